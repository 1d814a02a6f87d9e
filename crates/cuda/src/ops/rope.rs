//! Launcher for kernels/rope.cu (partial rotate-half RoPE, in place).

use cudarc::driver::CudaStream;

use super::{Kernels, invalid, launch, to_i32, to_u32};
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
