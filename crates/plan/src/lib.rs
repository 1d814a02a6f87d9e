//! deltaserve-plan: the ONE static memory plan, computed before anything is allocated.
//!
//! [`Plan::new`] is a pure function of the model shape ([`ModelConfig`]) and the limits ([`PlanOptions`]).
//! It sizes every region of a single device arena (weights, KV pages, DeltaNet state slots, state snapshots,
//! the activation workspace, logits, block tables, the GEMM workspace, the backend's scratch), gives each a 256-byte aligned offset,
//! and hands ALL memory left over to KV pages, so the context it reports can be filled to 100%.
//!
//! - [`dtype`]: storage formats of weights and KV, with their exact byte costs;
//! - [`weights`]: bytes of the model's weights per format, split device / pinned host;
//! - [`vision`]: the vision tower's weights and its activation workspace, bounded by the patches it runs
//!   at once (`--max-image-tokens-per-step`);
//! - [`workspace`]: the activation workspace of one engine step, planned by liveness (first-fit by lifetime);
//!   bounded by tokens per step and sequences per step, never by prompt length or context;
//! - [`cuda`]: what the CUDA backend carves beside the generic regions (its scratch, its weights' device
//!   layout), and [`CheckpointTensors`], what a quantised checkpoint's tensors need there;
//! - [`fit_context`]: aims at the model's full context by default, trading the knobs the user left open;
//! - [`render`]: the human table, the JSON object and the SVG chart.
//!
//! This crate allocates nothing; it prices what each backend carves ([`PlanOptions::backend`]).
//!
//! [`ModelConfig`]: deltaserve_model::ModelConfig

#![recursion_limit = "256"]

mod checkpoint;
pub mod cuda;
pub mod dtype;
mod error;
mod fit;
mod options;
mod plan;
mod render;
pub mod size;
pub mod vision;
pub mod weights;
pub mod workspace;

pub use checkpoint::{CheckpointTensors, act_order, is_f32_tensor, is_linear};
pub use dtype::{KvDtype, StateDtype, WeightsDtype};
pub use error::PlanError;
pub use fit::{Fitted, Free, NEAR_BEST, fit_context};
pub use options::{COLLECTIVE_RESERVE_BYTES, MAX_DECODE_PARTITIONS, PlanBackend, PlanOptions};
pub use plan::{ALIGN, Plan, Region, card_config};
pub use size::{fmt_bytes, fmt_count, parse_size};
pub use vision::{CudaTowerLayout, MIN_DEFAULT_IMAGE_TOKENS, default_max_image_tokens};
pub use weights::WeightBytes;
pub use workspace::{SamplingScratch, WorkspaceBuffer, WorkspaceLayout};
