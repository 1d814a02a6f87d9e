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

/// Turns a decoded image into patches exactly as Hugging Face's Qwen2-VL image processor does.
pub fn preprocess(cfg: &ImageProcessorConfig, img: &RgbImage) -> Result<ImagePatches, MediaError> {
    let (height, width) = smart_resize(img.height, img.width, cfg.factor(), cfg.min_pixels, cfg.max_pixels)?;
    let mut planes = resize_planar(img, height, width, cfg.resample);
    normalize(cfg, &mut planes, height * width);
    let (p, m, t) = (cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size);
    let (gh, gw) = (height / p, width / p);
    let row_len = 3 * t * p * p;
    let mut pixels = Vec::with_capacity(gh * gw * row_len);
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
    Ok(ImagePatches { grid_thw: [1, gh, gw], pixels, hash: img.hash() })
}

/// Rescales and normalises planar 0..255 values in place, with the scale folded into the mean and standard
/// deviation as the image processor does it (so the f32 results match to the last bit).
fn normalize(cfg: &ImageProcessorConfig, planes: &mut [f32], plane_len: usize) {
    for (c, plane) in planes.chunks_exact_mut(plane_len).enumerate() {
        let (mean, std) = match (cfg.do_rescale, cfg.do_normalize) {
            (true, true) => {
                let inv = (1.0 / cfg.rescale_factor) as f32;
                (cfg.image_mean[c] * inv, cfg.image_std[c] * inv)
            }
            (false, true) => (cfg.image_mean[c], cfg.image_std[c]),
            (true, false) => {
                let scale = cfg.rescale_factor as f32;
                plane.iter_mut().for_each(|v| *v *= scale);
                continue;
            }
            (false, false) => continue,
        };
        plane.iter_mut().for_each(|v| *v = (*v - mean) / std);
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
}
