//! Benchmark of CudaBackend at the Qwen3.6-27B shapes with random weights generated on the GPU
//! (`cargo test -p deltaserve-cuda --release --test bench_backend -- --ignored --nocapture`).
//! DS_BENCH_LAYERS (default 64) cuts the depth; numbers are also reported per layer. DS_BENCH_GEMV=0 /
//! DS_BENCH_DECODE=0 skip the GEMV comparison / the decode timings.
//!
//! Measures, in one process: the ceilings (a bf16 8192³ cuBLASLt GEMM, a 4 GiB device copy), the
//! decode GEMV against cuBLASLt on each 27B projection shape at 1/2/4/8 tokens, a 4096-token
//! prefill (one sequence), decode at batch 1/8/32 and contexts 1K/32K with eager launches and
//! with CUDA graphs against the bandwidth roofline (weights + KV read + DeltaNet state read and
//! written per step, over the measured copy bandwidth), and the process's GPU memory
//! (nvidia-smi) against the plan.
//!
use std::time::Instant;

use cudarc::driver::result;
use deltaserve_backend::{Backend, SeqChunk, StepBatch, step_logits};
use deltaserve_cuda::backend::CudaOptions;
use deltaserve_cuda::ops::gemv::{GemvOut, gemv};
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

/// The decode GEMV against cuBLASLt at the 27B projection shapes (one layer's launches; fused
/// GEMV outputs vs one GEMM each), n = 1, 2, 4, 8 tokens: µs per launch group and weight GB/s.
/// Weights rotate through a 3 GiB buffer so no launch reads from L2.
fn gemv_vs_cublas(gbs_copy: f64) {
    let rt = Runtime::open(0).unwrap();
    let k = Kernels::load(&rt, KernelDims::QWEN35_27B).unwrap();
    let mut arena = Arena::new(rt.context().clone());
    let pool_bytes = 3usize << 30;
    let r = arena.add_region("gemv", pool_bytes + (64 << 20)).unwrap();
    let pool = arena.alloc(r, pool_bytes).unwrap();
    let x = arena.alloc(r, 8 * 17408 * 2).unwrap();
    let y = arena.alloc(r, 8 * 248320 * 4).unwrap();
    let ws = arena.alloc(r, 32 << 20).unwrap();
    init_random(&k, rt.stream(), pool.ptr, pool_bytes / 2, 3, Init::Normal(0.02), false).unwrap();
    init_random(&k, rt.stream(), x.ptr, 8 * 17408, 4, Init::Normal(1.0), false).unwrap();
    let g = deltaserve_cuda::gemm::Gemm::new(&rt, ws).unwrap();
    // (label, k, output rows of each matrix sharing x, f32 out)
    let shapes: [(&str, usize, &[usize], bool); 7] = [
        ("gdn qkv+z+ba", 5120, &[10240, 6144, 96], false),
        ("gdn out", 6144, &[5120], false),
        ("attn q+k+v", 5120, &[12288, 1024, 1024], false),
        ("attn o", 6144, &[5120], false),
        ("mlp gate+up", 5120, &[34816], false),
        ("mlp down", 17408, &[5120], false),
        ("lm_head", 5120, &[248320], true),
    ];
    for (label, kd, ms, f32_out) in shapes {
        let bytes: usize = ms.iter().map(|m| m * kd * 2).sum();
        let span = bytes.div_ceil(256) * 256;
        let copies = (pool_bytes / span).max(1);
        let mut line = Vec::new();
        for n in [1usize, 2, 4, 8] {
            let mut t = [0f64; 2];
            for (which, tt) in t.iter_mut().enumerate() {
                let reps = 30;
                for i in 0..reps + 3 {
                    if i == 3 {
                        rt.synchronize().unwrap();
                        *tt = -now();
                    }
                    let mut at = pool.ptr + ((i % copies) * span) as u64;
                    let mut yo = y.ptr;
                    let mut outs = Vec::new();
                    for &m in ms {
                        outs.push(GemvOut { w: at, y: yo, m });
                        at += (m * kd * 2) as u64;
                        yo += (n * m * 4).div_ceil(256) as u64 * 256;
                    }
                    if which == 0 {
                        gemv(&k, rt.stream(), x.ptr, n, kd, &outs, f32_out).unwrap();
                    } else {
                        for o in &outs {
                            g.linear_out(rt.stream(), x.ptr, o.w, o.y, n, o.m, kd, f32_out).unwrap();
                        }
                    }
                }
                rt.synchronize().unwrap();
                *tt = (*tt + now()) / reps as f64;
            }
            let (gv, cb) = (bytes as f64 / t[0] / 1e9, bytes as f64 / t[1] / 1e9);
            line.push(format!(
                "n={n}: gemv {:.1} µs {gv:.0} GB/s ({:.0}% of copy) | cuBLASLt {:.1} µs {cb:.0} GB/s",
                t[0] * 1e6,
                100.0 * gv / gbs_copy,
                t[1] * 1e6
            ));
        }
        println!("BENCH gemv {label} (k {kd}, m {ms:?}, {:.1} MB): {}", bytes as f64 / 1e6, line.join("; "));
    }
}

fn now() -> f64 {
    use std::sync::OnceLock;
    static T0: OnceLock<Instant> = OnceLock::new();
    T0.get_or_init(Instant::now).elapsed().as_secs_f64()
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
    if std::env::var("DS_BENCH_GEMV").map_or(true, |v| v != "0") {
        gemv_vs_cublas(gbs);
    }

    let cfg = ModelConfig::from_json_str(&Preset::Qwen36_27b.config_json(Some(layers)).to_string()).unwrap();
    let d = cfg.dims();
    let budget: u64 =
        std::env::var("DS_BENCH_GIB").ok().and_then(|s| s.parse().ok()).unwrap_or(if layers >= 48 { 128 } else { 64 });
    let mut o = PlanOptions::gpu_defaults(budget << 30);
    o.max_context = Some(32768);
    o.max_seqs = 32;
    o.snapshot_slots = 1;
    let plan = Plan::new(&cfg, &o).unwrap();
    let t0 = Instant::now();
    let mut be = CudaBackend::new(&cfg, WeightSource::RandomWeights { seed: 7 }, &plan, 1).unwrap();
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
            all_logits: false,
            draft: 0,
            greedy_draft_vocab: 0,
            rope_delta: 0,
            images: Vec::new(),
            save_within: Vec::new(),
        }],
        post: vec![],
    };
    // Prefill 4096 tokens from position 0 (state zeroed each time): 1 warm-up + 3 timed.
    let mut pre = Vec::new();
    for i in 0..4 {
        logits.clear();
        let t0 = Instant::now();
        step_logits(&mut be, &chunk(0, 0, &prompt), &mut logits).unwrap();
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

    // Decode: batch 1/8/32 at contexts 1K and 32K, eager launches vs CUDA graphs. The contexts
    // are not prefilled (KV and state contents do not change the work): every sequence decodes
    // from position ctx with its own pages (zeroed KV) and slot. Roofline: the bytes a step must
    // move (weights read once; each sequence's KV read; DeltaNet state read and written) over the
    // measured copy bandwidth.
    let weight_bytes = (plan.weights_bytes - plan.weight_parts.embed) as f64; // one embed row is read
    let kv_token_bytes = (d.num_attention_layers * 2 * d.kv_dim * 2) as f64;
    let state_seq_bytes = (d.num_deltanet_layers
        * (d.gdn_v_heads * d.gdn_k_dim * d.gdn_v_dim * 4 + d.conv_kernel.saturating_sub(1) * d.conv_channels * 2))
        as f64;
    println!(
        "BENCH decode roofline inputs: weights {:.2} GB/step; KV {:.1} KiB/token; DeltaNet state {:.1} MB/sequence (read + written); copy {gbs:.0} GB/s; plan: {} KV pages of {page}, max_seqs {}",
        weight_bytes / 1e9,
        kv_token_bytes / 1024.0,
        2.0 * state_seq_bytes / 1e6,
        plan.num_kv_pages,
        plan.max_seqs
    );
    // DS_BENCH_DECODE=0 skips the decode timings (profiles and memory only).
    if std::env::var("DS_BENCH_DECODE").map_or(true, |v| v != "0") {
        let steps = 12usize;
        let mut next_page = 0u32;
        for ctx in [1024usize, 32768 - 2 * steps - 8] {
            for batch in [1usize, 8, 32] {
                let per_seq = (ctx + 2 * steps + 8).div_ceil(page);
                if batch > plan.max_seqs || batch * per_seq > plan.num_kv_pages {
                    println!(
                        "BENCH decode batch {batch}, ctx {ctx}: SKIP (needs {} pages, {batch} seqs)",
                        batch * per_seq
                    );
                    continue;
                }
                if next_page as usize + batch * per_seq > plan.num_kv_pages {
                    next_page = 0;
                }
                let seq_pages: Vec<Vec<u32>> = (0..batch)
                    .map(|i| (0..per_seq as u32).map(|p| next_page + (i * per_seq) as u32 + p).collect())
                    .collect();
                next_page += (batch * per_seq) as u32;
                let bytes = weight_bytes + batch as f64 * (ctx as f64 * kv_token_bytes + 2.0 * state_seq_bytes);
                let floor_ms = bytes / (gbs * 1e9) * 1e3;
                let mut line = Vec::new();
                for graphs in [false, true] {
                    be.set_options(CudaOptions { cuda_graphs: graphs, ..CudaOptions::default() }).unwrap();
                    let mut times = Vec::new();
                    let mut toks = vec![1u32; batch];
                    for i in 0..steps {
                        let b = StepBatch {
                            pre: vec![],
                            seqs: (0..batch)
                                .map(|j| SeqChunk {
                                    seq_id: j as u64,
                                    slot: j as u32,
                                    pages: seq_pages[j].clone(),
                                    start: ctx + i + if graphs { steps } else { 0 },
                                    tokens: vec![toks[j]],
                                    want_logits: true,
                                    all_logits: false,
                                    draft: 0,
                                    greedy_draft_vocab: 0,
                                    rope_delta: 0,
                                    images: Vec::new(),
                                    save_within: Vec::new(),
                                })
                                .collect(),
                            post: vec![],
                        };
                        logits.clear();
                        let t0 = Instant::now();
                        step_logits(&mut be, &b, &mut logits).unwrap();
                        times.push(t0.elapsed().as_secs_f64());
                        for (j, row) in logits.chunks_exact(d.vocab).enumerate() {
                            toks[j] = row
                                .iter()
                                .enumerate()
                                .fold((0, f32::MIN), |m, (k, &v)| if v > m.1 { (k, v) } else { m })
                                .0 as u32;
                        }
                    }
                    assert!(logits.iter().all(|x| x.is_finite()));
                    let ms = median(times[3..].to_vec()) * 1e3;
                    line.push(format!(
                        "{}: {ms:.2} ms/step = {:.1} tok/s ({:.0}% of roofline)",
                        if graphs { "graphs" } else { "eager" },
                        batch as f64 * 1e3 / ms,
                        100.0 * floor_ms / ms
                    ));
                }
                println!(
                    "BENCH decode batch {batch}, ctx {ctx}: roofline {floor_ms:.2} ms ({:.2} GB/step); {}",
                    bytes / 1e9,
                    line.join("; ")
                );
            }
        }
    }
    println!("BENCH graph stats: {:?}", be.graph_stats());
    be.set_options(CudaOptions::default()).unwrap();
    // Where the time goes: one prefill and one decode step, eagerly, with a timing event after each
    // op group (GPU time per group).
    for (label, start, toks) in [("prefill 4096", 0usize, &prompt[..]), ("decode 4K ctx", t, &prompt[..1])] {
        let slot = 0;
        if start > 0 {
            logits.clear();
            step_logits(&mut be, &chunk(slot, 0, &prompt), &mut logits).unwrap();
        }
        be.set_profiling(true).unwrap();
        logits.clear();
        step_logits(&mut be, &chunk(slot, start, toks), &mut logits).unwrap();
        let prof = be.take_profile();
        be.set_profiling(false).unwrap();
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
