//! Shared by the scheduler's property tests: a small configuration and a deterministic "model".
// Each test binary uses part of it.
#![allow(dead_code)]

use deltaserve_sched::{PrefixCacheConfig, SchedConfig};

/// 4-token pages, a 64-token context; with `cache`, a prefix cache of 2 device and 1 host snapshot slots.
pub fn cfg(max_batch_tokens: usize, num_pages: usize, max_seqs: usize, cache: bool) -> SchedConfig {
    let prefix_cache = if cache {
        PrefixCacheConfig { device_slots: 2, host_slots: 1, page_size: 4, snapshot_bytes: 100, page_bytes: 10 }
    } else {
        PrefixCacheConfig::disabled(4)
    };
    SchedConfig {
        max_batch_tokens,
        max_seqs,
        page_size: 4,
        num_pages,
        max_context: 64,
        max_waiting: 1000,
        prefix_cache,
        snapshot_interval: 0,
    }
}

/// The token at position `pos` of sequence `id` (deterministic "model").
pub fn truth(id: u64, pos: usize) -> u32 {
    (id as u32 * 7919 + pos as u32 * 31) % 997
}
