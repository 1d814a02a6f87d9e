//! Launcher for kernels/argmax.cu (greedy token selection on the device).

use cudarc::driver::CudaStream;

use super::{Kernels, invalid, launch_pdl, to_i32, to_u32};
use crate::error::CudaError;

/// Elements of a row per block of the first launch (`AM_CHUNK` in argmax.cu).
const CHUNK: usize = 4096;

/// Bytes of scratch [`argmax_rows`] needs for `rows` rows of `valid` ids: each row's per-block
/// candidates.
pub fn scratch_bytes(rows: usize, valid: usize) -> usize {
    8 * rows * valid.div_ceil(CHUNK)
}

/// `ids[r]` (i32) = the argmax of `x[r, ..valid]` (f32 rows at stride `ld` elements) for `rows` rows,
/// lowest index on ties, the host's `argmax` rule for NaNs. Two launches: the row in blocks of
/// [`CHUNK`] ids, each block's best into `scratch` ([`scratch_bytes`]), then the best of those.
#[allow(clippy::too_many_arguments)]
pub fn argmax_rows(
    k: &Kernels,
    s: &CudaStream,
    x: u64,
    ld: usize,
    valid: usize,
    rows: usize,
    ids: u64,
    scratch: u64,
    scratch_len: usize,
) -> Result<(), CudaError> {
    const K: &str = "argmax_rows";
    if rows == 0 {
        return Ok(());
    }
    if valid == 0 || valid > ld {
        return Err(invalid(K, format!("valid {valid} of rows of {ld}")));
    }
    let need = scratch_bytes(rows, valid);
    if scratch_len < need || !scratch.is_multiple_of(8) {
        return Err(invalid(K, format!("scratch {scratch_len} B at {scratch:#x}; need {need} B, 8-byte aligned")));
    }
    let np = valid.div_ceil(CHUNK);
    let (ld, v, n) = (ld as i64, to_i32(K, "valid", valid)?, to_i32(K, "parts", np)?);
    let r = to_u32(K, "rows", rows)?;
    launch_pdl!(k, s, "argmax_part", (r, n as u32, 1), (256, 1, 1), 0; x, ld, v, n, scratch)?;
    launch_pdl!(k, s, "argmax_final", (r, 1, 1), (32, 1, 1), 0; x, ld, n, scratch, ids)
}
