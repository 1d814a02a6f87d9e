//! Launchers for kernels/conv.cu: causal depthwise conv1d + SiLU with carried state (prefill over a
//! varlen batch, then the state update; and the one-token decode update).

use cudarc::driver::CudaStream;

use super::{Kernels, invalid, launch, to_i32, to_u32};
use crate::error::CudaError;

/// Tokens per block of `conv_prefill` (CONV_TT in kernels/conv.cu).
const CONV_TOKENS_PER_BLOCK: usize = 16;
/// Tokens per block of `conv_prefill8` (`CONV_TT8`): 8 channels a thread, 16-byte rows.
const CONV8_TOKENS_PER_BLOCK: usize = 8;

/// Varlen conv for `t` flattened tokens of `n_seqs` sequences.
#[derive(Clone, Copy, Debug)]
pub struct ConvPrefill {
    /// [t, channels] bf16, token stride `x_stride` elements.
    pub x: u64,
    pub x_stride: usize,
    /// [channels, kernel] bf16.
    pub w: u64,
    /// [t, channels] bf16 contiguous.
    pub y: u64,
    /// [slots, kernel-1, channels] bf16; read, then updated to the last kernel-1 inputs.
    pub state: u64,
    /// [n_seqs + 1] i32 and [n_seqs] i32.
    pub cu_seqlens: u64,
    pub slots: u64,
    pub n_seqs: usize,
    pub t: usize,
    pub channels: usize,
}

/// Runs conv_prefill then conv_state_update (two launches, stream ordered: the state is read by
/// every token tile before it is overwritten).
pub fn conv_prefill(k: &Kernels, s: &CudaStream, a: &ConvPrefill) -> Result<(), CudaError> {
    conv_prefill_only(k, s, a)?;
    conv_state_update(k, s, a, a.n_seqs, 0)
}

/// conv_prefill alone: `y` from the carried state and `x`; the state is not touched (the verify pass
/// of speculative decoding).
pub fn conv_prefill_only(k: &Kernels, s: &CudaStream, a: &ConvPrefill) -> Result<(), CudaError> {
    if a.t == 0 {
        return Ok(());
    }
    if a.n_seqs == 0 || a.channels == 0 || a.x_stride < a.channels {
        return Err(invalid("conv_prefill", format!("{a:?}")));
    }
    let ConvPrefill { x, w, y, state, cu_seqlens, slots, .. } = *a;
    let xs = a.x_stride as i64;
    let b = to_i32("conv_prefill", "n_seqs", a.n_seqs)?;
    let c = to_i32("conv_prefill", "channels", a.channels)?;
    let t = to_i32("conv_prefill", "t", a.t)?;
    let vec8 = a.channels.is_multiple_of(8)
        && a.x_stride.is_multiple_of(8)
        && [x, w, y, state].iter().all(|p| p.is_multiple_of(16));
    if vec8 {
        let gx = to_u32("conv_prefill8", "channel blocks", a.channels.div_ceil(8 * 128))?;
        let gy = to_u32("conv_prefill8", "token tiles", a.t.div_ceil(CONV8_TOKENS_PER_BLOCK))?;
        return launch!(k, s, "conv_prefill8", (gx, gy, 1), (128, 1, 1), 0; x, xs, w, y, state, cu_seqlens, slots, b, c, t);
    }
    let gx = to_u32("conv_prefill", "channel blocks", a.channels.div_ceil(128))?;
    let gy = to_u32("conv_prefill", "token tiles", a.t.div_ceil(CONV_TOKENS_PER_BLOCK))?;
    launch!(k, s, "conv_prefill", (gx, gy, 1), (128, 1, 1), 0; x, xs, w, y, state, cu_seqlens, slots, b, c, t)
}

/// The state update of the first `n_seqs` sequences of `a`: state[slot] = the last kernel-1 rows of
/// (state ++ the sequence's rows), of only its first `lens[s]` rows when `lens` (an `[n_seqs]` i32
/// array) is not 0 (the accepted tokens of a speculative verify).
pub fn conv_state_update(
    k: &Kernels,
    s: &CudaStream,
    a: &ConvPrefill,
    n_seqs: usize,
    lens: u64,
) -> Result<(), CudaError> {
    if a.t == 0 || n_seqs == 0 {
        return Ok(());
    }
    if n_seqs > a.n_seqs || a.channels == 0 || a.x_stride < a.channels {
        return Err(invalid("conv_state_update", format!("{n_seqs} sequences of {a:?}")));
    }
    let ConvPrefill { x, state, cu_seqlens, slots, .. } = *a;
    let xs = a.x_stride as i64;
    let c = to_i32("conv_state_update", "channels", a.channels)?;
    let gx = to_u32("conv_state_update", "channel blocks", a.channels.div_ceil(128))?;
    let gy = to_u32("conv_state_update", "n_seqs", n_seqs)?;
    launch!(k, s, "conv_state_update", (gx, gy, 1), (128, 1, 1), 0; x, xs, state, cu_seqlens, slots, lens, c)
}

/// Snapshots inside the sequences of `a`, before [`conv_state_update`] (it reads the carried state):
/// `saves` is an `[n_saves, 3]` i32 array of (sequence index, rows r, snapshot d), and snapshot d of
/// `dst` (`[snapshots, kernel-1, channels]` bf16, as the state) becomes the last kernel-1 rows of
/// (state ++ the sequence's first r rows).
pub fn conv_state_save(
    k: &Kernels,
    s: &CudaStream,
    a: &ConvPrefill,
    saves: u64,
    n_saves: usize,
    dst: u64,
) -> Result<(), CudaError> {
    if n_saves == 0 {
        return Ok(());
    }
    if a.channels == 0 || a.x_stride < a.channels {
        return Err(invalid("conv_state_save", format!("{n_saves} saves of {a:?}")));
    }
    let ConvPrefill { x, state, cu_seqlens, slots, .. } = *a;
    let xs = a.x_stride as i64;
    let c = to_i32("conv_state_save", "channels", a.channels)?;
    let gx = to_u32("conv_state_save", "channel blocks", a.channels.div_ceil(128))?;
    let gy = to_u32("conv_state_save", "n_saves", n_saves)?;
    launch!(k, s, "conv_state_save", (gx, gy, 1), (128, 1, 1), 0; x, xs, state, cu_seqlens, slots, saves, dst, c)
}

/// One token per sequence: x [n_seqs, channels] (stride x_stride), y [n_seqs, channels],
/// state[slots[b]] shifted in place.
#[allow(clippy::too_many_arguments)]
pub fn conv_decode(
    k: &Kernels,
    s: &CudaStream,
    x: u64,
    x_stride: usize,
    w: u64,
    y: u64,
    state: u64,
    slots: u64,
    n_seqs: usize,
    channels: usize,
) -> Result<(), CudaError> {
    if n_seqs == 0 {
        return Ok(());
    }
    if channels == 0 || x_stride < channels {
        return Err(invalid("conv_decode", format!("channels = {channels}, x_stride = {x_stride}")));
    }
    let xs = x_stride as i64;
    let c = to_i32("conv_decode", "channels", channels)?;
    let grid =
        (to_u32("conv_decode", "channel blocks", channels.div_ceil(128))?, to_u32("conv_decode", "n_seqs", n_seqs)?, 1);
    launch!(k, s, "conv_decode", grid, (128, 1, 1), 0; x, xs, w, y, state, slots, c)
}
