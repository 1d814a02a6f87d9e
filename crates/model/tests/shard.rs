//! Tensor-parallel sharding spec: the 27B's head counts give the documented ranges at TP=2/4, world
//! sizes that split a head group are refused naming the head counts, and at the 27B's head counts
//! (small head dims) every tensor's shards of every rank put back together give the full tensor,
//! element for element, with no element held by two ranks unless replicated.

#![allow(clippy::single_range_in_vec_init)]

use deltaserve_model::ModelConfig;
use deltaserve_model::shard::{ShardSpec, Split, WORLD_SIZES, check_world, unshard};
use deltaserve_model::synth::Preset;

fn cfg_27b() -> ModelConfig {
    Preset::Qwen36_27b.config(Some(8))
}

/// The 27B's head counts (24 q / 4 kv, 16 k / 48 v) at small widths; vocab 1001 (not divisible by 2, 4).
fn cfg_27b_heads_small() -> ModelConfig {
    let mut j = Preset::Qwen36_27b.config_json(Some(8));
    let t = &mut j["text_config"];
    t["hidden_size"] = 48.into();
    t["head_dim"] = 8.into();
    t["linear_key_head_dim"] = 4.into();
    t["linear_value_head_dim"] = 4.into();
    t["intermediate_size"] = 100.into();
    t["vocab_size"] = 1001.into();
    t["eos_token_id"] = 1000.into();
    t["pad_token_id"] = 999.into();
    ModelConfig::from_json_str(&j.to_string()).unwrap()
}

#[test]
fn ranges_at_27b_shapes() {
    let cfg = cfg_27b();
    let s = ShardSpec::new(&cfg, 1, 2).unwrap();
    assert_eq!((s.q_heads.clone(), s.kv_heads.clone()), (12..24, 2..4));
    assert_eq!((s.gdn_k_heads.clone(), s.gdn_v_heads.clone()), (8..16, 24..48));
    assert_eq!(s.intermediate, 8704..17408);
    assert_eq!(s.vocab, 124_160..248_320);
    // in_proj_qkv: q block, k block (offset 2048), v block (offset 4096), 128 per key / value head.
    assert_eq!(
        s.split("layers.0.linear_attn.in_proj_qkv.weight").unwrap(),
        Split::Rows(vec![1024..2048, 3072..4096, 4096 + 3072..4096 + 6144])
    );
    assert_eq!(
        s.split("layers.0.linear_attn.conv1d.weight").unwrap(),
        s.split("layers.0.linear_attn.in_proj_qkv.weight").unwrap()
    );
    assert_eq!(s.split("layers.0.linear_attn.in_proj_z.weight").unwrap(), Split::Rows(vec![3072..6144]));
    assert_eq!(s.split("layers.0.linear_attn.A_log").unwrap(), Split::Rows(vec![24..48]));
    assert_eq!(s.split("layers.0.linear_attn.out_proj.weight").unwrap(), Split::Cols(vec![3072..6144]));
    assert_eq!(s.split("layers.0.linear_attn.norm.weight").unwrap(), Split::Replicated);
    // q_proj rows are per head [q | gate] of 256 each.
    assert_eq!(s.split("layers.3.self_attn.q_proj.weight").unwrap(), Split::Rows(vec![12 * 512..24 * 512]));
    assert_eq!(s.split("layers.3.self_attn.k_proj.weight").unwrap(), Split::Rows(vec![512..1024]));
    assert_eq!(s.split("layers.3.self_attn.o_proj.weight").unwrap(), Split::Cols(vec![3072..6144]));
    assert_eq!(s.split("mtp.layers.0.self_attn.o_proj.weight").unwrap(), Split::Cols(vec![3072..6144]));
    assert_eq!(s.split("mtp.fc.weight").unwrap(), Split::Replicated);

    let r = ShardSpec::new(&cfg, 3, 4).unwrap();
    assert_eq!(
        (r.q_heads.clone(), r.kv_heads.clone(), r.gdn_k_heads.clone(), r.gdn_v_heads.clone()),
        (18..24, 3..4, 12..16, 36..48)
    );
    let c = r.rank_config(&cfg);
    let d = c.dims();
    assert_eq!((d.q_heads, d.kv_heads, d.q_per_kv, d.gdn_k_heads, d.gdn_v_heads, d.gdn_ratio), (6, 1, 6, 4, 12, 3));
    assert_eq!((d.intermediate, d.vocab, d.hidden, d.conv_channels), (4352, 62_080, 5120, 2 * 512 + 1536));
    assert!(s.split("layers.0.mlp.nonsense.weight").is_err());
}

#[test]
fn world_sizes_that_split_a_head_group_are_refused() {
    let cfg = cfg_27b();
    for w in [1, 2, 4] {
        check_world(&cfg, w).unwrap();
    }
    let e = ShardSpec::new(&cfg, 0, 8).unwrap_err().to_string();
    assert!(
        e.contains("tensor parallel size 8") && e.contains("4 attention kv heads") && e.contains("24 query heads"),
        "{e}"
    );
    assert!(e.contains("1, 2, 4"), "{e}");
    let e = ShardSpec::new(&cfg, 0, 3).unwrap_err().to_string();
    assert!(e.contains("must be 1, 2, 4 or 8"), "{e}");
    let e = ShardSpec::new(&cfg, 2, 2).unwrap_err().to_string();
    assert!(e.contains("rank 2"), "{e}");
    // A model whose DeltaNet key heads do not divide: 4 kv heads but 2 key heads.
    let mut j = Preset::Qwen36_27b.config_json(Some(4));
    j["text_config"]["linear_num_key_heads"] = 2.into();
    j["text_config"]["linear_num_value_heads"] = 6.into();
    let c = ModelConfig::from_json_str(&j.to_string()).unwrap();
    let e = check_world(&c, 4).unwrap_err().to_string();
    assert!(e.contains("2 DeltaNet key heads") && e.contains("6 value heads"), "{e}");
}

#[test]
fn shards_of_every_tensor_reassemble_the_full_tensor() {
    let cfg = cfg_27b_heads_small();
    for world in WORLD_SIZES {
        if check_world(&cfg, world).is_err() {
            assert_eq!(world, 8);
            continue;
        }
        let specs = ShardSpec::all(&cfg, world).unwrap();
        let per_rank: Vec<_> = specs.iter().map(|s| s.tensors(&cfg, true).unwrap()).collect();
        let n = per_rank[0].len();
        // 8 layers (6 DeltaNet × 13 + 2 attention × 9) + embed, lm_head, norm + MTP (4 + 9).
        assert_eq!(n, 6 * 14 + 2 * 11 + 3 + 4 + 11);
        for i in 0..n {
            let t0 = &per_rank[0][i];
            let full: Vec<f32> = (0..t0.shape.iter().product::<usize>()).map(|x| x as f32).collect();
            let splits: Vec<Split> = per_rank.iter().map(|r| r[i].split.clone()).collect();
            let shards: Vec<Vec<f32>> = per_rank.iter().map(|r| r[i].extract(&full).unwrap()).collect();
            for (r, s) in per_rank.iter().zip(&shards) {
                assert_eq!(s.len(), r[i].shard_shape().iter().product::<usize>(), "{}", t0.name);
            }
            let back = unshard(&t0.name, &t0.shape, &splits, &shards).unwrap();
            assert_eq!(back, full, "{} at world {world}", t0.name);
            // Split tensors are partitions: the shard sizes add up to the full size.
            if t0.split != Split::Replicated {
                assert_eq!(shards.iter().map(Vec::len).sum::<usize>(), full.len(), "{}", t0.name);
            }
        }
        // The rank's config has exactly the shard shapes.
        for s in &specs {
            let rc = s.rank_config(&cfg);
            let want = ShardSpec::new(&rc, 0, 1).unwrap().tensors(&rc, true).unwrap();
            let got = s.tensors(&cfg, true).unwrap();
            for (w, g) in want.iter().zip(&got) {
                assert_eq!(w.shape, g.shard_shape(), "{} rank {} of {world}", g.name, s.rank);
            }
        }
        // The last rank's vocabulary is the shorter one when the vocabulary does not divide.
        let v: Vec<usize> = specs.iter().map(|s| s.vocab.len()).collect();
        assert_eq!(v.iter().sum::<usize>(), 1001);
        assert!(v.windows(2).all(|p| p[0] >= p[1]), "{v:?}");
    }
}

#[test]
fn deltanet_value_heads_stay_with_their_key_heads() {
    // Value head v reads key head v / r: a rank's local value head j must read its local key head j / r.
    let cfg = cfg_27b();
    let d = cfg.dims();
    for world in [1, 2, 4] {
        for s in ShardSpec::all(&cfg, world).unwrap() {
            let r = d.gdn_ratio;
            for (j, v) in s.gdn_v_heads.clone().enumerate() {
                assert_eq!(v / r, s.gdn_k_heads.start + j / r);
            }
            for (j, h) in s.q_heads.clone().enumerate() {
                assert_eq!(h / d.q_per_kv, s.kv_heads.start + j / d.q_per_kv);
            }
        }
    }
}
