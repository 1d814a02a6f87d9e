//! `deltaserve eval`: quality evaluations of serving configurations.
//!
//! `eval kld` measures what a KV-cache storage format does to the model's next-token distributions:
//! the whole sequence runs once per configuration on a backend built for it (the backend `--device`
//! selects, with the engine flags of `serve` and K and V stored in the configuration's formats, so every
//! attention read sees the stored values), one position per step, and each position's distribution is
//! compared with the baseline configuration's: KL(baseline ‖ config) mean, p99, p99.9 and max, and top-1
//! agreement. Needle tests do not reveal this damage; the divergence does.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use deltaserve_plan::KvDtype;

use crate::engine_args::EngineArgs;
use crate::model_source::ModelArgs;

#[derive(clap::Subcommand)]
pub enum Command {
    /// KL divergence of next-token distributions of KV-cache configurations against a baseline.
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
    /// Configurations, comma-separated: a KV dtype for both K and V (bf16, fp16, fp32, fp8, int8, int4), or
    /// `k=DTYPE:v=DTYPE` (a missing half is bf16).
    #[arg(long, default_value = "bf16,fp8,int8,int4")]
    configs: String,
    /// The configuration every other is compared with.
    #[arg(long, default_value = "bf16")]
    baseline: String,
    /// Ignored: the sequence runs one position per step, each returning its logits.
    #[arg(long, hide = true, default_value_t = 128)]
    chunk: usize,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

/// One KV-cache configuration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvConfig {
    pub name: String,
    pub k: KvDtype,
    pub v: KvDtype,
}

impl KvConfig {
    /// `fp8` (K and V) or `k=fp8:v=int4` (a missing half is bf16).
    pub fn parse(s: &str) -> Result<Self> {
        let name = s.trim().to_string();
        if name.is_empty() {
            bail!("empty KV configuration");
        }
        let dtype = |d: &str| d.parse::<KvDtype>().map_err(|e| anyhow::anyhow!("configuration `{name}`: {e}"));
        if !name.contains('=') {
            let d = dtype(&name)?;
            return Ok(Self { name, k: d, v: d });
        }
        let (mut k, mut v) = (None, None);
        for part in name.split(':') {
            let (key, val) = part
                .split_once('=')
                .with_context(|| format!("configuration `{name}`: expected `k=DTYPE:v=DTYPE`, got `{part}`"))?;
            let slot = match key.trim().to_ascii_lowercase().as_str() {
                "k" => &mut k,
                "v" => &mut v,
                "kv" => {
                    let d = dtype(val)?;
                    (k, v) = (Some(d), Some(d));
                    continue;
                }
                other => bail!("configuration `{name}`: unknown key `{other}` (expected k or v)"),
            };
            if slot.is_some() {
                bail!("configuration `{name}`: `{key}` given twice");
            }
            *slot = Some(dtype(val)?);
        }
        Ok(Self { k: k.unwrap_or(KvDtype::Bf16), v: v.unwrap_or(KvDtype::Bf16), name })
    }
}

/// Divergence of one configuration from the baseline.
#[derive(Clone, Debug, serde::Serialize)]
pub struct KldReport {
    pub name: String,
    pub k: String,
    pub v: String,
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

/// The first index of the largest logit.
fn argmax(row: &[f32]) -> usize {
    row.iter().enumerate().fold(0, |best, (i, &x)| if x > row[best] { i } else { best })
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

/// Runs `tokens` with K/V stored as `cfg` on a backend built for it from the flags, calling `each` with
/// every position's logits row.
fn run_config(
    a: &KldArgs,
    dir: &Path,
    cfg: &KvConfig,
    tokens: &[u32],
    each: &mut dyn FnMut(usize, &[f32]),
) -> Result<()> {
    let mut built = a.engine.with_kv_dtypes(cfg.k, cfg.v).build_to_score(&a.model, dir, tokens.len())?;
    built.logits_at_every_position(tokens, each).with_context(|| format!("configuration `{}`", cfg.name))
}

/// The divergence of every configuration from `baseline` over `tokens`; `run(cfg, tokens, each)` calls
/// `each` with every position's logits row with K/V stored as `cfg`.
pub fn kld(
    tokens: &[u32],
    baseline: &KvConfig,
    configs: &[KvConfig],
    mut run: impl FnMut(&KvConfig, &[u32], &mut dyn FnMut(usize, &[f32])) -> Result<()>,
) -> Result<Vec<KldReport>> {
    let t0 = Instant::now();
    // The baseline's logits of every position (N × vocab f32); configurations stream against them.
    let mut base: Vec<f32> = Vec::new();
    run(baseline, tokens, &mut |_, row| base.extend_from_slice(row))?;
    let vocab = base.len() / tokens.len();
    tracing::info!(config = %baseline.name, secs = t0.elapsed().as_secs_f64(), "baseline done");
    let base_row = |pos: usize| &base[pos * vocab..][..vocab];
    let base_top: Vec<usize> = (0..tokens.len()).map(|p| argmax(base_row(p))).collect();
    // Configurations with the same formats have the same numbers: each runs once.
    let mut done: HashMap<(KvDtype, KvDtype), (Vec<f64>, usize)> = HashMap::new();
    let mut reports = Vec::new();
    for cfg in configs {
        let (kls, agree) = if (cfg.k, cfg.v) == (baseline.k, baseline.v) {
            (vec![0.0; tokens.len()], tokens.len())
        } else if let Some(r) = done.get(&(cfg.k, cfg.v)) {
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
            done.insert((cfg.k, cfg.v), (kls.clone(), agree));
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
    let baseline = KvConfig::parse(&a.baseline).context("--baseline")?;
    let configs: Vec<KvConfig> = a
        .configs
        .split(',')
        .filter(|s| !s.trim().is_empty())
        .map(KvConfig::parse)
        .collect::<Result<_>>()
        .context("--configs")?;
    if configs.is_empty() {
        bail!("--configs is empty");
    }
    if a.engine.kv_cache_dtype.is_some() || a.engine.k_cache_dtype.is_some() || a.engine.v_cache_dtype.is_some() {
        bail!(
            "--kv-cache-dtype / --k-cache-dtype / --v-cache-dtype: eval kld stores K and V as --configs and --baseline say"
        );
    }
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
    let reports = kld(&tokens, &baseline, &configs, |cfg, tokens, each| run_config(&a, &dir, cfg, tokens, each))?;
    if a.json {
        let out = serde_json::json!({
            "baseline": { "name": baseline.name, "k": baseline.k.to_string(), "v": baseline.v.to_string() },
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
        "{:<20} {:>5} {:>5} {:>12} {:>12} {:>12} {:>12} {:>8}",
        "config", "K", "V", "mean", "p99", "p99.9", "max", "top-1"
    );
    for r in &reports {
        println!(
            "{:<20} {:>5} {:>5} {:>12.4e} {:>12.4e} {:>12.4e} {:>12.4e} {:>7.2}%",
            r.name,
            r.k,
            r.v,
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
        let c = KvConfig::parse("fp8").unwrap();
        assert_eq!((c.k, c.v), (KvDtype::Fp8, KvDtype::Fp8));
        let c = KvConfig::parse("k=fp8:v=int4").unwrap();
        assert_eq!((c.name.as_str(), c.k, c.v), ("k=fp8:v=int4", KvDtype::Fp8, KvDtype::Int4));
        let c = KvConfig::parse("v=int8").unwrap();
        assert_eq!((c.k, c.v), (KvDtype::Bf16, KvDtype::Int8));
        let e = format!("{:#}", KvConfig::parse("int3").unwrap_err());
        assert!(e.contains("int3") && e.contains("choices"), "{e}");
        assert!(KvConfig::parse("k=fp8:k=int4").is_err());
        assert!(KvConfig::parse("q=fp8").is_err());
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
