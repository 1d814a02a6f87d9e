//! Look-ahead stepping never changes an output: with the next decode step launched before the
//! previous one's tokens are read (the CPU backend's emulation of a device that feeds its picks),
//! greedy and seeded sampling requests, stopped by length and by stop ids, alone and batched, and
//! second turns resumed from end-of-request snapshots give the tokens of one-step-at-a-time stepping;
//! also when some picks are made on the host (their fed rows do not run). Requests the host must see
//! first (penalties, stop strings, logprobs) step one at a time.

mod common;

use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Duration;

use deltaserve_backend::{
    Backend, BackendError, Capabilities, Feed, Pick, Picked, SpecCommit, StepBatch, StepOut, Want,
};
use deltaserve_cpu::{CpuBackend, CpuCacheConfig};
use deltaserve_engine::{EngineHandle, EngineOptions, Event, FinishReason, Request, SamplingParams};
use deltaserve_sched::{PrefixCacheConfig, SchedConfig};

use common::{load_model, state_bytes, tiny_model, wait_released};

/// How long the engine may take to go idle.
const IDLE_WITHIN: Duration = Duration::from_secs(20);

fn model_dir() -> &'static PathBuf {
    static D: OnceLock<PathBuf> = OnceLock::new();
    D.get_or_init(|| tiny_model("lookahead-test", 47))
}

/// An engine on the CPU backend with the prefix cache on; `host_every`: every k-th launched pick is
/// made on the host (0: none).
fn engine(lookahead: bool, host_every: usize) -> EngineHandle {
    let model = load_model(model_dir());
    let state_bytes = state_bytes(&model);
    let prefix = PrefixCacheConfig {
        device_slots: 4,
        host_slots: 4,
        page_size: 8,
        snapshot_bytes: state_bytes,
        page_bytes: 4096,
    };
    let (num_pages, seqs) = (200, 4);
    let sched = SchedConfig {
        max_batch_tokens: 64,
        max_seqs: seqs,
        page_size: 8,
        num_pages,
        max_context: 8 * 60,
        max_waiting: 64,
        prefix_cache: prefix,
        snapshot_interval: 0,
    };
    let caches = CpuCacheConfig {
        num_pages,
        page_size: 8,
        num_slots: seqs,
        snapshot_slots: prefix.device_slots,
        host_snapshot_slots: prefix.host_slots,
    };
    let mut backend = CpuBackend::new(model, caches);
    backend.emulate_host_picks(host_every);
    let opts = EngineOptions { lookahead, ..EngineOptions::default() };
    EngineHandle::start_with(Box::new(backend), sched, None, opts).unwrap()
}

/// (token ids, finish reason, prompt tokens restored from the cache)
type Out = (Vec<u32>, FinishReason, usize);

fn run(e: &EngineHandle, r: Request) -> Out {
    let mut s = e.submit(r).unwrap();
    let mut ids = Vec::new();
    loop {
        match s.blocking_next() {
            Some(Event::Token { id, .. }) => ids.push(id),
            Some(Event::Finished { reason, usage, .. }) => return (ids, reason, usage.cached_tokens),
            other => panic!("unexpected {other:?}"),
        }
    }
}

/// Runs `reqs` at once (staggered starts).
fn run_all(e: &EngineHandle, reqs: &[Request]) -> Vec<Out> {
    let handles: Vec<_> = reqs
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let (e, r) = (e.clone(), r.clone());
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis((i as u64 * 5) % 17));
                run(&e, r)
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

fn prompt(seed: u64, n: usize) -> Vec<u32> {
    let mut x = seed;
    (0..n)
        .map(|_| {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((x >> 33) % 990) as u32
        })
        .collect()
}

fn sampling(i: usize) -> SamplingParams {
    match i % 3 {
        0 => SamplingParams::greedy(),
        1 => SamplingParams { temperature: 0.8, top_k: 40, top_p: 0.9, seed: Some(i as u64), ..Default::default() },
        _ => SamplingParams { temperature: 1.1, min_p: 0.05, seed: Some(100 + i as u64), ..Default::default() },
    }
}

fn base(i: usize) -> Request {
    Request {
        prompt: prompt(i as u64, 5 + 13 * i % 40),
        max_tokens: 6 + 5 * i % 17,
        sampling: sampling(i),
        snapshot_on_finish: true,
        ..Default::default()
    }
}

/// The workload: batched requests, some stopped by a stop id taken from their free run, then second
/// turns of some of them (prompt + output + a new message), which resume from the first turn's
/// end-of-request snapshot. Returns every output in order.
fn workload(e: &EngineHandle, stops: &[Option<u32>]) -> Vec<Out> {
    let reqs: Vec<Request> =
        (0..stops.len()).map(|i| Request { stop_token_ids: stops[i].into_iter().collect(), ..base(i) }).collect();
    let mut outs = run_all(e, &reqs);
    for (i, r) in reqs.iter().enumerate().filter(|(i, _)| i % 2 == 0) {
        let mut p = r.prompt.clone();
        p.extend(&outs[i].0);
        p.extend(prompt(50 + i as u64, 7));
        let second = run(e, Request { prompt: p, stop_token_ids: vec![], ..r.clone() });
        outs.push(second);
    }
    outs
}

#[test]
fn lookahead_gives_the_tokens_of_one_step_at_a_time() {
    let n = 9;
    // Free runs (no stops) pick the stop ids: a token in the middle of some outputs.
    let plain = engine(false, 0);
    let free = run_all(&plain, &(0..n).map(base).collect::<Vec<_>>());
    plain.shutdown(true);
    let stops: Vec<Option<u32>> =
        free.iter().enumerate().map(|(i, o)| (i % 3 != 2 && o.0.len() > 3).then(|| o.0[o.0.len() / 2])).collect();

    let reference = engine(false, 0);
    let expected = workload(&reference, &stops);
    assert_eq!(wait_released(&reference, IDLE_WITHIN).steps_ahead, 0);
    reference.shutdown(true);
    assert!(expected.iter().any(|o| o.1 == FinishReason::Stop), "some requests stop at a stop id");
    assert!(expected.iter().skip(n).any(|o| o.2 > 0), "second turns resume from the cache");

    for host_every in [0, 3] {
        let e = engine(true, host_every);
        let got = workload(&e, &stops);
        let stats = wait_released(&e, IDLE_WITHIN);
        e.shutdown(true);
        for (i, (g, x)) in got.iter().zip(&expected).enumerate() {
            assert_eq!(g, x, "request {i} (host picks every {host_every})");
        }
        assert!(stats.steps_ahead > stats.steps / 3, "{} of {} steps launched ahead", stats.steps_ahead, stats.steps);
        assert_eq!(stats.sched.slots_in_use, 0);
    }
}

#[test]
fn requests_the_host_must_see_first_step_one_at_a_time() {
    let e = engine(true, 0);
    let penalised = SamplingParams { presence_penalty: 0.5, ..SamplingParams::greedy() };
    let reqs = [
        Request { sampling: penalised, ..base(1) },
        Request { stop_strings: vec!["zzzz".into()], ..base(2) },
        Request { logprobs: Some(2), ..base(3) },
    ];
    for r in reqs {
        let before = e.stats().steps_ahead;
        let (ids, _, _) = run(&e, r.clone());
        assert_eq!(ids.len(), r.max_tokens);
        assert_eq!(wait_released(&e, IDLE_WITHIN).steps_ahead, before, "{r:?}");
    }
    e.shutdown(true);
}

/// The CPU backend, whose `fail_at`-th collection fails (as a device fault would: no launched step
/// remains).
struct Flaky {
    inner: CpuBackend,
    collects: usize,
    fail_at: usize,
}

impl Backend for Flaky {
    fn capabilities(&self) -> Capabilities {
        Capabilities { name: "flaky".into(), ..self.inner.capabilities() }
    }
    fn step(&mut self, batch: &StepBatch, want: Want<'_>, out: &mut StepOut) -> Result<(), BackendError> {
        self.inner.step(batch, want, out)
    }
    fn commit_speculative(&mut self, commits: &[SpecCommit]) -> Result<(), BackendError> {
        self.inner.commit_speculative(commits)
    }
    fn arena_stats(&self) -> deltaserve_backend::ArenaStats {
        self.inner.arena_stats()
    }
    fn launch(
        &mut self,
        batch: &StepBatch,
        valid: usize,
        pick: Pick<'_>,
        feed: Option<&Feed>,
    ) -> Result<(), BackendError> {
        self.inner.launch(batch, valid, pick, feed)
    }
    fn pick_launched(&mut self, pick: Pick<'_>) -> Result<(), BackendError> {
        self.inner.pick_launched(pick)
    }
    fn collect(&mut self, out: &mut Picked) -> Result<(), BackendError> {
        self.collects += 1;
        if self.collects == self.fail_at {
            while self.inner.collect(&mut Picked::default()).is_ok() {}
            return Err(BackendError::Device("injected fault".into()));
        }
        self.inner.collect(out)
    }
}

#[test]
fn a_failed_launched_step_fails_its_requests_and_the_engine_goes_on() {
    let plain = engine(false, 0);
    let want = run(&plain, Request { snapshot_on_finish: false, ..base(3) });
    plain.shutdown(true);
    let model = load_model(model_dir());
    let sched = SchedConfig {
        max_batch_tokens: 64,
        max_seqs: 2,
        page_size: 8,
        num_pages: 100,
        max_context: 8 * 60,
        max_waiting: 8,
        prefix_cache: PrefixCacheConfig::disabled(8),
        snapshot_interval: 0,
    };
    let caches =
        CpuCacheConfig { num_pages: 100, page_size: 8, num_slots: 2, snapshot_slots: 0, host_snapshot_slots: 0 };
    let flaky = Flaky { inner: CpuBackend::new(model, caches), collects: 0, fail_at: 5 };
    let e = EngineHandle::start_with(Box::new(flaky), sched, None, EngineOptions::default()).unwrap();
    let mut s = e.submit(Request { snapshot_on_finish: false, ..base(3) }).unwrap();
    let failed = loop {
        match s.blocking_next() {
            Some(Event::Token { .. }) => continue,
            Some(Event::Error(err)) => break err.to_string(),
            other => panic!("expected the injected fault, got {other:?}"),
        }
    };
    assert!(failed.contains("injected fault"), "{failed}");
    assert_eq!(run(&e, Request { snapshot_on_finish: false, ..base(3) }), want, "the next request runs as before");
    assert_eq!(wait_released(&e, IDLE_WITHIN).sched.slots_in_use, 0);
    e.shutdown(true);
}
