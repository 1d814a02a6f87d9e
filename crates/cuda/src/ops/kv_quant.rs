//! Launcher for kernels/kv_quant.cu: the paged KV write into caches stored as bf16, fp8 (e4m3),
//! int8 or int4 with per-(token, head) f16 scales, K and V formats independent, with the rounding
//! of `deltaserve_cpu::kvquant` bit for bit. Addressing is [`super::kv_cache::kv_write`]'s.
//!
//! Layout of one attention layer's cache (the plan's `kv_pages` tensors, `Plan::kv_tensor_bytes`):
//! K data `[pages * page_size, kv_heads, head_dim]` at the format's bits (int4: element 2i in the
//! low nibble of byte i, 2i+1 in the high nibble, two's complement), K scales
//! `[pages * page_size, kv_heads]` f16, then V data and V scales alike.

use cudarc::driver::CudaStream;
use deltaserve_plan::KvDtype;

use super::{Kernels, invalid, launch_pdl, to_i32, to_u32};
use crate::error::CudaError;
use crate::nvrtc::KvFormats;

/// Bytes of one token-head row (`head_dim` elements) of a format, without the scale.
pub fn row_bytes(fmt: KvDtype, head_dim: usize) -> usize {
    (head_dim * fmt.bits() as usize).div_ceil(8)
}

/// One K or V tensor of a layer's cache: data and (for the scaled formats) scales.
#[derive(Clone, Copy, Debug)]
pub struct KvTensor {
    /// `[rows, kv_heads, head_dim]` at the format's bits.
    pub data: u64,
    /// `[rows, kv_heads]` f16 (ignored, may be 0, for bf16).
    pub scales: u64,
    pub fmt: KvDtype,
}

/// The checks of the cache tensor `what` ("K" / "V") of a KV write by `kernel`: its format's kernel code.
fn check_tensor(kernel: &'static str, what: &str, x: &KvTensor, head_dim: usize) -> Result<i32, CudaError> {
    let code = KvFormats::code(x.fmt).ok_or_else(|| {
        invalid(kernel, format!("{what}: the CUDA KV cache stores bf16, fp8, int8 or int4, not {}", x.fmt.name()))
    })?;
    let align = row_bytes(x.fmt, head_dim).min(4) as u64;
    if x.data == 0 || !x.data.is_multiple_of(align) {
        return Err(invalid(kernel, format!("{what}: data pointer {:#x} not {align}-byte aligned", x.data)));
    }
    if x.fmt.scale_bytes() > 0 && (x.scales == 0 || !x.scales.is_multiple_of(2)) {
        return Err(invalid(kernel, format!("{what}: {} needs a 2-byte aligned scales pointer", x.fmt.name())));
    }
    Ok(code)
}

/// The checks of a KV write `a` into `layer` (any formats; `a.t > 0`): the formats' kernel codes (K, V).
pub(crate) fn check_write(
    what: &'static str,
    a: &super::kv_cache::KvWrite,
    layer: &LayerKv,
) -> Result<(i32, i32), CudaError> {
    let width = a.kv_heads * a.head_dim;
    if a.page == 0 || a.n_seqs == 0 || a.max_blocks == 0 || a.kv_heads == 0 || a.k_stride < width || a.v_stride < width
    {
        return Err(invalid(what, format!("{a:?}")));
    }
    // Lanes move element pairs as 32-bit words.
    if !a.head_dim.is_multiple_of(2)
        || !a.k_stride.is_multiple_of(2)
        || !a.v_stride.is_multiple_of(2)
        || !a.k.is_multiple_of(4)
        || !a.v.is_multiple_of(4)
    {
        return Err(invalid(what, format!("{a:?}: head_dim and strides must be even, k/v 4-byte aligned")));
    }
    Ok((check_tensor(what, "K", &layer.k, a.head_dim)?, check_tensor(what, "V", &layer.v, a.head_dim)?))
}

/// Paged KV cache write of one layer into `layer`'s K and V tensors (any formats): the step's rows
/// and addressing as for the bf16 writer (`a`; its `k_cache` / `v_cache` are not used). The backend
/// writes its K/V rows with [`super::rope::qk_norm_rope_kv`] (bitwise this, fused with the norms and
/// RoPE); this kernel is its reference in tests/ops/.
pub fn kv_write_q(k: &Kernels, s: &CudaStream, a: &super::kv_cache::KvWrite, layer: &LayerKv) -> Result<(), CudaError> {
    if a.t == 0 {
        return Ok(());
    }
    let (kf, vf) = check_write("kv_write_q", a, layer)?;
    let super::kv_cache::KvWrite { k: kp, v: vp, block_tables, cu_seqlens, positions, .. } = *a;
    let (kc, ksc, vc, vsc) = (layer.k.data, layer.k.scales, layer.v.data, layer.v.scales);
    let (ks, vs) = (a.k_stride as i64, a.v_stride as i64);
    let mb = to_i32("kv_write_q", "max_blocks", a.max_blocks)?;
    let b = to_i32("kv_write_q", "n_seqs", a.n_seqs)?;
    let page = to_i32("kv_write_q", "page", a.page)?;
    let hkv = to_i32("kv_write_q", "kv_heads", a.kv_heads)?;
    let hd = to_i32("kv_write_q", "head_dim", a.head_dim)?;
    let grid = (to_u32("kv_write_q", "t", a.t)?, 1, 1);
    launch_pdl!(k, s, "kv_write_q", grid, (128, 1, 1), 0;
        kp, ks, vp, vs, kc, ksc, vc, vsc, block_tables, mb, cu_seqlens, b, positions, page, hkv, hd, kf, vf)
}

/// One attention layer's cache inside the plan's `kv_pages` region: K data, K scales, V data,
/// V scales, each starting `deltaserve_plan::ALIGN`-aligned (the backend's carving order).
#[derive(Clone, Copy, Debug)]
pub struct LayerKv {
    pub k: KvTensor,
    pub v: KvTensor,
}

impl LayerKv {
    /// Carves one layer at `base` from the plan's per-layer tensor sizes (`Plan::kv_tensor_bytes`:
    /// K data, K scales, V data, V scales); returns the layer and the bytes it spans.
    pub fn carve(base: u64, sizes: [usize; 4], kv: KvFormats) -> (LayerKv, usize) {
        let al = |x: usize| x.next_multiple_of(deltaserve_plan::ALIGN as usize);
        let [kb, ks, vb, vs] = sizes;
        let k = KvTensor { data: base, scales: base + al(kb) as u64, fmt: kv.k };
        let v_at = base + (al(kb) + al(ks)) as u64;
        let v = KvTensor { data: v_at, scales: v_at + al(vb) as u64, fmt: kv.v };
        (LayerKv { k, v }, al(kb) + al(ks) + al(vb) + al(vs))
    }

    /// The scales the `_q` attention launchers take.
    pub fn scales(&self) -> super::attention::KvScales {
        super::attention::KvScales { k: self.k.scales, v: self.v.scales }
    }

    /// (base address, bytes per token) of each stored tensor (data, and scales of the scaled
    /// formats), for copying whole tokens between pages: token `i` of page `p` starts at
    /// `base + (p * page_size + i) * bytes_per_token`.
    pub fn token_tensors(&self, kv_heads: usize, head_dim: usize) -> Vec<(u64, usize)> {
        let mut v = Vec::with_capacity(4);
        for x in [self.k, self.v] {
            v.push((x.data, kv_heads * row_bytes(x.fmt, head_dim)));
            if x.fmt.scale_bytes() > 0 {
                v.push((x.scales, kv_heads * x.fmt.scale_bytes() as usize));
            }
        }
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn carving_follows_the_plan_layout() {
        let kv = KvFormats { k: KvDtype::Int4, v: KvDtype::Fp8 };
        // 10 pages of 16 tokens, 4 kv heads of 256: K 4·128 B/token, scales 4·2, V 4·256.
        let sizes = [160 * 512, 160 * 8, 160 * 1024, 160 * 8];
        let (l, bytes) = LayerKv::carve(1 << 20, sizes, kv);
        assert_eq!(l.k.data, 1 << 20);
        assert_eq!(l.k.scales, (1 << 20) + 81920);
        assert_eq!(l.v.data, (1 << 20) + 81920 + 1280);
        assert_eq!(l.v.scales, (1 << 20) + 81920 + 1280 + 163840);
        assert_eq!(bytes, 81920 + 1280 + 163840 + 1280);
        let t = l.token_tensors(4, 256);
        assert_eq!(t, vec![(l.k.data, 512), (l.k.scales, 8), (l.v.data, 1024), (l.v.scales, 8)]);
        let (b, _) = LayerKv::carve(0, [100, 0, 100, 0], KvFormats::BF16);
        assert_eq!(b.token_tensors(1, 50), vec![(0, 100), (256, 100)]);
        assert_eq!(row_bytes(KvDtype::Int4, 32), 16);
    }
}
