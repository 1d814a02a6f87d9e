//! `POST /v1/completions`: prompts (text or token ids, one or a batch) continued, streamed or whole;
//! `echo` returns each prompt before its completions, and with `logprobs` every prompt token's
//! log-probability too (the first has none), which is how evaluation harnesses score text
//! (`max_tokens: 0` scores the prompts alone); vLLM's `prompt_logprobs` gives them in its own shape.

use std::convert::Infallible;

use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::response::sse::Event as SseEvent;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Map, Value, json};
use tokio::sync::mpsc;

use deltaserve_engine::{NO_PROMPT_LOGPROBS, TokenLogprob, Usage};
use deltaserve_text::Tokenizer;

use crate::error::ApiError;
use crate::openai::{
    finish_reason, finish_response, first_timings, next_events, parse_body, send_json, sse, usage_json,
};
use crate::output::{Collected, Finish, OutEvent, OutputStream, Parsing, PromptToken, combined_usage};
use crate::request::{CommonParams, Limits, build_request, new_id, unix_now};
use crate::state::AppState;
use crate::structured;
use crate::timings::{progress_json, timings_json};

#[derive(Debug, Deserialize)]
pub struct CompletionRequest {
    pub model: Option<String>,
    pub prompt: Value,
    #[serde(flatten)]
    pub common: CommonParams,
    pub logprobs: Option<u32>,
    pub echo: Option<bool>,
    pub suffix: Option<String>,
    /// As on chat completions (vLLM takes it here too): `json_object` or `json_schema`.
    pub response_format: Option<Value>,
}

/// What a completion returns besides its text.
struct Shape {
    /// Choices per prompt: choice `i` continues prompt `i / n`.
    n: usize,
    /// Each prompt's text, returned before each of its choices' completions (`echo`).
    echo: Option<Vec<String>>,
    /// Each prompt's token ids.
    prompts: Vec<Vec<u32>>,
    /// Alternatives per position of the `logprobs` object (None: no `logprobs` object).
    logprobs: Option<usize>,
    /// Alternatives per prompt position of vLLM's `prompt_logprobs` (None: not returned).
    prompt_logprobs: Option<usize>,
    /// `max_tokens: 0` with `echo`: the prompts are scored and nothing is generated (the engine's one
    /// token a choice is dropped).
    prompt_only: bool,
}

pub async fn completions(State(st): State<AppState>, body: Result<Bytes, BytesRejection>) -> Response {
    let result = completions_inner(&st, body).await;
    finish_response(&st, "completions", result)
}

async fn completions_inner(st: &AppState, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let req: CompletionRequest = parse_body(body)?;
    st.check_model(req.model.as_deref())?;
    req.common.validate()?;
    let n = req.common.choices(st.engine.sched_config().max_seqs)?;
    if req.suffix.is_some() {
        return Err(ApiError::bad_param("suffix", "`suffix` is not supported"));
    }
    let prompts = completion_prompts(st, &req.prompt)?;
    let top = req.logprobs.map(|k| k as usize);
    if top.is_some_and(|k| k > 20) {
        return Err(ApiError::bad_param("logprobs", "`logprobs` must be between 0 and 20"));
    }
    let c = &req.common;
    let echo = req.echo.unwrap_or(false);
    let prompt_only = echo && c.max_tokens == Some(0);
    let texts = || prompts.iter().map(|(text, ids)| text.clone().unwrap_or_else(|| decode(st, ids))).collect();
    let shape = Shape {
        n,
        echo: echo.then(texts),
        prompts: prompts.iter().map(|p| p.1.clone()).collect(),
        logprobs: top,
        prompt_logprobs: c.prompt_logprobs()?,
        prompt_only,
    };
    if echo && top.is_some() && c.streams() && n > 1 {
        return Err(ApiError::bad_param("n", "a streamed `echo` with `logprobs` takes `n` = 1"));
    }
    let scored = [shape.prompt_logprobs, top.filter(|_| echo)].into_iter().flatten().max();
    if scored.is_some() && !st.engine.scores_prompts() {
        let field = if shape.prompt_logprobs.is_some() { "prompt_logprobs" } else { "echo" };
        return Err(ApiError::bad_param(field, NO_PROMPT_LOGPROBS));
    }
    let guided = match (structured::response_format(req.response_format.as_ref())?, structured::guided(c)?) {
        (Some(_), Some((_, field))) => {
            return Err(ApiError::bad_param(field, format!("`{field}` cannot be combined with response_format")));
        }
        (Some(g), None) => Some((g, "response_format")),
        (None, g) => g,
    };
    // Each prompt is a request of `n` choices; a refused one drops (cancels) those already queued.
    let mut outs = Vec::with_capacity(prompts.len() * n);
    for (_, prompt) in &prompts {
        let mut engine_req = build_request(
            prompt.clone(),
            Limits {
                chat: false,
                max_tokens: if prompt_only { Some(1) } else { c.max_tokens.or(Some(16)) },
                sampling: c.sampling(&st.sampling_defaults, st.tokenizer.vocab_size())?,
                stop: c.stops(),
                ignore_eos: c.ignore_eos.unwrap_or(false),
                stop_token_ids: c.stop_token_ids(st.tokenizer.vocab_size())?,
                logprobs: top,
                images: Vec::new(),
                state: st,
            },
        )?;
        engine_req.prompt_logprobs = scored;
        let mut parsing = Parsing::default();
        if let Some((g, field)) = &guided {
            engine_req.constraint = Some(structured::constraint(st, g, field, &mut parsing)?);
        }
        c.apply_token_rules(&mut engine_req, st.tokenizer.vocab_size(), guided.as_ref().map(|(_, f)| *f))?;
        engine_req.progress = c.progress();
        outs.extend(st.generate_n(engine_req, n, parsing)?);
    }
    let id = new_id("cmpl-");
    let model = st.cfg.served_model_name.clone();
    let tok = st.tokenizer.clone();
    if c.streams() {
        return Ok(sse(completion_stream(outs, id, model, c.include_usage(), shape, tok)));
    }
    let mut cols = Collected::collect_all(outs).await?;
    if prompt_only {
        cols.iter_mut().for_each(drop_generated);
    }
    let choices: Vec<Value> = cols
        .iter()
        .enumerate()
        .map(|(i, col)| {
            let finish = col.finish.clone().unwrap_or(Finish::Length);
            // A prompt's scores come with its first choice (the one whose prompt ran).
            let (prompt, scores) = (&shape.prompts[i / n], &cols[i - i % n].prompt_logprobs);
            let echoed = shape.echo.as_ref().map(|_| (&prompt[..], &scores[..]));
            let logprobs = top.map(|k| completion_logprobs(&tok, echoed, &col.tokens, k, &mut 0));
            let echo_text = shape.echo.as_ref().map_or("", |e| e[i / n].as_str());
            let mut choice = json!({"index": i, "text": format!("{echo_text}{}", col.content), "logprobs": logprobs,
                                    "finish_reason": finish_reason(&finish), "stop_reason": finish.stop_string()});
            if let Some(k) = shape.prompt_logprobs {
                choice["prompt_logprobs"] = vllm_prompt_logprobs(&tok, scores, k);
            }
            choice
        })
        .collect();
    Ok(axum::Json(json!({
        "id": id, "object": "text_completion", "created": unix_now(), "model": model,
        "choices": choices,
        "usage": usage_json(&prompts_usage(cols.iter().map(|c| &c.usage), n)),
        "timings": first_timings(&cols),
    }))
    .into_response())
}

/// A prompt-only reply: the engine's one generated token is not returned.
fn drop_generated(col: &mut Collected) {
    col.content.clear();
    col.reasoning.clear();
    col.tokens.clear();
    col.tool_calls.clear();
    col.usage.completion_tokens = 0;
    col.finish = Some(Finish::Length);
}

fn completion_stream(
    outs: Vec<OutputStream>,
    id: String,
    model: String,
    include_usage: bool,
    shape: Shape,
    tok: std::sync::Arc<Tokenizer>,
) -> mpsc::Receiver<Result<SseEvent, Infallible>> {
    let (tx, rx) = mpsc::channel(64);
    let created = unix_now();
    let all = outs.len();
    let mut outs = crate::output::merged(outs);
    tokio::spawn(async move {
        let chunk = |index: usize, text: &str, finish: Value| {
            json!({"id": id, "object": "text_completion", "created": created, "model": model,
                   "choices": [{"index": index, "text": text, "logprobs": null, "finish_reason": finish}]})
        };
        // Each prompt's text comes first, once per choice; with logprobs, once its scores are in (before
        // the choice's first token), the prompt's part of the `logprobs` object with it.
        let echo_late = shape.echo.is_some() && shape.logprobs.is_some();
        if let Some(texts) = shape.echo.as_ref().filter(|_| !echo_late) {
            for i in 0..all {
                if send_json(&tx, chunk(i, &texts[i / shape.n], Value::Null)).await.is_err() {
                    return;
                }
            }
        }
        // A prompt's scores (vLLM's `prompt_logprobs`) go with its first choice's next chunk.
        let mut scores: Vec<Vec<PromptToken>> = vec![Vec::new(); all];
        let mut usages: Vec<Option<Usage>> = vec![None; all];
        // Where each choice's next token starts in its text (the `logprobs` object's `text_offset`).
        let mut offsets = vec![0; all];
        let mut echoed = vec![!echo_late; all];
        while let Some((index, events)) = next_events(&mut outs, &tx).await {
            let mut text = String::new();
            let mut done = None;
            let mut tokens = Vec::new();
            for e in events {
                match e {
                    OutEvent::Content(s) | OutEvent::Reasoning(s) if !shape.prompt_only => text.push_str(&s),
                    OutEvent::Token { id, text, logprob } if !shape.prompt_only => tokens.push((id, text, logprob)),
                    OutEvent::Progress { processed, total, cached, elapsed_ms } => {
                        let p = progress_json(processed, total, cached, elapsed_ms);
                        let v = json!({"id": id, "object": "text_completion", "created": created, "model": model,
                                       "choices": [], "prompt_progress": p});
                        if send_json(&tx, v).await.is_err() {
                            return;
                        }
                    }
                    OutEvent::PromptLogprobs(p) => scores[index].extend(p),
                    OutEvent::Done { finish, mut usage, timing } => {
                        let finish = if shape.prompt_only {
                            usage.completion_tokens = 0;
                            Finish::Length
                        } else {
                            finish
                        };
                        done = Some((finish, usage, timing));
                    }
                    _ => {}
                }
            }
            let (k, g) = (shape.logprobs.unwrap_or(0), index / shape.n);
            let mut echo_chunk = None;
            let ready = !text.is_empty() || !tokens.is_empty() || done.is_some();
            if let Some(texts) = shape.echo.as_ref().filter(|_| !echoed[index] && ready) {
                echoed[index] = true;
                let mut v = chunk(index, &texts[g], Value::Null);
                let prompt = Some((&shape.prompts[g][..], &scores[index][..]));
                v["choices"][0]["logprobs"] = completion_logprobs(&tok, prompt, &[], k, &mut offsets[index]);
                echo_chunk = Some(v);
            }
            let mut scored = |mut v: Value| {
                if let Some(k) = shape.prompt_logprobs.filter(|_| !scores[index].is_empty()) {
                    v["choices"][0]["prompt_logprobs"] = vllm_prompt_logprobs(&tok, &scores[index], k);
                    scores[index].clear();
                }
                v
            };
            if let Some(v) = echo_chunk
                && send_json(&tx, scored(v)).await.is_err()
            {
                return;
            }
            if !text.is_empty() || !tokens.is_empty() {
                let mut v = scored(chunk(index, &text, Value::Null));
                if shape.logprobs.is_some() && !tokens.is_empty() {
                    v["choices"][0]["logprobs"] = completion_logprobs(&tok, None, &tokens, k, &mut offsets[index]);
                }
                if send_json(&tx, v).await.is_err() {
                    return;
                }
            }
            if let Some((finish, usage, timing)) = done {
                let mut last = scored(chunk(index, "", json!(finish_reason(&finish))));
                last["timings"] = timings_json(&usage, &timing);
                let _ = send_json(&tx, last).await;
                usages[index] = Some(usage);
            }
        }
        if include_usage && usages.iter().all(Option::is_some) {
            let usage = prompts_usage(usages.iter().flatten(), shape.n);
            let _ = send_json(
                &tx,
                json!({"id": id, "object": "text_completion", "created": created, "model": model,
                                          "choices": [], "usage": usage_json(&usage)}),
            )
            .await;
        }
        let _ = tx.send(Ok(SseEvent::default().data("[DONE]"))).await;
    });
    rx
}

/// One prompt of a request: its text when sent as text, and its token ids.
type Prompt = (Option<String>, Vec<u32>);

/// The prompts of a request: a string, a list of token ids, or a list of either (a batch).
fn completion_prompts(st: &AppState, p: &Value) -> Result<Vec<Prompt>, ApiError> {
    let encode =
        |s: &str| st.prompt_encoder.encode(s).map_err(|e| ApiError::bad(format!("tokenising the prompt: {e}")));
    let ids = |a: &[Value]| -> Option<Vec<u32>> {
        a.iter().map(|x| x.as_u64().and_then(|n| u32::try_from(n).ok())).collect()
    };
    let bad_ids = |at: &str| {
        ApiError::bad_param("prompt", format!("`{at}` as a list must hold token ids (non-negative integers)"))
    };
    match p {
        Value::String(s) => Ok(vec![(Some(s.clone()), encode(s)?)]),
        Value::Array(a) if a.is_empty() => Err(ApiError::bad_param("prompt", "`prompt` must not be empty")),
        Value::Array(a) if a[0].is_number() => Ok(vec![(None, ids(a).ok_or_else(|| bad_ids("prompt"))?)]),
        Value::Array(a) => a
            .iter()
            .enumerate()
            .map(|(i, p)| match p {
                Value::String(s) => Ok((Some(s.clone()), encode(s)?)),
                Value::Array(x) if !x.is_empty() => Ok((None, ids(x).ok_or_else(|| bad_ids(&format!("prompt[{i}]")))?)),
                _ => Err(ApiError::bad_param(
                    "prompt",
                    format!("`prompt[{i}]` must be a string or a non-empty list of token ids"),
                )),
            })
            .collect(),
        _ => Err(ApiError::bad_param("prompt", "`prompt` must be a string or a list of token ids")),
    }
}

/// The text of token ids, as `echo` returns a prompt sent as ids.
fn decode(st: &AppState, ids: &[u32]) -> String {
    st.tokenizer.decode(ids, false).unwrap_or_default()
}

/// The usage of the choices of a batch of prompts (in prompt order, `n` choices each): each prompt
/// counted once, every completion.
fn prompts_usage<'a>(usages: impl IntoIterator<Item = &'a Usage>, n: usize) -> Usage {
    let all: Vec<&Usage> = usages.into_iter().collect();
    let mut total = Usage::default();
    for group in all.chunks(n.max(1)) {
        let u = combined_usage(group.iter().copied());
        total.prompt_tokens += u.prompt_tokens;
        total.cached_tokens += u.cached_tokens;
        total.completion_tokens += u.completion_tokens;
    }
    total
}

/// The legacy completions `logprobs` object: with `echo`, the prompt's tokens first (`scores` holds
/// tokens 1.. of `prompt`; the first has no log-probability), then the generated `tokens`; `k`
/// alternatives per position, keyed by their text. Text offsets start at `offset`, which is left where
/// the text after these tokens starts (a stream's chunks run on from one another).
pub fn completion_logprobs(
    tok: &Tokenizer,
    echo: Option<(&[u32], &[PromptToken])>,
    tokens: &[(u32, String, TokenLogprob)],
    k: usize,
    offset: &mut usize,
) -> Value {
    let mut texts: Vec<String> = Vec::new();
    let mut lps: Vec<Option<&TokenLogprob>> = Vec::new();
    if let Some((prompt, scores)) = echo {
        for (i, &id) in prompt.iter().enumerate() {
            texts.push(tok.decode(&[id], false).unwrap_or_default());
            lps.push(i.checked_sub(1).and_then(|j| scores.get(j)).map(|s| &s.logprob));
        }
    }
    for (_, t, lp) in tokens {
        texts.push(t.clone());
        lps.push(Some(lp));
    }
    let offsets: Vec<usize> = texts
        .iter()
        .map(|t| {
            let at = *offset;
            *offset += t.len();
            at
        })
        .collect();
    let top = |lp: &TokenLogprob| {
        let mut m = Map::new();
        for (id, l) in lp.top.iter().take(k) {
            m.entry(tok.decode(&[*id], false).unwrap_or_default()).or_insert(json!(l));
        }
        Value::Object(m)
    };
    json!({
        "tokens": texts,
        "token_logprobs": lps.iter().map(|lp| lp.map(|lp| lp.logprob)).collect::<Vec<_>>(),
        "top_logprobs": lps.iter().map(|lp| lp.map_or(Value::Null, top)).collect::<Vec<_>>(),
        "text_offset": offsets,
    })
}

/// vLLM's `prompt_logprobs`: `null` for the first prompt token, then for each scored token an object
/// keyed by token id holding it and its `k` most likely alternatives (`logprob`, `rank`,
/// `decoded_token`).
pub fn vllm_prompt_logprobs(tok: &Tokenizer, scores: &[PromptToken], k: usize) -> Value {
    let entry = |id: u32, logprob: f32, rank: usize| json!({"logprob": logprob, "rank": rank, "decoded_token": tok.decode(&[id], false).unwrap_or_default()});
    let mut out = vec![Value::Null];
    out.extend(scores.iter().map(|s| {
        let mut m = Map::new();
        m.insert(s.id.to_string(), entry(s.id, s.logprob.logprob, s.rank));
        for (i, &(id, l)) in s.logprob.top.iter().take(k).enumerate() {
            m.entry(id.to_string()).or_insert_with(|| entry(id, l, i + 1));
        }
        Value::Object(m)
    }));
    Value::Array(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn demo_tokenizer() -> Tokenizer {
        let dir = deltaserve_text::synth_model::demo_model_dir().unwrap();
        Tokenizer::from_file(&dir.join("tokenizer.json")).unwrap()
    }

    #[test]
    fn completion_top_logprobs_are_keyed_by_token_text() {
        let tok = demo_tokenizer();
        let text_817 = tok.decode(&[817], false).unwrap();
        let text_300 = tok.decode(&[300], false).unwrap();
        assert_ne!(text_817, text_300);
        let lp = TokenLogprob { logprob: -0.5, top: vec![(300, -0.5), (817, -8.9)] };
        let v = completion_logprobs(&tok, None, &[(300, text_300.clone(), lp)], 2, &mut 0);
        assert_eq!(v["tokens"], json!([text_300]));
        let top = v["top_logprobs"][0].as_object().unwrap();
        assert_eq!(top.len(), 2, "{top:?}");
        assert_eq!(top[&text_300], json!(-0.5));
        assert!((top[&text_817].as_f64().unwrap() + 8.9).abs() < 1e-6, "{top:?}");
        assert!(!top.contains_key("817"));
    }

    #[test]
    fn echoed_logprobs_put_the_prompt_first_with_no_score_for_its_first_token() {
        let tok = demo_tokenizer();
        let text = |id: u32| tok.decode(&[id], false).unwrap();
        let prompt = [300, 817, 42];
        let scored = |id: u32, logprob: f32, rank: usize| PromptToken {
            id,
            logprob: TokenLogprob { logprob, top: vec![(5, -0.1), (id, logprob), (9, -4.0)] },
            rank,
        };
        let scores = [scored(817, -1.5, 2), scored(42, -3.0, 2)];
        let generated = (7, text(7), TokenLogprob { logprob: -0.25, top: vec![(7, -0.25)] });
        let v = completion_logprobs(&tok, Some((&prompt, &scores)), std::slice::from_ref(&generated), 1, &mut 0);
        assert_eq!(v["tokens"], json!([text(300), text(817), text(42), text(7)]));
        assert_eq!(v["token_logprobs"], json!([null, -1.5, -3.0, -0.25]));
        assert_eq!(v["top_logprobs"][0], Value::Null);
        assert_eq!(v["top_logprobs"][1], json!({ text(5): -0.1_f32 }), "one alternative, the best");
        let offsets: Vec<usize> =
            v["text_offset"].as_array().unwrap().iter().map(|o| o.as_u64().unwrap() as usize).collect();
        let lens: Vec<usize> = [300, 817, 42].iter().map(|&i| text(i).len()).collect();
        assert_eq!(offsets, [0, lens[0], lens[0] + lens[1], lens[0] + lens[1] + lens[2]]);
        // vLLM's shape: keyed by id, the prompt token with its rank, then the alternatives by rank.
        let p = vllm_prompt_logprobs(&tok, &scores, 1);
        assert_eq!(p[0], Value::Null);
        assert_eq!(p[1]["817"]["rank"], json!(2));
        assert_eq!(p[1]["817"]["logprob"], json!(-1.5_f32));
        assert_eq!(p[1]["817"]["decoded_token"], json!(text(817)));
        assert_eq!(p[1]["5"]["rank"], json!(1));
        assert_eq!(p[1].as_object().unwrap().len(), 2);
    }
}
