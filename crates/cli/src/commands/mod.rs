//! One module per subcommand.

pub mod generate;
pub mod logits;
pub mod synth;
