//! Launchers for kernels/gdn_gate.cu: beta/g gates fused with q/k L2 norm and the q scale, and for
//! decode rows the causal conv too ([`gdn_conv_gate_decode`]).

use cudarc::driver::CudaStream;

use super::conv::ConvPrefill;
use super::{Kernels, invalid, launch, launch_pdl, to_i32, to_u32};
use crate::KernelDims;
use crate::error::CudaError;

#[derive(Clone, Copy, Debug)]
pub struct GdnGate {
    /// Conv output [t, conv_dim] bf16 (q at column 0, k at column hk*dk), token stride.
    pub qk: u64,
    pub qk_stride: usize,
    /// [t, hv] bf16 each, token strides in elements.
    pub b: u64,
    pub b_stride: usize,
    pub a: u64,
    pub a_stride: usize,
    /// [hv] f32 each.
    pub a_log: u64,
    pub dt_bias: u64,
    /// Outputs: q, k [t, hk, dk] bf16; g, beta [t, hv] f32.
    pub q_out: u64,
    pub k_out: u64,
    pub g: u64,
    pub beta: u64,
    pub t: usize,
    pub hk: usize,
    pub hv: usize,
}

pub fn gdn_gate(k: &Kernels, s: &CudaStream, a: &GdnGate) -> Result<(), CudaError> {
    if a.t == 0 {
        return Ok(());
    }
    let dk = k.dims.gdn_k_dim;
    if a.hk == 0 || a.hv == 0 || a.qk_stride < 2 * a.hk * dk || a.b_stride < a.hv || a.a_stride < a.hv {
        return Err(invalid("gdn_gate", format!("{a:?} (DK = {dk})")));
    }
    let GdnGate { qk, b, a: ap, a_log, dt_bias, q_out, k_out, g, beta, .. } = *a;
    let (qs, bs, as_) = (a.qk_stride as i64, a.b_stride as i64, a.a_stride as i64);
    let hk = to_i32("gdn_gate", "hk", a.hk)?;
    let hv = to_i32("gdn_gate", "hv", a.hv)?;
    let grid = (to_u32("gdn_gate", "t", a.t)?, 1, 1);
    launch!(k, s, "gdn_gate", grid, (256, 1, 1), 0;
        qk, qs, b, bs, ap, as_, a_log, dt_bias, q_out, k_out, g, beta, hk, hv)
}

/// Decode rows (one token per sequence): the causal conv of [`super::conv::conv_decode`] and the gates
/// of [`gdn_gate`] in one launch, bitwise the same.
#[derive(Clone, Copy, Debug)]
pub struct GdnConvGateDecode {
    /// In-projection rows [gate.t, *] bf16 (q | k | v channels from column 0), token stride.
    pub x: u64,
    pub x_stride: usize,
    /// Conv weights [channels, conv_kernel] bf16; conv state [slots, conv_kernel - 1, channels] bf16;
    /// slots [gate.t] i32 (< 0: a padding row).
    pub w: u64,
    pub state: u64,
    pub slots: u64,
    /// The gates of the same rows; `gate.qk` is where the conv output goes ([gate.t, channels] bf16,
    /// `gate.qk_stride` = channels = (2 hk + hv) head_dim).
    pub gate: GdnGate,
}

/// Whether [`gdn_conv_gate_decode`] takes a layer of `channels` conv channels with `hk` key and `hv`
/// value heads: one block per head of conv channels needs key and value heads of one width.
pub fn conv_gate_decode_supported(dims: &KernelDims, channels: usize, hk: usize, hv: usize) -> bool {
    hk > 0 && hv > 0 && dims.gdn_k_dim == dims.gdn_v_dim && channels == (2 * hk + hv) * dims.gdn_k_dim
}

pub fn gdn_conv_gate_decode(k: &Kernels, s: &CudaStream, a: &GdnConvGateDecode) -> Result<(), CudaError> {
    const K: &str = "gdn_conv_gate_decode";
    let g = &a.gate;
    if g.t == 0 {
        return Ok(());
    }
    let dk = k.dims.gdn_k_dim;
    let channels = check_conv_gate(K, k, a.x_stride, g, a)?;
    let GdnConvGateDecode { x, w, state, slots, .. } = *a;
    let GdnGate { qk: y, b, a: ap, a_log, dt_bias, q_out, k_out, g: gp, beta, .. } = *g;
    let (xs, bs, as_) = (a.x_stride as i64, g.b_stride as i64, g.a_stride as i64);
    let c = to_i32(K, "channels", channels)?;
    let (hk, hv) = (to_i32(K, "hk", g.hk)?, to_i32(K, "hv", g.hv)?);
    let grid = (to_u32(K, "n_seqs", g.t)?, to_u32(K, "heads", channels / dk + 1)?, 1);
    launch_pdl!(k, s, K, grid, (dk as u32, 1, 1), 0;
        x, xs, w, y, state, slots, c, b, bs, ap, as_, a_log, dt_bias, q_out, k_out, gp, beta, hk, hv)
}

/// What the fused conv + gate kernels require of their arguments `a` (x token stride `x_stride`, gates
/// `g`): [`conv_gate_decode_supported`] and rows wide enough. Returns the conv channels.
fn check_conv_gate(
    kernel: &'static str,
    k: &Kernels,
    x_stride: usize,
    g: &GdnGate,
    a: &impl std::fmt::Debug,
) -> Result<usize, CudaError> {
    let channels = g.qk_stride;
    if !conv_gate_decode_supported(&k.dims, channels, g.hk, g.hv)
        || x_stride < channels
        || g.b_stride < g.hv
        || g.a_stride < g.hv
    {
        let (dk, dv) = (k.dims.gdn_k_dim, k.dims.gdn_v_dim);
        return Err(invalid(
            kernel,
            format!("{a:?} (DK = {dk}, DV = {dv}: heads of one width, channels = (2 hk + hv) DK)"),
        ));
    }
    Ok(channels)
}

/// The rows of speculative verify chunks (or of their commit) through conv and gates in one launch
/// (kernels/gdn_gate.cu `gdn_conv_gate_rows`): bitwise conv_prefill + gdn_gate, the conv state read and
/// never written.
#[derive(Clone, Copy, Debug)]
pub struct GdnConvGateRows {
    /// In-projection rows [gate.t, *] bf16 (q | k | v channels from column 0), token stride.
    pub x: u64,
    pub x_stride: usize,
    /// Conv weights [channels, conv_kernel] bf16; conv state [slots, conv_kernel - 1, channels] bf16.
    pub w: u64,
    pub state: u64,
    /// [n_seqs + 1] i32 row offsets and [n_seqs] i32 slots (< 0: rows of zeros) of the sequences.
    pub cu_seqlens: u64,
    pub slots: u64,
    pub n_seqs: usize,
    /// The gates of the same rows (`gate.t` rows in all); `gate.qk` is where the conv output goes.
    pub gate: GdnGate,
}

impl GdnConvGateRows {
    /// The fused launch over the rows, state, slots and sequences of a conv launch `cp` (its `y` is
    /// `gate.qk`'s), with the gates `gate`.
    pub fn of_conv(cp: &ConvPrefill, gate: GdnGate) -> Self {
        let ConvPrefill { x, x_stride, w, state, cu_seqlens, slots, n_seqs, .. } = *cp;
        GdnConvGateRows { x, x_stride, w, state, cu_seqlens, slots, n_seqs, gate }
    }
}

pub fn gdn_conv_gate_rows(k: &Kernels, s: &CudaStream, a: &GdnConvGateRows) -> Result<(), CudaError> {
    const K: &str = "gdn_conv_gate_rows";
    let g = &a.gate;
    if g.t == 0 || a.n_seqs == 0 {
        return Ok(());
    }
    let dk = k.dims.gdn_k_dim;
    let channels = check_conv_gate(K, k, a.x_stride, g, a)?;
    let GdnConvGateRows { x, w, state, cu_seqlens, slots, .. } = *a;
    let GdnGate { qk: y, b, a: ap, a_log, dt_bias, q_out, k_out, g: gp, beta, .. } = *g;
    let (xs, bs, as_) = (a.x_stride as i64, g.b_stride as i64, g.a_stride as i64);
    let c = to_i32(K, "channels", channels)?;
    let (hk, hv) = (to_i32(K, "hk", g.hk)?, to_i32(K, "hv", g.hv)?);
    let grid = (to_u32(K, "n_seqs", a.n_seqs)?, to_u32(K, "heads", channels / dk + 1)?, 1);
    launch!(k, s, K, grid, (dk as u32, 1, 1), 0;
        x, xs, w, y, state, cu_seqlens, slots, c, b, bs, ap, as_, a_log, dt_bias, q_out, k_out, gp, beta, hk, hv)
}
