//! Cache ops between steps: state snapshots (device or pinned host), state slot copies and page
//! prefix copies.

use cudarc::driver::result;
use deltaserve_backend::{BackendError, CacheOp, SnapshotLoc};

use crate::error::CudaError;

use super::CudaBackend;
use super::device_error;
use super::layout::LayerCache;

#[derive(Clone, Copy, Debug)]
pub(super) enum Place {
    Dev(u64),
    /// Byte offset in the pinned host pool.
    Host(usize),
}

impl CudaBackend {
    pub(super) fn snapshot_check(&self, loc: SnapshotLoc) -> Result<(), BackendError> {
        let (i, n) = match loc {
            SnapshotLoc::Device(i) => (i, self.snapshot_slots),
            SnapshotLoc::Host(i) => (i, self.host_snapshot_slots),
        };
        if i as usize >= n {
            return Err(BackendError::InvalidStep(format!("snapshot {loc:?} out of range")));
        }
        Ok(())
    }

    /// Per DeltaNet layer: (slot address, snapshot address or host offset, bytes) of the two
    /// tensors, for state slot `slot` and snapshot `loc`; then, with speculative decoding, the slot's
    /// pending hidden row (part of its state).
    pub(super) fn state_parts(&self, slot: Option<u32>, loc: SnapshotLoc) -> Vec<(u64, u64, usize)> {
        let mut parts = Vec::new();
        for c in &self.caches {
            if let LayerCache::Gdn { rec, conv, snap_rec, snap_conv } = *c {
                parts.extend([(rec, snap_rec, self.rec_bytes), (conv, snap_conv, self.conv_bytes)]);
            }
        }
        if let Some(sp) = &self.spec {
            parts.push((sp.pending, sp.snap_pending, 2 * self.d.hidden));
        }
        let mut host_at = 0usize;
        let mut out = Vec::with_capacity(parts.len());
        for (base, snap_base, len) in parts {
            let slot_addr = slot.map(|s| self.states.ptr + (base + s as usize * len) as u64).unwrap_or(0);
            let other = match loc {
                SnapshotLoc::Device(i) => self.snapshots.ptr + (snap_base + i as usize * len) as u64,
                SnapshotLoc::Host(i) => (i as usize * self.snapshot_len + host_at) as u64,
            };
            host_at += len;
            out.push((slot_addr, other, len));
        }
        out
    }

    pub(super) fn copy(&self, dst: Place, src: Place, bytes: usize) -> Result<(), CudaError> {
        let s = self.rt.stream().cu_stream();
        let pool = self.host_pool.as_ref().map_or(std::ptr::null_mut(), |p| p.ptr());
        // SAFETY: every address comes from state_parts / the pinned pool bounds checked by the
        // callers (slot and snapshot indices are validated), and the pinned pool lives as long as
        // self; the step synchronises before returning.
        unsafe {
            match (dst, src) {
                (Place::Dev(d), Place::Dev(sr)) => {
                    result::memcpy_dtod_async(d, sr, bytes, s).map_err(CudaError::driver("cuMemcpyDtoDAsync"))
                }
                (Place::Host(o), Place::Dev(sr)) => {
                    let dst = std::slice::from_raw_parts_mut(pool.add(o), bytes);
                    result::memcpy_dtoh_async(dst, sr, s).map_err(CudaError::driver("cuMemcpyDtoHAsync"))
                }
                (Place::Dev(d), Place::Host(o)) => {
                    let src = std::slice::from_raw_parts(pool.add(o), bytes);
                    result::memcpy_htod_async(d, src, s).map_err(CudaError::driver("cuMemcpyHtoDAsync"))
                }
                (Place::Host(o), Place::Host(so)) => {
                    self.rt.synchronize()?;
                    std::ptr::copy(pool.add(so), pool.add(o), bytes);
                    Ok(())
                }
            }
        }
    }

    pub(super) fn apply(&self, op: &CacheOp) -> Result<(), BackendError> {
        let place = |loc: SnapshotLoc, a: u64| match loc {
            SnapshotLoc::Device(_) => Place::Dev(a),
            SnapshotLoc::Host(_) => Place::Host(a as usize),
        };
        match *op {
            CacheOp::SaveState { slot, to } | CacheOp::RestoreState { from: to, slot } => {
                self.snapshot_check(to)?;
                if slot as usize >= self.num_slots {
                    return Err(BackendError::InvalidStep(format!("state slot {slot} out of range")));
                }
                let save = matches!(op, CacheOp::SaveState { .. });
                for (sa, oa, len) in self.state_parts(Some(slot), to) {
                    if save {
                        self.copy(place(to, oa), Place::Dev(sa), len).map_err(device_error)?;
                    } else {
                        self.copy(Place::Dev(sa), place(to, oa), len).map_err(device_error)?;
                    }
                }
            }
            CacheOp::MoveSnapshot { from, to } => {
                self.snapshot_check(from)?;
                self.snapshot_check(to)?;
                let src = self.state_parts(None, from);
                let dst = self.state_parts(None, to);
                for ((_, s, len), (_, d, _)) in src.into_iter().zip(dst) {
                    self.copy(place(to, d), place(from, s), len).map_err(device_error)?;
                }
            }
            CacheOp::CopyState { src, dst } => {
                if src as usize >= self.num_slots || dst as usize >= self.num_slots {
                    return Err(BackendError::InvalidStep(format!("state copy {src} → {dst} out of range")));
                }
                if src == dst {
                    return Ok(());
                }
                // The snapshot half of each part is not used here.
                let from = self.state_parts(Some(src), SnapshotLoc::Device(0));
                let to = self.state_parts(Some(dst), SnapshotLoc::Device(0));
                for ((s, _, len), (d, _, _)) in from.into_iter().zip(to) {
                    self.copy(Place::Dev(d), Place::Dev(s), len).map_err(device_error)?;
                }
            }
            CacheOp::CopyPagePrefix { src, dst, tokens } => {
                let ps = self.page_size;
                if src as usize >= self.num_pages || dst as usize >= self.num_pages || tokens as usize > ps {
                    return Err(BackendError::InvalidStep(format!(
                        "page copy {src} → {dst} ({tokens} tokens) out of range"
                    )));
                }
                if tokens == 0 || src == dst {
                    return Ok(());
                }
                let mtp_kv = self.spec.as_ref().map(|sp| sp.kv);
                let attn = self.caches.iter().filter_map(|c| if let LayerCache::Attn(l) = *c { Some(l) } else { None });
                // The MTP head's KV is in the pages too (speculative decoding).
                for l in attn.chain(mtp_kv) {
                    // Data and (quantised formats) scales, each `bpt` bytes per token.
                    for (base, bpt) in l.token_tensors(self.d.kv_heads, self.d.head_dim) {
                        let s0 = base + (src as usize * ps * bpt) as u64;
                        let d0 = base + (dst as usize * ps * bpt) as u64;
                        self.copy(Place::Dev(d0), Place::Dev(s0), tokens as usize * bpt).map_err(device_error)?;
                    }
                }
            }
        }
        Ok(())
    }
}
