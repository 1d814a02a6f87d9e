//! `deltaserve bench --constrained`: decode steps of replies under a JSON schema against unconstrained
//! ones at the same batch and context, both run by the engine itself over the bench's backend, so a
//! constrained step pays what it pays when serving: each constrained row's token bitmask computed on
//! the host by the server's grammar constraint (llguidance, against the model's tokenizer) where the
//! engine computes it, its upload with the step, the masked pick on the device, the matcher following
//! the picked token, and the look-ahead the engine gives or refuses such steps.
//!
//! The sequences reach their context without a real prefill: the backend the engine drives cuts each
//! prompt chunk to its last token (at its last position), so the decode steps after it attend to the
//! whole context and walk the same DeltaNet state (their content does not change the work) while the
//! prompt costs one position. Every reply runs its timed steps (`--steps`, at least 128) after a
//! warm-up, all sequences in every step; a constrained reply that completes its JSON object ends it
//! with the end-of-turn token and starts a new object under a freshly compiled grammar (compiled on
//! another thread, as the server compiles each request's grammar before queuing it), so every step's
//! mask is a real one.
//! Afterwards each constrained reply's tokens are replayed through the grammar: any token outside it
//! fails the run.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, sync_channel};
use std::sync::{Arc, Mutex};

use deltaserve_backend::{ArenaStats, BackendError, Capabilities, ImageTokens};
use deltaserve_cpu::{CpuBackend, CpuCacheConfig};
use deltaserve_engine::{
    EngineHandle, EngineOptions, Event, Request, SamplingParams, SharedConstraint, TokenConstraint,
};
use deltaserve_sched::{PrefixCacheConfig, SchedConfig};
use deltaserve_server::structured::GrammarConstraint;
use deltaserve_text::{Grammar, GrammarCompiler, GrammarMatcher, Tokenizer};

use super::*;

/// Steps of each reply before the timed ones (the first runs the prompts).
const WARMUP: usize = 4;

/// The fewest timed steps of a constrained point: a reply's JSON object takes tens of tokens, and a
/// mask's cost depends on where in it the reply stands.
const MIN_STEPS: usize = 128;

/// Timed steps of each reply: `--steps`, at least [`MIN_STEPS`].
pub(super) fn timed_steps(steps: usize) -> usize {
    steps.max(MIN_STEPS)
}

/// The replies' schema: an object with an enum, a bounded integer, a bounded string and an array of
/// bounded strings (what a tool's structured reply looks like).
pub(super) fn reply_schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "status": {"type": "string", "enum": ["ok", "degraded", "failed", "unknown"]},
            "retries": {"type": "integer", "minimum": 0, "maximum": 1000},
            "summary": {"type": "string", "minLength": 1, "maxLength": 48},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 4},
        },
        "required": ["status", "retries", "summary", "tags"],
        "additionalProperties": false,
    })
}

/// Tokens each reply generates for `--steps`: the warm-up, the timed steps and one more.
pub(super) fn reply_tokens(steps: usize) -> usize {
    WARMUP + timed_steps(steps) + 2
}

/// One (batch, context) point: ms per step of constrained and unconstrained replies.
#[derive(Debug, Default)]
pub(super) struct ConstrainedRow {
    pub(super) batch: usize,
    pub(super) context: usize,
    pub(super) ms_constrained: f64,
    pub(super) ms_unconstrained: f64,
    /// Mean host ms of one row's bitmask (the grammar's `allowed`, or its host mask).
    pub(super) mask_ms: f64,
    /// Share of the engine's steps launched ahead, constrained and unconstrained.
    pub(super) ahead_constrained: f64,
    pub(super) ahead_unconstrained: f64,
    /// JSON objects the constrained replies completed (each parsed), and their tokens the grammar
    /// refuses (0 unless the masks are wrong) or objects that do not parse.
    pub(super) objects: usize,
    pub(super) outside: usize,
}

impl ConstrainedRow {
    pub(super) fn ratio(&self) -> f64 {
        self.ms_constrained / self.ms_unconstrained
    }
}

/// A backend the bench lends the engine and takes back afterwards.
pub(super) trait Lend: Send + 'static {
    fn backend(&mut self) -> &mut dyn Backend;
}

impl Lend for Under {
    fn backend(&mut self) -> &mut dyn Backend {
        self.get()
    }
}

impl Lend for CpuBackend {
    fn backend(&mut self) -> &mut dyn Backend {
        self
    }
}

/// The engine's backend: the bench's, with each prompt chunk cut to its last token.
struct Lent<T>(Arc<Mutex<T>>);

impl<T: Lend> Lent<T> {
    fn with<R>(&self, f: impl FnOnce(&mut dyn Backend) -> R) -> R {
        let mut b = self.0.lock().unwrap_or_else(|e| e.into_inner());
        f(b.backend())
    }
}

/// `batch` with every chunk of several tokens (a prompt's) cut to its last token at its last
/// position; None when it has none.
fn cut_prompts(batch: &StepBatch) -> Option<StepBatch> {
    if batch.seqs.iter().all(|c| c.tokens.len() <= 1 || c.draft > 0) {
        return None;
    }
    let mut b = batch.clone();
    for c in b.seqs.iter_mut().filter(|c| c.tokens.len() > 1 && c.draft == 0) {
        c.start += c.tokens.len() - 1;
        c.tokens.drain(..c.tokens.len() - 1);
        c.save_within.clear();
        c.images.clear();
    }
    Some(b)
}

impl<T: Lend> Backend for Lent<T> {
    fn capabilities(&self) -> Capabilities {
        self.with(|b| b.capabilities())
    }
    fn image_tokens(&self) -> Option<ImageTokens> {
        None
    }
    fn step(&mut self, batch: &StepBatch, want: Want<'_>, out: &mut StepOut) -> Result<(), BackendError> {
        let cut = cut_prompts(batch);
        self.with(|b| b.step(cut.as_ref().unwrap_or(batch), want, out))
    }
    fn launch(
        &mut self,
        batch: &StepBatch,
        valid: usize,
        pick: deltaserve_backend::Pick<'_>,
        feed: Option<&Feed>,
    ) -> Result<(), BackendError> {
        let cut = cut_prompts(batch);
        self.with(|b| b.launch(cut.as_ref().unwrap_or(batch), valid, pick, feed))
    }
    fn pick_launched(&mut self, pick: deltaserve_backend::Pick<'_>) -> Result<(), BackendError> {
        self.with(|b| b.pick_launched(pick))
    }
    fn collect(&mut self, out: &mut Picked) -> Result<(), BackendError> {
        self.with(|b| b.collect(out))
    }
    fn commit_speculative(&mut self, commits: &[deltaserve_backend::SpecCommit]) -> Result<(), BackendError> {
        self.with(|b| b.commit_speculative(commits))
    }
    fn arena_stats(&self) -> ArenaStats {
        self.with(|b| b.arena_stats())
    }
}

/// Host time spent in the constrained rows' masks.
#[derive(Default)]
struct MaskClock {
    nanos: AtomicU64,
    masks: AtomicU64,
}

impl MaskClock {
    fn time<R>(&self, f: impl FnOnce() -> R) -> R {
        let t0 = Instant::now();
        let r = f();
        self.nanos.fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
        self.masks.fetch_add(1, Ordering::Relaxed);
        r
    }
}

/// The server's grammar constraint, timed, starting a new object under a fresh grammar after each
/// end-of-turn token.
struct Restarting {
    inner: GrammarConstraint,
    eos: Vec<u32>,
    fresh: Arc<Mutex<Receiver<Result<GrammarMatcher, String>>>>,
    clock: Arc<MaskClock>,
}

impl TokenConstraint for Restarting {
    fn mask(&mut self, row: &mut [f32]) {
        let inner = &mut self.inner;
        self.clock.time(|| inner.mask(row));
    }
    fn allowed(&mut self, bits: &mut [u32]) {
        let inner = &mut self.inner;
        self.clock.time(|| inner.allowed(bits));
    }
    fn accept(&mut self, token: u32) {
        self.inner.accept(token);
        if self.eos.contains(&token) {
            // The compiler thread runs until the last constraint is gone (and the grammar compiled
            // before the run started): a fresh one is always there.
            if let Ok(Ok(m)) = self.fresh.lock().unwrap_or_else(|e| e.into_inner()).recv() {
                self.inner = GrammarConstraint::new(m, None, self.eos.clone());
            }
        }
    }
}

/// What every point shares: the grammar, the tokenizer and the engine's limits.
pub(super) struct Setup {
    pub(super) tokenizer: Arc<Tokenizer>,
    /// The end-of-turn ids (the model's).
    pub(super) eos: Vec<u32>,
    pub(super) sample: RowSampling,
    /// `--steps`.
    pub(super) steps: usize,
    pub(super) page_size: usize,
    pub(super) num_pages: usize,
    pub(super) max_context: usize,
    pub(super) max_seqs: usize,
}

/// Runs every (context, batch) point, unconstrained then constrained, through one engine over `be`;
/// hands `be` back with the rows.
pub(super) fn measure<T: Lend>(be: T, s: &Setup, points: &[(usize, usize)]) -> Result<(T, Vec<ConstrainedRow>)> {
    let tok = &s.tokenizer;
    let compiler = GrammarCompiler::new(tok.clone(), tok.vocab_size(), &s.eos)
        .map_err(|e| anyhow::anyhow!("--constrained: the grammar compiler: {e}"))?;
    let compiler = Arc::new(compiler);
    let grammar = Grammar::JsonSchema(reply_schema());
    compiler.compile(&grammar).map_err(|e| anyhow::anyhow!("--constrained: the schema does not compile: {e}"))?;
    let shared = Arc::new(Mutex::new(be));
    // Every point's prompts run in one step (the backend sees one token of each).
    let sched = SchedConfig {
        max_batch_tokens: points.iter().map(|&(ctx, b)| b * (ctx + 1)).max().unwrap_or(1),
        max_seqs: s.max_seqs,
        page_size: s.page_size,
        num_pages: s.num_pages,
        max_context: s.max_context,
        max_waiting: 1024,
        prefix_cache: PrefixCacheConfig::disabled(s.page_size),
        snapshot_interval: 0,
    };
    let engine =
        EngineHandle::start_with(Box::new(Lent(shared.clone())), sched, Some(tok.clone()), EngineOptions::default())?;
    let point = |ctx: usize, b: usize| -> Result<ConstrainedRow> {
        tracing::info!("bench: constrained decode batch {b} at context {}", fmt_count(ctx as u64));
        let free = run_point(&engine, s, &compiler, None, b, ctx)?;
        let held = run_point(&engine, s, &compiler, Some(&grammar), b, ctx)?;
        Ok(ConstrainedRow {
            batch: b,
            context: ctx,
            ms_constrained: held.ms,
            ms_unconstrained: free.ms,
            mask_ms: held.mask_ms,
            ahead_constrained: held.ahead,
            ahead_unconstrained: free.ahead,
            objects: held.objects,
            outside: held.outside,
        })
    };
    // Every point, stopping at the first error (the backend comes back either way).
    let rows: Result<Vec<ConstrainedRow>> = points.iter().map(|&(ctx, b)| point(ctx, b)).collect();
    engine.shutdown(false);
    drop(engine);
    let be = Arc::try_unwrap(shared)
        .map_err(|_| anyhow::anyhow!("the engine kept the bench's backend"))?
        .into_inner()
        .unwrap_or_else(|e| e.into_inner());
    Ok((be, rows?))
}

/// One run of `b` replies at context `ctx`, under `grammar` or free.
struct PointRun {
    ms: f64,
    mask_ms: f64,
    ahead: f64,
    objects: usize,
    outside: usize,
}

fn run_point(
    engine: &EngineHandle,
    s: &Setup,
    compiler: &Arc<GrammarCompiler>,
    grammar: Option<&Grammar>,
    b: usize,
    ctx: usize,
) -> Result<PointRun> {
    let clock = Arc::new(MaskClock::default());
    // Fresh grammars for the objects after each reply's first, compiled ahead on another thread.
    let (fresh, compiling) = match grammar {
        Some(g) => {
            let (tx, rx) = sync_channel(2 * b);
            let (c, g) = (compiler.clone(), g.clone());
            let t = std::thread::spawn(move || while tx.send(c.compile(&g)).is_ok() {});
            (Some(Arc::new(Mutex::new(rx))), Some(t))
        }
        None => (None, None),
    };
    let valid = s.tokenizer.vocab_size().max(1);
    let n = reply_tokens(s.steps);
    let mut reqs = Vec::with_capacity(b);
    for i in 0..b {
        let constraint = match (grammar, &fresh) {
            (Some(g), Some(fresh)) => {
                let m = compiler.compile(g).map_err(|e| anyhow::anyhow!("--constrained: {e}"))?;
                Some(SharedConstraint::new(Restarting {
                    inner: GrammarConstraint::new(m, None, s.eos.clone()),
                    eos: s.eos.clone(),
                    fresh: fresh.clone(),
                    clock: clock.clone(),
                }))
            }
            _ => None,
        };
        let r = &s.sample;
        reqs.push(Request {
            prompt: (0..ctx).map(|j| ((i * 7919 + j * 31 + 5) % valid) as u32).collect(),
            max_tokens: n,
            sampling: SamplingParams {
                temperature: r.temperature,
                top_k: r.top_k,
                top_p: r.top_p,
                min_p: r.min_p,
                seed: Some(i as u64),
                ..SamplingParams::default()
            },
            constraint,
            ..Request::default()
        });
    }
    drop(fresh);
    let before = engine.stats();
    let mut streams = Vec::with_capacity(b);
    for r in reqs {
        streams.push(engine.submit(r)?);
    }
    // Token i of every reply comes from one step (the first step runs every prompt): the time between
    // the steps that give tokens i - 1 and i of every reply.
    let mut tokens: Vec<Vec<u32>> = vec![Vec::with_capacity(n); b];
    let timed = timed_steps(s.steps);
    let mut times = Vec::with_capacity(timed);
    let mut last: Option<Instant> = None;
    let mut masks_before = (0, 0);
    for i in 0..n {
        for (stream, ids) in streams.iter_mut().zip(&mut tokens) {
            match stream.blocking_next() {
                Some(Event::Token { id, .. }) => ids.push(id),
                Some(Event::Finished { reason, .. }) => bail!("a reply ended after {i} tokens ({reason:?})"),
                Some(Event::Error(e)) => bail!("a reply failed: {e}"),
                Some(Event::Prefill { .. } | Event::PromptLogprobs { .. }) => {
                    bail!("a reply reported its prompt's progress or scores unasked")
                }
                None => bail!("a reply's stream ended after {i} tokens"),
            }
        }
        let now = Instant::now();
        if i == WARMUP {
            masks_before = (clock.nanos.load(Ordering::Relaxed), clock.masks.load(Ordering::Relaxed));
        }
        if let Some(t) = last
            && i > WARMUP
            && times.len() < timed
        {
            times.push((now - t).as_secs_f64() * 1e3);
        }
        last = Some(now);
    }
    for mut stream in streams {
        while let Some(e) = stream.blocking_next() {
            if matches!(e, Event::Finished { .. } | Event::Error(_)) {
                break;
            }
        }
    }
    let after = engine.stats();
    if let Some(t) = compiling {
        // The constraints (and their receiver) are gone with their requests: the compiler stops.
        let _ = t.join();
    }
    let (nanos, masks) = (clock.nanos.load(Ordering::Relaxed), clock.masks.load(Ordering::Relaxed));
    let (nanos, masks) = (nanos - masks_before.0, masks - masks_before.1);
    let steps = after.steps.saturating_sub(before.steps).max(1);
    let mut run = PointRun {
        ms: median(times),
        mask_ms: if masks == 0 { 0.0 } else { nanos as f64 / masks as f64 / 1e6 },
        ahead: after.steps_ahead.saturating_sub(before.steps_ahead) as f64 / steps as f64,
        objects: 0,
        outside: 0,
    };
    if let Some(g) = grammar {
        for ids in &tokens {
            let (objects, outside) = replay(compiler, g, &s.tokenizer, &s.eos, ids)?;
            run.objects += objects;
            run.outside += outside;
        }
    }
    Ok(run)
}

/// Follows a constrained reply's tokens through the grammar, a fresh one after each end-of-turn id:
/// (complete objects that parse as JSON objects, tokens the grammar refuses + objects that do not parse).
fn replay(
    compiler: &GrammarCompiler,
    grammar: &Grammar,
    tok: &Tokenizer,
    eos: &[u32],
    ids: &[u32],
) -> Result<(usize, usize)> {
    let compile = || compiler.compile(grammar).map_err(|e| anyhow::anyhow!("--constrained: {e}"));
    let (mut m, mut from) = (compile()?, 0);
    let (mut objects, mut outside) = (0, 0);
    for (i, &t) in ids.iter().enumerate() {
        if eos.contains(&t) {
            if m.is_done() || m.allows_prefix(&[t]) == 1 {
                let text = tok.decode(&ids[from..i], false).unwrap_or_default();
                tracing::debug!(object = %text, "bench: a constrained reply's JSON object");
                match serde_json::from_str::<Value>(&text) {
                    Ok(v) if v.is_object() => objects += 1,
                    _ => outside += 1,
                }
            } else {
                outside += 1;
            }
            (m, from) = (compile()?, i + 1);
        } else if m.accept(t).is_err() {
            outside += 1;
            (m, from) = (compile()?, i + 1);
        }
    }
    Ok((objects, outside))
}

/// `bench --device cpu --constrained`: the constrained measurement alone, on the CPU reference backend
/// (by default the built-in demo model).
pub(super) fn run_cpu(a: &Args) -> Result<()> {
    if !a.constrained {
        bail!("bench --device cpu measures only --constrained (every other measurement needs the CUDA backend)");
    }
    if a.model.preset.is_some() || a.model.random_weights {
        bail!(
            "bench --device cpu runs a model directory or the demo model (--preset and --random-weights are for CUDA)"
        );
    }
    if a.tensor_parallel > 1 || a.speculative_tokens > 0 || a.profile || a.phases {
        bail!("--tensor-parallel, --speculative-tokens, --profile and --phases need the CUDA backend");
    }
    let mut model = a.model.clone();
    model.no_vision = true;
    let dir = model.dir()?;
    let text = model.load_text(&dir)?;
    let weights = model.load_weights(&text)?;
    let tokenizer = Arc::new(text.tokenizer.context("--constrained needs the model's tokenizer.json")?);
    let cfg = text.config;
    let n = reply_tokens(a.steps);
    let mut o = PlanOptions::cpu_defaults(a.memory.unwrap_or(2 << 30));
    o.max_seqs = a.batches.iter().copied().max().unwrap_or(1);
    o.max_context = Some(a.contexts.iter().copied().max().unwrap_or(0) + n + 8);
    o.snapshot_slots = 0;
    o.max_image_tokens_per_step = None;
    let plan = Plan::new(&cfg, &o).context("the bench's memory plan does not fit (lower --contexts or --batches)")?;
    let mut skipped = Vec::new();
    let points = fitting_points(a, &plan, &mut skipped);
    let pages = points.iter().map(|&(ctx, b)| b * (ctx + n).div_ceil(plan.page_size)).max().unwrap_or(1);
    let be = CpuBackend::new(
        weights,
        CpuCacheConfig {
            num_pages: pages.min(plan.num_kv_pages),
            page_size: plan.page_size,
            num_slots: plan.num_state_slots,
            snapshot_slots: 0,
            host_snapshot_slots: 0,
        },
    );
    let setup = Setup {
        tokenizer,
        eos: cfg.eos_token_ids.clone(),
        sample: a.sample.clone(),
        steps: a.steps,
        page_size: plan.page_size,
        num_pages: pages.min(plan.num_kv_pages),
        max_context: plan.max_context,
        max_seqs: plan.max_seqs,
    };
    let (_, constrained) = measure(be, &setup, &points)?;
    let name = if a.model.model.is_some() {
        model_name(&model, &cfg)
    } else {
        format!("demo model ({})", model_name(&model, &cfg))
    };
    let report = Report {
        gpu: "the CPU (f32 reference backend)".into(),
        tensor_parallel: 1,
        model: name,
        plan_bytes: plan.total_bytes,
        arena_bytes: plan.arena_bytes(),
        sampling: sampling_label(&a.sample),
        skipped,
        constrained,
        ..Report::default()
    };
    emit("bench", &report, a.json, a.svg.as_deref())
}

/// The (context, batch) points of `--contexts` × `--batches` whose constrained replies fit the plan's
/// pages and context (the others named in `skipped`).
pub(super) fn fitting_points(a: &Args, plan: &Plan, skipped: &mut Vec<String>) -> Vec<(usize, usize)> {
    let n = reply_tokens(a.steps);
    let mut points = Vec::new();
    for &ctx in &a.contexts {
        for &b in &a.batches {
            let per_seq = (ctx + n).div_ceil(plan.page_size);
            if b * per_seq > plan.num_kv_pages || ctx + n > plan.max_context || b > plan.max_seqs {
                skipped.push(format!(
                    "constrained decode batch {b} at {ctx}: needs {} KV pages, the plan has {}",
                    b * per_seq,
                    plan.num_kv_pages
                ));
                continue;
            }
            points.push((ctx, b));
        }
    }
    points
}
