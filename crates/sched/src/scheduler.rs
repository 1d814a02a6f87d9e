//! Continuous batching over the static pools: every step mixes one decode token for each running
//! sequence that has finished its prompt with prefill chunks of the others, within
//! `max_batch_tokens`. Long prompts are split across steps; waiting sequences are admitted first come,
//! first served. When KV pages run out the newest running sequence is preempted by recompute: it
//! gives back its pages and slot, keeps its tokens (prompt + generated so far) and re-enters the
//! front of the queue, so it later continues exactly where it was. No GPU, no clock, no async:
//! tests drive it as a simulation.

use std::collections::{HashMap, VecDeque};

use deltaserve_backend::{SeqChunk, StepBatch};

use crate::pools::{PagePool, SlotPool};

pub type SeqId = u64;

/// Capacities and limits, from the static memory plan.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SchedConfig {
    pub max_batch_tokens: usize,
    pub max_seqs: usize,
    pub page_size: usize,
    pub num_pages: usize,
    /// The most positions one sequence may hold in the KV cache.
    pub max_context: usize,
    /// Requests that may wait for admission; more are refused as overloaded.
    pub max_waiting: usize,
}

/// Why a request is refused at submission.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum AdmitError {
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("max_tokens must be at least 1")]
    ZeroMaxTokens,
    #[error(
        "this model's maximum context length is {max_context} tokens; the request needs {needed} \
         ({prompt} in the prompt + {max_tokens} to generate, the last generated token needs no cache slot)"
    )]
    ContextTooLong { prompt: usize, max_tokens: usize, needed: usize, max_context: usize },
    #[error("the server is overloaded: {waiting} requests are already waiting (limit {limit}); retry later")]
    Overloaded { waiting: usize, limit: usize },
    #[error("sequence id {0} is already in use")]
    DuplicateId(SeqId),
}

/// A sequence's bookkeeping.
#[derive(Clone, Debug)]
struct Sequence {
    /// Prompt followed by every generated token.
    tokens: Vec<u32>,
    prompt_len: usize,
    max_tokens: usize,
    /// Tokens whose KV and DeltaNet state are in the sequence's pages and slot.
    cached: usize,
    slot: Option<u32>,
    pages: Vec<u32>,
    /// Submission order (FCFS and preemption victim choice).
    arrival: u64,
    preemptions: u32,
}

impl Sequence {
    fn generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }
    fn in_prefill(&self) -> bool {
        self.tokens.len() - self.cached > 1
    }
}

/// What one step does, and what changed in the queue to make room for it.
#[derive(Clone, Debug, Default)]
pub struct StepPlan {
    pub batch: StepBatch,
    /// Sequences preempted (by recompute) during this schedule.
    pub preempted: Vec<SeqId>,
    /// Sequences admitted from the waiting queue during this schedule.
    pub admitted: Vec<SeqId>,
}

/// Counters for metrics and tests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SchedStats {
    pub waiting: usize,
    pub running: usize,
    pub pages_in_use: usize,
    pub pages_total: usize,
    pub slots_in_use: usize,
    pub slots_total: usize,
    pub preemptions: u64,
}

/// Checks a request's lengths against the limits: before any work, as a pure function.
pub fn check_request(cfg: &SchedConfig, prompt_len: usize, max_tokens: usize) -> Result<(), AdmitError> {
    if prompt_len == 0 {
        return Err(AdmitError::EmptyPrompt);
    }
    if max_tokens == 0 {
        return Err(AdmitError::ZeroMaxTokens);
    }
    // The last generated token is returned but never fed back, so it needs no cache position.
    if prompt_len + max_tokens - 1 > cfg.max_context {
        return Err(AdmitError::ContextTooLong {
            prompt: prompt_len,
            max_tokens,
            needed: prompt_len + max_tokens,
            max_context: cfg.max_context,
        });
    }
    Ok(())
}

pub struct Scheduler {
    cfg: SchedConfig,
    pages: PagePool,
    slots: SlotPool,
    seqs: HashMap<SeqId, Sequence>,
    waiting: VecDeque<SeqId>,
    /// Admitted sequences, oldest first.
    running: Vec<SeqId>,
    next_arrival: u64,
    preemptions: u64,
}

impl Scheduler {
    pub fn new(cfg: SchedConfig) -> Self {
        assert!(cfg.max_batch_tokens > 0 && cfg.max_seqs > 0, "max_batch_tokens and max_seqs must be > 0");
        assert!(
            cfg.num_pages >= cfg.max_context.div_ceil(cfg.page_size),
            "the plan must hold one sequence at max_context ({} tokens) in {} pages of {}",
            cfg.max_context,
            cfg.num_pages,
            cfg.page_size
        );
        Self {
            pages: PagePool::new(cfg.num_pages, cfg.page_size),
            slots: SlotPool::new(cfg.max_seqs),
            cfg,
            seqs: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            next_arrival: 0,
            preemptions: 0,
        }
    }

    pub fn config(&self) -> &SchedConfig {
        &self.cfg
    }

    /// Checks a request against the limits without queueing it.
    pub fn check(&self, prompt_len: usize, max_tokens: usize) -> Result<(), AdmitError> {
        check_request(&self.cfg, prompt_len, max_tokens)
    }

    /// Queues a new sequence.
    pub fn add(&mut self, id: SeqId, prompt: Vec<u32>, max_tokens: usize) -> Result<(), AdmitError> {
        self.check(prompt.len(), max_tokens)?;
        if self.seqs.contains_key(&id) {
            return Err(AdmitError::DuplicateId(id));
        }
        if self.waiting.len() >= self.cfg.max_waiting {
            return Err(AdmitError::Overloaded { waiting: self.waiting.len(), limit: self.cfg.max_waiting });
        }
        let arrival = self.next_arrival;
        self.next_arrival += 1;
        let prompt_len = prompt.len();
        self.seqs.insert(
            id,
            Sequence {
                tokens: prompt,
                prompt_len,
                max_tokens,
                cached: 0,
                slot: None,
                pages: Vec::new(),
                arrival,
                preemptions: 0,
            },
        );
        self.waiting.push_back(id);
        Ok(())
    }

    /// Plans the next step. The caller runs `plan.batch`, then calls [`Scheduler::commit`].
    pub fn schedule(&mut self) -> StepPlan {
        let mut plan = StepPlan::default();
        let mut budget = self.cfg.max_batch_tokens;
        // Decodes first (one token each, lowest latency), then prompts, each group oldest first.
        let mut order: Vec<SeqId> = self.running.clone();
        order.sort_by_key(|id| {
            let s = &self.seqs[id];
            (s.in_prefill(), s.arrival)
        });
        for id in order {
            if budget == 0 {
                break;
            }
            if !self.running.contains(&id) {
                continue; // preempted while making room for an older sequence
            }
            let (cached, total) = {
                let s = &self.seqs[&id];
                (s.cached, s.tokens.len())
            };
            let n = (total - cached).min(budget);
            if self.reserve_pages(id, cached + n, &mut plan.preempted) {
                budget -= n;
                plan.batch.seqs.push(self.chunk(id, n));
            }
        }
        // Admit waiting sequences while there is room.
        while budget > 0 && self.running.len() < self.cfg.max_seqs {
            let Some(&id) = self.waiting.front() else { break };
            let n = self.seqs[&id].tokens.len().min(budget);
            let need = self.pages.pages_for(n);
            if self.pages.num_free() < need || self.slots.num_free() == 0 {
                break;
            }
            self.waiting.pop_front();
            let slot = self.slots.take().expect("checked above");
            let pages = self.pages.take(need).expect("checked above");
            let s = self.seqs.get_mut(&id).expect("waiting ids exist");
            s.slot = Some(slot);
            s.pages = pages;
            self.running.push(id);
            plan.admitted.push(id);
            budget -= n;
            plan.batch.seqs.push(self.chunk(id, n));
        }
        plan
    }

    /// Makes `id` hold pages for `positions`, preempting newer sequences if needed. Returns false
    /// (and preempts `id` itself) when even that is not enough.
    fn reserve_pages(&mut self, id: SeqId, positions: usize, preempted: &mut Vec<SeqId>) -> bool {
        loop {
            let need = self.pages.pages_for(positions).saturating_sub(self.seqs[&id].pages.len());
            if need == 0 {
                return true;
            }
            if let Some(pages) = self.pages.take(need) {
                self.seqs.get_mut(&id).expect("running").pages.extend(pages);
                return true;
            }
            // Victim: the newest running sequence (possibly `id` itself).
            let victim = *self.running.iter().max_by_key(|v| self.seqs[v].arrival).expect("id is running");
            self.preempt(victim);
            preempted.push(victim);
            if victim == id {
                return false;
            }
        }
    }

    fn preempt(&mut self, id: SeqId) {
        self.release(id);
        let s = self.seqs.get_mut(&id).expect("exists");
        s.cached = 0;
        s.preemptions += 1;
        self.preemptions += 1;
        self.waiting.push_front(id);
    }

    /// Returns a running sequence's pages and slot.
    fn release(&mut self, id: SeqId) {
        self.running.retain(|r| *r != id);
        let s = self.seqs.get_mut(&id).expect("exists");
        let pages = std::mem::take(&mut s.pages);
        let slot = s.slot.take();
        self.pages.give_back(pages);
        if let Some(slot) = slot {
            self.slots.give_back(slot);
        }
    }

    fn chunk(&self, id: SeqId, n: usize) -> SeqChunk {
        let s = &self.seqs[&id];
        SeqChunk {
            seq_id: id,
            slot: s.slot.expect("running sequences hold a slot"),
            pages: s.pages.clone(),
            start: s.cached,
            tokens: s.tokens[s.cached..s.cached + n].to_vec(),
            want_logits: s.cached + n == s.tokens.len(),
        }
    }

    /// Records that `plan.batch` ran: its tokens are now cached.
    pub fn commit(&mut self, plan: &StepPlan) {
        for c in &plan.batch.seqs {
            if let Some(s) = self.seqs.get_mut(&c.seq_id) {
                s.cached = c.start + c.tokens.len();
            }
        }
    }

    /// Appends a sampled token to a sequence. Returns true when the sequence reached `max_tokens`.
    pub fn append_token(&mut self, id: SeqId, token: u32) -> bool {
        match self.seqs.get_mut(&id) {
            Some(s) => {
                s.tokens.push(token);
                s.generated() >= s.max_tokens
            }
            None => false,
        }
    }

    /// Removes a sequence (finished or cancelled) and frees everything it holds at once.
    pub fn remove(&mut self, id: SeqId) -> bool {
        if !self.seqs.contains_key(&id) {
            return false;
        }
        self.release(id);
        self.waiting.retain(|w| *w != id);
        self.seqs.remove(&id);
        true
    }

    pub fn contains(&self, id: SeqId) -> bool {
        self.seqs.contains_key(&id)
    }

    pub fn is_idle(&self) -> bool {
        self.seqs.is_empty()
    }

    /// Tokens (prompt + generated) of a sequence.
    pub fn tokens(&self, id: SeqId) -> Option<&[u32]> {
        self.seqs.get(&id).map(|s| s.tokens.as_slice())
    }

    pub fn stats(&self) -> SchedStats {
        SchedStats {
            waiting: self.waiting.len(),
            running: self.running.len(),
            pages_in_use: self.pages.capacity() - self.pages.num_free(),
            pages_total: self.pages.capacity(),
            slots_in_use: self.slots.capacity() - self.slots.num_free(),
            slots_total: self.slots.capacity(),
            preemptions: self.preemptions,
        }
    }

    /// Panics if any invariant is broken (tests call this after every step).
    pub fn assert_consistent(&self) {
        let held: usize = self.seqs.values().map(|s| s.pages.len()).sum();
        self.pages.assert_consistent(held);
        assert_eq!(self.slots.num_free() + self.running.len(), self.slots.capacity(), "slots");
        assert_eq!(self.running.len() + self.waiting.len(), self.seqs.len(), "every sequence is running or waiting");
        assert!(self.running.len() <= self.cfg.max_seqs);
        for (id, s) in &self.seqs {
            let running = self.running.contains(id);
            assert_eq!(running, s.slot.is_some(), "seq {id}: slot iff running");
            if running {
                assert!(s.pages.len() >= self.pages.pages_for(s.cached), "seq {id}: pages cover the cache");
            } else {
                assert!(s.pages.is_empty() && s.cached == 0, "seq {id}: waiting sequences hold nothing");
            }
            assert!(s.tokens.len() - s.prompt_len <= s.max_tokens);
        }
    }
}
