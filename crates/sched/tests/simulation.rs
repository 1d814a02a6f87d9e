//! Scheduler simulations: random workloads under tight budgets. After every step the pools are
//! consistent, the token budget and sequence limit hold, chunks continue exactly where the cache
//! ends, every sequence finishes with exactly its tokens, and preemption only delays. With a prefix
//! cache, every snapshot's contents are followed through the steps' cache ops (snapshots inside chunks
//! or at their ends): a sequence resumes only from the state of exactly its prefix.

use std::collections::HashMap;

use deltaserve_backend::{CacheOp, SnapshotLoc, StepBatch};
use deltaserve_sched::{AdmitError, PrefixCacheConfig, SchedConfig, Scheduler};

mod common;
use proptest::prelude::*;

/// The shared configuration without a prefix cache.
fn cfg(max_batch_tokens: usize, num_pages: usize, max_seqs: usize) -> SchedConfig {
    common::cfg(max_batch_tokens, num_pages, max_seqs, false)
}

/// Runs a workload to completion; "sampling" appends a token derived from (id, position).
fn simulate(c: SchedConfig, reqs: &[(usize, usize, usize)]) -> (HashMap<u64, Vec<u32>>, u64) {
    simulate_with(c, reqs, false, 0)
}

/// What the state slots and snapshots hold: the tokens whose state each is (None: unknown).
#[derive(Default)]
struct States {
    slots: HashMap<u32, Vec<u32>>,
    snapshots: HashMap<SnapshotLoc, Vec<u32>>,
}

impl States {
    /// Applies cache ops; a restore must find exactly the prefix its sequence's chunk continues from.
    fn apply(&mut self, ops: &[CacheOp], batch: &StepBatch, tokens: &dyn Fn(u64) -> Vec<u32>) {
        for op in ops {
            match *op {
                CacheOp::SaveState { slot, to } => {
                    let held = self.slots.get(&slot).cloned().expect("a saved slot holds a known state");
                    self.snapshots.insert(to, held);
                }
                CacheOp::MoveSnapshot { from, to } => {
                    let held = self.snapshots.remove(&from).expect("a moved snapshot holds a known state");
                    self.snapshots.insert(to, held);
                }
                CacheOp::RestoreState { from, slot } => {
                    let held = self.snapshots.get(&from).cloned().expect("a restored snapshot holds a known state");
                    // (A sequence admitted and then preempted in the same step has no chunk left.)
                    if let Some(c) = batch.seqs.iter().find(|c| c.slot == slot) {
                        assert_eq!(held.len(), c.start, "restored state length vs the chunk's start");
                        assert_eq!(held, tokens(c.seq_id)[..c.start], "a sequence resumed from another prefix's state");
                    }
                    self.slots.insert(slot, held);
                }
                CacheOp::CopyState { src, dst } => {
                    let held = self.slots.get(&src).cloned().expect("a copied slot holds a known state");
                    self.slots.insert(dst, held);
                }
                CacheOp::CopyPagePrefix { .. } => {}
            }
        }
    }

    /// The step's chunks ran: snapshots inside them, then each slot's state at its chunk's end.
    fn run(&mut self, batch: &StepBatch, tokens: &dyn Fn(u64) -> Vec<u32>) {
        let mut written = Vec::new();
        for c in &batch.seqs {
            let toks = tokens(c.seq_id);
            for &(p, loc) in &c.save_within {
                assert!(p > c.start && p < c.start + c.tokens.len(), "a snapshot point inside its chunk");
                assert!(!written.contains(&loc), "two snapshots of one step in {loc:?}");
                written.push(loc);
                self.snapshots.insert(loc, toks[..p].to_vec());
            }
            self.slots.insert(c.slot, toks[..c.start + c.tokens.len()].to_vec());
        }
    }
}

/// `shared`: prompts share prefixes (a common "system prompt" and each other's tokens) and ask for
/// snapshots at fixed points, so the prefix cache is exercised.
/// `within`: how many snapshots the backend takes inside the chunks of one step.
fn simulate_with(
    c: SchedConfig,
    reqs: &[(usize, usize, usize)],
    shared: bool,
    within: usize,
) -> (HashMap<u64, Vec<u32>>, u64) {
    let mut s = Scheduler::new(c.clone()).with_snapshots_within_chunks(within);
    let mut states = States::default();
    let mut done = HashMap::new();
    let mut step = 0;
    let mut pending: Vec<(usize, u64, Vec<u32>, usize)> = reqs
        .iter()
        .enumerate()
        .map(|(i, &(arrive, p, m))| (arrive, i as u64, (0..p as u32).map(|t| t + 1000 * i as u32).collect(), m))
        .collect();
    pending.sort_by_key(|r| r.0);
    loop {
        while let Some(r) = pending.first() {
            if r.0 > step {
                break;
            }
            let (_, id, prompt, max) = pending.remove(0);
            let opts = deltaserve_sched::SeqOptions {
                snapshot_points: if shared { vec![5, 12, 17] } else { vec![] },
                snapshot_on_finish: shared,
                no_drafts: false,
                ..Default::default()
            };
            s.add_with(id, prompt, max, opts).unwrap();
        }
        if s.is_idle() && pending.is_empty() {
            s.assert_consistent();
            break;
        }
        let plan = s.schedule();
        assert!(plan.batch.num_tokens() <= c.max_batch_tokens);
        assert!(plan.batch.seqs.len() <= c.max_seqs);
        let mut seen = std::collections::HashSet::new();
        for ch in &plan.batch.seqs {
            assert!(seen.insert(ch.seq_id), "a sequence appears twice in one step");
            let toks = s.tokens(ch.seq_id).unwrap();
            assert_eq!(&toks[ch.start..ch.start + ch.tokens.len()], &ch.tokens[..]);
            assert!(ch.pages.len() * c.page_size >= ch.start + ch.tokens.len());
        }
        let inside: usize = plan.batch.seqs.iter().map(|ch| ch.save_within.len()).sum();
        assert!(inside <= within, "{inside} snapshots inside the chunks of a step that takes {within}");
        let tokens = |id: u64| s.tokens(id).unwrap().to_vec();
        states.apply(&plan.batch.pre, &plan.batch, &tokens);
        states.run(&plan.batch, &tokens);
        states.apply(&plan.batch.post, &plan.batch, &tokens);
        s.commit(&plan);
        for ch in plan.batch.seqs.iter().filter(|c| c.want_logits) {
            let pos = ch.start + ch.tokens.len();
            if s.append_token(ch.seq_id, (ch.seq_id * 7919 + pos as u64) as u32 % 50_000) {
                done.insert(ch.seq_id, s.tokens(ch.seq_id).unwrap().to_vec());
                s.finish(ch.seq_id);
            }
        }
        s.assert_consistent();
        step += 1;
        assert!(step < 100_000, "no progress");
    }
    (done, s.stats().preemptions)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]
    #[test]
    fn random_workloads_complete_identically_under_any_budget(
        reqs in prop::collection::vec((0usize..20, 1usize..40, 1usize..20), 1..12),
        budget in 1usize..40,
        pages in 16usize..40,
        seqs in 1usize..6,
    ) {
        let reqs: Vec<_> = reqs.into_iter().map(|(a, p, m)| (a, p, m.min(64 + 1 - p))).collect();
        let (roomy, _) = simulate(cfg(256, 1000, 16), &reqs);
        let (tight, _) = simulate(cfg(budget, pages, seqs), &reqs);
        prop_assert_eq!(roomy.len(), reqs.len());
        prop_assert_eq!(roomy, tight);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]
    #[test]
    fn prefix_cache_bookkeeping_stays_consistent_and_never_changes_outputs(
        reqs in prop::collection::vec((0usize..20, 1usize..40, 1usize..20), 1..12),
        budget in 1usize..40,
        pages in 16usize..40,
        seqs in 1usize..6,
        device in 1usize..3,
        host in 0usize..3,
        within in prop::sample::select(vec![0usize, 1, 2, usize::MAX]),
    ) {
        let reqs: Vec<_> = reqs.into_iter().map(|(a, p, m)| (a, p, m.min(64 + 1 - p))).collect();
        let (plain, _) = simulate_with(cfg(256, 1000, 16), &reqs, true, 0);
        let cached = SchedConfig {
            prefix_cache: PrefixCacheConfig { device_slots: device, host_slots: host, page_size: 4, snapshot_bytes: 100, page_bytes: 10 },
            snapshot_interval: 7,
            ..cfg(budget, pages, seqs)
        };
        let (with_cache, _) = simulate_with(cached, &reqs, true, within);
        prop_assert_eq!(plain, with_cache);
    }
}

#[test]
fn small_kv_budget_forces_preemption_and_everything_still_finishes() {
    let reqs: Vec<(usize, usize, usize)> = (0..8).map(|i| (0, 20 + i, 30)).collect();
    let (done, preemptions) = simulate(cfg(64, 16, 8), &reqs);
    assert_eq!(done.len(), 8);
    assert!(preemptions > 0, "the budget should force preemption");
    for (i, (_, p, m)) in reqs.iter().enumerate() {
        assert_eq!(done[&(i as u64)].len(), p + m);
    }
}

#[test]
fn admission_limits_are_clear_errors() {
    let mut s = Scheduler::new(SchedConfig { max_waiting: 2, ..cfg(16, 16, 2) });
    assert_eq!(s.add(1, vec![], 4), Err(AdmitError::EmptyPrompt));
    assert_eq!(s.add(1, vec![1], 0), Err(AdmitError::ZeroMaxTokens));
    // max_context 64: a 64-token prompt with one token to generate fits (the last token needs no slot).
    assert!(s.add(1, vec![1; 64], 1).is_ok());
    let e = s.add(2, vec![1; 65], 1).unwrap_err();
    assert!(matches!(e, AdmitError::ContextTooLong { prompt: 65, max_context: 64, .. }), "{e}");
    assert!(e.to_string().contains("64"));
    assert!(matches!(s.add(3, vec![1; 10], 56), Err(AdmitError::ContextTooLong { .. })));
    assert!(s.add(3, vec![1; 10], 55).is_ok());
    assert!(matches!(s.add(9, vec![1; 10], usize::MAX), Err(AdmitError::ContextTooLong { .. })));
    assert_eq!(s.add(3, vec![1], 1), Err(AdmitError::DuplicateId(3)));
    assert!(matches!(s.add(4, vec![1], 1), Err(AdmitError::Overloaded { waiting: 2, limit: 2 })));
}

#[test]
fn stats_count_the_waiting_prompt_tokens_and_the_page_size() {
    let mut s = Scheduler::new(cfg(16, 16, 1));
    s.add(1, vec![1; 10], 4).unwrap();
    s.add(2, vec![2; 7], 4).unwrap();
    let st = s.stats();
    assert_eq!((st.waiting, st.waiting_tokens, st.page_size), (2, 17, 4));
    let p = s.schedule();
    s.commit(&p);
    // One sequence fits (max_seqs 1): only the other's prompt is still waiting.
    let st = s.stats();
    assert_eq!((st.running, st.waiting, st.waiting_tokens), (1, 1, 7));
}

#[test]
fn long_prompt_is_split_across_steps_and_decodes_keep_flowing() {
    let mut s = Scheduler::new(cfg(8, 100, 4));
    s.add(1, vec![1; 3], 10).unwrap();
    let p = s.schedule();
    s.commit(&p);
    s.append_token(1, 9);
    s.add(2, vec![2; 30], 2).unwrap();
    let mut steps = 0;
    while s.tokens(2).map(|t| t.len()) == Some(30) {
        let p = s.schedule();
        // sequence 1 decodes one token in every step while 2's prompt streams in 7-token chunks
        assert_eq!(p.batch.seqs[0].seq_id, 1);
        assert_eq!(p.batch.seqs[0].tokens.len(), 1);
        assert!(p.batch.num_tokens() <= 8);
        s.commit(&p);
        for c in p.batch.seqs.iter().filter(|c| c.want_logits) {
            s.append_token(c.seq_id, 5);
        }
        s.assert_consistent();
        steps += 1;
    }
    assert_eq!(steps, 5, "30 prompt tokens in chunks of 7");
}

#[test]
fn cancellation_frees_everything_at_once() {
    let mut s = Scheduler::new(cfg(64, 16, 4));
    s.add(1, vec![1; 40], 10).unwrap();
    let p = s.schedule();
    s.commit(&p);
    assert!(s.stats().pages_in_use > 0);
    assert!(s.remove(1));
    let st = s.stats();
    assert_eq!((st.pages_in_use, st.slots_in_use, st.running, st.waiting), (0, 0, 0, 0));
    assert!(!s.remove(1));
    s.assert_consistent();
}

#[test]
fn a_step_takes_as_many_snapshots_inside_its_chunks_as_the_backend_does() {
    // A 30-token prompt with snapshot points 5, 12 and 17: the first chunk runs past as many points as
    // the backend takes a step and ends at the next.
    for (limit, first_chunk, inside) in [(0, 5, 0), (1, 12, 1), (2, 17, 2), (usize::MAX, 30, 3)] {
        let c = SchedConfig {
            prefix_cache: PrefixCacheConfig {
                device_slots: 4,
                host_slots: 0,
                page_size: 4,
                snapshot_bytes: 100,
                page_bytes: 10,
            },
            ..cfg(64, 100, 4)
        };
        let mut s = Scheduler::new(c).with_snapshots_within_chunks(limit);
        let opts = deltaserve_sched::SeqOptions { snapshot_points: vec![5, 12, 17], ..Default::default() };
        s.add_with(1, (100..130).collect(), 1, opts).unwrap();
        let plan = s.schedule();
        let ch = &plan.batch.seqs[0];
        assert_eq!((ch.tokens.len(), ch.save_within.len()), (first_chunk, inside), "limit {limit}");
        let points: Vec<usize> = ch.save_within.iter().map(|s| s.0).collect();
        assert_eq!(points, [5, 12, 17][..inside], "limit {limit}");
    }
}
