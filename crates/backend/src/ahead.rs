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
    /// Only in [`Backend::launch`]: the forward starts now and the picks wait for
    /// [`Backend::pick_launched`], so that what they need can be learnt while it runs (a constrained
    /// row's token mask depends on the pick of the step launched before it, collected meanwhile).
    Later,
}

/// Checks `pick` for [`Backend::pick_launched`] of a step whose `rows` wanted rows wait for it.
pub fn check_later_pick(pick: Pick<'_>, rows: usize) -> Result<(), BackendError> {
    match pick {
        Pick::Later => Err(BackendError::InvalidStep("a launched step's picks cannot wait twice".into())),
        Pick::Sample(rs) => crate::check_row_count(rs.len(), rows),
        Pick::Argmax => Ok(()),
    }
}

/// [`Backend::pick_launched`] with no step launched with [`Pick::Later`] waiting.
pub fn no_step_waits() -> BackendError {
    BackendError::InvalidStep("no launched step waits for its picks".into())
}

/// [`Backend::launch`] while a step launched with [`Pick::Later`] waits for its picks.
pub fn picks_not_made() -> BackendError {
    BackendError::InvalidStep("the launched step's picks are not made yet".into())
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
    /// A step launched with [`Pick::Later`]: its logits rows, the wanted rows that ran, `valid`.
    unpicked: Option<(Vec<f32>, Vec<bool>, usize)>,
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
        if self.unpicked.is_some() {
            return Err(picks_not_made());
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
                let rows: Vec<RowSampling> = ran(rows, &wanted);
                be.step(&run, Want::Tokens { valid, pick: Pick::Sample(&rows) }, &mut out)?
            }
            Pick::Later => {
                be.step(&run, Want::Logits, &mut out)?;
                self.unpicked = Some((out.logits, wanted, valid));
                return Ok(());
            }
        }
        self.queue(out.tokens, wanted);
        Ok(())
    }

    /// Picks the rows of the step launched with [`Pick::Later`] (see [`Backend::pick_launched`]).
    pub fn pick_launched(&mut self, pick: Pick<'_>) -> Result<(), BackendError> {
        let Some((mut logits, wanted, valid)) = self.unpicked.take() else {
            return Err(no_step_waits());
        };
        check_later_pick(pick, wanted.len())?;
        let rows = wanted.iter().filter(|w| **w).count();
        let vocab = logits.len().checked_div(rows).unwrap_or(0);
        let mut tokens = Vec::with_capacity(rows);
        let ran_rows;
        let pick = match pick {
            Pick::Sample(all) => {
                ran_rows = ran(all, &wanted);
                Pick::Sample(&ran_rows)
            }
            other => other,
        };
        crate::host::pick_tokens(&mut logits, vocab, valid, pick, &mut tokens)?;
        self.queue(tokens, wanted);
        Ok(())
    }

    /// Queues the picks `got` of the wanted rows that ran (`wanted`; the others pick 0).
    fn queue(&mut self, got: Vec<u32>, wanted: Vec<bool>) {
        let mut got = got.into_iter();
        let mut picked = Picked::default();
        for w in wanted {
            picked.tokens.push(if w { got.next().unwrap_or(0) } else { 0 });
            self.picks += usize::from(w);
            picked.on_device.push(w && (self.host_every == 0 || !self.picks.is_multiple_of(self.host_every)));
        }
        self.last = picked.clone();
        self.done.push_back(picked);
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
        self.unpicked = None;
        self.last = Picked::default();
    }
}

/// The rules of the wanted rows that ran (`wanted`), in order.
fn ran(rows: &[RowSampling], wanted: &[bool]) -> Vec<RowSampling> {
    rows.iter().zip(wanted).filter(|(_, w)| **w).map(|(r, _)| r.clone()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ArenaStats, Capabilities, SeqChunk, SpecCommit, host};

    /// Logits rows of 4 ids falling from id `(token + 1) % 4` (`token`: what the row's chunk ran) on.
    struct Next {
        ahead: Emulated,
    }

    impl Backend for Next {
        fn capabilities(&self) -> Capabilities {
            Capabilities {
                name: "next".into(),
                vocab_size: 4,
                launches_ahead: true,
                max_draft_tokens: 0,
                masks_tokens: true,
                picks_after_launch: true,
                snapshots_within_chunks: 0,
                prompt_logits: false,
                max_logits_rows: 0,
            }
        }
        fn step(&mut self, batch: &StepBatch, want: Want<'_>, out: &mut StepOut) -> Result<(), BackendError> {
            host::host_step(batch, 4, want, out, |_, logits, _| {
                for c in batch.seqs.iter().filter(|c| c.want_logits) {
                    let next = (c.tokens[0] as usize + 1) % 4;
                    logits.extend((0..4).map(|i| -(((i + 4 - next) % 4) as f32)));
                }
                Ok(())
            })
        }
        fn launch(
            &mut self,
            b: &StepBatch,
            valid: usize,
            pick: Pick<'_>,
            f: Option<&Feed>,
        ) -> Result<(), BackendError> {
            let mut ahead = std::mem::take(&mut self.ahead);
            let r = ahead.launch(self, b, valid, pick, f);
            self.ahead = ahead;
            r
        }
        fn pick_launched(&mut self, pick: Pick<'_>) -> Result<(), BackendError> {
            self.ahead.pick_launched(pick)
        }
        fn collect(&mut self, out: &mut Picked) -> Result<(), BackendError> {
            self.ahead.collect(out)
        }
        fn commit_speculative(&mut self, commits: &[SpecCommit]) -> Result<(), BackendError> {
            host::no_verified_chunks(commits)
        }
        fn arena_stats(&self) -> ArenaStats {
            ArenaStats::default()
        }
    }

    /// A step launched with its picks left for later: the step before it is collected meanwhile, the
    /// next waits for the picks, and a step fed from them runs on them.
    #[test]
    fn picks_left_for_later_feed_the_next_step() {
        let one = |t: u32| SeqChunk { seq_id: 1, tokens: vec![t], want_logits: true, ..SeqChunk::default() };
        let batch = |t: u32| StepBatch { seqs: vec![one(t)], ..StepBatch::default() };
        let feed = Feed { from: vec![0], stops: vec![vec![]] };
        let mut be = Next { ahead: Emulated::default() };
        be.launch(&batch(0), 4, Pick::Argmax, None).unwrap();
        be.launch(&batch(0), 4, Pick::Later, Some(&feed)).unwrap();
        let e = be.launch(&batch(0), 4, Pick::Argmax, Some(&feed));
        assert!(matches!(e, Err(BackendError::InvalidStep(_))), "no launch before the picks: {e:?}");
        let mut first = Picked::default();
        be.collect(&mut first).unwrap();
        assert_eq!(first.tokens, [1]);
        assert!(be.collect(&mut Picked::default()).is_err(), "the later step is not collected before its picks");
        // Its mask allows ids 0 and 3 only: the pick is 3, not the argmax 2 (it ran the first pick, 1).
        let rows = [RowSampling { allowed: Some(vec![0b1001]), ..RowSampling::greedy() }];
        be.pick_launched(Pick::Sample(&rows)).unwrap();
        assert!(be.pick_launched(Pick::Argmax).is_err(), "nothing waits for picks now");
        be.launch(&batch(0), 4, Pick::Argmax, Some(&feed)).unwrap();
        let mut got = Picked::default();
        be.collect(&mut got).unwrap();
        be.collect(&mut got).unwrap();
        assert_eq!(got.tokens, [3, 0], "the step fed 3 picks (3 + 1) % 4");
        assert_eq!(got.on_device, [true, true]);
        // Picks cannot wait twice; the step is dropped with the error.
        be.launch(&batch(0), 4, Pick::Later, None).unwrap();
        assert!(matches!(be.pick_launched(Pick::Later), Err(BackendError::InvalidStep(_))));
        assert!(be.pick_launched(Pick::Argmax).is_err());
    }
}
