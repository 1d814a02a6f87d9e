//! `config.json` → [`ModelConfig`]: the validated text-model shape of a Qwen3.5/3.6 (`qwen3_5`,
//! `qwen3_5_text`, and the mixture-of-experts `qwen3_5_moe`, `qwen3_5_moe_text`) or Qwen3-Next
//! (`qwen3_next`, dense or with experts) checkpoint, plus [`Dims`], the derived sizes. The experts'
//! fields are read by [`crate::moe`].
//!
//! Parsing is explicit: every field we use is read by name, and a missing, mistyped or inconsistent
//! field is an error that names it. Fields that would change the math in ways we do not implement
//! (other routing schemes, YaRN, sliding windows, biases, unsupported quantisation methods) are refused by name;
//! other unknown fields are reported once through `tracing` and ignored, as vLLM and llama.cpp do.
//! A supported `quantization_config` (GPTQ / AutoRound int4, block FP8) is parsed into
//! [`ModelConfig::quantization`] (see [`crate::quant`]).

use std::path::Path;

use serde_json::{Map, Value};

use crate::error::ModelError;
use crate::moe::MoeConfig;
use crate::quant::Quantization;
use crate::vision::VisionConfig;

/// Which checkpoint family the config came from (changes only the DeltaNet projection packing).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum Arch {
    /// `qwen3_5` / `qwen3_5_text`: separate `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`.
    Qwen35,
    /// `qwen3_next`: packed `in_proj_qkvz` and `in_proj_ba`, grouped per key head.
    Qwen3Next,
}

/// The mixer of one decoder layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum LayerKind {
    /// Gated DeltaNet (`"linear_attention"`).
    DeltaNet,
    /// Gated softmax attention (`"full_attention"`).
    Attention,
}

/// The text model's shape and constants, validated.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct ModelConfig {
    pub arch: Arch,
    pub hidden_size: usize,
    /// Width of the dense MLP layers. A model whose every layer is sparse has none; its config may leave
    /// the field out (`qwen3_5_moe` does), and it is then the shared expert's width.
    pub intermediate_size: usize,
    pub vocab_size: usize,
    pub rms_norm_eps: f32,
    pub tie_word_embeddings: bool,
    /// One entry per decoder layer.
    pub layer_types: Vec<LayerKind>,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    /// Rotated leading dims of each attention head (`head_dim * partial_rotary_factor`), even.
    pub rotary_dim: usize,
    pub rope_theta: f64,
    /// How the rotary frequencies split between the (t, h, w) M-RoPE streams, interleaved
    /// (`rope_parameters.mrope_section`; HF's default [11, 11, 10] when absent). Text positions are equal
    /// in all streams, so it matters only for images.
    pub mrope_section: [usize; 3],
    pub linear_num_key_heads: usize,
    pub linear_num_value_heads: usize,
    pub linear_key_head_dim: usize,
    pub linear_value_head_dim: usize,
    pub linear_conv_kernel_dim: usize,
    pub max_position_embeddings: usize,
    /// Token ids that end generation (config + generation_config.json).
    pub eos_token_ids: Vec<u32>,
    pub mtp_num_hidden_layers: usize,
    /// The checkpoint's `quantization_config` (top level, or under `text_config`), if any.
    pub quantization: Option<Quantization>,
    /// The experts of a mixture-of-experts model; `None` when every layer's MLP is dense.
    pub moe: Option<MoeConfig>,
    /// The vision tower and image token ids of a multimodal checkpoint; `None` for text-only ones.
    pub vision: Option<VisionConfig>,
}

/// Sizes derived once from a [`ModelConfig`]; nothing else recomputes them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Dims {
    pub hidden: usize,
    pub intermediate: usize,
    pub vocab: usize,
    pub num_layers: usize,
    pub num_deltanet_layers: usize,
    pub num_attention_layers: usize,
    /// Attention: query heads, kv heads, head dim, query heads per kv head.
    pub q_heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub q_per_kv: usize,
    pub rotary_dim: usize,
    /// `q_heads * head_dim` (the attention output width before `o_proj`).
    pub attn_dim: usize,
    /// `kv_heads * head_dim`.
    pub kv_dim: usize,
    /// DeltaNet: key heads, value heads, dims, value heads per key head.
    pub gdn_k_heads: usize,
    pub gdn_v_heads: usize,
    pub gdn_k_dim: usize,
    pub gdn_v_dim: usize,
    pub gdn_ratio: usize,
    /// `gdn_k_heads * gdn_k_dim`.
    pub gdn_key_width: usize,
    /// `gdn_v_heads * gdn_v_dim`.
    pub gdn_value_width: usize,
    /// Conv channels `2 * key_width + value_width` ([q | k | v]).
    pub conv_channels: usize,
    pub conv_kernel: usize,
}

impl ModelConfig {
    /// Reads `config.json` (and `generation_config.json` for stop tokens, when present) from a model directory.
    pub fn from_dir(dir: &Path) -> Result<Self, ModelError> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|e| ModelError::io(&path, e))?;
        let mut cfg = Self::from_json_str(&text).map_err(|e| e.in_file(&path))?;
        let gen_path = dir.join("generation_config.json");
        if gen_path.exists() {
            let text = std::fs::read_to_string(&gen_path).map_err(|e| ModelError::io(&gen_path, e))?;
            let v: Value = serde_json::from_str(&text)
                .map_err(|e| ModelError::config(format!("{}: invalid JSON: {e}", gen_path.display())))?;
            if let Some(ids) = v.get("eos_token_id") {
                for id in token_ids(ids, "generation_config.json eos_token_id")? {
                    if !cfg.eos_token_ids.contains(&id) {
                        cfg.eos_token_ids.push(id);
                    }
                }
            }
        }
        Ok(cfg)
    }

    /// Parses the text of a `config.json`.
    pub fn from_json_str(text: &str) -> Result<Self, ModelError> {
        let root: Value = serde_json::from_str(text).map_err(|e| ModelError::config(format!("invalid JSON: {e}")))?;
        let root = root.as_object().ok_or_else(|| ModelError::config("config.json must be a JSON object"))?;
        let model_type = root
            .get("model_type")
            .and_then(Value::as_str)
            .ok_or_else(|| ModelError::config("missing field `model_type` (string)"))?;
        match model_type {
            "qwen3_5" | "qwen3_5_moe" => {
                let text_cfg = root.get("text_config").and_then(Value::as_object).ok_or_else(|| {
                    ModelError::config(format!("`{model_type}` config needs an object field `text_config`"))
                })?;
                let tie_top = root.get("tie_word_embeddings").and_then(Value::as_bool);
                let mut cfg = parse_text(text_cfg, Arch::Qwen35, model_type == "qwen3_5_moe", "text_config.")?;
                cfg.vision = VisionConfig::parse(root, &cfg)?;
                // HF writes `quantization_config` at the top level of a multimodal config.
                if let Some(q) = root.get("quantization_config").filter(|q| !q.is_null()) {
                    cfg.quantization = Some(Quantization::from_json(q, "quantization_config")?);
                }
                // The top-level flag is what HF's ForConditionalGeneration uses for the lm_head.
                if let Some(t) = tie_top {
                    cfg.tie_word_embeddings = t;
                }
                if cfg.eos_token_ids.is_empty()
                    && let Some(v) = root.get("eos_token_id")
                {
                    cfg.eos_token_ids = token_ids(v, "eos_token_id")?;
                }
                Ok(cfg)
            }
            "qwen3_5_text" => parse_text(root, Arch::Qwen35, false, ""),
            "qwen3_5_moe_text" => parse_text(root, Arch::Qwen35, true, ""),
            "qwen3_next" => parse_text(root, Arch::Qwen3Next, false, ""),
            "qwen3_moe" => Err(ModelError::unsupported(
                "model_type `qwen3_moe`: only the hybrid DeltaNet + attention models are supported \
                 (qwen3_5, qwen3_5_moe, qwen3_next)",
            )),
            other => Err(ModelError::config(format!(
                "unknown model_type `{other}` (supported: qwen3_5, qwen3_5_text, qwen3_5_moe, qwen3_5_moe_text, qwen3_next)"
            ))),
        }
    }

    /// The derived sizes.
    pub fn dims(&self) -> Dims {
        let num_attention_layers = self.layer_types.iter().filter(|k| **k == LayerKind::Attention).count();
        Dims {
            hidden: self.hidden_size,
            intermediate: self.intermediate_size,
            vocab: self.vocab_size,
            num_layers: self.layer_types.len(),
            num_deltanet_layers: self.layer_types.len() - num_attention_layers,
            num_attention_layers,
            q_heads: self.num_attention_heads,
            kv_heads: self.num_key_value_heads,
            head_dim: self.head_dim,
            q_per_kv: self.num_attention_heads / self.num_key_value_heads,
            rotary_dim: self.rotary_dim,
            attn_dim: self.num_attention_heads * self.head_dim,
            kv_dim: self.num_key_value_heads * self.head_dim,
            gdn_k_heads: self.linear_num_key_heads,
            gdn_v_heads: self.linear_num_value_heads,
            gdn_k_dim: self.linear_key_head_dim,
            gdn_v_dim: self.linear_value_head_dim,
            gdn_ratio: self.linear_num_value_heads / self.linear_num_key_heads,
            gdn_key_width: self.linear_num_key_heads * self.linear_key_head_dim,
            gdn_value_width: self.linear_num_value_heads * self.linear_value_head_dim,
            conv_channels: 2 * self.linear_num_key_heads * self.linear_key_head_dim
                + self.linear_num_value_heads * self.linear_value_head_dim,
            conv_kernel: self.linear_conv_kernel_dim,
        }
    }
}

/// Fields read by [`parse_text`] or known to be harmless bookkeeping; anything else is logged.
const KNOWN_FIELDS: &[&str] = &[
    "model_type",
    "architectures",
    "hidden_size",
    "intermediate_size",
    "vocab_size",
    "rms_norm_eps",
    "tie_word_embeddings",
    "layer_types",
    "full_attention_interval",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "partial_rotary_factor",
    "rope_theta",
    "rope_parameters",
    "rope_scaling",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
    "max_position_embeddings",
    "eos_token_id",
    "bos_token_id",
    "pad_token_id",
    "mtp_num_hidden_layers",
    "mtp_use_dedicated_embeddings",
    "hidden_act",
    "attention_bias",
    "attention_dropout",
    "attn_output_gate",
    "output_gate_type",
    "num_experts",
    "num_experts_per_tok",
    "mlp_only_layers",
    "decoder_sparse_step",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "norm_topk_prob",
    "output_router_logits",
    "router_aux_loss_coef",
    "sliding_window",
    "use_sliding_window",
    "quantization_config",
    "torch_dtype",
    "dtype",
    "transformers_version",
    "use_cache",
    "initializer_range",
    "mamba_ssm_dtype",
    "_name_or_path",
    "return_dict",
    "output_hidden_states",
    "output_attentions",
    "chunk_size_feed_forward",
    "is_encoder_decoder",
    "id2label",
    "label2id",
    "problem_type",
    "tokenizer_class",
    "layer_norm_epsilon",
    "vision_config",
    "text_config",
    "image_token_id",
    "video_token_id",
    "vision_start_token_id",
    "vision_end_token_id",
    "max_window_layers",
    "use_qk_norm",
];

/// Parses a text config; `moe_model` is true for the `qwen3_5_moe` model types.
fn parse_text(obj: &Map<String, Value>, arch: Arch, moe_model: bool, prefix: &str) -> Result<ModelConfig, ModelError> {
    let f = Fields { obj, prefix };
    let unknown: Vec<&str> = obj.keys().map(String::as_str).filter(|k| !KNOWN_FIELDS.contains(k)).collect();
    if !unknown.is_empty() {
        tracing::warn!(fields = ?unknown, "config.json: ignoring fields deltaserve does not use");
    }

    let quantization = match obj.get("quantization_config") {
        Some(q) if !q.is_null() => Some(Quantization::from_json(q, &format!("{prefix}quantization_config"))?),
        _ => None,
    };
    // Features that would change the math and are not implemented: refuse by name.
    if f.opt_bool("attention_bias")?.unwrap_or(false) {
        return Err(ModelError::unsupported(format!("`{prefix}attention_bias` = true is not supported")));
    }
    if f.opt_bool("use_sliding_window")?.unwrap_or(false) {
        return Err(ModelError::unsupported(format!("`{prefix}use_sliding_window` = true is not supported")));
    }
    if let Some(act) = obj.get("hidden_act")
        && act.as_str() != Some("silu")
    {
        return Err(ModelError::unsupported(format!("`{prefix}hidden_act` = {act}: only \"silu\" is supported")));
    }
    if matches!(obj.get("attn_output_gate"), Some(Value::Bool(false))) {
        return Err(ModelError::unsupported(format!(
            "`{prefix}attn_output_gate` = false is not supported (Qwen3.5 attention is always gated)"
        )));
    }

    let num_layers = f.usize("num_hidden_layers")?;
    if num_layers > MAX_LAYERS {
        return Err(ModelError::config(format!(
            "`{prefix}num_hidden_layers` = {num_layers} is implausible (max {MAX_LAYERS})"
        )));
    }
    let layer_types = match obj.get("layer_types") {
        Some(Value::Array(items)) => {
            if items.len() != num_layers {
                return Err(ModelError::config(format!(
                    "`{prefix}layer_types` has {} entries but `{prefix}num_hidden_layers` is {num_layers}",
                    items.len()
                )));
            }
            items
                .iter()
                .enumerate()
                .map(|(i, v)| match v.as_str() {
                    Some("linear_attention") => Ok(LayerKind::DeltaNet),
                    Some("full_attention") => Ok(LayerKind::Attention),
                    _ => Err(ModelError::config(format!(
                        "`{prefix}layer_types[{i}]` = {v}: expected \"linear_attention\" or \"full_attention\""
                    ))),
                })
                .collect::<Result<Vec<_>, _>>()?
        }
        Some(other) => {
            return Err(ModelError::config(format!("`{prefix}layer_types` must be an array, got {other}")));
        }
        None => {
            let interval = f.usize("full_attention_interval")?;
            if interval == 0 {
                return Err(ModelError::config(format!("`{prefix}full_attention_interval` must be > 0")));
            }
            (0..num_layers)
                .map(|i| if (i + 1) % interval == 0 { LayerKind::Attention } else { LayerKind::DeltaNet })
                .collect()
        }
    };

    let moe = MoeConfig::parse(obj, arch, moe_model, prefix, num_layers)?;
    let intermediate_size = match (f.opt_usize("intermediate_size")?, &moe) {
        (Some(i), _) => i,
        (None, Some(m)) if m.sparse_layers.iter().all(|s| *s) => m.shared_expert_intermediate,
        (None, _) => return Err(f.missing("intermediate_size")),
    };

    let hidden_size = f.usize("hidden_size")?;
    let num_attention_heads = f.usize("num_attention_heads")?;
    let num_key_value_heads = f.usize("num_key_value_heads")?;
    let head_dim = match f.opt_usize("head_dim")? {
        Some(h) => h,
        None => hidden_size / num_attention_heads.max(1),
    };
    let rope = obj.get("rope_parameters").or_else(|| obj.get("rope_scaling")).filter(|v| !v.is_null());
    if let Some(r) = rope {
        let kind = r.get("rope_type").or_else(|| r.get("type")).and_then(Value::as_str).unwrap_or("default");
        if kind != "default" {
            return Err(ModelError::unsupported(format!(
                "`{prefix}rope_parameters.rope_type` = \"{kind}\": only \"default\" RoPE is supported yet"
            )));
        }
    }
    let rope_field = |name: &str| rope.and_then(|r| r.get(name)).or_else(|| obj.get(name));
    let partial = match rope_field("partial_rotary_factor") {
        None => 1.0,
        Some(v) => v
            .as_f64()
            .ok_or_else(|| ModelError::config(format!("`{prefix}partial_rotary_factor` must be a number, got {v}")))?,
    };
    let rope_theta = match rope_field("rope_theta") {
        None => {
            return Err(ModelError::config(format!("missing field `{prefix}rope_parameters.rope_theta`")));
        }
        Some(v) => {
            v.as_f64().ok_or_else(|| ModelError::config(format!("`{prefix}rope_theta` must be a number, got {v}")))?
        }
    };
    let rotary_dim = (head_dim as f64 * partial) as usize; // truncated, as HF does
    let mrope_section = match rope.and_then(|r| r.get("mrope_section")) {
        None | Some(Value::Null) => [11, 11, 10],
        Some(v) => mrope_section(v, prefix)?,
    };

    let cfg = ModelConfig {
        arch,
        hidden_size,
        intermediate_size,
        vocab_size: f.usize("vocab_size")?,
        rms_norm_eps: f.f64("rms_norm_eps")? as f32,
        tie_word_embeddings: f.opt_bool("tie_word_embeddings")?.unwrap_or(false),
        layer_types,
        num_attention_heads,
        num_key_value_heads,
        head_dim,
        rotary_dim,
        rope_theta,
        mrope_section,
        linear_num_key_heads: f.usize("linear_num_key_heads")?,
        linear_num_value_heads: f.usize("linear_num_value_heads")?,
        linear_key_head_dim: f.usize("linear_key_head_dim")?,
        linear_value_head_dim: f.usize("linear_value_head_dim")?,
        linear_conv_kernel_dim: f.usize("linear_conv_kernel_dim")?,
        max_position_embeddings: f.opt_usize("max_position_embeddings")?.unwrap_or(262_144),
        eos_token_ids: match obj.get("eos_token_id") {
            Some(v) => token_ids(v, &format!("{prefix}eos_token_id"))?,
            None => Vec::new(),
        },
        mtp_num_hidden_layers: f.opt_usize("mtp_num_hidden_layers")?.unwrap_or(0),
        quantization,
        moe,
        vision: None,
    };
    validate(&cfg, prefix)?;
    Ok(cfg)
}

/// Sanity bounds: configs beyond these are corrupt, and would overflow size arithmetic.
const MAX_LAYERS: usize = 4096;
const MAX_DIM: usize = 1 << 24;

fn validate(c: &ModelConfig, p: &str) -> Result<(), ModelError> {
    let positive = [
        ("hidden_size", c.hidden_size),
        ("intermediate_size", c.intermediate_size),
        ("vocab_size", c.vocab_size),
        ("num_hidden_layers", c.layer_types.len()),
        ("num_attention_heads", c.num_attention_heads),
        ("num_key_value_heads", c.num_key_value_heads),
        ("head_dim", c.head_dim),
        ("linear_num_key_heads", c.linear_num_key_heads),
        ("linear_num_value_heads", c.linear_num_value_heads),
        ("linear_key_head_dim", c.linear_key_head_dim),
        ("linear_value_head_dim", c.linear_value_head_dim),
        ("linear_conv_kernel_dim", c.linear_conv_kernel_dim),
    ];
    for (name, v) in positive {
        if v == 0 {
            return Err(ModelError::config(format!("`{p}{name}` must be > 0")));
        }
        if v > MAX_DIM {
            return Err(ModelError::config(format!("`{p}{name}` = {v} is implausible (max {MAX_DIM})")));
        }
    }
    if !c.num_attention_heads.is_multiple_of(c.num_key_value_heads) {
        return Err(ModelError::config(format!(
            "`{p}num_attention_heads` ({}) must be a multiple of `{p}num_key_value_heads` ({})",
            c.num_attention_heads, c.num_key_value_heads
        )));
    }
    if !c.linear_num_value_heads.is_multiple_of(c.linear_num_key_heads) {
        return Err(ModelError::config(format!(
            "`{p}linear_num_value_heads` ({}) must be a multiple of `{p}linear_num_key_heads` ({})",
            c.linear_num_value_heads, c.linear_num_key_heads
        )));
    }
    if c.rotary_dim == 0 || !c.rotary_dim.is_multiple_of(2) || c.rotary_dim > c.head_dim {
        return Err(ModelError::config(format!(
            "`{p}partial_rotary_factor` gives a rotary dim of {} for head_dim {}: it must be even, > 0 and <= head_dim",
            c.rotary_dim, c.head_dim
        )));
    }
    if !(c.rms_norm_eps > 0.0 && c.rms_norm_eps < 1.0) {
        return Err(ModelError::config(format!("`{p}rms_norm_eps` = {} is out of range", c.rms_norm_eps)));
    }
    if !(c.rope_theta > 0.0 && c.rope_theta.is_finite()) {
        return Err(ModelError::config(format!("`{p}rope_theta` = {} must be positive", c.rope_theta)));
    }
    if let Some(id) = c.eos_token_ids.iter().find(|&&id| id as usize >= c.vocab_size) {
        return Err(ModelError::config(format!("`{p}eos_token_id` {id} is outside the vocabulary ({})", c.vocab_size)));
    }
    Ok(())
}

/// `rope_parameters.mrope_section`: three counts of rotary frequency pairs (HF slices, never checks, them).
fn mrope_section(v: &Value, prefix: &str) -> Result<[usize; 3], ModelError> {
    let parsed: Option<Vec<usize>> =
        v.as_array().and_then(|a| a.iter().map(|x| x.as_u64().map(|n| n as usize)).collect());
    match parsed.as_deref() {
        Some(&[t, h, w]) => Ok([t, h, w]),
        _ => Err(ModelError::config(format!(
            "`{prefix}rope_parameters.mrope_section` must be three non-negative integers, got {v}"
        ))),
    }
}

fn token_ids(v: &Value, field: &str) -> Result<Vec<u32>, ModelError> {
    let one = |x: &Value| {
        x.as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .ok_or_else(|| ModelError::config(format!("`{field}` must hold token ids, got {x}")))
    };
    match v {
        Value::Null => Ok(Vec::new()),
        Value::Array(a) => a.iter().map(one).collect(),
        x => Ok(vec![one(x)?]),
    }
}

/// Typed access to one JSON object's fields, with errors that name the field.
pub(crate) struct Fields<'a> {
    pub(crate) obj: &'a Map<String, Value>,
    pub(crate) prefix: &'a str,
}

impl Fields<'_> {
    pub(crate) fn missing(&self, name: &str) -> ModelError {
        ModelError::config(format!("missing field `{}{name}`", self.prefix))
    }
    pub(crate) fn wrong(&self, name: &str, want: &str, got: &Value) -> ModelError {
        ModelError::config(format!("`{}{name}` must be {want}, got {got}", self.prefix))
    }
    pub(crate) fn opt_usize(&self, name: &str) -> Result<Option<usize>, ModelError> {
        match self.obj.get(name) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => {
                v.as_u64().map(|x| Some(x as usize)).ok_or_else(|| self.wrong(name, "a non-negative integer", v))
            }
        }
    }
    pub(crate) fn usize(&self, name: &str) -> Result<usize, ModelError> {
        self.opt_usize(name)?.ok_or_else(|| self.missing(name))
    }
    pub(crate) fn f64(&self, name: &str) -> Result<f64, ModelError> {
        match self.obj.get(name) {
            None | Some(Value::Null) => Err(self.missing(name)),
            Some(v) => v.as_f64().ok_or_else(|| self.wrong(name, "a number", v)),
        }
    }
    pub(crate) fn opt_bool(&self, name: &str) -> Result<Option<bool>, ModelError> {
        match self.obj.get(name) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v.as_bool().map(Some).ok_or_else(|| self.wrong(name, "true or false", v)),
        }
    }
}
