//! Structured outputs: grammars (a JSON schema, any JSON object, or the model's own XML tool-call
//! syntax for a set of tools) compiled with llguidance against the model's vocabulary, and a
//! per-reply [`GrammarMatcher`] that masks a logits row to the tokens the grammar allows next and
//! follows the tokens emitted.

use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{self, TokEnv, TokRxInfo, TokTrie, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use serde_json::Value;

use crate::Tokenizer;
use crate::bytelevel;

/// What a reply must match.
#[derive(Clone, Debug, PartialEq)]
pub enum Grammar {
    /// JSON text valid for this schema.
    JsonSchema(Value),
    /// Any JSON object.
    JsonObject,
    /// One or more tool calls in the Qwen3 XML syntax (`<tool_call>` / `<function=NAME>` /
    /// `<parameter=NAME>`), each to one of these tools (OpenAI `function` objects or Anthropic
    /// tools: `name` plus `parameters` / `input_schema`), with values valid for its schema.
    ToolCalls { tools: Vec<Value>, at_most_one: bool },
    /// Text matching this regular expression (Rust `regex` syntax, anchored at both ends).
    Regex(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
}

/// Compiles grammars for one tokenizer (built once per model: it indexes the vocabulary).
pub struct GrammarCompiler {
    factory: Arc<ParserFactory>,
}

impl std::fmt::Debug for GrammarCompiler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarCompiler").finish_non_exhaustive()
    }
}

/// The vocabulary as llguidance sees it: each id's bytes; special added tokens are marked (so no
/// grammar text can produce them) and the end of a reply is `eos`.
struct Vocabulary {
    trie: TokTrie,
    tokenizer: Arc<Tokenizer>,
}

impl TokenizerEnv for Vocabulary {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<toktrie::TokenId> {
        match std::str::from_utf8(s) {
            Ok(text) => self.tokenizer.encode(text).unwrap_or_else(|_| self.trie.greedy_tokenize(s)),
            Err(_) => self.trie.greedy_tokenize(s),
        }
    }
}

impl GrammarCompiler {
    /// Indexes `tokenizer`'s vocabulary, `vocab_size` ids wide (the model's logits row: ids past the
    /// tokenizer's are never allowed); `eos` ends a reply (the chat's end-of-turn tokens).
    pub fn new(tokenizer: Arc<Tokenizer>, vocab_size: usize, eos: &[u32]) -> Result<Self, String> {
        let first_eos = *eos.first().ok_or("no end-of-turn token to end a constrained reply with")?;
        let mut words = Vec::with_capacity(vocab_size);
        for id in 0..vocab_size as u32 {
            let mut bytes = Vec::new();
            if let Some(token) = tokenizer.id_to_token(id) {
                if tokenizer.is_special(&token) {
                    bytes.push(TokTrie::SPECIAL_TOKEN_MARKER);
                    bytes.extend_from_slice(token.as_bytes());
                } else if tokenizer.is_byte_level() && !tokenizer.is_added(&token) {
                    bytelevel::token_bytes(&token, &mut bytes);
                } else {
                    bytes.extend_from_slice(tokenizer.decode(&[id], false).unwrap_or_default().as_bytes());
                }
            }
            words.push(bytes);
        }
        let info = TokRxInfo::new(vocab_size as u32, first_eos);
        let trie = TokTrie::from(&info, &words).with_eos_tokens(eos);
        let env: TokEnv = Arc::new(Vocabulary { trie, tokenizer });
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| e.to_string())?;
        factory.quiet();
        Ok(Self { factory: Arc::new(factory) })
    }

    /// A matcher for one reply, or why the grammar does not compile.
    pub fn compile(&self, grammar: &Grammar) -> Result<GrammarMatcher, String> {
        let top = match grammar {
            Grammar::JsonSchema(schema) => TopLevelGrammar::from_json_schema(compact(schema)),
            Grammar::JsonObject => TopLevelGrammar::from_json_schema(compact(&serde_json::json!({"type": "object"}))),
            Grammar::ToolCalls { tools, at_most_one } => {
                TopLevelGrammar::from_lark(tool_call_lark(tools, *at_most_one)?)
            }
            Grammar::Regex(rx) => TopLevelGrammar::from_regex(rx),
            Grammar::Choice(choices) if choices.is_empty() => return Err("no choices to pick from".into()),
            Grammar::Choice(choices) => {
                let alts: Vec<String> = choices.iter().map(|c| lark_str(c)).collect();
                TopLevelGrammar::from_lark(format!("start: {}\n", alts.join(" | ")))
            }
        };
        let parser = self.factory.create_parser(top).map_err(|e| e.to_string())?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(e);
        }
        let vocab = self.factory.tok_env().tok_trie().vocab_size();
        Ok(GrammarMatcher { matcher, vocab })
    }
}

/// One reply's place in its grammar.
pub struct GrammarMatcher {
    matcher: Matcher,
    /// The ids the grammar knows (the vocabulary it was compiled against).
    vocab: usize,
}

impl std::fmt::Debug for GrammarMatcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarMatcher").field("stopped", &self.matcher.is_stopped()).finish()
    }
}

impl GrammarMatcher {
    /// Sets the logits of the tokens the grammar does not allow next to -inf. False when it
    /// allows nothing (the reply is complete, or the matcher failed).
    pub fn mask(&mut self, logits: &mut [f32]) -> bool {
        let Ok(allowed) = self.matcher.compute_mask_or_eos() else { return false };
        if allowed.is_zero() {
            return false;
        }
        let n = allowed.len().min(logits.len());
        for (id, l) in logits.iter_mut().enumerate() {
            if id >= n || !allowed.is_allowed(id as u32) {
                *l = f32::NEG_INFINITY;
            }
        }
        true
    }

    /// The tokens the grammar allows next as a bitmask: bit `id % 32` of word `id / 32` set when `id`
    /// is allowed; every word of `bits` is written (ids past the grammar's vocabulary are refused).
    /// False (and no bit set) when it allows nothing, as [`GrammarMatcher::mask`].
    pub fn allowed(&mut self, bits: &mut [u32]) -> bool {
        bits.fill(0);
        let Ok(allowed) = self.matcher.compute_mask_or_eos() else { return false };
        if allowed.is_zero() {
            return false;
        }
        let n = allowed.len();
        for (w, (out, &word)) in bits.iter_mut().zip(allowed.as_slice()).enumerate() {
            let lo = w * 32;
            if lo >= n {
                break;
            }
            *out = if n - lo >= 32 { word } else { word & ((1u32 << (n - lo)) - 1) };
        }
        true
    }

    /// How many of `tokens`, in order, the grammar allows from where it stands, without following
    /// them (0 once it allows nothing further, or for an id past its vocabulary).
    pub fn allows_prefix(&mut self, tokens: &[u32]) -> usize {
        let known = tokens.iter().position(|&t| t as usize >= self.vocab).unwrap_or(tokens.len());
        if known == 0 {
            return 0;
        }
        self.matcher.validate_tokens(&tokens[..known]).unwrap_or(0).min(known)
    }

    /// Follows an emitted token. An error means the token broke the grammar.
    pub fn accept(&mut self, token: u32) -> Result<(), String> {
        self.matcher.consume_token(token).map_err(|e| e.to_string())
    }

    /// An independent matcher at the same place in the grammar (its parser and lexer caches copied),
    /// for another reply to the same request.
    pub fn fork(&self) -> GrammarMatcher {
        GrammarMatcher { matcher: self.matcher.deep_clone(), vocab: self.vocab }
    }

    /// True when the grammar admits nothing further.
    pub fn is_done(&self) -> bool {
        self.matcher.is_stopped()
    }
}

/// `schema` with JSON written on one line, separators as Python's `json.dumps` writes them (what
/// the model reads in its prompts), unless the schema sets its own `x-guidance` options.
fn compact(schema: &Value) -> Value {
    let mut schema = schema.clone();
    if let Some(o) = schema.as_object_mut() {
        o.entry("x-guidance").or_insert_with(
            || serde_json::json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}),
        );
    }
    schema
}

/// A JSON-schema `pattern` as the body of a Lark `/regex/`: its anchors dropped (the value is
/// matched whole) and its slashes escaped.
fn lark_regex(pattern: &str) -> String {
    let p = pattern.strip_prefix('^').unwrap_or(pattern);
    let p = match p.strip_suffix('$') {
        Some(q) if !q.ends_with('\\') => q,
        _ => p,
    };
    let mut out = String::with_capacity(p.len());
    let mut escaped = false;
    for c in p.chars() {
        if c == '/' && !escaped {
            out.push('\\');
        }
        escaped = c == '\\' && !escaped;
        out.push(c);
    }
    out
}

/// A Lark string literal.
fn lark_str(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_else(|_| "\"\"".into())
}

/// The Lark grammar of the Qwen3 XML tool-call syntax for `tools`.
fn tool_call_lark(tools: &[Value], at_most_one: bool) -> Result<String, String> {
    if tools.is_empty() {
        return Err("no tools to call".into());
    }
    let mut rules = Vec::new();
    let mut terminals = Vec::new();
    let mut calls = Vec::new();
    for (t, tool) in tools.iter().enumerate() {
        let f = tool.get("function").unwrap_or(tool);
        let name = f.get("name").and_then(Value::as_str).ok_or("a tool has no name")?;
        let schema = f.get("parameters").or_else(|| f.get("input_schema"));
        let props = schema.and_then(|s| s.get("properties")).and_then(Value::as_object);
        let required: Vec<&str> = schema
            .and_then(|s| s.get("required"))
            .and_then(Value::as_array)
            .map(|r| r.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        let mut body = Vec::new();
        for (p, (pname, pschema)) in props.into_iter().flatten().enumerate() {
            let rule = format!("p{t}_{p}");
            let value = param_value(pschema, &format!("S{t}_{p}"), &mut terminals);
            rules.push(format!("{rule}: {} {value}", lark_str(&format!("<parameter={pname}>\n"))));
            body.push(if required.contains(&pname.as_str()) { rule } else { format!("{rule}?") });
        }
        let call = format!("c{t}");
        rules.push(format!(
            "{call}: {} {} {}",
            lark_str(&format!("<function={name}>\n")),
            body.join(" "),
            lark_str("</function>\n")
        ));
        calls.push(call);
    }
    let one = format!("\"<tool_call>\\n\" ({}) \"</tool_call>\"", calls.join(" | "));
    let start = if at_most_one { format!("start: {one}") } else { format!("start: call (\"\\n\" call)*\ncall: {one}") };
    Ok(format!("{start}\n{}\n{}\n", rules.join("\n"), terminals.join("\n")))
}

/// The grammar of one parameter's value followed by its closing `\n</parameter>\n`: the enum's
/// strings, a string (at most `maxLength` characters when given, matching `pattern` when given:
/// the whole value, as llguidance reads JSON-schema patterns) that ends at the first closing tag,
/// or JSON valid for the schema for other types. A string terminal named `name` is added to
/// `terminals`.
fn param_value(schema: &Value, name: &str, terminals: &mut Vec<String>) -> String {
    let close = "\n</parameter>\n";
    let strings: Vec<&str> =
        schema.get("enum").and_then(Value::as_array).into_iter().flatten().filter_map(Value::as_str).collect();
    let ty = schema.get("type").and_then(Value::as_str);
    if !strings.is_empty() && matches!(ty, None | Some("string")) {
        let alts: Vec<String> = strings.iter().map(|s| lark_str(&format!("{s}{close}"))).collect();
        return format!("({})", alts.join(" | "));
    }
    if matches!(ty, None | Some("string")) {
        // One lexeme for the text and its closing tag, so it ends exactly at the first closing tag.
        let min = schema.get("minLength").and_then(Value::as_u64).unwrap_or(0);
        let count = match schema.get("maxLength").and_then(Value::as_u64) {
            Some(max) => format!("{{{min},{}}}", max.max(min)),
            None if min > 0 => format!("{{{min},}}"),
            None => "*".into(),
        };
        let mut lexeme = format!(r#"/(?s:.){count}\n<\/parameter>\n/"#);
        if let Some(p) = schema.get("pattern").and_then(Value::as_str) {
            lexeme.push_str(&format!(r#" & /(?:{})\n<\/parameter>\n/"#, lark_regex(p)));
        }
        terminals.push(format!(r#"{name}: {lexeme} & ~/(?s:.*)\n<\/parameter>\n(?s:.+)/"#));
        return name.to_string();
    }
    format!("%json {} {}", compact(schema), lark_str(close))
}
