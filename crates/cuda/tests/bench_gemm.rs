//! Benchmark of cuBLASLt's algorithm choice at the shapes the engine runs
//! (`cargo test -p deltaserve-cuda --release --test bench_gemm -- --ignored --nocapture`).
//!
//! For each GEMM of a 4,096-token prefill step of the 27B (bf16 out) and of its vision tower at one
//! 1024×1024 image (4,096 patches, f32 out), every algorithm cuBLASLt's heuristic offers (up to 16) is
//! timed on random operands: the median of 20 launches (CUDA events around each) after 3 warm-up ones.
//! It prints the heuristic's first choice (what the engine runs) and the fastest offered, each as µs and
//! TFLOP/s, and their ratio: how much a per-shape choice by measurement would gain over the heuristic.
//! `DS_BENCH_GEMM_TOKENS` sets the token count (default 4096).

use cudarc::driver::sys::CUevent_flags;
use deltaserve_cuda::gemm::{Gemm, recommended_workspace_bytes};
use deltaserve_cuda::ops::init::{Init, init_random};
use deltaserve_cuda::{Arena, DevSpan, KernelDims, Kernels, Runtime};

/// (what, out features m, in features k, f32 output).
const SHAPES: [(&str, usize, usize, bool); 14] = [
    ("27B DeltaNet in-proj qkv", 10240, 5120, false),
    ("27B DeltaNet in-proj z", 6144, 5120, false),
    ("27B DeltaNet out", 5120, 6144, false),
    ("27B attention q + gate", 12288, 5120, false),
    ("27B attention k (or v)", 1024, 5120, false),
    ("27B attention o", 5120, 6144, false),
    ("27B MLP gate + up", 34816, 5120, false),
    ("27B MLP down", 5120, 17408, false),
    ("tower qkv", 3456, 1152, true),
    ("tower proj", 1152, 1152, true),
    ("tower fc1", 4304, 1152, true),
    ("tower fc2", 1152, 4304, true),
    ("tower merger fc1 (1,024 rows)", 4608, 4608, true),
    ("tower merger fc2 (1,024 rows)", 5120, 4608, true),
];

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

#[test]
#[ignore = "benchmark; needs a GPU"]
fn bench_gemm_algorithms() {
    let Ok(rt) = Runtime::open(0) else {
        println!("SKIP: no GPU");
        return;
    };
    let tokens: usize = std::env::var("DS_BENCH_GEMM_TOKENS").ok().and_then(|v| v.parse().ok()).unwrap_or(4096);
    let k = Kernels::load(&rt, KernelDims::QWEN35_27B).unwrap();
    let ws_bytes = recommended_workspace_bytes(&rt);
    let most_w = SHAPES.iter().map(|s| s.1 * s.2).max().unwrap();
    let most_x = SHAPES.iter().map(|s| s.2).max().unwrap() * tokens;
    let most_y = SHAPES.iter().map(|s| s.1).max().unwrap() * tokens;
    let mut arena = Arena::new(rt.context().clone());
    let reg = arena.add_region("bench", 2 * most_w + 2 * most_x + 4 * most_y + ws_bytes + (1 << 20)).unwrap();
    let s = rt.stream();
    let w = arena.alloc(reg, 2 * most_w).unwrap().ptr;
    let x = arena.alloc(reg, 2 * most_x).unwrap().ptr;
    let y = arena.alloc(reg, 4 * most_y).unwrap().ptr;
    let ws = arena.alloc(reg, ws_bytes).unwrap().ptr;
    init_random(&k, s, w, most_w, 1, Init::Normal(0.02), false).unwrap();
    init_random(&k, s, x, most_x, 2, Init::Normal(1.0), false).unwrap();
    let gemm = Gemm::new(&rt, DevSpan { ptr: ws, bytes: ws_bytes }).unwrap();
    let flags = Some(CUevent_flags::CU_EVENT_DEFAULT);
    let (e0, e1) = (rt.context().new_event(flags).unwrap(), rt.context().new_event(flags).unwrap());
    println!("GEMM algorithms at {tokens} tokens: the heuristic's first choice against the fastest it offers");
    let (mut first_total, mut best_total) = (0.0, 0.0);
    for (what, m, kd, f32_out) in SHAPES {
        let n = if what.contains("merger") { tokens / 4 } else { tokens };
        let offered = gemm.algorithms(m, n, kd, f32_out, 16).unwrap();
        let mut us = Vec::new();
        for i in 0..offered {
            gemm.use_algorithm(m, n, kd, f32_out, i).unwrap();
            let run = || gemm.linear_out(s, x, w, y, n, m, kd, f32_out);
            if run().is_err() {
                us.push(f64::INFINITY);
                continue;
            }
            for _ in 0..2 {
                run().unwrap();
            }
            let t = (0..20)
                .map(|_| {
                    e0.record(s).unwrap();
                    run().unwrap();
                    e1.record(s).unwrap();
                    1e3 * e0.elapsed_ms(&e1).unwrap() as f64
                })
                .collect();
            us.push(median(t));
        }
        let best = (0..offered).min_by(|&a, &b| us[a].partial_cmp(&us[b]).unwrap()).unwrap();
        let tf = |us: f64| 2.0 * (m * n * kd) as f64 / (us * 1e-6) / 1e12;
        println!(
            "GEMM {what:<30} m {m:>5} n {n:>5} k {kd:>5}: first {:>8.1} µs ({:>5.0} TFLOP/s), best #{best:<2} of {offered:<2} \
             {:>8.1} µs ({:>5.0} TFLOP/s): {:.3}×",
            us[0],
            tf(us[0]),
            us[best],
            tf(us[best]),
            us[best] / us[0]
        );
        println!("GEMM {what} all µs: {:?}", us.iter().map(|u| (u * 10.0).round() / 10.0).collect::<Vec<_>>());
        first_total += us[0];
        best_total += us[best];
    }
    println!("GEMM total: first {first_total:.1} µs, best {best_total:.1} µs: {:.3}×", best_total / first_total);
}
