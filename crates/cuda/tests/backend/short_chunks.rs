//! Short prefill chunks over a long context (`CudaOptions::short_chunk_decode_attention_from`): the
//! prefill kernel with each tile's keys split over more blocks (the wide kernels), and every row as a
//! decode query split-K over its causal keys (as long-context verify rows are), instead of the prefill
//! kernel's query tiles alone. The same logits as the prefill kernel, and as close to the CPU
//! reference as the prefill kernel's — beside a long prefill chunk, a chunk below the threshold and
//! decode rows in one step, in a step of short chunks alone (no other tiles), and in the steps after
//! them (the chunks' every row, not only the last, feeds the later layers' K/V). Chunks longer than the
//! rows path takes split their keys too (into the chunked DeltaNet workspace, idle in attention layers).

use deltaserve_backend::{Backend, StepBatch};
use deltaserve_cuda::backend::{CudaOptions, SHORT_CHUNK_TOKENS};
use deltaserve_plan::KvDtype;
use rand::SeedableRng;
use rand::rngs::StdRng;

use super::common::*;

/// One step of `(slot, start, tokens)` chunks on every backend; the wanted rows' logits of each.
fn step_all(backends: &mut [&mut dyn Backend], pg: &[Vec<u32>], chunks: &[(usize, usize, Vec<u32>)]) -> Vec<Vec<f32>> {
    let mut batch = StepBatch::default();
    for (slot, start, tokens) in chunks {
        batch.seqs.push(chunk(*slot as u32, &pg[*slot], *start, tokens));
    }
    backends.iter_mut().map(|b| run(&mut **b, &batch)).collect()
}

#[test]
fn short_chunks_over_long_contexts_match_the_prefill_kernel_and_the_cpu() {
    if !gpu() {
        return;
    }
    let (dir, cfg) = tiny_dir(8);
    let mut failures = Vec::new();
    for kv in [KvDtype::Bf16, KvDtype::Fp8] {
        let plan = plan_with(&cfg, |o| {
            o.k_dtype = kv;
            o.v_dtype = kv;
        });
        let mut tiles = cuda(&dir, &cfg, &plan);
        // The short chunks' paths: the prefill kernel with its keys split (where the wide kernels run),
        // and the rows as decode queries.
        let mut split = cuda(&dir, &cfg, &plan);
        split.set_options(CudaOptions { short_chunk_decode_attention_from: 256, ..split.options() }).unwrap();
        let mut rows = cuda(&dir, &cfg, &plan);
        let o = CudaOptions { short_chunk_decode_attention_from: 256, short_chunk_split_keys: false, ..rows.options() };
        rows.set_options(o).unwrap();
        let paths: &[(usize, &str)] = if split.short_chunks_split_keys() {
            &[(1, "keys split"), (2, "decode queries")]
        } else {
            &[(2, "decode queries")]
        };
        let mut cpu = cpu(&dir, &cfg);
        if kv != KvDtype::Bf16 {
            cpu = cpu.with_kv_formats(kv, kv);
        }
        let vocab = rows.capabilities().vocab_size;
        let mut rng = StdRng::seed_from_u64(31);
        // Histories, then one step: three short chunks over long contexts (37 tokens after 300, the
        // longest rows path's after 700, and 150 after 500: the keys split only, the rows path's tiles),
        // one below the threshold (5 after 40), a long prefill from 0, and a decode row.
        let hist = [300usize, 700, 40, 0, 120, 500];
        let new = [37usize, SHORT_CHUNK_TOKENS, 5, 200, 1, 150];
        let pg: Vec<Vec<u32>> = (0..hist.len()).map(|i| pages(64 * i as u32, 1000)).collect();
        let toks: Vec<Vec<u32>> =
            (0..hist.len()).map(|i| random_tokens(&mut rng, hist[i] + new[i] + 8, vocab)).collect();
        let mut bs: [&mut dyn Backend; 4] = [&mut tiles, &mut split, &mut rows, &mut cpu];
        for (i, &h) in hist.iter().enumerate().filter(|(_, h)| **h > 0) {
            step_all(&mut bs, &pg, &[(i, 0, toks[i][..h].to_vec())]);
        }
        let label = format!("KV {}", kv.name());
        // Each short-chunk path is held to the prefill kernel (all read the same KV cache; bf16 rounding
        // apart) and to the CPU reference no worse than the prefill kernel is (long contexts of a random
        // tiny model drift from the f32 reference by a few percent on every path).
        let vs_tiles_bound = if kv == KvDtype::Bf16 { 2e-2 } else { 4e-2 };
        let mut compare = |what: &str, got: &[Vec<f32>]| {
            let mut tiles_cpu = Score::default();
            tiles_cpu.add(&got[0], &got[3], vocab);
            let t = tiles_cpu.median_l2();
            for &(i, path) in paths {
                let (mut vs_tiles, mut path_cpu) = (Score::default(), Score::default());
                vs_tiles.add(&got[i], &got[0], vocab);
                path_cpu.add(&got[i], &got[3], vocab);
                let r = path_cpu.median_l2();
                println!(
                    "{label} {what}, {path}: worst row vs the prefill kernel {:.3e}; median L2 vs CPU {r:.3e} \
                     (prefill kernel {t:.3e}); argmax as CPU {}/{} (prefill kernel {}/{})",
                    vs_tiles.worst, path_cpu.argmax_same, path_cpu.rows, tiles_cpu.argmax_same, tiles_cpu.rows
                );
                if vs_tiles.worst >= vs_tiles_bound {
                    failures.push(format!("{label} {what}, {path}: {:.3e} from the prefill kernel", vs_tiles.worst));
                }
                if r > 1.25 * t + 5e-3 {
                    failures.push(format!(
                        "{label} {what}, {path}: median L2 vs CPU {r:.3e}, the prefill kernel's {t:.3e}"
                    ));
                }
                if path_cpu.decisive_flips > tiles_cpu.decisive_flips {
                    failures.push(format!("{label} {what}, {path}: an argmax flip where the CPU's margin is decisive"));
                }
            }
        };
        let mixed: Vec<(usize, usize, Vec<u32>)> =
            (0..hist.len()).map(|i| (i, hist[i], toks[i][hist[i]..hist[i] + new[i]].to_vec())).collect();
        compare("mixed step", &step_all(&mut bs, &pg, &mixed));
        // Short chunks alone (the prefill kernel has no tile to run), then a decode step of everyone.
        let at: Vec<usize> = (0..hist.len()).map(|i| hist[i] + new[i]).collect();
        let alone =
            vec![(0, at[0], toks[0][at[0]..at[0] + 3].to_vec()), (1, at[1], toks[1][at[1]..at[1] + 2].to_vec())];
        compare("short chunks alone", &step_all(&mut bs, &pg, &alone));
        let next: Vec<(usize, usize, Vec<u32>)> = (0..hist.len())
            .map(|i| {
                let p = at[i] + [3, 2, 0, 0, 0, 0][i];
                (i, p, vec![toks[i][p]])
            })
            .collect();
        compare("decode step after them", &step_all(&mut bs, &pg, &next));
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// At the 27B's attention heads (head dim 256, 24 q / 4 kv heads; 8 layers, two of them attention) with an
/// fp8 cache, short chunks' rows as decode queries attend in groups of a chunk's rows (attn_verify_mma,
/// which the tiny model's head dim 32 does not take): the same logits as the prefill kernel's tiles, in
/// the step and in the decode step after it. Random weights; GPU only (the CPU oracle at these widths is
/// slow, and the kernel itself is held to it in the ops table).
#[test]
fn short_chunks_in_row_groups_match_the_prefill_kernel_at_27b_heads() {
    use deltaserve_cuda::{CudaBackend, WeightSource};
    use deltaserve_model::ModelConfig;
    use deltaserve_model::synth::Preset;
    if !gpu() {
        return;
    }
    let free = deltaserve_cuda::Runtime::open(0).and_then(|rt| rt.free_memory()).unwrap_or(0);
    if free < 40 << 30 {
        println!("SKIP: two 27B-width backends need 40 GiB free ({} GiB here)", free >> 30);
        return;
    }
    let preset = Preset::parse("qwen3.6-27b").unwrap();
    let cfg = ModelConfig::from_json_str(&preset.config_json(Some(8)).to_string()).unwrap();
    let plan = plan_with(&cfg, |o| {
        o.budget_bytes = 18 << 30;
        o.max_batch_tokens = 2048;
        o.max_context = Some(8192);
        o.k_dtype = KvDtype::Fp8;
        o.v_dtype = KvDtype::Fp8;
    });
    let new_backend = |groups: bool| {
        let mut b =
            CudaBackend::with_options(&cfg, WeightSource::RandomWeights { seed: 5 }, &plan, 2, test_opts()).unwrap();
        let from = if groups { 256 } else { usize::MAX };
        let o = CudaOptions { short_chunk_decode_attention_from: from, short_chunk_split_keys: false, ..b.options() };
        b.set_options(o).unwrap();
        b
    };
    let (mut tiles, mut groups) = (new_backend(false), new_backend(true));
    let vocab = cfg.vocab_size;
    let mut rng = StdRng::seed_from_u64(41);
    // Two sequences: 37 and 5 new tokens after 1,500 and 600 cached ones (groups of 4 rows and a last
    // group of 1), then a decode step of both.
    let (hist, new) = ([1500usize, 600], [37usize, 5]);
    let pg: Vec<Vec<u32>> = (0..2).map(|i| pages(512 * i as u32, 1600)).collect();
    let toks: Vec<Vec<u32>> = (0..2).map(|i| random_tokens(&mut rng, hist[i] + new[i] + 1, vocab)).collect();
    let mut bs: [&mut dyn Backend; 2] = [&mut tiles, &mut groups];
    for i in 0..2 {
        step_all(&mut bs, &pg, &[(i, 0, toks[i][..hist[i]].to_vec())]);
    }
    let short: Vec<(usize, usize, Vec<u32>)> =
        (0..2).map(|i| (i, hist[i], toks[i][hist[i]..hist[i] + new[i]].to_vec())).collect();
    let next: Vec<(usize, usize, Vec<u32>)> =
        (0..2).map(|i| (i, hist[i] + new[i], vec![toks[i][hist[i] + new[i]]])).collect();
    for (what, step) in [("short chunks", &short), ("decode step after them", &next)] {
        let got = step_all(&mut bs, &pg, step);
        for (s, (a, b)) in got[0].chunks(vocab).zip(got[1].chunks(vocab)).enumerate() {
            let l2 = rel_l2(b, a);
            println!("27B heads, fp8 KV, {what}, sequence {s}: row groups vs the prefill kernel, L2 rel err {l2:.3e}");
            // bf16 rounding through 8 random layers: ~1e-2; a wrong row, length or table row: order 1.
            assert!(l2 < 6e-2, "{what}, sequence {s}: L2 rel err {l2:.3e}");
        }
    }
}
