//! The engine end to end on the CPU backend: whatever the batching (many concurrent requests, random
//! arrival, tiny step budgets forcing many prefill chunks, a KV budget small enough to force
//! preemption), every request's tokens equal its solo run; the arena never moves; cancellation,
//! overload and shutdown behave.

mod common;

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use deltaserve_cpu::{CpuBackend, CpuCacheConfig, CpuModel, GdnMode, Logits};
use deltaserve_engine::{EngineError, EngineHandle, Event, FinishReason, Request, Sampler, SamplingParams};
use deltaserve_sched::{AdmitError, PrefixCacheConfig, SchedConfig};
use deltaserve_text::{IncrementalDecoder, Tokenizer};

use common::{load_model, tiny_model, wait_released};

/// How long the engine may take to go idle.
const IDLE_WITHIN: Duration = Duration::from_secs(10);

fn model_dir() -> &'static PathBuf {
    static D: OnceLock<PathBuf> = OnceLock::new();
    D.get_or_init(|| tiny_model("engine-test", 21))
}

fn tokenizer() -> Arc<Tokenizer> {
    Arc::new(Tokenizer::from_file(&model_dir().join("tokenizer.json")).unwrap())
}

fn start(sched: SchedConfig) -> EngineHandle {
    let backend = CpuBackend::new(
        load_model(model_dir()),
        CpuCacheConfig {
            num_pages: sched.num_pages,
            page_size: sched.page_size,
            num_slots: sched.max_seqs,
            snapshot_slots: sched.prefix_cache.device_slots,
            host_snapshot_slots: sched.prefix_cache.host_slots,
        },
    );
    EngineHandle::start(Box::new(backend), sched, Some(tokenizer()))
}

fn sched(max_batch_tokens: usize, num_pages: usize, max_seqs: usize) -> SchedConfig {
    SchedConfig {
        max_batch_tokens,
        max_seqs,
        page_size: 8,
        num_pages,
        max_context: num_pages * 8,
        max_waiting: 64,
        prefix_cache: PrefixCacheConfig::disabled(8),
        snapshot_interval: 0,
    }
}

/// Collects a stream: (token ids, text, finish reason).
fn collect(mut s: deltaserve_engine::RequestStream) -> Result<(Vec<u32>, String, FinishReason), EngineError> {
    let (mut ids, mut text) = (Vec::new(), String::new());
    loop {
        match s.blocking_next() {
            Some(Event::Token { id, text: t, .. }) => {
                ids.push(id);
                text.push_str(&t);
            }
            Some(Event::Finished { reason, .. }) => return Ok((ids, text, reason)),
            Some(Event::Prefill { .. } | Event::PromptLogprobs { .. }) => {}
            Some(Event::Error(e)) => return Err(e),
            None => return Err(EngineError::Stopped),
        }
    }
}

struct Case {
    prompt: Vec<u32>,
    max_tokens: usize,
    sampling: SamplingParams,
}

fn cases(n: usize, seed: u64) -> Vec<Case> {
    let mut x = seed;
    let mut next = move |m: u64| {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (x >> 33) % m
    };
    (0..n)
        .map(|i| {
            let len = 1 + next(150) as usize;
            let prompt = (0..len).map(|_| next(991) as u32).collect();
            // Greedy, sampled, and each with penalties (those rows are picked by the step, `Want::Tokens`).
            let sampling = match i % 6 {
                2 => SamplingParams {
                    temperature: 0.8,
                    top_k: 40,
                    top_p: 0.9,
                    seed: Some(i as u64),
                    ..Default::default()
                },
                4 => SamplingParams {
                    temperature: 1.2,
                    min_p: 0.05,
                    repetition_penalty: 1.2,
                    presence_penalty: 0.4,
                    seed: Some(i as u64),
                    ..Default::default()
                },
                1 => SamplingParams {
                    repetition_penalty: 1.3,
                    presence_penalty: 0.5,
                    frequency_penalty: 0.2,
                    ..SamplingParams::greedy()
                },
                _ => SamplingParams::greedy(),
            };
            Case { prompt, max_tokens: 1 + next(24) as usize, sampling }
        })
        .collect()
}

/// The request alone on the reference model: the prompt in one forward, then one forward per token.
fn solo(model: &CpuModel, tok: &Tokenizer, c: &Case) -> (Vec<u32>, String) {
    let mut sampler = Sampler::new(c.sampling.clone(), tok.vocab_size().min(model.dims.vocab));
    let mut state = model.new_sequence();
    let mut logits = model.forward(&mut state, &c.prompt, GdnMode::Auto, Logits::Last).unwrap();
    let mut context = c.prompt.clone();
    let mut decoder = IncrementalDecoder::new(true);
    let (mut ids, mut text) = (Vec::new(), String::new());
    loop {
        let id = sampler.sample(&mut logits, &context);
        sampler.observe(id);
        ids.push(id);
        context.push(id);
        text.push_str(&decoder.push(tok, id).unwrap());
        if ids.len() == c.max_tokens {
            break;
        }
        logits = model.forward(&mut state, &[id], GdnMode::Auto, Logits::Last).unwrap();
    }
    text.push_str(&decoder.finish(tok).unwrap());
    (ids, text)
}

fn request(c: &Case) -> Request {
    Request {
        prompt: c.prompt.clone(),
        max_tokens: c.max_tokens,
        sampling: c.sampling.clone(),
        stop_token_ids: vec![],
        stop_strings: vec![],
        logprobs: None,
        ..Default::default()
    }
}

#[test]
fn batched_outputs_equal_solo_runs_under_any_batching() {
    let model = load_model(model_dir());
    let tok = tokenizer();
    let cs = cases(14, 5);
    let expected: Vec<_> = cs.iter().map(|c| solo(&model, &tok, c)).collect();
    // (max_batch_tokens, pages of 8 tokens, max_seqs): roomy; tiny steps; KV budget that forces preemption.
    for (mbt, pages, seqs) in [(512, 400, 16), (7, 400, 5), (64, 24, 8)] {
        let engine = start(sched(mbt, pages, seqs));
        let arena_before = engine.stats().arena;
        // Random arrival: submit from several threads with staggered delays.
        let handles: Vec<_> = cs
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let engine = engine.clone();
                let r = request(c);
                std::thread::spawn(move || {
                    std::thread::sleep(Duration::from_millis((i as u64 * 7) % 23));
                    collect(engine.submit(r).unwrap()).unwrap()
                })
            })
            .collect();
        for (i, h) in handles.into_iter().enumerate() {
            let (ids, text, _) = h.join().unwrap();
            assert_eq!((&ids, &text), (&expected[i].0, &expected[i].1), "config ({mbt}, {pages}, {seqs}) request {i}");
        }
        let stats = wait_released(&engine, IDLE_WITHIN);
        assert_eq!(stats.arena, arena_before, "the arena must not move while serving");
        assert_eq!((stats.sched.pages_in_use, stats.sched.slots_in_use), (0, 0));
        if pages == 24 {
            assert!(stats.sched.preemptions > 0, "the small KV budget should have forced preemption");
        }
        engine.shutdown(true);
    }
}

#[test]
fn over_long_prompts_are_rejected_before_any_work_and_the_engine_stays_fine() {
    let engine = start(sched(32, 8, 2)); // 64 positions
    let fill = Request {
        prompt: vec![5; 64],
        max_tokens: 1,
        sampling: SamplingParams::greedy(),
        stop_token_ids: vec![],
        stop_strings: vec![],
        logprobs: None,
        ..Default::default()
    };
    let (ids, _, reason) = collect(engine.submit(fill.clone()).unwrap()).unwrap();
    assert_eq!((ids.len(), reason), (1, FinishReason::Length));
    let err = engine.submit(Request { prompt: vec![5; 65], ..fill.clone() }).err().expect("rejected");
    assert!(matches!(err, EngineError::Admit(AdmitError::ContextTooLong { prompt: 65, max_context: 64, .. })), "{err}");
    assert!(err.to_string().contains("64"));
    let err = engine.submit(Request { prompt: vec![5; 10], max_tokens: 56, ..fill.clone() }).err().expect("rejected");
    assert!(matches!(err, EngineError::Admit(AdmitError::ContextTooLong { .. })));
    let err = engine.submit(Request { prompt: vec![5_000], ..fill.clone() }).err().expect("rejected");
    assert!(err.to_string().contains("outside the vocabulary"), "{err}");
    let err = engine
        .submit(Request { sampling: SamplingParams { top_p: 2.0, ..Default::default() }, ..fill.clone() })
        .err()
        .unwrap();
    assert!(err.to_string().contains("top_p"));
    // A backend without a vision tower refuses requests that carry images.
    assert!(!engine.runs_images());
    let image = deltaserve_model::ImagePatches { grid_thw: [1, 2, 2], pixels: vec![0.0; 4], hash: [0; 32] };
    let err = engine.submit(Request { images: vec![Arc::new(image)], ..fill.clone() }).err().expect("rejected");
    assert_eq!(err.to_string(), format!("invalid request: {}", deltaserve_engine::NO_VISION_TOWER));
    // still serving
    assert!(collect(engine.submit(Request { prompt: vec![7; 30], max_tokens: 5, ..fill }).unwrap()).is_ok());
    engine.shutdown(true);
}

#[test]
fn dropping_a_stream_cancels_and_frees_its_memory() {
    let engine = start(sched(16, 64, 4));
    let r = Request {
        prompt: vec![3; 40],
        max_tokens: 400,
        sampling: SamplingParams::greedy(),
        stop_token_ids: vec![],
        stop_strings: vec![],
        logprobs: None,
        ..Default::default()
    };
    let mut s = engine.submit(r).unwrap();
    for _ in 0..3 {
        assert!(matches!(s.blocking_next(), Some(Event::Token { .. })));
    }
    drop(s);
    assert_eq!(wait_released(&engine, IDLE_WITHIN).sched.pages_in_use, 0);
    engine.shutdown(false);
}

#[test]
fn full_queue_is_overloaded_and_shutdown_without_drain_ends_streams() {
    let engine = start(SchedConfig { max_waiting: 2, ..sched(4, 64, 1) });
    let r = Request {
        prompt: vec![3; 20],
        max_tokens: 300,
        sampling: SamplingParams::greedy(),
        stop_token_ids: vec![],
        stop_strings: vec![],
        logprobs: None,
        ..Default::default()
    };
    let mut streams: Vec<_> = Vec::new();
    let mut overloaded = 0;
    for _ in 0..8 {
        match engine.submit(r.clone()) {
            Ok(s) => streams.push(s),
            Err(EngineError::Admit(AdmitError::Overloaded { .. })) => overloaded += 1,
            Err(e) => panic!("{e}"),
        }
    }
    assert!(overloaded > 0, "8 submissions against 1 slot and a queue of 2 must overflow");
    engine.shutdown(false);
    for s in streams {
        assert!(matches!(collect(s), Err(EngineError::Stopped)));
    }
    assert!(matches!(engine.submit(r), Err(EngineError::Stopped)));
}

#[test]
fn stop_strings_stop_tokens_and_logprobs() {
    let model = load_model(model_dir());
    let tok = tokenizer();
    let engine = start(sched(64, 64, 4));
    let base = Request {
        prompt: vec![11, 12, 13],
        max_tokens: 40,
        sampling: SamplingParams::greedy(),
        stop_token_ids: vec![],
        stop_strings: vec![],
        logprobs: Some(3),
        ..Default::default()
    };
    let (ids, text, _) = collect(engine.submit(base.clone()).unwrap()).unwrap();
    let solo_text =
        solo(&model, &tok, &Case { prompt: base.prompt.clone(), max_tokens: 40, sampling: SamplingParams::greedy() }).1;
    assert_eq!(text, solo_text);
    // stop at a token id
    let (ids2, _, reason) =
        collect(engine.submit(Request { stop_token_ids: vec![ids[4]], ..base.clone() }).unwrap()).unwrap();
    assert_eq!(reason, FinishReason::Stop);
    assert_eq!(ids2.last(), Some(&ids[4]));
    assert!(ids2.len() <= 5);
    // stop at a string taken from the middle of the text
    let chars: Vec<char> = text.chars().collect();
    if chars.len() > 6 {
        let stop: String = chars[3..6].iter().collect();
        let (_, t3, reason) =
            collect(engine.submit(Request { stop_strings: vec![stop.clone()], ..base.clone() }).unwrap()).unwrap();
        assert_eq!(reason, FinishReason::StopString(stop.clone()));
        assert!(!t3.contains(&stop) && text.starts_with(&t3), "{t3:?} vs {text:?}");
    }
    // logprobs: greedy token is the top-1 and logprobs are <= 0
    let mut s = engine.submit(base).unwrap();
    if let Some(Event::Token { id, logprob: Some(lp), .. }) = s.blocking_next() {
        assert_eq!(lp.top.len(), 3);
        assert_eq!(lp.top[0].0, id);
        assert!((lp.logprob - lp.top[0].1).abs() < 1e-6 && lp.logprob <= 0.0);
    } else {
        panic!("expected a token with logprobs");
    }
    drop(s);
    engine.shutdown(false);
}

/// A request's timing counts the steps that ran its prompt: with a 7-token step budget a 50-token
/// prompt runs in ceil(50 / 7) = 8 steps before its first token, whose wall time lies within the TTFT.
#[test]
fn timing_counts_the_prefill_steps_of_a_request() {
    let engine = start(sched(7, 400, 4));
    let prompt: Vec<u32> = (0..50).map(|i| (i * 37 % 991) as u32).collect();
    let r = Request { prompt, max_tokens: 3, sampling: SamplingParams::greedy(), ..Default::default() };
    let mut s = engine.submit(r).unwrap();
    let timing = loop {
        match s.blocking_next() {
            Some(Event::Finished { timing, .. }) => break timing,
            Some(Event::Token { .. }) => {}
            other => panic!("unexpected {other:?}"),
        }
    };
    assert_eq!(timing.prefill_steps, 8, "{timing:?}");
    assert!(
        timing.prefill_step_ms > 0.0 && timing.prefill_step_ms <= timing.ttft_ms - timing.queue_ms + 1e-6,
        "{timing:?}"
    );
    engine.shutdown(true);
}

/// A request that asks for its prompt's progress hears of every step that ran a part of it, before its
/// first token: a 50-token prompt in 7-token steps comes in at 7, 14, …, 49 and 50 tokens.
#[test]
fn progress_reports_each_prefill_step_before_the_first_token() {
    let engine = start(sched(7, 400, 4));
    let prompt: Vec<u32> = (0..50).map(|i| (i * 41 % 991) as u32).collect();
    let r = Request { prompt, max_tokens: 3, sampling: SamplingParams::greedy(), progress: true, ..Default::default() };
    let mut s = engine.submit(r).unwrap();
    let (mut seen, mut tokens, mut last_ms) = (Vec::new(), 0, 0.0);
    loop {
        match s.blocking_next() {
            Some(Event::Prefill { processed, total, cached, elapsed_ms }) => {
                assert_eq!(tokens, 0, "progress after a token");
                assert_eq!((total, cached), (50, 0));
                assert!(elapsed_ms >= last_ms, "time went back: {elapsed_ms} < {last_ms}");
                last_ms = elapsed_ms;
                seen.push(processed);
            }
            Some(Event::Token { .. }) => tokens += 1,
            Some(Event::Finished { timing, .. }) => {
                assert_eq!(timing.prefill_steps as usize, seen.len());
                break;
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(seen, [7, 14, 21, 28, 35, 42, 49, 50]);
    assert_eq!(tokens, 3);
    engine.shutdown(true);
}

/// Allows one scripted token per step, then only the end token.
struct Script {
    next: Vec<u32>,
    end: u32,
    seen: Arc<std::sync::Mutex<Vec<u32>>>,
}

impl deltaserve_engine::TokenConstraint for Script {
    fn mask(&mut self, row: &mut [f32]) {
        let allowed = self.next.first().copied().unwrap_or(self.end);
        for (id, l) in row.iter_mut().enumerate() {
            if id as u32 != allowed {
                *l = f32::NEG_INFINITY;
            }
        }
    }
    fn accept(&mut self, token: u32) {
        self.seen.lock().unwrap().push(token);
        if self.next.first() == Some(&token) {
            self.next.remove(0);
        }
    }
}

#[test]
fn a_constraint_masks_every_pick_and_follows_every_token() {
    let engine = start(sched(16, 64, 4));
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    for sampling in [SamplingParams::greedy(), SamplingParams { temperature: 1.0, seed: Some(3), ..Default::default() }]
    {
        seen.lock().unwrap().clear();
        let script = Script { next: vec![40, 41, 40, 7], end: 2, seen: seen.clone() };
        let r = Request {
            prompt: vec![3; 12],
            max_tokens: 20,
            sampling,
            stop_token_ids: vec![2],
            constraint: Some(deltaserve_engine::SharedConstraint::new(script)),
            ..Default::default()
        };
        // An unconstrained neighbour in the same batch keeps its own picks.
        let free = engine.submit(Request { constraint: None, stop_token_ids: vec![], ..r.clone() }).unwrap();
        let (ids, _, reason) = collect(engine.submit(r).unwrap()).unwrap();
        assert_eq!(ids, vec![40, 41, 40, 7, 2]);
        assert_eq!(reason, FinishReason::Stop);
        assert_eq!(*seen.lock().unwrap(), ids);
        assert_eq!(collect(free).unwrap().0.len(), 20);
    }
    engine.shutdown(true);
}

/// `n` choices of one prompt: the prompt runs once and the sequence forks; choice `i` equals the
/// request alone with seed `seed + i` (penalties included). With a slot taken by another request,
/// the last choice waits and recomputes, with the same tokens.
#[test]
fn choices_fork_after_the_prompt_and_equal_their_solo_runs() {
    let model = load_model(model_dir());
    let tok = tokenizer();
    let prompt: Vec<u32> = (0..21).map(|i| (i * 37 + 11) % 900).collect(); // a partly filled last page
    let sampling =
        SamplingParams { temperature: 0.9, top_k: 30, presence_penalty: 0.3, seed: Some(5), ..Default::default() };
    let case = |i: u64| Case {
        prompt: prompt.clone(),
        max_tokens: 10,
        sampling: SamplingParams { seed: Some(5 + i), ..sampling.clone() },
    };
    let want: Vec<Vec<u32>> = (0..3).map(|i| solo(&model, &tok, &case(i)).0).collect();
    assert_ne!(want[0], want[1], "the seeds give different choices");
    for (busy, forks) in [(false, 2), (true, 1)] {
        let engine = start(sched(8, 64, 3));
        let other = busy.then(|| engine.submit(request(&Case { max_tokens: 40, ..case(9) })).unwrap());
        let streams = engine.submit_n(request(&case(0)), 3).unwrap();
        let got: Vec<Vec<u32>> = streams.into_iter().map(|s| collect(s).unwrap().0).collect();
        assert_eq!(got, want, "busy: {busy}");
        if let Some(o) = other {
            collect(o).unwrap();
        }
        let st = wait_released(&engine, IDLE_WITHIN);
        assert_eq!(st.sched.forks, forks, "busy: {busy}");
        let prompts = if busy { 2 * prompt.len() as u64 } else { prompt.len() as u64 };
        assert_eq!(st.prompt_tokens, prompts, "the prompt counts once");
        assert!(matches!(engine.submit_n(request(&case(0)), 4), Err(EngineError::Invalid(m)) if m.contains("1..=3")));
        engine.shutdown(true);
    }
}
