//! Bytes to RGB pixels: PNG, JPEG, WebP and GIF (its first frame), and the hash that names the picture.

use std::io::Cursor;

use image::{ImageFormat, ImageReader};
use sha2::{Digest, Sha256};

use crate::error::MediaError;

/// The most pixels a decoded image may have (a 16K × 16K screenshot fits; a decompression bomb does not).
pub const MAX_DECODED_PIXELS: u64 = 16384 * 16384;

/// An image decoded to 8-bit RGB, rows top to bottom, pixels `[r, g, b]` left to right.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RgbImage {
    pub width: u32,
    pub height: u32,
    pub rgb: Vec<u8>,
}

impl RgbImage {
    /// SHA-256 of the dimensions and the decoded pixels: the same picture in any encoding hashes the same.
    pub fn hash(&self) -> [u8; 32] {
        let mut h = Sha256::new();
        h.update(self.width.to_le_bytes());
        h.update(self.height.to_le_bytes());
        h.update(&self.rgb);
        h.finalize().into()
    }
}

/// Decodes an encoded image; other formats, truncated or corrupt bytes and oversized images are refused.
pub fn decode(bytes: &[u8]) -> Result<RgbImage, MediaError> {
    let format = image::guess_format(bytes)
        .map_err(|_| MediaError::Undecodable("the bytes are not a recognised image format".into()))?;
    if !matches!(format, ImageFormat::Png | ImageFormat::Jpeg | ImageFormat::WebP | ImageFormat::Gif) {
        return Err(MediaError::UnsupportedFormat(format!("{format:?}").to_uppercase()));
    }
    let reader = || ImageReader::with_format(Cursor::new(bytes), format);
    let (width, height) = reader().into_dimensions().map_err(|e| MediaError::Undecodable(e.to_string()))?;
    if u64::from(width) * u64::from(height) > MAX_DECODED_PIXELS {
        return Err(MediaError::TooLarge { width, height, max: MAX_DECODED_PIXELS });
    }
    if format == ImageFormat::Jpeg
        && let Some(img) = decode_jpeg(bytes)?
    {
        return Ok(img);
    }
    let mut r = reader();
    r.no_limits();
    let img = r.decode().map_err(|e| MediaError::Undecodable(e.to_string()))?;
    let rgb = img.into_rgb8();
    Ok(RgbImage { width: rgb.width(), height: rgb.height(), rgb: rgb.into_raw() })
}

/// 8-bit colour and grey JPEGs decoded as libjpeg does (its chroma upsampling and rounding), so the pixels
/// are the ones Pillow gives; None for other kinds (CMYK, 16-bit), which the generic decoder takes.
fn decode_jpeg(bytes: &[u8]) -> Result<Option<RgbImage>, MediaError> {
    let mut d = jpeg_decoder::Decoder::new(Cursor::new(bytes));
    let pixels = d.decode().map_err(|e| MediaError::Undecodable(e.to_string()))?;
    let Some(info) = d.info() else { return Ok(None) };
    let rgb = match info.pixel_format {
        jpeg_decoder::PixelFormat::RGB24 => pixels,
        jpeg_decoder::PixelFormat::L8 => pixels.iter().flat_map(|&v| [v, v, v]).collect(),
        _ => return Ok(None),
    };
    Ok(Some(RgbImage { width: u32::from(info.width), height: u32::from(info.height), rgb }))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Encodes a small RGBA test picture in `format`.
    pub(crate) fn encoded(format: ImageFormat, width: u32, height: u32) -> Vec<u8> {
        let img = image::RgbaImage::from_fn(width, height, |x, y| {
            image::Rgba([(x * 7 % 256) as u8, (y * 11 % 256) as u8, ((x + y) * 3 % 256) as u8, 255])
        });
        let mut out = Cursor::new(Vec::new());
        if format == ImageFormat::Jpeg {
            image::DynamicImage::ImageRgba8(img).into_rgb8().write_to(&mut out, format).unwrap();
        } else {
            img.write_to(&mut out, format).unwrap();
        }
        out.into_inner()
    }

    #[test]
    fn decodes_each_supported_format_to_rgb() {
        for format in [ImageFormat::Png, ImageFormat::Jpeg, ImageFormat::WebP, ImageFormat::Gif] {
            let img = decode(&encoded(format, 9, 5)).unwrap_or_else(|e| panic!("{format:?}: {e}"));
            assert_eq!((img.width, img.height, img.rgb.len()), (9, 5, 9 * 5 * 3), "{format:?}");
        }
    }

    #[test]
    fn lossless_formats_agree_and_hash_names_the_pixels() {
        let png = decode(&encoded(ImageFormat::Png, 9, 5)).unwrap();
        let webp = decode(&encoded(ImageFormat::WebP, 9, 5)).unwrap();
        assert_eq!(png, webp);
        assert_eq!(png.hash(), webp.hash());
        let other = decode(&encoded(ImageFormat::Png, 5, 9)).unwrap();
        assert_ne!(png.hash(), other.hash());
    }

    #[test]
    fn refuses_garbage_truncated_and_other_formats() {
        assert!(matches!(decode(b"hello, world"), Err(MediaError::Undecodable(_))));
        let png = encoded(ImageFormat::Png, 9, 5);
        assert!(matches!(decode(&png[..png.len() / 2]), Err(MediaError::Undecodable(_))));
        let bmp = b"BM\x3a\0\0\0\0\0\0\0\x36\0\0\0\x28\0\0\0";
        let err = decode(bmp).unwrap_err();
        assert!(matches!(err, MediaError::UnsupportedFormat(_)), "{err}");
        assert!(err.to_string().contains("BMP"), "{err}");
    }
}
