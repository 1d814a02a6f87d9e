//! Images in chat requests: the image parts of the messages, loaded (fetched, decoded, patched; an image
//! sent before comes from the processed-image cache) off the async runtime before the request is queued, and
//! each image's placeholder token expanded to the tokens the image takes.

use std::path::Path;
use std::sync::Arc;

use deltaserve_media::{ConfigError, ImageProcessorConfig, decode, load, preprocess};
pub use deltaserve_media::{FetchPolicy, ImageCache};
use deltaserve_model::ImagePatches;

use crate::error::ApiError;
use crate::state::AppState;

/// The placeholder the chat template renders for each image (between `<|vision_start|>` and
/// `<|vision_end|>`).
pub const IMAGE_PAD: &str = "<|image_pad|>";

/// How the server takes images.
#[derive(Clone, Debug)]
pub struct MediaConfig {
    /// The checkpoint's image processor.
    pub processor: ImageProcessorConfig,
    /// Which image URLs are fetched, with the size limit and timeout.
    pub fetch: FetchPolicy,
    /// The most images one request may carry (`--limit-images-per-request`).
    pub max_images: usize,
    /// Processed images by their encoded bytes (`--image-cache`): an image sent again (every earlier
    /// screenshot of an agent's conversation, each turn) is not decoded and patched again.
    pub cache: Arc<ImageCache>,
}

/// `--limit-images-per-request`'s default.
pub const DEFAULT_MAX_IMAGES: usize = 32;

/// `--image-cache`'s default: 1 GiB of patches (about twenty 1080p screenshots at Qwen3.5's image processor).
pub const DEFAULT_IMAGE_CACHE_BYTES: usize = 1 << 30;

impl Default for MediaConfig {
    fn default() -> Self {
        Self {
            processor: ImageProcessorConfig::qwen35(),
            fetch: FetchPolicy::default(),
            max_images: DEFAULT_MAX_IMAGES,
            cache: Arc::new(ImageCache::new(DEFAULT_IMAGE_CACHE_BYTES)),
        }
    }
}

impl MediaConfig {
    /// The defaults with the image processor of the model directory `dir` (its `preprocessor_config.json`,
    /// else Qwen3.5's).
    pub fn for_model_dir(dir: &Path) -> Result<Self, ConfigError> {
        Ok(Self { processor: ImageProcessorConfig::for_model_dir(dir)?, ..Self::default() })
    }
}

/// One image part of a request: where it is (`messages[1].content[2]`, for errors) and its URL.
#[derive(Clone, Debug, PartialEq)]
pub struct ImagePart {
    pub location: String,
    pub url: String,
}

/// The image URL of an OpenAI `image_url` part (`{"url": ...}` or, as some clients send, the string).
pub fn image_url(part: &serde_json::Value) -> Option<&str> {
    let v = part.get("image_url")?;
    v.as_str().or_else(|| v.get("url").and_then(serde_json::Value::as_str))
}

/// Loads the request's images in order: at most `max_images`, each fetched or decoded and patched on a
/// blocking thread. A failure names the part.
pub async fn load_images(st: &AppState, parts: Vec<ImagePart>) -> Result<Vec<Arc<ImagePatches>>, ApiError> {
    if parts.is_empty() {
        return Ok(Vec::new());
    }
    let cfg = st.media.clone();
    if parts.len() > cfg.max_images {
        return Err(ApiError::bad_param(
            "messages",
            format!(
                "the request has {}; at most {} are accepted (--limit-images-per-request)",
                count(parts.len(), "image"),
                cfg.max_images
            ),
        ));
    }
    if st.tokenizer.token_id(IMAGE_PAD).is_none() {
        return Err(ApiError::bad_param("messages", format!("the model's tokenizer has no {IMAGE_PAD} token")));
    }
    tokio::task::spawn_blocking(move || load_all(&cfg, &parts))
        .await
        .map_err(|e| ApiError::Internal(format!("loading images: {e}")))?
}

/// The images of `parts` in order, up to [`IMAGES_AT_ONCE`] loaded at a time (each also splits its own
/// preprocessing over threads); the first failing part's error.
fn load_all(cfg: &MediaConfig, parts: &[ImagePart]) -> Result<Vec<Arc<ImagePatches>>, ApiError> {
    let mut out = Vec::with_capacity(parts.len());
    for group in parts.chunks(IMAGES_AT_ONCE) {
        let loaded: Vec<Result<Arc<ImagePatches>, ApiError>> = if group.len() == 1 {
            vec![load_one(cfg, &group[0])]
        } else {
            std::thread::scope(|s| {
                let hs: Vec<_> = group.iter().map(|p| s.spawn(move || load_one(cfg, p))).collect();
                hs.into_iter()
                    .map(|h| h.join().unwrap_or_else(|_| Err(ApiError::Internal("loading an image panicked".into()))))
                    .collect()
            })
        };
        for r in loaded {
            out.push(r?);
        }
    }
    Ok(out)
}

/// Images of one request decoded and patched at once.
const IMAGES_AT_ONCE: usize = 4;

fn load_one(cfg: &MediaConfig, part: &ImagePart) -> Result<Arc<ImagePatches>, ApiError> {
    let at = |e: deltaserve_media::MediaError| ApiError::bad_param("messages", format!("{}: {e}", part.location));
    let bytes = load(&part.url, &cfg.fetch).map_err(at)?;
    cfg.cache
        .get_or_insert(&bytes, || {
            let img = decode(&bytes)?;
            Ok(Arc::new(preprocess(&cfg.processor, &img)?))
        })
        .map_err(at)
}

/// The prompt with each image's single placeholder `pad` replaced by the image's `tokens(merge)` copies.
pub fn expand_placeholders(
    ids: Vec<u32>,
    pad: u32,
    images: &[Arc<ImagePatches>],
    merge: usize,
) -> Result<Vec<u32>, ApiError> {
    let found = ids.iter().filter(|&&t| t == pad).count();
    if found != images.len() {
        return Err(ApiError::bad_param(
            "messages",
            format!(
                "the prompt has {} ({IMAGE_PAD}) for {}",
                count(found, "image placeholder"),
                count(images.len(), "image")
            ),
        ));
    }
    let extra: usize = images.iter().map(|img| img.tokens(merge).saturating_sub(1)).sum();
    let mut out = Vec::with_capacity(ids.len() + extra);
    let mut next = images.iter();
    for t in ids {
        if t == pad
            && let Some(img) = next.next()
        {
            out.extend(std::iter::repeat_n(pad, img.tokens(merge)));
        } else {
            out.push(t);
        }
    }
    Ok(out)
}

/// Refuses a prompt with images that does not fit the context, saying how many tokens the images take.
pub fn check_context(
    prompt: usize,
    images: &[Arc<ImagePatches>],
    merge: usize,
    max_context: usize,
) -> Result<(), ApiError> {
    if images.is_empty() || prompt <= max_context {
        return Ok(());
    }
    let image_tokens: usize = images.iter().map(|img| img.tokens(merge)).sum();
    Err(ApiError::bad_param(
        "messages",
        format!(
            "the prompt takes {prompt} tokens, {image_tokens} of them for {}, more than the context of {max_context} tokens",
            count(images.len(), "image")
        ),
    ))
}

/// "1 image", "2 images".
fn count(n: usize, noun: &str) -> String {
    if n == 1 { format!("1 {noun}") } else { format!("{n} {noun}s") }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn image(h: usize, w: usize) -> Arc<ImagePatches> {
        Arc::new(ImagePatches { grid_thw: [1, h, w], pixels: Vec::new(), hash: [0; 32] })
    }

    #[test]
    fn each_placeholder_becomes_its_images_tokens() {
        let ids = vec![1, 9, 2, 9, 3];
        let out = expand_placeholders(ids, 9, &[image(4, 6), image(2, 2)], 2).unwrap();
        assert_eq!(out, [1, 9, 9, 9, 9, 9, 9, 2, 9, 3]);
        let err = expand_placeholders(vec![1, 9, 9], 9, &[image(2, 2)], 2).unwrap_err();
        assert!(err.message().contains("2 image placeholders (<|image_pad|>) for 1 image"), "{}", err.message());
    }

    #[test]
    fn image_prompts_over_the_context_are_refused_with_the_image_tokens() {
        let imgs = [image(8, 8)];
        assert!(check_context(20, &imgs, 2, 20).is_ok());
        let err = check_context(21, &imgs, 2, 20).unwrap_err();
        assert_eq!(err.status(), axum::http::StatusCode::BAD_REQUEST);
        assert!(err.message().contains("16 of them for 1 image,"), "{}", err.message());
        assert!(check_context(21, &[], 2, 20).is_ok());
    }

    /// An image sent again (the same bytes) is the one decoded and patched the first time; with no cache
    /// every request makes its own; a bad image is still refused naming its part.
    #[test]
    fn an_image_sent_again_comes_from_the_cache() {
        const PIXEL_PNG: &str = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kgAAAABJRU5ErkJggg==";
        let part = |url: &str| ImagePart { location: "messages[0].content[1]".into(), url: url.into() };
        let cfg = MediaConfig::default();
        let a = load_one(&cfg, &part(PIXEL_PNG)).unwrap();
        let b = load_one(&cfg, &part(PIXEL_PNG)).unwrap();
        assert!(Arc::ptr_eq(&a, &b));
        assert_eq!(cfg.cache.stats().0, 1);
        let off = MediaConfig { cache: Arc::new(ImageCache::new(0)), ..MediaConfig::default() };
        let (c, d) = (load_one(&off, &part(PIXEL_PNG)).unwrap(), load_one(&off, &part(PIXEL_PNG)).unwrap());
        assert!(!Arc::ptr_eq(&c, &d) && c.pixels == a.pixels);
        let err = load_one(&cfg, &part("data:image/png;base64,aGVsbG8=")).unwrap_err();
        assert!(err.message().contains("messages[0].content[1]"), "{}", err.message());
    }

    /// A request's images come back in order whatever order their loads finish in, and the first bad part
    /// (in the request's order) is the error.
    #[test]
    fn a_requests_images_load_together_in_order() {
        let png = |side: u32, shade: u8| {
            let img = image::RgbImage::from_pixel(side, side, image::Rgb([shade, 0, 0]));
            let mut out = std::io::Cursor::new(Vec::new());
            img.write_to(&mut out, image::ImageFormat::Png).unwrap();
            format!(
                "data:image/png;base64,{}",
                base64::Engine::encode(&base64::engine::general_purpose::STANDARD, out.into_inner())
            )
        };
        let part = |i: usize, url: String| ImagePart { location: format!("messages[0].content[{i}]"), url };
        let parts: Vec<ImagePart> = (0..6).map(|i| part(i, png(64 + 32 * i as u32, i as u8))).collect();
        let cfg = MediaConfig::default();
        let got = load_all(&cfg, &parts).unwrap();
        let want: Vec<Arc<ImagePatches>> = parts.iter().map(|p| load_one(&cfg, p).unwrap()).collect();
        assert_eq!(got.len(), 6);
        assert!(got.iter().zip(&want).all(|(a, b)| a.grid_thw == b.grid_thw && a.hash == b.hash));
        let mut bad = parts.clone();
        bad[2].url = "data:image/png;base64,aGVsbG8=".into();
        bad[4].url = "data:image/png;base64,aGVsbG8=".into();
        let err = load_all(&cfg, &bad).unwrap_err();
        assert!(err.message().contains("messages[0].content[2]"), "{}", err.message());
    }

    #[test]
    fn image_url_reads_object_and_string_forms() {
        let obj = serde_json::json!({"type": "image_url", "image_url": {"url": "data:x"}});
        assert_eq!(image_url(&obj), Some("data:x"));
        assert_eq!(image_url(&serde_json::json!({"image_url": "http://a/b"})), Some("http://a/b"));
        assert_eq!(image_url(&serde_json::json!({"image_url": 3})), None);
    }
}
