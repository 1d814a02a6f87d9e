//! deltaserve-cuda: the CUDA backend's op layer for Qwen3.5/3.6 hybrid models.
//!
//! - [`runtime`]: library checks, device open (sm_80+), stream, set-up copies;
//! - [`arena`]: named device regions (one `cuMemAlloc` each) with bump sub-allocation and a seal;
//! - [`nvrtc`]: run-time compilation of `kernels/*.cu` for the device's exact arch, cached;
//!   [`nvrtc::kernels_check`] compiles all of them for sm_80/86/89/90 without a GPU;
//! - [`ops`]: one launcher file per kernel file (same name), raw `u64` device pointers in;
//! - [`gemm`]: `y = x · Wᵀ` through cuBLASLt with per-shape cached algorithms;
//! - [`w4`]: the device format of 4-bit (W4A16) linears: GPTQ conversion, reference quantiser;
//! - [`w4_host`]: int4 linears in that format computed by the host CPU (experts kept in host memory);
//!   [`host_experts_mlp`]: a sparse layer's routed experts for a step's rows, computed by the host;
//! - [`collective`]: NCCL communicators over local GPUs, in-place all-reduce (sum) and all-gather;
//! - [`backend`]: [`CudaBackend`], the engine's `Backend` over the static plan's memory;
//! - [`switches`]: the `DELTASERVE_*` environment switches, read once;
//! - [`trace`]: an opt-in timeline of every kernel block (`DELTASERVE_TRACE`), for profiling;
//! - [`gdn_bench`]: timing of the chunked DeltaNet prefill kernels at a model's shape (`bench`).
//!
//! Dtypes: activations bf16 in device memory, math in f32, DeltaNet state f32.

pub mod arena;
pub mod backend;
pub mod collective;
pub mod error;
pub mod gdn_bench;
pub mod gemm;
pub mod host_experts_mlp;
pub mod nvrtc;
pub mod ops;
pub mod runtime;
pub mod switches;
pub mod tp;
pub mod trace;
pub mod w4;
pub mod w4_host;

pub use arena::{Arena, DevSpan, RegionId};
pub use backend::{CudaBackend, StepPhases, WeightSource};
pub use error::CudaError;
pub use nvrtc::{AttnTiling, KernelDims, KernelsReport, KvFormats, kernels_check};
pub use ops::Kernels;
pub use runtime::{LibStatus, Runtime, device_count};
pub use switches::Switches;
pub use tp::TpBackend;
