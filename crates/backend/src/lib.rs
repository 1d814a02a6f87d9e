//! deltaserve-backend: the contract between the engine and a compute backend (CPU reference, CUDA).
//!
//! A backend owns the device memory of the static plan (weights, KV pages, DeltaNet state slots,
//! activation workspace) and executes one engine step at a time: a [`StepBatch`] of sequence chunks,
//! each naming its state slot, its KV pages and its new tokens, between two lists of cache ops
//! ([`CacheOp`]: prefix-cache page copies and state snapshots). Backends never see requests, text or
//! HTTP; the scheduler never sees memory contents. Everything here is plain data.
//!
//! The contract ([`Backend`]) is small:
//! - [`Backend::capabilities`]: what the backend is and can do ([`Capabilities`]: its name, the width
//!   of its logit rows, whether it launches steps ahead, how many tokens it drafts). The engine reads
//!   them once at start and never asks for what they exclude.
//! - [`Backend::step`]: runs a batch; a [`Want`] says what each wanted row returns into the caller's
//!   [`StepOut`] (reused from step to step): its logits, its token picked where the logits are (the
//!   argmax, or the draw of its [`RowSampling`]), or, for batches with speculative chunks, the drafts
//!   and their verify logits. A backend whose rows come to the host serves every [`Want`] through
//!   [`host::host_step`].
//! - [`Backend::launch`] / [`Backend::collect`]: look-ahead (see [`ahead`]), a step started before the
//!   previous step's tokens are read, fed them where they are.
//! - [`Backend::commit_speculative`]: speculative decoding (MTP). A chunk with `draft > 0` asks the
//!   backend to draft that many tokens with the model's MTP head and verify them in one forward
//!   ([`Want::Drafts`]); the engine then accepts a prefix and tells the backend how many positions to
//!   keep. Until the commit the sequence's DeltaNet state is the one before the verify: a rejected
//!   draft leaves no trace.
//! - [`Backend::arena_stats`]: the memory arena's counters.
//! - [`Backend::image_tokens`]: whether the model runs images. A chunk of a sequence with images carries
//!   the images whose placeholder rows it holds ([`ChunkImage`]) and the sequence's rope delta; the
//!   backend runs the vision tower for an image in the step that first needs its rows and puts the merged
//!   rows in place of the placeholders' embeddings, every position rotated at its M-RoPE (t, h, w)
//!   position ([`SeqChunk::mrope_positions`]).

pub mod ahead;
pub mod host;
pub mod host_memory;
pub mod sampling;

use std::sync::Arc;

pub use ahead::{Feed, Pick, Picked};
pub use deltaserve_model::ImagePatches;
pub use deltaserve_model::mrope::PlacedImage;
pub use sampling::{Penalty, RowSampling};

/// How a model's prompts hold images: each image fills a run of `image_token_id` placeholders, one per
/// `merge × merge` window of its patches, and its patch rows are `patch_len` values wide.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ImageTokens {
    pub image_token_id: u32,
    pub merge: usize,
    pub patch_len: usize,
}

/// An image some of whose placeholder rows fall in a chunk.
#[derive(Clone, Debug)]
pub struct ChunkImage {
    pub image: Arc<ImagePatches>,
    /// Where it sits in the sequence (its first placeholder's index, its rotary origin, its merged grid).
    pub placed: PlacedImage,
}

impl PartialEq for ChunkImage {
    fn eq(&self, other: &Self) -> bool {
        self.placed == other.placed
            && (Arc::ptr_eq(&self.image, &other.image)
                || (self.image.hash == other.image.hash && self.image.grid_thw == other.image.grid_thw))
    }
}

impl Eq for ChunkImage {}

/// One sequence's part of a step: `tokens` at positions `start..start + tokens.len()`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SeqChunk {
    /// The engine's id of the sequence (for error messages only).
    pub seq_id: u64,
    /// DeltaNet state slot (recurrent + conv state of every DeltaNet layer).
    pub slot: u32,
    /// KV pages of this sequence, in position order; covers at least `start + tokens.len()` positions.
    pub pages: Vec<u32>,
    /// Tokens already in the KV cache and folded into the slot's state.
    pub start: usize,
    pub tokens: Vec<u32>,
    /// Return the logits of the last token of this chunk.
    pub want_logits: bool,
    /// Return the logits of every token of this chunk, in position order, instead of the last one's
    /// only (prompt log-probabilities: row i is the distribution of the token after position
    /// `start + i`). A plain chunk only, and only where [`Capabilities::prompt_logits`]; its rows count
    /// against [`Capabilities::max_logits_rows`].
    pub all_logits: bool,
    /// Speculative decoding: after `tokens` (exactly one, the sequence's next token), draft this many
    /// tokens with the MTP head and verify all `1 + draft` positions in one forward; the pages cover
    /// `start + 1 + draft` positions. 0: a plain chunk. Only steps that want [`Want::Drafts`] take such chunks.
    pub draft: usize,
    /// Speculative chunks of greedy requests: n > 0 makes every draft the [`argmax`] of the draft head's
    /// logits over ids `< n`, which the backend may pick where the logits are instead of calling the
    /// [`DraftPicker`] (0: the picker picks).
    pub greedy_draft_vocab: usize,
    /// M-RoPE of a sequence with images: a text position `p` before the chunk's first image (and every
    /// position of a chunk without images, drafts included) rotates at `p + rope_delta` in all three
    /// streams (HF's rope delta, ≤ 0; 0 for text-only sequences).
    pub rope_delta: i64,
    /// The images whose placeholder rows fall in this chunk, in order (the first may have begun in an
    /// earlier chunk, the last may end in a later one). Text after one continues from its
    /// [`PlacedImage::delta_after`].
    pub images: Vec<ChunkImage>,
    /// Snapshots taken inside the chunk (backends with [`Capabilities::snapshots_within_chunks`] > 0):
    /// `(p, loc)` with `start < p < start + tokens.len()`, increasing — the slot's state after
    /// position `p - 1` is copied to `loc`, as a [`CacheOp::SaveState`] after a chunk ending at `p`
    /// would. A plain chunk only (no drafts).
    pub save_within: Vec<(usize, SnapshotLoc)>,
}

impl SeqChunk {
    /// Why the chunk's [`SeqChunk::save_within`] points are not strictly inside it and increasing, on a
    /// plain chunk (None: they are).
    pub fn bad_saves(&self) -> Option<String> {
        let end = self.start + self.tokens.len();
        let mut last = self.start;
        for &(p, _) in &self.save_within {
            if self.draft > 0 {
                return Some(format!("seq {}: a speculative chunk takes no snapshots inside it", self.seq_id));
            }
            if p <= last || p >= end {
                return Some(format!(
                    "seq {}: snapshot points {:?} must increase strictly inside the chunk {}..{end}",
                    self.seq_id,
                    self.save_within.iter().map(|s| s.0).collect::<Vec<_>>(),
                    self.start
                ));
            }
            last = p;
        }
        None
    }

    /// The chunk cut at its [`SeqChunk::save_within`] points: consecutive pieces, each with the
    /// snapshot to take after it (the last: none), each carrying the images whose rows it holds and the
    /// rope delta of its first text position. Running the pieces in order, saving after each, is the
    /// chunk with its snapshots; only the last piece wants logits (if the chunk does).
    pub fn pieces(&self) -> Vec<(SeqChunk, Option<SnapshotLoc>)> {
        let end = self.start + self.tokens.len();
        let mut cuts: Vec<(usize, Option<SnapshotLoc>)> = self.save_within.iter().map(|&(p, l)| (p, Some(l))).collect();
        cuts.push((end, None));
        let mut from = self.start;
        let mut out = Vec::with_capacity(cuts.len());
        for (to, loc) in cuts {
            let images: Vec<ChunkImage> =
                self.images.iter().filter(|i| i.placed.seq_start < to && i.placed.end() > from).cloned().collect();
            let before = self.images.iter().rfind(|i| i.placed.end() <= from);
            let piece = SeqChunk {
                start: from,
                tokens: self.tokens[from - self.start..to - self.start].to_vec(),
                want_logits: self.want_logits && to == end,
                all_logits: self.all_logits,
                rope_delta: before.map_or(self.rope_delta, |i| i.placed.delta_after()),
                images,
                save_within: Vec::new(),
                ..self.clone()
            };
            out.push((piece, loc));
            from = to;
        }
        out
    }

    /// Positions this chunk runs through the model (its tokens plus its drafts).
    pub fn positions(&self) -> usize {
        self.tokens.len() + self.draft
    }

    /// The logits rows a step returns for this chunk where its rows come back as logits: every
    /// verified position of a speculative chunk, every position of an [`SeqChunk::all_logits`] chunk,
    /// else the last one's when it wants them.
    pub fn logits_rows(&self) -> usize {
        if self.draft > 0 {
            1 + self.draft
        } else if self.all_logits {
            self.tokens.len()
        } else {
            usize::from(self.want_logits)
        }
    }

    /// The (t, h, w) positions of this chunk's positions when it holds image rows (None: position `p`
    /// rotates at `p + rope_delta` in every stream).
    pub fn mrope_positions(&self) -> Option<Vec<[usize; 3]>> {
        if self.images.is_empty() {
            return None;
        }
        let placed: Vec<PlacedImage> = self.images.iter().map(|i| i.placed).collect();
        Some(deltaserve_model::mrope::positions(self.start, self.positions(), self.rope_delta, &placed))
    }

    /// The rotary position of the chunk's first position when it holds no image rows.
    pub fn first_position(&self) -> usize {
        (self.start as i64 + self.rope_delta).max(0) as usize
    }

    /// Draft `i` of this chunk from the draft head's logits `row`: the greedy pick, or `pick`'s.
    pub fn pick_draft(&self, pick: &mut DraftPicker<'_>, i: usize, row: &[f32]) -> u32 {
        match self.greedy_draft_vocab {
            0 => pick(self.seq_id, i, row),
            n => argmax(&row[..n.min(row.len())]),
        }
    }
}

/// Where a DeltaNet state snapshot (recurrent + conv state of every DeltaNet layer) is kept.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SnapshotLoc {
    /// A slot of the plan's device snapshot pool.
    Device(u32),
    /// A slot of the pinned host pool (`--snapshot-host-memory`).
    Host(u32),
}

/// Cache maintenance a step performs around its chunks (prefix cache and state snapshots).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CacheOp {
    /// Copy a state slot into a snapshot.
    SaveState { slot: u32, to: SnapshotLoc },
    /// Copy a snapshot into a state slot (the sequence then continues from the snapshot's position).
    RestoreState { from: SnapshotLoc, slot: u32 },
    /// Move a snapshot between tiers (device ↔ host).
    MoveSnapshot { from: SnapshotLoc, to: SnapshotLoc },
    /// Copy the first `tokens` positions of KV page `src` into page `dst` (every attention layer):
    /// a shared, partly filled page becomes a private page the sequence can append to.
    CopyPagePrefix { src: u32, dst: u32, tokens: u32 },
    /// Copy state slot `src` into slot `dst`: a sequence forks (several choices of one prompt).
    CopyState { src: u32, dst: u32 },
}

/// One engine step: `pre` ops, then chunks of distinct sequences (at most `max_batch_tokens`
/// tokens in all), then `post` ops; each list runs in order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StepBatch {
    pub pre: Vec<CacheOp>,
    pub seqs: Vec<SeqChunk>,
    pub post: Vec<CacheOp>,
}

impl StepBatch {
    /// Positions run through the model (drafted positions included).
    pub fn num_tokens(&self) -> usize {
        self.seqs.iter().map(SeqChunk::positions).sum()
    }
    pub fn num_logits(&self) -> usize {
        self.seqs.iter().filter(|s| s.want_logits).count()
    }
}

/// What a backend's memory arena has done since it was created.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ArenaStats {
    /// Backend-memory allocations made (regions carved at start-up); must not change while serving.
    pub allocations: u64,
    /// Highest number of bytes in use at once.
    pub high_water_bytes: u64,
    /// Bytes reserved at start-up.
    pub capacity_bytes: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error("invalid step: {0}")]
    InvalidStep(String),
    #[error("backend failure: {0}")]
    Device(String),
    #[error("not supported by this backend: {0}")]
    Unsupported(String),
}

/// Picks draft token `index` (0-based) of sequence `seq_id` from the draft head's logits row
/// ([`Capabilities::vocab_size`] wide): the engine's greedy or sampling choice. Called in draft order
/// per sequence.
pub type DraftPicker<'a> = dyn FnMut(u64, usize, &[f32]) -> u32 + 'a;

/// What the engine keeps of a verified chunk: `accepted` positions (1..=1 + draft) from its `start`,
/// i.e. its token and the first `accepted - 1` drafts, which the engine accepted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SpecCommit {
    pub seq_id: u64,
    pub slot: u32,
    /// The chunk's pages (covering at least `start + accepted` positions).
    pub pages: Vec<u32>,
    pub start: usize,
    pub accepted: usize,
}

/// What a backend is and can do, stated once: the engine reads it at start and never asks for what it
/// excludes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Capabilities {
    /// Short name for logs (`cpu`, `cuda:0`).
    pub name: String,
    /// Logit rows are this wide.
    pub vocab_size: usize,
    /// Whether [`Backend::launch`] and [`Backend::collect`] work (look-ahead).
    pub launches_ahead: bool,
    /// The most draft tokens one chunk may carry (0: no speculative decoding: no step wants
    /// [`Want::Drafts`] of a batch with drafts, and nothing is committed).
    pub max_draft_tokens: usize,
    /// Whether picks ([`Want::Tokens`], [`Backend::launch`]) apply a row's token mask
    /// ([`RowSampling::allowed`]). Without it, the engine samples constrained rows on the host.
    pub masks_tokens: bool,
    /// Whether the engine may launch steps with their picks left for later ([`Pick::Later`],
    /// [`Backend::pick_launched`]): with token masks, constrained requests then run ahead.
    pub picks_after_launch: bool,
    /// How many snapshots one step may take inside its chunks ([`SeqChunk::save_within`], all
    /// chunks together). 0: none; the scheduler ends chunks at snapshot points.
    pub snapshots_within_chunks: usize,
    /// Whether a chunk may ask for every row's logits ([`SeqChunk::all_logits`], prompt
    /// log-probabilities).
    pub prompt_logits: bool,
    /// The most logits rows one step returns, all chunks together ([`SeqChunk::logits_rows`]).
    pub max_logits_rows: usize,
}

/// What a step returns for each chunk that wants its logits (a wanted row), in batch order.
pub enum Want<'a> {
    /// Its logits row, appended to [`StepOut::logits`].
    Logits,
    /// Its token, picked over ids `< valid` where the logits are (the [`argmax`], or the draw of the
    /// matching [`RowSampling`]: one per wanted row), appended to [`StepOut::tokens`]. A device
    /// backend picks on the device and downloads 4 bytes a row instead of the row.
    Tokens { valid: usize, pick: Pick<'a> },
    /// As [`Want::Logits`], and chunks with `draft > 0` are speculative: the backend drafts `draft`
    /// tokens with the MTP head (calling the picker for each, in order), runs the main model over the
    /// chunk's token and the drafts, appends `1 + draft` logit rows for the chunk (row i predicts the
    /// token after position `start + i`) and pushes its drafts to [`StepOut::drafts`] (one entry per
    /// speculative chunk, in batch order). The chunk's DeltaNet state is left as it was before the step
    /// until [`Backend::commit_speculative`]; KV written beyond the committed length is ignored later.
    Drafts(&'a mut DraftPicker<'a>),
    /// As [`Want::Drafts`] for a step whose every wanted row is a plain greedy pick: instead of the
    /// logits rows, the backend appends each row's [`argmax`] over ids `< valid` to
    /// [`StepOut::tokens`] (`1 + draft` per speculative chunk, one per other wanted row, in batch order).
    /// A device backend picks on the device and downloads 4 bytes a row instead of the row.
    DraftsArgmax { valid: usize, pick: &'a mut DraftPicker<'a> },
}

/// A step's outputs (see [`Want`]). A step appends to them; the caller keeps one and clears it before
/// each step, so its buffers are reused (no allocation per step once they have grown).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StepOut {
    /// Rows of [`Capabilities::vocab_size`] logits.
    pub logits: Vec<f32>,
    /// Picked tokens, one per wanted row.
    pub tokens: Vec<u32>,
    /// The drafts of each speculative chunk.
    pub drafts: Vec<Vec<u32>>,
}

impl StepOut {
    /// Empties every output, keeping the buffers.
    pub fn clear(&mut self) {
        self.logits.clear();
        self.tokens.clear();
        self.drafts.clear();
    }
}

/// Index of the largest value, the lowest index on ties; NaNs are never larger (a NaN at index 0
/// keeps index 0). The greedy rule of the engine and of device argmax kernels.
pub fn argmax(x: &[f32]) -> u32 {
    let mut best = 0;
    for (i, v) in x.iter().enumerate() {
        if *v > x[best] {
            best = i;
        }
    }
    best as u32
}

/// Checks `batch`'s chunks that want every row's logits ([`SeqChunk::all_logits`]) against what the
/// backend can do: plain chunks only, where it takes them, and within its logits rows.
pub fn check_logits_rows(batch: &StepBatch, caps: &Capabilities) -> Result<(), BackendError> {
    let mut all = batch.seqs.iter().filter(|c| c.all_logits).peekable();
    if all.peek().is_none() {
        return Ok(());
    }
    if !caps.prompt_logits {
        return Err(BackendError::InvalidStep(format!("{} returns no logits of every prompt row", caps.name)));
    }
    if let Some(c) = all.find(|c| c.draft > 0) {
        return Err(BackendError::InvalidStep(format!(
            "seq {}: a speculative chunk wants every row's logits",
            c.seq_id
        )));
    }
    let rows: usize = batch.seqs.iter().map(SeqChunk::logits_rows).sum();
    if rows > caps.max_logits_rows {
        return Err(BackendError::InvalidStep(format!(
            "the step wants {rows} logits rows; this backend returns at most {}",
            caps.max_logits_rows
        )));
    }
    Ok(())
}

/// Checks that `rows` holds one entry per wanted row of `batch` (for [`Pick::Sample`]).
pub fn check_sample_rows(batch: &StepBatch, rows: &[RowSampling]) -> Result<(), BackendError> {
    check_row_count(rows.len(), batch.seqs.iter().filter(|c| c.want_logits).count())
}

/// `given` sampling rows for `want` wanted rows: one each.
pub(crate) fn check_row_count(given: usize, want: usize) -> Result<(), BackendError> {
    if given != want {
        return Err(BackendError::InvalidStep(format!("{given} sampling rows for {want} rows that want a token")));
    }
    Ok(())
}

/// Runs `batch` on `be` for its wanted rows' logits alone, appended to `logits` (tools and tests that
/// keep their rows in a plain buffer).
pub fn step_logits<B: Backend + ?Sized>(
    be: &mut B,
    batch: &StepBatch,
    logits: &mut Vec<f32>,
) -> Result<(), BackendError> {
    let mut out = StepOut { logits: std::mem::take(logits), ..StepOut::default() };
    let r = be.step(batch, Want::Logits, &mut out);
    *logits = out.logits;
    r
}

/// A compute backend executing engine steps over the memory of the static plan.
pub trait Backend: Send {
    /// What this backend is and can do.
    fn capabilities(&self) -> Capabilities;

    /// How prompts hold images when the loaded model runs them (a vision tower the backend runs); None:
    /// requests that carry images are refused.
    fn image_tokens(&self) -> Option<ImageTokens> {
        None
    }

    /// Whether the loaded model runs images ([`Backend::image_tokens`]).
    fn runs_images(&self) -> bool {
        self.image_tokens().is_some()
    }

    /// Runs `batch`: its `pre` ops, its chunks, its `post` ops, and appends to `out` what `want` asks
    /// of each wanted row, in batch order. A chunk with `start == 0` begins from a zeroed state slot.
    /// Chunks with `draft > 0` only come with [`Want::Drafts`].
    fn step(&mut self, batch: &StepBatch, want: Want<'_>, out: &mut StepOut) -> Result<(), BackendError>;

    /// Starts `batch` and may return before it has run: like [`Backend::step`] with [`Want::Tokens`],
    /// its picks come back from [`Backend::collect`], in launch order. With a `feed` its chunks take
    /// their tokens from the picks of the step launched just before it, which need not be collected yet
    /// (see [`Feed`]). At most two launched steps are uncollected at once. After an error no launched
    /// step remains. Only where [`Capabilities::launches_ahead`].
    fn launch(
        &mut self,
        batch: &StepBatch,
        valid: usize,
        pick: Pick<'_>,
        feed: Option<&Feed>,
    ) -> Result<(), BackendError>;

    /// Makes the picks of the step launched last with [`Pick::Later`] (`pick` as [`Backend::launch`]
    /// takes it, never `Later` again). Until then no further step is launched (the steps launched
    /// before it may be collected) and that step is not collected; the step after it may be fed from
    /// these picks. After an error no launched step remains. Only where [`Capabilities::launches_ahead`].
    fn pick_launched(&mut self, pick: Pick<'_>) -> Result<(), BackendError>;

    /// Waits for the oldest launched step that is not collected yet and appends its picks to `out`.
    /// After an error no launched step remains. Only where [`Capabilities::launches_ahead`].
    fn collect(&mut self, out: &mut Picked) -> Result<(), BackendError>;

    /// Keeps the accepted positions of the speculative chunks of the last step ([`Want::Drafts`]): the
    /// DeltaNet state advances by exactly those positions (as if they had been decoded one by one) and
    /// the MTP head's cache catches up. Must be called after that step, before the next, for every
    /// speculative chunk whose sequence continues (or is snapshotted). Only where
    /// [`Capabilities::max_draft_tokens`] is positive; a commit without its verified chunk is an
    /// invalid step.
    fn commit_speculative(&mut self, commits: &[SpecCommit]) -> Result<(), BackendError>;

    /// The arena's counters (tests assert they do not move while serving).
    fn arena_stats(&self) -> ArenaStats;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_cut_a_chunk_at_its_snapshots_with_their_images_and_positions() {
        // Tokens 10..30; an image of 6 rows at 12..18 (merged grid 1 × 2 × 3); snapshots after 15 and 22.
        let placed = PlacedImage::new(12, 12, [1, 4, 6], 2).unwrap();
        let image = Arc::new(ImagePatches { grid_thw: [1, 4, 6], pixels: Vec::new(), hash: [7; 32] });
        let c = SeqChunk {
            seq_id: 3,
            start: 10,
            tokens: (10..30).collect(),
            want_logits: true,
            rope_delta: 0,
            images: vec![ChunkImage { image, placed }],
            save_within: vec![(15, SnapshotLoc::Device(1)), (22, SnapshotLoc::Device(0))],
            ..SeqChunk::default()
        };
        assert_eq!(c.bad_saves(), None);
        let pieces = c.pieces();
        let spans: Vec<(usize, usize, usize, bool, Option<SnapshotLoc>)> =
            pieces.iter().map(|(p, l)| (p.start, p.tokens.len(), p.images.len(), p.want_logits, *l)).collect();
        assert_eq!(
            spans,
            [
                (10, 5, 1, false, Some(SnapshotLoc::Device(1))),
                (15, 7, 1, false, Some(SnapshotLoc::Device(0))),
                (22, 8, 0, true, None)
            ]
        );
        assert_eq!(pieces[2].0.rope_delta, placed.delta_after(), "text after the image continues from it");
        // The pieces' positions are the chunk's.
        let whole = c.mrope_positions().unwrap();
        let mut cut = Vec::new();
        for (p, _) in &pieces {
            cut.extend(
                p.mrope_positions()
                    .unwrap_or_else(|| (0..p.tokens.len()).map(|i| [p.first_position() + i; 3]).collect()),
            );
        }
        assert_eq!(cut, whole);
        assert!(pieces.iter().flat_map(|p| &p.0.tokens).copied().eq(10..30));
        // Points outside the chunk, out of order, or on a speculative chunk are refused.
        for bad in [
            vec![(10, SnapshotLoc::Device(0))],
            vec![(30, SnapshotLoc::Device(0))],
            vec![(20, SnapshotLoc::Device(0)), (18, SnapshotLoc::Device(1))],
        ] {
            assert!(SeqChunk { save_within: bad, ..c.clone() }.bad_saves().is_some());
        }
        let spec = SeqChunk { tokens: vec![5], draft: 2, save_within: vec![(11, SnapshotLoc::Device(0))], ..c.clone() };
        assert!(spec.bad_saves().is_some());
    }

    #[test]
    fn greedy_drafts_skip_the_picker() {
        let row = [0.5f32, 2.0, 9.0, 1.0];
        let mut calls = 0;
        let mut pick = |seq: u64, i: usize, r: &[f32]| {
            calls += 1;
            assert_eq!((seq, i, r.len()), (3, 1, 4));
            0u32
        };
        let mut c = SeqChunk { seq_id: 3, draft: 2, ..SeqChunk::default() };
        assert_eq!(c.pick_draft(&mut pick, 1, &row), 0, "the picker's choice");
        // Greedy: the argmax below the vocabulary bound (id 2 is beyond a bound of 2).
        c.greedy_draft_vocab = 2;
        assert_eq!(c.pick_draft(&mut pick, 1, &row), 1);
        c.greedy_draft_vocab = 100;
        assert_eq!(c.pick_draft(&mut pick, 1, &row), 2);
        assert_eq!(calls, 1);
    }
}
