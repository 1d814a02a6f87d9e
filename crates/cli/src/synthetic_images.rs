//! Synthetic screenshots for the load tools (`probe --images`, `soak --screenshot`), deterministic from a
//! seed: a window with a title bar, a sidebar, lines of text-like blocks and a few buttons, PNG-encoded
//! and sent as data URLs in OpenAI `image_url` parts. Every seed gives different pixels (the prefix cache
//! keys an image by the hash of its decoded pixels), and a seed's picture is the same in every run.
//!
//! Before a tool sends images it checks that the server takes them ([`ImageCheck::run`]): a vision tower
//! is loaded, an image of the size fits the tower's patches a step, and a request may carry as many
//! images as the tool will put in one. Each refusal is one error naming the flag and the server's reason.

use std::fmt;
use std::io::Cursor;
use std::str::FromStr;

use anyhow::{Context, Result, anyhow, bail};
use base64::Engine as _;
use deltaserve_media::{ImageProcessorConfig, grid_for};
use serde_json::{Value, json};

use crate::http::Client;
use crate::synthetic_text::Rng;

/// An image's size in pixels, `WxH` on the command line.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ImageSize {
    pub(crate) width: u32,
    pub(crate) height: u32,
}

impl FromStr for ImageSize {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || format!("`{s}` is not an image size WIDTHxHEIGHT in pixels (e.g. 1280x720)");
        let (w, h) = s.trim().split_once(['x', 'X', '×']).ok_or_else(bad)?;
        let (width, height) =
            (w.trim().parse::<u32>().map_err(|_| bad())?, h.trim().parse::<u32>().map_err(|_| bad())?);
        if width < 8 || height < 8 || width > 8192 || height > 8192 {
            return Err(format!("`{s}`: each side must be 8 to 8192 pixels"));
        }
        Ok(Self { width, height })
    }
}

impl fmt::Display for ImageSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}x{}", self.width, self.height)
    }
}

/// The PNG bytes of synthetic screenshot `seed` of `size`.
pub(crate) fn screenshot_png(size: ImageSize, seed: u64) -> Vec<u8> {
    let (w, h) = (size.width, size.height);
    let mut rng = Rng::new(seed ^ 0x1a6e_5c4e_e45b_07a1);
    let mut img = image::RgbImage::from_pixel(w, h, image::Rgb([246, 246, 244]));
    let hue = |rng: &mut Rng| -> [u8; 3] {
        [60 + rng.below(160) as u8, 60 + rng.below(160) as u8, 60 + rng.below(160) as u8]
    };
    // Title bar: a horizontal gradient between two seeded colours.
    let bar = (h / 24).max(2);
    let (a, b) = (hue(&mut rng), hue(&mut rng));
    for x in 0..w {
        let t = x as f32 / w.max(2) as f32;
        let c = image::Rgb(std::array::from_fn(|i| (a[i] as f32 * (1.0 - t) + b[i] as f32 * t) as u8));
        for y in 0..bar {
            img.put_pixel(x, y, c);
        }
    }
    // Sidebar with menu entries.
    let side = w / 6;
    fill(&mut img, 0, bar, side, h - bar, [228, 230, 235]);
    let line_h = (h / 40).max(4);
    let glyph_h = (line_h * 5 / 9).max(2);
    let mut y = bar + line_h;
    while y + glyph_h < h {
        let len = side / 4 + rng.below((side / 2).max(1) as usize) as u32;
        fill(&mut img, side / 10, y, len.min(side.saturating_sub(side / 10)), glyph_h, [90, 96, 110]);
        y += line_h * 2;
    }
    // Text: lines of word-like dark blocks in the main area, with a few paragraph breaks.
    let (left, right) = (side + w / 40 + 1, w - w / 40);
    let word_gap = (line_h / 3).max(1);
    let mut y = bar + line_h;
    while y + glyph_h < h - line_h {
        if rng.below(7) == 0 {
            y += line_h;
            continue;
        }
        let end = left + (right.saturating_sub(left)) * (5 + rng.below(6) as u32) / 10;
        let ink = if rng.below(9) == 0 { hue(&mut rng) } else { [40, 42, 48] };
        let mut x = left + if rng.below(4) == 0 { line_h * 2 } else { 0 };
        while x < end {
            let word = (line_h / 2 + rng.below((line_h * 3) as usize) as u32).min(end - x);
            fill(&mut img, x, y, word, glyph_h, ink);
            x += word + word_gap;
        }
        y += line_h;
    }
    // Buttons.
    for _ in 0..3 {
        let (bw, bh) = ((w / 10).max(2), (line_h * 2).min(h / 4).max(2));
        let x = left + rng.below(right.saturating_sub(left + bw).max(1) as usize) as u32;
        let y = bar + rng.below(h.saturating_sub(bar + bh).max(1) as usize) as u32;
        fill(&mut img, x, y, bw, bh, hue(&mut rng));
    }
    // The seed itself, one 2 × 2 block per bit along the bottom edge: two seeds never draw the same pixels.
    for bit in 0..64u32 {
        let on = (seed >> bit) & 1 == 1;
        let x = (bit * 2) % w;
        fill(&mut img, x, h - 2, 2, 2, if on { [0, 0, 0] } else { [255, 255, 255] });
    }
    let mut out = Cursor::new(Vec::new());
    img.write_to(&mut out, image::ImageFormat::Png).expect("PNG encoding into memory");
    out.into_inner()
}

/// Fills the rectangle at (`x`, `y`) of `w × h` pixels, clipped to the image.
fn fill(img: &mut image::RgbImage, x: u32, y: u32, w: u32, h: u32, rgb: [u8; 3]) {
    for yy in y..(y + h).min(img.height()) {
        for xx in x..(x + w).min(img.width()) {
            img.put_pixel(xx, yy, image::Rgb(rgb));
        }
    }
}

/// Screenshot `seed` of `size` as an OpenAI `image_url` content part (a PNG data URL).
pub(crate) fn image_part(size: ImageSize, seed: u64) -> Value {
    let b64 = base64::engine::general_purpose::STANDARD.encode(screenshot_png(size, seed));
    json!({"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{b64}")}})
}

/// A seed for image `index` of the prompt or turn `slot` of the run seeded `seed` (distinct for every
/// triple).
pub(crate) fn image_seed(seed: u64, slot: u64, index: u64) -> u64 {
    let mut r = Rng::new(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ slot.rotate_left(32) ^ index);
    r.next()
}

/// OpenAI-style messages as Anthropic ones for `/v1/messages/count_tokens`: `image_url` parts with a data
/// URL become `image` blocks with a base64 source; everything else is kept.
pub(crate) fn anthropic_messages(messages: &[Value]) -> Vec<Value> {
    messages
        .iter()
        .map(|m| {
            let Some(parts) = m["content"].as_array() else { return m.clone() };
            let blocks: Vec<Value> = parts
                .iter()
                .map(|p| match p["image_url"]["url"].as_str().and_then(|u| u.strip_prefix("data:")) {
                    Some(rest) if p["type"] == "image_url" => {
                        let (meta, data) = rest.split_once(',').unwrap_or((rest, ""));
                        let media_type = meta.strip_suffix(";base64").unwrap_or(meta);
                        json!({"type": "image", "source": {"type": "base64", "media_type": media_type, "data": data}})
                    }
                    _ => p.clone(),
                })
                .collect();
            let mut m = m.clone();
            m["content"] = Value::Array(blocks);
            m
        })
        .collect()
}

/// User content: `text` alone, or the text cut at line starts into `images.len() + 1` pieces of about equal
/// length with an image between each two (empty pieces are left out).
pub(crate) fn interleave(text: String, images: &[Value]) -> Value {
    if images.is_empty() {
        return Value::String(text);
    }
    let n = images.len() + 1;
    let mut cuts = vec![0];
    for k in 1..n {
        let mut at = text.len() * k / n;
        while !text.is_char_boundary(at) {
            at -= 1;
        }
        let at = text[..at].rfind('\n').map_or(0, |i| i + 1).max(*cuts.last().unwrap_or(&0));
        cuts.push(at);
    }
    cuts.push(text.len());
    let mut parts = Vec::with_capacity(2 * n);
    for (i, w) in cuts.windows(2).enumerate() {
        if w[1] > w[0] {
            parts.push(json!({"type": "text", "text": &text[w[0]..w[1]]}));
        }
        if let Some(img) = images.get(i) {
            parts.push(img.clone());
        }
    }
    Value::Array(parts)
}

/// What an in-process server is known to take (no requests needed to find out).
#[derive(Clone)]
pub(crate) struct LocalImages {
    /// The checkpoint has a vision tower.
    pub(crate) model_has_vision: bool,
    /// The most patches of one image the loaded tower runs; None: no tower loaded.
    pub(crate) max_patches: Option<usize>,
    /// The most images one request may carry.
    pub(crate) max_images: usize,
    pub(crate) processor: ImageProcessorConfig,
}

/// The checks before a tool sends images.
pub(crate) struct ImageCheck<'a> {
    /// The flag that asked for images (`--images`, `--screenshot`), for errors.
    pub(crate) flag: &'a str,
    pub(crate) size: ImageSize,
    /// The most images the tool puts in one request, and why (for errors).
    pub(crate) per_request: usize,
    pub(crate) why: String,
    /// What an in-process server takes; None for `--url`.
    pub(crate) local: Option<&'a LocalImages>,
}

impl ImageCheck<'_> {
    /// Refuses what the server cannot take (a clear error naming the flag), then sends one request with one
    /// image of the size and counts `per_request` images; returns the prompt tokens one image takes (its
    /// placeholder tokens, grid / merge²: from the in-process server's image processor, else Qwen3.5/3.6's,
    /// checked against what the server counts).
    pub(crate) async fn run(&self, client: &Client, model: &str) -> Result<usize> {
        let (flag, size) = (self.flag, self.size);
        let processor = self.local.map_or_else(ImageProcessorConfig::qwen35, |l| l.processor.clone());
        let grid = grid_for(&processor, size.width, size.height).map_err(|e| anyhow!("{flag} {size}: {e}"))?;
        let (patches, tokens) = (grid.iter().product::<usize>(), processor.tokens(grid));
        if let Some(l) = self.local {
            if !l.model_has_vision {
                bail!("{flag}: the model has no vision tower, so the server refuses images");
            }
            let Some(max_patches) = l.max_patches else {
                bail!(
                    "{flag}: the server loads no vision tower (--no-vision, or on CUDA a memory plan that traded the \
                     tower for the context: --max-image-tokens-per-step N keeps it), so it refuses images"
                );
            };
            if patches > max_patches {
                bail!(
                    "{flag}: a {size} image takes {patches} patches ({}×{} after resizing), more than the vision \
                     tower's {max_patches} a step (--max-image-tokens-per-step): choose a smaller image size",
                    grid[2] * processor.patch_size,
                    grid[1] * processor.patch_size
                );
            }
            if self.per_request > l.max_images {
                bail!(
                    "{flag}: a request would carry {} images ({}), more than the {} the in-process server accepts \
                     (run `deltaserve serve --limit-images-per-request N` and pass --url)",
                    self.per_request,
                    self.why,
                    l.max_images
                );
            }
        }
        let count = |messages: Vec<Value>| async move {
            let body = json!({"model": model, "messages": anthropic_messages(&messages)});
            let v = client.post_json("/v1/messages/count_tokens", &body).await?;
            v["input_tokens"].as_u64().ok_or_else(|| anyhow!("count_tokens: no input_tokens in {v}"))
        };
        if self.per_request > 1 {
            let small = ImageSize { width: 32, height: 32 };
            let parts: Vec<Value> = (0..self.per_request as u64).map(|i| image_part(small, i)).collect();
            count(vec![json!({"role": "user", "content": parts})]).await.with_context(|| {
                format!("{flag}: the server refuses {} images in one request ({})", self.per_request, self.why)
            })?;
        }
        let text = "What does this screenshot show?";
        let with =
            vec![json!({"role": "user", "content": [{"type": "text", "text": text}, image_part(size, u64::MAX)]})];
        let body = json!({"model": model, "messages": with, "max_tokens": 1, "temperature": 0, "stream": true,
                          "stream_options": {"include_usage": true}});
        let (reply, ..) = client
            .chat(&body)
            .await
            .with_context(|| format!("{flag}: the server refuses a request with one {size} image"))?;
        let with_image = reply.usage.as_ref().and_then(|u| u["prompt_tokens"].as_u64());
        let without = count(vec![json!({"role": "user", "content": text})]).await?;
        // The image's placeholders and its <|vision_start|> / <|vision_end|> markers.
        let added = with_image.map_or(0, |n| n.saturating_sub(without)) as usize;
        if !(tokens..=tokens + 8).contains(&added) {
            let measured = added.saturating_sub(2);
            tracing::warn!(
                "{flag}: a {size} image adds {added} prompt tokens, not the {tokens} (+ 2 markers) of Qwen3.5/3.6's \
                 image processor: the server's processor differs; reporting {measured} tokens per image"
            );
            return Ok(measured);
        }
        Ok(tokens)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_and_bad_ones_are_refused() {
        assert_eq!("1280x720".parse::<ImageSize>(), Ok(ImageSize { width: 1280, height: 720 }));
        assert_eq!(" 64X48 ".parse::<ImageSize>().map(|s| s.to_string()), Ok("64x48".to_string()));
        for bad in ["1280", "x720", "0x5", "1280x720x3", "99999x10"] {
            assert!(bad.parse::<ImageSize>().is_err(), "{bad}");
        }
    }

    #[test]
    fn screenshots_decode_are_deterministic_and_differ_by_seed() {
        let size = ImageSize { width: 320, height: 200 };
        let a = deltaserve_media::decode(&screenshot_png(size, 1)).unwrap();
        assert_eq!((a.width, a.height), (320, 200));
        assert_eq!(a, deltaserve_media::decode(&screenshot_png(size, 1)).unwrap());
        let b = deltaserve_media::decode(&screenshot_png(size, 2)).unwrap();
        assert_ne!(a.hash(), b.hash());
        let seeds: std::collections::HashSet<u64> =
            (0..4).flat_map(|slot| (0..4).map(move |i| image_seed(7, slot, i))).collect();
        assert_eq!(seeds.len(), 16);
    }

    #[test]
    fn a_screenshot_is_small_enough_for_many_in_one_request() {
        // 32 screenshots of 1280x720 (the server's default limit) as base64 stay well under `serve`'s default
        // 16 MiB body.
        let png = screenshot_png(ImageSize { width: 1280, height: 720 }, 3);
        assert!(png.len() < 256 << 10, "{} bytes", png.len());
    }

    #[test]
    fn interleaving_keeps_the_text_and_places_every_image() {
        let text = "one\ntwo\nthree\nfour\nfive\n".to_string();
        let img = json!({"type": "image_url", "image_url": {"url": "data:image/png;base64,QUJD"}});
        assert_eq!(interleave(text.clone(), &[]), Value::String(text.clone()));
        let v = interleave(text.clone(), &[img.clone(), img.clone()]);
        let parts = v.as_array().unwrap();
        assert_eq!(parts.iter().filter(|p| p["type"] == "image_url").count(), 2);
        let joined: String = parts.iter().filter_map(|p| p["text"].as_str()).collect();
        assert_eq!(joined, text);
        assert_eq!(parts[0]["type"], "text");
        // Too little text: the images still all go in.
        let v = interleave(String::new(), &[img.clone(), img]);
        assert_eq!(v.as_array().unwrap().len(), 2);
        let a = anthropic_messages(&[json!({"role": "user", "content": parts})]);
        let blocks = a[0]["content"].as_array().unwrap();
        assert_eq!(
            blocks[1],
            json!({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "QUJD"}})
        );
        assert_eq!(blocks[0], parts[0]);
    }
}
