//! Launcher for kernels/w4_gemm.cu: `y[m, out] = x[m, in] · Wᵀ` for an int4 linear (format in
//! [`crate::w4`]) at any number of rows, reading the int4 weights directly (no bf16 copy): the
//! projections of steps with more rows than the decode GEMV takes (batches above 8 sequences,
//! speculative verification, short prefill chunks).
//!
//! - [`w4_gemm_config`]: tokens per block and the split over K for a shape on a GPU of `sms` SMs;
//! - [`w4_gemm`]: the launch (plus, split over K, the in-order reduction of the partial sums; with
//!   act-order weights, the gather of x first);
//! - [`w4_gemm_segments`]: up to four linears sharing x (a layer's q/k/v, qkv/z/b/a, gate/up) in one
//!   launch of the tile kernels and one reduce — one wave of blocks over all their rows instead of a
//!   launch, a reduce and a tail each;
//! - [`w4_gemm_workspace_bytes`] / [`w4_gemm_x_scratch_bytes`]: the scratch a launch needs (the memory
//!   plan bounds the workspace with `deltaserve_plan::cuda::w4_gemm_workspace_bound`, and a launch
//!   takes no more splits than the workspace it is given holds).

use cudarc::driver::CudaStream;
pub use deltaserve_plan::cuda::W4_GEMM_BLOCK_ROWS as BLOCK_ROWS;
pub use deltaserve_plan::cuda::W4_GEMM_MAX_SPLITS as MAX_SPLITS;
use deltaserve_plan::cuda::{w4_gemm_partial_bytes, w4_gemm_splits, w4_gemm_tokens};

use super::w4a16::{self, W4Out, W4Weights, permute_x};
use super::{Kernels, invalid, launch_pdl, norm, to_i32, to_u32};
use crate::arena::DevSpan;
use crate::error::CudaError;
use crate::w4::W4_GROUP;

const THREADS: u32 = 128;
/// cp.async ring stages of the tile kernels (`W4G_S`).
const STAGES: usize = 4;
/// Warps of a pair-kernel block (`W4T_WARPS`): one 32-row pair each at `wpt` = 1.
const PAIR_WARPS: usize = 4;
/// Rows of a pair of the int4 format.
const PAIR_ROWS: usize = 32;
/// Blocks of the pair kernels a multiprocessor holds (at most 168 registers a thread, their launch
/// bound; 8 KB of shared memory a block), by which [`w4_gemm_config`] sizes a wave.
const PAIR_BLOCKS_PER_SM: usize = 3;
/// Rows of x up to which the pair kernels run (one tile of 16 tokens; from 17 rows the tile kernels
/// are faster at the 27B shapes: bench_w4's `bench_w4_rows`).
pub const PAIR_MAX_ROWS: usize = 16;
/// The tile kernels and their tokens per block.
pub(crate) const KERNELS: [(&str, usize); 5] =
    [("w4g_16", 16), ("w4g_24", 24), ("w4g_32", 32), ("w4g_48", 48), ("w4g_64", 64)];
/// The pair kernels: symmetric, with zero points.
pub(crate) const PAIR_KERNELS: [&str; 2] = ["w4t_16s", "w4t_16a"];

/// Dynamic shared memory of a tile-kernel block of `tokens` tokens: per stage 4 weight units of 2 KB,
/// the x tile (`tokens` × 128 bf16) and the warps' scales (4 × 64 B, `W4G_SBYTES`, which the default
/// `W4G_SMEM_SCALES` build copies with the weights; 3 blocks of 32 tokens or 2 of 64 fit an H100's /
/// H200's multiprocessor, 1 an sm_86 / sm_89 one).
pub fn smem_bytes(tokens: usize) -> usize {
    STAGES * (4 * 2048 + tokens * 2 * W4_GROUP + 4 * 64)
}

/// Dynamic shared memory of a pair-kernel block: each warp's 2 KB of partial sums (`W4T_SLOT_U4`; the
/// weights stream through registers).
pub const PAIR_SMEM_BYTES: usize = PAIR_WARPS * 2048;

/// How one [`w4_gemm`] launch tiles its work.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct W4GemmConfig {
    /// Tokens (rows of x) per block: 16, 24, 32, 48 or 64 (the pair kernels: 16).
    pub tokens: usize,
    /// Splits over K (groups of 128 columns); above 1 the partial sums go through the workspace.
    pub splits: usize,
    /// The pair kernels (`w4t_*`) with this many warps per pair (1, 2 or 4; a split's groups in that
    /// many parts, added in the block); 0: the tile kernels (`w4g_*`).
    pub wpt: usize,
}

/// The configuration for `m` rows of x through an `[out, inp]` linear on a GPU of `sms` SMs with a
/// split-K workspace of `workspace` bytes: the plan's tiling (`deltaserve_plan::cuda::w4_gemm_tokens`,
/// `w4_gemm_splits`), with no more splits than the workspace holds.
pub fn w4_gemm_config(m: usize, out: usize, inp: usize, sms: usize, workspace: usize) -> W4GemmConfig {
    if m > PAIR_MAX_ROWS {
        return w4_tile_config(m, out, inp, sms, workspace);
    }
    let (wpt, splits) = pair_tiling(out.div_ceil(PAIR_ROWS), inp, sms, true);
    W4GemmConfig { tokens: PAIR_MAX_ROWS, splits: fit_splits(splits, m, out, workspace), wpt }
}

/// `splits` halved until the partial sums of `m` rows through `out` outputs fit `workspace` bytes.
fn fit_splits(mut splits: usize, m: usize, out: usize, workspace: usize) -> usize {
    while splits > 1 && w4_gemm_partial_bytes(m.max(1), out, splits) > workspace {
        splits /= 2;
    }
    splits
}

/// Warps per pair and splits over K for a pair-kernel launch over `pairs` pairs of `inp` columns: the
/// fewest warps per pair (1, 2, 4) whose blocks fill 60% of a wave (as the decode GEMV), then (when
/// `split`) the fewest splits that do; at least 2 groups per warp and 4 per split.
fn pair_tiling(pairs: usize, inp: usize, sms: usize, split: bool) -> (usize, usize) {
    let slots = sms.max(1) * PAIR_BLOCKS_PER_SM;
    let groups = (inp / W4_GROUP).max(1);
    let blocks = |wpt: usize, splits: usize| pairs.div_ceil(PAIR_WARPS / wpt) * splits;
    let enough = |b: usize| 5 * b >= 3 * slots;
    let mut wpt = [1, 2, 4].into_iter().find(|&w| enough(blocks(w, 1))).unwrap_or(PAIR_WARPS);
    while wpt > 1 && 2 * wpt > groups {
        wpt /= 2;
    }
    let mut splits = 1;
    while split && !enough(blocks(wpt, splits)) && 2 * splits <= MAX_SPLITS && groups >= 4 * splits * wpt {
        splits *= 2;
    }
    (wpt, splits)
}

/// The tile kernels' configuration (the plan's tiling, `deltaserve_plan::cuda::w4_gemm_splits`),
/// with no more splits than the workspace holds.
pub fn w4_tile_config(m: usize, out: usize, inp: usize, sms: usize, workspace: usize) -> W4GemmConfig {
    let splits = fit_splits(w4_gemm_splits(m, out, inp, sms), m, out, workspace);
    W4GemmConfig { tokens: w4_gemm_tokens(m), splits, wpt: 0 }
}

/// Bytes of f32 partial sums a launch of `m` rows through `out` outputs with `cfg` needs (0 unsplit).
pub fn w4_gemm_workspace_bytes(m: usize, out: usize, cfg: W4GemmConfig) -> usize {
    w4_gemm_partial_bytes(m, out, cfg.splits)
}

/// Bytes of the x scratch an act-order linear needs: x gathered in device column order, bf16 `[m, in]`.
pub use deltaserve_plan::cuda::w4_x_scratch_bytes as w4_gemm_x_scratch_bytes;

/// Why [`w4_gemm`] cannot take the weights `w` (None: it can): the format's own limits, rows a multiple
/// of 4 and of at most 65535 tiles, 8-byte aligned scales and 2-byte aligned zeros, fewer than 2^31
/// chunks of qweight.
fn weights_error(w: &W4Weights) -> Option<CudaError> {
    const K: &str = "w4_gemm";
    if let Err(e) = w.check(K) {
        return Some(e);
    }
    if !w.out.is_multiple_of(4) || w.out.div_ceil(BLOCK_ROWS) > 65535 {
        return Some(invalid(K, format!("out {} (a multiple of 4, at most 65535 tiles of {BLOCK_ROWS})", w.out)));
    }
    if !w.scales.is_multiple_of(8) || w.zeros.is_some_and(|z| !z.is_multiple_of(2)) {
        return Some(invalid(K, "scales must be 8-byte and zeros 2-byte aligned"));
    }
    to_i32(K, "qweight chunks", w.out * w.inp / 32).err()
}

/// Whether [`w4_gemm`] takes `w` with x at `x` of row stride `ldx` (bf16 elements): the weights' limits
/// and 16-byte aligned x rows (act-order weights gather x into the scratch, which is).
pub fn supported(w: &W4Weights, x: u64, ldx: usize) -> bool {
    let x_ok = w.perm.is_some() || (x.is_multiple_of(16) && ldx.is_multiple_of(8));
    x_ok && weights_error(w).is_none()
}

/// `y[m, out]` (bf16, or f32 with `f32_out`; row stride `ldy`) = `x[m, in]` (bf16, row stride `ldx`)
/// · Wᵀ, f32 accumulation, for any `m`; `w.out` a multiple of 4, rows of y past `out` untouched.
/// `cfg` from [`w4_gemm_config`]; with `cfg.splits > 1`, `workspace` holds
/// [`w4_gemm_workspace_bytes`] (16-byte aligned) and a second kernel adds the splits in order
/// (deterministic). Act-order weights (`perm`) need `x_scratch` of [`w4_gemm_x_scratch_bytes`].
/// Scratch smaller than the launch needs is an error (nothing is written past a span).
#[allow(clippy::too_many_arguments)]
pub fn w4_gemm(
    k: &Kernels,
    s: &CudaStream,
    w: &W4Weights,
    x: u64,
    ldx: usize,
    y: u64,
    ldy: usize,
    m: usize,
    cfg: W4GemmConfig,
    f32_out: bool,
    workspace: Option<DevSpan>,
    x_scratch: Option<DevSpan>,
) -> Result<(), CudaError> {
    let segs = [Seg { w, y, ldy }];
    let Some(parts) = launch_gemm(k, s, &segs, x, ldx, m, cfg, f32_out, workspace, x_scratch)? else {
        return Ok(());
    };
    reduce(k, s, parts, &segs, m, cfg.splits, f32_out)
}

/// Whether [`w4_gemm_segments`] takes `outs` with x at `x` of row stride `ldx`: the linears of one
/// [`w4a16::W4Out`] list the int4 GEMV takes together (1 to 4, one input width and format, no act-order),
/// each one [`w4_gemm`] takes, into 8-byte aligned outputs.
pub fn segments_supported(outs: &[W4Out<'_>], x: u64, ldx: usize) -> bool {
    w4a16::multi_supported(outs)
        && outs.iter().all(|o| o.ldy >= o.w.out && o.y.is_multiple_of(8) && supported(o.w, x, ldx))
}

/// `y_i[m, out_i]` (bf16) = `x[m, in]` · W_iᵀ for up to four int4 linears sharing x (a layer's q/k/v,
/// qkv/z/b/a, gate/up) in one launch of the tile kernels (`cfg.wpt` 0; [`w4_gemm_config`] of their outputs
/// together) and, split over K, one reduce: the linears' row tiles side by side in one grid, their partial
/// sums side by side in the workspace. Each linear's outputs equal [`w4_gemm`]'s with the same `cfg`,
/// bitwise.
#[allow(clippy::too_many_arguments)]
pub fn w4_gemm_segments(
    k: &Kernels,
    s: &CudaStream,
    outs: &[W4Out<'_>],
    x: u64,
    ldx: usize,
    m: usize,
    cfg: W4GemmConfig,
    workspace: Option<DevSpan>,
) -> Result<(), CudaError> {
    if !segments_supported(outs, x, ldx) || cfg.wpt != 0 {
        return Err(invalid(
            "w4_gemm_segments",
            "1 to 4 linears of one input width and format, no act-order, 8-byte aligned outputs, the tile kernels",
        ));
    }
    let segs = segs_of(outs);
    let Some(parts) = launch_gemm(k, s, &segs, x, ldx, m, cfg, false, workspace, None)? else {
        return Ok(());
    };
    reduce(k, s, parts, &segs, m, cfg.splits, false)
}

/// The in-order sum of a split launch's partial sums at `parts` into each segment's y.
fn reduce(
    k: &Kernels,
    s: &CudaStream,
    parts: u64,
    segs: &[Seg<'_>],
    m: usize,
    splits: usize,
    f32_out: bool,
) -> Result<(), CudaError> {
    const K: &str = "w4_gemm";
    let ldp: usize = segs.iter().map(|g| g.w.out).sum();
    let vec = i32::from(segs.iter().all(|g| out_vec(g.y, g.ldy, f32_out) != 0));
    let (splits, f32_i, m_i, ldp_l) = (splits as i32, i32::from(f32_out), to_i32(K, "rows", m)?, ldp as i64);
    let rgrid = (to_u32(K, "reduce blocks", (m * ldp / 4).div_ceil(256))?, 1, 1);
    let [
        (q0, s0, z0, y0, l0, o0, n0),
        (q1, s1, z1, y1, l1, o1, n1),
        (q2, s2, z2, y2, l2, o2, n2),
        (q3, s3, z3, y3, l3, o3, n3),
    ] = seg_args(segs, |_| 0)?;
    launch_pdl!(k, s, "w4g_reduce", rgrid, (256, 1, 1), 0; parts, splits, m_i, ldp_l, f32_i, vec,
        q0, s0, z0, y0, l0, o0, n0, q1, s1, z1, y1, l1, o1, n1,
        q2, s2, z2, y2, l2, o2, n2, q3, s3, z3, y3, l3, o3, n3)
}

/// The kernels' four segment arguments (qweight, scales, zeros, y, ldy, out, blocks) from `segs`
/// (at most 4): `blocks(seg)` blocks each; unused segments empty.
#[allow(clippy::type_complexity)]
fn seg_args(
    segs: &[Seg<'_>],
    blocks: impl Fn(&Seg<'_>) -> usize,
) -> Result<[(u64, u64, u64, u64, i64, i32, i32); w4a16::MULTI_MAX], CudaError> {
    const K: &str = "w4_gemm";
    let mut seg = [(0u64, 0u64, 0u64, 0u64, 0i64, 0i32, 0i32); w4a16::MULTI_MAX];
    if segs.is_empty() || segs.len() > w4a16::MULTI_MAX {
        return Err(invalid(K, format!("{} linears in one launch (1 to {})", segs.len(), w4a16::MULTI_MAX)));
    }
    for (n, g) in segs.iter().enumerate() {
        let (out, nb) = (to_i32(K, "out", g.w.out)?, to_i32(K, "blocks", blocks(g))?);
        seg[n] = (g.w.qweight, g.w.scales, g.w.zeros.unwrap_or(0), g.y, g.ldy as i64, out, nb);
    }
    Ok(seg)
}

/// The residual add + RMSNorm that follows an int4 linear feeding the residual stream: `res`
/// (bf16 `[m, out]`) += the linear's output, `out` = rmsnorm_1p(res) with weight `w`.
#[derive(Clone, Copy, Debug)]
pub struct AddNorm {
    pub res: u64,
    pub w: u64,
    pub out: u64,
    pub eps: f32,
}

/// Whether [`w4_gemm_norm`] takes `w` at `cfg` with `norm`'s rows: a launch split over K (its partial
/// sums are what the norm reads) into outputs the fused norm takes.
pub fn norm_supported(w: &W4Weights, cfg: W4GemmConfig, norm: &AddNorm) -> bool {
    (2..=norm::PARTS_MAX_SPLITS).contains(&cfg.splits)
        && norm::add_rms_norm_1p_parts_supported(w.out, &[norm.res, norm.w, norm.out])
}

/// [`w4_gemm`] (bf16 outputs, split over K: `cfg.splits` ≥ 2) with the residual add + RMSNorm after
/// it in place of the reduce: `norm.res += x · Wᵀ`, `norm.out = rmsnorm_1p(norm.res)`, the sum of the
/// partial sums rounded to bf16 as [`w4_gemm`] rounds it (the same bits as `w4_gemm` into y then
/// [`norm::add_rms_norm_1p`] of y into `res`), y never written: one launch and one `[m, out]` round
/// trip fewer.
#[allow(clippy::too_many_arguments)]
pub fn w4_gemm_norm(
    k: &Kernels,
    s: &CudaStream,
    w: &W4Weights,
    x: u64,
    ldx: usize,
    m: usize,
    cfg: W4GemmConfig,
    workspace: DevSpan,
    x_scratch: Option<DevSpan>,
    norm: AddNorm,
) -> Result<(), CudaError> {
    if !norm_supported(w, cfg, &norm) {
        return Err(invalid(
            "w4_gemm_norm",
            format!(
                "{cfg:?} over {} outputs: a split over K (2..={}) into 16-byte aligned rows",
                w.out,
                norm::PARTS_MAX_SPLITS
            ),
        ));
    }
    let Some(parts) =
        launch_gemm(k, s, &[Seg { w, y: 0, ldy: w.out }], x, ldx, m, cfg, false, Some(workspace), x_scratch)?
    else {
        return Ok(());
    };
    norm::add_rms_norm_1p_parts(k, s, parts, cfg.splits, norm.res, norm.w, norm.out, m, w.out, norm.eps)
}

/// Whether y's rows take 4-row vector stores (`vec` of the kernels).
fn out_vec(y: u64, ldy: usize, f32_out: bool) -> i32 {
    let eb = if f32_out { 4 } else { 2 };
    i32::from(y.is_multiple_of(2 * eb as u64) && ldy.is_multiple_of(4))
}

/// The GEMM launch of [`w4_gemm`] / [`w4_gemm_segments`] over `segs` (one, or several sharing x through the
/// tile kernels): into each y, or split over K into the workspace's partial sums (the segments' columns side
/// by side), whose address it returns (None: nothing to reduce).
#[allow(clippy::too_many_arguments)]
fn launch_gemm(
    k: &Kernels,
    s: &CudaStream,
    segs: &[Seg<'_>],
    x: u64,
    ldx: usize,
    m: usize,
    cfg: W4GemmConfig,
    f32_out: bool,
    workspace: Option<DevSpan>,
    x_scratch: Option<DevSpan>,
) -> Result<Option<u64>, CudaError> {
    const K: &str = "w4_gemm";
    let w = segs.first().ok_or_else(|| invalid(K, "no linear"))?.w;
    for g in segs {
        if let Some(e) = weights_error(g.w) {
            return Err(e);
        }
        if g.ldy < g.w.out || ldx < g.w.inp {
            return Err(invalid(K, format!("ldx {ldx} (>= in {}), ldy {} (>= out {})", g.w.inp, g.ldy, g.w.out)));
        }
    }
    if m == 0 {
        return Ok(None);
    }
    let groups = w.inp / W4_GROUP;
    let name = if cfg.wpt == 0 {
        KERNELS.iter().find(|kn| kn.1 == cfg.tokens).map(|kn| kn.0)
    } else {
        let ok = cfg.tokens == PAIR_MAX_ROWS && [1, 2, 4].contains(&cfg.wpt) && segs.len() == 1;
        ok.then(|| PAIR_KERNELS[usize::from(w.zeros.is_some())])
    };
    let Some(name) = name.filter(|_| (1..=groups.min(MAX_SPLITS)).contains(&cfg.splits)) else {
        return Err(invalid(
            K,
            format!(
                "{cfg:?}: 16, 24, 32, 48 or 64 tokens (pairs: 16, one linear), 0, 1, 2 or 4 warps per pair, 1..={} splits",
                groups.min(MAX_SPLITS)
            ),
        ));
    };
    let (xg, ldxg) = match w.perm {
        Some(_) if segs.len() > 1 => return Err(invalid(K, "act-order weights take x gathered for them alone")),
        Some(perm) => {
            let need = w4_gemm_x_scratch_bytes(m, w.inp);
            let Some(scratch) = x_scratch.filter(|p| p.ptr.is_multiple_of(16) && p.bytes >= need).map(|p| p.ptr) else {
                return Err(invalid(K, format!("act-order weights need a 16-byte aligned x scratch of {need} B")));
            };
            permute_x(k, s, x, ldx, perm, scratch, m, w.inp)?;
            (scratch, w.inp)
        }
        None => (x, ldx),
    };
    if !xg.is_multiple_of(16) || !ldxg.is_multiple_of(8) {
        return Err(invalid(K, format!("x at {xg:#x} with row stride {ldxg} is not 16-byte aligned per row")));
    }
    let vec = i32::from(segs.iter().all(|g| out_vec(g.y, g.ldy, f32_out) != 0));
    let ldp: usize = segs.iter().map(|g| g.w.out).sum();
    let (mode, parts) = match (cfg.splits > 1, workspace) {
        (false, _) => (i32::from(f32_out), 0),
        (true, Some(ws)) if ws.ptr.is_multiple_of(16) && ws.bytes >= w4_gemm_workspace_bytes(m, ldp, cfg) => {
            (2, ws.ptr)
        }
        (true, _) => {
            let need = w4_gemm_workspace_bytes(m, ldp, cfg);
            return Err(invalid(
                K,
                format!("a launch of {} splits needs a 16-byte aligned workspace of {need} B", cfg.splits),
            ));
        }
    };
    let (sbf, ldx_l, m_i) = (w.scale_bf16(), ldxg as i64, to_i32(K, "rows", m)?);
    let inp = to_i32(K, "in", w.inp)?;
    let tiles = to_u32(K, "token tiles", m.div_ceil(cfg.tokens))?;
    if cfg.wpt == 0 {
        let rows: usize = segs.iter().map(|g| g.w.out.div_ceil(BLOCK_ROWS)).sum();
        let grid = (tiles, to_u32(K, "row tiles", rows)?, cfg.splits as u32);
        let smem = smem_bytes(cfg.tokens) as u32;
        let [
            (q0, s0, z0, y0, l0, o0, n0),
            (q1, s1, z1, y1, l1, o1, n1),
            (q2, s2, z2, y2, l2, o2, n2),
            (q3, s3, z3, y3, l3, o3, n3),
        ] = seg_args(segs, |g| g.w.out.div_ceil(BLOCK_ROWS))?;
        let ldp_l = ldp as i64;
        launch_pdl!(k, s, name, grid, (THREADS, 1, 1), smem; xg, ldx_l, m_i, inp, sbf, mode, vec, parts, ldp_l,
            q0, s0, z0, y0, l0, o0, n0, q1, s1, z1, y1, l1, o1, n1,
            q2, s2, z2, y2, l2, o2, n2, q3, s3, z3, y3, l3, o3, n3)?;
    } else {
        let seg = [if mode == 2 { Seg { w, y: parts, ldy: w.out } } else { Seg { w, y: segs[0].y, ldy: segs[0].ldy } }];
        launch_pairs(k, s, name, &seg, xg, ldxg, m, cfg.wpt, cfg.splits, mode, vec)?;
    }
    Ok((mode == 2).then_some(parts))
}

/// Whether [`w4_gemm_multi`] takes `outs` with x at `x` of row stride `ldx` for `m` rows.
pub fn multi_supported(outs: &[W4Out<'_>], x: u64, ldx: usize, m: usize) -> bool {
    m <= PAIR_MAX_ROWS && segments_supported(outs, x, ldx)
}

/// `y_i[m, out_i]` (bf16) = `x[m, in]` · W_iᵀ for up to four int4 linears sharing x (a layer's q/k/v,
/// qkv/z/b/a, gate/up) in one launch of the pair kernel, `m` at most [`PAIR_MAX_ROWS`]; no split over K
/// (no workspace), warps per pair from the linears' rows together on a GPU of `sms` SMs. Each linear's
/// outputs equal [`w4_gemm`]'s unsplit ones with the same warps per pair, bitwise.
#[allow(clippy::too_many_arguments)]
pub fn w4_gemm_multi(
    k: &Kernels,
    s: &CudaStream,
    outs: &[W4Out<'_>],
    x: u64,
    ldx: usize,
    m: usize,
    sms: usize,
) -> Result<(), CudaError> {
    const K: &str = "w4_gemm_multi";
    if !multi_supported(outs, x, ldx, m) {
        return Err(invalid(
            K,
            format!(
                "1 to 4 linears of one input width and format, no act-order, 16-byte aligned x, at most {PAIR_MAX_ROWS} rows"
            ),
        ));
    }
    if m == 0 {
        return Ok(());
    }
    let wpt = multi_wpt(outs, sms);
    let segs = segs_of(outs);
    let vec = i32::from(outs.iter().all(|o| o.ldy.is_multiple_of(4)));
    launch_pairs(k, s, PAIR_KERNELS[usize::from(outs[0].w.zeros.is_some())], &segs, x, ldx, m, wpt, 1, 0, vec)
}

/// Warps per pair of a [`w4_gemm_multi`] launch over `outs` on a GPU of `sms` SMs.
pub fn multi_wpt(outs: &[W4Out<'_>], sms: usize) -> usize {
    let pairs: usize = outs.iter().map(|o| o.w.out.div_ceil(PAIR_ROWS)).sum();
    pair_tiling(pairs, outs.first().map_or(W4_GROUP, |o| o.w.inp), sms, false).0
}

/// One segment of a pair-kernel launch: a linear, where its outputs go and their row stride.
struct Seg<'a> {
    w: &'a W4Weights,
    y: u64,
    ldy: usize,
}

/// The segments of the linears `outs`, in order.
fn segs_of<'a>(outs: &[W4Out<'a>]) -> Vec<Seg<'a>> {
    outs.iter().map(|o| Seg { w: o.w, y: o.y, ldy: o.ldy }).collect()
}

/// Launches pair kernel `name` over `segs` (checked by the caller; more than one only unsplit).
#[allow(clippy::too_many_arguments)]
fn launch_pairs(
    k: &Kernels,
    s: &CudaStream,
    name: &'static str,
    segs: &[Seg<'_>],
    x: u64,
    ldx: usize,
    m: usize,
    wpt: usize,
    splits: usize,
    mode: i32,
    vec: i32,
) -> Result<(), CudaError> {
    const K: &str = "w4_gemm";
    let per_block = |g: &Seg<'_>| g.w.out.div_ceil(PAIR_ROWS).div_ceil(PAIR_WARPS / wpt);
    let blocks: usize = segs.iter().map(per_block).sum();
    let seg = seg_args(segs, per_block)?;
    let first = segs[0].w;
    let grid = (to_u32(K, "pair blocks", blocks)?, to_u32(K, "token tiles", m.div_ceil(PAIR_MAX_ROWS))?, splits as u32);
    let (ldx_l, m_i, inp) = (ldx as i64, to_i32(K, "rows", m)?, to_i32(K, "in", first.inp)?);
    let (sbf, wpt_i, smem) = (first.scale_bf16(), wpt as i32, PAIR_SMEM_BYTES as u32);
    let [
        (q0, s0, z0, y0, l0, o0, n0),
        (q1, s1, z1, y1, l1, o1, n1),
        (q2, s2, z2, y2, l2, o2, n2),
        (q3, s3, z3, y3, l3, o3, n3),
    ] = seg;
    launch_pdl!(k, s, name, grid, (THREADS, 1, 1), smem; x, ldx_l, m_i, inp, sbf, mode, vec, wpt_i,
        q0, s0, z0, y0, l0, o0, n0, q1, s1, z1, y1, l1, o1, n1,
        q2, s2, z2, y2, l2, o2, n2, q3, s3, z3, y3, l3, o3, n3)
}

#[cfg(test)]
mod tests {
    use super::*;

    const H200: usize = 132;

    #[test]
    fn tokens_per_block_follow_the_rows() {
        for (m, tokens) in [
            (1, 16),
            (9, 16),
            (16, 16),
            (17, 24),
            (24, 24),
            (25, 32),
            (32, 32),
            (33, 48),
            (48, 48),
            (49, 32),
            (64, 32),
            (65, 48),
            (96, 48),
            (97, 64),
            (128, 64),
            (144, 48),
            (200, 64),
            (256, 64),
        ] {
            assert_eq!(w4_tile_config(m, 17408, 5120, H200, usize::MAX).tokens, tokens, "m = {m}");
            assert_eq!(w4_gemm_config(m, 17408, 5120, H200, usize::MAX).tokens, tokens, "m = {m}");
        }
    }

    #[test]
    fn splits_fill_the_gpu_within_their_bounds() {
        let c = |m, out, inp| w4_tile_config(m, out, inp, H200, usize::MAX).splits;
        // 2.4 blocks per SM: 317 on the H200. 5120 x 5120 at 9..16 rows: 40 blocks, 8 splits (320).
        assert_eq!(c(16, 5120, 5120), 8);
        assert_eq!(c(9, 5120, 5120), 8);
        // down (5120 x 17408) at 32 rows: 40 blocks, 8 splits.
        assert_eq!(c(32, 5120, 17408), 8);
        // gate / up (17408 x 5120): 136 row tiles; 4 splits at 16 rows, 2 at 64 (two token tiles).
        assert_eq!(c(16, 17408, 5120), 4);
        assert_eq!(c(64, 17408, 5120), 2);
        // One 48-token tile at 33..48 rows: the most splits that fit one wave of 2 blocks an SM (264) where
        // they fill 85% of it: down at 48 rows, 40 tiles, 6 splits (240); in-proj 80 tiles, 3 (240); else
        // the powers of two: q 96 tiles, 4 (two splits would fill 73%).
        assert_eq!(c(48, 5120, 17408), 6);
        assert_eq!(c(40, 10240, 5120), 3);
        assert_eq!(c(48, 12288, 5120), 4);
        // Above 64 rows the 64-token tile, 2.6 blocks an SM: 344 on the H200. gate / up at 128 rows:
        // 272 tiles, 2 splits; at 256 rows 544 tiles, none; down at 128 rows: 80 tiles, 8 splits.
        assert_eq!(c(128, 17408, 5120), 2);
        assert_eq!(c(256, 17408, 5120), 1);
        assert_eq!(c(128, 5120, 17408), 8);
        // Enough blocks: no split; 100 rows of the 5120 x 5120 shape: 80 tiles, 8 splits (640).
        assert_eq!(c(100, 5120, 5120), 8);
        assert_eq!(c(200, 12288, 5120), 1);
        // Few groups: at least 4 per split (the tiny model's 128 x 256: 2 groups, no split).
        assert_eq!(c(4, 128, 256), 1);
        assert_eq!(c(1, 256, 1024), 2);
        // Never more than MAX_SPLITS, never 0 (a GPU of 1 SM, an empty launch).
        assert_eq!(c(1, 128, 128 * 1024), MAX_SPLITS);
        assert_eq!(w4_tile_config(0, 5120, 5120, 0, usize::MAX).splits, 1);
    }

    #[test]
    fn pair_kernels_fill_a_wave_with_warps_per_pair_before_splits() {
        let c = |m, out, inp| {
            let cfg = w4_gemm_config(m, out, inp, H200, usize::MAX);
            (cfg.tokens, cfg.wpt, cfg.splits)
        };
        // 396 blocks on the H200; 60% of them: 238.
        // 5120 x 5120 at 12 rows: 160 pairs, 4 warps each = 160 blocks; 2 splits = 320.
        assert_eq!(c(12, 5120, 5120), (16, 4, 2));
        // gate / up at 12 rows: 544 pairs, 2 warps each = 272 blocks.
        assert_eq!(c(12, 17408, 5120), (16, 2, 1));
        // in_proj_qkv at 16 rows: 320 pairs, 4 warps each.
        assert_eq!(c(16, 10240, 5120), (16, 4, 1));
        // Few groups: at least 2 a warp (the tiny model's 128 x 256: 2 groups).
        assert_eq!(c(12, 128, 256), (16, 1, 1));
        // From 17 rows the tile kernels.
        assert_eq!(c(17, 5120, 17408).2, w4_tile_config(17, 5120, 17408, H200, usize::MAX).splits);
        assert_eq!(c(17, 5120, 17408).1, 0);
        assert_eq!(w4_gemm_config(0, 5120, 5120, 0, usize::MAX).splits, 1);
        // One launch over several linears: the warps per pair of their pairs together, no split
        // (qkv / z / b / a of the 27B: 320 + 192 + 2 + 2 pairs).
        assert_eq!(pair_tiling(516, 5120, H200, false), (2, 1));
    }

    #[test]
    fn workspace_stays_within_the_planned_bound_and_the_given_bytes() {
        use deltaserve_plan::cuda::{W4_GEMM_MAX_ROWS, w4_gemm_workspace_bound};
        for (out, inp) in [(5120, 5120), (17408, 5120), (5120, 17408), (12288, 5120), (1024, 5120), (48, 5120)] {
            let bound = w4_gemm_workspace_bound(out, inp, W4_GEMM_MAX_ROWS);
            assert!(bound <= MAX_SPLITS * W4_GEMM_MAX_ROWS * out * 4, "[{out}, {inp}]: {bound}");
            for m in 1..=W4_GEMM_MAX_ROWS {
                let cfg = w4_gemm_config(m, out, inp, H200, bound);
                assert!(w4_gemm_workspace_bytes(m, out, cfg) <= bound, "[{out}, {inp}] m = {m}");
                // Unbounded, the same split (the plan's bound never costs a split).
                assert_eq!(cfg, w4_gemm_config(m, out, inp, H200, usize::MAX), "[{out}, {inp}] m = {m}");
                let tile = w4_tile_config(m, out, inp, H200, bound);
                assert_eq!(tile, w4_tile_config(m, out, inp, H200, usize::MAX), "[{out}, {inp}] m = {m}");
                // A smaller workspace: fewer splits, never more bytes than given.
                let small = w4_gemm_config(m, out, inp, H200, 2 * m * out * 4);
                assert!(small.splits <= 2);
            }
            assert_eq!(w4_gemm_config(16, out, inp, H200, 0).splits, 1);
        }
        let cfg = W4GemmConfig { tokens: 16, splits: 3, wpt: 1 };
        assert_eq!(w4_gemm_workspace_bytes(10, 5120, cfg), 3 * 10 * 5120 * 4);
        assert_eq!(w4_gemm_workspace_bytes(10, 5120, W4GemmConfig { splits: 1, ..cfg }), 0);
        assert_eq!(w4_gemm_x_scratch_bytes(3, 5120), 3 * 5120 * 2);
    }

    #[test]
    fn every_kernel_is_compiled_with_the_module() {
        let module = crate::nvrtc::SOURCES.iter().find(|s| s.module == "w4_gemm").expect("w4_gemm module");
        for (name, tokens) in KERNELS {
            assert!(module.functions.contains(&name), "{name}");
            assert!(smem_bytes(tokens) <= 99 * 1024, "{name}: fits sm_86's 99 KB per block");
        }
        for name in PAIR_KERNELS {
            assert!(module.functions.contains(&name), "{name}");
        }
        const { assert!(PAIR_SMEM_BYTES * PAIR_BLOCKS_PER_SM <= 99 * 1024, "fits sm_86 shared memory per SM") };
        assert!(module.functions.contains(&"w4g_reduce"));
    }
}
