//! A request's state on the engine thread, from submission to its last event.

use std::time::Instant;

use deltaserve_text::{IncrementalDecoder, StopMatcher};
use tokio::sync::mpsc as tmpsc;

use super::choices::Choice;
use super::{Event, Request, images};
use crate::sampling::Sampler;

/// Per-request state on the engine thread.
pub(super) struct Live {
    pub(super) req: Request,
    pub(super) tx: tmpsc::UnboundedSender<Event>,
    pub(super) sampler: Sampler,
    pub(super) decoder: IncrementalDecoder,
    pub(super) stops: StopMatcher,
    pub(super) submitted: Instant,
    pub(super) admitted: Option<Instant>,
    pub(super) first_token: Option<Instant>,
    pub(super) generated: usize,
    pub(super) preemptions: u32,
    /// Steps (and their seconds) that ran this request before its first token.
    pub(super) prefill_steps: u32,
    pub(super) prefill_step_s: f64,
    /// Speculative decoding: tokens drafted for it, and accepted.
    pub(super) drafted: u64,
    pub(super) accepted: u64,
    /// When its prompt's progress was last logged (a long prompt logs it every
    /// [`super::PROGRESS_LOG_EVERY`]).
    pub(super) progress_logged: Option<Instant>,
    /// The other choices of its prompt, forked from it once the prompt has run.
    pub(super) forks: Vec<Choice>,
    /// It is one of those (its prompt counts once, with the first choice).
    pub(super) forked: bool,
    /// Its images where its prompt holds them (empty for text).
    pub(super) images: images::Placed,
    /// The next prompt token whose log-probability it is sent ([`Request::prompt_logprobs`]; a
    /// prompt run again after a preemption sends none twice).
    pub(super) prompt_scored: usize,
}

impl Live {
    pub(super) fn new(req: Request, tx: tmpsc::UnboundedSender<Event>, submitted: Instant, valid_vocab: usize) -> Self {
        Self {
            sampler: Sampler::new(req.sampling.clone(), valid_vocab).banning_stops(&req.stop_token_ids),
            stops: StopMatcher::new(req.stop_strings.clone()),
            req,
            tx,
            decoder: IncrementalDecoder::new(true),
            submitted,
            admitted: None,
            first_token: None,
            generated: 0,
            preemptions: 0,
            prefill_steps: 0,
            prefill_step_s: 0.0,
            drafted: 0,
            accepted: 0,
            progress_logged: None,
            forks: Vec::new(),
            forked: false,
            images: Vec::new(),
            prompt_scored: 1,
        }
    }
}
