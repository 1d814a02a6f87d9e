//! Constrained decoding (llguidance grammars) with speculative decoding on the CPU backend: drafts
//! that break the grammar (a random MTP head's, and an agreeing head's unmasked argmaxes) are refused
//! at verify and never emitted. For K = 0..4, greedy constrained requests give the same tokens, and
//! every token they emit is one the grammar allowed at its position; unconstrained neighbours in the
//! same steps keep their own tokens; sampling requests under a grammar stay inside it; a constraint
//! that cannot check drafts makes its request decode without them. Without speculation, constrained
//! rows are picked by the backend with their token bitmask, with the tokens of host sampling (a backend
//! that applies no masks). Rows that come back to the host are masked with bitmasks computed while the
//! step ran.

mod common;

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use deltaserve_backend::sampling::{is_allowed, mask_words};
use deltaserve_backend::{
    ArenaStats, Backend, BackendError, Capabilities, Feed, Pick, Picked, SpecCommit, StepBatch, StepOut, Want,
};
use deltaserve_cpu::CpuBackend;
use deltaserve_engine::{
    EngineHandle, Event, FinishReason, Request, SamplingParams, SharedConstraint, TokenConstraint,
};
use deltaserve_model::synth::{MtpVariant, Preset};
use deltaserve_sched::SchedConfig;
use deltaserve_text::{Grammar, GrammarCompiler, GrammarMatcher, Tokenizer};
use serde_json::json;

use common::{Setup, cache_cfg, load_model, wait_idle};

fn model_dir(variant: MtpVariant) -> PathBuf {
    static DIRS: Mutex<Vec<(String, PathBuf)>> = Mutex::new(Vec::new());
    let key = format!("{variant:?}");
    let mut dirs = DIRS.lock().unwrap();
    if let Some((_, d)) = dirs.iter().find(|(k, _)| *k == key) {
        return d.clone();
    }
    let d = std::env::temp_dir().join(format!("ds-constrained-{}-{}", std::process::id(), dirs.len()));
    deltaserve_text::synth_model::write_synthetic_model_with(&d, Preset::Tiny, None, 21, variant, |_, _| {}).unwrap();
    dirs.push((key, d.clone()));
    d
}

fn tokenizer(variant: MtpVariant) -> Arc<Tokenizer> {
    Arc::new(Tokenizer::from_file(&model_dir(variant).join("tokenizer.json")).unwrap())
}

fn sched() -> SchedConfig {
    Setup { max_batch_tokens: 24, num_pages: 64, max_seqs: 4, prefix_cache: false }.sched(0)
}

fn backend(variant: MtpVariant, k: usize) -> CpuBackend {
    let c = sched();
    let cache = cache_cfg(&c);
    let model = load_model(&model_dir(variant));
    if k == 0 { CpuBackend::new(model, cache) } else { CpuBackend::with_speculation(model, cache, k).unwrap() }
}

/// An engine over `variant`'s model: plain (`k == 0`) or speculative with `k` drafts.
fn engine(variant: MtpVariant, k: usize) -> EngineHandle {
    let tok = Some(tokenizer(variant));
    if k == 0 {
        EngineHandle::start(Box::new(backend(variant, 0)), sched(), tok)
    } else {
        EngineHandle::start_speculative(Box::new(backend(variant, k)), sched(), tok, k).unwrap()
    }
}

/// What the engine asked of a [`Masking`] backend.
#[derive(Default)]
struct Asked {
    /// Rows picked with a token mask.
    masked_rows: usize,
    /// Steps whose rows came back as logits.
    logits_steps: usize,
    /// Steps launched ahead with their picks left for later.
    later_picks: usize,
}

/// The CPU backend, applying token masks or not (then the engine samples constrained rows on the
/// host), counting what it is asked.
struct Masking {
    inner: CpuBackend,
    masks: bool,
    asked: Arc<Mutex<Asked>>,
}

impl Masking {
    fn count(&self, pick: &Pick<'_>) {
        if let Pick::Sample(rows) = pick {
            self.asked.lock().unwrap().masked_rows += rows.iter().filter(|r| r.allowed.is_some()).count();
        }
    }
}

impl Backend for Masking {
    fn capabilities(&self) -> Capabilities {
        Capabilities { masks_tokens: self.masks, ..self.inner.capabilities() }
    }
    fn step(&mut self, batch: &StepBatch, want: Want<'_>, out: &mut StepOut) -> Result<(), BackendError> {
        match &want {
            Want::Tokens { pick, .. } => self.count(pick),
            _ => self.asked.lock().unwrap().logits_steps += 1,
        }
        self.inner.step(batch, want, out)
    }
    fn launch(&mut self, b: &StepBatch, valid: usize, pick: Pick<'_>, feed: Option<&Feed>) -> Result<(), BackendError> {
        self.count(&pick);
        if let Pick::Later = pick {
            self.asked.lock().unwrap().later_picks += 1;
        }
        self.inner.launch(b, valid, pick, feed)
    }
    fn pick_launched(&mut self, pick: Pick<'_>) -> Result<(), BackendError> {
        self.count(&pick);
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

/// What the constraints of a test were asked.
#[derive(Default)]
struct Counts {
    /// Tokens they were told of that they refused.
    refused: AtomicUsize,
    /// Bitmasks they gave (rows masked by the backend, or with a mask computed while the step ran).
    bitmasks: AtomicUsize,
}

/// A grammar as a request's constraint (only the end token once it allows nothing further).
struct Checked {
    matcher: GrammarMatcher,
    eos: u32,
    counts: Arc<Counts>,
    /// Whether it checks drafts (else its request decodes without them).
    checks_drafts: bool,
}

impl TokenConstraint for Checked {
    fn mask(&mut self, row: &mut [f32]) {
        if !self.matcher.mask(row) {
            for (id, l) in row.iter_mut().enumerate() {
                if id as u32 != self.eos {
                    *l = f32::NEG_INFINITY;
                }
            }
        }
    }
    fn allowed(&mut self, bits: &mut [u32]) {
        self.counts.bitmasks.fetch_add(1, Ordering::SeqCst);
        if !self.matcher.allowed(bits) {
            bits[self.eos as usize / 32] |= 1 << (self.eos % 32);
        }
    }
    fn accept(&mut self, token: u32) {
        if self.matcher.accept(token).is_err() && token != self.eos {
            self.counts.refused.fetch_add(1, Ordering::SeqCst);
        }
    }
    fn allows_prefix(&mut self, tokens: &[u32]) -> Option<usize> {
        self.checks_drafts.then(|| self.matcher.allows_prefix(tokens))
    }
}

struct Grammars {
    compiler: GrammarCompiler,
    eos: u32,
    tok: Arc<Tokenizer>,
}

impl Grammars {
    fn new(variant: MtpVariant) -> Self {
        let tok = tokenizer(variant);
        let eos = tok.token_id("<|im_end|>").unwrap();
        let compiler = GrammarCompiler::new(tok.clone(), tok.vocab_size(), &[eos]).unwrap();
        Self { compiler, eos, tok }
    }

    fn constraint(&self, g: &Grammar, counts: &Arc<Counts>, checks_drafts: bool) -> SharedConstraint {
        let matcher = self.compiler.compile(g).unwrap();
        SharedConstraint::new(Checked { matcher, eos: self.eos, counts: counts.clone(), checks_drafts })
    }

    /// Asserts that the grammar allowed each of `ids` at its position (the end token when it allows
    /// nothing further).
    fn assert_valid(&self, g: &Grammar, ids: &[u32], what: &str) {
        let mut m = self.compiler.compile(g).unwrap();
        let mut bits = vec![0u32; mask_words(self.tok.vocab_size())];
        for (i, &t) in ids.iter().enumerate() {
            let ok = if m.allowed(&mut bits) { is_allowed(&bits, t) } else { t == self.eos };
            assert!(ok, "{what}: token {i} ({t}) of {ids:?} is outside the grammar");
            if t == self.eos {
                assert_eq!(i + 1, ids.len(), "{what}: the end token ends the reply");
                return;
            }
            m.accept(t).unwrap();
        }
    }
}

fn grammars() -> Vec<Grammar> {
    vec![
        Grammar::JsonSchema(json!({
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 6}, "n": {"type": "integer"}},
            "required": ["name", "n"],
        })),
        Grammar::Regex("(yes|no|maybe)( [a-z]{1,5}){1,3}\\.".into()),
        Grammar::Choice(vec!["alpha".into(), "beta gamma".into(), "delta".into()]),
    ]
}

fn collect(mut s: deltaserve_engine::RequestStream) -> (Vec<u32>, FinishReason) {
    let mut ids = Vec::new();
    loop {
        match s.blocking_next() {
            Some(Event::Token { id, .. }) => ids.push(id),
            Some(Event::Finished { reason, .. }) => return (ids, reason),
            Some(Event::Prefill { .. } | Event::PromptLogprobs { .. }) => {}
            Some(Event::Error(e)) => panic!("request failed: {e}"),
            None => panic!("stream ended early"),
        }
    }
}

/// Each grammar's greedy constrained request next to an unconstrained one, all submitted at once:
/// their tokens, and the drafting counters.
fn run(e: &EngineHandle, gs: &Grammars, sampling: &SamplingParams, counts: &Arc<Counts>) -> Vec<Vec<u32>> {
    let mut streams = Vec::new();
    for (i, g) in grammars().iter().enumerate() {
        let base = Request {
            prompt: (0..5 + 3 * i as u32).map(|t| 100 + 37 * t).collect(),
            max_tokens: 40,
            sampling: sampling.clone(),
            stop_token_ids: vec![gs.eos],
            ..Request::default()
        };
        let free = Request { prompt: vec![7, 8, 9, 10 + i as u32], max_tokens: 12, ..base.clone() };
        streams.push(e.submit(Request { constraint: Some(gs.constraint(g, counts, true)), ..base }).unwrap());
        streams.push(e.submit(free).unwrap());
    }
    streams.into_iter().map(|s| collect(s).0).collect()
}

#[test]
fn drafts_under_a_grammar_never_break_it_and_greedy_tokens_equal_plain_decoding() {
    let greedy = SamplingParams::greedy();
    for variant in [MtpVariant::Random, MtpVariant::Agreeing { residual_scale: 0.0 }] {
        let gs = Grammars::new(variant);
        let counts = Arc::new(Counts::default());
        let plain = engine(variant, 0);
        let want = run(&plain, &gs, &greedy, &counts);
        plain.shutdown(true);
        for (g, ids) in grammars().iter().zip(want.iter().step_by(2)) {
            gs.assert_valid(g, ids, &format!("{variant:?} plain"));
        }
        for k in 1..=4 {
            let e = engine(variant, k);
            let before = counts.bitmasks.load(Ordering::SeqCst);
            let got = run(&e, &gs, &greedy, &counts);
            let stats = wait_idle(&e);
            e.shutdown(true);
            // Verify steps mask their first rows with bitmasks computed while the step ran.
            assert!(counts.bitmasks.load(Ordering::SeqCst) > before, "{variant:?} K={k}");
            assert_eq!(got, want, "{variant:?} K={k}: the tokens of plain decoding");
            assert!(stats.spec_steps > 0 && stats.spec_drafted > 0, "{variant:?} K={k}: {stats:?}");
            if variant != MtpVariant::Random {
                // The agreeing head's drafts are the target's unmasked picks: the grammar takes some
                // of them and refuses others.
                assert!(stats.spec_accepted > 0, "{variant:?} K={k}: {stats:?}");
                assert!(stats.spec_accepted < stats.spec_drafted, "{variant:?} K={k}: {stats:?}");
            }
        }
        assert_eq!(counts.refused.load(Ordering::SeqCst), 0, "{variant:?}: no token outside a grammar was emitted");
    }
}

#[test]
fn sampling_under_a_grammar_with_drafts_stays_inside_it() {
    let variant = MtpVariant::Agreeing { residual_scale: 0.05 };
    let gs = Grammars::new(variant);
    let counts = Arc::new(Counts::default());
    let e = engine(variant, 3);
    for seed in 0..4 {
        let sampling = SamplingParams { temperature: 0.9, top_k: 40, seed: Some(seed), ..Default::default() };
        let got = run(&e, &gs, &sampling, &counts);
        for (g, ids) in grammars().iter().zip(got.iter().step_by(2)) {
            gs.assert_valid(g, ids, &format!("seed {seed}"));
        }
    }
    let stats = wait_idle(&e);
    e.shutdown(true);
    assert!(stats.spec_drafted > 0 && stats.spec_accepted > 0, "{stats:?}");
    assert_eq!(counts.refused.load(Ordering::SeqCst), 0);
}

#[test]
fn a_constraint_that_cannot_check_drafts_decodes_without_them() {
    let variant = MtpVariant::Agreeing { residual_scale: 0.0 };
    let gs = Grammars::new(variant);
    let counts = Arc::new(Counts::default());
    let g = &grammars()[1];
    let req = |checks| Request {
        prompt: vec![5, 6, 7],
        max_tokens: 30,
        sampling: SamplingParams::greedy(),
        stop_token_ids: vec![gs.eos],
        constraint: Some(gs.constraint(g, &counts, checks)),
        ..Request::default()
    };
    let plain = engine(variant, 0);
    let (want, _) = collect(plain.submit(req(false)).unwrap());
    plain.shutdown(true);
    let e = engine(variant, 2);
    let (got, _) = collect(e.submit(req(false)).unwrap());
    let stats = wait_idle(&e);
    e.shutdown(true);
    assert_eq!(got, want);
    assert_eq!(stats.spec_drafted, 0, "{stats:?}");
    gs.assert_valid(g, &got, "no drafts");
    assert_eq!(counts.refused.load(Ordering::SeqCst), 0);
}

/// Without speculation, a step with constrained rows is picked by the backend, each constrained row
/// with its token bitmask (no row comes back as logits), and gives the tokens of host sampling, greedy
/// and seeded sampling alike, for the constrained requests and their unconstrained neighbours. Their
/// decode steps run ahead: launched before the previous step's picks are read, picked once the masks
/// that those picks lead to are known.
#[test]
fn token_masks_picked_by_the_backend_equal_host_sampling() {
    let variant = MtpVariant::Random;
    let gs = Grammars::new(variant);
    let counts = Arc::new(Counts::default());
    let samplings = [
        SamplingParams::greedy(),
        SamplingParams { temperature: 0.8, top_k: 30, top_p: 0.9, seed: Some(11), ..Default::default() },
        SamplingParams { temperature: 1.2, seed: Some(12), ..Default::default() },
    ];
    let mut outs = Vec::new();
    for masks in [false, true] {
        let asked = Arc::new(Mutex::new(Asked::default()));
        let b = Masking { inner: backend(variant, 0), masks, asked: asked.clone() };
        let e = EngineHandle::start(Box::new(b), sched(), Some(tokenizer(variant)));
        let got: Vec<Vec<Vec<u32>>> = samplings.iter().map(|s| run(&e, &gs, s, &counts)).collect();
        wait_idle(&e);
        e.shutdown(true);
        for (s, out) in samplings.iter().zip(&got) {
            for (g, ids) in grammars().iter().zip(out.iter().step_by(2)) {
                gs.assert_valid(g, ids, &format!("masks {masks}, {s:?}"));
            }
        }
        let asked = asked.lock().unwrap();
        if masks {
            assert!(asked.masked_rows > 0, "constrained rows carry their masks");
            assert_eq!(asked.logits_steps, 0, "no step brings its rows back");
            assert!(asked.later_picks > 0, "constrained decode steps run ahead");
        } else {
            assert_eq!(asked.masked_rows, 0);
            assert!(asked.logits_steps > 0, "constrained rows are sampled on the host");
        }
        outs.push(got);
    }
    assert_eq!(outs[0], outs[1]);
    assert_eq!(counts.refused.load(Ordering::SeqCst), 0);
}
