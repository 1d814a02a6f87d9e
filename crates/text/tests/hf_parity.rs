//! Parity with HF transformers/tokenizers: renders, ids and decodes recorded by
//! scripts/text_fixtures.py must be reproduced byte for byte.

mod common;

use deltaserve_text::{
    ChatRequest, ChatTemplate, TextError, synthetic_tokenizer_config_json_for, synthetic_tokenizer_json,
};
use serde_json::Value;

fn request(case: &Value) -> ChatRequest {
    ChatRequest {
        messages: case["messages"].as_array().expect("messages").clone(),
        tools: case["tools"].as_array().cloned(),
        add_generation_prompt: case["add_generation_prompt"].as_bool().expect("add_generation_prompt"),
        kwargs: case.get("kwargs").and_then(|k| k.as_object()).cloned().unwrap_or_default(),
    }
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().expect("ids array").iter().map(|x| x.as_u64().expect("id") as u32).collect()
}

#[test]
fn synthetic_files_are_deterministic_and_match_fixture() {
    let dir = common::synth_dir();
    let on_disk = std::fs::read_to_string(dir.join("tokenizer.json")).unwrap();
    assert_eq!(synthetic_tokenizer_json(1024).unwrap(), on_disk);
    let cfg = std::fs::read_to_string(dir.join("tokenizer_config.json")).unwrap();
    assert_eq!(synthetic_tokenizer_config_json_for(1024), cfg);
}

#[test]
fn conversations_render_byte_identical_and_encode_identically() {
    let fx = common::fixtures();
    let tok = common::synth_tokenizer();
    let tmpl = ChatTemplate::from_dir(&common::synth_dir()).unwrap().expect("template in dir");
    let convs = fx["conversations"].as_array().unwrap();
    assert!(convs.len() >= 12);
    for case in convs {
        let name = case["name"].as_str().unwrap();
        let text = tmpl.render(&request(case)).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(text, case["text"].as_str().unwrap(), "render of {name}");
        assert_eq!(tok.encode(&text).unwrap(), ids(&case["ids"]), "ids of {name}");
        // Decoding keeps specials as text; re-encoding the decode (NFC-normalised) is stable.
        let decoded = tok.decode(&ids(&case["ids"]), false).unwrap();
        assert_eq!(tok.encode(&decoded).unwrap(), ids(&case["ids"]), "re-encode of {name}");
    }
}

#[test]
fn raise_exception_cases_match_hf_messages() {
    let fx = common::fixtures();
    let tmpl = ChatTemplate::from_dir(&common::synth_dir()).unwrap().unwrap();
    for case in fx["errors"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        match tmpl.render(&request(case)) {
            Err(TextError::TemplateRaised(msg)) => {
                assert_eq!(msg, case["message"].as_str().unwrap(), "{name}")
            }
            other => panic!("{name}: expected TemplateRaised, got {other:?}"),
        }
    }
}

#[test]
fn environment_features_match_jinja2() {
    let fx = common::fixtures();
    for case in fx["env_cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let tmpl = ChatTemplate::new(case["template"].as_str().unwrap(), None, Some("<|im_end|>".into()))
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let mut req = request(case);
        // transformers passes every set special token; the synthetic config sets pad_token too.
        req.kwargs.insert("pad_token".into(), "<|endoftext|>".into());
        let text = tmpl.render(&req).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(text, case["text"].as_str().unwrap(), "env case {name}");
    }
}

#[test]
fn raw_strings_encode_and_decode_like_tokenizers() {
    let fx = common::fixtures();
    let tok = common::synth_tokenizer();
    let strings = fx["strings"].as_array().unwrap();
    assert!(strings.len() >= 15);
    for case in strings {
        let text = case["text"].as_str().unwrap();
        let want = ids(&case["ids"]);
        assert_eq!(tok.encode(text).unwrap(), want, "ids of {text:?}");
        let tokens: Vec<String> = want.iter().map(|&i| tok.id_to_token(i).unwrap()).collect();
        let want_tokens: Vec<&str> = case["tokens"].as_array().unwrap().iter().map(|t| t.as_str().unwrap()).collect();
        assert_eq!(tokens, want_tokens, "tokens of {text:?}");
        assert_eq!(tok.decode(&want, false).unwrap(), case["decoded"].as_str().unwrap());
        assert_eq!(tok.decode(&want, true).unwrap(), case["decoded_skip_special"].as_str().unwrap());
    }
}

#[test]
fn vocab_and_special_ids() {
    let tok = common::synth_tokenizer();
    assert_eq!(tok.vocab_size(), 1024 + 33);
    for (i, s) in deltaserve_text::SPECIAL_TOKENS.iter().enumerate() {
        assert_eq!(tok.token_id(s), Some(1024 + i as u32), "{s}");
        assert_eq!(tok.id_to_token(1024 + i as u32).as_deref(), Some(*s));
    }
    assert_eq!(tok.token_id("<|im_end|>"), Some(1026));
    // `<think>` is not special (kept by skip_special); `<|im_end|>` is.
    let ids = tok.encode("<think>x</think><|im_end|>").unwrap();
    assert_eq!(tok.decode(&ids, true).unwrap(), "<think>x</think>");
    assert_eq!(tok.id_to_token(1057), None);
}
