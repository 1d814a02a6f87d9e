//! Launchers for kernels/mtp.cu: the row moves of the MTP head (speculative decoding).

use cudarc::driver::CudaStream;

use super::{Kernels, invalid, launch, to_i32, to_u32};
use crate::error::CudaError;

/// `y[r]` = `pending[slots[s]]` for the first row of sequence s, else `x[r − 1]` (zeros for slot < 0):
/// each row's "hidden of the previous position". x, y `[t, d]`; pending `[slots, d]`; `cu_seqlens`
/// `[n_seqs + 1]`, `slots` `[n_seqs]` i32. bf16, bit exact.
#[allow(clippy::too_many_arguments)]
pub fn shift_rows(
    k: &Kernels,
    s: &CudaStream,
    x: u64,
    pending: u64,
    cu_seqlens: u64,
    slots: u64,
    n_seqs: usize,
    y: u64,
    t: usize,
    d: usize,
) -> Result<(), CudaError> {
    if t == 0 {
        return Ok(());
    }
    if d == 0 || n_seqs == 0 {
        return Err(invalid("shift_rows", format!("d = {d}, n_seqs = {n_seqs}")));
    }
    let b = to_i32("shift_rows", "n_seqs", n_seqs)?;
    let dd = to_i32("shift_rows", "d", d)?;
    launch!(k, s, "shift_rows", (to_u32("shift_rows", "t", t)?, 1, 1), (256, 1, 1), 0; x, pending, cu_seqlens, slots, b, y, dd)
}

/// `dst[dst_rows[i]] = src[rows[i]]` for `i < n` (`rows`, `dst_rows` `[n]` i32; negative: skipped).
#[allow(clippy::too_many_arguments)]
pub fn scatter_rows(
    k: &Kernels,
    s: &CudaStream,
    src: u64,
    rows: u64,
    dst: u64,
    dst_rows: u64,
    n: usize,
    d: usize,
) -> Result<(), CudaError> {
    if n == 0 {
        return Ok(());
    }
    if d == 0 {
        return Err(invalid("scatter_rows", "d = 0"));
    }
    let dd = to_i32("scatter_rows", "d", d)?;
    launch!(k, s, "scatter_rows", (to_u32("scatter_rows", "n", n)?, 1, 1), (256, 1, 1), 0; src, rows, dst, dst_rows, dd)
}
