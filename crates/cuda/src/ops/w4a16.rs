//! Launchers for kernels/w4a16.cu: 4-bit weights with bf16 activations (format in [`crate::w4`]).
//!
//! - [`w4_gemv`]: decode projections `y[m, out] = x[m, in] · Wᵀ` for any `m` (8 tokens per launch);
//! - [`w4_gemv_multi`]: up to four linears sharing x in one launch (a layer's q/k/v, qkv/z/b/a, gate/up);
//! - [`w4_gemv_fold`]: the same with the residual add + RMSNorm between two projections folded into them
//!   ([`Fold`]);
//! - [`w4_dequant`]: rows `r0..r1` of `W` to a bf16 `[r1 − r0, in]` tile (prefill: dequantise an
//!   N-slice into a bounded scratch, then a cuBLASLt bf16 GEMM on it);
//! - [`w4_quantize`]: bf16 rows of a linear to the format on the GPU (`--quantize int4` at load).

use cudarc::driver::CudaStream;
use deltaserve_plan::workspace::FOLD_TOKENS;

use super::{Kernels, invalid, launch, launch_pdl, to_i32, to_u32};
use crate::error::CudaError;
use crate::w4::{ScaleDtype, W4_GROUP, W4Bytes, W4Linear};

/// Tokens per GEMV launch (the MMA's n).
pub const GEMV_MAX_M: usize = 8;
const WARPS: usize = 8;
/// Threads per block of the pair kernel.
pub const BLOCK_THREADS: u32 = (WARPS * 32) as u32;

/// One int4 linear in device memory (pointers into the weights arena).
#[derive(Clone, Copy, Debug)]
pub struct W4Weights {
    /// u32 × `out·in/8`, tile-major ([`crate::w4`]), 16-byte aligned.
    pub qweight: u64,
    /// u16 `[in/128, out]`.
    pub scales: u64,
    pub scale_dtype: ScaleDtype,
    /// u8 `[in/128, ceil(out/2)]`; `None` = symmetric.
    pub zeros: Option<u64>,
    /// i32 `[in]`; `None` = identity.
    pub perm: Option<u64>,
    pub out: usize,
    pub inp: usize,
}

impl W4Weights {
    pub(crate) fn check(&self, kernel: &'static str) -> Result<(), CudaError> {
        W4Linear::check_shape(kernel, self.out, self.inp)?;
        if !self.qweight.is_multiple_of(16) {
            return Err(invalid(kernel, format!("qweight at {:#x} is not 16-byte aligned", self.qweight)));
        }
        Ok(())
    }

    /// The tensors of an `[out, in]` linear placed from `base` as [`W4Bytes::layout`] places them
    /// with the arena's alignment (what the plan charges per int4 linear); `base` 256-byte aligned.
    pub fn at(base: u64, out: usize, inp: usize, asym: bool, perm: bool, scale_dtype: ScaleDtype) -> W4Weights {
        let (offs, _) = W4Bytes::new(out, inp, asym, perm).layout(crate::arena::ALIGN);
        W4Weights {
            qweight: base,
            scales: base + offs[1] as u64,
            scale_dtype,
            zeros: asym.then_some(base + offs[2] as u64),
            perm: perm.then_some(base + offs[3] as u64),
            out,
            inp,
        }
    }

    /// Device bytes of this linear's tensors.
    pub fn bytes(&self) -> W4Bytes {
        W4Bytes::new(self.out, self.inp, self.zeros.is_some(), self.perm.is_some())
    }

    pub(crate) fn scale_bf16(&self) -> i32 {
        i32::from(self.scale_dtype == ScaleDtype::Bf16)
    }
}

/// Every pair kernel (row loads x output dtype x zero points x scale dtype): `w4p_*` for segments whose
/// rows are multiples of 4 (one load for a lane's 4 scales and zeros), `w4ps_*` for any.
pub(crate) const PAIR_KERNELS: [&str; 16] = [
    "w4p_hsh", "w4p_hsb", "w4p_hah", "w4p_hab", "w4p_fsh", "w4p_fsb", "w4p_fah", "w4p_fab", "w4ps_hsh", "w4ps_hsb",
    "w4ps_hah", "w4ps_hab", "w4ps_fsh", "w4ps_fsb", "w4ps_fah", "w4ps_fab",
];

/// Every folded pair kernel (bf16 outputs; row loads x zero points x scale dtype): `w4pf_*`, `w4pfs_*`.
pub(crate) const FOLD_KERNELS: [&str; 8] =
    ["w4pf_sh", "w4pf_sb", "w4pf_ah", "w4pf_ab", "w4pfs_sh", "w4pfs_sb", "w4pfs_ah", "w4pfs_ab"];

/// The pair kernel for an output dtype, zero points and scale dtype (see kernels/w4a16.cu), or with
/// `fold` the folded one (bf16 outputs); `vec`: every segment's rows (and its linear's) are a multiple
/// of 4. One body per kernel: the two side by side made the decode step slower
/// (bench/results/int4-gemv-one-body-h200-2026-12-01.md).
fn pair_kernel(f32_out: bool, asym: bool, bf16_scales: bool, fold: bool, vec: bool) -> &'static str {
    let rows = usize::from(!vec);
    if fold {
        return FOLD_KERNELS[4 * rows + 2 * usize::from(asym) + usize::from(bf16_scales)];
    }
    PAIR_KERNELS[8 * rows + 4 * usize::from(f32_out) + 2 * usize::from(asym) + usize::from(bf16_scales)]
}

/// Dynamic shared memory of a pair-kernel block: 1 KB per warp, where the warps of a pair add their sums
/// (kernels/w4_pair.cuh `W4P_WARP_U4`; the weights stream through registers).
pub const PAIR_SMEM_BYTES: usize = WARPS * 1024;
/// Output rows per warp of the pair kernel (two 16-row MMA tiles).
const PAIR_ROWS: usize = 32;

/// Warps per 32-row pair of one GEMV shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GemvConfig {
    /// Warps sharing one pair's groups (split-K inside a block): 1, 2, 4 or 8.
    pub wpt: usize,
    /// Blocks the GPU holds at once ([`Kernels::w4_slots`]; 0: never split a thin last wave, see
    /// [`launch_segments`]).
    pub slots: usize,
}

/// The configuration for a launch of `out` rows (summed over its linears) × `inp` on a GPU that holds
/// `slots` blocks at once ([`Kernels::w4_slots`]): the fewest warps per pair (1, 2, 4, 8) whose blocks
/// fill at least 60% of that wave (else 8), and no more than half as many warps as there are groups. Fewer warps
/// per pair means fewer, longer blocks (fewer pipeline fills, no reduction); 60% of a wave keeps the
/// SMs busy enough. On the H200 this picks the fastest of the four at every measured shape
/// (bench/results/int4-gemv-waves-h200-2026-11-30.md; gate+up 34,816 × 5,120: 2, which with the
/// thin-wave split of [`launch_segments`] runs in one wave and a short tail).
pub fn gemv_config(out: usize, inp: usize, slots: usize) -> GemvConfig {
    let pairs = out.div_ceil(PAIR_ROWS);
    let groups = (inp / W4_GROUP).max(1);
    let slots = slots.max(1);
    let want = [1, 2, 4].into_iter().find(|&w| 5 * pairs.div_ceil(WARPS / w) >= 3 * slots).unwrap_or(WARPS);
    GemvConfig { wpt: fit_wpt(want, groups), slots }
}

/// Warps per pair for `groups` groups: at most `want`, and no more than half as many as the groups.
fn fit_wpt(want: usize, groups: usize) -> usize {
    let mut wpt = want;
    while wpt > 1 && wpt * 2 > groups {
        wpt /= 2;
    }
    wpt
}

/// One segment of a GEMV launch: pairs `pair0 .. pair0 + pairs` of linear `linear`, `wpt` warps per
/// pair.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Segment {
    pub linear: usize,
    pub pair0: usize,
    pub pairs: usize,
    pub wpt: usize,
}

/// The segments of a launch over linears of `pairs[i]` pairs and `groups` groups: each linear at
/// `cfg.wpt`, except that when the launch's blocks end in a thin wave (more blocks than `cfg.slots`,
/// the remainder at most a quarter of them) that wave's pairs, taken from the end of the launch,
/// run with 8 warps per pair (or as many as the groups allow) in as many more, shorter blocks: the
/// thin wave then costs a fraction of a full one (gate+up at the 27B shape: 272 blocks of 20 units
/// per warp on 264 slots; 1,056 pairs at 2 warps, the last 32 at 8). At most [`MULTI_MAX`]
/// segments (otherwise no split).
pub fn launch_segments(pairs: &[usize], groups: usize, cfg: GemvConfig) -> Vec<Segment> {
    let whole: Vec<Segment> =
        pairs.iter().enumerate().map(|(linear, &p)| Segment { linear, pair0: 0, pairs: p, wpt: cfg.wpt }).collect();
    let ppb = WARPS / cfg.wpt;
    let blocks: usize = pairs.iter().map(|p| p.div_ceil(ppb)).sum();
    let tail_wpt = fit_wpt(WARPS, groups);
    if cfg.slots == 0 || tail_wpt <= cfg.wpt || blocks <= cfg.slots {
        return whole;
    }
    let thin = blocks % cfg.slots;
    if thin == 0 || 4 * thin > cfg.slots {
        return whole;
    }
    // The last `thin` blocks' pairs, from the last linear backwards (a linear's last block may hold
    // fewer than ppb pairs).
    let mut segs = Vec::new();
    let mut left = thin;
    let mut tails = Vec::new();
    for (i, &p) in pairs.iter().enumerate().rev() {
        let nb = p.div_ceil(ppb);
        let take = left.min(nb);
        left -= take;
        let main = (nb - take) * ppb;
        tails.push((i, main.min(p)));
        if left == 0 {
            break;
        }
    }
    for (i, &p) in pairs.iter().enumerate() {
        let main = tails.iter().find(|t| t.0 == i).map_or(p, |t| t.1);
        if main > 0 {
            segs.push(Segment { linear: i, pair0: 0, pairs: main, wpt: cfg.wpt });
        }
    }
    for &(i, main) in tails.iter().rev() {
        segs.push(Segment { linear: i, pair0: main, pairs: pairs[i] - main, wpt: tail_wpt });
    }
    if segs.len() > MULTI_MAX { whole } else { segs }
}

/// `y[m, out]` (bf16, row stride `ldy`) = `x[m, in]` (bf16, row stride `ldx`) · Wᵀ, f32 accumulation.
/// `cfg` from [`gemv_config`]. Act-order weights (`perm`) need `x_scratch`: bf16 `[min(m, 8), in]`,
/// where x is gathered in the device column order.
#[allow(clippy::too_many_arguments)]
pub fn w4_gemv(
    k: &Kernels,
    s: &CudaStream,
    w: &W4Weights,
    x: u64,
    ldx: usize,
    y: u64,
    ldy: usize,
    m: usize,
    cfg: GemvConfig,
    x_scratch: Option<u64>,
) -> Result<(), CudaError> {
    w4_gemv_out(k, s, w, x, ldx, y, ldy, m, cfg, x_scratch, false)
}

/// [`w4_gemv`] with `y` in f32 when `f32_out` (int4 lm_head logits), else bf16.
#[allow(clippy::too_many_arguments)]
pub fn w4_gemv_out(
    k: &Kernels,
    s: &CudaStream,
    w: &W4Weights,
    x: u64,
    ldx: usize,
    y: u64,
    ldy: usize,
    m: usize,
    cfg: GemvConfig,
    x_scratch: Option<u64>,
    f32_out: bool,
) -> Result<(), CudaError> {
    const K: &str = "w4_gemv";
    w.check(K)?;
    if m == 0 {
        return Ok(());
    }
    if ldy < w.out || ldx < w.inp {
        return Err(invalid(K, format!("ldx {ldx} < in {} or ldy {ldy} < out {}", w.inp, w.out)));
    }
    if w.perm.is_none() && (!x.is_multiple_of(16) || !ldx.is_multiple_of(8)) {
        return Err(invalid(K, format!("x at {x:#x} with row stride {ldx} is not 16-byte aligned per row")));
    }
    if w.perm.is_some() && x_scratch.is_none_or(|p| !p.is_multiple_of(16)) {
        return Err(invalid(K, "act-order weights need a 16-byte aligned x scratch of [8, in] bf16"));
    }
    for m0 in (0..m).step_by(GEMV_MAX_M) {
        let mc = (m - m0).min(GEMV_MAX_M);
        let xc = x + 2 * (m0 * ldx) as u64;
        let yc = y + (if f32_out { 4 } else { 2 } * m0 * ldy) as u64;
        let (xg, ldxg) = match (w.perm, x_scratch) {
            (Some(perm), Some(scratch)) => {
                permute_x(k, s, xc, ldx, perm, scratch, mc, w.inp)?;
                (scratch, w.inp as i64)
            }
            _ => (xc, ldx as i64),
        };
        launch_pair(k, s, &[W4Out { w, y: yc, ldy }], xg, ldxg, mc, cfg, f32_out, Fold::None)?;
    }
    Ok(())
}

/// `scratch[r, j] = x[r, perm[j]]` for `r < m` (bf16, `scratch` row stride `inp`): x gathered in the
/// device column order of an act-order linear.
#[allow(clippy::too_many_arguments)]
pub(crate) fn permute_x(
    k: &Kernels,
    s: &CudaStream,
    x: u64,
    ldx: usize,
    perm: u64,
    scratch: u64,
    m: usize,
    inp: usize,
) -> Result<(), CudaError> {
    const K: &str = "w4_permute_x";
    let (ldx_l, m_i, inp_i) = (ldx as i64, to_i32(K, "rows", m)?, to_i32(K, "in", inp)?);
    let grid = ((m * inp).div_ceil(256).min(1 << 16) as u32, 1, 1);
    launch!(k, s, K, grid, (256, 1, 1), 0; x, ldx_l, perm, scratch, m_i, inp_i)
}

/// One linear of [`w4_gemv_multi`]: its weights and `y[m, out]` (row stride `ldy`).
#[derive(Clone, Copy, Debug)]
pub struct W4Out<'a> {
    pub w: &'a W4Weights,
    pub y: u64,
    pub ldy: usize,
}

/// Linears one [`w4_gemv_multi`] launch takes at most.
pub const MULTI_MAX: usize = 4;

/// Whether [`w4_gemv_multi`] takes these linears in one launch: 1 to [`MULTI_MAX`] of the same input
/// width, zero points and scale dtype, none act-order (each would need its own permuted x).
pub fn multi_supported(outs: &[W4Out<'_>]) -> bool {
    let Some(first) = outs.first() else { return false };
    outs.len() <= MULTI_MAX
        && outs.iter().all(|o| {
            o.w.perm.is_none()
                && o.w.inp == first.w.inp
                && o.w.zeros.is_some() == first.w.zeros.is_some()
                && o.w.scale_dtype == first.w.scale_dtype
        })
}

/// `y_i[m, out_i] = x[m, in] · W_iᵀ` for up to four linears sharing x (a layer's q/k/v, qkv/z/b/a, gate/up)
/// in one launch of the pair kernel per 8 tokens, `cfg.wpt` warps per 32-row pair (see
/// [`gemv_config`] over the summed rows). Each linear's rows equal its [`w4_gemv`] rows with the same
/// `cfg` bitwise, except those the launch's thin last wave runs with more warps per pair
/// ([`launch_segments`]: then equal to rounding).
#[allow(clippy::too_many_arguments)]
pub fn w4_gemv_multi(
    k: &Kernels,
    s: &CudaStream,
    outs: &[W4Out<'_>],
    x: u64,
    ldx: usize,
    m: usize,
    cfg: GemvConfig,
    f32_out: bool,
) -> Result<(), CudaError> {
    const K: &str = "w4_gemv_multi";
    check_multi(K, outs, x, ldx)?;
    let eb = if f32_out { 4 } else { 2 };
    for m0 in (0..m).step_by(GEMV_MAX_M) {
        let mc = (m - m0).min(GEMV_MAX_M);
        let chunk: Vec<W4Out<'_>> = outs.iter().map(|o| W4Out { y: o.y + (eb * m0 * o.ldy) as u64, ..*o }).collect();
        launch_pair(k, s, &chunk, x + 2 * (m0 * ldx) as u64, ldx as i64, mc, cfg, f32_out, Fold::None)?;
    }
    Ok(())
}

/// What [`w4_gemv_multi`] requires of its linears and x.
fn check_multi(kernel: &'static str, outs: &[W4Out<'_>], x: u64, ldx: usize) -> Result<(), CudaError> {
    if !multi_supported(outs) {
        return Err(invalid(kernel, "1 to 4 linears of one input width and format, without act-order"));
    }
    let inp = outs[0].w.inp;
    for o in outs {
        o.w.check(kernel)?;
        if o.ldy < o.w.out {
            return Err(invalid(kernel, format!("ldy {} < out {}", o.ldy, o.w.out)));
        }
    }
    if ldx < inp || !x.is_multiple_of(16) || !ldx.is_multiple_of(8) {
        return Err(invalid(kernel, format!("x at {x:#x} with row stride {ldx} (in {inp}): 16-byte aligned rows")));
    }
    Ok(())
}

/// The residual add + RMSNorm between two int4 decode projections, folded into them (kernels/w4a16.cu,
/// `W4Fold`): the first writes the residual stream, the norm's input before its 1/rms and the sums of
/// squares; the second scales its outputs by 1/rms. Sums: f32 `[ceil(d / 32), 8]` ([`fold_sums_bytes`]).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub enum Fold {
    /// A plain GEMV.
    #[default]
    None,
    /// One linear whose `y` is the residual stream `h` `[m, out]` (bf16, read and written):
    /// `h = bf16(h + bf16(x·Wᵀ))`, `x_out[m, r] = bf16(h · (1 + norm_w[r]))` (bf16, row stride `ldy`), and
    /// `sums` the per-32-row sums of `h²`.
    Residual { x_out: u64, norm_w: u64, sums: u64 },
    /// `x` is a `Residual` launch's `x_out` (row length `in`); every output is scaled by
    /// `rsqrt(Σ h² / in + eps)` from its `sums`.
    Norm { sums: u64, eps: f32 },
}

// A fold's sums hold FOLD_TOKENS tokens per 32-row pair (the plan sizes `fold_sums` by it): a launch's tokens.
const _: () = assert!(FOLD_TOKENS == GEMV_MAX_M);
/// Shared memory a folded launch adds after the sums (kernels/w4_pair.cuh `W4_FOLD_SMEM`): mode 1's staged
/// residual and norm weights, mode 2's staged sums.
const FOLD_SMEM_BYTES: usize = 8192;
/// The widest rows a fold normalises (`W4_FOLD_MAX_D`: mode 2's sums fill the staging).
pub const FOLD_MAX_D: usize = 8192;

/// Whether rows of `d` elements fold ([`Fold`]): at most [`FOLD_MAX_D`], a multiple of the int4 group.
pub fn fold_supported(d: usize) -> bool {
    d <= FOLD_MAX_D && d.is_multiple_of(W4_GROUP)
}

/// Dynamic shared memory of a `w4pf_*` launch: the sums, then the fold's staging.
pub const FOLD_KERNEL_SMEM_BYTES: usize = PAIR_SMEM_BYTES + FOLD_SMEM_BYTES;

/// Bytes of a fold's sums for rows of `d` elements.
pub fn fold_sums_bytes(d: usize) -> usize {
    d.div_ceil(PAIR_ROWS) * FOLD_TOKENS * 4
}

/// [`w4_gemv_multi`] for one launch (`m` <= 8 tokens, bf16 outputs) with `fold`: a [`Fold::Residual`]
/// launch takes one linear, whose `y` is the residual stream.
#[allow(clippy::too_many_arguments)]
pub fn w4_gemv_fold(
    k: &Kernels,
    s: &CudaStream,
    outs: &[W4Out<'_>],
    x: u64,
    ldx: usize,
    m: usize,
    cfg: GemvConfig,
    fold: Fold,
) -> Result<(), CudaError> {
    const K: &str = "w4_gemv_fold";
    check_multi(K, outs, x, ldx)?;
    if m > GEMV_MAX_M {
        return Err(invalid(K, format!("{m} tokens: a fold is one launch of at most {GEMV_MAX_M}")));
    }
    match fold {
        Fold::None => {}
        Fold::Residual { x_out, norm_w, sums } => {
            if outs.len() != 1 || !fold_supported(outs[0].w.out) {
                return Err(invalid(
                    K,
                    format!(
                        "a residual fold launches one linear of at most {FOLD_MAX_D} rows, a multiple of {W4_GROUP}"
                    ),
                ));
            }
            let o = &outs[0];
            if !sums.is_multiple_of(16)
                || !x_out.is_multiple_of(8)
                || !o.y.is_multiple_of(8)
                || !o.ldy.is_multiple_of(4)
            {
                return Err(invalid(K, "fold sums must be 16-byte aligned, x_out and y 8-byte, ldy a multiple of 4"));
            }
            if !norm_w.is_multiple_of(8) {
                return Err(invalid(K, "the norm weight must be 8-byte aligned"));
            }
        }
        Fold::Norm { sums, .. } => {
            if !fold_supported(outs[0].w.inp) {
                return Err(invalid(
                    K,
                    format!("a norm fold takes x rows of at most {FOLD_MAX_D}, a multiple of {W4_GROUP}"),
                ));
            }
            if !sums.is_multiple_of(16) {
                return Err(invalid(K, "fold sums must be 16-byte aligned"));
            }
        }
    }
    launch_pair(k, s, outs, x, ldx as i64, m, cfg, false, fold)
}

/// One launch of the pair kernel over `outs` (checked by the caller: 1..=4 linears of one format,
/// input x already in the device column order), `mc` <= 8 tokens.
#[allow(clippy::too_many_arguments)]
fn launch_pair(
    k: &Kernels,
    s: &CudaStream,
    outs: &[W4Out<'_>],
    x: u64,
    ldx: i64,
    mc: usize,
    cfg: GemvConfig,
    f32_out: bool,
    fold: Fold,
) -> Result<(), CudaError> {
    const K: &str = "w4_gemv";
    if ![1, 2, 4, 8].contains(&cfg.wpt) {
        return Err(invalid(K, format!("warps per pair must be 1, 2, 4 or 8, got {}", cfg.wpt)));
    }
    let first = outs[0].w;
    for o in outs {
        if !o.w.scales.is_multiple_of(8) || o.w.zeros.is_some_and(|z| !z.is_multiple_of(4)) {
            return Err(invalid(K, "scales must be 8-byte and zeros 4-byte aligned"));
        }
        // The kernel indexes qweight by 32-bit 16-byte chunks.
        to_i32(K, "qweight chunks", o.w.out * o.w.inp / 32)?;
    }
    let groups = first.inp / W4_GROUP;
    // Kernel segments: (qweight, scales, zeros, y, ldy, rows, scale row stride, wpt, blocks); unused
    // ones have 0 blocks. A segment from row r0 of its linear: its units start at pair r0/32
    // (tile-major), its scales at column r0 of each group's row, its zeros at byte r0/2, its outputs
    // at column r0 of y.
    let pairs: Vec<usize> = outs.iter().map(|o| o.w.out.div_ceil(PAIR_ROWS)).collect();
    let mut seg = [(0u64, 0u64, 0u64, 0u64, 0i64, 1i32, 1i32, 1i32, 0i32); MULTI_MAX];
    let mut blocks = 0usize;
    let eb = if f32_out { 4 } else { 2 };
    for (n, sg) in launch_segments(&pairs, groups, cfg).into_iter().enumerate() {
        let o = &outs[sg.linear];
        let row0 = sg.pair0 * PAIR_ROWS;
        let rows = (sg.pairs * PAIR_ROWS).min(o.w.out - row0);
        let nb = sg.pairs.div_ceil(WARPS / sg.wpt);
        blocks += nb;
        seg[n] = (
            o.w.qweight + (row0 * o.w.inp / 2) as u64,
            o.w.scales + (2 * row0) as u64,
            o.w.zeros.map_or(0, |z| z + (row0 / 2) as u64),
            o.y + (eb * row0) as u64,
            o.ldy as i64,
            to_i32(K, "out", rows)?,
            to_i32(K, "out", o.w.out)?,
            sg.wpt as i32,
            to_i32(K, "blocks", nb)?,
        );
    }
    // The 16-byte-vector body when every used segment's (blocks .8 > 0) rows (.5) and its linear's rows (.6,
    // the scales' row stride) are multiples of 4.
    let vec = seg.iter().filter(|sg| sg.8 > 0).all(|sg| sg.5 % 4 == 0 && sg.6 % 4 == 0);
    let name =
        pair_kernel(f32_out, first.zeros.is_some(), first.scale_dtype == ScaleDtype::Bf16, fold != Fold::None, vec);
    let grid = (to_u32(K, "blocks", blocks)?, 1, 1);
    let block = (BLOCK_THREADS, 1, 1);
    let smem = (if fold == Fold::None { PAIR_SMEM_BYTES } else { FOLD_KERNEL_SMEM_BYTES }) as u32;
    let (mc_i, inp) = (mc as i32, to_i32(K, "in", first.inp)?);
    let [
        (q0, s0, z0, y0, l0, o0, r0, w0, n0),
        (q1, s1, z1, y1, l1, o1, r1, w1, n1),
        (q2, s2, z2, y2, l2, o2, r2, w2, n2),
        (q3, s3, z3, y3, l3, o3, r3, w3, n3),
    ] = seg;
    let (fx, nw, fss, fmode, feps) = match fold {
        Fold::None => {
            return launch_pdl!(k, s, name, grid, block, smem; x, ldx, mc_i, inp,
                q0, s0, z0, y0, l0, o0, r0, w0, n0, q1, s1, z1, y1, l1, o1, r1, w1, n1,
                q2, s2, z2, y2, l2, o2, r2, w2, n2, q3, s3, z3, y3, l3, o3, r3, w3, n3);
        }
        Fold::Residual { x_out, norm_w, sums } => (x_out, norm_w, sums, 1i32, 0f32),
        Fold::Norm { sums, eps } => (0, 0, sums, 2, eps),
    };
    let fnp = to_i32(K, "fold pairs", first.inp.div_ceil(PAIR_ROWS))?;
    launch_pdl!(k, s, name, grid, block, smem; x, ldx, mc_i, inp,
        q0, s0, z0, y0, l0, o0, r0, w0, n0, q1, s1, z1, y1, l1, o1, r1, w1, n1,
        q2, s2, z2, y2, l2, o2, r2, w2, n2, q3, s3, z3, y3, l3, o3, r3, w3, n3, fx, nw, fss, fmode, fnp, feps)
}

/// Benchmark probe: streams `w.qweight` as the pair kernel does for `wpt` warps per pair (its grid and
/// register stages, no math) in the device layout (`tiled` true: tile-major, a 2 KB unit per
/// (32-row pair, group)) or row-major as the format was before (`tiled` false, the same bytes).
/// `sink`: one writable u32.
pub fn w4_read_probe(
    k: &Kernels,
    s: &CudaStream,
    w: &W4Weights,
    wpt: usize,
    tiled: bool,
    sink: u64,
) -> Result<(), CudaError> {
    const K: &str = "w4_read_probe";
    w.check(K)?;
    if ![1, 2, 4, 8].contains(&wpt) || !w.out.is_multiple_of(32) {
        return Err(invalid(K, "wpt 1, 2, 4 or 8 and out a multiple of 32"));
    }
    let grid = (to_u32(K, "blocks", w.out.div_ceil(32 * (WARPS / wpt)))?, 1, 1);
    let (out, inp, wpt_i, tiled_i) = (to_i32(K, "out", w.out)?, to_i32(K, "in", w.inp)?, wpt as i32, i32::from(tiled));
    let qw = w.qweight;
    launch!(k, s, K, grid, (BLOCK_THREADS, 1, 1), 0;
        qw, out, inp, wpt_i, tiled_i, sink)
}

/// Rows `r0..r1` of `w` dequantised to bf16 `dst[r − r0, feature]` (row stride `ldd`, input-feature
/// order: act-order columns are scattered back), exactly `bf16((q − zero) · scale)`.
#[allow(clippy::too_many_arguments)]
pub fn w4_dequant(
    k: &Kernels,
    s: &CudaStream,
    w: &W4Weights,
    r0: usize,
    r1: usize,
    dst: u64,
    ldd: usize,
) -> Result<(), CudaError> {
    const K: &str = "w4_dequant";
    w.check(K)?;
    if r0 > r1 || r1 > w.out {
        return Err(invalid(K, format!("rows {r0}..{r1} outside 0..{}", w.out)));
    }
    if r0 == r1 {
        return Ok(());
    }
    if ldd < w.inp || (w.perm.is_none() && (!dst.is_multiple_of(16) || !ldd.is_multiple_of(8))) {
        return Err(invalid(
            K,
            format!("dst at {dst:#x} with row stride {ldd} (in {}): must be 16-byte aligned rows", w.inp),
        ));
    }
    let words = (r1 - r0) * (w.inp / 8);
    to_i32(K, "words", words)?;
    // One thread per 4 words without a permutation, per word with one.
    let items = if w.perm.is_some() { words } else { words / 4 };
    let grid = (items.div_ceil(256).min(1 << 20) as u32, 1, 1);
    let (qw, sc, zp, sbf, pp) = (w.qweight, w.scales, w.zeros.unwrap_or(0), w.scale_bf16(), w.perm.unwrap_or(0));
    let (out, inp, a, b) = (to_i32(K, "out", w.out)?, to_i32(K, "in", w.inp)?, r0 as i32, r1 as i32);
    let ldd_i = ldd as i64;
    launch!(k, s, "w4_dequant", grid, (256, 1, 1), 0; qw, sc, zp, sbf, pp, dst, ldd_i, out, inp, a, b)
}

/// Quantises rows `r0..r1` of a bf16 linear (row `r` at `src + (r − r0)·ldw` elements: a staging
/// buffer holding just those rows) into `w` (fp16 scales; asymmetric iff `w.zeros` is set; no
/// `perm`). `r0` must be even and `r1` even or `out` (two rows share a zero-point byte).
#[allow(clippy::too_many_arguments)]
pub fn w4_quantize(
    k: &Kernels,
    s: &CudaStream,
    src: u64,
    ldw: usize,
    r0: usize,
    r1: usize,
    w: &W4Weights,
) -> Result<(), CudaError> {
    const K: &str = "w4_quantize";
    w.check(K)?;
    if w.scale_dtype != ScaleDtype::F16 || w.perm.is_some() {
        return Err(invalid(K, "quantises to fp16 scales without a permutation"));
    }
    if r0 > r1 || r1 > w.out || !r0.is_multiple_of(2) || !(r1.is_multiple_of(2) || r1 == w.out) || ldw < w.inp {
        return Err(invalid(
            K,
            format!("rows {r0}..{r1} of {} (r0 even, r1 even or out) with ldw {ldw} (in {})", w.out, w.inp),
        ));
    }
    if r0 == r1 {
        return Ok(());
    }
    let warps = (r1 - r0).div_ceil(2) * (w.inp / W4_GROUP);
    let grid = (to_u32(K, "blocks", warps.div_ceil(8))?, 1, 1);
    let (out, inp, a, b) = (to_i32(K, "out", w.out)?, to_i32(K, "in", w.inp)?, r0 as i32, r1 as i32);
    let asym = i32::from(w.zeros.is_some());
    let (ldw_i, qw, sc, zp) = (ldw as i64, w.qweight, w.scales, w.zeros.unwrap_or(0));
    launch!(k, s, "w4_quantize", grid, (256, 1, 1), 0; src, ldw_i, out, inp, a, b, asym, qw, sc, zp)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tensors_are_placed_aligned_after_each_other() {
        let w = W4Weights::at(1 << 20, 1000, 5120, true, true, ScaleDtype::F16);
        let b = w.bytes();
        assert_eq!(w.scales - w.qweight, b.qweight.next_multiple_of(256) as u64);
        let z = w.zeros.expect("asym");
        assert_eq!(z - w.scales, b.scales.next_multiple_of(256) as u64);
        assert_eq!(w.perm.expect("perm") - z, b.zeros.next_multiple_of(256) as u64);
        let s = W4Weights::at(0, 48, 5120, false, false, ScaleDtype::Bf16);
        assert!(s.zeros.is_none() && s.perm.is_none());
    }

    #[test]
    fn one_launch_takes_up_to_four_linears_of_one_format() {
        let w = |out, inp, asym, perm, sd| W4Weights::at(0, out, inp, asym, perm, sd);
        let (q, k, v) = (
            w(12288, 5120, false, false, ScaleDtype::F16),
            w(1024, 5120, false, false, ScaleDtype::F16),
            w(1024, 5120, false, false, ScaleDtype::F16),
        );
        let o = |w| W4Out { w, y: 0, ldy: 1 };
        assert!(multi_supported(&[o(&q), o(&k), o(&v)]));
        assert!(multi_supported(&[o(&q), o(&k), o(&v), o(&k)]));
        assert!(!multi_supported(&[o(&q), o(&k), o(&v), o(&k), o(&v)]), "at most MULTI_MAX");
        assert!(!multi_supported(&[]));
        let other_in = w(1024, 6144, false, false, ScaleDtype::F16);
        let asym = w(1024, 5120, true, false, ScaleDtype::F16);
        let bf16 = w(1024, 5120, false, false, ScaleDtype::Bf16);
        let act_order = w(1024, 5120, false, true, ScaleDtype::F16);
        for bad in [&other_in, &asym, &bf16, &act_order] {
            assert!(!multi_supported(&[o(&q), o(bad)]), "{bad:?}");
        }
    }

    #[test]
    fn one_kernel_per_body_and_format() {
        assert_eq!(pair_kernel(false, false, true, false, true), "w4p_hsb");
        assert_eq!(pair_kernel(false, false, true, false, false), "w4ps_hsb");
        assert_eq!(pair_kernel(true, true, false, false, true), "w4p_fah");
        assert_eq!(pair_kernel(false, false, true, true, true), "w4pf_sb");
        assert_eq!(pair_kernel(false, true, false, true, false), "w4pfs_ah");
        // Every one is compiled with the module (and gets its shared memory set at load).
        let module = crate::nvrtc::SOURCES.iter().find(|s| s.module == "w4a16").expect("w4a16 module");
        for name in PAIR_KERNELS.iter().chain(&FOLD_KERNELS) {
            assert!(module.functions.contains(name), "{name}");
        }
    }

    #[test]
    fn default_config_at_the_27b_shapes() {
        for (out, inp, wpt) in [
            (34816, 5120, 2),
            (5120, 17408, 8),
            (16480, 5120, 4),
            (14336, 5120, 4),
            (10240, 5120, 4),
            (12288, 5120, 4),
            (16896, 5120, 4),
            (8448, 5120, 8),
            (25344, 5120, 2),
            (50688, 5120, 1),
            (6144, 5120, 8),
            (1024, 5120, 8),
            (248320, 5120, 1),
            (48, 128, 1),
        ] {
            assert_eq!(gemv_config(out, inp, 264), GemvConfig { wpt, slots: 264 }, "[{out}, {inp}]");
        }
    }

    #[test]
    fn thin_last_waves_run_with_more_warps_per_pair() {
        let seg = |linear, pair0, pairs, wpt| Segment { linear, pair0, pairs, wpt };
        let cfg = gemv_config(34816, 5120, 264);
        // gate and up (544 pairs each) at 2 warps per pair: 272 blocks on 264 slots; the last 8
        // blocks' 32 pairs (of up) run at 8 warps per pair.
        assert_eq!(launch_segments(&[544, 544], 40, cfg), [seg(0, 0, 544, 2), seg(1, 0, 512, 2), seg(1, 512, 32, 8)]);
        assert_eq!(launch_segments(&[1088], 40, cfg), [seg(0, 0, 1056, 2), seg(0, 1056, 32, 8)]);
        // A thin wave (3 blocks) reaching into an earlier linear, with a partial last block (3 pairs).
        let c = GemvConfig { wpt: 2, slots: 19 };
        assert_eq!(launch_segments(&[80, 7], 40, c), [seg(0, 0, 76, 2), seg(0, 76, 4, 8), seg(1, 0, 7, 8)]);
        // One wave or less, a thick last wave, already 8 warps per pair, too many segments, slots 0.
        assert_eq!(launch_segments(&[320], 40, GemvConfig { wpt: 4, slots: 264 }), [seg(0, 0, 320, 4)]);
        assert_eq!(launch_segments(&[700], 40, GemvConfig { wpt: 4, slots: 264 }), [seg(0, 0, 700, 4)]);
        assert_eq!(launch_segments(&[300], 136, GemvConfig { wpt: 8, slots: 264 }), [seg(0, 0, 300, 8)]);
        let many = launch_segments(&[8, 8, 8, 8], 40, GemvConfig { wpt: 1, slots: 3 });
        assert_eq!(many.len(), 4);
        assert!(many.iter().all(|s| s.wpt == 1));
        assert_eq!(launch_segments(&[1088], 40, GemvConfig { wpt: 2, slots: 0 }), [seg(0, 0, 1088, 2)]);
        // Few groups cap the tail's warps per pair (8 groups: 4 warps).
        assert_eq!(
            launch_segments(&[1100], 8, GemvConfig { wpt: 2, slots: 264 }),
            [seg(0, 0, 1056, 2), seg(0, 1056, 44, 4)]
        );
    }
}
