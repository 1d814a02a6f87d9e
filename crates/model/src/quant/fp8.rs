//! Block-FP8 linears: the e4m3 code, the block quantisation of the official `-FP8` checkpoints, and the
//! stored tensors' dequantisation.

use super::floats;
use crate::checkpoint::DType;
use crate::error::ModelError;

/// One block-FP8 linear.
#[derive(Clone, Debug)]
pub struct Fp8BlockSource<'a> {
    /// `[rows, cols]` per scale block.
    pub block: [usize; 2],
    pub out_features: usize,
    pub in_features: usize,
    /// F8_E4M3 `[out, in]`.
    pub weight: &'a [u8],
    /// `[ceil(out/rows), ceil(in/cols)]` in `scale_dtype`.
    pub scale_inv: &'a [u8],
    pub scale_dtype: DType,
}

/// Decodes one FP8 e4m3fn byte (bias 7, no infinities; `S.1111.111` is NaN).
pub fn fp8_e4m3_to_f32(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0f32 } else { 1.0 };
    let e = ((b >> 3) & 0x0f) as i32;
    let m = (b & 0x07) as f32;
    if e == 0x0f && b & 0x07 == 0x07 {
        return f32::NAN;
    }
    if e == 0 { sign * m / 8.0 * 2f32.powi(-6) } else { sign * (1.0 + m / 8.0) * 2f32.powi(e - 7) }
}

/// Encodes `x` as an FP8 e4m3fn byte: round to nearest even, saturating at ±448 (what
/// `cvt.rn.satfinite.e4m3x2.f32` does); NaN gives the NaN code `S.1111.111`.
pub fn fp8_e4m3_from_f32(x: f32) -> u8 {
    let sign = ((x.to_bits() >> 24) & 0x80) as u8;
    let a = x.abs();
    if a.is_nan() {
        return sign | 0x7f;
    }
    if a >= 448.0 {
        return sign | 0x7e;
    }
    if a < 2f32.powi(-6) {
        // Subnormals: m · 2^-9, m = 0..8 (8 is the smallest normal, code 0x08); a · 512 is exact.
        return sign | (a * 512.0).round_ties_even() as u8;
    }
    let bits = a.to_bits();
    let e = ((bits >> 23) & 0xff) as i32 - 127; // -6..=8
    let (mant, rem) = ((bits & 0x7f_ffff) >> 20, bits & 0xf_ffff);
    let up = rem > 0x8_0000 || (rem == 0x8_0000 && mant & 1 == 1);
    // A mantissa carry moves to the next binade: the codes of one sign are contiguous.
    let code = (((e + 7) as u32) << 3) + mant + u32::from(up);
    sign | code.min(0x7e) as u8
}

/// Quantises `w [out, in]` (row-major) to block FP8: e4m3 codes `[out, in]` and one f32 scale per
/// `block[0] × block[1]` block (`[ceil(out / b0), ceil(in / b1)]`, row-major), `scale = amax / 448`
/// (1 for an all-zero block) and `code = e4m3(w / scale)`: the official `-FP8` checkpoints' layout
/// (`weight` and `weight_scale_inv`, `w ≈ code · scale`).
pub fn fp8_block_quantize(w: &[f32], out: usize, inp: usize, block: [usize; 2]) -> (Vec<u8>, Vec<f32>) {
    assert_eq!(w.len(), out * inp, "fp8_block_quantize: w is not [out, in]");
    let [bo, bi] = block;
    let (ob, ib) = (out.div_ceil(bo), inp.div_ceil(bi));
    let mut scales = vec![0f32; ob * ib];
    for (o, row) in w.chunks_exact(inp).enumerate() {
        for (i, v) in row.iter().enumerate() {
            let s = &mut scales[(o / bo) * ib + i / bi];
            *s = s.max(v.abs());
        }
    }
    for s in &mut scales {
        *s = if *s > 0.0 { *s / 448.0 } else { 1.0 };
    }
    let codes = w
        .chunks_exact(inp)
        .enumerate()
        .flat_map(|(o, row)| {
            let srow = &scales[(o / bo) * ib..(o / bo + 1) * ib];
            row.iter().enumerate().map(move |(i, &v)| fp8_e4m3_from_f32(v / srow[i / bi]))
        })
        .collect();
    (codes, scales)
}

impl Fp8BlockSource<'_> {
    /// The block scales as f32 `[ceil(out/rows), ceil(in/cols)]` (checked against that shape).
    pub fn scales_f32(&self, name: &str) -> Result<Vec<f32>, ModelError> {
        let s = floats(name, self.scale_dtype, self.scale_inv)?;
        let want = self.out_features.div_ceil(self.block[0]) * self.in_features.div_ceil(self.block[1]);
        if s.len() != want {
            return Err(ModelError::weights(format!("`{name}`: {} block scales, expected {want}", s.len())));
        }
        Ok(s)
    }

    pub(super) fn dequantize(&self, name: &str) -> Result<Vec<f32>, ModelError> {
        let (out_f, in_f) = (self.out_features, self.in_features);
        let [bo, bi] = self.block;
        let scale_cols = in_f.div_ceil(bi);
        let scales = floats(name, self.scale_dtype, self.scale_inv)?;
        let lut: Vec<f32> = (0..=255u8).map(fp8_e4m3_to_f32).collect();
        let mut out = Vec::with_capacity(out_f * in_f);
        for (o, row) in self.weight.chunks_exact(in_f).enumerate() {
            let srow = &scales[(o / bo) * scale_cols..(o / bo + 1) * scale_cols];
            out.extend(row.iter().enumerate().map(|(i, &b)| lut[b as usize] * srow[i / bi]));
        }
        Ok(out)
    }
}
