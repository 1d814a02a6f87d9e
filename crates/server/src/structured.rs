//! Structured outputs for the HTTP APIs: `response_format` and forced `tool_choice` (OpenAI and
//! Anthropic) read into a [`Grammar`], compiled before any work is queued (a 400 naming the field
//! when it does not compile), and handed to the engine as a token constraint that starts after the
//! reasoning block when thinking is on.

use std::sync::{Arc, OnceLock};

use deltaserve_engine::{SharedConstraint, TokenConstraint};
use deltaserve_text::{Grammar, GrammarCompiler, GrammarMatcher};
use serde_json::Value;

use crate::error::ApiError;
use crate::output::Parsing;
use crate::request::CommonParams;
use crate::state::AppState;

/// The model's grammar compiler, built on first use (it indexes the whole vocabulary once).
#[derive(Clone, Default)]
pub struct Grammars(Arc<OnceLock<Result<GrammarCompiler, String>>>);

impl std::fmt::Debug for Grammars {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Grammars")
    }
}

/// OpenAI `response_format`: `text` (none), `json_object`, `json_schema` (`strict` or not: the
/// schema is always enforced).
pub fn response_format(rf: Option<&Value>) -> Result<Option<Grammar>, ApiError> {
    let Some(rf) = rf else { return Ok(None) };
    let bad = |m: &str| ApiError::bad_param("response_format", m.to_string());
    match rf.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(Grammar::JsonObject)),
        Some("json_schema") => {
            let schema = rf
                .get("json_schema")
                .and_then(|j| j.get("schema"))
                .ok_or_else(|| bad("response_format.json_schema.schema is missing"))?;
            if !schema.is_object() && !schema.is_boolean() {
                return Err(bad("response_format.json_schema.schema must be a JSON schema object"));
            }
            Ok(Some(Grammar::JsonSchema(schema.clone())))
        }
        Some(other) => {
            Err(bad(&format!("response_format type `{other}` is not supported (text, json_object, json_schema)")))
        }
        None => Err(bad("response_format needs a `type` (text, json_object, json_schema)")),
    }
}

/// vLLM's structured-output extras: `guided_json` (a schema, as an object or JSON text),
/// `guided_regex`, `guided_choice`, and `structured_outputs` with one of `json`, `regex`, `choice`,
/// `json_object`; each read into a [`Grammar`], with the field that set it. `guided_grammar`,
/// `guided_whitespace_pattern` and other `structured_outputs` keys are refused with a 400 naming
/// them; `guided_decoding_backend` is ignored (llguidance is the one backend).
pub fn guided(c: &CommonParams) -> Result<Option<(Grammar, &'static str)>, ApiError> {
    let given = |v: &Option<Value>| v.clone().filter(|v| !v.is_null());
    for (field, v) in
        [("guided_grammar", &c.guided_grammar), ("guided_whitespace_pattern", &c.guided_whitespace_pattern)]
    {
        if given(v).is_some() {
            return Err(ApiError::bad_param(
                field,
                format!(
                    "`{field}` is not supported (guided_json, guided_regex, guided_choice and structured_outputs \
                     json / regex / choice / json_object are)"
                ),
            ));
        }
    }
    let mut found = Vec::new();
    for (field, v) in
        [("guided_json", &c.guided_json), ("guided_regex", &c.guided_regex), ("guided_choice", &c.guided_choice)]
    {
        if let Some(v) = given(v) {
            found.push((guided_grammar(field.trim_start_matches("guided_"), v, field)?, field));
        }
    }
    if let Some(so) = given(&c.structured_outputs) {
        const FIELD: &str = "structured_outputs";
        let obj = so.as_object().ok_or_else(|| ApiError::bad_param(FIELD, "`structured_outputs` must be an object"))?;
        let set: Vec<(&String, &Value)> =
            obj.iter().filter(|(_, v)| !v.is_null() && **v != Value::Bool(false)).collect();
        let [(key, v)] = set[..] else {
            return Err(ApiError::bad_param(
                FIELD,
                "`structured_outputs` needs exactly one of json, regex, choice, json_object",
            ));
        };
        found.push((guided_grammar(key, v.clone(), FIELD)?, FIELD));
    }
    if found.len() > 1 {
        return Err(ApiError::bad_param(found[1].1, "only one structured-output field may be given"));
    }
    Ok(found.pop())
}

/// One structured-output request: `kind` (`json`, `regex`, `choice`, `json_object`) with `value`.
fn guided_grammar(kind: &str, value: Value, field: &str) -> Result<Grammar, ApiError> {
    let bad = |m: String| ApiError::bad_param(field, m);
    match (kind, value) {
        ("json", Value::String(text)) => {
            let schema: Value =
                serde_json::from_str(&text).map_err(|e| bad(format!("`{field}` is not a JSON schema: {e}")))?;
            guided_grammar("json", schema, field)
        }
        ("json", schema @ (Value::Object(_) | Value::Bool(_))) => Ok(Grammar::JsonSchema(schema)),
        ("regex", Value::String(rx)) => Ok(Grammar::Regex(rx)),
        ("choice", Value::Array(items)) => items
            .into_iter()
            .map(|v| match v {
                Value::String(s) => Ok(s),
                other => Err(bad(format!("`{field}` must list strings, got {other}"))),
            })
            .collect::<Result<Vec<_>, _>>()
            .map(Grammar::Choice),
        ("json_object", Value::Bool(true)) => Ok(Grammar::JsonObject),
        ("json" | "regex" | "choice" | "json_object", v) => Err(bad(format!("`{field}`: {kind} cannot be {v}"))),
        (other, _) => Err(bad(format!("`{field}.{other}` is not supported (json, regex, choice and json_object are)"))),
    }
}

/// The tool of `tools` named `name` (OpenAI `function` objects or Anthropic tools).
fn named_tool(tools: &[Value], name: &str) -> Option<Value> {
    tools.iter().find(|t| t.get("function").unwrap_or(t).get("name").and_then(Value::as_str) == Some(name)).cloned()
}

/// A forced tool call to any of `tools` (`name` None) or to the one named, which must be in
/// `tools`; several calls when `parallel`.
pub fn forced_tool_call(tools: Option<&[Value]>, name: Option<&str>, parallel: bool) -> Result<Grammar, ApiError> {
    let tools = tools.filter(|t| !t.is_empty()).ok_or_else(|| {
        ApiError::bad_param("tool_choice", "tool_choice forces a tool call, but the request has no `tools`")
    })?;
    match name {
        None => Ok(Grammar::ToolCalls { tools: tools.to_vec(), at_most_one: !parallel }),
        Some(n) => {
            let tool = named_tool(tools, n).ok_or_else(|| {
                ApiError::bad_param("tool_choice", format!("tool_choice names `{n}`, which is not in `tools`"))
            })?;
            Ok(Grammar::ToolCalls { tools: vec![tool], at_most_one: !parallel })
        }
    }
}

/// The engine constraint for `grammar` (a 400 naming `field` when it does not compile). When the
/// prompt opened `<think>` (`parsing.reasoning`), tokens are free until `</think>`. Under a
/// tool-call grammar, `parsing` reads parameter values where the grammar ends them.
pub fn constraint(
    st: &AppState,
    grammar: &Grammar,
    field: &str,
    parsing: &mut Parsing,
) -> Result<SharedConstraint, ApiError> {
    let thinking = parsing.reasoning == Some(true);
    let compiler = st
        .grammars
        .0
        .get_or_init(|| GrammarCompiler::new(st.tokenizer.clone(), st.tokenizer.vocab_size(), &st.eos_ids))
        .as_ref()
        .map_err(|e| ApiError::bad_param(field, format!("structured outputs are not available: {e}")))?;
    let matcher = compiler
        .compile(grammar)
        .map_err(|e| ApiError::bad_param(field, format!("`{field}` cannot be compiled into a grammar: {e}")))?;
    let think_end = if thinking { st.tokenizer.token_id("</think>") } else { None };
    parsing.grammar_values = matches!(grammar, Grammar::ToolCalls { .. });
    Ok(SharedConstraint::new(GrammarConstraint::new(matcher, think_end, st.eos_ids.clone())))
}

/// A reply under a grammar: free while reasoning, then masked; when the grammar fails or admits
/// nothing further, only the end-of-turn tokens are allowed (the reply ends with `stop`).
pub struct GrammarConstraint {
    matcher: GrammarMatcher,
    /// While reasoning: the `</think>` id that starts the grammar.
    think_end: Option<u32>,
    eos: Vec<u32>,
}

impl GrammarConstraint {
    /// The constraint of one reply under `matcher`'s grammar; with `think_end`, tokens are free until
    /// that id (the end of the reasoning block); `eos`: the end-of-turn ids.
    pub fn new(matcher: GrammarMatcher, think_end: Option<u32>, eos: Vec<u32>) -> Self {
        Self { matcher, think_end, eos }
    }
}

impl TokenConstraint for GrammarConstraint {
    fn mask(&mut self, row: &mut [f32]) {
        if self.think_end.is_some() {
            return;
        }
        if !self.matcher.mask(row) {
            for (id, l) in row.iter_mut().enumerate() {
                if !self.eos.contains(&(id as u32)) {
                    *l = f32::NEG_INFINITY;
                }
            }
        }
    }

    fn allowed(&mut self, bits: &mut [u32]) {
        if self.think_end.is_some() {
            bits.fill(u32::MAX);
            return;
        }
        if !self.matcher.allowed(bits) {
            bits.fill(0);
            for &id in &self.eos {
                if let Some(w) = bits.get_mut(id as usize / 32) {
                    *w |= 1 << (id % 32);
                }
            }
        }
    }

    fn allows_prefix(&mut self, tokens: &[u32]) -> Option<usize> {
        // While reasoning every token is free, up to and including `</think>`.
        let start = match self.think_end {
            None => 0,
            Some(end) => match tokens.iter().position(|&t| t == end) {
                None => return Some(tokens.len()),
                Some(i) => i + 1,
            },
        };
        Some(start + self.matcher.allows_prefix(&tokens[start..]))
    }

    fn fork(&self) -> Option<SharedConstraint> {
        Some(SharedConstraint::new(GrammarConstraint {
            matcher: self.matcher.fork(),
            think_end: self.think_end,
            eos: self.eos.clone(),
        }))
    }

    fn accept(&mut self, token: u32) {
        match self.think_end {
            Some(end) if token == end => self.think_end = None,
            Some(_) => {}
            None => {
                if let Err(e) = self.matcher.accept(token) {
                    tracing::debug!(error = %e, token, "a token outside the grammar; the reply ends");
                }
            }
        }
    }
}

/// vLLM's `allowed_token_ids`: the reply's tokens come from these ids only (as a token mask, on the
/// device where the backend applies masks); the end of sequence only where the list holds it.
#[derive(Clone)]
pub struct AllowedTokens {
    /// Bit `id % 32` of word `id / 32` set for an allowed id.
    bits: Vec<u32>,
}

impl AllowedTokens {
    /// The constraint allowing `ids` (each below `vocab`).
    pub fn new(ids: &[u32], vocab: usize) -> Self {
        let mut bits = vec![0u32; vocab.div_ceil(32)];
        for &id in ids {
            bits[id as usize / 32] |= 1 << (id % 32);
        }
        Self { bits }
    }

    fn allows(&self, id: u32) -> bool {
        self.bits.get(id as usize / 32).is_some_and(|w| (w >> (id % 32)) & 1 == 1)
    }
}

impl TokenConstraint for AllowedTokens {
    fn mask(&mut self, row: &mut [f32]) {
        for (id, l) in row.iter_mut().enumerate() {
            if !self.allows(id as u32) {
                *l = f32::NEG_INFINITY;
            }
        }
    }

    fn allowed(&mut self, bits: &mut [u32]) {
        bits.fill(0);
        let n = bits.len().min(self.bits.len());
        bits[..n].copy_from_slice(&self.bits[..n]);
    }

    fn allows_prefix(&mut self, tokens: &[u32]) -> Option<usize> {
        Some(tokens.iter().take_while(|&&t| self.allows(t)).count())
    }

    fn fork(&self) -> Option<SharedConstraint> {
        Some(SharedConstraint::new(self.clone()))
    }

    fn accept(&mut self, _token: u32) {}
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Style;
    use serde_json::json;

    fn param(e: &ApiError) -> Value {
        e.body(Style::OpenAi)["error"]["param"].clone()
    }

    #[test]
    fn response_format_and_tool_choice_fields() {
        assert_eq!(response_format(None).unwrap(), None);
        assert_eq!(response_format(Some(&json!({"type": "text"}))).unwrap(), None);
        assert_eq!(response_format(Some(&json!({"type": "json_object"}))).unwrap(), Some(Grammar::JsonObject));
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        let rf = json!({"type": "json_schema", "json_schema": {"name": "x", "strict": true, "schema": schema}});
        assert_eq!(response_format(Some(&rf)).unwrap(), Some(Grammar::JsonSchema(schema)));
        for bad in [json!({"type": "json_schema"}), json!({"type": "xml"}), json!({})] {
            assert_eq!(param(&response_format(Some(&bad)).unwrap_err()), "response_format");
        }
        let tools = vec![json!({"type": "function", "function": {"name": "get_weather"}})];
        assert!(matches!(
            forced_tool_call(Some(&tools), Some("get_weather"), false),
            Ok(Grammar::ToolCalls { at_most_one: true, .. })
        ));
        let err = forced_tool_call(Some(&tools), Some("nope"), true).unwrap_err();
        assert!(err.message().contains("`nope`") && param(&err) == "tool_choice");
        assert!(forced_tool_call(None, None, true).is_err());
    }

    #[test]
    fn guided_fields() {
        let parse = |v: Value| guided(&serde_json::from_value::<CommonParams>(v).unwrap());
        assert_eq!(parse(json!({"guided_decoding_backend": "xgrammar"})).unwrap(), None);
        let schema = json!({"type": "object"});
        assert_eq!(
            parse(json!({"guided_json": schema.to_string()})).unwrap(),
            Some((Grammar::JsonSchema(schema.clone()), "guided_json"))
        );
        assert_eq!(
            parse(json!({"guided_choice": ["a", "b"]})).unwrap(),
            Some((Grammar::Choice(vec!["a".into(), "b".into()]), "guided_choice"))
        );
        assert_eq!(
            parse(json!({"structured_outputs": {"regex": "[0-9]+"}})).unwrap(),
            Some((Grammar::Regex("[0-9]+".into()), "structured_outputs"))
        );
        assert_eq!(
            parse(json!({"structured_outputs": {"json_object": true}})).unwrap(),
            Some((Grammar::JsonObject, "structured_outputs"))
        );
        for (body, field) in [
            (json!({"guided_grammar": "root ::= \"a\""}), "guided_grammar"),
            (json!({"guided_whitespace_pattern": " "}), "guided_whitespace_pattern"),
            (json!({"guided_choice": [1]}), "guided_choice"),
            (json!({"guided_json": "{"}), "guided_json"),
            (json!({"structured_outputs": {"grammar": "x"}}), "structured_outputs"),
            (json!({"structured_outputs": {"regex": "a", "choice": ["a"]}}), "structured_outputs"),
            (json!({"guided_regex": "a", "guided_choice": ["a"]}), "guided_choice"),
        ] {
            assert_eq!(param(&parse(body.clone()).unwrap_err()), field, "{body}");
        }
    }
}
