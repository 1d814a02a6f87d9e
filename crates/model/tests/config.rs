//! config.json parsing: the model types (dense and mixture-of-experts), derived dims, and clear errors for
//! bad input.

use deltaserve_model::synth::Preset;
use deltaserve_model::{Arch, LayerKind, ModelConfig, ModelError};
use serde_json::{Value, json};

fn parse(v: &Value) -> Result<ModelConfig, ModelError> {
    ModelConfig::from_json_str(&v.to_string())
}

fn err(v: &Value) -> String {
    parse(v).expect_err("expected an error").to_string()
}

#[test]
fn the_27b_preset_has_the_documented_shape() {
    let cfg = parse(&Preset::Qwen36_27b.config_json(None)).unwrap();
    let d = cfg.dims();
    assert_eq!(cfg.arch, Arch::Qwen35);
    assert_eq!((d.hidden, d.num_layers, d.num_attention_layers, d.num_deltanet_layers), (5120, 64, 16, 48));
    assert_eq!((d.q_heads, d.kv_heads, d.head_dim, d.rotary_dim), (24, 4, 256, 64));
    assert_eq!((d.gdn_k_heads, d.gdn_v_heads, d.gdn_ratio, d.conv_channels), (16, 48, 3, 10240));
    assert_eq!(cfg.layer_types[3], LayerKind::Attention);
    assert_eq!(cfg.layer_types[4], LayerKind::DeltaNet);
    assert_eq!(d.vocab, 248_320);
}

#[test]
fn text_only_and_layer_types_from_interval() {
    let mut text = Preset::Tiny.text_config(Some(8));
    text.as_object_mut().unwrap().remove("layer_types");
    let cfg = parse(&text).unwrap();
    let kinds: Vec<bool> = cfg.layer_types.iter().map(|k| *k == LayerKind::Attention).collect();
    assert_eq!(kinds, [false, false, false, true, false, false, false, true]);
}

#[test]
fn qwen3_next_sparse_layers_follow_mlp_only_layers_and_the_sparse_step() {
    let mut c = Preset::Tiny.text_config(None);
    c["model_type"] = json!("qwen3_next");
    c["num_experts"] = json!(0);
    let cfg = parse(&c).unwrap();
    assert_eq!((cfg.arch, cfg.moe), (Arch::Qwen3Next, None));
    c["num_experts"] = json!(8);
    c["num_experts_per_tok"] = json!(2);
    c["moe_intermediate_size"] = json!(32);
    c["shared_expert_intermediate_size"] = json!(48);
    let m = parse(&c).unwrap().moe.unwrap();
    assert_eq!((m.num_experts, m.top_k, m.expert_intermediate, m.shared_expert_intermediate), (8, 2, 32, 48));
    assert!(m.norm_topk_prob, "HF's default");
    assert_eq!(m.sparse_layers, [true; 4]);
    c["mlp_only_layers"] = json!([1]);
    c["decoder_sparse_step"] = json!(2);
    c["norm_topk_prob"] = json!(false);
    let m = parse(&c).unwrap().moe.unwrap();
    assert_eq!(m.sparse_layers, [false, false, false, true]);
    assert!(!m.norm_topk_prob);
    c["mlp_only_layers"] = json!([0, 1, 2, 3]);
    assert_eq!(parse(&c).unwrap().moe, None, "all layers dense via mlp_only_layers");
}

#[test]
fn qwen3_5_moe_has_experts_in_every_layer() {
    let mut c = Preset::Tiny.config_json(None);
    c["model_type"] = json!("qwen3_5_moe");
    let t = c["text_config"].as_object_mut().unwrap();
    t.insert("model_type".into(), json!("qwen3_5_moe_text"));
    t.remove("intermediate_size");
    for (k, v) in [("num_experts", 16), ("num_experts_per_tok", 4), ("moe_intermediate_size", 64)] {
        t.insert(k.into(), json!(v));
    }
    t.insert("shared_expert_intermediate_size".into(), json!(96));
    let cfg = parse(&c).unwrap();
    let m = cfg.moe.as_ref().unwrap();
    assert_eq!((m.num_experts, m.top_k, m.num_sparse_layers()), (16, 4, 4));
    assert!(m.norm_topk_prob);
    assert_eq!(cfg.intermediate_size, 96, "no dense layer: the shared expert's width");
    // Text-only form.
    let mut text = c["text_config"].clone();
    text["mlp_only_layers"] = json!([]);
    assert_eq!(parse(&text).unwrap().moe, cfg.moe);
    // Fields HF's qwen3_5_moe ignores are refused rather than silently dropped.
    for (field, v) in
        [("mlp_only_layers", json!([0])), ("decoder_sparse_step", json!(2)), ("norm_topk_prob", json!(false))]
    {
        let mut bad = text.clone();
        bad[field] = v;
        let e = err(&bad);
        assert!(e.contains(field) && e.contains("every layer"), "{field}: {e}");
    }
}

#[test]
fn bad_and_unimplemented_experts_are_named() {
    let mut c = Preset::Tiny.text_config(None);
    c["model_type"] = json!("qwen3_5_moe_text");
    for (k, v) in [("num_experts", 8), ("num_experts_per_tok", 2), ("moe_intermediate_size", 32)] {
        c[k] = json!(v);
    }
    c["shared_expert_intermediate_size"] = json!(32);
    assert!(parse(&c).is_ok());
    let cases = [
        ("num_experts_per_tok", json!(9), "between 1 and `num_experts` (8)"),
        ("num_experts_per_tok", json!(0), "between 1"),
        ("moe_intermediate_size", json!(0), "moe_intermediate_size"),
        ("num_experts", json!(0), "must be > 0"),
        ("scoring_func", json!("sigmoid"), "only softmax routing"),
        ("routed_scaling_factor", json!(2.5), "scaled routed experts"),
        ("n_group", json!(8), "grouped routing"),
    ];
    for (field, v, want) in cases {
        let mut bad = c.clone();
        bad[field] = v;
        let e = err(&bad);
        assert!(e.contains(field) && e.contains(want), "{field}: {e}");
    }
    let mut bad = c.clone();
    bad.as_object_mut().unwrap().remove("num_experts_per_tok");
    assert!(err(&bad).contains("missing field `num_experts_per_tok`"));
    let mut next = c.clone();
    next["model_type"] = json!("qwen3_next");
    next["mlp_only_layers"] = json!([7]);
    assert!(err(&next).contains("`mlp_only_layers` entry 7 is not a decoder layer"));
    next["mlp_only_layers"] = json!([]);
    next["decoder_sparse_step"] = json!(0);
    assert!(err(&next).contains("decoder_sparse_step"));
    let mut dense35 = c.clone();
    dense35["model_type"] = json!("qwen3_5_text");
    assert!(err(&dense35).contains("use model_type qwen3_5_moe"));
    let e = err(&json!({"model_type": "qwen3_moe"}));
    assert!(e.contains("qwen3_moe") && e.contains("hybrid"), "{e}");
}

#[test]
fn missing_and_mistyped_fields_are_named() {
    for field in ["hidden_size", "linear_num_value_heads", "rms_norm_eps", "num_hidden_layers"] {
        let mut c = Preset::Tiny.config_json(None);
        c["text_config"].as_object_mut().unwrap().remove(field);
        let e = err(&c);
        assert!(e.contains(&format!("text_config.{field}")), "{field}: {e}");
    }
    let mut c = Preset::Tiny.text_config(None);
    c["hidden_size"] = json!("big");
    assert!(err(&c).contains("hidden_size"));
}

#[test]
fn inconsistent_fields_are_errors() {
    let cases: Vec<(&str, Value, &str)> = vec![
        ("num_key_value_heads", json!(3), "multiple"),
        ("linear_num_value_heads", json!(5), "multiple"),
        ("layer_types", json!(["linear_attention"]), "layer_types"),
        ("layer_types", json!(["linear_attention", "mamba", "x", "y"]), "layer_types[1]"),
        ("eos_token_id", json!(99_999), "outside the vocabulary"),
        ("hidden_act", json!("gelu"), "hidden_act"),
        ("rope_parameters", json!({"rope_type": "yarn", "rope_theta": 1e7, "factor": 4.0}), "yarn"),
        ("partial_rotary_factor", json!(0.3), "rotary"),
    ];
    for (field, value, needle) in cases {
        let mut c = Preset::Tiny.text_config(None);
        c[field] = value;
        if field == "partial_rotary_factor" {
            c["rope_parameters"]["partial_rotary_factor"] = json!(0.3);
        }
        let e = err(&c);
        assert!(e.contains(needle), "{field}: `{e}` should mention `{needle}`");
    }
    assert!(err(&json!({"model_type": "llama"})).contains("unknown model_type"));
    assert!(err(&json!([1, 2])).contains("object"));
    assert!(ModelConfig::from_json_str("{not json").unwrap_err().to_string().contains("invalid JSON"));
}
