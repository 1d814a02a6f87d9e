//! The vision tower's config and weights: `vision_config` and the image token ids parsed (and refused by
//! name when unsupported), text-only configs without a tower, and `model.visual.*` loaded with errors that
//! name a missing or misshapen tensor.

use std::path::{Path, PathBuf};

use deltaserve_model::synth::{Preset, write_model};
use deltaserve_model::{Checkpoint, ModelConfig, VisionAct, VisionWeights};
use serde_json::{Value, json};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/hf").join(name)
}

fn vision_json() -> Value {
    serde_json::from_str(&std::fs::read_to_string(fixture("qwen35_vision").join("config.json")).unwrap()).unwrap()
}

fn err(v: &Value) -> String {
    ModelConfig::from_json_str(&v.to_string()).expect_err("expected an error").to_string()
}

#[test]
fn vision_config_and_token_ids_are_read() {
    let cfg = ModelConfig::from_dir(&fixture("qwen35_vision")).unwrap();
    let v = cfg.vision.as_ref().expect("a tower");
    assert_eq!((v.depth, v.hidden_size, v.num_heads, v.head_dim()), (2, 144, 2, 72));
    assert_eq!((v.intermediate_size, v.out_hidden_size, v.patch_dim(), v.merge_unit()), (288, 128, 1536, 4));
    assert_eq!((v.num_position_embeddings, v.position_grid_side(), v.hidden_act), (64, 8, VisionAct::GeluTanh));
    assert_eq!(
        (v.image_token_id, v.video_token_id, v.vision_start_token_id, v.vision_end_token_id),
        (500, 501, 502, 503)
    );
    assert_eq!(v.rope_theta, 10_000.0);
    assert_eq!(cfg.mrope_section, [2, 1, 1]);
}

#[test]
fn text_only_checkpoints_have_no_tower() {
    let cfg = ModelConfig::from_dir(&fixture("qwen3next_moe")).unwrap();
    assert_eq!(cfg.vision, None);
    let mut t = Preset::Tiny.text_config(None);
    t["rope_parameters"].as_object_mut().unwrap().remove("mrope_section");
    let text = ModelConfig::from_json_str(&t.to_string()).unwrap();
    assert_eq!(text.vision, None);
    assert_eq!(text.mrope_section, [11, 11, 10], "HF's default");
    let mut c = vision_json();
    c["vision_config"] = Value::Null;
    assert_eq!(ModelConfig::from_json_str(&c.to_string()).unwrap().vision, None);
}

#[test]
fn synthetic_presets_carry_a_tower_config_with_in_vocabulary_token_ids() {
    for (preset, depth, side) in [(Preset::Tiny, 2, 8), (Preset::Qwen36_27b, 27, 48)] {
        let cfg = preset.config(None);
        let v = cfg.vision.unwrap();
        assert_eq!((v.depth, v.head_dim(), v.position_grid_side()), (depth, 72, side));
        assert_eq!(v.image_token_id as usize, preset.tokenizer_mergeable() + 12);
    }
}

#[test]
fn the_real_tower_has_the_documented_parameter_count() {
    let cfg = Preset::Qwen36_27b.config(None);
    let shapes = deltaserve_model::vision::tensor_shapes(cfg.vision.as_ref().unwrap());
    let params: usize = shapes.iter().map(|(_, s)| s.iter().product::<usize>()).sum();
    assert_eq!(params, 460_730_096, "docs/architecture.md §5");
}

#[test]
fn synthetic_models_have_a_loadable_tower_and_the_image_processor_config() {
    let dir = std::env::temp_dir().join(format!("ds-vision-synth-{}", std::process::id()));
    let cfg = write_model(&dir, Preset::Tiny, None, 7, |_, _| {}).unwrap();
    let w = VisionWeights::load_f32(&Checkpoint::open(&dir).unwrap(), &cfg).unwrap().expect("a tower");
    assert_eq!(w.blocks.len(), 2);
    assert_eq!(w.merger_fc2.weight.shape, [128, 576]);
    let pre: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("preprocessor_config.json")).unwrap()).unwrap();
    assert_eq!(
        (pre["patch_size"].as_u64(), pre["merge_size"].as_u64(), pre["temporal_patch_size"].as_u64()),
        (Some(16), Some(2), Some(2))
    );
    assert_eq!(pre["size"], json!({"shortest_edge": 65536, "longest_edge": 16777216}));
    assert_eq!(pre["image_mean"], json!([0.5, 0.5, 0.5]));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn unsupported_or_inconsistent_towers_are_refused_by_name() {
    let cases: [(&str, Value, &str); 5] = [
        ("deepstack_visual_indexes", json!([8, 16]), "deepstack_visual_indexes"),
        ("hidden_act", json!("relu"), "vision_config.hidden_act"),
        ("num_position_embeddings", json!(60), "must be a square"),
        ("num_heads", json!(5), "head dim"),
        ("depth", json!("two"), "vision_config.depth"),
    ];
    for (field, value, want) in cases {
        let mut c = vision_json();
        c["vision_config"][field] = value;
        let e = err(&c);
        assert!(e.contains(want), "{field}: {e}");
    }
    let mut c = vision_json();
    c["vision_config"]["deepstack_visual_indexes"] = json!([]);
    assert!(ModelConfig::from_json_str(&c.to_string()).is_ok(), "an empty deepstack list is Qwen3.5's");
    c["text_config"]["rope_parameters"]["mrope_section"] = json!([2, 1]);
    assert!(err(&c).contains("mrope_section"), "{}", err(&c));
}

#[test]
fn a_tower_that_cannot_feed_the_text_model_is_ignored() {
    // Text-only exports keep HF's default token ids and a stale tower: they still load, without one.
    for name in ["qwen35_gva3", "qwen35_moe", "qwen35_gva1_tied", "qwen35_gva3_d32"] {
        assert_eq!(ModelConfig::from_dir(&fixture(name)).unwrap().vision, None, "{name}");
    }
    for (field, value) in [("image_token_id", json!(512)), ("vision_end_token_id", json!(600))] {
        let mut c = vision_json();
        c[field] = value;
        assert_eq!(ModelConfig::from_json_str(&c.to_string()).unwrap().vision, None, "{field}");
    }
    let mut c = vision_json();
    c["vision_config"]["out_hidden_size"] = json!(64);
    assert_eq!(ModelConfig::from_json_str(&c.to_string()).unwrap().vision, None);
}

#[test]
fn tower_weights_load_and_name_what_is_wrong() {
    let dir = fixture("qwen35_vision");
    let cfg = ModelConfig::from_dir(&dir).unwrap();
    let ckpt = Checkpoint::open(&dir).unwrap();
    let w = VisionWeights::load_f32(&ckpt, &cfg).unwrap().expect("a tower");
    assert_eq!(w.blocks.len(), 2);
    assert_eq!(w.patch_embed.weight.shape, [144, 1536]);
    assert!(w.patch_embed.bias.is_some());
    assert_eq!(w.merger_fc1.weight.shape, [576, 576]);
    assert_eq!(w.merger_fc2.weight.shape, [128, 576]);
    assert_eq!(w.blocks[1].qkv.weight.shape, [432, 144]);

    // A text-only checkpoint under this config: the first tensor is missing, by name.
    let text_ckpt = Checkpoint::open(&fixture("qwen35_gva3")).unwrap();
    let e = VisionWeights::load_f32(&text_ckpt, &cfg).err().unwrap().to_string();
    assert!(e.contains("model.visual.patch_embed.proj.weight"), "{e}");

    let mut wrong = cfg.clone();
    wrong.vision.as_mut().unwrap().intermediate_size = 300;
    let e = VisionWeights::load_f32(&ckpt, &wrong).err().unwrap().to_string();
    assert!(e.contains("model.visual.blocks.0.mlp.linear_fc1.weight") && e.contains("300"), "{e}");

    let mut text = cfg.clone();
    text.vision = None;
    assert!(VisionWeights::load_f32(&ckpt, &text).unwrap().is_none(), "no tower asked for, none read");
}

#[test]
fn tensor_list_matches_the_checkpoint() {
    let dir = fixture("qwen35_vision");
    let cfg = ModelConfig::from_dir(&dir).unwrap();
    let ckpt = Checkpoint::open(&dir).unwrap();
    let listed = deltaserve_model::vision::tensor_shapes(cfg.vision.as_ref().unwrap());
    let mut stored: Vec<&str> = ckpt.names().into_iter().filter(|n| n.starts_with("model.visual.")).collect();
    stored.sort();
    let mut names: Vec<&str> = listed.iter().map(|(n, _)| n.as_str()).collect();
    names.sort();
    assert_eq!(names, stored);
    for (name, shape) in &listed {
        assert_eq!(ckpt.get(name).unwrap().shape, &shape[..], "{name}");
    }
}
