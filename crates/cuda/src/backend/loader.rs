//! Placing the weights in the weights region: a checkpoint's tensors (converted, cut to a rank's shard,
//! quantised to int4 or converted from GPTQ on the way) or random weights at the real shapes; with
//! `experts_on_host` the routed experts in the pinned host block instead (`expert_load.rs`,
//! `host_experts.rs`).

use deltaserve_model::shard::{ShardSpec, Split};
use deltaserve_model::weights::TensorSource;
use deltaserve_model::{Checkpoint, DType, LayerKind, ModelConfig, ModelError, ModelWeights, MoeConfig, MtpWeights};
use deltaserve_plan::cuda::{DenseRole, Fp8Bytes, WeightFormat, WeightTensor, weight_tensors};
use deltaserve_plan::{is_f32_tensor, is_linear};

use crate::arena::{ALIGN, Arena, DevSpan};
use crate::error::CudaError;
use crate::ops::init::{Init, init_random};
use crate::ops::w4a16::W4Weights;
use crate::ops::{Kernels, w4a16};
use crate::runtime::Runtime;
use crate::w4::{ScaleDtype, W4Bytes, W4Linear};

use super::CudaBackend;
use super::expert_load::W4ExpertBlock;
use super::host_experts::{ExpertStage, HostExperts, HostFill};
use super::moe::{ExpertBlock, MoeLayer, expert_proj, loaded_experts};
use super::spec::MtpHead;
use super::weights::{AttnLayer, GdnLayer, Layer, Mixer, Part, Proj, Weights};

/// The first of a pair stored as one [2·rows, cols] tensor (the second follows it).
pub(super) fn pair_first(name: &str) -> bool {
    name.contains("in_proj_b.weight")
        || name.contains("mlp.gate_proj.weight")
        || name.contains("mlp.shared_expert.gate_proj.weight")
}

pub(super) fn pair_second(name: &str) -> bool {
    name.contains("in_proj_a.weight")
        || name.contains("mlp.up_proj.weight")
        || name.contains("mlp.shared_expert.up_proj.weight")
}

/// The random initialisation of a dense tensor by what it holds (projections of std `1/sqrt(fan_in)`).
pub(super) fn random_init(role: DenseRole) -> Init {
    match role {
        DenseRole::Embed => Init::Normal(1.0),
        DenseRole::Linear { fan_in } => Init::Normal(1.0 / (fan_in as f32).sqrt()),
        DenseRole::Norm => Init::Normal(0.1),
        DenseRole::ConvTaps | DenseRole::DtBias => Init::Normal(0.5),
        DenseRole::ALog => Init::LogUniform1To16,
        DenseRole::GatedNorm => Init::OnePlusNormal(0.1),
    }
}

/// A tensor's shard from its full little-endian bytes, `N` bytes per element (one copy: the shard).
pub(super) fn shard_bytes<const N: usize>(
    split: &Split,
    name: &str,
    shape: &[usize],
    bytes: &[u8],
) -> Result<Vec<u8>, ModelError> {
    let (elems, rest) = bytes.as_chunks::<N>();
    if !rest.is_empty() {
        return Err(ModelError::weights(format!("`{name}`: {} bytes are not whole {N}-byte elements", bytes.len())));
    }
    Ok(split.extract(name, shape, elems)?.into_flattened())
}

/// Places weights in the weights region while a checkpoint loads.
pub(super) struct Loader<'a> {
    pub(super) rt: &'a Runtime,
    pub(super) k: &'a Kernels,
    pub(super) arena: &'a mut Arena,
    pub(super) wreg: crate::arena::RegionId,
    /// Device staging for quantisation at load (the empty KV pages region; after the expert stage with
    /// routed experts on the host).
    pub(super) staging: DevSpan,
    /// The pinned block of the routed experts (`experts_on_host`).
    pub(super) host: Option<&'a mut HostExperts>,
    /// Where experts quantised at load for the host block are quantised first.
    pub(super) stage: Option<ExpertStage>,
    pub(super) quantized: usize,
    pub(super) converted: usize,
    pub(super) total_w4: usize,
    /// Tensor parallelism: the rank's shard, cut from every tensor as it loads.
    pub(super) shard: Option<&'a ShardSpec>,
}

impl Loader<'_> {
    /// The source tensor as little-endian bf16 (or f32) bytes, cut to the rank's shard under tensor
    /// parallelism, with its (shard's) shape.
    pub(super) fn bytes(&self, src: &TensorSource<'_>, f32_out: bool) -> Result<(Vec<u8>, Vec<usize>), ModelError> {
        let bytes = convert(src, f32_out)?;
        match self.shard {
            None => Ok((bytes, src.shape.clone())),
            Some(spec) => {
                let split = spec.split_stored(&src.name)?;
                let shape = split.shard_shape(&src.shape);
                let out = if f32_out {
                    shard_bytes::<4>(&split, &src.name, &src.shape, &bytes)?
                } else {
                    shard_bytes::<2>(&split, &src.name, &src.shape, &bytes)?
                };
                Ok((out, shape))
            }
        }
    }

    pub(super) fn dense(&mut self, bytes: &[u8]) -> Result<u64, CudaError> {
        let ptr = self.arena.alloc(self.wreg, bytes.len())?.ptr;
        self.rt.upload(ptr, bytes)?;
        Ok(ptr)
    }

    /// `[out, in]` bf16 bytes quantised on the GPU (rows staged through `staging`).
    pub(super) fn quantize(
        &mut self,
        bf16: &[u8],
        out: usize,
        inp: usize,
        asym: bool,
        name: &str,
    ) -> Result<W4Weights, CudaError> {
        W4Linear::check_shape(name, out, inp)?;
        let (_, bytes) = W4Bytes::new(out, inp, asym, false).layout(ALIGN);
        let base = self.arena.alloc(self.wreg, bytes)?.ptr;
        let w = W4Weights::at(base, out, inp, asym, false, ScaleDtype::F16);
        self.quantize_rows(bf16, out, &w, 0, name)?;
        Ok(w)
    }

    /// `rows` rows of bf16 bytes quantised on the GPU into rows `row0 .. row0 + rows` of the placed
    /// int4 linear `w` (f16 scales; rows staged through `staging`).
    pub(super) fn quantize_rows(
        &mut self,
        bf16: &[u8],
        rows: usize,
        w: &W4Weights,
        row0: usize,
        name: &str,
    ) -> Result<(), CudaError> {
        let inp = w.inp;
        if bf16.len() != 2 * rows * inp || row0 + rows > w.out || !row0.is_multiple_of(2) {
            return Err(CudaError::Weights(format!(
                "`{name}`: {} B, expected [{rows}, {inp}] bf16 for rows {row0}.. of a [{}, {inp}] int4 linear",
                bf16.len(),
                w.out
            )));
        }
        let step = (self.staging.bytes / (2 * inp)).min(rows.next_multiple_of(2)) & !1;
        if step < 2 {
            return Err(CudaError::Plan(format!(
                "--quantize int4 stages each linear's rows in the KV pages region: {} B cannot hold 2 rows of \
                 `{name}` [{rows}, {inp}] ({} B); plan for more context (or a larger --memory)",
                self.staging.bytes,
                4 * inp
            )));
        }
        let s = self.rt.stream().clone();
        for r in (0..rows).step_by(step) {
            let r1 = (r + step).min(rows);
            // upload() waits for the stream, so the previous chunk's quantisation has read the staging.
            self.rt.upload(self.staging.ptr, &bf16[2 * r * inp..2 * r1 * inp])?;
            w4a16::w4_quantize(self.k, &s, self.staging.ptr, inp, row0 + r, row0 + r1, w)?;
        }
        self.rt.synchronize()?;
        self.quantized += 1;
        let n = self.quantized + self.converted;
        if n.is_multiple_of(32) || n == self.total_w4 {
            tracing::info!("int4 weights: {n}/{} linears", self.total_w4);
        }
        Ok(())
    }

    /// One GPTQ-packed linear converted to the device format on the host (warning where it had to round).
    pub(super) fn convert_gptq(
        &mut self,
        g: &deltaserve_model::quant::GptqSource<'_>,
        name: &str,
    ) -> Result<W4Linear, CudaError> {
        let c = W4Linear::from_gptq(g, name)?;
        if c.zero16_clamped > 0 || c.scales_rounded > 0 {
            tracing::warn!(
                "`{name}`: {} zero points of 16 clamped to 15, {} f32 scales rounded to fp16",
                c.zero16_clamped,
                c.scales_rounded
            );
        }
        self.converted += 1;
        Ok(c.linear)
    }

    /// Copies a host int4 linear into the placed `w` (same shape and format).
    pub(super) fn upload_w4(&self, l: &W4Linear, w: &W4Weights) -> Result<(), CudaError> {
        self.rt.upload(w.qweight, &l.qweight)?;
        self.rt.upload(w.scales, &l.scales)?;
        if let (Some(p), Some(z)) = (w.zeros, &l.zeros) {
            self.rt.upload(p, z)?;
        }
        if let (Some(p), Some(v)) = (w.perm, &l.perm) {
            self.rt.upload(p, v)?;
        }
        Ok(())
    }

    pub(super) fn gptq(
        &mut self,
        g: &deltaserve_model::quant::GptqSource<'_>,
        name: &str,
    ) -> Result<W4Weights, CudaError> {
        let l = self.convert_gptq(g, name)?;
        let (asym, perm) = (l.zeros.is_some(), l.perm.is_some());
        let (_, bytes) = l.bytes().layout(ALIGN);
        let base = self.arena.alloc(self.wreg, bytes)?.ptr;
        let w = W4Weights::at(base, l.out_features, l.in_features, asym, perm, l.scale_dtype);
        self.upload_w4(&l, &w)?;
        Ok(w)
    }

    /// One linear: int4 (converted from GPTQ, or quantised unless `keep_dense`) or bf16.
    pub(super) fn linear(
        &mut self,
        src: &TensorSource<'_>,
        int4: bool,
        asym: bool,
        keep_dense: bool,
    ) -> Result<Part, CudaError> {
        if int4 && let Some(deltaserve_model::QuantizedSource::Gptq(g)) = &src.quantized {
            if let Some(spec) = self.shard {
                // The rank's shard of the packed tensors, converted like a whole linear.
                let werr = |e: ModelError| CudaError::Weights(e.to_string());
                let split = spec.split_stored(&src.name).map_err(werr)?;
                let cut = deltaserve_model::shard::shard_gptq(&split, g, &src.name).map_err(werr)?;
                return Ok(Part::W4(self.gptq(&cut.source(), &src.name)?));
            }
            return Ok(Part::W4(self.gptq(g, &src.name)?));
        }
        let (bytes, shape) = self.bytes(src, false).map_err(|e| CudaError::Weights(e.to_string()))?;
        let (out, inp) = match shape.as_slice() {
            [o, i] => (*o, *i),
            s => return Err(CudaError::Weights(format!("`{}`: shape {s:?} is not a linear", src.name))),
        };
        if int4 && !keep_dense {
            return Ok(Part::W4(self.quantize(&bytes, out, inp, asym, &src.name)?));
        }
        Ok(Part::Bf16 { w: self.dense(&bytes)?, rows: out })
    }
}

/// The source tensor as little-endian bf16 or f32 bytes.
pub(super) fn convert(src: &TensorSource<'_>, f32_out: bool) -> Result<Vec<u8>, ModelError> {
    if !f32_out && src.dtype == DType::BF16 {
        let mut out = Vec::with_capacity(src.byte_len());
        for p in &src.parts {
            out.extend_from_slice(p);
        }
        return Ok(out);
    }
    let x = src.to_f32()?;
    let mut out = Vec::with_capacity(x.len() * if f32_out { 4 } else { 2 });
    for v in x {
        if f32_out {
            out.extend_from_slice(&v.to_le_bytes());
        } else {
            out.extend_from_slice(&half::bf16::from_f32(v).to_bits().to_le_bytes());
        }
    }
    Ok(out)
}

/// A random int4 `[out, in]` linear placed at `base`: uniform codes, bf16 group scales of weights of std
/// `1/sqrt(in)`, zero points 8 (asymmetric).
pub(super) fn random_w4(
    k: &Kernels,
    rt: &Runtime,
    base: u64,
    out: usize,
    inp: usize,
    asym: bool,
    seed: u64,
) -> Result<W4Weights, CudaError> {
    let w = W4Weights::at(base, out, inp, asym, false, ScaleDtype::Bf16);
    let (b, s) = (w.bytes(), rt.stream());
    init_random(k, s, w.qweight, b.qweight / 4, seed, Init::Bits, false)?;
    // Uniform codes with zero 8 have a std of ~4.6 steps: weights of std 1/sqrt(in).
    let std = 1.0 / (inp as f32).sqrt() / 4.6;
    init_random(k, s, w.scales, b.scales / 2, seed ^ 1, Init::Scale(std), false)?;
    if let Some(z) = w.zeros {
        rt.memset(z, 0x88, b.zeros)?;
    }
    Ok(w)
}

impl CudaBackend {
    /// Loads the checkpoint of the model `full` into this backend's layout for `cfg` (the rank's
    /// shape under tensor parallelism, where every tensor is cut to the rank's shard as it loads).
    pub(super) fn load_checkpoint(
        &mut self,
        full: &ModelConfig,
        cfg: &ModelConfig,
        dir: &std::path::Path,
        wreg: crate::arena::RegionId,
        fmt: WeightFormat,
        staging: DevSpan,
    ) -> Result<Weights, CudaError> {
        let ckpt = Checkpoint::open(dir).map_err(|e| CudaError::Weights(e.to_string()))?;
        let d = self.d;
        let h = d.hidden;
        // A GPTQ checkpoint keeps the linears it left unquantised in bf16; a bf16 checkpoint under an
        // int4 plan is quantised at load (`--quantize int4`).
        let keep_dense = matches!(cfg.quantization, Some(deltaserve_model::quant::Quantization::Gptq(_)));
        // Under fp8, a block-FP8 checkpoint keeps the linears it left unquantised in bf16; a bf16 checkpoint
        // is quantised at load (`--quantize fp8`).
        let fp8_checkpoint = matches!(cfg.quantization, Some(deltaserve_model::quant::Quantization::Fp8Block(_)));
        let total_w4 = weight_tensors(cfg, fmt)
            .iter()
            .filter(|s| matches!(s, WeightTensor::W4 { .. } | WeightTensor::HostW4 { .. }))
            .count();
        // int4 experts for the host block are quantised in a device stage at the start of the staging.
        let (stage, staging) = match (&self.host_experts, &cfg.moe) {
            (Some(_), Some(m)) if fmt.int4 => {
                let (st, rest) = ExpertStage::carve(staging, m.expert_intermediate, h, fmt.asym)?;
                (Some(st), rest)
            }
            _ => (None, staging),
        };
        let mut ld = Loader {
            rt: &self.rt,
            k: &self.k,
            arena: &mut self.arena,
            wreg,
            staging,
            host: self.host_experts.as_mut(),
            stage,
            quantized: 0,
            converted: 0,
            total_w4,
            shard: self.tp.as_ref().map(|t| &t.spec),
        };
        let mut pending: Option<u64> = None;
        let mut tied_head: Option<Part> = None;
        let host = self.host_embed.as_ref().map(|e| (e.table.ptr(), e.table.bytes()));
        let tied = cfg.tie_word_embeddings;
        let num_experts = full.moe.as_ref().map_or(0, |m| m.num_experts);
        let mut experts = ExpertBlock::default();
        let mut w4_experts = W4ExpertBlock::default();
        let mut convert = |src: TensorSource<'_>| -> Result<Part, ModelError> {
            let dev = |e: CudaError| ModelError::config(format!("{}: {e}", src.name));
            let name = src.name.clone();
            if let Some(at) = expert_proj(&name) {
                if fmt.int4 {
                    return w4_experts.place(&mut ld, &src, at, num_experts, fmt.asym).map_err(dev);
                }
                // Every expert of the layer in one bf16 block (on the device, or in the host block).
                let (bytes, shape) = ld.bytes(&src, false)?;
                let mut alloc = |n: usize| ld.alloc_experts(n);
                let ptr = experts.place(&name, at, bytes.len(), num_experts, &mut alloc).map_err(dev)?;
                ld.put_experts(ptr, &bytes).map_err(dev)?;
                return Ok(Part::Bf16 { w: ptr, rows: shape[0] });
            }
            if name.ends_with("embed_tokens.weight") {
                let (bytes, _) = ld.bytes(&src, false)?;
                let own_head = tied && fmt.own_lm_head(tied);
                if own_head {
                    tied_head = Some(if fmt.lm_head_int4 {
                        Part::W4(ld.quantize(&bytes, d.vocab, h, fmt.asym, &name).map_err(dev)?)
                    } else {
                        Part::Bf16 { w: ld.dense(&bytes).map_err(dev)?, rows: d.vocab }
                    });
                }
                return match host {
                    Some((table, table_bytes)) => {
                        if bytes.len() != table_bytes {
                            return Err(ModelError::config(format!(
                                "{name}: {} B, expected {table_bytes}",
                                bytes.len()
                            )));
                        }
                        // SAFETY: the pinned table holds table_bytes bytes and lives as long as the backend.
                        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), table, table_bytes) };
                        Ok(Part::Bf16 { w: 0, rows: d.vocab })
                    }
                    None => Ok(Part::Bf16 { w: ld.dense(&bytes).map_err(dev)?, rows: d.vocab }),
                };
            }
            if name.ends_with("lm_head.weight") {
                return ld.linear(&src, fmt.lm_head_int4, fmt.asym, false).map_err(dev);
            }
            if fmt.int4 && is_linear(&name) {
                return ld.linear(&src, true, fmt.asym, keep_dense).map_err(dev);
            }
            if fmt.fp8 && is_linear(&name) {
                return ld.fp8_linear(&src, fp8_checkpoint).map_err(dev);
            }
            // bf16 linears (pairs fused) and the small tensors.
            let f32_out = is_f32_tensor(&name);
            let (bytes, shape) = ld.bytes(&src, f32_out)?;
            let rows = if shape.len() == 2 { shape[0] } else { 0 };
            let ptr = if pair_second(&name) {
                pending
                    .take()
                    .ok_or_else(|| ModelError::config(format!("{name}: its pair's first half was not loaded")))?
            } else if pair_first(&name) {
                let span = ld.arena.alloc(ld.wreg, 2 * bytes.len()).map_err(dev)?;
                pending = Some(span.ptr + bytes.len() as u64);
                span.ptr
            } else {
                ld.arena.alloc(ld.wreg, bytes.len()).map_err(dev)?.ptr
            };
            ld.rt.upload(ptr, &bytes).map_err(dev)?;
            Ok(Part::Bf16 { w: ptr, rows: if pair_first(&name) { 2 * rows } else { rows } })
        };
        let werr = |e: ModelError| CudaError::Weights(e.to_string());
        let mw: ModelWeights<Part> = ModelWeights::load(&ckpt, full, &mut convert).map_err(werr)?;
        let mtp_w = if fmt.mtp {
            let m = ModelWeights::<Part>::load_mtp(&ckpt, full, &mut convert).map_err(werr)?;
            Some(m.ok_or_else(|| {
                CudaError::Weights("speculative decoding needs the checkpoint's MTP head (no `mtp.*` tensors)".into())
            })?)
        } else {
            None
        };
        let (quantized, converted) = (ld.quantized, ld.converted);
        if quantized > 0 && fmt.fp8 {
            tracing::info!("quantised {quantized} linears to block FP8 on the GPU (e4m3, 128×128 scale blocks)");
        } else if quantized > 0 {
            tracing::info!("quantised {quantized} linears to int4 on the GPU (round to nearest, group 128)");
        }
        self.w4_quantized = quantized;
        self.w4_converted = converted;
        let moe = full.moe.as_ref().map(|m| (m, h));
        checkpoint_weights(&mw, mtp_w, tied_head, fmt.int4 || fmt.fp8, self.host_embed.is_some(), moe)
    }

    pub(super) fn random_weights(
        &mut self,
        cfg: &ModelConfig,
        wreg: crate::arena::RegionId,
        seed: u64,
        fmt: WeightFormat,
        staging: DevSpan,
    ) -> Result<Weights, CudaError> {
        let specs = weight_tensors(cfg, fmt);
        let mut parts = Vec::with_capacity(specs.len());
        let s = self.rt.stream().clone();
        // Routed experts for the host block: made in the staging, copied down.
        let mut fill = HostFill::new(staging);
        let no_host = || CudaError::Plan("routed experts on the host without a host block".into());
        for (i, spec) in specs.iter().enumerate() {
            let tseed = seed ^ (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
            let part = match *spec {
                WeightTensor::Dense { n, f32, role } => {
                    let span = self.arena.alloc(wreg, n * if f32 { 4 } else { 2 })?;
                    init_random(&self.k, &s, span.ptr, n, tseed, random_init(role), f32)?;
                    Part::Bf16 { w: span.ptr, rows: 0 }
                }
                WeightTensor::Fp8 { out, inp } => {
                    let base = self.arena.alloc(wreg, Fp8Bytes::new(out, inp).aligned())?.ptr;
                    Part::Fp8(super::fp8_load::random_fp8(&self.k, &self.rt, base, out, inp, tseed)?)
                }
                WeightTensor::W4 { out, inp, asym } => {
                    let (_, bytes) = W4Bytes::new(out, inp, asym, false).layout(ALIGN);
                    let base = self.arena.alloc(wreg, bytes)?.ptr;
                    Part::W4(random_w4(&self.k, &self.rt, base, out, inp, asym, tseed)?)
                }
                WeightTensor::HostDense { n, role } => {
                    let he = self.host_experts.as_mut().ok_or_else(no_host)?;
                    let at = he.alloc(2 * n)?;
                    fill.dense((he, &self.rt, &self.k), at, n, tseed, random_init(role))?;
                    Part::Bf16 { w: at, rows: 0 }
                }
                WeightTensor::HostW4 { out, inp, asym } => {
                    let he = self.host_experts.as_mut().ok_or_else(no_host)?;
                    let at = he.alloc(W4Bytes::new(out, inp, asym, false).aligned())?;
                    Part::W4(fill.w4((he, &self.rt, &self.k), at, out, inp, asym, tseed)?)
                }
                WeightTensor::Host { n } => {
                    // The staging is the host embedding's now.
                    if let Some(he) = self.host_experts.as_mut() {
                        fill.flush(he, &self.rt)?;
                    }
                    let Some(he) = &self.host_embed else {
                        return Err(CudaError::Plan("embed_on_host without a host table".into()));
                    };
                    // Generated on the GPU through the (still empty) KV region, copied to the pinned table.
                    let chunk = (staging.bytes / 2).min(n);
                    if chunk == 0 {
                        return Err(CudaError::Plan("no KV region to stage the host embedding".into()));
                    }
                    for (c, e0) in (0..n).step_by(chunk).enumerate() {
                        let m = chunk.min(n - e0);
                        init_random(&self.k, &s, staging.ptr, m, tseed ^ c as u64, Init::Normal(1.0), false)?;
                        // SAFETY: the table holds n bf16 elements (table_bytes = 2n); e0 + m <= n.
                        let dst = unsafe { std::slice::from_raw_parts_mut(he.table.ptr().add(2 * e0), 2 * m) };
                        self.rt.download(dst, staging.ptr)?;
                    }
                    Part::Bf16 { w: 0, rows: 0 }
                }
            };
            parts.push(part);
        }
        if let Some(he) = self.host_experts.as_mut() {
            fill.flush(he, &self.rt)?;
        }
        let mut it = parts.into_iter();
        let mut next = || it.next().ok_or_else(|| CudaError::Weights("weight spec list too short".into()));
        let proj = |next: &mut dyn FnMut() -> Result<Part, CudaError>, pair: bool| -> Result<Proj, CudaError> {
            Ok(if pair && (fmt.int4 || fmt.fp8) { vec![next()?, next()?] } else { vec![next()?] })
        };
        let d = self.d;
        let embed_part = next()?;
        let embed = embed_part.ptr();
        let lm_head =
            if fmt.own_lm_head(cfg.tie_word_embeddings) { next()? } else { Part::Bf16 { w: embed, rows: d.vocab } };
        let lm_head = match lm_head {
            Part::Bf16 { w, .. } => Part::Bf16 { w, rows: d.vocab },
            p => p,
        };
        let final_norm = next()?.ptr();
        let mut layers = Vec::with_capacity(cfg.layer_types.len());
        // Row counts of bf16 parts (the forward needs them only for mixed projections).
        let rows = |mut p: Proj, r: usize| -> Proj {
            if let [Part::Bf16 { rows, .. }] = p.as_mut_slice() {
                *rows = r;
            }
            p
        };
        let layer = |next: &mut dyn FnMut() -> Result<Part, CudaError>,
                     kind: LayerKind,
                     sparse: Option<&MoeConfig>|
         -> Result<Layer, CudaError> {
            let input_norm = next()?.ptr();
            let post_norm = next()?.ptr();
            let mixer = match kind {
                LayerKind::DeltaNet => Mixer::Gdn(GdnLayer {
                    qkv: rows(proj(next, false)?, d.conv_channels),
                    z: rows(proj(next, false)?, d.gdn_value_width),
                    ba: rows(proj(next, true)?, 2 * d.gdn_v_heads),
                    conv: next()?.ptr(),
                    dt_bias: next()?.ptr(),
                    a_log: next()?.ptr(),
                    norm: next()?.ptr(),
                    out: rows(proj(next, false)?, d.hidden),
                }),
                LayerKind::Attention => Mixer::Attn(AttnLayer {
                    q: rows(proj(next, false)?, 2 * d.attn_dim),
                    k: rows(proj(next, false)?, d.kv_dim),
                    v: rows(proj(next, false)?, d.kv_dim),
                    o: rows(proj(next, false)?, d.hidden),
                    q_norm: next()?.ptr(),
                    k_norm: next()?.ptr(),
                }),
            };
            let width = sparse.map_or(d.intermediate, |m| m.shared_expert_intermediate);
            let gate_up = rows(proj(next, true)?, 2 * width);
            let down = rows(proj(next, false)?, d.hidden);
            // weight_tensors' order: router, the experts' block, the shared expert's gate.
            let moe = match sparse {
                Some(m) if fmt.int4 => {
                    let router = next()?.ptr();
                    let parts = (0..2 * m.num_experts).map(|_| next()).collect::<Result<Vec<_>, _>>()?;
                    Some(MoeLayer::new_w4(m, d.hidden, router, next()?.ptr(), &parts)?)
                }
                Some(m) => {
                    let (router, block, gate) = (next()?.ptr(), next()?.ptr(), next()?.ptr());
                    Some(MoeLayer::new(m, d.hidden, router, gate, block))
                }
                None => None,
            };
            Ok(Layer { input_norm, post_norm, mixer, gate_up, down, moe })
        };
        for (i, kind) in cfg.layer_types.iter().enumerate() {
            layers.push(layer(&mut next, *kind, cfg.moe.as_ref().filter(|m| m.is_sparse(i)))?);
        }
        let mtp = if fmt.mtp && cfg.mtp_num_hidden_layers > 0 {
            let fc = rows(proj(&mut next, false)?, d.hidden);
            let (pre_fc_norm_embedding, pre_fc_norm_hidden, norm) = (next()?.ptr(), next()?.ptr(), next()?.ptr());
            let sparse = cfg.moe.as_ref().filter(|m| m.mtp_is_sparse());
            let layer = layer(&mut next, LayerKind::Attention, sparse)?;
            Some(MtpHead { fc, pre_fc_norm_embedding, pre_fc_norm_hidden, norm, layer })
        } else {
            None
        };
        self.rt.synchronize()?;
        Ok(Weights {
            embed: if fmt.embed_on_host { 0 } else { embed },
            lm_head: vec![lm_head],
            final_norm,
            layers,
            mtp,
        })
    }
}

/// The backend's weights from a checkpoint's placed parts `mw` (and the MTP head's): int4 pairs are two
/// parts, a bf16 pair the one fused part of its first half; the lm_head is the checkpoint's, else the one
/// placed for a tied head, else the embedding. `host_embed`: the embedding table is in host memory.
/// `moe`: the experts' config and the hidden size of a mixture-of-experts model.
fn checkpoint_weights(
    mw: &ModelWeights<Part>,
    mtp_w: Option<MtpWeights<Part>>,
    tied_head: Option<Part>,
    // Quantised decoder linears (int4 or fp8): pairs are two parts, bf16 ones included.
    quantised: bool,
    host_embed: bool,
    moe: Option<(&MoeConfig, usize)>,
) -> Result<Weights, CudaError> {
    let one = |p: &Part| vec![*p];
    // int4 / fp8: pairs are two parts; bf16: the first half is the fused pair.
    let two = |a: &Part, b: &Part| if matches!(a, Part::Bf16 { .. }) && !quantised { vec![*a] } else { vec![*a, *b] };
    let sparse = |l: &deltaserve_model::LayerWeights<Part>| match (&l.moe, moe) {
        (Some(w), Some((m, h))) => loaded_experts(w, m, h).map(Some),
        _ => Ok(None),
    };
    let layer = |l: &deltaserve_model::LayerWeights<Part>, moe: Option<MoeLayer>| Layer {
        input_norm: l.input_norm.ptr(),
        post_norm: l.post_norm.ptr(),
        mixer: match &l.mixer {
            deltaserve_model::MixerWeights::DeltaNet(g) => Mixer::Gdn(GdnLayer {
                qkv: one(&g.in_proj_qkv),
                z: one(&g.in_proj_z),
                ba: two(&g.in_proj_b, &g.in_proj_a),
                conv: g.conv1d.ptr(),
                dt_bias: g.dt_bias.ptr(),
                a_log: g.a_log.ptr(),
                norm: g.norm.ptr(),
                out: one(&g.out_proj),
            }),
            deltaserve_model::MixerWeights::Attention(a) => Mixer::Attn(AttnLayer {
                q: one(&a.q_proj),
                k: one(&a.k_proj),
                v: one(&a.v_proj),
                o: one(&a.o_proj),
                q_norm: a.q_norm.ptr(),
                k_norm: a.k_norm.ptr(),
            }),
        },
        gate_up: two(&l.mlp.gate_proj, &l.mlp.up_proj),
        down: one(&l.mlp.down_proj),
        moe,
    };
    let layers = mw.layers.iter().map(|l| Ok(layer(l, sparse(l)?))).collect::<Result<_, CudaError>>()?;
    let mtp = match mtp_w {
        Some(m) => Some(MtpHead {
            fc: one(&m.fc),
            pre_fc_norm_embedding: m.pre_fc_norm_embedding.ptr(),
            pre_fc_norm_hidden: m.pre_fc_norm_hidden.ptr(),
            norm: m.norm.ptr(),
            layer: layer(&m.layer, sparse(&m.layer)?),
        }),
        None => None,
    };
    let lm_head = match (&mw.lm_head, tied_head) {
        (Some(p), _) => *p,
        (None, Some(p)) => p,
        (None, None) => mw.embed,
    };
    Ok(Weights {
        embed: if host_embed { 0 } else { mw.embed.ptr() },
        lm_head: vec![lm_head],
        final_norm: mw.final_norm.ptr(),
        layers,
        mtp,
    })
}
