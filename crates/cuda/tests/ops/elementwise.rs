//! The row-wise and linear ops: embedding gather, the RMSNorms, the gates and SwiGLU, RoPE and the
//! fused q/k norm + RoPE (+ KV write), the causal conv (prefill, decode, speculative commit), the
//! speculative rows' shift and scatter, GEMM and GEMV.

use deltaserve_cpu as cpu;
use deltaserve_cuda::gemm;
use deltaserve_cuda::ops::{self, conv};
use rand::RngExt;
use rand::rngs::StdRng;

use crate::harness::{Dev, Outcome, R, compare, cu_of, randv, rb, same_bits};
use crate::{EXACT, Env, Op};

/// [`Op::Embed`]: rows of the table by id; id −1 gives a row of zeros.
pub fn embed(e: Env, d: &mut Dev, rng: &mut StdRng, op: &Op) -> R<Vec<Outcome>> {
    let Env { k, s, tol, .. } = e;
    let Op::Embed { t, d: dim, vocab } = *op else { unreachable!() };
    let table = randv(rng, vocab * dim, 1.0);
    // Every 3rd id is −1 (outside a tensor-parallel rank's vocabulary shard): a row of zeros.
    let ids: Vec<i32> = (0..t).map(|i| if i % 3 == 2 { -1 } else { rng.random_range(0..vocab as i32) }).collect();
    let (tp, ip, op) = (d.bf16(&table)?, d.i32s(&ids)?, d.poison(2 * t * dim)?);
    ops::embed::embed_gather(k, s, tp, ip, op, t, dim)?;
    let r: Vec<f32> = ids
        .iter()
        .flat_map(|&i| if i < 0 { vec![0.0; dim] } else { table[i as usize * dim..][..dim].to_vec() })
        .collect();
    Ok(vec![compare("out", &r, &d.get_bf16(op, t * dim)?, tol)])
}

/// [`Op::AddRmsNorm`]: the normed rows, and the residual stream bit for bit.
pub fn add_rms_norm(e: Env, d: &mut Dev, rng: &mut StdRng, op: &Op) -> R<Vec<Outcome>> {
    let Env { k, s, tol, .. } = e;
    let Op::AddRmsNorm { rows, d: dim, residual } = *op else { unreachable!() };
    let x = randv(rng, rows * dim, 2.0);
    let res = randv(rng, rows * dim, 2.0);
    let w = randv(rng, dim, 0.5);
    let (xp, rp, wp) = (d.bf16(&x)?, d.bf16(&res)?, d.bf16(&w)?);
    let (ro, op) = (d.poison(2 * rows * dim)?, d.poison(2 * rows * dim)?);
    let (resp, rop) = if residual { (Some(rp), Some(ro)) } else { (None, None) };
    ops::norm::add_rms_norm_1p(k, s, xp, resp, wp, rop, op, rows, dim, 1e-6)?;
    let h: Vec<f32> = if residual { x.iter().zip(&res).map(|(a, b)| rb(a + b)).collect() } else { x.clone() };
    let mut n = h.clone();
    cpu::norm::rms_norm_1p(&mut n, &w, 1e-6);
    let got = d.get_bf16(op, rows * dim)?;
    let mut v = vec![compare("normed", &n, &got, tol)];
    if residual {
        v.push(compare("residual", &h, &d.get_bf16(ro, rows * dim)?, EXACT));
    }
    // The first rows alone (a launch of few rows: the one-row-a-block kernel) give the same bits as in the
    // launch of every row (many rows: a quarter of the threads a row).
    let few = rows.min(3);
    let (ro1, op1) = (d.poison(2 * few * dim)?, d.poison(2 * few * dim)?);
    let rop1 = if residual { Some(ro1) } else { None };
    ops::norm::add_rms_norm_1p(k, s, xp, resp, wp, rop1, op1, few, dim, 1e-6)?;
    let alone = d.get_bf16(op1, few * dim)?;
    let same = alone.iter().zip(&got).all(|(a, b)| a.to_bits() == b.to_bits());
    v.push(Outcome { ok: same, detail: format!("rows 0..{few} alone the same bits as among {rows}: {same}") });
    Ok(v)
}

/// [`Op::AddRmsNormParts`]: x summed from the f32 partials in split order and rounded to bf16 (as the
/// int4 GEMM's reduce writes it), then as [`Op::AddRmsNorm`]: the normed rows, the residual bit for bit.
pub fn add_rms_norm_parts(e: Env, d: &mut Dev, rng: &mut StdRng, op: &Op) -> R<Vec<Outcome>> {
    let Env { k, s, tol, .. } = e;
    let Op::AddRmsNormParts { rows, d: dim, splits } = *op else { unreachable!() };
    let n = rows * dim;
    let parts: Vec<f32> = (0..splits * n).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    let res = randv(rng, n, 2.0);
    let w = randv(rng, dim, 0.5);
    let (pp, rp, wp, op) = (d.f32s(&parts)?, d.bf16(&res)?, d.bf16(&w)?, d.poison(2 * n)?);
    ops::norm::add_rms_norm_1p_parts(k, s, pp, splits, rp, wp, op, rows, dim, 1e-6)?;
    let x: Vec<f32> = (0..n).map(|i| rb((1..splits).fold(parts[i], |a, sp| a + parts[sp * n + i]))).collect();
    let h: Vec<f32> = x.iter().zip(&res).map(|(a, b)| rb(a + rb(*b))).collect();
    let mut normed = h.clone();
    cpu::norm::rms_norm_1p(&mut normed, &w, 1e-6);
    Ok(vec![compare("normed", &normed, &d.get_bf16(op, n)?, tol), compare("residual", &h, &d.get_bf16(rp, n)?, EXACT)])
}

/// [`Op::RmsNormStrided`]: RMSNorm of `hd`-wide heads read at a row stride.
pub fn rms_norm_strided(e: Env, d: &mut Dev, rng: &mut StdRng, op: &Op) -> R<Vec<Outcome>> {
    let Env { k, s, tol, .. } = e;
    let Op::RmsNormStrided { t, heads, hd, stride } = *op else { unreachable!() };
    let x = randv(rng, t * heads * stride, 3.0);
    let w = randv(rng, hd, 0.5);
    let (xp, wp, op) = (d.bf16(&x)?, d.bf16(&w)?, d.poison(2 * t * heads * hd)?);
    ops::norm::rms_norm_1p(k, s, xp, stride, wp, op, hd, t * heads, hd, 1e-6)?;
    let mut r: Vec<f32> = x.chunks(stride).flat_map(|c| c[..hd].to_vec()).collect();
    cpu::norm::rms_norm_1p(&mut r, &w, 1e-6);
    Ok(vec![compare("out", &r, &d.get_bf16(op, t * heads * hd)?, tol)])
}

/// [`Op::GatedRmsNorm`]: the DeltaNet output norm gated by SiLU(z).
pub fn gated_rms_norm(e: Env, d: &mut Dev, rng: &mut StdRng, op: &Op) -> R<Vec<Outcome>> {
    let Env { k, s, tol, .. } = e;
    let Op::GatedRmsNorm { t, hv, dv } = *op else { unreachable!() };
    let o = randv(rng, t * hv * dv, 1.0);
    let z = randv(rng, t * hv * dv, 3.0);
    let w: Vec<f32> = (0..dv).map(|_| rng.random_range(0.5..1.5)).collect();
    let (opp, zp, wp, outp) = (d.bf16(&o)?, d.bf16(&z)?, d.f32s(&w)?, d.poison(2 * t * hv * dv)?);
    ops::norm::gated_rms_norm(k, s, opp, zp, hv * dv, hv, wp, outp, t, dv, 1e-6)?;
    let mut r = o.clone();
    cpu::norm::gated_rms_norm(&mut r, &z, &w, 1e-6);
    let got = d.get_bf16(outp, t * hv * dv)?;
    let mut v = vec![compare("out", &r, &got, tol)];
    // The same rows with z's token stride padded by 4 elements take the scalar kernel: heads of 128 (which
    // the 16-byte kernel takes above) give the same bits.
    let zs = hv * dv + 4;
    let zpad: Vec<f32> = z.chunks(hv * dv).flat_map(|row| row.iter().copied().chain([0.0; 4])).collect();
    let (zpp, out2) = (d.bf16(&zpad)?, d.poison(2 * t * hv * dv)?);
    ops::norm::gated_rms_norm(k, s, opp, zpp, zs, hv, wp, out2, t, dv, 1e-6)?;
    let scalar = d.get_bf16(out2, t * hv * dv)?;
    let same = got.iter().zip(&scalar).all(|(a, b)| a.to_bits() == b.to_bits());
    v.push(Outcome { ok: same, detail: format!("the kernel of any row layout gives the same bits: {same}") });
    Ok(v)
}

/// [`Op::SigmoidGate`]: attention output times sigmoid of the gate half of q|gate, in place.
pub fn sigmoid_gate(e: Env, d: &mut Dev, rng: &mut StdRng, op: &Op) -> R<Vec<Outcome>> {
    let Env { k, s, tol, .. } = e;
    let Op::SigmoidGate { t, heads, hd } = *op else { unreachable!() };
    let x = randv(rng, t * heads * hd, 2.0);
    let qg = randv(rng, t * heads * 2 * hd, 4.0);
    let (xp, gp) = (d.bf16(&x)?, d.bf16(&qg)?);
    ops::elementwise::sigmoid_gate_mul(k, s, xp, gp + 2 * hd as u64, t, heads, hd, 2 * heads * hd, 2 * hd)?;
    let r: Vec<f32> = (0..x.len())
        .map(|i| {
            let (tt, h, dd) = (i / (heads * hd), (i / hd) % heads, i % hd);
            x[i] * cpu::activation::sigmoid(qg[tt * 2 * heads * hd + h * 2 * hd + hd + dd])
        })
        .collect();
    Ok(vec![compare("out", &r, &d.get_bf16(xp, x.len())?, tol)])
}

/// [`Op::Swiglu`]: SiLU(gate) · up from the fused gate|up rows.
pub fn swiglu(e: Env, d: &mut Dev, rng: &mut StdRng, op: &Op) -> R<Vec<Outcome>> {
    let Env { k, s, tol, .. } = e;
    let Op::Swiglu { t, i } = *op else { unreachable!() };
    let gu = randv(rng, t * 2 * i, 4.0);
    let (gp, op) = (d.bf16(&gu)?, d.poison(2 * t * i)?);
    ops::elementwise::swiglu(k, s, gp, 2 * i, gp + 2 * i as u64, 2 * i, op, t, i)?;
    let r: Vec<f32> = (0..t * i)
        .map(|e| {
            let (tt, c) = (e / i, e % i);
            cpu::activation::silu(gu[tt * 2 * i + c]) * gu[tt * 2 * i + i + c]
        })
        .collect();
    Ok(vec![compare("out", &r, &d.get_bf16(op, t * i)?, tol)])
}

/// [`Op::Rope`]: partial rotary embedding in place.
pub fn rope(e: Env, d: &mut Dev, rng: &mut StdRng, op: &Op) -> R<Vec<Outcome>> {
    let Env { k, s, tol, .. } = e;
    let Op::Rope { t, heads, hd, rot, pos0 } = *op else { unreachable!() };
    let x = randv(rng, t * heads * hd, 2.0);
    let pos: Vec<i32> = (0..t).map(|i| (pos0 + i) as i32).collect();
    let (xp, pp) = (d.bf16(&x)?, d.i32s(&pos)?);
    ops::rope::rope_partial(k, s, xp, heads * hd, pp, t, heads, hd, rot, 1e7)?;
    let mut r = x.clone();
    cpu::rope::apply_partial_rope(&mut r, heads, hd, rot, 1e7, pos0);
    Ok(vec![compare("out", &r, &d.get_bf16(xp, x.len())?, tol)])
}

/// [`Op::QkNormRope`]: the fused kernel bit for bit against rms_norm_1p + rope_partial.
pub fn qk_norm_rope(e: Env, d: &mut Dev, rng: &mut StdRng, op: &Op) -> R<Vec<Outcome>> {
    let Env { k, s, .. } = e;
    let Op::QkNormRope { t, nq, nkv, hd, rot, pos0 } = *op else { unreachable!() };
    // q in the q|gate layout [t, nq, 2*hd] (the gate halves must stay untouched), k [t, nkv, hd].
    let (q_tok, k_tok) = (2 * nq * hd, nkv * hd);
    let q = randv(rng, t * q_tok, 2.0);
    let kv = randv(rng, t * k_tok, 2.0);
    let (wq, wk) = (randv(rng, hd, 0.5), randv(rng, hd, 0.5));
    let pos: Vec<i32> = (0..t).map(|i| (pos0 + 3 * i) as i32).collect();
    let (wqp, wkp, pp) = (d.bf16(&wq)?, d.bf16(&wk)?, d.i32s(&pos)?);
    let (qa, ka, qb, kb) = (d.bf16(&q)?, d.bf16(&kv)?, d.bf16(&q)?, d.bf16(&kv)?);
    let (theta, eps) = (1e7, 1e-6);
    ops::norm::rms_norm_1p(k, s, qa, 2 * hd, wqp, qa, 2 * hd, t * nq, hd, eps)?;
    ops::norm::rms_norm_1p(k, s, ka, hd, wkp, ka, hd, t * nkv, hd, eps)?;
    ops::rope::rope_partial_strided(k, s, qa, q_tok, 2 * hd, pp, t, nq, hd, rot, theta)?;
    ops::rope::rope_partial(k, s, ka, k_tok, pp, t, nkv, hd, rot, theta)?;
    let a = ops::rope::QkNormRope {
        q: qb,
        q_tok,
        q_head: 2 * hd,
        q_heads: nq,
        q_norm: wqp,
        k: kb,
        k_tok,
        kv_heads: nkv,
        k_norm: wkp,
        positions: pp,
        rope_pos: 0,
        mrope_section: [0; 3],
        t,
        head_dim: hd,
        rotary_dim: rot,
        theta,
        eps,
    };
    ops::rope::qk_norm_rope(k, s, &a)?;
    let bits = |p: u64, n: usize| -> R<Vec<u16>> {
        let mut v = vec![0u16; n];
        d.rt.download(&mut v, p)?;
        Ok(v)
    };
    Ok(vec![
        same_bits("q|gate vs the separate kernels", &bits(qa, q.len())?, &bits(qb, q.len())?),
        same_bits("k vs the separate kernels", &bits(ka, kv.len())?, &bits(kb, kv.len())?),
    ])
}

/// [`Op::QkNormRopeKv`]: the fused kernel bit for bit against qk_norm_rope + kv_write_q.
pub fn qk_norm_rope_kv(e: Env, d: &mut Dev, rng: &mut StdRng, op: &Op) -> R<Vec<Outcome>> {
    let Env { k, s, .. } = e;
    let Op::QkNormRopeKv { fk, fv, ref seqs, nq, nkv, hd, page, pad } = *op else { unreachable!() };
    let (q_tok, kvd) = (2 * nq * hd, nkv * hd);
    // The rows: each sequence's new tokens at their positions, then the padding row.
    let mut pos: Vec<i32> = seqs.iter().flat_map(|&(c, n)| (c..c + n).map(|p| p as i32)).collect();
    let mut lens: Vec<usize> = seqs.iter().map(|s| s.1).collect();
    if pad {
        pos.push(-1);
        lens.push(1);
    }
    let t = pos.len();
    let cu = cu_of(&lens);
    // Block tables: the blocks of the new tokens get distinct pages in shuffled order (a few
    // pages, however far the positions), the others page 0 (never written).
    let max_blocks = seqs.iter().map(|&(c, n)| (c + n).div_ceil(page)).max().unwrap_or(1);
    let used: Vec<(usize, usize)> = seqs
        .iter()
        .enumerate()
        .flat_map(|(b, &(c, n))| (c / page..(c + n).div_ceil(page)).map(move |blk| (b, blk)))
        .collect();
    let num_blocks = used.len() + 3;
    let mut pages: Vec<i32> = (0..num_blocks as i32).collect();
    for i in (1..pages.len()).rev() {
        let j = rng.random_range(0..=i);
        pages.swap(i, j);
    }
    let mut bt = vec![0i32; lens.len() * max_blocks];
    for (&(b, blk), &pg) in used.iter().zip(&pages) {
        bt[b * max_blocks + blk] = pg;
    }
    let q = randv(rng, t * q_tok, 2.0);
    let kx = randv(rng, t * kvd, 2.0);
    let vx = randv(rng, t * kvd, 1.0);
    let (wq, wk) = (randv(rng, hd, 0.5), randv(rng, hd, 0.5));
    let (wqp, wkp, pp, cup, btp, vp) =
        (d.bf16(&wq)?, d.bf16(&wk)?, d.i32s(&pos)?, d.i32s(&cu)?, d.i32s(&bt)?, d.bf16(&vx)?);
    let rows = num_blocks * page * nkv;
    let (krb, vrb) = (ops::kv_quant::row_bytes(fk, hd), ops::kv_quant::row_bytes(fv, hd));
    let tensor = |data, scales, fmt| ops::kv_quant::KvTensor { data, scales, fmt };
    let mut run = |fused: bool| -> R<Vec<Vec<u16>>> {
        let (qp, kp) = (d.bf16(&q)?, d.bf16(&kx)?);
        let (kc, vc, ksc, vsc) =
            (d.poison(rows * krb)?, d.poison(rows * vrb)?, d.poison(2 * rows)?, d.poison(2 * rows)?);
        let layer = ops::kv_quant::LayerKv { k: tensor(kc, ksc, fk), v: tensor(vc, vsc, fv) };
        let a = ops::rope::QkNormRope {
            q: qp,
            q_tok,
            q_head: 2 * hd,
            q_heads: nq,
            q_norm: wqp,
            k: kp,
            k_tok: kvd,
            kv_heads: nkv,
            k_norm: wkp,
            positions: pp,
            rope_pos: 0,
            mrope_section: [0; 3],
            t,
            head_dim: hd,
            rotary_dim: hd / 4,
            theta: 1e7,
            eps: 1e-6,
        };
        let w = ops::kv_cache::KvWrite {
            k: kp,
            k_stride: kvd,
            v: vp,
            v_stride: kvd,
            k_cache: 0,
            v_cache: 0,
            block_tables: btp,
            max_blocks,
            cu_seqlens: cup,
            positions: pp,
            n_seqs: lens.len(),
            t,
            page,
            kv_heads: nkv,
            head_dim: hd,
        };
        if fused {
            ops::rope::qk_norm_rope_kv(k, s, &a, &w, &layer)?;
        } else {
            ops::rope::qk_norm_rope(k, s, &a)?;
            ops::kv_quant::kv_write_q(k, s, &w, &layer)?;
        }
        let words = |p: u64, bytes: usize| -> R<Vec<u16>> {
            let mut v = vec![0u16; bytes / 2];
            d.rt.download(&mut v, p)?;
            Ok(v)
        };
        Ok(vec![
            words(qp, 2 * q.len())?,
            words(kp, 2 * kx.len())?,
            words(kc, rows * krb)?,
            words(ksc, 2 * rows)?,
            words(vc, rows * vrb)?,
            words(vsc, 2 * rows)?,
        ])
    };
    let (want, got) = (run(false)?, run(true)?);
    let names = ["q|gate", "k", "K cache", "K scales", "V cache", "V scales"];
    let mut out: Vec<Outcome> = names
        .iter()
        .zip(want.iter().zip(&got))
        .map(|(n, (w, g))| same_bits(&format!("{n} vs the two kernels"), w, g))
        .collect();
    // The cache got the rows (not only poison in both).
    let written = want[2].iter().filter(|&&x| x != 0xFFFF).count();
    out.push(Outcome { ok: written > 0, detail: format!("K cache: {written} words written") });
    Ok(out)
}

/// [`Op::ConvPrefill`]: the causal conv + SiLU over ragged sequences from their carried
/// states (slots in reverse order), the outputs and the updated states; with saves, the states of
/// the snapshots inside the sequences (into snapshots in reverse order).
pub fn conv_prefill(e: Env, d: &mut Dev, rng: &mut StdRng, op: &Op) -> R<Vec<Outcome>> {
    let Env { k, s, tol, .. } = e;
    let Op::ConvPrefill { ref lens, c, ref saves } = *op else { unreachable!() };
    let kw = k.dims.conv_kernel;
    let t: usize = lens.iter().sum();
    let nb = lens.len();
    let x = randv(rng, t * c, 2.0);
    let w = randv(rng, c * kw, 0.6);
    let st0 = randv(rng, nb * (kw - 1) * c, 2.0);
    // Slots in reverse order, to catch slot/sequence mix-ups.
    let slots: Vec<i32> = (0..nb as i32).rev().collect();
    let cu = cu_of(lens);
    let mut st_dev = vec![0f32; st0.len()];
    for (b, &sl) in slots.iter().enumerate() {
        let n = (kw - 1) * c;
        st_dev[sl as usize * n..][..n].copy_from_slice(&st0[b * n..][..n]);
    }
    let (xp, wp, sp, cup, slp, yp) =
        (d.bf16(&x)?, d.bf16(&w)?, d.bf16(&st_dev)?, d.i32s(&cu)?, d.i32s(&slots)?, d.poison(2 * t * c)?);
    let a = conv::ConvPrefill {
        x: xp,
        x_stride: c,
        w: wp,
        y: yp,
        state: sp,
        cu_seqlens: cup,
        slots: slp,
        n_seqs: nb,
        t,
        channels: c,
    };
    let n = (kw - 1) * c;
    let table: Vec<i32> =
        saves.iter().enumerate().flat_map(|(i, &(b, r))| [b as i32, r as i32, (saves.len() - 1 - i) as i32]).collect();
    let (savp, dstp) = (d.i32s(&table)?, d.poison(2 * saves.len() * n)?);
    conv::conv_prefill_only(k, s, &a)?;
    // The same rows at a token stride of c + 1 (no 16-byte rows): the one-channel kernel, the same bits.
    let xpad: Vec<f32> = x.chunks(c).flat_map(|row| row.iter().copied().chain([0.0])).collect();
    let (xpp, y1) = (d.bf16(&xpad)?, d.poison(2 * t * c)?);
    conv::conv_prefill_only(k, s, &conv::ConvPrefill { x: xpp, x_stride: c + 1, y: y1, ..a })?;
    let (yv, y1v) = (d.get_bf16(yp, t * c)?, d.get_bf16(y1, t * c)?);
    let same = yv.iter().zip(&y1v).all(|(p, q)| p.to_bits() == q.to_bits());
    conv::conv_state_save(k, s, &a, savp, saves.len(), dstp)?;
    conv::conv_state_update(k, s, &a, nb, 0)?;
    let (mut ry, mut rs) = (Vec::new(), vec![0f32; st0.len()]);
    for (b, &len) in lens.iter().enumerate() {
        let mut st = st0[b * n..][..n].to_vec();
        let xs = &x[cu[b] as usize * c..][..len * c];
        ry.extend(cpu::conv::causal_conv1d_silu(xs, c, &w, kw, &mut st));
        rs[slots[b] as usize * n..][..n].copy_from_slice(&st);
    }
    // A snapshot after r rows: the state the conv of those rows alone leaves.
    let mut rsave = vec![0f32; saves.len() * n];
    for (i, &(b, r)) in saves.iter().enumerate() {
        let mut st = st0[b * n..][..n].to_vec();
        cpu::conv::causal_conv1d_silu(&x[cu[b] as usize * c..][..r * c], c, &w, kw, &mut st);
        rsave[(saves.len() - 1 - i) * n..][..n].copy_from_slice(&st);
    }
    let mut out = vec![
        compare("y", &ry, &yv, tol),
        Outcome { ok: same, detail: format!("y of either kernel (16-byte rows or not) the same bits: {same}") },
        compare("state", &rs, &d.get_bf16(sp, rs.len())?, EXACT),
    ];
    if !saves.is_empty() {
        out.push(compare("snapshots", &rsave, &d.get_bf16(dstp, rsave.len())?, EXACT));
    }
    Ok(out)
}

/// [`Op::ConvDecode`]: one token per sequence.
pub fn conv_decode(e: Env, d: &mut Dev, rng: &mut StdRng, op: &Op) -> R<Vec<Outcome>> {
    let Env { k, s, tol, .. } = e;
    let Op::ConvDecode { b, c } = *op else { unreachable!() };
    let kw = k.dims.conv_kernel;
    let x = randv(rng, b * c, 2.0);
    let w = randv(rng, c * kw, 0.6);
    let st0 = randv(rng, b * (kw - 1) * c, 2.0);
    let slots: Vec<i32> = (0..b as i32).rev().collect();
    let n = (kw - 1) * c;
    let mut st_dev = vec![0f32; st0.len()];
    for (bi, &sl) in slots.iter().enumerate() {
        st_dev[sl as usize * n..][..n].copy_from_slice(&st0[bi * n..][..n]);
    }
    let (xp, wp, sp, slp, yp) = (d.bf16(&x)?, d.bf16(&w)?, d.bf16(&st_dev)?, d.i32s(&slots)?, d.poison(2 * b * c)?);
    conv::conv_decode(k, s, xp, c, wp, yp, sp, slp, b, c)?;
    let (mut ry, mut rs) = (Vec::new(), vec![0f32; st0.len()]);
    for (bi, &sl) in slots.iter().enumerate() {
        let mut st = st0[bi * n..][..n].to_vec();
        ry.extend(cpu::conv::causal_conv1d_silu(&x[bi * c..][..c], c, &w, kw, &mut st));
        rs[sl as usize * n..][..n].copy_from_slice(&st);
    }
    Ok(vec![compare("y", &ry, &d.get_bf16(yp, b * c)?, tol), compare("state", &rs, &d.get_bf16(sp, rs.len())?, EXACT)])
}

/// [`Op::ConvAccept`]: the conv window shifted by each sequence's accepted rows.
pub fn conv_accept(e: Env, d: &mut Dev, rng: &mut StdRng, op: &Op) -> R<Vec<Outcome>> {
    let Env { k, s, tol, .. } = e;
    let Op::ConvAccept { ref lens, ref accept, c } = *op else { unreachable!() };
    let kw = k.dims.conv_kernel;
    let t: usize = lens.iter().sum();
    let nb = lens.len();
    let x = randv(rng, t * c, 2.0);
    let n = (kw - 1) * c;
    let st0 = randv(rng, (nb + 1) * n, 2.0);
    let slots: Vec<i32> = (1..=nb as i32).rev().collect();
    let cu = cu_of(lens);
    let acc: Vec<i32> = accept.iter().map(|&a| a as i32).collect();
    let (xp, sp, cup, slp, ap) = (d.bf16(&x)?, d.bf16(&st0)?, d.i32s(&cu)?, d.i32s(&slots)?, d.i32s(&acc)?);
    let a = conv::ConvPrefill {
        x: xp,
        x_stride: c,
        w: 0,
        y: 0,
        state: sp,
        cu_seqlens: cup,
        slots: slp,
        n_seqs: nb,
        t,
        channels: c,
    };
    conv::conv_state_update(k, s, &a, nb, ap)?;
    // The oracle: the last kw − 1 rows of (state ++ accepted rows).
    let mut rs: Vec<f32> = st0.iter().map(|&v| rb(v)).collect();
    for (b, &sl) in slots.iter().enumerate() {
        let old = &rs[sl as usize * n..][..n].to_vec();
        let mut rows: Vec<&[f32]> = old.chunks_exact(c).collect();
        rows.extend(x[cu[b] as usize * c..][..accept[b] * c].chunks_exact(c));
        let new: Vec<f32> = rows[rows.len() - (kw - 1)..].iter().flat_map(|r| r.iter().map(|&v| rb(v))).collect();
        rs[sl as usize * n..][..n].copy_from_slice(&new);
    }
    Ok(vec![compare("state", &rs, &d.get_bf16(sp, rs.len())?, tol)])
}

/// [`Op::MtpRows`]: shift_rows and scatter_rows.
pub fn mtp_rows(e: Env, d: &mut Dev, rng: &mut StdRng, op: &Op) -> R<Vec<Outcome>> {
    let Env { k, s, tol, .. } = e;
    let Op::MtpRows { ref lens, d: dim } = *op else { unreachable!() };
    let t: usize = lens.iter().sum();
    let nb = lens.len();
    let x = randv(rng, t * dim, 2.0);
    let pend = randv(rng, (nb + 2) * dim, 2.0);
    // The last sequence is decode-graph padding (slot −1: zero rows).
    let slots: Vec<i32> = (0..nb).map(|b| if b + 1 == nb { -1 } else { (nb - b) as i32 }).collect();
    let cu = cu_of(lens);
    let (xp, pp, cup, slp, yp) = (d.bf16(&x)?, d.bf16(&pend)?, d.i32s(&cu)?, d.i32s(&slots)?, d.poison(2 * t * dim)?);
    ops::mtp::shift_rows(k, s, xp, pp, cup, slp, nb, yp, t, dim)?;
    let mut ry = Vec::with_capacity(t * dim);
    for (b, &len) in lens.iter().enumerate() {
        for i in 0..len {
            let r = cu[b] as usize + i;
            let row: Vec<f32> = if slots[b] < 0 {
                vec![0.0; dim]
            } else if i == 0 {
                pend[slots[b] as usize * dim..][..dim].to_vec()
            } else {
                x[(r - 1) * dim..][..dim].to_vec()
            };
            ry.extend(row.iter().map(|&v| rb(v)));
        }
    }
    let shifted = compare("shift", &ry, &d.get_bf16(yp, t * dim)?, tol);
    // Scatter each sequence's last row to its slot (−1 rows skipped).
    let rows: Vec<i32> = (0..nb).map(|b| cu[b + 1] - 1).collect();
    ops::mtp::scatter_rows(k, s, xp, d.i32s(&rows)?, pp, slp, nb, dim)?;
    let mut rp: Vec<f32> = pend.iter().map(|&v| rb(v)).collect();
    for b in 0..nb {
        if slots[b] >= 0 {
            let src: Vec<f32> = x[rows[b] as usize * dim..][..dim].iter().map(|&v| rb(v)).collect();
            rp[slots[b] as usize * dim..][..dim].copy_from_slice(&src);
        }
    }
    Ok(vec![shifted, compare("scatter", &rp, &d.get_bf16(pp, rp.len())?, tol)])
}

/// [`Op::Gemm`]: cuBLASLt GEMM against the CPU linear; no heuristic call after prepare.
pub fn gemm(e: Env, d: &mut Dev, rng: &mut StdRng, op: &Op) -> R<Vec<Outcome>> {
    let Env { rt, s, tol, .. } = e;
    let Op::Gemm { m, n, k: kk } = *op else { unreachable!() };
    let x = randv(rng, n * kk, 1.0);
    let w = randv(rng, m * kk, 0.05);
    let ws_bytes = gemm::recommended_workspace_bytes(rt);
    let ws = deltaserve_cuda::DevSpan { ptr: d.alloc(ws_bytes)?, bytes: ws_bytes };
    let g = gemm::Gemm::new(rt, ws)?;
    let (xp, wp, yp) = (d.bf16(&x)?, d.bf16(&w)?, d.poison(2 * n * m)?);
    g.prepare(m, n, kk)?;
    let before = g.heuristic_calls();
    g.linear(s, xp, wp, yp, n, m, kk)?;
    let r = cpu::linear::linear(&x, n, &w, m, kk);
    let mut v = vec![compare("y", &r, &d.get_bf16(yp, n * m)?, tol)];
    if g.heuristic_calls() != before {
        v.push(Outcome::error("heuristic ran on the hot path".into()));
    }
    Ok(v)
}

/// [`Op::Gemv`]: the decode GEMV against the CPU linear, and token 0 alone bit for bit.
pub fn gemv(e: Env, d: &mut Dev, rng: &mut StdRng, op: &Op) -> R<Vec<Outcome>> {
    let Env { k, s, tol, .. } = e;
    let Op::Gemv { n, ref ms, k: kk, f32_out } = *op else { unreachable!() };
    // Poisoned outputs, CPU reference per matrix; then token 0 alone (n = 1) must give
    // bitwise the same row as in the n-token launch.
    let x = randv(rng, n * kk, 1.0);
    let xp = d.bf16(&x)?;
    let eb = if f32_out { 4 } else { 2 };
    let mut outs = Vec::new();
    let mut singles = Vec::new();
    let mut refs = Vec::new();
    for &m in ms {
        let w = randv(rng, m * kk, 0.05);
        let wp = d.bf16(&w)?;
        outs.push(ops::gemv::GemvOut { w: wp, y: d.poison(eb * n * m)?, m });
        singles.push(ops::gemv::GemvOut { w: wp, y: d.poison(eb * m)?, m });
        refs.push(cpu::linear::linear(&x, n, &w, m, kk));
    }
    ops::gemv::gemv(k, s, xp, n, kk, &outs, f32_out)?;
    ops::gemv::gemv(k, s, xp, 1, kk, &singles, f32_out)?;
    let get = |p: u64, len: usize| if f32_out { d.get_f32(p, len) } else { d.get_bf16(p, len) };
    let mut v = Vec::new();
    for ((o, one), r) in outs.iter().zip(&singles).zip(&refs) {
        let got = get(o.y, n * o.m)?;
        v.push(compare(&format!("y[{n}, {}]", o.m), r, &got, tol));
        let alone = get(one.y, o.m)?;
        if alone.iter().zip(&got).any(|(a, b)| a.to_bits() != b.to_bits()) {
            v.push(Outcome::error(format!("m={}: token 0 at n=1 differs from n={n}", o.m)));
        }
    }
    Ok(v)
}
