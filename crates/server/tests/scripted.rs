//! The whole HTTP stack on a scripted backend: a test backend whose logits always pick the next token
//! of a script (reasoning, `</think>`, text, two Qwen XML tool calls, `<|im_end|>`), so reasoning
//! splitting and tool-call parsing are exercised end to end, streamed and not, through both APIs.

use std::collections::HashMap;
use std::sync::Arc;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use deltaserve_backend::host::host_step;
use deltaserve_backend::{ArenaStats, Backend, BackendError, Capabilities, StepBatch, StepOut, Want};
use deltaserve_engine::EngineHandle;
use deltaserve_sched::SchedConfig;
use deltaserve_server::{AppState, ServerConfig, routes};
use deltaserve_text::{ChatTemplate, Tokenizer};
use serde_json::{Value, json};
use tower::ServiceExt;

const SCRIPT: &str = "Let me check the weather.\n</think>\n\nSure, checking.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis \"Île\"\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n<parameter=tz>\nCET\n</parameter>\n</function>\n</tool_call>";

/// Emits `script` token by token after each prompt, then `eos`.
struct ScriptedBackend {
    vocab: usize,
    script: Vec<u32>,
    eos: u32,
    prompt_len: HashMap<u64, usize>,
}

impl Backend for ScriptedBackend {
    fn capabilities(&self) -> Capabilities {
        Capabilities { name: "scripted".into(), vocab_size: self.vocab, launches_ahead: false, max_draft_tokens: 0 }
    }
    fn step(&mut self, batch: &StepBatch, want: Want<'_>, out: &mut StepOut) -> Result<(), BackendError> {
        host_step(batch, self.vocab, want, out, |_, logits, _| {
            for c in batch.seqs.iter().filter(|c| c.want_logits) {
                let end = c.start + c.tokens.len();
                let p = *self.prompt_len.entry(c.seq_id).or_insert(end);
                let next = self.script.get(end - p).copied().unwrap_or(self.eos);
                let mut row = vec![-10.0f32; self.vocab];
                row[next as usize] = 10.0;
                logits.extend(row);
            }
            Ok(())
        })
    }
    deltaserve_backend::without_lookahead_or_drafts!("scripted");
    fn arena_stats(&self) -> ArenaStats {
        ArenaStats::default()
    }
}

fn app() -> axum::Router {
    let dir = deltaserve_text::synth_model::demo_model_dir().unwrap();
    let tokenizer = Arc::new(Tokenizer::from_file(&dir.join("tokenizer.json")).unwrap());
    let template = ChatTemplate::from_dir(&dir).unwrap().map(Arc::new);
    let eos = tokenizer.token_id("<|im_end|>").unwrap();
    let script = tokenizer.encode(SCRIPT).unwrap();
    let backend = ScriptedBackend { vocab: 1024, script, eos, prompt_len: HashMap::new() };
    let sched = SchedConfig {
        max_batch_tokens: 64,
        max_seqs: 4,
        page_size: 16,
        num_pages: 64,
        max_context: 1024,
        max_waiting: 16,
        prefix_cache: deltaserve_sched::PrefixCacheConfig::disabled(16),
        snapshot_interval: 0,
    };
    let engine = EngineHandle::start(Box::new(backend), sched, Some(tokenizer.clone()));
    let state = AppState {
        engine,
        prompt_encoder: deltaserve_server::state::prompt_encoder(&tokenizer),
        tokenizer,
        template,
        metrics: Arc::new(Default::default()),
        cfg: Arc::new(ServerConfig {
            served_model_name: "demo".into(),
            api_key: Some("k".into()),
            max_body_bytes: 1 << 20,
        }),
        eos_ids: vec![eos],
        sampling_defaults: Default::default(),
    };
    routes::router(state)
}

fn tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}},
        {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}}}}
    ])
}

async fn post(app: &axum::Router, path: &str, body: Value) -> (StatusCode, String) {
    post_raw(app, path, body.to_string().into_bytes(), true).await
}

async fn post_raw(app: &axum::Router, path: &str, body: Vec<u8>, auth: bool) -> (StatusCode, String) {
    let mut req = Request::post(path).header("content-type", "application/json");
    if auth {
        req = req.header("authorization", "Bearer k");
    }
    let resp = app.clone().oneshot(req.body(Body::from(body)).unwrap()).await.unwrap();
    let status = resp.status();
    let bytes = axum::body::to_bytes(resp.into_body(), 1 << 24).await.unwrap();
    (status, String::from_utf8(bytes.to_vec()).unwrap())
}

/// `data:` payloads of an SSE body.
fn sse_data(body: &str) -> Vec<String> {
    body.lines().filter_map(|l| l.strip_prefix("data: ")).map(str::to_string).collect()
}

fn check_calls(calls: &[(String, String)]) {
    assert_eq!(calls.len(), 2, "{calls:?}");
    assert_eq!(calls[0].0, "get_weather");
    let args: Value = serde_json::from_str(&calls[0].1).unwrap();
    assert_eq!(args, json!({"city": "Paris \"Île\"", "days": 3}));
    assert_eq!(calls[1].0, "get_time");
    assert_eq!(serde_json::from_str::<Value>(&calls[1].1).unwrap(), json!({"tz": "CET"}));
}

#[tokio::test(flavor = "multi_thread")]
async fn openai_chat_with_reasoning_and_tool_calls() {
    let app = app();
    let req = json!({"model": "demo", "messages": [{"role": "user", "content": "weather?"}], "tools": tools(), "temperature": 0});
    let (status, body) = post(&app, "/v1/chat/completions", req.clone()).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    let choice = &v["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls");
    assert_eq!(choice["message"]["reasoning_content"], "Let me check the weather.");
    assert_eq!(choice["message"]["content"], "Sure, checking.");
    let calls: Vec<(String, String)> = choice["message"]["tool_calls"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| (c["function"]["name"].as_str().unwrap().into(), c["function"]["arguments"].as_str().unwrap().into()))
        .collect();
    check_calls(&calls);

    // Streamed: the deltas rebuild the same message.
    let mut sreq = req;
    sreq["stream"] = json!(true);
    sreq["stream_options"] = json!({"include_usage": true});
    let (status, body) = post(&app, "/v1/chat/completions", sreq).await;
    assert_eq!(status, StatusCode::OK);
    let data = sse_data(&body);
    assert_eq!(data.last().unwrap(), "[DONE]");
    let (mut reasoning, mut content, mut calls, mut finish, mut usage) =
        (String::new(), String::new(), Vec::<(String, String)>::new(), None, None);
    for d in &data[..data.len() - 1] {
        let v: Value = serde_json::from_str(d).unwrap();
        if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
            usage = Some(u.clone());
        }
        let Some(c) = v["choices"].get(0) else { continue };
        let delta = &c["delta"];
        reasoning += delta["reasoning_content"].as_str().unwrap_or("");
        content += delta["content"].as_str().unwrap_or("");
        for tc in delta["tool_calls"].as_array().into_iter().flatten() {
            let i = tc["index"].as_u64().unwrap() as usize;
            if let Some(name) = tc["function"]["name"].as_str() {
                assert!(tc["id"].as_str().unwrap().starts_with("call_"));
                assert_eq!(i, calls.len());
                calls.push((name.into(), String::new()));
            }
            calls[i].1 += tc["function"]["arguments"].as_str().unwrap_or("");
        }
        if let Some(f) = c["finish_reason"].as_str() {
            finish = Some(f.to_string());
        }
    }
    assert_eq!(
        (reasoning.as_str(), content.as_str(), finish.as_deref()),
        ("Let me check the weather.", "Sure, checking.", Some("tool_calls"))
    );
    check_calls(&calls);
    assert!(usage.unwrap()["completion_tokens"].as_u64().unwrap() > 10);
}

#[tokio::test(flavor = "multi_thread")]
async fn anthropic_messages_with_thinking_and_tool_use() {
    let app = app();
    let tools = json!([
        {"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}},
        {"name": "get_time", "input_schema": {"type": "object", "properties": {"tz": {"type": "string"}}}}
    ]);
    let req = json!({"model": "demo", "max_tokens": 200, "messages": [{"role": "user", "content": "weather?"}], "tools": tools});
    let (status, body) = post(&app, "/v1/messages", req.clone()).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["stop_reason"], "tool_use");
    let blocks = v["content"].as_array().unwrap();
    let kinds: Vec<&str> = blocks.iter().map(|b| b["type"].as_str().unwrap()).collect();
    assert_eq!(kinds, ["thinking", "text", "tool_use", "tool_use"]);
    assert_eq!(blocks[0]["thinking"], "Let me check the weather.");
    assert_eq!(blocks[2]["input"], json!({"city": "Paris \"Île\"", "days": 3}));
    assert!(blocks[2]["id"].as_str().unwrap().starts_with("toolu_"));

    let mut sreq = req;
    sreq["stream"] = json!(true);
    let (_, body) = post(&app, "/v1/messages", sreq).await;
    let events: Vec<Value> = sse_data(&body).iter().map(|d| serde_json::from_str(d).unwrap()).collect();
    let types: Vec<&str> = events.iter().map(|e| e["type"].as_str().unwrap()).collect();
    assert_eq!(types.first(), Some(&"message_start"));
    assert_eq!(&types[types.len() - 2..], ["message_delta", "message_stop"]);
    let mut json_by_block: HashMap<u64, String> = HashMap::new();
    for e in &events {
        if e["type"] == "content_block_delta" && e["delta"]["type"] == "input_json_delta" {
            *json_by_block.entry(e["index"].as_u64().unwrap()).or_default() +=
                e["delta"]["partial_json"].as_str().unwrap();
        }
    }
    let mut inputs: Vec<(u64, Value)> =
        json_by_block.into_iter().map(|(k, v)| (k, serde_json::from_str(&v).unwrap())).collect();
    inputs.sort_by_key(|x| x.0);
    assert_eq!(inputs[0].1, json!({"city": "Paris \"Île\"", "days": 3}));
    assert_eq!(events[events.len() - 2]["delta"]["stop_reason"], "tool_use");

    // count_tokens agrees with usage.input_tokens
    let (_, body) = post(&app, "/v1/messages/count_tokens", json!({"model": "demo", "messages": [{"role": "user", "content": "weather?"}], "tools": [{"name": "get_weather", "input_schema": {"type": "object"}}]})).await;
    let counted: Value = serde_json::from_str(&body).unwrap();
    assert!(counted["input_tokens"].as_u64().unwrap() > 10);
}

#[tokio::test(flavor = "multi_thread")]
async fn errors_have_the_right_status_and_body() {
    let app = app();
    let chat = |extra: Value| {
        let mut v = json!({"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4});
        for (k, x) in extra.as_object().unwrap() {
            v[k] = x.clone();
        }
        v
    };
    let cases: Vec<(Value, StatusCode, &str)> = vec![
        (chat(json!({"n": 2})), StatusCode::BAD_REQUEST, "`n`"),
        (chat(json!({"response_format": {"type": "json_object"}})), StatusCode::BAD_REQUEST, "response_format"),
        (chat(json!({"model": "gpt-9"})), StatusCode::NOT_FOUND, "gpt-9"),
        (chat(json!({"temperature": -1})), StatusCode::BAD_REQUEST, "temperature"),
        (chat(json!({"temperature": "hot"})), StatusCode::BAD_REQUEST, "invalid"),
        (chat(json!({"max_tokens": 5000})), StatusCode::BAD_REQUEST, "1024"),
        (chat(json!({"messages": []})), StatusCode::BAD_REQUEST, "messages"),
        (chat(json!({"messages": [{"role": "wizard", "content": "x"}]})), StatusCode::BAD_REQUEST, "wizard"),
        (chat(json!({"tool_choice": "required", "tools": tools()})), StatusCode::BAD_REQUEST, "tool_choice"),
        (json!([1, 2, 3]), StatusCode::BAD_REQUEST, "object"),
    ];
    for (body, want, needle) in cases {
        let (status, text) = post(&app, "/v1/chat/completions", body.clone()).await;
        assert_eq!(status, want, "{body} → {text}");
        let v: Value = serde_json::from_str(&text).unwrap();
        assert!(v["error"]["message"].as_str().unwrap().contains(needle), "{body} → {text}");
    }
    let (status, text) = post_raw(&app, "/v1/chat/completions", b"{not json".to_vec(), true).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{text}");
    let (status, _) = post_raw(&app, "/v1/chat/completions", chat(json!({})).to_string().into_bytes(), false).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    let (status, text) = post_raw(&app, "/v1/chat/completions", vec![b' '; 2 << 20], true).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE, "{text}");
    let (status, text) = post(&app, "/v1/messages", json!({"messages": [{"role": "user", "content": "x"}]})).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(serde_json::from_str::<Value>(&text).unwrap()["type"], "error");
    let (status, _) = post(&app, "/v1/nope", json!({})).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
}
