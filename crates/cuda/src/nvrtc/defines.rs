//! The `-D` specialisations the modules are compiled with: the model's dimensions, the KV cache's storage
//! formats and the attention prefill kernel's tiling.

use deltaserve_plan::{KvDtype, StateDtype};

use crate::error::CudaError;

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
    /// The DeltaNet recurrent state is stored bf16 (`STATE_BF16`), not f32 (`--state-dtype`).
    pub state_bf16: bool,
}

impl KernelDims {
    /// Qwen3.5/3.6 27B.
    pub const QWEN35_27B: KernelDims = KernelDims {
        gdn_k_dim: 128,
        gdn_v_dim: 128,
        conv_kernel: 4,
        attn_head_dim: 256,
        gqa_group: 6,
        gdn_bv: 32,
        state_bf16: false,
    };

    /// n-tiles of 8 query columns in `attn_verify_mma` (VQ_NT): room for the 4 rows of a verify chunk at
    /// 3 draft tokens (4 × the GQA group columns), at most 3 (ops::attention::verify_group_rows says which
    /// GQA groups take the kernel).
    pub fn verify_ntiles(&self) -> usize {
        (4 * self.gqa_group).div_ceil(8).clamp(1, 3)
    }

    /// These dims with the DeltaNet recurrent state stored as `state`.
    pub fn with_state_dtype(self, state: StateDtype) -> Self {
        Self { state_bf16: state == StateDtype::Bf16, ..self }
    }

    /// The `-D` list for one module.
    pub fn defines(&self, module: &str) -> Vec<(&'static str, String)> {
        let state = ("STATE_BF16", u8::from(self.state_bf16).to_string());
        match module {
            "conv" => vec![("CONV_K", self.conv_kernel.to_string())],
            "gdn_gate" => vec![("DK", self.gdn_k_dim.to_string()), ("CONV_K", self.conv_kernel.to_string())],
            "gdn_decode" => vec![
                ("DK", self.gdn_k_dim.to_string()),
                ("DV", self.gdn_v_dim.to_string()),
                ("CONV_K", self.conv_kernel.to_string()),
                state,
            ],
            "gdn_chunk" => vec![
                ("DK", self.gdn_k_dim.to_string()),
                ("DV", self.gdn_v_dim.to_string()),
                ("GDN_BV", self.gdn_bv.to_string()),
                state,
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
    /// On Hopper (sm_90) at head dims of 64 .. 256 (a multiple of 64): the wide kernel's work on
    /// warpgroup tensor-core instructions (`attn_prefill_wg`, 64-key tiles, the attention
    /// module built for sm_90a), where its shared memory fits; elsewhere the wide kernel runs.
    pub wgmma: bool,
    /// With [`AttnTiling::wgmma`]: the warp-specialised kernel (`attn_prefill_ws`: a producer warpgroup
    /// copying K/V tiles with the tensor memory accelerator and widening quantised ones, two consumer
    /// warpgroups) where its shared memory fits and the page size allows its boxes; elsewhere
    /// `attn_prefill_wg` (`DELTASERVE_ATTN_PREFILL=wg` asks for that one).
    pub tma: bool,
}

impl AttnTiling {
    /// On Hopper the warp-specialised kernel (`attn_prefill_ws`, [`AttnTiling::tma`]: 1.2× the
    /// warpgroup one's 27B bf16 prefill at 128K; over quantised caches `Kernels::load_kv` keeps the
    /// warpgroup one, bench/results/attention-prefill-ws-2026-12-05.md); elsewhere the wide
    /// kernel at 64 keys per tile where it applies and fits, else at 32 (sm_80);
    /// elsewhere (sm_86/89: 99 KB of shared memory per block) `attn_prefill` at 32-key tiles. Plain
    /// bf16 P (FlashAttention's choice: its rounding moves o by about 2^-9 of |v|; 17% faster than
    /// the hi/lo split on the H200), 6 heads per block at the 27B's GQA 6 for `attn_prefill`
    /// (bench/results/attention-pairs-h200-2026-11-29.md).
    pub const DEFAULT: AttnTiling =
        AttnTiling { keys: 64, p_split: false, heads: 0, wide: true, wgmma: true, tma: true };

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
