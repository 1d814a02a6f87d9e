//! `POST /tokenize` and `POST /detokenize`, in the shapes vLLM's and llama.cpp's servers take, so that a
//! client written for either counts its prompt (an agent managing its context) without generating:
//! - `/tokenize`: a text (`prompt`, vLLM; `content`, llama.cpp) as the tokenizer encodes it, or chat
//!   `messages` (with `tools`, `chat_template_kwargs`, images) rendered with the model's template as a
//!   chat request is (`add_generation_prompt`, default true): `{"count", "max_model_len", "tokens"}`, and
//!   each token's text with `return_token_strs` (vLLM: `token_strs`) or `with_pieces` (llama.cpp: `tokens`
//!   as `{"id", "piece"}` objects), each token decoded on its own (a token that holds part of a
//!   multi-byte character decodes to U+FFFD there; `/detokenize` of the whole list gives the text).
//! - `/detokenize`: `tokens` → the text, as `prompt` (vLLM) and `content` (llama.cpp).
//!
//! Qwen's tokenizers add no special tokens of their own, so `add_special_tokens` / `add_special` (unknown
//! fields, ignored as every unknown field is) change nothing.

use axum::Extension;
use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Map, Value, json};

use crate::error::ApiError;
use crate::media::load_images;
use crate::openai::{finish_response, parse_body};
use crate::request::{normalize_messages, render_chat};
use crate::state::{AppState, ChatDefaults};

#[derive(Debug, Default, Deserialize)]
struct TokenizeRequest {
    model: Option<String>,
    prompt: Option<Value>,
    content: Option<Value>,
    messages: Option<Vec<Value>>,
    tools: Option<Vec<Value>>,
    chat_template_kwargs: Option<Map<String, Value>>,
    add_generation_prompt: Option<bool>,
    return_token_strs: Option<bool>,
    with_pieces: Option<bool>,
}

#[derive(Debug, Default, Deserialize)]
struct DetokenizeRequest {
    model: Option<String>,
    tokens: Option<Value>,
}

pub async fn tokenize(
    State(st): State<AppState>,
    Extension(chat): Extension<ChatDefaults>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let result = tokenize_inner(&st, &chat, body).await;
    finish_response(&st, "tokenize", result)
}

async fn tokenize_inner(
    st: &AppState,
    chat: &ChatDefaults,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let req: TokenizeRequest = parse_body(body)?;
    st.check_model(req.model.as_deref())?;
    let ids = match (&req.prompt, &req.content, &req.messages) {
        (Some(text), None, None) => encode(st, "prompt", text)?,
        (None, Some(text), None) => encode(st, "content", text)?,
        (None, None, Some(messages)) => {
            let (messages, image_parts) = normalize_messages(messages)?;
            let images = load_images(st, image_parts).await?;
            let kwargs = chat.merged(req.chat_template_kwargs.clone().unwrap_or_default());
            let generation = req.add_generation_prompt.unwrap_or(true);
            render_chat(st, messages, req.tools.clone(), kwargs, &images, generation)?.0
        }
        _ => {
            return Err(ApiError::bad(
                "give exactly one of `prompt` or `content` (a text) and `messages` (a chat to render)",
            ));
        }
    };
    let piece = |id: u32| st.tokenizer.decode(&[id], false).unwrap_or_default();
    let tokens = if req.with_pieces.unwrap_or(false) {
        ids.iter().map(|&id| json!({"id": id, "piece": piece(id)})).collect()
    } else {
        ids.iter().map(|&id| json!(id)).collect::<Vec<Value>>()
    };
    let strs = req.return_token_strs.unwrap_or(false).then(|| ids.iter().map(|&id| piece(id)).collect::<Vec<_>>());
    Ok(axum::Json(json!({
        "count": ids.len(),
        "max_model_len": st.engine.sched_config().max_context,
        "tokens": tokens,
        "token_strs": strs,
    }))
    .into_response())
}

/// A text field's ids, as a completion's prompt is encoded.
fn encode(st: &AppState, field: &str, text: &Value) -> Result<Vec<u32>, ApiError> {
    let text = text.as_str().ok_or_else(|| {
        ApiError::bad_param(field, format!("`{field}` must be a string, not {}", crate::request::type_name(text)))
    })?;
    st.prompt_encoder.encode(text).map_err(|e| ApiError::bad(format!("tokenising `{field}`: {e}")))
}

pub async fn detokenize(State(st): State<AppState>, body: Result<Bytes, BytesRejection>) -> Response {
    let result = detokenize_inner(&st, body);
    finish_response(&st, "detokenize", result)
}

fn detokenize_inner(st: &AppState, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let req: DetokenizeRequest = parse_body(body)?;
    st.check_model(req.model.as_deref())?;
    let tokens =
        req.tokens.ok_or_else(|| ApiError::bad_param("tokens", "`tokens` (a list of token ids) is missing"))?;
    let ids = ids_of(&tokens)?;
    let text = st.tokenizer.decode(&ids, false).map_err(|e| ApiError::bad_param("tokens", e.to_string()))?;
    Ok(axum::Json(json!({"prompt": text, "content": text})).into_response())
}

/// `tokens` as ids: a list of non-negative integers that fit a token id.
fn ids_of(tokens: &Value) -> Result<Vec<u32>, ApiError> {
    let list =
        tokens.as_array().ok_or_else(|| ApiError::bad_param("tokens", "`tokens` must be a list of token ids"))?;
    list.iter()
        .enumerate()
        .map(|(i, v)| {
            v.as_u64().and_then(|n| u32::try_from(n).ok()).ok_or_else(|| {
                ApiError::bad_param("tokens", format!("tokens[{i}] is {v}, not a token id (a non-negative integer)"))
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_lists_are_checked_item_by_item() {
        assert_eq!(ids_of(&json!([0, 7, 151643])).unwrap(), [0, 7, 151643]);
        for bad in [json!("1 2"), json!([1, -2]), json!([1.5]), json!([4294967296u64]), json!([null])] {
            let e = ids_of(&bad).unwrap_err();
            assert_eq!(e.status(), axum::http::StatusCode::BAD_REQUEST, "{bad}");
        }
        assert!(ids_of(&json!([3, "x"])).unwrap_err().message().contains("tokens[1]"));
    }
}
