//! The server in-process, for the load tools (`soak`, `probe` without `--url`): built exactly as `serve`
//! builds it, on 127.0.0.1 with an ephemeral port, and stopped at the end.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{Context, Result};

use crate::engine_args::EngineArgs;
use crate::http::Target;
use crate::model_source::ModelArgs;

/// Where a load tool (`soak`, `probe`) sends its requests: a running server, or one it starts in-process.
#[derive(clap::Args)]
pub struct ServerArgs {
    /// Server to drive, e.g. http://127.0.0.1:8000 (default: start the server in-process on an ephemeral
    /// port with the --model / engine flags, and stop it at the end). With --url, --model is the model name
    /// sent in requests (default: the first model of /v1/models).
    #[arg(long)]
    pub url: Option<String>,
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub engine: EngineArgs,
    /// API key, sent as `Authorization: Bearer KEY` (in-process: the server requires it too).
    #[arg(long, env = "DELTASERVE_API_KEY")]
    pub api_key: Option<String>,
}

/// A server to send requests to; [`Connected::stop`] stops it when it runs in-process.
pub(crate) struct Connected {
    pub(crate) target: Target,
    /// The model name for requests (None: the first of /v1/models).
    pub(crate) model: Option<String>,
    /// The in-process server, when there is no --url.
    pub(crate) local: Option<InProcess>,
}

impl ServerArgs {
    /// Parses --url, or starts the server in-process.
    pub(crate) async fn connect(&self) -> Result<Connected> {
        match &self.url {
            Some(url) => Ok(Connected {
                target: Target::parse(url)?,
                model: self.model.model.as_ref().map(|m| m.to_string_lossy().into_owned()),
                local: None,
            }),
            None => {
                let server = InProcess::start(&self.model, &self.engine, self.api_key.clone()).await?;
                let target = Target { host: "127.0.0.1".into(), port: server.addr.port(), base: String::new() };
                Ok(Connected { target, model: Some(server.name.clone()), local: Some(server) })
            }
        }
    }
}

impl Connected {
    pub(crate) async fn stop(self) -> Result<()> {
        match self.local {
            Some(server) => server.stop().await,
            None => Ok(()),
        }
    }
}

pub(crate) struct InProcess {
    pub(crate) addr: SocketAddr,
    pub(crate) name: String,
    /// The memory plan the engine was started with, and the backend it runs on.
    pub(crate) plan: deltaserve_plan::Plan,
    pub(crate) device: crate::model_source::Device,
    /// What the server takes in images: its tower, the request limit and the image processor.
    pub(crate) images: crate::synthetic_images::LocalImages,
    pub(crate) engine: deltaserve_engine::EngineHandle,
    pub(crate) stop_tx: tokio::sync::oneshot::Sender<()>,
    pub(crate) join: tokio::task::JoinHandle<std::io::Result<()>>,
}

impl InProcess {
    /// Builds the server state the way `serve` does and serves it on 127.0.0.1:0.
    pub(crate) async fn start(model: &ModelArgs, engine: &EngineArgs, api_key: Option<String>) -> Result<Self> {
        let name = match (&model.model, &model.preset) {
            (Some(model), _) => crate::hub::served_name(model),
            (None, Some(preset)) => preset.clone(),
            (None, None) => "demo".into(),
        };
        let model_dir = model.dir()?;
        let chat_defaults = crate::commands::serve::chat_defaults(model);
        let (model, engine_args, dir) = (model.clone(), engine.clone(), model_dir.clone());
        let started = tokio::task::spawn_blocking(move || -> Result<_> { engine_args.start(&model, &dir) })
            .await
            .context("starting the engine")??;
        tracing::info!("{}", started.plan.table());
        let state = started.app_state(&name, api_key, 64 << 20, &model_dir)?;
        let images = crate::synthetic_images::LocalImages {
            model_has_vision: started.plan.model_has_vision,
            max_patches: started.plan.options.max_image_tokens_per_step,
            max_images: state.media.max_images,
            processor: state.media.processor.clone(),
        };
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.context("binding 127.0.0.1:0")?;
        let addr = listener.local_addr()?;
        tracing::info!(model = %name, "in-process server on http://{addr}");
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let join = tokio::spawn(deltaserve_server::serve(
            listener,
            state,
            async move {
                let _ = stop_rx.await;
            },
            deltaserve_server::ServeOptions { grace: Duration::from_secs(2), chat_defaults },
        ));
        Ok(Self {
            addr,
            name,
            plan: started.plan,
            device: started.device,
            images,
            engine: started.engine,
            stop_tx,
            join,
        })
    }

    pub(crate) async fn stop(self) -> Result<()> {
        let _ = self.stop_tx.send(());
        self.join.await.context("the in-process server task")?.context("the in-process server")?;
        let engine = self.engine;
        tokio::task::spawn_blocking(move || engine.shutdown(false)).await?;
        Ok(())
    }
}

/// The resident set size of this process (`VmRSS` in /proc/self/status), in bytes.
pub(crate) fn host_rss_bytes() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}
