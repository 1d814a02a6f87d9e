//! Launchers for kernels/rope.cu: partial rotate-half RoPE, and an attention layer's q/k RMSNorm +
//! RoPE in one launch ([`qk_norm_rope`]), in place.

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
    /// [t] i32.
    pub positions: u64,
    pub t: usize,
    pub head_dim: usize,
    pub rotary_dim: usize,
    pub theta: f32,
    pub eps: f32,
}

/// One launch for what `rms_norm_1p` (q, k) and [`rope_partial`] (q, k) do, bitwise the same.
pub fn qk_norm_rope(k: &Kernels, s: &CudaStream, a: &QkNormRope) -> Result<(), CudaError> {
    const K: &str = "qk_norm_rope";
    if a.t == 0 {
        return Ok(());
    }
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
            K,
            format!(
                "head_dim {hd} (<= 512), rotary_dim {}, q strides {}/{} for {} heads, k stride {} for {} heads",
                a.rotary_dim, a.q_tok, a.q_head, a.q_heads, a.k_tok, a.kv_heads
            ),
        ));
    }
    // One warp per (token, head) row, 8 rows per block.
    let grid = (to_u32(K, "blocks", (a.t * (a.q_heads + a.kv_heads)).div_ceil(8))?, 1, 1);
    let (q, qt, qh, wq, nq) = (a.q, a.q_tok as i64, a.q_head as i64, a.q_norm, to_i32(K, "q_heads", a.q_heads)?);
    let (kp, kt, kh, wk, nk) = (a.k, a.k_tok as i64, hd as i64, a.k_norm, to_i32(K, "kv_heads", a.kv_heads)?);
    let (pos, tt, d, r, theta, eps) =
        (a.positions, to_i32(K, "t", a.t)?, hd as i32, a.rotary_dim as i32, a.theta, a.eps);
    launch_pdl!(k, s, K, grid, (256, 1, 1), 0; q, qt, qh, wq, nq, kp, kt, kh, wk, nk, pos, tt, d, r, theta, eps)
}
