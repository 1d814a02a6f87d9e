//! The vision tower of a multimodal Qwen3.5/3.6 checkpoint: `vision_config` and the top-level image
//! token ids → [`VisionConfig`], and the `model.visual.*` tensors → [`VisionWeights`] (loaded only when
//! a caller asks, so text-only serving never reads them). Text-only checkpoints (Qwen3-Next, `*_text`)
//! have no tower: [`crate::ModelConfig::vision`] is `None`.

use serde_json::{Map, Value};

use crate::checkpoint::Checkpoint;
use crate::config::{Fields, ModelConfig};
use crate::error::ModelError;
use crate::weights::{HostTensor, TensorSource, direct};

/// The activation of the tower's MLP blocks (`vision_config.hidden_act`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum VisionAct {
    /// `gelu_pytorch_tanh` (Qwen3.5/3.6): the tanh approximation of GELU.
    GeluTanh,
    /// `gelu`: GELU with the exact erf.
    Gelu,
    /// `silu`.
    Silu,
}

/// The vision tower's shape and the prompt tokens that carry images, validated.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct VisionConfig {
    pub depth: usize,
    pub hidden_size: usize,
    pub num_heads: usize,
    pub intermediate_size: usize,
    /// Width of the merger's output: the text model's hidden size.
    pub out_hidden_size: usize,
    pub patch_size: usize,
    pub temporal_patch_size: usize,
    pub spatial_merge_size: usize,
    pub in_channels: usize,
    /// Learned position embeddings, a square grid (`side²`), interpolated to each image's grid.
    pub num_position_embeddings: usize,
    pub hidden_act: VisionAct,
    /// Base of the tower's 2-D rotary positions.
    pub rope_theta: f64,
    pub image_token_id: u32,
    pub video_token_id: u32,
    pub vision_start_token_id: u32,
    pub vision_end_token_id: u32,
}

/// `vision_config` fields read here or known to be bookkeeping; others are logged.
const KNOWN_VISION_FIELDS: &[&str] = &[
    "depth",
    "hidden_size",
    "num_heads",
    "intermediate_size",
    "out_hidden_size",
    "patch_size",
    "temporal_patch_size",
    "spatial_merge_size",
    "in_channels",
    "num_position_embeddings",
    "hidden_act",
    "deepstack_visual_indexes",
    "rope_parameters",
    "initializer_range",
    "model_type",
    "dtype",
    "torch_dtype",
    "transformers_version",
];

impl VisionConfig {
    /// Reads `root.vision_config` and the top-level token ids of a multimodal config; `None` when the
    /// config has no (or a null) `vision_config`.
    pub(crate) fn parse(root: &Map<String, Value>, text: &ModelConfig) -> Result<Option<Self>, ModelError> {
        let obj = match root.get("vision_config") {
            None | Some(Value::Null) => return Ok(None),
            Some(Value::Object(o)) => o,
            Some(other) => return Err(ModelError::config(format!("`vision_config` must be an object, got {other}"))),
        };
        let unknown: Vec<&str> = obj.keys().map(String::as_str).filter(|k| !KNOWN_VISION_FIELDS.contains(k)).collect();
        if !unknown.is_empty() {
            tracing::warn!(fields = ?unknown, "config.json: ignoring vision_config fields deltaserve does not use");
        }
        let f = Fields { obj, prefix: "vision_config." };
        if let Some(v) = obj.get("deepstack_visual_indexes")
            && !matches!(v, Value::Null)
            && v.as_array().is_none_or(|a| !a.is_empty())
        {
            return Err(ModelError::unsupported(format!(
                "`vision_config.deepstack_visual_indexes` = {v}: deepstack vision outputs are not supported \
                 (Qwen3.5/3.6 have none)"
            )));
        }
        let hidden_act = match obj.get("hidden_act").and_then(Value::as_str) {
            None | Some("gelu_pytorch_tanh") => VisionAct::GeluTanh,
            Some("gelu") => VisionAct::Gelu,
            Some("silu") => VisionAct::Silu,
            Some(other) => {
                return Err(ModelError::unsupported(format!(
                    "`vision_config.hidden_act` = \"{other}\": only gelu_pytorch_tanh, gelu and silu are supported"
                )));
            }
        };
        let rope = obj.get("rope_parameters").filter(|v| !v.is_null());
        if let Some(kind) = rope.and_then(|r| r.get("rope_type")).and_then(Value::as_str)
            && kind != "axial"
        {
            return Err(ModelError::unsupported(format!(
                "`vision_config.rope_parameters.rope_type` = \"{kind}\": only \"axial\" is supported"
            )));
        }
        let rope_theta = match rope.and_then(|r| r.get("rope_theta")) {
            None => 10_000.0,
            Some(v) => v.as_f64().ok_or_else(|| {
                ModelError::config(format!("`vision_config.rope_parameters.rope_theta` must be a number, got {v}"))
            })?,
        };
        let top = Fields { obj: root, prefix: "" };
        // Missing ids take HF's defaults (the Qwen3.5/3.6 tokenizer's).
        let token = |name: &str, default: usize| -> Result<u32, ModelError> {
            let id = top.opt_usize(name)?.unwrap_or(default);
            u32::try_from(id).map_err(|_| ModelError::config(format!("`{name}` {id} is not a token id")))
        };
        let cfg = Self {
            depth: f.usize("depth")?,
            hidden_size: f.usize("hidden_size")?,
            num_heads: f.usize("num_heads")?,
            intermediate_size: f.usize("intermediate_size")?,
            out_hidden_size: f.usize("out_hidden_size")?,
            patch_size: f.usize("patch_size")?,
            temporal_patch_size: f.usize("temporal_patch_size")?,
            spatial_merge_size: f.usize("spatial_merge_size")?,
            in_channels: f.opt_usize("in_channels")?.unwrap_or(3),
            num_position_embeddings: f.usize("num_position_embeddings")?,
            hidden_act,
            rope_theta,
            image_token_id: token("image_token_id", 248_056)?,
            video_token_id: token("video_token_id", 248_057)?,
            vision_start_token_id: token("vision_start_token_id", 248_053)?,
            vision_end_token_id: token("vision_end_token_id", 248_054)?,
        };
        cfg.validate()?;
        // Text-only exports often keep a stale `vision_config` (and no `model.visual.*`): such a checkpoint
        // serves text, without a tower.
        if let Err(reason) = cfg.fits(text) {
            tracing::warn!("config.json: the vision tower is ignored (images are refused): {reason}");
            return Ok(None);
        }
        Ok(Some(cfg))
    }

    /// Whether the tower can feed this text model: its output width and its token ids.
    fn fits(&self, text: &ModelConfig) -> Result<(), String> {
        if self.out_hidden_size != text.hidden_size {
            return Err(format!(
                "`vision_config.out_hidden_size` ({}) differs from the text model's hidden_size ({})",
                self.out_hidden_size, text.hidden_size
            ));
        }
        let ids = [
            ("image_token_id", self.image_token_id),
            ("video_token_id", self.video_token_id),
            ("vision_start_token_id", self.vision_start_token_id),
            ("vision_end_token_id", self.vision_end_token_id),
        ];
        match ids.iter().find(|(_, id)| *id as usize >= text.vocab_size) {
            Some((name, id)) => Err(format!("`{name}` {id} is outside the vocabulary ({})", text.vocab_size)),
            None => Ok(()),
        }
    }

    fn validate(&self) -> Result<(), ModelError> {
        let positive = [
            ("depth", self.depth),
            ("hidden_size", self.hidden_size),
            ("num_heads", self.num_heads),
            ("intermediate_size", self.intermediate_size),
            ("out_hidden_size", self.out_hidden_size),
            ("patch_size", self.patch_size),
            ("temporal_patch_size", self.temporal_patch_size),
            ("spatial_merge_size", self.spatial_merge_size),
            ("in_channels", self.in_channels),
            ("num_position_embeddings", self.num_position_embeddings),
        ];
        for (name, v) in positive {
            if v == 0 || v > 1 << 20 {
                return Err(ModelError::config(format!("`vision_config.{name}` = {v} is out of range")));
            }
        }
        if !self.hidden_size.is_multiple_of(self.num_heads) || !self.head_dim().is_multiple_of(4) {
            return Err(ModelError::config(format!(
                "`vision_config.hidden_size` ({}) over `num_heads` ({}) must give a head dim that is a multiple of 4",
                self.hidden_size, self.num_heads
            )));
        }
        let side = self.position_grid_side();
        if side * side != self.num_position_embeddings {
            return Err(ModelError::config(format!(
                "`vision_config.num_position_embeddings` ({}) must be a square",
                self.num_position_embeddings
            )));
        }
        Ok(())
    }

    /// Dims of one attention head of the tower.
    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_heads
    }

    /// Values in one patch row of [`crate::ImagePatches::pixels`]: `channels · temporal · patch²`.
    pub fn patch_dim(&self) -> usize {
        self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size
    }

    /// Patches folded into one prompt token (`merge²`).
    pub fn merge_unit(&self) -> usize {
        self.spatial_merge_size * self.spatial_merge_size
    }

    /// Side of the learned position-embedding grid.
    pub fn position_grid_side(&self) -> usize {
        (self.num_position_embeddings as f64).sqrt().round() as usize
    }

    /// Why `img` does not fit the tower, if it does not: a grid that does not fold into merge windows, or a
    /// pixel buffer that is not `patches × patch_dim` values.
    pub fn check_image(&self, img: &crate::ImagePatches) -> Result<(), String> {
        let [t, h, w] = img.grid_thw;
        let m = self.spatial_merge_size;
        if t == 0 || h == 0 || w == 0 || !h.is_multiple_of(m) || !w.is_multiple_of(m) {
            return Err(format!("grid {t}×{h}×{w} must be non-empty and fold into {m}×{m} windows"));
        }
        if img.pixels.len() != img.patches() * self.patch_dim() {
            return Err(format!(
                "{} pixel values for {} patches of {} values",
                img.pixels.len(),
                img.patches(),
                self.patch_dim()
            ));
        }
        Ok(())
    }
}

/// A linear layer of the tower: weight `[out, in]` and bias `[out]`.
pub struct VisionLinear<T> {
    pub weight: T,
    pub bias: Option<T>,
}

/// A LayerNorm: weight and bias `[dim]`.
pub struct LayerNormWeights<T> {
    pub weight: T,
    pub bias: T,
}

/// One transformer block of the tower.
pub struct VisionBlockWeights<T> {
    pub norm1: LayerNormWeights<T>,
    /// `[3 · hidden, hidden]`: rows `[q | k | v]`, each `heads × head_dim`.
    pub qkv: VisionLinear<T>,
    /// `[hidden, hidden]`
    pub proj: VisionLinear<T>,
    pub norm2: LayerNormWeights<T>,
    /// `[intermediate, hidden]`
    pub fc1: VisionLinear<T>,
    /// `[hidden, intermediate]`
    pub fc2: VisionLinear<T>,
}

/// The weights of the vision tower (`model.visual.*`).
pub struct VisionWeights<T> {
    /// `[hidden, channels · temporal · patch²]`: the Conv3d whose kernel equals its stride, as a linear.
    pub patch_embed: VisionLinear<T>,
    /// `[num_position_embeddings, hidden]`
    pub pos_embed: T,
    pub blocks: Vec<VisionBlockWeights<T>>,
    /// The merger's LayerNorm (`[hidden]`, per patch, before the `merge²` patches are concatenated).
    pub merger_norm: LayerNormWeights<T>,
    /// `[hidden · merge², hidden · merge²]`
    pub merger_fc1: VisionLinear<T>,
    /// `[out_hidden, hidden · merge²]`
    pub merger_fc2: VisionLinear<T>,
}

const PREFIX: &str = "model.visual.";

impl VisionWeights<HostTensor> {
    /// The tower as f32 host tensors; `None` for a config without one.
    pub fn load_f32(ckpt: &Checkpoint, cfg: &ModelConfig) -> Result<Option<Self>, ModelError> {
        Self::load(ckpt, cfg, |src| HostTensor::from_source(&src))
    }
}

impl<T> VisionWeights<T> {
    /// Maps, checks and converts every `model.visual.*` tensor with `convert`; `None` when the config
    /// has no tower. A missing tensor or a wrong shape is an error naming the tensor.
    pub fn load(
        ckpt: &Checkpoint,
        cfg: &ModelConfig,
        convert: impl FnMut(TensorSource<'_>) -> Result<T, ModelError>,
    ) -> Result<Option<Self>, ModelError> {
        let Some(v) = &cfg.vision else { return Ok(None) };
        let mut l = Loader { ckpt, convert };
        let (h, merged) = (v.hidden_size, v.hidden_size * v.merge_unit());
        let mut patch = direct(ckpt, &format!("{PREFIX}patch_embed.proj.weight"), &patch_shape(v))?;
        patch.shape = vec![h, v.patch_dim()];
        let bias_name = format!("{PREFIX}patch_embed.proj.bias");
        let patch_embed = VisionLinear {
            weight: (l.convert)(patch)?,
            bias: if ckpt.contains(&bias_name) { Some((l.convert)(direct(ckpt, &bias_name, &[h])?)?) } else { None },
        };
        let pos_embed = l.tensor("pos_embed.weight", &[v.num_position_embeddings, h])?;
        let mut blocks = Vec::with_capacity(v.depth);
        for i in 0..v.depth {
            let b = |s: &str| format!("blocks.{i}.{s}");
            blocks.push(VisionBlockWeights {
                norm1: l.layer_norm(&b("norm1"), h)?,
                qkv: l.linear(&b("attn.qkv"), 3 * h, h)?,
                proj: l.linear(&b("attn.proj"), h, h)?,
                norm2: l.layer_norm(&b("norm2"), h)?,
                fc1: l.linear(&b("mlp.linear_fc1"), v.intermediate_size, h)?,
                fc2: l.linear(&b("mlp.linear_fc2"), h, v.intermediate_size)?,
            });
        }
        Ok(Some(Self {
            patch_embed,
            pos_embed,
            blocks,
            merger_norm: l.layer_norm("merger.norm", h)?,
            merger_fc1: l.linear("merger.linear_fc1", merged, merged)?,
            merger_fc2: l.linear("merger.linear_fc2", v.out_hidden_size, merged)?,
        }))
    }
}

/// The stored shape of the patch embedding's Conv3d weight.
fn patch_shape(v: &VisionConfig) -> [usize; 5] {
    [v.hidden_size, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size]
}

/// Reads `model.visual.*` tensors by their name under the prefix, shape-checked.
struct Loader<'a, F> {
    ckpt: &'a Checkpoint,
    convert: F,
}

impl<'a, T, F: FnMut(TensorSource<'a>) -> Result<T, ModelError>> Loader<'a, F> {
    fn tensor(&mut self, name: &str, shape: &[usize]) -> Result<T, ModelError> {
        (self.convert)(direct(self.ckpt, &format!("{PREFIX}{name}"), shape)?)
    }
    fn linear(&mut self, name: &str, out: usize, inp: usize) -> Result<VisionLinear<T>, ModelError> {
        Ok(VisionLinear {
            weight: self.tensor(&format!("{name}.weight"), &[out, inp])?,
            bias: Some(self.tensor(&format!("{name}.bias"), &[out])?),
        })
    }
    fn layer_norm(&mut self, name: &str, dim: usize) -> Result<LayerNormWeights<T>, ModelError> {
        Ok(LayerNormWeights {
            weight: self.tensor(&format!("{name}.weight"), &[dim])?,
            bias: self.tensor(&format!("{name}.bias"), &[dim])?,
        })
    }
}

/// Every stored tensor name of the tower with its shape, in load order (what the plan prices and
/// `synth` writes).
pub fn tensor_shapes(v: &VisionConfig) -> Vec<(String, Vec<usize>)> {
    let (h, merged) = (v.hidden_size, v.hidden_size * v.merge_unit());
    let mut out = vec![
        (format!("{PREFIX}patch_embed.proj.weight"), patch_shape(v).to_vec()),
        (format!("{PREFIX}patch_embed.proj.bias"), vec![h]),
        (format!("{PREFIX}pos_embed.weight"), vec![v.num_position_embeddings, h]),
    ];
    // (name, out, in): a linear with bias; in == 0 marks a LayerNorm (weight and bias [out]).
    let mut layers: Vec<(String, usize, usize)> = Vec::new();
    for i in 0..v.depth {
        let b = format!("{PREFIX}blocks.{i}.");
        layers.extend([
            (format!("{b}norm1"), h, 0),
            (format!("{b}attn.qkv"), 3 * h, h),
            (format!("{b}attn.proj"), h, h),
            (format!("{b}norm2"), h, 0),
            (format!("{b}mlp.linear_fc1"), v.intermediate_size, h),
            (format!("{b}mlp.linear_fc2"), h, v.intermediate_size),
        ]);
    }
    layers.extend([
        (format!("{PREFIX}merger.norm"), h, 0),
        (format!("{PREFIX}merger.linear_fc1"), merged, merged),
        (format!("{PREFIX}merger.linear_fc2"), v.out_hidden_size, merged),
    ]);
    for (name, o, i) in layers {
        let weight = if i == 0 { vec![o] } else { vec![o, i] };
        out.push((format!("{name}.weight"), weight));
        out.push((format!("{name}.bias"), vec![o]));
    }
    out
}
