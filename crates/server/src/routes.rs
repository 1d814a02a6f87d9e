//! The router: routes (the APIs, `/tokenize`, `/detokenize` and `/props` behind the key as well), API-key
//! check, body limit, chat defaults, cross-origin requests, health, metrics, load report and the 404 fallback.

use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Router};

use crate::error::{ApiError, Style};
use crate::state::{AppState, ChatDefaults};
use crate::{anthropic, completions, openai};

/// The router with no chat defaults (each model's template decides).
pub fn router(state: AppState) -> Router {
    router_with(state, ChatDefaults::default())
}

/// The router whose chat requests start from `chat_defaults`.
pub fn router_with(state: AppState, chat_defaults: ChatDefaults) -> Router {
    let api = Router::new()
        .route("/v1/chat/completions", post(openai::chat_completions))
        .route("/v1/completions", post(completions::completions))
        .route("/v1/responses", post(crate::responses::responses))
        .route("/v1/models", get(openai::models))
        // `{*id}`: served names may hold a `/` (`Qwen/Qwen3.6-27B`).
        .route("/v1/models/{*id}", get(openai::model))
        .route("/v1/messages", post(anthropic::messages))
        .route("/v1/messages/count_tokens", post(anthropic::count_tokens))
        .route("/v1/loads", get(crate::loads::loads))
        .route("/tokenize", post(crate::tokenize::tokenize))
        .route("/detokenize", post(crate::tokenize::detokenize))
        .route("/props", get(crate::props::props))
        .route_layer(middleware::from_fn_with_state(state.clone(), require_key));
    Router::new()
        .merge(api)
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(state.cfg.max_body_bytes))
        .layer(Extension(chat_defaults))
        .layer(middleware::from_fn_with_state(state.clone(), crate::cors::cors))
        .with_state(state)
}

/// Which error style a path's clients expect.
pub fn style_for(path: &str) -> Style {
    if path.starts_with("/v1/messages") { Style::Anthropic } else { Style::OpenAi }
}

/// `Authorization: Bearer KEY` (OpenAI) or `x-api-key: KEY` (Anthropic), when a key is configured.
async fn require_key(State(st): State<AppState>, headers: HeaderMap, req: Request, next: Next) -> Response {
    if let Some(key) = &st.cfg.api_key {
        let bearer = headers
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer ").or_else(|| v.strip_prefix("bearer ")));
        let x_key = headers.get("x-api-key").and_then(|v| v.to_str().ok());
        if bearer != Some(key.as_str()) && x_key != Some(key.as_str()) {
            let style = style_for(req.uri().path());
            st.metrics.request("unauthorized", 401);
            return ApiError::Unauthorized.into_response_styled(style);
        }
    }
    next.run(req).await
}

async fn health(State(st): State<AppState>) -> Response {
    let _ = st;
    (StatusCode::OK, "ok").into_response()
}

async fn metrics(State(st): State<AppState>) -> Response {
    let mut text = st.metrics.render(&st.engine.stats());
    crate::metrics::render_prompt_encoder(&mut text, &st.prompt_encoder.stats());
    crate::metrics::render_image_cache(&mut text, &st.media.cache);
    ([("content-type", "text/plain; version=0.0.4")], text).into_response()
}

async fn not_found(req: Request) -> Response {
    let path = req.uri().path().to_string();
    ApiError::NotFound(format!("no route for {} {path}", req.method())).into_response_styled(style_for(&path))
}
