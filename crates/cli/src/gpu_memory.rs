//! Device memory as the driver reports it (`nvidia-smi --query-compute-apps`), for the tools that hold the
//! server to its memory plan (`probe`, `bench`): one query, and a sampler thread that keeps the peak.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

/// Samples `nvidia-smi --query-compute-apps` on a thread and keeps the peak of one process (or of all).
pub(crate) struct GpuSampler {
    peak: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    join: Option<std::thread::JoinHandle<()>>,
}

impl GpuSampler {
    /// None when nvidia-smi is missing or lists nothing for the process (no GPU in use).
    pub(crate) fn start(pid: Option<u32>) -> Option<Self> {
        query_gpu_memory(pid)?;
        let (peak, stop) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicBool::new(false)));
        let (p, s) = (peak.clone(), stop.clone());
        let join = std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                if let Some(b) = query_gpu_memory(pid) {
                    p.fetch_max(b, Ordering::Relaxed);
                }
                std::thread::sleep(Duration::from_millis(200));
            }
        });
        Some(Self { peak, stop, join: Some(join) })
    }

    /// The peak since the last call, including the memory in use now.
    pub(crate) fn take_peak(&self, pid: Option<u32>) -> u64 {
        let now = query_gpu_memory(pid).unwrap_or(0);
        self.peak.swap(0, Ordering::Relaxed).max(now)
    }
}

impl Drop for GpuSampler {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(j) = self.join.take() {
            let _ = j.join();
        }
    }
}

/// Device memory of `pid` (or of every compute process) as the driver reports it, in bytes.
pub(crate) fn query_gpu_memory(pid: Option<u32>) -> Option<u64> {
    let out = std::process::Command::new("nvidia-smi")
        .args(["--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"])
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    parse_compute_apps(&String::from_utf8_lossy(&out.stdout), pid)
}

/// `pid, MiB` lines (one per process and GPU): the MiB of `pid` on its fullest GPU (tensor
/// parallelism: the per-card figure the plan budgets), or the sum of all lines; None when `pid` is
/// not listed.
fn parse_compute_apps(text: &str, pid: Option<u32>) -> Option<u64> {
    let rows: Vec<(u32, u64)> = text
        .lines()
        .filter_map(|l| {
            let (p, m) = l.split_once(',')?;
            Some((p.trim().parse().ok()?, m.trim().parse().ok()?))
        })
        .collect();
    let mib = match pid {
        Some(pid) => rows.iter().filter(|r| r.0 == pid).map(|r| r.1).max()?,
        None if rows.is_empty() => return None,
        None => rows.iter().map(|r| r.1).sum(),
    };
    Some(mib << 20)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compute_apps_lines() {
        let text = "1234, 24000\n999, 100\n";
        assert_eq!(parse_compute_apps(text, Some(1234)), Some(24000 << 20));
        assert_eq!(parse_compute_apps(text, None), Some(24100 << 20));
        assert_eq!(parse_compute_apps(text, Some(5)), None);
        // One process on two GPUs: its fullest card.
        assert_eq!(parse_compute_apps("7, 20000\n7, 23000\n8, 1\n", Some(7)), Some(23000 << 20));
        assert_eq!(parse_compute_apps("", None), None);
        assert_eq!(parse_compute_apps("No running processes found\n", None), None);
    }
}
