//! M-RoPE positions of a prompt, exactly as Hugging Face's `get_rope_index` for Qwen3.5/3.6: every token
//! gets a (t, h, w) position. Text tokens advance all three streams together; an image's tokens sit on
//! its merged grid (t at the image's start, h and w at start + row / column), and the text after it
//! continues from the image's start + max(rows, columns). The rope delta (largest position + 1 − prompt
//! length) carries the offset into later tokens: token `i` after the prompt is at `i + delta` in all
//! three streams.

use crate::error::ModelError;

/// The (t, h, w) rotary positions of a run of tokens and the offset that continues them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MropePositions {
    /// One (t, h, w) per token.
    pub positions: Vec<[usize; 3]>,
    /// Largest position + 1 − number of tokens: the position of token index `i ≥ len` is `i + delta`.
    pub delta: i64,
}

/// Where an image sits in a sequence: the index of its first placeholder token, the rotary position its
/// tokens start from (t, h and w all start there) and its merged grid (tokens along t, rows, columns).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PlacedImage {
    pub seq_start: usize,
    pub origin: usize,
    pub merged: [usize; 3],
}

impl PlacedImage {
    /// An image of `grid_thw` patches folded by `merge`; errors when the grid does not fold.
    pub fn new(seq_start: usize, origin: usize, grid_thw: [usize; 3], merge: usize) -> Result<Self, ModelError> {
        let [t, h, w] = grid_thw;
        if merge == 0 || t == 0 || h == 0 || w == 0 || !h.is_multiple_of(merge) || !w.is_multiple_of(merge) {
            return Err(ModelError::config(format!("grid {t}×{h}×{w} does not fold by merge {merge}")));
        }
        Ok(Self { seq_start, origin, merged: [t, h / merge, w / merge] })
    }

    /// Placeholder tokens the image fills.
    pub fn tokens(&self) -> usize {
        self.merged.iter().product()
    }

    /// Index of the first token after the image.
    pub fn end(&self) -> usize {
        self.seq_start + self.tokens()
    }

    /// The (t, h, w) position of the image's token `k` (merged patches in raster order, frame by frame).
    pub fn position(&self, k: usize) -> [usize; 3] {
        let [_, gh, gw] = self.merged;
        let o = self.origin;
        [o + k / (gh * gw), o + (k / gw) % gh, o + k % gw]
    }

    /// The rope delta of the text after the image: its first text token is at `origin + max(rows, columns)`.
    pub fn delta_after(&self) -> i64 {
        (self.origin + self.merged[1].max(self.merged[2])) as i64 - self.end() as i64
    }
}

/// Places the images of a prompt: image `n` (grid `grids[n]`, in prompt order) fills the next run of
/// `image_token_id` tokens with `t·h·w / merge²` of them. Errors name the mismatch (a run of the wrong
/// length, more runs than images, images left over).
pub fn place_images(
    ids: &[u32],
    image_token_id: u32,
    grids: &[[usize; 3]],
    merge: usize,
) -> Result<Vec<PlacedImage>, ModelError> {
    let mut placed: Vec<PlacedImage> = Vec::with_capacity(grids.len());
    let mut i = 0;
    while i < ids.len() {
        if ids[i] != image_token_id {
            i += 1;
            continue;
        }
        let n = placed.len();
        let Some(&grid) = grids.get(n) else {
            return Err(ModelError::config(format!(
                "image token at prompt index {i} has no image ({} images given)",
                grids.len()
            )));
        };
        let delta = placed.last().map_or(0, PlacedImage::delta_after);
        let image = PlacedImage::new(i, (i as i64 + delta) as usize, grid, merge)
            .map_err(|e| ModelError::config(format!("image {n}: {e}")))?;
        let run = ids[i..].iter().take_while(|&&id| id == image_token_id).count();
        if run < image.tokens() {
            return Err(ModelError::config(format!(
                "image {n} needs {} image tokens but the prompt has a run of {run} at index {i}",
                image.tokens()
            )));
        }
        i = image.end();
        placed.push(image);
    }
    if placed.len() < grids.len() {
        return Err(ModelError::config(format!(
            "{} images given but the prompt has image tokens for {}",
            grids.len(),
            placed.len()
        )));
    }
    Ok(placed)
}

/// Positions of tokens `start..start + n` of a sequence: a token inside one of `images` (in order) at its
/// grid position; a text token at its index plus the rope delta of the last image that ended at or before
/// it, or plus `rope_delta` (the delta of the text before the first of `images`) when none did.
pub fn positions(start: usize, n: usize, rope_delta: i64, images: &[PlacedImage]) -> Vec<[usize; 3]> {
    let mut delta = rope_delta;
    let mut images = images.iter().peekable();
    (start..start + n)
        .map(|p| {
            while let Some(im) = images.next_if(|im| im.end() <= p) {
                delta = im.delta_after();
            }
            match images.peek() {
                Some(im) if im.seq_start <= p => im.position(p - im.seq_start),
                _ => [(p as i64 + delta).max(0) as usize; 3],
            }
        })
        .collect()
}

/// Positions of a prompt whose images (grids `grid_thw` of patches, in prompt order) each fill a run of
/// `image_token_id` tokens of `t·h·w / merge²` tokens (see [`place_images`]).
pub fn rope_index(
    ids: &[u32],
    image_token_id: u32,
    grids: &[[usize; 3]],
    merge: usize,
) -> Result<MropePositions, ModelError> {
    let placed = place_images(ids, image_token_id, grids, merge)?;
    let positions = self::positions(0, ids.len(), 0, &placed);
    let max = positions.iter().flat_map(|p| p.iter().copied()).max().map_or(0, |m| m as i64 + 1);
    Ok(MropePositions { positions, delta: max - ids.len() as i64 })
}

/// Positions of `n` text tokens starting at `first` (equal in all three streams).
pub fn text_positions(first: usize, n: usize) -> Vec<[usize; 3]> {
    (first..first + n).map(|p| [p; 3]).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const IMG: u32 = 9;

    #[test]
    fn text_only_is_sequential_with_no_delta() {
        let m = rope_index(&[1, 2, 3], IMG, &[], 2).unwrap();
        assert_eq!(m.positions, text_positions(0, 3));
        assert_eq!(m.delta, 0);
    }

    #[test]
    fn image_sits_on_its_grid_and_text_continues_after_the_longest_side() {
        // 2 text, an image of 4×6 patches → 2×3 tokens, 1 text.
        let ids = [1, 2, IMG, IMG, IMG, IMG, IMG, IMG, 3];
        let m = rope_index(&ids, IMG, &[[1, 4, 6]], 2).unwrap();
        let image: Vec<[usize; 3]> = (0..2).flat_map(|r| (0..3).map(move |c| [2, 2 + r, 2 + c])).collect();
        assert_eq!(&m.positions[2..8], &image[..]);
        assert_eq!(m.positions[8], [5; 3]);
        assert_eq!(m.delta, 6 - 9);
    }

    #[test]
    fn adjacent_images_each_take_their_grid() {
        let ids = [IMG; 5];
        let m = rope_index(&ids, IMG, &[[1, 2, 2], [1, 4, 4]], 2).unwrap();
        assert_eq!(m.positions[0], [0, 0, 0]);
        assert_eq!(m.positions[1], [1, 1, 1]);
        assert_eq!(m.positions[4], [1, 2, 2]);
    }

    #[test]
    fn mismatched_images_are_errors() {
        let e = rope_index(&[IMG, IMG, 1], IMG, &[[1, 4, 4]], 2).unwrap_err().to_string();
        assert!(e.contains("needs 4 image tokens"), "{e}");
        let e = rope_index(&[IMG], IMG, &[], 2).unwrap_err().to_string();
        assert!(e.contains("has no image"), "{e}");
        let e = rope_index(&[1], IMG, &[[1, 2, 2]], 2).unwrap_err().to_string();
        assert!(e.contains("1 images given"), "{e}");
        let e = rope_index(&[IMG], IMG, &[[1, 3, 2]], 2).unwrap_err().to_string();
        assert!(e.contains("does not fold"), "{e}");
    }

    /// Any window of a sequence, from the delta before its first image, has the whole prompt's positions.
    #[test]
    fn windows_have_the_prompts_positions() {
        let mut ids = vec![1, 2];
        ids.extend([IMG; 6]);
        ids.extend([3, 4, 5]);
        ids.extend([IMG; 4]);
        ids.extend([6, 7]);
        let grids = [[1, 4, 6], [1, 2, 8]];
        let whole = rope_index(&ids, IMG, &grids, 2).unwrap();
        let placed = place_images(&ids, IMG, &grids, 2).unwrap();
        assert_eq!(placed[1].seq_start, 11);
        assert_eq!(placed[1].delta_after(), whole.delta);
        for start in 0..ids.len() {
            for n in 0..=ids.len() - start {
                let mine: Vec<PlacedImage> =
                    placed.iter().filter(|im| im.end() > start && im.seq_start < start + n).copied().collect();
                let before = placed.iter().rfind(|im| im.end() <= start).map_or(0, PlacedImage::delta_after);
                assert_eq!(positions(start, n, before, &mine), whole.positions[start..start + n], "{start}+{n}");
            }
        }
        // Decode after the prompt: index + delta in all streams.
        assert_eq!(positions(ids.len(), 1, whole.delta, &[]), vec![[(ids.len() as i64 + whole.delta) as usize; 3]]);
    }
}
