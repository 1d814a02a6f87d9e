//! The bytes an image URL names: `data:` URLs decoded in place, http(s) URLs fetched from allowed domains
//! only, with a size limit and a timeout.

use std::io::Read;
use std::time::Duration;

use base64::Engine;

use crate::error::MediaError;

/// Which image URLs the server fetches, and how much it will wait for and read.
#[derive(Clone, Debug)]
pub struct FetchPolicy {
    /// Hosts images may be fetched from (a host also allows its subdomains; `*` allows every host). Empty:
    /// only `data:` URLs are accepted.
    pub allowed_domains: Vec<String>,
    /// The most bytes one image may have.
    pub max_bytes: u64,
    /// The longest a fetch may take, from connecting to the last byte.
    pub timeout: Duration,
}

impl Default for FetchPolicy {
    fn default() -> Self {
        Self { allowed_domains: Vec::new(), max_bytes: 20 << 20, timeout: Duration::from_secs(10) }
    }
}

impl FetchPolicy {
    fn allows(&self, host: &str) -> bool {
        let host = host.trim_end_matches('.').to_ascii_lowercase();
        self.allowed_domains.iter().any(|d| {
            let d = d.trim_end_matches('.').to_ascii_lowercase();
            d == "*" || host == d || host.strip_suffix(&d).is_some_and(|rest| rest.ends_with('.'))
        })
    }
}

/// The encoded image bytes a URL names.
pub fn load(url: &str, policy: &FetchPolicy) -> Result<Vec<u8>, MediaError> {
    let scheme = url.split_once(':').map(|(s, _)| s.to_ascii_lowercase()).unwrap_or_default();
    match scheme.as_str() {
        "data" => data_url(url, policy.max_bytes),
        "http" | "https" => fetch(url, policy),
        _ => Err(MediaError::UnsupportedUrl(shorten(url))),
    }
}

fn data_url(url: &str, max_bytes: u64) -> Result<Vec<u8>, MediaError> {
    let rest = &url["data:".len()..];
    let (meta, payload) =
        rest.split_once(',').ok_or_else(|| MediaError::BadDataUrl("no ',' before the data".into()))?;
    let Some(media_type) = meta.strip_suffix(";base64") else {
        return Err(MediaError::BadDataUrl("only base64 data URLs (data:image/...;base64,...) are accepted".into()));
    };
    let media_type = media_type.split(';').next().unwrap_or("").to_ascii_lowercase();
    if !media_type.is_empty() && !media_type.starts_with("image/") {
        return Err(MediaError::BadDataUrl(format!("media type {media_type:?} is not an image")));
    }
    if payload.len() as u64 / 4 * 3 > max_bytes {
        return Err(MediaError::BadDataUrl(format!("the image is larger than {max_bytes} bytes")));
    }
    let payload: String = payload.chars().filter(|c| !c.is_ascii_whitespace()).collect();
    base64::engine::general_purpose::STANDARD
        .decode(payload)
        .map_err(|e| MediaError::BadDataUrl(format!("invalid base64: {e}")))
}

fn fetch(url: &str, policy: &FetchPolicy) -> Result<Vec<u8>, MediaError> {
    let failed = |reason: String| MediaError::FetchFailed { url: shorten(url), reason };
    let agent = ureq::AgentBuilder::new().timeout(policy.timeout).redirects(0).build();
    let request = agent.get(url);
    let host = request.request_url().map_err(|e| failed(e.to_string()))?.host().to_string();
    if !policy.allows(&host) {
        let allowed = if policy.allowed_domains.is_empty() {
            "no domains (start it with --allowed-media-domains to fetch image URLs)".to_string()
        } else {
            policy.allowed_domains.join(", ")
        };
        return Err(MediaError::DomainNotAllowed { host, allowed });
    }
    let response = request.call().map_err(|e| match e {
        ureq::Error::Status(code, _) => failed(format!("HTTP status {code}")),
        other => failed(other.to_string()),
    })?;
    if response.status() != 200 {
        return Err(failed(format!("HTTP status {}", response.status())));
    }
    let too_big = || failed(format!("the image is larger than {} bytes", policy.max_bytes));
    if response.header("content-length").and_then(|v| v.parse::<u64>().ok()).is_some_and(|n| n > policy.max_bytes) {
        return Err(too_big());
    }
    let mut bytes = Vec::new();
    response.into_reader().take(policy.max_bytes + 1).read_to_end(&mut bytes).map_err(|e| failed(e.to_string()))?;
    if bytes.len() as u64 > policy.max_bytes {
        return Err(too_big());
    }
    Ok(bytes)
}

/// A URL short enough for an error message (data URLs can be megabytes).
fn shorten(url: &str) -> String {
    match url.char_indices().nth(80) {
        Some((i, _)) => format!("{}…", &url[..i]),
        None => url.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::net::TcpListener;

    use super::*;

    /// Serves `body` with `status` to every connection on a local port; returns the base URL.
    fn serve(status: &'static str, body: Vec<u8>) -> String {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut s) = stream else { continue };
                let mut buf = [0u8; 4096];
                let _ = s.read(&mut buf);
                let head = format!("HTTP/1.1 {status}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n", body.len());
                let _ = s.write_all(head.as_bytes());
                let _ = s.write_all(&body);
            }
        });
        format!("http://{addr}")
    }

    fn allow(domains: &[&str]) -> FetchPolicy {
        FetchPolicy { allowed_domains: domains.iter().map(|d| d.to_string()).collect(), ..Default::default() }
    }

    #[test]
    fn data_urls_decode_and_bad_ones_are_refused() {
        let p = FetchPolicy::default();
        assert_eq!(load("data:image/png;base64,aGVsbG8=", &p).unwrap(), b"hello");
        assert_eq!(load("DATA:;base64,aGVs\nbG8=", &p).unwrap(), b"hello");
        let err = load("data:image/png,hello", &p).unwrap_err();
        assert!(err.to_string().contains("only base64"), "{err}");
        let err = load("data:video/mp4;base64,aGVsbG8=", &p).unwrap_err();
        assert!(err.to_string().contains("not an image"), "{err}");
        assert!(matches!(load("data:image/png;base64,!!!", &p), Err(MediaError::BadDataUrl(_))));
        assert!(matches!(load("ftp://x/y.png", &p), Err(MediaError::UnsupportedUrl(_))));
    }

    #[test]
    fn fetches_only_from_allowed_domains() {
        let base = serve("200 OK", b"picture".to_vec());
        let err = load(&format!("{base}/a.png"), &FetchPolicy::default()).unwrap_err();
        assert!(matches!(err, MediaError::DomainNotAllowed { .. }), "{err}");
        assert!(err.to_string().contains("--allowed-media-domains"), "{err}");
        let err = load(&format!("{base}/a.png"), &allow(&["example.com"])).unwrap_err();
        assert!(err.to_string().contains("\"127.0.0.1\""), "{err}");
        assert_eq!(load(&format!("{base}/a.png"), &allow(&["127.0.0.1"])).unwrap(), b"picture");
        assert_eq!(load(&format!("{base}/a.png"), &allow(&["*"])).unwrap(), b"picture");
    }

    #[test]
    fn subdomains_of_an_allowed_domain_are_allowed() {
        let p = allow(&["Example.com"]);
        assert!(p.allows("example.com") && p.allows("img.example.com"));
        assert!(!p.allows("badexample.com") && !p.allows("example.com.evil.org"));
    }

    #[test]
    fn status_errors_and_oversized_bodies_fail() {
        let missing = serve("404 Not Found", b"nope".to_vec());
        let err = load(&format!("{missing}/a.png"), &allow(&["*"])).unwrap_err();
        assert!(err.to_string().contains("HTTP status 404"), "{err}");
        let big = serve("200 OK", vec![7; 100]);
        let p = FetchPolicy { max_bytes: 50, ..allow(&["*"]) };
        let err = load(&format!("{big}/a.png"), &p).unwrap_err();
        assert!(err.to_string().contains("larger than 50 bytes"), "{err}");
    }
}
