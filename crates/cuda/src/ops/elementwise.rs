//! Launchers for kernels/elementwise.cu: attention output gate and SwiGLU.

use cudarc::driver::CudaStream;

use super::{Kernels, launch, launch_pdl, to_i32};
use crate::error::CudaError;

fn grid_for(n: usize) -> (u32, u32, u32) {
    (n.div_ceil(256).clamp(1, 1 << 20) as u32, 1, 1)
}

/// Grid of the `*8` kernels: 8 columns per thread, one row per grid.y (rows beyond 65535 loop).
fn grid8(rows: usize, cols: usize) -> (u32, u32, u32) {
    (cols.div_ceil(8 * 256).max(1) as u32, rows.clamp(1, 65535) as u32, 1)
}

/// Whether the 16-byte (8-column) kernels apply: every count and stride a multiple of 8 elements and
/// every pointer 16-byte aligned.
fn vec8(counts: &[usize], ptrs: &[u64]) -> bool {
    counts.iter().all(|c| c.is_multiple_of(8)) && ptrs.iter().all(|p| p.is_multiple_of(16))
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
    if vec8(&[hd, g_tok, g_head], &[x, gate]) {
        return launch!(k, s, "sigmoid_gate_mul8", grid8(t, heads * hd), (256, 1, 1), 0; x, gate, tt, h, d, gt, gh);
    }
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
    if vec8(&[i, g_stride, u_stride], &[gate, up, out]) {
        return launch_pdl!(k, s, "swiglu8", grid8(t, i), (256, 1, 1), 0; gate, gs, up, us, out, tt, ii);
    }
    launch_pdl!(k, s, "swiglu", grid_for(n), (256, 1, 1), 0; gate, gs, up, us, out, tt, ii)
}
