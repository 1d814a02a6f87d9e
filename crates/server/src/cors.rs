//! Cross-origin requests (CORS), for clients that call the API from a web page of another origin (browser
//! chat front ends, notebooks in the browser). As vLLM's and llama.cpp's servers do by default, every origin
//! may call (`--allowed-origins`, default `*`); a preflight (`OPTIONS` with `Access-Control-Request-Method`)
//! is answered before the API-key check, since browsers send it without credentials, and the key is still
//! required on the request that follows.

use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::state::AppState;

/// The origins whose web pages may call the API.
#[derive(Clone, Debug, Default, PartialEq)]
pub enum AllowedOrigins {
    /// Any origin (`*`).
    #[default]
    Any,
    /// These origins (`scheme://host[:port]`, compared without case), none when empty: no CORS headers.
    List(Vec<String>),
}

impl AllowedOrigins {
    /// From `--allowed-origins` values: `*` among them allows any; an empty list allows none.
    pub fn parse(values: &[String]) -> Self {
        let list: Vec<String> =
            values.iter().map(|v| v.trim().trim_end_matches('/').to_string()).filter(|v| !v.is_empty()).collect();
        if list.iter().any(|v| v == "*") { Self::Any } else { Self::List(list) }
    }

    /// The `Access-Control-Allow-Origin` value for a request from `origin`, if it is allowed.
    fn allow(&self, origin: &HeaderValue) -> Option<HeaderValue> {
        match self {
            Self::Any => Some(HeaderValue::from_static("*")),
            Self::List(list) => {
                let o = origin.to_str().ok()?;
                list.iter().any(|a| a.eq_ignore_ascii_case(o)).then(|| origin.clone())
            }
        }
    }
}

/// The methods the API answers.
const METHODS: &str = "GET, POST, OPTIONS";
/// The request headers a preflight allows when it names none: those the OpenAI and Anthropic clients send.
const HEADERS: &str = "authorization, content-type, x-api-key, anthropic-version, anthropic-beta, openai-beta";
/// How long a browser may keep a preflight's answer, in seconds.
const MAX_AGE: &str = "86400";

/// The middleware: answers preflights from allowed origins, and marks other responses to them.
pub async fn cors(State(st): State<AppState>, req: Request, next: Next) -> Response {
    let Some(origin) = req.headers().get(header::ORIGIN).cloned() else { return next.run(req).await };
    let Some(allow) = st.cfg.allowed_origins.allow(&origin) else { return next.run(req).await };
    let preflight =
        req.method() == Method::OPTIONS && req.headers().contains_key(header::ACCESS_CONTROL_REQUEST_METHOD);
    if preflight {
        let asked = req.headers().get(header::ACCESS_CONTROL_REQUEST_HEADERS).cloned();
        let mut h = HeaderMap::new();
        h.insert(header::ACCESS_CONTROL_ALLOW_METHODS, HeaderValue::from_static(METHODS));
        h.insert(header::ACCESS_CONTROL_ALLOW_HEADERS, asked.unwrap_or(HeaderValue::from_static(HEADERS)));
        h.insert(header::ACCESS_CONTROL_MAX_AGE, HeaderValue::from_static(MAX_AGE));
        let mut resp = (StatusCode::NO_CONTENT, h).into_response();
        mark(resp.headers_mut(), allow);
        return resp;
    }
    let mut resp = next.run(req).await;
    mark(resp.headers_mut(), allow);
    resp
}

/// The headers every response to an allowed origin carries.
fn mark(h: &mut HeaderMap, allow: HeaderValue) {
    let specific = allow != "*";
    h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, allow);
    if specific {
        h.append(header::VARY, HeaderValue::from_static("Origin"));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn origins_parse_and_match() {
        let any = AllowedOrigins::parse(&["*".into()]);
        assert_eq!(any, AllowedOrigins::Any);
        assert_eq!(any.allow(&HeaderValue::from_static("http://x")).unwrap(), "*");
        let list = AllowedOrigins::parse(&["https://chat.example.com/".into(), " http://localhost:3000".into()]);
        assert_eq!(
            list.allow(&HeaderValue::from_static("HTTPS://chat.example.com")).unwrap(),
            "HTTPS://chat.example.com"
        );
        assert!(list.allow(&HeaderValue::from_static("http://localhost:3000")).is_some());
        assert!(list.allow(&HeaderValue::from_static("http://localhost:3001")).is_none());
        let none = AllowedOrigins::parse(&[]);
        assert!(none.allow(&HeaderValue::from_static("http://localhost:3000")).is_none());
    }
}
