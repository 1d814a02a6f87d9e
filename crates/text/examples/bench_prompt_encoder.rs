//! Benchmark: tokenising a growing agent conversation every turn, whole (`Tokenizer::encode`) vs a
//! message at a time with the cache (`PromptEncoder`), as the server does for each request.
//!
//!   cargo run --release -p deltaserve-text --example bench_prompt_encoder [TARGET_TOKENS] [MERGEABLE]
//!
//! The tokenizer is the synthetic one of the 27B preset (4063 merges: about 4 bytes per token on the
//! synthetic text, like Qwen's on code); the conversation is rendered by the Qwen3.5 chat template:
//! a system prompt, then turns of a user message, a tool call's result (1K-16K tokens) and a reply,
//! up to TARGET_TOKENS (default 131072). Prints, per turn, the prompt's tokens and both times, then
//! the ratio at the last turn.

use std::sync::Arc;
use std::time::Instant;

use deltaserve_text::{ChatRequest, ChatTemplate, PromptEncoder, QWEN35_CHAT_TEMPLATE, Tokenizer};
use serde_json::json;

const CORPUS: &str = include_str!("../src/synth_corpus.txt");

/// About `tokens` tokens of corpus text starting at a varying offset.
fn text(tokens: usize, seed: usize) -> String {
    let bytes = tokens * 4;
    let start = (seed * 7919) % CORPUS.len();
    let mut s: String = CORPUS.chars().cycle().skip(start).take(bytes).collect();
    s.push('\n');
    s
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let target: usize = args.next().map_or(Ok(131_072), |a| a.parse())?;
    let mergeable: usize = args.next().map_or(Ok(4063), |a| a.parse())?;
    let tok = Arc::new(Tokenizer::from_json(&deltaserve_text::synthetic_tokenizer_json(mergeable)?)?);
    let enc = PromptEncoder::new(tok.clone(), "<|im_start|>", PromptEncoder::DEFAULT_MAX_TOKENS);
    let tpl = ChatTemplate::new(QWEN35_CHAT_TEMPLATE, None, None)?;
    let mut messages = vec![json!({"role": "system", "content": text(2000, 0)})];
    println!("| turn | prompt tokens | whole encode ms | per-message encode ms | encoded tokens |");
    println!("|---|---|---|---|---|");
    let mut last = (0.0, 0.0);
    for turn in 1.. {
        messages.push(json!({"role": "user", "content": text(200 + 97 * turn % 800, turn)}));
        let req = ChatRequest {
            messages: messages.clone(),
            tools: None,
            add_generation_prompt: true,
            kwargs: Default::default(),
        };
        let prompt = tpl.render(&req)?;
        let t0 = Instant::now();
        let whole = tok.encode(&prompt)?;
        let t1 = Instant::now();
        let before = enc.stats().miss_tokens;
        let pieces = enc.encode(&prompt)?;
        let t2 = Instant::now();
        assert_eq!(whole, pieces, "turn {turn}: the per-message ids differ");
        let (a, b) = ((t1 - t0).as_secs_f64() * 1e3, (t2 - t1).as_secs_f64() * 1e3);
        println!("| {turn} | {} | {a:.1} | {b:.1} | {} |", whole.len(), enc.stats().miss_tokens - before);
        last = (a, b);
        if whole.len() >= target {
            break;
        }
        // The reply, then a tool result that the next turn's request carries.
        messages.push(json!({"role": "assistant", "content": text(150, turn + 1000)}));
        messages.push(json!({"role": "tool", "content": text(1000 + (turn * 3301) % 15000, turn + 2000)}));
    }
    println!();
    println!("last turn: whole {:.1} ms, per message {:.1} ms ({:.1}x)", last.0, last.1, last.0 / last.1.max(1e-9));
    Ok(())
}
