//! Engine and memory-plan options shared by the commands that run the engine (`serve`), and the
//! start-up that turns them into a plan, a backend and a running engine.

use std::sync::Arc;

use anyhow::{Context, Result};
use deltaserve_cpu::{CpuBackend, CpuCacheConfig};
use deltaserve_engine::EngineHandle;
use deltaserve_plan::{KvDtype, Plan, PlanOptions, parse_size};
use deltaserve_sched::{PrefixCacheConfig, SchedConfig};
use deltaserve_text::{ChatTemplate, Tokenizer};

use crate::model_source::LoadedModel;

#[derive(clap::Args, Clone, Debug)]
pub struct EngineArgs {
    /// Memory budget of the backend arena (e.g. 24GiB). CPU default: 2GiB of host memory.
    #[arg(long)]
    pub memory: Option<String>,
    /// Tokens per engine step (prefill chunks + decode tokens).
    #[arg(long)]
    pub max_batch_tokens: Option<usize>,
    /// Sequences in flight at once (DeltaNet state slots).
    #[arg(long)]
    pub max_seqs: Option<usize>,
    /// Advertised context (default: the most that fits, capped by the model).
    #[arg(long)]
    pub max_context: Option<usize>,
    /// Tokens per KV page.
    #[arg(long, default_value_t = 32)]
    pub page_size: usize,
    /// Requests that may wait for admission before new ones get "overloaded" (HTTP 429).
    #[arg(long, default_value_t = 256)]
    pub max_waiting: usize,
    /// KV cache storage (the CPU reference backend stores f32).
    #[arg(long)]
    pub kv_cache_dtype: Option<String>,
    /// DeltaNet state snapshots kept in the backend's memory plan (the prefix cache's first tier).
    #[arg(long)]
    pub snapshot_slots: Option<usize>,
    /// Host memory for more snapshots (the second tier; restoring from it is a copy).
    #[arg(long, default_value = "512MiB")]
    pub snapshot_host_memory: String,
    /// During long prefills, also snapshot every this many tokens (0: never).
    #[arg(long, default_value_t = 4096)]
    pub snapshot_interval: usize,
    /// Disable the prefix cache (KV pages + DeltaNet state snapshots).
    #[arg(long)]
    pub no_prefix_cache: bool,
}

impl EngineArgs {
    /// The two snapshot tiers: the plan's device pool and `--snapshot-host-memory` on the host.
    fn prefix_cache(&self, plan: &Plan) -> Result<PrefixCacheConfig> {
        if self.no_prefix_cache || plan.options.snapshot_slots == 0 {
            return Ok(PrefixCacheConfig::disabled(plan.page_size));
        }
        let host =
            parse_size(&self.snapshot_host_memory).map_err(|e| anyhow::anyhow!("--snapshot-host-memory: {e}"))?;
        Ok(PrefixCacheConfig {
            device_slots: plan.options.snapshot_slots,
            host_slots: (host / plan.state_bytes_per_seq.max(1)) as usize,
            page_size: plan.page_size,
            snapshot_bytes: plan.state_bytes_per_seq,
            page_bytes: plan.kv_page_bytes(),
        })
    }
}

/// A running engine and the plan it was built from.
pub struct Started {
    pub engine: EngineHandle,
    pub plan: Plan,
    pub tokenizer: Option<Arc<Tokenizer>>,
    pub template: Option<Arc<ChatTemplate>>,
    /// Token ids that end generation.
    pub eos_ids: Vec<u32>,
}

impl EngineArgs {
    /// Plans memory for `loaded` on the CPU backend, allocates the arena and starts the engine.
    pub fn start_cpu(&self, loaded: LoadedModel) -> Result<Started> {
        let budget = parse_size(self.memory.as_deref().unwrap_or("2GiB")).map_err(anyhow::Error::msg)?;
        let mut opts = PlanOptions::cpu_defaults(budget);
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
        if let Some(kv) = &self.kv_cache_dtype {
            let kv: KvDtype = kv.parse().map_err(|e| anyhow::anyhow!("--kv-cache-dtype: {e}"))?;
            if kv != KvDtype::F32 {
                anyhow::bail!("--kv-cache-dtype {kv:?}: the CPU reference backend stores its KV cache in f32");
            }
        }
        let cfg = loaded.model.config.clone();
        let plan = Plan::new(&cfg, &opts).context("the memory plan does not fit")?;
        let sched = SchedConfig {
            max_batch_tokens: plan.max_batch_tokens,
            max_seqs: plan.max_seqs,
            page_size: plan.page_size,
            num_pages: plan.num_kv_pages,
            max_context: plan.max_context,
            max_waiting: self.max_waiting,
            prefix_cache: self.prefix_cache(&plan)?,
            snapshot_interval: self.snapshot_interval,
        };
        let eos_ids = cfg.eos_token_ids.clone();
        let backend = CpuBackend::new(
            loaded.model,
            CpuCacheConfig {
                num_pages: plan.num_kv_pages,
                page_size: plan.page_size,
                num_slots: plan.num_state_slots,
                snapshot_slots: sched.prefix_cache.device_slots,
                host_snapshot_slots: sched.prefix_cache.host_slots,
            },
        );
        let tokenizer = loaded.tokenizer.map(Arc::new);
        let engine = EngineHandle::start(Box::new(backend), sched, tokenizer.clone());
        Ok(Started { engine, plan, tokenizer, template: loaded.template.map(Arc::new), eos_ids })
    }
}
