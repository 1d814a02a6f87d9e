//! [`PlanError`]: why a plan does not fit. Every message says what does not fit, how much does, and what to change.

use crate::size::{fmt_bytes as b, fmt_count as c};

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PlanError {
    /// An option is out of range (zero tokens per step, more sequences than tokens, …).
    #[error("{option} {value}: {reason}")]
    InvalidOption { option: &'static str, value: String, reason: String },

    /// The weights (plus the runtime reserve) alone exceed the budget.
    #[error(
        "the weights alone need {} at {dtype} + {} runtime reserve, more than --memory {}: {hint}",
        b(*weights), b(*runtime_reserve), b(*budget)
    )]
    WeightsDoNotFit { weights: u64, dtype: String, runtime_reserve: u64, budget: u64, hint: String },

    /// Weights fit, but weights + state slots + snapshots + activations + … exceed the budget.
    #[error(
        "weights ({}) and the fixed regions ({breakdown}) need {}, {} more than --memory {}: {hint}",
        b(*weights), b(*fixed), b(fixed - budget), b(*budget)
    )]
    FixedRegionsDoNotFit { weights: u64, fixed: u64, budget: u64, breakdown: String, hint: String },

    /// Everything fixed fits, but not one KV page is left.
    #[error(
        "after weights ({}) and fixed regions only {} of --memory {} is left, less than one KV page ({} for {} tokens at {kv}): {hint}",
        b(*weights), b(*left), b(*budget), b(*page_bytes), page_size
    )]
    NoKvPage { weights: u64, left: u64, budget: u64, page_bytes: u64, page_size: usize, kv: String, hint: String },

    /// The requested context does not fit one sequence.
    #[error(
        "--max-context {} needs {} of KV at {kv}, {} is left after weights ({}) and fixed regions: at most {} tokens fit; {hint}",
        c(*requested as u64), b(*needed), b(*left), b(*weights), c(*fits as u64)
    )]
    ContextDoesNotFit { requested: usize, needed: u64, left: u64, weights: u64, fits: usize, kv: String, hint: String },

    /// The requested context is longer than the model's positions.
    #[error(
        "--max-context {} exceeds the model's max_position_embeddings ({}); YaRN scaling is not supported: use --max-context {} or less",
        c(*requested as u64), c(*model_max as u64), c(*model_max as u64)
    )]
    ContextExceedsModel { requested: usize, model_max: usize },

    /// A size does not fit in 64 bits (a corrupt or absurd config).
    #[error("{what} overflows 64 bits; check the model config")]
    Overflow { what: &'static str },
}
