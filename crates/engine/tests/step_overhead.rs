//! The engine's own work per step (scheduling, building each row's sampling, emitting tokens) over a
//! backend that answers at once: what the host adds to every decode step. A measurement, not a check:
//! `cargo test --release -p deltaserve-engine --test step_overhead -- --ignored --nocapture`.

use deltaserve_backend::{ArenaStats, Backend, BackendError, Capabilities, StepBatch, StepOut, Want};
use deltaserve_engine::{EngineHandle, Event, Request, SamplingParams};
use deltaserve_sched::{PrefixCacheConfig, SchedConfig};

/// A backend of the 27B's vocabulary whose steps take no time (tokens cycle through 5,000 ids).
struct Null;
impl Backend for Null {
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            name: "null".into(),
            vocab_size: 248_320,
            launches_ahead: false,
            max_draft_tokens: 0,
            masks_tokens: false,
            picks_after_launch: false,
            snapshots_within_chunks: 0,
            prompt_logits: false,
            max_logits_rows: 0,
        }
    }
    fn step(&mut self, b: &StepBatch, want: Want<'_>, out: &mut StepOut) -> Result<(), BackendError> {
        let wanted = b.seqs.iter().filter(|c| c.want_logits);
        match want {
            Want::Tokens { .. } | Want::DraftsArgmax { .. } => {
                out.tokens.extend(wanted.map(|c| 1000 + (c.start as u32 % 5000)))
            }
            Want::Logits | Want::Drafts(_) => out.logits.resize(out.logits.len() + wanted.count() * 248_320, 0.0),
        }
        Ok(())
    }
    deltaserve_backend::without_lookahead_or_drafts!("null");
    fn arena_stats(&self) -> ArenaStats {
        ArenaStats { allocations: 0, high_water_bytes: 0, capacity_bytes: 0 }
    }
}

/// 1 and 8 requests of a 4,000-token prompt generating 4,000 tokens each, greedy and with Qwen's
/// sampling plus a presence penalty (its entries grow with the generated ids): µs per engine step.
#[test]
#[ignore]
fn engine_overhead() {
    for (n, sampled) in [(1usize, false), (1, true), (8, false), (8, true)] {
        let sched = SchedConfig {
            max_batch_tokens: 8192,
            max_seqs: 8,
            page_size: 16,
            num_pages: 8 * 600,
            max_context: 9000,
            max_waiting: 64,
            prefix_cache: PrefixCacheConfig::disabled(16),
            snapshot_interval: 0,
        };
        let e = EngineHandle::start(Box::new(Null), sched, None);
        let tokens = 4000;
        let t0 = std::time::Instant::now();
        let hs: Vec<_> = (0..n)
            .map(|i| {
                let sampling = if sampled {
                    SamplingParams {
                        temperature: 0.6,
                        top_k: 20,
                        top_p: 0.95,
                        presence_penalty: 1.5,
                        seed: Some(i as u64),
                        ..Default::default()
                    }
                } else {
                    SamplingParams::greedy()
                };
                let r = Request {
                    prompt: (0..4000u32).map(|j| j % 30000 + 7).collect(),
                    max_tokens: tokens,
                    sampling,
                    ..Default::default()
                };
                let mut s = e.submit(r).unwrap();
                std::thread::spawn(move || {
                    let mut k = 0;
                    while let Some(ev) = s.blocking_next() {
                        if matches!(ev, Event::Token { .. }) {
                            k += 1
                        }
                        if matches!(ev, Event::Finished { .. }) {
                            break;
                        }
                    }
                    k
                })
            })
            .collect();
        let got: usize = hs.into_iter().map(|h| h.join().unwrap()).sum();
        let dt = t0.elapsed().as_secs_f64();
        let steps = e.stats().steps;
        eprintln!(
            "{n} requests, sampled {sampled}: {got} tokens, {steps} steps, {:.1} us per step",
            dt * 1e6 / steps as f64
        );
        e.shutdown(false);
    }
}
