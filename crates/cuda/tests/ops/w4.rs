//! The 4-bit weights (W4A16, the device format of deltaserve_cuda::w4 with its host oracle there):
//! GEMV at every warps-per-pair choice, several linears in one launch, the residual add + RMSNorm
//! folded between projections, dequantisation and quantisation.

use deltaserve_cpu as cpu;
use deltaserve_cuda::ops::{self, w4a16};
use deltaserve_cuda::w4::{ScaleDtype, W4Linear};
use half::bf16;
use rand::RngExt;
use rand::rngs::StdRng;

use crate::harness::{Dev, Outcome, R, compare, randv, rb, same_bits};
use crate::{ACCUM, Env, FOLD_X, Op, Tol};

/// A random int4 linear: random quants, scales of both signs (fp16 or bf16), random zero points
/// (asym), a random act-order permutation (perm).
fn w4_random(rng: &mut StdRng, out: usize, inp: usize, asym: bool, perm: bool, bf16_scales: bool) -> W4Linear {
    let groups = inp / 128;
    let q: Vec<u8> = (0..out * inp).map(|_| rng.random_range(0..16u8)).collect();
    let scales = (0..groups * out)
        .map(|_| {
            let v = rng.random_range(2e-3f32..2e-2) * if rng.random_range(0..4) == 0 { -1.0 } else { 1.0 };
            if bf16_scales { bf16::from_f32(v).to_bits() } else { half::f16::from_f32(v).to_bits() }
        })
        .collect();
    let zeros: Option<Vec<u8>> = asym.then(|| (0..groups * out).map(|_| rng.random_range(0..16u8)).collect());
    let perm = perm.then(|| {
        let mut p: Vec<i32> = (0..inp as i32).collect();
        for i in (1..inp).rev() {
            p.swap(i, rng.random_range(0..=i));
        }
        p
    });
    let dtype = if bf16_scales { ScaleDtype::Bf16 } else { ScaleDtype::F16 };
    W4Linear { perm, ..W4Linear::from_quants(out, inp, &q, zeros.as_deref(), scales, dtype) }
}

fn w4_upload(d: &mut Dev, l: &W4Linear) -> R<w4a16::W4Weights> {
    let qweight = d.alloc(4 * l.qweight.len())?;
    d.rt.upload(qweight, &l.qweight)?;
    let scales = d.alloc(2 * l.scales.len())?;
    d.rt.upload(scales, &l.scales)?;
    let zeros = match &l.zeros {
        Some(z) => {
            let p = d.alloc(z.len())?;
            d.rt.upload(p, z)?;
            Some(p)
        }
        None => None,
    };
    let perm = match &l.perm {
        Some(p) => Some(d.i32s(p)?),
        None => None,
    };
    Ok(w4a16::W4Weights {
        qweight,
        scales,
        scale_dtype: l.scale_dtype,
        zeros,
        perm,
        out: l.out_features,
        inp: l.in_features,
    })
}

/// GEMV vs the CPU matmul with the dequantised f32 weights, x with a padded row stride, for every
/// warps-per-pair choice and f32 outputs; then token 0 alone must give bitwise the same row as
/// in the m-token launch (default configuration).
pub fn gemv(e: Env, d: &mut Dev, rng: &mut StdRng, op: &Op) -> R<Vec<Outcome>> {
    let Env { k, s, .. } = e;
    let Op::W4Gemv { m, out, inp, asym, perm, bf16: bf16_scales } = *op else { unreachable!() };
    let l = w4_random(rng, out, inp, asym, perm, bf16_scales);
    let w = w4_upload(d, &l)?;
    let (ldx, ldy) = (inp + 8, out + 3);
    let x = randv(rng, m * ldx, 1.0);
    let xc: Vec<f32> = x.chunks(ldx).flat_map(|r| r[..inp].to_vec()).collect();
    let r = cpu::linear::linear(&xc, m, &l.dequantize(), out, inp);
    let xp = d.bf16(&x)?;
    let scratch = d.alloc(2 * 8 * inp)?;
    let auto = w4a16::gemv_config(out, inp, k.w4_slots);
    let mut v = Vec::new();
    let mut first = Vec::new();
    // Every warps-per-pair, and a thin last wave split off (2 warps per pair, 4 pairs a block, one
    // block fewer slots than blocks: the last block's pairs run with 8 warps per pair, from a row
    // offset, with the partial last pair when out % 32 != 0).
    let thin = w4a16::GemvConfig { wpt: 2, slots: out.div_ceil(32).div_ceil(4).saturating_sub(1) };
    let cfgs = [1usize, 2, 4, 8].map(|wpt| w4a16::GemvConfig { wpt, slots: 0 });
    for cfg in cfgs.into_iter().chain([thin, auto]) {
        let yp = d.poison(2 * m * ldy)?;
        w4a16::w4_gemv(k, s, &w, xp, ldx, yp, ldy, m, cfg, Some(scratch))?;
        let y = d.get_bf16(yp, m * ldy)?;
        let y: Vec<f32> = y.chunks(ldy).flat_map(|r| r[..out].to_vec()).collect();
        let segs = w4a16::launch_segments(&[out.div_ceil(32)], inp / 128, cfg);
        let split = segs.get(1).map_or(String::new(), |t| format!(" + last {} pairs at {}", t.pairs, t.wpt));
        let tag = format!("y wpt={}{split}{}", cfg.wpt, if cfg == auto { " (default)" } else { "" });
        v.push(compare(&tag, &r, &y, ACCUM));
        if cfg == auto {
            first = y[..out].to_vec();
        }
    }
    // f32 outputs (int4 lm_head logits).
    let yp = d.poison(4 * m * ldy)?;
    w4a16::w4_gemv_out(k, s, &w, xp, ldx, yp, ldy, m, auto, Some(scratch), true)?;
    let y = d.get_f32(yp, m * ldy)?;
    let y: Vec<f32> = y.chunks(ldy).flat_map(|r| r[..out].to_vec()).collect();
    v.push(compare(&format!("y f32 wpt={}", auto.wpt), &r, &y, ACCUM));
    let yp = d.poison(2 * ldy)?;
    w4a16::w4_gemv(k, s, &w, xp, ldx, yp, ldy, 1, auto, Some(scratch))?;
    let y1 = d.get_bf16(yp, out)?;
    let same = y1.iter().zip(&first).all(|(a, b)| a.to_bits() == b.to_bits());
    v.push(Outcome { ok: same, detail: format!("token 0 alone bitwise equal to the {m}-token launch: {same}") });
    Ok(v)
}

pub fn gemv_multi(e: Env, d: &mut Dev, rng: &mut StdRng, op: &Op) -> R<Vec<Outcome>> {
    let Env { k, s, .. } = e;
    let Op::W4GemvMulti { m, ref outs, inp, asym, bf16: bf16_scales } = *op else { unreachable!() };
    let ls: Vec<W4Linear> = outs.iter().map(|&o| w4_random(rng, o, inp, asym, false, bf16_scales)).collect();
    let ws = ls.iter().map(|l| w4_upload(d, l)).collect::<R<Vec<_>>>()?;
    let ldx = inp + 8;
    let x = randv(rng, m * ldx, 1.0);
    let xc: Vec<f32> = x.chunks(ldx).flat_map(|r| r[..inp].to_vec()).collect();
    let xp = d.bf16(&x)?;
    let cfg = w4a16::gemv_config(outs.iter().sum(), inp, k.w4_slots);
    let ys = outs.iter().map(|&o| d.poison(2 * m * (o + 1))).collect::<R<Vec<_>>>()?;
    let wo: Vec<w4a16::W4Out<'_>> = ws.iter().zip(&ys).map(|(w, &y)| w4a16::W4Out { w, y, ldy: w.out + 1 }).collect();
    w4a16::w4_gemv_multi(k, s, &wo, xp, ldx, m, cfg, false)?;
    // The linears part of which the shared launch ran in its thin-wave tail.
    let pairs: Vec<usize> = outs.iter().map(|o| o.div_ceil(32)).collect();
    let segs = w4a16::launch_segments(&pairs, inp / 128, cfg);
    let mut v = Vec::new();
    for (i, (l, w)) in ls.iter().zip(&ws).enumerate() {
        let ldy = w.out + 1;
        let r = cpu::linear::linear(&xc, m, &l.dequantize(), w.out, inp);
        let y = d.get_bf16(ys[i], m * ldy)?;
        let y: Vec<f32> = y.chunks(ldy).flat_map(|r| r[..w.out].to_vec()).collect();
        v.push(compare(&format!("y{i} [{}, {inp}] wpt={}", w.out, cfg.wpt), &r, &y, ACCUM));
        let yp = d.poison(2 * m * ldy)?;
        w4a16::w4_gemv(k, s, w, xp, ldx, yp, ldy, m, cfg, None)?;
        let alone = d.get_bf16(yp, m * ldy)?;
        let alone: Vec<f32> = alone.chunks(ldy).flat_map(|r| r[..w.out].to_vec()).collect();
        // Bitwise equal unless the shared launch ran part of this linear in its thin-wave tail.
        if segs.iter().any(|s| s.linear == i && s.wpt != cfg.wpt) {
            v.push(compare(&format!("y{i} (thin-wave tail) vs its own launch"), &alone, &y, ACCUM));
        } else {
            let same = alone.iter().zip(&y).all(|(a, b)| a.to_bits() == b.to_bits());
            v.push(Outcome { ok: same, detail: format!("y{i} bitwise equal to its own launch: {same}") });
        }
    }
    Ok(v)
}

/// The folded pair of projections (producer into the residual stream, consumers after the norm) vs the
/// same kernels unfolded with add_rms_norm_1p between them: the residual bitwise (the producer's
/// configuration is the same), the norm's input bitwise vs bf16(h · (1 + w)) on the host, the sums of
/// squares vs the host's. The consumers' outputs of both paths against the host's f64 product with the
/// exact normed x: each within FOLD_X (both round x to bf16, at different points), and the folded
/// error's RMS within 1.2× the unfolded one's (the fold is as accurate as the norm kernel).
pub fn fold(e: Env, d: &mut Dev, rng: &mut StdRng, op: &Op) -> R<Vec<Outcome>> {
    let Env { k, s, .. } = e;
    let Op::W4Fold { m, hidden, pin, ref outs, asym, bf16: bf16_scales, thin } = *op else { unreachable!() };
    const EPS: f32 = 1e-6;
    let pl = w4_random(rng, hidden, pin, asym, false, bf16_scales);
    let pw = w4_upload(d, &pl)?;
    let ls: Vec<W4Linear> = outs.iter().map(|&o| w4_random(rng, o, hidden, asym, false, bf16_scales)).collect();
    let ws = ls.iter().map(|l| w4_upload(d, l)).collect::<R<Vec<_>>>()?;
    let xp_host = randv(rng, m * pin, 1.0);
    let res = randv(rng, m * hidden, 2.0);
    let nw = randv(rng, hidden, 0.5);
    let (xp, nwp) = (d.bf16(&xp_host)?, d.bf16(&nw)?);
    let pcfg = if thin {
        w4a16::GemvConfig { wpt: 2, slots: hidden.div_ceil(32).div_ceil(4).saturating_sub(1) }
    } else {
        w4a16::gemv_config(hidden, pin, k.w4_slots)
    };
    let ccfg = w4a16::gemv_config(outs.iter().sum(), hidden, k.w4_slots);
    let ys = |d: &mut Dev| outs.iter().map(|&o| d.poison(2 * m * o)).collect::<R<Vec<_>>>();
    let wo = |ys: &[u64]| -> Vec<w4a16::W4Out<'_>> {
        ws.iter().zip(ys).map(|(w, &y)| w4a16::W4Out { w, y, ldy: w.out }).collect()
    };
    // Unfolded: producer -> add_rms_norm_1p -> consumers.
    let (mixer, res_u, normed) = (d.poison(2 * m * hidden)?, d.bf16(&res)?, d.poison(2 * m * hidden)?);
    w4a16::w4_gemv(k, s, &pw, xp, pin, mixer, hidden, m, pcfg, None)?;
    ops::norm::add_rms_norm_1p(k, s, mixer, Some(res_u), nwp, Some(res_u), normed, m, hidden, EPS)?;
    let yu = ys(d)?;
    w4a16::w4_gemv_multi(k, s, &wo(&yu), normed, hidden, m, ccfg, false)?;
    // Folded.
    let (res_f, fx) = (d.bf16(&res)?, d.poison(2 * m * hidden)?);
    let sums = d.poison(w4a16::fold_sums_bytes(hidden))?;
    let prod = [w4a16::W4Out { w: &pw, y: res_f, ldy: hidden }];
    let fold = w4a16::Fold::Residual { x_out: fx, norm_w: nwp, sums };
    w4a16::w4_gemv_fold(k, s, &prod, xp, pin, m, pcfg, fold)?;
    let yf = ys(d)?;
    w4a16::w4_gemv_fold(k, s, &wo(&yf), fx, hidden, m, ccfg, w4a16::Fold::Norm { sums, eps: EPS })?;

    let mut v = Vec::new();
    let h = d.get_bf16(res_u, m * hidden)?;
    let hf = d.get_bf16(res_f, m * hidden)?;
    let same = h.iter().zip(&hf).all(|(a, b)| a.to_bits() == b.to_bits());
    v.push(Outcome { ok: same, detail: format!("residual bitwise equal to add_rms_norm_1p's: {same}") });
    let want_x: Vec<f32> = h.iter().enumerate().map(|(i, &x)| rb(x * (1.0 + nw[i % hidden]))).collect();
    let got_x = d.get_bf16(fx, m * hidden)?;
    let same = want_x.iter().zip(&got_x).all(|(a, b)| a.to_bits() == b.to_bits());
    v.push(Outcome { ok: same, detail: format!("norm input bitwise bf16(h (1 + w)): {same}") });
    let pairs = hidden.div_ceil(32);
    let sv = d.get_f32(sums, pairs * 8)?;
    let got_ss: Vec<f32> = (0..m).map(|t| (0..pairs).map(|p| sv[8 * p + t]).sum()).collect();
    let want_ss: Vec<f32> =
        h.chunks(hidden).map(|r| r.iter().map(|x| (*x as f64).powi(2)).sum::<f64>() as f32).collect();
    v.push(compare("sums of squares", &want_ss, &got_ss, Tol { atol_rms: 0.0, atol_abs: 0.0, rtol: 1e-5 }));
    // The exact normed x (f64) from the GPU's h.
    let xn: Vec<f64> = h
        .chunks(hidden)
        .flat_map(|r| {
            let ms = r.iter().map(|x| (*x as f64).powi(2)).sum::<f64>() / hidden as f64;
            let inv = 1.0 / (ms + EPS as f64).sqrt();
            r.iter().zip(&nw).map(move |(x, w)| *x as f64 * inv * (1.0 + *w as f64))
        })
        .collect();
    let (mut se_u, mut se_f) = (0f64, 0f64);
    for (i, (l, o)) in ls.iter().zip(outs).enumerate() {
        let wd = l.dequantize();
        let r: Vec<f32> = (0..m * o)
            .map(|k| {
                let (t, row) = (k / o, k % o);
                let xr = &xn[t * hidden..(t + 1) * hidden];
                wd[row * hidden..(row + 1) * hidden].iter().zip(xr).map(|(w, x)| *w as f64 * x).sum::<f64>() as f32
            })
            .collect();
        let (a, b) = (d.get_bf16(yu[i], m * o)?, d.get_bf16(yf[i], m * o)?);
        se_u += r.iter().zip(&a).map(|(r, y)| ((r - y) as f64).powi(2)).sum::<f64>();
        se_f += r.iter().zip(&b).map(|(r, y)| ((r - y) as f64).powi(2)).sum::<f64>();
        v.push(compare(&format!("y{i} [{o}, {hidden}] unfolded vs exact"), &r, &a, FOLD_X));
        v.push(compare(&format!("y{i} [{o}, {hidden}] folded vs exact"), &r, &b, FOLD_X));
    }
    let ok = se_f <= 1.44 * se_u;
    v.push(Outcome {
        ok,
        detail: format!("error RMS folded / unfolded = {:.3} (at most 1.2)", (se_f / se_u.max(1e-30)).sqrt()),
    });
    Ok(v)
}

pub fn dequant(e: Env, d: &mut Dev, rng: &mut StdRng, op: &Op) -> R<Vec<Outcome>> {
    let Env { k, s, .. } = e;
    let Op::W4Dequant { out, inp, r0, r1, asym, perm } = *op else { unreachable!() };
    let l = w4_random(rng, out, inp, asym, perm, false);
    let w = w4_upload(d, &l)?;
    let ldd = inp + 8;
    let dp = d.poison(2 * (r1 - r0) * ldd)?;
    w4a16::w4_dequant(k, s, &w, r0, r1, dp, ldd)?;
    let mut got = vec![0u16; (r1 - r0) * ldd];
    d.rt.download(&mut got, dp)?;
    let got: Vec<u16> = got.chunks(ldd).flat_map(|r| r[..inp].to_vec()).collect();
    Ok(vec![same_bits("bf16 rows", &l.dequantize_bf16(r0, r1), &got)])
}

/// Quantises in two row slices through a staging buffer, compares every output word with the host
/// quantiser, and checks the round trip within half a quantisation step.
pub fn quantize(e: Env, d: &mut Dev, rng: &mut StdRng, op: &Op) -> R<Vec<Outcome>> {
    let Env { k, s, .. } = e;
    let Op::W4Quantize { out, inp, asym } = *op else { unreachable!() };
    let mut wv = randv(rng, out * inp, 0.05);
    wv[5] = 1.5; // an outlier
    if out > 2 {
        wv[inp..inp + 128].iter_mut().for_each(|v| *v = 0.0); // an all-zero group
        wv[2 * inp..2 * inp + 128].iter_mut().for_each(|v| *v = rb(v.abs() + 0.01)); // all positive
    }
    let host = W4Linear::quantize(&wv, out, inp, asym)?;
    let groups = inp / 128;
    let dev = w4a16::W4Weights {
        qweight: d.poison(out * inp / 2)?,
        scales: d.poison(2 * groups * out)?,
        scale_dtype: ScaleDtype::F16,
        zeros: if asym { Some(d.poison(groups * out.div_ceil(2))?) } else { None },
        perm: None,
        out,
        inp,
    };
    let ldw = inp + 8;
    let staged: Vec<f32> = wv.chunks(inp).flat_map(|r| r.iter().copied().chain(std::iter::repeat_n(0.0, 8))).collect();
    let sp = d.bf16(&staged)?;
    let half = (out / 2) & !1;
    w4a16::w4_quantize(k, s, sp, ldw, 0, half, &dev)?;
    w4a16::w4_quantize(k, s, sp + (2 * half * ldw) as u64, ldw, half, out, &dev)?;
    let mut qw = vec![0u32; out * inp / 8];
    d.rt.download(&mut qw, dev.qweight)?;
    let mut sc = vec![0u16; groups * out];
    d.rt.download(&mut sc, dev.scales)?;
    let zeros = match dev.zeros {
        Some(p) => {
            let mut z = vec![0u8; groups * out.div_ceil(2)];
            d.rt.download(&mut z, p)?;
            Some(z)
        }
        None => None,
    };
    let qbad = qw.iter().zip(&host.qweight).filter(|(a, b)| a != b).count();
    let zbad = match (&zeros, &host.zeros) {
        (Some(a), Some(b)) => a.iter().zip(b).filter(|(x, y)| x != y).count(),
        _ => 0,
    };
    let mut v = vec![
        Outcome {
            ok: qbad == 0,
            detail: format!("qweight: {} words, {qbad} differ from the host quantiser", qw.len()),
        },
        same_bits("scales", &host.scales, &sc),
        Outcome { ok: zbad == 0, detail: format!("zeros: {zbad} bytes differ from the host quantiser") },
    ];
    let gpu = W4Linear { qweight: qw, scales: sc, zeros, ..host.clone() };
    let deq = gpu.dequantize();
    let mut worst = 0f32;
    for o in 0..out {
        for i in 0..inp {
            let step = gpu.scale(i / 128, o);
            let err = (deq[o * inp + i] - wv[o * inp + i]).abs();
            worst = worst.max(if step > 0.0 {
                err / (0.5 * step)
            } else if err > 0.0 {
                f32::INFINITY
            } else {
                0.0
            });
        }
    }
    // Symmetric: within half a step. Asymmetric: the rounded zero point shifts the grid, so the
    // clamped extremes may be off by up to one step.
    let bound = if asym { 2.002 } else { 1.001 };
    v.push(Outcome {
        ok: worst <= bound,
        detail: format!("round trip: worst |w - deq(q(w))| = {worst:.4} half-steps (bound {bound})"),
    });
    Ok(v)
}
