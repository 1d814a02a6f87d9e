//! KV-cache storage formats: round-trip error bounds on random token-head rows, exactness for values a
//! format already holds, zero/huge/tiny rows (never NaN), and the paged backend storing exactly what a
//! [`QuantizingCache`] over a plain sequence state stores.

use std::path::PathBuf;
use std::sync::OnceLock;

use deltaserve_backend::{SeqChunk, StepBatch, step_logits};
use deltaserve_cpu::kvquant::{E4M3_MAX, e4m3_to_f32, round_bf16};
use deltaserve_cpu::{CpuBackend, CpuCacheConfig, CpuModel, GdnMode, KvFormat, KvQuant, Logits, QuantizingCache};
use deltaserve_model::synth::{Preset, write_model};

/// splitmix64: deterministic test data without a dependency on an RNG crate's API.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
    fn normal(&mut self) -> f32 {
        let (u, v) = (self.unit().max(1e-300), self.unit());
        ((-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()) as f32
    }
}

/// Rows like K/V: gaussian, a random overall magnitude (0.03 … 1000; rows small enough for a subnormal
/// f16 scale are covered by `huge_and_tiny_magnitudes_never_make_nan`), sometimes an outlier channel.
fn random_rows(seed: u64, n: usize) -> Vec<Vec<f32>> {
    let mut r = Rng(seed);
    (0..n)
        .map(|i| {
            let hd = [32, 64, 128, 256][i % 4];
            let mag = 10f32.powf(r.unit() as f32 * 4.5 - 1.5);
            let mut row: Vec<f32> = (0..hd).map(|_| r.normal() * mag).collect();
            if r.unit() < 0.3 {
                let j = (r.next() % hd as u64) as usize;
                row[j] *= 20.0;
            }
            row
        })
        .collect()
}

fn amax(row: &[f32]) -> f32 {
    row.iter().fold(0.0f32, |a, x| a.max(x.abs()))
}

fn quantized(f: KvFormat, row: &[f32]) -> Vec<f32> {
    let mut q = row.to_vec();
    f.quantize_row(&mut q);
    q
}

#[test]
fn round_trip_error_bounds_on_random_rows() {
    let rows = random_rows(7, 4000);
    for f in KvFormat::ALL {
        // Worst error relative to the element, and relative to the row's amax.
        let (mut worst_rel, mut worst_of_amax, mut sum_of_amax, mut n) = (0f64, 0f64, 0f64, 0usize);
        for row in &rows {
            let q = quantized(f, row);
            let a = amax(row);
            let s = f.row_scale(a).unwrap_or(0.0);
            for (&x, &y) in row.iter().zip(&q) {
                assert!(y.is_finite(), "{f}: {x} → {y}");
                let err = (x - y).abs();
                // Per-format bound: half an ulp (floats) or half a step of the scale (ints).
                let bound = match f {
                    KvFormat::F32 => 0.0,
                    KvFormat::Bf16 => x.abs() * 2f32.powi(-8),
                    KvFormat::F16 => x.abs() * 2f32.powi(-11) + 2f32.powi(-25), // subnormals: steps of 2^-24
                    // 4 significant bits in the normal range; steps of 2^-9·scale below 2^-6·scale.
                    KvFormat::Fp8 => x.abs() * 2f32.powi(-4) * 1.000_001 + s * 2f32.powi(-10),
                    KvFormat::Int8 | KvFormat::Int4 => s * 0.500_001,
                };
                assert!(err <= bound, "{f}: {x} → {y}, err {err:e} > {bound:e} (amax {a}, scale {s})");
                if x.abs() > a * 0.05 {
                    worst_rel = worst_rel.max((err / x.abs()) as f64);
                }
                worst_of_amax = worst_of_amax.max((err / a) as f64);
                sum_of_amax += (err / a) as f64;
                n += 1;
            }
        }
        let mean_of_amax = sum_of_amax / n as f64;
        eprintln!(
            "{f:>5}: worst |err|/|x| (|x| > 5% amax) {:.4}%, worst |err|/amax {:.4}%, mean |err|/amax {:.5}%",
            worst_rel * 100.0,
            worst_of_amax * 100.0,
            mean_of_amax * 100.0
        );
        // The headline numbers: ~2^-8 bf16, ≤ 6.25% per element fp8, ≤ 0.4% of amax int8, ≤ 7.2% of amax int4.
        let (max_rel, max_of_amax) = match f {
            KvFormat::F32 => (0.0, 0.0),
            KvFormat::Bf16 => (2f64.powi(-8), 2f64.powi(-8)),
            KvFormat::F16 => (2f64.powi(-11), 2f64.powi(-11)),
            KvFormat::Fp8 => (0.0626, 0.0626),
            KvFormat::Int8 => (1.0, 0.00395),
            KvFormat::Int4 => (1.0, 0.0716),
        };
        assert!(worst_rel <= max_rel && worst_of_amax <= max_of_amax, "{f}: {worst_rel} {worst_of_amax}");
        // And the errors are real: every lossy format loses something on random data.
        if f != KvFormat::F32 {
            assert!(worst_of_amax > 0.0, "{f}");
        }
    }
}

#[test]
fn quantising_twice_changes_nothing() {
    for f in KvFormat::ALL {
        for row in random_rows(11, 400) {
            let once = quantized(f, &row);
            let twice = quantized(f, &once);
            assert_eq!(once, twice, "{f} is not idempotent");
        }
    }
}

#[test]
fn representable_values_are_exact() {
    // bf16 values.
    let row: Vec<f32> = random_rows(3, 1)[0].iter().map(|&x| round_bf16(x)).collect();
    assert_eq!(quantized(KvFormat::Bf16, &row), row);
    // f16 values (also exact in f32 and bf16-representable ones only when short).
    let row = vec![1.0, -0.5, 65504.0, 6.103_515_6e-5, 0.099_975_586, 0.0];
    assert_eq!(quantized(KvFormat::F16, &row), row);
    // Scaled formats: codes times an f16 scale, with the full-range code present.
    let s = 0.011_718_75f32; // 3·2^-8, exact in f16
    for (f, codes) in [
        (KvFormat::Int8, vec![127.0, -127.0, 0.0, 1.0, -64.0, 33.0, 100.0, -2.0]),
        (KvFormat::Int4, vec![7.0, -7.0, 0.0, 1.0, -3.0, 5.0, -6.0, 2.0]),
        (KvFormat::Fp8, [0x7eu8, 0xfe, 0x00, 0x01, 0x38, 0xb9, 0x52, 0x07].iter().map(|&c| e4m3_to_f32(c)).collect()),
    ] {
        assert_eq!(codes[0], f.qmax().unwrap());
        let row: Vec<f32> = codes.iter().map(|c| c * s).collect();
        assert_eq!(quantized(f, &row), row, "{f}");
        assert_eq!(f.row_scale(amax(&row)), Some(s), "{f}");
    }
    assert_eq!(KvFormat::Fp8.qmax(), Some(E4M3_MAX));
}

#[test]
fn zero_rows_stay_zero() {
    for f in KvFormat::ALL {
        for hd in [1, 32, 256] {
            assert_eq!(quantized(f, &vec![0.0; hd]), vec![0.0; hd], "{f}");
        }
    }
}

#[test]
fn huge_and_tiny_magnitudes_never_make_nan() {
    let mut r = Rng(99);
    let base: Vec<f32> = (0..64).map(|_| r.normal()).collect();
    for mag in [1e-38f32, 1e-30, 1e-10, 1e-6, 1e-3, 1.0, 1e3, 1e5, 1e7, 1e10, 1e20, 1e38] {
        let row: Vec<f32> = base.iter().map(|x| x * mag).collect();
        for f in KvFormat::ALL {
            let q = quantized(f, &row);
            for (&x, &y) in row.iter().zip(&q) {
                assert!(!y.is_nan(), "{f} at {mag:e}: {x} → NaN");
                // Never flips a sign.
                assert!(y == 0.0 || y.signum() == x.signum(), "{f} at {mag:e}: {x} → {y}");
                if let Some(qmax) = f.qmax() {
                    assert!(y.is_finite(), "{f} at {mag:e}: {x} → {y}");
                    let s = f.row_scale(amax(&row)).unwrap();
                    assert!(y.abs() <= qmax * s, "{f} at {mag:e}: {x} → {y}, scale {s}");
                    // No clipping below the largest scale: at most half a step (of a coarse step for tiny rows).
                    if amax(&row) <= qmax * 65504.0 {
                        let step = if f == KvFormat::Fp8 { (x.abs() / 8.0).max(s / 512.0) } else { s };
                        assert!((x - y).abs() <= step * 0.500_01, "{f} at {mag:e}: {x} → {y}, scale {s}");
                    }
                }
            }
            // Within the scale's range the usual bound holds; mid-range rows keep their largest value.
            if (1e-3..=1e3).contains(&mag) && f != KvFormat::F32 {
                let i = row.iter().position(|x| x.abs() == amax(&row)).unwrap();
                let rel = ((q[i] - row[i]) / row[i]).abs();
                assert!(rel < 0.0626, "{f} at {mag:e}: amax element off by {rel}");
            }
        }
    }
    // ±inf in a row saturates the scaled formats instead of poisoning the row.
    let mut row = base.clone();
    row[3] = f32::INFINITY;
    row[9] = f32::NEG_INFINITY;
    for f in [KvFormat::Fp8, KvFormat::Int8, KvFormat::Int4] {
        let q = quantized(f, &row);
        assert!(q.iter().all(|y| y.is_finite()), "{f}: {q:?}");
        assert!(q[3] > 0.0 && q[9] < 0.0, "{f}");
    }
}

#[test]
fn format_names_parse() {
    for f in KvFormat::ALL {
        assert_eq!(f.name().parse::<KvFormat>(), Ok(f));
    }
    assert_eq!("E4M3".parse::<KvFormat>(), Ok(KvFormat::Fp8));
    let e = "int3".parse::<KvFormat>().unwrap_err();
    assert!(e.contains("int3") && e.contains("fp8, int8, int4"), "{e}");
}

fn model_dir() -> &'static PathBuf {
    static D: OnceLock<PathBuf> = OnceLock::new();
    D.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("ds-kvquant-{}", std::process::id()));
        write_model(&dir, Preset::Tiny, None, 13, |_, _| {}).unwrap();
        dir
    })
}

fn fresh_model() -> CpuModel {
    CpuModel::load(model_dir()).unwrap()
}

fn model() -> &'static CpuModel {
    static M: OnceLock<CpuModel> = OnceLock::new();
    M.get_or_init(fresh_model)
}

/// Last-token logits of each chunk through the paged backend with formats (k, v).
fn paged_logits(k: KvFormat, v: KvFormat, tokens: &[u32], chunks: &[usize]) -> Vec<f32> {
    let cfg = CpuCacheConfig { num_pages: 16, page_size: 8, num_slots: 2, snapshot_slots: 0, host_snapshot_slots: 0 };
    let mut b = CpuBackend::new(fresh_model(), cfg).with_kv_formats(k, v);
    assert_eq!(b.kv_formats(), (k, v));
    // Pages out of order, so paging is exercised.
    let pages: Vec<u32> = vec![9, 2, 14, 0, 7, 11, 3, 5, 12, 1];
    let mut out = Vec::new();
    let mut at = 0;
    for &c in chunks {
        let batch = StepBatch {
            seqs: vec![SeqChunk {
                seq_id: 1,
                slot: 1,
                pages: pages.clone(),
                start: at,
                tokens: tokens[at..at + c].to_vec(),
                want_logits: true,
                ..SeqChunk::default()
            }],
            ..StepBatch::default()
        };
        step_logits(&mut b, &batch, &mut out).unwrap();
        at += c;
    }
    out
}

/// The same through a [`QuantizingCache`] over a plain sequence state.
fn wrapped_logits(k: KvFormat, v: KvFormat, tokens: &[u32], chunks: &[usize]) -> Vec<f32> {
    let m = model();
    let mut cache = QuantizingCache { inner: m.new_sequence(), k, v, head_dim: m.dims.head_dim };
    let mut out = Vec::new();
    let mut at = 0;
    for &c in chunks {
        out.extend(m.forward_cached(&mut cache, at, &tokens[at..at + c], GdnMode::Auto, Logits::Last).unwrap());
        at += c;
    }
    out
}

#[test]
fn paged_backend_stores_what_the_format_holds() {
    let tokens: Vec<u32> = (0..70).map(|i| (i * 389 + 17) % 1024).collect();
    let chunks = [37, 20, 1, 1, 1, 10];
    let exact = wrapped_logits(KvFormat::F32, KvFormat::F32, &tokens, &chunks);
    let mut plain = Vec::new();
    let mut st = model().new_sequence();
    let mut at = 0;
    for &c in &chunks {
        plain.extend(model().forward(&mut st, &tokens[at..at + c], GdnMode::Auto, Logits::Last).unwrap());
        at += c;
    }
    assert_eq!(exact, plain, "an f32 QuantizingCache must change nothing");
    for (k, v) in [
        (KvFormat::F32, KvFormat::F32),
        (KvFormat::Bf16, KvFormat::Bf16),
        (KvFormat::Fp8, KvFormat::Fp8),
        (KvFormat::Int8, KvFormat::Int4),
        (KvFormat::Int4, KvFormat::Int4),
    ] {
        let paged = paged_logits(k, v, &tokens, &chunks);
        let wrapped = wrapped_logits(k, v, &tokens, &chunks);
        assert_eq!(paged, wrapped, "k {k} v {v}: paged and wrapped caches differ");
        if k != KvFormat::F32 {
            assert_ne!(paged, exact, "k {k} v {v}: quantisation had no effect");
        }
    }
}
