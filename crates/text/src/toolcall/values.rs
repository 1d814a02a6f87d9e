//! Tool-call argument values typed by the tool's JSON schema: a parameter's declared type (string,
//! integer, number, boolean, JSON, nullable), the conversion of the model's raw value text to that JSON
//! value, the parameter schemas of a request's tools, and the JSON call form some fine-tunes write.

use serde_json::{Map, Number, Value};

use super::valid_function_name;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    String,
    Integer,
    Number,
    Boolean,
    Json,
    Null,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct ParamType {
    pub(super) kind: Kind,
    pub(super) nullable: bool,
}

pub(super) const PLAIN_STRING: ParamType = ParamType { kind: Kind::String, nullable: false };

fn kind_of(name: &str) -> Option<Kind> {
    let n = name.trim().to_ascii_lowercase();
    Some(match n.as_str() {
        "null" => return None,
        "string" | "str" | "text" | "enum" => Kind::String,
        "integer" | "int" => Kind::Integer,
        "number" | "float" | "double" => Kind::Number,
        "boolean" | "bool" => Kind::Boolean,
        "object" | "array" | "dict" | "list" => Kind::Json,
        _ => Kind::String,
    })
}

/// Resolve the type of one property schema.
pub(super) fn param_type(schema: &Value) -> ParamType {
    let mut nullable = false;
    let mut kind = None;
    match schema.get("type") {
        Some(Value::String(t)) => match kind_of(t) {
            Some(k) => kind = Some(k),
            None => {
                nullable = true;
                kind = Some(Kind::Null);
            }
        },
        Some(Value::Array(ts)) => {
            for t in ts.iter().filter_map(Value::as_str) {
                match kind_of(t) {
                    None => nullable = true,
                    Some(k) => {
                        kind.get_or_insert(k);
                    }
                }
            }
        }
        _ => {
            for key in ["anyOf", "oneOf"] {
                if let Some(Value::Array(alts)) = schema.get(key) {
                    for alt in alts {
                        let t = param_type(alt);
                        nullable |= t.nullable;
                        if t.kind != Kind::Null {
                            kind.get_or_insert(t.kind);
                        }
                    }
                }
            }
        }
    }
    ParamType { kind: kind.unwrap_or(if nullable { Kind::Null } else { Kind::String }), nullable }
}

/// Convert a raw parameter value by its schema type.
pub(super) fn convert(raw: &str, ty: ParamType) -> Value {
    let t = raw.trim();
    let null_like = t.eq_ignore_ascii_case("null") || t == "None";
    if null_like && (ty.nullable || ty.kind != Kind::String) {
        return Value::Null;
    }
    let string = || Value::String(raw.to_string());
    match ty.kind {
        Kind::String | Kind::Null => string(),
        Kind::Integer => {
            if let Ok(i) = t.parse::<i64>() {
                Value::Number(i.into())
            } else if let Ok(u) = t.parse::<u64>() {
                Value::Number(u.into())
            } else {
                match t.parse::<f64>() {
                    Ok(f) if f.is_finite() && f.fract() == 0.0 && f.abs() < 9.0e15 => Value::Number((f as i64).into()),
                    _ => string(),
                }
            }
        }
        Kind::Number => {
            if let Ok(n) = serde_json::from_str::<Number>(t) {
                Value::Number(n)
            } else {
                let looks_numeric = t.chars().all(|c| c.is_ascii_digit() || matches!(c, '+' | '-' | '.' | 'e' | 'E'));
                match t.parse::<f64>() {
                    Ok(f) if looks_numeric => Number::from_f64(f).map_or_else(string, Value::Number),
                    _ => string(),
                }
            }
        }
        Kind::Boolean => {
            if t.eq_ignore_ascii_case("true") {
                Value::Bool(true)
            } else if t.eq_ignore_ascii_case("false") {
                Value::Bool(false)
            } else {
                string()
            }
        }
        Kind::Json => serde_json::from_str::<Value>(t).unwrap_or_else(|_| string()),
    }
}

/// Parameter schemas (`properties`) of one function.
#[derive(Debug, Clone, Default)]
pub(super) struct FunctionSchema {
    pub(super) properties: Map<String, Value>,
}

pub(super) fn function_schemas(tools: &[Value]) -> Vec<(String, FunctionSchema)> {
    let mut out = Vec::new();
    for tool in tools {
        let f = tool.get("function").unwrap_or(tool);
        let Some(name) = f.get("name").and_then(Value::as_str) else {
            continue;
        };
        let params = f.get("parameters").or_else(|| f.get("input_schema"));
        let properties =
            params.and_then(|p| p.get("properties")).and_then(Value::as_object).cloned().unwrap_or_default();
        out.push((name.to_string(), FunctionSchema { properties }));
    }
    out
}

/// A call in the JSON form some Qwen fine-tunes write inside `<tool_call>`: `{"name": NAME,
/// "arguments": OBJECT}` (`parameters` is accepted for `arguments`, and the arguments may be a
/// JSON string holding the object). Returns the name and the arguments' JSON text.
pub(super) fn json_call(body: &str) -> Option<(String, String)> {
    let Value::Object(call) = serde_json::from_str::<Value>(body.trim()).ok()? else { return None };
    let name = call.get("name").and_then(Value::as_str).filter(|n| valid_function_name(n))?;
    let args = match call.get("arguments").or_else(|| call.get("parameters")) {
        None | Some(Value::Null) => Value::Object(Map::new()),
        Some(v @ Value::Object(_)) => v.clone(),
        Some(Value::String(s)) => serde_json::from_str::<Value>(s).ok().filter(Value::is_object)?,
        Some(_) => return None,
    };
    Some((name.to_string(), serde_json::to_string(&args).ok()?))
}
