//! Snapshots inside a step's chunks (`SeqChunk::save_within`): the chunked DeltaNet walks each cut
//! sequence segment by segment, the states at the cuts go to device snapshots, and the conv state of
//! each cut comes from the step's rows. A chunk cut at its snapshot points must leave the snapshots,
//! the logits and the state that the same pieces run as steps of their own (with `SaveState` after
//! each) leave, and continuations restored from either must agree, with the CPU backend too.

use deltaserve_backend::{Backend, CacheOp, SnapshotLoc, StepBatch, step_logits};
use deltaserve_cuda::backend::CudaOptions;
use deltaserve_cuda::{CudaBackend, WeightSource};
use deltaserve_plan::StateDtype;
use rand::SeedableRng;
use rand::rngs::StdRng;

use super::common::*;
use super::int4::compare_int4;

/// The bf16 bounds for a handful of rows: a near tie may pick another argmax (a decisive one may not).
const FEW_ROWS: Bounds = Bounds { argmax_share: 0.0, ..BF16 };
/// A continuation's one logits row against the CPU backend: its median is that row, so the row bound
/// holds it (on the H200 the row after 212 tokens of this random model was 9.2e-2 from the CPU's, and
/// bitwise the row of the continuation from the snapshot taken between steps).
const ONE_ROW: Bounds = Bounds { median: TOL_ROW, ..FEW_ROWS };

/// A chunk of `tokens` from `start` in `slot` with snapshots at `cuts` (absolute positions) into
/// device snapshots `snaps`.
fn cut_chunk(
    slot: u32,
    pages: &[u32],
    start: usize,
    tokens: &[u32],
    cuts: &[(usize, u32)],
) -> deltaserve_backend::SeqChunk {
    let mut c = chunk(slot, pages, start, tokens);
    c.save_within = cuts.iter().map(|&(p, d)| (p, SnapshotLoc::Device(d))).collect();
    c
}

#[test]
fn snapshots_inside_a_chunk_equal_snapshots_between_steps() {
    if gpu() {
        inside_vs_between(StateDtype::F32);
    }
}

/// The DeltaNet state stored bf16 (`--state-dtype bf16`): a step with snapshots inside, its pieces as
/// steps and the continuations from either against the CPU backend storing bf16 states (every segment
/// of a cut chunk stores its state, as a step of its own does); then prefill and decode against it.
#[test]
fn bf16_state_snapshots_prefill_and_decode_match_cpu() {
    if !gpu() {
        return;
    }
    inside_vs_between(StateDtype::Bf16);
    let (dir, cfg) = tiny_dir(8);
    let plan = plan_with(&cfg, |o| o.state_dtype = StateDtype::Bf16);
    let mut g = cuda(&dir, &cfg, &plan);
    let mut c = cpu(&dir, &cfg).with_state_dtype(StateDtype::Bf16);
    let failures = compare_int4("DeltaNet state bf16", &mut g, &mut c);
    assert!(failures.is_empty(), "{failures:#?}");
}

fn inside_vs_between(state: StateDtype) {
    let (dir, cfg) = tiny_dir(8);
    let plan = plan_with(&cfg, |o| {
        o.snapshot_slots = 8;
        o.state_dtype = state;
    });
    let opts = CudaOptions { snapshots_in_step: true, ..test_opts() };
    let mut g = CudaBackend::with_options(&cfg, WeightSource::Checkpoint(dir.clone()), &plan, 4, opts).unwrap();
    assert_eq!(g.capabilities().snapshots_within_chunks, 8, "as many a step as the device snapshots");
    let mut c = cpu(&dir, &cfg).with_state_dtype(state);
    println!("DeltaNet state {state}");
    let stats = g.arena_stats();
    let vocab = g.capabilities().vocab_size;
    let mut rng = StdRng::seed_from_u64(17);
    // Three prompts in one step: one cut off and on the 64-row grid, one not cut, one cut after 5
    // rows (the conv state then holds rows of the carried state: none, it starts at 0, so zeros).
    let (a, b, s) =
        (random_tokens(&mut rng, 300, vocab), random_tokens(&mut rng, 70, vocab), random_tokens(&mut rng, 40, vocab));
    let cont = random_tokens(&mut rng, 20, vocab);
    let pg: Vec<Vec<u32>> = (0..8).map(|i| pages(40 * i, 400)).collect();
    let whole = StepBatch {
        seqs: vec![
            cut_chunk(0, &pg[0], 0, &a, &[(100, 0), (192, 1)]),
            chunk(1, &pg[1], 0, &b),
            cut_chunk(2, &pg[2], 0, &s, &[(5, 2)]),
        ],
        ..Default::default()
    };
    let got = run(&mut g, &whole);
    // (the CPU backend takes snapshots inside chunks too: the same batch, slots and snapshots)
    let want_cpu = run(&mut c, &whole);
    // The same pieces as steps of their own, into slots 3 and 4 and snapshots 3, 4 and 5.
    let mut pieces = Vec::new();
    for (slot, toks, cuts) in [(3u32, &a, vec![(100usize, 3u32), (192, 4)]), (4, &s, vec![(5, 5)])] {
        let mut from = 0;
        for (p, d) in cuts.into_iter().map(|(p, d)| (p, Some(d))).chain([(toks.len(), None)]) {
            let mut step = one(chunk(slot, &pg[slot as usize], from, &toks[from..p]));
            step.post = d.map(|d| CacheOp::SaveState { slot, to: SnapshotLoc::Device(d) }).into_iter().collect();
            let l = run(&mut g, &step);
            if d.is_none() {
                pieces.push(l);
            }
            from = p;
        }
    }
    let row = |i: usize| &got[i * vocab..(i + 1) * vocab];
    let (e_a, e_s) = (rel_err(row(0), &pieces[0]), rel_err(row(2), &pieces[1]));
    println!("last rows, one step with snapshots inside vs the pieces as steps: {e_a:.3e}, {e_s:.3e}");
    assert!(e_a < 2e-2 && e_s < 2e-2, "a cut chunk's last logits differ from its pieces' ({e_a:.3e}, {e_s:.3e})");
    let mut score = Score::default();
    score.add(&got, &want_cpu, vocab);
    score.check_with("one step with snapshots inside vs the CPU backend", FEW_ROWS);
    // Continuations from each snapshot taken inside (slot 5) and between steps (slot 6), and on the
    // CPU backend from its own snapshot: the 20 tokens after the point, over the pages the prompt
    // wrote. A continuation writes over the rows after its point, so the later point goes first.
    let checks = [(192usize, 1u32, 4u32, 0usize, 3usize), (100, 0, 3, 0, 3), (5, 2, 5, 2, 4)];
    for (p, inside, between, pg_inside, pg_between) in checks {
        let restored = |slot: u32, from: u32, pgs: &[u32]| {
            let mut step = one(chunk(slot, pgs, p, &cont));
            step.pre = vec![CacheOp::RestoreState { from: SnapshotLoc::Device(from), slot }];
            step
        };
        let from_inside = run(&mut g, &restored(5, inside, &pg[pg_inside]));
        let from_between = run(&mut g, &restored(6, between, &pg[pg_between]));
        let cpu_cont = run(&mut c, &restored(5, inside, &pg[pg_inside]));
        let e = rel_err(&from_inside, &from_between);
        println!("continuation after {p}: restored from inside a step vs between steps {e:.3e}");
        assert!(e < 2e-2, "continuation after {p} differs by {e:.3e}");
        let mut score = Score::default();
        score.add(&from_inside, &cpu_cont, vocab);
        score.check_with(&format!("continuation after {p} from a snapshot inside a step vs the CPU backend"), ONE_ROW);
    }
    assert_eq!(g.arena_stats(), stats);
}

#[test]
fn bad_snapshots_inside_chunks_are_refused() {
    if !gpu() {
        return;
    }
    let (dir, cfg) = tiny_dir(2);
    let plan = plan_for(&cfg);
    let off = CudaOptions { snapshots_in_step: false, ..test_opts() };
    let g = CudaBackend::with_options(&cfg, WeightSource::Checkpoint(dir.clone()), &plan, 4, off).unwrap();
    assert_eq!(g.capabilities().snapshots_within_chunks, 0, "none when the options turn them off");
    drop(g);
    let mut g = cuda(&dir, &cfg, &plan);
    assert!(g.capabilities().snapshots_within_chunks > 0, "on by default");
    let toks: Vec<u32> = (0..50).collect();
    let pg = pages(0, 64);
    let mut out = Vec::new();
    let cases: [(&str, Vec<(usize, SnapshotLoc)>); 5] = [
        ("to host memory", vec![(10, SnapshotLoc::Host(0))]),
        ("one snapshot twice", vec![(10, SnapshotLoc::Device(1)), (20, SnapshotLoc::Device(1))]),
        ("out of range", vec![(10, SnapshotLoc::Device(99))]),
        ("at the chunk's end", vec![(50, SnapshotLoc::Device(0))]),
        ("decreasing", vec![(20, SnapshotLoc::Device(0)), (10, SnapshotLoc::Device(1))]),
    ];
    for (what, saves) in cases {
        let mut c = chunk(0, &pg, 0, &toks);
        c.save_within = saves;
        let e = step_logits(&mut g, &one(c), &mut out);
        println!("{what}: {e:?}");
        assert!(e.is_err(), "{what}: accepted");
    }
    // Still serves.
    assert_eq!(run(&mut g, &one(chunk(0, &pg, 0, &toks))).len(), g.capabilities().vocab_size);
}

/// A long step's chunked DeltaNet cut into pieces, each piece's walk beside the next piece's prep: the same
/// logits bit for bit as one prep and one walk, for two prompts in one step (4,300 rows: pieces of 2,048, the
/// longer prompt cut once) and the token after each (the states they left).
#[test]
fn overlapped_pieces_equal_one_walk() {
    if !gpu() {
        return;
    }
    let (dir, cfg) = tiny_dir(4);
    let plan = plan_with(&cfg, |o| o.max_batch_tokens = 4608);
    let mut got = Vec::new();
    for overlap in [true, false] {
        let opts = CudaOptions { deltanet_overlap: overlap, ..test_opts() };
        let mut g = CudaBackend::with_options(&cfg, WeightSource::Checkpoint(dir.clone()), &plan, 4, opts).unwrap();
        let vocab = g.capabilities().vocab_size;
        let mut rng = StdRng::seed_from_u64(5);
        let (a, b) = (random_tokens(&mut rng, 3000, vocab), random_tokens(&mut rng, 1300, vocab));
        let (pa, pb) = (pages(0, 3100), pages(200, 1400));
        let mut l =
            run(&mut g, &StepBatch { seqs: vec![chunk(0, &pa, 0, &a), chunk(1, &pb, 0, &b)], ..Default::default() });
        let rounds = g.last_deltanet_rounds();
        println!("overlap {overlap}: {rounds} rounds of pieces");
        assert_eq!(rounds, if overlap { 2 } else { 0 });
        let next = StepBatch { seqs: vec![chunk(0, &pa, 3000, &[7]), chunk(1, &pb, 1300, &[9])], ..Default::default() };
        l.extend(run(&mut g, &next));
        got.push(l);
    }
    let differ = got[0].iter().zip(&got[1]).filter(|(x, y)| x.to_bits() != y.to_bits()).count();
    assert_eq!(differ, 0, "{differ} of {} logits differ between overlapped pieces and one walk", got[0].len());
}
