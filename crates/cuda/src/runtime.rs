//! Opening the GPU: library presence checks (before any cudarc call, which would panic on a
//! missing library), device 0 context with event tracking disabled (we synchronise by stream
//! order; cudarc's per-slice events would add work to every launch), host<->device copies
//! for set-up and tests (not for the hot path), and pinned host allocations.

use std::sync::Arc;

use cudarc::driver::sys::CUdevice_attribute;
use cudarc::driver::{CudaContext, CudaStream, result};

use crate::error::CudaError;

/// Which CUDA libraries dlopen finds on this machine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LibStatus {
    pub driver: bool,
    pub nvrtc: bool,
    pub cublas: bool,
    pub cublaslt: bool,
}

impl LibStatus {
    /// Probes each library with dlopen only (no symbol is called).
    pub fn probe() -> Self {
        // SAFETY: each function only tries `dlopen` on candidate names and drops the handle.
        unsafe {
            LibStatus {
                driver: cudarc::driver::sys::is_culib_present(),
                nvrtc: cudarc::nvrtc::sys::is_culib_present(),
                cublas: cudarc::cublas::sys::is_culib_present(),
                cublaslt: cudarc::cublaslt::sys::is_culib_present(),
            }
        }
    }

    /// The first missing library as an error, or Ok if all are present.
    pub fn require_all(&self) -> Result<(), CudaError> {
        let missing = |lib, hint| Err(CudaError::LibraryMissing { lib, hint });
        if !self.driver {
            return missing(
                "libcuda.so.1",
                "no NVIDIA driver on this machine; install the driver (>= 580 for CUDA 13)",
            );
        }
        if !self.nvrtc {
            return missing(
                "libnvrtc.so.13",
                "install the CUDA 13 toolkit or the nvidia-cuda-nvrtc wheel and add its lib dir to LD_LIBRARY_PATH",
            );
        }
        if !self.cublas {
            return missing("libcublas.so.13", "install the CUDA 13 toolkit or the nvidia-cublas wheel");
        }
        if !self.cublaslt {
            return missing("libcublasLt.so.13", "install the CUDA 13 toolkit or the nvidia-cublas wheel");
        }
        Ok(())
    }
}

/// One GPU: its context, the stream every op launches on, and the facts the launchers need.
pub struct Runtime {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    /// Compute capability (major, minor).
    pub cc: (i32, i32),
    pub name: String,
    pub sm_count: i32,
    /// Largest dynamic shared memory a block may opt into (bytes).
    pub max_smem_optin: i32,
}

/// Number of CUDA devices the driver reports (after `CUDA_VISIBLE_DEVICES`).
pub fn device_count() -> Result<usize, CudaError> {
    LibStatus::probe().require_all()?;
    result::init().map_err(CudaError::driver("cuInit"))?;
    let n = result::device::get_count().map_err(CudaError::driver("cuDeviceGetCount"))?;
    Ok(n.max(0) as usize)
}

impl Runtime {
    /// Opens device `ordinal`. Errors (never panics) when a library is missing, there is no such
    /// device, or it is older than sm_80.
    pub fn open(ordinal: usize) -> Result<Runtime, CudaError> {
        LibStatus::probe().require_all()?;
        result::init().map_err(CudaError::driver("cuInit"))?;
        let count = result::device::get_count().map_err(CudaError::driver("cuDeviceGetCount"))?;
        if ordinal as i64 >= count as i64 {
            return Err(CudaError::NoDevice { ordinal, count });
        }
        let ctx = CudaContext::new(ordinal).map_err(CudaError::driver("cuDevicePrimaryCtxRetain"))?;
        // SAFETY: called before anything is allocated through this context.
        unsafe { ctx.disable_event_tracking() };
        let cc = ctx.compute_capability().map_err(CudaError::driver("cuDeviceGetAttribute(compute capability)"))?;
        let name = ctx.name().map_err(CudaError::driver("cuDeviceGetName"))?;
        if cc.0 < 8 {
            return Err(CudaError::UnsupportedArch { ordinal, name, major: cc.0, minor: cc.1 });
        }
        let attr = |a, call| ctx.attribute(a).map_err(CudaError::driver(call));
        let sm_count = attr(
            CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            "cuDeviceGetAttribute(multiprocessor count)",
        )?;
        let max_smem_optin = attr(
            CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
            "cuDeviceGetAttribute(max shared memory per block opt-in)",
        )?;
        let stream = ctx.new_stream().map_err(CudaError::driver("cuStreamCreate"))?;
        Ok(Runtime { ctx, stream, cc, name, sm_count, max_smem_optin })
    }

    /// Device memory free right now, as the driver reports it (bytes).
    pub fn free_memory(&self) -> Result<u64, CudaError> {
        Ok(self.memory_info()?.0)
    }

    /// The device's (free, total) memory in bytes.
    pub fn memory_info(&self) -> Result<(u64, u64), CudaError> {
        self.ctx.bind_to_thread().map_err(CudaError::driver("cuCtxSetCurrent"))?;
        let (free, total) = self.ctx.mem_get_info().map_err(CudaError::driver("cuMemGetInfo"))?;
        Ok((free as u64, total as u64))
    }

    /// `sm_XY` for NVRTC, e.g. `sm_90` (never `sm_90a`: no Hopper-only instructions).
    pub fn arch(&self) -> String {
        format!("sm_{}{}", self.cc.0, self.cc.1)
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Waits for all work on the stream; reports asynchronous kernel faults.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.stream.synchronize().map_err(CudaError::driver("cuStreamSynchronize"))
    }

    /// Copies `src` to device address `dst` and waits (set-up and tests only).
    pub fn upload<T: Copy>(&self, dst: u64, src: &[T]) -> Result<(), CudaError> {
        self.ctx.bind_to_thread().map_err(CudaError::driver("cuCtxSetCurrent"))?;
        // SAFETY: the caller passes a device range of at least size_of_val(src) bytes; we wait
        // for the copy before `src` can be dropped.
        unsafe { result::memcpy_htod_async(dst, src, self.stream.cu_stream()) }
            .map_err(CudaError::driver("cuMemcpyHtoDAsync"))?;
        self.synchronize()
    }

    /// Copies `dst.len()` elements from device address `src` (waits for the stream first).
    pub fn download<T: Copy>(&self, dst: &mut [T], src: u64) -> Result<(), CudaError> {
        self.ctx.bind_to_thread().map_err(CudaError::driver("cuCtxSetCurrent"))?;
        // SAFETY: the caller passes a device range of at least size_of_val(dst) bytes; we wait
        // for the copy before returning.
        unsafe { result::memcpy_dtoh_async(dst, src, self.stream.cu_stream()) }
            .map_err(CudaError::driver("cuMemcpyDtoHAsync"))?;
        self.synchronize()
    }

    /// Copies `bytes` bytes from device address `src` to `dst` on the stream (asynchronous; benchmarks).
    pub fn copy_device(&self, dst: u64, src: u64, bytes: usize) -> Result<(), CudaError> {
        // SAFETY: the caller passes two device ranges of at least `bytes` bytes.
        unsafe { result::memcpy_dtod_async(dst, src, bytes, self.stream.cu_stream()) }
            .map_err(CudaError::driver("cuMemcpyDtoDAsync"))
    }

    /// Fills `bytes` bytes at `dst` with `value` on the stream (asynchronous).
    pub fn memset(&self, dst: u64, value: u8, bytes: usize) -> Result<(), CudaError> {
        // SAFETY: the caller passes a device range of at least `bytes` bytes.
        unsafe { result::memset_d8_async(dst, value, bytes, self.stream.cu_stream()) }
            .map_err(CudaError::driver("cuMemsetD8Async"))
    }
}

/// A pinned (page-locked) host allocation, freed when dropped. The GPU copies to and from it
/// asynchronously, without the driver's staging copy of pageable memory.
/// The memory starts uninitialised: callers write it (or copy into it) before reading.
pub struct PinnedHost {
    ptr: *mut u8,
    bytes: usize,
    /// The address kernels read it at (the host address under unified addressing).
    dev: u64,
    /// Keeps the context alive until the memory is freed.
    ctx: Arc<CudaContext>,
}

impl PinnedHost {
    /// Allocates `bytes` bytes (at least one) of pinned host memory in `rt`'s context.
    pub fn new(rt: &Runtime, bytes: usize) -> Result<PinnedHost, CudaError> {
        rt.ctx.bind_to_thread().map_err(CudaError::driver("cuCtxSetCurrent"))?;
        // SAFETY: a plain pinned allocation, freed once in Drop.
        let ptr = unsafe { result::malloc_host(bytes.max(1), 0) }.map_err(CudaError::driver("cuMemHostAlloc"))?;
        Ok(PinnedHost { ptr: ptr as *mut u8, bytes, dev: ptr as u64, ctx: rt.ctx.clone() })
    }

    /// Allocates `bytes` bytes (at least one) of pinned host memory mapped into the device's address
    /// space (`CU_MEMHOSTALLOC_DEVICEMAP`, `PORTABLE`: every context's), for kernels to read across the
    /// bus at [`PinnedHost::device_ptr`] (`cuMemHostGetDevicePointer`; the host address itself under
    /// the unified addressing of every 64-bit Linux system the backend runs on).
    pub fn mapped(rt: &Runtime, bytes: usize) -> Result<PinnedHost, CudaError> {
        use cudarc::driver::sys;
        rt.ctx.bind_to_thread().map_err(CudaError::driver("cuCtxSetCurrent"))?;
        let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
        // SAFETY: a pinned allocation, freed once in Drop (owned by the value below from here on).
        let ptr = unsafe { result::malloc_host(bytes.max(1), flags) }.map_err(CudaError::driver("cuMemHostAlloc"))?;
        let mut host = PinnedHost { ptr: ptr as *mut u8, bytes, dev: 0, ctx: rt.ctx.clone() };
        let mut dev: sys::CUdeviceptr = 0;
        // SAFETY: `ptr` was allocated just above with CU_MEMHOSTALLOC_DEVICEMAP; flags must be 0.
        unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dev, ptr, 0) }
            .result()
            .map_err(CudaError::driver("cuMemHostGetDevicePointer"))?;
        host.dev = dev;
        Ok(host)
    }

    pub fn ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// The address kernels read the memory at: [`PinnedHost::mapped`]'s device pointer, else the host
    /// address (what unified addressing maps it to).
    pub fn device_ptr(&self) -> u64 {
        self.dev
    }

    /// Usable bytes (what was asked for).
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Drop for PinnedHost {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: allocated by malloc_host in new(), freed once; no copy into or out of it is in
            // flight (its owners synchronise their stream before dropping it).
            let _ = unsafe { result::free_host(self.ptr as *mut std::ffi::c_void) };
        }
    }
}
