//! W4A16 benchmarks at the Qwen3.6-27B shapes (run explicitly, needs a GPU):
//!
//!   cargo test --release -p deltaserve-cuda --test bench_w4 -- --ignored --nocapture
//!
//! - decode: `w4_gemv` at M = 1 (every warps-per-tile choice) and M = 8, GB/s over the bytes the
//!   kernel reads (packed weights + scales (+ zeros) + x), as a share of the device-to-device copy
//!   bandwidth measured in the same run (2 × bytes / time of a 1 GiB `cuMemcpyDtoD`). Several copies
//!   of each weight are cycled so that the footprint exceeds L2;
//! - prefill: 512 and 4096 tokens through `w4_dequant` of row slices (1K-8K rows) + a cuBLASLt GEMM per
//!   slice, TFLOP/s and its share of one bf16 cuBLASLt GEMM of the same shape;
//! - `w4_quantize` throughput (bf16 bytes read per second), the `--quantize int4` load path.
//!
//! `bench_w4_rows` (its own test: `... --test bench_w4 -- --ignored --nocapture bench_w4_rows`): the
//! projections of steps of 1 to 256 rows at the 27B shapes: `w4_gemm` (default configuration), the
//! pair GEMV (M <= 8) and the dequantise + cuBLASLt path (64 MiB row slices), ms and the weight bytes'
//! GB/s as a share of the copy bandwidth. `DS_BENCH_W4_ROWS_SWEEP=1` adds every kernel × K split
//! of `w4_gemm` per (shape, M), the table to tune `w4_gemm_config` from; `DS_BENCH_W4_ROWS_M="24,32"` and
//! `DS_BENCH_W4=<substring of the linear's name>` narrow it (for profilers).
//!
//! `DS_BENCH_W4=<substring>` runs only the decode shapes whose name contains it (for profilers);
//! `DS_BENCH_W4_SWEEP=1` runs only the shape sweep (the GEMV's fixed cost per launch:
//! bench/results/decode-gemv-pdl-h200-2026-11-30.md; its wave quantisation:
//! bench/results/int4-gemv-waves-h200-2026-11-30.md), over the shapes
//! `DS_BENCH_W4_SHAPES="out:in,..."` when set.

use std::sync::Arc;

use cudarc::driver::CudaStream;
use deltaserve_cuda::ops::init::{Init, init_random};
use deltaserve_cuda::ops::w4_gemm::{self, W4GemmConfig};
use deltaserve_cuda::ops::w4a16::{self, GemvConfig, W4Weights};
use deltaserve_cuda::w4::{ScaleDtype, W4Bytes};
use deltaserve_cuda::{CudaError, DevSpan, KernelDims, Kernels, LibStatus, Runtime, gemm};

mod bench_util;

use bench_util::{Dev, R, copy_bandwidth, time_ms};

/// A decode shape's buffers from `d`: random bf16 weights `[out, in]` to quantise (std 0.02), x
/// `[8, in]` (std 1) and y `[8, out]`.
fn decode_buffers(k: &Kernels, s: &Arc<CudaStream>, d: &mut Dev, out: usize, inp: usize) -> R<(u64, u64, u64)> {
    let stage = d.alloc(2 * out * inp)?;
    init_random(k, s, stage, out * inp, 7, Init::Normal(0.02), false)?;
    let x = d.alloc(2 * 8 * inp)?;
    init_random(k, s, x, 8 * inp, 8, Init::Normal(1.0), false)?;
    Ok((stage, x, d.alloc(2 * 8 * out)?))
}

/// A random bf16 [out, in] (std 0.02) quantised on the GPU; returns the device weights and the
/// quantise time.
fn make_w4(
    k: &Kernels,
    s: &Arc<CudaStream>,
    d: &mut Dev,
    stage: u64,
    out: usize,
    inp: usize,
    asym: bool,
) -> R<(W4Weights, f64)> {
    let b = W4Bytes::new(out, inp, asym, false);
    let w = W4Weights {
        qweight: d.alloc(b.qweight)?,
        scales: d.alloc(b.scales)?,
        scale_dtype: ScaleDtype::F16,
        zeros: if asym { Some(d.alloc(b.zeros)?) } else { None },
        perm: None,
        out,
        inp,
    };
    let ms = time_ms(d.rt, 3, |_| w4a16::w4_quantize(k, s, stage, inp, 0, out, &w))?;
    Ok((w, ms))
}

/// Copies of `w` (the first is `w` itself) so that cycling them reads at least `footprint` bytes.
fn copies(d: &mut Dev, w: &W4Weights, footprint: usize) -> R<Vec<W4Weights>> {
    let b = w.bytes();
    let n = footprint.div_ceil(b.total()).max(1);
    let s = d.rt.stream().cu_stream();
    let mut v = vec![*w];
    for _ in 1..n {
        let c = W4Weights {
            qweight: d.alloc(b.qweight)?,
            scales: d.alloc(b.scales)?,
            zeros: if w.zeros.is_some() { Some(d.alloc(b.zeros)?) } else { None },
            ..*w
        };
        let cp = |dst: u64, src: u64, n: usize| {
            // SAFETY: distinct arena spans of n bytes.
            unsafe { cudarc::driver::result::memcpy_dtod_async(dst, src, n, s) }
                .map_err(CudaError::driver("cuMemcpyDtoDAsync"))
        };
        cp(c.qweight, w.qweight, b.qweight)?;
        cp(c.scales, w.scales, b.scales)?;
        if let (Some(dz), Some(sz)) = (c.zeros, w.zeros) {
            cp(dz, sz, b.zeros)?;
        }
        v.push(c);
    }
    d.rt.synchronize()?;
    Ok(v)
}

/// Decode shapes: (name, out, in).
const DECODE: &[(&str, usize, usize)] = &[
    ("mlp gate+up", 34816, 5120),
    ("mlp down", 5120, 17408),
    ("gdn in_proj_qkv", 10240, 5120),
    ("gdn in_proj_z", 6144, 5120),
    ("gdn out_proj", 5120, 6144),
    ("attn q (+gate)", 12288, 5120),
    ("attn k or v", 1024, 5120),
    ("lm_head", 248320, 5120),
];

/// Linears of a layer that share x (one launch of w4_gemv_multi), in = 5120.
const MULTI: &[(&str, &[usize])] =
    &[("attn q+k+v", &[12288, 1024, 1024]), ("gdn qkv+z+ba", &[10240, 6144, 96]), ("mlp gate+up", &[17408, 17408])];

/// Prefill shapes (at each of TOKENS).
const PREFILL: &[(&str, usize, usize)] = &[
    ("mlp gate+up", 34816, 5120),
    ("mlp down", 5120, 17408),
    ("gdn in_proj_qkv", 10240, 5120),
    ("gdn out_proj", 5120, 6144),
];

/// Prefill step sizes: a short agent turn and a full step.
const TOKENS: &[usize] = &[512, 4096];
const SLICE: usize = 4096;
/// Slice sizes compared (rows of bf16 scratch; the plan reserves up to 64 MiB: 6,528 rows at in = 5120).
const SLICES: &[usize] = &[1024, 2048, 4096, 8192];

#[test]
#[ignore = "benchmark; needs a GPU"]
fn bench_w4_27b() {
    if !LibStatus::probe().driver {
        eprintln!("SKIP bench: no CUDA driver");
        return;
    }
    let rt = Runtime::open(0).expect("open device");
    let k = Kernels::load(&rt, KernelDims::QWEN35_27B).expect("load kernels");
    if let Err(e) = run(&rt, &k) {
        panic!("bench failed: {e}");
    }
}

fn run(rt: &Runtime, k: &Kernels) -> R<()> {
    let s = rt.stream().clone();
    let copy = copy_bandwidth(rt)?;
    if std::env::var("DS_BENCH_W4_SWEEP").is_ok() {
        return shape_sweep(rt, k, copy);
    }
    println!("device {} ({}), {} SMs, {} int4 GEMV blocks at once", rt.name, rt.arch(), rt.sm_count, k.w4_slots);
    println!("BENCH copy bandwidth (cuMemcpyDtoD 1 GiB, read + write): {copy:.0} GB/s");
    println!();
    println!("| linear | out x in | M | warps per pair | asym | us | GB/s read | % of copy |");
    println!("|---|---|---|---|---|---|---|---|");
    let mut quant_lines = Vec::new();
    let mut best_lines = Vec::new();
    // DS_BENCH_W4=<substring>: only the decode shapes whose name contains it (for profilers), nothing else.
    let only = std::env::var("DS_BENCH_W4").ok();
    for &(name, out, inp) in DECODE.iter().filter(|(n, ..)| only.as_ref().is_none_or(|o| n.contains(o.as_str()))) {
        // bf16 staging + two int4 variants, each with copies of up to 400 MB + one linear
        let mut d = Dev::new(rt, 4 * out * inp + (1 << 30))?;
        let (stage, x, y) = decode_buffers(k, &s, &mut d, out, inp)?;
        let auto = w4a16::gemv_config(out, inp, k.w4_slots);
        let mut best: Option<(f64, String)> = None;
        for asym in [false, true] {
            let (w, qms) = make_w4(k, &s, &mut d, stage, out, inp, asym)?;
            quant_lines.push(format!(
                "| {name} | {out} x {inp} | {asym} | {:.1} | {:.0} |",
                qms * 1e3,
                2.0 * (out * inp) as f64 / (qms * 1e-3) / 1e9
            ));
            let ws = copies(&mut d, &w, 400 << 20)?;
            let mut cfgs: Vec<(usize, GemvConfig)> = Vec::new();
            if asym {
                cfgs.push((1, auto));
            } else {
                cfgs.extend([1usize, 2, 4, 8].iter().map(|&wpt| (1, GemvConfig { wpt, slots: 0 })));
                cfgs.extend([(2, auto), (4, auto), (8, auto)]);
            }
            for (m, cfg) in cfgs {
                let iters = 50.max(ws.len());
                let ms =
                    time_ms(rt, iters, |i| w4a16::w4_gemv(k, &s, &ws[i % ws.len()], x, inp, y, out, m, cfg, None))?;
                let b = w.bytes();
                let read = (b.qweight + b.scales + b.zeros + 2 * m * inp) as f64;
                let gbs = read / (ms * 1e-3) / 1e9;
                let tag = format!("wpt={}{}", cfg.wpt, if cfg == auto { " (default)" } else { "" });
                println!(
                    "| {name} | {out} x {inp} | {m} | {tag} | {asym} | {:.1} | {gbs:.0} | {:.1}% |",
                    ms * 1e3,
                    100.0 * gbs / copy
                );
                if m == 1 && !asym && best.as_ref().is_none_or(|(b, _)| gbs > *b) {
                    best = Some((gbs, tag));
                }
            }
        }
        if let Some((gbs, tag)) = best {
            best_lines.push(format!("| {name} | {out} x {inp} | {tag} | {gbs:.0} | {:.1}% |", 100.0 * gbs / copy));
        }
        rt.synchronize()?;
    }
    read_probe(rt, k, copy, only.as_deref())?;
    if only.is_some() {
        return Ok(());
    }
    println!();
    println!("One launch for a layer's linears sharing x (w4_gemv_multi) vs one launch each (default configs):");
    println!("| linears | rows x in | M | separate us | one launch us | GB/s (one launch) | % of copy |");
    println!("|---|---|---|---|---|---|---|");
    for &(name, outs) in MULTI {
        let inp = 5120;
        let total: usize = outs.iter().sum();
        let mut d = Dev::new(rt, 3 * total * inp + (1 << 30))?;
        let stage = d.alloc(2 * outs.iter().max().copied().unwrap_or(0) * inp)?;
        let x = d.alloc(2 * 8 * inp)?;
        init_random(k, &s, x, 8 * inp, 8, Init::Normal(1.0), false)?;
        // Sets of the layer's linears (several, cycled, so the footprint exceeds L2).
        let mut sets: Vec<Vec<(W4Weights, u64)>> = Vec::new();
        let mut bytes = 0usize;
        while sets.len() < 2 || bytes < (400 << 20) {
            let mut set = Vec::new();
            for &out in outs {
                init_random(k, &s, stage, out * inp, 7 + sets.len() as u64, Init::Normal(0.02), false)?;
                let (w, _) = make_w4(k, &s, &mut d, stage, out, inp, false)?;
                bytes += w.bytes().total();
                set.push((w, d.alloc(2 * 8 * out)?));
            }
            sets.push(set);
        }
        for m in [1usize, 8] {
            let sep = time_ms(rt, 50.max(sets.len()), |i| {
                for (w, y) in &sets[i % sets.len()] {
                    let cfg = w4a16::gemv_config(w.out, inp, k.w4_slots);
                    w4a16::w4_gemv(k, &s, w, x, inp, *y, w.out, m, cfg, None)?;
                }
                Ok(())
            })?;
            let cfg = w4a16::gemv_config(total, inp, k.w4_slots);
            let one = time_ms(rt, 50.max(sets.len()), |i| {
                let set = &sets[i % sets.len()];
                let wo: Vec<w4a16::W4Out<'_>> =
                    set.iter().map(|(w, y)| w4a16::W4Out { w, y: *y, ldy: w.out }).collect();
                w4a16::w4_gemv_multi(k, &s, &wo, x, inp, m, cfg, false)
            })?;
            let read = (sets[0].iter().map(|(w, _)| w.bytes().total()).sum::<usize>() + 2 * m * inp) as f64;
            let gbs = read / (one * 1e-3) / 1e9;
            println!(
                "| {name} | {total} x {inp} | {m} | {:.1} | {:.1} | {gbs:.0} | {:.1}% |",
                sep * 1e3,
                one * 1e3,
                100.0 * gbs / copy
            );
        }
        rt.synchronize()?;
    }

    println!();
    println!("Best M = 1 configuration per shape (symmetric):");
    println!("| linear | out x in | warps per pair | GB/s read | % of copy |");
    println!("|---|---|---|---|---|");
    for l in best_lines {
        println!("{l}");
    }
    println!();
    println!("w4_quantize (bf16 read, one linear):");
    println!("| linear | out x in | asym | us | GB/s |");
    println!("|---|---|---|---|---|");
    for l in quant_lines {
        println!("{l}");
    }

    println!();
    println!("Prefill: bf16 cuBLASLt vs w4_dequant of row slices + cuBLASLt per slice");
    println!(
        "| linear | out x in | tokens | slice rows | bf16 ms | bf16 TFLOP/s | w4 ms | w4 TFLOP/s | w4 / bf16 | dequant ms (GB/s written) |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for (&tokens, &(name, out, inp)) in TOKENS.iter().flat_map(|t| PREFILL.iter().map(move |p| (t, p))) {
        let ws_bytes = gemm::recommended_workspace_bytes(rt);
        let scratch_rows = SLICES.iter().copied().max().unwrap_or(SLICE).min(out);
        let mut d = Dev::new(
            rt,
            2 * out * inp + 2 * tokens * (inp + out) + 2 * scratch_rows * (inp + tokens) + out * inp + (256 << 20),
        )?;
        let wsp = DevSpan { ptr: d.alloc(ws_bytes)?, bytes: ws_bytes };
        let g = gemm::Gemm::new(rt, wsp)?;
        let wb = d.alloc(2 * out * inp)?;
        init_random(k, &s, wb, out * inp, 9, Init::Normal(0.02), false)?;
        let x = d.alloc(2 * tokens * inp)?;
        init_random(k, &s, x, tokens * inp, 10, Init::Normal(1.0), false)?;
        let y = d.alloc(2 * tokens * out)?;
        let (w, _) = make_w4(k, &s, &mut d, wb, out, inp, false)?;
        let scratch = d.alloc(2 * scratch_rows * inp)?;
        let ytmp = d.alloc(2 * tokens * scratch_rows)?;
        g.prepare(out, tokens, inp)?;
        let bf = time_ms(rt, 10, |_| g.linear(&s, x, wb, y, tokens, out, inp))?;
        let flop = 2.0 * tokens as f64 * out as f64 * inp as f64;
        for &slice in SLICES {
            if slice > SLICE && slice >= 2 * out {
                continue;
            }
            let slices: Vec<(usize, usize)> = (0..out).step_by(slice).map(|r| (r, (r + slice).min(out))).collect();
            for &(r0, r1) in &slices {
                g.prepare(r1 - r0, tokens, inp)?;
            }
            let w4 = time_ms(rt, 10, |_| {
                for &(r0, r1) in &slices {
                    w4a16::w4_dequant(k, &s, &w, r0, r1, scratch, inp)?;
                    g.linear(&s, x, scratch, ytmp, tokens, r1 - r0, inp)?;
                }
                Ok(())
            })?;
            let dq = time_ms(rt, 10, |_| {
                for &(r0, r1) in &slices {
                    w4a16::w4_dequant(k, &s, &w, r0, r1, scratch, inp)?;
                }
                Ok(())
            })?;
            println!(
                "| {name} | {out} x {inp} | {tokens} | {slice} | {bf:.3} | {:.0} | {w4:.3} | {:.0} | {:.1}% | {dq:.3} ({:.0}) |",
                flop / (bf * 1e-3) / 1e12,
                flop / (w4 * 1e-3) / 1e12,
                100.0 * bf / w4,
                2.0 * (out * inp) as f64 / (dq * 1e-3) / 1e9
            );
        }
    }
    Ok(())
}

/// The pair kernel's weight streaming alone (w4_read_probe: same grid and register stages, no math), in the
/// device layout (tile-major: contiguous 2 KB units) and row-major as the format was before (64 bytes
/// from each of 32 rows per unit): how much of the GEMV's gap to the copy rate is streaming and
/// access pattern rather than the math.
fn read_probe(rt: &Runtime, k: &Kernels, copy: f64, only: Option<&str>) -> R<()> {
    let s = rt.stream().clone();
    println!();
    println!("Weight streaming alone (w4_read_probe, M = 1 grid of the pair kernel, no math):");
    println!("| linear | out x in | wpt | layout | us | GB/s | % of copy |");
    println!("|---|---|---|---|---|---|---|");
    for &(name, out, inp) in DECODE.iter().filter(|(n, ..)| only.is_none_or(|o| n.contains(o))) {
        let mut d = Dev::new(rt, 2 * out * inp + (1 << 30))?;
        let stage = d.alloc(2 * out * inp)?;
        init_random(k, &s, stage, out * inp, 7, Init::Normal(0.02), false)?;
        let (w, _) = make_w4(k, &s, &mut d, stage, out, inp, false)?;
        let ws = copies(&mut d, &w, 400 << 20)?;
        let sink = d.alloc(16)?;
        let auto = w4a16::gemv_config(out, inp, k.w4_slots);
        for wpt in [auto.wpt, 8] {
            for tiled in [false, true] {
                let ms = time_ms(rt, 50.max(ws.len()), |i| {
                    w4a16::w4_read_probe(k, &s, &ws[i % ws.len()], wpt, tiled, sink)
                })?;
                let gbs = (out * inp / 2) as f64 / (ms * 1e-3) / 1e9;
                let layout = if tiled { "device (tile-major)" } else { "row-major (before)" };
                println!(
                    "| {name} | {out} x {inp} | {wpt} | {layout} | {:.1} | {gbs:.0} | {:.1}% |",
                    ms * 1e3,
                    100.0 * gbs / copy
                );
            }
        }
        rt.synchronize()?;
    }
    Ok(())
}

/// DS_BENCH_W4_SWEEP: the pair kernel at M = 1 over shapes that vary the waves of blocks and the
/// groups each warp streams (what separates the lm_head's ~90% of copy from the MLP's ~56%).
fn shape_sweep(rt: &Runtime, k: &Kernels, copy: f64) -> R<()> {
    let s = rt.stream().clone();
    println!("| out x in | wpt | blocks | waves (2/SM) | groups per warp | us | % of copy |");
    println!("|---|---|---|---|---|---|---|");
    // DS_BENCH_W4_SHAPES="out:in,out:in,...": these shapes instead of the default list (e.g. rows
    // either side of a wave boundary: bench/results/int4-gemv-waves-h200-2026-11-30.md).
    let shapes: Vec<(usize, usize)> = match std::env::var("DS_BENCH_W4_SHAPES") {
        Ok(v) => v
            .split(',')
            .filter_map(|p| p.split_once(':'))
            .filter_map(|(o, i)| Some((o.trim().parse().ok()?, i.trim().parse().ok()?)))
            .collect(),
        Err(_) => vec![
            (34816, 5120),
            (69632, 5120),
            (139264, 5120),
            (248320, 5120),
            (34816, 10240),
            (34816, 20480),
            (8704, 20480),
            (17408, 10240),
        ],
    };
    for (out, inp) in shapes {
        let mut d = Dev::new(rt, 2 * out * inp + (1 << 30))?;
        let (stage, x, y) = decode_buffers(k, &s, &mut d, out, inp)?;
        let (w, _) = make_w4(k, &s, &mut d, stage, out, inp, false)?;
        let ws = copies(&mut d, &w, 400 << 20)?;
        // Every warps-per-pair without the thin-wave split, then the default (with it, "+ split").
        let auto = w4a16::gemv_config(out, inp, k.w4_slots);
        let cfgs = [1usize, 2, 4, 8].map(|wpt| GemvConfig { wpt, slots: 0 });
        for cfg in cfgs.into_iter().chain([auto]) {
            let ms = time_ms(rt, 50.max(ws.len()), |i| {
                w4a16::w4_gemv(k, &s, &ws[i % ws.len()], x, inp, y, out, 1, cfg, None)
            })?;
            let b = w.bytes();
            let gbs = (b.qweight + b.scales + 2 * inp) as f64 / (ms * 1e-3) / 1e9;
            let segs = w4a16::launch_segments(&[out.div_ceil(32)], inp / 128, cfg);
            let blocks: usize = segs.iter().map(|p| p.pairs.div_ceil(8 / p.wpt)).sum();
            let tag = if segs.len() > 1 { format!("{} + split", cfg.wpt) } else { cfg.wpt.to_string() };
            println!(
                "| {out} x {inp} | {tag} | {blocks} | {:.2} | {} | {:.1} | {:.1}% |",
                blocks as f64 / (2 * rt.sm_count as usize) as f64,
                inp / 128 / cfg.wpt,
                ms * 1e3,
                100.0 * gbs / copy
            );
        }
        rt.synchronize()?;
    }
    Ok(())
}

/// The 27B's projections for steps of more than one row (name, out, in).
const ROWS_SHAPES: &[(&str, usize, usize)] = &[
    ("mlp gate or up", 17408, 5120),
    ("mlp down", 5120, 17408),
    ("gdn in_proj_qkv", 10240, 5120),
    ("attn q (+gate)", 12288, 5120),
    ("gdn out_proj", 5120, 6144),
];
const ROWS_M: &[usize] = &[1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 128, 256];
/// The bf16 slice the dequantise + cuBLASLt path runs through (the backend's 64 MiB).
const ROWS_SLICE_BYTES: usize = 64 << 20;

#[test]
#[ignore = "benchmark; needs a GPU"]
fn bench_w4_rows() {
    if !LibStatus::probe().driver {
        eprintln!("SKIP bench: no CUDA driver");
        return;
    }
    let rt = Runtime::open(0).expect("open device");
    let k = Kernels::load(&rt, KernelDims::QWEN35_27B).expect("load kernels");
    if let Err(e) = run_rows(&rt, &k) {
        panic!("bench failed: {e}");
    }
}

fn run_rows(rt: &Runtime, k: &Kernels) -> R<()> {
    let s = rt.stream().clone();
    let copy = copy_bandwidth(rt)?;
    let sms = rt.sm_count as usize;
    let sweep = std::env::var("DS_BENCH_W4_ROWS_SWEEP").is_ok();
    println!("device {} ({}), {sms} SMs; copy bandwidth {copy:.0} GB/s (read + write)", rt.name, rt.arch());
    println!();
    println!(
        "| linear | out x in | M | w4_gemm tokens/splits/wpt | w4_gemm us | GB/s | % of copy | tile kernels us | GEMV us | dequant+cuBLASLt us | dequant / w4_gemm |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    // DS_BENCH_W4_ROWS_M="24,32" and DS_BENCH_W4=<substring of the linear's name> narrow the table (profilers).
    let ms: Vec<usize> = match std::env::var("DS_BENCH_W4_ROWS_M") {
        Ok(v) => v.split(',').filter_map(|m| m.trim().parse().ok()).collect(),
        Err(_) => ROWS_M.to_vec(),
    };
    let only = std::env::var("DS_BENCH_W4").ok();
    let mmax = ROWS_M.iter().copied().max().unwrap_or(1);
    for &(name, out, inp) in ROWS_SHAPES.iter().filter(|s| only.as_deref().is_none_or(|o| s.0.contains(o))) {
        let slice = (ROWS_SLICE_BYTES / (2 * inp)).min(out) / 128 * 128;
        let ws_bytes = gemm::recommended_workspace_bytes(rt);
        let wsg = (1..=w4_gemm::MAX_SPLITS).map(|sp| sp * mmax * out * 4).max().unwrap_or(0);
        let mut d =
            Dev::new(rt, 4 * out * inp + ROWS_SLICE_BYTES + wsg + ws_bytes + 2 * mmax * (inp + 2 * out) + (1 << 30))?;
        let stage = d.alloc(2 * out * inp)?;
        init_random(k, &s, stage, out * inp, 7, Init::Normal(0.02), false)?;
        let x = d.alloc(2 * mmax * inp)?;
        init_random(k, &s, x, mmax * inp, 8, Init::Normal(1.0), false)?;
        let (y, ytmp, ws) = (d.alloc(2 * mmax * out)?, d.alloc(2 * mmax * slice)?, d.alloc(wsg)?);
        let scratch = d.alloc(ROWS_SLICE_BYTES)?;
        let g = gemm::Gemm::new(rt, DevSpan { ptr: d.alloc(ws_bytes)?, bytes: ws_bytes })?;
        let (w, _) = make_w4(k, &s, &mut d, stage, out, inp, false)?;
        let wcopies = copies(&mut d, &w, 400 << 20)?;
        let b = w.bytes();
        let wbytes = (b.qweight + b.scales) as f64;
        let n = 50.max(wcopies.len());
        for &m in &ms {
            let gemm_us = |cfg: W4GemmConfig| -> R<f64> {
                let t = time_ms(rt, n, |i| {
                    let wi = &wcopies[i % wcopies.len()];
                    w4_gemm::w4_gemm(
                        k,
                        &s,
                        wi,
                        x,
                        inp,
                        y,
                        out,
                        m,
                        cfg,
                        false,
                        Some(DevSpan { ptr: ws, bytes: wsg }),
                        None,
                    )
                })?;
                Ok(t * 1e3)
            };
            let auto = w4_gemm::w4_gemm_config(m, out, inp, sms, wsg);
            let us = gemm_us(auto)?;
            let tile_us = gemm_us(w4_gemm::w4_tile_config(m, out, inp, sms, wsg))?;
            let gemv = if m <= w4a16::GEMV_MAX_M {
                let cfg = w4a16::gemv_config(out, inp, k.w4_slots);
                let t = time_ms(rt, n, |i| {
                    w4a16::w4_gemv(k, &s, &wcopies[i % wcopies.len()], x, inp, y, out, m, cfg, None)
                })?;
                format!("{:.1}", t * 1e3)
            } else {
                "-".to_string()
            };
            let rows: Vec<(usize, usize)> = (0..out).step_by(slice).map(|r| (r, (r + slice).min(out))).collect();
            let dq = 1e3
                * time_ms(rt, 10, |_| {
                    for &(r0, r1) in &rows {
                        w4a16::w4_dequant(k, &s, &w, r0, r1, scratch, inp)?;
                        g.linear(&s, x, scratch, ytmp, m, r1 - r0, inp)?;
                    }
                    Ok(())
                })?;
            let gbs = wbytes / (us * 1e-6) / 1e9;
            println!(
                "| {name} | {out} x {inp} | {m} | {}/{}/{} | {us:.1} | {gbs:.0} | {:.1}% | {tile_us:.1} | {gemv} | {dq:.1} | {:.2}x |",
                auto.tokens,
                auto.splits,
                auto.wpt,
                100.0 * gbs / copy,
                dq / us
            );
            if sweep && m >= 9 {
                // The pair kernels (16 tokens, 1/2/4 warps per pair), then the tile kernels (wpt 0).
                let kinds = [(16, 1), (16, 2), (16, 4), (16, 0), (24, 0), (32, 0), (48, 0), (64, 0)];
                for splits in [1, 2, 3, 4, 5, 6, 8, 12].into_iter().filter(|&sp| sp <= inp / 512) {
                    let fits = |&(tk, wpt): &(usize, usize)| (wpt == 0 || m <= tk) && (m <= 64 || tk >= 48);
                    for (tokens, wpt) in kinds.into_iter().filter(fits) {
                        let cfg = W4GemmConfig { tokens, splits, wpt };
                        let t = gemm_us(cfg)?;
                        let gbs = wbytes / (t * 1e-6) / 1e9;
                        println!(
                            "|   sweep | {out} x {inp} | {m} | {tokens}/{splits}/{wpt} | {t:.1} | {gbs:.0} | {:.1}% | | | | |",
                            100.0 * gbs / copy
                        );
                    }
                }
            }
        }
        rt.synchronize()?;
    }
    Ok(())
}
