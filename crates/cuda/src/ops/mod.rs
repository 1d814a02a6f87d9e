//! Kernel launchers: one file per `kernels/*.cu` file, same name. Each launcher takes raw `u64`
//! device pointers and dims, checks the dims, and enqueues on the given stream (asynchronous;
//! faults surface at the next synchronisation). [`Kernels`] holds every compiled function.

pub mod argmax;
pub mod attention;
mod attention_tiling;
pub mod conv;
pub mod elementwise;
pub mod embed;
pub mod feed;
pub mod fp8;
pub mod gdn_chunk;
pub mod gdn_decode;
pub mod gdn_gate;
pub mod gdn_overlap;
pub mod gemv;
pub mod init;
pub mod kv_cache;
pub mod kv_quant;
pub mod moe;
pub mod moe_w4;
pub mod mtp;
pub mod norm;
pub mod rope;
pub mod sample;
pub mod tma;
pub mod vision;
pub mod w4_gemm;
pub mod w4a16;

use std::collections::HashMap;

use cudarc::driver::CudaFunction;
use cudarc::driver::sys::CUfunction_attribute;
use cudarc::nvrtc::Ptx;

use crate::error::CudaError;
use crate::nvrtc::{self, AttnTiling, KernelDims, KvFormats, SOURCES};
use crate::runtime::Runtime;
use crate::switches::Switches;

/// Every kernel of the crate, compiled for one device and one set of [`KernelDims`].
pub struct Kernels {
    funcs: HashMap<&'static str, CudaFunction>,
    pub dims: KernelDims,
    /// KV-cache formats the attention kernels were compiled for ([`Kernels::load`]: bf16).
    pub kv: KvFormats,
    /// Tiling of the attention prefill kernel.
    pub attn: AttnTiling,
    pub arch: String,
    /// Wall time of compiling + loading all modules (ms).
    pub load_ms: f64,
    /// Launch the kernels of a decode step ([`launch_pdl!`]: the GEMVs, norms, SwiGLU, the DeltaNet
    /// and attention decode kernels, RoPE, KV writes, embedding gathers, argmax) with programmatic
    /// stream serialization (sm_90 and later, see [`launch_programmatic`]): each may launch while the
    /// kernel before it finishes; the GEMVs stream their first weights and the DeltaNet decode kernel
    /// loads its state before waiting for it. [`pdl_enabled`].
    pub pdl: bool,
    /// Blocks of the int4 GEMV the GPU holds at once (its occupancy per SM × SMs: 2 per SM, as its
    /// registers allow on sm_80 to sm_90; 264 on the H200). [`w4a16::gemv_config`].
    pub w4_slots: usize,
    /// Decode attention on tensor cores (`attn_decode_mma`) where the cache formats allow it
    /// ([`attention::decode_mma_supported`]: a 4-bit K or V at head dims % 64 == 0 only);
    /// `DELTASERVE_DECODE_ATTN=split` at load (or false here) keeps `attn_decode_split`, the A/B switch
    /// of the benchmarks.
    pub decode_mma: bool,
    /// A speculative verify chunk's rows attend together (`attn_verify_mma`, each K/V tile read once for
    /// all of them) where the cache formats allow it ([`attention::verify_mma_supported`]: codes in K and
    /// V) and the tensor-core decode kernel runs; `DELTASERVE_VERIFY_ATTN=rows` at load (or false here)
    /// runs them one by one as decode queries, the A/B switch of the benchmarks.
    pub verify_mma: bool,
    /// How the chunked DeltaNet prefill walks its chunks: with the output on warps of its own where a block
    /// may have the shared memory ([`gdn_chunk::Walk::choose`]); `DELTASERVE_GDN_WALK=one-stream` at load keeps
    /// the one-stream walk, the A/B switch of the benchmarks.
    pub gdn_walk: gdn_chunk::Walk,
    /// Whether the chunked DeltaNet prefill may run each piece's walk beside the next piece's prep
    /// ([`gdn_overlap`]: with an f32 state; `DELTASERVE_GDN_OVERLAP=0` at load: never), and the GPU's SMs
    /// ([`gdn_overlap::piece_for`]).
    pub gdn_overlap: bool,
    pub sm_count: usize,
}

impl Kernels {
    /// Compiles (NVRTC, in parallel, cached per process) and loads every module, and raises the
    /// dynamic shared-memory limit of the kernels that need more than 48 KB.
    pub fn load(rt: &Runtime, dims: KernelDims) -> Result<Kernels, CudaError> {
        Self::load_kv(rt, dims, KvFormats::BF16)
    }

    /// [`Kernels::load`] with the attention kernels reading a KV cache stored in `kv`. The default
    /// tiling, or with `DELTASERVE_ATTN_PREFILL=pair` the warp-pair prefill kernel (`attn_prefill`,
    /// 32-key tiles) instead of the wide one: an A/B switch for comparing the two end to end; with
    /// `DELTASERVE_ATTN_PREFILL=wide` the wide kernel on Hopper too, instead of the warp-specialised or
    /// warpgroup one ([`attention::producer_copies`] chooses by the cache's formats);
    /// `DELTASERVE_ATTN_PREFILL=wg` the warpgroup one whose threads all load (`attn_prefill_wg`),
    /// `DELTASERVE_ATTN_PREFILL=ws` the warp-specialised one (`attn_prefill_ws`) over any cache.
    pub fn load_kv(rt: &Runtime, dims: KernelDims, kv: KvFormats) -> Result<Kernels, CudaError> {
        let s = Switches::get();
        let tiling = if s.attn_prefill_pair {
            AttnTiling { keys: 32, wide: false, ..AttnTiling::DEFAULT }
        } else {
            let d = AttnTiling::DEFAULT;
            let tma = match (s.attn_prefill_ws, s.attn_prefill_wg) {
                (true, _) => true,
                (_, true) => false,
                _ => attention::producer_copies(&kv),
            };
            AttnTiling { wgmma: d.wgmma && !s.attn_prefill_wide, tma: d.tma && tma, ..d }
        };
        Self::load_tiled(rt, dims, kv, tiling)
    }

    /// [`Kernels::load_kv`] with the attention prefill kernel tiled as `attn` (benchmarks compare tilings).
    pub fn load_tiled(rt: &Runtime, dims: KernelDims, kv: KvFormats, attn: AttnTiling) -> Result<Kernels, CudaError> {
        dims.validate()?;
        kv.validate()?;
        attn.validate(&dims)?;
        // From here on `attn` is the tiling that runs (`wide`: the wide prefill kernel at `keys`).
        let attn = attention::resolve_tiling(&dims, &kv, attn, rt.cc, rt.max_smem_optin.max(0) as usize);
        let t0 = std::time::Instant::now();
        let arch = rt.arch();
        let trace = crate::trace::defines(rt)?;
        let cubins: Vec<Result<nvrtc::Cubin, CudaError>> = std::thread::scope(|scope| {
            let hs: Vec<_> = SOURCES
                .iter()
                .map(|src| {
                    // The warpgroup prefill kernel's wgmma needs the arch-specific build.
                    let arch = if attn.wgmma && src.module == "attention" { nvrtc::HOPPER_ARCH } else { arch.as_str() };
                    let mut defines = dims.defines(src.module);
                    defines.extend(kv.defines(src.module));
                    defines.extend(attn.defines(&dims, src.module));
                    defines.extend(trace.iter().cloned());
                    scope.spawn(move || nvrtc::compile(src, arch, &defines, false))
                })
                .collect();
            hs.into_iter()
                .map(|h| {
                    h.join().unwrap_or_else(|_| {
                        Err(CudaError::InvalidArgs { kernel: "nvrtc", msg: "compiler thread panicked".into() })
                    })
                })
                .collect()
        });
        let mut funcs = HashMap::new();
        for (src, cubin) in SOURCES.iter().zip(cubins) {
            let cubin = cubin?;
            let module = rt
                .context()
                .load_module(Ptx::from_binary(cubin.image.as_ref().clone()))
                .map_err(CudaError::driver("cuModuleLoadData"))?;
            for &name in src.functions {
                let f = module.load_function(name).map_err(CudaError::driver("cuModuleGetFunction"))?;
                funcs.insert(name, f);
            }
        }
        let switches = Switches::get();
        let pdl = pdl_enabled(rt.cc, switches.pdl.as_deref());
        let decode_mma = attention::decode_mma_supported(&kv, dims.attn_head_dim) && !switches.decode_attn_split;
        let load_ms = t0.elapsed().as_secs_f64() * 1e3;
        let verify_mma =
            decode_mma && attention::verify_mma_supported(&kv, dims.attn_head_dim) && !switches.verify_attn_rows;
        let gdn_walk = gdn_chunk::Walk::choose(&dims, rt.max_smem_optin.max(0) as usize, switches.gdn_walk_one_stream);
        let gdn_overlap = switches.gdn_overlap && !dims.state_bf16;
        let sm_count = rt.sm_count.max(1) as usize;
        let mut k = Kernels {
            funcs,
            dims,
            kv,
            attn,
            arch,
            load_ms,
            pdl,
            w4_slots: 0,
            decode_mma,
            verify_mma,
            gdn_walk,
            gdn_overlap,
            sm_count,
        };
        for (name, bytes) in [
            ("gdn_chunk_prep", gdn_chunk::prep_smem_bytes(&dims)),
            ("gdn_chunk_state", gdn_chunk::state_smem_bytes(&dims)),
            ("gdn_chunk_state_bf16", gdn_chunk::state_smem_bytes(&dims)),
        ]
        .into_iter()
        // The warp-specialised walk where it runs.
        .chain(
            (gdn_walk == gdn_chunk::Walk::OutputWarps).then(|| ("gdn_chunk_state_ws", gdn_chunk::ws_smem_bytes(&dims))),
        )
        // The prefill kernel that runs (the other is never launched with these kernels).
        .chain(std::iter::once((attention::prefill_kernel(&attn), attention::prefill_kernel_smem(&dims, &kv, &attn))))
        // attn_prefill_ws's fallback where a page size does not allow its boxes.
        .chain(attn.tma.then(|| {
            let wg = AttnTiling { tma: false, ..attn };
            (attention::prefill_kernel(&wg), attention::prefill_kernel_smem(&dims, &kv, &wg))
        }))
        .chain(w4a16::PAIR_KERNELS.iter().map(|&n| (n, w4a16::PAIR_SMEM_BYTES)))
        .chain(w4a16::FOLD_KERNELS.iter().map(|&n| (n, w4a16::FOLD_KERNEL_SMEM_BYTES)))
        // (Tests fill every byte of an SM's shared memory: init::fill_smem.)
        .chain(std::iter::once(("init_smem", rt.max_smem_optin.max(0) as usize)))
        .chain(w4_gemm::KERNELS.iter().map(|&(n, tokens)| (n, w4_gemm::smem_bytes(tokens))))
        .chain(moe_w4::KERNELS.iter().map(|&n| (n, moe_w4::smem_bytes(n))))
        .chain(std::iter::once(("gemm_fp8", fp8::GEMM_SMEM_BYTES)))
        {
            if bytes as i64 > rt.max_smem_optin as i64 {
                return Err(CudaError::InvalidArgs {
                    kernel: name,
                    msg: format!("needs {bytes} B of shared memory, the device allows {}", rt.max_smem_optin),
                });
            }
            k.func(name)?
                .set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, bytes as i32)
                .map_err(CudaError::driver("cuFuncSetAttribute(max dynamic smem)"))?;
        }
        let per_sm = k
            .func(w4a16::PAIR_KERNELS[0])?
            .occupancy_max_active_blocks_per_multiprocessor(w4a16::BLOCK_THREADS, w4a16::PAIR_SMEM_BYTES, None)
            .map_err(CudaError::driver("cuOccupancyMaxActiveBlocksPerMultiprocessor"))?;
        k.w4_slots = per_sm.max(1) as usize * rt.sm_count.max(1) as usize;
        Ok(k)
    }

    /// Whether attention prefill runs `attn_prefill_wide` (see [`AttnTiling::wide`]); the tile
    /// table follows ([`attention::tile_table`]).
    pub fn attn_wide(&self) -> bool {
        self.attn.wide
    }

    /// The attention prefill kernel these kernels launch.
    pub fn attn_prefill_kernel(&self) -> &'static str {
        attention::prefill_kernel(&self.attn)
    }

    pub(crate) fn func(&self, name: &'static str) -> Result<&CudaFunction, CudaError> {
        self.funcs.get(name).ok_or(CudaError::UnknownKernel(name))
    }
}

/// `launch!(kernels, stream, "name", grid, block, smem; arg_idents...)`: every argument must be
/// a local binding (its address is passed to the driver and must outlive the launch call).
macro_rules! launch {
    ($k:expr, $stream:expr, $name:expr, $grid:expr, $block:expr, $smem:expr; $($arg:ident),* $(,)?) => {{
        use cudarc::driver::PushKernelArg as _;
        let f = $k.func($name)?;
        let cfg = cudarc::driver::LaunchConfig {
            grid_dim: $grid,
            block_dim: $block,
            shared_mem_bytes: $smem,
        };
        let mut b = $stream.launch_builder(f);
        $( b.arg(&$arg); )*
        // SAFETY: argument order and types match the kernel signature in kernels/*.cu, and the
        // launcher validated the dims that bound every device access.
        unsafe { b.launch(cfg) }.map(|_| ()).map_err(|source| $crate::error::CudaError::Launch {
            kernel: $name,
            grid: cfg.grid_dim,
            block: cfg.block_dim,
            smem: cfg.shared_mem_bytes,
            cause: source,
        })
    }};
}
pub(crate) use launch;

/// Whether kernels launch programmatically on a GPU of compute capability `cc`: from sm_90 on
/// (`griddepcontrol` is Hopper's), unless `DELTASERVE_PDL` (`env`) is `0` (an A/B switch).
pub fn pdl_enabled(cc: (i32, i32), env: Option<&str>) -> bool {
    cc.0 >= 9 && env != Some("0")
}

/// [`launch!`] for a kernel that may overlap the previous kernel in the stream: with `k.pdl` it is
/// launched by [`launch_programmatic`], else like [`launch!`]. The kernel must `pdl_wait()` before
/// touching anything the previous kernel reads or writes, and in every block before it exits (most
/// call `pdl_enter()` first): a programmatic kernel that finished without waiting would not imply
/// that its predecessor had finished, and the next kernel waits only for this one.
macro_rules! launch_pdl {
    ($k:expr, $stream:expr, $name:expr, $grid:expr, $block:expr, $smem:expr; $($arg:ident),* $(,)?) => {{
        if $k.pdl {
            let mut params = [$( (&$arg) as *const _ as *mut std::ffi::c_void ),*];
            // SAFETY: argument order and types match the kernel signature in kernels/*.cu (as for
            // launch!), every pointer is to a local that outlives the call, and the kernel waits
            // for its predecessor before reading its outputs.
            unsafe { $crate::ops::launch_programmatic($k, $stream, $name, $grid, $block, $smem, &mut params) }
        } else {
            $crate::ops::launch!($k, $stream, $name, $grid, $block, $smem; $($arg),*)
        }
    }};
}
pub(crate) use launch_pdl;

/// Launches `name` with programmatic stream serialization (`cuLaunchKernelEx`, sm_90 and later;
/// captured into CUDA graphs as a programmatic edge): the kernel may begin once every block of the
/// previous kernel has started and called `pdl_trigger()` (or exited), and waits in `pdl_wait()`
/// for that kernel's completion and memory.
///
/// # Safety
/// `params` holds one pointer per kernel parameter, in order, each to a value of the parameter's
/// type that lives until this returns; the kernel calls `pdl_wait()` before it reads or writes
/// memory that the previous kernel in the stream reads or writes.
pub(crate) unsafe fn launch_programmatic(
    k: &Kernels,
    s: &cudarc::driver::CudaStream,
    name: &'static str,
    grid: (u32, u32, u32),
    block: (u32, u32, u32),
    smem: u32,
    params: &mut [*mut std::ffi::c_void],
) -> Result<(), CudaError> {
    use cudarc::driver::sys;
    let f = k.func(name)?;
    let err = |cause| CudaError::Launch { kernel: name, grid, block, smem, cause };
    s.context().bind_to_thread().map_err(err)?;
    // SAFETY: a zeroed attribute is valid; id and value are set below.
    let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
    attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attr.value.programmaticStreamSerializationAllowed = 1;
    let cfg = sys::CUlaunchConfig {
        gridDimX: grid.0,
        gridDimY: grid.1,
        gridDimZ: grid.2,
        blockDimX: block.0,
        blockDimY: block.1,
        blockDimZ: block.2,
        sharedMemBytes: smem,
        hStream: s.cu_stream(),
        attrs: &mut attr,
        numAttrs: 1,
    };
    // SAFETY: the function belongs to the stream's context (bound above); the caller guarantees the
    // parameters.
    unsafe { sys::cuLaunchKernelEx(&cfg, f.cu_function(), params.as_mut_ptr(), std::ptr::null_mut()) }
        .result()
        .map_err(err)
}

/// Shorthand for an argument error.
pub(crate) fn invalid(kernel: &'static str, msg: impl Into<String>) -> CudaError {
    CudaError::InvalidArgs { kernel, msg: msg.into() }
}

/// `usize` -> kernel `int`, or an error naming the kernel.
pub(crate) fn to_i32(kernel: &'static str, what: &str, v: usize) -> Result<i32, CudaError> {
    i32::try_from(v).map_err(|_| invalid(kernel, format!("{what} = {v} does not fit in i32")))
}

/// `usize` -> grid dimension.
pub(crate) fn to_u32(kernel: &'static str, what: &str, v: usize) -> Result<u32, CudaError> {
    u32::try_from(v).map_err(|_| invalid(kernel, format!("{what} = {v} does not fit in u32")))
}

/// Host-side tile table for varlen launches: for each sequence (from `cu_seqlens`, B+1 offsets)
/// and each tile of `tile` tokens inside it, the pair (sequence index, tile index). Upload it next
/// to `cu_seqlens`; the kernels index it with blockIdx.x.
pub fn tile_table(cu_seqlens: &[i32], tile: usize) -> Vec<i32> {
    let mut out = Vec::new();
    for (s, w) in cu_seqlens.windows(2).enumerate() {
        let len = (w[1] - w[0]).max(0) as usize;
        for c in 0..len.div_ceil(tile) {
            out.push(s as i32);
            out.push(c as i32);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::pdl_enabled;

    #[test]
    fn programmatic_launches_only_from_sm90_and_switchable() {
        for cc in [(8, 0), (8, 6), (8, 9)] {
            assert!(!pdl_enabled(cc, None), "{cc:?}: Ampere and Ada launch as before");
        }
        assert!(pdl_enabled((9, 0), None));
        assert!(pdl_enabled((10, 0), Some("1")));
        assert!(!pdl_enabled((9, 0), Some("0")), "DELTASERVE_PDL=0 turns it off");
    }
}
