//! GPTQ checkpoints written from a model directory, packed from the format's definition (AutoGPTQ /
//! GPTQModel / AutoRound's GPTQ export): per decoder linear `[out, in]`, 4-bit codes of groups of
//! `group` input columns (in quantisation order: a permutation under act-order, recorded in `g_idx`)
//! packed 8 per int32 along the input (`qweight [in/8, out]`), f16 `scales [groups, out]`, zero points
//! packed 8 per int32 along the output (`qzeros [groups, out/8]`, v1 stores zero − 1), and
//! `quantization_config` in config.json. Used by the loader tests (CPU and CUDA) and nothing else:
//! the values come from a round-to-nearest quantiser, not GPTQ's error-compensating solver, which
//! changes the values but not the layout a loader reads.

use std::collections::HashMap;
use std::path::Path;

use rand::rngs::Xoshiro256PlusPlus;
use rand::{RngExt, SeedableRng};
use serde_json::{Value, json};

use crate::checkpoint::{Checkpoint, DType, TensorHeader, write_safetensors};
use crate::error::ModelError;

/// Which GPTQ flavour to write.
#[derive(Clone, Copy, Debug)]
pub struct GptqVariant {
    /// `"gptq"` or `"auto-round"` (AutoRound's `auto_round:auto_gptq` export, always v1).
    pub method: &'static str,
    pub sym: bool,
    pub act_order: bool,
    /// GPTQModel `checkpoint_format: "gptq_v2"` (zeros stored as is) instead of v1 (zero − 1).
    pub v2: bool,
    /// `-1`: one group per output channel.
    pub group: i64,
    /// Store a `g_idx` even without act-order (AutoGPTQ always does).
    pub write_trivial_g_idx: bool,
}

impl GptqVariant {
    /// AutoGPTQ's common export: symmetric, group 128, v1, trivial `g_idx` stored.
    pub const SYM: GptqVariant =
        GptqVariant { method: "gptq", sym: true, act_order: false, v2: false, group: 128, write_trivial_g_idx: true };
    /// Asymmetric with act-order (a permutation of the input columns).
    pub const ASYM_ACT_ORDER: GptqVariant =
        GptqVariant { method: "gptq", sym: false, act_order: true, v2: false, group: 128, write_trivial_g_idx: false };
}

/// One packed linear.
pub struct Packed {
    /// `[in/8, out]`
    pub qweight: Vec<u32>,
    /// `[groups, out/8]`
    pub qzeros: Vec<u32>,
    /// `[groups, out]`, f16 bits
    pub scales: Vec<u16>,
    /// `[in]`
    pub g_idx: Vec<i32>,
    pub groups: usize,
    /// The packer's own dequantisation, `[out, in]`.
    pub deq: Vec<f32>,
    /// Scale of each (out, in) element (for error bounds).
    pub elem_scale: Vec<f32>,
}

/// Quantises `w` `[out, in]` to 4 bits per group of `group` input columns (in quantisation order:
/// a random permutation for act-order) and packs it as GPTQ stores it.
pub fn pack(w: &[f32], out: usize, inp: usize, v: GptqVariant, rng: &mut Xoshiro256PlusPlus) -> Packed {
    let group = if v.group < 0 { inp } else { v.group as usize };
    let groups = inp.div_ceil(group);
    // Quantisation order: identity, or a random permutation (act-order); g_idx[i] = position / group.
    let mut order: Vec<usize> = (0..inp).collect();
    if v.act_order {
        for k in (1..inp).rev() {
            let j = rng.random_range(0..=k);
            order.swap(k, j);
        }
    }
    let mut g_idx = vec![0i32; inp];
    for (pos, &i) in order.iter().enumerate() {
        g_idx[i] = (pos / group) as i32;
    }
    let maxq = 15i32;
    let mut scale = vec![0f32; groups * out];
    let mut zero = vec![0i32; groups * out];
    let mut scales = vec![0u16; groups * out];
    for g in 0..groups {
        let rows: Vec<usize> = (0..inp).filter(|&i| g_idx[i] as usize == g).collect();
        for o in 0..out {
            let vals = rows.iter().map(|&i| w[o * inp + i]);
            let (mn, mx) = vals.fold((0f32, 0f32), |(a, b), x| (a.min(x), b.max(x)));
            let (s, z) = if v.sym {
                let amax = mn.abs().max(mx);
                (2.0 * amax / maxq as f32, (maxq + 1) / 2)
            } else {
                let s = (mx - mn) / maxq as f32;
                (s, 0)
            };
            let s16 = half::f16::from_f32(if s > 0.0 { s } else { 1.0 });
            let s = s16.to_f32();
            let z = if v.sym {
                z
            } else {
                // v1 stores zero − 1, so its zeros live in [1, 15]; v2 can store 0.
                let zmin = if v.v2 { 0 } else { 1 };
                ((-mn / s).round() as i32).clamp(zmin, maxq)
            };
            scale[g * out + o] = s;
            zero[g * out + o] = z;
            scales[g * out + o] = s16.to_bits();
        }
    }
    let mut qweight = vec![0u32; inp / 8 * out];
    let mut deq = vec![0f32; out * inp];
    let mut elem_scale = vec![0f32; out * inp];
    for i in 0..inp {
        let g = g_idx[i] as usize;
        for o in 0..out {
            let (s, z) = (scale[g * out + o], zero[g * out + o]);
            let q = ((w[o * inp + i] / s).round() as i32 + z).clamp(0, maxq);
            qweight[(i / 8) * out + o] |= (q as u32) << (4 * (i % 8));
            deq[o * inp + i] = (q - z) as f32 * s;
            elem_scale[o * inp + i] = s;
        }
    }
    let mut qzeros = vec![0u32; groups * out / 8];
    for g in 0..groups {
        for o in 0..out {
            let stored = if v.v2 { zero[g * out + o] } else { zero[g * out + o] - 1 };
            qzeros[g * (out / 8) + o / 8] |= ((stored as u32) & 0xf) << (4 * (o % 8));
        }
    }
    Packed { qweight, qzeros, scales, g_idx, groups, deq, elem_scale }
}

/// The `quantization_config` a GPTQ (or AutoRound GPTQ-export) checkpoint carries.
pub fn config(v: GptqVariant, not_converted: &[&str]) -> Value {
    let mut q = json!({
        "bits": 4,
        "group_size": v.group,
        "sym": v.sym,
        "desc_act": v.act_order,
        "modules_to_not_convert": not_converted,
    });
    if v.method == "gptq" {
        q["quant_method"] = json!("gptq");
        q["checkpoint_format"] = json!(if v.v2 { "gptq_v2" } else { "gptq" });
        q["damp_percent"] = json!(0.01);
        q["static_groups"] = json!(false);
        q["true_sequential"] = json!(true);
    } else {
        q["quant_method"] = json!("auto-round");
        q["packing_format"] = json!("auto_round:auto_gptq");
        q["data_type"] = json!("int");
        q["block_name_to_quantize"] = json!("model.language_model.layers");
        // AutoRound records modules it leaves in 16 bits in extra_config.
        let extra: serde_json::Map<String, Value> =
            not_converted.iter().map(|m| (m.to_string(), json!({ "bits": 16, "data_type": "float" }))).collect();
        q["extra_config"] = Value::Object(extra);
        q["modules_to_not_convert"] = Value::Null;
    }
    q
}

/// A tensor to write: stored name, dtype, shape, little-endian bytes.
pub type OutTensor = (String, DType, Vec<usize>, Vec<u8>);

/// What [`convert`] did, for checks: by stored weight name.
#[derive(Default)]
pub struct Converted {
    /// Every tensor of the source checkpoint as f32.
    pub original: HashMap<String, Vec<f32>>,
    /// The quantised linears: the packer's dequantisation and each element's scale.
    pub quantized: HashMap<String, (Vec<f32>, Vec<f32>)>,
}

/// A decoder linear a quantiser converts (not embeddings, norms, conv, lm_head, the MTP head).
pub fn is_decoder_linear(name: &str, shape: &[usize]) -> bool {
    shape.len() == 2 && name.starts_with("model.language_model.layers.") && name.ends_with(".weight")
}

/// Rewrites the single-file checkpoint in `dir` as GPTQ: every decoder linear with a multiple of 8
/// rows and a multiple of 8 columns (in_proj_a / b of small models stay bf16, as real exports leave
/// them) except the modules in `not_converted` (names without `.weight`); `edit` may change the
/// tensor list before it is written (tests of malformed checkpoints). Also writes
/// `quantization_config` into config.json.
pub fn convert(
    dir: &Path,
    v: GptqVariant,
    not_converted: &[&str],
    seed: u64,
    edit: impl FnOnce(&mut Vec<OutTensor>),
) -> Result<Converted, ModelError> {
    let ckpt = Checkpoint::open(dir)?;
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
    let mut tensors: Vec<OutTensor> = Vec::new();
    let mut done = Converted::default();
    for name in ckpt.names() {
        let t = ckpt.get(name)?;
        let module = name.trim_end_matches(".weight");
        let quantize = is_decoder_linear(name, t.shape)
            && t.shape[0].is_multiple_of(8)
            && t.shape[1].is_multiple_of(8)
            && !not_converted.contains(&module);
        let w = t.to_f32()?;
        if !quantize {
            tensors.push((name.to_string(), t.dtype, t.shape.to_vec(), t.bytes.to_vec()));
            done.original.insert(name.to_string(), w);
            continue;
        }
        let (out, inp) = (t.shape[0], t.shape[1]);
        let p = pack(&w, out, inp, v, &mut rng);
        done.original.insert(name.to_string(), w);
        let u32s = |x: &[u32]| x.iter().flat_map(|w| w.to_le_bytes()).collect::<Vec<u8>>();
        tensors.push((format!("{module}.qweight"), DType::I32, vec![inp / 8, out], u32s(&p.qweight)));
        tensors.push((format!("{module}.qzeros"), DType::I32, vec![p.groups, out / 8], u32s(&p.qzeros)));
        let scales = p.scales.iter().flat_map(|s| s.to_le_bytes()).collect();
        tensors.push((format!("{module}.scales"), DType::F16, vec![p.groups, out], scales));
        if v.act_order || v.write_trivial_g_idx {
            let g_idx = p.g_idx.iter().flat_map(|g| g.to_le_bytes()).collect();
            tensors.push((format!("{module}.g_idx"), DType::I32, vec![inp], g_idx));
        }
        done.quantized.insert(name.to_string(), (p.deq, p.elem_scale));
    }
    edit(&mut tensors);
    drop(ckpt);
    write_tensors(&dir.join("model.safetensors"), &tensors)?;
    set_quant_config(dir, config(v, not_converted))?;
    Ok(done)
}

/// Writes `tensors` as one safetensors file.
pub fn write_tensors(path: &Path, tensors: &[OutTensor]) -> Result<(), ModelError> {
    let headers: Vec<TensorHeader> =
        tensors.iter().map(|(n, d, s, _)| TensorHeader { name: n.clone(), dtype: *d, shape: s.clone() }).collect();
    write_safetensors(path, &headers, |i, buf| {
        buf.extend_from_slice(&tensors[i].3);
        Ok(())
    })
}

/// Writes `quantization_config` into the model directory's config.json (top level, as HF does).
pub fn set_quant_config(dir: &Path, q: Value) -> Result<(), ModelError> {
    let path = dir.join("config.json");
    let io = |source| ModelError::Io { path: path.clone(), cause: source };
    let mut v: Value = serde_json::from_str(&std::fs::read_to_string(&path).map_err(io)?)
        .map_err(|e| ModelError::Config(format!("{}: {e}", path.display())))?;
    v["quantization_config"] = q;
    std::fs::write(&path, serde_json::to_string_pretty(&v).unwrap_or_default()).map_err(io)?;
    Ok(())
}
