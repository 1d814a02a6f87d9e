//! `deltaserve generate`: one prompt (token ids, raw text or a chat message) through the batching engine
//! on the backend `--device` selects (built as `serve` builds it, from the same engine flags), streamed
//! to stdout, or as one JSON object with `--json`.

use std::io::Write;

use anyhow::{Context, Result, bail};
use deltaserve_engine::{Event, Request, SamplingParams};
use deltaserve_text::ChatRequest;
use serde_json::json;

use crate::engine_args::{EngineArgs, Started};
use crate::model_source::{ModelArgs, parse_token_list};

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    engine: EngineArgs,
    /// Prompt as token ids: `1,2,3` or `@ids.json`.
    #[arg(long, conflicts_with = "prompt")]
    tokens: Option<String>,
    /// Prompt as text.
    #[arg(long)]
    prompt: Option<String>,
    /// Wrap --prompt as a user message in the model's chat template.
    #[arg(long, requires = "prompt")]
    chat: bool,
    /// With --chat: a system message.
    #[arg(long, requires = "chat")]
    system: Option<String>,
    /// With --chat: render with enable_thinking=false.
    #[arg(long, requires = "chat")]
    no_think: bool,
    #[arg(long, default_value_t = 64)]
    max_tokens: usize,
    /// 0 = greedy.
    #[arg(long, default_value_t = 1.0)]
    temperature: f32,
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    #[arg(long, default_value_t = 0.0)]
    min_p: f32,
    #[arg(long, default_value_t = 1.0)]
    repetition_penalty: f32,
    #[arg(long, default_value_t = 0.0)]
    presence_penalty: f32,
    #[arg(long, default_value_t = 0.0)]
    frequency_penalty: f32,
    #[arg(long)]
    seed: Option<u64>,
    /// Stop string (repeatable).
    #[arg(long)]
    stop: Vec<String>,
    /// Do not stop at the model's end-of-sequence tokens.
    #[arg(long)]
    ignore_eos: bool,
    /// Print one JSON object (`token_ids`, `text`, ...) instead of streaming text.
    #[arg(long)]
    json: bool,
}

pub fn run(a: Args) -> Result<()> {
    let started = a.engine.start(&a.model, &a.model.dir()?)?;
    let result = generate(&a, &started);
    started.engine.shutdown(false);
    result
}

/// The prompt's token ids: `--tokens`, or `--prompt` encoded (through the chat template with `--chat`).
fn prompt_ids(a: &Args, started: &Started) -> Result<Vec<u32>> {
    Ok(match (&a.tokens, &a.prompt) {
        (Some(t), _) => parse_token_list(t)?,
        (None, Some(p)) => {
            let tok = started
                .tokenizer
                .as_ref()
                .context("--prompt needs a tokenizer.json in the model directory (or pass --tokens)")?;
            let text = if a.chat {
                let tpl = started.template.as_ref().context("--chat needs a chat template in the model directory")?;
                let mut messages = Vec::new();
                if let Some(s) = &a.system {
                    messages.push(json!({"role": "system", "content": s}));
                }
                messages.push(json!({"role": "user", "content": p}));
                let mut kwargs = serde_json::Map::new();
                if a.no_think {
                    kwargs.insert("enable_thinking".into(), json!(false));
                }
                tpl.render(&ChatRequest { messages, tools: None, add_generation_prompt: true, kwargs })?
            } else {
                p.clone()
            };
            tok.encode(&text)?
        }
        (None, None) => bail!("give the prompt with --prompt TEXT or --tokens IDS"),
    })
}

/// Runs the request on the started engine, streaming its text to stdout unless `--json`.
fn generate(a: &Args, started: &Started) -> Result<()> {
    let prompt = prompt_ids(a, started)?;
    let prompt_tokens = prompt.len();
    let sampling = SamplingParams {
        temperature: a.temperature,
        top_k: a.top_k,
        top_p: a.top_p,
        min_p: a.min_p,
        repetition_penalty: a.repetition_penalty,
        presence_penalty: a.presence_penalty,
        frequency_penalty: a.frequency_penalty,
        seed: a.seed,
        ..SamplingParams::default()
    };
    let stop_token_ids = if a.ignore_eos { Vec::new() } else { started.eos_ids.clone() };
    let req = Request {
        prompt,
        max_tokens: a.max_tokens,
        sampling,
        stop_token_ids,
        stop_strings: a.stop.clone(),
        ..Request::default()
    };
    let mut stdout = std::io::stdout().lock();
    let mut stream = started.engine.submit(req)?;
    // Generated ids (a final stop token included) and text (special tokens skipped, cut before a stop string).
    let (mut token_ids, mut text) = (Vec::new(), String::new());
    let (finish_reason, timing) = loop {
        match stream.blocking_next() {
            Some(Event::Token { id, text: piece, .. }) => {
                token_ids.push(id);
                text.push_str(&piece);
                if !a.json {
                    let _ = stdout.write_all(piece.as_bytes());
                    let _ = stdout.flush();
                }
            }
            // Not asked for: the engine logs a long prompt's progress itself.
            Some(Event::Prefill { .. } | Event::PromptLogprobs { .. }) => {}
            Some(Event::Finished { reason, timing, .. }) => break (reason, timing),
            Some(Event::Error(e)) => return Err(e.into()),
            None => bail!("the engine stopped before the request finished"),
        }
    };
    // Prefill: admission to the first token; decode: the first token to the finish.
    let prefill_ms = timing.ttft_ms - timing.queue_ms;
    let decode_ms = timing.total_ms - timing.ttft_ms;
    let n = token_ids.len();
    let decode_rate = if decode_ms > 0.0 { n as f64 / (decode_ms / 1e3) } else { 0.0 };
    if a.json {
        let v = json!({
            "token_ids": token_ids,
            "text": text,
            "finish_reason": finish_reason,
            "prompt_tokens": prompt_tokens,
            "completion_tokens": n,
            "prefill_ms": prefill_ms,
            "decode_ms": decode_ms,
        });
        writeln!(stdout, "{v}")?;
    } else {
        writeln!(stdout)?;
        if started.tokenizer.is_none() {
            writeln!(stdout, "{token_ids:?}")?;
        }
        eprintln!(
            "[{} prompt tokens, prefill {:.1} ms ({:.0} tok/s); {n} tokens, {:.1} tok/s, {:.2} ms/token; finish: {:?}]",
            prompt_tokens,
            prefill_ms,
            prompt_tokens as f64 / (prefill_ms / 1e3).max(1e-9),
            decode_rate,
            decode_ms / n.max(1) as f64,
            finish_reason
        );
    }
    Ok(())
}
