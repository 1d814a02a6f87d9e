//! Where a step's prompt chunks reach snapshot points: the snapshots after the step (a chunk ending at
//! a point) and inside it (a backend that takes them there, as many a step as it takes), each a
//! prefix-cache entry with its device or host snapshot.

use deltaserve_backend::{CacheOp, SeqChunk, SnapshotLoc};

use super::{Scheduler, SeqId, StepPlan};
use crate::prefix::cache_key;

impl Scheduler {
    /// The snapshots of `plan`'s chunks: `SaveState` after the step for a chunk ending at a point, a
    /// `save_within` entry for a point inside one.
    pub(super) fn place_snapshots(&mut self, plan: &mut StepPlan) {
        // Snapshot points a chunk reaches (prompt positions only: speculative chunks never hold one):
        // at its end the state is saved after the step; inside it (backends that take them), during
        // the step, into device slots made free before it — never one another of this step's.
        let spans: Vec<(usize, SeqId, usize, usize)> = (plan.batch.seqs.iter().enumerate())
            .filter(|(_, c)| c.draft == 0)
            .map(|(i, c)| (i, c.seq_id, c.start, c.start + c.tokens.len()))
            .collect();
        let mut written: Vec<u32> = Vec::new();
        let mut within = 0;
        for (i, id, start, end) in spans {
            let s = &self.seqs[&id];
            let points: Vec<usize> = s.snapshot_points.iter().copied().filter(|&p| p > start && p <= end).collect();
            for p in points {
                let mut ops = Vec::new();
                if p == end {
                    self.snapshot(id, end, &mut ops);
                    plan.batch.post.extend(ops);
                } else if within == self.within_limit {
                    // (chunk_len keeps a step within the limit; a chunk past it goes without)
                } else if let Some(loc) = self.cache_prefix(id, p, &written, &mut ops) {
                    within += 1;
                    if let SnapshotLoc::Device(d) = loc {
                        written.push(d);
                    }
                    plan.batch.pre.extend(ops);
                    plan.batch.seqs[i].save_within.push((p, loc));
                }
            }
        }
    }

    /// Snapshots `id`'s state at `end` (its cached length once the step ran) into the prefix cache.
    pub(super) fn snapshot(&mut self, id: SeqId, end: usize, ops: &mut Vec<CacheOp>) {
        if let Some(loc) = self.cache_prefix(id, end, &[], ops) {
            let slot = self.seqs[&id].slot.expect("running");
            ops.push(CacheOp::SaveState { slot, to: loc });
        }
    }

    /// Registers `id`'s first `end` tokens in the prefix cache with a device snapshot slot for its state
    /// at `end` (none of `spare`), which the caller fills; `ops` makes the slot free. None: the cache is
    /// off, the prefix is cached already, or no slot could be had.
    fn cache_prefix(&mut self, id: SeqId, end: usize, spare: &[u32], ops: &mut Vec<CacheOp>) -> Option<SnapshotLoc> {
        let s = &self.seqs[&id];
        let tokens = cache_key(&s.tokens[..end], &s.media).into_owned();
        if !self.prefix.enabled() || self.prefix.contains(&tokens) {
            return None;
        }
        let mut released = Vec::new();
        let loc = self.prefix.alloc_device_sparing(ops, &mut released, spare);
        self.pages.give_back(released);
        let loc = loc?;
        let pages: Vec<u32> = self.seqs[&id].pages[..self.pages.pages_for(end)].to_vec();
        for &p in &pages {
            self.pages.retain(p);
        }
        self.prefix.insert(tokens, pages, loc);
        Some(loc)
    }

    /// Counts the snapshot points strictly inside plain chunk `c` against the step's room for them.
    pub(super) fn take_within_room(&mut self, c: &SeqChunk) {
        let (start, end) = (c.start, c.start + c.tokens.len());
        let inside = self.seqs[&c.seq_id].snapshot_points.iter().filter(|&&p| p > start && p < end);
        self.within_room = self.within_room.saturating_sub(inside.count());
    }
}
