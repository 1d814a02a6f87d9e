//! Graceful shutdown's bookkeeping: counts the requests in flight (until their response bodies end)
//! and, once shutdown has begun, answers every new request with a 503 "shutting down" while the
//! in-flight ones finish.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{HeaderValue, header};
use axum::middleware::Next;
use axum::response::Response;
use http_body::{Body as HttpBody, Frame, SizeHint};

use crate::error::ApiError;

/// Shared by the shutdown task and the [`gate`] middleware.
#[derive(Clone, Default)]
pub struct Drain {
    inner: Arc<Inner>,
}

#[derive(Default)]
struct Inner {
    stopping: AtomicBool,
    in_flight: tokio::sync::watch::Sender<usize>,
}

impl Drain {
    /// From now on new requests get a 503.
    pub fn begin(&self) {
        self.inner.stopping.store(true, Ordering::SeqCst);
    }

    pub fn is_stopping(&self) -> bool {
        self.inner.stopping.load(Ordering::SeqCst)
    }

    /// Requests whose responses have not ended yet.
    pub fn in_flight(&self) -> usize {
        *self.inner.in_flight.borrow()
    }

    /// Resolves when no request is in flight.
    pub async fn idle(&self) {
        let mut rx = self.inner.in_flight.subscribe();
        let _ = rx.wait_for(|n| *n == 0).await;
    }

    fn enter(&self) -> InFlight {
        self.inner.in_flight.send_modify(|n| *n += 1);
        InFlight(self.clone())
    }
}

/// One request in flight; dropped when its response body ends (or the client goes away).
struct InFlight(Drain);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.inner.in_flight.send_modify(|n| *n -= 1);
    }
}

/// Middleware: a 503 (with `Connection: close`) once shutdown has begun, else runs the request and
/// counts it in flight until its response body ends.
pub async fn gate(State(drain): State<Drain>, req: Request, next: Next) -> Response {
    // Counted before the check, so the shutdown task never sees zero while this request slips in.
    let guard = drain.enter();
    if drain.is_stopping() {
        drop(guard);
        let style = crate::routes::style_for(req.uri().path());
        let mut resp = ApiError::Unavailable("the server is shutting down".into()).into_response_styled(style);
        resp.headers_mut().insert(header::CONNECTION, HeaderValue::from_static("close"));
        return resp;
    }
    next.run(req).await.map(|body| Body::new(Tracked { body, _guard: guard }))
}

/// A response body that holds its request's [`InFlight`] until it is dropped.
struct Tracked {
    body: Body,
    _guard: InFlight,
}

impl HttpBody for Tracked {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}
