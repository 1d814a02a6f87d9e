//! Launchers for kernels/rope.cu: partial rotate-half RoPE, and an attention layer's q/k RMSNorm +
//! RoPE in one launch ([`qk_norm_rope`]), in place, with the step's K/V rows written into the paged
//! cache by the same launch ([`qk_norm_rope_kv`], the backend's).

use cudarc::driver::CudaStream;

use super::{Kernels, invalid, launch, launch_pdl, to_i32, to_u32};
use crate::error::CudaError;

/// x [t, heads, head_dim] bf16 (token stride `tok_stride` elements), pos [t] i32; rotates the
/// first `rotary_dim` dims of each head with base `theta`.
#[allow(clippy::too_many_arguments)]
pub fn rope_partial(
    k: &Kernels,
    s: &CudaStream,
    x: u64,
    tok_stride: usize,
    pos: u64,
    t: usize,
    heads: usize,
    head_dim: usize,
    rotary_dim: usize,
    theta: f32,
) -> Result<(), CudaError> {
    rope_partial_strided(k, s, x, tok_stride, head_dim, pos, t, heads, head_dim, rotary_dim, theta)
}

/// [`rope_partial`] with head h of token i at `x + i*tok_stride + h*head_stride` (elements), e.g.
/// the q half of the attention q|gate projection output (head_stride = 2*head_dim).
#[allow(clippy::too_many_arguments)]
pub fn rope_partial_strided(
    k: &Kernels,
    s: &CudaStream,
    x: u64,
    tok_stride: usize,
    head_stride: usize,
    pos: u64,
    t: usize,
    heads: usize,
    head_dim: usize,
    rotary_dim: usize,
    theta: f32,
) -> Result<(), CudaError> {
    if t == 0 {
        return Ok(());
    }
    if rotary_dim == 0
        || !rotary_dim.is_multiple_of(2)
        || rotary_dim > head_dim
        || head_stride < head_dim
        || tok_stride < heads * head_stride
    {
        return Err(invalid(
            "rope_partial",
            format!("rotary_dim = {rotary_dim}, head_dim = {head_dim}, heads = {heads}, tok_stride = {tok_stride}"),
        ));
    }
    let (ts, hs) = (tok_stride as i64, head_stride as i64);
    let (h, hd, r) = (
        to_i32("rope_partial", "heads", heads)?,
        to_i32("rope_partial", "head_dim", head_dim)?,
        to_i32("rope_partial", "rotary_dim", rotary_dim)?,
    );
    let grid = (to_u32("rope_partial", "t", t)?, 1, 1);
    launch!(k, s, "rope_partial", grid, (128, 1, 1), 0; x, ts, pos, h, hd, r, theta, hs)
}

/// An attention layer's q and k heads: RMSNorm(1 + w) per head then partial RoPE, in place.
#[derive(Clone, Copy, Debug)]
pub struct QkNormRope {
    /// q head h of token i at `q + i*q_tok + h*q_head` (elements; the q half of the q|gate layout).
    pub q: u64,
    pub q_tok: usize,
    pub q_head: usize,
    pub q_heads: usize,
    /// [head_dim] bf16.
    pub q_norm: u64,
    /// k head h of token i at `k + i*k_tok + h*head_dim`.
    pub k: u64,
    pub k_tok: usize,
    pub kv_heads: usize,
    pub k_norm: u64,
    /// [t] i32: each row's KV index, and its rotary position when `rope_pos` is 0.
    pub positions: u64,
    /// [t, 3] i32: each row's (t, h, w) M-RoPE position, rotated as `mrope_section` splits the
    /// frequencies (a model that runs images); 0: rows rotate at `positions`.
    pub rope_pos: u64,
    /// (t, h, w) frequencies of M-RoPE (`rope_parameters.mrope_section`); read only with `rope_pos`.
    pub mrope_section: [usize; 3],
    pub t: usize,
    pub head_dim: usize,
    pub rotary_dim: usize,
    pub theta: f32,
    pub eps: f32,
}

/// The checks of a [`QkNormRope`] launch named `what` (`a.t > 0`).
fn check_qk(what: &'static str, a: &QkNormRope) -> Result<(), CudaError> {
    let hd = a.head_dim;
    if hd == 0
        || hd > 512
        || a.rotary_dim == 0
        || !a.rotary_dim.is_multiple_of(2)
        || a.rotary_dim > hd
        || a.q_head < hd
        || a.q_tok < a.q_heads * a.q_head
        || a.k_tok < a.kv_heads * hd
    {
        return Err(invalid(
            what,
            format!(
                "head_dim {hd} (<= 512), rotary_dim {}, q strides {}/{} for {} heads, k stride {} for {} heads",
                a.rotary_dim, a.q_tok, a.q_head, a.q_heads, a.k_tok, a.kv_heads
            ),
        ));
    }
    Ok(())
}

/// One launch for what `rms_norm_1p` (q, k) and [`rope_partial`] (q, k) do, bitwise the same.
pub fn qk_norm_rope(k: &Kernels, s: &CudaStream, a: &QkNormRope) -> Result<(), CudaError> {
    if a.t == 0 {
        return Ok(());
    }
    check_qk("qk_norm_rope", a)?;
    launch_qk(k, s, a, None)
}

/// [`qk_norm_rope`], then the step's K rows (as it leaves them) and V rows into `layer`'s paged cache
/// ([`super::kv_quant::kv_write_q`]), in one launch and bitwise the same as the two. `kv` addresses
/// the write as for `kv_write_q` (its `k` / `k_stride` are `a`'s k rows; `k_cache` / `v_cache` unused).
pub fn qk_norm_rope_kv(
    k: &Kernels,
    s: &CudaStream,
    a: &QkNormRope,
    kv: &super::kv_cache::KvWrite,
    layer: &super::kv_quant::LayerKv,
) -> Result<(), CudaError> {
    const K: &str = "qk_norm_rope_kv";
    if a.t == 0 {
        return Ok(());
    }
    check_qk(K, a)?;
    let formats = super::kv_quant::check_write(K, kv, layer)?;
    let rows = (kv.t, kv.k, kv.k_stride, kv.kv_heads, kv.head_dim, kv.positions);
    if rows != (a.t, a.k, a.k_tok, a.kv_heads, a.head_dim, a.positions) {
        return Err(invalid(K, format!("the KV write {kv:?} is not of the rows of {a:?}")));
    }
    launch_qk(k, s, a, Some((kv, layer, formats)))
}

/// The kernels of E consecutive dims a lane (E = 2, 4, 8: head_dim 64, 128, 256).
const QK_VECTOR: [&str; 3] = ["qk_norm_rope_v2", "qk_norm_rope_v4", "qk_norm_rope_v8"];

/// Steps of at least this many tokens run one block a token with 4 rows a warp (the rotation table
/// computed once a token), shorter ones a row a warp.
const QK_ONE_PIECE_TOKENS: usize = 256;

/// E for `qk_norm_rope_vE` when `a` (and the KV write `kv`) allow it: head_dim 32E for E in {2, 4, 8},
/// the rotated half a multiple of E, every row address and norm weight aligned to 2E bytes.
fn vector_width(a: &QkNormRope, kv: Option<&super::kv_cache::KvWrite>) -> Option<usize> {
    let e = a.head_dim / 32;
    if !a.head_dim.is_multiple_of(32) || ![2, 4, 8].contains(&e) || !(a.rotary_dim / 2).is_multiple_of(e) {
        return None;
    }
    let bytes = 2 * e as u64;
    let mut addrs = vec![a.q, a.k, a.q_norm, a.k_norm];
    let mut strides = vec![a.q_tok, a.q_head, a.k_tok];
    if let Some(w) = kv {
        addrs.push(w.v);
        strides.push(w.v_stride);
    }
    (addrs.iter().all(|p| p.is_multiple_of(bytes)) && strides.iter().all(|s| s.is_multiple_of(e))).then_some(e)
}

/// The `qk_norm_rope` kernel over `a`'s rows, and with `kv` the KV write (the formats' kernel codes).
fn launch_qk(
    k: &Kernels,
    s: &CudaStream,
    a: &QkNormRope,
    kv: Option<(&super::kv_cache::KvWrite, &super::kv_quant::LayerKv, (i32, i32))>,
) -> Result<(), CudaError> {
    const K: &str = "qk_norm_rope";
    let hd = a.head_dim;
    let nv_rows = if kv.is_some() { a.kv_heads } else { 0 };
    let rows = a.q_heads + a.kv_heads + nv_rows;
    let (name, grid) = match vector_width(a, kv.map(|(w, ..)| w)) {
        // A token a block (its rows in pieces of 8 warps): one piece for long steps, a row a warp for short ones.
        Some(e) => {
            let pieces = if a.t >= QK_ONE_PIECE_TOKENS { 1 } else { rows.div_ceil(8) };
            (QK_VECTOR[e.trailing_zeros() as usize - 1], (to_u32(K, "t", a.t)?, pieces as u32, 1))
        }
        // One warp per (token, head) row of q, k (and v), 8 rows per block.
        None => (K, (to_u32(K, "blocks", (a.t * rows).div_ceil(8))?, 1, 1)),
    };
    let (q, qt, qh, wq, nq) = (a.q, a.q_tok as i64, a.q_head as i64, a.q_norm, to_i32(K, "q_heads", a.q_heads)?);
    let (kp, kt, kh, wk, nk) = (a.k, a.k_tok as i64, hd as i64, a.k_norm, to_i32(K, "kv_heads", a.kv_heads)?);
    let (pos, tt, d, r, theta, eps) =
        (a.positions, to_i32(K, "t", a.t)?, hd as i32, a.rotary_dim as i32, a.theta, a.eps);
    let nv = nv_rows as i32;
    let rp = a.rope_pos;
    let (sec_h, sec_w) =
        (to_i32(K, "mrope_section", a.mrope_section[1])?, to_i32(K, "mrope_section", a.mrope_section[2])?);
    // The KV write's arguments (all zero without it: the kernel then stores nothing).
    let ((vp, vt), (kc, ksc, vc, vsc), (bt, cu), (mb, b, page), (kf, vf)) = match kv {
        Some((w, layer, formats)) => (
            (w.v, w.v_stride as i64),
            (layer.k.data, layer.k.scales, layer.v.data, layer.v.scales),
            (w.block_tables, w.cu_seqlens),
            (to_i32(K, "max_blocks", w.max_blocks)?, to_i32(K, "n_seqs", w.n_seqs)?, to_i32(K, "page", w.page)?),
            formats,
        ),
        None => ((0u64, 0i64), (0u64, 0u64, 0u64, 0u64), (0u64, 0u64), (0i32, 0i32, 1i32), (0i32, 0i32)),
    };
    launch_pdl!(k, s, name, grid, (256, 1, 1), 0;
        q, qt, qh, wq, nq, kp, kt, kh, wk, nk, vp, vt, nv, pos, tt, d, r, theta, eps,
        kc, ksc, vc, vsc, bt, mb, cu, b, page, kf, vf, rp, sec_h, sec_w)
}
