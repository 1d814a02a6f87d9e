//! Forking a sequence after its prompt ran (several choices of one prompt): the child shares the
//! full KV pages, gets copies of the partly filled page and of the state slot, and decodes on its
//! own; without a free slot it waits and recomputes.

use deltaserve_backend::CacheOp;
use deltaserve_sched::{AdmitError, Scheduler, SeqOptions};

mod common;
use common::cfg;

/// Runs steps until `id`'s prompt is cached (its first pick pending).
fn prefill(s: &mut Scheduler, id: u64) {
    for _ in 0..20 {
        let plan = s.schedule();
        s.commit(&plan);
        s.assert_consistent();
        if plan.batch.seqs.iter().any(|c| c.seq_id == id && c.want_logits) {
            return;
        }
    }
    panic!("the prompt of {id} never ran");
}

#[test]
fn a_fork_shares_full_pages_and_copies_the_rest() {
    let mut s = Scheduler::new(cfg(64, 16, 4, false));
    s.add(1, (0..10).collect(), 5).unwrap(); // pages of 4: two full, one holding 2 tokens
    assert_eq!(s.fork(1, 2, SeqOptions::default()), Err(AdmitError::NotForkable(1)), "not prefilled yet");
    prefill(&mut s, 1);
    assert!(s.fork(1, 2, SeqOptions::default()).unwrap());
    assert_eq!(s.fork(1, 2, SeqOptions::default()), Err(AdmitError::DuplicateId(2)));
    s.assert_consistent();
    assert_eq!(s.tokens(2), s.tokens(1));
    let st = s.stats();
    assert_eq!((st.running, st.pages_in_use, st.forks), (2, 4, 1), "3 parent pages + 1 private copy");
    s.append_token(1, 50);
    s.append_token(2, 60);
    let plan = s.schedule();
    let (p, c) = (&plan.batch.seqs[0], &plan.batch.seqs[1]);
    assert_eq!((p.seq_id, c.seq_id), (1, 2));
    assert_eq!((p.start, c.start), (10, 10), "the child continues where the parent is");
    assert_eq!(c.tokens, vec![60]);
    assert_eq!(&c.pages[..2], &p.pages[..2], "full pages are shared");
    assert_ne!(c.pages[2], p.pages[2]);
    assert_eq!(
        &plan.batch.pre[..],
        &[
            CacheOp::CopyState { src: p.slot, dst: c.slot },
            CacheOp::CopyPagePrefix { src: p.pages[2], dst: c.pages[2], tokens: 2 }
        ]
    );
    s.commit(&plan);
    s.remove(1);
    s.assert_consistent();
    assert_eq!(s.stats().pages_in_use, 3, "the child keeps the shared pages");
    s.remove(2);
    assert_eq!(s.stats().pages_in_use, 0);
}

#[test]
fn without_a_free_slot_the_fork_waits_and_recomputes() {
    let mut s = Scheduler::new(cfg(64, 16, 1, false));
    s.add(1, (0..8).collect(), 5).unwrap();
    prefill(&mut s, 1);
    assert!(!s.fork(1, 2, SeqOptions::default()).unwrap());
    s.assert_consistent();
    s.append_token(2, 60);
    assert_eq!((s.stats().waiting, s.stats().forks), (1, 0));
    s.remove(1);
    let plan = s.schedule();
    assert_eq!(plan.admitted, vec![2]);
    let c = &plan.batch.seqs[0];
    assert_eq!((c.start, c.tokens.len()), (0, 9), "prompt and first token run again");
    assert!(plan.batch.pre.is_empty());
}
