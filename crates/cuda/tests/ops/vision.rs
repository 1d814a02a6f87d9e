//! The vision tower's kernels (`kernels/vision.cu`) against the CPU tower's functions
//! (`deltaserve_cpu::vision`, `rope::apply_axial_rope`, `attention::full_attention`, `norm::layer_norm`,
//! the activations), and M-RoPE in the fused q/k norm + RoPE kernel against `rope::apply_mrope`.

use deltaserve_cpu as cpu;
use deltaserve_cuda::ops::{self, vision as vk};
use rand::RngExt;
use rand::rngs::StdRng;

use crate::harness::{Dev, Outcome, R, compare, cu_of, randv, same_bits};
use crate::{Env, Op};

/// The activations a case runs (`ops::vision::Act` and the reference's function).
#[derive(Clone, Copy, Debug)]
pub enum VisionAct {
    GeluTanh,
    Gelu,
    Silu,
    None,
}

impl VisionAct {
    fn kernel(self) -> vk::Act {
        match self {
            Self::GeluTanh => vk::Act::GeluTanh,
            Self::Gelu => vk::Act::Gelu,
            Self::Silu => vk::Act::Silu,
            Self::None => vk::Act::None,
        }
    }
    fn reference(self, x: f32) -> f32 {
        match self {
            Self::GeluTanh => cpu::activation::gelu_tanh(x),
            Self::Gelu => cpu::activation::gelu(x),
            Self::Silu => cpu::activation::silu(x),
            Self::None => x,
        }
    }
}

fn grid_of([t, h, w]: [usize; 3]) -> vk::Grid {
    vk::Grid { t, h, w, merge: 2 }
}

/// f32 values (not rounded: the kernels read the f32 residual stream and GEMM outputs as they are).
fn randf(rng: &mut StdRng, n: usize, a: f32) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-a..a)).collect()
}

/// [`Op::VisionLayerNorm`]: f32 rows → LayerNorm → bf16; with `residual`, x += y + bias first (the stored
/// stream compared too).
pub fn layer_norm(e: Env, d: &mut Dev, rng: &mut StdRng, op: &Op) -> R<Vec<Outcome>> {
    let Env { k, s, tol, .. } = e;
    let Op::VisionLayerNorm { rows, d: dim, residual } = *op else { unreachable!() };
    // An offset, so the mean matters.
    let x: Vec<f32> = randf(rng, rows * dim, 3.0).iter().map(|v| v + 1.5).collect();
    let (w, b) = (randv(rng, dim, 1.0), randv(rng, dim, 0.5));
    let (xp, wp, bp, op) = (d.f32s(&x)?, d.bf16(&w)?, d.bf16(&b)?, d.poison(2 * rows * dim)?);
    let mut out = Vec::new();
    let mut r = x.clone();
    if residual {
        let (y, bias) = (randf(rng, rows * dim, 2.0), randv(rng, dim, 0.5));
        let (yp, biasp) = (d.f32s(&y)?, d.bf16(&bias)?);
        vk::layer_norm(k, s, xp, Some((yp, biasp)), wp, bp, op, rows, dim, 1e-6)?;
        r.iter_mut().enumerate().for_each(|(i, v)| *v += y[i] + bias[i % dim]);
        out.push(compare("stream", &r, &d.get_f32(xp, rows * dim)?, tol));
    } else {
        vk::layer_norm(k, s, xp, None, wp, bp, op, rows, dim, 1e-6)?;
    }
    cpu::norm::layer_norm(&mut r, &w, &b, 1e-6);
    out.push(compare("normed", &r, &d.get_bf16(op, rows * dim)?, tol));
    Ok(out)
}

/// [`Op::VisionEmbedPos`]: x + bias + the interpolated position table.
pub fn embed_pos(e: Env, d: &mut Dev, rng: &mut StdRng, op: &Op) -> R<Vec<Outcome>> {
    let Env { k, s, tol, .. } = e;
    let Op::VisionEmbedPos { grid, d: dim, side } = *op else { unreachable!() };
    let n: usize = grid.iter().product();
    let x = randf(rng, n * dim, 1.0);
    let (bias, table) = (randv(rng, dim, 0.1), randv(rng, side * side * dim, 0.5));
    let (xp, bp, tp) = (d.f32s(&x)?, d.bf16(&bias)?, d.bf16(&table)?);
    vk::embed_pos(k, s, xp, bp, tp, dim, grid_of(grid), side)?;
    let pos = cpu::vision::position_embeddings(&table, dim, side, grid, 2);
    let r: Vec<f32> = x.iter().enumerate().map(|(i, v)| v + bias[i % dim] + pos[i]).collect();
    Ok(vec![compare("x", &r, &d.get_f32(xp, n * dim)?, tol)])
}

/// [`Op::VisionQkvRope`]: y + bias, q and k rotated at each patch's (row, column) in bf16, v as its f16
/// codes.
pub fn qkv_rope(e: Env, d: &mut Dev, rng: &mut StdRng, op: &Op) -> R<Vec<Outcome>> {
    let Env { k, s, tol, .. } = e;
    let Op::VisionQkvRope { grid, heads, hd } = *op else { unreachable!() };
    let n: usize = grid.iter().product();
    let w = 3 * heads * hd;
    let (y, bias) = (randf(rng, n * w, 2.0), randv(rng, w, 0.2));
    let (yp, bp, op) = (d.f32s(&y)?, d.bf16(&bias)?, d.poison(2 * n * w)?);
    let theta = 10_000.0;
    vk::qkv_rope(k, s, yp, bp, op, heads, hd, grid_of(grid), theta)?;
    let with_bias: Vec<f32> = y.iter().enumerate().map(|(i, v)| v + bias[i % w]).collect();
    let part = |p: usize| -> Vec<f32> { with_bias.chunks(w).flat_map(|r| r[p * w / 3..][..w / 3].to_vec()).collect() };
    let (mut q, mut kk, v) = (part(0), part(1), part(2));
    let pos = cpu::vision::patch_positions(grid, 2);
    cpu::rope::apply_axial_rope(&mut q, heads, hd, theta as f64, &pos);
    cpu::rope::apply_axial_rope(&mut kk, heads, hd, theta as f64, &pos);
    let c = w / 3;
    let got = d.get_u16s(op, n * w)?;
    let (mut got_qk, mut got_v) = (Vec::new(), Vec::new());
    for row in got.chunks(w) {
        got_qk.extend(row[..2 * c].iter().map(|&b| half::bf16::from_bits(b).to_f32()));
        got_v.extend(row[2 * c..].iter().map(|&b| half::f16::from_bits(b).to_f32() / vk::V_SCALE));
    }
    let r_qk: Vec<f32> = (0..n).flat_map(|i| [&q[i * c..][..c], &kk[i * c..][..c]].concat()).collect();
    Ok(vec![compare("q, k", &r_qk, &got_qk, tol), compare("v (f16 codes)", &v, &got_v, tol)])
}

/// qkv `[n, 3·dim]` on the device as the attention reads it: q and k bf16, v as its f16 codes
/// (`ops::vision::v_code`).
fn qkv_dev(d: &mut Dev, qkv: &[f32], dim: usize) -> R<u64> {
    let bits: Vec<u16> = qkv
        .chunks(3 * dim)
        .flat_map(|row| {
            let qk = row[..2 * dim].iter().map(|&x| half::bf16::from_f32(x).to_bits());
            qk.chain(row[2 * dim..].iter().map(|&x| vk::v_code(x))).collect::<Vec<u16>>()
        })
        .collect();
    d.u16s(&bits)
}

/// [`Op::VisionAttention`]: each image (its own qkv rows) attends within each of its frames, launched
/// one image after the other as the tower runs them.
pub fn attention(e: Env, d: &mut Dev, rng: &mut StdRng, op: &Op) -> R<Vec<Outcome>> {
    let Env { k, s, tol, .. } = e;
    let Op::VisionAttention { ref grids, heads, hd } = *op else { unreachable!() };
    let dim = heads * hd;
    let mut out = Vec::new();
    for (i, &g) in grids.iter().enumerate() {
        let n: usize = g.iter().product();
        let qkv = randv(rng, n * 3 * dim, 2.0);
        let (qp, op) = (qkv_dev(d, &qkv, dim)?, d.poison(2 * n * dim)?);
        vk::attention(k, s, qp, op, heads, hd, grid_of(g))?;
        let r = frames_reference(&qkv, &vec![g[1] * g[2]; g[0]], heads, hd);
        out.push(compare(&format!("image {i} {g:?}"), &r, &d.get_bf16(op, n * dim)?, tol));
    }
    Ok(out)
}

/// The reference of the attention over frames of `lens` rows of qkv `[n, 3·dim]` (one after the other):
/// each frame's rows through `full_attention` on their own.
fn frames_reference(qkv: &[f32], lens: &[usize], heads: usize, hd: usize) -> Vec<f32> {
    let dim = heads * hd;
    let mut r = Vec::with_capacity(qkv.len() / 3);
    let mut at = 0;
    for &len in lens {
        let rows = &qkv[at * 3 * dim..(at + len) * 3 * dim];
        let part = |p: usize| -> Vec<f32> { rows.chunks(3 * dim).flat_map(|x| x[p * dim..][..dim].to_vec()).collect() };
        r.extend(cpu::attention::full_attention(&part(0), &part(1), &part(2), heads, hd));
        at += len;
    }
    r
}

/// [`Op::VisionAttentionFrames`]: packed frames of any lengths in one launch (device offsets), after a
/// kernel that leaves NaN in every SM's shared memory where asked; and the launcher refuses the head
/// dims the kernels do not take.
pub fn attention_frames(e: Env, d: &mut Dev, rng: &mut StdRng, op: &Op) -> R<Vec<Outcome>> {
    let Env { rt, k, s, tol } = e;
    let Op::VisionAttentionFrames { ref lens, heads, hd, nan_smem } = *op else { unreachable!() };
    let (dim, n) = (heads * hd, lens.iter().sum::<usize>());
    let qkv = randv(rng, n * 3 * dim, 2.0);
    let (qp, op, cu) = (qkv_dev(d, &qkv, dim)?, d.poison(2 * n * dim)?, d.i32s(&cu_of(lens))?);
    let frames = vk::Frames::Packed { cu, count: lens.len(), max_len: lens.iter().copied().max().unwrap_or(0) };
    if nan_smem {
        // A few blocks per SM, each over all the shared memory a block may have.
        let blocks = 4 * rt.sm_count.max(1) as usize;
        ops::init::fill_smem(k, s, 0xffff_ffff, blocks, rt.max_smem_optin.max(0) as usize)?;
    }
    vk::attention_frames(k, s, qp, op, n, heads, hd, frames)?;
    let r = frames_reference(&qkv, lens, heads, hd);
    let mut out = vec![compare(&format!("frames {lens:?}"), &r, &d.get_bf16(op, n * dim)?, tol)];
    let refused: Vec<usize> = [0, 1, 71, 129, 130, 256]
        .into_iter()
        .filter(|&bad| vk::attention_frames(k, s, qp, op, n, heads, bad, frames).is_ok())
        .collect();
    out.push(Outcome {
        ok: refused.is_empty(),
        detail: format!("head dims 0, 1, 71, 129, 130, 256 refused (accepted: {refused:?})"),
    });
    Ok(out)
}

/// [`Op::VisionBiasAct`]: act(y + bias) to bf16.
pub fn bias_act(e: Env, d: &mut Dev, rng: &mut StdRng, op: &Op) -> R<Vec<Outcome>> {
    let Env { k, s, tol, .. } = e;
    let Op::VisionBiasAct { rows, d: dim, act } = *op else { unreachable!() };
    let (y, bias) = (randf(rng, rows * dim, 4.0), randv(rng, dim, 0.5));
    let (yp, bp, op) = (d.f32s(&y)?, d.bf16(&bias)?, d.poison(2 * rows * dim)?);
    vk::bias_act(k, s, yp, bp, op, rows, dim, act.kernel())?;
    let r: Vec<f32> = y.iter().enumerate().map(|(i, v)| act.reference(v + bias[i % dim])).collect();
    Ok(vec![compare("act", &r, &d.get_bf16(op, rows * dim)?, tol)])
}

/// [`Op::QkNormRopeMrope`]: the fused q/k norm + RoPE at (t, h, w) positions against rms_norm_1p +
/// apply_mrope; and at equal streams bit for bit the kernel rotating at `positions`.
pub fn qk_norm_rope_mrope(e: Env, d: &mut Dev, rng: &mut StdRng, op: &Op) -> R<Vec<Outcome>> {
    let Env { k, s, tol, .. } = e;
    let Op::QkNormRopeMrope { t, nq, nkv, hd, rot, section } = *op else { unreachable!() };
    let (q_tok, k_tok) = (2 * nq * hd, nkv * hd);
    let q = randv(rng, t * q_tok, 2.0);
    let kv = randv(rng, t * k_tok, 2.0);
    let (wq, wk) = (randv(rng, hd, 0.5), randv(rng, hd, 0.5));
    // Image-like rows: h and w streams off the t stream, then text rows at equal streams.
    let pos3: Vec<[usize; 3]> =
        (0..t).map(|i| if i < t / 2 { [7, 7 + i / 3, 7 + i % 3] } else { [20 + i; 3] }).collect();
    let kv_pos: Vec<i32> = (0..t).map(|i| (100 + i) as i32).collect();
    let flat: Vec<i32> = pos3.iter().flat_map(|p| p.map(|x| x as i32)).collect();
    let (wqp, wkp, pp, rp) = (d.bf16(&wq)?, d.bf16(&wk)?, d.i32s(&kv_pos)?, d.i32s(&flat)?);
    let (theta, eps) = (1e7f32, 1e-6);
    let launch = |qp: u64, kp: u64, positions: u64, rope_pos: u64| {
        let a = ops::rope::QkNormRope {
            q: qp,
            q_tok,
            q_head: 2 * hd,
            q_heads: nq,
            q_norm: wqp,
            k: kp,
            k_tok,
            kv_heads: nkv,
            k_norm: wkp,
            positions,
            rope_pos,
            mrope_section: section,
            t,
            head_dim: hd,
            rotary_dim: rot,
            theta,
            eps,
        };
        ops::rope::qk_norm_rope(k, s, &a)
    };
    let (qa, ka) = (d.bf16(&q)?, d.bf16(&kv)?);
    launch(qa, ka, pp, rp)?;
    // The reference: the rows normalised by rms_norm_1p (bitwise the fused kernel's norm: the qk_norm_rope
    // cases), then M-RoPE on the CPU. (A CPU norm differs in its last f32 bits, so now and then its bf16
    // rounding flips, and a rotation mixing a flipped value of a few units into a small output exceeds a
    // tolerance scaled by that output.)
    let mut norm = |x: &[f32], w: u64, stride: usize, heads: usize| -> R<Vec<f32>> {
        let p = d.bf16(x)?;
        ops::norm::rms_norm_1p(k, s, p, stride / heads, w, p, stride / heads, t * heads, hd, eps)?;
        let v = d.get_bf16(p, x.len())?;
        Ok(v.chunks(stride / heads).flat_map(|h| h[..hd].to_vec()).collect())
    };
    let (mut rq, mut rk) = (norm(&q, wqp, q_tok, nq)?, norm(&kv, wkp, k_tok, nkv)?);
    cpu::rope::apply_mrope(&mut rq, nq, hd, rot, theta as f64, section, &pos3);
    cpu::rope::apply_mrope(&mut rk, nkv, hd, rot, theta as f64, section, &pos3);
    let got_q = d.get_bf16(qa, q.len())?;
    let got_q: Vec<f32> = got_q.chunks(2 * hd).flat_map(|h| h[..hd].to_vec()).collect();
    let mut out = vec![compare("q", &rq, &got_q, tol), compare("k", &rk, &d.get_bf16(ka, kv.len())?, tol)];
    // Equal streams at the KV positions: bit for bit the launch without rope_pos.
    let eq: Vec<i32> = kv_pos.iter().flat_map(|&p| [p; 3]).collect();
    let ep = d.i32s(&eq)?;
    let (qb, kb, qc, kc) = (d.bf16(&q)?, d.bf16(&kv)?, d.bf16(&q)?, d.bf16(&kv)?);
    launch(qb, kb, pp, ep)?;
    launch(qc, kc, pp, 0)?;
    let bits = |p: u64, n: usize| -> R<Vec<u16>> {
        let mut v = vec![0u16; n];
        d.rt.download(&mut v, p)?;
        Ok(v)
    };
    out.push(same_bits("q, equal streams vs positions", &bits(qb, q.len())?, &bits(qc, q.len())?));
    out.push(same_bits("k, equal streams vs positions", &bits(kb, kv.len())?, &bits(kc, kv.len())?));
    Ok(out)
}
