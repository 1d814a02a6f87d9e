//! What the GPU benchmarks (`bench_w4.rs`, `bench_fp8.rs`) share: a device arena to allocate from, timing by
//! CUDA events, and the device-to-device copy bandwidth their ratios are taken against.
#![allow(dead_code)]

use deltaserve_cuda::arena::{Arena, RegionId};
use deltaserve_cuda::{CudaError, Runtime};

pub type R<T> = Result<T, CudaError>;

/// One arena region of `bytes` on the device, allocated from front to back.
pub struct Dev<'a> {
    pub rt: &'a Runtime,
    arena: Arena,
    reg: RegionId,
}

impl<'a> Dev<'a> {
    pub fn new(rt: &'a Runtime, bytes: usize) -> R<Self> {
        let mut arena = Arena::new(rt.context().clone());
        let reg = arena.add_region("bench", bytes)?;
        Ok(Dev { rt, arena, reg })
    }
    pub fn alloc(&mut self, bytes: usize) -> R<u64> {
        Ok(self.arena.alloc(self.reg, bytes.max(16))?.ptr)
    }
}

/// Mean milliseconds per call of `f` over `iters` calls (after 3 warm-up calls), by events.
pub fn time_ms(rt: &Runtime, iters: usize, mut f: impl FnMut(usize) -> R<()>) -> R<f64> {
    let s = rt.stream();
    let de = CudaError::driver;
    for i in 0..3 {
        f(i)?;
    }
    let ev = || {
        rt.context()
            .new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(CudaError::driver("cuEventCreate"))
    };
    let (e0, e1) = (ev()?, ev()?);
    e0.record(s).map_err(de("cuEventRecord"))?;
    for i in 0..iters {
        f(i)?;
    }
    e1.record(s).map_err(de("cuEventRecord"))?;
    e1.synchronize().map_err(de("cuEventSynchronize"))?;
    Ok(e0.elapsed_ms(&e1).map_err(de("cuEventElapsedTime"))? as f64 / iters as f64)
}

/// GB/s of a 1 GiB device-to-device copy (bytes read + written over its time), in an arena of its own.
pub fn copy_bandwidth(rt: &Runtime) -> R<f64> {
    let bytes = 1usize << 30;
    let mut d = Dev::new(rt, 2 * bytes + 4096)?;
    let (a, b) = (d.alloc(bytes)?, d.alloc(bytes)?);
    rt.memset(a, 0x3c, bytes)?;
    let s = rt.stream().cu_stream();
    let ms = time_ms(rt, 10, |_| {
        // SAFETY: both spans are `bytes` long and do not overlap.
        unsafe { cudarc::driver::result::memcpy_dtod_async(b, a, bytes, s) }
            .map_err(CudaError::driver("cuMemcpyDtoDAsync"))
    })?;
    Ok(2.0 * bytes as f64 / (ms * 1e-3) / 1e9)
}
