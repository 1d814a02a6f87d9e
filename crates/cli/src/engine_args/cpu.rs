//! The CPU reference backend's start-up: its checks, plan and host memory, and the backend.

use anyhow::{Context, Result};
use deltaserve_cpu::{CpuBackend, CpuCacheConfig, KvFormat};
use deltaserve_model::ModelConfig;
use deltaserve_plan::{Plan, fmt_bytes};
use deltaserve_sched::SchedConfig;

use super::{EngineArgs, Prepared};
use crate::model_source::{Device, ModelArgs, TextModel};

impl EngineArgs {
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

    /// The CPU backend's checks and plan, and the host memory its arena will take against what is available.
    pub(super) fn prepare_cpu(&self, text: TextModel, positions: Option<usize>, no_vision: bool) -> Result<Prepared> {
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
    pub(super) fn load_cpu(&self, model: &ModelArgs, p: &Prepared) -> Result<CpuBackend> {
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
        Ok(backend
            .with_kv_formats(plan.options.k_dtype, plan.options.v_dtype)
            .with_state_dtype(plan.options.state_dtype))
    }
}
