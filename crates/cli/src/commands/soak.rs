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

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Result, bail};

use super::soak_sessions::Replica;
use crate::http::Target;
use crate::in_process::ServerArgs;
use crate::report::emit;
use crate::synthetic_images::ImageSize;

mod replay;
mod report;

use replay::soak;

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
    /// After the --turns turns, this many short user follow-ups of about --follow-up-tokens tokens each
    /// (kind `short`): the first token of a few new tokens on the whole long conversation, as an agent's
    /// quick reply or tool result sends them.
    #[arg(long, default_value_t = 0)]
    follow_ups: usize,
    /// Prompt tokens each --follow-ups message adds, about.
    #[arg(long, default_value_t = 40)]
    follow_up_tokens: usize,
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
    if a.follow_ups > 0 && a.follow_up_tokens == 0 {
        bail!("--follow-up-tokens must be at least 1");
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

/// The kind of a --follow-ups turn.
const SHORT: &str = "short";

/// One turn's measurements.
#[derive(Clone, Debug, Default)]
pub(super) struct Turn {
    pub(super) turn: usize,
    /// What the turn appended: `task` (turn 1), `tool`, `user` or `short` (a --follow-ups message).
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
    /// From the server's `timings` of the reply: the engine steps that ran the turn's prompt and their
    /// compute (ms). The rest of the TTFT is spent outside the engine's steps: the HTTP exchange, the
    /// template and tokeniser, the queue, the prefix cache's restore and the engine's work between steps.
    pub(super) prefill_steps: Option<u64>,
    pub(super) prefill_ms: Option<f64>,
    /// With speculative decoding (the reply's `timings`): tokens drafted for the turn's reply, and accepted.
    pub(super) drafted: Option<u64>,
    pub(super) accepted: Option<u64>,
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
    /// The share of the TTFT spent outside the steps that ran the prompt.
    fn outside_compute(&self) -> Option<f64> {
        self.prefill_ms.filter(|_| self.ttft_ms > 0.0).map(|c| (1.0 - c / self.ttft_ms).max(0.0))
    }
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

impl Session {
    /// The session's turns before its short follow-ups.
    fn main_turns(&self) -> &[Turn] {
        let n = self.turns.iter().take_while(|t| t.kind != SHORT).count();
        &self.turns[..n]
    }

    /// The short follow-ups' turns.
    pub(super) fn short_turns(&self) -> &[Turn] {
        &self.turns[self.main_turns().len()..]
    }

    fn ttft_ratio(&self) -> Option<f64> {
        let turns = self.main_turns();
        let (t2, last) = (turns.get(1)?, turns.last()?);
        (turns.len() >= 2 && t2.ttft_per_new_token_ms() > 0.0)
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
