//! Work split over a few threads: rows of an output, each computed the same way on any thread.

/// Fills `out` (rows of `row_len`; a last partial row is left alone) by `f(row index, row)`, its rows split in
/// contiguous runs over up to 8 threads (one for small outputs).
pub(crate) fn rows(out: &mut [f32], row_len: usize, f: impl Fn(usize, &mut [f32]) + Sync) {
    const MIN_VALUES_PER_THREAD: usize = 1 << 18;
    if row_len == 0 {
        return;
    }
    let rows = out.len() / row_len;
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(8)
        .min(out.len().div_ceil(MIN_VALUES_PER_THREAD))
        .max(1);
    let per = rows.div_ceil(threads).max(1);
    let run = |first: usize, chunk: &mut [f32]| {
        for (i, dst) in chunk.chunks_exact_mut(row_len).enumerate() {
            f(first + i, dst);
        }
    };
    if threads == 1 {
        return run(0, out);
    }
    std::thread::scope(|scope| {
        for (t, chunk) in out.chunks_mut(per * row_len).enumerate() {
            let run = &run;
            scope.spawn(move || run(t * per, chunk));
        }
    });
}

#[cfg(test)]
mod tests {
    #[test]
    fn every_row_is_filled_once_with_its_index() {
        for (n_rows, len) in [(0usize, 5usize), (1, 3), (7, 1), (3000, 301)] {
            let mut out = vec![-1.0f32; n_rows * len];
            super::rows(&mut out, len, |r, dst| {
                dst.iter_mut().enumerate().for_each(|(i, d)| *d = (r * 1000 + i) as f32)
            });
            assert!(
                out.chunks(len.max(1))
                    .enumerate()
                    .all(|(r, row)| row.iter().enumerate().all(|(i, &v)| v == (r * 1000 + i) as f32))
            );
        }
    }
}
