//! Resolution from a checkpoint: which tensors store a linear, and its quantised encoding with shapes and
//! dtypes checked.

use super::{Fp8BlockSource, GptqConfig, GptqParams, GptqSource, ModuleQuant, Quantization, QuantizedSource};
use crate::checkpoint::{Checkpoint, DType, TensorRef};
use crate::error::ModelError;

/// Names of the tensors that may store linear `weight_name` (`X.weight`) besides itself.
pub fn companion_names(weight_name: &str) -> Vec<String> {
    match weight_name.strip_suffix(".weight") {
        Some(m) => ["qweight", "qzeros", "scales", "g_idx", "bias", "weight_scale_inv"]
            .iter()
            .map(|s| format!("{m}.{s}"))
            .collect(),
        None => Vec::new(),
    }
}

/// True when the checkpoint stores linear `weight_name` in a quantised encoding.
pub fn is_stored_quantized(ckpt: &Checkpoint, weight_name: &str) -> bool {
    let Some(m) = weight_name.strip_suffix(".weight") else { return false };
    ckpt.contains(&format!("{m}.qweight")) || ckpt.get(weight_name).is_ok_and(|t| t.dtype == DType::F8E4M3)
}

/// Resolves linear `weight_name` (`X.weight`, canonical shape `[out, in]`) to its quantised
/// encoding, or `None` when the checkpoint stores it densely. Shapes and dtypes are checked;
/// errors name the tensor and both shapes.
pub fn linear_source<'a>(
    ckpt: &'a Checkpoint,
    quant: Option<&Quantization>,
    weight_name: &str,
    shape: [usize; 2],
) -> Result<Option<QuantizedSource<'a>>, ModelError> {
    let Some(module) = weight_name.strip_suffix(".weight") else { return Ok(None) };
    let [out_f, in_f] = shape;
    let qweight_name = format!("{module}.qweight");
    if ckpt.contains(&qweight_name) {
        let g = match quant {
            Some(Quantization::Gptq(g)) => g,
            other => {
                return Err(ModelError::weights(format!(
                    "tensor `{qweight_name}` is GPTQ-packed but config.json {}",
                    match other {
                        Some(q) => format!("declares quant_method \"{}\"", q.method()),
                        None => "has no quantization_config".into(),
                    }
                )));
            }
        };
        let q = quant.map(|q| q.module(module)).unwrap_or(ModuleQuant::Excluded);
        let params = match q {
            ModuleQuant::Gptq(p) => p,
            _ => {
                return Err(ModelError::weights(format!(
                    "tensor `{qweight_name}` is GPTQ-packed but quantization_config leaves `{module}` unquantised \
                     (modules_to_not_convert / extra_config / block_name_to_quantize)"
                )));
            }
        };
        return gptq_source(ckpt, g, params, module, out_f, in_f).map(|s| Some(QuantizedSource::Gptq(s)));
    }
    let Ok(w) = ckpt.get(weight_name) else { return Ok(None) };
    if w.dtype != DType::F8E4M3 {
        return Ok(None);
    }
    let block = match quant.map(|q| q.module(module)) {
        Some(ModuleQuant::Fp8(b)) => b,
        Some(ModuleQuant::Excluded) => {
            return Err(ModelError::weights(format!(
                "tensor `{weight_name}` is FP8 but quantization_config lists `{module}` as not converted"
            )));
        }
        _ => {
            return Err(ModelError::weights(format!(
                "tensor `{weight_name}` is F8_E4M3 but config.json has no fp8 quantization_config with \
                 weight_block_size"
            )));
        }
    };
    let w = ckpt.get_shaped(weight_name, &shape)?;
    let scale_name = format!("{module}.weight_scale_inv");
    let s = ckpt.get_shaped(&scale_name, &[out_f.div_ceil(block[0]), in_f.div_ceil(block[1])])?;
    if !s.dtype.is_float() {
        return Err(ModelError::weights(format!(
            "tensor `{scale_name}` has dtype {}; expected F32, BF16 or F16",
            s.dtype.name()
        )));
    }
    Ok(Some(QuantizedSource::Fp8Block(Fp8BlockSource {
        block,
        out_features: out_f,
        in_features: in_f,
        weight: w.bytes,
        scale_inv: s.bytes,
        scale_dtype: s.dtype,
    })))
}

fn want_dtype(t: &TensorRef, ok: &[DType]) -> Result<(), ModelError> {
    if ok.contains(&t.dtype) {
        Ok(())
    } else {
        let names: Vec<&str> = ok.iter().map(|d| d.name()).collect();
        Err(ModelError::weights(format!(
            "tensor `{}` has dtype {}; expected {}",
            t.name,
            t.dtype.name(),
            names.join(" or ")
        )))
    }
}

fn gptq_source<'a>(
    ckpt: &'a Checkpoint,
    g: &GptqConfig,
    params: GptqParams,
    module: &str,
    out_f: usize,
    in_f: usize,
) -> Result<GptqSource<'a>, ModelError> {
    let pack = params.pack();
    let name = |s: &str| format!("{module}.{s}");
    if !in_f.is_multiple_of(pack) {
        return Err(ModelError::weights(format!(
            "`{module}`: {in_f} input features cannot be GPTQ-packed {pack} per int32"
        )));
    }
    let groups = params.groups(in_f);
    let qweight = ckpt.get_shaped(&name("qweight"), &[in_f / pack, out_f])?;
    want_dtype(&qweight, &[DType::I32])?;
    let scales = ckpt.get_shaped(&name("scales"), &[groups, out_f])?;
    want_dtype(&scales, &[DType::F16, DType::BF16, DType::F32])?;
    let qzeros = if ckpt.contains(&name("qzeros")) || !params.sym {
        if !out_f.is_multiple_of(pack) {
            return Err(ModelError::weights(format!(
                "`{module}`: {out_f} output features cannot hold GPTQ zero points packed {pack} per int32"
            )));
        }
        let z = ckpt.get_shaped(&name("qzeros"), &[groups, out_f / pack])?;
        want_dtype(&z, &[DType::I32])?;
        Some(z.bytes)
    } else {
        None
    };
    let g_idx = if ckpt.contains(&name("g_idx")) {
        let t = ckpt.get_shaped(&name("g_idx"), &[in_f])?;
        want_dtype(&t, &[DType::I32])?;
        Some(t.bytes)
    } else if g.desc_act {
        return Err(ModelError::MissingTensor {
            name: name("g_idx"),
            hint: " (quantization_config has desc_act = true, so the act-order group index is required)".into(),
        });
    } else {
        None
    };
    if let Ok(bias) = ckpt.get(&name("bias")) {
        let b = ckpt.get_shaped(&name("bias"), &[out_f])?;
        if !bias.dtype.is_float() || b.to_f32()?.iter().any(|&x| x != 0.0) {
            return Err(ModelError::unsupported(format!(
                "tensor `{}`: linear biases are not supported (Qwen3.5 linears have none)",
                name("bias")
            )));
        }
    }
    Ok(GptqSource {
        params,
        zero_format: g.zero_format,
        out_features: out_f,
        in_features: in_f,
        qweight: qweight.bytes,
        qzeros,
        scales: scales.bytes,
        scales_dtype: scales.dtype,
        g_idx,
    })
}
