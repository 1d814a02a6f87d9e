//! Mixture-of-experts plans: every routed expert's bytes priced, activations bounded by the step's
//! tokens × top-k, and the Qwen3.6-35B-A3B / Qwen3-Next-80B-A3B presets at their real shapes.

use deltaserve_model::ModelConfig;
use deltaserve_model::synth::Preset;
use deltaserve_plan::{KvDtype, Plan, PlanBackend, PlanOptions, WeightsDtype};

const GIB: u64 = 1 << 30;

fn cfg(preset: &str) -> ModelConfig {
    Preset::parse(preset).unwrap().config(None)
}

fn int4_fp8(budget: u64) -> PlanOptions {
    PlanOptions {
        backend: PlanBackend::Generic,
        weights_dtype: WeightsDtype::Int4,
        k_dtype: KvDtype::Fp8,
        v_dtype: KvDtype::Fp8,
        ..PlanOptions::gpu_defaults(budget)
    }
}

#[test]
fn presets_have_the_published_shapes() {
    let c = cfg("qwen3.6-35b-a3b");
    let (d, m) = (c.dims(), c.moe.clone().unwrap());
    assert_eq!((d.hidden, d.num_layers, d.num_attention_layers, d.vocab), (2048, 40, 10, 248_320));
    assert_eq!(
        (d.q_heads, d.kv_heads, d.head_dim, d.gdn_k_heads, d.gdn_v_heads, d.gdn_k_dim),
        (16, 2, 256, 16, 32, 128)
    );
    assert_eq!((m.num_experts, m.top_k, m.expert_intermediate, m.shared_expert_intermediate), (256, 8, 512, 512));
    assert!(m.norm_topk_prob && m.num_sparse_layers() == 40);
    assert_eq!(c.mtp_num_hidden_layers, 1);
    let n = cfg("qwen3-next-80b-a3b");
    let (d, m) = (n.dims(), n.moe.clone().unwrap());
    assert_eq!(
        (d.hidden, d.num_layers, d.num_attention_layers, d.vocab, d.intermediate),
        (2048, 48, 12, 151_936, 5120)
    );
    assert_eq!((m.num_experts, m.top_k, m.expert_intermediate, m.num_sparse_layers()), (512, 10, 512, 48));
}

/// `deltaserve plan --preset qwen3.6-35b-a3b --memory 24GiB --weights-dtype int4 --kv-cache-dtype fp8`.
#[test]
fn qwen36_35b_a3b_int4_experts_fill_the_full_context_at_24gib() {
    let plan = Plan::new(&cfg("qwen3.6-35b-a3b"), &int4_fp8(24 * GIB)).unwrap();
    // One expert: gate and up [512, 2048], down [2048, 512]; int4 with an fp16 scale per 128 inputs.
    let gate = 512 * 2048 / 2 + 512 * (2048 / 128) * 2;
    let down = 2048 * 512 / 2 + 2048 * (512 / 128) * 2;
    let expert = 2 * gate + down;
    assert_eq!(expert, 1_622_016);
    assert_eq!(plan.weight_parts.experts, 40 * 256 * expert);
    assert_eq!(plan.weight_parts.experts_active, 40 * 8 * expert);
    assert!(plan.weight_parts.linears > plan.weight_parts.experts);
    // Router [256, 2048] and shared-expert gate [1, 2048] per layer stay 16-bit, among the dense tensors.
    assert!(plan.weight_parts.dense >= 40 * (256 * 2048 * 2 + 2048 * 2));
    // Attention KV in fp8: 10 layers × 2 kv heads × (K + V) × (256 values + a 2-byte scale).
    assert_eq!(plan.kv_bytes_per_token, 10 * 2 * 2 * (256 + 2));
    assert_eq!(plan.max_context, 262_144, "{}", plan.table());
    assert!(plan.table().contains("mixture of experts: routed experts"), "{}", plan.table());
}

#[test]
fn expert_activations_are_bounded_by_tokens_times_top_k() {
    let c = cfg("qwen3.6-35b-a3b");
    let at = |tokens: usize, context: Option<usize>| {
        let o = PlanOptions { max_batch_tokens: tokens, max_context: context, ..int4_fp8(24 * GIB) };
        Plan::new(&c, &o).unwrap()
    };
    let p = at(2048, None);
    let rows = p.workspace.get("moe_rows_in").unwrap();
    assert_eq!(rows.bytes, 2048 * 8 * 2048 * 2, "[T·k, hidden] bf16");
    assert_eq!(p.workspace.get("moe_gate_up").unwrap().bytes, 2048 * 8 * 2 * 512 * 2);
    assert_eq!(p.workspace.get("moe_router_logits").unwrap().bytes, 2048 * 256 * 4);
    assert_eq!(p.workspace.get("moe_expert_offsets").unwrap().bytes, 2 * 257 * 4, "row and tile prefix sums");
    assert_eq!(p.workspace.get("moe_rows").unwrap().bytes, 2048 * 8 * 4);
    // The same at any context; halving the step's tokens halves them.
    assert_eq!(at(2048, Some(4096)).workspace, p.workspace);
    assert_eq!(at(1024, None).workspace.get("moe_rows_in").unwrap().bytes, rows.bytes / 2);
    assert!(p.workspace.ops.contains(&"moe_unpermute"));
    // Decode's per-pair expert GEMVs read `mlp_in` while writing `moe_gate_up`: never the same bytes.
    let (x, gu) = (p.workspace.get("mlp_in").unwrap(), p.workspace.get("moe_gate_up").unwrap());
    assert!(x.lifetime_overlaps(gu) && !x.address_overlaps(gu));
}

/// With speculation the MTP head's sparse layer runs the experts over its own rows, after the main layers:
/// the `moe_*` buffers stay live through the head, so none shares bytes with the head's buffers.
#[test]
fn the_sparse_mtp_head_keeps_its_expert_buffers() {
    let c = cfg("qwen3.6-35b-a3b");
    let o = PlanOptions { speculative_tokens: 3, ..int4_fp8(40 * GIB) };
    let ws = Plan::new(&c, &o).unwrap().workspace;
    let (moe, mtp): (Vec<_>, Vec<_>) = ws
        .buffers
        .iter()
        .filter(|b| b.name.starts_with("moe_") || b.name.starts_with("mtp_"))
        .partition(|b| b.name.starts_with("moe_"));
    assert!(!moe.is_empty() && !mtp.is_empty());
    for m in &moe {
        for x in &mtp {
            assert!(m.lifetime_overlaps(x) && !m.address_overlaps(x), "{} and {}", m.name, x.name);
        }
    }
}

#[test]
fn qwen3_next_80b_a3b_prices_every_expert() {
    let c = cfg("qwen3-next-80b-a3b");
    let plan = Plan::new(&c, &int4_fp8(64 * GIB)).unwrap();
    assert_eq!(plan.weight_parts.experts, 48 * 512 * 1_622_016);
    assert_eq!(plan.weight_parts.experts_active, 48 * 10 * 1_622_016);
    // 37 GiB of int4 experts do not fit a 24 GiB card: the error says so.
    let e = Plan::new(&c, &int4_fp8(24 * GIB)).unwrap_err().to_string();
    assert!(e.contains("weights"), "{e}");
}

/// The routed-expert bytes a decode step reads (bench's roofline): one token reads its top-k per sparse
/// layer, more tokens more distinct experts, never more than all of them.
#[test]
fn a_step_reads_the_experts_its_tokens_pick() {
    let c = cfg("qwen3.6-35b-a3b");
    let plan = Plan::new(&c, &int4_fp8(64 * GIB)).unwrap();
    let (w, m) = (&plan.weight_parts, c.moe.as_ref().unwrap());
    let read = |t| w.experts_read(m.num_experts, m.top_k, t);
    assert!((read(1) - w.experts_active as f64).abs() < 1.0);
    assert!(read(1) < read(8) && read(8) < read(64) && read(64) < w.experts as f64);
    // 8 tokens, top 8 of 256 experts: 57.4 distinct experts per layer (7.18 tokens' worth), not 64.
    assert!((read(8) / w.experts_active as f64 - 7.18).abs() < 0.01, "{}", read(8) / w.experts_active as f64);
    assert_eq!(plan.weight_parts.experts_read(m.num_experts, m.top_k, 0), 0.0);
}

/// With speculative decoding the MTP head is priced with its mixture of experts: fc, attention, the shared
/// expert and every routed expert in bf16, the router, shared-expert gate and norms 16-bit.
#[test]
fn speculation_prices_the_mtp_heads_experts() {
    let c = cfg("qwen3.6-35b-a3b");
    let bf16 = |spec: usize| PlanOptions {
        backend: PlanBackend::Generic,
        speculative_tokens: spec,
        ..PlanOptions::gpu_defaults(200 * GIB)
    };
    let (off, on) = (Plan::new(&c, &bf16(0)).unwrap(), Plan::new(&c, &bf16(3)).unwrap());
    let mtp = on.weight_parts.mtp;
    assert_eq!(on.weights_bytes - off.weights_bytes, mtp);
    // fc [2048, 4096]; q [8192, 2048], k and v [512, 2048], o [2048, 4096]; shared expert 3 × 512 × 2048;
    // 256 experts × 3 × 512 × 2048; router [256, 2048]; shared-expert gate; 7 norms.
    let params: u64 = 8_388_608
        + 16_777_216
        + 2 * 1_048_576
        + 8_388_608
        + 3 * 1_048_576
        + 256 * 3 * 1_048_576
        + 524_288
        + 2048
        + 5 * 2048
        + 2 * 256;
    assert_eq!(params, 844_640_768);
    let tensors = 5 + 3 + 256 * 3 + 2 + 7;
    assert!((2 * params..2 * params + tensors * 256).contains(&mtp), "{mtp} vs {}", 2 * params);
    // A Qwen3-Next head is sparse as its decoder layer 0 is: dense (priced at `intermediate_size`) when
    // `mlp_only_layers` holds 0.
    let next = |dense: u64| {
        let mut j = Preset::small_qwen3_next_moe();
        j["mlp_only_layers"] = vec![dense].into();
        let c = ModelConfig::from_json_str(&j.to_string()).unwrap();
        Plan::new(&c, &PlanOptions { speculative_tokens: 2, ..PlanOptions::cpu_defaults(GIB) }).unwrap()
    };
    let (sparse, dense) = (next(2).weight_parts.mtp, next(0).weight_parts.mtp);
    // 6 experts of width 64 and a shared expert of 96 against a dense MLP of 256 (f32 weights on the CPU).
    let mlp_params = |w: u64| 3 * 128 * w;
    let diff = 4 * (mlp_params(6 * 64 + 96) - mlp_params(256) + 6 * 128 + 128) as i64;
    let got = sparse as i64 - dense as i64;
    assert!((diff - 40 * 256..=diff + 40 * 256).contains(&got), "{got} vs {diff}");
}
