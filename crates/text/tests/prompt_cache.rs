//! `PromptEncoder` gives exactly `Tokenizer::encode`'s ids while it encodes only new messages: over
//! growing conversations rendered by the chat template, edits of earlier messages, evictions, prompts
//! without the opener, and tokenizers whose opener is not a safe split point.

mod common;

use std::sync::Arc;

use common::{Rng, synth_tokenizer};
use deltaserve_text::{ChatRequest, ChatTemplate, PromptEncoder, QWEN35_CHAT_TEMPLATE, Tokenizer};
use serde_json::{Value, json};

const OPENER: &str = "<|im_start|>";

/// Message text with what trips tokenizers at piece edges: leading / trailing whitespace and
/// newlines, digits, punctuation runs, non-ASCII, and other special tokens written in the text.
fn content(rng: &mut Rng, words: usize) -> String {
    const BITS: [&str; 14] =
        ["fn", "main()", "  ", "\n", "\n\n", "é", "日本語", "42", "x_y", "!!", "<|im_end|>", "\t", "The", " "];
    let mut s = String::new();
    for _ in 0..words {
        s.push_str(BITS[rng.below(BITS.len())]);
        if rng.below(3) == 0 {
            s.push(' ');
        }
    }
    s
}

fn render(tpl: &ChatTemplate, messages: &[Value]) -> String {
    tpl.render(&ChatRequest {
        messages: messages.to_vec(),
        tools: None,
        add_generation_prompt: true,
        kwargs: Default::default(),
    })
    .expect("template renders")
}

/// The synthetic Qwen tokenizer, an encoder over it caching up to `max_tokens`, the chat template, a
/// generator seeded with `seed`, and a conversation holding a system message of `system_words`.
fn setup(
    max_tokens: usize,
    seed: u64,
    system_words: usize,
) -> (Arc<Tokenizer>, PromptEncoder, ChatTemplate, Rng, Vec<Value>) {
    let tok = Arc::new(synth_tokenizer());
    let enc = PromptEncoder::new(tok.clone(), OPENER, max_tokens);
    assert!(enc.splits(), "the synthetic Qwen tokenizer's <|im_start|> is a safe split point");
    let tpl = ChatTemplate::new(QWEN35_CHAT_TEMPLATE, None, None).unwrap();
    let mut rng = Rng(seed);
    let messages = vec![json!({"role": "system", "content": content(&mut rng, system_words)})];
    (tok, enc, tpl, rng, messages)
}

#[test]
fn growing_conversation_encodes_only_new_messages() {
    let (tok, enc, tpl, mut rng, mut messages) = setup(PromptEncoder::DEFAULT_MAX_TOKENS, 0x5eed, 300);
    let mut last_miss = 0;
    for turn in 0..12 {
        let words = 50 + rng.below(400);
        messages.push(json!({"role": "user", "content": content(&mut rng, words)}));
        let text = render(&tpl, &messages);
        let want = tok.encode(&text).unwrap();
        let before = enc.stats();
        assert_eq!(enc.encode(&text).unwrap(), want, "turn {turn}");
        let after = enc.stats();
        let encoded = (after.miss_tokens - before.miss_tokens) as usize;
        if turn > 0 {
            // Only the new user message, the previous reply and the generation prompt are new.
            assert!(encoded * 3 < want.len() || encoded < 1500, "turn {turn}: encoded {encoded} of {}", want.len());
            assert!(after.hit_tokens > before.hit_tokens, "turn {turn}: nothing reused");
        }
        last_miss = encoded;
        let words = 20 + rng.below(100);
        messages.push(json!({"role": "assistant", "content": content(&mut rng, words)}));
    }
    assert!(last_miss > 0);
    // The same prompt again: all pieces cached.
    let text = render(&tpl, &messages);
    assert_eq!(enc.encode(&text).unwrap(), tok.encode(&text).unwrap());
    let before = enc.stats();
    assert_eq!(enc.encode(&text).unwrap(), tok.encode(&text).unwrap());
    assert_eq!(enc.stats().misses, before.misses, "an identical prompt encodes nothing");
}

#[test]
fn edits_branches_and_raw_prompts_keep_the_ids() {
    let (tok, enc, tpl, mut rng, mut messages) = setup(PromptEncoder::DEFAULT_MAX_TOKENS, 7, 80);
    for _ in 0..6 {
        messages.push(json!({"role": "user", "content": content(&mut rng, 60)}));
        messages.push(json!({"role": "assistant", "content": content(&mut rng, 30)}));
    }
    for round in 0..20 {
        // Edit an earlier message, or branch off a shorter history.
        let mut m = messages.clone();
        if round % 2 == 0 {
            let i = 1 + rng.below(m.len() - 1);
            m[i]["content"] = json!(content(&mut rng, 40));
        } else {
            m.truncate(1 + rng.below(m.len() - 1));
            m.push(json!({"role": "user", "content": content(&mut rng, 25)}));
        }
        let text = render(&tpl, &m);
        assert_eq!(enc.encode(&text).unwrap(), tok.encode(&text).unwrap(), "round {round}");
    }
    // Raw prompts: openers anywhere, back to back, at the very end, or absent.
    for raw in [
        "no opener at all, just text \n\n",
        "<|im_start|>",
        "<|im_start|><|im_start|>user\nhi<|im_end|>",
        "lead<|im_start|>  spaced <|im_start|>\n",
        "text ending in an opener<|im_start|>",
        "<|im_start|>assistant\n<think>\n\n</think>\n\n",
    ] {
        assert_eq!(enc.encode(raw).unwrap(), tok.encode(raw).unwrap(), "{raw:?}");
    }
    assert_eq!(enc.encode("").unwrap(), tok.encode("").unwrap());
}

#[test]
fn eviction_bounds_the_cache_and_keeps_the_ids() {
    let (tok, enc, tpl, mut rng, _) = setup(2000, 99, 0);
    for session in 0..8 {
        let mut messages = vec![json!({"role": "system", "content": content(&mut rng, 100)})];
        for _ in 0..5 {
            messages.push(json!({"role": "user", "content": content(&mut rng, 120)}));
            let text = render(&tpl, &messages);
            assert_eq!(enc.encode(&text).unwrap(), tok.encode(&text).unwrap(), "session {session}");
            assert!(enc.stats().tokens <= 2000, "cache above its bound: {:?}", enc.stats());
            messages.push(json!({"role": "assistant", "content": content(&mut rng, 10)}));
        }
    }
    let s = enc.stats();
    assert!(s.hits > 0 && s.misses > 0, "{s:?}");
}

#[test]
fn unsafe_or_missing_openers_fall_back_to_plain_encoding() {
    let tok = Arc::new(synth_tokenizer());
    // Not an added token: splitting there could cut a BPE word.
    let plain = PromptEncoder::new(tok.clone(), "user", PromptEncoder::DEFAULT_MAX_TOKENS);
    assert!(!plain.splits());
    let text = "<|im_start|>user\nhello user<|im_end|>";
    assert_eq!(plain.encode(text).unwrap(), tok.encode(text).unwrap());
    assert_eq!(plain.stats().misses, 0, "a plain encoder keeps no pieces");
    assert!(!PromptEncoder::new(tok.clone(), "", 100).splits());

    // An opener that strips whitespace on its left is not a safe split point.
    let mut json: Value =
        serde_json::from_str(&std::fs::read_to_string(common::synth_dir().join("tokenizer.json")).unwrap()).unwrap();
    for t in json["added_tokens"].as_array_mut().unwrap() {
        if t["content"] == OPENER {
            t["lstrip"] = json!(true);
        }
    }
    let stripping = Arc::new(Tokenizer::from_json(&json.to_string()).unwrap());
    let enc = PromptEncoder::new(stripping.clone(), OPENER, 100);
    assert!(!enc.splits());
    let text = "a  <|im_start|>b";
    assert_eq!(enc.encode(text).unwrap(), stripping.encode(text).unwrap());
}
