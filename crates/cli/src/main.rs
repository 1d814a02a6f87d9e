//! `deltaserve`: the command-line entry point. Each subcommand lives in `commands/`.

mod commands;
mod engine_args;
mod gpu_memory;
mod http;
mod hub;
mod in_process;
mod model_source;
mod report;
mod synthetic_text;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "deltaserve",
    version,
    about = "Inference server for hybrid Gated-DeltaNet + attention models (Qwen3.5/3.6, Qwen3-Next)"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
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

fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .init();
    let cli = Cli::parse();
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
