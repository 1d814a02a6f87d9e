//! Block-FP8 linears at the Qwen3.6-27B shapes against bf16 on the same GPU (run explicitly, needs one with
//! FP8 tensor cores):
//!
//!   cargo test --release -p deltaserve-cuda --test bench_fp8 -- --ignored --nocapture
//!
//! - decode: the FP8 GEMV (`gemv_fp8`) and the bf16 GEMV at 1, 8 and 16 tokens, GB/s over the bytes the
//!   kernel reads (codes + scales, or bf16 weights) as a share of the device-to-device copy bandwidth
//!   measured in the same run; several copies of each weight cycled so that the footprint exceeds L2;
//! - prefill: 32 .. 4096 tokens through the activations' quantisation + cuBLASLt's block-scaled FP8 GEMM
//!   against one bf16 cuBLASLt GEMM of the same shape: TFLOP/s, the quantisation's share, the speed-up.

use deltaserve_cuda::ops::fp8::{self, Fp8Out, Fp8Weights};
use deltaserve_cuda::ops::gemv::{self, GemvOut};
use deltaserve_cuda::ops::init::{Init, init_random};
use deltaserve_cuda::{DevSpan, KernelDims, Kernels, LibStatus, Runtime, gemm};
use deltaserve_plan::cuda::Fp8Bytes;

mod bench_util;

use bench_util::{Dev, R, copy_bandwidth, time_ms};

/// The 27B's linears (name, out, in): qkv + z + b/a of a DeltaNet layer, its out, attention q(+gate), k/v,
/// o, the MLP's gate (= up) and down.
const SHAPES: &[(&str, usize, usize)] = &[
    ("gdn qkv", 10240, 5120),
    ("gdn z", 6144, 5120),
    ("gdn out", 5120, 6144),
    ("attn q+gate", 12288, 5120),
    ("attn k", 1024, 5120),
    ("attn o", 5120, 6144),
    ("mlp gate", 17408, 5120),
    ("mlp down", 5120, 17408),
];

#[test]
#[ignore = "benchmark; needs a GPU with FP8 tensor cores"]
fn bench_fp8_27b() {
    if !LibStatus::probe().driver {
        eprintln!("SKIP bench: no CUDA driver");
        return;
    }
    let rt = Runtime::open(0).expect("open device");
    if rt.cc < (8, 9) {
        eprintln!("SKIP bench: sm_{}{} has no FP8 tensor cores", rt.cc.0, rt.cc.1);
        return;
    }
    let k = Kernels::load(&rt, KernelDims::QWEN35_27B).expect("load kernels");
    if let Err(e) = run(&rt, &k) {
        panic!("bench failed: {e}");
    }
}

fn run(rt: &Runtime, k: &Kernels) -> R<()> {
    let s = rt.stream().clone();
    let mut d = Dev::new(rt, 40 << 30)?;
    let copy = copy_bandwidth(rt)?;
    println!("BENCH fp8 copy bandwidth {copy:.0} GB/s");
    let ws_bytes = gemm::recommended_workspace_bytes(rt);
    let g = gemm::Gemm::new(rt, DevSpan { ptr: d.alloc(ws_bytes)?, bytes: ws_bytes })?;
    let tmax = 4096;
    let kmax = SHAPES.iter().map(|s| s.2).max().unwrap_or(0);
    let x = d.alloc(2 * tmax * kmax)?;
    init_random(k, &s, x, tmax * kmax, 8, Init::Normal(1.0), false)?;
    let y = d.alloc(2 * tmax * 17408)?;
    let scratch = d.alloc(fp8::act_scratch_bytes(tmax, kmax))?;
    println!("BENCH fp8 decode: ms per call, GB/s of the weights read, share of the copy bandwidth");
    for &(name, out, inp) in SHAPES {
        // Copies of the weights over ~1 GiB (past L2) per format.
        let fb = Fp8Bytes::new(out, inp);
        let n = (1usize << 30).div_ceil(out * inp).max(2);
        let f8: Vec<Fp8Weights> = (0..n)
            .map(|i| {
                let w = Fp8Weights::at(d.alloc(fb.aligned())?, out, inp);
                init_random(k, &s, w.codes, fb.codes, 9 + i as u64, Init::Fp8Codes(32.0), false)?;
                init_random(k, &s, w.scales, fb.scales / 4, 10, Init::Scale(1e-3), true)?;
                Ok(w)
            })
            .collect::<R<_>>()?;
        let bf: Vec<u64> = (0..n)
            .map(|i| {
                let w = d.alloc(2 * out * inp)?;
                init_random(k, &s, w, out * inp, 11 + i as u64, Init::Normal(0.02), false)?;
                Ok(w)
            })
            .collect::<R<_>>()?;
        for t in [1usize, 8, 16] {
            let ms8 =
                time_ms(rt, 50, |i| fp8::gemv_fp8(k, &s, x, t, inp, &[Fp8Out { w: &f8[i % n], y, ldy: out }], false))?;
            let gb8 = (fb.codes + fb.scales) as f64 / (ms8 * 1e-3) / 1e9;
            let ms16 = if t <= gemv::MAX_TOKENS {
                time_ms(rt, 50, |i| gemv::gemv(k, &s, x, t, inp, &[GemvOut { w: bf[i % n], y, m: out }], false))?
            } else {
                time_ms(rt, 50, |i| g.linear(&s, x, bf[i % n], y, t, out, inp))?
            };
            let gb16 = (2 * out * inp) as f64 / (ms16 * 1e-3) / 1e9;
            println!(
                "BENCH fp8 decode {name} [{out}, {inp}] t={t}: fp8 {ms8:.4} ms {gb8:.0} GB/s ({:.1}%), bf16 {ms16:.4} ms \
                 ({:.1}%), {:.2}x",
                100.0 * gb8 / copy,
                100.0 * gb16 / copy,
                ms16 / ms8
            );
        }
    }
    println!("BENCH fp8 prefill: activation quantisation + block-scaled FP8 GEMM against the bf16 GEMM");
    for &(name, out, inp) in SHAPES {
        let fb = Fp8Bytes::new(out, inp);
        let w = Fp8Weights::at(d.alloc(fb.aligned())?, out, inp);
        init_random(k, &s, w.codes, fb.codes, 12, Init::Fp8Codes(32.0), false)?;
        init_random(k, &s, w.scales, fb.scales / 4, 13, Init::Scale(1e-3), true)?;
        let wb = d.alloc(2 * out * inp)?;
        init_random(k, &s, wb, out * inp, 14, Init::Normal(0.02), false)?;
        for t in [32usize, 64, 512, 4096] {
            let xs = scratch + fp8::act_scales_offset(t, inp) as u64;
            if !g.fp8_supported(out, t, inp, out, y) {
                println!("BENCH fp8 prefill {name} t={t}: cuBLASLt has no block-scaled FP8 GEMM here");
                continue;
            }
            let q = time_ms(rt, 20, |_| fp8::act_quant(k, &s, x, t, inp, scratch, xs))?;
            let mm = time_ms(rt, 20, |_| g.linear_fp8(&s, scratch, xs, w.codes, w.scales, y, t, out, inp, out))?;
            let bf = time_ms(rt, 20, |_| g.linear(&s, x, wb, y, t, out, inp))?;
            let flop = 2.0 * (t * out * inp) as f64;
            println!(
                "BENCH fp8 prefill {name} [{out}, {inp}] t={t}: quantise {q:.4} ms + FP8 GEMM {mm:.4} ms ({:.0} TFLOP/s) \
                 against bf16 {bf:.4} ms ({:.0} TFLOP/s): {:.2}x ({:.2}x without the quantisation)",
                flop / (mm * 1e-3) / 1e12,
                flop / (bf * 1e-3) / 1e12,
                bf / (q + mm),
                bf / mm
            );
        }
    }
    Ok(())
}
