//! Run-time compilation of the embedded CUDA C kernels with NVRTC, to a cubin for one exact
//! `sm_XY`, with `-D` specialisations (head dims, conv width, GQA group). Results are cached per
//! process (key: module, arch, options). [`kernels_check`] compiles every module for every
//! supported arch without a GPU (NVRTC alone, e.g. from the `nvidia-cuda-nvrtc` wheel).
//!
//! Kernels include no toolkit header: `kernels/prelude.cuh` (bf16 on raw bit patterns, warp
//! reductions) is prepended to each source as text. A module of several files is their text
//! concatenated, its shared header first (attention: `attention_tile.cuh`, the prefill kernels,
//! `attention_mma.cuh`, then the decode and the verify kernels).

use std::collections::HashMap;
use std::ffi::{CStr, CString, c_char};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use cudarc::nvrtc::{result, sys};
use deltaserve_plan::KvDtype;

use crate::error::CudaError;

const PRELUDE: &str = include_str!("../kernels/prelude.cuh");

/// One `.cu` file and the kernels it defines.
pub struct KernelSource {
    pub module: &'static str,
    pub src: &'static str,
    pub functions: &'static [&'static str],
}

/// Every kernel source of the crate.
pub const SOURCES: &[KernelSource] = &[
    KernelSource { module: "embed", src: include_str!("../kernels/embed.cu"), functions: &["embed_gather"] },
    KernelSource { module: "argmax", src: include_str!("../kernels/argmax.cu"), functions: &["argmax_rows"] },
    KernelSource {
        module: "sample",
        src: include_str!("../kernels/sample.cu"),
        functions: &[
            "sample_penalize",
            "sample_penalize_bits",
            "sample_mask_bits",
            "sample_stats",
            "sample_hist",
            "sample_gather",
            "sample_pick",
            "sample_stash",
        ],
    },
    KernelSource { module: "feed", src: include_str!("../kernels/feed.cu"), functions: &["feed_rows"] },
    KernelSource {
        module: "vision",
        src: include_str!("../kernels/vision.cu"),
        functions: &[
            "vision_embed_pos",
            "vision_layer_norm",
            "vision_qkv_rope",
            "vision_attn_d64",
            "vision_attn_d72",
            "vision_attn_d128",
            "vision_residual",
            "vision_bias_act",
        ],
    },
    KernelSource { module: "init", src: include_str!("../kernels/init.cu"), functions: &["init_random", "init_smem"] },
    KernelSource {
        module: "norm",
        src: include_str!("../kernels/norm.cu"),
        functions: &["add_rms_norm_1p", "rms_norm_1p", "gated_rms_norm"],
    },
    KernelSource {
        module: "elementwise",
        src: include_str!("../kernels/elementwise.cu"),
        functions: &["sigmoid_gate_mul", "swiglu", "sigmoid_gate_mul8", "swiglu8"],
    },
    KernelSource {
        module: "rope",
        src: include_str!("../kernels/rope.cu"),
        functions: &["rope_partial", "qk_norm_rope"],
    },
    KernelSource { module: "kv_cache", src: include_str!("../kernels/kv_cache.cu"), functions: &["kv_write"] },
    KernelSource { module: "kv_quant", src: include_str!("../kernels/kv_quant.cu"), functions: &["kv_write_q"] },
    KernelSource {
        module: "conv",
        src: include_str!("../kernels/conv.cu"),
        functions: &["conv_prefill", "conv_state_update", "conv_state_save", "conv_decode"],
    },
    KernelSource {
        module: "gdn_gate",
        src: include_str!("../kernels/gdn_gate.cu"),
        functions: &["gdn_gate", "gdn_conv_gate_decode", "gdn_conv_gate_rows"],
    },
    KernelSource {
        module: "gdn_chunk",
        src: include_str!("../kernels/gdn_chunk.cu"),
        functions: &["gdn_chunk_prep", "gdn_chunk_state", "gdn_chunk_state_bf16"],
    },
    KernelSource {
        module: "gdn_decode",
        src: include_str!("../kernels/gdn_decode.cu"),
        functions: &[
            "gdn_decode",
            "gdn_recurrent",
            "gdn_decode_gated",
            "gdn_recurrent_gated",
            "gdn_rows",
            "gdn_commit_layers",
        ],
    },
    KernelSource { module: "mtp", src: include_str!("../kernels/mtp.cu"), functions: &["shift_rows", "scatter_rows"] },
    KernelSource { module: "gemv", src: include_str!("../kernels/gemv.cu"), functions: &["gemv_bf16"] },
    KernelSource {
        module: "fp8",
        src: include_str!("../kernels/fp8.cu"),
        functions: &["gemv_fp8_n8", "gemv_fp8_n16", "fp8_act_quant", "fp8_dequant", "fp8_quantize"],
    },
    KernelSource {
        module: "moe",
        src: include_str!("../kernels/moe.cu"),
        functions: &["moe_route", "moe_offsets", "moe_permute", "moe_gemm", "moe_gemv", "moe_unpermute"],
    },
    KernelSource {
        module: "w4a16",
        // The pair GEMV's device code, then its kernels.
        src: concat!(include_str!("../kernels/w4_pair.cuh"), include_str!("../kernels/w4a16.cu")),
        functions: &[
            "w4_permute_x",
            "w4p_hsh",
            "w4p_hsb",
            "w4p_hah",
            "w4p_hab",
            "w4p_fsh",
            "w4p_fsb",
            "w4p_fah",
            "w4p_fab",
            "w4ps_hsh",
            "w4ps_hsb",
            "w4ps_hah",
            "w4ps_hab",
            "w4ps_fsh",
            "w4ps_fsb",
            "w4ps_fah",
            "w4ps_fab",
            "w4pf_sh",
            "w4pf_sb",
            "w4pf_ah",
            "w4pf_ab",
            "w4pfs_sh",
            "w4pfs_sb",
            "w4pfs_ah",
            "w4pfs_ab",
            "w4_read_probe",
            "w4_dequant",
            "w4_quantize",
        ],
    },
    KernelSource {
        module: "w4_gemm",
        // The tile GEMM's device code, then its kernels.
        src: concat!(include_str!("../kernels/w4_tile.cuh"), include_str!("../kernels/w4_gemm.cu")),
        functions: &["w4g_16", "w4g_24", "w4g_32", "w4t_16s", "w4t_16a", "w4g_reduce"],
    },
    KernelSource {
        module: "moe_w4",
        // The int4 experts run the pair GEMV's and the tile GEMM's device code.
        src: concat!(
            include_str!("../kernels/w4_pair.cuh"),
            include_str!("../kernels/w4_tile.cuh"),
            include_str!("../kernels/moe_w4.cu")
        ),
        functions: &["moe_w4p_sh", "moe_w4p_sb", "moe_w4p_ah", "moe_w4p_ab", "moe_w4g"],
    },
    KernelSource {
        module: "attention",
        // The shared tile code, the prefill kernels, the decode kernels' shared tensor-core pieces, then the
        // decode and the verify kernels: one module.
        src: concat!(
            include_str!("../kernels/attention_tile.cuh"),
            include_str!("../kernels/attention_prefill.cu"),
            include_str!("../kernels/attention_mma.cuh"),
            include_str!("../kernels/attention_decode.cu"),
            include_str!("../kernels/attention_verify.cu")
        ),
        functions: &[
            "attn_prefill",
            "attn_prefill_wide",
            "attn_prefill_wide64",
            "attn_decode_split",
            "attn_decode_combine",
            "attn_decode_mma",
            "attn_verify_mma",
        ],
    },
];

/// Archs the kernels must compile for (no `a` variants: no Hopper-only instructions).
pub const CHECK_ARCHS: &[&str] = &["sm_80", "sm_86", "sm_89", "sm_90"];

/// Whether libnvrtc can be dlopened.
pub fn nvrtc_present() -> bool {
    // SAFETY: only tries dlopen on candidate names.
    unsafe { sys::is_culib_present() }
}

/// NVRTC's (major, minor) version.
pub fn nvrtc_version() -> Result<(i32, i32), CudaError> {
    require_nvrtc("version")?;
    let (mut major, mut minor) = (0, 0);
    // SAFETY: writes two ints.
    unsafe { sys::nvrtcVersion(&mut major, &mut minor) }.result().map_err(|source| CudaError::Nvrtc {
        call: "nvrtcVersion",
        module: String::new(),
        cause: source,
    })?;
    Ok((major, minor))
}

fn require_nvrtc(_what: &str) -> Result<(), CudaError> {
    if nvrtc_present() {
        Ok(())
    } else {
        Err(CudaError::LibraryMissing {
            lib: "libnvrtc.so.13",
            hint: "install the CUDA 13 toolkit or the nvidia-cuda-nvrtc==13.0.* wheel and add its lib dir to LD_LIBRARY_PATH",
        })
    }
}

/// A compiled module.
#[derive(Clone)]
pub struct Cubin {
    pub module: &'static str,
    pub arch: String,
    pub image: Arc<Vec<u8>>,
    /// NVRTC's log (with `verbose`: ptxas register / spill lines).
    pub log: String,
    pub compile_ms: f64,
}

type CacheKey = (&'static str, String, Vec<String>);

fn cache() -> &'static Mutex<HashMap<CacheKey, Cubin>> {
    static CACHE: OnceLock<Mutex<HashMap<CacheKey, Cubin>>> = OnceLock::new();
    CACHE.get_or_init(|| Mutex::new(HashMap::new()))
}

/// Compiles `source` for `arch` (e.g. "sm_90") with `-D` defines; cached per process.
/// `verbose` adds ptxas's resource report to the log (and bypasses nothing: it is part of the key).
pub fn compile(
    source: &KernelSource,
    arch: &str,
    defines: &[(&str, String)],
    verbose: bool,
) -> Result<Cubin, CudaError> {
    require_nvrtc(source.module)?;
    let mut options = vec![
        format!("--gpu-architecture={arch}"),
        "-std=c++17".to_string(),
        "--device-as-default-execution-space".to_string(),
    ];
    if verbose {
        options.push("--ptxas-options=-v".to_string());
    }
    options.extend(defines.iter().map(|(k, v)| format!("-D{k}={v}")));
    // Experiments: extra options for every module (`-DNAME=VALUE` for a switch a kernel file reads
    // under #ifndef, to sweep it without rebuilding).
    options.extend(crate::switches::Switches::get().nvrtc_options.iter().cloned());
    let key = (source.module, arch.to_string(), options.clone());
    if let Ok(c) = cache().lock()
        && let Some(hit) = c.get(&key)
    {
        return Ok(hit.clone());
    }
    let t0 = Instant::now();
    // A traced build (crate::trace): every kernel body starts with the trace scope.
    let body = if crate::trace::is_traced(defines) {
        std::borrow::Cow::Owned(crate::trace::instrument(source.src))
    } else {
        source.src.into()
    };
    let (image, log) = compile_uncached(source.module, &format!("{PRELUDE}\n{body}"), arch, &options)?;
    let cubin = Cubin {
        module: source.module,
        arch: arch.to_string(),
        image: Arc::new(image),
        log,
        compile_ms: t0.elapsed().as_secs_f64() * 1e3,
    };
    if let Ok(mut c) = cache().lock() {
        c.insert(key, cubin.clone());
    }
    Ok(cubin)
}

fn compile_uncached(
    module: &'static str,
    src: &str,
    arch: &str,
    options: &[String],
) -> Result<(Vec<u8>, String), CudaError> {
    let nv = |call: &'static str| move |source| CudaError::Nvrtc { call, module: module.to_string(), cause: source };
    let c_src = CString::new(src).map_err(|_| CudaError::Compile {
        module: module.into(),
        arch: arch.into(),
        options: options.join(" "),
        log: "source contains a NUL byte".into(),
    })?;
    let name = CString::new(format!("{module}.cu")).unwrap_or_default();
    let prog = result::create_program(&c_src, Some(&name)).map_err(nv("nvrtcCreateProgram"))?;
    // SAFETY: `prog` is a live program until destroy_program below; options contain no NUL.
    let compiled = unsafe { result::compile_program(prog, options) };
    let log = unsafe { result::get_program_log(prog) }.map(|l| c_chars_to_string(&l)).unwrap_or_default();
    let out = match compiled {
        Err(_) => Err(CudaError::Compile {
            module: module.into(),
            arch: arch.into(),
            options: options.join(" "),
            log: log.clone(),
        }),
        Ok(()) => get_cubin(prog).map_err(nv("nvrtcGetCUBIN")),
    };
    // SAFETY: destroyed once.
    let _ = unsafe { result::destroy_program(prog) };
    out.map(|image| (image, log))
}

fn get_cubin(prog: sys::nvrtcProgram) -> Result<Vec<u8>, result::NvrtcError> {
    let mut size = 0usize;
    // SAFETY: `prog` compiled successfully; the buffer has the size NVRTC reports.
    unsafe {
        sys::nvrtcGetCUBINSize(prog, &mut size).result()?;
        let mut buf = vec![0u8; size];
        sys::nvrtcGetCUBIN(prog, buf.as_mut_ptr() as *mut c_char).result()?;
        Ok(buf)
    }
}

fn c_chars_to_string(v: &[c_char]) -> String {
    if v.is_empty() {
        return String::new();
    }
    // SAFETY: NVRTC logs are NUL-terminated; fall back to lossy bytes otherwise.
    match CStr::from_bytes_until_nul(unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, v.len()) }) {
        Ok(s) => s.to_string_lossy().into_owned(),
        Err(_) => String::new(),
    }
}

/// Dimensions the kernels are specialised on (one set per model).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct KernelDims {
    /// DeltaNet key / value head dims (DK, DV).
    pub gdn_k_dim: usize,
    pub gdn_v_dim: usize,
    /// Short-convolution width.
    pub conv_kernel: usize,
    /// Full-attention head dim and query heads per kv head.
    pub attn_head_dim: usize,
    pub gqa_group: usize,
    /// Value columns per block in gdn_chunk_state (16 or 32).
    pub gdn_bv: usize,
}

impl KernelDims {
    /// Qwen3.5/3.6 27B.
    pub const QWEN35_27B: KernelDims =
        KernelDims { gdn_k_dim: 128, gdn_v_dim: 128, conv_kernel: 4, attn_head_dim: 256, gqa_group: 6, gdn_bv: 32 };

    /// n-tiles of 8 query columns in `attn_verify_mma` (VQ_NT): room for the 4 rows of a verify chunk at
    /// 3 draft tokens (4 × the GQA group columns), at most 3 (ops::attention::verify_group_rows says which
    /// GQA groups take the kernel).
    pub fn verify_ntiles(&self) -> usize {
        (4 * self.gqa_group).div_ceil(8).clamp(1, 3)
    }

    /// The `-D` list for one module.
    pub fn defines(&self, module: &str) -> Vec<(&'static str, String)> {
        match module {
            "conv" => vec![("CONV_K", self.conv_kernel.to_string())],
            "gdn_gate" => vec![("DK", self.gdn_k_dim.to_string()), ("CONV_K", self.conv_kernel.to_string())],
            "gdn_decode" => vec![
                ("DK", self.gdn_k_dim.to_string()),
                ("DV", self.gdn_v_dim.to_string()),
                ("CONV_K", self.conv_kernel.to_string()),
            ],
            "gdn_chunk" => vec![
                ("DK", self.gdn_k_dim.to_string()),
                ("DV", self.gdn_v_dim.to_string()),
                ("GDN_BV", self.gdn_bv.to_string()),
            ],
            "attention" => vec![
                ("HD", self.attn_head_dim.to_string()),
                ("GQA_GROUP", self.gqa_group.to_string()),
                ("VQ_NT", self.verify_ntiles().to_string()),
            ],
            _ => Vec::new(),
        }
    }

    /// Checks the constraints the kernels assume.
    pub fn validate(&self) -> Result<(), CudaError> {
        let bad = |msg: String| Err(CudaError::InvalidArgs { kernel: "KernelDims", msg });
        if !self.gdn_k_dim.is_multiple_of(32) || !self.gdn_v_dim.is_multiple_of(32) || self.gdn_k_dim > 256 {
            return bad(format!(
                "DeltaNet head dims must be multiples of 32 (DK <= 256), got DK={} DV={}",
                self.gdn_k_dim, self.gdn_v_dim
            ));
        }
        if !(self.gdn_bv == 16 || self.gdn_bv == 32) || !self.gdn_v_dim.is_multiple_of(self.gdn_bv) {
            return bad(format!("gdn_bv must be 16 or 32 and divide DV, got {}", self.gdn_bv));
        }
        if !self.attn_head_dim.is_multiple_of(32) || self.attn_head_dim > 256 {
            return bad(format!("attention head dim must be a multiple of 32 and <= 256, got {}", self.attn_head_dim));
        }
        if self.gqa_group == 0 || self.gqa_group > 8 || !(2..=8).contains(&self.conv_kernel) {
            return bad(format!(
                "gqa_group must be 1..=8 and conv_kernel 2..=8, got {} and {}",
                self.gqa_group, self.conv_kernel
            ));
        }
        Ok(())
    }
}

/// Storage formats of the paged KV cache, K and V independently, that the attention kernels are
/// compiled for: bf16, or fp8 (e4m3) / int8 / int4 codes with one f16 scale per (token, kv head)
/// (rules: deltaserve_cpu::kvquant). The attention module is specialised per pair (`-D KV_K_FMT`,
/// `-D KV_V_FMT`, absent for bf16 so the bf16 build is the plain one); the cache writer
/// (kv_quant.cu) takes the formats at run time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct KvFormats {
    pub k: KvDtype,
    pub v: KvDtype,
}

impl KvFormats {
    pub const BF16: KvFormats = KvFormats { k: KvDtype::Bf16, v: KvDtype::Bf16 };

    /// A format's code in the kernels (`KVF_*` in prelude.cuh, read by kernels/attention_*.cu and
    /// kv_quant.cu); None for the formats the CUDA kernels do not store (fp16, fp32).
    pub fn code(x: KvDtype) -> Option<i32> {
        match x {
            KvDtype::Bf16 => Some(0),
            KvDtype::Fp8 => Some(1),
            KvDtype::Int8 => Some(2),
            KvDtype::Int4 => Some(3),
            KvDtype::F16 | KvDtype::F32 => None,
        }
    }

    /// The `-D` list for one module (empty unless the module is "attention" and a format is not bf16).
    pub fn defines(&self, module: &str) -> Vec<(&'static str, String)> {
        let mut v = Vec::new();
        if module == "attention" {
            for (name, x) in [("KV_K_FMT", self.k), ("KV_V_FMT", self.v)] {
                if let Some(c) = Self::code(x).filter(|&c| c != 0) {
                    v.push((name, c.to_string()));
                }
            }
        }
        v
    }

    /// Checks that both formats are ones the kernels store.
    pub fn validate(&self) -> Result<(), CudaError> {
        if Self::code(self.k).is_none() || Self::code(self.v).is_none() {
            return Err(CudaError::InvalidArgs {
                kernel: "KvFormats",
                msg: format!(
                    "the CUDA KV cache stores bf16, fp8, int8 or int4; got K {} and V {}",
                    self.k.name(),
                    self.v.name()
                ),
            });
        }
        Ok(())
    }

    /// Whether K / V carry per-(token, head) scales.
    pub fn scaled(&self) -> (bool, bool) {
        (self.k.scale_bytes() > 0, self.v.scale_bytes() > 0)
    }
}

/// How the attention prefill kernel tiles its work (`PF_*` in kernels/attention_prefill.cu): keys per KV
/// tile, query heads per block and P's precision in the P·V product. A warp pair shares each query
/// head of a block, splitting its head dims.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AttnTiling {
    /// Keys per KV tile: 32 or 64.
    pub keys: usize,
    /// P enters the P·V product as bf16 hi + lo (about 16 mantissa bits) instead of plain bf16.
    pub p_split: bool,
    /// Query heads (of one kv head) per block, a divisor of the GQA group; 0: [`AttnTiling::auto_heads`].
    pub heads: usize,
    /// Prefer `attn_prefill_wide` (128 packed (query, head) rows per block, a warp pair per 32 rows)
    /// where it applies: plain P, and the device's shared memory holds its block at
    /// `keys` (else at 32 keys; else `attn_prefill` at 32 keys). [`crate::Kernels::attn`] holds the
    /// tiling that runs ([`crate::Kernels::attn_wide`]).
    pub wide: bool,
}

impl AttnTiling {
    /// The wide kernel at 64 keys per tile where it applies and fits (sm_90), else at 32 (sm_80);
    /// elsewhere (sm_86/89: 99 KB of shared memory per block) `attn_prefill` at 32-key tiles. Plain
    /// bf16 P (FlashAttention's choice: its rounding moves o by about 2^-9 of |v|; 17% faster than
    /// the hi/lo split on the H200), 6 heads per block at the 27B's GQA 6 for `attn_prefill`
    /// (bench/results/attention-pairs-h200-2026-11-29.md).
    pub const DEFAULT: AttnTiling = AttnTiling { keys: 64, p_split: false, heads: 0, wide: true };

    /// The default heads per block: the largest divisor of the GQA group up to 6 (2 warps per head;
    /// 12 warps at most, so 168 registers per thread still fit one block per SM).
    pub fn auto_heads(gqa_group: usize) -> usize {
        (1..=gqa_group.min(6)).rev().find(|d| gqa_group.is_multiple_of(*d)).unwrap_or(1)
    }

    /// Query heads per block for a GQA group.
    pub fn heads_per_block(&self, gqa_group: usize) -> usize {
        if self.heads == 0 { Self::auto_heads(gqa_group) } else { self.heads }
    }

    /// The `-D` list for one module (empty unless the module is "attention").
    pub fn defines(&self, dims: &KernelDims, module: &str) -> Vec<(&'static str, String)> {
        if module != "attention" {
            return Vec::new();
        }
        vec![
            ("PF_BK", self.keys.to_string()),
            ("PF_PSPLIT", u8::from(self.p_split).to_string()),
            ("PF_HPB", self.heads_per_block(dims.gqa_group).to_string()),
        ]
    }

    pub fn validate(&self, dims: &KernelDims) -> Result<(), CudaError> {
        let bad = |msg: String| Err(CudaError::InvalidArgs { kernel: "AttnTiling", msg });
        if !(self.keys == 32 || self.keys == 64) {
            return bad(format!("keys per attention tile must be 32 or 64, got {}", self.keys));
        }
        let h = self.heads_per_block(dims.gqa_group);
        if h == 0 || h > 8 || !dims.gqa_group.is_multiple_of(h) {
            return bad(format!("heads per block ({h}) must divide the GQA group ({}) and be <= 8", dims.gqa_group));
        }
        Ok(())
    }
}

/// Quantised-KV builds of the attention module that [`kernels_check`] compiles besides the bf16
/// one: every format's K path and V path at least once, and mixed pairs.
pub const CHECK_KV: &[(KvFormats, &str)] = &[
    (KvFormats { k: KvDtype::Fp8, v: KvDtype::Fp8 }, "attention[fp8/fp8]"),
    (KvFormats { k: KvDtype::Int8, v: KvDtype::Int4 }, "attention[int8/int4]"),
    (KvFormats { k: KvDtype::Int4, v: KvDtype::Int8 }, "attention[int4/int8]"),
    (KvFormats { k: KvDtype::Bf16, v: KvDtype::Fp8 }, "attention[bf16/fp8]"),
];

/// One line of the kernels-check report.
#[derive(Clone, Debug)]
pub struct CheckLine {
    pub module: &'static str,
    pub arch: String,
    pub ok: bool,
    pub cubin_bytes: usize,
    pub compile_ms: f64,
    /// ptxas resource lines (registers, smem, spills) or the compiler error.
    pub detail: String,
    /// Instructions of each kernel ([`kernel_instructions`]).
    pub code: Vec<(String, usize)>,
}

/// Result of [`kernels_check`].
#[derive(Clone, Debug)]
pub struct KernelsReport {
    pub nvrtc_version: (i32, i32),
    pub lines: Vec<CheckLine>,
}

impl KernelsReport {
    pub fn all_ok(&self) -> bool {
        self.lines.iter().all(|l| l.ok)
    }
}

impl std::fmt::Display for KernelsReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (ma, mi) = self.nvrtc_version;
        writeln!(f, "NVRTC {ma}.{mi}")?;
        for l in &self.lines {
            writeln!(
                f,
                "{:<20} {:<6} {:<4} {:>8} B {:>7.0} ms",
                l.module,
                l.arch,
                if l.ok { "ok" } else { "FAIL" },
                l.cubin_bytes,
                l.compile_ms
            )?;
            for d in l.detail.lines().filter(|d| !d.trim().is_empty()) {
                writeln!(f, "    {}", d.trim())?;
            }
            if !l.code.is_empty() {
                let sizes: Vec<String> = l.code.iter().map(|(k, n)| format!("{k} {n}")).collect();
                writeln!(f, "    instructions: {}", sizes.join(", "))?;
            }
        }
        let bad = self.lines.iter().filter(|l| !l.ok).count();
        write!(f, "{} module builds, {} failed", self.lines.len(), bad)
    }
}

/// Compiles every kernel module for every arch in `archs` (default [`CHECK_ARCHS`]) with `dims`;
/// needs NVRTC only, no GPU. Compile failures are reported per line, not returned as `Err`.
pub fn kernels_check(archs: &[&str], dims: &KernelDims) -> Result<KernelsReport, CudaError> {
    kernels_check_where(archs, dims, |_| true)
}

/// The compile-time defines of `module` in [`kernels_check`]'s builds at `dims` (the model's dims and
/// the attention tiling that runs where the wide prefill kernels do not fit: 32-key tiles); two dims
/// whose defines are equal build the same module.
pub fn check_defines(dims: &KernelDims, module: &str) -> Vec<(&'static str, String)> {
    let mut defines = dims.defines(module);
    let tiling = AttnTiling { keys: 32, wide: false, ..AttnTiling::DEFAULT };
    defines.extend(tiling.defines(dims, module));
    defines
}

/// [`kernels_check`] over the modules for which `keep(module)` holds.
pub fn kernels_check_where(
    archs: &[&str],
    dims: &KernelDims,
    keep: impl Fn(&str) -> bool,
) -> Result<KernelsReport, CudaError> {
    let nvrtc_version = nvrtc_version()?;
    dims.validate()?;
    let sources: Vec<&KernelSource> = SOURCES.iter().filter(|s| keep(s.module)).collect();
    // (source, arch, KV formats, report label)
    let mut jobs: Vec<(&KernelSource, &str, KvFormats, &'static str)> =
        archs.iter().flat_map(|a| sources.iter().map(move |s| (*s, *a, KvFormats::BF16, s.module))).collect();
    if let Some(&attn) = sources.iter().find(|s| s.module == "attention") {
        jobs.extend(archs.iter().flat_map(|a| CHECK_KV.iter().map(move |&(kv, label)| (attn, *a, kv, label))));
    }
    let lines = std::thread::scope(|scope| {
        let handles: Vec<_> = jobs
            .iter()
            .map(|&(src, arch, kv, label)| {
                scope.spawn(move || {
                    // attn_prefill as it runs where the wide kernels do not fit (sm_86/89: 32-key
                    // tiles); the wide kernels do not depend on the tiling's defines.
                    let mut defines = check_defines(dims, src.module);
                    defines.extend(kv.defines(src.module));
                    let r = compile(src, arch, &defines, true);
                    match r {
                        Ok(c) => CheckLine {
                            module: label,
                            arch: arch.to_string(),
                            ok: true,
                            cubin_bytes: c.image.len(),
                            compile_ms: c.compile_ms,
                            detail: resource_lines(&c.log),
                            code: kernel_instructions(&c.image),
                        },
                        Err(e) => CheckLine {
                            module: label,
                            arch: arch.to_string(),
                            ok: false,
                            cubin_bytes: 0,
                            compile_ms: 0.0,
                            detail: e.to_string(),
                            code: Vec::new(),
                        },
                    }
                })
            })
            .collect();
        handles
            .into_iter()
            .zip(&jobs)
            .map(|(h, (_, arch, _, label))| {
                h.join().unwrap_or_else(|_| CheckLine {
                    module: label,
                    arch: arch.to_string(),
                    ok: false,
                    cubin_bytes: 0,
                    compile_ms: 0.0,
                    detail: "compiler thread panicked".into(),
                    code: Vec::new(),
                })
            })
            .collect()
    });
    Ok(KernelsReport { nvrtc_version, lines })
}

/// Machine-code size of each kernel in a cubin: its `.text.<name>` section's bytes / 16 (every SASS
/// instruction of sm_70 and later is 16 bytes), sorted by name. Read from the ELF section headers
/// (64-bit little-endian, as NVRTC emits); anything malformed gives an empty list. The size matters
/// for kernels that run once per layer on the decode path: their code is fetched cold each time
/// (bench/results/decode-small-kernels-h200-2026-12-01.md: an unrolled `qk_norm_rope` of 9K instructions was
/// 2.7x slower than the 3.2K one).
pub fn kernel_instructions(cubin: &[u8]) -> Vec<(String, usize)> {
    let u16_at = |o: usize| cubin.get(o..o + 2).map(|b| u16::from_le_bytes([b[0], b[1]]) as usize);
    let u32_at = |o: usize| cubin.get(o..o + 4).map(|b| u32::from_le_bytes(b.try_into().unwrap_or([0; 4])) as usize);
    let u64_at = |o: usize| cubin.get(o..o + 8).map(|b| u64::from_le_bytes(b.try_into().unwrap_or([0; 8])) as usize);
    let parse = || -> Option<Vec<(String, usize)>> {
        if cubin.get(..5)? != b"\x7fELF\x02" {
            return None;
        }
        let (shoff, shentsize, shnum, shstrndx) = (u64_at(0x28)?, u16_at(0x3a)?, u16_at(0x3c)?, u16_at(0x3e)?);
        let sh = |i: usize| shoff.checked_add(i.checked_mul(shentsize)?);
        let strtab = u64_at(sh(shstrndx)? + 24)?;
        let mut out = Vec::new();
        for i in 0..shnum {
            let h = sh(i)?;
            let name_at = strtab.checked_add(u32_at(h)?)?;
            let name = cubin.get(name_at..)?.split(|&b| b == 0).next()?;
            if let Some(kernel) = name.strip_prefix(b".text.") {
                out.push((String::from_utf8_lossy(kernel).into_owned(), u64_at(h + 32)? / 16));
            }
        }
        out.sort();
        Some(out)
    };
    parse().unwrap_or_default()
}

/// Keeps ptxas's per-function summary lines ("Compiling entry", "Used N registers", spills).
fn resource_lines(log: &str) -> String {
    log.lines()
        .filter(|l| {
            l.contains("Compiling entry")
                || l.contains("registers")
                || (l.contains("spill") && !l.contains(" 0 bytes spill stores, 0 bytes spill loads"))
        })
        .map(|l| l.trim_start_matches("ptxas info    : ").to_string())
        .collect::<Vec<_>>()
        .join("\n")
}

#[cfg(test)]
mod tests {
    use super::{SOURCES, kernel_instructions};

    /// Every kernel a source defines by name is in its module's list (the loader fetches only those).
    #[test]
    fn every_named_kernel_is_listed() {
        for src in SOURCES {
            for def in src.src.split("extern \"C\" __global__ void ").skip(1) {
                // `__launch_bounds__(...)` may come before the name.
                let def = match def.strip_prefix("__launch_bounds__(") {
                    Some(rest) => rest.split_once(')').map_or(rest, |(_, r)| r).trim_start(),
                    None => def,
                };
                let name: String = def.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
                // Names pasted by macros (`name##suffix`) are listed by their expansions.
                if !name.is_empty() && def[name.len()..].starts_with('(') {
                    assert!(src.functions.contains(&name.as_str()), "{}: kernel `{name}` is not listed", src.module);
                }
            }
        }
    }

    /// A 64-bit ELF with a null section, `.shstrtab` and the given `.text.*` sections (name, bytes).
    fn elf(texts: &[(&str, usize)]) -> Vec<u8> {
        let mut names = b"\0.shstrtab\0".to_vec();
        let text_names: Vec<usize> = texts
            .iter()
            .map(|(n, _)| {
                let at = names.len();
                names.extend_from_slice(format!(".text.{n}\0").as_bytes());
                at
            })
            .collect();
        let shoff = 64 + names.len();
        let mut f = vec![0u8; 64];
        f[..5].copy_from_slice(b"\x7fELF\x02");
        f[0x28..0x30].copy_from_slice(&(shoff as u64).to_le_bytes());
        f[0x3a..0x3c].copy_from_slice(&64u16.to_le_bytes());
        f[0x3c..0x3e].copy_from_slice(&(2 + texts.len() as u16).to_le_bytes());
        f[0x3e..0x40].copy_from_slice(&1u16.to_le_bytes());
        f.extend_from_slice(&names);
        let header = |name: usize, offset: usize, size: usize| {
            let mut h = vec![0u8; 64];
            h[..4].copy_from_slice(&(name as u32).to_le_bytes());
            h[24..32].copy_from_slice(&(offset as u64).to_le_bytes());
            h[32..40].copy_from_slice(&(size as u64).to_le_bytes());
            h
        };
        f.extend(header(0, 0, 0));
        f.extend(header(1, 64, names.len()));
        for (&at, &(_, bytes)) in text_names.iter().zip(texts) {
            f.extend(header(at, 0, bytes));
        }
        f
    }

    #[test]
    fn kernel_sizes_come_from_the_text_sections() {
        let got = kernel_instructions(&elf(&[("w4p_hsb", 16 * 4976), ("attn", 32)]));
        assert_eq!(got, vec![("attn".to_string(), 2), ("w4p_hsb".to_string(), 4976)]);
    }

    #[test]
    fn malformed_cubins_give_no_sizes() {
        assert!(kernel_instructions(b"").is_empty());
        assert!(kernel_instructions(b"\x7fELF\x01 32-bit").is_empty());
        let mut cut = elf(&[("k", 64)]);
        cut.truncate(cut.len() - 30); // the last section header cut inside its size field
        assert!(kernel_instructions(&cut).is_empty());
        let mut wild = elf(&[("k", 64)]);
        wild[0x28..0x30].copy_from_slice(&u64::MAX.to_le_bytes()); // section headers past the end
        assert!(kernel_instructions(&wild).is_empty());
    }
}
