//! An image as the vision tower takes it: the patch tensor of the checkpoint's image processor, the patch
//! grid, and the hash that names the image in the prefix cache. Decoding and resizing make it (the media
//! input side); the vision tower of every backend consumes it.

/// One preprocessed image (or, later, video clip).
#[derive(Clone, Debug, PartialEq)]
pub struct ImagePatches {
    /// Patches along time, height and width (`image_grid_thw` in Hugging Face terms); `t` is 1 for an image.
    pub grid_thw: [usize; 3],
    /// `[t · h · w, channels · temporal_patch_size · patch_size²]` f32, rescaled and normalised, rows in the
    /// image processor's order (each `merge × merge` window of patches contiguous), exactly HF's `pixel_values`.
    pub pixels: Vec<f32>,
    /// A hash of the decoded pixels (before resizing): the same picture sent again is the same image, a
    /// different one never is.
    pub hash: [u8; 32],
}

impl ImagePatches {
    /// Patches in the grid.
    pub fn patches(&self) -> usize {
        self.grid_thw.iter().product()
    }

    /// Prompt tokens the image takes once the merger folds each `merge × merge` window into one.
    pub fn tokens(&self, merge: usize) -> usize {
        self.patches() / (merge * merge)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_fold_merge_windows() {
        let img = ImagePatches { grid_thw: [1, 6, 10], pixels: vec![0.0; 60 * 1536], hash: [0; 32] };
        assert_eq!(img.patches(), 60);
        assert_eq!(img.tokens(2), 15);
    }
}
