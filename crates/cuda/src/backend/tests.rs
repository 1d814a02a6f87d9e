//! Unit tests of the backend's carve of the plan's regions, its step inputs and tensor shards (no GPU
//! needed).

use std::path::{Path, PathBuf};

use deltaserve_model::ModelConfig;
use deltaserve_model::shard::{ShardSpec, Split};
use deltaserve_model::synth::Preset;
use deltaserve_model::synth::gptq::{self, GptqVariant};
use deltaserve_plan::cuda::{ScratchParts, WeightFormat};
use deltaserve_plan::workspace::STEP_INPUTS;
use deltaserve_plan::{CheckpointTensors, Plan, PlanBackend, PlanOptions, WeightsDtype};

use super::WeightSource;
use super::inputs::StepInputs;
use super::layout::{Carve, check_plan, weights_bytes};
use super::loader::shard_bytes;

/// Every plan's step inputs form the block one upload writes: token_ids first, the others after it in
/// order within their capacities, nothing live beside them inside it.
#[test]
fn step_inputs_are_one_block() {
    for (p, layers) in [(Preset::Qwen36_27b, None), (Preset::Tiny, Some(4))] {
        let cfg = p.config(layers);
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
    let plan = Plan::new(&Preset::Tiny.config(Some(4)), &PlanOptions::gpu_defaults(1 << 30)).unwrap();
    let mut ws = plan.workspace.clone();
    let pos = ws.get("positions").unwrap().clone();
    let other = ws.buffers.iter_mut().find(|b| b.name == "residual").unwrap();
    other.offset = pos.offset;
    assert!(StepInputs::block(&ws).unwrap_err().to_string().contains("residual"));
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

/// Option sets over the knobs the carve reads: weights format, lm_head, embedding place, speculation,
/// tokens and sequences per step, tensor parallelism.
fn option_sets(cfg: &ModelConfig) -> Vec<PlanOptions> {
    let mut v = Vec::new();
    for int4 in [false, true] {
        for asym in [false, true] {
            for (lm_head_int4, embed_on_host) in [(false, false), (true, false), (false, true), (true, true)] {
                for (tokens, seqs) in [(4096, 16), (512, 4), (700, 3), (8192, 64), (64, 1)] {
                    for tp in [1, 2, 4] {
                        for spec in [0, 2] {
                            if ShardSpec::new(cfg, 0, tp).is_err() || (spec > 0 && cfg.mtp_num_hidden_layers == 0) {
                                continue;
                            }
                            let mut o = PlanOptions::gpu_defaults(80 << 30);
                            o.weights_dtype = if int4 { WeightsDtype::Int4 } else { WeightsDtype::Bf16 };
                            o.int4_asym = asym;
                            o.lm_head_int4 = lm_head_int4;
                            o.embed_on_host = embed_on_host;
                            (o.max_batch_tokens, o.max_seqs) = (tokens, seqs);
                            o.speculative_tokens = spec;
                            o.set_tensor_parallel(tp);
                            v.push(o);
                        }
                    }
                }
            }
        }
    }
    v
}

/// Every rank's model shape and shard (one, unsharded, without tensor parallelism).
fn ranks(cfg: &ModelConfig, tp: usize) -> Vec<(ModelConfig, Option<ShardSpec>)> {
    if tp == 1 {
        return vec![(cfg.clone(), None)];
    }
    ShardSpec::all(cfg, tp).unwrap().into_iter().map(|s| (s.rank_config(cfg), Some(s))).collect()
}

/// The plan's `weights` and `backend_scratch` bytes.
fn planned(p: &Plan) -> (usize, usize) {
    let r = |name| p.region(name).map_or(0, |r| r.bytes as usize);
    (r("weights"), r("backend_scratch"))
}

/// For random weights every rank's carve fits the plan: the scratch's parts exactly fill rank 0's
/// `backend_scratch` (a smaller shard's fit in it), the weights region holds the plan's and the layout's.
#[test]
fn the_carve_fits_the_plans_regions() {
    let configs = [Preset::Tiny.config(None), Preset::Tiny.config(Some(4)), Preset::Qwen36_27b.config(None)];
    for cfg in configs {
        for o in option_sets(&cfg) {
            let Ok(plan) = Plan::new(&cfg, &o) else { continue };
            let (plan_weights, plan_scratch) = planned(&plan);
            let fmt = WeightFormat::of(&o);
            for (rank, shard) in ranks(&cfg, o.tensor_parallel) {
                let what = format!("hidden {} rank {:?} {o:?}", cfg.dims().hidden, shard.as_ref().map(|s| s.rank));
                let served = check_plan(&rank, rank.dims(), &plan, shard.as_ref());
                if o.speculative_tokens > 0 && shard.is_some() {
                    assert!(served.is_err(), "{what}");
                    continue;
                }
                served.unwrap();
                let random = WeightSource::RandomWeights { seed: 1 };
                let w = weights_bytes(&plan, (&cfg, &rank), &random, fmt, shard.as_ref()).unwrap();
                let c = Carve::new(&plan, &rank, w, fmt).unwrap();
                let (t, s) = (plan.max_batch_tokens, plan.max_seqs);
                assert_eq!(c.parts, ScratchParts::new(&rank, t, s, fmt.linears(), fmt.lm_head_int4), "{what}");
                assert!(c.parts.total() <= c.scratch && c.scratch <= plan_scratch, "{what}");
                if shard.as_ref().is_none_or(|s| s.rank == 0) {
                    assert_eq!((c.parts.total(), c.scratch), (plan_scratch, plan_scratch), "{what}");
                }
                assert!(c.weights >= w && c.weights >= plan_weights, "{what}");
            }
        }
    }
}

#[test]
fn a_plan_without_the_cuda_scratch_is_refused() {
    let cfg = Preset::Tiny.config(None);
    let o = PlanOptions { backend: PlanBackend::Generic, ..PlanOptions::gpu_defaults(1 << 30) };
    let plan = Plan::new(&cfg, &o).unwrap();
    let e = check_plan(&cfg, cfg.dims(), &plan, None).unwrap_err().to_string();
    assert!(e.contains("PlanBackend::Cuda"), "{e}");
}

fn scratch_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ds-cuda-carve-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// A quantised checkpoint under int4 weights: every rank's weights region holds the tensors the rank
/// places (its own walk, at most rank 0's that the plan priced), and the weights region plus the scratch
/// are exactly the plan's two regions (what the weights need beyond the plan came from its scratch).
fn check_checkpoint(cfg: &ModelConfig, dir: &Path) {
    for o in option_sets(cfg).into_iter().filter(|o| o.weights_dtype == WeightsDtype::Int4) {
        let tp = o.tensor_parallel;
        let rank0 = (tp > 1).then(|| ShardSpec::new(cfg, 0, tp).unwrap());
        let walked = CheckpointTensors::walk(cfg, dir, rank0.as_ref()).unwrap();
        let with = PlanOptions { backend: PlanBackend::Cuda { checkpoint: Some(walked.into()) }, ..o.clone() };
        let Ok(plan) = Plan::new(cfg, &with) else { continue };
        let (plan_weights, plan_scratch) = planned(&plan);
        let fmt = WeightFormat::of(&o);
        let source = WeightSource::Checkpoint(dir.to_path_buf());
        for (rank, shard) in ranks(cfg, tp) {
            let w = weights_bytes(&plan, (cfg, &rank), &source, fmt, shard.as_ref()).unwrap();
            let own = CheckpointTensors::walk(cfg, dir, shard.as_ref()).unwrap().device_bytes(fmt);
            let c = Carve::new(&plan, &rank, w, fmt).unwrap();
            assert!(own <= c.weights, "{o:?}");
            assert_eq!(c.weights + c.scratch, plan_weights + plan_scratch, "{o:?}");
            assert!(c.parts.total() <= c.scratch, "{o:?}");
        }
    }
}

#[test]
fn a_quantised_checkpoint_fits_the_plans_regions() {
    for (tag, v) in [("sym", GptqVariant::SYM), ("asym", GptqVariant::ASYM_ACT_ORDER)] {
        let dir = scratch_dir(tag);
        deltaserve_model::synth::write_model(&dir, Preset::Tiny, Some(4), 3, |_, _| {}).unwrap();
        gptq::convert(&dir, v, &[], 3, |_| {}).unwrap();
        let cfg = ModelConfig::from_dir(&dir).unwrap();
        assert!(cfg.quantization.is_some());
        check_checkpoint(&cfg, &dir);
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// A mixture-of-experts model takes bf16 and int4 plans (its experts in the plan's format), on one GPU.
#[test]
fn moe_plans_take_bf16_and_int4() {
    let cfg = Preset::TinyMoe.config(Some(4));
    let o = PlanOptions::gpu_defaults(1 << 30);
    assert!(check_plan(&cfg, cfg.dims(), &Plan::new(&cfg, &o).unwrap(), None).is_ok());
    let o4 = PlanOptions { weights_dtype: WeightsDtype::Int4, ..o };
    assert!(check_plan(&cfg, cfg.dims(), &Plan::new(&cfg, &o4).unwrap(), None).is_ok());
}

/// The int4 experts' layout is the plan's: expert e at `e · stride` from expert 0, each linear where
/// the arena places the plan's next int4 tensor.
#[test]
fn int4_expert_layout_is_the_plans() {
    use super::moe::W4ExpertLayout;
    use deltaserve_plan::cuda::{WeightTensor, weight_tensors};
    let cfg = Preset::Qwen36_35bA3b.config(Some(1));
    let m = cfg.moe.clone().unwrap();
    let fmt =
        WeightFormat::of(&PlanOptions { weights_dtype: WeightsDtype::Int4, ..PlanOptions::gpu_defaults(1 << 30) });
    // The layer's tensors from the first expert's gate/up (the shared expert's come before the router).
    let ts = weight_tensors(&cfg, fmt);
    let first =
        ts.iter().position(|t| matches!(t, WeightTensor::W4 { out, .. } if *out == 2 * m.expert_intermediate)).unwrap();
    let w4: Vec<usize> = ts[first..first + 2 * m.num_experts].iter().map(WeightTensor::device_bytes).collect();
    assert!(ts[first..first + 2 * m.num_experts].iter().all(|t| matches!(t, WeightTensor::W4 { .. })));
    let lay = W4ExpertLayout::new(m.expert_intermediate, 2048, fmt.asym, crate::w4::ScaleDtype::Bf16);
    assert_eq!(lay.stride, w4[0] + w4[1]);
    let (g, d) = lay.expert(1 << 20, 3);
    assert_eq!(g.qweight, (1 << 20) + 3 * lay.stride as u64);
    assert_eq!(d.qweight, g.qweight + w4[0] as u64);
    assert_eq!((g.out, g.inp, d.out, d.inp), (1024, 2048, 2048, 512));
}

/// With the routed experts on the host the backend's weights region is the plan's without them: random
/// weights and a GPTQ checkpoint's (its walk prices no expert on the device) fit the plan's regions, and
/// the host block holds what leaves the device. Dense models and tensor parallelism are refused.
#[test]
fn host_experts_leave_the_weights_region() {
    use deltaserve_plan::cuda::host_experts_bytes;
    let cfg = Preset::TinyMoe.config(Some(4));
    for int4 in [false, true] {
        for spec in [0, 2] {
            let mut o = PlanOptions::gpu_defaults(1 << 30);
            if int4 {
                o.weights_dtype = WeightsDtype::Int4;
            }
            o.speculative_tokens = spec;
            let dev = Plan::new(&cfg, &o).unwrap();
            o.experts_on_host = true;
            let host = Plan::new(&cfg, &o).unwrap();
            let fmt = WeightFormat::of(&o);
            check_plan(&cfg, cfg.dims(), &host, None).unwrap();
            let random = WeightSource::RandomWeights { seed: 1 };
            let w = weights_bytes(&host, (&cfg, &cfg), &random, fmt, None).unwrap();
            let w_dev = weights_bytes(&dev, (&cfg, &cfg), &random, WeightFormat::of(&dev.options), None).unwrap();
            assert_eq!(w + host_experts_bytes(&cfg, fmt), w_dev, "int4 {int4} spec {spec}");
            let c = Carve::new(&host, &cfg, w, fmt).unwrap();
            assert!(c.weights >= w && c.weights as u64 == host.weights_bytes.max(w as u64), "int4 {int4} spec {spec}");
            assert_eq!(host.weights_bytes + host.host_weights_bytes, dev.weights_bytes);
        }
    }
    // A GPTQ checkpoint of int4 experts: none of them on the device.
    let dir = scratch_dir("host-experts");
    let mut c = Preset::TinyMoe.config_json(Some(4));
    c["text_config"]["moe_intermediate_size"] = serde_json::json!(128);
    c["text_config"]["linear_num_value_heads"] = serde_json::json!(4);
    let written = deltaserve_model::synth::write_model_json(
        &dir,
        Preset::TinyMoe,
        c,
        3,
        deltaserve_model::synth::MtpVariant::Random,
        |_, _| {},
    )
    .unwrap();
    gptq::convert(&dir, GptqVariant::SYM, &[], 3, |_| {}).unwrap();
    let cfg = ModelConfig::from_dir(&dir).unwrap();
    assert_eq!(cfg.dims(), written.dims());
    let walked = CheckpointTensors::walk(&cfg, &dir, None).unwrap();
    let mut o = PlanOptions { weights_dtype: WeightsDtype::Int4, ..PlanOptions::gpu_defaults(1 << 30) };
    let on_device = walked.device_bytes(WeightFormat::of(&o));
    o.experts_on_host = true;
    let fmt = WeightFormat::of(&o);
    assert_eq!(walked.device_bytes(fmt) + host_experts_bytes(&cfg, fmt), on_device);
    let with = PlanOptions { backend: PlanBackend::Cuda { checkpoint: Some(walked.into()) }, ..o.clone() };
    let plan = Plan::new(&cfg, &with).unwrap();
    let source = WeightSource::Checkpoint(dir.clone());
    let w = weights_bytes(&plan, (&cfg, &cfg), &source, fmt, None).unwrap();
    let (plan_weights, plan_scratch) = planned(&plan);
    let c = Carve::new(&plan, &cfg, w, fmt).unwrap();
    assert_eq!(c.weights + c.scratch, plan_weights + plan_scratch);
    let _ = std::fs::remove_dir_all(&dir);
    // Refused where it cannot work.
    let dense = Preset::Tiny.config(Some(4));
    let mut plan = Plan::new(&dense, &PlanOptions::gpu_defaults(1 << 30)).unwrap();
    plan.options.experts_on_host = true;
    assert!(check_plan(&dense, dense.dims(), &plan, None).is_err());
}
