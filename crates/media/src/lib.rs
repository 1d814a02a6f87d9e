//! Images in requests: decoding (PNG, JPEG, WebP, GIF), the checkpoint's image processor settings, resizing
//! and patching exactly as Hugging Face does it, fetching images named by data or http(s) URLs, and a cache of
//! processed images by their encoded bytes.

mod cache;
mod config;
mod decode;
mod error;
mod fetch;
mod par;
mod patches;
mod resize;

pub use cache::ImageCache;
pub use config::{ImageProcessorConfig, Resample};
pub use decode::{MAX_DECODED_PIXELS, RgbImage, decode};
pub use error::{ConfigError, MediaError};
pub use fetch::{FetchPolicy, load};
pub use patches::{grid_for, preprocess};
pub use resize::{MAX_ASPECT_RATIO, resize_planar, smart_resize};
