//! What every handler shares: the engine handle, tokenizer, chat template, metrics and settings.

use std::sync::Arc;

use deltaserve_engine::{EngineHandle, SamplingParams};
use deltaserve_text::{ChatTemplate, PromptEncoder, Tokenizer};
use serde_json::{Map, Value, json};

use crate::metrics::Metrics;

/// Server settings.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// The name clients use in `model` (also accepted: any name when `strict_model_name` is false).
    pub served_model_name: String,
    pub api_key: Option<String>,
    /// Largest request body accepted (413 above).
    pub max_body_bytes: usize,
    /// The origins whose web pages may call the API ([`crate::cors`]).
    pub allowed_origins: crate::cors::AllowedOrigins,
    /// The thinking budget of chat requests that do not give one (`--reasoning-budget`; [`crate::thinking`]).
    pub reasoning_budget: Option<usize>,
}

/// Chat-template variables every chat request starts from; a request's `chat_template_kwargs` (or
/// Anthropic `thinking`) overrides them. Empty for a real model (its template's own defaults apply);
/// `enable_thinking: false` for the built-in demo model, whose random weights never close `<think>`.
/// The router carries it as a request extension ([`crate::routes::router_with`]).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ChatDefaults {
    pub kwargs: Map<String, Value>,
}

impl ChatDefaults {
    /// Thinking off unless a request turns it on.
    pub fn thinking_off() -> Self {
        Self { kwargs: Map::from_iter([("enable_thinking".to_string(), json!(false))]) }
    }

    /// These defaults with `request`'s values on top.
    pub fn merged(&self, request: Map<String, Value>) -> Map<String, Value> {
        let mut kwargs = self.kwargs.clone();
        kwargs.extend(request);
        kwargs
    }
}

#[derive(Clone)]
pub struct AppState {
    pub engine: EngineHandle,
    pub tokenizer: Arc<Tokenizer>,
    /// Encodes prompts a message at a time with a cache ([`prompt_encoder`]).
    pub prompt_encoder: Arc<PromptEncoder>,
    pub template: Option<Arc<ChatTemplate>>,
    pub metrics: Arc<Metrics>,
    pub cfg: Arc<ServerConfig>,
    /// Token ids that end generation (from the model's config).
    pub eos_ids: Vec<u32>,
    /// Sampling used for fields a request leaves out (the model's generation_config.json, as vLLM does).
    pub sampling_defaults: SamplingParams,
    /// Structured outputs' grammar compiler (built on first use).
    pub grammars: crate::structured::Grammars,
    /// How images in requests are fetched, limited and preprocessed.
    pub media: Arc<crate::media::MediaConfig>,
}

/// The server's prompt encoder over `tokenizer`: split before every message opener (`<|im_start|>`),
/// each message's ids cached, so a turn re-encodes only the messages it adds.
pub fn prompt_encoder(tokenizer: &Arc<Tokenizer>) -> Arc<PromptEncoder> {
    Arc::new(PromptEncoder::new(tokenizer.clone(), crate::request::MESSAGE_OPENER, PromptEncoder::DEFAULT_MAX_TOKENS))
}

impl AppState {
    /// Submits `req` to the engine and wraps its events in the output parser.
    pub fn generate(
        &self,
        req: deltaserve_engine::Request,
        parsing: crate::output::Parsing,
    ) -> Result<crate::output::OutputStream, crate::error::ApiError> {
        Ok(self.generate_n(req, 1, parsing)?.remove(0))
    }

    /// Submits `req` for `n` choices (the prompt runs once): one output stream each.
    pub fn generate_n(
        &self,
        req: deltaserve_engine::Request,
        n: usize,
        parsing: crate::output::Parsing,
    ) -> Result<Vec<crate::output::OutputStream>, crate::error::ApiError> {
        let streams = self.engine.submit_n(req, n)?;
        let out = streams.into_iter().enumerate().map(|(i, s)| {
            let o = crate::output::OutputStream::new(s, parsing.clone(), self.tokenizer.clone(), self.metrics.clone());
            // The prompt counts once in the metrics, with the first choice.
            if i == 0 { o } else { o.without_prompt() }
        });
        Ok(out.collect())
    }

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

/// Sampling defaults from a model directory's `generation_config.json` (`temperature`, `top_p`,
/// `top_k`, `min_p`, `repetition_penalty`), on top of OpenAI's (temperature 1, top_p 1).
/// A missing or unreadable file gives OpenAI's defaults; bad values are ignored with a warning.
pub fn sampling_defaults(model_dir: &std::path::Path) -> SamplingParams {
    let mut p = SamplingParams::default();
    let path = model_dir.join("generation_config.json");
    let Ok(text) = std::fs::read_to_string(&path) else { return p };
    let Ok(v) = serde_json::from_str::<serde_json::Value>(&text) else {
        tracing::warn!(path = %path.display(), "generation_config.json is not valid JSON; ignoring its sampling defaults");
        return p;
    };
    let num = |k: &str| v.get(k).and_then(serde_json::Value::as_f64);
    // Like vLLM, `do_sample` is not consulted: only the explicit values are.
    if let Some(t) = num("temperature") {
        p.temperature = t as f32;
    }
    if let Some(x) = num("top_p") {
        p.top_p = x as f32;
    }
    if let Some(x) = num("top_k").filter(|k| *k > 0.0) {
        p.top_k = x as usize;
    }
    if let Some(x) = num("min_p") {
        p.min_p = x as f32;
    }
    if let Some(x) = num("repetition_penalty") {
        p.repetition_penalty = x as f32;
    }
    if let Err(e) = p.validate() {
        tracing::warn!(path = %path.display(), error = %e, "ignoring sampling defaults from generation_config.json");
        return SamplingParams::default();
    }
    p
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generation_config_supplies_sampling_defaults() {
        let dir = std::env::temp_dir().join(format!("ds-gencfg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        assert_eq!(sampling_defaults(&dir), SamplingParams::default());
        std::fs::write(
            dir.join("generation_config.json"),
            r#"{"temperature": 0.6, "top_p": 0.95, "top_k": 20, "do_sample": true}"#,
        )
        .unwrap();
        let d = sampling_defaults(&dir);
        assert_eq!((d.temperature, d.top_p, d.top_k), (0.6, 0.95, 20));
        std::fs::write(dir.join("generation_config.json"), r#"{"top_p": 7}"#).unwrap();
        assert_eq!(sampling_defaults(&dir), SamplingParams::default(), "invalid values are ignored");
        std::fs::write(dir.join("generation_config.json"), "{").unwrap();
        assert_eq!(sampling_defaults(&dir), SamplingParams::default());
    }
}
