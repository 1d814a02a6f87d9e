//! The embedded kernel sources: every module's CUDA C text and the kernels it defines.

/// One `.cu` file and the kernels it defines.
pub struct KernelSource {
    pub module: &'static str,
    pub src: &'static str,
    pub functions: &'static [&'static str],
}

/// Every kernel source of the crate.
pub const SOURCES: &[KernelSource] = &[
    KernelSource { module: "embed", src: include_str!("../../kernels/embed.cu"), functions: &["embed_gather"] },
    KernelSource { module: "argmax", src: include_str!("../../kernels/argmax.cu"), functions: &["argmax_rows"] },
    KernelSource {
        module: "sample",
        src: include_str!("../../kernels/sample.cu"),
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
    KernelSource { module: "feed", src: include_str!("../../kernels/feed.cu"), functions: &["feed_rows"] },
    KernelSource {
        module: "vision",
        src: include_str!("../../kernels/vision.cu"),
        functions: &[
            "vision_embed_pos",
            "vision_add_norm",
            "vision_qkv_rope",
            "vision_attn_d64",
            "vision_attn_d72",
            "vision_attn_d128",
            "vision_bias_act",
        ],
    },
    KernelSource {
        module: "init",
        src: include_str!("../../kernels/init.cu"),
        functions: &["init_random", "init_smem"],
    },
    KernelSource {
        module: "norm",
        src: include_str!("../../kernels/norm.cu"),
        functions: &[
            "add_rms_norm_1p",
            "add_rms_norm_1p_rows",
            "add_rms_norm_1p_parts",
            "rms_norm_1p",
            "gated_rms_norm",
            "gated_rms_norm128",
        ],
    },
    KernelSource {
        module: "elementwise",
        src: include_str!("../../kernels/elementwise.cu"),
        functions: &["sigmoid_gate_mul", "swiglu", "sigmoid_gate_mul8", "swiglu8"],
    },
    KernelSource {
        module: "rope",
        src: include_str!("../../kernels/rope.cu"),
        functions: &["rope_partial", "qk_norm_rope", "qk_norm_rope_v2", "qk_norm_rope_v4", "qk_norm_rope_v8"],
    },
    KernelSource { module: "kv_cache", src: include_str!("../../kernels/kv_cache.cu"), functions: &["kv_write"] },
    KernelSource { module: "kv_quant", src: include_str!("../../kernels/kv_quant.cu"), functions: &["kv_write_q"] },
    KernelSource {
        module: "conv",
        src: include_str!("../../kernels/conv.cu"),
        functions: &["conv_prefill", "conv_prefill8", "conv_state_update", "conv_state_save", "conv_decode"],
    },
    KernelSource {
        module: "gdn_gate",
        src: include_str!("../../kernels/gdn_gate.cu"),
        functions: &["gdn_gate", "gdn_conv_gate_decode", "gdn_conv_gate_rows"],
    },
    KernelSource {
        module: "gdn_chunk",
        // The prep and the one-stream walk, then the walk with its output on warps of its own.
        src: concat!(include_str!("../../kernels/gdn_chunk.cu"), include_str!("../../kernels/gdn_chunk_ws.cu")),
        functions: &["gdn_chunk_prep", "gdn_chunk_state", "gdn_chunk_state_bf16", "gdn_chunk_state_ws"],
    },
    KernelSource {
        module: "gdn_decode",
        src: include_str!("../../kernels/gdn_decode.cu"),
        functions: &[
            "gdn_decode",
            "gdn_recurrent",
            "gdn_decode_gated",
            "gdn_recurrent_gated",
            "gdn_rows",
            "gdn_commit_layers",
        ],
    },
    KernelSource {
        module: "mtp",
        src: include_str!("../../kernels/mtp.cu"),
        functions: &["shift_rows", "scatter_rows"],
    },
    KernelSource { module: "gemv", src: include_str!("../../kernels/gemv.cu"), functions: &["gemv_bf16"] },
    KernelSource {
        module: "fp8",
        // The GEMV, quantisers and dequantiser, then the tensor-core GEMM.
        src: concat!(include_str!("../../kernels/fp8.cu"), include_str!("../../kernels/fp8_gemm.cu")),
        functions: &[
            "gemv_fp8_n8",
            "gemv_fp8_n16",
            "fp8_act_quant",
            "fp8_swiglu_quant",
            "fp8_dequant",
            "fp8_quantize",
            "gemm_fp8",
        ],
    },
    KernelSource {
        module: "moe",
        src: include_str!("../../kernels/moe.cu"),
        functions: &["moe_route", "moe_offsets", "moe_permute", "moe_gemm", "moe_gemv", "moe_unpermute"],
    },
    KernelSource {
        module: "w4a16",
        // The pair GEMV's device code, then its kernels.
        src: concat!(include_str!("../../kernels/w4_pair.cuh"), include_str!("../../kernels/w4a16.cu")),
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
        src: concat!(include_str!("../../kernels/w4_tile.cuh"), include_str!("../../kernels/w4_gemm.cu")),
        functions: &["w4g_16", "w4g_24", "w4g_32", "w4g_48", "w4g_64", "w4t_16s", "w4t_16a", "w4g_reduce"],
    },
    KernelSource {
        module: "moe_w4",
        // The int4 experts run the pair GEMV's and the tile GEMM's device code.
        src: concat!(
            include_str!("../../kernels/w4_pair.cuh"),
            include_str!("../../kernels/w4_tile.cuh"),
            include_str!("../../kernels/moe_w4.cu")
        ),
        functions: &["moe_w4p_sh", "moe_w4p_sb", "moe_w4p_ah", "moe_w4p_ab", "moe_w4g"],
    },
    KernelSource {
        module: "attention",
        // The shared tile code, the prefill kernels (warp pairs, wide, then Hopper's wgmma; the warp-specialised
        // one after its e4m3 pieces), the decode kernels' shared tensor-core pieces, then the decode and the
        // verify kernels: one module.
        src: concat!(
            include_str!("../../kernels/attention_tile.cuh"),
            include_str!("../../kernels/attention_prefill.cu"),
            include_str!("../../kernels/attention_prefill_wide.cu"),
            include_str!("../../kernels/attention_prefill_wg.cu"),
            include_str!("../../kernels/attention_prefill_e4m3.cuh"),
            include_str!("../../kernels/attention_prefill_ws.cu"),
            include_str!("../../kernels/attention_mma.cuh"),
            include_str!("../../kernels/attention_decode.cu"),
            include_str!("../../kernels/attention_verify.cu")
        ),
        functions: &[
            "attn_prefill",
            "attn_prefill_wide",
            "attn_prefill_wide64",
            "attn_prefill_wg",
            "attn_prefill_ws",
            "attn_decode_split",
            "attn_decode_combine",
            "attn_decode_mma",
            "attn_verify_mma",
        ],
    },
];

#[cfg(test)]
mod tests {
    use super::SOURCES;

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
}
