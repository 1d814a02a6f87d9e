//! Launchers for kernels/fp8.cu: block-FP8 linears read in place (the decode GEMV), the activations'
//! quantisation for the FP8 tensor-core GEMM ([`crate::gemm::Gemm::linear_fp8`]), dequantised row
//! slices, and the quantiser that makes the format from bf16 weights.

use cudarc::driver::CudaStream;
use deltaserve_plan::cuda::Fp8Bytes;

use super::{Kernels, invalid, launch, launch_pdl, to_i32, to_u32};
use crate::error::CudaError;

/// Edge of a scale block (rows and inputs).
pub const FP8_BLOCK: usize = deltaserve_plan::dtype::QUANT_GROUP;
/// Most tokens one GEMV launch takes (two MMA n-tiles).
pub const GEMV_MAX_TOKENS: usize = 16;
/// Output rows per GEMV block.
const ROWS: usize = 16;
/// Most weight matrices per GEMV launch.
pub const MAX_OUTS: usize = 3;

/// One block-FP8 linear in device memory: e4m3 codes `[out, in]` row-major and f32 scales
/// `[ceil(out/128), ceil(in/128)]` (`w = code · scale`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fp8Weights {
    pub codes: u64,
    pub scales: u64,
    pub out: usize,
    pub inp: usize,
}

impl Fp8Weights {
    /// The tensors of an `[out, in]` linear placed from `base` as [`Fp8Bytes::layout`] places them.
    pub fn at(base: u64, out: usize, inp: usize) -> Fp8Weights {
        let (scales, _) = Fp8Bytes::new(out, inp).layout();
        Fp8Weights { codes: base, scales: base + scales as u64, out, inp }
    }

    pub fn bytes(&self) -> Fp8Bytes {
        Fp8Bytes::new(self.out, self.inp)
    }

    /// Whether the kernels take this linear: `in` a multiple of 16, codes and scales 16-byte aligned.
    pub fn check(&self, kernel: &'static str) -> Result<(), CudaError> {
        if self.out == 0 || self.inp == 0 || !self.inp.is_multiple_of(16) {
            return Err(invalid(kernel, format!("[{}, {}]: in must be a positive multiple of 16", self.out, self.inp)));
        }
        if !self.codes.is_multiple_of(16) || !self.scales.is_multiple_of(16) {
            return Err(invalid(kernel, "codes and scales must be 16-byte aligned"));
        }
        Ok(())
    }
}

/// Block scales `[ceil(out/128), ceil(in/128)]` (a checkpoint's `weight_scale_inv`, row-major) in the
/// device layout: each row padded to `fp8_scale_cols(in)` with 1.0.
pub fn pad_scales(scales: &[f32], out: usize, inp: usize) -> Vec<f32> {
    let (kb, kbp) = (inp.div_ceil(FP8_BLOCK), deltaserve_plan::dtype::fp8_scale_cols(inp));
    let mut v = vec![1.0f32; out.div_ceil(FP8_BLOCK) * kbp];
    for (dst, src) in v.chunks_exact_mut(kbp).zip(scales.chunks_exact(kb)) {
        dst[..kb].copy_from_slice(src);
    }
    v
}

/// One output of a GEMV launch: `y [n, w.out]` with row stride `ldy` (≥ `w.out`) elements.
#[derive(Clone, Copy, Debug)]
pub struct Fp8Out<'a> {
    pub w: &'a Fp8Weights,
    pub y: u64,
    pub ldy: usize,
}

/// `y_s = x · W_sᵀ` for each of `outs` (1..=3 linears sharing `x [n, kdim]` bf16), n in 1..=16 tokens;
/// y bf16, or f32 with `f32_out`. x 16-byte aligned.
pub fn gemv_fp8(
    k: &Kernels,
    s: &CudaStream,
    x: u64,
    n: usize,
    kdim: usize,
    outs: &[Fp8Out<'_>],
    f32_out: bool,
) -> Result<(), CudaError> {
    const NAME: &str = "gemv_fp8";
    if !(1..=GEMV_MAX_TOKENS).contains(&n) {
        return Err(invalid(NAME, format!("n = {n} tokens (1..={GEMV_MAX_TOKENS})")));
    }
    if outs.is_empty() || outs.len() > MAX_OUTS {
        return Err(invalid(NAME, format!("{} outputs (1..={MAX_OUTS})", outs.len())));
    }
    for o in outs {
        o.w.check(NAME)?;
        if o.w.inp != kdim {
            return Err(invalid(NAME, format!("a [{}, {}] linear on {kdim} inputs", o.w.out, o.w.inp)));
        }
        if o.ldy < o.w.out || !o.y.is_multiple_of(2) {
            return Err(invalid(NAME, format!("y: row stride {} < {} rows, or misaligned", o.ldy, o.w.out)));
        }
    }
    if !x.is_multiple_of(16) {
        return Err(invalid(NAME, "x must be 16-byte aligned"));
    }
    let seg = |i: usize| {
        outs.get(i).map_or((0u64, 0u64, 0u64, 0usize, 0usize), |o| (o.w.codes, o.w.scales, o.y, o.w.out, o.ldy))
    };
    let nb: Vec<usize> = (0..MAX_OUTS).map(|i| seg(i).3.div_ceil(ROWS)).collect();
    let blocks: usize = nb.iter().sum();
    let grid = (to_u32(NAME, "blocks", blocks)?, 1, 1);
    let (nn, kk) = (to_i32(NAME, "n", n)?, to_i32(NAME, "k", kdim)?);
    let (w0, s0, y0, m0, ld0) = seg(0);
    let (w1, s1, y1, m1, ld1) = seg(1);
    let (w2, s2, y2, m2, ld2) = seg(2);
    let (m0, ld0, nb0) = (to_i32(NAME, "m", m0)?, to_i32(NAME, "ldy", ld0)?, to_i32(NAME, "blocks", nb[0])?);
    let (m1, ld1, nb1) = (to_i32(NAME, "m", m1)?, to_i32(NAME, "ldy", ld1)?, to_i32(NAME, "blocks", nb[1])?);
    let (m2, ld2) = (to_i32(NAME, "m", m2)?, to_i32(NAME, "ldy", ld2)?);
    let f32o = i32::from(f32_out);
    let name = if n <= 8 { "gemv_fp8_n8" } else { "gemv_fp8_n16" };
    launch_pdl!(k, s, name, grid, (256, 1, 1), 0;
        x, nn, kk, w0, s0, y0, m0, ld0, nb0, w1, s1, y1, m1, ld1, nb1, w2, s2, y2, m2, ld2, f32o)
}

/// Bytes of the scratch [`act_quant`] writes for `t` tokens of `kdim` features: codes `[t, kdim]`, then
/// (256-byte aligned) the scales.
pub fn act_scratch_bytes(t: usize, kdim: usize) -> usize {
    deltaserve_plan::cuda::fp8_x_scratch_bytes(t, kdim)
}

/// Offset of the scales in the [`act_quant`] scratch.
pub fn act_scales_offset(t: usize, kdim: usize) -> usize {
    (t * kdim).next_multiple_of(crate::arena::ALIGN)
}

/// x `[t, kdim]` bf16 → e4m3 codes `[t, kdim]` at `q` and f32 scales `[kdim/128, t]` (token-major) at
/// `xs`: per token and 128 features `s = amax / 448` (1 when all are zero), `code = e4m3(x · (1 / s))`.
pub fn act_quant(k: &Kernels, s: &CudaStream, x: u64, t: usize, kdim: usize, q: u64, xs: u64) -> Result<(), CudaError> {
    const NAME: &str = "fp8_act_quant";
    if t == 0 {
        return Ok(());
    }
    if !kdim.is_multiple_of(FP8_BLOCK) || !x.is_multiple_of(16) || !q.is_multiple_of(8) || !xs.is_multiple_of(4) {
        return Err(invalid(NAME, format!("k = {kdim} must be a multiple of 128, x 16-, q 8- and xs 4-byte aligned")));
    }
    let grid = (to_u32(NAME, "blocks", (t * kdim / 8).div_ceil(256))?, 1, 1);
    let (tt, kk) = (to_i32(NAME, "t", t)?, to_i32(NAME, "k", kdim)?);
    launch_pdl!(k, s, NAME, grid, (256, 1, 1), 0; x, tt, kk, q, xs)
}

/// The SwiGLU of a step quantised for the FP8 GEMM in one pass: `h = bf16(silu(gate) · up)` of `[t, i]`
/// (row strides `gs` / `us` elements; exactly [`super::elementwise::swiglu`]'s h), its first `tq` rows
/// as [`act_quant`] would quantise h (codes at `q`, scales `[i/128, tq]` at `xs`, never stored as bf16)
/// and the rows from `tq` (those the GEMV takes) as bf16 to `out [t, i]`.
#[allow(clippy::too_many_arguments)]
pub fn swiglu_quant(
    k: &Kernels,
    s: &CudaStream,
    (gate, gs): (u64, usize),
    (up, us): (u64, usize),
    t: usize,
    i: usize,
    tq: usize,
    (q, xs): (u64, u64),
    out: u64,
) -> Result<(), CudaError> {
    const NAME: &str = "fp8_swiglu_quant";
    if t == 0 {
        return Ok(());
    }
    let aligned = [gate, up, out].iter().all(|p| p.is_multiple_of(16)) && gs.is_multiple_of(8) && us.is_multiple_of(8);
    if !i.is_multiple_of(FP8_BLOCK) || tq > t || !aligned || !q.is_multiple_of(8) || !xs.is_multiple_of(4) {
        return Err(invalid(
            NAME,
            format!(
                "i = {i} must be a multiple of 128, tq = {tq} at most t = {t}, gate / up / out 16-byte aligned with \
                 strides of 8 elements, q 8- and xs 4-byte aligned"
            ),
        ));
    }
    let grid = (to_u32(NAME, "blocks", i.div_ceil(8 * 256))?, t.min(65_535) as u32, 1);
    let (gs, us) = (gs as i64, us as i64);
    let (tt, ii, tqq) = (to_i32(NAME, "t", t)?, to_i32(NAME, "i", i)?, to_i32(NAME, "tq", tq)?);
    launch_pdl!(k, s, NAME, grid, (256, 1, 1), 0; gate, gs, up, us, tt, ii, tqq, q, xs, out)
}

/// Dynamic shared memory of `gemm_fp8`: 3 stages of a 128×128 activation tile, a 128×128 weight tile and
/// 128 tokens' scales (97.5 KB: within the 99 KB an sm_86 / sm_89 block may opt in to).
pub const GEMM_SMEM_BYTES: usize = 3 * (2 * 128 * 128 + 4 * 128);

/// Whether `gemm_fp8` runs on a GPU of architecture `arch` (`sm_XY`, the kernels' [`Kernels::arch`]): mma.sync
/// e4m3 needs sm_89 or later.
pub fn gemm_mma_supported(arch: &str) -> bool {
    let digits = arch.trim_start_matches("sm_").trim_end_matches(|c: char| c.is_ascii_alphabetic());
    digits.parse::<u32>().is_ok_and(|cc| cc >= 89)
}

/// `y [t, w.out]` bf16 (row stride `ldy`) = x · Wᵀ on the FP8 tensor cores with mma.sync (sm_89+; Ada has
/// no cuBLASLt block-scaled FP8 GEMM): `xq` `[t, w.inp]` e4m3 codes and `xs` `[w.inp/128, t]` scales from
/// [`act_quant`]; each 128-k block's exact sums of products scaled by the token's and the weight block's
/// scales, in f32.
#[allow(clippy::too_many_arguments)]
pub fn gemm_mma(
    k: &Kernels,
    s: &CudaStream,
    xq: u64,
    xs: u64,
    t: usize,
    w: &Fp8Weights,
    y: u64,
    ldy: usize,
) -> Result<(), CudaError> {
    const NAME: &str = "gemm_fp8";
    if !gemm_mma_supported(&k.arch) {
        return Err(invalid(NAME, format!("FP8 mma.sync needs sm_89 or later, not {}", k.arch)));
    }
    w.check(NAME)?;
    if !w.inp.is_multiple_of(FP8_BLOCK) || !w.out.is_multiple_of(8) {
        return Err(invalid(NAME, format!("[{}, {}]: out must be a multiple of 8 and in of 128", w.out, w.inp)));
    }
    if ldy < w.out || !ldy.is_multiple_of(2) || !y.is_multiple_of(4) || !xq.is_multiple_of(16) || !xs.is_multiple_of(4)
    {
        return Err(invalid(
            NAME,
            format!("y (row stride {ldy}) 4-byte aligned with an even stride, xq 16-byte aligned"),
        ));
    }
    if t == 0 {
        return Ok(());
    }
    let grid = (to_u32(NAME, "token tiles", t.div_ceil(128))?, to_u32(NAME, "row tiles", w.out.div_ceil(128))?, 1);
    let (tt, kk, m, ld) =
        (to_i32(NAME, "t", t)?, to_i32(NAME, "k", w.inp)?, to_i32(NAME, "m", w.out)?, to_i32(NAME, "ldy", ldy)?);
    let (codes, scales) = (w.codes, w.scales);
    launch!(k, s, NAME, grid, (256, 1, 1), GEMM_SMEM_BYTES as u32; xq, xs, tt, kk, codes, scales, m, y, ld)
}

/// Rows `r0..r1` of `w` dequantised to bf16 `[r1 - r0, in]` at `out` (`f2bf(e4m3(code) · scale)`).
pub fn dequant(k: &Kernels, s: &CudaStream, w: &Fp8Weights, r0: usize, r1: usize, out: u64) -> Result<(), CudaError> {
    const NAME: &str = "fp8_dequant";
    if r0 > r1 || r1 > w.out {
        return Err(invalid(NAME, format!("rows {r0}..{r1} of {}", w.out)));
    }
    if r0 == r1 {
        return Ok(());
    }
    let n = (r1 - r0) * w.inp;
    let grid = (n.div_ceil(256).clamp(1, 65_535) as u32, 1, 1);
    let (codes, scales) = (w.codes, w.scales);
    let (kk, a, b) = (to_i32(NAME, "k", w.inp)?, to_i32(NAME, "r0", r0)?, to_i32(NAME, "r1", r1)?);
    launch!(k, s, NAME, grid, (256, 1, 1), 0; codes, scales, kk, a, b, out)
}

/// Quantises bf16 `w [out, in]` at `src` into `dst` (codes and scales as
/// `deltaserve_model::quant::fp8_block_quantize` makes them, bit for bit).
pub fn quantize(k: &Kernels, s: &CudaStream, src: u64, dst: &Fp8Weights) -> Result<(), CudaError> {
    const NAME: &str = "fp8_quantize";
    if dst.out == 0 || dst.inp == 0 {
        return Ok(());
    }
    let grid = (
        to_u32(NAME, "k blocks", dst.inp.div_ceil(FP8_BLOCK))?,
        to_u32(NAME, "row blocks", dst.out.div_ceil(FP8_BLOCK))?,
        1,
    );
    let (m, kk) = (to_i32(NAME, "m", dst.out)?, to_i32(NAME, "k", dst.inp)?);
    let (codes, scales) = (dst.codes, dst.scales);
    launch!(k, s, NAME, grid, (256, 1, 1), 0; src, m, kk, codes, scales)
}

#[cfg(test)]
mod tests {
    use super::gemm_mma_supported;

    #[test]
    fn the_mma_gemm_runs_from_ada_on() {
        for (arch, ok) in [("sm_80", false), ("sm_86", false), ("sm_89", true), ("sm_90", true), ("sm_90a", true)] {
            assert_eq!(gemm_mma_supported(arch), ok, "{arch}");
        }
        assert!(!gemm_mma_supported("") && !gemm_mma_supported("compute_89x"));
    }
}
