//! Continuous batching over the static pools: every step mixes one decode token for each running
//! sequence that has finished its prompt with prefill chunks of the others, within
//! `max_batch_tokens`. Long prompts are split across steps; waiting sequences are admitted first come,
//! first served. When KV pages run out the newest running sequence is preempted by recompute: it
//! gives back its pages and slot, keeps its tokens (prompt + generated so far) and re-enters the
//! front of the queue, so it later continues exactly where it was. No GPU, no clock, no async:
//! tests drive it as a simulation.
//!
//! With speculative decoding ([`Scheduler::with_speculation`]) a decoding sequence's chunk carries up
//! to K drafts (never more than its remaining `max_tokens` allow): the step costs `1 + drafts` tokens
//! of the budget and pages for all those positions are reserved. [`Scheduler::commit`] counts only the
//! chunk's token as cached; the engine then reports the accepted drafts with
//! [`Scheduler::accept_drafts`], which also gives back the pages reserved for rejected positions.

use std::collections::{HashMap, VecDeque};

use deltaserve_backend::{CacheOp, SeqChunk, StepBatch};

use crate::pools::{PagePool, SlotPool};
use crate::prefix::{MediaSpan, PrefixCache, PrefixCacheConfig, PrefixStats, cache_key};

mod snapshots;

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
    /// Prefix cache of KV pages + DeltaNet state snapshots (disabled with 0 device slots).
    pub prefix_cache: PrefixCacheConfig,
    /// During long prefills, also snapshot every this many tokens (0: never).
    pub snapshot_interval: usize,
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
    #[error("sequence id {0} is not running with its whole prompt cached")]
    NotForkable(SeqId),
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
    /// Positions (ascending) where the state should be snapshotted for the prefix cache.
    snapshot_points: Vec<usize>,
    snapshot_on_finish: bool,
    /// Never draft for it (its tokens are picked under a grammar, one at a time).
    no_drafts: bool,
    /// Prompt tokens restored from the prefix cache at first admission.
    cached_prefix: Option<usize>,
    /// The prompt's media spans (keyed by content in the prefix cache).
    media: Vec<MediaSpan>,
    /// Its prompt chunks want every row's logits ([`SeqOptions::prompt_logits`]).
    prompt_logits: bool,
}

/// Per-sequence options of [`Scheduler::add_with`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SeqOptions {
    /// Prompt positions where agent traffic will reuse the state: message starts, the end of the
    /// prompt before the generation prompt. Chunks are cut there and the state is snapshotted.
    pub snapshot_points: Vec<usize>,
    /// Snapshot the state after the last fed token when the sequence finishes (the next request of
    /// an agent loop re-renders the whole turn).
    pub snapshot_on_finish: bool,
    /// Never give it drafts under speculative decoding (a constrained reply picks one token a step).
    pub no_drafts: bool,
    /// The prompt's media (images): their placeholder tokens are keyed by content in the prefix cache.
    pub media: Vec<MediaSpan>,
    /// Every prompt position's logits come back (prompt log-probabilities): its prompt runs from the
    /// start (no prefix-cache hit) in chunks that want every row's logits, as many rows a step as the
    /// backend returns ([`Scheduler::with_logits_rows`]).
    pub prompt_logits: bool,
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

impl StepPlan {
    /// True when the step does nothing at all.
    pub fn is_empty(&self) -> bool {
        self.batch.seqs.is_empty() && self.batch.pre.is_empty() && self.batch.post.is_empty()
    }
}

/// Counters for metrics and tests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SchedStats {
    pub waiting: usize,
    /// Tokens the waiting requests still have to compute (their prompts, less any restored state).
    pub waiting_tokens: usize,
    pub running: usize,
    pub pages_in_use: usize,
    pub pages_total: usize,
    pub slots_in_use: usize,
    pub slots_total: usize,
    /// Tokens per KV page.
    pub page_size: usize,
    pub preemptions: u64,
    /// Sequences forked from another's cache (several choices of one prompt).
    pub forks: u64,
    pub prefix: PrefixStats,
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
    if prompt_len.saturating_add(max_tokens - 1) > cfg.max_context {
        return Err(AdmitError::ContextTooLong {
            prompt: prompt_len,
            max_tokens,
            needed: prompt_len.saturating_add(max_tokens),
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
    forks: u64,
    prefix: PrefixCache,
    /// Cache ops queued by [`Scheduler::finish`], run at the start of the next step.
    pending_pre: Vec<CacheOp>,
    /// Most drafts per decode chunk (0: no speculative decoding).
    spec_tokens: usize,
    /// How many snapshots the backend takes inside the chunks of one step ([`SeqChunk::save_within`]):
    /// chunks run past that many snapshot points instead of ending there (0: they end at each).
    within_limit: usize,
    /// What is left of `within_limit` in the step being planned.
    within_room: usize,
    /// The most logits rows one step returns ([`SeqChunk::logits_rows`], all chunks together).
    logits_rows: usize,
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
        assert_eq!(cfg.prefix_cache.page_size, cfg.page_size, "prefix cache and KV pages share the page size");
        Self {
            prefix: PrefixCache::new(cfg.prefix_cache),
            pages: PagePool::new(cfg.num_pages, cfg.page_size),
            slots: SlotPool::new(cfg.max_seqs),
            cfg,
            seqs: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            next_arrival: 0,
            preemptions: 0,
            forks: 0,
            pending_pre: Vec::new(),
            spec_tokens: 0,
            within_limit: 0,
            within_room: 0,
            logits_rows: usize::MAX,
        }
    }

    /// Speculative decoding: decode chunks carry up to `k` drafts.
    pub fn with_speculation(mut self, k: usize) -> Self {
        self.spec_tokens = k;
        self
    }

    /// Snapshots inside chunks (a backend with `Capabilities::snapshots_within_chunks`, up to `limit`
    /// a step): a prompt's chunk runs past its snapshot points and takes their snapshots inside it, so
    /// a turn's new tokens run in as few steps as the token budget allows.
    pub fn with_snapshots_within_chunks(mut self, limit: usize) -> Self {
        self.within_limit = limit;
        self
    }

    /// The backend returns at most `rows` logits rows a step (`Capabilities::max_logits_rows`): chunks
    /// that want every row's logits are cut to fit.
    pub fn with_logits_rows(mut self, rows: usize) -> Self {
        self.logits_rows = rows;
        self
    }

    /// Most drafts per decode chunk (0: speculation off).
    pub fn speculative_tokens(&self) -> usize {
        self.spec_tokens
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
        self.add_with(id, prompt, max_tokens, SeqOptions::default())
    }

    /// Queues a new sequence with prefix-cache options.
    pub fn add_with(
        &mut self,
        id: SeqId,
        prompt: Vec<u32>,
        max_tokens: usize,
        opts: SeqOptions,
    ) -> Result<(), AdmitError> {
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
        let mut points: Vec<usize> = opts.snapshot_points.into_iter().filter(|&p| p > 0 && p < prompt_len).collect();
        if self.cfg.snapshot_interval > 0 {
            points.extend((1..).map(|k| k * self.cfg.snapshot_interval).take_while(|&p| p < prompt_len));
        }
        points.sort_unstable();
        points.dedup();
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
                snapshot_points: points,
                snapshot_on_finish: opts.snapshot_on_finish,
                no_drafts: opts.no_drafts,
                cached_prefix: None,
                media: opts.media,
                prompt_logits: opts.prompt_logits,
            },
        );
        self.waiting.push_back(id);
        Ok(())
    }

    /// Adds `child`, a copy of `parent` (running, every token of it cached: its prompt just ran and
    /// its first pick is not appended yet), for another choice of the same prompt. The child shares
    /// the parent's full KV pages (a reference each) and gets copies of its partly filled last page
    /// and of its state slot (cache ops run at the start of the next step, before any chunk). When
    /// no slot or page is free it waits at the front of the queue instead and recomputes its tokens
    /// when admitted, as a preempted sequence does. Returns true when it forked.
    pub fn fork(&mut self, parent: SeqId, child: SeqId, opts: SeqOptions) -> Result<bool, AdmitError> {
        if self.seqs.contains_key(&child) {
            return Err(AdmitError::DuplicateId(child));
        }
        let p = self.seqs.get(&parent).filter(|p| p.slot.is_some() && p.cached == p.tokens.len());
        let p = p.ok_or(AdmitError::NotForkable(parent))?;
        let mut seq = Sequence {
            cached: 0,
            slot: None,
            pages: Vec::new(),
            arrival: self.next_arrival,
            preemptions: 0,
            snapshot_points: Vec::new(),
            snapshot_on_finish: opts.snapshot_on_finish,
            no_drafts: opts.no_drafts,
            ..p.clone()
        };
        self.next_arrival += 1;
        let (ps, cached) = (self.cfg.page_size, p.cached);
        let (src_slot, shared, partial) = (p.slot, p.pages[..cached / ps].to_vec(), p.pages.get(cached / ps).copied());
        let partial = partial.filter(|_| cached % ps != 0);
        let slot = if self.running.len() < self.cfg.max_seqs { self.slots.take() } else { None };
        let own = match (slot, partial) {
            (None, _) => None,
            (Some(_), None) => Some(None),
            (Some(_), Some(_)) => self.take_page().map(Some),
        };
        match (slot, src_slot, own) {
            (Some(slot), Some(src), Some(own)) => {
                for &page in &shared {
                    self.pages.retain(page);
                }
                seq.pages = shared;
                self.pending_pre.push(CacheOp::CopyState { src, dst: slot });
                if let (Some(own), Some(src)) = (own, partial) {
                    let tokens = (cached % ps) as u32;
                    self.pending_pre.push(CacheOp::CopyPagePrefix { src, dst: own, tokens });
                    seq.pages.push(own);
                }
                seq.slot = Some(slot);
                seq.cached = cached;
                self.seqs.insert(child, seq);
                self.running.push(child);
                self.forks += 1;
                Ok(true)
            }
            _ => {
                if let Some(slot) = slot {
                    self.slots.give_back(slot);
                }
                self.seqs.insert(child, seq);
                self.waiting.push_front(child);
                Ok(false)
            }
        }
    }

    /// One free page, evicting cached prefixes when none is free.
    fn take_page(&mut self) -> Option<u32> {
        loop {
            if let Some(p) = self.pages.take(1) {
                return Some(p[0]);
            }
            self.pages.give_back(self.prefix.evict_one()?);
        }
    }

    /// Plans the next step. The caller runs `plan.batch`, then calls [`Scheduler::commit`].
    pub fn schedule(&mut self) -> StepPlan {
        let mut plan = StepPlan::default();
        plan.batch.pre = std::mem::take(&mut self.pending_pre);
        let mut budget = self.cfg.max_batch_tokens;
        self.within_room = self.within_limit;
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
            let n = self.chunk_len(id, budget);
            let draft = self.drafts(id, budget - n);
            let cached = self.seqs[&id].cached;
            if self.reserve_pages(id, cached + n + draft, &mut plan, &mut budget) {
                budget -= n + draft;
                let mut c = self.chunk(id, n);
                c.draft = draft;
                self.take_within_room(&c);
                plan.batch.seqs.push(c);
            }
        }
        // Admit waiting sequences while there is room, resuming from the prefix cache when possible.
        while budget > 0 && self.running.len() < self.cfg.max_seqs && self.slots.num_free() > 0 {
            let Some(&id) = self.waiting.front() else { break };
            if !self.admit(id, budget, &mut plan) {
                break;
            }
            let n = self.chunk_len(id, budget);
            let cached = self.seqs[&id].cached;
            if !self.reserve_pages(id, cached + n, &mut plan, &mut budget) {
                break;
            }
            budget -= n;
            plan.admitted.push(id);
            let c = self.chunk(id, n);
            self.take_within_room(&c);
            plan.batch.seqs.push(c);
        }
        self.fit_logits_rows(&mut plan);
        self.place_snapshots(&mut plan);
        plan
    }

    /// Shortens the chunks that want every row's logits, the last first, until the step's logits rows
    /// fit the backend's (each keeps one token: every chunk of a step fits in one row each).
    fn fit_logits_rows(&self, plan: &mut StepPlan) {
        let rows: usize = plan.batch.seqs.iter().map(SeqChunk::logits_rows).sum();
        let mut excess = rows.saturating_sub(self.logits_rows);
        for c in plan.batch.seqs.iter_mut().rev().filter(|c| c.all_logits) {
            if excess == 0 {
                break;
            }
            let cut = excess.min(c.tokens.len() - 1);
            c.tokens.truncate(c.tokens.len() - cut);
            c.want_logits = c.start + c.tokens.len() == self.seqs[&c.seq_id].tokens.len();
            excess -= cut;
        }
    }

    /// The step after `prev` (committed, its picks not appended yet), planned before those picks are
    /// known: each sequence of `prev` decodes its pending pick at the next position (a placeholder
    /// token; the backend feeds the pick). Sequences whose pick is their last by length are left out.
    /// None, and nothing changed, unless that is the whole next step: a step with nothing to admit,
    /// no speculation, every running sequence in `prev` waiting for its pick, and the pages at hand
    /// (no eviction, no preemption). Queued cache work (end-of-request snapshots) runs before it.
    pub fn schedule_ahead(&mut self, prev: &StepPlan) -> Option<StepPlan> {
        let admissible = self.running.len() < self.cfg.max_seqs && self.slots.num_free() > 0;
        if self.spec_tokens > 0 || (!self.waiting.is_empty() && admissible) {
            return None;
        }
        let in_prev = |id: &SeqId| prev.batch.seqs.iter().any(|c| c.seq_id == *id && c.want_logits);
        let waiting_pick = |s: &Sequence| s.cached == s.tokens.len();
        if self.running.iter().any(|id| !in_prev(id) || !waiting_pick(&self.seqs[id])) {
            return None;
        }
        let mut plan = StepPlan::default();
        let mut taken: Vec<(SeqId, usize)> = Vec::new();
        for c in prev.batch.seqs.iter().filter(|c| self.running.contains(&c.seq_id)) {
            let s = &self.seqs[&c.seq_id];
            if s.generated() + 1 >= s.max_tokens {
                continue;
            }
            let need = self.pages.pages_for(s.cached + 1).saturating_sub(s.pages.len());
            let Some(pages) = self.pages.take(need) else {
                for (id, n) in taken {
                    let s = self.seqs.get_mut(&id).expect("running");
                    let back = s.pages.split_off(s.pages.len() - n);
                    self.pages.give_back(back);
                }
                return None;
            };
            let s = self.seqs.get_mut(&c.seq_id).expect("running");
            s.pages.extend(pages);
            taken.push((c.seq_id, need));
            plan.batch.seqs.push(SeqChunk {
                seq_id: c.seq_id,
                slot: s.slot.expect("running sequences hold a slot"),
                pages: s.pages.clone(),
                start: s.cached,
                tokens: vec![0],
                want_logits: true,
                all_logits: false,
                draft: 0,
                greedy_draft_vocab: 0,
                rope_delta: 0,
                images: Vec::new(),
                save_within: Vec::new(),
            });
        }
        if plan.batch.seqs.is_empty() {
            return None;
        }
        plan.batch.pre = std::mem::take(&mut self.pending_pre);
        Some(plan)
    }

    /// Drafts for `id`'s chunk this step: 0 unless it is decoding; at most K, what `spare` budget
    /// allows, and one less than the tokens it may still emit (a step emits up to `1 + drafts`).
    fn drafts(&self, id: SeqId, spare: usize) -> usize {
        let s = &self.seqs[&id];
        if self.spec_tokens == 0 || s.no_drafts || s.in_prefill() || s.tokens.len() == s.cached {
            return 0;
        }
        let remaining = s.max_tokens.saturating_sub(s.generated());
        self.spec_tokens.min(remaining.saturating_sub(1)).min(spare)
    }

    /// Tokens of `id` to run now: up to the budget and the first snapshot point past those the step
    /// may still take inside its chunks.
    fn chunk_len(&self, id: SeqId, budget: usize) -> usize {
        let s = &self.seqs[&id];
        let mut ahead = s.snapshot_points.iter().filter(|&&p| p > s.cached);
        let next_point = ahead.nth(self.within_room).copied().unwrap_or(usize::MAX);
        (s.tokens.len() - s.cached).min(budget).min(next_point - s.cached)
    }

    /// Moves the head of the queue to running: a slot, and the longest cached prefix if any.
    /// Returns false (leaving it queued) when its first chunk's pages cannot be found, even after
    /// evicting cached prefixes.
    fn admit(&mut self, id: SeqId, budget: usize, plan: &mut StepPlan) -> bool {
        let ps = self.cfg.page_size;
        let max_prefix = self.seqs[&id].tokens.len() - 1; // the last token must run to give logits
        let hit = if self.prefix.enabled() && !self.seqs[&id].prompt_logits {
            let s = &self.seqs[&id];
            self.prefix.lookup(&cache_key(&s.tokens, &s.media), max_prefix)
        } else {
            None
        };
        let start = hit.as_ref().map_or(0, |h| h.len);
        // Hold the hit's pages first, so that evictions below cannot free them.
        let held: Vec<u32> = hit.as_ref().map_or(Vec::new(), |h| h.pages.clone());
        for &p in &held {
            self.pages.retain(p);
        }
        let first = (self.seqs[&id].tokens.len() - start).min(budget);
        let need = self.pages.pages_for(start + first) - start / ps;
        while self.pages.num_free() < need {
            match self.prefix.evict_one() {
                Some(released) => self.pages.give_back(released),
                None => {
                    self.pages.give_back(held);
                    return false;
                }
            }
        }
        self.waiting.pop_front();
        let slot = self.slots.take().expect("checked by the caller");
        let mut pages: Vec<u32> = held[..start / ps].to_vec();
        if let Some(h) = &hit {
            plan.batch.pre.push(CacheOp::RestoreState { from: h.loc, slot });
            if start % ps != 0 {
                // The partly filled last page is copied: this sequence will append to it.
                let own = self.pages.take(1).expect("counted in `need`")[0];
                let src = held[start / ps];
                plan.batch.pre.push(CacheOp::CopyPagePrefix { src, dst: own, tokens: (start % ps) as u32 });
                self.pages.give_back([src]);
                pages.push(own);
            }
        }
        let s = self.seqs.get_mut(&id).expect("waiting ids exist");
        s.slot = Some(slot);
        s.pages = pages;
        s.cached = start;
        s.cached_prefix.get_or_insert(start);
        self.running.push(id);
        true
    }

    /// Makes `id` hold pages for `positions`, preempting newer sequences if needed. Returns false
    /// (and preempts `id` itself) when even that is not enough.
    /// A victim that already has a chunk in `plan` loses it (its tokens go back to `budget`).
    fn reserve_pages(&mut self, id: SeqId, positions: usize, plan: &mut StepPlan, budget: &mut usize) -> bool {
        loop {
            let need = self.pages.pages_for(positions).saturating_sub(self.seqs[&id].pages.len());
            if need == 0 {
                return true;
            }
            if let Some(pages) = self.pages.take(need) {
                self.seqs.get_mut(&id).expect("running").pages.extend(pages);
                return true;
            }
            // Cached prefixes give way before running sequences do.
            if let Some(released) = self.prefix.evict_one() {
                self.pages.give_back(released);
                continue;
            }
            // Victim: the newest running sequence (possibly `id` itself, which may still be waiting).
            let Some(victim) = self.running.iter().copied().max_by_key(|v| self.seqs[v].arrival) else { return false };
            if !self.running.contains(&id) && self.seqs[&victim].arrival < self.seqs[&id].arrival {
                return false; // a newcomer never preempts older sequences
            }
            self.preempt(victim);
            plan.preempted.push(victim);
            plan.admitted.retain(|a| *a != victim);
            if let Some(i) = plan.batch.seqs.iter().position(|c| c.seq_id == victim) {
                *budget += plan.batch.seqs.remove(i).positions();
            }
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
            all_logits: s.prompt_logits && s.cached < s.prompt_len,
            draft: 0,
            greedy_draft_vocab: 0,
            rope_delta: 0,
            images: Vec::new(),
            save_within: Vec::new(),
        }
    }

    /// Records that `plan.batch` ran: its tokens are now cached (of a speculative chunk, its token;
    /// the engine adds the accepted drafts with [`Scheduler::accept_drafts`]).
    pub fn commit(&mut self, plan: &StepPlan) {
        for c in &plan.batch.seqs {
            if let Some(s) = self.seqs.get_mut(&c.seq_id) {
                s.cached = c.start + c.tokens.len();
            }
        }
    }

    /// After a speculative chunk of `id` was committed: `accepted` of its drafts were kept (they are
    /// cached now, and must already be appended as tokens), and the pages reserved beyond the cached
    /// positions are given back.
    pub fn accept_drafts(&mut self, id: SeqId, accepted: usize) {
        let Some(s) = self.seqs.get_mut(&id) else { return };
        if s.slot.is_none() {
            return;
        }
        s.cached = (s.cached + accepted).min(s.tokens.len());
        let keep = s.cached.div_ceil(self.cfg.page_size);
        if s.pages.len() > keep {
            let extra = s.pages.split_off(keep);
            self.pages.give_back(extra);
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

    /// Ends a sequence normally: snapshots its final state first when it asked for that (the save
    /// runs at the start of the next step, before anything can reuse its slot), then frees it.
    pub fn finish(&mut self, id: SeqId) {
        let Some(s) = self.seqs.get(&id) else { return };
        if s.snapshot_on_finish && s.slot.is_some() && s.cached > 0 {
            let mut ops = std::mem::take(&mut self.pending_pre);
            self.snapshot(id, s.cached, &mut ops);
            self.pending_pre = ops;
        }
        self.remove(id);
    }

    /// Prompt tokens restored from the prefix cache when `id` was first admitted.
    pub fn cached_prefix(&self, id: SeqId) -> usize {
        self.seqs.get(&id).and_then(|s| s.cached_prefix).unwrap_or(0)
    }

    /// Drops every cached prefix (after a failed step, whose snapshots may not have been written).
    pub fn clear_prefix_cache(&mut self) {
        let released = self.prefix.clear();
        self.pages.give_back(released);
        self.pending_pre.clear();
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

    /// Nothing to run (no sequences, no queued cache work).
    pub fn is_idle(&self) -> bool {
        self.seqs.is_empty() && self.pending_pre.is_empty()
    }

    /// Tokens (prompt + generated) of a sequence.
    pub fn tokens(&self, id: SeqId) -> Option<&[u32]> {
        self.seqs.get(&id).map(|s| s.tokens.as_slice())
    }

    pub fn stats(&self) -> SchedStats {
        SchedStats {
            waiting: self.waiting.len(),
            waiting_tokens: self
                .waiting
                .iter()
                .filter_map(|id| self.seqs.get(id))
                .map(|s| s.tokens.len() - s.cached)
                .sum(),
            running: self.running.len(),
            pages_in_use: self.pages.capacity() - self.pages.num_free(),
            pages_total: self.pages.capacity(),
            slots_in_use: self.slots.capacity() - self.slots.num_free(),
            slots_total: self.slots.capacity(),
            page_size: self.cfg.page_size,
            preemptions: self.preemptions,
            forks: self.forks,
            prefix: self.prefix.stats(),
        }
    }

    /// Panics if any invariant is broken (tests call this after every step).
    pub fn assert_consistent(&self) {
        let held: usize = self.seqs.values().map(|s| s.pages.len()).sum();
        self.pages.assert_consistent(held + self.prefix.page_refs());
        self.prefix.assert_consistent();
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
