//! Launchers for kernels/gdn_decode.cu: the DeltaNet recurrence per sequence slot, one token per
//! sequence (decode) or a few (the verify and commit of speculative decoding).

use cudarc::driver::CudaStream;

use super::{Kernels, invalid, launch, launch_pdl, to_i32, to_u32};
use crate::error::CudaError;

#[derive(Clone, Copy, Debug)]
pub struct GdnDecode {
    /// q, k [n_seqs, hk, dk] bf16 (from gdn_gate); v head h at `v + b*v_stride + h*dv`.
    pub q: u64,
    pub k: u64,
    pub v: u64,
    pub v_stride: usize,
    /// [n_seqs, hv] f32.
    pub g: u64,
    pub beta: u64,
    /// [slots, hv, dk, dv] f32, and slot ids `[n_seqs]` i32.
    pub state: u64,
    pub slots: u64,
    /// [n_seqs, hv, dv] bf16.
    pub o: u64,
    pub n_seqs: usize,
    pub hk: usize,
    pub hv: usize,
}

pub fn gdn_decode(k: &Kernels, s: &CudaStream, a: &GdnDecode) -> Result<(), CudaError> {
    if a.n_seqs == 0 {
        return Ok(());
    }
    let dv = k.dims.gdn_v_dim;
    if a.hk == 0 || !a.hv.is_multiple_of(a.hk) || a.v_stride < a.hv * dv {
        return Err(invalid("gdn_decode", format!("{a:?}")));
    }
    let GdnDecode { q, k: kp, v, g, beta, state, slots, o, .. } = *a;
    let vs = a.v_stride as i64;
    let hk = to_i32("gdn_decode", "hk", a.hk)?;
    let hv = to_i32("gdn_decode", "hv", a.hv)?;
    let grid = (to_u32("gdn_decode", "n_seqs", a.n_seqs)?, to_u32("gdn_decode", "hv", a.hv)?, (dv / 32) as u32);
    launch!(k, s, "gdn_decode", grid, (128, 1, 1), 0; q, kp, v, vs, g, beta, state, slots, o, hk, hv)
}

/// Decode rows through the recurrence and then the gated RMSNorm of each head (norm.rs's
/// `gated_rms_norm`) in one launch, bitwise the same; the recurrence output `d.o` is not stored.
#[derive(Clone, Copy, Debug)]
pub struct GdnDecodeGated {
    pub d: GdnDecode,
    /// z row b head h at `z + b*z_tok_stride + h*dv` (bf16); the norm weight [dv] f32.
    pub z: u64,
    pub z_tok_stride: usize,
    pub norm_w: u64,
    /// [n_seqs, hv, dv] bf16.
    pub out: u64,
    pub eps: f32,
}

pub fn gdn_decode_gated(k: &Kernels, s: &CudaStream, a: &GdnDecodeGated) -> Result<(), CudaError> {
    const K: &str = "gdn_decode_gated";
    let d = &a.d;
    if d.n_seqs == 0 {
        return Ok(());
    }
    let dv = check_gated(K, k, d, a.z_tok_stride, a)?;
    let GdnDecode { q, k: kp, v, g, beta, state, slots, .. } = *d;
    let (z, nw, out, eps) = (a.z, a.norm_w, a.out, a.eps);
    let (vs, zs) = (d.v_stride as i64, a.z_tok_stride as i64);
    let (hk, hv) = (to_i32(K, "hk", d.hk)?, to_i32(K, "hv", d.hv)?);
    let grid = (to_u32(K, "n_seqs", d.n_seqs)?, to_u32(K, "hv", d.hv)?, 1);
    // A bf16 state with DV a multiple of 64: two columns a lane (gdn_decode.cu), half the threads; v read
    // two columns at a time.
    let pairs = k.dims.state_bf16 && dv.is_multiple_of(64);
    if pairs && (!d.v_stride.is_multiple_of(2) || !v.is_multiple_of(4)) {
        return Err(invalid(K, format!("{a:?}: a bf16 state's kernel reads v two columns at a time (4-byte aligned)")));
    }
    let threads = if pairs { 2 * dv } else { 4 * dv };
    launch_pdl!(k, s, K, grid, (threads as u32, 1, 1), 0;
        q, kp, v, vs, g, beta, state, slots, z, zs, nw, out, hk, hv, eps)
}

/// The recurrence over `lens[b]` rows from row `starts[b]` of sequence b (`starts`, `lens`, `d.slots`:
/// `[n_seqs]` i32 device arrays; `lens` 0: `starts` is a cu_seqlens array of `n_seqs + 1`); `d`'s
/// row-indexed buffers hold every row.
#[derive(Clone, Copy, Debug)]
pub struct GdnRecurrent {
    pub d: GdnDecode,
    pub starts: u64,
    pub lens: u64,
    /// Write the advanced state back (commit) or leave it untouched (verify).
    pub write_state: bool,
}

pub fn gdn_recurrent(k: &Kernels, s: &CudaStream, a: &GdnRecurrent) -> Result<(), CudaError> {
    let d = &a.d;
    if d.n_seqs == 0 {
        return Ok(());
    }
    let dv = k.dims.gdn_v_dim;
    if d.hk == 0 || !d.hv.is_multiple_of(d.hk) || d.v_stride < d.hv * dv {
        return Err(invalid("gdn_recurrent", format!("{a:?}")));
    }
    let GdnDecode { q, k: kp, v, g, beta, state, slots, o, .. } = *d;
    let (starts, lens, write) = (a.starts, a.lens, i32::from(a.write_state));
    let vs = d.v_stride as i64;
    let hk = to_i32("gdn_recurrent", "hk", d.hk)?;
    let hv = to_i32("gdn_recurrent", "hv", d.hv)?;
    let grid = (to_u32("gdn_recurrent", "n_seqs", d.n_seqs)?, to_u32("gdn_recurrent", "hv", d.hv)?, (dv / 32) as u32);
    launch!(k, s, "gdn_recurrent", grid, (128, 1, 1), 0;
        q, kp, v, vs, g, beta, state, slots, starts, lens, o, hk, hv, write)
}

/// Speculative verify rows through the recurrence (the state read, not written) and then the gated
/// RMSNorm of each row's head, in one launch (kernels/gdn_decode.cu `gdn_recurrent_gated`): bitwise
/// [`gdn_recurrent`] without write-back followed by norm.rs's `gated_rms_norm`; the recurrence output
/// `d.o` is not stored. Sequence b's rows are `starts[b] .. starts[b + 1]` (`starts`: cu_seqlens,
/// `[d.n_seqs + 1]` i32).
#[derive(Clone, Copy, Debug)]
pub struct GdnRecurrentGated {
    pub d: GdnDecode,
    pub starts: u64,
    /// z row t head h at `z + t*z_tok_stride + h*dv` (bf16); the norm weight [dv] f32.
    pub z: u64,
    pub z_tok_stride: usize,
    pub norm_w: u64,
    /// [rows, hv, dv] bf16.
    pub out: u64,
    pub eps: f32,
}

pub fn gdn_recurrent_gated(k: &Kernels, s: &CudaStream, a: &GdnRecurrentGated) -> Result<(), CudaError> {
    const K: &str = "gdn_recurrent_gated";
    let d = &a.d;
    if d.n_seqs == 0 {
        return Ok(());
    }
    let dv = check_gated(K, k, d, a.z_tok_stride, a)?;
    let GdnDecode { q, k: kp, v, g, beta, state, slots, .. } = *d;
    let (starts, z, nw, out, eps) = (a.starts, a.z, a.norm_w, a.out, a.eps);
    let (vs, zs) = (d.v_stride as i64, a.z_tok_stride as i64);
    let (hk, hv) = (to_i32(K, "hk", d.hk)?, to_i32(K, "hv", d.hv)?);
    let grid = (to_u32(K, "n_seqs", d.n_seqs)?, to_u32(K, "hv", d.hv)?, 1);
    launch!(k, s, K, grid, ((4 * dv) as u32, 1, 1), 0;
        q, kp, v, vs, g, beta, state, slots, starts, z, zs, nw, out, hk, hv, eps)
}

/// What the gated kernels (`gdn_decode_gated`, `gdn_recurrent_gated`) require of their arguments `a`:
/// heads that group evenly, v and z rows wide enough, DV at most 256 (a block of 4 DV threads).
/// Returns DV.
fn check_gated(
    kernel: &'static str,
    k: &Kernels,
    d: &GdnDecode,
    z_tok_stride: usize,
    a: &impl std::fmt::Debug,
) -> Result<usize, CudaError> {
    let dv = k.dims.gdn_v_dim;
    if d.hk == 0 || !d.hv.is_multiple_of(d.hk) || d.v_stride < d.hv * dv || z_tok_stride < d.hv * dv || dv > 256 {
        return Err(invalid(kernel, format!("{a:?} (DV = {dv} <= 256)")));
    }
    Ok(dv)
}

/// A speculative step's DeltaNet rows of one layer with their conv and gates, in one launch
/// (kernels/gdn_decode.cu `gdn_rows`): the verify (`commit` false: [`GdnRecurrentGated`]'s outputs, no
/// state written) or the commit (`commit` true: the recurrence with write-back and the conv state
/// advanced over the rows, nothing else written), bitwise the kernels they replace.
#[derive(Clone, Copy, Debug)]
pub struct GdnRows {
    /// The in-projection's qkv rows `[*, x_stride]` bf16 (q, k, v channels: `(2·hk + hv)·dk`) and its
    /// b / a rows `[*, ba_stride]` (b, then a at column hv).
    pub x: u64,
    pub x_stride: usize,
    pub ba: u64,
    pub ba_stride: usize,
    /// Conv weights `[channels, conv_kernel]` bf16 and states `[slots, conv_kernel − 1, channels]` bf16.
    pub conv_w: u64,
    pub conv_state: u64,
    /// `[hv]` f32.
    pub a_log: u64,
    pub dt_bias: u64,
    /// `[slots, hv, dk, dv]` f32, slot ids `[n_seqs]` i32.
    pub state: u64,
    pub slots: u64,
    /// Sequence b's rows from `starts[b]`: `lens[b]` of them, or (`lens` 0) up to `starts[b + 1]`.
    pub starts: u64,
    pub lens: u64,
    /// The verify's gated norm: z row t head h at `z + t·z_tok_stride + h·dv`, the norm weight `[dv]`
    /// f32, out `[rows, hv, dv]` bf16 (unused by a commit).
    pub z: u64,
    pub z_tok_stride: usize,
    pub norm_w: u64,
    pub out: u64,
    /// The verify's trace (0: not written): the x and ba rows it reads, row t at row `t − starts[0]`, at x's
    /// and ba's row strides (what the commit replays).
    pub trace_x: u64,
    pub trace_ba: u64,
    pub eps: f32,
    pub n_seqs: usize,
    pub hk: usize,
    pub hv: usize,
    pub commit: bool,
}

/// Whether [`gdn_rows`] takes a layer of these dims: equal key and value head dims (as the fused conv
/// kernels) and the head's `2·dk + dv` channels within the block's `4·dv` threads.
pub fn rows_supported(dims: &crate::nvrtc::KernelDims, channels: usize, hk: usize, hv: usize) -> bool {
    super::gdn_gate::conv_gate_decode_supported(dims, channels, hk, hv) && dims.gdn_v_dim <= 256
}

/// The heads and row strides [`gdn_rows`] and [`gdn_commit_layers`] take: dims [`rows_supported`], whole
/// key-head groups, x rows holding the `(2·hk + hv)·dk` channels and ba rows the `2·hv` gates.
fn rows_layout_ok(k: &Kernels, hk: usize, hv: usize, x_stride: usize, ba_stride: usize) -> bool {
    let channels = (2 * hk + hv) * k.dims.gdn_k_dim;
    rows_supported(&k.dims, channels, hk, hv) && hv.is_multiple_of(hk) && x_stride >= channels && ba_stride >= 2 * hv
}

pub fn gdn_rows(k: &Kernels, s: &CudaStream, a: &GdnRows) -> Result<(), CudaError> {
    const K: &str = "gdn_rows";
    if a.n_seqs == 0 {
        return Ok(());
    }
    let dv = k.dims.gdn_v_dim;
    let zs_ok = a.commit || a.z_tok_stride >= a.hv * dv;
    let trace_ok = !a.commit || (a.trace_x == 0 && a.trace_ba == 0);
    if !rows_layout_ok(k, a.hk, a.hv, a.x_stride, a.ba_stride) || !zs_ok || !trace_ok {
        return Err(invalid(K, format!("{a:?}")));
    }
    let GdnRows {
        x,
        ba,
        conv_w,
        conv_state,
        a_log,
        dt_bias,
        state,
        slots,
        starts,
        lens,
        z,
        norm_w,
        out,
        trace_x,
        trace_ba,
        eps,
        ..
    } = *a;
    let (xs, bs, zs) = (a.x_stride as i64, a.ba_stride as i64, a.z_tok_stride as i64);
    let (hk, hv, commit) = (to_i32(K, "hk", a.hk)?, to_i32(K, "hv", a.hv)?, i32::from(a.commit));
    let grid = (to_u32(K, "n_seqs", a.n_seqs)?, to_u32(K, "hv", a.hv)?, 1);
    launch!(k, s, K, grid, ((4 * dv) as u32, 1, 1), 0;
        x, xs, conv_w, conv_state, ba, bs, a_log, dt_bias, state, slots, starts, lens, z, zs, norm_w, out, trace_x,
        trace_ba, hk, hv, eps, commit)
}

/// Layers per [`gdn_commit_layers`] launch: the kernel's pointer table (`GDN_LAYER_TABLE` in
/// kernels/gdn_decode.cu), passed by value within the 4 KB of kernel parameters every architecture takes.
pub const GDN_LAYER_TABLE: usize = 48;

/// One DeltaNet layer's weights and states for [`gdn_commit_layers`] (as [`GdnRows`] names them).
#[derive(Clone, Copy, Debug, Default)]
pub struct GdnLayerPtrs {
    pub conv_w: u64,
    pub conv_state: u64,
    pub a_log: u64,
    pub dt_bias: u64,
    pub state: u64,
}

/// The commit of [`gdn_rows`] for every layer of `layers` (kernels/gdn_decode.cu `gdn_commit_layers`,
/// one launch per [`GDN_LAYER_TABLE`] layers): layer l's rows are `x + l·x_layer` and `ba + l·ba_layer`
/// (elements: the speculative trace's per-layer blocks); slots, starts and lens as [`GdnRows`]'. Each
/// layer ends exactly as its own [`gdn_rows`] commit leaves it.
#[derive(Clone, Copy, Debug)]
pub struct GdnCommitLayers<'a> {
    pub layers: &'a [GdnLayerPtrs],
    pub x: u64,
    pub x_layer: usize,
    pub x_stride: usize,
    pub ba: u64,
    pub ba_layer: usize,
    pub ba_stride: usize,
    pub slots: u64,
    pub starts: u64,
    pub lens: u64,
    pub n_seqs: usize,
    pub hk: usize,
    pub hv: usize,
}

/// The kernel's `GdnLayerTable`: five arrays of [`GDN_LAYER_TABLE`] device pointers.
#[repr(C)]
#[derive(Clone, Copy)]
struct LayerTable {
    conv_w: [u64; GDN_LAYER_TABLE],
    conv_state: [u64; GDN_LAYER_TABLE],
    a_log: [u64; GDN_LAYER_TABLE],
    dt_bias: [u64; GDN_LAYER_TABLE],
    state: [u64; GDN_LAYER_TABLE],
}

// SAFETY: plain old data laid out as the kernel's struct (repr(C), 8-byte device pointers).
unsafe impl cudarc::driver::DeviceRepr for LayerTable {}

pub fn gdn_commit_layers(k: &Kernels, s: &CudaStream, a: &GdnCommitLayers<'_>) -> Result<(), CudaError> {
    const K: &str = "gdn_commit_layers";
    if a.n_seqs == 0 || a.layers.is_empty() {
        return Ok(());
    }
    let dv = k.dims.gdn_v_dim;
    if !rows_layout_ok(k, a.hk, a.hv, a.x_stride, a.ba_stride) || a.lens == 0 {
        return Err(invalid(K, format!("{a:?}")));
    }
    let (slots, starts, lens) = (a.slots, a.starts, a.lens);
    let (xs, bs) = (a.x_stride as i64, a.ba_stride as i64);
    let (xl, bl) = (a.x_layer as i64, a.ba_layer as i64);
    let (hk, hv) = (to_i32(K, "hk", a.hk)?, to_i32(K, "hv", a.hv)?);
    for (ci, chunk) in a.layers.chunks(GDN_LAYER_TABLE).enumerate() {
        let first = (ci * GDN_LAYER_TABLE) as u64;
        let x = a.x + 2 * first * a.x_layer as u64;
        let ba = a.ba + 2 * first * a.ba_layer as u64;
        let mut lt = LayerTable {
            conv_w: [0; GDN_LAYER_TABLE],
            conv_state: [0; GDN_LAYER_TABLE],
            a_log: [0; GDN_LAYER_TABLE],
            dt_bias: [0; GDN_LAYER_TABLE],
            state: [0; GDN_LAYER_TABLE],
        };
        for (i, l) in chunk.iter().enumerate() {
            (lt.conv_w[i], lt.conv_state[i], lt.a_log[i]) = (l.conv_w, l.conv_state, l.a_log);
            (lt.dt_bias[i], lt.state[i]) = (l.dt_bias, l.state);
        }
        let grid = (to_u32(K, "n_seqs", a.n_seqs)?, to_u32(K, "hv", a.hv)?, chunk.len() as u32);
        launch!(k, s, K, grid, ((4 * dv) as u32, 1, 1), 0; x, xl, xs, ba, bl, bs, lt, slots, starts, lens, hk, hv)?;
    }
    Ok(())
}
