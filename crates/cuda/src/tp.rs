//! [`TpBackend`]: one model over `N` GPUs of one host (Megatron-style tensor parallelism), as one
//! engine [`Backend`]. Rank `r` is a [`CudaBackend`] on GPU `r` holding its shard of the model
//! ([`deltaserve_model::shard`]: attention and kv heads, DeltaNet key-head groups, MLP intermediate
//! range, vocabulary range) under the per-card plan (`tensor_parallel` = N), with its own arena, KV
//! pages, state slots and snapshots. The scheduler stays in one place: every rank runs the same step
//! batch, each on its own thread, and NCCL sums the row-parallel outputs on the GPUs (after the
//! embedding, each mixer's output projection and each MLP's down projection: 2·layers + 1
//! all-reduces of `[tokens, hidden]` bf16 per step, on each rank's stream, so decode graphs contain
//! them). Each rank computes the logits of its vocabulary range; they are downloaded by each rank
//! and placed side by side on the host (the engine samples on the host, so a device all-gather
//! would only add a copy).
//!
//! A rank's step validates the batch exactly as every other rank does (same plan geometry), so a
//! refused step is refused by all ranks before any collective runs.

use std::ops::Range;
use std::sync::Arc;

use deltaserve_backend::host::host_step;
use deltaserve_backend::{ArenaStats, Backend, BackendError, Capabilities, StepBatch, StepOut, Want};
use deltaserve_model::ModelConfig;
use deltaserve_model::shard::ShardSpec;
use deltaserve_plan::Plan;

use crate::backend::{CudaBackend, CudaOptions, GraphStats, WeightSource};
use crate::collective::Communicators;
use crate::error::CudaError;

/// The ranks of one tensor-parallel group and the host-side assembly of their logits.
pub struct TpBackend {
    ranks: Vec<CudaBackend>,
    /// Each rank's vocabulary range (rank order, contiguous).
    vocab: Vec<Range<usize>>,
    full_vocab: usize,
    /// Kept alive as long as the ranks (they hold clones too).
    _comms: Arc<Communicators>,
}

impl TpBackend {
    /// Builds rank r on GPU r for r < `plan.options.tensor_parallel` (in parallel: each rank loads
    /// or generates its shard of the weights), then creates the NCCL communicators and attaches
    /// them. `cfg` is the whole model; `plan` the per-card plan.
    pub fn new(
        cfg: &ModelConfig,
        weights: WeightSource,
        plan: &Plan,
        host_snapshot_slots: usize,
        opts: CudaOptions,
    ) -> Result<Self, CudaError> {
        let world = plan.options.tensor_parallel;
        let specs = ShardSpec::all(cfg, world).map_err(|e| CudaError::Plan(e.to_string()))?;
        let count = crate::runtime::device_count()?;
        if count < world {
            return Err(CudaError::Plan(format!(
                "--tensor-parallel {world} needs {world} GPUs; the driver reports {count} (CUDA_VISIBLE_DEVICES?)"
            )));
        }
        tracing::info!("tensor parallel: building {world} ranks on GPUs 0..{world}");
        let built: Vec<Result<CudaBackend, CudaError>> = std::thread::scope(|s| {
            let handles: Vec<_> = specs
                .iter()
                .map(|spec| {
                    let (weights, spec) = (weights.clone(), spec.clone());
                    s.spawn(move || CudaBackend::rank(cfg, weights, plan, host_snapshot_slots, opts, spec))
                })
                .collect();
            handles
                .into_iter()
                .enumerate()
                .map(|(r, h)| {
                    h.join().unwrap_or_else(|_| Err(CudaError::Plan(format!("rank {r} panicked while loading"))))
                })
                .collect()
        });
        let mut ranks = built.into_iter().collect::<Result<Vec<_>, _>>()?;
        let streams = ranks.iter().map(|b| b.runtime().stream().clone()).collect();
        let comms = Arc::new(Communicators::new(streams).map_err(|e| CudaError::Plan(e.to_string()))?);
        for b in &mut ranks {
            b.attach(comms.clone())?;
        }
        let vocab = specs.iter().map(|s| s.vocab.clone()).collect();
        let mut tp = Self { vocab, full_vocab: cfg.vocab_size, ranks, _comms: comms };
        // NCCL sets up a protocol's buffers at its first collective: run a full step's all-reduce and a
        // one-token one now, so serving allocates nothing (the driver's figure is flat from here on).
        tp.time_all_reduce(plan.max_batch_tokens, 1)?;
        tp.time_all_reduce(1, 1)?;
        tracing::info!("tensor parallel: {world} ranks ready, NCCL communicators attached and warmed (NVLS off)");
        Ok(tp)
    }

    /// Number of ranks.
    pub fn world(&self) -> usize {
        self.ranks.len()
    }

    /// The ranks (profiling, options, statistics of each).
    pub fn ranks(&self) -> &[CudaBackend] {
        &self.ranks
    }

    pub fn ranks_mut(&mut self) -> &mut [CudaBackend] {
        &mut self.ranks
    }

    /// Decode-graph counters of rank 0 (every rank captures and replays the same steps).
    pub fn graph_stats(&self) -> GraphStats {
        self.ranks[0].graph_stats()
    }

    /// Seconds per all-reduce of `[tokens, hidden]` bf16 over the group (all ranks at once; the
    /// slowest rank's mean over `reps` calls).
    pub fn time_all_reduce(&mut self, tokens: usize, reps: usize) -> Result<f64, CudaError> {
        let panicked = |r| CudaError::Plan(format!("rank {r} panicked"));
        let times = on_every_rank(&mut self.ranks, |b| b.time_all_reduce(tokens, reps), panicked);
        times.into_iter().try_fold(0.0f64, |m, t| Ok(m.max(t?)))
    }
}

/// Runs `f` on every rank at once, one thread each (collectives need all ranks in flight), and
/// returns the results in rank order; a panicking rank gives `panicked(rank)`.
fn on_every_rank<T: Send, E: Send>(
    ranks: &mut [CudaBackend],
    f: impl Fn(&mut CudaBackend) -> Result<T, E> + Sync,
    panicked: impl Fn(usize) -> E,
) -> Vec<Result<T, E>> {
    std::thread::scope(|s| {
        let handles: Vec<_> = ranks.iter_mut().map(|b| s.spawn(|| f(b))).collect();
        handles.into_iter().enumerate().map(|(r, h)| h.join().unwrap_or_else(|_| Err(panicked(r)))).collect()
    })
}

/// Places each rank's logits rows (`[rows, vocab_r]`, row-major) side by side: `[rows, Σ vocab_r]`
/// appended to `out`. The ranks' row counts must agree.
pub fn assemble_logits(parts: &[Vec<f32>], vocab: &[Range<usize>], out: &mut Vec<f32>) -> Result<(), BackendError> {
    let full: usize = vocab.iter().map(|r| r.len()).sum();
    let bad = |m: String| Err(BackendError::Device(format!("tensor-parallel logits: {m}")));
    if parts.len() != vocab.len() || vocab.iter().any(|r| r.is_empty()) {
        return bad(format!("{} parts for {} vocabulary ranges", parts.len(), vocab.len()));
    }
    let rows = parts[0].len() / vocab[0].len();
    for (p, r) in parts.iter().zip(vocab) {
        if p.len() != rows * r.len() {
            return bad(format!("a rank returned {} values, {rows} rows of {} expected", p.len(), r.len()));
        }
    }
    let at = out.len();
    out.resize(at + rows * full, 0.0);
    for row in 0..rows {
        let dst = &mut out[at + row * full..at + (row + 1) * full];
        for (p, r) in parts.iter().zip(vocab) {
            let w = r.len();
            dst[r.clone()].copy_from_slice(&p[row * w..(row + 1) * w]);
        }
    }
    Ok(())
}

impl Backend for TpBackend {
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            name: format!("cuda:0..{} (tensor parallel {})", self.ranks.len(), self.ranks.len()),
            vocab_size: self.full_vocab,
            launches_ahead: false,
            max_draft_tokens: 0,
            masks_tokens: true,
            picks_after_launch: false,
            snapshots_within_chunks: 0,
            prompt_logits: false,
            max_logits_rows: 0,
        }
    }

    /// Every rank's logits, placed side by side; tokens are picked from them on the host.
    fn step(&mut self, batch: &StepBatch, want: Want<'_>, out: &mut StepOut) -> Result<(), BackendError> {
        let (ranks, vocab) = (&mut self.ranks, &self.vocab);
        host_step(batch, self.full_vocab, want, out, |_, logits, _| {
            let step = |b: &mut CudaBackend| {
                let mut o = StepOut::default();
                b.step(batch, Want::Logits, &mut o).map(|_| o.logits)
            };
            let parts = on_every_rank(ranks, step, |r| BackendError::Device(format!("rank {r} panicked")));
            let parts = parts.into_iter().collect::<Result<Vec<_>, _>>()?;
            assemble_logits(&parts, vocab, logits)
        })
    }

    deltaserve_backend::without_lookahead_or_drafts!("tensor parallel");

    fn arena_stats(&self) -> ArenaStats {
        self.ranks.iter().map(|b| b.arena_stats()).fold(ArenaStats::default(), |a, s| ArenaStats {
            allocations: a.allocations + s.allocations,
            high_water_bytes: a.high_water_bytes + s.high_water_bytes,
            capacity_bytes: a.capacity_bytes + s.capacity_bytes,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logits_of_the_ranks_side_by_side() {
        // Vocabulary 7 over 3 ranks (3, 3, 1 columns), 2 rows.
        let vocab = [0..3, 3..6, 6..7];
        let parts = vec![vec![0.0, 1.0, 2.0, 10.0, 11.0, 12.0], vec![3.0, 4.0, 5.0, 13.0, 14.0, 15.0], vec![6.0, 16.0]];
        let mut out = vec![-1.0];
        assemble_logits(&parts, &vocab, &mut out).unwrap();
        let want: Vec<f32> =
            std::iter::once(-1.0).chain((0..7).map(|x| x as f32)).chain((10..17).map(|x| x as f32)).collect();
        assert_eq!(out, want);
        // No rows: nothing appended.
        let mut out = Vec::new();
        assemble_logits(&[vec![], vec![], vec![]], &vocab, &mut out).unwrap();
        assert!(out.is_empty());
    }

    #[test]
    fn mismatched_rank_outputs_are_an_error() {
        let vocab = [0..2, 2..4];
        let mut out = Vec::new();
        let e = assemble_logits(&[vec![0.0; 4], vec![0.0; 3]], &vocab, &mut out).unwrap_err();
        assert!(e.to_string().contains("rows"), "{e}");
        assert!(assemble_logits(&[vec![0.0; 2]], &vocab, &mut out).is_err());
        assert!(out.is_empty());
    }
}
