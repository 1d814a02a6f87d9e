//! Steps planned ahead ([`Scheduler::schedule_ahead`]): random workloads driven like the engine's
//! look-ahead (each step's successor planned before its picks are appended, random early stops,
//! late arrivals, tight page budgets, a prefix cache). A planned-ahead chunk always decodes its
//! sequence's pending pick at the next position with pages that cover it, never for a sequence whose
//! pick is its last, never while a waiting request could be admitted; pools stay consistent and every
//! sequence ends with exactly its tokens.

use std::collections::HashMap;

use deltaserve_sched::{Scheduler, SeqOptions, StepPlan};
use proptest::prelude::*;

mod common;
use common::{cfg, truth};

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn planned_ahead_chunks_decode_the_pending_pick(
        reqs in prop::collection::vec((1usize..30, 1usize..20, any::<bool>()), 1..8),
        late in 0usize..8,
        stop_seed in any::<u64>(),
        pages in 16usize..40,
        max_seqs in 1usize..4,
        cache in any::<bool>(),
    ) {
        let mut s = Scheduler::new(cfg(16, pages, max_seqs, cache));
        // Expected final lengths (a request may stop early: `stops` picks the position).
        let mut want: HashMap<u64, usize> = HashMap::new();
        let add = |s: &mut Scheduler, want: &mut HashMap<u64, usize>, i: usize| {
            let (p, m, _) = reqs[i];
            let id = i as u64;
            let prompt: Vec<u32> = (0..p).map(|pos| truth(id, pos)).collect();
            let opts = SeqOptions { snapshot_points: vec![], snapshot_on_finish: cache, no_drafts: false, ..SeqOptions::default() };
            s.add_with(id, prompt, m, opts).unwrap();
            want.insert(id, p + m);
        };
        let first = reqs.len().min(late.max(1));
        for i in 0..first {
            add(&mut s, &mut want, i);
        }
        let mut rng = stop_seed;
        let (mut steps, mut ahead_steps) = (0, 0);
        // The launched, uncommitted step (look-ahead keeps one).
        let mut launched: Option<StepPlan> = None;
        let mut added = first;
        while !s.is_idle() || launched.is_some() {
            steps += 1;
            prop_assert!(steps < 10_000, "no progress");
            let cur = match launched.take() {
                Some(p) => p,
                None => s.schedule(),
            };
            s.commit(&cur);
            if steps % 5 == 0 && added < reqs.len() {
                add(&mut s, &mut want, added);
                added += 1;
            }
            let next = s.schedule_ahead(&cur);
            if let Some(n) = &next {
                ahead_steps += 1;
                for ch in &n.batch.seqs {
                    let toks = s.tokens(ch.seq_id).unwrap();
                    prop_assert_eq!(ch.start, toks.len(), "the pending pick's position");
                    prop_assert_eq!(ch.tokens.len(), 1);
                    prop_assert!(ch.pages.len() * 4 > ch.start, "pages cover the next position");
                    let generated = toks.len() - reqs[ch.seq_id as usize].0;
                    prop_assert!(generated + 1 < reqs[ch.seq_id as usize].1, "a last pick is not planned ahead");
                    prop_assert!(cur.batch.seqs.iter().any(|c| c.seq_id == ch.seq_id && c.want_logits));
                }
                let st = s.stats();
                prop_assert!(st.waiting == 0 || st.running == max_seqs || st.slots_in_use == max_seqs);
            }
            // The picks of `cur`, as the engine hands them out (some requests stop early).
            for ch in cur.batch.seqs.iter().filter(|c| c.want_logits) {
                let id = ch.seq_id;
                // A sequence that ended at the previous pick: its planned-ahead row did not run.
                let Some(pos) = s.tokens(id).map(<[u32]>::len) else { continue };
                let mut finished = s.append_token(id, truth(id, pos));
                rng = rng.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                if reqs[id as usize].2 && (rng >> 33) % 7 == 0 {
                    want.insert(id, pos + 1);
                    finished = true;
                }
                if finished {
                    let toks = s.tokens(id).unwrap().to_vec();
                    prop_assert_eq!(toks.len(), want[&id]);
                    prop_assert!(toks.iter().enumerate().all(|(p, &t)| t == truth(id, p)));
                    s.finish(id);
                }
            }
            // A planned-ahead chunk of a finished sequence is dropped at its commit.
            launched = next;
            s.assert_consistent();
            if s.is_idle() && launched.is_none() && added < reqs.len() {
                add(&mut s, &mut want, added);
                added += 1;
            }
        }
        // A long enough lone request is planned ahead once its prompt ran.
        prop_assert!(ahead_steps > 0 || reqs.len() > 1 || reqs[0].1 <= 2 || reqs[0].0 > 16);
        let st = s.stats();
        prop_assert_eq!(st.slots_in_use, 0);
        prop_assert_eq!(st.pages_in_use, if cache { st.pages_in_use } else { 0 });
    }
}
