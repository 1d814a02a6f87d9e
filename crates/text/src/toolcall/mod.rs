//! Streaming parser for Qwen3.5/3.6 XML tool calls (the Qwen3-Coder format our chat template asks
//! for), producing OpenAI-style tool-call stream events.
//!
//! The model is prompted to answer with
//!
//! ```text
//! <tool_call>
//! <function=NAME>
//! <parameter=ARG>
//! VALUE
//! </parameter>
//! </function>
//! </tool_call>
//! ```
//!
//! [`ToolCallParser`] runs over the *content* stream (after [`crate::ReasoningParser`]) and turns it
//! into [`ToolEvent`]s: plain text, then per call a `Start` (as soon as the name is complete),
//! argument deltas whose concatenation is exactly the JSON object of the arguments (what OpenAI
//! clients build from `function.arguments` deltas), and an `End`.
//!
//! # Rules
//!
//! * Text outside calls is [`ToolEvent::Content`]. Only what could still be the start of
//!   `<tool_call>` is held back, plus trailing whitespace: whitespace directly before a
//!   `<tool_call>` and directly after a `</tool_call>` is dropped (the template puts `\n\n` / `\n`
//!   there when it renders calls back). A `<function=` without `<tool_call>` is plain text.
//! * A call is recognised once `<tool_call>`, optional whitespace, `<function=NAME>` are complete
//!   and NAME is a plausible identifier (non-empty, at most 256 bytes, no whitespace, quotes,
//!   braces or angle brackets — rejecting e.g. unrendered `{{ name }}` like vLLM does). Otherwise
//!   the `<tool_call>` text is emitted as content, unchanged, and parsing goes on after the tag.
//!   Unknown function names are still emitted; the caller may validate them.
//! * Parameters: `<parameter=NAME>` then the value up to the structural `</parameter>`: one that
//!   is followed (after optional whitespace) by `<parameter=`, `</function>`, `</tool_call>` or the
//!   end of the output. Any other `</parameter>` is part of the value (so look-alikes in code
//!   survive). A missing `</parameter>` is tolerated when the value is followed by `</function>`
//!   plus optional whitespace plus `</tool_call>` (or the end). One leading and one trailing `\n`
//!   of the value (added by the format) are removed.
//! * Values are typed by the tool's JSON schema (`properties.NAME`, from `function.parameters`,
//!   or Anthropic's `input_schema`), like vLLM's qwen3_coder parser: `string` → the raw text;
//!   `integer` / `number` → a JSON number when the text parses (else the raw string); `boolean` →
//!   `true`/`false` (any case; else the raw string); `object` / `array` → the parsed JSON when
//!   valid (else the raw string); `null`/`None` → `null` for non-string types and for nullable
//!   strings. The type is `type` (first non-null entry when it is a list), else the first
//!   non-null `anyOf` / `oneOf` alternative, else string. Parameters missing from the schema, and
//!   all parameters of unknown functions, are strings.
//! * Streaming: each parameter's key is sent as soon as its name is complete; non-nullable
//!   string values are streamed as escaped JSON text as they arrive (held back only around a
//!   possible closing tag or a final `\n`); other values are sent when complete.
//! * Text inside `<function=…>` that is neither whitespace nor a parameter is dropped, except that
//!   a function body with no parameters that is a JSON object (`<function=f>{"a":1}</function>`) is
//!   used as the arguments.
//! * The JSON form some Qwen fine-tunes write, `<tool_call>{"name": NAME, "arguments": {…}}</tool_call>`
//!   (`parameters` for `arguments`, or the arguments as a JSON string, also accepted), is a call
//!   too, sent whole once `</tool_call>` (or the end of the output) arrives; a body that is not
//!   such an object is content.
//! * Several calls per turn get indexes 0, 1, …; several `<function=…>` blocks inside one
//!   `<tool_call>` are separate calls. A missing `</function>` before `</tool_call>` is tolerated.
//! * At [`ToolCallParser::finish`] (output ended): a `<tool_call>` whose `<function=NAME>` was never
//!   completed is emitted as content, verbatim (text is never lost); a started call is closed —
//!   the open parameter ends with the text received so far and the arguments object is closed,
//!   so the arguments are always valid JSON.
//! * Under a grammar ([`ToolCallParser::grammar_values`]: forced tool calls, whose values end at
//!   the first `\n</parameter>\n`, as the grammar ends them), a value ends exactly there: text such
//!   as `</function>` + `</tool_call>` inside a string value stays in the value.
//! * Tool-call ids are `call_` + 24 ASCII alphanumerics, from a per-parser seed
//!   ([`ToolCallParser::new_with_seed`] makes them reproducible).

use serde_json::Value;
use std::sync::atomic::{AtomicU64, Ordering};

mod values;

use values::{FunctionSchema, Kind, PLAIN_STRING, ParamType, convert, function_schemas, json_call, param_type};

const TOOL_CALL_OPEN: &str = "<tool_call>";
const TOOL_CALL_CLOSE: &str = "</tool_call>";
const FUNCTION_OPEN: &str = "<function=";
const FUNCTION_CLOSE: &str = "</function>";
const PARAM_OPEN: &str = "<parameter=";
const PARAM_CLOSE: &str = "</parameter>";
const MAX_NAME_LEN: usize = 256;

/// One event of the parsed content stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolEvent {
    /// Plain assistant text outside tool calls.
    Content(String),
    /// A tool call begins (sent once its function name is complete).
    Start {
        /// Position of the call in this output: 0, 1, …
        index: usize,
        /// `call_` + 24 alphanumerics.
        id: String,
        /// Function name as written by the model (not validated against `tools`).
        name: String,
    },
    /// The next piece of the call's JSON arguments string.
    ArgumentsDelta { index: usize, delta: String },
    /// The call is complete; its argument deltas form one JSON object.
    End { index: usize },
}

/// A complete tool call, as returned by [`parse_complete`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    /// JSON object text of the arguments.
    pub arguments: String,
}

/// Parse a complete content text (after the reasoning split): `(content, calls)`. Built on
/// [`ToolCallParser`], so it equals what any streaming split of `text` produces.
pub fn parse_complete(text: &str, tools: &[Value]) -> (String, Vec<ToolCall>) {
    let mut p = ToolCallParser::new(tools);
    let mut events = p.push(text);
    events.extend(p.finish());
    collect_events(events)
}

/// Fold a sequence of events into `(content, calls)`.
pub fn collect_events(events: impl IntoIterator<Item = ToolEvent>) -> (String, Vec<ToolCall>) {
    let mut content = String::new();
    let mut calls: Vec<ToolCall> = Vec::new();
    for ev in events {
        match ev {
            ToolEvent::Content(s) => content.push_str(&s),
            ToolEvent::Start { index, id, name } => {
                debug_assert_eq!(index, calls.len());
                calls.push(ToolCall { id, name, arguments: String::new() });
            }
            ToolEvent::ArgumentsDelta { index, delta } => {
                if let Some(c) = calls.get_mut(index) {
                    c.arguments.push_str(&delta);
                }
            }
            ToolEvent::End { .. } => {}
        }
    }
    (content, calls)
}

fn valid_function_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_NAME_LEN
        && !name.chars().any(|c| c.is_whitespace() || matches!(c, '{' | '}' | '<' | '>' | '"' | '\''))
}

fn valid_param_name(name: &str) -> bool {
    !name.is_empty() && name.len() <= MAX_NAME_LEN && !name.contains(['<', '\n'])
}

/// Whether `prefix` (possibly empty) could still grow into one of `tags`.
fn could_become(prefix: &str, tags: &[&str]) -> bool {
    tags.iter().any(|t| t.starts_with(prefix))
}

/// Byte offset where a trailing partial `tag` (a proper prefix of it) starts in `s`, or `s.len()`.
fn partial_tag_start(s: &str, tag: &str) -> usize {
    let max = tag.len().saturating_sub(1).min(s.len());
    for k in (1..=max).rev() {
        let start = s.len() - k;
        if s.is_char_boundary(start) && tag.starts_with(&s[start..]) {
            return start;
        }
    }
    s.len()
}

fn json_string(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_else(|_| String::from("\"\""))
}

/// Escaped JSON text of `s` without the surrounding quotes.
fn json_string_inner(s: &str) -> String {
    let q = json_string(s);
    q[1..q.len() - 1].to_string()
}

#[derive(Debug)]
enum State {
    /// Outside calls. `drop_ws`: whitespace here follows a `</tool_call>` and is dropped.
    Text { drop_ws: bool },
    /// `pending` starts with the opener (`opener` bytes: `<tool_call>`, or 0 when a further
    /// `<function=` follows a `</function>`), then whitespace, then (part of) `<function=NAME>`.
    CallOpen { opener: usize },
    /// Inside `<function=…>`, between parameters.
    Body,
    /// Inside a parameter value.
    Value(ValueState),
    /// After `</function>`: expecting `</tool_call>` or another `<function=`.
    AfterFunction,
}

#[derive(Debug)]
struct ValueState {
    ty: ParamType,
    /// Stream the value as JSON string text (non-nullable string type).
    stream: bool,
    /// The leading `\n` of the value has been dealt with.
    leading_done: bool,
    /// Raw text so far (for non-streamed values).
    raw: String,
}

#[derive(Debug)]
struct OpenCall {
    index: usize,
    schema: Option<usize>,
    params: usize,
    /// Non-parameter text in the body (used as arguments if it is a JSON object).
    junk: String,
}

/// Where a value ends, as far as the text seen so far tells.
enum ValueEnd {
    /// No closing tag candidate.
    None,
    /// A closing tag may start here; later text decides.
    Undecided(usize),
    /// The value ends here; `consume` bytes of closing tag follow that belong to the value state.
    At { end: usize, consume: usize },
}

/// Streaming tool-call parser; see the module docs for the format and rules.
#[derive(Debug)]
pub struct ToolCallParser {
    schemas: Vec<(String, FunctionSchema)>,
    state: State,
    /// Text not yet consumed.
    pending: String,
    /// Whitespace held back before a possible `<tool_call>`.
    held_ws: String,
    call: Option<OpenCall>,
    next_index: usize,
    rng: u64,
    events: Vec<ToolEvent>,
    /// Values end at the first `\n</parameter>\n` ([`ToolCallParser::grammar_values`]).
    grammar_values: bool,
}

static PARSER_COUNTER: AtomicU64 = AtomicU64::new(0);

fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl ToolCallParser {
    /// A parser for one output, given the request's OpenAI `tools` array (Anthropic-style
    /// `{name, input_schema}` entries are accepted too). Ids are random per parser.
    pub fn new(tools: &[Value]) -> Self {
        use std::hash::{BuildHasher, Hasher};
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u64(PARSER_COUNTER.fetch_add(1, Ordering::Relaxed));
        if let Ok(d) = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH) {
            h.write_u128(d.as_nanos());
        }
        Self::new_with_seed(tools, h.finish())
    }

    /// Like [`ToolCallParser::new`], with tool-call ids derived from `seed` (reproducible).
    pub fn new_with_seed(tools: &[Value], seed: u64) -> Self {
        Self {
            schemas: function_schemas(tools),
            state: State::Text { drop_ws: false },
            pending: String::new(),
            held_ws: String::new(),
            call: None,
            next_index: 0,
            rng: seed,
            events: Vec::new(),
            grammar_values: false,
        }
    }

    /// For output written under the tool-call grammar (forced tool calls): a parameter value ends
    /// at the first `\n</parameter>\n`, where the grammar ends it, whatever closing tags of the
    /// call it contains before that.
    pub fn grammar_values(mut self) -> Self {
        self.grammar_values = true;
        self
    }

    /// Number of tool calls started so far.
    pub fn calls_started(&self) -> usize {
        self.next_index
    }

    /// Whether the parser is inside a started call (between `Start` and `End`).
    pub fn in_call(&self) -> bool {
        self.call.is_some()
    }

    /// Feed the next piece of content text; returns the events it completes.
    pub fn push(&mut self, text: &str) -> Vec<ToolEvent> {
        self.pending.push_str(text);
        self.process(false);
        std::mem::take(&mut self.events)
    }

    /// End of output: flush held text, close or revert an open call.
    pub fn finish(&mut self) -> Vec<ToolEvent> {
        self.process(true);
        std::mem::take(&mut self.events)
    }

    fn gen_id(&mut self) -> String {
        const ALNUM: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
        let mut id = String::with_capacity(29);
        id.push_str("call_");
        let mut word = 0u64;
        for i in 0..24 {
            if i % 8 == 0 {
                word = splitmix64(&mut self.rng);
            }
            id.push(ALNUM[(word % 62) as usize] as char);
            word /= 62;
        }
        id
    }

    fn emit_content(&mut self, s: &str) {
        if s.is_empty() {
            return;
        }
        if let Some(ToolEvent::Content(last)) = self.events.last_mut() {
            last.push_str(s);
        } else {
            self.events.push(ToolEvent::Content(s.to_string()));
        }
    }

    fn emit_args(&mut self, s: &str) {
        let Some(call) = &self.call else { return };
        let index = call.index;
        if s.is_empty() {
            return;
        }
        if let Some(ToolEvent::ArgumentsDelta { index: i, delta }) = self.events.last_mut()
            && *i == index
        {
            delta.push_str(s);
            return;
        }
        self.events.push(ToolEvent::ArgumentsDelta { index, delta: s.to_string() });
    }

    fn param_schema(&self, name: &str) -> ParamType {
        self.call
            .as_ref()
            .and_then(|c| c.schema)
            .and_then(|i| self.schemas[i].1.properties.get(name))
            .map_or(PLAIN_STRING, param_type)
    }

    fn start_call(&mut self, name: &str) {
        let index = self.next_index;
        self.next_index += 1;
        let id = self.gen_id();
        let schema = self.schemas.iter().position(|(n, _)| n == name);
        self.events.push(ToolEvent::Start { index, id, name: name.to_string() });
        self.call = Some(OpenCall { index, schema, params: 0, junk: String::new() });
    }

    fn start_param(&mut self, name: &str) {
        let ty = self.param_schema(name);
        let stream = ty.kind == Kind::String && !ty.nullable;
        let first = self.call.as_ref().is_some_and(|c| c.params == 0);
        let mut head = String::from(if first { "{" } else { ", " });
        head.push_str(&json_string(name));
        head.push_str(": ");
        if stream {
            head.push('"');
        }
        if let Some(c) = self.call.as_mut() {
            c.params += 1;
        }
        self.emit_args(&head);
        self.state = State::Value(ValueState { ty, stream, leading_done: false, raw: String::new() });
    }

    /// Append value text (already known to belong to the value).
    fn value_text(&mut self, s: &str) {
        if s.is_empty() {
            return;
        }
        let State::Value(v) = &mut self.state else {
            return;
        };
        if v.stream {
            let esc = json_string_inner(s);
            self.emit_args(&esc);
        } else {
            v.raw.push_str(s);
        }
    }

    fn end_param(&mut self) {
        let State::Value(v) = std::mem::replace(&mut self.state, State::Body) else {
            return;
        };
        if v.stream {
            self.emit_args("\"");
        } else {
            let val = convert(&v.raw, v.ty);
            let text = serde_json::to_string(&val).unwrap_or_else(|_| "null".into());
            self.emit_args(&text);
        }
    }

    fn end_call(&mut self) {
        let Some(call) = self.call.as_ref() else {
            return;
        };
        let index = call.index;
        let tail = if call.params > 0 {
            "}".to_string()
        } else {
            match serde_json::from_str::<Value>(call.junk.trim()) {
                Ok(v @ Value::Object(_)) => serde_json::to_string(&v).unwrap_or_else(|_| "{}".into()),
                _ => "{}".to_string(),
            }
        };
        self.emit_args(&tail);
        self.events.push(ToolEvent::End { index });
        self.call = None;
    }

    /// Give up on a call opener: its text becomes content.
    fn revert_open(&mut self, opener: usize) {
        let ws = std::mem::take(&mut self.held_ws);
        self.emit_content(&ws);
        let tag: String = self.pending.drain(..opener).collect();
        self.emit_content(&tag);
        self.state = State::Text { drop_ws: false };
    }

    /// Classify the value text in `pending` (ends of the value are `</parameter>` or
    /// `</function>` in structural position).
    fn scan_value(&self, eof: bool) -> ValueEnd {
        let s = self.pending.as_str();
        if self.grammar_values {
            const END: &str = "\n</parameter>\n";
            return match s.find(END) {
                // The `\n` before the tag is the format's, removed with the value's last byte.
                Some(i) => ValueEnd::At { end: i + 1, consume: PARAM_CLOSE.len() },
                None if !eof && partial_tag_start(s, END) < s.len() => ValueEnd::Undecided(partial_tag_start(s, END)),
                None => ValueEnd::None,
            };
        }
        let mut pos = 0;
        while let Some(off) = s[pos..].find('<') {
            let i = pos + off;
            let rest = &s[i..];
            for (tag, followers, consume) in [
                (PARAM_CLOSE, &[PARAM_OPEN, FUNCTION_CLOSE, TOOL_CALL_CLOSE][..], PARAM_CLOSE.len()),
                (FUNCTION_CLOSE, &[TOOL_CALL_CLOSE][..], 0),
            ] {
                if let Some(after) = rest.strip_prefix(tag) {
                    let t = after.trim_start();
                    if followers.iter().any(|f| t.starts_with(f)) {
                        return ValueEnd::At { end: i, consume };
                    }
                    if could_become(t, followers) {
                        if eof {
                            return ValueEnd::At { end: i, consume: s.len() - i };
                        }
                        return ValueEnd::Undecided(i);
                    }
                } else if tag.starts_with(rest) {
                    if eof {
                        return ValueEnd::At { end: i, consume: s.len() - i };
                    }
                    return ValueEnd::Undecided(i);
                }
            }
            pos = i + 1;
        }
        ValueEnd::None
    }

    fn process(&mut self, eof: bool) {
        loop {
            match &mut self.state {
                State::Text { drop_ws } => {
                    if *drop_ws {
                        let n = self.pending.len() - self.pending.trim_start().len();
                        self.pending.drain(..n);
                        if self.pending.is_empty() {
                            return;
                        }
                        *drop_ws = false;
                    }
                    if let Some(i) = self.pending.find(TOOL_CALL_OPEN) {
                        let before: String = self.pending.drain(..i).collect();
                        let kept = before.trim_end();
                        let ws = before[kept.len()..].to_string();
                        let ws0 = std::mem::take(&mut self.held_ws);
                        if !kept.is_empty() {
                            self.emit_content(&ws0);
                            self.emit_content(kept);
                            self.held_ws = ws;
                        } else {
                            self.held_ws = ws0 + &ws;
                        }
                        self.state = State::CallOpen { opener: TOOL_CALL_OPEN.len() };
                        continue;
                    }
                    let s = self.pending.as_str();
                    let hold = if eof { s.len() } else { partial_tag_start(s, TOOL_CALL_OPEN) };
                    let text_end = if eof { hold } else { s[..hold].trim_end().len() };
                    if text_end > 0 {
                        let ws = std::mem::take(&mut self.held_ws);
                        self.emit_content(&ws);
                        let t: String = self.pending.drain(..text_end).collect();
                        self.emit_content(&t);
                    }
                    if eof {
                        let ws = std::mem::take(&mut self.held_ws);
                        self.emit_content(&ws);
                    } else {
                        // Keep whitespace (and a partial tag) held: whitespace goes to `held_ws`.
                        let s = self.pending.as_str();
                        let ws_len = s.len() - s.trim_start().len();
                        let ws_len = ws_len.min(partial_tag_start(s, TOOL_CALL_OPEN));
                        let ws: String = self.pending.drain(..ws_len).collect();
                        self.held_ws.push_str(&ws);
                    }
                    return;
                }
                State::CallOpen { opener } => {
                    let opener = *opener;
                    let after = &self.pending[opener..];
                    let t = after.trim_start();
                    if let Some(name_part) = t.strip_prefix(FUNCTION_OPEN) {
                        match name_part.find('>') {
                            Some(k) if valid_function_name(&name_part[..k]) => {
                                let name = name_part[..k].to_string();
                                let consumed = self.pending.len() - name_part.len() + k + 1;
                                self.pending.drain(..consumed);
                                self.held_ws.clear();
                                self.start_call(&name);
                                self.state = State::Body;
                            }
                            None if !eof && (name_part.is_empty() || valid_function_name(name_part)) => {
                                return;
                            }
                            _ => self.revert_open(opener),
                        }
                    } else if opener > 0 && t.starts_with('{') {
                        // The JSON form: `<tool_call>{"name": …, "arguments": …}</tool_call>`.
                        let body_end = after.find(TOOL_CALL_CLOSE);
                        if body_end.is_none() && !eof {
                            return;
                        }
                        let body = &after[..body_end.unwrap_or(after.len())];
                        match json_call(body) {
                            Some((name, args)) => {
                                let consumed = opener + body_end.map_or(after.len(), |k| k + TOOL_CALL_CLOSE.len());
                                self.pending.drain(..consumed);
                                self.held_ws.clear();
                                self.start_call(&name);
                                self.emit_args(&args);
                                self.events.push(ToolEvent::End { index: self.next_index - 1 });
                                self.call = None;
                                self.state = State::Text { drop_ws: true };
                            }
                            None => self.revert_open(opener),
                        }
                    } else if !eof && FUNCTION_OPEN.starts_with(t) {
                        return;
                    } else {
                        self.revert_open(opener);
                    }
                }
                State::Body => {
                    let n = self.pending.len() - self.pending.trim_start().len();
                    self.pending.drain(..n);
                    let t = self.pending.as_str();
                    if let Some(name_part) = t.strip_prefix(PARAM_OPEN) {
                        match name_part.find('>') {
                            Some(k) if valid_param_name(&name_part[..k]) => {
                                let name = name_part[..k].to_string();
                                self.pending.drain(..PARAM_OPEN.len() + k + 1);
                                self.start_param(&name);
                                continue;
                            }
                            None if !eof && (name_part.is_empty() || valid_param_name(name_part)) => {
                                return;
                            }
                            _ => {}
                        }
                    } else if t.starts_with(FUNCTION_CLOSE) {
                        self.pending.drain(..FUNCTION_CLOSE.len());
                        self.end_call();
                        self.state = State::AfterFunction;
                        continue;
                    } else if t.starts_with(TOOL_CALL_CLOSE) {
                        self.pending.drain(..TOOL_CALL_CLOSE.len());
                        self.end_call();
                        self.state = State::Text { drop_ws: true };
                        continue;
                    } else if eof {
                        if let Some(c) = self.call.as_mut() {
                            c.junk.push_str(&self.pending);
                        }
                        self.pending.clear();
                        self.end_call();
                        self.state = State::Text { drop_ws: false };
                        return;
                    } else if could_become(t, &[PARAM_OPEN, FUNCTION_CLOSE, TOOL_CALL_CLOSE]) {
                        return;
                    }
                    // Junk: consume up to the next '<' (at least one char).
                    let t = self.pending.as_str();
                    let first = t.chars().next().map_or(0, char::len_utf8);
                    let end = t[first..].find('<').map_or(t.len(), |k| first + k);
                    let junk: String = self.pending.drain(..end).collect();
                    if let Some(c) = self.call.as_mut() {
                        c.junk.push_str(&junk);
                    }
                }
                State::Value(v) => {
                    if !v.leading_done {
                        if self.pending.is_empty() && !eof {
                            return;
                        }
                        if self.pending.starts_with('\n') {
                            self.pending.drain(..1);
                        }
                        v.leading_done = true;
                    }
                    match self.scan_value(eof) {
                        ValueEnd::At { end, consume } => {
                            let mut text: String = self.pending.drain(..end).collect();
                            if text.ends_with('\n') {
                                text.pop();
                            }
                            self.pending.drain(..consume);
                            self.value_text(&text);
                            self.end_param();
                        }
                        ValueEnd::Undecided(i) => {
                            let mut safe = i;
                            if self.pending[..safe].ends_with('\n') {
                                safe -= 1;
                            }
                            let text: String = self.pending.drain(..safe).collect();
                            self.value_text(&text);
                            return;
                        }
                        ValueEnd::None => {
                            let mut text = std::mem::take(&mut self.pending);
                            if text.ends_with('\n') {
                                text.pop();
                                if !eof {
                                    self.pending.push('\n');
                                }
                            }
                            self.value_text(&text);
                            if !eof {
                                return;
                            }
                            self.end_param();
                        }
                    }
                }
                State::AfterFunction => {
                    let n = self.pending.len() - self.pending.trim_start().len();
                    self.pending.drain(..n);
                    let t = self.pending.as_str();
                    if t.starts_with(TOOL_CALL_CLOSE) {
                        self.pending.drain(..TOOL_CALL_CLOSE.len());
                        self.state = State::Text { drop_ws: true };
                    } else if t.starts_with(FUNCTION_OPEN) {
                        self.state = State::CallOpen { opener: 0 };
                    } else if eof {
                        // A partial closing tag at the very end is dropped; other text is content.
                        if could_become(t, &[TOOL_CALL_CLOSE, FUNCTION_OPEN]) {
                            self.pending.clear();
                        }
                        self.state = State::Text { drop_ws: false };
                    } else if could_become(t, &[TOOL_CALL_CLOSE, FUNCTION_OPEN]) {
                        return;
                    } else {
                        self.state = State::Text { drop_ws: false };
                    }
                }
            }
        }
    }
}
