//! The chunked DeltaNet prefill ([`super::gdn_chunk`]) with each piece's walk running beside the next piece's
//! prep. The walk launches one block per (sequence, value head, 64 value columns) — 96 blocks for one 27B
//! prompt, on a GPU of 132 SMs — and each block takes most of an SM's shared memory, so while it runs a
//! third of the GPU is idle. Cut every sequence into pieces of [`piece_rows`] rows (at chunk boundaries,
//! so the chunks are the same ones), the walk of round r (every sequence's r-th piece) runs on a stream of
//! higher priority while round r + 1's prep fills the SMs the walk leaves: the same kernels, the same
//! results bit for bit where the state is f32 (a bf16 state would be rounded once more at each cut, so
//! that format keeps the single walk).

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaContext, CudaEvent, CudaStream};
use std::sync::Arc;

use super::Kernels;
use super::gdn_chunk::{self, CHUNK, GdnChunk, Precision};
use crate::error::CudaError;

/// Fewest rows a piece has: each round costs ~25 µs more than its kernels (27B, H100: pieces of 1,024 rows
/// took 1.21× pieces of 4,096 at 16K rows, slower than one walk).
pub const MIN_PIECE: usize = 2048;

/// Most rows a piece has: the first round's prep runs alone and each next round's only partly beside a walk,
/// so longer pieces leave more prep outside the overlap (27B, H100, two runs: pieces of 4,096 at 64K rows
/// 5.82–5.93 ms, of 8,192 5.90–5.92).
pub const MAX_PIECE: usize = 4096;

/// Rows a piece of a step of `rows` prefill rows has (0: run it as one piece): a quarter of the step, from
/// [`MIN_PIECE`] to [`MAX_PIECE`] rows, a multiple of the chunk (at 16K rows pieces of 4,096 took 1.508 ms,
/// of 2,048 1.591, of 8,192 1.538).
pub fn piece_rows(rows: usize) -> usize {
    if rows < 2 * MIN_PIECE {
        return 0;
    }
    (rows / 4).clamp(MIN_PIECE, MAX_PIECE) / CHUNK * CHUNK
}

/// Rows a piece has when `k` runs a step of `rows` prefill rows in `seqs` sequences of `hv` value heads (0: one
/// prep, one walk): [`piece_rows`] where the overlap is on ([`Kernels::gdn_overlap`]) and one round's walk leaves
/// at least an eighth of the SMs to the prep (one walk block an SM).
pub fn piece_for(k: &Kernels, rows: usize, seqs: usize, hv: usize) -> usize {
    let walk_blocks = seqs * hv * gdn_chunk::walk_column_blocks(&k.dims);
    match k.gdn_overlap && walk_blocks + k.sm_count / 8 <= k.sm_count {
        true => piece_rows(rows),
        false => 0,
    }
}

/// One round of [`Rounds`]: the r-th piece of every sequence that has one, as a varlen batch of its own
/// over the step's rows (`cu` `[n + 1]`, `slots` `[n]`: the rows between two pieces are entries of slot
/// −1, which the walk skips) and its chunk table `[n_chunks, 2]` (entry, chunk index in the entry).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Round {
    pub cu: Vec<i32>,
    pub slots: Vec<i32>,
    pub table: Vec<i32>,
}

/// A varlen batch cut every `piece` rows of each sequence, on the host, round by round.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rounds {
    pub rounds: Vec<Round>,
}

impl Rounds {
    /// `cu` `[n + 1]` and `slots` `[n]` of a varlen batch cut every `piece` rows of each sequence (rounded up
    /// to a positive multiple of the chunk).
    pub fn new(cu: &[i32], slots: &[i32], piece: usize) -> Self {
        let piece = piece.max(1).next_multiple_of(CHUNK);
        let longest = cu.windows(2).map(|w| (w[1] - w[0]).max(0) as usize).max().unwrap_or(0);
        let mut rounds = Vec::new();
        for r in 0..longest.div_ceil(piece) {
            let mut round = Round { cu: Vec::new(), slots: Vec::new(), table: Vec::new() };
            for (w, &slot) in cu.windows(2).zip(slots) {
                let start = w[0] as usize + r * piece;
                if start >= w[1] as usize {
                    continue;
                }
                let end = (start + piece).min(w[1] as usize);
                match round.cu.last() {
                    None => round.cu.push(start as i32),
                    Some(&last) if (last as usize) < start => {
                        round.cu.push(start as i32);
                        round.slots.push(-1);
                    }
                    Some(_) => {}
                }
                let entry = round.slots.len() as i32;
                round.cu.push(end as i32);
                round.slots.push(slot);
                round.table.extend((0..(end - start).div_ceil(CHUNK) as i32).flat_map(|c| [entry, c]));
            }
            rounds.push(round);
        }
        Rounds { rounds }
    }

    /// The length of [`Rounds::image`] (i32 values).
    pub fn image_len(&self) -> usize {
        self.rounds.iter().map(|r| r.cu.len() + r.slots.len() + r.table.len()).sum()
    }

    /// The i32 image uploaded for [`Rounds::on_device`]: each round's boundaries, slots and chunk table.
    pub fn image(&self) -> Vec<i32> {
        self.rounds.iter().flat_map(|r| r.cu.iter().chain(&r.slots).chain(&r.table)).copied().collect()
    }

    /// Each round's arrays where [`Rounds::image`] lies on the device at `ptr`.
    pub fn on_device(&self, ptr: u64) -> Vec<RoundOnDevice> {
        let mut at = ptr;
        let mut out = Vec::with_capacity(self.rounds.len());
        for r in &self.rounds {
            let (n, chunks) = (r.slots.len(), r.table.len() / 2);
            out.push(RoundOnDevice {
                cu: at,
                slots: at + 4 * (n as u64 + 1),
                table: at + 4 * (2 * n as u64 + 1),
                n,
                chunks,
            });
            at += 4 * (r.cu.len() + r.slots.len() + r.table.len()) as u64;
        }
        out
    }
}

/// A [`Round`] on the device: `n` entries, `chunks` chunks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RoundOnDevice {
    pub cu: u64,
    pub slots: u64,
    pub table: u64,
    pub n: usize,
    pub chunks: usize,
}

/// The stream the walks run on (the highest priority the device has) and the events that order it
/// against the caller's stream.
pub struct Overlap {
    walk: Arc<CudaStream>,
    fork: CudaEvent,
    prep: CudaEvent,
    join: CudaEvent,
}

impl Overlap {
    pub fn new(ctx: &Arc<CudaContext>) -> Result<Self, CudaError> {
        ctx.bind_to_thread().map_err(CudaError::driver("cuCtxSetCurrent"))?;
        let (_, greatest) = cudarc::driver::result::stream::get_priority_range()
            .map_err(CudaError::driver("cuCtxGetStreamPriorityRange"))?;
        let walk = ctx.new_stream_with_priority(greatest).map_err(CudaError::driver("cuStreamCreateWithPriority"))?;
        let ev =
            || ctx.new_event(Some(CUevent_flags::CU_EVENT_DISABLE_TIMING)).map_err(CudaError::driver("cuEventCreate"));
        Ok(Overlap { walk, fork: ev()?, prep: ev()?, join: ev()? })
    }
}

/// [`gdn_chunk::gdn_chunk_with`] over the batch of `a` in `rounds` (`a.cu_seqlens`, `a.slots`, `a.n_seqs`,
/// `a.chunk_table`, `a.n_chunks` are not read): round r's prep on `s`, its walk on the overlap's stream after it
/// and after round r − 1's walk, so that round r + 1's prep runs beside it; `s` goes on once the last walk is
/// done.
pub fn gdn_chunk_overlapped(
    k: &Kernels,
    s: &CudaStream,
    ov: &Overlap,
    a: &GdnChunk,
    rounds: &[RoundOnDevice],
    prec: Precision,
) -> Result<(), CudaError> {
    let rec = |e: &CudaEvent, st: &CudaStream| e.record(st).map_err(CudaError::driver("cuEventRecord"));
    let wait = |st: &CudaStream, e: &CudaEvent| st.wait(e).map_err(CudaError::driver("cuStreamWaitEvent"));
    rec(&ov.fork, s)?;
    wait(&ov.walk, &ov.fork)?;
    for r in rounds {
        let round =
            GdnChunk { cu_seqlens: r.cu, slots: r.slots, n_seqs: r.n, chunk_table: r.table, n_chunks: r.chunks, ..*a };
        gdn_chunk::gdn_chunk_prep_with(k, s, &round, prec)?;
        rec(&ov.prep, s)?;
        wait(&ov.walk, &ov.prep)?;
        gdn_chunk::gdn_chunk_state_with(k, &ov.walk, &round, prec)?;
    }
    rec(&ov.join, &ov.walk)?;
    wait(s, &ov.join)
}

#[cfg(test)]
mod tests {
    use super::{Rounds, piece_rows};

    #[test]
    fn pieces_cut_every_sequence_and_each_round_is_a_batch_of_its_own() {
        // Sequences of 200, 70 and 150 rows (slots 3, 5, 7), pieces of 128 rows.
        let r = Rounds::new(&[0, 200, 270, 420], &[3, 5, 7], 128);
        assert_eq!(r.rounds.len(), 2);
        assert_eq!(Rounds::new(&[0, 200, 270, 420], &[3, 5, 7], 100), r, "a piece rounds up to whole chunks");
        // Round 0: rows 0..128, 200..270, 270..398, contiguous but for the gap 128..200 (slot -1).
        let r0 = &r.rounds[0];
        assert_eq!((r0.cu.clone(), r0.slots.clone()), (vec![0, 128, 200, 270, 398], vec![3, -1, 5, 7]));
        assert_eq!(r0.table, vec![0, 0, 0, 1, 2, 0, 2, 1, 3, 0, 3, 1]);
        // Round 1: rows 128..200 and 398..420, the gap between them skipped.
        let r1 = &r.rounds[1];
        assert_eq!((r1.cu.clone(), r1.slots.clone()), (vec![128, 200, 398, 420], vec![3, -1, 7]));
        assert_eq!(r1.table, vec![0, 0, 0, 1, 2, 0]);
        let img = r.image();
        assert_eq!(img.len(), 5 + 4 + 12 + 4 + 3 + 6);
        assert_eq!(r.image_len(), img.len());
        let d = r.on_device(1000);
        assert_eq!((d[0].slots, d[0].table, d[0].n, d[0].chunks), (1020, 1036, 4, 6));
        assert_eq!((d[1].cu, d[1].slots, d[1].table, d[1].n, d[1].chunks), (1084, 1100, 1112, 3, 3));
        assert_eq!(img[(d[1].cu - 1000) as usize / 4], 128);
    }

    #[test]
    fn a_piece_is_a_quarter_of_the_step_within_bounds() {
        assert_eq!(piece_rows(4095), 0);
        assert_eq!(piece_rows(4096), 2048);
        assert_eq!(piece_rows(16384), 4096);
        assert_eq!(piece_rows(12000), 2944);
        assert_eq!(piece_rows(20000), 4096);
        assert_eq!(piece_rows(262_144), 4096);
    }
}
