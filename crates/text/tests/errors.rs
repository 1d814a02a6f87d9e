//! Error paths: bad tokenizer files, template syntax errors, raise_exception, ids outside the
//! vocabulary, bad tokenizer_config.json fields — each an error naming its source, never a panic.

mod common;

use std::path::PathBuf;

use deltaserve_text::{ChatRequest, ChatTemplate, TextError, Tokenizer, synthetic_tokenizer_json};

fn tmp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("deltaserve-text-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn user(text: &str) -> ChatRequest {
    ChatRequest {
        messages: vec![serde_json::json!({"role": "user", "content": text})],
        add_generation_prompt: true,
        ..Default::default()
    }
}

#[test]
fn malformed_tokenizer_json() {
    assert!(matches!(Tokenizer::from_json("{not json"), Err(TextError::TokenizerLoad { .. })));
    assert!(matches!(Tokenizer::from_json(r#"{"model": {"type": "Nope"}}"#), Err(TextError::TokenizerLoad { .. })));
    let dir = tmp_dir("badtok");
    let path = dir.join("tokenizer.json");
    std::fs::write(&path, "[1, 2").unwrap();
    let err = Tokenizer::from_file(&path).unwrap_err();
    assert!(err.to_string().contains("tokenizer.json"), "{err}");
    let missing = dir.join("missing.json");
    let err = Tokenizer::from_file(&missing).unwrap_err();
    assert!(matches!(err, TextError::Io { .. }) && err.to_string().contains("missing.json"), "{err}");
    // The OS error is in the message once: not also a source() that an error chain prints again.
    assert!(err.to_string().contains("os error 2") && std::error::Error::source(&err).is_none(), "{err}");
}

#[test]
fn id_outside_vocab() {
    let tok = common::synth_tokenizer();
    let err = tok.decode(&[1, 2, 1057], false).unwrap_err();
    assert!(matches!(err, TextError::UnknownId { id: 1057, vocab_size: 1057 }), "{err}");
    assert!(tok.decode(&[1, 2, 1056], false).is_ok());
}

#[test]
fn template_syntax_error() {
    let err = ChatTemplate::new("{% if messages %}unclosed", None, None).unwrap_err();
    assert!(matches!(err, TextError::TemplateSyntax(_)), "{err}");
    let err = ChatTemplate::new("{{ messages | }}", None, None).unwrap_err();
    assert!(matches!(err, TextError::TemplateSyntax(_)), "{err}");
}

#[test]
fn raise_exception_and_render_errors() {
    let t = ChatTemplate::new("{{ raise_exception('boom: ' + messages[0].role) }}", None, None).unwrap();
    match t.render(&user("x")) {
        Err(TextError::TemplateRaised(msg)) => assert_eq!(msg, "boom: user"),
        other => panic!("expected TemplateRaised, got {other:?}"),
    }
    let t = ChatTemplate::new("{{ messages[0].content.nope.deeper }}", None, None).unwrap();
    assert!(matches!(t.render(&user("x")), Err(TextError::TemplateRender(_))));
    let t = ChatTemplate::new("{{ x | tojson(bogus=1) }}", None, None).unwrap();
    assert!(matches!(t.render(&user("x")), Err(TextError::TemplateRender(_))));
}

#[test]
fn qwen_template_rejects_string_arguments_and_bad_content() {
    let t = ChatTemplate::new(deltaserve_text::QWEN35_CHAT_TEMPLATE, None, None).unwrap();
    // Arguments given as a JSON object string are read as JSON; any other string is refused.
    let mut req = user("hi");
    req.messages.push(serde_json::json!({"role": "assistant", "content": "",
        "tool_calls": [{"function": {"name": "f", "arguments": "{\"a\": 1}"}}]}));
    assert!(t.render(&req).unwrap().contains("<parameter=a>\n1\n</parameter>"));
    req.messages[1]["tool_calls"][0]["function"]["arguments"] = serde_json::json!("a=1");
    assert!(matches!(t.render(&req), Err(TextError::TemplateRaised(m)) if m.contains("arguments")));
    let mut req = user("hi");
    req.messages[0]["content"] = serde_json::json!({"oops": 1});
    assert!(matches!(t.render(&req), Err(TextError::TemplateRaised(_))));
    let req = ChatRequest::default();
    assert!(matches!(t.render(&req), Err(TextError::TemplateRaised(_))));
}

#[test]
fn from_dir_sources_and_bad_fields() {
    // No template at all.
    let dir = tmp_dir("none");
    assert!(ChatTemplate::from_dir(&dir).unwrap().is_none());
    std::fs::write(dir.join("tokenizer_config.json"), r#"{"eos_token": "</s>"}"#).unwrap();
    assert!(ChatTemplate::from_dir(&dir).unwrap().is_none());

    // List form picks "default"; tokens given as {content: ...}.
    let dir = tmp_dir("list");
    std::fs::write(
        dir.join("tokenizer_config.json"),
        r#"{"bos_token": {"content": "<s>"}, "eos_token": "</s>",
            "chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "[{{ bos_token }}|{{ eos_token }}]"}]}"#,
    )
    .unwrap();
    let t = ChatTemplate::from_dir(&dir).unwrap().unwrap();
    assert_eq!(t.render(&user("x")).unwrap(), "[<s>|</s>]");

    // chat_template.jinja takes precedence over tokenizer_config.json.
    std::fs::write(dir.join("chat_template.jinja"), "jinja {{ eos_token }}\n").unwrap();
    let t = ChatTemplate::from_dir(&dir).unwrap().unwrap();
    assert_eq!(t.render(&user("x")).unwrap(), "jinja </s>");

    // Bad shapes name the file and the field.
    let dir = tmp_dir("bad");
    std::fs::write(dir.join("tokenizer_config.json"), r#"{"chat_template": 7}"#).unwrap();
    let err = ChatTemplate::from_dir(&dir).unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("tokenizer_config.json") && msg.contains("chat_template"), "{msg}");
    std::fs::write(dir.join("tokenizer_config.json"), r#"{"eos_token": 3, "chat_template": "x"}"#).unwrap();
    let msg = ChatTemplate::from_dir(&dir).unwrap_err().to_string();
    assert!(msg.contains("eos_token"), "{msg}");
    std::fs::write(dir.join("tokenizer_config.json"), "{oops").unwrap();
    assert!(matches!(ChatTemplate::from_dir(&dir), Err(TextError::Json { .. })));
    std::fs::write(dir.join("tokenizer_config.json"), r#"{"chat_template": [{"name": "other", "template": "x"}]}"#)
        .unwrap();
    assert!(ChatTemplate::from_dir(&dir).unwrap_err().to_string().contains("default"));
}

#[test]
fn synthetic_tokenizer_sizes() {
    assert!(matches!(synthetic_tokenizer_json(100), Err(TextError::Synthetic(_))));
    assert!(matches!(synthetic_tokenizer_json(1_000_000), Err(TextError::Synthetic(_))));
    let tok = Tokenizer::from_json(&synthetic_tokenizer_json(256).unwrap()).unwrap();
    assert_eq!(tok.vocab_size(), 256 + 33);
    // Every byte is encodable with only byte tokens.
    let ids = tok.encode("héllo 😀").unwrap();
    assert_eq!(tok.decode(&ids, false).unwrap(), "héllo 😀");
    let big = Tokenizer::from_json(&synthetic_tokenizer_json(3000).unwrap()).unwrap();
    assert_eq!(big.vocab_size(), 3033);
    assert_eq!(big.token_id("<|endoftext|>"), Some(3000));
}

#[test]
fn strftime_now_renders_a_date() {
    let t = ChatTemplate::new("{{ strftime_now('%Y-%m-%d') }}", None, None).unwrap();
    let out = t.render(&user("x")).unwrap();
    assert_eq!(out.len(), 10, "{out}");
    assert!(out.starts_with("20"), "{out}");
}
