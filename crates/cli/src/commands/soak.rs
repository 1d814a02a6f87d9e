//! `deltaserve soak`: replays a synthetic multi-turn agent session through the HTTP API and reports
//! what every turn cost: prompt / cached / new tokens, time to first token, total time, and the
//! server's memory counters. Fails on HTTP errors, malformed responses, prefix-cache misses (a
//! turn must restore ≥ 95% of the previous turn's prompt) and any arena growth between turns.
//!
//! Without `--url` it starts the server in-process on 127.0.0.1 (an ephemeral port) with the
//! `--model` / engine flags, exactly as `deltaserve serve` builds it (the few lines that assemble
//! the server state are duplicated from `serve.rs`), and stops it at the end. With `--url`, `--model`
//! is the model name sent in requests (default: the first id of `/v1/models`).
//!
//! The client is a minimal HTTP/1.1 client over `tokio::net::TcpStream` (one request per connection,
//! `Connection: close`; content-length, chunked or read-to-close bodies; SSE `data:` lines parsed as
//! they arrive so the first streamed token is timed when it reaches the socket).

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use serde_json::{Map, Value, json};

use crate::engine_args::EngineArgs;
use crate::model_source::ModelArgs;

/// Required fraction of the previous turn's prompt that the next turn must restore from the cache.
const MIN_CACHED_FRACTION: f64 = 0.95;
/// Every this many turns the new message is a user follow-up instead of a tool result.
const USER_EVERY: usize = 4;

#[derive(clap::Args)]
pub struct Args {
    /// Server to test, e.g. http://127.0.0.1:8000 (default: start the server in-process on an
    /// ephemeral port with the --model / engine flags, and stop it at the end). With --url, --model
    /// is the model name sent in requests (default: the first model of /v1/models).
    #[arg(long)]
    url: Option<String>,
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    engine: EngineArgs,
    /// API key, sent as `Authorization: Bearer KEY` (in-process: the server requires it too).
    #[arg(long, env = "DELTASERVE_API_KEY")]
    api_key: Option<String>,
    /// Requests in the session (the first one is the system prompt + task).
    #[arg(long)]
    turns: usize,
    /// Prompt tokens the session grows to by its last turn (approximately).
    #[arg(long)]
    target_context: usize,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
    /// Also write an SVG chart (TTFT per turn; cached vs new prompt tokens per turn) to this file.
    #[arg(long)]
    svg: Option<PathBuf>,
    /// Seed of the synthetic session's texts and sizes.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// max_tokens of every turn.
    #[arg(long, default_value_t = 16)]
    max_tokens: u32,
    /// Seconds one request may take before the soak fails.
    #[arg(long, default_value_t = 600)]
    request_timeout_secs: u64,
}

pub fn run(a: Args) -> Result<()> {
    if a.turns == 0 {
        bail!("--turns must be at least 1");
    }
    if a.max_tokens == 0 {
        bail!("--max-tokens must be at least 1");
    }
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let report = rt.block_on(async {
        match &a.url {
            Some(url) => {
                let target = Target::parse(url)?;
                let model = a.model.model.as_ref().map(|m| m.to_string_lossy().into_owned());
                anyhow::Ok(soak(&a, &target, model, false).await)
            }
            None => {
                let server = InProcess::start(&a).await?;
                let target = Target { host: "127.0.0.1".into(), port: server.addr.port(), base: String::new() };
                let report = soak(&a, &target, Some(server.name.clone()), true).await;
                server.stop().await?;
                Ok(report)
            }
        }
    });
    rt.shutdown_timeout(Duration::from_secs(2));
    let report = report?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report.to_json())?);
    } else {
        print!("{}", report.table());
    }
    if let Some(path) = &a.svg {
        std::fs::write(path, report.svg()).with_context(|| format!("writing {}", path.display()))?;
    }
    if !report.failures.is_empty() {
        bail!("soak failed:\n  - {}", report.failures.join("\n  - "));
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// The in-process server

struct InProcess {
    addr: SocketAddr,
    name: String,
    engine: deltaserve_engine::EngineHandle,
    stop_tx: tokio::sync::oneshot::Sender<()>,
    join: tokio::task::JoinHandle<std::io::Result<()>>,
}

impl InProcess {
    /// Builds the server state the way `serve` does and serves it on 127.0.0.1:0.
    async fn start(a: &Args) -> Result<Self> {
        let name = match &a.model.model {
            Some(dir) => dir.file_name().map_or("model".into(), |n| n.to_string_lossy().into_owned()),
            None => "demo".into(),
        };
        let model_dir = a.model.dir()?;
        let (model, engine_args) = (a.model.clone(), a.engine.clone());
        let started = tokio::task::spawn_blocking(move || -> Result<_> { engine_args.start(&model) })
            .await
            .context("starting the engine")??;
        tracing::info!("{}", started.plan.table());
        let state = started.app_state(&name, a.api_key.clone(), 64 << 20, &model_dir)?;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.context("binding 127.0.0.1:0")?;
        let addr = listener.local_addr()?;
        tracing::info!(model = %name, "in-process server on http://{addr}");
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let join = tokio::spawn(deltaserve_server::serve(
            listener,
            state,
            async move {
                let _ = stop_rx.await;
            },
            Duration::from_secs(2),
        ));
        Ok(Self { addr, name, engine: started.engine, stop_tx, join })
    }

    async fn stop(self) -> Result<()> {
        let _ = self.stop_tx.send(());
        self.join.await.context("the in-process server task")?.context("the in-process server")?;
        let engine = self.engine;
        tokio::task::spawn_blocking(move || engine.shutdown(false)).await?;
        Ok(())
    }
}

/// The resident set size of this process (`VmRSS` in /proc/self/status), in bytes.
fn host_rss_bytes() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

// ---------------------------------------------------------------------------------------------
// The session

/// One turn's measurements.
#[derive(Clone, Debug, Default)]
struct Turn {
    turn: usize,
    /// What the turn appended: `task` (turn 1), `tool` or `user`.
    kind: &'static str,
    prompt_tokens: u64,
    cached_tokens: u64,
    completion_tokens: u64,
    ttft_ms: f64,
    total_ms: f64,
    arena_high_water_bytes: Option<u64>,
    arena_allocations: Option<u64>,
    kv_pages_used: Option<u64>,
    host_rss_bytes: Option<u64>,
}

impl Turn {
    fn new_tokens(&self) -> u64 {
        self.prompt_tokens.saturating_sub(self.cached_tokens)
    }
    fn ttft_per_new_token_ms(&self) -> f64 {
        self.ttft_ms / self.new_tokens().max(1) as f64
    }
}

struct Report {
    server: String,
    in_process: bool,
    target_context: usize,
    turns: Vec<Turn>,
    /// Arena counters before the first turn.
    baseline: Option<(u64, u64)>,
    failures: Vec<String>,
}

/// The server's reply to one turn, as streamed.
#[derive(Default)]
struct Reply {
    content: String,
    reasoning: String,
    /// (id, name, arguments) by index.
    tool_calls: Vec<(String, String, String)>,
    usage: Option<Value>,
    finish_reason: Option<String>,
    first_token: Option<Instant>,
    first_finish: Option<Instant>,
    done: bool,
    error: Option<String>,
}

async fn soak(a: &Args, target: &Target, model: Option<String>, in_process: bool) -> Report {
    let mut report = Report {
        server: if in_process { format!("in-process {}", target.origin()) } else { target.origin() },
        in_process,
        target_context: a.target_context,
        turns: Vec::new(),
        baseline: None,
        failures: Vec::new(),
    };
    if let Err(e) = run_session(a, target, model, in_process, &mut report).await {
        report.failures.push(format!("{e:#}"));
    }
    report
}

async fn run_session(
    a: &Args,
    target: &Target,
    model: Option<String>,
    in_process: bool,
    report: &mut Report,
) -> Result<()> {
    let client = Client {
        target: target.clone(),
        api_key: a.api_key.clone(),
        timeout: Duration::from_secs(a.request_timeout_secs),
    };
    // Reachability first, and the model name when none was given.
    let models = client.get_json("/v1/models").await?;
    let model = match model {
        Some(m) => m,
        None => models["data"][0]["id"]
            .as_str()
            .map(str::to_string)
            .ok_or_else(|| anyhow!("GET /v1/models: no model id in {models}"))?,
    };
    let m0 = client.metrics().await?;
    report.baseline = Some((m0.allocations, m0.high_water));

    let mut rng = Rng::new(a.seed);
    let n = a.turns;
    // Relative payload sizes of turns 2..=n: geometric growth with seeded jitter.
    let weights: Vec<f64> = (0..n).map(|i| 1.3f64.powi(i as i32) * (0.75 + 0.5 * rng.unit())).collect();
    let mut messages =
        vec![json!({"role": "system", "content": system_prompt()}), json!({"role": "user", "content": task(&mut rng)})];
    let tools = tools();
    // Characters per prompt token, refined from what the server reports.
    let initial_chars: usize =
        messages.iter().map(|m| m["content"].as_str().map_or(0, str::len)).sum::<usize>() + tools.to_string().len();
    let mut chars_per_token = 3.0; // replaced by what turn 1 measures
    let mut prev: Option<(Turn, Reply, usize)> = None; // (turn, reply, payload chars)
    for t in 1..=n {
        let mut kind = "task";
        let mut payload_chars = 0;
        if let Some((pt, reply, prev_payload)) = &prev {
            // Refine chars/token from the last growth (payload + the re-rendered reply + wrappers).
            if t > 2 && *prev_payload > 0 {
                let before = report.turns[report.turns.len() - 2].prompt_tokens
                    + report.turns[report.turns.len() - 2].completion_tokens;
                let grew = pt.prompt_tokens.saturating_sub(before + 12) as f64;
                if grew > 8.0 {
                    chars_per_token = 0.5 * chars_per_token + 0.5 * (*prev_payload as f64 / grew);
                }
            }
            let reply_overhead = u64::from(a.max_tokens) + 16;
            let context_now = pt.prompt_tokens + pt.completion_tokens + 12;
            let remaining_turns = (n - t + 1) as u64;
            let budget = (a.target_context as u64)
                .saturating_sub(context_now + (remaining_turns - 1) * reply_overhead + remaining_turns * 12);
            let w: f64 = weights[t - 1..].iter().sum();
            let tokens = (budget as f64 * weights[t - 1] / w).max(8.0);
            payload_chars = (tokens * chars_per_token).round() as usize;
            messages.push(assistant_message(reply));
            if t % USER_EVERY == 0 {
                kind = "user";
                messages.push(json!({"role": "user", "content": follow_up(&mut rng, payload_chars)}));
            } else {
                kind = "tool";
                let text = tool_output(&mut rng, t, payload_chars);
                if reply.tool_calls.is_empty() {
                    messages.push(json!({"role": "tool", "tool_call_id": format!("call_soak_{t}"), "content": text}));
                } else {
                    // Answer every call the model made; the first carries the payload.
                    for (i, (id, name, _)) in reply.tool_calls.iter().enumerate() {
                        let content = if i == 0 { text.clone() } else { format!("{name}: ok") };
                        messages.push(json!({"role": "tool", "tool_call_id": id, "content": content}));
                    }
                }
            }
        }
        let body = json!({
            "model": model,
            "messages": messages,
            "tools": tools,
            "temperature": 0,
            "max_tokens": a.max_tokens,
            "stream": true,
            "stream_options": {"include_usage": true},
            "chat_template_kwargs": {"preserve_thinking": true},
        });
        let (reply, ttft_ms, total_ms) = client.chat(&body).await.with_context(|| format!("turn {t}"))?;
        let usage = reply.usage.as_ref().expect("checked by chat");
        let num = |v: &Value, what: &str| {
            v.as_u64().ok_or_else(|| anyhow!("turn {t}: usage.{what} is missing or not a count: {usage}"))
        };
        let mut turn = Turn {
            turn: t,
            kind,
            prompt_tokens: num(&usage["prompt_tokens"], "prompt_tokens")?,
            cached_tokens: num(
                &usage["prompt_tokens_details"]["cached_tokens"],
                "prompt_tokens_details.cached_tokens",
            )?,
            completion_tokens: num(&usage["completion_tokens"], "completion_tokens")?,
            ttft_ms,
            total_ms,
            ..Default::default()
        };
        let m = client.metrics().await.with_context(|| format!("turn {t}"))?;
        turn.arena_allocations = Some(m.allocations);
        turn.arena_high_water_bytes = Some(m.high_water);
        turn.kv_pages_used = m.kv_pages_used;
        turn.host_rss_bytes = if in_process { host_rss_bytes() } else { None };
        if t == 1 && turn.prompt_tokens > 0 {
            chars_per_token = initial_chars as f64 / turn.prompt_tokens as f64;
        }
        check_turn(&turn, report.turns.last(), report.baseline, &mut report.failures);
        tracing::info!(
            turn = t,
            kind,
            prompt = turn.prompt_tokens,
            cached = turn.cached_tokens,
            new = turn.new_tokens(),
            ttft_ms = format!("{:.1}", turn.ttft_ms),
            payload_chars,
            "turn done"
        );
        report.turns.push(turn.clone());
        prev = Some((turn, reply, payload_chars));
    }
    Ok(())
}

/// The per-turn checks: cache accounting and arena growth.
fn check_turn(t: &Turn, prev: Option<&Turn>, baseline: Option<(u64, u64)>, failures: &mut Vec<String>) {
    let n = t.turn;
    if t.cached_tokens >= t.prompt_tokens.max(1) {
        failures.push(format!(
            "turn {n}: cached_tokens {} ≥ prompt_tokens {} (at most prompt_tokens − 1 can be restored: the last \
             prompt token must be computed to produce logits)",
            t.cached_tokens, t.prompt_tokens
        ));
    }
    if let Some(p) = prev {
        let need = (MIN_CACHED_FRACTION * p.prompt_tokens as f64).ceil() as u64;
        if t.cached_tokens < need {
            failures.push(format!(
                "turn {n}: cached_tokens {} < 95% of the previous turn's prompt_tokens {} (need ≥ {need}): the prefix \
                 cache did not restore the previous context",
                t.cached_tokens, p.prompt_tokens
            ));
        }
    }
    let before = match prev {
        Some(p) => p.arena_allocations.zip(p.arena_high_water_bytes),
        None => baseline,
    };
    if let (Some((alloc0, hw0)), Some(alloc), Some(hw)) = (before, t.arena_allocations, t.arena_high_water_bytes) {
        let since = if prev.is_some() { "the previous turn" } else { "start-up (before turn 1)" };
        if alloc != alloc0 {
            failures
                .push(format!("turn {n}: deltaserve_arena_allocations changed from {alloc0} to {alloc} since {since}"));
        }
        if hw != hw0 {
            failures
                .push(format!("turn {n}: deltaserve_arena_high_water_bytes changed from {hw0} to {hw} since {since}"));
        }
    }
}

/// The assistant message that re-sends a reply exactly as the server streamed it.
fn assistant_message(r: &Reply) -> Value {
    let mut m = Map::new();
    m.insert("role".into(), json!("assistant"));
    m.insert(
        "content".into(),
        if r.content.is_empty() && !r.tool_calls.is_empty() { Value::Null } else { json!(r.content) },
    );
    if !r.reasoning.is_empty() {
        m.insert("reasoning_content".into(), json!(r.reasoning));
    }
    if !r.tool_calls.is_empty() {
        let calls: Vec<Value> = r
            .tool_calls
            .iter()
            .map(
                |(id, name, args)| json!({"id": id, "type": "function", "function": {"name": name, "arguments": args}}),
            )
            .collect();
        m.insert("tool_calls".into(), Value::Array(calls));
    }
    Value::Object(m)
}

// ---------------------------------------------------------------------------------------------
// Synthetic texts (deterministic from --seed)

/// splitmix64.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Self(seed ^ 0x5eed_50a4_d311_7a5e)
    }
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
    fn pick<'a>(&mut self, xs: &[&'a str]) -> &'a str {
        xs[self.below(xs.len())]
    }
}

const DIRS: &[&str] = &["sched", "engine", "server", "text", "model", "cpu", "plan", "backend"];
const FILES: &[&str] = &["lib", "state", "cache", "request", "output", "metrics", "routes", "config", "worker"];
const IDENTS: &[&str] = &[
    "prefix", "snapshot", "page", "slot", "tokens", "budget", "queue", "stream", "request", "batch", "chunk", "state",
    "window", "usage", "cursor", "limit", "entry", "handle",
];
const LEVELS: &[&str] = &["INFO", "INFO", "INFO", "DEBUG", "WARN"];

fn system_prompt() -> String {
    "You are a coding agent working in a Rust repository. Use the tools to inspect files, run commands and search \
     the code. Think step by step, keep answers short, and call one tool at a time. When the task is done, reply \
     with a summary of the change."
        .into()
}

fn tools() -> Value {
    json!([
        {"type": "function", "function": {
            "name": "read_file",
            "description": "Read a file of the repository.",
            "parameters": {"type": "object", "properties": {
                "path": {"type": "string", "description": "Path relative to the repository root."},
                "start_line": {"type": "integer"}, "end_line": {"type": "integer"}},
                "required": ["path"]}}},
        {"type": "function", "function": {
            "name": "run_command",
            "description": "Run a shell command in the repository and return its output.",
            "parameters": {"type": "object", "properties": {
                "command": {"type": "string"}, "timeout_s": {"type": "integer"}},
                "required": ["command"]}}},
        {"type": "function", "function": {
            "name": "search_code",
            "description": "Search the repository for a regular expression.",
            "parameters": {"type": "object", "properties": {
                "pattern": {"type": "string"}, "path": {"type": "string"}},
                "required": ["pattern"]}}}
    ])
}

fn task(rng: &mut Rng) -> String {
    let (d, f, i) = (rng.pick(DIRS), rng.pick(FILES), rng.pick(IDENTS));
    format!(
        "The test `{d}::{f}::tests::{i}_is_restored` fails after the last change to crates/{d}/src/{f}.rs. Find out \
         why and fix it without changing the public API."
    )
}

/// One line of synthetic tool output.
fn line(rng: &mut Rng) -> String {
    let (d, f, a, b) = (rng.pick(DIRS), rng.pick(FILES), rng.pick(IDENTS), rng.pick(IDENTS));
    match rng.below(4) {
        0 => format!("crates/{d}/src/{f}.rs:{}:    let {a}_{b} = self.{a}.get(&{b})?;", 1 + rng.below(900)),
        1 => format!(
            "2026-03-{:02}T{:02}:{:02}:{:02}Z {} {d}::{f}: {a} {b}={} took {}ms",
            1 + rng.below(28),
            rng.below(24),
            rng.below(60),
            rng.below(60),
            rng.pick(LEVELS),
            rng.below(100_000),
            rng.below(500)
        ),
        2 => format!("test {d}::{f}::tests::{a}_{b} ... {}", if rng.below(9) == 0 { "FAILED" } else { "ok" }),
        _ => format!(
            "    fn {a}_{b}(&mut self, {b}: usize) -> Result<{}, Error> {{",
            if rng.below(2) == 0 { "()" } else { "usize" }
        ),
    }
}

/// Lines of synthetic text of about `chars` characters.
fn lines(rng: &mut Rng, chars: usize) -> String {
    let mut s = String::new();
    while s.len() < chars {
        s.push_str(&line(rng));
        s.push('\n');
    }
    s.truncate(s.trim_end().len());
    s
}

fn tool_output(rng: &mut Rng, turn: usize, chars: usize) -> String {
    let head = match turn % 3 {
        0 => format!("$ cargo test -p deltaserve-{} 2>&1 | tail", rng.pick(DIRS)),
        1 => format!("$ rg -n '{}' crates/", rng.pick(IDENTS)),
        _ => format!("$ sed -n 1,200p crates/{}/src/{}.rs", rng.pick(DIRS), rng.pick(FILES)),
    };
    format!("{head}\n{}", lines(rng, chars.saturating_sub(head.len() + 1)))
}

fn follow_up(rng: &mut Rng, chars: usize) -> String {
    let head = format!(
        "Before you go on: the `{}` path in crates/{}/src/{}.rs matters too. Here is the log from CI:",
        rng.pick(IDENTS),
        rng.pick(DIRS),
        rng.pick(FILES)
    );
    format!("{head}\n{}", lines(rng, chars.saturating_sub(head.len() + 1)))
}

// ---------------------------------------------------------------------------------------------
// The HTTP/1.1 client

#[derive(Clone, Debug)]
struct Target {
    host: String,
    port: u16,
    /// Path prefix without a trailing slash (`` or `/prefix`).
    base: String,
}

impl Target {
    fn parse(url: &str) -> Result<Self> {
        let rest = match url.split_once("://") {
            Some(("http", rest)) => rest,
            Some(("https", _)) => bail!("--url {url}: https is not supported; use a plain http:// URL"),
            Some((scheme, _)) => bail!("--url {url}: unsupported scheme `{scheme}` (expected http://)"),
            None => url,
        };
        let (authority, path) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i..]),
            None => (rest, ""),
        };
        let (host, port) = match authority.rsplit_once(':') {
            Some((h, p)) if !h.ends_with(']') || h.starts_with('[') => {
                (h.to_string(), p.parse::<u16>().map_err(|_| anyhow!("--url {url}: bad port `{p}`"))?)
            }
            _ => (authority.to_string(), 80),
        };
        if host.is_empty() {
            bail!("--url {url}: no host");
        }
        let mut base = path.trim_end_matches('/').to_string();
        if base.ends_with("/v1") {
            base.truncate(base.len() - 3);
        }
        Ok(Self { host, port, base })
    }

    fn origin(&self) -> String {
        format!("http://{}:{}{}", self.host, self.port, self.base)
    }
}

struct HttpResponse {
    status: u16,
    body: Vec<u8>,
}

/// Arena counters scraped from /metrics.
struct MetricsSample {
    allocations: u64,
    high_water: u64,
    kv_pages_used: Option<u64>,
}

struct Client {
    target: Target,
    api_key: Option<String>,
    timeout: Duration,
}

impl Client {
    async fn get_json(&self, path: &str) -> Result<Value> {
        let r = self.request("GET", path, None, |_| {}).await?;
        if r.status != 200 {
            bail!("GET {path}: HTTP {}: {}", r.status, error_text(&r.body));
        }
        serde_json::from_slice(&r.body).with_context(|| format!("GET {path}: the body is not JSON"))
    }

    async fn metrics(&self) -> Result<MetricsSample> {
        let r = self.request("GET", "/metrics", None, |_| {}).await?;
        if r.status != 200 {
            bail!("GET /metrics: HTTP {}: {}", r.status, error_text(&r.body));
        }
        let text = String::from_utf8_lossy(&r.body);
        let get = |name: &str| {
            text.lines()
                .filter(|l| !l.starts_with('#'))
                .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse::<f64>().ok())
                .map(|v| v as u64)
        };
        let need =
            |name: &str| get(name).ok_or_else(|| anyhow!("GET /metrics: no `{name}` gauge (is this deltaserve?)"));
        Ok(MetricsSample {
            allocations: need("deltaserve_arena_allocations")?,
            high_water: need("deltaserve_arena_high_water_bytes")?,
            kv_pages_used: get("deltaserve_kv_pages_used"),
        })
    }

    /// Streams one chat completion: the reply, TTFT and total time (ms).
    async fn chat(&self, body: &Value) -> Result<(Reply, f64, f64)> {
        let payload = serde_json::to_vec(body)?;
        let mut sse = SseParser::default();
        let mut reply = Reply::default();
        let start = Instant::now();
        let r = self
            .request("POST", "/v1/chat/completions", Some(&payload), |bytes| {
                sse.feed(bytes, |data| on_event(&mut reply, data));
            })
            .await?;
        let end = Instant::now();
        if r.status != 200 {
            bail!("POST /v1/chat/completions: HTTP {}: {}", r.status, error_text(&r.body));
        }
        sse.finish(|data| on_event(&mut reply, data));
        if let Some(e) = reply.error.take() {
            bail!("POST /v1/chat/completions: malformed or failed stream: {e}");
        }
        if !reply.done {
            bail!("POST /v1/chat/completions: the stream ended without `data: [DONE]`");
        }
        if reply.finish_reason.is_none() {
            bail!("POST /v1/chat/completions: no chunk carried a finish_reason");
        }
        if reply.usage.is_none() {
            bail!("POST /v1/chat/completions: no usage chunk although stream_options.include_usage was set");
        }
        // A reply whose only token ended it (EOS) streams no text: time to the finish chunk instead.
        let first = reply.first_token.or(reply.first_finish).unwrap_or(end);
        let ms = |t: Instant| t.duration_since(start).as_secs_f64() * 1e3;
        let (ttft, total) = (ms(first), ms(end));
        Ok((reply, ttft, total))
    }

    /// One request on a fresh connection; `on_body` sees the decoded body as it arrives.
    async fn request(
        &self,
        method: &str,
        path: &str,
        body: Option<&[u8]>,
        on_body: impl FnMut(&[u8]),
    ) -> Result<HttpResponse> {
        let what = format!("{method} {}{path}", self.target.origin());
        tokio::time::timeout(self.timeout, self.request_inner(method, path, body, on_body))
            .await
            .map_err(|_| anyhow!("{what}: no complete response within {:?}", self.timeout))?
            .with_context(|| what.clone())
    }

    async fn request_inner(
        &self,
        method: &str,
        path: &str,
        body: Option<&[u8]>,
        mut on_body: impl FnMut(&[u8]),
    ) -> Result<HttpResponse> {
        let t = &self.target;
        let stream = tokio::net::TcpStream::connect((t.host.as_str(), t.port))
            .await
            .with_context(|| format!("cannot connect to {}:{} (is the server running?)", t.host, t.port))?;
        let mut head = format!(
            "{method} {}{path} HTTP/1.1\r\nHost: {}:{}\r\nUser-Agent: deltaserve-soak\r\nAccept: */*\r\nConnection: close\r\n",
            t.base, t.host, t.port
        );
        if let Some(key) = &self.api_key {
            let _ = write!(head, "Authorization: Bearer {key}\r\n");
        }
        if let Some(b) = body {
            let _ = write!(head, "Content-Type: application/json\r\nContent-Length: {}\r\n", b.len());
        }
        head.push_str("\r\n");
        let mut out = head.into_bytes();
        out.extend_from_slice(body.unwrap_or_default());
        write_all(&stream, &out).await.context("sending the request")?;

        // Status line and headers.
        let mut buf = Vec::new();
        let header_end = loop {
            if let Some(i) = find(&buf, b"\r\n\r\n") {
                break i;
            }
            if buf.len() > 64 << 10 {
                bail!("the response headers exceed 64 KiB");
            }
            if read_some(&stream, &mut buf).await? == 0 {
                bail!("the connection closed before a complete response header ({} bytes received)", buf.len());
            }
        };
        let head = std::str::from_utf8(&buf[..header_end]).context("the response header is not UTF-8")?;
        let mut lines = head.split("\r\n");
        let status_line = lines.next().unwrap_or_default();
        let status = match status_line.split_whitespace().collect::<Vec<_>>()[..] {
            [v, code, ..] if v.starts_with("HTTP/1.") => {
                code.parse::<u16>().map_err(|_| anyhow!("bad status line `{status_line}`"))?
            }
            _ => bail!("bad status line `{status_line}`"),
        };
        let mut chunked = false;
        let mut length = None;
        for l in lines {
            let (k, v) = l.split_once(':').ok_or_else(|| anyhow!("bad header line `{l}`"))?;
            let (k, v) = (k.trim().to_ascii_lowercase(), v.trim());
            if k == "transfer-encoding" && v.to_ascii_lowercase().contains("chunked") {
                chunked = true;
            } else if k == "content-length" {
                length = Some(v.parse::<usize>().map_err(|_| anyhow!("bad content-length `{v}`"))?);
            }
        }
        let mut raw = buf.split_off(header_end + 4);
        let mut body = Vec::new();
        let no_body = method == "HEAD" || status == 204 || status == 304 || (100..200).contains(&status);
        if no_body {
            return Ok(HttpResponse { status, body });
        }
        if chunked {
            let mut dec = Chunked::default();
            loop {
                let mut emit = |b: &[u8]| {
                    on_body(b);
                    body.extend_from_slice(b);
                };
                dec.feed(&mut raw, &mut emit)?;
                if dec.done {
                    break;
                }
                if read_some(&stream, &mut raw).await? == 0 {
                    bail!("the connection closed in the middle of a chunked body ({} bytes decoded)", body.len());
                }
            }
        } else if let Some(n) = length {
            loop {
                let take = raw.len().min(n - body.len());
                on_body(&raw[..take]);
                body.extend_from_slice(&raw[..take]);
                raw.clear();
                if body.len() == n {
                    break;
                }
                if read_some(&stream, &mut raw).await? == 0 {
                    bail!("the connection closed after {} of {n} body bytes", body.len());
                }
            }
        } else {
            loop {
                on_body(&raw);
                body.append(&mut raw);
                if read_some(&stream, &mut raw).await? == 0 {
                    break;
                }
            }
        }
        Ok(HttpResponse { status, body })
    }
}

async fn write_all(s: &tokio::net::TcpStream, mut data: &[u8]) -> Result<()> {
    while !data.is_empty() {
        s.writable().await?;
        match s.try_write(data) {
            Ok(0) => bail!("the connection closed while sending"),
            Ok(n) => data = &data[n..],
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// Appends what the socket has (waiting for at least one byte); 0 at end of stream.
async fn read_some(s: &tokio::net::TcpStream, buf: &mut Vec<u8>) -> Result<usize> {
    let mut tmp = [0u8; 16 << 10];
    loop {
        s.readable().await?;
        match s.try_read(&mut tmp) {
            Ok(n) => {
                buf.extend_from_slice(&tmp[..n]);
                return Ok(n);
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(anyhow::Error::new(e).context("reading the response")),
        }
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// The message of an error body (OpenAI / Anthropic `error.message`), else the body itself.
fn error_text(body: &[u8]) -> String {
    let v: Option<Value> = serde_json::from_slice(body).ok();
    match v.as_ref().and_then(|v| v["error"]["message"].as_str()) {
        Some(m) => m.to_string(),
        None => {
            let s = String::from_utf8_lossy(body);
            let s = s.trim();
            if s.is_empty() { "(empty body)".into() } else { s.chars().take(500).collect() }
        }
    }
}

/// Incremental decoder of `Transfer-Encoding: chunked`.
#[derive(Default)]
struct Chunked {
    /// Bytes left in the current chunk's data.
    left: usize,
    /// The CRLF after a chunk's data is still due.
    crlf_due: bool,
    done: bool,
}

impl Chunked {
    /// Decodes what `raw` holds, consuming it; leaves an incomplete size line in `raw`.
    fn feed(&mut self, raw: &mut Vec<u8>, emit: &mut impl FnMut(&[u8])) -> Result<()> {
        let mut pos = 0;
        while !self.done {
            if self.left > 0 {
                let take = self.left.min(raw.len() - pos);
                if take == 0 {
                    break;
                }
                emit(&raw[pos..pos + take]);
                pos += take;
                self.left -= take;
                if self.left == 0 {
                    self.crlf_due = true;
                }
            } else if self.crlf_due {
                if raw.len() - pos < 2 {
                    break;
                }
                if &raw[pos..pos + 2] != b"\r\n" {
                    bail!("malformed chunked body: no CRLF after a chunk");
                }
                pos += 2;
                self.crlf_due = false;
            } else {
                let Some(i) = find(&raw[pos..], b"\r\n") else {
                    if raw.len() - pos > 1024 {
                        bail!("malformed chunked body: a chunk-size line over 1 KiB");
                    }
                    break;
                };
                let line = std::str::from_utf8(&raw[pos..pos + i]).unwrap_or("");
                let hex = line.split(';').next().unwrap_or("").trim();
                let size = usize::from_str_radix(hex, 16)
                    .map_err(|_| anyhow!("malformed chunked body: bad chunk size `{}`", line.escape_debug()))?;
                pos += i + 2;
                if size == 0 {
                    // Trailers, if any, are not needed: the connection closes after them.
                    self.done = true;
                } else {
                    self.left = size;
                }
            }
        }
        raw.drain(..pos);
        Ok(())
    }
}

/// Incremental Server-Sent Events parser: calls back with each event's `data`.
#[derive(Default)]
struct SseParser {
    line: Vec<u8>,
    data: Option<String>,
}

impl SseParser {
    fn feed(&mut self, bytes: &[u8], mut on_data: impl FnMut(&str)) {
        for &b in bytes {
            if b == b'\n' {
                let mut line = std::mem::take(&mut self.line);
                if line.last() == Some(&b'\r') {
                    line.pop();
                }
                self.line_done(&String::from_utf8_lossy(&line), &mut on_data);
            } else {
                self.line.push(b);
            }
        }
    }

    fn line_done(&mut self, line: &str, on_data: &mut impl FnMut(&str)) {
        if line.is_empty() {
            if let Some(d) = self.data.take() {
                on_data(&d);
            }
        } else if let Some(v) = line.strip_prefix("data:") {
            let v = v.strip_prefix(' ').unwrap_or(v);
            match &mut self.data {
                Some(d) => {
                    d.push('\n');
                    d.push_str(v);
                }
                None => self.data = Some(v.to_string()),
            }
        } // comments (`:`), `event:`, `id:` and `retry:` lines are not needed
    }

    /// Dispatches an event left unterminated at the end of the stream.
    fn finish(&mut self, mut on_data: impl FnMut(&str)) {
        if !self.line.is_empty() {
            let line = String::from_utf8_lossy(&std::mem::take(&mut self.line)).into_owned();
            self.line_done(&line, &mut on_data);
        }
        self.line_done("", &mut on_data);
    }
}

/// Folds one SSE `data` payload of a chat completion stream into `r`.
fn on_event(r: &mut Reply, data: &str) {
    if r.error.is_some() {
        return;
    }
    if data.trim() == "[DONE]" {
        r.done = true;
        return;
    }
    if r.done {
        r.error = Some("data after [DONE]".into());
        return;
    }
    let v: Value = match serde_json::from_str(data) {
        Ok(v) => v,
        Err(e) => {
            r.error = Some(format!("an event is not JSON ({e}): {}", data.chars().take(200).collect::<String>()));
            return;
        }
    };
    if let Some(e) = v.get("error") {
        r.error = Some(format!("error event: {}", e.get("message").and_then(Value::as_str).unwrap_or(&e.to_string())));
        return;
    }
    if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
        r.usage = Some(u.clone());
    }
    let Some(choices) = v.get("choices").and_then(Value::as_array) else {
        r.error = Some(format!("a chunk without `choices`: {data}"));
        return;
    };
    for c in choices {
        let delta = &c["delta"];
        let mut token = false;
        if let Some(s) = delta["content"].as_str() {
            token |= !s.is_empty();
            r.content.push_str(s);
        }
        if let Some(s) = delta["reasoning_content"].as_str() {
            token |= !s.is_empty();
            r.reasoning.push_str(s);
        }
        if let Some(calls) = delta["tool_calls"].as_array() {
            for call in calls {
                token = true;
                let i = call["index"].as_u64().unwrap_or(0) as usize;
                while r.tool_calls.len() <= i {
                    r.tool_calls.push(Default::default());
                }
                let slot = &mut r.tool_calls[i];
                if let Some(id) = call["id"].as_str() {
                    slot.0 = id.to_string();
                }
                if let Some(n) = call["function"]["name"].as_str() {
                    slot.1.push_str(n);
                }
                if let Some(a) = call["function"]["arguments"].as_str() {
                    slot.2.push_str(a);
                }
            }
        }
        if token && r.first_token.is_none() {
            r.first_token = Some(Instant::now());
        }
        if let Some(f) = c["finish_reason"].as_str() {
            r.finish_reason = Some(f.to_string());
            r.first_finish.get_or_insert_with(Instant::now);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Output: JSON, table, SVG

impl Report {
    fn ttft_ratio(&self) -> Option<f64> {
        let (t2, last) = (self.turns.get(1)?, self.turns.last()?);
        (self.turns.len() >= 2 && t2.ttft_per_new_token_ms() > 0.0)
            .then(|| last.ttft_per_new_token_ms() / t2.ttft_per_new_token_ms())
    }

    fn min_cached_fraction(&self) -> Option<f64> {
        self.turns
            .windows(2)
            .map(|w| w[1].cached_tokens as f64 / w[0].prompt_tokens.max(1) as f64)
            .min_by(|a, b| a.total_cmp(b))
    }

    fn to_json(&self) -> Value {
        let turns: Vec<Value> = self
            .turns
            .iter()
            .map(|t| {
                json!({
                    "turn": t.turn,
                    "kind": t.kind,
                    "prompt_tokens": t.prompt_tokens,
                    "cached_tokens": t.cached_tokens,
                    "new_tokens": t.new_tokens(),
                    "completion_tokens": t.completion_tokens,
                    "ttft_ms": round3(t.ttft_ms),
                    "ttft_per_new_token_ms": round3(t.ttft_per_new_token_ms()),
                    "total_ms": round3(t.total_ms),
                    "arena_high_water_bytes": t.arena_high_water_bytes,
                    "arena_allocations": t.arena_allocations,
                    "kv_pages_used": t.kv_pages_used,
                    "host_rss_bytes": t.host_rss_bytes,
                })
            })
            .collect();
        json!({
            "turns": turns,
            "summary": {
                "server": self.server,
                "turns": self.turns.len(),
                "target_context": self.target_context,
                "final_context": self.turns.last().map_or(0, |t| t.prompt_tokens),
                "ttft_ratio_last_vs_turn2_per_new_token": self.ttft_ratio().map(round3),
                "min_cached_fraction_of_previous_context": self.min_cached_fraction().map(round3),
                "baseline_arena_allocations": self.baseline.map(|b| b.0),
                "baseline_arena_high_water_bytes": self.baseline.map(|b| b.1),
                "ok": self.failures.is_empty(),
                "failures": self.failures,
            }
        })
    }

    fn table(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "soak: {} turns against {} (target context {})",
            self.turns.len(),
            self.server,
            self.target_context
        );
        let rss = if self.in_process { "  host RSS" } else { "" };
        let _ = writeln!(
            s,
            "{:>4} {:>4} {:>8} {:>8} {:>7} {:>9} {:>12} {:>9} {:>14} {:>7}{rss}",
            "turn", "msg", "prompt", "cached", "new", "ttft ms", "ttft/new ms", "total ms", "arena hw", "allocs"
        );
        for t in &self.turns {
            let _ = write!(
                s,
                "{:>4} {:>4} {:>8} {:>8} {:>7} {:>9.1} {:>12.4} {:>9.1} {:>14} {:>7}",
                t.turn,
                t.kind,
                t.prompt_tokens,
                t.cached_tokens,
                t.new_tokens(),
                t.ttft_ms,
                t.ttft_per_new_token_ms(),
                t.total_ms,
                t.arena_high_water_bytes.map_or("-".into(), |v| v.to_string()),
                t.arena_allocations.map_or("-".into(), |v| v.to_string()),
            );
            if self.in_process {
                let _ = write!(
                    s,
                    "  {}",
                    t.host_rss_bytes.map_or("-".into(), |v| format!("{:.1} MiB", v as f64 / 1048576.0))
                );
            }
            s.push('\n');
        }
        let fmt = |v: Option<f64>| v.map_or("-".into(), |v| format!("{v:.3}"));
        let _ = writeln!(
            s,
            "final context {} tokens; min cached fraction of the previous context {}; TTFT per new token, last vs turn 2: {}",
            self.turns.last().map_or(0, |t| t.prompt_tokens),
            fmt(self.min_cached_fraction()),
            fmt(self.ttft_ratio())
        );
        if self.failures.is_empty() {
            let _ = writeln!(s, "ok");
        } else {
            let _ = writeln!(s, "FAILED:");
            for f in &self.failures {
                let _ = writeln!(s, "  - {f}");
            }
        }
        s
    }

    /// Two panels: TTFT per turn (bars, ms) and prompt tokens per turn split into cached and new.
    fn svg(&self) -> String {
        let (w, h, left, right, top, panel, gap) = (760.0, 560.0, 70.0, 20.0, 40.0, 200.0, 70.0);
        let plot_w = w - left - right;
        let n = self.turns.len().max(1) as f64;
        let slot = plot_w / n;
        let bar = (slot * 0.7).max(1.0);
        let mut s = String::new();
        let _ = writeln!(
            s,
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" font-family="sans-serif" font-size="11">"#
        );
        let _ = writeln!(s, r#"<rect width="{w}" height="{h}" fill="white"/>"#);
        let _ = writeln!(
            s,
            r#"<text x="{left}" y="20" font-size="14">deltaserve soak: {} turns, {} ({})</text>"#,
            self.turns.len(),
            xml(&self.server),
            if self.failures.is_empty() { "ok" } else { "FAILED" }
        );
        // Panel 1: TTFT.
        let max_ttft = self.turns.iter().map(|t| t.ttft_ms).fold(0.0, f64::max).max(1e-3);
        let y0 = top + 20.0;
        axes(&mut s, left, y0, plot_w, panel, max_ttft, "time to first token (ms)");
        for (i, t) in self.turns.iter().enumerate() {
            let x = left + slot * i as f64 + (slot - bar) / 2.0;
            let bh = panel * t.ttft_ms / max_ttft;
            let _ = writeln!(
                s,
                r##"<rect x="{x:.1}" y="{:.1}" width="{bar:.1}" height="{bh:.1}" fill="#4878cf"><title>turn {}: {:.1} ms ({:.4} ms per new token)</title></rect>"##,
                y0 + panel - bh,
                t.turn,
                t.ttft_ms,
                t.ttft_per_new_token_ms()
            );
        }
        // Panel 2: cached vs new prompt tokens.
        let max_tok = self.turns.iter().map(|t| t.prompt_tokens).max().unwrap_or(1).max(1) as f64;
        let y1 = y0 + panel + gap;
        axes(&mut s, left, y1, plot_w, panel, max_tok, "prompt tokens per turn: cached / new");
        for (i, t) in self.turns.iter().enumerate() {
            let x = left + slot * i as f64 + (slot - bar) / 2.0;
            let ch = panel * t.cached_tokens as f64 / max_tok;
            let nh = panel * t.new_tokens() as f64 / max_tok;
            let _ = writeln!(
                s,
                r##"<rect x="{x:.1}" y="{:.1}" width="{bar:.1}" height="{ch:.1}" fill="#6acc65"><title>turn {}: {} cached</title></rect>"##,
                y1 + panel - ch,
                t.turn,
                t.cached_tokens
            );
            let _ = writeln!(
                s,
                r##"<rect x="{x:.1}" y="{:.1}" width="{bar:.1}" height="{nh:.1}" fill="#d65f5f"><title>turn {}: {} new</title></rect>"##,
                y1 + panel - ch - nh,
                t.turn,
                t.new_tokens()
            );
            if self.turns.len() <= 40 || i % (self.turns.len() / 20).max(1) == 0 {
                let _ = writeln!(
                    s,
                    r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
                    x + bar / 2.0,
                    y1 + panel + 14.0,
                    t.turn
                );
            }
        }
        let ly = y1 + panel + 34.0;
        let _ = writeln!(
            s,
            r##"<rect x="{left}" y="{:.1}" width="10" height="10" fill="#6acc65"/><text x="{:.1}" y="{:.1}">cached</text><rect x="{:.1}" y="{:.1}" width="10" height="10" fill="#d65f5f"/><text x="{:.1}" y="{:.1}">new</text><text x="{:.1}" y="{:.1}" text-anchor="end">turn</text>"##,
            ly - 9.0,
            left + 14.0,
            ly,
            left + 70.0,
            ly - 9.0,
            left + 84.0,
            ly,
            w - right,
            ly
        );
        s.push_str("</svg>\n");
        s
    }
}

/// A panel's frame, title and three y-axis ticks.
fn axes(s: &mut String, x: f64, y: f64, w: f64, h: f64, max: f64, title: &str) {
    let _ = writeln!(s, r#"<text x="{x}" y="{:.1}" font-size="12">{}</text>"#, y - 8.0, xml(title));
    let _ = writeln!(s, r##"<rect x="{x}" y="{y}" width="{w}" height="{h}" fill="none" stroke="#999"/>"##);
    for k in 0..=2 {
        let v = max * k as f64 / 2.0;
        let ty = y + h - h * k as f64 / 2.0;
        let label = if max >= 100.0 { format!("{v:.0}") } else { format!("{v:.2}") };
        let _ = writeln!(
            s,
            r##"<line x1="{:.1}" y1="{ty:.1}" x2="{x}" y2="{ty:.1}" stroke="#999"/><text x="{:.1}" y="{:.1}" text-anchor="end">{label}</text>"##,
            x - 4.0,
            x - 6.0,
            ty + 4.0
        );
    }
}

fn xml(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

fn round3(v: f64) -> f64 {
    (v * 1000.0).round() / 1000.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunked_decoding_survives_any_split() {
        let wire = b"5\r\nhello\r\n7;ext=1\r\n, world\r\n0\r\n\r\n";
        for cut in 0..wire.len() {
            let mut dec = Chunked::default();
            let mut out = Vec::new();
            let mut raw = wire[..cut].to_vec();
            dec.feed(&mut raw, &mut |b: &[u8]| out.extend_from_slice(b)).unwrap();
            raw.extend_from_slice(&wire[cut..]);
            dec.feed(&mut raw, &mut |b: &[u8]| out.extend_from_slice(b)).unwrap();
            assert!(dec.done, "cut {cut}");
            assert_eq!(out, b"hello, world", "cut {cut}");
        }
        let mut raw = b"zz\r\n".to_vec();
        assert!(Chunked::default().feed(&mut raw, &mut |_: &[u8]| {}).is_err());
    }

    #[test]
    fn sse_events_split_anywhere() {
        let wire = "data: {\"a\":1}\n\n: keep-alive\n\ndata: [DONE]\n\n";
        for cut in 0..wire.len() {
            let mut p = SseParser::default();
            let mut got = Vec::new();
            p.feed(&wire.as_bytes()[..cut], |d| got.push(d.to_string()));
            p.feed(&wire.as_bytes()[cut..], |d| got.push(d.to_string()));
            p.finish(|d| got.push(d.to_string()));
            assert_eq!(got, ["{\"a\":1}", "[DONE]"], "cut {cut}");
        }
    }

    #[test]
    fn urls() {
        let t = Target::parse("http://127.0.0.1:8000/v1/").unwrap();
        assert_eq!((t.host.as_str(), t.port, t.base.as_str()), ("127.0.0.1", 8000, ""));
        let t = Target::parse("localhost/prefix").unwrap();
        assert_eq!((t.host.as_str(), t.port, t.base.as_str()), ("localhost", 80, "/prefix"));
        assert!(Target::parse("https://x").is_err());
    }

    #[test]
    fn the_checks() {
        let t = |turn, prompt, cached, alloc| Turn {
            turn,
            prompt_tokens: prompt,
            cached_tokens: cached,
            arena_allocations: Some(alloc),
            arena_high_water_bytes: Some(100),
            ..Default::default()
        };
        let mut f = Vec::new();
        check_turn(&t(1, 100, 0, 5), None, Some((5, 100)), &mut f);
        check_turn(&t(2, 200, 95, 5), Some(&t(1, 100, 0, 5)), None, &mut f);
        assert!(f.is_empty(), "{f:?}");
        check_turn(&t(2, 200, 94, 5), Some(&t(1, 100, 0, 5)), None, &mut f);
        check_turn(&t(2, 200, 200, 6), Some(&t(1, 100, 0, 5)), None, &mut f);
        assert_eq!(f.len(), 3, "{f:?}");
    }
}
