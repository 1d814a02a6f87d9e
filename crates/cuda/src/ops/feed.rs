//! Launcher for kernels/feed.cu (look-ahead decode: a step's tokens from the previous step's picks).

use cudarc::driver::CudaStream;

use super::{Kernels, invalid, launch, to_i32, to_u32};
use crate::error::CudaError;

/// Where a fed step's inputs are (device addresses; `table` 0 without a host embedding table).
pub struct FeedTargets {
    pub token_ids: u64,
    pub positions: u64,
    pub slots: u64,
    pub seq_lens: u64,
    /// The embedding table in pinned host memory (device-mapped), or 0, and the residual rows it fills.
    pub table: u64,
    pub residual: u64,
    pub hidden: usize,
}

/// Feeds `rows` one-token rows from `picks` (i32 at `stride` 1, or (token, flag) pairs at 2): `feed` holds
/// each row's `from`, then `stops_w` stop ids a row (−1 pads). See kernels/feed.cu.
#[allow(clippy::too_many_arguments)]
pub fn feed_rows(
    k: &Kernels,
    s: &CudaStream,
    picks: u64,
    stride: usize,
    feed: u64,
    rows: usize,
    stops_w: usize,
    valid: usize,
    to: &FeedTargets,
) -> Result<(), CudaError> {
    if rows == 0 {
        return Ok(());
    }
    if !(1..=2).contains(&stride) || to.hidden == 0 {
        return Err(invalid("feed_rows", format!("stride {stride}, hidden {}", to.hidden)));
    }
    let (st, n, w, v, d) = (
        stride as i32,
        to_i32("feed_rows", "rows", rows)?,
        to_i32("feed_rows", "stops", stops_w)?,
        to_i32("feed_rows", "valid", valid)?,
        to_i32("feed_rows", "hidden", to.hidden)?,
    );
    let (ids, pos, slots, lens, table, res) =
        (to.token_ids, to.positions, to.slots, to.seq_lens, to.table, to.residual);
    launch!(k, s, "feed_rows", (to_u32("feed_rows", "rows", rows)?, 1, 1), (256, 1, 1), 0;
        picks, st, feed, n, w, v, ids, pos, slots, lens, table, res, d)
}
