//! The start-up: a prepared model (checked and planned, no weight read), its backend built, and the
//! engine running on it.

use std::path::Path;
use std::sync::Arc;

use anyhow::{Context, Result};
use deltaserve_backend::Backend;
use deltaserve_engine::EngineHandle;
use deltaserve_plan::Plan;
use deltaserve_sched::SchedConfig;
use deltaserve_server::{AppState, ServerConfig};
use deltaserve_text::{ChatTemplate, Tokenizer};

use super::EngineArgs;
use crate::model_source::{Device, ModelArgs, TextModel};

/// A backend built from the flags and the plan that sized it, before an engine drives it.
pub struct Built {
    pub backend: Box<dyn Backend>,
    pub plan: Plan,
    pub sched: SchedConfig,
    pub tokenizer: Option<Arc<Tokenizer>>,
    pub template: Option<Arc<ChatTemplate>>,
    /// Token ids that end generation.
    pub eos_ids: Vec<u32>,
    /// Drafts per decode step (`--speculative-tokens`, 0: off).
    speculative_tokens: usize,
}

impl Built {
    /// Every position's logits of `tokens` run as one sequence (state slot 0, the first KV pages):
    /// `each(i, row)` gets the row after position `i`.
    pub fn logits_at_every_position(&mut self, tokens: &[u32], each: impl FnMut(usize, &[f32])) -> Result<()> {
        self.logits_with_images(tokens, &[], each)
    }

    /// [`Built::logits_at_every_position`] of a prompt whose image placeholder runs hold `images`.
    pub fn logits_with_images(
        &mut self,
        tokens: &[u32],
        images: &[Arc<deltaserve_model::ImagePatches>],
        each: impl FnMut(usize, &[f32]),
    ) -> Result<()> {
        let plan = &self.plan;
        if tokens.len() > plan.max_context {
            anyhow::bail!(
                "{} tokens exceed the memory plan's context of {} (raise --memory or --max-context)",
                tokens.len(),
                plan.max_context
            );
        }
        let pages: Vec<u32> = (0..tokens.len().div_ceil(plan.page_size) as u32).collect();
        deltaserve_engine::logits_with_images(&mut *self.backend, 0, &pages, tokens, images, each)?;
        Ok(())
    }
}

/// A model checked and planned, its weights not read yet ([`EngineArgs::prepare`]).
pub struct Prepared {
    pub(super) device: Device,
    pub(super) text: TextModel,
    pub(super) plan: Plan,
    pub(super) sched: SchedConfig,
    pub(super) speculative_tokens: usize,
    /// The KV pages the CPU backend allocates (fewer than the plan's when scoring one sequence).
    pub(super) cpu_pages: usize,
}

impl Prepared {
    /// The model's tokenizer (None: no tokenizer.json).
    pub fn tokenizer(&self) -> Option<&Tokenizer> {
        self.text.tokenizer.as_ref()
    }
}

/// A running engine and the plan it was built from.
pub struct Started {
    pub engine: EngineHandle,
    /// The backend it runs on.
    pub device: Device,
    pub plan: Plan,
    pub tokenizer: Option<Arc<Tokenizer>>,
    pub template: Option<Arc<ChatTemplate>>,
    /// Token ids that end generation.
    pub eos_ids: Vec<u32>,
}

impl Started {
    /// The HTTP server's state over this engine.
    pub fn app_state(
        &self,
        name: &str,
        api_key: Option<String>,
        max_body_bytes: usize,
        model_dir: &std::path::Path,
    ) -> Result<AppState> {
        let tokenizer = self.tokenizer.clone().context("serving needs a tokenizer.json in the model directory")?;
        Ok(AppState {
            grammars: Default::default(),
            engine: self.engine.clone(),
            prompt_encoder: deltaserve_server::state::prompt_encoder(&tokenizer),
            tokenizer,
            template: self.template.clone(),
            metrics: Arc::new(Default::default()),
            cfg: Arc::new(ServerConfig {
                served_model_name: name.to_string(),
                api_key: api_key_or_none(api_key),
                max_body_bytes,
                allowed_origins: Default::default(),
                reasoning_budget: None,
            }),
            eos_ids: self.eos_ids.clone(),
            sampling_defaults: deltaserve_server::state::sampling_defaults(model_dir),
            media: Arc::new(deltaserve_server::media::MediaConfig::for_model_dir(model_dir)?),
        })
    }
}

impl EngineArgs {
    /// Loads the model in `dir` (from [`ModelArgs::dir`]) for the device `--device` selects, plans
    /// memory, allocates the backend's arena and starts the engine.
    pub fn start(&self, model: &ModelArgs, dir: &Path) -> Result<Started> {
        self.start_prepared(model, self.prepare(model, dir, None)?)
    }

    /// [`EngineArgs::start`] from a model [`EngineArgs::prepare`] has checked and planned.
    pub fn start_prepared(&self, model: &ModelArgs, prepared: Prepared) -> Result<Started> {
        let device = prepared.device;
        let built = self.load(model, prepared)?;
        let engine = EngineHandle::start_with(
            built.backend,
            built.sched,
            built.tokenizer.clone(),
            self.engine_options(built.speculative_tokens, &built.plan),
        )
        .context("--speculative-tokens")?;
        Ok(Started {
            engine,
            device,
            plan: built.plan,
            tokenizer: built.tokenizer,
            template: built.template,
            eos_ids: built.eos_ids,
        })
    }

    /// Loads the model in `dir` (from [`ModelArgs::dir`]) for the device `--device` selects, plans memory
    /// and allocates the backend's arena for one sequence of `positions` tokens
    /// ([`Built::logits_at_every_position`]): everything [`EngineArgs::start`] does but the engine. The
    /// CPU backend's arena then holds only the KV pages that sequence needs (its pages emulate every KV
    /// format in f32, so the plan's pages can take several times `--memory`).
    pub fn build_to_score(&self, model: &ModelArgs, dir: &Path, positions: usize) -> Result<Built> {
        self.load(model, self.prepare(model, dir, Some(positions))?)
    }

    /// Everything that can be checked before a weight is read: the device (and its libraries), the
    /// config, tokenizer and chat template, the flags, and the memory plan against the memory there is
    /// (the GPU's free memory; on the CPU the host's available memory). `positions`: as in
    /// [`EngineArgs::build_to_score`].
    pub fn prepare(&self, model: &ModelArgs, dir: &Path, positions: Option<usize>) -> Result<Prepared> {
        let device = model.device()?;
        let text = model.load_text(dir)?;
        match device {
            Device::Cpu => self.prepare_cpu(text, positions, model.no_vision),
            Device::Cuda => self.prepare_cuda(text, model.random_weights, model.no_vision),
        }
    }

    /// Reads the weights of a prepared model and allocates its backend.
    fn load(&self, model: &ModelArgs, p: Prepared) -> Result<Built> {
        let backend: Box<dyn Backend> = match p.device {
            Device::Cpu => Box::new(self.load_cpu(model, &p)?),
            Device::Cuda => self.load_cuda(&p, model.random_weights)?,
        };
        let Prepared { text, plan, sched, speculative_tokens, .. } = p;
        Ok(Built {
            backend,
            plan,
            sched,
            eos_ids: text.config.eos_token_ids.clone(),
            tokenizer: text.tokenizer.map(Arc::new),
            template: text.template.map(Arc::new),
            speculative_tokens,
        })
    }

    /// Builds the backend of a model [`EngineArgs::prepare`] has checked and planned (the plan's `positions`
    /// as given there): [`EngineArgs::build_to_score`] in two halves, so that every configuration can be
    /// checked before any weight is read.
    pub fn build_prepared(&self, model: &ModelArgs, prepared: Prepared) -> Result<Built> {
        self.load(model, prepared)
    }
}

/// The API key the server requires: an empty `--api-key` / `DELTASERVE_API_KEY=` is no key (said in a
/// warning), not a key no client can send.
fn api_key_or_none(key: Option<String>) -> Option<String> {
    match key {
        Some(k) if k.trim().is_empty() => {
            tracing::warn!("the API key (--api-key / DELTASERVE_API_KEY) is empty: requests need no key");
            None
        }
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_empty_api_key_is_no_key() {
        assert_eq!(api_key_or_none(None), None);
        assert_eq!(api_key_or_none(Some(String::new())), None);
        assert_eq!(api_key_or_none(Some(" ".into())), None);
        assert_eq!(api_key_or_none(Some("k".into())), Some("k".into()));
    }
}
