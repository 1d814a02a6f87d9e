//! Prompt log-probabilities on the CPU backend: every prompt token (after the first) is scored once, in
//! order, equal to the model's own distribution at its position, whatever the chunking — chunks cut to
//! the backend's logits rows, beside other requests, with a cached copy of the prompt that must not be
//! used; a prompt scored after greedy generation gives its generated tokens the logprobs they were
//! generated with; a backend that cannot return every row's logits refuses such requests.

mod common;

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use deltaserve_backend::{
    ArenaStats, Backend, BackendError, Capabilities, Feed, Pick, Picked, SeqChunk, SpecCommit, StepBatch, StepOut, Want,
};
use deltaserve_cpu::{CpuBackend, GdnMode, Logits};
use deltaserve_engine::{EngineError, EngineHandle, Event, Request, RequestStream, SamplingParams, TokenLogprob};
use deltaserve_text::Tokenizer;

use common::{Setup, cache_cfg, collect, load_model, tiny_model};

fn model_dir() -> &'static PathBuf {
    static D: OnceLock<PathBuf> = OnceLock::new();
    D.get_or_init(|| tiny_model("prompt-logprobs", 5))
}

fn tokenizer() -> Arc<Tokenizer> {
    Arc::new(Tokenizer::from_file(&model_dir().join("tokenizer.json")).unwrap())
}

/// The CPU backend returning at most `rows` logits rows a step (`prompt_logits` as given), recording the
/// most any step asked for.
struct Capped {
    inner: CpuBackend,
    rows: usize,
    prompt_logits: bool,
    most: Arc<AtomicUsize>,
}

impl Backend for Capped {
    fn capabilities(&self) -> Capabilities {
        Capabilities { max_logits_rows: self.rows, prompt_logits: self.prompt_logits, ..self.inner.capabilities() }
    }
    fn step(&mut self, batch: &StepBatch, want: Want<'_>, out: &mut StepOut) -> Result<(), BackendError> {
        let rows: usize = batch.seqs.iter().map(SeqChunk::logits_rows).sum();
        self.most.fetch_max(rows, Ordering::SeqCst);
        deltaserve_backend::check_logits_rows(batch, &self.capabilities())?;
        self.inner.step(batch, want, out)
    }
    fn launch(&mut self, b: &StepBatch, valid: usize, pick: Pick<'_>, feed: Option<&Feed>) -> Result<(), BackendError> {
        self.inner.launch(b, valid, pick, feed)
    }
    fn pick_launched(&mut self, pick: Pick<'_>) -> Result<(), BackendError> {
        self.inner.pick_launched(pick)
    }
    fn collect(&mut self, out: &mut Picked) -> Result<(), BackendError> {
        self.inner.collect(out)
    }
    fn commit_speculative(&mut self, commits: &[SpecCommit]) -> Result<(), BackendError> {
        self.inner.commit_speculative(commits)
    }
    fn arena_stats(&self) -> ArenaStats {
        self.inner.arena_stats()
    }
}

/// An engine over the tiny model with an 8-token step budget, three sequences, the prefix cache on and
/// `rows` logits rows a step.
fn start(rows: usize, prompt_logits: bool) -> (EngineHandle, Arc<AtomicUsize>) {
    let setup = Setup { max_batch_tokens: 8, num_pages: 64, max_seqs: 3, prefix_cache: true };
    let sched = setup.sched(4);
    let most = Arc::new(AtomicUsize::new(0));
    let inner = CpuBackend::new(load_model(model_dir()), cache_cfg(&sched));
    let backend = Capped { inner, rows, prompt_logits, most: most.clone() };
    (EngineHandle::start(Box::new(backend), sched, Some(tokenizer())), most)
}

fn prompt(len: usize, seed: u32) -> Vec<u32> {
    (0..len as u32).map(|i| 3 + (i * 37 + seed * 11) % 200).collect()
}

fn scoring(prompt: Vec<u32>, max_tokens: usize, top: usize) -> Request {
    Request { prompt, max_tokens, sampling: SamplingParams::greedy(), prompt_logprobs: Some(top), ..Request::default() }
}

/// A scored prompt token: its id, log-probability (with alternatives) and rank.
type Scored = (u32, TokenLogprob, usize);

/// A stream's prompt scores (checked to start at token 1 and follow each other), then its generated
/// tokens and their logprobs.
fn scores_and_tokens(mut s: RequestStream) -> (Vec<Scored>, Vec<(u32, f32)>) {
    let (mut scores, mut tokens) = (Vec::new(), Vec::new());
    loop {
        match s.blocking_next() {
            Some(Event::PromptLogprobs { from, tokens: ids, logprobs, ranks }) => {
                assert!(tokens.is_empty(), "prompt scores after a generated token");
                assert_eq!(from, 1 + scores.len(), "scores continue where the last ones ended");
                assert!(ids.len() == logprobs.len() && ids.len() == ranks.len());
                scores.extend(ids.into_iter().zip(logprobs).zip(ranks).map(|((i, l), r)| (i, l, r)));
            }
            Some(Event::Token { id, logprob, .. }) => tokens.push((id, logprob.map_or(f32::NAN, |l| l.logprob))),
            Some(Event::Finished { .. }) => return (scores, tokens),
            Some(Event::Prefill { .. }) => {}
            Some(Event::Error(e)) => panic!("request failed: {e}"),
            None => panic!("stream ended early"),
        }
    }
}

/// The model's log-softmax over the valid ids at every position of `tokens`, run in one forward.
fn reference(tokens: &[u32], valid: usize) -> Vec<Vec<f32>> {
    let model = load_model(model_dir());
    let mut state = model.new_sequence();
    let logits = model.forward(&mut state, tokens, GdnMode::Auto, Logits::All).unwrap();
    logits
        .chunks_exact(model.dims.vocab)
        .map(|row| {
            let row = &row[..valid];
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let lse = max + row.iter().map(|x| (x - max).exp()).sum::<f32>().ln();
            row.iter().map(|x| x - lse).collect()
        })
        .collect()
}

fn valid_vocab() -> usize {
    tokenizer().vocab_size().min(load_model(model_dir()).dims.vocab)
}

#[test]
fn every_prompt_token_is_scored_once_as_the_model_scores_it() {
    let (engine, most) = start(4, true);
    let p = prompt(29, 1);
    // The same prompt cached first: the scored request must not start from it.
    collect(engine.submit(Request { prompt: p.clone(), max_tokens: 2, ..Request::default() }).unwrap());
    let others: Vec<RequestStream> = (0..2)
        .map(|i| engine.submit(Request { prompt: prompt(20, 7 + i), max_tokens: 12, ..Request::default() }).unwrap())
        .collect();
    let (scores, _) = scores_and_tokens(engine.submit(scoring(p.clone(), 3, 4)).unwrap());
    for s in others {
        collect(s);
    }
    // Steps filled the backend's rows (the 29-token prompt was cut to them), never more.
    assert_eq!(most.load(Ordering::SeqCst), 4, "the most logits rows a step asked for");
    assert_eq!(scores.len(), p.len() - 1, "every prompt token but the first");
    let want = reference(&p, valid_vocab());
    for (i, (id, lp, rank)) in scores.iter().enumerate() {
        let row = &want[i];
        assert_eq!(*id, p[i + 1]);
        assert!(
            (lp.logprob - row[*id as usize]).abs() < 1e-4,
            "token {}: {} vs {}",
            i + 1,
            lp.logprob,
            row[*id as usize]
        );
        let better = row.iter().filter(|&&x| x > row[*id as usize]).count();
        assert_eq!(*rank, better + 1, "token {}", i + 1);
        assert_eq!(lp.top.len(), 4);
        let best = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        assert!((lp.top[0].1 - best).abs() < 1e-4 && lp.top.windows(2).all(|w| w[0].1 >= w[1].1));
    }
    engine.shutdown(true);
}

#[test]
fn generated_tokens_scored_as_a_prompt_keep_their_logprobs() {
    let (engine, _) = start(5, true);
    let p = prompt(13, 3);
    let greedy = Request {
        prompt: p.clone(),
        max_tokens: 6,
        sampling: SamplingParams::greedy(),
        logprobs: Some(0),
        ..Request::default()
    };
    let (_, generated) = scores_and_tokens(engine.submit(greedy).unwrap());
    let mut whole = p.clone();
    whole.extend(generated.iter().map(|g| g.0));
    let (scores, _) = scores_and_tokens(engine.submit(scoring(whole, 1, 0)).unwrap());
    let tail = &scores[scores.len() - generated.len()..];
    for ((id, lp), (sid, slp, rank)) in generated.iter().zip(tail) {
        assert_eq!(id, sid);
        assert!((lp - slp.logprob).abs() < 1e-4, "{lp} generated, {} scored", slp.logprob);
        assert_eq!(*rank, 1, "a greedy token is the most likely one");
        assert!(slp.top.is_empty());
    }
    engine.shutdown(true);
}

#[test]
fn a_backend_without_every_rows_logits_refuses_prompt_scores() {
    let (engine, _) = start(3, false);
    assert!(!engine.scores_prompts());
    match engine.submit(scoring(prompt(5, 0), 1, 0)) {
        Err(EngineError::Invalid(m)) => assert!(m.contains("prompt log-probabilities"), "{m}"),
        other => panic!("expected a refusal, got {:?}", other.map(|_| ())),
    }
    // Plain requests still run.
    let out = collect(engine.submit(Request { prompt: prompt(5, 0), max_tokens: 2, ..Request::default() }).unwrap());
    assert_eq!(out.ids.len(), 2);
    engine.shutdown(true);
}
