//! Shared helpers for the integration tests: fixture paths and loading.

#![allow(dead_code)]

use std::path::PathBuf;

use deltaserve_text::Tokenizer;

pub fn fixtures_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests").join("fixtures")
}

pub fn synth_dir() -> PathBuf {
    fixtures_dir().join("synth_1024")
}

pub fn synth_tokenizer() -> Tokenizer {
    Tokenizer::from_file(&synth_dir().join("tokenizer.json")).expect("fixture tokenizer loads")
}

pub fn fixtures() -> serde_json::Value {
    let text = std::fs::read_to_string(fixtures_dir().join("text_fixtures.json")).expect("fixture file");
    serde_json::from_str(&text).expect("fixture JSON")
}

/// Tiny deterministic PRNG (xorshift64*), so tests need no extra dependency.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}
