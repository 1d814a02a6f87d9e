//! deltaserve-cpu: the f32 CPU reference backend, the numerical oracle every other backend is
//! tested against. Plain loops, one file per op family, no speed tricks that need explaining.
//!
//! - [`linear`], [`norm`], [`activation`], [`conv`], [`rope`], [`attention`], [`gdn`]: the ops;
//! - [`model`]: the forward pass of one sequence with its carried state; [`moe`]: the sparse MLP;
//! - [`vision`]: the vision tower (images → embeddings); [`multimodal`]: prompts with images (image rows
//!   in place of image tokens, M-RoPE positions);
//! - [`tp`]: tensor parallelism simulated over in-memory ranks (sharded weights, explicit collectives);
//! - [`paged`]: the paged-arena backend; [`kvquant`]: the KV-cache storage formats it can emulate.

pub mod activation;
pub mod attention;
mod chunk_input;
pub mod conv;
pub mod gdn;
pub mod kvquant;
pub mod linear;
pub mod model;
pub mod moe;
pub mod multimodal;
pub mod norm;
pub mod paged;
pub mod rope;
pub mod tp;
pub mod vision;

pub use kvquant::{KvFormat, KvQuant, QuantizingCache};
pub use model::{CpuModel, ForwardError, GdnMode, GdnTrace, LayerState, Logits, Positions, SeqCache, SequenceState};
pub use paged::{CpuBackend, CpuCacheConfig, MAX_DRAFT_TOKENS};
pub use tp::{TpModel, TpSequence};
pub use vision::{ImageError, VisionTower};
