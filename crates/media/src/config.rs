//! The checkpoint's image processor settings (`preprocessor_config.json`), with Hugging Face's Qwen2-VL
//! defaults for every key the file leaves out.

use std::path::Path;

use serde::Deserialize;

use crate::error::ConfigError;

/// The resampling filter used when an image is resized (PIL's numbering in the config file).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Resample {
    /// PIL 2: antialiased linear (triangle) filter.
    Bilinear,
    /// PIL 3: antialiased cubic filter (Keys, a = −0.5).
    Bicubic,
}

/// How images become patches for one checkpoint.
#[derive(Clone, Debug, PartialEq)]
pub struct ImageProcessorConfig {
    /// Side of one square patch, in pixels.
    pub patch_size: usize,
    /// Frames per patch along time; a still image is repeated this many times.
    pub temporal_patch_size: usize,
    /// Patches per side folded into one prompt token by the merger.
    pub merge_size: usize,
    /// Per-channel mean subtracted after rescaling.
    pub image_mean: [f32; 3],
    /// Per-channel standard deviation divided by after subtracting the mean.
    pub image_std: [f32; 3],
    /// Multiplies the 0..255 pixel values (usually 1/255).
    pub rescale_factor: f64,
    /// Fewest pixels (height × width) after resizing.
    pub min_pixels: u64,
    /// Most pixels (height × width) after resizing.
    pub max_pixels: u64,
    /// The resize filter.
    pub resample: Resample,
    /// Whether pixel values are multiplied by `rescale_factor`.
    pub do_rescale: bool,
    /// Whether pixel values are normalised with `image_mean` / `image_std`.
    pub do_normalize: bool,
}

impl Default for ImageProcessorConfig {
    fn default() -> Self {
        Self {
            patch_size: 14,
            temporal_patch_size: 2,
            merge_size: 2,
            image_mean: [0.481_454_66, 0.457_827_5, 0.408_210_73],
            image_std: [0.268_629_55, 0.261_302_6, 0.275_777_1],
            rescale_factor: 1.0 / 255.0,
            min_pixels: 56 * 56,
            max_pixels: 28 * 28 * 1280,
            resample: Resample::Bicubic,
            do_rescale: true,
            do_normalize: true,
        }
    }
}

#[derive(Deserialize)]
struct Size {
    shortest_edge: Option<u64>,
    longest_edge: Option<u64>,
}

#[derive(Deserialize)]
struct RawConfig {
    patch_size: Option<usize>,
    temporal_patch_size: Option<usize>,
    merge_size: Option<usize>,
    image_mean: Option<[f32; 3]>,
    image_std: Option<[f32; 3]>,
    rescale_factor: Option<f64>,
    size: Option<Size>,
    min_pixels: Option<u64>,
    max_pixels: Option<u64>,
    resample: Option<u32>,
    do_rescale: Option<bool>,
    do_normalize: Option<bool>,
}

impl ImageProcessorConfig {
    /// The image processor Qwen3.5 and Qwen3.6 checkpoints publish (patch 16, merge 2, 256 × 256 to
    /// 4096 × 4096 pixels, mean and std 0.5): used for a checkpoint without `preprocessor_config.json`.
    pub fn qwen35() -> Self {
        Self {
            patch_size: 16,
            image_mean: [0.5; 3],
            image_std: [0.5; 3],
            min_pixels: 65_536,
            max_pixels: 16_777_216,
            ..Self::default()
        }
    }

    /// `preprocessor_config.json` of the model directory `dir`, else [`Self::qwen35`].
    pub fn for_model_dir(dir: &Path) -> Result<Self, ConfigError> {
        let path = dir.join("preprocessor_config.json");
        if path.exists() { Self::from_file(&path) } else { Ok(Self::qwen35()) }
    }

    /// Reads `preprocessor_config.json` from a file.
    pub fn from_file(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path)
            .map_err(|source| ConfigError::Io { path: path.display().to_string(), source })?;
        Self::from_json(&text).map_err(|message| ConfigError::Invalid { path: path.display().to_string(), message })
    }

    /// Parses the JSON text of `preprocessor_config.json`.
    pub fn from_json(text: &str) -> Result<Self, String> {
        let raw: RawConfig = serde_json::from_str(text).map_err(|e| e.to_string())?;
        let d = Self::default();
        let size = raw.size.unwrap_or(Size { shortest_edge: None, longest_edge: None });
        let resample = match raw.resample {
            None | Some(3) => Resample::Bicubic,
            Some(2) => Resample::Bilinear,
            Some(other) => {
                return Err(format!("resample {other} is not supported (2 = bilinear and 3 = bicubic are)"));
            }
        };
        let cfg = Self {
            patch_size: raw.patch_size.unwrap_or(d.patch_size),
            temporal_patch_size: raw.temporal_patch_size.unwrap_or(d.temporal_patch_size),
            merge_size: raw.merge_size.unwrap_or(d.merge_size),
            image_mean: raw.image_mean.unwrap_or(d.image_mean),
            image_std: raw.image_std.unwrap_or(d.image_std),
            rescale_factor: raw.rescale_factor.unwrap_or(d.rescale_factor),
            min_pixels: raw.min_pixels.or(size.shortest_edge).unwrap_or(d.min_pixels),
            max_pixels: raw.max_pixels.or(size.longest_edge).unwrap_or(d.max_pixels),
            resample,
            do_rescale: raw.do_rescale.unwrap_or(true),
            do_normalize: raw.do_normalize.unwrap_or(true),
        };
        if cfg.patch_size == 0 || cfg.temporal_patch_size == 0 || cfg.merge_size == 0 {
            return Err("patch_size, temporal_patch_size and merge_size must be positive".into());
        }
        if cfg.min_pixels > cfg.max_pixels || cfg.max_pixels == 0 {
            return Err(format!("size: shortest_edge {} exceeds longest_edge {}", cfg.min_pixels, cfg.max_pixels));
        }
        if cfg.image_std.contains(&0.0) {
            return Err("image_std must not contain 0".into());
        }
        Ok(cfg)
    }

    /// The side every resized dimension is a multiple of: one merge window of patches.
    pub fn factor(&self) -> usize {
        self.patch_size * self.merge_size
    }

    /// Prompt tokens for an image of `grid_thw` patches.
    pub fn tokens(&self, grid_thw: [usize; 3]) -> usize {
        grid_thw.iter().product::<usize>() / (self.merge_size * self.merge_size)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_qwen35_style_config() {
        let cfg = ImageProcessorConfig::from_json(
            r#"{"patch_size": 16, "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
                "image_std": [0.5, 0.5, 0.5], "rescale_factor": 0.00392156862745098, "resample": 3,
                "size": {"longest_edge": 65536, "shortest_edge": 1024}}"#,
        )
        .unwrap();
        assert_eq!((cfg.patch_size, cfg.factor(), cfg.min_pixels, cfg.max_pixels), (16, 32, 1024, 65536));
        assert_eq!(cfg.image_mean, [0.5; 3]);
        assert_eq!(cfg.resample, Resample::Bicubic);
        assert_eq!(cfg.tokens([1, 4, 6]), 6);
    }

    #[test]
    fn a_model_directory_without_the_file_gets_qwen35_settings() {
        let dir = std::env::temp_dir().join(format!("deltaserve-media-cfg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        assert_eq!(ImageProcessorConfig::for_model_dir(&dir).unwrap(), ImageProcessorConfig::qwen35());
        std::fs::write(dir.join("preprocessor_config.json"), r#"{"patch_size": 14}"#).unwrap();
        assert_eq!(ImageProcessorConfig::for_model_dir(&dir).unwrap().patch_size, 14);
        std::fs::write(dir.join("preprocessor_config.json"), "{").unwrap();
        let err = ImageProcessorConfig::for_model_dir(&dir).unwrap_err().to_string();
        assert!(err.contains("invalid preprocessor config"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn min_max_pixels_override_size_and_defaults_fill_gaps() {
        let cfg = ImageProcessorConfig::from_json(r#"{"min_pixels": 100, "max_pixels": 200}"#).unwrap();
        assert_eq!((cfg.min_pixels, cfg.max_pixels, cfg.patch_size), (100, 200, 14));
    }

    #[test]
    fn refuses_unknown_resample_and_bad_sizes() {
        let err = ImageProcessorConfig::from_json(r#"{"resample": 1}"#).unwrap_err();
        assert!(err.contains("resample 1"), "{err}");
        let err = ImageProcessorConfig::from_json(r#"{"size": {"shortest_edge": 9, "longest_edge": 4}}"#).unwrap_err();
        assert!(err.contains("exceeds"), "{err}");
    }
}
