//! Launchers for kernels/moe.cu: a sparse layer's routing (softmax, top-k, the shared expert's gate),
//! the rows grouped by expert, the experts' grouped GEMM (prefill) and per-pair GEMV (decode), and the
//! weighted un-permute onto the shared expert's output. Every launch shape depends on the step's token
//! count, `top_k` and the expert count only, never on how the tokens route (CUDA graphs replay them).
//! The decode chain (routing, per-pair GEMV, un-permute) launches programmatically where the kernels do
//! ([`Kernels::pdl`]).

use cudarc::driver::CudaStream;

use super::{Kernels, invalid, launch, launch_pdl, to_i32, to_u32};
use crate::error::CudaError;

/// Rows of one grouped-GEMM tile (`MOE_BM`): the tile counts of [`moe_offsets`] are in these.
pub const TILE_ROWS: usize = 64;
/// Output columns of one grouped-GEMM tile (`MOE_BN`).
const TILE_COLS: usize = 64;
/// Output rows of one GEMV block.
const GEMV_ROWS: usize = 16;
/// Most experts a token may use (`MOE_MAX_K`).
pub const MAX_TOP_K: usize = 32;
/// Most experts the grouping kernel counts in shared memory (8 bytes each).
pub const MAX_EXPERTS: usize = 4096;

/// Bytes of `moe_topk` for `t` tokens: `(expert i32, weight f32)` per (token, k).
pub fn topk_bytes(t: usize, top_k: usize) -> usize {
    8 * t * top_k
}

/// Bytes of `moe_expert_offsets`: row prefix sums `[E + 1]` then tile prefix sums `[E + 1]`, i32.
pub fn offsets_bytes(num_experts: usize) -> usize {
    8 * (num_experts + 1)
}

/// Grid rows of a grouped GEMM over tiles of `tile_rows` ([`TILE_ROWS`] for `moe_gemm`): an upper bound
/// on the tiles of `pairs` rows over `num_experts` experts (each non-empty expert adds at most one
/// partial tile).
pub fn gemm_tiles(pairs: usize, num_experts: usize, tile_rows: usize) -> usize {
    pairs.div_ceil(tile_rows) + num_experts.min(pairs)
}

/// A grouped GEMM's grid rows ([`gemm_tiles`]), at most 65,535 (the grid's y limit).
pub(super) fn tile_grid_rows(
    name: &'static str,
    pairs: usize,
    num_experts: usize,
    tile_rows: usize,
) -> Result<u32, CudaError> {
    let tiles = to_u32(name, "tiles", gemm_tiles(pairs, num_experts, tile_rows))?;
    if tiles > 65535 {
        return Err(invalid(name, format!("{tiles} row tiles (at most 65535)")));
    }
    Ok(tiles)
}

fn check_k(name: &'static str, num_experts: usize, top_k: usize) -> Result<(), CudaError> {
    if num_experts == 0 || num_experts > MAX_EXPERTS || top_k == 0 || top_k > MAX_TOP_K.min(num_experts) {
        return Err(invalid(
            name,
            format!("{num_experts} experts (1..={MAX_EXPERTS}), top {top_k} (1..={MAX_TOP_K}, at most the experts)"),
        ));
    }
    Ok(())
}

fn check_vec8(name: &'static str, dims: &[usize], ptrs: &[u64]) -> Result<(), CudaError> {
    if dims.iter().any(|d| *d == 0 || !d.is_multiple_of(8)) || ptrs.iter().any(|p| !p.is_multiple_of(16)) {
        return Err(invalid(name, format!("dims {dims:?} must be multiples of 8 and pointers 16-byte aligned")));
    }
    Ok(())
}

/// Routing of `t` tokens: `logits` `[t, E]` f32 → `topk` `[t, top_k]` (expert, weight), the `top_k`
/// most probable experts (equal logits: the lower expert first), weights renormalised when `norm`;
/// `shared_gate[t]` = sigmoid(x[t] · wg) (f32) for `x` `[t, hidden]` and `wg` `[hidden]` bf16.
#[allow(clippy::too_many_arguments)]
pub fn route(
    k: &Kernels,
    s: &CudaStream,
    logits: u64,
    t: usize,
    num_experts: usize,
    top_k: usize,
    norm: bool,
    x: u64,
    wg: u64,
    hidden: usize,
    topk: u64,
    shared_gate: u64,
) -> Result<(), CudaError> {
    const NAME: &str = "moe_route";
    check_k(NAME, num_experts, top_k)?;
    if t == 0 {
        return Ok(());
    }
    let (e, kk, n, h) =
        (to_i32(NAME, "E", num_experts)?, to_i32(NAME, "top_k", top_k)?, i32::from(norm), to_i32(NAME, "H", hidden)?);
    launch_pdl!(k, s, NAME, (to_u32(NAME, "t", t)?, 1, 1), (256, 1, 1), 0; logits, e, kk, n, x, wg, h, topk, shared_gate)
}

/// The grouping of the step's `pairs` = t·top_k (token, k) rows by expert: `offsets` (see
/// [`offsets_bytes`]; tiles of `tile_rows`, the grouped GEMM's: [`TILE_ROWS`] for bf16 experts,
/// [`super::moe_w4::TILE_ROWS`] for int4) and `rows[pairs]` i32, each pair's row in the grouped order.
#[allow(clippy::too_many_arguments)]
pub fn offsets(
    k: &Kernels,
    s: &CudaStream,
    topk: u64,
    pairs: usize,
    num_experts: usize,
    tile_rows: usize,
    offsets: u64,
    rows: u64,
) -> Result<(), CudaError> {
    const NAME: &str = "moe_offsets";
    check_k(NAME, num_experts, 1)?;
    let (p, e, bm) = (to_i32(NAME, "pairs", pairs)?, to_i32(NAME, "E", num_experts)?, to_i32(NAME, "bm", tile_rows)?);
    if bm == 0 {
        return Err(invalid(NAME, "tiles of 0 rows"));
    }
    let smem = (8 * num_experts) as u32;
    launch!(k, s, NAME, (1, 1, 1), (1024, 1, 1), smem; topk, p, e, bm, offsets, rows)
}

/// `out[rows[p]] = x[p / top_k]` for every pair: `x` `[t, hidden]`, `out` `[t·top_k, hidden]` bf16.
#[allow(clippy::too_many_arguments)]
pub fn permute(
    k: &Kernels,
    s: &CudaStream,
    x: u64,
    rows: u64,
    t: usize,
    top_k: usize,
    hidden: usize,
    out: u64,
) -> Result<(), CudaError> {
    const NAME: &str = "moe_permute";
    check_vec8(NAME, &[hidden], &[x, out])?;
    if t == 0 {
        return Ok(());
    }
    let (kk, h) = (to_i32(NAME, "top_k", top_k)?, to_i32(NAME, "H", hidden)?);
    launch!(k, s, NAME, (to_u32(NAME, "pairs", t * top_k)?, 1, 1), (128, 1, 1), 0; x, rows, kk, h, out)
}

/// The experts' weights of one projection: expert e's `[n, kdim]` bf16 at `base + e·stride` elements.
#[derive(Clone, Copy, Debug)]
pub struct ExpertWeights {
    pub base: u64,
    pub stride: usize,
    pub n: usize,
    pub kdim: usize,
}

impl ExpertWeights {
    fn check(&self, name: &'static str, x: u64, y: u64) -> Result<(i64, i32, i32), CudaError> {
        check_vec8(name, &[self.kdim, self.stride], &[x, y, self.base])?;
        let stride = i64::try_from(self.stride).map_err(|_| invalid(name, "expert stride overflows"))?;
        Ok((stride, to_i32(name, "N", self.n)?, to_i32(name, "K", self.kdim)?))
    }
}

/// Grouped GEMM: `y[r, :n] = x[r, :kdim] · W_eᵀ` for the grouped rows r of every expert e (`offsets`
/// from [`offsets`]); `pairs` sizes the grid (the step's t·top_k), `y` `[pairs, n]` bf16.
#[allow(clippy::too_many_arguments)]
pub fn gemm(
    k: &Kernels,
    s: &CudaStream,
    x: u64,
    offsets: u64,
    num_experts: usize,
    pairs: usize,
    w: &ExpertWeights,
    y: u64,
) -> Result<(), CudaError> {
    const NAME: &str = "moe_gemm";
    check_k(NAME, num_experts, 1)?;
    let (ws, n, kd) = w.check(NAME, x, y)?;
    if pairs == 0 || w.n == 0 {
        return Ok(());
    }
    let grid = (
        to_u32(NAME, "column tiles", w.n.div_ceil(TILE_COLS))?,
        tile_grid_rows(NAME, pairs, num_experts, TILE_ROWS)?,
        1,
    );
    let (e, wb) = (to_i32(NAME, "E", num_experts)?, w.base);
    launch!(k, s, NAME, grid, (128, 1, 1), 0; x, offsets, e, wb, ws, n, kd, y)
}

/// The shared expert run with a per-pair GEMV launch, as one more pair per token after the routed pairs:
/// its projection `w` (the shape of an expert's: bf16 `[n, kdim]` at an address, or an int4 linear),
/// the step's `tokens`, and `x_row`, the x row of its first pair (0 where the launch reads the tokens'
/// rows, the gate/up projection; the routed pairs' count where it reads the pairs' rows, the down
/// projection over the SwiGLU rows, the shared pairs' after the routed). Its outputs follow the routed
/// pairs' rows of `y`.
#[derive(Clone, Copy, Debug)]
pub struct SharedPairs<W> {
    pub w: W,
    pub tokens: usize,
    pub x_row: usize,
}

/// Per-pair GEMV (decode): `y[p, :n] = x[p / x_div, :kdim] · W_eᵀ` with e the expert of pair p in
/// `topk`, for `pairs` pairs; reads only the selected experts' weights; then the `shared` expert's
/// pairs, if given.
#[allow(clippy::too_many_arguments)]
pub fn gemv(
    k: &Kernels,
    s: &CudaStream,
    x: u64,
    x_div: usize,
    topk: u64,
    pairs: usize,
    shared: Option<SharedPairs<u64>>,
    w: &ExpertWeights,
    y: u64,
) -> Result<(), CudaError> {
    const NAME: &str = "moe_gemv";
    let (ws, n, kd) = w.check(NAME, x, y)?;
    let (sh_w, sh_t, sh_x) = shared.map_or((0, 0, 0), |p| (p.w, p.tokens, p.x_row));
    if shared.is_some() {
        check_vec8(NAME, &[w.kdim], &[sh_w])?;
    }
    let all = pairs + sh_t;
    if all == 0 || w.n == 0 {
        return Ok(());
    }
    if all > 65535 || x_div == 0 {
        return Err(invalid(NAME, format!("{all} pairs (at most 65535), x_div {x_div} (> 0)")));
    }
    let grid = (to_u32(NAME, "row blocks", w.n.div_ceil(GEMV_ROWS))?, all as u32, 1);
    let (xd, wb) = (to_i32(NAME, "x_div", x_div)?, w.base);
    let (p, sx) = (to_i32(NAME, "pairs", pairs)?, to_i32(NAME, "shared x row", sh_x)?);
    launch_pdl!(k, s, NAME, grid, (128, 1, 1), 0; x, xd, topk, p, sx, wb, ws, sh_w, n, kd, y)
}

/// `out[t] = Σ_k w_k · ys[row(t, k)] + shared_gate[t] · S[t]` (bf16 `[t, hidden]`), S the shared
/// expert's output: `shared` `[t, hidden]` when given (the shared pairs' rows of a per-pair GEMV), else
/// `out` itself; `rows` from [`offsets`], or None when `ys` is in pair order ([`gemv`]).
#[allow(clippy::too_many_arguments)]
pub fn unpermute(
    k: &Kernels,
    s: &CudaStream,
    ys: u64,
    rows: Option<u64>,
    topk: u64,
    t: usize,
    top_k: usize,
    shared_gate: u64,
    shared: Option<u64>,
    hidden: usize,
    out: u64,
) -> Result<(), CudaError> {
    const NAME: &str = "moe_unpermute";
    if t == 0 {
        return Ok(());
    }
    let (kk, h, rows) = (to_i32(NAME, "top_k", top_k)?, to_i32(NAME, "H", hidden)?, rows.unwrap_or(0));
    let sh = shared.unwrap_or(0);
    launch_pdl!(k, s, NAME, (to_u32(NAME, "t", t)?, 1, 1), (256, 1, 1), 0; ys, rows, topk, kk, shared_gate, sh, h, out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tile_bound_covers_the_most_uneven_routing() {
        // Every expert but one with a single row: each adds a partial tile.
        let (pairs, e) = (300usize, 64usize);
        let mut counts = vec![1usize; e];
        counts[0] = pairs - (e - 1);
        let tiles: usize = counts.iter().map(|c| c.div_ceil(TILE_ROWS)).sum();
        assert!(tiles <= gemm_tiles(pairs, e, TILE_ROWS));
        // One expert takes every row.
        assert!(pairs.div_ceil(TILE_ROWS) <= gemm_tiles(pairs, e, TILE_ROWS));
        assert_eq!(gemm_tiles(1, 512, TILE_ROWS), 2);
        assert_eq!(gemm_tiles(300, 64, 32), 10 + 64);
        assert_eq!(offsets_bytes(4), 40);
        assert_eq!(topk_bytes(3, 8), 192);
    }
}
