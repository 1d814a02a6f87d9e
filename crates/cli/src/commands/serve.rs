//! `deltaserve serve`: the OpenAI- and Anthropic-compatible HTTP server.

use std::net::{SocketAddr, ToSocketAddrs};
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result, bail};

use crate::engine_args::EngineArgs;
use crate::model_source::ModelArgs;

#[derive(clap::Args)]
pub struct Args {
    /// The model directory, as `--model` (`deltaserve serve /path/to/model`).
    #[arg(value_name = "MODEL", conflicts_with_all = ["model", "preset"])]
    model_path: Option<PathBuf>,
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    engine: EngineArgs,
    /// Address to listen on: an IP address (0.0.0.0: every interface) or a host name.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Require this key (`Authorization: Bearer KEY` or `x-api-key: KEY`) on /v1/* (empty: no key).
    #[arg(long, env = "DELTASERVE_API_KEY")]
    api_key: Option<String>,
    /// The model name clients send (default: the Hugging Face id, the model directory's name, or `demo`).
    #[arg(long)]
    served_model_name: Option<String>,
    /// Largest request body in MiB.
    #[arg(long, default_value_t = 16)]
    max_body_mib: usize,
    /// On SIGINT/SIGTERM, seconds to let in-flight requests finish before cancelling them (a second
    /// signal exits at once).
    #[arg(long, default_value_t = 10)]
    shutdown_grace_secs: u64,
    /// Origins whose web pages may call the API (CORS), comma-separated (`scheme://host[:port]`; `*`: any,
    /// as vLLM and llama.cpp allow by default; an empty value: none, no CORS headers).
    #[arg(long, value_delimiter = ',', value_name = "ORIGINS", default_value = "*")]
    allowed_origins: Vec<String>,
    /// The thinking budget of chat requests that give none (their `thinking_token_budget`, Anthropic's
    /// `thinking.budget_tokens`): the reasoning is closed after this many tokens; 0: no reasoning; -1
    /// (the default): no budget.
    #[arg(long, default_value_t = -1, allow_negative_numbers = true, value_name = "N")]
    reasoning_budget: i64,
    /// Hosts whose http(s) image URLs the server fetches, comma-separated (a host also allows its
    /// subdomains; `*`: any host). Default: none, only data: URLs.
    #[arg(long, value_delimiter = ',', value_name = "HOSTS")]
    allowed_media_domains: Vec<String>,
    /// The most images one request may carry.
    #[arg(long, default_value_t = deltaserve_server::media::DEFAULT_MAX_IMAGES)]
    limit_images_per_request: usize,
    /// Host memory for processed images kept by their encoded bytes, so an image sent again (an agent's earlier
    /// screenshots, every turn) is not decoded and patched again; 0: none kept.
    #[arg(long, default_value = "1GiB", value_name = "SIZE", value_parser = deltaserve_plan::parse_size)]
    image_cache: u64,
}

pub fn run(mut a: Args) -> Result<()> {
    if let Some(path) = a.model_path.take() {
        a.model.model = Some(path);
    }
    let name = a.served_model_name.clone().unwrap_or_else(|| match &a.model.model {
        Some(model) => crate::hub::served_name(model),
        None => "demo".into(),
    });
    // Everything that can fail before the weights load is checked first: the address, then the model's
    // device, config, tokenizer and memory plan.
    let listener = bind(&a.host, a.port)?;
    if let Some(model) = &a.model.model
        && crate::hub::hub_id(model).is_some()
    {
        // A Hugging Face id: its config and tokenizer first, and every check on them, before the weights
        // download (planned again below, with a quantised checkpoint's tensors then on disk).
        let text_dir = crate::hub::resolve(model, crate::hub::Need::Text)?;
        let checked = a.engine.prepare(&a.model, &text_dir, None)?;
        if checked.tokenizer().is_none() {
            bail!("serving needs a tokenizer.json in the model repository {}", model.display());
        }
    }
    let model_dir = a.model.dir()?;
    let prepared = a.engine.prepare(&a.model, &model_dir, None)?;
    if prepared.tokenizer().is_none() {
        bail!("serving needs a tokenizer.json in the model directory {}", model_dir.display());
    }
    let started = a.engine.start_prepared(&a.model, prepared)?;
    eprintln!("{}", started.plan.table());
    let mut state = started.app_state(&name, a.api_key.clone(), a.max_body_mib << 20, &model_dir)?;
    let mut media = (*state.media).clone();
    media.fetch.allowed_domains =
        a.allowed_media_domains.iter().map(|d| d.trim().to_string()).filter(|d| !d.is_empty()).collect();
    media.max_images = a.limit_images_per_request;
    media.cache = std::sync::Arc::new(deltaserve_server::media::ImageCache::new(
        usize::try_from(a.image_cache).context("--image-cache")?,
    ));
    state.media = std::sync::Arc::new(media);
    let mut cfg = (*state.cfg).clone();
    cfg.allowed_origins = deltaserve_server::cors::AllowedOrigins::parse(&a.allowed_origins);
    cfg.reasoning_budget = usize::try_from(a.reasoning_budget).ok();
    state.cfg = std::sync::Arc::new(cfg);
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::from_std(listener).context("the listening socket")?;
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
        deltaserve_server::serve(listener, state, shutdown_signal()?, opts).await?;
        let engine = started.engine.clone();
        tokio::task::spawn_blocking(move || engine.shutdown(false)).await?;
        tracing::info!("stopped");
        anyhow::Ok(())
    })
}

/// Listens on `host`:`port` (the first of its addresses that binds), before anything else is loaded.
fn bind(host: &str, port: u16) -> Result<std::net::TcpListener> {
    let addrs: Vec<SocketAddr> = (host, port)
        .to_socket_addrs()
        .with_context(|| format!("--host {host}: not an IP address or a host name that resolves"))?
        .collect();
    let mut last = None;
    for addr in addrs {
        match std::net::TcpListener::bind(addr) {
            Ok(listener) => {
                listener.set_nonblocking(true).context("the listening socket")?;
                return Ok(listener);
            }
            Err(e) => last = Some((addr, e)),
        }
    }
    let Some((addr, e)) = last else { bail!("--host {host}: resolves to no address") };
    let hint = match e.kind() {
        std::io::ErrorKind::AddrInUse => format!(": port {port} is in use by another process (choose one with --port)"),
        std::io::ErrorKind::AddrNotAvailable => format!(": {host} is not an address of this machine (--host)"),
        std::io::ErrorKind::PermissionDenied => format!(": port {port} needs privileges (choose one above 1023)"),
        _ => String::new(),
    };
    bail!("cannot listen on {addr} ({e}){hint}")
}

/// Thinking is off by default for the built-in demo model (its random weights never close `<think>`,
/// so its whole reply would be reasoning); a real model keeps its chat template's default.
pub(crate) fn chat_defaults(model: &ModelArgs) -> deltaserve_server::ChatDefaults {
    match (&model.model, &model.preset) {
        (None, None) => deltaserve_server::ChatDefaults::thinking_off(),
        _ => deltaserve_server::ChatDefaults::default(),
    }
}

/// Resolves on the first SIGINT or SIGTERM; a second one during the shutdown grace exits the process at
/// once (exit code 130). The signal handlers are installed before serving starts.
fn shutdown_signal() -> Result<impl std::future::Future<Output = ()> + Send + 'static> {
    let mut signals = Signals::new()?;
    Ok(async move {
        signals.next().await;
        tokio::spawn(async move {
            let which = signals.next().await;
            tracing::warn!("second {which} during the shutdown grace: exiting now, cancelling the requests in flight");
            std::process::exit(130);
        });
    })
}

/// SIGINT and SIGTERM as one stream of signal names.
struct Signals {
    #[cfg(unix)]
    int: tokio::signal::unix::Signal,
    #[cfg(unix)]
    term: tokio::signal::unix::Signal,
}

impl Signals {
    fn new() -> Result<Self> {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{SignalKind, signal};
            Ok(Self {
                int: signal(SignalKind::interrupt()).context("installing the SIGINT handler")?,
                term: signal(SignalKind::terminate()).context("installing the SIGTERM handler")?,
            })
        }
        #[cfg(not(unix))]
        Ok(Self {})
    }

    /// The next signal's name.
    async fn next(&mut self) -> &'static str {
        #[cfg(unix)]
        {
            tokio::select! {
                _ = self.int.recv() => "SIGINT",
                _ = self.term.recv() => "SIGTERM",
            }
        }
        #[cfg(not(unix))]
        {
            let _ = tokio::signal::ctrl_c().await;
            "Ctrl-C"
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        args: Args,
    }

    /// `deltaserve serve ARGS` parsed as the binary parses it.
    fn parse(args: &[&str]) -> Result<Args, clap::Error> {
        let argv = std::iter::once("serve").chain(args.iter().copied()).map(std::ffi::OsString::from);
        Cli::try_parse_from(crate::with_long_tp(argv)).map(|c| c.args)
    }

    #[test]
    fn vllm_and_llama_cpp_flag_names() {
        let engine = |args: &[&str]| parse(args).unwrap().engine;
        for args in
            [&["--max-context", "4096"][..], &["--max-model-len", "4096"], &["--ctx-size", "4096"], &["-c", "4096"]]
        {
            assert_eq!(engine(args).max_context, Some(4096), "{args:?}");
        }
        for args in [&["--tensor-parallel", "2"][..], &["--tensor-parallel-size", "2"], &["-tp", "2"], &["-tp=2"]] {
            assert_eq!(engine(args).tensor_parallel, 2, "{args:?}");
        }
        assert_eq!(engine(&["--gpu-memory-utilization", "0.9"]).gpu_memory_utilization, Some(0.9));
        for bad in ["0", "1.5", "NaN", "most"] {
            let e = parse(&["--gpu-memory-utilization", bad]).err().unwrap().to_string();
            assert!(e.contains("fraction"), "{bad}: {e}");
        }
        let e = parse(&["--memory", "20GiB", "--gpu-memory-utilization", "0.9"]).err().unwrap().to_string();
        assert!(e.contains("--memory") && e.contains("cannot be used with"), "{e}");
    }

    #[test]
    fn the_model_may_be_positional() {
        let a = parse(&["/models/Qwen3.6-27B", "--port", "9000"]).unwrap();
        assert_eq!(a.model_path.as_deref(), Some(std::path::Path::new("/models/Qwen3.6-27B")));
        assert!(parse(&["/models/a", "--model", "/models/b"]).is_err(), "the model given twice");
        assert!(parse(&["/models/a", "/models/b"]).is_err());
    }

    #[test]
    fn bad_addresses_are_one_line_errors() {
        let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = taken.local_addr().unwrap().port();
        let e = format!("{:#}", bind("127.0.0.1", port).unwrap_err());
        assert!(e.contains(&format!("port {port} is in use")) && !e.contains('\n'), "{e}");
        let e = format!("{:#}", bind("192.0.2.1", 0).unwrap_err());
        assert!(e.contains("not an address of this machine"), "{e}");
        let e = format!("{:#}", bind("no such host!", 0).unwrap_err());
        assert!(e.contains("--host no such host!"), "{e}");
        let ok = bind("localhost", 0).unwrap();
        assert!(ok.local_addr().unwrap().ip().is_loopback());
    }
}
