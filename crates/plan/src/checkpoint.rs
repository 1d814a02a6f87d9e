//! [`CheckpointTensors`]: the tensors of a quantised checkpoint as the CUDA backend places them, walked
//! once, priced for any [`WeightFormat`]. A GPTQ / AutoRound checkpoint under an int4 plan keeps some
//! linears bf16 and act-order linears carry a permutation: what the weights need beyond the plan's
//! `weights` region, which the plan adds to the backend's scratch (the backend takes it from there).

use std::fmt;
use std::path::Path;

use deltaserve_model::quant::{GptqSource, Quantization};
use deltaserve_model::{Checkpoint, ModelConfig, ModelError, ModelWeights, QuantizedSource, ShardSpec};

use crate::cuda::{Fp8Bytes, W4Bytes, WeightFormat};
use crate::plan::ALIGN;

/// A decoder linear (stored `[out, in]` projection) by its tensor name.
pub fn is_linear(name: &str) -> bool {
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

/// The tensors the CUDA backend keeps in f32 (`A_log`, `dt_bias`, the DeltaNet gated-norm weight).
pub fn is_f32_tensor(name: &str) -> bool {
    name.ends_with("A_log") || name.ends_with("dt_bias") || name.ends_with("linear_attn.norm.weight")
}

/// True when a GPTQ `g_idx` is not `i / group` (act-order): the conversion may need a permutation.
pub fn act_order(g: &GptqSource<'_>) -> bool {
    let gs = g.params.group_size.unwrap_or(g.in_features).max(1);
    g.g_idx.is_some_and(|b| {
        b.chunks_exact(4).enumerate().any(|(i, w)| u32::from_le_bytes([w[0], w[1], w[2], w[3]]) as usize != i / gs)
    })
}

/// How a stored tensor is priced.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Embed,
    LmHead,
    Linear,
    /// A routed expert's linear (quantised at load under int4 whatever the checkpoint keeps dense, as the
    /// backend places experts; on the host with `experts_on_host`).
    Expert,
    F32,
    Dense,
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct Tensor {
    kind: Kind,
    /// The shape one card loads (the rank's shard under tensor parallelism).
    shape: Vec<usize>,
    /// A GPTQ-packed linear: (asymmetric, act-order).
    gptq: Option<(bool, bool)>,
    /// A block-FP8 linear in 128×128 blocks (what the CUDA backend keeps as stored under fp8).
    fp8: bool,
}

/// The tensors of a checkpoint as one card loads them (see the module docs).
#[derive(Clone, PartialEq, Eq)]
pub struct CheckpointTensors {
    tensors: Vec<Tensor>,
    tie_word_embeddings: bool,
    /// A GPTQ checkpoint: linears it stores unquantised stay bf16 (not quantised at load).
    keep_dense: bool,
    /// A block-FP8 checkpoint: under fp8 the linears it stores unquantised stay bf16.
    fp8_checkpoint: bool,
}

impl fmt::Debug for CheckpointTensors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CheckpointTensors").field("tensors", &self.tensors.len()).finish_non_exhaustive()
    }
}

impl CheckpointTensors {
    /// Walks checkpoint `dir` of model `cfg` (the whole model); under tensor parallelism `shard`'s
    /// share (the tensors cut as the rank loads them).
    pub fn walk(cfg: &ModelConfig, dir: &Path, shard: Option<&ShardSpec>) -> Result<Self, ModelError> {
        let ckpt = Checkpoint::open(dir)?;
        let mut tensors = Vec::new();
        let _: ModelWeights<()> = ModelWeights::load(&ckpt, cfg, |src| {
            let name = &src.name;
            let shape = match shard {
                Some(s) => s.split_stored(name)?.shard_shape(&src.shape),
                None => src.shape.clone(),
            };
            let kind = if name.ends_with("embed_tokens.weight") {
                Kind::Embed
            } else if name.ends_with("lm_head.weight") {
                Kind::LmHead
            } else if name.contains(".mlp.experts.") {
                Kind::Expert
            } else if is_linear(name) {
                Kind::Linear
            } else if is_f32_tensor(name) {
                Kind::F32
            } else {
                Kind::Dense
            };
            let gptq = match &src.quantized {
                Some(QuantizedSource::Gptq(g)) => Some((!g.params.sym, act_order(g))),
                _ => None,
            };
            let fp8 = matches!(&src.quantized, Some(QuantizedSource::Fp8Block(f)) if f.block == [128, 128]);
            tensors.push(Tensor { kind, shape, gptq, fp8 });
            Ok(())
        })?;
        Ok(Self {
            tensors,
            tie_word_embeddings: cfg.tie_word_embeddings,
            keep_dense: matches!(cfg.quantization, Some(Quantization::Gptq(_))),
            fp8_checkpoint: matches!(cfg.quantization, Some(Quantization::Fp8Block(_))),
        })
    }

    /// Device bytes the backend places for these weights in format `f` (an upper bound: act-order
    /// GPTQ linears are counted with their permutation; no routed expert with `experts_on_host`).
    pub fn device_bytes(&self, f: WeightFormat) -> usize {
        let w4 = |s: &[usize], asym: bool, perm: bool| W4Bytes::new(s[0], s[1], asym, perm).aligned();
        let al = |x: usize| x.next_multiple_of(ALIGN as usize);
        self.tensors
            .iter()
            .map(|t| {
                let s = &t.shape;
                let numel: usize = s.iter().product();
                let dense2 = al(2 * numel);
                let fp8 = Fp8Bytes::new(s[0], *s.get(1).unwrap_or(&1)).aligned();
                // `fp8`: a decoder linear under fp8 (stored so, or quantised at load from a bf16 checkpoint).
                let lin = |int4: bool, keep: bool, fp8_linear: bool| match t.gptq {
                    Some((asym, perm)) if int4 => w4(s, asym, perm),
                    _ if int4 && !keep => w4(s, f.asym, false),
                    _ if fp8_linear && (t.fp8 || !self.fp8_checkpoint) => fp8,
                    _ => dense2,
                };
                match t.kind {
                    Kind::Embed => {
                        let head = if self.tie_word_embeddings && f.own_lm_head(self.tie_word_embeddings) {
                            if f.lm_head_int4 { w4(s, f.asym, false) } else { dense2 }
                        } else {
                            0
                        };
                        head + if f.embed_on_host { 0 } else { dense2 }
                    }
                    Kind::LmHead => lin(f.lm_head_int4, false, false),
                    Kind::Expert if f.experts_on_host => 0,
                    Kind::Expert => lin(f.int4, false, false),
                    Kind::Linear if f.int4 => lin(true, self.keep_dense, false),
                    Kind::Linear if f.fp8 => lin(false, false, true),
                    Kind::F32 => al(4 * numel),
                    Kind::Linear | Kind::Dense => dense2,
                }
            })
            .sum()
    }
}
