//! `IncrementalDecoder`: turns a stream of token ids into text pieces that are always complete,
//! valid UTF-8, holding back the bytes of a character split across byte-level BPE tokens.

use crate::bytelevel::token_bytes;
use crate::error::TextError;
use crate::tokenizer::Tokenizer;

/// Streaming detokeniser. The concatenation of all `push` outputs plus `finish` equals
/// `Tokenizer::decode(all_ids, skip_special)`.
#[derive(Debug, Clone)]
pub struct IncrementalDecoder {
    skip_special: bool,
    /// Byte-level path: raw bytes not yet emitted (an incomplete UTF-8 sequence).
    pending: Vec<u8>,
    /// Generic path (non byte-level decoders): ids seen so far and the window offsets.
    ids: Vec<u32>,
    prefix_offset: usize,
    read_offset: usize,
}

impl IncrementalDecoder {
    /// A decoder that drops special tokens when `skip_special` is true.
    pub fn new(skip_special: bool) -> Self {
        Self { skip_special, pending: Vec::new(), ids: Vec::new(), prefix_offset: 0, read_offset: 0 }
    }

    /// Adds one id; returns the text that became complete (possibly empty).
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<String, TextError> {
        let token = tok.check_id(id)?;
        if !tok.is_byte_level() {
            return self.push_generic(tok, id);
        }
        if self.skip_special && tok.is_special(&token) {
            return Ok(String::new());
        }
        token_bytes(&token, &mut self.pending);
        Ok(self.drain_valid(false))
    }

    /// Ends the stream: returns whatever is held back (an incomplete character becomes U+FFFD,
    /// as in a full decode).
    pub fn finish(&mut self, tok: &Tokenizer) -> Result<String, TextError> {
        if !tok.is_byte_level() {
            let prefix = tok.decode(&self.ids[self.prefix_offset..self.read_offset], self.skip_special)?;
            let full = tok.decode(&self.ids[self.prefix_offset..], self.skip_special)?;
            self.ids.clear();
            self.prefix_offset = 0;
            self.read_offset = 0;
            return Ok(full.get(prefix.len()..).unwrap_or_default().to_string());
        }
        Ok(self.drain_valid(true))
    }

    /// Emits the longest valid prefix of `pending`, replacing invalid sequences with U+FFFD the
    /// way `String::from_utf8_lossy` does; an incomplete tail is kept unless `at_end`.
    fn drain_valid(&mut self, at_end: bool) -> String {
        let mut out = String::new();
        let mut start = 0;
        loop {
            match std::str::from_utf8(&self.pending[start..]) {
                Ok(s) => {
                    out.push_str(s);
                    start = self.pending.len();
                    break;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    // The prefix up to `valid` is UTF-8 by construction.
                    out.push_str(&String::from_utf8_lossy(&self.pending[start..start + valid]));
                    start += valid;
                    match e.error_len() {
                        Some(n) => {
                            out.push('\u{fffd}');
                            start += n;
                        }
                        None => {
                            if at_end {
                                out.push('\u{fffd}');
                                start = self.pending.len();
                            }
                            break;
                        }
                    }
                }
            }
        }
        self.pending.drain(..start);
        out
    }

    /// Fallback for tokenizers whose decoder is not plain ByteLevel: decode a small window and
    /// emit the new suffix once it no longer ends in a replacement character.
    fn push_generic(&mut self, tok: &Tokenizer, id: u32) -> Result<String, TextError> {
        self.ids.push(id);
        let prefix = tok.decode(&self.ids[self.prefix_offset..self.read_offset], self.skip_special)?;
        let full = tok.decode(&self.ids[self.prefix_offset..], self.skip_special)?;
        if full.len() > prefix.len() && !full.ends_with('\u{fffd}') && full.starts_with(&prefix) {
            let new = full[prefix.len()..].to_string();
            self.prefix_offset = self.read_offset;
            self.read_offset = self.ids.len();
            return Ok(new);
        }
        Ok(String::new())
    }
}
