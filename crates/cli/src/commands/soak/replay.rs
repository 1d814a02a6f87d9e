//! The session replay: every session's turns sent and measured, the per-turn checks, and the replicas'
//! counters read around the run.

use std::time::Duration;

use anyhow::{Context, Result, anyhow};
use serde_json::{Map, Value, json};

use super::{Args, Report, Session, Turn};
use crate::commands::soak_sessions::{Replica, read_replicas};
use crate::http::{Client, Reply, Target};
use crate::in_process::host_rss_bytes;
use crate::synthetic_images::{ImageCheck, ImageSize, LocalImages, image_part, image_seed};
use crate::synthetic_text::{Rng, follow_up, system_prompt, task, tool_output, tools};

/// Required fraction of the previous turn's prompt that the next turn must restore from the cache.
const MIN_CACHED_FRACTION: f64 = 0.95;
/// Every this many turns the new message is a user follow-up instead of a tool result.
const USER_EVERY: usize = 4;

pub(super) async fn soak(
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
        follow_ups: a.follow_ups,
        follow_up_tokens: a.follow_up_tokens,
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
    /// Short user follow-ups after the turns, and the tokens each adds.
    follow_ups: usize,
    follow_up_tokens: usize,
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
    for t in 1..=n + a.follow_ups {
        let mut kind = "task";
        let mut payload_chars = 0;
        if let (Some((_, reply, _)), true) = (&prev, t > n) {
            // A short follow-up on the whole conversation (no screenshot: a few tokens of text).
            kind = super::SHORT;
            payload_chars = (a.follow_up_tokens as f64 * chars_per_token).round().max(1.0) as usize;
            messages.push(assistant_message(reply));
            let text: String = follow_up(&mut rng, payload_chars).chars().take(payload_chars).collect();
            messages.push(json!({"role": "user", "content": text}));
        } else if let Some((pt, reply, prev_payload)) = &prev {
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
            prefill_steps: reply.timings.as_ref().and_then(|v| v["prefill_steps"].as_u64()),
            prefill_ms: reply.timings.as_ref().and_then(|v| v["prefill_step_ms"].as_f64()),
            drafted: reply.timings.as_ref().and_then(|v| v["draft_n"].as_u64()),
            accepted: reply.timings.as_ref().and_then(|v| v["draft_n_accepted"].as_u64()),
            images: if a.screenshot.is_some() { t.min(n) } else { 0 },
            image_tokens: a.screenshot.map_or(0, |(_, tokens)| (t.min(n) * tokens) as u64),
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
