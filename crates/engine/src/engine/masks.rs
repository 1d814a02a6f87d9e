//! Token masks of constrained rows computed on CPU threads, off the engine thread's critical path.
//!
//! - A step whose rows come back to the host (speculative verify steps; steps sampled on the host)
//!   masks each constrained request's first row by the constraint where the reply stands before the
//!   step, which the step does not change: [`while_running`] computes those bitmasks on a CPU thread
//!   while the engine thread waits for the backend's forward, and the rows are masked with them
//!   afterwards (the later verify rows of a speculative chunk depend on its drafts, known once the
//!   step returns: they are masked then, one after the other, as each draft is accepted).
//! - A step whose rows the backend picks with their bitmasks needs them before its picks: the
//!   bitmasks of several constrained rows are computed on several threads at once ([`bitmasks`]).
//!   With look-ahead, step N+1 is launched before step N's picks are read and its picks wait
//!   (`engine/ahead.rs`): once N is collected and its tokens followed, the masks are computed while
//!   N+1's forward runs, then N+1 is picked with them.

use std::collections::HashMap;

use deltaserve_backend::sampling::{PARALLEL_PICK_VOCAB, map_rows};
use deltaserve_sched::SeqId;

use super::SharedConstraint;

/// The bitmask (`words` words) of the tokens `c` allows next.
pub(super) fn bitmask(c: &SharedConstraint, words: usize) -> Vec<u32> {
    let mut bits = vec![0u32; words];
    c.with(|c| c.allowed(&mut bits));
    bits
}

/// The bitmasks of `constraints`, in order: on several threads when there are several of a large
/// vocabulary (each constraint is its own request's).
pub(super) fn bitmasks(constraints: &mut [&SharedConstraint], words: usize) -> Vec<Vec<u32>> {
    let parallel = constraints.len() > 1 && words * 32 >= PARALLEL_PICK_VOCAB;
    map_rows(constraints, parallel, |c| bitmask(c, words))
}

/// Runs `step` on this thread while the bitmasks (`words` words) of `rows`' constraints are computed
/// on another; returns its result and the bitmasks by sequence. A constraint that panics leaves no
/// bitmask (its rows are then masked on the engine thread, as without this).
pub(super) fn while_running<R>(
    rows: Vec<(SeqId, SharedConstraint)>,
    words: usize,
    step: impl FnOnce() -> R,
) -> (R, HashMap<SeqId, Vec<u32>>) {
    if rows.is_empty() {
        return (step(), HashMap::new());
    }
    std::thread::scope(|s| {
        let job = s.spawn(move || rows.iter().map(|(id, c)| (*id, bitmask(c, words))).collect());
        let r = step();
        (r, job.join().unwrap_or_default())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::TokenConstraint;

    /// Allows the ids `from..from + 3`.
    struct Window {
        from: usize,
    }

    impl TokenConstraint for Window {
        fn mask(&mut self, row: &mut [f32]) {
            for (id, l) in row.iter_mut().enumerate() {
                if !(self.from..self.from + 3).contains(&id) {
                    *l = f32::NEG_INFINITY;
                }
            }
        }
        fn accept(&mut self, _: u32) {}
    }

    #[test]
    fn masks_computed_beside_a_step_are_the_constraints_own() {
        let rows: Vec<(SeqId, SharedConstraint)> =
            [(4, 1), (9, 30), (2, 62)].map(|(id, from)| (id, SharedConstraint::new(Window { from }))).into();
        let (r, masks) = while_running(rows.clone(), 3, || 42);
        assert_eq!(r, 42);
        assert_eq!(masks.len(), 3);
        assert_eq!(masks[&4], vec![0b1110, 0, 0]);
        assert_eq!(masks[&9], vec![3 << 30, 1, 0]);
        assert_eq!(masks[&2], vec![0, 3 << 30, 1]);
        let mut cs: Vec<&SharedConstraint> = rows.iter().map(|(_, c)| c).collect();
        let inline = bitmasks(&mut cs, 3);
        assert_eq!(inline, vec![masks[&4].clone(), masks[&9].clone(), masks[&2].clone()]);
        let (r, masks) = while_running(Vec::new(), 3, || "ran");
        assert_eq!((r, masks.len()), ("ran", 0));
    }
}
