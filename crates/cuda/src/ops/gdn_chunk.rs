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
    // Three regions, each two things in turn (PREP_*_BYTES in gdn_chunk.cu): K [64][dk+8] bf16 then the w / u
    // staging ([64][dk+8] bf16, [64][min(dv, 64)+4] f32); Q [64][dk+8] bf16 then T [64][68] f32; A [64][68] f32
    // then V [64][dv+8] bf16; then G/beta/scale [64] f32.
    let (k_tile, a_tile) = (2 * CHUNK * (d.gdn_k_dim + 8), 4 * CHUNK * (CHUNK + 4));
    let (v_tile, u_stage) = (2 * CHUNK * (d.gdn_v_dim + 8), 4 * CHUNK * (d.gdn_v_dim.min(64) + 4));
    k_tile.max(u_stage) + k_tile.max(a_tile) + a_tile.max(v_tile) + 4 * 3 * CHUNK
}

pub(crate) fn state_smem_bytes(d: &KernelDims) -> usize {
    // w_hi, w_lo, q, k [64][dk+8] bf16, P_hi, P_lo [64][72] bf16, decays [2][64] (f32, f32),
    // o [64][cols+8] bf16 (at most sm_86's 99 KB per block at dk = dv = 128).
    2 * (4 * CHUNK * (d.gdn_k_dim + 8) + 2 * CHUNK * (CHUNK + 8))
        + 8 * 2 * CHUNK
        + 2 * CHUNK * (state_block_cols(d) + 8)
}

/// Shared memory of gdn_chunk_state_ws (kernels/gdn_chunk_ws.cu): the exchange buffers X [2][warps][(dk + 64) / 16 * 2]
/// [32] uint4, the w hi, w lo tiles twice and the k and q tiles [64][dk+8] bf16, P hi, lo [64][72] bf16, the o tile
/// [64][cols+8] bf16, the decays [64] twice (f32, f32): 226 KB at dk = dv = 128 (sm_90's 227 KB a block; not
/// sm_80's 163).
pub fn ws_smem_bytes(d: &KernelDims) -> usize {
    let cols = state_block_cols(d);
    let exchange = 2 * (cols / 16) * ((d.gdn_k_dim + CHUNK) / 16) * 2 * 32 * 16;
    exchange + 6 * 2 * CHUNK * (d.gdn_k_dim + 8) + 2 * 2 * CHUNK * (CHUNK + 8) + 2 * CHUNK * (cols + 8) + 2 * 8 * CHUNK
}

/// How gdn_chunk_state walks the chunks ([`Precision::Split`]; [`Precision::Bf16`] always walks in one stream).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Walk {
    /// One instruction stream per 16 value columns computes the recurrence and the output
    /// (`gdn_chunk_state`, any GPU).
    OneStream,
    /// The output on warps of its own beside the recurrence's (`gdn_chunk_state_ws`, the same results bit for
    /// bit), where a block may have [`ws_smem_bytes`] of shared memory.
    OutputWarps,
}

impl Walk {
    /// The walk a GPU allowing `max_smem` bytes of shared memory per block runs by default (`one_stream`: the
    /// `DELTASERVE_GDN_WALK=one-stream` switch).
    pub fn choose(d: &KernelDims, max_smem: usize, one_stream: bool) -> Walk {
        if !one_stream && ws_smem_bytes(d) <= max_smem { Walk::OutputWarps } else { Walk::OneStream }
    }
}

/// Value columns per gdn_chunk_state block (16 per warp; 4 warps when dv/16 allows, else 2).
fn state_block_cols(d: &KernelDims) -> usize {
    if (d.gdn_v_dim / 16).is_multiple_of(4) { 64 } else { 32 }
}

/// Blocks of the walk a (sequence, value head) launches.
pub(crate) fn walk_column_blocks(d: &KernelDims) -> usize {
    d.gdn_v_dim / state_block_cols(d)
}

/// Host-side chunk table: (sequence, chunk index) per 64-token chunk; upload as i32 pairs.
pub fn chunk_table(cu_seqlens: &[i32]) -> Vec<i32> {
    super::tile_table(cu_seqlens, CHUNK)
}

/// A varlen batch cut at snapshots inside its sequences: each piece between two cuts (a segment) is
/// its own varlen entry, so chunks start at segment starts exactly as when each piece runs in a step
/// of its own. [`gdn_chunk_prep`] takes all segments at once (`cu`, and the chunk table of `cu`);
/// [`gdn_chunk_state`] walks them in rounds, one launch a round: round r walks the r-th segment of
/// every sequence (`round_slots(r)`: its slot there, −1 at every other entry), so between rounds the
/// slot holds the state at that round's cuts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Segments {
    /// `[n_segs + 1]` boundaries (flattened rows).
    pub cu: Vec<i32>,
    /// `[rounds, n_segs]` slots.
    pub slots: Vec<i32>,
}

impl Segments {
    /// `cu` `[n + 1]` and `slots` `[n]` of a varlen batch; `cuts[s]`: rows after sequence s's start at
    /// which to cut it, increasing and strictly inside it (missing entries: none).
    pub fn new(cu: &[i32], slots: &[i32], cuts: &[Vec<usize>]) -> Self {
        let n = slots.len();
        let mut seg_cu = vec![cu[0]];
        let mut owner = Vec::new(); // (slot, round) of each segment
        for s in 0..n {
            let c = cuts.get(s).map_or(&[][..], |c| &c[..]);
            for (r, &row) in c.iter().enumerate() {
                seg_cu.push(cu[s] + row as i32);
                owner.push((slots[s], r));
            }
            seg_cu.push(cu[s + 1]);
            owner.push((slots[s], c.len()));
        }
        let rounds = cuts.iter().map(Vec::len).max().unwrap_or(0) + 1;
        let mut seg_slots = vec![-1; rounds * owner.len()];
        for (j, &(slot, r)) in owner.iter().enumerate() {
            seg_slots[r * owner.len() + j] = slot;
        }
        Segments { cu: seg_cu, slots: seg_slots }
    }

    pub fn n_segs(&self) -> usize {
        self.cu.len() - 1
    }

    pub fn rounds(&self) -> usize {
        self.slots.len() / self.n_segs().max(1)
    }

    /// The slots of round `r`.
    pub fn round_slots(&self, r: usize) -> &[i32] {
        let n = self.n_segs();
        &self.slots[r * n..(r + 1) * n]
    }
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

/// [`Segments`] on the device: `cu` `[n_segs + 1]` and `slots` `[rounds, n_segs]` i32.
#[derive(Clone, Copy, Debug)]
pub struct SegmentsOnDevice {
    pub cu: u64,
    pub slots: u64,
    pub n_segs: usize,
    pub rounds: usize,
}

/// [`gdn_chunk`] over the batch of `a` cut into segments `seg` (`a.chunk_table` / `a.n_chunks`: the
/// chunk table of the segments; `a.cu_seqlens`, `a.slots`, `a.n_seqs` are not read): one prep over
/// every segment, then one walk a round; `after_round(r)` runs (stream ordered) once round r's states
/// are in the slots, i.e. each cut sequence's state at its r-th cut.
pub fn gdn_chunk_segments(
    k: &Kernels,
    s: &CudaStream,
    a: &GdnChunk,
    seg: SegmentsOnDevice,
    mut after_round: impl FnMut(usize) -> Result<(), CudaError>,
) -> Result<(), CudaError> {
    let all = GdnChunk { cu_seqlens: seg.cu, slots: seg.slots, n_seqs: seg.n_segs, ..*a };
    gdn_chunk_prep(k, s, &all)?;
    for r in 0..seg.rounds {
        gdn_chunk_state(k, s, &GdnChunk { slots: seg.slots + 4 * (r * seg.n_segs) as u64, ..all })?;
        after_round(r)?;
    }
    Ok(())
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

/// [`gdn_chunk_state`] with an explicit operand precision (the kernels' walk, [`Kernels::gdn_walk`]).
pub fn gdn_chunk_state_with(k: &Kernels, s: &CudaStream, a: &GdnChunk, p: Precision) -> Result<(), CudaError> {
    gdn_chunk_state_walk(k, s, a, p, k.gdn_walk)
}

/// [`gdn_chunk_state`] with an explicit precision and walk ([`Walk::OutputWarps`] only where the kernels
/// allow it: [`Kernels::gdn_walk`] is that walk).
pub fn gdn_chunk_state_walk(
    k: &Kernels,
    s: &CudaStream,
    a: &GdnChunk,
    p: Precision,
    walk: Walk,
) -> Result<(), CudaError> {
    let ws = p == Precision::Split && walk == Walk::OutputWarps;
    if ws && k.gdn_walk != Walk::OutputWarps {
        return Err(invalid(
            "gdn_chunk_state_ws",
            format!("needs {} B of shared memory a block, more than this GPU allows", ws_smem_bytes(&k.dims)),
        ));
    }
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
    let cols = state_block_cols(&d);
    // One warp a 16 columns, and in the warp-specialised walk one more for their output.
    let (name, threads, smem) = match (p, ws) {
        (_, true) => ("gdn_chunk_state_ws", 4 * cols, ws_smem_bytes(&d)),
        (Precision::Split, false) => ("gdn_chunk_state", 2 * cols, state_smem_bytes(&d)),
        (Precision::Bf16, false) => ("gdn_chunk_state_bf16", 2 * cols, state_smem_bytes(&d)),
    };
    let grid = (
        to_u32("gdn_chunk_state", "n_seqs", a.n_seqs)?,
        to_u32("gdn_chunk_state", "hv", a.hv)?,
        (d.gdn_v_dim / cols) as u32,
    );
    launch!(k, s, name, grid, (threads as u32, 1, 1), smem as u32;
        q, kp, wh, wl, u, ph, pl, ws_g, state, o, cu_seqlens, slots, t, hk, hv)
}

#[cfg(test)]
mod tests {
    use super::{Segments, Walk, ws_smem_bytes};
    use crate::nvrtc::KernelDims;

    #[test]
    fn the_output_warps_walk_where_a_block_has_the_shared_memory() {
        let d = KernelDims::QWEN35_27B;
        // 98,304 B of exchange buffers, 104,448 of w (twice), k and q tiles, 18,432 of P, 9,216 of o, 1,024 of
        // decays: 1 KB under sm_90's 232,448 a block.
        assert_eq!(ws_smem_bytes(&d), 231_424);
        // sm_90's 227 KB a block; sm_80's 163 KB and sm_86/89's 99 KB keep the one-stream walk.
        assert_eq!(Walk::choose(&d, 232_448, false), Walk::OutputWarps);
        assert_eq!(Walk::choose(&d, 232_448, true), Walk::OneStream);
        assert_eq!(Walk::choose(&d, 166_912, false), Walk::OneStream);
        assert_eq!(Walk::choose(&d, 101_376, false), Walk::OneStream);
        // Head dims 32 (2 + 2 warps a block) fit everywhere.
        let small = KernelDims { gdn_k_dim: 32, gdn_v_dim: 32, ..d };
        assert_eq!(Walk::choose(&small, 101_376, false), Walk::OutputWarps);
    }

    #[test]
    fn segments_cut_sequences_and_walk_them_in_rounds() {
        // Three sequences of 100, 5 and 70 rows, slots 4, 0 and 9; the first cut at 64 and 90, the
        // last at 3.
        let s = Segments::new(&[0, 100, 105, 175], &[4, 0, 9], &[vec![64, 90], vec![], vec![3]]);
        assert_eq!(s.cu, vec![0, 64, 90, 100, 105, 108, 175]);
        assert_eq!((s.n_segs(), s.rounds()), (6, 3));
        assert_eq!(s.round_slots(0), &[4, -1, -1, 0, 9, -1]);
        assert_eq!(s.round_slots(1), &[-1, 4, -1, -1, -1, 9]);
        assert_eq!(s.round_slots(2), &[-1, -1, 4, -1, -1, -1]);
        // No cuts: the batch as it is, one round.
        let plain = Segments::new(&[0, 7, 9], &[1, 2], &[]);
        assert_eq!((plain.cu, plain.slots), (vec![0, 7, 9], vec![1, 2]));
    }
}
