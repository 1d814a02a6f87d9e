//! The whole HTTP stack on a scripted backend: a test backend whose logits always pick the next token
//! of a script (reasoning, `</think>`, text, two Qwen XML tool calls, `<|im_end|>`), so reasoning
//! splitting and tool-call parsing are exercised end to end, streamed and not, through both APIs;
//! also the chat defaults, the model routes and graceful shutdown over a real socket.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use deltaserve_backend::host::host_step;
use deltaserve_backend::{ArenaStats, Backend, BackendError, Capabilities, ImageTokens, StepBatch, StepOut, Want};
use deltaserve_engine::{EngineHandle, EngineOptions};
use deltaserve_sched::SchedConfig;
use deltaserve_server::{AppState, ChatDefaults, ServerConfig, routes};
use deltaserve_text::{ChatTemplate, Tokenizer};
use serde_json::{Value, json};
use tower::ServiceExt;

const SCRIPT: &str = "Let me check the weather.\n</think>\n\nSure, checking.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis \"Île\"\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n<parameter=tz>\nCET\n</parameter>\n</function>\n</tool_call>";

/// Emits `script` token by token after each prompt, then `eos`; each step takes `step_delay`.
struct ScriptedBackend {
    vocab: usize,
    script: Vec<u32>,
    eos: u32,
    prompt_len: HashMap<u64, usize>,
    step_delay: Duration,
    /// Claims to run images (their rows are ignored): the engine's checks of image requests apply.
    images: Option<ImageTokens>,
}

impl Backend for ScriptedBackend {
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            name: "scripted".into(),
            vocab_size: self.vocab,
            launches_ahead: false,
            max_draft_tokens: 0,
            masks_tokens: false,
            picks_after_launch: false,
            snapshots_within_chunks: 0,
            prompt_logits: false,
            max_logits_rows: 0,
        }
    }
    fn image_tokens(&self) -> Option<ImageTokens> {
        self.images
    }
    fn step(&mut self, batch: &StepBatch, want: Want<'_>, out: &mut StepOut) -> Result<(), BackendError> {
        std::thread::sleep(self.step_delay);
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
    routes::router(state(SCRIPT, Duration::ZERO))
}

/// The server state over a backend that writes `script`.
fn state(script: &str, step_delay: Duration) -> AppState {
    state_with(script, step_delay, None, EngineOptions::default())
}

/// [`state`] over a backend that claims `images`, the engine started with `opts`.
fn state_with(script: &str, step_delay: Duration, images: Option<ImageTokens>, opts: EngineOptions) -> AppState {
    let dir = deltaserve_text::synth_model::demo_model_dir().unwrap();
    let tokenizer = Arc::new(Tokenizer::from_file(&dir.join("tokenizer.json")).unwrap());
    let template = ChatTemplate::from_dir(&dir).unwrap().map(Arc::new);
    let eos = tokenizer.token_id("<|im_end|>").unwrap();
    let script = tokenizer.encode(script).unwrap();
    let backend = ScriptedBackend { vocab: 1024, script, eos, prompt_len: HashMap::new(), step_delay, images };
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
    let engine = EngineHandle::start_with(Box::new(backend), sched, Some(tokenizer.clone()), opts).unwrap();
    AppState {
        grammars: Default::default(),
        engine,
        prompt_encoder: deltaserve_server::state::prompt_encoder(&tokenizer),
        tokenizer,
        template,
        metrics: Arc::new(Default::default()),
        cfg: Arc::new(ServerConfig {
            served_model_name: "demo".into(),
            api_key: Some("k".into()),
            max_body_bytes: 1 << 20,
            allowed_origins: Default::default(),
            reasoning_budget: None,
        }),
        eos_ids: vec![eos],
        sampling_defaults: Default::default(),
        media: Default::default(),
    }
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

/// The script's two tools, in Anthropic's shape.
fn anthropic_tools() -> Value {
    json!([
        {"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}},
        {"name": "get_time", "input_schema": {"type": "object", "properties": {"tz": {"type": "string"}}}}
    ])
}

#[tokio::test(flavor = "multi_thread")]
async fn anthropic_messages_with_thinking_and_tool_use() {
    let app = app();
    let req = json!({"model": "demo", "max_tokens": 200, "messages": [{"role": "user", "content": "weather?"}], "tools": anthropic_tools(),
                     "thinking": {"type": "enabled", "budget_tokens": 1024}});
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
        (chat(json!({"n": 5})), StatusCode::BAD_REQUEST, "`n`"),
        (chat(json!({"best_of": 2})), StatusCode::BAD_REQUEST, "best_of"),
        (chat(json!({"response_format": {"type": "xml"}})), StatusCode::BAD_REQUEST, "response_format"),
        (
            chat(json!({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}})),
            StatusCode::BAD_REQUEST,
            "response_format",
        ),
        (chat(json!({"model": "gpt-9"})), StatusCode::NOT_FOUND, "gpt-9"),
        (chat(json!({"temperature": -1})), StatusCode::BAD_REQUEST, "temperature"),
        (chat(json!({"temperature": "hot"})), StatusCode::BAD_REQUEST, "invalid"),
        (chat(json!({"max_tokens": 5000})), StatusCode::BAD_REQUEST, "1024"),
        (chat(json!({"messages": []})), StatusCode::BAD_REQUEST, "messages"),
        (chat(json!({"messages": [{"role": "wizard", "content": "x"}]})), StatusCode::BAD_REQUEST, "wizard"),
        (chat(json!({"tool_choice": "required"})), StatusCode::BAD_REQUEST, "tool_choice"),
        (
            chat(json!({"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": tools()})),
            StatusCode::BAD_REQUEST,
            "`nope`",
        ),
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

async fn get(app: &axum::Router, path: &str) -> (StatusCode, Value) {
    let req = Request::get(path).header("authorization", "Bearer k").body(Body::empty()).unwrap();
    let resp = app.clone().oneshot(req).await.unwrap();
    let status = resp.status();
    let bytes = axum::body::to_bytes(resp.into_body(), 1 << 20).await.unwrap();
    (status, serde_json::from_slice(&bytes).unwrap())
}

#[tokio::test(flavor = "multi_thread")]
async fn messages_name_plain_values_not_rust_debug_values() {
    let app = app();
    let chat = |rf: Value| json!({"messages": [{"role": "user", "content": "hi"}], "response_format": rf});
    let anthropic =
        |block: Value, role: &str| json!({"max_tokens": 4, "messages": [{"role": role, "content": [block]}]});
    let cases = [
        ("/v1/chat/completions", chat(json!({"type": "xml"})), "response_format type `xml`"),
        ("/v1/chat/completions", chat(json!({})), "response_format needs a `type`"),
        ("/v1/messages", anthropic(json!({"type": "image"}), "user"), "image sources of type (none) are not supported"),
        ("/v1/messages", anthropic(json!({"type": "document"}), "user"), "block type `document` is not supported"),
        ("/v1/messages", anthropic(json!({"type": "audio"}), "assistant"), "block type `audio` is not supported"),
        ("/v1/messages", anthropic(json!({"text": "x"}), "user"), "a block without a `type` is not supported"),
    ];
    for (path, body, needle) in cases {
        let (status, text) = post(&app, path, body.clone()).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body} → {text}");
        let message = serde_json::from_str::<Value>(&text).unwrap()["error"]["message"].as_str().unwrap().to_string();
        assert!(message.contains(needle), "{body} → {message}");
        assert!(!message.contains("Some(") && !message.contains("None"), "{body} → {message}");
    }
}

/// A 1 × 1 RGBA PNG: resized to Qwen3.5's minimum of 256 × 256 pixels, 64 image tokens.
const PIXEL_PNG: &str = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kgAAAABJRU5ErkJggg==";

#[tokio::test(flavor = "multi_thread")]
async fn images_are_counted_then_refused_without_a_vision_tower() {
    let app = app();
    let count = |blocks: Value| json!({"messages": [{"role": "user", "content": blocks}]});
    let text = json!({"type": "text", "text": "What is this?"});
    let (status, plain) = post(&app, "/v1/messages/count_tokens", count(json!([text]))).await;
    assert_eq!(status, StatusCode::OK, "{plain}");
    let (media_type, data) = PIXEL_PNG["data:".len()..].split_once(";base64,").unwrap();
    let image = json!({"type": "image", "source": {"type": "base64", "media_type": media_type, "data": data}});
    let (status, with_image) = post(&app, "/v1/messages/count_tokens", count(json!([text, image]))).await;
    assert_eq!(status, StatusCode::OK, "{with_image}");
    let tokens = |body: &str| serde_json::from_str::<Value>(body).unwrap()["input_tokens"].as_u64().unwrap();
    // <|vision_start|>, 64 image tokens, <|vision_end|>.
    assert_eq!(tokens(&with_image), tokens(&plain) + 66);
    let chat = json!({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": PIXEL_PNG}}]}]});
    let (status, body) = post(&app, "/v1/chat/completions", chat).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    assert!(body.contains(deltaserve_engine::NO_VISION_TOWER), "{body}");
}

/// An image with more patches than the engine's `max_image_tokens_per_step` (the bound the plan sized the
/// vision tower's workspace for) gets a 400 naming the limit; at the bound it runs.
#[tokio::test(flavor = "multi_thread")]
async fn images_over_the_patch_bound_get_a_400_naming_the_limit() {
    let pad = Tokenizer::from_file(&deltaserve_text::synth_model::demo_model_dir().unwrap().join("tokenizer.json"))
        .unwrap()
        .token_id("<|image_pad|>")
        .unwrap();
    let tower = Some(ImageTokens { image_token_id: pad, merge: 2, patch_len: 3 * 2 * 16 * 16 });
    let app = |bound: usize| {
        let opts = EngineOptions { max_image_tokens_per_step: bound, ..EngineOptions::default() };
        routes::router(state_with(SCRIPT, Duration::ZERO, tower, opts))
    };
    // PIXEL_PNG becomes 256 × 256 pixels: 16 × 16 = 256 patches.
    let chat = json!({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": PIXEL_PNG}}]}]});
    let (status, body) = post(&app(255), "/v1/chat/completions", chat.clone()).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    let message = serde_json::from_str::<Value>(&body).unwrap()["error"]["message"].as_str().unwrap().to_string();
    assert!(message.contains("256 patches") && message.contains("limit of 255 patches"), "{message}");
    assert!(message.contains("--max-image-tokens-per-step"), "{message}");
    let (status, body) = post(&app(256), "/v1/chat/completions", chat).await;
    assert_eq!(status, StatusCode::OK, "{body}");
}

#[tokio::test(flavor = "multi_thread")]
async fn retrieve_model_by_id() {
    let app = app();
    let (status, list) = get(&app, "/v1/models").await;
    assert_eq!(status, StatusCode::OK);
    let (status, model) = get(&app, "/v1/models/demo").await;
    assert_eq!(status, StatusCode::OK, "{model}");
    assert_eq!(model["id"], "demo");
    assert_eq!(model["object"], "model");
    assert_eq!(model["max_model_len"], list["data"][0]["max_model_len"]);
    for unknown in ["/v1/models/gpt-9", "/v1/models/org/demo"] {
        let (status, err) = get(&app, unknown).await;
        assert_eq!(status, StatusCode::NOT_FOUND, "{unknown}: {err}");
        assert_eq!(err["error"]["type"], "invalid_request_error");
        assert!(err["error"]["message"].as_str().unwrap().contains("does not exist"), "{err}");
    }
}

/// The load report a gateway polls: behind the API key, SGLang's shape, the static plan's capacity.
#[tokio::test(flavor = "multi_thread")]
async fn load_report_for_gateways() {
    let app = app();
    let (status, _) =
        post(&app, "/v1/chat/completions", json!({"messages": [{"role": "user", "content": "hi"}]})).await;
    assert_eq!(status, StatusCode::OK);
    let (status, r) = get(&app, "/v1/loads?include=core,disagg,queues,memory").await;
    assert_eq!(status, StatusCode::OK, "{r}");
    assert_eq!(r["dp_rank_count"], 1);
    let l = &r["loads"][0];
    // The finished request may still hold its slot for a moment: counts, within the plan's limits.
    assert!(l["num_running_reqs"].as_u64().is_some_and(|n| n <= 4), "{l}");
    assert_eq!(
        l["num_total_reqs"].as_u64(),
        Some(l["num_running_reqs"].as_u64().unwrap() + l["num_waiting_reqs"].as_u64().unwrap())
    );
    // 64 pages of 16 tokens; 4 sequences.
    assert_eq!(l["max_total_num_tokens"], 1024);
    assert_eq!(l["max_running_requests"], 4);
    assert!((0.0..=1.0).contains(&l["token_usage"].as_f64().unwrap()), "{l}");
    let unauthorized = app.clone().oneshot(Request::get("/v1/loads").body(Body::empty()).unwrap()).await.unwrap();
    assert_eq!(unauthorized.status(), StatusCode::UNAUTHORIZED);
}

/// Cross-origin calls from a web page: a preflight is answered without the key (browsers send none), with the
/// headers it asks for; the call itself still needs the key, and its answer (an error too) carries the
/// origin's permission so the page can read it; an origin not in `--allowed-origins` gets no CORS headers.
#[tokio::test(flavor = "multi_thread")]
async fn cross_origin_preflights_and_calls() {
    let app = app();
    let preflight = Request::options("/v1/chat/completions")
        .header("origin", "http://localhost:3000")
        .header("access-control-request-method", "POST")
        .header("access-control-request-headers", "authorization, content-type")
        .body(Body::empty())
        .unwrap();
    let r = app.clone().oneshot(preflight).await.unwrap();
    assert_eq!(r.status(), StatusCode::NO_CONTENT);
    let h = r.headers();
    assert_eq!(h["access-control-allow-origin"], "*");
    assert_eq!(h["access-control-allow-headers"], "authorization, content-type");
    assert!(h["access-control-allow-methods"].to_str().unwrap().contains("POST"));
    let call = |auth: bool| {
        let mut b = Request::get("/v1/models").header("origin", "http://localhost:3000");
        if auth {
            b = b.header("authorization", "Bearer k");
        }
        b.body(Body::empty()).unwrap()
    };
    for (auth, status) in [(true, StatusCode::OK), (false, StatusCode::UNAUTHORIZED)] {
        let r = app.clone().oneshot(call(auth)).await.unwrap();
        assert_eq!(r.status(), status);
        assert_eq!(r.headers()["access-control-allow-origin"], "*");
    }
    // Without an Origin header (not a browser): no CORS headers.
    let r = app.clone().oneshot(Request::get("/health").body(Body::empty()).unwrap()).await.unwrap();
    assert!(!r.headers().contains_key("access-control-allow-origin"));
    // Only the listed origins.
    let mut st = state(SCRIPT, Duration::ZERO);
    let mut cfg = (*st.cfg).clone();
    cfg.allowed_origins = deltaserve_server::cors::AllowedOrigins::parse(&["https://chat.example.com".into()]);
    st.cfg = Arc::new(cfg);
    let app = routes::router(st);
    let from = |origin: &str| Request::get("/health").header("origin", origin).body(Body::empty()).unwrap();
    let r = app.clone().oneshot(from("https://chat.example.com")).await.unwrap();
    assert_eq!(r.headers()["access-control-allow-origin"], "https://chat.example.com");
    assert_eq!(r.headers()["vary"], "Origin");
    let r = app.clone().oneshot(from("https://evil.example.com")).await.unwrap();
    assert!(!r.headers().contains_key("access-control-allow-origin"));
}

/// Prompt tokens and reasoning/content of a non-streamed chat reply.
async fn chat_reply(app: &axum::Router, kwargs: Option<Value>) -> (u64, Value, Value) {
    let mut req = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 12});
    if let Some(k) = kwargs {
        req["chat_template_kwargs"] = k;
    }
    let (status, body) = post(app, "/v1/chat/completions", req).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    let msg = &v["choices"][0]["message"];
    (v["usage"]["prompt_tokens"].as_u64().unwrap(), msg["reasoning_content"].clone(), msg["content"].clone())
}

#[tokio::test(flavor = "multi_thread")]
async fn chat_defaults_turn_thinking_off_unless_the_request_turns_it_on() {
    let plain = app();
    let demo = routes::router_with(state(SCRIPT, Duration::ZERO), ChatDefaults::thinking_off());
    // A real model: its template's default (thinking on: the reply opens in reasoning).
    let (on_tokens, reasoning, _) = chat_reply(&plain, None).await;
    assert_eq!(reasoning, "Let me check the weather.");
    // The demo defaults: thinking off, everything is content.
    let (off_tokens, reasoning, content) = chat_reply(&demo, None).await;
    assert_eq!(reasoning, Value::Null);
    assert!(content.as_str().unwrap().starts_with("Let me check the weather."), "{content}");
    assert_ne!(off_tokens, on_tokens, "the prompt holds an empty think block");
    let (tokens, ..) = chat_reply(&plain, Some(json!({"enable_thinking": false}))).await;
    assert_eq!(tokens, off_tokens);
    // The request's kwargs win over the defaults.
    let (tokens, reasoning, _) = chat_reply(&demo, Some(json!({"enable_thinking": true}))).await;
    assert_eq!((tokens, reasoning), (on_tokens, json!("Let me check the weather.")));
    // Anthropic `thinking` too; count_tokens renders the same prompt.
    let msgs = json!({"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]});
    let mut enabled = msgs.clone();
    enabled["thinking"] = json!({"type": "enabled", "budget_tokens": 1024});
    let count = |body: String| serde_json::from_str::<Value>(&body).unwrap()["input_tokens"].as_u64().unwrap();
    let demo_default = count(post(&demo, "/v1/messages/count_tokens", msgs).await.1);
    let demo_enabled = count(post(&demo, "/v1/messages/count_tokens", enabled).await.1);
    assert_eq!((demo_default, demo_enabled), (off_tokens, on_tokens));
}

/// An Anthropic reply's content blocks as (type, text / thinking / input JSON), non-streamed and
/// rebuilt from the stream's events.
async fn anthropic_blocks(app: &axum::Router, req: Value) -> (Vec<(String, String)>, Vec<(String, String)>) {
    let (status, body) = post(app, "/v1/messages", req.clone()).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let whole: Value = serde_json::from_str(&body).unwrap();
    let field = |b: &Value| match b["type"].as_str().unwrap() {
        "thinking" => b["thinking"].as_str().unwrap().to_string(),
        "text" => b["text"].as_str().unwrap().to_string(),
        _ => b["input"].to_string(),
    };
    let whole =
        whole["content"].as_array().unwrap().iter().map(|b| (b["type"].as_str().unwrap().into(), field(b))).collect();
    let mut sreq = req;
    sreq["stream"] = json!(true);
    let (_, body) = post(app, "/v1/messages", sreq).await;
    let mut streamed: Vec<(String, String)> = Vec::new();
    for e in sse_data(&body).iter().map(|d| serde_json::from_str::<Value>(d).unwrap()) {
        match e["type"].as_str().unwrap() {
            "content_block_start" => {
                assert_eq!(e["index"].as_u64().unwrap() as usize, streamed.len());
                let b = &e["content_block"];
                let start = if b["type"] == "tool_use" { String::new() } else { field(b) };
                streamed.push((b["type"].as_str().unwrap().into(), start));
            }
            "content_block_delta" => {
                let d = &e["delta"];
                let piece = ["text", "thinking", "partial_json"].iter().find_map(|k| d[*k].as_str()).unwrap();
                streamed[e["index"].as_u64().unwrap() as usize].1 += piece;
            }
            _ => {}
        }
    }
    for b in streamed.iter_mut().filter(|b| b.0 == "tool_use") {
        b.1 = serde_json::from_str::<Value>(&b.1).unwrap().to_string();
    }
    (whole, streamed)
}

fn blocks(list: &[(&str, &str)]) -> Vec<(String, String)> {
    list.iter().map(|(k, t)| (k.to_string(), t.to_string())).collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn anthropic_thinking_blocks_follow_the_request() {
    // The model opens `<think>` itself, whatever the prompt says.
    let app = routes::router(state("<think>\nhidden plan\n</think>\n\nVisible answer.", Duration::ZERO));
    let req = |thinking: Value| {
        let mut r = json!({"max_tokens": 50, "messages": [{"role": "user", "content": "hi"}]});
        if !thinking.is_null() {
            r["thinking"] = thinking;
        }
        r
    };
    let answer_only = blocks(&[("text", "Visible answer.")]);
    for thinking in [Value::Null, json!({"type": "disabled"})] {
        let (whole, streamed) = anthropic_blocks(&app, req(thinking.clone())).await;
        assert_eq!(whole, answer_only, "thinking {thinking}");
        assert_eq!(streamed, answer_only, "thinking {thinking}");
    }
    let (whole, streamed) = anthropic_blocks(&app, req(json!({"type": "enabled", "budget_tokens": 1024}))).await;
    let with_thinking = blocks(&[("thinking", "hidden plan"), ("text", "Visible answer.")]);
    assert_eq!((whole, streamed), (with_thinking.clone(), with_thinking));
}

#[tokio::test(flavor = "multi_thread")]
async fn anthropic_streamed_and_whole_replies_have_the_same_blocks() {
    let app = app();
    let req = |max_tokens: u64, thinking: bool| {
        let mut r = json!({"max_tokens": max_tokens, "messages": [{"role": "user", "content": "hi"}], "tools": anthropic_tools()});
        if thinking {
            r["thinking"] = json!({"type": "enabled", "budget_tokens": 1024});
        }
        r
    };
    for thinking in [false, true] {
        // Cut by max_tokens while thinking: an empty text block, streamed or not.
        let (whole, streamed) = anthropic_blocks(&app, req(3, thinking)).await;
        assert_eq!(whole, streamed, "thinking {thinking}");
        let kinds: Vec<&str> = whole.iter().map(|b| b.0.as_str()).collect();
        assert_eq!(kinds, if thinking { vec!["thinking", "text"] } else { vec!["text"] }, "{whole:?}");
        assert_eq!(whole.last().unwrap().1, "");
        // The whole script: thinking, text, two tool calls.
        let (whole, streamed) = anthropic_blocks(&app, req(200, thinking)).await;
        assert_eq!(whole, streamed, "thinking {thinking}");
        let kinds: Vec<&str> = whole.iter().map(|b| b.0.as_str()).collect();
        let mut want = vec!["text", "tool_use", "tool_use"];
        if thinking {
            want.insert(0, "thinking");
        }
        assert_eq!(kinds, want, "{whole:?}");
    }
}

/// Sends one HTTP/1.1 request with `Connection: close` on a new connection.
async fn raw_request(addr: std::net::SocketAddr, method: &str, path: &str, body: &str) -> tokio::net::TcpStream {
    use tokio::io::AsyncWriteExt;
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let head = format!(
        "{method} {path} HTTP/1.1\r\nhost: test\r\nauthorization: Bearer k\r\ncontent-type: application/json\r\n\
         content-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(head.as_bytes()).await.unwrap();
    s
}

async fn read_to_end(s: &mut tokio::net::TcpStream) -> String {
    use tokio::io::AsyncReadExt;
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(20), s.read_to_end(&mut out)).await.unwrap().unwrap();
    String::from_utf8_lossy(&out).into_owned()
}

#[tokio::test(flavor = "multi_thread")]
async fn shutdown_answers_new_requests_with_503_while_in_flight_ones_finish() {
    use tokio::io::AsyncReadExt;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let opts =
        deltaserve_server::ServeOptions { grace: Duration::from_secs(60), chat_defaults: ChatDefaults::default() };
    // About 80 tokens at 25 ms a step: the stream runs for ~2 s.
    let state = state(SCRIPT, Duration::from_millis(25));
    let server = tokio::spawn(deltaserve_server::serve(listener, state, async { stop_rx.await.unwrap_or(()) }, opts));

    let chat = json!({"messages": [{"role": "user", "content": "hi"}], "stream": true}).to_string();
    let mut stream = raw_request(addr, "POST", "/v1/chat/completions", &chat).await;
    let mut head = vec![0u8; 4096];
    let n = tokio::time::timeout(Duration::from_secs(10), stream.read(&mut head)).await.unwrap().unwrap();
    assert!(String::from_utf8_lossy(&head[..n]).starts_with("HTTP/1.1 200"));
    stop_tx.send(()).unwrap();

    // New connections are accepted and answered 503 in each API's error style.
    let mut answers = Vec::new();
    for (path, body) in [("/v1/models", ""), ("/v1/chat/completions", chat.as_str()), ("/v1/messages", "{}")] {
        let method = if body.is_empty() { "GET" } else { "POST" };
        let mut reply = read_to_end(&mut raw_request(addr, method, path, body).await).await;
        for _ in 0..50 {
            if !reply.starts_with("HTTP/1.1 200") {
                break;
            }
            // The shutdown signal is handled asynchronously: ask again.
            tokio::time::sleep(Duration::from_millis(20)).await;
            reply = read_to_end(&mut raw_request(addr, method, path, body).await).await;
        }
        answers.push(reply);
    }
    for reply in &answers {
        assert!(reply.starts_with("HTTP/1.1 503"), "{reply}");
        assert!(reply.contains("the server is shutting down"), "{reply}");
    }
    assert!(answers[0].contains(r#""type":"service_unavailable""#), "{}", answers[0]);
    assert!(answers[2].contains(r#""type":"overloaded_error""#), "{}", answers[2]);

    // The stream in flight runs to its end.
    let rest = read_to_end(&mut stream).await;
    assert!(rest.contains("data: [DONE]"), "{rest}");
    assert!(rest.contains(r#""finish_reason":"stop""#), "{rest}");
    assert!(!rest.contains("error"), "{rest}");
    // … and then the server stops, long before the grace is over.
    let stopped = tokio::time::timeout(Duration::from_secs(10), server).await;
    stopped.expect("the server did not stop once the stream ended").unwrap().unwrap();
    assert!(tokio::net::TcpStream::connect(addr).await.is_err(), "still accepting after shutdown");
}
