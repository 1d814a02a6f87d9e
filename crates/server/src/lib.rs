//! deltaserve-server: the HTTP API over the engine.
//!
//! - [`openai`]: `/v1/chat/completions`, `/v1/models`, `/v1/models/{id}`; [`completions`]: `/v1/completions`;
//! - [`responses`]: `/v1/responses` (OpenAI's Responses API, stateless, over the chat pipeline);
//! - [`anthropic`]: `/v1/messages`, `/v1/messages/count_tokens`;
//! - [`request`]: API requests → engine requests (sampling, stops, chat rendering);
//! - [`output`]: engine events → reasoning / content / tool-call events;
//! - [`error`]: every client-visible error and its status; [`metrics`]: Prometheus; [`routes`]: the router;
//! - [`drain`]: graceful shutdown (a 503 for new requests while in-flight ones finish);
//! - [`loads`]: `/v1/loads`, the load report a gateway's load-aware routing polls;
//! - [`media`]: images in chat requests (loading off the runtime, placeholders expanded to image tokens);
//! - [`timings`]: a response's `timings` and a streamed prompt's `prompt_progress` (llama.cpp's fields);
//! - [`tokenize`]: `/tokenize` and `/detokenize` (vLLM's and llama.cpp's shapes); [`props`]: `/props`
//!   (llama.cpp's server settings).

pub mod anthropic;
pub mod completions;
pub mod cors;
pub mod drain;
pub mod error;
pub mod loads;
pub mod media;
pub mod metrics;
pub mod openai;
pub mod output;
pub mod props;
pub mod request;
pub mod responses;
pub mod routes;
pub mod state;
pub mod structured;
pub mod thinking;
pub mod timings;
pub mod tokenize;

use std::net::SocketAddr;
use std::time::Duration;

pub use state::{AppState, ChatDefaults, ServerConfig};

/// How [`serve`] runs, besides the state.
#[derive(Clone, Debug, Default)]
pub struct ServeOptions {
    /// After the shutdown signal, how long in-flight requests may run before they are cancelled.
    pub grace: Duration,
    /// The chat-template variables requests start from ([`ChatDefaults`]).
    pub chat_defaults: ChatDefaults,
}

/// Serves `state` on `listener` until `shutdown` resolves; then answers new requests with a 503
/// "shutting down", lets in-flight requests finish for up to `opts.grace`, cancels what is left,
/// stops accepting connections and returns.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: AppState,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    opts: ServeOptions,
) -> std::io::Result<()> {
    let engine = state.engine.clone();
    let drain = drain::Drain::default();
    let app = routes::router_with(state, opts.chat_defaults)
        .layer(axum::middleware::from_fn_with_state(drain.clone(), drain::gate));
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let grace = opts.grace;
    tokio::spawn(async move {
        shutdown.await;
        drain.begin();
        tracing::info!(
            grace_s = grace.as_secs_f64(),
            in_flight = drain.in_flight(),
            "shutting down: new requests get 503; finishing in-flight requests"
        );
        if tokio::time::timeout(grace, drain.idle()).await.is_err() {
            // Whatever is still running now is cancelled; its streams end with an error event.
            tracing::info!(in_flight = drain.in_flight(), "shutdown grace over: cancelling the requests left");
            let _ = tokio::task::spawn_blocking(move || engine.shutdown(false)).await;
        }
        let _ = stop_tx.send(true);
    });
    let mut rx = stop_rx.clone();
    axum::serve(listener, app.into_make_service_with_connect_info::<SocketAddr>())
        .with_graceful_shutdown(async move {
            let _ = rx.wait_for(|v| *v).await;
        })
        .await
}
