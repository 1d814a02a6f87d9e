//! What a request cost, as llama.cpp's server reports it: the `timings` object of a response (its
//! field names, so that clients written for llama-server read it) and the `prompt_progress` of a
//! streamed response that asked for it (`return_progress`). Both OpenAI endpoints use them.

use deltaserve_engine::{Timing, Usage};
use serde_json::{Value, json};

/// `n` per second over `ms` (0 when no time passed).
fn per_second(n: u64, ms: f64) -> f64 {
    if ms > 0.0 { n as f64 * 1e3 / ms } else { 0.0 }
}

/// Milliseconds per one of `n` (0 for none).
fn per_token(ms: f64, n: u64) -> f64 {
    if n > 0 { ms / n as f64 } else { 0.0 }
}

/// The `timings` of one choice:
/// - `cache_n`: prompt tokens restored from the prefix cache; `prompt_n`: the prompt tokens computed;
///   `prompt_ms`: from the request's admission to its first token (the prompt's steps and the first
///   token's pick), with `prompt_per_token_ms` and `prompt_per_second` over `prompt_n`;
/// - `predicted_n`: generated tokens; `predicted_ms`: from the first token to the last, with
///   `predicted_per_token_ms` and `predicted_per_second` over the tokens after the first (the first
///   token's time is the prompt's);
/// - `draft_n` / `draft_n_accepted` (with speculative decoding only): tokens the draft head proposed
///   and how many the verify accepted;
/// - deltaserve's own: `queue_ms` (arrival → admission), `prefill_steps` and `prefill_step_ms` (the
///   engine steps that ran the prompt and their compute: the rest of `prompt_ms` is the engine's own
///   work between steps), `preemptions`.
pub fn timings_json(u: &Usage, t: &Timing) -> Value {
    let prompt_n = u.prompt_tokens.saturating_sub(u.cached_tokens) as u64;
    let prompt_ms = (t.ttft_ms - t.queue_ms).max(0.0);
    let predicted_n = u.completion_tokens as u64;
    let predicted_ms = (t.total_ms - t.ttft_ms).max(0.0);
    let after_first = predicted_n.saturating_sub(1);
    let mut v = json!({
        "cache_n": u.cached_tokens,
        "prompt_n": prompt_n,
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": per_token(prompt_ms, prompt_n),
        "prompt_per_second": per_second(prompt_n, prompt_ms),
        "predicted_n": predicted_n,
        "predicted_ms": predicted_ms,
        "predicted_per_token_ms": per_token(predicted_ms, after_first),
        "predicted_per_second": per_second(after_first, predicted_ms),
        "queue_ms": t.queue_ms,
        "prefill_steps": t.prefill_steps,
        "prefill_step_ms": t.prefill_step_ms,
        "preemptions": t.preemptions,
    });
    if t.draft_tokens > 0 {
        v["draft_n"] = json!(t.draft_tokens);
        v["draft_n_accepted"] = json!(t.accepted_tokens);
    }
    v
}

/// A streamed response's `prompt_progress`: `processed` of the prompt's `total` tokens are in the
/// context (`cache` of them restored from the prefix cache), `time_ms` after the request's admission.
pub fn progress_json(processed: usize, total: usize, cached: usize, elapsed_ms: f64) -> Value {
    json!({"total": total, "cache": cached, "processed": processed, "time_ms": elapsed_ms})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timings_split_the_prompt_from_the_generation() {
        let u = Usage { prompt_tokens: 1000, completion_tokens: 11, cached_tokens: 900 };
        let t = Timing {
            queue_ms: 5.0,
            ttft_ms: 55.0,
            total_ms: 155.0,
            prefill_steps: 1,
            prefill_step_ms: 40.0,
            ..Timing::default()
        };
        let v = timings_json(&u, &t);
        assert_eq!(v["cache_n"], 900);
        assert_eq!(v["prompt_n"], 100);
        assert_eq!(v["prompt_ms"], 50.0);
        assert_eq!(v["prompt_per_token_ms"], 0.5);
        assert_eq!(v["prompt_per_second"], 2000.0);
        assert_eq!(v["predicted_n"], 11);
        assert_eq!(v["predicted_ms"], 100.0);
        assert_eq!(v["predicted_per_token_ms"], 10.0);
        assert_eq!(v["predicted_per_second"], 100.0);
        assert_eq!(v["queue_ms"], 5.0);
        assert_eq!(v["prefill_steps"], 1);
        assert_eq!(v["prefill_step_ms"], 40.0);
        assert!(v.get("draft_n").is_none(), "no speculation, no draft counts: {v}");
    }

    #[test]
    fn timings_of_one_token_and_of_speculation_stay_finite() {
        let u = Usage { prompt_tokens: 4, completion_tokens: 1, cached_tokens: 4 };
        let t = Timing { ttft_ms: 3.0, total_ms: 3.0, draft_tokens: 6, accepted_tokens: 4, ..Timing::default() };
        let v = timings_json(&u, &t);
        assert_eq!(v["prompt_n"], 0);
        assert_eq!(v["prompt_per_token_ms"], 0.0);
        assert_eq!(v["prompt_per_second"], 0.0);
        assert_eq!(v["predicted_per_second"], 0.0);
        assert_eq!(v["draft_n"], 6);
        assert_eq!(v["draft_n_accepted"], 4);
    }

    #[test]
    fn progress_uses_llama_servers_names() {
        let v = progress_json(512, 2048, 256, 12.5);
        assert_eq!(v, json!({"total": 2048, "cache": 256, "processed": 512, "time_ms": 12.5}));
    }
}
