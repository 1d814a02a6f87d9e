//! NCCL collectives for tensor parallelism, through cudarc's dynamically loaded NCCL: one
//! communicator per local GPU, created together ([`Communicators::new`], `ncclCommInitAll`), and the
//! two collectives a Megatron-style forward needs — an in-place all-reduce (sum) of bf16 / f32
//! buffers (after each row-parallel projection) and an all-gather (vocabulary-sharded logits). Buffers
//! are [`DevSpan`]s of the arena; each rank's collective runs on that rank's stream, so it is ordered
//! with the kernels around it (and can be captured in a CUDA graph like them).
//!
//! - NVLink SHARP / multicast stays off: `NCCL_NVLS_ENABLE=0` is set before the first communicator
//!   (the shared GPU hosts require it).
//! - A missing `libnccl.so` is an error, never a panic: [`nccl_present`] is checked first (cudarc
//!   panics on a call into a library it cannot load). cudarc dlopens `libnccl.so` (not the
//!   `libnccl.so.2` that wheels and runtime packages ship), so the hint says how to link it.
//! - One thread may drive all GPUs: the `*_all` calls wrap the ranks' calls in one NCCL group. With a
//!   thread per GPU, each thread calls the `*_rank` form for its rank.

use std::sync::Arc;

use cudarc::driver::CudaStream;
use cudarc::nccl::result::{self as nccl, NcclError};
use cudarc::nccl::sys;

use crate::arena::DevSpan;

/// Element type of a collective's buffers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CollDtype {
    F32,
    Bf16,
}

impl CollDtype {
    pub fn bytes(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::Bf16 => 2,
        }
    }
    fn nccl(self) -> sys::ncclDataType_t {
        match self {
            Self::F32 => sys::ncclDataType_t::ncclFloat32,
            Self::Bf16 => sys::ncclDataType_t::ncclBfloat16,
        }
    }
}

/// Errors of the collective layer.
#[derive(Debug, thiserror::Error)]
pub enum CollectiveError {
    #[error(
        "NCCL not found by dlopen (cudarc looks for `libnccl.so`): install NCCL 2.x (libnccl2, or the nvidia-nccl \
         wheel) and, if only `libnccl.so.2` exists, link it: `ln -s /path/to/libnccl.so.2 DIR/libnccl.so` with DIR on \
         LD_LIBRARY_PATH"
    )]
    LibraryMissing,
    /// `code` is NCCL's result (e.g. `ncclUnhandledCudaError`), `msg` its description.
    #[error("NCCL call `{call}` failed: {code} ({msg})")]
    Nccl { call: &'static str, code: String, msg: String },
    #[error("collective `{call}`: {msg}")]
    InvalidArgs { call: &'static str, msg: String },
}

fn nccl_err(call: &'static str) -> impl FnOnce(NcclError) -> CollectiveError {
    move |e| {
        // SAFETY: NCCL is loaded (a call into it just returned); the string is static and NUL-terminated.
        let msg = unsafe {
            let p = sys::ncclGetErrorString(e.0);
            if p.is_null() { String::new() } else { std::ffi::CStr::from_ptr(p).to_string_lossy().into_owned() }
        };
        CollectiveError::Nccl { call, code: format!("{:?}", e.0), msg }
    }
}

/// Whether dlopen finds NCCL (no symbol is called).
pub fn nccl_present() -> bool {
    // SAFETY: only tries `dlopen` on candidate names and drops the handle.
    unsafe { sys::is_culib_present() }
}

/// The loaded NCCL's version code (e.g. 22703 for 2.27.3), or an error when it is missing.
pub fn nccl_version() -> Result<i32, CollectiveError> {
    if !nccl_present() {
        return Err(CollectiveError::LibraryMissing);
    }
    nccl::get_nccl_version().map_err(nccl_err("ncclGetVersion"))
}

/// One NCCL communicator per local GPU (rank r = `streams[r]`'s device), created together.
pub struct Communicators {
    comms: Vec<sys::ncclComm_t>,
    streams: Vec<Arc<CudaStream>>,
}

// SAFETY: an NCCL communicator may be used from any thread as long as calls on one communicator
// are not concurrent; `&self` methods issue each rank's calls from the calling thread only, and the
// `*_rank` methods document that a rank is driven by one thread at a time.
unsafe impl Send for Communicators {}
unsafe impl Sync for Communicators {}

impl Communicators {
    /// Creates the communicators of `streams.len()` ranks (one stream per distinct local GPU;
    /// collectives of rank r run on `streams[r]`). Sets `NCCL_NVLS_ENABLE=0` first.
    pub fn new(streams: Vec<Arc<CudaStream>>) -> Result<Self, CollectiveError> {
        if !nccl_present() {
            return Err(CollectiveError::LibraryMissing);
        }
        if streams.is_empty() {
            return Err(CollectiveError::InvalidArgs { call: "ncclCommInitAll", msg: "no GPU given".into() });
        }
        let ordinals: Vec<i32> = streams.iter().map(|s| s.context().ordinal() as i32).collect();
        if (1..ordinals.len()).any(|i| ordinals[..i].contains(&ordinals[i])) {
            return Err(CollectiveError::InvalidArgs {
                call: "ncclCommInitAll",
                msg: format!("each rank needs its own GPU, got devices {ordinals:?}"),
            });
        }
        // SAFETY: set before NCCL reads its environment (at its first communicator); deltaserve reads no
        // environment variable concurrently at start-up, where communicators are made.
        unsafe { std::env::set_var("NCCL_NVLS_ENABLE", "0") };
        let mut comms = vec![std::ptr::null_mut(); streams.len()];
        // SAFETY: `comms` has room for one handle per device in `ordinals`.
        unsafe { nccl::comm_init_all(comms.as_mut_ptr(), ordinals.len() as i32, ordinals.as_ptr()) }
            .map_err(nccl_err("ncclCommInitAll"))?;
        Ok(Self { comms, streams })
    }

    /// Number of ranks.
    pub fn world(&self) -> usize {
        self.comms.len()
    }

    /// Rank r's stream.
    pub fn stream(&self, rank: usize) -> &Arc<CudaStream> {
        &self.streams[rank]
    }

    fn check(&self, call: &'static str, rank: usize, spans: &[(DevSpan, usize)]) -> Result<(), CollectiveError> {
        if rank >= self.world() {
            return Err(CollectiveError::InvalidArgs { call, msg: format!("rank {rank} of {}", self.world()) });
        }
        for (span, need) in spans {
            if span.bytes < *need {
                return Err(CollectiveError::InvalidArgs {
                    call,
                    msg: format!("buffer of {} bytes at {:#x}, {need} needed", span.bytes, span.ptr),
                });
            }
        }
        Ok(())
    }

    /// Rank `rank`'s part of an in-place all-reduce (sum) of `count` elements at `buf`, on its stream.
    /// Every rank must make the matching call (another thread, or inside a group).
    pub fn all_reduce_sum_rank(
        &self,
        rank: usize,
        buf: DevSpan,
        count: usize,
        dtype: CollDtype,
    ) -> Result<(), CollectiveError> {
        self.check("ncclAllReduce", rank, &[(buf, count * dtype.bytes())])?;
        let p = buf.ptr as *mut std::ffi::c_void;
        // SAFETY: `buf` covers `count` elements (checked); the stream belongs to this rank's device.
        unsafe {
            nccl::all_reduce(
                p,
                p,
                count,
                dtype.nccl(),
                sys::ncclRedOp_t::ncclSum,
                self.comms[rank],
                self.streams[rank].cu_stream() as _,
            )
        }
        .map(|_| ())
        .map_err(nccl_err("ncclAllReduce"))
    }

    /// Rank `rank`'s part of an all-gather: its `count` elements at `send` land at
    /// `recv[rank·count..]` of every rank; `recv` holds `world·count` elements in rank order.
    pub fn all_gather_rank(
        &self,
        rank: usize,
        send: DevSpan,
        recv: DevSpan,
        count: usize,
        dtype: CollDtype,
    ) -> Result<(), CollectiveError> {
        let e = dtype.bytes();
        self.check("ncclAllGather", rank, &[(send, count * e), (recv, self.world() * count * e)])?;
        // SAFETY: both buffers are large enough (checked); the stream belongs to this rank's device.
        unsafe {
            nccl::all_gather(
                send.ptr as *const std::ffi::c_void,
                recv.ptr as *mut std::ffi::c_void,
                count,
                dtype.nccl(),
                self.comms[rank],
                self.streams[rank].cu_stream() as _,
            )
        }
        .map(|_| ())
        .map_err(nccl_err("ncclAllGather"))
    }

    /// All ranks' in-place all-reduce (sum) from one thread: `bufs[r]` on rank r, in one NCCL group.
    pub fn all_reduce_sum_all(&self, bufs: &[DevSpan], count: usize, dtype: CollDtype) -> Result<(), CollectiveError> {
        self.ranks_match("ncclAllReduce", bufs.len())?;
        self.grouped(|c| (0..c.world()).try_for_each(|r| c.all_reduce_sum_rank(r, bufs[r], count, dtype)))
    }

    /// All ranks' all-gather from one thread (see [`Self::all_gather_rank`]), in one NCCL group.
    pub fn all_gather_all(
        &self,
        send: &[DevSpan],
        recv: &[DevSpan],
        count: usize,
        dtype: CollDtype,
    ) -> Result<(), CollectiveError> {
        self.ranks_match("ncclAllGather", send.len().min(recv.len()))?;
        self.ranks_match("ncclAllGather", send.len().max(recv.len()))?;
        self.grouped(|c| (0..c.world()).try_for_each(|r| c.all_gather_rank(r, send[r], recv[r], count, dtype)))
    }

    fn ranks_match(&self, call: &'static str, n: usize) -> Result<(), CollectiveError> {
        if n != self.world() {
            return Err(CollectiveError::InvalidArgs { call, msg: format!("{n} buffers for {} ranks", self.world()) });
        }
        Ok(())
    }

    /// Runs `f` between `ncclGroupStart` and `ncclGroupEnd` (the group is always closed).
    fn grouped(&self, f: impl FnOnce(&Self) -> Result<(), CollectiveError>) -> Result<(), CollectiveError> {
        nccl::group_start().map_err(nccl_err("ncclGroupStart"))?;
        let r = f(self);
        let end = nccl::group_end().map_err(nccl_err("ncclGroupEnd"));
        r.and(end.map(|_| ()))
    }
}

impl Drop for Communicators {
    fn drop(&mut self) {
        for &c in &self.comms {
            // SAFETY: each handle came from ncclCommInitAll and is destroyed once. Errors cannot be
            // reported from drop; a failing destroy leaks the communicator.
            let _ = unsafe { nccl::comm_destroy(c) };
        }
    }
}
