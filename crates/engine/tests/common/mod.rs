//! Helpers shared by the engine tests over the CPU backend (`speculative.rs`, `speculative_moe.rs`,
//! `constrained.rs`, `images.rs`): the scheduler's configuration, the backend's cache configuration to
//! match it, and waiting for the engine to go idle.
#![allow(dead_code)]

use deltaserve_cpu::CpuCacheConfig;
use deltaserve_engine::{EngineHandle, EngineStats};
use deltaserve_sched::{PrefixCacheConfig, SchedConfig};

/// Tokens per KV page in these tests.
pub const PAGE: usize = 8;

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
