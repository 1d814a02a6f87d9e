//! Steps with images on the CUDA backend (the CPU backend's `chunk_input.rs` is the reference): an image's
//! tower runs in the step that first needs its rows; its merged rows replace the placeholders' embeddings
//! (after the embedding, before the first layer), and the rows a later chunk needs are kept on the host
//! until a chunk takes the image's last row. Keeping them is only a saving: a sequence that leaves the
//! batch mid-image loses them and runs the tower again when it continues.
//!
//! Rotary positions: with the tower loaded, every step uploads each row's (t, h, w) M-RoPE position
//! ([`CudaBackend::rope_rows`]): an image row's grid position, a text row `p + rope_delta` in all three
//! streams (equal streams rotate exactly as plain RoPE at that position); the KV index stays `p`.

use std::collections::HashMap;
use std::sync::Arc;

use deltaserve_backend::{BackendError, ImagePatches, SeqChunk, StepBatch};

use crate::error::CudaError;

use super::CudaBackend;
use super::forward::b2;

/// Rows `first..` of an image's merged rows (bf16 bits, `[rows, hidden]`), kept for a later chunk.
pub(super) struct Kept {
    first: usize,
    rows: Vec<u16>,
}

/// Images' kept rows by (sequence, index of the image's first placeholder).
pub(super) type KeptRows = HashMap<(u64, usize), Kept>;

/// One image's rows `lo..hi` (image-relative) of a step, written at residual row `row`.
pub(super) struct Fill {
    key: (u64, usize),
    image: Arc<ImagePatches>,
    /// Placeholder tokens of the image.
    tokens: usize,
    lo: usize,
    hi: usize,
    row: usize,
    /// Run the tower (no rows kept from an earlier step).
    encode: bool,
}

impl CudaBackend {
    /// The image fills of a step whose chunks run in `order` (chunk `order[r]`'s rows from `cu[r]`),
    /// checked: images only where the tower is loaded, never in speculative chunks, inside their chunk,
    /// each one the tower takes.
    pub(super) fn image_fills(
        &self,
        batch: &StepBatch,
        order: &[usize],
        cu: &[i32],
    ) -> Result<Vec<Fill>, BackendError> {
        let mut fills = Vec::new();
        for (r, &i) in order.iter().enumerate() {
            let c = &batch.seqs[i];
            if c.images.is_empty() {
                continue;
            }
            let inv = |m: String| BackendError::InvalidStep(format!("seq {}: {m}", c.seq_id));
            let Some(v) = &self.vision else {
                return Err(inv("this model runs no vision tower here: images are not accepted".into()));
            };
            if c.draft > 0 {
                return Err(inv("a speculative chunk holds no image rows".into()));
            }
            let kept = v.kept.borrow();
            let end = c.start + c.tokens.len();
            for (n, ci) in c.images.iter().enumerate() {
                let p = ci.placed;
                if p.seq_start >= end || p.end() <= c.start {
                    return Err(inv(format!(
                        "image {n} (tokens {}..{}) is outside the chunk {}..{end}",
                        p.seq_start,
                        p.end(),
                        c.start
                    )));
                }
                let key = (c.seq_id, p.seq_start);
                let (lo, hi) = (p.seq_start.max(c.start) - p.seq_start, p.end().min(end) - p.seq_start);
                let encode = kept.get(&key).is_none_or(|k| k.first > lo);
                if encode {
                    v.check(n, &ci.image).map_err(inv)?;
                    let merge = v.cfg.spatial_merge_size;
                    if ci.image.tokens(merge) != p.tokens() {
                        return Err(inv(format!(
                            "image {n}: {} tokens placed for {} merged patches",
                            p.tokens(),
                            ci.image.tokens(merge)
                        )));
                    }
                }
                let row = cu[r] as usize + (p.seq_start + lo - c.start);
                fills.push(Fill { key, image: ci.image.clone(), tokens: p.tokens(), lo, hi, row, encode });
            }
        }
        Ok(fills)
    }

    /// Writes the step's image rows (the fills set for it) into the residual stream: runs the tower of
    /// each image first needed now, copies its rows of this step, keeps the rest on the host; rows kept
    /// from an earlier step are uploaded. Nothing for a step without images.
    pub(super) fn put_image_rows(&self) -> Result<(), CudaError> {
        let Some(v) = &self.vision else { return Ok(()) };
        let fills = std::mem::take(&mut *v.fills.borrow_mut());
        let h = self.d.hidden;
        let s = self.rt.stream();
        for f in fills {
            let dst = self.ws.residual + b2(f.row * h);
            let n = f.hi - f.lo;
            if f.encode {
                v.encode(&self.k, &self.gemm, &self.rt, &f.image)?;
                self.rt.copy_device(dst, v.merged() + b2(f.lo * h), 2 * n * h)?;
                if f.hi < f.tokens {
                    let mut rows = vec![0u16; (f.tokens - f.hi) * h];
                    self.rt.download(&mut rows, v.merged() + b2(f.hi * h))?;
                    v.kept.borrow_mut().insert(f.key, Kept { first: f.hi, rows });
                }
                continue;
            }
            let mut kept = v.kept.borrow_mut();
            let k = kept.get(&f.key).ok_or_else(|| CudaError::Plan("an image's kept rows are gone".into()))?;
            let src = &k.rows[(f.lo - k.first) * h..(f.hi - k.first) * h];
            // SAFETY: dst holds n rows of the residual stream (the fill lies inside the step's rows);
            // pageable memory is staged before the call returns.
            unsafe { cudarc::driver::result::memcpy_htod_async(dst, src, s.cu_stream()) }
                .map_err(CudaError::driver("cuMemcpyHtoDAsync"))?;
            if f.hi == f.tokens {
                kept.remove(&f.key);
            }
        }
        Ok(())
    }

    /// Sets the fills the next forward writes (see [`CudaBackend::put_image_rows`]).
    pub(super) fn set_image_fills(&self, fills: Vec<Fill>) {
        if let Some(v) = &self.vision {
            *v.fills.borrow_mut() = fills;
        }
    }

    /// Drops the kept rows of sequences that are not in `batch`.
    pub(super) fn retain_images(&self, batch: &StepBatch) {
        if let Some(v) = &self.vision {
            let mut kept = v.kept.borrow_mut();
            if !kept.is_empty() {
                kept.retain(|(seq, _), _| batch.seqs.iter().any(|c| c.seq_id == *seq));
            }
        }
    }

    /// The tower's merged rows of one image (`[tokens, hidden]`, bf16 values as f32), run alone on the
    /// stream: what a step writes in place of the image's placeholders. Fails where no tower is loaded
    /// or the image does not fit it.
    pub fn encode_image(&self, img: &ImagePatches) -> Result<Vec<f32>, CudaError> {
        let v = self.vision.as_ref().ok_or_else(|| CudaError::Plan("no vision tower is loaded".into()))?;
        v.check(0, img).map_err(|m| CudaError::InvalidArgs { kernel: "vision tower", msg: m })?;
        v.encode(&self.k, &self.gemm, &self.rt, img)?;
        let mut rows = vec![0u16; img.tokens(v.cfg.spatial_merge_size) * self.d.hidden];
        self.rt.download(&mut rows, v.merged())?;
        Ok(rows.into_iter().map(|b| half::bf16::from_bits(b).to_f32()).collect())
    }

    /// Images whose rows are kept for a later chunk.
    pub fn images_in_flight(&self) -> usize {
        self.vision.as_ref().map_or(0, |v| v.kept.borrow().len())
    }

    /// The (t, h, w) rotary positions `[rows, 3]` of a step whose chunks run in `order` (their tokens;
    /// padding rows up to `rows` at −1), or nothing without the tower (rows rotate at their KV index).
    pub(super) fn rope_rows(&self, batch: &StepBatch, order: &[usize], rows: usize) -> Vec<i32> {
        if self.vision.is_none() {
            return Vec::new();
        }
        let mut out = Vec::with_capacity(3 * rows);
        for &i in order {
            out.extend(chunk_rope(&batch.seqs[i]));
        }
        out.resize(3 * rows.max(out.len() / 3), -1);
        out
    }
}

/// A chunk's (t, h, w) positions of its tokens, flattened.
fn chunk_rope(c: &SeqChunk) -> Vec<i32> {
    match c.mrope_positions() {
        Some(p) => p[..c.tokens.len()].iter().flat_map(|q| q.map(|x| x as i32)).collect(),
        None => {
            let first = c.first_position();
            (first..first + c.tokens.len()).flat_map(|p| [p as i32; 3]).collect()
        }
    }
}

/// The rotary position (every stream) of draft row `i` of speculative chunk `c` (`start + i` plus the
/// sequence's rope delta).
pub(super) fn draft_rope(c: &SeqChunk, i: usize) -> [i32; 3] {
    [(c.first_position() + i) as i32; 3]
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use deltaserve_backend::{ChunkImage, ImagePatches, SeqChunk};
    use deltaserve_model::mrope::{PlacedImage, place_images};

    use super::{chunk_rope, draft_rope};

    const IMG: u32 = 9;

    fn image(grid_thw: [usize; 3]) -> Arc<ImagePatches> {
        Arc::new(ImagePatches { grid_thw, pixels: Vec::new(), hash: [0; 32] })
    }

    /// Rows of a chunk holding image rows take their (t, h, w) grid positions and the text after the image
    /// continues from it; text chunks after it rotate at p + delta in all three streams, drafts too.
    #[test]
    fn rows_rotate_at_their_mrope_positions() {
        // 2 text, an image of 4×6 patches (2×3 tokens), 2 text.
        let ids = [1, 2, IMG, IMG, IMG, IMG, IMG, IMG, 3, 4];
        let placed: PlacedImage = place_images(&ids, IMG, &[[1, 4, 6]], 2).unwrap()[0];
        let img = ChunkImage { image: image([1, 4, 6]), placed };
        // A chunk from token 4 (inside the image) to 9.
        let c = SeqChunk { start: 4, tokens: ids[4..9].to_vec(), images: vec![img], ..SeqChunk::default() };
        let got: Vec<[i32; 3]> = chunk_rope(&c).chunks(3).map(|p| [p[0], p[1], p[2]]).collect();
        assert_eq!(got, [[2, 2, 4], [2, 3, 2], [2, 3, 3], [2, 3, 4], [5, 5, 5]]);
        // Decode after the prompt: index + delta, every stream; a draft i rows later.
        let delta = placed.delta_after();
        assert_eq!(delta, -3);
        let d = SeqChunk { start: 10, tokens: vec![7], rope_delta: delta, ..SeqChunk::default() };
        assert_eq!(chunk_rope(&d), [7, 7, 7]);
        assert_eq!(draft_rope(&d, 2), [9, 9, 9]);
        // A text-only sequence: its KV index.
        let t = SeqChunk { start: 3, tokens: vec![1, 2], ..SeqChunk::default() };
        assert_eq!(chunk_rope(&t), [3, 3, 3, 4, 4, 4]);
    }
}
