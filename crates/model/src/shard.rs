//! Tensor-parallel sharding (Megatron style): for a [`ModelConfig`] and a rank of a world of 1, 2, 4 or
//! 8 cards, which part of every weight tensor that rank holds. Pure: no backend, no allocation beyond
//! the extracted shards.
//!
//! Column-parallel projections (their outputs split) are followed by row-parallel ones (their inputs
//! split), so one all-reduce (sum) after each row-parallel projection restores the replicated residual
//! stream:
//!
//! | tensor | split | by |
//! |---|---|---|
//! | `embed_tokens`, `lm_head` `[V, D]` | rows | vocabulary range `ceil(V / world)` per rank (the last may be shorter) |
//! | attention `q_proj` `[2·H·hd, D]` (per head `[q \| gate]`) | rows | query heads |
//! | attention `k_proj`, `v_proj` `[KV·hd, D]` | rows | kv heads (whole GQA groups: query head `h` reads kv head `h / (H/KV)`) |
//! | attention `o_proj` `[D, H·hd]` | columns | query heads |
//! | DeltaNet `in_proj_qkv` `[2·Hk·dk + Hv·dv, D]`, `conv1d` `[C, K]` | rows, three ranges | the rank's key heads in the q block and in the k block, its value heads in the v block |
//! | DeltaNet `in_proj_z` `[Hv·dv, D]`, `in_proj_b`, `in_proj_a` `[Hv, D]`, `A_log`, `dt_bias` `[Hv]` | rows | value heads |
//! | DeltaNet `out_proj` `[D, Hv·dv]` | columns | value heads |
//! | MLP `gate_proj`, `up_proj` `[I, D]` | rows | intermediate range `ceil(I / world)` per rank |
//! | MLP `down_proj` `[D, I]` | columns | the same intermediate range |
//! | every norm (incl. the DeltaNet gated norm `[dv]`, shared by all heads), MTP `fc` | replicated | |
//!
//! DeltaNet value head `v` reads key head `v / (Hv/Hk)` (consecutive groups, HF layout), so a rank that
//! owns key heads `[k0, k1)` owns value heads `[k0·r, k1·r)`: whole groups, and the rank's local value
//! head `j` reads its local key head `j / r` as in the unsharded model. Likewise for attention. A world
//! size must therefore divide the attention kv heads and the DeltaNet key heads (the 27B: 4 kv, 16 key
//! heads → 1, 2 or 4 cards). Names are the canonical ones of [`crate::weights`] (after the Qwen3-Next
//! unpack), without the `model.` / `model.language_model.` prefix: `layers.3.self_attn.q_proj.weight`.
//!
//! A rank's model is an ordinary model of a smaller shape ([`ShardSpec::rank_config`]: heads, value
//! heads, intermediate size and vocabulary divided) whose mixer and MLP outputs are partial sums.

use std::ops::Range;

use crate::checkpoint::DType;
use crate::config::{Dims, LayerKind, ModelConfig};
use crate::error::ModelError;
use crate::quant::{GptqParams, GptqSource, ZeroFormat};
use crate::weights::{
    AttentionWeights, DeltaNetWeights, HostTensor, LayerWeights, MixerWeights, MlpWeights, ModelWeights, MtpWeights,
};

/// The tensor-parallel sizes supported.
pub const WORLD_SIZES: [usize; 4] = [1, 2, 4, 8];

/// How one tensor is split across ranks: what a rank keeps.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Split {
    /// Every rank holds the whole tensor.
    Replicated,
    /// These rows (dim 0) of the tensor, concatenated in order. For a 1-D tensor, these elements.
    Rows(Vec<Range<usize>>),
    /// These columns (dim 1) of a 2-D `[out, in]` tensor, concatenated in order.
    Cols(Vec<Range<usize>>),
}

impl Split {
    fn kept(ranges: &[Range<usize>]) -> usize {
        ranges.iter().map(|r| r.len()).sum()
    }

    /// The shard's shape for a full tensor of `shape`.
    pub fn shard_shape(&self, shape: &[usize]) -> Vec<usize> {
        let mut s = shape.to_vec();
        match self {
            Self::Replicated => {}
            Self::Rows(r) => s[0] = Self::kept(r),
            Self::Cols(r) => s[1] = Self::kept(r),
        }
        s
    }

    /// The shard of a full row-major tensor of `shape` (elements of any type: f32 values, or the
    /// `u16` bits of bf16). `name` is for errors only.
    pub fn extract<T: Copy>(&self, name: &str, shape: &[usize], data: &[T]) -> Result<Vec<T>, ModelError> {
        let numel: usize = shape.iter().product();
        if data.len() != numel || shape.is_empty() {
            return Err(ModelError::weights(format!("shard of `{name}`: {} values for shape {shape:?}", data.len())));
        }
        let bad_range = |r: &Range<usize>, n: usize, what: &str| {
            ModelError::weights(format!("shard of `{name}` (shape {shape:?}): {what} {r:?} outside 0..{n}"))
        };
        match self {
            Self::Replicated => Ok(data.to_vec()),
            Self::Rows(ranges) => {
                let row: usize = shape[1..].iter().product();
                let mut out = Vec::with_capacity(Self::kept(ranges) * row);
                for r in ranges {
                    if r.start > r.end || r.end > shape[0] {
                        return Err(bad_range(r, shape[0], "rows"));
                    }
                    out.extend_from_slice(&data[r.start * row..r.end * row]);
                }
                Ok(out)
            }
            Self::Cols(ranges) => {
                if shape.len() != 2 {
                    return Err(ModelError::weights(format!(
                        "shard of `{name}`: a column split needs a 2-D tensor, shape is {shape:?}"
                    )));
                }
                let cols = shape[1];
                for r in ranges {
                    if r.start > r.end || r.end > cols {
                        return Err(bad_range(r, cols, "columns"));
                    }
                }
                let mut out = Vec::with_capacity(shape[0] * Self::kept(ranges));
                for row in data.chunks_exact(cols) {
                    for r in ranges {
                        out.extend_from_slice(&row[r.clone()]);
                    }
                }
                Ok(out)
            }
        }
    }
}

/// One tensor of the model and how it is split for one rank.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorShard {
    /// Canonical name, e.g. `layers.0.linear_attn.in_proj_qkv.weight`.
    pub name: String,
    /// The full tensor's shape.
    pub shape: Vec<usize>,
    pub split: Split,
}

impl TensorShard {
    /// The rank's shape.
    pub fn shard_shape(&self) -> Vec<usize> {
        self.split.shard_shape(&self.shape)
    }
    /// The rank's part of the full tensor `data` (row-major f32 of [`Self::shape`]).
    pub fn extract(&self, data: &[f32]) -> Result<Vec<f32>, ModelError> {
        self.split.extract(&self.name, &self.shape, data)
    }
}

/// What rank `rank` of `world` holds: head, intermediate and vocabulary ranges.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardSpec {
    pub rank: usize,
    pub world: usize,
    /// Attention query heads and kv heads.
    pub q_heads: Range<usize>,
    pub kv_heads: Range<usize>,
    /// DeltaNet key heads and value heads (whole groups).
    pub gdn_k_heads: Range<usize>,
    pub gdn_v_heads: Range<usize>,
    /// MLP intermediate rows.
    pub intermediate: Range<usize>,
    /// Vocabulary rows of the embedding and lm_head.
    pub vocab: Range<usize>,
    dims: Dims,
}

/// The canonical name of a stored tensor name: without the `model.language_model.` / `model.`
/// prefix and without the note the loader appends to projections it unpacks from Qwen3-Next's packed
/// tensors (`… (from packed Qwen3-Next projection)`).
pub fn canonical_name(stored: &str) -> &str {
    let name = stored.split(" (").next().unwrap_or(stored);
    name.strip_prefix("model.language_model.").or_else(|| name.strip_prefix("model.")).unwrap_or(name)
}

/// `[rank·c, (rank+1)·c) ∩ [0, n)` with `c = ceil(n / world)`: the last ranks may be shorter.
fn ceil_range(n: usize, rank: usize, world: usize) -> Range<usize> {
    let c = n.div_ceil(world);
    (rank * c).min(n)..((rank + 1) * c).min(n)
}

fn even_range(n: usize, rank: usize, world: usize) -> Range<usize> {
    let c = n / world;
    rank * c..(rank + 1) * c
}

fn scale(r: &Range<usize>, by: usize) -> Range<usize> {
    r.start * by..r.end * by
}

fn shift(r: Range<usize>, by: usize) -> Range<usize> {
    r.start + by..r.end + by
}

/// Checks that `world` is a supported tensor-parallel size for `cfg` (see the module docs).
pub fn check_world(cfg: &ModelConfig, world: usize) -> Result<(), ModelError> {
    if !WORLD_SIZES.contains(&world) {
        return Err(ModelError::unsupported(format!("tensor parallel size {world}: must be 1, 2, 4 or 8")));
    }
    if world > 1 && cfg.moe.is_some() {
        return Err(ModelError::unsupported(format!(
            "tensor parallel size {world}: mixture-of-experts models run on one device for now"
        )));
    }
    let d = cfg.dims();
    let ok: Vec<String> = WORLD_SIZES
        .iter()
        .filter(|&&w| d.kv_heads.is_multiple_of(w) && d.gdn_k_heads.is_multiple_of(w))
        .map(|w| w.to_string())
        .collect();
    let ok = ok.join(", ");
    if !d.kv_heads.is_multiple_of(world) {
        return Err(ModelError::unsupported(format!(
            "tensor parallel size {world} does not divide the model's {} attention kv heads ({} query heads): \
             attention is split by whole kv-head groups; this model takes tensor parallel sizes {ok}",
            d.kv_heads, d.q_heads
        )));
    }
    if !d.gdn_k_heads.is_multiple_of(world) {
        return Err(ModelError::unsupported(format!(
            "tensor parallel size {world} does not divide the model's {} DeltaNet key heads ({} value heads): \
             DeltaNet is split by whole key-head groups; this model takes tensor parallel sizes {ok}",
            d.gdn_k_heads, d.gdn_v_heads
        )));
    }
    Ok(())
}

impl ShardSpec {
    /// The shard of rank `rank` of `world` for `cfg`; an error names the head counts a world size does
    /// not divide.
    pub fn new(cfg: &ModelConfig, rank: usize, world: usize) -> Result<Self, ModelError> {
        check_world(cfg, world)?;
        if rank >= world {
            return Err(ModelError::unsupported(format!(
                "tensor parallel rank {rank} is not below the world size {world}"
            )));
        }
        let d = cfg.dims();
        let kv_heads = even_range(d.kv_heads, rank, world);
        let gdn_k_heads = even_range(d.gdn_k_heads, rank, world);
        Ok(Self {
            rank,
            world,
            q_heads: scale(&kv_heads, d.q_per_kv),
            kv_heads,
            gdn_v_heads: scale(&gdn_k_heads, d.gdn_ratio),
            gdn_k_heads,
            intermediate: ceil_range(d.intermediate, rank, world),
            vocab: ceil_range(d.vocab, rank, world),
            dims: d,
        })
    }

    /// Every rank of `world`.
    pub fn all(cfg: &ModelConfig, world: usize) -> Result<Vec<Self>, ModelError> {
        (0..world).map(|r| Self::new(cfg, r, world)).collect()
    }

    /// The model shape a rank runs: heads, kv heads, DeltaNet heads, intermediate size and vocabulary
    /// of this rank; everything else (hidden size, layers, head dims, norms' eps) unchanged. Rank 0
    /// holds the largest shard, so its config is the per-card worst case.
    pub fn rank_config(&self, cfg: &ModelConfig) -> ModelConfig {
        let mut c = cfg.clone();
        c.num_attention_heads = self.q_heads.len();
        c.num_key_value_heads = self.kv_heads.len();
        c.linear_num_key_heads = self.gdn_k_heads.len();
        c.linear_num_value_heads = self.gdn_v_heads.len();
        c.intermediate_size = self.intermediate.len();
        c.vocab_size = self.vocab.len();
        c
    }

    /// How the tensor stored as `stored` in a checkpoint (`model.language_model.layers.3.…`, or a
    /// projection unpacked from Qwen3-Next's `in_proj_qkvz` / `in_proj_ba`) is split for this rank.
    pub fn split_stored(&self, stored: &str) -> Result<Split, ModelError> {
        self.split(canonical_name(stored))
    }

    /// How the tensor called `name` (canonical, see the module docs) is split for this rank.
    pub fn split(&self, name: &str) -> Result<Split, ModelError> {
        let d = &self.dims;
        let rows = |r: Range<usize>| Split::Rows(vec![r]);
        let suffix = name
            .strip_prefix("mtp.layers.0.")
            .or_else(|| {
                let rest = name.strip_prefix("layers.")?;
                let dot = rest.find('.')?;
                rest[..dot].parse::<usize>().ok().map(|_| &rest[dot + 1..])
            })
            .unwrap_or(name);
        let qkv = || {
            let kw = d.gdn_key_width;
            Split::Rows(vec![
                scale(&self.gdn_k_heads, d.gdn_k_dim),
                shift(scale(&self.gdn_k_heads, d.gdn_k_dim), kw),
                shift(scale(&self.gdn_v_heads, d.gdn_v_dim), 2 * kw),
            ])
        };
        Ok(match suffix {
            "embed_tokens.weight" | "lm_head.weight" => rows(self.vocab.clone()),
            "norm.weight"
            | "input_layernorm.weight"
            | "post_attention_layernorm.weight"
            | "self_attn.q_norm.weight"
            | "self_attn.k_norm.weight"
            | "linear_attn.norm.weight"
            | "mtp.fc.weight"
            | "mtp.pre_fc_norm_embedding.weight"
            | "mtp.pre_fc_norm_hidden.weight"
            | "mtp.norm.weight" => Split::Replicated,
            "self_attn.q_proj.weight" => rows(scale(&self.q_heads, 2 * d.head_dim)),
            "self_attn.k_proj.weight" | "self_attn.v_proj.weight" => rows(scale(&self.kv_heads, d.head_dim)),
            "self_attn.o_proj.weight" => Split::Cols(vec![scale(&self.q_heads, d.head_dim)]),
            "linear_attn.in_proj_qkv.weight" | "linear_attn.conv1d.weight" => qkv(),
            "linear_attn.in_proj_z.weight" => rows(scale(&self.gdn_v_heads, d.gdn_v_dim)),
            "linear_attn.in_proj_b.weight"
            | "linear_attn.in_proj_a.weight"
            | "linear_attn.A_log"
            | "linear_attn.dt_bias" => rows(self.gdn_v_heads.clone()),
            "linear_attn.out_proj.weight" => Split::Cols(vec![scale(&self.gdn_v_heads, d.gdn_v_dim)]),
            "mlp.gate_proj.weight" | "mlp.up_proj.weight" => rows(self.intermediate.clone()),
            "mlp.down_proj.weight" => Split::Cols(vec![self.intermediate.clone()]),
            _ => return Err(ModelError::weights(format!("no tensor-parallel split for tensor `{name}`"))),
        })
    }

    /// Every text-model tensor (and the MTP head's when `with_mtp` and the config declares one) with
    /// its full shape and this rank's split.
    pub fn tensors(&self, cfg: &ModelConfig, with_mtp: bool) -> Result<Vec<TensorShard>, ModelError> {
        let mut shapes = shape_skeleton(cfg);
        if !with_mtp {
            shapes.mtp = None;
        }
        let mut out = Vec::new();
        visit_named(&shapes, &mut |name, shape| {
            out.push(TensorShard { name: name.to_string(), shape: shape.clone(), split: self.split(name)? });
            Ok(())
        })?;
        Ok(out)
    }

    /// This rank's shards of full f32 weights (the MTP head too, when present).
    pub fn shard_weights(&self, w: &ModelWeights<HostTensor>) -> Result<ModelWeights<HostTensor>, ModelError> {
        try_map_named(w, &mut |name, t: &HostTensor| {
            let split = self.split(name)?;
            Ok(HostTensor { shape: split.shard_shape(&t.shape), data: split.extract(name, &t.shape, &t.data)? })
        })
    }
}

/// One GPTQ-packed linear cut to a rank's shard, owning its tensors ([`shard_gptq`]).
#[derive(Clone, Debug)]
pub struct GptqShard {
    pub params: GptqParams,
    pub zero_format: ZeroFormat,
    pub out_features: usize,
    pub in_features: usize,
    pub qweight: Vec<u8>,
    pub qzeros: Option<Vec<u8>>,
    pub scales: Vec<u8>,
    pub scales_dtype: DType,
    pub g_idx: Option<Vec<u8>>,
}

impl GptqShard {
    pub fn source(&self) -> GptqSource<'_> {
        GptqSource {
            params: self.params,
            zero_format: self.zero_format,
            out_features: self.out_features,
            in_features: self.in_features,
            qweight: &self.qweight,
            qzeros: self.qzeros.as_deref(),
            scales: &self.scales,
            scales_dtype: self.scales_dtype,
            g_idx: self.g_idx.as_deref(),
        }
    }
}

/// The columns `ranges` (in elements of `elem` bytes) of a row-major byte matrix with `cols` columns.
fn byte_cols(data: &[u8], cols: usize, elem: usize, ranges: &[Range<usize>]) -> Vec<u8> {
    let row = cols * elem;
    let mut out = Vec::with_capacity(data.len() / row.max(1) * ranges.iter().map(|r| r.len() * elem).sum::<usize>());
    for r in data.chunks_exact(row.max(1)) {
        for c in ranges {
            out.extend_from_slice(&r[c.start * elem..c.end * elem]);
        }
    }
    out
}

/// The rows `ranges` of a row-major byte matrix of rows of `row` bytes.
fn byte_rows(data: &[u8], row: usize, ranges: &[Range<usize>]) -> Vec<u8> {
    ranges.iter().flat_map(|r| data[r.start * row..r.end * row].iter().copied()).collect()
}

/// Cuts a GPTQ-packed `[out, in]` linear (qweight I32 `[in·bits/32, out]`, qzeros I32 `[groups,
/// out·bits/32]`, scales `[groups, out]`, g_idx I32 `[in]`) to `split`, without unpacking:
/// - rows of the weight (output features) are columns of qweight, scales and qzeros (a range must hold
///   whole qzeros words: multiples of 32/bits);
/// - columns (input features) are rows of qweight (multiples of 32/bits) and whole groups of scales and
///   qzeros (multiples of the group size, or the one group of per-channel weights). Act-order weights
///   (a `g_idx` that does not follow the input order) cannot be cut by input columns: the device format
///   keeps 128 consecutive columns per scale, and a shard of act-order columns has no such groups.
pub fn shard_gptq(split: &Split, src: &GptqSource<'_>, name: &str) -> Result<GptqShard, ModelError> {
    let (out, inp) = (src.out_features, src.in_features);
    let bits = src.params.bits as usize;
    if bits == 0 || 32 % bits != 0 {
        return Err(ModelError::unsupported(format!("`{name}`: GPTQ with {bits} bits cannot be sharded")));
    }
    let pf = 32 / bits;
    let gs = src.params.group_size.unwrap_or(inp).max(1);
    let groups = inp.div_ceil(gs);
    let selem = match src.scales_dtype {
        DType::F32 => 4,
        _ => 2,
    };
    let whole = |what: &str, r: &Range<usize>, unit: usize| {
        if r.start.is_multiple_of(unit) && r.end.is_multiple_of(unit) {
            Ok(())
        } else {
            Err(ModelError::unsupported(format!(
                "`{name}`: its tensor-parallel shard {what} {r:?} does not fall on whole units of {unit}"
            )))
        }
    };
    let owned = |qweight, qzeros, scales, g_idx, out_features, in_features| GptqShard {
        params: src.params,
        zero_format: src.zero_format,
        out_features,
        in_features,
        qweight,
        qzeros,
        scales,
        scales_dtype: src.scales_dtype,
        g_idx,
    };
    match split {
        Split::Replicated => Ok(owned(
            src.qweight.to_vec(),
            src.qzeros.map(<[u8]>::to_vec),
            src.scales.to_vec(),
            src.g_idx.map(<[u8]>::to_vec),
            out,
            inp,
        )),
        Split::Rows(ranges) => {
            for r in ranges {
                whole("rows", r, pf)?;
            }
            let words: Vec<Range<usize>> = ranges.iter().map(|r| r.start / pf..r.end / pf).collect();
            Ok(owned(
                byte_cols(src.qweight, out, 4, ranges),
                src.qzeros.map(|z| byte_cols(z, out / pf, 4, &words)),
                byte_cols(src.scales, out, selem, ranges),
                src.g_idx.map(<[u8]>::to_vec),
                Split::kept(ranges),
                inp,
            ))
        }
        Split::Cols(ranges) => {
            if let Some(g) = src.g_idx {
                let act_order = g
                    .chunks_exact(4)
                    .enumerate()
                    .any(|(i, w)| u32::from_le_bytes([w[0], w[1], w[2], w[3]]) as usize != i / gs);
                if act_order {
                    return Err(ModelError::unsupported(format!(
                        "`{name}`: act-order (desc_act) GPTQ weights cannot be split by input columns for tensor \
                         parallelism; use --tensor-parallel 1 or a checkpoint quantised without desc_act"
                    )));
                }
            }
            let kept = Split::kept(ranges);
            // Per-channel weights: every shard keeps the one group.
            let group_rows: Vec<Range<usize>> = if groups == 1 {
                std::iter::once(0..1).collect()
            } else {
                for r in ranges {
                    whole("input columns", r, gs)?;
                }
                ranges.iter().map(|r| r.start / gs..r.end / gs).collect()
            };
            for r in ranges {
                whole("input columns", r, pf)?;
            }
            let qrows: Vec<Range<usize>> = ranges.iter().map(|r| r.start / pf..r.end / pf).collect();
            let mut shard = owned(
                byte_rows(src.qweight, out * 4, &qrows),
                src.qzeros.map(|z| byte_rows(z, out / pf * 4, &group_rows)),
                byte_rows(src.scales, out * selem, &group_rows),
                src.g_idx.map(|_| (0..kept).flat_map(|i| ((i / gs) as u32).to_le_bytes()).collect()),
                out,
                kept,
            );
            if groups == 1 {
                // One group over the shard's input columns (per-channel).
                shard.params = GptqParams { group_size: None, ..src.params };
            }
            Ok(shard)
        }
    }
}

/// The full shape of every tensor of `cfg`, in the structure of [`ModelWeights`] (the MTP head when
/// the config declares one; conv1d as `[C, K]` as loaded).
pub fn shape_skeleton(cfg: &ModelConfig) -> ModelWeights<Vec<usize>> {
    let d = cfg.dims();
    let h = d.hidden;
    let attention = || AttentionWeights {
        q_proj: vec![2 * d.attn_dim, h],
        k_proj: vec![d.kv_dim, h],
        v_proj: vec![d.kv_dim, h],
        o_proj: vec![h, d.attn_dim],
        q_norm: vec![d.head_dim],
        k_norm: vec![d.head_dim],
    };
    let mlp = || MlpWeights {
        gate_proj: vec![d.intermediate, h],
        up_proj: vec![d.intermediate, h],
        down_proj: vec![h, d.intermediate],
    };
    let layers = cfg
        .layer_types
        .iter()
        .map(|kind| LayerWeights {
            input_norm: vec![h],
            post_norm: vec![h],
            mixer: match kind {
                LayerKind::DeltaNet => MixerWeights::DeltaNet(DeltaNetWeights {
                    in_proj_qkv: vec![d.conv_channels, h],
                    in_proj_z: vec![d.gdn_value_width, h],
                    in_proj_b: vec![d.gdn_v_heads, h],
                    in_proj_a: vec![d.gdn_v_heads, h],
                    conv1d: vec![d.conv_channels, d.conv_kernel],
                    dt_bias: vec![d.gdn_v_heads],
                    a_log: vec![d.gdn_v_heads],
                    norm: vec![d.gdn_v_dim],
                    out_proj: vec![h, d.gdn_value_width],
                }),
                LayerKind::Attention => MixerWeights::Attention(attention()),
            },
            mlp: mlp(),
            moe: None,
        })
        .collect();
    let mtp = (cfg.mtp_num_hidden_layers > 0).then(|| MtpWeights {
        fc: vec![h, 2 * h],
        pre_fc_norm_embedding: vec![h],
        pre_fc_norm_hidden: vec![h],
        norm: vec![h],
        layer: LayerWeights {
            input_norm: vec![h],
            post_norm: vec![h],
            mixer: MixerWeights::Attention(attention()),
            mlp: mlp(),
            moe: None,
        },
    });
    ModelWeights {
        embed: vec![d.vocab, h],
        lm_head: (!cfg.tie_word_embeddings).then(|| vec![d.vocab, h]),
        final_norm: vec![h],
        layers,
        mtp,
    }
}

/// Calls `f` with the canonical name of every tensor of `w`, in load order.
pub fn visit_named<T>(
    w: &ModelWeights<T>,
    f: &mut dyn FnMut(&str, &T) -> Result<(), ModelError>,
) -> Result<(), ModelError> {
    try_map_named(w, &mut |name, t| f(name, t)).map(|_: ModelWeights<()>| ())
}

/// Maps every tensor of `w` with its canonical name, keeping the structure.
pub fn try_map_named<T, U>(
    w: &ModelWeights<T>,
    f: &mut dyn FnMut(&str, &T) -> Result<U, ModelError>,
) -> Result<ModelWeights<U>, ModelError> {
    let embed = f("embed_tokens.weight", &w.embed)?;
    let lm_head = w.lm_head.as_ref().map(|t| f("lm_head.weight", t)).transpose()?;
    let final_norm = f("norm.weight", &w.final_norm)?;
    let layers = w
        .layers
        .iter()
        .enumerate()
        .map(|(i, l)| map_layer(&format!("layers.{i}."), l, f))
        .collect::<Result<Vec<_>, _>>()?;
    let mtp = match &w.mtp {
        None => None,
        Some(m) => Some(MtpWeights {
            fc: f("mtp.fc.weight", &m.fc)?,
            pre_fc_norm_embedding: f("mtp.pre_fc_norm_embedding.weight", &m.pre_fc_norm_embedding)?,
            pre_fc_norm_hidden: f("mtp.pre_fc_norm_hidden.weight", &m.pre_fc_norm_hidden)?,
            norm: f("mtp.norm.weight", &m.norm)?,
            layer: map_layer("mtp.layers.0.", &m.layer, f)?,
        }),
    };
    Ok(ModelWeights { embed, lm_head, final_norm, layers, mtp })
}

fn map_layer<T, U>(
    prefix: &str,
    l: &LayerWeights<T>,
    f: &mut dyn FnMut(&str, &T) -> Result<U, ModelError>,
) -> Result<LayerWeights<U>, ModelError> {
    let mut g = |s: &str, t: &T| f(&format!("{prefix}{s}"), t);
    let input_norm = g("input_layernorm.weight", &l.input_norm)?;
    let mixer = match &l.mixer {
        MixerWeights::DeltaNet(m) => MixerWeights::DeltaNet(DeltaNetWeights {
            in_proj_qkv: g("linear_attn.in_proj_qkv.weight", &m.in_proj_qkv)?,
            in_proj_z: g("linear_attn.in_proj_z.weight", &m.in_proj_z)?,
            in_proj_b: g("linear_attn.in_proj_b.weight", &m.in_proj_b)?,
            in_proj_a: g("linear_attn.in_proj_a.weight", &m.in_proj_a)?,
            conv1d: g("linear_attn.conv1d.weight", &m.conv1d)?,
            dt_bias: g("linear_attn.dt_bias", &m.dt_bias)?,
            a_log: g("linear_attn.A_log", &m.a_log)?,
            norm: g("linear_attn.norm.weight", &m.norm)?,
            out_proj: g("linear_attn.out_proj.weight", &m.out_proj)?,
        }),
        MixerWeights::Attention(m) => MixerWeights::Attention(AttentionWeights {
            q_proj: g("self_attn.q_proj.weight", &m.q_proj)?,
            k_proj: g("self_attn.k_proj.weight", &m.k_proj)?,
            v_proj: g("self_attn.v_proj.weight", &m.v_proj)?,
            o_proj: g("self_attn.o_proj.weight", &m.o_proj)?,
            q_norm: g("self_attn.q_norm.weight", &m.q_norm)?,
            k_norm: g("self_attn.k_norm.weight", &m.k_norm)?,
        }),
    };
    let post_norm = g("post_attention_layernorm.weight", &l.post_norm)?;
    let mlp = MlpWeights {
        gate_proj: g("mlp.gate_proj.weight", &l.mlp.gate_proj)?,
        up_proj: g("mlp.up_proj.weight", &l.mlp.up_proj)?,
        down_proj: g("mlp.down_proj.weight", &l.mlp.down_proj)?,
    };
    if l.moe.is_some() {
        return Err(ModelError::unsupported("tensor parallelism of mixture-of-experts layers is not supported yet"));
    }
    Ok(LayerWeights { input_norm, post_norm, mixer, mlp, moe: None })
}

/// Concatenates the shards of all ranks of one tensor back into the full tensor (the inverse of
/// [`Split::extract`] over a world; a replicated tensor is taken from rank 0). For tests and checks.
pub fn unshard(name: &str, shape: &[usize], splits: &[Split], shards: &[Vec<f32>]) -> Result<Vec<f32>, ModelError> {
    let numel: usize = shape.iter().product();
    let mut full = vec![0.0f32; numel];
    let mut covered = vec![false; numel];
    let err = |m: String| ModelError::weights(format!("unshard `{name}`: {m}"));
    if splits.len() != shards.len() || splits.is_empty() {
        return Err(err(format!("{} splits for {} shards", splits.len(), shards.len())));
    }
    for (split, shard) in splits.iter().zip(shards) {
        if shard.len() != split.shard_shape(shape).iter().product::<usize>() {
            return Err(err(format!("shard of {} values does not match split {split:?}", shard.len())));
        }
        let mut put = |i: usize, v: f32| -> Result<(), ModelError> {
            if covered[i] && full[i].to_bits() != v.to_bits() {
                return Err(err(format!("element {i} held twice with different values")));
            }
            covered[i] = true;
            full[i] = v;
            Ok(())
        };
        match split {
            Split::Replicated => {
                for (i, &v) in shard.iter().enumerate() {
                    put(i, v)?;
                }
            }
            Split::Rows(ranges) => {
                let row: usize = shape[1..].iter().product();
                let mut src = shard.iter();
                for r in ranges {
                    for i in r.start * row..r.end * row {
                        put(i, *src.next().unwrap_or(&f32::NAN))?;
                    }
                }
            }
            Split::Cols(ranges) => {
                let (rows, cols) = (shape[0], shape[1]);
                let mut src = shard.iter();
                for row in 0..rows {
                    for r in ranges {
                        for c in r.clone() {
                            put(row * cols + c, *src.next().unwrap_or(&f32::NAN))?;
                        }
                    }
                }
            }
        }
    }
    if let Some(i) = covered.iter().position(|c| !c) {
        return Err(err(format!("element {i} is held by no rank")));
    }
    Ok(full)
}
