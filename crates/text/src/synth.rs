//! Synthetic Qwen3.5-style tokenizer for test models: a deterministic byte-level BPE learned from
//! an embedded corpus, the 33 Qwen special tokens, and the matching `tokenizer_config.json`.

use std::collections::HashMap;

use serde_json::{Map, Value, json};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::{NormalizedString, OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer};

use crate::bytelevel::{base_byte_order, byte_to_char};
use crate::error::TextError;

/// The Qwen3.5/3.6 added tokens, in id order (`<|endoftext|>` first).
pub const SPECIAL_TOKENS: [&str; 33] = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
    "<|audio_start|>",
    "<|audio_end|>",
    "<tts_pad>",
    "<tts_text_bos>",
    "<tts_text_eod>",
    "<tts_text_bos_single>",
    "<|audio_pad|>",
];

/// The ids of the added tokens that Qwen marks `special: false`, `<tool_call>` to `</think>` (they survive
/// `skip_special_tokens`, so reasoning and tool-call parsers can see them in decoded text).
const NOT_SPECIAL: std::ops::Range<usize> = 14..26;

/// The Qwen3.5 pre-tokenizer split regex (marks `\p{M}` join letters).
pub const QWEN35_SPLIT_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

const CORPUS: &str = include_str!("synth_corpus.txt");

/// True if the added token is flagged special in Qwen's tokenizer files.
pub fn is_special_token(token: &str) -> bool {
    !SPECIAL_TOKENS[NOT_SPECIAL].contains(&token)
}

fn byte_level_json() -> Value {
    json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false})
}

fn pre_tokenizer_json() -> Value {
    json!({
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": QWEN35_SPLIT_REGEX}, "behavior": "Isolated", "invert": false},
            byte_level_json(),
        ]
    })
}

/// The corpus as pre-tokenized words (byte-level strings) with their counts, in first-seen order.
fn corpus_words() -> Result<Vec<(String, u64)>, TextError> {
    let pre: PreTokenizerWrapper = serde_json::from_value(pre_tokenizer_json())
        .map_err(|e| TextError::Synthetic(format!("pre_tokenizer JSON: {e}")))?;
    let mut normalized = NormalizedString::from(CORPUS);
    normalized.nfc();
    let mut pts = PreTokenizedString::from(normalized);
    pre.pre_tokenize(&mut pts).map_err(|e| TextError::Synthetic(format!("pre-tokenizing the corpus: {e}")))?;
    let mut index: HashMap<String, usize> = HashMap::new();
    let mut words: Vec<(String, u64)> = Vec::new();
    for (piece, _, _) in pts.get_splits(OffsetReferential::Original, OffsetType::Byte) {
        match index.get(piece) {
            Some(&i) => words[i].1 += 1,
            None => {
                index.insert(piece.to_string(), words.len());
                words.push((piece.to_string(), 1));
            }
        }
    }
    Ok(words)
}

/// Learns merges until the vocabulary has `mergeable` tokens. Returns (vocab by id, merges).
/// A learned vocabulary (token strings by id) and its merges in rank order.
type Learned = (Vec<String>, Vec<(String, String)>);

fn learn_bpe(mergeable: usize) -> Result<Learned, TextError> {
    if mergeable < 256 {
        return Err(TextError::Synthetic(format!(
            "mergeable = {mergeable}, but the 256 byte tokens alone need at least 256"
        )));
    }
    let table = byte_to_char();
    let mut vocab: Vec<String> = base_byte_order().iter().map(|&b| table[b as usize].to_string()).collect();
    let mut ids: HashMap<String, u32> = vocab.iter().enumerate().map(|(i, t)| (t.clone(), i as u32)).collect();
    let mut words: Vec<(Vec<u32>, u64)> = Vec::new();
    for (w, count) in corpus_words()? {
        let symbols: Option<Vec<u32>> = w.chars().map(|c| ids.get(&c.to_string()).copied()).collect();
        let symbols = symbols
            .ok_or_else(|| TextError::Synthetic(format!("corpus word {w:?} has a char outside the byte alphabet")))?;
        words.push((symbols, count));
    }
    let mut merges = Vec::new();
    while vocab.len() < mergeable {
        let mut counts: HashMap<(u32, u32), u64> = HashMap::new();
        for (symbols, count) in &words {
            for pair in symbols.windows(2) {
                *counts.entry((pair[0], pair[1])).or_insert(0) += count;
            }
        }
        // Most frequent pair; ties go to the smallest (left, right) ids, so training is deterministic.
        let best = counts.into_iter().max_by(|a, b| a.1.cmp(&b.1).then_with(|| b.0.cmp(&a.0))).map(|(pair, _)| pair);
        let Some((left, right)) = best else {
            extend_with_ascii_pairs(&mut vocab, &mut ids, &mut merges, mergeable)?;
            break;
        };
        let merged = format!("{}{}", vocab[left as usize], vocab[right as usize]);
        let new_id = match ids.get(&merged) {
            Some(&id) => id,
            None => {
                let id = vocab.len() as u32;
                ids.insert(merged.clone(), id);
                vocab.push(merged);
                id
            }
        };
        merges.push((vocab[left as usize].clone(), vocab[right as usize].clone()));
        for (symbols, _) in &mut words {
            if symbols.len() < 2 {
                continue;
            }
            let mut out = Vec::with_capacity(symbols.len());
            let mut i = 0;
            while i < symbols.len() {
                if i + 1 < symbols.len() && symbols[i] == left && symbols[i + 1] == right {
                    out.push(new_id);
                    i += 2;
                } else {
                    out.push(symbols[i]);
                    i += 1;
                }
            }
            *symbols = out;
        }
    }
    Ok((vocab, merges))
}

/// Once the corpus has no pair left, adds merges of two printable ASCII byte tokens ("aa", "ab",
/// ...) in a fixed order until the vocabulary is full, so any size up to ~11k can be built.
fn extend_with_ascii_pairs(
    vocab: &mut Vec<String>,
    ids: &mut HashMap<String, u32>,
    merges: &mut Vec<(String, String)>,
    mergeable: usize,
) -> Result<(), TextError> {
    let ascii: Vec<String> = (b'!'..=b'~').map(|b| (b as char).to_string()).collect();
    for left in &ascii {
        for right in &ascii {
            if vocab.len() >= mergeable {
                return Ok(());
            }
            let merged = format!("{left}{right}");
            if ids.contains_key(&merged) {
                continue;
            }
            ids.insert(merged.clone(), vocab.len() as u32);
            vocab.push(merged);
            merges.push((left.clone(), right.clone()));
        }
    }
    if vocab.len() >= mergeable {
        return Ok(());
    }
    Err(TextError::Synthetic(format!("at most {} mergeable tokens can be built, {mergeable} requested", vocab.len())))
}

/// A deterministic byte-level BPE `tokenizer.json` with `mergeable` model tokens (ids
/// `0..mergeable`) and the 33 Qwen added tokens (ids `mergeable..mergeable + 33`).
pub fn synthetic_tokenizer_json(mergeable: usize) -> Result<String, TextError> {
    let (vocab, merges) = learn_bpe(mergeable)?;
    let mut vocab_json = Map::new();
    for (id, tok) in vocab.iter().enumerate() {
        vocab_json.insert(tok.clone(), json!(id));
    }
    let merges_json: Vec<Value> = merges.iter().map(|(a, b)| json!([a, b])).collect();
    let added: Vec<Value> = SPECIAL_TOKENS
        .iter()
        .enumerate()
        .map(|(i, tok)| {
            json!({
                "id": mergeable + i,
                "content": tok,
                "single_word": false,
                "lstrip": false,
                "rstrip": false,
                "normalized": false,
                "special": is_special_token(tok),
            })
        })
        .collect();
    let doc = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": pre_tokenizer_json(),
        "post_processor": byte_level_json(),
        "decoder": byte_level_json(),
        "model": {
            "type": "BPE",
            "dropout": null,
            "unk_token": null,
            "continuing_subword_prefix": "",
            "end_of_word_suffix": "",
            "fuse_unk": false,
            "byte_fallback": false,
            "ignore_merges": false,
            "vocab": vocab_json,
            "merges": merges_json,
        }
    });
    serde_json::to_string_pretty(&doc).map_err(|e| TextError::Synthetic(format!("serialising tokenizer.json: {e}")))
}

/// `tokenizer_config.json` for synthetic models: Qwen2Tokenizer class, our Qwen3.5-format chat
/// template, eos `<|im_end|>`, pad `<|endoftext|>`, no bos. It has no `added_tokens_decoder`
/// (its keys are ids, which depend on the vocabulary size); transformers then takes the added
/// tokens and their `special` flags from tokenizer.json. Use
/// [`synthetic_tokenizer_config_json_for`] to include it.
pub fn synthetic_tokenizer_config_json() -> String {
    config_json(None)
}

/// Like [`synthetic_tokenizer_config_json`], plus `added_tokens_decoder` for the 33 specials at
/// ids `mergeable..mergeable + 33` (matching [`synthetic_tokenizer_json`]`(mergeable)`).
pub fn synthetic_tokenizer_config_json_for(mergeable: usize) -> String {
    config_json(Some(mergeable))
}

fn config_json(mergeable: Option<usize>) -> String {
    let mut decoder = Map::new();
    for (i, tok) in SPECIAL_TOKENS.iter().enumerate() {
        let Some(base) = mergeable else { break };
        decoder.insert(
            (base + i).to_string(),
            json!({
                "content": tok,
                "lstrip": false,
                "normalized": false,
                "rstrip": false,
                "single_word": false,
                "special": is_special_token(tok),
            }),
        );
    }
    let mut doc = json!({
        "add_bos_token": false,
        "add_prefix_space": false,
        "bos_token": null,
        "chat_template": crate::QWEN35_CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": false,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 262144,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": false,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": null,
    });
    if let (Some(_), Some(obj)) = (mergeable, doc.as_object_mut()) {
        obj.insert("added_tokens_decoder".into(), Value::Object(decoder));
    }
    serde_json::to_string_pretty(&doc).unwrap_or_default()
}
