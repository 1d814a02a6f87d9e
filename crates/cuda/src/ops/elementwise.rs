//! Launchers for kernels/elementwise.cu: attention output gate and SwiGLU.

use cudarc::driver::CudaStream;

use super::{Kernels, launch, to_i32};
use crate::error::CudaError;

fn grid_for(n: usize) -> (u32, u32, u32) {
    (n.div_ceil(256).clamp(1, 1 << 20) as u32, 1, 1)
}

/// x [t, heads*hd] bf16 in place: x *= sigmoid(gate), gate element (t, h, d) at
/// `gate + t*g_tok + h*g_head + d`. For Qwen3.5 attention, gate = q_proj output + hd,
/// g_tok = 2*heads*hd, g_head = 2*hd.
#[allow(clippy::too_many_arguments)]
pub fn sigmoid_gate_mul(
    k: &Kernels,
    s: &CudaStream,
    x: u64,
    gate: u64,
    t: usize,
    heads: usize,
    hd: usize,
    g_tok: usize,
    g_head: usize,
) -> Result<(), CudaError> {
    let n = t * heads * hd;
    if n == 0 {
        return Ok(());
    }
    let (tt, h, d) = (
        to_i32("sigmoid_gate_mul", "t", t)?,
        to_i32("sigmoid_gate_mul", "heads", heads)?,
        to_i32("sigmoid_gate_mul", "hd", hd)?,
    );
    let (gt, gh) = (g_tok as i64, g_head as i64);
    launch!(k, s, "sigmoid_gate_mul", grid_for(n), (256, 1, 1), 0; x, gate, tt, h, d, gt, gh)
}

/// out [t, i] bf16 = silu(gate[t, :i]) * up[t, :i], rows of gate/up at strides g_stride/u_stride.
#[allow(clippy::too_many_arguments)]
pub fn swiglu(
    k: &Kernels,
    s: &CudaStream,
    gate: u64,
    g_stride: usize,
    up: u64,
    u_stride: usize,
    out: u64,
    t: usize,
    i: usize,
) -> Result<(), CudaError> {
    let n = t * i;
    if n == 0 {
        return Ok(());
    }
    let (gs, us) = (g_stride as i64, u_stride as i64);
    let (tt, ii) = (to_i32("swiglu", "t", t)?, to_i32("swiglu", "i", i)?);
    launch!(k, s, "swiglu", grid_for(n), (256, 1, 1), 0; gate, gs, up, us, out, tt, ii)
}
