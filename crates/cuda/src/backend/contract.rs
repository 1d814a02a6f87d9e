//! The engine's [`Backend`] contract on [`CudaBackend`]: steps, launched steps, speculative steps, sampling,
//! arena stats.

use deltaserve_backend::{
    ArenaStats, Backend, BackendError, DraftPicker, Feed, Pick, Picked, RowSampling, SpecCommit, StepBatch,
};

use crate::error::CudaError;
use crate::runtime::PinnedHost;

use super::CudaBackend;
use super::ahead::LaunchOut;
use super::step::StepOut;

impl Backend for CudaBackend {
    fn name(&self) -> String {
        format!("cuda:{}", self.rt.context().ordinal())
    }

    fn vocab_size(&self) -> usize {
        self.d.vocab
    }

    fn step(&mut self, batch: &StepBatch, logits: &mut Vec<f32>) -> Result<(), BackendError> {
        self.step_to(batch, StepOut::Logits(logits))
    }

    fn max_draft_tokens(&self) -> usize {
        self.spec.as_ref().map_or(0, |sp| sp.max_draft)
    }

    /// Not under tensor parallelism (rows are picked on the host) nor with speculative decoding.
    fn launches_ahead(&self) -> bool {
        self.tp.is_none() && self.spec.is_none()
    }

    /// Uploads the step's inputs, replays its graph (fed rows first take their tokens with `feed_rows`),
    /// picks on the device and starts the copy of the picks; returns without waiting.
    fn launch(
        &mut self,
        batch: &StepBatch,
        valid: usize,
        pick: Pick<'_>,
        feed: Option<&Feed>,
    ) -> Result<(), BackendError> {
        if !self.launches_ahead() {
            return Err(BackendError::Unsupported(
                "launching steps ahead with tensor parallelism or speculation".into(),
            ));
        }
        if batch.seqs.iter().any(|c| c.draft > 0) {
            return Err(BackendError::InvalidStep("speculative chunks need step_speculative".into()));
        }
        if self.launches.queue_len() >= 2 {
            return Err(BackendError::InvalidStep("two launched steps are not collected yet".into()));
        }
        if let Pick::Sample(rows) = pick {
            deltaserve_backend::check_sample_rows(batch, rows)?;
        }
        if let Some(f) = feed {
            let prev = self
                .launches
                .last
                .map(|(_, rows)| rows)
                .ok_or_else(|| BackendError::InvalidStep("a fed step needs the step launched before it".into()))?;
            f.check(batch, prev)?;
        }
        self.rt.context().bind_to_thread().map_err(|e| BackendError::Device(e.to_string()))?;
        if feed.is_none() && self.host_embed.is_some() && self.launches.busy() {
            // The host embedding's staging buffer may still be read by a pending launch's copy.
            self.rt.synchronize().map_err(|e| BackendError::Device(e.to_string()))?;
        }
        let r = self.enqueue_step(batch, StepOut::Launch(LaunchOut { valid, pick, feed }));
        if r.is_err() {
            self.abandon_launches();
        }
        r
    }

    fn collect(&mut self, out: &mut Picked) -> Result<(), BackendError> {
        self.rt.context().bind_to_thread().map_err(|e| BackendError::Device(e.to_string()))?;
        let r = self.collect_picks(out);
        if r.is_err() {
            self.abandon_launches();
        }
        r
    }

    /// Drafts with the MTP head (one head forward per draft position, its logits picked on the host),
    /// then one forward of the main model over every chunk, speculative chunks as short prefills whose
    /// DeltaNet state stays committed (see [`Spec`]).
    fn step_speculative(
        &mut self,
        batch: &StepBatch,
        pick: &mut DraftPicker<'_>,
        logits: &mut Vec<f32>,
        drafts: &mut Vec<Vec<u32>>,
    ) -> Result<(), BackendError> {
        if !batch.seqs.iter().any(|c| c.draft > 0) {
            return self.step(batch, logits);
        }
        self.check_speculative(batch)?;
        let dev = |e: CudaError| BackendError::Device(e.to_string());
        self.rt.context().bind_to_thread().map_err(|e| BackendError::Device(e.to_string()))?;
        if let Some(sp) = &mut self.spec {
            sp.verified.clear();
        }
        for op in &batch.pre {
            self.apply(op)?;
        }
        let t0 = std::time::Instant::now();
        let mut dtoks = self.draft(batch, pick)?;
        if let Some(sp) = &mut self.spec {
            sp.draft_s = t0.elapsed().as_secs_f64();
        }
        let verify: Vec<bool> = batch.seqs.iter().map(|c| c.draft > 0).collect();
        let mut ex = StepBatch { pre: Vec::new(), seqs: batch.seqs.clone(), post: Vec::new() };
        for (c, d) in ex.seqs.iter_mut().zip(&dtoks) {
            c.tokens.extend_from_slice(d);
            c.draft = 0;
        }
        self.run_chunks(&ex, &verify, StepOut::Logits(logits))?;
        for op in &batch.post {
            self.apply(op)?;
        }
        self.rt.synchronize().map_err(dev)?;
        drafts.extend(verify.iter().zip(dtoks.iter_mut()).filter(|(v, _)| **v).map(|(_, d)| std::mem::take(d)));
        Ok(())
    }

    fn commit_speculative(&mut self, commits: &[SpecCommit]) -> Result<(), BackendError> {
        if commits.is_empty() {
            return Ok(());
        }
        self.commit(commits)
    }

    /// The argmax of each wanted row on the GPU; 4 bytes a row come back instead of the row. (A
    /// tensor-parallel rank holds a vocabulary shard: its group picks on the host.)
    fn step_argmax(&mut self, batch: &StepBatch, valid: usize, tokens: &mut Vec<u32>) -> Result<(), BackendError> {
        if self.tp.is_some() {
            return Err(BackendError::Unsupported("argmax on one tensor-parallel rank's vocabulary shard".into()));
        }
        self.step_to(batch, StepOut::Argmax { valid, tokens })
    }

    /// Each wanted row's token picked on the GPU ([`ops::sample`]); 4 bytes a row come back instead of
    /// the row (rows the device cannot cut come back whole). A tensor-parallel rank holds a vocabulary
    /// shard: its group picks on the host.
    fn step_sample(
        &mut self,
        batch: &StepBatch,
        valid: usize,
        rows: &[RowSampling],
        tokens: &mut Vec<u32>,
    ) -> Result<(), BackendError> {
        if self.tp.is_some() {
            return Err(BackendError::Unsupported("sampling on one tensor-parallel rank's vocabulary shard".into()));
        }
        deltaserve_backend::check_sample_rows(batch, rows)?;
        self.step_to(batch, StepOut::Sample { valid, rows, tokens })
    }

    fn arena_stats(&self) -> ArenaStats {
        let capacity: usize = self.arena.regions().iter().map(|(_, s, _)| s).sum();
        let embed = self.host_embed.as_ref().map(|e| [&e.table, &e.staging]);
        let pinned: Vec<&PinnedHost> = self
            .host_pool
            .iter()
            .chain(embed.into_iter().flatten())
            .chain([&self.inputs.image])
            .chain(self.launches.pinned())
            .collect();
        let host_b: usize = pinned.iter().map(|p| p.bytes()).sum();
        ArenaStats {
            allocations: (self.arena.driver_allocs() + pinned.len()) as u64,
            high_water_bytes: (self.arena.high_water() + host_b) as u64,
            capacity_bytes: (capacity + host_b) as u64,
        }
    }
}
