//! Device memory as a few named regions, each ONE `cuMemAlloc`, carved by a bump allocator
//! (256-byte alignment). After [`Arena::seal`] every allocation is an error, so the serving path
//! can only use addresses planned at start-up (stable for CUDA graphs). Views are raw `u64`
//! device pointers plus byte lengths. Memory is freed when the arena is dropped.

use std::sync::Arc;

use cudarc::driver::{CudaContext, result};

use crate::error::CudaError;

/// Sub-allocation alignment (bytes): enough for 16-byte vector loads and cuBLASLt operands.
pub const ALIGN: usize = deltaserve_plan::ALIGN as usize;

/// `bytes` rounded up to [`ALIGN`] (what a carve of `bytes` advances).
pub fn aligned(bytes: usize) -> usize {
    bytes.next_multiple_of(ALIGN)
}

/// A device range: raw pointer + byte length.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DevSpan {
    pub ptr: u64,
    pub bytes: usize,
}

impl DevSpan {
    /// The sub-range starting `offset` bytes in, `bytes` long (checked).
    pub fn slice(&self, offset: usize, bytes: usize) -> Option<DevSpan> {
        (offset.checked_add(bytes)? <= self.bytes).then(|| DevSpan { ptr: self.ptr + offset as u64, bytes })
    }
}

/// Handle of a region inside one arena.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RegionId(usize);

struct Region {
    name: String,
    base: u64,
    size: usize,
    used: usize,
}

/// Named regions of device memory with bump sub-allocation.
pub struct Arena {
    ctx: Arc<CudaContext>,
    regions: Vec<Region>,
    sealed: bool,
    /// Number of `cuMemAlloc` calls (one per region).
    driver_allocs: usize,
    /// Number of sub-allocations handed out.
    sub_allocs: usize,
    /// Largest total of bytes in use across all regions (sum of bump offsets).
    high_water: usize,
}

impl Arena {
    pub fn new(ctx: Arc<CudaContext>) -> Self {
        Arena { ctx, regions: Vec::new(), sealed: false, driver_allocs: 0, sub_allocs: 0, high_water: 0 }
    }

    /// Reserves a region of `bytes` bytes with one `cuMemAlloc`.
    pub fn add_region(&mut self, name: &str, bytes: usize) -> Result<RegionId, CudaError> {
        if self.sealed {
            return Err(self.err(name, "the arena is sealed".into()));
        }
        if self.regions.iter().any(|r| r.name == name) {
            return Err(self.err(name, "a region with this name exists".into()));
        }
        self.ctx.bind_to_thread().map_err(CudaError::driver("cuCtxSetCurrent"))?;
        // SAFETY: plain allocation; the pointer is freed exactly once in Drop.
        let base = unsafe { result::malloc_sync(bytes.max(1)) }.map_err(|e| CudaError::Arena {
            region: name.to_string(),
            msg: format!("cuMemAlloc of {bytes} bytes failed: {e}"),
        })?;
        self.driver_allocs += 1;
        self.regions.push(Region { name: name.to_string(), base, size: bytes, used: 0 });
        Ok(RegionId(self.regions.len() - 1))
    }

    /// Carves `bytes` bytes (start aligned to [`ALIGN`]) from a region.
    pub fn alloc(&mut self, region: RegionId, bytes: usize) -> Result<DevSpan, CudaError> {
        let r = self.regions.get(region.0).ok_or_else(|| self.err("?", format!("no region with id {}", region.0)))?;
        if self.sealed {
            return Err(self.err(&r.name, format!("allocation of {bytes} B after seal()")));
        }
        let start = aligned(r.used);
        let end = start.checked_add(bytes).filter(|&e| e <= r.size).ok_or_else(|| {
            self.err(&r.name, format!("out of space: {bytes} B requested at offset {start}, region holds {} B", r.size))
        })?;
        let span = DevSpan { ptr: r.base + start as u64, bytes };
        self.regions[region.0].used = end;
        self.sub_allocs += 1;
        let total: usize = self.regions.iter().map(|r| r.used).sum();
        self.high_water = self.high_water.max(total);
        Ok(span)
    }

    /// The whole region as one span (for planners that compute offsets themselves).
    pub fn region_span(&self, region: RegionId) -> Option<DevSpan> {
        self.regions.get(region.0).map(|r| DevSpan { ptr: r.base, bytes: r.size })
    }

    /// Forbids every further region or allocation.
    pub fn seal(&mut self) {
        self.sealed = true;
    }

    pub fn is_sealed(&self) -> bool {
        self.sealed
    }

    pub fn driver_allocs(&self) -> usize {
        self.driver_allocs
    }

    pub fn sub_allocs(&self) -> usize {
        self.sub_allocs
    }

    pub fn high_water(&self) -> usize {
        self.high_water
    }

    /// (name, size, used) for each region, in creation order.
    pub fn regions(&self) -> Vec<(String, usize, usize)> {
        self.regions.iter().map(|r| (r.name.clone(), r.size, r.used)).collect()
    }

    fn err(&self, region: &str, msg: String) -> CudaError {
        CudaError::Arena { region: region.to_string(), msg }
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_err() {
            return;
        }
        for r in &self.regions {
            // SAFETY: `base` came from malloc_sync and is freed once; errors at teardown are
            // ignored (nothing useful can be done with them in Drop).
            let _ = unsafe { result::free_sync(r.base) };
        }
    }
}
