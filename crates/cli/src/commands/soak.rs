//! `deltaserve soak`: replays a synthetic multi-turn agent session through the HTTP API and reports
//! what every turn cost: prompt / cached / new tokens, time to first token, total time, and the
//! server's memory counters. Fails on HTTP errors, malformed responses, prefix-cache misses (a
//! turn must restore ≥ 95% of the previous turn's prompt) and any arena growth between turns.
//!
//! `--sessions N` runs N such sessions at once (seeds `--seed`..`--seed + N - 1`, each naming itself in
//! an `X-Session-Id` header), e.g. through a gateway in front of several replicas, and reports each
//! session's cached fraction and TTFT. A gateway does not proxy `/metrics`: then the per-turn server
//! counters are left out, and `--metrics-url` (repeatable) names the replicas whose `/metrics` are read
//! before and after the run (arena growth fails the run; their prefix-cache hits are reported).
//!
//! `--screenshot WxH` makes the sessions carry images: every turn adds one synthetic screenshot (distinct per
//! turn and session) in a user message, and the history keeps the earlier ones unchanged, so each turn
//! restores them from the prefix cache (which keys an image by the hash of its decoded pixels) like the
//! text around them. The report gives the image tokens of every turn's prompt; a server that cannot take
//! the screenshots is refused before the first turn.
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
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};
use serde_json::{Map, Value, json};

use super::soak_sessions::{Replica, read_replicas, sessions_table};
use crate::http::{Client, Reply, Target};
use crate::in_process::{ServerArgs, host_rss_bytes};
use crate::report::{ToolReport, emit, round_to, xml};
use crate::synthetic_images::{ImageCheck, ImageSize, LocalImages, image_part, image_seed};
use crate::synthetic_text::{Rng, follow_up, system_prompt, task, tool_output, tools};

/// Required fraction of the previous turn's prompt that the next turn must restore from the cache.
const MIN_CACHED_FRACTION: f64 = 0.95;
/// Every this many turns the new message is a user follow-up instead of a tool result.
const USER_EVERY: usize = 4;

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    server: ServerArgs,
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
    /// Agent sessions run at once (session i uses seed --seed + i and sends `X-Session-Id: soak-SEED`).
    #[arg(long, default_value_t = 1)]
    sessions: usize,
    /// A replica's base URL whose /metrics is read before and after the run (repeatable), when --url is a
    /// gateway; with it, or with several sessions, /metrics is not read from --url between turns.
    #[arg(long = "metrics-url", value_name = "URL")]
    metrics_urls: Vec<String>,
    /// Every turn adds one synthetic screenshot of WIDTHxHEIGHT pixels (distinct per turn and session) in a
    /// user message; the earlier ones stay in the history unchanged. A request then carries up to --turns
    /// images (the server's limit: 32 by default).
    #[arg(long, value_name = "WxH")]
    screenshot: Option<ImageSize>,
}

pub fn run(a: Args) -> Result<()> {
    if a.turns == 0 {
        bail!("--turns must be at least 1");
    }
    if a.max_tokens == 0 {
        bail!("--max-tokens must be at least 1");
    }
    if a.sessions == 0 {
        bail!("--sessions must be at least 1");
    }
    let replicas = a.metrics_urls.iter().map(|u| Target::parse(u)).collect::<Result<Vec<_>>>()?;
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let report = rt.block_on(async {
        let server = a.server.connect().await?;
        let local_images = server.local.as_ref().map(|l| &l.images);
        let report = soak(&a, &server.target, &replicas, server.model.clone(), local_images).await;
        server.stop().await?;
        anyhow::Ok(report)
    });
    rt.shutdown_timeout(Duration::from_secs(2));
    emit("soak", &report?, a.json, a.svg.as_deref())
}

// ---------------------------------------------------------------------------------------------
// The session

/// One turn's measurements.
#[derive(Clone, Debug, Default)]
pub(super) struct Turn {
    pub(super) turn: usize,
    /// What the turn appended: `task` (turn 1), `tool` or `user`.
    pub(super) kind: &'static str,
    pub(super) prompt_tokens: u64,
    pub(super) cached_tokens: u64,
    pub(super) completion_tokens: u64,
    pub(super) ttft_ms: f64,
    pub(super) total_ms: f64,
    pub(super) arena_high_water_bytes: Option<u64>,
    pub(super) arena_allocations: Option<u64>,
    pub(super) kv_pages_used: Option<u64>,
    pub(super) host_rss_bytes: Option<u64>,
    /// Engine steps during the turn and their wall time (from the server's /metrics before and
    /// after it): how much of the turn was compute, and in how many steps its prompt ran.
    pub(super) steps: Option<u64>,
    pub(super) step_ms: Option<f64>,
    /// Screenshots in the prompt and the prompt tokens they take (their placeholders).
    pub(super) images: usize,
    pub(super) image_tokens: u64,
}

impl Turn {
    fn new_tokens(&self) -> u64 {
        self.prompt_tokens.saturating_sub(self.cached_tokens)
    }
    fn ttft_per_new_token_ms(&self) -> f64 {
        self.ttft_ms / self.new_tokens().max(1) as f64
    }
}

/// Cached tokens of each turn over the previous turn's prompt (None for the first).
fn cached_fractions(turns: &[Turn]) -> impl Iterator<Item = Option<f64>> + '_ {
    turns.iter().enumerate().map(|(i, t)| {
        let prev = i.checked_sub(1).map(|j| &turns[j])?;
        Some(t.cached_tokens as f64 / prev.prompt_tokens.max(1) as f64)
    })
}

struct Report {
    server: String,
    in_process: bool,
    target_context: usize,
    /// `--screenshot` and the prompt tokens one takes.
    screenshot: Option<(ImageSize, usize)>,
    /// One per session, in session order.
    sessions: Vec<Session>,
    /// The --metrics-url replicas' counters before and after the run.
    replicas: Vec<Replica>,
    /// Seconds from the first session's start to the last one's end.
    wall_s: f64,
    failures: Vec<String>,
}

/// One agent session's turns.
#[derive(Default)]
pub(super) struct Session {
    pub(super) key: String,
    pub(super) turns: Vec<Turn>,
    /// Arena counters before the first turn (when /metrics is read from the target between turns).
    pub(super) baseline: Option<(u64, u64)>,
    pub(super) failures: Vec<String>,
}

async fn soak(
    a: &Args,
    target: &Target,
    replicas: &[Target],
    model: Option<String>,
    local_images: Option<&LocalImages>,
) -> Report {
    let in_process = local_images.is_some();
    let mut report = Report {
        server: if in_process { format!("in-process {}", target.origin()) } else { target.origin() },
        in_process,
        target_context: a.target_context,
        screenshot: None,
        sessions: Vec::new(),
        replicas: Vec::new(),
        wall_s: 0.0,
        failures: Vec::new(),
    };
    let client = |session: Option<String>, target: &Target| Client {
        target: target.clone(),
        api_key: a.server.api_key.clone(),
        timeout: Duration::from_secs(a.request_timeout_secs),
        session,
    };
    let replica_clients: Vec<Client> = replicas.iter().map(|r| client(None, r)).collect();
    let before = match read_replicas(&replica_clients).await {
        Ok(m) => m,
        Err(e) => {
            report.failures.push(format!("{e:#}"));
            return report;
        }
    };
    // Reachability first, and the model name when none was given.
    let model = match resolve_model(&client(None, target), model).await {
        Ok(m) => m,
        Err(e) => {
            report.failures.push(format!("{e:#}"));
            return report;
        }
    };
    if let Some(size) = a.screenshot {
        let why = format!("the last turn carries one screenshot per turn: --turns {}", a.turns);
        let check = ImageCheck { flag: "--screenshot", size, per_request: a.turns, why, local: local_images };
        match check.run(&client(None, target), &model).await {
            Ok(tokens) => report.screenshot = Some((size, tokens)),
            Err(e) => {
                report.failures.push(format!("{e:#}"));
                return report;
            }
        }
    }
    // Between turns /metrics describes this session's server only when it serves nothing else.
    let per_turn_metrics = a.sessions == 1 && replicas.is_empty();
    let start = std::time::Instant::now();
    let shape = Shape {
        turns: a.turns,
        target_context: a.target_context,
        max_tokens: a.max_tokens,
        screenshot: report.screenshot,
    };
    let runs: Vec<_> = (0..a.sessions as u64)
        .map(|i| {
            let seed = a.seed + i;
            let key = format!("soak-{seed}");
            let c = client(Some(key.clone()), target);
            let model = model.clone();
            tokio::spawn(async move {
                let mut session = Session { key, ..Default::default() };
                if let Err(e) = run_session(shape, &c, &model, seed, per_turn_metrics, in_process, &mut session).await {
                    session.failures.push(format!("{e:#}"));
                }
                session
            })
        })
        .collect();
    for run in runs {
        match run.await {
            Ok(session) => report.sessions.push(session),
            Err(e) => report.failures.push(format!("a session's task failed: {e}")),
        }
    }
    report.wall_s = start.elapsed().as_secs_f64();
    for s in &report.sessions {
        let prefix = if a.sessions > 1 { format!("session {}: ", s.key) } else { String::new() };
        report.failures.extend(s.failures.iter().map(|f| format!("{prefix}{f}")));
    }
    match read_replicas(&replica_clients).await {
        Ok(after) => report.replicas = Replica::compare(replicas, before, after, &mut report.failures),
        Err(e) => report.failures.push(format!("{e:#}")),
    }
    report
}

/// `model`, or the first id of the target's /v1/models.
async fn resolve_model(client: &Client, model: Option<String>) -> Result<String> {
    let models = client.get_json("/v1/models").await?;
    match model {
        Some(m) => Ok(m),
        None => models["data"][0]["id"]
            .as_str()
            .map(str::to_string)
            .ok_or_else(|| anyhow!("GET /v1/models: no model id in {models}")),
    }
}

/// What every session's turns are sized by.
#[derive(Clone, Copy)]
struct Shape {
    turns: usize,
    target_context: usize,
    max_tokens: u32,
    /// A screenshot each turn, and the prompt tokens it takes.
    screenshot: Option<(ImageSize, usize)>,
}

/// Prompt tokens a screenshot's message adds beyond the image's placeholders (its vision markers, the
/// caption and the user turn's wrapping), about.
const SCREENSHOT_OVERHEAD: u64 = 16;

/// The screenshot of turn `turn` of the session seeded `seed` as a user message's content, after `text`.
fn with_screenshot(text: String, size: ImageSize, seed: u64, turn: usize) -> Value {
    json!([{"type": "text", "text": text}, image_part(size, image_seed(seed, turn as u64, 0))])
}

async fn run_session(
    a: Shape,
    client: &Client,
    model: &str,
    seed: u64,
    per_turn_metrics: bool,
    in_process: bool,
    report: &mut Session,
) -> Result<()> {
    let mut last_steps = (None, None);
    if per_turn_metrics {
        let m0 = client.metrics().await?;
        report.baseline = Some((m0.allocations, m0.high_water));
        last_steps = (m0.steps, m0.step_seconds);
    }

    let mut rng = Rng::new(seed);
    let n = a.turns;
    // Relative payload sizes of turns 2..=n: geometric growth with seeded jitter.
    let weights: Vec<f64> = (0..n).map(|i| 1.3f64.powi(i as i32) * (0.75 + 0.5 * rng.unit())).collect();
    let (system, task) = (system_prompt(), task(&mut rng));
    let tools = tools();
    // Characters per prompt token, refined from what the server reports.
    let initial_chars = system.len() + task.len() + tools.to_string().len();
    // Prompt tokens of one turn's screenshot message beyond its text.
    let shot = a.screenshot.map_or(0, |(_, tokens)| tokens as u64 + SCREENSHOT_OVERHEAD);
    let task = match a.screenshot {
        Some((size, _)) => with_screenshot(task, size, seed, 1),
        None => json!(task),
    };
    let mut messages = vec![json!({"role": "system", "content": system}), json!({"role": "user", "content": task})];
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
                let grew = pt.prompt_tokens.saturating_sub(before + 12 + shot) as f64;
                if grew > 8.0 {
                    chars_per_token = 0.5 * chars_per_token + 0.5 * (*prev_payload as f64 / grew);
                }
            }
            let reply_overhead = u64::from(a.max_tokens) + 16;
            let context_now = pt.prompt_tokens + pt.completion_tokens + 12;
            let remaining_turns = (n - t + 1) as u64;
            let budget = (a.target_context as u64)
                .saturating_sub(context_now + (remaining_turns - 1) * reply_overhead + remaining_turns * (12 + shot));
            let w: f64 = weights[t - 1..].iter().sum();
            let tokens = (budget as f64 * weights[t - 1] / w).max(8.0);
            payload_chars = (tokens * chars_per_token).round() as usize;
            messages.push(assistant_message(reply));
            if t % USER_EVERY == 0 {
                kind = "user";
                let text = follow_up(&mut rng, payload_chars);
                let content = match a.screenshot {
                    Some((size, _)) => with_screenshot(text, size, seed, t),
                    None => json!(text),
                };
                messages.push(json!({"role": "user", "content": content}));
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
                // Tool messages carry no images: the screenshot follows in a user message.
                if let Some((size, _)) = a.screenshot {
                    let caption = format!("Screenshot after step {}:", t - 1);
                    messages.push(json!({"role": "user", "content": with_screenshot(caption, size, seed, t)}));
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
            images: if a.screenshot.is_some() { t } else { 0 },
            image_tokens: a.screenshot.map_or(0, |(_, tokens)| (t * tokens) as u64),
            ..Default::default()
        };
        if per_turn_metrics {
            let m = client.metrics().await.with_context(|| format!("turn {t}"))?;
            turn.steps = m.steps.zip(last_steps.0).map(|(a, b)| a.saturating_sub(b));
            turn.step_ms = m.step_seconds.zip(last_steps.1).map(|(a, b)| (a - b).max(0.0) * 1e3);
            last_steps = (m.steps, m.step_seconds);
            turn.arena_allocations = Some(m.allocations);
            turn.arena_high_water_bytes = Some(m.high_water);
            turn.kv_pages_used = m.kv_pages_used;
        }
        turn.host_rss_bytes = if in_process { host_rss_bytes() } else { None };
        if t == 1 && turn.prompt_tokens > shot {
            chars_per_token = initial_chars as f64 / (turn.prompt_tokens - shot) as f64;
        }
        check_turn(&turn, report.turns.last(), report.baseline, &mut report.failures);
        tracing::info!(
            session = %report.key,
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
// Output: JSON, table, SVG

impl Report {
    /// Completion tokens of every session's turns.
    fn generated_tokens(&self) -> u64 {
        self.sessions.iter().flat_map(|s| &s.turns).map(|t| t.completion_tokens).sum()
    }

    /// The first session's turns (the only session's, without --sessions).
    fn turns(&self) -> &[Turn] {
        self.sessions.first().map_or(&[], |s| &s.turns)
    }
}

impl Session {
    fn ttft_ratio(&self) -> Option<f64> {
        let (t2, last) = (self.turns.get(1)?, self.turns.last()?);
        (self.turns.len() >= 2 && t2.ttft_per_new_token_ms() > 0.0)
            .then(|| last.ttft_per_new_token_ms() / t2.ttft_per_new_token_ms())
    }

    /// The smallest share of the previous turn's prompt a turn found cached.
    pub(super) fn min_cached_fraction(&self) -> Option<f64> {
        self.turns
            .windows(2)
            .map(|w| w[1].cached_tokens as f64 / w[0].prompt_tokens.max(1) as f64)
            .min_by(|a, b| a.total_cmp(b))
    }
}

impl ToolReport for Report {
    fn to_json(&self) -> Value {
        let turns: Vec<Value> = self
            .sessions
            .iter()
            .flat_map(|s| s.turns.iter().zip(cached_fractions(&s.turns)).map(move |(t, f)| (s, t, f)))
            .map(|(session, t, cached_fraction)| {
                json!({
                    "session": session.key,
                    "turn": t.turn,
                    "kind": t.kind,
                    "prompt_tokens": t.prompt_tokens,
                    "cached_tokens": t.cached_tokens,
                    "new_tokens": t.new_tokens(),
                    "cached_fraction_of_previous_context": cached_fraction.map(|v| round_to(v, 4)),
                    "images": t.images,
                    "image_tokens": t.image_tokens,
                    "completion_tokens": t.completion_tokens,
                    "ttft_ms": round3(t.ttft_ms),
                    "ttft_per_new_token_ms": round3(t.ttft_per_new_token_ms()),
                    "total_ms": round3(t.total_ms),
                    "arena_high_water_bytes": t.arena_high_water_bytes,
                    "arena_allocations": t.arena_allocations,
                    "kv_pages_used": t.kv_pages_used,
                    "host_rss_bytes": t.host_rss_bytes,
                    "steps": t.steps,
                    "step_ms": t.step_ms.map(round3),
                })
            })
            .collect();
        let n_turns = turns.len();
        let generated = self.generated_tokens();
        let first = self.sessions.first();
        let baseline = first.and_then(|s| s.baseline);
        let min_cached = self.sessions.iter().filter_map(Session::min_cached_fraction).min_by(f64::total_cmp);
        json!({
            "turns": turns,
            "sessions": self.sessions.iter().map(Session::summary).collect::<Vec<_>>(),
            "replicas": self.replicas.iter().map(Replica::to_json).collect::<Vec<_>>(),
            "summary": {
                "server": self.server,
                "sessions": self.sessions.len(),
                "turns": n_turns,
                "target_context": self.target_context,
                "screenshot": self.screenshot.map(|(size, _)| size.to_string()),
                "tokens_per_screenshot": self.screenshot.map(|(_, tokens)| tokens),
                "final_context": self.sessions.iter().filter_map(|s| s.turns.last()).map(|t| t.prompt_tokens).max(),
                "ttft_ratio_last_vs_turn2_per_new_token": first.and_then(Session::ttft_ratio).map(round3),
                "min_cached_fraction_of_previous_context": min_cached.map(round3),
                "wall_s": round3(self.wall_s),
                "generated_tokens": generated,
                "generated_tokens_per_s": round3(generated as f64 / self.wall_s.max(1e-9)),
                "baseline_arena_allocations": baseline.map(|b| b.0),
                "baseline_arena_high_water_bytes": baseline.map(|b| b.1),
                "ok": self.failures.is_empty(),
                "failures": self.failures,
            }
        })
    }

    fn table(&self) -> String {
        let mut s = String::new();
        if self.sessions.len() > 1 || !self.replicas.is_empty() {
            sessions_table(&mut s, &self.server, self.target_context, &self.sessions, &self.replicas);
            let _ = writeln!(
                s,
                "{} tokens generated in {:.1} s: {:.1} tokens/s over all sessions",
                self.generated_tokens(),
                self.wall_s,
                self.generated_tokens() as f64 / self.wall_s.max(1e-9)
            );
        } else {
            self.turns_table(&mut s);
        }
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

    /// Two panels: TTFT per turn (bars, ms) and prompt tokens per turn split into cached and new (the
    /// first session's).
    fn svg(&self) -> String {
        self.turns_svg()
    }

    fn failures(&self) -> Vec<String> {
        self.failures.clone()
    }
}

impl Report {
    /// One row per turn of the only session.
    fn turns_table(&self, s: &mut String) {
        let _ = writeln!(
            s,
            "soak: {} turns against {} (target context {})",
            self.turns().len(),
            self.server,
            self.target_context
        );
        if let Some((size, tokens)) = self.screenshot {
            let _ = writeln!(s, "every turn adds a {size} screenshot ({tokens} prompt tokens each)");
        }
        let rss = if self.in_process { "  host RSS" } else { "" };
        let img = if self.screenshot.is_some() { format!(" {:>8}", "img tok") } else { String::new() };
        let _ = writeln!(
            s,
            "{:>4} {:>4} {:>8} {:>8} {:>7} {:>7}{img} {:>9} {:>12} {:>9} {:>6} {:>9} {:>14} {:>7}{rss}",
            "turn",
            "msg",
            "prompt",
            "cached",
            "of prev",
            "new",
            "ttft ms",
            "ttft/new ms",
            "total ms",
            "steps",
            "step ms",
            "arena hw",
            "allocs"
        );
        for (t, cached) in self.turns().iter().zip(cached_fractions(self.turns())) {
            let img = if self.screenshot.is_some() { format!(" {:>8}", t.image_tokens) } else { String::new() };
            let _ = write!(
                s,
                "{:>4} {:>4} {:>8} {:>8} {:>7} {:>7}{img} {:>9.1} {:>12.4} {:>9.1} {:>6} {:>9} {:>14} {:>7}",
                t.turn,
                t.kind,
                t.prompt_tokens,
                t.cached_tokens,
                cached.map_or("-".into(), |f| format!("{:.1}%", 100.0 * f)),
                t.new_tokens(),
                t.ttft_ms,
                t.ttft_per_new_token_ms(),
                t.total_ms,
                t.steps.map_or("-".into(), |v| v.to_string()),
                t.step_ms.map_or("-".into(), |v| format!("{v:.1}")),
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
        let first = self.sessions.first();
        let _ = writeln!(
            s,
            "final context {} tokens; min cached fraction of the previous context {}; TTFT per new token, last vs turn 2: {}",
            self.turns().last().map_or(0, |t| t.prompt_tokens),
            fmt(first.and_then(Session::min_cached_fraction)),
            fmt(first.and_then(Session::ttft_ratio))
        );
    }

    fn turns_svg(&self) -> String {
        let (w, h, left, right, top, panel, gap) = (760.0, 580.0, 70.0, 20.0, 40.0, 200.0, 70.0);
        let plot_w = w - left - right;
        let n = self.turns().len().max(1) as f64;
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
            self.turns().len(),
            xml(&self.server),
            if self.failures.is_empty() { "ok" } else { "FAILED" }
        );
        // Panel 1: TTFT.
        let max_ttft = self.turns().iter().map(|t| t.ttft_ms).fold(0.0, f64::max).max(1e-3);
        let y0 = top + 20.0;
        let max_ttft = crate::report::panel(&mut s, left, y0, plot_w, panel, max_ttft, "time to first token (ms)", "");
        for (i, t) in self.turns().iter().enumerate() {
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
        let max_tok = self.turns().iter().map(|t| t.prompt_tokens).max().unwrap_or(1).max(1) as f64;
        let y1 = y0 + panel + gap;
        let title = match self.screenshot {
            Some((size, tokens)) => {
                format!("prompt tokens per turn: cached / new (a {size} screenshot a turn, {tokens} tokens each)")
            }
            None => "prompt tokens per turn: cached / new".into(),
        };
        let max_tok = crate::report::panel(&mut s, left, y1, plot_w, panel, max_tok, &title, "");
        for (i, t) in self.turns().iter().enumerate() {
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
            if self.turns().len() <= 40 || i % (self.turns().len() / 20).max(1) == 0 {
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

fn round3(v: f64) -> f64 {
    round_to(v, 3)
}

#[cfg(test)]
mod tests {
    use super::*;

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
