//! Launchers for kernels/gdn_chunk.cu: chunked (C = 64) Gated DeltaNet prefill over a varlen
//! batch on tensor cores, with a transient workspace proportional to the step's tokens.

use cudarc::driver::CudaStream;

use super::{Kernels, invalid, launch, to_i32, to_u32};
use crate::error::CudaError;
use crate::nvrtc::KernelDims;

/// Chunk length (fixed in the kernel).
pub const CHUNK: usize = deltaserve_plan::workspace::GDN_CHUNK;

/// Workspace bytes for `t` tokens (sized by the plan): w_hi, w_lo [hv,t,dk] bf16,
/// u [hv,t,dv] f32, P_hi, P_lo [hv,t,64] bf16, the decays (exp(G), exp(G_last − G)) [hv,t,2] f32
/// = 4 (dk + dv + 66) B per token and head (head-major: a chunk's rows of one head are contiguous).
pub fn workspace_bytes(t: usize, hv: usize, dims: &KernelDims) -> usize {
    deltaserve_plan::cuda::gdn_chunk_workspace_bytes(t, hv, dims.gdn_k_dim, dims.gdn_v_dim)
}

/// Largest key head dim the state kernel takes (h^T lives in registers).
pub const MAX_K_DIM: usize = 128;

pub(crate) fn prep_smem_bytes(d: &KernelDims) -> usize {
    // K [64][dk+8] bf16, Q [64][dk+8] bf16 then T [64][68] f32 in one region, V [64][dv+8] bf16,
    // A [64][68] f32, G/beta/scale [64] f32 (PREP_QT_BYTES in gdn_chunk.cu).
    let (k_tile, a_tile) = (2 * CHUNK * (d.gdn_k_dim + 8), 4 * CHUNK * (CHUNK + 4));
    k_tile + k_tile.max(a_tile) + 2 * CHUNK * (d.gdn_v_dim + 8) + a_tile + 4 * 3 * CHUNK
}

pub(crate) fn state_smem_bytes(d: &KernelDims) -> usize {
    // w_hi, w_lo, q, k [64][dk+8] bf16, P_hi, P_lo [64][72] bf16, decays [2][64] (f32, f32),
    // o [64][cols+8] bf16 (at most sm_86's 99 KB per block at dk = dv = 128).
    2 * (4 * CHUNK * (d.gdn_k_dim + 8) + 2 * CHUNK * (CHUNK + 8))
        + 8 * 2 * CHUNK
        + 2 * CHUNK * (state_block_cols(d) + 8)
}

/// Value columns per gdn_chunk_state block (16 per warp; 4 warps when dv/16 allows, else 2).
fn state_block_cols(d: &KernelDims) -> usize {
    if (d.gdn_v_dim / 16).is_multiple_of(4) { 64 } else { 32 }
}

/// Host-side chunk table: (sequence, chunk index) per 64-token chunk; upload as i32 pairs.
pub fn chunk_table(cu_seqlens: &[i32]) -> Vec<i32> {
    super::tile_table(cu_seqlens, CHUNK)
}

#[derive(Clone, Copy, Debug)]
pub struct GdnChunk {
    /// q, k [t, hk, dk] bf16 (from gdn_gate); v head h of token i at `v + i*v_stride + h*dv`.
    pub q: u64,
    pub k: u64,
    pub v: u64,
    pub v_stride: usize,
    /// [t, hv] f32.
    pub g: u64,
    pub beta: u64,
    /// [slots, hv, dk, dv] f32 (read at the start, written at the end of each sequence).
    pub state: u64,
    /// [n_seqs + 1] i32, [n_seqs] i32, and the chunk table [n_chunks, 2] i32.
    pub cu_seqlens: u64,
    pub slots: u64,
    pub chunk_table: u64,
    pub n_chunks: usize,
    /// [t, hv, dv] bf16.
    pub o: u64,
    /// At least [`workspace_bytes`]`(t, hv)` bytes, 256-aligned.
    pub workspace: u64,
    pub workspace_bytes: usize,
    pub n_seqs: usize,
    pub t: usize,
    pub hk: usize,
    pub hv: usize,
}

/// Operand precision of the tensor-core products.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Precision {
    /// Non-bf16 operands (state, T, w, P, v_new) split into hi + lo bf16: ~f32 accuracy (default).
    Split,
    /// Plain bf16 operands (as flash-linear-attention): fewer tensor-core instructions.
    Bf16,
}

/// Runs [`gdn_chunk_prep`] then [`gdn_chunk_state`] (stream ordered), [`Precision::Split`].
pub fn gdn_chunk(k: &Kernels, s: &CudaStream, a: &GdnChunk) -> Result<(), CudaError> {
    gdn_chunk_with(k, s, a, Precision::Split)
}

/// [`gdn_chunk`] with an explicit operand precision.
pub fn gdn_chunk_with(k: &Kernels, s: &CudaStream, a: &GdnChunk, p: Precision) -> Result<(), CudaError> {
    gdn_chunk_prep_with(k, s, a, p)?;
    gdn_chunk_state_with(k, s, a, p)
}

/// Workspace parts (w_hi, w_lo, u, P_hi, P_lo, G), each 256-aligned.
struct Parts {
    wh: u64,
    wl: u64,
    u: u64,
    ph: u64,
    pl: u64,
    g: u64,
}

fn workspace_parts(a: &GdnChunk, d: &KernelDims) -> Parts {
    let align = |b: usize| (b.div_ceil(256) * 256) as u64;
    let th = a.t * a.hv;
    let wh = a.workspace;
    let wl = wh + align(2 * th * d.gdn_k_dim);
    let u = wl + align(2 * th * d.gdn_k_dim);
    let ph = u + align(4 * th * d.gdn_v_dim);
    let pl = ph + align(2 * th * CHUNK);
    let g = pl + align(2 * th * CHUNK);
    Parts { wh, wl, u, ph, pl, g }
}

fn validate(k: &Kernels, a: &GdnChunk) -> Result<(), CudaError> {
    let d = k.dims;
    let need = workspace_bytes(a.t, a.hv, &d);
    if a.hk == 0 || !a.hv.is_multiple_of(a.hk) || a.v_stride < a.hv * d.gdn_v_dim || a.n_seqs == 0 {
        return Err(invalid("gdn_chunk_prep", format!("{a:?}")));
    }
    if d.gdn_k_dim > MAX_K_DIM {
        return Err(invalid("gdn_chunk_state", format!("key head dim {} > {MAX_K_DIM}", d.gdn_k_dim)));
    }
    // 16-byte vector loads / cp.async of q, k, v rows.
    if !(a.q | a.k | a.v).is_multiple_of(16) || !a.v_stride.is_multiple_of(8) {
        return Err(invalid(
            "gdn_chunk_prep",
            format!("q/k/v must be 16-byte aligned and v_stride a multiple of 8: {a:?}"),
        ));
    }
    if a.workspace_bytes < need || !a.workspace.is_multiple_of(256) {
        return Err(invalid(
            "gdn_chunk_prep",
            format!("workspace {} B at {:#x}; need {need} B, 256-aligned", a.workspace_bytes, a.workspace),
        ));
    }
    Ok(())
}

/// The parallel part: per (chunk, value head) G, P, T = (I + A)^-1, w, u into the workspace.
pub fn gdn_chunk_prep(k: &Kernels, s: &CudaStream, a: &GdnChunk) -> Result<(), CudaError> {
    gdn_chunk_prep_with(k, s, a, Precision::Split)
}

/// [`gdn_chunk_prep`] with an explicit operand precision.
pub fn gdn_chunk_prep_with(k: &Kernels, s: &CudaStream, a: &GdnChunk, p: Precision) -> Result<(), CudaError> {
    if a.t == 0 || a.n_chunks == 0 {
        return Ok(());
    }
    validate(k, a)?;
    let d = k.dims;
    let Parts { wh, wl, u, ph, pl, g: ws_g } = workspace_parts(a, &d);
    let GdnChunk { q, k: kp, v, g, beta, cu_seqlens, chunk_table, .. } = *a;
    let vs = a.v_stride as i64;
    let t = to_i32("gdn_chunk_prep", "t", a.t)?;
    let hk = to_i32("gdn_chunk_prep", "hk", a.hk)?;
    let hv = to_i32("gdn_chunk_prep", "hv", a.hv)?;
    let precise = i32::from(p == Precision::Split);
    let grid = (to_u32("gdn_chunk_prep", "n_chunks", a.n_chunks)?, to_u32("gdn_chunk_prep", "hv", a.hv)?, 1);
    let smem = prep_smem_bytes(&d) as u32;
    launch!(k, s, "gdn_chunk_prep", grid, (128, 1, 1), smem;
        q, kp, v, vs, g, beta, cu_seqlens, chunk_table, wh, wl, u, ph, pl, ws_g, t, hk, hv, precise)
}

/// The sequential part: per (sequence, value head, value slice) walk the chunks, update the state.
pub fn gdn_chunk_state(k: &Kernels, s: &CudaStream, a: &GdnChunk) -> Result<(), CudaError> {
    gdn_chunk_state_with(k, s, a, Precision::Split)
}

/// [`gdn_chunk_state`] with an explicit operand precision.
pub fn gdn_chunk_state_with(k: &Kernels, s: &CudaStream, a: &GdnChunk, p: Precision) -> Result<(), CudaError> {
    if a.t == 0 || a.n_chunks == 0 {
        return Ok(());
    }
    validate(k, a)?;
    let d = k.dims;
    let Parts { wh, wl, u, ph, pl, g: ws_g } = workspace_parts(a, &d);
    let GdnChunk { q, k: kp, state, cu_seqlens, slots, o, .. } = *a;
    let t = to_i32("gdn_chunk_state", "t", a.t)?;
    let hk = to_i32("gdn_chunk_state", "hk", a.hk)?;
    let hv = to_i32("gdn_chunk_state", "hv", a.hv)?;
    let name = match p {
        Precision::Split => "gdn_chunk_state",
        Precision::Bf16 => "gdn_chunk_state_bf16",
    };
    let cols = state_block_cols(&d);
    let grid = (
        to_u32("gdn_chunk_state", "n_seqs", a.n_seqs)?,
        to_u32("gdn_chunk_state", "hv", a.hv)?,
        (d.gdn_v_dim / cols) as u32,
    );
    let smem = state_smem_bytes(&d) as u32;
    launch!(k, s, name, grid, (2 * cols as u32, 1, 1), smem;
        q, kp, wh, wl, u, ph, pl, ws_g, state, o, cu_seqlens, slots, t, hk, hv)
}
