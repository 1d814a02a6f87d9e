//! Steps of a backend whose rows come to the host as logits (the CPU reference, a tensor-parallel
//! group, test backends): every [`Want`] served from one logits step, the tokens picked on the host by
//! the same rules a device applies ([`argmax`], [`crate::RowSampling::pick`]); and the answers of a backend
//! to the calls its [`crate::Capabilities`] exclude.

use crate::{
    BackendError, DraftPicker, Pick, SpecCommit, StepBatch, StepOut, Want, argmax, check_sample_rows, sampling,
};

/// [`crate::Backend::step`] from `run(picker, logits, drafts)`, which runs `batch` and appends each
/// wanted row's logits (`vocab` wide) to `logits`; given the picker ([`Want::Drafts`]) it drafts and
/// verifies the speculative chunks into `logits` and `drafts`. For [`Want::Tokens`] and
/// [`Want::DraftsArgmax`] the rows pass through the end of `out.logits` (left as it was) and their
/// tokens go to `out.tokens`.
pub fn host_step(
    batch: &StepBatch,
    vocab: usize,
    want: Want<'_>,
    out: &mut StepOut,
    run: impl FnOnce(Option<&mut DraftPicker<'_>>, &mut Vec<f32>, &mut Vec<Vec<u32>>) -> Result<(), BackendError>,
) -> Result<(), BackendError> {
    if matches!(want, Want::Tokens { .. } | Want::DraftsArgmax { .. }) && batch.seqs.iter().any(|c| c.all_logits) {
        return Err(all_logits_picked());
    }
    match want {
        Want::Logits => run(None, &mut out.logits, &mut out.drafts),
        Want::Drafts(pick) => run(Some(pick), &mut out.logits, &mut out.drafts),
        Want::DraftsArgmax { valid, pick } => {
            let at = out.logits.len();
            let r = run(Some(pick), &mut out.logits, &mut out.drafts)
                .and_then(|()| pick_tokens(&mut out.logits[at..], vocab, valid, Pick::Argmax, &mut out.tokens));
            out.logits.truncate(at);
            r
        }
        Want::Tokens { valid, pick } => {
            match pick {
                Pick::Sample(rows) => check_sample_rows(batch, rows)?,
                Pick::Later => return Err(later_in_a_step()),
                Pick::Argmax => {}
            }
            let at = out.logits.len();
            let r = run(None, &mut out.logits, &mut out.drafts)
                .and_then(|()| pick_tokens(&mut out.logits[at..], vocab, valid, pick, &mut out.tokens));
            out.logits.truncate(at);
            r
        }
    }
}

/// Appends the token of each row of `logits` (rows of `vocab`) picked by `pick` over ids `< valid`:
/// the argmax, or the row's [`crate::RowSampling`] (its penalties are applied to `logits`).
/// [`Pick::Later`] is for launched steps only: an invalid step here.
pub fn pick_tokens(
    logits: &mut [f32],
    vocab: usize,
    valid: usize,
    pick: Pick<'_>,
    tokens: &mut Vec<u32>,
) -> Result<(), BackendError> {
    match pick {
        _ if vocab == 0 => {}
        Pick::Argmax => tokens.extend(logits.chunks_exact(vocab).map(|row| argmax(&row[..valid.min(vocab)]))),
        Pick::Sample(rows) => tokens.extend(sampling::pick_rows(logits, vocab, valid, rows, false)),
        Pick::Later => return Err(later_in_a_step()),
    }
    Ok(())
}

/// The error of a step whose rows come back as picks (or a launched step) holding a chunk that wants
/// every row's logits ([`crate::SeqChunk::all_logits`]).
pub fn all_logits_picked() -> BackendError {
    BackendError::InvalidStep("a chunk wanting every row's logits needs a step that returns logits".into())
}

/// The error of [`Pick::Later`] outside [`crate::Backend::launch`].
pub fn later_in_a_step() -> BackendError {
    BackendError::InvalidStep("picks left for later belong to launched steps".into())
}

/// The answer to [`crate::Backend::launch`] / [`crate::Backend::collect`] of a backend that does not
/// launch steps ahead.
pub fn no_launches(backend: &str) -> BackendError {
    BackendError::Unsupported(format!("launching steps ahead (backend {backend})"))
}

/// [`crate::Backend::commit_speculative`] of a backend that verifies no drafts: nothing to commit.
pub fn no_verified_chunks(commits: &[SpecCommit]) -> Result<(), BackendError> {
    match commits.first() {
        None => Ok(()),
        Some(c) => Err(BackendError::InvalidStep(format!("seq {}: no speculative chunk to commit", c.seq_id))),
    }
}

/// Inside `impl Backend for …` of a backend named `$name` whose [`crate::Capabilities`] exclude
/// look-ahead and drafting: its `launch` and `collect` ([`no_launches`]) and `commit_speculative`
/// ([`no_verified_chunks`]), which the engine never calls.
#[macro_export]
macro_rules! without_lookahead_or_drafts {
    ($name:expr) => {
        fn launch(
            &mut self,
            _: &$crate::StepBatch,
            _: usize,
            _: $crate::Pick<'_>,
            _: Option<&$crate::Feed>,
        ) -> Result<(), $crate::BackendError> {
            Err($crate::host::no_launches($name))
        }

        fn pick_launched(&mut self, _: $crate::Pick<'_>) -> Result<(), $crate::BackendError> {
            Err($crate::host::no_launches($name))
        }

        fn collect(&mut self, _: &mut $crate::Picked) -> Result<(), $crate::BackendError> {
            Err($crate::host::no_launches($name))
        }

        fn commit_speculative(&mut self, commits: &[$crate::SpecCommit]) -> Result<(), $crate::BackendError> {
            $crate::host::no_verified_chunks(commits)
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{RowSampling, SeqChunk};

    /// Tokens wanted of a logits step: picked on the host, the logits buffer as it was.
    #[test]
    fn tokens_are_picked_from_the_logits_rows() {
        let batch = StepBatch {
            seqs: (0..2).map(|i| SeqChunk { seq_id: i, want_logits: true, ..SeqChunk::default() }).collect(),
            ..StepBatch::default()
        };
        let run = |_: Option<&mut DraftPicker<'_>>, l: &mut Vec<f32>, _: &mut Vec<Vec<u32>>| {
            l.extend([0.0, 3.0, 9.0, 1.0, 5.0, 2.0, 7.0, 0.0]);
            Ok(())
        };
        let mut out = StepOut { logits: vec![-1.0], ..StepOut::default() };
        host_step(&batch, 4, Want::Tokens { valid: 2, pick: Pick::Argmax }, &mut out, run).unwrap();
        assert_eq!((out.tokens, out.logits), (vec![1, 0], vec![-1.0]));
        let mut out = StepOut::default();
        let rows = [RowSampling::greedy(), RowSampling::greedy()];
        host_step(&batch, 4, Want::Tokens { valid: 4, pick: Pick::Sample(&rows) }, &mut out, run).unwrap();
        assert_eq!(out.tokens, vec![2, 2]);
        let e = host_step(&batch, 4, Want::Tokens { valid: 4, pick: Pick::Sample(&rows[..1]) }, &mut out, run);
        assert!(matches!(e, Err(BackendError::InvalidStep(_))), "{e:?}");
        // Drafts with every row's argmax: the picker reaches the run, the rows become tokens.
        let mut out = StepOut::default();
        let mut picker = |_: u64, _: usize, _: &[f32]| 0u32;
        let drafting = |p: Option<&mut DraftPicker<'_>>, l: &mut Vec<f32>, d: &mut Vec<Vec<u32>>| {
            assert!(p.is_some());
            d.push(vec![5]);
            run(None, l, d)
        };
        host_step(&batch, 4, Want::DraftsArgmax { valid: 3, pick: &mut picker }, &mut out, drafting).unwrap();
        assert_eq!((out.tokens, out.logits, out.drafts), (vec![2, 2], vec![], vec![vec![5]]));
        let mut out = StepOut::default();
        host_step(&batch, 4, Want::Logits, &mut out, run).unwrap();
        assert_eq!((out.logits.len(), out.tokens.len()), (8, 0));
    }
}
