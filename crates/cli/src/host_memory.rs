//! The check every host memory request of the CLI passes before it is allocated (the CPU backend's
//! arena, the pinned routed experts of `--experts-on-host`): a request larger than what the process may
//! still take ([`Available`]) is refused with a clear error instead of aborting the process; and the
//! size of the automatic host snapshot pool.

use anyhow::{Result, bail};
pub use deltaserve_backend::host_memory::Available;
use deltaserve_plan::fmt_bytes;

/// Refuses `need` bytes of host memory for `what` when more than `available` is left (no check where
/// the figure is unknown). `lower` names the flags that reduce the request.
pub fn check(what: &str, need: u64, available: Option<Available>, lower: &str) -> Result<()> {
    match available {
        Some(a) if need > a.bytes => bail!(
            "{what} needs {} of host memory, more than the {} available ({}): {lower}",
            fmt_bytes(need),
            fmt_bytes(a.bytes),
            a.source
        ),
        _ => Ok(()),
    }
}

/// Snapshots per sequence the plan serves in the host pool of `--snapshot-host-memory auto`: an agent
/// session resumes from the snapshot at the end of its last turn, and a long prompt adds one every
/// `--snapshot-interval` tokens.
pub const AUTO_SNAPSHOTS_PER_SEQ: u64 = 4;
const AUTO_SNAPSHOT_FLOOR: u64 = 512 << 20;
const AUTO_SNAPSHOT_CAP: u64 = 16 << 30;

/// The host snapshot pool of `--snapshot-host-memory auto`: [`AUTO_SNAPSHOTS_PER_SEQ`] snapshots of
/// `snapshot_bytes` per sequence, at least 512 MiB, at most a quarter of the memory still `available`
/// and 16 GiB (pinned at start on a GPU; the floor wins over the quarter: it is the fixed default it replaces).
pub fn auto_snapshot_bytes(snapshot_bytes: u64, max_seqs: usize, available: Option<Available>) -> u64 {
    let want = AUTO_SNAPSHOTS_PER_SEQ * max_seqs.max(1) as u64 * snapshot_bytes;
    let cap = available.map_or(AUTO_SNAPSHOT_CAP, |a| (a.bytes / 4).min(AUTO_SNAPSHOT_CAP));
    want.min(cap).max(AUTO_SNAPSHOT_FLOOR)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_auto_snapshot_pool_follows_the_sequences_and_the_host() {
        let avail = |gib: u64| Some(Available { bytes: gib << 30, source: "MemAvailable" });
        // A 27B-sized snapshot (~150 MB) for 16 sequences on a 64 GiB host: 4 per sequence.
        let snap = 150_000_000;
        assert_eq!(auto_snapshot_bytes(snap, 16, avail(64)), 4 * 16 * snap);
        // A small host: a quarter of what is left.
        assert_eq!(auto_snapshot_bytes(snap, 16, avail(16)), 4 << 30);
        // Never below the old fixed default, never above 16 GiB.
        assert_eq!(auto_snapshot_bytes(1 << 20, 1, avail(64)), 512 << 20);
        assert_eq!(auto_snapshot_bytes(snap, 16, avail(1)), 512 << 20);
        assert_eq!(auto_snapshot_bytes(1 << 30, 256, None), 16 << 30);
    }

    #[test]
    fn a_request_above_what_is_available_is_refused() {
        let avail = Some(Available { bytes: 22 << 30, source: "MemAvailable" });
        assert!(check("the plan", 2 << 30, avail, "lower --memory").is_ok());
        assert!(check("the plan", 64 << 30, None, "lower --memory").is_ok());
        let e = check("the CPU backend", 32 << 30, avail, "lower --memory").unwrap_err().to_string();
        assert_eq!(
            e,
            "the CPU backend needs 32.00 GiB of host memory, more than the 22.00 GiB available (MemAvailable): \
             lower --memory"
        );
    }
}
