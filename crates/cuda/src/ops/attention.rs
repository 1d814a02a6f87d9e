//! Launchers for kernels/attention_prefill.cu, attention_prefill_wide.cu, attention_decode.cu and
//! attention_verify.cu: causal GQA attention over the paged KV cache, prefill (varlen, online softmax
//! on tensor cores, no scratch), decode (fixed split count + combine) and groups of a sequence's rows
//! (a verify chunk) read together.
//! The cache is bf16, or quantised per [`Kernels::kv`] (the `_q` launchers take its scales).

use cudarc::driver::CudaStream;

pub use super::attention_tiling::{WIDE_ROWS, prefill_kernel_at, producer_copies};
pub(crate) use super::attention_tiling::{prefill_kernel, prefill_kernel_smem, resolve_tiling};
use super::attention_tiling::{prefill_smem_bytes, tma_box_rows, ws_smem_bytes};
use super::attention_tiling::{ws_k_codes_direct, ws_v_codes_direct};
use super::kv_quant::row_bytes;
use super::{Kernels, invalid, launch, launch_pdl, tma, to_i32, to_u32};
use crate::error::CudaError;
use crate::nvrtc::{AttnTiling, KernelDims, KvFormats};
use deltaserve_plan::KvDtype;

/// Queries per prefill tile (fixed in the kernel: one m16 mma row tile per query head).
pub const Q_TILE: usize = deltaserve_plan::cuda::ATTN_Q_TILE;

/// Per-(token, head) f16 scales of a quantised cache ([rows, kv_heads] each; 0 for a bf16 matrix).
#[derive(Clone, Copy, Debug, Default)]
pub struct KvScales {
    pub k: u64,
    pub v: u64,
}

fn check_scales(kernel: &'static str, k: &Kernels, sc: &KvScales) -> Result<(), CudaError> {
    for (what, f, p) in [("K", k.kv.k, sc.k), ("V", k.kv.v, sc.v)] {
        if f.scale_bytes() > 0 && (p == 0 || !p.is_multiple_of(2)) {
            return Err(invalid(kernel, format!("{what} is {} and needs 2-byte aligned scales, got {p:#x}", f.name())));
        }
    }
    Ok(())
}

/// Host-side tile table for [`attn_prefill`] with the kernels `k`: (sequence, 16-query tile) pairs,
/// or with the wide kernel ([`Kernels::attn_wide`]) (sequence, tile of [`WIDE_ROWS`] packed rows)
/// pairs — never more entries than 16-query tiles (a GQA group is at most 8).
pub fn tile_table(k: &Kernels, cu_seqlens: &[i32]) -> Vec<i32> {
    tile_table_for(k.attn_wide(), k.dims.gqa_group, cu_seqlens)
}

/// [`tile_table`] for the wide kernel (`wide`: tiles of [`WIDE_ROWS`] packed rows, `gqa_group` rows
/// per query) or attn_prefill (16-query tiles).
fn tile_table_for(wide: bool, gqa_group: usize, cu_seqlens: &[i32]) -> Vec<i32> {
    if wide {
        let rows: Vec<i32> = cu_seqlens.iter().map(|&c| c * gqa_group as i32).collect();
        super::tile_table(&rows, WIDE_ROWS)
    } else {
        super::tile_table(cu_seqlens, Q_TILE)
    }
}

/// Scratch bytes for [`attn_decode`]: partial o [b, hq, n_split, hd] + (max, sum) pairs, f32.
pub fn decode_scratch_bytes(n_seqs: usize, q_heads: usize, n_split: usize, head_dim: usize) -> usize {
    let po = 4 * n_seqs * q_heads * n_split * head_dim;
    po.div_ceil(256) * 256 + 8 * n_seqs * q_heads * n_split
}

/// Paged-KV geometry shared by both launchers.
#[derive(Clone, Copy, Debug)]
pub struct KvPages {
    /// [num_blocks * page, kv_heads*head_dim] bf16, or the codes of the format of [`Kernels::kv`]
    /// (ops::kv_quant's layout).
    pub k_cache: u64,
    pub v_cache: u64,
    /// [n_seqs, max_blocks] i32.
    pub block_tables: u64,
    pub max_blocks: usize,
    pub page: usize,
    pub kv_heads: usize,
    /// Rows of each cache (num_blocks * page): the extent of the tensor maps of `attn_prefill_ws`.
    pub rows: usize,
}

#[derive(Clone, Copy, Debug)]
pub struct AttnPrefill {
    /// [t, q_heads, hd] bf16 (normed, rotated), head h of token i at `q + i*q_tok + h*q_head`
    /// (elements); o contiguous [t, q_heads, hd].
    pub q: u64,
    pub q_tok: usize,
    pub q_head: usize,
    pub o: u64,
    pub kv: KvPages,
    /// `[n_seqs + 1]` i32 query offsets; `[n_seqs]` i32 kv lengths including the new tokens.
    pub cu_seqlens: u64,
    pub seq_lens: u64,
    /// [n_tiles, 2] i32 from [`tile_table`].
    pub tile_table: u64,
    pub n_tiles: usize,
    pub q_heads: usize,
    pub scale: f32,
}

pub fn attn_prefill(k: &Kernels, s: &CudaStream, a: &AttnPrefill) -> Result<(), CudaError> {
    attn_prefill_q(k, s, a, &KvScales::default())
}

/// [`attn_prefill`] over a cache stored in the formats the kernels were loaded for ([`Kernels::kv`]):
/// `kv.k_cache` / `kv.v_cache` hold the codes, `sc` their scales.
pub fn attn_prefill_q(k: &Kernels, s: &CudaStream, a: &AttnPrefill, sc: &KvScales) -> Result<(), CudaError> {
    prefill_launch(k, s, a, sc, None)
}

/// A prefill launch split over the keys ([`attn_prefill_split`]).
#[derive(Clone, Copy, Debug)]
pub struct PrefillSplit {
    /// Key splits per tile (grid.z).
    pub n_split: usize,
    /// The launch's queries are the step's rows `row0 .. row0 + rows` (its tiles' sequences hold
    /// exactly those); their outputs are written at `o + row` as without the split.
    pub row0: usize,
    pub rows: usize,
    /// At least [`decode_scratch_bytes`]`(rows, q_heads, n_split, head_dim)` bytes, 256-aligned: the
    /// partials, in the decode launch's layout.
    pub scratch: u64,
    pub scratch_bytes: usize,
}

/// Whether [`attn_prefill_split`] runs with these kernels: the wide prefill kernels only (sm_80 and
/// sm_90 at the 27B head dim; sm_86 / sm_89 run `attn_prefill`, unsplit).
pub fn prefill_split_supported(k: &Kernels) -> bool {
    k.attn_wide()
}

/// [`attn_prefill_q`] with each tile's keys split `sp.n_split` ways, for a few queries over a long
/// context (one tile per kv head would leave most SMs idle): the wide kernel writes each split's
/// unnormalised partials, `attn_decode_combine` merges them into `a.o` (ungated).
pub fn attn_prefill_split(
    k: &Kernels,
    s: &CudaStream,
    a: &AttnPrefill,
    sc: &KvScales,
    sp: &PrefillSplit,
) -> Result<(), CudaError> {
    const K: &str = "attn_prefill_split";
    if a.n_tiles == 0 || sp.rows == 0 {
        return Ok(());
    }
    if !prefill_split_supported(k) {
        return Err(invalid(K, "the split runs in the wide prefill kernels, not loaded here"));
    }
    let hd = k.dims.attn_head_dim;
    let need = decode_scratch_bytes(sp.rows, a.q_heads, sp.n_split, hd);
    if sp.n_split == 0 || sp.scratch_bytes < need || !sp.scratch.is_multiple_of(256) {
        return Err(invalid(K, format!("{sp:?}: need {need} B of 256-aligned scratch and n_split >= 1")));
    }
    let (part_o, part_ml) = partials(sp.scratch, sp.rows, a.q_heads, sp.n_split, hd);
    let ns = to_i32(K, "n_split", sp.n_split)?;
    prefill_launch(k, s, a, sc, Some((ns, to_i32(K, "row0", sp.row0)?, part_o, part_ml)))?;
    let o = a.o + 2 * (sp.row0 * a.q_heads * hd) as u64;
    combine(k, s, (part_o, part_ml), 0, o, (sp.rows, a.q_heads, sp.n_split), (0, 0, 0))
}

/// The partial outputs and the (max, sum) pairs in a scratch of [`decode_scratch_bytes`] for `rows`
/// rows of `q_heads` heads split `n_split` ways.
fn partials(scratch: u64, rows: usize, q_heads: usize, n_split: usize, head_dim: usize) -> (u64, u64) {
    (scratch, scratch + (4 * rows * q_heads * n_split * head_dim).div_ceil(256) as u64 * 256)
}

/// Partials of a row `attn_decode_combine` merges, at most (COMB_MAX in attention_decode.cu; the plan's
/// decode partitions are at most as many).
pub const COMBINE_MAX_SPLITS: usize = 128;
// Every decode partition count the plan allows, and the split prefill's and grouped verify's (<= 64).
const _: () = assert!(COMBINE_MAX_SPLITS >= deltaserve_plan::MAX_DECODE_PARTITIONS && COMBINE_MAX_SPLITS >= 64);

/// `attn_decode_combine` over `rows` rows of `q_heads` heads and `n_split` partials each: `seq_lens`
/// (0: every row has all `n_split`), o at `o`, `gate` (0: none) with its token and head strides.
fn combine(
    k: &Kernels,
    s: &CudaStream,
    (part_o, part_ml): (u64, u64),
    seq_lens: u64,
    o: u64,
    (rows, q_heads, n_split): (usize, usize, usize),
    (gate, qt, qh): (u64, i64, i64),
) -> Result<(), CudaError> {
    const K: &str = "attn_decode_combine";
    if n_split > COMBINE_MAX_SPLITS {
        return Err(invalid(K, format!("{n_split} partials a row; the combine takes {COMBINE_MAX_SPLITS}")));
    }
    let (hq, ns) = (to_i32(K, "q_heads", q_heads)?, to_i32(K, "n_split", n_split)?);
    let grid = (to_u32(K, "rows", rows)?, to_u32(K, "q_heads", q_heads)?, 1);
    let block = (k.dims.attn_head_dim as u32, 1, 1);
    launch_pdl!(k, s, K, grid, block, 0; part_o, part_ml, seq_lens, o, hq, ns, gate, qt, qh)
}

/// The prefill kernel's launch; `split`: (n_split, row0, part_o, part_ml) of a split launch (wide
/// kernels only).
fn prefill_launch(
    k: &Kernels,
    s: &CudaStream,
    a: &AttnPrefill,
    sc: &KvScales,
    split: Option<(i32, i32, u64, u64)>,
) -> Result<(), CudaError> {
    if a.n_tiles == 0 {
        return Ok(());
    }
    check_scales("attn_prefill", k, sc)?;
    let (k_scales, v_scales) = (sc.k, sc.v);
    let d = k.dims;
    if a.kv.kv_heads == 0 || a.q_heads != a.kv.kv_heads * d.gqa_group || a.kv.page == 0 {
        return Err(invalid("attn_prefill", format!("{a:?}: q_heads must be kv_heads * GQA_GROUP ({})", d.gqa_group)));
    }
    if a.q_head < d.attn_head_dim || a.q_tok < a.q_heads * a.q_head {
        return Err(invalid("attn_prefill", format!("{a:?}: q strides too small")));
    }
    // The kernel reads q and writes o in bf16 pairs and copies K/V rows in 16-byte chunks.
    if !a.q.is_multiple_of(4) || !a.q_tok.is_multiple_of(2) || !a.q_head.is_multiple_of(2) || !a.o.is_multiple_of(4) {
        return Err(invalid("attn_prefill", format!("{a:?}: q/o must be 4-byte aligned with even strides")));
    }
    if !a.kv.k_cache.is_multiple_of(16) || !a.kv.v_cache.is_multiple_of(16) {
        return Err(invalid("attn_prefill", format!("{a:?}: the K/V caches must be 16-byte aligned")));
    }
    let AttnPrefill { q, o, cu_seqlens, seq_lens, tile_table, scale, .. } = *a;
    let (qt, qh) = (a.q_tok as i64, a.q_head as i64);
    let KvPages { k_cache, v_cache, block_tables, .. } = a.kv;
    let mb = to_i32("attn_prefill", "max_blocks", a.kv.max_blocks)?;
    let hq = to_i32("attn_prefill", "q_heads", a.q_heads)?;
    let hkv = to_i32("attn_prefill", "kv_heads", a.kv.kv_heads)?;
    let page = to_i32("attn_prefill", "page", a.kv.page)?;
    if k.attn_wide() {
        // Q rows are copied to shared memory in 16-byte chunks.
        if !q.is_multiple_of(16) || !a.q_tok.is_multiple_of(8) || !a.q_head.is_multiple_of(8) {
            return Err(invalid("attn_prefill", format!("{a:?}: q must be 16-byte aligned with strides of 8")));
        }
        // One block per (tile of 128 packed rows, kv head, key split); a warp pair per 32 rows.
        let (n_split, row0, part_o, part_ml) = split.unwrap_or((1, 0, 0, 0));
        let grid = (
            to_u32("attn_prefill", "n_tiles", a.n_tiles)?,
            to_u32("attn_prefill", "kv_heads", a.kv.kv_heads)?,
            n_split as u32,
        );
        if let (true, Some(br)) = (k.attn.tma, tma_box_rows(a.kv.page)) {
            // The warp-specialised kernel: each cache as a tensor map [rows, kv_heads * row], a bf16 one
            // swizzled in 64-dim boxes, codes in boxes of a token-head row's bytes.
            let (hd, kvh) = (d.attn_head_dim, a.kv.kv_heads);
            // (An fp8 K's and V's codes in 128-byte swizzled boxes, K's as wgmma reads them.)
            let map = |ptr: u64, f: KvDtype, direct: bool| match f {
                KvDtype::Bf16 => tma::bf16_rows_swizzled(ptr, a.kv.rows, kvh * hd, br),
                _ if direct => tma::bytes_rows_swizzled(ptr, a.kv.rows, kvh * hd, br),
                _ => {
                    let rowb = row_bytes(f, hd);
                    tma::bytes_rows(ptr, a.kv.rows, kvh * rowb, rowb, br)
                }
            };
            let kmap = map(k_cache, k.kv.k, ws_k_codes_direct(&d, &k.kv))?;
            let vmap = map(v_cache, k.kv.v, ws_v_codes_direct(&d, &k.kv))?;
            let (box_rows, smem) = (br as i32, ws_smem_bytes(&d, &k.kv) as u32);
            // Kv heads along x: every head's tile t launches before any head's tile t + 1 (heaviest first).
            if a.n_tiles > 65_535 {
                return Err(invalid("attn_prefill", format!("{} tiles: at most 65,535 a launch", a.n_tiles)));
            }
            let grid = (grid.1, grid.0, grid.2);
            return launch!(k, s, "attn_prefill_ws", grid, (384, 1, 1), smem;
                kmap, vmap, q, k_scales, v_scales, block_tables, mb, cu_seqlens, seq_lens, tile_table, o, hq, hkv, page,
                box_rows, scale, qt, qh, n_split, row0, part_o, part_ml);
        }
        let t = AttnTiling { tma: false, ..k.attn };
        let smem = prefill_kernel_smem(&d, &k.kv, &t) as u32;
        return launch!(k, s, prefill_kernel(&t), grid, (256, 1, 1), smem;
            q, k_cache, v_cache, k_scales, v_scales, block_tables, mb, cu_seqlens, seq_lens, tile_table, o, hq, hkv,
            page, scale, qt, qh, n_split, row0, part_o, part_ml);
    }
    if split.is_some() {
        return Err(invalid("attn_prefill", "a key split needs the wide prefill kernels"));
    }
    // One block per (16-query tile, kv head, group of heads_per_block query heads); a warp pair per
    // query head.
    let hpb = k.attn.heads_per_block(d.gqa_group);
    let grid = (
        to_u32("attn_prefill", "n_tiles", a.n_tiles)?,
        to_u32("attn_prefill", "kv_heads", a.kv.kv_heads * (d.gqa_group / hpb))?,
        1,
    );
    let block = (64 * hpb as u32, 1, 1);
    let smem = prefill_smem_bytes(&d, &k.kv, &k.attn) as u32;
    launch!(k, s, "attn_prefill", grid, block, smem;
        q, k_cache, v_cache, k_scales, v_scales, block_tables, mb, cu_seqlens, seq_lens, tile_table, o, hq, hkv,
        page, scale, qt, qh)
}

#[derive(Clone, Copy, Debug)]
pub struct AttnDecode {
    /// [n_seqs, q_heads, hd] bf16 with strides like [`AttnPrefill::q`]; o contiguous.
    pub q: u64,
    pub q_tok: usize,
    pub q_head: usize,
    pub o: u64,
    pub kv: KvPages,
    /// `[n_seqs]` i32 kv lengths (>= 1).
    pub seq_lens: u64,
    /// `[n_seqs]` i32 block-table row of each query row (0: row b uses table row b).
    pub table_rows: u64,
    pub n_seqs: usize,
    pub q_heads: usize,
    /// Key-range partitions per sequence (fixed per graph bucket, e.g. 16).
    pub n_split: usize,
    /// At least [`decode_scratch_bytes`] bytes, 256-aligned.
    pub scratch: u64,
    pub scratch_bytes: usize,
    pub scale: f32,
    /// 0, or the attention output gate: o of row b head h is multiplied by sigmoid(gate[b*q_tok +
    /// h*q_head + d]) (strides as q's; the gate half of the q|gate layout is q + head_dim) in the
    /// combine step, exactly as `sigmoid_gate_mul` after it would.
    pub gate: u64,
}

/// Whether `attn_decode_mma` (tensor-core decode attention) reads caches of these formats at this
/// head dim: K and V each bf16, fp8 (e4m3), int8, or int4 when the head dim is a multiple of 64 (a
/// lane's piece of a V row is then at least 4 bytes); otherwise `attn_decode_split`.
pub fn decode_mma_supported(kv: &KvFormats, head_dim: usize) -> bool {
    head_dim.is_multiple_of(64) || (kv.k != KvDtype::Int4 && kv.v != KvDtype::Int4)
}

pub fn attn_decode(k: &Kernels, s: &CudaStream, a: &AttnDecode) -> Result<(), CudaError> {
    attn_decode_q(k, s, a, &KvScales::default())
}

/// [`attn_decode`] over a cache stored in the formats the kernels were loaded for ([`Kernels::kv`]).
pub fn attn_decode_q(k: &Kernels, s: &CudaStream, a: &AttnDecode, sc: &KvScales) -> Result<(), CudaError> {
    if a.n_seqs == 0 {
        return Ok(());
    }
    let c = decode_checks("attn_decode_split", k, a, sc)?;
    let grid = (
        to_u32("attn_decode_split", "n_seqs", a.n_seqs)?,
        to_u32("attn_decode_split", "kv_heads", a.kv.kv_heads)?,
        to_u32("attn_decode_split", "n_split", a.n_split)?,
    );
    // The tensor-core kernel: same arguments and partials (16-byte aligned caches: its vector loads).
    let mma = k.decode_mma && decode_mma_supported(&k.kv, k.dims.attn_head_dim) && c.aligned16;
    let name = if mma { "attn_decode_mma" } else { "attn_decode_split" };
    let DecodeArgs { k_scales, v_scales, mb, hq, hkv, page, ns, qt, qh, part_o, part_ml, .. } = c;
    let AttnDecode { q, o, seq_lens, table_rows, scale, gate, .. } = *a;
    let KvPages { k_cache, v_cache, block_tables, .. } = a.kv;
    launch_pdl!(k, s, name, grid, (256, 1, 1), 0;
        q, k_cache, v_cache, k_scales, v_scales, block_tables, table_rows, mb, seq_lens, part_o, part_ml, hq, hkv,
        page, scale, ns, qt, qh)?;
    combine(k, s, (part_o, part_ml), seq_lens, o, (a.n_seqs, a.q_heads, a.n_split), (gate, qt, qh))
}

/// Blocks of `attn_verify_mma` an SM holds (128 threads of ~250 registers each).
pub const VERIFY_BLOCKS_PER_SM: usize = 2;

/// Rows of one group [`attn_verify_q`] takes with kernels of these dims (0: none): its query columns
/// (VQ_COLS in attention_verify.cu, 8 × [`KernelDims::verify_ntiles`]) over the GQA group. Groups of more
/// than 6 query heads a kv head attend row by row: both warps of a pair compute a group's S, so 4 rows of
/// 8 heads (32 columns) cost more tensor-core work than the rows' own launches (one 8-column n-tile each)
/// save in loads (measured on the H200 with the 35B-A3B: verify 4.63 ms grouped, 4.40 row by row @ 32K).
pub fn verify_group_rows(d: &KernelDims) -> usize {
    if d.gqa_group > 6 { 0 } else { 8 * d.verify_ntiles() / d.gqa_group.max(1) }
}

/// Whether `attn_verify_mma` reads caches of these formats at this head dim: K and V each of codes
/// (fp8, int8, int4), a lane's share of a V row whole 32-bit words (head dims % 64, int4 V % 128).
pub fn verify_mma_supported(kv: &KvFormats, head_dim: usize) -> bool {
    let v_words = head_dim * kv.v.bits() as usize / 8 / 32;
    kv.k != KvDtype::Bf16
        && kv.v != KvDtype::Bf16
        && decode_mma_supported(kv, head_dim)
        && head_dim.is_multiple_of(32)
        && v_words > 0
        && v_words.is_multiple_of(2)
}

/// Key splits of a launch of `blocks` blocks (one an SM; `sms` SMs) up to `cap`: the fewest whose waves of
/// blocks take within 5% of the least time any split count up to the cap gives (time ∝ waves / splits);
/// at least 1. (The split prefill launches and the grouped verify rows' launches choose theirs so.)
pub fn wave_splits(sms: usize, blocks: usize, cap: usize) -> usize {
    let cap = cap.max(1);
    let time = |n: usize| (blocks.max(1) * n).div_ceil(sms.max(1)) as f64 / n as f64;
    let best = (1..=cap).map(time).fold(f64::INFINITY, f64::min);
    (1..=cap).find(|&n| time(n) <= 1.05 * best).unwrap_or(1)
}

/// Whether [`attn_verify_q`] runs `attn_verify_mma` for the groups `g` with these kernels (else the
/// rows attend one by one).
pub fn verify_groups_run(k: &Kernels, g: &RowGroups) -> bool {
    k.verify_mma && g.n > 0 && g.max_rows >= 1 && g.max_rows <= verify_group_rows(&k.dims)
}

/// Groups of consecutive query rows of [`attn_verify_q`], each of one sequence (a verify chunk's rows,
/// lengths increasing by one).
#[derive(Clone, Copy, Debug)]
pub struct RowGroups {
    /// `[n + 1]` i32: group i is rows `starts[i] .. starts[i + 1]` of the launch.
    pub starts: u64,
    pub n: usize,
    /// The most rows any group has.
    pub max_rows: usize,
}

/// [`attn_decode_q`] for rows that come in groups `g` of one sequence each (a speculative verify chunk's
/// rows): `attn_verify_mma` reads each K/V tile once for all of a group's rows, where the kernels, the
/// formats and the group sizes allow it (`a.table_rows` given); otherwise the rows attend one by one as
/// decode queries. Same arguments, partials and output.
pub fn attn_verify_q(
    k: &Kernels,
    s: &CudaStream,
    a: &AttnDecode,
    sc: &KvScales,
    g: &RowGroups,
) -> Result<(), CudaError> {
    const K: &str = "attn_verify_mma";
    if a.n_seqs == 0 || !verify_groups_run(k, g) || a.table_rows == 0 {
        return attn_decode_q(k, s, a, sc);
    }
    let c = decode_checks(K, k, a, sc)?;
    if !c.aligned16 {
        return attn_decode_q(k, s, a, sc);
    }
    if g.n > a.n_seqs {
        return Err(invalid(K, format!("{g:?}: more groups than the launch's {} rows", a.n_seqs)));
    }
    let grid = (to_u32(K, "groups", g.n)?, to_u32(K, "kv_heads", a.kv.kv_heads)?, to_u32(K, "n_split", a.n_split)?);
    let DecodeArgs { k_scales, v_scales, mb, hq, hkv, page, ns, qt, qh, part_o, part_ml, .. } = c;
    let AttnDecode { q, o, seq_lens, table_rows, scale, gate, .. } = *a;
    let KvPages { k_cache, v_cache, block_tables, .. } = a.kv;
    let starts = g.starts;
    launch_pdl!(k, s, K, grid, (128, 1, 1), 0;
        q, k_cache, v_cache, k_scales, v_scales, block_tables, table_rows, mb, seq_lens, starts, part_o, part_ml, hq,
        hkv, page, scale, ns, qt, qh)?;
    // Every row has n_split partials (those without keys hold max = -inf).
    combine(k, s, (part_o, part_ml), 0, o, (a.n_seqs, a.q_heads, a.n_split), (gate, qt, qh))
}

/// The checked scalar arguments of a decode-shaped launch.
struct DecodeArgs {
    k_scales: u64,
    v_scales: u64,
    mb: i32,
    hq: i32,
    hkv: i32,
    page: i32,
    ns: i32,
    qt: i64,
    qh: i64,
    part_o: u64,
    part_ml: u64,
    /// Both caches 16-byte aligned (the tensor-core kernels' vector loads).
    aligned16: bool,
}

fn decode_checks(kernel: &'static str, k: &Kernels, a: &AttnDecode, sc: &KvScales) -> Result<DecodeArgs, CudaError> {
    check_scales(kernel, k, sc)?;
    if k.kv != KvFormats::BF16 && (!a.kv.k_cache.is_multiple_of(4) || !a.kv.v_cache.is_multiple_of(4)) {
        return Err(invalid(kernel, format!("{a:?}: the K/V caches must be 4-byte aligned")));
    }
    let d = k.dims;
    let need = decode_scratch_bytes(a.n_seqs, a.q_heads, a.n_split, d.attn_head_dim);
    if a.kv.kv_heads == 0 || a.q_heads != a.kv.kv_heads * d.gqa_group || a.n_split == 0 || a.kv.page == 0 {
        return Err(invalid(kernel, format!("{a:?}")));
    }
    if a.scratch_bytes < need || !a.scratch.is_multiple_of(256) {
        return Err(invalid(kernel, format!("scratch {} B; need {need} B, 256-aligned", a.scratch_bytes)));
    }
    if a.q_head < d.attn_head_dim || a.q_tok < a.q_heads * a.q_head {
        return Err(invalid(kernel, format!("{a:?}: q strides too small")));
    }
    let (part_o, part_ml) = partials(a.scratch, a.n_seqs, a.q_heads, a.n_split, d.attn_head_dim);
    Ok(DecodeArgs {
        k_scales: sc.k,
        v_scales: sc.v,
        mb: to_i32(kernel, "max_blocks", a.kv.max_blocks)?,
        hq: to_i32(kernel, "q_heads", a.q_heads)?,
        hkv: to_i32(kernel, "kv_heads", a.kv.kv_heads)?,
        page: to_i32(kernel, "page", a.kv.page)?,
        ns: to_i32(kernel, "n_split", a.n_split)?,
        qt: a.q_tok as i64,
        qh: a.q_head as i64,
        part_o,
        part_ml,
        aligned16: a.kv.k_cache.is_multiple_of(16) && a.kv.v_cache.is_multiple_of(16),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const D: KernelDims = KernelDims::QWEN35_27B;

    #[test]
    fn tensor_core_decode_takes_int4_only_at_head_dims_of_64() {
        use KvDtype::*;
        for k in [Bf16, Fp8, Int8, Int4] {
            for v in [Bf16, Fp8, Int8, Int4] {
                let kv = KvFormats { k, v };
                assert!(decode_mma_supported(&kv, 256) && decode_mma_supported(&kv, 64), "{k:?}/{v:?}");
                assert_eq!(decode_mma_supported(&kv, 32), k != Int4 && v != Int4, "{k:?}/{v:?}");
            }
        }
    }

    #[test]
    fn a_verify_group_holds_four_rows_up_to_gqa_6() {
        let rows = |g: usize| {
            let d = KernelDims { gqa_group: g, ..D };
            (d.verify_ntiles(), verify_group_rows(&d))
        };
        assert_eq!(rows(6), (3, 4)); // the 27B: 24 columns
        assert_eq!(rows(4), (2, 4));
        assert_eq!(rows(2), (1, 4));
        assert_eq!(rows(1), (1, 8));
        assert_eq!(rows(8), (3, 0)); // Qwen3-Next, the 35B-A3B: the rows attend one by one
        assert_eq!(rows(64), (3, 0));
    }

    #[test]
    fn verify_groups_split_for_whole_waves() {
        // One verify chunk (a group a kv head: 4 blocks) over 132 SMs: 32 splits, one wave of 128; four
        // chunks: 8 (one wave of 128); eight: 4; a scratch of 16 splits a row caps it.
        assert_eq!(wave_splits(132, 4, 64), 32);
        assert_eq!(wave_splits(132, 16, 64), 8);
        assert_eq!(wave_splits(132, 32, 64), 4);
        assert_eq!(wave_splits(132, 4, 16), 16);
        assert_eq!(wave_splits(132, 4, 0), 1);
    }

    #[test]
    fn wide_tiles_cover_the_packed_rows() {
        // Sequences of 37, 0, 263 and 1 queries, 6 query heads per kv head: 222, 0, 1578, 6 rows.
        let cu = [0, 37, 37, 300, 301];
        let t = tile_table_for(true, 6, &cu);
        let want: Vec<(i32, i32)> =
            [(0, 2), (2, 13), (3, 1)].iter().flat_map(|&(s, n)| (0..n).map(move |i| (s, i))).collect();
        let got: Vec<(i32, i32)> = t.chunks(2).map(|p| (p[0], p[1])).collect();
        assert_eq!(got, want);
        // Never more entries than 16-query tiles (the backend's tile-table region is sized for those).
        for g in 1..=8 {
            assert!(tile_table_for(true, g, &cu).len() <= tile_table_for(false, g, &cu).len());
        }
    }
}
