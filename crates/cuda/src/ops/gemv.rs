//! Launcher for kernels/gemv.cu: `y[n, m] = x[n, k] · W[m, k]ᵀ` for decode-sized n (1..=8),
//! up to three weight matrices sharing x in one launch. Faster than cuBLASLt at these n: the
//! weights stream once at close to copy bandwidth (see bench/results/decode-2026-11-29.md).

use cudarc::driver::CudaStream;

use super::{Kernels, invalid, launch_pdl, to_i32, to_u32};
use crate::error::CudaError;

/// Most tokens (rows of x) one launch takes: the MMA's n = 8.
pub const MAX_TOKENS: usize = 8;
/// Output rows per block.
pub const ROWS: usize = 16;
/// Most weight matrices per launch.
pub const MAX_OUTS: usize = 3;

/// One output of a launch: weights `w` [m, k] bf16 row-major and `y` [n, m] (bf16 or f32).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GemvOut {
    pub w: u64,
    pub y: u64,
    pub m: usize,
}

/// Whether the kernel takes `n` tokens of `k` features (else use the GEMM).
pub fn supported(n: usize, k: usize) -> bool {
    (1..=MAX_TOKENS).contains(&n) && k > 0 && k.is_multiple_of(8)
}

/// `y_s = x · W_sᵀ` for each of `outs` (1..=3); x [n, k] bf16; y in f32 when `f32_out`.
/// Every pointer must be 16-byte aligned, `k` a multiple of 8 and `n` in 1..=8.
#[allow(clippy::too_many_arguments)]
pub fn gemv(
    k: &Kernels,
    s: &CudaStream,
    x: u64,
    n: usize,
    kdim: usize,
    outs: &[GemvOut],
    f32_out: bool,
) -> Result<(), CudaError> {
    const NAME: &str = "gemv_bf16";
    if !supported(n, kdim) {
        return Err(invalid(NAME, format!("n = {n} (1..={MAX_TOKENS}) and k = {kdim} (multiple of 8) required")));
    }
    if outs.is_empty() || outs.len() > MAX_OUTS {
        return Err(invalid(NAME, format!("{} outputs (1..={MAX_OUTS})", outs.len())));
    }
    if !x.is_multiple_of(16) || outs.iter().any(|o| !o.w.is_multiple_of(16) || !o.y.is_multiple_of(16)) {
        return Err(invalid(NAME, "pointers must be 16-byte aligned"));
    }
    let mut seg = [GemvOut { w: 0, y: 0, m: 0 }; MAX_OUTS];
    seg[..outs.len()].copy_from_slice(outs);
    let nb: Vec<usize> = seg.iter().map(|o| o.m.div_ceil(ROWS)).collect();
    let blocks: usize = nb.iter().sum();
    if blocks == 0 {
        return Ok(());
    }
    let grid = (to_u32(NAME, "blocks", blocks)?, 1, 1);
    let (nn, kk) = (to_i32(NAME, "n", n)?, to_i32(NAME, "k", kdim)?);
    let (w0, y0, m0, nb0) = (seg[0].w, seg[0].y, to_i32(NAME, "m", seg[0].m)?, to_i32(NAME, "blocks", nb[0])?);
    let (w1, y1, m1, nb1) = (seg[1].w, seg[1].y, to_i32(NAME, "m", seg[1].m)?, to_i32(NAME, "blocks", nb[1])?);
    let (w2, y2, m2) = (seg[2].w, seg[2].y, to_i32(NAME, "m", seg[2].m)?);
    let f32o = i32::from(f32_out);
    launch_pdl!(k, s, "gemv_bf16", grid, (128, 1, 1), 0; x, nn, kk, w0, y0, m0, nb0, w1, y1, m1, nb1, w2, y2, m2, f32o)
}
