//! `deltaserve logits`: all-position logits of a token sequence, as one F32 tensor `logits` [T, vocab], on
//! the backend `--device` selects (built from the same engine flags as `serve`). With `--messages` the
//! sequence is an OpenAI-format chat rendered as the server renders it (its images given as data URLs),
//! and the file also holds its `input_ids` [T] (I32).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use deltaserve_media::{FetchPolicy, ImageProcessorConfig, decode, load, preprocess};
use deltaserve_model::ImagePatches;
use deltaserve_model::checkpoint::{DType, TensorHeader, write_safetensors};
use deltaserve_server::media::{IMAGE_PAD, expand_placeholders};
use deltaserve_server::request::normalize_messages;
use deltaserve_text::ChatRequest;

use crate::engine_args::EngineArgs;
use crate::model_source::{ModelArgs, parse_token_list};

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    engine: EngineArgs,
    /// Token ids: `1,2,3` or `@ids.json`.
    #[arg(long, required_unless_present = "messages", conflicts_with = "messages")]
    tokens: Option<String>,
    /// A JSON file of OpenAI-format chat messages (images as `image_url` parts with data: URLs), rendered
    /// with the model's chat template and its generation prompt.
    #[arg(long)]
    messages: Option<PathBuf>,
    /// Output safetensors file.
    #[arg(long)]
    output: PathBuf,
    /// Ignored: the sequence runs one position per step, each returning its logits.
    #[arg(long, hide = true)]
    chunk: Option<usize>,
}

pub fn run(a: Args) -> Result<()> {
    let dir = a.model.dir()?;
    let (ids, images) = match (&a.tokens, &a.messages) {
        (Some(tokens), _) => (parse_token_list(tokens)?, Vec::new()),
        (None, Some(path)) => render_messages(&a.model, &dir, path)?,
        (None, None) => bail!("give --tokens or --messages"),
    };
    if ids.is_empty() {
        bail!("the sequence is empty");
    }
    let mut built = a.engine.build_to_score(&a.model, &dir, ids.len())?;
    if !images.is_empty() && !built.backend.runs_images() {
        bail!("the prompt has images but the model runs no vision tower (none in the checkpoint, or --no-vision)");
    }
    let mut logits = Vec::new();
    built.logits_with_images(&ids, &images, |_, row| logits.extend_from_slice(row))?;
    let vocab = logits.len() / ids.len();
    let t = ids.len();
    let headers = [
        TensorHeader { name: "input_ids".into(), dtype: DType::I32, shape: vec![t] },
        TensorHeader { name: "logits".into(), dtype: DType::F32, shape: vec![t, vocab] },
    ];
    write_safetensors(&a.output, &headers, |i, buf| {
        match i {
            0 => buf.extend(ids.iter().flat_map(|&v| (v as i32).to_le_bytes())),
            _ => buf.extend(logits.iter().flat_map(|v| v.to_le_bytes())),
        }
        Ok(())
    })?;
    let max_abs = logits.iter().fold(0.0f32, |acc, v| acc.max(v.abs()));
    let hash =
        logits.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, v| (h ^ v.to_bits() as u64).wrapping_mul(0x0100_0000_01b3));
    eprintln!(
        "wrote input_ids [{t}] and logits [{t}, {vocab}] to {} ({} images, max |logit| {max_abs:.4}, hash {hash:016x})",
        a.output.display(),
        images.len()
    );
    Ok(())
}

/// The prompt ids of the chat in `path` (placeholders expanded) and its images, in order.
fn render_messages(model: &ModelArgs, dir: &Path, path: &Path) -> Result<(Vec<u32>, Vec<Arc<ImagePatches>>)> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let messages: Vec<serde_json::Value> = serde_json::from_str(&text)
        .with_context(|| format!("{}: expected a JSON array of messages", path.display()))?;
    let (messages, parts) = normalize_messages(&messages).map_err(|e| anyhow::anyhow!("{}", e.message()))?;
    let processor = ImageProcessorConfig::for_model_dir(dir)?;
    let policy = FetchPolicy::default();
    let images = parts
        .iter()
        .map(|p| {
            let at = |e: deltaserve_media::MediaError| anyhow::anyhow!("{}: {e}", p.location);
            let img = decode(&load(&p.url, &policy).map_err(at)?).map_err(at)?;
            Ok(Arc::new(preprocess(&processor, &img).map_err(at)?))
        })
        .collect::<Result<Vec<_>>>()?;
    let tm = model.load_text(dir)?;
    let (Some(tokenizer), Some(template)) = (&tm.tokenizer, &tm.template) else {
        bail!("--messages needs the model's tokenizer.json and chat template");
    };
    let req = ChatRequest { messages, tools: None, add_generation_prompt: true, kwargs: Default::default() };
    let prompt = template.render(&req).map_err(|e| anyhow::anyhow!("chat template: {e}"))?;
    let mut ids = tokenizer.encode(&prompt)?;
    if !images.is_empty() {
        let pad = tokenizer.token_id(IMAGE_PAD).with_context(|| format!("the tokenizer has no {IMAGE_PAD}"))?;
        ids = expand_placeholders(ids, pad, &images, processor.merge_size)
            .map_err(|e| anyhow::anyhow!("{}", e.message()))?;
    }
    Ok((ids, images))
}
