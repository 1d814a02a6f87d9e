//! The engine: one thread owns the backend and runs the step loop (schedule → backend step →
//! sample → commit), driven through a small async-friendly API. [`EngineHandle::submit`] validates a
//! request, queues it and returns a [`RequestStream`] of [`Event`]s; dropping the stream cancels the
//! request and frees its pages and slot at the next step. Nothing the engine thread does blocks on a
//! client: events go through unbounded channels, commands through a channel the thread drains.
//!
//! Look-ahead ([`EngineOptions::lookahead`], on by default): a decode step is launched before the
//! previous one's tokens are read, fed them on the device (`engine/ahead.rs`).
//!
//! Speculative decoding ([`EngineHandle::start_speculative`]): a decoding sequence's step drafts up to
//! K tokens with the model's MTP head, verifies them in one forward and emits 1..=K+1 tokens. Greedy
//! requests keep the longest prefix of drafts equal to what the target picks (so their outputs are
//! those of plain decoding, token for token); sampling requests use rejection sampling (accept draft
//! `d` with probability `min(1, p(d)/q(d))`, else draw from `max(0, p − q)`), which preserves the target
//! distribution `p` (the sampler's, penalties and cuts included); `q` is the head's softmax at the
//! request's temperature. Emission stops at a stop token, stop string or `max_tokens` like plain
//! decoding, and only the emitted positions are committed to the sequence's state.
//!
//! Constrained requests (a [`TokenConstraint`]: structured outputs): without speculation their rows
//! carry the constraint's token bitmask in their [`RowSampling`] and the backend picks them where the
//! logits are, with the other rows of the step ([`deltaserve_backend::Capabilities::masks_tokens`];
//! otherwise their steps sample on the host). With speculation they draft like any request when the
//! constraint checks drafts ([`TokenConstraint::allows_prefix`]): at verify the drafts are checked in
//! order, the first one refused ends acceptance, and every verified row is masked before its pick, so
//! no refused token is emitted and greedy outputs are those of plain decoding. Where the step allows
//! it, their masks are computed on CPU threads while the backend runs (`engine/masks.rs`); their
//! decode steps run ahead with their picks left until the masks are known (`engine/ahead.rs`).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::thread::JoinHandle;
use std::time::Instant;

use deltaserve_backend::sampling::mask_words;
use deltaserve_backend::{Backend, Pick, RowSampling, SeqChunk, SpecCommit, StepOut, Want};
use deltaserve_sched::{AdmitError, SchedConfig, Scheduler, SeqId, SeqOptions, check_request};
use deltaserve_text::Tokenizer;
use tokio::sync::mpsc as tmpsc;

mod ahead;
mod choices;
mod emit;
pub(crate) mod images;
mod live;
mod masks;
mod prompt;
mod rows;
mod types;
mod verify;

use ahead::Launched;
use choices::Choice;
use images::ImageRules;
use live::Live;
use rows::token_logprob;
pub use types::{
    EngineError, EngineStats, Event, FinishReason, Request, SharedConstraint, Timing, TokenConstraint, TokenLogprob,
    Usage,
};

enum Command {
    Submit { id: SeqId, req: Box<Request>, tx: tmpsc::UnboundedSender<Event>, submitted: Instant, forks: Vec<Choice> },
    Cancel(SeqId),
    Shutdown { drain: bool },
}

struct Shared {
    stats: Mutex<EngineStats>,
    /// Submitted but not yet admitted (bounded by the scheduler's `max_waiting`).
    queued: AtomicUsize,
    next_id: AtomicU64,
}

struct Inner {
    cmd: Mutex<mpsc::Sender<Command>>,
    shared: Arc<Shared>,
    thread: Mutex<Option<JoinHandle<()>>>,
    sched_cfg: SchedConfig,
    vocab: usize,
    /// What images the engine takes (how prompts hold them, when the backend runs them; their bound).
    images: ImageRules,
    /// The backend returns every prompt row's logits ([`Request::prompt_logprobs`]).
    prompt_logits: bool,
}

/// Why a request for its prompt's log-probabilities is refused where the backend does not return them.
pub const NO_PROMPT_LOGPROBS: &str = "prompt log-probabilities are not available on this backend (a CUDA backend \
                                      returns them without speculative decoding or tensor parallelism)";

/// Cheap-to-clone handle to a running engine.
#[derive(Clone)]
pub struct EngineHandle {
    inner: Arc<Inner>,
}

/// The events of one request; dropping it cancels the request.
pub struct RequestStream {
    pub id: SeqId,
    rx: tmpsc::UnboundedReceiver<Event>,
    cancel: Option<mpsc::Sender<Command>>,
}

impl RequestStream {
    /// The next event (None after the last one).
    pub async fn next(&mut self) -> Option<Event> {
        let e = self.rx.recv().await;
        if matches!(e, Some(Event::Finished { .. } | Event::Error(_)) | None) {
            self.cancel = None; // finished: nothing to cancel
        }
        e
    }
    /// Blocking variant for non-async callers (CLI, tests).
    pub fn blocking_next(&mut self) -> Option<Event> {
        let e = self.rx.blocking_recv();
        if matches!(e, Some(Event::Finished { .. } | Event::Error(_)) | None) {
            self.cancel = None;
        }
        e
    }
}

impl Drop for RequestStream {
    fn drop(&mut self) {
        if let Some(tx) = self.cancel.take() {
            let _ = tx.send(Command::Cancel(self.id));
        }
    }
}

/// How often the server logs the progress of a prompt still running (a long fill takes minutes).
const PROGRESS_LOG_EVERY: std::time::Duration = std::time::Duration::from_secs(10);

/// The most draft tokens per step `--speculative-tokens` accepts.
pub const MAX_SPECULATIVE_TOKENS: usize = 4;

/// Why a request with images is refused when the backend runs no vision tower.
pub const NO_VISION_TOWER: &str = "requests with images cannot run: the backend runs no vision tower for this model";

/// How the engine steps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EngineOptions {
    /// Drafts per decode step (0: no speculative decoding; else 1..=[`MAX_SPECULATIVE_TOKENS`]).
    pub speculative_tokens: usize,
    /// Launch each decode step before the previous one's tokens are read, where the backend can
    /// ([`deltaserve_backend::Capabilities::launches_ahead`]) and the requests allow it (see
    /// `engine/ahead.rs`).
    pub lookahead: bool,
    /// The most patches (vision-tower tokens) of one image: the bound the plan sized the tower's
    /// workspace for (`--max-image-tokens-per-step`); a request with a larger image is refused at
    /// submission. The tower runs one image at a time, so this bounds its activations in any step.
    pub max_image_tokens_per_step: usize,
}

impl Default for EngineOptions {
    fn default() -> Self {
        Self { speculative_tokens: 0, lookahead: true, max_image_tokens_per_step: usize::MAX }
    }
}

impl EngineHandle {
    /// Starts the engine thread over `backend`.
    pub fn start(backend: Box<dyn Backend>, sched_cfg: SchedConfig, tokenizer: Option<Arc<Tokenizer>>) -> Self {
        Self::spawn(backend, sched_cfg, tokenizer, EngineOptions::default())
    }

    /// Starts the engine with speculative decoding: `k` (1..=4) drafts per decode step. Errors when `k`
    /// is out of range or the backend cannot draft that many (no MTP head, or no support).
    pub fn start_speculative(
        backend: Box<dyn Backend>,
        sched_cfg: SchedConfig,
        tokenizer: Option<Arc<Tokenizer>>,
        k: usize,
    ) -> Result<Self, EngineError> {
        if k == 0 {
            return Err(EngineError::Invalid(format!(
                "speculative tokens must be 1..={MAX_SPECULATIVE_TOKENS}, got 0"
            )));
        }
        let opts = EngineOptions { speculative_tokens: k, ..EngineOptions::default() };
        Self::start_with(backend, sched_cfg, tokenizer, opts)
    }

    /// Starts the engine with `opts`. Errors when speculative decoding is asked for and the backend
    /// cannot draft that many tokens (no MTP head, or no support), or the count is out of range.
    pub fn start_with(
        backend: Box<dyn Backend>,
        sched_cfg: SchedConfig,
        tokenizer: Option<Arc<Tokenizer>>,
        opts: EngineOptions,
    ) -> Result<Self, EngineError> {
        let k = opts.speculative_tokens;
        if k == 0 {
            return Ok(Self::spawn(backend, sched_cfg, tokenizer, opts));
        }
        if !(1..=MAX_SPECULATIVE_TOKENS).contains(&k) {
            return Err(EngineError::Invalid(format!(
                "speculative tokens must be 1..={MAX_SPECULATIVE_TOKENS}, got {k}"
            )));
        }
        let caps = backend.capabilities();
        let most = caps.max_draft_tokens;
        if most < k {
            return Err(EngineError::Invalid(if most == 0 {
                format!("backend {} cannot draft tokens (no MTP head, or speculative decoding unsupported)", caps.name)
            } else {
                format!("backend {} drafts at most {most} tokens per step, {k} requested", caps.name)
            }));
        }
        Ok(Self::spawn(backend, sched_cfg, tokenizer, opts))
    }

    fn spawn(
        backend: Box<dyn Backend>,
        sched_cfg: SchedConfig,
        tokenizer: Option<Arc<Tokenizer>>,
        opts: EngineOptions,
    ) -> Self {
        let (tx, rx) = mpsc::channel();
        let shared = Arc::new(Shared {
            stats: Mutex::new(EngineStats::default()),
            queued: AtomicUsize::new(0),
            next_id: AtomicU64::new(1),
        });
        let caps = backend.capabilities();
        let vocab = caps.vocab_size;
        let images = ImageRules { tokens: backend.image_tokens(), max_patches: opts.max_image_tokens_per_step };
        if let Ok(mut st) = shared.stats.lock() {
            st.arena = backend.arena_stats();
        }
        let valid_vocab = tokenizer.as_ref().map_or(vocab, |t| t.vocab_size().min(vocab));
        let worker = Worker {
            sched: Scheduler::new(sched_cfg.clone())
                .with_speculation(opts.speculative_tokens)
                .with_snapshots_within_chunks(caps.snapshots_within_chunks)
                .with_logits_rows(caps.max_logits_rows),
            lookahead: opts.lookahead && caps.launches_ahead,
            masks_tokens: caps.masks_tokens,
            picks_after_launch: caps.picks_after_launch,
            ahead: None,
            collected: Instant::now(),
            backend,
            tokenizer,
            valid_vocab,
            reqs: HashMap::new(),
            shared: shared.clone(),
            rx,
            vocab,
            out: StepOut::default(),
            images,
        };
        let thread = std::thread::Builder::new()
            .name("deltaserve-engine".into())
            .spawn(move || worker.run())
            .expect("spawning the engine thread");
        Self {
            inner: Arc::new(Inner {
                cmd: Mutex::new(tx),
                shared,
                thread: Mutex::new(Some(thread)),
                sched_cfg,
                vocab,
                images,
                prompt_logits: caps.prompt_logits,
            }),
        }
    }

    pub fn sched_config(&self) -> &SchedConfig {
        &self.inner.sched_cfg
    }

    /// Whether requests may carry images (the loaded model has a vision tower the backend runs).
    pub fn runs_images(&self) -> bool {
        self.inner.images.tokens.is_some()
    }

    /// Whether requests may ask for their prompt's log-probabilities ([`Request::prompt_logprobs`]; else
    /// they are refused with [`NO_PROMPT_LOGPROBS`]).
    pub fn scores_prompts(&self) -> bool {
        self.inner.prompt_logits
    }

    /// Validates and queues a request.
    pub fn submit(&self, req: Request) -> Result<RequestStream, EngineError> {
        let mut streams = self.submit_n(req, 1)?;
        Ok(streams.remove(0))
    }

    /// Validates and queues a request for `n` choices (1..=`max_seqs`): one stream each. The prompt
    /// runs once; when it has run, the sequence forks into `n` (the state slot copied, the KV pages
    /// shared) and choice `i` samples with seed `seed + i` (each its own random seed without one)
    /// and its own copy of the constraint. Dropping a stream cancels that choice.
    pub fn submit_n(&self, req: Request, n: usize) -> Result<Vec<RequestStream>, EngineError> {
        let max_seqs = self.inner.sched_cfg.max_seqs;
        if n == 0 || n > max_seqs {
            return Err(EngineError::Invalid(format!("n must be 1..={max_seqs} (the sequences run at once), got {n}")));
        }
        let choices = choices::requests(&req, n)?;
        req.sampling.validate().map_err(EngineError::Invalid)?;
        if req.sampling.min_tokens > req.max_tokens {
            return Err(EngineError::Invalid(format!(
                "`min_tokens` ({}) must be at most `max_tokens` ({})",
                req.sampling.min_tokens, req.max_tokens
            )));
        }
        if let Some(&(id, _)) = req.sampling.logit_bias.iter().find(|(id, _)| *id as usize >= self.inner.vocab) {
            return Err(EngineError::Invalid(format!(
                "`logit_bias` names token {id}, outside the vocabulary of {} ids",
                self.inner.vocab
            )));
        }
        images::place(&req.prompt, &req.images, self.inner.images)?;
        if req.prompt_logprobs.is_some() && !self.inner.prompt_logits {
            return Err(EngineError::Invalid(NO_PROMPT_LOGPROBS.into()));
        }
        if let Some((i, id)) = req.prompt.iter().enumerate().find(|(_, id)| **id as usize >= self.inner.vocab) {
            return Err(EngineError::Invalid(format!(
                "prompt token {i} has id {id}, outside the vocabulary of {} ids",
                self.inner.vocab
            )));
        }
        // Length checks happen before any work; a pure function of the plan's limits.
        check_request(&self.inner.sched_cfg, req.prompt.len(), req.max_tokens)?;
        let sh = &self.inner.shared;
        let limit = self.inner.sched_cfg.max_waiting;
        if sh.queued.fetch_add(1, Ordering::SeqCst) >= limit {
            let waiting = sh.queued.fetch_sub(1, Ordering::SeqCst) - 1;
            return Err(AdmitError::Overloaded { waiting, limit }.into());
        }
        let id = sh.next_id.fetch_add(n as u64, Ordering::Relaxed);
        let cmd = self.inner.cmd.lock().map_err(|_| EngineError::Stopped)?.clone();
        let (streams, tx, forks) = choices::channels(id, choices, &cmd);
        cmd.send(Command::Submit { id, req: Box::new(req), tx, submitted: Instant::now(), forks }).map_err(|_| {
            sh.queued.fetch_sub(1, Ordering::SeqCst);
            EngineError::Stopped
        })?;
        Ok(streams)
    }

    pub fn stats(&self) -> EngineStats {
        self.inner.shared.stats.lock().map(|s| s.clone()).unwrap_or_default()
    }

    /// Stops the engine: `drain` finishes in-flight requests first, otherwise they are cancelled
    /// (their streams end with [`EngineError::Stopped`]). Waits for the thread to exit.
    pub fn shutdown(&self, drain: bool) {
        if let Ok(cmd) = self.inner.cmd.lock() {
            let _ = cmd.send(Command::Shutdown { drain });
        }
        if let Some(t) = self.inner.thread.lock().ok().and_then(|mut t| t.take()) {
            let _ = t.join();
        }
    }
}

/// Whether a request under `constraint` drafts: unconstrained ones do, constrained ones when their
/// constraint checks drafts ([`TokenConstraint::allows_prefix`]).
fn drafts_under(constraint: Option<&SharedConstraint>) -> bool {
    constraint.is_none_or(|c| c.with(|c| c.allows_prefix(&[])).is_some())
}

/// What happened to a request when a token was emitted.
enum Emit {
    Continue,
    /// It is done (the caller finishes it once the step's commits are made).
    Finish(FinishReason),
    /// Its client went away (cancelled).
    Gone,
}

/// The engine thread's state.
struct Worker {
    sched: Scheduler,
    backend: Box<dyn Backend>,
    tokenizer: Option<Arc<Tokenizer>>,
    valid_vocab: usize,
    reqs: HashMap<SeqId, Live>,
    shared: Arc<Shared>,
    rx: mpsc::Receiver<Command>,
    /// Logit rows are this wide ([`deltaserve_backend::Capabilities::vocab_size`]).
    vocab: usize,
    /// The outputs of the last step (reused: a step allocates nothing for them once they have grown).
    out: StepOut,
    /// Device-picked steps go through [`Backend::launch`]; the next is launched before one is collected.
    lookahead: bool,
    /// The step launched and not collected yet.
    ahead: Option<Launched>,
    /// The backend applies token masks ([`deltaserve_backend::Capabilities::masks_tokens`]).
    masks_tokens: bool,
    /// Steps may launch with their picks left for later
    /// ([`deltaserve_backend::Capabilities::picks_after_launch`]).
    picks_after_launch: bool,
    /// When the last launched step was collected (launched steps overlap: a step's time starts at
    /// its launch or at this, whichever is later).
    collected: Instant,
    /// What images the engine takes.
    images: ImageRules,
}

impl Worker {
    fn run(mut self) {
        let mut draining = false;
        loop {
            // Wait for work when idle; otherwise take whatever arrived since the last step.
            if self.is_idle() {
                if draining {
                    break;
                }
                self.publish_stats();
                match self.rx.recv() {
                    Ok(cmd) => draining |= self.handle(cmd),
                    Err(_) => break,
                }
            }
            while let Ok(cmd) = self.rx.try_recv() {
                draining |= self.handle(cmd);
            }
            if self.is_idle() {
                continue;
            }
            self.drop_disconnected();
            self.step();
            self.publish_stats();
        }
        for (_, live) in self.reqs.drain() {
            let _ = live.tx.send(Event::Error(EngineError::Stopped));
        }
        self.publish_stats();
    }

    /// Applies a command; returns true when the engine should drain and stop.
    fn handle(&mut self, cmd: Command) -> bool {
        match cmd {
            Command::Submit { id, req, tx, submitted, forks } => {
                let placed = images::place(&req.prompt, &req.images, self.images);
                let opts = SeqOptions {
                    snapshot_points: req.snapshot_points.clone(),
                    snapshot_on_finish: req.snapshot_on_finish,
                    no_drafts: !drafts_under(req.constraint.as_ref()),
                    media: placed.as_ref().map(images::media_spans).unwrap_or_default(),
                    prompt_logits: req.prompt_logprobs.is_some(),
                };
                let added = placed.and_then(|p| {
                    self.sched.add_with(id, req.prompt.clone(), req.max_tokens, opts).map_err(EngineError::from)?;
                    Ok(p)
                });
                match added {
                    Ok(placed) => {
                        let mut live = Live::new(*req, tx, submitted, self.valid_vocab);
                        live.forks = forks;
                        live.images = placed;
                        self.reqs.insert(id, live);
                    }
                    Err(e) => {
                        self.shared.queued.fetch_sub(1, Ordering::SeqCst);
                        for f in forks {
                            let _ = f.tx.send(Event::Error(e.clone()));
                        }
                        let _ = tx.send(Event::Error(e));
                    }
                }
                false
            }
            Command::Cancel(id) => {
                self.cancel(id);
                false
            }
            Command::Shutdown { drain } => {
                if !drain {
                    let ids: Vec<SeqId> = self.reqs.keys().copied().collect();
                    for id in ids {
                        self.fail(id, EngineError::Stopped);
                    }
                }
                true
            }
        }
    }

    fn cancel(&mut self, id: SeqId) {
        self.drop_pending_choice(id);
        if let Some(live) = self.reqs.remove(&id) {
            if live.admitted.is_none() {
                self.shared.queued.fetch_sub(1, Ordering::SeqCst);
            }
            self.sched.remove(id);
        }
    }

    fn fail(&mut self, id: SeqId, e: EngineError) {
        if let Some(live) = self.reqs.get(&id) {
            for c in &live.forks {
                let _ = c.tx.send(Event::Error(e.clone()));
            }
            let _ = live.tx.send(Event::Error(e));
        }
        self.cancel(id);
        if let Ok(mut s) = self.shared.stats.lock() {
            s.requests_failed += 1;
        }
    }

    /// Cancels requests whose client went away.
    fn drop_disconnected(&mut self) {
        let gone: Vec<SeqId> = self.reqs.iter().filter(|(_, l)| l.tx.is_closed()).map(|(id, _)| *id).collect();
        for id in gone {
            self.cancel(id);
        }
    }

    /// Nothing to run and nothing launched.
    fn is_idle(&self) -> bool {
        self.sched.is_idle() && self.ahead.is_none()
    }

    fn step(&mut self) {
        if let Some(cur) = self.ahead.take() {
            self.follow(cur);
            return;
        }
        let entered = Instant::now();
        let mut plan = self.sched.schedule();
        self.place_chunks(&mut plan.batch.seqs);
        let scheduled = entered.elapsed();
        // Greedy requests' drafts are argmaxes: the backend picks them where the logits are.
        for c in plan.batch.seqs.iter_mut().filter(|c| c.draft > 0) {
            c.greedy_draft_vocab = self.reqs.get(&c.seq_id).map_or(0, |l| l.sampler.greedy_draft_vocab());
        }
        let now = Instant::now();
        for id in &plan.admitted {
            if let Some(live) = self.reqs.get_mut(id)
                && live.admitted.is_none()
            {
                live.admitted = Some(now);
                self.shared.queued.fetch_sub(1, Ordering::SeqCst);
            }
        }
        for id in &plan.preempted {
            if let Some(live) = self.reqs.get_mut(id) {
                live.preemptions += 1;
            }
        }
        if plan.is_empty() {
            return;
        }
        self.out.clear();
        // Sampling requests' draft distributions (q), per sequence in draft order.
        let mut q_rows: HashMap<SeqId, Vec<Vec<f32>>> = HashMap::new();
        // Steps without speculation whose rows want no logprobs take every row's token where the logits
        // are: the argmax when every row is a plain greedy pick (no penalties), else the sampling rule
        // (the penalties and one uniform draw per row travel with the step); 4 bytes a row come back.
        let wanted: Vec<Option<&Live>> =
            plan.batch.seqs.iter().filter(|c| c.want_logits).map(|c| self.reqs.get(&c.seq_id)).collect();
        // Chunks that want every row's logits (prompt log-probabilities) bring them back.
        let scoring = plan.batch.seqs.iter().any(|c| c.all_logits);
        // A constrained row's token mask travels with its sampling rule where the backend applies one
        // (else the row is masked on the host, and its step brings the rows back). A row whose choices
        // fork from it comes back too.
        let masks = self.masks_tokens;
        let on_device = self.sched.speculative_tokens() == 0
            && !scoring
            && wanted.iter().all(|l| {
                l.is_some_and(|l| {
                    l.req.logprobs.is_none() && (masks || l.req.constraint.is_none()) && l.forks.is_empty()
                })
            });
        // Every wanted row a plain greedy pick (no penalties, constraint, logprobs or forks): the step takes
        // each row's argmax where the logits are, a speculative step's verify rows included.
        let all_greedy = wanted.iter().all(|l| {
            l.is_some_and(|l| {
                l.req.logprobs.is_none() && l.req.constraint.is_none() && l.forks.is_empty() && l.sampler.picks_argmax()
            })
        });
        let greedy_step = on_device && all_greedy;
        let device_sampling = on_device && !greedy_step;
        let greedy_spec = self.sched.speculative_tokens() > 0 && all_greedy && !scoring;
        let started = Instant::now();
        let rows: Vec<RowSampling> = if device_sampling { self.sampling_rows(&plan.batch.seqs, true) } else { vec![] };
        let pick = on_device.then_some(if greedy_step { Pick::Argmax } else { Pick::Sample(&rows) });
        if self.lookahead
            && let Some(pick) = pick
        {
            if let Err(e) = self.backend.launch(&plan.batch, self.valid_vocab, pick, None) {
                self.step_failed(&e.to_string(), &plan.batch.seqs);
                return;
            }
            self.follow(Launched::new(plan, rows, None, started));
            return;
        }
        // The constrained rows' first masks, computed on a CPU thread while the backend runs the step
        // (rows picked by the backend carry theirs already).
        let constrained: Vec<(SeqId, SharedConstraint)> = plan
            .batch
            .seqs
            .iter()
            .filter(|c| c.want_logits && !on_device)
            .filter_map(|c| Some((c.seq_id, self.reqs.get(&c.seq_id)?.req.constraint.clone()?)))
            .collect();
        let reqs = &mut self.reqs;
        let mut draft_pick = |seq: u64, _i: usize, row: &[f32]| -> u32 {
            let Some(live) = reqs.get_mut(&seq) else { return 0 };
            let (token, q) = live.sampler.draft(row);
            if let Some(q) = q {
                q_rows.entry(seq).or_default().push(q);
            }
            token
        };
        let want = match pick {
            Some(pick) => Want::Tokens { valid: self.valid_vocab, pick },
            None if greedy_spec => Want::DraftsArgmax { valid: self.valid_vocab, pick: &mut draft_pick },
            None if self.sched.speculative_tokens() > 0 => Want::Drafts(&mut draft_pick),
            None => Want::Logits,
        };
        let (backend, out) = (&mut self.backend, &mut self.out);
        let (result, mut first_masks) =
            masks::while_running(constrained, mask_words(self.vocab), || backend.step(&plan.batch, want, out));
        if let Err(e) = result {
            self.step_failed(&e.to_string(), &plan.batch.seqs);
            return;
        }
        let step_seconds = started.elapsed().as_secs_f64();
        let committed = Instant::now();
        self.prompt_steps(&plan.batch.seqs, step_seconds);
        self.sched.commit(&plan);
        let commit = committed.elapsed();
        if let Ok(mut s) = self.shared.stats.lock() {
            s.steps += 1;
            s.step_seconds += step_seconds;
        }
        let mut out = std::mem::take(&mut self.out);
        // Choices forked from a row of this step, each with its own copy of the row.
        let mut forked = if on_device { Vec::new() } else { self.fork_choices(&plan.batch.seqs, &out.logits) };
        let forked_ids: Vec<SeqId> = forked.iter().map(|(id, _)| *id).collect();
        let mut rows = out.logits.chunks_exact_mut(self.vocab);
        // Rows of plain chunks are sampled first, all at once (in parallel across sequences); rows of
        // speculative chunks stay in batch order for the accept pass below.
        let mut plain: Vec<(SeqId, &mut [f32])> = Vec::new();
        let mut verify_rows: Vec<Vec<&mut [f32]>> = Vec::new();
        for c in &plan.batch.seqs {
            if c.all_logits {
                let mut all: Vec<&mut [f32]> = rows.by_ref().take(c.tokens.len()).collect();
                let last = if c.want_logits { all.pop() } else { None };
                self.send_prompt_logprobs(c, &all);
                plain.extend(last.map(|row| (c.seq_id, row)));
            } else if c.draft == 0 {
                if c.want_logits {
                    let Some(row) = rows.next() else { break };
                    plain.push((c.seq_id, row));
                }
            } else {
                verify_rows.push(rows.by_ref().take(c.draft + 1).collect());
            }
        }
        plain.extend(forked.iter_mut().map(|(id, row)| (*id, row.as_mut_slice())));
        let mut finished = Vec::new();
        // The tokens of a greedy speculative step's verify rows, per speculative chunk in batch order.
        let mut verify_tokens: Vec<Vec<u32>> = Vec::new();
        let mut sampled = if on_device {
            let wanted = plan.batch.seqs.iter().filter(|c| c.want_logits).map(|c| c.seq_id);
            wanted.zip(out.tokens.iter().copied()).map(|(id, t)| (id, (t, None))).collect()
        } else if greedy_spec {
            let mut tokens = out.tokens.iter().copied();
            let mut plain_tokens = HashMap::new();
            for c in &plan.batch.seqs {
                if c.draft > 0 {
                    verify_tokens.push(tokens.by_ref().take(c.draft + 1).collect());
                } else if c.want_logits
                    && let Some(t) = tokens.next()
                {
                    plain_tokens.insert(c.seq_id, (t, None));
                }
            }
            plain_tokens
        } else {
            self.sample_rows(plain, &mut first_masks)
        };
        for id in forked_ids {
            if let Some(token) = sampled.remove(&id)
                && let Emit::Finish(r) = self.emit(id, token.0, token.1)
            {
                finished.push((id, r));
            }
        }
        let mut verify_rows = verify_rows.into_iter();
        let mut verify_tokens = verify_tokens.into_iter();
        let mut drafts = out.drafts.drain(..);
        let mut commits = Vec::new();
        for c in &plan.batch.seqs {
            if c.draft == 0 {
                if let Some(token) = sampled.remove(&c.seq_id)
                    && let Emit::Finish(r) = self.emit(c.seq_id, token.0, token.1)
                {
                    finished.push((c.seq_id, r));
                }
                continue;
            }
            let draft = drafts.next().unwrap_or_default();
            // A greedy step's verified rows came back as tokens, any other's as logits rows.
            let tokens = if greedy_spec { verify_tokens.next() } else { None };
            let verified: Vec<&mut [f32]> =
                if greedy_spec { Vec::new() } else { verify_rows.next().unwrap_or_default() };
            if tokens.as_ref().map_or(verified.len(), Vec::len) != c.draft + 1 || draft.len() != c.draft {
                self.fail(c.seq_id, EngineError::Backend("speculative step returned too few rows or drafts".into()));
                continue;
            }
            let (emitted, accepted, end) = match tokens {
                Some(tokens) => self.accept_tokens(c.seq_id, &draft, &tokens),
                None => {
                    let q = q_rows.remove(&c.seq_id);
                    let first = first_masks.remove(&c.seq_id);
                    self.accept(c.seq_id, &draft, verified, q, first)
                }
            };
            if let Ok(mut s) = self.shared.stats.lock() {
                s.spec_steps += 1;
                s.spec_drafted += c.draft as u64;
                s.spec_accepted += accepted as u64;
                s.spec_emitted += emitted as u64;
            }
            if let Some(live) = self.reqs.get_mut(&c.seq_id) {
                live.drafted += c.draft as u64;
                live.accepted += accepted as u64;
            }
            if self.reqs.contains_key(&c.seq_id) && emitted > 0 {
                self.sched.accept_drafts(c.seq_id, emitted - 1);
                commits.push(SpecCommit {
                    seq_id: c.seq_id,
                    slot: c.slot,
                    pages: c.pages.clone(),
                    start: c.start,
                    accepted: emitted,
                });
            }
            if let Some(r) = end {
                finished.push((c.seq_id, r));
            }
        }
        drop(drafts);
        self.out = out;
        if !commits.is_empty()
            && let Err(e) = self.backend.commit_speculative(&commits)
        {
            tracing::error!(error = %e, "speculative commit failed; failing its requests");
            self.sched.clear_prefix_cache();
            for c in &commits {
                self.fail(c.seq_id, EngineError::Backend(e.to_string()));
            }
            finished.retain(|(id, _)| !commits.iter().any(|c| c.seq_id == *id));
        }
        for (id, reason) in finished {
            self.finish(id, reason);
        }
        // Where a step's time outside the backend went, when it is noticeable.
        let outside = entered.elapsed().as_secs_f64() - step_seconds;
        if outside > 0.005 {
            tracing::debug!(
                tokens = plan.batch.seqs.iter().map(|c| c.tokens.len()).sum::<usize>(),
                backend_ms = format!("{:.1}", step_seconds * 1e3),
                outside_ms = format!("{:.1}", outside * 1e3),
                schedule_ms = format!("{:.1}", scheduled.as_secs_f64() * 1e3),
                commit_ms = format!("{:.1}", commit.as_secs_f64() * 1e3),
                "engine step spent time outside the backend"
            );
        }
    }

    /// Fails the requests of a step whose backend call failed (and drops the cached prefixes, whose
    /// snapshots may not have been written).
    fn step_failed(&mut self, error: &str, seqs: &[SeqChunk]) {
        tracing::error!(error, "backend step failed; failing the requests in the step");
        self.sched.clear_prefix_cache();
        for c in seqs {
            self.fail(c.seq_id, EngineError::Backend(error.to_string()));
        }
    }

    fn publish_stats(&self) {
        if let Ok(mut s) = self.shared.stats.lock() {
            s.sched = self.sched.stats();
            s.arena = self.backend.arena_stats();
        }
    }
}
