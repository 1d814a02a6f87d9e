//! The ops table: every case (a kernel, the dims it is specialised for, its inputs' shape) and the
//! tolerance its outputs are held to against the CPU reference.

use deltaserve_cuda::ops::gdn_chunk;
use deltaserve_cuda::{AttnTiling, KernelDims};
use deltaserve_plan::KvDtype;

use crate::Op;

#[derive(Clone, Copy, Debug)]
pub(crate) struct Tol {
    /// atol = atol_rms · rms(ref) + atol_abs
    pub(crate) atol_rms: f32,
    pub(crate) atol_abs: f32,
    pub(crate) rtol: f32,
}

pub(crate) const SINGLE: Tol = Tol { atol_rms: 2e-3, atol_abs: 1e-6, rtol: 8e-3 };
pub(crate) const ACCUM: Tol = Tol { atol_rms: 4e-3, atol_abs: 1e-6, rtol: 1.6e-2 };
/// A GEMV whose x was rounded to bf16 from exact values (the normed x): ~0.16% of the output RMS per
/// output from the rounding alone, so 1.2e-2 is ~7 standard deviations.
pub(crate) const FOLD_X: Tol = Tol { atol_rms: 1.2e-2, atol_abs: 1e-6, rtol: 1.6e-2 };
pub(crate) const EXACT: Tol = Tol { atol_rms: 0.0, atol_abs: 0.0, rtol: 0.0 };

pub(crate) struct Case {
    pub(crate) name: &'static str,
    pub(crate) dims: KernelDims,
    pub(crate) op: Op,
    pub(crate) tol: Tol,
}

/// Small-attention variant: head dim 128, 2 query heads per kv head, BV 16 for the chunk kernel.
pub(crate) const SMALL: KernelDims =
    KernelDims { attn_head_dim: 128, gqa_group: 2, gdn_bv: 16, ..KernelDims::QWEN35_27B };
/// Attention at the smallest head dims: no GQA (64) and a group of 8 (32).
pub(crate) const HD64_G1: KernelDims = KernelDims { attn_head_dim: 64, gqa_group: 1, ..KernelDims::QWEN35_27B };
pub(crate) const HD32_G8: KernelDims = KernelDims { attn_head_dim: 32, gqa_group: 8, ..KernelDims::QWEN35_27B };
/// Qwen3-Next's attention (head dim 256, 16 q heads over 2 kv heads): two prefill blocks per kv head.
/// The Tiny preset's attention (head dim 32, 4 q heads over 2 kv heads; the speculative tests' model).
pub(crate) const TINY_ATTN: KernelDims = KernelDims { attn_head_dim: 32, gqa_group: 2, ..KernelDims::QWEN35_27B };
/// GQA 4 at head dim 256 (the verify groups' 2-n-tile kernel).
pub(crate) const GQA4: KernelDims = KernelDims { gqa_group: 4, ..KernelDims::QWEN35_27B };
pub(crate) const NEXT_ATTN: KernelDims = KernelDims { attn_head_dim: 256, gqa_group: 8, ..KernelDims::QWEN35_27B };
/// Attention prefill with plain bf16 P (the default AttnTiling, FlashAttention's choice): P's
/// rounding (2^-9 relative) moves o by up to 2^-9 · Σ p |v| — the scale of V, not of o, which cancels
/// to ~|v| / sqrt(keys) over random keys. Measured on the H200 (bench/results/attention-pairs-h200-
/// 2026-11-29.md): absolute errors up to 0.9% (bf16 K/V) and 1.3% (quantised V, whose scale folds
/// into P before the rounding) of rms(o) on elements where o cancels, hence 2.4% of rms(o). The hi/lo
/// split (AttnTiling::p_split) is held to ACCUM.
pub(crate) const ATTN_PLAIN_P: Tol = Tol { atol_rms: 2.4e-2, atol_abs: 1e-6, rtol: 1.6e-2 };
/// ATTN_PLAIN_P over thousands of keys and millions of outputs (the fp8 case at a 3,129-token context, 5.1 M
/// elements): every prefill kernel's worst element reached 96-122% of ATTN_PLAIN_P on an H100 (the sm_80 warp-
/// pair kernel 111% on one draw) - the tail of the same rounding over 6x the elements; twice the bound.
pub(crate) const ATTN_PLAIN_P_LONG: Tol = Tol { atol_rms: 4.8e-2, atol_abs: 1e-6, rtol: 1.6e-2 };
/// DeltaNet head dims 32 (the qwen35_gva3_d32 fixture's shape): 2 warps per state block.
pub(crate) const GDN32: KernelDims = KernelDims { gdn_k_dim: 32, gdn_v_dim: 32, ..KernelDims::QWEN35_27B };
/// gdn_chunk with plain bf16 operands (Precision::Bf16, FLA-like): measured worst errors ~3% of the
/// output rms on near-zero elements (2.4x over a 3x-ACCUM bound on the H200), hence this loose bound;
/// the default Precision::Split is held to ACCUM.
pub(crate) const GDN_BF16: Tol = Tol { atol_rms: 6e-2, atol_abs: 1e-6, rtol: 6e-2 };
/// The DeltaNet state stored bf16 (`--state-dtype bf16`): the state kernels against the reference that
/// rounds where they store (the recurrent ones after every token, the chunked walk at its stores).
pub(crate) const BF16_STATE: KernelDims = KernelDims { state_bf16: true, ..KernelDims::QWEN35_27B };
/// A bf16 state rounded between rows: where the kernel and the reference straddle a rounding boundary (their
/// f32 sums in different orders), an element differs by one bf16 ulp (2^-8 of it), which the rows after mix
/// into every other element of its column. At a cut of the chunked walk: measured up to 0.9% of the state
/// rms on the H100; the recurrent kernels round after every token of a multi-token row (a state element at
/// 138% of ACCUM's bound at one seed).
pub(crate) const BF16_STATE_ROUNDED: Tol = Tol { atol_rms: 1.6e-2, ..ACCUM };
pub(crate) const SPLIT: gdn_chunk::Precision = gdn_chunk::Precision::Split;
pub(crate) const BF16: gdn_chunk::Precision = gdn_chunk::Precision::Bf16;

pub(crate) fn gdn_op(lens: &[usize], hk: usize, hv: usize, prec: gdn_chunk::Precision) -> Op {
    Op::GdnChunk { lens: lens.to_vec(), hk, hv, prec, cuts: Vec::new() }
}

/// A chunked prefill case with each sequence cut at `cuts` (snapshots inside the chunk).
pub(crate) fn gdn_cut_op(lens: &[usize], cuts: &[&[usize]], hk: usize, hv: usize) -> Op {
    let cuts = cuts.iter().map(|c| c.to_vec()).collect();
    Op::GdnChunk { lens: lens.to_vec(), hk, hv, prec: gdn_chunk::Precision::Split, cuts }
}

pub(crate) fn gdn_rows(lens: &[usize], slots: &[i32], accept: Option<&[usize]>, hk: usize, hv: usize) -> Op {
    Op::GdnRows { lens: lens.to_vec(), slots: slots.to_vec(), accept: accept.map(<[usize]>::to_vec), hk, hv }
}

pub(crate) fn commit_layers(
    lens: &[usize],
    slots: &[i32],
    accept: &[usize],
    hk: usize,
    hv: usize,
    layers: usize,
) -> Op {
    Op::GdnCommitLayers { lens: lens.to_vec(), slots: slots.to_vec(), accept: accept.to_vec(), hk, hv, layers }
}

/// A 27B-shape prefill case (24 q heads, 4 kv heads) on `attn_prefill` (the warp-pair kernel, not
/// the wide one) tiled `keys` per KV tile. (The `Op::AttnPrefill` cases run the default tiling: the
/// wide kernel on devices whose shared memory holds it, as the H200's does.)
pub(crate) fn tiled(seqs: &[(usize, usize)], page: usize, keys: usize, p_split: bool, heads: usize) -> Op {
    let tiling = AttnTiling { keys, p_split, heads, wide: false, wgmma: false, tma: false };
    Op::AttnPrefillTiled { seqs: seqs.to_vec(), hq: 24, hkv: 4, page, tiling }
}

/// A prefill case on the wide kernel at `keys` per KV tile (where the device's shared memory holds
/// it: 64 keys on the H200, where it is not the default; else the tiling falls back as
/// `Kernels::load_tiled` resolves it).
pub(crate) fn wide(seqs: &[(usize, usize)], hq: usize, hkv: usize, page: usize, keys: usize) -> Op {
    let tiling = AttnTiling { keys, p_split: false, heads: 0, wide: true, wgmma: false, tma: false };
    Op::AttnPrefillTiled { seqs: seqs.to_vec(), hq, hkv, page, tiling }
}

/// A prefill case on the warpgroup kernel (`attn_prefill_wg`, Hopper's without the TMA producer;
/// elsewhere the tiling resolves to the wide kernel and the case checks that). Quantised caches: the
/// `kv_q+attn_prefill` cases.
pub(crate) fn wg(seqs: &[(usize, usize)], hq: usize, hkv: usize, page: usize) -> Op {
    let tiling = AttnTiling { tma: false, ..AttnTiling::DEFAULT };
    Op::AttnPrefillTiled { seqs: seqs.to_vec(), hq, hkv, page, tiling }
}

/// [`wg`] on the warp-specialised kernel (`attn_prefill_ws`, a TMA producer: the default on Hopper) where
/// the page size allows its copy boxes (else `attn_prefill_wg`).
pub(crate) fn ws(seqs: &[(usize, usize)], hq: usize, hkv: usize, page: usize) -> Op {
    Op::AttnPrefillTiled { seqs: seqs.to_vec(), hq, hkv, page, tiling: AttnTiling::DEFAULT }
}

/// A quantised-KV case (see [`Op::KvQ`]).
#[allow(clippy::too_many_arguments)]
pub(crate) fn kvq(
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
pub(crate) fn qkv(
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

/// The table, in the order that gives each case its seed: the pickers, the row-wise ops and
/// DeltaNet, attention, the linears (bf16 and 4-bit), the quantised KV cache.
pub(crate) fn cases() -> Vec<Case> {
    [row_cases(), attention_cases(), linear_cases(), kv_quant_cases(), moe_cases(), vision_cases()]
        .into_iter()
        .flatten()
        .collect()
}

/// One row of the table.
pub(crate) fn c(name: &'static str, dims: KernelDims, op: Op, tol: Tol) -> Case {
    Case { name, dims, op, tol }
}

pub(crate) fn row_cases() -> Vec<Case> {
    let q = KernelDims::QWEN35_27B;
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
        c("add_rms_norm_1p", q, Op::AddRmsNorm { rows: 300, d: 5120, residual: true }, SINGLE),
        c("add_rms_norm_1p", q, Op::AddRmsNorm { rows: 257, d: 5120, residual: false }, SINGLE),
        c("add_rms_norm_1p", q, Op::AddRmsNorm { rows: 260, d: 2048, residual: true }, SINGLE),
        c("add_rms_norm_1p", q, Op::AddRmsNorm { rows: 270, d: 1000, residual: true }, SINGLE),
        c("add_rms_norm_1p", q, Op::AddRmsNorm { rows: 5, d: 5120, residual: false }, SINGLE),
        // The scalar path: a width not a multiple of 8, and one wider than the vector path holds.
        c("add_rms_norm_1p", q, Op::AddRmsNorm { rows: 3, d: 36, residual: true }, SINGLE),
        c("add_rms_norm_1p", q, Op::AddRmsNorm { rows: 2, d: 8200, residual: true }, SINGLE),
        // In place of an int4 GEMM's split-K reduce: the 27B's width at 2 and 8 splits, 16 splits (four
        // batches of loads), a width of one vector a thread.
        c("add_rms_norm_1p_parts", q, Op::AddRmsNormParts { rows: 12, d: 5120, splits: 2 }, SINGLE),
        c("add_rms_norm_1p_parts", q, Op::AddRmsNormParts { rows: 40, d: 5120, splits: 8 }, SINGLE),
        c("add_rms_norm_1p_parts", q, Op::AddRmsNormParts { rows: 3, d: 256, splits: 16 }, SINGLE),
        c("add_rms_norm_1p_parts", q, Op::AddRmsNormParts { rows: 64, d: 2048, splits: 5 }, SINGLE),
        c("rms_norm_1p_strided", q, Op::RmsNormStrided { t: 7, heads: 24, hd: 256, stride: 512 }, SINGLE),
        c("rms_norm_1p_strided", q, Op::RmsNormStrided { t: 1, heads: 4, hd: 256, stride: 256 }, SINGLE),
        c("gated_rms_norm", q, Op::GatedRmsNorm { t: 9, hv: 48, dv: 128 }, SINGLE),
        c("gated_rms_norm", q, Op::GatedRmsNorm { t: 37, hv: 5, dv: 128 }, SINGLE),
        c("gated_rms_norm", q, Op::GatedRmsNorm { t: 5, hv: 3, dv: 96 }, SINGLE),
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
        // Long steps (qk_norm_rope_vE in one piece a token, 4 rows a warp): the 27B's and the 35B-A3B's rows a
        // token, head dims 64 and 128.
        c("qk_norm_rope", q, Op::QkNormRope { t: 300, nq: 24, nkv: 4, hd: 256, rot: 64, pos0: 7 }, EXACT),
        c("qk_norm_rope", q, Op::QkNormRope { t: 260, nq: 8, nkv: 1, hd: 64, rot: 32, pos0: 260_000 }, EXACT),
        c("qk_norm_rope_kv", q, qkv(f8, f8, &[(1023, 260)], 16, 2, 256, 16, false), EXACT),
        c("qk_norm_rope_kv", q, qkv(bf, i8, &[(0, 200), (40, 90)], 8, 2, 128, 16, true), EXACT),
        c("conv_prefill", q, Op::ConvPrefill { lens: vec![1], c: 10240, saves: vec![] }, SINGLE),
        c("conv_prefill", q, Op::ConvPrefill { lens: vec![63, 64, 65], c: 10240, saves: vec![] }, SINGLE),
        c("conv_prefill", q, Op::ConvPrefill { lens: vec![2, 1, 129, 127], c: 10240, saves: vec![] }, SINGLE),
        c("conv_prefill", q, Op::ConvPrefill { lens: vec![300, 9], c: 136, saves: vec![] }, SINGLE),
        // Snapshots inside: a cut after 1 and 2 rows (part of the carried state kept), 3, and deep.
        c(
            "conv_prefill",
            q,
            Op::ConvPrefill { lens: vec![2, 40, 129], c: 10240, saves: vec![(1, 1), (2, 2), (1, 3), (2, 100)] },
            SINGLE,
        ),
        c("conv_decode", q, Op::ConvDecode { b: 5, c: 10240 }, SINGLE),
        c("gdn_gate", q, Op::GdnGate { t: 70, hk: 16, hv: 48 }, SINGLE),
        c("gdn_conv_gate_decode", q, Op::GdnConvGateDecode { slots: vec![2, -1, 0], hk: 16, hv: 48 }, EXACT),
        c("gdn_conv_gate_decode", q, Op::GdnConvGateDecode { slots: vec![1], hk: 2, hv: 6 }, EXACT),
        c("gdn_conv_gate_rows", q, Op::GdnConvGateRows { lens: vec![4], slots: vec![2], hk: 16, hv: 48 }, EXACT),
        c(
            "gdn_conv_gate_rows",
            q,
            Op::GdnConvGateRows { lens: vec![4, 1, 6], slots: vec![3, 0, 1], hk: 16, hv: 48 },
            EXACT,
        ),
        c("gdn_conv_gate_rows", q, Op::GdnConvGateRows { lens: vec![2, 3], slots: vec![1, 2], hk: 2, hv: 6 }, EXACT),
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
        // Snapshots inside chunks: cuts on and off the 64-row grid, two in one sequence, a 1-row segment.
        c("gdn_chunk", q, gdn_cut_op(&[200, 5, 130], &[&[64, 150], &[], &[1]], 16, 48), ACCUM),
        c("gdn_chunk", q, gdn_cut_op(&[65, 300], &[&[37], &[128, 129, 299]], 16, 48), ACCUM),
        c("gdn_chunk", GDN32, gdn_cut_op(&[70, 9], &[&[3], &[8]], 2, 6), ACCUM),
        // Plain bf16 operands (FLA-like): looser bound, the line reports the actual error.
        c("gdn_chunk", q, gdn_op(&[129, 1, 64, 200], 16, 48, BF16), GDN_BF16),
        c("gdn_chunk", q, gdn_op(&[1000], 16, 48, BF16), GDN_BF16),
        c("gdn_decode", q, Op::GdnDecode { b: 7, hk: 16, hv: 48 }, ACCUM),
        c("gdn_decode_gated", q, Op::GdnDecodeGated { slots: vec![3, -1, 0, 1], hk: 16, hv: 48 }, EXACT),
        c("gdn_decode_gated", GDN32, Op::GdnDecodeGated { slots: vec![0, 2], hk: 2, hv: 6 }, EXACT),
        c(
            "gdn_recurrent_gated",
            q,
            Op::GdnRecurrentGated { lens: vec![4, 1, 3], slots: vec![2, 0, 1], hk: 16, hv: 48 },
            EXACT,
        ),
        c(
            "gdn_recurrent_gated",
            GDN32,
            Op::GdnRecurrentGated { lens: vec![2, 4], slots: vec![1, 0], hk: 2, hv: 6 },
            EXACT,
        ),
        c("gdn_rows", q, gdn_rows(&[4, 1, 6], &[3, -1, 1], None, 16, 48), EXACT),
        c("gdn_rows", GDN32, gdn_rows(&[2, 4], &[1, 0], None, 2, 6), EXACT),
        c("gdn_rows", q, gdn_rows(&[4, 3, 6, 2], &[3, 0, 1, -1], Some(&[2, 3, 5, 1]), 16, 48), EXACT),
        c("gdn_rows", GDN32, gdn_rows(&[4], &[2], Some(&[4]), 2, 6), EXACT),
        c("gdn_commit_layers", q, commit_layers(&[4, 3, 2], &[3, -1, 0], &[2, 3, 1], 16, 48, 3), EXACT),
        c("gdn_commit_layers", GDN32, commit_layers(&[4, 2], &[1, 0], &[4, 1], 2, 6, 50), EXACT),
        c("gdn_recurrent", q, Op::GdnRecurrent { lens: vec![3, 1, 5, 2], accept: None, hk: 16, hv: 48 }, ACCUM),
        c(
            "gdn_recurrent",
            q,
            Op::GdnRecurrent { lens: vec![3, 1, 5, 2], accept: Some(vec![2, 1, 5, 1]), hk: 16, hv: 48 },
            ACCUM,
        ),
        c("gdn_recurrent", GDN32, Op::GdnRecurrent { lens: vec![4, 2], accept: Some(vec![3, 2]), hk: 2, hv: 6 }, ACCUM),
        c("gdn_chunk", BF16_STATE, gdn_op(&[129, 1, 64, 200], 16, 48, SPLIT), ACCUM),
        c("gdn_chunk", BF16_STATE, gdn_op(&[1000], 16, 48, SPLIT), ACCUM),
        c("gdn_chunk", BF16_STATE, gdn_cut_op(&[65, 300], &[&[37], &[128, 129, 299]], 16, 48), BF16_STATE_ROUNDED),
        c("gdn_decode", BF16_STATE, Op::GdnDecode { b: 7, hk: 16, hv: 48 }, ACCUM),
        c("gdn_decode_gated", BF16_STATE, Op::GdnDecodeGated { slots: vec![3, -1, 0, 1], hk: 16, hv: 48 }, EXACT),
        c(
            "gdn_recurrent_gated",
            BF16_STATE,
            Op::GdnRecurrentGated { lens: vec![4, 1, 3], slots: vec![2, 0, 1], hk: 16, hv: 48 },
            EXACT,
        ),
        c(
            "gdn_recurrent",
            BF16_STATE,
            Op::GdnRecurrent { lens: vec![3, 1, 5, 2], accept: None, hk: 16, hv: 48 },
            BF16_STATE_ROUNDED,
        ),
        c(
            "gdn_recurrent",
            BF16_STATE,
            Op::GdnRecurrent { lens: vec![3, 1, 5, 2], accept: Some(vec![2, 1, 5, 1]), hk: 16, hv: 48 },
            BF16_STATE_ROUNDED,
        ),
        c("gdn_rows", BF16_STATE, gdn_rows(&[4, 1, 6], &[3, -1, 1], None, 16, 48), EXACT),
        c("gdn_rows", BF16_STATE, gdn_rows(&[4, 3, 6, 2], &[3, 0, 1, -1], Some(&[2, 3, 5, 1]), 16, 48), EXACT),
        c("gdn_commit_layers", BF16_STATE, commit_layers(&[4, 3, 2], &[3, -1, 0], &[2, 3, 1], 16, 48, 3), EXACT),
        c("conv_state_update", q, Op::ConvAccept { lens: vec![3, 1, 5, 2], accept: vec![2, 1, 5, 1], c: 10240 }, EXACT),
        c("mtp_rows", q, Op::MtpRows { lens: vec![3, 1, 5, 2], d: 5120 }, EXACT),
        c("mtp_rows", q, Op::MtpRows { lens: vec![1, 2], d: 36 }, EXACT),
    ]
}

pub(crate) fn attention_cases() -> Vec<Case> {
    let q = KernelDims::QWEN35_27B;
    vec![
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
        // The warpgroup kernel (wgmma): the same page sizes (per-row lookups at 16 and 32, one page a
        // tile at 64 and 128), a long context, and head dims 256 / 128 / 64 at GQA 6, 8, 2 and 1.
        c("kv_write+attn_prefill_wg", q, wg(&[(5, 64), (31, 127), (33, 129), (1000, 1)], 24, 4, 32), ATTN_PLAIN_P),
        c("kv_write+attn_prefill_wg", q, wg(&[(0, 300), (70, 40), (0, 1)], 24, 4, 16), ATTN_PLAIN_P),
        c("kv_write+attn_prefill_wg", q, wg(&[(0, 63), (64, 65), (100, 17)], 24, 4, 64), ATTN_PLAIN_P),
        c("kv_write+attn_prefill_wg", q, wg(&[(0, 300), (129, 64)], 24, 4, 128), ATTN_PLAIN_P),
        c("kv_write+attn_prefill_wg", q, wg(&[(3000, 200), (4100, 3)], 24, 4, 64), ATTN_PLAIN_P),
        c("kv_write+attn_prefill_wg", NEXT_ATTN, wg(&[(0, 100), (50, 33), (7, 1)], 16, 2, 32), ATTN_PLAIN_P),
        c("kv_write+attn_prefill_wg", SMALL, wg(&[(17, 63), (0, 64), (64, 65), (40, 2)], 8, 4, 16), ATTN_PLAIN_P),
        c("kv_write+attn_prefill_wg", HD64_G1, wg(&[(0, 130), (200, 9)], 4, 4, 64), ATTN_PLAIN_P),
        // The warp-specialised kernel (TMA boxes of a page at 16 and 32 keys, of 64 keys at 64 and 128
        // pages), the same shapes; pages its boxes cannot take (4, 48 keys: attn_prefill_wg runs).
        c("kv_write+attn_prefill_ws", q, ws(&[(5, 64), (31, 127), (33, 129), (1000, 1)], 24, 4, 32), ATTN_PLAIN_P),
        c("kv_write+attn_prefill_ws", q, ws(&[(0, 300), (70, 40), (0, 1)], 24, 4, 16), ATTN_PLAIN_P),
        c("kv_write+attn_prefill_ws", q, ws(&[(0, 63), (64, 65), (100, 17)], 24, 4, 64), ATTN_PLAIN_P),
        c("kv_write+attn_prefill_ws", q, ws(&[(0, 300), (129, 64)], 24, 4, 128), ATTN_PLAIN_P),
        c("kv_write+attn_prefill_ws", q, ws(&[(3000, 200), (4100, 3)], 24, 4, 64), ATTN_PLAIN_P),
        c("kv_write+attn_prefill_ws", NEXT_ATTN, ws(&[(0, 100), (50, 33), (7, 1)], 16, 2, 32), ATTN_PLAIN_P),
        c("kv_write+attn_prefill_ws", SMALL, ws(&[(17, 63), (0, 64), (64, 65), (40, 2)], 8, 4, 16), ATTN_PLAIN_P),
        c("kv_write+attn_prefill_ws", HD64_G1, ws(&[(0, 130), (200, 9)], 4, 4, 64), ATTN_PLAIN_P),
        c("kv_write+attn_prefill_ws", q, ws(&[(0, 300), (70, 40), (0, 1)], 24, 4, 4), ATTN_PLAIN_P),
        c("kv_write+attn_prefill_ws", q, ws(&[(5, 64), (31, 127), (100, 17)], 24, 4, 48), ATTN_PLAIN_P),
        c(
            "kv_write+attn_prefill",
            TINY_ATTN,
            Op::AttnPrefillTiled {
                seqs: vec![(0, 37), (37, 5), (60, 1)],
                hq: 4,
                hkv: 2,
                page: 16,
                tiling: AttnTiling { keys: 32, p_split: false, heads: 0, wide: false, wgmma: false, tma: false },
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
    ]
}

pub(crate) fn linear_cases() -> Vec<Case> {
    let q = KernelDims::QWEN35_27B;
    vec![
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
        // Block FP8: every token count of the GEMV's two tile widths, several linears a launch, partial row
        // and scale blocks, the 27B's shapes; the prefill routes at 17 .. 4096 tokens; the quantiser.
        c("fp8_gemv", q, Op::Fp8Gemv { n: 1, outs: vec![5120], k: 17408, f32_out: false }, ACCUM),
        c("fp8_gemv", q, Op::Fp8Gemv { n: 2, outs: vec![10240, 6144, 48], k: 5120, f32_out: false }, ACCUM),
        c("fp8_gemv", q, Op::Fp8Gemv { n: 3, outs: vec![300, 17], k: 1040, f32_out: true }, ACCUM),
        c("fp8_gemv", q, Op::Fp8Gemv { n: 5, outs: vec![129], k: 16, f32_out: false }, ACCUM),
        c("fp8_gemv", q, Op::Fp8Gemv { n: 8, outs: vec![34816], k: 5120, f32_out: false }, ACCUM),
        c("fp8_gemv", q, Op::Fp8Gemv { n: 9, outs: vec![1000, 64], k: 6144, f32_out: false }, ACCUM),
        c("fp8_gemv", q, Op::Fp8Gemv { n: 13, outs: vec![5120], k: 17408, f32_out: true }, ACCUM),
        c("fp8_gemv", q, Op::Fp8Gemv { n: 16, outs: vec![777, 128, 5], k: 640, f32_out: false }, ACCUM),
        c("fp8_gemm", q, Op::Fp8Gemm { n: 20, out: 1000, k: 5120 }, ACCUM),
        c("fp8_gemm", q, Op::Fp8Gemm { n: 64, out: 5120, k: 17408 }, ACCUM),
        c("fp8_gemm", q, Op::Fp8Gemm { n: 512, out: 6144, k: 5120 }, ACCUM),
        c("fp8_gemm", q, Op::Fp8Gemm { n: 4096, out: 384, k: 1024 }, ACCUM),
        // One and five scale blocks along k (rows of scales padded to 4): the tiny models' widths.
        c("fp8_gemm", q, Op::Fp8Gemm { n: 36, out: 256, k: 128 }, ACCUM),
        c("fp8_gemm", q, Op::Fp8Gemm { n: 300, out: 136, k: 128 }, ACCUM),
        c("fp8_gemm", q, Op::Fp8Gemm { n: 40, out: 1000, k: 640 }, ACCUM),
        c("fp8_swiglu_quant", q, Op::Fp8SwigluQuant { t: 4097, i: 17408, tq: 4096 }, EXACT),
        c("fp8_gated_norm_quant", q, Op::Fp8GatedNormQuant { t: 4099, hv: 48, tq: 4096 }, EXACT),
        c("fp8_gated_norm_quant", q, Op::Fp8GatedNormQuant { t: 21, hv: 3, tq: 21 }, EXACT),
        c("fp8_swiglu_quant", q, Op::Fp8SwigluQuant { t: 70, i: 384, tq: 68 }, EXACT),
        // The 27B's rows (the GEMV's tail token bf16); a width whose last threads hold no vector.
        c("fp8_norm_quant", q, Op::Fp8NormQuant { t: 4097, d: 5120, tq: 4096 }, EXACT),
        c("fp8_norm_quant", q, Op::Fp8NormQuant { t: 300, d: 384, tq: 300 }, EXACT),
        c("fp8_swiglu_quant", q, Op::Fp8SwigluQuant { t: 33, i: 2176, tq: 33 }, EXACT),
        c("fp8_quantize", q, Op::Fp8Quantize { out: 300, k: 1040 }, EXACT),
        c("fp8_quantize", q, Op::Fp8Quantize { out: 5120, k: 640 }, EXACT),
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
    ]
}

pub(crate) fn kv_quant_cases() -> Vec<Case> {
    let q = KernelDims::QWEN35_27B;
    let (bf, f8, i8, i4) = (KvDtype::Bf16, KvDtype::Fp8, KvDtype::Int8, KvDtype::Int4);
    vec![
        // Quantised KV: writes with special rows (1 token; page boundaries; several sequences) ...
        c("kv_write_q", q, kvq(f8, i4, &[(0, 1)], 24, 4, 16, None, true), EXACT),
        c("kv_write_q", q, kvq(i8, f8, &[(0, 33), (5, 16), (0, 2)], 24, 4, 16, None, true), EXACT),
        c("kv_write_q", HD32_G8, kvq(i4, i8, &[(0, 17), (3, 9)], 8, 1, 8, None, true), EXACT),
        c("kv_write_q", SMALL, kvq(i4, bf, &[(60, 70)], 8, 4, 32, None, true), EXACT),
        // ... and attention over them (write checks included), same tolerance as the bf16 cases.
        c("kv_q+attn_prefill", q, kvq(f8, f8, &[(0, 63), (10, 65), (100, 17)], 24, 4, 16, None, false), ATTN_PLAIN_P),
        // fp8 K and V multiplied unwidened on Hopper (head dim 256): 64-key boxes, a longer context; an fp8 K beside
        // a widened int4 V (the warp-specialised kernel as the other Hopper one); head dim 128 (both widened).
        c("kv_q+attn_prefill", q, kvq(f8, f8, &[(0, 700), (3000, 129)], 24, 4, 64, None, false), ATTN_PLAIN_P_LONG),
        c(
            "kv_q+attn_prefill",
            SMALL,
            kvq(f8, f8, &[(17, 63), (0, 64), (200, 65)], 8, 4, 32, None, false),
            ATTN_PLAIN_P,
        ),
        c("kv_q+attn_prefill", q, kvq(f8, i4, &[(0, 200), (64, 64)], 24, 4, 128, None, false), ATTN_PLAIN_P),
        c("kv_q+attn_prefill", q, kvq(i8, i4, &[(5, 64), (31, 127), (1000, 1)], 24, 4, 32, None, false), ATTN_PLAIN_P),
        c("kv_q+attn_prefill", q, kvq(i4, i8, &[(0, 300)], 24, 4, 32, None, false), ATTN_PLAIN_P),
        c("kv_q+attn_prefill", SMALL, kvq(bf, i4, &[(17, 63), (0, 64), (64, 65)], 8, 4, 16, None, false), ATTN_PLAIN_P),
        c("kv_q+attn_prefill", HD32_G8, kvq(i4, f8, &[(70, 40), (0, 16), (9, 1)], 8, 1, 8, None, false), ATTN_PLAIN_P),
        c("kv_q+attn_prefill", q, kvq(i8, bf, &[(0, 130), (3000, 40), (7, 1)], 24, 4, 64, None, false), ATTN_PLAIN_P),
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
        // Verify rows (several new tokens a sequence, each a decode query at its own causal length):
        // attn_verify_mma over each chunk's rows in groups (4 rows of the 27B's 6 heads; chunks of 1-5 rows:
        // groups split, partitions past a short row's keys, tiles across pages), and row by row on
        // attn_decode_mma, both against the oracle.
        c(
            "kv_q+attn_verify",
            q,
            kvq(f8, f8, &[(3000, 4), (0, 4), (126, 3), (17, 1)], 24, 4, 16, Some(16), false),
            ACCUM,
        ),
        c("kv_q+attn_verify", q, kvq(f8, f8, &[(700, 5), (4090, 2)], 24, 4, 8, Some(32), false), ACCUM),
        c("kv_q+attn_verify", q, kvq(i4, i4, &[(2000, 4), (33, 4)], 24, 4, 32, Some(16), false), ACCUM),
        c("kv_q+attn_verify", q, kvq(i8, f8, &[(500, 4), (1, 2)], 24, 4, 16, Some(8), false), ACCUM),
        c("kv_q+attn_verify", q, kvq(f8, i4, &[(1500, 4)], 24, 4, 32, Some(4), false), ACCUM),
        // GQA 4 (2 n-tiles), 2 at head dim 128 (1 n-tile, 4 rows a group), 1 at head dim 64 (8 rows).
        c("kv_q+attn_verify", GQA4, kvq(f8, f8, &[(900, 4), (9, 3)], 16, 4, 16, Some(16), false), ACCUM),
        c("kv_q+attn_verify", SMALL, kvq(f8, i8, &[(300, 4), (9, 3)], 8, 4, 8, Some(4), false), ACCUM),
        c("kv_q+attn_verify", HD64_G1, kvq(i8, i8, &[(1000, 13), (40, 4)], 2, 2, 16, Some(8), false), ACCUM),
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

pub(crate) fn moe_cases() -> Vec<Case> {
    use crate::moe::Routing::{Few, OneHot, Spread};
    let q = KernelDims::QWEN35_27B;
    let m = |t, experts, top_k, h, i, norm, routing| Op::Moe { t, experts, top_k, h, i, norm, routing };
    vec![
        c("moe", q, m(1, 64, 8, 256, 128, true, Spread), ACCUM),
        c("moe", q, m(3, 64, 8, 256, 128, true, OneHot), ACCUM),
        c("moe", q, m(64, 64, 8, 256, 128, false, Few), ACCUM),
        c("moe", q, m(300, 64, 8, 256, 136, true, Spread), ACCUM),
        c("moe", q, m(300, 6, 3, 64, 32, false, OneHot), ACCUM),
        c("moe", q, m(65, 8, 2, 64, 32, true, Few), ACCUM),
        // Expert width 256: the shared expert's gate and up as two int4 linears, each half whole GEMV blocks.
        c("moe", q, m(2, 16, 4, 256, 256, true, Spread), ACCUM),
        // The 35B-A3B's expert shape (width 512 over 2048, top 8; 64 of its 256 experts, what the test
        // arena holds) and Qwen3-Next's 512 experts, top 10. At K = 2048 the grouped GEMM's f32 sums
        // round the bf16 intermediates one step off the reference's now and then, and the down
        // projection carries that (one element at 1.16× ACCUM on the H200): FOLD_X's bound, as for a
        // GEMV of bf16-rounded x.
        c("moe", q, m(64, 64, 8, 2048, 512, true, Spread), FOLD_X),
        c("moe", q, m(5, 512, 10, 512, 64, false, Spread), ACCUM),
    ]
}

/// The vision tower's kernels (none specialised on the model's dims) at the real tower's width (1152,
/// 16 heads of 72, MLP 4304, a 48² position table) and the tiny preset's (144, 2 heads of 72), and M-RoPE
/// in the fused q/k norm + RoPE kernel (the 27B's rotary dims and the tiny model's).
pub(crate) fn vision_cases() -> Vec<Case> {
    use crate::vision::VisionAct::{Gelu, GeluTanh, None as Plain, Silu};
    let q = KernelDims::QWEN35_27B;
    let attn = |grids: &[[usize; 3]], heads, hd| Op::VisionAttention { grids: grids.to_vec(), heads, hd };
    let frames =
        |lens: &[usize], heads, hd, nan_smem| Op::VisionAttentionFrames { lens: lens.to_vec(), heads, hd, nan_smem };
    let mrope = |t, nq, nkv, hd, rot| Op::QkNormRopeMrope { t, nq, nkv, hd, rot, section: [11, 11, 10] };
    vec![
        c("qk_norm_rope_mrope", q, mrope(12, 24, 4, 256, 64), SINGLE),
        c("qk_norm_rope_mrope", q, mrope(9, 4, 2, 32, 8), SINGLE),
        c("qk_norm_rope_mrope", q, mrope(300, 24, 4, 256, 64), SINGLE),
        c("vision_layer_norm", q, Op::VisionLayerNorm { rows: 7, d: 1152, residual: false }, SINGLE),
        c("vision_layer_norm", q, Op::VisionLayerNorm { rows: 3, d: 144, residual: false }, SINGLE),
        // The residual add before it: the tower's width, a width past the registers' 1,536 and one not a
        // multiple of 4 (element loads), row counts not a multiple of the block's 4.
        c("vision_layer_norm", q, Op::VisionLayerNorm { rows: 9, d: 1152, residual: true }, SINGLE),
        c("vision_layer_norm", q, Op::VisionLayerNorm { rows: 5, d: 2052, residual: true }, SINGLE),
        c("vision_layer_norm", q, Op::VisionLayerNorm { rows: 6, d: 150, residual: true }, SINGLE),
        c("vision_embed_pos", q, Op::VisionEmbedPos { grid: [1, 4, 6], d: 144, side: 8 }, SINGLE),
        c("vision_embed_pos", q, Op::VisionEmbedPos { grid: [2, 14, 10], d: 1152, side: 48 }, SINGLE),
        c("vision_embed_pos", q, Op::VisionEmbedPos { grid: [1, 64, 96], d: 144, side: 48 }, SINGLE),
        c("vision_qkv_rope", q, Op::VisionQkvRope { grid: [1, 4, 6], heads: 2, hd: 72 }, SINGLE),
        c("vision_qkv_rope", q, Op::VisionQkvRope { grid: [1, 32, 24], heads: 16, hd: 72 }, SINGLE),
        c("vision_qkv_rope", q, Op::VisionQkvRope { grid: [2, 6, 8], heads: 3, hd: 64 }, SINGLE),
        // The attention (tensor cores, bf16 P: the other bf16 attention cases' bound). One image, a
        // partial query tile and a partial key tile (120 patches).
        c("vision_attention", q, attn(&[[1, 10, 12]], 2, 72), ATTN_PLAIN_P),
        // Two images of different sizes, one after the other.
        c("vision_attention", q, attn(&[[1, 10, 12], [1, 6, 4]], 2, 72), ATTN_PLAIN_P),
        c("vision_attention", q, attn(&[[1, 16, 32], [1, 8, 6]], 16, 72), ATTN_PLAIN_P),
        c("vision_attention", q, attn(&[[1, 16, 20]], 3, 64), ATTN_PLAIN_P),
        c("vision_attention", q, attn(&[[1, 14, 18], [1, 4, 4]], 4, 64), ATTN_PLAIN_P),
        // Two frames attend each on their own.
        c("vision_attention", q, attn(&[[2, 6, 8]], 2, 72), ATTN_PLAIN_P),
        // Whole tiles only (128 queries, 64 keys per tile at 72 dims) at the real tower's width.
        c("vision_attention", q, attn(&[[1, 32, 32]], 16, 72), ATTN_PLAIN_P),
        // Packed frames of any lengths in one launch, NaN left in shared memory before it: the tiny
        // tower's shape (2 heads of 72) up to a 1024² image's frame; the real width (16 heads).
        c("vision_attention", q, frames(&[1, 24, 100, 333, 4096], 2, 72, true), ATTN_PLAIN_P),
        c("vision_attention", q, frames(&[63, 64, 65, 127, 128, 129, 1], 16, 72, true), ATTN_PLAIN_P),
        c("vision_attention", q, frames(&[300, 0, 17], 16, 72, false), ATTN_PLAIN_P),
        // The other head dims: 64 and 128 (16-byte copies), 36 and 2 (4-byte copies, zero-filled dims
        // up to the kernel's 64), 80 and 104 (on the 128-dim kernel).
        c("vision_attention", q, frames(&[333, 1, 64, 129], 3, 64, true), ATTN_PLAIN_P),
        c("vision_attention", q, frames(&[200, 65, 1, 31], 2, 128, true), ATTN_PLAIN_P),
        c("vision_attention", q, frames(&[77, 5, 130], 3, 36, true), ATTN_PLAIN_P),
        c("vision_attention", q, frames(&[40, 3], 2, 2, true), ATTN_PLAIN_P),
        c("vision_attention", q, frames(&[150, 33], 2, 80, true), ATTN_PLAIN_P),
        c("vision_attention", q, frames(&[97, 2], 4, 104, false), ATTN_PLAIN_P),
        c("vision_bias_act", q, Op::VisionBiasAct { rows: 5, d: 4304, act: GeluTanh }, SINGLE),
        c("vision_bias_act", q, Op::VisionBiasAct { rows: 9, d: 576, act: Gelu }, SINGLE),
        c("vision_bias_act", q, Op::VisionBiasAct { rows: 4, d: 288, act: Silu }, SINGLE),
        c("vision_bias_act", q, Op::VisionBiasAct { rows: 3, d: 5120, act: Plain }, SINGLE),
        c("vision_bias_act", q, Op::VisionBiasAct { rows: 4, d: 1030, act: GeluTanh }, SINGLE),
    ]
}
