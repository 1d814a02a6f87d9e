//! The quantised KV cache (kv_quant.cu writes, the attention kernels read codes + scales): the host codec
//! with the CPU oracle's rules, every written row bit for bit against it (special rows included),
//! and attention over the cache against the CPU attention over the CPU-dequantised cache.

use deltaserve_cpu as cpu;
use deltaserve_cpu::kvquant::{KvQuant, f32_to_f16_bits};
use deltaserve_cuda::ops::{self, attention};
use deltaserve_cuda::{AttnTiling, Kernels, KvFormats};
use deltaserve_plan::KvDtype;
use half::bf16;
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

use crate::attention::{PagedRows, decode_args, pages, prefill_args, verify_args};
use crate::harness::{Dev, Outcome, R, compare, randv, rb};
use crate::{Env, Op};

/// Host encoding of one token-head row with the CPU oracle's rules (deltaserve_cpu::kvquant):
/// (cache bytes, f16 scale bits; 0 for bf16 and all-zero rows).
fn kvq_encode(fmt: KvDtype, row: &[f32]) -> (Vec<u8>, u16) {
    use cpu::kvquant::f32_to_e4m3;
    if fmt == KvDtype::Bf16 {
        return (row.iter().flat_map(|&x| bf16::from_f32(x).to_bits().to_le_bytes()).collect(), 0);
    }
    let amax = row.iter().fold(0.0f32, |a, x| a.max(x.abs()));
    let Some(scale) = fmt.row_scale(amax) else {
        return (vec![0u8; ops::kv_quant::row_bytes(fmt, row.len())], 0);
    };
    let codes: Vec<u8> = row
        .iter()
        .map(|&x| {
            let y = x / scale;
            match fmt {
                KvDtype::Fp8 => f32_to_e4m3(y),
                KvDtype::Int8 => y.round_ties_even().clamp(-127.0, 127.0) as i8 as u8,
                _ => (y.round_ties_even().clamp(-7.0, 7.0) as i8 as u8) & 0xf,
            }
        })
        .collect();
    let bytes = if fmt == KvDtype::Int4 { codes.chunks(2).map(|p| p[0] | (p[1] << 4)).collect() } else { codes };
    (bytes, f32_to_f16_bits(scale))
}

/// Host decoding of one stored row: code × scale in f32 (bf16: the value).
fn kvq_decode(fmt: KvDtype, bytes: &[u8], scale_bits: u16, hd: usize) -> Vec<f32> {
    use cpu::kvquant::{e4m3_to_f32, f16_bits_to_f32};
    let sc = f16_bits_to_f32(scale_bits);
    (0..hd)
        .map(|i| match fmt {
            KvDtype::Bf16 => bf16::from_bits(u16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]])).to_f32(),
            KvDtype::Fp8 => e4m3_to_f32(bytes[i]) * sc,
            KvDtype::Int8 => f32::from(bytes[i] as i8) * sc,
            _ => f32::from((((bytes[i / 2] >> (4 * (i % 2))) << 4) as i8) >> 4) * sc,
        })
        .collect()
}

/// The host codec the GPU checks rely on: encode then decode gives deltaserve_cpu::kvquant's values.
pub fn host_codec_matches_kvquant() {
    let mut rng = StdRng::seed_from_u64(11);
    for fmt in [KvDtype::Bf16, KvDtype::Fp8, KvDtype::Int8, KvDtype::Int4] {
        for (i, mag) in [0.0f32, 1e-7, 1e-3, 1.0, 300.0, 1e6, 1e37].into_iter().enumerate() {
            let hd = [32, 64, 256][i % 3];
            let mut row = randv(&mut rng, hd, 1.0).into_iter().map(|x| rb(x * mag)).collect::<Vec<f32>>();
            if i == 5 {
                row[3] = f32::INFINITY;
            }
            let (bytes, sc) = kvq_encode(fmt, &row);
            assert_eq!(bytes.len(), ops::kv_quant::row_bytes(fmt, hd));
            let mut oracle = row.clone();
            fmt.quantize_row(&mut oracle);
            let dec = kvq_decode(fmt, &bytes, sc, hd);
            assert!(dec.iter().zip(&oracle).all(|(a, b)| a == b), "{fmt:?} x{mag}: {dec:?} vs {oracle:?}");
        }
    }
}

/// [`Op::KvQ`]: kv_write_q of every position of `seqs` into a cache of formats `kv` checked
/// row by row, then (unless `special`) attention of the new tokens over it: prefill on the default
/// and the warp-pair kernels, or decode with `n_split` on the tensor-core and the split kernels (with
/// several new tokens a sequence: as verify rows, grouped on attn_verify_mma and row by row).
pub fn kvq_case(e: Env, d: &mut Dev, rng: &mut StdRng, op: &Op) -> R<Vec<Outcome>> {
    let Env { rt, k, s, tol } = e;
    let Op::KvQ { fk, fv, ref seqs, hq, hkv, page, n_split, special } = *op else { unreachable!() };
    let kv = KvFormats { k: fk, v: fv };
    let hd = k.dims.attn_head_dim;
    let mut paged = PagedRows::random(rng, seqs, page, hkv, hd);
    if special {
        special_rows(&mut paged, rng);
    }
    let rows = paged.num_blocks * page * hkv;
    let (krb, vrb) = (ops::kv_quant::row_bytes(kv.k, hd), ops::kv_quant::row_bytes(kv.v, hd));
    let (kc, vc) = (d.poison(rows * krb)?, d.poison(rows * vrb)?);
    let (ksc, vsc) = (d.poison(2 * rows)?, d.poison(2 * rows)?);
    let w = paged.write_args(d, (0, 0))?;
    let tensor = |data, scales, fmt| ops::kv_quant::KvTensor { data, scales, fmt };
    let layer = ops::kv_quant::LayerKv { k: tensor(kc, ksc, kv.k), v: tensor(vc, vsc, kv.v) };
    ops::kv_quant::kv_write_q(k, s, &w, &layer)?;
    rt.synchronize()?;

    // The write: bytes and scale bits of every written row against the host encoding, and the
    // host-decoded values against the CPU oracle's quantize_row (value equality: -0 == 0).
    let mut out = Vec::new();
    for (what, all, t) in [("K", &paged.k, layer.k), ("V", &paged.v, layer.v)] {
        out.push(check_write(d, what, &paged, all, t)?);
    }
    if special {
        return Ok(out);
    }

    // Attention over the cache with kernels compiled for its formats.
    let mut kq = Kernels::load_kv(rt, k.dims, kv)?;
    let q = paged.queries(rng, d, hq)?;
    let n = q.q.len();
    let kvp = pages(&w, (kc, vc), paged.num_blocks);
    let scales = attention::KvScales { k: ksc, v: vsc };
    // Prefill also runs on attn_prefill (the kernel of GPUs without room for the wide one) into op2,
    // and on Hopper, where the default is the warp-specialised kernel, on the wide kernel into op3 and
    // on the Hopper kernel the default is not (the warpgroup one, or the warp-specialised one with its
    // TMA producer widening the codes) into op4.
    let (mut op2, mut op3, mut op4) = (None, None, None);
    match n_split {
        None => {
            let pair = AttnTiling { keys: 32, wide: false, ..AttnTiling::DEFAULT };
            let kp = Kernels::load_tiled(rt, k.dims, kv, pair)?;
            let o2 = d.poison(2 * n)?;
            for (kk, o) in [(&kq, q.o), (&kp, o2)] {
                let a = prefill_args(d, kk, &q, o, kvp)?;
                attention::attn_prefill_q(kk, s, &a, &scales)?;
            }
            op2 = Some(o2);
            let kw = Kernels::load_tiled(rt, k.dims, kv, AttnTiling { wgmma: false, ..AttnTiling::DEFAULT })?;
            if kq.attn.wgmma {
                let o3 = d.poison(2 * n)?;
                attention::attn_prefill_q(&kw, s, &prefill_args(d, &kw, &q, o3, kvp)?, &scales)?;
                op3 = Some(o3);
            }
            for tma in [true, false] {
                let ks = Kernels::load_tiled(rt, k.dims, kv, AttnTiling { tma, ..AttnTiling::DEFAULT })?;
                let name = attention::prefill_kernel_at(&ks, kvp.page);
                if ks.attn.wgmma && name != attention::prefill_kernel_at(&kq, kvp.page) {
                    let o4 = d.poison(2 * n)?;
                    attention::attn_prefill_q(&ks, s, &prefill_args(d, &ks, &q, o4, kvp)?, &scales)?;
                    op4 = Some((name, o4));
                }
            }
        }
        Some(n_split) if seqs.iter().any(|&(_, n)| n > 1) => {
            // Verify-shaped rows: attn_verify_mma over each sequence's rows in groups, then the same rows
            // one by one on attn_decode_mma (its A/B switch) into op2.
            let rows = attention::verify_group_rows(&kq.dims);
            let (a, g) = verify_args(d, &q, seqs, kvp, n_split, rows)?;
            if !kq.verify_mma {
                let msg = format!("does not take {kv:?} at head dim {hd} (a case for attn_decode_mma)");
                return Err(deltaserve_cuda::CudaError::InvalidArgs { kernel: "attn_verify_mma", msg });
            }
            attention::attn_verify_q(&kq, s, &a, &scales, &g)?;
            kq.verify_mma = false;
            let o2 = d.poison(2 * n)?;
            attention::attn_verify_q(&kq, s, &attention::AttnDecode { o: o2, ..a }, &scales, &g)?;
            op2 = Some(o2);
        }
        Some(n_split) => {
            let a = decode_args(d, &q, kvp, n_split)?;
            attention::attn_decode_q(&kq, s, &a, &scales)?;
            if kq.decode_mma {
                // The tensor-core kernel ran; the split kernel (its A/B switch) into op2.
                kq.decode_mma = false;
                let o2 = d.poison(2 * n)?;
                attention::attn_decode_q(&kq, s, &attention::AttnDecode { o: o2, ..a }, &scales)?;
                op2 = Some(o2);
            }
        }
    }
    // Reference: the CPU attention over the CPU-dequantised cache.
    kv.k.quantize_rows(&mut paged.k, hd);
    kv.v.quantize_rows(&mut paged.v, hd);
    let r = paged.attention(&q);
    out.push(compare("o", &r, &d.get_bf16(q.o, n)?, tol));
    if let Some(op2) = op2 {
        let what = match n_split {
            Some(_) if seqs.iter().any(|&(_, n)| n > 1) => "o (attn_decode_mma row by row)",
            Some(_) => "o (attn_decode_split)",
            None => "o (attn_prefill)",
        };
        out.push(compare(what, &r, &d.get_bf16(op2, n)?, tol));
    }
    if let Some(op3) = op3 {
        out.push(compare("o (the wide kernel)", &r, &d.get_bf16(op3, n)?, tol));
    }
    if let Some((name, op4)) = op4 {
        out.push(compare(&format!("o ({name})"), &r, &d.get_bf16(op4, n)?, tol));
    }
    Ok(out)
}

/// Rows (token-heads) of K (every third from the first) and V (every third from the second) with
/// special contents, cycling through the kinds: all zero, tiny, huge, saturating, ±inf, one value.
fn special_rows(paged: &mut PagedRows, rng: &mut StdRng) {
    let kinds = |r: usize, x: &mut [f32], rng: &mut StdRng| match r % 6 {
        0 => x.fill(0.0),
        1 => x.iter_mut().for_each(|v| *v = rb(*v * 1e-6)), // subnormal f16 scales
        2 => x.iter_mut().for_each(|v| *v = rb(*v * 1e6)),  // beyond int4's scale range
        3 => x.iter_mut().for_each(|v| *v = rb(*v * 1e37)), // saturates every format
        4 => {
            x.iter_mut().for_each(|v| *v = rb(*v * 1e3));
            x[rng.random_range(0..x.len())] = f32::INFINITY;
            x[rng.random_range(0..x.len())] = f32::NEG_INFINITY;
        }
        _ => {
            x.fill(0.0);
            x[rng.random_range(0..x.len())] = -0.5; // one value; the rest zeros (and -0)
            x[rng.random_range(0..x.len())] = -0.0;
        }
    };
    let hd = paged.hd;
    for (r, row) in paged.k.chunks_mut(hd).enumerate().filter(|(r, _)| r % 3 == 0) {
        kinds(r / 3, row, rng);
    }
    for (r, row) in paged.v.chunks_mut(hd).enumerate().filter(|(r, _)| r % 3 == 1) {
        kinds(r / 3 + 1, row, rng);
    }
}

/// The rows of one written cache tensor `t` (K or V, `what`) against the host encoding of `all`.
fn check_write(d: &Dev, what: &str, paged: &PagedRows, all: &[f32], t: ops::kv_quant::KvTensor) -> R<Outcome> {
    let (fmt, hkv, hd, width) = (t.fmt, paged.hkv, paged.hd, paged.width());
    let rowb = ops::kv_quant::row_bytes(fmt, hd);
    let rows = paged.num_blocks * paged.page * hkv;
    let mut bytes = vec![0u8; rows * rowb];
    let mut sbits = vec![0u16; rows];
    d.rt.download(&mut bytes, t.data)?;
    d.rt.download(&mut sbits, t.scales)?;
    let (mut bad_codes, mut bad_scales, mut bad_values, mut first) = (0usize, 0usize, 0usize, String::new());
    for (b, &tot) in paged.totals.iter().enumerate() {
        for p in 0..tot {
            let row = paged.row(b, p);
            for h in 0..hkv {
                let x = &all[(paged.cu[b] as usize + p) * width + h * hd..][..hd];
                let idx = row * hkv + h;
                let got = &bytes[idx * rowb..][..rowb];
                let (want, want_sc) = kvq_encode(fmt, x);
                let mut oracle = x.to_vec();
                fmt.quantize_row(&mut oracle);
                let dec = kvq_decode(fmt, got, sbits[idx], hd);
                let codes_ok = got == want.as_slice();
                let scale_ok = fmt == KvDtype::Bf16 || sbits[idx] == want_sc;
                let values_ok = dec.iter().zip(&oracle).all(|(a, o)| a == o);
                bad_codes += usize::from(!codes_ok);
                bad_scales += usize::from(!scale_ok);
                bad_values += usize::from(!values_ok);
                if first.is_empty() && !(codes_ok && scale_ok && values_ok) {
                    let amax = x.iter().fold(0.0f32, |a, v| a.max(v.abs()));
                    first = format!(
                        "; first: seq {b} pos {p} head {h} amax {amax:e} scale {:#06x} want {want_sc:#06x} \
                             (row_scale {:?}) codes {:?}.. want {:?}..",
                        sbits[idx],
                        fmt.row_scale(amax).map(f32_to_f16_bits),
                        &got[..rowb.min(8)],
                        &want[..rowb.min(8)]
                    );
                }
            }
        }
    }
    Ok(Outcome {
        ok: bad_codes + bad_scales + bad_values == 0,
        detail: format!(
            "{what} {}: {} rows; {bad_codes} with other codes, {bad_scales} other scales, {bad_values} \
             decoding other than kvquant{first}",
            fmt.name(),
            paged.totals.iter().sum::<usize>() * hkv
        ),
    })
}
