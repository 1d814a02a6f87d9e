//! Launchers for kernels/init.cu (deterministic random weights on the device; shared memory filled
//! with a pattern, for tests).

use cudarc::driver::CudaStream;

use super::{Kernels, launch};
use crate::error::CudaError;

/// Distribution of [`init_random`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Init {
    /// std · N(0, 1).
    Normal(f32),
    /// 1 + std · N(0, 1).
    OnePlusNormal(f32),
    /// ln U(1, 16) (`A_log`).
    LogUniform1To16,
    /// Uniformly random 32-bit words (packed int4 codes): `n` counts words, `f32_out` is ignored.
    Bits,
    /// std · (1 + 0.1 · N(0, 1)): positive, plausible int4 group scales (and fp8 block scales).
    Scale(f32),
    /// e4m3 codes of std · N(0, 1) (fp8 weights): `n` counts bytes, `f32_out` is ignored.
    Fp8Codes(f32),
}

/// Fills `n` elements at `out` (bf16, or f32 with `f32_out`; u32 words for [`Init::Bits`]) from
/// (seed, index).
pub fn init_random(
    k: &Kernels,
    s: &CudaStream,
    out: u64,
    n: usize,
    seed: u64,
    init: Init,
    f32_out: bool,
) -> Result<(), CudaError> {
    init_random_at(k, s, out, n, 0, seed, init, f32_out)
}

/// Elements `first .. first + n` of the tensor [`init_random`] fills from `seed`, at `out` (a slice of
/// a tensor made in pieces: the same values as made whole).
#[allow(clippy::too_many_arguments)]
pub fn init_random_at(
    k: &Kernels,
    s: &CudaStream,
    out: u64,
    n: usize,
    first: usize,
    seed: u64,
    init: Init,
    f32_out: bool,
) -> Result<(), CudaError> {
    if n == 0 {
        return Ok(());
    }
    let (std_, mode) = match init {
        Init::Normal(x) => (x, 0i32),
        Init::OnePlusNormal(x) => (x, 1),
        Init::LogUniform1To16 => (0.0f32, 2),
        Init::Bits => (0.0f32, 3),
        Init::Scale(x) => (x, 4),
        Init::Fp8Codes(x) => (x, 5),
    };
    let (nn, first) = (n as i64, first as i64);
    let is_f32 = f32_out as i32;
    let grid = (n.div_ceil(256).clamp(1, 16384) as u32, 1, 1);
    launch!(k, s, "init_random", grid, (256, 1, 1), 0; out, nn, first, seed, std_, mode, is_f32)
}

/// Fills the dynamic shared memory of `blocks` blocks of 256 threads, `bytes` each (at most the
/// device's opt-in limit, `Runtime::max_smem_optin`), with the 32-bit `pattern`: what the blocks of the
/// kernels launched after it find in shared memory they have not written (tests; `init_smem`).
pub fn fill_smem(k: &Kernels, s: &CudaStream, pattern: u32, blocks: usize, bytes: usize) -> Result<(), CudaError> {
    const K: &str = "init_smem";
    if blocks == 0 || bytes < 4 {
        return Ok(());
    }
    let words = super::to_i32(K, "words", bytes / 4)?;
    let smem = super::to_u32(K, "bytes", bytes)?;
    launch!(k, s, K, (super::to_u32(K, "blocks", blocks)?, 1, 1), (256, 1, 1), smem; pattern, words)
}
