//! A step's rows: their sampling rules as the backend takes them, sampling the rows that come back on
//! the engine thread (each with its sequence's sampler, context and constraint, on several threads for
//! a large vocabulary), and the log-probabilities a request asked for.

use std::collections::HashMap;

use deltaserve_backend::sampling::{PARALLEL_PICK_VOCAB, apply_mask, map_rows, mask_words};
use deltaserve_backend::{RowSampling, SeqChunk};
use deltaserve_sched::SeqId;

use super::{Live, SharedConstraint, TokenLogprob, Worker, masks};
use crate::sampling::Sampler;

/// A sampled token and, when logprobs were asked, the raw logits row it came from.
pub(super) type Sampled = (u32, Option<Vec<f32>>);

/// One row to sample: its sequence's sampler and context.
pub(super) struct SampleTask<'a> {
    pub(super) id: SeqId,
    pub(super) sampler: &'a mut Sampler,
    pub(super) logprobs: bool,
    pub(super) context: &'a [u32],
    pub(super) row: &'a mut [f32],
    pub(super) constraint: Option<&'a SharedConstraint>,
    /// The constraint's bitmask for this row, when it was computed already.
    pub(super) mask: Option<Vec<u32>>,
}

impl SampleTask<'_> {
    fn run(&mut self) -> (SeqId, Sampled) {
        let raw = self.logprobs.then(|| self.row.to_vec());
        match (self.mask.take(), self.constraint) {
            (Some(bits), Some(_)) => apply_mask(&bits, self.row),
            (_, Some(c)) => c.with(|c| c.mask(self.row)),
            _ => {}
        }
        (self.id, (self.sampler.sample(self.row, self.context), raw))
    }
}

/// Runs every task: on several threads when there are several rows of a large vocabulary (each task
/// owns its sampler and row, so the results are those of one pass in order).
pub(super) fn run_all(tasks: &mut [SampleTask<'_>]) -> Vec<(SeqId, Sampled)> {
    let vocab = tasks.first().map_or(0, |t| t.row.len());
    map_rows(tasks, vocab >= PARALLEL_PICK_VOCAB, SampleTask::run)
}

impl Worker {
    /// The sampling rule of each wanted row of `seqs` (one uniform draw from each sampling request's
    /// RNG; a constrained request's token mask from where its reply stands). `context`: penalties over
    /// each sequence's tokens (false: the rows of context-free requests, planned before their last pick
    /// is known).
    pub(super) fn sampling_rows(&mut self, seqs: &[SeqChunk], context: bool) -> Vec<RowSampling> {
        self.sampling_rows_where(seqs, context, &vec![true; seqs.len()])
    }

    /// [`Worker::sampling_rows`] where only the chunks `runs` marks run: the others' rows are plain
    /// greedy rows (no draw, no mask).
    pub(super) fn sampling_rows_where(&mut self, seqs: &[SeqChunk], context: bool, runs: &[bool]) -> Vec<RowSampling> {
        let wanted = || seqs.iter().zip(runs).filter(|(c, _)| c.want_logits);
        let mut rows: Vec<RowSampling> = wanted()
            .map(|(c, &runs)| {
                let tokens = if context { self.sched.tokens(c.seq_id).unwrap_or(&[]) } else { &[] };
                let live = self.reqs.get_mut(&c.seq_id).filter(|_| runs);
                live.map_or_else(RowSampling::greedy, |l| l.sampler.row(tokens))
            })
            .collect();
        // The constrained rows' bitmasks (on several threads when there are several).
        let (mut at, mut constraints) = (Vec::new(), Vec::new());
        for (i, (c, _)) in wanted().enumerate().filter(|(_, (_, r))| **r) {
            if let Some(k) = self.reqs.get(&c.seq_id).and_then(|l| l.req.constraint.as_ref()) {
                at.push(i);
                constraints.push(k);
            }
        }
        for (i, bits) in at.into_iter().zip(masks::bitmasks(&mut constraints, mask_words(self.vocab))) {
            rows[i].allowed = Some(bits);
        }
        rows
    }

    /// Samples the next token of each sequence from its logits row: (token, raw row when logprobs were
    /// asked) by sequence. Every sequence has its own sampler and RNG, so the rows are independent: with
    /// several rows of a large vocabulary they are sampled on several threads (the same tokens as one by
    /// one; a draw over 248K ids costs ~1 ms). A constrained row takes its bitmask from `masks` when it
    /// is there (computed while the step ran), else its constraint masks it.
    pub(super) fn sample_rows(
        &mut self,
        rows: Vec<(SeqId, &mut [f32])>,
        masks: &mut HashMap<SeqId, Vec<u32>>,
    ) -> HashMap<SeqId, Sampled> {
        let sched = &self.sched;
        let mut lives: HashMap<SeqId, &mut Live> = self.reqs.iter_mut().map(|(id, l)| (*id, l)).collect();
        let mut tasks: Vec<SampleTask<'_>> = Vec::with_capacity(rows.len());
        for (id, row) in rows {
            if let Some(live) = lives.remove(&id) {
                let logprobs = live.req.logprobs.is_some();
                tasks.push(SampleTask {
                    id,
                    sampler: &mut live.sampler,
                    logprobs,
                    context: sched.tokens(id).unwrap_or(&[]),
                    row,
                    constraint: live.req.constraint.as_ref(),
                    mask: masks.remove(&id),
                });
            }
        }
        run_all(&mut tasks).into_iter().collect()
    }
}

/// Log-probabilities of `token` and of the `k` most likely ids, from a raw logits row (ids below `valid`).
pub(super) fn token_logprob(raw: &[f32], valid: usize, token: u32, k: usize) -> TokenLogprob {
    let row = &raw[..valid.min(raw.len())];
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let lse = max + row.iter().map(|x| (x - max).exp()).sum::<f32>().ln();
    let k = k.min(row.len());
    let mut idx: Vec<u32> = (0..row.len() as u32).collect();
    if k > 0 && k < idx.len() {
        idx.select_nth_unstable_by(k - 1, |a, b| row[*b as usize].total_cmp(&row[*a as usize]).then(a.cmp(b)));
    }
    let mut top: Vec<(u32, f32)> = idx[..k].iter().map(|&i| (i, row[i as usize] - lse)).collect();
    top.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    TokenLogprob { logprob: raw.get(token as usize).map_or(f32::NEG_INFINITY, |l| l - lse), top }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampling::SamplingParams;
    use rand::rngs::Xoshiro256PlusPlus;
    use rand::{RngExt, SeedableRng};

    /// Unconstrained tasks of sequences 0, 1, …: row i sampled by `samplers[i]`, its logprobs where
    /// `logprobs(i)`.
    fn tasks<'a>(
        samplers: &'a mut [Sampler],
        rows: &'a mut [Vec<f32>],
        context: &'a [u32],
        logprobs: impl Fn(usize) -> bool,
    ) -> Vec<SampleTask<'a>> {
        samplers
            .iter_mut()
            .zip(rows.iter_mut())
            .enumerate()
            .map(|(i, (sampler, row))| SampleTask {
                id: i as SeqId,
                sampler,
                logprobs: logprobs(i),
                context,
                row,
                constraint: None,
                mask: None,
            })
            .collect()
    }

    /// Rows of a large vocabulary sampled on several threads give each sequence the tokens (and raw
    /// rows) of one sequential pass with the same samplers.
    #[test]
    fn parallel_sampling_equals_sequential() {
        let vocab = PARALLEL_PICK_VOCAB + 5;
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(9);
        let rows: Vec<Vec<f32>> =
            (0..7).map(|_| (0..vocab).map(|_| rng.random::<f32>() * 10.0 - 5.0).collect()).collect();
        let params = |i: usize| SamplingParams {
            temperature: if i == 3 { 0.0 } else { 0.8 },
            top_k: [0, 20, 50][i % 3],
            top_p: 0.9,
            seed: Some(i as u64),
            ..Default::default()
        };
        let run = |parallel: bool| {
            let mut samplers: Vec<Sampler> = (0..rows.len()).map(|i| Sampler::new(params(i), vocab)).collect();
            let mut rows = rows.clone();
            let context = [1u32, 2, 3];
            let mut out = Vec::new();
            for _step in 0..3 {
                let mut tasks = tasks(&mut samplers, &mut rows, &context, |i| i == 1);
                out.push(if parallel { run_all(&mut tasks) } else { tasks.iter_mut().map(SampleTask::run).collect() });
            }
            out
        };
        let (par, seq) = (run(true), run(false));
        assert_eq!(par, seq);
        assert!(par[0].iter().any(|(id, (_, raw))| *id == 1 && raw.as_ref().is_some_and(|r| r.len() == vocab)));
    }

    /// `cargo test --release -p deltaserve-engine --lib parallel_sampling_cost -- --ignored --nocapture`:
    /// 32 rows of the 27B's 248,320 ids (Qwen's top_k 20 / top_p 0.95), sequential vs `run_all`.
    #[test]
    #[ignore]
    fn parallel_sampling_cost() {
        let vocab = 248_320;
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(2);
        let base: Vec<f32> = (0..vocab).map(|_| rng.random::<f32>() * 12.0 - 6.0).collect();
        let p = SamplingParams { temperature: 0.6, top_k: 20, top_p: 0.95, seed: Some(1), ..Default::default() };
        let mut samplers: Vec<Sampler> = (0..32).map(|_| Sampler::new(p.clone(), vocab)).collect();
        for parallel in [false, true] {
            let mut rows: Vec<Vec<f32>> = vec![base.clone(); 32];
            let t0 = std::time::Instant::now();
            let mut tasks = tasks(&mut samplers, &mut rows, &[], |_| false);
            let n = if parallel { run_all(&mut tasks).len() } else { tasks.iter_mut().map(SampleTask::run).count() };
            let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
            println!(
                "{n} rows, {}: {:.1} ms ({cores} cores)",
                if parallel { "run_all" } else { "sequential" },
                t0.elapsed().as_secs_f64() * 1e3
            );
        }
    }
}
