//! The engine's request and event types: what a caller submits ([`Request`], an optional
//! [`TokenConstraint`]), what it receives ([`Event`]: tokens, the finish with its [`Usage`] and [`Timing`],
//! or an [`EngineError`]) and the engine's counters ([`EngineStats`]).

use std::sync::{Arc, Mutex};

use deltaserve_backend::ArenaStats;
use deltaserve_model::ImagePatches;
use deltaserve_sched::{AdmitError, SchedStats};

use crate::sampling::SamplingParams;

/// A validated generation request, in tokens.
#[derive(Clone, Debug, Default)]
pub struct Request {
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// Generation ends after one of these ids (it is included in the output ids, not in the text).
    pub stop_token_ids: Vec<u32>,
    /// Generation ends when the text contains one of these; the text is cut before it.
    pub stop_strings: Vec<String>,
    /// Return the sampled token's log-probability and this many top alternatives.
    pub logprobs: Option<usize>,
    /// Return every prompt token's log-probability (after the first) and this many top alternatives
    /// at each prompt position ([`Event::PromptLogprobs`]). Its prompt runs from the start (no
    /// prefix-cache hit), with every row's logits coming back.
    pub prompt_logprobs: Option<usize>,
    /// Prompt positions where the DeltaNet state is worth snapshotting for later requests (message
    /// starts, the end of the prompt before the generation prompt).
    pub snapshot_points: Vec<usize>,
    /// Snapshot the final state too (an agent loop's next request re-renders this turn).
    pub snapshot_on_finish: bool,
    /// Limits the tokens it may produce (structured outputs). Its rows are masked before they are
    /// sampled (on the device as a token bitmask where the backend takes one, else on the host); it
    /// drafts when the constraint checks drafts ([`TokenConstraint::allows_prefix`]), and no token the
    /// constraint refuses is ever emitted.
    pub constraint: Option<SharedConstraint>,
    /// The prompt's images in the order of their placeholder runs (each `tokens(merge)` image-pad ids).
    /// Only a backend that runs images accepts a request with any.
    pub images: Vec<Arc<ImagePatches>>,
    /// Send an [`Event::Prefill`] after every engine step that ran a part of the prompt.
    pub progress: bool,
    /// A stop string that ends the reply stays at the end of its text (vLLM's
    /// `include_stop_str_in_output`).
    pub include_stop_str: bool,
}

/// Which tokens a request may produce next (structured outputs: a grammar). The engine masks each
/// of the request's logits rows with it before sampling and tells it every token emitted. A
/// constraint that admits nothing further allows only the end-of-turn tokens, so the reply ends
/// with `stop`.
pub trait TokenConstraint: Send {
    /// Sets the logits of the tokens not allowed next to -inf.
    fn mask(&mut self, row: &mut [f32]);
    /// Follows an emitted token.
    fn accept(&mut self, token: u32);
    /// The tokens allowed next as a bitmask over `bits.len() * 32` ids: bit `id % 32` of word
    /// `id / 32` set when `id` is allowed (every bit is written). The default reads [`Self::mask`]
    /// over a row of zeros.
    fn allowed(&mut self, bits: &mut [u32]) {
        let mut row = vec![0.0f32; bits.len() * 32];
        self.mask(&mut row);
        deltaserve_backend::sampling::bits_of_row(&row, bits);
    }
    /// How many of `tokens`, in order, the constraint allows from where it stands, without following
    /// them: speculative drafts are checked with it, and the first it refuses ends their acceptance.
    /// None (the default): it cannot check tokens ahead, and its request does not draft.
    fn allows_prefix(&mut self, tokens: &[u32]) -> Option<usize> {
        let _ = tokens;
        None
    }
    /// A constraint of its own for another choice of the same prompt, in this one's place (None:
    /// it cannot be copied, and a request for several choices is refused).
    fn fork(&self) -> Option<SharedConstraint> {
        None
    }
}

/// A request's [`TokenConstraint`], shared so that a [`Request`] stays cloneable.
#[derive(Clone)]
pub struct SharedConstraint(Arc<Mutex<dyn TokenConstraint>>);

impl SharedConstraint {
    pub fn new(c: impl TokenConstraint + 'static) -> Self {
        Self(Arc::new(Mutex::new(c)))
    }

    /// See [`TokenConstraint::fork`].
    pub fn fork(&self) -> Option<SharedConstraint> {
        self.with(|c| c.fork())
    }

    /// Runs `f` on the constraint (locked meanwhile): for a constraint that holds another.
    pub fn with<R>(&self, f: impl FnOnce(&mut dyn TokenConstraint) -> R) -> R {
        let mut guard = self.0.lock().unwrap_or_else(|e| e.into_inner());
        f(&mut *guard)
    }
}

impl std::fmt::Debug for SharedConstraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SharedConstraint")
    }
}

/// Why generation ended.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// A stop token id.
    Stop,
    /// A stop string (given).
    StopString(String),
    /// `max_tokens` reached.
    Length,
}

/// Log-probabilities of a generated token (natural log, over the model's raw distribution).
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct TokenLogprob {
    pub logprob: f32,
    /// The most likely tokens at this position, best first.
    pub top: Vec<(u32, f32)>,
}

#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Prompt tokens restored from the prefix cache (KV pages + DeltaNet state snapshot).
    pub cached_tokens: usize,
}

#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct Timing {
    /// Submission → first admission.
    pub queue_ms: f64,
    /// Submission → first generated token.
    pub ttft_ms: f64,
    /// Submission → finish.
    pub total_ms: f64,
    /// Generated tokens per second after the first.
    pub decode_tokens_per_s: f64,
    pub preemptions: u32,
    /// Engine steps that ran this request's prompt (admission → first token) and their wall time:
    /// the rest of `ttft_ms - queue_ms` is spent outside the backend (scheduling, the engine loop).
    pub prefill_steps: u32,
    pub prefill_step_ms: f64,
    /// Speculative decoding: tokens the draft head proposed for this request, and how many of them
    /// the verify accepted (0 and 0 without speculation).
    pub draft_tokens: u64,
    pub accepted_tokens: u64,
}

/// What a request's stream carries.
#[derive(Clone, Debug)]
pub enum Event {
    /// A generated token and the text that became final with it (possibly empty: text is held back
    /// while it could still be the start of a stop string or an incomplete UTF-8 character).
    Token { id: u32, text: String, logprob: Option<TokenLogprob> },
    /// The prompt has advanced (only for a request that asked, [`Request::progress`]): `processed` of its
    /// `total` tokens are in the context, `cached` of them restored from the prefix cache; `elapsed_ms`
    /// since the request was first admitted. The last one has `processed == total` and comes before
    /// the first token.
    Prefill { processed: usize, total: usize, cached: usize, elapsed_ms: f64 },
    /// Log-probabilities of prompt tokens (only for a request that asked,
    /// [`Request::prompt_logprobs`]): entry i is of prompt token `from + i` (its id in `tokens`) given
    /// the tokens before it, with its rank (1: the most likely id there). They come in order, starting
    /// at token 1, all of them before the first token.
    PromptLogprobs { from: usize, tokens: Vec<u32>, logprobs: Vec<TokenLogprob>, ranks: Vec<usize> },
    /// The last event of a successful request.
    Finished { reason: FinishReason, usage: Usage, timing: Timing },
    /// The last event of a failed request.
    Error(EngineError),
}

#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Admit(#[from] AdmitError),
    #[error("invalid request: {0}")]
    Invalid(String),
    #[error("backend error: {0}")]
    Backend(String),
    #[error("the engine has stopped")]
    Stopped,
}

/// Snapshot of the engine's state for metrics and tests.
#[derive(Clone, Debug, Default)]
pub struct EngineStats {
    pub sched: SchedStats,
    pub arena: ArenaStats,
    pub steps: u64,
    /// Wall time of the backend's step calls (each returns with its outputs on the host), in
    /// seconds: the engine's compute, against which a request's time to first token can be split.
    /// A launched step counts from its launch, or from the previous collection when that is later,
    /// to its collection (launched steps overlap).
    pub step_seconds: f64,
    pub requests_finished: u64,
    pub requests_failed: u64,
    pub prompt_tokens: u64,
    pub generated_tokens: u64,
    /// Speculative decoding: sequence-steps that verified drafts, drafts made, drafts accepted (and
    /// emitted), tokens emitted by those steps.
    pub spec_steps: u64,
    pub spec_drafted: u64,
    pub spec_accepted: u64,
    pub spec_emitted: u64,
    /// Steps launched before the previous step's tokens were read (look-ahead).
    pub steps_ahead: u64,
}

impl EngineStats {
    /// Accepted drafts / drafts made (0 without speculation).
    pub fn acceptance_rate(&self) -> f64 {
        if self.spec_drafted == 0 { 0.0 } else { self.spec_accepted as f64 / self.spec_drafted as f64 }
    }
    /// Tokens emitted per speculative sequence-step (0 without speculation).
    pub fn tokens_per_spec_step(&self) -> f64 {
        if self.spec_steps == 0 { 0.0 } else { self.spec_emitted as f64 / self.spec_steps as f64 }
    }
}
