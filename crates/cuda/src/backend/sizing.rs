//! Sizes of what the backend places: the scratch region's parts, the weight layout of each format (random,
//! bf16 or int4, from a checkpoint), tensor shards, and the kernels' specialisation.

use deltaserve_model::shard::{ShardSpec, Split};
use deltaserve_model::{Checkpoint, LayerKind, ModelConfig, ModelError, ModelWeights};
use deltaserve_plan::{PlanOptions, WeightsDtype};

use crate::error::CudaError;
use crate::nvrtc::KernelDims;
use crate::ops::init::Init;
use crate::ops::{attention, gdn_chunk};
use crate::w4::W4Bytes;

pub(super) const ALIGN: usize = crate::arena::ALIGN;

pub(super) fn al(x: usize) -> usize {
    x.div_ceil(ALIGN) * ALIGN
}

/// Bound of the bf16 slice an int4 linear is dequantised into for a prefill GEMM (the int4
/// prefill path: `w4_dequant` of a row slice, then cuBLASLt on it, writing the slice's columns).
pub const W4_SLICE_BYTES: usize = 64 << 20;

/// The parts of the backend's scratch region, in order.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ScratchParts {
    /// Chunked DeltaNet f32 workspace.
    pub gdn: usize,
    /// Varlen chunk and tile tables.
    pub chunk_table: usize,
    pub tile_table: usize,
    /// bf16 `[8, max in]`: x gathered in device-column order for act-order int4 weights.
    pub w4_x: usize,
    /// bf16 slice of dequantised int4 weight rows (prefill GEMMs); 0 without int4 decoder linears.
    pub w4_slice: usize,
}

impl ScratchParts {
    /// For steps of `t_max` tokens and `s_max` sequences; `int4_linears` / `lm_head_int4` as the
    /// plan's options say.
    pub fn new(cfg: &ModelConfig, t_max: usize, s_max: usize, int4_linears: bool, lm_head_int4: bool) -> Self {
        let d = cfg.dims();
        let dims = kernel_dims(cfg);
        let gdn = if d.num_deltanet_layers > 0 { gdn_chunk::workspace_bytes(t_max, d.gdn_v_heads, &dims) } else { 0 };
        let lin = decoder_linear_shapes(cfg);
        let max_in = lin.iter().map(|&(_, i)| i).max().unwrap_or(0).max(d.hidden);
        let (w4_x, w4_slice) = if int4_linears {
            let biggest = lin.iter().map(|&(o, i)| 2 * o * i).max().unwrap_or(0);
            (2 * 8 * max_in, biggest.min(W4_SLICE_BYTES))
        } else if lm_head_int4 {
            (2 * 8 * d.hidden, 0)
        } else {
            (0, 0)
        };
        ScratchParts {
            gdn,
            chunk_table: 8 * (t_max / gdn_chunk::CHUNK + s_max + 1),
            tile_table: 8 * (t_max / attention::Q_TILE + s_max + 1),
            w4_x,
            w4_slice,
        }
    }

    /// Bytes of the region (each part 256-byte aligned).
    pub fn total(&self) -> usize {
        al(self.gdn) + al(self.chunk_table) + al(self.tile_table) + al(self.w4_x) + al(self.w4_slice)
    }
}

/// Every decoder linear's `[out, in]` (the shapes the plan prices).
pub(super) fn decoder_linear_shapes(cfg: &ModelConfig) -> Vec<(usize, usize)> {
    let d = cfg.dims();
    let h = d.hidden;
    let mut v = Vec::new();
    for kind in &cfg.layer_types {
        match kind {
            LayerKind::DeltaNet => v.extend([
                (d.conv_channels, h),
                (d.gdn_value_width, h),
                (d.gdn_v_heads, h),
                (d.gdn_v_heads, h),
                (h, d.gdn_value_width),
            ]),
            LayerKind::Attention => v.extend([(2 * d.attn_dim, h), (d.kv_dim, h), (d.kv_dim, h), (h, d.attn_dim)]),
        }
        v.extend([(d.intermediate, h), (d.intermediate, h), (h, d.intermediate)]);
    }
    v
}

/// Rows per dequantised slice of an `[out, in]` int4 linear in a slice buffer of `slice_bytes`:
/// all rows when they fit, else a multiple of 128 (at least 16 rows, or an error at the caller).
pub fn w4_slice_rows(out: usize, inp: usize, slice_bytes: usize) -> usize {
    let fit = slice_bytes / (2 * inp.max(1));
    if fit >= out {
        out
    } else if fit >= 128 {
        fit / 128 * 128
    } else {
        fit / 16 * 16
    }
}

/// The backend scratch the plan must reserve (`PlanOptions::backend_scratch_bytes`) for bf16
/// weights: bounded by the step's tokens and sequences, never by prompt length.
pub fn scratch_bytes(cfg: &ModelConfig, t_max: usize, s_max: usize) -> usize {
    ScratchParts::new(cfg, t_max, s_max, false, false).total()
}

/// [`scratch_bytes`] for the plan's options: int4 decoder linears add the bf16 slice the prefill
/// GEMMs dequantise into ([`W4_SLICE_BYTES`] at most) and the act-order x scratch; an int4 lm_head
/// the x scratch. Under tensor parallelism: one card's (its shard of the heads), as the plan.
pub fn scratch_bytes_for(cfg: &ModelConfig, opts: &PlanOptions) -> usize {
    let int4 = opts.weights_dtype == WeightsDtype::Int4;
    let card = deltaserve_plan::card_config(cfg, opts.tensor_parallel).unwrap_or_else(|_| cfg.clone());
    ScratchParts::new(&card, opts.max_batch_tokens, opts.max_seqs, int4, opts.lm_head_int4).total()
}

/// Kernel specialisation for a model.
pub fn kernel_dims(cfg: &ModelConfig) -> KernelDims {
    let d = cfg.dims();
    KernelDims {
        gdn_k_dim: d.gdn_k_dim,
        gdn_v_dim: d.gdn_v_dim,
        conv_kernel: d.conv_kernel,
        attn_head_dim: d.head_dim,
        gqa_group: d.q_per_kv.max(1),
        gdn_bv: if d.gdn_v_dim.is_multiple_of(32) { 32 } else { 16 },
    }
}

pub(super) fn is_f32_tensor(name: &str) -> bool {
    name.ends_with("A_log") || name.ends_with("dt_bias") || name.ends_with("linear_attn.norm.weight")
}

/// How the backend stores the weights (from the plan's options).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WeightFormat {
    /// Decoder linears in int4 (one part per linear) instead of bf16 (pairs fused).
    pub int4: bool,
    /// The MTP head too (speculative decoding on, and the model declares one).
    pub mtp: bool,
    /// int4 with zero points.
    pub asym: bool,
    pub lm_head_int4: bool,
    pub embed_on_host: bool,
}

impl WeightFormat {
    pub fn of(opts: &PlanOptions) -> Self {
        WeightFormat {
            int4: opts.weights_dtype == WeightsDtype::Int4,
            mtp: opts.speculative_tokens > 0,
            asym: opts.int4_asym,
            lm_head_int4: opts.lm_head_int4,
            embed_on_host: opts.embed_on_host,
        }
    }
    /// A device lm_head of its own (not the device embedding).
    pub(super) fn own_lm_head(&self, cfg: &ModelConfig) -> bool {
        !cfg.tie_word_embeddings || self.embed_on_host || self.lm_head_int4
    }
}

/// One tensor of the backend's weight layout.
#[derive(Clone, Copy, Debug)]
pub(super) enum WSpec {
    /// `n` elements, bf16 or f32, with the random init.
    Dense { n: usize, f32: bool, init: Init },
    /// An int4 `[out, in]` linear (random init: weights of std `1/sqrt(in)`).
    W4 { out: usize, inp: usize, asym: bool },
    /// The embedding table in pinned host memory.
    Host { n: usize },
}

impl WSpec {
    pub(super) fn device_bytes(&self) -> usize {
        match *self {
            WSpec::Dense { n, f32, .. } => al(n * if f32 { 4 } else { 2 }),
            WSpec::W4 { out, inp, asym } => W4Bytes::new(out, inp, asym, false).layout(ALIGN).1,
            WSpec::Host { .. } => 0,
        }
    }
}

/// Every tensor in load order: embedding, own lm_head, final norm, then per layer the norms and
/// the mixer's and MLP's tensors, then the MTP head's (fc, its three norms, its layer). bf16 pairs
/// (in_proj_b + in_proj_a, gate + up) are one entry of both halves; int4 pairs two entries.
pub(super) fn weight_specs(cfg: &ModelConfig, f: WeightFormat) -> Vec<WSpec> {
    let d = cfg.dims();
    let h = d.hidden;
    let dense = |n: usize, init: Init| WSpec::Dense { n, f32: false, init };
    let lin = |o: usize, i: usize| -> Vec<WSpec> {
        if f.int4 {
            vec![WSpec::W4 { out: o, inp: i, asym: f.asym }]
        } else {
            vec![dense(o * i, Init::Normal(1.0 / (i as f32).sqrt()))]
        }
    };
    let pair = |o: usize, i: usize| -> Vec<WSpec> {
        if f.int4 {
            vec![WSpec::W4 { out: o, inp: i, asym: f.asym }, WSpec::W4 { out: o, inp: i, asym: f.asym }]
        } else {
            vec![dense(2 * o * i, Init::Normal(1.0 / (i as f32).sqrt()))]
        }
    };
    let normw = |n: usize| dense(n, Init::Normal(0.1));
    let mut v =
        vec![if f.embed_on_host { WSpec::Host { n: d.vocab * h } } else { dense(d.vocab * h, Init::Normal(1.0)) }];
    if f.own_lm_head(cfg) {
        if f.lm_head_int4 {
            v.push(WSpec::W4 { out: d.vocab, inp: h, asym: f.asym });
        } else {
            v.push(dense(d.vocab * h, Init::Normal(1.0 / (h as f32).sqrt())));
        }
    }
    v.push(normw(h));
    let mtp = f.mtp && cfg.mtp_num_hidden_layers > 0;
    let kinds = cfg.layer_types.iter().map(|k| (false, *k));
    for (is_mtp, kind) in kinds.chain(mtp.then_some((true, LayerKind::Attention))) {
        if is_mtp {
            v.extend(lin(h, 2 * h));
            v.extend([normw(h), normw(h), normw(h)]);
        }
        v.push(normw(h));
        v.push(normw(h));
        match kind {
            LayerKind::DeltaNet => {
                v.extend(lin(d.conv_channels, h));
                v.extend(lin(d.gdn_value_width, h));
                v.extend(pair(d.gdn_v_heads, h));
                v.push(dense(d.conv_channels * d.conv_kernel, Init::Normal(0.5)));
                v.push(WSpec::Dense { n: d.gdn_v_heads, f32: true, init: Init::Normal(0.5) });
                v.push(WSpec::Dense { n: d.gdn_v_heads, f32: true, init: Init::LogUniform1To16 });
                v.push(WSpec::Dense { n: d.gdn_v_dim, f32: true, init: Init::OnePlusNormal(0.1) });
                v.extend(lin(h, d.gdn_value_width));
            }
            LayerKind::Attention => {
                v.extend(lin(2 * d.attn_dim, h));
                v.extend(lin(d.kv_dim, h));
                v.extend(lin(d.kv_dim, h));
                v.extend(lin(h, d.attn_dim));
                v.push(normw(d.head_dim));
                v.push(normw(d.head_dim));
            }
        }
        v.extend(pair(d.intermediate, h));
        v.extend(lin(h, d.intermediate));
    }
    v
}

/// Device bytes of the weights as the backend places them for random weights and for a bf16
/// checkpoint (quantised at load when `f.int4`): what it compares with the plan's `weights`
/// region. It differs from the plan only by the three small DeltaNet tensors the backend keeps in
/// f32 (`A_log`, `dt_bias`, the gated-norm weight; the plan prices them 16-bit) and, for bf16,
/// by the alignment padding the fused pairs save.
pub fn weights_device_bytes(cfg: &ModelConfig, f: WeightFormat) -> usize {
    weight_specs(cfg, f).iter().map(WSpec::device_bytes).sum()
}

/// A decoder linear (stored `[out, in]` projection) by its tensor name.
pub(super) fn is_linear(name: &str) -> bool {
    if name == "mtp.fc.weight" {
        return true;
    }
    const LIN: [&str; 12] = [
        "in_proj_qkv.weight",
        "in_proj_z.weight",
        "in_proj_b.weight",
        "in_proj_a.weight",
        "out_proj.weight",
        "q_proj.weight",
        "k_proj.weight",
        "v_proj.weight",
        "o_proj.weight",
        "gate_proj.weight",
        "up_proj.weight",
        "down_proj.weight",
    ];
    LIN.iter().any(|l| name.ends_with(&format!(".{l}")) || name == *l)
}

/// True when a GPTQ `g_idx` is not `i / group` (act-order): the conversion may need a permutation.
pub(super) fn act_order(g: &deltaserve_model::quant::GptqSource<'_>) -> bool {
    let gs = g.params.group_size.unwrap_or(g.in_features).max(1);
    g.g_idx.is_some_and(|b| {
        b.chunks_exact(4).enumerate().any(|(i, w)| u32::from_le_bytes([w[0], w[1], w[2], w[3]]) as usize != i / gs)
    })
}

/// Device bytes the backend places for the weights of checkpoint `dir` in format `f` (an upper
/// bound: act-order GPTQ linears are counted with their permutation). For a GPTQ checkpoint under
/// an int4 plan this differs from the plan's `weights` region by the linears the checkpoint leaves
/// unquantised (kept bf16) and the act-order permutations; callers reserve the difference as
/// backend scratch (the backend takes it from there). Under tensor parallelism, `shard`'s share (the
/// tensors cut as the rank loads them; `cfg` is the whole model).
pub fn checkpoint_weights_bytes(
    cfg: &ModelConfig,
    dir: &std::path::Path,
    f: WeightFormat,
    shard: Option<&ShardSpec>,
) -> Result<usize, CudaError> {
    let ckpt = Checkpoint::open(dir).map_err(|e| CudaError::Weights(e.to_string()))?;
    let keep_dense = matches!(cfg.quantization, Some(deltaserve_model::quant::Quantization::Gptq(_)));
    let w4 = |o: usize, i: usize, asym: bool, perm: bool| W4Bytes::new(o, i, asym, perm).layout(ALIGN).1;
    let mut total = 0usize;
    let _: ModelWeights<()> = ModelWeights::load(&ckpt, cfg, |src| {
        let name = &src.name;
        let shape = match shard {
            Some(s) => s.split_stored(name)?.shard_shape(&src.shape),
            None => src.shape.clone(),
        };
        let numel: usize = shape.iter().product();
        let dense2 = al(2 * numel);
        let lin = |int4: bool, keep: bool| match &src.quantized {
            Some(deltaserve_model::QuantizedSource::Gptq(g)) if int4 => {
                w4(shape[0], shape[1], !g.params.sym, act_order(g))
            }
            _ if int4 && !keep => w4(shape[0], shape[1], f.asym, false),
            _ => dense2,
        };
        total += if name.ends_with("embed_tokens.weight") {
            let head = if cfg.tie_word_embeddings && f.own_lm_head(cfg) {
                if f.lm_head_int4 { w4(shape[0], shape[1], f.asym, false) } else { dense2 }
            } else {
                0
            };
            head + if f.embed_on_host { 0 } else { dense2 }
        } else if name.ends_with("lm_head.weight") {
            lin(f.lm_head_int4, false)
        } else if f.int4 && is_linear(name) {
            lin(true, keep_dense)
        } else if is_f32_tensor(name) {
            al(4 * numel)
        } else {
            dense2
        };
        Ok(())
    })
    .map_err(|e| CudaError::Weights(e.to_string()))?;
    Ok(total)
}

/// A tensor's shard from its full little-endian bytes, `N` bytes per element (one copy: the shard).
pub(super) fn shard_bytes<const N: usize>(
    split: &Split,
    name: &str,
    shape: &[usize],
    bytes: &[u8],
) -> Result<Vec<u8>, ModelError> {
    let (elems, rest) = bytes.as_chunks::<N>();
    if !rest.is_empty() {
        return Err(ModelError::weights(format!("`{name}`: {} bytes are not whole {N}-byte elements", bytes.len())));
    }
    Ok(split.extract(name, shape, elems)?.into_flattened())
}
