//! Engine and memory-plan options shared by the commands that run a backend (`serve`, `generate`,
//! `logits`, `eval kld`, the in-process server of `soak` and `probe`), and the start-up that turns them
//! into a plan, a backend and a running engine.

use std::path::Path;
use std::sync::Arc;

use anyhow::{Context, Result};
use deltaserve_backend::Backend;
use deltaserve_cpu::{CpuBackend, CpuCacheConfig, KvFormat};
use deltaserve_cuda::backend::CudaOptions;
use deltaserve_cuda::{CudaBackend, TpBackend, WeightSource};
use deltaserve_engine::{EngineHandle, EngineOptions};
use deltaserve_model::ModelConfig;
use deltaserve_model::quant::Quantization;
use deltaserve_plan::{Free, KvDtype, Plan, PlanOptions, WeightsDtype, fit_context, fmt_bytes, parse_size};
use deltaserve_sched::{PrefixCacheConfig, SchedConfig};
use deltaserve_server::{AppState, ServerConfig};
use deltaserve_text::{ChatTemplate, Tokenizer};

use crate::model_source::{Device, ModelArgs, TextModel};

#[derive(clap::Args, Clone, Debug)]
pub struct EngineArgs {
    /// Memory budget of the backend arena (e.g. 24GiB). CPU default: 2GiB of host memory; CUDA default:
    /// 95% of the GPU's free memory.
    #[arg(long)]
    pub memory: Option<String>,
    /// CUDA backend: the memory budget as a fraction F (0 < F <= 1) of the GPU's total memory (the
    /// budget --memory gives in bytes).
    #[arg(long, value_name = "F", conflicts_with = "memory", value_parser = parse_fraction)]
    pub gpu_memory_utilization: Option<f64>,
    /// Tokens per engine step (prefill chunks + decode tokens).
    #[arg(long)]
    pub max_batch_tokens: Option<usize>,
    /// Sequences in flight at once (DeltaNet state slots).
    #[arg(long)]
    pub max_seqs: Option<usize>,
    /// Advertised context (default: the most that fits, capped by the model).
    #[arg(long, short = 'c', visible_aliases = ["max-model-len", "ctx-size"])]
    pub max_context: Option<usize>,
    /// Tokens per KV page.
    #[arg(long, default_value_t = 32)]
    pub page_size: usize,
    /// Requests that may wait for admission before new ones get "overloaded" (HTTP 429).
    #[arg(long, default_value_t = 256)]
    pub max_waiting: usize,
    /// KV cache storage of K and V: bf16, fp16, fp32, fp8 (e4m3 + per-token-head fp16 scale), int8 or int4
    /// (+ scale). The CPU reference backend keeps f32 pages holding exactly the values of that format.
    /// Default: fp32 on the CPU backend.
    #[arg(long)]
    pub kv_cache_dtype: Option<String>,
    /// K cache storage (overrides --kv-cache-dtype for K).
    #[arg(long)]
    pub k_cache_dtype: Option<String>,
    /// V cache storage (overrides --kv-cache-dtype for V).
    #[arg(long)]
    pub v_cache_dtype: Option<String>,
    /// DeltaNet state snapshots kept in the backend's memory plan (the prefix cache's first tier).
    #[arg(long)]
    pub snapshot_slots: Option<usize>,
    /// Host memory for more snapshots (the second tier; restoring from it is a copy): a size, or `auto`
    /// (4 snapshots per sequence the plan serves, from 512 MiB up to a quarter of the available host memory and 16 GiB).
    #[arg(long, default_value = "auto")]
    pub snapshot_host_memory: String,
    /// During long prefills, also snapshot every this many tokens (0: never).
    #[arg(long, default_value_t = 4096)]
    pub snapshot_interval: usize,
    /// Disable the prefix cache (KV pages + DeltaNet state snapshots).
    #[arg(long)]
    pub no_prefix_cache: bool,
    /// CUDA backend: launch decode steps eagerly instead of replaying CUDA graphs.
    #[arg(long)]
    pub no_cuda_graphs: bool,
    /// Step one at a time: do not launch a decode step before the previous step's tokens are read (by
    /// default the next step is launched first and fed those tokens on the device, for requests without
    /// penalties, stop strings or logprobs).
    #[arg(long)]
    pub no_lookahead: bool,
    /// CUDA backend: the most split-K partitions a decode row's attention uses (one per 128 keys of its
    /// context, up to this; 1..=128, default 32). More helps long contexts at small batches.
    #[arg(long)]
    pub decode_partitions: Option<usize>,
    /// Speculative decoding with the model's MTP head: draft K (1..4) tokens per decode step and verify
    /// them in one forward (greedy outputs are unchanged up to bf16 ties on CUDA; sampling keeps its
    /// distribution). Needs a checkpoint with `mtp.*` tensors; on CUDA not yet with --tensor-parallel.
    #[arg(long)]
    pub speculative_tokens: Option<usize>,
    /// CUDA backend: tensor parallelism, one model split over GPUs 0..N (N = 1, 2, 4 or 8; it must
    /// divide the attention kv heads and the DeltaNet key heads). --memory is then per card (default:
    /// the smallest card's free memory); `deltaserve plan --tensor-parallel N` shows the per-card plan.
    /// vLLM's `-tp N` is accepted too.
    #[arg(long, visible_alias = "tensor-parallel-size", default_value_t = 1)]
    pub tensor_parallel: usize,
    /// CUDA backend: storage of the decoder linears, bf16, int4 (group 128) or fp8 (e4m3 in 128×128
    /// scale blocks, as the official `-FP8` checkpoints; Ada / Hopper GPUs). int4 or fp8 with a bf16
    /// checkpoint quantises it at load (as --quantize); with --random-weights, random codes at the real
    /// shapes. A GPTQ / AutoRound checkpoint is int4 by itself; a block-FP8 checkpoint stays fp8 where
    /// the GPU has FP8 tensor cores (`bf16` dequantises it).
    #[arg(long)]
    pub weights_dtype: Option<String>,
    /// CUDA backend: quantise a bf16 checkpoint's decoder linears at load, on the GPU (int4: round to
    /// nearest, group 128, fp16 scales, symmetric unless --int4-asym; fp8: e4m3, one f32 scale per
    /// 128×128 block, sm_89 or later).
    #[arg(long, value_name = "int4|fp8")]
    pub quantize: Option<String>,
    /// int4 weights with zero points (asymmetric) when quantising at load or for random weights.
    #[arg(long)]
    pub int4_asym: bool,
    /// CUDA backend: store lm_head in int4 (logits through the int4 GEMV). Default: the planner may
    /// choose it when int4 weights do not reach the full context otherwise.
    #[arg(long)]
    pub lm_head_int4: bool,
    /// CUDA backend: keep the embedding table in pinned host memory (a step uploads its rows).
    /// Default: the planner may choose it when the full context does not fit otherwise.
    #[arg(long)]
    pub embed_on_host: bool,
    /// CUDA backend, mixture-of-experts models: keep the routed experts in pinned host memory, mapped for
    /// the GPU, which reads the experts each token picks across PCIe (slower decode, far less GPU
    /// memory). Default: the planner chooses it when nothing else comes near the full context.
    #[arg(long)]
    pub experts_on_host: bool,
    /// The most patches (vision-tower tokens; 4 make one prompt image token) of one image: the plan sizes
    /// the tower's activation workspace for this many, and a request with a larger image gets a 400.
    /// Default: the larger of 4096 and one image at the pixel budget of preprocessor_config.json (65,536
    /// for Qwen3.5/3.6). Only where the backend runs the tower (CPU, or CUDA on one card; not with
    /// --no-vision). Given, the CUDA plan keeps the tower even where the full context would trade it away.
    #[arg(long, value_name = "N")]
    pub max_image_tokens_per_step: Option<usize>,
}

impl EngineArgs {
    fn engine_options(&self, speculative_tokens: usize, plan: &Plan) -> EngineOptions {
        EngineOptions {
            speculative_tokens,
            lookahead: !self.no_lookahead,
            // No tower priced: none is loaded either, and images are refused whatever their size.
            max_image_tokens_per_step: plan.options.max_image_tokens_per_step.unwrap_or(usize::MAX),
        }
    }

    /// `--tensor-parallel` on the CPU reference: only 1 (it simulates the sharded forward in its
    /// tests, it does not serve sharded).
    fn check_cpu_tensor_parallel(&self) -> Result<()> {
        match self.tensor_parallel {
            1 => Ok(()),
            n => anyhow::bail!(
                "--tensor-parallel {n}: the CPU reference backend does not shard the model (tensor parallelism \
                 runs on the CUDA backend: --device cuda)"
            ),
        }
    }

    /// Drafts per decode step (0: off); `--speculative-tokens` must be 1..=4.
    fn speculative_tokens(&self) -> Result<usize> {
        match self.speculative_tokens {
            None => Ok(0),
            Some(k) if (1..=deltaserve_engine::MAX_SPECULATIVE_TOKENS).contains(&k) => Ok(k),
            Some(k) => anyhow::bail!(
                "--speculative-tokens {k}: must be 1..={} (drafts per decode step)",
                deltaserve_engine::MAX_SPECULATIVE_TOKENS
            ),
        }
    }

    /// (K, V) storage from `--kv-cache-dtype` and the per-tensor overrides; None where unset.
    fn kv_dtypes(&self) -> Result<(Option<KvDtype>, Option<KvDtype>)> {
        let parse = |flag: &str, v: &Option<String>| -> Result<Option<KvDtype>> {
            v.as_deref().map(|s| s.parse::<KvDtype>().map_err(|e| anyhow::anyhow!("--{flag}: {e}"))).transpose()
        };
        let both = parse("kv-cache-dtype", &self.kv_cache_dtype)?;
        let k = parse("k-cache-dtype", &self.k_cache_dtype)?.or(both);
        let v = parse("v-cache-dtype", &self.v_cache_dtype)?.or(both);
        Ok((k, v))
    }

    /// The two snapshot tiers: the plan's device pool and `--snapshot-host-memory` on the host.
    fn prefix_cache(&self, plan: &Plan) -> Result<PrefixCacheConfig> {
        if self.no_prefix_cache || plan.options.snapshot_slots == 0 {
            return Ok(PrefixCacheConfig::disabled(plan.page_size));
        }
        let snapshot = plan.state_bytes_per_seq.max(1);
        let host = match self.snapshot_host_memory.trim() {
            "auto" => {
                // What the plan pins for its host weights (embedding, routed experts) is not the pool's.
                let pinned = plan.host_weights_bytes;
                let avail = crate::host_memory::Available::now()
                    .map(|a| crate::host_memory::Available { bytes: a.bytes.saturating_sub(pinned), ..a });
                let bytes = crate::host_memory::auto_snapshot_bytes(snapshot, plan.max_seqs, avail);
                tracing::info!(
                    pool = %fmt_bytes(bytes),
                    snapshots = bytes / snapshot,
                    sequences = plan.max_seqs,
                    "host snapshot pool (--snapshot-host-memory auto)"
                );
                bytes
            }
            s => {
                let bytes = parse_size(s).map_err(|e| anyhow::anyhow!("--snapshot-host-memory: {e}"))?;
                if bytes / snapshot < plan.max_seqs as u64 {
                    tracing::warn!(
                        "--snapshot-host-memory {s} holds {} snapshots of {} for {} sequences: sessions beyond that \
                         re-prefill their context on their next turn (auto sizes it for the sequences)",
                        bytes / snapshot,
                        fmt_bytes(snapshot),
                        plan.max_seqs
                    );
                }
                bytes
            }
        };
        Ok(PrefixCacheConfig {
            device_slots: plan.options.snapshot_slots,
            host_slots: (host / snapshot) as usize,
            page_size: plan.page_size,
            snapshot_bytes: plan.state_bytes_per_seq,
            page_bytes: plan.kv_page_bytes(),
        })
    }
}

/// A backend built from the flags and the plan that sized it, before an engine drives it.
pub struct Built {
    pub backend: Box<dyn Backend>,
    pub plan: Plan,
    pub sched: SchedConfig,
    pub tokenizer: Option<Arc<Tokenizer>>,
    pub template: Option<Arc<ChatTemplate>>,
    /// Token ids that end generation.
    pub eos_ids: Vec<u32>,
    /// Drafts per decode step (`--speculative-tokens`, 0: off).
    speculative_tokens: usize,
}

impl Built {
    /// Every position's logits of `tokens` run as one sequence (state slot 0, the first KV pages):
    /// `each(i, row)` gets the row after position `i`.
    pub fn logits_at_every_position(&mut self, tokens: &[u32], each: impl FnMut(usize, &[f32])) -> Result<()> {
        self.logits_with_images(tokens, &[], each)
    }

    /// [`Built::logits_at_every_position`] of a prompt whose image placeholder runs hold `images`.
    pub fn logits_with_images(
        &mut self,
        tokens: &[u32],
        images: &[Arc<deltaserve_model::ImagePatches>],
        each: impl FnMut(usize, &[f32]),
    ) -> Result<()> {
        let plan = &self.plan;
        if tokens.len() > plan.max_context {
            anyhow::bail!(
                "{} tokens exceed the memory plan's context of {} (raise --memory or --max-context)",
                tokens.len(),
                plan.max_context
            );
        }
        let pages: Vec<u32> = (0..tokens.len().div_ceil(plan.page_size) as u32).collect();
        deltaserve_engine::logits_with_images(&mut *self.backend, 0, &pages, tokens, images, each)?;
        Ok(())
    }
}

/// A model checked and planned, its weights not read yet ([`EngineArgs::prepare`]).
pub struct Prepared {
    device: Device,
    text: TextModel,
    plan: Plan,
    sched: SchedConfig,
    speculative_tokens: usize,
    /// The KV pages the CPU backend allocates (fewer than the plan's when scoring one sequence).
    cpu_pages: usize,
}

impl Prepared {
    /// The model's tokenizer (None: no tokenizer.json).
    pub fn tokenizer(&self) -> Option<&Tokenizer> {
        self.text.tokenizer.as_ref()
    }
}

/// A running engine and the plan it was built from.
pub struct Started {
    pub engine: EngineHandle,
    /// The backend it runs on.
    pub device: Device,
    pub plan: Plan,
    pub tokenizer: Option<Arc<Tokenizer>>,
    pub template: Option<Arc<ChatTemplate>>,
    /// Token ids that end generation.
    pub eos_ids: Vec<u32>,
}

impl Started {
    /// The HTTP server's state over this engine.
    pub fn app_state(
        &self,
        name: &str,
        api_key: Option<String>,
        max_body_bytes: usize,
        model_dir: &std::path::Path,
    ) -> Result<AppState> {
        let tokenizer = self.tokenizer.clone().context("serving needs a tokenizer.json in the model directory")?;
        Ok(AppState {
            grammars: Default::default(),
            engine: self.engine.clone(),
            prompt_encoder: deltaserve_server::state::prompt_encoder(&tokenizer),
            tokenizer,
            template: self.template.clone(),
            metrics: Arc::new(Default::default()),
            cfg: Arc::new(ServerConfig {
                served_model_name: name.to_string(),
                api_key: api_key_or_none(api_key),
                max_body_bytes,
            }),
            eos_ids: self.eos_ids.clone(),
            sampling_defaults: deltaserve_server::state::sampling_defaults(model_dir),
            media: Arc::new(deltaserve_server::media::MediaConfig::for_model_dir(model_dir)?),
        })
    }
}

impl EngineArgs {
    /// The plan options: the backend's defaults with the command-line overrides.
    fn plan_options(&self, device: Device) -> Result<PlanOptions> {
        let mut opts = match device {
            Device::Cpu => PlanOptions::cpu_defaults(0),
            Device::Cuda => PlanOptions::gpu_defaults(0),
        };
        opts.budget_bytes = match device {
            Device::Cpu if self.gpu_memory_utilization.is_some() => anyhow::bail!(
                "--gpu-memory-utilization: a fraction of a GPU's memory; the CPU backend takes --memory (default 2GiB)"
            ),
            Device::Cpu => {
                parse_size(self.memory.as_deref().unwrap_or("2GiB")).map_err(|e| anyhow::anyhow!("--memory: {e}"))?
            }
            Device::Cuda => {
                // Under tensor parallelism the smallest card's memory.
                let (mut free, mut total) = (u64::MAX, u64::MAX);
                for gpu in 0..self.tensor_parallel.max(1) {
                    let (f, t) = deltaserve_cuda::Runtime::open(gpu)?.memory_info()?;
                    (free, total) = (free.min(f), total.min(t));
                }
                let card = crate::gpu_budget::GpuMemory { free, total, reserve: opts.runtime_reserve_bytes };
                card.budget(self.memory.as_deref(), self.gpu_memory_utilization)?
            }
        };
        if let Some(v) = self.max_batch_tokens {
            opts.max_batch_tokens = v;
        }
        if let Some(v) = self.max_seqs {
            opts.max_seqs = v;
        }
        opts.max_context = self.max_context;
        if let Some(v) = self.snapshot_slots {
            opts.snapshot_slots = v;
        }
        if self.no_prefix_cache {
            opts.snapshot_slots = 0;
        }
        opts.page_size = self.page_size;
        let (k_dtype, v_dtype) = self.kv_dtypes()?;
        opts.k_dtype = k_dtype.unwrap_or(opts.k_dtype);
        opts.v_dtype = v_dtype.unwrap_or(opts.v_dtype);
        opts.speculative_tokens = self.speculative_tokens()?;
        if let Some(n) = self.decode_partitions {
            opts.decode_partitions = n; // the plan checks the range
        }
        Ok(opts)
    }

    /// The options the planner may trade to reach the full context: those not set on the command line.
    fn free(&self) -> Free {
        Free {
            max_seqs: self.max_seqs.is_none(),
            snapshot_slots: self.snapshot_slots.is_none() && !self.no_prefix_cache,
            embed_on_host: false,
            lm_head_int4: false,
            vision: false,
            experts_on_host: false,
        }
    }

    /// The CUDA weight storage of the decoder linears (and int4's asymmetry) from --weights-dtype /
    /// --quantize, the checkpoint's quantization_config and the GPU: a block-FP8 checkpoint stays FP8
    /// on sm_89 and later (FP8 tensor cores), and is dequantised to bf16 before that.
    fn cuda_weights(&self, cfg: &ModelConfig, random_weights: bool, tp: usize) -> Result<(WeightsDtype, bool)> {
        let flag = match self.weights_dtype.as_deref() {
            None => None,
            Some(w) => match w.parse::<WeightsDtype>().map_err(|e| anyhow::anyhow!("--weights-dtype: {e}"))? {
                w @ (WeightsDtype::Bf16 | WeightsDtype::Int4 | WeightsDtype::Fp8Block) => Some(w),
                other => anyhow::bail!("--weights-dtype {other}: the CUDA backend stores weights in bf16, int4 or fp8"),
            },
        };
        let quantize = match self.quantize.as_deref() {
            None => None,
            Some(q @ ("int4" | "fp8")) if random_weights => {
                anyhow::bail!("--quantize {q} quantises a checkpoint; with --random-weights use --weights-dtype {q}")
            }
            Some("int4") => Some(WeightsDtype::Int4),
            Some("fp8") => Some(WeightsDtype::Fp8Block),
            Some(other) => anyhow::bail!("--quantize {other}: int4 or fp8"),
        };
        if let (Some(f), Some(q)) = (flag, quantize)
            && f != q
        {
            anyhow::bail!("--weights-dtype {f} and --quantize {q} disagree");
        }
        if !random_weights {
            let int4 = (flag == Some(WeightsDtype::Int4) || quantize == Some(WeightsDtype::Int4))
                .then_some(WeightsDtype::Int4);
            let wd = flag.filter(|w| *w != WeightsDtype::Int4).or(int4);
            if let Some(asym) = crate::model_source::gptq_int4(cfg, wd, quantize.is_some())? {
                return Ok((WeightsDtype::Int4, asym || self.int4_asym));
            }
        }
        let fp8_block = match &cfg.quantization {
            Some(Quantization::Fp8Block(c)) if !random_weights => Some(c.block),
            _ => None,
        };
        let cc = || -> Result<(i32, i32)> { Ok(deltaserve_cuda::Runtime::open(0)?.cc) };
        let wanted = quantize.or(flag);
        let dtype = match (wanted, fp8_block) {
            (Some(WeightsDtype::Fp8Block), _) => {
                let (major, minor) = cc()?;
                if (major, minor) < (8, 9) {
                    anyhow::bail!(
                        "fp8 weights: FP8 tensor cores need an Ada or Hopper GPU (sm_89 or later); this one is \
                         sm_{major}{minor}: use --weights-dtype bf16 or int4"
                    );
                }
                if let Some(b) = fp8_block.filter(|b| *b != [128, 128]) {
                    anyhow::bail!(
                        "fp8 weights: this checkpoint's FP8 scale blocks are {}x{}; the CUDA backend reads 128x128 \
                         blocks (--weights-dtype bf16 dequantises it)",
                        b[0],
                        b[1]
                    );
                }
                if tp > 1 {
                    anyhow::bail!("fp8 weights: not supported with --tensor-parallel yet (use bf16 or int4)");
                }
                WeightsDtype::Fp8Block
            }
            (Some(w), _) => w,
            (None, Some(block)) => {
                let (major, minor) = cc()?;
                let why = if (major, minor) < (8, 9) {
                    Some(format!("this GPU (sm_{major}{minor}) has no FP8 tensor cores"))
                } else if block != [128, 128] {
                    Some(format!("its {}x{} scale blocks are not the 128x128 the kernels read", block[0], block[1]))
                } else if tp > 1 {
                    Some("tensor parallelism takes bf16 or int4 weights".to_string())
                } else if cfg.moe.is_some() {
                    Some("mixture-of-experts models take bf16 or int4 weights on CUDA".to_string())
                } else {
                    None
                };
                match why {
                    Some(why) => {
                        tracing::warn!("block-FP8 checkpoint dequantised to bf16: {why} (--quantize int4 for int4)");
                        WeightsDtype::Bf16
                    }
                    None => {
                        tracing::info!("block-FP8 checkpoint kept in FP8 (e4m3 weights, FP8 tensor cores)");
                        WeightsDtype::Fp8Block
                    }
                }
            }
            (None, None) => WeightsDtype::Bf16,
        };
        Ok((dtype, self.int4_asym))
    }

    /// The plan for the full context (or `--max-context`), logging what the planner traded for it.
    fn fit(&self, cfg: &ModelConfig, opts: &PlanOptions, free: Free) -> Result<Plan> {
        let fitted = fit_context(cfg, opts, free).context("the memory plan does not fit")?;
        if !fitted.adjustments.is_empty() && fitted.shortfall.is_none() {
            tracing::info!(
                "memory plan: to fill the full context ({} tokens) the planner set {}",
                fitted.target_context,
                fitted.adjustments.join(", ")
            );
        }
        if let Some(why) = &fitted.shortfall {
            tracing::warn!("memory plan: {why}");
        }
        Ok(fitted.plan)
    }

    fn sched_config(&self, plan: &Plan) -> Result<SchedConfig> {
        Ok(SchedConfig {
            max_batch_tokens: plan.max_batch_tokens,
            max_seqs: plan.max_seqs,
            page_size: plan.page_size,
            num_pages: plan.num_kv_pages,
            max_context: plan.max_context,
            max_waiting: self.max_waiting,
            prefix_cache: self.prefix_cache(plan)?,
            snapshot_interval: self.snapshot_interval,
        })
    }

    /// Loads the model in `dir` (from [`ModelArgs::dir`]) for the device `--device` selects, plans
    /// memory, allocates the backend's arena and starts the engine.
    pub fn start(&self, model: &ModelArgs, dir: &Path) -> Result<Started> {
        self.start_prepared(model, self.prepare(model, dir, None)?)
    }

    /// [`EngineArgs::start`] from a model [`EngineArgs::prepare`] has checked and planned.
    pub fn start_prepared(&self, model: &ModelArgs, prepared: Prepared) -> Result<Started> {
        let device = prepared.device;
        let built = self.load(model, prepared)?;
        let engine = EngineHandle::start_with(
            built.backend,
            built.sched,
            built.tokenizer.clone(),
            self.engine_options(built.speculative_tokens, &built.plan),
        )
        .context("--speculative-tokens")?;
        Ok(Started {
            engine,
            device,
            plan: built.plan,
            tokenizer: built.tokenizer,
            template: built.template,
            eos_ids: built.eos_ids,
        })
    }

    /// Loads the model in `dir` (from [`ModelArgs::dir`]) for the device `--device` selects, plans memory
    /// and allocates the backend's arena for one sequence of `positions` tokens
    /// ([`Built::logits_at_every_position`]): everything [`EngineArgs::start`] does but the engine. The
    /// CPU backend's arena then holds only the KV pages that sequence needs (its pages emulate every KV
    /// format in f32, so the plan's pages can take several times `--memory`).
    pub fn build_to_score(&self, model: &ModelArgs, dir: &Path, positions: usize) -> Result<Built> {
        self.load(model, self.prepare(model, dir, Some(positions))?)
    }

    /// Everything that can be checked before a weight is read: the device (and its libraries), the
    /// config, tokenizer and chat template, the flags, and the memory plan against the memory there is
    /// (the GPU's free memory; on the CPU the host's available memory). `positions`: as in
    /// [`EngineArgs::build_to_score`].
    pub fn prepare(&self, model: &ModelArgs, dir: &Path, positions: Option<usize>) -> Result<Prepared> {
        let device = model.device()?;
        let text = model.load_text(dir)?;
        match device {
            Device::Cpu => self.prepare_cpu(text, positions, model.no_vision),
            Device::Cuda => self.prepare_cuda(text, model.random_weights, model.no_vision),
        }
    }

    /// Reads the weights of a prepared model and allocates its backend.
    fn load(&self, model: &ModelArgs, p: Prepared) -> Result<Built> {
        let backend: Box<dyn Backend> = match p.device {
            Device::Cpu => Box::new(self.load_cpu(model, &p)?),
            Device::Cuda => self.load_cuda(&p, model.random_weights)?,
        };
        let Prepared { text, plan, sched, speculative_tokens, .. } = p;
        Ok(Built {
            backend,
            plan,
            sched,
            eos_ids: text.config.eos_token_ids.clone(),
            tokenizer: text.tokenizer.map(Arc::new),
            template: text.template.map(Arc::new),
            speculative_tokens,
        })
    }

    /// A copy of these options storing K as `k` and V as `v` (what `--k-cache-dtype` / `--v-cache-dtype`
    /// give).
    pub fn with_kv_dtypes(&self, k: KvDtype, v: KvDtype) -> Self {
        Self { k_cache_dtype: Some(k.to_string()), v_cache_dtype: Some(v.to_string()), ..self.clone() }
    }

    /// A copy of these options storing the decoder linears as `w` (what `--weights-dtype` gives: `int4` or
    /// `fp8` with a bf16 checkpoint quantises it at load, `bf16` with a block-FP8 checkpoint dequantises it);
    /// `None` keeps the command line's choice.
    pub fn with_weights_dtype(&self, w: Option<WeightsDtype>) -> Self {
        match w {
            Some(w) => Self { weights_dtype: Some(w.to_string()), ..self.clone() },
            None => self.clone(),
        }
    }

    /// Builds the backend of a model [`EngineArgs::prepare`] has checked and planned (the plan's `positions`
    /// as given there): [`EngineArgs::build_to_score`] in two halves, so that every configuration can be
    /// checked before any weight is read.
    pub fn build_prepared(&self, model: &ModelArgs, prepared: Prepared) -> Result<Built> {
        self.load(model, prepared)
    }

    /// The CUDA backend's checks and plan (against the GPU's free memory).
    fn prepare_cuda(&self, text: TextModel, random_weights: bool, no_vision: bool) -> Result<Prepared> {
        CudaBackend::check_model(&text.config)?;
        let tp = self.tensor_parallel;
        // The model's vision tower on the GPU: priced in the plan, loaded by the backend; one card only.
        // The fit may leave it out for context unless the user asked for images (--max-image-tokens-per-step).
        let asked = self.max_image_tokens_per_step.is_some();
        let mut vision = !no_vision && text.config.vision.is_some();
        if vision && tp > 1 {
            if asked {
                anyhow::bail!(
                    "--max-image-tokens-per-step: the GPU vision tower does not run with --tensor-parallel {tp}"
                );
            }
            tracing::warn!(
                "--tensor-parallel {tp}: the GPU vision tower runs on one card only; requests with images are refused"
            );
            vision = false;
        }
        if !vision && asked {
            tracing::warn!("--max-image-tokens-per-step: ignored, no vision tower is loaded (images are refused)");
        }
        deltaserve_model::shard::check_world(&text.config, tp)
            .map_err(|e| anyhow::anyhow!("--tensor-parallel {tp}: {e}"))?;
        if tp > 1 {
            let n = deltaserve_cuda::device_count()?;
            if n < tp {
                anyhow::bail!("--tensor-parallel {tp} needs {tp} GPUs; the driver reports {n} (CUDA_VISIBLE_DEVICES?)");
            }
        }
        let spec = self.speculative_tokens()?;
        if spec > 0 {
            if tp > 1 {
                anyhow::bail!("--speculative-tokens: not supported with --tensor-parallel yet");
            }
            if text.config.mtp_num_hidden_layers == 0 {
                anyhow::bail!("--speculative-tokens {spec}: this model has no MTP head (`mtp_num_hidden_layers` is 0)");
            }
        }
        let mut opts = self.plan_options(Device::Cuda)?;
        // The CUDA KV cache stores bf16, fp8, int8 or int4 (K and V independently); refuse the
        // others before planning and loading.
        deltaserve_cuda::KvFormats { k: opts.k_dtype, v: opts.v_dtype }
            .validate()
            .map_err(|e| anyhow::anyhow!("--kv-cache-dtype / --k-cache-dtype / --v-cache-dtype: {e}"))?;
        let cfg = &text.config;
        opts.set_tensor_parallel(tp);
        let (weights_dtype, asym) = self.cuda_weights(cfg, random_weights, tp)?;
        opts.weights_dtype = weights_dtype;
        opts.int4_asym = asym;
        opts.lm_head_int4 = self.lm_head_int4;
        opts.embed_on_host = self.embed_on_host;
        opts.experts_on_host = self.experts_on_host;
        if self.experts_on_host && text.config.moe.is_none() {
            anyhow::bail!("--experts-on-host: this model has no routed experts (its MLPs are dense)");
        }
        opts.max_image_tokens_per_step = vision
            .then(|| crate::model_source::max_image_tokens_per_step(self.max_image_tokens_per_step, Some(&text.dir)));
        // A GPTQ checkpoint may keep some linears bf16 or need act-order permutations: the plan adds
        // what its weights need beyond the weights region to the backend scratch (the backend takes it there).
        let checkpoint = (!random_weights).then_some(text.dir.as_path());
        opts.backend = crate::model_source::cuda_plan_backend(cfg, checkpoint, &opts)?;
        // The fit may move the embedding to host memory (the MTP head reads its rows from there too).
        let free = Free {
            embed_on_host: !self.embed_on_host,
            lm_head_int4: !self.lm_head_int4,
            vision: !asked,
            experts_on_host: !self.experts_on_host && tp == 1,
            ..self.free()
        };
        let plan = self.fit(cfg, &opts, free)?;
        // The pinned experts, against the host memory the process may still take (before any is read).
        let host_experts = plan.weight_parts.host_experts();
        if host_experts > 0 {
            let avail = crate::host_memory::Available::now();
            let lower = "free host memory, or store the experts in fewer bytes (--weights-dtype int4)";
            crate::host_memory::check("--experts-on-host", host_experts, avail, lower)?;
            tracing::info!(
                "routed experts in pinned host memory: {} (each token reads {} of them across the bus)",
                fmt_bytes(host_experts),
                fmt_bytes(plan.weight_parts.experts_active)
            );
        }
        let sched = self.sched_config(&plan)?;
        let cpu_pages = plan.num_kv_pages;
        Ok(Prepared { device: Device::Cuda, text, plan, sched, speculative_tokens: spec, cpu_pages })
    }

    /// The CUDA backend: weights from the checkpoint (or random at the real shapes) straight into
    /// the plan's device regions.
    fn load_cuda(&self, p: &Prepared, random_weights: bool) -> Result<Box<dyn Backend>> {
        let cfg = &p.text.config;
        let weights = if random_weights {
            tracing::warn!("--random-weights: initialising the weights at random on the GPU (benchmarks only)");
            WeightSource::RandomWeights { seed: 0 }
        } else {
            if let Some(q) = &cfg.quantization {
                tracing::info!(quantization = %q.describe(), "checkpoint quantisation (converted to the device format at load)");
            }
            WeightSource::Checkpoint(p.text.dir.clone())
        };
        let cuda_opts = cuda_options(!self.no_cuda_graphs);
        let host_slots = p.sched.prefix_cache.host_slots;
        Ok(if self.tensor_parallel > 1 {
            Box::new(TpBackend::new(cfg, weights, &p.plan, host_slots, cuda_opts)?)
        } else {
            Box::new(CudaBackend::with_options(cfg, weights, &p.plan, host_slots, cuda_opts)?)
        })
    }

    /// The CPU backend's checks and plan, and the host memory its arena will take against what is available.
    fn prepare_cpu(&self, text: TextModel, positions: Option<usize>, no_vision: bool) -> Result<Prepared> {
        self.check_cpu_tensor_parallel()?;
        if self.weights_dtype.is_some()
            || self.quantize.is_some()
            || self.lm_head_int4
            || self.embed_on_host
            || self.experts_on_host
        {
            anyhow::bail!(
                "--weights-dtype / --quantize / --lm-head-int4 / --embed-on-host / --experts-on-host: CUDA backend \
                 options (the CPU reference keeps f32 weights in host memory)"
            );
        }
        let spec = self.speculative_tokens()?;
        let mut opts = self.plan_options(Device::Cpu)?;
        // The CPU backend loads the model's tower (f32) unless --no-vision: its weights and workspace are
        // priced, never traded away by the fit.
        opts.max_image_tokens_per_step = (!no_vision && text.config.vision.is_some())
            .then(|| crate::model_source::max_image_tokens_per_step(self.max_image_tokens_per_step, Some(&text.dir)));
        let plan = self.fit(&text.config, &opts, self.free())?;
        let sched = self.sched_config(&plan)?;
        let num_pages = positions.map_or(plan.num_kv_pages, |n| n.div_ceil(plan.page_size).clamp(1, plan.num_kv_pages));
        let need = self.cpu_host_bytes(&text.config, &plan, &sched, num_pages);
        let lower = format!(
            "lower --memory ({}) or --snapshot-host-memory ({})",
            self.memory.as_deref().unwrap_or("default 2GiB"),
            self.snapshot_host_memory
        );
        crate::host_memory::check("the CPU backend", need, crate::host_memory::Available::now(), &lower)?;
        Ok(Prepared { device: Device::Cpu, text, plan, sched, speculative_tokens: spec, cpu_pages: num_pages })
    }

    /// Host bytes the CPU backend takes for `plan` with `num_pages` KV pages: the plan's regions with its KV
    /// pages in f32 (the CPU reference emulates every KV format in f32 pages), and the host snapshot pool.
    fn cpu_host_bytes(&self, cfg: &ModelConfig, plan: &Plan, sched: &SchedConfig, num_pages: usize) -> u64 {
        let d = cfg.dims();
        let f32_kv = num_pages as u64 * plan.page_size as u64 * (d.num_attention_layers * 2 * d.kv_dim * 4) as u64;
        let plan_kv = plan.num_kv_pages as u64 * plan.kv_page_bytes();
        let (k, v) = (plan.options.k_dtype, plan.options.v_dtype);
        if (k, v) != (KvFormat::F32, KvFormat::F32) {
            let msg = format!(
                "the CPU reference backend emulates K {k} / V {v} in f32 pages: {num_pages} KV pages take {} of host \
                 memory (the plan counts them at the format's size)",
                fmt_bytes(f32_kv)
            );
            if f32_kv > plan.budget_bytes {
                tracing::warn!("{msg}; lower --memory to bound it");
            } else {
                tracing::info!("{msg}");
            }
        }
        let host_snapshots = sched.prefix_cache.host_slots as u64 * sched.prefix_cache.snapshot_bytes;
        plan.total_bytes.saturating_sub(plan_kv) + f32_kv + host_snapshots
    }

    /// The CPU backend: the checkpoint's weights in f32, and its arena.
    fn load_cpu(&self, model: &ModelArgs, p: &Prepared) -> Result<CpuBackend> {
        let weights = model.load_weights(&p.text)?;
        let spec = p.speculative_tokens;
        if spec > 0 && !weights.has_mtp() {
            anyhow::bail!(
                "--speculative-tokens {spec}: this model has no MTP head (no `mtp.*` tensors in the checkpoint, or \
                 `mtp_num_hidden_layers` is 0)"
            );
        }
        let (plan, sched) = (&p.plan, &p.sched);
        let cache = CpuCacheConfig {
            num_pages: p.cpu_pages,
            page_size: plan.page_size,
            num_slots: plan.num_state_slots,
            snapshot_slots: sched.prefix_cache.device_slots,
            host_snapshot_slots: sched.prefix_cache.host_slots,
        };
        let backend = if spec > 0 {
            CpuBackend::with_speculation(weights, cache, spec).context("--speculative-tokens")?
        } else {
            CpuBackend::new(weights, cache)
        };
        Ok(backend.with_kv_formats(plan.options.k_dtype, plan.options.v_dtype))
    }
}

/// The API key the server requires: an empty `--api-key` / `DELTASERVE_API_KEY=` is no key (said in a
/// warning), not a key no client can send.
fn api_key_or_none(key: Option<String>) -> Option<String> {
    match key {
        Some(k) if k.trim().is_empty() => {
            tracing::warn!("the API key (--api-key / DELTASERVE_API_KEY) is empty: requests need no key");
            None
        }
        other => other,
    }
}

/// `--gpu-memory-utilization`: a fraction in (0, 1].
fn parse_fraction(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(f) if f > 0.0 && f <= 1.0 => Ok(f),
        _ => Err(format!("`{s}` is not a fraction in (0, 1] of the GPU's memory (e.g. 0.9)")),
    }
}

/// The CUDA backend's options of the server and the benchmarks. A/B switches: `DELTASERVE_FOLD=0`: decode
/// steps run the residual add + RMSNorm as its own kernel instead of folded into the int4 projections;
/// `DELTASERVE_W4_GEMM=0`: int4 projections of more rows than the decode GEMV's dequantise for cuBLASLt;
/// `DELTASERVE_SNAPSHOTS_IN_STEP=1`: snapshots inside a step's chunks.
pub fn cuda_options(cuda_graphs: bool) -> CudaOptions {
    let sw = deltaserve_cuda::Switches::get();
    let w4_gemm_max_rows = if sw.w4_gemm { CudaOptions::default().w4_gemm_max_rows } else { 0 };
    let verify_decode_attention_from =
        sw.verify_decode_from.unwrap_or(CudaOptions::default().verify_decode_attention_from);
    let short_chunk_decode_attention_from =
        sw.short_chunk_decode_from.unwrap_or(CudaOptions::default().short_chunk_decode_attention_from);
    CudaOptions {
        cuda_graphs,
        fold_norms: sw.fold_norms,
        w4_gemm_max_rows,
        verify_decode_attention_from,
        short_chunk_decode_attention_from,
        snapshots_in_step: sw.snapshots_in_step,
        ..CudaOptions::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_empty_api_key_is_no_key() {
        assert_eq!(api_key_or_none(None), None);
        assert_eq!(api_key_or_none(Some(String::new())), None);
        assert_eq!(api_key_or_none(Some(" ".into())), None);
        assert_eq!(api_key_or_none(Some("k".into())), Some("k".into()));
    }
}
