//! deltaserve-backend: the contract between the engine and a compute backend (CPU reference, CUDA).
//!
//! A backend owns the device memory of the static plan (weights, KV pages, DeltaNet state slots,
//! activation workspace) and executes one engine step at a time: a [`StepBatch`] of sequence chunks,
//! each naming its state slot, its KV pages and its new tokens. Backends never see requests, text or
//! HTTP; the scheduler never sees memory contents. Everything here is plain data.

/// One sequence's part of a step: `tokens` at positions `start..start + tokens.len()`.
#[derive(Clone, Debug, PartialEq, Eq)]
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
    pub fn num_tokens(&self) -> usize {
        self.seqs.iter().map(|s| s.tokens.len()).sum()
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
}

/// A compute backend executing engine steps over the memory of the static plan.
pub trait Backend: Send {
    /// Short name for logs (`cpu`, `cuda:0`).
    fn name(&self) -> String;
    /// Logit rows are this wide.
    fn vocab_size(&self) -> usize;
    /// Runs `batch`: its `pre` ops, its chunks, its `post` ops. Appends one row of `vocab_size()`
    /// logits to `logits` for each chunk with `want_logits`, in batch order. A chunk with
    /// `start == 0` begins from a zeroed state slot.
    fn step(&mut self, batch: &StepBatch, logits: &mut Vec<f32>) -> Result<(), BackendError>;
    /// The arena's counters (tests assert they do not move while serving).
    fn arena_stats(&self) -> ArenaStats;
}
