//! Launchers for kernels/gdn_chunk.cu: chunked (C = 64) Gated DeltaNet prefill over a varlen
//! batch, with a transient f32 workspace proportional to the step's tokens.

use cudarc::driver::CudaStream;

use super::{Kernels, invalid, launch, to_i32, to_u32};
use crate::error::CudaError;
use crate::nvrtc::KernelDims;

/// Chunk length (fixed in the kernel).
pub const CHUNK: usize = 64;

/// Workspace bytes for `t` tokens: w [t,hv,dk], u [t,hv,dv], P [t,hv,64], G [t,hv], all f32.
pub fn workspace_bytes(t: usize, hv: usize, dims: &KernelDims) -> usize {
    let per_tok_head = dims.gdn_k_dim + dims.gdn_v_dim + CHUNK + 1;
    // Each part starts 256-byte aligned.
    4 * t * hv * per_tok_head + 4 * 256
}

pub(crate) fn prep_smem_bytes(d: &KernelDims) -> usize {
    4 * (2 * CHUNK * (d.gdn_k_dim + 1) + CHUNK * CHUNK + 3 * CHUNK)
}

pub(crate) fn state_smem_bytes(d: &KernelDims) -> usize {
    4 * (d.gdn_k_dim * d.gdn_bv + CHUNK * (d.gdn_k_dim + 4) + CHUNK * CHUNK + CHUNK * (d.gdn_bv + 1) + 2 * CHUNK)
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

/// Runs [`gdn_chunk_prep`] then [`gdn_chunk_state`] (stream ordered).
pub fn gdn_chunk(k: &Kernels, s: &CudaStream, a: &GdnChunk) -> Result<(), CudaError> {
    gdn_chunk_prep(k, s, a)?;
    gdn_chunk_state(k, s, a)
}

/// Workspace pointers (w, u, P, G), each part 256-aligned.
fn workspace_parts(a: &GdnChunk, d: &KernelDims) -> (u64, u64, u64, u64) {
    let align = |b: usize| (b.div_ceil(256) * 256) as u64;
    let th = a.t * a.hv;
    let ws_w = a.workspace;
    let ws_u = ws_w + align(4 * th * d.gdn_k_dim);
    let ws_p = ws_u + align(4 * th * d.gdn_v_dim);
    let ws_g = ws_p + align(4 * th * CHUNK);
    (ws_w, ws_u, ws_p, ws_g)
}

fn validate(k: &Kernels, a: &GdnChunk) -> Result<(), CudaError> {
    let d = k.dims;
    let need = workspace_bytes(a.t, a.hv, &d);
    if a.hk == 0 || !a.hv.is_multiple_of(a.hk) || a.v_stride < a.hv * d.gdn_v_dim || a.n_seqs == 0 {
        return Err(invalid("gdn_chunk_prep", format!("{a:?}")));
    }
    if a.workspace_bytes < need || !a.workspace.is_multiple_of(256) {
        return Err(invalid(
            "gdn_chunk_prep",
            format!("workspace {} B at {:#x}; need {need} B, 256-aligned", a.workspace_bytes, a.workspace),
        ));
    }
    Ok(())
}

/// The parallel part: per (chunk, value head) G, A, P, w, u into the workspace.
pub fn gdn_chunk_prep(k: &Kernels, s: &CudaStream, a: &GdnChunk) -> Result<(), CudaError> {
    if a.t == 0 || a.n_chunks == 0 {
        return Ok(());
    }
    validate(k, a)?;
    let d = k.dims;
    let (ws_w, ws_u, ws_p, ws_g) = workspace_parts(a, &d);
    let GdnChunk { q, k: kp, v, g, beta, cu_seqlens, chunk_table, .. } = *a;
    let vs = a.v_stride as i64;
    let hk = to_i32("gdn_chunk_prep", "hk", a.hk)?;
    let hv = to_i32("gdn_chunk_prep", "hv", a.hv)?;
    let grid = (to_u32("gdn_chunk_prep", "n_chunks", a.n_chunks)?, to_u32("gdn_chunk_prep", "hv", a.hv)?, 1);
    let smem = prep_smem_bytes(&d) as u32;
    launch!(k, s, "gdn_chunk_prep", grid, (256, 1, 1), smem;
        q, kp, v, vs, g, beta, cu_seqlens, chunk_table, ws_w, ws_u, ws_p, ws_g, hk, hv)
}

/// The sequential part: per (sequence, value head, value slice) walk the chunks, update the state.
pub fn gdn_chunk_state(k: &Kernels, s: &CudaStream, a: &GdnChunk) -> Result<(), CudaError> {
    if a.t == 0 || a.n_chunks == 0 {
        return Ok(());
    }
    validate(k, a)?;
    let d = k.dims;
    let (ws_w, ws_u, ws_p, ws_g) = workspace_parts(a, &d);
    let GdnChunk { q, k: kp, state, cu_seqlens, slots, o, .. } = *a;
    let hk = to_i32("gdn_chunk_state", "hk", a.hk)?;
    let hv = to_i32("gdn_chunk_state", "hv", a.hv)?;
    let grid = (
        to_u32("gdn_chunk_state", "n_seqs", a.n_seqs)?,
        to_u32("gdn_chunk_state", "hv", a.hv)?,
        (d.gdn_v_dim / d.gdn_bv) as u32,
    );
    let smem = state_smem_bytes(&d) as u32;
    launch!(k, s, "gdn_chunk_state", grid, (256, 1, 1), smem;
        q, kp, ws_w, ws_u, ws_p, ws_g, state, o, cu_seqlens, slots, hk, hv)
}
