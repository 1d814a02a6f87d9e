//! The device format of 4-bit (W4A16) linears, and its host side: conversion from GPTQ / AutoRound
//! checkpoints ([`W4Linear::from_gptq`]), the reference quantiser that `w4_quantize` matches bit for
//! bit ([`W4Linear::quantize`]), and dequantisation (the oracle of the kernels in
//! `kernels/w4a16.cu`). Pure Rust: everything here runs without a GPU.
//!
//! # Format
//!
//! One linear `W [out, in]` (`in` a multiple of 128), in groups of [`W4_GROUP`] = 128 consecutive
//! *device columns*; `NG = in / 128` groups:
//!
//! - `qweight` u32, `out·in/8` words, **tile-major**: the rows form "pairs" of 32 (the last one has
//!   `R = out − 32p ≤ 32` rows); the (pair `p`, group `k`) *unit* holds the pair's `R` rows × 128
//!   columns (64 bytes per row), units in (p, k) row-major order, so pair `p` starts at 16-byte
//!   chunk `p·NG·128` and unit (p, k) at `p·NG·128 + k·R·4`. Inside a unit, row `rr = 4g + j`
//!   (`j = rr % 4`) holds the chunks `(before(j) + g)·4 + t`, `t = 0..4` its 32-column quarters,
//!   where `before(j)` counts the unit's rows with `rr % 4 < j` (`8j` when `R = 32`): the GEMV
//!   lane `(g, t)` copies chunk `t` of rows `4g + j` for `j = 0..4`, four contiguous 512-byte runs of
//!   a 2 KB unit ([`u4_index`]). A chunk is 4 words of 8 columns, interleaved across the group's
//!   four chunks: word `i` of chunk `t` holds the group's columns `32i + 8t .. 32i + 8t + 8`, so the
//!   lanes `t = 0..4` reading word `i`'s activations read 64 contiguous bytes ([`word_index`]); column
//!   `c` of a word is in nibble `(c & 1)·4 + (c >> 1)` (the nibbles hold columns `0,2,4,6,1,3,5,7`, so
//!   `(word >> 4p) & 0x000f000f` is the pair of columns `(2p, 2p+1)` in the two 16-bit halves, which
//!   is what the tensor-core GEMV feeds to `mma` as is).
//! - `scales` u16 `[NG, out]`, group-major (one group's scales of 16 consecutive rows are one
//!   32-byte sector): fp16 bits, or bf16 bits when the checkpoint's scales were bf16
//!   ([`ScaleDtype`]).
//! - `zeros` u8 `[NG, ceil(out/2)]`, optional: the zero point of (group `g`, row `o`) is nibble
//!   `o & 1` of byte `g·ceil(out/2) + o/2`. Absent = symmetric, zero 8.
//! - `perm` i32 `[in]`, optional (act-order checkpoints whose `g_idx` does not follow the input
//!   order): device column `j` holds input feature `perm[j]`; the GEMV gathers `x` in that order,
//!   the dequantiser scatters the columns back.
//!
//! `w[o, perm[j]] = (q[o, j] − zero[j/128, o]) · scale[j/128, o]` (f32 math).
//!
//! Bytes: `out·in/2 + 2·out·NG (+ NG·ceil(out/2))`, what `deltaserve_plan` charges for an int4
//! linear (checked by a test); `perm` (4·in bytes, act-order only) is not in the plan.

use deltaserve_model::DType;
use deltaserve_model::quant::GptqSource;
use half::{bf16, f16};

use crate::error::CudaError;

/// Input columns per scale / zero point.
pub const W4_GROUP: usize = deltaserve_plan::dtype::QUANT_GROUP;

/// How the scales' 16-bit patterns are read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScaleDtype {
    F16,
    Bf16,
}

impl ScaleDtype {
    pub fn to_f32(self, bits: u16) -> f32 {
        match self {
            Self::F16 => f16::from_bits(bits).to_f32(),
            Self::Bf16 => bf16::from_bits(bits).to_f32(),
        }
    }
}

/// One int4 linear in the device format (host copy).
#[derive(Clone, Debug, PartialEq)]
pub struct W4Linear {
    pub out_features: usize,
    pub in_features: usize,
    /// u32 × `out·in/8`, tile-major with interleaved nibbles (see the module docs).
    pub qweight: Vec<u32>,
    /// `[in/128, out]` 16-bit patterns in `scale_dtype`.
    pub scales: Vec<u16>,
    pub scale_dtype: ScaleDtype,
    /// `[in/128, ceil(out/2)]` packed zero points; `None` = symmetric (zero 8).
    pub zeros: Option<Vec<u8>>,
    /// `[in]`: input feature of each device column; `None` = identity.
    pub perm: Option<Vec<i32>>,
}

/// Device bytes of the tensors of one int4 linear (priced by the plan).
pub use deltaserve_plan::cuda::W4Bytes;

/// Index of the 16-byte chunk `c` (chunk `c % 4` of group `c / 4`: its words hold the group's columns
/// `32i + 8(c % 4) ..`, `i = 0..4`) of row `o` of an `[out, inp]` linear in the tile-major order (module
/// docs; `w4_u4` in kernels/prelude.cuh).
pub fn u4_index(out: usize, inp: usize, o: usize, c: usize) -> usize {
    let ng = inp / W4_GROUP;
    let (p, rr) = (o / 32, o % 32);
    let r = (out - 32 * p).min(32);
    let before: usize = (0..rr % 4).map(|jj| (r + 3 - jj) / 4).sum();
    p * ng * 128 + (c / 4) * r * 4 + (before + rr / 4) * 4 + c % 4
}

/// Index of the word holding device column `j` of row `o` (the column's nibble: [`nibble_of`]): the
/// group's 8-column piece `q = (j % 128) / 8` is word `q / 4` of chunk `q % 4` (`w4_word` in
/// kernels/prelude.cuh).
pub fn word_index(out: usize, inp: usize, o: usize, j: usize) -> usize {
    let q = (j % W4_GROUP) / 8;
    4 * u4_index(out, inp, o, 4 * (j / W4_GROUP) + q % 4) + q / 4
}

/// Nibble (0..8) of device column `c` (mod 8) inside its word.
#[inline]
pub fn nibble_of(c: usize) -> usize {
    (c & 1) * 4 + ((c & 7) >> 1)
}

/// The result of [`W4Linear::from_gptq`].
#[derive(Clone, Debug)]
pub struct W4Convert {
    pub linear: W4Linear,
    /// (group, row) entries whose v1 zero point was 16 (a stored 15: the classic format's
    /// wrap-around of a zero of 0) and whose quants were all ≥ 1, stored exactly as zero 15 with
    /// every quant lowered by one.
    pub zero16_shifted: usize,
    /// Entries with zero 16 and a quant of 0: not representable in 4 bits; stored as zero 15 (each
    /// such weight is off by one quantisation step). 0 for every real checkpoint we know of.
    pub zero16_clamped: usize,
    /// F32 scales that fit neither fp16 nor bf16 exactly, rounded to fp16.
    pub scales_rounded: usize,
}

fn werr(name: &str, msg: impl std::fmt::Display) -> CudaError {
    CudaError::Weights(format!("`{name}` (int4): {msg}"))
}

/// Little-endian u32 / u16 words of a byte slice.
fn words(b: &[u8]) -> impl Iterator<Item = u32> + '_ {
    b.chunks_exact(4).map(|w| u32::from_le_bytes([w[0], w[1], w[2], w[3]]))
}

impl W4Linear {
    /// Number of groups of 128 device columns.
    pub fn groups(&self) -> usize {
        self.in_features / W4_GROUP
    }

    /// Errors unless `[out, in]` can be stored in this format.
    pub fn check_shape(name: &str, out: usize, inp: usize) -> Result<(), CudaError> {
        if out == 0 || inp == 0 || !inp.is_multiple_of(W4_GROUP) {
            return Err(werr(
                name,
                format!("shape [{out}, {inp}]: the CUDA int4 format needs in > 0 a multiple of {W4_GROUP} and out > 0"),
            ));
        }
        if i32::try_from(inp).is_err() || i32::try_from(out).is_err() {
            return Err(werr(name, format!("shape [{out}, {inp}] is too large")));
        }
        Ok(())
    }

    pub fn bytes(&self) -> W4Bytes {
        W4Bytes::new(self.out_features, self.in_features, self.zeros.is_some(), self.perm.is_some())
    }

    /// Quant of row `o`, device column `j`.
    pub fn q(&self, o: usize, j: usize) -> u32 {
        (self.qweight[word_index(self.out_features, self.in_features, o, j)] >> (4 * nibble_of(j))) & 15
    }

    /// Zero point of (group `g`, row `o`).
    pub fn zero(&self, g: usize, o: usize) -> u32 {
        match &self.zeros {
            Some(z) => (z[g * self.out_features.div_ceil(2) + o / 2] >> (4 * (o & 1))) as u32 & 15,
            None => 8,
        }
    }

    pub fn scale(&self, g: usize, o: usize) -> f32 {
        self.scale_dtype.to_f32(self.scales[g * self.out_features + o])
    }

    /// Input feature of device column `j`.
    pub fn feature(&self, j: usize) -> usize {
        self.perm.as_ref().map_or(j, |p| p[j] as usize)
    }

    /// Row `o` dequantised in the input-feature order (f32, as the kernels compute it before
    /// rounding).
    pub fn dequantize_row(&self, o: usize) -> Vec<f32> {
        let mut row = vec![0f32; self.in_features];
        for j in 0..self.in_features {
            let g = j / W4_GROUP;
            row[self.feature(j)] = (self.q(o, j) as i32 - self.zero(g, o) as i32) as f32 * self.scale(g, o);
        }
        row
    }

    /// The whole `[out, in]` weight in f32, input-feature order.
    pub fn dequantize(&self) -> Vec<f32> {
        (0..self.out_features).flat_map(|o| self.dequantize_row(o)).collect()
    }

    /// What `w4_dequant` writes for rows `r0..r1`: bf16 bits `[r1 − r0, in]`.
    pub fn dequantize_bf16(&self, r0: usize, r1: usize) -> Vec<u16> {
        (r0..r1).flat_map(|o| self.dequantize_row(o)).map(|v| bf16::from_f32(v).to_bits()).collect()
    }

    /// Packs quants given per (row, device column) (`q[o·in + j]`, values 0..16) into `qweight`.
    pub fn pack_quants(out: usize, inp: usize, q: &[u8]) -> Vec<u32> {
        let mut w = vec![0u32; out * inp / 8];
        for o in 0..out {
            for j in 0..inp {
                w[word_index(out, inp, o, j)] |= (q[o * inp + j] as u32 & 15) << (4 * nibble_of(j));
            }
        }
        w
    }

    /// Packs zero points given per (group, row) (`z[g·out + o]`, 0..16) into the `zeros` bytes.
    pub fn pack_zeros(out: usize, groups: usize, z: &[u8]) -> Vec<u8> {
        let stride = out.div_ceil(2);
        let mut b = vec![0u8; groups * stride];
        for g in 0..groups {
            for o in 0..out {
                b[g * stride + o / 2] |= (z[g * out + o] & 15) << (4 * (o & 1));
            }
        }
        b
    }

    /// Converts one GPTQ-packed linear (4 bits, v1 or v2 zeros, symmetric or not, with or without
    /// `g_idx`) to the device format. The group size must be a multiple of 128 (or one group per
    /// row); an act-order `g_idx` is turned into `perm` (the columns sorted by group), and a
    /// `g_idx` that follows the input order takes the fast path (no `perm`). `name` is used in
    /// errors.
    pub fn from_gptq(src: &GptqSource, name: &str) -> Result<W4Convert, CudaError> {
        let (out, inp) = (src.out_features, src.in_features);
        Self::check_shape(name, out, inp)?;
        if src.params.bits != 4 {
            return Err(werr(name, format!("{} bits: only 4-bit GPTQ weights convert", src.params.bits)));
        }
        let gs = src.params.group_size.unwrap_or(inp).min(inp).max(1);
        let src_groups = inp.div_ceil(gs);
        if !gs.is_multiple_of(W4_GROUP) {
            return Err(werr(
                name,
                format!(
                    "GPTQ group size {gs}: the CUDA int4 format stores one scale per {W4_GROUP} input rows, so the \
                     group size must be a multiple of {W4_GROUP} (or -1)"
                ),
            ));
        }
        let want = |what: &str, got: usize, expect: usize| {
            if got == expect { Ok(()) } else { Err(werr(name, format!("{what} has {got} bytes, expected {expect}"))) }
        };
        want("qweight", src.qweight.len(), inp / 8 * out * 4)?;
        let selem = match src.scales_dtype {
            DType::F16 | DType::BF16 => 2,
            DType::F32 => 4,
            d => return Err(werr(name, format!("scales have dtype {}; expected F16, BF16 or F32", d.name()))),
        };
        want("scales", src.scales.len(), src_groups * out * selem)?;

        // Source group of every input feature.
        let src_group: Vec<usize> = match src.g_idx {
            Some(b) => {
                want("g_idx", b.len(), inp * 4)?;
                words(b)
                    .enumerate()
                    .map(|(i, g)| {
                        let g = g as i32;
                        if g < 0 || g as usize >= src_groups {
                            Err(werr(name, format!("g_idx[{i}] = {g} is outside the {src_groups} groups")))
                        } else {
                            Ok(g as usize)
                        }
                    })
                    .collect::<Result<_, _>>()?
            }
            None => (0..inp).map(|i| i / gs).collect(),
        };
        let uniform = |order: &dyn Fn(usize) -> usize| {
            (0..inp / W4_GROUP)
                .all(|b| (1..W4_GROUP).all(|c| src_group[order(b * W4_GROUP + c)] == src_group[order(b * W4_GROUP)]))
        };
        let perm: Option<Vec<i32>> = if uniform(&|j| j) {
            None
        } else {
            let mut p: Vec<usize> = (0..inp).collect();
            p.sort_by_key(|&i| src_group[i]); // stable
            if !uniform(&|j| p[j]) {
                let mut count = vec![0usize; src_groups];
                src_group.iter().for_each(|&g| count[g] += 1);
                let (g, n) = count.iter().enumerate().find(|(_, n)| !n.is_multiple_of(W4_GROUP)).unwrap_or((0, &0));
                return Err(werr(
                    name,
                    format!(
                        "g_idx puts {n} input rows in group {g}; the CUDA int4 format needs every group to be a \
                         multiple of {W4_GROUP} rows"
                    ),
                ));
            }
            Some(p.into_iter().map(|i| i as i32).collect())
        };
        let feature = |j: usize| perm.as_ref().map_or(j, |p| p[j] as usize);
        let groups = inp / W4_GROUP;
        // Source group of each device group.
        let dev_src: Vec<usize> = (0..groups).map(|g| src_group[feature(g * W4_GROUP)]).collect();

        // Scales.
        let (src_bits, scale_dtype, scales_rounded): (Vec<u16>, ScaleDtype, usize) = match src.scales_dtype {
            DType::F16 => {
                (src.scales.chunks_exact(2).map(|b| u16::from_le_bytes([b[0], b[1]])).collect(), ScaleDtype::F16, 0)
            }
            DType::BF16 => {
                (src.scales.chunks_exact(2).map(|b| u16::from_le_bytes([b[0], b[1]])).collect(), ScaleDtype::Bf16, 0)
            }
            _ => {
                let f: Vec<f32> = words(src.scales).map(f32::from_bits).collect();
                let exact16 = |x: &f32| f16::from_f32(*x).to_f32() == *x || x.is_nan();
                let exactb = |x: &f32| bf16::from_f32(*x).to_f32() == *x || x.is_nan();
                if f.iter().all(exact16) {
                    (f.iter().map(|&x| f16::from_f32(x).to_bits()).collect(), ScaleDtype::F16, 0)
                } else if f.iter().all(exactb) {
                    (f.iter().map(|&x| bf16::from_f32(x).to_bits()).collect(), ScaleDtype::Bf16, 0)
                } else {
                    let n = f.iter().filter(|x| !exact16(x)).count();
                    (f.iter().map(|&x| f16::from_f32(x).to_bits()).collect(), ScaleDtype::F16, n)
                }
            }
        };
        let mut scales = vec![0u16; groups * out];
        for (g, &sg) in dev_src.iter().enumerate() {
            scales[g * out..][..out].copy_from_slice(&src_bits[sg * out..][..out]);
        }

        // Quants in device order.
        let mut q = vec![0u8; out * inp];
        for (j, qcol) in (0..inp).map(|j| (j, feature(j))) {
            let row = &src.qweight[(qcol / 8) * out * 4..][..out * 4];
            for (o, w) in words(row).enumerate() {
                q[o * inp + j] = ((w >> (4 * (qcol % 8))) & 15) as u8;
            }
        }

        // Zero points (real zero = stored + offset, 0..=16).
        let (mut shifted, mut clamped) = (0, 0);
        let zeros = if src.params.sym {
            None
        } else {
            let qz = src.qzeros.ok_or_else(|| werr(name, "asymmetric GPTQ weight without qzeros"))?;
            if !out.is_multiple_of(8) {
                return Err(werr(name, format!("{out} output rows cannot hold GPTQ zero points packed 8 per int32")));
            }
            want("qzeros", qz.len(), src_groups * out / 8 * 4)?;
            let packed: Vec<u32> = words(qz).collect();
            let off = src.zero_format.offset() as u32;
            let mut z = vec![0u8; groups * out];
            for (g, &sg) in dev_src.iter().enumerate() {
                for o in 0..out {
                    let real = ((packed[sg * out / 8 + o / 8] >> (4 * (o % 8))) & 15) + off;
                    if real == 16 {
                        let cols = o * inp + g * W4_GROUP..o * inp + (g + 1) * W4_GROUP;
                        if q[cols.clone()].iter().all(|&v| v >= 1) {
                            q[cols].iter_mut().for_each(|v| *v -= 1);
                            shifted += 1;
                        } else {
                            clamped += 1;
                        }
                        z[g * out + o] = 15;
                    } else {
                        z[g * out + o] = real as u8;
                    }
                }
            }
            Some(Self::pack_zeros(out, groups, &z))
        };
        let linear = W4Linear {
            out_features: out,
            in_features: inp,
            qweight: Self::pack_quants(out, inp, &q),
            scales,
            scale_dtype,
            zeros,
            perm,
        };
        Ok(W4Convert { linear, zero16_shifted: shifted, zero16_clamped: clamped, scales_rounded })
    }

    /// The reference quantiser (`w4_quantize` on the GPU matches it bit for bit): round to nearest
    /// (ties to even) per group of 128 columns of each row, fp16 scales.
    ///
    /// - symmetric: `s = fp16(min(max|w| / 7, 65504))`, `q = clamp(rint(w / s), −8, 7) + 8`;
    /// - asymmetric: `lo = min(min w, 0)`, `hi = max(max w, 0)`, `s = fp16(min((hi − lo) / 15, 65504))`,
    ///   `zero = clamp(rint(−lo / s), 0, 15)`, `q = clamp(rint(w / s) + zero, 0, 15)`;
    /// - a group whose scale rounds to 0 stores q = zero (8, or 0 when asymmetric).
    ///
    /// `w` is `[out, in]` row-major (the bf16 values as f32).
    pub fn quantize(w: &[f32], out: usize, inp: usize, asym: bool) -> Result<W4Linear, CudaError> {
        Self::check_shape("quantize", out, inp)?;
        if w.len() != out * inp {
            return Err(werr("quantize", format!("{} values for a [{out}, {inp}] weight", w.len())));
        }
        let groups = inp / W4_GROUP;
        let mut q = vec![0u8; out * inp];
        let mut scales = vec![0u16; groups * out];
        let mut z = vec![0u8; groups * out];
        for o in 0..out {
            for g in 0..groups {
                let vals = &w[o * inp + g * W4_GROUP..][..W4_GROUP];
                let (s16, zero) = group_params(vals, asym);
                let sf = f16::from_bits(s16).to_f32();
                for (c, &v) in vals.iter().enumerate() {
                    q[o * inp + g * W4_GROUP + c] = quant(v, sf, zero, asym);
                }
                scales[g * out + o] = s16;
                z[g * out + o] = zero as u8;
            }
        }
        Ok(W4Linear {
            out_features: out,
            in_features: inp,
            qweight: Self::pack_quants(out, inp, &q),
            scales,
            scale_dtype: ScaleDtype::F16,
            zeros: asym.then(|| Self::pack_zeros(out, groups, &z)),
            perm: None,
        })
    }
}

/// (fp16 scale bits, zero) of one group, as `w4_quantize` computes them. `max`/`min` (not `clamp`):
/// NaN handling as CUDA's fmaxf/fminf.
#[allow(clippy::manual_clamp)]
fn group_params(vals: &[f32], asym: bool) -> (u16, u32) {
    if asym {
        let lo = vals.iter().fold(0f32, |a, &v| a.min(v));
        let hi = vals.iter().fold(0f32, |a, &v| a.max(v));
        let s16 = f16::from_f32(((hi - lo) / 15.0).min(65504.0));
        let sf = s16.to_f32();
        let zero = if sf > 0.0 { (-lo / sf).round_ties_even().max(0.0).min(15.0) as u32 } else { 0 };
        (s16.to_bits(), zero)
    } else {
        let amax = vals.iter().fold(0f32, |a, &v| a.max(v.abs()));
        (f16::from_f32((amax / 7.0).min(65504.0)).to_bits(), 8)
    }
}

#[allow(clippy::manual_clamp)]
fn quant(v: f32, sf: f32, zero: u32, asym: bool) -> u8 {
    if sf > 0.0 {
        let r = (v / sf).round_ties_even();
        if asym { (r + zero as f32).max(0.0).min(15.0) as u8 } else { (r.max(-8.0).min(7.0) as i32 + 8) as u8 }
    } else {
        zero as u8
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use deltaserve_model::quant::{GptqParams, ZeroFormat};
    use deltaserve_plan::dtype::WeightsDtype;
    use rand::rngs::StdRng;
    use rand::{RngExt, SeedableRng};

    /// A GPTQ checkpoint's tensors, packed from the format's definition (qweight `[in/8, out]`
    /// with input row `i` in word row `i/8`, nibble `i%8`; qzeros `[groups, out/8]` along `out`;
    /// v1 stores zero − 1).
    struct Gptq {
        params: GptqParams,
        zf: ZeroFormat,
        out: usize,
        inp: usize,
        qweight: Vec<u8>,
        qzeros: Option<Vec<u8>>,
        scales: Vec<u8>,
        sdt: DType,
        g_idx: Option<Vec<u8>>,
    }

    impl Gptq {
        fn source(&self) -> GptqSource<'_> {
            GptqSource {
                params: self.params,
                zero_format: self.zf,
                out_features: self.out,
                in_features: self.inp,
                qweight: &self.qweight,
                qzeros: self.qzeros.as_deref(),
                scales: &self.scales,
                scales_dtype: self.sdt,
                g_idx: self.g_idx.as_deref(),
            }
        }
    }

    #[derive(Clone, Copy)]
    struct Spec {
        out: usize,
        inp: usize,
        group: Option<usize>,
        sym: bool,
        zf: ZeroFormat,
        /// 0: no g_idx, 1: trivial g_idx (i / group), 2: act-order permutation
        gidx: u8,
        sdt: DType,
        /// write qzeros for symmetric weights too (as AutoGPTQ does)
        sym_qzeros: bool,
    }

    const BASE: Spec = Spec {
        out: 40,
        inp: 512,
        group: Some(128),
        sym: true,
        zf: ZeroFormat::V1MinusOne,
        gidx: 0,
        sdt: DType::F16,
        sym_qzeros: false,
    };

    fn le32(v: impl IntoIterator<Item = u32>) -> Vec<u8> {
        v.into_iter().flat_map(|w| w.to_le_bytes()).collect()
    }

    /// Random quants / zeros / scales in the GPTQ layout. `zero16`: v1 zeros may be 16 (stored 15).
    fn make(sp: Spec, rng: &mut StdRng, zero16: bool) -> Gptq {
        let (out, inp) = (sp.out, sp.inp);
        let gs = sp.group.unwrap_or(inp);
        let groups = inp.div_ceil(gs);
        // Group of each input row: in order, or a random permutation of the in-order assignment.
        let mut g_of: Vec<usize> = (0..inp).map(|i| i / gs).collect();
        if sp.gidx == 2 {
            for k in (1..inp).rev() {
                let j = rng.random_range(0..=k);
                g_of.swap(k, j);
            }
        }
        let mut qweight = vec![0u32; inp / 8 * out];
        for i in 0..inp {
            for o in 0..out {
                let q: u32 = rng.random_range(0..16);
                qweight[(i / 8) * out + o] |= q << (4 * (i % 8));
            }
        }
        let qzeros = (!sp.sym || sp.sym_qzeros).then(|| {
            let mut z = vec![0u32; groups * out / 8];
            for g in 0..groups {
                for o in 0..out {
                    let stored: u32 = match (sp.sym, sp.zf) {
                        (true, ZeroFormat::V1MinusOne) => 7,
                        (true, ZeroFormat::V2Exact) => 8,
                        (false, ZeroFormat::V1MinusOne) => rng.random_range(0..if zero16 { 16 } else { 15 }),
                        (false, ZeroFormat::V2Exact) => rng.random_range(0..16),
                    };
                    z[g * (out / 8) + o / 8] |= stored << (4 * (o % 8));
                }
            }
            le32(z)
        });
        let scales: Vec<f32> = (0..groups * out)
            .map(|_| rng.random_range(1e-3f32..2e-2) * if rng.random_range(0..8) == 0 { -1.0 } else { 1.0 })
            .collect();
        let scales = match sp.sdt {
            DType::F16 => scales.iter().flat_map(|&s| f16::from_f32(s).to_le_bytes()).collect(),
            DType::BF16 => scales.iter().flat_map(|&s| bf16::from_f32(s).to_le_bytes()).collect(),
            // f32 scales holding fp16 values (as a float32 export of fp16 scales does)
            _ => le32(scales.iter().map(|&s| f16::from_f32(s).to_f32().to_bits())),
        };
        let g_idx = (sp.gidx > 0).then(|| le32(g_of.iter().map(|&g| g as u32)));
        Gptq {
            params: GptqParams { bits: 4, group_size: sp.group, sym: sp.sym },
            zf: sp.zf,
            out,
            inp,
            qweight: le32(qweight),
            qzeros,
            scales,
            sdt: sp.sdt,
            g_idx,
        }
    }

    fn roundtrip(sp: Spec, seed: u64) -> W4Convert {
        let mut rng = StdRng::seed_from_u64(seed);
        let g = make(sp, &mut rng, false);
        let src = g.source();
        let want = deltaserve_model::QuantizedSource::Gptq(src.clone()).dequantize("t").expect("source dequantises");
        let c = W4Linear::from_gptq(&src, "t").expect("converts");
        let got = c.linear.dequantize();
        assert_eq!(got.len(), want.len());
        let bad = got.iter().zip(&want).position(|(a, b)| a.to_bits() != b.to_bits());
        assert!(bad.is_none(), "first mismatch at {bad:?}: {:?} vs {:?}", bad.map(|i| got[i]), bad.map(|i| want[i]));
        assert_eq!(c.linear.bytes().total(), {
            let b = &c.linear;
            b.qweight.len() * 4
                + b.scales.len() * 2
                + b.zeros.as_ref().map_or(0, Vec::len)
                + b.perm.as_ref().map_or(0, |p| p.len() * 4)
        });
        c
    }

    /// A tensor-parallel shard of a GPTQ linear, cut in its packed form, dequantises (directly and
    /// through the device format) to the same shard of the whole dequantised weight.
    #[test]
    fn gptq_shards_equal_the_shards_of_the_weight() {
        use deltaserve_model::shard::{Split, shard_gptq};
        let one = |r: std::ops::Range<usize>| std::iter::once(r).collect::<Vec<_>>();
        let mut rng = StdRng::seed_from_u64(21);
        let specs = [
            BASE,
            Spec { sym: false, zf: ZeroFormat::V2Exact, sdt: DType::BF16, ..BASE },
            Spec { gidx: 1, sym: false, ..BASE },
            Spec { group: None, ..BASE },
            Spec { gidx: 2, ..BASE },
        ];
        let splits = [
            Split::Rows(vec![0..16, 24..40]),
            Split::Rows(one(8..48)),
            Split::Cols(one(128..384)),
            Split::Cols(one(0..256)),
            Split::Replicated,
        ];
        for (k, sp) in specs.iter().enumerate() {
            let sp = Spec { out: 48, ..*sp };
            let g = make(sp, &mut rng, false);
            let full = deltaserve_model::QuantizedSource::Gptq(g.source()).dequantize("t").unwrap();
            for split in &splits {
                let cut = match shard_gptq(split, &g.source(), "t") {
                    Ok(c) => c,
                    Err(e) => {
                        // Only act-order weights cut by input columns are refused.
                        assert!(sp.gidx == 2 && matches!(split, Split::Cols(_)), "spec {k} {split:?}: {e}");
                        assert!(e.to_string().contains("act-order"), "{e}");
                        continue;
                    }
                };
                let want = split.extract("t", &[48, 512], &full).unwrap();
                let got = deltaserve_model::QuantizedSource::Gptq(cut.source()).dequantize("t").unwrap();
                assert_eq!(got, want, "spec {k} {split:?}: the shard's own dequantisation");
                let dev = W4Linear::from_gptq(&cut.source(), "t").unwrap().linear.dequantize();
                assert_eq!(dev, want, "spec {k} {split:?}: through the device format");
            }
        }
        // Ranges that cut a packed word or a group are errors, not wrong weights.
        let g = make(BASE, &mut rng, false);
        assert!(shard_gptq(&Split::Rows(one(0..12)), &g.source(), "t").is_err());
        assert!(shard_gptq(&Split::Cols(one(0..200)), &g.source(), "t").is_err());
    }

    #[test]
    fn gptq_symmetric_v1_and_v2_convert_exactly() {
        for zf in [ZeroFormat::V1MinusOne, ZeroFormat::V2Exact] {
            for sym_qzeros in [false, true] {
                let c = roundtrip(Spec { zf, sym_qzeros, ..BASE }, 1);
                assert!(c.linear.zeros.is_none() && c.linear.perm.is_none());
            }
        }
    }

    #[test]
    fn gptq_asymmetric_v1_and_v2_convert_exactly() {
        for zf in [ZeroFormat::V1MinusOne, ZeroFormat::V2Exact] {
            let c = roundtrip(Spec { sym: false, zf, ..BASE }, 2);
            assert!(c.linear.zeros.is_some());
            assert_eq!((c.zero16_shifted, c.zero16_clamped), (0, 0));
        }
    }

    #[test]
    fn gptq_act_order_becomes_a_permutation_and_trivial_g_idx_takes_the_fast_path() {
        for sym in [true, false] {
            for zf in [ZeroFormat::V1MinusOne, ZeroFormat::V2Exact] {
                let c = roundtrip(Spec { sym, zf, gidx: 2, ..BASE }, 3);
                let p = c.linear.perm.as_ref().expect("act-order needs a permutation");
                let mut sorted = p.clone();
                sorted.sort();
                assert_eq!(sorted, (0..512).collect::<Vec<i32>>());
                let c = roundtrip(Spec { sym, zf, gidx: 1, ..BASE }, 4);
                assert!(c.linear.perm.is_none(), "g_idx = i/128 must not permute");
            }
        }
    }

    #[test]
    fn gptq_group_multiples_of_128_per_channel_and_scale_dtypes() {
        for group in [None, Some(256), Some(512), Some(4096)] {
            for sym in [true, false] {
                roundtrip(Spec { group, sym, ..BASE }, 5);
                roundtrip(Spec { group, sym, gidx: 2, ..BASE }, 6);
            }
        }
        let c = roundtrip(Spec { sdt: DType::BF16, sym: false, ..BASE }, 7);
        assert_eq!(c.linear.scale_dtype, ScaleDtype::Bf16);
        // f32 scales that are fp16 values: fp16, exact.
        let c = roundtrip(Spec { sdt: DType::F32, ..BASE }, 8);
        assert_eq!((c.linear.scale_dtype, c.scales_rounded), (ScaleDtype::F16, 0));
    }

    #[test]
    fn v1_zero_of_16_is_shifted_exactly_or_counted() {
        let mut rng = StdRng::seed_from_u64(9);
        let sp = Spec { sym: false, out: 8, inp: 256, ..BASE };
        let mut g = make(sp, &mut rng, true);
        // Every zero 16 (stored 15); row 0 group 0 has quants >= 1 (shiftable), the rest keep 0s.
        g.qzeros = Some(le32(vec![0xffff_ffffu32; 2]));
        let mut qw: Vec<u32> = words(&g.qweight).collect();
        for w in qw.iter_mut().take(128 / 8 * 8) {
            *w |= 0x1111_1111; // rows 0..8 of group 0: every quant >= 1
        }
        for o in 0..8 {
            qw[(128 / 8) * 8 + o] &= 0xffff_fff0; // one quant 0 in group 1 of each row
        }
        g.qweight = le32(qw);
        let src = g.source();
        let c = W4Linear::from_gptq(&src, "t").expect("converts");
        assert_eq!((c.zero16_shifted, c.zero16_clamped), (8, 8));
        let want = deltaserve_model::QuantizedSource::Gptq(src.clone()).dequantize("t").expect("dequantises");
        let got = c.linear.dequantize();
        for o in 0..8 {
            for i in 0..128 {
                assert_eq!(got[o * 256 + i].to_bits(), want[o * 256 + i].to_bits(), "shifted group must be exact");
            }
        }
    }

    #[test]
    fn unsupported_layouts_are_errors_not_panics() {
        let mut rng = StdRng::seed_from_u64(10);
        let g = make(Spec { group: Some(64), ..BASE }, &mut rng, false);
        let e = W4Linear::from_gptq(&g.source(), "m.down_proj").unwrap_err().to_string();
        assert!(e.contains("m.down_proj") && e.contains("group size 64"), "{e}");
        let g = make(Spec { inp: 520, group: Some(520), ..BASE }, &mut rng, false);
        assert!(W4Linear::from_gptq(&g.source(), "t").is_err());
        // g_idx with unequal groups
        let mut g = make(Spec { gidx: 1, ..BASE }, &mut rng, false);
        let mut gi: Vec<u32> = (0..512).map(|i| (i / 128) as u32).collect();
        gi[0] = 1;
        g.g_idx = Some(le32(gi));
        let e = W4Linear::from_gptq(&g.source(), "t").unwrap_err().to_string();
        assert!(e.contains("rows in group"), "{e}");
        // truncated tensors
        let mut g = make(Spec { sym: false, ..BASE }, &mut rng, false);
        g.qweight.pop();
        assert!(W4Linear::from_gptq(&g.source(), "t").is_err());
        let mut g = make(Spec { sym: false, ..BASE }, &mut rng, false);
        g.qzeros.as_mut().expect("asym").truncate(4);
        assert!(W4Linear::from_gptq(&g.source(), "t").is_err());
        let mut g = make(Spec { gidx: 2, ..BASE }, &mut rng, false);
        g.g_idx.as_mut().expect("g_idx")[0] = 200;
        assert!(W4Linear::from_gptq(&g.source(), "t").unwrap_err().to_string().contains("g_idx[0]"));
    }

    #[test]
    fn quantize_stays_within_half_a_step() {
        let mut rng = StdRng::seed_from_u64(11);
        let (out, inp) = (7, 384);
        let mut w: Vec<f32> =
            (0..out * inp).map(|_| bf16::from_f32(rng.random_range(-0.05f32..0.05)).to_f32()).collect();
        w[3] = 0.9; // an outlier
        w[inp..inp + 128].iter_mut().for_each(|v| *v = 0.0); // an all-zero group
        w[2 * inp..2 * inp + 128].iter_mut().for_each(|v| *v = v.abs() + 0.01); // all positive
        for asym in [false, true] {
            let l = W4Linear::quantize(&w, out, inp, asym).expect("quantizes");
            let d = l.dequantize();
            for o in 0..out {
                for i in 0..inp {
                    let s = l.scale(i / 128, o);
                    let err = (d[o * inp + i] - w[o * inp + i]).abs();
                    assert!(err <= 0.5 * s * (1.0 + 1e-3) + 1e-9, "asym {asym} ({o}, {i}): err {err} step {s}");
                }
            }
            assert!(d[inp..inp + 128].iter().all(|&v| v == 0.0));
        }
    }

    #[test]
    fn nibble_layout_pairs_adjacent_columns() {
        let q: Vec<u8> = (0..8).collect();
        let w = W4Linear::pack_quants(1, 8, &q)[0];
        for p in 0..4 {
            let pair = (w >> (4 * p)) & 0x000f_000f;
            assert_eq!((pair & 0xffff, pair >> 16), (2 * p as u32, 2 * p as u32 + 1));
        }
    }

    /// The tile-major order is a bijection onto `0..out·in/32` chunks, a full (pair, group) unit is
    /// 2 KB of consecutive chunks, and lane `(g, t)`'s copy `j` of a full unit is chunk `32j + 4g + t`
    /// (each copy of the warp: 512 contiguous bytes).
    #[test]
    fn tile_major_order_is_a_bijection_with_contiguous_units() {
        for (out, inp) in [(64, 256), (48, 384), (7, 128), (33, 128), (101, 512), (3, 256)] {
            let n = out * inp / 32;
            let mut seen = vec![false; n];
            for o in 0..out {
                for c in 0..inp / 32 {
                    let u = u4_index(out, inp, o, c);
                    assert!(u < n && !seen[u], "[{out}, {inp}] row {o} chunk {c} -> {u}");
                    seen[u] = true;
                    // Rows of one unit stay inside it.
                    let (p, k) = (o / 32, c / 4);
                    let r = (out - 32 * p).min(32);
                    let base = p * (inp / 128) * 128 + k * r * 4;
                    assert!((base..base + 4 * r).contains(&u));
                    if r == 32 {
                        let (g, j, t) = ((o % 32) / 4, o % 4, c % 4);
                        assert_eq!(u - base, 32 * j + 4 * g + t);
                    }
                }
            }
        }
        // Round trip through the packer.
        let (out, inp) = (40, 256);
        let q: Vec<u8> = (0..out * inp).map(|i| (i * 7 % 16) as u8).collect();
        let l = W4Linear {
            out_features: out,
            in_features: inp,
            qweight: W4Linear::pack_quants(out, inp, &q),
            scales: vec![0; 2 * out],
            scale_dtype: ScaleDtype::F16,
            zeros: None,
            perm: None,
        };
        assert!((0..out * inp).all(|i| l.q(i / inp, i % inp) == q[i] as u32));
        // Word i of a chunk t holds the group's columns 32i + 8t .. + 8: the four chunks of a row's
        // group, word by word, are its columns in order.
        for j in (0..inp).step_by(8) {
            let (k, q) = (j / 128, (j % 128) / 8);
            assert_eq!(word_index(out, inp, 5, j), 4 * u4_index(out, inp, 5, 4 * k + q % 4) + q / 4);
            assert_eq!(word_index(out, inp, 5, j + 7), word_index(out, inp, 5, j));
        }
        assert_eq!(word_index(out, inp, 0, 8), 4 * u4_index(out, inp, 0, 1));
        assert_eq!(word_index(out, inp, 0, 32), 4 * u4_index(out, inp, 0, 0) + 1);
    }

    #[test]
    fn f32_scales_keep_their_value_or_are_counted() {
        let mut rng = StdRng::seed_from_u64(12);
        let mut g = make(BASE, &mut rng, false);
        // bf16 values that fp16 cannot hold exactly (tiny): stored as bf16, exact.
        let vals: Vec<f32> = (0..4 * 40).map(|i| bf16::from_f32(1e-6 * (1.0 + i as f32 / 7.0)).to_f32()).collect();
        g.scales = le32(vals.iter().map(|v| v.to_bits()));
        g.sdt = DType::F32;
        let c = W4Linear::from_gptq(&g.source(), "t").expect("converts");
        assert_eq!((c.linear.scale_dtype, c.scales_rounded), (ScaleDtype::Bf16, 0));
        let want = deltaserve_model::QuantizedSource::Gptq(g.source()).dequantize("t").expect("dequantises");
        assert!(c.linear.dequantize().iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()));
        // Neither fp16 nor bf16: rounded to fp16 and counted.
        let vals: Vec<f32> = (0..4 * 40).map(|i| 0.01 + i as f32 * 1.234_567e-7).collect();
        g.scales = le32(vals.iter().map(|v| v.to_bits()));
        let c = W4Linear::from_gptq(&g.source(), "t").expect("converts");
        assert_eq!(c.linear.scale_dtype, ScaleDtype::F16);
        assert!(c.scales_rounded > 0);
    }

    #[test]
    fn bytes_match_what_the_plan_charges() {
        for (out, inp) in [(5120, 17408), (34816, 5120), (48, 5120), (1024, 6144), (7, 384), (3, 256)] {
            for asym in [false, true] {
                let b = W4Bytes::new(out, inp, asym, false);
                assert_eq!(b.total() as u128, WeightsDtype::Int4.linear_bytes(out, inp, asym), "[{out}, {inp}] {asym}");
                // Placed as the plan's weights region places them: each tensor 256-byte aligned.
                let al = |x: usize| x.next_multiple_of(256);
                let (offs, total) = b.layout(256);
                assert_eq!(total, al(b.qweight) + al(b.scales) + al(b.zeros), "[{out}, {inp}] {asym}");
                assert_eq!(offs[1], al(b.qweight));
                assert!(offs.iter().all(|o| o % 256 == 0));
            }
        }
    }
}
