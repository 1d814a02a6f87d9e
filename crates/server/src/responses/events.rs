//! A Responses API reply: output items built from the chat output's events, returned whole or streamed
//! as the API's typed SSE events (`response.created`, `response.output_item.added`,
//! `response.output_text.delta`, `response.function_call_arguments.delta`, `response.reasoning_text.delta`,
//! ..., `response.completed` or `response.incomplete`), each with its `sequence_number`.

use std::convert::Infallible;

use axum::response::sse::Event as SseEvent;
use axum::response::{IntoResponse, Response};
use deltaserve_engine::{Timing, Usage};
use serde_json::{Value, json};
use tokio::sync::mpsc;

use super::ResponsesRequest;
use crate::error::{ApiError, Style};
use crate::openai::sse;
use crate::output::{Finish, OutEvent, OutputStream};
use crate::request::{new_id, unix_now};
use crate::timings::timings_json;

/// The request fields a response object repeats.
pub struct Echo {
    instructions: Value,
    max_output_tokens: Value,
    temperature: Value,
    top_p: Value,
    tools: Value,
    tool_choice: Value,
    parallel_tool_calls: bool,
    text: Value,
    reasoning: Value,
    /// `include` asked for `reasoning.encrypted_content`: reasoning items carry their text there too.
    encrypted_reasoning: bool,
}

impl Echo {
    pub fn of(req: &ResponsesRequest) -> Self {
        Self {
            instructions: json!(req.instructions),
            max_output_tokens: json!(req.max_output_tokens),
            temperature: json!(req.temperature),
            top_p: json!(req.top_p),
            tools: json!(req.tools.clone().unwrap_or_default()),
            tool_choice: req.tool_choice.clone().unwrap_or(json!("auto")),
            parallel_tool_calls: req.parallel_tool_calls.unwrap_or(true),
            text: req.text.clone().unwrap_or(json!({"format": {"type": "text"}})),
            reasoning: req.reasoning.clone().unwrap_or(json!({"effort": null, "summary": null})),
            encrypted_reasoning: req.include.iter().flatten().any(|i| i == "reasoning.encrypted_content"),
        }
    }
}

/// The output items of one reply as they are built.
struct Items {
    items: Vec<Value>,
    /// The open reasoning or message item (index into `items`): text goes there until another kind comes.
    open: Option<usize>,
    /// Output index of each tool call (by the parser's call index).
    calls: Vec<usize>,
    /// Closed reasoning items carry their text in `encrypted_content` too ([`Echo`]).
    encrypted_reasoning: bool,
}

/// The stream events an output event gives, in order (a whole response drops them).
type Emitted = Vec<Value>;

impl Items {
    fn new(encrypted_reasoning: bool) -> Self {
        Self { items: Vec::new(), open: None, calls: Vec::new(), encrypted_reasoning }
    }

    /// Closes the open text item: its `done` events.
    fn close(&mut self, out: &mut Emitted) {
        let Some(i) = self.open.take() else { return };
        let item = &mut self.items[i];
        item["status"] = json!("completed");
        let id = item["id"].clone();
        match item["type"].as_str() {
            Some("reasoning") => {
                let text = item["content"][0]["text"].clone();
                if self.encrypted_reasoning {
                    item["encrypted_content"] = text.clone();
                }
                out.push(json!({"type": "response.reasoning_text.done", "item_id": id, "output_index": i,
                                "content_index": 0, "text": text}));
            }
            _ => {
                let part = item["content"][0].clone();
                out.push(json!({"type": "response.output_text.done", "item_id": id, "output_index": i,
                                "content_index": 0, "text": part["text"], "logprobs": []}));
                out.push(json!({"type": "response.content_part.done", "item_id": id, "output_index": i,
                                "content_index": 0, "part": part}));
            }
        }
        out.push(json!({"type": "response.output_item.done", "output_index": i, "item": self.items[i]}));
    }

    /// Appends text to the open item of `kind` (`reasoning` or `message`), opening one if needed.
    fn text(&mut self, kind: &str, delta: &str, out: &mut Emitted) {
        if self.open.is_some_and(|i| self.items[i]["type"] != kind) {
            self.close(out);
        }
        let i = match self.open {
            Some(i) => i,
            None => {
                let i = self.items.len();
                let item = if kind == "reasoning" {
                    json!({"type": "reasoning", "id": new_id("rs_"), "summary": [], "status": "in_progress",
                           "content": [{"type": "reasoning_text", "text": ""}]})
                } else {
                    json!({"type": "message", "id": new_id("msg_"), "role": "assistant", "status": "in_progress",
                           "content": [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]})
                };
                let mut added = item.clone();
                added["content"] = json!([]);
                out.push(json!({"type": "response.output_item.added", "output_index": i, "item": added}));
                if kind == "message" {
                    out.push(json!({"type": "response.content_part.added", "item_id": item["id"], "output_index": i,
                                    "content_index": 0,
                                    "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []}}));
                }
                self.items.push(item);
                self.open = Some(i);
                i
            }
        };
        let item = &mut self.items[i];
        append(&mut item["content"][0]["text"], delta);
        let kind = if kind == "reasoning" { "response.reasoning_text.delta" } else { "response.output_text.delta" };
        let mut e = json!({"type": kind, "item_id": item["id"], "output_index": i, "content_index": 0, "delta": delta});
        if kind == "response.output_text.delta" {
            e["logprobs"] = json!([]);
        }
        out.push(e);
    }

    /// Takes one output event of the chat pipeline.
    fn take(&mut self, e: OutEvent, out: &mut Emitted) {
        match e {
            OutEvent::Reasoning(s) => self.text("reasoning", &s, out),
            OutEvent::Content(s) => self.text("message", &s, out),
            OutEvent::ToolStart { index, id, name } => {
                self.close(out);
                let i = self.items.len();
                let item = json!({"type": "function_call", "id": new_id("fc_"), "call_id": id, "name": name,
                                  "arguments": "", "status": "in_progress"});
                out.push(json!({"type": "response.output_item.added", "output_index": i, "item": item}));
                self.items.push(item);
                self.calls.resize(self.calls.len().max(index + 1), usize::MAX);
                self.calls[index] = i;
            }
            OutEvent::ToolArgs { index, delta } => {
                let Some(&i) = self.calls.get(index).filter(|&&i| i < self.items.len()) else { return };
                let item = &mut self.items[i];
                append(&mut item["arguments"], &delta);
                out.push(json!({"type": "response.function_call_arguments.delta", "item_id": item["id"],
                                "output_index": i, "delta": delta}));
            }
            OutEvent::ToolEnd { index } => {
                let Some(&i) = self.calls.get(index).filter(|&&i| i < self.items.len()) else { return };
                let item = &mut self.items[i];
                item["status"] = json!("completed");
                out.push(json!({"type": "response.function_call_arguments.done", "item_id": item["id"],
                                "output_index": i, "name": item["name"], "arguments": item["arguments"]}));
                out.push(json!({"type": "response.output_item.done", "output_index": i, "item": item}));
            }
            OutEvent::Token { .. }
            | OutEvent::Progress { .. }
            | OutEvent::PromptLogprobs(_)
            | OutEvent::Done { .. } => {}
        }
    }
}

/// Appends `delta` to a string field in place (each token's text, not a copy of the whole reply per token).
fn append(field: &mut Value, delta: &str) {
    match field {
        Value::String(s) => s.push_str(delta),
        other => *other = json!(delta),
    }
}

/// The response object: in progress (no usage yet) or finished.
fn response(
    id: &str,
    model: &str,
    created: u64,
    echo: &Echo,
    items: &[Value],
    end: Option<(&Finish, &Usage, &Timing)>,
) -> Value {
    let (status, incomplete) = match end {
        None => ("in_progress", Value::Null),
        Some((Finish::Length, ..)) => ("incomplete", json!({"reason": "max_output_tokens"})),
        Some(_) => ("completed", Value::Null),
    };
    let usage = end.map_or(Value::Null, |(_, u, _)| {
        json!({"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": u.cached_tokens},
               "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
               "total_tokens": u.prompt_tokens + u.completion_tokens})
    });
    let mut r = json!({
        "id": id, "object": "response", "created_at": created, "status": status, "error": null,
        "incomplete_details": incomplete, "instructions": echo.instructions, "max_output_tokens": echo.max_output_tokens,
        "model": model, "output": items, "parallel_tool_calls": echo.parallel_tool_calls,
        "previous_response_id": null, "reasoning": echo.reasoning, "store": false, "temperature": echo.temperature,
        "text": echo.text, "tool_choice": echo.tool_choice, "tools": echo.tools, "top_p": echo.top_p,
        "truncation": "disabled", "usage": usage, "metadata": {}, "user": null,
    });
    if let Some((_, u, t)) = end {
        r["timings"] = timings_json(u, t);
    }
    r
}

/// Runs the reply to its end and returns the response object.
pub async fn whole(mut out: OutputStream, echo: Echo, model: String) -> Result<Response, ApiError> {
    let (id, created) = (new_id("resp_"), unix_now());
    let mut items = Items::new(echo.encrypted_reasoning);
    let mut sink = Emitted::new();
    while let Some(batch) = out.next().await {
        for e in batch? {
            if let OutEvent::Done { finish, usage, timing } = &e {
                items.close(&mut sink);
                let r = response(&id, &model, created, &echo, &items.items, Some((finish, usage, timing)));
                return Ok(axum::Json(r).into_response());
            }
            items.take(e, &mut sink);
        }
        sink.clear();
    }
    Err(ApiError::Unavailable("the reply ended without finishing".into()))
}

/// The stream's sender: numbers each event (`sequence_number`) and names it by its type.
struct Numbered {
    tx: mpsc::Sender<Result<SseEvent, Infallible>>,
    seq: u64,
}

impl Numbered {
    /// Sends `v`; false once the client has gone.
    async fn send(&mut self, mut v: Value) -> bool {
        v["sequence_number"] = json!(self.seq);
        self.seq += 1;
        let kind = v["type"].as_str().unwrap_or("message").to_string();
        self.tx.send(Ok(SseEvent::default().event(kind).data(v.to_string()))).await.is_ok()
    }
}

/// Streams the reply as the API's events.
pub fn stream(mut out: OutputStream, echo: Echo, model: String) -> Response {
    let (tx, rx) = mpsc::channel::<Result<SseEvent, Infallible>>(64);
    tokio::spawn(async move {
        let (id, created) = (new_id("resp_"), unix_now());
        let mut tx = Numbered { tx, seq: 0 };
        let start = response(&id, &model, created, &echo, &[], None);
        for kind in ["response.created", "response.in_progress"] {
            if !tx.send(json!({"type": kind, "response": start})).await {
                return;
            }
        }
        let mut items = Items::new(echo.encrypted_reasoning);
        while let Some(batch) = out.next().await {
            let events = match batch {
                Ok(e) => e,
                Err(e) => {
                    let body = e.body(Style::OpenAi);
                    let err = &body["error"];
                    let _ = tx
                        .send(json!({"type": "error", "code": err["code"], "message": err["message"],
                                     "param": err["param"]}))
                        .await;
                    return;
                }
            };
            let mut emitted = Emitted::new();
            let mut end = None;
            for e in events {
                match e {
                    OutEvent::Done { finish, usage, timing } => end = Some((finish, usage, timing)),
                    e => items.take(e, &mut emitted),
                }
            }
            if let Some((finish, usage, timing)) = &end {
                items.close(&mut emitted);
                let kind = if *finish == Finish::Length { "response.incomplete" } else { "response.completed" };
                let r = response(&id, &model, created, &echo, &items.items, Some((finish, usage, timing)));
                emitted.push(json!({"type": kind, "response": r}));
            }
            for v in emitted {
                if !tx.send(v).await {
                    return; // client gone: dropping `out` cancels the request
                }
            }
            if end.is_some() {
                return;
            }
        }
    });
    sse(rx)
}
