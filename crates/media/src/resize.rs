//! Image sizes and resampling as Hugging Face's Qwen2-VL image processor does them: `smart_resize` picks a
//! size that is a multiple of one merge window within the pixel budget, and the resize is torchvision's
//! antialiased one on 8-bit images (separable, width then height, each pass rounded back to 8 bits; PyTorch
//! does it in fixed point, so a value may differ by one step).

use crate::config::Resample;
use crate::decode::RgbImage;
use crate::error::MediaError;

/// The largest aspect ratio (long side over short side) the image processor accepts.
pub const MAX_ASPECT_RATIO: u32 = 200;

/// The `(height, width)` an image is resized to: each a multiple of `factor`, their product within
/// `[min_pixels, max_pixels]` where rounding allows, the aspect ratio kept as closely as possible.
pub fn smart_resize(
    height: u32,
    width: u32,
    factor: usize,
    min_pixels: u64,
    max_pixels: u64,
) -> Result<(usize, usize), MediaError> {
    if height == 0 || width == 0 {
        return Err(MediaError::TooSmall { width, height, min: 1 });
    }
    let (h, w) = (f64::from(height), f64::from(width));
    if h.max(w) / h.min(w) > f64::from(MAX_ASPECT_RATIO) {
        return Err(MediaError::ExtremeAspect { width, height, max: MAX_ASPECT_RATIO });
    }
    let f = factor as f64;
    // Python's `round` rounds halves to even.
    let mut h_bar = (h / f).round_ties_even() * f;
    let mut w_bar = (w / f).round_ties_even() * f;
    if h_bar * w_bar > max_pixels as f64 {
        let beta = (h * w / max_pixels as f64).sqrt();
        h_bar = f.max((h / beta / f).floor() * f);
        w_bar = f.max((w / beta / f).floor() * f);
    } else if h_bar * w_bar < min_pixels as f64 {
        let beta = (min_pixels as f64 / (h * w)).sqrt();
        h_bar = (h * beta / f).ceil() * f;
        w_bar = (w * beta / f).ceil() * f;
    }
    Ok((h_bar as usize, w_bar as usize))
}

/// Resizes an RGB image to `height × width`, returning planar f32 channels `[3][height][width]` holding
/// the 8-bit results (0..=255, whole numbers), as torchvision's uint8 resize leaves them. The rows of each pass
/// are split over a few threads; every value is the same sum in the same order as one output at a time.
pub fn resize_planar(img: &RgbImage, height: usize, width: usize, resample: Resample) -> Vec<f32> {
    let (in_h, in_w) = (img.height as usize, img.width as usize);
    let mut planes = vec![0f32; 3 * in_h * in_w];
    // Row r of the planes: channel r / in_h of image row r % in_h.
    crate::par::rows(&mut planes, in_w, |r, dst| {
        let (c, y) = (r / in_h, r % in_h);
        for (d, px) in dst.iter_mut().zip(img.rgb[3 * y * in_w..3 * (y + 1) * in_w].chunks_exact(3)) {
            *d = f32::from(px[c]);
        }
    });
    if (in_h, in_w) == (height, width) {
        return planes;
    }
    // Width first, then height, each pass rounded and clamped to 8 bits as PyTorch's uint8 kernel does.
    let mut cur = planes;
    if width != in_w {
        let taps = Taps::new(in_w, width, resample);
        let mut out = vec![0f32; 3 * in_h * width];
        // Output row r of the 3 · in_h rows filters source row r.
        crate::par::rows(&mut out, width, |r, dst| {
            let src = &cur[r * in_w..(r + 1) * in_w];
            for (x, d) in dst.iter_mut().enumerate() {
                *d = to_u8(taps.apply(x, |k| src[k]));
            }
        });
        cur = out;
    }
    if height != in_h {
        let taps = Taps::new(in_h, height, resample);
        let mut out = vec![0f32; 3 * height * width];
        // Output row r (channel r / height, row y = r % height) sums its taps' source rows of that channel,
        // a row at a time, each sum started and added in the order of one output at a time.
        crate::par::rows(&mut out, width, |r, dst| {
            let (c, y) = (r / height, r % height);
            let mut acc = vec![-0.0f64; width];
            for (j, &w) in taps.weights[y].iter().enumerate() {
                let k = c * in_h + taps.start[y] + j;
                for (a, &v) in acc.iter_mut().zip(&cur[k * width..(k + 1) * width]) {
                    *a += w * f64::from(v);
                }
            }
            for (d, a) in dst.iter_mut().zip(acc) {
                *d = to_u8(a as f32);
            }
        });
        cur = out;
    }
    cur
}

/// A filtered value back to an 8-bit level (halves round up, as fixed-point rounding does).
fn to_u8(v: f32) -> f32 {
    v.round().clamp(0.0, 255.0)
}

/// The source range and normalised weights of every output position along one axis (PyTorch's
/// antialiased interpolation: the filter widens by the scale when shrinking).
struct Taps {
    start: Vec<usize>,
    weights: Vec<Vec<f64>>,
}

impl Taps {
    fn new(in_size: usize, out_size: usize, resample: Resample) -> Self {
        let (support_1, filter): (f64, fn(f64) -> f64) = match resample {
            Resample::Bicubic => (2.0, cubic),
            Resample::Bilinear => (1.0, |x: f64| (1.0 - x.abs()).max(0.0)),
        };
        let scale = in_size as f64 / out_size as f64;
        let (support, inv_scale) = if scale >= 1.0 { (support_1 * scale, 1.0 / scale) } else { (support_1, 1.0) };
        let mut start = Vec::with_capacity(out_size);
        let mut weights = Vec::with_capacity(out_size);
        for i in 0..out_size {
            let center = scale * (i as f64 + 0.5);
            let lo = ((center - support + 0.5) as i64).max(0) as usize;
            let hi = ((center + support + 0.5) as i64).min(in_size as i64) as usize;
            let mut w: Vec<f64> = (lo..hi).map(|j| filter((j as f64 - center + 0.5) * inv_scale)).collect();
            let total: f64 = w.iter().sum();
            if total != 0.0 {
                w.iter_mut().for_each(|v| *v /= total);
            }
            start.push(lo);
            weights.push(w);
        }
        Self { start, weights }
    }

    fn apply(&self, i: usize, src: impl Fn(usize) -> f32) -> f32 {
        let lo = self.start[i];
        self.weights[i].iter().enumerate().map(|(j, w)| w * f64::from(src(lo + j))).sum::<f64>() as f32
    }
}

/// Keys' cubic convolution kernel with a = −0.5.
fn cubic(x: f64) -> f64 {
    const A: f64 = -0.5;
    let x = x.abs();
    if x < 1.0 {
        ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0
    } else if x < 2.0 {
        (((x - 5.0) * x + 8.0) * x - 4.0) * A
    } else {
        0.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn smart_resize_matches_hugging_face() {
        // Values from transformers' smart_resize (factor 32 unless given).
        assert_eq!(smart_resize(64, 96, 32, 1024, 65536).unwrap(), (64, 96));
        assert_eq!(smart_resize(75, 50, 32, 1024, 65536).unwrap(), (64, 64));
        assert_eq!(smart_resize(30, 40, 32, 9216, 65536).unwrap(), (96, 128));
        assert_eq!(smart_resize(150, 200, 32, 1024, 9216).unwrap(), (64, 96));
        // Halves round to even, as Python's round does: 48/32 = 1.5 → 2, 80/32 = 2.5 → 2.
        assert_eq!(smart_resize(48, 80, 32, 1024, 65536).unwrap(), (64, 64));
        assert_eq!(smart_resize(1080, 1920, 28, 3136, 1003520).unwrap(), (728, 1316));
    }

    #[test]
    fn smart_resize_refuses_extreme_aspect_and_empty_images() {
        let err = smart_resize(10, 2010, 32, 1024, 65536).unwrap_err();
        assert!(matches!(err, MediaError::ExtremeAspect { .. }), "{err}");
        assert!(err.to_string().contains("200:1"), "{err}");
        assert!(smart_resize(10, 2000, 32, 1024, 1 << 30).is_ok());
        assert!(matches!(smart_resize(0, 5, 32, 1024, 65536), Err(MediaError::TooSmall { .. })));
    }

    /// One output at a time, as the resize was first written: the reference for the row-wise passes.
    fn resize_one_at_a_time(img: &RgbImage, height: usize, width: usize, resample: Resample) -> Vec<f32> {
        let (in_h, in_w) = (img.height as usize, img.width as usize);
        let mut cur = vec![0f32; 3 * in_h * in_w];
        for (i, px) in img.rgb.chunks_exact(3).enumerate() {
            for c in 0..3 {
                cur[c * in_h * in_w + i] = f32::from(px[c]);
            }
        }
        let mut cur_w = in_w;
        if width != in_w {
            let taps = Taps::new(in_w, width, resample);
            let mut out = vec![0f32; 3 * in_h * width];
            for (src, dst) in cur.chunks_exact(in_w).zip(out.chunks_exact_mut(width)) {
                for (x, d) in dst.iter_mut().enumerate() {
                    *d = to_u8(taps.apply(x, |k| src[k]));
                }
            }
            cur = out;
            cur_w = width;
        }
        if height != in_h {
            let taps = Taps::new(in_h, height, resample);
            let mut out = vec![0f32; 3 * height * cur_w];
            for c in 0..3 {
                let src = &cur[c * in_h * cur_w..(c + 1) * in_h * cur_w];
                for y in 0..height {
                    for x in 0..cur_w {
                        out[(c * height + y) * cur_w + x] = to_u8(taps.apply(y, |k| src[k * cur_w + x]));
                    }
                }
            }
            cur = out;
        }
        cur
    }

    #[test]
    fn row_wise_passes_equal_one_output_at_a_time() {
        let noisy = |w: u32, h: u32| RgbImage {
            width: w,
            height: h,
            rgb: (0..(w * h * 3) as usize).map(|i| ((i * 7919 + i / 7) % 256) as u8).collect(),
        };
        for (w, h, out_w, out_h) in
            [(640, 480, 448, 320), (300, 200, 640, 448), (1000, 37, 1024, 64), (33, 700, 32, 704), (512, 512, 512, 256)]
        {
            let img = noisy(w, h);
            for resample in [Resample::Bicubic, Resample::Bilinear] {
                let got = resize_planar(&img, out_h, out_w, resample);
                let want = resize_one_at_a_time(&img, out_h, out_w, resample);
                let same = got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same && got.len() == want.len(), "{w}x{h} -> {out_w}x{out_h} {resample:?}");
            }
        }
    }

    #[test]
    fn same_size_is_identity_and_flat_images_stay_flat() {
        let img = RgbImage { width: 3, height: 2, rgb: (0..18).map(|v| v * 10).collect() };
        let planes = resize_planar(&img, 2, 3, Resample::Bicubic);
        assert_eq!(planes[0..6], [0.0, 30.0, 60.0, 90.0, 120.0, 150.0]);
        let flat = RgbImage { width: 7, height: 5, rgb: vec![77; 7 * 5 * 3] };
        for (h, w) in [(3, 4), (10, 14)] {
            for r in [Resample::Bicubic, Resample::Bilinear] {
                assert!(resize_planar(&flat, h, w, r).iter().all(|&v| v == 77.0));
            }
        }
    }
}
