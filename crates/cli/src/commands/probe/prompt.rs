//! The probe's prompts of an exact token count: a nonce line, filler text (a needle placed at a depth
//! in it) and a question, fitted to a target on the server's tokenizer (`/v1/messages/count_tokens`).

use anyhow::{Result, anyhow, bail};
use serde_json::{Value, json};

use crate::http::Client;
use crate::synthetic_images::{anthropic_messages, interleave};

/// Long filler text; prompts are its prefixes behind a per-prompt nonce line.
pub(super) struct Filler {
    pub(super) text: String,
    /// Characters per token, measured on the server's tokenizer.
    pub(super) chars_per_token: f64,
}

/// What a prompt is made of: nonce, filler, needle (at a depth), question.
pub(super) struct Parts<'a> {
    pub(super) nonce: &'a str,
    pub(super) needle: Option<(&'a str, f64)>,
    pub(super) question: &'a str,
}

fn compose(filler: &str, p: &Parts) -> String {
    let mut s = String::with_capacity(filler.len() + 256);
    s.push_str(p.nonce);
    s.push('\n');
    match p.needle {
        Some((needle, depth)) => {
            let mut cut = ((filler.len() as f64) * depth) as usize;
            while !filler.is_char_boundary(cut) {
                cut -= 1;
            }
            // At a line start, so the needle is a sentence of its own.
            let cut = filler[..cut].rfind('\n').map_or(0, |i| i + 1);
            s.push_str(&filler[..cut]);
            s.push_str(needle);
            s.push('\n');
            s.push_str(&filler[cut..]);
        }
        None => s.push_str(filler),
    }
    s.push_str(p.question);
    s
}

pub(super) struct Counter<'a> {
    pub(super) client: &'a Client,
    pub(super) model: &'a str,
}

impl Counter<'_> {
    /// Prompt tokens of `messages` as the server renders them (`/v1/messages/count_tokens`).
    pub(super) async fn count(&self, messages: &[Value]) -> Result<usize> {
        let body = json!({"model": self.model, "messages": anthropic_messages(messages)});
        let v = self.client.post_json("/v1/messages/count_tokens", &body).await?;
        v["input_tokens"].as_u64().map(|n| n as usize).ok_or_else(|| anyhow!("count_tokens: no input_tokens in {v}"))
    }

    /// The content of a user message (its text with `images` among it) such that `history` + it renders to
    /// at most `target` tokens and at least `target - slack`: grows or trims the filler prefix by the
    /// measured characters per token.
    pub(super) async fn fit(
        &self,
        f: &Filler,
        history: &[Value],
        parts: &Parts<'_>,
        images: &[Value],
        target: usize,
    ) -> Result<(Value, usize)> {
        let with = |content: &Value| {
            let mut m = history.to_vec();
            m.push(json!({"role": "user", "content": content}));
            m
        };
        let empty = self.count(&with(&interleave(compose("", parts), images))).await?;
        if empty > target {
            let what = if images.is_empty() {
                String::new()
            } else {
                format!(" with this prompt's {} images and no filler", images.len())
            };
            bail!("the conversation already has {empty} tokens{what}, more than the {target} this prompt may have");
        }
        let slack = 16.max(target / 2000);
        let mut chars = (((target - empty) as f64) * f.chars_per_token) as usize;
        for _ in 0..12 {
            chars = chars.min(f.text.len());
            while !f.text.is_char_boundary(chars) {
                chars -= 1;
            }
            let content = interleave(compose(&f.text[..chars], parts), images);
            let n = self.count(&with(&content)).await?;
            if n <= target && (n + slack >= target || chars == f.text.len()) {
                return Ok((content, n));
            }
            let step = ((target as f64 - n as f64) * f.chars_per_token * 0.98) as isize;
            let step = if n > target { step.min(-1) } else { step.max(1) };
            chars = (chars as isize + step).max(0) as usize;
        }
        bail!("could not build a prompt of {target} tokens (the tokenizer's characters per token vary too much)")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn needle_lands_on_its_own_line() {
        let filler = "aaa\nbbb\nccc\nddd\n";
        let p = Parts { nonce: "N", needle: Some(("NEEDLE", 0.5)), question: "?" };
        let s = compose(filler, &p);
        assert!(s.starts_with("N\n") && s.ends_with('?'));
        assert!(s.contains("\nNEEDLE\n"), "{s}");
        let p = Parts { nonce: "N", needle: None, question: "?" };
        assert_eq!(compose(filler, &p), format!("N\n{filler}?"));
    }
}
