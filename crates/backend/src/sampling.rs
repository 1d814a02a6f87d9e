//! The sampling rule of a step's rows, as every backend applies it: a row's penalties and token mask
//! (structured outputs: the ids a grammar allows, a bitmask per row), then greedy
//! (`temperature == 0`: the [`argmax`]) or a draw with temperature, top-k, top-p and min-p from one
//! uniform number the engine drew from the request's RNG. This is the host reference; a device backend
//! picks the same candidates and draws with the same uniform (its sums run in another order, so a draw
//! that lands within rounding of a boundary may pick the neighbour).
//!
//! Semantics follow vLLM's:
//! - `repetition_penalty` p over the ids a [`Penalty`] marks `repeated`: a positive logit is divided by
//!   p, a negative one multiplied; then each [`Penalty`]'s `subtract` (presence + frequency · count);
//! - top-k keeps the k most likely, top-p the smallest set whose mass reaches p (of the top-k mass),
//!   min-p drops tokens below `min_p · p_max`.
//!
//! Candidates are ordered by logit, descending, ties by lower id; the draw walks them in that order,
//! except without any cut, where every id is a candidate and the draw walks them in id order. Sums over
//! the vocabulary (the softmax's, the top-p prefix, the draw's walk) accumulate in f64: an f32 running
//! sum over 248K ids drifts by ~1e-4, more than one id's share of a flat row.

use crate::argmax;

/// One logit the penalties touch: `id` was in the context (`repeated`: the repetition penalty applies)
/// and/or generated (`subtract` = presence + frequency · count).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Penalty {
    pub id: u32,
    pub repeated: bool,
    pub subtract: f32,
}

/// How one wanted row of a step picks its token.
#[derive(Clone, Debug, PartialEq)]
pub struct RowSampling {
    /// 0 → greedy.
    pub temperature: f32,
    /// 0 → disabled.
    pub top_k: usize,
    /// 1 → disabled.
    pub top_p: f32,
    /// 0 → disabled.
    pub min_p: f32,
    /// The draw, uniform in [0, 1) (unused when greedy).
    pub uniform: f32,
    /// Divides positive (multiplies negative) logits of the `repeated` ids; 1 → none.
    pub repetition_penalty: f32,
    /// Applied in order. An id is `repeated` in at most one entry, and that entry comes before any other
    /// entry of the id (the repetition penalty applies first, then the subtrahends).
    pub penalties: Vec<Penalty>,
    /// The ids this row may pick, as a bitmask: bit `id % 32` of word `id / 32` set when `id` is
    /// allowed ([`mask_words`] of the logits row wide; ids past it are refused). The others' logits
    /// become -inf with the penalties. None: every id.
    pub allowed: Option<Vec<u32>>,
}

impl RowSampling {
    /// The plain greedy pick: no penalty.
    pub fn greedy() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            uniform: 0.0,
            repetition_penalty: 1.0,
            penalties: Vec::new(),
            allowed: None,
        }
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    /// A draw over every valid id with no cut (the draw walks ids in id order).
    pub fn is_plain_draw(&self, valid: usize) -> bool {
        !self.is_greedy() && (self.top_k == 0 || self.top_k >= valid) && self.top_p >= 1.0 && self.min_p <= 0.0
    }

    /// Applies the penalties, then the token mask ([`RowSampling::allowed`]), to `logits` (the row over
    /// the valid ids) in place.
    pub fn apply_penalties(&self, logits: &mut [f32]) {
        for p in &self.penalties {
            let Some(l) = logits.get_mut(p.id as usize) else { continue };
            if p.repeated && self.repetition_penalty != 1.0 {
                *l = if *l > 0.0 { *l / self.repetition_penalty } else { *l * self.repetition_penalty };
            }
            *l -= p.subtract;
        }
        if let Some(bits) = &self.allowed {
            apply_mask(bits, logits);
        }
    }

    /// The token of this row: penalties applied to `logits` (the valid ids only, modified), then the
    /// greedy pick or the draw.
    pub fn pick(&self, logits: &mut [f32]) -> u32 {
        self.apply_penalties(logits);
        self.pick_adjusted(logits)
    }

    /// [`RowSampling::pick`] over logits whose penalties are already applied.
    pub fn pick_adjusted(&self, logits: &[f32]) -> u32 {
        if self.is_greedy() || logits.is_empty() {
            return argmax(logits);
        }
        let (cand, probs) = self.candidates(logits);
        draw(&probs, self.uniform).map_or(cand[0].0, |i| cand[i].0)
    }

    /// Candidates after temperature, top-k, top-p and min-p, with their (unnormalised after the cuts)
    /// probabilities: softmax over the top-k candidates (every id without top-k, summed in id order),
    /// then the top-p prefix, then the min-p floor. Sorted by [`by_logit`], except without any cut,
    /// where every id is a candidate in id order (the same distribution). Not for greedy rows.
    ///
    /// Cost O(vocab) plus a sort of the candidates that can survive the cuts, not a sort of the whole
    /// vocabulary (10–13 ms per draw at the 27B's 248K ids): top-k selects its k first; with top-p or
    /// min-p the largest candidates are selected in growing batches until the cut falls inside one.
    pub fn candidates(&self, logits: &[f32]) -> (Vec<(u32, f32)>, Vec<f32>) {
        let inv_t = 1.0 / self.temperature;
        let mut all: Vec<(u32, f32)> = logits.iter().enumerate().map(|(i, &l)| (i as u32, l * inv_t)).collect();
        let n = all.len();
        let top_k = if self.top_k > 0 { self.top_k.min(n) } else { n };
        let (top_p, min_p) = (self.top_p, self.min_p);
        if top_k < n {
            // The k largest under the order, sorted; the softmax over them.
            largest_first(&mut all, top_k);
            all.truncate(top_k);
            let max = all[0].1;
            let mut probs: Vec<f32> = all.iter().map(|&(_, l)| (l - max).exp()).collect();
            let sum = probs.iter().map(|&p| p as f64).sum::<f64>() as f32;
            probs.iter_mut().for_each(|p| *p /= sum);
            let keep = cut(&probs, top_p, min_p);
            probs.truncate(keep);
            return (all, probs);
        }
        let max = all.iter().fold(f32::NEG_INFINITY, |m, c| m.max(c.1));
        let sum = all.iter().map(|&(_, l)| (l - max).exp() as f64).sum::<f64>() as f32;
        if top_p >= 1.0 && min_p <= 0.0 {
            let probs = all.iter().map(|&(_, l)| (l - max).exp() / sum).collect();
            return (all, probs);
        }
        // Grow the sorted prefix until the top-p / min-p cut falls strictly inside it.
        let mut m = 256.min(n);
        loop {
            largest_first(&mut all, m);
            let probs: Vec<f32> = all[..m].iter().map(|&(_, l)| (l - max).exp() / sum).collect();
            let keep = cut(&probs, top_p, min_p);
            if keep < m || m == n {
                let mut probs = probs;
                probs.truncate(keep);
                all.truncate(m);
                return (all, probs);
            }
            m = (m * 4).min(n);
        }
    }
}

/// The words of a token bitmask over `ids` ids ([`RowSampling::allowed`]).
pub fn mask_words(ids: usize) -> usize {
    ids.div_ceil(32)
}

/// Whether `id` is allowed by the token bitmask `bits` (ids past it are not).
pub fn is_allowed(bits: &[u32], id: u32) -> bool {
    bits.get(id as usize / 32).is_some_and(|w| w >> (id % 32) & 1 == 1)
}

/// Sets the logits of the ids `bits` does not allow to -inf.
pub fn apply_mask(bits: &[u32], logits: &mut [f32]) {
    for (id, l) in logits.iter_mut().enumerate() {
        if !is_allowed(bits, id as u32) {
            *l = f32::NEG_INFINITY;
        }
    }
}

/// How many ids below `valid` the bitmask `bits` allows.
pub fn allowed_count(bits: &[u32], valid: usize) -> usize {
    let full = (valid / 32).min(bits.len());
    let mut n: usize = bits[..full].iter().map(|w| w.count_ones() as usize).sum();
    if let Some(w) = bits.get(full).filter(|_| !valid.is_multiple_of(32)) {
        n += (w & ((1u32 << (valid % 32)) - 1)).count_ones() as usize;
    }
    n
}

/// Writes the bitmask of the finite entries of `row` into `bits` (every word; ids past the row are
/// refused).
pub fn bits_of_row(row: &[f32], bits: &mut [u32]) {
    for (w, word) in bits.iter_mut().enumerate() {
        let ids = row.get(w * 32..).unwrap_or(&[]);
        *word = ids.iter().take(32).enumerate().filter(|(_, l)| l.is_finite()).fold(0, |m, (b, _)| m | 1 << b);
    }
}

/// Rows of a vocabulary at least this wide are picked on several threads ([`pick_rows`]).
pub const PARALLEL_PICK_VOCAB: usize = 32_768;

/// The machine's cores, asked once (the query reads cgroup files; the engine maps rows every step).
fn cores() -> usize {
    static CORES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, |t| t.get()))
}

/// `f` over every item, results in item order: on several threads (contiguous chunks, one per core)
/// when `parallel` and there are several items and cores.
pub fn map_rows<T: Send, R: Send>(items: &mut [T], parallel: bool, f: impl Fn(&mut T) -> R + Sync) -> Vec<R> {
    let threads = if parallel { cores().min(items.len()) } else { 1 };
    if threads <= 1 {
        return items.iter_mut().map(f).collect();
    }
    let per = items.len().div_ceil(threads);
    let f = &f;
    std::thread::scope(|sc| {
        let handles: Vec<_> =
            items.chunks_mut(per).map(|chunk| sc.spawn(move || chunk.iter_mut().map(f).collect::<Vec<R>>())).collect();
        handles.into_iter().flat_map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e))).collect()
    })
}

/// The token of each row of `logits` (`rows.len()` rows of `vocab`, ids `< valid` considered) by its
/// [`RowSampling`]: [`RowSampling::pick`], or [`RowSampling::pick_adjusted`] when the penalties are
/// already applied. Rows of a large vocabulary run on several threads (each row is independent).
pub fn pick_rows(logits: &mut [f32], vocab: usize, valid: usize, rows: &[RowSampling], penalised: bool) -> Vec<u32> {
    if vocab == 0 {
        return Vec::new();
    }
    let n = valid.min(vocab);
    let mut pairs: Vec<(&mut [f32], &RowSampling)> = logits.chunks_exact_mut(vocab).zip(rows).collect();
    map_rows(&mut pairs, vocab >= PARALLEL_PICK_VOCAB, |(row, s)| {
        if penalised { s.pick_adjusted(&row[..n]) } else { s.pick(&mut row[..n]) }
    })
}

/// The index a draw `u` in [0, 1) lands on in non-negative `weights` (walked in order, scaled to their
/// sum); the last positive weight on rounding leftovers; None when no weight is positive.
pub fn draw(weights: &[f32], u: f32) -> Option<usize> {
    let total: f64 = weights.iter().map(|&w| w as f64).sum();
    let mut r = u as f64 * total;
    let mut last = None;
    for (i, &w) in weights.iter().enumerate() {
        let w = w as f64;
        if w > 0.0 {
            if r < w {
                return Some(i);
            }
            r -= w;
            last = Some(i);
        }
    }
    last
}

/// The candidate order: logit descending, ties by lower id.
pub fn by_logit(a: &(u32, f32), b: &(u32, f32)) -> std::cmp::Ordering {
    b.1.total_cmp(&a.1).then(a.0.cmp(&b.0))
}

/// Puts the `m` first candidates under [`by_logit`] at the front of `c`, sorted (the rest unordered).
fn largest_first(c: &mut [(u32, f32)], m: usize) {
    if m == 0 {
        return;
    }
    if m < c.len() {
        c.select_nth_unstable_by(m - 1, by_logit);
    }
    c[..m].sort_by(by_logit);
}

/// How many of the sorted normalised `probs` survive top-p (the shortest prefix whose mass reaches
/// `top_p`) and then min-p (those at least `min_p` times the largest; at least one).
pub fn cut(probs: &[f32], top_p: f32, min_p: f32) -> usize {
    let mut keep = probs.len();
    if top_p < 1.0 {
        let mut acc = 0.0f64;
        keep = probs
            .iter()
            .position(|&p| {
                acc += p as f64;
                acc >= top_p as f64
            })
            .map_or(probs.len(), |i| i + 1);
    }
    if min_p > 0.0 && keep > 0 {
        let floor = min_p * probs[0];
        keep = probs[..keep].iter().take_while(|&&p| p >= floor).count().max(1);
    }
    keep
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(t: f32, k: usize, p: f32, min_p: f32, u: f32) -> RowSampling {
        RowSampling { temperature: t, top_k: k, top_p: p, min_p, uniform: u, ..RowSampling::greedy() }
    }

    #[test]
    fn draws_walk_the_sorted_candidates() {
        let logits = [0.0f32, 3.0, 1.0, 3.0, -2.0];
        // top-k 2: ids 1 and 3 (tie broken by id), equal mass: u < 0.5 → 1, else 3.
        assert_eq!(row(1.0, 2, 1.0, 0.0, 0.49).pick_adjusted(&logits), 1);
        assert_eq!(row(1.0, 2, 1.0, 0.0, 0.51).pick_adjusted(&logits), 3);
        // top-k 1 is greedy whatever the draw.
        assert_eq!(row(1.0, 1, 1.0, 0.0, 0.99).pick_adjusted(&logits), 1);
        // No cut: ids in id order; u near 0 → id 0 (mass e^0 of ~43).
        assert_eq!(row(1.0, 0, 1.0, 0.0, 0.0).pick_adjusted(&logits), 0);
        // min-p 0.5 keeps the two 3.0s only.
        for u in [0.0, 0.3, 0.7, 0.999] {
            assert!([1, 3].contains(&row(1.0, 0, 1.0, 0.5, u).pick_adjusted(&logits)));
        }
    }

    #[test]
    fn penalties_follow_vllm() {
        let mut s = RowSampling { repetition_penalty: 2.0, ..RowSampling::greedy() };
        s.penalties = vec![
            Penalty { id: 0, repeated: true, subtract: 0.0 },
            Penalty { id: 1, repeated: true, subtract: 1.0 },
            Penalty { id: 2, repeated: false, subtract: 0.5 },
            Penalty { id: 9, repeated: true, subtract: 1.0 }, // beyond the row: ignored
        ];
        let mut l = [4.0f32, -1.0, 1.0, 2.0];
        s.apply_penalties(&mut l);
        assert_eq!(l, [2.0, -3.0, 0.5, 2.0]);
        // Greedy after penalties: ids 0 and 3 tie at 2.0 → the lower id.
        let mut l = [4.0f32, -1.0, 1.0, 2.0];
        assert_eq!(s.pick(&mut l), 0);
        // An id's repeated entry, then its subtrahend entry: as one entry with both.
        let split = RowSampling {
            penalties: vec![
                Penalty { id: 1, repeated: true, subtract: 0.0 },
                Penalty { id: 0, repeated: true, subtract: 0.0 },
                Penalty { id: 1, repeated: false, subtract: 1.0 },
            ],
            ..s.clone()
        };
        let (mut a, mut b) = ([4.0f32, -1.0, 1.0, 2.0], [4.0f32, -1.0, 1.0, 2.0]);
        split.apply_penalties(&mut a);
        let one = RowSampling {
            penalties: vec![
                Penalty { id: 0, repeated: true, subtract: 0.0 },
                Penalty { id: 1, repeated: true, subtract: 1.0 },
            ],
            ..s.clone()
        };
        one.apply_penalties(&mut b);
        assert_eq!(a, b);
    }

    #[test]
    fn parallel_rows_pick_as_one_by_one() {
        let vocab = PARALLEL_PICK_VOCAB + 3;
        let mut x = 7u64;
        let base: Vec<f32> = (0..vocab * 5)
            .map(|_| {
                x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                (x >> 40) as f32 / (1u64 << 24) as f32 * 8.0
            })
            .collect();
        let rows: Vec<RowSampling> =
            (0..5).map(|i| row([0.0, 0.7, 1.0, 1.3, 0.9][i], [0, 20, 0, 0, 5][i], 0.9, 0.0, 0.1 * i as f32)).collect();
        let one: Vec<u32> =
            base.chunks_exact(vocab).zip(&rows).map(|(l, r)| r.pick(&mut l[..vocab - 2].to_vec())).collect();
        assert_eq!(pick_rows(&mut base.clone(), vocab, vocab - 2, &rows, false), one);
        assert_eq!(pick_rows(&mut base.clone(), vocab, vocab - 2, &rows, true), one, "no penalties to apply");
    }

    /// A masked row picks among its allowed ids only, greedy or drawn, and the bitmask helpers agree.
    #[test]
    fn the_token_mask_limits_every_pick() {
        let logits = [5.0f32, 1.0, 4.0, 0.5, 3.0, 2.0, 9.0, 0.0, 1.5, 2.5];
        let mut bits = vec![0u32; mask_words(logits.len())];
        let allowed = |l: &[f32]| l.iter().enumerate().map(|(i, _)| [1, 3, 5, 8].contains(&i)).collect::<Vec<_>>();
        let masked: Vec<f32> =
            logits.iter().zip(allowed(&logits)).map(|(&l, a)| if a { l } else { f32::NEG_INFINITY }).collect();
        bits_of_row(&masked, &mut bits);
        assert_eq!(bits, vec![(1 << 1) | (1 << 3) | (1 << 5) | (1 << 8)]);
        assert!(is_allowed(&bits, 5) && !is_allowed(&bits, 6) && !is_allowed(&bits, 40));
        assert_eq!((allowed_count(&bits, 10), allowed_count(&bits, 6), allowed_count(&bits, 64)), (4, 3, 4));
        let greedy = RowSampling { allowed: Some(bits.clone()), ..RowSampling::greedy() };
        assert_eq!(greedy.pick(&mut logits.to_vec()), 5, "the best allowed id, not 6");
        for (k, p) in [(0, 1.0), (3, 1.0), (0, 0.9), (20, 0.5)] {
            for u in [0.0, 0.2, 0.5, 0.8, 0.999] {
                let r = RowSampling { allowed: Some(bits.clone()), ..row(1.0, k, p, 0.0, u) };
                let t = r.pick(&mut logits.to_vec());
                assert!([1, 3, 5, 8].contains(&t), "top-k {k}, top-p {p}, u {u}: {t}");
                // The same as the row whose disallowed logits are -inf.
                assert_eq!(t, row(1.0, k, p, 0.0, u).pick(&mut masked.clone()));
            }
        }
    }

    #[test]
    fn draw_keeps_the_last_positive_weight_on_leftovers() {
        assert_eq!(draw(&[0.0, 1.0, 0.0], 0.999_999_9), Some(1));
        assert_eq!(draw(&[0.0, 0.0], 0.5), None);
        assert_eq!(draw(&[1.0, 1.0, 2.0], 0.5), Some(2));
    }
}
