//! A step's host-to-device uploads: the step inputs' block through its pinned image, the block-table rows
//! that changed, the varlen tables and the host embedding rows.

use cudarc::driver::result;
use deltaserve_plan::Plan;
use deltaserve_plan::workspace::{STEP_INPUTS, WorkspaceBuffer, WorkspaceLayout};

use crate::error::CudaError;
use crate::runtime::{PinnedHost, Runtime};

use super::CudaBackend;
use super::weights::HostEmbed;

/// The step inputs' block of the workspace (the plan puts them back to back) and its pinned image: a step
/// writes its inputs into the image and uploads them in one copy.
pub(super) struct StepInputs {
    pub(super) image: PinnedHost,
    /// Each input's byte offset in the block and its capacity (`STEP_INPUTS` order).
    pub(super) at: [(usize, usize); 6],
    /// Recorded after each upload: the image is rewritten only once the last copy out of it is done.
    pub(super) done: cudarc::driver::CudaEvent,
}

impl StepInputs {
    pub(super) fn new(rt: &Runtime, plan: &Plan) -> Result<StepInputs, CudaError> {
        let (at, bytes) = Self::block(&plan.workspace)?;
        let image = PinnedHost::new(rt, bytes)?;
        let done = rt.context().new_event(None).map_err(CudaError::driver("cuEventCreate"))?;
        Ok(StepInputs { image, at, done })
    }

    /// The block of the plan's step inputs: each input's offset from token_ids (the first) and capacity,
    /// and the block's bytes. No other buffer live while they are may lie inside it (one copy writes it all).
    pub(super) fn block(ws: &WorkspaceLayout) -> Result<([(usize, usize); 6], usize), CudaError> {
        let bufs = STEP_INPUTS.map(|name| ws.get(name));
        let Some(bufs) = bufs.into_iter().collect::<Option<Vec<_>>>() else {
            return Err(CudaError::Plan("the workspace lacks a step input".into()));
        };
        let lo = bufs[0].offset;
        if bufs.iter().any(|b| b.offset < lo) {
            return Err(CudaError::Plan("the step inputs' block does not start with token_ids".into()));
        }
        let hi = bufs.iter().map(|b| b.offset + b.bytes).max().unwrap_or(lo);
        let inside = |b: &&WorkspaceBuffer| {
            !STEP_INPUTS.contains(&b.name)
                && b.offset < hi
                && lo < b.offset + b.bytes
                && bufs.iter().any(|i| i.lifetime_overlaps(b))
        };
        if let Some(o) = ws.buffers.iter().find(inside) {
            return Err(CudaError::Plan(format!("workspace buffer `{}` lies inside the step inputs' block", o.name)));
        }
        let mut at = [(0, 0); 6];
        for (a, b) in at.iter_mut().zip(&bufs) {
            *a = ((b.offset - lo) as usize, b.bytes as usize);
        }
        Ok((at, (hi - lo) as usize))
    }
}

/// Steps of at least this many rows take their embedding rows from the host table with a kernel that reads
/// them across the bus (the step's forward); shorter ones through [`CudaBackend::upload_host_embedding`].
/// Decided by the row count alone, so a captured graph and the uploads of the steps that replay it agree (a
/// padded graph of more rows gathers what the upload already wrote: the same values).
pub(super) const HOST_EMBED_GPU_ROWS: usize = 64;

impl CudaBackend {
    /// Gathers the embedding rows of `ids` from the pinned host table into the pinned staging
    /// buffer and uploads them to `residual` (before the step's kernels or graph; the previous
    /// step synchronised, so the staging is free).
    pub(super) fn upload_host_embedding(&self, he: &HostEmbed, ids: &[i32]) -> Result<(), CudaError> {
        let row = 2 * self.d.hidden;
        let n = ids.len() * row;
        if n > he.staging.bytes() {
            return Err(CudaError::Plan(format!("{} embedding rows exceed the host staging buffer", ids.len())));
        }
        for (r, &id) in ids.iter().enumerate() {
            // SAFETY: r < staging_bytes / row (checked above); id < vocab rows of `row` bytes in the table.
            unsafe {
                if id < 0 {
                    // Outside a tensor-parallel rank's vocabulary shard.
                    std::ptr::write_bytes(he.staging.ptr().add(r * row), 0, row);
                } else {
                    let id = (id as usize).min(self.d.vocab - 1);
                    std::ptr::copy_nonoverlapping(he.table.ptr().add(id * row), he.staging.ptr().add(r * row), row);
                }
            }
        }
        // SAFETY: residual holds [t_max, hidden] bf16 (checked at construction); the pinned staging
        // lives as long as self and is not written again before the step synchronises.
        let src = unsafe { std::slice::from_raw_parts(he.staging.ptr(), n) };
        unsafe { result::memcpy_htod_async(self.ws.residual, src, self.rt.stream().cu_stream()) }
            .map_err(CudaError::driver("cuMemcpyHtoDAsync"))
    }

    /// Makes block-table row `r` start with `pages` on the device, uploading only the span that differs from
    /// the mirror: usually nothing in a decode step, one entry when a sequence enters a new page, a prompt's
    /// pages once. Entries past `pages` keep what they held: kernels read a row's first ⌈len / page⌉
    /// entries only, and every entry ever written is a valid page id (the region starts zeroed), so a
    /// graph's padding row still reads a real page.
    pub(super) fn put_table_row(&self, r: usize, pages: &[u32]) -> Result<(), CudaError> {
        let at = r * self.table_width;
        let mut mirror = self.table_mirror.borrow_mut();
        let row = &mut mirror[at..at + pages.len()];
        let differs = |(a, &b): (&i32, &u32)| *a != b as i32;
        let Some(lo) = row.iter().zip(pages).position(differs) else { return Ok(()) };
        let hi = pages.len() - row.iter().zip(pages).rev().position(differs).unwrap_or(0);
        for (a, &b) in row[lo..hi].iter_mut().zip(&pages[lo..hi]) {
            *a = b as i32;
        }
        let r = self.upload_i32(self.block_tables.ptr + 4 * (at + lo) as u64, &row[lo..hi]);
        if r.is_err() {
            // Unknown on the device now: −1 is never a page, so the next step uploads the span again.
            row[lo..hi].fill(-1);
        }
        r
    }

    /// Writes the step inputs (`STEP_INPUTS` order) into their pinned image and uploads the block up to the
    /// last value written, in one copy. An input the backend keeps elsewhere (with speculative decoding the
    /// gather indices of every verified row, in the speculation region) is uploaded on its own.
    pub(super) fn upload_inputs(&self, parts: [&[i32]; 6]) -> Result<(), CudaError> {
        let (inp, ws) = (&self.inputs, &self.ws);
        let dsts = [ws.token_ids, ws.positions, ws.cu_seqlens, ws.seq_lens, ws.slots, ws.last_idx];
        let in_block = |i: usize| dsts[i] == ws.token_ids + inp.at[i].0 as u64;
        if let Some(i) = (0..6).find(|&i| in_block(i) && 4 * parts[i].len() > inp.at[i].1) {
            return Err(CudaError::Plan(format!("the step's `{}` exceeds its workspace buffer", STEP_INPUTS[i])));
        }
        inp.done.synchronize().map_err(CudaError::driver("cuEventSynchronize"))?;
        let mut end = 0;
        for (i, v) in parts.iter().enumerate() {
            if !in_block(i) {
                self.upload_i32(dsts[i], v)?;
                continue;
            }
            let off = inp.at[i].0;
            // SAFETY: off + 4·len <= off + capacity <= the image's bytes (checked above and at construction);
            // the last copy out of the image has completed (the event above).
            unsafe { std::ptr::copy_nonoverlapping(v.as_ptr() as *const u8, inp.image.ptr().add(off), 4 * v.len()) };
            end = end.max(off + 4 * v.len());
        }
        if end == 0 {
            return Ok(());
        }
        let s = self.rt.stream();
        // SAFETY: the block starts at token_ids and holds the image's bytes (construction); the image is not
        // written again before `done` fires.
        let src = unsafe { std::slice::from_raw_parts(inp.image.ptr() as *const u8, end) };
        unsafe { result::memcpy_htod_async(ws.token_ids, src, s.cu_stream()) }
            .map_err(CudaError::driver("cuMemcpyHtoDAsync"))?;
        inp.done.record(s).map_err(CudaError::driver("cuEventRecord"))
    }

    pub(super) fn upload_i32(&self, dst: u64, v: &[i32]) -> Result<(), CudaError> {
        if v.is_empty() {
            return Ok(());
        }
        // SAFETY: dst is a workspace buffer checked at construction to hold the step's maximum;
        // pageable source memory is staged before the call returns.
        unsafe { result::memcpy_htod_async(dst, v, self.rt.stream().cu_stream()) }
            .map_err(CudaError::driver("cuMemcpyHtoDAsync"))
    }
}
