//! 4-bit weights against the CPU on the dequantised weights: quantised at load, GPTQ checkpoints, the int4
//! GEMM, folded norms, the embedding in host memory and the int4 lm_head.

use std::path::PathBuf;

use deltaserve_backend::{Backend, StepBatch};
use deltaserve_cpu::CpuBackend;
use deltaserve_cuda::backend::CudaOptions;
use deltaserve_cuda::{CudaBackend, WeightSource};
use deltaserve_model::ModelConfig;
use deltaserve_model::synth::Preset;
use rand::SeedableRng;
use rand::rngs::StdRng;

use crate::common::*;

/// The tiny preset with 4 DeltaNet value heads (value width 128), so every linear's `in` is a
/// multiple of 128 (the int4 format's group), written once per process.
pub(crate) fn tiny_int4_dir(layers: usize) -> (PathBuf, ModelConfig) {
    tiny_int4_dir_named("int4", layers)
}

/// [`tiny_int4_dir`] in a directory of its own (`tag`), for tests that rewrite the checkpoint.
pub(crate) fn tiny_int4_dir_named(tag: &str, layers: usize) -> (PathBuf, ModelConfig) {
    let dir = std::env::temp_dir().join(format!("ds-cuda-backend-{tag}-{}-{layers}", std::process::id()));
    let cfg = deltaserve_model::synth::write_model_json(
        &dir,
        Preset::Tiny,
        tiny_int4_config(layers),
        13,
        deltaserve_model::synth::MtpVariant::None,
        |_, _| {},
    )
    .unwrap();
    (dir, cfg)
}

/// Prefill (1, 5, 37, 300, 1100 tokens: GEMV, int4 GEMM and sliced-GEMM paths) and a 12-step greedy decode
/// (graphs), CUDA vs the CPU reference on the same weights. Returns the failures.
pub(crate) fn compare_int4(label: &str, g: &mut CudaBackend, c: &mut CpuBackend) -> Vec<String> {
    compare_quantised(label, g, c, QUANT, QUANT)
}

/// [`compare_int4`] with the prefill held to `prefill` and the decode to `decode`.
pub(crate) fn compare_quantised(
    label: &str,
    g: &mut CudaBackend,
    c: &mut CpuBackend,
    prefill: Bounds,
    decode: Bounds,
) -> Vec<String> {
    let vocab = g.capabilities().vocab_size;
    let allocs = g.arena_stats().allocations;
    let mut rng = StdRng::seed_from_u64(21);
    let mut pre = Score::default();
    for (i, len) in [1usize, 5, 37, 300, 1100].into_iter().enumerate() {
        let ids = random_tokens(&mut rng, len, vocab);
        let b = one(chunk(0, &pages(200 * i as u32, len), 0, &ids));
        pre.add(&run(g, &b), &run(c, &b), vocab);
    }
    let prompt = random_tokens(&mut rng, 37, vocab);
    let pg = pages(1000, 37 + 12);
    let b = one(chunk(2, &pg, 0, &prompt));
    let (mut lg, mut lc) = (run(g, &b), run(c, &b));
    let mut dec = Score::default();
    for step in 0..12 {
        dec.add(&lg, &lc, vocab);
        let tok = argmax(&lg) as u32;
        lg = run(g, &one(chunk(2, &pg, 37 + step, &[tok])));
        lc = run(c, &one(chunk(2, &pg, 37 + step, &[tok])));
    }
    println!("{label}: graph stats {:?}", g.graph_stats());
    let mut failures: Vec<String> = Vec::new();
    failures.extend(pre.soft_check_with(&format!("{label} prefill"), prefill));
    failures.extend(dec.soft_check_with(&format!("{label} decode (teacher-forced)"), decode));
    if g.arena_stats().allocations != allocs {
        failures.push(format!("{label}: the arena allocated while serving"));
    }
    failures
}

/// (5a) int4 decoder linears quantised at load on the GPU (sym and asym, with an int4 lm_head and
/// the embedding on the host in some runs; the norms folded into the projections, and once not)
/// against the CPU on the dequantised weights.
#[test]
fn int4_quantized_at_load_matches_cpu() {
    if !gpu() {
        return;
    }
    let (dir, cfg) = tiny_int4_dir(8);
    let mut failures = Vec::new();
    for (asym, lm_head_int4, embed_on_host, fold) in [
        (false, false, false, true),
        (false, false, false, false),
        (true, false, false, true),
        (false, true, true, true),
    ] {
        let plan = plan_with(&cfg, |o| {
            o.weights_dtype = deltaserve_plan::WeightsDtype::Int4;
            o.int4_asym = asym;
            o.lm_head_int4 = lm_head_int4;
            o.embed_on_host = embed_on_host;
        });
        let mut g = cuda(&dir, &cfg, &plan);
        g.set_options(CudaOptions { fold_norms: fold, ..g.options() }).unwrap();
        assert_eq!(g.norms_fold(), fold);
        println!(
            "int4 asym {asym} lm_head_int4 {lm_head_int4} embed_on_host {embed_on_host} fold {fold}: quantised {} linears, weights {} B (plan {} B)",
            g.w4_quantized,
            g.weights_bytes,
            plan.region("weights").unwrap().bytes
        );
        assert!(g.w4_quantized > 0);
        let mut c = cpu_int4(&dir, &cfg, true, asym, lm_head_int4);
        failures.extend(compare_int4(
            &format!("int4 asym={asym} lm_head_int4={lm_head_int4} host_embed={embed_on_host} fold={fold}"),
            &mut g,
            &mut c,
        ));
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// The residual add + RMSNorm folded into the int4 projections around it (`CudaOptions::fold_norms`,
/// on by default for steps of at most 8 tokens) against the separate norm kernel: two backends of the
/// same weights (fold on, fold off) and the CPU reference run prompts of 1 and 5 tokens (folded) and 37
/// (not), then decode steps of 3 sequences and of 1 (graphs), teacher-forced by the reference, sym and
/// asym weights. The fold rounds the norm's input before its 1/rms instead of after, so the two GPU
/// paths differ by rounding, which 8 random layers amplify (their logits are not compared with each
/// other). The folded path must match the reference within the int4 bounds, with a median error at most
/// 1.25× the norm kernel's (+2e-3). The norm kernel's own check is printed, not asserted here (it is in
/// `int4_quantized_at_load_matches_cpu`): on the H200 one of its 3-sequence rows flipped a decisive
/// argmax in this schedule (L2 1.7e-1; the folded rows: at most 6.3e-2).
#[test]
fn folded_norms_match_separate_kernels() {
    if !gpu() {
        return;
    }
    let (dir, cfg) = tiny_int4_dir(8);
    let mut failures = Vec::new();
    for asym in [false, true] {
        let plan = plan_with(&cfg, |o| {
            o.weights_dtype = deltaserve_plan::WeightsDtype::Int4;
            o.int4_asym = asym;
        });
        let mut on = cuda(&dir, &cfg, &plan);
        let mut off = cuda(&dir, &cfg, &plan);
        off.set_options(CudaOptions { fold_norms: false, ..off.options() }).unwrap();
        assert!(on.norms_fold() && !off.norms_fold(), "int4 layers fold their norms unless turned off");
        let mut c = cpu_int4(&dir, &cfg, true, asym, false);
        let allocs = on.arena_stats().allocations;
        let vocab = on.capabilities().vocab_size;
        let mut rng = StdRng::seed_from_u64(5);
        let lens = [1usize, 5, 37];
        let pg: Vec<Vec<u32>> = (0..lens.len()).map(|i| pages(100 * i as u32, 60)).collect();
        let (mut s_on, mut s_off) = (Score::default(), Score::default());
        let mut next = Vec::new();
        for (i, &len) in lens.iter().enumerate() {
            let b = one(chunk(i as u32, &pg[i], 0, &random_tokens(&mut rng, len, vocab)));
            let r = run_scored(&b, &mut c, [(&mut on, &mut s_on), (&mut off, &mut s_off)], vocab);
            next.push(argmax(&r) as u32);
        }
        let mut pos = lens.to_vec();
        for step in 0..10 {
            let live = if step < 6 { lens.len() } else { 1 };
            let mut b = StepBatch::default();
            for i in 0..live {
                b.seqs.push(chunk(i as u32, &pg[i], pos[i], &[next[i]]));
                pos[i] += 1;
            }
            let r = run_scored(&b, &mut c, [(&mut on, &mut s_on), (&mut off, &mut s_off)], vocab);
            for (i, row) in r.chunks_exact(vocab).enumerate() {
                next[i] = argmax(row) as u32;
            }
        }
        println!("fold asym={asym}: graph stats {:?}", on.graph_stats());
        failures.extend(s_on.soft_check_with(&format!("folded norms vs CPU (asym={asym})"), QUANT));
        if let Some(e) = s_off.soft_check_with(&format!("norm kernel vs CPU (asym={asym})"), QUANT) {
            println!("(not asserted here) {e}");
        }
        let (m_on, m_off) = (s_on.median_l2(), s_off.median_l2());
        println!("fold asym={asym}: median L2 rel err vs CPU {m_on:.3e} folded, {m_off:.3e} with the norm kernel");
        if m_on > 1.25 * m_off + 2e-3 {
            failures.push(format!("asym={asym}: folded median L2 {m_on:.3e} vs {m_off:.3e} with the norm kernel"));
        }
        assert_eq!(on.arena_stats().allocations, allocs, "the arena allocated while serving");
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// Runs `b` on the reference `c` and on each backend, adding each backend's rows against the reference's
/// to its score; returns the reference's logits.
pub(crate) fn run_scored(
    b: &StepBatch,
    c: &mut CpuBackend,
    backends: [(&mut CudaBackend, &mut Score); 2],
    vocab: usize,
) -> Vec<f32> {
    let r = run(c, b);
    for (g, score) in backends {
        score.add(&run(g, b), &r, vocab);
    }
    r
}

/// (5c) GPTQ checkpoints written from the format's definition (deltaserve_model::synth::gptq:
/// symmetric v1 with a stored trivial g_idx, asymmetric with act-order, asymmetric gptq_v2, two
/// linears left bf16) load on the GPU (converted to the device format) and match the CPU engine on
/// the same checkpoint (which dequantises it exactly).
#[test]
fn gptq_checkpoint_matches_cpu() {
    use deltaserve_model::synth::gptq::{self, GptqVariant};
    if !gpu() {
        return;
    }
    let v2 = GptqVariant { v2: true, sym: false, ..GptqVariant::SYM };
    let mut failures = Vec::new();
    for (tag, v) in [("sym-v1", GptqVariant::SYM), ("asym-act-order", GptqVariant::ASYM_ACT_ORDER), ("asym-v2", v2)] {
        let (dir, _) = tiny_int4_dir_named(&format!("gptq-{tag}"), 8);
        let kept = ["model.language_model.layers.0.mlp.down_proj", "model.language_model.layers.3.self_attn.o_proj"];
        let done = gptq::convert(&dir, v, &kept, 5, |_| {}).unwrap();
        let cfg = ModelConfig::from_dir(&dir).unwrap();
        assert!(cfg.quantization.is_some(), "{tag}: quantization_config read");
        // What the checkpoint needs beyond an int4 plan's weights region (the linears it keeps
        // bf16, act-order permutations) comes from backend scratch, as `serve` plans it.
        let plan = plan_with_checkpoint(&cfg, &dir, |o| {
            o.weights_dtype = deltaserve_plan::WeightsDtype::Int4;
            o.int4_asym = !v.sym;
        });
        let mut g = cuda(&dir, &cfg, &plan);
        println!(
            "gptq {tag}: {} linears packed, {} converted to the device format, weights {} B",
            done.quantized.len(),
            g.w4_converted,
            g.weights_bytes
        );
        assert!(!done.quantized.is_empty() && g.w4_converted > 0, "{tag}: nothing converted");
        let mut c = cpu(&dir, &cfg);
        failures.extend(compare_int4(&format!("gptq {tag}"), &mut g, &mut c));
        // The same schedule with the dequantised slices for every step above the GEMV's rows (printed, for
        // comparison, not asserted).
        let mut g = cuda(&dir, &cfg, &plan);
        g.set_options(CudaOptions { w4_gemm_max_rows: 0, ..g.options() }).unwrap();
        let mut c = cpu(&dir, &cfg);
        for f in compare_int4(&format!("gptq {tag} (sliced)"), &mut g, &mut c) {
            println!("(not asserted here) {f}");
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// The int4 tensor-core GEMM (steps of 9..=256 rows) against the dequantised slices and cuBLASLt that
/// longer steps take: two backends of the same weights (GEMM on, off) and the CPU reference run prompts of
/// 12, 20, 37, 64, 100 and 200 tokens, then verify-shaped steps of 3 sequences × 4 tokens (12 rows),
/// teacher-forced by the reference, for weights quantised at load (sym, asym) and an asymmetric gptq_v2
/// checkpoint. The GEMM multiplies the exact integers (q − z) and scales in f32, the slices round the
/// weights to bf16, so the paths differ by rounding, which 8 random layers amplify: on the H200 single
/// rows of either path reach 0.2–0.6 relative L2 against the reference (the slices' worst), so rows are
/// not bounded one by one. The GEMM must match the reference within the int4 median bound, with a median error at most
/// 1.25× the slices' (+2e-3) and a worst row no worse than the slices' worst (or the row bound).
#[test]
fn int4_gemm_matches_the_dequantised_slices() {
    use deltaserve_model::synth::gptq::{self, GptqVariant};
    if !gpu() {
        return;
    }
    let mut failures = Vec::new();
    for tag in ["sym", "asym", "gptq-asym-v2"] {
        let (dir, cfg, plan, mut c) = if tag == "gptq-asym-v2" {
            let (dir, _) = tiny_int4_dir_named("gemm-gptq", 8);
            let v2 = GptqVariant { v2: true, sym: false, ..GptqVariant::SYM };
            gptq::convert(&dir, v2, &[], 5, |_| {}).unwrap();
            let cfg = ModelConfig::from_dir(&dir).unwrap();
            let plan = plan_with_checkpoint(&cfg, &dir, |o| {
                o.weights_dtype = deltaserve_plan::WeightsDtype::Int4;
                o.int4_asym = true;
            });
            let c = cpu(&dir, &cfg);
            (dir, cfg, plan, c)
        } else {
            let asym = tag == "asym";
            let (dir, cfg) = tiny_int4_dir(8);
            let plan = plan_with(&cfg, |o| {
                o.weights_dtype = deltaserve_plan::WeightsDtype::Int4;
                o.int4_asym = asym;
            });
            let c = cpu_int4(&dir, &cfg, true, asym, false);
            (dir, cfg, plan, c)
        };
        let mut on = cuda(&dir, &cfg, &plan);
        let mut off = cuda(&dir, &cfg, &plan);
        off.set_options(CudaOptions { w4_gemm_max_rows: 0, ..off.options() }).unwrap();
        let vocab = on.capabilities().vocab_size;
        let mut rng = StdRng::seed_from_u64(9);
        let (mut s_on, mut s_off) = (Score::default(), Score::default());
        let lens = [12usize, 20, 37, 64, 100, 200];
        let pg: Vec<Vec<u32>> = (0..lens.len()).map(|i| pages(20 * i as u32, 300)).collect();
        let prompts: Vec<StepBatch> = lens
            .iter()
            .enumerate()
            .map(|(i, &n)| one(chunk(i as u32, &pg[i], 0, &random_tokens(&mut rng, n, vocab))))
            .collect();
        let mut next = Vec::new();
        for b in &prompts {
            next.push(argmax(&run_scored(b, &mut c, [(&mut on, &mut s_on), (&mut off, &mut s_off)], vocab)) as u32);
        }
        let mut pos = lens.to_vec();
        for _ in 0..4 {
            let mut b = StepBatch::default();
            for i in 0..3 {
                let mut toks = vec![next[i]];
                toks.extend(random_tokens(&mut rng, 3, vocab));
                b.seqs.push(chunk(i as u32, &pg[i], pos[i], &toks));
                pos[i] += 4;
            }
            let r = run_scored(&b, &mut c, [(&mut on, &mut s_on), (&mut off, &mut s_off)], vocab);
            for (i, row) in r.chunks_exact(vocab).enumerate() {
                next[i] = argmax(row) as u32;
            }
        }
        for (s, what) in [(&s_on, "int4 GEMM"), (&s_off, "dequantised slices")] {
            if let Some(e) = s.soft_check_with(&format!("{what} vs CPU ({tag})"), QUANT) {
                println!("(not asserted row by row) {e}");
            }
        }
        let (m_on, m_off) = (s_on.median_l2(), s_off.median_l2());
        println!("int4 GEMM {tag}: median L2 rel err vs CPU {m_on:.3e} with the GEMM, {m_off:.3e} with the slices");
        if m_on > QUANT.median || m_on > 1.25 * m_off + 2e-3 {
            failures.push(format!("{tag}: GEMM median L2 {m_on:.3e} vs {m_off:.3e} with the slices"));
        }
        if s_on.worst_l2 > s_off.worst_l2.max(TOL_ROW) {
            failures
                .push(format!("{tag}: GEMM worst row {:.3e} vs {:.3e} with the slices", s_on.worst_l2, s_off.worst_l2));
        }
        if tag.starts_with("gptq") {
            let _ = std::fs::remove_dir_all(&dir);
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// (5b) bf16 weights with the embedding on the host give the same logits bit for bit (the rows
/// are the same bf16 values: uploaded from the host's gather for steps under 64 rows, gathered from
/// the mapped table by the GPU for the 700-token prompt); an int4 lm_head matches the CPU with the
/// dequantised lm_head.
#[test]
fn embed_on_host_and_int4_lm_head() {
    if !gpu() {
        return;
    }
    let (dir, cfg) = tiny_int4_dir(4);
    let base = plan_with(&cfg, |_| {});
    let host = plan_with(&cfg, |o| o.embed_on_host = true);
    let mut a = cuda(&dir, &cfg, &base);
    let mut b = cuda(&dir, &cfg, &host);
    let allocs = b.arena_stats().allocations;
    let vocab = a.capabilities().vocab_size;
    let mut rng = StdRng::seed_from_u64(3);
    for (i, len) in [1usize, 40, 700].into_iter().enumerate() {
        let ids = random_tokens(&mut rng, len, vocab);
        let st = one(chunk(0, &pages(100 * i as u32, len + 4), 0, &ids));
        assert_eq!(run(&mut a, &st), run(&mut b, &st), "embed_on_host changed prefill logits ({len} tokens)");
        for k in 0..4 {
            let st = one(chunk(0, &pages(100 * i as u32, len + 4), len + k, &[ids[k % len]]));
            assert_eq!(run(&mut a, &st), run(&mut b, &st), "embed_on_host changed decode logits");
        }
    }
    assert_eq!(b.arena_stats().allocations, allocs, "allocations after start");
    println!("embed_on_host: logits identical; arena {:?}", b.arena_stats());
    let head = plan_with(&cfg, |o| o.lm_head_int4 = true);
    let mut g = cuda(&dir, &cfg, &head);
    let mut c = cpu_int4(&dir, &cfg, false, false, true);
    let failures = compare_int4("bf16 + int4 lm_head", &mut g, &mut c);
    assert!(failures.is_empty(), "{failures:#?}");
}

/// (5c) Random int4 weights at the model's shapes: finite logits on prefill and decode, and no
/// allocation after start.
#[test]
fn random_int4_weights_run() {
    if !gpu() {
        return;
    }
    let (_, cfg) = tiny_int4_dir(4);
    for asym in [false, true] {
        let plan = plan_with(&cfg, |o| {
            o.weights_dtype = deltaserve_plan::WeightsDtype::Int4;
            o.int4_asym = asym;
            o.lm_head_int4 = true;
        });
        random_weights_run(&format!("random int4 asym {asym}"), &cfg, &plan);
    }
}

/// A backend of random weights at `cfg`'s shapes under `plan`: a 600-token prefill and 5 decode steps give
/// finite logits, and nothing is allocated after start.
pub(crate) fn random_weights_run(label: &str, cfg: &ModelConfig, plan: &deltaserve_plan::Plan) {
    let mut g = CudaBackend::with_options(cfg, WeightSource::RandomWeights { seed: 1 }, plan, 2, test_opts()).unwrap();
    let allocs = g.arena_stats().allocations;
    let vocab = g.capabilities().vocab_size;
    let ids: Vec<u32> = (0..600).map(|i| (i * 7 % vocab) as u32).collect();
    let pg = pages(0, 610);
    let l = run(&mut g, &one(chunk(0, &pg, 0, &ids)));
    assert!(l.iter().all(|x| x.is_finite()), "{label}: prefill logits not finite");
    for k in 0..5 {
        let l = run(&mut g, &one(chunk(0, &pg, 600 + k, &[3])));
        assert!(l.iter().all(|x| x.is_finite()), "{label}: decode logits not finite");
    }
    assert_eq!(g.arena_stats().allocations, allocs);
    println!("{label}: weights {} B, logits finite", g.weights_bytes);
}

/// Steps the int4 GEMM takes (40 rows of one prompt, then 12 rows of three sequences) with each residual
/// add + RMSNorm run in the split-K reduce of the projection before it (`CudaOptions::norms_in_reduce`)
/// give the logits of the reduce and the norm kernel apart, bit for bit, and so does the decode step
/// after them: at the 27B widths (4 layers, one attention; random int4 weights), where the
/// hidden-size projections split over K. GPU only.
#[test]
fn norms_in_the_reduce_equal_the_norm_kernel() {
    use deltaserve_cuda::ops::w4_gemm;
    if !gpu() {
        return;
    }
    let rt = deltaserve_cuda::Runtime::open(0).unwrap();
    let free = rt.free_memory().unwrap_or(0);
    if free < 24 << 30 {
        println!("SKIP: two 27B-width backends need 24 GiB free ({} GiB here)", free >> 30);
        return;
    }
    let preset = Preset::parse("qwen3.6-27b").unwrap();
    let cfg = ModelConfig::from_json_str(&preset.config_json(Some(4)).to_string()).unwrap();
    let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
    for t in [12, 40] {
        let cfg = w4_gemm::w4_gemm_config(t, h, i, rt.sm_count as usize, usize::MAX);
        assert!(cfg.splits > 1, "down at {t} rows does not split ({cfg:?}): the test would not reach the fused norm");
    }
    let plan = plan_with(&cfg, |o| {
        o.weights_dtype = deltaserve_plan::WeightsDtype::Int4;
        o.budget_bytes = 12 << 30;
        o.max_batch_tokens = 2048;
        o.max_context = Some(4096);
    });
    let new_backend = |on: bool| {
        let mut b =
            CudaBackend::with_options(&cfg, WeightSource::RandomWeights { seed: 9 }, &plan, 2, test_opts()).unwrap();
        b.set_options(CudaOptions { norms_in_reduce: on, ..b.options() }).unwrap();
        b
    };
    let (mut on, mut off) = (new_backend(true), new_backend(false));
    let vocab = cfg.vocab_size;
    let mut rng = StdRng::seed_from_u64(43);
    let pg: Vec<Vec<u32>> = (0..3).map(|s| pages(64 * s as u32, 128)).collect();
    let toks: Vec<Vec<u32>> = (0..3).map(|_| random_tokens(&mut rng, 64, vocab)).collect();
    let prompt = chunk(0, &pg[0], 0, &toks[0][..40]);
    // 1 + 4 + 7 rows, then a decode step of the three.
    let mixed = StepBatch {
        pre: vec![],
        seqs: vec![
            chunk(0, &pg[0], 40, &toks[0][40..41]),
            chunk(1, &pg[1], 0, &toks[1][..4]),
            chunk(2, &pg[2], 0, &toks[2][..7]),
        ],
        post: vec![],
    };
    let decode = StepBatch {
        pre: vec![],
        seqs: vec![
            chunk(0, &pg[0], 41, &toks[0][41..42]),
            chunk(1, &pg[1], 4, &toks[1][4..5]),
            chunk(2, &pg[2], 7, &toks[2][7..8]),
        ],
        post: vec![],
    };
    for (what, b) in
        [("a 40-token prompt", one(prompt)), ("12 rows of three sequences", mixed), ("the decode step after", decode)]
    {
        let (a, z) = (run(&mut on, &b), run(&mut off, &b));
        assert!(a.iter().all(|v| v.is_finite()), "{what}: non-finite logits");
        let differ = a.iter().zip(&z).filter(|(x, y)| x.to_bits() != y.to_bits()).count();
        println!("norms in the reduce, {what}: {} logits, {differ} differ from the norm kernel's", a.len());
        assert_eq!(differ, 0, "{what}: the norm in the reduce changed {differ} logits");
    }
}
