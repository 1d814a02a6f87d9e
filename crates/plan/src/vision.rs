//! The vision tower's part of the plan: its weights ([`tower_weight_bytes`], in the `weights` region) and
//! its activation workspace ([`tower_workspace_bytes`], the `vision` region), bounded by the patches the
//! tower runs at once (`--max-image-tokens-per-step`), never by the prompt or the number of images.
//!
//! The tower is priced only where the backend loads it ([`crate::PlanOptions::max_image_tokens_per_step`]
//! is `Some`): the CPU reference keeps it in f32 (`VisionWeights::load_f32`), its workspace
//! [`tower_workspace_bytes`]; the CUDA backend keeps it in bf16 (one card; the fit may trade it for the
//! full context unless the user asked for images), its workspace laid out by [`CudaTowerLayout`];
//! `--no-vision` loads none and prices 0. A text-only model has no tower and prices 0 whatever the options.

use deltaserve_model::VisionConfig;
use deltaserve_model::vision::tensor_shapes;

use crate::plan::ALIGN;

/// `--max-image-tokens-per-step` at least: the default is the larger of this and the patches of one image
/// at the image processor's pixel budget ([`default_max_image_tokens`]).
pub const MIN_DEFAULT_IMAGE_TOKENS: usize = 4096;

/// The default `--max-image-tokens-per-step`: the larger of [`MIN_DEFAULT_IMAGE_TOKENS`] and the patches of
/// one image of `max_pixels` pixels cut into `patch_size²` patches (so every image the preprocessor
/// produces is accepted). Qwen3.5/3.6 (16 MP, patch 16): 65,536.
pub fn default_max_image_tokens(max_pixels: u64, patch_size: usize) -> usize {
    let per_patch = (patch_size as u64).saturating_mul(patch_size as u64).max(1);
    let patches = usize::try_from(max_pixels / per_patch).unwrap_or(usize::MAX);
    patches.max(MIN_DEFAULT_IMAGE_TOKENS)
}

fn al(x: u128) -> u128 {
    x.next_multiple_of(ALIGN as u128)
}

/// Parameters of the tower: every stored tensor (patch embedding, position embeddings, each block's norms,
/// qkv, proj and MLP, the merger), biases included.
pub fn tower_params(v: &VisionConfig) -> u128 {
    tensor_shapes(v).iter().map(|(_, shape)| shape.iter().map(|&d| d as u128).product::<u128>()).sum()
}

/// Bytes of the tower's weights at `elem` bytes per value, each tensor starting 256-byte aligned (as the
/// decoder's are counted).
pub fn tower_weight_bytes(v: &VisionConfig, elem: usize) -> u128 {
    tensor_shapes(v)
        .iter()
        .map(|(_, shape)| al(shape.iter().map(|&d| d as u128).product::<u128>() * elem as u128))
        .sum()
}

/// Bytes of the tower's activations for `patches` patches at `act_bytes` per value. The tower runs one
/// image at a time, block by block, so this bounds a step whose images (each encoded whole) have at most
/// `patches` patches. Values per patch:
/// - a block's live buffers, every one counted whatever the order they die in: the residual stream,
///   its norm, qkv `[3h]`, the split and rotated q, k, v `[3h]`, the attention output, the projection or
///   MLP output, the MLP intermediate `[I]`: `11h + I`;
/// - or the merger's, if larger: the stream, its norm, fc1 (`h · merge²` per window = `h` per patch), the
///   merged rows (`out / merge²` per patch): `3h + out / merge²`;
/// - plus the merged rows handed to the step (`out / merge²`) and one attention score row (one value per
///   patch: scores are never materialised `[n, n]`).
pub fn tower_workspace_bytes(v: &VisionConfig, patches: usize, act_bytes: usize) -> u128 {
    let (h, i) = (v.hidden_size as u128, v.intermediate_size as u128);
    let merged_row = (v.out_hidden_size as u128).div_ceil(v.merge_unit().max(1) as u128);
    let block = 11 * h + i;
    let merger = 3 * h + merged_row;
    let per_patch = block.max(merger) + merged_row + 1;
    al(patches as u128 * per_patch * act_bytes as u128)
}

/// The CUDA backend's `vision` region: the tower's buffers for `patches` patches (one image at a time)
/// and the step's M-RoPE positions, byte offsets from the region's start, each 256-byte aligned:
/// - `x`: the residual stream `[patches, hidden]` f32;
/// - `xn`: a LayerNorm's output, the attention output `[patches, hidden]` bf16;
/// - `wide`: f32 GEMM outputs (the pixels `[patches, patch_dim]` bf16 before the patch embedding; qkv
///   `[patches, 3·hidden]`; fc1 `[patches, intermediate]`; a projection, fc2 or merger output);
/// - `narrow`: the bf16 inputs made from them (rotated qkv, the MLP activation, the merger's activation);
/// - `merged`: the image's merged rows `[patches / merge², out_hidden]` bf16;
/// - `rope_pos`: `[max_batch_tokens, 3]` i32, every row's (t, h, w) rotary position of a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CudaTowerLayout {
    pub x: usize,
    pub xn: usize,
    pub wide: usize,
    pub narrow: usize,
    pub merged: usize,
    pub rope_pos: usize,
    /// Bytes of the region.
    pub bytes: usize,
}

impl CudaTowerLayout {
    /// The layout for images of at most `patches` patches and steps of at most `max_batch_tokens` rows.
    pub fn new(v: &VisionConfig, patches: usize, max_batch_tokens: usize) -> Self {
        let (h, i, n) = (v.hidden_size, v.intermediate_size, patches);
        let windows = n.div_ceil(v.merge_unit().max(1));
        let wide = (4 * n * (3 * h).max(i)).max(4 * windows * v.out_hidden_size).max(2 * n * v.patch_dim());
        let narrow = 2 * n * (3 * h).max(i);
        let sizes = [4 * n * h, 2 * n * h, wide, narrow, 2 * windows * v.out_hidden_size, 12 * max_batch_tokens];
        let mut at = [0usize; 6];
        let mut end = 0;
        for (a, s) in at.iter_mut().zip(sizes) {
            *a = end;
            end += s.next_multiple_of(ALIGN as usize);
        }
        let [x, xn, wide, narrow, merged, rope_pos] = at;
        CudaTowerLayout { x, xn, wide, narrow, merged, rope_pos, bytes: end }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use deltaserve_model::synth::Preset;

    fn tower(preset: Preset) -> VisionConfig {
        let cfg = preset.config(None);
        cfg.vision.expect("a multimodal preset has a tower")
    }

    #[test]
    fn qwen36_tower_params_and_bytes() {
        let v = tower(Preset::Qwen36_27b);
        // docs/architecture.md §6: the tower's parameters.
        assert_eq!(tower_params(&v), 460_730_096);
        // Each tensor starts 256-aligned: of them only the MLP's fc1 bias [4304] is not a multiple of 256 B
        // (f32 17,216 B → 17,408; bf16 8,608 B → 8,704), once per block.
        assert_eq!(tower_weight_bytes(&v, 4), 4 * 460_730_096 + 27 * 192);
        assert_eq!(tower_weight_bytes(&v, 2), 2 * 460_730_096 + 27 * 96);
    }

    #[test]
    fn workspace_grows_with_patches_only() {
        let v = tower(Preset::Qwen36_27b);
        // 11 · 1152 + 4304 (a block) + 5120 / 4 (merged rows) + 1 (a score) values per patch, f32.
        let per_patch = (11 * 1152 + 4304 + 1280 + 1) * 4;
        assert_eq!(tower_workspace_bytes(&v, 4096, 4), 4096 * per_patch);
        assert_eq!(tower_workspace_bytes(&v, 8192, 2), 8192 * per_patch / 2);
        assert_eq!(tower_workspace_bytes(&v, 1, 4), per_patch.next_multiple_of(256));
        assert_eq!(tower_workspace_bytes(&v, 0, 4), 0);
    }

    #[test]
    fn cuda_layout_holds_every_phase_of_the_tower() {
        let v = tower(Preset::Qwen36_27b);
        let l = CudaTowerLayout::new(&v, 4096, 2048);
        // x f32, xn bf16; wide: the MLP's fc1 f32 (4304 > 3 · 1152); narrow: its bf16 activation.
        assert_eq!(l.xn - l.x, 4096 * 1152 * 4);
        assert_eq!(l.wide - l.xn, 4096 * 1152 * 2);
        assert_eq!(l.narrow - l.wide, 4096 * 4304 * 4);
        assert_eq!(l.merged - l.narrow, 4096 * 4304 * 2);
        assert_eq!(l.rope_pos - l.merged, 1024 * 5120 * 2);
        assert_eq!(l.bytes - l.rope_pos, 2048 * 12);
    }

    #[test]
    fn default_bound_takes_one_max_pixels_image() {
        assert_eq!(default_max_image_tokens(16_777_216, 16), 65_536); // Qwen3.5/3.6's preprocessor
        assert_eq!(default_max_image_tokens(28 * 28 * 1280, 14), 5120); // Qwen2-VL's
        assert_eq!(default_max_image_tokens(65_536, 16), MIN_DEFAULT_IMAGE_TOKENS);
        assert_eq!(default_max_image_tokens(u64::MAX, 0), usize::try_from(u64::MAX).unwrap_or(usize::MAX));
    }
}
