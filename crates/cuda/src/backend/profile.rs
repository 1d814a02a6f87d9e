//! Timing: per-op-group GPU time while profiling, and the step phases' marks.

use crate::error::CudaError;

use super::CudaBackend;
use super::phases::{Mark, PhaseTimer, StepPhases};

/// Per-op-group GPU time while profiling ([`CudaBackend::set_profiling`]): a timing event is recorded
/// at the start of a step and after each group (no synchronisation in between), read back once at the
/// end of the step and summed by group.
pub(super) struct Profile {
    pub(super) events: Vec<cudarc::driver::CudaEvent>,
    /// Whether `events[0]` marks the start of the current step (then `names.len() + 1` events are
    /// recorded).
    pub(super) open: bool,
    /// `names[i]`: the group that ended at `events[i + 1]`.
    pub(super) names: Vec<&'static str>,
    pub(super) totals: Vec<(&'static str, f64)>,
}

/// Timing events per profiled step (a step records one per op group: ~6 per layer); more flush early.
pub(super) const PROFILE_EVENTS: usize = 1024;

impl CudaBackend {
    /// Turns per-op-group timing on or off: steps then run eagerly (no CUDA graphs) with a timing
    /// event after each op group; [`CudaBackend::take_profile`] returns and clears the totals.
    pub fn set_profiling(&mut self, on: bool) -> Result<(), CudaError> {
        let prof = if on {
            let ctx = self.rt.context();
            let timing = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
            let events = (0..PROFILE_EVENTS)
                .map(|_| ctx.new_event(timing))
                .collect::<Result<Vec<_>, _>>()
                .map_err(CudaError::driver("cuEventCreate"))?;
            Some(Profile { events, open: false, names: Vec::new(), totals: Vec::new() })
        } else {
            None
        };
        *self.prof.borrow_mut() = prof;
        Ok(())
    }

    /// Times the parts of every step from now on (host work, uploads, forward, outputs), or stops.
    pub fn set_step_phases(&mut self, on: bool) -> Result<(), CudaError> {
        *self.phases.borrow_mut() = if on { Some(PhaseTimer::new(&self.rt)?) } else { None };
        Ok(())
    }

    /// The median parts of the steps timed since phases were turned on or last taken.
    pub fn take_step_phases(&self) -> Option<StepPhases> {
        self.phases.borrow_mut().as_mut().and_then(|p| p.take())
    }

    /// Step phases: the step reached `m`.
    pub(super) fn phase(&self, m: Mark) -> Result<(), CudaError> {
        match self.phases.borrow_mut().as_mut() {
            Some(p) => p.mark(m, self.rt.stream()),
            None => Ok(()),
        }
    }

    /// (group, seconds of GPU time) accumulated since profiling was turned on or last taken.
    pub fn take_profile(&self) -> Vec<(&'static str, f64)> {
        self.prof.borrow_mut().as_mut().map(|p| std::mem::take(&mut p.totals)).unwrap_or_default()
    }

    /// Profiling: marks the start of a step (first adding up groups timed outside one).
    pub(super) fn prof_begin(&self) -> Result<(), CudaError> {
        self.prof_end()?;
        let mut p = self.prof.borrow_mut();
        if let Some(p) = p.as_mut() {
            p.names.clear();
            p.events[0].record(self.rt.stream()).map_err(CudaError::driver("cuEventRecord"))?;
            p.open = true;
        }
        Ok(())
    }

    /// Profiling: waits for the step's events and adds the time between them to their groups.
    pub(super) fn prof_end(&self) -> Result<(), CudaError> {
        let mut p = self.prof.borrow_mut();
        if let Some(p) = p.as_mut() {
            for (i, &name) in p.names.iter().enumerate() {
                let ms = p.events[i].elapsed_ms(&p.events[i + 1]).map_err(CudaError::driver("cuEventElapsedTime"))?;
                match p.totals.iter_mut().find(|(n, _)| *n == name) {
                    Some(e) => e.1 += f64::from(ms) / 1e3,
                    None => p.totals.push((name, f64::from(ms) / 1e3)),
                }
            }
            p.names.clear();
            p.open = false;
        }
        Ok(())
    }

    /// Profiling: the op group `name` ends here.
    pub(super) fn tick(&self, name: &'static str) -> Result<(), CudaError> {
        let full = self.prof.borrow().as_ref().is_some_and(|p| p.names.len() + 1 == p.events.len());
        if full {
            self.prof_end()?;
            self.prof_begin()?;
        }
        let mut p = self.prof.borrow_mut();
        if let Some(p) = p.as_mut() {
            if !p.open {
                // A group outside a step (e.g. a cache op): its own start.
                p.events[0].record(self.rt.stream()).map_err(CudaError::driver("cuEventRecord"))?;
                p.open = true;
            }
            p.events[p.names.len() + 1].record(self.rt.stream()).map_err(CudaError::driver("cuEventRecord"))?;
            p.names.push(name);
        }
        Ok(())
    }
}
