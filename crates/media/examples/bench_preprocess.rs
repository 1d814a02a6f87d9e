//! What an image costs the server before the model sees it: decode and preprocess (resize, normalise, patch)
//! screenshots of common sizes, PNG-encoded, and the same bytes again through the processed-image cache
//! (what each later turn of an agent's conversation pays for an earlier screenshot).
//!
//! `cargo run --release -p deltaserve-media --example bench_preprocess [ROUNDS]` (default 5; medians).

use std::io::Cursor;
use std::sync::Arc;
use std::time::Instant;

use deltaserve_media::{ImageCache, ImageProcessorConfig, decode, preprocess};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// A screenshot-like picture: flat panels, text-like stripes and a gradient, PNG-encoded.
fn screenshot(w: u32, h: u32) -> Vec<u8> {
    let img = image::RgbImage::from_fn(w, h, |x, y| {
        let panel = ((x / 320) + (y / 180)) % 3;
        let text = if (y % 18) < 11 && (x % 9) < 6 && (x / 40 + y / 18) % 5 != 0 { 60 } else { 0 };
        let base = [235u8, 242, 250][panel as usize];
        image::Rgb([base - text, base - text / 2, (x * 255 / w) as u8])
    });
    let mut out = Cursor::new(Vec::new());
    img.write_to(&mut out, image::ImageFormat::Png).expect("PNG encoding");
    out.into_inner()
}

fn main() {
    let rounds: usize = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(5).max(1);
    let cfg = ImageProcessorConfig::qwen35();
    println!("| screenshot | PNG | patches | decode ms | preprocess ms | again, from the cache ms |");
    println!("|---|---|---|---|---|---|");
    for (w, h) in [(1280u32, 720u32), (1920, 1080), (2560, 1440)] {
        let png = screenshot(w, h);
        let (mut dec, mut pre, mut hit) = (Vec::new(), Vec::new(), Vec::new());
        let mut patches = 0;
        for _ in 0..rounds {
            let cache = ImageCache::new(1 << 30);
            let t = Instant::now();
            let img = decode(&png).expect("decodes");
            dec.push(t.elapsed().as_secs_f64() * 1e3);
            let t = Instant::now();
            let p = preprocess(&cfg, &img).expect("preprocesses");
            pre.push(t.elapsed().as_secs_f64() * 1e3);
            patches = p.patches();
            let p = Arc::new(p);
            cache.get_or_insert(&png, || Ok::<_, ()>(p.clone())).unwrap();
            let t = Instant::now();
            let again = cache.get_or_insert(&png, || Err(())).expect("kept");
            hit.push(t.elapsed().as_secs_f64() * 1e3);
            assert!(Arc::ptr_eq(&again, &p));
        }
        println!(
            "| {w}×{h} | {:.2} MB | {patches} | {:.1} | {:.1} | {:.2} |",
            png.len() as f64 / 1e6,
            median(dec),
            median(pre),
            median(hit)
        );
    }
}
