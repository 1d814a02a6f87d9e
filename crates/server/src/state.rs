//! What every handler shares: the engine handle, tokenizer, chat template, metrics and settings.

use std::sync::Arc;

use deltaserve_engine::EngineHandle;
use deltaserve_text::{ChatTemplate, Tokenizer};

use crate::metrics::Metrics;

/// Server settings.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// The name clients use in `model` (also accepted: any name when `strict_model_name` is false).
    pub served_model_name: String,
    pub api_key: Option<String>,
    /// Largest request body accepted (413 above).
    pub max_body_bytes: usize,
}

#[derive(Clone)]
pub struct AppState {
    pub engine: EngineHandle,
    pub tokenizer: Arc<Tokenizer>,
    pub template: Option<Arc<ChatTemplate>>,
    pub metrics: Arc<Metrics>,
    pub cfg: Arc<ServerConfig>,
    /// Token ids that end generation (from the model's config).
    pub eos_ids: Vec<u32>,
}

impl AppState {
    /// Checks the request's `model` field: absent or the served name.
    pub fn check_model(&self, model: Option<&str>) -> Result<(), crate::error::ApiError> {
        match model {
            None => Ok(()),
            Some(m) if m == self.cfg.served_model_name => Ok(()),
            Some(m) => Err(crate::error::ApiError::NotFound(format!(
                "the model `{m}` does not exist; this server serves `{}`",
                self.cfg.served_model_name
            ))),
        }
    }
}
