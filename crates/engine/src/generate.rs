//! One request, start to finish, on the CPU reference model: chunked prefill, then token-by-token
//! decode with sampling, stop tokens, stop strings and a token budget; text is streamed through an
//! incremental UTF-8-safe detokeniser. (The batching engine of the server builds on the same pieces.)

use std::time::Instant;

use deltaserve_cpu::{CpuModel, ForwardError, GdnMode, Logits};
use deltaserve_text::{IncrementalDecoder, StopMatcher, TextError, Tokenizer};

use crate::sampling::{Sampler, SamplingParams};

/// What to generate.
#[derive(Clone, Debug)]
pub struct GenerateRequest {
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// Generation ends after emitting one of these ids.
    pub stop_token_ids: Vec<u32>,
    /// Generation ends when the text contains one of these; the text is cut before it.
    pub stop_strings: Vec<String>,
    /// Tokens per prefill call (the prompt is fed in pieces of at most this size).
    pub prefill_chunk: usize,
}

/// Why generation ended.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// A stop token id.
    Stop,
    /// A stop string (given).
    StopString(String),
    /// `max_tokens` reached.
    Length,
}

/// The result of [`generate`].
#[derive(Clone, Debug, serde::Serialize)]
pub struct GenerateOutput {
    /// Generated ids only (a final stop token included).
    pub token_ids: Vec<u32>,
    /// Generated text (special tokens skipped, cut before a stop string).
    pub text: String,
    pub finish_reason: FinishReason,
    pub prompt_tokens: usize,
    pub prefill_ms: f64,
    pub decode_ms: f64,
}

#[derive(Debug, thiserror::Error)]
pub enum GenerateError {
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("invalid sampling parameters: {0}")]
    Sampling(String),
    #[error(
        "prompt ({prompt} tokens) + max_tokens ({max_tokens}) = {} exceeds the model's context of {context} tokens",
        prompt + max_tokens
    )]
    ContextTooLong { prompt: usize, max_tokens: usize, context: usize },
    #[error(transparent)]
    Forward(#[from] ForwardError),
    #[error(transparent)]
    Text(#[from] TextError),
}

/// Runs `req` to completion; `on_text` receives each newly decoded piece of text as it becomes final.
pub fn generate(
    model: &CpuModel,
    tokenizer: Option<&Tokenizer>,
    req: &GenerateRequest,
    mut on_text: impl FnMut(&str),
) -> Result<GenerateOutput, GenerateError> {
    if req.prompt.is_empty() {
        return Err(GenerateError::EmptyPrompt);
    }
    req.sampling.validate().map_err(GenerateError::Sampling)?;
    let context = model.config.max_position_embeddings;
    if req.prompt.len() + req.max_tokens > context {
        return Err(GenerateError::ContextTooLong { prompt: req.prompt.len(), max_tokens: req.max_tokens, context });
    }
    let valid_vocab = tokenizer.map_or(model.dims.vocab, |t| t.vocab_size().min(model.dims.vocab));
    let mut sampler = Sampler::new(req.sampling.clone(), valid_vocab);
    let mut state = model.new_sequence();

    let t0 = Instant::now();
    let mut logits = Vec::new();
    for piece in req.prompt.chunks(req.prefill_chunk.max(1)) {
        logits = model.forward(&mut state, piece, GdnMode::Auto, Logits::Last)?;
    }
    let prefill_ms = t0.elapsed().as_secs_f64() * 1e3;

    let t1 = Instant::now();
    let mut context_ids = req.prompt.clone();
    let mut out_ids = Vec::new();
    let mut text = String::new();
    let mut decoder = IncrementalDecoder::new(true);
    let mut stops = StopMatcher::new(req.stop_strings.clone());
    let mut finish = FinishReason::Length;
    while out_ids.len() < req.max_tokens {
        let id = sampler.sample(&mut logits, &context_ids);
        sampler.observe(id);
        out_ids.push(id);
        context_ids.push(id);
        if let Some(tok) = tokenizer {
            let piece = decoder.push(tok, id)?;
            let out = stops.push(&piece);
            text.push_str(&out.emit);
            on_text(&out.emit);
            if let Some(s) = out.stopped {
                finish = FinishReason::StopString(s);
                break;
            }
        }
        if req.stop_token_ids.contains(&id) {
            finish = FinishReason::Stop;
            break;
        }
        if out_ids.len() == req.max_tokens {
            break;
        }
        logits = model.forward(&mut state, &[id], GdnMode::Auto, Logits::Last)?;
    }
    if let Some(tok) = tokenizer
        && !matches!(finish, FinishReason::StopString(_))
    {
        let tail = decoder.finish(tok)?;
        let out = stops.push(&tail);
        let rest = format!("{}{}", out.emit, if out.stopped.is_none() { stops.flush() } else { String::new() });
        text.push_str(&rest);
        on_text(&rest);
        if let Some(s) = out.stopped {
            finish = FinishReason::StopString(s);
        }
    }
    Ok(GenerateOutput {
        token_ids: out_ids,
        text,
        finish_reason: finish,
        prompt_tokens: req.prompt.len(),
        prefill_ms,
        decode_ms: t1.elapsed().as_secs_f64() * 1e3,
    })
}
