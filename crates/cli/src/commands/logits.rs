//! `deltaserve logits`: all-position logits of a token sequence, as one F32 tensor `logits` [T, vocab], on
//! the backend `--device` selects (built from the same engine flags as `serve`).

use std::path::PathBuf;

use anyhow::{Result, bail};

use crate::engine_args::EngineArgs;
use crate::model_source::{ModelArgs, parse_token_list};

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    engine: EngineArgs,
    /// Token ids: `1,2,3` or `@ids.json`.
    #[arg(long)]
    tokens: String,
    /// Output safetensors file.
    #[arg(long)]
    output: PathBuf,
    /// Ignored: the sequence runs one position per step, each returning its logits.
    #[arg(long, hide = true)]
    chunk: Option<usize>,
}

pub fn run(a: Args) -> Result<()> {
    let ids = parse_token_list(&a.tokens)?;
    if ids.is_empty() {
        bail!("--tokens is empty");
    }
    let mut built = a.engine.build_to_score(&a.model, &a.model.dir()?, ids.len())?;
    let mut logits = Vec::new();
    built.logits_at_every_position(&ids, |_, row| logits.extend_from_slice(row))?;
    let vocab = logits.len() / ids.len();
    deltaserve_model::checkpoint::write_f32_safetensors(&a.output, &[("logits", vec![ids.len(), vocab], &logits)])?;
    let max_abs = logits.iter().fold(0.0f32, |acc, v| acc.max(v.abs()));
    let hash =
        logits.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, v| (h ^ v.to_bits() as u64).wrapping_mul(0x0100_0000_01b3));
    eprintln!(
        "wrote logits [{}, {vocab}] to {} (max |logit| {max_abs:.4}, hash {hash:016x})",
        ids.len(),
        a.output.display()
    );
    Ok(())
}
