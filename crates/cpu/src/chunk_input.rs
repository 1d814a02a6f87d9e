//! What a step chunk feeds the decoder on the paged backend: its input rows (token embeddings, with an
//! image's merged rows in place of its placeholders) and its rotary positions (M-RoPE (t, h, w) for a
//! chunk that holds image rows, else its index plus the sequence's rope delta).
//!
//! An image's tower runs in the step that first needs its rows; the rows are kept ([`ImageRows`]) until
//! a chunk takes the image's last row, so an image split across chunks runs the tower once. Keeping them
//! is only a saving: a sequence that leaves the batch mid-image (preempted, cancelled) loses them and
//! runs the tower again when it continues.

use std::collections::HashMap;
use std::collections::hash_map::Entry;

use deltaserve_backend::{SeqChunk, StepBatch};

use crate::model::{CpuModel, ForwardError, Positions};
use crate::vision::ImageError;

/// A chunk's input rows `[t, hidden]` and positions.
pub(crate) struct ChunkInput {
    pub x: Vec<f32>,
    pub pos: ChunkPositions,
}

/// The positions of a chunk's rows.
pub(crate) enum ChunkPositions {
    /// Row i at `first + i` in every stream (no image rows).
    Sequential(usize),
    /// One (t, h, w) per row (chunks with image rows).
    Mrope(Vec<[usize; 3]>),
}

impl ChunkPositions {
    pub fn get(&self) -> Positions<'_> {
        match self {
            Self::Sequential(first) => Positions::Sequential(*first),
            Self::Mrope(p) => Positions::Mrope(p),
        }
    }
}

/// Merged rows of images whose rows are not all consumed yet, by (sequence, index of the image's first
/// placeholder).
#[derive(Default)]
pub(crate) struct ImageRows {
    rows: HashMap<(u64, usize), Vec<f32>>,
}

impl ImageRows {
    /// The input of chunk `c` (its tokens only; drafts are fed by the speculative path).
    pub fn input(&mut self, model: &CpuModel, c: &SeqChunk) -> Result<ChunkInput, ForwardError> {
        let mut x = model.embed_checked(&c.tokens)?;
        if c.images.is_empty() {
            return Ok(ChunkInput { x, pos: ChunkPositions::Sequential(c.first_position()) });
        }
        if c.draft > 0 {
            return Err(ForwardError::Multimodal("a speculative chunk holds no image rows".into()));
        }
        let tower = model.vision_tower()?;
        let merge = tower.config.spatial_merge_size;
        let h = model.dims.hidden;
        let end = c.start + c.tokens.len();
        for (n, ci) in c.images.iter().enumerate() {
            let placed = ci.placed;
            if placed.seq_start >= end || placed.end() <= c.start {
                return Err(ForwardError::Multimodal(format!(
                    "image {n} (tokens {}..{}) is outside the chunk {}..{end}",
                    placed.seq_start,
                    placed.end(),
                    c.start
                )));
            }
            let key = (c.seq_id, placed.seq_start);
            let rows = match self.rows.entry(key) {
                Entry::Occupied(e) => e.into_mut(),
                Entry::Vacant(e) => {
                    tower.check(n, &ci.image)?;
                    if ci.image.tokens(merge) != placed.tokens() {
                        let reason =
                            format!("{} tokens placed for {} merged patches", placed.tokens(), ci.image.tokens(merge));
                        return Err(ImageError { index: n, reason }.into());
                    }
                    e.insert(tower.encode(&ci.image))
                }
            };
            let (lo, hi) = (placed.seq_start.max(c.start), placed.end().min(end));
            let dst = &mut x[(lo - c.start) * h..(hi - c.start) * h];
            dst.copy_from_slice(&rows[(lo - placed.seq_start) * h..(hi - placed.seq_start) * h]);
            if placed.end() <= end {
                self.rows.remove(&key);
            }
        }
        let pos = c.mrope_positions().map_or(ChunkPositions::Sequential(c.first_position()), ChunkPositions::Mrope);
        Ok(ChunkInput { x, pos })
    }

    /// Drops the rows of sequences that are not in `batch`.
    pub fn retain_batch(&mut self, batch: &StepBatch) {
        if !self.rows.is_empty() {
            self.rows.retain(|(seq, _), _| batch.seqs.iter().any(|c| c.seq_id == *seq));
        }
    }

    /// Images whose rows are kept.
    pub fn kept(&self) -> usize {
        self.rows.len()
    }
}
