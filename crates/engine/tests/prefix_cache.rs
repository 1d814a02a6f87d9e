//! The prefix cache never changes an output: random agent-like conversation trees (multi-turn
//! growth, branching from earlier turns, edits of earlier messages, concurrent sessions sharing a
//! system prompt) give token-identical greedy outputs and log-probabilities within f32 rounding
//! with the cache on (tiny snapshot pools, so entries are demoted and evicted) and off; and
//! multi-turn requests actually reuse the previous turn's context. Both ways of taking snapshots at
//! message starts: inside a chunk (the CPU backend's) and by ending chunks there (a backend without
//! `snapshots_within_chunks`); inside chunks a turn runs in fewer steps with the same cache hits.

mod common;

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use deltaserve_backend::{
    ArenaStats, Backend, BackendError, Capabilities, Feed, ImageTokens, Pick, Picked, SpecCommit, StepBatch, StepOut,
    Want,
};
use deltaserve_cpu::{CpuBackend, CpuCacheConfig};
use deltaserve_engine::{EngineHandle, Event, Request, SamplingParams, Usage};
use deltaserve_sched::{PrefixCacheConfig, SchedConfig};

use common::{load_model, state_bytes, tiny_model};

const IM_START: u32 = 992; // `<|im_start|>` in the tiny preset's tokenizer (mergeable 991 + 1)

fn model_dir() -> &'static PathBuf {
    static D: OnceLock<PathBuf> = OnceLock::new();
    D.get_or_init(|| tiny_model("prefix-test", 33))
}

/// How snapshots at points inside a prompt are taken.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Points {
    /// Inside chunks (the CPU backend's way).
    Within,
    /// Chunks end at them (what the backend says when it cannot take them inside a chunk).
    ChunkEnds,
}

/// Counts of what the engine asked of the backend.
#[derive(Default)]
struct Counts {
    steps: AtomicUsize,
    saves_within: AtomicUsize,
}

/// The CPU backend, counting steps and snapshots inside chunks; with [`Points::ChunkEnds`] it says it
/// cannot take them.
struct Counted {
    inner: CpuBackend,
    points: Points,
    counts: Arc<Counts>,
}

impl Backend for Counted {
    fn capabilities(&self) -> Capabilities {
        let within = self.points == Points::Within;
        let cap = if within { usize::MAX } else { 0 };
        Capabilities { snapshots_within_chunks: cap, ..self.inner.capabilities() }
    }
    fn image_tokens(&self) -> Option<ImageTokens> {
        self.inner.image_tokens()
    }
    fn step(&mut self, batch: &StepBatch, want: Want<'_>, out: &mut StepOut) -> Result<(), BackendError> {
        self.count(batch);
        self.inner.step(batch, want, out)
    }
    fn launch(&mut self, b: &StepBatch, valid: usize, pick: Pick<'_>, feed: Option<&Feed>) -> Result<(), BackendError> {
        self.count(b);
        self.inner.launch(b, valid, pick, feed)
    }
    fn pick_launched(&mut self, pick: Pick<'_>) -> Result<(), BackendError> {
        self.inner.pick_launched(pick)
    }
    fn collect(&mut self, out: &mut Picked) -> Result<(), BackendError> {
        self.inner.collect(out)
    }
    fn commit_speculative(&mut self, commits: &[SpecCommit]) -> Result<(), BackendError> {
        self.inner.commit_speculative(commits)
    }
    fn arena_stats(&self) -> ArenaStats {
        self.inner.arena_stats()
    }
}

impl Counted {
    fn count(&self, batch: &StepBatch) {
        let saves: usize = batch.seqs.iter().map(|c| c.save_within.len()).sum();
        assert!(self.points == Points::Within || saves == 0, "snapshots inside a chunk the backend cannot take");
        self.counts.saves_within.fetch_add(saves, Ordering::Relaxed);
        self.counts.steps.fetch_add(!batch.seqs.is_empty() as usize, Ordering::Relaxed);
    }
}

fn engine(cache: bool, num_pages: usize) -> EngineHandle {
    engine_with(cache, num_pages, Points::Within).0
}

fn engine_with(cache: bool, num_pages: usize, points: Points) -> (EngineHandle, Arc<Counts>) {
    let model = load_model(model_dir());
    let state_bytes = state_bytes(&model);
    let prefix = if cache {
        PrefixCacheConfig {
            device_slots: 2,
            host_slots: 3,
            page_size: 8,
            snapshot_bytes: state_bytes,
            page_bytes: 8 * 512,
        }
    } else {
        PrefixCacheConfig::disabled(8)
    };
    let sched = SchedConfig {
        max_batch_tokens: 48,
        max_seqs: 3,
        page_size: 8,
        num_pages,
        max_context: 8 * 60,
        max_waiting: 64,
        prefix_cache: prefix,
        snapshot_interval: 40,
    };
    let backend = CpuBackend::new(
        model,
        CpuCacheConfig {
            num_pages,
            page_size: 8,
            num_slots: 3,
            snapshot_slots: prefix.device_slots,
            host_snapshot_slots: prefix.host_slots,
        },
    );
    let counts = Arc::new(Counts::default());
    let backend = Counted { inner: backend, points, counts: counts.clone() };
    (EngineHandle::start(Box::new(backend), sched, None), counts)
}

/// A chat-like prompt: messages each starting with IM_START; returns (tokens, message starts).
fn render(messages: &[Vec<u32>]) -> (Vec<u32>, Vec<usize>) {
    let mut tokens = Vec::new();
    let mut starts = Vec::new();
    for m in messages {
        starts.push(tokens.len());
        tokens.push(IM_START);
        tokens.extend(m);
    }
    starts.push(tokens.len());
    tokens.extend([IM_START, 5, 6]); // generation prompt
    (tokens, starts)
}

struct Rng(u64);
impl Rng {
    fn next(&mut self, m: u64) -> u64 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (self.0 >> 33) % m
    }
    fn message(&mut self) -> Vec<u32> {
        let n = 1 + self.next(45) as usize;
        (0..n).map(|_| self.next(990) as u32).collect()
    }
}

/// (generated ids, per-token logprobs, usage)
fn run(e: &EngineHandle, prompt: Vec<u32>, points: Vec<usize>) -> (Vec<u32>, Vec<f32>, Usage) {
    let req = Request {
        prompt,
        max_tokens: 6,
        sampling: SamplingParams::greedy(),
        logprobs: Some(1),
        snapshot_points: points,
        snapshot_on_finish: true,
        ..Default::default()
    };
    let mut s = e.submit(req).unwrap();
    let (mut ids, mut lps) = (Vec::new(), Vec::new());
    loop {
        match s.blocking_next() {
            Some(Event::Token { id, logprob, .. }) => {
                ids.push(id);
                lps.push(logprob.unwrap().logprob);
            }
            Some(Event::Finished { usage, .. }) => return (ids, lps, usage),
            other => panic!("unexpected {other:?}"),
        }
    }
}

/// A workload: a list of conversations (message lists), built as trees by growth, branching, edits.
fn workload(seed: u64) -> Vec<Vec<Vec<u32>>> {
    let mut rng = Rng(seed);
    let system: Vec<u32> = (0..30).map(|i| (i * 7 % 900) as u32).collect();
    let mut convs: Vec<Vec<Vec<u32>>> = vec![vec![system.clone(), rng.message()]];
    for _ in 0..14 {
        let base = convs[rng.next(convs.len() as u64) as usize].clone();
        let next = match rng.next(4) {
            // grow: the previous turn's output is appended by `simulate`, then a new message
            0 | 1 => {
                let mut c = base;
                c.push(rng.message());
                c
            }
            // branch from an earlier turn
            2 => {
                let keep = 1 + rng.next(base.len() as u64) as usize;
                let mut c = base[..keep].to_vec();
                c.push(rng.message());
                c
            }
            // edit an earlier message
            _ => {
                let mut c = base;
                let i = rng.next(c.len() as u64) as usize;
                let j = rng.next(c[i].len() as u64) as usize;
                c[i][j] = (c[i][j] + 1) % 990;
                c
            }
        };
        convs.push(next);
    }
    // a second session sharing the system prompt
    convs.push(vec![system, rng.message(), rng.message()]);
    convs
}

/// Runs the workload: each conversation is rendered; after each request the assistant output is
/// appended as a message of that conversation (so the next turn re-renders it identically).
fn simulate(e: &EngineHandle, seed: u64) -> Vec<(Vec<u32>, Vec<f32>, Usage, usize)> {
    let mut outputs = Vec::new();
    let mut convs = workload(seed);
    for i in 0..convs.len() {
        let (prompt, starts) = render(&convs[i]);
        let plen = prompt.len();
        let (ids, lps, usage) = run(e, prompt, starts);
        if i + 1 < convs.len() && convs[i + 1].starts_with(&convs[i]) {
            let mut out = vec![5, 6];
            out.extend(&ids[..ids.len() - 1]);
            let at = convs[i].len();
            convs[i + 1].insert(at, out);
        }
        outputs.push((ids, lps, usage, plen));
    }
    outputs
}

#[test]
fn outputs_with_and_without_the_prefix_cache_are_identical() {
    for (seed, pages, points) in [
        (1u64, 400usize, Points::Within),
        (2, 70, Points::Within),
        (3, 60, Points::Within),
        (1, 400, Points::ChunkEnds),
    ] {
        let off = engine(false, pages);
        let (on, counts) = engine_with(true, pages, points);
        let a = simulate(&off, seed);
        let b = simulate(&on, seed);
        let within = counts.saves_within.load(Ordering::Relaxed);
        assert_eq!(within > 0, points == Points::Within, "seed {seed} {points:?}: {within} snapshots inside chunks");
        let mut hits = 0;
        for (i, (x, y)) in a.iter().zip(&b).enumerate() {
            assert_eq!(x.0, y.0, "seed {seed} request {i}: tokens differ with the cache");
            for (p, q) in x.1.iter().zip(&y.1) {
                assert!((p - q).abs() < 1e-4, "seed {seed} request {i}: logprob {p} vs {q}");
            }
            assert_eq!(x.2.cached_tokens, 0);
            assert!(y.2.cached_tokens < y.3, "cached tokens must leave the last prompt token to run");
            hits += (y.2.cached_tokens > 0) as usize;
        }
        assert!(hits >= 5, "seed {seed}: only {hits} requests hit the cache");
        let st = on.stats().sched;
        assert!(
            st.prefix.evictions + st.prefix.demotions > 0,
            "the tiny pools should have forced eviction: {:?}",
            st.prefix
        );
        off.shutdown(true);
        on.shutdown(true);
    }
}

/// Six turns of one conversation: (generated ids, cached tokens, prefill steps) per turn.
fn conversation(points: Points) -> Vec<(Vec<u32>, usize, usize)> {
    let (e, counts) = engine_with(true, 400, points);
    let mut rng = Rng(9);
    let mut messages = vec![(0..40).collect::<Vec<u32>>(), rng.message()];
    let mut prev_len = 0;
    let mut turns = Vec::new();
    for turn in 0..6 {
        let (prompt, starts) = render(&messages);
        let plen = prompt.len();
        let before = counts.steps.load(Ordering::Relaxed);
        let (ids, _, usage) = run(&e, prompt, starts);
        // Steps of the turn less its decode steps (one a generated token after the first).
        let prefill_steps = counts.steps.load(Ordering::Relaxed) - before - (ids.len() - 1);
        if turn > 0 {
            // Everything up to the end of the previous prompt + its output is reused.
            assert!(
                usage.cached_tokens >= prev_len,
                "{points:?} turn {turn}: cached {} < previous context {prev_len}",
                usage.cached_tokens
            );
        }
        let mut out = vec![5, 6];
        out.extend(&ids[..ids.len() - 1]);
        prev_len = plen + ids.len() - 1;
        messages.push(out);
        messages.push(rng.message());
        turns.push((ids, usage.cached_tokens, prefill_steps));
    }
    e.shutdown(true);
    turns
}

#[test]
fn multi_turn_requests_reuse_the_previous_turn() {
    let within = conversation(Points::Within);
    let ends = conversation(Points::ChunkEnds);
    for (turn, (w, e)) in within.iter().zip(&ends).enumerate() {
        assert_eq!((&w.0, w.1), (&e.0, e.1), "turn {turn}: the same tokens and cache hits either way");
        assert!(w.2 <= e.2, "turn {turn}: {} prefill steps with snapshots inside chunks, {} without", w.2, e.2);
    }
    // A follow-up turn's new tokens (the previous reply's end, a user message, the generation prompt:
    // two snapshot points inside) fit the 48-token budget: one step instead of several.
    let steps = |turns: &[(Vec<u32>, usize, usize)]| turns.iter().map(|t| t.2).collect::<Vec<_>>();
    println!("prefill steps per turn: inside chunks {:?}, at chunk ends {:?}", steps(&within), steps(&ends));
    let (w, e): (usize, usize) = (within[1..].iter().map(|t| t.2).sum(), ends[1..].iter().map(|t| t.2).sum());
    assert!(w < e, "follow-up turns: {w} prefill steps with snapshots inside chunks, {e} without");
}
