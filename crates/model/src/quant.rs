//! Quantised checkpoints: the `quantization_config` of `config.json` ([`Quantization`]) and the
//! stored encodings of quantised linear weights ([`QuantizedSource`]), with their dequantisation.
//!
//! Two encodings are read:
//!
//! - **GPTQ** (`quant_method` `"gptq"`, as AutoGPTQ / GPTQModel export it, and `"auto-round"` with
//!   `packing_format` `"auto_round:auto_gptq"`, AutoRound's GPTQ-compatible export). A linear
//!   `X.weight` `[out, in]` is stored instead as
//!   - `X.qweight` I32 `[in·bits/32, out]`: `32/bits` values per word along `in`, lowest bits first
//!     (input row `i` lives in word row `i / 8`, bits `4·(i % 8)..` for 4 bits);
//!   - `X.scales` F16 (or BF16/F32) `[groups, out]`, `groups = ceil(in / group_size)`;
//!   - `X.qzeros` I32 `[groups, out·bits/32]`: zero points packed the same way along `out`;
//!   - optional `X.g_idx` I32 `[in]`: the group of each input row (permuted under `desc_act`;
//!     without it the group of row `i` is `i / group_size`);
//!   - optional `X.bias` (must be zero: the model has no biases).
//!
//!   Dequantisation: `w[o, i] = (q[i, o] − zero[g(i), o]) · scale[g(i), o]`, in f32.
//!
//!   Zero points: the classic ("v1") format, written by AutoGPTQ, by GPTQModel with
//!   `checkpoint_format: "gptq"` (its default) and by AutoRound's `auto_round:auto_gptq` packing,
//!   stores `zero − 1` (and so cannot represent a zero of 0); the real zero is `stored + 1` (the
//!   exllama/vLLM GPTQ kernels add 1 the same way, without masking). GPTQModel's
//!   `checkpoint_format: "gptq_v2"` stores the zero itself. For `sym: true` the zero is fixed at
//!   `2^(bits−1)` (8 for 4 bits, as Marlin assumes) and `qzeros` is not read (it holds 7 in v1, 8 in v2).
//!
//! - **Block FP8** (`quant_method` `"fp8"` with `weight_block_size`, the official `-FP8`
//!   checkpoints): `X.weight` F8_E4M3 `[out, in]` and `X.weight_scale_inv` F32 (or BF16/F16)
//!   `[ceil(out/bo), ceil(in/bi)]`; `w[o, i] = fp8(o, i) · scale_inv[o / bo, i / bi]`.
//!
//! Which linears are quantised is read from the checkpoint itself (a `qweight`, or an F8_E4M3
//! `weight`), so layers a quantiser left unquantised (`modules_to_not_convert`, AutoRound
//! `extra_config` entries with 16 bits, modules outside `block_name_to_quantize`, shapes it could
//! not pack) load densely as before; a module the config explicitly excludes but that is stored
//! quantised is an error.

use std::collections::BTreeMap;

use serde_json::{Map, Value};

use crate::checkpoint::{Checkpoint, DType, TensorRef};
use crate::error::ModelError;

// ---------------------------------------------------------------------------------------------
// Config
// ---------------------------------------------------------------------------------------------

/// A parsed, supported `quantization_config`.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub enum Quantization {
    /// Integer weight-only GPTQ layout (GPTQ or AutoRound's GPTQ-compatible export).
    Gptq(GptqConfig),
    /// Block-scaled FP8 e4m3 weights.
    Fp8Block(Fp8BlockConfig),
}

/// Which tool's config the GPTQ layout came from (informational; the layout is the same).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum GptqProducer {
    /// `quant_method: "gptq"` (AutoGPTQ, GPTQModel, optimum).
    Gptq,
    /// `quant_method: "auto-round"` / `"intel/auto-round"` with GPTQ packing.
    AutoRound,
}

/// How `qzeros` store the zero point.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum ZeroFormat {
    /// Classic GPTQ ("v1"): stored = zero − 1; real zero = stored + 1.
    V1MinusOne,
    /// GPTQModel `gptq_v2`: stored = zero.
    V2Exact,
}

impl ZeroFormat {
    /// What to add to a stored zero to get the real one.
    pub fn offset(self) -> i32 {
        match self {
            Self::V1MinusOne => 1,
            Self::V2Exact => 0,
        }
    }
}

/// Per-module GPTQ parameters.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct GptqParams {
    pub bits: u32,
    /// Input rows per group; `None` = one group over all of `in` (`group_size: -1`, per-channel).
    pub group_size: Option<usize>,
    pub sym: bool,
}

/// GPTQ / AutoRound `quantization_config`.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct GptqConfig {
    pub producer: GptqProducer,
    /// The default parameters of a quantised module.
    pub params: GptqParams,
    /// Act-order: quantised in a permuted row order, so `g_idx` must be stored.
    pub desc_act: bool,
    pub zero_format: ZeroFormat,
    /// Modules left unquantised (`modules_to_not_convert`).
    pub modules_to_not_convert: Vec<String>,
    /// AutoRound: only modules under these blocks are quantised (`block_name_to_quantize`).
    pub block_name_to_quantize: Option<Vec<String>>,
    /// AutoRound per-module overrides (`extra_config`): `None` = left unquantised (bits ≥ 16).
    pub extra_config: BTreeMap<String, Option<GptqParams>>,
}

/// Block-FP8 `quantization_config`.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Fp8BlockConfig {
    /// `[rows (out), cols (in)]` per scale block, `weight_block_size`.
    pub block: [usize; 2],
    /// `modules_to_not_convert` and `ignored_layers`.
    pub modules_to_not_convert: Vec<String>,
}

/// Bits supported for GPTQ weights.
pub const GPTQ_BITS: &[u32] = &[4];

impl Quantization {
    /// One line for logs: the format and its parameters.
    pub fn describe(&self) -> String {
        match self {
            Self::Gptq(g) => format!(
                "{} int{} (group {}, {}{})",
                match g.producer {
                    GptqProducer::Gptq => "GPTQ",
                    GptqProducer::AutoRound => "AutoRound (GPTQ packing)",
                },
                g.params.bits,
                g.params.group_size.map_or("per channel".to_string(), |s| s.to_string()),
                if g.params.sym { "symmetric" } else { "asymmetric" },
                if g.desc_act { ", act-order" } else { "" }
            ),
            Self::Fp8Block(c) => format!("block FP8 e4m3 ({}x{} scale blocks)", c.block[0], c.block[1]),
        }
    }

    /// Parses a `quantization_config` object; `field` is its path in config.json (for errors).
    pub fn from_json(v: &Value, field: &str) -> Result<Self, ModelError> {
        let obj = v.as_object().ok_or_else(|| ModelError::config(format!("`{field}` must be an object, got {v}")))?;
        let f = QFields { obj, field };
        let method = f
            .str("quant_method")?
            .ok_or_else(|| ModelError::config(format!("missing field `{field}.quant_method`")))?;
        match method {
            "gptq" => Self::parse_gptq(&f, GptqProducer::Gptq),
            "auto-round" | "auto_round" | "intel/auto-round" => Self::parse_gptq(&f, GptqProducer::AutoRound),
            "fp8" => Self::parse_fp8(&f),
            other => Err(ModelError::unsupported(format!(
                "`{field}.quant_method` = \"{other}\": this quantisation method is not supported yet \
                 (supported: gptq, auto-round with GPTQ packing, fp8 with block scales)"
            ))),
        }
    }

    fn parse_gptq(f: &QFields, producer: GptqProducer) -> Result<Self, ModelError> {
        let field = f.field;
        if producer == GptqProducer::AutoRound {
            let packing = f.str("packing_format")?.unwrap_or("auto_round:auto_gptq");
            if !matches!(packing, "auto_round:auto_gptq" | "auto_round:gptq" | "auto_gptq") {
                return Err(ModelError::unsupported(format!(
                    "`{field}.packing_format` = \"{packing}\": not supported yet (only AutoRound's GPTQ-compatible \
                     export, \"auto_round:auto_gptq\", is)"
                )));
            }
        }
        if let Some(dt) = f.str("data_type")?
            && dt != "int"
        {
            return Err(ModelError::unsupported(format!(
                "`{field}.data_type` = \"{dt}\": only integer (\"int\") GPTQ weights are supported yet"
            )));
        }
        if let Some(pd) = f.str("pack_dtype")?
            && pd != "int32"
        {
            return Err(ModelError::unsupported(format!(
                "`{field}.pack_dtype` = \"{pd}\": only int32 packing is supported yet"
            )));
        }
        let zero_format = match f.str("checkpoint_format")?.unwrap_or("gptq") {
            "gptq" => ZeroFormat::V1MinusOne,
            "gptq_v2" => ZeroFormat::V2Exact,
            other => {
                return Err(ModelError::unsupported(format!(
                    "`{field}.checkpoint_format` = \"{other}\": not supported yet (supported: gptq, gptq_v2)"
                )));
            }
        };
        let bits = f.int("bits")?.ok_or_else(|| ModelError::config(format!("missing field `{field}.bits`")))?;
        let bits = check_bits(bits, &format!("{field}.bits"))?;
        let group_size = match f.int("group_size")? {
            None => return Err(ModelError::config(format!("missing field `{field}.group_size`"))),
            Some(g) => check_group(g, &format!("{field}.group_size"))?,
        };
        let sym = f.bool("sym")?.unwrap_or(true);
        let desc_act = f.bool("desc_act")?.unwrap_or(false);
        let params = GptqParams { bits, group_size, sym };

        let mut modules_to_not_convert = f.str_list("modules_to_not_convert")?.unwrap_or_default();
        if let Some(more) = f.str_list("ignored_layers")? {
            modules_to_not_convert.extend(more);
        }
        let block_name_to_quantize =
            match f.obj.get("block_name_to_quantize").or_else(|| f.obj.get("to_quant_block_names")) {
                None | Some(Value::Null) => None,
                Some(Value::String(s)) => {
                    Some(s.split(',').map(|x| x.trim().to_string()).filter(|x| !x.is_empty()).collect())
                }
                Some(Value::Array(a)) => Some(
                    a.iter()
                        .map(|x| {
                            x.as_str().map(str::to_string).ok_or_else(|| {
                                ModelError::config(format!(
                                    "`{field}.block_name_to_quantize` must hold strings, got {x}"
                                ))
                            })
                        })
                        .collect::<Result<Vec<_>, _>>()?,
                ),
                Some(other) => {
                    return Err(ModelError::config(format!(
                        "`{field}.block_name_to_quantize` must be a string or a list of strings, got {other}"
                    )));
                }
            };
        let mut extra_config = BTreeMap::new();
        match f.obj.get("extra_config") {
            None | Some(Value::Null) => {}
            Some(Value::Object(m)) => {
                for (name, entry) in m {
                    let at = format!("{field}.extra_config.{name}");
                    let e = entry.as_object().ok_or_else(|| ModelError::config(format!("`{at}` must be an object")))?;
                    let ef = QFields { obj: e, field: &at };
                    let ebits = ef.int("bits")?.unwrap_or(bits as i64);
                    let entry = if ebits >= 16 {
                        None
                    } else {
                        if let Some(dt) = ef.str("data_type")?
                            && dt != "int"
                        {
                            return Err(ModelError::unsupported(format!(
                                "`{at}.data_type` = \"{dt}\": only integer GPTQ weights are supported yet"
                            )));
                        }
                        Some(GptqParams {
                            bits: check_bits(ebits, &format!("{at}.bits"))?,
                            group_size: match ef.int("group_size")? {
                                Some(g) => check_group(g, &format!("{at}.group_size"))?,
                                None => group_size,
                            },
                            sym: ef.bool("sym")?.unwrap_or(sym),
                        })
                    };
                    extra_config.insert(name.clone(), entry);
                }
            }
            Some(other) => {
                return Err(ModelError::config(format!("`{field}.extra_config` must be an object, got {other}")));
            }
        }
        if let Some(dynamic) = f.obj.get("dynamic").filter(|d| d.as_object().is_some_and(|m| !m.is_empty())) {
            tracing::warn!(
                dynamic = %dynamic,
                "`{field}.dynamic`: GPTQModel per-module rules are not interpreted; which modules are quantised is \
                 read from the checkpoint and every shape is checked"
            );
        }
        Ok(Self::Gptq(GptqConfig {
            producer,
            params,
            desc_act,
            zero_format,
            modules_to_not_convert,
            block_name_to_quantize,
            extra_config,
        }))
    }

    fn parse_fp8(f: &QFields) -> Result<Self, ModelError> {
        let field = f.field;
        if let Some(fmt) = f.str("fmt")?
            && fmt != "e4m3"
        {
            return Err(ModelError::unsupported(format!(
                "`{field}.fmt` = \"{fmt}\": only e4m3 FP8 weights are supported yet"
            )));
        }
        if let Some(scheme) = f.str("activation_scheme")?
            && scheme != "dynamic"
        {
            return Err(ModelError::unsupported(format!(
                "`{field}.activation_scheme` = \"{scheme}\": only \"dynamic\" is supported yet"
            )));
        }
        let block = match f.obj.get("weight_block_size") {
            None | Some(Value::Null) => {
                return Err(ModelError::unsupported(format!(
                    "`{field}.weight_block_size` is missing: per-tensor / per-channel FP8 is not supported yet \
                     (only block-scaled FP8 with `weight_scale_inv`)"
                )));
            }
            Some(Value::Array(a)) if a.len() == 2 && a.iter().all(|x| x.as_u64().is_some_and(|n| n > 0)) => {
                [a[0].as_u64().unwrap_or(1) as usize, a[1].as_u64().unwrap_or(1) as usize]
            }
            Some(other) => {
                return Err(ModelError::config(format!(
                    "`{field}.weight_block_size` must be two positive integers, got {other}"
                )));
            }
        };
        let mut modules_to_not_convert = f.str_list("modules_to_not_convert")?.unwrap_or_default();
        if let Some(more) = f.str_list("ignored_layers")? {
            modules_to_not_convert.extend(more);
        }
        Ok(Self::Fp8Block(Fp8BlockConfig { block, modules_to_not_convert }))
    }

    /// The method name as it appears in `quant_method`.
    pub fn method(&self) -> &'static str {
        match self {
            Self::Gptq(g) => match g.producer {
                GptqProducer::Gptq => "gptq",
                GptqProducer::AutoRound => "auto-round",
            },
            Self::Fp8Block(_) => "fp8",
        }
    }
}

fn check_bits(bits: i64, field: &str) -> Result<u32, ModelError> {
    match u32::try_from(bits) {
        Ok(b) if GPTQ_BITS.contains(&b) => Ok(b),
        _ => Err(ModelError::unsupported(format!("`{field}` = {bits}: only 4-bit GPTQ weights are supported yet"))),
    }
}

fn check_group(g: i64, field: &str) -> Result<Option<usize>, ModelError> {
    match g {
        -1 => Ok(None),
        g if g > 0 && g <= 1 << 24 => Ok(Some(g as usize)),
        g => Err(ModelError::unsupported(format!(
            "`{field}` = {g}: the group size must be positive, or -1 for one group per output channel"
        ))),
    }
}

/// Typed access to a `quantization_config` object's fields, with errors naming the field.
struct QFields<'a> {
    obj: &'a Map<String, Value>,
    field: &'a str,
}

impl QFields<'_> {
    fn wrong(&self, name: &str, want: &str, got: &Value) -> ModelError {
        ModelError::config(format!("`{}.{name}` must be {want}, got {got}", self.field))
    }
    fn str(&self, name: &str) -> Result<Option<&str>, ModelError> {
        match self.obj.get(name) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v.as_str().map(Some).ok_or_else(|| self.wrong(name, "a string", v)),
        }
    }
    fn int(&self, name: &str) -> Result<Option<i64>, ModelError> {
        match self.obj.get(name) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v.as_i64().map(Some).ok_or_else(|| self.wrong(name, "an integer", v)),
        }
    }
    fn bool(&self, name: &str) -> Result<Option<bool>, ModelError> {
        match self.obj.get(name) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v.as_bool().map(Some).ok_or_else(|| self.wrong(name, "true or false", v)),
        }
    }
    fn str_list(&self, name: &str) -> Result<Option<Vec<String>>, ModelError> {
        match self.obj.get(name) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Array(a)) => a
                .iter()
                .map(|x| x.as_str().map(str::to_string).ok_or_else(|| self.wrong(name, "a list of strings", x)))
                .collect::<Result<Vec<_>, _>>()
                .map(Some),
            Some(v) => Err(self.wrong(name, "a list of strings", v)),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Module selection
// ---------------------------------------------------------------------------------------------

/// A module name without the text-model prefix (`model.language_model.`, `model.`), so that config
/// entries and checkpoint names written with either prefix compare equal.
fn normalize(name: &str) -> &str {
    for p in ["model.language_model.", "language_model.model.", "language_model.", "model."] {
        if let Some(rest) = name.strip_prefix(p) {
            return rest;
        }
    }
    name
}

/// True when `pattern` names `module` or a block (dotted prefix / component run) containing it.
fn module_matches(module: &str, pattern: &str) -> bool {
    let (m, p) = (normalize(module), normalize(pattern.trim_end_matches('.')));
    if p.is_empty() {
        return false;
    }
    m == p
        || module == pattern
        || m.starts_with(&format!("{p}."))
        || m.ends_with(&format!(".{p}"))
        || m.contains(&format!(".{p}."))
}

/// True when `module` lies under block `block` (e.g. `model.language_model.layers`).
fn within_block(module: &str, block: &str) -> bool {
    let (m, b) = (normalize(module), normalize(block.trim_end_matches('.')));
    !b.is_empty() && (m == b || m.starts_with(&format!("{b}.")))
}

/// What the config says about one module.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ModuleQuant {
    /// Explicitly left unquantised by the config.
    Excluded,
    /// GPTQ-quantised with these parameters (if the checkpoint stores it quantised).
    Gptq(GptqParams),
    /// Block-FP8 (if the checkpoint stores it so).
    Fp8([usize; 2]),
}

impl Quantization {
    /// The config's rule for `module` (a linear's name without `.weight`).
    pub fn module(&self, module: &str) -> ModuleQuant {
        match self {
            Self::Gptq(g) => {
                if let Some((_, entry)) = g.extra_config.iter().find(|(k, _)| normalize(k) == normalize(module)) {
                    return entry.map_or(ModuleQuant::Excluded, ModuleQuant::Gptq);
                }
                if g.modules_to_not_convert.iter().any(|p| module_matches(module, p)) {
                    return ModuleQuant::Excluded;
                }
                if let Some(blocks) = &g.block_name_to_quantize
                    && !blocks.iter().any(|b| within_block(module, b))
                {
                    return ModuleQuant::Excluded;
                }
                ModuleQuant::Gptq(g.params)
            }
            Self::Fp8Block(c) => {
                if c.modules_to_not_convert.iter().any(|p| module_matches(module, p)) {
                    ModuleQuant::Excluded
                } else {
                    ModuleQuant::Fp8(c.block)
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Stored encodings
// ---------------------------------------------------------------------------------------------

/// How a quantised linear weight is stored; the raw checkpoint bytes, for a backend to upload as is
/// or to dequantise with [`QuantizedSource::dequantize`].
#[derive(Clone, Debug)]
pub enum QuantizedSource<'a> {
    Gptq(GptqSource<'a>),
    Fp8Block(Fp8BlockSource<'a>),
}

/// One GPTQ-packed linear (see the module docs for the layout).
#[derive(Clone, Debug)]
pub struct GptqSource<'a> {
    pub params: GptqParams,
    pub zero_format: ZeroFormat,
    /// `out` and `in` of the dequantised `[out, in]` weight.
    pub out_features: usize,
    pub in_features: usize,
    /// I32 `[in·bits/32, out]`.
    pub qweight: &'a [u8],
    /// I32 `[groups, out·bits/32]`; `None` only for symmetric weights stored without it.
    pub qzeros: Option<&'a [u8]>,
    /// `[groups, out]` in `scales_dtype`.
    pub scales: &'a [u8],
    pub scales_dtype: DType,
    /// I32 `[in]`, the group of each input row.
    pub g_idx: Option<&'a [u8]>,
}

/// One block-FP8 linear.
#[derive(Clone, Debug)]
pub struct Fp8BlockSource<'a> {
    /// `[rows, cols]` per scale block.
    pub block: [usize; 2],
    pub out_features: usize,
    pub in_features: usize,
    /// F8_E4M3 `[out, in]`.
    pub weight: &'a [u8],
    /// `[ceil(out/rows), ceil(in/cols)]` in `scale_dtype`.
    pub scale_inv: &'a [u8],
    pub scale_dtype: DType,
}

impl GptqParams {
    /// The number of groups for `in_features` input rows.
    pub fn groups(&self, in_features: usize) -> usize {
        in_features.div_ceil(self.group_size.unwrap_or(in_features).max(1))
    }
    /// Values per packed int32.
    pub fn pack(&self) -> usize {
        32 / self.bits as usize
    }
}

impl QuantizedSource<'_> {
    /// Every checkpoint byte the encoding reads (for progress accounting).
    pub fn byte_len(&self) -> usize {
        match self {
            Self::Gptq(g) => {
                g.qweight.len() + g.qzeros.map_or(0, <[u8]>::len) + g.scales.len() + g.g_idx.map_or(0, <[u8]>::len)
            }
            Self::Fp8Block(f) => f.weight.len() + f.scale_inv.len(),
        }
    }

    /// The dequantised `[out, in]` weight, row-major f32. `name` is used in errors.
    pub fn dequantize(&self, name: &str) -> Result<Vec<f32>, ModelError> {
        match self {
            Self::Gptq(g) => g.dequantize(name),
            Self::Fp8Block(f) => f.dequantize(name),
        }
    }
}

fn words(bytes: &[u8]) -> impl Iterator<Item = u32> + '_ {
    bytes.chunks_exact(4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
}

fn floats(name: &str, dtype: DType, bytes: &[u8]) -> Result<Vec<f32>, ModelError> {
    let mut out = Vec::with_capacity(bytes.len() / dtype.size().unwrap_or(1));
    TensorRef::bytes_to_f32(name, dtype, bytes, &mut out)?;
    Ok(out)
}

impl GptqSource<'_> {
    /// The group of every input row, validated.
    fn groups_of_rows(&self, name: &str) -> Result<Vec<usize>, ModelError> {
        let groups = self.params.groups(self.in_features);
        match self.g_idx {
            Some(bytes) => words(bytes)
                .enumerate()
                .map(|(i, g)| {
                    let g = g as i32;
                    if g < 0 || g as usize >= groups {
                        Err(ModelError::weights(format!(
                            "tensor `{name}` (GPTQ): g_idx[{i}] = {g} is outside the {groups} groups"
                        )))
                    } else {
                        Ok(g as usize)
                    }
                })
                .collect(),
            None => {
                let gs = self.params.group_size.unwrap_or(self.in_features);
                Ok((0..self.in_features).map(|i| i / gs).collect())
            }
        }
    }

    fn dequantize(&self, name: &str) -> Result<Vec<f32>, ModelError> {
        let (out_f, in_f) = (self.out_features, self.in_features);
        let bits = self.params.bits;
        let pack = self.params.pack();
        let mask = (1u32 << bits) - 1;
        let groups = self.params.groups(in_f);
        let gidx = self.groups_of_rows(name)?;
        let scales = floats(name, self.scales_dtype, self.scales)?;
        // Real zero of (group, out column), as i32.
        let zeros: Vec<i32> = if self.params.sym {
            vec![1i32 << (bits - 1); groups * out_f]
        } else {
            let qz = self
                .qzeros
                .ok_or_else(|| ModelError::weights(format!("tensor `{name}` (asymmetric GPTQ) has no qzeros")))?;
            let packed: Vec<u32> = words(qz).collect();
            let cols = out_f / pack;
            let off = self.zero_format.offset();
            (0..groups * out_f)
                .map(|k| {
                    let (g, o) = (k / out_f, k % out_f);
                    let w = packed[g * cols + o / pack];
                    ((w >> (bits as usize * (o % pack))) & mask) as i32 + off
                })
                .collect()
        };
        let mut out = vec![0f32; out_f * in_f];
        for (r, row) in self.qweight.chunks_exact(4 * out_f).enumerate() {
            for (o, w) in words(row).enumerate() {
                for k in 0..pack {
                    let i = r * pack + k;
                    let q = ((w >> (bits as usize * k)) & mask) as i32;
                    let gi = gidx[i] * out_f + o;
                    out[o * in_f + i] = (q - zeros[gi]) as f32 * scales[gi];
                }
            }
        }
        Ok(out)
    }
}

/// Decodes one FP8 e4m3fn byte (bias 7, no infinities; `S.1111.111` is NaN).
pub fn fp8_e4m3_to_f32(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0f32 } else { 1.0 };
    let e = ((b >> 3) & 0x0f) as i32;
    let m = (b & 0x07) as f32;
    if e == 0x0f && b & 0x07 == 0x07 {
        return f32::NAN;
    }
    if e == 0 { sign * m / 8.0 * 2f32.powi(-6) } else { sign * (1.0 + m / 8.0) * 2f32.powi(e - 7) }
}

/// Encodes `x` as an FP8 e4m3fn byte: round to nearest even, saturating at ±448 (what
/// `cvt.rn.satfinite.e4m3x2.f32` does); NaN gives the NaN code `S.1111.111`.
pub fn fp8_e4m3_from_f32(x: f32) -> u8 {
    let sign = ((x.to_bits() >> 24) & 0x80) as u8;
    let a = x.abs();
    if a.is_nan() {
        return sign | 0x7f;
    }
    if a >= 448.0 {
        return sign | 0x7e;
    }
    if a < 2f32.powi(-6) {
        // Subnormals: m · 2^-9, m = 0..8 (8 is the smallest normal, code 0x08); a · 512 is exact.
        return sign | (a * 512.0).round_ties_even() as u8;
    }
    let bits = a.to_bits();
    let e = ((bits >> 23) & 0xff) as i32 - 127; // -6..=8
    let (mant, rem) = ((bits & 0x7f_ffff) >> 20, bits & 0xf_ffff);
    let up = rem > 0x8_0000 || (rem == 0x8_0000 && mant & 1 == 1);
    // A mantissa carry moves to the next binade: the codes of one sign are contiguous.
    let code = (((e + 7) as u32) << 3) + mant + u32::from(up);
    sign | code.min(0x7e) as u8
}

/// Quantises `w [out, in]` (row-major) to block FP8: e4m3 codes `[out, in]` and one f32 scale per
/// `block[0] × block[1]` block (`[ceil(out / b0), ceil(in / b1)]`, row-major), `scale = amax / 448`
/// (1 for an all-zero block) and `code = e4m3(w / scale)`: the official `-FP8` checkpoints' layout
/// (`weight` and `weight_scale_inv`, `w ≈ code · scale`).
pub fn fp8_block_quantize(w: &[f32], out: usize, inp: usize, block: [usize; 2]) -> (Vec<u8>, Vec<f32>) {
    assert_eq!(w.len(), out * inp, "fp8_block_quantize: w is not [out, in]");
    let [bo, bi] = block;
    let (ob, ib) = (out.div_ceil(bo), inp.div_ceil(bi));
    let mut scales = vec![0f32; ob * ib];
    for (o, row) in w.chunks_exact(inp).enumerate() {
        for (i, v) in row.iter().enumerate() {
            let s = &mut scales[(o / bo) * ib + i / bi];
            *s = s.max(v.abs());
        }
    }
    for s in &mut scales {
        *s = if *s > 0.0 { *s / 448.0 } else { 1.0 };
    }
    let codes = w
        .chunks_exact(inp)
        .enumerate()
        .flat_map(|(o, row)| {
            let srow = &scales[(o / bo) * ib..(o / bo + 1) * ib];
            row.iter().enumerate().map(move |(i, &v)| fp8_e4m3_from_f32(v / srow[i / bi]))
        })
        .collect();
    (codes, scales)
}

impl Fp8BlockSource<'_> {
    /// The block scales as f32 `[ceil(out/rows), ceil(in/cols)]` (checked against that shape).
    pub fn scales_f32(&self, name: &str) -> Result<Vec<f32>, ModelError> {
        let s = floats(name, self.scale_dtype, self.scale_inv)?;
        let want = self.out_features.div_ceil(self.block[0]) * self.in_features.div_ceil(self.block[1]);
        if s.len() != want {
            return Err(ModelError::weights(format!("`{name}`: {} block scales, expected {want}", s.len())));
        }
        Ok(s)
    }

    fn dequantize(&self, name: &str) -> Result<Vec<f32>, ModelError> {
        let (out_f, in_f) = (self.out_features, self.in_features);
        let [bo, bi] = self.block;
        let scale_cols = in_f.div_ceil(bi);
        let scales = floats(name, self.scale_dtype, self.scale_inv)?;
        let lut: Vec<f32> = (0..=255u8).map(fp8_e4m3_to_f32).collect();
        let mut out = Vec::with_capacity(out_f * in_f);
        for (o, row) in self.weight.chunks_exact(in_f).enumerate() {
            let srow = &scales[(o / bo) * scale_cols..(o / bo + 1) * scale_cols];
            out.extend(row.iter().enumerate().map(|(i, &b)| lut[b as usize] * srow[i / bi]));
        }
        Ok(out)
    }
}

// ---------------------------------------------------------------------------------------------
// Resolution from a checkpoint
// ---------------------------------------------------------------------------------------------

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
