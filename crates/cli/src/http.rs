//! A minimal HTTP/1.1 client for the load tools (`soak`, `probe`): one request per connection
//! (`Connection: close`), content-length, chunked or read-to-close bodies, and SSE `data:` lines parsed as
//! they arrive so the first streamed token is timed when it reaches the socket. No TLS: these tools talk to
//! a deltaserve on the local network.

use std::fmt::Write as _;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use serde_json::Value;

/// The server's reply to one turn, as streamed.
#[derive(Default)]
pub(crate) struct Reply {
    pub(crate) content: String,
    pub(crate) reasoning: String,
    /// (id, name, arguments) by index.
    pub(crate) tool_calls: Vec<(String, String, String)>,
    pub(crate) usage: Option<Value>,
    /// The server's `timings` of the reply (deltaserve and llama-server send them on the finish chunk).
    pub(crate) timings: Option<Value>,
    pub(crate) finish_reason: Option<String>,
    pub(crate) first_token: Option<Instant>,
    pub(crate) first_finish: Option<Instant>,
    pub(crate) done: bool,
    pub(crate) error: Option<String>,
}

#[derive(Clone, Debug)]
pub(crate) struct Target {
    pub(crate) host: String,
    pub(crate) port: u16,
    /// Path prefix without a trailing slash (`` or `/prefix`).
    pub(crate) base: String,
}

impl Target {
    pub(crate) fn parse(url: &str) -> Result<Self> {
        let rest = match url.split_once("://") {
            Some(("http", rest)) => rest,
            Some(("https", _)) => bail!("--url {url}: https is not supported; use a plain http:// URL"),
            Some((scheme, _)) => bail!("--url {url}: unsupported scheme `{scheme}` (expected http://)"),
            None => url,
        };
        let (authority, path) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i..]),
            None => (rest, ""),
        };
        let (host, port) = match authority.rsplit_once(':') {
            Some((h, p)) if !h.ends_with(']') || h.starts_with('[') => {
                (h.to_string(), p.parse::<u16>().map_err(|_| anyhow!("--url {url}: bad port `{p}`"))?)
            }
            _ => (authority.to_string(), 80),
        };
        if host.is_empty() {
            bail!("--url {url}: no host");
        }
        let mut base = path.trim_end_matches('/').to_string();
        if base.ends_with("/v1") {
            base.truncate(base.len() - 3);
        }
        Ok(Self { host, port, base })
    }

    pub(crate) fn origin(&self) -> String {
        format!("http://{}:{}{}", self.host, self.port, self.base)
    }
}

pub(crate) struct HttpResponse {
    pub(crate) status: u16,
    pub(crate) body: Vec<u8>,
}

/// Arena counters scraped from /metrics.
pub(crate) struct MetricsSample {
    pub(crate) allocations: u64,
    pub(crate) high_water: u64,
    pub(crate) kv_pages_used: Option<u64>,
    /// Engine steps run and their wall time (s) so far (absent on servers that do not report them).
    pub(crate) steps: Option<u64>,
    pub(crate) step_seconds: Option<f64>,
    /// Prompt tokens of finished requests, and those of them served from the prefix cache.
    pub(crate) prompt_tokens: Option<u64>,
    pub(crate) cached_tokens: Option<u64>,
}

pub(crate) struct Client {
    pub(crate) target: Target,
    pub(crate) api_key: Option<String>,
    pub(crate) timeout: Duration,
    /// Sent as `X-Session-Id` (a gateway can route a session's requests by it).
    pub(crate) session: Option<String>,
}

impl Client {
    pub(crate) async fn get_json(&self, path: &str) -> Result<Value> {
        let r = self.request("GET", path, None, |_| {}).await?;
        if r.status != 200 {
            bail!("GET {path}: HTTP {}: {}", r.status, error_text(&r.body));
        }
        serde_json::from_slice(&r.body).with_context(|| format!("GET {path}: the body is not JSON"))
    }

    /// POSTs a JSON body and returns the JSON reply (HTTP 200 only).
    pub(crate) async fn post_json(&self, path: &str, body: &Value) -> Result<Value> {
        let payload = serde_json::to_vec(body)?;
        let r = self.request("POST", path, Some(&payload), |_| {}).await?;
        if r.status != 200 {
            bail!("POST {path}: HTTP {}: {}", r.status, error_text(&r.body));
        }
        serde_json::from_slice(&r.body).with_context(|| format!("POST {path}: the body is not JSON"))
    }

    pub(crate) async fn metrics(&self) -> Result<MetricsSample> {
        let r = self.request("GET", "/metrics", None, |_| {}).await?;
        if r.status != 200 {
            bail!("GET /metrics: HTTP {}: {}", r.status, error_text(&r.body));
        }
        let text = String::from_utf8_lossy(&r.body);
        let getf = |name: &str| {
            text.lines()
                .filter(|l| !l.starts_with('#'))
                .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse::<f64>().ok())
        };
        let get = |name: &str| getf(name).map(|v| v as u64);
        let need =
            |name: &str| get(name).ok_or_else(|| anyhow!("GET /metrics: no `{name}` gauge (is this deltaserve?)"));
        Ok(MetricsSample {
            allocations: need("deltaserve_arena_allocations")?,
            high_water: need("deltaserve_arena_high_water_bytes")?,
            kv_pages_used: get("deltaserve_kv_pages_used"),
            steps: get("deltaserve_engine_steps_total"),
            step_seconds: getf("deltaserve_engine_step_seconds_total"),
            prompt_tokens: get("deltaserve_prompt_tokens_total"),
            cached_tokens: get("deltaserve_prefix_cache_hit_tokens_total"),
        })
    }

    /// Streams one chat completion: the reply, TTFT and total time (ms).
    pub(crate) async fn chat(&self, body: &Value) -> Result<(Reply, f64, f64)> {
        let payload = serde_json::to_vec(body)?;
        let mut sse = SseParser::default();
        let mut reply = Reply::default();
        let start = Instant::now();
        let r = self
            .request("POST", "/v1/chat/completions", Some(&payload), |bytes| {
                sse.feed(bytes, |data| on_event(&mut reply, data));
            })
            .await?;
        let end = Instant::now();
        if r.status != 200 {
            bail!("POST /v1/chat/completions: HTTP {}: {}", r.status, error_text(&r.body));
        }
        sse.finish(|data| on_event(&mut reply, data));
        if let Some(e) = reply.error.take() {
            bail!("POST /v1/chat/completions: malformed or failed stream: {e}");
        }
        if !reply.done {
            bail!("POST /v1/chat/completions: the stream ended without `data: [DONE]`");
        }
        if reply.finish_reason.is_none() {
            bail!("POST /v1/chat/completions: no chunk carried a finish_reason");
        }
        if reply.usage.is_none() {
            bail!("POST /v1/chat/completions: no usage chunk although stream_options.include_usage was set");
        }
        // A reply whose only token ended it (EOS) streams no text: time to the finish chunk instead.
        let first = reply.first_token.or(reply.first_finish).unwrap_or(end);
        let ms = |t: Instant| t.duration_since(start).as_secs_f64() * 1e3;
        let (ttft, total) = (ms(first), ms(end));
        Ok((reply, ttft, total))
    }

    /// One request on a fresh connection; `on_body` sees the decoded body as it arrives.
    pub(crate) async fn request(
        &self,
        method: &str,
        path: &str,
        body: Option<&[u8]>,
        on_body: impl FnMut(&[u8]),
    ) -> Result<HttpResponse> {
        let what = format!("{method} {}{path}", self.target.origin());
        tokio::time::timeout(self.timeout, self.request_inner(method, path, body, on_body))
            .await
            .map_err(|_| anyhow!("{what}: no complete response within {:?}", self.timeout))?
            .with_context(|| what.clone())
    }

    pub(crate) async fn request_inner(
        &self,
        method: &str,
        path: &str,
        body: Option<&[u8]>,
        mut on_body: impl FnMut(&[u8]),
    ) -> Result<HttpResponse> {
        let t = &self.target;
        let stream = tokio::net::TcpStream::connect((t.host.as_str(), t.port))
            .await
            .with_context(|| format!("cannot connect to {}:{} (is the server running?)", t.host, t.port))?;
        let mut head = format!(
            "{method} {}{path} HTTP/1.1\r\nHost: {}:{}\r\nUser-Agent: deltaserve-cli\r\nAccept: */*\r\nConnection: close\r\n",
            t.base, t.host, t.port
        );
        if let Some(key) = &self.api_key {
            let _ = write!(head, "Authorization: Bearer {key}\r\n");
        }
        if let Some(id) = &self.session {
            let _ = write!(head, "X-Session-Id: {id}\r\n");
        }
        if let Some(b) = body {
            let _ = write!(head, "Content-Type: application/json\r\nContent-Length: {}\r\n", b.len());
        }
        head.push_str("\r\n");
        let mut out = head.into_bytes();
        out.extend_from_slice(body.unwrap_or_default());
        write_all(&stream, &out).await.context("sending the request")?;

        // Status line and headers.
        let mut buf = Vec::new();
        let header_end = loop {
            if let Some(i) = find(&buf, b"\r\n\r\n") {
                break i;
            }
            if buf.len() > 64 << 10 {
                bail!("the response headers exceed 64 KiB");
            }
            if read_some(&stream, &mut buf).await? == 0 {
                bail!("the connection closed before a complete response header ({} bytes received)", buf.len());
            }
        };
        let head = std::str::from_utf8(&buf[..header_end]).context("the response header is not UTF-8")?;
        let mut lines = head.split("\r\n");
        let status_line = lines.next().unwrap_or_default();
        let status = match status_line.split_whitespace().collect::<Vec<_>>()[..] {
            [v, code, ..] if v.starts_with("HTTP/1.") => {
                code.parse::<u16>().map_err(|_| anyhow!("bad status line `{status_line}`"))?
            }
            _ => bail!("bad status line `{status_line}`"),
        };
        let mut chunked = false;
        let mut length = None;
        for l in lines {
            let (k, v) = l.split_once(':').ok_or_else(|| anyhow!("bad header line `{l}`"))?;
            let (k, v) = (k.trim().to_ascii_lowercase(), v.trim());
            if k == "transfer-encoding" && v.to_ascii_lowercase().contains("chunked") {
                chunked = true;
            } else if k == "content-length" {
                length = Some(v.parse::<usize>().map_err(|_| anyhow!("bad content-length `{v}`"))?);
            }
        }
        let mut raw = buf.split_off(header_end + 4);
        let mut body = Vec::new();
        let no_body = method == "HEAD" || status == 204 || status == 304 || (100..200).contains(&status);
        if no_body {
            return Ok(HttpResponse { status, body });
        }
        if chunked {
            let mut dec = Chunked::default();
            loop {
                let mut emit = |b: &[u8]| {
                    on_body(b);
                    body.extend_from_slice(b);
                };
                dec.feed(&mut raw, &mut emit)?;
                if dec.done {
                    break;
                }
                if read_some(&stream, &mut raw).await? == 0 {
                    bail!("the connection closed in the middle of a chunked body ({} bytes decoded)", body.len());
                }
            }
        } else if let Some(n) = length {
            loop {
                let take = raw.len().min(n - body.len());
                on_body(&raw[..take]);
                body.extend_from_slice(&raw[..take]);
                raw.clear();
                if body.len() == n {
                    break;
                }
                if read_some(&stream, &mut raw).await? == 0 {
                    bail!("the connection closed after {} of {n} body bytes", body.len());
                }
            }
        } else {
            loop {
                on_body(&raw);
                body.append(&mut raw);
                if read_some(&stream, &mut raw).await? == 0 {
                    break;
                }
            }
        }
        Ok(HttpResponse { status, body })
    }
}

pub(crate) async fn write_all(s: &tokio::net::TcpStream, mut data: &[u8]) -> Result<()> {
    while !data.is_empty() {
        s.writable().await?;
        match s.try_write(data) {
            Ok(0) => bail!("the connection closed while sending"),
            Ok(n) => data = &data[n..],
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// Appends what the socket has (waiting for at least one byte); 0 at end of stream.
pub(crate) async fn read_some(s: &tokio::net::TcpStream, buf: &mut Vec<u8>) -> Result<usize> {
    let mut tmp = [0u8; 16 << 10];
    loop {
        s.readable().await?;
        match s.try_read(&mut tmp) {
            Ok(n) => {
                buf.extend_from_slice(&tmp[..n]);
                return Ok(n);
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(anyhow::Error::new(e).context("reading the response")),
        }
    }
}

pub(crate) fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// The message of an error body (OpenAI / Anthropic `error.message`), else the body itself.
pub(crate) fn error_text(body: &[u8]) -> String {
    let v: Option<Value> = serde_json::from_slice(body).ok();
    match v.as_ref().and_then(|v| v["error"]["message"].as_str()) {
        Some(m) => m.to_string(),
        None => {
            let s = String::from_utf8_lossy(body);
            let s = s.trim();
            if s.is_empty() { "(empty body)".into() } else { s.chars().take(500).collect() }
        }
    }
}

/// Incremental decoder of `Transfer-Encoding: chunked`.
#[derive(Default)]
pub(crate) struct Chunked {
    /// Bytes left in the current chunk's data.
    pub(crate) left: usize,
    /// The CRLF after a chunk's data is still due.
    pub(crate) crlf_due: bool,
    pub(crate) done: bool,
}

impl Chunked {
    /// Decodes what `raw` holds, consuming it; leaves an incomplete size line in `raw`.
    pub(crate) fn feed(&mut self, raw: &mut Vec<u8>, emit: &mut impl FnMut(&[u8])) -> Result<()> {
        let mut pos = 0;
        while !self.done {
            if self.left > 0 {
                let take = self.left.min(raw.len() - pos);
                if take == 0 {
                    break;
                }
                emit(&raw[pos..pos + take]);
                pos += take;
                self.left -= take;
                if self.left == 0 {
                    self.crlf_due = true;
                }
            } else if self.crlf_due {
                if raw.len() - pos < 2 {
                    break;
                }
                if &raw[pos..pos + 2] != b"\r\n" {
                    bail!("malformed chunked body: no CRLF after a chunk");
                }
                pos += 2;
                self.crlf_due = false;
            } else {
                let Some(i) = find(&raw[pos..], b"\r\n") else {
                    if raw.len() - pos > 1024 {
                        bail!("malformed chunked body: a chunk-size line over 1 KiB");
                    }
                    break;
                };
                let line = std::str::from_utf8(&raw[pos..pos + i]).unwrap_or("");
                let hex = line.split(';').next().unwrap_or("").trim();
                let size = usize::from_str_radix(hex, 16)
                    .map_err(|_| anyhow!("malformed chunked body: bad chunk size `{}`", line.escape_debug()))?;
                pos += i + 2;
                if size == 0 {
                    // Trailers, if any, are not needed: the connection closes after them.
                    self.done = true;
                } else {
                    self.left = size;
                }
            }
        }
        raw.drain(..pos);
        Ok(())
    }
}

/// Incremental Server-Sent Events parser: calls back with each event's `data`.
#[derive(Default)]
pub(crate) struct SseParser {
    pub(crate) line: Vec<u8>,
    pub(crate) data: Option<String>,
}

impl SseParser {
    pub(crate) fn feed(&mut self, bytes: &[u8], mut on_data: impl FnMut(&str)) {
        for &b in bytes {
            if b == b'\n' {
                let mut line = std::mem::take(&mut self.line);
                if line.last() == Some(&b'\r') {
                    line.pop();
                }
                self.line_done(&String::from_utf8_lossy(&line), &mut on_data);
            } else {
                self.line.push(b);
            }
        }
    }

    pub(crate) fn line_done(&mut self, line: &str, on_data: &mut impl FnMut(&str)) {
        if line.is_empty() {
            if let Some(d) = self.data.take() {
                on_data(&d);
            }
        } else if let Some(v) = line.strip_prefix("data:") {
            let v = v.strip_prefix(' ').unwrap_or(v);
            match &mut self.data {
                Some(d) => {
                    d.push('\n');
                    d.push_str(v);
                }
                None => self.data = Some(v.to_string()),
            }
        } // comments (`:`), `event:`, `id:` and `retry:` lines are not needed
    }

    /// Dispatches an event left unterminated at the end of the stream.
    pub(crate) fn finish(&mut self, mut on_data: impl FnMut(&str)) {
        if !self.line.is_empty() {
            let line = String::from_utf8_lossy(&std::mem::take(&mut self.line)).into_owned();
            self.line_done(&line, &mut on_data);
        }
        self.line_done("", &mut on_data);
    }
}

/// Folds one SSE `data` payload of a chat completion stream into `r`.
pub(crate) fn on_event(r: &mut Reply, data: &str) {
    if r.error.is_some() {
        return;
    }
    if data.trim() == "[DONE]" {
        r.done = true;
        return;
    }
    if r.done {
        r.error = Some("data after [DONE]".into());
        return;
    }
    let v: Value = match serde_json::from_str(data) {
        Ok(v) => v,
        Err(e) => {
            r.error = Some(format!("an event is not JSON ({e}): {}", data.chars().take(200).collect::<String>()));
            return;
        }
    };
    if let Some(e) = v.get("error") {
        r.error = Some(format!("error event: {}", e.get("message").and_then(Value::as_str).unwrap_or(&e.to_string())));
        return;
    }
    if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
        r.usage = Some(u.clone());
    }
    if let Some(t) = v.get("timings").filter(|t| t.is_object()) {
        r.timings = Some(t.clone());
    }
    let Some(choices) = v.get("choices").and_then(Value::as_array) else {
        r.error = Some(format!("a chunk without `choices`: {data}"));
        return;
    };
    for c in choices {
        let delta = &c["delta"];
        let mut token = false;
        if let Some(s) = delta["content"].as_str() {
            token |= !s.is_empty();
            r.content.push_str(s);
        }
        if let Some(s) = delta["reasoning_content"].as_str() {
            token |= !s.is_empty();
            r.reasoning.push_str(s);
        }
        if let Some(calls) = delta["tool_calls"].as_array() {
            for call in calls {
                token = true;
                let i = call["index"].as_u64().unwrap_or(0) as usize;
                while r.tool_calls.len() <= i {
                    r.tool_calls.push(Default::default());
                }
                let slot = &mut r.tool_calls[i];
                if let Some(id) = call["id"].as_str() {
                    slot.0 = id.to_string();
                }
                if let Some(n) = call["function"]["name"].as_str() {
                    slot.1.push_str(n);
                }
                if let Some(a) = call["function"]["arguments"].as_str() {
                    slot.2.push_str(a);
                }
            }
        }
        if token && r.first_token.is_none() {
            r.first_token = Some(Instant::now());
        }
        if let Some(f) = c["finish_reason"].as_str() {
            r.finish_reason = Some(f.to_string());
            r.first_finish.get_or_insert_with(Instant::now);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunked_decoding_survives_any_split() {
        let wire = b"5\r\nhello\r\n7;ext=1\r\n, world\r\n0\r\n\r\n";
        for cut in 0..wire.len() {
            let mut dec = Chunked::default();
            let mut out = Vec::new();
            let mut raw = wire[..cut].to_vec();
            dec.feed(&mut raw, &mut |b: &[u8]| out.extend_from_slice(b)).unwrap();
            raw.extend_from_slice(&wire[cut..]);
            dec.feed(&mut raw, &mut |b: &[u8]| out.extend_from_slice(b)).unwrap();
            assert!(dec.done, "cut {cut}");
            assert_eq!(out, b"hello, world", "cut {cut}");
        }
        let mut raw = b"zz\r\n".to_vec();
        assert!(Chunked::default().feed(&mut raw, &mut |_: &[u8]| {}).is_err());
    }

    #[test]
    fn sse_events_split_anywhere() {
        let wire = "data: {\"a\":1}\n\n: keep-alive\n\ndata: [DONE]\n\n";
        for cut in 0..wire.len() {
            let mut p = SseParser::default();
            let mut got = Vec::new();
            p.feed(&wire.as_bytes()[..cut], |d| got.push(d.to_string()));
            p.feed(&wire.as_bytes()[cut..], |d| got.push(d.to_string()));
            p.finish(|d| got.push(d.to_string()));
            assert_eq!(got, ["{\"a\":1}", "[DONE]"], "cut {cut}");
        }
    }

    #[test]
    fn urls() {
        let t = Target::parse("http://127.0.0.1:8000/v1/").unwrap();
        assert_eq!((t.host.as_str(), t.port, t.base.as_str()), ("127.0.0.1", 8000, ""));
        let t = Target::parse("localhost/prefix").unwrap();
        assert_eq!((t.host.as_str(), t.port, t.base.as_str()), ("localhost", 80, "/prefix"));
        assert!(Target::parse("https://x").is_err());
    }
}
