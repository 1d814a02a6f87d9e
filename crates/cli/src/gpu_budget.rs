//! The memory budget of a GPU plan from the command line: `--memory`, `--gpu-memory-utilization`, or the
//! free memory the driver reports less a margin; an explicit budget the card cannot hold is refused before
//! any weight is read.

use anyhow::Result;
use deltaserve_plan::{fmt_bytes, parse_size};

/// One GPU's memory as the driver reports it once this process's context exists, and the runtime reserve
/// the plan counts for that context, its modules and handles.
pub(crate) struct GpuMemory {
    pub(crate) free: u64,
    pub(crate) total: u64,
    pub(crate) reserve: u64,
}

impl GpuMemory {
    /// The budget: `--memory`, or `--gpu-memory-utilization` × the card's total, or 95% of the free memory
    /// (a margin for other processes and the driver). An explicit budget whose arena (the budget less the
    /// runtime reserve) exceeds the free memory is refused before any weight is read.
    pub(crate) fn budget(&self, memory: Option<&str>, utilization: Option<f64>) -> Result<u64> {
        let (budget, flag) = match (memory, utilization) {
            (Some(m), _) => (parse_size(m).map_err(|e| anyhow::anyhow!("--memory: {e}"))?, format!("--memory {m}")),
            (None, Some(f)) => ((self.total as f64 * f) as u64, format!("--gpu-memory-utilization {f}")),
            (None, None) => return Ok(self.free.saturating_sub(self.free / 20)),
        };
        if budget.saturating_sub(self.reserve) > self.free {
            anyhow::bail!(
                "{flag} asks for {} ({} for the arena after the {} runtime reserve), but only {} of the GPU's {} is                  free (other processes hold the rest): lower it",
                fmt_bytes(budget),
                fmt_bytes(budget.saturating_sub(self.reserve)),
                fmt_bytes(self.reserve),
                fmt_bytes(self.free),
                fmt_bytes(self.total)
            );
        }
        Ok(budget)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    #[test]
    fn gpu_budget_from_the_flags_and_the_free_memory() {
        let card = GpuMemory { free: 100 * GIB, total: 140 * GIB, reserve: GIB };
        assert_eq!(card.budget(None, None).unwrap(), 95 * GIB);
        assert_eq!(card.budget(Some("24GiB"), None).unwrap(), 24 * GIB);
        assert_eq!(card.budget(None, Some(0.5)).unwrap(), 70 * GIB);
        // More than the free memory (the arena, less the reserve): refused, naming the flag.
        let e = card.budget(None, Some(0.9)).unwrap_err().to_string();
        assert!(
            e.contains("--gpu-memory-utilization 0.9") && e.contains("126.00 GiB") && e.contains("100.00 GiB"),
            "{e}"
        );
        let e = card.budget(Some("120GiB"), None).unwrap_err().to_string();
        assert!(e.contains("--memory 120GiB") && e.contains("free"), "{e}");
        assert!(card.budget(Some("101GiB"), None).is_ok(), "the runtime reserve is in use already");
        assert!(card.budget(Some("lots"), None).unwrap_err().to_string().contains("--memory"));
    }
}
