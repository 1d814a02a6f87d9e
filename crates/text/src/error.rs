//! The crate's error type, `TextError`: every failure names the file, field or input it came from.

use std::path::PathBuf;

/// Errors from tokenizer loading, encoding/decoding, chat templates and synthetic vocabularies.
#[derive(Debug, thiserror::Error)]
pub enum TextError {
    /// A file could not be read. The OS error is part of the message (not a `source()`, which would
    /// print it twice in a chain).
    #[error("cannot read {path}: {cause}")]
    Io { path: PathBuf, cause: std::io::Error },
    /// A tokenizer definition (tokenizer.json or JSON text) could not be loaded.
    #[error("cannot load tokenizer from {origin}: {message}")]
    TokenizerLoad { origin: String, message: String },
    /// Encoding text failed.
    #[error("cannot encode text: {0}")]
    Encode(String),
    /// Decoding ids failed.
    #[error("cannot decode ids: {0}")]
    Decode(String),
    /// A token id is outside the tokenizer's vocabulary.
    #[error("token id {id} is outside the vocabulary (size {vocab_size})")]
    UnknownId { id: u32, vocab_size: usize },
    /// A JSON file could not be parsed.
    #[error("cannot parse {path} as JSON: {cause}")]
    Json { path: PathBuf, cause: serde_json::Error },
    /// A field of a config file has an unexpected shape.
    #[error("{path}: field `{field}`: {message}")]
    ConfigField { path: PathBuf, field: String, message: String },
    /// The chat template does not compile.
    #[error("chat template syntax error: {0}")]
    TemplateSyntax(String),
    /// Rendering the chat template failed.
    #[error("chat template render error: {0}")]
    TemplateRender(String),
    /// The template called `raise_exception(message)`.
    #[error("chat template raised an exception: {0}")]
    TemplateRaised(String),
    /// The synthetic tokenizer could not be built with the requested size.
    #[error("synthetic tokenizer: {0}")]
    Synthetic(String),
}
