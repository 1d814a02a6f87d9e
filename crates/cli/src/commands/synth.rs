//! `deltaserve synth`: a complete random-weight model directory (config, bf16 safetensors, tokenizer, template).

use std::path::PathBuf;

use anyhow::Result;
use deltaserve_model::synth::Preset;
use indicatif::{ProgressBar, ProgressStyle};

#[derive(clap::Args)]
pub struct Args {
    /// Shape preset: tiny or qwen3.6-27b.
    #[arg(long)]
    preset: String,
    /// Output directory.
    #[arg(long)]
    out: PathBuf,
    /// Number of decoder layers (default: the preset's).
    #[arg(long)]
    layers: Option<usize>,
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

pub fn run(a: Args) -> Result<()> {
    let preset = Preset::parse(&a.preset)?;
    if a.layers == Some(0) {
        anyhow::bail!("--layers must be at least 1");
    }
    let bar = ProgressBar::new(0).with_message("writing weights");
    bar.set_style(
        ProgressStyle::with_template("{msg} [{bar:40}] {bytes}/{total_bytes} ({eta})")?.progress_chars("=> "),
    );
    deltaserve_engine::synth::write_synthetic_model(&a.out, preset, a.layers, a.seed, |done, total| {
        bar.set_length(total);
        bar.set_position(done);
    })?;
    bar.finish_and_clear();
    eprintln!("wrote a {} model with RANDOM weights to {}", a.preset, a.out.display());
    Ok(())
}
