//! The host memory a process may still take: `MemAvailable` of /proc/meminfo, capped by the cgroup's
//! limit when one is set. What a backend checks before it pins or allocates host memory, so a request
//! larger than that is refused with a clear error instead of the process being killed.

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

#[cfg(test)]
mod tests {
    use super::*;

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
}
