//! The CPU reference backend behind the engine's [`Backend`] contract: the f32 model plus one host
//! arena holding every sequence's KV pages (per attention layer) and DeltaNet state slots (per
//! DeltaNet layer), sized by the static plan and allocated once. Each step runs its sequence
//! chunks one after another through [`CpuModel::forward_cached`], so batching can never change a
//! sequence's numbers. (Per-op temporaries of this oracle are ordinary heap memory, bounded by the
//! step's tokens; the device backends carve those from the plan's activation workspace.)

use deltaserve_backend::{ArenaStats, Backend, BackendError, CacheOp, SnapshotLoc, StepBatch};
use deltaserve_model::LayerKind;

use crate::kvquant::{KvFormat, KvQuant};
use crate::model::{CpuModel, GdnMode, Logits, SeqCache};

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
}

impl CpuBackend {
    /// Allocates the arena for `cfg` (the only allocation this backend makes for caches).
    pub fn new(model: CpuModel, cfg: CpuCacheConfig) -> Self {
        let d = model.dims;
        let kv_dim = d.kv_dim;
        let conv_len = (d.conv_kernel - 1) * d.conv_channels;
        let rec_len = d.gdn_v_heads * d.gdn_k_dim * d.gdn_v_dim;
        let kv_floats = cfg.num_pages * cfg.page_size * kv_dim;
        let snapshot_len = d.num_deltanet_layers * (conv_len + rec_len);
        let total = d.num_attention_layers * 2 * kv_floats
            + d.num_deltanet_layers * cfg.num_slots * (conv_len + rec_len)
            + cfg.snapshot_slots * snapshot_len;
        let mut arena = HostArena::with_capacity(total);
        let layers = model
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
            },
        }
    }

    /// Stores K and V in these formats (default: both [`KvFormat::F32`], exact). The arena stays f32:
    /// only the values change, to exactly those the device format would hold.
    pub fn with_kv_formats(mut self, k: KvFormat, v: KvFormat) -> Self {
        self.caches.k_format = k;
        self.caches.v_format = v;
        self
    }

    /// The (K, V) storage formats.
    pub fn kv_formats(&self) -> (KvFormat, KvFormat) {
        (self.caches.k_format, self.caches.v_format)
    }

    pub fn model(&self) -> &CpuModel {
        &self.model
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
    fn name(&self) -> String {
        "cpu".into()
    }

    fn vocab_size(&self) -> usize {
        self.model.dims.vocab
    }

    fn step(&mut self, batch: &StepBatch, logits: &mut Vec<f32>) -> Result<(), BackendError> {
        let caches = &mut self.caches;
        for op in &batch.pre {
            caches.apply(op)?;
        }
        let cfg = caches.cfg;
        for c in &batch.seqs {
            let slot = c.slot as usize;
            if slot >= cfg.num_slots {
                return Err(BackendError::InvalidStep(format!("seq {}: slot {slot} out of range", c.seq_id)));
            }
            let end = c.start + c.tokens.len();
            if c.pages.len() * cfg.page_size < end || c.pages.iter().any(|&p| p as usize >= cfg.num_pages) {
                return Err(BackendError::InvalidStep(format!("seq {}: pages do not cover {end} positions", c.seq_id)));
            }
            let mut view = PagedSeq { backend: caches, slot, pages: &c.pages };
            if c.start == 0 {
                // A new (or recomputed) sequence starts from a zeroed state.
                for (i, kind) in self.model.config.layer_types.iter().enumerate() {
                    if *kind == LayerKind::DeltaNet {
                        let (conv, rec) = view.deltanet_state(i);
                        conv.fill(0.0);
                        rec.fill(0.0);
                    }
                }
            }
            let row = self
                .model
                .forward_cached(&mut view, c.start, &c.tokens, GdnMode::Auto, Logits::Last)
                .map_err(|e| BackendError::InvalidStep(format!("seq {}: {e}", c.seq_id)))?;
            if c.want_logits {
                logits.extend_from_slice(&row);
            }
        }
        for op in &batch.post {
            caches.apply(op)?;
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
    /// (offset, len) of each DeltaNet layer's conv and recurrent state of `slot` in the arena.
    fn slot_parts(&self, slot: usize) -> Vec<(usize, usize)> {
        let mut parts = Vec::new();
        for l in &self.layers {
            if let LayerRegion::DeltaNet { conv, recurrent } = *l {
                parts.push((conv + slot * self.conv_len, self.conv_len));
                parts.push((recurrent + slot * self.rec_len, self.rec_len));
            }
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
