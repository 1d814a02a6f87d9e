//! The mixture-of-experts MLP of `qwen3_5_moe` (Qwen3.5/3.6-35B-A3B) and of Qwen3-Next: [`MoeConfig`], its
//! fields read from `config.json` (which layers are sparse, how many experts, how many a token uses, how
//! their weights are normalised), with every variant we do not implement refused by name.
//!
//! A sparse layer's MLP (docs/architecture.md §2.4a): router logits `x·Wᵀ` `[E]`, softmax in f32, the
//! `top_k` largest probabilities (renormalised to sum 1 when `norm_topk_prob`), each chosen expert's
//! SwiGLU MLP (width `moe_intermediate_size`) weighted by its probability, plus the shared expert (a
//! SwiGLU MLP of width `shared_expert_intermediate_size`) times `sigmoid(x·w_gate)`.

use serde_json::{Map, Value};

use crate::config::{Arch, Fields};
use crate::error::ModelError;

/// The experts of a mixture-of-experts model, validated.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct MoeConfig {
    /// Routed experts per sparse layer (`num_experts`).
    pub num_experts: usize,
    /// Experts each token uses (`num_experts_per_tok`).
    pub top_k: usize,
    /// Width of one routed expert's MLP (`moe_intermediate_size`).
    pub expert_intermediate: usize,
    /// Width of the shared expert's MLP (`shared_expert_intermediate_size`).
    pub shared_expert_intermediate: usize,
    /// Renormalise the chosen experts' probabilities to sum 1 (`norm_topk_prob`; always for `qwen3_5_moe`).
    pub norm_topk_prob: bool,
    /// One entry per decoder layer: true when the layer's MLP is the mixture of experts.
    pub sparse_layers: Vec<bool>,
}

impl MoeConfig {
    /// True when decoder layer `layer` has the mixture-of-experts MLP.
    pub fn is_sparse(&self, layer: usize) -> bool {
        self.sparse_layers.get(layer).copied().unwrap_or(false)
    }

    /// True when the MTP head's decoder layer has the mixture of experts. The reference implementations
    /// build it as decoder layer 0 (its index in `mtp.layers`), so it follows layer 0's rule: always
    /// for `qwen3_5_moe`; for Qwen3-Next unless `mlp_only_layers` holds 0 or `decoder_sparse_step` > 1.
    pub fn mtp_is_sparse(&self) -> bool {
        self.is_sparse(0)
    }

    /// Number of sparse layers.
    pub fn num_sparse_layers(&self) -> usize {
        self.sparse_layers.iter().filter(|s| **s).count()
    }

    /// The experts of a text config. `moe_model` is true for the `qwen3_5_moe` model types (every layer
    /// sparse); for Qwen3-Next the layers with experts follow `num_experts`, `mlp_only_layers` and
    /// `decoder_sparse_step`, as HF's decoder layer decides. `None` when no layer is sparse.
    pub(crate) fn parse(
        obj: &Map<String, Value>,
        arch: Arch,
        moe_model: bool,
        prefix: &str,
        num_layers: usize,
    ) -> Result<Option<Self>, ModelError> {
        let f = Fields { obj, prefix };
        refuse_variants(&f)?;
        let num_experts = f.opt_usize("num_experts")?.unwrap_or(0);
        let dense_layers: Vec<usize> = match obj.get("mlp_only_layers") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| {
                    v.as_u64().map(|x| x as usize).filter(|&x| x < num_layers).ok_or_else(|| {
                        ModelError::config(format!(
                            "`{prefix}mlp_only_layers` entry {v} is not a decoder layer (0..{num_layers})"
                        ))
                    })
                })
                .collect::<Result<_, _>>()?,
            Some(other) => {
                return Err(ModelError::config(format!("`{prefix}mlp_only_layers` must be an array, got {other}")));
            }
        };
        let step = f.opt_usize("decoder_sparse_step")?.unwrap_or(1);
        let norm_topk_prob = f.opt_bool("norm_topk_prob")?;
        let sparse_layers: Vec<bool> = if moe_model {
            // HF's qwen3_5_moe decoder layer is always sparse and its router always renormalises; a config
            // asking otherwise would be silently ignored there, so it is refused here.
            let odd = if !dense_layers.is_empty() {
                Some("mlp_only_layers")
            } else if step != 1 {
                Some("decoder_sparse_step")
            } else if norm_topk_prob == Some(false) {
                Some("norm_topk_prob")
            } else {
                None
            };
            if let Some(field) = odd {
                return Err(ModelError::unsupported(format!(
                    "`{prefix}{field}` = {}: a qwen3_5_moe model has experts in every layer and renormalises \
                     its top-k weights",
                    obj[field]
                )));
            }
            if num_experts == 0 {
                return Err(ModelError::config(format!("`{prefix}num_experts` must be > 0 for a qwen3_5_moe model")));
            }
            vec![true; num_layers]
        } else {
            if arch == Arch::Qwen35 && num_experts > 0 {
                return Err(ModelError::unsupported(format!(
                    "`{prefix}num_experts` = {num_experts} in a dense qwen3_5 config: use model_type qwen3_5_moe"
                )));
            }
            if num_experts > 0 && step == 0 {
                return Err(ModelError::config(format!("`{prefix}decoder_sparse_step` must be > 0")));
            }
            (0..num_layers).map(|i| num_experts > 0 && !dense_layers.contains(&i) && (i + 1) % step == 0).collect()
        };
        if !sparse_layers.contains(&true) {
            return Ok(None);
        }
        let top_k = f.usize("num_experts_per_tok")?;
        if top_k == 0 || top_k > num_experts {
            return Err(ModelError::config(format!(
                "`{prefix}num_experts_per_tok` = {top_k}: must be between 1 and `{prefix}num_experts` ({num_experts})"
            )));
        }
        let cfg = Self {
            num_experts,
            top_k,
            expert_intermediate: f.usize("moe_intermediate_size")?,
            shared_expert_intermediate: f.usize("shared_expert_intermediate_size")?,
            norm_topk_prob: norm_topk_prob.unwrap_or(true),
            sparse_layers,
        };
        for (name, v) in [
            ("num_experts", cfg.num_experts),
            ("moe_intermediate_size", cfg.expert_intermediate),
            ("shared_expert_intermediate_size", cfg.shared_expert_intermediate),
        ] {
            if v == 0 || v > MAX_EXPERT_DIM {
                return Err(ModelError::config(format!(
                    "`{prefix}{name}` = {v}: must be between 1 and {MAX_EXPERT_DIM}"
                )));
            }
        }
        Ok(Some(cfg))
    }
}

/// Bound on expert counts and widths: beyond it a config is corrupt (and size arithmetic would overflow).
const MAX_EXPERT_DIM: usize = 1 << 20;

/// Routing schemes of other mixture-of-experts families (DeepSeek, GLM, Laguna) that change the math:
/// refused by name rather than ignored.
fn refuse_variants(f: &Fields<'_>) -> Result<(), ModelError> {
    let p = f.prefix;
    if let Some(v) = f.obj.get("scoring_func").filter(|v| !v.is_null())
        && v.as_str() != Some("softmax")
    {
        return Err(ModelError::unsupported(format!("`{p}scoring_func` = {v}: only softmax routing is supported")));
    }
    for field in ["routed_scaling_factor", "moe_routed_scaling_factor"] {
        if let Some(v) = f.obj.get(field).filter(|v| !v.is_null())
            && v.as_f64() != Some(1.0)
        {
            return Err(ModelError::unsupported(format!(
                "`{p}{field}` = {v}: scaled routed experts are not supported"
            )));
        }
    }
    for field in ["n_group", "topk_group", "n_shared_experts", "num_shared_experts"] {
        if let Some(n) = f.opt_usize(field)?
            && n > 1
        {
            return Err(ModelError::unsupported(format!(
                "`{p}{field}` = {n}: grouped routing and more than one shared expert are not supported"
            )));
        }
    }
    Ok(())
}
