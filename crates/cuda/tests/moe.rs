//! The CUDA backend on mixture-of-experts models against the CPU backend (the oracle that matches HF's
//! fixtures): a `qwen3_5_moe` model (every layer sparse, renormalised top-k) and a Qwen3-Next one (a
//! dense first layer, plain top-k probabilities), whole prompts and greedy decode, with the experts run
//! as per-pair GEMVs for decode steps and as grouped GEMMs (also forced for every step); the same with
//! GPTQ int4 experts (symmetric, and v2 zero points) against the CPU's dequantised weights; bf16 experts
//! quantised at load against the CPU on the host quantiser's values; a block-FP8 checkpoint's experts
//! dequantised to bf16 and quantised to int4 at load; the shared expert run with the routed experts' decode
//! GEMVs; and decode steps replayed from a CUDA graph while the tokens route differently,
//! equal to eager launches; and with the routed experts in pinned host memory (`experts_on_host`) the logits of
//! the experts on the device, bit for bit.
//!
//! The stored HF MoE fixtures (`fixtures/hf/qwen35_moe`, `qwen3next_moe`) have head dims of 16, which
//! the CUDA kernels do not take (see `backend.rs`'s `hf_fixtures_logits`); these models have the same
//! layer kinds at head dims 32. Skips (passes) without a GPU.

use std::path::PathBuf;

use deltaserve_backend::{Backend, StepBatch};
use deltaserve_cpu::CpuBackend;
use deltaserve_cuda::backend::{CudaOptions, kernel_dims};
use deltaserve_cuda::{CudaBackend, WeightSource};
use deltaserve_model::ModelConfig;
use deltaserve_model::synth::gptq::{self, GptqVariant};
use deltaserve_model::synth::{MtpVariant, Preset, write_model, write_model_json};
use deltaserve_plan::{Plan, WeightsDtype};
use rand::SeedableRng;
use rand::rngs::StdRng;

mod common;
use common::*;

/// The `tiny-moe` preset (8 experts top 2 of width 64, a shared expert of 128) with 4 layers.
fn qwen35_moe_dir() -> (PathBuf, ModelConfig) {
    let dir = std::env::temp_dir().join(format!("ds-cuda-moe35-{}", std::process::id()));
    let cfg = write_model(&dir, Preset::TinyMoe, Some(4), 13, |_, _| {}).unwrap();
    (dir, cfg)
}

/// Qwen3-Next at the tiny shapes: 6 experts top 3 (probabilities not renormalised), layer 0 dense.
fn qwen3_next_moe_dir() -> (PathBuf, ModelConfig) {
    let dir = std::env::temp_dir().join(format!("ds-cuda-moe-next-{}", std::process::id()));
    let c = Preset::small_qwen3_next_moe();
    let cfg = write_model_json(&dir, Preset::Qwen3Next80bA3b, c, 29, MtpVariant::Random, |_, _| {}).unwrap();
    (dir, cfg)
}

/// The test models are what the GPU tests say (no GPU needed): kernels specialise for them, the
/// Qwen3-Next one has a dense first layer and plain top-k probabilities.
#[test]
fn test_models_have_the_shapes_the_kernels_take() {
    let next = ModelConfig::from_json_str(&Preset::small_qwen3_next_moe().to_string()).unwrap();
    let m = next.moe.as_ref().unwrap();
    assert!(!m.is_sparse(0) && m.is_sparse(1) && !m.norm_topk_prob && m.top_k == 3);
    let tiny = ModelConfig::from_json_str(&Preset::TinyMoe.config_json(Some(4)).to_string()).unwrap();
    for cfg in [next, tiny] {
        kernel_dims(&cfg).validate().unwrap();
        CudaBackend::check_model(&cfg).unwrap();
    }
}

/// CUDA (`opts`) vs CPU: whole prompts of 1, 3, 37 and 300 tokens, then 12 greedy decode steps
/// (teacher-forced logits; the free-running sequences may part only where the CPU's margin is not
/// decisive). The failures, if any.
fn against_cpu(label: &str, dir: &std::path::Path, cfg: &ModelConfig, opts: CudaOptions) -> Vec<String> {
    let g = CudaBackend::with_options(cfg, WeightSource::Checkpoint(dir.to_path_buf()), &plan_for(cfg), 0, opts);
    compare(label, g.unwrap(), cpu(dir, cfg), BF16)
}

/// [`against_cpu`]'s comparison of the backends `g` and `c`, within `bounds`.
fn compare(label: &str, mut g: CudaBackend, mut c: CpuBackend, bounds: Bounds) -> Vec<String> {
    let vocab = g.capabilities().vocab_size;
    let mut rng = StdRng::seed_from_u64(7);
    let mut full = Score::default();
    for (i, len) in [1usize, 3, 37, 300].into_iter().enumerate() {
        let ids = random_tokens(&mut rng, len, vocab);
        let b = one(chunk(0, &pages(40 * i as u32, len), 0, &ids));
        full.add(&run(&mut g, &b), &run(&mut c, &b), vocab);
    }
    let mut failures: Vec<String> = full.soft_check_with(&format!("{label}: prompts"), bounds).into_iter().collect();
    let prompt = random_tokens(&mut rng, 37, vocab);
    let pg = pages(500, 37 + 12);
    let b = one(chunk(1, &pg, 0, &prompt));
    let (mut lg, mut lc) = (run(&mut g, &b), run(&mut c, &b));
    let mut forced = Score::default();
    let (mut ids_g, mut ids_c, mut decisive_at) = (Vec::new(), Vec::new(), Vec::new());
    for step in 0..12 {
        forced.add(&lg, &lc, vocab);
        ids_g.push(argmax(&lg) as u32);
        ids_c.push(argmax(&lc) as u32);
        decisive_at.push(decisive(&lc));
        let tok = [argmax(&lc) as u32];
        lg = run(&mut g, &one(chunk(1, &pg, 37 + step, &tok)));
        lc = run(&mut c, &one(chunk(1, &pg, 37 + step, &tok)));
    }
    println!("{label}: greedy CUDA {ids_g:?}\n{label}: greedy CPU  {ids_c:?}");
    failures.extend(forced.soft_check_with(&format!("{label}: decode (teacher-forced)"), bounds));
    for (k, ((a, b), dec)) in ids_g.iter().zip(&ids_c).zip(&decisive_at).enumerate() {
        if a != b && *dec {
            failures.push(format!("{label}: greedy token {k} differs where the CPU's margin is decisive"));
        }
    }
    failures
}

#[test]
fn qwen35_moe_matches_cpu() {
    if !gpu() {
        return;
    }
    let (dir, cfg) = qwen35_moe_dir();
    let d = test_opts();
    let mut failures = against_cpu("qwen3_5_moe", &dir, &cfg, d);
    // Grouped GEMMs for every step, decode included.
    failures.extend(against_cpu("qwen3_5_moe grouped", &dir, &cfg, CudaOptions { gemv_max_tokens: 0, ..d }));
    assert!(failures.is_empty(), "{failures:#?}");
}

#[test]
fn qwen3_next_moe_matches_cpu() {
    if !gpu() {
        return;
    }
    let (dir, cfg) = qwen3_next_moe_dir();
    let failures = against_cpu("qwen3_next moe", &dir, &cfg, test_opts());
    assert!(failures.is_empty(), "{failures:#?}");
}

/// The `tiny-moe` shapes at widths the int4 format takes ([`tiny_moe_int4_config`]), seed 13.
fn wide_experts_dir(tag: &str) -> (PathBuf, ModelConfig) {
    let dir = std::env::temp_dir().join(format!("ds-cuda-moe-w4-{tag}-{}", std::process::id()));
    let cfg =
        write_model_json(&dir, Preset::TinyMoe, tiny_moe_int4_config(), 13, MtpVariant::Random, |_, _| {}).unwrap();
    (dir, cfg)
}

/// GPTQ int4 experts (every decoder linear packed but the routers, as real exports leave them), symmetric
/// v1 and v2 with zero points, against the CPU on the checkpoint's dequantised weights: per-pair GEMVs
/// for decode steps, and grouped GEMMs for every step. Within the int4 bounds of the dense int4 tests
/// (`QUANT`: 4 prompt rows, so one flip where the CPU's margin is not decisive is 25% of them).
#[test]
fn gptq_int4_experts_match_cpu() {
    if !gpu() {
        return;
    }
    let mut failures = Vec::new();
    let v2 = GptqVariant { v2: true, sym: false, ..GptqVariant::SYM };
    for (tag, v) in [("sym", GptqVariant::SYM), ("asym-v2", v2)] {
        let (dir, cfg0) = wide_experts_dir(tag);
        let routers: Vec<String> =
            (0..cfg0.layer_types.len()).map(|l| format!("model.language_model.layers.{l}.mlp.gate")).collect();
        let kept: Vec<&str> = routers.iter().map(String::as_str).collect();
        let done = gptq::convert(&dir, v, &kept, 5, |_| {}).unwrap();
        assert!(done.quantized.keys().any(|n| n.contains("experts.7.down_proj")), "{tag}: experts packed");
        let cfg = ModelConfig::from_dir(&dir).unwrap();
        let plan = plan_with_checkpoint(&cfg, &dir, |o| {
            o.weights_dtype = WeightsDtype::Int4;
            o.int4_asym = !v.sym;
        });
        let d = test_opts();
        for (what, opts) in [("", d), (" grouped", CudaOptions { gemv_max_tokens: 0, ..d })] {
            let g = CudaBackend::with_options(&cfg, WeightSource::Checkpoint(dir.clone()), &plan, 0, opts).unwrap();
            failures.extend(compare(&format!("gptq {tag}{what}"), g, cpu(&dir, &cfg), QUANT));
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// bf16 experts quantised at load (`--weights-dtype int4`: round to nearest, each expert's gate and up
/// rows into one linear) against the CPU on the host quantiser's values of every linear, per-pair GEMVs
/// and grouped GEMMs.
#[test]
fn experts_quantised_at_load_match_cpu() {
    if !gpu() {
        return;
    }
    let (dir, cfg) = wide_experts_dir("quantize");
    let plan = plan_with(&cfg, |o| o.weights_dtype = WeightsDtype::Int4);
    let d = test_opts();
    let mut failures = Vec::new();
    for (what, opts) in [("", d), (" grouped", CudaOptions { gemv_max_tokens: 0, ..d })] {
        let g = CudaBackend::with_options(&cfg, WeightSource::Checkpoint(dir.clone()), &plan, 0, opts).unwrap();
        assert!(g.w4_quantized > 0);
        failures.extend(compare(
            &format!("quantised at load{what}"),
            g,
            cpu_int4(&dir, &cfg, true, false, false),
            QUANT,
        ));
    }
    let _ = std::fs::remove_dir_all(&dir);
    assert!(failures.is_empty(), "{failures:#?}");
}

/// A block-FP8 checkpoint of a mixture-of-experts model (`synth --fp8`: every expert, the shared expert and
/// the attention and DeltaNet linears in e4m3 with 128×128 block scales, as the official `-FP8` releases):
/// dequantised at load into bf16 experts, against the CPU on the same values rounded to bf16; and quantised
/// to int4 at load (`--quantize int4`), against the CPU on the host quantiser's values of them. Per-pair
/// GEMVs for decode steps, and grouped GEMMs for every step.
#[test]
fn fp8_checkpoint_experts_match_cpu() {
    if !gpu() {
        return;
    }
    let (dir, _) = wide_experts_dir("fp8");
    let done = deltaserve_model::synth::fp8::convert(&dir, |_, _| {}).unwrap();
    assert!(done.quantized.iter().any(|n| n.contains("experts.7.down_proj")), "experts stored as fp8");
    let cfg = ModelConfig::from_dir(&dir).unwrap();
    CudaBackend::check_model(&cfg).unwrap();
    let d = test_opts();
    let mut failures = Vec::new();
    for (w, bounds) in [(WeightsDtype::Bf16, BF16), (WeightsDtype::Int4, QUANT)] {
        let plan = plan_with_checkpoint(&cfg, &dir, |o| o.weights_dtype = w);
        for (what, opts) in [("", d), (" grouped", CudaOptions { gemv_max_tokens: 0, ..d })] {
            let g = CudaBackend::with_options(&cfg, WeightSource::Checkpoint(dir.clone()), &plan, 0, opts).unwrap();
            let c = match w {
                WeightsDtype::Int4 => {
                    assert!(g.w4_quantized > 0, "nothing quantised");
                    cpu_int4(&dir, &cfg, true, false, false)
                }
                _ => cpu_bf16_linears(&dir, &cfg),
            };
            failures.extend(compare(&format!("fp8 checkpoint, {w} experts{what}"), g, c, bounds));
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    assert!(failures.is_empty(), "{failures:#?}");
}

/// The shared expert run as one more pair per token of the routed experts' decode GEMVs
/// (`moe_shared_pairs`): experts and shared expert of width 256 (so int4 gate and up halves are whole
/// GEMV blocks), bf16 and quantised to int4 at load, decode steps replayed from graphs and eager, against
/// the CPU (prompts take the grouped GEMMs and the dense shared expert as before).
#[test]
fn shared_expert_pairs_match_cpu() {
    if !gpu() {
        return;
    }
    let dir = std::env::temp_dir().join(format!("ds-cuda-moe-shared-{}", std::process::id()));
    let mut c = tiny_moe_int4_config();
    c["text_config"]["moe_intermediate_size"] = serde_json::json!(256);
    c["text_config"]["shared_expert_intermediate_size"] = serde_json::json!(256);
    let cfg = write_model_json(&dir, Preset::TinyMoe, c, 17, MtpVariant::Random, |_, _| {}).unwrap();
    let opts = CudaOptions { moe_shared_pairs: true, ..test_opts() };
    let mut failures = Vec::new();
    for graphs in [true, false] {
        let o = CudaOptions { cuda_graphs: graphs, ..opts };
        let what = if graphs { "graphs" } else { "eager" };
        failures.extend(against_cpu(&format!("shared pairs, bf16, {what}"), &dir, &cfg, o));
        let plan = plan_with(&cfg, |o| o.weights_dtype = WeightsDtype::Int4);
        let g = CudaBackend::with_options(&cfg, WeightSource::Checkpoint(dir.clone()), &plan, 0, o).unwrap();
        let c = cpu_int4(&dir, &cfg, true, false, false);
        failures.extend(compare(&format!("shared pairs, int4 at load, {what}"), g, c, QUANT));
    }
    let _ = std::fs::remove_dir_all(&dir);
    assert!(failures.is_empty(), "{failures:#?}");
}

/// Decode steps of three sequences, captured once as a CUDA graph and replayed with other tokens
/// (so other experts): every replay's logits bitwise equal to eager launches of the same steps, and
/// within the bf16 bounds of the CPU's.
#[test]
fn moe_decode_graph_replays_follow_the_routing() {
    if !gpu() {
        return;
    }
    let (dir, cfg) = qwen35_moe_dir();
    let plan = plan_for(&cfg);
    let src = || WeightSource::Checkpoint(dir.clone());
    let d = CudaOptions::default();
    let mut graphs = CudaBackend::with_options(&cfg, src(), &plan, 0, CudaOptions { cuda_graphs: true, ..d }).unwrap();
    let mut eager = CudaBackend::with_options(&cfg, src(), &plan, 0, CudaOptions { cuda_graphs: false, ..d }).unwrap();
    let mut c = cpu(&dir, &cfg);
    let vocab = graphs.capabilities().vocab_size;
    let mut rng = StdRng::seed_from_u64(3);
    let pg: Vec<Vec<u32>> = (0..3).map(|i| pages(60 * i, 80)).collect();
    let mut pos = [0usize; 3];
    for i in 0..3 {
        let ids = random_tokens(&mut rng, 9 + 5 * i, vocab);
        let b = one(chunk(i as u32, &pg[i], 0, &ids));
        for be in [&mut graphs as &mut dyn Backend, &mut eager, &mut c] {
            run(be, &b);
        }
        pos[i] = ids.len();
    }
    let mut vs_cpu = Score::default();
    let mut routed = std::collections::HashSet::new();
    for step in 0..10 {
        // Random tokens each step: the rows route to other experts than at the capture.
        let toks = random_tokens(&mut rng, 3, vocab);
        let mut batch = StepBatch::default();
        for i in 0..3 {
            batch.seqs.push(chunk(i as u32, &pg[i], pos[i], &[toks[i]]));
            pos[i] += 1;
        }
        routed.insert(toks.clone());
        let (lg, le, lc) = (run(&mut graphs, &batch), run(&mut eager, &batch), run(&mut c, &batch));
        assert!(lg.iter().zip(&le).all(|(a, b)| a.to_bits() == b.to_bits()), "step {step}: replay differs from eager");
        vs_cpu.add(&lg, &lc, vocab);
    }
    let gs = graphs.graph_stats();
    println!("graph stats {gs:?}; {} distinct token triples", routed.len());
    assert!(gs.captures >= 1 && gs.replays >= 8, "{gs:?}");
    assert_eq!(eager.graph_stats().captures, 0);
    // Against the CPU only in bulk: the random router's top-k of a row can sit within bf16 rounding of a
    // tie, and a row that picks another expert there is legitimately far off (one of 30 rows, L2 0.24, on
    // the H200). The replays themselves are bit-equal to eager launches (above).
    if let Some(failure) = vs_cpu.soft_check("MoE decode replays vs CPU") {
        println!("{failure}");
    }
    let mut l2: Vec<f32> = vs_cpu.detail.iter().map(|d| d.1).collect();
    l2.sort_by(|a, b| a.total_cmp(b));
    assert!(l2[l2.len() / 2] <= TOL_MEDIAN, "MoE decode replays vs CPU: median L2 rel err {}", l2[l2.len() / 2]);
    assert!(vs_cpu.argmax_same * 10 >= vs_cpu.rows * 8, "MoE decode replays vs CPU: argmax agreement below 80%");
}

/// Random weights at the `tiny-moe` shapes (bf16: every expert of a layer in one block; int4 at the
/// widths of [`tiny_moe_int4_config`]: every expert laid out alike) give finite logits, through the grouped path (a prompt) and
/// the per-pair path (a decode step).
#[test]
fn random_moe_weights_run() {
    if !gpu() {
        return;
    }
    let cfg = ModelConfig::from_json_str(&Preset::TinyMoe.config_json(Some(4)).to_string()).unwrap();
    let wide = ModelConfig::from_json_str(&tiny_moe_int4_config().to_string()).unwrap();
    let int4 = |c: &ModelConfig| plan_with(c, |o| o.weights_dtype = WeightsDtype::Int4);
    for (cfg, plan) in [(&cfg, plan_for(&cfg)), (&wide, int4(&wide))] {
        let mut g = CudaBackend::new(cfg, WeightSource::RandomWeights { seed: 5 }, &plan, 0).unwrap();
        let ids: Vec<u32> = (0..100).collect();
        let pg = pages(0, 101);
        let out = run(&mut g, &one(chunk(0, &pg, 0, &ids)));
        let next = run(&mut g, &one(chunk(0, &pg, 100, &[7])));
        for o in [&out, &next] {
            assert!(o.iter().all(|x| x.is_finite()) && o.iter().any(|x| *x != 0.0));
        }
    }
}

/// The logits of backends `a` (experts on the device) and `b` (`experts_on_host`), bitwise: whole prompts
/// of 1, 37 and 300 tokens (the per-pair GEMVs, then the grouped GEMMs), 10 greedy decode steps of one
/// sequence and 4 of three at once. The same kernels over the same bytes, so the same bits; the failures.
fn same_logits(label: &str, a: &mut CudaBackend, b: &mut CudaBackend) -> Vec<String> {
    let vocab = a.capabilities().vocab_size;
    let mut failures = Vec::new();
    let mut check = |what: String, x: &[f32], y: &[f32]| {
        let differ = x.len() != y.len() || x.iter().zip(y).any(|(p, q)| p.to_bits() != q.to_bits());
        if differ || x.iter().any(|v| !v.is_finite()) {
            failures.push(format!("{label}: {what}: the logits differ (or are not finite)"));
        }
    };
    let mut rng = StdRng::seed_from_u64(11);
    for (i, len) in [1usize, 37, 300].into_iter().enumerate() {
        let ids = random_tokens(&mut rng, len, vocab);
        let batch = one(chunk(i as u32, &pages(40 * i as u32, len + 20), 0, &ids));
        check(format!("prompt of {len}"), &run(a, &batch), &run(b, &batch));
    }
    // Greedy decode after the 37-token prompt (slot 1), then three sequences a step.
    let mut last = run(a, &one(chunk(1, &pages(40, 57), 37, &[3])));
    check("decode step 0".into(), &last, &run(b, &one(chunk(1, &pages(40, 57), 37, &[3]))));
    for step in 1..10 {
        let tok = [argmax(&last) as u32];
        let batch = one(chunk(1, &pages(40, 57), 37 + step, &tok));
        last = run(a, &batch);
        check(format!("decode step {step}"), &last, &run(b, &batch));
    }
    for step in 0..4 {
        let mut batch = StepBatch::default();
        for (slot, len) in [(0u32, 1usize), (1, 47), (2, 300)] {
            let first = 40 * slot;
            batch.seqs.push(chunk(slot, &pages(first, len + 20), len + step, &[(7 * step + slot as usize) as u32]));
        }
        check(format!("batch decode step {step}"), &run(a, &batch), &run(b, &batch));
    }
    failures
}

/// A plan of the tests' settings with the routed experts on the host.
fn on_host(o: &mut deltaserve_plan::PlanOptions) {
    o.experts_on_host = true;
}

/// `--experts-on-host`: the routed experts in pinned host memory, read by the same kernels across the bus,
/// give the logits of the experts on the device bit for bit: bf16 experts from a checkpoint (the tiny-moe
/// model, and Qwen3-Next's dense first layer), GPTQ int4 experts (symmetric, and v2 with zero points),
/// bf16 experts quantised at load (`--weights-dtype int4`: in a device stage, copied down), random bf16
/// and int4 experts (made on the GPU, copied down); per-pair GEMVs for decode steps, and grouped GEMMs for
/// every step. The device weights lose the experts' bytes.
#[test]
fn experts_on_host_give_the_logits_of_experts_on_the_device() {
    if !gpu() {
        return;
    }
    use deltaserve_plan::cuda::{WeightFormat, host_experts_bytes};
    let d = test_opts();
    let grouped = CudaOptions { gemv_max_tokens: 0, ..d };
    let mut failures = Vec::new();
    let mut pair = |label: &str, cfg: &ModelConfig, src: &dyn Fn() -> WeightSource, dev: &Plan, host: &Plan| {
        for (what, opts) in [("", d), (" grouped", grouped)] {
            let free0 = deltaserve_cuda::Runtime::open(0).and_then(|r| r.free_memory()).unwrap();
            let mut a = CudaBackend::with_options(cfg, src(), dev, 0, opts).unwrap();
            let free1 = deltaserve_cuda::Runtime::open(0).and_then(|r| r.free_memory()).unwrap();
            let mut b = CudaBackend::with_options(cfg, src(), host, 0, opts).unwrap();
            let free2 = deltaserve_cuda::Runtime::open(0).and_then(|r| r.free_memory()).unwrap();
            let moved = host_experts_bytes(cfg, WeightFormat::of(&host.options));
            println!(
                "{label}{what}: weights on the device {} B vs {} B; host experts {moved} B; the driver's free \
                 memory fell {} B building the device-experts backend, {} B the host-experts one (arenas {} B, {} B)",
                a.weights_bytes,
                b.weights_bytes,
                free0 as i64 - free1 as i64,
                free1 as i64 - free2 as i64,
                dev.arena_bytes(),
                host.arena_bytes()
            );
            assert!(moved > 0 && b.weights_bytes < a.weights_bytes, "{label}");
            failures.extend(same_logits(&format!("{label}{what}"), &mut a, &mut b));
        }
    };
    // bf16 checkpoints: the tiny-moe model (every layer sparse) and Qwen3-Next (a dense first layer).
    for (label, (dir, cfg)) in [("bf16 experts", qwen35_moe_dir()), ("qwen3-next bf16 experts", qwen3_next_moe_dir())] {
        let src = || WeightSource::Checkpoint(dir.clone());
        pair(label, &cfg, &src, &plan_for(&cfg), &plan_with(&cfg, on_host));
    }
    // GPTQ int4 experts, converted on the host and copied into the host block.
    let v2 = GptqVariant { v2: true, sym: false, ..GptqVariant::SYM };
    for (tag, v) in [("sym", GptqVariant::SYM), ("asym-v2", v2)] {
        let (dir, cfg0) = wide_experts_dir(&format!("host-{tag}"));
        let routers: Vec<String> =
            (0..cfg0.layer_types.len()).map(|l| format!("model.language_model.layers.{l}.mlp.gate")).collect();
        let kept: Vec<&str> = routers.iter().map(String::as_str).collect();
        gptq::convert(&dir, v, &kept, 5, |_| {}).unwrap();
        let cfg = ModelConfig::from_dir(&dir).unwrap();
        let int4 = |host: bool| {
            plan_with_checkpoint(&cfg, &dir, |o| {
                o.weights_dtype = WeightsDtype::Int4;
                o.int4_asym = !v.sym;
                o.experts_on_host = host;
            })
        };
        let src = || WeightSource::Checkpoint(dir.clone());
        pair(&format!("gptq {tag} experts"), &cfg, &src, &int4(false), &int4(true));
        let _ = std::fs::remove_dir_all(&dir);
    }
    // bf16 experts quantised at load (symmetric and with zero points).
    let (dir, cfg) = wide_experts_dir("host-quantize");
    for asym in [false, true] {
        let int4 = |host: bool| {
            plan_with(&cfg, |o| {
                o.weights_dtype = WeightsDtype::Int4;
                o.int4_asym = asym;
                o.experts_on_host = host;
            })
        };
        let src = || WeightSource::Checkpoint(dir.clone());
        pair(&format!("quantised at load (asym {asym})"), &cfg, &src, &int4(false), &int4(true));
    }
    let _ = std::fs::remove_dir_all(&dir);
    // Random weights: bf16 experts (one block a layer) and int4 (every expert laid out alike).
    let tiny = ModelConfig::from_json_str(&Preset::TinyMoe.config_json(Some(4)).to_string()).unwrap();
    let wide = ModelConfig::from_json_str(&tiny_moe_int4_config().to_string()).unwrap();
    let src = || WeightSource::RandomWeights { seed: 5 };
    pair("random bf16 experts", &tiny, &src, &plan_for(&tiny), &plan_with(&tiny, on_host));
    let int4 = |host: bool| {
        plan_with(&wide, |o| {
            o.weights_dtype = WeightsDtype::Int4;
            o.experts_on_host = host;
        })
    };
    pair("random int4 experts", &wide, &src, &int4(false), &int4(true));
    assert!(failures.is_empty(), "{failures:#?}");
}

/// The tiny-moe model with its sparse MTP head (its experts in the host block too): a prompt, plain
/// decode steps and speculative steps (the head drafting 2 tokens, the verify over 3 positions, the
/// commit) give the logits and drafts of the experts on the device bit for bit, bf16 and quantised at load.
#[test]
fn decode_and_mtp_steps_with_experts_on_host() {
    if !gpu() {
        return;
    }
    use deltaserve_backend::{SpecCommit, StepOut, Want};
    let dir = std::env::temp_dir().join(format!("ds-cuda-moe-host-mtp-{}", std::process::id()));
    let cfg =
        write_model_json(&dir, Preset::TinyMoe, tiny_moe_int4_config(), 17, MtpVariant::Random, |_, _| {}).unwrap();
    assert!(cfg.moe.as_ref().is_some_and(|m| m.mtp_is_sparse()) && cfg.mtp_num_hidden_layers > 0);
    let vocab = cfg.vocab_size;
    let prompt: Vec<u32> = (0..29).map(|i| ((i * 53 + 3) % vocab) as u32).collect();
    let pg = pages(0, 80);
    let mut failures = Vec::new();
    for int4 in [false, true] {
        let plan = |host: bool| {
            plan_with(&cfg, |o| {
                o.speculative_tokens = 2;
                o.experts_on_host = host;
                if int4 {
                    o.weights_dtype = WeightsDtype::Int4;
                }
            })
        };
        let (dev, host) = (plan(false), plan(true));
        assert!(host.weight_parts.mtp_experts > 0 && host.host_weights_bytes > host.weight_parts.experts);
        let mut seen: Vec<Vec<Vec<f32>>> = Vec::new();
        for p in [&dev, &host] {
            let mut g =
                CudaBackend::with_options(&cfg, WeightSource::Checkpoint(dir.clone()), p, 2, test_opts()).unwrap();
            let mut rows = vec![run(&mut g, &one(chunk(0, &pg, 0, &prompt)))];
            let mut pos = prompt.len();
            // Plain decode steps.
            for _ in 0..4 {
                let tok = [argmax(rows.last().unwrap()) as u32];
                rows.push(run(&mut g, &one(chunk(0, &pg, pos, &tok))));
                pos += 1;
            }
            // Speculative steps: the head drafts 2 (its rows recorded), the main model verifies 3 positions;
            // one position is committed.
            for _ in 0..4 {
                let tok = argmax(rows.last().unwrap()) as u32;
                let mut c = chunk(0, &pg, pos, &[tok]);
                c.draft = 2;
                let mut drafted = Vec::new();
                let mut picker = |_: u64, _: usize, row: &[f32]| {
                    drafted.push(row.to_vec());
                    argmax(row) as u32
                };
                let mut out = StepOut::default();
                g.step(&one(c), Want::Drafts(&mut picker), &mut out).unwrap();
                assert_eq!(out.logits.len(), 3 * vocab);
                rows.extend(drafted);
                rows.push(out.drafts.concat().iter().map(|&t| t as f32).collect());
                rows.push(out.logits[..vocab].to_vec());
                let commit = SpecCommit { seq_id: 0, slot: 0, pages: pg.clone(), start: pos, accepted: 1 };
                g.commit_speculative(&[commit]).unwrap();
                pos += 1;
            }
            seen.push(rows);
        }
        let same = seen[0].len() == seen[1].len()
            && seen[0].iter().zip(&seen[1]).all(|(x, y)| x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits()));
        println!("int4 {int4}: {} rows (logits, draft logits, drafts), bitwise equal: {same}", seen[0].len());
        if !same {
            failures.push(format!("int4 {int4}: experts on the host changed the decode or MTP steps"));
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    assert!(failures.is_empty(), "{failures:#?}");
}
