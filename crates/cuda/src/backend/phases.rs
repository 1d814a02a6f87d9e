//! Where a step's wall time goes (the bench's `--phases`): host instants and GPU timing events at the
//! marks of a step: its entry, its first upload, its forward (a graph replay or the kernels), its
//! outputs on the host. Off unless asked for (four events a step).

use std::time::Instant;

use cudarc::driver::{CudaEvent, CudaStream};

use crate::error::CudaError;
use crate::runtime::Runtime;

/// The medians over the timed steps of each part of a step, in ms.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepPhases {
    /// Steps timed.
    pub steps: usize,
    /// Host: from the step's entry to its first upload (checking the batch, building the inputs).
    pub host_prep_ms: f64,
    /// Host: issuing the uploads (inputs, changed block-table entries, host embedding rows).
    pub host_upload_ms: f64,
    /// Host: launching the forward (one graph replay, or every kernel).
    pub host_launch_ms: f64,
    /// GPU: from the first upload to the forward's start (the copies, then the wait for the launch).
    pub gpu_inputs_ms: f64,
    /// GPU: the forward.
    pub gpu_forward_ms: f64,
    /// From the forward's end until the outputs are on the host (the greedy argmax, the copy, the wake-up).
    pub output_ms: f64,
    /// The step's wall time.
    pub wall_ms: f64,
}

/// The marks of a step, in order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Mark {
    Entry,
    Uploads,
    Forward,
    Forwarded,
    Outputs,
}

pub(super) struct PhaseTimer {
    /// Events at Uploads, Forward, Forwarded, Outputs.
    events: [CudaEvent; 4],
    host: [Option<Instant>; 5],
    steps: Vec<[f64; 7]>,
}

impl PhaseTimer {
    pub(super) fn new(rt: &Runtime) -> Result<PhaseTimer, CudaError> {
        let timing = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let ev = || rt.context().new_event(timing).map_err(CudaError::driver("cuEventCreate"));
        Ok(PhaseTimer { events: [ev()?, ev()?, ev()?, ev()?], host: [None; 5], steps: Vec::new() })
    }

    pub(super) fn mark(&mut self, m: Mark, stream: &CudaStream) -> Result<(), CudaError> {
        let i = m as usize;
        if m == Mark::Entry {
            self.host = [None; 5];
        } else {
            self.events[i - 1].record(stream).map_err(CudaError::driver("cuEventRecord"))?;
        }
        self.host[i] = Some(Instant::now());
        if m == Mark::Outputs {
            self.finish()?;
        }
        Ok(())
    }

    /// Ends a step at its last mark, if it passed every one (a step that failed or skipped a mark is not counted).
    fn finish(&mut self) -> Result<(), CudaError> {
        let end = Instant::now();
        let Some(h) = self.host.iter().copied().collect::<Option<Vec<Instant>>>() else { return Ok(()) };
        let ms = |a: Instant, b: Instant| (b - a).as_secs_f64() * 1e3;
        let gpu = |a: usize, b: usize| -> Result<f64, CudaError> {
            let t = self.events[a].elapsed_ms(&self.events[b]).map_err(CudaError::driver("cuEventElapsedTime"))?;
            Ok(f64::from(t))
        };
        let row = [ms(h[0], h[1]), ms(h[1], h[2]), ms(h[2], h[3]), gpu(0, 1)?, gpu(1, 2)?, gpu(2, 3)?, ms(h[0], end)];
        self.steps.push(row);
        self.host = [None; 5];
        Ok(())
    }

    /// The medians of the steps timed since the last call (None if none was).
    pub(super) fn take(&mut self) -> Option<StepPhases> {
        let steps = std::mem::take(&mut self.steps);
        if steps.is_empty() {
            return None;
        }
        let med = |k: usize| {
            let mut v: Vec<f64> = steps.iter().map(|r| r[k]).collect();
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        Some(StepPhases {
            steps: steps.len(),
            host_prep_ms: med(0),
            host_upload_ms: med(1),
            host_launch_ms: med(2),
            gpu_inputs_ms: med(3),
            gpu_forward_ms: med(4),
            output_ms: med(5),
            wall_ms: med(6),
        })
    }
}
