//! Launcher for kernels/embed.cu (embedding gather).

use cudarc::driver::CudaStream;

use super::{Kernels, invalid, launch_pdl, to_i32, to_u32};
use crate::error::CudaError;

/// `out[t] = table[ids[t]]`; table [vocab, d] bf16, ids [t] i32 (must be < vocab), out [t, d] bf16.
pub fn embed_gather(
    k: &Kernels,
    s: &CudaStream,
    table: u64,
    ids: u64,
    out: u64,
    t: usize,
    d: usize,
) -> Result<(), CudaError> {
    if t == 0 {
        return Ok(());
    }
    if d == 0 {
        return Err(invalid("embed_gather", "d = 0"));
    }
    let dd = to_i32("embed_gather", "d", d)?;
    launch_pdl!(k, s, "embed_gather", (to_u32("embed_gather", "t", t)?, 1, 1), (256, 1, 1), 0; table, ids, out, dd)
}
