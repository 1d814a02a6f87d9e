//! deltaserve-server: the HTTP API over the engine.
//!
//! - [`openai`]: `/v1/chat/completions`, `/v1/completions`, `/v1/models`;
//! - [`anthropic`]: `/v1/messages`, `/v1/messages/count_tokens`;
//! - [`request`]: API requests → engine requests (sampling, stops, chat rendering);
//! - [`output`]: engine events → reasoning / content / tool-call events;
//! - [`error`]: every client-visible error and its status; [`metrics`]: Prometheus; [`routes`]: the router.

pub mod anthropic;
pub mod error;
pub mod metrics;
pub mod openai;
pub mod output;
pub mod request;
pub mod routes;
pub mod state;

use std::net::SocketAddr;
use std::time::Duration;

pub use state::{AppState, ServerConfig};

/// Serves `state` on `listener` until `shutdown` resolves; then stops accepting connections, lets
/// in-flight requests finish for up to `grace`, cancels what is left and returns.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: AppState,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    grace: Duration,
) -> std::io::Result<()> {
    let engine = state.engine.clone();
    let app = routes::router(state);
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        shutdown.await;
        tracing::info!(
            grace_s = grace.as_secs_f64(),
            "shutting down: no new connections; finishing in-flight requests"
        );
        let _ = stop_tx.send(true);
        tokio::time::sleep(grace).await;
        // Whatever is still running now is cancelled; its streams end with an error event.
        let _ = tokio::task::spawn_blocking(move || engine.shutdown(false)).await;
    });
    let mut rx = stop_rx.clone();
    axum::serve(listener, app.into_make_service_with_connect_info::<SocketAddr>())
        .with_graceful_shutdown(async move {
            let _ = rx.wait_for(|v| *v).await;
        })
        .await
}
