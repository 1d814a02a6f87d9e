//! The projections: the choice between a cuBLASLt GEMM, the bf16 decode GEMV and the int4 (W4A16) GEMV or
//! dequantised slices, and the norms folded into int4 projections.

use cudarc::driver::CudaStream;
use deltaserve_plan::cuda::w4_slice_rows;

use crate::error::CudaError;
use crate::ops::fp8::{self, Fp8Out};
use crate::ops::gemv::GemvOut;
use crate::ops::w4a16::{Fold, W4Weights};
use crate::ops::{gemv, norm, w4_gemm, w4a16};

use super::CudaBackend;
use super::layout::Ws;
use super::weights::{Layer, Mixer, Part, Proj};

impl CudaBackend {
    /// y_s [t, m_s] = x [t, kdim] · W_sᵀ for each output: the decode GEMV (one launch for all
    /// outputs) for steps of at most `gemv_max_tokens` tokens, else one cuBLASLt GEMM each.
    /// Outputs made of int4 parts (or mixing int4 and bf16 parts) run part by part:
    /// [`CudaBackend::w4_linear`] for int4, a cuBLASLt GEMM into the part's columns for bf16.
    pub(super) fn proj(
        &self,
        s: &CudaStream,
        x: u64,
        t: usize,
        kdim: usize,
        outs: &[ProjOut<'_>],
        f32_out: bool,
    ) -> Result<(), CudaError> {
        let bf16: Option<Vec<GemvOut>> = outs
            .iter()
            .map(|o| match o.parts {
                [Part::Bf16 { w, .. }] => Some(GemvOut { w: *w, y: o.y, m: o.m }),
                _ => None,
            })
            .collect();
        if let Some(outs) = bf16 {
            let aligned = x.is_multiple_of(16) && outs.iter().all(|o| o.w.is_multiple_of(16) && o.y.is_multiple_of(16));
            if t <= self.opts.gemv_max_tokens && gemv::supported(t, kdim) && aligned {
                return gemv::gemv(&self.k, s, x, t, kdim, &outs, f32_out);
            }
            for o in &outs {
                self.gemm.linear_out(s, x, o.w, o.y, t, o.m, kdim, f32_out)?;
            }
            return Ok(());
        }
        if let Some(fp8) = fp8_outs(outs) {
            return self.fp8_proj(s, x, t, kdim, &fp8, f32_out);
        }
        if !f32_out && outs.iter().map(|o| o.parts.len()).sum::<usize>() > 1 {
            // Several int4 linears sharing x (q/k/v, qkv/z/b/a, gate/up: outputs and the parts that
            // write consecutive columns of one): one launch of the int4 GEMV, or of the int4 GEMM's
            // pair kernel for a few more rows, or of its tile kernels.
            if let Some(w4) = w4_outs(outs) {
                if t <= self.opts.gemv_max_tokens {
                    let cfg = w4_multi_config(&w4, kdim, self.k.w4_slots);
                    return w4a16::w4_gemv_multi(&self.k, s, &w4, x, kdim, t, cfg, false);
                }
                if t <= self.opts.w4_gemm_max_rows && w4_gemm::multi_supported(&w4, x, kdim, t) {
                    let sms = self.k.sm_count;
                    return w4_gemm::w4_gemm_multi(&self.k, s, &w4, x, kdim, t, sms);
                }
                if self.w4_gemm_rows(t) && w4_gemm::segments_supported(&w4, x, kdim) {
                    // The tile kernels over every linear's row tiles in one grid, one split-K reduce.
                    let (sms, ws) = (self.k.sm_count, self.ws.w4_gemm);
                    let out = w4.iter().map(|o| o.w.out).sum();
                    let cfg = w4_gemm::w4_tile_config(t, out, kdim, sms, ws.bytes);
                    return w4_gemm::w4_gemm_segments(&self.k, s, &w4, x, kdim, t, cfg, Some(ws));
                }
            }
        }
        let eb = if f32_out { 4 } else { 2 };
        // The block-FP8 parts together (x quantised once for all of them), after the others.
        let mut fp8_parts = Vec::new();
        for o in outs {
            let mut col = 0usize;
            for p in o.parts {
                let y = o.y + (eb * col) as u64;
                match p {
                    Part::Bf16 { w, rows } => self.gemm.linear_ld(s, x, *w, y, t, *rows, kdim, o.m, f32_out)?,
                    Part::W4(w) => self.w4_linear(s, x, w, y, o.m, t, f32_out)?,
                    Part::Fp8(w) => fp8_parts.push(Fp8Out { w, y, ldy: o.m }),
                }
                col += p.rows();
            }
            if col != o.m {
                return Err(CudaError::Plan(format!("projection parts cover {col} of {} output columns", o.m)));
            }
        }
        if !fp8_parts.is_empty() {
            self.fp8_proj(s, x, t, kdim, &fp8_parts, f32_out)?;
        }
        Ok(())
    }

    /// [`CudaBackend::proj`] (bf16 outputs) with the residual add + RMSNorm around it folded in (`fold`;
    /// [`Fold::None`]: `proj`). A folded projection is one int4 GEMV launch (`self.fold` checked that
    /// every layer's are).
    pub(super) fn proj_fold(
        &self,
        s: &CudaStream,
        x: u64,
        t: usize,
        kdim: usize,
        outs: &[ProjOut<'_>],
        fold: Fold,
    ) -> Result<(), CudaError> {
        if fold == Fold::None {
            return self.proj(s, x, t, kdim, outs, false);
        }
        let w4 =
            w4_outs(outs).ok_or_else(|| CudaError::Plan("a folded projection is not one int4 GEMV launch".into()))?;
        let cfg = w4_multi_config(&w4, kdim, self.k.w4_slots);
        w4a16::w4_gemv_fold(&self.k, s, &w4, x, kdim, t, cfg, fold)
    }

    /// Whether decode steps fold their RMSNorms into the int4 projections ([`CudaOptions::fold_norms`]
    /// and every layer's projections allow it).
    pub fn norms_fold(&self) -> bool {
        self.fold && self.opts.fold_norms
    }

    /// Whether this step's residual add + RMSNorms run right after the projections before them, in their
    /// split-K reduce where the int4 GEMM splits ([`CudaOptions::norms_in_reduce`]): steps of the int4
    /// GEMM's rows, tensor parallelism off (the norm follows the all-reduce there).
    pub(super) fn norms_in_reduce(&self, t: usize) -> bool {
        self.opts.norms_in_reduce && self.tp.is_none() && self.w4_gemm_rows(t)
    }

    /// Whether the int4 projections of a step of `t` tokens run the int4 GEMM: more than the decode
    /// GEMV's rows, at most [`CudaOptions::w4_gemm_max_rows`].
    fn w4_gemm_rows(&self, t: usize) -> bool {
        t > self.opts.gemv_max_tokens && t <= self.opts.w4_gemm_max_rows
    }

    /// Whether this step's norms fold into its projections ([`CudaOptions::fold_norms`]).
    pub(super) fn folds(&self, t: usize) -> bool {
        self.norms_fold() && t <= w4a16::GEMV_MAX_M && t <= self.opts.gemv_max_tokens
    }

    /// `y[t, w.out]` (row stride `ldy`) = `x[t, w.inp]` · Wᵀ for an int4 linear, reading the int4
    /// weights in place: the int4 GEMV for steps of at most `gemv_max_tokens` tokens, the int4
    /// tensor-core GEMM up to `w4_gemm_max_rows`, the GEMV for longer f32 outputs (lm_head logits);
    /// else row slices dequantised to bf16 in the scratch and a cuBLASLt GEMM per slice writing its
    /// columns of `y`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn w4_linear(
        &self,
        s: &CudaStream,
        x: u64,
        w: &W4Weights,
        y: u64,
        ldy: usize,
        t: usize,
        f32_out: bool,
    ) -> Result<(), CudaError> {
        let gemv_rows = t <= self.opts.gemv_max_tokens;
        if self.w4_gemm_rows(t) && w4_gemm::supported(w, x, w.inp) {
            let ws = self.ws.w4_gemm;
            let cfg = w4_gemm::w4_gemm_config(t, w.out, w.inp, self.k.sm_count, ws.bytes);
            let xs = Some(self.ws.w4_x);
            return w4_gemm::w4_gemm(&self.k, s, w, x, w.inp, y, ldy, t, cfg, f32_out, Some(ws), xs);
        }
        let xs = (self.ws.w4_x.bytes >= w4_gemm::w4_gemm_x_scratch_bytes(w4a16::GEMV_MAX_M, w.inp))
            .then_some(self.ws.w4_x.ptr);
        if f32_out || gemv_rows {
            let cfg = w4a16::gemv_config(w.out, w.inp, self.k.w4_slots);
            return w4a16::w4_gemv_out(&self.k, s, w, x, w.inp, y, ldy, t, cfg, xs, f32_out);
        }
        let slice = self.ws.w4_slice;
        let rows = w4_slice_rows(w.out, w.inp, slice.bytes);
        if rows == 0 {
            return Err(CudaError::Plan(format!(
                "the int4 prefill slice ({} B) cannot hold 16 rows of a [{}, {}] linear",
                slice.bytes, w.out, w.inp
            )));
        }
        for r0 in (0..w.out).step_by(rows) {
            let r1 = (r0 + rows).min(w.out);
            w4a16::w4_dequant(&self.k, s, w, r0, r1, slice.ptr, w.inp)?;
            self.gemm.linear_ld(s, x, slice.ptr, y + 2 * r0 as u64, t, r1 - r0, w.inp, ldy, false)?;
        }
        Ok(())
    }

    /// How block-FP8 linears sharing `x [t, kdim]` run on the tensor cores in a step of `t` tokens, if they
    /// do: our mma.sync FP8 GEMM with [`crate::CudaOptions::fp8_mma_gemm`] (sm_89+) over every token, else
    /// cuBLASLt's block-scaled FP8 GEMM where it runs (Hopper) over the first `t & !3` (the rest by the
    /// GEMV). None: the GEMV (up to 16 tokens) or dequantised row slices.
    pub(super) fn fp8_gemm_route(&self, t: usize, kdim: usize, outs: &[Fp8Out<'_>], f32_out: bool) -> Option<Fp8Gemm> {
        if t <= fp8::GEMV_MAX_TOKENS || f32_out || !self.opts.fp8_tensor_cores {
            return None;
        }
        let scratch = self.ws.fp8_x.bytes;
        let mma = self.opts.fp8_mma_gemm
            && fp8::gemm_mma_supported(&self.k.arch)
            && kdim.is_multiple_of(fp8::FP8_BLOCK)
            && scratch >= fp8::act_scratch_bytes(t, kdim)
            && outs.iter().all(|o| o.w.out.is_multiple_of(8) && o.ldy.is_multiple_of(2) && o.y.is_multiple_of(4));
        if mma {
            return Some(Fp8Gemm { mma: true, tq: t });
        }
        let t4 = t & !3;
        let cublas = self.rt.cc.0 >= 9
            && scratch >= fp8::act_scratch_bytes(t4, kdim)
            && outs.iter().all(|o| self.gemm.fp8_supported(o.w.out, t4, kdim, o.ldy, o.y));
        cublas.then_some(Fp8Gemm { mma: false, tq: t4 })
    }

    /// Where [`Self::fp8_gemm_route`] puts the codes and scales of `tq` tokens of `kdim` features.
    fn fp8_x_at(&self, tq: usize, kdim: usize) -> (u64, u64) {
        let q = self.ws.fp8_x.ptr;
        (q, q + fp8::act_scales_offset(tq, kdim) as u64)
    }

    /// Whether the kernel that writes an activation `[t, kdim]` for the projection `w` (into `y`, row stride
    /// `ldy`) writes its FP8 codes and scales too ([`Self::fp8_fused_targets`] of that one output).
    pub(super) fn fp8_fused_target(
        &self,
        w: &Proj,
        t: usize,
        kdim: usize,
        y: u64,
        ldy: usize,
    ) -> Option<(usize, (u64, u64))> {
        self.fp8_fused_targets(&[po(w, y, ldy)], t, kdim)
    }

    /// Whether the kernel that writes an activation `[t, kdim]` for the projections `outs` (sharing it as x)
    /// writes its FP8 codes and scales too: every part block-FP8, run on the tensor cores this step, with
    /// [`crate::CudaOptions::fp8_fused_quant`]. Some: the tokens to quantise (the rest the GEMV takes as bf16)
    /// and where their codes and scales go; the kernel's caller then calls [`Self::fp8_x_written`].
    pub(super) fn fp8_fused_targets(&self, outs: &[ProjOut<'_>], t: usize, kdim: usize) -> Option<(usize, (u64, u64))> {
        if !self.opts.fp8_fused_quant || !kdim.is_multiple_of(fp8::FP8_BLOCK) || outs.is_empty() {
            return None;
        }
        let fp8 = fp8_outs(outs)?;
        let tq = self.fp8_gemm_route(t, kdim, &fp8, false)?.tq;
        Some((tq, self.fp8_x_at(tq, kdim)))
    }

    /// The residual add + RMSNorm of the step's `t` rows (`x` added to `res` where given, `res_out` updated)
    /// into `out`, the input of the projections `outs`: where those take FP8 codes
    /// ([`Self::fp8_fused_targets`]) and the norm's many-rows kernel runs, it writes the codes instead of
    /// `out`'s quantised rows ([`norm::add_rms_norm_1p_quant`]).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn add_norm_into(
        &self,
        s: &CudaStream,
        (x, res, res_out): (u64, Option<u64>, Option<u64>),
        norm_w: u64,
        out: u64,
        t: usize,
        outs: &[ProjOut<'_>],
    ) -> Result<(), CudaError> {
        let (h, eps) = (self.d.hidden, self.eps);
        let ptrs = [x, res.unwrap_or(0), norm_w, res_out.unwrap_or(0), out];
        if let Some((tq, at)) = self.fp8_fused_targets(outs, t, h)
            && norm::add_rms_norm_1p_quant_supported(t, h, &ptrs, at)
        {
            norm::add_rms_norm_1p_quant(&self.k, s, (x, res, norm_w, res_out, out), (t, h, eps), tq, at)?;
            self.fp8_x_written(out, tq, h);
            return Ok(());
        }
        norm::add_rms_norm_1p(&self.k, s, x, res, norm_w, res_out, out, t, h, eps)
    }

    /// The FP8 scratch now holds the codes and scales of the first `tq` tokens of the activation at `x`
    /// (`kdim` features), which its writer quantised ([`Self::fp8_fused_target`]): the projection that reads
    /// `x` next takes them instead of quantising.
    pub(super) fn fp8_x_written(&self, x: u64, tq: usize, kdim: usize) {
        self.fp8_x_holds.set(Some(Fp8XTag { x, tq, kdim }));
    }

    /// `y_s = x · W_sᵀ` for block-FP8 linears sharing `x [t, kdim]`: the FP8 GEMV (three linears a launch)
    /// for steps of up to 16 tokens; longer ones on the tensor cores where [`Self::fp8_gemm_route`] says
    /// (x quantised once per 128 features and token, unless the kernel that wrote x did: [`Fp8XTag`]),
    /// else row slices dequantised to bf16 and a bf16 GEMM per slice (and for f32 outputs).
    pub(super) fn fp8_proj(
        &self,
        s: &CudaStream,
        x: u64,
        t: usize,
        kdim: usize,
        outs: &[Fp8Out<'_>],
        f32_out: bool,
    ) -> Result<(), CudaError> {
        let held = self.fp8_x_holds.take();
        if t <= fp8::GEMV_MAX_TOKENS {
            for group in outs.chunks(fp8::MAX_OUTS) {
                fp8::gemv_fp8(&self.k, s, x, t, kdim, group, f32_out)?;
            }
            return Ok(());
        }
        if let Some(route) = self.fp8_gemm_route(t, kdim, outs, f32_out) {
            let tq = route.tq;
            let (q, xs) = self.fp8_x_at(tq, kdim);
            if held != Some(Fp8XTag { x, tq, kdim }) {
                fp8::act_quant(&self.k, s, x, tq, kdim, q, xs)?;
            }
            for o in outs {
                if route.mma {
                    fp8::gemm_mma(&self.k, s, q, xs, tq, o.w, o.y, o.ldy)?;
                } else {
                    self.gemm.linear_fp8(s, q, xs, o.w.codes, o.w.scales, o.y, tq, o.w.out, kdim, o.ldy)?;
                }
            }
            if tq < t {
                let rest: Vec<Fp8Out<'_>> =
                    outs.iter().map(|o| Fp8Out { y: o.y + (2 * tq * o.ldy) as u64, ..*o }).collect();
                let xr = x + (2 * tq * kdim) as u64;
                for group in rest.chunks(fp8::MAX_OUTS) {
                    fp8::gemv_fp8(&self.k, s, xr, t - tq, kdim, group, false)?;
                }
            }
            return Ok(());
        }
        let slice = self.ws.w4_slice;
        for o in outs {
            let w = o.w;
            let rows = w4_slice_rows(w.out, w.inp, slice.bytes);
            if rows == 0 {
                return Err(CudaError::Plan(format!(
                    "the fp8 prefill slice ({} B) cannot hold 16 rows of a [{}, {}] linear",
                    slice.bytes, w.out, w.inp
                )));
            }
            let eb = if f32_out { 4 } else { 2 };
            for r0 in (0..w.out).step_by(rows) {
                let r1 = (r0 + rows).min(w.out);
                fp8::dequant(&self.k, s, w, r0, r1, slice.ptr)?;
                self.gemm.linear_ld(s, x, slice.ptr, o.y + (eb * r0) as u64, t, r1 - r0, w.inp, o.ldy, f32_out)?;
            }
        }
        Ok(())
    }

    /// A mixer's output projection: into `mixer_out`, or with `out_norm` the post-attention norm too.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn mixer_out_proj(
        &self,
        s: &CudaStream,
        ws: &Ws,
        x: u64,
        t: usize,
        kdim: usize,
        w: &Proj,
        out_norm: Option<OutNorm>,
    ) -> Result<(), CudaError> {
        let h = self.d.hidden;
        match out_norm {
            Some(OutNorm::Fold(f)) => self.proj_fold(s, x, t, kdim, &[po(w, ws.residual, h)], f),
            Some(OutNorm::After { w: nw, out }) => self.proj_norm(s, x, t, kdim, w, ws.mixer_out, nw, out),
            None => self.proj(s, x, t, kdim, &[po(w, ws.mixer_out, h)], false),
        }
    }

    /// `y [t, hidden]` = x · Wᵀ, then the residual add + RMSNorm of weight `norm_w` over it into `out`
    /// (the residual stream updated). An int4 linear whose int4 GEMM launch splits over K runs the norm
    /// in the reduce of its partial sums ([`w4_gemm::w4_gemm_norm`]: y is not written); otherwise
    /// [`CudaBackend::proj`] into y and [`norm::add_rms_norm_1p`]. Both give the same bits.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn proj_norm(
        &self,
        s: &CudaStream,
        x: u64,
        t: usize,
        kdim: usize,
        w: &Proj,
        y: u64,
        norm_w: u64,
        out: u64,
    ) -> Result<(), CudaError> {
        let (h, res, eps) = (self.d.hidden, self.ws.residual, self.eps);
        if let [Part::W4(w4)] = w.as_slice()
            && w4.out == h
            && self.w4_gemm_rows(t)
            && w4_gemm::supported(w4, x, kdim)
        {
            let (sms, ws) = (self.k.sm_count, self.ws.w4_gemm);
            let cfg = w4_gemm::w4_gemm_config(t, w4.out, w4.inp, sms, ws.bytes);
            let an = w4_gemm::AddNorm { res, w: norm_w, out, eps };
            if w4_gemm::norm_supported(w4, cfg, &an) {
                return w4_gemm::w4_gemm_norm(&self.k, s, w4, x, kdim, t, cfg, ws, Some(self.ws.w4_x), an);
            }
        }
        self.proj(s, x, t, kdim, &[po(w, y, h)], false)?;
        norm::add_rms_norm_1p(&self.k, s, y, Some(res), norm_w, Some(res), out, t, h, eps)
    }
}

/// What the projection that ends a mixer (or the MLP) does with the norm after it.
#[derive(Clone, Copy)]
pub(super) enum OutNorm {
    /// Folded into its int4 GEMV ([`Fold::Residual`]).
    Fold(Fold),
    /// Run right after it ([`CudaBackend::proj_norm`]): the residual add + RMSNorm of weight `w` into
    /// `out`.
    After { w: u64, out: u64 },
}

/// How a layer's RMSNorms go with its projections ([`CudaBackend::layer`]; the post-attention norm
/// always does when this is given): folded into int4 GEMVs (`gemv`), or run by the projection before
/// each ([`CudaBackend::proj_norm`]).
#[derive(Clone, Copy)]
pub(super) struct LayerFold {
    /// The input norm went with the previous layer's down projection.
    pub(super) input: bool,
    /// The weight of the norm after this layer (the next layer's input norm), which goes with the down
    /// projection; None: the output goes to `mlp_out`.
    pub(super) next_norm: Option<u64>,
    /// Folded into the int4 GEMVs ([`Fold`]); false: [`OutNorm::After`].
    pub(super) gemv: bool,
}

/// One output of [`CudaBackend::proj`]: `y [t, m]`, its parts writing consecutive columns.
pub(super) struct ProjOut<'a> {
    pub(super) parts: &'a [Part],
    pub(super) y: u64,
    pub(super) m: usize,
}

/// The int4 GEMV outputs of `outs` when every part is int4 and one launch takes them all
/// ([`w4a16::multi_supported`]).
pub(super) fn w4_outs<'a>(outs: &[ProjOut<'a>]) -> Option<Vec<w4a16::W4Out<'a>>> {
    let mut w4 = Vec::new();
    for o in outs {
        let mut col = 0usize;
        for p in o.parts {
            let Part::W4(w) = p else { return None };
            w4.push(w4a16::W4Out { w, y: o.y + (2 * col) as u64, ldy: o.m });
            col += w.out;
        }
        if col != o.m {
            return None;
        }
    }
    w4a16::multi_supported(&w4).then_some(w4)
}

/// The FP8 outputs of `outs` when every part is block-FP8 (each part writing its columns of its output).
fn fp8_outs<'a>(outs: &[ProjOut<'a>]) -> Option<Vec<Fp8Out<'a>>> {
    let mut v = Vec::new();
    for o in outs {
        let mut col = 0usize;
        for p in o.parts {
            let Part::Fp8(w) = p else { return None };
            v.push(Fp8Out { w, y: o.y, ldy: o.m });
            v.last_mut()?.y = o.y + (2 * col) as u64;
            col += w.out;
        }
        if col != o.m {
            return None;
        }
    }
    Some(v)
}

/// The GEMV configuration of one launch over `w4` (their rows summed).
pub(super) fn w4_multi_config(w4: &[w4a16::W4Out<'_>], kdim: usize, slots: usize) -> w4a16::GemvConfig {
    w4a16::gemv_config(w4.iter().map(|o| o.w.out).sum(), kdim, slots)
}

/// Whether every layer's residual add + RMSNorm can fold into its projections: rows of `hidden` fold
/// ([`w4a16::fold_supported`]), each projection that follows a norm is one int4 GEMV launch, and each
/// that feeds the residual stream one int4 linear.
pub(super) fn layers_fold(layers: &[Layer], hidden: usize) -> bool {
    fn whole(p: &Proj) -> ProjOut<'_> {
        po(p, 0, p.iter().map(Part::rows).sum())
    }
    let launch = |ps: &[&Proj]| w4_outs(&ps.iter().map(|p| whole(p)).collect::<Vec<_>>()).is_some();
    let linear = |p: &Proj| w4_outs(&[whole(p)]).is_some_and(|w| w.len() == 1);
    w4a16::fold_supported(hidden)
        && layers.iter().all(|l| {
            let (inp, out) = match &l.mixer {
                Mixer::Gdn(g) => (launch(&[&g.qkv, &g.z, &g.ba]), &g.out),
                Mixer::Attn(a) => (launch(&[&a.q, &a.k, &a.v]), &a.o),
            };
            inp && linear(out) && launch(&[&l.gate_up]) && linear(&l.down) && l.moe.is_none()
        })
}

pub(super) fn po(parts: &[Part], y: u64, m: usize) -> ProjOut<'_> {
    ProjOut { parts, y, m }
}

/// How a step's block-FP8 projections run on the tensor cores ([`CudaBackend::fp8_gemm_route`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Fp8Gemm {
    /// Our mma.sync FP8 GEMM; false: cuBLASLt's block-scaled one.
    pub(super) mma: bool,
    /// The tokens it takes (the first `tq` of the step; the rest by the GEMV, from bf16).
    pub(super) tq: usize,
}

/// The FP8 activation scratch holds the codes and scales of the first `tq` tokens of the activation at
/// `x` (`kdim` features), written by the kernel that wrote `x` for the projection that reads it next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Fp8XTag {
    x: u64,
    tq: usize,
    kdim: usize,
}
