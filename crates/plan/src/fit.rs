//! [`fit_context`]: "boots = fills" by default — when the user names no context, the plan aims at the
//! model's full context (`max_position_embeddings`) and, if that does not fit, trades the knobs the
//! user left open (device snapshots, sequences per step, the embedding's place, lm_head precision, the
//! vision tower) in a fixed order, cheapest first, until it does.
//!
//! Order of the ladder (each rung keeps the earlier ones):
//! 1. device snapshot slots down to 4 (the host tier still holds snapshots);
//! 2. sequences per step down to 8;
//! 3. the embedding table in pinned host memory (a step copies only its `[T, D]` rows);
//! 4. lm_head in int4, only when the decoder linears are int4 already;
//! 5. no vision tower (its weights and workspace), only when the user did not ask for images
//!    (`--max-image-tokens-per-step`): requests with images are then refused;
//! 6. sequences per step 4, then 2, then 1, with 2, then 1 device snapshot.
//!
//! A mixture-of-experts model has one more trade, the costliest: its routed experts in pinned host memory
//! (`--experts-on-host`: every token then reads its experts across the bus). It is taken only when no
//! rung of the ladder comes within [`NEAR_BEST`] of the target without it, and then from the user's
//! settings: the experts move first and the ladder climbs again from its first rung, as far as it still
//! needs to (a model whose experts alone do not fit, as the 80B-A3B's on a 24 GB card, usually needs
//! nothing else). Never for a dense model, nor where the backend cannot ([`Free::experts_on_host`]).
//!
//! A knob the user set explicitly is never touched. If no rung reaches the target (a budget a little
//! short of the model's full context, e.g. a 24 GB card with a display attached), the plan takes the
//! fewest rungs whose context is within [`NEAR_BEST`] of the most any rung gives (every knob traded
//! buys the last few percent at the cost of concurrency), with a note saying what fits and what was
//! traded. An explicit `--max-context` that no rung reaches is the plan's own error.

use deltaserve_model::ModelConfig;

use crate::dtype::{StateDtype, WeightsDtype};
use crate::error::PlanError;
use crate::options::{PlanBackend, PlanOptions};
use crate::plan::Plan;
use crate::size::{fmt_bytes, fmt_count};

/// Which options the planner may change (the user did not set them).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Free {
    pub max_seqs: bool,
    pub snapshot_slots: bool,
    /// Only where the backend can keep the embedding on the host.
    pub embed_on_host: bool,
    /// Only where the backend can run an int4 lm_head.
    pub lm_head_int4: bool,
    /// The vision tower may be left out (the user did not ask for images).
    pub vision: bool,
    /// Only where the backend can read routed experts from host memory (CUDA, one card); only a
    /// mixture-of-experts model takes it.
    pub experts_on_host: bool,
}

impl Free {
    /// Every knob open.
    pub fn all() -> Self {
        Self {
            max_seqs: true,
            snapshot_slots: true,
            embed_on_host: true,
            lm_head_int4: true,
            vision: true,
            experts_on_host: true,
        }
    }
}

/// A plan with the changes the planner made to reach its context.
#[derive(Clone, Debug)]
pub struct Fitted {
    pub plan: Plan,
    /// Human-readable, in the order applied, e.g. `--max-seqs 16 -> 8`.
    pub adjustments: Vec<String>,
    /// The context aimed at: `--max-context`, else the model's `max_position_embeddings`.
    pub target_context: usize,
    /// Why the target was not reached, when it was not.
    pub shortfall: Option<String>,
    /// A setting the user may prefer to what the planner traded: where it moved a mixture of experts' bf16 or
    /// fp8 experts to the host, int4 weights when they keep the experts on the GPU at the full context.
    pub hint: Option<String>,
    /// A format the user may choose: where the fit traded sequences per step on the CUDA backend and a bf16
    /// DeltaNet state keeps more of them at the same context, `--state-dtype bf16`.
    pub note: Option<String>,
}

/// Plans for the target context (see the module docs). Each candidate's plan prices its own backend
/// scratch (it depends on the sequences per step and the lm_head's format). Where the planner moved a
/// mixture of experts' bf16 or fp8 experts to the host and int4 weights would keep them on the GPU at the
/// target, [`Fitted::hint`] says so (reading the experts across the bus costs far more than 4-bit weights);
/// where it traded sequences and a bf16 DeltaNet state would keep more, [`Fitted::note`] says that.
pub fn fit_context(cfg: &ModelConfig, base: &PlanOptions, free: Free) -> Result<Fitted, PlanError> {
    let mut fitted = fit_ladder(cfg, base, free)?;
    if fitted.adjustments.iter().any(|a| a == EXPERTS_ON_HOST) && base.weights_dtype != WeightsDtype::Int4 {
        let int4 = PlanOptions { weights_dtype: WeightsDtype::Int4, ..base.clone() };
        if let Ok(alt) = fit_ladder(cfg, &int4, free)
            && alt.shortfall.is_none()
            && !alt.adjustments.iter().any(|a| a == EXPERTS_ON_HOST)
        {
            fitted.hint = Some(format!(
                "the routed experts ({} weights) go to host memory, where every token reads its experts across the \
                 bus; with --weights-dtype int4 (a bf16 or FP8 checkpoint: --quantize int4) they stay on the GPU and \
                 the full context ({} tokens) fits",
                base.weights_dtype.name(),
                fmt_count(alt.plan.max_context as u64)
            ));
        }
    }
    fitted.note = state_note(cfg, base, free, &fitted);
    Ok(fitted)
}

/// `--state-dtype bf16` where the fit traded sequences per step on the CUDA backend with an f32 DeltaNet
/// state, and half the state's bytes keep more sequences at the same context.
fn state_note(cfg: &ModelConfig, base: &PlanOptions, free: Free, fitted: &Fitted) -> Option<String> {
    let cuda = matches!(base.backend, PlanBackend::Cuda { .. });
    if !cuda || base.state_dtype != StateDtype::F32 || fitted.plan.max_seqs >= base.max_seqs {
        return None;
    }
    let bf16 = PlanOptions { state_dtype: StateDtype::Bf16, ..base.clone() };
    let alt = fit_ladder(cfg, &bf16, free).ok()?;
    let keeps = alt.plan.max_seqs > fitted.plan.max_seqs && alt.plan.max_context >= fitted.plan.max_context;
    keeps.then(|| {
        format!(
            "the DeltaNet state in bf16 (--state-dtype bf16: half its bytes, rounded after every token) keeps {} \
             sequences per step at {} tokens instead of {}",
            alt.plan.max_seqs,
            fmt_count(fitted.plan.max_context as u64),
            fitted.plan.max_seqs
        )
    })
}

/// [`fit_context`] without its hint.
fn fit_ladder(cfg: &ModelConfig, base: &PlanOptions, free: Free) -> Result<Fitted, PlanError> {
    let target = base.max_context.unwrap_or(cfg.max_position_embeddings);
    // The user's settings, planned for "as large as fits" so a shortfall is a plan, not an error.
    let open = PlanOptions { max_context: None, ..base.clone() };
    let first = Plan::new(cfg, &open);
    if let Ok(p) = &first
        && p.max_context >= target
    {
        return Ok(Fitted {
            plan: finish(cfg, p, base, &open)?,
            adjustments: Vec::new(),
            target_context: target,
            shortfall: None,
            hint: None,
            note: None,
        });
    }

    // Each rung prefix's plan (with the adjustments it took), for when none reaches the target: the
    // ladder's first, then (a mixture of experts) the ladder's with the experts on the host.
    let mut tried: Vec<(Vec<String>, Plan)> = first.iter().map(|p| (Vec::new(), p.clone())).collect();
    if let Some(fitted) = climb(cfg, &open, base, free, Vec::new(), target, &mut tried)? {
        return Ok(fitted);
    }
    // The experts move only when the ladder alone stays short of NEAR_BEST of the target (reading the
    // experts across the bus costs far more than the last few percent of context).
    let near = tried.iter().any(|(_, p)| p.max_context as f64 >= NEAR_BEST * target as f64);
    if free.experts_on_host && cfg.moe.is_some() && !open.experts_on_host && open.tensor_parallel == 1 && !near {
        let hosted = PlanOptions { experts_on_host: true, ..open.clone() };
        if let Some(fitted) = climb(cfg, &hosted, base, free, vec![EXPERTS_ON_HOST.into()], target, &mut tried)? {
            return Ok(fitted);
        }
    }

    // Nothing reached the target: the user's settings decide (an explicit --max-context that does not
    // fit is the plan's own error, with its hints).
    if base.max_context.is_some() {
        return Plan::new(cfg, base).map(|plan| Fitted {
            plan,
            adjustments: Vec::new(),
            target_context: target,
            shortfall: None,
            hint: None,
            note: None,
        });
    }
    let best = tried.iter().map(|(_, p)| p.max_context).max().unwrap_or(0);
    let Some((adjustments, plan)) = tried.into_iter().find(|(_, p)| p.max_context as f64 >= NEAR_BEST * best as f64)
    else {
        // No candidate planned at all: the error of the user's settings.
        return first.map(|plan| Fitted {
            plan,
            adjustments: Vec::new(),
            target_context: target,
            shortfall: None,
            hint: None,
            note: None,
        });
    };
    let taken = adjustments.len();
    let shortfall = Some(format!(
        "the full context ({} tokens) does not fit in {}: {} tokens fit{}",
        fmt_count(target as u64),
        fmt_bytes(base.budget_bytes),
        fmt_count(plan.max_context as u64),
        match taken {
            0 => " with the settings given".to_string(),
            _ if best > plan.max_context => format!(
                " with {} ({} with every open option traded, at the cost of concurrency)",
                adjustments.join(", "),
                fmt_count(best as u64)
            ),
            _ => format!(" with {}", adjustments.join(", ")),
        },
    ));
    Ok(Fitted { plan, adjustments, target_context: target, shortfall, hint: None, note: None })
}

/// When the target is out of reach: the fewest rungs whose context is at least this share of the most
/// any rung gives.
pub const NEAR_BEST: f64 = 0.9;

/// How the fit names the experts' move to the host.
const EXPERTS_ON_HOST: &str = "--experts-on-host";

/// Climbs the ladder from `start` (whose own plan the caller has tried; `adjustments` say how it
/// differs from the user's settings): the first rung prefix that reaches `target`, else None with each
/// prefix's plan pushed onto `tried`.
fn climb(
    cfg: &ModelConfig,
    start: &PlanOptions,
    base: &PlanOptions,
    free: Free,
    mut adjustments: Vec<String>,
    target: usize,
    tried: &mut Vec<(Vec<String>, Plan)>,
) -> Result<Option<Fitted>, PlanError> {
    let mut o = start.clone();
    let mut rungs = vec![None];
    rungs.extend(ladder(base, free).into_iter().map(Some));
    for rung in rungs {
        let before = o.clone();
        match rung {
            // The start itself: planned by the caller unless it moved the experts.
            None if adjustments.is_empty() => continue,
            None => {}
            Some(rung) => {
                rung.apply(&mut o);
                if o == before {
                    continue;
                }
                adjustments.push(rung.describe(&before, &o));
            }
        }
        if let Ok(p) = Plan::new(cfg, &o) {
            if p.max_context >= target {
                let plan = finish(cfg, &p, base, &o)?;
                return Ok(Some(Fitted {
                    plan,
                    adjustments,
                    target_context: target,
                    shortfall: None,
                    hint: None,
                    note: None,
                }));
            }
            tried.push((adjustments.clone(), p));
        }
    }
    Ok(None)
}

/// With an explicit `--max-context`, plan exactly that (KV pages still take all memory left).
fn finish(cfg: &ModelConfig, p: &Plan, base: &PlanOptions, o: &PlanOptions) -> Result<Plan, PlanError> {
    match base.max_context {
        Some(mc) => Plan::new(cfg, &PlanOptions { max_context: Some(mc), ..o.clone() }),
        None => Ok(p.clone()),
    }
}

#[derive(Clone, Copy, Debug)]
enum Rung {
    Snapshots(usize),
    Seqs(usize),
    EmbedOnHost,
    LmHeadInt4,
    NoVision,
}

fn ladder(base: &PlanOptions, free: Free) -> Vec<Rung> {
    let mut r = Vec::new();
    let mut push = |ok: bool, rung| {
        if ok {
            r.push(rung)
        }
    };
    push(free.snapshot_slots, Rung::Snapshots(4));
    push(free.max_seqs, Rung::Seqs(8));
    push(free.embed_on_host, Rung::EmbedOnHost);
    push(free.lm_head_int4 && base.weights_dtype == WeightsDtype::Int4, Rung::LmHeadInt4);
    push(free.vision, Rung::NoVision);
    for (seqs, snaps) in [(4, 2), (2, 1), (1, 1)] {
        push(free.max_seqs, Rung::Seqs(seqs));
        push(free.snapshot_slots, Rung::Snapshots(snaps));
    }
    r
}

impl Rung {
    fn apply(self, o: &mut PlanOptions) {
        match self {
            // Never raise a knob, never drop snapshots to 0 (that switches the prefix cache off).
            Rung::Snapshots(n) => o.snapshot_slots = o.snapshot_slots.min(n),
            Rung::Seqs(n) => o.max_seqs = o.max_seqs.min(n),
            Rung::EmbedOnHost => o.embed_on_host = true,
            Rung::LmHeadInt4 => o.lm_head_int4 = true,
            Rung::NoVision => o.max_image_tokens_per_step = None,
        }
    }

    fn describe(self, before: &PlanOptions, after: &PlanOptions) -> String {
        match self {
            Rung::Snapshots(_) => format!("--snapshot-slots {} -> {}", before.snapshot_slots, after.snapshot_slots),
            Rung::Seqs(_) => format!("--max-seqs {} -> {}", before.max_seqs, after.max_seqs),
            Rung::EmbedOnHost => "--embed-on-host".to_string(),
            Rung::LmHeadInt4 => "--lm-head-int4".to_string(),
            Rung::NoVision => "--no-vision".to_string(),
        }
    }
}
