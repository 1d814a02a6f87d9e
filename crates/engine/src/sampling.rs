//! A request's next-token selection: its parameters, its seeded RNG and its generated-token counts,
//! turned each step into a [`RowSampling`] (the penalties as per-id entries, one uniform draw) that the
//! backend applies where the logits are ([`deltaserve_backend::sampling`] holds the rule). Semantics
//! follow vLLM's:
//! - `repetition_penalty` p over prompt + generated tokens: a positive logit is divided by p, a negative one multiplied;
//! - `presence_penalty` / `frequency_penalty` over generated tokens: `logit −= presence·[count>0] + frequency·count`;
//! - top-k keeps the k most likely, top-p the smallest set whose mass reaches p, min-p drops tokens below `min_p · p_max`;
//! - `logit_bias` adds its value to its id's logit (after the penalties; -100 all but bans it);
//! - `min_tokens`: the request's stop ids cannot be picked before that many tokens are generated.
//!
//! Ids at or beyond `valid_vocab` (padding rows of the embedding) are never chosen.

use std::collections::HashMap;

use deltaserve_backend::sampling::{Penalty, RowSampling};
use rand::rngs::Xoshiro256PlusPlus;
use rand::{RngExt, SeedableRng};

/// User-facing sampling parameters, validated by [`SamplingParams::validate`].
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct SamplingParams {
    /// 0 → greedy.
    pub temperature: f32,
    /// 0 → disabled.
    pub top_k: usize,
    /// 1 → disabled.
    pub top_p: f32,
    /// 0 → disabled.
    pub min_p: f32,
    /// 1 → disabled.
    pub repetition_penalty: f32,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    /// Seed of this request's RNG (None: drawn from the OS).
    pub seed: Option<u64>,
    /// Added to the logits of these ids (id, bias in [-100, 100]); each id once.
    pub logit_bias: Vec<(u32, f32)>,
    /// The stop ids ([`Sampler::banning_stops`]) are not picked before this many tokens are generated.
    pub min_tokens: usize,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: None,
            logit_bias: Vec::new(),
            min_tokens: 0,
        }
    }
}

impl SamplingParams {
    pub fn greedy() -> Self {
        Self { temperature: 0.0, ..Self::default() }
    }

    /// Checks ranges; the error names the parameter, the allowed range and the value given.
    pub fn validate(&self) -> Result<(), String> {
        let check = |ok: bool, name: &str, range: &str, v: f32| {
            if ok { Ok(()) } else { Err(format!("`{name}` must be {range}, got {v}")) }
        };
        check(self.temperature.is_finite() && self.temperature >= 0.0, "temperature", ">= 0", self.temperature)?;
        check(self.top_p > 0.0 && self.top_p <= 1.0, "top_p", "in (0, 1]", self.top_p)?;
        check((0.0..=1.0).contains(&self.min_p), "min_p", "in [0, 1]", self.min_p)?;
        check(
            self.repetition_penalty.is_finite() && self.repetition_penalty > 0.0,
            "repetition_penalty",
            "> 0",
            self.repetition_penalty,
        )?;
        check((-2.0..=2.0).contains(&self.presence_penalty), "presence_penalty", "in [-2, 2]", self.presence_penalty)?;
        check(
            (-2.0..=2.0).contains(&self.frequency_penalty),
            "frequency_penalty",
            "in [-2, 2]",
            self.frequency_penalty,
        )?;
        let mut ids = std::collections::HashSet::new();
        for &(id, b) in &self.logit_bias {
            check((-100.0..=100.0).contains(&b), "logit_bias", "in [-100, 100]", b)?;
            if !ids.insert(id) {
                return Err(format!("`logit_bias` names token {id} twice"));
            }
        }
        Ok(())
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }
}

/// A request's sampler: its parameters, its RNG, the counts of generated tokens and, with a repetition
/// penalty, the context's distinct ids (kept up to date as the context grows: a step does not rescan it).
pub struct Sampler {
    params: SamplingParams,
    rng: Xoshiro256PlusPlus,
    valid_vocab: usize,
    /// Generated ids with their counts, in order of first appearance (`generated_at`: id → position).
    generated: Vec<(u32, u32)>,
    generated_at: HashMap<u32, usize>,
    /// The repetition penalty's ids: those of the first `folded` context tokens, each once, in order of
    /// first appearance (`seen` marks them).
    repeated: Vec<u32>,
    seen: Vec<bool>,
    folded: usize,
    /// The last folded token (a context that no longer ends the folded prefix with it is folded anew).
    folded_last: Option<u32>,
    /// A draw given back ([`Sampler::unread`]), taken by the next row.
    unread: Option<f32>,
    /// Tokens generated so far, and the ids banned until there are `min_tokens` of them.
    produced: usize,
    banned: Vec<u32>,
}

impl Sampler {
    /// `valid_vocab`: ids >= this are padding and never sampled.
    pub fn new(params: SamplingParams, valid_vocab: usize) -> Self {
        let seed = params.seed.unwrap_or_else(rand::random);
        Self {
            rng: Xoshiro256PlusPlus::seed_from_u64(seed),
            params,
            valid_vocab,
            generated: Vec::new(),
            generated_at: HashMap::new(),
            repeated: Vec::new(),
            seen: Vec::new(),
            folded: 0,
            folded_last: None,
            unread: None,
            produced: 0,
            banned: Vec::new(),
        }
    }

    /// Bans `stop_ids` (the request's end-of-sequence and stop ids) until `min_tokens` tokens are
    /// generated: their logits are -inf in every row before then.
    pub fn banning_stops(mut self, stop_ids: &[u32]) -> Self {
        if self.params.min_tokens > 0 {
            self.banned = stop_ids.iter().copied().filter(|&id| (id as usize) < self.valid_vocab).collect();
            self.banned.sort_unstable();
            self.banned.dedup();
        }
        self
    }

    /// Whether the stop ids are still banned (fewer than `min_tokens` tokens generated).
    fn banning(&self) -> bool {
        !self.banned.is_empty() && self.produced < self.params.min_tokens
    }

    /// Whether fewer than `min_tokens` tokens have been generated: stop strings do not end the reply yet.
    pub fn below_min_tokens(&self) -> bool {
        self.produced < self.params.min_tokens
    }

    /// Folds the context tokens not folded yet into the repetition penalty's ids (no-op without one).
    fn fold(&mut self, context: &[u32]) {
        if self.params.repetition_penalty == 1.0 {
            return;
        }
        let same_prefix =
            context.len() >= self.folded && self.folded.checked_sub(1).map(|i| context[i]) == self.folded_last;
        if !same_prefix {
            self.repeated.clear();
            self.seen.clear();
            self.folded = 0;
        }
        if self.seen.is_empty() {
            self.seen = vec![false; self.valid_vocab];
        }
        for &id in &context[self.folded..] {
            if let Some(s) = self.seen.get_mut(id as usize)
                && !*s
            {
                *s = true;
                self.repeated.push(id);
            }
        }
        self.folded = context.len();
        self.folded_last = context.last().copied();
    }

    /// Whether a row's rule does not depend on the context (no penalties, no stop ids banned by
    /// `min_tokens` yet): the next step's row can be made before this step's pick is known.
    pub fn context_free(&self) -> bool {
        let p = &self.params;
        p.repetition_penalty == 1.0 && p.presence_penalty == 0.0 && p.frequency_penalty == 0.0 && !self.banning()
    }

    /// Gives back the draw of a `row` that was not used (its step did not run): the next row draws it
    /// again, so a request's draws follow its steps.
    pub fn unread(&mut self, row: &RowSampling) {
        if !row.is_greedy() {
            self.unread = Some(row.uniform);
        }
    }

    /// Records a generated token (for presence/frequency penalties).
    pub fn observe(&mut self, id: u32) {
        self.produced += 1;
        let at = *self.generated_at.entry(id).or_insert(self.generated.len());
        match self.generated.get_mut(at) {
            Some(g) => g.1 += 1,
            None => self.generated.push((id, 1)),
        }
    }

    /// Picks the next token from `logits` ([vocab], modified in place). `context` is the prompt plus
    /// everything generated so far (for the repetition penalty).
    pub fn sample(&mut self, logits: &mut [f32], context: &[u32]) -> u32 {
        let n = self.valid_vocab.min(logits.len());
        self.row(context).pick(&mut logits[..n])
    }

    /// This step's [`RowSampling`]: the parameters, the penalties over `context` (prompt plus everything
    /// generated so far) and the generated counts, and one uniform draw from the RNG (sampling requests).
    pub fn row(&mut self, context: &[u32]) -> RowSampling {
        self.fold(context);
        let mut row = self.row_without_draw();
        if !row.is_greedy() {
            row.uniform = self.unread.take().unwrap_or_else(|| self.rng.random::<f32>());
        }
        row
    }

    /// The row over the folded context ([`Sampler::fold`]), without a draw.
    fn row_without_draw(&self) -> RowSampling {
        let p = &self.params;
        RowSampling {
            temperature: p.temperature,
            top_k: p.top_k,
            top_p: p.top_p,
            min_p: p.min_p,
            uniform: 0.0,
            repetition_penalty: p.repetition_penalty,
            penalties: self.penalties(),
            allowed: None,
        }
    }

    /// The penalties: the folded context's ids (with a repetition penalty), then one subtrahend per id:
    /// the generated ones' (with presence / frequency penalties), minus the logit bias, +inf for a banned
    /// stop id. An id may have one entry of each kind; the repeated ones come first, as
    /// [`RowSampling::apply_penalties`] wants (and the device applies the subtrahends in parallel). Without
    /// a bias or a ban, no lookups: a step copies two lists.
    fn penalties(&self) -> Vec<Penalty> {
        let p = &self.params;
        let mut out = Vec::new();
        if p.repetition_penalty != 1.0 {
            out.extend(self.repeated.iter().map(|&id| Penalty { id, repeated: true, subtract: 0.0 }));
        }
        let first_sub = out.len();
        if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
            let sub = |c: u32| p.presence_penalty + p.frequency_penalty * c as f32;
            out.extend(
                self.generated.iter().filter(|&&(id, _)| (id as usize) < self.valid_vocab).map(|&(id, c)| Penalty {
                    id,
                    repeated: false,
                    subtract: sub(c),
                }),
            );
        }
        let banned = if self.banning() { &self.banned[..] } else { &[] };
        if p.logit_bias.is_empty() && banned.is_empty() {
            return out;
        }
        let mut at: HashMap<u32, usize> =
            out[first_sub..].iter().enumerate().map(|(i, e)| (e.id, first_sub + i)).collect();
        let extra = p.logit_bias.iter().map(|&(id, b)| (id, -b)).chain(banned.iter().map(|&id| (id, f32::INFINITY)));
        for (id, sub) in extra.filter(|&(id, _)| (id as usize) < self.valid_vocab) {
            match at.get(&id) {
                Some(&i) => out[i].subtract += sub,
                None => {
                    at.insert(id, out.len());
                    out.push(Penalty { id, repeated: false, subtract: sub });
                }
            }
        }
        out
    }

    /// The distribution [`Sampler::sample`] draws from (non-greedy parameters), dense over the valid
    /// ids: penalties, temperature, top-k, top-p and min-p applied, normalised. `logits` is modified.
    pub fn distribution(&mut self, logits: &mut [f32], context: &[u32]) -> Vec<f32> {
        let n = self.valid_vocab.min(logits.len());
        let logits = &mut logits[..n];
        self.fold(context);
        let row = self.row_without_draw();
        row.apply_penalties(logits);
        let mut dense = vec![0.0f32; n];
        if row.is_greedy() {
            dense[argmax(logits) as usize] = 1.0;
            return dense;
        }
        let (cand, probs) = row.candidates(logits);
        let total: f32 = probs.iter().sum();
        for (&(id, _), p) in cand.iter().zip(&probs) {
            dense[id as usize] = p / total;
        }
        dense
    }

    /// The vocabulary bound of this request's drafts when they are plain argmaxes (greedy requests: the
    /// backend may pick them where the logits are), else 0 (drafts are drawn: [`Sampler::draft`]).
    pub fn greedy_draft_vocab(&self) -> usize {
        if self.params.is_greedy() { self.valid_vocab } else { 0 }
    }

    /// A speculative draft from the draft head's logits `row`: greedy requests take the argmax (no
    /// penalties: a draft is only a guess); sampling requests draw from `softmax(row / temperature)` over
    /// the valid ids and also get that distribution back (the `q` of rejection sampling).
    pub fn draft(&mut self, row: &[f32]) -> (u32, Option<Vec<f32>>) {
        let row = &row[..self.valid_vocab.min(row.len())];
        if self.params.is_greedy() {
            return (argmax(row), None);
        }
        let inv_t = 1.0 / self.params.temperature;
        let max = row.iter().fold(f32::NEG_INFINITY, |m, &l| m.max(l * inv_t));
        let mut q: Vec<f32> = row.iter().map(|&l| (l * inv_t - max).exp()).collect();
        let sum: f32 = q.iter().sum();
        q.iter_mut().for_each(|x| *x /= sum);
        let token = self.draw(&q);
        (token, Some(q))
    }

    /// A draw from unnormalised non-negative `weights` (the last positive id on rounding leftovers).
    pub fn draw(&mut self, weights: &[f32]) -> u32 {
        let u = self.rng.random::<f32>();
        deltaserve_backend::sampling::draw(weights, u).unwrap_or(0) as u32
    }

    /// A uniform draw in [0, 1) from this request's RNG.
    pub fn uniform(&mut self) -> f32 {
        self.rng.random::<f32>()
    }

    /// Whether this request decodes greedily.
    pub fn is_greedy(&self) -> bool {
        self.params.is_greedy()
    }

    /// Whether [`Sampler::sample`] is the plain argmax of the row (greedy, no penalty or bias to apply).
    pub fn picks_argmax(&self) -> bool {
        self.params.is_greedy() && self.context_free() && self.params.logit_bias.is_empty()
    }
}

/// One rejection-sampling decision of speculative decoding: draft `d` was drawn from `q`; accept it
/// with probability `min(1, p(d)/q(d))`, else draw from the residual `max(0, p − q)` (normalised).
/// The result is distributed exactly as `p` (Leviathan et al., 2023). Returns (token, accepted).
pub fn speculative_pick(sampler: &mut Sampler, p: &[f32], q: &[f32], d: u32) -> (u32, bool) {
    let pd = p.get(d as usize).copied().unwrap_or(0.0);
    let qd = q.get(d as usize).copied().unwrap_or(0.0);
    if sampler.uniform() * qd < pd {
        return (d, true);
    }
    let residual: Vec<f32> =
        p.iter().enumerate().map(|(i, &a)| (a - q.get(i).copied().unwrap_or(0.0)).max(0.0)).collect();
    let t = if residual.iter().any(|&r| r > 0.0) { sampler.draw(&residual) } else { sampler.draw(p) };
    (t, false)
}

pub use deltaserve_backend::argmax;

#[cfg(test)]
mod tests {
    use super::*;
    use deltaserve_backend::sampling::cut;

    fn sampler(p: SamplingParams) -> Sampler {
        Sampler::new(SamplingParams { seed: Some(7), ..p }, 8)
    }

    #[test]
    fn greedy_takes_argmax_and_skips_padding() {
        let mut s = sampler(SamplingParams::greedy());
        let mut logits = vec![0.0, 3.0, 1.0, 2.0, 0.0, 0.0, 0.0, 0.0, 9.0, 9.0];
        assert_eq!(s.sample(&mut logits, &[]), 1);
    }

    #[test]
    fn repetition_penalty_demotes_seen_tokens() {
        let mut s = sampler(SamplingParams { repetition_penalty: 4.0, ..SamplingParams::greedy() });
        let mut logits = vec![0.0, 3.0, 1.0, 2.0, 0.0, 0.0, 0.0, 0.0];
        assert_eq!(s.sample(&mut logits, &[1]), 3);
        assert_eq!(logits[1], 0.75);
    }

    #[test]
    fn repeated_ids_fold_as_the_context_grows_and_refold_when_it_changes() {
        let params = SamplingParams { repetition_penalty: 1.5, ..SamplingParams::greedy() };
        let ids = |r: &RowSampling| r.penalties.iter().filter(|p| p.repeated).map(|p| p.id).collect::<Vec<_>>();
        let mut s = Sampler::new(params.clone(), 8);
        assert_eq!(ids(&s.row(&[3, 1, 3])), [3, 1]);
        assert_eq!(ids(&s.row(&[3, 1, 3, 5, 1])), [3, 1, 5], "only the new tokens are folded");
        assert_eq!(ids(&s.row(&[2, 2])), [2], "a shorter context starts over");
        assert_eq!(ids(&s.row(&[2, 4, 6])), [2, 4, 6], "a context whose folded prefix changed starts over");
        // The same as a sampler that sees the last context first.
        let mut fresh = Sampler::new(params, 8);
        assert_eq!(ids(&fresh.row(&[2, 4, 6])), [2, 4, 6]);
    }

    #[test]
    fn logit_bias_adds_to_the_logits_with_one_entry_per_id() {
        let params = SamplingParams {
            frequency_penalty: 1.0,
            logit_bias: vec![(1, -100.0), (2, 5.0), (9, 50.0)],
            ..SamplingParams::greedy()
        };
        let mut s = sampler(params);
        assert!(!s.picks_argmax(), "a biased greedy row is not the plain argmax");
        s.observe(2);
        let row = s.row(&[2]);
        // Token 2 has its frequency penalty and its bias in one entry (the device applies entries in
        // parallel); id 9 is padding and is dropped.
        let mut subs: Vec<(u32, f32)> = row.penalties.iter().map(|p| (p.id, p.subtract)).collect();
        subs.sort_by_key(|e| e.0);
        assert_eq!(subs, [(1, 100.0), (2, 1.0 - 5.0)]);
        let mut logits = vec![0.0, 9.0, 1.0, 2.0, 0.0, 0.0, 0.0, 0.0];
        assert_eq!(s.sample(&mut logits, &[2]), 2, "the bias lifts 2 over 3 and bans 1");
        assert_eq!(logits[1], -91.0);
        let bad = SamplingParams { logit_bias: vec![(3, 101.0)], ..SamplingParams::greedy() };
        assert!(bad.validate().unwrap_err().contains("logit_bias"));
        let twice = SamplingParams { logit_bias: vec![(3, 1.0), (3, 2.0)], ..SamplingParams::greedy() };
        assert!(twice.validate().unwrap_err().contains("twice"));
    }

    #[test]
    fn min_tokens_bans_the_stop_ids_until_enough_tokens_are_out() {
        let params = SamplingParams { min_tokens: 2, presence_penalty: 2.0, ..SamplingParams::greedy() };
        let mut s = Sampler::new(params, 8).banning_stops(&[0, 7, 99]);
        let logits = vec![9.0, 1.0, 2.0, 0.0, 0.0, 0.0, 0.0, 8.0];
        assert!(!s.context_free(), "the next row depends on how many tokens are out");
        assert_eq!(s.sample(&mut logits.clone(), &[]), 2, "neither stop id while none is out");
        s.observe(2);
        assert!(s.below_min_tokens());
        let banned = |s: &mut Sampler| s.row(&[]).penalties.iter().filter(|p| p.subtract.is_infinite()).count();
        assert_eq!(banned(&mut s), 2, "ids past the vocabulary are not banned");
        assert_eq!(s.sample(&mut logits.clone(), &[]), 1, "the presence penalty demotes 2, the stop ids stay banned");
        s.observe(1);
        assert!(!s.below_min_tokens() && banned(&mut s) == 0);
        assert_eq!(s.sample(&mut logits.clone(), &[]), 0, "the end of sequence is allowed from then on");
        // Without min_tokens the stop ids are never banned, and the sampler stays context-free.
        let plain = Sampler::new(SamplingParams::greedy(), 8).banning_stops(&[0]);
        assert!(plain.context_free() && plain.picks_argmax());
    }

    #[test]
    fn presence_and_frequency_penalties_use_generated_counts() {
        let mut s =
            sampler(SamplingParams { presence_penalty: 0.5, frequency_penalty: 1.0, ..SamplingParams::greedy() });
        s.observe(1);
        s.observe(1);
        let mut logits = vec![0.0, 3.0, 1.0, 0.6, 0.0, 0.0, 0.0, 0.0];
        assert_eq!(s.sample(&mut logits, &[1, 1]), 2);
        assert_eq!(logits[1], 3.0 - 0.5 - 2.0);
    }

    #[test]
    fn top_k_one_is_greedy_and_seed_reproduces() {
        let logits = vec![0.1, 0.5, 0.2, 0.4, 0.3, 0.0, 0.0, 0.0];
        let mut s = sampler(SamplingParams { temperature: 1.0, top_k: 1, ..Default::default() });
        assert_eq!(s.sample(&mut logits.clone(), &[]), 1);
        let draw = |seed| {
            let mut s = Sampler::new(SamplingParams { seed: Some(seed), ..Default::default() }, 8);
            (0..32).map(|_| s.sample(&mut logits.clone(), &[])).collect::<Vec<_>>()
        };
        assert_eq!(draw(3), draw(3));
        assert_ne!(draw(3), draw(4));
    }

    #[test]
    fn top_p_and_min_p_cut_the_tail() {
        // probabilities ∝ e^l: token 0 dominates.
        let logits = vec![10.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0];
        for p in
            [SamplingParams { top_p: 0.5, ..Default::default() }, SamplingParams { min_p: 0.01, ..Default::default() }]
        {
            let mut s = sampler(p);
            assert!((0..200).all(|_| s.sample(&mut logits.clone(), &[]) == 0));
        }
        // without cuts, the tail is sometimes drawn at high temperature
        let mut s = sampler(SamplingParams { temperature: 20.0, ..Default::default() });
        assert!((0..200).any(|_| s.sample(&mut logits.clone(), &[]) != 0));
    }

    #[test]
    fn sampling_frequencies_follow_the_softmax() {
        let logits = vec![
            2.0f32.ln(),
            1.0f32.ln(),
            1.0f32.ln(),
            f32::NEG_INFINITY,
            f32::NEG_INFINITY,
            f32::NEG_INFINITY,
            f32::NEG_INFINITY,
            f32::NEG_INFINITY,
        ];
        let mut s = sampler(SamplingParams::default());
        let n = 20_000;
        let zeros = (0..n).filter(|_| s.sample(&mut logits.clone(), &[]) == 0).count();
        let frac = zeros as f64 / n as f64;
        assert!((frac - 0.5).abs() < 0.02, "P(0) = {frac}, expected 0.5");
    }

    /// Pearson's chi-square of `counts` against probabilities `p` (cells with p > 0).
    fn chi_square(counts: &[u64], p: &[f32]) -> f64 {
        let n: u64 = counts.iter().sum();
        counts
            .iter()
            .zip(p)
            .filter(|(_, p)| **p > 0.0)
            .map(|(&c, &p)| {
                let e = n as f64 * p as f64;
                (c as f64 - e).powi(2) / e
            })
            .sum()
    }

    #[test]
    fn rejection_sampling_preserves_the_target_distribution() {
        // Small vocabulary; p and q overlap partly, q has mass where p has none and vice versa.
        let p = [0.40f32, 0.25, 0.20, 0.10, 0.05, 0.0];
        let q = [0.05f32, 0.10, 0.30, 0.05, 0.20, 0.30];
        let mut s = Sampler::new(SamplingParams { seed: Some(12345), ..Default::default() }, 6);
        let n = 200_000;
        let mut counts = [0u64; 6];
        let mut accepted = 0;
        for _ in 0..n {
            let d = s.draw(&q);
            let (t, acc) = speculative_pick(&mut s, &p, &q, d);
            counts[t as usize] += 1;
            accepted += usize::from(acc);
        }
        // 4 degrees of freedom (5 cells with p > 0): the 0.999 quantile is 18.47. Seeded: deterministic.
        let chi = chi_square(&counts, &p);
        assert!(chi < 18.47, "chi-square {chi:.2} over {counts:?}");
        assert_eq!(counts[5], 0, "a token the target excludes is never emitted");
        // Acceptance probability is Σ min(p, q) = 0.05 + 0.10 + 0.20 + 0.05 + 0.05 = 0.45.
        let rate = accepted as f64 / n as f64;
        assert!((rate - 0.45).abs() < 0.01, "acceptance {rate}");
        // Identical p and q: every draft is accepted.
        let mut all = 0;
        for _ in 0..1000 {
            let d = s.draw(&p);
            all += usize::from(speculative_pick(&mut s, &p, &p, d).1);
        }
        assert_eq!(all, 1000);
    }

    #[test]
    fn distribution_is_what_sample_draws_from() {
        let params = SamplingParams { temperature: 0.7, top_k: 5, top_p: 0.9, seed: Some(3), ..Default::default() };
        let logits = [1.0f32, 0.5, 2.0, -1.0, 0.0, 1.5, 0.2, -0.3];
        let mut s = Sampler::new(params.clone(), 8);
        let p = s.distribution(&mut logits.clone(), &[]);
        assert!((p.iter().sum::<f32>() - 1.0).abs() < 1e-5);
        let mut s = Sampler::new(params, 8);
        let n = 100_000;
        let mut counts = [0u64; 8];
        for _ in 0..n {
            counts[s.sample(&mut logits.clone(), &[]) as usize] += 1;
        }
        for (i, (&c, &pi)) in counts.iter().zip(&p).enumerate() {
            if pi == 0.0 {
                assert_eq!(c, 0, "token {i} is outside the cuts");
            }
        }
        let chi = chi_square(&counts, &p);
        assert!(chi < 20.5, "chi-square {chi:.2}"); // ≤ 4 dof at 0.9995
    }

    #[test]
    fn validate_names_the_parameter() {
        let e = SamplingParams { top_p: 0.0, ..Default::default() }.validate().unwrap_err();
        assert!(e.contains("top_p"), "{e}");
        assert!(SamplingParams { temperature: -1.0, ..Default::default() }.validate().is_err());
        assert!(SamplingParams::default().validate().is_ok());
    }

    /// The candidate rule by its definition: sort every id, then top-k, softmax, top-p, min-p (the
    /// softmax of every id summed in id order, as `candidates` does; without any cut, id order).
    fn reference(p: &SamplingParams, logits: &[f32]) -> (Vec<u32>, Vec<f32>) {
        let scaled: Vec<(u32, f32)> = logits.iter().enumerate().map(|(i, &l)| (i as u32, l / p.temperature)).collect();
        let mut cand = scaled.clone();
        cand.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        let max = cand[0].1;
        let whole = p.top_k == 0 || p.top_k >= cand.len();
        if !whole {
            cand.truncate(p.top_k);
        }
        let sum =
            if whole { scaled.iter() } else { cand.iter() }.map(|&(_, l)| (l - max).exp() as f64).sum::<f64>() as f32;
        if whole && p.top_p >= 1.0 && p.min_p <= 0.0 {
            return (
                scaled.iter().map(|c| c.0).collect(),
                scaled.iter().map(|&(_, l)| (l - max).exp() / sum).collect(),
            );
        }
        let probs: Vec<f32> = cand.iter().map(|&(_, l)| (l - max).exp() / sum).collect();
        let keep = cut(&probs, p.top_p, p.min_p);
        (cand[..keep].iter().map(|c| c.0).collect(), probs[..keep].to_vec())
    }

    #[test]
    fn candidates_equal_the_full_sort() {
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(3);
        for case in 0..300 {
            let n = [2usize, 7, 300, 5000][case % 4];
            // Peaked and flat rows, with ties (values on a coarse grid).
            let scale = [0.5f32, 4.0, 12.0][case % 3];
            let logits: Vec<f32> = (0..n).map(|_| (rng.random::<f32>() * scale * 8.0).round() / 8.0).collect();
            let params = SamplingParams {
                temperature: [0.3f32, 0.7, 1.0, 1.5][case % 4],
                top_k: [0usize, 1, 20, 50, 10_000][(case / 3) % 5],
                top_p: [1.0f32, 0.95, 0.8, 0.3][(case / 5) % 4],
                min_p: [0.0f32, 0.05, 0.2][(case / 20) % 3],
                ..Default::default()
            };
            let s = Sampler::new(params.clone(), n);
            let (cand, probs) = s.row_without_draw().candidates(&logits);
            let got: Vec<u32> = cand[..probs.len()].iter().map(|c| c.0).collect();
            let (want, want_p) = reference(&params, &logits);
            assert_eq!(got, want, "case {case}: {params:?}, n {n}");
            for (a, b) in probs.iter().zip(&want_p) {
                assert!((a - b).abs() <= 1e-5 * b.max(1e-3), "case {case}: prob {a} vs {b}");
            }
        }
    }

    /// `cargo test --release -p deltaserve-engine sampling_cost -- --ignored --nocapture`: one sampling
    /// draw over the 27B's 248,320 ids, against the full sort it replaced.
    #[test]
    #[ignore]
    fn sampling_cost() {
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(1);
        // Peaked like a language model's: normal(0, 2.5) (sum of uniforms), a few ids far above.
        let mut logits: Vec<f32> =
            (0..248_320).map(|_| (0..12).map(|_| rng.random::<f32>()).sum::<f32>() * 2.5 - 15.0).collect();
        for i in 0..8 {
            logits[i * 31_000] = 14.0 - i as f32;
        }
        let qwen = SamplingParams { temperature: 0.6, top_k: 20, top_p: 0.95, seed: Some(1), ..Default::default() };
        let top_p = SamplingParams { temperature: 0.7, top_p: 0.8, seed: Some(1), ..Default::default() };
        let plain = SamplingParams { temperature: 1.0, seed: Some(1), ..Default::default() };
        for (name, p) in [
            ("temperature 0.6, top_k 20, top_p 0.95", qwen),
            ("temperature 0.7, top_p 0.8", top_p),
            ("temperature 1", plain),
        ] {
            let mut s = Sampler::new(p.clone(), logits.len());
            let t0 = std::time::Instant::now();
            for _ in 0..20 {
                let mut row = logits.clone();
                s.sample(&mut row, &[]);
            }
            let ours = t0.elapsed().as_secs_f64() / 20.0 * 1e3;
            let t0 = std::time::Instant::now();
            for _ in 0..5 {
                std::hint::black_box(reference(&p, &logits));
            }
            let full = t0.elapsed().as_secs_f64() / 5.0 * 1e3;
            println!("{name}: {ours:.2} ms per draw (full sort: {full:.2} ms)");
        }
    }
}
