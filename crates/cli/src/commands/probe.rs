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
use crate::report::emit;
use crate::synthetic_images::{ImageCheck, ImageSize, LocalImages, image_part, image_seed};
use crate::synthetic_text::{Rng, lines};

mod prompt;
mod report;

use prompt::{Counter, Filler, Parts};

/// Share of the previous turn's prompt a turn must restore from the prefix cache.
const MIN_CACHED_FRACTION: f64 = 0.95;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ladder_context() {
        assert_eq!(ladder_context(262_144, None, None), 262_144);
        assert_eq!(ladder_context(262_144, None, Some(CPU_DEFAULT_CONTEXT)), 8192);
        assert_eq!(ladder_context(4096, None, Some(CPU_DEFAULT_CONTEXT)), 4096);
        assert_eq!(ladder_context(262_144, Some(32_768), Some(CPU_DEFAULT_CONTEXT)), 32_768);
        assert_eq!(ladder_context(4096, Some(32_768), None), 4096);
    }
}
