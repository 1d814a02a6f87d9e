//! Synthetic (random-weight) model directories at any shape: `config.json` in the real multimodal
//! `qwen3_5` / `qwen3_5_moe` layout (text-only `qwen3_next` for the Qwen3-Next preset),
//! `generation_config.json`, and `model.safetensors` in bf16 with the real tensor names (one tensor per
//! expert for mixture-of-experts presets, their MTP head's included), the vision tower's included
//! (with the image processor's `preprocessor_config.json`) for the multimodal presets.
//! Weights are drawn deterministically from (seed, tensor name), so a preset + seed always gives the
//! same bytes. Tokenizer files are written by the caller (the text crate owns tokenizers).

pub mod fp8;
pub mod gptq;

use std::path::Path;

use rand::rngs::Xoshiro256PlusPlus;
use rand::{RngExt, SeedableRng};
use serde_json::{Value, json};

use crate::checkpoint::{DType, TensorHeader, write_safetensors};
use crate::config::{Arch, LayerKind, ModelConfig};
use crate::error::ModelError;
use crate::moe::MoeConfig;
use crate::vision::VisionConfig;

/// Built-in model shapes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Preset {
    /// A few MB, GVA ratio 3 and GQA like the 27B; for tests and the demo model.
    Tiny,
    /// The tiny shapes with a mixture of experts in every layer (8 experts, top 2, a gated shared expert).
    TinyMoe,
    /// The real Qwen3.6-27B text shapes (64 layers; cut with `layers`).
    Qwen36_27b,
    /// The real Qwen3.6-35B-A3B text shapes (40 layers, 256 experts top 8 of width 512, a shared expert).
    Qwen36_35bA3b,
    /// The real Qwen3-Next-80B-A3B text shapes (48 layers, 512 experts top 10 of width 512, a shared expert).
    Qwen3Next80bA3b,
}

/// The text shape of a preset.
struct Shape {
    hidden: usize,
    layers: usize,
    heads: usize,
    kv: usize,
    head_dim: usize,
    gdn_k: usize,
    gdn_v: usize,
    dk: usize,
    dv: usize,
    /// Dense MLP width (`None`: every layer sparse, the field left out as `qwen3_5_moe` does).
    inter: Option<usize>,
    vocab: usize,
    mtp: usize,
    /// (experts, top-k, expert width, shared expert width).
    moe: Option<(usize, usize, usize, usize)>,
}

impl Preset {
    pub const NAMES: [&'static str; 5] = ["tiny", "tiny-moe", "qwen3.6-27b", "qwen3.6-35b-a3b", "qwen3-next-80b-a3b"];

    pub fn parse(name: &str) -> Result<Self, ModelError> {
        match name {
            "tiny" => Ok(Self::Tiny),
            "tiny-moe" => Ok(Self::TinyMoe),
            "qwen3.6-27b" | "qwen3.5-27b" => Ok(Self::Qwen36_27b),
            "qwen3.6-35b-a3b" | "qwen3.5-35b-a3b" => Ok(Self::Qwen36_35bA3b),
            "qwen3-next-80b-a3b" => Ok(Self::Qwen3Next80bA3b),
            other => Err(ModelError::config(format!("unknown preset `{other}` (known: {})", Self::NAMES.join(", ")))),
        }
    }

    /// Number of mergeable (non-special) tokens the synthetic tokenizer should have for this preset.
    pub fn tokenizer_mergeable(self) -> usize {
        match self {
            Self::Tiny | Self::TinyMoe => 991,
            Self::Qwen36_27b | Self::Qwen36_35bA3b | Self::Qwen3Next80bA3b => 4063,
        }
    }

    fn shape(self) -> Shape {
        let s = |hidden, layers, heads, kv, head_dim, gdn_k, gdn_v, dk, inter, vocab, mtp| Shape {
            hidden,
            layers,
            heads,
            kv,
            head_dim,
            gdn_k,
            gdn_v,
            dk,
            dv: dk,
            inter,
            vocab,
            mtp,
            moe: None,
        };
        match self {
            Self::Tiny => s(128, 4, 4, 2, 32, 2, 6, 32, Some(256), 1024, 1),
            Self::TinyMoe => Shape { moe: Some((8, 2, 64, 128)), ..s(128, 4, 4, 2, 32, 2, 6, 32, None, 1024, 1) },
            Self::Qwen36_27b => s(5120, 64, 24, 4, 256, 16, 48, 128, Some(17408), 248_320, 1),
            Self::Qwen36_35bA3b => {
                Shape { moe: Some((256, 8, 512, 512)), ..s(2048, 40, 16, 2, 256, 16, 32, 128, None, 248_320, 1) }
            }
            Self::Qwen3Next80bA3b => {
                Shape { moe: Some((512, 10, 512, 512)), ..s(2048, 48, 16, 2, 256, 16, 32, 128, Some(5120), 151_936, 1) }
            }
        }
    }

    /// The `text_config` object, with `layers` decoder layers (None: the preset's own count).
    pub fn text_config(self, layers: Option<usize>) -> Value {
        let Shape { hidden, layers: n, heads, kv, head_dim: hd, gdn_k: lk, gdn_v: lv, dk, dv, inter, vocab, mtp, moe } =
            self.shape();
        let n = layers.unwrap_or(n);
        let layer_types: Vec<&str> =
            (0..n).map(|i| if (i + 1) % 4 == 0 { "full_attention" } else { "linear_attention" }).collect();
        let rot_half = hd / 8; // partial_rotary_factor 0.25 → rotary dim hd/4, hd/8 frequencies
        let mrope = [rot_half - 2 * (rot_half / 3), rot_half / 3, rot_half / 3];
        // Stop tokens: <|im_end|> and <|endoftext|> in the synthetic tokenizer's id space.
        let mergeable = self.tokenizer_mergeable() as u64;
        let next = self == Self::Qwen3Next80bA3b;
        let mut v = json!({
            "model_type": if next { "qwen3_next" } else if moe.is_some() { "qwen3_5_moe_text" } else { "qwen3_5_text" },
            "hidden_size": hidden,
            "num_hidden_layers": n,
            "layer_types": layer_types,
            "full_attention_interval": 4,
            "num_attention_heads": heads,
            "num_key_value_heads": kv,
            "head_dim": hd,
            "attn_output_gate": true,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10_000_000.0,
                "partial_rotary_factor": 0.25,
                "mrope_section": mrope,
                "mrope_interleaved": true
            },
            "partial_rotary_factor": 0.25,
            "linear_num_key_heads": lk,
            "linear_num_value_heads": lv,
            "linear_key_head_dim": dk,
            "linear_value_head_dim": dv,
            "linear_conv_kernel_dim": 4,
            "hidden_act": "silu",
            "vocab_size": vocab,
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": false,
            "max_position_embeddings": 262_144,
            "mtp_num_hidden_layers": mtp,
            "mtp_use_dedicated_embeddings": false,
            "mamba_ssm_dtype": "float32",
            "attention_bias": false,
            "attention_dropout": 0.0,
            "dtype": "bfloat16",
            "bos_token_id": null,
            "eos_token_id": mergeable + 2,
            "pad_token_id": mergeable
        });
        if let Some(i) = inter {
            v["intermediate_size"] = json!(i);
        }
        if let Some((experts, top_k, width, shared)) = moe {
            v["num_experts"] = json!(experts);
            v["num_experts_per_tok"] = json!(top_k);
            v["moe_intermediate_size"] = json!(width);
            v["shared_expert_intermediate_size"] = json!(shared);
            v["router_aux_loss_coef"] = json!(0.001);
            if next {
                v["norm_topk_prob"] = json!(true);
                v["decoder_sparse_step"] = json!(1);
                v["mlp_only_layers"] = json!([]);
            }
        }
        if next {
            v["architectures"] = json!(["Qwen3NextForCausalLM"]);
            v["rope_parameters"] =
                json!({ "rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25 });
        }
        v
    }

    /// The `vision_config` object: the real Qwen3.5/3.6 tower (27 blocks of width 1152), or for the tiny
    /// presets a 2-block tower of width 144 with the real head dim (72).
    pub fn vision_config(self) -> Value {
        let (depth, hidden, heads, inter, positions) = match self {
            Self::Tiny | Self::TinyMoe => (2, 144, 2, 288, 64),
            _ => (27, 1152, 16, 4304, 2304),
        };
        json!({
            "model_type": "qwen3_5_vision", "depth": depth, "hidden_size": hidden, "intermediate_size": inter,
            "num_heads": heads, "patch_size": 16, "temporal_patch_size": 2, "spatial_merge_size": 2,
            "out_hidden_size": self.shape().hidden, "num_position_embeddings": positions,
            "in_channels": 3, "hidden_act": "gelu_pytorch_tanh", "deepstack_visual_indexes": []
        })
    }

    /// A Qwen3-Next mixture-of-experts config at a few MB, for tests: 4 layers (a dense first one), hidden 128,
    /// head dims 32 (what the CUDA kernels take), 6 experts of width 64 with top 3 and plain (not
    /// renormalised) top-k probabilities, a shared expert of width 96.
    pub fn small_qwen3_next_moe() -> Value {
        let mut c = Self::Qwen3Next80bA3b.config_json(Some(4));
        for (k, v) in [
            ("hidden_size", 128),
            ("intermediate_size", 256),
            ("moe_intermediate_size", 64),
            ("shared_expert_intermediate_size", 96),
            ("num_experts", 6),
            ("num_experts_per_tok", 3),
            ("num_attention_heads", 4),
            ("num_key_value_heads", 2),
            ("head_dim", 32),
            ("linear_num_key_heads", 2),
            ("linear_num_value_heads", 4),
            ("linear_key_head_dim", 32),
            ("linear_value_head_dim", 32),
        ] {
            c[k] = json!(v);
        }
        c["norm_topk_prob"] = json!(false);
        c["mlp_only_layers"] = json!([0]);
        c
    }

    /// The preset's model configuration: [`Preset::config_json`] parsed.
    pub fn config(self, layers: Option<usize>) -> ModelConfig {
        ModelConfig::from_json_str(&self.config_json(layers).to_string()).expect("a preset's config parses")
    }

    /// The whole `config.json` in the multimodal layout that Qwen3.5/3.6 checkpoints use (Qwen3-Next:
    /// its text-only config).
    pub fn config_json(self, layers: Option<usize>) -> Value {
        if self == Self::Qwen3Next80bA3b {
            return self.text_config(layers);
        }
        let moe = self.shape().moe.is_some();
        json!({
            "architectures": [if moe { "Qwen3_5MoeForConditionalGeneration" } else { "Qwen3_5ForConditionalGeneration" }],
            "model_type": if moe { "qwen3_5_moe" } else { "qwen3_5" },
            "text_config": self.text_config(layers),
            "vision_config": self.vision_config(),
            // The synthetic tokenizer's added tokens follow its mergeable ones in Qwen's order.
            "vision_start_token_id": self.tokenizer_mergeable() + 9,
            "vision_end_token_id": self.tokenizer_mergeable() + 10,
            "image_token_id": self.tokenizer_mergeable() + 12,
            "video_token_id": self.tokenizer_mergeable() + 13,
            "tie_word_embeddings": false,
            "transformers_version": "5.17.0"
        })
    }
}

/// Which MTP head (and main-model variant) [`write_model_with`] writes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum MtpVariant {
    /// A random MTP head when the preset declares one (`mtp_num_hidden_layers` ≥ 1): its drafts are
    /// almost always rejected (the reject path of speculative decoding).
    Random,
    /// No MTP head: `mtp_num_hidden_layers: 0` and no `mtp.*` tensors.
    None,
    /// A head built to agree with the main model. The main layers' residual contributions (`out_proj`,
    /// `o_proj`, `down_proj`, every expert's and the shared expert's included) are scaled by `residual_scale`; with 0 they vanish, so the main model's
    /// next-token logits depend only on the current token (`lm_head(norm(embed(x)))`). The head's `fc`
    /// picks the (normed, unit-weight) embedding half, its block adds zero (`o_proj` and every `down_proj` = 0)
    /// and `mtp.norm` equals the final norm, so it predicts from `x_{t+1}` what the main model will
    /// predict at `t+1`: every draft is accepted (up to rounding of a common positive scale). A small
    /// non-zero `residual_scale` gives partial acceptance on a model whose state matters.
    Agreeing { residual_scale: f32 },
}

/// How a tensor is initialised.
#[derive(Clone, Copy, Debug)]
enum Init {
    Normal(f32),
    /// 1 + Normal(std): the gated norm's plain weight.
    OnePlusNormal(f32),
    /// ln(Uniform(1, 16)): `A_log`.
    LogUniform1To16,
    /// All zeros.
    Zero,
    /// `[n, 2n]`: the identity in the first n columns, zeros in the rest.
    IdentityLeft,
}

/// One tensor to write: stored name, shape, init, and the name its random stream is seeded from.
struct Spec {
    name: String,
    shape: Vec<usize>,
    init: Init,
    seed_name: String,
}

/// Every tensor of a Qwen3.5-layout checkpoint (text model + MTP head) for `variant`.
fn tensor_specs(cfg: &ModelConfig, variant: MtpVariant) -> Vec<Spec> {
    let d = cfg.dims();
    let h = d.hidden;
    let p = if cfg.arch == Arch::Qwen3Next { "model." } else { "model.language_model." };
    let mut specs: Vec<Spec> = text_tensor_specs(cfg)
        .into_iter()
        .map(|(name, shape, init)| Spec { seed_name: name.clone(), name, shape, init })
        .collect();
    if let Some(v) = &cfg.vision {
        specs.extend(vision_tensor_specs(v).into_iter().map(|(name, shape, init)| Spec {
            seed_name: name.clone(),
            name,
            shape,
            init,
        }));
    }
    if let MtpVariant::Agreeing { residual_scale } = variant {
        for s in &mut specs {
            if is_residual(&s.name)
                && let Init::Normal(std) = s.init
            {
                s.init = if residual_scale == 0.0 { Init::Zero } else { Init::Normal(std * residual_scale) };
            }
        }
    }
    if cfg.mtp_num_hidden_layers == 0 || variant == MtpVariant::None {
        return specs;
    }
    let agree = matches!(variant, MtpVariant::Agreeing { .. });
    let norm = |n: usize| (vec![n], Init::Normal(0.1));
    let zero = |out: usize, inp: usize| (vec![out, inp], Init::Zero);
    let mut mtp: Vec<(String, (Vec<usize>, Init))> = vec![
        ("mtp.fc.weight".into(), if agree { (vec![h, 2 * h], Init::IdentityLeft) } else { lin(h, 2 * h) }),
        ("mtp.pre_fc_norm_embedding.weight".into(), if agree { (vec![h], Init::Zero) } else { norm(h) }),
        ("mtp.pre_fc_norm_hidden.weight".into(), norm(h)),
        ("mtp.norm.weight".into(), norm(h)),
    ];
    let l = |s: &str| format!("mtp.layers.0.{s}");
    mtp.extend([
        (l("input_layernorm.weight"), norm(h)),
        (l("post_attention_layernorm.weight"), norm(h)),
        (l("self_attn.q_proj.weight"), lin(2 * d.attn_dim, h)),
        (l("self_attn.k_proj.weight"), lin(d.kv_dim, h)),
        (l("self_attn.v_proj.weight"), lin(d.kv_dim, h)),
        (l("self_attn.o_proj.weight"), if agree { zero(h, d.attn_dim) } else { lin(h, d.attn_dim) }),
        (l("self_attn.q_norm.weight"), norm(d.head_dim)),
        (l("self_attn.k_norm.weight"), norm(d.head_dim)),
    ]);
    // The MLP: a mixture of experts in a mixture-of-experts model, as the main layers write it.
    let sparse = cfg.moe.as_ref().filter(|m| m.mtp_is_sparse());
    for (name, (shape, init)) in mlp_specs(&l("mlp."), sparse, h, d.intermediate) {
        let init = if agree && name.ends_with("down_proj.weight") { Init::Zero } else { init };
        mtp.push((name, (shape, init)));
    }
    for (name, (shape, init)) in mtp {
        // The agreeing head's final norm is the main model's (same random stream, same bytes).
        let seed_name = if agree && name == "mtp.norm.weight" { format!("{p}norm.weight") } else { name.clone() };
        specs.push(Spec { name, shape, init, seed_name });
    }
    specs
}

/// (stored name, shape, init) of every text-model tensor of a Qwen3.5-layout checkpoint.
fn text_tensor_specs(cfg: &ModelConfig) -> Vec<(String, Vec<usize>, Init)> {
    let d = cfg.dims();
    let h = d.hidden;
    let norm = |n: usize| (vec![n], Init::Normal(0.1));
    let next = cfg.arch == Arch::Qwen3Next;
    let p = if next { "model." } else { "model.language_model." };
    let mut v: Vec<(String, (Vec<usize>, Init))> = vec![
        (format!("{p}embed_tokens.weight"), (vec![d.vocab, h], Init::Normal(1.0))),
        (format!("{p}norm.weight"), norm(h)),
    ];
    if !cfg.tie_word_embeddings {
        v.push(("lm_head.weight".into(), lin(d.vocab, h)));
    }
    for (i, kind) in cfg.layer_types.iter().enumerate() {
        let l = |s: &str| format!("{p}layers.{i}.{s}");
        v.push((l("input_layernorm.weight"), norm(h)));
        v.push((l("post_attention_layernorm.weight"), norm(h)));
        match kind {
            LayerKind::DeltaNet => {
                if next {
                    // Qwen3-Next packs the in-projections per key head.
                    v.push((l("linear_attn.in_proj_qkvz.weight"), lin(d.conv_channels + d.gdn_value_width, h)));
                    v.push((l("linear_attn.in_proj_ba.weight"), lin(2 * d.gdn_v_heads, h)));
                } else {
                    v.push((l("linear_attn.in_proj_qkv.weight"), lin(d.conv_channels, h)));
                    v.push((l("linear_attn.in_proj_z.weight"), lin(d.gdn_value_width, h)));
                    v.push((l("linear_attn.in_proj_b.weight"), lin(d.gdn_v_heads, h)));
                    v.push((l("linear_attn.in_proj_a.weight"), lin(d.gdn_v_heads, h)));
                }
                v.push((l("linear_attn.conv1d.weight"), (vec![d.conv_channels, 1, d.conv_kernel], Init::Normal(0.5))));
                v.push((l("linear_attn.dt_bias"), (vec![d.gdn_v_heads], Init::Normal(0.5))));
                v.push((l("linear_attn.A_log"), (vec![d.gdn_v_heads], Init::LogUniform1To16)));
                v.push((l("linear_attn.norm.weight"), (vec![d.gdn_v_dim], Init::OnePlusNormal(0.1))));
                v.push((l("linear_attn.out_proj.weight"), lin(h, d.gdn_value_width)));
            }
            LayerKind::Attention => {
                v.push((l("self_attn.q_proj.weight"), lin(2 * d.attn_dim, h)));
                v.push((l("self_attn.k_proj.weight"), lin(d.kv_dim, h)));
                v.push((l("self_attn.v_proj.weight"), lin(d.kv_dim, h)));
                v.push((l("self_attn.o_proj.weight"), lin(h, d.attn_dim)));
                v.push((l("self_attn.q_norm.weight"), norm(d.head_dim)));
                v.push((l("self_attn.k_norm.weight"), norm(d.head_dim)));
            }
        }
        v.extend(mlp_specs(&l("mlp."), cfg.moe.as_ref().filter(|m| m.is_sparse(i)), h, d.intermediate));
    }
    v.into_iter().map(|(n, (s, i))| (n, s, i)).collect()
}

/// A main layer's residual contribution (scaled by [`MtpVariant::Agreeing`]): a mixer's output projection
/// or an MLP's `down_proj` (a dense MLP's, an expert's or the shared expert's).
fn is_residual(name: &str) -> bool {
    name.ends_with("linear_attn.out_proj.weight")
        || name.ends_with("self_attn.o_proj.weight")
        || (name.contains(".mlp.") && name.ends_with("down_proj.weight"))
}

/// A linear `[out, inp]` drawn with std `1/√inp`.
fn lin(out: usize, inp: usize) -> (Vec<usize>, Init) {
    (vec![out, inp], Init::Normal(1.0 / (inp as f32).sqrt()))
}

/// (stored name, (shape, init)) of the MLP under `prefix` (`….mlp.`): with `sparse`, the router, every
/// expert (one tensor per expert), the shared expert and its gate; else the dense SwiGLU of width `dense_width`.
fn mlp_specs(
    prefix: &str,
    sparse: Option<&MoeConfig>,
    h: usize,
    dense_width: usize,
) -> Vec<(String, (Vec<usize>, Init))> {
    let swiglu = |p: &str, width: usize| {
        [
            (format!("{prefix}{p}gate_proj.weight"), lin(width, h)),
            (format!("{prefix}{p}up_proj.weight"), lin(width, h)),
            (format!("{prefix}{p}down_proj.weight"), lin(h, width)),
        ]
    };
    let Some(m) = sparse else { return swiglu("", dense_width).to_vec() };
    let mut v = vec![(format!("{prefix}gate.weight"), lin(m.num_experts, h))];
    for e in 0..m.num_experts {
        v.extend(swiglu(&format!("experts.{e}."), m.expert_intermediate));
    }
    v.extend(swiglu("shared_expert.", m.shared_expert_intermediate));
    v.push((format!("{prefix}shared_expert_gate.weight"), lin(1, h)));
    v
}

/// (stored name, shape, init) of every tensor of the vision tower.
fn vision_tensor_specs(v: &VisionConfig) -> Vec<(String, Vec<usize>, Init)> {
    crate::vision::tensor_shapes(v)
        .into_iter()
        .map(|(name, shape)| {
            let init = if name.ends_with(".bias") {
                Init::Normal(0.02)
            } else if shape.len() == 1 {
                Init::OnePlusNormal(0.1) // LayerNorm weights
            } else if name.ends_with("pos_embed.weight") {
                Init::Normal(0.5)
            } else {
                Init::Normal(1.0 / (shape[1..].iter().product::<usize>() as f32).sqrt())
            };
            (name, shape, init)
        })
        .collect()
}

/// The `preprocessor_config.json` of Qwen3.5/3.6 (their image processor's settings).
pub fn preprocessor_config_json(v: &VisionConfig) -> Value {
    json!({
        "image_processor_type": "Qwen2VLImageProcessorFast",
        "do_convert_rgb": true, "do_resize": true, "do_rescale": true, "do_normalize": true,
        "resample": 3, "rescale_factor": 1.0 / 255.0,
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
        "patch_size": v.patch_size, "temporal_patch_size": v.temporal_patch_size, "merge_size": v.spatial_merge_size,
        "size": { "shortest_edge": 65_536, "longest_edge": 16_777_216 }
    })
}

/// Writes config.json, generation_config.json and model.safetensors (bf16) for `preset` into `dir`,
/// with a random MTP head when the preset has one. `progress` is called with (bytes written, total bytes).
pub fn write_model(
    dir: &Path,
    preset: Preset,
    layers: Option<usize>,
    seed: u64,
    progress: impl FnMut(u64, u64),
) -> Result<ModelConfig, ModelError> {
    write_model_with(dir, preset, layers, seed, MtpVariant::Random, progress)
}

/// [`write_model`] with a choice of MTP head (see [`MtpVariant`]).
pub fn write_model_with(
    dir: &Path,
    preset: Preset,
    layers: Option<usize>,
    seed: u64,
    variant: MtpVariant,
    progress: impl FnMut(u64, u64),
) -> Result<ModelConfig, ModelError> {
    let mut config = preset.config_json(layers);
    if variant == MtpVariant::None {
        match config.get_mut("text_config") {
            Some(text) => text["mtp_num_hidden_layers"] = json!(0),
            None => config["mtp_num_hidden_layers"] = json!(0),
        }
    }
    write_model_json(dir, preset, config, seed, variant, progress)
}

/// [`write_model_with`] from a `config.json` value (a preset's, edited: other head counts or sizes
/// at the preset's tokenizer).
pub fn write_model_json(
    dir: &Path,
    preset: Preset,
    config: Value,
    seed: u64,
    variant: MtpVariant,
    mut progress: impl FnMut(u64, u64),
) -> Result<ModelConfig, ModelError> {
    std::fs::create_dir_all(dir).map_err(|e| ModelError::io(dir, e))?;
    let text = serde_json::to_string_pretty(&config).map_err(|e| ModelError::config(e.to_string()))?;
    let cfg = ModelConfig::from_json_str(&text)?;
    write_file(&dir.join("config.json"), text.as_bytes())?;
    let mergeable = preset.tokenizer_mergeable() as u64;
    let gen_cfg = json!({ "eos_token_id": [mergeable + 2, mergeable], "do_sample": false });
    write_file(&dir.join("generation_config.json"), gen_cfg.to_string().as_bytes())?;
    if let Some(v) = &cfg.vision {
        let pre = serde_json::to_string_pretty(&preprocessor_config_json(v))
            .map_err(|e| ModelError::config(e.to_string()))?;
        write_file(&dir.join("preprocessor_config.json"), pre.as_bytes())?;
    }

    let specs = tensor_specs(&cfg, variant);
    let headers: Vec<TensorHeader> = specs
        .iter()
        .map(|s| TensorHeader { name: s.name.clone(), dtype: DType::BF16, shape: s.shape.clone() })
        .collect();
    let total: u64 = specs.iter().map(|s| s.shape.iter().product::<usize>() as u64 * 2).sum();
    let mut written = 0u64;
    write_safetensors(&dir.join("model.safetensors"), &headers, |i, buf| {
        let Spec { shape, init, seed_name, .. } = &specs[i];
        let n: usize = shape.iter().product();
        let cols = shape.last().copied().unwrap_or(1);
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed ^ fnv1a(seed_name.as_bytes()));
        buf.reserve(n * 2);
        for idx in 0..n {
            let x = match *init {
                Init::Normal(std) => std * normal(&mut rng),
                Init::OnePlusNormal(std) => 1.0 + std * normal(&mut rng),
                Init::LogUniform1To16 => (1.0 + 15.0 * rng.random::<f32>()).ln(),
                Init::Zero => 0.0,
                Init::IdentityLeft => f32::from(idx / cols == idx % cols),
            };
            buf.extend_from_slice(&half::bf16::from_f32(x).to_bits().to_le_bytes());
        }
        written += buf.len() as u64;
        progress(written, total);
        Ok(())
    })?;
    Ok(cfg)
}

/// Writes beside `path` and renames over it (`checkpoint::replace_file`): a test reading the model
/// another test of the same process is rewriting sees the old file or the new one, never a partial one.
fn write_file(path: &Path, bytes: &[u8]) -> Result<(), ModelError> {
    crate::checkpoint::replace_file(path, |partial| {
        std::fs::write(partial, bytes).map_err(|e| ModelError::io(partial, e))
    })
}

/// A standard normal sample (Box–Muller).
fn normal(rng: &mut Xoshiro256PlusPlus) -> f32 {
    let u1: f32 = rng.random::<f32>().max(f32::MIN_POSITIVE);
    let u2: f32 = rng.random::<f32>();
    (-2.0 * u1.ln()).sqrt() * (std::f32::consts::TAU * u2).cos()
}

/// FNV-1a, to derive a per-tensor seed from its name.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3))
}
