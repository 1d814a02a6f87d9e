//! Benchmark of CudaBackend at the Qwen3.6-27B shapes with random weights generated on the GPU
//! (`cargo test -p deltaserve-cuda --release --test bench_backend -- --ignored --nocapture`).
//! DS_BENCH_LAYERS (default 64) cuts the depth; numbers are also reported per layer.
//!
//! Measures, in one process: the ceilings (a bf16 8192³ cuBLASLt GEMM, a 4 GiB device copy), a
//! 4096-token prefill (one sequence), decode at batch 1 at 128 and ~4K context, and the process's
//! GPU memory (nvidia-smi) against the plan.

use std::time::Instant;

use cudarc::driver::result;
use deltaserve_backend::{Backend, SeqChunk, StepBatch};
use deltaserve_cuda::ops::init::{Init, init_random};
use deltaserve_cuda::{Arena, CudaBackend, KernelDims, Kernels, Runtime, WeightSource};
use deltaserve_model::ModelConfig;
use deltaserve_model::synth::Preset;
use deltaserve_plan::{Plan, PlanOptions};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

/// (bf16 GEMM TFLOP/s at 8192³, device copy GB/s counting read + write).
fn ceilings() -> (f64, f64) {
    let rt = Runtime::open(0).unwrap();
    let k = Kernels::load(&rt, KernelDims::QWEN35_27B).unwrap();
    let mut arena = Arena::new(rt.context().clone());
    let n = 8192usize;
    let r = arena.add_region("bench", 3 * n * n * 2 + (32 << 20)).unwrap();
    let a = arena.alloc(r, n * n * 2).unwrap();
    let b = arena.alloc(r, n * n * 2).unwrap();
    let c = arena.alloc(r, n * n * 2).unwrap();
    let ws = arena.alloc(r, 32 << 20).unwrap();
    init_random(&k, rt.stream(), a.ptr, n * n, 1, Init::Normal(1.0), false).unwrap();
    init_random(&k, rt.stream(), b.ptr, n * n, 2, Init::Normal(1.0), false).unwrap();
    let g = deltaserve_cuda::gemm::Gemm::new(&rt, ws).unwrap();
    let mut times = Vec::new();
    for i in 0..12 {
        rt.synchronize().unwrap();
        let t0 = Instant::now();
        g.linear(rt.stream(), a.ptr, b.ptr, c.ptr, n, n, n).unwrap();
        rt.synchronize().unwrap();
        if i >= 2 {
            times.push(t0.elapsed().as_secs_f64());
        }
    }
    let tflops = 2.0 * (n as f64).powi(3) / median(times) / 1e12;
    drop(g);
    drop(arena);
    let mut arena = Arena::new(rt.context().clone());
    let bytes = 4usize << 30;
    let r = arena.add_region("copy", 2 * bytes).unwrap();
    let src = arena.alloc(r, bytes).unwrap();
    let dst = arena.alloc(r, bytes).unwrap();
    rt.memset(src.ptr, 1, bytes).unwrap();
    let mut times = Vec::new();
    for i in 0..8 {
        rt.synchronize().unwrap();
        let t0 = Instant::now();
        // SAFETY: both spans are 4 GiB device ranges of this arena.
        unsafe { result::memcpy_dtod_async(dst.ptr, src.ptr, bytes, rt.stream().cu_stream()) }.unwrap();
        rt.synchronize().unwrap();
        if i >= 2 {
            times.push(t0.elapsed().as_secs_f64());
        }
    }
    let gbs = 2.0 * bytes as f64 / median(times) / 1e9;
    (tflops, gbs)
}

fn gpu_used_mib() -> String {
    std::process::Command::new("nvidia-smi")
        .args(["--query-compute-apps=pid,used_memory", "--format=csv,noheader"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().replace('\n', "; "))
        .unwrap_or_else(|e| format!("nvidia-smi failed: {e}"))
}

#[test]
#[ignore]
fn bench_27b() {
    if let Err(e) = Runtime::open(0) {
        println!("SKIP: {e}");
        return;
    }
    let layers: usize = std::env::var("DS_BENCH_LAYERS").ok().and_then(|s| s.parse().ok()).unwrap_or(64);
    let (tflops, gbs) = ceilings();
    println!("BENCH ceilings: bf16 GEMM 8192^3 {tflops:.0} TFLOP/s; device copy {gbs:.0} GB/s (read+write)");

    let cfg = ModelConfig::from_json_str(&Preset::Qwen36_27b.config_json(Some(layers)).to_string()).unwrap();
    let d = cfg.dims();
    let mut o = PlanOptions::gpu_defaults(if layers >= 48 { 118 << 30 } else { 64 << 30 });
    o.max_context = Some(32768);
    o.backend_scratch_bytes = deltaserve_cuda::backend::scratch_bytes(&cfg, o.max_batch_tokens, o.max_seqs) as u64;
    let plan = Plan::new(&cfg, &o).unwrap();
    let t0 = Instant::now();
    let mut be = CudaBackend::new(&cfg, WeightSource::RandomWeights { seed: 7 }, &plan, 2).unwrap();
    println!(
        "BENCH backend up in {:.1} s ({} layers; weights {:.2} GB laid out vs plan {:.2} GB; scratch {:.0} MB)",
        t0.elapsed().as_secs_f64(),
        layers,
        be.weights_bytes as f64 / 1e9,
        plan.weights_bytes as f64 / 1e9,
        be.scratch_bytes as f64 / 1e6
    );
    let stats = be.arena_stats();
    let page = plan.page_size;
    let pages: Vec<u32> = (0..(32768 / page) as u32).collect();
    let t = 4096usize;
    let prompt: Vec<u32> = (0..t).map(|i| ((i * 7919) % d.vocab) as u32).collect();
    let mut logits = Vec::new();
    let chunk = |slot, start, tokens: &[u32]| StepBatch {
        pre: vec![],
        seqs: vec![SeqChunk {
            seq_id: 0,
            slot,
            pages: pages.clone(),
            start,
            tokens: tokens.to_vec(),
            want_logits: true,
            draft: 0,
        }],
        post: vec![],
    };
    // Prefill 4096 tokens from position 0 (state zeroed each time): 1 warm-up + 3 timed.
    let mut pre = Vec::new();
    for i in 0..4 {
        logits.clear();
        let t0 = Instant::now();
        be.step(&chunk(0, 0, &prompt), &mut logits).unwrap();
        if i > 0 {
            pre.push(t0.elapsed().as_secs_f64());
        }
    }
    assert!(logits.iter().all(|x| x.is_finite()));
    let pre_s = median(pre);
    // FLOPs of the linears (2·params·T) + lm_head for one row + attention scores/values (causal).
    let linear_params = plan.weight_parts.linear_params as f64;
    let attn_flops = d.num_attention_layers as f64 * 4.0 * d.q_heads as f64 * d.head_dim as f64 * (t * t) as f64 / 2.0;
    let gemm_flops = 2.0 * linear_params * t as f64 + 2.0 * (d.vocab * d.hidden) as f64;
    let pre_tflops = (gemm_flops + attn_flops) / pre_s / 1e12;
    println!(
        "BENCH prefill {t} tokens: {:.1} ms = {:.0} tok/s; {:.0} TFLOP/s ({:.0}% of the measured GEMM ceiling); {:.2} ms/layer",
        pre_s * 1e3,
        t as f64 / pre_s,
        pre_tflops,
        100.0 * pre_tflops / tflops,
        pre_s * 1e3 / layers as f64
    );

    // Decode at batch 1 after the 4K prefill (context 4097..), and on a fresh 128-token context.
    let weight_bytes = (plan.weights_bytes - plan.weight_parts.embed) as f64; // one embed row is read
    // Decode only reads the weights: the floor is their bytes over the measured DRAM traffic rate
    // (the copy's read + write bytes per second).
    let floor_ms = weight_bytes / (gbs * 1e9) * 1e3;
    for (label, slot, ctx) in [("4K context", 0u32, t), ("128 context", 1, 128)] {
        if ctx == 128 {
            logits.clear();
            be.step(&chunk(slot, 0, &prompt[..128]), &mut logits).unwrap();
        }
        let mut times = Vec::new();
        let mut tok = 1u32;
        for i in 0..40 {
            logits.clear();
            let t0 = Instant::now();
            be.step(&chunk(slot, ctx + i, &[tok]), &mut logits).unwrap();
            times.push(t0.elapsed().as_secs_f64());
            tok = logits.iter().enumerate().fold((0, f32::MIN), |m, (j, &v)| if v > m.1 { (j, v) } else { m }).0 as u32;
        }
        let ms = median(times[5..].to_vec()) * 1e3;
        println!(
            "BENCH decode batch 1, {label}: {ms:.2} ms/token = {:.1} tok/s; bandwidth floor {floor_ms:.2} ms ({:.0}% of roofline); {:.3} ms/layer",
            1e3 / ms,
            100.0 * floor_ms / ms,
            ms / layers as f64
        );
    }
    // Where the time goes: one prefill and one decode step with a synchronisation after each op
    // group (adds ~µs per group; the totals are close to the unprofiled step).
    for (label, start, toks) in [("prefill 4096", 0usize, &prompt[..]), ("decode 4K ctx", t, &prompt[..1])] {
        let slot = 0;
        if start > 0 {
            logits.clear();
            be.step(&chunk(slot, 0, &prompt), &mut logits).unwrap();
        }
        be.set_profiling(true);
        logits.clear();
        be.step(&chunk(slot, start, toks), &mut logits).unwrap();
        let prof = be.take_profile();
        be.set_profiling(false);
        let total: f64 = prof.iter().map(|(_, s)| s).sum();
        let parts: Vec<String> =
            prof.iter().map(|(n, s)| format!("{n} {:.2} ms ({:.0}%)", s * 1e3, 100.0 * s / total)).collect();
        println!("BENCH profile {label}: total {:.2} ms: {}", total * 1e3, parts.join("; "));
    }
    assert_eq!(be.arena_stats(), stats, "arena counters moved while serving");
    println!(
        "BENCH memory: plan total {:.2} GiB (arena {:.2} GiB + reserve {:.2} GiB); backend capacity {:.2} GiB; nvidia-smi pid,used: {}",
        plan.total_bytes as f64 / (1u64 << 30) as f64,
        plan.arena_bytes() as f64 / (1u64 << 30) as f64,
        plan.options.runtime_reserve_bytes as f64 / (1u64 << 30) as f64,
        stats.capacity_bytes as f64 / (1u64 << 30) as f64,
        gpu_used_mib()
    );
    println!("BENCH regions: {:?}", be.regions());
    println!("BENCH gemm heuristic calls: {}", be.gemm_heuristic_calls());
}
