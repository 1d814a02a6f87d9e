//! Helpers shared by the engine tests over the CPU backend: loading a model, the scheduler's configuration,
//! the backend's cache configuration to match it, running a request's stream to its end, and waiting for
//! the engine to go idle.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use deltaserve_cpu::{CpuCacheConfig, CpuModel};
use deltaserve_engine::{EngineHandle, EngineStats, Event, FinishReason, RequestStream, Timing, Usage};
use deltaserve_model::synth::Preset;
use deltaserve_sched::{PrefixCacheConfig, SchedConfig};

/// Tokens per KV page in these tests.
pub const PAGE: usize = 8;

/// Writes the tiny preset's model, drawn from `seed`, with its tokenizer to `ds-{name}-{pid}` in the
/// system's temporary directory.
pub fn tiny_model(name: &str, seed: u64) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ds-{name}-{}", std::process::id()));
    deltaserve_text::synth_model::write_synthetic_model(&dir, Preset::Tiny, None, seed, |_, _| {}).unwrap();
    dir
}

/// The model in `dir` on the CPU, in f32.
pub fn load_model(dir: &Path) -> CpuModel {
    CpuModel::load(dir).unwrap()
}

/// Bytes of one sequence's DeltaNet state in `model` (conv and recurrent, f32): a snapshot's size.
pub fn state_bytes(model: &CpuModel) -> u64 {
    let d = &model.dims;
    (d.num_deltanet_layers * ((d.conv_kernel - 1) * d.conv_channels + d.gdn_v_heads * d.gdn_k_dim * d.gdn_v_dim) * 4)
        as u64
}

/// A test engine's limits.
pub struct Setup {
    pub max_batch_tokens: usize,
    pub num_pages: usize,
    pub max_seqs: usize,
    pub prefix_cache: bool,
}

impl Setup {
    /// The scheduler's configuration: `device_snapshots` device snapshot slots (and 2 host ones) when the
    /// prefix cache is on; no interval snapshots.
    pub fn sched(&self, device_snapshots: usize) -> SchedConfig {
        let prefix_cache = if self.prefix_cache {
            PrefixCacheConfig {
                device_slots: device_snapshots,
                host_slots: 2,
                page_size: PAGE,
                snapshot_bytes: 1 << 16,
                page_bytes: 4096,
            }
        } else {
            PrefixCacheConfig::disabled(PAGE)
        };
        SchedConfig {
            max_batch_tokens: self.max_batch_tokens,
            max_seqs: self.max_seqs,
            page_size: PAGE,
            num_pages: self.num_pages,
            max_context: self.num_pages * PAGE,
            max_waiting: 64,
            prefix_cache,
            snapshot_interval: 0,
        }
    }
}

/// The CPU backend's cache for scheduler configuration `c`.
pub fn cache_cfg(c: &SchedConfig) -> CpuCacheConfig {
    CpuCacheConfig {
        num_pages: c.num_pages,
        page_size: c.page_size,
        num_slots: c.max_seqs,
        snapshot_slots: c.prefix_cache.device_slots,
        host_snapshot_slots: c.prefix_cache.host_slots,
    }
}

/// Engine stats once nothing runs or waits (stats are published after each step).
pub fn wait_idle(e: &EngineHandle) -> EngineStats {
    for _ in 0..2000 {
        let s = e.stats();
        if s.sched.running + s.sched.waiting == 0 {
            return s;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    panic!("engine did not go idle");
}

/// Engine stats once nothing runs or waits and no sequence holds a state slot, which must come within
/// `limit`.
pub fn wait_released(e: &EngineHandle, limit: Duration) -> EngineStats {
    let t0 = Instant::now();
    loop {
        let s = e.stats();
        if s.sched.running + s.sched.waiting == 0 && s.sched.slots_in_use == 0 {
            return s;
        }
        assert!(t0.elapsed() < limit, "engine did not go idle: {:?}", s.sched);
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// What a request gave: its tokens, their logprobs (NaN where there were none), why it ended and its usage.
#[derive(Clone, Debug, PartialEq)]
pub struct Out {
    pub ids: Vec<u32>,
    pub logprobs: Vec<f32>,
    pub reason: FinishReason,
    pub usage: Usage,
    pub timing: Timing,
}

/// Runs a request's stream to its end (a failed request panics).
pub fn collect(mut s: RequestStream) -> Out {
    let (mut ids, mut logprobs) = (Vec::new(), Vec::new());
    loop {
        match s.blocking_next() {
            Some(Event::Token { id, logprob, .. }) => {
                ids.push(id);
                logprobs.push(logprob.map_or(f32::NAN, |l| l.logprob));
            }
            Some(Event::Finished { reason, usage, timing }) => return Out { ids, logprobs, reason, usage, timing },
            Some(Event::Prefill { .. } | Event::PromptLogprobs { .. }) => {}
            Some(Event::Error(e)) => panic!("request failed: {e}"),
            None => panic!("stream ended early"),
        }
    }
}
