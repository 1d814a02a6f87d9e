//! The CPU reference backend behind the engine's [`Backend`] contract: the f32 model plus one host
//! arena holding every sequence's KV pages (per attention layer) and DeltaNet state slots (per
//! DeltaNet layer), sized by the static plan and allocated once. Each step runs its sequence
//! chunks one after another through [`CpuModel::forward_cached`], so batching can never change a
//! sequence's numbers. (Per-op temporaries of this oracle are ordinary heap memory, bounded by the
//! step's tokens; the device backends carve those from the plan's activation workspace.)
//!
//! Speculative decoding ([`CpuBackend::with_speculation`]): the arena gains the MTP head's KV (one more
//! attention layer in every page, so prefix sharing and page copies cover it) and one "pending hidden"
//! row per slot: the main model's post-norm hidden of the last fed position, which the head combines
//! with the next token. MTP cache entry `p` holds (hidden of `p − 1`, token `p`), so it depends only on
//! `tokens[..=p]` and shared prefix pages stay valid for every sequence sharing the prefix. The pending
//! hidden is part of a slot's state snapshot. Every chunk updates the head's cache for its positions.
//! A speculative chunk drafts with the head, then verifies on a scratch copy of the DeltaNet state
//! (token-by-token recurrence, as decode does) while keeping each DeltaNet layer's recurrence inputs;
//! [`Backend::commit_speculative`] replays those inputs for the accepted positions on the committed state,
//! so the state is exactly what decoding the accepted tokens one by one gives.
//!
//! Images ([`Backend::image_tokens`], when the model has a vision tower): a chunk's image rows replace
//! its placeholders' embeddings and its positions rotate at their M-RoPE positions
//! ([`crate::chunk_input`]); the MTP head takes the same positions (and the placeholders' token
//! embeddings).

use deltaserve_backend::ahead::Emulated;
use deltaserve_backend::host::host_step;
use deltaserve_backend::{
    ArenaStats, Backend, BackendError, CacheOp, Capabilities, DraftPicker, Feed, ImageTokens, Pick, Picked, SeqChunk,
    SnapshotLoc, SpecCommit, StepBatch, StepOut, Want, check_logits_rows,
};
use deltaserve_model::LayerKind;
use deltaserve_plan::StateDtype;

use crate::chunk_input::{ChunkInput, ImageRows};
use crate::kvquant::{KvFormat, KvQuant};
use crate::model::{CpuModel, ForwardError, GdnMode, GdnTrace, Logits, Positions, SeqCache};

/// Capacities of the arena, from the plan.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CpuCacheConfig {
    pub num_pages: usize,
    pub page_size: usize,
    pub num_slots: usize,
    /// DeltaNet state snapshots in the arena (the plan's device pool).
    pub snapshot_slots: usize,
    /// DeltaNet state snapshots in a separate host pool (`--snapshot-host-memory`).
    pub host_snapshot_slots: usize,
}

/// One allocation carved into named regions by offset; never grows.
struct HostArena {
    buf: Vec<f32>,
    used: usize,
    allocations: u64,
}

impl HostArena {
    fn with_capacity(floats: usize) -> Self {
        Self { buf: vec![0.0; floats], used: 0, allocations: 1 }
    }
    /// Reserves `n` floats; returns their offset.
    fn carve(&mut self, n: usize) -> usize {
        let at = self.used;
        assert!(at + n <= self.buf.len(), "arena overflow: the plan under-counted");
        self.used += n;
        at
    }
}

/// Offsets of one layer's region in the arena.
#[derive(Clone, Copy, Debug)]
enum LayerRegion {
    /// K pages then V pages, each [num_pages, page_size, kv_dim].
    Attention { k: usize, v: usize },
    /// conv [slots, kernel − 1, channels], recurrent [slots, Hv, dk, dv].
    DeltaNet { conv: usize, recurrent: usize },
}

pub struct CpuBackend {
    model: CpuModel,
    caches: Caches,
    /// Most drafts per speculative chunk (0: speculation off).
    max_draft: usize,
    /// Speculative chunks of the last step, awaiting their commit.
    verified: Vec<Verified>,
    /// Launched steps (run at once) awaiting their collection.
    ahead: Emulated,
    /// Merged rows of images split across chunks.
    image_rows: ImageRows,
}

/// What a speculative chunk's verify keeps for its commit.
struct Verified {
    seq_id: u64,
    slot: u32,
    start: usize,
    /// The sequence's rope delta (the chunk's positions are `start + i + rope_delta`).
    rope_delta: i64,
    /// The chunk's token followed by its drafts.
    tokens: Vec<u32>,
    /// Post-norm hidden rows of those positions `[1 + draft, hidden]`.
    rows: Vec<f32>,
    /// Recurrence inputs per DeltaNet layer (layer index, trace).
    traces: Vec<(usize, GdnTrace)>,
}

/// The arena and where each layer's region lies in it.
struct Caches {
    cfg: CpuCacheConfig,
    arena: HostArena,
    layers: Vec<LayerRegion>,
    kv_dim: usize,
    conv_len: usize,
    rec_len: usize,
    /// Arena offset of the device snapshot pool: [snapshot_slots, snapshot_len].
    snapshots: usize,
    /// The host snapshot pool: [host_snapshot_slots, snapshot_len].
    host_snapshots: Vec<f32>,
    /// Floats of one snapshot: (conv, recurrent) of every DeltaNet layer, in layer order.
    snapshot_len: usize,
    /// Storage formats of K and V: each written token-head row is quantised and dequantised back
    /// (see [`crate::kvquant`]), so the f32 pages hold exactly what a device cache would.
    k_format: KvFormat,
    v_format: KvFormat,
    head_dim: usize,
    /// The DeltaNet recurrent state is stored bf16: rounded after every update (the arena stays f32).
    state_bf16: bool,
    /// Speculation: arena offset of the pending hidden rows `[slots, hidden]` (part of each snapshot).
    pending_hidden: Option<usize>,
    hidden: usize,
}

/// The most drafts per speculative chunk any backend step takes (`--speculative-tokens` 1..=4).
pub const MAX_DRAFT_TOKENS: usize = 4;

impl CpuBackend {
    /// Makes every `k`-th launched pick count as made on the host (0: none), as a device's sampler
    /// leaves some rows to the host: tests the engine's handling of fed rows that do not run.
    pub fn emulate_host_picks(&mut self, k: usize) {
        self.ahead.host_every = k;
    }

    /// Allocates the arena for `cfg` (the only allocation this backend makes for caches).
    pub fn new(model: CpuModel, cfg: CpuCacheConfig) -> Self {
        Self::build(model, cfg, 0)
    }

    /// A backend that also runs speculative chunks of up to `max_draft` (1..=4) drafts with the model's
    /// MTP head. Errors when the model has no MTP head or `max_draft` is out of range.
    pub fn with_speculation(model: CpuModel, cfg: CpuCacheConfig, max_draft: usize) -> Result<Self, ForwardError> {
        if !model.has_mtp() {
            return Err(ForwardError::NoMtpHead);
        }
        if !(1..=MAX_DRAFT_TOKENS).contains(&max_draft) {
            return Err(ForwardError::Speculation(format!(
                "draft tokens per step must be 1..={MAX_DRAFT_TOKENS}, got {max_draft}"
            )));
        }
        Ok(Self::build(model, cfg, max_draft))
    }

    fn build(model: CpuModel, cfg: CpuCacheConfig, max_draft: usize) -> Self {
        let d = model.dims;
        let spec = max_draft > 0;
        let kv_dim = d.kv_dim;
        let conv_len = (d.conv_kernel - 1) * d.conv_channels;
        let rec_len = d.gdn_v_heads * d.gdn_k_dim * d.gdn_v_dim;
        let kv_floats = cfg.num_pages * cfg.page_size * kv_dim;
        let hidden_len = if spec { d.hidden } else { 0 };
        let snapshot_len = d.num_deltanet_layers * (conv_len + rec_len) + hidden_len;
        let kv_layers = d.num_attention_layers + usize::from(spec);
        let total = kv_layers * 2 * kv_floats
            + d.num_deltanet_layers * cfg.num_slots * (conv_len + rec_len)
            + cfg.num_slots * hidden_len
            + cfg.snapshot_slots * snapshot_len;
        let mut arena = HostArena::with_capacity(total);
        let mut layers: Vec<LayerRegion> = model
            .config
            .layer_types
            .iter()
            .map(|k| match k {
                LayerKind::Attention => LayerRegion::Attention { k: arena.carve(kv_floats), v: arena.carve(kv_floats) },
                LayerKind::DeltaNet => LayerRegion::DeltaNet {
                    conv: arena.carve(cfg.num_slots * conv_len),
                    recurrent: arena.carve(cfg.num_slots * rec_len),
                },
            })
            .collect();
        let pending_hidden = spec.then(|| {
            // The MTP head's KV: one more attention layer, at index `num_layers`.
            layers.push(LayerRegion::Attention { k: arena.carve(kv_floats), v: arena.carve(kv_floats) });
            arena.carve(cfg.num_slots * hidden_len)
        });
        let snapshots = arena.carve(cfg.snapshot_slots * snapshot_len);
        let host_snapshots = vec![0.0; cfg.host_snapshot_slots * snapshot_len];
        Self {
            model,
            caches: Caches {
                cfg,
                arena,
                layers,
                kv_dim,
                conv_len,
                rec_len,
                snapshots,
                host_snapshots,
                snapshot_len,
                k_format: KvFormat::F32,
                v_format: KvFormat::F32,
                head_dim: d.head_dim,
                state_bf16: false,
                pending_hidden,
                hidden: d.hidden,
            },
            max_draft,
            verified: Vec::new(),
            ahead: Emulated::default(),
            image_rows: ImageRows::default(),
        }
    }

    /// Stores K and V in these formats (default: both [`KvFormat::F32`], exact). The arena stays f32:
    /// only the values change, to exactly those the device format would hold.
    pub fn with_kv_formats(mut self, k: KvFormat, v: KvFormat) -> Self {
        self.caches.k_format = k;
        self.caches.v_format = v;
        self
    }

    /// Stores the DeltaNet recurrent state in `dtype` (default f32, exact): with bf16 every state a step
    /// leaves is rounded to bf16, as a device slot of that format holds it (the arena stays f32).
    pub fn with_state_dtype(mut self, dtype: StateDtype) -> Self {
        self.caches.state_bf16 = dtype == StateDtype::Bf16;
        self
    }

    /// The (K, V) storage formats.
    pub fn kv_formats(&self) -> (KvFormat, KvFormat) {
        (self.caches.k_format, self.caches.v_format)
    }

    pub fn model(&self) -> &CpuModel {
        &self.model
    }

    /// Images whose merged rows are kept for a later chunk (an image split across chunks).
    pub fn images_in_flight(&self) -> usize {
        self.image_rows.kept()
    }

    /// Runs a step; speculative chunks need `pick` (and speculation on).
    fn run(
        &mut self,
        batch: &StepBatch,
        mut pick: Option<&mut DraftPicker<'_>>,
        logits: &mut Vec<f32>,
        drafts: &mut Vec<Vec<u32>>,
    ) -> Result<(), BackendError> {
        if pick.is_none() && batch.seqs.iter().any(|c| c.draft > 0) {
            return Err(BackendError::InvalidStep("speculative chunks need a draft picker".into()));
        }
        self.verified.clear();
        for op in &batch.pre {
            self.caches.apply(op)?;
        }
        for c in &batch.seqs {
            self.check_chunk(c)?;
            let err = |e: ForwardError| BackendError::InvalidStep(format!("seq {}: {e}", c.seq_id));
            let spec = self.max_draft > 0;
            let mut view = PagedSeq { backend: &mut self.caches, slot: c.slot as usize, pages: &c.pages };
            if c.start == 0 {
                // A new (or recomputed) sequence starts from a zeroed state.
                for (i, kind) in self.model.config.layer_types.iter().enumerate() {
                    if *kind == LayerKind::DeltaNet {
                        let (conv, rec) = view.deltanet_state(i);
                        conv.fill(0.0);
                        rec.fill(0.0);
                    }
                }
                if spec {
                    view.pending_hidden().fill(0.0);
                }
            }
            if c.draft > 0
                && let Some(pick) = pick.as_deref_mut()
            {
                let (rows, tokens, traces) = Self::verify(&self.model, &mut view, c, pick).map_err(err)?;
                logits.extend_from_slice(&self.model.logits(&rows));
                drafts.push(tokens[1..].to_vec());
                let (seq_id, slot, start, rope_delta) = (c.seq_id, c.slot, c.start, c.rope_delta);
                self.verified.push(Verified { seq_id, slot, start, rope_delta, tokens, rows, traces });
                continue;
            }
            // A chunk with snapshots inside runs piece by piece, the state saved after each piece.
            for (piece, save) in c.pieces() {
                let mut view = PagedSeq { backend: &mut self.caches, slot: c.slot as usize, pages: &c.pages };
                Self::run_plain(&self.model, &mut self.image_rows, &mut view, &piece, spec, logits).map_err(err)?;
                if let Some(to) = save {
                    self.caches.apply(&CacheOp::SaveState { slot: c.slot, to })?;
                }
            }
        }
        self.image_rows.retain_batch(batch);
        for op in &batch.post {
            self.caches.apply(op)?;
        }
        Ok(())
    }

    /// Runs plain chunk `c` (no drafts) over `view`; appends its last row's logits if it wants them, every
    /// row's if it wants those.
    fn run_plain(
        model: &CpuModel,
        image_rows: &mut ImageRows,
        view: &mut PagedSeq<'_>,
        c: &SeqChunk,
        spec: bool,
        logits: &mut Vec<f32>,
    ) -> Result<(), ForwardError> {
        let ChunkInput { x, pos } = image_rows.input(model, c)?;
        let rows = model.run_layers(view, c.start, x, pos.get(), GdnMode::Auto)?;
        if spec {
            // The head's cache for these positions: entry p = (hidden of p − 1, token p).
            let h = model.dims.hidden;
            let t = c.tokens.len();
            let mut hidden_in = view.pending_hidden().to_vec();
            hidden_in.extend_from_slice(&rows[..(t - 1) * h]);
            let mtp_layer = model.dims.num_layers;
            model.mtp_forward_at(view, mtp_layer, c.start, pos.get(), &hidden_in, &c.tokens)?;
            view.pending_hidden().copy_from_slice(&rows[(t - 1) * h..]);
        }
        if c.all_logits {
            logits.extend_from_slice(&model.logits_of(&rows, Logits::All));
        } else if c.want_logits {
            logits.extend_from_slice(&model.logits_of(&rows, Logits::Last));
        }
        Ok(())
    }

    fn check_chunk(&self, c: &SeqChunk) -> Result<(), BackendError> {
        let cfg = self.caches.cfg;
        let slot = c.slot as usize;
        if slot >= cfg.num_slots {
            return Err(BackendError::InvalidStep(format!("seq {}: slot {slot} out of range", c.seq_id)));
        }
        if c.tokens.is_empty() {
            return Err(BackendError::InvalidStep(format!("seq {}: empty chunk", c.seq_id)));
        }
        let end = c.start + c.positions();
        if c.pages.len() * cfg.page_size < end || c.pages.iter().any(|&p| p as usize >= cfg.num_pages) {
            return Err(BackendError::InvalidStep(format!("seq {}: pages do not cover {end} positions", c.seq_id)));
        }
        if let Some(e) = c.bad_saves() {
            return Err(BackendError::InvalidStep(e));
        }
        for &(_, loc) in &c.save_within {
            self.caches.check_snapshot(loc)?;
        }
        if c.draft > 0 {
            if self.max_draft == 0 {
                return Err(BackendError::Unsupported(
                    "speculative decoding: this CPU backend was built without an MTP head".into(),
                ));
            }
            if c.draft > self.max_draft || c.tokens.len() != 1 || c.start == 0 {
                return Err(BackendError::InvalidStep(format!(
                    "seq {}: a speculative chunk is one decode token after the prompt with 1..={} drafts \
                     (got {} tokens at {} with {} drafts)",
                    c.seq_id,
                    self.max_draft,
                    c.tokens.len(),
                    c.start,
                    c.draft
                )));
            }
        }
        Ok(())
    }

    /// Drafts `c.draft` tokens with the MTP head, then runs the main model over the chunk's token and the
    /// drafts on a scratch copy of the DeltaNet state. Returns (hidden rows, token + drafts, traces).
    #[allow(clippy::type_complexity)]
    fn verify(
        model: &CpuModel,
        view: &mut PagedSeq<'_>,
        c: &SeqChunk,
        pick: &mut DraftPicker<'_>,
    ) -> Result<(Vec<f32>, Vec<u32>, Vec<(usize, GdnTrace)>), ForwardError> {
        let mtp_layer = model.dims.num_layers;
        let mut tokens = c.tokens.clone();
        // Entry `start` is real (pending hidden + the chunk's token); later entries are drafts, rewritten
        // from the main model's hidden rows at the commit.
        let mut g = view.pending_hidden().to_vec();
        for i in 0..c.draft {
            let at = c.start + i;
            let pos = Positions::Sequential(c.first_position() + i);
            g = model.mtp_forward_at(view, mtp_layer, at, pos, &g, &tokens[i..=i])?;
            let row = model.logits(&g);
            tokens.push(c.pick_draft(pick, i, &row));
        }
        let scratch = model
            .config
            .layer_types
            .iter()
            .enumerate()
            .map(|(i, k)| {
                (*k == LayerKind::DeltaNet).then(|| {
                    let (conv, rec) = view.deltanet_state(i);
                    (conv.to_vec(), rec.to_vec())
                })
            })
            .collect();
        let inner = PagedSeq { backend: &mut *view.backend, slot: view.slot, pages: view.pages };
        let mut vv = VerifyView { inner, scratch, traces: Vec::new() };
        let x = model.embed_checked(&tokens)?;
        let pos = Positions::Sequential(c.first_position());
        let rows = model.run_layers(&mut vv, c.start, x, pos, GdnMode::Recurrent)?;
        Ok((rows, tokens, vv.traces))
    }
}

/// One sequence's view of the arena during a step.
struct PagedSeq<'a> {
    backend: &'a mut Caches,
    slot: usize,
    pages: &'a [u32],
}

impl PagedSeq<'_> {
    /// Arena offset of position `pos` in a KV region starting at `base`.
    fn kv_offset(&self, base: usize, pos: usize) -> usize {
        let ps = self.backend.cfg.page_size;
        let page = self.pages[pos / ps] as usize;
        base + (page * ps + pos % ps) * self.backend.kv_dim
    }
}

impl PagedSeq<'_> {
    /// The slot's pending hidden row (speculation only).
    fn pending_hidden(&mut self) -> &mut [f32] {
        let b = &mut *self.backend;
        let base = b.pending_hidden.expect("speculation is on") + self.slot * b.hidden;
        &mut b.arena.buf[base..base + b.hidden]
    }
}

/// A paged sequence seen through a scratch copy of its DeltaNet state (the speculative verify):
/// KV goes to the pages, the committed state is not touched, and each DeltaNet layer's recurrence
/// inputs are kept for the commit.
struct VerifyView<'a> {
    inner: PagedSeq<'a>,
    /// Per layer: (conv, recurrent) copies for DeltaNet layers.
    scratch: Vec<Option<(Vec<f32>, Vec<f32>)>>,
    traces: Vec<(usize, GdnTrace)>,
}

impl SeqCache for VerifyView<'_> {
    fn deltanet_state(&mut self, layer: usize) -> (&mut [f32], &mut [f32]) {
        let (c, r) = self.scratch[layer].as_mut().expect("a DeltaNet layer");
        (c, r)
    }
    fn write_kv(&mut self, layer: usize, start: usize, k: &[f32], v: &[f32]) {
        self.inner.write_kv(layer, start, k, v)
    }
    fn read_kv(&self, layer: usize, len: usize) -> (Vec<f32>, Vec<f32>) {
        self.inner.read_kv(layer, len)
    }
    fn state_bf16(&self) -> bool {
        self.inner.state_bf16()
    }
    fn wants_gdn_trace(&self) -> bool {
        true
    }
    fn record_gdn_trace(&mut self, layer: usize, trace: GdnTrace) {
        self.traces.push((layer, trace));
    }
}

impl SeqCache for PagedSeq<'_> {
    fn deltanet_state(&mut self, layer: usize) -> (&mut [f32], &mut [f32]) {
        let b = &mut *self.backend;
        let LayerRegion::DeltaNet { conv, recurrent } = b.layers[layer] else {
            unreachable!("layer {layer} is not a DeltaNet layer")
        };
        let c0 = conv + self.slot * b.conv_len;
        let r0 = recurrent + self.slot * b.rec_len;
        // conv regions precede recurrent regions of the same layer, so the split is disjoint.
        let (head, tail) = b.arena.buf.split_at_mut(r0);
        (&mut head[c0..c0 + b.conv_len], &mut tail[..b.rec_len])
    }
    fn state_bf16(&self) -> bool {
        self.backend.state_bf16
    }
    fn write_kv(&mut self, layer: usize, start: usize, k: &[f32], v: &[f32]) {
        let LayerRegion::Attention { k: kb, v: vb } = self.backend.layers[layer] else {
            unreachable!("layer {layer} is not an attention layer")
        };
        let w = self.backend.kv_dim;
        let (kf, vf, hd) = (self.backend.k_format, self.backend.v_format, self.backend.head_dim);
        for (i, (kr, vr)) in k.chunks_exact(w).zip(v.chunks_exact(w)).enumerate() {
            let (ko, vo) = (self.kv_offset(kb, start + i), self.kv_offset(vb, start + i));
            let buf = &mut self.backend.arena.buf;
            buf[ko..ko + w].copy_from_slice(kr);
            kf.quantize_rows(&mut buf[ko..ko + w], hd);
            buf[vo..vo + w].copy_from_slice(vr);
            vf.quantize_rows(&mut buf[vo..vo + w], hd);
        }
    }
    fn read_kv(&self, layer: usize, len: usize) -> (Vec<f32>, Vec<f32>) {
        let LayerRegion::Attention { k: kb, v: vb } = self.backend.layers[layer] else {
            unreachable!("layer {layer} is not an attention layer")
        };
        let w = self.backend.kv_dim;
        let mut k = Vec::with_capacity(len * w);
        let mut v = Vec::with_capacity(len * w);
        for pos in 0..len {
            let (ko, vo) = (self.kv_offset(kb, pos), self.kv_offset(vb, pos));
            k.extend_from_slice(&self.backend.arena.buf[ko..ko + w]);
            v.extend_from_slice(&self.backend.arena.buf[vo..vo + w]);
        }
        (k, v)
    }
}

impl Backend for CpuBackend {
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            name: "cpu".into(),
            vocab_size: self.model.dims.vocab,
            launches_ahead: true,
            max_draft_tokens: self.max_draft,
            masks_tokens: true,
            picks_after_launch: true,
            snapshots_within_chunks: usize::MAX,
            prompt_logits: true,
            max_logits_rows: usize::MAX,
        }
    }

    fn image_tokens(&self) -> Option<ImageTokens> {
        let v = self.model.config.vision.as_ref().filter(|_| self.model.vision.is_some())?;
        Some(ImageTokens { image_token_id: v.image_token_id, merge: v.spatial_merge_size, patch_len: v.patch_dim() })
    }

    fn step(&mut self, batch: &StepBatch, want: Want<'_>, out: &mut StepOut) -> Result<(), BackendError> {
        let vocab = self.model.dims.vocab;
        check_logits_rows(batch, &self.capabilities())?;
        host_step(batch, vocab, want, out, |pick, logits, drafts| self.run(batch, pick, logits, drafts))
    }

    fn launch(
        &mut self,
        batch: &StepBatch,
        valid: usize,
        pick: Pick<'_>,
        feed: Option<&Feed>,
    ) -> Result<(), BackendError> {
        let mut ahead = std::mem::take(&mut self.ahead);
        let r = ahead.launch(self, batch, valid, pick, feed);
        if r.is_err() {
            ahead.reset();
        }
        self.ahead = ahead;
        r
    }

    fn pick_launched(&mut self, pick: Pick<'_>) -> Result<(), BackendError> {
        let r = self.ahead.pick_launched(pick);
        if r.is_err() {
            self.ahead.reset();
        }
        r
    }

    fn collect(&mut self, out: &mut Picked) -> Result<(), BackendError> {
        let r = self.ahead.collect(out);
        if r.is_err() {
            self.ahead.reset();
        }
        r
    }

    fn commit_speculative(&mut self, commits: &[SpecCommit]) -> Result<(), BackendError> {
        for c in commits {
            let Some(i) = self.verified.iter().position(|v| v.seq_id == c.seq_id && v.slot == c.slot) else {
                return Err(BackendError::InvalidStep(format!("seq {}: no speculative chunk to commit", c.seq_id)));
            };
            let v = self.verified.swap_remove(i);
            let e = c.accepted;
            if c.start != v.start || e == 0 || e > v.tokens.len() {
                return Err(BackendError::InvalidStep(format!(
                    "seq {}: commit of {e} positions at {} does not match the verified chunk ({} positions at {})",
                    c.seq_id,
                    c.start,
                    v.tokens.len(),
                    v.start
                )));
            }
            let cfg = self.caches.cfg;
            if c.pages.len() * cfg.page_size < v.start + e || c.pages.iter().any(|&p| p as usize >= cfg.num_pages) {
                return Err(BackendError::InvalidStep(format!("seq {}: commit pages out of range", c.seq_id)));
            }
            let err = |e: ForwardError| BackendError::InvalidStep(format!("seq {}: {e}", c.seq_id));
            let bf16_state = self.caches.state_bf16;
            let mut view = PagedSeq { backend: &mut self.caches, slot: c.slot as usize, pages: &c.pages };
            for (layer, trace) in &v.traces {
                let (conv, rec) = view.deltanet_state(*layer);
                self.model.replay_gdn(trace, e, (conv, rec, bf16_state)).map_err(err)?;
            }
            // The head's cache entries of the accepted drafts, from the main model's hidden rows.
            let h = self.model.dims.hidden;
            let mtp_layer = self.model.dims.num_layers;
            let pos = Positions::Sequential((v.start as i64 + 1 + v.rope_delta).max(0) as usize);
            self.model
                .mtp_forward_at(&mut view, mtp_layer, v.start + 1, pos, &v.rows[..(e - 1) * h], &v.tokens[1..e])
                .map_err(err)?;
            view.pending_hidden().copy_from_slice(&v.rows[(e - 1) * h..e * h]);
        }
        Ok(())
    }

    fn arena_stats(&self) -> ArenaStats {
        let a = &self.caches.arena;
        ArenaStats {
            allocations: a.allocations,
            high_water_bytes: (a.used * 4) as u64,
            capacity_bytes: (a.buf.len() * 4) as u64,
        }
    }
}

impl Caches {
    /// (offset, len) of each DeltaNet layer's conv and recurrent state of `slot` in the arena, then the
    /// pending hidden row when speculation is on.
    fn slot_parts(&self, slot: usize) -> Vec<(usize, usize)> {
        let mut parts = Vec::new();
        for l in &self.layers {
            if let LayerRegion::DeltaNet { conv, recurrent } = *l {
                parts.push((conv + slot * self.conv_len, self.conv_len));
                parts.push((recurrent + slot * self.rec_len, self.rec_len));
            }
        }
        if let Some(base) = self.pending_hidden {
            parts.push((base + slot * self.hidden, self.hidden));
        }
        parts
    }

    fn check_snapshot(&self, loc: SnapshotLoc) -> Result<(), BackendError> {
        let (i, n) = match loc {
            SnapshotLoc::Device(i) => (i, self.cfg.snapshot_slots),
            SnapshotLoc::Host(i) => (i, self.cfg.host_snapshot_slots),
        };
        if i as usize >= n {
            return Err(BackendError::InvalidStep(format!("snapshot {loc:?} out of range")));
        }
        Ok(())
    }

    /// Copies a snapshot out (`load == false`: slot → snapshot; true: snapshot → slot).
    fn transfer(&mut self, slot: u32, loc: SnapshotLoc, load: bool) -> Result<(), BackendError> {
        self.check_snapshot(loc)?;
        if slot as usize >= self.cfg.num_slots {
            return Err(BackendError::InvalidStep(format!("state slot {slot} out of range")));
        }
        let mut at = 0;
        for (off, len) in self.slot_parts(slot as usize) {
            let snap: &mut [f32] = match loc {
                SnapshotLoc::Device(i) => {
                    let base = self.snapshots + i as usize * self.snapshot_len + at;
                    // The snapshot pool lies after every slot region, so the two ranges never overlap.
                    let (lo, hi) = self.arena.buf.split_at_mut(base);
                    if load {
                        lo[off..off + len].copy_from_slice(&hi[..len]);
                    } else {
                        hi[..len].copy_from_slice(&lo[off..off + len]);
                    }
                    at += len;
                    continue;
                }
                SnapshotLoc::Host(i) => {
                    let base = i as usize * self.snapshot_len + at;
                    &mut self.host_snapshots[base..base + len]
                }
            };
            if load {
                self.arena.buf[off..off + len].copy_from_slice(snap);
            } else {
                snap.copy_from_slice(&self.arena.buf[off..off + len]);
            }
            at += len;
        }
        Ok(())
    }

    fn apply(&mut self, op: &CacheOp) -> Result<(), BackendError> {
        match *op {
            CacheOp::SaveState { slot, to } => self.transfer(slot, to, false),
            CacheOp::RestoreState { from, slot } => self.transfer(slot, from, true),
            CacheOp::MoveSnapshot { from, to } => {
                self.check_snapshot(from)?;
                self.check_snapshot(to)?;
                let n = self.snapshot_len;
                let data: Vec<f32> = match from {
                    SnapshotLoc::Device(i) => self.arena.buf[self.snapshots + i as usize * n..][..n].to_vec(),
                    SnapshotLoc::Host(i) => self.host_snapshots[i as usize * n..][..n].to_vec(),
                };
                match to {
                    SnapshotLoc::Device(i) => {
                        self.arena.buf[self.snapshots + i as usize * n..][..n].copy_from_slice(&data)
                    }
                    SnapshotLoc::Host(i) => self.host_snapshots[i as usize * n..][..n].copy_from_slice(&data),
                }
                Ok(())
            }
            CacheOp::CopyState { src, dst } => {
                let n = self.cfg.num_slots;
                if src as usize >= n || dst as usize >= n {
                    return Err(BackendError::InvalidStep(format!("state copy {src} → {dst} out of range")));
                }
                if src != dst {
                    for ((s0, len), (d0, _)) in
                        self.slot_parts(src as usize).into_iter().zip(self.slot_parts(dst as usize))
                    {
                        self.arena.buf.copy_within(s0..s0 + len, d0);
                    }
                }
                Ok(())
            }
            CacheOp::CopyPagePrefix { src, dst, tokens } => {
                let (ps, w) = (self.cfg.page_size, self.kv_dim);
                if src as usize >= self.cfg.num_pages || dst as usize >= self.cfg.num_pages || tokens as usize > ps {
                    return Err(BackendError::InvalidStep(format!(
                        "page copy {src} → {dst} ({tokens} tokens) out of range"
                    )));
                }
                let n = tokens as usize * w;
                for l in self.layers.clone() {
                    if let LayerRegion::Attention { k, v } = l {
                        for base in [k, v] {
                            let s0 = base + src as usize * ps * w;
                            let d0 = base + dst as usize * ps * w;
                            self.arena.buf.copy_within(s0..s0 + n, d0);
                        }
                    }
                }
                Ok(())
            }
        }
    }
}
