//! `deltaserve eval`: quality evaluations of serving configurations.
//!
//! `eval kld` measures what a storage format does to the model's next-token distributions: the KV cache's
//! (K and V), the DeltaNet state's and, on the CUDA backend, the decoder weights'. The whole sequence runs
//! once per configuration on a backend built for it (the backend `--device` selects, with the engine flags
//! of `serve`, K and V
//! stored in the configuration's formats, so every attention read sees the stored values, and the decoder
//! linears stored as its `w=` says, quantised at load from a bf16 checkpoint as `--weights-dtype` does), one
//! position per step, and each position's distribution is compared with the baseline configuration's:
//! KL(baseline ‖ config) mean, p99, p99.9 and max, and top-1 agreement. Needle tests do not reveal this
//! damage; the divergence does.
//!
//! A configuration is a KV dtype for both K and V (`fp8`), or `:`-separated keys: `k=`, `v=` (a missing
//! half is bf16), `kv=` (both) and `w=` (weights: bf16, int4 or fp8; missing: as the command line and the
//! checkpoint say) and `s=` (the DeltaNet recurrent state: fp32 or bf16; missing: `--state-dtype`). So
//! `bf16,fp8,int8,int4` compares KV formats, `w=bf16,w=fp8,w=int4` with the baseline `w=bf16` compares weight
//! formats over a bf16 KV cache, and `s=bf16` with the baseline `s=fp32` the state's storage.

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use deltaserve_backend::argmax;
use deltaserve_plan::{KvDtype, StateDtype, WeightsDtype};

use crate::engine_args::{EngineArgs, Prepared};
use crate::model_source::{Device, ModelArgs};

#[derive(clap::Subcommand)]
pub enum Command {
    /// KL divergence of next-token distributions of KV-cache and weight formats against a baseline.
    Kld(KldArgs),
}

#[derive(clap::Args)]
#[command(group(clap::ArgGroup::new("input").required(true).args(["text_file", "tokens"])))]
pub struct KldArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    engine: EngineArgs,
    /// A text file to evaluate on (tokenised with the model's tokenizer.json); `--text` is an alias.
    #[arg(long, value_name = "FILE", alias = "text")]
    text_file: Option<PathBuf>,
    /// Evaluate on this many deterministic pseudo-random token ids instead (for random-weight models).
    #[arg(long)]
    tokens: Option<usize>,
    /// Seed of the pseudo-random tokens.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Configurations, comma-separated. A plain word is a KV dtype for both K and V (bf16, fp16, fp32, fp8,
    /// int8, int4), so the default compares KV formats. Otherwise `:`-separated keys: `k=DTYPE`, `v=DTYPE`
    /// (a missing half is bf16), `kv=DTYPE` (both) and `w=DTYPE`, the decoder weights on the CUDA backend
    /// (bf16, int4 or fp8, as --weights-dtype: a bf16 checkpoint is quantised at load; without `w=`, the
    /// weights the command line and checkpoint give) and `s=DTYPE`, the DeltaNet recurrent state (fp32 or
    /// bf16, as --state-dtype). E.g. `w=fp8`, `w=int4:kv=fp8`, `k=fp8:v=int4:w=fp8`;
    /// `--configs w=bf16,w=fp8,w=int4 --baseline w=bf16` compares the weight formats, `--configs s=bf16
    /// --baseline s=fp32` the state's (each position runs as a decode step, so the state is rounded every token).
    #[arg(long, default_value = "bf16,fp8,int8,int4")]
    configs: String,
    /// The configuration every other is compared with (the syntax of --configs).
    #[arg(long, default_value = "bf16")]
    baseline: String,
    /// Ignored: the sequence runs one position per step, each returning its logits.
    #[arg(long, hide = true, default_value_t = 128)]
    chunk: usize,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

/// The weight formats a `w=` configuration may name: the CUDA backend's storage of the decoder linears.
const WEIGHTS_CHOICES: &str = "bf16, int4, fp8";

/// What a run with these formats computes: configurations with the same key have the same numbers.
pub type ConfigKey = (KvDtype, KvDtype, Option<WeightsDtype>, Option<StateDtype>);

/// One configuration: the storage of K, V and (when given) the decoder weights.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KldConfig {
    /// As the user wrote it.
    pub name: String,
    pub k: KvDtype,
    pub v: KvDtype,
    /// The decoder weights' storage; `None`: as the command line and the checkpoint say.
    pub w: Option<WeightsDtype>,
    /// The DeltaNet recurrent state's storage; `None`: as the command line says (`--state-dtype`).
    pub s: Option<StateDtype>,
}

impl KldConfig {
    /// `fp8` (K and V), or `:`-separated `k=`, `v=` (a missing half is bf16), `kv=` (both) and `w=`
    /// (weights: bf16, int4 or fp8; missing: as loaded), e.g. `k=fp8:v=int4`, `w=int4:kv=fp8`.
    pub fn parse(s: &str) -> Result<Self> {
        let name = s.trim().to_string();
        if name.is_empty() {
            bail!("empty configuration");
        }
        let dtype = |d: &str| d.parse::<KvDtype>().map_err(|e| anyhow::anyhow!("configuration `{name}`: {e}"));
        if !name.contains('=') {
            let d = dtype(&name)?;
            return Ok(Self { name, k: d, v: d, w: None, s: None });
        }
        let weights = |d: &str| match d.parse::<WeightsDtype>() {
            Ok(w @ (WeightsDtype::Bf16 | WeightsDtype::Int4 | WeightsDtype::Fp8Block)) => Ok(w),
            _ => Err(anyhow::anyhow!(
                "configuration `{name}`: unknown weights dtype `{}` (choices: {WEIGHTS_CHOICES})",
                d.trim()
            )),
        };
        let twice = |key: &str| anyhow::anyhow!("configuration `{name}`: `{key}` given twice");
        let (mut k, mut v, mut w, mut st) = (None, None, None, None);
        for part in name.split(':') {
            let (key, val) = part.split_once('=').with_context(|| {
                format!("configuration `{name}`: expected `KEY=DTYPE` (keys k, v, kv, w, s), got `{part}`")
            })?;
            let key = key.trim().to_ascii_lowercase();
            match key.as_str() {
                "k" | "v" | "kv" => {
                    let d = dtype(val)?;
                    for (half, slot) in [("k", &mut k), ("v", &mut v)] {
                        if key.contains(half) {
                            if slot.is_some() {
                                return Err(twice(half));
                            }
                            *slot = Some(d);
                        }
                    }
                }
                "w" => {
                    if w.is_some() {
                        return Err(twice("w"));
                    }
                    w = Some(weights(val)?);
                }
                "s" => {
                    if st.is_some() {
                        return Err(twice("s"));
                    }
                    let d = val.parse::<StateDtype>().map_err(|e| anyhow::anyhow!("configuration `{name}`: {e}"))?;
                    st = Some(d);
                }
                other => bail!("configuration `{name}`: unknown key `{other}` (expected k, v, kv, w or s)"),
            }
        }
        Ok(Self { k: k.unwrap_or(KvDtype::Bf16), v: v.unwrap_or(KvDtype::Bf16), w, s: st, name })
    }

    /// The formats that decide this configuration's numbers.
    pub fn key(&self) -> ConfigKey {
        (self.k, self.v, self.w, self.s)
    }

    /// The weights' storage as reported: its name, or `as loaded`.
    pub fn weights_name(&self) -> String {
        self.w.map_or_else(|| "as loaded".to_string(), |w| w.to_string())
    }

    /// The DeltaNet state's storage as reported: its name, or `as given` (`--state-dtype`, else fp32).
    pub fn state_name(&self) -> String {
        self.s.map_or_else(|| "as given".to_string(), |s| s.to_string())
    }
}

/// Divergence of one configuration from the baseline.
#[derive(Clone, Debug, serde::Serialize)]
pub struct KldReport {
    pub name: String,
    pub k: String,
    pub v: String,
    /// The decoder weights' storage (bf16, int4, fp8), or `as loaded` (the command line's and checkpoint's).
    pub weights: String,
    /// The DeltaNet recurrent state's storage (fp32, bf16), or `as given` (`--state-dtype`).
    pub state: String,
    pub positions: usize,
    pub mean_kl: f64,
    pub p99_kl: f64,
    pub p999_kl: f64,
    pub max_kl: f64,
    pub top1_agreement: f64,
}

/// splitmix64: the pseudo-random token stream of `--tokens`.
fn pseudo_random_tokens(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut s = seed ^ 0x6b4c_6d2e_9f1d_0a37;
    (0..n)
        .map(|_| {
            s = s.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = s;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            ((z ^ (z >> 31)) % vocab as u64) as u32
        })
        .collect()
}

/// log Σ exp(row), in f64: `row[i] − lse` is the log-probability of token `i`.
fn log_sum_exp(row: &[f32]) -> f64 {
    let max = row.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(x as f64));
    max + row.iter().map(|&x| (x as f64 - max).exp()).sum::<f64>().ln()
}

/// KL(p ‖ q) of the distributions of two logit rows (0 when they are equal; never negative).
pub fn kl(p: &[f32], q: &[f32]) -> f64 {
    let (lp, lq) = (log_sum_exp(p), log_sum_exp(q));
    let d: f64 = p
        .iter()
        .zip(q)
        .map(|(&x, &y)| {
            let (a, b) = (x as f64 - lp, y as f64 - lq);
            if a == b { 0.0 } else { a.exp() * (a - b) }
        })
        .sum();
    d.max(0.0)
}

/// The nearest-rank percentile `p` (0..1) of sorted values.
fn percentile(sorted: &[f64], p: f64) -> f64 {
    let i = ((p * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[i]
}

/// The engine flags of `cfg`'s backend: the command line's, with K, V and the weights stored as `cfg` says.
fn config_engine(a: &KldArgs, cfg: &KldConfig) -> EngineArgs {
    a.engine.with_kv_dtypes(cfg.k, cfg.v).with_weights_dtype(cfg.w).with_state_dtype(cfg.s)
}

/// Refuses what `eval kld` cannot measure, before anything is loaded: `w=` configurations on the CPU
/// reference backend (it keeps f32 weights) or with random weights (each format draws its own), or
/// together with `--weights-dtype` / `--quantize`; KV flags (the configurations store K and V).
fn check_flags(a: &KldArgs, all: &[&KldConfig], device: impl FnOnce() -> Result<Device>) -> Result<()> {
    if a.engine.kv_cache_dtype.is_some() || a.engine.k_cache_dtype.is_some() || a.engine.v_cache_dtype.is_some() {
        bail!(
            "--kv-cache-dtype / --k-cache-dtype / --v-cache-dtype: eval kld stores K and V as --configs and --baseline say"
        );
    }
    let Some(first) = all.iter().find(|c| c.w.is_some()) else {
        return Ok(());
    };
    let name = &first.name;
    if let Some((flag, value)) = [("--weights-dtype", &a.engine.weights_dtype), ("--quantize", &a.engine.quantize)]
        .into_iter()
        .find_map(|(flag, v)| v.as_deref().map(|v| (flag, v)))
    {
        bail!(
            "{flag} {value} and the configuration `{name}`: give the weights either on the command line (for every \
             configuration, without `w=`) or per configuration with `w=` (e.g. `w={value}`), not both"
        );
    }
    if a.model.random_weights {
        bail!(
            "the configuration `{name}` with --random-weights: each weight format draws its own random values, so \
             the divergence would compare different models; load a checkpoint (--model DIR) to measure weight formats"
        );
    }
    if device()? == Device::Cpu {
        bail!(
            "the configuration `{name}` on the CPU reference backend (--device cpu, or auto finding no GPU): it \
             keeps f32 weights, so `w=` has nothing to store; weight formats run on the CUDA backend (--device \
             cuda). KV formats (configurations without `w=`) run on either"
        );
    }
    Ok(())
}

/// The divergence of every configuration from `baseline` over `tokens`; `run(cfg, tokens, each)` calls
/// `each` with every position's logits row with K, V and the weights stored as `cfg` says. Each distinct
/// [`KldConfig::key`] runs once.
pub fn kld(
    tokens: &[u32],
    baseline: &KldConfig,
    configs: &[KldConfig],
    mut run: impl FnMut(&KldConfig, &[u32], &mut dyn FnMut(usize, &[f32])) -> Result<()>,
) -> Result<Vec<KldReport>> {
    let t0 = Instant::now();
    // The baseline's logits of every position (N × vocab f32); configurations stream against them.
    let mut base: Vec<f32> = Vec::new();
    run(baseline, tokens, &mut |_, row| base.extend_from_slice(row))?;
    let vocab = base.len() / tokens.len();
    tracing::info!(config = %baseline.name, secs = t0.elapsed().as_secs_f64(), "baseline done");
    let base_row = |pos: usize| &base[pos * vocab..][..vocab];
    let base_top: Vec<u32> = (0..tokens.len()).map(|p| argmax(base_row(p))).collect();
    // Configurations with the same formats have the same numbers: each runs once.
    let mut done: HashMap<ConfigKey, (Vec<f64>, usize)> = HashMap::new();
    let mut reports = Vec::new();
    for cfg in configs {
        let (kls, agree) = if cfg.key() == baseline.key() {
            (vec![0.0; tokens.len()], tokens.len())
        } else if let Some(r) = done.get(&cfg.key()) {
            r.clone()
        } else {
            let t = Instant::now();
            let mut kls = vec![0.0; tokens.len()];
            let mut agree = 0;
            run(cfg, tokens, &mut |pos, row| {
                kls[pos] = kl(base_row(pos), row);
                agree += usize::from(argmax(row) == base_top[pos]);
            })?;
            tracing::info!(config = %cfg.name, secs = t.elapsed().as_secs_f64(), "configuration done");
            done.insert(cfg.key(), (kls.clone(), agree));
            (kls, agree)
        };
        if let Some((pos, x)) = kls.iter().enumerate().find(|(_, x)| !x.is_finite()) {
            bail!("configuration `{}`: KL divergence at position {pos} is {x} (a NaN or inf in the logits)", cfg.name);
        }
        let n = kls.len();
        let mut sorted = kls.clone();
        sorted.sort_by(f64::total_cmp);
        reports.push(KldReport {
            name: cfg.name.clone(),
            k: cfg.k.to_string(),
            v: cfg.v.to_string(),
            weights: cfg.weights_name(),
            state: cfg.state_name(),
            positions: n,
            mean_kl: kls.iter().sum::<f64>() / n as f64,
            p99_kl: percentile(&sorted, 0.99),
            p999_kl: percentile(&sorted, 0.999),
            max_kl: sorted[n - 1],
            top1_agreement: agree as f64 / n as f64,
        });
    }
    Ok(reports)
}

pub fn run(c: Command) -> Result<()> {
    match c {
        Command::Kld(a) => run_kld(a),
    }
}

fn run_kld(a: KldArgs) -> Result<()> {
    // Parse everything before loading the model: a bad configuration fails fast.
    let baseline = KldConfig::parse(&a.baseline).context("--baseline")?;
    let configs: Vec<KldConfig> = a
        .configs
        .split(',')
        .filter(|s| !s.trim().is_empty())
        .map(KldConfig::parse)
        .collect::<Result<_>>()
        .context("--configs")?;
    if configs.is_empty() {
        bail!("--configs is empty");
    }
    let all: Vec<&KldConfig> = std::iter::once(&baseline).chain(&configs).collect();
    check_flags(&a, &all, || a.model.device())?;
    let text =
        a.text_file.as_ref().map(|p| std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display())));
    let text = text.transpose()?;
    let dir = a.model.dir()?;
    let model = a.model.load_text(&dir)?;
    let (tokens, source) = match (text, a.tokens) {
        (Some(text), _) => {
            let tok = model.tokenizer.as_ref().context("--text-file needs a model directory with tokenizer.json")?;
            (tok.encode(&text)?, format!("text {}", a.text_file.as_ref().unwrap().display()))
        }
        (None, Some(n)) => (
            pseudo_random_tokens(n, model.config.vocab_size, a.seed),
            format!("{n} pseudo-random tokens (seed {})", a.seed),
        ),
        (None, None) => bail!("give --text-file FILE or --tokens N"),
    };
    if tokens.is_empty() {
        bail!("no tokens to evaluate");
    }
    // Every configuration's flags and memory plan, checked before any weight is read: one that cannot run
    // (fp8 weights on a GPU without FP8 tensor cores, a GPTQ checkpoint with `w=bf16`, ...) fails now, not
    // after the configurations before it.
    let mut prepared: HashMap<ConfigKey, Prepared> = HashMap::new();
    for cfg in &all {
        if let std::collections::hash_map::Entry::Vacant(e) = prepared.entry(cfg.key()) {
            let p = config_engine(&a, cfg)
                .prepare(&a.model, &dir, Some(tokens.len()))
                .with_context(|| format!("configuration `{}`", cfg.name))?;
            e.insert(p);
        }
    }
    let reports = kld(&tokens, &baseline, &configs, |cfg, tokens, each| {
        let p = prepared.remove(&cfg.key()).context("a configuration ran twice")?;
        let mut built = config_engine(&a, cfg)
            .build_prepared(&a.model, p)
            .with_context(|| format!("configuration `{}`", cfg.name))?;
        tracing::info!(config = %cfg.name, weights = %built.plan.options.weights_dtype, "backend built");
        built.logits_at_every_position(tokens, each).with_context(|| format!("configuration `{}`", cfg.name))
    })?;
    if a.json {
        let out = serde_json::json!({
            "baseline": {
                "name": baseline.name,
                "k": baseline.k.to_string(),
                "v": baseline.v.to_string(),
                "weights": baseline.weights_name(),
                "state": baseline.state_name(),
            },
            "source": source,
            "positions": tokens.len(),
            "chunk": a.chunk,
            "configs": reports,
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    println!(
        "KL(baseline {} ‖ config) of next-token distributions over {}, {} positions",
        baseline.name,
        source,
        tokens.len()
    );
    println!(
        "{:<20} {:>5} {:>5} {:>9} {:>8} {:>12} {:>12} {:>12} {:>12} {:>8}",
        "config", "K", "V", "W", "state", "mean", "p99", "p99.9", "max", "top-1"
    );
    for r in &reports {
        println!(
            "{:<20} {:>5} {:>5} {:>9} {:>8} {:>12.4e} {:>12.4e} {:>12.4e} {:>12.4e} {:>7.2}%",
            r.name,
            r.k,
            r.v,
            r.weights,
            r.state,
            r.mean_kl,
            r.p99_kl,
            r.p999_kl,
            r.max_kl,
            r.top1_agreement * 100.0
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;
    use std::path::Path;

    #[derive(clap::Parser)]
    struct Cli {
        #[command(subcommand)]
        command: Command,
    }

    #[test]
    fn text_file_and_its_alias() {
        for flag in ["--text-file", "--text"] {
            let Command::Kld(a) = Cli::try_parse_from(["eval", "kld", flag, "/tmp/t.txt"]).unwrap().command;
            assert_eq!(a.text_file.as_deref(), Some(Path::new("/tmp/t.txt")), "{flag}");
        }
    }

    #[test]
    fn configs_parse() {
        let c = KldConfig::parse("fp8").unwrap();
        assert_eq!((c.k, c.v, c.w), (KvDtype::Fp8, KvDtype::Fp8, None));
        let c = KldConfig::parse("k=fp8:v=int4").unwrap();
        assert_eq!((c.name.as_str(), c.k, c.v, c.w), ("k=fp8:v=int4", KvDtype::Fp8, KvDtype::Int4, None));
        let c = KldConfig::parse("v=int8").unwrap();
        assert_eq!((c.k, c.v), (KvDtype::Bf16, KvDtype::Int8));
        let e = format!("{:#}", KldConfig::parse("int3").unwrap_err());
        assert!(e.contains("int3") && e.contains("choices"), "{e}");
        assert!(KldConfig::parse("k=fp8:k=int4").is_err());
        assert!(KldConfig::parse("q=fp8").is_err());
        let c = KldConfig::parse("kv=fp8:s=bf16").unwrap();
        assert_eq!((c.k, c.v, c.w, c.s), (KvDtype::Fp8, KvDtype::Fp8, None, Some(StateDtype::Bf16)));
        assert_eq!((c.state_name(), KldConfig::parse("fp8").unwrap().state_name()), ("bf16".into(), "as given".into()));
        assert!(KldConfig::parse("s=bf16:s=fp32").is_err());
    }

    #[test]
    fn plain_words_stay_kv_dtypes() {
        // `bf16,fp8,int8,int4` names KV formats, with the weights as loaded.
        for (word, kv) in
            [("bf16", KvDtype::Bf16), ("fp8", KvDtype::Fp8), ("int8", KvDtype::Int8), ("int4", KvDtype::Int4)]
        {
            let c = KldConfig::parse(word).unwrap();
            assert_eq!((c.k, c.v, c.w), (kv, kv, None), "{word}");
            assert_eq!(c.weights_name(), "as loaded");
        }
    }

    #[test]
    fn weights_configs_parse() {
        let c = KldConfig::parse("w=fp8").unwrap();
        assert_eq!(
            (c.name.as_str(), c.k, c.v, c.w),
            ("w=fp8", KvDtype::Bf16, KvDtype::Bf16, Some(WeightsDtype::Fp8Block))
        );
        assert_eq!(c.weights_name(), "fp8");
        let c = KldConfig::parse("w=int4:kv=fp8").unwrap();
        assert_eq!((c.k, c.v, c.w), (KvDtype::Fp8, KvDtype::Fp8, Some(WeightsDtype::Int4)));
        assert_eq!(c.weights_name(), "int4");
        let c = KldConfig::parse("k=fp8:v=int4:w=fp8").unwrap();
        assert_eq!((c.k, c.v, c.w), (KvDtype::Fp8, KvDtype::Int4, Some(WeightsDtype::Fp8Block)));
        // Keys and values case-insensitively, spaces around them ignored; the name is kept as typed.
        let c = KldConfig::parse(" W=BF16:V=int8 ").unwrap();
        assert_eq!(
            (c.name.as_str(), c.k, c.v, c.w),
            ("W=BF16:V=int8", KvDtype::Bf16, KvDtype::Int8, Some(WeightsDtype::Bf16))
        );
        assert_eq!(c.weights_name(), "bf16");
    }

    #[test]
    fn weights_config_errors() {
        let err = |s: &str| format!("{:#}", KldConfig::parse(s).unwrap_err());
        let e = err("w=fp8:w=int4");
        assert!(e.contains("`w` given twice"), "{e}");
        let e = err("w=int3");
        assert!(e.contains("unknown weights dtype `int3`") && e.contains("bf16, int4, fp8"), "{e}");
        // Weight formats the CUDA backend does not store are refused by name too.
        for bad in ["w=fp16", "w=fp32", "w=int8", "w="] {
            assert!(err(bad).contains("unknown weights dtype"), "{bad}: {}", err(bad));
        }
        let e = err("k=fp8:q=int4");
        assert!(e.contains("unknown key `q`") && e.contains("k, v, kv, w or s"), "{e}");
        let e = err("w=fp8:int4");
        assert!(e.contains("expected `KEY=DTYPE`") && e.contains("`int4`"), "{e}");
        // `kv` and a half of it: given twice, whichever comes first.
        assert!(err("kv=fp8:k=int4").contains("`k` given twice"));
        assert!(err("v=int4:kv=fp8").contains("`v` given twice"));
        // A KV dtype error under a `w=` configuration names the configuration.
        let e = err("w=fp8:k=fp9");
        assert!(e.contains("w=fp8:k=fp9") && e.contains("fp9"), "{e}");
    }

    /// Runs [`kld`] with fake logits that depend only on the configuration's formats, returning the reports
    /// and the names of the configurations that ran.
    fn fake_kld(baseline: &str, configs: &[&str]) -> (Vec<KldReport>, Vec<String>) {
        let baseline = KldConfig::parse(baseline).unwrap();
        let configs: Vec<KldConfig> = configs.iter().map(|c| KldConfig::parse(c).unwrap()).collect();
        let mut ran = Vec::new();
        let tokens = [1, 2, 3];
        let reports = kld(&tokens, &baseline, &configs, |cfg, tokens, each| {
            ran.push(cfg.name.clone());
            let w = cfg.w.map_or(0.0, |w| 1.0 + w as u8 as f32);
            let bump = cfg.k as u8 as f32 + 10.0 * cfg.v as u8 as f32 + 100.0 * w;
            for pos in 0..tokens.len() {
                each(pos, &[0.0, 1e-3 * bump, 2.0]);
            }
            Ok(())
        })
        .unwrap();
        (reports, ran)
    }

    #[test]
    fn runs_are_deduplicated_by_k_v_and_weights() {
        let (reports, ran) = fake_kld(
            "bf16",
            &[
                "w=fp8",
                "kv=bf16:w=fp8",
                "k=bf16:v=bf16:w=fp8",
                "fp8",
                "w=int4",
                "bf16",
                "kv=bf16",
                "w=bf16",
                "w=int4:kv=fp8",
            ],
        );
        // The baseline, then every distinct (k, v, w) once: `w=bf16` is not the baseline's weights as loaded
        // (a block-FP8 checkpoint loads fp8), so it runs too.
        assert_eq!(ran, ["bf16", "w=fp8", "fp8", "w=int4", "w=bf16", "w=int4:kv=fp8"]);
        let by_name = |n: &str| reports.iter().find(|r| r.name == n).unwrap();
        // The same formats, the same numbers, each under the name it was given.
        assert_eq!(reports.len(), 9);
        for n in ["kv=bf16:w=fp8", "k=bf16:v=bf16:w=fp8"] {
            assert_eq!(by_name(n).mean_kl, by_name("w=fp8").mean_kl, "{n}");
            assert_eq!(by_name(n).weights, "fp8");
        }
        assert!(by_name("w=fp8").mean_kl > 0.0);
        for n in ["bf16", "kv=bf16"] {
            assert_eq!((by_name(n).mean_kl, by_name(n).top1_agreement), (0.0, 1.0), "{n}");
            assert_eq!(by_name(n).weights, "as loaded");
        }
        assert_ne!(by_name("w=int4").mean_kl, by_name("w=int4:kv=fp8").mean_kl);
        assert_eq!((by_name("w=int4:kv=fp8").k.as_str(), by_name("w=int4:kv=fp8").weights.as_str()), ("fp8", "int4"));
        // A `w=` baseline: the same formats are the baseline, the weights as loaded are not.
        let (reports, ran) = fake_kld("w=bf16", &["kv=bf16:w=bf16", "bf16", "w=int4"]);
        assert_eq!(ran, ["w=bf16", "bf16", "w=int4"]);
        assert_eq!(reports[0].mean_kl, 0.0);
        assert!(reports[1].mean_kl > 0.0 && reports[2].mean_kl > 0.0);
        assert_eq!(KldConfig::parse("w=fp8:kv=int4").unwrap().key(), KldConfig::parse("kv=int4:w=e4m3").unwrap().key());
    }

    fn kld_args(args: &[&str]) -> KldArgs {
        let mut all = vec!["eval", "kld", "--tokens", "8"];
        all.extend_from_slice(args);
        let Command::Kld(a) = Cli::try_parse_from(all).unwrap().command;
        a
    }

    /// [`check_flags`] of `args` and `configs` on `device`; the error text, or None when accepted.
    fn check(args: &[&str], configs: &[&str], device: Device) -> Option<String> {
        let a = kld_args(args);
        let configs: Vec<KldConfig> = configs.iter().map(|c| KldConfig::parse(c).unwrap()).collect();
        let all: Vec<&KldConfig> = configs.iter().collect();
        check_flags(&a, &all, || Ok(device)).err().map(|e| format!("{e:#}"))
    }

    #[test]
    fn weights_configs_are_refused_where_they_cannot_run() {
        // KV formats run anywhere; `w=` on the GPU.
        assert_eq!(check(&[], &["bf16", "fp8"], Device::Cpu), None);
        assert_eq!(check(&[], &["bf16", "w=fp8"], Device::Cuda), None);
        assert_eq!(check(&["--int4-asym", "--lm-head-int4"], &["w=int4"], Device::Cuda), None);
        let e = check(&[], &["bf16", "w=fp8"], Device::Cpu).unwrap();
        assert!(e.contains("`w=fp8`") && e.contains("CPU reference") && e.contains("--device cuda"), "{e}");
        // The command line's weights and `w=`: one or the other, whatever the device.
        for (flag, value) in [("--weights-dtype", "int4"), ("--quantize", "fp8")] {
            let e = check(&[flag, value], &["bf16", "w=int4:kv=fp8"], Device::Cuda).unwrap();
            assert!(e.contains(flag) && e.contains("`w=int4:kv=fp8`") && e.contains(&format!("w={value}")), "{e}");
            assert_eq!(check(&[flag, value], &["bf16", "fp8"], Device::Cuda), None, "{flag} with KV formats");
        }
        let e = check(&["--random-weights"], &["w=bf16", "w=int4"], Device::Cuda).unwrap();
        assert!(e.contains("--random-weights") && e.contains("`w=bf16`"), "{e}");
        // The device is not asked when nothing needs it.
        let a = kld_args(&[]);
        let bf16 = KldConfig::parse("bf16").unwrap();
        check_flags(&a, &[&bf16], || panic!("device resolved")).unwrap();
    }

    #[test]
    fn with_weights_dtype_sets_the_flag() {
        let a = kld_args(&["--weights-dtype", "int4"]);
        assert_eq!(a.engine.with_weights_dtype(None).weights_dtype.as_deref(), Some("int4"));
        for w in [WeightsDtype::Bf16, WeightsDtype::Int4, WeightsDtype::Fp8Block] {
            let e = kld_args(&[]).engine.with_weights_dtype(Some(w));
            assert_eq!(e.weights_dtype.as_deref().map(|s| s.parse::<WeightsDtype>()), Some(Ok(w)));
        }
    }

    #[test]
    fn kl_and_percentiles() {
        let p = [1.0, 2.0, 3.0];
        assert_eq!(kl(&p, &p), 0.0);
        // Shifting every logit changes nothing.
        assert!(kl(&p, &[2.0, 3.0, 4.0]) < 1e-15);
        let q = [1.0, 2.0, 3.5];
        let want: f64 = {
            let lp: Vec<f64> = p.iter().map(|&x| x as f64 - log_sum_exp(&p)).collect();
            let lq: Vec<f64> = q.iter().map(|&x| x as f64 - log_sum_exp(&q)).collect();
            lp.iter().zip(&lq).map(|(a, b)| a.exp() * (a - b)).sum()
        };
        assert!((kl(&p, &q) - want).abs() < 1e-15 && want > 0.0);
        let v: Vec<f64> = (1..=1000).map(f64::from).collect();
        assert_eq!(percentile(&v, 0.99), 990.0);
        assert_eq!(percentile(&v, 0.999), 999.0);
        assert_eq!(percentile(&[5.0], 0.999), 5.0);
    }
}
