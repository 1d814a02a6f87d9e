//! Every position's logits of one token sequence, through any [`Backend`]: the sequence runs alone in
//! one state slot, one position per step, each step asking for its logits row. What `deltaserve logits`
//! writes and what `deltaserve eval kld` compares. A prompt with images runs them as the engine does
//! (each step's chunk carries its image rows and M-RoPE positions).

use std::sync::Arc;

use deltaserve_backend::{Backend, BackendError, ImagePatches, SeqChunk, StepBatch, step_logits};

use crate::engine::images::{self, ImageRules};

#[derive(Debug, thiserror::Error)]
pub enum ScoreError {
    #[error("token id {id} at position {index} is outside the vocabulary (size {vocab})")]
    OutsideVocabulary { id: u32, index: usize, vocab: usize },
    #[error(transparent)]
    Backend(#[from] BackendError),
    #[error("{0}")]
    Images(String),
}

/// Runs `tokens` through `backend` as one new sequence in state `slot` over the KV `pages` (which cover
/// `tokens.len()` positions) and calls `each(i, row)` with the logits row after position `i` (the
/// distribution of token `i + 1`), in position order. Every id is checked against the vocabulary first.
pub fn logits_at_every_position(
    backend: &mut dyn Backend,
    slot: u32,
    pages: &[u32],
    tokens: &[u32],
    each: impl FnMut(usize, &[f32]),
) -> Result<(), ScoreError> {
    logits_with_images(backend, slot, pages, tokens, &[], each)
}

/// [`logits_at_every_position`] of a prompt whose image placeholder runs hold `images`, in order (the
/// backend must run images: [`Backend::image_tokens`]; one sequence scored, its images unbounded).
pub fn logits_with_images(
    backend: &mut dyn Backend,
    slot: u32,
    pages: &[u32],
    tokens: &[u32],
    images: &[Arc<ImagePatches>],
    mut each: impl FnMut(usize, &[f32]),
) -> Result<(), ScoreError> {
    let vocab = backend.capabilities().vocab_size;
    if let Some((index, &id)) = tokens.iter().enumerate().find(|(_, id)| **id as usize >= vocab) {
        return Err(ScoreError::OutsideVocabulary { id, index, vocab });
    }
    let placed = images::place(tokens, images, ImageRules { tokens: backend.image_tokens(), max_patches: usize::MAX })
        .map_err(|e| ScoreError::Images(e.to_string()))?;
    let chunk = SeqChunk { slot, pages: pages.to_vec(), want_logits: true, ..SeqChunk::default() };
    let mut batch = StepBatch { seqs: vec![chunk], ..StepBatch::default() };
    let mut row = Vec::with_capacity(vocab);
    for (i, &id) in tokens.iter().enumerate() {
        let chunk = &mut batch.seqs[0];
        (chunk.start, chunk.tokens) = (i, vec![id]);
        images::place_chunk(chunk, &placed);
        row.clear();
        step_logits(backend, &batch, &mut row)?;
        if row.len() != vocab {
            return Err(
                BackendError::Device(format!("a step returned {} logits, not one row of {vocab}", row.len())).into()
            );
        }
        each(i, &row);
    }
    Ok(())
}
