//! Tensor parallelism simulated on the CPU ([`deltaserve_cpu::tp`]) against the unsharded reference:
//!
//! - the tiny preset, the HF fixtures `qwen35_gva3` (GQA 2:1, GVA 3:1) and `qwen3next_dense` (packed
//!   Qwen3-Next projections, unpacked at load) at TP=1 and 2 (their 2 kv / 2 key heads allow no more),
//!   and an in-memory model with 8 kv / 8 key heads (GQA 2:1, GVA 3:1, vocabulary and intermediate
//!   sizes that do not divide by the world) at TP=1, 2, 4 and 8;
//! - a 300-token prompt fed in pieces of 130 (two 64-token chunks + 2), 70 and 100 tokens (chunk
//!   boundaries inside and across calls), then 4 decode steps; logits of every position compared;
//! - TP=1 is bit-identical; TP>1 within `max |Δ| ≤ 1e-4 · max |logit|` (f32 rounding of the split
//!   row-parallel sums; measured 1.2e-6 .. 8.5e-6, the same order as the reference's own chunked vs
//!   recurrent difference, 1.1e-6 .. 1.0e-5, printed as the noise floor);
//! - every weight's shards put back together equal the full weight.

use std::path::{Path, PathBuf};

use deltaserve_cpu::tp::{TpModel, all_gather_cols, all_reduce_sum};
use deltaserve_cpu::{CpuModel, GdnMode, Logits};
use deltaserve_model::shard::{ShardSpec, Split, shape_skeleton, try_map_named, unshard, visit_named};
use deltaserve_model::synth::{Preset, write_model};
use deltaserve_model::weights::HostTensor;
use deltaserve_model::{Checkpoint, ModelConfig, ModelWeights};

/// Relative tolerance of TP>1 logits (max |Δ| over max |reference logit|).
const TOL: f32 = 1e-4;

fn load(dir: &Path) -> CpuModel {
    let cfg = ModelConfig::from_dir(dir).unwrap();
    let ckpt = Checkpoint::open(dir).unwrap();
    CpuModel::new(cfg.clone(), ModelWeights::load_f32(&ckpt, &cfg).unwrap())
}

fn fixture(name: &str) -> CpuModel {
    load(&Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/hf").join(name))
}

fn tiny() -> CpuModel {
    // One directory per call: the tests run in parallel threads of one process.
    static CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir: PathBuf = std::env::temp_dir().join(format!("ds-tp-tiny-{}-{n}", std::process::id()));
    write_model(&dir, Preset::Tiny, None, 17, |_, _| {}).unwrap();
    let m = load(&dir);
    let _ = std::fs::remove_dir_all(&dir);
    m
}

/// A small xorshift for in-memory weights.
struct Rng(u64);
impl Rng {
    fn uniform(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 40) as f32 / (1u64 << 24) as f32
    }
    fn normal(&mut self) -> f32 {
        let (u1, u2) = (self.uniform().max(1e-7), self.uniform());
        (-2.0 * u1.ln()).sqrt() * (std::f32::consts::TAU * u2).cos()
    }
}

/// 8 layers (6 DeltaNet + 2 attention), 16 q / 8 kv heads, 8 key / 24 value heads, intermediate 190
/// and vocabulary 999 (neither divides by 4 or 8), random weights in memory.
fn wide_heads() -> CpuModel {
    let mut j = Preset::Tiny.config_json(Some(8));
    let t = &mut j["text_config"];
    for (k, v) in [
        ("hidden_size", 64),
        ("num_attention_heads", 16),
        ("num_key_value_heads", 8),
        ("head_dim", 16),
        ("linear_num_key_heads", 8),
        ("linear_num_value_heads", 24),
        ("linear_key_head_dim", 8),
        ("linear_value_head_dim", 8),
        ("intermediate_size", 190),
        ("vocab_size", 999),
        ("eos_token_id", 998),
        ("pad_token_id", 997),
    ] {
        t[k] = v.into();
    }
    let cfg = ModelConfig::from_json_str(&j.to_string()).unwrap();
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let w = try_map_named(&shape_skeleton(&cfg), &mut |name, shape: &Vec<usize>| {
        let n: usize = shape.iter().product();
        let fan_in = if shape.len() == 2 { shape[1] } else { 1 };
        let data = (0..n)
            .map(|_| {
                if name.ends_with("A_log") {
                    (1.0 + 15.0 * rng.uniform()).ln()
                } else if name.ends_with("linear_attn.norm.weight") {
                    1.0 + 0.1 * rng.normal()
                } else if name.ends_with("norm.weight") || name.ends_with("layernorm.weight") {
                    0.1 * rng.normal()
                } else if name.ends_with("dt_bias") || name.ends_with("embed_tokens.weight") {
                    rng.normal()
                } else if name.ends_with("conv1d.weight") {
                    0.5 * rng.normal()
                } else {
                    0.5 * rng.normal() / (fan_in as f32).sqrt()
                }
            })
            .collect();
        Ok(HostTensor { shape: shape.clone(), data })
    })
    .unwrap();
    CpuModel::new(cfg, w)
}

/// The prompt pieces and decode tokens of every comparison.
fn script(vocab: usize) -> Vec<Vec<u32>> {
    let tok = |i: usize| ((i * 7919 + 13) % vocab) as u32;
    let mut pieces = Vec::new();
    let mut pos = 0;
    for len in [130, 70, 100, 1, 1, 1, 1] {
        pieces.push((pos..pos + len).map(tok).collect());
        pos += len;
    }
    pieces
}

/// max |a − b| / max |b|.
fn rel_err(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    a.iter().zip(b).fold(0.0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

/// Runs the script on the reference and at each world size; returns the worst relative error per world.
fn compare(name: &str, m: &CpuModel, worlds: &[usize]) {
    let pieces = script(m.dims.vocab);
    let mut st = m.new_sequence();
    let reference: Vec<Vec<f32>> =
        pieces.iter().map(|p| m.forward(&mut st, p, GdnMode::Auto, Logits::All).unwrap()).collect();
    assert!(reference.iter().flatten().all(|x| x.is_finite()));
    // The f32 noise floor: the same model with the token-by-token recurrence instead of chunks.
    let mut st = m.new_sequence();
    let floor = pieces
        .iter()
        .zip(&reference)
        .map(|(p, r)| rel_err(&m.forward(&mut st, p, GdnMode::Recurrent, Logits::All).unwrap(), r))
        .fold(0.0f32, f32::max);
    println!("{name}: chunked vs recurrent reference (f32 noise floor) {floor:.2e}");
    for &world in worlds {
        let tp = TpModel::from_model(m, world).unwrap();
        let mut seq = tp.new_sequence();
        let mut worst = 0.0f32;
        let mut first = Vec::new();
        for (p, r) in pieces.iter().zip(&reference) {
            let got = tp.forward(&mut seq, p, GdnMode::Auto, Logits::All).unwrap();
            if first.is_empty() {
                first = got.clone();
            }
            if world == 1 {
                assert!(got.iter().zip(r).all(|(a, b)| a.to_bits() == b.to_bits()), "{name}: TP=1 not bit-identical");
            }
            worst = worst.max(rel_err(&got, r));
        }
        // Last-row logits agree with the last row of All.
        let mut seq2 = tp.new_sequence();
        let last = tp.forward(&mut seq2, &pieces[0], GdnMode::Auto, Logits::Last).unwrap();
        let v = m.dims.vocab;
        assert_eq!(last, first[first.len() - v..], "{name} TP={world}: Logits::Last");
        println!("{name}: TP={world} logits max |Δ| / max |logit| = {worst:.2e} over 304 positions");
        assert!(worst <= TOL, "{name}: TP={world} relative error {worst:e} > {TOL:e}");
        assert_eq!(seq.len, 304);
    }
}

#[test]
fn tiny_preset_sharded_forward_matches() {
    compare("tiny", &tiny(), &[1, 2]);
}

#[test]
fn hf_fixture_gva3_sharded_forward_matches() {
    compare("qwen35_gva3", &fixture("qwen35_gva3"), &[1, 2]);
}

#[test]
fn hf_fixture_qwen3next_sharded_forward_matches() {
    compare("qwen3next_dense", &fixture("qwen3next_dense"), &[1, 2]);
}

#[test]
fn wide_heads_sharded_forward_matches_at_tp_1_2_4_8() {
    compare("wide_heads", &wide_heads(), &[1, 2, 4, 8]);
}

#[test]
fn refused_world_sizes_name_the_heads() {
    let m = fixture("qwen35_gva3");
    let e = TpModel::from_model(&m, 4).err().unwrap().to_string();
    assert!(e.contains("2 attention kv heads") && e.contains("4 query heads"), "{e}");
    let m = fixture("qwen35_gva1_tied");
    let e = TpModel::from_model(&m, 2).err().unwrap().to_string();
    assert!(e.contains("1 attention kv heads"), "{e}");
}

#[test]
fn shards_concatenate_back_to_the_full_weights() {
    for (name, m, worlds) in [
        ("tiny", tiny(), vec![1, 2]),
        ("qwen35_gva3", fixture("qwen35_gva3"), vec![2]),
        ("qwen3next_dense", fixture("qwen3next_dense"), vec![2]),
        ("wide_heads", wide_heads(), vec![2, 4, 8]),
    ] {
        for world in worlds {
            let tp = TpModel::from_model(&m, world).unwrap();
            // Collect every rank's tensors by name, in the same order.
            let mut per_rank: Vec<Vec<(String, HostTensor)>> = Vec::new();
            for r in &tp.ranks {
                let mut v = Vec::new();
                visit_named(&r.model.weights, &mut |n, t| {
                    v.push((n.to_string(), t.clone()));
                    Ok(())
                })
                .unwrap();
                per_rank.push(v);
            }
            let mut count = 0;
            visit_named(&m.weights, &mut |n, full| {
                let splits: Vec<Split> = tp.ranks.iter().map(|r| r.spec.split(n).unwrap()).collect();
                let shards: Vec<Vec<f32>> = per_rank
                    .iter()
                    .map(|v| v.iter().find(|(x, _)| x == n).map(|(_, t)| t.data.clone()).unwrap())
                    .collect();
                let back = unshard(n, &full.shape, &splits, &shards).unwrap();
                assert!(back == full.data, "{name} TP={world}: {n} does not reassemble");
                count += 1;
                Ok(())
            })
            .unwrap();
            assert!(count > 20, "{name}: only {count} tensors");
            assert_eq!(per_rank[0].len(), count);
        }
    }
    // A rank's shard is what the spec says it is.
    let m = fixture("qwen35_gva3");
    let s = ShardSpec::new(&m.config, 1, 2).unwrap();
    assert_eq!(s.vocab, 256..512);
}

#[test]
fn collectives() {
    let mut b = vec![vec![1.0, 2.0], vec![10.0, 20.0], vec![100.0, 200.0]];
    all_reduce_sum(&mut b);
    assert!(b.iter().all(|x| x == &[111.0, 222.0]));
    let parts = vec![vec![1.0, 2.0, 3.0, 4.0], vec![5.0, 6.0], vec![]];
    assert_eq!(all_gather_cols(&parts, 2), vec![1.0, 2.0, 5.0, 3.0, 4.0, 6.0]);
}
