//! KV-cache storage formats of the reference backend. The oracle keeps its cache in f32 but stores
//! exactly the values a device cache of the format would hold: every token-head row (`head_dim`
//! values of one kv head at one position) is quantised with the format's rule on write and
//! immediately dequantised back, so reading the cache gives the device's numbers bit for bit
//! (up to the order of the final `code × scale` multiply, which is exact here).
//!
//! Rules, per token-head row `x[0..head_dim]`:
//! - [`KvFormat::F32`]: stored as is.
//! - [`KvFormat::Bf16`], [`KvFormat::F16`]: each value rounded to nearest, ties to even (f16 overflows
//!   to ±inf as IEEE conversion does; bf16 has f32's range).
//! - [`KvFormat::Fp8`]: `scale = f16↑(amax / 448)`; each value becomes the nearest OCP e4m3 (FN)
//!   number to `x / scale` (ties to even, saturating at ±448, never NaN), dequantised `× scale`.
//! - [`KvFormat::Int8`]: `scale = f16↑(amax / 127)`; `q = clamp(round_half_even(x / scale), −127, 127)`.
//! - [`KvFormat::Int4`]: `scale = f16↑(amax / 7)`; `q = clamp(round_half_even(x / scale), −7, 7)`:
//!   symmetric 4-bit, the code −8 is never produced (so a row and its negation store the same magnitudes).
//!
//! The scale is the per-(token, head) fp16 scale the plan counts ([`KvFormat::scale_bytes`]). It is
//! `amax / qmax` rounded *up* to the next f16 (so `|x / scale| ≤ qmax` and nothing is clipped) and
//! clamped to `[2^-24, 65504]` (the smallest positive and the largest finite f16), so no row ever
//! divides by zero or by infinity. Rows with `amax < 2^-14 · qmax` (fp8 < 0.027, int8 < 7.8e-3,
//! int4 < 4.3e-4) get a subnormal f16 scale with fewer significant bits: their error is still at most
//! half a scale step, but the step is coarser relative to `amax`; rows with `amax > 65504 · qmax`
//! saturate (≈2.9e7 for fp8, 8.3e6 for int8, 4.6e5 for int4). An all-zero row stores zeros. NaN inputs stay NaN (a NaN in K/V is a bug upstream and must stay visible); ±inf
//! inputs of the scaled formats saturate to ±`qmax · scale`.

/// Storage format of K or V in the KV cache: the plan's [`KvDtype`] (names, bits, scale bytes,
/// parsing live there); this module adds how the reference backend rounds values to it.
pub use deltaserve_plan::KvDtype as KvFormat;

/// The quantisation rules of each KV format (see the module docs).
pub trait KvQuant: Copy {
    /// The largest magnitude of a code, for the scaled formats (`scale = amax / qmax`).
    fn qmax(self) -> Option<f32>;
    /// The per-row scale this format stores for a row whose largest magnitude is `amax` (None for
    /// the unscaled formats, and for all-zero rows).
    fn row_scale(self, amax: f32) -> Option<f32>;
    /// Quantises one token-head row in place: afterwards it holds the dequantised stored values.
    fn quantize_row(self, row: &mut [f32]);
    /// Quantises `data` ([rows, head_dim] of token-head rows, e.g. [t, kv_heads·head_dim]) in place.
    fn quantize_rows(self, data: &mut [f32], head_dim: usize);
}

impl KvQuant for KvFormat {
    /// The largest magnitude of a code, for the scaled formats (`scale = amax / qmax`).
    fn qmax(self) -> Option<f32> {
        match self {
            Self::Fp8 => Some(E4M3_MAX),
            Self::Int8 => Some(127.0),
            Self::Int4 => Some(7.0),
            _ => None,
        }
    }

    /// The per-row scale this format stores for a row whose largest magnitude is `amax` (None for
    /// the unscaled formats, and for all-zero rows).
    fn row_scale(self, amax: f32) -> Option<f32> {
        let qmax = self.qmax()?;
        (amax > 0.0).then(|| f16_scale(amax / qmax))
    }

    /// Quantises one token-head row in place: afterwards it holds the dequantised stored values.
    fn quantize_row(self, row: &mut [f32]) {
        match self {
            Self::F32 => {}
            Self::Bf16 => row.iter_mut().for_each(|x| *x = round_bf16(*x)),
            Self::F16 => row.iter_mut().for_each(|x| *x = round_f16(*x)),
            Self::Fp8 | Self::Int8 | Self::Int4 => {
                let amax = row.iter().fold(0.0f32, |a, x| a.max(x.abs()));
                let Some(scale) = self.row_scale(amax) else {
                    return; // all zeros (or NaN only): stored as is
                };
                for x in row.iter_mut() {
                    let y = *x / scale;
                    let q = match self {
                        Self::Fp8 => e4m3_to_f32(f32_to_e4m3(y)),
                        Self::Int8 => y.round_ties_even().clamp(-127.0, 127.0),
                        _ => y.round_ties_even().clamp(-7.0, 7.0),
                    };
                    *x = q * scale;
                }
            }
        }
    }

    /// Quantises `data` ([rows, head_dim] of token-head rows, e.g. [t, kv_heads·head_dim]) in place.
    fn quantize_rows(self, data: &mut [f32], head_dim: usize) {
        if self == Self::F32 {
            return;
        }
        assert!(head_dim > 0 && data.len().is_multiple_of(head_dim), "KV rows are not whole heads");
        data.chunks_exact_mut(head_dim).for_each(|r| self.quantize_row(r));
    }
}

/// The largest finite e4m3 (FN) value.
pub const E4M3_MAX: f32 = 448.0;
/// The largest finite f16 value.
pub const F16_MAX: f32 = 65504.0;
/// The smallest positive (subnormal) f16 value, 2^-24.
pub const F16_MIN_POSITIVE: f32 = 5.960_464_5e-8;

/// The stored fp16 scale for a wanted scale `s > 0` (= amax / qmax): the smallest f16 ≥ `s`, clamped
/// to `[2^-24, 65504]`. Rounding up keeps `|x / scale| ≤ qmax`, so no value of the row is clipped.
pub fn f16_scale(s: f32) -> f32 {
    if s.is_nan() || s > F16_MAX {
        return F16_MAX;
    }
    let r = round_f16(s);
    let up = if r < s { f16_bits_to_f32(f32_to_f16_bits(r) + 1) } else { r };
    up.clamp(F16_MIN_POSITIVE, F16_MAX)
}

/// `x` rounded to the nearest bf16 (ties to even); NaN stays NaN.
pub fn round_bf16(x: f32) -> f32 {
    if x.is_nan() {
        return x;
    }
    let b = x.to_bits();
    let lsb = (b >> 16) & 1;
    f32::from_bits(b.wrapping_add(0x7fff + lsb) & 0xffff_0000)
}

/// Every value of `xs` rounded to the nearest bf16 ([`round_bf16`]).
pub fn round_bf16_slice(xs: &mut [f32]) {
    xs.iter_mut().for_each(|x| *x = round_bf16(*x));
}

/// `x` rounded to the nearest f16 (ties to even), as f32.
pub fn round_f16(x: f32) -> f32 {
    f16_bits_to_f32(f32_to_f16_bits(x))
}

/// IEEE binary16 bits of `x`, rounded to nearest even (overflow to ±inf, subnormals kept).
pub fn f32_to_f16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    let sign = ((b >> 16) & 0x8000) as u16;
    let a = b & 0x7fff_ffff;
    if a > 0x7f80_0000 {
        return sign | 0x7e00; // NaN
    }
    if a >= 0x477f_f000 {
        return sign | 0x7c00; // ≥ 65520 rounds to inf
    }
    if a < 0x3880_0000 {
        // Below 2^-14: a multiple of 2^-24 (code 0x400 is the smallest normal, so a carry is right).
        let m = (f32::from_bits(a) as f64 * 16_777_216.0).round_ties_even() as u16;
        return sign | m;
    }
    let exp = (a >> 23) - 112; // rebias 127 → 15 (a ≥ 2^-14, so exp ≥ 1)
    let mant = a & 0x7f_ffff;
    let mut h = (exp << 10) | (mant >> 13);
    let rem = mant & 0x1fff;
    if rem > 0x1000 || (rem == 0x1000 && h & 1 == 1) {
        h += 1; // a mantissa carry moves into the exponent, as it should
    }
    sign | h as u16
}

/// The value of IEEE binary16 bits.
pub fn f16_bits_to_f32(h: u16) -> f32 {
    let sign = if h & 0x8000 != 0 { -1.0f32 } else { 1.0 };
    let e = i32::from((h >> 10) & 0x1f);
    let m = f32::from(h & 0x3ff);
    match e {
        0 => sign * m * F16_MIN_POSITIVE,
        31 if m == 0.0 => sign * f32::INFINITY,
        31 => f32::NAN,
        _ => sign * (1.0 + m / 1024.0) * 2f32.powi(e - 15),
    }
}

/// The e4m3 (OCP FN) code nearest to `x` (ties to even), saturating at ±448; ±inf saturates, NaN maps
/// to 0 (the format's NaN code is never produced).
pub fn f32_to_e4m3(x: f32) -> u8 {
    if x.is_nan() { 0 } else { deltaserve_model::quant::fp8_e4m3_from_f32(x) }
}

/// The value of an e4m3 (OCP FN) code (0x7f/0xff are NaN).
pub fn e4m3_to_f32(c: u8) -> f32 {
    deltaserve_model::quant::fp8_e4m3_to_f32(c)
}

/// A [`SeqCache`](crate::SeqCache) that stores K and V through formats: rows are quantised on write
/// and the wrapped cache holds the dequantised values. `head_dim` is the row length of one kv head.
pub struct QuantizingCache<C> {
    pub inner: C,
    pub k: KvFormat,
    pub v: KvFormat,
    pub head_dim: usize,
}

impl<C: crate::SeqCache> crate::SeqCache for QuantizingCache<C> {
    fn deltanet_state(&mut self, layer: usize) -> (&mut [f32], &mut [f32]) {
        self.inner.deltanet_state(layer)
    }
    fn state_bf16(&self) -> bool {
        self.inner.state_bf16()
    }
    fn write_kv(&mut self, layer: usize, start: usize, k: &[f32], v: &[f32]) {
        let (mut k, mut v) = (k.to_vec(), v.to_vec());
        self.k.quantize_rows(&mut k, self.head_dim);
        self.v.quantize_rows(&mut v, self.head_dim);
        self.inner.write_kv(layer, start, &k, &v);
    }
    fn read_kv(&self, layer: usize, len: usize) -> (Vec<f32>, Vec<f32>) {
        self.inner.read_kv(layer, len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_f16_code_round_trips() {
        for h in 0..=u16::MAX {
            let x = f16_bits_to_f32(h);
            if x.is_nan() {
                assert!(round_f16(x).is_nan());
                continue;
            }
            assert_eq!(f32_to_f16_bits(x), h, "code {h:#06x} = {x:e}");
        }
    }

    #[test]
    fn f16_rounding_edges() {
        assert_eq!(round_f16(65504.0), 65504.0);
        assert_eq!(round_f16(65519.0), 65504.0);
        assert_eq!(round_f16(65520.0), f32::INFINITY);
        assert_eq!(round_f16(-1e9), f32::NEG_INFINITY);
        // 1 + 2^-11 is a tie between 1 and 1 + 2^-10: even (1) wins; 1 + 3·2^-11 goes up to 1 + 2^-9.
        assert_eq!(round_f16(1.0 + 2f32.powi(-11)), 1.0);
        assert_eq!(round_f16(1.0 + 3.0 * 2f32.powi(-11)), 1.0 + 2f32.powi(-9));
        assert_eq!(round_f16(2f32.powi(-25)), 0.0); // tie with 0 and 2^-24: even
        assert_eq!(round_f16(1.5 * 2f32.powi(-25)), F16_MIN_POSITIVE);
        assert_eq!(round_f16(2f32.powi(-14) * (1.0 - 2f32.powi(-12))), 2f32.powi(-14));
    }

    #[test]
    fn every_e4m3_code_round_trips() {
        let mut seen = 0;
        for c in 0..=u8::MAX {
            let x = e4m3_to_f32(c);
            if x.is_nan() {
                assert!(c & 0x7f == 0x7f);
                continue;
            }
            seen += 1;
            assert_eq!(f32_to_e4m3(x), c, "code {c:#04x} = {x}");
        }
        assert_eq!(seen, 254);
        assert_eq!(e4m3_to_f32(0x7e), 448.0);
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9));
    }

    #[test]
    fn e4m3_saturates_and_rounds_to_even() {
        assert_eq!(e4m3_to_f32(f32_to_e4m3(1e9)), 448.0);
        assert_eq!(e4m3_to_f32(f32_to_e4m3(f32::NEG_INFINITY)), -448.0);
        assert_eq!(e4m3_to_f32(f32_to_e4m3(470.0)), 448.0);
        assert_eq!(f32_to_e4m3(f32::NAN), 0);
        // Between 1 and 1.125 the tie goes to 1 (even mantissa); between 1.125 and 1.25 to 1.25.
        assert_eq!(e4m3_to_f32(f32_to_e4m3(1.0625)), 1.0);
        assert_eq!(e4m3_to_f32(f32_to_e4m3(1.1875)), 1.25);
        // Subnormals: multiples of 2^-9.
        assert_eq!(e4m3_to_f32(f32_to_e4m3(1.5 / 512.0)), 2.0 / 512.0);
        assert_eq!(e4m3_to_f32(f32_to_e4m3(0.4 / 512.0)), 0.0);
        // The largest subnormal rounds up into the smallest normal.
        assert_eq!(e4m3_to_f32(f32_to_e4m3(7.6 / 512.0)), 8.0 / 512.0);
    }

    /// Hopper's attention prefill over an fp8 K multiplies Q as two e4m3 halves (hi = e4m3(x), lo = e4m3(x −
    /// hi), x = q · 2^e with a row's largest |x| in [128, 256)): every bf16 of magnitude in [2^-2, 2^8) is
    /// exactly such a sum, so only elements below 2^-9 of their row's largest can lose bits.
    #[test]
    fn a_bf16_is_two_e4m3_halves() {
        let mut checked = 0;
        for bits in 0u16..0x7f80 {
            let x = f32::from_bits((bits as u32) << 16);
            if !(0.25..256.0).contains(&x) {
                continue;
            }
            for x in [x, -x] {
                let hi = e4m3_to_f32(f32_to_e4m3(x));
                let lo = e4m3_to_f32(f32_to_e4m3(x - hi));
                assert_eq!(hi + lo, x, "{x}: {hi} + {lo}");
            }
            checked += 1;
        }
        assert_eq!(checked, 10 * 128); // 10 binades of 128 bf16 values
        // Below 2^-2 the low half's last bits fall under e4m3's subnormal step (2^-9).
        let x = f32::from_bits(0x3e01_0000); // 2^-3 + 2^-10: the low half 2^-10 rounds to 0
        assert_ne!(e4m3_to_f32(f32_to_e4m3(x)) + e4m3_to_f32(f32_to_e4m3(x - e4m3_to_f32(f32_to_e4m3(x)))), x);
    }

    #[test]
    fn scales_round_up_and_clamp() {
        assert_eq!(f16_scale(1.0), 1.0);
        assert_eq!(f16_scale(1.0 + 2f32.powi(-20)), 1.0 + 2f32.powi(-10));
        assert_eq!(f16_scale(1e-12), F16_MIN_POSITIVE);
        assert_eq!(f16_scale(1e9), F16_MAX);
        assert_eq!(f16_scale(f32::INFINITY), F16_MAX);
        for s in [3e-7f32, 1e-3, 0.1234, 7.77, 3000.1] {
            let f = f16_scale(s);
            assert!(f >= s && round_f16(f) == f && f <= s * (1.0 + 2f32.powi(-10)) + F16_MIN_POSITIVE, "{s} → {f}");
        }
    }

    #[test]
    fn bf16_rounding() {
        assert_eq!(round_bf16(1.0 + 2f32.powi(-8)), 1.0); // tie → even
        assert_eq!(round_bf16(1.0 + 3.0 * 2f32.powi(-8)), 1.0 + 2f32.powi(-6));
        assert_eq!(round_bf16(f32::MAX), f32::INFINITY);
        assert!(round_bf16(f32::NAN).is_nan());
        assert_eq!(round_bf16(-0.0).to_bits(), (-0.0f32).to_bits());
    }

    #[test]
    fn int_codes_are_exact_multiples_of_the_scale() {
        let mut row: Vec<f32> = (0..64).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
        let amax = row.iter().fold(0.0f32, |a, x| a.max(x.abs()));
        KvFormat::Int4.quantize_row(&mut row);
        let s = KvFormat::Int4.row_scale(amax).unwrap();
        for x in &row {
            let q = x / s;
            assert_eq!(q, q.round(), "{x} / {s}");
            assert!(q.abs() <= 7.0);
        }
    }
}
