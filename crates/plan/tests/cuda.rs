//! What the plan prices for the CUDA backend: its scratch's parts, its weights' device layout against the
//! plan's weight bytes, a checkpoint's tensors per rank, the int4 slice rows and the linear names.

use deltaserve_model::ModelConfig;
use deltaserve_model::shard::ShardSpec;
use deltaserve_model::synth::Preset;
use deltaserve_plan::cuda::{
    ScratchParts, W4_GEMM_MAX_ROWS, W4_SLICE_BYTES, WeightFormat, WeightTensor, w4_gemm_workspace_bound, w4_slice_rows,
};
use deltaserve_plan::cuda::{weight_tensors, weights_device_bytes};
use deltaserve_plan::{ALIGN, CheckpointTensors, Plan, PlanBackend, PlanOptions, WeightBytes, WeightsDtype, is_linear};

fn al(x: usize) -> usize {
    x.next_multiple_of(ALIGN as usize)
}

/// What the backend keeps in f32 beyond the plan's 16-bit pricing (A_log, dt_bias, gated norm).
fn f32_extra(cfg: &ModelConfig) -> usize {
    let d = cfg.dims();
    d.num_deltanet_layers
        * (2 * (al(4 * d.gdn_v_heads) - al(2 * d.gdn_v_heads)) + al(4 * d.gdn_v_dim) - al(2 * d.gdn_v_dim))
}

#[test]
fn int4_weights_place_exactly_what_the_plan_charges() {
    for cfg in [Preset::Qwen36_27b.config(None), Preset::Tiny.config(None)] {
        for asym in [false, true] {
            for (lm_head_int4, spec) in [(false, 0), (true, 0), (false, 2), (true, 3)] {
                for embed_on_host in [false, true] {
                    let mut o = PlanOptions::gpu_defaults(24 << 30);
                    o.weights_dtype = WeightsDtype::Int4;
                    o.int4_asym = asym;
                    o.lm_head_int4 = lm_head_int4;
                    o.embed_on_host = embed_on_host;
                    // With speculative decoding the MTP head's linears are int4 too.
                    o.speculative_tokens = spec;
                    let plan = WeightBytes::new(&cfg, &o).unwrap();
                    assert_eq!(plan.mtp > 0, spec > 0 && cfg.mtp_num_hidden_layers > 0);
                    let ours = weights_device_bytes(&cfg, WeightFormat::of(&o));
                    assert_eq!(
                        ours,
                        plan.device() as usize + f32_extra(&cfg),
                        "hidden {} asym {asym} lm_head_int4 {lm_head_int4} embed_on_host {embed_on_host} \
                         spec {spec}",
                        cfg.dims().hidden
                    );
                    // The host table is the plan's host weights.
                    let host: usize = weight_tensors(&cfg, WeightFormat::of(&o))
                        .iter()
                        .map(|s| if let WeightTensor::Host { n } = s { 2 * n } else { 0 })
                        .sum();
                    assert_eq!(host as u64, plan.host());
                }
            }
        }
        // bf16: fused pairs only save alignment padding.
        let o = PlanOptions::gpu_defaults(24 << 30);
        let plan = WeightBytes::new(&cfg, &o).unwrap().device() as usize;
        let ours = weights_device_bytes(&cfg, WeightFormat::of(&o));
        assert!(ours <= plan + f32_extra(&cfg) && ours + 4096 * cfg.dims().num_layers >= plan);
    }
}

/// The per-rank sizing of a checkpoint's weights (what a tensor-parallel rank places: every tensor
/// cut to its shard) equals the layout of the rank's model shape, for each rank; unsharded, the
/// whole model's.
#[test]
fn checkpoint_bytes_per_rank_are_the_rank_shapes() {
    let dir = std::env::temp_dir().join(format!("ds-plan-ckpt-bytes-{}", std::process::id()));
    let cfg = deltaserve_model::synth::write_model(&dir, Preset::Tiny, Some(4), 3, |_, _| {}).unwrap();
    let bytes = |spec: Option<&ShardSpec>, fmt| CheckpointTensors::walk(&cfg, &dir, spec).unwrap().device_bytes(fmt);
    for int4 in [true, false] {
        let mut o = PlanOptions::gpu_defaults(1 << 30);
        if int4 {
            o.weights_dtype = WeightsDtype::Int4;
        }
        let fmt = WeightFormat::of(&o);
        if int4 {
            // int4: one entry per linear, as the checkpoint walk counts them.
            assert_eq!(bytes(None, fmt), weights_device_bytes(&cfg, fmt));
        }
        for spec in ShardSpec::all(&cfg, 2).unwrap() {
            let got = bytes(Some(&spec), fmt);
            let rank = spec.rank_config(&cfg);
            if int4 {
                assert_eq!(got, weights_device_bytes(&rank, fmt), "rank {}", spec.rank);
            } else {
                // bf16 pairs are fused in the layout (one alignment instead of two).
                let layout = weights_device_bytes(&rank, fmt);
                assert!(got >= layout && got <= layout + 2 * 256 * rank.layer_types.len(), "rank {}", spec.rank);
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn int4_scratch_adds_the_slice_the_x_scratch_and_the_gemm_workspace() {
    let cfg = Preset::Qwen36_27b.config(None);
    let mut o = PlanOptions::gpu_defaults(24 << 30);
    let base = ScratchParts::new(&cfg, o.max_batch_tokens, o.max_seqs, WeightsDtype::Bf16, false).total();
    assert_eq!(ScratchParts::of(&cfg, &o).total(), base);
    o.weights_dtype = WeightsDtype::Int4;
    // x for up to 256 rows of the widest input (down: 17408); the split-K partial sums of the linear
    // that needs most on a GPU of 200 SMs: DeltaNet qkv (10240 outputs, 80 row tiles) in 4 splits at 192
    // rows (three 64-token tiles; down's 40 row tiles: 8 splits of 5120 outputs, the same bytes).
    let ws = w4_gemm_workspace_bound(10240, 5120, W4_GEMM_MAX_ROWS);
    assert_eq!(ws, 4 * 192 * 10240 * 4);
    assert_eq!(w4_gemm_workspace_bound(5120, 17408, W4_GEMM_MAX_ROWS), 8 * 192 * 5120 * 4);
    assert_eq!(w4_gemm_workspace_bound(12288, 5120, W4_GEMM_MAX_ROWS), 4 * 128 * 12288 * 4);
    assert_eq!(ScratchParts::of(&cfg, &o).total(), base + al(2 * 256 * 17408) + W4_SLICE_BYTES + al(ws));
    o.weights_dtype = WeightsDtype::Bf16;
    o.lm_head_int4 = true;
    assert_eq!(ScratchParts::of(&cfg, &o).total(), base + al(2 * 8 * 5120));
    // The tiny model's largest linear fits whole.
    let tiny = Preset::Tiny.config(None);
    let p = ScratchParts::new(&tiny, 512, 4, WeightsDtype::Int4, false);
    let d = tiny.dims();
    assert_eq!(p.w4_slice, 2 * d.hidden * d.intermediate.max(d.conv_channels));
    // Steps of 4 tokens: the x scratch still holds the GEMV's 8 rows.
    assert_eq!(ScratchParts::new(&tiny, 4, 4, WeightsDtype::Int4, false).w4_x, 2 * 8 * d.intermediate.max(d.hidden));
}

#[test]
fn fp8_scratch_adds_the_activation_codes_and_scales_and_the_slice() {
    let cfg = Preset::Qwen36_27b.config(None);
    let mut o = PlanOptions::gpu_defaults(24 << 30);
    let base = ScratchParts::of(&cfg, &o).total();
    o.weights_dtype = WeightsDtype::Fp8Block;
    let t = o.max_batch_tokens;
    // e4m3 codes of t tokens of the widest input (down: 17408), then one f32 scale per token and 128 inputs.
    let x = al(t * 17408) + 4 * t * 136;
    assert_eq!(deltaserve_plan::cuda::fp8_x_scratch_bytes(t, 17408), x);
    assert_eq!(ScratchParts::of(&cfg, &o).total(), base + al(x) + W4_SLICE_BYTES);
    // Every decoder linear one fp8 tensor: codes plus the scales of its 128×128 blocks, each 256-aligned.
    let f = WeightFormat::of(&o);
    let ts = weight_tensors(&cfg, f);
    let down = ts.iter().find(|t| matches!(t, WeightTensor::Fp8 { out: 5120, inp: 17408 })).unwrap();
    assert_eq!(down.device_bytes(), al(5120 * 17408) + al(4 * 40 * 136));
    assert!(!ts.iter().any(|t| matches!(t, WeightTensor::W4 { .. })));
}

#[test]
fn slice_rows_at_the_27b_shapes() {
    for (out, inp, rows) in [(17408, 5120, 6528), (5120, 17408, 1920), (10240, 5120, 6528), (1024, 5120, 1024)] {
        let r = w4_slice_rows(out, inp, W4_SLICE_BYTES);
        assert_eq!(r, rows, "[{out}, {inp}]");
        assert!(2 * r * inp <= W4_SLICE_BYTES);
    }
    assert_eq!(w4_slice_rows(100, 1 << 30, W4_SLICE_BYTES), 0);
    assert_eq!(w4_slice_rows(48, 128, 1 << 20), 48);
}

#[test]
fn linear_names() {
    assert!(is_linear("model.language_model.layers.3.linear_attn.in_proj_qkv.weight"));
    assert!(is_linear("model.layers.0.mlp.down_proj.weight"));
    assert!(!is_linear("model.layers.0.linear_attn.conv1d.weight"));
    assert!(!is_linear("model.layers.0.self_attn.q_norm.weight"));
    assert!(!is_linear("lm_head.weight"));
}

#[test]
fn the_cpu_backend_has_no_scratch() {
    let cfg = Preset::Tiny.config(None);
    let p = Plan::new(&cfg, &PlanOptions::cpu_defaults(1 << 30)).unwrap();
    assert_eq!(p.backend_scratch_bytes, 0);
    let gpu = PlanOptions { backend: PlanBackend::Generic, ..PlanOptions::gpu_defaults(1 << 30) };
    assert_eq!(Plan::new(&cfg, &gpu).unwrap().backend_scratch_bytes, 0);
}

/// A mixture-of-experts model's bf16 layout places every expert (one block per layer), the router and
/// the shared expert at its own width: what the plan charges, up to alignment padding.
#[test]
fn bf16_experts_place_what_the_plan_charges() {
    for p in [Preset::TinyMoe, Preset::Qwen36_35bA3b] {
        let cfg = p.config(None);
        let o = PlanOptions::gpu_defaults(80 << 30);
        let plan = WeightBytes::new(&cfg, &o).unwrap().device() as usize;
        let ours = weights_device_bytes(&cfg, WeightFormat::of(&o));
        assert!(ours <= plan + f32_extra(&cfg) && ours + 4096 * cfg.dims().num_layers >= plan, "{ours} vs {plan}");
    }
}
