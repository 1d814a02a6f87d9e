//! Look-ahead stepping: while step N runs, the engine launches step N+1 (same sequences, one position
//! further, each fed step N's pick on the device), then reads step N's tokens and streams them while
//! N+1 runs. The GPU does not wait for the host between decode steps.
//!
//! The next step is launched only when it can be planned without N's tokens: every request in the
//! step is context-free (no penalties: the rule does not depend on the pick), wants no logprobs and
//! has no stop strings (a stop string is seen on the host, after its token was fed). A sequence whose
//! pick is its last by length is left out; one whose pick is a stop id is fed a row that does not run
//! on the device, so its state stays the one its end-of-request snapshot wants. A pick the device could
//! not make (a sampled row picked on the host) leaves its row of N+1 unrun: that sequence is not
//! committed by N+1, its pick there is dropped, and the next step runs once N+1 is collected.
//!
//! A request constrained by a grammar runs ahead where the backend applies token masks and takes
//! picks after the launch ([`deltaserve_backend::Capabilities::picks_after_launch`]): its mask for
//! N+1 depends on its pick of N, so N+1 is launched with its picks left for later
//! ([`Pick::Later`]); once N is collected and its tokens followed, the masks are computed (while
//! N+1's forward runs) and N+1's picks are made with them.

use std::time::Instant;

use deltaserve_backend::ahead::FEED_STOPS;
use deltaserve_backend::{Feed, Pick, Picked, RowSampling};
use deltaserve_sched::StepPlan;

use super::{Emit, FinishReason, Live, Worker};

/// A step launched and not collected yet.
pub(super) struct Launched {
    plan: StepPlan,
    /// Its sampling rows (one per wanted row; empty for argmax steps): a row left unrun gives its draw back.
    rows: Vec<RowSampling>,
    feed: Option<Feed>,
    /// Chunks that did not run while their sequence goes on: not committed, their picks dropped.
    skip: Vec<bool>,
    /// Launched with [`Pick::Later`]: its picks are made once the step before it is collected.
    later: bool,
    started: Instant,
}

impl Launched {
    pub(super) fn new(plan: StepPlan, rows: Vec<RowSampling>, feed: Option<Feed>, started: Instant) -> Self {
        let skip = vec![false; plan.batch.seqs.len()];
        Self { plan, rows, feed, skip, later: false, started }
    }
}

impl Live {
    /// Whether this request's next step can be planned before its last pick is known (`masks`: the
    /// backend applies token masks, so a constrained request's picks can wait for its mask).
    fn runs_ahead(&self, masks: bool) -> bool {
        self.req.logprobs.is_none()
            && (masks || self.req.constraint.is_none())
            && self.req.stop_strings.is_empty()
            && self.req.stop_token_ids.len() <= FEED_STOPS
            && self.sampler.context_free()
    }
}

impl Worker {
    /// `cur` is launched: records it as run, launches the step after it when that can be planned now,
    /// then collects `cur` and hands out its tokens.
    pub(super) fn follow(&mut self, cur: Launched) {
        let mut ran = StepPlan::default();
        ran.batch.seqs =
            cur.plan.batch.seqs.iter().zip(&cur.skip).filter(|(_, s)| !**s).map(|(c, _)| c.clone()).collect();
        self.sched.commit(&ran);
        let mut next = match self.launch_next(&cur) {
            Ok(n) => n,
            Err(e) => {
                // The backend keeps no launched step after an error: `cur` is lost too.
                self.step_failed(&e, &cur.plan.batch.seqs);
                return;
            }
        };
        let mut picked = Picked::default();
        if let Err(e) = self.backend.collect(&mut picked) {
            // No launched step remains after an error: `next` (of `cur`'s sequences) is lost too.
            self.step_failed(&e.to_string(), &cur.plan.batch.seqs);
            return;
        }
        let wanted = cur.plan.batch.num_logits();
        if picked.tokens.len() != wanted || picked.on_device.len() != wanted {
            if next.is_some() {
                let _ = self.backend.collect(&mut Picked::default());
            }
            let e = format!("a launched step returned {} picks for {wanted} rows", picked.tokens.len());
            self.step_failed(&e, &cur.plan.batch.seqs);
            return;
        }
        let now = Instant::now();
        let step_seconds = now.duration_since(cur.started.max(self.collected)).as_secs_f64();
        self.collected = now;
        self.prompt_steps(&cur.plan.batch.seqs, step_seconds);
        if let Ok(mut s) = self.shared.stats.lock() {
            s.steps += 1;
            s.step_seconds += step_seconds;
        }
        let mut finished = Vec::new();
        let mut tokens = picked.tokens.iter();
        for (c, skip) in cur.plan.batch.seqs.iter().zip(&cur.skip) {
            if !c.want_logits {
                continue;
            }
            let token = tokens.next().copied().unwrap_or(0);
            if !*skip && let Emit::Finish(r) = self.emit(c.seq_id, token, None) {
                finished.push((c.seq_id, r));
            }
        }
        if let Some(n) = &mut next {
            self.mark_unrun(n, &picked, &finished);
        }
        for (id, reason) in finished {
            self.finish(id, reason);
        }
        if let Some(n) = next.as_mut().filter(|n| n.later)
            && let Err(e) = self.pick_later(n)
        {
            self.step_failed(&e, &n.plan.batch.seqs);
            next = None;
        }
        self.ahead = next;
    }

    /// Makes the picks of `next`, launched with [`Pick::Later`] while the step before it ran: its rows'
    /// rules now that every request has followed that step's token (a constrained row's mask from
    /// there), none drawn for a row that does not run.
    fn pick_later(&mut self, next: &mut Launched) -> Result<(), String> {
        let runs: Vec<bool> = next
            .plan
            .batch
            .seqs
            .iter()
            .zip(&next.skip)
            .map(|(c, skip)| !skip && self.reqs.contains_key(&c.seq_id))
            .collect();
        next.rows = self.sampling_rows_where(&next.plan.batch.seqs, false, &runs);
        next.later = false;
        self.backend.pick_launched(Pick::Sample(&next.rows)).map_err(|e| e.to_string())
    }

    /// Plans and launches the step after `cur` (whose picks are not known yet) when the requests and
    /// the scheduler allow it.
    fn launch_next(&mut self, cur: &Launched) -> Result<Option<Launched>, String> {
        let masks = self.masks_tokens && self.picks_after_launch;
        let eligible = |id: &u64| self.reqs.get(id).is_none_or(|l| l.runs_ahead(masks));
        if !cur.plan.batch.seqs.iter().all(|c| eligible(&c.seq_id)) {
            return Ok(None);
        }
        let Some(mut plan) = self.sched.schedule_ahead(&cur.plan) else { return Ok(None) };
        self.place_chunks(&mut plan.batch.seqs);
        let wanted: Vec<u64> = cur.plan.batch.seqs.iter().filter(|c| c.want_logits).map(|c| c.seq_id).collect();
        let mut feed = Feed::default();
        for c in &plan.batch.seqs {
            let from = wanted.iter().position(|&w| w == c.seq_id);
            feed.from.push(from.ok_or_else(|| format!("seq {}: planned ahead without a pick to feed", c.seq_id))?);
            feed.stops.push(self.reqs.get(&c.seq_id).map_or_else(Vec::new, |l| l.req.stop_token_ids.clone()));
        }
        let live = |c: &deltaserve_backend::SeqChunk| self.reqs.get(&c.seq_id);
        let later = plan.batch.seqs.iter().any(|c| live(c).is_some_and(|l| l.req.constraint.is_some()));
        let greedy = !later && plan.batch.seqs.iter().all(|c| live(c).is_none_or(|l| l.sampler.picks_argmax()));
        let rows = if greedy || later { Vec::new() } else { self.sampling_rows(&plan.batch.seqs, false) };
        let pick = match (later, greedy) {
            (true, _) => Pick::Later,
            (false, true) => Pick::Argmax,
            (false, false) => Pick::Sample(&rows),
        };
        let started = Instant::now();
        self.backend.launch(&plan.batch, self.valid_vocab, pick, Some(&feed)).map_err(|e| e.to_string())?;
        if let Ok(mut s) = self.shared.stats.lock() {
            s.steps_ahead += 1;
        }
        let mut launched = Launched::new(plan, rows, Some(feed), started);
        launched.later = later;
        Ok(Some(launched))
    }

    /// Marks the chunks of `next` that did not run although their sequence goes on (their fed pick was
    /// made on the host), and gives their sampling draws back.
    fn mark_unrun(&mut self, next: &mut Launched, picked: &Picked, finished: &[(u64, FinishReason)]) {
        let Some(feed) = &next.feed else { return };
        for (i, c) in next.plan.batch.seqs.iter().enumerate() {
            let ends = finished.iter().any(|(id, _)| *id == c.seq_id);
            if feed.runs(i, &picked.tokens, &picked.on_device) || ends {
                continue;
            }
            let Some(live) = self.reqs.get_mut(&c.seq_id) else { continue };
            next.skip[i] = true;
            if let Some(row) = next.rows.get(i) {
                live.sampler.unread(row);
            }
        }
    }
}
