//! Processed images kept by the hash of their encoded bytes. An agent's conversation sends every earlier
//! screenshot again with each turn; decoding and patching a 1080p screenshot again costs tens of milliseconds
//! of the turn's first token, each time. The cache is bounded by the bytes of the patches it holds (least
//! recently used first out); the work happens outside its lock.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use deltaserve_model::ImagePatches;
use sha2::{Digest, Sha256};

/// Processed images by the SHA-256 of their encoded bytes, up to a byte budget.
pub struct ImageCache {
    capacity: usize,
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    map: HashMap<[u8; 32], Entry>,
    bytes: usize,
    clock: u64,
    hits: u64,
    misses: u64,
}

struct Entry {
    patches: Arc<ImagePatches>,
    bytes: usize,
    used: u64,
}

/// The bytes an image's patches take in memory.
fn patch_bytes(p: &ImagePatches) -> usize {
    std::mem::size_of_val(p.pixels.as_slice()) + std::mem::size_of::<ImagePatches>()
}

impl ImageCache {
    /// A cache holding up to `capacity` bytes of patches (0: none kept).
    pub fn new(capacity: usize) -> ImageCache {
        ImageCache { capacity, inner: Mutex::new(Inner::default()) }
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// The image of `encoded` (its bytes as fetched, or from a data URL): kept from an earlier request, else
    /// made by `make` (decoded and patched) and kept if it fits.
    pub fn get_or_insert<E>(
        &self,
        encoded: &[u8],
        make: impl FnOnce() -> Result<Arc<ImagePatches>, E>,
    ) -> Result<Arc<ImagePatches>, E> {
        if self.capacity == 0 {
            return make();
        }
        let key: [u8; 32] = Sha256::digest(encoded).into();
        {
            let mut g = self.lock();
            g.clock += 1;
            let now = g.clock;
            if let Some(e) = g.map.get_mut(&key) {
                e.used = now;
                let p = e.patches.clone();
                g.hits += 1;
                return Ok(p);
            }
            g.misses += 1;
        }
        let patches = make()?;
        let bytes = patch_bytes(&patches);
        if bytes <= self.capacity {
            let mut g = self.lock();
            if let Some(old) = g.map.remove(&key) {
                g.bytes -= old.bytes;
            }
            while g.bytes + bytes > self.capacity {
                let Some((&oldest, _)) = g.map.iter().min_by_key(|(_, e)| e.used) else { break };
                if let Some(e) = g.map.remove(&oldest) {
                    g.bytes -= e.bytes;
                }
            }
            g.clock += 1;
            let used = g.clock;
            g.bytes += bytes;
            g.map.insert(key, Entry { patches: patches.clone(), bytes, used });
        }
        Ok(patches)
    }

    /// (hits, misses, images kept, bytes kept).
    pub fn stats(&self) -> (u64, u64, usize, usize) {
        let g = self.lock();
        (g.hits, g.misses, g.map.len(), g.bytes)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // A panic while holding the lock leaves consistent counts (every update is a few statements).
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl std::fmt::Debug for ImageCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (hits, misses, images, bytes) = self.stats();
        f.debug_struct("ImageCache")
            .field("capacity", &self.capacity)
            .field("images", &images)
            .field("bytes", &bytes)
            .field("hits", &hits)
            .field("misses", &misses)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn patches(values: usize, tag: u8) -> Arc<ImagePatches> {
        Arc::new(ImagePatches { grid_thw: [1, 1, 1], pixels: vec![f32::from(tag); values], hash: [tag; 32] })
    }

    #[test]
    fn the_same_bytes_are_made_once_and_the_least_recent_go_first() {
        let one = patch_bytes(&patches(1000, 0));
        let cache = ImageCache::new(2 * one + 10);
        let mut made = 0;
        let mut get = |bytes: &[u8], tag: u8| {
            cache
                .get_or_insert(bytes, || {
                    made += 1;
                    Ok::<_, ()>(patches(1000, tag))
                })
                .unwrap()
        };
        let a = get(b"image a", 1);
        assert!(Arc::ptr_eq(&a, &get(b"image a", 9)), "a hit returns the kept image");
        get(b"image b", 2);
        get(b"image a", 9); // a is now more recent than b
        get(b"image c", 3); // evicts b
        assert_eq!(get(b"image a", 9).hash, [1; 32]);
        assert_eq!(get(b"image b", 4).hash, [4; 32], "b was evicted and made again");
        assert_eq!(made, 4);
        let (hits, misses, images, bytes) = cache.stats();
        assert_eq!((hits, misses, images, bytes), (3, 4, 2, 2 * one));
    }

    #[test]
    fn oversized_images_and_a_zero_budget_keep_nothing_and_errors_pass_through() {
        let cache = ImageCache::new(100);
        let big = cache.get_or_insert(b"big", || Ok::<_, ()>(patches(1000, 1))).unwrap();
        assert_eq!(big.pixels.len(), 1000);
        assert_eq!(cache.stats().2, 0);
        assert_eq!(cache.get_or_insert(b"bad", || Err::<Arc<ImagePatches>, _>("undecodable")), Err("undecodable"));
        let off = ImageCache::new(0);
        let x = off.get_or_insert(b"x", || Ok::<_, ()>(patches(1, 1))).unwrap();
        let y = off.get_or_insert(b"x", || Ok::<_, ()>(patches(1, 1))).unwrap();
        assert!(!Arc::ptr_eq(&x, &y) && off.stats() == (0, 0, 0, 0));
    }
}
