//! The CPU reference engine against HF transformers 5.17 (fp32 torch path) on small random models
//! saved by `save_pretrained` in bf16 (`fixtures/hf/*`, made by `scripts/hf_fixtures.py`):
//! every logit within 1e-3 of the largest |logit|, for prompts of 1, 37, 300 and 1100 tokens
//! (full passes, and the longest prompt fed in uneven pieces), and the greedy decode trace
//! reproduced token for token with per-step logits. The fixtures include mixture-of-experts models
//! (`qwen35_moe`: every layer sparse, renormalised top-k; `qwen3next_moe`: a dense layer among sparse
//! ones, plain top-k probabilities), with prompts of up to 300 tokens, and a block-FP8 checkpoint written
//! by transformers' `FineGrainedFP8Config` (`qwen35_fp8`, against HF's own dequantisation).

use std::path::{Path, PathBuf};

use deltaserve_backend::argmax;
use deltaserve_cpu::{CpuModel, GdnMode, Logits};
use deltaserve_model::{Checkpoint, ModelConfig, ModelWeights};

const TOL: f32 = 1e-3;

fn fixture_dirs() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/hf");
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(&root)
        .unwrap_or_else(|e| panic!("{}: {e}", root.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| has_prompts(&p.join("reference.json")))
        .collect();
    dirs.sort();
    assert!(dirs.len() >= 6, "expected the six HF fixture models in {}", root.display());
    dirs
}

/// Text fixtures list their prompts (the image fixture is checked by `hf_vision.rs`).
fn has_prompts(reference: &Path) -> bool {
    let Ok(text) = std::fs::read_to_string(reference) else { return false };
    serde_json::from_str::<serde_json::Value>(&text).is_ok_and(|v| v.get("prompts").is_some())
}

fn load(dir: &Path) -> CpuModel {
    let cfg = ModelConfig::from_dir(dir).unwrap();
    let ckpt = Checkpoint::open(dir).unwrap();
    let w = ModelWeights::load_f32(&ckpt, &cfg).unwrap();
    CpuModel::new(cfg, w)
}

fn reference(dir: &Path) -> (serde_json::Value, Checkpoint) {
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap()).unwrap();
    // reference.safetensors holds the f32 logits (and i64 ids, which we read from the JSON).
    (json, Checkpoint::open_file(&dir.join("reference.safetensors")).unwrap())
}

fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

/// max |ours − ref| / max |ref|.
fn rel_err(ours: &[f32], reference: &[f32]) -> f32 {
    assert_eq!(ours.len(), reference.len());
    let scale = reference.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let worst = ours.iter().zip(reference).fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
    worst / scale
}

#[test]
fn full_prompt_logits_match_hf() {
    for dir in fixture_dirs() {
        let model = load(&dir);
        let (json, refs) = reference(&dir);
        for p in json["prompts"].as_array().unwrap() {
            let tokens = ids(&p["ids"]);
            let expected = refs.get(&format!("logits_{}", tokens.len())).unwrap().to_f32().unwrap();
            let mut st = model.new_sequence();
            let got = model.forward(&mut st, &tokens, GdnMode::Auto, Logits::All).unwrap();
            let e = rel_err(&got, &expected);
            println!("{} T={}: max rel err {e:.2e}", dir.display(), tokens.len());
            assert!(
                e < TOL,
                "{}: T={} logits differ from HF by {e:.3e} (relative to max |logit|)",
                dir.display(),
                tokens.len()
            );
        }
    }
}

#[test]
fn prompt_fed_in_uneven_pieces_matches_hf() {
    for dir in fixture_dirs() {
        let model = load(&dir);
        let (json, refs) = reference(&dir);
        // The longest prompt (1100 tokens; 300 for the mixture-of-experts fixtures).
        let p = json["prompts"].as_array().unwrap().iter().max_by_key(|p| p["len"].as_u64()).unwrap();
        let tokens = ids(&p["ids"]);
        let expected = refs.get(&format!("logits_{}", tokens.len())).unwrap().to_f32().unwrap();
        let mut st = model.new_sequence();
        let mut got = Vec::new();
        // Pieces crossing chunk boundaries at awkward offsets, including single tokens (recurrent form).
        let sizes = [1usize, 63, 65, 1, 1, 200, 64, 7, 128, 300];
        let mut at = 0;
        for s in sizes.iter().cycle() {
            if at == tokens.len() {
                break;
            }
            let end = (at + s).min(tokens.len());
            got.extend(model.forward(&mut st, &tokens[at..end], GdnMode::Auto, Logits::All).unwrap());
            at = end;
        }
        let e = rel_err(&got, &expected);
        assert!(e < TOL, "{}: pieces differ from HF by {e:.3e}", dir.display());
    }
}

#[test]
fn greedy_decode_trace_matches_hf() {
    for dir in fixture_dirs() {
        let model = load(&dir);
        let (json, refs) = reference(&dir);
        let dec = &json["decode"];
        let plen = dec["prompt_len"].as_u64().unwrap() as usize;
        let prompt = ids(&json["prompts"].as_array().unwrap().iter().find(|p| p["len"] == plen).unwrap()["ids"]);
        let expected_ids = ids(&dec["generated"]);
        let expected_logits = refs.get("decode_logits").unwrap().to_f32().unwrap();
        let vocab = model.dims.vocab;
        let mut st = model.new_sequence();
        let mut logits = model.forward(&mut st, &prompt, GdnMode::Auto, Logits::Last).unwrap();
        let mut got_ids = Vec::new();
        for step in 0..expected_ids.len() {
            let e = rel_err(&logits, &expected_logits[step * vocab..(step + 1) * vocab]);
            assert!(e < TOL, "{}: decode step {step} logits differ by {e:.3e}", dir.display());
            let id = argmax(&logits);
            got_ids.push(id);
            logits = model.forward(&mut st, &[id], GdnMode::Auto, Logits::Last).unwrap();
        }
        assert_eq!(got_ids, expected_ids, "{}: greedy ids differ from HF", dir.display());
    }
}
