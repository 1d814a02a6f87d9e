//! The one error type of model loading: every message names the file, field or tensor at fault.

use std::path::{Path, PathBuf};

/// Each message carries its cause in full (an OS error is part of the message, not a `source()` that
/// an error chain would print a second time).
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("{path}: {cause}")]
    Io { path: PathBuf, cause: std::io::Error },
    #[error("invalid model config: {0}")]
    Config(String),
    #[error("not supported: {0}")]
    Unsupported(String),
    #[error("invalid weights: {0}")]
    Weights(String),
    #[error("tensor `{name}` is missing from the checkpoint{hint}")]
    MissingTensor { name: String, hint: String },
    #[error("tensor `{name}` has shape {found:?}, expected {expected:?}")]
    Shape { name: String, expected: Vec<usize>, found: Vec<usize> },
}

impl ModelError {
    pub fn io(path: &Path, cause: std::io::Error) -> Self {
        Self::Io { path: path.to_path_buf(), cause }
    }
    pub fn config(msg: impl Into<String>) -> Self {
        Self::Config(msg.into())
    }
    pub fn unsupported(msg: impl Into<String>) -> Self {
        Self::Unsupported(msg.into())
    }
    pub fn weights(msg: impl Into<String>) -> Self {
        Self::Weights(msg.into())
    }
    /// Prefixes a config error with the file it came from.
    pub fn in_file(self, path: &Path) -> Self {
        match self {
            Self::Config(m) => Self::Config(format!("{}: {m}", path.display())),
            Self::Unsupported(m) => Self::Unsupported(format!("{}: {m}", path.display())),
            other => other,
        }
    }
}
