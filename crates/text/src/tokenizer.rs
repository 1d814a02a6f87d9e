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
    /// Loads a `tokenizer.json` file, plus the added tokens that only the `tokenizer_config.json`
    /// next to it lists (its `added_tokens_decoder`), as transformers merges them.
    pub fn from_file(path: &Path) -> Result<Self, TextError> {
        let text = std::fs::read_to_string(path)
            .map_err(|source| TextError::Io { path: path.to_path_buf(), cause: source })?;
        let mut tok = Self::load(&text, &path.display().to_string())?;
        let config_path = path.with_file_name("tokenizer_config.json");
        if config_path.exists() {
            let config = std::fs::read_to_string(&config_path)
                .map_err(|source| TextError::Io { path: config_path.clone(), cause: source })?;
            let config: serde_json::Value =
                serde_json::from_str(&config).map_err(|cause| TextError::Json { path: config_path.clone(), cause })?;
            tok.merge_added_tokens(&config).map_err(|message| TextError::ConfigField {
                path: config_path,
                field: "added_tokens_decoder".into(),
                message,
            })?;
        }
        Ok(tok)
    }

    /// Adds the entries of a `tokenizer_config.json`'s `added_tokens_decoder` that the tokenizer
    /// lacks, in id order, as transformers does when it loads a tokenizer (each takes the next free
    /// id, which for well-formed files is the id the config gives).
    pub fn merge_added_tokens(&mut self, config: &serde_json::Value) -> Result<(), String> {
        let Some(decoder) = config.get("added_tokens_decoder") else { return Ok(()) };
        let decoder = decoder.as_object().ok_or("expected an object of id → token")?;
        let mut entries = Vec::with_capacity(decoder.len());
        for (id, entry) in decoder {
            let id: u32 = id.parse().map_err(|_| format!("key {id:?} is not a token id"))?;
            let content = entry
                .get("content")
                .and_then(|c| c.as_str())
                .ok_or_else(|| format!("entry {id}: `content` must be a string"))?;
            entries.push((id, content, entry));
        }
        entries.sort_by_key(|e| e.0);
        let missing: Vec<tokenizers::AddedToken> = entries
            .into_iter()
            .filter(|(_, content, _)| self.inner.token_to_id(content).is_none())
            .map(|(_, content, entry)| {
                let flag = |name: &str| entry.get(name).and_then(|v| v.as_bool());
                let special = flag("special").unwrap_or(false);
                tokenizers::AddedToken::from(content.to_string(), special)
                    .single_word(flag("single_word").unwrap_or(false))
                    .lstrip(flag("lstrip").unwrap_or(false))
                    .rstrip(flag("rstrip").unwrap_or(false))
                    .normalized(flag("normalized").unwrap_or(!special))
            })
            .collect();
        self.inner.add_tokens(missing).map_err(|e| e.to_string())?;
        self.vocab_size = self.inner.get_vocab_size(true);
        Ok(())
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

    /// True if `token` is an added token (special or not).
    pub(crate) fn is_added(&self, token: &str) -> bool {
        self.inner.get_added_vocabulary().get_vocab().contains_key(token)
    }

    /// True if `id` is an added token flagged `special` (skipped by `decode(.., true)`).
    pub(crate) fn is_special(&self, token: &str) -> bool {
        self.inner.get_added_vocabulary().is_special_token(token)
    }
}
