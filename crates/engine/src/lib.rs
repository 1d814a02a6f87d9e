//! deltaserve-engine: turning requests into tokens.
//!
//! - [`engine`]: the engine thread (continuous batching over a [`deltaserve_backend::Backend`]) and its handle;
//! - [`sampling`]: a request's sampler (parameters, seeded RNG, generated counts), turned each step into the
//!   backend's `RowSampling` (the rule itself: `deltaserve_backend::sampling`);
//! - [`score`]: every position's logits of one sequence through a backend (`logits`, `eval kld`).

pub mod engine;
pub mod sampling;
pub mod score;

pub use engine::{
    EngineError, EngineHandle, EngineOptions, EngineStats, Event, FinishReason, MAX_SPECULATIVE_TOKENS,
    NO_PROMPT_LOGPROBS, NO_VISION_TOWER, Request, RequestStream, SharedConstraint, Timing, TokenConstraint,
    TokenLogprob, Usage,
};
pub use sampling::{Sampler, SamplingParams};
pub use score::{ScoreError, logits_at_every_position, logits_with_images};
