//! Speculative decoding on the CPU backend never corrupts state: drafting, verifying K+1 positions and
//! committing any accepted prefix gives exactly the logits (bit for bit) of decoding the same tokens
//! one by one without speculation, whatever the drafts were (on a dense model and on mixture-of-experts
//! models whose MTP head is itself sparse, in the `qwen3_5_moe` and Qwen3-Next forms); and a model
//! without an MTP head refuses.

use deltaserve_backend::{
    Backend, BackendError, CacheOp, SeqChunk, SnapshotLoc, SpecCommit, StepBatch, StepOut, Want, argmax, step_logits,
};
use deltaserve_cpu::{CpuBackend, CpuCacheConfig, CpuModel, ForwardError};
use deltaserve_model::synth::{MtpVariant, Preset, write_model_json, write_model_with};
use deltaserve_plan::StateDtype;

const PAGE: usize = 8;

/// The model shapes the tests run on.
#[derive(Clone, Copy, Debug)]
enum Form {
    /// The `tiny` preset (dense).
    Dense,
    /// The `tiny-moe` preset (`qwen3_5_moe`: experts in every layer and in the MTP head).
    Qwen35Moe,
    /// The small Qwen3-Next mixture of experts with layer 2 dense (layer 0, and so the MTP head, sparse;
    /// top-k probabilities not renormalised).
    Qwen3NextMoe,
}

fn model(variant: MtpVariant, tag: &str) -> CpuModel {
    model_of(Form::Dense, variant, tag)
}

fn model_of(form: Form, variant: MtpVariant, tag: &str) -> CpuModel {
    let dir = std::env::temp_dir().join(format!("ds-spec-cpu-{tag}-{form:?}-{}", std::process::id()));
    match form {
        Form::Dense => write_model_with(&dir, Preset::Tiny, None, 5, variant, |_, _| {}),
        Form::Qwen35Moe => write_model_with(&dir, Preset::TinyMoe, None, 5, variant, |_, _| {}),
        Form::Qwen3NextMoe => {
            let mut c = Preset::small_qwen3_next_moe();
            c["mlp_only_layers"] = vec![2u64].into();
            write_model_json(&dir, Preset::Qwen3Next80bA3b, c, 5, variant, |_, _| {})
        }
    }
    .unwrap();
    let model = CpuModel::load(&dir).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    model
}

fn cache_cfg() -> CpuCacheConfig {
    CpuCacheConfig { num_pages: 32, page_size: PAGE, num_slots: 2, snapshot_slots: 2, host_snapshot_slots: 0 }
}

fn chunk(slot: u32, start: usize, tokens: &[u32], draft: usize) -> SeqChunk {
    let tokens = tokens.to_vec();
    SeqChunk {
        seq_id: 7,
        slot,
        pages: (0..32).collect(),
        start,
        tokens,
        want_logits: true,
        draft,
        ..Default::default()
    }
}

fn batch(c: SeqChunk) -> StepBatch {
    StepBatch { seqs: vec![c], ..StepBatch::default() }
}

/// Greedy decode without speculation: the generated tokens and the logits row before each of them.
fn reference(m: CpuModel, prompt: &[u32], n: usize, state: StateDtype) -> (Vec<u32>, Vec<Vec<f32>>) {
    let mut b = CpuBackend::new(m, cache_cfg()).with_state_dtype(state);
    let mut rows = Vec::new();
    let mut out = Vec::new();
    let mut logits = Vec::new();
    step_logits(&mut b, &batch(chunk(0, 0, prompt, 0)), &mut logits).unwrap();
    for pos in prompt.len()..prompt.len() + n {
        let t = argmax(&logits);
        out.push(t);
        rows.push(std::mem::take(&mut logits));
        step_logits(&mut b, &batch(chunk(0, pos, &[t], 0)), &mut logits).unwrap();
    }
    (out, rows)
}

/// Speculative greedy decode where draft i of step s is right when `right(s, i)` (else a wrong token):
/// every accepted prefix length occurs. Checks each verified row against the reference, bit for bit.
fn speculative(
    m: CpuModel,
    prompt: &[u32],
    reference: &(Vec<u32>, Vec<Vec<f32>>),
    (k, snapshot, state): (usize, bool, StateDtype),
) {
    let (want, ref_rows) = reference;
    let vocab = m.dims.vocab as u32;
    let mut b = CpuBackend::with_speculation(m, cache_cfg(), 4).unwrap().with_state_dtype(state);
    assert_eq!(b.capabilities().max_draft_tokens, 4);
    let mut logits = Vec::new();
    step_logits(&mut b, &batch(chunk(0, 0, prompt, 0)), &mut logits).unwrap();
    assert_eq!(logits, ref_rows[0], "prefill logits");
    let mut slot = 0u32;
    let mut g = 0; // tokens generated (and emitted) so far
    let mut step = 0usize;
    let mut accepted_total = 0;
    while g + 2 < want.len() {
        let kk = k.min(want.len() - g - 2);
        let pattern = |i: usize| !(step * 7 + i * 3).is_multiple_of(5);
        let mut picker = |_: u64, i: usize, row: &[f32]| {
            assert_eq!(row.len(), vocab as usize);
            let truth = want[g + 1 + i];
            if pattern(i) { truth } else { (truth + 1) % vocab }
        };
        let mut out = StepOut::default();
        let c = chunk(slot, prompt.len() + g, &[want[g]], kk);
        b.step(&batch(c.clone()), Want::Drafts(&mut picker), &mut out).unwrap();
        let (rows, drafts) = (out.logits, out.drafts);
        assert_eq!(rows.len(), (kk + 1) * vocab as usize);
        assert_eq!(drafts.len(), 1);
        assert_eq!(drafts[0].len(), kk);
        // Greedy acceptance: row i is the model's prediction after draft i.
        let mut accepted = 0;
        for (i, row) in rows.chunks_exact(vocab as usize).enumerate() {
            assert_eq!(row, &ref_rows[g + 1 + i][..], "step {step}: verified row {i} differs from plain decode");
            let y = argmax(row);
            assert_eq!(y, want[g + 1 + i]);
            if i < kk && drafts[0][i] == y {
                accepted += 1;
            } else {
                break;
            }
        }
        accepted_total += accepted;
        let commit = SpecCommit { seq_id: 7, slot, pages: c.pages.clone(), start: c.start, accepted: accepted + 1 };
        b.commit_speculative(&[commit]).unwrap();
        g += accepted + 1;
        step += 1;
        if snapshot && step.is_multiple_of(3) {
            // Move the sequence to the other slot through a snapshot: the state (pending hidden included)
            // is a committed one.
            let other = 1 - slot;
            let ops = vec![
                CacheOp::SaveState { slot, to: SnapshotLoc::Device(0) },
                CacheOp::RestoreState { from: SnapshotLoc::Device(0), slot: other },
            ];
            step_logits(&mut b, &StepBatch { pre: ops, ..StepBatch::default() }, &mut Vec::new()).unwrap();
            slot = other;
        }
    }
    assert!(accepted_total > 0, "the pattern accepts some drafts");
}

#[test]
fn verify_and_commit_match_plain_decode_bit_for_bit() {
    let prompt: Vec<u32> = (0..13).map(|i| (i * 37 + 5) % 1000).collect();
    let r = reference(model(MtpVariant::Random, "ref"), &prompt, 24, StateDtype::F32);
    for k in 1..=4 {
        speculative(model(MtpVariant::Random, "k"), &prompt, &r, (k, k % 2 == 0, StateDtype::F32));
    }
}

/// The DeltaNet state stored bf16: the verify and the commit round it after every token, as decode
/// steps store it, so speculation still gives plain decode's logits bit for bit; the rounding shows in
/// the logits, within a small fraction of them.
#[test]
fn bf16_state_verify_and_commit_match_plain_decode_bit_for_bit() {
    let prompt: Vec<u32> = (0..13).map(|i| (i * 37 + 5) % 1000).collect();
    let r = reference(model(MtpVariant::Random, "ref16"), &prompt, 24, StateDtype::Bf16);
    let exact = reference(model(MtpVariant::Random, "ref32"), &prompt, 24, StateDtype::F32);
    let rel = |a: &[f32], b: &[f32]| {
        let d: f32 = a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum();
        (d / b.iter().map(|y| y * y).sum::<f32>()).sqrt()
    };
    let worst = r.1.iter().zip(&exact.1).map(|(a, b)| rel(a, b)).fold(0.0f32, f32::max);
    assert!(worst > 0.0 && worst < 2e-2, "bf16 state vs f32: worst logits row {worst:.2e}");
    for k in [1, 3, 4] {
        speculative(model(MtpVariant::Random, "k16"), &prompt, &r, (k, k != 1, StateDtype::Bf16));
    }
}

#[test]
fn moe_verify_and_commit_match_plain_decode_bit_for_bit() {
    let prompt: Vec<u32> = (0..11).map(|i| (i * 53 + 2) % 900).collect();
    for form in [Form::Qwen35Moe, Form::Qwen3NextMoe] {
        let m = model_of(form, MtpVariant::Random, "moe-ref");
        let mtp = m.weights.mtp.as_ref().expect("the MTP head is loaded");
        assert!(mtp.layer.moe.is_some(), "{form:?}: the MTP head's MLP is a mixture of experts");
        let r = reference(m, &prompt, 16, StateDtype::F32);
        for k in [1, 3] {
            speculative(model_of(form, MtpVariant::Random, "moe-k"), &prompt, &r, (k, k == 3, StateDtype::F32));
        }
    }
}

#[test]
fn agreeing_head_drafts_what_the_model_predicts() {
    for form in [Form::Dense, Form::Qwen35Moe, Form::Qwen3NextMoe] {
        agreeing_head_drafts(form);
    }
}

fn agreeing_head_drafts(form: Form) {
    let m = model_of(form, MtpVariant::Agreeing { residual_scale: 0.0 }, "agree");
    let vocab = m.dims.vocab;
    let mut b = CpuBackend::with_speculation(m, cache_cfg(), 4).unwrap();
    let prompt = [3u32, 99, 512];
    let mut logits = Vec::new();
    step_logits(&mut b, &batch(chunk(0, 0, &prompt, 0)), &mut logits).unwrap();
    let mut next = argmax(&logits);
    let mut pos = prompt.len();
    for _ in 0..5 {
        let mut out = StepOut::default();
        let mut pick = |_: u64, _: usize, row: &[f32]| argmax(row);
        let c = chunk(0, pos, &[next], 4);
        b.step(&batch(c.clone()), Want::Drafts(&mut pick), &mut out).unwrap();
        let (rows, drafts) = (out.logits, out.drafts);
        let verified: Vec<u32> = rows.chunks_exact(vocab).map(argmax).collect();
        assert_eq!(&verified[..4], &drafts[0][..], "{form:?}: every draft is what the main model predicts");
        b.commit_speculative(&[SpecCommit { seq_id: 7, slot: 0, pages: c.pages, start: pos, accepted: 5 }]).unwrap();
        pos += 5;
        next = verified[4];
    }
}

#[test]
fn bad_speculation_requests_are_errors() {
    let no_head = model(MtpVariant::None, "nohead");
    assert!(!no_head.has_mtp());
    let e = CpuBackend::with_speculation(no_head, cache_cfg(), 2).err().unwrap();
    assert!(matches!(e, ForwardError::NoMtpHead), "{e}");
    for k in [0, 5] {
        let e = CpuBackend::with_speculation(model(MtpVariant::Random, "badk"), cache_cfg(), k).err().unwrap();
        assert!(e.to_string().contains("1..=4"), "{e}");
    }
    // A backend without speculation refuses speculative chunks; one with it refuses malformed ones.
    let mut plain = CpuBackend::new(model(MtpVariant::Random, "plain"), cache_cfg());
    let mut pick = |_: u64, _: usize, _: &[f32]| 0u32;
    let e = plain.step(&batch(chunk(0, 3, &[1], 2)), Want::Drafts(&mut pick), &mut StepOut::default());
    assert!(matches!(e, Err(BackendError::Unsupported(_))), "{e:?}");
    let mut spec = CpuBackend::with_speculation(model(MtpVariant::Random, "malformed"), cache_cfg(), 2).unwrap();
    for c in [chunk(0, 3, &[1], 3), chunk(0, 0, &[1], 1), chunk(0, 3, &[1, 2], 1)] {
        let e = spec.step(&batch(c), Want::Drafts(&mut pick), &mut StepOut::default());
        assert!(matches!(e, Err(BackendError::InvalidStep(_))), "{e:?}");
    }
    let e = spec.commit_speculative(&[SpecCommit { seq_id: 1, slot: 0, pages: vec![0], start: 3, accepted: 1 }]);
    assert!(matches!(e, Err(BackendError::InvalidStep(_))), "{e:?}");
}
