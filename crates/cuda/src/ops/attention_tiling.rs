//! Which prefill attention kernel runs, and its dynamic shared memory: the warp-pair kernel
//! (attention_prefill.cu), the wide ones (attention_prefill_wide.cu), and on Hopper the warpgroup and the
//! warp-specialised kernels (attention_prefill_wg.cu, attention_prefill_ws.cu with its e4m3 pieces in
//! attention_prefill_e4m3.cuh), chosen by compute capability, cache formats, head dim and the block's
//! shared memory.

use super::Kernels;
use super::kv_quant::row_bytes;
use crate::nvrtc::{AttnTiling, KernelDims, KvFormats};
use deltaserve_plan::KvDtype;

/// Dynamic shared memory of [`attn_prefill`](super::attention::attn_prefill) (PF_SMEM_BYTES in
/// attention_prefill.cu): 2 stages of K and V tiles (bf16 rows padded by 8, or the raw codes of a quantised
/// format), then for each quantised matrix one converted bf16 tile and the tile's f32 scales, then the warp
/// pairs' partial-S exchange (16 f32 per key and warp).
pub(crate) fn prefill_smem_bytes(d: &KernelDims, kv: &KvFormats, t: &AttnTiling) -> usize {
    let (hd, keys) = (d.attn_head_dim, t.keys);
    let warps = 2 * t.heads_per_block(d.gqa_group);
    kv_tiles_bytes(kv, keys, hd, keys * (hd + 8) * 2) + warps * keys * 64
}

/// The K/V part of a prefill kernel's shared memory at `keys` per KV tile and bf16 tiles of
/// `tile` bytes (rows padded or not, as the kernel lays them out): 2 stages of K and V (a bf16 matrix as
/// its tile, a quantised one as its codes), then for each quantised matrix its converted bf16 tile and
/// the tile's f32 scales.
fn kv_tiles_bytes(kv: &KvFormats, keys: usize, hd: usize, tile: usize) -> usize {
    let part = |f: KvDtype| if f == KvDtype::Bf16 { tile } else { keys * row_bytes(f, hd) };
    let extra = |f: KvDtype| if f == KvDtype::Bf16 { 0 } else { tile + 4 * keys };
    2 * (part(kv.k) + part(kv.v)) + extra(kv.k) + extra(kv.v)
}

/// Packed (query, head) rows per block of `attn_prefill_wide` (row r of a sequence: query
/// r / GQA group, head r % GQA group of the block's kv head).
pub const WIDE_ROWS: usize = 128;

/// Dynamic shared memory of `attn_prefill_wide` at `keys` per KV tile (the pw_* layout in
/// attention_prefill_wide.cu): the block's Q rows (unpadded, swizzled), 2 stages of K and V (bf16 tiles with rows
/// padded by 8, or a quantised format's codes), for each quantised matrix its converted bf16 tile and
/// f32 tile scales, the pairs' P exchange (bf16, 32 lanes x keys / 16 x 16 B per warp) and the rows'
/// factors (a float2 per lane and warp).
pub(crate) fn wide_smem_bytes(d: &KernelDims, kv: &KvFormats, keys: usize) -> usize {
    let hd = d.attn_head_dim;
    WIDE_ROWS * hd * 2 + kv_tiles_bytes(kv, keys, hd, keys * (hd + 8) * 2) + 8 * 32 * keys + 8 * 32 * 8
}

/// Dynamic shared memory of `attn_prefill_wg` (the WG_* layout in attention_prefill_wg.cu): 1 KB to
/// align the block's tiles to the 128-byte swizzle's 1024-byte atoms, its Q rows, 2 stages of 64-key K
/// and V (a bf16 matrix as its tile, a quantised one as its codes), for each quantised matrix its
/// bf16 tile, then its f32 tile scales.
pub(crate) fn wg_smem_bytes(d: &KernelDims, kv: &KvFormats) -> usize {
    let hd = d.attn_head_dim;
    1024 + WIDE_ROWS * hd * 2 + kv_tiles_bytes(kv, WG_KEYS, hd, WG_KEYS * hd * 2)
}

/// Keys per KV tile of `attn_prefill_wg` and `attn_prefill_ws`.
const WG_KEYS: usize = 64;

/// Dynamic shared memory of `attn_prefill_ws` (attention_prefill_ws.cu): 1 KB of alignment slack, its
/// Q rows, 2 stages of 64-key K (swizzled bf16 tiles; an fp8 K's codes as they are) and 2 of V (bf16
/// tiles; an fp8 V's transposed codes, then its 2 stages of codes as they land), 10 barriers in 128 bytes;
/// with a quantised matrix the tiles' f32 scales (2 stages of K and V) and one stage of the codes the
/// producer widens (every quantised matrix's but an fp8 K's and V's).
pub(crate) fn ws_smem_bytes(d: &KernelDims, kv: &KvFormats) -> usize {
    let hd = d.attn_head_dim;
    let (k8, v8) = (ws_k_codes_direct(d, kv), ws_v_codes_direct(d, kv));
    let widened = |f: KvDtype| if f == KvDtype::Bf16 { 0 } else { WG_KEYS * row_bytes(f, hd) };
    let codes = if k8 { 0 } else { widened(kv.k) } + if v8 { 0 } else { widened(kv.v) };
    let k_stage = WG_KEYS * hd * if k8 { 1 } else { 2 };
    // (An fp8 V's transposed tile: wgmma's 8 x 16-byte core matrices, groups of 8 dims 528 bytes apart, 1 KB
    // aligned: WS_VT_BYTES in attention_prefill_e4m3.cuh.)
    let v_stages = if v8 { 2 * (hd / 8 * 528).next_multiple_of(1024) + 2 * WG_KEYS * hd } else { 2 * WG_KEYS * hd * 2 };
    let quantised = if kv.k == KvDtype::Bf16 && kv.v == KvDtype::Bf16 { 0 } else { 4 * WG_KEYS * 4 };
    1024 + WIDE_ROWS * hd * 2 + 2 * k_stage + v_stages + 128 + quantised + codes
}

/// Whether `attn_prefill_ws` multiplies K's codes as they lie in the cache (an fp8 K at head dim 256, the
/// shape checked on a GPU: e4m3 tensor-core products against Q split into two e4m3 halves), its K stages
/// copied straight from the cache (`WS_K8` in attention_prefill_e4m3.cuh).
pub(crate) fn ws_k_codes_direct(d: &KernelDims, kv: &KvFormats) -> bool {
    kv.k == KvDtype::Fp8 && d.attn_head_dim == 256
}

/// Whether `attn_prefill_ws` multiplies V's codes too (fp8 K and V at head dim 256: e4m3 products against P
/// split into two e4m3 halves, V's codes copied in 128-byte swizzled boxes and transposed by the producer;
/// `WS_V8` in attention_prefill_e4m3.cuh).
pub(crate) fn ws_v_codes_direct(d: &KernelDims, kv: &KvFormats) -> bool {
    kv.v == KvDtype::Fp8 && ws_k_codes_direct(d, kv)
}

/// Whether `attn_prefill_wg` takes the wide kernel's work: compute capability 9.0 (its wgmma runs in an
/// sm_90a build), head dims a multiple of 64 up to 256, and its block's shared memory fits.
fn wgmma_applies(d: &KernelDims, kv: &KvFormats, cc: (i32, i32), max_smem: usize) -> bool {
    let hd = d.attn_head_dim;
    cc == (9, 0) && hd.is_multiple_of(64) && hd <= 256 && wg_smem_bytes(d, kv) <= max_smem
}

/// Whether `attn_prefill_ws` can take `attn_prefill_wg`'s work: its shared memory fits.
fn tma_applies(d: &KernelDims, kv: &KvFormats, max_smem: usize) -> bool {
    ws_smem_bytes(d, kv) <= max_smem
}

/// Whether Hopper's attention prefill runs the warp-specialised kernel (`attn_prefill_ws`, its producer
/// copying K/V tiles) by default over a cache in `kv`: over bf16 K and V (27B bf16 prefill at 128K 1.21×
/// the warpgroup kernel's on the H200, 1.22× on the H100) and over fp8 K and V, where both matrices' codes go
/// to e4m3 products unwidened (int4 weights + fp8 KV at 24 GiB, 128K 1.32× on the H100,
/// bench/results/fp8-v-codes-to-e4m3-products-h100-2026-12-06.md); not over the other quantised formats,
/// where the producer warpgroup widening both matrices' codes is the bottleneck (0.87×,
/// bench/results/attention-prefill-ws-2026-12-05.md).
pub fn producer_copies(kv: &KvFormats) -> bool {
    *kv == KvFormats::BF16 || (kv.k == KvDtype::Fp8 && kv.v == KvDtype::Fp8)
}

/// Rows of `attn_prefill_ws`'s copy boxes over pages of `page` keys: the page where it divides a 64-key
/// tile (from 8 keys: a box's rows start on the 128-byte swizzle's 1024-byte atoms), 64 where 64 divides
/// the page; None otherwise (`attn_prefill_wg` runs).
pub(crate) fn tma_box_rows(page: usize) -> Option<usize> {
    match page {
        8..=64 if WG_KEYS.is_multiple_of(page) => Some(page),
        p if p > WG_KEYS && p.is_multiple_of(WG_KEYS) => Some(WG_KEYS),
        _ => None,
    }
}

/// The tiling the kernels run for a requested `t` on a device of compute capability `cc`: the wide
/// kernel at `t.keys` where it applies (plain P) and its shared memory fits `max_smem`, else at 32
/// keys, else `attn_prefill` at 32 keys (a tiling that asked for the wide kernel, e.g. the default,
/// never falls back to 64-key pair tiles); `wgmma` stays only where `attn_prefill_wg` applies (then at
/// 64 keys), `tma` only where `attn_prefill_ws` applies too. Tilings with `wide: false` are kept as
/// they are.
pub(crate) fn resolve_tiling(
    d: &KernelDims,
    kv: &KvFormats,
    t: AttnTiling,
    cc: (i32, i32),
    max_smem: usize,
) -> AttnTiling {
    if !t.wide {
        return AttnTiling { wgmma: false, tma: false, ..t };
    }
    if !t.p_split && d.attn_head_dim >= 32 {
        if t.wgmma && wgmma_applies(d, kv, cc, max_smem) {
            return AttnTiling { keys: WG_KEYS, tma: t.tma && tma_applies(d, kv, max_smem), ..t };
        }
        for keys in [t.keys, 32] {
            if wide_smem_bytes(d, kv, keys) <= max_smem {
                return AttnTiling { keys, wgmma: false, tma: false, ..t };
            }
        }
    }
    AttnTiling { wide: false, keys: 32, wgmma: false, tma: false, ..t }
}

/// The prefill kernel that runs with the (resolved) tiling `t` (`attn_prefill_ws` where the page size
/// allows its boxes: [`tma_box_rows`]; else `attn_prefill_wg`).
pub(crate) fn prefill_kernel(t: &AttnTiling) -> &'static str {
    match (t.wide, t.wgmma, t.tma, t.keys) {
        (true, true, true, _) => "attn_prefill_ws",
        (true, true, false, _) => "attn_prefill_wg",
        (true, false, _, 64) => "attn_prefill_wide64",
        (true, false, _, _) => "attn_prefill_wide",
        _ => "attn_prefill",
    }
}

/// The prefill kernel the kernels `k` launch over pages of `page` keys: [`prefill_kernel`], with
/// `attn_prefill_wg` for `attn_prefill_ws` where the page size does not allow its boxes.
pub fn prefill_kernel_at(k: &Kernels, page: usize) -> &'static str {
    let t = AttnTiling { tma: k.attn.tma && tma_box_rows(page).is_some(), ..k.attn };
    prefill_kernel(&t)
}

/// Dynamic shared memory of the prefill kernel that runs with the (resolved) tiling `t`.
pub(crate) fn prefill_kernel_smem(d: &KernelDims, kv: &KvFormats, t: &AttnTiling) -> usize {
    match (t.wide, t.wgmma, t.tma) {
        (true, true, true) => ws_smem_bytes(d, kv),
        (true, true, false) => wg_smem_bytes(d, kv),
        (true, false, _) => wide_smem_bytes(d, kv, t.keys),
        _ => prefill_smem_bytes(d, kv, t),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const D: KernelDims = KernelDims::QWEN35_27B;
    const FP8: KvFormats = KvFormats { k: KvDtype::Fp8, v: KvDtype::Fp8 };
    // cudaDevAttrMaxSharedMemoryPerBlockOptin of the GPUs the kernels target.
    const H100: usize = 232_448;
    const A100: usize = 166_912;
    const RTX3090: usize = 101_376;

    #[test]
    fn wide_shared_memory_at_the_27b_shape() {
        // Q 64 KiB + 2 stages of K and V (rows padded to 264) + P exchange + factor exchange.
        assert_eq!(wide_smem_bytes(&D, &KvFormats::BF16, 64), 65_536 + 4 * 64 * 264 * 2 + 16_384 + 2_048);
        assert_eq!(wide_smem_bytes(&D, &KvFormats::BF16, 32), 143_360);
        // fp8: code stages, converted bf16 tiles and f32 scales instead of bf16 stages.
        assert_eq!(wide_smem_bytes(&D, &FP8, 64), 65_536 + 4 * 64 * 256 + 2 * (64 * 264 * 2 + 256) + 16_384 + 2_048);
    }

    #[test]
    fn the_default_tiling_follows_the_shared_memory() {
        let t = AttnTiling { wgmma: false, ..AttnTiling::DEFAULT };
        for kv in [KvFormats::BF16, FP8, KvFormats { k: KvDtype::Int4, v: KvDtype::Int8 }] {
            let h = resolve_tiling(&D, &kv, t, (9, 0), H100);
            assert!(h.wide && h.keys == 64, "{kv:?}: {h:?}");
            let a = resolve_tiling(&D, &kv, t, (8, 0), A100);
            assert!(a.wide && a.keys == 32, "{kv:?}: {a:?}");
            // sm_86 / sm_89: attn_prefill at 32-key tiles, which fits their 99 KB.
            let r = resolve_tiling(&D, &kv, t, (8, 6), RTX3090);
            assert!(!r.wide && r.keys == 32, "{kv:?}: {r:?}");
            assert!(prefill_smem_bytes(&D, &kv, &r) <= RTX3090);
        }
        // The hi/lo P split runs on attn_prefill only; a tiling without `wide` is kept as asked.
        let split = resolve_tiling(&D, &KvFormats::BF16, AttnTiling { p_split: true, ..t }, (9, 0), H100);
        assert!(!split.wide && split.keys == 32 && split.p_split);
        let pair = AttnTiling { keys: 64, p_split: false, heads: 3, wide: false, wgmma: false, tma: false };
        assert_eq!(resolve_tiling(&D, &KvFormats::BF16, pair, (9, 0), H100), pair);
    }

    #[test]
    fn the_warpgroup_kernel_runs_on_hopper_only() {
        let t = AttnTiling { tma: false, ..AttnTiling::DEFAULT };
        assert!(t.wgmma, "Hopper's tensor-core instructions by default");
        // Q 64 KiB + 2 stages of 64-key K and V + the alignment slack: 193 KiB, inside the H100's 227.
        assert_eq!(wg_smem_bytes(&D, &KvFormats::BF16), 1024 + 65_536 + 131_072);
        // fp8: code stages, then the converted bf16 tiles and the f32 scales.
        assert_eq!(wg_smem_bytes(&D, &FP8), 1024 + 65_536 + 4 * 16_384 + 2 * (32_768 + 256));
        for kv in [KvFormats::BF16, FP8, KvFormats { k: KvDtype::Int4, v: KvDtype::Int8 }] {
            let h = resolve_tiling(&D, &kv, t, (9, 0), H100);
            assert!(h.wide && h.wgmma && h.keys == 64, "{h:?}");
            assert_eq!(prefill_kernel(&h), "attn_prefill_wg");
            assert_eq!(prefill_kernel_smem(&D, &kv, &h), wg_smem_bytes(&D, &kv));
            assert!(wg_smem_bytes(&D, &kv) <= H100);
        }
        // Other GPUs, other head dims: the wide kernel (or attn_prefill) as before.
        for cc in [(8, 0), (8, 9), (10, 0)] {
            let o = resolve_tiling(&D, &KvFormats::BF16, t, cc, H100);
            assert!(o.wide && !o.wgmma, "{cc:?}: {o:?}");
        }
        for hd in [32, 72, 320] {
            let d = KernelDims { attn_head_dim: hd, ..D };
            assert!(!resolve_tiling(&d, &KvFormats::BF16, t, (9, 0), H100).wgmma, "head dim {hd}");
        }
        assert!(resolve_tiling(&KernelDims { attn_head_dim: 128, ..D }, &FP8, t, (9, 0), H100).wgmma);
        // Nor with the hi/lo P split (attn_prefill), nor without `wide`.
        assert!(!resolve_tiling(&D, &KvFormats::BF16, AttnTiling { p_split: true, ..t }, (9, 0), H100).wgmma);
        assert!(!resolve_tiling(&D, &KvFormats::BF16, AttnTiling { wide: false, ..t }, (9, 0), H100).wgmma);
    }

    #[test]
    fn the_warp_specialised_kernel_runs_on_hopper_where_it_fits() {
        let t = AttnTiling::DEFAULT;
        const { assert!(AttnTiling::DEFAULT.tma, "Hopper's default: measured faster on the H200") };
        // Q 64 KiB + 2 K and 2 V stages of 64 keys + the alignment slack + the barriers.
        assert_eq!(ws_smem_bytes(&D, &KvFormats::BF16), 1024 + 65_536 + 131_072 + 128);
        // Codes: the tiles' scales and one stage of 64 rows of each quantised matrix the producer widens; an
        // fp8 K's stages hold its codes, an fp8 V's its transposed codes (fp8 / fp8: K 2 x 16 KiB, V 2 x 17 KiB
        // transposed and 2 x 16 KiB as copied).
        assert_eq!(ws_smem_bytes(&D, &FP8), 1024 + 65_536 + 32_768 + 2 * 17_408 + 32_768 + 128 + 1024);
        // (At other head dims an fp8 K's codes are widened.)
        let d64 = KernelDims { attn_head_dim: 64, ..D };
        assert_eq!(ws_smem_bytes(&d64, &FP8), 1024 + 16_384 + 32_768 + 128 + 1024 + 2 * 64 * 64);
        let int4_bf16 = KvFormats { k: KvDtype::Int4, v: KvDtype::Bf16 };
        assert_eq!(ws_smem_bytes(&D, &int4_bf16), 1024 + 65_536 + 131_072 + 128 + 1024 + 64 * 128);
        let int8 = KvFormats { k: KvDtype::Int8, v: KvDtype::Int8 };
        for kv in [KvFormats::BF16, FP8, int4_bf16, KvFormats { k: KvDtype::Int8, v: KvDtype::Int4 }, int8] {
            let h = resolve_tiling(&D, &kv, t, (9, 0), H100);
            assert!(h.wgmma && h.tma && h.keys == 64, "{kv:?}: {h:?}");
            assert_eq!(prefill_kernel(&h), "attn_prefill_ws");
            assert_eq!(prefill_kernel_smem(&D, &kv, &h), ws_smem_bytes(&D, &kv));
            assert!(ws_smem_bytes(&D, &kv) <= H100, "{kv:?}");
        }
        // By default over bf16 K and V and over fp8 K and V (Kernels::load_kv).
        assert!(producer_copies(&KvFormats::BF16) && producer_copies(&FP8) && !producer_copies(&int4_bf16));
        assert!(!producer_copies(&KvFormats { k: KvDtype::Fp8, v: KvDtype::Int8 }) && !producer_copies(&int8));
        // Other GPUs, the wide kernel asked for: no TMA producer.
        let o = resolve_tiling(&D, &KvFormats::BF16, t, (8, 0), H100);
        assert!(!o.tma && prefill_kernel(&o) != "attn_prefill_ws", "{o:?}");
        assert!(!resolve_tiling(&D, &KvFormats::BF16, AttnTiling { wgmma: false, ..t }, (9, 0), H100).tma);
        // Its copy boxes: a page that divides a 64-key tile (from 8 keys), or 64 rows of a page that 64 divides.
        for (page, rows) in
            [(8, Some(8)), (16, Some(16)), (32, Some(32)), (64, Some(64)), (128, Some(64)), (256, Some(64))]
        {
            assert_eq!(tma_box_rows(page), rows, "page {page}");
        }
        for page in [1, 4, 24, 48, 96, 100] {
            assert_eq!(tma_box_rows(page), None, "page {page}");
        }
    }
}
