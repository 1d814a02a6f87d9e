//! The host memory a process may still take (`MemAvailable` of /proc/meminfo, capped by the cgroup's
//! limit when one is set), and the check every CPU-backend memory request passes before it is allocated:
//! a request larger than that is refused with a clear error instead of aborting the process.

use anyhow::{Result, bail};
use deltaserve_plan::fmt_bytes;

/// The memory available to this process and where the figure comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Available {
    pub bytes: u64,
    /// `MemAvailable` or `the cgroup's memory limit`.
    pub source: &'static str,
}

impl Available {
    /// This machine's figure; None where neither /proc/meminfo nor a cgroup limit can be read.
    pub fn now() -> Option<Self> {
        let read = |p: &str| std::fs::read_to_string(p).ok();
        let meminfo = read("/proc/meminfo").as_deref().and_then(mem_available);
        // cgroup v2, then v1 (whose "no limit" is a huge number, which the min below ignores).
        let cgroup =
            cgroup_left(read("/sys/fs/cgroup/memory.max"), read("/sys/fs/cgroup/memory.current")).or_else(|| {
                cgroup_left(
                    read("/sys/fs/cgroup/memory/memory.limit_in_bytes"),
                    read("/sys/fs/cgroup/memory/memory.usage_in_bytes"),
                )
            });
        combine(meminfo, cgroup)
    }
}

/// The smaller of the two figures, named.
fn combine(meminfo: Option<u64>, cgroup: Option<u64>) -> Option<Available> {
    match (meminfo, cgroup) {
        (Some(m), Some(c)) if c < m => Some(Available { bytes: c, source: "the cgroup's memory limit" }),
        (Some(m), _) => Some(Available { bytes: m, source: "MemAvailable" }),
        (None, Some(c)) => Some(Available { bytes: c, source: "the cgroup's memory limit" }),
        (None, None) => None,
    }
}

/// `MemAvailable` of /proc/meminfo, in bytes.
fn mem_available(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// What a cgroup's limit leaves: limit − usage; None without a limit (`max`) or a file.
fn cgroup_left(limit: Option<String>, usage: Option<String>) -> Option<u64> {
    let limit: u64 = limit?.trim().parse().ok()?;
    let usage: u64 = usage.and_then(|u| u.trim().parse().ok()).unwrap_or(0);
    Some(limit.saturating_sub(usage))
}

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
    fn meminfo_and_cgroup_figures() {
        let meminfo = "MemTotal:       24000000 kB\nMemFree:         1000 kB\nMemAvailable:   20000000 kB\n";
        assert_eq!(mem_available(meminfo), Some(20_000_000 * 1024));
        assert_eq!(mem_available("MemTotal: 5 kB\n"), None);
        assert_eq!(cgroup_left(Some("max\n".into()), Some("100\n".into())), None);
        assert_eq!(cgroup_left(Some("8589934592\n".into()), Some("1073741824\n".into())), Some(7 << 30));
        assert_eq!(cgroup_left(None, None), None);
        let m = combine(Some(20 << 30), Some(7 << 30)).unwrap();
        assert_eq!((m.bytes, m.source), (7 << 30, "the cgroup's memory limit"));
        assert_eq!(combine(Some(20 << 30), Some(u64::MAX)).unwrap().source, "MemAvailable");
        assert_eq!(combine(None, None), None);
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
