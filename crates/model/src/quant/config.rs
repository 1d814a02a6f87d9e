//! The `quantization_config` of `config.json`: the supported formats and their parameters, parsed with
//! errors that name the field.

use std::collections::BTreeMap;

use serde_json::{Map, Value};

use crate::error::ModelError;

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
