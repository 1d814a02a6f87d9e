//! Turning API requests into engine requests, shared by the OpenAI and Anthropic handlers: sampling
//! parameters, stop rules and length defaults; chat messages normalised for the model's template and
//! rendered to token ids; the parsing the output needs.

use std::sync::Arc;

use serde::Deserialize;
use serde_json::{Map, Value, json};

use deltaserve_engine::{Request, SamplingParams, SharedConstraint};
use deltaserve_model::ImagePatches;
use deltaserve_text::ChatRequest;

use crate::error::ApiError;
use crate::media::{ImagePart, check_context, expand_placeholders, image_url};
use crate::output::Parsing;
use crate::state::AppState;
use crate::structured::AllowedTokens;

/// Sampling and length fields common to the OpenAI endpoints (vLLM's extensions included).
#[derive(Debug, Default, Deserialize)]
pub struct CommonParams {
    pub max_tokens: Option<u64>,
    pub max_completion_tokens: Option<u64>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub seed: Option<u64>,
    pub stop: Option<StopSpec>,
    pub n: Option<u32>,
    pub best_of: Option<u32>,
    /// vLLM's structured-output extras (see [`crate::structured::guided`]).
    pub guided_json: Option<Value>,
    pub guided_regex: Option<Value>,
    pub guided_choice: Option<Value>,
    pub guided_grammar: Option<Value>,
    pub guided_whitespace_pattern: Option<Value>,
    pub guided_decoding_backend: Option<Value>,
    pub structured_outputs: Option<Value>,
    pub ignore_eos: Option<bool>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    /// llama.cpp's extension: a streamed response reports the prompt's progress in chunks of their own
    /// (`prompt_progress`) while the prompt runs.
    pub return_progress: Option<bool>,
    /// vLLM's extension: every prompt token's log-probability (after the first) and this many most
    /// likely alternatives at each prompt position.
    pub prompt_logprobs: Option<i64>,
    /// OpenAI's `{"token id": bias}` (llama.cpp's `[[id, bias | false], ...]` too): added to the
    /// logits of those ids; -100 (or `false`) all but bans one.
    pub logit_bias: Option<Value>,
    /// vLLM's: the end-of-sequence and stop ids are not picked, nor do stop strings end the reply,
    /// before this many tokens.
    pub min_tokens: Option<u64>,
    /// vLLM's: more ids that end the reply, besides end of sequence.
    pub stop_token_ids: Option<Vec<Value>>,
    /// vLLM's: the reply's tokens come from these ids only.
    pub allowed_token_ids: Option<Vec<Value>>,
    /// vLLM's: a stop string that ends the reply stays at the end of its text.
    pub include_stop_str_in_output: Option<bool>,
    pub user: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum StopSpec {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Default, Deserialize)]
pub struct StreamOptions {
    pub include_usage: Option<bool>,
}

impl CommonParams {
    /// Whether the response streams.
    pub fn streams(&self) -> bool {
        self.stream.unwrap_or(false)
    }

    /// Whether a streamed response reports the prompt's progress (`return_progress`).
    pub fn progress(&self) -> bool {
        self.streams() && self.return_progress.unwrap_or(false)
    }

    /// The alternatives per prompt position that `prompt_logprobs` asks for (None: not asked).
    pub fn prompt_logprobs(&self) -> Result<Option<usize>, ApiError> {
        match self.prompt_logprobs {
            None => Ok(None),
            Some(k @ 0..=20) => Ok(Some(k as usize)),
            Some(k) => Err(ApiError::bad_param(
                "prompt_logprobs",
                format!("`prompt_logprobs` must be between 0 and 20, got {k}"),
            )),
        }
    }

    /// Whether a streamed response ends with a usage chunk (`stream_options.include_usage`).
    pub fn include_usage(&self) -> bool {
        self.stream_options.as_ref().and_then(|o| o.include_usage).unwrap_or(false)
    }

    /// The `stop` strings as a list.
    pub fn stops(&self) -> Vec<String> {
        match &self.stop {
            None => Vec::new(),
            Some(StopSpec::One(s)) => vec![s.clone()],
            Some(StopSpec::Many(v)) => v.clone(),
        }
    }
}

/// What the handlers pass to [`build_request`].
pub struct Limits<'a> {
    pub max_tokens: Option<u64>,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    pub ignore_eos: bool,
    /// Ids that end the reply besides the end-of-sequence ones (which `ignore_eos` drops).
    pub stop_token_ids: Vec<u32>,
    pub logprobs: Option<usize>,
    /// A chat prompt: the prefix cache snapshots it at its message starts ([`snapshot_points`]) and when
    /// it finishes.
    pub chat: bool,
    /// The prompt's images, in order ([`crate::media::load_images`]).
    pub images: Vec<Arc<ImagePatches>>,
    pub state: &'a AppState,
}

/// An engine request for `prompt`, with the default max_tokens filling the remaining context.
pub fn build_request(prompt: Vec<u32>, l: Limits) -> Result<Request, ApiError> {
    if l.stop.len() > 16 || l.stop.iter().any(|s| s.len() > 1024) {
        return Err(ApiError::bad_param("stop", "at most 16 stop strings of at most 1024 bytes each"));
    }
    let max_context = l.state.engine.sched_config().max_context;
    check_context(prompt.len(), &l.images, l.state.media.processor.merge_size, max_context)?;
    let max_tokens = match l.max_tokens {
        Some(0) => return Err(ApiError::bad_param("max_tokens", "`max_tokens` must be at least 1")),
        Some(m) => usize::try_from(m).unwrap_or(usize::MAX),
        // Fill the context exactly, as vLLM does (prompt + completion = max_model_len).
        None => max_context.saturating_sub(prompt.len()).max(1),
    };
    if l.sampling.min_tokens > max_tokens {
        let m = l.sampling.min_tokens;
        return Err(ApiError::bad_param(
            "min_tokens",
            format!("`min_tokens` ({m}) must be at most `max_tokens` ({max_tokens})"),
        ));
    }
    let snapshot_points = if l.chat { snapshot_points(l.state, &prompt) } else { Vec::new() };
    Ok(Request {
        prompt,
        max_tokens,
        sampling: l.sampling,
        stop_token_ids: {
            let mut ids = if l.ignore_eos { Vec::new() } else { l.state.eos_ids.clone() };
            for id in l.stop_token_ids {
                if !ids.contains(&id) {
                    ids.push(id);
                }
            }
            ids
        },
        stop_strings: l.stop.into_iter().filter(|s| !s.is_empty()).collect(),
        logprobs: l.logprobs,
        snapshot_points,
        snapshot_on_finish: l.chat,
        constraint: None,
        images: l.images,
        progress: false,
        prompt_logprobs: None,
        include_stop_str: false,
    })
}

impl CommonParams {
    /// Sampling parameters: the request's, else the model's defaults (`d`); `vocab`: the ids a
    /// `logit_bias` may name.
    pub fn sampling(&self, d: &SamplingParams, vocab: usize) -> Result<SamplingParams, ApiError> {
        Ok(SamplingParams {
            temperature: self.temperature.unwrap_or(d.temperature),
            top_k: self.top_k.map_or(d.top_k, |k| if k > 0 { k as usize } else { 0 }),
            top_p: self.top_p.unwrap_or(d.top_p),
            min_p: self.min_p.unwrap_or(d.min_p),
            repetition_penalty: self.repetition_penalty.unwrap_or(d.repetition_penalty),
            presence_penalty: self.presence_penalty.unwrap_or(d.presence_penalty),
            frequency_penalty: self.frequency_penalty.unwrap_or(d.frequency_penalty),
            seed: self.seed,
            logit_bias: self.logit_bias.as_ref().map_or(Ok(Vec::new()), |b| logit_bias(b, vocab))?,
            min_tokens: self.min_tokens.map_or(0, |m| usize::try_from(m).unwrap_or(usize::MAX)),
        })
    }

    /// vLLM's `stop_token_ids`: each an id of the vocabulary (`vocab` ids).
    pub fn stop_token_ids(&self, vocab: usize) -> Result<Vec<u32>, ApiError> {
        let ids = self.stop_token_ids.as_deref().unwrap_or_default();
        if ids.len() > 256 {
            let msg = format!("at most 256 `stop_token_ids`, got {}", ids.len());
            return Err(ApiError::bad_param("stop_token_ids", msg));
        }
        token_ids("stop_token_ids", ids, vocab)
    }

    /// The number of choices, `n`: 1..=`max_seqs` (the sequences that run at once).
    pub fn choices(&self, max_seqs: usize) -> Result<usize, ApiError> {
        let n = self.n.unwrap_or(1) as usize;
        if n == 0 || n > max_seqs {
            return Err(ApiError::bad_param("n", format!("`n` must be between 1 and {max_seqs}, got {n}")));
        }
        Ok(n)
    }

    /// Checks what the engine's own validation does not: `best_of` (refused) and `top_k` (-1 or 0
    /// to disable, else at least 1, as in vLLM).
    pub fn validate(&self) -> Result<(), ApiError> {
        if let Some(b) = self.best_of.filter(|b| *b != 1) {
            return Err(ApiError::bad_param("best_of", format!("`best_of` = {b} is not supported (use `n`)")));
        }
        if let Some(k) = self.top_k.filter(|k| *k < -1) {
            return Err(ApiError::bad_param("top_k", format!("`top_k` must be -1, 0 or at least 1, got {k}")));
        }
        Ok(())
    }

    /// Sets on `req` what these fields ask of the reply's tokens and text beyond sampling:
    /// `allowed_token_ids` (as a token constraint) and `include_stop_str_in_output`. `grammar`: the field of
    /// the structured output `req` is under, if any; `min_tokens` and `allowed_token_ids` are refused beside
    /// one (its grammar may allow nothing but the end of the reply before `min_tokens` are out, and it
    /// masks the tokens itself).
    pub fn apply_token_rules(&self, req: &mut Request, vocab: usize, grammar: Option<&str>) -> Result<(), ApiError> {
        if let (Some(field), Some(m)) = (grammar, self.min_tokens.filter(|m| *m > 0)) {
            return Err(ApiError::bad_param(
                "min_tokens",
                format!(
                    "`min_tokens` ({m}) cannot be combined with `{field}` (a structured output ends where its grammar does)"
                ),
            ));
        }
        if let Some(ids) = &self.allowed_token_ids {
            let bad = |m: String| ApiError::bad_param("allowed_token_ids", m);
            if let Some(field) = grammar {
                return Err(bad(format!("`allowed_token_ids` cannot be combined with `{field}`")));
            }
            if ids.is_empty() {
                return Err(bad("`allowed_token_ids` must not be empty".into()));
            }
            let ids = token_ids("allowed_token_ids", ids, vocab)?;
            req.constraint = Some(SharedConstraint::new(AllowedTokens::new(&ids, vocab)));
        }
        req.include_stop_str = self.include_stop_str_in_output.unwrap_or(false);
        Ok(())
    }
}

/// The most ids a `logit_bias` may name.
const MAX_LOGIT_BIAS: usize = 1024;

/// A token id below `vocab` given as a JSON number or a string of digits (OpenAI's map keys).
fn token_id(v: &Value, vocab: usize) -> Option<u32> {
    let id = match v {
        Value::Number(n) => n.as_u64()?,
        Value::String(s) => s.trim().parse().ok()?,
        _ => return None,
    };
    u32::try_from(id).ok().filter(|&id| (id as usize) < vocab)
}

/// The token ids of the list `field` (each below `vocab`), or a 400 naming the field.
fn token_ids(field: &str, values: &[Value], vocab: usize) -> Result<Vec<u32>, ApiError> {
    values
        .iter()
        .map(|v| {
            token_id(v, vocab)
                .ok_or_else(|| ApiError::bad_param(field, format!("`{field}` holds {v}, not a token id below {vocab}")))
        })
        .collect()
}

/// `logit_bias` as (id, bias) pairs, each id once: OpenAI's object of token-id strings to numbers in
/// [-100, 100], or llama.cpp's list of `[id, bias]` pairs where a bias of `false` bans the id (-100).
fn logit_bias(v: &Value, vocab: usize) -> Result<Vec<(u32, f32)>, ApiError> {
    let bad = |m: String| ApiError::bad_param("logit_bias", m);
    let entries: Vec<(Value, &Value)> = match v {
        Value::Null => Vec::new(),
        Value::Object(m) => m.iter().map(|(k, b)| (Value::String(k.clone()), b)).collect(),
        Value::Array(a) => a
            .iter()
            .map(|e| match e.as_array().map(Vec::as_slice) {
                Some([id, b]) => Ok((id.clone(), b)),
                _ => Err(bad(format!("a `logit_bias` list holds [token id, bias] pairs, got {e}"))),
            })
            .collect::<Result<_, _>>()?,
        _ => return Err(bad("`logit_bias` must be an object of token ids to biases".into())),
    };
    if entries.len() > MAX_LOGIT_BIAS {
        return Err(bad(format!("`logit_bias` may name at most {MAX_LOGIT_BIAS} tokens, got {}", entries.len())));
    }
    let mut out: Vec<(u32, f32)> = Vec::with_capacity(entries.len());
    for (id, b) in entries {
        let id = token_id(&id, vocab)
            .ok_or_else(|| bad(format!("`logit_bias` key {id} is not a token id below {vocab}")))?;
        let b = match b {
            Value::Bool(false) => -100.0,
            b => b
                .as_f64()
                .filter(|b| (-100.0..=100.0).contains(b))
                .ok_or_else(|| bad(format!("the bias of token {id} must be a number in [-100, 100], got {b}")))?
                as f32,
        };
        if out.iter().any(|&(i, _)| i == id) {
            return Err(bad(format!("`logit_bias` names token {id} twice")));
        }
        out.push((id, b));
    }
    Ok(out)
}

/// Normalises chat messages for the Qwen templates: text parts joined, `developer` as `system`, OpenAI
/// tool-call argument strings parsed into objects. A user message with images keeps its content as a list of
/// text and `{"type": "image"}` parts (the template renders each image's placeholder); the images' URLs
/// come back separately, in prompt order.
pub fn normalize_messages(messages: &[Value]) -> Result<(Vec<Value>, Vec<ImagePart>), ApiError> {
    if messages.is_empty() {
        return Err(ApiError::bad_param("messages", "`messages` must not be empty"));
    }
    let mut images = Vec::new();
    let normalized = messages
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let obj = m
                .as_object()
                .ok_or_else(|| ApiError::bad_param("messages", format!("messages[{i}] must be an object")))?;
            let role = obj.get("role").and_then(Value::as_str).ok_or_else(|| {
                ApiError::bad_param("messages", format!("messages[{i}].role is missing or not a string"))
            })?;
            let role = match role {
                "system" | "user" | "assistant" | "tool" => role,
                "developer" => "system",
                other => {
                    return Err(ApiError::bad_param(
                        "messages",
                        format!("messages[{i}].role `{other}` is not one of system, developer, user, assistant, tool"),
                    ));
                }
            };
            let mut out = obj.clone();
            out.insert("role".into(), json!(role));
            out.insert("content".into(), content(obj.get("content"), i, role, &mut images)?);
            if let Some(calls) = obj.get("tool_calls").filter(|c| !c.is_null()) {
                out.insert("tool_calls".into(), Value::Array(normalize_tool_calls(calls, i)?));
            }
            Ok(Value::Object(out))
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok((normalized, images))
}

/// Message content: a string, null, or a list of `text` and (in user messages) `image_url` parts. Text
/// only: one string; with images: text and image parts in order, the images appended to `images`.
fn content(content: Option<&Value>, i: usize, role: &str, images: &mut Vec<ImagePart>) -> Result<Value, ApiError> {
    let parts = match content {
        None | Some(Value::Null) => return Ok(json!("")),
        Some(Value::String(s)) => return Ok(json!(s)),
        Some(Value::Array(parts)) => parts,
        Some(other) => {
            return Err(ApiError::bad_param(
                "messages",
                format!("messages[{i}].content must be a string or a list of parts, got {}", type_name(other)),
            ));
        }
    };
    let (mut out, mut text, first_image) = (Vec::new(), String::new(), images.len());
    for (j, p) in parts.iter().enumerate() {
        let bad = |message: String| ApiError::bad_param("messages", format!("messages[{i}].content[{j}]{message}"));
        match (p.get("type").and_then(Value::as_str), p.get("text").and_then(Value::as_str)) {
            (Some("text"), Some(t)) => text.push_str(t),
            (Some("image_url"), _) => {
                if role != "user" {
                    return Err(bad(format!(": images are accepted in user messages only, not in `{role}` ones")));
                }
                let url = image_url(p).ok_or_else(|| bad(".image_url must be {\"url\": \"...\"}".into()))?;
                // Anthropic image blocks come converted, with the location of the original block.
                let location = p.get("location").and_then(Value::as_str);
                images.push(ImagePart {
                    location: location.map_or_else(|| format!("messages[{i}].content[{j}]"), str::to_string),
                    url: url.to_string(),
                });
                out.push(json!({"type": "text", "text": std::mem::take(&mut text)}));
                out.push(json!({"type": "image"}));
            }
            (Some(kind @ ("video_url" | "video" | "input_video")), _) => {
                return Err(bad(format!(": content parts of type `{kind}` are not supported yet (text, image_url)")));
            }
            (Some(kind), _) if kind != "text" => {
                return Err(bad(format!(": content parts of type `{kind}` are not supported (text, image_url)")));
            }
            _ => return Err(bad(" must be {\"type\": \"text\", \"text\": \"...\"}".into())),
        }
    }
    if images.len() == first_image {
        return Ok(json!(text));
    }
    out.push(json!({"type": "text", "text": text}));
    out.retain(|p| p.get("text").and_then(Value::as_str) != Some(""));
    Ok(Value::Array(out))
}

fn normalize_tool_calls(calls: &Value, i: usize) -> Result<Vec<Value>, ApiError> {
    let arr = calls
        .as_array()
        .ok_or_else(|| ApiError::bad_param("messages", format!("messages[{i}].tool_calls must be a list")))?;
    arr.iter()
        .enumerate()
        .map(|(j, c)| {
            let f = c.get("function").and_then(Value::as_object).ok_or_else(|| {
                ApiError::bad_param("messages", format!("messages[{i}].tool_calls[{j}].function is missing"))
            })?;
            let name = f.get("name").and_then(Value::as_str).ok_or_else(|| {
                ApiError::bad_param("messages", format!("messages[{i}].tool_calls[{j}].function.name is missing"))
            })?;
            let args = match f.get("arguments") {
                None | Some(Value::Null) => json!({}),
                Some(Value::String(s)) if s.trim().is_empty() => json!({}),
                // Kept as the string: the template reads it as Python's `json.loads` does (big
                // integers exact, `1e400` infinite), which serde_json's numbers cannot hold.
                Some(Value::String(s)) => {
                    if deltaserve_text::check_json_object(s).is_err() {
                        return Err(ApiError::bad_param(
                            "messages",
                            format!("messages[{i}].tool_calls[{j}].function.arguments is not a JSON object string"),
                        ));
                    }
                    Value::String(s.clone())
                }
                Some(v @ Value::Object(_)) => v.clone(),
                Some(other) => {
                    return Err(ApiError::bad_param(
                        "messages",
                        format!(
                            "messages[{i}].tool_calls[{j}].function.arguments must be a JSON object, got {}",
                            type_name(other)
                        ),
                    ));
                }
            };
            let mut out = c.as_object().cloned().unwrap_or_default();
            out.insert("type".into(), json!("function"));
            out.insert("function".into(), json!({ "name": name, "arguments": args }));
            Ok(Value::Object(out))
        })
        .collect()
}

/// Validates OpenAI `tools`: a list of `{type: function, function: {name, parameters?}}`.
pub fn validate_tools(tools: &[Value]) -> Result<(), ApiError> {
    for (i, t) in tools.iter().enumerate() {
        let name = t.get("function").and_then(|f| f.get("name")).and_then(Value::as_str);
        if t.get("type").and_then(Value::as_str) != Some("function") || name.is_none_or(str::is_empty) {
            return Err(ApiError::bad_param(
                "tools",
                format!("tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}"),
            ));
        }
    }
    Ok(())
}

/// Renders the chat template, with the generation prompt (the assistant message's opening) or without it,
/// and tokenises: (prompt ids, output parsing). Each image's placeholder is expanded to the tokens the image
/// takes.
pub fn render_chat(
    state: &AppState,
    messages: Vec<Value>,
    tools: Option<Vec<Value>>,
    kwargs: Map<String, Value>,
    images: &[Arc<ImagePatches>],
    add_generation_prompt: bool,
) -> Result<(Vec<u32>, Parsing), ApiError> {
    let template =
        state.template.as_ref().ok_or_else(|| ApiError::bad("this model has no chat template; use /v1/completions"))?;
    let text = template
        .render(&ChatRequest { messages, tools: tools.clone(), add_generation_prompt, kwargs })
        .map_err(|e| ApiError::bad_param("messages", format!("chat template: {e}")))?;
    let mut ids =
        state.prompt_encoder.encode(&text).map_err(|e| ApiError::bad(format!("tokenising the prompt: {e}")))?;
    if !images.is_empty() {
        let pad = state.tokenizer.token_id(crate::media::IMAGE_PAD).unwrap_or(u32::MAX);
        ids = expand_placeholders(ids, pad, images, state.media.processor.merge_size)?;
    }
    // The generation prompt of Qwen3.5/3.6 opens `<think>` when thinking is on.
    let opened = text.trim_end().ends_with("<think>");
    Ok((ids, Parsing { reasoning: Some(opened), tools: tools.filter(|t| !t.is_empty()), grammar_values: false }))
}

pub fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

/// `chatcmpl-…` / `cmpl-…` / `msg_…` ids.
pub fn new_id(prefix: &str) -> String {
    let n: u128 = rand::random();
    format!("{prefix}{:024x}", n & ((1u128 << 96) - 1))
}

pub fn unix_now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// The token that opens every message of a Qwen3.5/3.6 chat prompt.
pub const MESSAGE_OPENER: &str = "<|im_start|>";

/// The role whose message starts are snapshot points (see [`snapshot_points`]).
const ASSISTANT_ROLE: &str = "assistant";

/// Where a chat prompt's DeltaNet state is worth snapshotting: the start of every assistant message
/// (`<|im_start|>assistant`), the generation prompt's included. A conversation's next request appends
/// to this one, and where it renders an earlier turn differently it does so from an assistant message's
/// start: the template drops the reasoning of assistant turns before the latest user message, and a
/// reply re-rendered from parsed tool calls may differ from the generated text. User and tool messages
/// are re-rendered as sent, so a snapshot at their starts would only cut the prompt into more steps
/// (an agent turn's new tokens — the tool result and the generation prompt — run in two chunks, not
/// three). Where the role does not tokenise, every message start.
pub fn snapshot_points(state: &AppState, prompt: &[u32]) -> Vec<usize> {
    let role = state.tokenizer.encode(ASSISTANT_ROLE).ok().filter(|r| !r.is_empty());
    match state.tokenizer.token_id(MESSAGE_OPENER) {
        Some(im_start) => message_starts(prompt, im_start, role.as_deref()),
        None => Vec::new(),
    }
}

/// Positions (after the first) of `im_start` followed by the ids of `role`, or of every `im_start` when
/// `role` is None.
fn message_starts(prompt: &[u32], im_start: u32, role: Option<&[u32]>) -> Vec<usize> {
    prompt
        .iter()
        .enumerate()
        .filter(|&(i, &t)| i > 0 && t == im_start && role.is_none_or(|r| prompt[i + 1..].starts_with(r)))
        .map(|(i, _)| i)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snapshot_points_are_assistant_message_starts() {
        // <|im_start|>=1, assistant=2, user=3, text=9: system, user, assistant, tool result (a user
        // turn), generation prompt.
        let p = [1, 4, 9, 1, 3, 9, 9, 1, 2, 9, 9, 1, 3, 9, 1, 2, 9];
        assert_eq!(message_starts(&p, 1, Some(&[2])), vec![7, 14]);
        assert_eq!(message_starts(&p, 1, None), vec![3, 7, 11, 14]);
        // A role of several tokens (a small vocabulary), and a trailing opener: no role after it.
        let p = [1, 4, 1, 5, 6, 9, 1, 5, 7, 1, 5];
        assert_eq!(message_starts(&p, 1, Some(&[5, 6])), vec![2]);
        assert_eq!(message_starts(&[1, 9, 1], 1, Some(&[2])), Vec::<usize>::new());
    }

    #[test]
    fn string_arguments_python_reads_are_kept_not_refused() {
        // Python's json reads these (a 97-bit integer, -0, an infinite float); the template renders
        // them from the string, so they reach it unchanged.
        let args = r#"{"id": 123456789012345678901234567890, "z": -0, "far": 1e400}"#;
        let calls = json!([{"id": "c1", "type": "function", "function": {"name": "f", "arguments": args}}]);
        let out = normalize_tool_calls(&calls, 1).unwrap();
        assert_eq!(out[0]["function"]["arguments"], json!(args));
        for bad in ["[1, 2]", "{\"a\": }", "nope"] {
            let calls = json!([{"function": {"name": "f", "arguments": bad}}]);
            let err = normalize_tool_calls(&calls, 1).unwrap_err();
            assert!(err.message().contains("messages[1].tool_calls[0].function.arguments"), "{bad}");
        }
    }
}
