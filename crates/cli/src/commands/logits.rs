//! `deltaserve logits`: all-position logits of a token sequence, as one F32 tensor `logits` [T, vocab].

use std::path::PathBuf;

use anyhow::{Result, bail};
use deltaserve_cpu::{GdnMode, Logits};

use crate::model_source::{ModelArgs, parse_token_list};

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    /// Token ids: `1,2,3` or `@ids.json`.
    #[arg(long)]
    tokens: String,
    /// Output safetensors file.
    #[arg(long)]
    output: PathBuf,
    /// Feed the sequence in pieces of this many tokens (state carried between pieces).
    #[arg(long, default_value_t = 4096)]
    chunk: usize,
}

pub fn run(a: Args) -> Result<()> {
    let ids = parse_token_list(&a.tokens)?;
    if ids.is_empty() {
        bail!("--tokens is empty");
    }
    let loaded = a.model.load()?;
    let m = &loaded.model;
    let mut state = m.new_sequence();
    let mut logits = Vec::with_capacity(ids.len() * m.dims.vocab);
    for piece in ids.chunks(a.chunk.max(1)) {
        logits.extend(m.forward(&mut state, piece, GdnMode::Auto, Logits::All)?);
    }
    deltaserve_model::checkpoint::write_f32_safetensors(
        &a.output,
        &[("logits", vec![ids.len(), m.dims.vocab], &logits)],
    )?;
    let max_abs = logits.iter().fold(0.0f32, |acc, v| acc.max(v.abs()));
    let hash =
        logits.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, v| (h ^ v.to_bits() as u64).wrapping_mul(0x0100_0000_01b3));
    eprintln!(
        "wrote logits [{}, {}] to {} (max |logit| {max_abs:.4}, hash {hash:016x})",
        ids.len(),
        m.dims.vocab,
        a.output.display()
    );
    Ok(())
}
