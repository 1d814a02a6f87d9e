//! CudaBackend against the CPU reference backend (the f32 oracle that matches HF transformers
//! within 1e-3, crates/cpu/tests/hf_fixtures.rs) and against itself (ragged batches, snapshots).
//! Every test prints its numbers and skips cleanly (passes, printing SKIP) without a usable GPU.
//!
//! Tolerance: the CUDA path keeps weights, activations, the residual stream and the KV cache in
//! bf16 (f32 math inside kernels, f32 GEMM accumulation, f32 DeltaNet state), like HF run in bf16;
//! the CPU reference is f32 throughout. Measured on the H200 (2026-11-29) on the 8-layer tiny
//! model: per-row ‖Δ‖₂/‖ref‖₂ 1.2e-2 … 7e-2, median ≈ 2.5e-2, with two single-token rows of one
//! prompt at 1.7e-1 (argmax unchanged) — above the 2e-2 first aimed for; see
//! bench/results/cuda-backend-2026-11-29.md. The asserted bounds are therefore: no argmax flip
//! where the reference's top-2 margin exceeds 2·TOL·max|ref| (a wrong op flips those), argmax
//! agreement ≥ 90% of rows, the median row's L2 error ≤ TOL_MEDIAN, every row's ≤ TOL_ROW.
//! A bug in any op (wrong head stride, position, slot or page) gives errors of order 1.

use std::path::{Path, PathBuf};

use deltaserve_backend::{
    Backend, CacheOp, Feed, Penalty, Pick, Picked, RowSampling, SnapshotLoc, StepBatch, step_logits,
};
use deltaserve_cuda::backend::kernel_dims;
use deltaserve_cuda::{CudaBackend, WeightSource};
use deltaserve_model::synth::Preset;
use deltaserve_model::{Checkpoint, ModelConfig};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

#[path = "../common/mod.rs"]
mod common;
mod fp8;
mod graphs;
mod images;
mod int4;
mod masked;
mod saves;
mod short_chunks;

use common::*;
use int4::compare_int4;

/// (1) HF fixtures: runs those whose head dims the kernels support (multiples of 32: `qwen35_gva3_d32`
/// and the block-FP8 `qwen35_fp8`); the others use head dims 16/24 and are reported as skipped — CUDA ≈
/// HF is then established through the CPU reference (CPU ≈ HF within 1e-3 in
/// crates/cpu/tests/hf_fixtures.rs, CUDA ≈ CPU below).
#[test]
fn hf_fixtures_logits() {
    if !gpu() {
        return;
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/hf");
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(&root)
        .unwrap()
        .map(|e| e.unwrap().path())
        // Text fixtures list their prompts, as crates/cpu/tests/hf_fixtures.rs picks them (the image
        // fixture has its own tests).
        .filter(|p| {
            let json = std::fs::read_to_string(p.join("reference.json")).unwrap_or_default();
            serde_json::from_str::<serde_json::Value>(&json).is_ok_and(|v| v.get("prompts").is_some())
        })
        .collect();
    dirs.sort();
    for dir in dirs {
        let cfg = ModelConfig::from_dir(&dir).unwrap();
        if let Err(e) = kernel_dims(&cfg).validate() {
            println!("SKIP {}: kernels not specialisable for these dims: {e}", dir.display());
            continue;
        }
        let json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap()).unwrap();
        let refs = Checkpoint::open_file(&dir.join("reference.safetensors")).unwrap();
        // A block-FP8 fixture (transformers' FineGrainedFP8 checkpoint) runs with its codes kept as stored,
        // where the backend keeps FP8 weights. HF's reference dequantises the weights and leaves the
        // activations alone, so the prefill's FP8 projections take dequantised rows here. The FP8 tensor
        // cores' quantised activations are checked by the ops table and tests/backend/fp8.rs.
        let fp8 = matches!(cfg.quantization, Some(deltaserve_model::quant::Quantization::Fp8Block(_)));
        if fp8 && !fp8::fp8_gpu() {
            println!("SKIP {}: FP8 weights are kept on sm_89 and later", dir.display());
            continue;
        }
        let plan = if fp8 {
            plan_with_checkpoint(&cfg, &dir, |o| o.weights_dtype = deltaserve_plan::WeightsDtype::Fp8Block)
        } else {
            plan_for(&cfg)
        };
        let mut be = cuda(&dir, &cfg, &plan);
        if fp8 {
            be.set_options(deltaserve_cuda::backend::CudaOptions { fp8_tensor_cores: false, ..be.options() }).unwrap();
        }
        let vocab = be.capabilities().vocab_size;
        let mut score = Score::default();
        for (slot, p) in json["prompts"].as_array().unwrap().iter().enumerate() {
            let ids: Vec<u32> = p["ids"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect();
            let expected = refs.get(&format!("logits_{}", ids.len())).unwrap().to_f32().unwrap();
            // One step per position prefix is too slow; split into pieces and compare piece ends.
            let pg = pages(100 * slot as u32, ids.len());
            let mut at = 0;
            for s in [1usize, 63, 65, 1, 200, 7, 300].iter().cycle() {
                if at == ids.len() {
                    break;
                }
                let end = (at + s).min(ids.len());
                let got = run(&mut be, &one(chunk(slot as u32, &pg, at, &ids[at..end])));
                score.add(&got, &expected[(end - 1) * vocab..end * vocab], vocab);
                at = end;
            }
        }
        score.check_with(&format!("HF {}", dir.display()), HF_FIXTURE);
    }
}

/// (2) + (4): CUDA vs CPU on whole prompts, uneven pieces and a greedy decode.
#[test]
fn matches_cpu_backend() {
    if !gpu() {
        return;
    }
    let (dir, cfg) = tiny_dir(8);
    let plan = plan_for(&cfg);
    let mut g = cuda(&dir, &cfg, &plan);
    let mut c = cpu(&dir, &cfg);
    let stats = g.arena_stats();
    println!("arena: {stats:?}; regions {:?}", g.regions());
    let vocab = g.capabilities().vocab_size;
    let mut rng = StdRng::seed_from_u64(5);
    let mut full = Score::default();
    let mut pieces = Score::default();
    for (i, len) in [1usize, 37, 300, 1100, 2048].into_iter().enumerate() {
        let ids = random_tokens(&mut rng, len, vocab);
        let pg = pages(200 * i as u32, len);
        let b = one(chunk(0, &pg, 0, &ids));
        full.add(&run(&mut g, &b), &run(&mut c, &b), vocab);
        let mut at = 0;
        for s in [1usize, 63, 65, 1, 1, 200, 64, 7, 128, 300].iter().cycle() {
            if at == len || len > 1100 {
                break;
            }
            let end = (at + s).min(len);
            let b = one(chunk(1, &pg, at, &ids[at..end]));
            pieces.add(&run(&mut g, &b), &run(&mut c, &b), vocab);
            at = end;
        }
    }
    let mut failures: Vec<String> = Vec::new();
    failures.extend(full.soft_check("CPU full prompts (1, 37, 300, 1100, 2048 tokens)"));
    failures.extend(pieces.soft_check("CPU uneven pieces"));

    // Greedy decode of 16 tokens after a 37-token prompt: free-running on each backend, and
    // teacher-forced (both fed the CUDA tokens) for per-step logits.
    let prompt = random_tokens(&mut rng, 37, vocab);
    let pg = pages(1000, 37 + 16);
    let b = one(chunk(2, &pg, 0, &prompt));
    let (mut lg, mut lc) = (run(&mut g, &b), run(&mut c, &b));
    let (mut free_g, mut free_c) = (argmax(&lg) as u32, argmax(&lc) as u32);
    let (mut ids_g, mut ids_c) = (Vec::new(), Vec::new());
    let mut cg = cpu(&dir, &cfg); // free-running CPU copy
    run(&mut cg, &b);
    let mut forced = Score::default();
    let mut decisive_at = Vec::new();
    for step in 0..16 {
        forced.add(&lg, &lc, vocab);
        decisive_at.push(decisive(&lc));
        ids_g.push(free_g);
        ids_c.push(free_c);
        let pos = 37 + step;
        let tok = argmax(&lg) as u32;
        lg = run(&mut g, &one(chunk(2, &pg, pos, &[tok])));
        lc = run(&mut c, &one(chunk(2, &pg, pos, &[tok])));
        free_g = argmax(&lg) as u32;
        free_c = argmax(&run(&mut cg, &one(chunk(2, &pg, pos, &[ids_c[step]])))) as u32;
    }
    let same = ids_g.iter().zip(&ids_c).filter(|(a, b)| a == b).count();
    println!("greedy 16: CUDA {ids_g:?}\n           CPU  {ids_c:?}\n           identical {same}/16");
    failures.extend(forced.soft_check("CPU decode (teacher-forced)"));
    // The free-running sequences may part only where the reference's top-2 margin is within bf16
    // noise (until they part, the CPU copy's logits are the teacher-forced ones): a near tie can
    // go either way under a different summation order (it did at step 7 with the decode GEMV,
    // while no teacher-forced argmax flipped where the margin was decisive).
    if let Some(k) = ids_g.iter().zip(&ids_c).position(|(a, b)| a != b) {
        println!("greedy: sequences part at step {k} (reference margin decisive there: {})", decisive_at[k]);
        assert!(!decisive_at[k], "greedy decode parted at step {k}, where the reference's margin is decisive");
    }
    assert_eq!(g.arena_stats(), stats, "arena counters moved while serving");
    assert!(failures.is_empty(), "{failures:?}");
}

/// A step that wants tokens (the argmax of each wanted row taken on the GPU) picks the argmax of the
/// logits that a logits step returns for the same steps on a twin backend: a mixed prefill step, then
/// greedy decodes fed back (batch 3, decode graphs), with the full vocabulary and with `valid` below it.
#[test]
fn argmax_step_picks_the_logits_argmax() {
    if !gpu() {
        return;
    }
    let (dir, cfg) = tiny_dir(8);
    let plan = plan_for(&cfg);
    let vocab = cfg.vocab_size;
    for valid in [vocab, vocab - 9] {
        let (mut logits_be, mut argmax_be) = (cuda(&dir, &cfg, &plan), cuda(&dir, &cfg, &plan));
        let mut rng = StdRng::seed_from_u64(4);
        let prompts: Vec<Vec<u32>> = [40usize, 1, 77].iter().map(|&n| random_tokens(&mut rng, n, vocab)).collect();
        let pg: Vec<Vec<u32>> = (0..3).map(|i| pages(40 * i as u32, 200)).collect();
        let mut batch = StepBatch::default();
        for (i, p) in prompts.iter().enumerate() {
            batch.seqs.push(chunk(i as u32, &pg[i], 0, p));
        }
        let mut pos: Vec<usize> = prompts.iter().map(Vec::len).collect();
        for step in 0..6 {
            let rows = run(&mut logits_be, &batch);
            let want: Vec<u32> = rows.chunks_exact(vocab).map(|r| deltaserve_backend::argmax(&r[..valid])).collect();
            let got = picks(&mut argmax_be, &batch, valid, Pick::Argmax);
            assert_eq!(got, want, "step {step}, valid {valid}");
            batch = StepBatch::default();
            for (i, &t) in got.iter().enumerate() {
                batch.seqs.push(chunk(i as u32, &pg[i], pos[i], &[t]));
                pos[i] += 1;
            }
        }
        println!("argmax on the GPU (valid {valid}): 6 steps × 3 rows equal to the host argmax of the logits");
    }
}

/// Sampling rows picked on the GPU (penalties, plain draws, top-k / top-p / min-p cuts) equal the host
/// rule over the same step's logits, step after step (the tokens feed the next step).
#[test]
fn sample_step_matches_the_host_rule() {
    if !gpu() {
        return;
    }
    let (dir, cfg) = tiny_dir(8);
    let plan = plan_for(&cfg);
    let vocab = cfg.vocab_size;
    let valid = vocab - 5;
    let (mut logits_be, mut sample_be) = (cuda(&dir, &cfg, &plan), cuda(&dir, &cfg, &plan));
    let mut rng = StdRng::seed_from_u64(5);
    let prompts: Vec<Vec<u32>> = [30usize, 1, 64, 9].iter().map(|&n| random_tokens(&mut rng, n, vocab)).collect();
    let pg: Vec<Vec<u32>> = (0..4).map(|i| pages(40 * i as u32, 200)).collect();
    let mut batch = StepBatch::default();
    for (i, p) in prompts.iter().enumerate() {
        batch.seqs.push(chunk(i as u32, &pg[i], 0, p));
    }
    let mut pos: Vec<usize> = prompts.iter().map(Vec::len).collect();
    let (mut equal, mut total) = (0, 0);
    for step in 0..8 {
        let rows: Vec<RowSampling> = (0..4)
            .map(|i| {
                let mut r = RowSampling {
                    temperature: [0.0, 1.0, 0.6, 0.8][i],
                    top_k: [0, 0, 20, 0][i],
                    top_p: [1.0, 1.0, 0.95, 0.9][i],
                    min_p: [0.0, 0.0, 0.0, 0.05][i],
                    uniform: rng.random::<f32>(),
                    repetition_penalty: if i == 0 { 1.5 } else { 1.0 },
                    ..RowSampling::greedy()
                };
                if i == 0 {
                    r.penalties = (0..40).map(|id| Penalty { id, repeated: true, subtract: 0.25 }).collect();
                }
                r
            })
            .collect();
        let logits = run(&mut logits_be, &batch);
        let got = picks(&mut sample_be, &batch, valid, Pick::Sample(&rows));
        for (i, (row, set)) in logits.chunks_exact(vocab).zip(&rows).enumerate() {
            let mut adjusted = row[..valid].to_vec();
            set.apply_penalties(&mut adjusted);
            let want = set.pick_adjusted(&adjusted);
            if set.is_greedy() {
                assert_eq!(got[i], want, "step {step}, greedy row with penalties");
            } else {
                let (cand, probs) = set.candidates(&adjusted);
                assert!(cand[..probs.len()].iter().any(|c| c.0 == got[i]), "step {step}, row {i}: outside the cut");
            }
            equal += usize::from(got[i] == want);
            total += 1;
        }
        batch = StepBatch::default();
        for (i, &t) in got.iter().enumerate() {
            batch.seqs.push(chunk(i as u32, &pg[i], pos[i], &[t]));
            pos[i] += 1;
        }
    }
    assert!(equal + 1 >= total, "{equal} of {total} tokens equal to the host rule");
    println!("sampling on the GPU: {equal} of {total} tokens equal to the host rule over 8 steps × 4 rows");
}

/// Launched steps (look-ahead decode) give the tokens of steps run one at a time: a prefill step, then
/// decode steps each launched before the previous one is collected and fed its picks on the device (one
/// row leaves midway, so later steps are fed from other rows' places);
/// greedy and sampled, with the embedding table on the device and in pinned host memory. A fed row
/// whose pick is one of its stop ids does not run: a synchronous step of its sequence afterwards picks
/// what the reference picked there (its KV and state were left alone).
#[test]
fn launched_steps_feed_their_picks() {
    if !gpu() {
        return;
    }
    let (dir, cfg) = tiny_dir(8);
    let vocab = cfg.vocab_size;
    let valid = vocab - 5;
    let (steps, drop_at, stop_at) = (9, 3, 6);
    for embed_on_host in [false, true] {
        let plan = plan_with(&cfg, |o| o.embed_on_host = embed_on_host);
        for sampled in [false, true] {
            let label = format!("embed_on_host {embed_on_host}, sampled {sampled}");
            let (mut a, mut b) = (cuda(&dir, &cfg, &plan), cuda(&dir, &cfg, &plan));
            assert!(b.capabilities().launches_ahead);
            let mut rng = StdRng::seed_from_u64(9);
            let prompts: Vec<Vec<u32>> =
                [30usize, 1, 64, 9].iter().map(|&n| random_tokens(&mut rng, n, vocab)).collect();
            let pg: Vec<Vec<u32>> = (0..4).map(|i| pages(40 * i as u32, 200)).collect();
            let rows_of = |step: usize| -> Vec<RowSampling> {
                (0..4)
                    .map(|i| RowSampling {
                        temperature: [0.0, 1.0, 0.6, 0.8][i],
                        top_k: [0, 0, 20, 0][i],
                        top_p: [1.0, 1.0, 0.95, 0.9][i],
                        min_p: [0.0, 0.0, 0.0, 0.05][i],
                        uniform: ((i * 7919 + step * 104_729) % 1000) as f32 / 1000.0,
                        ..RowSampling::greedy()
                    })
                    .collect()
            };
            let sync = |be: &mut dyn Backend, batch: &StepBatch, rows: &[RowSampling]| -> Vec<u32> {
                picks(be, batch, valid, if sampled { Pick::Sample(rows) } else { Pick::Argmax })
            };
            // Rows of step s: all four, then (from `drop_at` on) row 1 has ended by length.
            let alive = |s: usize| -> Vec<usize> { (0..4).filter(|&i| i != 1 || s < drop_at).collect() };
            let rows_at = |s: usize| -> Vec<RowSampling> {
                let all = rows_of(s);
                alive(s).iter().map(|&i| all[i].clone()).collect()
            };
            // The reference: one step at a time, each fed the previous step's tokens on the host.
            let mut batch = StepBatch::default();
            for (i, p) in prompts.iter().enumerate() {
                batch.seqs.push(chunk(i as u32, &pg[i], 0, p));
            }
            let mut pos: Vec<usize> = prompts.iter().map(Vec::len).collect();
            // want[s][j]: the pick of row alive(s)[j] at step s.
            let mut want: Vec<Vec<u32>> = Vec::new();
            for step in 0..=steps {
                if step > 0 {
                    batch = StepBatch::default();
                    let prev = alive(step - 1);
                    for i in alive(step) {
                        let t = want[step - 1][prev.iter().position(|&r| r == i).unwrap()];
                        batch.seqs.push(chunk(i as u32, &pg[i], pos[i], &[t]));
                        pos[i] += 1;
                    }
                }
                want.push(sync(&mut a, &batch, &rows_at(step)));
            }
            // Launched ahead, fed from the previous step's rows (row 1 left out from `drop_at` on); step
            // `stop_at` stops row 0 (its fed pick is a stop id) and is the last. Odd steps leave their
            // picks for later: made after the step before them is collected (as a constrained row's mask
            // waits for it), and the step after them is fed from those picks.
            let mut batch = StepBatch::default();
            for (i, p) in prompts.iter().enumerate() {
                batch.seqs.push(chunk(i as u32, &pg[i], 0, p));
            }
            let mut pos: Vec<usize> = prompts.iter().map(Vec::len).collect();
            let rows0 = rows_at(0);
            fn pick_of(sampled: bool, rows: &[RowSampling]) -> Pick<'_> {
                if sampled { Pick::Sample(rows) } else { Pick::Argmax }
            }
            b.launch(&batch, valid, pick_of(sampled, &rows0), None).unwrap();
            let mut got: Vec<Picked> = Vec::new();
            for step in 1..=stop_at {
                let (now, prev) = (alive(step), alive(step - 1));
                let mut batch = StepBatch::default();
                let mut feed = Feed::default();
                for &i in &now {
                    batch.seqs.push(chunk(i as u32, &pg[i], pos[i], &[0]));
                    pos[i] += 1;
                    feed.from.push(prev.iter().position(|&r| r == i).unwrap());
                    let stop = step == stop_at && i == 0;
                    feed.stops.push(if stop { vec![vocab as u32 + 7, want[step - 1][0]] } else { vec![] });
                }
                let rows = rows_at(step);
                let later = step % 2 == 1;
                b.launch(&batch, valid, if later { Pick::Later } else { pick_of(sampled, &rows) }, Some(&feed))
                    .unwrap();
                let mut p = Picked::default();
                b.collect(&mut p).unwrap();
                if later {
                    b.pick_launched(pick_of(sampled, &rows)).unwrap();
                }
                got.push(p);
            }
            let mut last = Picked::default();
            b.collect(&mut last).unwrap();
            assert!(b.collect(&mut Picked::default()).is_err(), "{label}: nothing left to collect");
            // A launched step of cache ops alone (an end-of-request snapshot) is collected with no picks.
            let save = StepBatch {
                pre: vec![CacheOp::SaveState { slot: 1, to: SnapshotLoc::Device(0) }],
                ..Default::default()
            };
            b.launch(&save, valid, pick_of(sampled, &[]), None).unwrap();
            let mut none = Picked::default();
            b.collect(&mut none).unwrap();
            assert!(none.tokens.is_empty() && none.on_device.is_empty(), "{label}: picks of a step without rows");
            for (step, p) in got.iter().enumerate() {
                assert_eq!(p.tokens, want[step], "{label}: step {step}");
                assert!(p.on_device.iter().all(|&d| d), "{label}: step {step} picked on the device");
            }
            assert_eq!(&last.tokens[1..], &want[stop_at][1..], "{label}: the rows that ran at step {stop_at}");
            // Row 0 did not run at `stop_at`: fed its token now, it picks the reference's.
            let one =
                StepBatch { seqs: vec![chunk(0, &pg[0], pos[0] - 1, &[want[stop_at - 1][0]])], ..Default::default() };
            let again = sync(&mut b, &one, &rows_of(stop_at)[..1]);
            assert_eq!(again[0], want[stop_at][0], "{label}: the stopped row's state and KV were left alone");
            println!("{label}: {} launched steps equal the synchronous ones", stop_at + 1);
        }
    }
}

/// (3): a ragged batch (prefills from 0, continued prefill, decodes, a new 1-token sequence)
/// equals each sequence run alone.
#[test]
fn ragged_batch_equals_alone() {
    if !gpu() {
        return;
    }
    let (dir, cfg) = tiny_dir(8);
    let plan = plan_for(&cfg);
    let mut alone = cuda(&dir, &cfg, &plan);
    let mut batched = cuda(&dir, &cfg, &plan);
    let stats = batched.arena_stats();
    let vocab = alone.capabilities().vocab_size;
    let mut rng = StdRng::seed_from_u64(9);
    // (history, new tokens) per sequence.
    let shape = [(0usize, 300usize), (50, 1), (100, 37), (0, 1), (64, 1), (33, 70)];
    let seqs: Vec<(Vec<u32>, Vec<u32>)> =
        shape.iter().map(|&(h, n)| (random_tokens(&mut rng, h, vocab), random_tokens(&mut rng, n, vocab))).collect();
    let pg: Vec<Vec<u32>> = (0..seqs.len()).map(|i| pages(40 * i as u32, 400)).collect();
    for (i, (hist, _)) in seqs.iter().enumerate() {
        if !hist.is_empty() {
            let b = one(chunk(i as u32, &pg[i], 0, hist));
            run(&mut alone, &b);
            run(&mut batched, &b);
        }
    }
    let mut want = Vec::new();
    for (i, (hist, new)) in seqs.iter().enumerate() {
        want.extend(run(&mut alone, &one(chunk(i as u32, &pg[i], hist.len(), new))));
    }
    let mut batch = StepBatch::default();
    for (i, (hist, new)) in seqs.iter().enumerate() {
        let mut c = chunk(i as u32, &pg[i], hist.len(), new);
        c.want_logits = i != 2; // one chunk without logits
        batch.seqs.push(c);
    }
    let got = run(&mut batched, &batch);
    let want: Vec<f32> =
        want.chunks_exact(vocab).enumerate().filter(|(i, _)| *i != 2).flat_map(|(_, r)| r.to_vec()).collect();
    let mut s = Score::default();
    s.add(&got, &want, vocab);
    println!("ragged: worst row rel diff vs alone {:.3e}", s.worst);
    s.check("ragged batch vs alone");
    assert!(s.worst < 5e-3, "ragged batch differs from alone runs by {:.3e}", s.worst);
    // One more all-decode step on both.
    let mut batch = StepBatch::default();
    let mut want = Vec::new();
    for (i, (hist, new)) in seqs.iter().enumerate() {
        let pos = hist.len() + new.len();
        let c = chunk(i as u32, &pg[i], pos, &[(i * 7) as u32]);
        want.extend(run(&mut alone, &one(c.clone())));
        batch.seqs.push(c);
    }
    let mut s = Score::default();
    s.add(&run(&mut batched, &batch), &want, vocab);
    s.check("all-decode batch vs alone");
    assert!(s.worst < 5e-3);
    assert_eq!(batched.arena_stats(), stats);
}

/// Every row's logits (prompt log-probabilities): a chunk that wants them, in a step beside a prompt and a
/// decode, returns one row per position, each matching the CPU backend's; a step asking for more rows
/// than the backend returns is refused with an error, and the next step runs.
#[test]
fn every_row_logits_match_the_cpu() {
    if !gpu() {
        return;
    }
    let (dir, cfg) = tiny_dir(8);
    let plan = plan_for(&cfg);
    let mut g = cuda(&dir, &cfg, &plan);
    let mut c = cpu(&dir, &cfg);
    let caps = g.capabilities();
    assert!(caps.prompt_logits && caps.max_logits_rows == 8, "{caps:?}");
    let vocab = caps.vocab_size;
    let mut rng = StdRng::seed_from_u64(17);
    let hist = random_tokens(&mut rng, 40, vocab);
    let (pa, pb, pc) = (pages(0, 200), pages(40, 200), pages(80, 200));
    for be in [&mut g as &mut dyn Backend, &mut c] {
        run(be, &one(chunk(1, &pb, 0, &hist)));
    }
    let scored = random_tokens(&mut rng, 6, vocab);
    let prompt = random_tokens(&mut rng, 37, vocab);
    let mut batch = StepBatch::default();
    let mut all = chunk(0, &pa, 0, &scored);
    all.all_logits = true;
    all.want_logits = false;
    batch.seqs.extend([all, chunk(1, &pb, 40, &[7]), chunk(2, &pc, 0, &prompt)]);
    let (got, want) = (run(&mut g, &batch), run(&mut c, &batch));
    assert_eq!(got.len(), 8 * vocab, "6 rows of the scored chunk, one of each other");
    let mut s = Score::default();
    s.add(&got, &want, vocab);
    // Eight rows, six of them a prompt's first positions: the median is one row's bf16 error (4.3e-2
    // measured on the H200), so each row is held to the row bound, and to being its own position's: a
    // row from another position or sequence is ~1.4 away in L2 on this random model.
    s.check_with("every row's logits beside a prompt and a decode", Bounds { median: TOL_ROW, ..BF16 });
    for (i, row) in got.chunks_exact(vocab).enumerate() {
        let nearest = (0..8).min_by(|&a, &b| {
            let d = |j: usize| rel_l2(row, &want[j * vocab..(j + 1) * vocab]);
            d(a).total_cmp(&d(b))
        });
        assert_eq!(nearest, Some(i), "row {i} is nearest another row of the CPU's");
    }
    // Nine rows: one more than the logits region holds.
    let mut over = chunk(3, &pages(120, 200), 0, &random_tokens(&mut rng, 9, vocab));
    over.all_logits = true;
    let mut out = Vec::new();
    let err = step_logits(&mut g, &one(over), &mut out).expect_err("nine rows of eight");
    assert!(err.to_string().contains("logits rows"), "{err}");
    let b = one(chunk(1, &pb, 41, &[9]));
    let mut s = Score::default();
    s.add(&run(&mut g, &b), &run(&mut c, &b), vocab);
    s.check("the step after a refused one");
}

/// (5): SaveState / RestoreState / MoveSnapshot (device ↔ host) / CopyPagePrefix / CopyState
/// round trips: a continuation from a restored (or copied, as a fork does) state + copied partial
/// page equals the original continuation.
#[test]
fn snapshot_ops_round_trip() {
    if !gpu() {
        return;
    }
    let (dir, cfg) = tiny_dir(8);
    let plan = plan_for(&cfg);
    let mut g = cuda(&dir, &cfg, &plan);
    let stats = g.arena_stats();
    let vocab = g.capabilities().vocab_size;
    let mut rng = StdRng::seed_from_u64(3);
    let prefix = random_tokens(&mut rng, 40, vocab); // pages a, b full; c holds 8 tokens
    let cont = random_tokens(&mut rng, 20, vocab);
    let base = vec![10u32, 11, 12, 13];
    // Prefix on slot 0, saved to device snapshot 1, then moved to host 0 and back to device 2.
    let mut b = one(chunk(0, &base, 0, &prefix));
    b.post = vec![
        CacheOp::SaveState { slot: 0, to: SnapshotLoc::Device(1) },
        CacheOp::MoveSnapshot { from: SnapshotLoc::Device(1), to: SnapshotLoc::Host(0) },
        CacheOp::MoveSnapshot { from: SnapshotLoc::Host(0), to: SnapshotLoc::Host(2) },
        CacheOp::MoveSnapshot { from: SnapshotLoc::Host(2), to: SnapshotLoc::Device(2) },
        CacheOp::SaveState { slot: 0, to: SnapshotLoc::Host(1) },
        // A fork (several choices of one prompt): slot 0's state copied into slot 2.
        CacheOp::CopyState { src: 0, dst: 2 },
    ];
    run(&mut g, &b);
    let want = run(&mut g, &one(chunk(0, &base, 40, &cont)));
    // Scribble on the other slots first so a missing restore would show.
    run(&mut g, &one(chunk(3, &[30, 31], 0, &cont)));
    run(&mut g, &one(chunk(4, &[32, 33], 0, &cont)));
    run(&mut g, &one(chunk(5, &[34, 35], 0, &cont)));
    let cases = [
        (3u32, Some(SnapshotLoc::Device(1)), 20u32),
        (4, Some(SnapshotLoc::Device(2)), 21),
        (5, Some(SnapshotLoc::Host(1)), 22),
        (2, None, 24),
    ];
    for (slot, from, page_c) in cases {
        let pg = vec![10, 11, page_c, 23 + slot];
        let restore = from.map(|from| CacheOp::RestoreState { from, slot });
        let b = StepBatch {
            pre: restore.into_iter().chain([CacheOp::CopyPagePrefix { src: 12, dst: page_c, tokens: 8 }]).collect(),
            seqs: vec![chunk(slot, &pg, 40, &cont)],
            post: vec![],
        };
        let got = run(&mut g, &b);
        let e = rel_err(&got, &want);
        println!("restore from {from:?} (None: the forked slot) into slot {slot}: rel diff {e:.3e}");
        assert!(e < 1e-5, "restored continuation differs by {e:.3e}");
    }
    // Out-of-range ops are errors, not faults.
    let mut out = Vec::new();
    let bad = StepBatch { pre: vec![CacheOp::SaveState { slot: 0, to: SnapshotLoc::Host(9) }], ..Default::default() };
    assert!(step_logits(&mut g, &bad, &mut out).is_err());
    let bad = StepBatch { pre: vec![CacheOp::CopyState { src: 0, dst: 9999 }], ..Default::default() };
    assert!(step_logits(&mut g, &bad, &mut out).is_err());
    assert_eq!(g.arena_stats(), stats);
}

/// Random weights generated on the device give finite logits at the tiny shape.
#[test]
fn random_weights_run() {
    if !gpu() {
        return;
    }
    let cfg = ModelConfig::from_json_str(&Preset::Tiny.config_json(Some(4)).to_string()).unwrap();
    let plan = plan_for(&cfg);
    let mut g = CudaBackend::new(&cfg, WeightSource::RandomWeights { seed: 1 }, &plan, 0).unwrap();
    let ids: Vec<u32> = (0..100).collect();
    let out = run(&mut g, &one(chunk(0, &pages(0, 100), 0, &ids)));
    assert!(out.iter().all(|x| x.is_finite()) && out.iter().any(|x| *x != 0.0));
    let stats = g.arena_stats();
    println!("random weights: {} logits finite; arena {stats:?}", out.len());
}

/// Diagnostic (prints, asserts only finiteness): CUDA-vs-CPU error by depth and prompt length, to
/// tell bf16 accumulation (grows with depth and length) from a bug (jumps at one layer kind or
/// length).
#[test]
fn error_by_depth_and_length() {
    if !gpu() {
        return;
    }
    for layers in [1usize, 3, 4, 8] {
        let (dir, cfg) = tiny_dir(layers);
        let plan = plan_for(&cfg);
        let mut g = cuda(&dir, &cfg, &plan);
        let mut c = cpu(&dir, &cfg);
        let vocab = g.capabilities().vocab_size;
        let mut rng = StdRng::seed_from_u64(21);
        let mut line = Vec::new();
        for len in [1usize, 2, 37, 64, 65, 300, 1100] {
            let ids = random_tokens(&mut rng, len, vocab);
            let b = one(chunk(0, &pages(0, len), 0, &ids));
            let (o, r) = (run(&mut g, &b), run(&mut c, &b));
            assert!(o.iter().all(|x| x.is_finite()));
            line.push(format!("T={len}: {:.1e}/{:.1e}", rel_err(&o, &r), rel_l2(&o, &r)));
        }
        println!("depth {layers} ({:?}): max-rel/L2-rel {}", cfg.layer_types, line.join(", "));
    }
}

/// (6a) Quantised KV cache: fp8 K/V and int8 K/V (codes + per-(token, head) f16 scales in
/// kv_pages) against the CPU reference storing the same formats (deltaserve_cpu::kvquant: the
/// values a device cache of the format holds), prefill 1 … 1100 tokens and a 12-step greedy decode
/// through the decode graphs, same bounds as the bf16 comparison. A KV format the kernels do not
/// store (fp16) is an error, not a fault.
#[test]
fn quantized_kv_matches_cpu() {
    use deltaserve_plan::KvDtype;
    if !gpu() {
        return;
    }
    let (dir, cfg) = tiny_dir(8);
    let mut failures = Vec::new();
    for (kf, vf) in [(KvDtype::Fp8, KvDtype::Fp8), (KvDtype::Int8, KvDtype::Int8)] {
        let plan = plan_with(&cfg, |o| {
            o.k_dtype = kf;
            o.v_dtype = vf;
        });
        let bf16 = plan_with(&cfg, |_| {});
        println!(
            "KV K {} / V {}: kv_pages {} B, {} pages (bf16: {} pages)",
            kf.name(),
            vf.name(),
            plan.region("kv_pages").unwrap().bytes,
            plan.num_kv_pages,
            bf16.num_kv_pages
        );
        assert!(plan.num_kv_pages > bf16.num_kv_pages, "a quantised cache holds more pages");
        let mut g = cuda(&dir, &cfg, &plan);
        let mut c = cpu(&dir, &cfg).with_kv_formats(kf, vf);
        failures.extend(compare_int4(&format!("KV {}/{}", kf.name(), vf.name()), &mut g, &mut c));
        assert!(g.graph_stats().captures > 0 || !test_opts().cuda_graphs, "decode graphs were not used");
    }
    let plan = plan_with(&cfg, |o| {
        o.k_dtype = KvDtype::F16;
        o.v_dtype = KvDtype::F16;
    });
    let r = CudaBackend::with_options(&cfg, WeightSource::Checkpoint(dir.clone()), &plan, 4, test_opts());
    assert!(r.is_err(), "an fp16 KV cache must be refused");
    assert!(failures.is_empty(), "{failures:#?}");
}

/// (6b) Prefix-cache path with an fp8 cache: CopyPagePrefix copies the codes and the scales of a
/// partly filled page (restored state + copied page continue exactly like the original), and the
/// continuation matches the CPU reference with fp8 K/V doing the same ops.
#[test]
fn fp8_kv_page_prefix_copy() {
    use deltaserve_plan::KvDtype;
    if !gpu() {
        return;
    }
    let (dir, cfg) = tiny_dir(8);
    let plan = plan_with(&cfg, |o| {
        o.k_dtype = KvDtype::Fp8;
        o.v_dtype = KvDtype::Fp8;
    });
    let mut g = cuda(&dir, &cfg, &plan);
    let mut c = cpu(&dir, &cfg).with_kv_formats(KvDtype::Fp8, KvDtype::Fp8);
    let stats = g.arena_stats();
    let vocab = g.capabilities().vocab_size;
    let mut rng = StdRng::seed_from_u64(8);
    let prefix = random_tokens(&mut rng, 40, vocab); // pages 10, 11 full; 12 holds 8 tokens
    let cont = random_tokens(&mut rng, 20, vocab);
    let base = vec![10u32, 11, 12, 13];
    let mut b = one(chunk(0, &base, 0, &prefix));
    b.post = vec![CacheOp::SaveState { slot: 0, to: SnapshotLoc::Device(1) }];
    let mut score = Score::default();
    score.add(&run(&mut g, &b), &run(&mut c, &b), vocab);
    let cont_b = one(chunk(0, &base, 40, &cont));
    let want = run(&mut g, &cont_b);
    score.add(&want, &run(&mut c, &cont_b), vocab);
    // Scribble on the target pages first so a missing copy (codes or scales) would show.
    run(&mut g, &one(chunk(3, &[20, 21], 0, &cont)));
    let pg = vec![10, 11, 20, 24, 25];
    let b = StepBatch {
        pre: vec![
            CacheOp::RestoreState { from: SnapshotLoc::Device(1), slot: 3 },
            CacheOp::CopyPagePrefix { src: 12, dst: 20, tokens: 8 },
        ],
        seqs: vec![chunk(3, &pg, 40, &cont)],
        post: vec![],
    };
    let got = run(&mut g, &b);
    let e = rel_err(&got, &want);
    println!("fp8 KV: restored slot 3 with page 12 → 20 copied: rel diff {e:.3e}");
    assert!(e < 1e-5, "continuation after the fp8 page copy differs by {e:.3e}");
    // The same on the CPU reference, and decode steps on the copied pages on both.
    run(&mut c, &one(chunk(3, &[20, 21], 0, &cont)));
    let cg = run(&mut c, &b);
    score.add(&got, &cg, vocab);
    let mut tok = argmax(&got[got.len() - vocab..]) as u32;
    for step in 0..6 {
        let d = one(chunk(3, &pg, 60 + step, &[tok]));
        let (lg, lc) = (run(&mut g, &d), run(&mut c, &d));
        score.add(&lg, &lc, vocab);
        tok = argmax(&lg) as u32;
    }
    score.check("fp8 KV prefix copy vs CPU");
    // Out-of-range copies are errors, not faults.
    let mut out = Vec::new();
    let bad = StepBatch { pre: vec![CacheOp::CopyPagePrefix { src: 12, dst: 20, tokens: 17 }], ..Default::default() };
    assert!(step_logits(&mut g, &bad, &mut out).is_err());
    assert_eq!(g.arena_stats(), stats);
}

/// Every checkpoint format of a model whose shapes the kernels take passes the check before the GPU (a
/// mixture-of-experts model's bf16, GPTQ int4 and block-FP8 checkpoints alike); shapes they do not take
/// (the stored HF fixtures' head dims of 16) are refused with one line that names the CPU backend.
#[test]
fn models_are_checked_against_the_kernels_before_the_gpu() {
    use deltaserve_model::synth::Preset;
    let tiny = ModelConfig::from_json_str(&Preset::TinyMoe.config_json(Some(4)).to_string()).unwrap();
    assert!(CudaBackend::check_model(&tiny).is_ok());
    let json: serde_json::Value = serde_json::from_str(&Preset::TinyMoe.config_json(Some(4)).to_string()).unwrap();
    let with = |q: serde_json::Value| {
        let mut j = json.clone();
        j["quantization_config"] = q;
        ModelConfig::from_json_str(&j.to_string()).unwrap()
    };
    let gptq = with(serde_json::json!({
        "quant_method": "gptq", "bits": 4, "group_size": 128, "sym": true, "desc_act": false
    }));
    let fp8 = with(serde_json::json!({
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]
    }));
    assert!(matches!(fp8.quantization, Some(deltaserve_model::quant::Quantization::Fp8Block(_))));
    for cfg in [&gptq, &fp8] {
        assert!(CudaBackend::check_model(cfg).is_ok());
    }
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/hf");
    for name in ["qwen35_moe", "qwen35_gva3"] {
        let cfg = ModelConfig::from_dir(&fixtures.join(name)).unwrap();
        let e = CudaBackend::check_model(&cfg).unwrap_err().to_string();
        assert!(e.contains("head dim") && e.contains("--device cpu") && !e.contains('\n'), "{name}: {e}");
    }
}
