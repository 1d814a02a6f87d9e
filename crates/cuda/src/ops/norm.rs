//! Launchers for kernels/norm.cu: residual-add + RMSNorm(1+w), strided RMSNorm(1+w) (q/k norms),
//! and the DeltaNet output's gated RMSNorm (plain w, silu(z)).

use cudarc::driver::CudaStream;

use super::{Kernels, invalid, launch, launch_pdl, to_i32, to_u32};
use crate::error::CudaError;

/// h = x + res (bf16; `res` None: h = x); `res_out` (may alias `res`) = h; out = rmsnorm_1p(h).
/// All [rows, d] bf16; w [d] bf16.
#[allow(clippy::too_many_arguments)]
pub fn add_rms_norm_1p(
    k: &Kernels,
    s: &CudaStream,
    x: u64,
    res: Option<u64>,
    w: u64,
    res_out: Option<u64>,
    out: u64,
    rows: usize,
    d: usize,
    eps: f32,
) -> Result<(), CudaError> {
    if rows == 0 {
        return Ok(());
    }
    if d == 0 {
        return Err(invalid("add_rms_norm_1p", "d = 0"));
    }
    let (res, res_out) = (res.unwrap_or(0), res_out.unwrap_or(0));
    let dd = to_i32("add_rms_norm_1p", "d", d)?;
    let grid = (to_u32("add_rms_norm_1p", "rows", rows)?, 1, 1);
    let v = add_norm_threads(d);
    if rows_path(rows, d, &[x, res, w, res_out, out]) {
        // The same bits with a quarter of the threads a row (`add_rms_norm_1p_rows`).
        let (vv, tq, none) = (v as i32, 0i32, 0u64);
        return launch_pdl!(k, s, "add_rms_norm_1p_rows", grid, (v / NORM_VT, 1, 1), 0;
            x, res, w, res_out, out, dd, eps, vv, tq, none, none);
    }
    launch_pdl!(k, s, "add_rms_norm_1p", grid, (v, 1, 1), 0; x, res, w, res_out, out, dd, eps)
}

/// Whether [`add_rms_norm_1p`] runs `add_rms_norm_1p_rows` for these rows and addresses.
fn rows_path(rows: usize, d: usize, ptrs: &[u64]) -> bool {
    let v = add_norm_threads(d);
    rows >= NORM_ROWS_MIN
        && d.is_multiple_of(8)
        && d <= 8 * v as usize
        && v.is_multiple_of(32 * NORM_VT)
        && ptrs.iter().all(|p| p.is_multiple_of(16))
}

/// Whether [`add_rms_norm_1p_quant`] takes these rows (the many-rows kernel's, `d` a multiple of 128) with
/// these addresses (`x`, `res`, `w`, `res_out`, `out`; 0 for none) and codes `q`, scales `xs`.
pub fn add_rms_norm_1p_quant_supported(rows: usize, d: usize, ptrs: &[u64], (q, xs): (u64, u64)) -> bool {
    d.is_multiple_of(128) && rows_path(rows, d, ptrs) && q.is_multiple_of(8) && xs.is_multiple_of(4)
}

/// [`add_rms_norm_1p`] (its tensors `(x, res, w, res_out, out)` as it takes them) whose first `tq` rows of out
/// are quantised for the FP8 GEMM instead of stored: codes `[tq, d]` at `q` and scales `[d/128, tq]` at `xs`,
/// exactly as [`super::fp8::act_quant`] would quantise the stored rows; the rows from `tq` are stored to `out`
/// as bf16. Where [`add_rms_norm_1p_quant_supported`].
pub fn add_rms_norm_1p_quant(
    k: &Kernels,
    s: &CudaStream,
    (x, res, w, res_out, out): (u64, Option<u64>, u64, Option<u64>, u64),
    (rows, d, eps): (usize, usize, f32),
    tq: usize,
    (q, xs): (u64, u64),
) -> Result<(), CudaError> {
    const NAME: &str = "add_rms_norm_1p_rows";
    let (res, res_out) = (res.unwrap_or(0), res_out.unwrap_or(0));
    if !add_rms_norm_1p_quant_supported(rows, d, &[x, res, w, res_out, out], (q, xs)) || tq > rows {
        return Err(invalid(
            NAME,
            format!(
                "quantised rows: {rows} rows of {d} (at least {NORM_ROWS_MIN}, d a multiple of 128), tq = {tq} at \
                 most the rows, rows 16-, q 8- and xs 4-byte aligned"
            ),
        ));
    }
    let v = add_norm_threads(d);
    let grid = (to_u32(NAME, "rows", rows)?, 1, 1);
    let (dd, vv, tqq) = (to_i32(NAME, "d", d)?, v as i32, to_i32(NAME, "tq", tq)?);
    launch_pdl!(k, s, NAME, grid, (v / NORM_VT, 1, 1), 0; x, res, w, res_out, out, dd, eps, vv, tqq, q, xs)
}

/// Rows from which [`add_rms_norm_1p`] runs `add_rms_norm_1p_rows` (four times the rows an SM holds at once;
/// fewer rows keep the wide block, whose rows finish sooner).
const NORM_ROWS_MIN: usize = 256;
/// Threads of `add_rms_norm_1p`'s block each thread of `add_rms_norm_1p_rows` plays (`NORM_VT`).
const NORM_VT: u32 = 4;

/// Whether [`add_rms_norm_1p_parts`] takes rows of `d` with these addresses: the kernel's vector path
/// (`d % 8 == 0`, at most 8 × 4 × 640, 16-byte aligned rows).
pub fn add_rms_norm_1p_parts_supported(d: usize, ptrs: &[u64]) -> bool {
    d > 0
        && d.is_multiple_of(8)
        && d <= 8 * 4 * add_norm_threads(d) as usize
        && ptrs.iter().all(|p| p.is_multiple_of(16))
}

/// Splits over K an [`add_rms_norm_1p_parts`] launch takes: the int4 GEMM's.
pub use deltaserve_plan::cuda::W4_GEMM_MAX_SPLITS as PARTS_MAX_SPLITS;

/// [`add_rms_norm_1p`] with x the bf16 rounding of the sum, in split order, of `splits` f32 partial-sum
/// arrays `parts [splits][rows][d]` (an int4 GEMM split over K; what `w4g_reduce` would write, bit
/// for bit, never stored), `res` updated in place: h = x + res; res = h; out = rmsnorm_1p(h).
#[allow(clippy::too_many_arguments)]
pub fn add_rms_norm_1p_parts(
    k: &Kernels,
    s: &CudaStream,
    parts: u64,
    splits: usize,
    res: u64,
    w: u64,
    out: u64,
    rows: usize,
    d: usize,
    eps: f32,
) -> Result<(), CudaError> {
    const K: &str = "add_rms_norm_1p_parts";
    if !add_rms_norm_1p_parts_supported(d, &[parts, res, w, out]) || !(1..=PARTS_MAX_SPLITS).contains(&splits) {
        return Err(invalid(
            K,
            format!(
                "d {d} (a multiple of 8, at most 20480), 16-byte aligned rows, {splits} splits (1..={PARTS_MAX_SPLITS})"
            ),
        ));
    }
    if rows == 0 {
        return Ok(());
    }
    let (dd, sp) = (to_i32(K, "d", d)?, splits as i32);
    let grid = (to_u32(K, "rows", rows)?, 1, 1);
    launch_pdl!(k, s, K, grid, (add_norm_threads(d), 1, 1), 0; parts, sp, res, w, res, out, dd, eps)
}

/// Threads of an add_rms_norm_1p block for rows of `d`: one per 16-byte vector of the row (all its
/// loads in one round trip), 256 to 640 (the kernel's 68 registers x 640 fit an SM). At the 27B's
/// 5,120: 640, which took the H200's batch-1 decode step from 6.28 to 6.20 ms
/// (bench/results/pdl-coherent-loads-h200-2026-11-30.md).
fn add_norm_threads(d: usize) -> u32 {
    (d.div_ceil(8).next_multiple_of(32)).clamp(256, 640) as u32
}

/// Row r of x at `x + r*x_stride`, of out at `out + r*out_stride` (elements), d wide;
/// out = x * rsqrt(mean x² + eps) * (1 + w). For q_norm on the [T, H, 2*hd] q|gate layout use
/// rows = T*H, x_stride = 2*hd, out_stride = hd.
#[allow(clippy::too_many_arguments)]
pub fn rms_norm_1p(
    k: &Kernels,
    s: &CudaStream,
    x: u64,
    x_stride: usize,
    w: u64,
    out: u64,
    out_stride: usize,
    rows: usize,
    d: usize,
    eps: f32,
) -> Result<(), CudaError> {
    if rows == 0 {
        return Ok(());
    }
    if d == 0 || x_stride < d || out_stride < d {
        return Err(invalid("rms_norm_1p", format!("d = {d}, x_stride = {x_stride}, out_stride = {out_stride}")));
    }
    let (xs, os) = (x_stride as i64, out_stride as i64);
    let dd = to_i32("rms_norm_1p", "d", d)?;
    let grid = (to_u32("rms_norm_1p", "rows", rows)?, 1, 1);
    launch!(k, s, "rms_norm_1p", grid, (256, 1, 1), 0; x, xs, w, out, os, dd, eps)
}

/// o [t*heads, d] bf16; z: head h of token t at `z + t*z_tok_stride + h*d`; w [d] f32;
/// out [t*heads, d] = w * rmsnorm(o) * silu(z). Heads of 128 with aligned rows take `gated_rms_norm128`
/// (16-byte loads, the same bits).
#[allow(clippy::too_many_arguments)]
pub fn gated_rms_norm(
    k: &Kernels,
    s: &CudaStream,
    o: u64,
    z: u64,
    z_tok_stride: usize,
    heads: usize,
    w: u64,
    out: u64,
    t: usize,
    d: usize,
    eps: f32,
) -> Result<(), CudaError> {
    gated(k, s, (o, z, z_tok_stride, heads, w), out, t, d, eps, None)
}

/// Whether [`gated_rms_norm_fp8`] takes these rows: heads of 128 features, o / z / out / w 16-byte aligned and
/// z's token stride a multiple of 8 elements.
pub fn gated_rms_norm128_supported(o: u64, z: u64, z_tok_stride: usize, w: u64, out: u64, d: usize) -> bool {
    d == 128 && [o, z, w, out].iter().all(|p| p.is_multiple_of(16)) && z_tok_stride.is_multiple_of(8)
}

/// [`gated_rms_norm`] (heads of 128: [`gated_rms_norm128_supported`]) with the rows of the first `tq`
/// tokens quantised for the FP8 GEMM as [`super::fp8::act_quant`] would quantise them (codes `[tq,
/// heads*128]` at `q`, scales `[heads, tq]` at `xs`) instead of stored; the rows from `tq` stored to `out`.
#[allow(clippy::too_many_arguments)]
pub fn gated_rms_norm_fp8(
    k: &Kernels,
    s: &CudaStream,
    (o, z, z_tok_stride, heads): (u64, u64, usize, usize),
    w: u64,
    out: u64,
    t: usize,
    eps: f32,
    tq: usize,
    (q, xs): (u64, u64),
) -> Result<(), CudaError> {
    if !gated_rms_norm128_supported(o, z, z_tok_stride, w, out, 128) || tq > t || !q.is_multiple_of(8) {
        return Err(invalid(
            "gated_rms_norm128",
            format!("the quantised norm needs aligned rows of 128 and tq = {tq} <= t = {t}"),
        ));
    }
    gated(k, s, (o, z, z_tok_stride, heads, w), out, t, 128, eps, Some((tq, q, xs)))
}

#[allow(clippy::too_many_arguments)]
fn gated(
    k: &Kernels,
    s: &CudaStream,
    (o, z, z_tok_stride, heads, w): (u64, u64, usize, usize, u64),
    out: u64,
    t: usize,
    d: usize,
    eps: f32,
    quant: Option<(usize, u64, u64)>,
) -> Result<(), CudaError> {
    if t == 0 {
        return Ok(());
    }
    if d == 0 || heads == 0 || z_tok_stride < heads * d {
        return Err(invalid("gated_rms_norm", format!("d = {d}, heads = {heads}, z_tok_stride = {z_tok_stride}")));
    }
    let zs = z_tok_stride as i64;
    let h = to_i32("gated_rms_norm", "heads", heads)?;
    let rows = to_i32("gated_rms_norm", "rows", t * heads)?;
    if gated_rms_norm128_supported(o, z, z_tok_stride, w, out, d) {
        let (tq, q, xs) = quant.unwrap_or((0, 0, 0));
        let tq = to_i32("gated_rms_norm128", "tq", tq)?;
        let grid = ((t * heads).div_ceil(16) as u32, 1, 1);
        return launch!(k, s, "gated_rms_norm128", grid, (256, 1, 1), 0; o, z, zs, h, w, out, rows, eps, tq, q, xs);
    }
    let dd = to_i32("gated_rms_norm", "d", d)?;
    let grid = ((t * heads).div_ceil(8) as u32, 1, 1);
    launch!(k, s, "gated_rms_norm", grid, (256, 1, 1), 0; o, z, zs, h, w, out, rows, dd, eps)
}

#[cfg(test)]
mod tests {
    use super::add_norm_threads;

    #[test]
    fn add_norm_blocks_take_a_thread_per_vector_within_bounds() {
        assert_eq!(add_norm_threads(5120), 640);
        assert_eq!(add_norm_threads(4096), 512);
        assert_eq!(add_norm_threads(2048), 256);
        assert_eq!(add_norm_threads(36), 256);
        assert_eq!(add_norm_threads(8200), 640);
    }
}
