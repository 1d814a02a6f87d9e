//! Launcher for kernels/argmax.cu (greedy token selection on the device).

use cudarc::driver::CudaStream;

use super::{Kernels, invalid, launch_pdl, to_i32, to_u32};
use crate::error::CudaError;

/// `ids[r]` (i32) = the argmax of `x[r, ..valid]` (f32 rows at stride `ld` elements) for `rows` rows,
/// lowest index on ties, the host's `argmax` rule for NaNs.
pub fn argmax_rows(
    k: &Kernels,
    s: &CudaStream,
    x: u64,
    ld: usize,
    valid: usize,
    rows: usize,
    ids: u64,
) -> Result<(), CudaError> {
    if rows == 0 {
        return Ok(());
    }
    if valid == 0 || valid > ld {
        return Err(invalid("argmax_rows", format!("valid {valid} of rows of {ld}")));
    }
    let (ld, v) = (ld as i64, to_i32("argmax_rows", "valid", valid)?);
    launch_pdl!(k, s, "argmax_rows", (to_u32("argmax_rows", "rows", rows)?, 1, 1), (1024, 1, 1), 0; x, ld, v, ids)
}
