//! Launchers for kernels/moe_w4.cu: the routed experts' projections with int4 weights (the device
//! format of [`crate::w4`]) — a per-pair GEMV for decode-sized steps (each (token, k) pair reads only
//! its expert's weights) and a grouped GEMM over the rows [`super::moe::offsets`] grouped by expert
//! (tiles of [`TILE_ROWS`]). Routing, grouping and the un-permute are [`super::moe`]'s. Launch shapes
//! depend on the step's token count, `top_k` and the expert count only, never on the routing.

use cudarc::driver::CudaStream;

use super::moe::{MAX_EXPERTS, SharedPairs, tile_grid_rows};
use super::w4a16::{BLOCK_THREADS, PAIR_SMEM_BYTES, W4Weights};
use super::{Kernels, invalid, launch, launch_pdl, to_i32, to_u32};
use crate::error::CudaError;
use crate::w4::{ScaleDtype, W4_GROUP};

/// Rows of one grouped-GEMM tile (`MOE_W4_TILE`): [`super::moe::offsets`] counts tiles in these.
pub const TILE_ROWS: usize = 32;
/// Output rows of one grouped-GEMM block (`W4G_WARPS` pairs of 32).
const GEMM_BLOCK_ROWS: usize = 128;
/// Warps of a GEMV block (`W4_WARPS`).
const GEMV_WARPS: usize = 8;
/// The GEMV kernels (zero points × scale dtype) and the grouped GEMM.
pub(crate) const KERNELS: [&str; 5] = ["moe_w4p_sh", "moe_w4p_sb", "moe_w4p_ah", "moe_w4p_ab", "moe_w4g"];

/// Dynamic shared memory of each of [`KERNELS`] (the pair kernel's sums; the 32-token tile GEMM's stages).
pub(crate) fn smem_bytes(name: &str) -> usize {
    if name == "moe_w4g" { super::w4_gemm::smem_bytes(TILE_ROWS) } else { PAIR_SMEM_BYTES }
}

/// One projection of every expert of a layer: expert e's int4 `[out, in]` linear is `first`'s tensors
/// moved by `e · stride` bytes (every expert laid out alike, one after the other).
#[derive(Clone, Copy, Debug)]
pub struct W4Experts {
    pub first: W4Weights,
    pub stride: u64,
    pub count: usize,
}

impl W4Experts {
    /// Expert `e`'s linear.
    pub fn expert(&self, e: usize) -> W4Weights {
        let at = |p: u64| p + e as u64 * self.stride;
        let f = self.first;
        W4Weights { qweight: at(f.qweight), scales: at(f.scales), zeros: f.zeros.map(at), perm: f.perm.map(at), ..f }
    }

    fn check(&self, name: &'static str, x: u64, y: u64) -> Result<(), CudaError> {
        let f = &self.first;
        f.check(name)?;
        if f.perm.is_some() {
            return Err(invalid(name, "act-order (permuted) expert weights are not supported"));
        }
        if !f.out.is_multiple_of(4) || !self.stride.is_multiple_of(16) || self.count == 0 || self.count > MAX_EXPERTS {
            return Err(invalid(
                name,
                format!(
                    "{} experts (1..={MAX_EXPERTS}) of {} rows (a multiple of 4), stride {} B (a multiple of 16)",
                    self.count, f.out, self.stride
                ),
            ));
        }
        if !x.is_multiple_of(16) || !y.is_multiple_of(8) {
            return Err(invalid(name, "x must be 16-byte and y 8-byte aligned"));
        }
        Ok(())
    }

    fn stride_i64(&self, name: &'static str) -> Result<i64, CudaError> {
        i64::try_from(self.stride).map_err(|_| invalid(name, "expert stride overflows"))
    }
}

/// Warps per 32-row pair of a GEMV launch over `pairs` (token, k) pairs: the fewest (1, 2, 4, 8, at
/// most the groups) whose blocks fill the `slots` the GPU holds at once, else the most.
pub fn gemv_wpt(pairs: usize, out: usize, inp: usize, slots: usize) -> usize {
    let groups = (inp / W4_GROUP).max(1);
    let row_pairs = out.div_ceil(32);
    let blocks = |wpt: usize| pairs * row_pairs.div_ceil(GEMV_WARPS / wpt);
    let allowed = [1usize, 2, 4, 8].into_iter().filter(|&w| w == 1 || w <= groups);
    let mut last = 1;
    for w in allowed {
        last = w;
        if blocks(w) >= slots {
            return w;
        }
    }
    last
}

/// The shared expert's projection for a GEMV launch with the routed experts ([`SharedPairs`]): one int4
/// linear of the experts' shape and format, or (gate/up) two stacked, `top`'s rows then `bottom`'s, each
/// half the experts' rows.
#[derive(Clone, Copy, Debug)]
pub struct W4Shared {
    pub top: W4Weights,
    pub bottom: Option<W4Weights>,
}

/// The kernel's `MoeW4Shared`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct SharedArg {
    qw: [u64; 2],
    sc: [u64; 2],
    z: [u64; 2],
    shb: i32,
    pad: i32,
}

// SAFETY: plain old data laid out as the kernel's struct (repr(C), 8-byte device pointers, then two i32).
unsafe impl cudarc::driver::DeviceRepr for SharedArg {}

impl W4Shared {
    /// Whether it runs with experts `f` in launches of `wpt` warps per pair (for every `wpt`: [`Self::fits`]).
    fn arg(&self, name: &'static str, f: &W4Weights, wpt: usize) -> Result<SharedArg, CudaError> {
        if !self.fits(f) {
            return Err(invalid(name, "the shared expert's linears are not the experts' shape and format"));
        }
        let parts = [Some(self.top), self.bottom];
        let mut a = SharedArg::default();
        for (i, w) in parts.iter().enumerate() {
            let Some(w) = w else { continue };
            w.check(name)?;
            (a.qw[i], a.sc[i], a.z[i]) = (w.qweight, w.scales, w.zeros.unwrap_or(0));
        }
        if self.bottom.is_some() {
            a.shb = to_i32(name, "shared blocks", self.top.out.div_ceil(32).div_ceil(GEMV_WARPS / wpt))?;
        }
        Ok(a)
    }

    /// Whether these linears run as one more pair of `f`'s GEMV launches: the experts' input width and
    /// format (zero points, scale dtype, no act-order); one linear of `f`'s rows, or two of half of them
    /// each a whole number of blocks at any warps per pair (a multiple of 256 rows).
    pub fn fits(&self, f: &W4Weights) -> bool {
        let fmt = |w: &W4Weights| {
            w.inp == f.inp
                && w.zeros.is_some() == f.zeros.is_some()
                && w.scale_dtype == f.scale_dtype
                && w.perm.is_none()
        };
        match self.bottom {
            None => fmt(&self.top) && self.top.out == f.out,
            Some(b) => {
                let half = f.out / 2;
                fmt(&self.top)
                    && fmt(&b)
                    && self.top.out == half
                    && b.out == half
                    && half.is_multiple_of(32 * GEMV_WARPS)
            }
        }
    }
}

/// Per-pair GEMV (decode): `y[p, :out] = x[p / x_div, :in] · W_eᵀ` (bf16, rows of `ldx`) with e the
/// expert of pair p in `topk` (`moe_route`'s `(expert, weight)` pairs), for `pairs` pairs; then the
/// `shared` expert's pairs, if given.
#[allow(clippy::too_many_arguments)]
pub fn gemv(
    k: &Kernels,
    s: &CudaStream,
    x: u64,
    ldx: usize,
    x_div: usize,
    topk: u64,
    pairs: usize,
    shared: Option<SharedPairs<W4Shared>>,
    w: &W4Experts,
    y: u64,
) -> Result<(), CudaError> {
    let f = &w.first;
    let name = match (f.zeros.is_some(), f.scale_dtype) {
        (false, ScaleDtype::F16) => "moe_w4p_sh",
        (false, ScaleDtype::Bf16) => "moe_w4p_sb",
        (true, ScaleDtype::F16) => "moe_w4p_ah",
        (true, ScaleDtype::Bf16) => "moe_w4p_ab",
    };
    w.check(name, x, y)?;
    let (sh_t, sh_x) = shared.as_ref().map_or((0, 0), |p| (p.tokens, p.x_row));
    let all = pairs + sh_t;
    if all == 0 {
        return Ok(());
    }
    if all > 65535 || x_div == 0 || ldx < f.inp || !ldx.is_multiple_of(8) {
        return Err(invalid(name, format!("{all} pairs (at most 65535), x_div {x_div} (> 0), ldx {ldx}")));
    }
    let wpt = gemv_wpt(all, f.out, f.inp, k.w4_slots);
    let shw = match &shared {
        Some(p) => p.w.arg(name, f, wpt)?,
        None => SharedArg::default(),
    };
    let blocks = f.out.div_ceil(32).div_ceil(GEMV_WARPS / wpt);
    let grid = (to_u32(name, "blocks", blocks)?, all as u32, 1);
    let (ldx, xd, e) = (ldx as i64, to_i32(name, "x_div", x_div)?, to_i32(name, "E", w.count)?);
    let (p, sx) = (to_i32(name, "pairs", pairs)?, to_i32(name, "shared x row", sh_x)?);
    let (qw, sc, z, es) = (f.qweight, f.scales, f.zeros.unwrap_or(0), w.stride_i64(name)?);
    let (out, inp, wpt) = (to_i32(name, "out", f.out)?, to_i32(name, "in", f.inp)?, wpt as i32);
    launch_pdl!(k, s, name, grid, (BLOCK_THREADS, 1, 1), PAIR_SMEM_BYTES as u32;
        x, ldx, xd, topk, e, p, sx, qw, sc, z, es, shw, y, out, inp, wpt)
}

/// Grouped GEMM: `y[r, :out] = x[r, :in] · W_eᵀ` for the grouped rows r of every expert e (`offsets`
/// from [`super::moe::offsets`] with tiles of [`TILE_ROWS`]); `pairs` (the step's t·top_k) sizes the
/// grid; `x` `[pairs, in]`, `y` `[pairs, out]` bf16.
pub fn gemm(
    k: &Kernels,
    s: &CudaStream,
    x: u64,
    offsets: u64,
    pairs: usize,
    w: &W4Experts,
    y: u64,
) -> Result<(), CudaError> {
    const NAME: &str = "moe_w4g";
    w.check(NAME, x, y)?;
    let f = &w.first;
    if pairs == 0 {
        return Ok(());
    }
    let grid = (
        to_u32(NAME, "row blocks", f.out.div_ceil(GEMM_BLOCK_ROWS))?,
        tile_grid_rows(NAME, pairs, w.count, TILE_ROWS)?,
        1,
    );
    let (e, qw, sc, z, es) =
        (to_i32(NAME, "E", w.count)?, f.qweight, f.scales, f.zeros.unwrap_or(0), w.stride_i64(NAME)?);
    let (sbf, out, inp) = (f.scale_bf16(), to_i32(NAME, "out", f.out)?, to_i32(NAME, "in", f.inp)?);
    let smem = smem_bytes(NAME) as u32;
    launch!(k, s, NAME, grid, (128, 1, 1), smem; x, offsets, e, qw, sc, z, es, sbf, y, out, inp)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gemv_fills_a_wave_with_the_fewest_warps_per_pair() {
        // 35B-A3B gate/up [1024, 2048] (16 groups), one token's 8 experts on 264 slots: 8 warps a pair.
        assert_eq!(gemv_wpt(8, 1024, 2048, 264), 8);
        // 32 tokens × 8 experts: one warp a pair already gives 1,024 blocks.
        assert_eq!(gemv_wpt(256, 1024, 2048, 264), 1);
        // down [2048, 512] (4 groups): at most 4 warps a pair.
        assert_eq!(gemv_wpt(8, 2048, 512, 264), 4);
        assert_eq!(gemv_wpt(1, 128, 128, 264), 1);
    }

    #[test]
    fn every_kernel_is_compiled_with_the_module() {
        let module = crate::nvrtc::SOURCES.iter().find(|s| s.module == "moe_w4").expect("moe_w4 module");
        for name in KERNELS {
            assert!(module.functions.contains(&name), "{name}");
            assert!(smem_bytes(name) <= 99 * 1024, "{name}: fits sm_86's 99 KB per block");
        }
    }

    #[test]
    fn an_expert_is_the_first_moved_by_the_stride() {
        let first = W4Weights::at(4096, 64, 128, true, false, ScaleDtype::F16);
        let w = W4Experts { first, stride: 8192, count: 3 };
        let e2 = w.expert(2);
        assert_eq!(e2.qweight, 4096 + 16384);
        assert_eq!(e2.scales - e2.qweight, first.scales - first.qweight);
        assert_eq!(e2.zeros.unwrap() - e2.qweight, first.zeros.unwrap() - first.qweight);
    }
}
