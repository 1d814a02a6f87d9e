//! The engine's [`Backend`] contract on [`CudaBackend`]: steps, launched steps, speculative steps, sampling,
//! arena stats.

use deltaserve_backend::{ArenaStats, Backend, BackendError, Feed, ImageTokens, Pick, Picked, SpecCommit, StepBatch};

use crate::runtime::PinnedHost;

use super::CudaBackend;
use super::ahead::LaunchOut;
use super::step::StepOut;

impl Backend for CudaBackend {
    /// Steps launch ahead except under tensor parallelism (rows are picked on the host) or with
    /// speculative decoding.
    fn capabilities(&self) -> deltaserve_backend::Capabilities {
        deltaserve_backend::Capabilities {
            name: format!("cuda:{}", self.rt.context().ordinal()),
            vocab_size: self.d.vocab,
            launches_ahead: self.launches_ahead(),
            max_draft_tokens: self.spec.as_ref().map_or(0, |sp| sp.max_draft),
            masks_tokens: crate::switches::Switches::get().device_masks,
            picks_after_launch: crate::switches::Switches::get().later_picks,
            snapshots_within_chunks: self.snapshots_within_step(),
            // Every row's logits gather into the logits region's rows (one per sequence without
            // speculation); a speculative backend's rows belong to its verify chunks.
            prompt_logits: self.spec.is_none() && self.tp.is_none(),
            max_logits_rows: self.max_seqs * (1 + self.spec.as_ref().map_or(0, |sp| sp.max_draft)),
        }
    }

    /// Images run where the vision tower is loaded (the plan prices it).
    fn image_tokens(&self) -> Option<ImageTokens> {
        let v = &self.vision.as_ref()?.cfg;
        Some(ImageTokens { image_token_id: v.image_token_id, merge: v.spatial_merge_size, patch_len: v.patch_dim() })
    }

    /// Logits are downloaded whole. Tokens are picked on the GPU: the argmax of each row, or its token
    /// drawn by [`ops::sample`] (rows the device cannot cut come back whole); 4 bytes a row come back
    /// instead of the row. (A tensor-parallel rank holds a vocabulary shard: its group picks on the
    /// host.) Drafts: see `step_speculative` (speculative decoding).
    fn step(
        &mut self,
        batch: &StepBatch,
        want: deltaserve_backend::Want<'_>,
        out: &mut deltaserve_backend::StepOut,
    ) -> Result<(), BackendError> {
        use deltaserve_backend::Want;
        if batch.seqs.iter().any(|c| c.all_logits) {
            deltaserve_backend::check_logits_rows(batch, &self.capabilities())?;
            if !matches!(want, Want::Logits) {
                return Err(deltaserve_backend::host::all_logits_picked());
            }
        }
        let tokens = &mut out.tokens;
        match want {
            Want::Logits => self.step_to(batch, StepOut::Logits(&mut out.logits)),
            Want::Tokens { .. } | Want::DraftsArgmax { .. } if self.tp.is_some() => {
                Err(BackendError::Unsupported("picking tokens on one tensor-parallel rank's vocabulary shard".into()))
            }
            Want::Tokens { valid, pick: Pick::Argmax } => self.step_to(batch, StepOut::Argmax { valid, tokens }),
            Want::Tokens { valid, pick: Pick::Sample(rows) } => {
                deltaserve_backend::check_sample_rows(batch, rows)?;
                self.step_to(batch, StepOut::Sample { valid, rows, tokens })
            }
            Want::Tokens { pick: Pick::Later, .. } => Err(deltaserve_backend::host::later_in_a_step()),
            Want::Drafts(pick) => self.step_speculative(batch, pick, StepOut::Logits(&mut out.logits), &mut out.drafts),
            Want::DraftsArgmax { valid, pick } => {
                self.step_speculative(batch, pick, StepOut::Argmax { valid, tokens }, &mut out.drafts)
            }
        }
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
            return Err(BackendError::InvalidStep("speculative chunks need a draft picker".into()));
        }
        if batch.seqs.iter().any(|c| c.all_logits) {
            return Err(deltaserve_backend::host::all_logits_picked());
        }
        if self.launches.queue_len() >= 2 {
            return Err(BackendError::InvalidStep("two launched steps are not collected yet".into()));
        }
        if self.launches.unpicked.is_some() {
            return Err(deltaserve_backend::ahead::picks_not_made());
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

    /// Picks the rows of the step launched with [`Pick::Later`] (its logits stay in the logits region
    /// until then: the next step is not launched before these picks), as `launch` would have.
    fn pick_launched(&mut self, pick: Pick<'_>) -> Result<(), BackendError> {
        let Some((rows, valid)) = self.launches.unpicked.take() else {
            return Err(deltaserve_backend::ahead::no_step_waits());
        };
        let dev = |e: &dyn std::fmt::Display| BackendError::Device(e.to_string());
        let r = deltaserve_backend::ahead::check_later_pick(pick, rows).and_then(|()| {
            self.rt.context().bind_to_thread().map_err(|e| dev(&e))?;
            self.launch_picks(rows, LaunchOut { valid, pick, feed: None }).map_err(|e| dev(&e))
        });
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

    fn commit_speculative(&mut self, commits: &[SpecCommit]) -> Result<(), BackendError> {
        if commits.is_empty() {
            return Ok(());
        }
        self.commit(commits)
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
