//! Prompts with images on the reference model. The vision tower ([`crate::vision`]) turns each image into
//! rows of the text model's width; those rows replace the embeddings of the image tokens, in order, and
//! attention rotates q and k at each token's (t, h, w) M-RoPE position ([`deltaserve_model::mrope`]).
//!
//! [`CpuModel::forward_with_images`] runs a piece of a sequence with the images whose tokens it holds
//! (positions from the sequence's next position, its rope delta updated, so later tokens, decode
//! included, continue after the images); [`CpuModel::forward_rows`] is the step below it, for callers
//! that encode images themselves (an image split across chunks) and give explicit positions.

use deltaserve_model::ImagePatches;
use deltaserve_model::mrope::rope_index;

use crate::model::{CpuModel, ForwardError, GdnMode, Logits, Positions, SeqCache, SequenceState};
use crate::vision::VisionTower;

impl CpuModel {
    /// The vision tower, or the error that says the model takes no images.
    pub fn vision_tower(&self) -> Result<VisionTower<'_>, ForwardError> {
        match (&self.config.vision, &self.vision) {
            (Some(config), Some(weights)) => Ok(VisionTower { config, weights }),
            _ => Err(ForwardError::NoVisionTower),
        }
    }

    /// Image embeddings `[Σ tokens, hidden]` of `images`, in order.
    pub fn encode_images(&self, images: &[ImagePatches]) -> Result<Vec<f32>, ForwardError> {
        Ok(self.vision_tower()?.encode_all(images)?)
    }

    /// Runs `tokens`, the next tokens of `state`, whose image-token runs are filled by `images` (every
    /// image whole, in order). Positions follow HF's `get_rope_index` from the sequence's next position;
    /// the sequence's rope delta grows by this piece's, so later calls (text or decode) continue after
    /// the images.
    pub fn forward_with_images(
        &self,
        state: &mut SequenceState,
        tokens: &[u32],
        images: &[ImagePatches],
        mode: GdnMode,
        want: Logits,
    ) -> Result<Vec<f32>, ForwardError> {
        let Some(vc) = &self.config.vision else {
            return Err(ForwardError::NoVisionTower);
        };
        let grids: Vec<[usize; 3]> = images.iter().map(|i| i.grid_thw).collect();
        let m = rope_index(tokens, vc.image_token_id, &grids, vc.spatial_merge_size)
            .map_err(|e| ForwardError::Multimodal(e.to_string()))?;
        let first = state.next_position();
        let positions: Vec<[usize; 3]> = m.positions.iter().map(|p| p.map(|v| v + first)).collect();
        let rows = if images.is_empty() { Vec::new() } else { self.encode_images(images)? };
        let start = state.len;
        let hidden = self.forward_rows(state, start, tokens, &rows, &positions, mode)?;
        state.len += tokens.len();
        state.rope_delta += m.delta;
        Ok(self.logits_of(&hidden, want))
    }

    /// Runs `tokens` at KV indices `start..` of `cache` with `image_rows` (`[n, hidden]`, n = the image
    /// tokens among `tokens`) in place of the image tokens' embeddings, q and k rotated at `positions`
    /// (one (t, h, w) per token). Returns the post-final-norm hidden rows `[t, hidden]`.
    pub fn forward_rows(
        &self,
        cache: &mut dyn SeqCache,
        start: usize,
        tokens: &[u32],
        image_rows: &[f32],
        positions: &[[usize; 3]],
        mode: GdnMode,
    ) -> Result<Vec<f32>, ForwardError> {
        let h = self.dims.hidden;
        if positions.len() != tokens.len() {
            return Err(ForwardError::Multimodal(format!("{} positions for {} tokens", positions.len(), tokens.len())));
        }
        let image_token = self.config.vision.as_ref().map(|v| v.image_token_id);
        let slots = tokens.iter().filter(|&&id| Some(id) == image_token).count();
        if image_rows.len() != slots * h {
            return Err(ForwardError::Multimodal(format!(
                "{} image rows for {slots} image tokens",
                image_rows.len() / h.max(1)
            )));
        }
        let mut x = self.embed_checked(tokens)?;
        let rows = x.chunks_exact_mut(h).zip(tokens).filter(|(_, id)| Some(**id) == image_token);
        for ((row, _), img) in rows.zip(image_rows.chunks_exact(h)) {
            row.copy_from_slice(img);
        }
        self.run_layers(cache, start, x, Positions::Mrope(positions), mode)
    }
}
