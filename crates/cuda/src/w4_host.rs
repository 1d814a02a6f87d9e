//! Int4 linears in the device format ([`crate::w4`]) computed by the host CPU, reading the format in
//! place: `y = x · Wᵀ` for one token. This is the arithmetic of routed experts kept in host memory and
//! computed where they are (what llama.cpp users do with `-ot exps=CPU`), instead of read across the
//! bus by the GPU's kernels; `examples/bench_host_experts.rs` measures it at an MoE model's shapes
//! against the bus.
//!
//! A pair's (32 rows) group of 128 columns is one contiguous 2 KB unit of the format, 64 bytes a row
//! ([`crate::w4::u4_index`]); byte `b` of a row's 64 holds the low nibble of column [`lo_col`]`(b)` and
//! the high nibble of [`hi_col`]`(b)` of the group. [`PackedX`] quantises x once per token to int8 per
//! group of 128 (scale `max |x| / 127`, as llama.cpp's q8 activations) and lays it out in that byte
//! order, so that a row's group is an integer dot product of its 128 nibbles with 128 int8 values:
//! `y[o] = Σ_g s[g, o] · dx_g · (Σ_b q_b · xq_b − z[g, o] · Σ xq_g)` (exact integer sums, f32
//! scaling). The rows of a pair are computed together, group by group, so the weights stream in
//! order. On x86-64 with AVX2 the dot products run on `vpmaddubsw` (unsigned nibbles × signed int8);
//! elsewhere a plain loop computes the same integers.

use std::ops::Range;

use crate::error::CudaError;
use crate::w4::{ScaleDtype, W4_GROUP, W4Linear, nibble_of, u4_index};

/// Bytes of one row's group in the format.
const GROUP_BYTES: usize = W4_GROUP / 2;
/// Rows of a pair of the format.
const PAIR: usize = 32;
/// Bytes ahead of a slot's weights the AVX2 loop asks the cache for: one 2 KB unit (a hint; a pair's
/// units are contiguous and the next pair's follow). On a 2-core Xeon, 8.8 against 7.6 GB/s a core
/// without it (`examples/bench_host_experts`); 4 and 8 KB ahead measured the same.
const PREFETCH_AHEAD: usize = 2048;

/// Device column (within its group) of the low nibble of byte `b` (0..64) of a row's group: chunk
/// `b / 16`, word `(b % 16) / 4`, byte `b % 4` of the word holds nibbles `2(b % 4)` and `2(b % 4) + 1`.
pub fn lo_col(b: usize) -> usize {
    col_of(b, 2 * (b % 4))
}

/// Device column (within its group) of the high nibble of byte `b` of a row's group.
pub fn hi_col(b: usize) -> usize {
    col_of(b, 2 * (b % 4) + 1)
}

fn col_of(b: usize, nibble: usize) -> usize {
    let (t, i) = (b / 16, (b % 16) / 4);
    let c = (0..8).find(|&c| nibble_of(c) == nibble).unwrap_or(0);
    32 * i + 8 * t + c
}

/// One int4 linear in the device format, borrowed (the host copy of [`W4Linear`], or the bytes of
/// an expert in the pinned host block). Act-order weights are not taken.
#[derive(Clone, Copy, Debug)]
pub struct W4HostView<'a> {
    pub qweight: &'a [u32],
    pub scales: &'a [u16],
    pub scale_dtype: ScaleDtype,
    pub zeros: Option<&'a [u8]>,
    pub out: usize,
    pub inp: usize,
}

impl<'a> W4HostView<'a> {
    /// The view of `w`; act-order weights (a `perm`) are refused.
    pub fn of(w: &'a W4Linear) -> Result<Self, CudaError> {
        if w.perm.is_some() {
            return Err(CudaError::Weights("act-order int4 weights are not computed on the host".into()));
        }
        Self::new(w.qweight.as_slice(), &w.scales, w.scale_dtype, w.zeros.as_deref(), w.out_features, w.in_features)
    }

    /// A view over the format's arrays, checked against `[out, inp]`.
    pub fn new(
        qweight: &'a [u32],
        scales: &'a [u16],
        scale_dtype: ScaleDtype,
        zeros: Option<&'a [u8]>,
        out: usize,
        inp: usize,
    ) -> Result<Self, CudaError> {
        W4Linear::check_shape("host int4 linear", out, inp)?;
        let ng = inp / W4_GROUP;
        let sizes_ok = qweight.len() == out * inp / 8
            && scales.len() == ng * out
            && zeros.is_none_or(|z| z.len() == ng * out.div_ceil(2));
        if !sizes_ok {
            return Err(CudaError::Weights(format!(
                "host int4 linear [{out}, {inp}]: {} qweight words, {} scales, {:?} zero bytes do not match the format",
                qweight.len(),
                scales.len(),
                zeros.map(<[u8]>::len)
            )));
        }
        Ok(W4HostView { qweight, scales, scale_dtype, zeros, out, inp })
    }

    fn bytes(&self) -> &'a [u8] {
        // SAFETY: u32 words reinterpreted as their bytes, in memory order (the format's nibble order is
        // defined on little-endian words; x86-64 and aarch64 are little-endian).
        unsafe { std::slice::from_raw_parts(self.qweight.as_ptr().cast::<u8>(), self.qweight.len() * 4) }
    }

    /// Group `g`'s scales and zero points of pair `p`'s rows (as many as `sc` holds), in row order.
    fn pair_scales(&self, g: usize, p: usize, sc: &mut [f32], zr: &mut [i32]) {
        let o0 = PAIR * p;
        let bits = &self.scales[g * self.out + o0..][..sc.len()];
        match self.scale_dtype {
            ScaleDtype::F16 => half::slice::HalfFloatSliceExt::convert_to_f32_slice(
                half::slice::HalfBitsSliceExt::reinterpret_cast::<half::f16>(bits),
                sc,
            ),
            ScaleDtype::Bf16 => sc.iter_mut().zip(bits).for_each(|(s, &b)| *s = f32::from_bits(u32::from(b) << 16)),
        }
        if let Some(z) = self.zeros {
            let row = &z[g * self.out.div_ceil(2)..];
            for (rr, v) in zr.iter_mut().enumerate() {
                let o = o0 + rr;
                *v = i32::from((row[o / 2] >> (4 * (o & 1))) & 15);
            }
        }
    }
}

/// One token's x quantised to int8 per group of 128 and laid out in the format's byte order.
#[derive(Clone, Debug)]
pub struct PackedX {
    /// `[groups][128]`: the low nibbles' columns (64), then the high nibbles' (64).
    pub q: Vec<i8>,
    /// `[groups]`: the group's scale, `max |x| / 127` (x ≈ q · scale).
    pub scale: Vec<f32>,
    /// `[groups]`: Σ q over the group.
    pub qsum: Vec<i32>,
}

impl PackedX {
    /// x (`[inp]`, device column order; `inp` a multiple of 128) packed for [`gemv`].
    pub fn new(x: &[f32]) -> Self {
        let ng = x.len() / W4_GROUP;
        let mut q = vec![0i8; ng * W4_GROUP];
        let (mut scale, mut qsum) = (vec![0f32; ng], vec![0i32; ng]);
        for g in 0..ng {
            let xg = &x[g * W4_GROUP..][..W4_GROUP];
            let amax = xg.iter().fold(0f32, |m, v| m.max(v.abs()));
            // A non-finite x makes the group's scale NaN: the outputs it reaches are NaN, as on the GPU.
            let d = if xg.iter().all(|v| v.is_finite()) { amax / 127.0 } else { f32::NAN };
            let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
            let qg = &mut q[g * W4_GROUP..][..W4_GROUP];
            for b in 0..GROUP_BYTES {
                qg[b] = (xg[lo_col(b)] * inv).round() as i8;
                qg[GROUP_BYTES + b] = (xg[hi_col(b)] * inv).round() as i8;
            }
            scale[g] = d;
            qsum[g] = qg.iter().map(|&v| i32::from(v)).sum();
        }
        PackedX { q, scale, qsum }
    }
}

/// `y[o − rows.start] = Σ_j W[o, j] · x[j]` for the rows `rows` of `w` (f32 out, `y.len() ==
/// rows.len()`), x as [`PackedX`] quantised it.
pub fn gemv(w: &W4HostView<'_>, x: &PackedX, rows: Range<usize>, y: &mut [f32]) {
    assert_eq!(x.scale.len(), w.inp / W4_GROUP, "x packed for another width");
    assert!(rows.end <= w.out && y.len() == rows.len(), "rows {rows:?} of {} into {} outputs", w.out, y.len());
    let ng = w.inp / W4_GROUP;
    let bytes = w.bytes();
    let mut p = rows.start / PAIR;
    while p * PAIR < rows.end {
        let r = (w.out - PAIR * p).min(PAIR);
        // The pair's slots in unit order: slot (before(j) + g) holds row 4g + j (u4_index).
        let mut slot_row = [0usize; PAIR];
        for rr in 0..r {
            slot_row[(u4_index(w.out, w.inp, PAIR * p + rr, 0) - p * ng * 128) / 4] = rr;
        }
        // Everything per slot (the unit's order); the rows get their sums at the end.
        let mut acc = [0f32; PAIR];
        let (mut sc, mut zr) = ([0f32; PAIR], [8i32; PAIR]);
        let (mut sc_slot, mut zr_slot) = ([0f32; PAIR], [0i32; PAIR]);
        for g in 0..ng {
            let unit = &bytes[16 * (p * ng * 128 + g * r * 4)..][..r * GROUP_BYTES];
            let xq = <&[i8; W4_GROUP]>::try_from(&x.q[g * W4_GROUP..(g + 1) * W4_GROUP]).expect("128 a group");
            let mut dots = [0i32; PAIR];
            dot_unit(unit, xq, &mut dots[..r]);
            w.pair_scales(g, p, &mut sc[..r], &mut zr[..r]);
            for s in 0..r {
                (sc_slot[s], zr_slot[s]) = (sc[slot_row[s]], zr[slot_row[s]]);
            }
            let (xs, qs) = (x.scale[g], x.qsum[g]);
            for s in 0..PAIR {
                acc[s] += sc_slot[s] * xs * (dots[s] - zr_slot[s] * qs) as f32;
            }
        }
        for (s, &a) in acc[..r].iter().enumerate() {
            let o = PAIR * p + slot_row[s];
            if rows.contains(&o) {
                y[o - rows.start] = a;
            }
        }
        p += 1;
    }
}

/// `dots[s] = Σ_b (unit[64 s + b] & 15) · xq[b] + (unit[64 s + b] >> 4) · xq[64 + b]` for each row slot.
fn dot_unit(unit: &[u8], xq: &[i8; W4_GROUP], dots: &mut [i32]) {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2; every load is inside `unit` (64 bytes a slot) and `xq`.
        unsafe { dot_unit_avx2(unit, xq, dots) };
        return;
    }
    for (s, d) in dots.iter_mut().enumerate() {
        let q = &unit[GROUP_BYTES * s..][..GROUP_BYTES];
        *d = (0..GROUP_BYTES)
            .map(|b| i32::from(q[b] & 15) * i32::from(xq[b]) + i32::from(q[b] >> 4) * i32::from(xq[GROUP_BYTES + b]))
            .sum();
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn dot_unit_avx2(unit: &[u8], xq: &[i8; W4_GROUP], dots: &mut [i32]) {
    use std::arch::x86_64::*;
    assert!(unit.len() >= GROUP_BYTES * dots.len());
    // SAFETY (the loads): `xq` is 128 bytes; slot s reads unit[64 s .. 64 s + 64], checked above.
    unsafe {
        let xp = xq.as_ptr().cast::<__m256i>();
        let (xl0, xl1) = (_mm256_loadu_si256(xp), _mm256_loadu_si256(xp.add(1)));
        let (xh0, xh1) = (_mm256_loadu_si256(xp.add(2)), _mm256_loadu_si256(xp.add(3)));
        let (m, ones) = (_mm256_set1_epi8(0x0f), _mm256_set1_epi16(1));
        // Slot s's eight i32 partial sums.
        let slot = |s: usize| {
            let wp = unit.as_ptr().add(GROUP_BYTES * s).cast::<__m256i>();
            _mm_prefetch::<_MM_HINT_T0>(wp.cast::<i8>().wrapping_add(PREFETCH_AHEAD));
            let (w0, w1) = (_mm256_loadu_si256(wp), _mm256_loadu_si256(wp.add(1)));
            let (l0, l1) = (_mm256_and_si256(w0, m), _mm256_and_si256(w1, m));
            let (h0, h1) =
                (_mm256_and_si256(_mm256_srli_epi16(w0, 4), m), _mm256_and_si256(_mm256_srli_epi16(w1, 4), m));
            // u8 (0..15) × i8 (-127..127) pairs summed to i16: at most 2 · 15 · 127 = 3,810 each,
            // 15,240 for the four added below (no saturation).
            let a = _mm256_add_epi16(_mm256_maddubs_epi16(l0, xl0), _mm256_maddubs_epi16(l1, xl1));
            let b = _mm256_add_epi16(_mm256_maddubs_epi16(h0, xh0), _mm256_maddubs_epi16(h1, xh1));
            _mm256_madd_epi16(_mm256_add_epi16(a, b), ones)
        };
        let n8 = dots.len() / 8 * 8;
        for s0 in (0..n8).step_by(8) {
            // Eight slots' sums at once: hadd works within 128-bit halves, so two rounds leave slot
            // s0 + i's sums over its low and high halves in lane i of each half (i < 4: ab, else cd).
            let v: [__m256i; 8] = std::array::from_fn(|i| slot(s0 + i));
            let (a, b) = (_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
            let (c, d) = (_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
            let (ab, cd) = (_mm256_hadd_epi32(a, b), _mm256_hadd_epi32(c, d));
            let s03 = _mm_add_epi32(_mm256_castsi256_si128(ab), _mm256_extracti128_si256(ab, 1));
            let s47 = _mm_add_epi32(_mm256_castsi256_si128(cd), _mm256_extracti128_si256(cd, 1));
            _mm_storeu_si128(dots.as_mut_ptr().add(s0).cast::<__m128i>(), s03);
            _mm_storeu_si128(dots.as_mut_ptr().add(s0 + 4).cast::<__m128i>(), s47);
        }
        for (s, d) in dots.iter_mut().enumerate().skip(n8) {
            let v = slot(s);
            let v4 = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
            let v2 = _mm_add_epi32(v4, _mm_unpackhi_epi64(v4, v4));
            *d = _mm_cvtsi128_si32(_mm_add_epi32(v2, _mm_shuffle_epi32(v2, 1)));
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use rand::rngs::StdRng;
    use rand::{RngExt, SeedableRng};

    use super::*;

    /// A random linear in the format: quants and zero points (`asym`) uniform, scales of both signs
    /// in fp16 or bf16.
    pub(crate) fn random(out: usize, inp: usize, asym: bool, bf16_scales: bool, seed: u64) -> W4Linear {
        let mut rng = StdRng::seed_from_u64(seed);
        let ng = inp / W4_GROUP;
        let q: Vec<u8> = (0..out * inp).map(|_| rng.random_range(0..16u8)).collect();
        let z: Vec<u8> = (0..ng * out).map(|_| rng.random_range(0..16u8)).collect();
        let scales = (0..ng * out)
            .map(|_| {
                let v = rng.random_range(-0.01f32..0.01);
                if bf16_scales { half::bf16::from_f32(v).to_bits() } else { half::f16::from_f32(v).to_bits() }
            })
            .collect();
        let dtype = if bf16_scales { ScaleDtype::Bf16 } else { ScaleDtype::F16 };
        W4Linear::from_quants(out, inp, &q, asym.then_some(z.as_slice()), scales, dtype)
    }

    #[test]
    fn byte_columns_cover_each_group_once() {
        let mut seen = [false; W4_GROUP];
        for b in 0..GROUP_BYTES {
            for c in [lo_col(b), hi_col(b)] {
                assert!(!seen[c], "column {c} twice");
                seen[c] = true;
            }
        }
        assert!(seen.iter().all(|&s| s));
    }

    /// Against the format's dequantisation (`W4Linear::dequantize_row`) times x in f64, within the int8
    /// rounding of x (half a step of each group's scale times Σ |W| over the group), at widths with a
    /// partial last pair and one group, sym and asym, fp16 and bf16 scales, row ranges that start and
    /// end mid-pair; and the integers equal to the plain loop's.
    #[test]
    fn gemv_matches_the_dequantised_rows() {
        for (i, &(out, inp, asym, bf)) in
            [(64, 256, false, false), (44, 384, true, true), (100, 128, true, false), (1024, 2048, false, true)]
                .iter()
                .enumerate()
        {
            let w = random(out, inp, asym, bf, 0x9e37_79b9_7f4a_7c15 + i as u64);
            let x: Vec<f32> = (0..inp).map(|j| ((j * 7919 % 1000) as f32 / 500.0 - 1.0) * (1 + j % 3) as f32).collect();
            let px = PackedX::new(&x);
            let view = W4HostView::of(&w).unwrap();
            for rows in [0..out, 3..out.min(40), out - 1..out] {
                let mut y = vec![f32::NAN; rows.len()];
                gemv(&view, &px, rows.clone(), &mut y);
                for (k, o) in rows.enumerate() {
                    let wr = w.dequantize_row(o);
                    let r: f64 = wr.iter().zip(&x).map(|(&a, &b)| a as f64 * b as f64).sum();
                    let bound: f64 = (0..inp / W4_GROUP)
                        .map(|g| {
                            let s: f64 = wr[g * W4_GROUP..][..W4_GROUP].iter().map(|v| v.abs() as f64).sum();
                            0.5 * px.scale[g] as f64 * s
                        })
                        .sum();
                    let mag: f64 = wr.iter().zip(&x).map(|(&a, &b)| (a as f64 * b as f64).abs()).sum();
                    assert!(
                        (y[k] as f64 - r).abs() <= bound + 1e-5 * mag + 1e-7,
                        "[{out}, {inp}] asym {asym} row {o}: {} against {r} (bound {bound:.3e})",
                        y[k]
                    );
                }
            }
        }
    }

    /// The AVX2 dot products (where the CPU has them) equal the plain loop's integers, nibbles of 0 and
    /// 15 against x of ±127 included.
    #[test]
    fn dot_products_are_exact() {
        let mut unit: Vec<u8> = (0..32 * GROUP_BYTES).map(|i| (i * 37 % 256) as u8).collect();
        unit[..GROUP_BYTES].fill(0xff);
        let mut xq = [0i8; W4_GROUP];
        for (i, v) in xq.iter_mut().enumerate() {
            *v = if i % 5 == 0 {
                -127
            } else if i % 7 == 0 {
                127
            } else {
                (i as i32 * 13 % 255 - 127) as i8
            };
        }
        let mut got = [0i32; 32];
        dot_unit(&unit, &xq, &mut got);
        for (s, &d) in got.iter().enumerate() {
            let q = &unit[GROUP_BYTES * s..][..GROUP_BYTES];
            let want: i32 = (0..GROUP_BYTES)
                .map(|b| {
                    i32::from(q[b] & 15) * i32::from(xq[b]) + i32::from(q[b] >> 4) * i32::from(xq[GROUP_BYTES + b])
                })
                .sum();
            assert_eq!(d, want, "slot {s}");
        }
    }

    #[test]
    fn a_non_finite_x_reaches_the_outputs() {
        let w = random(32, 256, false, false, 3);
        let mut x = vec![0.5f32; 256];
        x[200] = f32::NAN;
        let mut y = vec![0f32; 32];
        gemv(&W4HostView::of(&w).unwrap(), &PackedX::new(&x), 0..32, &mut y);
        assert!(y.iter().all(|v| v.is_nan()));
        let mut y = vec![f32::NAN; 32];
        gemv(&W4HostView::of(&w).unwrap(), &PackedX::new(&[0f32; 256]), 0..32, &mut y);
        assert!(y.iter().all(|&v| v == 0.0), "x = 0 gives 0");
    }

    #[test]
    fn wrong_sizes_and_act_order_are_refused() {
        let mut w = random(64, 256, false, false, 7);
        assert!(W4HostView::new(&w.qweight[1..], &w.scales, w.scale_dtype, None, 64, 256).is_err());
        assert!(W4HostView::new(&w.qweight, &w.scales, w.scale_dtype, None, 64, 200).is_err());
        w.perm = Some((0..256).collect());
        assert!(W4HostView::of(&w).is_err());
    }
}
