//! The routed experts in pinned host memory (`experts_on_host`): one block, mapped into the device's
//! address space, holding every sparse layer's experts and the MTP head's. Each tensor is placed as the
//! weights region would place it (256-byte aligned, in load order), so the expert kernels find expert e
//! at expert 0's address plus one stride as on the device, and read only the experts a step picks, across
//! the bus. The block is written from the host (a checkpoint's bf16 bytes, GPTQ conversions) or copied
//! down from device staging (experts quantised at load, random weights: made on the GPU in the KV pages
//! region, empty until the first step). Nothing here takes device memory beyond that staging.

use std::time::Instant;

use deltaserve_backend::host_memory::Available;
use deltaserve_plan::fmt_bytes;

use crate::arena::{ALIGN, DevSpan, aligned};
use crate::error::CudaError;
use crate::ops::Kernels;
use crate::ops::init::{Init, init_random_at};
use crate::ops::w4a16::W4Weights;
use crate::runtime::{PinnedHost, Runtime};
use crate::w4::{ScaleDtype, W4Bytes, W4Linear};

use super::loader::random_w4;

/// The pinned, device-mapped block of the routed experts, bump-allocated.
pub(super) struct HostExperts {
    block: PinnedHost,
    used: usize,
}

impl HostExperts {
    /// Pins `bytes` of host memory mapped for the device, refused (before anything is pinned) when the
    /// process may not take that much more host memory.
    pub(super) fn new(rt: &Runtime, bytes: usize) -> Result<Self, CudaError> {
        check_available(bytes as u64, Available::now())?;
        let t0 = Instant::now();
        let block = PinnedHost::mapped(rt, bytes).map_err(|e| {
            CudaError::HostMemory(format!(
                "pinning {} for the routed experts (--experts-on-host) failed: {e}",
                fmt_bytes(bytes as u64)
            ))
        })?;
        tracing::info!(
            "routed experts: {} of pinned host memory (--experts-on-host), mapped for the GPU in {:.1} s",
            fmt_bytes(bytes as u64),
            t0.elapsed().as_secs_f64()
        );
        Ok(HostExperts { block, used: 0 })
    }

    /// The device address of `bytes` more bytes of the block (256-byte aligned, as the weights region
    /// places a tensor).
    pub(super) fn alloc(&mut self, bytes: usize) -> Result<u64, CudaError> {
        let need = self.used + aligned(bytes);
        if need > self.block.bytes() {
            return Err(CudaError::HostMemory(format!(
                "the routed experts' host block holds {} B, {need} B are needed",
                self.block.bytes()
            )));
        }
        let at = self.block.device_ptr() + self.used as u64;
        self.used = need;
        Ok(at)
    }

    /// The block's host bytes at device address `at`, `len` long (checked against the block).
    fn host_mut(&mut self, at: u64, len: usize) -> Result<&mut [u8], CudaError> {
        let off = at.checked_sub(self.block.device_ptr()).map(|o| o as usize);
        match off {
            Some(o) if o.checked_add(len).is_some_and(|end| end <= self.block.bytes()) => {
                // SAFETY: the range lies inside the pinned block, borrowed mutably with `self`; no kernel
                // reads the block while the weights load.
                Ok(unsafe { std::slice::from_raw_parts_mut(self.block.ptr().add(o), len) })
            }
            _ => Err(CudaError::HostMemory(format!(
                "{len} B at {at:#x} lie outside the routed experts' host block ({} B at {:#x})",
                self.block.bytes(),
                self.block.device_ptr()
            ))),
        }
    }

    /// Copies `src` to device address `at` of the block, on the host.
    pub(super) fn write<T: Copy>(&mut self, at: u64, src: &[T]) -> Result<(), CudaError> {
        let len = std::mem::size_of_val(src);
        // SAFETY: `src` is `len` initialised bytes of plain data.
        let bytes = unsafe { std::slice::from_raw_parts(src.as_ptr().cast::<u8>(), len) };
        self.host_mut(at, len)?.copy_from_slice(bytes);
        Ok(())
    }

    /// A host int4 linear into the placed `w` of the block (same shape and format).
    pub(super) fn write_w4(&mut self, l: &W4Linear, w: &W4Weights) -> Result<(), CudaError> {
        self.write(w.qweight, &l.qweight)?;
        self.write(w.scales, &l.scales)?;
        if let (Some(p), Some(z)) = (w.zeros, &l.zeros) {
            self.write(p, z)?;
        }
        if let (Some(p), Some(v)) = (w.perm, &l.perm) {
            self.write(p, v)?;
        }
        Ok(())
    }

    /// Copies `len` device bytes at `from` (staging) to device address `at` of the block, and waits.
    pub(super) fn download(&mut self, rt: &Runtime, at: u64, from: u64, len: usize) -> Result<(), CudaError> {
        rt.download(self.host_mut(at, len)?, from)
    }

    /// Bytes placed so far, and the block's.
    pub(super) fn usage(&self) -> (usize, usize) {
        (self.used, self.block.bytes())
    }
}

/// Refuses `need` bytes when more than `available` is left (no check where the figure is unknown).
fn check_available(need: u64, available: Option<Available>) -> Result<(), CudaError> {
    match available {
        Some(a) if need > a.bytes => Err(CudaError::HostMemory(format!(
            "--experts-on-host pins {} for the routed experts, more than the {} available ({}): free host \
             memory, or store the experts in fewer bytes (--weights-dtype int4)",
            fmt_bytes(need),
            fmt_bytes(a.bytes),
            a.source
        ))),
        _ => Ok(()),
    }
}

/// Device staging of experts quantised at load: one expert's gate/up and down linears (the layout of
/// [`super::moe::W4ExpertLayout`]) at the start of the KV pages region, quantised there and copied down
/// whole into the host block; the rest of the region stages the bf16 rows they are quantised from.
#[derive(Clone, Copy, Debug)]
pub(super) struct ExpertStage {
    pub(super) gate_up: W4Weights,
    pub(super) down: W4Weights,
    /// Bytes of each linear as placed (what is copied down).
    pub(super) gate_up_bytes: usize,
    pub(super) down_bytes: usize,
    /// The expert whose gate rows `gate_up` holds, waiting for its up rows.
    pub(super) gate_of: Option<usize>,
}

impl ExpertStage {
    /// Carves the stage of experts `width` wide over `hidden` from the start of `staging`; the rest of
    /// it comes back for the rows.
    pub(super) fn carve(
        staging: DevSpan,
        width: usize,
        hidden: usize,
        asym: bool,
    ) -> Result<(ExpertStage, DevSpan), CudaError> {
        let gate_up_bytes = W4Bytes::new(2 * width, hidden, asym, false).aligned();
        let down_bytes = W4Bytes::new(hidden, width, asym, false).aligned();
        let rows = staging.bytes.saturating_sub(gate_up_bytes + down_bytes);
        if rows < 4 * width.max(hidden) {
            return Err(CudaError::Plan(format!(
                "quantising host experts at load stages one expert ({} B) and two of its rows in the KV pages \
                 region, which holds {} B: plan for more context (or a larger --memory)",
                gate_up_bytes + down_bytes + 4 * width.max(hidden),
                staging.bytes
            )));
        }
        let at = |off: usize, out, inp| W4Weights::at(staging.ptr + off as u64, out, inp, asym, false, ScaleDtype::F16);
        let stage = ExpertStage {
            gate_up: at(0, 2 * width, hidden),
            down: at(gate_up_bytes, hidden, width),
            gate_up_bytes,
            down_bytes,
            gate_of: None,
        };
        let rest = DevSpan { ptr: staging.ptr + (gate_up_bytes + down_bytes) as u64, bytes: rows };
        Ok((stage, rest))
    }
}

/// Random routed experts for the host block, made on the GPU in `staging` and copied down, as many
/// consecutive tensors per copy as the staging holds. The values are those the same tensors get on the
/// device (each element a function of its tensor's seed and its index).
pub(super) struct HostFill {
    staging: DevSpan,
    /// The host-block address the staging's first byte goes to, and the bytes staged.
    at: u64,
    used: usize,
}

impl HostFill {
    pub(super) fn new(staging: DevSpan) -> Self {
        HostFill { staging, at: 0, used: 0 }
    }

    /// Copies what is staged down to the host block.
    pub(super) fn flush(&mut self, he: &mut HostExperts, rt: &Runtime) -> Result<(), CudaError> {
        if self.used > 0 {
            he.download(rt, self.at, self.staging.ptr, self.used)?;
            self.used = 0;
        }
        Ok(())
    }

    /// A random int4 `[out, in]` linear (bf16 scales, as the device's random int4 linears) for host
    /// address `at`, where it is copied with the tensors staged beside it.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn w4(
        &mut self,
        (he, rt, k): (&mut HostExperts, &Runtime, &Kernels),
        at: u64,
        out: usize,
        inp: usize,
        asym: bool,
        seed: u64,
    ) -> Result<W4Weights, CudaError> {
        let bytes = W4Bytes::new(out, inp, asym, false).aligned();
        if self.used > 0 && (at != self.at + self.used as u64 || self.used + bytes > self.staging.bytes) {
            self.flush(he, rt)?;
        }
        if bytes > self.staging.bytes {
            return Err(CudaError::Plan(format!(
                "random host experts stage each int4 linear ({bytes} B) in the KV pages region, which holds {} B",
                self.staging.bytes
            )));
        }
        if self.used == 0 {
            self.at = at;
        }
        random_w4(k, rt, self.staging.ptr + self.used as u64, out, inp, asym, seed)?;
        self.used += bytes;
        debug_assert!(bytes.is_multiple_of(ALIGN));
        Ok(W4Weights::at(at, out, inp, asym, false, ScaleDtype::Bf16))
    }

    /// `n` random bf16 elements of `init` for host address `at` (one layer's block of experts), made in
    /// slices of the staging.
    pub(super) fn dense(
        &mut self,
        (he, rt, k): (&mut HostExperts, &Runtime, &Kernels),
        at: u64,
        n: usize,
        seed: u64,
        init: Init,
    ) -> Result<(), CudaError> {
        self.flush(he, rt)?;
        let chunk = self.staging.bytes / 2;
        if chunk == 0 {
            return Err(CudaError::Plan("no KV pages region to stage the random host experts".into()));
        }
        for first in (0..n).step_by(chunk) {
            let m = chunk.min(n - first);
            init_random_at(k, rt.stream(), self.staging.ptr, m, first, seed, init, false)?;
            he.download(rt, at + 2 * first as u64, self.staging.ptr, 2 * m)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pinning_more_than_is_available_is_refused() {
        let avail = Some(Available { bytes: 30 << 30, source: "MemAvailable" });
        assert!(check_available(20 << 30, avail).is_ok());
        assert!(check_available(64 << 30, None).is_ok());
        let e = check_available(40 << 30, avail).unwrap_err().to_string();
        assert!(e.contains("40.00 GiB") && e.contains("30.00 GiB available (MemAvailable)"), "{e}");
    }
}
