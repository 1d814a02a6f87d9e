//! Engine and memory-plan options shared by the commands that run a backend (`serve`, `generate`,
//! `logits`, `eval kld`, the in-process server of `soak` and `probe`), and the start-up that turns them
//! into a plan, a backend and a running engine.

use anyhow::{Context, Result};
use deltaserve_cuda::backend::CudaOptions;
use deltaserve_engine::EngineOptions;
use deltaserve_model::ModelConfig;
use deltaserve_plan::{Free, KvDtype, Plan, PlanOptions, StateDtype, WeightsDtype, fit_context, fmt_bytes, parse_size};
use deltaserve_sched::{PrefixCacheConfig, SchedConfig};

use crate::model_source::Device;

mod cpu;
mod cuda;
mod start;

pub use start::{Prepared, Started};

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
    /// DeltaNet recurrent state storage in its slots and snapshots: fp32 (exact, default) or bf16 (half the
    /// memory and half the state traffic of a decode step). The recurrence still computes in f32; the state
    /// is rounded after every decoded or verified token and at the end of each prefill chunk, so speculation
    /// keeps plain decode's results. The CPU reference backend keeps f32 holding those values.
    #[arg(long, visible_aliases = ["mamba-ssm-cache-dtype", "mamba-ssm-dtype"])]
    pub state_dtype: Option<StateDtype>,
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
        opts.state_dtype = self.state_dtype.unwrap_or_default();
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
        if let Some(hint) = &fitted.hint {
            tracing::warn!("memory plan: {hint}");
        }
        if let Some(note) = &fitted.note {
            tracing::info!("memory plan: {note}");
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

    /// A copy of these options storing K as `k` and V as `v` (what `--k-cache-dtype` / `--v-cache-dtype`
    /// give).
    pub fn with_kv_dtypes(&self, k: KvDtype, v: KvDtype) -> Self {
        Self { k_cache_dtype: Some(k.to_string()), v_cache_dtype: Some(v.to_string()), ..self.clone() }
    }

    /// A copy of these options storing the DeltaNet state as `s`; `None` keeps the command line's choice.
    pub fn with_state_dtype(&self, s: Option<StateDtype>) -> Self {
        Self { state_dtype: s.or(self.state_dtype), ..self.clone() }
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
/// `DELTASERVE_SNAPSHOTS_IN_STEP=0`: chunks end at snapshot points; `DELTASERVE_MOE_SHARED_PAIRS=0`: a sparse
/// layer's shared expert runs as its own dense MLP instead of with the routed experts' decode GEMVs; `DELTASERVE_FP8_MMA=1`: block-FP8 prefill
/// projections run the mma.sync FP8 GEMM.
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
        norms_in_reduce: sw.norms_in_reduce,
        w4_gemm_max_rows,
        verify_decode_attention_from,
        short_chunk_decode_attention_from,
        snapshots_in_step: sw.snapshots_in_step,
        moe_shared_pairs: sw.moe_shared_pairs,
        fp8_mma_gemm: sw.fp8_mma_gemm,
        fp8_fused_quant: sw.fp8_fused_quant,
        ..CudaOptions::default()
    }
}
