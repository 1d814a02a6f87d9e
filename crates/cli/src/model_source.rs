//! Where a command's model comes from (`--model DIR`, or the built-in demo model) and which device
//! runs it; loads config, weights and tokenizer.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use deltaserve_cpu::CpuModel;
use deltaserve_model::{Checkpoint, ModelConfig, ModelWeights};
use deltaserve_text::{ChatTemplate, Tokenizer};

/// Options every model-running command takes.
#[derive(clap::Args, Clone, Debug)]
pub struct ModelArgs {
    /// HF model directory (config.json, *.safetensors, tokenizer.json). Default: the built-in demo model (random weights).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Backend: `cpu` (the f32 reference) or `cuda`. Default: cpu on machines without a GPU.
    #[arg(long, default_value = "auto")]
    pub device: String,
}

/// A loaded model with its optional tokenizer and chat template.
pub struct LoadedModel {
    pub model: CpuModel,
    pub tokenizer: Option<Tokenizer>,
    pub template: Option<ChatTemplate>,
}

impl ModelArgs {
    /// The model directory: `--model`, or the built-in demo model (created on first use).
    pub fn dir(&self) -> Result<PathBuf> {
        match &self.model {
            Some(d) => Ok(d.clone()),
            None => {
                let dir = deltaserve_engine::synth::demo_model_dir().context("creating the built-in demo model")?;
                tracing::warn!(
                    "no --model given: using the built-in demo model (tiny preset, RANDOM weights, its output is gibberish) at {}. \
                     To serve a real model pass --model /path/to/Qwen3.6-27B (a Hugging Face directory with config.json, \
                     *.safetensors and tokenizer.json).",
                    dir.display()
                );
                Ok(dir)
            }
        }
    }

    pub fn load(&self) -> Result<LoadedModel> {
        self.load_dir(&self.dir()?)
    }

    /// Loads the model in `dir` (from [`ModelArgs::dir`]) for the selected device.
    pub fn load_dir(&self, dir: &Path) -> Result<LoadedModel> {
        match self.device.as_str() {
            "cpu" | "auto" => {}
            "cuda" => bail!("--device cuda: the CUDA backend is not part of this build yet; use --device cpu"),
            other => bail!("unknown --device `{other}` (expected cpu or cuda)"),
        }
        load_dir(dir)
    }
}

fn load_dir(dir: &Path) -> Result<LoadedModel> {
    if !dir.is_dir() {
        bail!("model directory {} does not exist", dir.display());
    }
    let config = ModelConfig::from_dir(dir)?;
    let ckpt = Checkpoint::open(dir)?;
    let weights = ModelWeights::load_f32(&ckpt, &config)?;
    let tok_path = dir.join("tokenizer.json");
    let tokenizer = if tok_path.exists() { Some(Tokenizer::from_file(&tok_path)?) } else { None };
    let template = ChatTemplate::from_dir(dir)?;
    tracing::info!(
        model = %dir.display(),
        layers = config.layer_types.len(),
        hidden = config.hidden_size,
        vocab = config.vocab_size,
        tokenizer = tokenizer.is_some(),
        "model loaded on the CPU reference backend"
    );
    Ok(LoadedModel { model: CpuModel::new(config, weights), tokenizer, template })
}

/// Parses `1,2,3` or `@file.json` (a JSON array of ids).
pub fn parse_token_list(arg: &str) -> Result<Vec<u32>> {
    if let Some(path) = arg.strip_prefix('@') {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading token ids from {path}"))?;
        let ids: Vec<u32> = serde_json::from_str(&text)
            .with_context(|| format!("{path}: expected a JSON array of non-negative integer token ids"))?;
        return Ok(ids);
    }
    arg.split(',')
        .map(|s| s.trim())
        .filter(|s| !s.is_empty())
        .map(|s| s.parse::<u32>().with_context(|| format!("`{s}` in --tokens is not a token id")))
        .collect()
}
