//! `deltaserve`: the command-line entry point. Each subcommand lives in `commands/`.

mod commands;
mod device;
mod engine_args;
mod gpu_budget;
mod gpu_memory;
mod host_memory;
mod http;
mod hub;
mod in_process;
mod model_source;
mod progress;
mod report;
mod synthetic_images;
mod synthetic_text;

use std::io::IsTerminal;

use clap::{Parser, Subcommand};

/// `deltaserve --version`: the package version and the git commit it was built from.
const VERSION: &str = concat!(env!("CARGO_PKG_VERSION"), " (commit ", env!("DELTASERVE_GIT_COMMIT"), ")");

#[derive(Parser)]
#[command(
    name = "deltaserve",
    version = VERSION,
    about = "Inference server for hybrid Gated-DeltaNet + attention models (Qwen3.5/3.6, Qwen3-Next)"
)]
struct Cli {
    /// Log level: error, warn, info, debug or trace (debug and trace apply to deltaserve's own crates).
    /// Given, it wins over RUST_LOG; else RUST_LOG, else info.
    #[arg(long, global = true, value_enum)]
    log_level: Option<LogLevel>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum LogLevel {
    Error,
    Warn,
    Info,
    Debug,
    Trace,
}

/// The `tracing` filter: `--log-level` when given, else `RUST_LOG` when set, else `info`.
fn log_filter(level: Option<LogLevel>, rust_log: Option<&str>) -> String {
    let name = |l: LogLevel| format!("{l:?}").to_ascii_lowercase();
    match (level, rust_log) {
        // Below info, the dependencies (HTTP, tokenizers) stay at info: their debug output drowns ours.
        (Some(l @ (LogLevel::Debug | LogLevel::Trace)), _) => format!("info,deltaserve={}", name(l)),
        (Some(l), _) => name(l),
        (None, Some(env)) if !env.trim().is_empty() => env.to_string(),
        (None, _) => "info".into(),
    }
}

#[derive(Subcommand)]
enum Command {
    /// Serve the OpenAI- and Anthropic-compatible HTTP API (the built-in demo model without --model).
    Serve(commands::serve::Args),
    /// CUDA kernel tools (`kernels check`: compile every kernel for sm_80/86/89/90, no GPU needed).
    #[command(subcommand)]
    Kernels(commands::kernels::Command),
    /// Measure the CUDA backend (prefill, decode, memory) against the GPU's measured ceilings.
    Bench(commands::bench::Args),
    /// Generate text (or token ids) for one prompt.
    Generate(commands::generate::Args),
    /// Write the logits of every position of a token sequence to a safetensors file.
    Logits(commands::logits::Args),
    /// Write a complete random-weight model directory for a preset shape.
    Synth(commands::synth::Args),
    /// Print the static memory plan: what fits in a memory budget.
    Plan(commands::plan::Args),
    /// The ceiling ladder: fill the advertised context (one prompt at 25..100%, then many turns) and check
    /// the driver-reported memory against the plan.
    Probe(commands::probe::Args),
    /// Replay a synthetic multi-turn agent session against a server and report per-turn cost.
    Soak(commands::soak::Args),
    /// Quality evaluations (`eval kld`: KL divergence of KV-cache configurations against a baseline).
    #[command(subcommand)]
    Eval(commands::eval::Command),
}

/// The command line with vLLM's `-tp N` / `-tp=N` (a one-dash long option, which clap has no form for)
/// spelled `--tensor-parallel`.
fn with_long_tp(args: impl IntoIterator<Item = std::ffi::OsString>) -> Vec<std::ffi::OsString> {
    args.into_iter()
        .map(|a| match a.to_str() {
            Some("-tp") => "--tensor-parallel".into(),
            Some(s) if s.starts_with("-tp=") => format!("--tensor-parallel={}", &s[4..]).into(),
            _ => a,
        })
        .collect()
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse_from(with_long_tp(std::env::args_os()));
    let filter = log_filter(cli.log_level, std::env::var("RUST_LOG").ok().as_deref());
    let filter = tracing_subscriber::EnvFilter::try_new(&filter).unwrap_or_else(|e| {
        eprintln!("warning: RUST_LOG `{filter}` is not a valid filter ({e}); logging at info");
        "info".into()
    });
    // Colour only on a terminal: logs written to a file or a pipe stay plain text.
    let ansi = std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none();
    tracing_subscriber::fmt().with_writer(std::io::stderr).with_ansi(ansi).with_env_filter(filter).init();
    let result = match cli.command {
        Command::Serve(a) => commands::serve::run(a),
        Command::Kernels(c) => commands::kernels::run(c),
        Command::Bench(a) => commands::bench::run(a),
        Command::Generate(a) => commands::generate::run(a),
        Command::Logits(a) => commands::logits::run(a),
        Command::Synth(a) => commands::synth::run(a),
        Command::Plan(a) => commands::plan::run(a),
        Command::Probe(a) => commands::probe::run(a),
        Command::Soak(a) => commands::soak::run(a),
        Command::Eval(c) => commands::eval::run(c),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_level_flag_wins_over_rust_log() {
        assert_eq!(log_filter(None, None), "info");
        assert_eq!(log_filter(None, Some("")), "info");
        assert_eq!(log_filter(None, Some("warn,deltaserve_engine=debug")), "warn,deltaserve_engine=debug");
        assert_eq!(log_filter(Some(LogLevel::Warn), Some("debug")), "warn");
        assert_eq!(log_filter(Some(LogLevel::Error), None), "error");
        assert_eq!(log_filter(Some(LogLevel::Debug), None), "info,deltaserve=debug");
        assert_eq!(log_filter(Some(LogLevel::Trace), Some("warn")), "info,deltaserve=trace");
    }

    #[test]
    fn log_level_is_global() {
        let cli = Cli::try_parse_from(["deltaserve", "plan", "--preset", "tiny", "--log-level", "debug"]).unwrap();
        assert_eq!(cli.log_level, Some(LogLevel::Debug));
        let cli = Cli::try_parse_from(["deltaserve", "--log-level", "warn", "plan", "--preset", "tiny"]).unwrap();
        assert_eq!(cli.log_level, Some(LogLevel::Warn));
        assert!(Cli::try_parse_from(["deltaserve", "--log-level", "loud", "plan"]).is_err());
    }

    #[test]
    fn version_names_the_commit() {
        assert!(VERSION.starts_with(env!("CARGO_PKG_VERSION")) && VERSION.contains("(commit "), "{VERSION}");
    }
}
