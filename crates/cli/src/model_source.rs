//! Where a command's model comes from (`--model DIR`, a Hugging Face id, or the built-in demo model)
//! and which device runs it; loads config, weights and tokenizer.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use deltaserve_cpu::CpuModel;
use deltaserve_media::ImageProcessorConfig;
use deltaserve_model::quant::Quantization;
use deltaserve_model::shard::ShardSpec;
use deltaserve_model::{Checkpoint, ModelConfig, ModelWeights, VisionWeights};
use deltaserve_plan::{CheckpointTensors, PlanBackend, PlanOptions, WeightsDtype};
use deltaserve_text::{ChatTemplate, Tokenizer};

/// Options every model-running command takes.
#[derive(clap::Args, Clone, Debug)]
pub struct ModelArgs {
    /// A Hugging Face model id (owner/name[@revision], downloaded into the Hugging Face cache on first
    /// use) or a local model directory (config.json, *.safetensors, tokenizer.json). Default: the
    /// built-in demo model (random weights).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Backend: `cpu` (the f32 reference) or `cuda`. Default (`auto`): cuda when an NVIDIA driver,
    /// NVRTC and cuBLAS are found, else cpu.
    #[arg(long, default_value = "auto")]
    pub device: String,
    /// Use a built-in shape instead of a model directory (tiny, tiny-moe, qwen3.6-27b, qwen3.6-35b-a3b,
    /// qwen3-next-80b-a3b); needs --random-weights
    /// unless it is `tiny` (whose random weights are written to disk).
    #[arg(long, conflicts_with = "model")]
    pub preset: Option<String>,
    /// With --preset: number of decoder layers.
    #[arg(long, requires = "preset")]
    pub preset_layers: Option<usize>,
    /// Initialise the weights at random directly on the GPU (benchmarks at real shapes, no files).
    #[arg(long)]
    pub random_weights: bool,
    /// Load no vision tower, even where the checkpoint has one: requests with images are refused.
    #[arg(long)]
    pub no_vision: bool,
}

/// Where the model runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Device {
    Cpu,
    Cuda,
}

/// A model's config, tokenizer and template (weights not loaded).
pub struct TextModel {
    pub dir: PathBuf,
    pub config: ModelConfig,
    pub tokenizer: Option<Tokenizer>,
    pub template: Option<ChatTemplate>,
}

impl ModelArgs {
    /// The backend `--device` selects (`auto`: cuda when its libraries are present).
    pub fn device(&self) -> Result<Device> {
        match self.device.as_str() {
            "cpu" => Ok(Device::Cpu),
            "cuda" => {
                deltaserve_cuda::LibStatus::probe().require_all().context("--device cuda")?;
                Ok(Device::Cuda)
            }
            "auto" => Ok(crate::device::auto()),
            other => bail!("unknown --device `{other}` (expected cpu, cuda or auto)"),
        }
    }

    /// The model directory: `--model`, a `--preset` (config and tokenizer only, for
    /// `--random-weights`), or the built-in demo model (created on first use).
    pub fn dir(&self) -> Result<PathBuf> {
        if let Some(name) = &self.preset {
            let preset = deltaserve_model::synth::Preset::parse(name)?;
            let layers = self.preset_layers.map_or(String::new(), |l| format!("-{l}l"));
            let dir = deltaserve_text::synth_model::cache_dir().join(format!("preset-{name}{layers}-v1"));
            if !dir.join("config.json").exists() {
                deltaserve_text::synth_model::write_synthetic_config(&dir, preset, self.preset_layers)?;
            }
            return Ok(dir);
        }
        match &self.model {
            Some(d) => crate::hub::resolve(d, crate::hub::Need::Model),
            None => {
                let dir = deltaserve_text::synth_model::demo_model_dir().context("creating the built-in demo model")?;
                tracing::warn!(
                    "no --model given: using the built-in demo model (tiny preset, RANDOM weights, its output is gibberish) at {}. \
                     To serve a real model pass --model Qwen/Qwen3.6-27B (a Hugging Face id, downloaded on first use) \
                     or --model DIR (a local directory with config.json, *.safetensors and tokenizer.json).",
                    dir.display()
                );
                Ok(dir)
            }
        }
    }

    /// Loads the weights of `text` (from [`ModelArgs::load_text`]) in f32 for the CPU reference backend.
    pub fn load_weights(&self, text: &TextModel) -> Result<CpuModel> {
        if self.random_weights {
            bail!("--random-weights initialises weights on the GPU: use it with --device cuda");
        }
        load_weights(text, !self.no_vision)
    }

    /// Config, tokenizer and chat template of `dir`, without the weights (the CUDA backend loads
    /// the weights itself, straight into device memory).
    pub fn load_text(&self, dir: &Path) -> Result<TextModel> {
        if !dir.is_dir() {
            bail!("model directory {} does not exist", dir.display());
        }
        let config = ModelConfig::from_dir(dir)?;
        let tok_path = dir.join("tokenizer.json");
        let tokenizer = if tok_path.exists() { Some(Tokenizer::from_file(&tok_path)?) } else { None };
        Ok(TextModel { dir: dir.to_path_buf(), config, tokenizer, template: ChatTemplate::from_dir(dir)? })
    }
}

fn load_weights(text: &TextModel, vision: bool) -> Result<CpuModel> {
    let TextModel { dir, config, tokenizer, .. } = text;
    let ckpt = Checkpoint::open(dir)?;
    let weights = ModelWeights::load_f32(&ckpt, config)?;
    let vision = if vision { VisionWeights::load_f32(&ckpt, config)? } else { None };
    tracing::info!(
        model = %dir.display(),
        layers = config.layer_types.len(),
        hidden = config.hidden_size,
        vocab = config.vocab_size,
        tokenizer = tokenizer.is_some(),
        vision_tower = vision.is_some(),
        quantization = config.quantization.as_ref().map_or("none".to_string(), |q| q.describe() + ", dequantised to f32"),
        "model loaded on the CPU reference backend"
    );
    Ok(CpuModel::new(config.clone(), weights).with_vision(vision))
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

/// The int4 storage a GPTQ checkpoint implies on CUDA: `Some(asymmetric)` for a GPTQ checkpoint (an
/// error if the flags ask for other weights), `None` otherwise.
pub fn gptq_int4(cfg: &ModelConfig, weights_dtype: Option<WeightsDtype>, quantize: bool) -> Result<Option<bool>> {
    let Some(Quantization::Gptq(g)) = &cfg.quantization else {
        return Ok(None);
    };
    if weights_dtype.is_some_and(|w| w != WeightsDtype::Int4) || quantize {
        bail!("this checkpoint is GPTQ-quantised (int4 by itself): --weights-dtype / --quantize do not apply");
    }
    Ok(Some(!g.params.sym))
}

/// The most patches the vision tower runs at once (what the plan sizes its workspace for; a larger image is
/// refused): `--max-image-tokens-per-step`, else the larger of 4096 and the patches of one image at the
/// pixel budget of `dir`'s `preprocessor_config.json` (Qwen3.5's when missing or unreadable: 65,536).
pub fn max_image_tokens_per_step(flag: Option<usize>, dir: Option<&Path>) -> usize {
    if let Some(n) = flag {
        return n;
    }
    let processor = match dir.map(ImageProcessorConfig::for_model_dir) {
        Some(Ok(p)) => p,
        Some(Err(e)) => {
            tracing::warn!("{e}: the vision tower's bound assumes Qwen3.5's image processor");
            ImageProcessorConfig::qwen35()
        }
        None => ImageProcessorConfig::qwen35(),
    };
    deltaserve_plan::default_max_image_tokens(processor.max_pixels, processor.patch_size)
}

/// The CUDA backend a plan of `opts` is for. `checkpoint`: the model directory when the weights come
/// from it (not random weights); a quantised one stored int4 is walked once for what its tensors
/// need beyond the plan's weights region (under tensor parallelism rank 0's shard, the largest).
pub fn cuda_plan_backend(cfg: &ModelConfig, checkpoint: Option<&Path>, opts: &PlanOptions) -> Result<PlanBackend> {
    let tp = opts.tensor_parallel;
    let rank0 = (tp > 1).then(|| ShardSpec::new(cfg, 0, tp)).transpose()?;
    // A Hub snapshot whose weights are not downloaded yet has no tensors to walk.
    let quantized = checkpoint.filter(|dir| {
        cfg.quantization.is_some()
            && matches!(opts.weights_dtype, WeightsDtype::Int4 | WeightsDtype::Fp8Block)
            && crate::hub::has_weights(dir)
    });
    let checkpoint = quantized.and_then(|dir| match CheckpointTensors::walk(cfg, dir, rank0.as_ref()) {
        Ok(t) => Some(Arc::new(t)),
        Err(e) => {
            tracing::warn!("sizing the checkpoint's quantised weights: {e}");
            None
        }
    });
    Ok(PlanBackend::Cuda { checkpoint })
}
