//! Requests with images through the engine on the CPU backend. On the HF fixture `fixtures/hf/qwen35_vision`
//! (two images of different grids in one prompt, `scripts/hf_vision_fixtures.py`) the prompt's last logits
//! and 7 greedy decode steps equal HF's within 1e-3 relative with the same ids, with a step budget that
//! splits the first image across two steps (its tower runs once). Preemption (recompute), a prefix-cache
//! hit (also one that ends inside an image) and speculative decoding keep every position: each gives the
//! tokens and logits of an uninterrupted run. In the prefix cache an image is its pixel hash: the same
//! image hits, a different one of the same size does not.

mod common;
#[path = "../../cpu/tests/hf_vision_fixture/mod.rs"]
mod hf_vision_fixture;

use std::sync::{Arc, Mutex};

use deltaserve_backend::{
    ArenaStats, Backend, BackendError, Capabilities, Feed, ImageTokens, Pick, Picked, SpecCommit, StepBatch, StepOut,
    Want,
};
use deltaserve_cpu::CpuBackend;
use deltaserve_engine::{
    EngineError, EngineHandle, EngineOptions, Event, Request, SamplingParams, Usage, logits_with_images,
};
use deltaserve_model::ImagePatches;
use deltaserve_model::synth::{MtpVariant, Preset, write_model_with};

use common::{Setup, cache_cfg};
use hf_vision_fixture::{Reference, fixture, load};

const TOL: f32 = 1e-3;

/// What the engine asked of the backend: every chunk (seq, start, tokens, images' first indices) and
/// every logits row, in step order.
#[derive(Default)]
struct Log {
    chunks: Vec<(u64, usize, usize, Vec<usize>)>,
    rows: Vec<(u64, Vec<f32>)>,
    /// Images whose rows the backend kept after each step.
    kept: Vec<usize>,
}

/// The CPU backend, stepping one step at a time and recording what it ran.
struct Recorder {
    inner: CpuBackend,
    log: Arc<Mutex<Log>>,
}

impl Backend for Recorder {
    fn capabilities(&self) -> Capabilities {
        Capabilities { launches_ahead: false, ..self.inner.capabilities() }
    }
    fn image_tokens(&self) -> Option<ImageTokens> {
        self.inner.image_tokens()
    }
    fn step(&mut self, batch: &StepBatch, want: Want<'_>, out: &mut StepOut) -> Result<(), BackendError> {
        let before = out.logits.len();
        let rows_back = matches!(want, Want::Logits);
        self.inner.step(batch, want, out)?;
        let mut log = self.log.lock().unwrap();
        log.kept.push(self.inner.images_in_flight());
        for c in &batch.seqs {
            let images = c.images.iter().map(|i| i.placed.seq_start).collect();
            log.chunks.push((c.seq_id, c.start, c.tokens.len(), images));
        }
        if rows_back {
            let vocab = self.inner.capabilities().vocab_size;
            let mut rows = out.logits[before..].chunks_exact(vocab);
            for c in batch.seqs.iter().filter(|c| c.want_logits && c.draft == 0) {
                log.rows.push((c.seq_id, rows.next().unwrap().to_vec()));
            }
        }
        Ok(())
    }
    fn launch(&mut self, _: &StepBatch, _: usize, _: Pick<'_>, _: Option<&Feed>) -> Result<(), BackendError> {
        Err(BackendError::Unsupported("launch".into()))
    }
    fn pick_launched(&mut self, _: Pick<'_>) -> Result<(), BackendError> {
        Err(BackendError::Unsupported("pick_launched".into()))
    }
    fn collect(&mut self, _: &mut Picked) -> Result<(), BackendError> {
        Err(BackendError::Unsupported("collect".into()))
    }
    fn commit_speculative(&mut self, commits: &[SpecCommit]) -> Result<(), BackendError> {
        self.inner.commit_speculative(commits)
    }
    fn arena_stats(&self) -> ArenaStats {
        self.inner.arena_stats()
    }
}

/// An engine over the fixture's model, recording into the returned log.
fn engine(s: &Setup) -> (EngineHandle, Arc<Mutex<Log>>) {
    let c = s.sched(4);
    let log = Arc::new(Mutex::new(Log::default()));
    let inner = CpuBackend::new(load(&fixture()), cache_cfg(&c));
    let backend = Recorder { inner, log: log.clone() };
    (EngineHandle::start(Box::new(backend), c, None), log)
}

fn request(prompt: &[u32], images: &[Arc<ImagePatches>], max_tokens: usize, points: Vec<usize>) -> Request {
    Request {
        prompt: prompt.to_vec(),
        max_tokens,
        logprobs: Some(1), // the rows come back to the host, where the recorder sees them
        images: images.to_vec(),
        snapshot_points: points,
        sampling: SamplingParams::greedy(),
        ..Request::default()
    }
}

/// Runs a stream to its end: (tokens, usage, preemptions).
fn finish(mut s: deltaserve_engine::RequestStream) -> (Vec<u32>, Usage, u32) {
    let mut ids = Vec::new();
    loop {
        match s.blocking_next() {
            Some(Event::Token { id, .. }) => ids.push(id),
            Some(Event::Finished { usage, timing, .. }) => return (ids, usage, timing.preemptions),
            other => panic!("request failed: {other:?}"),
        }
    }
}

/// The logits rows of sequence `id`, in order.
fn rows_of(log: &Mutex<Log>, id: u64) -> Vec<Vec<f32>> {
    log.lock().unwrap().rows.iter().filter(|(s, _)| *s == id).map(|(_, r)| r.clone()).collect()
}

/// max |ours − ref| / max |ref|.
fn rel_err(ours: &[f32], reference: &[f32]) -> f32 {
    assert_eq!(ours.len(), reference.len());
    let scale = reference.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    ours.iter().zip(reference).fold(0.0f32, |m, (a, b)| m.max((a - b).abs())) / scale
}

fn same_rows(what: &str, ours: &[Vec<f32>], want: &[Vec<f32>]) {
    assert_eq!(ours.len(), want.len(), "{what}: rows");
    for (i, (a, b)) in ours.iter().zip(want).enumerate() {
        let e = rel_err(a, b);
        assert!(e < 1e-5, "{what}: row {i} differs by {e:.2e}");
    }
}

#[test]
fn fixture_prompt_through_the_engine_matches_hf() {
    let r = Reference::open();
    let (ids, images) = (r.ids("input_ids"), r.shared_images());
    // 16-token steps: image A (tokens 5..29) is split between the first two steps.
    let (e, log) = engine(&Setup { max_batch_tokens: 16, num_pages: 16, max_seqs: 2, prefix_cache: false });
    let stream = e.submit(request(&ids, &images, 8, vec![])).unwrap();
    let id = stream.id;
    let (tokens, usage, _) = finish(stream);
    assert_eq!(usage.prompt_tokens, ids.len());
    assert_eq!(tokens, r.ids("decode_ids")[ids.len()..ids.len() + 8], "greedy ids equal HF's");
    let want = r.f32("decode_logits");
    let vocab = want.len() / 8;
    let rows = rows_of(&log, id);
    assert_eq!(rows.len(), 8, "the prompt's last row and 7 decode rows");
    for (step, (ours, hf)) in rows.iter().zip(want.chunks_exact(vocab)).enumerate() {
        let err = rel_err(ours, hf);
        println!("row {step}: max rel err {err:.2e}");
        assert!(err < TOL, "row {step} differs from HF by {err:.3e}");
    }
    let hf_last = &r.f32("logits")[(ids.len() - 1) * vocab..];
    assert!(rel_err(&rows[0], hf_last) < TOL);
    let chunks = log.lock().unwrap().chunks.clone();
    assert_eq!(chunks[0], (id, 0, 16, vec![6]), "the first step holds the start of image A (tokens 6..30)");
    assert_eq!(chunks[1], (id, 16, 16, vec![6]), "the second step holds the rest of image A");
    // Image A's rows are kept between the two steps (its tower ran once), then dropped.
    assert_eq!(log.lock().unwrap().kept[..3], [1, 0, 0]);
    e.shutdown(false);
}

/// An image with more patches than `max_image_tokens_per_step` (the bound the plan sized the tower's
/// workspace for) is refused at submission, naming the limit, before anything is queued or encoded; at
/// the bound the same request runs.
#[test]
fn images_over_the_patch_bound_are_refused_at_submission() {
    let r = Reference::open();
    let (ids, images) = (r.ids("input_ids"), r.shared_images());
    let largest = images.iter().map(|i| i.patches()).max().unwrap();
    let start = |bound: usize| {
        let c = Setup { max_batch_tokens: 16, num_pages: 16, max_seqs: 2, prefix_cache: false }.sched(4);
        let log = Arc::new(Mutex::new(Log::default()));
        let backend = Recorder { inner: CpuBackend::new(load(&fixture()), cache_cfg(&c)), log: log.clone() };
        let opts = EngineOptions { max_image_tokens_per_step: bound, ..EngineOptions::default() };
        (EngineHandle::start_with(Box::new(backend), c, None, opts).unwrap(), log)
    };
    let (e, log) = start(largest - 1);
    let err = e.submit(request(&ids, &images, 2, vec![])).err().expect("refused");
    let m = err.to_string();
    assert!(matches!(err, EngineError::Invalid(_)), "{m}");
    assert!(m.contains(&format!("{largest} patches")) && m.contains(&format!("limit of {}", largest - 1)), "{m}");
    assert!(m.contains("--max-image-tokens-per-step"), "{m}");
    std::thread::sleep(std::time::Duration::from_millis(50));
    assert_eq!(e.stats().steps, 0, "nothing was queued");
    assert!(log.lock().unwrap().chunks.is_empty());
    e.shutdown(false);
    let (e, _) = start(largest);
    let (tokens, _, _) = finish(e.submit(request(&ids, &images, 2, vec![])).unwrap());
    assert_eq!(tokens.len(), 2);
    e.shutdown(false);
}

/// Every position's logits of the prompt (one position a step, as `deltaserve logits` runs it) equal HF's.
#[test]
fn scoring_every_position_matches_hf() {
    let r = Reference::open();
    let (ids, images) = (r.ids("input_ids"), r.shared_images());
    let c = Setup { max_batch_tokens: 64, num_pages: 8, max_seqs: 1, prefix_cache: false }.sched(4);
    let mut backend = CpuBackend::new(load(&fixture()), cache_cfg(&c));
    let pages: Vec<u32> = (0..8).collect();
    let mut logits = Vec::new();
    logits_with_images(&mut backend, 0, &pages, &ids, &images, |_, row| logits.extend_from_slice(row)).unwrap();
    let err = rel_err(&logits, &r.f32("logits"));
    println!("all {} positions: max rel err {err:.2e}", ids.len());
    assert!(err < TOL, "{err:.3e}");
    assert_eq!(backend.images_in_flight(), 0);
    // Without the images the prompt is refused, naming the mismatch.
    let e = logits_with_images(&mut backend, 0, &pages, &ids, &images[..1], |_, _| {}).unwrap_err();
    assert!(e.to_string().contains("has no image"), "{e}");
}

/// The fixture's prompt and images, its greedy tokens and logits rows on an engine with no cache and
/// roomy pages.
fn solo(prompt: &[u32], images: &[Arc<ImagePatches>], max_tokens: usize) -> (Vec<u32>, Vec<Vec<f32>>) {
    let (e, log) = engine(&Setup { max_batch_tokens: 64, num_pages: 32, max_seqs: 2, prefix_cache: false });
    let s = e.submit(request(prompt, images, max_tokens, vec![])).unwrap();
    let id = s.id;
    let (tokens, _, _) = finish(s);
    e.shutdown(false);
    (tokens, rows_of(&log, id))
}

#[test]
fn preemption_recomputes_the_same_positions() {
    let r = Reference::open();
    let (ids, images) = (r.ids("input_ids"), r.shared_images());
    let (want_tokens, want_rows) = solo(&ids, &images, 12);
    // Two sequences of 65 positions, 9 pages each, over 12 pages: the newer is preempted and recomputed
    // (its prompt, images included, runs again from the start, in 24-token steps).
    let (e, log) = engine(&Setup { max_batch_tokens: 24, num_pages: 12, max_seqs: 2, prefix_cache: false });
    let streams: Vec<_> = (0..2).map(|_| e.submit(request(&ids, &images, 12, vec![])).unwrap()).collect();
    let ids_of: Vec<u64> = streams.iter().map(|s| s.id).collect();
    let outs: Vec<_> = streams.into_iter().map(finish).collect();
    assert!(outs.iter().map(|o| o.2).sum::<u32>() > 0, "the KV budget should have forced a preemption");
    for (i, (tokens, _, _)) in outs.iter().enumerate() {
        assert_eq!(tokens, &want_tokens, "request {i}");
        same_rows(&format!("request {i}"), &rows_of(&log, ids_of[i]), &want_rows);
    }
    e.shutdown(false);
}

#[test]
fn prefix_cache_hits_the_same_image_only() {
    let r = Reference::open();
    let (ids, images) = (r.ids("input_ids"), r.shared_images());
    // Snapshots inside image A (20) and after image B (44).
    let points = vec![20, 44];
    let (e, log) = engine(&Setup { max_batch_tokens: 64, num_pages: 48, max_seqs: 2, prefix_cache: true });
    let run = |imgs: &[Arc<ImagePatches>]| {
        let s = e.submit(request(&ids, imgs, 6, points.clone())).unwrap();
        let id = s.id;
        let (tokens, usage, _) = finish(s);
        (tokens, usage.cached_tokens, rows_of(&log, id))
    };
    let (first, cached, first_rows) = run(&images);
    assert_eq!(cached, 0);
    let (again, cached, again_rows) = run(&images);
    assert_eq!(cached, 44, "the same images: the snapshot after image B");
    assert_eq!(again, first);
    same_rows("cache hit", &again_rows, &first_rows);

    // Image B replaced by a different image of the same size: the hit stops inside image A (20) and the
    // rest of A runs its tower again; the output is that prompt's own.
    let mut other_b = (*images[1]).clone();
    other_b.hash = [9; 32];
    other_b.pixels.iter_mut().for_each(|p| *p = -*p);
    let changed = [images[0].clone(), Arc::new(other_b)];
    let (tokens, cached, rows) = run(&changed);
    assert_eq!(cached, 20, "a different image B is not cached");
    let (want_tokens, want_rows) = solo(&ids, &changed, 6);
    assert_eq!(tokens, want_tokens);
    same_rows("hit inside image A", &rows, &want_rows);

    // The same pixels under another hash are another image: nothing of image A is reused.
    let mut renamed_a = (*images[0]).clone();
    renamed_a.hash = [7; 32];
    let (tokens, cached, _) = run(&[Arc::new(renamed_a), images[1].clone()]);
    assert_eq!(cached, 0);
    assert_eq!(tokens, first);
    e.shutdown(false);
}

/// A synthetic tiny model with a vision tower and an agreeing MTP head: speculative decoding after a
/// prompt with images gives the tokens of plain decoding (the drafts' positions carry the rope delta).
#[test]
fn speculative_decoding_after_images_keeps_the_tokens() {
    let dir = std::env::temp_dir().join(format!("ds-engine-images-{}", std::process::id()));
    write_model_with(&dir, Preset::Tiny, None, 21, MtpVariant::Agreeing { residual_scale: 0.05 }, |_, _| {}).unwrap();
    let model = || load(&dir);
    let it = CpuBackend::new(model(), cache_cfg(&setup_small().sched(4))).image_tokens().unwrap();
    // Two images of 2×3 and 1×1 merged tokens between text.
    let image = |grid_thw: [usize; 3], seed: u8| {
        let n = grid_thw.iter().product::<usize>() * it.patch_len;
        let pixels = (0..n).map(|i| ((i * 7 + seed as usize) % 13) as f32 / 6.5 - 1.0).collect();
        Arc::new(ImagePatches { grid_thw, pixels, hash: [seed; 32] })
    };
    let images = [image([1, 4, 6], 1), image([1, 2, 2], 2)];
    let mut prompt: Vec<u32> = vec![3, 14, 15];
    prompt.extend([it.image_token_id; 6]);
    prompt.extend([92, 65]);
    prompt.extend([it.image_token_id; 1]);
    prompt.extend([35, 89, 79]);
    let run = |k: usize| {
        let c = setup_small().sched(4);
        let backend = if k == 0 {
            CpuBackend::new(model(), cache_cfg(&c))
        } else {
            CpuBackend::with_speculation(model(), cache_cfg(&c), k).unwrap()
        };
        let e = if k == 0 {
            EngineHandle::start(Box::new(backend), c, None)
        } else {
            EngineHandle::start_speculative(Box::new(backend), c, None, k).unwrap()
        };
        let req = Request {
            prompt: prompt.clone(),
            max_tokens: 16,
            images: images.to_vec(),
            sampling: SamplingParams::greedy(),
            ..Request::default()
        };
        let out = finish(e.submit(req).unwrap()).0;
        let stats = e.stats();
        e.shutdown(false);
        (out, stats.spec_accepted)
    };
    let (plain, _) = run(0);
    let (spec, accepted) = run(3);
    assert_eq!(spec, plain);
    assert!(accepted > 0, "the agreeing head's drafts are accepted");
    let _ = std::fs::remove_dir_all(&dir);
}

fn setup_small() -> Setup {
    Setup { max_batch_tokens: 5, num_pages: 16, max_seqs: 2, prefix_cache: false }
}
