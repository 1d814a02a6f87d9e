//! Launcher for kernels/sample.cu (token selection for sampling rows on the device): the rows'
//! parameters and penalties go up, the penalties are applied to the logits in place, then the stats /
//! histogram / gather / pick kernels leave one (token, flag) pair per row in the scratch's `out`.

use cudarc::driver::{CudaStream, result};
use deltaserve_backend::RowSampling;
use deltaserve_plan::SamplingScratch;
use deltaserve_plan::workspace::{SAMPLE_BINS, SAMPLE_PENALTIES_PER_SEQ};

use super::{Kernels, invalid, launch, to_i32, to_u32};
use crate::error::CudaError;

/// Mode of a row in the kernels: 0 greedy, 1 a plain draw over every id, 2 a cut (top-k / top-p / min-p).
pub fn mode(row: &RowSampling, valid: usize) -> i32 {
    if row.is_greedy() {
        0
    } else if row.is_plain_draw(valid) {
        1
    } else {
        2
    }
}

/// The kernels' `SampleParams` of each row (8 words: 1/temperature, top-k (0: none), top-p, min-p,
/// uniform, mode, 0, 0) and the penalty entries (row, id, repetition factor bits, subtrahend bits) of
/// ids `< valid`.
pub fn encode(rows: &[RowSampling], valid: usize) -> (Vec<u32>, Vec<[u32; 4]>) {
    let mut params = Vec::with_capacity(rows.len() * 8);
    let mut pens = Vec::new();
    for (r, row) in rows.iter().enumerate() {
        let top_k = if row.top_k >= valid { 0 } else { row.top_k };
        let inv_t = if row.is_greedy() { 1.0 } else { 1.0 / row.temperature };
        params.extend([
            inv_t.to_bits(),
            top_k as u32,
            row.top_p.to_bits(),
            row.min_p.to_bits(),
            row.uniform.to_bits(),
            mode(row, valid) as u32,
            0,
            0,
        ]);
        for p in row.penalties.iter().filter(|p| (p.id as usize) < valid) {
            let rp = if p.repeated { row.repetition_penalty } else { 1.0 };
            if rp != 1.0 || p.subtract != 0.0 {
                pens.push([r as u32, p.id, rp.to_bits(), p.subtract.to_bits()]);
            }
        }
    }
    (params, pens)
}

/// Whether a step's encoded penalties fit the scratch of `seqs` rows.
pub fn penalties_fit(pens: usize, seqs: usize) -> bool {
    pens <= seqs * SAMPLE_PENALTIES_PER_SEQ
}

/// Picks the tokens of `rows` rows of the logits at `x` (f32, stride `ld`, ids `< valid`): uploads
/// `params` and `pens` (from [`encode`]) into the scratch at `base` (laid out by `sc` for at least
/// `rows` rows), applies the penalties to the logits in place, and runs the kernels. The scratch's
/// `out` then holds (token, flag) per row: flag 1 (token −1) where the host must pick.
#[allow(clippy::too_many_arguments)]
pub fn sample_rows(
    k: &Kernels,
    s: &CudaStream,
    sc: &SamplingScratch,
    base: u64,
    x: u64,
    ld: usize,
    valid: usize,
    rows: usize,
    params: &[u32],
    pens: &[[u32; 4]],
) -> Result<(), CudaError> {
    if rows == 0 {
        return Ok(());
    }
    if valid == 0 || valid > ld {
        return Err(invalid("sample_rows", format!("valid {valid} of rows of {ld}")));
    }
    if params.len() != rows * 8 || !penalties_fit(pens.len(), rows) {
        return Err(invalid(
            "sample_rows",
            format!("{} parameter words, {} penalties for {rows} rows", params.len(), pens.len()),
        ));
    }
    let cs = s.cu_stream();
    // SAFETY: the scratch holds `rows` rows' parts (the plan sized it for the step's maximum), and
    // pageable sources are staged before the calls return.
    unsafe {
        result::memcpy_htod_async(base + sc.params, params, cs).map_err(CudaError::driver("cuMemcpyHtoDAsync"))?;
        if !pens.is_empty() {
            result::memcpy_htod_async(base + sc.penalties, pens, cs).map_err(CudaError::driver("cuMemcpyHtoDAsync"))?;
        }
        result::memset_d8_async(base + sc.hist_count, 0, sc.zeroed_bytes as usize, cs)
            .map_err(CudaError::driver("cuMemsetD8Async"))?;
    }
    let ld_i = ld as i64;
    let v = to_i32("sample_rows", "valid", valid)?;
    let r = to_u32("sample_rows", "rows", rows)?;
    let (params_p, partials, cand, cand_count, out) =
        (base + sc.params, base + sc.partials, base + sc.cand, base + sc.cand_count, base + sc.out);
    let (hist_count, hist_mass) = (base + sc.hist_count, base + sc.hist_mass);
    if !pens.is_empty() {
        let (pp, n) = (base + sc.penalties, to_i32("sample_penalize", "penalties", pens.len())?);
        launch!(k, s, "sample_penalize", ((pens.len() as u32).div_ceil(256), 1, 1), (256, 1, 1), 0; x, ld_i, pp, n)?;
    }
    let b = to_u32("sample_rows", "blocks", sc.blocks)?;
    launch!(k, s, "sample_stats", (b, r, 1), (256, 1, 1), 0; x, ld_i, v, params_p, partials)?;
    let bins = SAMPLE_BINS as i32;
    let hist_smem = (SAMPLE_BINS * 12) as u32;
    launch!(k, s, "sample_hist", (b, r, 1), (256, 1, 1), hist_smem;
        x, ld_i, v, params_p, partials, bins, hist_count, hist_mass)?;
    let cap = to_i32("sample_rows", "candidates", sc.candidates)?;
    let (bi, state) = (sc.blocks as i32, base + sc.state);
    let pick_smem = (sc.candidates * 8) as u32;
    // Rows cut without top-k may need a second round (the bin where their draw lands).
    let rounds = if params.chunks_exact(8).any(|w| w[5] == 2 && w[1] == 0) { 2 } else { 1 };
    for round in 1..=rounds {
        launch!(k, s, "sample_gather", (b, r, 1), (256, 1, 1), 0;
            x, ld_i, v, params_p, partials, bins, hist_count, hist_mass, cap, cand, cand_count, state, round)?;
        launch!(k, s, "sample_pick", (r, 1, 1), (1024, 1, 1), pick_smem;
            x, ld_i, v, params_p, partials, bi, bins, hist_count, hist_mass, cap, cand, cand_count, state, round, out)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use deltaserve_backend::Penalty;

    #[test]
    fn rows_encode_their_mode_and_penalties() {
        let greedy = RowSampling::greedy();
        let plain = RowSampling { temperature: 0.5, uniform: 0.25, ..RowSampling::greedy() };
        let cut = RowSampling {
            temperature: 2.0,
            top_k: 20,
            repetition_penalty: 1.5,
            penalties: vec![
                Penalty { id: 3, repeated: true, subtract: 0.0 },
                Penalty { id: 4, repeated: false, subtract: 0.5 },
                Penalty { id: 99, repeated: true, subtract: 1.0 }, // beyond `valid`
            ],
            ..RowSampling::greedy()
        };
        let wide_k = RowSampling { temperature: 1.0, top_k: 50, ..RowSampling::greedy() };
        let (params, pens) = encode(&[greedy, plain, cut, wide_k], 50);
        assert_eq!(params.len(), 32);
        let modes: Vec<u32> = params.chunks(8).map(|p| p[5]).collect();
        assert_eq!(modes, [0, 1, 2, 1], "top-k at the vocabulary is no cut");
        assert_eq!(f32::from_bits(params[8]), 2.0);
        assert_eq!(f32::from_bits(params[12]), 0.25);
        assert_eq!(params[17], 20);
        assert_eq!(params[25], 0);
        assert_eq!(pens, vec![[2, 3, 1.5f32.to_bits(), 0], [2, 4, 1.0f32.to_bits(), 0.5f32.to_bits()]]);
        assert!(penalties_fit(SAMPLE_PENALTIES_PER_SEQ * 2, 2) && !penalties_fit(SAMPLE_PENALTIES_PER_SEQ + 1, 1));
    }
}
