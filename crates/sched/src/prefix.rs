//! The prefix cache of a hybrid model. An attention layer's KV pages alone cannot resume a sequence:
//! the DeltaNet layers also need their recurrent + conv state at exactly the same position. So an
//! entry here is a prefix `tokens[0..len]` with both: references to the KV pages covering it (shared,
//! content-addressed by the prefix's hash chain) and a state snapshot taken at `len`.
//!
//! Snapshots live in two tiers: the plan's device pool and a pinned host pool. When the device pool
//! is full the least valuable entry moves to the host (a copy, restored later by a copy); when the
//! host pool is full, or pages are needed, the least valuable entry is dropped. Value is recompute
//! saved per byte held: tokens beyond the entry's longest cached ancestor, times (1 + hits), over the
//! snapshot bytes plus the pages it adds — not plain LRU (ties go to the least recently used).
//!
//! Entries are keyed by token ids, except where a prompt holds media: an image's placeholder tokens
//! (all the same id) are keyed by the image's pixel hash ([`MediaSpan`], [`cache_key`]), so the same
//! image sent again hits and a different image of the same size never does.
//!
//! Pure bookkeeping: page references are taken and released by the caller (the scheduler).

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};

use deltaserve_backend::{CacheOp, SnapshotLoc};

/// Tokens `start..start + len` of a prompt stand for a piece of media (an image's placeholders) whose
/// content hash is `hash`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MediaSpan {
    pub start: usize,
    pub len: usize,
    pub hash: [u8; 32],
}

/// The key ids of `tokens` (a sequence's first tokens) in the prefix cache: the tokens, with each
/// media span's placeholders replaced by ids drawn from its hash (bit 31 set, which no vocabulary
/// reaches, so they never equal a token; successive placeholders take successive 31-bit words of the
/// hash, mixed with their index).
pub fn cache_key<'a>(tokens: &'a [u32], media: &[MediaSpan]) -> Cow<'a, [u32]> {
    let inside = |m: &&MediaSpan| m.start < tokens.len();
    if !media.iter().any(|m| inside(&m)) {
        return Cow::Borrowed(tokens);
    }
    let mut key = tokens.to_vec();
    for m in media.iter().filter(inside) {
        let end = (m.start + m.len).min(key.len());
        for (i, k) in key[m.start..end].iter_mut().enumerate() {
            let w = (i % 8) * 4;
            let word = u32::from_le_bytes([m.hash[w], m.hash[w + 1], m.hash[w + 2], m.hash[w + 3]]);
            *k = 0x8000_0000 | ((word ^ ((i / 8) as u32).wrapping_mul(0x9E37_79B9)) & 0x7FFF_FFFF);
        }
    }
    Cow::Owned(key)
}

/// Capacities and sizes, from the plan.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PrefixCacheConfig {
    pub device_slots: usize,
    pub host_slots: usize,
    pub page_size: usize,
    pub snapshot_bytes: u64,
    pub page_bytes: u64,
}

impl PrefixCacheConfig {
    pub fn disabled(page_size: usize) -> Self {
        Self { device_slots: 0, host_slots: 0, page_size, snapshot_bytes: 1, page_bytes: 1 }
    }
    pub fn enabled(&self) -> bool {
        self.device_slots > 0
    }
}

#[derive(Clone, Debug)]
struct Entry {
    tokens: Vec<u32>,
    /// Pages covering positions `0..tokens.len()` (the last may be partly filled); one reference each.
    pages: Vec<u32>,
    loc: SnapshotLoc,
    /// Length of the longest other entry that was a prefix of this one when it was inserted.
    parent_len: usize,
    hits: u64,
    last_used: u64,
}

/// A usable cached prefix for a new sequence.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hit {
    pub len: usize,
    /// Pages covering `0..len` (the caller retains the full ones and copies the partial last one).
    pub pages: Vec<u32>,
    pub loc: SnapshotLoc,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefixStats {
    pub entries_device: usize,
    pub entries_host: usize,
    pub lookups: u64,
    pub hits: u64,
    pub hit_tokens: u64,
    pub evictions: u64,
    pub demotions: u64,
}

pub struct PrefixCache {
    cfg: PrefixCacheConfig,
    entries: HashMap<u64, Entry>,
    /// How many entries have each length: the positions a lookup probes.
    lengths: BTreeMap<usize, usize>,
    device_free: Vec<u32>,
    host_free: Vec<u32>,
    clock: u64,
    stats: PrefixStats,
}

/// Rolling hash of token prefixes: `h(tokens[0..i+1]) = step(h(tokens[0..i]), tokens[i])`.
fn step(h: u64, token: u32) -> u64 {
    let x = (h ^ u64::from(token)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    x ^ (x >> 29)
}

const SEED: u64 = 0x243F_6A88_85A3_08D3;

fn prefix_hash(tokens: &[u32]) -> u64 {
    tokens.iter().fold(SEED, |h, &t| step(h, t))
}

impl PrefixCache {
    pub fn new(cfg: PrefixCacheConfig) -> Self {
        Self {
            device_free: (0..cfg.device_slots as u32).rev().collect(),
            host_free: (0..cfg.host_slots as u32).rev().collect(),
            cfg,
            entries: HashMap::new(),
            lengths: BTreeMap::new(),
            clock: 0,
            stats: PrefixStats::default(),
        }
    }

    pub fn enabled(&self) -> bool {
        self.cfg.enabled()
    }

    /// The longest cached prefix of `tokens` of length at most `max_len`, marked as used.
    pub fn lookup(&mut self, tokens: &[u32], max_len: usize) -> Option<Hit> {
        if self.entries.is_empty() || max_len == 0 {
            return None;
        }
        self.stats.lookups += 1;
        let (key, _) = self.longest_entry(tokens, max_len)?;
        self.clock += 1;
        let e = self.entries.get_mut(&key).expect("found above");
        e.hits += 1;
        e.last_used = self.clock;
        self.stats.hits += 1;
        self.stats.hit_tokens += e.tokens.len() as u64;
        Some(Hit { len: e.tokens.len(), pages: e.pages.clone(), loc: e.loc })
    }

    /// The entry (key, length) of the longest cached prefix of `tokens` no longer than `max_len`: one
    /// pass of the rolling hash with a map probe at each length some entry has (O(len), not O(len²)),
    /// then the tokens of the longest entries whose hash matched compared until one is equal (the
    /// first, but for a 64-bit collision): one comparison, not one per cached ancestor.
    fn longest_entry(&self, tokens: &[u32], max_len: usize) -> Option<(u64, usize)> {
        let n = max_len.min(tokens.len());
        let (mut h, mut at) = (SEED, 0);
        let mut found = Vec::new();
        for &len in self.lengths.range(1..n + 1).map(|(len, _)| len) {
            h = tokens[at..len].iter().fold(h, |h, &t| step(h, t));
            at = len;
            if self.entries.contains_key(&h) {
                found.push((h, len));
            }
        }
        found.into_iter().rev().find(|&(key, len)| self.entries[&key].tokens[..] == tokens[..len])
    }

    /// Whether `tokens` (a whole prefix) is cached already.
    pub fn contains(&self, tokens: &[u32]) -> bool {
        self.entries.get(&prefix_hash(tokens)).is_some_and(|e| e.tokens == tokens)
    }

    /// A device snapshot slot for a new entry: free, or made free by moving the least valuable
    /// device entry to the host (ops appended to `ops`) or dropping it (its pages appended to
    /// `released`). None when the cache is disabled.
    pub fn alloc_device(&mut self, ops: &mut Vec<CacheOp>, released: &mut Vec<u32>) -> Option<SnapshotLoc> {
        self.alloc_device_sparing(ops, released, &[])
    }

    /// [`PrefixCache::alloc_device`] that never frees one of the device slots `spare` (snapshots a
    /// coming step writes: their entries must stay where they are until it ran).
    pub fn alloc_device_sparing(
        &mut self,
        ops: &mut Vec<CacheOp>,
        released: &mut Vec<u32>,
        spare: &[u32],
    ) -> Option<SnapshotLoc> {
        if !self.enabled() {
            return None;
        }
        if let Some(d) = self.device_free.pop() {
            return Some(SnapshotLoc::Device(d));
        }
        let victim = self.least_valuable(|loc| matches!(loc, SnapshotLoc::Device(d) if !spare.contains(&d)))?;
        let SnapshotLoc::Device(slot) = self.entries[&victim].loc else { unreachable!() };
        if self.cfg.host_slots > 0 {
            if self.host_free.is_empty()
                && let Some(h) = self.least_valuable(|loc| matches!(loc, SnapshotLoc::Host(_)))
            {
                released.extend(self.remove(h));
            }
            if let Some(host) = self.host_free.pop() {
                let to = SnapshotLoc::Host(host);
                ops.push(CacheOp::MoveSnapshot { from: SnapshotLoc::Device(slot), to });
                self.entries.get_mut(&victim).expect("exists").loc = to;
                self.stats.demotions += 1;
                return Some(SnapshotLoc::Device(slot));
            }
        }
        released.extend(self.remove(victim));
        self.device_free.pop().map(SnapshotLoc::Device)
    }

    /// Registers `tokens` with its pages (one reference each, already taken by the caller) and the
    /// snapshot at `loc` (from [`PrefixCache::alloc_device`]).
    pub fn insert(&mut self, tokens: Vec<u32>, pages: Vec<u32>, loc: SnapshotLoc) {
        let key = prefix_hash(&tokens);
        // (Probing every shorter length with `contains` rehashed the prefix each time: O(len²), ~0.5 s
        // per snapshot at 131K tokens.)
        let parent_len = self.longest_entry(&tokens, tokens.len().saturating_sub(1)).map_or(0, |(_, l)| l);
        self.clock += 1;
        *self.lengths.entry(tokens.len()).or_default() += 1;
        let old = self.entries.insert(key, Entry { tokens, pages, loc, parent_len, hits: 0, last_used: self.clock });
        assert!(old.is_none(), "insert of a prefix that is cached already (or a 64-bit hash collision)");
    }

    /// Drops the least valuable entry; returns the pages it held (None when empty).
    pub fn evict_one(&mut self) -> Option<Vec<u32>> {
        let victim = self.least_valuable(|_| true)?;
        Some(self.remove(victim))
    }

    /// Drops everything (e.g. after a failed step); returns the pages held.
    pub fn clear(&mut self) -> Vec<u32> {
        let keys: Vec<u64> = self.entries.keys().copied().collect();
        keys.into_iter().flat_map(|k| self.remove(k)).collect()
    }

    fn remove(&mut self, key: u64) -> Vec<u32> {
        let e = self.entries.remove(&key).expect("exists");
        if let Some(n) = self.lengths.get_mut(&e.tokens.len()) {
            *n -= 1;
            if *n == 0 {
                self.lengths.remove(&e.tokens.len());
            }
        }
        match e.loc {
            SnapshotLoc::Device(d) => self.device_free.push(d),
            SnapshotLoc::Host(h) => self.host_free.push(h),
        }
        self.stats.evictions += 1;
        e.pages
    }

    fn value(&self, e: &Entry) -> f64 {
        let ps = self.cfg.page_size;
        let saved = (e.tokens.len() - e.parent_len) as f64 * (1 + e.hits) as f64;
        let new_pages = e.tokens.len().div_ceil(ps) - e.parent_len / ps;
        saved / (self.cfg.snapshot_bytes + new_pages as u64 * self.cfg.page_bytes) as f64
    }

    fn least_valuable(&self, filter: impl Fn(SnapshotLoc) -> bool) -> Option<u64> {
        self.entries
            .iter()
            .filter(|(_, e)| filter(e.loc))
            .min_by(|a, b| self.value(a.1).total_cmp(&self.value(b.1)).then(a.1.last_used.cmp(&b.1.last_used)))
            .map(|(k, _)| *k)
    }

    /// Page references held by entries.
    pub fn page_refs(&self) -> usize {
        self.entries.values().map(|e| e.pages.len()).sum()
    }

    pub fn stats(&self) -> PrefixStats {
        let device = self.entries.values().filter(|e| matches!(e.loc, SnapshotLoc::Device(_))).count();
        PrefixStats { entries_device: device, entries_host: self.entries.len() - device, ..self.stats }
    }

    /// Panics if slots are double-booked or the probed lengths are not the entries'.
    pub fn assert_consistent(&self) {
        let mut lengths = BTreeMap::new();
        for e in self.entries.values() {
            *lengths.entry(e.tokens.len()).or_default() += 1;
        }
        assert_eq!(lengths, self.lengths, "the lengths a lookup probes are the entries'");
        let mut dev: Vec<u32> = self.device_free.clone();
        let mut host: Vec<u32> = self.host_free.clone();
        for e in self.entries.values() {
            match e.loc {
                SnapshotLoc::Device(d) => dev.push(d),
                SnapshotLoc::Host(h) => host.push(h),
            }
            assert_eq!(e.pages.len(), e.tokens.len().div_ceil(self.cfg.page_size), "entry pages cover its tokens");
        }
        dev.sort_unstable();
        host.sort_unstable();
        assert_eq!(dev, (0..self.cfg.device_slots as u32).collect::<Vec<_>>(), "device snapshot slots");
        assert_eq!(host, (0..self.cfg.host_slots as u32).collect::<Vec<_>>(), "host snapshot slots");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn media_keys_follow_the_hash_not_the_placeholder() {
        let tokens = [1, 2, 9, 9, 9, 3];
        let a = MediaSpan { start: 2, len: 3, hash: [7; 32] };
        let b = MediaSpan { hash: [8; 32], ..a.clone() };
        assert_eq!(cache_key(&tokens, &[]), &tokens[..]);
        let one = |m: &MediaSpan| vec![m.clone()];
        let (ka, kb) = (cache_key(&tokens, &one(&a)), cache_key(&tokens, &one(&b)));
        assert_eq!(ka[..2], tokens[..2]);
        assert_eq!(ka[5], 3);
        assert!(ka[2..5].iter().all(|k| *k >= 0x8000_0000));
        assert_ne!(ka, kb, "another image of the same size is another key");
        assert_eq!(ka, cache_key(&tokens, &one(&a)), "the same image is the same key");
        // A prefix that ends inside the image keys the rows it holds.
        assert_eq!(cache_key(&tokens[..3], &one(&a))[..], ka[..3]);
        assert_eq!(cache_key(&tokens[..2], &[a]), &tokens[..2]);
    }

    const PS: usize = 16;

    fn cache(device_slots: usize) -> PrefixCache {
        PrefixCache::new(PrefixCacheConfig {
            device_slots,
            host_slots: 0,
            page_size: PS,
            snapshot_bytes: 1000,
            page_bytes: 10,
        })
    }

    fn add(c: &mut PrefixCache, tokens: &[u32]) {
        let (mut ops, mut released) = (Vec::new(), Vec::new());
        let loc = c.alloc_device(&mut ops, &mut released).expect("a free slot");
        assert!(released.is_empty());
        c.insert(tokens.to_vec(), (0..tokens.len().div_ceil(PS) as u32).collect(), loc);
    }

    #[test]
    fn lookup_finds_the_longest_cached_prefix_within_the_limit() {
        let stream: Vec<u32> = (0..200).map(|i| (i * 7 + 3) % 101).collect();
        let mut c = cache(4);
        for len in [10, 50, 100] {
            add(&mut c, &stream[..len]);
        }
        add(&mut c, &[9, 9, 9]);
        assert_eq!(c.lookup(&stream, 120).map(|h| h.len), Some(100));
        assert_eq!(c.lookup(&stream, 99).map(|h| h.len), Some(50));
        assert_eq!(c.lookup(&stream, 9), None);
        let mut edited = stream.clone();
        edited[60] += 1;
        assert_eq!(c.lookup(&edited, 200).map(|h| h.len), Some(50));
        assert!(c.contains(&stream[..50]) && !c.contains(&stream[..51]));
        c.assert_consistent();
    }

    #[test]
    fn an_entry_is_valued_by_the_tokens_beyond_its_longest_cached_prefix() {
        let a: Vec<u32> = (0..100).collect();
        let mut b = a.clone();
        b.extend([500, 501, 502, 503]);
        let other: Vec<u32> = (1000..1104).collect();
        let mut c = cache(3);
        add(&mut c, &a);
        add(&mut c, &b);
        add(&mut c, &other);
        // b adds 4 tokens to a (its parent), so it goes first; then a (100 new tokens) before other (104).
        c.evict_one();
        assert!(c.contains(&a) && !c.contains(&b) && c.contains(&other));
        c.evict_one();
        assert!(!c.contains(&a) && c.contains(&other));
    }

    #[test]
    fn snapshots_along_a_long_conversation_find_their_parents() {
        // An agent conversation to 131,072 tokens with a snapshot every 2,048: each new entry's
        // parent is the one before it (so every entry but the first saves 2,048 tokens), and the
        // lookup of the whole conversation finds the last. (With a quadratic parent search this
        // took minutes.)
        let stream: Vec<u32> = (0..131_072u32).map(|i| i.wrapping_mul(2_654_435_761) % 248_320).collect();
        let mut c = cache(64);
        for k in 1..=64 {
            add(&mut c, &stream[..k * 2048]);
        }
        assert!(c.entries.values().all(|e| e.parent_len + 2048 == e.tokens.len()));
        assert_eq!(c.lookup(&stream, stream.len()).map(|h| h.len), Some(131_072));
        c.assert_consistent();
    }
}
