//! `deltaserve serve`: the OpenAI- and Anthropic-compatible HTTP server.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{Context, Result};

use crate::engine_args::EngineArgs;
use crate::model_source::ModelArgs;

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    engine: EngineArgs,
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Require this key (`Authorization: Bearer KEY` or `x-api-key: KEY`) on /v1/*.
    #[arg(long, env = "DELTASERVE_API_KEY")]
    api_key: Option<String>,
    /// The model name clients send (default: the Hugging Face id, the model directory's name, or `demo`).
    #[arg(long)]
    served_model_name: Option<String>,
    /// Largest request body in MiB.
    #[arg(long, default_value_t = 16)]
    max_body_mib: usize,
    /// On SIGINT/SIGTERM, seconds to let in-flight requests finish before cancelling them.
    #[arg(long, default_value_t = 10)]
    shutdown_grace_secs: u64,
}

pub fn run(a: Args) -> Result<()> {
    let name = a.served_model_name.clone().unwrap_or_else(|| match &a.model.model {
        Some(model) => crate::hub::served_name(model),
        None => "demo".into(),
    });
    let model_dir = a.model.dir()?;
    let started = a.engine.start(&a.model)?;
    eprintln!("{}", started.plan.table());
    let state = started.app_state(&name, a.api_key.clone(), a.max_body_mib << 20, &model_dir)?;
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    rt.block_on(async move {
        let addr: SocketAddr = format!("{}:{}", a.host, a.port)
            .parse()
            .with_context(|| format!("bad --host/--port {}:{}", a.host, a.port))?;
        let listener = tokio::net::TcpListener::bind(addr).await.with_context(|| format!("binding {addr}"))?;
        let p = &started.plan;
        tracing::info!(
            model = %name,
            max_context = p.max_context,
            max_full_context_seqs = p.max_full_context_seqs,
            max_seqs = p.max_seqs,
            "serving on http://{} (OpenAI: /v1/chat/completions, /v1/completions; Anthropic: /v1/messages)",
            listener.local_addr()?
        );
        let opts = deltaserve_server::ServeOptions {
            grace: Duration::from_secs(a.shutdown_grace_secs),
            chat_defaults: chat_defaults(&a.model),
        };
        deltaserve_server::serve(listener, state, shutdown_signal(), opts).await?;
        let engine = started.engine.clone();
        tokio::task::spawn_blocking(move || engine.shutdown(false)).await?;
        tracing::info!("stopped");
        anyhow::Ok(())
    })
}

/// Thinking is off by default for the built-in demo model (its random weights never close `<think>`,
/// so its whole reply would be reasoning); a real model keeps its chat template's default.
pub(crate) fn chat_defaults(model: &ModelArgs) -> deltaserve_server::ChatDefaults {
    match (&model.model, &model.preset) {
        (None, None) => deltaserve_server::ChatDefaults::thinking_off(),
        _ => deltaserve_server::ChatDefaults::default(),
    }
}

/// Resolves on SIGINT or SIGTERM.
async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! { _ = ctrl_c => {}, _ = term => {} }
}
