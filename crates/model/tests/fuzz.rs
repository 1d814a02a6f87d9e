//! Parsers never panic: arbitrary bytes as a safetensors file, mutated safetensors headers, and
//! arbitrary or mutated config.json text all give a value or an error.

use deltaserve_model::synth::Preset;
use deltaserve_model::{Checkpoint, ModelConfig};
use proptest::prelude::*;

fn open_bytes(bytes: &[u8], tag: &str) -> Result<Checkpoint, String> {
    let dir = std::env::temp_dir().join(format!("ds-fuzz-{}-{tag}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("model.safetensors"), bytes).unwrap();
    Checkpoint::open(&dir).map_err(|e| e.to_string())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_bytes_are_never_a_panic(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        let _ = open_bytes(&bytes, "raw");
    }

    #[test]
    fn mutated_headers_are_never_a_panic(
        len in 0u64..200,
        header in "\\{\"[a-z]{1,4}\":\\{\"dtype\":\"(BF16|F32|I64|XX)\",\"shape\":\\[[0-9]{1,3}(,[0-9]{1,3})?\\],\"data_offsets\":\\[[0-9]{1,3},[0-9]{1,3}\\]\\}\\}",
        tail in prop::collection::vec(any::<u8>(), 0..64),
    ) {
        let mut bytes = len.to_le_bytes().to_vec();
        bytes.extend(header.as_bytes());
        bytes.extend(tail);
        if let Ok(ck) = open_bytes(&bytes, "hdr") {
            for name in ck.names().iter().map(|s| s.to_string()).collect::<Vec<_>>() {
                let _ = ck.get(&name).and_then(|t| t.to_f32());
            }
        }
    }

    #[test]
    fn arbitrary_config_text_is_never_a_panic(text in ".{0,200}") {
        let _ = ModelConfig::from_json_str(&text);
    }

    #[test]
    fn mutated_configs_are_never_a_panic(
        field in prop::sample::select(vec![
            "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
            "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
            "linear_conv_kernel_dim", "vocab_size", "rms_norm_eps", "layer_types", "rope_parameters",
            "partial_rotary_factor", "eos_token_id", "tie_word_embeddings", "intermediate_size",
        ]),
        value in prop_oneof![
            Just(serde_json::json!(null)), Just(serde_json::json!(0)), Just(serde_json::json!(-1)),
            Just(serde_json::json!(1e300)), Just(serde_json::json!("x")), Just(serde_json::json!([])),
            Just(serde_json::json!({})), Just(serde_json::json!(u64::MAX)), Just(serde_json::json!(3)),
        ],
    ) {
        let mut c = Preset::Tiny.config_json(None);
        c["text_config"][field] = value.clone();
        let _ = ModelConfig::from_json_str(&c.to_string());
        // without layer_types, the layer count alone decides the layout
        c["text_config"].as_object_mut().unwrap().remove("layer_types");
        let _ = ModelConfig::from_json_str(&c.to_string());
    }
}
