//! The canonical weight set of the text model, independent of checkpoint naming and of the storage a
//! backend wants. [`ModelWeights::load`] maps HF names (`model.language_model.*` or `model.*`,
//! `lm_head.weight` or tied embeddings), checks every shape (errors name the tensor and both shapes),
//! unpacks Qwen3-Next's `in_proj_qkvz` / `in_proj_ba` into the Qwen3.5 layout, skips `model.visual.*`,
//! and hands each tensor to a backend converter as a [`TensorSource`]. The `mtp.*` tensors (the
//! multi-token-prediction head used for speculative decoding, docs/architecture.md §2.5 / §5.2) are loaded
//! separately by [`ModelWeights::load_mtp`]; a checkpoint without them still loads. The head's MLP is
//! loaded as a main layer's is: sparse in a mixture-of-experts model.
//!
//! A sparse (mixture-of-experts) layer's [`LayerWeights::mlp`] is its shared expert, and
//! [`LayerWeights::moe`] holds the router, the routed experts and the shared expert's gate; experts are
//! read one tensor per expert (`mlp.experts.{i}.{gate,up,down}_proj.weight`, what `save_pretrained`
//! writes) or from the fused `[E, 2·I, D]` / `[E, D, I]` tensors (`mlp.experts.gate_up_proj` /
//! `mlp.experts.down_proj`) when a checkpoint stores those (`moe_weights`).
//!
//! Linear weights of quantised checkpoints (GPTQ / AutoRound int4, block FP8; see [`crate::quant`])
//! arrive as a [`TensorSource`] whose [`TensorSource::quantized`] holds the packed encoding;
//! [`TensorSource::to_f32`] dequantises them, so f32 converters need no change.

use indicatif::{ProgressBar, ProgressStyle};

use crate::checkpoint::{Checkpoint, DType, TensorRef};
use crate::config::{Arch, LayerKind, ModelConfig};
use crate::error::ModelError;
use crate::moe_weights;
use crate::quant::{self, QuantizedSource};

/// The bytes of one canonical tensor.
///
/// Dense tensors (`quantized: None`): the concatenation of `parts` (row ranges of stored tensors) in
/// `dtype`. Quantised linears (`quantized: Some`): `shape` is the dequantised `[out, in]`, `parts`
/// holds the main packed tensor (GPTQ `qweight`, dtype I32; FP8 `weight`, dtype F8E4M3) and
/// `quantized` the whole encoding with its scales; [`Self::to_f32`] dequantises.
pub struct TensorSource<'a> {
    /// Canonical (Qwen3.5 HF) name, e.g. `layers.3.linear_attn.in_proj_qkv.weight`.
    pub name: String,
    pub shape: Vec<usize>,
    pub dtype: DType,
    pub parts: Vec<&'a [u8]>,
    /// The packed encoding of a quantised linear weight; `None` for dense tensors.
    pub quantized: Option<QuantizedSource<'a>>,
}

impl TensorSource<'_> {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
    /// Checkpoint bytes behind the tensor (all of a quantised encoding, scales included).
    pub fn byte_len(&self) -> usize {
        match &self.quantized {
            Some(q) => q.byte_len(),
            None => self.parts.iter().map(|p| p.len()).sum(),
        }
    }
    /// True for a quantised linear (see [`Self::quantized`]).
    pub fn is_quantized(&self) -> bool {
        self.quantized.is_some()
    }
    /// The tensor as f32 (quantised linears dequantised).
    pub fn to_f32(&self) -> Result<Vec<f32>, ModelError> {
        if let Some(q) = &self.quantized {
            return q.dequantize(&self.name);
        }
        let mut out = Vec::with_capacity(self.numel());
        for p in &self.parts {
            TensorRef::bytes_to_f32(&self.name, self.dtype, p, &mut out)?;
        }
        Ok(out)
    }
}

/// A dense f32 tensor in host memory (the CPU reference backend's storage).
#[derive(Clone, Debug, PartialEq)]
pub struct HostTensor {
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

impl HostTensor {
    pub fn from_source(src: &TensorSource) -> Result<Self, ModelError> {
        Ok(Self { shape: src.shape.clone(), data: src.to_f32()? })
    }
}

/// Gated DeltaNet mixer weights (Qwen3.5 layout).
pub struct DeltaNetWeights<T> {
    /// [conv_channels, hidden]: rows [q (Hk·dk) | k (Hk·dk) | v (Hv·dv)].
    pub in_proj_qkv: T,
    /// [Hv·dv, hidden]
    pub in_proj_z: T,
    /// [Hv, hidden]
    pub in_proj_b: T,
    /// [Hv, hidden]
    pub in_proj_a: T,
    /// [conv_channels, kernel] (stored as [C, 1, K]).
    pub conv1d: T,
    /// [Hv]
    pub dt_bias: T,
    /// [Hv]
    pub a_log: T,
    /// [dv], plain weight (not 1+w).
    pub norm: T,
    /// [hidden, Hv·dv]
    pub out_proj: T,
}

/// Gated attention mixer weights.
pub struct AttentionWeights<T> {
    /// [2·H·hd, hidden]: per head [q (hd) | gate (hd)].
    pub q_proj: T,
    /// [KV·hd, hidden]
    pub k_proj: T,
    /// [KV·hd, hidden]
    pub v_proj: T,
    /// [hidden, H·hd]
    pub o_proj: T,
    /// [hd], used as 1+w.
    pub q_norm: T,
    /// [hd], used as 1+w.
    pub k_norm: T,
}

pub enum MixerWeights<T> {
    DeltaNet(DeltaNetWeights<T>),
    Attention(AttentionWeights<T>),
}

/// SwiGLU MLP weights.
pub struct MlpWeights<T> {
    /// [intermediate, hidden]
    pub gate_proj: T,
    /// [intermediate, hidden]
    pub up_proj: T,
    /// [hidden, intermediate]
    pub down_proj: T,
}

pub struct LayerWeights<T> {
    /// [hidden], 1+w
    pub input_norm: T,
    /// [hidden], 1+w
    pub post_norm: T,
    pub mixer: MixerWeights<T>,
    /// The dense MLP; in a sparse layer, the shared expert (`mlp.shared_expert.*`).
    pub mlp: MlpWeights<T>,
    /// The routed experts of a sparse (mixture-of-experts) layer; `None` in a dense layer.
    pub moe: Option<MoeWeights<T>>,
}

/// The routed part of a sparse layer's MLP (its shared expert is [`LayerWeights::mlp`]).
pub struct MoeWeights<T> {
    /// [num_experts, hidden]: the router (`mlp.gate.weight`).
    pub router: T,
    /// One SwiGLU MLP per expert: gate and up [expert_intermediate, hidden], down [hidden, expert_intermediate].
    pub experts: Vec<MlpWeights<T>>,
    /// [1, hidden]: the shared expert's sigmoid gate (`mlp.shared_expert_gate.weight`).
    pub shared_expert_gate: T,
}

pub struct ModelWeights<T> {
    /// [vocab, hidden]
    pub embed: T,
    /// [vocab, hidden]; `None` when the embeddings are tied.
    pub lm_head: Option<T>,
    /// [hidden], 1+w
    pub final_norm: T,
    pub layers: Vec<LayerWeights<T>>,
    /// The MTP head (speculative decoding), when loaded with [`ModelWeights::load_mtp`].
    pub mtp: Option<MtpWeights<T>>,
}

/// The multi-token-prediction head (docs/architecture.md §2.5): from the main model's post-final-norm hidden
/// `h_t` and the embedding of the next token `e`, `x = fc([norm_e(e) | norm_h(h_t)])`, one gated
/// full-attention decoder layer (its own KV cache), then `norm`; logits through the shared lm_head.
/// It shares the embedding and lm_head with the main model.
pub struct MtpWeights<T> {
    /// [hidden, 2·hidden]: columns [embedding half | hidden half].
    pub fc: T,
    /// [hidden], 1+w, applied to the token embedding.
    pub pre_fc_norm_embedding: T,
    /// [hidden], 1+w, applied to the main model's hidden state.
    pub pre_fc_norm_hidden: T,
    /// [hidden], 1+w, after the decoder layer.
    pub norm: T,
    /// The decoder layer (always a gated attention mixer).
    pub layer: LayerWeights<T>,
}

impl<T> ModelWeights<T> {
    /// The output projection (the embedding table when tied).
    pub fn lm_head(&self) -> &T {
        self.lm_head.as_ref().unwrap_or(&self.embed)
    }
}

impl ModelWeights<HostTensor> {
    /// Loads every weight as f32 host tensors (CPU reference backend), the MTP head included when
    /// the checkpoint has one.
    pub fn load_f32(ckpt: &Checkpoint, cfg: &ModelConfig) -> Result<Self, ModelError> {
        let mut w = Self::load(ckpt, cfg, |src| HostTensor::from_source(&src))?;
        w.mtp = Self::load_mtp(ckpt, cfg, |src| HostTensor::from_source(&src))?;
        Ok(w)
    }
}

impl<T> ModelWeights<T> {
    /// Maps, checks and converts every text-model weight with `convert`, showing progress by bytes.
    pub fn load(
        ckpt: &Checkpoint,
        cfg: &ModelConfig,
        mut convert: impl FnMut(TensorSource<'_>) -> Result<T, ModelError>,
    ) -> Result<Self, ModelError> {
        let names = Names::detect(ckpt, cfg)?;
        let stored: Vec<String> = names
            .all_stored(ckpt, cfg)
            .into_iter()
            .flat_map(|n| {
                let companions = quant::companion_names(&n);
                std::iter::once(n).chain(companions)
            })
            .collect();
        let total: u64 = stored.iter().filter_map(|n| ckpt.get(n).ok()).map(|t| t.bytes.len() as u64).sum();
        let q = cfg.quantization.as_ref();
        let lin = |name: &str, shape: [usize; 2]| linear(ckpt, q, name, shape);
        let bar = ProgressBar::new(total).with_message("loading weights");
        bar.set_style(
            ProgressStyle::with_template("{msg} [{bar:40}] {bytes}/{total_bytes} ({bytes_per_sec}, eta {eta})")
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("=> "),
        );
        let mut load = |src: TensorSource<'_>| -> Result<T, ModelError> {
            let n = src.byte_len() as u64;
            let t = convert(src)?;
            bar.inc(n);
            Ok(t)
        };
        let d = cfg.dims();
        let h = d.hidden;
        let embed = load(direct(ckpt, &names.model("embed_tokens.weight"), &[d.vocab, h])?)?;
        let lm_head = if cfg.tie_word_embeddings { None } else { Some(load(lin("lm_head.weight", [d.vocab, h])?)?) };
        let final_norm = load(direct(ckpt, &names.model("norm.weight"), &[h])?)?;
        let mut layers = Vec::with_capacity(d.num_layers);
        for (i, kind) in cfg.layer_types.iter().enumerate() {
            let l = |s: &str| names.model(&format!("layers.{i}.{s}"));
            let input_norm = load(direct(ckpt, &l("input_layernorm.weight"), &[h])?)?;
            let post_norm = load(direct(ckpt, &l("post_attention_layernorm.weight"), &[h])?)?;
            let mixer = match kind {
                LayerKind::DeltaNet => {
                    let p = |s: &str| l(&format!("linear_attn.{s}"));
                    let (qkv, z, b, a) = match cfg.arch {
                        Arch::Qwen35 => (
                            lin(&p("in_proj_qkv.weight"), [d.conv_channels, h])?,
                            lin(&p("in_proj_z.weight"), [d.gdn_value_width, h])?,
                            lin(&p("in_proj_b.weight"), [d.gdn_v_heads, h])?,
                            lin(&p("in_proj_a.weight"), [d.gdn_v_heads, h])?,
                        ),
                        Arch::Qwen3Next => {
                            unpack_qwen3_next(ckpt, cfg, &p("in_proj_qkvz.weight"), &p("in_proj_ba.weight"))?
                        }
                    };
                    let mut conv = direct(ckpt, &p("conv1d.weight"), &[d.conv_channels, 1, d.conv_kernel])?;
                    conv.shape = vec![d.conv_channels, d.conv_kernel];
                    MixerWeights::DeltaNet(DeltaNetWeights {
                        in_proj_qkv: load(qkv)?,
                        in_proj_z: load(z)?,
                        in_proj_b: load(b)?,
                        in_proj_a: load(a)?,
                        conv1d: load(conv)?,
                        dt_bias: load(direct(ckpt, &p("dt_bias"), &[d.gdn_v_heads])?)?,
                        a_log: load(direct(ckpt, &p("A_log"), &[d.gdn_v_heads])?)?,
                        norm: load(direct(ckpt, &p("norm.weight"), &[d.gdn_v_dim])?)?,
                        out_proj: load(lin(&p("out_proj.weight"), [h, d.gdn_value_width])?)?,
                    })
                }
                LayerKind::Attention => {
                    let p = |s: &str| l(&format!("self_attn.{s}"));
                    MixerWeights::Attention(AttentionWeights {
                        q_proj: load(lin(&p("q_proj.weight"), [2 * d.attn_dim, h])?)?,
                        k_proj: load(lin(&p("k_proj.weight"), [d.kv_dim, h])?)?,
                        v_proj: load(lin(&p("v_proj.weight"), [d.kv_dim, h])?)?,
                        o_proj: load(lin(&p("o_proj.weight"), [h, d.attn_dim])?)?,
                        q_norm: load(direct(ckpt, &p("q_norm.weight"), &[d.head_dim])?)?,
                        k_norm: load(direct(ckpt, &p("k_norm.weight"), &[d.head_dim])?)?,
                    })
                }
            };
            let sparse = cfg.moe.as_ref().filter(|m| m.is_sparse(i));
            let (mlp, moe) = moe_weights::load_mlp(ckpt, q, sparse, h, d.intermediate, &l("mlp."), &mut load)?;
            layers.push(LayerWeights { input_norm, post_norm, mixer, mlp, moe });
        }
        bar.finish_and_clear();
        let used = stored;
        let unused: Vec<&str> = ckpt
            .names()
            .into_iter()
            .filter(|n| !n.starts_with("model.visual.") && !n.starts_with("mtp.") && !used.iter().any(|u| u == n))
            .collect();
        if !unused.is_empty() {
            tracing::warn!(count = unused.len(), first = unused[0], "checkpoint tensors not used by the text model");
        }
        tracing::info!(bytes = total, tensors = used.len(), "weights loaded");
        Ok(Self { embed, lm_head, final_norm, layers, mtp: None })
    }

    /// The MTP head (`mtp.*`), converted with `convert`. `None` when the config declares no MTP layer
    /// (`mtp_num_hidden_layers: 0`) or the checkpoint has no `mtp.fc.weight` (MTP tensors are often
    /// stripped from quantised exports). A partial head (some `mtp.*` tensors missing) is an error that
    /// names the missing tensor. Only the first MTP layer is used (Qwen3.5/3.6 ship one).
    ///
    /// The head's layer is a gated-attention decoder layer; its MLP is a mixture of experts in a
    /// mixture-of-experts model ([`crate::MoeConfig::mtp_is_sparse`]), named as a main layer's
    /// (`mtp.layers.0.mlp.gate.weight`, `mlp.shared_expert.*`, `mlp.shared_expert_gate.weight`, and the
    /// experts one tensor per expert or fused `mlp.experts.gate_up_proj` / `mlp.experts.down_proj`) and
    /// read by the same code.
    pub fn load_mtp(
        ckpt: &Checkpoint,
        cfg: &ModelConfig,
        mut convert: impl FnMut(TensorSource<'_>) -> Result<T, ModelError>,
    ) -> Result<Option<MtpWeights<T>>, ModelError> {
        if cfg.mtp_num_hidden_layers == 0 || !ckpt.contains("mtp.fc.weight") {
            return Ok(None);
        }
        if cfg.mtp_num_hidden_layers > 1 {
            tracing::warn!(layers = cfg.mtp_num_hidden_layers, "only the first MTP layer is used for drafting");
        }
        let d = cfg.dims();
        let h = d.hidden;
        let q = cfg.quantization.as_ref();
        let lin = |name: &str, shape: [usize; 2]| linear(ckpt, q, name, shape);
        let vec = |name: &str, n: usize| direct(ckpt, name, &[n]);
        let l = |s: &str| format!("mtp.layers.0.{s}");
        // Linears first, then the norms (the order backends place them in).
        let fc = convert(lin("mtp.fc.weight", [h, 2 * h])?)?;
        let q_proj = convert(lin(&l("self_attn.q_proj.weight"), [2 * d.attn_dim, h])?)?;
        let k_proj = convert(lin(&l("self_attn.k_proj.weight"), [d.kv_dim, h])?)?;
        let v_proj = convert(lin(&l("self_attn.v_proj.weight"), [d.kv_dim, h])?)?;
        let o_proj = convert(lin(&l("self_attn.o_proj.weight"), [h, d.attn_dim])?)?;
        let sparse = cfg.moe.as_ref().filter(|m| m.mtp_is_sparse());
        let (mlp, moe) = moe_weights::load_mlp(ckpt, q, sparse, h, d.intermediate, &l("mlp."), &mut convert)?;
        let pre_fc_norm_embedding = convert(vec("mtp.pre_fc_norm_embedding.weight", h)?)?;
        let pre_fc_norm_hidden = convert(vec("mtp.pre_fc_norm_hidden.weight", h)?)?;
        let norm = convert(vec("mtp.norm.weight", h)?)?;
        let input_norm = convert(vec(&l("input_layernorm.weight"), h)?)?;
        let post_norm = convert(vec(&l("post_attention_layernorm.weight"), h)?)?;
        let q_norm = convert(vec(&l("self_attn.q_norm.weight"), d.head_dim)?)?;
        let k_norm = convert(vec(&l("self_attn.k_norm.weight"), d.head_dim)?)?;
        let mixer = MixerWeights::Attention(AttentionWeights { q_proj, k_proj, v_proj, o_proj, q_norm, k_norm });
        Ok(Some(MtpWeights {
            fc,
            pre_fc_norm_embedding,
            pre_fc_norm_hidden,
            norm,
            layer: LayerWeights { input_norm, post_norm, mixer, mlp, moe },
        }))
    }
}

/// Where the text model's tensors live: `model.language_model.` (multimodal) or `model.` (text-only).
struct Names {
    prefix: &'static str,
}

impl Names {
    fn detect(ckpt: &Checkpoint, cfg: &ModelConfig) -> Result<Self, ModelError> {
        for prefix in ["model.language_model.", "model."] {
            if ckpt.contains(&format!("{prefix}embed_tokens.weight")) {
                return Ok(Self { prefix });
            }
        }
        let _ = cfg;
        Err(ModelError::MissingTensor {
            name: "model.language_model.embed_tokens.weight".into(),
            hint: " (nor `model.embed_tokens.weight`): is this a Qwen3.5/3.6 or Qwen3-Next checkpoint?".into(),
        })
    }
    fn model(&self, s: &str) -> String {
        format!("{}{s}", self.prefix)
    }
    /// Every stored tensor name the text model reads.
    fn all_stored(&self, ckpt: &Checkpoint, cfg: &ModelConfig) -> Vec<String> {
        let mut v = vec![self.model("embed_tokens.weight"), self.model("norm.weight")];
        if !cfg.tie_word_embeddings {
            v.push("lm_head.weight".into());
        }
        for (i, kind) in cfg.layer_types.iter().enumerate() {
            let l = |s: &str| self.model(&format!("layers.{i}.{s}"));
            v.push(l("input_layernorm.weight"));
            v.push(l("post_attention_layernorm.weight"));
            v.extend(moe_weights::mlp_stored_names(ckpt, cfg.moe.as_ref().filter(|m| m.is_sparse(i)), &l("mlp.")));
            let mixer: &[&str] = match (kind, cfg.arch) {
                (LayerKind::Attention, _) => &[
                    "self_attn.q_proj.weight",
                    "self_attn.k_proj.weight",
                    "self_attn.v_proj.weight",
                    "self_attn.o_proj.weight",
                    "self_attn.q_norm.weight",
                    "self_attn.k_norm.weight",
                ],
                (LayerKind::DeltaNet, Arch::Qwen35) => &[
                    "linear_attn.in_proj_qkv.weight",
                    "linear_attn.in_proj_z.weight",
                    "linear_attn.in_proj_b.weight",
                    "linear_attn.in_proj_a.weight",
                    "linear_attn.conv1d.weight",
                    "linear_attn.dt_bias",
                    "linear_attn.A_log",
                    "linear_attn.norm.weight",
                    "linear_attn.out_proj.weight",
                ],
                (LayerKind::DeltaNet, Arch::Qwen3Next) => &[
                    "linear_attn.in_proj_qkvz.weight",
                    "linear_attn.in_proj_ba.weight",
                    "linear_attn.conv1d.weight",
                    "linear_attn.dt_bias",
                    "linear_attn.A_log",
                    "linear_attn.norm.weight",
                    "linear_attn.out_proj.weight",
                ],
            };
            v.extend(mixer.iter().map(|s| l(s)));
        }
        v
    }
}

/// A stored tensor used as is, after a shape check.
pub(crate) fn direct<'a>(ckpt: &'a Checkpoint, name: &str, shape: &[usize]) -> Result<TensorSource<'a>, ModelError> {
    let t = ckpt.get_shaped(name, shape)?;
    Ok(TensorSource {
        name: name.to_string(),
        shape: shape.to_vec(),
        dtype: t.dtype,
        parts: vec![t.bytes],
        quantized: None,
    })
}

/// A linear weight `[out, in]`: its quantised encoding when the checkpoint stores one, else dense.
pub(crate) fn linear<'a>(
    ckpt: &'a Checkpoint,
    q: Option<&quant::Quantization>,
    name: &str,
    shape: [usize; 2],
) -> Result<TensorSource<'a>, ModelError> {
    match quant::linear_source(ckpt, q, name, shape)? {
        Some(enc) => {
            let (dtype, main) = match &enc {
                QuantizedSource::Gptq(g) => (DType::I32, g.qweight),
                QuantizedSource::Fp8Block(f) => (DType::F8E4M3, f.weight),
            };
            Ok(TensorSource {
                name: name.to_string(),
                shape: shape.to_vec(),
                dtype,
                parts: vec![main],
                quantized: Some(enc),
            })
        }
        None if q.is_some() && !ckpt.contains(name) => Err(ModelError::MissingTensor {
            name: name.to_string(),
            hint: format!(" (nor its quantised form `{}.qweight`)", name.strip_suffix(".weight").unwrap_or(name)),
        }),
        None => direct(ckpt, name, &shape),
    }
}

/// Splits Qwen3-Next's packed projections into the Qwen3.5 layout.
/// `in_proj_qkvz` rows, per key-head group g: [q_g (dk) | k_g (dk) | v_g (r·dv) | z_g (r·dv)];
/// `in_proj_ba` rows, per group: [b_g (r) | a_g (r)]. Output: qkv = [q_0..q_G | k_0..k_G | v_0..v_G], z, b, a.
fn unpack_qwen3_next<'a>(
    ckpt: &'a Checkpoint,
    cfg: &ModelConfig,
    qkvz_name: &str,
    ba_name: &str,
) -> Result<(TensorSource<'a>, TensorSource<'a>, TensorSource<'a>, TensorSource<'a>), ModelError> {
    let d = cfg.dims();
    let h = d.hidden;
    let (dk, dv, r, groups) = (d.gdn_k_dim, d.gdn_v_dim, d.gdn_ratio, d.gdn_k_heads);
    // Splitting a packed projection by rows would need column slices of GPTQ's qweight/scales/qzeros
    // and row ranges across FP8 scale blocks; refuse rather than dequantise into owned buffers.
    for name in [qkvz_name, ba_name] {
        if quant::is_stored_quantized(ckpt, name) {
            return Err(ModelError::unsupported(format!(
                "tensor `{name}`: quantised Qwen3-Next packed projections (in_proj_qkvz / in_proj_ba) are not \
                 supported yet; use a checkpoint that leaves them unquantised"
            )));
        }
    }
    let qkvz = ckpt.get_shaped(qkvz_name, &[2 * d.gdn_key_width + 2 * d.gdn_value_width, h])?;
    let ba = ckpt.get_shaped(ba_name, &[2 * d.gdn_v_heads, h])?;
    let row_bytes = |t: &TensorRef| -> Result<usize, ModelError> {
        t.dtype.size().filter(|_| t.dtype.is_float()).map(|s| s * h).ok_or_else(|| {
            ModelError::weights(format!(
                "tensor `{}` has dtype {:?}; only BF16, F16 and F32 are supported",
                t.name, t.dtype
            ))
        })
    };
    let (qrow, brow) = (row_bytes(&qkvz)?, row_bytes(&ba)?);
    let rows =
        |t: &TensorRef<'a>, rb: usize, first: usize, n: usize| -> &'a [u8] { &t.bytes[first * rb..(first + n) * rb] };
    let group_rows = 2 * dk + 2 * r * dv;
    let (mut q, mut k, mut v, mut z, mut b, mut a) = (vec![], vec![], vec![], vec![], vec![], vec![]);
    for g in 0..groups {
        let base = g * group_rows;
        q.push(rows(&qkvz, qrow, base, dk));
        k.push(rows(&qkvz, qrow, base + dk, dk));
        v.push(rows(&qkvz, qrow, base + 2 * dk, r * dv));
        z.push(rows(&qkvz, qrow, base + 2 * dk + r * dv, r * dv));
        b.push(rows(&ba, brow, g * 2 * r, r));
        a.push(rows(&ba, brow, g * 2 * r + r, r));
    }
    let base = qkvz_name.trim_end_matches("in_proj_qkvz.weight");
    let src = |suffix: &str, parts: Vec<&'a [u8]>, n: usize, dtype| TensorSource {
        name: format!("{base}{suffix} (from packed Qwen3-Next projection)"),
        shape: vec![n, h],
        dtype,
        parts,
        quantized: None,
    };
    let qkv_parts = q.into_iter().chain(k).chain(v).collect();
    Ok((
        src("in_proj_qkv.weight", qkv_parts, d.conv_channels, qkvz.dtype),
        src("in_proj_z.weight", z, d.gdn_value_width, qkvz.dtype),
        src("in_proj_b.weight", b, d.gdn_v_heads, ba.dtype),
        src("in_proj_a.weight", a, d.gdn_v_heads, ba.dtype),
    ))
}
