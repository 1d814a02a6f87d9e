//! Block-FP8 weights (e4m3 codes, one f32 scale per 128×128 block): the decode GEMV, the activations'
//! quantisation, cuBLASLt's block-scaled FP8 GEMM and our mma.sync one, dequantisation, and the quantiser,
//! against the CPU
//! (`deltaserve_model::quant`'s encoder and quantiser, the CPU linear on dequantised weights).

use deltaserve_cpu as cpu;
use deltaserve_cuda::gemm;
use deltaserve_cuda::ops::fp8::{self, Fp8Out, Fp8Weights};
use deltaserve_model::quant::{fp8_block_quantize, fp8_e4m3_from_f32, fp8_e4m3_to_f32};
use rand::RngExt;
use rand::rngs::StdRng;

use crate::harness::{Dev, Outcome, R, compare, randv, rb};
use crate::{ACCUM, Env, Op};

/// A block-FP8 linear: its codes, scales and dequantised f32 weights (`code · scale`).
struct Fp8Host {
    out: usize,
    inp: usize,
    codes: Vec<u8>,
    scales: Vec<f32>,
    w: Vec<f32>,
}

/// Random weights quantised as the checkpoints are: blocks of different magnitudes, an all-zero 128-row
/// block where there are several, and tiny values (subnormal codes).
fn fp8_random(rng: &mut StdRng, out: usize, inp: usize) -> Fp8Host {
    let kb = inp.div_ceil(128);
    let mag: Vec<f32> = (0..out.div_ceil(128) * kb).map(|_| rng.random_range(0.005f32..0.1)).collect();
    let mut w: Vec<f32> = (0..out * inp)
        .map(|i| {
            let (o, k) = (i / inp, i % inp);
            let a = mag[(o / 128) * kb + k / 128];
            if rng.random_range(0..50) == 0 { rng.random_range(-a..a) * 1e-4 } else { rng.random_range(-a..a) }
        })
        .collect();
    if out > 256 {
        w[128 * inp..256 * inp].fill(0.0);
    }
    let (codes, scales) = fp8_block_quantize(&w, out, inp, [128, 128]);
    let w = dequantize(&codes, &scales, out, inp);
    Fp8Host { out, inp, codes, scales, w }
}

fn dequantize(codes: &[u8], scales: &[f32], out: usize, inp: usize) -> Vec<f32> {
    let kb = inp.div_ceil(128);
    (0..out * inp).map(|i| fp8_e4m3_to_f32(codes[i]) * scales[(i / inp / 128) * kb + (i % inp) / 128]).collect()
}

fn upload(d: &mut Dev, l: &Fp8Host) -> R<Fp8Weights> {
    let scales = fp8::pad_scales(&l.scales, l.out, l.inp);
    let w = Fp8Weights { codes: d.alloc(l.codes.len())?, scales: d.f32s(&scales)?, out: l.out, inp: l.inp };
    d.rt.upload(w.codes, &l.codes)?;
    Ok(w)
}

/// The activations' quantisation the GEMM reads, on the CPU: per token and 128 features s = amax / 448
/// (1 for zeros), codes e4m3(x · (1 / s)); scales token-major `[k/128, t]`.
fn act_quant(x: &[f32], t: usize, k: usize) -> (Vec<u8>, Vec<f32>) {
    let kb = k / 128;
    let mut q = vec![0u8; t * k];
    let mut s = vec![0f32; kb * t];
    for tok in 0..t {
        for b in 0..kb {
            let row = &x[tok * k + b * 128..tok * k + b * 128 + 128];
            let amax = row.iter().fold(0f32, |m, v| m.max(v.abs()));
            let sc = if amax > 0.0 { amax / 448.0 } else { 1.0 };
            s[b * t + tok] = sc;
            let inv = 1.0 / sc;
            for (i, v) in row.iter().enumerate() {
                q[tok * k + b * 128 + i] = fp8_e4m3_from_f32(v * inv);
            }
        }
    }
    (q, s)
}

/// [`Op::Fp8Gemv`]: every linear of one launch against the CPU linear on the dequantised weights (its
/// output with a padded row stride), f32 outputs too; token 0 alone bit for bit as in the n-token launch.
pub fn gemv(e: Env, d: &mut Dev, rng: &mut StdRng, op: &Op) -> R<Vec<Outcome>> {
    let Env { k, s, .. } = e;
    let Op::Fp8Gemv { n, ref outs, k: kk, f32_out } = *op else { unreachable!() };
    let ls: Vec<Fp8Host> = outs.iter().map(|&o| fp8_random(rng, o, kk)).collect();
    let ws = ls.iter().map(|l| upload(d, l)).collect::<R<Vec<_>>>()?;
    let x = randv(rng, n * kk, 1.0);
    let xp = d.bf16(&x)?;
    let eb = if f32_out { 4 } else { 2 };
    let mut v = Vec::new();
    {
        let ys = ls.iter().map(|l| d.poison(eb * n * (l.out + 3))).collect::<R<Vec<_>>>()?;
        let launch: Vec<Fp8Out<'_>> = ws.iter().zip(&ys).map(|(w, &y)| Fp8Out { w, y, ldy: w.out + 3 }).collect();
        fp8::gemv_fp8(k, s, xp, n, kk, &launch, f32_out)?;
        let y1 = ls.iter().map(|l| d.poison(eb * l.out)).collect::<R<Vec<_>>>()?;
        let single: Vec<Fp8Out<'_>> = ws.iter().zip(&y1).map(|(w, &y)| Fp8Out { w, y, ldy: w.out }).collect();
        fp8::gemv_fp8(k, s, xp, 1, kk, &single, f32_out)?;
        let get = |p: u64, len: usize| if f32_out { d.get_f32(p, len) } else { d.get_bf16(p, len) };
        for (i, l) in ls.iter().enumerate() {
            let r = cpu::linear::linear(&x, n, &l.w, l.out, kk);
            let y = get(ys[i], n * (l.out + 3))?;
            let y: Vec<f32> = y.chunks(l.out + 3).flat_map(|row| row[..l.out].to_vec()).collect();
            v.push(compare(&format!("y{i} [{n}, {}]", l.out), &r, &y, ACCUM));
            let one = get(y1[i], l.out)?;
            let same = one.iter().zip(&y[..l.out]).all(|(a, b)| a.to_bits() == b.to_bits());
            let detail = format!("y{i}: token 0 alone bitwise equal to the {n}-token launch: {same}");
            v.push(Outcome { ok: same, detail });
        }
    }
    Ok(v)
}

/// [`Op::Fp8Gemm`]: the activations' codes and scales bit for bit against the CPU's, then (where cuBLASLt
/// runs the block-scaled FP8 GEMM: Hopper) the GEMM against the CPU linear on the dequantised activations
/// and weights, into a column slice of a wider output; and the bf16 route (dequantised rows bit for bit,
/// then a bf16 GEMM) everywhere.
pub fn gemm(e: Env, d: &mut Dev, rng: &mut StdRng, op: &Op) -> R<Vec<Outcome>> {
    let Env { rt, k, s, .. } = e;
    let Op::Fp8Gemm { n, out, k: kk } = *op else { unreachable!() };
    let l = fp8_random(rng, out, kk);
    let w = upload(d, &l)?;
    // Rows of different magnitudes, one all zero.
    let mut x: Vec<f32> = (0..n).flat_map(|t| randv(rng, kk, 0.5 + 3.0 * (t % 5) as f32)).collect();
    x[..kk].fill(0.0);
    let xp = d.bf16(&x)?;
    let (q_ref, s_ref) = act_quant(&x, n, kk);
    let scratch = d.alloc(fp8::act_scratch_bytes(n, kk))?;
    let xs = scratch + fp8::act_scales_offset(n, kk) as u64;
    fp8::act_quant(k, s, xp, n, kk, scratch, xs)?;
    let mut q = vec![0u8; n * kk];
    rt.download(&mut q, scratch)?;
    let sc = d.get_f32(xs, n * kk / 128)?;
    let q_same = q == q_ref;
    let s_same = sc.iter().zip(&s_ref).all(|(a, b)| a.to_bits() == b.to_bits());
    let mut v = vec![
        Outcome { ok: q_same, detail: format!("activation codes [{n}, {kk}] bitwise: {q_same}") },
        Outcome { ok: s_same, detail: format!("activation scales [{}, {n}] bitwise: {s_same}", kk / 128) },
    ];
    let ws_bytes = gemm::recommended_workspace_bytes(rt);
    let g = gemm::Gemm::new(rt, deltaserve_cuda::DevSpan { ptr: d.alloc(ws_bytes)?, bytes: ws_bytes })?;
    let ldy = out + 8;
    let y = d.poison(2 * n * ldy)?;
    let col = y + 16;
    let xdq: Vec<f32> = (0..n * kk).map(|i| fp8_e4m3_to_f32(q_ref[i]) * s_ref[(i % kk / 128) * n + i / kk]).collect();
    if g.fp8_supported(out, n, kk, ldy, col) {
        g.linear_fp8(s, scratch, xs, w.codes, w.scales, col, n, out, kk, ldy)?;
        let got = d.get_bf16(y, n * ldy)?;
        let got: Vec<f32> = got.chunks(ldy).flat_map(|row| row[8..8 + out].to_vec()).collect();
        let r = cpu::linear::linear(&xdq, n, &l.w, out, kk);
        v.push(compare(&format!("cuBLASLt FP8 y [{n}, {out}] (columns 8.. of {ldy})"), &r, &got, ACCUM));
    } else {
        v.push(Outcome {
            ok: true,
            detail: format!("cuBLASLt block-scaled FP8: not on sm_{}{} (skipped)", rt.cc.0, rt.cc.1),
        });
    }
    // Our mma.sync FP8 GEMM (sm_89+) on the same codes and scales, into the same column slice.
    if fp8::gemm_mma_supported(&k.arch) {
        let y = d.poison(2 * n * ldy)?;
        fp8::gemm_mma(k, s, scratch, xs, n, &w, y + 16, ldy)?;
        let got = d.get_bf16(y, n * ldy)?;
        let pad_ok = got.chunks(ldy).all(|row| row[..8].iter().chain(&row[8 + out..]).all(|v| v.is_nan()));
        let got: Vec<f32> = got.chunks(ldy).flat_map(|row| row[8..8 + out].to_vec()).collect();
        let r = cpu::linear::linear(&xdq, n, &l.w, out, kk);
        v.push(compare(&format!("mma.sync FP8 y [{n}, {out}] (columns 8.. of {ldy})"), &r, &got, ACCUM));
        v.push(Outcome { ok: pad_ok, detail: format!("mma.sync FP8: nothing written outside the slice: {pad_ok}") });
    } else {
        v.push(Outcome { ok: true, detail: format!("mma.sync FP8: not on sm_{}{} (skipped)", rt.cc.0, rt.cc.1) });
    }
    // Dequantised rows (a slice from an offset) bit for bit, then the bf16 GEMM on them.
    let (r0, r1) = (out / 3, out);
    let slice = d.poison(2 * (r1 - r0) * kk)?;
    fp8::dequant(k, s, &w, r0, r1, slice)?;
    let got = d.get_bf16(slice, (r1 - r0) * kk)?;
    let want: Vec<f32> = l.w[r0 * kk..r1 * kk].iter().map(|&x| rb(x)).collect();
    let same = got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits());
    v.push(Outcome { ok: same, detail: format!("dequantised rows {r0}..{r1} bitwise: {same}") });
    let yb = d.poison(2 * n * (r1 - r0))?;
    g.linear(s, xp, slice, yb, n, r1 - r0, kk)?;
    let wb: Vec<f32> = want;
    let r = cpu::linear::linear(&x, n, &wb, r1 - r0, kk);
    v.push(compare("bf16 GEMM on the dequantised rows", &r, &d.get_bf16(yb, n * (r1 - r0))?, ACCUM));
    Ok(v)
}

/// [`Op::Fp8SwigluQuant`]: the fused pass against the SwiGLU kernel then the activations' quantisation, all
/// bit for bit: the first `tq` rows' codes and scales, the bf16 rows from `tq` (the GEMV's). The first row's
/// gates are zero (an all-zero block: scale 1).
pub fn swiglu_quant(e: Env, d: &mut Dev, rng: &mut StdRng, op: &Op) -> R<Vec<Outcome>> {
    let Env { k, s, .. } = e;
    let Op::Fp8SwigluQuant { t, i, tq } = *op else { unreachable!() };
    let mut gu: Vec<f32> = (0..t).flat_map(|r| randv(rng, 2 * i, 0.5 + 2.0 * (r % 3) as f32)).collect();
    gu[..i].fill(0.0);
    let gp = d.bf16(&gu)?;
    let (gate, up) = ((gp, 2 * i), (gp + 2 * i as u64, 2 * i));
    let h = d.poison(2 * t * i)?;
    deltaserve_cuda::ops::elementwise::swiglu(k, s, gate.0, gate.1, up.0, up.1, h, t, i)?;
    let (q_ref, xs_ref) = (d.poison(t * i)?, d.poison(4 * t * i / 128)?);
    fp8::act_quant(k, s, h, tq, i, q_ref, xs_ref)?;
    let (q, xs, out) = (d.poison(t * i)?, d.poison(4 * t * i / 128)?, d.poison(2 * t * i)?);
    fp8::swiglu_quant(k, s, gate, up, t, i, tq, (q, xs), out)?;
    fused_against_apart(d, "SwiGLU", (q, xs, out), (q_ref, xs_ref, h), t, tq, i)
}

/// The outputs of a pass that writes an activation quantised (`q`, `xs`, and bf16 `out` from token `tq`)
/// against the activation `h` written in bf16 then quantised (`q_ref`, `xs_ref`), bit for bit: the first `tq`
/// tokens' codes and scales, the bf16 rows of the tokens after (`t` tokens of `width` features).
fn fused_against_apart(
    d: &Dev,
    what: &str,
    (q, xs, out): (u64, u64, u64),
    (q_ref, xs_ref, h): (u64, u64, u64),
    t: usize,
    tq: usize,
    width: usize,
) -> R<Vec<Outcome>> {
    let m = tq * width;
    let cs = d.get_bytes(q, m)? == d.get_bytes(q_ref, m)?;
    let ss = d.get_bytes(xs, 4 * m / 128)? == d.get_bytes(xs_ref, 4 * m / 128)?;
    let (at, tail) = (2 * m as u64, 2 * (t - tq) * width);
    let hs = d.get_bytes(out + at, tail)? == d.get_bytes(h + at, tail)?;
    Ok(vec![
        Outcome { ok: cs, detail: format!("codes [{tq}, {width}] bitwise as the {what} then quantisation: {cs}") },
        Outcome { ok: ss, detail: format!("scales [{}, {tq}] bitwise: {ss}", width / 128) },
        Outcome { ok: hs, detail: format!("bf16 rows of tokens {tq}..{t} bitwise as the {what}'s: {hs}") },
    ])
}

/// [`Op::Fp8GatedNormQuant`]: the quantising gated norm against the gated norm then the activations'
/// quantisation, bit for bit (codes and scales of the first `tq` tokens, the bf16 rows after); a zero head
/// row (scale 1) in token 0.
pub fn gated_norm_quant(e: Env, d: &mut Dev, rng: &mut StdRng, op: &Op) -> R<Vec<Outcome>> {
    let Env { k, s, .. } = e;
    let Op::Fp8GatedNormQuant { t, hv, tq } = *op else { unreachable!() };
    let n = t * hv * 128;
    let mut o = randv(rng, n, 1.0);
    o[..128].fill(0.0);
    let z = randv(rng, n, 3.0);
    let w: Vec<f32> = (0..128).map(|_| rng.random_range(0.5..1.5)).collect();
    let (op_, zp, wp) = (d.bf16(&o)?, d.bf16(&z)?, d.f32s(&w)?);
    let h = d.poison(2 * n)?;
    deltaserve_cuda::ops::norm::gated_rms_norm(k, s, op_, zp, hv * 128, hv, wp, h, t, 128, 1e-6)?;
    let (q_ref, xs_ref) = (d.poison(n)?, d.poison(4 * t * hv)?);
    fp8::act_quant(k, s, h, tq, hv * 128, q_ref, xs_ref)?;
    let (q, xs, out) = (d.poison(n)?, d.poison(4 * t * hv)?, d.poison(2 * n)?);
    deltaserve_cuda::ops::norm::gated_rms_norm_fp8(k, s, (op_, zp, hv * 128, hv), wp, out, t, 1e-6, tq, (q, xs))?;
    fused_against_apart(d, "norm", (q, xs, out), (q_ref, xs_ref, h), t, tq, hv * 128)
}

/// [`Op::Fp8NormQuant`]: the quantising residual add + RMSNorm against the norm then the activations'
/// quantisation, bit for bit (codes and scales of the first `tq` rows, the bf16 rows after, the residual
/// stream written alike); a zero row (scale 1) first.
pub fn norm_quant(e: Env, d: &mut Dev, rng: &mut StdRng, op: &Op) -> R<Vec<Outcome>> {
    use deltaserve_cuda::ops::norm;
    let Env { k, s, .. } = e;
    let Op::Fp8NormQuant { t, d: dd, tq } = *op else { unreachable!() };
    let n = t * dd;
    let (mut x, mut res) = (randv(rng, n, 1.0), randv(rng, n, 4.0));
    x[..dd].fill(0.0);
    res[..dd].fill(0.0);
    let w: Vec<f32> = randv(rng, dd, 0.5);
    let (xp, wp) = (d.bf16(&x)?, d.bf16(&w)?);
    let (res_a, res_b) = (d.bf16(&res)?, d.bf16(&res)?);
    let h = d.poison(2 * n)?;
    norm::add_rms_norm_1p(k, s, xp, Some(res_a), wp, Some(res_a), h, t, dd, 1e-6)?;
    let (q_ref, xs_ref) = (d.poison(n)?, d.poison(4 * n / 128)?);
    fp8::act_quant(k, s, h, tq, dd, q_ref, xs_ref)?;
    let (q, xs, out) = (d.poison(n)?, d.poison(4 * n / 128)?, d.poison(2 * n)?);
    let supported = norm::add_rms_norm_1p_quant_supported(t, dd, &[xp, res_b, wp, res_b, out], (q, xs));
    norm::add_rms_norm_1p_quant(k, s, (xp, Some(res_b), wp, Some(res_b), out), (t, dd, 1e-6), tq, (q, xs))?;
    let mut v = fused_against_apart(d, "norm", (q, xs, out), (q_ref, xs_ref, h), t, tq, dd)?;
    let same_res = d.get_bytes(res_a, 2 * n)? == d.get_bytes(res_b, 2 * n)?;
    v.push(Outcome { ok: same_res, detail: format!("residual stream bitwise: {same_res}") });
    v.push(Outcome { ok: supported, detail: format!("taken by the many-rows kernel: {supported}") });
    Ok(v)
}

/// [`Op::Fp8Quantize`]: bf16 weights quantised on the GPU, codes and scales bit for bit against
/// `fp8_block_quantize`.
pub fn quantize(e: Env, d: &mut Dev, rng: &mut StdRng, op: &Op) -> R<Vec<Outcome>> {
    let Env { rt, k, s, .. } = e;
    let Op::Fp8Quantize { out, k: kk } = *op else { unreachable!() };
    let mut w = randv(rng, out * kk, 0.05);
    w[..kk.min(out * kk)].iter_mut().for_each(|v| *v = rb(*v * 1e-5));
    if out > 128 {
        w[..128 * kk].fill(0.0);
    }
    let (codes, scales) = fp8_block_quantize(&w, out, kk, [128, 128]);
    let wp = d.bf16(&w)?;
    let padded = fp8::pad_scales(&scales, out, kk);
    let dst = Fp8Weights { codes: d.poison(out * kk)?, scales: d.poison(4 * padded.len())?, out, inp: kk };
    fp8::quantize(k, s, wp, &dst)?;
    let mut got = vec![0u8; out * kk];
    rt.download(&mut got, dst.codes)?;
    let gs = d.get_f32(dst.scales, padded.len())?;
    let cs = got == codes;
    // The padding of each scale row is never written.
    let (kb, kbp) = (kk.div_ceil(128), padded.len() / out.div_ceil(128));
    let gs: Vec<f32> = gs.chunks(kbp).flat_map(|r| r[..kb].to_vec()).collect();
    let ss = gs.iter().zip(&scales).all(|(a, b)| a.to_bits() == b.to_bits());
    Ok(vec![
        Outcome { ok: cs, detail: format!("codes [{out}, {kk}] bitwise: {cs}") },
        Outcome { ok: ss, detail: format!("scales [{}] bitwise: {ss}", scales.len()) },
    ])
}
