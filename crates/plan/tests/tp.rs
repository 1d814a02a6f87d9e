//! The per-card plan under tensor parallelism: at TP=N each card holds its shard (weights, its kv
//! heads' KV, its DeltaNet value heads' state), so per-card KV per token and state per sequence are
//! 1/N of TP=1's for the 27B at N = 2, 4; the budget is one card's; world sizes that split a head group
//! are refused naming the heads; what fits in 24 GiB per card with bf16 weights.

use deltaserve_model::ModelConfig;
use deltaserve_model::synth::Preset;
use deltaserve_plan::size::GIB;
use deltaserve_plan::{Free, KvDtype, Plan, PlanError, PlanOptions, WeightsDtype, card_config, fit_context};

fn cfg_27b() -> ModelConfig {
    Preset::Qwen36_27b.config(None)
}

fn opts(budget: u64, tp: usize) -> PlanOptions {
    PlanOptions { tensor_parallel: tp, ..PlanOptions::gpu_defaults(budget) }
}

#[test]
fn kv_and_state_per_card_divide_by_the_world() {
    let cfg = cfg_27b();
    let one = Plan::new(&cfg, &opts(80 * GIB, 1)).unwrap();
    for tp in [2, 4] {
        let p = Plan::new(&cfg, &opts(80 * GIB, tp)).unwrap();
        assert_eq!(p.kv_bytes_per_token * tp as u64, one.kv_bytes_per_token, "TP={tp}");
        assert_eq!(p.state_bytes_per_seq * tp as u64, one.state_bytes_per_seq, "TP={tp}");
        // 16 attention layers × K,V × (4 / tp) kv heads × 256 × bf16.
        assert_eq!(p.kv_bytes_per_token, 16 * 2 * (4 / tp as u64) * 256 * 2);
        // 48 DeltaNet layers × (48 / tp value heads × 128 × 128 × f32 + 3 × 10240 / tp conv channels × bf16).
        assert_eq!(p.state_bytes_per_seq, 48 * ((48 / tp as u64) * 128 * 128 * 4 + 3 * (10240 / tp as u64) * 2));
        // Weights: every split tensor divides exactly at the 27B's shapes; norms are replicated.
        let parts = (p.weight_parts.linears, p.weight_parts.embed, p.weight_parts.lm_head);
        assert_eq!(
            (parts.0 * tp as u64, parts.1 * tp as u64, parts.2 * tp as u64),
            (one.weight_parts.linears, one.weight_parts.embed, one.weight_parts.lm_head),
            "TP={tp}"
        );
        assert_eq!(p.weight_parts.dense, {
            // Norms stay whole; conv taps, A_log, dt_bias are split (each tensor 256-byte aligned).
            let al = |x: u64| x.next_multiple_of(256);
            al(5120 * 2)
                + 64 * 2 * al(5120 * 2)
                + 48 * (al(10240 / tp as u64 * 4 * 2) + 2 * al(48 / tp as u64 * 2) + al(128 * 2))
                + 16 * 2 * al(256 * 2)
        });
        // The gathered logits are full width (+ the card's shard); the per-card dims are the card's.
        assert_eq!(p.model_vocab, 248_320);
        assert_eq!((p.dims.kv_heads, p.dims.gdn_v_heads, p.dims.vocab), (4 / tp, 48 / tp, 248_320 / tp));
        assert_eq!(p.logits_bytes, 16 * (248_320 + 248_320 / tp as u64) * 4);
        let table = p.table();
        assert!(table.contains(&format!("per card, TP={tp}")), "{table}");
        let j = p.to_json();
        assert_eq!(j["tensor_parallel"], tp);
        assert_eq!(j["scope"], format!("per card, TP={tp}"));
        assert_eq!(j["model"]["card_kv_heads"], 4 / tp);
        // A card holds less, so the context it can fill at the same per-card budget grows.
        assert!(p.max_context >= one.max_context);
    }
}

#[test]
fn world_sizes_that_split_heads_are_refused() {
    let cfg = cfg_27b();
    let e = Plan::new(&cfg, &opts(80 * GIB, 8)).unwrap_err();
    let PlanError::InvalidOption { option, reason, .. } = &e else { panic!("{e}") };
    assert_eq!(*option, "--tensor-parallel");
    assert!(reason.contains("4 attention kv heads") && reason.contains("24 query heads"), "{e}");
    let e = Plan::new(&cfg, &opts(80 * GIB, 3)).unwrap_err().to_string();
    assert!(e.contains("--tensor-parallel 3") && e.contains("1, 2, 4 or 8"), "{e}");
    assert!(card_config(&cfg, 0).is_err());
    assert_eq!(card_config(&cfg, 1).unwrap(), cfg);
}

/// `deltaserve plan --preset qwen3.6-27b --memory 24GiB --weights-dtype bf16 --tensor-parallel N`.
#[test]
fn qwen36_27b_bf16_in_24gib_per_card() {
    let cfg = cfg_27b();
    let budget = 24 * GIB;
    let fit = |tp: usize| fit_context(&cfg, &opts(budget, tp), Free::all());
    // TP=1 and TP=2: the bf16 weights alone do not fit one 24 GiB card (50.1 GiB, 25.05 GiB per card).
    for tp in [1, 2] {
        let e = fit(tp).unwrap_err();
        let PlanError::WeightsDoNotFit { weights, .. } = e else { panic!("TP={tp}: {e}") };
        println!("TP={tp}: bf16 weights {:.2} GiB per card: do not fit 24 GiB", weights as f64 / GIB as f64);
        assert!(weights > budget - 600 * (1 << 20));
    }
    // TP=4: 12.5 GiB of weights per card, the full 262,144-token context fits with room to spare.
    let f = fit(4).unwrap();
    let p = &f.plan;
    println!(
        "TP=4: weights {:.2} GiB per card, KV {} B/token, state {} B/seq, max_context {} ({} at full context), {:?}",
        p.weights_bytes as f64 / GIB as f64,
        p.kv_bytes_per_token,
        p.state_bytes_per_seq,
        p.max_context,
        p.max_full_context_seqs,
        f.adjustments
    );
    assert!(f.shortfall.is_none());
    assert_eq!(p.max_context, 262_144);
    assert!(f.adjustments.is_empty(), "{:?}", f.adjustments);
    assert!(p.weights_bytes < 13 * GIB && p.weights_bytes > 12 * GIB);
    assert!(p.total_bytes <= budget);
    // The dual-card case: int4 weights, TP=2, 24 GiB per card: the full context fits too.
    let o = PlanOptions { weights_dtype: WeightsDtype::Int4, k_dtype: KvDtype::Bf16, ..opts(budget, 2) };
    let f2 = fit_context(&cfg, &o, Free::all()).unwrap();
    println!("TP=2 int4: max_context {} ({:?})", f2.plan.max_context, f2.adjustments);
    assert_eq!(f2.plan.max_context, 262_144);
}

#[test]
fn tensor_parallel_reserves_nccl_memory_per_card_on_the_gpu() {
    use deltaserve_plan::COLLECTIVE_RESERVE_BYTES;
    let mut o = PlanOptions::gpu_defaults(24 * GIB);
    let base = o.runtime_reserve_bytes;
    o.set_tensor_parallel(2);
    assert_eq!((o.tensor_parallel, o.runtime_reserve_bytes), (2, base + COLLECTIVE_RESERVE_BYTES));
    // Setting it again does not add twice; back to one card removes it.
    o.set_tensor_parallel(4);
    assert_eq!(o.runtime_reserve_bytes, base + COLLECTIVE_RESERVE_BYTES);
    o.set_tensor_parallel(1);
    assert_eq!(o.runtime_reserve_bytes, base);
    // The CPU reference has no runtime reserve and no NCCL.
    let mut c = PlanOptions::cpu_defaults(GIB);
    c.set_tensor_parallel(2);
    assert_eq!(c.runtime_reserve_bytes, 0);
    // The plan counts it and says what it is for.
    let cfg = cfg_27b();
    let mut o = PlanOptions::gpu_defaults(24 * GIB);
    o.weights_dtype = WeightsDtype::Int4;
    o.set_tensor_parallel(2);
    let p = Plan::new(&cfg, &o).unwrap();
    assert_eq!(p.total_bytes - p.arena_bytes(), base + COLLECTIVE_RESERVE_BYTES + o.graph_reserve_bytes);
    assert!(p.table().contains("NCCL"), "{}", p.table());
}
