//! Verifying a speculative chunk: its drafts accepted or not, row by row, under the request's sampler
//! and constraint.

use deltaserve_backend::sampling::apply_mask;
use deltaserve_sched::SeqId;

use super::{Emit, FinishReason, Worker};
use crate::sampling::speculative_pick;

impl Worker {
    /// Emits the verified tokens of a speculative chunk of `id`: row i of `rows` is the target's logits
    /// after the chunk's token and drafts `..i`. Returns (tokens emitted, drafts among them, finish).
    ///
    /// Under a constraint, the drafts are checked against it in order from where the reply stands; the
    /// first it refuses ends acceptance there. Each row is masked by the constraint (which has followed
    /// every token emitted before it) before its token is picked, so the target's token at the first
    /// refused draft is drawn under the mask and no token the constraint refuses is emitted. Greedy
    /// requests get the tokens of plain decoding; sampling requests keep the masked distribution (a
    /// refused draft has probability 0 under it: rejection sampling rejects it). `first`: the first
    /// row's bitmask when it was computed while the step ran.
    pub(super) fn accept(
        &mut self,
        id: SeqId,
        drafts: &[u32],
        rows: Vec<&mut [f32]>,
        q: Option<Vec<Vec<f32>>>,
        mut first: Option<Vec<u32>>,
    ) -> (usize, usize, Option<FinishReason>) {
        let (mut emitted, mut accepted) = (0, 0);
        let constraint = self.reqs.get(&id).and_then(|l| l.req.constraint.clone());
        let allowed = constraint.as_ref().map_or(drafts.len(), |c| c.with(|c| c.allows_prefix(drafts)).unwrap_or(0));
        for (i, row) in rows.into_iter().enumerate() {
            let Some(live) = self.reqs.get_mut(&id) else { break };
            let raw = live.req.logprobs.map(|_| row.to_vec());
            match (first.take(), &constraint) {
                (Some(bits), Some(_)) => apply_mask(&bits, row),
                (_, Some(c)) => c.with(|c| c.mask(row)),
                _ => {}
            }
            let context = self.sched.tokens(id).unwrap_or(&[]);
            let draft = drafts.get(i).copied();
            let (token, is_draft) = match (draft, q.as_ref().and_then(|q| q.get(i))) {
                // Sampling: rejection sampling against the draft distribution q.
                (Some(d), Some(qi)) if !live.sampler.is_greedy() => {
                    let p = live.sampler.distribution(row, context);
                    speculative_pick(&mut live.sampler, &p, qi, d)
                }
                // Greedy (or the bonus row): the target's own pick; a draft survives if it is that pick.
                _ => {
                    let t = live.sampler.sample(row, context);
                    (t, draft == Some(t))
                }
            };
            let is_draft = is_draft && i < allowed;
            emitted += 1;
            accepted += usize::from(is_draft);
            match self.emit(id, token, raw) {
                Emit::Continue if is_draft => {}
                Emit::Continue | Emit::Gone => return (emitted, accepted, None),
                Emit::Finish(r) => return (emitted, accepted, Some(r)),
            }
        }
        (emitted, accepted, None)
    }

    /// [`Self::accept`] for a greedy request whose verified rows were picked where the logits are:
    /// `tokens[i]` is the target's argmax after the chunk's token and drafts `..i`. A draft survives
    /// while it is that pick.
    pub(super) fn accept_tokens(
        &mut self,
        id: SeqId,
        drafts: &[u32],
        tokens: &[u32],
    ) -> (usize, usize, Option<FinishReason>) {
        let (mut emitted, mut accepted) = (0, 0);
        for (i, &token) in tokens.iter().enumerate() {
            let is_draft = drafts.get(i) == Some(&token);
            emitted += 1;
            accepted += usize::from(is_draft);
            match self.emit(id, token, None) {
                Emit::Continue if is_draft => {}
                Emit::Continue | Emit::Gone => return (emitted, accepted, None),
                Emit::Finish(r) => return (emitted, accepted, Some(r)),
            }
        }
        (emitted, accepted, None)
    }
}
