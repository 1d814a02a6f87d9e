//! Launcher for kernels/w4_gemm.cu: `y[m, out] = x[m, in] · Wᵀ` for an int4 linear (format in
//! [`crate::w4`]) at any number of rows, reading the int4 weights directly (no bf16 copy): the
//! projections of steps with more rows than the decode GEMV takes (batches above 8 sequences,
//! speculative verification, short prefill chunks).
//!
//! - [`w4_gemm_config`]: tokens per block and the split over K for a shape on a GPU of `sms` SMs;
//! - [`w4_gemm`]: the launch (plus, split over K, the in-order reduction of the partial sums; with
//!   act-order weights, the gather of x first);
//! - [`w4_gemm_workspace_bytes`] / [`w4_gemm_max_workspace_bytes`] / [`w4_gemm_x_scratch_bytes`]: the
//!   scratch it needs, for the memory plan.

use cudarc::driver::CudaStream;

use super::w4a16::{W4Weights, permute_x};
use super::{Kernels, invalid, launch_pdl, to_i32, to_u32};
use crate::error::CudaError;
use crate::w4::W4_GROUP;

/// Output rows per block (4 warps, one 32-row pair of the format each).
pub const BLOCK_ROWS: usize = 128;
const THREADS: u32 = 128;
/// cp.async ring stages (`W4G_S`).
const STAGES: usize = 4;
/// The kernels and their tokens per block.
pub(crate) const KERNELS: [(&str, usize); 2] = [("w4g_16", 16), ("w4g_32", 32)];
/// Most K splits of one launch.
pub const MAX_SPLITS: usize = 16;
/// Fewest groups of 128 columns per split (the ring holds 3 in flight).
const MIN_GROUPS_PER_SPLIT: usize = 4;

/// Dynamic shared memory of a block of `tokens` tokens: per stage 4 weight units of 2 KB and the x
/// tile (`tokens` × 128 bf16).
pub fn smem_bytes(tokens: usize) -> usize {
    STAGES * (4 * 2048 + tokens * 2 * W4_GROUP)
}

/// How one [`w4_gemm`] launch tiles its work.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct W4GemmConfig {
    /// Tokens (rows of x) per block: 16 or 32.
    pub tokens: usize,
    /// Splits over K (groups of 128 columns); above 1 the partial sums go through the workspace.
    pub splits: usize,
}

/// The configuration for `m` rows of x through an `[out, inp]` linear on a GPU of `sms` SMs:
/// 16 tokens per block up to 16 rows, else 32; and enough K splits that the blocks number at least
/// two per SM, within three bounds: at least 4 groups per split, at most [`MAX_SPLITS`], and the
/// partial sums (written and read, f32) at most a quarter of the weight bytes (`splits · m ≤ in / 64`),
/// which also bounds the workspace by `out · in / 16` bytes.
pub fn w4_gemm_config(m: usize, out: usize, inp: usize, sms: usize) -> W4GemmConfig {
    let m = m.max(1);
    let tokens = if m <= 16 { 16 } else { 32 };
    let blocks = out.div_ceil(BLOCK_ROWS) * m.div_ceil(tokens);
    let target = 2 * sms.max(1);
    let groups = inp / W4_GROUP;
    let want = if blocks >= target { 1 } else { target.div_ceil(blocks.max(1)) };
    let cap = (groups / MIN_GROUPS_PER_SPLIT).min(inp / (64 * m)).min(MAX_SPLITS);
    W4GemmConfig { tokens, splits: want.min(cap).max(1) }
}

/// Bytes of f32 partial sums a launch of `m` rows through `out` outputs with `cfg` needs (0 unsplit).
pub fn w4_gemm_workspace_bytes(m: usize, out: usize, cfg: W4GemmConfig) -> usize {
    if cfg.splits > 1 { cfg.splits * m * out * 4 } else { 0 }
}

/// The most workspace any launch of up to `max_m` rows through an `[out, inp]` linear takes with the
/// default configuration ([`w4_gemm_config`]) on `sms` SMs: at most `out · in / 16` bytes.
pub fn w4_gemm_max_workspace_bytes(max_m: usize, out: usize, inp: usize, sms: usize) -> usize {
    (1..=max_m).map(|m| w4_gemm_workspace_bytes(m, out, w4_gemm_config(m, out, inp, sms))).max().unwrap_or(0)
}

/// Bytes of the x scratch an act-order linear needs: x gathered in device column order, bf16 `[m, in]`.
pub fn w4_gemm_x_scratch_bytes(m: usize, inp: usize) -> usize {
    2 * m * inp
}

/// `y[m, out]` (bf16, or f32 with `f32_out`; row stride `ldy`) = `x[m, in]` (bf16, row stride `ldx`)
/// · Wᵀ, f32 accumulation, for any `m`; `w.out` a multiple of 4, rows of y past `out` untouched.
/// `cfg` from [`w4_gemm_config`]; with `cfg.splits > 1`, `workspace` holds
/// [`w4_gemm_workspace_bytes`] (16-byte aligned) and a second kernel adds the splits in order
/// (deterministic). Act-order weights (`perm`) need `x_scratch` of [`w4_gemm_x_scratch_bytes`].
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
    workspace: Option<u64>,
    x_scratch: Option<u64>,
) -> Result<(), CudaError> {
    const K: &str = "w4_gemm";
    w.check(K)?;
    if m == 0 {
        return Ok(());
    }
    let groups = w.inp / W4_GROUP;
    let name = KERNELS.iter().find(|kn| kn.1 == cfg.tokens).map(|kn| kn.0);
    let Some(name) = name.filter(|_| (1..=groups.min(MAX_SPLITS)).contains(&cfg.splits)) else {
        return Err(invalid(K, format!("{cfg:?}: 16 or 32 tokens and 1..={} splits", groups.min(MAX_SPLITS))));
    };
    if !w.out.is_multiple_of(4) || ldy < w.out || ldx < w.inp {
        return Err(invalid(K, format!("out {} (a multiple of 4), ldx {ldx} (>= in), ldy {ldy} (>= out)", w.out)));
    }
    if !w.scales.is_multiple_of(8) || w.zeros.is_some_and(|z| !z.is_multiple_of(2)) {
        return Err(invalid(K, "scales must be 8-byte and zeros 2-byte aligned"));
    }
    to_i32(K, "qweight chunks", w.out * w.inp / 32)?;
    let (xg, ldxg) = match w.perm {
        Some(perm) => {
            let Some(scratch) = x_scratch.filter(|p| p.is_multiple_of(16)) else {
                return Err(invalid(K, "act-order weights need a 16-byte aligned x scratch of [m, in] bf16"));
            };
            permute_x(k, s, x, ldx, perm, scratch, m, w.inp)?;
            (scratch, w.inp)
        }
        None => (x, ldx),
    };
    if !xg.is_multiple_of(16) || !ldxg.is_multiple_of(8) {
        return Err(invalid(K, format!("x at {xg:#x} with row stride {ldxg} is not 16-byte aligned per row")));
    }
    let eb = if f32_out { 4 } else { 2 };
    let vec = i32::from(y.is_multiple_of(2 * eb as u64) && ldy.is_multiple_of(4));
    let (mode, dst) = match (cfg.splits > 1, workspace) {
        (false, _) => (i32::from(f32_out), y),
        (true, Some(ws)) if ws.is_multiple_of(16) => (2, ws),
        (true, _) => return Err(invalid(K, "a split launch needs a 16-byte aligned workspace")),
    };
    let grid = (
        to_u32(K, "token tiles", m.div_ceil(cfg.tokens))?,
        to_u32(K, "row tiles", w.out.div_ceil(BLOCK_ROWS))?,
        cfg.splits as u32,
    );
    if grid.1 > 65535 {
        return Err(invalid(K, format!("{} rows: more than 65535 row tiles", w.out)));
    }
    let (qw, sc, zp, sbf) = (w.qweight, w.scales, w.zeros.unwrap_or(0), w.scale_bf16());
    let (ldx_l, ldy_l, m_i) = (ldxg as i64, ldy as i64, to_i32(K, "rows", m)?);
    let (out, inp) = (to_i32(K, "out", w.out)?, to_i32(K, "in", w.inp)?);
    let smem = smem_bytes(cfg.tokens) as u32;
    launch_pdl!(k, s, name, grid, (THREADS, 1, 1), smem; qw, sc, zp, sbf, xg, ldx_l, dst, ldy_l, m_i, out, inp, mode, vec)?;
    if mode != 2 {
        return Ok(());
    }
    let (splits, f32_i) = (cfg.splits as i32, i32::from(f32_out));
    let rgrid = (to_u32(K, "reduce blocks", (m * w.out / 4).div_ceil(256))?, 1, 1);
    launch_pdl!(k, s, "w4g_reduce", rgrid, (256, 1, 1), 0; dst, splits, m_i, out, y, ldy_l, f32_i, vec)
}

#[cfg(test)]
mod tests {
    use super::*;

    const H200: usize = 132;

    #[test]
    fn tokens_per_block_follow_the_rows() {
        for (m, tokens) in [(1, 16), (9, 16), (16, 16), (17, 32), (100, 32), (256, 32)] {
            assert_eq!(w4_gemm_config(m, 17408, 5120, H200).tokens, tokens, "m = {m}");
        }
    }

    #[test]
    fn splits_fill_the_gpu_within_their_bounds() {
        let c = |m, out, inp| w4_gemm_config(m, out, inp, H200).splits;
        // 5120 x 5120 at 16 rows: 40 blocks; 7 splits would fill 264, the partial sums allow 5.
        assert_eq!(c(16, 5120, 5120), 5);
        // At 9 rows the partial sums allow 8; 7 give 280 blocks.
        assert_eq!(c(9, 5120, 5120), 7);
        // down (5120 x 17408) at 32 rows: 40 blocks, 7 splits (8 allowed).
        assert_eq!(c(32, 5120, 17408), 7);
        // gate / up (17408 x 5120): 136 row tiles; 2 splits at 16 rows, none from 33 rows (272 blocks).
        assert_eq!(c(16, 17408, 5120), 2);
        assert_eq!(c(64, 17408, 5120), 1);
        // Enough blocks: no split; 256 rows of the 5120 x 5120 shape: 320 blocks.
        assert_eq!(c(256, 5120, 5120), 1);
        // Few groups: at least 4 per split (the tiny model's 128 x 256: 2 groups, no split).
        assert_eq!(c(4, 128, 256), 1);
        assert_eq!(c(1, 256, 1024), 2);
        // Never more than MAX_SPLITS, never 0 (a GPU of 1 SM, an empty launch).
        assert_eq!(c(1, 128, 128 * 1024), MAX_SPLITS);
        assert_eq!(w4_gemm_config(0, 5120, 5120, 0).splits, 1);
    }

    #[test]
    fn workspace_is_bounded_by_a_sixteenth_of_the_weights() {
        for (out, inp) in [(5120, 5120), (17408, 5120), (5120, 17408), (12288, 5120), (1024, 5120), (48, 5120)] {
            let most = w4_gemm_max_workspace_bytes(256, out, inp, H200);
            assert!(most <= out * inp / 16, "[{out}, {inp}]: {most}");
            for m in 1..=256 {
                let cfg = w4_gemm_config(m, out, inp, H200);
                assert!(w4_gemm_workspace_bytes(m, out, cfg) <= most);
            }
        }
        let cfg = W4GemmConfig { tokens: 16, splits: 3 };
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
        assert!(module.functions.contains(&"w4g_reduce"));
    }
}
