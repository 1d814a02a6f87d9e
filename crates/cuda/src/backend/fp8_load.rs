//! Block-FP8 linears placed in the weights region: a checkpoint's as stored (e4m3 codes uploaded as
//! they are, their scales as f32), a bf16 checkpoint's quantised on the GPU at load (`--quantize fp8`),
//! or random codes at the real shapes.

use deltaserve_model::quant::QuantizedSource;
use deltaserve_model::weights::TensorSource;
use deltaserve_plan::cuda::Fp8Bytes;

use crate::error::CudaError;
use crate::ops::Kernels;
use crate::ops::fp8::{self, FP8_BLOCK, Fp8Weights};
use crate::ops::init::{Init, init_random};
use crate::runtime::Runtime;

use super::loader::Loader;
use super::weights::Part;

impl Loader<'_> {
    /// One decoder linear under fp8 weights: block-FP8 (128×128) as the checkpoint stores it; a linear the
    /// checkpoint stores unquantised stays bf16 in an FP8 checkpoint (`keep_dense`), else it is quantised
    /// on the GPU.
    pub(super) fn fp8_linear(&mut self, src: &TensorSource<'_>, keep_dense: bool) -> Result<Part, CudaError> {
        let werr = |e: deltaserve_model::ModelError| CudaError::Weights(e.to_string());
        if let Some(QuantizedSource::Fp8Block(f)) = &src.quantized
            && f.block == [FP8_BLOCK, FP8_BLOCK]
        {
            let (out, inp) = (f.out_features, f.in_features);
            let scales = fp8::pad_scales(&f.scales_f32(&src.name).map_err(werr)?, out, inp);
            let w = self.alloc_fp8(out, inp, &src.name)?;
            self.rt.upload(w.codes, f.weight)?;
            self.rt.upload(w.scales, &scales)?;
            self.converted += 1;
            return Ok(Part::Fp8(w));
        }
        let (bytes, shape) = self.bytes(src, false).map_err(werr)?;
        let [out, inp] = shape[..] else {
            return Err(CudaError::Weights(format!("`{}`: shape {shape:?} is not a linear", src.name)));
        };
        if keep_dense {
            return Ok(Part::Bf16 { w: self.dense(&bytes)?, rows: out });
        }
        let w = self.alloc_fp8(out, inp, &src.name)?;
        self.quantize_fp8(&bytes, &w, &src.name)?;
        Ok(Part::Fp8(w))
    }

    /// Places linear `name` `[out, in]` in the weights region, checked for the kernels.
    fn alloc_fp8(&mut self, out: usize, inp: usize, name: &str) -> Result<Fp8Weights, CudaError> {
        let base = self.arena.alloc(self.wreg, Fp8Bytes::new(out, inp).aligned())?.ptr;
        let w = Fp8Weights::at(base, out, inp);
        w.check("fp8 weights").map_err(|e| CudaError::Weights(format!("`{name}`: {e}")))?;
        Ok(w)
    }

    /// `[out, in]` bf16 bytes quantised on the GPU into `w`, 128-row blocks at a time through the staging.
    fn quantize_fp8(&mut self, bf16: &[u8], w: &Fp8Weights, name: &str) -> Result<(), CudaError> {
        let inp = w.inp;
        let step = self.staging.bytes / (2 * inp) / FP8_BLOCK * FP8_BLOCK;
        if step == 0 {
            return Err(CudaError::Plan(format!(
                "--quantize fp8 stages 128 rows of each linear in the KV pages region: {} B cannot hold 128 rows \
                 of `{name}` ({} B); plan for more context (or a larger --memory)",
                self.staging.bytes,
                256 * inp
            )));
        }
        let s = self.rt.stream().clone();
        let kb = inp.div_ceil(FP8_BLOCK);
        for r in (0..w.out).step_by(step) {
            let r1 = (r + step).min(w.out);
            // upload() waits for the stream, so the previous block's quantisation has read the staging.
            self.rt.upload(self.staging.ptr, &bf16[2 * r * inp..2 * r1 * inp])?;
            let rows = Fp8Weights {
                codes: w.codes + (r * inp) as u64,
                scales: w.scales + (4 * (r / FP8_BLOCK) * kb) as u64,
                out: r1 - r,
                inp,
            };
            fp8::quantize(self.k, &s, self.staging.ptr, &rows)?;
        }
        self.rt.synchronize()?;
        self.quantized += 1;
        Ok(())
    }
}

/// A random block-FP8 `[out, in]` linear placed at `base`: codes of 32·N(0, 1) and scales near
/// `1/(32·sqrt(in))` (weights of std `1/sqrt(in)`, as the bf16 layout's).
pub(super) fn random_fp8(
    k: &Kernels,
    rt: &Runtime,
    base: u64,
    out: usize,
    inp: usize,
    seed: u64,
) -> Result<Fp8Weights, CudaError> {
    let w = Fp8Weights::at(base, out, inp);
    let (b, s) = (w.bytes(), rt.stream());
    init_random(k, s, w.codes, b.codes, seed, Init::Fp8Codes(32.0), false)?;
    let std = 1.0 / (inp as f32).sqrt() / 32.0;
    init_random(k, s, w.scales, b.scales / 4, seed ^ 1, Init::Scale(std), true)?;
    Ok(w)
}
