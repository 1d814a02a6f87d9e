//! Speculative decoding of mixture-of-experts models through the engine on the CPU backend: the MTP
//! head's MLP is itself a mixture of experts (with a shared expert), in the `qwen3_5_moe` form (`tiny-moe`)
//! and the Qwen3-Next form (top-k probabilities not renormalised, a dense layer in the model). With 3
//! drafts per step, greedy outputs of several concurrent requests (prompts over several chunks, a stop
//! token) are the tokens of plain decoding, log-probabilities equal within f32 rounding, and the
//! acceptance is reported: near zero for a random head, every draft for an agreeing one, in between
//! for a mostly agreeing one.

mod common;

use std::path::{Path, PathBuf};

use deltaserve_cpu::{CpuBackend, CpuModel};
use deltaserve_engine::{EngineHandle, FinishReason, Request, SamplingParams};
use deltaserve_model::synth::{MtpVariant, Preset, write_model_json, write_model_with};
use deltaserve_model::{Checkpoint, ModelConfig, ModelWeights};
use deltaserve_sched::SchedConfig;

use common::{Out, Setup, cache_cfg, collect, wait_idle};

#[derive(Clone, Copy, Debug)]
enum Form {
    Qwen35Moe,
    Qwen3NextMoe,
}

fn write(form: Form, variant: MtpVariant) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ds-spec-moe-{form:?}-{variant:?}-{}", std::process::id()));
    match form {
        Form::Qwen35Moe => write_model_with(&dir, Preset::TinyMoe, None, 9, variant, |_, _| {}),
        Form::Qwen3NextMoe => {
            // Layer 2 dense: layer 0, and so the MTP head, sparse.
            let mut c = Preset::small_qwen3_next_moe();
            c["mlp_only_layers"] = vec![2u64].into();
            write_model_json(&dir, Preset::Qwen3Next80bA3b, c, 9, variant, |_, _| {})
        }
    }
    .unwrap();
    dir
}

fn model(dir: &Path) -> CpuModel {
    let cfg = ModelConfig::from_dir(dir).unwrap();
    let w = ModelWeights::load_f32(&Checkpoint::open(dir).unwrap(), &cfg).unwrap();
    assert!(w.mtp.as_ref().is_some_and(|m| m.layer.moe.is_some()), "a sparse MTP head");
    CpuModel::new(cfg, w)
}

fn sched() -> SchedConfig {
    Setup { max_batch_tokens: 24, num_pages: 64, max_seqs: 4, prefix_cache: false }.sched(0)
}

/// An engine over the model in `dir`: plain (`k == 0`) or speculative with `k` drafts.
fn engine(dir: &Path, k: usize) -> EngineHandle {
    let c = sched();
    let cache = cache_cfg(&c);
    if k == 0 {
        EngineHandle::start(Box::new(CpuBackend::new(model(dir), cache)), c, None)
    } else {
        let b = CpuBackend::with_speculation(model(dir), cache, k).unwrap();
        EngineHandle::start_speculative(Box::new(b), c, None, k).unwrap()
    }
}

/// Greedy requests with prompts of several chunks; request 2 stops at `stop` when given.
fn requests(stop: Option<u32>) -> Vec<Request> {
    let mut x = 5u64;
    let mut next = move |m: u64| {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (x >> 33) % m
    };
    (0..4)
        .map(|i| Request {
            prompt: (0..10 + next(40) as usize).map(|_| next(900) as u32).collect(),
            max_tokens: 8 + next(12) as usize,
            sampling: SamplingParams::greedy(),
            stop_token_ids: if i == 2 { stop.into_iter().collect() } else { Vec::new() },
            logprobs: Some(0),
            ..Request::default()
        })
        .collect()
}

fn run(e: &EngineHandle, reqs: &[Request]) -> Vec<Out> {
    let streams: Vec<_> = reqs.iter().map(|r| e.submit(r.clone()).unwrap()).collect();
    streams.into_iter().map(collect).collect()
}

#[test]
fn moe_greedy_speculation_is_token_identical_to_plain_decoding() {
    let variants = [
        MtpVariant::Random,
        MtpVariant::Agreeing { residual_scale: 0.0 },
        MtpVariant::Agreeing { residual_scale: 0.05 },
    ];
    for form in [Form::Qwen35Moe, Form::Qwen3NextMoe] {
        for variant in variants {
            let what = format!("{form:?} {variant:?}");
            let dir = write(form, variant);
            let plain = engine(&dir, 0);
            let free = run(&plain, &requests(None));
            // A stop token in the middle of request 2's output (so inside a speculative step).
            let reqs = requests(Some(free[2].ids[free[2].ids.len() / 2]));
            let want = run(&plain, &reqs);
            plain.shutdown(true);
            let e = engine(&dir, 3);
            let got = run(&e, &reqs);
            let stats = wait_idle(&e);
            e.shutdown(true);
            let _ = std::fs::remove_dir_all(&dir);
            for (i, (a, b)) in want.iter().zip(&got).enumerate() {
                assert_eq!(a.ids, b.ids, "{what}: request {i} tokens");
                assert_eq!(a.reason, b.reason, "{what}: request {i} finish");
                for (j, (x, y)) in a.logprobs.iter().zip(&b.logprobs).enumerate() {
                    assert!((x - y).abs() <= 1e-5 * x.abs().max(1.0), "{what}: request {i} token {j}: {x} vs {y}");
                }
            }
            assert_eq!(want[2].reason, FinishReason::Stop, "{what}: request 2 stops");
            assert!(stats.spec_steps > 0 && stats.spec_drafted > 0, "{what}: {stats:?}");
            let rate = stats.acceptance_rate();
            eprintln!("{what}: acceptance {rate:.3} over {} drafts", stats.spec_drafted);
            match variant {
                MtpVariant::Random => assert!(rate < 0.2, "{what}: acceptance {rate}"),
                // Drafts past a stop token are not emitted, so not all count as accepted here.
                MtpVariant::Agreeing { residual_scale: 0.0 } => assert!(rate > 0.9, "{what}: acceptance {rate}"),
                _ => assert!(rate > 0.2 && rate < 1.0, "{what}: acceptance {rate}"),
            }
        }
    }
}
