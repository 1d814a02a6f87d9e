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
//!
//! `bench_fp8_gemv_shapes` times the GEMV's other block shapes (`fp8::GEMV_SHAPES`) against the default one at
//! 1 and 8 tokens on the decode launches of the 27B, and checks each shape's outputs against the default's.

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
    on_fp8_gpu(run);
}

/// Runs `f` on device 0 with the 27B's kernels, or says why not (no driver, no FP8 tensor cores).
fn on_fp8_gpu(f: fn(&Runtime, &Kernels) -> R<()>) {
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
    if let Err(e) = f(&rt, &k) {
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

/// A 27B decode step's FP8 GEMV launches (name, linears' rows, in): those sharing x go in one launch.
const LAUNCHES: &[(&str, &[usize], usize)] = &[
    ("gdn qkv+z+ba", &[10240, 6144, 96], 5120),
    ("gdn out", &[5120], 6144),
    ("attn q+gate, k, v", &[12288, 1024, 1024], 5120),
    ("attn o", &[5120], 6144),
    ("mlp gate+up", &[17408, 17408], 5120),
    ("mlp down", &[5120], 17408),
];

#[test]
#[ignore = "benchmark; needs a GPU with FP8 tensor cores"]
fn bench_fp8_gemv_shapes() {
    on_fp8_gpu(run_shapes);
}

fn run_shapes(rt: &Runtime, k: &Kernels) -> R<()> {
    let s = rt.stream().clone();
    let mut d = Dev::new(rt, 40 << 30)?;
    let copy = copy_bandwidth(rt)?;
    println!("BENCH fp8 copy bandwidth {copy:.0} GB/s");
    let x = d.alloc(2 * 8 * 17408)?;
    init_random(k, &s, x, 8 * 17408, 8, Init::Normal(1.0), false)?;
    let default = ("gemv_fp8_n8", 16, 256);
    let mut total = vec![0.0f64; fp8::GEMV_SHAPES.len() + 1];
    for &(name, rows, inp) in LAUNCHES {
        let bytes: usize = rows.iter().map(|&o| Fp8Bytes::new(o, inp).codes + Fp8Bytes::new(o, inp).scales).sum();
        let set_bytes: usize = rows.iter().map(|&o| Fp8Bytes::new(o, inp).aligned()).sum();
        let n = (1usize << 30).div_ceil(set_bytes).max(2);
        let sets: Vec<Vec<Fp8Weights>> = (0..n)
            .map(|i| {
                rows.iter()
                    .enumerate()
                    .map(|(j, &o)| {
                        let fb = Fp8Bytes::new(o, inp);
                        let w = Fp8Weights::at(d.alloc(fb.aligned())?, o, inp);
                        init_random(k, &s, w.codes, fb.codes, 20 + (i * 4 + j) as u64, Init::Fp8Codes(32.0), false)?;
                        init_random(k, &s, w.scales, fb.scales / 4, 21, Init::Scale(1e-3), true)?;
                        Ok(w)
                    })
                    .collect::<R<Vec<_>>>()
            })
            .collect::<R<_>>()?;
        let ys: Vec<u64> = rows.iter().map(|&o| d.alloc(2 * 8 * o)).collect::<R<_>>()?;
        let outs = |i: usize| -> Vec<Fp8Out<'_>> {
            sets[i % n].iter().zip(&ys).map(|(w, &y)| Fp8Out { w, y, ldy: w.out }).collect()
        };
        for t in [1usize, 8] {
            let read = |rt: &Runtime| -> R<Vec<u16>> {
                let mut v = Vec::new();
                for (&y, &o) in ys.iter().zip(rows.iter()) {
                    let mut h = vec![0u16; t * o];
                    rt.download(&mut h, y)?;
                    v.extend(h);
                }
                Ok(v)
            };
            fp8::gemv_fp8_shape(k, &s, default, x, t, inp, &outs(0), false)?;
            let want = read(rt)?;
            let base = time_ms(rt, 50, |i| fp8::gemv_fp8_shape(k, &s, default, x, t, inp, &outs(i), false))?;
            if t == 1 {
                total[0] += base;
            }
            let pct = |ms: f64| 100.0 * bytes as f64 / (ms * 1e-3) / 1e9 / copy;
            println!("BENCH fp8 gemv {name} t={t} {:<20} {:.2} us ({:.1}%)", default.0, base * 1e3, pct(base));
            for (vi, &shape) in fp8::GEMV_SHAPES.iter().enumerate() {
                fp8::gemv_fp8_shape(k, &s, shape, x, t, inp, &outs(0), false)?;
                let got = read(rt)?;
                let bf = |b: u16| f32::from_bits(u32::from(b) << 16);
                let (mut diff, mut scale) = (0.0f32, 0.0f32);
                for (&g, &w) in got.iter().zip(&want) {
                    diff = diff.max((bf(g) - bf(w)).abs());
                    scale = scale.max(bf(w).abs());
                }
                let ms = time_ms(rt, 50, |i| fp8::gemv_fp8_shape(k, &s, shape, x, t, inp, &outs(i), false))?;
                if t == 1 {
                    total[vi + 1] += ms;
                }
                println!(
                    "BENCH fp8 gemv {name} t={t} {:<20} {:.2} us ({:.1}%) {:.3}x, max diff {:.2e} of {:.2e}{}",
                    shape.0,
                    ms * 1e3,
                    pct(ms),
                    base / ms,
                    diff,
                    scale,
                    if got == want { " (bitwise)" } else { "" }
                );
            }
        }
    }
    println!("BENCH fp8 gemv one layer of each kind at t=1: {} {:.2} us", default.0, total[0] * 1e3);
    for (vi, &shape) in fp8::GEMV_SHAPES.iter().enumerate() {
        println!(
            "BENCH fp8 gemv one layer of each kind at t=1: {} {:.2} us ({:.3}x)",
            shape.0,
            total[vi + 1] * 1e3,
            total[0] / total[vi + 1]
        );
    }
    Ok(())
}
