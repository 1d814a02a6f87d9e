//! deltaserve-model: what a model *is*, independent of any backend.
//!
//! - [`config`]: `config.json` → validated [`ModelConfig`] and derived [`Dims`];
//! - [`moe`]: the mixture-of-experts fields ([`MoeConfig`]): which layers are sparse, experts, top-k;
//! - [`image`]: a preprocessed image ([`ImagePatches`]), what the vision tower consumes;
//! - [`vision`]: the vision tower's config ([`VisionConfig`]) and weights ([`VisionWeights`]);
//! - [`mrope`]: the (t, h, w) M-RoPE positions of a prompt with images (HF's `get_rope_index`);
//! - [`checkpoint`]: memory-mapped safetensors (single file or sharded), dtype conversion;
//! - [`weights`]: the canonical per-layer weight set, with HF names mapped and Qwen3-Next packing undone;
//! - [`quant`]: `quantization_config` and the GPTQ / block-FP8 encodings of quantised linears;
//! - [`shard`]: tensor-parallel sharding of every weight (which rows / columns a rank holds);
//! - [`synth`]: random-weight model directories at any shape (tests, the demo model, benchmarks).

pub mod checkpoint;
pub mod config;
pub mod error;
pub mod image;
pub mod moe;
mod moe_weights;
pub mod mrope;
pub mod quant;
pub mod shard;
pub mod synth;
pub mod vision;
pub mod weights;

pub use checkpoint::{Checkpoint, DType, TensorRef};
pub use config::{Arch, Dims, LayerKind, ModelConfig};
pub use error::ModelError;
pub use image::ImagePatches;
pub use moe::MoeConfig;
pub use mrope::{MropePositions, PlacedImage, place_images, rope_index};
pub use quant::{Quantization, QuantizedSource};
pub use shard::{ShardSpec, Split, TensorShard};
pub use vision::{VisionAct, VisionConfig, VisionWeights};
pub use weights::{
    AttentionWeights, DeltaNetWeights, LayerWeights, MixerWeights, MlpWeights, ModelWeights, MoeWeights, MtpWeights,
};
