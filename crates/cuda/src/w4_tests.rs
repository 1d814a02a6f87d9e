//! Tests of the int4 device format's host side (`w4.rs`): conversion, quantiser, layout.

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
    let mut w: Vec<f32> = (0..out * inp).map(|_| bf16::from_f32(rng.random_range(-0.05f32..0.05)).to_f32()).collect();
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
fn stacked_rows_are_one_linear_of_both() {
    let mut rng = StdRng::seed_from_u64(12);
    let (a, b, inp) = (64, 40, 256);
    let mut w = |n: usize| -> Vec<f32> { (0..n * inp).map(|_| rng.random_range(-0.05f32..0.05)).collect() };
    let (wa, wb) = (w(a), w(b));
    for asym in [false, true] {
        let (la, lb) = (W4Linear::quantize(&wa, a, inp, asym).unwrap(), W4Linear::quantize(&wb, b, inp, asym).unwrap());
        let both = la.stack_rows(&lb, "t").unwrap();
        assert_eq!((both.out_features, both.bytes()), (a + b, W4Bytes::new(a + b, inp, asym, false)));
        let mut want = la.dequantize();
        want.extend(lb.dequantize());
        assert_eq!(both.dequantize(), want, "asym {asym}");
    }
    // Formats that differ, or a first part that is not whole pairs, are refused.
    let (la, lb) = (W4Linear::quantize(&wa, a, inp, false).unwrap(), W4Linear::quantize(&wb, b, inp, true).unwrap());
    assert!(la.stack_rows(&lb, "t").unwrap_err().to_string().contains("one format"));
    assert!(lb.stack_rows(&lb, "t").is_err(), "40 rows is not a multiple of 32");
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
