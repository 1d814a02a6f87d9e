//! The ways an image in a request can be refused, each with a message a client can act on.

/// Why an image could not be turned into patches.
#[derive(Debug, thiserror::Error)]
pub enum MediaError {
    /// The bytes are not an image in one of the supported formats.
    #[error("the image could not be decoded: {0}")]
    Undecodable(String),
    /// The bytes are an image, but in a format the server does not read.
    #[error("unsupported image format {0}; send PNG, JPEG, WebP or GIF")]
    UnsupportedFormat(String),
    /// The image is smaller than the image processor accepts.
    #[error("the image is {width}×{height} pixels; both sides must be at least {min} pixels")]
    TooSmall { width: u32, height: u32, min: u32 },
    /// The image is too long and thin for the image processor.
    #[error("the image is {width}×{height} pixels; its aspect ratio must be at most {max}:1")]
    ExtremeAspect { width: u32, height: u32, max: u32 },
    /// The image is larger than the decoder will hold.
    #[error("the image is {width}×{height} pixels; at most {max} pixels are accepted")]
    TooLarge { width: u32, height: u32, max: u64 },
    /// A `data:` URL that is not `data:image/...;base64,...`.
    #[error("invalid data URL: {0}")]
    BadDataUrl(String),
    /// The URL's scheme is neither `data`, `http` nor `https`.
    #[error("unsupported image URL {0:?}; use a data: URL or an http(s) URL")]
    UnsupportedUrl(String),
    /// The URL's host is not in `--allowed-media-domains`.
    #[error("fetching images from {host:?} is not allowed; the server allows {allowed}")]
    DomainNotAllowed { host: String, allowed: String },
    /// The fetch failed (network, status, size, timeout).
    #[error("fetching the image from {url} failed: {reason}")]
    FetchFailed { url: String, reason: String },
}

/// Why a `preprocessor_config.json` could not be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read {path}: {source}")]
    Io { path: String, source: std::io::Error },
    #[error("invalid preprocessor config {path}: {message}")]
    Invalid { path: String, message: String },
}
