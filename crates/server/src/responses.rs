//! `POST /v1/responses`: OpenAI's Responses API (what Codex CLI and the newer SDKs speak), stateless, over
//! the chat pipeline. A request's `instructions` and `input` items become chat messages (messages with
//! text and image parts, `function_call` items an assistant message's tool calls, `function_call_output`
//! items tool messages, `reasoning` items the next assistant message's reasoning), its function `tools`,
//! `tool_choice`, `text.format` and sampling the chat request's; the reply comes back as `reasoning`,
//! `message` and `function_call` output items, streamed as the API's typed events or whole
//! ([`events`]). Nothing is stored: `previous_response_id` is refused, a client sends the conversation
//! (the prefix cache makes that cheap). Hosted tools (web search, file search, ...) are left out: the
//! model cannot call them here; other tool types are refused.

mod events;

use axum::Extension;
use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::response::Response;
use serde::Deserialize;
use serde_json::{Map, Value, json};

use crate::error::ApiError;
use crate::openai::{ChatCompletionRequest, finish_response, parse_body, start_chat};
use crate::request::type_name;
use crate::state::{AppState, ChatDefaults};

#[derive(Debug, Default, Deserialize)]
pub struct ResponsesRequest {
    model: Option<String>,
    input: Option<Value>,
    instructions: Option<String>,
    tools: Option<Vec<Value>>,
    tool_choice: Option<Value>,
    parallel_tool_calls: Option<bool>,
    max_output_tokens: Option<u64>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<i64>,
    min_p: Option<f32>,
    seed: Option<u64>,
    presence_penalty: Option<f32>,
    frequency_penalty: Option<f32>,
    repetition_penalty: Option<f32>,
    ignore_eos: Option<bool>,
    stream: Option<bool>,
    text: Option<Value>,
    reasoning: Option<Value>,
    include: Option<Vec<String>>,
    previous_response_id: Option<Value>,
    chat_template_kwargs: Option<Map<String, Value>>,
}

pub async fn responses(
    State(st): State<AppState>,
    Extension(chat): Extension<ChatDefaults>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let result = responses_inner(&st, &chat, body).await;
    finish_response(&st, "responses", result)
}

async fn responses_inner(
    st: &AppState,
    chat: &ChatDefaults,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let req: ResponsesRequest = parse_body(body)?;
    let chat_req = to_chat(&req)?;
    let (mut outs, _) = start_chat(st, chat, &chat_req).await?;
    let echo = events::Echo::of(&req);
    let out = outs.remove(0);
    if req.stream.unwrap_or(false) {
        return Ok(events::stream(out, echo, st.cfg.served_model_name.clone()));
    }
    events::whole(out, echo, st.cfg.served_model_name.clone()).await
}

/// The chat request a Responses request asks for.
fn to_chat(req: &ResponsesRequest) -> Result<ChatCompletionRequest, ApiError> {
    if req.previous_response_id.as_ref().is_some_and(|v| !v.is_null()) {
        return Err(ApiError::bad_param(
            "previous_response_id",
            "`previous_response_id` is not supported: this server stores no responses; send the whole \
             conversation in `input` (its prefix cache restores what it has seen)",
        ));
    }
    let input = req.input.as_ref().ok_or_else(|| ApiError::bad_param("input", "`input` is missing"))?;
    let messages = messages(req.instructions.as_deref(), input)?;
    let tools = req.tools.iter().flatten().enumerate().map(chat_tool).collect::<Result<Vec<_>, _>>()?;
    let tools: Vec<Value> = tools.into_iter().flatten().collect();
    let mut kwargs = req.chat_template_kwargs.clone().unwrap_or_default();
    if req.reasoning.as_ref().and_then(|r| r.get("effort")).and_then(Value::as_str) == Some("none") {
        kwargs.entry("enable_thinking").or_insert(json!(false));
    }
    let mut chat = json!({
        "model": req.model,
        "messages": messages,
        "max_completion_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "min_p": req.min_p,
        "seed": req.seed,
        "presence_penalty": req.presence_penalty,
        "frequency_penalty": req.frequency_penalty,
        "repetition_penalty": req.repetition_penalty,
        "ignore_eos": req.ignore_eos,
        "parallel_tool_calls": req.parallel_tool_calls,
        "chat_template_kwargs": kwargs,
    });
    if !tools.is_empty() {
        chat["tools"] = Value::Array(tools);
        if let Some(choice) = &req.tool_choice {
            chat["tool_choice"] = chat_tool_choice(choice)?;
        }
    }
    if let Some(format) = req.text.as_ref().and_then(|t| t.get("format")) {
        chat["response_format"] = response_format(format)?;
    }
    serde_json::from_value(chat).map_err(|e| ApiError::bad(format!("invalid request: {e}")))
}

/// Tool types the API runs on its own side (search, hosted tools): the model cannot call them here, so a
/// request that offers them runs without them.
const HOSTED_TOOLS: [&str; 9] = [
    "web_search",
    "web_search_preview",
    "file_search",
    "image_generation",
    "code_interpreter",
    "computer_use_preview",
    "mcp",
    "namespace",
    "local_shell",
];

/// Tool `i` in the chat shape: a function tool as one; None for a hosted tool ([`HOSTED_TOOLS`]); an
/// error for a tool the model would be expected to call but cannot here (a `custom` grammar tool).
fn chat_tool((i, tool): (usize, &Value)) -> Result<Option<Value>, ApiError> {
    match tool.get("type").and_then(Value::as_str) {
        Some("function") => {}
        Some(kind) if HOSTED_TOOLS.contains(&kind) => {
            tracing::debug!(tool = kind, "responses: a hosted tool is left out");
            return Ok(None);
        }
        kind => {
            return Err(ApiError::bad_param(
                "tools",
                format!("tools[{i}] of type {kind:?} is not supported (function tools are; hosted tools are left out)"),
            ));
        }
    }
    let mut f = Map::new();
    for key in ["name", "description", "parameters"] {
        if let Some(v) = tool.get(key).filter(|v| !v.is_null()) {
            f.insert(key.into(), v.clone());
        }
    }
    Ok(Some(json!({"type": "function", "function": f})))
}

fn chat_tool_choice(choice: &Value) -> Result<Value, ApiError> {
    match choice {
        Value::String(_) => Ok(choice.clone()),
        Value::Object(o) if o.get("type").and_then(Value::as_str) == Some("function") => {
            let name = o.get("name").and_then(Value::as_str).ok_or_else(|| {
                ApiError::bad_param("tool_choice", "tool_choice {\"type\": \"function\"} needs a `name`")
            })?;
            Ok(json!({"type": "function", "function": {"name": name}}))
        }
        other => Err(ApiError::bad_param(
            "tool_choice",
            format!("tool_choice {other} is not supported (\"auto\", \"none\", \"required\" or a function)"),
        )),
    }
}

/// `text.format` as a chat `response_format`.
fn response_format(format: &Value) -> Result<Value, ApiError> {
    match format.get("type").and_then(Value::as_str) {
        Some("text") => Ok(json!({"type": "text"})),
        Some("json_object") => Ok(json!({"type": "json_object"})),
        Some("json_schema") => {
            let mut schema = Map::new();
            for key in ["name", "schema", "strict", "description"] {
                if let Some(v) = format.get(key).filter(|v| !v.is_null()) {
                    schema.insert(key.into(), v.clone());
                }
            }
            Ok(json!({"type": "json_schema", "json_schema": schema}))
        }
        _ => Err(ApiError::bad_param(
            "text.format",
            format!("text.format {format} is not supported (text, json_object, json_schema)"),
        )),
    }
}

/// The chat messages of `instructions` and `input`. System and developer text before the first other
/// message (the instructions included) becomes one system message, as the chat template wants it.
fn messages(instructions: Option<&str>, input: &Value) -> Result<Vec<Value>, ApiError> {
    let items = match input {
        Value::String(s) => vec![json!({"role": "user", "content": s})],
        Value::Array(items) => items.clone(),
        other => {
            return Err(ApiError::bad_param(
                "input",
                format!("`input` must be a string or a list of items, got {}", type_name(other)),
            ));
        }
    };
    let mut system: Vec<String> = instructions.filter(|s| !s.is_empty()).map(str::to_string).into_iter().collect();
    let mut out: Vec<Value> = Vec::new();
    // Reasoning items wait for the assistant message they belong to (the next one).
    let mut reasoning = String::new();
    for (i, item) in items.iter().enumerate() {
        let bad = |what: String| ApiError::bad_param("input", format!("input[{i}]{what}"));
        let obj = item.as_object().ok_or_else(|| bad(" must be an object".into()))?;
        let kind =
            obj.get("type").and_then(Value::as_str).unwrap_or(if obj.contains_key("role") { "message" } else { "" });
        match kind {
            "message" => {
                let role = obj.get("role").and_then(Value::as_str).ok_or_else(|| bad(".role is missing".into()))?;
                let content = parts(obj.get("content"), i)?;
                if matches!(role, "system" | "developer") && out.is_empty() {
                    system.push(text_of(&content));
                    continue;
                }
                let mut m = json!({"role": role, "content": content});
                if role == "assistant" && !reasoning.is_empty() {
                    m["reasoning_content"] = json!(std::mem::take(&mut reasoning));
                }
                out.push(m);
            }
            "function_call" => {
                let field = |k: &str| {
                    obj.get(k).and_then(Value::as_str).ok_or_else(|| bad(format!(".{k} is missing or not a string")))
                };
                let call = json!({"id": field("call_id")?, "type": "function",
                                  "function": {"name": field("name")?, "arguments": field("arguments")?}});
                // Calls after an assistant message (or after each other) join its tool calls.
                match out.last_mut().filter(|m| m["role"] == "assistant") {
                    Some(last) if reasoning.is_empty() => {
                        last.as_object_mut().map(|m| m.entry("tool_calls").or_insert_with(|| json!([])));
                        if let Some(calls) = last["tool_calls"].as_array_mut() {
                            calls.push(call);
                        }
                    }
                    _ => {
                        let mut m = json!({"role": "assistant", "content": "", "tool_calls": [call]});
                        if !reasoning.is_empty() {
                            m["reasoning_content"] = json!(std::mem::take(&mut reasoning));
                        }
                        out.push(m);
                    }
                }
            }
            "function_call_output" => {
                let id = obj.get("call_id").and_then(Value::as_str).ok_or_else(|| bad(".call_id is missing".into()))?;
                let output = match obj.get("output") {
                    Some(Value::String(s)) => s.clone(),
                    Some(v @ Value::Array(_)) => text_of(&parts(Some(v), i)?),
                    _ => return Err(bad(".output must be a string or a list of text parts".into())),
                };
                out.push(json!({"role": "tool", "tool_call_id": id, "content": output}));
            }
            "reasoning" => reasoning.push_str(&reasoning_text(obj)),
            other => {
                return Err(bad(format!(
                    ": items of type `{other}` are not supported (message, function_call, function_call_output, \
                     reasoning)"
                )));
            }
        }
    }
    if out.is_empty() {
        // Nothing but instructions (or nothing at all: a client's probe): an empty user turn to answer.
        out.push(json!({"role": "user", "content": ""}));
    }
    if !system.is_empty() {
        out.insert(0, json!({"role": "system", "content": system.join("\n\n")}));
    }
    Ok(out)
}

/// A reasoning item's text: its `content` (this server's items carry the whole reasoning there), else its
/// `encrypted_content` (which this server's items fill with the same text when asked, for clients that send
/// back only that), else its `summary`.
fn reasoning_text(obj: &Map<String, Value>) -> String {
    let texts = |k: &str| -> Option<String> {
        let parts = obj.get(k)?.as_array()?;
        let text: String = parts.iter().filter_map(|p| p.get("text")?.as_str()).collect();
        (!text.is_empty()).then_some(text)
    };
    texts("content")
        .or_else(|| obj.get("encrypted_content")?.as_str().filter(|t| !t.is_empty()).map(str::to_string))
        .or_else(|| texts("summary"))
        .unwrap_or_default()
}

/// Item content as chat content: a string, or text and image parts.
fn parts(content: Option<&Value>, i: usize) -> Result<Value, ApiError> {
    let list = match content {
        None | Some(Value::Null) => return Ok(json!("")),
        Some(Value::String(s)) => return Ok(json!(s)),
        Some(Value::Array(list)) => list,
        Some(other) => {
            return Err(ApiError::bad_param(
                "input",
                format!("input[{i}].content must be a string or a list of parts, got {}", type_name(other)),
            ));
        }
    };
    let out = list
        .iter()
        .enumerate()
        .map(|(j, p)| {
            let kind = p.get("type").and_then(Value::as_str).unwrap_or("");
            let text = |k: &str| p.get(k).and_then(Value::as_str).map(|t| json!({"type": "text", "text": t}));
            let url = p.get("image_url").and_then(|u| u.as_str().or_else(|| u.get("url")?.as_str()));
            match kind {
                "input_text" | "output_text" | "text" | "summary_text" | "reasoning_text" => text("text"),
                "refusal" => text("refusal"),
                "input_image" => url.map(|u| json!({"type": "image_url", "image_url": {"url": u}})),
                _ => None,
            }
            .ok_or_else(|| {
                ApiError::bad_param(
                    "input",
                    format!(
                        "input[{i}].content[{j}] is not a part this server reads (input_text, output_text, refusal, \
                         input_image with an image_url)"
                    ),
                )
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Value::Array(out))
}

/// The text of chat content (its text parts joined).
fn text_of(content: &Value) -> String {
    match content {
        Value::String(s) => s.clone(),
        Value::Array(parts) => parts.iter().filter_map(|p| p.get("text")?.as_str()).collect(),
        _ => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn items_become_chat_messages() {
        let input = json!([
            {"type": "message", "role": "developer", "content": "Use the tools."},
            {"role": "user", "content": [{"type": "input_text", "text": "List the files."}]},
            {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "ls it"}]},
            {"type": "function_call", "call_id": "c1", "name": "shell", "arguments": "{\"cmd\":\"ls\"}"},
            {"type": "function_call", "call_id": "c2", "name": "shell", "arguments": "{\"cmd\":\"pwd\"}"},
            {"type": "function_call_output", "call_id": "c1", "output": "a.rs"},
            {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "/w"}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Done."}]},
        ]);
        let m = messages(Some("You are Codex."), &input).unwrap();
        assert_eq!(m[0], json!({"role": "system", "content": "You are Codex.\n\nUse the tools."}));
        assert_eq!(m[1], json!({"role": "user", "content": [{"type": "text", "text": "List the files."}]}));
        assert_eq!(m[2]["role"], "assistant");
        assert_eq!(m[2]["reasoning_content"], "ls it");
        let calls = m[2]["tool_calls"].as_array().unwrap();
        assert_eq!(calls.len(), 2, "parallel calls join one assistant message: {m:?}");
        assert_eq!(
            calls[1],
            json!({"id": "c2", "type": "function", "function": {"name": "shell", "arguments": "{\"cmd\":\"pwd\"}"}})
        );
        assert_eq!(m[3], json!({"role": "tool", "tool_call_id": "c1", "content": "a.rs"}));
        assert_eq!(m[4], json!({"role": "tool", "tool_call_id": "c2", "content": "/w"}));
        assert_eq!(m[5], json!({"role": "assistant", "content": [{"type": "text", "text": "Done."}]}));
        assert_eq!(messages(None, &json!("hi")).unwrap(), [json!({"role": "user", "content": "hi"})]);
        assert_eq!(messages(None, &json!([])).unwrap(), [json!({"role": "user", "content": ""})], "a probe");
        // A reasoning item sent back with its text in content, in encrypted_content only, or in a summary only.
        for item in [
            json!({"type": "reasoning", "content": [{"type": "reasoning_text", "text": "r"}], "summary": [{"type": "summary_text", "text": "r"}]}),
            json!({"type": "reasoning", "summary": [], "encrypted_content": "r"}),
            json!({"type": "reasoning", "summary": [{"type": "summary_text", "text": "r"}], "encrypted_content": null}),
        ] {
            let m =
                messages(None, &json!([{"role": "user", "content": "q"}, item, {"role": "assistant", "content": "a"}]));
            assert_eq!(m.unwrap()[1]["reasoning_content"], "r");
        }
    }

    #[test]
    fn requests_map_to_chat_fields_and_bad_ones_name_theirs() {
        let req: ResponsesRequest = serde_json::from_value(json!({
            "input": "hi", "max_output_tokens": 9, "temperature": 0.5,
            "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}, {"type": "web_search"}],
            "tool_choice": {"type": "function", "name": "f"},
            "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
            "reasoning": {"effort": "none"},
        }))
        .unwrap();
        let c = to_chat(&req).unwrap();
        assert_eq!(c.common.max_completion_tokens, Some(9));
        assert_eq!(c.tools.as_ref().map(Vec::len), Some(1), "the web search tool is left out");
        assert_eq!(c.tool_choice, Some(json!({"type": "function", "function": {"name": "f"}})));
        assert_eq!(c.response_format.as_ref().unwrap()["json_schema"]["name"], "x");
        assert_eq!(c.chat_template_kwargs.as_ref().unwrap()["enable_thinking"], false);
        let bad = |body: Value, param: &str| {
            let req: ResponsesRequest = serde_json::from_value(body).unwrap();
            let e = to_chat(&req).unwrap_err();
            assert_eq!(e.status(), axum::http::StatusCode::BAD_REQUEST);
            assert!(e.body(crate::error::Style::OpenAi).to_string().contains(param), "{param}: {}", e.message());
        };
        bad(json!({"input": "hi", "previous_response_id": "resp_1"}), "previous_response_id");
        bad(json!({}), "input");
        bad(json!({"input": [{"type": "item_reference", "id": "x"}]}), "input[0]");
        bad(json!({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}), "content[0]");
        bad(json!({"input": "hi", "text": {"format": {"type": "grammar"}}}), "text.format");
        bad(json!({"input": "hi", "tools": [{"type": "custom", "name": "apply_patch"}]}), "tools[0]");
    }
}
