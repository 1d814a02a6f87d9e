//! `deltaserve probe`: the ceiling ladder. "Boots" is not "fills": this fills the context the server
//! advertises (`max_model_len` of `/v1/models`) with one prompt at 25, 50, 75, 92 and 100% (each a fresh
//! prefill: a per-rung nonce opens the prompt so no cached prefix is reused), then grows one multi-turn
//! conversation to 100%. Per rung and turn it reports prompt / cached tokens, time to first token, the
//! prefill rate, and the device memory the driver reports for the server process (`nvidia-smi
//! --query-compute-apps`, sampled every 200 ms while the request runs) against the memory plan.
//!
//! It fails on any error, on driver-reported memory above the plan, on memory that grows from rung to rung
//! (more than 1% of the plan), on arena allocations after start, and — with a real model (`--needle`) — on a
//! needle (a passphrase placed at a varying depth) that the reply does not repeat.
//!
//! `--images N` puts N synthetic screenshots (`--image-size`, PNG data URLs in `image_url` parts) among the text
//! of every rung's prompt (distinct per rung) and of every turn's new message (earlier turns' images stay in
//! the history, so the next turn restores them from the prefix cache); the text is fitted so that text and
//! image tokens together make each target, and the report gives the image tokens of every prompt. A server
//! that cannot take them (no vision tower, an image over `--max-image-tokens-per-step`, more images in one
//! request than it accepts) is refused before the ladder starts.
//!
//! Without `--url` the server runs in-process with the `--model` / engine flags (as `soak` does) and the
//! plan is the one it started with; with `--url`, pass the plan's total as `--plan-bytes` to hold the
//! driver's numbers to it (memory growth and errors are checked either way).

use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};
use deltaserve_plan::{fmt_bytes, fmt_count, parse_size};
use serde_json::{Value, json};

use crate::gpu_memory::GpuSampler;
use crate::http::{Client, Target};
use crate::in_process::ServerArgs;
use crate::model_source::Device;
use crate::progress::Progress;
use crate::report::{ToolReport, emit, round_to, xml};
use crate::synthetic_images::{
    ImageCheck, ImageSize, LocalImages, anthropic_messages, image_part, image_seed, interleave,
};
use crate::synthetic_text::{Rng, lines};

/// Share of the previous turn's prompt a turn must restore from the prefix cache.
const MIN_CACHED_FRACTION: f64 = 0.95;
/// Allowed spread of the driver-reported peak across rungs, as a fraction of the plan (or of the first peak).
const MAX_GROWTH: f64 = 0.01;
/// The most tokens the ladder fills by default on the in-process CPU backend: the f32 reference prefills
/// a few hundred tokens a second at best, so a ladder to a 262K-token context would run for hours.
const CPU_DEFAULT_CONTEXT: u64 = 8192;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Needle {
    /// On, except for the built-in demo model and --random-weights (whose replies are noise).
    Auto,
    On,
    Off,
}

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    server: ServerArgs,
    /// Rungs of the single-prompt ladder, in percent of the advertised context.
    #[arg(long, value_delimiter = ',', default_value = "25,50,75,92,100")]
    rungs: Vec<f64>,
    /// Tokens the ladder fills (its 100%), at most the advertised context. Default: the advertised context;
    /// in-process on the CPU backend at most 8192.
    #[arg(long)]
    context: Option<u64>,
    /// Turns of the multi-turn conversation grown to 100% of the context (0: skip it).
    #[arg(long, default_value_t = 8)]
    turns: usize,
    /// Tokens generated per request (with ignore_eos, so prompt + completion fill the rung exactly).
    #[arg(long, default_value_t = 4)]
    max_tokens: u32,
    /// Synthetic screenshots in every prompt: N among each rung's text (distinct per rung) and N in each
    /// turn's new message (the earlier turns' stay in the history); text + image tokens still make each target.
    #[arg(long, default_value_t = 0, value_name = "N")]
    images: usize,
    /// Size of the --images screenshots, WIDTHxHEIGHT in pixels (the server resizes to multiples of its
    /// patch × merge size: 1280x720 takes 1280×704, 3,520 patches, 880 prompt tokens on Qwen3.5/3.6).
    #[arg(long, default_value = "1280x720", value_name = "WxH")]
    image_size: ImageSize,
    /// Check needle retrieval at every rung.
    #[arg(long, value_enum, default_value_t = Needle::Auto)]
    needle: Needle,
    /// With --url: the plan's total (e.g. 24GiB) that the driver-reported memory must stay under.
    #[arg(long, value_parser = parse_size)]
    plan_bytes: Option<u64>,
    /// With --url: the server's process id for nvidia-smi (default: all compute processes of the GPU).
    #[arg(long)]
    gpu_pid: Option<u32>,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
    /// Also write an SVG chart (prefill rate and driver memory per rung and turn) to this file.
    #[arg(long)]
    svg: Option<PathBuf>,
    /// Seed of the filler text, nonces and needles.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Seconds one request may take before the probe fails.
    #[arg(long, default_value_t = 3600)]
    request_timeout_secs: u64,
}

pub fn run(a: Args) -> Result<()> {
    if a.rungs.is_empty() && a.turns == 0 {
        bail!("nothing to probe: give --rungs or --turns");
    }
    if let Some(r) = a.rungs.iter().find(|r| !(**r > 0.0 && **r <= 100.0)) {
        bail!("--rungs: {r} is not a percentage in (0, 100]");
    }
    if a.max_tokens == 0 {
        bail!("--max-tokens must be at least 1");
    }
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let report = rt.block_on(async {
        let server = a.server.connect().await?;
        let setup = match &server.local {
            None => Setup {
                server: server.target.origin(),
                model: server.model.clone(),
                plan_bytes: a.plan_bytes,
                pid: a.gpu_pid,
                needle: a.needle == Needle::On || a.needle == Needle::Auto,
                default_context: None,
                images: None,
            },
            Some(local) => {
                let m = &a.server.model;
                let noise = m.model.is_none() || m.random_weights;
                Setup {
                    server: format!("in-process {}", server.target.origin()),
                    model: server.model.clone(),
                    plan_bytes: Some(local.plan.total_bytes),
                    pid: Some(std::process::id()),
                    needle: a.needle == Needle::On || (a.needle == Needle::Auto && !noise),
                    default_context: (local.device == Device::Cpu).then_some(CPU_DEFAULT_CONTEXT),
                    images: Some(local.images.clone()),
                }
            }
        };
        let report = probe(&a, server.target.clone(), setup).await;
        server.stop().await?;
        anyhow::Ok(report)
    });
    rt.shutdown_timeout(Duration::from_secs(2));
    emit("probe", &report?, a.json, a.svg.as_deref())
}

struct Setup {
    server: String,
    model: Option<String>,
    plan_bytes: Option<u64>,
    pid: Option<u32>,
    needle: bool,
    /// The most the ladder fills without --context (None: the advertised context).
    default_context: Option<u64>,
    /// What the in-process server takes in images (None: `--url`).
    images: Option<LocalImages>,
}

// ---------------------------------------------------------------------------------------------
// Prompts of an exact token count

/// Long filler text; prompts are its prefixes behind a per-prompt nonce line.
struct Filler {
    text: String,
    /// Characters per token, measured on the server's tokenizer.
    chars_per_token: f64,
}

/// What a prompt is made of: nonce, filler, needle (at a depth), question.
struct Parts<'a> {
    nonce: &'a str,
    needle: Option<(&'a str, f64)>,
    question: &'a str,
}

fn compose(filler: &str, p: &Parts) -> String {
    let mut s = String::with_capacity(filler.len() + 256);
    s.push_str(p.nonce);
    s.push('\n');
    match p.needle {
        Some((needle, depth)) => {
            let mut cut = ((filler.len() as f64) * depth) as usize;
            while !filler.is_char_boundary(cut) {
                cut -= 1;
            }
            // At a line start, so the needle is a sentence of its own.
            let cut = filler[..cut].rfind('\n').map_or(0, |i| i + 1);
            s.push_str(&filler[..cut]);
            s.push_str(needle);
            s.push('\n');
            s.push_str(&filler[cut..]);
        }
        None => s.push_str(filler),
    }
    s.push_str(p.question);
    s
}

struct Counter<'a> {
    client: &'a Client,
    model: &'a str,
}

impl Counter<'_> {
    /// Prompt tokens of `messages` as the server renders them (`/v1/messages/count_tokens`).
    async fn count(&self, messages: &[Value]) -> Result<usize> {
        let body = json!({"model": self.model, "messages": anthropic_messages(messages)});
        let v = self.client.post_json("/v1/messages/count_tokens", &body).await?;
        v["input_tokens"].as_u64().map(|n| n as usize).ok_or_else(|| anyhow!("count_tokens: no input_tokens in {v}"))
    }

    /// The content of a user message (its text with `images` among it) such that `history` + it renders to
    /// at most `target` tokens and at least `target - slack`: grows or trims the filler prefix by the
    /// measured characters per token.
    async fn fit(
        &self,
        f: &Filler,
        history: &[Value],
        parts: &Parts<'_>,
        images: &[Value],
        target: usize,
    ) -> Result<(Value, usize)> {
        let with = |content: &Value| {
            let mut m = history.to_vec();
            m.push(json!({"role": "user", "content": content}));
            m
        };
        let empty = self.count(&with(&interleave(compose("", parts), images))).await?;
        if empty > target {
            let what = if images.is_empty() {
                String::new()
            } else {
                format!(" with this prompt's {} images and no filler", images.len())
            };
            bail!("the conversation already has {empty} tokens{what}, more than the {target} this prompt may have");
        }
        let slack = 16.max(target / 2000);
        let mut chars = (((target - empty) as f64) * f.chars_per_token) as usize;
        for _ in 0..12 {
            chars = chars.min(f.text.len());
            while !f.text.is_char_boundary(chars) {
                chars -= 1;
            }
            let content = interleave(compose(&f.text[..chars], parts), images);
            let n = self.count(&with(&content)).await?;
            if n <= target && (n + slack >= target || chars == f.text.len()) {
                return Ok((content, n));
            }
            let step = ((target as f64 - n as f64) * f.chars_per_token * 0.98) as isize;
            let step = if n > target { step.min(-1) } else { step.max(1) };
            chars = (chars as isize + step).max(0) as usize;
        }
        bail!("could not build a prompt of {target} tokens (the tokenizer's characters per token vary too much)")
    }
}

// ---------------------------------------------------------------------------------------------
// The probe

#[derive(Clone, Debug, Default)]
struct Row {
    /// `25%` or `turn 3`.
    label: String,
    percent: f64,
    prompt_tokens: u64,
    cached_tokens: u64,
    completion_tokens: u64,
    ttft_ms: f64,
    total_ms: f64,
    driver_peak_bytes: Option<u64>,
    needle: Option<bool>,
    /// Images in the prompt and the prompt tokens they take (their placeholders).
    images: usize,
    image_tokens: u64,
    /// The generated text.
    reply: String,
}

impl Row {
    fn new_tokens(&self) -> u64 {
        self.prompt_tokens.saturating_sub(self.cached_tokens)
    }
    fn prefill_tok_s(&self) -> f64 {
        self.new_tokens() as f64 / (self.ttft_ms / 1e3).max(1e-9)
    }
}

struct Report {
    server: String,
    model: String,
    /// The context the ladder fills, and the one the server advertises.
    max_context: u64,
    advertised_context: u64,
    plan_bytes: Option<u64>,
    idle_driver_bytes: Option<u64>,
    arena_capacity_bytes: Option<u64>,
    needle: bool,
    /// `--images` per prompt, their size, and the prompt tokens one takes (0 without images).
    images_per_prompt: usize,
    image_size: ImageSize,
    tokens_per_image: usize,
    rungs: Vec<Row>,
    turns: Vec<Row>,
    failures: Vec<String>,
}

async fn probe(a: &Args, target: Target, setup: Setup) -> Report {
    let mut report = Report {
        server: setup.server.clone(),
        model: String::new(),
        max_context: 0,
        advertised_context: 0,
        plan_bytes: setup.plan_bytes,
        idle_driver_bytes: None,
        arena_capacity_bytes: None,
        needle: setup.needle,
        images_per_prompt: a.images,
        image_size: a.image_size,
        tokens_per_image: 0,
        rungs: Vec::new(),
        turns: Vec::new(),
        failures: Vec::new(),
    };
    if let Err(e) = run_probe(a, target, &setup, &mut report).await {
        report.failures.push(format!("{e:#}"));
    }
    report.check();
    report
}

async fn run_probe(a: &Args, target: Target, setup: &Setup, report: &mut Report) -> Result<()> {
    let client = Client {
        target,
        api_key: a.server.api_key.clone(),
        timeout: Duration::from_secs(a.request_timeout_secs),
        session: None,
    };
    let models = client.get_json("/v1/models").await?;
    let first = &models["data"][0];
    let model = setup.model.clone().or_else(|| first["id"].as_str().map(str::to_string));
    let model = model.ok_or_else(|| anyhow!("GET /v1/models lists no model"))?;
    let advertised = first["max_model_len"]
        .as_u64()
        .ok_or_else(|| anyhow!("GET /v1/models: no max_model_len (the advertised context) in {first}"))?;
    let max_context = ladder_context(advertised, a.context, setup.default_context);
    report.model = model.clone();
    report.max_context = max_context;
    report.advertised_context = advertised;
    let before = client.metrics().await?;
    report.arena_capacity_bytes = client_capacity(&client).await;
    let sampler = GpuSampler::start(setup.pid);
    if sampler.is_none() {
        tracing::warn!("nvidia-smi lists no GPU memory for the server: driver-reported memory is not checked");
    }
    report.idle_driver_bytes = sampler.as_ref().map(|s| s.take_peak(setup.pid));
    let counter = Counter { client: &client, model: &model };
    if a.images > 0 {
        let per_request = a.images * a.turns.max(1);
        let why = if a.turns > 0 {
            format!("the last turn carries {} × {}: --turns × --images", a.turns, a.images)
        } else {
            "each prompt carries --images".into()
        };
        let check = ImageCheck { flag: "--images", size: a.image_size, per_request, why, local: setup.images.as_ref() };
        report.tokens_per_image = check.run(&client, &model).await?;
    }
    let tpi = report.tokens_per_image as u64;

    // Filler long enough for the whole context, and its characters per token.
    let mut rng = Rng::new(a.seed);
    let sample = lines(&mut rng, 20_000);
    let n = counter.count(&[json!({"role": "user", "content": sample})]).await?.max(1);
    let chars_per_token = 20_000.0 / n as f64;
    let filler = Filler {
        text: lines(&mut rng, ((max_context as f64) * chars_per_token * 1.3) as usize + 4096),
        chars_per_token,
    };
    tracing::info!(
        "probe: {model}, filling {} tokens of the advertised {}{}; filler {:.2} chars/token",
        fmt_count(max_context),
        fmt_count(advertised),
        if a.context.is_none() && max_context < advertised { " (the CPU default; --context sets it)" } else { "" },
        chars_per_token
    );
    let mut progress = Progress::new(a.rungs.len() + a.turns);

    let question = if setup.needle {
        "\n\nQuestion: what is the secret passphrase stated in the text above? Reply with the passphrase only."
    } else {
        "\n\nSummarise the log above in one line."
    };
    for (i, &pct) in a.rungs.iter().enumerate() {
        let nonce = format!("Probe rung {i} ({pct}%), nonce {:016x}.", rng.next());
        let secret = format!("{}-{}-{}", word(&mut rng), word(&mut rng), rng.below(10_000));
        let needle_line = format!("The secret passphrase is {secret}.");
        let depth = (0.15 + 0.37 * i as f64) % 0.9;
        let parts = Parts { nonce: &nonce, needle: setup.needle.then_some((needle_line.as_str(), depth)), question };
        let want = ((max_context as f64 * pct / 100.0) as u64).saturating_sub(a.max_tokens as u64) as usize;
        let images: Vec<Value> =
            (0..a.images as u64).map(|k| image_part(a.image_size, image_seed(a.seed, i as u64, k))).collect();
        let (content, counted) =
            counter.fit(&filler, &[], &parts, &images, want).await.with_context(|| format!("rung {pct}%"))?;
        progress.start(&format!("rung {pct}%: prompt {} tokens", fmt_count(counted as u64)));
        let messages = vec![json!({"role": "user", "content": content})];
        let mut row = request(&client, &model, &messages, a.max_tokens, sampler.as_ref(), setup.pid).await?;
        row.label = format!("{pct}%");
        row.percent = pct;
        row.images = a.images;
        row.image_tokens = a.images as u64 * tpi;
        if row.prompt_tokens != counted as u64 {
            report.failures.push(format!(
                "rung {pct}%: usage.prompt_tokens {} differs from count_tokens {counted}",
                row.prompt_tokens
            ));
        }
        if setup.needle {
            row.needle = Some(row.reply.contains(&secret));
        }
        progress.finish_step(&row_line(&row));
        report.rungs.push(row);
    }

    if a.turns > 0 {
        let mut messages: Vec<Value> = Vec::new();
        let last = (max_context as usize).saturating_sub(a.max_tokens as usize);
        for t in 1..=a.turns {
            let nonce = if t == 1 { format!("Probe conversation, nonce {:016x}.", rng.next()) } else { String::new() };
            let question = format!("\n\nStep {t}: summarise what changed in one line.");
            let parts = Parts { nonce: &nonce, needle: None, question: &question };
            let want = last * t / a.turns;
            // Each turn is a distinct slice of the filler, so turns do not repeat each other.
            let offset = (filler.text.len() / (a.turns + 1)) * (t - 1) / 2;
            let offset = (0..=offset).rev().find(|&o| filler.text.is_char_boundary(o)).unwrap_or(0);
            let slice = Filler { text: filler.text[offset..].to_string(), chars_per_token };
            // N new images a turn, none of them a rung's.
            let images: Vec<Value> = (0..a.images as u64)
                .map(|k| image_part(a.image_size, image_seed(a.seed, (1 << 32) + t as u64, k)))
                .collect();
            let (content, counted) =
                counter.fit(&slice, &messages, &parts, &images, want).await.with_context(|| format!("turn {t}"))?;
            messages.push(json!({"role": "user", "content": content}));
            progress.start(&format!("turn {t}: prompt {} tokens", fmt_count(counted as u64)));
            let mut row = request(&client, &model, &messages, a.max_tokens, sampler.as_ref(), setup.pid).await?;
            row.label = format!("turn {t}");
            row.percent = 100.0 * (row.prompt_tokens + row.completion_tokens) as f64 / max_context as f64;
            row.images = a.images * t;
            row.image_tokens = row.images as u64 * tpi;
            if row.prompt_tokens != counted as u64 {
                report.failures.push(format!(
                    "turn {t}: usage.prompt_tokens {} differs from count_tokens {counted}",
                    row.prompt_tokens
                ));
            }
            if let Some(prev) = report.turns.last() {
                let need = (prev.prompt_tokens as f64 * MIN_CACHED_FRACTION) as u64;
                if row.cached_tokens < need {
                    report.failures.push(format!(
                        "turn {t}: {} cached tokens, less than {:.0}% of the previous prompt ({})",
                        row.cached_tokens,
                        MIN_CACHED_FRACTION * 100.0,
                        prev.prompt_tokens
                    ));
                }
            }
            progress.finish_step(&row_line(&row));
            messages.push(json!({"role": "assistant", "content": row.reply.clone()}));
            report.turns.push(row);
        }
    }

    let after = client.metrics().await?;
    if after.allocations != before.allocations {
        report.failures.push(format!(
            "the arena allocated during the probe ({} allocations before, {} after)",
            before.allocations, after.allocations
        ));
    }
    Ok(())
}

/// The arena's capacity gauge, when the server exports it.
async fn client_capacity(client: &Client) -> Option<u64> {
    let r = client.request("GET", "/metrics", None, |_| {}).await.ok()?;
    let text = String::from_utf8_lossy(&r.body);
    text.lines()
        .find_map(|l| l.strip_prefix("deltaserve_arena_capacity_bytes ")?.trim().parse::<f64>().ok())
        .map(|v| v as u64)
}

/// One streamed chat completion at temperature 0 with ignore_eos: the row (reply text kept aside).
async fn request(
    client: &Client,
    model: &str,
    messages: &[Value],
    max_tokens: u32,
    sampler: Option<&GpuSampler>,
    pid: Option<u32>,
) -> Result<Row> {
    if let Some(s) = sampler {
        s.take_peak(pid);
    }
    let body = json!({
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": true,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    let (reply, ttft_ms, total_ms) = client.chat(&body).await?;
    let usage = reply.usage.clone().unwrap_or_default();
    let get = |k: &str| usage[k].as_u64().unwrap_or(0);
    let row = Row {
        prompt_tokens: get("prompt_tokens"),
        cached_tokens: usage["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0),
        completion_tokens: get("completion_tokens"),
        ttft_ms,
        total_ms,
        driver_peak_bytes: sampler.map(|s| s.take_peak(pid)),
        reply: reply.content.clone(),
        ..Default::default()
    };
    Ok(row)
}

/// The ladder's top: `--context` (at most the advertised context), else the advertised context capped by
/// the backend's default.
fn ladder_context(advertised: u64, context: Option<u64>, default: Option<u64>) -> u64 {
    match context {
        Some(c) if c > advertised => {
            tracing::warn!("--context {c}: the server advertises {advertised} tokens; probing those");
            advertised
        }
        Some(c) => c,
        None => default.map_or(advertised, |d| d.min(advertised)),
    }
}

fn row_line(r: &Row) -> String {
    let images = if r.images > 0 { format!(", {} images: {} tokens", r.images, r.image_tokens) } else { String::new() };
    format!(
        "probe: {}: prompt {} (cached {}{images}), TTFT {:.0} ms, prefill {:.0} tok/s, driver peak {}",
        r.label,
        r.prompt_tokens,
        r.cached_tokens,
        r.ttft_ms,
        r.prefill_tok_s(),
        r.driver_peak_bytes.map_or("n/a".into(), fmt_bytes)
    )
}

/// A short lowercase word for passphrases.
fn word(rng: &mut Rng) -> &'static str {
    rng.pick(&["amber", "birch", "cobalt", "delta", "ember", "fjord", "granite", "harbor", "indigo", "juniper"])
}

// ---------------------------------------------------------------------------------------------
// Checks and output

impl Report {
    fn rows(&self) -> impl Iterator<Item = &Row> {
        self.rungs.iter().chain(&self.turns)
    }

    fn check(&mut self) {
        let mut f = Vec::new();
        for r in self.rows() {
            if let (Some(peak), Some(plan)) = (r.driver_peak_bytes, self.plan_bytes)
                && peak > plan
            {
                f.push(format!(
                    "{}: driver-reported {} is above the plan's {}",
                    r.label,
                    fmt_bytes(peak),
                    fmt_bytes(plan)
                ));
            }
            if r.needle == Some(false) {
                f.push(format!("{}: the reply does not repeat the needle", r.label));
            }
        }
        let peaks: Vec<u64> = self.rows().filter_map(|r| r.driver_peak_bytes).collect();
        if let (Some(lo), Some(hi)) = (peaks.iter().min(), peaks.iter().max()) {
            let allowed = (self.plan_bytes.unwrap_or(*lo) as f64 * MAX_GROWTH) as u64;
            if hi - lo > allowed {
                f.push(format!(
                    "driver-reported memory grew with the prompt: {} to {} (allowed spread {})",
                    fmt_bytes(*lo),
                    fmt_bytes(*hi),
                    fmt_bytes(allowed)
                ));
            }
        }
        self.failures.extend(f);
    }
}

impl ToolReport for Report {
    fn to_json(&self) -> Value {
        let row = |r: &Row| {
            json!({
                "label": r.label, "percent": round1(r.percent), "prompt_tokens": r.prompt_tokens,
                "cached_tokens": r.cached_tokens, "new_tokens": r.new_tokens(),
                "completion_tokens": r.completion_tokens, "ttft_ms": round1(r.ttft_ms), "total_ms": round1(r.total_ms),
                "prefill_tok_s": round1(r.prefill_tok_s()), "driver_peak_bytes": r.driver_peak_bytes, "needle": r.needle,
                "images": r.images, "image_tokens": r.image_tokens,
            })
        };
        json!({
            "server": self.server, "model": self.model, "max_context": self.max_context,
            "advertised_context": self.advertised_context,
            "plan_bytes": self.plan_bytes, "idle_driver_bytes": self.idle_driver_bytes,
            "arena_capacity_bytes": self.arena_capacity_bytes, "needle_checked": self.needle,
            "images_per_prompt": self.images_per_prompt,
            "image_size": (self.images_per_prompt > 0).then(|| self.image_size.to_string()),
            "tokens_per_image": self.tokens_per_image,
            "rungs": self.rungs.iter().map(row).collect::<Vec<_>>(),
            "turns": self.turns.iter().map(row).collect::<Vec<_>>(),
            "passed": self.failures.is_empty(), "failures": self.failures,
        })
    }

    fn table(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "probe of {} ({}), filling {} tokens of the advertised context {}",
            self.server,
            self.model,
            fmt_count(self.max_context),
            fmt_count(self.advertised_context)
        );
        let _ = writeln!(
            s,
            "plan {} · driver idle {} · arena {}",
            self.plan_bytes.map_or("n/a".into(), fmt_bytes),
            self.idle_driver_bytes.map_or("n/a".into(), fmt_bytes),
            self.arena_capacity_bytes.map_or("n/a".into(), fmt_bytes)
        );
        let images = self.images_per_prompt > 0;
        if images {
            let _ = writeln!(
                s,
                "images: {} of {} in each rung's prompt and each turn's new message, {} prompt tokens each",
                self.images_per_prompt, self.image_size, self.tokens_per_image
            );
        }
        let _ = write!(
            s,
            "\n{:<9} {:>6} {:>9} {:>9} {:>9} {:>10} {:>11} {:>11} {:>7} {:>6}",
            "rung", "fill", "prompt", "cached", "new", "TTFT ms", "prefill/s", "driver", "/plan", "needle"
        );
        let _ = writeln!(s, "{}", if images { format!(" {:>6} {:>8}", "images", "img tok") } else { String::new() });
        for r in self.rows() {
            let ratio = match (r.driver_peak_bytes, self.plan_bytes) {
                (Some(p), Some(plan)) => format!("{:.3}", p as f64 / plan as f64),
                _ => "-".into(),
            };
            let _ = write!(
                s,
                "{:<9} {:>5.1}% {:>9} {:>9} {:>9} {:>10.0} {:>11.0} {:>11} {:>7} {:>6}",
                r.label,
                r.percent,
                r.prompt_tokens,
                r.cached_tokens,
                r.new_tokens(),
                r.ttft_ms,
                r.prefill_tok_s(),
                r.driver_peak_bytes.map_or("n/a".into(), fmt_bytes),
                ratio,
                r.needle.map_or("-", |ok| if ok { "ok" } else { "MISS" })
            );
            let _ = writeln!(
                s,
                "{}",
                if images { format!(" {:>6} {:>8}", r.images, r.image_tokens) } else { String::new() }
            );
        }
        let _ = writeln!(
            s,
            "\n{}",
            if self.failures.is_empty() { "PASS".to_string() } else { format!("FAIL ({})", self.failures.len()) }
        );
        s
    }

    /// Two panels: prefill tokens/s per rung and turn; driver-reported memory against the plan. Each y
    /// axis carries its values.
    fn svg(&self) -> String {
        let rows: Vec<&Row> = self.rows().collect();
        let (w, h, left, right, top, gap) = (760.0, 540.0, 80.0, 20.0, 56.0, 70.0);
        let (pw, ph) = (w - left - right, (h - top - gap - 40.0) / 2.0);
        let bw = pw / rows.len().max(1) as f64;
        let mut s = format!(
            "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" viewBox=\"0 0 {w} {h}\" font-family=\"sans-serif\" font-size=\"11\">\n\
             <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
             <text x=\"{left}\" y=\"20\" font-size=\"14\">deltaserve probe: {} — {} of {} tokens{}</text>\n",
            xml(&self.model),
            fmt_count(self.max_context),
            fmt_count(self.advertised_context),
            if self.images_per_prompt > 0 {
                format!(
                    " · {} images of {} a prompt (under each bar: its image tokens)",
                    self.images_per_prompt, self.image_size
                )
            } else {
                String::new()
            }
        );
        let max_rate = rows.iter().map(|r| r.prefill_tok_s()).fold(0.0, f64::max);
        let plan = self.plan_bytes.unwrap_or(0) as f64;
        let max_mem = rows.iter().filter_map(|r| r.driver_peak_bytes).map(|b| b as f64).fold(plan, f64::max);
        // Memory in the largest binary unit it reaches.
        let (unit, unit_name) = [(1u64 << 30, " GiB"), (1 << 20, " MiB"), (1, " B")]
            .into_iter()
            .find(|(u, _)| max_mem >= *u as f64)
            .unwrap_or((1, " B"));
        let unit = unit as f64;
        for panel in 0..2 {
            let y0 = top + panel as f64 * (ph + gap);
            let axis_top = match panel {
                0 => crate::report::panel(
                    &mut s,
                    left,
                    y0,
                    pw,
                    ph,
                    max_rate,
                    "prefill tokens/s (new prompt tokens / TTFT)",
                    "",
                ),
                _ => {
                    let title = "driver-reported device memory (line: plan)";
                    crate::report::panel(&mut s, left, y0, pw, ph, max_mem / unit, title, unit_name)
                }
            };
            for (i, r) in rows.iter().enumerate() {
                let x = left + i as f64 * bw + bw * 0.15;
                let (v, color) = match panel {
                    0 => (r.prefill_tok_s(), "#4a7bd0"),
                    _ => (r.driver_peak_bytes.unwrap_or(0) as f64 / unit, "#d07b4a"),
                };
                let bh = ph * v / axis_top;
                let _ = writeln!(
                    s,
                    "<rect x=\"{x:.1}\" y=\"{:.1}\" width=\"{:.1}\" height=\"{bh:.1}\" fill=\"{color}\"><title>{}: {}</title></rect>",
                    y0 + ph - bh,
                    bw * 0.7,
                    xml(&r.label),
                    crate::report::tick_label(v)
                );
                let _ = writeln!(
                    s,
                    "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{}</text>",
                    x + bw * 0.35,
                    y0 + ph + 14.0,
                    xml(&r.label)
                );
                if r.images > 0 {
                    let _ = writeln!(
                        s,
                        "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\" fill=\"#666\"><title>{} images, {} of the prompt's tokens</title>{} img</text>",
                        x + bw * 0.35,
                        y0 + ph + 27.0,
                        r.images,
                        r.image_tokens,
                        fmt_count(r.image_tokens)
                    );
                }
            }
            if panel == 1 && plan > 0.0 {
                let y = y0 + ph - ph * (plan / unit) / axis_top;
                let _ = writeln!(
                    s,
                    "<line x1=\"{left}\" x2=\"{}\" y1=\"{y:.1}\" y2=\"{y:.1}\" stroke=\"#c00\" stroke-dasharray=\"4 3\"/>",
                    left + pw
                );
                let _ = writeln!(
                    s,
                    "<text x=\"{}\" y=\"{:.1}\" text-anchor=\"end\" fill=\"#c00\">plan {}</text>",
                    left + pw - 4.0,
                    y - 4.0,
                    fmt_bytes(plan as u64)
                );
            }
        }
        s.push_str("</svg>\n");
        s
    }

    fn failures(&self) -> Vec<String> {
        self.failures.clone()
    }
}

fn round1(v: f64) -> f64 {
    round_to(v, 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn needle_lands_on_its_own_line() {
        let filler = "aaa\nbbb\nccc\nddd\n";
        let p = Parts { nonce: "N", needle: Some(("NEEDLE", 0.5)), question: "?" };
        let s = compose(filler, &p);
        assert!(s.starts_with("N\n") && s.ends_with('?'));
        assert!(s.contains("\nNEEDLE\n"), "{s}");
        let p = Parts { nonce: "N", needle: None, question: "?" };
        assert_eq!(compose(filler, &p), format!("N\n{filler}?"));
    }

    #[test]
    fn the_ladder_context() {
        assert_eq!(ladder_context(262_144, None, None), 262_144);
        assert_eq!(ladder_context(262_144, None, Some(CPU_DEFAULT_CONTEXT)), 8192);
        assert_eq!(ladder_context(4096, None, Some(CPU_DEFAULT_CONTEXT)), 4096);
        assert_eq!(ladder_context(262_144, Some(32_768), Some(CPU_DEFAULT_CONTEXT)), 32_768);
        assert_eq!(ladder_context(4096, Some(32_768), None), 4096);
    }

    #[test]
    fn the_chart_has_axis_values() {
        let row = |label: &str, peak| Row {
            label: label.into(),
            prompt_tokens: 3000,
            ttft_ms: 1000.0,
            driver_peak_bytes: Some(peak),
            ..Default::default()
        };
        let r = Report {
            server: String::new(),
            model: "m".into(),
            max_context: 4096,
            advertised_context: 4096,
            plan_bytes: Some(2 << 30),
            idle_driver_bytes: None,
            arena_capacity_bytes: None,
            needle: false,
            images_per_prompt: 0,
            image_size: ImageSize { width: 64, height: 64 },
            tokens_per_image: 0,
            rungs: vec![row("25%", 3 << 29)],
            turns: vec![],
            failures: vec![],
        };
        let svg = r.svg();
        for tick in [">0<", ">1000<", ">3000<", ">0 GiB<", ">0.5 GiB<", ">2 GiB<"] {
            assert!(svg.contains(tick), "no tick {tick}: {svg}");
        }
    }

    #[test]
    fn growth_and_plan_checks() {
        let row = |label: &str, peak| Row { label: label.into(), driver_peak_bytes: Some(peak), ..Default::default() };
        let mut r = Report {
            server: String::new(),
            model: String::new(),
            max_context: 0,
            advertised_context: 0,
            plan_bytes: Some(1000),
            idle_driver_bytes: None,
            arena_capacity_bytes: None,
            needle: false,
            images_per_prompt: 0,
            image_size: ImageSize { width: 64, height: 64 },
            tokens_per_image: 0,
            rungs: vec![row("25%", 900), row("50%", 905)],
            turns: vec![],
            failures: vec![],
        };
        r.check();
        assert!(r.failures.is_empty(), "{:?}", r.failures);
        r.rungs.push(row("100%", 1001));
        r.check();
        assert_eq!(r.failures.len(), 2, "{:?}", r.failures); // above the plan, and grew by > 1%
    }
}
