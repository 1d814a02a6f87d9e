//! CUDA graphs against eager launches, and the profiling switches that must not change results.

use deltaserve_backend::{Backend, CacheOp, Pick, SnapshotLoc, StepBatch};
use deltaserve_cuda::backend::CudaOptions;
use deltaserve_cuda::{CudaBackend, WeightSource};
use rand::SeedableRng;
use rand::rngs::StdRng;

use crate::common::*;

/// Decode steps replayed from CUDA graphs equal eager launches: two backends of the same tiny
/// model (one with graphs, one without) run the same prompts and then the same teacher-forced
/// decode schedule, where sequences join and leave between steps (batch sizes 1, 3, 5, 7, 8, 2,
/// 11, 16; one graph per size, captured on its first step and replayed after), one sequence
/// starts with a 1-token prompt inside a decode batch, one chunk wants no logits, and one mixed
/// step (prefill + decode) runs eagerly on both. Both paths run the same kernels at the same n,
/// so every row must be bitwise equal (also above 8 rows, where the projections use cuBLASLt).
/// Measured on the H200 (2026-11-29): 104/104 rows bitwise equal. The padded buckets
/// (`CudaOptions::graph_pad`, off by default) must be bitwise equal too: they gave O(1) differences on
/// some rows (56/104 equal) until the workspace plan followed the backend's op order (the conv output
/// had overwritten the gates' input rows), 104/104 since.
#[test]
fn decode_graphs_match_eager() {
    if !gpu() {
        return;
    }
    let d = CudaOptions::default();
    let padded = CudaOptions { graph_pad: true, ..d };
    let p = graphs_vs_eager("padded buckets", padded, CudaOptions { cuda_graphs: false, ..d });
    assert_eq!((p.worst_small, p.worst_big), (0.0, 0.0), "padded graph replays differ from eager launches");
    assert!(!p.arena_moved, "arena counters moved with padded buckets");
    let r = graphs_vs_eager("default", d, CudaOptions { cuda_graphs: false, ..d });
    r.check();
}

/// What [`graphs_vs_eager`] measured.
struct GraphsReport {
    worst_small: f32,
    worst_big: f32,
    argmax_same_big: usize,
    rows_big: usize,
    captures: usize,
    replays: usize,
    eager_captures: usize,
    arena_moved: bool,
}

impl GraphsReport {
    fn check(&self) {
        assert_eq!(self.worst_small, 0.0, "graph replay differs from eager launches at <= 8 rows");
        assert_eq!(self.worst_big, 0.0, "graph replay differs from eager launches at > 8 rows");
        assert!(
            self.argmax_same_big * 10 >= self.rows_big * 9,
            "argmax agreement {}/{}",
            self.argmax_same_big,
            self.rows_big
        );
        assert_eq!(self.captures, 8, "one capture per batch size used (1, 3, 5, 7, 8, 2, 11, 16)");
        assert!(self.replays >= 8, "graphs were replayed");
        assert_eq!(self.eager_captures, 0);
        assert!(!self.arena_moved, "arena counters moved while capturing or replaying");
    }
}

fn graphs_vs_eager(label: &str, graph_opts: CudaOptions, eager_opts: CudaOptions) -> GraphsReport {
    let (dir, cfg) = tiny_dir(8);
    let plan = test_plan(&cfg, 16, 1);
    let src = || WeightSource::Checkpoint(dir.clone());
    let mut eager = CudaBackend::with_options(&cfg, src(), &plan, 0, eager_opts).unwrap();
    let mut graphs = CudaBackend::with_options(&cfg, src(), &plan, 0, graph_opts).unwrap();
    let stats = graphs.arena_stats();
    let vocab = eager.capabilities().vocab_size;
    let mut rng = StdRng::seed_from_u64(17);
    let n_seqs = 16usize;
    // Prompt lengths; sequence 7 has none: its first token is a 1-token chunk at position 0.
    let prompt_len = |i: usize| if i == 7 { 0 } else { 5 + 23 * i };
    let pg: Vec<Vec<u32>> = (0..n_seqs).map(|i| pages(30 * i as u32, 450)).collect();
    let mut pos = vec![0usize; n_seqs];
    let mut next = vec![0u32; n_seqs];
    for i in 0..n_seqs {
        let len = prompt_len(i);
        if len == 0 {
            next[i] = 3;
            continue;
        }
        let ids = random_tokens(&mut rng, len, vocab);
        let b = one(chunk(i as u32, &pg[i], 0, &ids));
        let (le, lg) = (run(&mut eager, &b), run(&mut graphs, &b));
        assert_eq!(le, lg, "prefill differs (both eager)");
        next[i] = argmax(&le) as u32;
        pos[i] = len;
    }
    let schedule: Vec<Vec<usize>> = vec![
        vec![0],
        vec![0],
        vec![0, 1, 2],
        vec![0, 1, 2],
        vec![1, 2, 3, 4, 7],
        vec![1, 2, 3, 4, 7],
        vec![2, 3, 4, 5, 6, 7, 1],
        vec![0, 1, 2, 3, 4, 5, 6, 7],
        vec![0, 1, 2, 3, 4, 5, 6, 7],
        vec![5, 6],
        vec![6, 5],
        vec![0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10],
        vec![0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10],
        (0..16).collect(),
        (0..16).collect(),
        vec![3],
        vec![3],
        vec![4, 6, 2],
    ];
    let (mut exact_rows, mut rows, mut worst_small, mut worst_big) = (0usize, 0usize, 0f32, 0f32);
    let (mut argmax_same_big, mut rows_big) = (0usize, 0usize);
    for (step, active) in schedule.iter().enumerate() {
        let mut batch = StepBatch::default();
        for (j, &i) in active.iter().enumerate() {
            let mut c = chunk(i as u32, &pg[i], pos[i], &[next[i]]);
            c.want_logits = !(step == 6 && j == 3); // one chunk without logits
            batch.seqs.push(c);
        }
        if step == 9 {
            // A mixed step: a prefill chunk beside the decodes (eager on both backends).
            let extra = random_tokens(&mut rng, 9, vocab);
            batch.seqs.push(chunk(12, &pg[12], pos[12], &extra));
        }
        let (le, lg) = (run(&mut eager, &batch), run(&mut graphs, &batch));
        assert_eq!(le.len(), lg.len());
        let step_diffs: Vec<String> =
            le.chunks_exact(vocab).zip(lg.chunks_exact(vocab)).map(|(a, b)| format!("{:.0e}", rel_err(b, a))).collect();
        let want: Vec<usize> = batch.seqs.iter().enumerate().filter(|(_, c)| c.want_logits).map(|(j, _)| j).collect();
        for (r, (a, b)) in le.chunks_exact(vocab).zip(lg.chunks_exact(vocab)).enumerate() {
            let e = rel_err(b, a);
            rows += 1;
            exact_rows += usize::from(a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()));
            if active.len() <= 8 {
                worst_small = worst_small.max(e);
            } else {
                worst_big = worst_big.max(e);
                rows_big += 1;
                argmax_same_big += usize::from(argmax(a) == argmax(b));
            }
            // Teacher forcing: both backends get the eager backend's greedy token.
            let c = &batch.seqs[want[r]];
            if c.tokens.len() == 1 {
                next[c.slot as usize] = argmax(a) as u32;
            }
        }
        for c in &batch.seqs {
            pos[c.slot as usize] += c.tokens.len();
        }
        println!(
            "{label} step {step}: seqs {:?} (bucket {}), {:?}; row diffs {}",
            batch.seqs.iter().map(|c| c.slot).collect::<Vec<_>>(),
            graphs.graph_bucket(active.len()),
            graphs.graph_stats(),
            step_diffs.join(" ")
        );
    }
    let gs = graphs.graph_stats();
    println!(
        "{label}: graphs vs eager: {exact_rows}/{rows} rows bitwise equal; max rel diff ≤ 8 rows {worst_small:.3e}, \
         > 8 rows {worst_big:.3e} (argmax {argmax_same_big}/{rows_big}); graph stats {gs:?}; eager {:?}",
        eager.graph_stats()
    );
    GraphsReport {
        worst_small,
        worst_big,
        argmax_same_big,
        rows_big,
        captures: gs.captures,
        replays: gs.replays,
        eager_captures: eager.graph_stats().captures,
        arena_moved: graphs.arena_stats() != stats,
    }
}

/// One backend, no second one in the process: decode steps of two sequences (bucket 2) with
/// graphs, then the same steps again from restored states (SaveState/RestoreState) with graphs
/// off; the logits must be bitwise equal.
#[test]
fn graphs_match_eager_same_backend() {
    if !gpu() {
        return;
    }
    let (dir, cfg) = tiny_dir(8);
    let plan = plan_for(&cfg);
    let mut g = CudaBackend::with_options(
        &cfg,
        WeightSource::Checkpoint(dir.clone()),
        &plan,
        0,
        CudaOptions { cuda_graphs: true, ..CudaOptions::default() },
    )
    .unwrap();
    let vocab = g.capabilities().vocab_size;
    let mut rng = StdRng::seed_from_u64(23);
    let pg: Vec<Vec<u32>> = (0..3).map(|i| pages(60 * i as u32, 300)).collect();
    let lens = [40usize, 64, 7];
    let mut next = vec![0u32; 3];
    for i in 0..3 {
        let ids = random_tokens(&mut rng, lens[i], vocab);
        let mut b = one(chunk(i as u32, &pg[i], 0, &ids));
        b.post = vec![CacheOp::SaveState { slot: i as u32, to: SnapshotLoc::Device(i as u32) }];
        next[i] = argmax(&run(&mut g, &b)) as u32;
    }
    let steps = 6;
    let mut per_mode = Vec::new();
    for graphs in [true, false] {
        g.set_options(CudaOptions { cuda_graphs: graphs, ..CudaOptions::default() }).unwrap();
        let mut toks = next.clone();
        let mut pos = lens;
        let mut out = Vec::new();
        for st in 0..steps {
            let mut b = StepBatch::default();
            if st == 0 {
                b.pre = (0..3).map(|i| CacheOp::RestoreState { from: SnapshotLoc::Device(i), slot: i }).collect();
            }
            // Alternate which sequences decode: 3, 2, 1 rows.
            let active: Vec<usize> = match st % 3 {
                0 => vec![0, 1, 2],
                1 => vec![2, 0],
                _ => vec![1],
            };
            for &i in &active {
                b.seqs.push(chunk(i as u32, &pg[i], pos[i], &[toks[i]]));
                pos[i] += 1;
            }
            let l = run(&mut g, &b);
            for (r, &i) in active.iter().enumerate() {
                toks[i] = argmax(&l[r * vocab..(r + 1) * vocab]) as u32;
            }
            out.push(l);
        }
        println!("same backend, graphs {graphs}: {:?}", g.graph_stats());
        per_mode.push(out);
    }
    for (st, (a, b)) in per_mode[0].iter().zip(&per_mode[1]).enumerate() {
        let diffs: Vec<String> =
            a.chunks_exact(vocab).zip(b.chunks_exact(vocab)).map(|(x, y)| format!("{:.0e}", rel_err(x, y))).collect();
        println!("same backend step {st}: graphs vs eager row diffs {}", diffs.join(" "));
    }
    for (a, b) in per_mode[0].iter().zip(&per_mode[1]) {
        assert!(a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()), "graphs differ from eager on one backend");
    }
}

/// Profiling (a timing event after each op group) times every group and changes no result: the same
/// prompt and decode step in two slots, without and with profiling, give the same logits bit for bit.
#[test]
fn profiling_times_op_groups_without_changing_results() {
    if !gpu() {
        return;
    }
    let (dir, cfg) = tiny_dir(8);
    let plan = plan_for(&cfg);
    let opts = CudaOptions { cuda_graphs: false, ..CudaOptions::default() };
    let mut be = CudaBackend::with_options(&cfg, WeightSource::Checkpoint(dir), &plan, 0, opts).unwrap();
    let vocab = be.capabilities().vocab_size;
    let ids = random_tokens(&mut StdRng::seed_from_u64(31), 70, vocab);
    let mut runs = Vec::new();
    for (slot, profile) in [(0u32, false), (1, true)] {
        be.set_profiling(profile).unwrap();
        let pg = pages(60 * slot, 80);
        let prefill = run(&mut be, &one(chunk(slot, &pg, 0, &ids)));
        let next = argmax(&prefill) as u32;
        let decode = run(&mut be, &one(chunk(slot, &pg, ids.len(), &[next])));
        runs.push((prefill, decode, be.take_profile()));
    }
    be.set_profiling(false).unwrap();
    let (plain, timed) = (&runs[0], &runs[1]);
    assert!(plain.2.is_empty(), "no totals without profiling");
    let same = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
    assert!(same(&plain.0, &timed.0) && same(&plain.1, &timed.1), "profiling changed the logits");
    let groups: Vec<&str> = timed.2.iter().map(|g| g.0).collect();
    println!("profile of a 70-token prefill + one decode step: {:?}", timed.2);
    for g in ["embed", "norms", "gdn core (chunked / decode)", "attn core (prefill / decode)", "final norm + lm_head"] {
        assert!(groups.contains(&g), "group {g} missing from {groups:?}");
    }
    assert!(timed.2.iter().all(|g| g.1 >= 0.0) && timed.2.iter().map(|g| g.1).sum::<f64>() > 0.0);
}

/// Step phases (the bench's `--phases`): graphed decode steps with logits and greedy outputs are timed part
/// by part, the parts fit in the wall time, and timing changes no logits.
#[test]
fn step_phases_time_the_parts_of_a_step() {
    if !gpu() {
        return;
    }
    let (dir, cfg) = tiny_dir(8);
    let plan = plan_for(&cfg);
    let mut be = cuda(&dir, &cfg, &plan);
    let vocab = be.capabilities().vocab_size;
    let ids = random_tokens(&mut StdRng::seed_from_u64(32), 30, vocab);
    // The decode graph is captured here: both runs below replay it.
    let pg = pages(200, 4);
    run(&mut be, &one(chunk(2, &pg, 0, &ids[..5])));
    run(&mut be, &one(chunk(2, &pg, 5, &ids[5..6])));
    let mut runs = Vec::new();
    for (slot, timed) in [(0u32, false), (1, true)] {
        be.set_step_phases(timed).unwrap();
        let pg = pages(60 * slot, 80);
        let mut rows = run(&mut be, &one(chunk(slot, &pg, 0, &ids)));
        for p in ids.len()..ids.len() + 4 {
            let next = argmax(&rows[rows.len() - vocab..]) as u32;
            rows.extend(run(&mut be, &one(chunk(slot, &pg, p, &[next]))));
        }
        let logits = be.take_step_phases();
        picks(&mut be, &one(chunk(slot, &pg, ids.len() + 4, &[3])), vocab, Pick::Argmax);
        runs.push((rows, logits, be.take_step_phases()));
    }
    be.set_step_phases(false).unwrap();
    let (plain, timed) = (&runs[0], &runs[1]);
    assert!(plain.1.is_none() && plain.2.is_none(), "no phases unless turned on");
    assert!(plain.0.iter().zip(&timed.0).all(|(a, b)| a.to_bits() == b.to_bits()), "timing changed the logits");
    for (label, p, steps) in [("logits", timed.1.unwrap(), 5), ("greedy", timed.2.unwrap(), 1)] {
        println!("{label}: {p:?}");
        assert_eq!(p.steps, steps, "{label}");
        let parts =
            [p.host_prep_ms, p.host_upload_ms, p.host_launch_ms, p.gpu_inputs_ms, p.gpu_forward_ms, p.output_ms];
        assert!(parts.iter().all(|&x| x >= 0.0) && p.gpu_forward_ms > 0.0, "{label}: {p:?}");
        assert!(p.host_prep_ms + p.host_upload_ms + p.host_launch_ms <= p.wall_ms, "{label}: {p:?}");
    }
}
