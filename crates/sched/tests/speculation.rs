//! Speculative decoding in the scheduler: random workloads with random acceptance under tight page
//! budgets (preemption) and a prefix cache. After every step the pools are consistent, drafts never
//! exceed K or what a sequence may still emit (and a sequence added without drafts gets none),
//! pages cover every verified position, unused pages are given back after the accept, and every
//! sequence ends with exactly its tokens.

use std::collections::HashMap;

use deltaserve_sched::{Scheduler, SeqOptions};
use proptest::prelude::*;

mod common;
use common::{cfg, truth};

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn drafts_are_bounded_and_pages_follow_the_accepts(
        k in 1usize..=4,
        reqs in prop::collection::vec((1usize..30, 1usize..20), 1..8),
        accept_seed in any::<u64>(),
        budget in 6usize..24,
        pages in 16usize..40,
        cache in any::<bool>(),
    ) {
        let c = cfg(budget, pages, 3, cache);
        let mut s = Scheduler::new(c.clone()).with_speculation(k);
        let mut want: HashMap<u64, usize> = HashMap::new();
        for (i, &(p, m)) in reqs.iter().enumerate() {
            let id = i as u64;
            let prompt: Vec<u32> = (0..p).map(|pos| truth(id, pos)).collect();
            // Every third sequence is constrained: it never drafts.
            let opts = SeqOptions { snapshot_points: vec![], snapshot_on_finish: cache, no_drafts: id % 3 == 2, ..SeqOptions::default() };
            s.add_with(id, prompt, m, opts).unwrap();
            want.insert(id, p + m);
        }
        let mut rng = accept_seed;
        let mut steps = 0;
        let mut drafted = 0;
        while !s.is_idle() {
            steps += 1;
            prop_assert!(steps < 10_000, "no progress");
            let plan = s.schedule();
            prop_assert!(plan.batch.num_tokens() <= c.max_batch_tokens);
            s.commit(&plan);
            for ch in &plan.batch.seqs {
                prop_assert!(ch.pages.len() * 4 >= ch.start + ch.positions(), "pages cover the verified positions");
                if !ch.want_logits {
                    continue;
                }
                let id = ch.seq_id;
                let toks = s.tokens(id).unwrap().to_vec();
                let generated = toks.len() - reqs[id as usize].0;
                let remaining = reqs[id as usize].1 - generated;
                prop_assert!(ch.draft <= k && ch.draft < remaining.max(1), "drafts {} with {remaining} left", ch.draft);
                prop_assert!(id % 3 != 2 || ch.draft == 0, "a sequence without drafts drafted");
                if ch.draft > 0 {
                    drafted += 1;
                    prop_assert_eq!(ch.tokens.len(), 1);
                }
                // Accept a random prefix of the drafts, then emit accepted + 1 tokens.
                rng = rng.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                let accepted = if ch.draft == 0 { 0 } else { (rng >> 33) as usize % (ch.draft + 1) };
                let mut finished = false;
                for _ in 0..=accepted {
                    let pos = s.tokens(id).unwrap().len();
                    finished = s.append_token(id, truth(id, pos));
                    if finished { break; }
                }
                if ch.draft > 0 {
                    let emitted = s.tokens(id).unwrap().len() - toks.len();
                    s.accept_drafts(id, emitted - 1);
                }
                if finished {
                    let toks = s.tokens(id).unwrap().to_vec();
                    prop_assert_eq!(toks.len(), want[&id]);
                    prop_assert!(toks.iter().enumerate().all(|(p, &t)| t == truth(id, p)));
                    s.finish(id);
                }
            }
            s.assert_consistent();
        }
        let st = s.stats();
        prop_assert_eq!(st.pages_in_use, if cache { st.pages_in_use } else { 0 });
        // Some sequence drafted unless none could: every one that may draft wants at most two tokens.
        let could_draft = reqs.iter().enumerate().any(|(i, r)| i % 3 != 2 && r.1 > 2);
        prop_assert!(drafted > 0 || !could_draft || budget < 8);
    }
}
