//! Launcher for kernels/sample.cu (token selection for sampling rows on the device): the rows'
//! parameters, token masks and penalties go up, the masks and penalties are applied to the logits in
//! place, then the stats / histogram / gather / pick kernels leave one (token, flag) pair per row in the
//! scratch's `out`.

use cudarc::driver::{CudaStream, result};
use deltaserve_backend::RowSampling;
use deltaserve_backend::sampling::allowed_count;
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

/// A step's rows as the kernels take them.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Encoded {
    /// `SampleParams` of each row, 8 words: 1/temperature, top-k (0: none), top-p, min-p, uniform, mode,
    /// repetition factor (1: none), masked (1: the row's token bitmap applies).
    pub params: Vec<u32>,
    /// Subtrahend entries (row, id, 1.0 bits, subtrahend bits) of ids `< valid`.
    pub pens: Vec<[u32; 4]>,
    /// `[rows, words]` bitmaps of the ids the repetition penalty applies to; empty when no row has one.
    pub bits: Vec<u32>,
    /// `[rows, words]` bitmaps of the ids each masked row may pick ([`RowSampling::allowed`]; other
    /// rows' words are unused); empty when no row has a mask.
    pub allowed: Vec<u32>,
}

/// Encodes `rows` over ids `< valid`; `words`: the words of one row's bitmap (the scratch's). A masked
/// row's top-k is at most the ids its mask allows (the others have no mass and sort last: the same
/// candidates, and fewer for the kernels to gather).
pub fn encode(rows: &[RowSampling], valid: usize, words: usize) -> Encoded {
    let mut e = Encoded { params: Vec::with_capacity(rows.len() * 8), ..Default::default() };
    let repeats = |row: &RowSampling| row.repetition_penalty != 1.0 && row.penalties.iter().any(|p| p.repeated);
    if rows.iter().any(repeats) {
        e.bits = vec![0; rows.len() * words];
    }
    if rows.iter().any(|r| r.allowed.is_some()) {
        e.allowed = vec![0; rows.len() * words];
    }
    for (r, row) in rows.iter().enumerate() {
        let mut top_k = if row.top_k >= valid { 0 } else { row.top_k };
        if let Some(mask) = &row.allowed {
            let n = mask.len().min(words);
            e.allowed[r * words..r * words + n].copy_from_slice(&mask[..n]);
            let allowed = allowed_count(mask, valid).max(1);
            if top_k > allowed {
                top_k = allowed;
            }
        }
        let inv_t = if row.is_greedy() { 1.0 } else { 1.0 / row.temperature };
        let rep = if repeats(row) { row.repetition_penalty } else { 1.0 };
        e.params.extend([
            inv_t.to_bits(),
            top_k as u32,
            row.top_p.to_bits(),
            row.min_p.to_bits(),
            row.uniform.to_bits(),
            mode(row, valid) as u32,
            rep.to_bits(),
            u32::from(row.allowed.is_some()),
        ]);
        for p in row.penalties.iter().filter(|p| (p.id as usize) < valid) {
            if p.repeated && rep != 1.0 {
                e.bits[r * words + p.id as usize / 32] |= 1 << (p.id % 32);
            }
            if p.subtract != 0.0 {
                e.pens.push([r as u32, p.id, 1.0f32.to_bits(), p.subtract.to_bits()]);
            }
        }
    }
    e
}

/// Whether a step's encoded penalties fit the scratch of `seqs` rows.
pub fn penalties_fit(pens: usize, seqs: usize) -> bool {
    pens <= seqs * SAMPLE_PENALTIES_PER_SEQ
}

/// Picks the tokens of `rows` rows of the logits at `x` (f32, stride `ld`, ids `< valid`): uploads the
/// rows `e` ([`encode`] with the scratch's `penalty_words`) into the scratch at `base` (laid out by `sc`
/// for at least `rows` rows), applies the penalties to the logits in place, and runs the kernels. The
/// scratch's `out` then holds (token, flag) per row: flag 1 (token −1) where the host must pick.
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
    e: &Encoded,
) -> Result<(), CudaError> {
    if rows == 0 {
        return Ok(());
    }
    if valid == 0 || valid > ld {
        return Err(invalid("sample_rows", format!("valid {valid} of rows of {ld}")));
    }
    let (params, pens, bits, allowed) = (&e.params, &e.pens, &e.bits, &e.allowed);
    let words = sc.penalty_words;
    let bitmap = |b: &Vec<u32>| b.is_empty() || b.len() == rows * words;
    if params.len() != rows * 8 || !penalties_fit(pens.len(), rows) || !bitmap(bits) || !bitmap(allowed) {
        let what = format!(
            "{} parameter words, {} penalties, {} + {} bitmap words",
            params.len(),
            pens.len(),
            bits.len(),
            allowed.len()
        );
        return Err(invalid("sample_rows", format!("{what} for {rows} rows")));
    }
    let cs = s.cu_stream();
    let up = || CudaError::driver("cuMemcpyHtoDAsync");
    // SAFETY: the scratch holds `rows` rows' parts (the plan sized it for the step's maximum), and
    // pageable sources are staged before the calls return.
    unsafe {
        result::memcpy_htod_async(base + sc.params, params.as_slice(), cs).map_err(up())?;
        if !allowed.is_empty() {
            result::memcpy_htod_async(base + sc.penalty_bits, allowed.as_slice(), cs).map_err(up())?;
        }
    }
    let ld_i = ld as i64;
    let v = to_i32("sample_rows", "valid", valid)?;
    let r = to_u32("sample_rows", "rows", rows)?;
    let params_p = base + sc.params;
    if !allowed.is_empty() {
        // The token masks borrow the repetition bitmaps' region: stream order puts the masks' kernel
        // before the repetition bitmaps' upload below.
        let (bp, w) = (base + sc.penalty_bits, to_i32("sample_mask_bits", "words", words)?);
        launch!(k, s, "sample_mask_bits", ((valid as u32).div_ceil(256), r, 1), (256, 1, 1), 0;
            x, ld_i, v, params_p, bp, w)?;
    }
    // SAFETY: as above.
    unsafe {
        if !pens.is_empty() {
            result::memcpy_htod_async(base + sc.penalties, pens.as_slice(), cs).map_err(up())?;
        }
        if !bits.is_empty() {
            result::memcpy_htod_async(base + sc.penalty_bits, bits.as_slice(), cs).map_err(up())?;
        }
        result::memset_d8_async(base + sc.hist_count, 0, sc.zeroed_bytes as usize, cs)
            .map_err(CudaError::driver("cuMemsetD8Async"))?;
    }
    let (partials, cand, cand_count, out) = (base + sc.partials, base + sc.cand, base + sc.cand_count, base + sc.out);
    let (hist_count, hist_mass) = (base + sc.hist_count, base + sc.hist_mass);
    if !bits.is_empty() {
        let (bp, w) = (base + sc.penalty_bits, to_i32("sample_penalize_bits", "words", words)?);
        launch!(k, s, "sample_penalize_bits", ((words as u32).div_ceil(256), r, 1), (256, 1, 1), 0;
            x, ld_i, v, params_p, bp, w)?;
    }
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

/// Copies the logits rows that [`sample_rows`] left to the host (its `out` flags) to `stash`: pinned host
/// memory of `rows` rows of `ld` f32, device-mapped. Other rows copy nothing.
#[allow(clippy::too_many_arguments)]
pub fn stash_host_rows(
    k: &Kernels,
    s: &CudaStream,
    sc: &SamplingScratch,
    base: u64,
    x: u64,
    ld: usize,
    valid: usize,
    rows: usize,
    stash: u64,
) -> Result<(), CudaError> {
    if rows == 0 {
        return Ok(());
    }
    let (ld_i, v, out) = (ld as i64, to_i32("sample_stash", "valid", valid)?, base + sc.out);
    let r = to_u32("sample_stash", "rows", rows)?;
    let b = to_u32("sample_stash", "blocks", sc.blocks)?;
    launch!(k, s, "sample_stash", (b, r, 1), (256, 1, 1), 0; x, ld_i, v, out, stash)
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
        let e = encode(&[greedy, plain, cut, wide_k], 50, 2);
        let params = &e.params;
        assert_eq!(params.len(), 32);
        let modes: Vec<u32> = params.chunks(8).map(|p| p[5]).collect();
        assert_eq!(modes, [0, 1, 2, 1], "top-k at the vocabulary is no cut");
        assert_eq!(f32::from_bits(params[8]), 2.0);
        assert_eq!(f32::from_bits(params[12]), 0.25);
        assert_eq!(params[17], 20);
        assert_eq!(params[25], 0);
        let reps: Vec<f32> = params.chunks(8).map(|p| f32::from_bits(p[6])).collect();
        assert_eq!(reps, [1.0, 1.0, 1.5, 1.0], "the repetition factor of rows with repeated ids");
        // The repeated id 3 is a bit of row 2's bitmap (2 words a row); id 4 a subtrahend entry.
        assert_eq!(e.bits, vec![0, 0, 0, 0, 1 << 3, 0, 0, 0]);
        assert_eq!(e.pens, vec![[2, 4, 1.0f32.to_bits(), 0.5f32.to_bits()]]);
        assert!(encode(&[RowSampling::greedy()], 50, 2).bits.is_empty(), "no bitmap without a repetition penalty");
        assert!(penalties_fit(SAMPLE_PENALTIES_PER_SEQ * 2, 2) && !penalties_fit(SAMPLE_PENALTIES_PER_SEQ + 1, 1));
        assert!(e.allowed.is_empty(), "no token bitmaps without a mask");
    }

    #[test]
    fn masked_rows_encode_their_bitmap_and_a_top_k_within_it() {
        // Row 0 allows ids 1, 4 and 40 (and 63, past `valid`); row 1 has no mask.
        let mask = vec![(1 << 1) | (1 << 4), (1 << 8) | (1 << 31)];
        let masked = RowSampling { temperature: 1.0, top_k: 20, allowed: Some(mask.clone()), ..RowSampling::greedy() };
        let free = RowSampling { temperature: 1.0, top_k: 20, ..RowSampling::greedy() };
        let greedy = RowSampling { allowed: Some(vec![1 << 3]), ..RowSampling::greedy() };
        let e = encode(&[masked, free, greedy], 50, 2);
        assert_eq!(e.allowed, vec![mask[0], mask[1], 0, 0, 1 << 3, 0]);
        let flags: Vec<u32> = e.params.chunks(8).map(|p| p[7]).collect();
        assert_eq!(flags, [1, 0, 1]);
        let top_k: Vec<u32> = e.params.chunks(8).map(|p| p[1]).collect();
        assert_eq!(top_k, [3, 20, 0], "the masked row's top-k is its allowed ids below `valid`");
        let modes: Vec<u32> = e.params.chunks(8).map(|p| p[5]).collect();
        assert_eq!(modes, [2, 2, 0]);
    }
}
