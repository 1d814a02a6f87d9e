//! Requests with images on the engine thread. At submission a request's images are placed on its prompt
//! (HF's `get_rope_index`: each fills its run of placeholders; text after it continues from its origin +
//! its longer merged side) and checked against the backend's [`ImageTokens`] and the tower's bound on
//! patches ([`ImageRules::max_patches`]: an image of more is refused before anything is queued). The placement lives with the
//! sequence ([`Live::images`]): every chunk the scheduler plans for it, whatever its start (a prompt
//! piece, decode, a recompute after preemption, the rest of a prompt after a prefix-cache hit, a
//! speculative chunk), gets the rope delta of the images before it and the images whose rows it holds.
//! In the prefix cache an image's placeholders are keyed by its pixel hash ([`MediaSpan`]).

use std::sync::Arc;

use deltaserve_backend::{ChunkImage, ImagePatches, ImageTokens, PlacedImage, SeqChunk};
use deltaserve_model::mrope::place_images;
use deltaserve_sched::MediaSpan;

use super::{EngineError, Live, NO_VISION_TOWER, Worker};

/// A request's images where its prompt holds them.
pub(crate) type Placed = Vec<(PlacedImage, Arc<ImagePatches>)>;

/// What images the engine takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ImageRules {
    /// How prompts hold images ([`deltaserve_backend::Backend::image_tokens`]); None: images are refused.
    pub tokens: Option<ImageTokens>,
    /// The most patches one image may have ([`super::EngineOptions::max_image_tokens_per_step`]).
    pub max_patches: usize,
}

/// Places `images` on `prompt` (empty without images); errors say why the request cannot run.
pub(crate) fn place(prompt: &[u32], images: &[Arc<ImagePatches>], rules: ImageRules) -> Result<Placed, EngineError> {
    if images.is_empty() {
        return Ok(Vec::new());
    }
    let Some(it) = rules.tokens else { return Err(EngineError::Invalid(NO_VISION_TOWER.into())) };
    for (n, img) in images.iter().enumerate() {
        if img.patches() > rules.max_patches {
            let [t, h, w] = img.grid_thw;
            return Err(EngineError::Invalid(format!(
                "image {n}: {} patches ({t}×{h}×{w}) exceed the vision tower's limit of {} patches a step \
                 (--max-image-tokens-per-step): send a smaller image",
                img.patches(),
                rules.max_patches
            )));
        }
        let want = img.patches() * it.patch_len;
        if img.pixels.len() != want {
            return Err(EngineError::Invalid(format!(
                "image {n}: {} pixel values for {} patches of {} values",
                img.pixels.len(),
                img.patches(),
                it.patch_len
            )));
        }
    }
    let grids: Vec<[usize; 3]> = images.iter().map(|i| i.grid_thw).collect();
    let placed =
        place_images(prompt, it.image_token_id, &grids, it.merge).map_err(|e| EngineError::Invalid(e.to_string()))?;
    Ok(placed.into_iter().zip(images.iter().cloned()).collect())
}

/// The prefix-cache spans of placed images.
pub(super) fn media_spans(placed: &Placed) -> Vec<MediaSpan> {
    placed.iter().map(|(p, img)| MediaSpan { start: p.seq_start, len: p.tokens(), hash: img.hash }).collect()
}

/// Sets `c`'s rope delta and images from its sequence's placement.
pub(crate) fn place_chunk(c: &mut SeqChunk, placed: &Placed) {
    let end = c.start + c.positions();
    c.rope_delta = placed.iter().take_while(|(p, _)| p.end() <= c.start).last().map_or(0, |(p, _)| p.delta_after());
    c.images = placed
        .iter()
        .filter(|(p, _)| p.end() > c.start && p.seq_start < end)
        .map(|(p, img)| ChunkImage { image: img.clone(), placed: *p })
        .collect();
}

impl Worker {
    /// Gives the chunks of sequences with images their rope delta and image rows.
    pub(super) fn place_chunks(&self, seqs: &mut [SeqChunk]) {
        for c in seqs {
            if let Some(live) = self.reqs.get(&c.seq_id).filter(|l: &&Live| !l.images.is_empty()) {
                place_chunk(c, &live.images);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const IMG: u32 = 9;
    const TOKENS: ImageRules =
        ImageRules { tokens: Some(ImageTokens { image_token_id: IMG, merge: 2, patch_len: 3 }), max_patches: 24 };
    const NO_TOWER: ImageRules = ImageRules { tokens: None, max_patches: usize::MAX };

    fn image(grid_thw: [usize; 3], hash: u8) -> Arc<ImagePatches> {
        let n: usize = grid_thw.iter().product();
        Arc::new(ImagePatches { grid_thw, pixels: vec![0.0; n * 3], hash: [hash; 32] })
    }

    #[test]
    fn chunks_take_the_images_they_overlap_and_the_delta_before() {
        // 2 text, an image of 2×3 tokens, 2 text, an image of 1×2 tokens, 1 text.
        let mut prompt = vec![1, 2];
        prompt.extend([IMG; 6]);
        prompt.extend([3, 4, IMG, IMG, 5]);
        let placed = place(&prompt, &[image([1, 4, 6], 1), image([1, 2, 4], 2)], TOKENS).unwrap();
        let chunk = |start: usize, n: usize| {
            let mut c = SeqChunk { start, tokens: vec![0; n], ..SeqChunk::default() };
            place_chunk(&mut c, &placed);
            c
        };
        // A chunk boundary inside the first image: both halves carry it.
        assert_eq!(chunk(0, 5).images.len(), 1);
        let c = chunk(5, 6);
        assert_eq!((c.images.len(), c.rope_delta), (2, 0));
        // After the first image: its delta (text at 5 = 2 + 3, index 8).
        let c = chunk(8, 2);
        assert!(c.images.is_empty());
        assert_eq!(c.rope_delta, -3);
        assert_eq!(c.first_position(), 5);
        // Decode after the prompt: the last image's delta.
        let c = chunk(prompt.len(), 1);
        assert_eq!(c.rope_delta, placed[1].0.delta_after());
        assert_eq!(media_spans(&placed)[1], MediaSpan { start: 10, len: 2, hash: [2; 32] });
    }

    #[test]
    fn bad_images_are_refused() {
        let prompt = [1, IMG, IMG, 2];
        let e = place(&prompt, &[image([1, 2, 4], 1)], NO_TOWER).unwrap_err().to_string();
        assert!(e.contains(NO_VISION_TOWER), "{e}");
        let e = place(&prompt, &[image([1, 4, 4], 1)], TOKENS).unwrap_err().to_string();
        assert!(e.contains("needs 4 image tokens"), "{e}");
        let mut short = (*image([1, 2, 4], 1)).clone();
        short.pixels.pop();
        let e = place(&prompt, &[Arc::new(short)], TOKENS).unwrap_err().to_string();
        assert!(e.contains("23 pixel values for 8 patches"), "{e}");
        assert!(place(&prompt, &[], NO_TOWER).unwrap().is_empty());
        // More patches than the tower's bound (24): refused whatever the prompt, naming the limit.
        let e = place(&prompt, &[image([1, 2, 4], 1), image([1, 6, 6], 2)], TOKENS).unwrap_err().to_string();
        assert!(e.contains("image 1: 36 patches (1×6×6)") && e.contains("limit of 24 patches"), "{e}");
        assert!(e.contains("--max-image-tokens-per-step"), "{e}");
        // At the bound: placed.
        let mut p24 = vec![1];
        p24.extend([IMG; 6]);
        assert_eq!(place(&p24, &[image([1, 4, 6], 1)], TOKENS).unwrap().len(), 1);
    }
}
