//! The Anthropic Messages API: `POST /v1/messages` (streaming and not; text, thinking and tool-use
//! blocks) and `POST /v1/messages/count_tokens`, so agent clients that speak it work. Requests are
//! converted to the chat messages our template renders; outputs come from the same parsed stream as
//! the OpenAI endpoints, turned into content blocks by one [`Blocks`] builder whether streamed or not.

use std::convert::Infallible;
use std::sync::Arc;

use axum::Extension;
use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::response::sse::Event as SseEvent;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Map, Value, json};
use tokio::sync::mpsc;

use deltaserve_engine::{SamplingParams, Usage};
use deltaserve_model::ImagePatches;

use crate::error::{ApiError, Style};
use crate::media::load_images;
use crate::openai::{parse_body, sse};
use crate::output::{Finish, OutEvent, OutputStream, Parsing};
use crate::request::{Limits, build_request, new_id, normalize_messages, render_chat, type_name};
use crate::state::{AppState, ChatDefaults};
use crate::structured;
use deltaserve_text::Grammar;

#[derive(Debug, Deserialize)]
pub struct MessagesRequest {
    pub model: Option<String>,
    pub max_tokens: Option<u64>,
    pub messages: Vec<Value>,
    pub system: Option<Value>,
    pub tools: Option<Vec<Value>>,
    pub tool_choice: Option<Value>,
    pub stop_sequences: Option<Vec<String>>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<u32>,
    pub stream: Option<bool>,
    pub thinking: Option<Value>,
    pub metadata: Option<Value>,
}

impl MessagesRequest {
    /// Whether the request asked for thinking (`thinking: {"type": "enabled"}`); as in Anthropic's API,
    /// only then does the reply carry `thinking` blocks.
    fn thinking_enabled(&self) -> bool {
        self.thinking.as_ref().and_then(|t| t.get("type")).and_then(Value::as_str) == Some("enabled")
    }

    /// `thinking.budget_tokens` of enabled thinking: the most reasoning tokens before the reasoning is
    /// closed ([`crate::thinking`]).
    fn thinking_budget(&self) -> Result<Option<usize>, ApiError> {
        let Some(b) = self.thinking.as_ref().and_then(|t| t.get("budget_tokens")).filter(|_| self.thinking_enabled())
        else {
            return Ok(None);
        };
        let n = b.as_u64().ok_or_else(|| {
            ApiError::bad_param(
                "thinking.budget_tokens",
                format!("`budget_tokens` must be a non-negative integer, got {b}"),
            )
        })?;
        Ok(Some(usize::try_from(n).unwrap_or(usize::MAX)))
    }
}

/// The prompt and output parsing of an Anthropic request.
/// The prompt, how to parse the output, and the grammar a forced `tool_choice` puts on it.
async fn convert(
    st: &AppState,
    chat: &ChatDefaults,
    req: &MessagesRequest,
) -> Result<(Vec<u32>, Parsing, Option<Grammar>, Vec<Arc<ImagePatches>>), ApiError> {
    st.check_model(req.model.as_deref())?;
    let mut messages = Vec::new();
    match &req.system {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) => messages.push(json!({"role": "system", "content": s})),
        Some(Value::Array(blocks)) => {
            messages.push(json!({"role": "system", "content": blocks_text(blocks, "system")?}))
        }
        Some(other) => {
            return Err(ApiError::bad_param(
                "system",
                format!("`system` must be a string or text blocks, got {}", type_name(other)),
            ));
        }
    }
    for (i, m) in req.messages.iter().enumerate() {
        let role = m.get("role").and_then(Value::as_str).unwrap_or_default();
        if role != "user" && role != "assistant" {
            return Err(ApiError::bad_param(
                "messages",
                format!("messages[{i}].role must be \"user\" or \"assistant\""),
            ));
        }
        match m.get("content") {
            Some(Value::String(s)) => messages.push(json!({"role": role, "content": s})),
            Some(Value::Array(blocks)) if role == "user" => user_blocks(blocks, i, &mut messages)?,
            Some(Value::Array(blocks)) => messages.push(assistant_blocks(blocks, i)?),
            _ => {
                return Err(ApiError::bad_param(
                    "messages",
                    format!("messages[{i}].content must be a string or a list of blocks"),
                ));
            }
        }
    }
    let offered =
        || req.tools.as_ref().map(|t| t.iter().map(to_openai_tool).collect::<Result<Vec<_>, _>>()).transpose();
    let choice = req.tool_choice.as_ref();
    let parallel = !choice.and_then(|c| c.get("disable_parallel_tool_use")).and_then(Value::as_bool).unwrap_or(false);
    let (tools, forced) = match choice.and_then(|c| c.get("type")).and_then(Value::as_str) {
        Some("none") => (None, None),
        None | Some("auto") => (offered()?, None),
        Some("any") => {
            let tools = offered()?;
            let g = structured::forced_tool_call(tools.as_deref(), None, parallel)?;
            (tools, Some(g))
        }
        Some("tool") => {
            let name = choice.and_then(|c| c.get("name")).and_then(Value::as_str);
            let name = name.ok_or_else(|| ApiError::bad_param("tool_choice", "tool_choice.name is missing"))?;
            let tools = offered()?;
            let g = structured::forced_tool_call(tools.as_deref(), Some(name), parallel)?;
            (tools, Some(g))
        }
        Some(other) => {
            return Err(ApiError::bad_param(
                "tool_choice",
                format!("tool_choice type `{other}` is not supported (auto, none, any, tool)"),
            ));
        }
    };
    let mut kwargs = Map::new();
    match req.thinking.as_ref().and_then(|t| t.get("type")).and_then(Value::as_str) {
        Some("enabled") => {
            kwargs.insert("enable_thinking".into(), json!(true));
        }
        Some("disabled") => {
            kwargs.insert("enable_thinking".into(), json!(false));
        }
        None => {}
        Some(other) => {
            return Err(ApiError::bad_param(
                "thinking",
                format!("thinking type `{other}` is not one of enabled, disabled"),
            ));
        }
    }
    let (messages, image_parts) = normalize_messages(&messages)?;
    let images = load_images(st, image_parts).await?;
    let (prompt, parsing) = render_chat(st, messages, tools, chat.merged(kwargs), &images, true)?;
    Ok((prompt, parsing, forced, images))
}

fn blocks_text(blocks: &[Value], field: &str) -> Result<String, ApiError> {
    let mut s = String::new();
    for b in blocks {
        match (b.get("type").and_then(Value::as_str), b.get("text").and_then(Value::as_str)) {
            (Some("text"), Some(t)) => s.push_str(t),
            _ => return Err(ApiError::bad_param(field, format!("`{field}` blocks must be text blocks"))),
        }
    }
    Ok(s)
}

/// User blocks: text and images make one user message; tool results become tool messages (first).
fn user_blocks(blocks: &[Value], i: usize, out: &mut Vec<Value>) -> Result<(), ApiError> {
    let mut parts = Vec::new();
    for (j, b) in blocks.iter().enumerate() {
        match b.get("type").and_then(Value::as_str) {
            Some("text") => {
                parts.push(json!({"type": "text", "text": b.get("text").and_then(Value::as_str).unwrap_or_default()}))
            }
            Some("image") => parts.push(json!({
                "type": "image_url",
                "image_url": {"url": image_source_url(b, i, j)?},
                "location": format!("messages[{i}].content[{j}]"),
            })),
            Some("tool_result") => {
                let content = match b.get("content") {
                    None | Some(Value::Null) => String::new(),
                    Some(Value::String(s)) => s.clone(),
                    Some(Value::Array(parts)) => blocks_text(parts, "messages")?,
                    Some(other) => other.to_string(),
                };
                let id = b.get("tool_use_id").and_then(Value::as_str).unwrap_or_default();
                out.push(json!({"role": "tool", "tool_call_id": id, "content": content}));
            }
            other => {
                return Err(ApiError::bad_param(
                    "messages",
                    format!(
                        "messages[{i}].content[{j}]: {} is not supported in user turns (text, image, tool_result)",
                        block_kind(other)
                    ),
                ));
            }
        }
    }
    let empty = parts.iter().all(|p| p.get("text").and_then(Value::as_str) == Some(""));
    if !empty {
        out.push(json!({"role": "user", "content": parts}));
    }
    Ok(())
}

/// The URL of an `image` block's source: a data URL for `base64`, the URL for `url`.
fn image_source_url(b: &Value, i: usize, j: usize) -> Result<String, ApiError> {
    let src = b.get("source");
    let field = |k: &str| src.and_then(|s| s.get(k)).and_then(Value::as_str);
    let missing = |k: &str| {
        ApiError::bad_param("messages", format!("messages[{i}].content[{j}].source.{k} is missing or not a string"))
    };
    match field("type") {
        Some("base64") => {
            let media_type = field("media_type").ok_or_else(|| missing("media_type"))?;
            Ok(format!("data:{media_type};base64,{}", field("data").ok_or_else(|| missing("data"))?))
        }
        Some("url") => Ok(field("url").ok_or_else(|| missing("url"))?.to_string()),
        other => Err(ApiError::bad_param(
            "messages",
            format!(
                "messages[{i}].content[{j}].source: image sources of type {} are not supported (base64, url)",
                other.map_or_else(|| "(none)".to_string(), |t| format!("`{t}`"))
            ),
        )),
    }
}

fn assistant_blocks(blocks: &[Value], i: usize) -> Result<Value, ApiError> {
    let (mut text, mut reasoning, mut calls) = (String::new(), String::new(), Vec::new());
    for (j, b) in blocks.iter().enumerate() {
        match b.get("type").and_then(Value::as_str) {
            Some("text") => text.push_str(b.get("text").and_then(Value::as_str).unwrap_or_default()),
            Some("thinking") => reasoning.push_str(b.get("thinking").and_then(Value::as_str).unwrap_or_default()),
            Some("redacted_thinking") => {}
            Some("tool_use") => calls.push(json!({
                "id": b.get("id").cloned().unwrap_or(Value::Null),
                "type": "function",
                "function": {"name": b.get("name").cloned().unwrap_or(Value::Null), "arguments": b.get("input").cloned().unwrap_or(json!({}))},
            })),
            other => {
                return Err(ApiError::bad_param(
                    "messages",
                    format!(
                        "messages[{i}].content[{j}]: {} is not supported in assistant turns (text, thinking, tool_use)",
                        block_kind(other)
                    ),
                ));
            }
        }
    }
    let mut m = json!({"role": "assistant", "content": text});
    if !reasoning.is_empty() {
        m["reasoning_content"] = json!(reasoning);
    }
    if !calls.is_empty() {
        m["tool_calls"] = Value::Array(calls);
    }
    Ok(m)
}

/// A block's `type` for a message: "block type `image`", or "a block without a `type`".
fn block_kind(kind: Option<&str>) -> String {
    kind.map_or_else(|| "a block without a `type`".into(), |k| format!("block type `{k}`"))
}

fn to_openai_tool(t: &Value) -> Result<Value, ApiError> {
    let name = t
        .get("name")
        .and_then(Value::as_str)
        .filter(|n| !n.is_empty())
        .ok_or_else(|| ApiError::bad_param("tools", "every tool needs a `name`"))?;
    // A tool without a description renders without the key (as transformers renders it), never as null.
    let mut function = serde_json::Map::new();
    function.insert("name".into(), json!(name));
    if let Some(d) = t.get("description").filter(|d| !d.is_null()) {
        function.insert("description".into(), d.clone());
    }
    let parameters = t.get("input_schema").cloned().unwrap_or(json!({"type": "object", "properties": {}}));
    function.insert("parameters".into(), parameters);
    Ok(json!({"type": "function", "function": function}))
}

pub async fn messages(
    State(st): State<AppState>,
    Extension(chat): Extension<ChatDefaults>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let resp = messages_inner(&st, &chat, body).await.unwrap_or_else(|e| e.into_response_styled(Style::Anthropic));
    st.metrics.request("messages", resp.status().as_u16());
    resp
}

async fn messages_inner(
    st: &AppState,
    chat: &ChatDefaults,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let req: MessagesRequest = parse_body(body)?;
    let max_tokens = req.max_tokens.ok_or_else(|| ApiError::bad_param("max_tokens", "`max_tokens` is required"))?;
    let (prompt, mut parsing, forced, images) = convert(st, chat, &req).await?;
    let input_tokens = prompt.len();
    let d = &st.sampling_defaults;
    let sampling = SamplingParams {
        temperature: req.temperature.unwrap_or(d.temperature),
        top_p: req.top_p.unwrap_or(d.top_p),
        top_k: req.top_k.map_or(d.top_k, |k| k as usize),
        ..d.clone()
    };
    let mut engine_req = build_request(
        prompt,
        Limits {
            chat: true,
            max_tokens: Some(max_tokens),
            sampling,
            stop: req.stop_sequences.clone().unwrap_or_default(),
            ignore_eos: false,
            stop_token_ids: Vec::new(),
            logprobs: None,
            images,
            state: st,
        },
    )?;
    if let Some(g) = &forced {
        engine_req.constraint = Some(structured::constraint(st, g, "tool_choice", &mut parsing)?);
    }
    if let Some(budget) = req.thinking_budget()?.or(st.cfg.reasoning_budget) {
        crate::thinking::budget(st, budget, &mut engine_req, &parsing, "thinking.budget_tokens")?;
    }
    let mut out = st.generate(engine_req, parsing)?;
    let id = new_id("msg_");
    let model = st.cfg.served_model_name.clone();
    let blocks = Blocks::new(req.thinking_enabled());
    if req.stream.unwrap_or(false) {
        return Ok(sse(message_stream(out, blocks, id, model, input_tokens)));
    }
    let mut reply = Reply::new(blocks);
    while let Some(batch) = out.next().await {
        reply.add(batch?);
    }
    let (finish, usage) = reply.end.unwrap_or((Finish::Length, Default::default()));
    Ok(axum::Json(json!({
        "id": id, "type": "message", "role": "assistant", "model": model, "content": reply.content,
        "stop_reason": stop_reason(&finish), "stop_sequence": finish.stop_string(),
        "usage": usage_json(&usage),
    }))
    .into_response())
}

fn tool_use_id(call_id: &str) -> String {
    format!("toolu_{}", call_id.trim_start_matches("call_"))
}

fn stop_reason(f: &Finish) -> &'static str {
    match f {
        Finish::Stop => "end_turn",
        Finish::StopString(_) => "stop_sequence",
        Finish::Length => "max_tokens",
        Finish::ToolCalls => "tool_use",
    }
}

fn usage_json(u: &Usage) -> Value {
    json!({"input_tokens": u.prompt_tokens, "output_tokens": u.completion_tokens,
           "cache_read_input_tokens": u.cached_tokens, "cache_creation_input_tokens": 0})
}

/// Which content block is open.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Block {
    Thinking,
    Text,
    Tool(usize),
}

/// A step in building the reply's content: the `content_block_*` events of a stream.
#[derive(Clone, Debug, PartialEq)]
enum BlockEvent {
    Start { index: usize, block: Value },
    Delta { index: usize, delta: Value },
    Stop { index: usize },
}

/// Output events → content blocks, the same for streamed and whole replies: `thinking` blocks only
/// when the request enabled thinking (otherwise reasoning the model emits anyway is left out, as
/// Anthropic's API shows none), and always at least one `text` or `tool_use` block (an empty `text`
/// block when the model wrote neither, e.g. cut by `max_tokens` while thinking).
struct Blocks {
    thinking: bool,
    open: Option<(Block, usize)>,
    next_index: usize,
    answered: bool,
}

impl Blocks {
    fn new(thinking: bool) -> Self {
        Self { thinking, open: None, next_index: 0, answered: false }
    }

    /// The block events of `events`, and the end of the output when it is among them.
    fn push(&mut self, events: Vec<OutEvent>, out: &mut Vec<BlockEvent>) -> Option<(Finish, Usage)> {
        let mut end = None;
        for e in events {
            let (block, delta) = match e {
                OutEvent::Reasoning(s) if self.thinking => {
                    (Block::Thinking, json!({"type": "thinking_delta", "thinking": s}))
                }
                OutEvent::Content(s) => (Block::Text, json!({"type": "text_delta", "text": s})),
                OutEvent::ToolStart { index, id, name } => {
                    let block = json!({"type": "tool_use", "id": tool_use_id(&id), "name": name, "input": {}});
                    self.start(Block::Tool(index), block, out);
                    continue;
                }
                OutEvent::ToolArgs { index, delta } => {
                    (Block::Tool(index), json!({"type": "input_json_delta", "partial_json": delta}))
                }
                OutEvent::Done { finish, usage, .. } => {
                    self.close(out);
                    if !self.answered {
                        self.start(Block::Text, json!({"type": "text", "text": ""}), out);
                        self.close(out);
                    }
                    end = Some((finish, usage));
                    continue;
                }
                OutEvent::Reasoning(_)
                | OutEvent::ToolEnd { .. }
                | OutEvent::Token { .. }
                | OutEvent::Progress { .. }
                | OutEvent::PromptLogprobs(_) => {
                    continue;
                }
            };
            if self.open.map(|(b, _)| b) != Some(block) {
                let start = match block {
                    Block::Thinking => json!({"type": "thinking", "thinking": "", "signature": ""}),
                    Block::Text => json!({"type": "text", "text": ""}),
                    Block::Tool(_) => continue, // arguments of a call that never started: nothing to attach them to
                };
                self.start(block, start, out);
            }
            let index = self.open.map_or(0, |(_, i)| i);
            out.push(BlockEvent::Delta { index, delta });
        }
        end
    }

    fn start(&mut self, block: Block, start: Value, out: &mut Vec<BlockEvent>) {
        self.close(out);
        self.answered |= block != Block::Thinking;
        out.push(BlockEvent::Start { index: self.next_index, block: start });
        self.open = Some((block, self.next_index));
        self.next_index += 1;
    }

    fn close(&mut self, out: &mut Vec<BlockEvent>) {
        if let Some((_, index)) = self.open.take() {
            out.push(BlockEvent::Stop { index });
        }
    }
}

/// A whole (non-streamed) reply: the block events folded into the `content` list.
struct Reply {
    blocks: Blocks,
    content: Vec<Value>,
    /// Each tool_use block's `input` JSON so far, by block index.
    partial_json: Vec<String>,
    end: Option<(Finish, Usage)>,
}

impl Reply {
    fn new(blocks: Blocks) -> Self {
        Self { blocks, content: Vec::new(), partial_json: Vec::new(), end: None }
    }

    fn add(&mut self, events: Vec<OutEvent>) {
        let mut steps = Vec::new();
        if let Some(end) = self.blocks.push(events, &mut steps) {
            self.end = Some(end);
        }
        for step in steps {
            match step {
                BlockEvent::Start { block, .. } => {
                    self.content.push(block);
                    self.partial_json.push(String::new());
                }
                BlockEvent::Delta { index, delta } => {
                    let field = match delta["type"].as_str() {
                        Some("thinking_delta") => "thinking",
                        Some("text_delta") => "text",
                        _ => "partial_json",
                    };
                    let piece = delta[field].as_str().unwrap_or_default();
                    match self.content[index].get_mut(field) {
                        Some(Value::String(s)) => s.push_str(piece),
                        _ => self.partial_json[index].push_str(piece),
                    }
                }
                BlockEvent::Stop { index } => {
                    if self.content[index]["type"] == "tool_use" {
                        self.content[index]["input"] =
                            serde_json::from_str(&self.partial_json[index]).unwrap_or_else(|_| json!({}));
                    }
                }
            }
        }
    }
}

fn message_stream(
    mut out: OutputStream,
    mut blocks: Blocks,
    id: String,
    model: String,
    input_tokens: usize,
) -> mpsc::Receiver<Result<SseEvent, Infallible>> {
    let (tx, rx) = mpsc::channel(64);
    tokio::spawn(async move {
        let send = |kind: &'static str, data: Value| {
            let tx = tx.clone();
            async move { tx.send(Ok(SseEvent::default().event(kind).data(data.to_string()))).await.map_err(|_| ()) }
        };
        let start = json!({"type": "message_start", "message": {"id": id, "type": "message", "role": "assistant", "model": model,
            "content": [], "stop_reason": null, "stop_sequence": null, "usage": {"input_tokens": input_tokens, "output_tokens": 0}}});
        if send("message_start", start).await.is_err() {
            return;
        }
        while let Some(batch) = out.next().await {
            let events = match batch {
                Ok(e) => e,
                Err(e) => {
                    let _ = send("error", e.body(Style::Anthropic)).await;
                    return;
                }
            };
            let mut steps = Vec::new();
            let end = blocks.push(events, &mut steps);
            for step in steps {
                let (kind, data) = match step {
                    BlockEvent::Start { index, block } => (
                        "content_block_start",
                        json!({"type": "content_block_start", "index": index, "content_block": block}),
                    ),
                    BlockEvent::Delta { index, delta } => {
                        ("content_block_delta", json!({"type": "content_block_delta", "index": index, "delta": delta}))
                    }
                    BlockEvent::Stop { index } => {
                        ("content_block_stop", json!({"type": "content_block_stop", "index": index}))
                    }
                };
                if send(kind, data).await.is_err() {
                    return; // client gone: dropping `out` cancels the request
                }
            }
            if let Some((finish, u)) = end {
                let delta = json!({"type": "message_delta",
                    "delta": {"stop_reason": stop_reason(&finish), "stop_sequence": finish.stop_string()},
                    "usage": {"output_tokens": u.completion_tokens}});
                let _ = send("message_delta", delta).await;
                let _ = send("message_stop", json!({"type": "message_stop"})).await;
            }
        }
    });
    rx
}

pub async fn count_tokens(
    State(st): State<AppState>,
    Extension(chat): Extension<ChatDefaults>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let counted = match parse_body::<MessagesRequest>(body) {
        Ok(req) => convert(&st, &chat, &req).await,
        Err(e) => Err(e),
    };
    let resp = counted
        .map(|(ids, ..)| axum::Json(json!({"input_tokens": ids.len()})).into_response())
        .unwrap_or_else(|e| e.into_response_styled(Style::Anthropic));
    st.metrics.request("count_tokens", resp.status().as_u16());
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tool_without_description_has_no_description_key() {
        let schema = json!({"type": "object", "properties": {"city": {"type": "string"}}});
        let bare = to_openai_tool(&json!({"name": "get_weather", "input_schema": schema})).unwrap();
        assert_eq!(bare, json!({"type": "function", "function": {"name": "get_weather", "parameters": schema}}));
        assert!(!bare.to_string().contains("null"));
        let described =
            to_openai_tool(&json!({"name": "get_weather", "description": "Weather now.", "input_schema": schema}))
                .unwrap();
        assert_eq!(described["function"]["description"], "Weather now.");
        // Key order as transformers renders it: name, description, parameters.
        let keys: Vec<&String> = described["function"].as_object().unwrap().keys().collect();
        assert_eq!(keys, ["name", "description", "parameters"]);
    }
}
