//! Snapshots taken inside a step's chunks ([`SeqChunk::save_within`]): the step's prefill sequences cut
//! at them (the chunked DeltaNet walks each cut sequence segment by segment, the slot's recurrent state
//! copied out between segments), the conv state of each cut computed from the step's rows, and, with
//! speculative decoding, the hidden row the head drafts from. A turn's new tokens then run in one step
//! however many message starts they cross.

use deltaserve_backend::{BackendError, SeqChunk, SnapshotLoc, StepBatch};
use deltaserve_plan::cuda::MAX_SNAPSHOTS_WITHIN_STEP;

use crate::error::CudaError;
use crate::ops::{conv, gdn_chunk, gdn_overlap};

use super::CudaBackend;
use super::cache_ops::Place;
use super::forward::b2;

/// One snapshot inside a prefill chunk of the step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct StepSave {
    /// The chunk's index in the step's order (among its prefill chunks, which come first).
    pub(super) seq: usize,
    /// Rows of the chunk before the snapshot point, and the step row of the last of them.
    pub(super) rows: usize,
    pub(super) row: usize,
    /// Which of the chunk's cuts it is: its state is the slot's after walk round `round`.
    pub(super) round: usize,
    pub(super) slot: u32,
    /// The device snapshot it goes to.
    pub(super) snap: u32,
}

/// The step's snapshots inside its chunks and where their tables sit in the `segments` scratch.
#[derive(Clone, Debug, Default)]
pub(super) struct StepSaves {
    pub(super) saves: Vec<StepSave>,
    /// The segments' boundaries and each round's slots, and the conv saves `[saves, 3]` (device).
    segments: Option<gdn_chunk::SegmentsOnDevice>,
    conv: u64,
}

/// The step's cuts on the host: the segments of its first `n_real` (prefill) chunks, their chunk
/// table, the saves, and the i32 image of the `segments` scratch.
pub(super) struct HostSaves {
    pub(super) saves: Vec<StepSave>,
    pub(super) segments: gdn_chunk::Segments,
    pub(super) table: Vec<i32>,
}

impl HostSaves {
    /// The snapshots inside the chunks `order[..n_real]` (`cu`, `slots`: the step's varlen arrays in
    /// that order); None when there are none.
    pub(super) fn new(batch: &StepBatch, order: &[usize], n_real: usize, cu: &[i32], slots: &[i32]) -> Option<Self> {
        let mut cuts: Vec<Vec<usize>> = vec![Vec::new(); n_real];
        let mut saves = Vec::new();
        for (r, &i) in order[..n_real].iter().enumerate() {
            let c = &batch.seqs[i];
            for &(p, loc) in &c.save_within {
                let SnapshotLoc::Device(snap) = loc else { continue }; // (check_saves refuses these)
                let rows = p - c.start;
                let row = cu[r] as usize + rows - 1;
                saves.push(StepSave { seq: r, rows, row, round: cuts[r].len(), slot: c.slot, snap });
                cuts[r].push(rows);
            }
        }
        if saves.is_empty() {
            return None;
        }
        let segments = gdn_chunk::Segments::new(&cu[..=n_real], &slots[..n_real], &cuts);
        let mut table = segments.cu.clone();
        table.extend_from_slice(&segments.slots);
        for s in &saves {
            table.extend([s.seq as i32, s.rows as i32, s.snap as i32]);
        }
        Some(HostSaves { saves, segments, table })
    }
}

impl CudaBackend {
    /// How many snapshots one step takes inside its chunks (`Capabilities::snapshots_within_chunks`):
    /// with [`crate::CudaOptions::snapshots_in_step`], as many as the plan's device snapshot slots
    /// and the segment tables hold; none under tensor parallelism.
    pub(super) fn snapshots_within_step(&self) -> usize {
        match self.opts.snapshots_in_step && self.tp.is_none() {
            true => self.saves_capacity(),
            false => 0,
        }
    }

    /// The most snapshots a step's chunks may carry: the plan's device snapshot slots, at most what the
    /// segment tables hold.
    fn saves_capacity(&self) -> usize {
        self.snapshot_slots.min(MAX_SNAPSHOTS_WITHIN_STEP)
    }

    /// Checks the step's snapshots inside chunks: strictly inside plain chunks and increasing, each to
    /// its own device snapshot, no more than the segment tables hold.
    pub(super) fn check_saves(&self, batch: &StepBatch) -> Result<(), BackendError> {
        let inv = |m: String| Err(BackendError::InvalidStep(m));
        let with: Vec<&SeqChunk> = batch.seqs.iter().filter(|c| !c.save_within.is_empty()).collect();
        let total: usize = with.iter().map(|c| c.save_within.len()).sum();
        if total > self.saves_capacity() {
            return inv(format!(
                "{total} snapshots inside the step's chunks: this backend takes {} a step",
                self.saves_capacity()
            ));
        }
        let mut seen = Vec::with_capacity(total);
        for c in with {
            if let Some(e) = c.bad_saves() {
                return inv(e);
            }
            for &(_, loc) in &c.save_within {
                let SnapshotLoc::Device(d) = loc else {
                    return inv(format!("seq {}: a snapshot inside a chunk goes to a device snapshot slot", c.seq_id));
                };
                self.snapshot_check(loc)?;
                if seen.contains(&d) {
                    return inv(format!("seq {}: device snapshot {d} written twice in one step", c.seq_id));
                }
                seen.push(d);
            }
        }
        Ok(())
    }

    /// Uploads the step's segment tables (`h`) and keeps its saves for the forward; clears them for a
    /// step without (`None`). Every step sets them before its forward (`upload_step`).
    pub(super) fn set_saves(&self, h: Option<&HostSaves>) -> Result<(), CudaError> {
        let mut cur = self.saves.borrow_mut();
        let Some(h) = h else {
            *cur = StepSaves::default();
            return Ok(());
        };
        let seg = &self.ws.segments;
        if 4 * h.table.len() > seg.bytes {
            return Err(CudaError::Plan(format!(
                "the segment tables of {} snapshots inside chunks exceed their scratch ({} B)",
                h.saves.len(),
                seg.bytes
            )));
        }
        self.upload_i32(seg.ptr, &h.table)?;
        let (n_segs, rounds) = (h.segments.n_segs(), h.segments.rounds());
        let slots = seg.ptr + 4 * (n_segs as u64 + 1);
        *cur = StepSaves {
            saves: h.saves.clone(),
            segments: Some(gdn_chunk::SegmentsOnDevice { cu: seg.ptr, slots, n_segs, rounds }),
            conv: slots + 4 * (rounds * n_segs) as u64,
        };
        Ok(())
    }

    /// The chunked DeltaNet over the step's prefill sequences `a` (the step's varlen arrays): as it is
    /// without snapshots inside them; else over their segments, walked round by round, each round's
    /// cut states copied from the slots to their snapshots (`snap_rec`: the layer's recurrent tensor
    /// in the snapshots region).
    pub(super) fn gdn_chunk_saving(&self, a: &gdn_chunk::GdnChunk, snap_rec: usize) -> Result<(), CudaError> {
        let (k, s) = (&self.k, self.rt.stream().as_ref());
        let rounds = self.rounds.borrow();
        if let (Some(ov), false) = (&self.overlap, rounds.is_empty()) {
            return gdn_overlap::gdn_chunk_overlapped(k, s, ov, a, &rounds, gdn_chunk::Precision::Split);
        }
        let sv = self.saves.borrow();
        let Some(seg) = sv.segments else { return gdn_chunk::gdn_chunk(k, s, a) };
        let len = self.rec_bytes;
        gdn_chunk::gdn_chunk_segments(k, s, a, seg, |r| {
            for save in sv.saves.iter().filter(|v| v.round == r) {
                let from = a.state + (save.slot as usize * len) as u64;
                let to = self.snapshots.ptr + (snap_rec + save.snap as usize * len) as u64;
                self.copy(Place::Dev(to), Place::Dev(from), len)?;
            }
            Ok(())
        })
    }

    /// The conv state of each snapshot inside the step's chunks (before the slots' update reads and
    /// overwrites the carried state); `snap_conv`: the layer's conv tensor in the snapshots region.
    pub(super) fn conv_saves(&self, cp: &conv::ConvPrefill, snap_conv: usize) -> Result<(), CudaError> {
        let sv = self.saves.borrow();
        if sv.saves.is_empty() {
            return Ok(());
        }
        let dst = self.snapshots.ptr + snap_conv as u64;
        conv::conv_state_save(&self.k, self.rt.stream().as_ref(), cp, sv.conv, sv.saves.len(), dst)
    }

    /// Speculative decoding: each snapshot's pending hidden row (the head drafts the token after the
    /// snapshot point from the hidden of the point's last row), from the final-normed rows `fin`.
    pub(super) fn pending_saves(&self, fin: u64, snap_pending: usize) -> Result<(), CudaError> {
        let h = self.d.hidden;
        for save in &self.saves.borrow().saves {
            let to = self.snapshots.ptr + (snap_pending + save.snap as usize * 2 * h) as u64;
            self.copy(Place::Dev(to), Place::Dev(fin + b2(save.row * h)), 2 * h)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use deltaserve_backend::{SeqChunk, SnapshotLoc, StepBatch};
    use deltaserve_plan::cuda::segment_table_bytes;

    use super::HostSaves;

    fn chunk(slot: u32, start: usize, len: usize, saves: &[(usize, u32)]) -> SeqChunk {
        SeqChunk {
            slot,
            start,
            tokens: vec![1; len],
            save_within: saves.iter().map(|&(p, d)| (p, SnapshotLoc::Device(d))).collect(),
            ..Default::default()
        }
    }

    /// The step's order puts chunk 2 first: its cuts are the first sequence's; a chunk resuming at 40
    /// cuts at rows from its start; the tables are the segments, the rounds' slots and the conv saves.
    #[test]
    fn a_steps_cuts_become_segments_rounds_and_conv_saves() {
        let batch = StepBatch {
            seqs: vec![chunk(5, 40, 30, &[(50, 1), (64, 0)]), chunk(6, 0, 1, &[]), chunk(7, 0, 10, &[(3, 2)])],
            ..Default::default()
        };
        // Order: chunk 2 (10 rows), chunk 0 (30 rows); the decode row last, not a prefill chunk.
        let (cu, slots) = ([0, 10, 40, 41], [7, 5, 6]);
        let h = HostSaves::new(&batch, &[2, 0, 1], 2, &cu, &slots).unwrap();
        assert_eq!(h.segments.cu, [0, 3, 10, 20, 34, 40]);
        assert_eq!(h.segments.slots, [7, -1, 5, -1, -1, -1, 7, -1, 5, -1, -1, -1, -1, -1, 5]);
        let rows: Vec<(usize, usize, usize, usize, u32)> =
            h.saves.iter().map(|s| (s.seq, s.rows, s.row, s.round, s.snap)).collect();
        assert_eq!(rows, [(0, 3, 2, 0, 2), (1, 10, 19, 0, 1), (1, 24, 33, 1, 0)]);
        let tail = [0, 3, 2, 1, 10, 1, 1, 24, 0];
        assert_eq!(h.table.len(), 6 + 15 + 9);
        assert_eq!(&h.table[21..], tail);
        assert!(4 * h.table.len() <= segment_table_bytes(3));
        // No snapshots inside: nothing to cut.
        let plain = StepBatch { seqs: vec![chunk(5, 0, 30, &[])], ..Default::default() };
        assert!(HostSaves::new(&plain, &[0], 1, &[0, 30], &[5]).is_none());
    }
}
