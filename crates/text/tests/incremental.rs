//! Streaming detokenisation: pieces are always valid UTF-8, never cut a character, and
//! concatenate to the full decode — for text-derived and random id streams.

mod common;

use common::Rng;
use deltaserve_text::{IncrementalDecoder, TextError, Tokenizer};

fn stream(tok: &Tokenizer, ids: &[u32], skip_special: bool) -> (Vec<String>, String) {
    let mut dec = IncrementalDecoder::new(skip_special);
    let mut pieces: Vec<String> = ids.iter().map(|&id| dec.push(tok, id).unwrap()).collect();
    pieces.push(dec.finish(tok).unwrap());
    let joined = pieces.concat();
    (pieces, joined)
}

#[test]
fn multibyte_chars_split_across_tokens_are_held_back() {
    let tok = common::synth_tokenizer();
    let text = "Zürich 北京 😀🦀 नमस्ते 👩‍💻 ok<think>\n思考\n</think>\n\n<|im_end|>";
    let ids = tok.encode(text).unwrap();
    // The small vocabulary must split some character over several tokens for this test to bite.
    let split = ids.iter().any(|&id| std::str::from_utf8(&token_raw_bytes(&tok, id)).is_err());
    assert!(split, "expected a token holding a partial UTF-8 sequence");
    for skip in [false, true] {
        let (pieces, joined) = stream(&tok, &ids, skip);
        assert_eq!(joined, tok.decode(&ids, skip).unwrap());
        assert!(pieces.iter().all(|p| !p.contains('\u{fffd}')), "no replacement chars: {pieces:?}");
        assert!(pieces.iter().any(|p| p.is_empty()), "some pushes must hold bytes back");
    }
    let (_, skipped) = stream(&tok, &ids, true);
    assert!(skipped.ends_with("</think>\n\n"), "<|im_end|> is special and skipped: {skipped:?}");
}

/// Raw bytes of one token through the GPT-2 byte alphabet (test-side reimplementation).
fn token_raw_bytes(tok: &Tokenizer, id: u32) -> Vec<u8> {
    let s = tok.id_to_token(id).unwrap();
    let mut map = std::collections::HashMap::new();
    let mut extra = 256u32;
    for b in 0u32..256 {
        let printable = (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || (0xae..=0xff).contains(&b);
        let c = if printable {
            b
        } else {
            extra += 1;
            extra - 1
        };
        map.insert(char::from_u32(c).unwrap(), b as u8);
    }
    s.chars().map(|c| map.get(&c).copied().unwrap_or(b'?')).collect()
}

#[test]
fn random_streams_concatenate_to_full_decode() {
    let tok = common::synth_tokenizer();
    let vocab = tok.vocab_size();
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let samples = ["héllo wörld", "你好世界", "🚀🎉❤️", "a\u{0303}b", "Ελληνικά", "mixed 中文 and emoji 😀!"];
    for round in 0..300 {
        let ids: Vec<u32> = if round % 2 == 0 {
            // Concatenated encodings of multibyte samples, cut at a random point.
            let mut ids = Vec::new();
            for _ in 0..4 {
                ids.extend(tok.encode(samples[rng.below(samples.len())]).unwrap());
            }
            let cut = rng.below(ids.len() + 1);
            ids.truncate(cut);
            ids
        } else {
            // Arbitrary ids: may form invalid UTF-8, which must come out as U+FFFD like decode.
            (0..rng.below(40)).map(|_| rng.below(vocab) as u32).collect()
        };
        for skip in [false, true] {
            let (_, joined) = stream(&tok, &ids, skip);
            assert_eq!(joined, tok.decode(&ids, skip).unwrap(), "ids {ids:?} skip {skip}");
        }
    }
}

#[test]
fn unknown_id_is_an_error() {
    let tok = common::synth_tokenizer();
    let mut dec = IncrementalDecoder::new(false);
    match dec.push(&tok, 5000) {
        Err(TextError::UnknownId { id: 5000, vocab_size: 1057 }) => {}
        other => panic!("expected UnknownId, got {other:?}"),
    }
}
