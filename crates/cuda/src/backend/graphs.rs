//! CUDA graphs of decode, verify, commit and draft steps: captured on a shape's first step, replayed after.

use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};

use crate::error::CudaError;

use super::CudaBackend;

/// Counters of the decode-graph path.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GraphStats {
    /// Graphs captured (one per bucket used so far).
    pub captures: usize,
    /// Steps replayed from a captured graph.
    pub replays: usize,
    /// Decode steps run eagerly (graphs off, profiling on, or a bucket's first step).
    pub eager_decode_steps: usize,
    /// Device memory the captured graphs took, as the driver's free memory fell across each capture
    /// and upload (bytes; the driver hands out memory in pages of 2 MiB).
    pub device_bytes: u64,
    /// The most one graph took.
    pub largest_bytes: u64,
    /// Steps run eagerly because another graph might take the graphs past the plan's reserve.
    pub over_budget: usize,
}

/// What a graph is assumed to take before one has been measured (a 27B verify step's measured 4 MiB).
const GRAPH_BYTES_GUESS: u64 = 4 << 20;

/// What a captured CUDA graph replays: a decode step of a batch-size bucket, a step of speculative
/// verify chunks (and decode rows) of one shape, or a commit of one shape.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(super) enum GraphKey {
    Decode(usize),
    /// (decode rows, verify rows attending as decode queries, each verify chunk's rows in order).
    Verify(usize, usize, Vec<usize>),
    /// (commits, verify rows, verify chunks) of the last step.
    Commit(usize, usize, usize),
    /// A draft step of the MTP head: (rows, first draft).
    Draft(usize, bool),
}

/// The most CUDA graphs a backend keeps (decode buckets, verify, commit and draft shapes).
pub(super) const MAX_GRAPHS: usize = 48;

impl CudaBackend {
    pub fn graph_stats(&self) -> GraphStats {
        self.graph_stats
    }

    /// The decode graph of a step with `n` one-token sequences: `n` itself, or with
    /// [`CudaOptions::graph_pad`] the next power of two capped at the plan's `max_seqs`.
    pub fn graph_bucket(&self, n: usize) -> usize {
        if !self.opts.graph_pad {
            return n;
        }
        n.next_power_of_two().min(self.max_seqs).max(n)
    }

    /// Runs `work` (stream work only: its inputs are uploaded) from the graph of `key`: replays it, or
    /// runs `work` eagerly (which also warms every cuBLASLt plan) and captures it for the next time.
    /// Eagerly every time when graphs are off or profiling is on.
    pub(super) fn run_graphed(
        &mut self,
        key: GraphKey,
        work: &dyn Fn(&Self) -> Result<(), CudaError>,
    ) -> Result<(), CudaError> {
        let graphed = self.opts.cuda_graphs && self.prof.borrow().is_none();
        if let (true, Some(g)) = (graphed, self.graphs.get(&key)) {
            g.launch().map_err(CudaError::driver("cuGraphLaunch"))?;
            self.graph_stats.replays += 1;
            return Ok(());
        }
        // Graphs live in driver memory outside the arena, within the plan's graph reserve: at most
        // MAX_GRAPHS shapes are captured, and none that could take the graphs past the reserve (sized
        // like the largest so far); later new shapes run eagerly.
        let gs = self.graph_stats;
        let fits = gs.device_bytes + gs.largest_bytes.max(GRAPH_BYTES_GUESS) <= self.graph_budget;
        if graphed && self.graphs.len() < MAX_GRAPHS && !fits {
            self.graph_stats.over_budget += 1;
            if gs.over_budget == 0 {
                tracing::info!(
                    graphs = self.graphs.len(),
                    bytes = gs.device_bytes,
                    reserve = self.graph_budget,
                    "the CUDA graph reserve is spent: new step shapes run without graphs"
                );
            }
        }
        let capture = graphed && self.graphs.len() < MAX_GRAPHS && fits;
        work(self)?;
        if matches!(key, GraphKey::Decode(_)) {
            self.graph_stats.eager_decode_steps += 1;
        }
        if !capture {
            return Ok(());
        }
        let free_eager = self.rt.free_memory()?;
        let st = self.rt.stream().clone();
        st.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(CudaError::driver("cuStreamBeginCapture"))?;
        let recorded = work(self);
        // Always end the capture, also when recording failed, so the stream is usable again.
        let graph = st.end_capture(CUgraphInstantiate_flags(0)).map_err(CudaError::driver("cuStreamEndCapture"));
        recorded?;
        let graph = graph?.ok_or_else(|| CudaError::Plan("the graph capture recorded no work".into()))?;
        graph.upload().map_err(CudaError::driver("cuGraphUpload"))?;
        let took = free_eager.saturating_sub(self.rt.free_memory()?);
        self.graph_stats.device_bytes += took;
        self.graph_stats.largest_bytes = self.graph_stats.largest_bytes.max(took);
        tracing::debug!(
            ?key,
            graph_bytes = took,
            graphs_bytes = self.graph_stats.device_bytes,
            "captured a CUDA graph"
        );
        if self.graph_stats.device_bytes > self.graph_budget {
            // Larger than any before: dropped (its memory goes back to the driver), and no more captures.
            drop(graph);
            self.graph_stats.device_bytes -= took;
            self.graph_budget = self.graph_stats.device_bytes;
            return Ok(());
        }
        self.graphs.insert(key, graph);
        self.graph_stats.captures += 1;
        Ok(())
    }
}
