//! The f32 reference vision tower of Qwen3.5/3.6 (HF `Qwen3_5VisionModel`): an [`ImagePatches`] in,
//! image embeddings `[tokens, text_hidden]` out, one row per prompt image token.
//!
//! 1. Patch embedding: the Conv3d whose kernel equals its stride is a linear over each
//!    `channels · temporal · patch²` row (plus its bias).
//! 2. Learned position embeddings: the `side × side` table resampled bilinearly (align-corners) to the
//!    image's `h × w` grid, each patch taking the weighted sum of its four nearest table rows.
//! 3. Blocks: `x += proj(attn(LN₁ x))`, `x += fc2(act(fc1(LN₂ x)))`; attention is non-causal within one
//!    frame of one image, q and k rotated by the patch's (row, column) ([`apply_axial_rope`]).
//! 4. Merger: LayerNorm per patch, each `merge × merge` window's patches concatenated, fc1, exact GELU, fc2.
//!
//! Patches arrive in the image processor's order (each merge window contiguous, windows in raster
//! order), so the merger's windows are consecutive rows; [`patch_positions`] gives each row's
//! (row, column) in the grid.

use deltaserve_model::vision::{LayerNormWeights, VisionBlockWeights, VisionLinear};
use deltaserve_model::weights::HostTensor;
use deltaserve_model::{ImagePatches, VisionAct, VisionConfig, VisionWeights};

use crate::activation::{gelu, gelu_tanh, silu};
use crate::attention::full_attention;
use crate::linear::linear_bias;
use crate::norm::layer_norm;
use crate::rope::apply_axial_rope;

/// LayerNorm epsilon of the tower's blocks and merger (fixed in HF's code).
const LN_EPS: f32 = 1e-6;

/// An image the tower cannot take.
#[derive(Debug, thiserror::Error)]
#[error("image {index}: {reason}")]
pub struct ImageError {
    pub index: usize,
    pub reason: String,
}

/// The tower of one model: its config and f32 weights.
pub struct VisionTower<'a> {
    pub config: &'a VisionConfig,
    pub weights: &'a VisionWeights<HostTensor>,
}

impl VisionTower<'_> {
    /// Checks that `img` fits the tower: a grid that folds into merge windows and a pixel buffer of
    /// `patches × patch_dim` values.
    pub fn check(&self, index: usize, img: &ImagePatches) -> Result<(), ImageError> {
        self.config.check_image(img).map_err(|reason| ImageError { index, reason })
    }

    /// The embeddings of every image, concatenated in order: `[Σ tokens, out_hidden]`.
    pub fn encode_all(&self, images: &[ImagePatches]) -> Result<Vec<f32>, ImageError> {
        let mut out = Vec::new();
        for (i, img) in images.iter().enumerate() {
            self.check(i, img)?;
            out.extend(self.encode(img));
        }
        Ok(out)
    }

    /// One (checked) image's embeddings `[tokens, out_hidden]`.
    pub fn encode(&self, img: &ImagePatches) -> Vec<f32> {
        let mut x = self.patch_embed(img);
        self.add_position_embeddings(&mut x, img.grid_thw);
        for i in 0..self.weights.blocks.len() {
            self.block(i, &mut x, img.grid_thw);
        }
        self.merge(&x)
    }

    /// The patch embedding `[patches, hidden]` (before the position embeddings).
    pub fn patch_embed(&self, img: &ImagePatches) -> Vec<f32> {
        let c = self.config;
        linear_of(&self.weights.patch_embed, &img.pixels, img.patches(), c.hidden_size, c.patch_dim())
    }

    /// Adds the interpolated learned position embeddings to `x` `[patches, hidden]`.
    pub fn add_position_embeddings(&self, x: &mut [f32], grid_thw: [usize; 3]) {
        let (hid, side) = (self.config.hidden_size, self.config.position_grid_side());
        let table = &self.weights.pos_embed.data;
        let pos = position_embeddings(table, hid, side, grid_thw, self.config.spatial_merge_size);
        x.iter_mut().zip(&pos).for_each(|(v, p)| *v += p);
    }

    /// Block `i` over `x` `[patches, hidden]`, in place.
    pub fn block(&self, i: usize, x: &mut [f32], grid_thw: [usize; 3]) {
        let c = self.config;
        let w: &VisionBlockWeights<HostTensor> = &self.weights.blocks[i];
        let (hid, n) = (c.hidden_size, x.len() / c.hidden_size);
        let qkv = linear_of(&w.qkv, &norm(x, &w.norm1), n, 3 * hid, hid);
        let attn = self.attention(&qkv, grid_thw);
        add(x, &linear_of(&w.proj, &attn, n, hid, hid));
        let hn = norm(x, &w.norm2);
        let mut mid = linear_of(&w.fc1, &hn, n, c.intermediate_size, hid);
        let act = match c.hidden_act {
            VisionAct::GeluTanh => gelu_tanh,
            VisionAct::Gelu => gelu,
            VisionAct::Silu => silu,
        };
        mid.iter_mut().for_each(|v| *v = act(*v));
        add(x, &linear_of(&w.fc2, &mid, n, hid, c.intermediate_size));
    }

    /// Attention of `qkv` rows `[patches, 3 · hidden]` (`[q | k | v]`), each frame of the image on its own.
    fn attention(&self, qkv: &[f32], grid_thw: [usize; 3]) -> Vec<f32> {
        let c = self.config;
        let (hid, heads, hd) = (c.hidden_size, c.num_heads, c.head_dim());
        let positions = patch_positions(grid_thw, c.spatial_merge_size);
        let frame = grid_thw[1] * grid_thw[2];
        let mut out = Vec::with_capacity(qkv.len() / 3);
        for (rows, pos) in qkv.chunks(frame * 3 * hid).zip(positions.chunks(frame)) {
            let part = |k: usize| -> Vec<f32> {
                rows.chunks_exact(3 * hid).flat_map(|r| &r[k * hid..][..hid]).copied().collect()
            };
            let (mut q, mut k, v) = (part(0), part(1), part(2));
            apply_axial_rope(&mut q, heads, hd, c.rope_theta, pos);
            apply_axial_rope(&mut k, heads, hd, c.rope_theta, pos);
            out.extend(full_attention(&q, &k, &v, heads, hd));
        }
        out
    }

    /// The merger: `[patches, hidden]` → `[patches / merge², out_hidden]`.
    pub fn merge(&self, x: &[f32]) -> Vec<f32> {
        let c = self.config;
        let w = self.weights;
        let merged = c.hidden_size * c.merge_unit();
        let n = x.len() / merged;
        let mut mid = linear_of(&w.merger_fc1, &norm(x, &w.merger_norm), n, merged, merged);
        mid.iter_mut().for_each(|v| *v = gelu(*v));
        linear_of(&w.merger_fc2, &mid, n, c.out_hidden_size, merged)
    }
}

/// The (row, column) of every patch row of an image, in the processor's order: merge windows in raster
/// order, the patches of a window in raster order within it; repeated for each of the `t` frames.
pub fn patch_positions(grid_thw: [usize; 3], merge: usize) -> Vec<[usize; 2]> {
    let [t, h, w] = grid_thw;
    let mut out = Vec::with_capacity(t * h * w);
    for _ in 0..t {
        for br in 0..h / merge {
            for bc in 0..w / merge {
                for ir in 0..merge {
                    for ic in 0..merge {
                        out.push([br * merge + ir, bc * merge + ic]);
                    }
                }
            }
        }
    }
    out
}

/// The learned position embeddings `[patches, hid]` of an image of `grid_thw` patches (merge windows of
/// `merge`): the `side × side` table `[side², hid]` resampled to the grid, each patch the weighted sum of
/// its four nearest table rows.
pub fn position_embeddings(table: &[f32], hid: usize, side: usize, grid_thw: [usize; 3], merge: usize) -> Vec<f32> {
    let [_, h, w] = grid_thw;
    let positions = patch_positions(grid_thw, merge);
    let mut out = vec![0.0f32; positions.len() * hid];
    for (pos, &[r, c]) in out.chunks_exact_mut(hid).zip(&positions) {
        let (rt, ct) = (interpolation_taps(r, h, side), interpolation_taps(c, w, side));
        let taps = rt.iter().flat_map(|&(ri, rw)| ct.iter().map(move |&(ci, cw)| (ri * side + ci, rw * cw)));
        for (k, wt) in taps {
            for (p, e) in pos.iter_mut().zip(&table[k * hid..][..hid]) {
                *p += e * wt;
            }
        }
    }
    out
}

/// The two table rows (clamped to the table) and weights that resample index `i` of an axis of `size`
/// onto a table axis of `side`, align-corners bilinear, with HF's f32 arithmetic.
fn interpolation_taps(i: usize, size: usize, side: usize) -> [(usize, f32); 2] {
    let src = i as f32 * (side - 1) as f32 / (size.max(2) - 1) as f32;
    let floor = src.floor();
    let tap = |o: usize| ((floor as usize + o).min(side - 1), (1.0 - (src - floor - o as f32).abs()).max(0.0));
    [tap(0), tap(1)]
}

fn linear_of(l: &VisionLinear<HostTensor>, x: &[f32], t: usize, out: usize, inp: usize) -> Vec<f32> {
    linear_bias(x, t, &l.weight.data, l.bias.as_ref().map(|b| b.data.as_slice()), out, inp)
}

fn norm(x: &[f32], w: &LayerNormWeights<HostTensor>) -> Vec<f32> {
    let mut y = x.to_vec();
    layer_norm(&mut y, &w.weight.data, &w.bias.data, LN_EPS);
    y
}

fn add(x: &mut [f32], y: &[f32]) {
    x.iter_mut().zip(y).for_each(|(a, b)| *a += b);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patches_come_window_by_window() {
        let p = patch_positions([1, 4, 4], 2);
        assert_eq!(&p[..6], &[[0, 0], [0, 1], [1, 0], [1, 1], [0, 2], [0, 3]]);
        assert_eq!(p[15], [3, 3]);
        assert_eq!(patch_positions([2, 2, 2], 2).len(), 8);
    }

    #[test]
    fn interpolation_hits_the_table_corners_and_splits_between_rows() {
        // An 8-row table resampled to 4 rows: 0 → row 0, 3 → row 7, 1 → 7/3 between rows 2 and 3.
        assert_eq!(interpolation_taps(0, 4, 8), [(0, 1.0), (1, 0.0)]);
        assert_eq!(interpolation_taps(3, 4, 8)[0], (7, 1.0));
        let [(a, wa), (b, wb)] = interpolation_taps(1, 4, 8);
        assert_eq!((a, b), (2, 3));
        assert!((wa - 2.0 / 3.0).abs() < 1e-6 && (wb - 1.0 / 3.0).abs() < 1e-6);
        // One row: everything from table row 0.
        assert_eq!(interpolation_taps(0, 1, 8)[0], (0, 1.0));
    }
}
