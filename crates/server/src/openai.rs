//! The OpenAI API: `/v1/chat/completions`, `/v1/completions` (both streaming over SSE and not) and
//! `/v1/models` (and `/v1/models/{id}`), with vLLM's extensions (`top_k`, `min_p`, `repetition_penalty`, `ignore_eos`,
//! `chat_template_kwargs`) and Qwen reasoning/tool-call parsing.

use std::convert::Infallible;

use axum::Extension;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Map, Value, json};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use crate::completions::vllm_prompt_logprobs;
use crate::error::{ApiError, Style};
use crate::media::load_images;
use crate::output::{Collected, Finish, OutEvent, OutputStream, PromptToken, combined_usage, merged};
use crate::request::{
    CommonParams, Limits, build_request, new_id, normalize_messages, render_chat, unix_now, validate_tools,
};
use crate::state::{AppState, ChatDefaults};
use crate::structured;
use crate::thinking;
use crate::timings::{progress_json, timings_json};

#[derive(Debug, Deserialize)]
pub struct ChatCompletionRequest {
    pub model: Option<String>,
    pub messages: Vec<Value>,
    #[serde(flatten)]
    pub common: CommonParams,
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<u32>,
    pub tools: Option<Vec<Value>>,
    pub tool_choice: Option<Value>,
    pub response_format: Option<Value>,
    pub chat_template_kwargs: Option<Map<String, Value>>,
    pub parallel_tool_calls: Option<bool>,
    /// OpenAI's: `none` turns thinking off, another level on (as vLLM maps it), unless
    /// `chat_template_kwargs` says.
    pub reasoning_effort: Option<String>,
    /// vLLM's (SGLang's `thinking_budget`, llama.cpp's `thinking_budget_tokens`): the most reasoning tokens
    /// before the reasoning is closed ([`crate::thinking`]); negative: no budget.
    #[serde(alias = "thinking_budget", alias = "thinking_budget_tokens")]
    pub thinking_token_budget: Option<i64>,
}

/// The reasoning efforts `reasoning_effort` takes.
const EFFORTS: [&str; 6] = ["none", "minimal", "low", "medium", "high", "xhigh"];

/// Parses a JSON body, mapping every failure to 400 (or 413 when the body exceeds the limit).
pub fn parse_body<T: serde::de::DeserializeOwned>(body: Result<Bytes, BytesRejection>) -> Result<T, ApiError> {
    let bytes = body.map_err(|e| {
        if e.status() == axum::http::StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::TooLarge(format!("the request body is too large: {e}"))
        } else {
            ApiError::bad(format!("could not read the request body: {e}"))
        }
    })?;
    let value: Value =
        serde_json::from_slice(&bytes).map_err(|e| ApiError::bad(format!("the body is not valid JSON: {e}")))?;
    if !value.is_object() {
        return Err(ApiError::bad("the body must be a JSON object"));
    }
    // Name the offending field, as vLLM does (`temperature: invalid type: string "hot", expected f32`).
    serde_path_to_error::deserialize(value.clone()).map_err(|e| {
        // `#[serde(flatten)]` hides the path of the shared sampling fields: look there again.
        let e = match serde_path_to_error::deserialize::<_, CommonParams>(value) {
            Err(inner) if e.path().to_string() == "." => inner,
            _ => e,
        };
        let path = e.path().to_string();
        let field = path.split(['.', '[']).next().unwrap_or_default().to_string();
        let msg = format!("invalid request: `{path}`: {}", e.inner());
        if field.is_empty() || field == "?" { ApiError::bad(msg) } else { ApiError::bad_param(&field, msg) }
    })
}

pub async fn chat_completions(
    State(st): State<AppState>,
    Extension(chat): Extension<ChatDefaults>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let result = chat_inner(&st, &chat, body).await;
    finish_response(&st, "chat_completions", result)
}

async fn chat_inner(
    st: &AppState,
    chat: &ChatDefaults,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let req: ChatCompletionRequest = parse_body(body)?;
    let (outs, logprobs) = start_chat(st, chat, &req).await?;
    let c = &req.common;
    let id = new_id("chatcmpl-");
    let model = st.cfg.served_model_name.clone();
    let prompt_logprobs = c.prompt_logprobs()?;
    if c.streams() {
        let shape = ChatStream { include_usage: c.include_usage(), logprobs: logprobs.is_some(), prompt_logprobs };
        return Ok(sse(chat_stream(outs, id, model, shape)));
    }
    let cols = Collected::collect_all(outs).await?;
    let choices: Vec<Value> =
        cols.iter().enumerate().map(|(i, col)| chat_choice(st, i, col, logprobs.is_some())).collect();
    let scores =
        prompt_logprobs.zip(cols.first()).map(|(k, col)| vllm_prompt_logprobs(&st.tokenizer, &col.prompt_logprobs, k));
    Ok(axum::Json(json!({
        "prompt_logprobs": scores,
        "id": id,
        "object": "chat.completion",
        "created": unix_now(),
        "model": model,
        "choices": choices,
        "usage": usage_json(&combined_usage(cols.iter().map(|c| &c.usage))),
        "timings": first_timings(&cols),
    }))
    .into_response())
}

/// Checks a chat request, renders and submits it: the output stream of each choice, and the logprobs
/// it asked for (the number of alternatives). The Responses API runs its requests through here too.
pub async fn start_chat(
    st: &AppState,
    chat: &ChatDefaults,
    req: &ChatCompletionRequest,
) -> Result<(Vec<OutputStream>, Option<usize>), ApiError> {
    let received = std::time::Instant::now();
    st.check_model(req.model.as_deref())?;
    req.common.validate()?;
    let n = req.common.choices(st.engine.sched_config().max_seqs)?;
    let format = structured::response_format(req.response_format.as_ref())?;
    // `Some(name)`: a forced call (`None`: any tool, `required`).
    let mut forced: Option<Option<String>> = None;
    let tools = match (&req.tools, &req.tool_choice) {
        (_, Some(Value::String(c))) if c == "none" => None,
        (_, Some(Value::String(c))) if c == "auto" => req.tools.clone(),
        (_, None) => req.tools.clone(),
        (_, Some(Value::String(c))) if c == "required" => {
            forced = Some(None);
            req.tools.clone()
        }
        (_, Some(choice)) if choice.get("type").and_then(Value::as_str) == Some("function") => {
            let name = choice.get("function").and_then(|f| f.get("name")).and_then(Value::as_str);
            let name =
                name.ok_or_else(|| ApiError::bad_param("tool_choice", "tool_choice.function.name is missing"))?;
            forced = Some(Some(name.to_string()));
            req.tools.clone()
        }
        (_, Some(other)) => {
            return Err(ApiError::bad_param(
                "tool_choice",
                format!(
                    "tool_choice {other} is not supported (\"auto\", \"none\", \"required\" or a named function are)"
                ),
            ));
        }
    };
    if let Some(t) = &tools {
        validate_tools(t)?;
    }
    let grammar = match (format, forced) {
        (Some(_), Some(_)) => {
            return Err(ApiError::bad_param(
                "response_format",
                "response_format cannot be combined with a tool_choice that forces a tool call",
            ));
        }
        (Some(g), None) => Some((g, "response_format")),
        (None, Some(name)) => {
            let parallel = req.parallel_tool_calls.unwrap_or(true);
            Some((structured::forced_tool_call(tools.as_deref(), name.as_deref(), parallel)?, "tool_choice"))
        }
        (None, None) => None,
    };
    let grammar = match (grammar, structured::guided(&req.common)?) {
        (Some(_), Some((_, field))) => {
            return Err(ApiError::bad_param(
                field,
                format!("`{field}` cannot be combined with response_format or a tool_choice that forces a tool call"),
            ));
        }
        (g, None) | (None, g) => g,
    };
    let top_logprobs = req.top_logprobs.unwrap_or(0) as usize;
    if top_logprobs > 20 {
        return Err(ApiError::bad_param("top_logprobs", "`top_logprobs` must be between 0 and 20"));
    }
    let logprobs = req.logprobs.unwrap_or(false).then_some(top_logprobs);
    let (messages, image_parts) = normalize_messages(&req.messages)?;
    let images = load_images(st, image_parts).await?;
    let mut request_kwargs = req.chat_template_kwargs.clone().unwrap_or_default();
    if let Some(effort) = &req.reasoning_effort {
        if !EFFORTS.contains(&effort.as_str()) {
            let msg = format!("`reasoning_effort` must be one of {}, got {effort:?}", EFFORTS.join(", "));
            return Err(ApiError::bad_param("reasoning_effort", msg));
        }
        request_kwargs.entry("enable_thinking").or_insert(json!(effort != "none"));
    }
    let kwargs = chat.merged(request_kwargs);
    let (prompt, mut parsing) = render_chat(st, messages, tools, kwargs, &images, true)?;
    let c = &req.common;
    let mut engine_req = build_request(
        prompt,
        Limits {
            chat: true,
            max_tokens: c.max_completion_tokens.or(c.max_tokens),
            sampling: c.sampling(&st.sampling_defaults, st.tokenizer.vocab_size())?,
            stop: c.stops(),
            ignore_eos: c.ignore_eos.unwrap_or(false),
            stop_token_ids: c.stop_token_ids(st.tokenizer.vocab_size())?,
            logprobs,
            images,
            state: st,
        },
    )?;
    if let Some((g, field)) = &grammar {
        engine_req.constraint = Some(structured::constraint(st, g, field, &mut parsing)?);
    }
    c.apply_token_rules(&mut engine_req, st.tokenizer.vocab_size(), grammar.as_ref().map(|(_, f)| f.as_ref()))?;
    let budget = req.thinking_token_budget.map_or(st.cfg.reasoning_budget, |b| usize::try_from(b).ok());
    if let Some(budget) = budget {
        thinking::budget(st, budget, &mut engine_req, &parsing, "thinking_token_budget")?;
    }
    engine_req.progress = c.progress();
    engine_req.prompt_logprobs = c.prompt_logprobs()?;
    if engine_req.prompt_logprobs.is_some() && !st.engine.scores_prompts() {
        return Err(ApiError::bad_param("prompt_logprobs", deltaserve_engine::NO_PROMPT_LOGPROBS));
    }
    tracing::debug!(
        prompt = engine_req.prompt.len(),
        prepare_ms = format!("{:.1}", received.elapsed().as_secs_f64() * 1e3),
        "chat request parsed, rendered and tokenised"
    );
    Ok((st.generate_n(engine_req, n, parsing)?, logprobs))
}

/// Choice `index` of a chat completion.
fn chat_choice(st: &AppState, index: usize, col: &Collected, logprobs: bool) -> Value {
    let finish = col.finish.clone().unwrap_or(Finish::Length);
    let mut message = json!({
        "role": "assistant",
        "content": if col.content.is_empty() && !col.tool_calls.is_empty() { Value::Null } else { json!(col.content) },
        "reasoning_content": if col.reasoning.is_empty() { Value::Null } else { json!(col.reasoning) },
    });
    if !col.tool_calls.is_empty() {
        message["tool_calls"] = Value::Array(
            col.tool_calls
                .iter()
                .map(|(id, name, args)| json!({"id": id, "type": "function", "function": {"name": name, "arguments": args}}))
                .collect(),
        );
    }
    let logprobs_json = logprobs
        .then(|| json!({ "content": col.tokens.iter().map(|(_, t, lp)| chat_logprob(st, t, lp)).collect::<Vec<_>>() }));
    json!({ "index": index, "message": message, "logprobs": logprobs_json, "finish_reason": finish_reason(&finish), "stop_reason": finish.stop_string() })
}

/// What a streamed chat completion returns besides its deltas.
struct ChatStream {
    /// A usage chunk once every choice is done.
    include_usage: bool,
    /// The generated tokens' logprobs.
    logprobs: bool,
    /// vLLM's `prompt_logprobs` (this many alternatives), with the first chunk after they are known.
    prompt_logprobs: Option<usize>,
}

/// The SSE events of a streamed chat completion (of each choice, tagged with its index; the usage,
/// when asked for, once every choice is done).
fn chat_stream(
    outs: Vec<OutputStream>,
    id: String,
    model: String,
    shape: ChatStream,
) -> mpsc::Receiver<Result<SseEvent, Infallible>> {
    let ChatStream { include_usage, logprobs: with_logprobs, prompt_logprobs } = shape;
    let (tx, rx) = mpsc::channel(64);
    let created = unix_now();
    let n = outs.len();
    let tokenizer_for_lp = outs[0].tokenizer();
    let mut outs = merged(outs);
    tokio::spawn(async move {
        let chunk = |index: usize, delta: Value, finish: Value, logprobs: Value| {
            json!({"id": id, "object": "chat.completion.chunk", "created": created, "model": model,
                   "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]})
        };
        for i in 0..n {
            let role = chunk(i, json!({"role": "assistant", "content": ""}), Value::Null, Value::Null);
            if send_json(&tx, role).await.is_err() {
                return;
            }
        }
        let mut usages = Vec::with_capacity(n);
        // The prompt's scores go with the first choice's next chunk.
        let mut scores: Vec<PromptToken> = Vec::new();
        while let Some((index, events)) = next_events(&mut outs, &tx).await {
            let mut delta = Map::new();
            let mut calls: Vec<Value> = Vec::new();
            let mut lps: Vec<Value> = Vec::new();
            let mut done = None;
            for e in events {
                match e {
                    OutEvent::Reasoning(s) => append(&mut delta, "reasoning_content", &s),
                    OutEvent::Content(s) => append(&mut delta, "content", &s),
                    OutEvent::ToolStart { index, id, name } => calls.push(
                        json!({"index": index, "id": id, "type": "function", "function": {"name": name, "arguments": ""}}),
                    ),
                    OutEvent::ToolArgs { index, delta } => {
                        calls.push(json!({"index": index, "function": {"arguments": delta}}));
                    }
                    OutEvent::ToolEnd { .. } => {}
                    OutEvent::Token { text, logprob, .. } => {
                        if with_logprobs {
                            lps.push(logprob_entry(&tokenizer_for_lp, &text, &logprob));
                        }
                    }
                    OutEvent::Progress { processed, total, cached, elapsed_ms } => {
                        let p = progress_json(processed, total, cached, elapsed_ms);
                        let v = json!({"id": id, "object": "chat.completion.chunk", "created": created,
                                       "model": model, "choices": [], "prompt_progress": p});
                        if send_json(&tx, v).await.is_err() {
                            return;
                        }
                    }
                    OutEvent::PromptLogprobs(p) => scores.extend(p),
                    OutEvent::Done { finish, usage, timing } => done = Some((finish, usage, timing)),
                }
            }
            let scored = |mut v: Value, scores: &mut Vec<PromptToken>| {
                if let Some(k) = prompt_logprobs.filter(|_| index == 0 && !scores.is_empty()) {
                    v["prompt_logprobs"] = vllm_prompt_logprobs(&tokenizer_for_lp, scores, k);
                    scores.clear();
                }
                v
            };
            if !calls.is_empty() {
                delta.insert("tool_calls".into(), Value::Array(calls));
            }
            if !delta.is_empty() || !lps.is_empty() {
                let lp = if lps.is_empty() { Value::Null } else { json!({ "content": lps }) };
                let v = scored(chunk(index, Value::Object(delta), Value::Null, lp), &mut scores);
                if send_json(&tx, v).await.is_err() {
                    return; // client gone: dropping `outs` cancels the request
                }
            }
            if let Some((finish, usage, timing)) = done {
                let mut last = scored(chunk(index, json!({}), json!(finish_reason(&finish)), Value::Null), &mut scores);
                last["choices"][0]["stop_reason"] = finish.stop_string();
                last["timings"] = timings_json(&usage, &timing);
                let _ = send_json(&tx, last).await;
                usages.push(usage);
            }
        }
        if include_usage && usages.len() == n {
            let usage = usage_json(&combined_usage(&usages));
            let _ = send_json(
                &tx,
                json!({"id": id, "object": "chat.completion.chunk", "created": created, "model": model,
                       "choices": [], "usage": usage}),
            )
            .await;
        }
        let _ = tx.send(Ok(SseEvent::default().data("[DONE]"))).await;
    });
    rx
}

/// The `timings` of a non-streamed response: its first choice's (the one whose prompt ran).
pub(crate) fn first_timings(cols: &[Collected]) -> Value {
    cols.first().map_or(Value::Null, |c| timings_json(&c.usage, &c.timing))
}

/// The next batch of one choice's events from `outs`: None once every choice is done, or after
/// sending an error (which ends the choices' events).
pub(crate) async fn next_events(
    outs: &mut mpsc::Receiver<(usize, Result<Vec<OutEvent>, ApiError>)>,
    tx: &mpsc::Sender<Result<SseEvent, Infallible>>,
) -> Option<(usize, Vec<OutEvent>)> {
    match outs.recv().await? {
        (index, Ok(events)) => Some((index, events)),
        (_, Err(e)) => {
            let _ = send_json(tx, e.body(Style::OpenAi)).await;
            None
        }
    }
}

pub async fn models(State(st): State<AppState>) -> Response {
    st.metrics.request("models", 200);
    axum::Json(json!({ "object": "list", "data": [model_object(&st)] })).into_response()
}

/// `GET /v1/models/{id}`: the served model, or a 404 for any other id.
pub async fn model(State(st): State<AppState>, Path(id): Path<String>) -> Response {
    let result = st.check_model(Some(&id)).map(|()| axum::Json(model_object(&st)).into_response());
    finish_response(&st, "model", result)
}

fn model_object(st: &AppState) -> Value {
    json!({
        "id": st.cfg.served_model_name,
        "object": "model",
        "created": unix_now(),
        "owned_by": "deltaserve",
        "root": st.cfg.served_model_name,
        "max_model_len": st.engine.sched_config().max_context,
    })
}

pub fn finish_reason(f: &Finish) -> &'static str {
    match f {
        Finish::Stop | Finish::StopString(_) => "stop",
        Finish::Length => "length",
        Finish::ToolCalls => "tool_calls",
    }
}

pub fn usage_json(u: &deltaserve_engine::Usage) -> Value {
    json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": { "cached_tokens": u.cached_tokens },
    })
}

fn logprob_entry(tok: &deltaserve_text::Tokenizer, text: &str, lp: &deltaserve_engine::TokenLogprob) -> Value {
    let top: Vec<Value> = lp
        .top
        .iter()
        .map(|(id, l)| {
            let t = tok.decode(&[*id], false).unwrap_or_default();
            json!({"token": t, "logprob": l, "bytes": t.as_bytes()})
        })
        .collect();
    json!({"token": text, "logprob": lp.logprob, "bytes": text.as_bytes(), "top_logprobs": top})
}

fn chat_logprob(st: &AppState, text: &str, lp: &deltaserve_engine::TokenLogprob) -> Value {
    logprob_entry(&st.tokenizer, text, lp)
}

/// The legacy completions `logprobs` object: `top_logprobs` maps each alternative's text to its
/// logprob (as OpenAI and vLLM do); alternatives that decode to the same text keep the best one.
fn append(delta: &mut Map<String, Value>, key: &str, s: &str) {
    match delta.get_mut(key) {
        Some(Value::String(v)) => v.push_str(s),
        _ => {
            delta.insert(key.into(), json!(s));
        }
    }
}

pub async fn send_json(tx: &mpsc::Sender<Result<SseEvent, Infallible>>, v: Value) -> Result<(), ()> {
    tx.send(Ok(SseEvent::default().data(v.to_string()))).await.map_err(|_| ())
}

pub fn sse(rx: mpsc::Receiver<Result<SseEvent, Infallible>>) -> Response {
    Sse::new(ReceiverStream::new(rx)).keep_alive(KeepAlive::default()).into_response()
}

/// Records the request in the metrics and renders an error in the OpenAI style.
pub fn finish_response(st: &AppState, endpoint: &str, r: Result<Response, ApiError>) -> Response {
    let resp = r.unwrap_or_else(|e| {
        if e.status().is_server_error() {
            tracing::error!(endpoint, error = %e.message(), "request failed");
        }
        e.into_response_styled(Style::OpenAi)
    });
    st.metrics.request(endpoint, resp.status().as_u16());
    resp
}
