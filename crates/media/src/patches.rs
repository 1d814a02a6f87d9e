//! Decoded pixels to the vision tower's input: resize, rescale and normalise, repeat the frame along time,
//! and lay the patches out in the image processor's order (each merge window's patches contiguous).

use deltaserve_model::ImagePatches;

use crate::config::ImageProcessorConfig;
use crate::decode::RgbImage;
use crate::error::MediaError;
use crate::resize::{resize_planar, smart_resize};

/// The patch grid `[t, h, w]` an image of this size gets, without resizing it.
pub fn grid_for(cfg: &ImageProcessorConfig, width: u32, height: u32) -> Result<[usize; 3], MediaError> {
    let (h, w) = smart_resize(height, width, cfg.factor(), cfg.min_pixels, cfg.max_pixels)?;
    Ok([1, h / cfg.patch_size, w / cfg.patch_size])
}

/// Turns a decoded image into patches exactly as Hugging Face's Qwen2-VL image processor does. The patches
/// are filled in parallel (each value rescaled and normalised on its way into its patch).
pub fn preprocess(cfg: &ImageProcessorConfig, img: &RgbImage) -> Result<ImagePatches, MediaError> {
    let (height, width) = smart_resize(img.height, img.width, cfg.factor(), cfg.min_pixels, cfg.max_pixels)?;
    let planes = resize_planar(img, height, width, cfg.resample);
    let norms = [0, 1, 2].map(|c| Norm::of(cfg, c));
    let (p, m, t) = (cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size);
    let (gh, gw) = (height / p, width / p);
    let row_len = 3 * t * p * p;
    let plane_len = height * width;
    let mut pixels = vec![0f32; gh * gw * row_len];
    // Patch n: merge window n / m² in raster order of windows, patch n % m² in raster order inside it; its
    // row holds each channel's p × p values, repeated t times along time.
    crate::par::rows(&mut pixels, row_len, |n, dst| {
        let (win, inner) = (n / (m * m), n % (m * m));
        let (bh, bw, mh, mw) = (win / (gw / m), win % (gw / m), inner / m, inner % m);
        let (y0, x0) = ((bh * m + mh) * p, (bw * m + mw) * p);
        let mut out = dst.chunks_exact_mut(p);
        for (c, norm) in norms.iter().enumerate() {
            let plane = &planes[c * plane_len..(c + 1) * plane_len];
            for _ in 0..t {
                for py in 0..p {
                    let row = (y0 + py) * width + x0;
                    let d = out.next().expect("a patch row holds 3 · t · p runs of p values");
                    for (d, &v) in d.iter_mut().zip(&plane[row..row + p]) {
                        *d = norm.apply(v);
                    }
                }
            }
        }
    });
    Ok(ImagePatches { grid_thw: [1, gh, gw], pixels, hash: img.hash() })
}

/// Rescaling and normalisation of one channel's 0..255 values, with the scale folded into the mean and
/// standard deviation as the image processor does it (so the f32 results match to the last bit).
#[derive(Clone, Copy)]
enum Norm {
    MeanStd(f32, f32),
    Scale(f32),
    None,
}

impl Norm {
    fn of(cfg: &ImageProcessorConfig, c: usize) -> Norm {
        match (cfg.do_rescale, cfg.do_normalize) {
            (true, true) => {
                let inv = (1.0 / cfg.rescale_factor) as f32;
                Norm::MeanStd(cfg.image_mean[c] * inv, cfg.image_std[c] * inv)
            }
            (false, true) => Norm::MeanStd(cfg.image_mean[c], cfg.image_std[c]),
            (true, false) => Norm::Scale(cfg.rescale_factor as f32),
            (false, false) => Norm::None,
        }
    }

    fn apply(self, v: f32) -> f32 {
        match self {
            Norm::MeanStd(mean, std) => (v - mean) / std,
            Norm::Scale(s) => v * s,
            Norm::None => v,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patch_rows_follow_merge_windows() {
        // A 4 × 4 image, patch 1, merge 2, temporal 2: grid 4 × 4, rows in 2 × 2 windows.
        let cfg = ImageProcessorConfig {
            patch_size: 1,
            merge_size: 2,
            temporal_patch_size: 2,
            min_pixels: 1,
            max_pixels: 1 << 20,
            do_normalize: false,
            do_rescale: false,
            ..Default::default()
        };
        let rgb = (0..16u8).flat_map(|i| [i, 100 + i, 200]).collect();
        let img = RgbImage { width: 4, height: 4, rgb };
        let out = preprocess(&cfg, &img).unwrap();
        assert_eq!(out.grid_thw, [1, 4, 4]);
        // Row features are channel × time; row order is window (0,0): pixels 0, 1, 4, 5, then window (0,1).
        let red: Vec<f32> = out.pixels.chunks_exact(6).map(|r| r[0]).collect();
        assert_eq!(red[..8], [0.0, 1.0, 4.0, 5.0, 2.0, 3.0, 6.0, 7.0]);
        assert_eq!(out.pixels[..6], [0.0, 0.0, 100.0, 100.0, 200.0, 200.0]);
        assert_eq!(out.hash, img.hash());
        assert_eq!(grid_for(&cfg, 4, 4).unwrap(), out.grid_thw);
    }

    /// Normalised in place, then patched one value at a time: how the patches were first made.
    fn patches_one_at_a_time(cfg: &ImageProcessorConfig, img: &RgbImage) -> Vec<f32> {
        let (height, width) =
            smart_resize(img.height, img.width, cfg.factor(), cfg.min_pixels, cfg.max_pixels).unwrap();
        let mut planes = resize_planar(img, height, width, cfg.resample);
        for (c, plane) in planes.chunks_exact_mut(height * width).enumerate() {
            let n = Norm::of(cfg, c);
            plane.iter_mut().for_each(|v| *v = n.apply(*v));
        }
        let (p, m, t) = (cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size);
        let (gh, gw) = (height / p, width / p);
        let mut pixels = Vec::new();
        for bh in 0..gh / m {
            for bw in 0..gw / m {
                for mh in 0..m {
                    for mw in 0..m {
                        let (y0, x0) = ((bh * m + mh) * p, (bw * m + mw) * p);
                        for c in 0..3 {
                            let plane = &planes[c * height * width..(c + 1) * height * width];
                            for _ in 0..t {
                                for py in 0..p {
                                    let row = (y0 + py) * width + x0;
                                    pixels.extend_from_slice(&plane[row..row + p]);
                                }
                            }
                        }
                    }
                }
            }
        }
        pixels
    }

    #[test]
    fn parallel_patches_equal_one_value_at_a_time() {
        for (w, h) in [(640u32, 480u32), (1000, 300), (96, 2000)] {
            let rgb = (0..(w * h * 3) as usize).map(|i| ((i * 7919 + i / 11) % 256) as u8).collect();
            let img = RgbImage { width: w, height: h, rgb };
            for (do_rescale, do_normalize) in [(true, true), (false, true), (true, false), (false, false)] {
                let cfg = ImageProcessorConfig { do_rescale, do_normalize, ..ImageProcessorConfig::qwen35() };
                let got = preprocess(&cfg, &img).unwrap().pixels;
                let want = patches_one_at_a_time(&cfg, &img);
                let same = got.len() == want.len() && got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{w}x{h} rescale {do_rescale} normalize {do_normalize}");
            }
        }
    }
}
