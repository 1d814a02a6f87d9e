//! deltaserve-engine: turning requests into tokens.
//!
//! - [`engine`]: the engine thread (continuous batching over a [`deltaserve_backend::Backend`]) and its handle;
//! - [`sampling`]: a request's sampler (parameters, seeded RNG, generated counts), turned each step into the
//!   backend's `RowSampling` (the rule itself: `deltaserve_backend::sampling`);
//! - [`generate`]: one request on the CPU reference model (prefill in pieces, decode, stop rules);
//! - [`synth`]: complete synthetic model directories and the built-in demo model.

pub mod engine;
pub mod generate;
pub mod sampling;
pub mod synth;

pub use engine::{
    EngineError, EngineHandle, EngineOptions, EngineStats, Event, MAX_SPECULATIVE_TOKENS, Request, RequestStream,
    Timing, TokenLogprob, Usage,
};
pub use generate::{FinishReason, GenerateError, GenerateOutput, GenerateRequest, generate};
pub use sampling::{Sampler, SamplingParams};
