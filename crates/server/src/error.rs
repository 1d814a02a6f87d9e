//! Every error a client can see, mapped to an HTTP status and an OpenAI- or Anthropic-style body in
//! one place. User input never produces a 500: `Internal` is only for the server's own failures.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use deltaserve_engine::EngineError;
use deltaserve_sched::AdmitError;
use serde_json::json;

#[derive(Clone, Debug, PartialEq)]
pub enum ApiError {
    /// 400: malformed or unsupported request; `param` names the offending field when known.
    BadRequest { message: String, param: Option<String> },
    /// 401
    Unauthorized,
    /// 404: unknown model or route.
    NotFound(String),
    /// 413
    TooLarge(String),
    /// 429: the waiting queue is full.
    Overloaded(String),
    /// 503: the engine is stopping or stopped.
    Unavailable(String),
    /// 500: a failure of the server itself.
    Internal(String),
}

/// Which API's error body to produce.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Style {
    OpenAi,
    Anthropic,
}

impl ApiError {
    pub fn bad(message: impl Into<String>) -> Self {
        Self::BadRequest { message: message.into(), param: None }
    }
    pub fn bad_param(param: &str, message: impl Into<String>) -> Self {
        Self::BadRequest { message: message.into(), param: Some(param.to_string()) }
    }

    pub fn status(&self) -> StatusCode {
        match self {
            Self::BadRequest { .. } => StatusCode::BAD_REQUEST,
            Self::Unauthorized => StatusCode::UNAUTHORIZED,
            Self::NotFound(_) => StatusCode::NOT_FOUND,
            Self::TooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            Self::Overloaded(_) => StatusCode::TOO_MANY_REQUESTS,
            Self::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            Self::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    pub fn message(&self) -> String {
        match self {
            Self::BadRequest { message, .. } => message.clone(),
            Self::Unauthorized => "invalid or missing API key".into(),
            Self::NotFound(m) | Self::TooLarge(m) | Self::Overloaded(m) | Self::Unavailable(m) | Self::Internal(m) => {
                m.clone()
            }
        }
    }

    /// OpenAI `error.type` / Anthropic `error.type`; also the metric label.
    pub fn kind(&self, style: Style) -> &'static str {
        match (self, style) {
            (Self::BadRequest { .. }, _) => "invalid_request_error",
            (Self::Unauthorized, _) => "authentication_error",
            (Self::NotFound(_), Style::OpenAi) => "invalid_request_error",
            (Self::NotFound(_), Style::Anthropic) => "not_found_error",
            (Self::TooLarge(_), Style::OpenAi) => "invalid_request_error",
            (Self::TooLarge(_), Style::Anthropic) => "request_too_large",
            (Self::Overloaded(_), Style::OpenAi) => "rate_limit_error",
            (Self::Overloaded(_), Style::Anthropic) => "overloaded_error",
            (Self::Unavailable(_), Style::OpenAi) => "service_unavailable",
            (Self::Unavailable(_), Style::Anthropic) => "overloaded_error",
            (Self::Internal(_), Style::OpenAi) => "server_error",
            (Self::Internal(_), Style::Anthropic) => "api_error",
        }
    }

    pub fn body(&self, style: Style) -> serde_json::Value {
        match style {
            Style::OpenAi => {
                let param = match self {
                    Self::BadRequest { param, .. } => param.clone(),
                    _ => None,
                };
                json!({ "error": {
                    "message": self.message(),
                    "type": self.kind(style),
                    "param": param,
                    "code": self.status().as_u16(),
                }})
            }
            Style::Anthropic => {
                json!({ "type": "error", "error": { "type": self.kind(style), "message": self.message() } })
            }
        }
    }

    pub fn into_response_styled(self, style: Style) -> Response {
        (self.status(), axum::Json(self.body(style))).into_response()
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        self.into_response_styled(Style::OpenAi)
    }
}

impl From<EngineError> for ApiError {
    fn from(e: EngineError) -> Self {
        match &e {
            EngineError::Admit(AdmitError::Overloaded { .. }) => Self::Overloaded(e.to_string()),
            EngineError::Admit(AdmitError::ContextTooLong { .. }) => Self::bad_param("messages", e.to_string()),
            EngineError::Admit(AdmitError::ZeroMaxTokens) => Self::bad_param("max_tokens", e.to_string()),
            EngineError::Admit(_) | EngineError::Invalid(_) => Self::bad(e.to_string()),
            EngineError::Stopped => Self::Unavailable("the server is shutting down".into()),
            EngineError::Backend(m) => Self::Internal(format!("backend failure: {m}")),
        }
    }
}
