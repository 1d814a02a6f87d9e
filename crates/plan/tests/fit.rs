//! `fit_context`: the default plan aims at the model's full context and trades only the options left open.

use deltaserve_model::ModelConfig;
use deltaserve_model::synth::Preset;
use deltaserve_plan::{Free, KvDtype, Plan, PlanOptions, StateDtype, WeightsDtype, fit_context};

const GIB: u64 = 1 << 30;

fn cfg(preset: &str) -> ModelConfig {
    Preset::parse(preset).unwrap().config(None)
}

fn opts(weights: WeightsDtype, kv: KvDtype, budget: u64) -> PlanOptions {
    PlanOptions { weights_dtype: weights, k_dtype: kv, v_dtype: kv, ..PlanOptions::gpu_defaults(budget) }
}

/// The command: `plan --preset qwen3.6-27b --memory 24GiB --weights-dtype int4 --kv-cache-dtype fp8`.
#[test]
fn qwen36_27b_int4_fp8_24gib_fills_262144() {
    let cfg = cfg("qwen3.6-27b");
    let base = opts(WeightsDtype::Int4, KvDtype::Fp8, 24 * GIB);
    // At the GPU defaults it does not: that is what the fit is for.
    assert!(Plan::new(&cfg, &base).unwrap().max_context < 262_144);

    let f = fit_context(&cfg, &base, Free::all()).unwrap();
    assert_eq!(f.target_context, 262_144);
    assert!(f.shortfall.is_none());
    assert_eq!(f.plan.max_context, 262_144);
    assert!(f.plan.total_bytes <= 24 * GIB);
    // Cheapest first, and only as far as needed.
    assert_eq!(f.adjustments, ["--snapshot-slots 8 -> 4", "--max-seqs 16 -> 8", "--embed-on-host", "--lm-head-int4"]);
    let o = &f.plan.options;
    assert!(o.embed_on_host && o.lm_head_int4);
    assert_eq!((o.max_seqs, o.snapshot_slots), (8, 4));
    // The plan is the plain plan of the options it reports.
    assert_eq!(Plan::new(&cfg, o).unwrap(), f.plan);
}

/// With MTP the fit trades sequences per step for the full context; the note says how many a bf16 DeltaNet
/// state keeps there (the plan itself stays f32: a format the user chooses), and nothing where it did not
/// trade them.
#[test]
fn traded_sequences_hint_at_a_bf16_state() {
    let cfg = cfg("qwen3.6-27b");
    let base = PlanOptions { speculative_tokens: 3, ..opts(WeightsDtype::Int4, KvDtype::Fp8, 24 * GIB) };
    let f = fit_context(&cfg, &base, Free::all()).unwrap();
    assert_eq!((f.plan.max_context, f.plan.max_seqs, f.plan.options.state_dtype), (262_144, 4, StateDtype::F32));
    let note = f.note.expect("a note");
    assert!(note.contains("--state-dtype bf16") && note.contains("keeps 8 sequences"), "{note}");
    let bf16 = PlanOptions { state_dtype: StateDtype::Bf16, ..base.clone() };
    let g = fit_context(&cfg, &bf16, Free::all()).unwrap();
    assert_eq!((g.plan.max_context, g.plan.max_seqs, g.note), (262_144, 8, None));
    let big = fit_context(&cfg, &PlanOptions { budget_bytes: 80 * GIB, ..base }, Free::all()).unwrap();
    assert!(big.note.is_none(), "{:?}", big.note);
}

#[test]
fn a_plan_that_already_fills_is_left_alone() {
    let cfg = cfg("qwen3.6-27b");
    let base = opts(WeightsDtype::Bf16, KvDtype::Bf16, 139 * GIB);
    let f = fit_context(&cfg, &base, Free::all()).unwrap();
    assert!(f.adjustments.is_empty() && f.shortfall.is_none());
    assert_eq!(f.plan, Plan::new(&cfg, &base).unwrap());
}

#[test]
fn options_the_user_set_are_never_changed() {
    let cfg = cfg("qwen3.6-27b");
    let base = opts(WeightsDtype::Int4, KvDtype::Fp8, 24 * GIB);
    let free = Free { max_seqs: false, ..Free::all() };
    let f = fit_context(&cfg, &base, free).unwrap();
    assert_eq!(f.plan.options.max_seqs, 16);
    assert!(f.adjustments.iter().all(|a| !a.contains("max-seqs")));
    // Nothing open at all: exactly the plan of the settings given.
    let f = fit_context(&cfg, &base, Free::default()).unwrap();
    assert_eq!(f.plan, Plan::new(&cfg, &base).unwrap());
    assert!(f.adjustments.is_empty());
    assert!(f.shortfall.as_deref().unwrap().contains("262,144"), "{:?}", f.shortfall);
}

#[test]
fn bf16_weights_never_get_an_int4_lm_head() {
    let cfg = cfg("qwen3.6-27b");
    let base = opts(WeightsDtype::Bf16, KvDtype::Bf16, 80 * GIB);
    let f = fit_context(&cfg, &base, Free::all()).unwrap();
    assert!(!f.plan.options.lm_head_int4);
}

#[test]
fn unreachable_target_takes_the_fewest_trades_near_the_most_context() {
    let cfg = cfg("qwen3.6-27b");
    // int4 + fp8 KV in 22 GiB (a 24 GB card with a display): 262,144 tokens fit with no rung; the
    // user's settings alone fill only ~21K, every rung ~259K at one sequence a step.
    let base = opts(WeightsDtype::Int4, KvDtype::Fp8, 22 * GIB);
    let f = fit_context(&cfg, &base, Free::all()).unwrap();
    let all = PlanOptions {
        max_seqs: 1,
        snapshot_slots: 1,
        embed_on_host: true,
        lm_head_int4: true,
        ..opts(WeightsDtype::Int4, KvDtype::Fp8, 22 * GIB)
    };
    let best = Plan::new(&cfg, &all).unwrap().max_context;
    assert!(best < 262_144 && Plan::new(&cfg, &base).unwrap().max_context < best / 4);
    assert!(f.plan.max_context as f64 >= deltaserve_plan::NEAR_BEST * best as f64, "{}", f.plan.max_context);
    // ... and not by the last rungs: several sequences a step remain.
    assert!(f.plan.options.max_seqs >= 4 && f.plan.options.embed_on_host && f.plan.options.lm_head_int4);
    let why = f.shortfall.unwrap();
    assert!(why.contains("tokens fit with --snapshot-slots") && why.contains("every open option traded"), "{why}");
    assert!(why.contains(&f.adjustments.join(", ")), "{why}");

    // bf16 weights (~54 GB) in 60 GiB: no rung comes near the full context; the same rule applies.
    let base = opts(WeightsDtype::Bf16, KvDtype::Bf16, 60 * GIB);
    let f = fit_context(&cfg, &base, Free::all()).unwrap();
    assert!(f.plan.max_context < 262_144 && f.plan.max_context > Plan::new(&cfg, &base).unwrap().max_context);
    assert!(f.shortfall.unwrap().contains("tokens fit"));
}

#[test]
fn explicit_max_context_is_reached_by_trading_open_options() {
    let cfg = cfg("qwen3.6-27b");
    let base = PlanOptions { max_context: Some(200_000), ..opts(WeightsDtype::Int4, KvDtype::Fp8, 24 * GIB) };
    assert!(Plan::new(&cfg, &base).is_err());
    let f = fit_context(&cfg, &base, Free::all()).unwrap();
    assert_eq!(f.plan.max_context, 200_000);
    assert!(!f.adjustments.is_empty());
    // With nothing open, the plan's own error (with its hints).
    let err = fit_context(&cfg, &base, Free::default()).unwrap_err();
    assert!(err.to_string().contains("200000") || err.to_string().contains("200,000"), "{err}");
}

#[test]
fn backend_scratch_is_recomputed_for_each_candidate() {
    let cfg = cfg("qwen3.6-27b");
    let base = PlanOptions { max_batch_tokens: 512, max_seqs: 64, ..opts(WeightsDtype::Int4, KvDtype::Fp8, 24 * GIB) };
    let f = fit_context(&cfg, &base, Free::all()).unwrap();
    let o = &f.plan.options;
    assert!(o.max_seqs < base.max_seqs, "{:?}", f.adjustments);
    let scratch = deltaserve_plan::cuda::ScratchParts::of(&cfg, o).total() as u64;
    assert_eq!(f.plan.backend_scratch_bytes, scratch);
    assert!(scratch < deltaserve_plan::cuda::ScratchParts::of(&cfg, &base).total() as u64);
}
