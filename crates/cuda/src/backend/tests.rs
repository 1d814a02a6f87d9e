//! Unit tests of the backend's sizing, weight layout and step inputs (no GPU needed).

use deltaserve_model::ModelConfig;
use deltaserve_model::shard::{ShardSpec, Split};
use deltaserve_plan::workspace::STEP_INPUTS;
use deltaserve_plan::{Plan, PlanOptions, WeightsDtype};

use super::inputs::StepInputs;
use super::sizing::{
    ScratchParts, W4_SLICE_BYTES, WSpec, WeightFormat, al, checkpoint_weights_bytes, is_linear, scratch_bytes,
    scratch_bytes_for, shard_bytes, w4_slice_rows, weight_specs, weights_device_bytes,
};

use deltaserve_model::synth::Preset;
use deltaserve_plan::WeightBytes;

fn preset(p: Preset, layers: Option<usize>) -> ModelConfig {
    ModelConfig::from_json_str(&p.config_json(layers).to_string()).unwrap()
}

/// What the backend keeps in f32 beyond the plan's 16-bit pricing (A_log, dt_bias, gated norm).
fn f32_extra(cfg: &ModelConfig) -> usize {
    let d = cfg.dims();
    d.num_deltanet_layers
        * (2 * (al(4 * d.gdn_v_heads) - al(2 * d.gdn_v_heads)) + al(4 * d.gdn_v_dim) - al(2 * d.gdn_v_dim))
}

#[test]
fn int4_weights_place_exactly_what_the_plan_charges() {
    for cfg in [preset(Preset::Qwen36_27b, None), preset(Preset::Tiny, None)] {
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
                    let host: usize = weight_specs(&cfg, WeightFormat::of(&o))
                        .iter()
                        .map(|s| if let WSpec::Host { n } = s { 2 * n } else { 0 })
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

/// Every plan's step inputs form the block one upload writes: token_ids first, the others after it in
/// order within their capacities, nothing live beside them inside it.
#[test]
fn step_inputs_are_one_block() {
    for (p, layers) in [(Preset::Qwen36_27b, None), (Preset::Tiny, Some(4))] {
        let cfg = preset(p, layers);
        for (spec, embed_on_host, memory) in [(0, false, 24u64 << 30), (2, true, 24 << 30), (0, true, 80 << 30)] {
            let mut o = PlanOptions::gpu_defaults(memory);
            o.weights_dtype = WeightsDtype::Int4;
            o.speculative_tokens = spec;
            o.embed_on_host = embed_on_host;
            let plan = Plan::new(&cfg, &o).unwrap();
            let (at, bytes) = StepInputs::block(&plan.workspace).unwrap();
            assert_eq!(at[0].0, 0);
            for (w, name) in at.windows(2).zip(&STEP_INPUTS[1..]) {
                assert!(w[0].0 + w[0].1 <= w[1].0, "{name}");
            }
            assert_eq!(bytes, at[5].0 + at[5].1);
            let s = plan.max_seqs;
            assert!(at[0].1 >= 4 * plan.max_batch_tokens && at[2].1 >= 4 * (s + 1) && at[5].1 >= 4 * s);
        }
    }
    // A buffer live beside the inputs inside their block is refused.
    let plan = Plan::new(&preset(Preset::Tiny, Some(4)), &PlanOptions::gpu_defaults(1 << 30)).unwrap();
    let mut ws = plan.workspace.clone();
    let pos = ws.get("positions").unwrap().clone();
    let other = ws.buffers.iter_mut().find(|b| b.name == "residual").unwrap();
    other.offset = pos.offset;
    assert!(StepInputs::block(&ws).unwrap_err().to_string().contains("residual"));
}

/// The per-rank sizing of a checkpoint's weights (what a tensor-parallel rank places: every tensor
/// cut to its shard) equals the layout of the rank's model shape, for each rank; unsharded, the
/// whole model's.
#[test]
fn checkpoint_bytes_per_rank_are_the_rank_shapes() {
    let dir = std::env::temp_dir().join(format!("ds-cuda-ckpt-bytes-{}", std::process::id()));
    let cfg = deltaserve_model::synth::write_model(&dir, Preset::Tiny, Some(4), 3, |_, _| {}).unwrap();
    for int4 in [true, false] {
        let mut o = PlanOptions::gpu_defaults(1 << 30);
        if int4 {
            o.weights_dtype = WeightsDtype::Int4;
        }
        let fmt = WeightFormat::of(&o);
        if int4 {
            // int4: one entry per linear, as the checkpoint walk counts them.
            assert_eq!(checkpoint_weights_bytes(&cfg, &dir, fmt, None).unwrap(), weights_device_bytes(&cfg, fmt));
        }
        for spec in ShardSpec::all(&cfg, 2).unwrap() {
            let got = checkpoint_weights_bytes(&cfg, &dir, fmt, Some(&spec)).unwrap();
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
fn shard_bytes_cut_whole_elements() {
    // A [4, 3] tensor of 2-byte elements 0..12.
    let vals: Vec<u16> = (0..12).collect();
    let bytes: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
    let back = |b: Vec<u8>| -> Vec<u16> { b.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect() };
    let rows = Split::Rows(vec![1..2, 3..4]);
    assert_eq!(back(shard_bytes::<2>(&rows, "t", &[4, 3], &bytes).unwrap()), vec![3, 4, 5, 9, 10, 11]);
    let cols = Split::Cols(std::iter::once(1..3).collect());
    assert_eq!(back(shard_bytes::<2>(&cols, "t", &[4, 3], &bytes).unwrap()), vec![1, 2, 4, 5, 7, 8, 10, 11]);
    assert!(shard_bytes::<2>(&rows, "t", &[4, 3], &bytes[..23]).is_err());
}

#[test]
fn int4_scratch_adds_the_slice_and_x_scratch() {
    let cfg = preset(Preset::Qwen36_27b, None);
    let mut o = PlanOptions::gpu_defaults(24 << 30);
    let base = scratch_bytes(&cfg, o.max_batch_tokens, o.max_seqs);
    assert_eq!(scratch_bytes_for(&cfg, &o), base);
    o.weights_dtype = WeightsDtype::Int4;
    assert_eq!(scratch_bytes_for(&cfg, &o), base + al(2 * 8 * 17408) + W4_SLICE_BYTES);
    o.weights_dtype = WeightsDtype::Bf16;
    o.lm_head_int4 = true;
    assert_eq!(scratch_bytes_for(&cfg, &o), base + al(2 * 8 * 5120));
    // The tiny model's largest linear fits whole.
    let tiny = preset(Preset::Tiny, None);
    let p = ScratchParts::new(&tiny, 512, 4, true, false);
    let d = tiny.dims();
    assert_eq!(p.w4_slice, 2 * d.hidden * d.intermediate.max(d.conv_channels));
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
