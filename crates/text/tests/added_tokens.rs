//! Added tokens listed only in `tokenizer_config.json`'s `added_tokens_decoder` are merged into the
//! tokenizer as transformers merges them. The layout is the real Qwen3.5/3.6 one: 248,044 mergeable
//! tokens, then the added tokens, of which the last seven (audio / TTS, 248070–248076) appear only
//! in the config.

mod common;

use deltaserve_text::{SPECIAL_TOKENS, TextError, Tokenizer};
use serde_json::{Value, json};

const MERGEABLE: usize = 248_044;
const CONFIG_ONLY: usize = 7;

fn tmp_dir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("deltaserve-text-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A directory holding the fixture tokenizer re-laid to Qwen3.6's ids: the vocabulary padded to
/// 248,044 entries, the added tokens after it, the last seven listed in the config only.
fn qwen36_layout_dir() -> std::path::PathBuf {
    let text = std::fs::read_to_string(common::synth_dir().join("tokenizer.json")).unwrap();
    let mut tok: Value = serde_json::from_str(&text).unwrap();
    let vocab = tok["model"]["vocab"].as_object_mut().unwrap();
    for id in vocab.len()..MERGEABLE {
        vocab.insert(format!("<filler_{id}>"), json!(id));
    }
    let added = tok["added_tokens"].as_array_mut().unwrap();
    assert_eq!(added.len(), SPECIAL_TOKENS.len());
    let mut decoder = serde_json::Map::new();
    for (i, entry) in added.iter_mut().enumerate() {
        entry["id"] = json!(MERGEABLE + i);
        decoder.insert((MERGEABLE + i).to_string(), entry.clone());
    }
    added.truncate(SPECIAL_TOKENS.len() - CONFIG_ONLY);
    let dir = tmp_dir("qwen36-added");
    std::fs::write(dir.join("tokenizer.json"), tok.to_string()).unwrap();
    std::fs::write(dir.join("tokenizer_config.json"), json!({"added_tokens_decoder": decoder}).to_string()).unwrap();
    dir
}

#[test]
fn config_only_added_tokens_are_merged_with_their_ids() {
    let dir = qwen36_layout_dir();
    let bare = Tokenizer::from_json(&std::fs::read_to_string(dir.join("tokenizer.json")).unwrap()).unwrap();
    // tokenizer.json alone does not know them: `<tts_pad>` is split into pieces, 248072 is unknown.
    assert!(bare.encode("<tts_pad>").unwrap().len() > 1);
    assert!(bare.decode(&[248_072], false).is_err());

    let tok = Tokenizer::from_file(&dir.join("tokenizer.json")).unwrap();
    assert_eq!(tok.vocab_size(), 248_077);
    assert_eq!(tok.token_id("<|audio_start|>"), Some(248_070));
    assert_eq!(tok.token_id("<tts_pad>"), Some(248_072));
    assert_eq!(tok.token_id("<|audio_pad|>"), Some(248_076));
    let plain = tok.encode("<|im_start|>user\n<|im_end|>").unwrap().len();
    assert_eq!(tok.encode("<|im_start|>user\n<tts_pad><|im_end|>").unwrap().len(), plain + 1);
    assert_eq!(tok.encode("<tts_pad>").unwrap(), vec![248_072]);
    assert_eq!(tok.decode(&[248_072], false).unwrap(), "<tts_pad>");
    // Flagged special in the config: skipped like the other specials.
    assert_eq!(tok.decode(&[248_072], true).unwrap(), "");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn malformed_added_tokens_decoder_names_the_field() {
    let dir = tmp_dir("bad-added");
    std::fs::copy(common::synth_dir().join("tokenizer.json"), dir.join("tokenizer.json")).unwrap();
    std::fs::write(dir.join("tokenizer_config.json"), r#"{"added_tokens_decoder": {"x": {"content": "<a>"}}}"#)
        .unwrap();
    let err = Tokenizer::from_file(&dir.join("tokenizer.json")).unwrap_err();
    assert!(matches!(err, TextError::ConfigField { .. }) && err.to_string().contains("added_tokens_decoder"), "{err}");
    let _ = std::fs::remove_dir_all(dir);
}
