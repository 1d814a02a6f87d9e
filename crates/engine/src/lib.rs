//! deltaserve-engine: turning requests into tokens.
//!
//! - [`sampling`]: penalties and seeded sampling (greedy, temperature, top-k, top-p, min-p);
//! - [`generate`]: one request on the CPU reference model (prefill in pieces, decode, stop rules);
//! - [`synth`]: complete synthetic model directories and the built-in demo model.

pub mod generate;
pub mod sampling;
pub mod synth;

pub use generate::{FinishReason, GenerateError, GenerateOutput, GenerateRequest, generate};
pub use sampling::{Sampler, SamplingParams};
