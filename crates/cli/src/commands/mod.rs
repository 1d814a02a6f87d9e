//! One module per subcommand.

pub mod bench;
pub mod eval;
pub mod generate;
pub mod kernels;
pub mod logits;
pub mod plan;
pub mod probe;
pub mod serve;
pub mod soak;
mod soak_sessions;
pub mod synth;
