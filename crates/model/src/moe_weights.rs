//! A decoder layer's MLP weights, one loader for the main layers and the MTP head ([`load_mlp`]): a dense
//! SwiGLU MLP, or a sparse layer's shared expert and routed part ([`MoeWeights`]: the router, every
//! expert's SwiGLU MLP and the shared expert's gate, checked against the [`MoeConfig`]). Experts are stored one tensor per expert
//! (`mlp.experts.{i}.{gate,up,down}_proj.weight`, dense or quantised like any linear) or fused, as
//! transformers holds them in memory (`mlp.experts.gate_up_proj` `[E, 2·I, D]` with each expert's gate
//! rows before its up rows, `mlp.experts.down_proj` `[E, D, I]`); a fused expert is a row range of those.
//! Errors name the tensor and the config field it disagrees with.

use crate::checkpoint::{Checkpoint, DType};
use crate::error::ModelError;
use crate::moe::MoeConfig;
use crate::quant::{self, Quantization};
use crate::weights::{MlpWeights, MoeWeights, TensorSource, linear};

/// The MLP under `prefix` (`….layers.{i}.mlp.` or `mtp.layers.0.mlp.`), each tensor through `load`: with
/// `sparse`, its shared expert (`shared_expert.{gate,up,down}_proj`) and routed part ([`load`]); else the
/// dense SwiGLU MLP (`{gate,up,down}_proj`) of width `dense_width`.
pub(crate) fn load_mlp<'a, T>(
    ckpt: &'a Checkpoint,
    q: Option<&Quantization>,
    sparse: Option<&MoeConfig>,
    hidden: usize,
    dense_width: usize,
    prefix: &str,
    load: &mut dyn FnMut(TensorSource<'a>) -> Result<T, ModelError>,
) -> Result<(MlpWeights<T>, Option<MoeWeights<T>>), ModelError> {
    let (swiglu, width) = match sparse {
        Some(m) => (format!("{prefix}shared_expert."), m.shared_expert_intermediate),
        None => (prefix.to_string(), dense_width),
    };
    let n = |p: &str| format!("{swiglu}{p}.weight");
    let mlp = MlpWeights {
        gate_proj: load(linear(ckpt, q, &n("gate_proj"), [width, hidden])?)?,
        up_proj: load(linear(ckpt, q, &n("up_proj"), [width, hidden])?)?,
        down_proj: load(linear(ckpt, q, &n("down_proj"), [hidden, width])?)?,
    };
    let moe = match sparse {
        Some(m) => Some(self::load(ckpt, q, m, hidden, prefix, load)?),
        None => None,
    };
    Ok((mlp, moe))
}

/// Every stored tensor name of the MLP under `prefix` that [`load_mlp`] reads.
pub(crate) fn mlp_stored_names(ckpt: &Checkpoint, sparse: Option<&MoeConfig>, prefix: &str) -> Vec<String> {
    match sparse {
        Some(m) => stored_names(ckpt, m, prefix),
        None => PROJ.map(|p| format!("{prefix}{p}.weight")).to_vec(),
    }
}

const PROJ: [&str; 3] = ["gate_proj", "up_proj", "down_proj"];

/// True when the sparse MLP under `prefix` (`….layers.{i}.mlp.`) stores its experts fused.
fn fused(ckpt: &Checkpoint, prefix: &str) -> bool {
    ckpt.contains(&format!("{prefix}experts.gate_up_proj"))
}

/// Every stored tensor name of the sparse MLP under `prefix`: router, shared expert and its gate, experts.
fn stored_names(ckpt: &Checkpoint, m: &MoeConfig, prefix: &str) -> Vec<String> {
    let mut v = vec![format!("{prefix}gate.weight"), format!("{prefix}shared_expert_gate.weight")];
    v.extend(PROJ.map(|p| format!("{prefix}shared_expert.{p}.weight")));
    if fused(ckpt, prefix) {
        v.extend(["gate_up_proj", "down_proj"].map(|p| format!("{prefix}experts.{p}")));
    } else {
        v.extend((0..m.num_experts).flat_map(|e| PROJ.map(|p| format!("{prefix}experts.{e}.{p}.weight"))));
    }
    v
}

/// Loads the router, experts and shared-expert gate of the sparse MLP under `prefix`, each through `load`.
fn load<'a, T>(
    ckpt: &'a Checkpoint,
    q: Option<&Quantization>,
    m: &MoeConfig,
    hidden: usize,
    prefix: &str,
    load: &mut dyn FnMut(TensorSource<'a>) -> Result<T, ModelError>,
) -> Result<MoeWeights<T>, ModelError> {
    let (e_count, width) = (m.num_experts, m.expert_intermediate);
    let router_name = format!("{prefix}gate.weight");
    if let Ok(t) = ckpt.get(&router_name)
        && t.shape.len() == 2
        && t.shape[0] != e_count
    {
        return Err(ModelError::weights(format!(
            "router `{router_name}` has shape {:?}: {} experts, but the config's `num_experts` is {e_count}",
            t.shape, t.shape[0]
        )));
    }
    let router = load(linear(ckpt, q, &router_name, [e_count, hidden])?)?;
    let experts = if fused(ckpt, prefix) {
        fused_experts(ckpt, m, hidden, prefix)?
            .into_iter()
            .map(|[g, u, d]| Ok(MlpWeights { gate_proj: load(g)?, up_proj: load(u)?, down_proj: load(d)? }))
            .collect::<Result<Vec<_>, ModelError>>()?
    } else {
        let extra = format!("{prefix}experts.{e_count}.gate_proj.weight");
        if ckpt.contains(&extra) || quant::is_stored_quantized(ckpt, &extra) {
            return Err(ModelError::weights(format!(
                "the checkpoint has expert {e_count} (`{extra}`), but the config's `num_experts` is {e_count}"
            )));
        }
        let mut experts = Vec::with_capacity(e_count);
        for e in 0..e_count {
            let n = |p: &str| format!("{prefix}experts.{e}.{p}.weight");
            experts.push(MlpWeights {
                gate_proj: load(linear(ckpt, q, &n("gate_proj"), [width, hidden])?)?,
                up_proj: load(linear(ckpt, q, &n("up_proj"), [width, hidden])?)?,
                down_proj: load(linear(ckpt, q, &n("down_proj"), [hidden, width])?)?,
            });
        }
        experts
    };
    let shared_expert_gate = load(linear(ckpt, q, &format!("{prefix}shared_expert_gate.weight"), [1, hidden])?)?;
    Ok(MoeWeights { router, experts, shared_expert_gate })
}

/// Each expert's (gate, up, down) as row ranges of the fused `experts.gate_up_proj` / `experts.down_proj`.
fn fused_experts<'a>(
    ckpt: &'a Checkpoint,
    m: &MoeConfig,
    hidden: usize,
    prefix: &str,
) -> Result<Vec<[TensorSource<'a>; 3]>, ModelError> {
    let (e_count, width) = (m.num_experts, m.expert_intermediate);
    let gu_name = format!("{prefix}experts.gate_up_proj");
    let down_name = format!("{prefix}experts.down_proj");
    let get = |name: &str, shape: [usize; 3]| {
        let t = ckpt.get(name)?;
        if t.shape.len() == 3 && t.shape[0] != e_count {
            return Err(ModelError::weights(format!(
                "fused experts `{name}` has shape {:?}: {} experts, but the config's `num_experts` is {e_count}",
                t.shape, t.shape[0]
            )));
        }
        let t = ckpt.get_shaped(name, &shape)?;
        let elem = t.dtype.size().filter(|_| t.dtype.is_float() && t.dtype != DType::F8E4M3).ok_or_else(|| {
            ModelError::unsupported(format!(
                "fused experts `{name}` have dtype {:?}: only BF16, F16 and F32 fused experts are supported",
                t.dtype
            ))
        })?;
        Ok((t, elem))
    };
    let (gu, gu_elem) = get(&gu_name, [e_count, 2 * width, hidden])?;
    let (down, down_elem) = get(&down_name, [e_count, hidden, width])?;
    let block = width * hidden; // elements of one [I, D] or [D, I] matrix
    let src = |e: usize, proj: &str, from: &str, dtype, bytes: &'a [u8], shape: [usize; 2]| TensorSource {
        name: format!("{prefix}experts.{e}.{proj}.weight (from fused `{from}`)"),
        shape: shape.to_vec(),
        dtype,
        parts: vec![bytes],
        quantized: None,
    };
    Ok((0..e_count)
        .map(|e| {
            let g0 = 2 * e * block * gu_elem;
            let d0 = e * block * down_elem;
            let gate = &gu.bytes[g0..g0 + block * gu_elem];
            let up = &gu.bytes[g0 + block * gu_elem..g0 + 2 * block * gu_elem];
            let dn = &down.bytes[d0..d0 + block * down_elem];
            [
                src(e, "gate_proj", &gu_name, gu.dtype, gate, [width, hidden]),
                src(e, "up_proj", &gu_name, gu.dtype, up, [width, hidden]),
                src(e, "down_proj", &down_name, down.dtype, dn, [hidden, width]),
            ]
        })
        .collect())
}
