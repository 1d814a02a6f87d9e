//! The vision tower on the GPU (`crates/cpu/src/vision.rs` is its reference): bf16 weights in the
//! weights region, its buffers in the plan's `vision` region ([`CudaTowerLayout`]), one image at a time.
//! The residual stream stays f32; each GEMM (cuBLASLt, bf16 in, f32 out) is followed by the kernel that
//! adds its bias (`kernels/vision.cu`): patch embedding → position embeddings → blocks (LayerNorm, qkv,
//! axial rotary, attention within each frame, proj, residual; LayerNorm, fc1, activation, fc2, residual)
//! → merger (LayerNorm, `merge²` consecutive rows as one, fc1, exact GELU, fc2) → the image's merged rows
//! `[tokens, out_hidden]` bf16, the text model's embedding rows. Each residual add runs in one kernel with
//! the LayerNorm that follows it.
//!
//! The tower is loaded when the plan prices it (`max_image_tokens_per_step`: the CLI sets it for a model
//! that has one, unless `--no-vision` or the fit traded it for context); it does not run under tensor
//! parallelism.

use std::cell::RefCell;
use std::collections::HashMap;

use cudarc::driver::{CudaEvent, CudaStream};

use deltaserve_model::vision::{VisionBlockWeights, VisionLinear, tensor_shapes};
use deltaserve_model::{Checkpoint, ImagePatches, ModelConfig, VisionAct, VisionConfig, VisionWeights};
use deltaserve_plan::{CudaTowerLayout, Plan};

use crate::arena::{Arena, DevSpan, RegionId};
use crate::error::CudaError;
use crate::gemm::Gemm;
use crate::ops::Kernels;
use crate::ops::init::{Init, init_random};
use crate::ops::vision::{self as vk, Act, Grid};
use crate::runtime::{PinnedHost, Runtime};

use super::images::{Fill, KeptRows};
use super::loader::convert;

/// LayerNorm epsilon of the tower's blocks and merger (fixed in HF's code).
const LN_EPS: f32 = 1e-6;

/// The tower: its config, weights (device addresses, bf16) and buffers.
pub(super) struct Vision {
    pub(super) cfg: VisionConfig,
    pub(super) w: VisionWeights<u64>,
    /// The most patches of one image (the plan's `max_image_tokens_per_step`).
    pub(super) max_patches: usize,
    /// The `vision` region and its buffers' offsets.
    pub(super) region: DevSpan,
    pub(super) layout: CudaTowerLayout,
    /// Rows of images split across steps, kept for their later chunks.
    pub(super) kept: RefCell<KeptRows>,
    /// The image rows the next forward writes.
    pub(super) fills: RefCell<Vec<Fill>>,
    /// The pixels of the image being encoded on their way to the GPU, as bf16.
    pub(super) pixels: PixelStaging,
}

/// Pinned host memory for an image's pixels on their way to the GPU, two halves in turn: a piece of the
/// image is converted to bf16 in one half (by a few threads) while the previous piece is copied out of the
/// other, asynchronously (pageable memory would be staged by the driver, and the copy would wait for it).
/// A half is rewritten only once its last copy is done.
pub(super) struct PixelStaging {
    host: PinnedHost,
    /// Recorded after each copy out of each half.
    done: [CudaEvent; 2],
}

impl PixelStaging {
    /// Pinned bytes of the staging (both halves): 16 MiB, a 4,096-patch image in one piece per half.
    pub(super) const BYTES: usize = 16 << 20;

    pub(super) fn new(rt: &Runtime) -> Result<PixelStaging, CudaError> {
        let host = PinnedHost::new(rt, Self::BYTES)?;
        let event = || rt.context().new_event(None).map_err(CudaError::driver("cuEventCreate"));
        Ok(PixelStaging { host, done: [event()?, event()?] })
    }

    /// `pixels` as bf16 at `dst` on the stream `s` (`dst` holds them all).
    fn upload(&self, s: &CudaStream, pixels: &[f32], dst: u64) -> Result<(), CudaError> {
        let half = Self::BYTES / 4; // values a half holds
        for (i, piece) in pixels.chunks(half).enumerate() {
            let done = &self.done[i % 2];
            done.synchronize().map_err(CudaError::driver("cuEventSynchronize"))?;
            // SAFETY: half i % 2 of the staging holds `half` u16 from byte (i % 2) · BYTES / 2 (2-byte aligned:
            // a page-aligned pinned allocation), piece.len() ≤ half, and no copy reads it now (the event above).
            let staged = unsafe {
                std::slice::from_raw_parts_mut((self.host.ptr() as *mut u16).add((i % 2) * half), piece.len())
            };
            bf16_bits_parallel(piece, staged);
            let at = dst + (2 * i * half) as u64;
            // SAFETY: `dst` holds pixels.len() bf16 (the caller's buffer), so `at` holds the piece; the source is
            // pinned and stays unwritten until `done` (recorded right after) has passed.
            unsafe { cudarc::driver::result::memcpy_htod_async(at, &*staged, s.cu_stream()) }
                .map_err(CudaError::driver("cuMemcpyHtoDAsync"))?;
            done.record(s).map_err(CudaError::driver("cuEventRecord"))?;
        }
        Ok(())
    }
}

/// The bf16 bits of `v`, rounded to nearest even (NaN stays a quiet NaN): what `half::bf16::from_f32` gives,
/// in a form the compiler vectorises.
fn bf16_bits(v: f32) -> u16 {
    let b = v.to_bits();
    if v.is_nan() { ((b >> 16) as u16) | 0x40 } else { ((b + 0x7fff + ((b >> 16) & 1)) >> 16) as u16 }
}

/// `src` as bf16 bits into `dst` (the same length), split over a few threads for large images.
fn bf16_bits_parallel(src: &[f32], dst: &mut [u16]) {
    const PER_THREAD: usize = 1 << 20;
    let threads =
        std::thread::available_parallelism().map_or(1, |n| n.get()).min(8).min(src.len().div_ceil(PER_THREAD));
    let convert = |s: &[f32], d: &mut [u16]| d.iter_mut().zip(s).for_each(|(o, &v)| *o = bf16_bits(v));
    if threads <= 1 {
        return convert(src, dst);
    }
    let chunk = src.len().div_ceil(threads);
    std::thread::scope(|scope| {
        for (s, d) in src.chunks(chunk).zip(dst.chunks_mut(chunk)) {
            scope.spawn(move || convert(s, d));
        }
    });
}

/// Whether the backend loads the tower of `cfg` under `plan`: the plan prices it. Under tensor
/// parallelism a plan that prices it is refused.
pub(super) fn tower_of<'a>(
    cfg: &'a ModelConfig,
    plan: &Plan,
    sharded: bool,
) -> Result<Option<(&'a VisionConfig, usize)>, CudaError> {
    match (&cfg.vision, plan.options.max_image_tokens_per_step) {
        (Some(_), Some(_)) if sharded => {
            Err(CudaError::Plan("the GPU vision tower does not run under tensor parallelism".into()))
        }
        (Some(v), Some(n)) => Ok(Some((v, n))),
        _ => Ok(None),
    }
}

/// Bytes the tower's bf16 weights take in the weights region (each tensor 256-byte aligned).
pub(super) fn weight_bytes(v: &VisionConfig) -> usize {
    deltaserve_plan::vision::tower_weight_bytes(v, 2) as usize
}

/// The plan's `vision` region (one allocation) for images of at most `patches` patches.
pub(super) fn carve_region(
    arena: &mut Arena,
    plan: &Plan,
    v: &VisionConfig,
    patches: usize,
) -> Result<(DevSpan, CudaTowerLayout), CudaError> {
    let bytes = plan
        .region("vision")
        .map(|r| r.bytes as usize)
        .ok_or_else(|| CudaError::Plan("the plan prices a vision tower but has no `vision` region".into()))?;
    let layout = CudaTowerLayout::new(v, patches, plan.max_batch_tokens);
    if layout.bytes > bytes {
        return Err(CudaError::Plan(format!(
            "the vision region holds {bytes} B, the tower needs {} B for {patches} patches",
            layout.bytes
        )));
    }
    let id = arena.add_region("vision", bytes)?;
    let span = arena.alloc(id, bytes)?;
    Ok((span, layout))
}

/// The tower's weights from the checkpoint `dir` (bf16, into `wreg`).
pub(super) fn load_checkpoint(
    rt: &Runtime,
    arena: &mut Arena,
    wreg: RegionId,
    ckpt: &Checkpoint,
    cfg: &ModelConfig,
) -> Result<VisionWeights<u64>, CudaError> {
    let w = VisionWeights::load(ckpt, cfg, |src| {
        let dev = |e: CudaError| deltaserve_model::ModelError::config(format!("{}: {e}", src.name));
        let bytes = convert(&src, false)?;
        let ptr = arena.alloc(wreg, bytes.len()).map_err(dev)?.ptr;
        rt.upload(ptr, &bytes).map_err(dev)?;
        Ok(ptr)
    })
    .map_err(|e| CudaError::Weights(e.to_string()))?;
    w.ok_or_else(|| CudaError::Weights("the model has no vision tower".into()))
}

/// Random tower weights at the real shapes (benchmarks), `synth`'s distributions.
pub(super) fn random_weights(
    k: &Kernels,
    rt: &Runtime,
    arena: &mut Arena,
    wreg: RegionId,
    v: &VisionConfig,
    seed: u64,
) -> Result<VisionWeights<u64>, CudaError> {
    let mut at: HashMap<String, u64> = HashMap::new();
    for (i, (name, shape)) in tensor_shapes(v).into_iter().enumerate() {
        let n: usize = shape.iter().product();
        let init = if name.ends_with(".bias") {
            Init::Normal(0.02)
        } else if shape.len() == 1 {
            Init::OnePlusNormal(0.1)
        } else if name.ends_with("pos_embed.weight") {
            Init::Normal(0.5)
        } else {
            Init::Normal(1.0 / (shape[1..].iter().product::<usize>() as f32).sqrt())
        };
        let span = arena.alloc(wreg, 2 * n)?;
        init_random(k, rt.stream(), span.ptr, n, seed ^ (0x5157 + i as u64), init, false)?;
        at.insert(name, span.ptr);
    }
    let get = |name: &str| {
        at.get(&format!("model.visual.{name}"))
            .copied()
            .ok_or_else(|| CudaError::Weights(format!("no tower tensor {name}")))
    };
    let lin = |name: &str| -> Result<VisionLinear<u64>, CudaError> {
        Ok(VisionLinear { weight: get(&format!("{name}.weight"))?, bias: Some(get(&format!("{name}.bias"))?) })
    };
    let norm = |name: &str| -> Result<deltaserve_model::vision::LayerNormWeights<u64>, CudaError> {
        Ok(deltaserve_model::vision::LayerNormWeights {
            weight: get(&format!("{name}.weight"))?,
            bias: get(&format!("{name}.bias"))?,
        })
    };
    let blocks = (0..v.depth)
        .map(|i| {
            let b = |s: &str| format!("blocks.{i}.{s}");
            Ok(VisionBlockWeights {
                norm1: norm(&b("norm1"))?,
                qkv: lin(&b("attn.qkv"))?,
                proj: lin(&b("attn.proj"))?,
                norm2: norm(&b("norm2"))?,
                fc1: lin(&b("mlp.linear_fc1"))?,
                fc2: lin(&b("mlp.linear_fc2"))?,
            })
        })
        .collect::<Result<Vec<_>, CudaError>>()?;
    Ok(VisionWeights {
        patch_embed: lin("patch_embed.proj")?,
        pos_embed: get("pos_embed.weight")?,
        blocks,
        merger_norm: norm("merger.norm")?,
        merger_fc1: lin("merger.linear_fc1")?,
        merger_fc2: lin("merger.linear_fc2")?,
    })
}

/// A linear's bias address (0: none).
fn bias(l: &VisionLinear<u64>) -> u64 {
    l.bias.unwrap_or(0)
}

impl Vision {
    /// Checks that `img` fits the tower (grid, pixels, at most `max_patches` patches); `index` names it.
    pub(super) fn check(&self, index: usize, img: &ImagePatches) -> Result<(), String> {
        self.cfg.check_image(img).map_err(|reason| format!("image {index}: {reason}"))?;
        if img.patches() > self.max_patches {
            return Err(format!(
                "image {index}: {} patches exceed the tower's {} (--max-image-tokens-per-step)",
                img.patches(),
                self.max_patches
            ));
        }
        Ok(())
    }

    /// Address of a buffer of the region at `offset`.
    fn at(&self, offset: usize) -> u64 {
        self.region.ptr + offset as u64
    }

    /// Where [`Vision::encode`] leaves an image's merged rows `[tokens, out_hidden]` bf16.
    pub(super) fn merged(&self) -> u64 {
        self.at(self.layout.merged)
    }

    /// Runs the tower over one (checked) image on the stream: its merged rows land in [`Vision::merged`].
    pub(super) fn encode(&self, k: &Kernels, gemm: &Gemm, rt: &Runtime, img: &ImagePatches) -> Result<(), CudaError> {
        let c = &self.cfg;
        let s = rt.stream().as_ref();
        let [t, gh, gw] = img.grid_thw;
        let grid = Grid { t, h: gh, w: gw, merge: c.spatial_merge_size };
        let n = grid.patches();
        let (h, heads, hd, inter) = (c.hidden_size, c.num_heads, c.head_dim(), c.intermediate_size);
        let l = &self.layout;
        let (x, xn, wide, narrow) = (self.at(l.x), self.at(l.xn), self.at(l.wide), self.at(l.narrow));
        // The pixels as bf16, in the wide buffer until the patch embedding has read them (it holds
        // max_patches × patch_dim bf16: the layout; n ≤ max_patches, checked).
        if img.pixels.len() != n * c.patch_dim() {
            return Err(CudaError::Plan(format!("{} pixel values for {n} patches", img.pixels.len())));
        }
        self.pixels.upload(s, &img.pixels, wide)?;
        let w = &self.w;
        gemm.linear_out(s, wide, w.patch_embed.weight, x, n, h, c.patch_dim(), true)?;
        vk::embed_pos(k, s, x, bias(&w.patch_embed), w.pos_embed, h, grid, c.position_grid_side())?;
        let act = match c.hidden_act {
            VisionAct::GeluTanh => Act::GeluTanh,
            VisionAct::Gelu => Act::Gelu,
            VisionAct::Silu => Act::Silu,
        };
        // Each residual add runs with the LayerNorm after it (the next block's first, or the merger's).
        let first = w.blocks.first().map_or(&w.merger_norm, |b| &b.norm1);
        vk::layer_norm(k, s, x, None, first.weight, first.bias, xn, n, h, LN_EPS)?;
        for (i, b) in w.blocks.iter().enumerate() {
            gemm.linear_out(s, xn, b.qkv.weight, wide, n, 3 * h, h, true)?;
            vk::qkv_rope(k, s, wide, bias(&b.qkv), narrow, heads, hd, grid, c.rope_theta as f32)?;
            vk::attention(k, s, narrow, xn, heads, hd, grid)?;
            gemm.linear_out(s, xn, b.proj.weight, wide, n, h, h, true)?;
            vk::layer_norm(k, s, x, Some((wide, bias(&b.proj))), b.norm2.weight, b.norm2.bias, xn, n, h, LN_EPS)?;
            gemm.linear_out(s, xn, b.fc1.weight, wide, n, inter, h, true)?;
            vk::bias_act(k, s, wide, bias(&b.fc1), narrow, n, inter, act)?;
            gemm.linear_out(s, narrow, b.fc2.weight, wide, n, h, inter, true)?;
            let next = w.blocks.get(i + 1).map_or(&w.merger_norm, |nb| &nb.norm1);
            vk::layer_norm(k, s, x, Some((wide, bias(&b.fc2))), next.weight, next.bias, xn, n, h, LN_EPS)?;
        }
        // The merger: each merge² consecutive rows of the normed stream are one row of h · merge².
        let (rows, merged) = (n / c.merge_unit(), h * c.merge_unit());
        gemm.linear_out(s, xn, w.merger_fc1.weight, wide, rows, merged, merged, true)?;
        vk::bias_act(k, s, wide, bias(&w.merger_fc1), narrow, rows, merged, Act::Gelu)?;
        gemm.linear_out(s, narrow, w.merger_fc2.weight, wide, rows, c.out_hidden_size, merged, true)?;
        vk::bias_act(k, s, wide, bias(&w.merger_fc2), self.merged(), rows, c.out_hidden_size, Act::None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pixels_convert_to_bf16_as_half_does() {
        let mut v: Vec<f32> = (0..(3 << 20) + 17).map(|i| ((i * 31) % 977) as f32 / 488.5 - 1.0).collect();
        let specials = [0.0, -0.0, 1.0, f32::MIN_POSITIVE, 1e-40, -1e-40, f32::MAX, f32::INFINITY, f32::NEG_INFINITY];
        v[..specials.len()].copy_from_slice(&specials);
        // Halfway cases round to even, both ways; the largest finite value rounds to infinity as half does.
        v[20] = f32::from_bits(0x3f80_8000);
        v[21] = f32::from_bits(0x3f81_8000);
        v[22] = f32::from_bits(0x3f80_8001);
        let mut got = vec![0u16; v.len()];
        bf16_bits_parallel(&v, &mut got);
        let want: Vec<u16> = v.iter().map(|&x| half::bf16::from_f32(x).to_bits()).collect();
        assert_eq!(got, want);
        let nan = bf16_bits(f32::NAN);
        assert!(half::bf16::from_bits(nan).is_nan());
    }
}
