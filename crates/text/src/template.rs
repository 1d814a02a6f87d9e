//! Chat templates: `ChatTemplate` finds a model's Jinja chat template and renders it with an
//! environment that mirrors HF transformers' `apply_chat_template` (trim/lstrip blocks, loop
//! controls, Python-style `tojson`/`str`, `raise_exception`, `strftime_now`, pycompat methods).

use std::path::Path;

use minijinja::value::{Kwargs, Value};
use minijinja::{Environment, ErrorKind, State};
use serde_json::Map;

use crate::error::TextError;
use crate::pyjson::{DumpOptions, dumps, py_str};
use crate::pyloads::python_json_loads;
use crate::strftime::DateTime;

const TEMPLATE_NAME: &str = "chat_template";

/// Arguments of one render, as passed to HF `apply_chat_template(messages, tools=..,
/// add_generation_prompt=.., **kwargs)`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ChatRequest {
    pub messages: Vec<serde_json::Value>,
    pub tools: Option<Vec<serde_json::Value>>,
    pub add_generation_prompt: bool,
    /// Extra template variables (e.g. `enable_thinking`); they override the special tokens.
    pub kwargs: Map<String, serde_json::Value>,
}

/// A compiled chat template plus the special-token strings HF exposes to it.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// Special tokens passed to the template (`bos_token`, `eos_token`, ...), only those set.
    special: Map<String, serde_json::Value>,
    /// The template's text.
    source: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate").field("special", &self.special).finish()
    }
}

/// Error carried inside a minijinja error when the template calls `raise_exception`.
#[derive(Debug)]
struct Raised(String);

impl std::fmt::Display for Raised {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Raised {}

impl ChatTemplate {
    /// Compiles `source`. `bos_token`/`eos_token` become template variables when given.
    pub fn new(source: &str, bos_token: Option<String>, eos_token: Option<String>) -> Result<Self, TextError> {
        let mut special = Map::new();
        if let Some(b) = bos_token {
            special.insert("bos_token".into(), b.into());
        }
        if let Some(e) = eos_token {
            special.insert("eos_token".into(), e.into());
        }
        Self::with_special(source, special)
    }

    fn with_special(source: &str, special: Map<String, serde_json::Value>) -> Result<Self, TextError> {
        let mut env = hf_environment()?;
        env.add_template_owned(TEMPLATE_NAME, source.to_string())
            .map_err(|e| TextError::TemplateSyntax(error_chain(&e)))?;
        Ok(Self { env, special, source: source.to_string() })
    }

    /// Finds the template in a model directory: `chat_template.jinja`, else `chat_template.json`'s
    /// `chat_template`, else `tokenizer_config.json`'s `chat_template` (a string, or a list of
    /// `{name, template}` from which "default" is taken). Special-token strings (`bos_token`,
    /// `eos_token`, `pad_token`, `unk_token`) come from `tokenizer_config.json`. `Ok(None)` if the
    /// directory has no template.
    pub fn from_dir(dir: &Path) -> Result<Option<Self>, TextError> {
        let config_path = dir.join("tokenizer_config.json");
        let config = if config_path.is_file() { Some(read_json(&config_path)?) } else { None };
        let mut special = Map::new();
        if let Some(cfg) = &config {
            for field in ["bos_token", "eos_token", "pad_token", "unk_token"] {
                if let Some(tok) = token_string(&config_path, cfg, field)? {
                    special.insert(field.to_string(), tok.into());
                }
            }
        }

        let jinja_path = dir.join("chat_template.jinja");
        let source = if jinja_path.is_file() {
            Some(read_text(&jinja_path)?)
        } else if dir.join("chat_template.json").is_file() {
            let path = dir.join("chat_template.json");
            let value = read_json(&path)?;
            template_field(&path, &value)?
        } else if let Some(cfg) = &config {
            template_field(&config_path, cfg)?
        } else {
            None
        };
        match source {
            Some(src) => Self::with_special(&src, special).map(Some),
            None => Ok(None),
        }
    }

    /// The template's source text, as the model directory holds it.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// A special-token string the template sees (`bos_token`, `eos_token`, ...), when set.
    pub fn special_token(&self, name: &str) -> Option<&str> {
        self.special.get(name).and_then(|v| v.as_str())
    }

    /// Renders like HF `apply_chat_template(..., tokenize=False)`.
    pub fn render(&self, req: &ChatRequest) -> Result<String, TextError> {
        let mut ctx = self.special.clone();
        ctx.insert("tools".into(), req.tools.clone().map(serde_json::Value::Array).unwrap_or(serde_json::Value::Null));
        ctx.insert("documents".into(), serde_json::Value::Null);
        ctx.insert("add_generation_prompt".into(), req.add_generation_prompt.into());
        for (k, v) in &req.kwargs {
            ctx.insert(k.clone(), v.clone());
        }
        let mut ctx: Vec<(String, Value)> =
            ctx.into_iter().map(|(k, v)| (k, Value::from(minijinja::value::Serde(&v)))).collect();
        ctx.push(("messages".into(), Value::from(req.messages.iter().map(message_value).collect::<Vec<_>>())));
        let tmpl = self.env.get_template(TEMPLATE_NAME).map_err(|e| TextError::TemplateRender(error_chain(&e)))?;
        tmpl.render(Value::from_pairs(ctx)).map_err(|e| match raised_message(&e) {
            Some(msg) => TextError::TemplateRaised(msg),
            None => TextError::TemplateRender(error_chain(&e)),
        })
    }
}

/// A message as a template value. Tool-call `arguments` given as a JSON string (the OpenAI wire
/// form) are read as Python's `json.loads` reads them, as the reference server does before it
/// renders; a string that is not JSON stays a string (the template decides what to do with it).
fn message_value(m: &serde_json::Value) -> Value {
    fn with_key(v: &serde_json::Value, key: &str, f: &dyn Fn(&serde_json::Value) -> Value) -> Value {
        match v.as_object() {
            Some(o) if o.contains_key(key) => Value::from_pairs(
                o.iter()
                    .map(|(k, x)| (k.clone(), if k == key { f(x) } else { Value::from(minijinja::value::Serde(x)) })),
            ),
            _ => Value::from(minijinja::value::Serde(v)),
        }
    }
    fn arguments(a: &serde_json::Value) -> Value {
        match a.as_str() {
            Some(s) => python_json_loads(s).unwrap_or_else(|_| Value::from(s)),
            None => Value::from(minijinja::value::Serde(a)),
        }
    }
    fn call(c: &serde_json::Value) -> Value {
        match c.get("function") {
            Some(_) => with_key(c, "function", &|f| with_key(f, "arguments", &arguments)),
            None => with_key(c, "arguments", &arguments),
        }
    }
    with_key(m, "tool_calls", &|calls| match calls.as_array() {
        Some(list) => Value::from(list.iter().map(call).collect::<Vec<_>>()),
        None => Value::from(minijinja::value::Serde(calls)),
    })
}

/// The environment HF builds in `_compile_jinja_template`, in minijinja terms.
fn hf_environment() -> Result<Environment<'static>, TextError> {
    let mut env = Environment::new();
    let syntax = minijinja::syntax::SyntaxConfig::builder()
        .trim_blocks(true)
        .lstrip_blocks(true)
        .build()
        .map_err(|e| TextError::TemplateSyntax(e.to_string()))?;
    env.set_syntax(syntax);
    env.set_auto_escape_callback(|_| minijinja::AutoEscape::None);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    // Python prints None/True/1e+16 where minijinja would print none/true/1e16.
    env.set_formatter(|out, _state, value| {
        if let Some(s) = value.as_str() {
            out.write_str(s)?;
        } else {
            out.write_str(&py_str(value))?;
        }
        Ok(())
    });
    env.add_filter("tojson", tojson);
    env.add_filter("string", |v: Value| -> Value {
        if v.as_str().is_some() { v } else { Value::from(py_str(&v)) }
    });
    env.add_function("raise_exception", |msg: Value| -> Result<Value, minijinja::Error> {
        let msg = py_str(&msg);
        Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg.clone()).with_source(Raised(msg)))
    });
    env.add_function("strftime_now", |fmt: String| DateTime::now().format(&fmt));
    Ok(env)
}

/// HF's `tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`.
fn tojson(_state: &State, value: &Value, indent_pos: Option<Value>, kwargs: Kwargs) -> Result<Value, minijinja::Error> {
    let ensure_ascii = kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false);
    let indent_val = match indent_pos {
        Some(v) => Some(v),
        None => kwargs.get::<Option<Value>>("indent")?,
    };
    let indent = match indent_val {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => match v.as_str() {
            Some(s) => Some(s.to_string()),
            None => {
                let n = i64::try_from(v.clone()).map_err(|_| {
                    minijinja::Error::new(ErrorKind::InvalidOperation, "tojson: indent must be an int or str")
                })?;
                Some(" ".repeat(n.max(0) as usize))
            }
        },
    };
    let separators = match kwargs.get::<Option<Value>>("separators")? {
        Some(v) if !v.is_none() => {
            let parts: Vec<Value> = v.try_iter()?.collect();
            match parts.as_slice() {
                [a, b] if a.as_str().is_some() && b.as_str().is_some() => {
                    Some((a.as_str().unwrap_or_default().to_string(), b.as_str().unwrap_or_default().to_string()))
                }
                _ => {
                    return Err(minijinja::Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: separators must be a pair of strings",
                    ));
                }
            }
        }
        _ => None,
    };
    let sort_keys = kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false);
    kwargs.assert_all_used()?;
    let opts = DumpOptions::new(ensure_ascii, indent, separators, sort_keys);
    Ok(Value::from_safe_string(dumps(value, &opts)?))
}

fn raised_message(err: &minijinja::Error) -> Option<String> {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(err);
    while let Some(e) = cur {
        if let Some(r) = e.downcast_ref::<Raised>() {
            return Some(r.0.clone());
        }
        cur = e.source();
    }
    None
}

fn error_chain(err: &minijinja::Error) -> String {
    let mut msg = err.to_string();
    let mut cur = std::error::Error::source(err);
    while let Some(e) = cur {
        msg.push_str(": ");
        msg.push_str(&e.to_string());
        cur = e.source();
    }
    msg
}

fn read_text(path: &Path) -> Result<String, TextError> {
    std::fs::read_to_string(path).map_err(|source| TextError::Io { path: path.to_path_buf(), cause: source })
}

fn read_json(path: &Path) -> Result<serde_json::Value, TextError> {
    let text = read_text(path)?;
    serde_json::from_str(&text).map_err(|source| TextError::Json { path: path.to_path_buf(), cause: source })
}

fn field_error(path: &Path, field: &str, message: &str) -> TextError {
    TextError::ConfigField { path: path.to_path_buf(), field: field.to_string(), message: message.to_string() }
}

/// A special token given as a string or as `{"content": ...}`; null/absent gives `None`.
fn token_string(path: &Path, cfg: &serde_json::Value, field: &str) -> Result<Option<String>, TextError> {
    match cfg.get(field) {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(serde_json::Value::String(s)) => Ok(Some(s.clone())),
        Some(serde_json::Value::Object(o)) => match o.get("content") {
            Some(serde_json::Value::String(s)) => Ok(Some(s.clone())),
            _ => Err(field_error(path, field, "object without a string `content`")),
        },
        Some(_) => Err(field_error(path, field, "expected a string, an object with `content`, or null")),
    }
}

/// `chat_template` as a string, or a list of `{name, template}` (the "default" entry).
fn template_field(path: &Path, cfg: &serde_json::Value) -> Result<Option<String>, TextError> {
    match cfg.get("chat_template") {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(serde_json::Value::String(s)) => Ok(Some(s.clone())),
        Some(serde_json::Value::Array(list)) => {
            for entry in list {
                let name = entry.get("name").and_then(|n| n.as_str());
                if name == Some("default") {
                    return match entry.get("template") {
                        Some(serde_json::Value::String(s)) => Ok(Some(s.clone())),
                        _ => Err(field_error(path, "chat_template", "entry \"default\" has no string `template`")),
                    };
                }
            }
            Err(field_error(path, "chat_template", "list has no entry named \"default\""))
        }
        Some(_) => Err(field_error(path, "chat_template", "expected a string or a list of {name, template}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn string_tool_arguments_render_as_python_reads_them() {
        let t = ChatTemplate::new(crate::QWEN35_CHAT_TEMPLATE, None, Some("<|im_end|>".into())).unwrap();
        let args = r#"{"id": 123456789012345678901234567890, "z": -0, "far": 1e400, "neg": -0.0, "list": [1e400, -0, 18446744073709551616]}"#;
        let req = ChatRequest {
            messages: vec![
                serde_json::json!({"role": "user", "content": "go"}),
                serde_json::json!({"role": "assistant", "content": "", "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": args}}]}),
            ],
            ..Default::default()
        };
        let out = t.render(&req).unwrap();
        // What transformers renders after json.loads: str() for scalars, json.dumps for lists.
        for want in [
            "<parameter=id>\n123456789012345678901234567890\n</parameter>",
            "<parameter=z>\n0\n</parameter>",
            "<parameter=far>\ninf\n</parameter>",
            "<parameter=neg>\n-0.0\n</parameter>",
            "<parameter=list>\n[Infinity, 0, 18446744073709551616]\n</parameter>",
        ] {
            assert!(out.contains(want), "{want:?} not in {out}");
        }
        // A string that is not JSON still reaches the template, which refuses it.
        let mut bad = req.clone();
        bad.messages[1]["tool_calls"][0]["function"]["arguments"] = serde_json::json!("not json");
        assert!(matches!(t.render(&bad), Err(TextError::TemplateRaised(_))));
    }
}
