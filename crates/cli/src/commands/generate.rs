//! `deltaserve generate`: one prompt (token ids, raw text or a chat message) through the model, streamed
//! to stdout, or as one JSON object with `--json`.

use std::io::Write;

use anyhow::{Context, Result, bail};
use deltaserve_engine::{GenerateRequest, SamplingParams, generate};
use deltaserve_text::ChatRequest;
use serde_json::json;

use crate::model_source::{ModelArgs, parse_token_list};

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
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
    let loaded = a.model.load()?;
    let tok = loaded.tokenizer.as_ref();
    let prompt: Vec<u32> = match (&a.tokens, &a.prompt) {
        (Some(t), _) => parse_token_list(t)?,
        (None, Some(p)) => {
            let tok = tok.context("--prompt needs a tokenizer.json in the model directory (or pass --tokens)")?;
            let text = if a.chat {
                let tpl = loaded.template.as_ref().context("--chat needs a chat template in the model directory")?;
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
    };
    let sampling = SamplingParams {
        temperature: a.temperature,
        top_k: a.top_k,
        top_p: a.top_p,
        min_p: a.min_p,
        repetition_penalty: a.repetition_penalty,
        presence_penalty: a.presence_penalty,
        frequency_penalty: a.frequency_penalty,
        seed: a.seed,
    };
    let stop_token_ids = if a.ignore_eos { Vec::new() } else { loaded.model.config.eos_token_ids.clone() };
    let req = GenerateRequest {
        prompt,
        max_tokens: a.max_tokens,
        sampling,
        stop_token_ids,
        stop_strings: a.stop.clone(),
        prefill_chunk: 512,
    };
    let mut stdout = std::io::stdout().lock();
    let out = generate(&loaded.model, tok, &req, |piece| {
        if !a.json {
            let _ = stdout.write_all(piece.as_bytes());
            let _ = stdout.flush();
        }
    })?;
    let n = out.token_ids.len();
    let decode_rate = if out.decode_ms > 0.0 { n as f64 / (out.decode_ms / 1e3) } else { 0.0 };
    if a.json {
        let v = json!({
            "token_ids": out.token_ids,
            "text": out.text,
            "finish_reason": out.finish_reason,
            "prompt_tokens": out.prompt_tokens,
            "completion_tokens": n,
            "prefill_ms": out.prefill_ms,
            "decode_ms": out.decode_ms,
        });
        writeln!(stdout, "{v}")?;
    } else {
        writeln!(stdout)?;
        if tok.is_none() {
            writeln!(stdout, "{:?}", out.token_ids)?;
        }
        eprintln!(
            "[{} prompt tokens, prefill {:.1} ms ({:.0} tok/s); {n} tokens, {:.1} tok/s, {:.2} ms/token; finish: {:?}]",
            out.prompt_tokens,
            out.prefill_ms,
            out.prompt_tokens as f64 / (out.prefill_ms / 1e3).max(1e-9),
            decode_rate,
            out.decode_ms / n.max(1) as f64,
            out.finish_reason
        );
    }
    Ok(())
}
