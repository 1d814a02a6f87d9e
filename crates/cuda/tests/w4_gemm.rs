//! `w4_gemm` (int4 weights × bf16 x at any number of rows) against the host oracle: the weights
//! dequantised by [`W4Linear::dequantize_row`] times the bf16-rounded x, summed in f64.
//!
//! Each case draws a random linear in the device format (random quant words, scales of both signs in
//! fp16 or bf16 bits, random zero points when asymmetric, a random act-order permutation when `perm`),
//! poisons y with NaN (0xFF bytes) including one row past `m` and the columns past `out` (ldy > out),
//! launches, and checks every element of the checked rows (all rows, or at the 27B shapes the first and
//! last 160 and every 29th) against |ref − y| ≤ 4e-3·rms(ref) + 1.6e-2·|ref| (the ops tests' ACCUM
//! tolerance), and that the poison past `out` and past `m` is untouched. The default configuration of
//! each case runs, and on the small shapes every token tile × a range of K splits; a split launch is
//! run twice and must repeat bit for bit. One line per launch. Without a CUDA driver: SKIP.
//! `DS_TEST_SEED=<u64>` changes the draws (printed).

use deltaserve_cuda::arena::{Arena, DevSpan, RegionId};
use deltaserve_cuda::ops::w4_gemm::{self, W4GemmConfig};
use deltaserve_cuda::ops::w4a16::{W4Out, W4Weights};
use deltaserve_cuda::w4::{ScaleDtype, W4_GROUP, W4Linear};
use deltaserve_cuda::{CudaError, KernelDims, Kernels, LibStatus, Runtime};
use half::{bf16, f16};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

type R<T> = Result<T, CudaError>;

/// One case: `m` rows of x through an `[out, inp]` linear of the given format; `f32_out`: f32 y.
#[derive(Clone, Copy, Debug)]
struct Case {
    m: usize,
    out: usize,
    inp: usize,
    asym: bool,
    bf16_scales: bool,
    perm: bool,
    f32_out: bool,
}

/// Rows checked against the oracle at or above this many outputs: a sample.
const SAMPLE_FROM: usize = 4096;

fn cases() -> Vec<Case> {
    let mut v = Vec::new();
    // Format variant i of 8: asym, bf16 scales, perm from its bits.
    let case = |m, out, inp, i: usize, f32_out| Case {
        m,
        out,
        inp,
        asym: i & 1 != 0,
        bf16_scales: i & 2 != 0,
        perm: i & 4 != 0,
        f32_out,
    };
    let all_m = [1, 3, 4, 8, 9, 16, 17, 33, 64, 100, 256];
    // Small shapes: every M, the eight formats in turn, some with f32 outputs; odd sizes (a partial
    // pair and a partial block of rows) from the tiny model's kind of shapes.
    for (n, &m) in all_m.iter().enumerate() {
        v.push(case(m, 256, 256, n % 8, n % 3 == 2));
        v.push(case(m, 384, 640, (n + 3) % 8, n % 4 == 1));
        v.push(case(m, 44, 384, (n + 5) % 8, false));
        v.push(case(m, 132, 128, (n + 6) % 8, n % 2 == 0));
    }
    // The 27B shapes: a covering subset (every format at least once, both token tiles, split and not).
    for (i, &(m, out, inp)) in [
        (1, 5120, 5120),
        (9, 5120, 5120),
        (16, 5120, 5120),
        (17, 5120, 5120),
        (64, 5120, 5120),
        (100, 5120, 5120),
        (256, 5120, 5120),
        (8, 17408, 5120),
        (33, 17408, 5120),
        (256, 17408, 5120),
        (4, 5120, 17408),
        (16, 5120, 17408),
        (100, 5120, 17408),
        (256, 5120, 17408),
    ]
    .iter()
    .enumerate()
    {
        v.push(case(m, out, inp, (i * 3) % 8, i == 5));
    }
    v
}

/// The GPU and the kernels at the 27B dims (None without a CUDA driver).
fn device() -> Option<(Runtime, Kernels)> {
    if !LibStatus::probe().driver {
        return None;
    }
    let rt = Runtime::open(0).expect("open device 0");
    let k = Kernels::load(&rt, KernelDims::QWEN35_27B).expect("load kernels");
    Some((rt, k))
}

#[test]
fn w4_gemm_matches_the_host_oracle() {
    let Some((rt, k)) = device() else {
        println!("SKIP: no CUDA driver");
        return;
    };
    let sms = rt.sm_count as usize;
    let seed: u64 = std::env::var("DS_TEST_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(0x5eed_0004);
    println!("w4_gemm on {} ({} SMs), seed {seed}", rt.name, sms);
    let mut failures = Vec::new();
    let t0 = std::time::Instant::now();
    for (i, c) in cases().into_iter().enumerate() {
        let mut rng = StdRng::seed_from_u64(seed.wrapping_add(i as u64));
        let lines = run_case(&rt, &k, sms, c, &mut rng).unwrap_or_else(|e| vec![(false, format!("error: {e}"))]);
        for (ok, line) in lines {
            println!(
                "{:<4} m={:<3} [{:>5}, {:>5}] {} {line}",
                if ok { "ok" } else { "FAIL" },
                c.m,
                c.out,
                c.inp,
                fmt(c)
            );
            if !ok {
                failures.push(format!("{c:?}: {line}"));
            }
        }
    }
    println!("{:.1} s", t0.elapsed().as_secs_f64());
    assert!(failures.is_empty(), "{} failing launches:\n{}", failures.len(), failures.join("\n"));
}

fn fmt(c: Case) -> String {
    format!(
        "{} {} {}{}",
        if c.asym { "asym" } else { "sym " },
        if c.bf16_scales { "bf16-s" } else { "f16-s " },
        if c.perm { "perm" } else { "    " },
        if c.f32_out { " f32-y" } else { "" }
    )
}

/// A random linear in the device format: random quant words (any 32 bits are 8 valid quants), scales
/// of magnitude 2e-3..2e-2 with a quarter negative, zero points 0..15 (asym), a shuffled `perm`.
fn random_linear(rng: &mut StdRng, c: Case) -> W4Linear {
    let groups = c.inp / W4_GROUP;
    let scale_bits = |v: f32| if c.bf16_scales { bf16::from_f32(v).to_bits() } else { f16::from_f32(v).to_bits() };
    let mut scales = Vec::with_capacity(groups * c.out);
    for _ in 0..groups * c.out {
        let mag = rng.random_range(2e-3f32..2e-2);
        scales.push(scale_bits(if rng.random_range(0u8..4) == 0 { -mag } else { mag }));
    }
    let zeros = c.asym.then(|| (0..groups * c.out.div_ceil(2)).map(|_| rng.random::<u8>()).collect());
    let perm = c.perm.then(|| {
        let mut p: Vec<i32> = (0..c.inp as i32).collect();
        for i in (1..p.len()).rev() {
            let j = rng.random_range(0..=i);
            p.swap(i, j);
        }
        p
    });
    W4Linear {
        out_features: c.out,
        in_features: c.inp,
        qweight: (0..c.out * c.inp / 8).map(|_| rng.random::<u32>()).collect(),
        scales,
        scale_dtype: if c.bf16_scales { ScaleDtype::Bf16 } else { ScaleDtype::F16 },
        zeros,
        perm,
    }
}

/// The rows the oracle checks: all, or for large `out` the first and last 160 and every 29th.
fn checked_rows(out: usize) -> Vec<usize> {
    if out < SAMPLE_FROM {
        return (0..out).collect();
    }
    (0..out).filter(|&o| o < 160 || o >= out - 160 || o % 29 == 0).collect()
}

/// `reference[m][i]` = y[m, rows[i]] from the dequantised rows and x (bf16 values), f64 sums, on every
/// core.
fn oracle(l: &W4Linear, rows: &[usize], x: &[f32], m: usize) -> Vec<Vec<f32>> {
    let inp = l.in_features;
    let threads = std::thread::available_parallelism().map_or(4, |n| n.get()).min(32);
    let per = rows.len().div_ceil(threads).max(1);
    let cols: Vec<Vec<Vec<f32>>> = std::thread::scope(|s| {
        let hs: Vec<_> = rows
            .chunks(per)
            .map(|chunk| {
                s.spawn(move || {
                    chunk
                        .iter()
                        .map(|&o| {
                            let w = l.dequantize_row(o);
                            (0..m)
                                .map(|t| {
                                    let xr = &x[t * inp..(t + 1) * inp];
                                    xr.iter().zip(&w).map(|(&a, &b)| a as f64 * b as f64).sum::<f64>() as f32
                                })
                                .collect()
                        })
                        .collect()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("oracle thread")).collect()
    });
    // cols: per chunk, per row, per token -> per token, per row.
    let by_row: Vec<&Vec<f32>> = cols.iter().flatten().collect();
    (0..m).map(|t| by_row.iter().map(|r| r[t]).collect()).collect()
}

struct Dev<'a> {
    rt: &'a Runtime,
    arena: Arena,
    region: RegionId,
}

impl Dev<'_> {
    fn span(&mut self, bytes: usize) -> R<u64> {
        Ok(self.arena.alloc(self.region, bytes.max(16))?.ptr)
    }
    fn put<T: Copy>(&mut self, v: &[T]) -> R<u64> {
        let p = self.span(std::mem::size_of_val(v))?;
        self.rt.upload(p, v)?;
        Ok(p)
    }
}

fn run_case(rt: &Runtime, k: &Kernels, sms: usize, c: Case, rng: &mut StdRng) -> R<Vec<(bool, String)>> {
    let l = random_linear(rng, c);
    let (ldx, ldy) = (c.inp + 8, c.out + 4);
    // x: bf16 values (std ~1), rows of ldx with padding.
    let xs: Vec<f32> = (0..c.m * c.inp).map(|_| bf16::from_f32(rng.random_range(-2.0f32..2.0)).to_f32()).collect();
    let mut xpad = vec![bf16::ZERO; c.m * ldx];
    for t in 0..c.m {
        for j in 0..c.inp {
            xpad[t * ldx + j] = bf16::from_f32(xs[t * c.inp + j]);
        }
    }
    let rows = checked_rows(c.out);

    let auto = w4_gemm::w4_gemm_config(c.m, c.out, c.inp, sms, usize::MAX);
    let mut cfgs = vec![auto];
    if c.out < SAMPLE_FROM {
        let groups = c.inp / W4_GROUP;
        for tokens in [16, 24, 32, 48, 64] {
            for splits in [1, 2, 3, groups.min(w4_gemm::MAX_SPLITS)] {
                for wpt in [0, 1, 2, 4].into_iter().filter(|&w| w == 0 || tokens == 16) {
                    let cfg = W4GemmConfig { tokens, splits: splits.min(groups), wpt };
                    if !cfgs.contains(&cfg) {
                        cfgs.push(cfg);
                    }
                }
            }
        }
    }
    let reference = oracle(&l, &rows, &xs, c.m);
    let b = l.bytes();
    let ws_most = cfgs.iter().map(|&cfg| w4_gemm::w4_gemm_workspace_bytes(c.m, c.out, cfg)).max().unwrap_or(0);
    let y_bytes = 4 * (c.m + 1) * ldy;
    let total = b.total() + 2 * c.m * ldx + w4_gemm::w4_gemm_x_scratch_bytes(c.m, c.inp) + y_bytes + ws_most;
    let mut arena = Arena::new(rt.context().clone());
    let region = arena.add_region("w4_gemm test", total + 16 * 256)?;
    let mut d = Dev { rt, arena, region };
    let w = W4Weights {
        qweight: d.put(&l.qweight)?,
        scales: d.put(&l.scales)?,
        scale_dtype: l.scale_dtype,
        zeros: match &l.zeros {
            Some(z) => Some(d.put(z)?),
            None => None,
        },
        perm: match &l.perm {
            Some(p) => Some(d.put(p)?),
            None => None,
        },
        out: c.out,
        inp: c.inp,
    };
    let x = d.put(&xpad)?;
    let scratch = d.span(w4_gemm::w4_gemm_x_scratch_bytes(c.m, c.inp))?;
    let y = d.span(y_bytes)?;
    let ws = d.span(ws_most)?;
    let s = rt.stream().clone();

    let mut lines = Vec::new();
    for cfg in cfgs {
        let run = |d: &Dev| -> R<Vec<u32>> {
            d.rt.memset(y, 0xFF, y_bytes)?;
            let ws = DevSpan { ptr: ws, bytes: ws_most };
            let scratch = DevSpan { ptr: scratch, bytes: w4_gemm::w4_gemm_x_scratch_bytes(c.m, c.inp) };
            w4_gemm::w4_gemm(k, &s, &w, x, ldx, y, ldy, c.m, cfg, c.f32_out, Some(ws), Some(scratch))?;
            fetch(d.rt, y, (c.m + 1) * ldy, c.f32_out)
        };
        let got = run(&d)?;
        let tag = format!(
            "tokens={} splits={} wpt={}{}",
            cfg.tokens,
            cfg.splits,
            cfg.wpt,
            if cfg == auto { " (default)" } else { "" }
        );
        let mut line = compare(&got, &reference, &rows, c, ldy);
        if cfg.splits > 1 {
            // A workspace one float short of the launch is refused before anything runs.
            let need = w4_gemm::w4_gemm_workspace_bytes(c.m, c.out, cfg);
            let short = DevSpan { ptr: ws, bytes: need - 4 };
            let scratch = DevSpan { ptr: scratch, bytes: w4_gemm::w4_gemm_x_scratch_bytes(c.m, c.inp) };
            if w4_gemm::w4_gemm(k, &s, &w, x, ldx, y, ldy, c.m, cfg, c.f32_out, Some(short), Some(scratch)).is_ok() {
                line.0 = false;
                line.1.push_str("; a workspace too small was accepted");
            }
            let again = run(&d)?;
            if again != got {
                line.0 = false;
                line.1.push_str("; a second launch differs (split order not deterministic)");
            }
        }
        lines.push((line.0, format!("{tag}: {}", line.1)));
    }
    Ok(lines)
}

/// y as raw bits (bf16 widened to the f32 pattern's top half, or f32), `n` elements.
fn fetch(rt: &Runtime, y: u64, n: usize, f32_out: bool) -> R<Vec<u32>> {
    if f32_out {
        let mut h = vec![0u32; n];
        rt.download(&mut h, y)?;
        return Ok(h);
    }
    let mut h = vec![0u16; n];
    rt.download(&mut h, y)?;
    Ok(h.into_iter().map(|b| (b as u32) << 16).collect())
}

/// Checks the rows against the reference and the poison around y; (ok, detail).
fn compare(got: &[u32], reference: &[Vec<f32>], rows: &[usize], c: Case, ldy: usize) -> (bool, String) {
    let poison = |v: u32| if c.f32_out { v == u32::MAX } else { v == 0xFFFF_0000 };
    let mut touched = 0usize;
    for t in 0..=c.m {
        let first = if t == c.m { 0 } else { c.out };
        touched += (first..ldy).filter(|&o| !poison(got[t * ldy + o])).count();
    }
    let n = (c.m * rows.len()).max(1);
    let rms = (reference.iter().flatten().map(|&v| (v as f64).powi(2)).sum::<f64>() / n as f64).sqrt() as f32;
    let atol = 4e-3 * rms + 1e-6;
    let (mut worst, mut at, mut bad) = (0f32, (0, 0), 0usize);
    for (t, rr) in reference.iter().enumerate() {
        for (&o, &r) in rows.iter().zip(rr) {
            let v = f32::from_bits(got[t * ldy + o]);
            let share = if v.is_finite() { (v - r).abs() / (atol + 1.6e-2 * r.abs()) } else { f32::INFINITY };
            if share > 1.0 {
                bad += 1;
            }
            if share > worst || share.is_nan() {
                worst = share;
                at = (t, o);
            }
        }
    }
    let (t, o) = at;
    let ok = bad == 0 && touched == 0;
    let detail = format!(
        "{} rows checked, worst y[{t}, {o}] = {:.4e} vs {:.4e} ({:.0}% of tol, atol {atol:.2e}); {bad} over tol, {touched} poisoned outside y written",
        rows.len(),
        f32::from_bits(got[t * ldy + o]),
        reference[t][rows.iter().position(|&r| r == o).unwrap_or(0)],
        worst * 100.0
    );
    (ok, detail)
}

/// One `w4_gemm_multi` launch over three linears writing consecutive columns of one output (as a
/// layer's qkv / z / b projections do) equals three single launches with its warps per pair, bitwise.
#[test]
fn w4_gemm_multi_equals_single_launches() {
    let Some((rt, k)) = device() else {
        println!("SKIP: no CUDA driver");
        return;
    };
    let sms = rt.sm_count as usize;
    for (i, (asym, m)) in [(false, 9), (true, 12), (false, 16), (true, 16)].into_iter().enumerate() {
        let sx = SharedX::new(&rt, 0x5eed_0100 + i as u64, asym, i % 2 == 0, m, 1);
        let w4 = sx.outs(sx.y_multi);
        assert!(w4_gemm::multi_supported(&w4, sx.x, INP, m));
        let s = rt.stream().clone();
        w4_gemm::w4_gemm_multi(&k, &s, &w4, sx.x, INP, m, sms).expect("multi launch");
        let wpt = w4_gemm::multi_wpt(&w4, sms);
        let cfg = W4GemmConfig { tokens: 16, splits: 1, wpt };
        let (a, b) = sx.against_single(&k, &w4, cfg);
        assert_eq!(a, b, "asym {asym}, m {m}, {wpt} warps per pair: the multi launch differs");
        // Too many rows for one tile, and act-order weights, are refused.
        assert!(!w4_gemm::multi_supported(&w4, sx.x, INP, 17));
    }
}

#[test]
fn w4_gemm_segments_equal_single_launches() {
    let Some((rt, k)) = device() else {
        println!("SKIP: no CUDA driver");
        return;
    };
    for (i, (asym, m, tokens, splits)) in
        [(false, 17, 24, 1), (true, 33, 32, 3), (false, 64, 32, 2), (true, 24, 24, 4), (false, 48, 48, 2)]
            .into_iter()
            .enumerate()
    {
        let sx = SharedX::new(&rt, 0x5eed_0200 + i as u64, asym, i % 2 == 1, m, splits);
        let w4 = sx.outs(sx.y_multi);
        assert!(w4_gemm::segments_supported(&w4, sx.x, INP));
        let s = rt.stream().clone();
        let cfg = W4GemmConfig { tokens, splits, wpt: 0 };
        let ws = Some(DevSpan { ptr: sx.ws, bytes: sx.ws_bytes });
        w4_gemm::w4_gemm_segments(&k, &s, &w4, sx.x, INP, m, cfg, ws).expect("segments launch");
        let (a, b) = sx.against_single(&k, &w4, cfg);
        assert_eq!(a, b, "asym {asym}, m {m}, {cfg:?}: the launch over segments differs");
        // A workspace too small for the segments' partial sums together is refused.
        if splits > 1 {
            let short = Some(DevSpan { ptr: sx.ws, bytes: sx.ws_bytes - 4 });
            assert!(w4_gemm::w4_gemm_segments(&k, &s, &w4, sx.x, INP, m, cfg, short).is_err());
        }
    }
}

/// Input columns of the linears that share x.
const INP: usize = 512;
/// Their outputs (the last one a partial pair and a partial block of rows).
const SHARED_OUTS: [usize; 3] = [640, 384, 44];

/// Linears sharing x, written as consecutive columns of one output: their weights, x, two outputs (a launch
/// over all of them, one launch each) and a split-K workspace for `splits`.
struct SharedX<'a> {
    d: Dev<'a>,
    ws_w: Vec<W4Weights>,
    m: usize,
    x: u64,
    y_multi: u64,
    y_single: u64,
    ws: u64,
    ws_bytes: usize,
}

impl<'a> SharedX<'a> {
    fn new(rt: &'a Runtime, seed: u64, asym: bool, bf16_scales: bool, m: usize, splits: usize) -> SharedX<'a> {
        let mut rng = StdRng::seed_from_u64(seed);
        let cs: Vec<Case> = SHARED_OUTS
            .iter()
            .map(|&out| Case { m, out, inp: INP, asym, bf16_scales, perm: false, f32_out: false })
            .collect();
        let lin: Vec<W4Linear> = cs.iter().map(|&c| random_linear(&mut rng, c)).collect();
        let total: usize = SHARED_OUTS.iter().sum();
        let ws_bytes = 4 * splits * m * total;
        let bytes: usize = lin.iter().map(|l| l.bytes().total()).sum::<usize>() + 2 * m * INP + 4 * 2 * m * total;
        let mut arena = Arena::new(rt.context().clone());
        let region = arena.add_region("w4_gemm shared-x test", bytes + ws_bytes + 64 * 256).expect("region");
        let mut d = Dev { rt, arena, region };
        let ws_w: Vec<W4Weights> = lin
            .iter()
            .zip(&cs)
            .map(|(l, c)| W4Weights {
                qweight: d.put(&l.qweight).expect("put"),
                scales: d.put(&l.scales).expect("put"),
                scale_dtype: l.scale_dtype,
                zeros: l.zeros.as_ref().map(|z| d.put(z).expect("put")),
                perm: None,
                out: c.out,
                inp: c.inp,
            })
            .collect();
        let xv: Vec<bf16> = (0..m * INP).map(|_| bf16::from_f32(rng.random_range(-2.0f32..2.0))).collect();
        let x = d.put(&xv).expect("put x");
        let (y_multi, y_single) = (d.span(2 * m * total).expect("y"), d.span(2 * m * total).expect("y"));
        let ws = d.span(ws_bytes.max(16)).expect("workspace");
        SharedX { d, ws_w, m, x, y_multi, y_single, ws, ws_bytes }
    }

    /// The linears' outputs at `y` (consecutive columns, row stride the outputs together).
    fn outs(&self, y: u64) -> Vec<W4Out<'_>> {
        let total: usize = SHARED_OUTS.iter().sum();
        let mut col = 0;
        let mut w4 = Vec::new();
        for w in &self.ws_w {
            w4.push(W4Out { w, y: y + 2 * col as u64, ldy: total });
            col += w.out;
        }
        w4
    }

    /// One [`w4_gemm::w4_gemm`] launch per linear at `cfg` into y_single; both outputs as bits.
    fn against_single(&self, k: &Kernels, w4: &[W4Out<'_>], cfg: W4GemmConfig) -> (Vec<u32>, Vec<u32>) {
        let total: usize = SHARED_OUTS.iter().sum();
        let s = self.d.rt.stream().clone();
        let ws = (cfg.splits > 1).then_some(DevSpan { ptr: self.ws, bytes: self.ws_bytes });
        for o in w4 {
            let y = self.y_single + (o.y - self.y_multi);
            w4_gemm::w4_gemm(k, &s, o.w, self.x, INP, y, total, self.m, cfg, false, ws, None).expect("single launch");
        }
        let a = fetch(self.d.rt, self.y_multi, self.m * total, false).expect("fetch");
        let b = fetch(self.d.rt, self.y_single, self.m * total, false).expect("fetch");
        (a, b)
    }
}

/// `w4_gemm_norm` (the residual add + RMSNorm in place of the split-K reduce) equals `w4_gemm` into y
/// then `add_rms_norm_1p` of y into the residual, bit for bit (the residual and the norm's output), over
/// both kernel kinds, 2–16 splits (the partial sums loaded four splits at a time), the 27B's hidden
/// width and small ones; a launch that is not split, and outputs the fused norm does not take, are
/// refused before anything runs.
#[test]
fn w4_gemm_norm_equals_reduce_then_norm() {
    use deltaserve_cuda::ops::norm;
    let Some((rt, k)) = device() else {
        println!("SKIP: no CUDA driver");
        return;
    };
    let cfg = |tokens, splits, wpt| W4GemmConfig { tokens, splits, wpt };
    let cases = [
        (12, 5120, 17408, false, cfg(16, 2, 4)),
        (40, 5120, 6144, true, cfg(24, 8, 0)),
        (17, 256, 1024, true, cfg(24, 3, 0)),
        (9, 1024, 512, true, cfg(16, 2, 1)),
        (33, 512, 4096, false, cfg(32, 16, 0)),
        (64, 5120, 5120, false, cfg(32, 5, 0)),
        (64, 5120, 17408, true, cfg(64, 8, 0)),
        (100, 5120, 6144, false, cfg(64, 3, 0)),
    ];
    for (n, (m, out, inp, asym, cfg)) in cases.into_iter().enumerate() {
        let mut rng = StdRng::seed_from_u64(0x5eed_0200 + n as u64);
        let c = Case { m, out, inp, asym, bf16_scales: n % 2 == 0, perm: false, f32_out: false };
        let l = random_linear(&mut rng, c);
        let ws_bytes = w4_gemm::w4_gemm_workspace_bytes(m, out, cfg);
        let bytes = l.bytes().total() + 2 * m * inp + ws_bytes + 2 * out + 5 * 2 * m * out;
        let mut arena = Arena::new(rt.context().clone());
        let region = arena.add_region("w4_gemm_norm test", bytes + 64 * 256).expect("region");
        let mut d = Dev { rt: &rt, arena, region };
        let w = W4Weights {
            qweight: d.put(&l.qweight).expect("put"),
            scales: d.put(&l.scales).expect("put"),
            scale_dtype: l.scale_dtype,
            zeros: l.zeros.as_ref().map(|z| d.put(z).expect("put")),
            perm: None,
            out,
            inp,
        };
        let bf = |n: usize, lim: f32, rng: &mut StdRng| -> Vec<bf16> {
            (0..n).map(|_| bf16::from_f32(rng.random_range(-lim..lim))).collect()
        };
        let x = d.put(&bf(m * inp, 2.0, &mut rng)).expect("x");
        let res0 = bf(m * out, 4.0, &mut rng);
        let nw = d.put(&bf(out, 0.5, &mut rng)).expect("norm weight");
        let (res_a, res_b) = (d.put(&res0).expect("res"), d.put(&res0).expect("res"));
        let (y, out_a, out_b) =
            (d.span(2 * m * out).unwrap(), d.span(2 * m * out).unwrap(), d.span(2 * m * out).unwrap());
        let ws = DevSpan { ptr: d.span(ws_bytes).unwrap(), bytes: ws_bytes };
        let s = rt.stream().clone();
        w4_gemm::w4_gemm(&k, &s, &w, x, inp, y, out, m, cfg, false, Some(ws), None).expect("w4_gemm");
        norm::add_rms_norm_1p(&k, &s, y, Some(res_a), nw, Some(res_a), out_a, m, out, 1e-6).expect("norm");
        let an = w4_gemm::AddNorm { res: res_b, w: nw, out: out_b, eps: 1e-6 };
        assert!(w4_gemm::norm_supported(&w, cfg, &an));
        w4_gemm::w4_gemm_norm(&k, &s, &w, x, inp, m, cfg, ws, None, an).expect("w4_gemm_norm");
        let get = |p: u64| {
            let mut h = vec![0u16; m * out];
            rt.download(&mut h, p).expect("download");
            h
        };
        let (ra, rb, oa, ob) = (get(res_a), get(res_b), get(out_a), get(out_b));
        let moved = ra.iter().zip(&res0).filter(|(a, r)| **a != r.to_bits()).count();
        println!(
            "m={m} [{out}, {inp}] {cfg:?}: residual {moved} of {} updated; fused equal: residual {}, output {}",
            ra.len(),
            ra == rb,
            oa == ob
        );
        assert!(moved > ra.len() / 2, "the residual barely moved: the test is vacuous");
        assert_eq!(ra, rb, "m={m} [{out}, {inp}] {cfg:?}: the residual differs");
        assert_eq!(oa, ob, "m={m} [{out}, {inp}] {cfg:?}: the norm's output differs");
        // Refused: no split (nothing to reduce), and too many splits for the fused norm.
        for bad in [W4GemmConfig { splits: 1, ..cfg }, W4GemmConfig { splits: 17, ..cfg }] {
            assert!(!w4_gemm::norm_supported(&w, bad, &an));
            assert!(w4_gemm::w4_gemm_norm(&k, &s, &w, x, inp, m, bad, ws, None, an).is_err(), "{bad:?} accepted");
        }
    }
}
