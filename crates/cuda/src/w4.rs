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

    /// A linear from its quants per (row, device column) (`q[o·in + j]`, 0..16), zero points per
    /// (group, row) (`z[g·out + o]`; None: symmetric) and scales `[in/128, out]` in `scale_dtype`;
    /// no act-order permutation.
    pub fn from_quants(
        out: usize,
        inp: usize,
        q: &[u8],
        z: Option<&[u8]>,
        scales: Vec<u16>,
        scale_dtype: ScaleDtype,
    ) -> Self {
        W4Linear {
            out_features: out,
            in_features: inp,
            qweight: Self::pack_quants(out, inp, q),
            scales,
            scale_dtype,
            zeros: z.map(|z| Self::pack_zeros(out, inp / W4_GROUP, z)),
            perm: None,
        }
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

    /// `self`'s rows then `other`'s as one `[out + other.out, in]` linear (an expert's gate and up
    /// projections, which the device keeps as one): both of one format (zero points or not, scale dtype,
    /// no `perm`) and `self.out` a multiple of 32, so that the pairs of 32 rows, and with them the
    /// tile-major words, follow each other unchanged. `name` is used in errors.
    pub fn stack_rows(&self, other: &W4Linear, name: &str) -> Result<W4Linear, CudaError> {
        let same = self.in_features == other.in_features
            && self.zeros.is_some() == other.zeros.is_some()
            && self.scale_dtype == other.scale_dtype
            && self.perm.is_none()
            && other.perm.is_none();
        if !same || !self.out_features.is_multiple_of(32) {
            return Err(werr(
                name,
                format!(
                    "cannot stack [{}, {}] and [{}, {}] rows: they need one format (zero points, scale dtype, no \
                     act-order) and the first a multiple of 32 rows",
                    self.out_features, self.in_features, other.out_features, other.in_features
                ),
            ));
        }
        let (a, b, groups) = (self.out_features, other.out_features, self.groups());
        let mut qweight = self.qweight.clone();
        qweight.extend_from_slice(&other.qweight);
        let rows = |v: &[u16], n: usize, g: usize| v[g * n..(g + 1) * n].to_vec();
        let scales =
            (0..groups).flat_map(|g| [rows(&self.scales, a, g), rows(&other.scales, b, g)]).flatten().collect();
        let zeros = match (&self.zeros, &other.zeros) {
            (Some(_), Some(_)) => {
                let z: Vec<u8> = (0..groups)
                    .flat_map(|g| {
                        let mine = (0..a).map(move |o| self.zero(g, o) as u8);
                        mine.chain((0..b).map(move |o| other.zero(g, o) as u8))
                    })
                    .collect();
                Some(Self::pack_zeros(a + b, groups, &z))
            }
            _ => None,
        };
        Ok(W4Linear {
            out_features: a + b,
            in_features: self.in_features,
            qweight,
            scales,
            scale_dtype: self.scale_dtype,
            zeros,
            perm: None,
        })
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
#[path = "w4_tests.rs"]
mod tests;
