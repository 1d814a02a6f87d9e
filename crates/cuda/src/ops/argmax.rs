//! Launcher for kernels/argmax.cu (greedy token selection on the device).

use cudarc::driver::CudaStream;

use super::{Kernels, invalid, launch_pdl, to_i32, to_u32};
use crate::error::CudaError;

/// Ids per block of the split argmax (`argmax_part`; a multiple of 4: 16-byte loads).
pub const CHUNK: usize = 4096;

/// Scratch bytes of the split argmax over `rows` rows of `valid` ids (f32 values and i32 ids of each part).
pub fn scratch_bytes(rows: usize, valid: usize) -> usize {
    8 * rows * valid.div_ceil(CHUNK)
}

/// `ids[r]` (i32) = the argmax of `x[r, ..valid]` (f32 rows at stride `ld` elements) for `rows` rows,
/// lowest index on ties, the host's `argmax` rule for NaNs. With `scratch` (a pointer and its bytes, at
/// least [`scratch_bytes`], 4-byte aligned) rows longer than [`CHUNK`] are split over blocks
/// (`argmax_part`, then `argmax_merge`); otherwise one block a row (`argmax_rows`). The same ids either way.
#[allow(clippy::too_many_arguments)]
pub fn argmax_rows(
    k: &Kernels,
    s: &CudaStream,
    x: u64,
    ld: usize,
    valid: usize,
    rows: usize,
    ids: u64,
    scratch: Option<(u64, usize)>,
) -> Result<(), CudaError> {
    const K: &str = "argmax_rows";
    if rows == 0 {
        return Ok(());
    }
    if valid == 0 || valid > ld {
        return Err(invalid(K, format!("valid {valid} of rows of {ld}")));
    }
    let (ldi, v) = (ld as i64, to_i32(K, "valid", valid)?);
    let parts = valid.div_ceil(CHUNK);
    match scratch {
        Some((p, bytes)) if parts > 1 && bytes >= scratch_bytes(rows, valid) && p.is_multiple_of(4) => {
            let (pv, pi) = (p, p + (4 * rows * parts) as u64);
            let (chunk, np) = (CHUNK as i32, to_i32(K, "parts", parts)?);
            let grid = (parts as u32, to_u32(K, "rows", rows)?, 1);
            launch_pdl!(k, s, "argmax_part", grid, (256, 1, 1), 0; x, ldi, v, chunk, pv, pi)?;
            launch_pdl!(k, s, "argmax_merge", (rows as u32, 1, 1), (32, 1, 1), 0; x, ldi, pv, pi, np, ids)
        }
        _ => launch_pdl!(k, s, "argmax_rows", (to_u32(K, "rows", rows)?, 1, 1), (1024, 1, 1), 0; x, ldi, v, ids),
    }
}
