//! `Tokenizer`: a thin wrapper over a HF `tokenizer.json` (via the `tokenizers` crate) with the
//! encode/decode conventions the server needs (specials in text are recognised, no BOS, strict ids).

use std::path::Path;

use tokenizers::DecoderWrapper;

use crate::error::TextError;

/// A loaded HF tokenizer.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// True when the decoder is a plain ByteLevel decoder, so tokens map to raw bytes directly.
    byte_level: bool,
    vocab_size: usize,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer").field("vocab_size", &self.vocab_size).field("byte_level", &self.byte_level).finish()
    }
}

impl Tokenizer {
    /// Loads a `tokenizer.json` file.
    pub fn from_file(path: &Path) -> Result<Self, TextError> {
        let text = std::fs::read_to_string(path)
            .map_err(|source| TextError::Io { path: path.to_path_buf(), cause: source })?;
        Self::load(&text, &path.display().to_string())
    }

    /// Loads a tokenizer from `tokenizer.json` text.
    pub fn from_json(json: &str) -> Result<Self, TextError> {
        Self::load(json, "<tokenizer json text>")
    }

    fn load(json: &str, origin: &str) -> Result<Self, TextError> {
        let inner: tokenizers::Tokenizer = json.parse().map_err(|e: tokenizers::Error| TextError::TokenizerLoad {
            origin: origin.to_string(),
            message: e.to_string(),
        })?;
        let byte_level = matches!(inner.get_decoder(), Some(DecoderWrapper::ByteLevel(_)));
        let vocab_size = inner.get_vocab_size(true);
        Ok(Self { inner, byte_level, vocab_size })
    }

    /// Encodes text. Special/added tokens written in the text are recognised; no BOS or other
    /// post-processing tokens are added.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TextError> {
        let enc = self.inner.encode(text, false).map_err(|e| TextError::Encode(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Decodes ids to text. Errors on an id outside the vocabulary.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String, TextError> {
        for &id in ids {
            self.check_id(id)?;
        }
        self.inner.decode(ids, skip_special).map_err(|e| TextError::Decode(e.to_string()))
    }

    /// Number of tokens, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// The id of a token string (model or added token).
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The token string of an id (model or added token).
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The underlying `tokenizers` tokenizer.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    pub(crate) fn check_id(&self, id: u32) -> Result<String, TextError> {
        self.inner.id_to_token(id).ok_or(TextError::UnknownId { id, vocab_size: self.vocab_size })
    }

    pub(crate) fn is_byte_level(&self) -> bool {
        self.byte_level
    }

    /// True if `id` is an added token flagged `special` (skipped by `decode(.., true)`).
    pub(crate) fn is_special(&self, token: &str) -> bool {
        self.inner.get_added_vocabulary().is_special_token(token)
    }
}
