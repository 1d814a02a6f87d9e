//! Launchers for kernels/vision.cu: the vision tower's own kernels (position embeddings, LayerNorm, the
//! qkv bias with the 2-D axial rotary, non-causal attention within an image's frames, the residual add
//! and the biased activations). Every launch is over one image of grid (t, h, w) patches.

use cudarc::driver::CudaStream;

use super::{Kernels, invalid, launch, to_i32, to_u32};
use crate::error::CudaError;

/// Head dims the attention kernel takes (even, at most this).
pub const MAX_HEAD_DIM: usize = 128;

/// An image's patch grid: `t` frames of `h × w` patches, folded by `merge × merge` windows (the rows come
/// window by window, `crates/cpu/src/vision.rs` `patch_positions`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Grid {
    pub t: usize,
    pub h: usize,
    pub w: usize,
    pub merge: usize,
}

impl Grid {
    /// Patch rows of the image.
    pub fn patches(&self) -> usize {
        self.t * self.h * self.w
    }

    /// The grid's kernel ints (h, w, merge), checked: non-empty, folding into windows.
    fn ints(&self, kernel: &'static str) -> Result<(i32, i32, i32), CudaError> {
        let Grid { t, h, w, merge } = *self;
        if t == 0 || h == 0 || w == 0 || merge == 0 || !h.is_multiple_of(merge) || !w.is_multiple_of(merge) {
            return Err(invalid(kernel, format!("grid {t}×{h}×{w} does not fold into {merge}×{merge} windows")));
        }
        Ok((to_i32(kernel, "h", h)?, to_i32(kernel, "w", w)?, to_i32(kernel, "merge", merge)?))
    }
}

/// The activations of [`bias_act`] (`vision_config.hidden_act`; the merger's is [`Act::Gelu`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Act {
    GeluTanh = 0,
    Gelu = 1,
    Silu = 2,
    /// The bias alone.
    None = 3,
}

/// `x[r] += bias + pos(r)`: x `[patches, d]` f32 (the patch embedding's GEMM output), bias `[d]` bf16
/// (0: none), the learned table `[side², d]` bf16 resampled bilinearly (align-corners) to the grid.
#[allow(clippy::too_many_arguments)]
pub fn embed_pos(
    k: &Kernels,
    s: &CudaStream,
    x: u64,
    bias: u64,
    table: u64,
    d: usize,
    grid: Grid,
    side: usize,
) -> Result<(), CudaError> {
    const K: &str = "vision_embed_pos";
    let (gh, gw, merge) = grid.ints(K)?;
    if d == 0 || side == 0 {
        return Err(invalid(K, format!("d = {d}, side = {side}")));
    }
    let (dd, side) = (to_i32(K, "d", d)?, to_i32(K, "side", side)?);
    let blocks = (to_u32(K, "patches", grid.patches())?, 1, 1);
    launch!(k, s, K, blocks, (256, 1, 1), 0; x, bias, table, dd, gh, gw, merge, side)
}

/// out `[rows, d]` bf16 = LayerNorm(x `[rows, d]` f32) with weight and bias `[d]` bf16.
#[allow(clippy::too_many_arguments)]
pub fn layer_norm(
    k: &Kernels,
    s: &CudaStream,
    x: u64,
    w: u64,
    b: u64,
    out: u64,
    rows: usize,
    d: usize,
    eps: f32,
) -> Result<(), CudaError> {
    const K: &str = "vision_layer_norm";
    if rows == 0 {
        return Ok(());
    }
    if d == 0 {
        return Err(invalid(K, "d = 0"));
    }
    let dd = to_i32(K, "d", d)?;
    launch!(k, s, K, (to_u32(K, "rows", rows)?, 1, 1), (256, 1, 1), 0; x, w, b, out, dd, eps)
}

/// qkv `[patches, 3·heads·hd]` bf16 = y (f32, the qkv GEMM's output) + bias (`[3·heads·hd]` bf16, 0:
/// none), q and k heads rotated by the 2-D axial rotary of base `theta` at each patch's (row, column).
#[allow(clippy::too_many_arguments)]
pub fn qkv_rope(
    k: &Kernels,
    s: &CudaStream,
    y: u64,
    bias: u64,
    qkv: u64,
    heads: usize,
    hd: usize,
    grid: Grid,
    theta: f32,
) -> Result<(), CudaError> {
    const K: &str = "vision_qkv_rope";
    let (gh, gw, merge) = grid.ints(K)?;
    if heads == 0 || hd == 0 || !hd.is_multiple_of(4) {
        return Err(invalid(K, format!("{heads} heads of dim {hd} (a multiple of 4)")));
    }
    let (nh, d) = (to_i32(K, "heads", heads)?, to_i32(K, "hd", hd)?);
    let blocks = (to_u32(K, "patches", grid.patches())?, 1, 1);
    launch!(k, s, K, blocks, (256, 1, 1), 0; y, bias, qkv, nh, d, gh, gw, merge, theta)
}

/// o `[patches, heads·hd]` bf16 = softmax(q kᵀ / √hd) v per head, each patch attending to every patch of
/// its frame (`grid.h · grid.w` patches); q, k, v the thirds of qkv `[patches, 3·heads·hd]` bf16.
pub fn attention(
    k: &Kernels,
    s: &CudaStream,
    qkv: u64,
    o: u64,
    heads: usize,
    hd: usize,
    grid: Grid,
) -> Result<(), CudaError> {
    const K: &str = "vision_attention";
    grid.ints(K)?;
    if heads == 0 || hd == 0 || hd > MAX_HEAD_DIM || !hd.is_multiple_of(2) {
        return Err(invalid(K, format!("{heads} heads of dim {hd} (even, at most {MAX_HEAD_DIM})")));
    }
    let frame = grid.h * grid.w;
    let n = grid.patches();
    let tiles = frame.div_ceil(32);
    let blocks = (to_u32(K, "blocks", grid.t * tiles)?, to_u32(K, "heads", heads)?, 1);
    let (nn, nh, d, l) =
        (to_i32(K, "n", n)?, to_i32(K, "heads", heads)?, to_i32(K, "hd", hd)?, to_i32(K, "frame", frame)?);
    let scale = 1.0 / (hd as f32).sqrt();
    launch!(k, s, K, blocks, (128, 1, 1), 0; qkv, o, nn, nh, d, l, scale)
}

/// x += y + bias: x, y `[rows, d]` f32, bias `[d]` bf16 (0: none).
#[allow(clippy::too_many_arguments)]
pub fn residual(
    k: &Kernels,
    s: &CudaStream,
    x: u64,
    y: u64,
    bias: u64,
    rows: usize,
    d: usize,
) -> Result<(), CudaError> {
    const K: &str = "vision_residual";
    let Some(shape) = elementwise(K, rows, d) else { return Ok(()) };
    let (blocks, total, dd) = shape?;
    launch!(k, s, K, blocks, (256, 1, 1), 0; x, y, bias, total, dd)
}

/// out `[rows, d]` bf16 = act(y + bias): y f32, bias `[d]` bf16 (0: none).
#[allow(clippy::too_many_arguments)]
pub fn bias_act(
    k: &Kernels,
    s: &CudaStream,
    y: u64,
    bias: u64,
    out: u64,
    rows: usize,
    d: usize,
    act: Act,
) -> Result<(), CudaError> {
    const K: &str = "vision_bias_act";
    let a = act as i32;
    let Some(shape) = elementwise(K, rows, d) else { return Ok(()) };
    let (blocks, total, dd) = shape?;
    launch!(k, s, K, blocks, (256, 1, 1), 0; y, bias, out, total, dd, a)
}

/// The grid, element count and width of an elementwise launch over `[rows, d]` (None: nothing to do).
type Elementwise = ((u32, u32, u32), i64, i32);

fn elementwise(kernel: &'static str, rows: usize, d: usize) -> Option<Result<Elementwise, CudaError>> {
    let total = rows.checked_mul(d)?;
    if total == 0 {
        return None;
    }
    let blocks = match to_u32(kernel, "blocks", total.div_ceil(256)) {
        Ok(b) => b,
        Err(e) => return Some(Err(e)),
    };
    Some(to_i32(kernel, "d", d).map(|dd| ((blocks, 1, 1), total as i64, dd)))
}
