//! Block-FP8 checkpoints written from a bf16 model directory, in the layout of the official Qwen
//! `-FP8` releases (Qwen3.5/3.6-27B-FP8, Qwen3.5/3.6-35B-A3B-FP8, Qwen3-Next-80B-A3B-*-FP8): each
//! quantised linear `X.weight` `[out, in]` becomes F8_E4M3 codes `[out, in]` plus
//! `X.weight_scale_inv` F32 `[ceil(out/128), ceil(in/128)]` (one scale per 128 × 128 block,
//! `w ≈ code · scale`, from [`crate::quant::fp8_block_quantize`]), and config.json gets
//! `quantization_config` `{quant_method: "fp8", fmt: "e4m3", activation_scheme: "dynamic",
//! weight_block_size: [128, 128], modules_to_not_convert}`.
//!
//! What is quantised follows those releases: every 2-D linear of the decoder layers and of the MTP
//! head's decoder layer (attention and DeltaNet projections, dense MLPs, every expert and the shared
//! expert), except the modules that [`modules_to_not_convert`] lists. Everything else is copied byte
//! for byte: embeddings, lm_head, norms, conv1d, `A_log`, `dt_bias`, DeltaNet's small `in_proj_a` /
//! `in_proj_b` (`in_proj_ba`), MoE routers (`mlp.gate`) and shared-expert gates, the MTP head's `fc`,
//! and the vision tower.
//!
//! Qwen3-Next's packed `in_proj_qkvz` is quantised too, as in its official FP8 release; deltaserve's
//! loader does not read quantised packed projections yet, so such a checkpoint is refused on load.

use std::collections::HashSet;
use std::path::Path;

use serde_json::{Value, json};

use crate::checkpoint::{Checkpoint, DType, TensorHeader, write_safetensors};
use crate::config::{Arch, LayerKind, ModelConfig};
use crate::error::ModelError;
use crate::quant::fp8_block_quantize;

/// The scale block of the official checkpoints, `[rows (out), cols (in)]`.
pub const BLOCK: [usize; 2] = [128, 128];

/// The `quantization_config` of an official Qwen `-FP8` checkpoint.
pub fn config(not_converted: &[String]) -> Value {
    json!({
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": BLOCK,
        "modules_to_not_convert": not_converted,
    })
}

/// The `modules_to_not_convert` the official FP8 release of `cfg`'s family lists (module names, without
/// `.weight`), for this config's layers:
///
/// - dense Qwen3.5/3.6 (the 27B): `lm_head`, `model.language_model.embed_tokens`, each DeltaNet layer's
///   `linear_attn.{conv1d, in_proj_a, in_proj_b}`, the vision tower's linears (each block's
///   `attn.{qkv, proj}` and `mlp.linear_fc{1,2}`, the merger's `linear_fc{1,2}`, `patch_embed.proj`,
///   `pos_embed`) and `mtp.fc`, sorted by name as that release stores them;
/// - mixture-of-experts Qwen3.5/3.6 (the 35B-A3B) and Qwen3-Next: `lm_head`, `model.embed_tokens`
///   (not for Qwen3-Next, whose list leaves it out), and every module of the decoder layers and the MTP
///   head that is not a quantised linear: each layer's `input_layernorm` and `post_attention_layernorm`,
///   `mlp.gate` and `mlp.shared_expert_gate` (sparse layers), `linear_attn.{A_log, conv1d, dt_bias,
///   in_proj_a, in_proj_b, in_proj_ba, norm}` (Qwen3-Next: `in_proj_ba` only) or
///   `self_attn.{k_norm, q_norm}`; the vision tower's linears as above (Qwen3.5/3.6; the 35B-A3B list
///   is known to name the blocks' linears, the other vision entries follow the 27B's); and the MTP
///   head's `fc`, norms, router and shared-expert gate.
///
/// The MTP entries are listed when the config declares an MTP layer. The loader decides what is
/// quantised from the stored dtypes; the list tells other loaders which modules to keep unquantised.
pub fn modules_to_not_convert(cfg: &ModelConfig) -> Vec<String> {
    let next = cfg.arch == Arch::Qwen3Next;
    let p = if next { "model." } else { "model.language_model." };
    let mut v: Vec<String> = vec!["lm_head".into()];
    let Some(moe) = cfg.moe.as_ref() else {
        // The dense release lists only the linears, the conv and the embedding it keeps.
        v.push(format!("{p}embed_tokens"));
        for (i, kind) in cfg.layer_types.iter().enumerate() {
            if *kind == LayerKind::DeltaNet {
                v.extend(["conv1d", "in_proj_a", "in_proj_b"].map(|m| format!("{p}layers.{i}.linear_attn.{m}")));
            }
        }
        v.extend(vision_modules(cfg));
        if cfg.mtp_num_hidden_layers > 0 {
            v.push("mtp.fc".into());
        }
        v.sort();
        return v;
    };
    if !next {
        v.push("model.embed_tokens".into());
    }
    let linear_attn: &[&str] = if next {
        &["A_log", "conv1d", "dt_bias", "in_proj_ba", "norm"]
    } else {
        &["A_log", "conv1d", "dt_bias", "in_proj_a", "in_proj_b", "in_proj_ba", "norm"]
    };
    for (i, kind) in cfg.layer_types.iter().enumerate() {
        let l = |s: &str| format!("{p}layers.{i}.{s}");
        let mut layer = vec![l("input_layernorm"), l("post_attention_layernorm")];
        if moe.is_sparse(i) {
            layer.extend([l("mlp.gate"), l("mlp.shared_expert_gate")]);
        }
        match kind {
            LayerKind::DeltaNet => layer.extend(linear_attn.iter().map(|m| l(&format!("linear_attn.{m}")))),
            LayerKind::Attention => layer.extend([l("self_attn.k_norm"), l("self_attn.q_norm")]),
        }
        layer.sort();
        v.extend(layer);
    }
    v.extend(vision_modules(cfg));
    if cfg.mtp_num_hidden_layers > 0 {
        let mut mtp: Vec<String> =
            ["fc", "norm", "pre_fc_norm_embedding", "pre_fc_norm_hidden"].map(|m| format!("mtp.{m}")).into();
        let mut layer = vec!["input_layernorm", "post_attention_layernorm", "self_attn.k_norm", "self_attn.q_norm"];
        if moe.mtp_is_sparse() {
            layer.extend(["mlp.gate", "mlp.shared_expert_gate"]);
        }
        mtp.extend(layer.iter().map(|m| format!("mtp.layers.0.{m}")));
        mtp.sort();
        v.extend(mtp);
    }
    v
}

/// The vision tower's linears, conv and position embedding (`model.visual.*`), which the Qwen3.5/3.6
/// releases list as not converted.
fn vision_modules(cfg: &ModelConfig) -> Vec<String> {
    let Some(vision) = &cfg.vision else { return Vec::new() };
    let mut v: Vec<String> = (0..vision.depth)
        .flat_map(|b| {
            ["attn.proj", "attn.qkv", "mlp.linear_fc1", "mlp.linear_fc2"]
                .map(|m| format!("model.visual.blocks.{b}.{m}"))
        })
        .collect();
    v.extend(
        ["merger.linear_fc1", "merger.linear_fc2", "patch_embed.proj", "pos_embed"]
            .map(|m| format!("model.visual.{m}")),
    );
    v
}

/// True when stored tensor `name` (shape `shape`) is a linear the official releases quantise: a 2-D
/// `.weight` of a decoder layer (`model.language_model.layers.*`, `model.layers.*`) or of the MTP
/// head's layer (`mtp.layers.*`) whose module is not in `not_converted`.
pub fn is_quantized_linear(name: &str, shape: &[usize], not_converted: &HashSet<&str>) -> bool {
    let Some(module) = name.strip_suffix(".weight") else { return false };
    shape.len() == 2
        && ["model.language_model.layers.", "model.layers.", "mtp.layers."].iter().any(|p| name.starts_with(p))
        && !not_converted.contains(module)
}

/// What [`convert`] wrote.
#[derive(Debug, Default)]
pub struct Converted {
    /// The stored names (`X.weight`) of the linears written as FP8, in file order.
    pub quantized: Vec<String>,
    /// The `modules_to_not_convert` written into config.json.
    pub modules_to_not_convert: Vec<String>,
}

/// One tensor of the converted file.
enum Part<'a> {
    /// Copied from the source as stored.
    Copy(&'a str),
    /// The e4m3 codes of this source linear (its scales follow as the next part).
    Codes(&'a str, [usize; 2]),
    /// The scales of the linear whose codes precede.
    Scales,
}

/// Rewrites the single-file bf16 checkpoint in `dir` (as [`super::write_model`] writes it) as a block-FP8
/// checkpoint like the official Qwen `-FP8` releases (see the module docs), and writes
/// `quantization_config` into config.json. Tensors are converted one at a time while the new file
/// streams out (it replaces `model.safetensors` when complete), so a full-size model never sits in
/// memory. `progress` is called with (bytes written, total bytes).
pub fn convert(dir: &Path, mut progress: impl FnMut(u64, u64)) -> Result<Converted, ModelError> {
    let cfg = ModelConfig::from_dir(dir)?;
    if let Some(q) = &cfg.quantization {
        return Err(ModelError::config(format!(
            "{}: the checkpoint is already quantised ({}); FP8 conversion reads a bf16 checkpoint",
            dir.display(),
            q.describe()
        )));
    }
    if dir.join("model.safetensors.index.json").exists() {
        return Err(ModelError::config(format!(
            "{}: FP8 conversion rewrites a single-file checkpoint (model.safetensors), not a sharded one",
            dir.display()
        )));
    }
    let not_converted = modules_to_not_convert(&cfg);
    let skip: HashSet<&str> = not_converted.iter().map(String::as_str).collect();
    let ckpt = Checkpoint::open(dir)?;
    let names = ckpt.names();
    let mut headers: Vec<TensorHeader> = Vec::with_capacity(names.len());
    let mut parts: Vec<Part> = Vec::with_capacity(names.len());
    let mut done = Converted { modules_to_not_convert: not_converted.clone(), ..Converted::default() };
    for &name in &names {
        let t = ckpt.get(name)?;
        if !is_quantized_linear(name, t.shape, &skip) {
            headers.push(TensorHeader { name: name.to_string(), dtype: t.dtype, shape: t.shape.to_vec() });
            parts.push(Part::Copy(name));
            continue;
        }
        if !t.dtype.is_float() {
            return Err(ModelError::weights(format!(
                "tensor `{name}` has dtype {}: FP8 conversion reads BF16, F16 or F32 linears",
                t.dtype.name()
            )));
        }
        let (out, inp) = (t.shape[0], t.shape[1]);
        let module = name.trim_end_matches(".weight");
        headers.push(TensorHeader { name: name.to_string(), dtype: DType::F8E4M3, shape: vec![out, inp] });
        parts.push(Part::Codes(name, [out, inp]));
        headers.push(TensorHeader {
            name: format!("{module}.weight_scale_inv"),
            dtype: DType::F32,
            shape: vec![out.div_ceil(BLOCK[0]), inp.div_ceil(BLOCK[1])],
        });
        parts.push(Part::Scales);
        done.quantized.push(name.to_string());
    }
    let total: u64 =
        headers.iter().map(|h| h.shape.iter().product::<usize>() as u64 * h.dtype.size().unwrap_or(0) as u64).sum();
    let mut written = 0u64;
    let mut scales: Vec<f32> = Vec::new();
    write_safetensors(&dir.join("model.safetensors"), &headers, |i, buf| {
        match parts[i] {
            Part::Copy(name) => buf.extend_from_slice(ckpt.get(name)?.bytes),
            Part::Codes(name, [out, inp]) => {
                let (codes, s) = fp8_block_quantize(&ckpt.get(name)?.to_f32()?, out, inp, BLOCK);
                buf.extend_from_slice(&codes);
                scales = s;
            }
            Part::Scales => buf.extend(scales.drain(..).flat_map(f32::to_le_bytes)),
        }
        written += buf.len() as u64;
        progress(written, total);
        Ok(())
    })?;
    drop(ckpt);
    super::gptq::set_quant_config(dir, config(&not_converted))?;
    Ok(done)
}
