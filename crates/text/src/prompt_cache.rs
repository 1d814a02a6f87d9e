//! `PromptEncoder`: tokenises chat prompts one message at a time and remembers each message's ids, so
//! that a conversation's next turn encodes only the messages it adds (a 128K-token agent context is
//! otherwise re-tokenised whole on every turn: hundreds of milliseconds of CPU in the time to first
//! token, growing with the context).
//!
//! Why the ids are the same: a chat template opens every message with one added token (`<|im_start|>`
//! for Qwen). The tokenizer finds added tokens before it normalises and pre-tokenises, and encodes the
//! text between two of them on its own; so a prompt's ids are the ids of its pieces, split before each
//! opener, concatenated — when the opener is an added token that strips no whitespace, matches inside
//! words, is not normalised, and overlaps no other added token. [`PromptEncoder::new`] checks those
//! properties and a sample; without them every call is a plain [`Tokenizer::encode`].
//!
//! Pieces are cached by their text (hash, then a full comparison) up to a bound on cached tokens; the
//! least recently used go first.

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::{Arc, Mutex};

use crate::error::TextError;
use crate::tokenizer::Tokenizer;

/// Counters of a [`PromptEncoder`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PromptCacheStats {
    /// Pieces and their tokens held now.
    pub pieces: usize,
    pub tokens: usize,
    /// Pieces found in the cache / encoded, over all calls.
    pub hits: u64,
    pub misses: u64,
    /// Tokens taken from the cache / encoded, over all calls.
    pub hit_tokens: u64,
    pub miss_tokens: u64,
}

struct Piece {
    text: Box<str>,
    ids: Box<[u32]>,
    used: u64,
}

#[derive(Default)]
struct Cache {
    map: HashMap<u64, Piece>,
    clock: u64,
    stats: PromptCacheStats,
}

/// Encodes prompts piece by piece with a cache of the pieces' ids (see the module docs).
pub struct PromptEncoder {
    tokenizer: Arc<Tokenizer>,
    /// The message opener the prompt is split before; `None`: plain encoding.
    opener: Option<String>,
    max_tokens: usize,
    cache: Mutex<Cache>,
}

impl std::fmt::Debug for PromptEncoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PromptEncoder").field("opener", &self.opener).field("max_tokens", &self.max_tokens).finish()
    }
}

fn key(text: &str) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    text.hash(&mut h);
    h.finish()
}

impl PromptEncoder {
    /// Tokens the server's encoder keeps: 4M (~16 MB of ids plus their text), a few 262K contexts.
    pub const DEFAULT_MAX_TOKENS: usize = 4 << 20;

    /// An encoder splitting before `opener` (e.g. `<|im_start|>`) and caching up to `max_tokens`
    /// tokens of pieces; a plain encoder when `opener` is not a safe split point of `tokenizer`.
    pub fn new(tokenizer: Arc<Tokenizer>, opener: &str, max_tokens: usize) -> Self {
        let opener = Self::safe_opener(&tokenizer, opener).then(|| opener.to_string());
        PromptEncoder { tokenizer, opener, max_tokens, cache: Mutex::new(Cache::default()) }
    }

    /// Whether prompts are split (false: every call is a plain encode).
    pub fn splits(&self) -> bool {
        self.opener.is_some()
    }

    /// Whether splitting before `opener` keeps `tokenizer`'s ids (see the module docs).
    fn safe_opener(tokenizer: &Tokenizer, opener: &str) -> bool {
        if opener.is_empty() {
            return false;
        }
        let added = tokenizer.inner().get_added_tokens_decoder();
        let Some(tok) = added.values().find(|t| t.content == opener) else { return false };
        if tok.lstrip || tok.rstrip || tok.single_word || tok.normalized {
            return false;
        }
        // No other added token may contain the opener or end with the start of it (a leftmost match
        // that reaches into the opener).
        let overlaps = added.values().filter(|t| t.content != opener).any(|t| {
            t.content.contains(opener)
                || (1..opener.len()).any(|k| opener.is_char_boundary(k) && t.content.ends_with(&opener[..k]))
        });
        if overlaps {
            return false;
        }
        let sample = format!("{opener}system\nA b.  c{opener}user\n x\n\n{opener}assistant\n");
        match (
            tokenizer.encode(&sample),
            Self::pieces(&sample, opener).iter().map(|p| tokenizer.encode(p)).collect::<Result<Vec<_>, _>>(),
        ) {
            (Ok(whole), Ok(parts)) => whole == parts.concat(),
            _ => false,
        }
    }

    /// `text` split before every occurrence of `opener` (the first piece may not start with it).
    fn pieces<'a>(text: &'a str, opener: &str) -> Vec<&'a str> {
        let mut out = Vec::new();
        let mut at = 0;
        for (i, _) in text.match_indices(opener).filter(|&(i, _)| i > 0) {
            out.push(&text[at..i]);
            at = i;
        }
        if at < text.len() {
            out.push(&text[at..]);
        }
        out
    }

    /// The ids of `text`, equal to `Tokenizer::encode(text)`.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TextError> {
        let Some(opener) = &self.opener else { return self.tokenizer.encode(text) };
        let pieces = Self::pieces(text, opener);
        let keys: Vec<u64> = pieces.iter().map(|p| key(p)).collect();
        // Hits under the lock; misses encoded without it.
        let mut found: Vec<Option<Vec<u32>>> = {
            let mut c = self.cache.lock().unwrap_or_else(|e| e.into_inner());
            c.clock += 1;
            let now = c.clock;
            pieces
                .iter()
                .zip(&keys)
                .map(|(p, k)| match c.map.get_mut(k) {
                    Some(e) if &*e.text == *p => {
                        e.used = now;
                        Some(e.ids.to_vec())
                    }
                    _ => None,
                })
                .collect()
        };
        let mut new = Vec::new();
        for (i, p) in pieces.iter().enumerate() {
            if found[i].is_none() {
                let ids = self.tokenizer.encode(p)?;
                new.push(i);
                found[i] = Some(ids);
            }
        }
        let ids: Vec<u32> = found.iter().flat_map(|f| f.as_deref().unwrap_or(&[])).copied().collect();
        let mut c = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        let now = c.clock;
        c.stats.hits += (pieces.len() - new.len()) as u64;
        c.stats.misses += new.len() as u64;
        let miss_tokens: usize = new.iter().map(|&i| found[i].as_ref().map_or(0, Vec::len)).sum();
        c.stats.miss_tokens += miss_tokens as u64;
        c.stats.hit_tokens += (ids.len() - miss_tokens) as u64;
        for i in new {
            let piece_ids = found[i].take().unwrap_or_default();
            if piece_ids.len() > self.max_tokens / 4 {
                continue; // one piece may not crowd out the rest
            }
            c.stats.tokens += piece_ids.len();
            let old = c.map.insert(keys[i], Piece { text: pieces[i].into(), ids: piece_ids.into(), used: now });
            c.stats.tokens -= old.map_or(0, |o| o.ids.len());
        }
        if c.stats.tokens > self.max_tokens {
            Self::evict(&mut c, self.max_tokens * 3 / 4);
        }
        Ok(ids)
    }

    /// Drops the least recently used pieces until at most `keep` tokens remain.
    fn evict(c: &mut Cache, keep: usize) {
        let mut by_age: Vec<(u64, u64)> = c.map.iter().map(|(k, p)| (p.used, *k)).collect();
        by_age.sort_unstable();
        for (_, k) in by_age {
            if c.stats.tokens <= keep {
                break;
            }
            if let Some(p) = c.map.remove(&k) {
                c.stats.tokens -= p.ids.len();
            }
        }
    }

    /// What the cache holds and has saved so far.
    pub fn stats(&self) -> PromptCacheStats {
        let c = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        PromptCacheStats { pieces: c.map.len(), ..c.stats }
    }
}
