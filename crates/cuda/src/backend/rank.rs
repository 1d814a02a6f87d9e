//! Tensor parallelism on one rank: its shard, the communicators of its group, the all-reduce.

use std::sync::Arc;

use deltaserve_model::shard::ShardSpec;

use crate::arena::DevSpan;
use crate::collective::{CollDtype, Communicators};
use crate::error::CudaError;

use super::CudaBackend;

/// One tensor-parallel rank: its shard of the model and the communicators of its group (attached
/// once every rank is built).
pub(super) struct RankComm {
    pub(super) spec: ShardSpec,
    /// The whole model's vocabulary (token ids are checked against it).
    pub(super) full_vocab: usize,
    pub(super) comms: Option<Arc<Communicators>>,
}

impl CudaBackend {
    /// Gives a rank its group's communicators (rank r's stream must be this backend's stream).
    pub fn attach(&mut self, comms: Arc<Communicators>) -> Result<(), CudaError> {
        let Some(tp) = &mut self.tp else {
            return Err(CudaError::Plan(
                "communicators attached to a backend that is not a tensor-parallel rank".into(),
            ));
        };
        if comms.world() != tp.spec.world || !Arc::ptr_eq(comms.stream(tp.spec.rank), self.rt.stream()) {
            return Err(CudaError::Plan(format!(
                "rank {}: the communicators' world or stream is not this rank's",
                tp.spec.rank
            )));
        }
        self.graphs.clear();
        tp.comms = Some(comms);
        Ok(())
    }

    /// The model's vocabulary (a tensor-parallel rank holds a shard of it: [`Backend::vocab_size`]).
    pub(super) fn full_vocab(&self) -> usize {
        self.tp.as_ref().map_or(self.d.vocab, |t| t.full_vocab)
    }

    /// Tensor parallelism: the in-place all-reduce (sum) of the `[.., elems]` bf16 activations at
    /// `buf` over the group, on this rank's stream (so also inside a captured decode graph). A no-op
    /// on one GPU.
    pub(super) fn all_reduce(&self, buf: u64, elems: usize) -> Result<(), CudaError> {
        let Some(r) = &self.tp else { return Ok(()) };
        let comms = r.comms.as_ref().ok_or_else(|| {
            CudaError::Plan(format!(
                "tensor-parallel rank {} runs a step before its communicators are attached",
                r.spec.rank
            ))
        })?;
        comms
            .all_reduce_sum_rank(r.spec.rank, DevSpan { ptr: buf, bytes: 2 * elems }, elems, CollDtype::Bf16)
            .map_err(|e| CudaError::Plan(format!("rank {}: {e}", r.spec.rank)))?;
        self.tick("all-reduce")
    }

    /// Benchmarks: seconds per all-reduce of `[tokens, hidden]` bf16 activations, the size a step
    /// of `tokens` tokens reduces after every row-parallel projection (the mean of `reps` calls on
    /// the `mixer_out` buffer, synchronised). Every rank of the group must call it at once.
    pub fn time_all_reduce(&self, tokens: usize, reps: usize) -> Result<f64, CudaError> {
        if tokens > self.max_tokens || reps == 0 {
            return Err(CudaError::Plan(format!("all-reduce timing of {tokens} tokens × {reps}")));
        }
        self.rt.context().bind_to_thread().map_err(CudaError::driver("cuCtxSetCurrent"))?;
        let elems = tokens * self.d.hidden;
        self.all_reduce(self.ws.mixer_out, elems)?;
        self.rt.synchronize()?;
        let t0 = std::time::Instant::now();
        for _ in 0..reps {
            self.all_reduce(self.ws.mixer_out, elems)?;
        }
        self.rt.synchronize()?;
        Ok(t0.elapsed().as_secs_f64() / reps as f64)
    }

    /// This rank's vocabulary range under tensor parallelism (all of it on one GPU).
    pub fn vocab_range(&self) -> std::ops::Range<usize> {
        self.tp.as_ref().map_or(0..self.d.vocab, |t| t.spec.vocab.clone())
    }
}
