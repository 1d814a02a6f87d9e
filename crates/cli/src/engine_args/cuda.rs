//! The CUDA backend's start-up: its weight storage, checks and plan against the GPU's memory, and the
//! backend (one card, or tensor-parallel over several).

use anyhow::Result;
use deltaserve_backend::Backend;
use deltaserve_cuda::{CudaBackend, TpBackend, WeightSource};
use deltaserve_model::ModelConfig;
use deltaserve_model::quant::Quantization;
use deltaserve_plan::{Free, WeightsDtype, fmt_bytes};

use super::{EngineArgs, Prepared, cuda_options};
use crate::model_source::{Device, TextModel};

impl EngineArgs {
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

    /// The CUDA backend's checks and plan (against the GPU's free memory).
    pub(super) fn prepare_cuda(&self, text: TextModel, random_weights: bool, no_vision: bool) -> Result<Prepared> {
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
    pub(super) fn load_cuda(&self, p: &Prepared, random_weights: bool) -> Result<Box<dyn Backend>> {
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
}
