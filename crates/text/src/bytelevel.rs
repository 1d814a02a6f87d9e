//! GPT-2 style byte-level alphabet: the 256 printable characters that stand for raw bytes in
//! byte-level BPE vocabularies, and the inverse map used when turning tokens back into bytes.

use std::collections::HashMap;
use std::sync::OnceLock;

/// The 256 alphabet characters, indexed by byte value.
pub(crate) fn byte_to_char() -> &'static [char; 256] {
    static TABLE: OnceLock<[char; 256]> = OnceLock::new();
    TABLE.get_or_init(|| {
        let mut table = ['\0'; 256];
        let mut next_extra = 256u32;
        for b in 0u32..256 {
            let printable = (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || (0xae..=0xff).contains(&b);
            let code = if printable {
                b
            } else {
                let c = next_extra;
                next_extra += 1;
                c
            };
            // Every code used is below 0x200, so it is always a valid char.
            table[b as usize] = char::from_u32(code).unwrap_or('\u{fffd}');
        }
        table
    })
}

/// Inverse of [`byte_to_char`].
pub(crate) fn char_to_byte() -> &'static HashMap<char, u8> {
    static MAP: OnceLock<HashMap<char, u8>> = OnceLock::new();
    MAP.get_or_init(|| byte_to_char().iter().enumerate().map(|(b, &c)| (c, b as u8)).collect())
}

/// Byte order used for the first 256 vocabulary ids: printable bytes first (as GPT-2 and Qwen do),
/// then the remapped control/space bytes.
pub(crate) fn base_byte_order() -> Vec<u8> {
    let mut order: Vec<u8> = (0u8..=255).filter(|&b| (byte_to_char()[b as usize] as u32) < 256).collect();
    order.extend((0u8..=255).filter(|&b| (byte_to_char()[b as usize] as u32) >= 256));
    order
}

/// Raw bytes of one token string, as the HF ByteLevel decoder computes them: every char mapped
/// through the alphabet, or the token's own UTF-8 bytes if any char is outside the alphabet.
pub(crate) fn token_bytes(token: &str, out: &mut Vec<u8>) {
    let map = char_to_byte();
    let start = out.len();
    for c in token.chars() {
        match map.get(&c) {
            Some(&b) => out.push(b),
            None => {
                out.truncate(start);
                out.extend_from_slice(token.as_bytes());
                return;
            }
        }
    }
}
