//! "Boots = fills" on the CPU backend: with a memory budget that allows only a short context, the
//! plan advertises exactly what fits; a single prompt of exactly that length completes, one token
//! more is refused with a clear error before any work, and the engine keeps serving.

mod common;

use std::sync::Arc;

use deltaserve_cpu::{CpuBackend, CpuCacheConfig};
use deltaserve_engine::{EngineError, EngineHandle, Event, FinishReason, Request, SamplingParams};
use deltaserve_model::ModelConfig;
use deltaserve_plan::{Plan, PlanOptions};
use deltaserve_sched::{AdmitError, PrefixCacheConfig, SchedConfig};
use deltaserve_text::Tokenizer;

use common::{load_model, tiny_model};

#[test]
fn the_advertised_context_fills_to_exactly_100_percent() {
    let dir = tiny_model("fill", 4);
    let cfg = ModelConfig::from_dir(&dir).unwrap();
    // A budget with room for the fixed regions plus a few hundred tokens of KV.
    let probe = Plan::new(&cfg, &PlanOptions { max_seqs: 2, ..PlanOptions::cpu_defaults(1 << 30) }).unwrap();
    let fixed = probe.total_bytes - probe.num_kv_pages as u64 * probe.kv_page_bytes();
    let budget = fixed + 21 * probe.kv_page_bytes() + 100;
    let plan = Plan::new(&cfg, &PlanOptions { max_seqs: 2, ..PlanOptions::cpu_defaults(budget) }).unwrap();
    assert!(plan.max_context >= 600 && plan.max_context < 1000, "max_context {}", plan.max_context);
    assert!(plan.total_bytes <= budget);

    let model = load_model(&dir);
    let backend = CpuBackend::new(
        model,
        CpuCacheConfig {
            num_pages: plan.num_kv_pages,
            page_size: plan.page_size,
            num_slots: plan.num_state_slots,
            snapshot_slots: 0,
            host_snapshot_slots: 0,
        },
    );
    let sched = SchedConfig {
        max_batch_tokens: plan.max_batch_tokens,
        max_seqs: plan.max_seqs,
        page_size: plan.page_size,
        num_pages: plan.num_kv_pages,
        max_context: plan.max_context,
        max_waiting: 8,
        prefix_cache: PrefixCacheConfig::disabled(plan.page_size),
        snapshot_interval: 0,
    };
    let tok = Arc::new(Tokenizer::from_file(&dir.join("tokenizer.json")).unwrap());
    let engine = EngineHandle::start(Box::new(backend), sched, Some(tok));
    let arena = engine.stats().arena;
    let n = plan.max_context;
    let req = |len: usize, max_tokens: usize| Request {
        prompt: (0..len).map(|i| (i * 31 % 990) as u32).collect(),
        max_tokens,
        sampling: SamplingParams::greedy(),
        stop_token_ids: vec![],
        stop_strings: vec![],
        logprobs: None,
        ..Default::default()
    };
    let finish = |mut s: deltaserve_engine::RequestStream| loop {
        match s.blocking_next() {
            Some(Event::Finished { reason, usage, .. }) => return (reason, usage),
            Some(Event::Token { .. }) => {}
            other => panic!("unexpected {other:?}"),
        }
    };
    // Exactly the advertised context: the whole prompt is cached, one token comes back.
    let (reason, usage) = finish(engine.submit(req(n, 1)).unwrap());
    assert_eq!((reason, usage.prompt_tokens, usage.completion_tokens), (FinishReason::Length, n, 1));
    // Prompt + generation that fill it exactly also work.
    let (_, usage) = finish(engine.submit(req(n - 40, 41)).unwrap());
    assert_eq!(usage.completion_tokens, 41);
    // One token more is refused before any work, with the numbers in the message.
    let err = engine.submit(req(n + 1, 1)).err().expect("refused");
    assert!(
        matches!(&err, EngineError::Admit(AdmitError::ContextTooLong { max_context, .. }) if *max_context == n),
        "{err}"
    );
    assert!(err.to_string().contains(&n.to_string()), "{err}");
    // Still serving, and the arena never moved.
    let (_, usage) = finish(engine.submit(req(10, 5)).unwrap());
    assert_eq!(usage.completion_tokens, 5);
    assert_eq!(engine.stats().arena, arena);
    engine.shutdown(true);
}
