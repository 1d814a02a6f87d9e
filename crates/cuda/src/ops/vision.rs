//! Launchers for kernels/vision.cu: the vision tower's own kernels (position embeddings, LayerNorm with
//! the residual add before it, the qkv bias with the 2-D axial rotary, non-causal attention within an
//! image's frames and the biased activations). Every launch is over one image of grid (t, h, w) patches.

use cudarc::driver::CudaStream;

use super::{Kernels, invalid, launch, to_i32, to_u32};
use crate::error::CudaError;

/// Head dims the attention kernels take (even, at most this).
pub const MAX_HEAD_DIM: usize = 128;

/// The scale of V's f16 codes (`VIS_V_SCALE` in kernels/vision.cu): the attention multiplies V in f16
/// against P in f16, and v · 2⁻⁸ keeps f16's 11 significant bits for |v| in [2⁻⁶, 2²⁴).
pub const V_SCALE: f32 = 1.0 / 256.0;

/// The f16 code a value `v` of V has in the attention's qkv (bits of f16(v · [`V_SCALE`]), rounded to
/// nearest even), as [`qkv_rope`] writes it.
pub fn v_code(v: f32) -> u16 {
    half::f16::from_f32(v * V_SCALE).to_bits()
}

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

/// out `[rows, d]` bf16 = LayerNorm(x `[rows, d]` f32) with weight and bias `[d]` bf16; with `residual` =
/// (y, bias), the residual add before it in the same pass: x += y (`[rows, d]` f32) + bias (`[d]` bf16, 0:
/// none), stored. `vision_add_norm`: a warp a row, four rows a block, chunks of four values where every row
/// is aligned.
#[allow(clippy::too_many_arguments)]
pub fn layer_norm(
    k: &Kernels,
    s: &CudaStream,
    x: u64,
    residual: Option<(u64, u64)>,
    w: u64,
    b: u64,
    out: u64,
    rows: usize,
    d: usize,
    eps: f32,
) -> Result<(), CudaError> {
    const K: &str = "vision_add_norm";
    if rows == 0 {
        return Ok(());
    }
    if d == 0 {
        return Err(invalid(K, "d = 0"));
    }
    let (y, bias) = residual.unwrap_or((0, 0));
    let vec = chunks_of_four(d, &[x, y], &[bias, w, b, out]);
    let (n, dd) = (to_i32(K, "rows", rows)?, to_i32(K, "d", d)?);
    rows.checked_mul(d).ok_or_else(|| invalid(K, "rows × d overflows"))?;
    let blocks = (to_u32(K, "row blocks", rows.div_ceil(4))?, 1, 1);
    launch!(k, s, K, blocks, (128, 1, 1), 0; x, y, bias, w, b, out, n, dd, eps, vec)
}

/// qkv `[patches, 3·heads·hd]` = y (f32, the qkv GEMM's output) + bias (`[3·heads·hd]` bf16, 0: none): q
/// and k heads (bf16) rotated by the 2-D axial rotary of base `theta` at each patch's (row, column), v as
/// its f16 codes ([`v_code`], what [`attention`] reads).
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
    if heads == 0 || hd == 0 || !hd.is_multiple_of(4) || hd > MAX_HEAD_DIM {
        return Err(invalid(K, format!("{heads} heads of dim {hd} (a multiple of 4, at most {MAX_HEAD_DIM})")));
    }
    if !y.is_multiple_of(16) || !bias.is_multiple_of(8) || !qkv.is_multiple_of(8) {
        return Err(invalid(K, format!("y {y:#x} must be 16-byte, bias {bias:#x} and qkv {qkv:#x} 8-byte aligned")));
    }
    let n = grid.patches();
    let (nn, nh, d) = (to_i32(K, "patches", n)?, to_i32(K, "heads", heads)?, to_i32(K, "hd", hd)?);
    let blocks = (to_u32(K, "patch blocks", n.div_ceil(ROPE_ROWS))?, 1, 1);
    launch!(k, s, K, blocks, (256, 1, 1), 0; y, bias, qkv, nn, nh, d, gh, gw, merge, theta)
}

/// Patches a `vision_qkv_rope` block rotates (`VIS_ROPE_ROWS`).
const ROPE_ROWS: usize = 4;

/// o `[patches, heads·hd]` bf16 = softmax(q kᵀ / √hd) v per head, each patch attending to every patch of
/// its frame (`grid.h · grid.w` patches); q, k, v the thirds of qkv `[patches, 3·heads·hd]` (q and k bf16,
/// v as [`v_code`]s: what [`qkv_rope`] writes).
/// [`attention_frames`] over the image's `grid.t` frames.
pub fn attention(
    k: &Kernels,
    s: &CudaStream,
    qkv: u64,
    o: u64,
    heads: usize,
    hd: usize,
    grid: Grid,
) -> Result<(), CudaError> {
    grid.ints(ATTENTION)?;
    let frames = Frames::Uniform { len: grid.h * grid.w, count: grid.t };
    attention_frames(k, s, qkv, o, grid.patches(), heads, hd, frames)
}

/// Where the frames of an [`attention_frames`] launch lie among its rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Frames {
    /// `count` frames of `len` rows, one after the other (an image's `t` frames of `h·w` patches).
    Uniform { len: usize, count: usize },
    /// `count` frames of any lengths: frame z is rows `cu[z]..cu[z + 1]` of the device i32 offsets at
    /// `cu` (`count + 1` of them, non-decreasing, within the rows), the longest `max_len` rows.
    Packed { cu: u64, count: usize, max_len: usize },
}

/// The name the attention launchers' errors carry.
const ATTENTION: &str = "vision_attention";

/// The attention kernels (kernels/vision.cu `vision_attn_d*`): name, the head dims it computes (a
/// head dim runs on the first kernel that has at least as many; its dims past hd are zeros) and its
/// queries per block (`VaTile::QROWS`).
const ATTENTION_KERNELS: [(&str, usize, usize); 3] =
    [("vision_attn_d64", 64, 128), ("vision_attn_d72", 72, 128), ("vision_attn_d128", 128, 64)];

/// The attention kernel for head dim `hd` and its queries per block; an error unless `hd` is even and
/// at most [`MAX_HEAD_DIM`].
pub fn attention_kernel(hd: usize) -> Result<(&'static str, usize), CudaError> {
    match ATTENTION_KERNELS.iter().find(|&&(_, dims, _)| hd <= dims) {
        Some(&(name, _, rows)) if hd > 0 && hd.is_multiple_of(2) => Ok((name, rows)),
        _ => Err(invalid(ATTENTION, format!("head dim {hd}: the kernels take even head dims up to {MAX_HEAD_DIM}"))),
    }
}

/// o `[n, heads·hd]` bf16 = softmax(q kᵀ / √hd) v per head, each row attending to every row of its
/// frame (non-causal; rows outside every frame are left as they are); q, k, v the thirds of qkv
/// `[n, 3·heads·hd]` (q and k bf16, v as [`v_code`]s). Tensor cores (kernels/vision.cu `vision_attn_d*`):
/// hd even, at most [`MAX_HEAD_DIM`], qkv and o 4-byte aligned.
#[allow(clippy::too_many_arguments)]
pub fn attention_frames(
    k: &Kernels,
    s: &CudaStream,
    qkv: u64,
    o: u64,
    n: usize,
    heads: usize,
    hd: usize,
    frames: Frames,
) -> Result<(), CudaError> {
    const K: &str = ATTENTION;
    let (name, rows) = attention_kernel(hd)?;
    if heads == 0 {
        return Err(invalid(K, "no heads"));
    }
    if !qkv.is_multiple_of(4) || !o.is_multiple_of(4) {
        return Err(invalid(K, format!("qkv {qkv:#x} and o {o:#x} must be 4-byte aligned")));
    }
    let (cu, count, max_len, len) = match frames {
        Frames::Uniform { len, count } => {
            if count.checked_mul(len) != Some(n) {
                return Err(invalid(K, format!("{count} frames of {len} rows are not the {n} rows")));
            }
            (0u64, count, len, len)
        }
        Frames::Packed { cu, count, max_len } => (cu, count, max_len.min(n), 0),
    };
    if count == 0 || max_len == 0 {
        return Ok(());
    }
    let blocks =
        (to_u32(K, "query tiles", max_len.div_ceil(rows))?, to_u32(K, "heads", heads)?, to_u32(K, "frames", count)?);
    if blocks.1 > 65_535 || blocks.2 > 65_535 {
        return Err(invalid(K, format!("{heads} heads and {count} frames: at most 65,535 each")));
    }
    let (nn, nh, d, l) =
        (to_i32(K, "n", n)?, to_i32(K, "heads", heads)?, to_i32(K, "hd", hd)?, to_i32(K, "frame", len)?);
    let scale = 1.0 / (hd as f32).sqrt();
    // 16-byte copies where every head row is 16-byte aligned.
    let vec = (hd.is_multiple_of(8) && qkv.is_multiple_of(16)) as i32;
    launch!(k, s, name, blocks, (128, 1, 1), 0; qkv, o, cu, nn, nh, d, l, scale, vec)
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
    let (blocks, dd) = shape?;
    let vec = chunks_of_four(d, &[y], &[bias, out]);
    launch!(k, s, K, blocks, (ELEMENTWISE_THREADS as u32, 1, 1), 0; y, bias, out, dd, a, vec)
}

/// The kernels' `vec` flag: 1 where rows of `d` values take 16-byte loads of f32 and 8-byte loads of bf16
/// (`d` a multiple of 4, the f32 rows at `f32s` 16-byte and the bf16 rows at `bf16s` 8-byte aligned), else 0
/// (element loads).
fn chunks_of_four(d: usize, f32s: &[u64], bf16s: &[u64]) -> i32 {
    let aligned = |ps: &[u64], to: u64| ps.iter().all(|p| p.is_multiple_of(to));
    (d.is_multiple_of(4) && aligned(f32s, 16) && aligned(bf16s, 8)) as i32
}

/// Threads of an elementwise block (chunks of four columns of one row).
const ELEMENTWISE_THREADS: usize = 256;

/// The grid (a row per `x`, blocks of `4 · ELEMENTWISE_THREADS` columns in `y`) and width of an elementwise
/// launch over `[rows, d]` (None: nothing to do).
type Elementwise = ((u32, u32, u32), i32);

fn elementwise(kernel: &'static str, rows: usize, d: usize) -> Option<Result<Elementwise, CudaError>> {
    if rows == 0 || d == 0 {
        return None;
    }
    let shape = || -> Result<Elementwise, CudaError> {
        let cols = to_u32(kernel, "column blocks", d.div_ceil(4 * ELEMENTWISE_THREADS))?;
        if cols > 65_535 {
            return Err(invalid(kernel, format!("rows of {d}: at most {} columns", 65_535 * 4 * ELEMENTWISE_THREADS)));
        }
        rows.checked_mul(d).ok_or_else(|| invalid(kernel, "rows × d overflows"))?;
        Ok(((to_u32(kernel, "rows", rows)?, cols, 1), to_i32(kernel, "d", d)?))
    };
    Some(shape())
}

#[cfg(test)]
mod tests {
    use super::attention_kernel;

    /// Each even head dim up to 128 runs on the smallest kernel that computes at least as many dims;
    /// the others are refused.
    #[test]
    fn elementwise_launches_take_a_row_per_block_column() {
        use super::elementwise;
        assert_eq!(elementwise("k", 4096, 4304).unwrap().unwrap(), ((4096, 5, 1), 4304));
        assert_eq!(elementwise("k", 65_536, 1152).unwrap().unwrap(), ((65_536, 2, 1), 1152));
        assert!(elementwise("k", 0, 8).is_none() && elementwise("k", 8, 0).is_none());
        assert!(elementwise("k", 1, 65_536 * 1024).unwrap().is_err(), "too many column blocks");
    }

    #[test]
    fn chunks_of_four_need_a_width_of_fours_and_aligned_rows() {
        use super::chunks_of_four;
        assert_eq!(chunks_of_four(1152, &[0x100, 0], &[0x208, 0]), 1);
        assert_eq!(chunks_of_four(150, &[0x100], &[0x200]), 0, "width not a multiple of 4");
        assert_eq!(chunks_of_four(1152, &[0x108], &[0x200]), 0, "f32 rows 8-byte aligned only");
        assert_eq!(chunks_of_four(1152, &[0x100], &[0x204]), 0, "bf16 rows 4-byte aligned only");
    }

    #[test]
    fn attention_kernel_by_head_dim() {
        for (hd, name) in
            [(2, "vision_attn_d64"), (64, "vision_attn_d64"), (66, "vision_attn_d72"), (72, "vision_attn_d72")]
                .into_iter()
                .chain([(74, "vision_attn_d128"), (80, "vision_attn_d128"), (128, "vision_attn_d128")])
        {
            assert_eq!(attention_kernel(hd).map(|k| k.0).ok(), Some(name), "head dim {hd}");
        }
        for hd in [0, 1, 71, 129, 130, 256] {
            assert!(attention_kernel(hd).is_err(), "head dim {hd}");
        }
    }
}
