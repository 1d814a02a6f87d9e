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

/// Positions of a prompt whose images (grids `grid_thw` of patches, in prompt order) each fill a run of
/// `image_token_id` tokens of `t·h·w / merge²` tokens. Errors name the mismatch (a run of the wrong
/// length, more runs than images, images left over).
pub fn rope_index(
    ids: &[u32],
    image_token_id: u32,
    grids: &[[usize; 3]],
    merge: usize,
) -> Result<MropePositions, ModelError> {
    let mut positions = Vec::with_capacity(ids.len());
    let mut next = 0usize; // the position of the next text token
    let mut images = grids.iter().enumerate();
    let mut i = 0;
    while i < ids.len() {
        if ids[i] != image_token_id {
            positions.push([next; 3]);
            next += 1;
            i += 1;
            continue;
        }
        let Some((n, &[t, h, w])) = images.next() else {
            return Err(ModelError::config(format!(
                "image token at prompt index {i} has no image ({} images given)",
                grids.len()
            )));
        };
        if merge == 0 || !h.is_multiple_of(merge) || !w.is_multiple_of(merge) {
            return Err(ModelError::config(format!("image {n}: grid {t}×{h}×{w} does not fold by merge {merge}")));
        }
        let (gh, gw) = (h / merge, w / merge);
        let tokens = t * gh * gw;
        let run = ids[i..].iter().take_while(|&&id| id == image_token_id).count();
        if run < tokens {
            return Err(ModelError::config(format!(
                "image {n} needs {tokens} image tokens but the prompt has a run of {run} at index {i}"
            )));
        }
        for ti in 0..t {
            for r in 0..gh {
                for c in 0..gw {
                    positions.push([next + ti, next + r, next + c]);
                }
            }
        }
        next += gh.max(gw);
        i += tokens;
    }
    if let Some((n, _)) = images.next() {
        return Err(ModelError::config(format!(
            "{} images given but the prompt has image tokens for {n}",
            grids.len()
        )));
    }
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
}
