//! Token masks (structured outputs) picked on the GPU against the CPU reference backend: rows with a
//! bitmask of allowed ids, greedy and sampled, sparse (a few ids) and dense (half the ids).

use deltaserve_backend::sampling::{is_allowed, mask_words};
use deltaserve_backend::{Backend, Pick, RowSampling, StepBatch};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

use crate::common::*;

/// A bitmask over `valid` ids: `n` random ids, or each id with probability 1/2 when `n` is 0.
fn mask(rng: &mut StdRng, valid: usize, n: usize) -> Vec<u32> {
    let mut bits = vec![0u32; mask_words(valid)];
    let ids: Vec<u32> = if n == 0 {
        (0..valid as u32).filter(|_| rng.random::<bool>()).collect()
    } else {
        (0..n).map(|_| rng.random_range(0..valid as u32)).collect()
    };
    for id in ids {
        bits[id as usize / 32] |= 1 << (id % 32);
    }
    bits
}

/// Whether the best allowed logit of `row` leads the second by more than bf16 noise.
fn decisive_under(row: &[f32], bits: &[u32]) -> bool {
    let allowed: Vec<f32> =
        row.iter().enumerate().filter(|(i, _)| is_allowed(bits, *i as u32)).map(|(_, &l)| l).collect();
    allowed.len() < 2 || decisive(&allowed)
}

/// Masked rows picked on the GPU never leave their mask; greedy ones equal the host rule over the same
/// logits exactly and the CPU backend's picks where the CPU's masked margin is decisive; sampled ones
/// land in the host rule's kept set and mostly equal the CPU's draw with the same uniform. Both backends
/// are fed the GPU's tokens (teacher-forced), 8 steps of 4 rows. Twin backends give each step's logits
/// (a step advances a sequence's state: one backend picks, its twin returns the rows).
#[test]
fn masked_sampling_matches_the_cpu_backend() {
    if !gpu() {
        return;
    }
    let (dir, cfg) = tiny_dir(8);
    let plan = plan_for(&cfg);
    let vocab = cfg.vocab_size;
    let valid = vocab - 5;
    let (mut logits_be, mut g) = (cuda(&dir, &cfg, &plan), cuda(&dir, &cfg, &plan));
    let (mut c, mut c_picks) = (cpu(&dir, &cfg), cpu(&dir, &cfg));
    // The CUDA backend applies a row's mask whenever it is given one; `masks_tokens` (what the engine
    // asks for) is on unless DELTASERVE_DEVICE_MASKS=0.
    assert!(c_picks.capabilities().masks_tokens);
    let mut rng = StdRng::seed_from_u64(17);
    let prompts: Vec<Vec<u32>> = [12usize, 1, 40, 7].iter().map(|&n| random_tokens(&mut rng, n, vocab)).collect();
    let pg: Vec<Vec<u32>> = (0..4).map(|i| pages(40 * i as u32, 200)).collect();
    let mut batch = StepBatch::default();
    for (i, p) in prompts.iter().enumerate() {
        batch.seqs.push(chunk(i as u32, &pg[i], 0, p));
    }
    let mut pos: Vec<usize> = prompts.iter().map(Vec::len).collect();
    let (mut greedy_same, mut greedy_decisive, mut sampled_same, mut sampled) = (0, 0, 0, 0);
    for step in 0..8 {
        let rows: Vec<RowSampling> = (0..4)
            .map(|i| RowSampling {
                temperature: [0.0, 0.0, 0.8, 1.0][i],
                top_k: [0, 0, 20, 0][i],
                top_p: [1.0, 1.0, 0.95, 1.0][i],
                uniform: rng.random::<f32>(),
                allowed: Some(mask(&mut rng, valid, [8, 0, 8, 0][i])),
                ..RowSampling::greedy()
            })
            .collect();
        let logits = run(&mut logits_be, &batch);
        let cpu_logits = run(&mut c, &batch);
        let got = picks(&mut g, &batch, valid, Pick::Sample(&rows));
        let cpu_picks = picks(&mut c_picks, &batch, valid, Pick::Sample(&rows));
        let host_rule: Vec<u32> =
            cpu_logits.chunks_exact(vocab).zip(&rows).map(|(row, set)| set.pick(&mut row[..valid].to_vec())).collect();
        assert_eq!(cpu_picks, host_rule, "step {step}: the CPU backend's picks are the host rule over its logits");
        let cpu_rows = cpu_logits.chunks_exact(vocab);
        for (i, ((row, set), cpu_row)) in logits.chunks_exact(vocab).zip(&rows).zip(cpu_rows).enumerate() {
            let bits = set.allowed.as_ref().unwrap();
            assert!(is_allowed(bits, got[i]), "step {step}, row {i}: GPU token {} outside its mask", got[i]);
            assert!(is_allowed(bits, cpu_picks[i]), "step {step}, row {i}: CPU token outside its mask");
            let mut adjusted = row[..valid].to_vec();
            set.apply_penalties(&mut adjusted);
            let want = set.pick_adjusted(&adjusted);
            if set.is_greedy() {
                assert_eq!(got[i], want, "step {step}, row {i}: the host rule over the GPU's logits");
                if decisive_under(&cpu_row[..valid], bits) {
                    greedy_decisive += 1;
                    assert_eq!(got[i], cpu_picks[i], "step {step}, row {i}: the CPU's pick, decisive there");
                }
                greedy_same += usize::from(got[i] == cpu_picks[i]);
            } else {
                let (cand, probs) = set.candidates(&adjusted);
                assert!(cand[..probs.len()].iter().any(|c| c.0 == got[i]), "step {step}, row {i}: outside the cut");
                sampled += 1;
                sampled_same += usize::from(got[i] == cpu_picks[i]);
            }
        }
        batch = StepBatch::default();
        for (i, &t) in got.iter().enumerate() {
            batch.seqs.push(chunk(i as u32, &pg[i], pos[i], &[t]));
            pos[i] += 1;
        }
    }
    println!(
        "masked picks on the GPU: greedy {greedy_same}/16 equal to the CPU's ({greedy_decisive} decisive), sampled \
         {sampled_same}/{sampled} equal to the CPU's draw"
    );
    assert!(2 * sampled_same >= sampled, "{sampled_same} of {sampled} sampled tokens equal to the CPU's");
}
