//! config.json parsing: the three model types, derived dims, and clear errors for bad input.

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
fn qwen3_next_dense_is_accepted_and_moe_is_refused_by_name() {
    let mut c = Preset::Tiny.text_config(None);
    c["model_type"] = json!("qwen3_next");
    c["num_experts"] = json!(0);
    assert_eq!(parse(&c).unwrap().arch, Arch::Qwen3Next);
    c["num_experts"] = json!(8);
    let e = err(&c);
    assert!(e.contains("num_experts") && e.contains("not supported yet"), "{e}");
    c["mlp_only_layers"] = json!([0, 1, 2, 3]);
    assert!(parse(&c).is_ok(), "all layers dense via mlp_only_layers");
    let e = err(&json!({"model_type": "qwen3_5_moe"}));
    assert!(e.contains("not supported yet"), "{e}");
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
