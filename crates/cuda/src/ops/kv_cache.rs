//! Launcher for kernels/kv_cache.cu (write new K/V rows into the paged cache).

use cudarc::driver::CudaStream;

use super::{Kernels, invalid, launch_pdl, to_i32, to_u32};
use crate::error::CudaError;

/// Paged KV cache write for one layer. Every pointer is a device address.
#[derive(Clone, Copy, Debug)]
pub struct KvWrite {
    /// [t, kv_heads*head_dim] bf16, token strides in elements.
    pub k: u64,
    pub k_stride: usize,
    pub v: u64,
    pub v_stride: usize,
    /// [num_blocks * page, kv_heads*head_dim] bf16.
    pub k_cache: u64,
    pub v_cache: u64,
    /// [n_seqs, max_blocks] i32.
    pub block_tables: u64,
    pub max_blocks: usize,
    /// [n_seqs + 1] i32, and absolute positions [t] i32.
    pub cu_seqlens: u64,
    pub positions: u64,
    pub n_seqs: usize,
    pub t: usize,
    pub page: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

pub fn kv_write(k: &Kernels, s: &CudaStream, a: &KvWrite) -> Result<(), CudaError> {
    if a.t == 0 {
        return Ok(());
    }
    let width = a.kv_heads * a.head_dim;
    if a.page == 0 || a.n_seqs == 0 || a.max_blocks == 0 || a.k_stride < width || a.v_stride < width {
        return Err(invalid("kv_write", format!("{a:?}")));
    }
    let KvWrite { k: kp, v: vp, k_cache, v_cache, block_tables, cu_seqlens, positions, .. } = *a;
    let (ks, vs) = (a.k_stride as i64, a.v_stride as i64);
    let mb = to_i32("kv_write", "max_blocks", a.max_blocks)?;
    let b = to_i32("kv_write", "n_seqs", a.n_seqs)?;
    let page = to_i32("kv_write", "page", a.page)?;
    let w = to_i32("kv_write", "width", width)?;
    let grid = (to_u32("kv_write", "t", a.t)?, 1, 1);
    launch_pdl!(k, s, "kv_write", grid, (128, 1, 1), 0;
        kp, ks, vp, vs, k_cache, v_cache, block_tables, mb, cu_seqlens, b, positions, page, w)
}
