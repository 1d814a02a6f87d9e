//! Steps launched ahead: the backend starts decode step N+1 before the engine has read step N's
//! tokens, and N+1's rows take their input tokens from N's picks where those are (on the device).
//! The host's work between two steps (reading the tokens, streaming them, building the next batch)
//! then overlaps the GPU's forward instead of leaving the GPU idle.
//!
//! A fed row cannot know on the host whether its sequence ended with the pick it is fed: a row whose
//! fed pick is one of its sequence's stop ids does not run (no KV write, no state change), so a
//! finished sequence's state stays the one its end-of-request snapshot wants. The host learns the
//! rest (lengths, stop strings, penalties) before it launches, and runs such steps one at a time.

use std::collections::VecDeque;

use crate::{Backend, BackendError, RowSampling, StepBatch, StepOut, Want};

/// The most stop ids one fed row carries.
pub const FEED_STOPS: usize = 8;

/// How a launched step picks each wanted row's token where the logits are.
#[derive(Clone, Copy, Debug)]
pub enum Pick<'a> {
    /// The [`crate::argmax`] over ids `< valid` (plain greedy rows).
    Argmax,
    /// The rule of the matching [`RowSampling`] (one per wanted row, in batch order).
    Sample(&'a [RowSampling]),
}

/// Where a launched step's input tokens come from: chunk `i` (every chunk one token that wants its
/// logits) takes the pick of wanted row `from[i]` of the step launched just before it. When that pick
/// is one of `stops[i]` (at most [`FEED_STOPS`]), or was not made on the device, chunk `i` does not run:
/// its sequence's KV and state stay as they were, and its pick is 0 (meaningless).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Feed {
    pub from: Vec<usize>,
    pub stops: Vec<Vec<u32>>,
}

impl Feed {
    /// Checks the feed against its batch and the previous launched step's `prev` wanted rows.
    pub fn check(&self, batch: &StepBatch, prev: usize) -> Result<(), BackendError> {
        let bad = |m: String| Err(BackendError::InvalidStep(m));
        if self.from.len() != batch.seqs.len() || self.stops.len() != batch.seqs.len() {
            return bad(format!("a feed of {} rows for {} chunks", self.from.len(), batch.seqs.len()));
        }
        if let Some(c) = batch.seqs.iter().find(|c| c.tokens.len() != 1 || !c.want_logits || c.draft > 0) {
            return bad(format!("seq {}: a fed chunk is one token that wants its logits", c.seq_id));
        }
        if let Some(&f) = self.from.iter().find(|&&f| f >= prev) {
            return bad(format!("fed from row {f} of a step with {prev} wanted rows"));
        }
        if self.stops.iter().any(|s| s.len() > FEED_STOPS) {
            return bad(format!("more than {FEED_STOPS} stop ids on a fed row"));
        }
        Ok(())
    }

    /// Whether chunk `i` runs, given the previous step's `picks` and where they were made.
    pub fn runs(&self, i: usize, picks: &[u32], on_device: &[bool]) -> bool {
        let f = self.from[i];
        on_device.get(f).copied().unwrap_or(false) && picks.get(f).is_some_and(|t| !self.stops[i].contains(t))
    }
}

/// Each wanted row's token of a collected step, and whether the device made it (false: the host
/// picked it afterwards, or its chunk did not run; a chunk fed from such a pick does not run).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Picked {
    pub tokens: Vec<u32>,
    pub on_device: Vec<bool>,
}

/// [`Backend::launch`] / [`Backend::collect`] for a backend that steps synchronously (the CPU
/// reference): a launch runs the step at once through the backend's [`Backend::step`], with the rows
/// that a [`Feed`] stops left out, and queues its picks. The same contract as a device that feeds on
/// the device, without the overlap; the engine's look-ahead is tested through it.
#[derive(Debug, Default)]
pub struct Emulated {
    done: VecDeque<Picked>,
    /// The picks of the last launched step.
    last: Picked,
    /// Every this many picks (0: none) counts as made on the host, as a device's rows that its
    /// sampler leaves to the host do: a chunk fed from it does not run.
    pub host_every: usize,
    picks: usize,
}

impl Emulated {
    /// Runs `batch` on `be` now (see [`Backend::launch`]).
    pub fn launch<B: Backend + ?Sized>(
        &mut self,
        be: &mut B,
        batch: &StepBatch,
        valid: usize,
        pick: Pick<'_>,
        feed: Option<&Feed>,
    ) -> Result<(), BackendError> {
        if self.done.len() >= 2 {
            return Err(BackendError::InvalidStep("two launched steps are not collected yet".into()));
        }
        let mut run = batch.clone();
        let mut runs = vec![true; batch.seqs.len()];
        if let Some(f) = feed {
            f.check(batch, self.last.tokens.len())?;
            for (i, c) in run.seqs.iter_mut().enumerate() {
                runs[i] = f.runs(i, &self.last.tokens, &self.last.on_device);
                c.tokens = vec![self.last.tokens[f.from[i]]];
            }
        }
        // Wanted rows of the chunks that run.
        let wanted: Vec<bool> = batch.seqs.iter().zip(&runs).filter(|(c, _)| c.want_logits).map(|(_, r)| *r).collect();
        let mut keep = runs.iter();
        run.seqs.retain(|_| *keep.next().unwrap_or(&true));
        let mut out = StepOut::default();
        match pick {
            Pick::Argmax => be.step(&run, Want::Tokens { valid, pick }, &mut out)?,
            Pick::Sample(rows) => {
                crate::check_sample_rows(batch, rows)?;
                let rows: Vec<RowSampling> =
                    rows.iter().zip(&wanted).filter(|(_, w)| **w).map(|(r, _)| r.clone()).collect();
                be.step(&run, Want::Tokens { valid, pick: Pick::Sample(&rows) }, &mut out)?
            }
        }
        let mut got = out.tokens.into_iter();
        let mut picked = Picked::default();
        for w in wanted {
            picked.tokens.push(if w { got.next().unwrap_or(0) } else { 0 });
            self.picks += usize::from(w);
            picked.on_device.push(w && (self.host_every == 0 || !self.picks.is_multiple_of(self.host_every)));
        }
        self.last = picked.clone();
        self.done.push_back(picked);
        Ok(())
    }

    /// The oldest launched step's picks (see [`Backend::collect`]).
    pub fn collect(&mut self, out: &mut Picked) -> Result<(), BackendError> {
        let p = self.done.pop_front().ok_or_else(|| BackendError::InvalidStep("no launched step to collect".into()))?;
        out.tokens.extend(p.tokens);
        out.on_device.extend(p.on_device);
        Ok(())
    }

    /// Forgets launched steps (after a failure).
    pub fn reset(&mut self) {
        self.done.clear();
        self.last = Picked::default();
    }
}
