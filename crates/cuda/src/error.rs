//! The crate's error type: every failure names what was being done (library, kernel and launch
//! dims, arena region, GEMM shape), so a log line is enough to find the cause. A library's error is part
//! of the message, not also a `source()` (an error chain would print it twice).

use cudarc::cublaslt::result::CublasError;
use cudarc::driver::DriverError;
use cudarc::nvrtc::result::NvrtcError;

#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// A CUDA library could not be dlopened (checked before any call, since cudarc panics then).
    #[error("CUDA library `{lib}` not found by dlopen ({hint})")]
    LibraryMissing { lib: &'static str, hint: &'static str },
    /// A driver call outside a kernel launch failed.
    #[error("CUDA driver call `{call}` failed: {cause}")]
    Driver { call: &'static str, cause: DriverError },
    /// The GPU is older than Ampere.
    #[error("GPU {ordinal} ({name}) is sm_{major}{minor}; deltaserve's CUDA backend needs sm_80 or newer")]
    UnsupportedArch { ordinal: usize, name: String, major: i32, minor: i32 },
    /// No device with this ordinal.
    #[error("no CUDA device {ordinal} (the driver reports {count})")]
    NoDevice { ordinal: usize, count: i32 },
    /// NVRTC rejected a kernel source; `log` is the compiler's output.
    #[error("NVRTC could not compile `{module}` for {arch} with [{options}]:\n{log}")]
    Compile { module: String, arch: String, options: String, log: String },
    /// An NVRTC API call failed.
    #[error("NVRTC call `{call}` for `{module}` failed: {cause}")]
    Nvrtc { call: &'static str, module: String, cause: NvrtcError },
    /// A kernel launch failed.
    #[error("launch of `{kernel}` (grid {grid:?}, block {block:?}, smem {smem} B) failed: {cause}")]
    Launch { kernel: &'static str, grid: (u32, u32, u32), block: (u32, u32, u32), smem: u32, cause: DriverError },
    /// A launcher's arguments do not describe a valid launch.
    #[error("`{kernel}`: invalid arguments: {msg}")]
    InvalidArgs { kernel: &'static str, msg: String },
    /// A kernel was requested that the loaded module set does not contain.
    #[error("kernel `{0}` is not loaded")]
    UnknownKernel(&'static str),
    /// Arena misuse: sealed, out of space, unknown region.
    #[error("arena region `{region}`: {msg}")]
    Arena { region: String, msg: String },
    /// Loading or converting the model's weights failed.
    #[error("weights: {0}")]
    Weights(String),
    /// A model this backend does not run (yet).
    #[error("{0}")]
    UnsupportedModel(String),
    /// The memory plan does not fit what the backend needs (names the buffer and both sizes).
    #[error("plan: {0}")]
    Plan(String),
    /// Pinned host memory the backend needs is not there (names the bytes and what is available).
    #[error("host memory: {0}")]
    HostMemory(String),
    /// A cuBLASLt call failed.
    #[error("cuBLASLt `{call}` failed for y[{n}x{m}] = x[{n}x{k}] * W[{m}x{k}]^T: {cause}")]
    Blas { call: &'static str, m: usize, n: usize, k: usize, cause: CublasError },
}

impl CudaError {
    /// `map_err` adapter naming the driver call.
    pub fn driver(call: &'static str) -> impl FnOnce(DriverError) -> CudaError {
        move |cause| CudaError::Driver { call, cause }
    }
}
