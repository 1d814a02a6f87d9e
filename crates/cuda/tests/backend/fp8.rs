//! Block-FP8 decoder linears against the CPU on the dequantised weights: a bf16 checkpoint quantised at
//! load on the GPU (`--quantize fp8`), and random FP8 weights at the model's shapes.

use deltaserve_backend::Backend;
use deltaserve_cuda::{CudaBackend, WeightSource};
use deltaserve_plan::WeightsDtype;

use crate::common::*;
use crate::int4::{compare_int4, tiny_int4_dir};

/// FP8 tensor cores: Ada (sm_89) and later; the CUDA backend keeps FP8 weights only there.
fn fp8_gpu() -> bool {
    gpu() && deltaserve_cuda::Runtime::open(0).is_ok_and(|rt| rt.cc >= (8, 9))
}

/// A bf16 checkpoint quantised to block FP8 at load (bit for bit as `fp8_block_quantize`): prefill of 1 ..
/// 1100 tokens (the FP8 GEMV up to 16 rows; above, cuBLASLt's block-scaled FP8 GEMM on Hopper with the
/// activations quantised per 128 features, else dequantised rows) and a greedy decode, against the CPU on
/// the dequantised weights (which does not quantise activations).
#[test]
fn fp8_quantized_at_load_matches_cpu() {
    if !fp8_gpu() {
        return;
    }
    let (dir, cfg) = tiny_int4_dir(8);
    let plan = plan_with(&cfg, |o| o.weights_dtype = WeightsDtype::Fp8Block);
    let mut g = cuda(&dir, &cfg, &plan);
    println!("fp8 at load: {} linears quantised, weights {} B", g.w4_quantized, g.weights_bytes);
    assert!(g.w4_quantized > 0, "nothing quantised");
    let mut c = cpu_fp8(&dir, &cfg);
    let failures = compare_int4("fp8 (quantised at load)", &mut g, &mut c);
    assert!(failures.is_empty(), "{failures:#?}");
}

/// Random FP8 weights at the model's shapes: finite logits on prefill and decode, and no allocation after
/// start.
#[test]
fn random_fp8_weights_run() {
    if !fp8_gpu() {
        return;
    }
    let (_, cfg) = tiny_int4_dir(4);
    let plan = plan_with(&cfg, |o| o.weights_dtype = WeightsDtype::Fp8Block);
    let mut g = CudaBackend::with_options(&cfg, WeightSource::RandomWeights { seed: 1 }, &plan, 2, test_opts()).unwrap();
    let allocs = g.arena_stats().allocations;
    let vocab = g.capabilities().vocab_size;
    let ids: Vec<u32> = (0..600).map(|i| (i * 7 % vocab) as u32).collect();
    let pg = pages(0, 610);
    let l = run(&mut g, &one(chunk(0, &pg, 0, &ids)));
    assert!(l.iter().all(|x| x.is_finite()), "prefill logits not finite");
    for k in 0..5 {
        let l = run(&mut g, &one(chunk(0, &pg, 600 + k, &[3])));
        assert!(l.iter().all(|x| x.is_finite()), "decode logits not finite");
    }
    assert_eq!(g.arena_stats().allocations, allocs);
    println!("random fp8: weights {} B, logits finite", g.weights_bytes);
}
