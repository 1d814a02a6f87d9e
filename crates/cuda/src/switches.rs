//! The CUDA backend's environment switches (A/B comparisons and diagnostics), read once per process
//! into [`Switches`] and logged once when any is set. `docs/environment.md` lists every variable
//! deltaserve reads.

use std::path::PathBuf;
use std::sync::OnceLock;

/// Every `DELTASERVE_*` switch of the CUDA backend, as read from the environment at the first
/// [`Switches::get`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Switches {
    /// `DELTASERVE_PDL`: `0` launches the decode kernels the ordinary way on sm_90+ instead of
    /// programmatically ([`crate::ops::pdl_enabled`] applies it); unset: programmatic on sm_90+.
    pub pdl: Option<String>,
    /// `DELTASERVE_DECODE_ATTN=split`: decode attention runs `attn_decode_split` (CUDA cores)
    /// instead of the tensor-core `attn_decode_mma`.
    pub decode_attn_split: bool,
    /// `DELTASERVE_VERIFY_ATTN=rows`: a speculative verify chunk's rows attend one by one as decode
    /// queries instead of together (`attn_verify_mma`).
    pub verify_attn_rows: bool,
    /// `DELTASERVE_ATTN_PREFILL=pair`: attention prefill runs the warp-pair kernel (`attn_prefill`,
    /// 32-key tiles) instead of the wide one.
    pub attn_prefill_pair: bool,
    /// `DELTASERVE_ATTN_PREFILL=wide`: on Hopper (sm_90) too, attention prefill runs the wide kernel
    /// (mma.sync, Ampere's path) instead of the warpgroup one (`attn_prefill_wg`, wgmma from an sm_90a
    /// build of the attention module; [`crate::AttnTiling::wgmma`]).
    pub attn_prefill_wide: bool,
    /// `DELTASERVE_ATTN_PREFILL=wg`: on Hopper, attention prefill runs the warpgroup kernel whose threads
    /// all load and compute (`attn_prefill_wg`) instead of the warp-specialised one (`attn_prefill_ws`: a
    /// TMA producer warpgroup, two consumer warpgroups; [`crate::AttnTiling::tma`]).
    pub attn_prefill_wg: bool,
    /// `DELTASERVE_ATTN_PREFILL=ws`: on Hopper, the warp-specialised kernel over any quantised cache
    /// (by default the warpgroup one runs over those but fp8 K and V: [`crate::ops::attention::producer_copies`]).
    pub attn_prefill_ws: bool,
    /// `DELTASERVE_NVRTC_OPTIONS`: extra NVRTC options (split at whitespace) for every kernel module,
    /// e.g. `-DNAME=VALUE` for a switch a kernel file reads under `#ifndef`.
    pub nvrtc_options: Vec<String>,
    /// `DELTASERVE_TRACE=<file.csv>`: record a timeline of every kernel block to this file
    /// ([`crate::trace`]); unset or empty: no trace.
    pub trace: Option<PathBuf>,
    /// `DELTASERVE_TRACE_CAP`: the trace ring's records, as given (checked by [`crate::trace`];
    /// unset: [`crate::trace::DEFAULT_CAP`]).
    pub trace_cap: Option<String>,
    /// `DELTASERVE_FOLD`: `0` runs the residual add + RMSNorm of int4 decode steps as its own kernel
    /// instead of folded into the projections around it (the default of
    /// `CudaOptions::fold_norms` that the server and the benchmarks use).
    pub fold_norms: bool,
    /// `DELTASERVE_NORM_IN_REDUCE=0`: steps of the int4 GEMM run each residual add + RMSNorm as its
    /// own kernel after the projection's split-K reduce instead of in it (`CudaOptions::norms_in_reduce`).
    pub norms_in_reduce: bool,
    /// `DELTASERVE_W4_GEMM=0`: int4 projections of steps above the decode GEMV's rows dequantise row
    /// slices for cuBLASLt instead of running the int4 tensor-core GEMM (`CudaOptions::w4_gemm_max_rows`
    /// 0 instead of its default).
    pub w4_gemm: bool,
    /// `DELTASERVE_VERIFY_DECODE_FROM=<tokens>`: speculative verify chunks whose context reaches this
    /// many tokens attend as decode queries (`CudaOptions::verify_decode_attention_from` instead of its
    /// default); not a number: unset.
    pub verify_decode_from: Option<usize>,
    /// `DELTASERVE_SHORT_CHUNK_DECODE_FROM=<tokens>`: prefill chunks of a few tokens whose context
    /// reaches this many tokens take the short-chunk attention (keys split, or rows as decode queries:
    /// `CudaOptions::short_chunk_decode_attention_from` instead of its default, 2,048; a number above
    /// the context turns it off); not a number: unset.
    pub short_chunk_decode_from: Option<usize>,
    /// Structured-output rows are masked and picked on the device (`sample_mask_bits`) with the
    /// step's other rows; `DELTASERVE_DEVICE_MASKS=0` picks them on the host instead.
    pub device_masks: bool,
    /// Decode steps holding structured-output rows are launched ahead, their picks made once the rows'
    /// masks are known (`Capabilities::picks_after_launch`); `DELTASERVE_LATER_PICKS=0` makes such a
    /// step wait for its masks before it launches.
    pub later_picks: bool,
    /// Snapshots at points inside a step's chunks (`CudaOptions::snapshots_in_step`);
    /// `DELTASERVE_SNAPSHOTS_IN_STEP=0`: chunks end at snapshot points.
    pub snapshots_in_step: bool,
    /// `DELTASERVE_MOE_SHARED_PAIRS=0`: a sparse layer's shared expert runs as the layer's dense MLP;
    /// unset or anything else: with the routed experts' decode GEMVs (`CudaOptions::moe_shared_pairs`).
    pub moe_shared_pairs: bool,
    /// `DELTASERVE_FP8_MMA=1`: block-FP8 prefill projections run the mma.sync FP8 GEMM
    /// (`CudaOptions::fp8_mma_gemm`); unset or anything else: cuBLASLt's (Hopper) or dequantised rows.
    pub fp8_mma_gemm: bool,
    /// `DELTASERVE_FP8_FUSED_QUANT=0`: the SwiGLU before a block-FP8 down projection writes bf16 and the
    /// activations' quantisation runs on its own (`CudaOptions::fp8_fused_quant` off).
    pub fp8_fused_quant: bool,
    /// `DELTASERVE_GDN_WALK=one-stream`: the chunked DeltaNet prefill walks its chunks in one instruction
    /// stream per 16 value columns (`gdn_chunk_state`) also where the warp-specialised walk fits
    /// ([`crate::ops::gdn_chunk::Walk`]).
    pub gdn_walk_one_stream: bool,
    /// `DELTASERVE_GDN_OVERLAP=0`: the chunked DeltaNet prefill runs one prep then one walk over the whole
    /// step instead of each piece's walk beside the next piece's prep ([`crate::ops::gdn_overlap`]).
    pub gdn_overlap: bool,
}

impl Switches {
    /// The switches in the current environment (values that are not valid Unicode count as unset).
    pub fn from_env() -> Switches {
        Switches {
            // A path need not be Unicode.
            trace: std::env::var_os("DELTASERVE_TRACE").filter(|p| !p.is_empty()).map(PathBuf::from),
            ..Self::from_lookup(|name| std::env::var(name).ok())
        }
    }

    /// The switches from `var`, which returns a variable's value (`None`: unset).
    pub fn from_lookup(var: impl Fn(&str) -> Option<String>) -> Switches {
        Switches {
            pdl: var("DELTASERVE_PDL"),
            decode_attn_split: var("DELTASERVE_DECODE_ATTN").is_some_and(|v| v == "split"),
            verify_attn_rows: var("DELTASERVE_VERIFY_ATTN").is_some_and(|v| v == "rows"),
            attn_prefill_pair: var("DELTASERVE_ATTN_PREFILL").is_some_and(|v| v == "pair"),
            attn_prefill_wide: var("DELTASERVE_ATTN_PREFILL").is_some_and(|v| v == "wide"),
            attn_prefill_wg: var("DELTASERVE_ATTN_PREFILL").is_some_and(|v| v == "wg"),
            attn_prefill_ws: var("DELTASERVE_ATTN_PREFILL").is_some_and(|v| v == "ws"),
            nvrtc_options: var("DELTASERVE_NVRTC_OPTIONS")
                .map(|v| v.split_whitespace().map(str::to_string).collect())
                .unwrap_or_default(),
            trace: var("DELTASERVE_TRACE").filter(|p| !p.is_empty()).map(PathBuf::from),
            trace_cap: var("DELTASERVE_TRACE_CAP"),
            fold_norms: var("DELTASERVE_FOLD").is_none_or(|v| v != "0"),
            norms_in_reduce: var("DELTASERVE_NORM_IN_REDUCE").is_none_or(|v| v != "0"),
            w4_gemm: var("DELTASERVE_W4_GEMM").is_none_or(|v| v != "0"),
            verify_decode_from: var("DELTASERVE_VERIFY_DECODE_FROM").and_then(|v| v.trim().parse().ok()),
            short_chunk_decode_from: var("DELTASERVE_SHORT_CHUNK_DECODE_FROM").and_then(|v| v.trim().parse().ok()),
            device_masks: var("DELTASERVE_DEVICE_MASKS").is_none_or(|v| v != "0"),
            later_picks: var("DELTASERVE_LATER_PICKS").is_none_or(|v| v != "0"),
            snapshots_in_step: var("DELTASERVE_SNAPSHOTS_IN_STEP").is_none_or(|v| v != "0"),
            moe_shared_pairs: var("DELTASERVE_MOE_SHARED_PAIRS").is_none_or(|v| v != "0"),
            fp8_mma_gemm: var("DELTASERVE_FP8_MMA").is_some_and(|v| v == "1"),
            fp8_fused_quant: var("DELTASERVE_FP8_FUSED_QUANT").is_none_or(|v| v != "0"),
            gdn_walk_one_stream: var("DELTASERVE_GDN_WALK").is_some_and(|v| v == "one-stream"),
            gdn_overlap: var("DELTASERVE_GDN_OVERLAP").is_none_or(|v| v != "0"),
        }
    }

    /// The process's switches: read from the environment on the first call (and logged if any is
    /// set), the same value afterwards.
    pub fn get() -> &'static Switches {
        static SWITCHES: OnceLock<Switches> = OnceLock::new();
        SWITCHES.get_or_init(|| {
            let s = Switches::from_env();
            if s.any_set() {
                tracing::info!(switches = ?s, "CUDA environment switches set");
            }
            s
        })
    }

    /// Whether any switch differs from its default.
    pub fn any_set(&self) -> bool {
        *self
            != Switches {
                fold_norms: true,
                norms_in_reduce: true,
                w4_gemm: true,
                device_masks: true,
                later_picks: true,
                snapshots_in_step: true,
                moe_shared_pairs: true,
                fp8_fused_quant: true,
                gdn_overlap: true,
                ..Switches::default()
            }
    }
}

#[cfg(test)]
mod tests {
    use super::Switches;

    fn from(pairs: &[(&str, &str)]) -> Switches {
        Switches::from_lookup(|name| pairs.iter().find(|(k, _)| *k == name).map(|(_, v)| v.to_string()))
    }

    #[test]
    fn defaults_without_variables() {
        let s = from(&[]);
        assert!(!s.any_set());
        assert!(s.fold_norms && s.norms_in_reduce && s.w4_gemm && s.device_masks && !s.decode_attn_split);
        assert!(!s.attn_prefill_pair);
        assert!(s.later_picks && s.snapshots_in_step && s.moe_shared_pairs && !s.fp8_mma_gemm);
        assert!(!s.gdn_walk_one_stream && s.gdn_overlap && s.fp8_fused_quant);
        assert!(!s.attn_prefill_wide);
        assert!(s.pdl.is_none() && s.nvrtc_options.is_empty() && s.trace_cap.is_none());
    }

    #[test]
    fn values_that_switch() {
        let s = from(&[
            ("DELTASERVE_PDL", "0"),
            ("DELTASERVE_DECODE_ATTN", "split"),
            ("DELTASERVE_VERIFY_ATTN", "rows"),
            ("DELTASERVE_ATTN_PREFILL", "pair"),
            ("DELTASERVE_NVRTC_OPTIONS", " -DA=1  -DB=2 "),
            ("DELTASERVE_TRACE_CAP", "1024"),
            ("DELTASERVE_FOLD", "0"),
            ("DELTASERVE_NORM_IN_REDUCE", "0"),
            ("DELTASERVE_W4_GEMM", "0"),
            ("DELTASERVE_VERIFY_DECODE_FROM", "0"),
            ("DELTASERVE_SHORT_CHUNK_DECODE_FROM", "8192"),
            ("DELTASERVE_DEVICE_MASKS", "0"),
            ("DELTASERVE_LATER_PICKS", "0"),
            ("DELTASERVE_SNAPSHOTS_IN_STEP", "0"),
            ("DELTASERVE_MOE_SHARED_PAIRS", "0"),
            ("DELTASERVE_FP8_MMA", "1"),
            ("DELTASERVE_FP8_FUSED_QUANT", "0"),
            ("DELTASERVE_GDN_WALK", "one-stream"),
            ("DELTASERVE_GDN_OVERLAP", "0"),
        ]);
        assert!(s.gdn_walk_one_stream && !s.gdn_overlap && !s.fp8_fused_quant);
        assert!(!s.device_masks && !s.later_picks && !s.snapshots_in_step && !s.moe_shared_pairs && s.fp8_mma_gemm);
        assert!(!s.norms_in_reduce);
        assert!(s.any_set());
        assert_eq!(s.pdl.as_deref(), Some("0"));
        assert!(s.decode_attn_split && s.verify_attn_rows && s.attn_prefill_pair && !s.fold_norms && !s.w4_gemm);
        assert_eq!(s.nvrtc_options, ["-DA=1", "-DB=2"]);
        assert_eq!(s.trace_cap.as_deref(), Some("1024"));
        assert_eq!(s.verify_decode_from, Some(0));
        assert_eq!(s.short_chunk_decode_from, Some(8192));
        assert!(!s.attn_prefill_wide);
        assert!(from(&[("DELTASERVE_ATTN_PREFILL", "wide")]).attn_prefill_wide);
        assert!(from(&[("DELTASERVE_ATTN_PREFILL", "wg")]).attn_prefill_wg);
        assert!(from(&[("DELTASERVE_ATTN_PREFILL", "ws")]).attn_prefill_ws);
    }

    #[test]
    fn other_values_keep_the_defaults() {
        let s = from(&[
            ("DELTASERVE_DECODE_ATTN", "mma"),
            ("DELTASERVE_VERIFY_ATTN", "together"),
            ("DELTASERVE_ATTN_PREFILL", "wgmma"),
            ("DELTASERVE_FOLD", "1"),
            ("DELTASERVE_DEVICE_MASKS", "1"),
            ("DELTASERVE_VERIFY_DECODE_FROM", "soon"),
        ]);
        assert!(!s.decode_attn_split && !s.verify_attn_rows && !s.attn_prefill_pair && s.fold_norms && s.device_masks);
        assert!(!s.attn_prefill_wide);
        assert!(!s.any_set());
    }
}
