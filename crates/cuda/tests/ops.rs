//! Every CUDA op against the f32 CPU reference (deltaserve-cpu), in ONE table of cases.
//!
//! Each case draws fresh random inputs (the seed is printed), rounds them to bf16 (what the GPU
//! reads), runs the CPU reference in f32 on those rounded values, poisons the GPU outputs with
//! NaN (0xFF bytes) before the launch, and checks every element: |ref − x| ≤ atol + rtol·|ref|.
//! The worst element and its share of the tolerance are printed for every case.
//!
//! Tolerances (bf16 I/O, f32 math): a bf16 output is the f32 result rounded once, a relative
//! error ≤ 2⁻⁹ ≈ 2e-3, so rtol = 8e-3 leaves 4× headroom for f32 reordering and libm differences
//! (expf, sinf). atol covers cancellation near zero and is tied to the output scale (rms of ref):
//! 2e-3·rms for single-rounding ops. The DeltaNet chunk kernel and attention accumulate over
//! many tokens in a different order than the CPU, and GEMM sums 5120 products; they get
//! rtol 1.6e-2 and atol 4e-3·rms. The residual stream (bf16(x + res)) must match bit for bit.
//!
//! With no CUDA driver the test prints SKIP and passes. To add an op: add an `Op` variant, its
//! arm in `run_case`, and rows in `cases()`.

use std::time::{SystemTime, UNIX_EPOCH};

use deltaserve_backend::{Penalty, RowSampling};
use deltaserve_cpu as cpu;
use deltaserve_cuda::arena::{Arena, RegionId};
use deltaserve_cuda::ops::w4a16;
use deltaserve_cuda::ops::{self, attention, conv, gdn_chunk, gdn_decode, gdn_gate, kv_cache};
use deltaserve_cuda::w4::{ScaleDtype, W4Linear};
use deltaserve_cuda::{AttnTiling, KernelDims, Kernels, KvFormats, LibStatus, Runtime, gemm};
use deltaserve_plan::KvDtype;
use half::bf16;
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

// ---------------------------------------------------------------------------------------------
// The table

#[derive(Clone, Debug)]
enum Op {
    Embed {
        t: usize,
        d: usize,
        vocab: usize,
    },
    /// Rows of `vocab` f32 logits, the argmax over the first `valid`; `special`: ties, NaNs, infinities.
    Argmax {
        rows: usize,
        vocab: usize,
        valid: usize,
        special: bool,
    },
    /// Rows of `vocab` logits (peaked like a language model's, flat, on a coarse grid with ties), each
    /// picked `rounds` times under a cycle of sampling parameters (greedy and penalised, plain draws,
    /// top-k / top-p / min-p cuts) with fresh uniforms: the device's tokens against the host rule.
    Sample {
        rows: usize,
        vocab: usize,
        valid: usize,
        rounds: usize,
    },
    AddRmsNorm {
        rows: usize,
        d: usize,
        residual: bool,
    },
    RmsNormStrided {
        t: usize,
        heads: usize,
        hd: usize,
        stride: usize,
    },
    GatedRmsNorm {
        t: usize,
        hv: usize,
        dv: usize,
    },
    SigmoidGate {
        t: usize,
        heads: usize,
        hd: usize,
    },
    Swiglu {
        t: usize,
        i: usize,
    },
    Rope {
        t: usize,
        heads: usize,
        hd: usize,
        rot: usize,
        pos0: usize,
    },
    /// q|gate and k heads: the fused RMSNorm + RoPE kernel, bitwise vs rms_norm_1p + rope_partial.
    QkNormRope {
        t: usize,
        nq: usize,
        nkv: usize,
        hd: usize,
        rot: usize,
        pos0: usize,
    },
    /// qk_norm_rope_kv (q|gate, k heads normalised and rotated; K and V rows into a paged cache of
    /// formats `fk` / `fv`), bitwise vs qk_norm_rope + kv_write_q. `seqs`: (cached, new) tokens per
    /// sequence (the new tokens at positions cached, cached + 1, ...); `pad` adds a decode-graph
    /// padding row (position -1).
    QkNormRopeKv {
        fk: KvDtype,
        fv: KvDtype,
        seqs: Vec<(usize, usize)>,
        nq: usize,
        nkv: usize,
        hd: usize,
        page: usize,
        pad: bool,
    },
    ConvPrefill {
        lens: Vec<usize>,
        c: usize,
    },
    ConvDecode {
        b: usize,
        c: usize,
    },
    /// Decode rows: gdn_conv_gate_decode bitwise vs conv_decode + gdn_gate (slots < 0: padding).
    GdnConvGateDecode {
        slots: Vec<i32>,
        hk: usize,
        hv: usize,
    },
    GdnGate {
        t: usize,
        hk: usize,
        hv: usize,
    },
    GdnChunk {
        lens: Vec<usize>,
        hk: usize,
        hv: usize,
        prec: gdn_chunk::Precision,
    },
    GdnDecode {
        b: usize,
        hk: usize,
        hv: usize,
    },
    /// Decode rows: gdn_decode_gated bitwise vs gdn_decode + gated_rms_norm (slots < 0: padding).
    GdnDecodeGated {
        slots: Vec<i32>,
        hk: usize,
        hv: usize,
    },
    /// gdn_recurrent over `lens` rows per sequence: verify (`accept` None: outputs of every row, the
    /// state bit-untouched) or commit of the first `accept[b]` rows (the state against the oracle, and
    /// bit-equal to gdn_decode run token by token over those rows).
    GdnRecurrent {
        lens: Vec<usize>,
        accept: Option<Vec<usize>>,
        hk: usize,
        hv: usize,
    },
    /// conv_state_update over the first `accept[b]` of `lens[b]` rows (speculative commit): bit-exact
    /// against the oracle's window shift.
    ConvAccept {
        lens: Vec<usize>,
        accept: Vec<usize>,
        c: usize,
    },
    /// shift_rows (each row's previous row, or its slot's pending row) and scatter_rows: bit-exact.
    MtpRows {
        lens: Vec<usize>,
        d: usize,
    },
    /// (past, new) per sequence: kv_write of all positions, then prefill attention of the new.
    AttnPrefill {
        seqs: Vec<(usize, usize)>,
        hq: usize,
        hkv: usize,
        page: usize,
    },
    /// [`Op::AttnPrefill`] with kernels compiled for another prefill tiling.
    AttnPrefillTiled {
        seqs: Vec<(usize, usize)>,
        hq: usize,
        hkv: usize,
        page: usize,
        tiling: AttnTiling,
    },
    AttnDecode {
        lens: Vec<usize>,
        hq: usize,
        hkv: usize,
        page: usize,
        n_split: usize,
    },
    Gemm {
        m: usize,
        n: usize,
        k: usize,
    },
    /// Decode GEMV: n tokens, up to 3 weight matrices [m, k] sharing x; f32 or bf16 out.
    Gemv {
        n: usize,
        ms: Vec<usize>,
        k: usize,
        f32_out: bool,
    },
    /// 4-bit GEMV (every warps-per-tile choice): m tokens, W [out, inp]; asym = zero points,
    /// perm = act-order permutation, bf16 = bf16 scales.
    W4Gemv {
        m: usize,
        out: usize,
        inp: usize,
        asym: bool,
        perm: bool,
        bf16: bool,
    },
    /// Up to three 4-bit linears sharing x in one launch (w4_gemv_multi): each output vs the CPU
    /// and bitwise vs its own launch with the same configuration.
    W4GemvMulti {
        m: usize,
        outs: Vec<usize>,
        inp: usize,
        asym: bool,
        bf16: bool,
    },
    /// The residual add + RMSNorm folded into the 4-bit projections around it (w4_gemv_fold): a
    /// producer [hidden, pin] whose output joins the residual stream, then the consumers `outs` x
    /// [hidden], against the same GEMVs with add_rms_norm_1p between them. `thin`: the producer's
    /// thin last wave runs as a second segment (its rows from an offset).
    W4Fold {
        m: usize,
        hidden: usize,
        pin: usize,
        outs: Vec<usize>,
        asym: bool,
        bf16: bool,
        thin: bool,
    },
    /// Rows r0..r1 of a 4-bit W [out, inp] to bf16, bit-exact vs W4Linear::dequantize_bf16.
    W4Dequant {
        out: usize,
        inp: usize,
        r0: usize,
        r1: usize,
        asym: bool,
        perm: bool,
    },
    /// bf16 W [out, inp] -> int4 in two row slices, bit-exact vs W4Linear::quantize.
    W4Quantize {
        out: usize,
        inp: usize,
        asym: bool,
    },
    /// Quantised KV cache (K and V formats): kv_write_q of all positions (codes and f16 scales
    /// bit-equal to deltaserve_cpu::kvquant), then (unless `special`) prefill attention of the new
    /// tokens, or decode with `n_split`, against the CPU attention over the CPU-dequantised cache.
    /// `special` adds all-zero, tiny, huge (saturating) and ±inf rows and checks the write only.
    KvQ {
        fk: KvDtype,
        fv: KvDtype,
        seqs: Vec<(usize, usize)>,
        hq: usize,
        hkv: usize,
        page: usize,
        n_split: Option<usize>,
        special: bool,
    },
}

#[derive(Clone, Copy, Debug)]
struct Tol {
    /// atol = atol_rms · rms(ref) + atol_abs
    atol_rms: f32,
    atol_abs: f32,
    rtol: f32,
}

const SINGLE: Tol = Tol { atol_rms: 2e-3, atol_abs: 1e-6, rtol: 8e-3 };
const ACCUM: Tol = Tol { atol_rms: 4e-3, atol_abs: 1e-6, rtol: 1.6e-2 };
/// A GEMV whose x was rounded to bf16 from exact values (the normed x): ~0.16% of the output RMS per
/// output from the rounding alone, so 1.2e-2 is ~7 standard deviations.
const FOLD_X: Tol = Tol { atol_rms: 1.2e-2, atol_abs: 1e-6, rtol: 1.6e-2 };
const EXACT: Tol = Tol { atol_rms: 0.0, atol_abs: 0.0, rtol: 0.0 };

struct Case {
    name: &'static str,
    dims: KernelDims,
    op: Op,
    tol: Tol,
}

/// Small-attention variant: head dim 128, 2 query heads per kv head, BV 16 for the chunk kernel.
const SMALL: KernelDims = KernelDims { attn_head_dim: 128, gqa_group: 2, gdn_bv: 16, ..KernelDims::QWEN35_27B };
/// Attention at the smallest head dims: no GQA (64) and a group of 8 (32).
const HD64_G1: KernelDims = KernelDims { attn_head_dim: 64, gqa_group: 1, ..KernelDims::QWEN35_27B };
const HD32_G8: KernelDims = KernelDims { attn_head_dim: 32, gqa_group: 8, ..KernelDims::QWEN35_27B };
/// Qwen3-Next's attention (head dim 256, 16 q heads over 2 kv heads): two prefill blocks per kv head.
/// The Tiny preset's attention (head dim 32, 4 q heads over 2 kv heads; the speculative tests' model).
const TINY_ATTN: KernelDims = KernelDims { attn_head_dim: 32, gqa_group: 2, ..KernelDims::QWEN35_27B };
const NEXT_ATTN: KernelDims = KernelDims { attn_head_dim: 256, gqa_group: 8, ..KernelDims::QWEN35_27B };
/// Attention prefill with plain bf16 P (the default AttnTiling, FlashAttention's choice): P's
/// rounding (2^-9 relative) moves o by up to 2^-9 · Σ p |v| — the scale of V, not of o, which cancels
/// to ~|v| / sqrt(keys) over random keys. Measured on the H200 (bench/results/attention-pairs-h200-
/// 2026-11-29.md): absolute errors up to 0.9% (bf16 K/V) and 1.3% (quantised V, whose scale folds
/// into P before the rounding) of rms(o) on elements where o cancels, hence 2.4% of rms(o). The hi/lo
/// split (AttnTiling::p_split) is held to ACCUM.
const ATTN_PLAIN_P: Tol = Tol { atol_rms: 2.4e-2, atol_abs: 1e-6, rtol: 1.6e-2 };
/// DeltaNet head dims 32 (the qwen35_gva3_d32 fixture's shape): 2 warps per state block.
const GDN32: KernelDims = KernelDims { gdn_k_dim: 32, gdn_v_dim: 32, ..KernelDims::QWEN35_27B };
/// gdn_chunk with plain bf16 operands (Precision::Bf16, FLA-like): measured worst errors ~3% of the
/// output rms on near-zero elements (2.4x over a 3x-ACCUM bound on the H200), hence this loose bound;
/// the default Precision::Split is held to ACCUM.
const GDN_BF16: Tol = Tol { atol_rms: 6e-2, atol_abs: 1e-6, rtol: 6e-2 };
const SPLIT: gdn_chunk::Precision = gdn_chunk::Precision::Split;
const BF16: gdn_chunk::Precision = gdn_chunk::Precision::Bf16;

fn gdn_op(lens: &[usize], hk: usize, hv: usize, prec: gdn_chunk::Precision) -> Op {
    Op::GdnChunk { lens: lens.to_vec(), hk, hv, prec }
}

/// A 27B-shape prefill case (24 q heads, 4 kv heads) on `attn_prefill` (the warp-pair kernel, not
/// the wide one) tiled `keys` per KV tile. (The `Op::AttnPrefill` cases run the default tiling: the
/// wide kernel on devices whose shared memory holds it, as the H200's does.)
fn tiled(seqs: &[(usize, usize)], page: usize, keys: usize, p_split: bool, heads: usize) -> Op {
    let tiling = AttnTiling { keys, p_split, heads, wide: false };
    Op::AttnPrefillTiled { seqs: seqs.to_vec(), hq: 24, hkv: 4, page, tiling }
}

/// A prefill case on the wide kernel at `keys` per KV tile (where the device's shared memory holds
/// it: 64 keys on the H200; else the tiling falls back as `Kernels::load_tiled` resolves it).
fn wide(seqs: &[(usize, usize)], hq: usize, hkv: usize, page: usize, keys: usize) -> Op {
    let tiling = AttnTiling { keys, p_split: false, heads: 0, wide: true };
    Op::AttnPrefillTiled { seqs: seqs.to_vec(), hq, hkv, page, tiling }
}

/// A quantised-KV case (see [`Op::KvQ`]).
#[allow(clippy::too_many_arguments)]
fn kvq(
    fk: KvDtype,
    fv: KvDtype,
    seqs: &[(usize, usize)],
    hq: usize,
    hkv: usize,
    page: usize,
    n_split: Option<usize>,
    special: bool,
) -> Op {
    Op::KvQ { fk, fv, seqs: seqs.to_vec(), hq, hkv, page, n_split, special }
}

/// A [`Op::QkNormRopeKv`] case.
#[allow(clippy::too_many_arguments)]
fn qkv(
    fk: KvDtype,
    fv: KvDtype,
    seqs: &[(usize, usize)],
    nq: usize,
    nkv: usize,
    hd: usize,
    page: usize,
    pad: bool,
) -> Op {
    Op::QkNormRopeKv { fk, fv, seqs: seqs.to_vec(), nq, nkv, hd, page, pad }
}

fn cases() -> Vec<Case> {
    let q = KernelDims::QWEN35_27B;
    let c = |name, dims, op, tol| Case { name, dims, op, tol };
    let (bf, f8, i8, i4) = (KvDtype::Bf16, KvDtype::Fp8, KvDtype::Int8, KvDtype::Int4);
    vec![
        c("embed", q, Op::Embed { t: 1, d: 5120, vocab: 1000 }, EXACT),
        c("embed", q, Op::Embed { t: 37, d: 5120, vocab: 1000 }, EXACT),
        c("argmax", q, Op::Argmax { rows: 1, vocab: 248_320, valid: 248_320, special: false }, EXACT),
        c("argmax", q, Op::Argmax { rows: 9, vocab: 248_320, valid: 248_077, special: false }, EXACT),
        c("argmax", q, Op::Argmax { rows: 12, vocab: 1000, valid: 999, special: true }, EXACT),
        c("argmax", q, Op::Argmax { rows: 3, vocab: 7, valid: 7, special: true }, EXACT),
        // The special rows through the four-loads-in-flight loop (more than 4 x 1024 vectors per row),
        // and rows that are not 16-byte aligned (the one-by-one path).
        c("argmax", q, Op::Argmax { rows: 6, vocab: 20_000, valid: 19_997, special: true }, EXACT),
        c("argmax", q, Op::Argmax { rows: 6, vocab: 20_001, valid: 20_001, special: true }, EXACT),
        c("sample", q, Op::Sample { rows: 8, vocab: 248_320, valid: 248_077, rounds: 40 }, EXACT),
        c("sample", q, Op::Sample { rows: 11, vocab: 1000, valid: 999, rounds: 40 }, EXACT),
        c("sample", q, Op::Sample { rows: 3, vocab: 7, valid: 7, rounds: 40 }, EXACT),
        c("add_rms_norm_1p", q, Op::AddRmsNorm { rows: 1, d: 5120, residual: true }, SINGLE),
        c("add_rms_norm_1p", q, Op::AddRmsNorm { rows: 17, d: 5120, residual: true }, SINGLE),
        c("add_rms_norm_1p", q, Op::AddRmsNorm { rows: 5, d: 5120, residual: false }, SINGLE),
        // The scalar path: a width not a multiple of 8, and one wider than the vector path holds.
        c("add_rms_norm_1p", q, Op::AddRmsNorm { rows: 3, d: 36, residual: true }, SINGLE),
        c("add_rms_norm_1p", q, Op::AddRmsNorm { rows: 2, d: 8200, residual: true }, SINGLE),
        c("rms_norm_1p_strided", q, Op::RmsNormStrided { t: 7, heads: 24, hd: 256, stride: 512 }, SINGLE),
        c("rms_norm_1p_strided", q, Op::RmsNormStrided { t: 1, heads: 4, hd: 256, stride: 256 }, SINGLE),
        c("gated_rms_norm", q, Op::GatedRmsNorm { t: 9, hv: 48, dv: 128 }, SINGLE),
        c("sigmoid_gate_mul", q, Op::SigmoidGate { t: 5, heads: 24, hd: 256 }, SINGLE),
        c("sigmoid_gate_mul", q, Op::SigmoidGate { t: 3, heads: 5, hd: 36 }, SINGLE),
        c("swiglu", q, Op::Swiglu { t: 3, i: 17408 }, SINGLE),
        c("swiglu", q, Op::Swiglu { t: 70, i: 2056 }, SINGLE),
        c("swiglu", q, Op::Swiglu { t: 4, i: 37 }, SINGLE),
        c("rope", q, Op::Rope { t: 1, heads: 24, hd: 256, rot: 64, pos0: 0 }, SINGLE),
        c("rope", q, Op::Rope { t: 33, heads: 4, hd: 256, rot: 64, pos0: 100_000 }, SINGLE),
        c("qk_norm_rope", q, Op::QkNormRope { t: 1, nq: 24, nkv: 4, hd: 256, rot: 64, pos0: 70_000 }, EXACT),
        c("qk_norm_rope", q, Op::QkNormRope { t: 37, nq: 16, nkv: 2, hd: 256, rot: 64, pos0: 5 }, EXACT),
        c("qk_norm_rope", q, Op::QkNormRope { t: 5, nq: 8, nkv: 1, hd: 64, rot: 32, pos0: 260_000 }, EXACT),
        c("qk_norm_rope_kv", q, qkv(f8, f8, &[(1023, 1)], 24, 4, 256, 16, false), EXACT),
        c("qk_norm_rope_kv", q, qkv(f8, i4, &[(40, 1), (3, 1)], 24, 4, 256, 16, true), EXACT),
        c("qk_norm_rope_kv", q, qkv(i8, bf, &[(0, 37), (70_000, 5)], 16, 2, 256, 16, false), EXACT),
        c("qk_norm_rope_kv", q, qkv(bf, bf, &[(5, 9)], 8, 1, 64, 8, true), EXACT),
        c("qk_norm_rope_kv", q, qkv(i4, f8, &[(259_000, 1), (17, 2)], 8, 4, 128, 32, false), EXACT),
        c("conv_prefill", q, Op::ConvPrefill { lens: vec![1], c: 10240 }, SINGLE),
        c("conv_prefill", q, Op::ConvPrefill { lens: vec![63, 64, 65], c: 10240 }, SINGLE),
        c("conv_prefill", q, Op::ConvPrefill { lens: vec![2, 1, 129, 127], c: 10240 }, SINGLE),
        c("conv_decode", q, Op::ConvDecode { b: 5, c: 10240 }, SINGLE),
        c("gdn_gate", q, Op::GdnGate { t: 70, hk: 16, hv: 48 }, SINGLE),
        c("gdn_conv_gate_decode", q, Op::GdnConvGateDecode { slots: vec![2, -1, 0], hk: 16, hv: 48 }, EXACT),
        c("gdn_conv_gate_decode", q, Op::GdnConvGateDecode { slots: vec![1], hk: 2, hv: 6 }, EXACT),
        c("gdn_chunk", q, gdn_op(&[1], 16, 48, SPLIT), ACCUM),
        c("gdn_chunk", q, gdn_op(&[63], 16, 48, SPLIT), ACCUM),
        c("gdn_chunk", q, gdn_op(&[64], 16, 48, SPLIT), ACCUM),
        c("gdn_chunk", q, gdn_op(&[65], 16, 48, SPLIT), ACCUM),
        c("gdn_chunk", q, gdn_op(&[127], 16, 48, SPLIT), ACCUM),
        c("gdn_chunk", q, gdn_op(&[129, 1, 64, 200], 16, 48, SPLIT), ACCUM),
        c("gdn_chunk", q, gdn_op(&[65, 0, 130, 0, 7], 16, 48, SPLIT), ACCUM),
        c("gdn_chunk", SMALL, gdn_op(&[100, 3], 4, 4, SPLIT), ACCUM),
        c("gdn_chunk", q, gdn_op(&[1000], 16, 48, SPLIT), ACCUM),
        c("gdn_chunk", GDN32, gdn_op(&[70, 1, 130], 2, 6, SPLIT), ACCUM),
        // Plain bf16 operands (FLA-like): looser bound, the line reports the actual error.
        c("gdn_chunk", q, gdn_op(&[129, 1, 64, 200], 16, 48, BF16), GDN_BF16),
        c("gdn_chunk", q, gdn_op(&[1000], 16, 48, BF16), GDN_BF16),
        c("gdn_decode", q, Op::GdnDecode { b: 7, hk: 16, hv: 48 }, ACCUM),
        c("gdn_decode_gated", q, Op::GdnDecodeGated { slots: vec![3, -1, 0, 1], hk: 16, hv: 48 }, EXACT),
        c("gdn_decode_gated", GDN32, Op::GdnDecodeGated { slots: vec![0, 2], hk: 2, hv: 6 }, EXACT),
        c("gdn_recurrent", q, Op::GdnRecurrent { lens: vec![3, 1, 5, 2], accept: None, hk: 16, hv: 48 }, ACCUM),
        c(
            "gdn_recurrent",
            q,
            Op::GdnRecurrent { lens: vec![3, 1, 5, 2], accept: Some(vec![2, 1, 5, 1]), hk: 16, hv: 48 },
            ACCUM,
        ),
        c("gdn_recurrent", GDN32, Op::GdnRecurrent { lens: vec![4, 2], accept: Some(vec![3, 2]), hk: 2, hv: 6 }, ACCUM),
        c("conv_state_update", q, Op::ConvAccept { lens: vec![3, 1, 5, 2], accept: vec![2, 1, 5, 1], c: 10240 }, EXACT),
        c("mtp_rows", q, Op::MtpRows { lens: vec![3, 1, 5, 2], d: 5120 }, EXACT),
        c("mtp_rows", q, Op::MtpRows { lens: vec![1, 2], d: 36 }, EXACT),
        c("kv_write+attn_prefill", q, Op::AttnPrefill { seqs: vec![(0, 1)], hq: 24, hkv: 4, page: 16 }, ATTN_PLAIN_P),
        c(
            "kv_write+attn_prefill",
            q,
            Op::AttnPrefill { seqs: vec![(0, 63), (10, 65), (100, 17)], hq: 24, hkv: 4, page: 16 },
            ATTN_PLAIN_P,
        ),
        c(
            "kv_write+attn_prefill",
            SMALL,
            Op::AttnPrefill { seqs: vec![(0, 129), (300, 5)], hq: 8, hkv: 4, page: 64 },
            ATTN_PLAIN_P,
        ),
        c(
            "kv_write+attn_prefill",
            q,
            Op::AttnPrefill { seqs: vec![(0, 15), (0, 16), (0, 17)], hq: 24, hkv: 4, page: 32 },
            ATTN_PLAIN_P,
        ),
        c(
            "kv_write+attn_prefill",
            q,
            Op::AttnPrefill { seqs: vec![(5, 64), (31, 127), (33, 129), (1000, 1)], hq: 24, hkv: 4, page: 32 },
            ATTN_PLAIN_P,
        ),
        c("kv_write+attn_prefill", q, Op::AttnPrefill { seqs: vec![(0, 300)], hq: 24, hkv: 4, page: 32 }, ATTN_PLAIN_P),
        c(
            "kv_write+attn_prefill",
            SMALL,
            Op::AttnPrefill { seqs: vec![(17, 63), (0, 64), (64, 65), (40, 2)], hq: 8, hkv: 4, page: 16 },
            ATTN_PLAIN_P,
        ),
        c(
            "kv_write+attn_prefill",
            HD64_G1,
            Op::AttnPrefill { seqs: vec![(3, 33), (0, 1)], hq: 2, hkv: 2, page: 32 },
            ATTN_PLAIN_P,
        ),
        c(
            "kv_write+attn_prefill",
            HD32_G8,
            Op::AttnPrefill { seqs: vec![(70, 40), (0, 16), (9, 1)], hq: 8, hkv: 1, page: 8 },
            ATTN_PLAIN_P,
        ),
        c(
            "kv_write+attn_prefill",
            NEXT_ATTN,
            Op::AttnPrefill { seqs: vec![(0, 100), (50, 33), (7, 1)], hq: 16, hkv: 2, page: 16 },
            ATTN_PLAIN_P,
        ),
        c("kv_write+attn_prefill", q, tiled(&[(5, 64), (31, 127), (1000, 1)], 32, 64, true, 0), ACCUM),
        c("kv_write+attn_prefill", q, tiled(&[(0, 63), (64, 65), (100, 17)], 16, 64, true, 3), ACCUM),
        c("kv_write+attn_prefill", q, tiled(&[(5, 64), (31, 127), (1000, 1)], 64, 64, false, 0), ATTN_PLAIN_P),
        c("kv_write+attn_prefill", q, tiled(&[(0, 300), (33, 129)], 32, 32, false, 3), ATTN_PLAIN_P),
        c(
            "kv_write+attn_prefill",
            q,
            tiled(&[(5, 64), (31, 127), (33, 129), (1000, 1)], 32, 32, false, 0),
            ATTN_PLAIN_P,
        ),
        // The wide kernel at 64 keys per tile: 32-key pages (two one-page halves per tile), 16-key
        // pages (per-row lookups), 64- and 128-key pages (one page per tile); other head dims / groups.
        c("kv_write+attn_prefill", q, wide(&[(5, 64), (31, 127), (33, 129), (1000, 1)], 24, 4, 32, 64), ATTN_PLAIN_P),
        c("kv_write+attn_prefill", q, wide(&[(0, 300), (70, 40), (0, 1)], 24, 4, 16, 64), ATTN_PLAIN_P),
        c("kv_write+attn_prefill", q, wide(&[(0, 63), (64, 65), (100, 17)], 24, 4, 64, 64), ATTN_PLAIN_P),
        c("kv_write+attn_prefill", q, wide(&[(0, 300), (129, 64)], 24, 4, 128, 64), ATTN_PLAIN_P),
        c("kv_write+attn_prefill", SMALL, wide(&[(17, 63), (0, 64), (64, 65), (40, 2)], 8, 4, 16, 64), ATTN_PLAIN_P),
        c("kv_write+attn_prefill", NEXT_ATTN, wide(&[(0, 100), (50, 33), (7, 1)], 16, 2, 32, 64), ATTN_PLAIN_P),
        c("kv_write+attn_prefill", HD32_G8, wide(&[(70, 40), (0, 16), (9, 1)], 8, 1, 8, 64), ATTN_PLAIN_P),
        c("kv_write+attn_prefill", TINY_ATTN, wide(&[(0, 37), (37, 5), (60, 1)], 4, 2, 16, 64), ATTN_PLAIN_P),
        c(
            "kv_write+attn_prefill",
            TINY_ATTN,
            Op::AttnPrefillTiled {
                seqs: vec![(0, 37), (37, 5), (60, 1)],
                hq: 4,
                hkv: 2,
                page: 16,
                tiling: AttnTiling { keys: 32, p_split: false, heads: 0, wide: false },
            },
            ATTN_PLAIN_P,
        ),
        c("kv_write+attn_prefill", q, tiled(&[(0, 300), (33, 129)], 32, 32, true, 3), ACCUM),
        c("kv_write+attn_prefill", q, tiled(&[(2, 77), (0, 1)], 16, 32, true, 2), ACCUM),
        c(
            "attn_decode",
            q,
            Op::AttnDecode { lens: vec![1, 17, 300, 1000], hq: 24, hkv: 4, page: 16, n_split: 8 },
            ACCUM,
        ),
        c("attn_decode", SMALL, Op::AttnDecode { lens: vec![5, 64], hq: 8, hkv: 4, page: 32, n_split: 16 }, ACCUM),
        // (bf16 cache: attn_decode_mma without prefetch; several tiles per warp, tiles across pages.)
        c("attn_decode", q, Op::AttnDecode { lens: vec![3000, 1, 129], hq: 24, hkv: 4, page: 32, n_split: 16 }, ACCUM),
        c("attn_decode", HD32_G8, Op::AttnDecode { lens: vec![100, 9], hq: 8, hkv: 1, page: 8, n_split: 4 }, ACCUM),
        c("gemm", q, Op::Gemm { m: 48, n: 1, k: 5120 }, ACCUM),
        c("gemm", q, Op::Gemm { m: 2048, n: 129, k: 5120 }, ACCUM),
        c("gemv", q, Op::Gemv { n: 1, ms: vec![5120], k: 17408, f32_out: false }, ACCUM),
        c("gemv", q, Op::Gemv { n: 3, ms: vec![10240, 6144, 96], k: 5120, f32_out: false }, ACCUM),
        c("gemv", q, Op::Gemv { n: 8, ms: vec![37], k: 136, f32_out: true }, ACCUM),
        c("gemv", q, Op::Gemv { n: 5, ms: vec![1, 17, 33], k: 8, f32_out: false }, ACCUM),
        c("gemv", q, Op::Gemv { n: 2, ms: vec![1000], k: 5120, f32_out: true }, ACCUM),
        c("gemv", q, Op::Gemv { n: 6, ms: vec![4099, 24], k: 6144, f32_out: false }, ACCUM),
        c("gemv", q, Op::Gemv { n: 4, ms: vec![64], k: 5128, f32_out: false }, ACCUM),
        c("gemv", q, Op::Gemv { n: 7, ms: vec![250], k: 1000, f32_out: true }, ACCUM),
        c("w4_gemv", q, Op::W4Gemv { m: 1, out: 200, inp: 1024, asym: false, perm: false, bf16: false }, ACCUM),
        c("w4_gemv", q, Op::W4Gemv { m: 2, out: 200, inp: 1024, asym: true, perm: false, bf16: false }, ACCUM),
        c("w4_gemv", q, Op::W4Gemv { m: 3, out: 200, inp: 1024, asym: false, perm: true, bf16: false }, ACCUM),
        c("w4_gemv", q, Op::W4Gemv { m: 4, out: 200, inp: 1024, asym: true, perm: true, bf16: false }, ACCUM),
        c("w4_gemv", q, Op::W4Gemv { m: 5, out: 200, inp: 1024, asym: false, perm: false, bf16: true }, ACCUM),
        c("w4_gemv", q, Op::W4Gemv { m: 6, out: 200, inp: 1024, asym: true, perm: false, bf16: true }, ACCUM),
        c("w4_gemv", q, Op::W4Gemv { m: 7, out: 200, inp: 1024, asym: false, perm: false, bf16: false }, ACCUM),
        c("w4_gemv", q, Op::W4Gemv { m: 8, out: 200, inp: 1024, asym: true, perm: false, bf16: false }, ACCUM),
        c("w4_gemv", q, Op::W4Gemv { m: 1, out: 5120, inp: 17408, asym: false, perm: false, bf16: false }, ACCUM),
        c("w4_gemv", q, Op::W4Gemv { m: 3, out: 1000, inp: 5120, asym: true, perm: true, bf16: false }, ACCUM),
        c("w4_gemv", q, Op::W4Gemv { m: 8, out: 37, inp: 128, asym: true, perm: false, bf16: false }, ACCUM),
        c("w4_gemv", q, Op::W4Gemv { m: 11, out: 48, inp: 384, asym: false, perm: true, bf16: false }, ACCUM),
        c("w4_gemv", q, Op::W4Gemv { m: 1, out: 301, inp: 640, asym: true, perm: false, bf16: true }, ACCUM),
        c("w4_gemv", q, Op::W4Gemv { m: 2, out: 6, inp: 256, asym: false, perm: false, bf16: false }, ACCUM),
        c(
            "w4_gemv_multi",
            q,
            Op::W4GemvMulti { m: 1, outs: vec![12288, 1024, 1024], inp: 5120, asym: false, bf16: false },
            ACCUM,
        ),
        c(
            "w4_gemv_multi",
            q,
            Op::W4GemvMulti { m: 11, outs: vec![200, 37, 96], inp: 384, asym: true, bf16: true },
            ACCUM,
        ),
        c(
            "w4_gemv_multi",
            q,
            Op::W4GemvMulti { m: 3, outs: vec![64, 1000], inp: 1024, asym: true, bf16: false },
            ACCUM,
        ),
        c(
            "w4_gemv_multi",
            q,
            Op::W4GemvMulti { m: 2, outs: vec![10240, 6144, 48, 48], inp: 5120, asym: false, bf16: true },
            ACCUM,
        ),
        // The 27B's down into gate/up, and a DeltaNet out-projection into the in-projection (qkv, z, b, a), folded.
        c(
            "w4_gemv_fold",
            q,
            Op::W4Fold {
                m: 1,
                hidden: 5120,
                pin: 17408,
                outs: vec![17408, 17408],
                asym: false,
                bf16: false,
                thin: false,
            },
            ACCUM,
        ),
        c(
            "w4_gemv_fold",
            q,
            Op::W4Fold {
                m: 2,
                hidden: 5120,
                pin: 6144,
                outs: vec![10240, 6144, 48, 48],
                asym: false,
                bf16: true,
                thin: true,
            },
            ACCUM,
        ),
        c(
            "w4_gemv_fold",
            q,
            Op::W4Fold { m: 8, hidden: 1024, pin: 384, outs: vec![200, 37], asym: true, bf16: false, thin: true },
            ACCUM,
        ),
        c(
            "w4_gemv_fold",
            q,
            Op::W4Fold { m: 5, hidden: 384, pin: 256, outs: vec![64], asym: true, bf16: true, thin: false },
            ACCUM,
        ),
        // The 27B's gate and up: on an H200 (264 blocks at once) up's last pairs run in the thin-wave tail.
        c(
            "w4_gemv_multi",
            q,
            Op::W4GemvMulti { m: 1, outs: vec![17408, 17408], inp: 5120, asym: false, bf16: false },
            ACCUM,
        ),
        c("w4_dequant", q, Op::W4Dequant { out: 300, inp: 1024, r0: 0, r1: 300, asym: false, perm: false }, EXACT),
        c("w4_dequant", q, Op::W4Dequant { out: 301, inp: 512, r0: 100, r1: 233, asym: true, perm: false }, EXACT),
        c("w4_dequant", q, Op::W4Dequant { out: 64, inp: 640, r0: 7, r1: 64, asym: true, perm: true }, EXACT),
        c("w4_dequant", q, Op::W4Dequant { out: 1000, inp: 5120, r0: 3, r1: 1000, asym: true, perm: false }, EXACT),
        c("w4_quantize", q, Op::W4Quantize { out: 301, inp: 512, asym: true }, EXACT),
        c("w4_quantize", q, Op::W4Quantize { out: 256, inp: 5120, asym: false }, EXACT),
        c("w4_quantize", q, Op::W4Quantize { out: 33, inp: 128, asym: false }, EXACT),
        // Quantised KV: writes with special rows (1 token; page boundaries; several sequences) ...
        c("kv_write_q", q, kvq(f8, i4, &[(0, 1)], 24, 4, 16, None, true), EXACT),
        c("kv_write_q", q, kvq(i8, f8, &[(0, 33), (5, 16), (0, 2)], 24, 4, 16, None, true), EXACT),
        c("kv_write_q", HD32_G8, kvq(i4, i8, &[(0, 17), (3, 9)], 8, 1, 8, None, true), EXACT),
        c("kv_write_q", SMALL, kvq(i4, bf, &[(60, 70)], 8, 4, 32, None, true), EXACT),
        // ... and attention over them (write checks included), same tolerance as the bf16 cases.
        c("kv_q+attn_prefill", q, kvq(f8, f8, &[(0, 63), (10, 65), (100, 17)], 24, 4, 16, None, false), ATTN_PLAIN_P),
        c("kv_q+attn_prefill", q, kvq(i8, i4, &[(5, 64), (31, 127), (1000, 1)], 24, 4, 32, None, false), ATTN_PLAIN_P),
        c("kv_q+attn_prefill", q, kvq(i4, i8, &[(0, 300)], 24, 4, 32, None, false), ATTN_PLAIN_P),
        c("kv_q+attn_prefill", SMALL, kvq(bf, i4, &[(17, 63), (0, 64), (64, 65)], 8, 4, 16, None, false), ATTN_PLAIN_P),
        c("kv_q+attn_prefill", HD32_G8, kvq(i4, f8, &[(70, 40), (0, 16), (9, 1)], 8, 1, 8, None, false), ATTN_PLAIN_P),
        c("kv_q+attn_decode", q, kvq(f8, f8, &[(0, 1), (16, 1), (299, 1), (999, 1)], 24, 4, 16, Some(8), false), ACCUM),
        c("kv_q+attn_decode", q, kvq(i8, i4, &[(4, 1), (63, 1)], 24, 4, 32, Some(16), false), ACCUM),
        c("kv_q+attn_decode", q, kvq(i4, i8, &[(500, 1)], 24, 4, 16, Some(4), false), ACCUM),
        c("kv_q+attn_decode", SMALL, kvq(bf, i4, &[(33, 1), (0, 1)], 8, 4, 16, Some(8), false), ACCUM),
        // (HD 32 with int4: attn_decode_split alone; the int4 cases above at HD 256 / 128 run both kernels.)
        c("kv_q+attn_decode", HD32_G8, kvq(i4, f8, &[(77, 1), (8, 1)], 8, 1, 8, Some(3), false), ACCUM),
        c("kv_q+attn_decode", q, kvq(i4, i4, &[(4000, 1), (127, 1), (16, 1)], 24, 4, 32, Some(16), false), ACCUM),
        c("kv_q+attn_decode", q, kvq(f8, i4, &[(2000, 1), (1, 1)], 24, 4, 8, Some(32), false), ACCUM),
        c("kv_q+attn_decode", HD64_G1, kvq(i4, i4, &[(40, 1), (1000, 1)], 2, 2, 16, Some(4), false), ACCUM),
        // attn_decode_mma (tensor cores) and attn_decode_split both, each against the oracle: several
        // tiles per warp (4000 keys over 16 partitions, 3000 over 4), partitions past a row's end, 16-key
        // tiles inside a page (page 16, 32) or across pages (page 8), GQA 1, 2, 6, 8.
        c("kv_q+attn_decode", q, kvq(i8, i8, &[(4000, 1), (127, 1), (128, 1)], 24, 4, 32, Some(16), false), ACCUM),
        c("kv_q+attn_decode", q, kvq(f8, i8, &[(3000, 1), (15, 1)], 24, 4, 16, Some(4), false), ACCUM),
        c("kv_q+attn_decode", q, kvq(i8, f8, &[(700, 1), (1, 1)], 24, 4, 8, Some(32), false), ACCUM),
        c("kv_q+attn_decode", HD32_G8, kvq(f8, f8, &[(77, 1), (8, 1), (500, 1)], 8, 1, 8, Some(3), false), ACCUM),
        c("kv_q+attn_decode", SMALL, kvq(f8, i8, &[(33, 1), (0, 1), (260, 1)], 8, 4, 16, Some(8), false), ACCUM),
        c("kv_q+attn_decode", HD64_G1, kvq(i8, i8, &[(40, 1), (7, 1), (1000, 1)], 2, 2, 32, Some(4), false), ACCUM),
        c("kv_q+attn_decode", q, kvq(bf, f8, &[(2000, 1), (31, 1)], 24, 4, 16, Some(8), false), ACCUM),
        c("kv_q+attn_decode", HD32_G8, kvq(f8, bf, &[(300, 1), (2, 1)], 8, 1, 8, Some(4), false), ACCUM),
        // Quantised K with bf16 V: faulted on the H200 (2026-11-29; the prefill wrote the absent V scale row past
        // the end of shared memory, fixed since but not yet re-run on a GPU); last, so a fault hides nothing.
        c("kv_q+attn_prefill", HD64_G1, kvq(i8, bf, &[(3, 33), (0, 1)], 2, 2, 32, None, false), ATTN_PLAIN_P),
        c("kv_q+attn_decode", HD64_G1, kvq(i8, bf, &[(40, 1), (7, 1)], 2, 2, 32, Some(4), false), ACCUM),
    ]
}

// ---------------------------------------------------------------------------------------------
// Driver

#[test]
fn ops_match_cpu_reference() {
    if !LibStatus::probe().driver {
        eprintln!("SKIP ops: no CUDA driver (libcuda) on this machine");
        return;
    }
    let rt = Runtime::open(0).expect("CUDA driver present but the device could not be opened");
    let seed = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(1);
    println!("device {} ({}), seed {seed}", rt.name, rt.arch());
    let mut kernels: Vec<(KernelDims, Kernels)> = Vec::new();
    let mut failures = Vec::new();
    // DS_OPS_FILTER=<substring>: only the cases whose name contains it (quick device runs).
    let filter = std::env::var("DS_OPS_FILTER").unwrap_or_default();
    for (i, case) in cases().into_iter().enumerate() {
        if !case.name.contains(filter.as_str()) {
            continue;
        }
        if !kernels.iter().any(|(d, _)| *d == case.dims) {
            let k = Kernels::load(&rt, case.dims).expect("kernel load");
            println!("loaded kernels for {:?} in {:.0} ms", case.dims, k.load_ms);
            kernels.push((case.dims, k));
        }
        let k = &kernels.iter().find(|(d, _)| *d == case.dims).expect("loaded").1;
        let mut rng = StdRng::seed_from_u64(seed.wrapping_add(i as u64));
        let outcomes = match run_case(&rt, k, &case, &mut rng) {
            Ok(o) => o,
            Err(e) => vec![Outcome::error(format!("{e}"))],
        };
        for o in outcomes {
            println!(
                "{:<4} {:<22} {:<58} {}",
                if o.ok { "ok" } else { "FAIL" },
                case.name,
                format!("{:?}", case.op).chars().take(58).collect::<String>(),
                o.detail
            );
            if !o.ok {
                failures.push(format!("{} {:?}: {}", case.name, case.op, o.detail));
            }
        }
    }
    assert!(failures.is_empty(), "{} failing checks:\n{}", failures.len(), failures.join("\n"));
}

struct Outcome {
    ok: bool,
    detail: String,
}

impl Outcome {
    fn error(msg: String) -> Self {
        Outcome { ok: false, detail: msg }
    }
}

fn compare(what: &str, reference: &[f32], got: &[f32], tol: Tol) -> Outcome {
    if reference.len() != got.len() {
        return Outcome::error(format!("{what}: length {} vs {}", got.len(), reference.len()));
    }
    let rms =
        (reference.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / reference.len().max(1) as f64).sqrt() as f32;
    let atol = tol.atol_rms * rms + tol.atol_abs;
    let (mut worst, mut worst_share, mut max_err, mut nan) = (0usize, 0f32, 0f32, 0usize);
    for (i, (&r, &x)) in reference.iter().zip(got).enumerate() {
        if !x.is_finite() {
            nan += 1;
            continue;
        }
        let err = (r - x).abs();
        let lim = atol + tol.rtol * r.abs();
        let share = if lim > 0.0 {
            err / lim
        } else if err > 0.0 {
            f32::INFINITY
        } else {
            0.0
        };
        max_err = max_err.max(err);
        if share > worst_share {
            worst_share = share;
            worst = i;
        }
    }
    let ok = nan == 0 && worst_share <= 1.0;
    Outcome {
        ok,
        detail: format!(
            "{what}: n={} max|err|={max_err:.3e} worst[{worst}] ref={:.4e} got={:.4e} ({:.0}% of tol; atol={atol:.2e} rtol={:.1e}){}",
            reference.len(),
            reference.get(worst).copied().unwrap_or(0.0),
            got.get(worst).copied().unwrap_or(0.0),
            worst_share * 100.0,
            tol.rtol,
            if nan > 0 { format!(" {nan} NON-FINITE (unwritten?)") } else { String::new() }
        ),
    }
}

// ---------------------------------------------------------------------------------------------
// Device helpers: one arena region per case, poisoned outputs, bf16 rounding.

struct Dev<'a> {
    rt: &'a Runtime,
    arena: Arena,
    reg: RegionId,
}

type R<T> = Result<T, deltaserve_cuda::CudaError>;

impl<'a> Dev<'a> {
    fn new(rt: &'a Runtime, bytes: usize) -> R<Self> {
        let mut arena = Arena::new(rt.context().clone());
        let reg = arena.add_region("test", bytes)?;
        Ok(Dev { rt, arena, reg })
    }
    fn alloc(&mut self, bytes: usize) -> R<u64> {
        Ok(self.arena.alloc(self.reg, bytes)?.ptr)
    }
    fn bf16(&mut self, v: &[f32]) -> R<u64> {
        let h: Vec<u16> = v.iter().map(|&x| bf16::from_f32(x).to_bits()).collect();
        let p = self.alloc(2 * v.len())?;
        self.rt.upload(p, &h)?;
        Ok(p)
    }
    fn f32s(&mut self, v: &[f32]) -> R<u64> {
        let p = self.alloc(4 * v.len())?;
        self.rt.upload(p, v)?;
        Ok(p)
    }
    fn i32s(&mut self, v: &[i32]) -> R<u64> {
        let p = self.alloc(4 * v.len().max(1))?;
        self.rt.upload(p, v)?;
        Ok(p)
    }
    /// Output buffer filled with 0xFF bytes: NaN as bf16 and as f32.
    fn poison(&mut self, bytes: usize) -> R<u64> {
        let p = self.alloc(bytes)?;
        self.rt.memset(p, 0xFF, bytes)?;
        Ok(p)
    }
    fn get_bf16(&self, p: u64, n: usize) -> R<Vec<f32>> {
        let mut h = vec![0u16; n];
        self.rt.download(&mut h, p)?;
        Ok(h.into_iter().map(|b| bf16::from_bits(b).to_f32()).collect())
    }
    fn get_f32(&self, p: u64, n: usize) -> R<Vec<f32>> {
        let mut h = vec![0f32; n];
        self.rt.download(&mut h, p)?;
        Ok(h)
    }
}

fn rb(x: f32) -> f32 {
    bf16::from_f32(x).to_f32()
}

/// Uniform in [-a, a), rounded to bf16.
/// The sampling parameters of draw `i` (cycled): greedy with penalties, plain draws, cuts.
fn sample_params(i: usize, valid: usize, rng: &mut StdRng) -> RowSampling {
    let row = |temperature: f32, top_k: usize, top_p: f32, min_p: f32| RowSampling {
        temperature,
        top_k,
        top_p,
        min_p,
        uniform: 0.0,
        ..RowSampling::greedy()
    };
    let mut r = match i % 11 {
        0 => row(0.0, 0, 1.0, 0.0),
        1 => row(1.0, 0, 1.0, 0.0),
        2 => row(0.7, 0, 1.0, 0.0),
        3 => row(0.6, 20, 0.95, 0.0),
        4 => row(1.0, 20, 0.95, 0.0),
        5 => row(0.7, 0, 0.8, 0.0),
        6 => row(1.0, 0, 1.0, 0.05),
        7 => row(1.0, 1, 1.0, 0.0),
        8 => row(1.3, 200, 1.0, 0.02),
        9 => row(0.8, 0, 0.3, 0.0),
        _ => row(1.5, 0, 0.999, 0.0),
    };
    r.uniform = rng.random::<f32>();
    if matches!(i % 11, 0 | 4) {
        // Penalties on the low ids (where the test rows put their peaks): repeated (a long context: the
        // first 20,000 ids, more than the entries a row holds, or 64), every 8th also generated.
        r.repetition_penalty = 1.3;
        let repeated = if i % 11 == 4 { 20_000u32 } else { 64 };
        r.penalties = (0..repeated.min(valid as u32))
            .map(|id| Penalty {
                id,
                repeated: true,
                subtract: if id % 8 == 0 && id < 64 { 0.5 + 0.25 * id as f32 } else { 0.0 },
            })
            .collect();
    }
    r
}

#[allow(clippy::too_many_arguments)]
fn sample_case(
    rt: &Runtime,
    k: &Kernels,
    d: &mut Dev,
    rng: &mut StdRng,
    rows: usize,
    vocab: usize,
    valid: usize,
    rounds: usize,
) -> R<Outcome> {
    let s = rt.stream().clone();
    // Row kinds: peaked (a body of width ~2.5, a few ids at +7..+12 among the low ids, every 97th id
    // masked to −inf), flat (width 0.5), a coarse grid (ties).
    let mut x = vec![0f32; rows * vocab];
    for (r, row) in x.chunks_exact_mut(vocab).enumerate() {
        for v in row.iter_mut() {
            let n: f32 = (0..4).map(|_| rng.random_range(-1.0f32..1.0)).sum();
            *v = match r % 3 {
                0 => 2.5 * n,
                1 => 0.5 * n,
                _ => (2.0 * n * 4.0).round() / 4.0,
            };
        }
        if r % 3 == 0 {
            for j in 0..6.min(vocab) {
                row[j * 7 % vocab.min(64)] = 12.0 - j as f32;
            }
            // Masked ids (−inf): never drawn, at the bottom of every order.
            for j in (5..vocab).step_by(97) {
                row[j] = f32::NEG_INFINITY;
            }
        }
    }
    let sc = deltaserve_plan::SamplingScratch::new(rows, vocab);
    let (xp, base) = (d.f32s(&x)?, d.poison(sc.bytes as usize)?);
    let (mut equal, mut host, mut outside, mut off, mut greedy_diff, mut draws) = (0, 0, 0, 0, 0, 0);
    let mut offs = Vec::new();
    let mut modes = [0usize; 3];
    for round in 0..rounds {
        let sets: Vec<RowSampling> = (0..rows).map(|r| sample_params(r + round * rows, valid, rng)).collect();
        rt.upload(xp, &x)?;
        let e = ops::sample::encode(&sets, valid, sc.penalty_words);
        ops::sample::sample_rows(k, &s, &sc, base, xp, vocab, valid, rows, &e)?;
        let mut got = vec![[0i32; 2]; rows];
        rt.download(&mut got, base + sc.out)?;
        for ((row, set), [token, flag]) in x.chunks_exact(vocab).zip(&sets).zip(got) {
            draws += 1;
            modes[ops::sample::mode(set, valid) as usize] += 1;
            if flag == 1 {
                host += 1;
                continue;
            }
            let mut adjusted = row[..valid].to_vec();
            set.apply_penalties(&mut adjusted);
            let want = set.pick_adjusted(&adjusted);
            equal += usize::from(token as u32 == want);
            if set.is_greedy() {
                greedy_diff += usize::from(token as u32 != want);
                continue;
            }
            // The device's token must be where the draw lands in the host's walk (its kept candidates in
            // the host's order) up to the rounding of sums over up to 248K terms: u within 1e-4 of the
            // token's share of the mass. (Equal tokens are counted; over a flat row of 248K ids a
            // share is ~4e-6, so the f32 sums' order alone moves the token.)
            let (cand, probs) = set.candidates(&adjusted);
            let Some(j) = cand[..probs.len()].iter().position(|c| token >= 0 && c.0 == token as u32) else {
                outside += 1;
                continue;
            };
            let total: f64 = probs.iter().map(|&p| p as f64).sum();
            let before = probs[..j].iter().map(|&p| p as f64).sum::<f64>() / total;
            let after = before + probs[j] as f64 / total;
            let u = set.uniform as f64;
            if u < before - 1e-4 || u > after + 1e-4 {
                off += 1;
                if offs.len() < 3 {
                    let host_at = cand.iter().position(|c| c.0 == want);
                    offs.push(format!(
                        "[t {} k {} p {} min_p {} u {u:.6}: device {token} at {j} ({before:.6}..{after:.6}), host {want} at \
                         {host_at:?}, {} kept]",
                        set.temperature,
                        set.top_k,
                        set.top_p,
                        set.min_p,
                        probs.len()
                    ));
                }
            }
        }
    }
    let picked = draws - host;
    // A top-p prefix whose mass lands within rounding of p (the device sums in f32, the host in f64) may
    // end one candidate apart, which moves the draw's scale: allow 1 in 100 such draws.
    Ok(Outcome {
        ok: outside == 0 && off <= 1 + picked / 100 && greedy_diff == 0 && host < draws / 2,
        detail: format!(
            "{draws} draws (modes greedy/plain/cut {modes:?}): {equal} of {picked} picked on the device equal to the \
             host rule, {off} away from the draw's place in the host's walk, {outside} outside the host's kept set, \
             {greedy_diff} greedy differences, {host} left to the host {}",
            offs.join(" ")
        ),
    })
}

fn randv(rng: &mut StdRng, n: usize, a: f32) -> Vec<f32> {
    (0..n).map(|_| rb(rng.random_range(-a..a))).collect()
}

fn cu_of(lens: &[usize]) -> Vec<i32> {
    let mut cu = vec![0i32];
    for &l in lens {
        cu.push(cu.last().copied().unwrap_or(0) + l as i32);
    }
    cu
}

// ---------------------------------------------------------------------------------------------
// Cases

fn run_case(rt: &Runtime, k: &Kernels, case: &Case, rng: &mut StdRng) -> R<Vec<Outcome>> {
    let s = rt.stream().clone();
    let tol = case.tol;
    let mut dev = Dev::new(rt, 1 << 30)?;
    let d = &mut dev;
    let out = match case.op.clone() {
        Op::Embed { t, d: dim, vocab } => {
            let table = randv(rng, vocab * dim, 1.0);
            // Every 3rd id is −1 (outside a tensor-parallel rank's vocabulary shard): a row of zeros.
            let ids: Vec<i32> =
                (0..t).map(|i| if i % 3 == 2 { -1 } else { rng.random_range(0..vocab as i32) }).collect();
            let (tp, ip, op) = (d.bf16(&table)?, d.i32s(&ids)?, d.poison(2 * t * dim)?);
            ops::embed::embed_gather(k, &s, tp, ip, op, t, dim)?;
            let r: Vec<f32> = ids
                .iter()
                .flat_map(|&i| if i < 0 { vec![0.0; dim] } else { table[i as usize * dim..][..dim].to_vec() })
                .collect();
            vec![compare("out", &r, &d.get_bf16(op, t * dim)?, tol)]
        }
        Op::Argmax { rows, vocab, valid, special } => {
            let mut x = randv(rng, rows * vocab, 4.0);
            if special {
                // Row r: a maximum repeated at several ids (the lowest must win), and per row kind a NaN
                // at 0, a NaN elsewhere, +inf, all -inf, all NaN, a maximum past `valid`.
                for (r, row) in x.chunks_exact_mut(vocab).enumerate() {
                    let m = 50.0;
                    for i in [vocab / 2, vocab / 3, vocab - 1, 1] {
                        if i < valid {
                            row[i] = m;
                        }
                    }
                    match r % 6 {
                        0 => row[0] = f32::NAN,
                        1 => row[vocab / 4] = f32::NAN,
                        2 => row[vocab / 5] = f32::INFINITY,
                        3 => row.iter_mut().for_each(|v| *v = f32::NEG_INFINITY),
                        4 => row.iter_mut().for_each(|v| *v = f32::NAN),
                        _ => row[vocab - 1] = 1e9,
                    }
                }
            }
            let (xp, ip) = (d.f32s(&x)?, d.poison(4 * rows)?);
            ops::argmax::argmax_rows(k, &s, xp, vocab, valid, rows, ip)?;
            let mut got = vec![0i32; rows];
            d.rt.download(&mut got, ip)?;
            let want: Vec<i32> =
                x.chunks_exact(vocab).map(|row| deltaserve_backend::argmax(&row[..valid]) as i32).collect();
            vec![Outcome { ok: got == want, detail: format!("ids {got:?} (host argmax {want:?})") }]
        }
        Op::Sample { rows, vocab, valid, rounds } => vec![sample_case(rt, k, d, rng, rows, vocab, valid, rounds)?],
        Op::AddRmsNorm { rows, d: dim, residual } => {
            let x = randv(rng, rows * dim, 2.0);
            let res = randv(rng, rows * dim, 2.0);
            let w = randv(rng, dim, 0.5);
            let (xp, rp, wp) = (d.bf16(&x)?, d.bf16(&res)?, d.bf16(&w)?);
            let (ro, op) = (d.poison(2 * rows * dim)?, d.poison(2 * rows * dim)?);
            let (resp, rop) = if residual { (Some(rp), Some(ro)) } else { (None, None) };
            ops::norm::add_rms_norm_1p(k, &s, xp, resp, wp, rop, op, rows, dim, 1e-6)?;
            let h: Vec<f32> = if residual { x.iter().zip(&res).map(|(a, b)| rb(a + b)).collect() } else { x.clone() };
            let mut n = h.clone();
            cpu::norm::rms_norm_1p(&mut n, &w, 1e-6);
            let mut v = vec![compare("normed", &n, &d.get_bf16(op, rows * dim)?, tol)];
            if residual {
                v.push(compare("residual", &h, &d.get_bf16(ro, rows * dim)?, EXACT));
            }
            v
        }
        Op::RmsNormStrided { t, heads, hd, stride } => {
            let x = randv(rng, t * heads * stride, 3.0);
            let w = randv(rng, hd, 0.5);
            let (xp, wp, op) = (d.bf16(&x)?, d.bf16(&w)?, d.poison(2 * t * heads * hd)?);
            ops::norm::rms_norm_1p(k, &s, xp, stride, wp, op, hd, t * heads, hd, 1e-6)?;
            let mut r: Vec<f32> = x.chunks(stride).flat_map(|c| c[..hd].to_vec()).collect();
            cpu::norm::rms_norm_1p(&mut r, &w, 1e-6);
            vec![compare("out", &r, &d.get_bf16(op, t * heads * hd)?, tol)]
        }
        Op::GatedRmsNorm { t, hv, dv } => {
            let o = randv(rng, t * hv * dv, 1.0);
            let z = randv(rng, t * hv * dv, 3.0);
            let w: Vec<f32> = (0..dv).map(|_| rng.random_range(0.5..1.5)).collect();
            let (opp, zp, wp, outp) = (d.bf16(&o)?, d.bf16(&z)?, d.f32s(&w)?, d.poison(2 * t * hv * dv)?);
            ops::norm::gated_rms_norm(k, &s, opp, zp, hv * dv, hv, wp, outp, t, dv, 1e-6)?;
            let mut r = o.clone();
            cpu::norm::gated_rms_norm(&mut r, &z, &w, 1e-6);
            vec![compare("out", &r, &d.get_bf16(outp, t * hv * dv)?, tol)]
        }
        Op::SigmoidGate { t, heads, hd } => {
            let x = randv(rng, t * heads * hd, 2.0);
            let qg = randv(rng, t * heads * 2 * hd, 4.0);
            let (xp, gp) = (d.bf16(&x)?, d.bf16(&qg)?);
            ops::elementwise::sigmoid_gate_mul(k, &s, xp, gp + 2 * hd as u64, t, heads, hd, 2 * heads * hd, 2 * hd)?;
            let r: Vec<f32> = (0..x.len())
                .map(|i| {
                    let (tt, h, dd) = (i / (heads * hd), (i / hd) % heads, i % hd);
                    x[i] * cpu::activation::sigmoid(qg[tt * 2 * heads * hd + h * 2 * hd + hd + dd])
                })
                .collect();
            vec![compare("out", &r, &d.get_bf16(xp, x.len())?, tol)]
        }
        Op::Swiglu { t, i } => {
            let gu = randv(rng, t * 2 * i, 4.0);
            let (gp, op) = (d.bf16(&gu)?, d.poison(2 * t * i)?);
            ops::elementwise::swiglu(k, &s, gp, 2 * i, gp + 2 * i as u64, 2 * i, op, t, i)?;
            let r: Vec<f32> = (0..t * i)
                .map(|e| {
                    let (tt, c) = (e / i, e % i);
                    cpu::activation::silu(gu[tt * 2 * i + c]) * gu[tt * 2 * i + i + c]
                })
                .collect();
            vec![compare("out", &r, &d.get_bf16(op, t * i)?, tol)]
        }
        Op::Rope { t, heads, hd, rot, pos0 } => {
            let x = randv(rng, t * heads * hd, 2.0);
            let pos: Vec<i32> = (0..t).map(|i| (pos0 + i) as i32).collect();
            let (xp, pp) = (d.bf16(&x)?, d.i32s(&pos)?);
            ops::rope::rope_partial(k, &s, xp, heads * hd, pp, t, heads, hd, rot, 1e7)?;
            let mut r = x.clone();
            cpu::rope::apply_partial_rope(&mut r, heads, hd, rot, 1e7, pos0);
            vec![compare("out", &r, &d.get_bf16(xp, x.len())?, tol)]
        }
        Op::QkNormRope { t, nq, nkv, hd, rot, pos0 } => {
            // q in the q|gate layout [t, nq, 2*hd] (the gate halves must stay untouched), k [t, nkv, hd].
            let (q_tok, k_tok) = (2 * nq * hd, nkv * hd);
            let q = randv(rng, t * q_tok, 2.0);
            let kv = randv(rng, t * k_tok, 2.0);
            let (wq, wk) = (randv(rng, hd, 0.5), randv(rng, hd, 0.5));
            let pos: Vec<i32> = (0..t).map(|i| (pos0 + 3 * i) as i32).collect();
            let (wqp, wkp, pp) = (d.bf16(&wq)?, d.bf16(&wk)?, d.i32s(&pos)?);
            let (qa, ka, qb, kb) = (d.bf16(&q)?, d.bf16(&kv)?, d.bf16(&q)?, d.bf16(&kv)?);
            let (theta, eps) = (1e7, 1e-6);
            ops::norm::rms_norm_1p(k, &s, qa, 2 * hd, wqp, qa, 2 * hd, t * nq, hd, eps)?;
            ops::norm::rms_norm_1p(k, &s, ka, hd, wkp, ka, hd, t * nkv, hd, eps)?;
            ops::rope::rope_partial_strided(k, &s, qa, q_tok, 2 * hd, pp, t, nq, hd, rot, theta)?;
            ops::rope::rope_partial(k, &s, ka, k_tok, pp, t, nkv, hd, rot, theta)?;
            let a = ops::rope::QkNormRope {
                q: qb,
                q_tok,
                q_head: 2 * hd,
                q_heads: nq,
                q_norm: wqp,
                k: kb,
                k_tok,
                kv_heads: nkv,
                k_norm: wkp,
                positions: pp,
                t,
                head_dim: hd,
                rotary_dim: rot,
                theta,
                eps,
            };
            ops::rope::qk_norm_rope(k, &s, &a)?;
            let bits = |p: u64, n: usize| -> R<Vec<u16>> {
                let mut v = vec![0u16; n];
                d.rt.download(&mut v, p)?;
                Ok(v)
            };
            vec![
                same_bits("q|gate vs the separate kernels", &bits(qa, q.len())?, &bits(qb, q.len())?),
                same_bits("k vs the separate kernels", &bits(ka, kv.len())?, &bits(kb, kv.len())?),
            ]
        }
        Op::QkNormRopeKv { fk, fv, seqs, nq, nkv, hd, page, pad } => {
            let (q_tok, kvd) = (2 * nq * hd, nkv * hd);
            // The rows: each sequence's new tokens at their positions, then the padding row.
            let mut pos: Vec<i32> = seqs.iter().flat_map(|&(c, n)| (c..c + n).map(|p| p as i32)).collect();
            let mut lens: Vec<usize> = seqs.iter().map(|s| s.1).collect();
            if pad {
                pos.push(-1);
                lens.push(1);
            }
            let t = pos.len();
            let cu = cu_of(&lens);
            // Block tables: the blocks of the new tokens get distinct pages in shuffled order (a few
            // pages, however far the positions), the others page 0 (never written).
            let max_blocks = seqs.iter().map(|&(c, n)| (c + n).div_ceil(page)).max().unwrap_or(1);
            let used: Vec<(usize, usize)> = seqs
                .iter()
                .enumerate()
                .flat_map(|(b, &(c, n))| (c / page..(c + n).div_ceil(page)).map(move |blk| (b, blk)))
                .collect();
            let num_blocks = used.len() + 3;
            let mut pages: Vec<i32> = (0..num_blocks as i32).collect();
            for i in (1..pages.len()).rev() {
                let j = rng.random_range(0..=i);
                pages.swap(i, j);
            }
            let mut bt = vec![0i32; lens.len() * max_blocks];
            for (&(b, blk), &pg) in used.iter().zip(&pages) {
                bt[b * max_blocks + blk] = pg;
            }
            let q = randv(rng, t * q_tok, 2.0);
            let kx = randv(rng, t * kvd, 2.0);
            let vx = randv(rng, t * kvd, 1.0);
            let (wq, wk) = (randv(rng, hd, 0.5), randv(rng, hd, 0.5));
            let (wqp, wkp, pp, cup, btp, vp) =
                (d.bf16(&wq)?, d.bf16(&wk)?, d.i32s(&pos)?, d.i32s(&cu)?, d.i32s(&bt)?, d.bf16(&vx)?);
            let rows = num_blocks * page * nkv;
            let (krb, vrb) = (ops::kv_quant::row_bytes(fk, hd), ops::kv_quant::row_bytes(fv, hd));
            let tensor = |data, scales, fmt| ops::kv_quant::KvTensor { data, scales, fmt };
            let mut run = |fused: bool| -> R<Vec<Vec<u16>>> {
                let (qp, kp) = (d.bf16(&q)?, d.bf16(&kx)?);
                let (kc, vc, ksc, vsc) =
                    (d.poison(rows * krb)?, d.poison(rows * vrb)?, d.poison(2 * rows)?, d.poison(2 * rows)?);
                let layer = ops::kv_quant::LayerKv { k: tensor(kc, ksc, fk), v: tensor(vc, vsc, fv) };
                let a = ops::rope::QkNormRope {
                    q: qp,
                    q_tok,
                    q_head: 2 * hd,
                    q_heads: nq,
                    q_norm: wqp,
                    k: kp,
                    k_tok: kvd,
                    kv_heads: nkv,
                    k_norm: wkp,
                    positions: pp,
                    t,
                    head_dim: hd,
                    rotary_dim: hd / 4,
                    theta: 1e7,
                    eps: 1e-6,
                };
                let w = ops::kv_cache::KvWrite {
                    k: kp,
                    k_stride: kvd,
                    v: vp,
                    v_stride: kvd,
                    k_cache: 0,
                    v_cache: 0,
                    block_tables: btp,
                    max_blocks,
                    cu_seqlens: cup,
                    positions: pp,
                    n_seqs: lens.len(),
                    t,
                    page,
                    kv_heads: nkv,
                    head_dim: hd,
                };
                if fused {
                    ops::rope::qk_norm_rope_kv(k, &s, &a, &w, &layer)?;
                } else {
                    ops::rope::qk_norm_rope(k, &s, &a)?;
                    ops::kv_quant::kv_write_q(k, &s, &w, &layer)?;
                }
                let words = |p: u64, bytes: usize| -> R<Vec<u16>> {
                    let mut v = vec![0u16; bytes / 2];
                    d.rt.download(&mut v, p)?;
                    Ok(v)
                };
                Ok(vec![
                    words(qp, 2 * q.len())?,
                    words(kp, 2 * kx.len())?,
                    words(kc, rows * krb)?,
                    words(ksc, 2 * rows)?,
                    words(vc, rows * vrb)?,
                    words(vsc, 2 * rows)?,
                ])
            };
            let (want, got) = (run(false)?, run(true)?);
            let names = ["q|gate", "k", "K cache", "K scales", "V cache", "V scales"];
            let mut out: Vec<Outcome> = names
                .iter()
                .zip(want.iter().zip(&got))
                .map(|(n, (w, g))| same_bits(&format!("{n} vs the two kernels"), w, g))
                .collect();
            // The cache got the rows (not only poison in both).
            let written = want[2].iter().filter(|&&x| x != 0xFFFF).count();
            out.push(Outcome { ok: written > 0, detail: format!("K cache: {written} words written") });
            out
        }
        Op::ConvPrefill { lens, c } => {
            let kw = k.dims.conv_kernel;
            let t: usize = lens.iter().sum();
            let nb = lens.len();
            let x = randv(rng, t * c, 2.0);
            let w = randv(rng, c * kw, 0.6);
            let st0 = randv(rng, nb * (kw - 1) * c, 2.0);
            // Slots in reverse order, to catch slot/sequence mix-ups.
            let slots: Vec<i32> = (0..nb as i32).rev().collect();
            let cu = cu_of(&lens);
            let mut st_dev = vec![0f32; st0.len()];
            for (b, &sl) in slots.iter().enumerate() {
                let n = (kw - 1) * c;
                st_dev[sl as usize * n..][..n].copy_from_slice(&st0[b * n..][..n]);
            }
            let (xp, wp, sp, cup, slp, yp) =
                (d.bf16(&x)?, d.bf16(&w)?, d.bf16(&st_dev)?, d.i32s(&cu)?, d.i32s(&slots)?, d.poison(2 * t * c)?);
            let a = conv::ConvPrefill {
                x: xp,
                x_stride: c,
                w: wp,
                y: yp,
                state: sp,
                cu_seqlens: cup,
                slots: slp,
                n_seqs: nb,
                t,
                channels: c,
            };
            conv::conv_prefill(k, &s, &a)?;
            let (mut ry, mut rs) = (Vec::new(), vec![0f32; st0.len()]);
            for (b, &len) in lens.iter().enumerate() {
                let n = (kw - 1) * c;
                let mut st = st0[b * n..][..n].to_vec();
                let xs = &x[cu[b] as usize * c..][..len * c];
                ry.extend(cpu::conv::causal_conv1d_silu(xs, c, &w, kw, &mut st));
                rs[slots[b] as usize * n..][..n].copy_from_slice(&st);
            }
            vec![
                compare("y", &ry, &d.get_bf16(yp, t * c)?, tol),
                compare("state", &rs, &d.get_bf16(sp, rs.len())?, EXACT),
            ]
        }
        Op::ConvDecode { b, c } => {
            let kw = k.dims.conv_kernel;
            let x = randv(rng, b * c, 2.0);
            let w = randv(rng, c * kw, 0.6);
            let st0 = randv(rng, b * (kw - 1) * c, 2.0);
            let slots: Vec<i32> = (0..b as i32).rev().collect();
            let n = (kw - 1) * c;
            let mut st_dev = vec![0f32; st0.len()];
            for (bi, &sl) in slots.iter().enumerate() {
                st_dev[sl as usize * n..][..n].copy_from_slice(&st0[bi * n..][..n]);
            }
            let (xp, wp, sp, slp, yp) =
                (d.bf16(&x)?, d.bf16(&w)?, d.bf16(&st_dev)?, d.i32s(&slots)?, d.poison(2 * b * c)?);
            conv::conv_decode(k, &s, xp, c, wp, yp, sp, slp, b, c)?;
            let (mut ry, mut rs) = (Vec::new(), vec![0f32; st0.len()]);
            for (bi, &sl) in slots.iter().enumerate() {
                let mut st = st0[bi * n..][..n].to_vec();
                ry.extend(cpu::conv::causal_conv1d_silu(&x[bi * c..][..c], c, &w, kw, &mut st));
                rs[sl as usize * n..][..n].copy_from_slice(&st);
            }
            vec![
                compare("y", &ry, &d.get_bf16(yp, b * c)?, tol),
                compare("state", &rs, &d.get_bf16(sp, rs.len())?, EXACT),
            ]
        }
        Op::GdnConvGateDecode { ref slots, hk, hv } => {
            let (dk, kw) = (k.dims.gdn_k_dim, k.dims.conv_kernel);
            let c = (2 * hk + hv) * dk;
            let (b, xs) = (slots.len(), c + 8);
            let n_slots = 4;
            let x = randv(rng, b * xs, 1.0);
            let w = randv(rng, c * kw, 0.6);
            let st0 = randv(rng, n_slots * (kw - 1) * c, 1.0);
            let ba = randv(rng, b * 2 * hv, 4.0);
            let a_log: Vec<f32> = (0..hv).map(|_| rng.random_range(-2.0..1.5)).collect();
            let dt_bias: Vec<f32> = (0..hv).map(|_| rng.random_range(-1.0..1.0)).collect();
            let (xp, wp, bap, alp, dtp, sp) =
                (d.bf16(&x)?, d.bf16(&w)?, d.bf16(&ba)?, d.f32s(&a_log)?, d.f32s(&dt_bias)?, d.i32s(slots)?);
            // Path A: the separate kernels; path B: the fused one; each with its own state copy.
            let mut outs = Vec::new();
            for fused in [false, true] {
                let st = d.bf16(&st0)?;
                let y = d.poison(2 * b * c)?;
                let (qo, ko, go, bo) = (
                    d.poison(2 * b * hk * dk)?,
                    d.poison(2 * b * hk * dk)?,
                    d.poison(4 * b * hv)?,
                    d.poison(4 * b * hv)?,
                );
                let gate = gate_args(y, c, bap, alp, dtp, [qo, ko, go, bo], b, hk, hv);
                if fused {
                    let f = gdn_gate::GdnConvGateDecode { x: xp, x_stride: xs, w: wp, state: st, slots: sp, gate };
                    gdn_gate::gdn_conv_gate_decode(k, &s, &f)?;
                } else {
                    conv::conv_decode(k, &s, xp, xs, wp, y, st, sp, b, c)?;
                    gdn_gate::gdn_gate(k, &s, &gate)?;
                }
                let bits16 = |p: u64, n: usize| -> R<Vec<u16>> {
                    let mut v = vec![0u16; n];
                    d.rt.download(&mut v, p)?;
                    Ok(v)
                };
                let bits32 = |p: u64, n: usize| -> R<Vec<u16>> {
                    let mut v = vec![0u16; 2 * n];
                    d.rt.download(&mut v, p)?;
                    Ok(v)
                };
                outs.push([
                    bits16(y, b * c)?,
                    bits16(st, st0.len())?,
                    bits16(qo, b * hk * dk)?,
                    bits16(ko, b * hk * dk)?,
                    bits32(go, b * hv)?,
                    bits32(bo, b * hv)?,
                ]);
            }
            ["y", "conv state", "q", "k", "g", "beta"]
                .iter()
                .enumerate()
                .map(|(i, what)| same_bits(&format!("{what} vs conv_decode + gdn_gate"), &outs[0][i], &outs[1][i]))
                .collect()
        }
        Op::GdnGate { t, hk, hv } => {
            let dk = k.dims.gdn_k_dim;
            let conv_dim = 2 * hk * dk + hv * k.dims.gdn_v_dim;
            let qkv = randv(rng, t * conv_dim, 1.0);
            let ba = randv(rng, t * 2 * hv, 4.0); // [b | a] per token, like a fused projection
            let a_log: Vec<f32> = (0..hv).map(|_| rng.random_range(-2.0..1.5)).collect();
            let dt_bias: Vec<f32> = (0..hv).map(|_| rng.random_range(-1.0..1.0)).collect();
            let (qp, bap, alp, dtp) = (d.bf16(&qkv)?, d.bf16(&ba)?, d.f32s(&a_log)?, d.f32s(&dt_bias)?);
            let (qo, ko, go, bo) =
                (d.poison(2 * t * hk * dk)?, d.poison(2 * t * hk * dk)?, d.poison(4 * t * hv)?, d.poison(4 * t * hv)?);
            let a = gate_args(qp, conv_dim, bap, alp, dtp, [qo, ko, go, bo], t, hk, hv);
            gdn_gate::gdn_gate(k, &s, &a)?;
            let (mut rq, mut rk, mut rg, mut rbeta) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
            for tt in 0..t {
                let row = &qkv[tt * conv_dim..];
                let mut qq = row[..hk * dk].to_vec();
                let mut kk = row[hk * dk..2 * hk * dk].to_vec();
                cpu::norm::l2_norm(&mut qq, dk, 1e-6);
                cpu::norm::l2_norm(&mut kk, dk, 1e-6);
                rq.extend(qq.iter().map(|v| v / (dk as f32).sqrt()));
                rk.extend(kk);
                for h in 0..hv {
                    let (bv, av) = (ba[tt * 2 * hv + h], ba[tt * 2 * hv + hv + h]);
                    rbeta.push(cpu::activation::sigmoid(bv));
                    rg.push(-a_log[h].exp() * cpu::activation::softplus(av + dt_bias[h]));
                }
            }
            vec![
                compare("q", &rq, &d.get_bf16(qo, rq.len())?, tol),
                compare("k", &rk, &d.get_bf16(ko, rk.len())?, tol),
                compare("g", &rg, &d.get_f32(go, rg.len())?, tol),
                compare("beta", &rbeta, &d.get_f32(bo, rbeta.len())?, tol),
            ]
        }
        Op::GdnChunk { lens, hk, hv, prec } => gdn_case(k, &s, d, rng, &lens, hk, hv, tol, GdnMode::Chunked(prec))?,
        Op::GdnDecodeGated { ref slots, hk, hv } => {
            let (dk, dv) = (k.dims.gdn_k_dim, k.dims.gdn_v_dim);
            let b = slots.len();
            let n_slots = slots.iter().copied().max().unwrap_or(0).max(0) as usize + 1;
            let (vs, zs) = (hv * dv + 8, hv * dv);
            let qv = randv(rng, b * hk * dk, 0.3);
            let kv = randv(rng, b * hk * dk, 0.3);
            let v = randv(rng, b * vs, 1.0);
            let g: Vec<f32> = (0..b * hv).map(|_| -rng.random_range(0.0..1.0f32)).collect();
            let beta: Vec<f32> = (0..b * hv).map(|_| rng.random_range(0.0..1.0f32)).collect();
            let st0 = randv(rng, n_slots * hv * dk * dv, 0.5);
            let z = randv(rng, b * zs, 2.0);
            let nw = randv(rng, dv, 1.0);
            let (qp, kp, vp, gp, bp) = (d.bf16(&qv)?, d.bf16(&kv)?, d.bf16(&v)?, d.f32s(&g)?, d.f32s(&beta)?);
            let (zp, nwp, sp) = (d.bf16(&z)?, d.f32s(&nw)?, d.i32s(slots)?);
            let mut got = Vec::new();
            for fused in [false, true] {
                let st = d.f32s(&st0)?;
                let (o, out) = (d.poison(2 * b * hv * dv)?, d.poison(2 * b * hv * dv)?);
                let dec = gdn_decode::GdnDecode {
                    q: qp,
                    k: kp,
                    v: vp,
                    v_stride: vs,
                    g: gp,
                    beta: bp,
                    state: st,
                    slots: sp,
                    o,
                    n_seqs: b,
                    hk,
                    hv,
                };
                if fused {
                    let a = gdn_decode::GdnDecodeGated { d: dec, z: zp, z_tok_stride: zs, norm_w: nwp, out, eps: 1e-6 };
                    gdn_decode::gdn_decode_gated(k, &s, &a)?;
                } else {
                    gdn_decode::gdn_decode(k, &s, &dec)?;
                    ops::norm::gated_rms_norm(k, &s, o, zp, zs, hv, nwp, out, b, dv, 1e-6)?;
                }
                let mut ob = vec![0u16; b * hv * dv];
                d.rt.download(&mut ob, out)?;
                let mut sb = vec![0u16; 2 * st0.len()];
                d.rt.download(&mut sb, st)?;
                got.push((ob, sb));
            }
            vec![
                same_bits("out vs gdn_decode + gated_rms_norm", &got[0].0, &got[1].0),
                same_bits("state vs gdn_decode", &got[0].1, &got[1].1),
            ]
        }
        Op::GdnDecode { b, hk, hv } => gdn_case(k, &s, d, rng, &vec![1; b], hk, hv, tol, GdnMode::Decode)?,
        Op::GdnRecurrent { lens, accept, hk, hv } => {
            gdn_case(k, &s, d, rng, &lens, hk, hv, tol, GdnMode::Recurrent(accept))?
        }
        Op::ConvAccept { lens, accept, c } => {
            let kw = k.dims.conv_kernel;
            let t: usize = lens.iter().sum();
            let nb = lens.len();
            let x = randv(rng, t * c, 2.0);
            let n = (kw - 1) * c;
            let st0 = randv(rng, (nb + 1) * n, 2.0);
            let slots: Vec<i32> = (1..=nb as i32).rev().collect();
            let cu = cu_of(&lens);
            let acc: Vec<i32> = accept.iter().map(|&a| a as i32).collect();
            let (xp, sp, cup, slp, ap) = (d.bf16(&x)?, d.bf16(&st0)?, d.i32s(&cu)?, d.i32s(&slots)?, d.i32s(&acc)?);
            let a = conv::ConvPrefill {
                x: xp,
                x_stride: c,
                w: 0,
                y: 0,
                state: sp,
                cu_seqlens: cup,
                slots: slp,
                n_seqs: nb,
                t,
                channels: c,
            };
            conv::conv_state_update(k, &s, &a, nb, ap)?;
            // The oracle: the last kw − 1 rows of (state ++ accepted rows).
            let mut rs: Vec<f32> = st0.iter().map(|&v| rb(v)).collect();
            for (b, &sl) in slots.iter().enumerate() {
                let old = &rs[sl as usize * n..][..n].to_vec();
                let mut rows: Vec<&[f32]> = old.chunks_exact(c).collect();
                rows.extend(x[cu[b] as usize * c..][..accept[b] * c].chunks_exact(c));
                let new: Vec<f32> =
                    rows[rows.len() - (kw - 1)..].iter().flat_map(|r| r.iter().map(|&v| rb(v))).collect();
                rs[sl as usize * n..][..n].copy_from_slice(&new);
            }
            vec![compare("state", &rs, &d.get_bf16(sp, rs.len())?, tol)]
        }
        Op::MtpRows { lens, d: dim } => {
            let t: usize = lens.iter().sum();
            let nb = lens.len();
            let x = randv(rng, t * dim, 2.0);
            let pend = randv(rng, (nb + 2) * dim, 2.0);
            // The last sequence is decode-graph padding (slot −1: zero rows).
            let slots: Vec<i32> = (0..nb).map(|b| if b + 1 == nb { -1 } else { (nb - b) as i32 }).collect();
            let cu = cu_of(&lens);
            let (xp, pp, cup, slp, yp) =
                (d.bf16(&x)?, d.bf16(&pend)?, d.i32s(&cu)?, d.i32s(&slots)?, d.poison(2 * t * dim)?);
            ops::mtp::shift_rows(k, &s, xp, pp, cup, slp, nb, yp, t, dim)?;
            let mut ry = Vec::with_capacity(t * dim);
            for (b, &len) in lens.iter().enumerate() {
                for i in 0..len {
                    let r = cu[b] as usize + i;
                    let row: Vec<f32> = if slots[b] < 0 {
                        vec![0.0; dim]
                    } else if i == 0 {
                        pend[slots[b] as usize * dim..][..dim].to_vec()
                    } else {
                        x[(r - 1) * dim..][..dim].to_vec()
                    };
                    ry.extend(row.iter().map(|&v| rb(v)));
                }
            }
            let shifted = compare("shift", &ry, &d.get_bf16(yp, t * dim)?, tol);
            // Scatter each sequence's last row to its slot (−1 rows skipped).
            let rows: Vec<i32> = (0..nb).map(|b| cu[b + 1] - 1).collect();
            ops::mtp::scatter_rows(k, &s, xp, d.i32s(&rows)?, pp, slp, nb, dim)?;
            let mut rp: Vec<f32> = pend.iter().map(|&v| rb(v)).collect();
            for b in 0..nb {
                if slots[b] >= 0 {
                    let src: Vec<f32> = x[rows[b] as usize * dim..][..dim].iter().map(|&v| rb(v)).collect();
                    rp[slots[b] as usize * dim..][..dim].copy_from_slice(&src);
                }
            }
            vec![shifted, compare("scatter", &rp, &d.get_bf16(pp, rp.len())?, tol)]
        }
        Op::AttnPrefill { seqs, hq, hkv, page } => attn_case(k, &s, d, rng, &seqs, hq, hkv, page, None, tol)?,
        Op::AttnPrefillTiled { seqs, hq, hkv, page, tiling } => {
            let kt = Kernels::load_tiled(rt, k.dims, KvFormats::BF16, tiling)?;
            attn_case(&kt, &s, d, rng, &seqs, hq, hkv, page, None, tol)?
        }
        Op::AttnDecode { lens, hq, hkv, page, n_split } => {
            let seqs: Vec<(usize, usize)> = lens.iter().map(|&l| (l - 1, 1)).collect();
            let mut out = attn_case(k, &s, d, rng, &seqs, hq, hkv, page, Some(n_split), tol)?;
            if k.decode_mma {
                // attn_decode_mma ran; the same case on attn_decode_split (its A/B switch).
                let mut ks = Kernels::load(rt, k.dims)?;
                ks.decode_mma = false;
                for mut o in attn_case(&ks, &s, d, rng, &seqs, hq, hkv, page, Some(n_split), tol)? {
                    o.detail = format!("attn_decode_split: {}", o.detail);
                    out.push(o);
                }
            }
            out
        }
        Op::KvQ { fk, fv, seqs, hq, hkv, page, n_split, special } => {
            kvq_case(rt, k, &s, d, rng, KvFormats { k: fk, v: fv }, &seqs, (hq, hkv, page), n_split, special, tol)?
        }
        Op::W4Gemv { m, out, inp, asym, perm, bf16 } => w4_gemv_case(k, &s, d, rng, m, out, inp, asym, perm, bf16)?,
        Op::W4GemvMulti { m, ref outs, inp, asym, bf16 } => {
            w4_gemv_multi_case(k, &s, d, rng, m, outs, inp, asym, bf16)?
        }
        Op::W4Fold { m, hidden, pin, ref outs, asym, bf16, thin } => {
            w4_fold_case(k, &s, d, rng, m, (hidden, pin), outs, asym, bf16, thin)?
        }
        Op::W4Dequant { out, inp, r0, r1, asym, perm } => w4_dequant_case(k, &s, d, rng, out, inp, r0, r1, asym, perm)?,
        Op::W4Quantize { out, inp, asym } => w4_quantize_case(k, &s, d, rng, out, inp, asym)?,
        Op::Gemm { m, n, k: kk } => {
            let x = randv(rng, n * kk, 1.0);
            let w = randv(rng, m * kk, 0.05);
            let ws_bytes = gemm::recommended_workspace_bytes(rt);
            let ws = deltaserve_cuda::DevSpan { ptr: d.alloc(ws_bytes)?, bytes: ws_bytes };
            let g = gemm::Gemm::new(rt, ws)?;
            let (xp, wp, yp) = (d.bf16(&x)?, d.bf16(&w)?, d.poison(2 * n * m)?);
            g.prepare(m, n, kk)?;
            let before = g.heuristic_calls();
            g.linear(&s, xp, wp, yp, n, m, kk)?;
            let r = cpu::linear::linear(&x, n, &w, m, kk);
            let mut v = vec![compare("y", &r, &d.get_bf16(yp, n * m)?, tol)];
            if g.heuristic_calls() != before {
                v.push(Outcome::error("heuristic ran on the hot path".into()));
            }
            v
        }
        Op::Gemv { n, ms, k: kk, f32_out } => {
            // Poisoned outputs, CPU reference per matrix; then token 0 alone (n = 1) must give
            // bitwise the same row as in the n-token launch.
            let x = randv(rng, n * kk, 1.0);
            let xp = d.bf16(&x)?;
            let eb = if f32_out { 4 } else { 2 };
            let mut outs = Vec::new();
            let mut singles = Vec::new();
            let mut refs = Vec::new();
            for &m in &ms {
                let w = randv(rng, m * kk, 0.05);
                let wp = d.bf16(&w)?;
                outs.push(ops::gemv::GemvOut { w: wp, y: d.poison(eb * n * m)?, m });
                singles.push(ops::gemv::GemvOut { w: wp, y: d.poison(eb * m)?, m });
                refs.push(cpu::linear::linear(&x, n, &w, m, kk));
            }
            ops::gemv::gemv(k, &s, xp, n, kk, &outs, f32_out)?;
            ops::gemv::gemv(k, &s, xp, 1, kk, &singles, f32_out)?;
            let get = |p: u64, len: usize| if f32_out { d.get_f32(p, len) } else { d.get_bf16(p, len) };
            let mut v = Vec::new();
            for ((o, one), r) in outs.iter().zip(&singles).zip(&refs) {
                let got = get(o.y, n * o.m)?;
                v.push(compare(&format!("y[{n}, {}]", o.m), r, &got, tol));
                let alone = get(one.y, o.m)?;
                if alone.iter().zip(&got).any(|(a, b)| a.to_bits() != b.to_bits()) {
                    v.push(Outcome::error(format!("m={}: token 0 at n=1 differs from n={n}", o.m)));
                }
            }
            v
        }
    };
    rt.synchronize()?;
    Ok(out)
}

/// Which DeltaNet core kernel [`gdn_case`] runs.
enum GdnMode {
    Chunked(gdn_chunk::Precision),
    /// One token per sequence.
    Decode,
    /// gdn_recurrent: verify (None) or commit of the first `accept[b]` rows.
    Recurrent(Option<Vec<usize>>),
}

/// DeltaNet core: random normalised q/k (as gdn_gate writes them), v, g, beta and a random
/// carried state in shuffled slots; the `mode`'s kernel vs cpu::gdn::gdn_recurrent.
#[allow(clippy::too_many_arguments)]
fn gdn_case(
    k: &Kernels,
    s: &std::sync::Arc<cudarc::driver::CudaStream>,
    d: &mut Dev,
    rng: &mut StdRng,
    lens: &[usize],
    hk: usize,
    hv: usize,
    tol: Tol,
    mode: GdnMode,
) -> R<Vec<Outcome>> {
    let (dk, dv) = (k.dims.gdn_k_dim, k.dims.gdn_v_dim);
    let t: usize = lens.iter().sum();
    let nb = lens.len();
    let mut q = randv(rng, t * hk * dk, 1.0);
    let mut kk = randv(rng, t * hk * dk, 1.0);
    cpu::norm::l2_norm(&mut q, dk, 1e-6);
    cpu::norm::l2_norm(&mut kk, dk, 1e-6);
    let q: Vec<f32> = q.iter().map(|v| rb(v / (dk as f32).sqrt())).collect();
    let kk: Vec<f32> = kk.iter().map(|&v| rb(v)).collect();
    // v lives inside a wider conv-output row, like the real layout.
    let v_stride = hv * dv + 64;
    let vrow = randv(rng, t * v_stride, 1.0);
    let g: Vec<f32> = (0..t * hv).map(|_| -rng.random_range(0.0f32..1.5).powi(2)).collect();
    let beta: Vec<f32> = (0..t * hv).map(|_| rng.random_range(0.05..0.95)).collect();
    let n_state = hv * dk * dv;
    let st0: Vec<f32> = (0..nb * n_state).map(|_| rng.random_range(-0.5..0.5)).collect();
    let n_slots = nb + 2;
    // A permutation of 1..=nb (slot 0 and nb+1 unused), reversed against the batch order.
    let slots: Vec<i32> = (0..nb).map(|b| (nb - b) as i32).collect();
    let mut st_dev = vec![0f32; n_slots * n_state];
    for (b, &sl) in slots.iter().enumerate() {
        st_dev[sl as usize * n_state..][..n_state].copy_from_slice(&st0[b * n_state..][..n_state]);
    }
    let cu = cu_of(lens);
    let (qp, kp, vp, gp, bp) = (d.bf16(&q)?, d.bf16(&kk)?, d.bf16(&vrow)?, d.f32s(&g)?, d.f32s(&beta)?);
    let (sp, cup, slp, op) = (d.f32s(&st_dev)?, d.i32s(&cu)?, d.i32s(&slots)?, d.poison(2 * t * hv * dv)?);
    let dec = gdn_decode::GdnDecode {
        q: qp,
        k: kp,
        v: vp,
        v_stride,
        g: gp,
        beta: bp,
        state: sp,
        slots: slp,
        o: op,
        n_seqs: nb,
        hk,
        hv,
    };
    let mut extra = Vec::new();
    // Rows of each sequence the state advances by (and whose outputs are compared).
    let used: Vec<usize> = match &mode {
        GdnMode::Recurrent(Some(a)) => a.clone(),
        _ => lens.to_vec(),
    };
    if let GdnMode::Chunked(prec) = mode {
        let table = gdn_chunk::chunk_table(&cu);
        let ws_bytes = gdn_chunk::workspace_bytes(t, hv, &k.dims);
        let (tp, wsp) = (d.i32s(&table)?, d.poison(ws_bytes)?);
        let a = gdn_chunk::GdnChunk {
            q: qp,
            k: kp,
            v: vp,
            v_stride,
            g: gp,
            beta: bp,
            state: sp,
            cu_seqlens: cup,
            slots: slp,
            chunk_table: tp,
            n_chunks: table.len() / 2,
            o: op,
            workspace: wsp,
            workspace_bytes: ws_bytes,
            n_seqs: nb,
            t,
            hk,
            hv,
        };
        gdn_chunk::gdn_chunk_with(k, s, &a, prec)?;
    } else if let GdnMode::Recurrent(accept) = &mode {
        // A verify takes its rows from cu_seqlens (lens 0), a commit from starts + lens.
        let lens_i: Vec<i32> = used.iter().map(|&x| x as i32).collect();
        let r = gdn_decode::GdnRecurrent {
            d: dec,
            starts: d.i32s(&cu)?,
            lens: if accept.is_some() { d.i32s(&lens_i)? } else { 0 },
            write_state: accept.is_some(),
        };
        gdn_decode::gdn_recurrent(k, s, &r)?;
        if accept.is_some() {
            // The same rows through gdn_decode, one token per launch, on a copy of the state: the
            // commit must leave exactly (bit for bit) what decoding them one by one leaves.
            let sp2 = d.f32s(&st_dev)?;
            let o2 = d.poison(2 * hv * dv)?;
            for (b, &n) in used.iter().enumerate() {
                for i in 0..n {
                    let row = cu[b] as usize + i;
                    let one = gdn_decode::GdnDecode {
                        q: qp + (2 * row * hk * dk) as u64,
                        k: kp + (2 * row * hk * dk) as u64,
                        v: vp + (2 * row * v_stride) as u64,
                        g: gp + (4 * row * hv) as u64,
                        beta: bp + (4 * row * hv) as u64,
                        state: sp2,
                        slots: slp + 4 * b as u64,
                        o: o2,
                        n_seqs: 1,
                        ..dec
                    };
                    gdn_decode::gdn_decode(k, s, &one)?;
                }
            }
            let (a, b) = (d.get_f32(sp, st_dev.len())?, d.get_f32(sp2, st_dev.len())?);
            if a.iter().zip(&b).any(|(x, y)| x.to_bits() != y.to_bits()) {
                extra.push(Outcome::error("commit state differs from gdn_decode token by token".into()));
            }
        } else if d.get_f32(sp, st_dev.len())?.iter().zip(&st_dev).any(|(x, y)| x.to_bits() != y.to_bits()) {
            extra.push(Outcome::error("verify (write_state = 0) changed the state".into()));
        }
    } else {
        gdn_decode::gdn_decode(k, s, &dec)?;
    }
    let dims = cpu::gdn::GdnDims { num_k_heads: hk, num_v_heads: hv, head_k_dim: dk, head_v_dim: dv };
    let mut ro = Vec::with_capacity(t * hv * dv);
    let mut rs = st_dev.clone();
    let mut got_o = Vec::with_capacity(t * hv * dv);
    let all_o = d.get_bf16(op, t * hv * dv)?;
    for (b, &len) in used.iter().enumerate() {
        let t0 = cu[b] as usize;
        got_o.extend_from_slice(&all_o[t0 * hv * dv..][..len * hv * dv]);
        let vseq: Vec<f32> = (0..len).flat_map(|i| vrow[(t0 + i) * v_stride..][..hv * dv].to_vec()).collect();
        let inp = cpu::gdn::GdnInputs {
            q: &q[t0 * hk * dk..][..len * hk * dk],
            k: &kk[t0 * hk * dk..][..len * hk * dk],
            v: &vseq,
            g: &g[t0 * hv..][..len * hv],
            beta: &beta[t0 * hv..][..len * hv],
        };
        let mut st = st0[b * n_state..][..n_state].to_vec();
        let mut o = vec![0f32; len * hv * dv];
        cpu::gdn::gdn_recurrent(dims, &inp, &mut st, &mut o)
            .map_err(|e| deltaserve_cuda::CudaError::InvalidArgs { kernel: "cpu reference", msg: e.to_string() })?;
        ro.extend(o);
        // A verify leaves the committed state as it was.
        if !matches!(mode, GdnMode::Recurrent(None)) {
            rs[slots[b] as usize * n_state..][..n_state].copy_from_slice(&st);
        }
    }
    let mut out = vec![compare("o", &ro, &got_o, tol), compare("state", &rs, &d.get_f32(sp, rs.len())?, tol)];
    out.extend(extra);
    Ok(out)
}

/// Paged attention: random K/V for every position written with kv_write through shuffled block
/// tables, then prefill attention of the `new` queries (or decode with `n_split`).
#[allow(clippy::too_many_arguments)]
fn attn_case(
    k: &Kernels,
    s: &std::sync::Arc<cudarc::driver::CudaStream>,
    d: &mut Dev,
    rng: &mut StdRng,
    seqs: &[(usize, usize)],
    hq: usize,
    hkv: usize,
    page: usize,
    n_split: Option<usize>,
    tol: Tol,
) -> R<Vec<Outcome>> {
    let hd = k.dims.attn_head_dim;
    let width = hkv * hd;
    let nb = seqs.len();
    let totals: Vec<usize> = seqs.iter().map(|&(p, n)| p + n).collect();
    let max_blocks = totals.iter().map(|t| t.div_ceil(page)).max().unwrap_or(1);
    let num_blocks = nb * max_blocks + 3;
    // Physical blocks handed out in a scrambled order.
    let mut perm: Vec<i32> = (0..num_blocks as i32).collect();
    for i in (1..perm.len()).rev() {
        let j = rng.random_range(0..=i);
        perm.swap(i, j);
    }
    let mut bt = vec![0i32; nb * max_blocks];
    for (i, v) in bt.iter_mut().enumerate() {
        *v = perm[i];
    }
    // Write all positions of every sequence.
    let t_all: usize = totals.iter().sum();
    let kall = randv(rng, t_all * width, 2.0);
    let vall = randv(rng, t_all * width, 1.0);
    let pos_all: Vec<i32> = totals.iter().flat_map(|&t| 0..t as i32).collect();
    let cu_all = cu_of(&totals);
    let cache_bytes = 2 * num_blocks * page * width;
    let (kc, vc) = (d.poison(cache_bytes)?, d.poison(cache_bytes)?);
    let (kp, vp, pp, cap, btp) = (d.bf16(&kall)?, d.bf16(&vall)?, d.i32s(&pos_all)?, d.i32s(&cu_all)?, d.i32s(&bt)?);
    kv_cache::kv_write(
        k,
        s,
        &kv_cache::KvWrite {
            k: kp,
            k_stride: width,
            v: vp,
            v_stride: width,
            k_cache: kc,
            v_cache: vc,
            block_tables: btp,
            max_blocks,
            cu_seqlens: cap,
            positions: pp,
            n_seqs: nb,
            t: t_all,
            page,
            kv_heads: hkv,
            head_dim: hd,
        },
    )?;
    let news: Vec<usize> = seqs.iter().map(|&(_, n)| n).collect();
    let t_new: usize = news.iter().sum();
    let q = randv(rng, t_new * hq * hd, 2.0);
    let qp = d.bf16(&q)?;
    let op = d.poison(2 * t_new * hq * hd)?;
    let lens: Vec<i32> = totals.iter().map(|&t| t as i32).collect();
    let lp = d.i32s(&lens)?;
    let kv = attention::KvPages { k_cache: kc, v_cache: vc, block_tables: btp, max_blocks, page, kv_heads: hkv };
    let scale = 1.0 / (hd as f32).sqrt();
    let mut indirect = None;
    let mut gated: Option<(u64, Vec<f32>)> = None;
    match n_split {
        None => {
            let cu = cu_of(&news);
            let a = prefill_args(d, k, &cu, (qp, hq, hd), op, kv, lp, scale)?;
            attention::attn_prefill(k, s, &a)?;
        }
        Some(n_split) => {
            let bytes = attention::decode_scratch_bytes(nb, hq, n_split, hd);
            let sc = d.poison(bytes)?;
            let a = attention::AttnDecode {
                q: qp,
                q_tok: hq * hd,
                q_head: hd,
                o: op,
                kv,
                seq_lens: lp,
                table_rows: 0,
                n_seqs: nb,
                q_heads: hq,
                n_split,
                scratch: sc,
                scratch_bytes: bytes,
                scale,
                gate: 0,
            };
            attention::attn_decode(k, s, &a)?;
            // The same queries with the output gate applied in the combine step (gate rows with q's
            // strides).
            let g = randv(rng, t_new * hq * hd, 2.0);
            let gp = d.bf16(&g)?;
            let op3 = d.poison(2 * t_new * hq * hd)?;
            attention::attn_decode(k, s, &attention::AttnDecode { o: op3, gate: gp, ..a })?;
            gated = Some((op3, g));
            // The same queries through `table_rows` (the speculative verify's indirection), the block
            // table rows stored in reverse order.
            let mut bt_rev = vec![0i32; nb * max_blocks];
            for b in 0..nb {
                bt_rev[(nb - 1 - b) * max_blocks..][..max_blocks].copy_from_slice(&bt[b * max_blocks..][..max_blocks]);
            }
            let rows: Vec<i32> = (0..nb as i32).rev().collect();
            let op2 = d.poison(2 * t_new * hq * hd)?;
            let kv2 = attention::KvPages { block_tables: d.i32s(&bt_rev)?, ..kv };
            attention::attn_decode(k, s, &attention::AttnDecode { o: op2, kv: kv2, table_rows: d.i32s(&rows)?, ..a })?;
            indirect = Some(op2);
        }
    }
    let mut r = Vec::new();
    let mut qo = 0;
    for (b, &(_, n)) in seqs.iter().enumerate() {
        let t0 = cu_all[b] as usize;
        let kc = &kall[t0 * width..][..totals[b] * width];
        let vcache = &vall[t0 * width..][..totals[b] * width];
        r.extend(cpu::attention::causal_gqa_attention(&q[qo * hq * hd..][..n * hq * hd], kc, vcache, hq, hkv, hd));
        qo += n;
    }
    let mut out = vec![compare("o", &r, &d.get_bf16(op, t_new * hq * hd)?, tol)];
    if let Some(op2) = indirect {
        out.push(compare("o via table_rows", &r, &d.get_bf16(op2, t_new * hq * hd)?, tol));
    }
    if let Some((op3, g)) = gated {
        let want: Vec<f32> = r
            .iter()
            .zip(&g)
            .map(|(o, g)| {
                let g = bf16::from_f32(*g).to_f32();
                bf16::from_f32(*o).to_f32() / (1.0 + (-g).exp())
            })
            .collect();
        out.push(compare("o gated in the combine step", &want, &d.get_bf16(op3, t_new * hq * hd)?, tol));
    }
    // kv_write check: read back every written row through the block table.
    let kc_h = d.get_bf16(kc, cache_bytes / 2)?;
    let mut got = Vec::with_capacity(kall.len());
    for (b, &tot) in totals.iter().enumerate() {
        for p in 0..tot {
            let row = bt[b * max_blocks + p / page] as usize * page + p % page;
            got.extend_from_slice(&kc_h[row * width..][..width]);
        }
    }
    out.push(compare("k_cache", &kall, &got, EXACT));
    Ok(out)
}

// ---------------------------------------------------------------------------------------------
// Quantised KV cache: kv_quant.cu writes, the attention kernels reading codes + scales.

/// Host encoding of one token-head row with the CPU oracle's rules (deltaserve_cpu::kvquant):
/// (cache bytes, f16 scale bits; 0 for bf16 and all-zero rows).
fn kvq_encode(fmt: KvDtype, row: &[f32]) -> (Vec<u8>, u16) {
    use cpu::kvquant::{KvQuant, f32_to_e4m3, f32_to_f16_bits};
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
#[test]
fn kvq_host_codec_matches_kvquant() {
    use cpu::kvquant::KvQuant;
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

/// Prefill launch arguments for contiguous q `[t, hq, hd]` (device pointer qp) over `kv`, with the
/// tile table of the kernels `k` for the query offsets `cu` (uploaded here).
#[allow(clippy::too_many_arguments)]
fn prefill_args(
    d: &mut Dev,
    k: &Kernels,
    cu: &[i32],
    (qp, hq, hd): (u64, usize, usize),
    o: u64,
    kv: attention::KvPages,
    seq_lens: u64,
    scale: f32,
) -> R<attention::AttnPrefill> {
    let table = attention::tile_table(k, cu);
    let (cu_seqlens, tile_table) = (d.i32s(cu)?, d.i32s(&table)?);
    Ok(attention::AttnPrefill {
        q: qp,
        q_tok: hq * hd,
        q_head: hd,
        o,
        kv,
        cu_seqlens,
        seq_lens,
        tile_table,
        n_tiles: table.len() / 2,
        q_heads: hq,
        scale,
    })
}

#[allow(clippy::too_many_arguments)]
fn kvq_case(
    rt: &Runtime,
    k: &Kernels,
    s: &cudarc::driver::CudaStream,
    d: &mut Dev,
    rng: &mut StdRng,
    kv: KvFormats,
    seqs: &[(usize, usize)],
    (hq, hkv, page): (usize, usize, usize),
    n_split: Option<usize>,
    special: bool,
    tol: Tol,
) -> R<Vec<Outcome>> {
    use cpu::kvquant::{KvQuant, f32_to_f16_bits};
    let hd = k.dims.attn_head_dim;
    let width = hkv * hd;
    let nb = seqs.len();
    let totals: Vec<usize> = seqs.iter().map(|&(p, n)| p + n).collect();
    let max_blocks = totals.iter().map(|t| t.div_ceil(page)).max().unwrap_or(1);
    let num_blocks = nb * max_blocks + 3;
    let mut perm: Vec<i32> = (0..num_blocks as i32).collect();
    for i in (1..perm.len()).rev() {
        let j = rng.random_range(0..=i);
        perm.swap(i, j);
    }
    let bt: Vec<i32> = perm[..nb * max_blocks].to_vec();
    let t_all: usize = totals.iter().sum();
    let mut kall = randv(rng, t_all * width, 2.0);
    let mut vall = randv(rng, t_all * width, 1.0);
    if special {
        // Rows (token-heads) with special contents, cycling through the kinds.
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
        for (r, row) in kall.chunks_mut(hd).enumerate().filter(|(r, _)| r % 3 == 0) {
            kinds(r / 3, row, rng);
        }
        for (r, row) in vall.chunks_mut(hd).enumerate().filter(|(r, _)| r % 3 == 1) {
            kinds(r / 3 + 1, row, rng);
        }
    }
    let pos_all: Vec<i32> = totals.iter().flat_map(|&t| 0..t as i32).collect();
    let cu_all = cu_of(&totals);
    let rows = num_blocks * page * hkv;
    let (krb, vrb) = (ops::kv_quant::row_bytes(kv.k, hd), ops::kv_quant::row_bytes(kv.v, hd));
    let (kc, vc) = (d.poison(rows * krb)?, d.poison(rows * vrb)?);
    let (ksc, vsc) = (d.poison(2 * rows)?, d.poison(2 * rows)?);
    let (kp, vp, pp, cap, btp) = (d.bf16(&kall)?, d.bf16(&vall)?, d.i32s(&pos_all)?, d.i32s(&cu_all)?, d.i32s(&bt)?);
    let tensor = |data, scales, fmt| ops::kv_quant::KvTensor { data, scales, fmt };
    let layer = ops::kv_quant::LayerKv { k: tensor(kc, ksc, kv.k), v: tensor(vc, vsc, kv.v) };
    ops::kv_quant::kv_write_q(
        k,
        s,
        &ops::kv_cache::KvWrite {
            k: kp,
            k_stride: width,
            v: vp,
            v_stride: width,
            k_cache: 0,
            v_cache: 0,
            block_tables: btp,
            max_blocks,
            cu_seqlens: cap,
            positions: pp,
            n_seqs: nb,
            t: t_all,
            page,
            kv_heads: hkv,
            head_dim: hd,
        },
        &layer,
    )?;
    rt.synchronize()?;

    // The write: bytes and scale bits of every written row against the host encoding, and the
    // host-decoded values against the CPU oracle's quantize_row (value equality: -0 == 0).
    let mut out = Vec::new();
    for (what, fmt, all, cache, scales, rowb) in [("K", kv.k, &kall, kc, ksc, krb), ("V", kv.v, &vall, vc, vsc, vrb)] {
        let mut bytes = vec![0u8; rows * rowb];
        let mut sbits = vec![0u16; rows];
        rt.download(&mut bytes, cache)?;
        rt.download(&mut sbits, scales)?;
        let (mut bad_codes, mut bad_scales, mut bad_values, mut first) = (0usize, 0usize, 0usize, String::new());
        for (b, &tot) in totals.iter().enumerate() {
            for p in 0..tot {
                let row = bt[b * max_blocks + p / page] as usize * page + p % page;
                for h in 0..hkv {
                    let x = &all[(cu_all[b] as usize + p) * width + h * hd..][..hd];
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
        out.push(Outcome {
            ok: bad_codes + bad_scales + bad_values == 0,
            detail: format!(
                "{what} {}: {} rows; {bad_codes} with other codes, {bad_scales} other scales, {bad_values} \
                 decoding other than kvquant{first}",
                fmt.name(),
                t_all * hkv
            ),
        });
    }
    if special {
        return Ok(out);
    }

    // Attention over the cache with kernels compiled for its formats.
    let mut kq = Kernels::load_kv(rt, k.dims, kv)?;
    let news: Vec<usize> = seqs.iter().map(|&(_, n)| n).collect();
    let t_new: usize = news.iter().sum();
    let q = randv(rng, t_new * hq * hd, 2.0);
    let qp = d.bf16(&q)?;
    let op = d.poison(2 * t_new * hq * hd)?;
    let lens: Vec<i32> = totals.iter().map(|&t| t as i32).collect();
    let lp = d.i32s(&lens)?;
    let pages = attention::KvPages { k_cache: kc, v_cache: vc, block_tables: btp, max_blocks, page, kv_heads: hkv };
    let scales = attention::KvScales { k: ksc, v: vsc };
    let scale = 1.0 / (hd as f32).sqrt();
    // Prefill also runs on attn_prefill (the kernel of GPUs without room for the wide one) into op2.
    let mut op2 = None;
    match n_split {
        None => {
            let cu = cu_of(&news);
            let pair = AttnTiling { keys: 32, wide: false, ..AttnTiling::DEFAULT };
            let kp = Kernels::load_tiled(rt, k.dims, kv, pair)?;
            let o2 = d.poison(2 * t_new * hq * hd)?;
            for (kk, o) in [(&kq, op), (&kp, o2)] {
                let a = prefill_args(d, kk, &cu, (qp, hq, hd), o, pages, lp, scale)?;
                attention::attn_prefill_q(kk, s, &a, &scales)?;
            }
            op2 = Some(o2);
        }
        Some(n_split) => {
            let bytes = attention::decode_scratch_bytes(nb, hq, n_split, hd);
            let sc = d.poison(bytes)?;
            let a = attention::AttnDecode {
                q: qp,
                q_tok: hq * hd,
                q_head: hd,
                o: op,
                kv: pages,
                seq_lens: lp,
                table_rows: 0,
                n_seqs: nb,
                q_heads: hq,
                n_split,
                scratch: sc,
                scratch_bytes: bytes,
                scale,
                gate: 0,
            };
            attention::attn_decode_q(&kq, s, &a, &scales)?;
            if kq.decode_mma {
                // The tensor-core kernel ran; the split kernel (its A/B switch) into op2.
                kq.decode_mma = false;
                let o2 = d.poison(2 * t_new * hq * hd)?;
                attention::attn_decode_q(&kq, s, &attention::AttnDecode { o: o2, ..a }, &scales)?;
                op2 = Some(o2);
            }
        }
    }
    // Reference: the CPU attention over the CPU-dequantised cache.
    kv.k.quantize_rows(&mut kall, hd);
    kv.v.quantize_rows(&mut vall, hd);
    let mut r = Vec::new();
    let mut qo = 0;
    for (b, &(_, n)) in seqs.iter().enumerate() {
        let t0 = cu_all[b] as usize;
        let kcache = &kall[t0 * width..][..totals[b] * width];
        let vcache = &vall[t0 * width..][..totals[b] * width];
        r.extend(cpu::attention::causal_gqa_attention(&q[qo * hq * hd..][..n * hq * hd], kcache, vcache, hq, hkv, hd));
        qo += n;
    }
    out.push(compare("o", &r, &d.get_bf16(op, t_new * hq * hd)?, tol));
    if let Some(op2) = op2 {
        let what = if n_split.is_some() { "o (attn_decode_split)" } else { "o (attn_prefill)" };
        out.push(compare(what, &r, &d.get_bf16(op2, t_new * hq * hd)?, tol));
    }
    Ok(out)
}

// ---------------------------------------------------------------------------------------------
// ---------------------------------------------------------------------------------------------
// W4A16: 4-bit weights in the device format of deltaserve_cuda::w4 (host oracle there).

/// A random int4 linear: random quants, scales of both signs (fp16 or bf16), random zero points
/// (asym), a random act-order permutation (perm).
fn w4_random(rng: &mut StdRng, out: usize, inp: usize, asym: bool, perm: bool, bf16_scales: bool) -> W4Linear {
    let groups = inp / 128;
    let q: Vec<u8> = (0..out * inp).map(|_| rng.random_range(0..16u8)).collect();
    let scales = (0..groups * out)
        .map(|_| {
            let v = rng.random_range(2e-3f32..2e-2) * if rng.random_range(0..4) == 0 { -1.0 } else { 1.0 };
            if bf16_scales { bf16::from_f32(v).to_bits() } else { half::f16::from_f32(v).to_bits() }
        })
        .collect();
    let zeros = asym.then(|| {
        let z: Vec<u8> = (0..groups * out).map(|_| rng.random_range(0..16u8)).collect();
        W4Linear::pack_zeros(out, groups, &z)
    });
    let perm = perm.then(|| {
        let mut p: Vec<i32> = (0..inp as i32).collect();
        for i in (1..inp).rev() {
            p.swap(i, rng.random_range(0..=i));
        }
        p
    });
    W4Linear {
        out_features: out,
        in_features: inp,
        qweight: W4Linear::pack_quants(out, inp, &q),
        scales,
        scale_dtype: if bf16_scales { ScaleDtype::Bf16 } else { ScaleDtype::F16 },
        zeros,
        perm,
    }
}

fn w4_upload(d: &mut Dev, l: &W4Linear) -> R<w4a16::W4Weights> {
    let qweight = d.alloc(4 * l.qweight.len())?;
    d.rt.upload(qweight, &l.qweight)?;
    let scales = d.alloc(2 * l.scales.len())?;
    d.rt.upload(scales, &l.scales)?;
    let zeros = match &l.zeros {
        Some(z) => {
            let p = d.alloc(z.len())?;
            d.rt.upload(p, z)?;
            Some(p)
        }
        None => None,
    };
    let perm = match &l.perm {
        Some(p) => Some(d.i32s(p)?),
        None => None,
    };
    Ok(w4a16::W4Weights {
        qweight,
        scales,
        scale_dtype: l.scale_dtype,
        zeros,
        perm,
        out: l.out_features,
        inp: l.in_features,
    })
}

/// GEMV vs the CPU matmul with the dequantised f32 weights, x with a padded row stride, for every
/// warps-per-pair choice and f32 outputs; then token 0 alone must give bitwise the same row as
/// in the m-token launch (default configuration).
#[allow(clippy::too_many_arguments)]
fn w4_gemv_case(
    k: &Kernels,
    s: &std::sync::Arc<cudarc::driver::CudaStream>,
    d: &mut Dev,
    rng: &mut StdRng,
    m: usize,
    out: usize,
    inp: usize,
    asym: bool,
    perm: bool,
    bf16_scales: bool,
) -> R<Vec<Outcome>> {
    let l = w4_random(rng, out, inp, asym, perm, bf16_scales);
    let w = w4_upload(d, &l)?;
    let (ldx, ldy) = (inp + 8, out + 3);
    let x = randv(rng, m * ldx, 1.0);
    let xc: Vec<f32> = x.chunks(ldx).flat_map(|r| r[..inp].to_vec()).collect();
    let r = cpu::linear::linear(&xc, m, &l.dequantize(), out, inp);
    let xp = d.bf16(&x)?;
    let scratch = d.alloc(2 * 8 * inp)?;
    let auto = w4a16::gemv_config(out, inp, k.w4_slots);
    let mut v = Vec::new();
    let mut first = Vec::new();
    // Every warps-per-pair, and a thin last wave split off (2 warps per pair, 4 pairs a block, one
    // block fewer slots than blocks: the last block's pairs run with 8 warps per pair, from a row
    // offset, with the partial last pair when out % 32 != 0).
    let thin = w4a16::GemvConfig { wpt: 2, slots: out.div_ceil(32).div_ceil(4).saturating_sub(1) };
    let cfgs = [1usize, 2, 4, 8].map(|wpt| w4a16::GemvConfig { wpt, slots: 0 });
    for cfg in cfgs.into_iter().chain([thin, auto]) {
        let yp = d.poison(2 * m * ldy)?;
        w4a16::w4_gemv(k, s, &w, xp, ldx, yp, ldy, m, cfg, Some(scratch))?;
        let y = d.get_bf16(yp, m * ldy)?;
        let y: Vec<f32> = y.chunks(ldy).flat_map(|r| r[..out].to_vec()).collect();
        let segs = w4a16::launch_segments(&[out.div_ceil(32)], inp / 128, cfg);
        let split = segs.get(1).map_or(String::new(), |t| format!(" + last {} pairs at {}", t.pairs, t.wpt));
        let tag = format!("y wpt={}{split}{}", cfg.wpt, if cfg == auto { " (default)" } else { "" });
        v.push(compare(&tag, &r, &y, ACCUM));
        if cfg == auto {
            first = y[..out].to_vec();
        }
    }
    // f32 outputs (int4 lm_head logits).
    let yp = d.poison(4 * m * ldy)?;
    w4a16::w4_gemv_out(k, s, &w, xp, ldx, yp, ldy, m, auto, Some(scratch), true)?;
    let y = d.get_f32(yp, m * ldy)?;
    let y: Vec<f32> = y.chunks(ldy).flat_map(|r| r[..out].to_vec()).collect();
    v.push(compare(&format!("y f32 wpt={}", auto.wpt), &r, &y, ACCUM));
    let yp = d.poison(2 * ldy)?;
    w4a16::w4_gemv(k, s, &w, xp, ldx, yp, ldy, 1, auto, Some(scratch))?;
    let y1 = d.get_bf16(yp, out)?;
    let same = y1.iter().zip(&first).all(|(a, b)| a.to_bits() == b.to_bits());
    v.push(Outcome { ok: same, detail: format!("token 0 alone bitwise equal to the {m}-token launch: {same}") });
    Ok(v)
}

#[allow(clippy::too_many_arguments)]
fn w4_gemv_multi_case(
    k: &Kernels,
    s: &std::sync::Arc<cudarc::driver::CudaStream>,
    d: &mut Dev,
    rng: &mut StdRng,
    m: usize,
    outs: &[usize],
    inp: usize,
    asym: bool,
    bf16_scales: bool,
) -> R<Vec<Outcome>> {
    let ls: Vec<W4Linear> = outs.iter().map(|&o| w4_random(rng, o, inp, asym, false, bf16_scales)).collect();
    let ws = ls.iter().map(|l| w4_upload(d, l)).collect::<R<Vec<_>>>()?;
    let ldx = inp + 8;
    let x = randv(rng, m * ldx, 1.0);
    let xc: Vec<f32> = x.chunks(ldx).flat_map(|r| r[..inp].to_vec()).collect();
    let xp = d.bf16(&x)?;
    let cfg = w4a16::gemv_config(outs.iter().sum(), inp, k.w4_slots);
    let ys = outs.iter().map(|&o| d.poison(2 * m * (o + 1))).collect::<R<Vec<_>>>()?;
    let wo: Vec<w4a16::W4Out<'_>> = ws.iter().zip(&ys).map(|(w, &y)| w4a16::W4Out { w, y, ldy: w.out + 1 }).collect();
    w4a16::w4_gemv_multi(k, s, &wo, xp, ldx, m, cfg, false)?;
    // The linears part of which the shared launch ran in its thin-wave tail.
    let pairs: Vec<usize> = outs.iter().map(|o| o.div_ceil(32)).collect();
    let segs = w4a16::launch_segments(&pairs, inp / 128, cfg);
    let mut v = Vec::new();
    for (i, (l, w)) in ls.iter().zip(&ws).enumerate() {
        let ldy = w.out + 1;
        let r = cpu::linear::linear(&xc, m, &l.dequantize(), w.out, inp);
        let y = d.get_bf16(ys[i], m * ldy)?;
        let y: Vec<f32> = y.chunks(ldy).flat_map(|r| r[..w.out].to_vec()).collect();
        v.push(compare(&format!("y{i} [{}, {inp}] wpt={}", w.out, cfg.wpt), &r, &y, ACCUM));
        let yp = d.poison(2 * m * ldy)?;
        w4a16::w4_gemv(k, s, w, xp, ldx, yp, ldy, m, cfg, None)?;
        let alone = d.get_bf16(yp, m * ldy)?;
        let alone: Vec<f32> = alone.chunks(ldy).flat_map(|r| r[..w.out].to_vec()).collect();
        // Bitwise equal unless the shared launch ran part of this linear in its thin-wave tail.
        if segs.iter().any(|s| s.linear == i && s.wpt != cfg.wpt) {
            v.push(compare(&format!("y{i} (thin-wave tail) vs its own launch"), &alone, &y, ACCUM));
        } else {
            let same = alone.iter().zip(&y).all(|(a, b)| a.to_bits() == b.to_bits());
            v.push(Outcome { ok: same, detail: format!("y{i} bitwise equal to its own launch: {same}") });
        }
    }
    Ok(v)
}

/// The folded pair of projections (producer into the residual stream, consumers after the norm) vs the
/// same kernels unfolded with add_rms_norm_1p between them: the residual bitwise (the producer's
/// configuration is the same), the norm's input bitwise vs bf16(h · (1 + w)) on the host, the sums of
/// squares vs the host's. The consumers' outputs of both paths against the host's f64 product with the
/// exact normed x: each within FOLD_X (both round x to bf16, at different points), and the folded
/// error's RMS within 1.2× the unfolded one's (the fold is as accurate as the norm kernel).
#[allow(clippy::too_many_arguments)]
fn w4_fold_case(
    k: &Kernels,
    s: &std::sync::Arc<cudarc::driver::CudaStream>,
    d: &mut Dev,
    rng: &mut StdRng,
    m: usize,
    (hidden, pin): (usize, usize),
    outs: &[usize],
    asym: bool,
    bf16_scales: bool,
    thin: bool,
) -> R<Vec<Outcome>> {
    const EPS: f32 = 1e-6;
    let pl = w4_random(rng, hidden, pin, asym, false, bf16_scales);
    let pw = w4_upload(d, &pl)?;
    let ls: Vec<W4Linear> = outs.iter().map(|&o| w4_random(rng, o, hidden, asym, false, bf16_scales)).collect();
    let ws = ls.iter().map(|l| w4_upload(d, l)).collect::<R<Vec<_>>>()?;
    let xp_host = randv(rng, m * pin, 1.0);
    let res = randv(rng, m * hidden, 2.0);
    let nw = randv(rng, hidden, 0.5);
    let (xp, nwp) = (d.bf16(&xp_host)?, d.bf16(&nw)?);
    let pcfg = if thin {
        w4a16::GemvConfig { wpt: 2, slots: hidden.div_ceil(32).div_ceil(4).saturating_sub(1) }
    } else {
        w4a16::gemv_config(hidden, pin, k.w4_slots)
    };
    let ccfg = w4a16::gemv_config(outs.iter().sum(), hidden, k.w4_slots);
    let ys = |d: &mut Dev| outs.iter().map(|&o| d.poison(2 * m * o)).collect::<R<Vec<_>>>();
    let wo = |ys: &[u64]| -> Vec<w4a16::W4Out<'_>> {
        ws.iter().zip(ys).map(|(w, &y)| w4a16::W4Out { w, y, ldy: w.out }).collect()
    };
    // Unfolded: producer -> add_rms_norm_1p -> consumers.
    let (mixer, res_u, normed) = (d.poison(2 * m * hidden)?, d.bf16(&res)?, d.poison(2 * m * hidden)?);
    w4a16::w4_gemv(k, s, &pw, xp, pin, mixer, hidden, m, pcfg, None)?;
    ops::norm::add_rms_norm_1p(k, s, mixer, Some(res_u), nwp, Some(res_u), normed, m, hidden, EPS)?;
    let yu = ys(d)?;
    w4a16::w4_gemv_multi(k, s, &wo(&yu), normed, hidden, m, ccfg, false)?;
    // Folded.
    let (res_f, fx) = (d.bf16(&res)?, d.poison(2 * m * hidden)?);
    let sums = d.poison(w4a16::fold_sums_bytes(hidden))?;
    let prod = [w4a16::W4Out { w: &pw, y: res_f, ldy: hidden }];
    let fold = w4a16::Fold::Residual { x_out: fx, norm_w: nwp, sums };
    w4a16::w4_gemv_fold(k, s, &prod, xp, pin, m, pcfg, fold)?;
    let yf = ys(d)?;
    w4a16::w4_gemv_fold(k, s, &wo(&yf), fx, hidden, m, ccfg, w4a16::Fold::Norm { sums, eps: EPS })?;

    let mut v = Vec::new();
    let h = d.get_bf16(res_u, m * hidden)?;
    let hf = d.get_bf16(res_f, m * hidden)?;
    let same = h.iter().zip(&hf).all(|(a, b)| a.to_bits() == b.to_bits());
    v.push(Outcome { ok: same, detail: format!("residual bitwise equal to add_rms_norm_1p's: {same}") });
    let want_x: Vec<f32> = h.iter().enumerate().map(|(i, &x)| rb(x * (1.0 + nw[i % hidden]))).collect();
    let got_x = d.get_bf16(fx, m * hidden)?;
    let same = want_x.iter().zip(&got_x).all(|(a, b)| a.to_bits() == b.to_bits());
    v.push(Outcome { ok: same, detail: format!("norm input bitwise bf16(h (1 + w)): {same}") });
    let pairs = hidden.div_ceil(32);
    let sv = d.get_f32(sums, pairs * 8)?;
    let got_ss: Vec<f32> = (0..m).map(|t| (0..pairs).map(|p| sv[8 * p + t]).sum()).collect();
    let want_ss: Vec<f32> =
        h.chunks(hidden).map(|r| r.iter().map(|x| (*x as f64).powi(2)).sum::<f64>() as f32).collect();
    v.push(compare("sums of squares", &want_ss, &got_ss, Tol { atol_rms: 0.0, atol_abs: 0.0, rtol: 1e-5 }));
    // The exact normed x (f64) from the GPU's h.
    let xn: Vec<f64> = h
        .chunks(hidden)
        .flat_map(|r| {
            let ms = r.iter().map(|x| (*x as f64).powi(2)).sum::<f64>() / hidden as f64;
            let inv = 1.0 / (ms + EPS as f64).sqrt();
            r.iter().zip(&nw).map(move |(x, w)| *x as f64 * inv * (1.0 + *w as f64))
        })
        .collect();
    let (mut se_u, mut se_f) = (0f64, 0f64);
    for (i, (l, o)) in ls.iter().zip(outs).enumerate() {
        let wd = l.dequantize();
        let r: Vec<f32> = (0..m * o)
            .map(|k| {
                let (t, row) = (k / o, k % o);
                let xr = &xn[t * hidden..(t + 1) * hidden];
                wd[row * hidden..(row + 1) * hidden].iter().zip(xr).map(|(w, x)| *w as f64 * x).sum::<f64>() as f32
            })
            .collect();
        let (a, b) = (d.get_bf16(yu[i], m * o)?, d.get_bf16(yf[i], m * o)?);
        se_u += r.iter().zip(&a).map(|(r, y)| ((r - y) as f64).powi(2)).sum::<f64>();
        se_f += r.iter().zip(&b).map(|(r, y)| ((r - y) as f64).powi(2)).sum::<f64>();
        v.push(compare(&format!("y{i} [{o}, {hidden}] unfolded vs exact"), &r, &a, FOLD_X));
        v.push(compare(&format!("y{i} [{o}, {hidden}] folded vs exact"), &r, &b, FOLD_X));
    }
    let ok = se_f <= 1.44 * se_u;
    v.push(Outcome {
        ok,
        detail: format!("error RMS folded / unfolded = {:.3} (at most 1.2)", (se_f / se_u.max(1e-30)).sqrt()),
    });
    Ok(v)
}

/// DeltaNet gate arguments for `t` rows: q|k read from `qk` (row stride `qk_stride`), b and a from
/// one `[t, 2·hv]` bf16 buffer `ba` ([b | a] per row, like the fused projection), outputs
/// `[q, k, g, beta]`.
#[allow(clippy::too_many_arguments)]
fn gate_args(
    qk: u64,
    qk_stride: usize,
    ba: u64,
    a_log: u64,
    dt_bias: u64,
    [q_out, k_out, g, beta]: [u64; 4],
    t: usize,
    hk: usize,
    hv: usize,
) -> gdn_gate::GdnGate {
    gdn_gate::GdnGate {
        qk,
        qk_stride,
        b: ba,
        b_stride: 2 * hv,
        a: ba + 2 * hv as u64,
        a_stride: 2 * hv,
        a_log,
        dt_bias,
        q_out,
        k_out,
        g,
        beta,
        t,
        hk,
        hv,
    }
}

/// Bit-exact comparison of 16-bit patterns.
fn same_bits(what: &str, want: &[u16], got: &[u16]) -> Outcome {
    let bad = want.iter().zip(got).filter(|(a, b)| a != b).count() + want.len().abs_diff(got.len());
    let first = want.iter().zip(got).position(|(a, b)| a != b);
    Outcome { ok: bad == 0, detail: format!("{what}: {} values, {bad} differ (first at {first:?})", want.len()) }
}

#[allow(clippy::too_many_arguments)]
fn w4_dequant_case(
    k: &Kernels,
    s: &std::sync::Arc<cudarc::driver::CudaStream>,
    d: &mut Dev,
    rng: &mut StdRng,
    out: usize,
    inp: usize,
    r0: usize,
    r1: usize,
    asym: bool,
    perm: bool,
) -> R<Vec<Outcome>> {
    let l = w4_random(rng, out, inp, asym, perm, false);
    let w = w4_upload(d, &l)?;
    let ldd = inp + 8;
    let dp = d.poison(2 * (r1 - r0) * ldd)?;
    w4a16::w4_dequant(k, s, &w, r0, r1, dp, ldd)?;
    let mut got = vec![0u16; (r1 - r0) * ldd];
    d.rt.download(&mut got, dp)?;
    let got: Vec<u16> = got.chunks(ldd).flat_map(|r| r[..inp].to_vec()).collect();
    Ok(vec![same_bits("bf16 rows", &l.dequantize_bf16(r0, r1), &got)])
}

/// Quantises in two row slices through a staging buffer, compares every output word with the host
/// quantiser, and checks the round trip within half a quantisation step.
fn w4_quantize_case(
    k: &Kernels,
    s: &std::sync::Arc<cudarc::driver::CudaStream>,
    d: &mut Dev,
    rng: &mut StdRng,
    out: usize,
    inp: usize,
    asym: bool,
) -> R<Vec<Outcome>> {
    let mut wv = randv(rng, out * inp, 0.05);
    wv[5] = 1.5; // an outlier
    if out > 2 {
        wv[inp..inp + 128].iter_mut().for_each(|v| *v = 0.0); // an all-zero group
        wv[2 * inp..2 * inp + 128].iter_mut().for_each(|v| *v = rb(v.abs() + 0.01)); // all positive
    }
    let host = W4Linear::quantize(&wv, out, inp, asym)?;
    let groups = inp / 128;
    let dev = w4a16::W4Weights {
        qweight: d.poison(out * inp / 2)?,
        scales: d.poison(2 * groups * out)?,
        scale_dtype: ScaleDtype::F16,
        zeros: if asym { Some(d.poison(groups * out.div_ceil(2))?) } else { None },
        perm: None,
        out,
        inp,
    };
    let ldw = inp + 8;
    let staged: Vec<f32> = wv.chunks(inp).flat_map(|r| r.iter().copied().chain(std::iter::repeat_n(0.0, 8))).collect();
    let sp = d.bf16(&staged)?;
    let half = (out / 2) & !1;
    w4a16::w4_quantize(k, s, sp, ldw, 0, half, &dev)?;
    w4a16::w4_quantize(k, s, sp + (2 * half * ldw) as u64, ldw, half, out, &dev)?;
    let mut qw = vec![0u32; out * inp / 8];
    d.rt.download(&mut qw, dev.qweight)?;
    let mut sc = vec![0u16; groups * out];
    d.rt.download(&mut sc, dev.scales)?;
    let zeros = match dev.zeros {
        Some(p) => {
            let mut z = vec![0u8; groups * out.div_ceil(2)];
            d.rt.download(&mut z, p)?;
            Some(z)
        }
        None => None,
    };
    let qbad = qw.iter().zip(&host.qweight).filter(|(a, b)| a != b).count();
    let zbad = match (&zeros, &host.zeros) {
        (Some(a), Some(b)) => a.iter().zip(b).filter(|(x, y)| x != y).count(),
        _ => 0,
    };
    let mut v = vec![
        Outcome {
            ok: qbad == 0,
            detail: format!("qweight: {} words, {qbad} differ from the host quantiser", qw.len()),
        },
        same_bits("scales", &host.scales, &sc),
        Outcome { ok: zbad == 0, detail: format!("zeros: {zbad} bytes differ from the host quantiser") },
    ];
    let gpu = W4Linear { qweight: qw, scales: sc, zeros, ..host.clone() };
    let deq = gpu.dequantize();
    let mut worst = 0f32;
    for o in 0..out {
        for i in 0..inp {
            let step = gpu.scale(i / 128, o);
            let err = (deq[o * inp + i] - wv[o * inp + i]).abs();
            worst = worst.max(if step > 0.0 {
                err / (0.5 * step)
            } else if err > 0.0 {
                f32::INFINITY
            } else {
                0.0
            });
        }
    }
    // Symmetric: within half a step. Asymmetric: the rounded zero point shifts the grid, so the
    // clamped extremes may be off by up to one step.
    let bound = if asym { 2.002 } else { 1.001 };
    v.push(Outcome {
        ok: worst <= bound,
        detail: format!("round trip: worst |w - deq(q(w))| = {worst:.4} half-steps (bound {bound})"),
    });
    Ok(v)
}

// ---------------------------------------------------------------------------------------------
// Timing (run explicitly: cargo test --release -p deltaserve-cuda --test ops -- --ignored)

#[test]
#[ignore = "benchmark; needs a GPU"]
fn bench_gdn_prefill_27b() {
    if !LibStatus::probe().driver {
        eprintln!("SKIP bench: no CUDA driver");
        return;
    }
    let rt = Runtime::open(0).expect("open device");
    let k = Kernels::load(&rt, KernelDims::QWEN35_27B).expect("load");
    println!("device {} ({})", rt.name, rt.arch());
    for prec in [gdn_chunk::Precision::Split, gdn_chunk::Precision::Bf16] {
        for (t, n_seqs) in [(4096usize, 1usize), (4096, 4), (16384, 1), (16384, 8), (65536, 1)] {
            if let Err(e) = bench_gdn(&rt, &k, t, n_seqs, prec) {
                panic!("bench failed: {e}");
            }
        }
    }
}

/// The issue #5 target, M tokens/s per layer.
const GDN_TARGET_MTOK: f64 = 8.0;

fn bench_gdn(rt: &Runtime, k: &Kernels, t: usize, n_seqs: usize, prec: gdn_chunk::Precision) -> R<()> {
    let (hk, hv) = (16usize, 48usize);
    let (dk, dv) = (k.dims.gdn_k_dim, k.dims.gdn_v_dim);
    let r = deltaserve_cuda::gdn_bench::time_gdn_prefill(rt, k, hk, hv, t, n_seqs, prec, 10)?;
    let mtok = r.mtok_per_s();
    // FLA at the nearest measured prompt length (one sequence).
    let (fla_t, fla) = deltaserve_cuda::gdn_bench::fla_h200_nearest(t / n_seqs);
    println!(
        "BENCH gdn_chunk 27B shape Hk={hk} Hv={hv} Dk={dk} Dv={dv} {prec:?} T={t} ({n_seqs} seqs): median {:.3} ms (prep {:.3} + state {:.3}) over {} runs (min {:.3}, max {:.3}) = {mtok:.2} M tokens/s per layer = {:.2}x the 8 M target, {:.2}x FLA at one {fla_t}-token sequence ({fla}); workspace {:.1} MiB ({} B/token); non-finite outputs {}",
        r.ms,
        r.prep_ms,
        r.state_ms,
        r.runs,
        r.min_ms,
        r.max_ms,
        mtok / GDN_TARGET_MTOK,
        mtok / fla,
        r.workspace_bytes as f64 / (1 << 20) as f64,
        r.workspace_bytes / t,
        r.nonfinite,
    );
    assert_eq!(r.nonfinite, 0, "non-finite DeltaNet outputs");
    Ok(())
}
