//! The plan prices every byte the CUDA backend carves: its scratch, its weights' device layout and what a
//! quantised checkpoint's tensors need beyond the weights region equal, byte for byte, what the backend's
//! own sizing computes. Runs without a GPU.

use std::path::{Path, PathBuf};

use deltaserve_cuda::backend as cuda;
use deltaserve_model::ModelConfig;
use deltaserve_model::shard::ShardSpec;
use deltaserve_model::synth::Preset;
use deltaserve_model::synth::gptq::{self, GptqVariant};
use deltaserve_plan::cuda::{self as plan, ScratchParts, WeightFormat};
use deltaserve_plan::{CheckpointTensors, Plan, PlanBackend, PlanOptions, WeightBytes, WeightsDtype};

fn preset(p: Preset, layers: Option<usize>) -> ModelConfig {
    ModelConfig::from_json_str(&p.config_json(layers).to_string()).unwrap()
}

/// Option sets over the knobs the sizing reads: weights format, lm_head, embedding place, speculation,
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

fn configs() -> Vec<ModelConfig> {
    vec![preset(Preset::Tiny, None), preset(Preset::Tiny, Some(4)), preset(Preset::Qwen36_27b, None)]
}

fn same_parts(p: &ScratchParts, c: &cuda::ScratchParts) -> bool {
    (p.gdn, p.chunk_table, p.tile_table, p.w4_x, p.w4_slice) == (c.gdn, c.chunk_table, c.tile_table, c.w4_x, c.w4_slice)
}

fn cuda_format(f: WeightFormat) -> cuda::WeightFormat {
    cuda::WeightFormat {
        int4: f.int4,
        mtp: f.mtp,
        asym: f.asym,
        lm_head_int4: f.lm_head_int4,
        embed_on_host: f.embed_on_host,
    }
}

#[test]
fn scratch_is_the_backends() {
    assert_eq!(plan::W4_SLICE_BYTES, cuda::W4_SLICE_BYTES);
    for cfg in configs() {
        for o in option_sets(&cfg) {
            let what = format!("hidden {} {o:?}", cfg.dims().hidden);
            assert_eq!(ScratchParts::of(&cfg, &o).total(), cuda::scratch_bytes_for(&cfg, &o), "{what}");
            let (t, s) = (o.max_batch_tokens, o.max_seqs);
            assert_eq!(ScratchParts::new(&cfg, t, s, false, false).total(), cuda::scratch_bytes(&cfg, t, s), "{what}");
            for (int4, lm) in [(false, false), (true, false), (false, true), (true, true)] {
                let p = ScratchParts::new(&cfg, t, s, int4, lm);
                assert!(same_parts(&p, &cuda::ScratchParts::new(&cfg, t, s, int4, lm)), "{what}");
                assert_eq!(p.total(), cuda::ScratchParts::new(&cfg, t, s, int4, lm).total(), "{what}");
            }
            // Without a checkpoint the plan's region is exactly the backend's scratch.
            if let Ok(p) = Plan::new(&cfg, &o) {
                assert_eq!(p.backend_scratch_bytes, cuda::scratch_bytes_for(&cfg, &o) as u64, "{what}");
                assert_eq!(p.region("backend_scratch").unwrap().bytes, p.backend_scratch_bytes);
            }
        }
    }
}

#[test]
fn the_cpu_backend_has_no_scratch() {
    let cfg = preset(Preset::Tiny, None);
    let p = Plan::new(&cfg, &PlanOptions::cpu_defaults(1 << 30)).unwrap();
    assert_eq!(p.backend_scratch_bytes, 0);
    let gpu = PlanOptions { backend: PlanBackend::Generic, ..PlanOptions::gpu_defaults(1 << 30) };
    assert_eq!(Plan::new(&cfg, &gpu).unwrap().backend_scratch_bytes, 0);
}

#[test]
fn slice_rows_are_the_backends() {
    for out in [1, 6, 48, 100, 1024, 5120, 17408, 248_320] {
        for inp in [128, 1024, 5120, 17408, 1 << 30] {
            for slice in [1 << 20, 3 << 20, plan::W4_SLICE_BYTES] {
                assert_eq!(plan::w4_slice_rows(out, inp, slice), cuda::w4_slice_rows(out, inp, slice));
            }
        }
    }
}

#[test]
fn weights_layout_is_the_backends() {
    for cfg in configs() {
        for o in option_sets(&cfg) {
            let f = WeightFormat::of(&o);
            assert_eq!(cuda_format(f), cuda::WeightFormat::of(&o));
            let card = deltaserve_plan::card_config(&cfg, o.tensor_parallel).unwrap();
            for c in [&cfg, &card] {
                assert_eq!(plan::weights_device_bytes(c, f), cuda::weights_device_bytes(c, cuda_format(f)), "{o:?}");
            }
        }
    }
}

fn scratch_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ds-plan-bytes-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// The backend's checkpoint sizing and the plan's walk agree for every format, whole and per rank; the
/// plan's scratch adds what the checkpoint needs beyond the plan's weights, as `serve` reserved it.
fn check_checkpoint(cfg: &ModelConfig, dir: &Path) {
    for o in option_sets(cfg) {
        let f = WeightFormat::of(&o);
        let tp = o.tensor_parallel;
        let rank0 = (tp > 1).then(|| ShardSpec::new(cfg, 0, tp).unwrap());
        let walked = CheckpointTensors::walk(cfg, dir, rank0.as_ref()).unwrap();
        let theirs = cuda::checkpoint_weights_bytes(cfg, dir, cuda_format(f), rank0.as_ref()).unwrap();
        assert_eq!(walked.device_bytes(f), theirs, "{o:?}");
        if tp > 1 {
            for spec in ShardSpec::all(cfg, tp).unwrap() {
                let mine = CheckpointTensors::walk(cfg, dir, Some(&spec)).unwrap().device_bytes(f);
                assert_eq!(mine, cuda::checkpoint_weights_bytes(cfg, dir, cuda_format(f), Some(&spec)).unwrap());
            }
        }
        let with = PlanOptions { backend: PlanBackend::Cuda { checkpoint: Some(walked.into()) }, ..o.clone() };
        let (Ok(p), Ok(plain)) = (Plan::new(cfg, &with), Plan::new(cfg, &o)) else { continue };
        let card = deltaserve_plan::card_config(cfg, tp).unwrap();
        let planned = WeightBytes::new(&card, &o).unwrap().device();
        let beyond = if o.weights_dtype == WeightsDtype::Int4 { (theirs as u64).saturating_sub(planned) } else { 0 };
        assert_eq!(p.backend_scratch_bytes, cuda::scratch_bytes_for(cfg, &o) as u64 + beyond, "{o:?}");
        assert_eq!(plain.backend_scratch_bytes, cuda::scratch_bytes_for(cfg, &o) as u64);
    }
}

#[test]
fn checkpoint_bytes_are_the_backends() {
    let dir = scratch_dir("bf16");
    let cfg = deltaserve_model::synth::write_model(&dir, Preset::Tiny, Some(4), 3, |_, _| {}).unwrap();
    check_checkpoint(&cfg, &dir);
    let _ = std::fs::remove_dir_all(&dir);
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
