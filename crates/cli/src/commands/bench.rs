//! `deltaserve bench`: speed and memory of the CUDA backend, each figure against a roofline measured in
//! the same run. First the device's ceilings (a bf16 8192³ cuBLASLt GEMM, a device-to-device copy), then
//! the backend on the model (default: the Qwen3.6-27B shapes with random weights made on the GPU):
//! prefill of single prompts (default 1K, 4K, 32K, 128K, 262K tokens, chunked as the scheduler chunks
//! them), decode steps at several batch sizes and contexts, and the device memory the driver reports for
//! this process against the plan.
//!
//! Rooflines (`docs/architecture.md` §6):
//! - prefill: FLOPs = T·(2·linear params (of a mixture of experts: the top-k routed ones) + DeltaNet chunk
//!   core) + attention 4·head_dim·q_heads·layers per (query, visible key) + one lm_head row; the
//!   roofline time is FLOPs / the measured GEMM rate;
//! - decode: bytes = device weights (one embedding row; of a mixture of experts' routed experts, those the
//!   step's tokens pick under uniform routing) + KV read + DeltaNet state read and written; the
//!   roofline time is bytes / the measured copy rate (read + write bytes per second).
//!
//! The decode steps run on whatever the KV pages and state slots hold (their content does not change the
//! work), so no long prefill is needed to measure decode at 32K context.
//!
//! Each decode row is timed four ways: steps that hand back the logits; steps that hand back each row's
//! argmax picked on the device (`argmax ms`: what greedy decoding costs); steps that hand back each row's
//! token sampled on the device (`sampled ms`; `--sample`, by default Qwen's recommended temperature 0.6,
//! top-k 20, top-p 0.95); and, as the baseline, the logits step followed by the host's pick of the same
//! rule (`host-sampled ms`).
//!
//! Speculative decoding's verify step is costed the same way: one sequence stepping `--verify-tokens`
//! (K + 1, default 3) tokens per step at each decode context, against the one-token step at that context (the
//! main model's forward over K + 1 positions; the MTP head's draft steps are not included).
//!
//! `--speculative-tokens K` also times whole speculative steps (one GPU): the MTP head drafting K tokens,
//! the verify forward over K + 1 positions and the commit of all K + 1, at each decode context and batch
//! size, against the one-token step there (with random weights the head's drafts are rejected; the cost
//! of a step does not depend on its acceptance, except the commit's replay, timed here at its maximum).
//!
//! `--tensor-parallel N` runs the model over GPUs 0..N: the plan, the bytes and the FLOPs are one card's
//! (its shard), the rooflines are one card's against the ceilings measured on GPU 0, and each row adds
//! the all-reduce share of the step time: (2·layers + 1) all-reduces of the step's `[tokens, hidden]`
//! activations, each timed alone on the group in the same run, over the measured step time.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use deltaserve_backend::{
    Backend, CacheOp, Feed, Picked, RowSampling, SeqChunk, SnapshotLoc, StepBatch, StepOut, Want,
};
use deltaserve_cuda::ops::init::{Init, init_random};
use deltaserve_cuda::{Arena, CudaBackend, Kernels, Runtime, TpBackend, WeightSource};
use deltaserve_model::ModelConfig;
use deltaserve_plan::{KvDtype, Plan, PlanOptions, WeightsDtype, card_config, fmt_bytes, fmt_count, parse_size};
use serde_json::{Value, json};

use crate::gpu_memory::GpuSampler;
use crate::model_source::ModelArgs;
use crate::report::{ToolReport, emit, round_to, xml};

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    /// Memory budget of the plan (default: the GPU's free memory less 5%).
    #[arg(long, value_parser = parse_size)]
    memory: Option<u64>,
    /// Prompt lengths of the prefill runs (capped by the plan's context).
    #[arg(long, value_delimiter = ',', default_value = "1024,4096,32768,131072,262144")]
    prompts: Vec<usize>,
    /// Batch sizes of the decode runs.
    #[arg(long, value_delimiter = ',', default_value = "1,8,32")]
    batches: Vec<usize>,
    /// Contexts of the decode runs.
    #[arg(long, value_delimiter = ',', default_value = "1024,32768")]
    contexts: Vec<usize>,
    /// Timed decode steps per (batch, context) (after 3 warm-up steps).
    #[arg(long, default_value_t = 24)]
    steps: usize,
    /// Storage of the decoder linears: bf16 or int4 (random int4 codes made on the GPU).
    #[arg(long, default_value = "bf16")]
    weights_dtype: WeightsDtype,
    /// int4 weights with zero points (asymmetric).
    #[arg(long)]
    int4_asym: bool,
    /// lm_head in int4.
    #[arg(long)]
    lm_head_int4: bool,
    /// Keep the embedding table in pinned host memory.
    #[arg(long)]
    embed_on_host: bool,
    /// KV cache dtype for K and V: bf16, fp8, int8, int4.
    #[arg(long, default_value = "bf16")]
    kv_cache_dtype: KvDtype,
    /// Tokens per engine step (prefill chunk).
    #[arg(long, default_value_t = 4096)]
    max_batch_tokens: usize,
    /// Tokens per step of the verify-shaped runs (K + 1 of speculative decoding; 0 or 1: none).
    #[arg(long, default_value_t = 3)]
    verify_tokens: usize,
    /// Tensor parallelism over GPUs 0..N (--memory is per card).
    #[arg(long, default_value_t = 1)]
    tensor_parallel: usize,
    /// Also time speculative steps drafting this many tokens with the MTP head (1..=4; 0: none).
    #[arg(long, default_value_t = 0)]
    speculative_tokens: usize,
    /// The most split-K partitions a decode row's attention uses (as `serve --decode-partitions`).
    #[arg(long, default_value_t = PlanOptions::gpu_defaults(0).decode_partitions)]
    decode_partitions: usize,
    /// Also time one decode step of one sequence per context op group by op group (eagerly, a timing
    /// event after each group: where a decode step's GPU time goes; one GPU, not under
    /// --tensor-parallel).
    #[arg(long)]
    profile: bool,
    /// Also split each decode point's steps (logits to the host, and greedy) into host work, uploads,
    /// the forward on the GPU and the outputs' return (timing events at four marks of a step; one GPU).
    #[arg(long)]
    phases: bool,
    /// The sampling of the sampled decode timings: `temperature,top_k,top_p,min_p` (top_k 0: none).
    #[arg(long, default_value = "0.6,20,0.95,0", value_parser = parse_sampling)]
    sample: RowSampling,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
    /// Also write an SVG chart (prefill tok/s by prompt length, decode tok/s by batch) to this file.
    #[arg(long)]
    svg: Option<PathBuf>,
}

#[derive(Debug, Default)]
struct Ceilings {
    gemm_tflops: f64,
    copy_gbs: f64,
}

#[derive(Debug)]
struct PrefillRow {
    tokens: usize,
    seconds: f64,
    tflop: f64,
    /// Roofline time over measured time.
    ratio: f64,
    /// Share of the FLOPs in softmax attention.
    attention_share: f64,
    /// Tensor parallelism: the all-reduces' share of the time.
    allreduce_share: Option<f64>,
    driver_peak_bytes: Option<u64>,
}

#[derive(Debug)]
struct DecodeRow {
    batch: usize,
    context: usize,
    ms_per_step: f64,
    /// The same steps with the tokens picked on the device (`Want::Tokens` with the argmax, greedy decoding).
    ms_per_step_argmax: f64,
    /// Sampled with [`qwen_sampling`]: on the device (`Want::Tokens` with the rule), and the logits step
    /// followed by the host's pick.
    ms_per_step_sampled: f64,
    ms_per_step_host_sampled: f64,
    /// Greedy and sampled steps launched ahead ([`Backend::launch`]: each step launched before the
    /// previous one's tokens are read, fed its picks on the device), ms between consecutive tokens; None
    /// where the backend steps one at a time.
    ms_per_step_argmax_ahead: Option<f64>,
    ms_per_step_sampled_ahead: Option<f64>,
    bytes: f64,
    /// The roofline over the step with the logits returned, over the greedy step, over the sampled one.
    ratio: f64,
    ratio_argmax: f64,
    ratio_sampled: f64,
    allreduce_share: Option<f64>,
    driver_peak_bytes: Option<u64>,
}

struct Report {
    gpu: String,
    tensor_parallel: usize,
    model: String,
    ceilings: Ceilings,
    plan_bytes: u64,
    arena_bytes: u64,
    idle_driver_bytes: Option<u64>,
    startup_s: f64,
    prefill: Vec<PrefillRow>,
    decode: Vec<DecodeRow>,
    /// The rule of the sampled decode timings, in words.
    sampling: String,
    skipped: Vec<String>,
    arena_allocations_moved: bool,
    /// (what, ms) of DeltaNet state snapshot copies: save/restore to/from the device and host tiers.
    snapshots: Vec<(&'static str, f64)>,
    /// Verify-shaped steps: (tokens per step, context, ms per step, ms of the one-token step there).
    verify: Vec<(usize, usize, f64, f64)>,
    speculative: Vec<SpecRow>,
    profiles: Vec<ProfileRow>,
    /// `--phases`: (batch, context, "logits" | "greedy" | "sampled", the step's parts).
    phases: Vec<(usize, usize, &'static str, deltaserve_cuda::StepPhases)>,
    /// The chunked DeltaNet prefill kernels alone at the model's (per-card) shape.
    deltanet: Vec<deltaserve_cuda::gdn_bench::GdnTiming>,
}

/// `--profile`: one batch-1 decode step at `context`, op group by op group.
struct ProfileRow {
    context: usize,
    /// Eager (profiled) ms per step.
    eager_ms: f64,
    /// (op group, GPU ms per step).
    groups: Vec<(&'static str, f64)>,
}

/// Whole speculative steps at one (batch, context): ms per step of each phase.
#[derive(Debug)]
struct SpecRow {
    k: usize,
    batch: usize,
    context: usize,
    draft_ms: f64,
    verify_ms: f64,
    commit_ms: f64,
    decode_ms: f64,
}

impl SpecRow {
    fn total_ms(&self) -> f64 {
        self.draft_ms + self.verify_ms + self.commit_ms
    }
    /// Decode speed-up at `tokens` emitted per step (accepted drafts + 1).
    fn speedup(&self, tokens: f64) -> f64 {
        tokens * self.decode_ms / self.total_ms()
    }
}

pub fn run(a: Args) -> Result<()> {
    let mut model = a.model.clone();
    if model.model.is_none() && model.preset.is_none() {
        model.preset = Some("qwen3.6-27b".into());
        model.random_weights = true;
    }
    if model.preset.is_some() && !model.random_weights {
        bail!("--preset needs --random-weights (a preset has no weight files)");
    }
    if a.steps == 0 || a.batches.contains(&0) || a.prompts.contains(&0) || a.contexts.contains(&0) {
        bail!("--steps, --batches, --prompts and --contexts take positive numbers");
    }
    deltaserve_cuda::LibStatus::probe().require_all().context("bench runs on the CUDA backend")?;
    let dir = model.dir()?;
    let text = model.load_text(&dir)?;
    let cfg = text.config;

    let tp = a.tensor_parallel;
    let card = card_config(&cfg, tp)?;
    let rt = Runtime::open(0)?;
    let gpu = format!("{} ({})", rt.context().name().unwrap_or_default(), rt.arch());
    tracing::info!("bench: measuring the device's ceilings on {gpu}");
    // One set of kernels, specialised to the model, for the ceilings and the DeltaNet timings.
    let kernels = Kernels::load(&rt, deltaserve_cuda::backend::kernel_dims(&card))?;
    let ceilings = measure_ceilings(&rt, &kernels)?;
    tracing::info!(
        "bench: bf16 GEMM {:.0} TFLOP/s, device copy {:.0} GB/s (read + write)",
        ceilings.gemm_tflops,
        ceilings.copy_gbs
    );
    let mut skipped = Vec::new();
    let deltanet = measure_deltanet(&rt, &kernels, &card, &mut skipped)?;
    drop(kernels);
    let budget = match a.memory {
        Some(m) => m,
        None => {
            let free = rt.free_memory()?;
            free - free / 20
        }
    };
    drop(rt);

    let max_prompt = a.prompts.iter().copied().max().unwrap_or(0).min(cfg.max_position_embeddings);
    let mut o = PlanOptions::gpu_defaults(budget);
    o.max_batch_tokens = a.max_batch_tokens;
    o.max_seqs = a.batches.iter().copied().max().unwrap_or(1).max(1);
    // One device and one host snapshot slot: the snapshot restore timings.
    o.snapshot_slots = 1;
    // Decode runs step from each context: `steps + 3` steps of one token, and of `verify_tokens` tokens.
    let span = (a.steps + 3) * a.verify_tokens.max(1).max(a.speculative_tokens + 1) + 8;
    o.max_context = Some(max_prompt.max(a.contexts.iter().copied().max().unwrap_or(0) + span));
    o.weights_dtype = a.weights_dtype;
    o.int4_asym = a.int4_asym;
    o.lm_head_int4 = a.lm_head_int4;
    o.embed_on_host = a.embed_on_host;
    (o.k_dtype, o.v_dtype) = (a.kv_cache_dtype, a.kv_cache_dtype);
    o.decode_partitions = a.decode_partitions; // the plan checks the range
    o.set_tensor_parallel(tp);
    if a.speculative_tokens > 0 {
        if tp > 1 {
            bail!("--speculative-tokens: not with --tensor-parallel");
        }
        o.speculative_tokens = a.speculative_tokens;
    }
    let plan = Plan::new(&cfg, &o).context("the bench's memory plan does not fit (lower --prompts or --batches)")?;
    tracing::info!("bench plan:\n{}", plan.table());

    let sampler = GpuSampler::start(Some(std::process::id()));
    let t0 = Instant::now();
    let weights = if model.random_weights {
        WeightSource::RandomWeights { seed: 7 }
    } else {
        WeightSource::Checkpoint(text.dir.clone())
    };
    let opts = crate::engine_args::cuda_options(true);
    let mut be = if tp > 1 {
        Under::Tp(TpBackend::new(&cfg, weights, &plan, 1, opts)?)
    } else {
        Under::One(Box::new(CudaBackend::with_options(&cfg, weights, &plan, 1, opts)?))
    };
    let startup_s = t0.elapsed().as_secs_f64();
    let stats = be.get().arena_stats();
    let idle_driver_bytes = sampler.as_ref().map(|s| s.take_peak(Some(std::process::id())));
    let peak = |s: &Option<GpuSampler>| s.as_ref().map(|s| s.take_peak(Some(std::process::id())));

    let mut report = Report {
        gpu: if tp > 1 { format!("{tp}× {gpu}") } else { gpu },
        tensor_parallel: tp,
        model: format!(
            "{}{} · weights {}{}{} · KV {}",
            model_name(&model, &cfg),
            if tp > 1 { format!(" · tensor parallel {tp} (per card below)") } else { String::new() },
            plan.options.weights_dtype.name(),
            if plan.options.lm_head_int4 { " + int4 lm_head" } else { "" },
            if plan.options.embed_on_host { " + host embedding" } else { "" },
            plan.options.k_dtype.name()
        ),
        ceilings,
        plan_bytes: plan.total_bytes,
        arena_bytes: plan.arena_bytes(),
        idle_driver_bytes,
        startup_s,
        prefill: Vec::new(),
        decode: Vec::new(),
        sampling: sampling_label(&a.sample),
        skipped,
        arena_allocations_moved: false,
        snapshots: Vec::new(),
        verify: Vec::new(),
        speculative: Vec::new(),
        profiles: Vec::new(),
        phases: Vec::new(),
        deltanet,
    };

    let d = cfg.dims();
    let vocab = d.vocab;
    let page = plan.page_size;
    // All-reduces per step: after the embedding and after each layer's mixer and MLP.
    let reduces = (2 * d.num_layers + 1) as f64;
    for &t in &a.prompts {
        if t > plan.max_context {
            report.skipped.push(format!("prefill {t}: beyond the plan's context {}", plan.max_context));
            continue;
        }
        tracing::info!("bench: prefill {} tokens", fmt_count(t as u64));
        let pages: Vec<u32> = (0..t.div_ceil(page) as u32).collect();
        let tokens: Vec<u32> = (0..t).map(|i| ((i * 7919 + 13) % vocab) as u32).collect();
        // Warm-up on the first length only (kernels and GEMM algorithms are ready after one step).
        if report.prefill.is_empty() {
            prefill(be.get(), &pages, &tokens[..t.min(a.max_batch_tokens)], a.max_batch_tokens)?;
        }
        peak(&sampler);
        let s = prefill(be.get(), &pages, &tokens, a.max_batch_tokens)?;
        let driver_peak_bytes = peak(&sampler);
        // One card's FLOPs (its shard) against one card's GEMM rate; `flop` counts every card's.
        let (flop, attn) = prefill_flops(&card, plan.weight_parts.linear_params, t);
        let roofline = flop / (report.ceilings.gemm_tflops * 1e12);
        let (flop, attn) = (flop * tp as f64, attn * tp as f64);
        let (full, rest) = (t / a.max_batch_tokens, t % a.max_batch_tokens);
        let allreduce_share = match be.all_reduce_s(a.max_batch_tokens)? {
            Some(per) => {
                let last = if rest > 0 { be.all_reduce_s(rest)?.unwrap_or(0.0) } else { 0.0 };
                Some(reduces * (full as f64 * per + last) / s)
            }
            None => None,
        };
        report.prefill.push(PrefillRow {
            tokens: t,
            seconds: s,
            tflop: flop / 1e12,
            ratio: roofline / s,
            attention_share: attn / flop,
            allreduce_share,
            driver_peak_bytes,
        });
        tracing::info!("bench: prefill {t}: {:.0} tok/s", t as f64 / s);
    }

    for &ctx in &a.contexts {
        for &b in &a.batches {
            let per_seq = (ctx + a.steps + 4).div_ceil(page);
            if b * per_seq > plan.num_kv_pages || ctx + a.steps + 4 > plan.max_context {
                report.skipped.push(format!(
                    "decode batch {b} at {ctx}: needs {} KV pages, the plan has {}",
                    b * per_seq,
                    plan.num_kv_pages
                ));
                continue;
            }
            tracing::info!("bench: decode batch {b} at context {}", fmt_count(ctx as u64));
            peak(&sampler);
            let ms = decode(be.get(), b, 1, ctx, per_seq, a.steps, vocab, Pick::Logits)?;
            let ms_argmax = decode(be.get(), b, 1, ctx, per_seq, a.steps, vocab, Pick::Argmax)?;
            let ms_sampled = decode(be.get(), b, 1, ctx, per_seq, a.steps, vocab, Pick::Sample(&a.sample))?;
            let ms_host_sampled = decode(be.get(), b, 1, ctx, per_seq, a.steps, vocab, Pick::HostSample(&a.sample))?;
            let (ms_argmax_ahead, ms_sampled_ahead) = if be.get().capabilities().launches_ahead {
                let g = decode_ahead(be.get(), b, ctx, per_seq, a.steps, vocab, None)?;
                (Some(g), Some(decode_ahead(be.get(), b, ctx, per_seq, a.steps, vocab, Some(&a.sample))?))
            } else {
                (None, None)
            };
            if let (true, 1, Under::One(cb)) = (a.profile, b, &mut be) {
                tracing::info!("bench: decode step op groups at context {}", fmt_count(ctx as u64));
                cb.set_profiling(true)?;
                let eager_ms = decode(cb.as_mut(), 1, 1, ctx, per_seq, a.steps, vocab, Pick::Logits)?;
                let steps = (a.steps + 3) as f64; // decode() runs 3 warm-up steps
                let groups = cb.take_profile().into_iter().map(|(g, s)| (g, s * 1e3 / steps)).collect();
                cb.set_profiling(false)?;
                report.profiles.push(ProfileRow { context: ctx, eager_ms, groups });
            }
            if let (true, Under::One(cb)) = (a.phases, &mut be) {
                tracing::info!("bench: decode step phases, batch {b} at context {}", fmt_count(ctx as u64));
                cb.set_step_phases(true)?;
                for (output, pick) in
                    [("logits", Pick::Logits), ("greedy", Pick::Argmax), ("sampled", Pick::Sample(&a.sample))]
                {
                    decode(cb.as_mut(), b, 1, ctx, per_seq, a.steps, vocab, pick)?;
                    if let Some(p) = cb.take_step_phases() {
                        report.phases.push((b, ctx, output, p));
                    }
                }
                cb.set_step_phases(false)?;
            }
            let driver_peak_bytes = peak(&sampler);
            let allreduce_share = be.all_reduce_s(b)?.map(|per| reduces * per * 1e3 / ms);
            // One card's device weights (less the embedding table, of which a step reads only its rows),
            // KV and state.
            // A mixture of experts: only the experts the step's tokens pick.
            let embed_on_device = if plan.options.embed_on_host { 0 } else { plan.weight_parts.embed };
            let parts = &plan.weight_parts;
            let experts_read = cfg.moe.as_ref().map_or(0.0, |m| parts.experts_read(m.num_experts, m.top_k, b));
            let weight_bytes = (plan.weights_bytes - embed_on_device - parts.experts) as f64 + experts_read;
            let bytes = weight_bytes
                + (b * ctx) as f64 * plan.kv_bytes_per_token as f64
                + 2.0 * b as f64 * plan.state_bytes_per_seq as f64;
            let floor_ms = bytes / (report.ceilings.copy_gbs * 1e9) * 1e3;
            report.decode.push(DecodeRow {
                batch: b,
                context: ctx,
                ms_per_step: ms,
                ms_per_step_argmax: ms_argmax,
                ms_per_step_sampled: ms_sampled,
                ms_per_step_host_sampled: ms_host_sampled,
                ms_per_step_argmax_ahead: ms_argmax_ahead,
                ms_per_step_sampled_ahead: ms_sampled_ahead,
                bytes,
                ratio: floor_ms / ms,
                ratio_argmax: floor_ms / ms_argmax,
                ratio_sampled: floor_ms / ms_sampled,
                allreduce_share,
                driver_peak_bytes,
            });
        }
        // One sequence stepping K + 1 tokens (a verify's forward) against its one-token step.
        let n = a.verify_tokens;
        let one = report.decode.iter().find(|r| r.batch == 1 && r.context == ctx).map(|r| r.ms_per_step);
        if let (true, Some(one)) = (n > 1, one) {
            let per_seq = (ctx + (a.steps + 3) * n + 4).div_ceil(page);
            if per_seq <= plan.num_kv_pages && ctx + (a.steps + 3) * n + 4 <= plan.max_context {
                tracing::info!("bench: verify-shaped steps of {n} tokens at context {}", fmt_count(ctx as u64));
                let ms = decode(be.get(), 1, n, ctx, per_seq, a.steps, vocab, Pick::Logits)?;
                report.verify.push((n, ctx, ms, one));
            }
        }
        let k = a.speculative_tokens;
        if let (true, Under::One(cb)) = (k > 0, &mut be) {
            for &b in &a.batches {
                let Some(one) = report.decode.iter().find(|r| r.batch == b && r.context == ctx).map(|r| r.ms_per_step)
                else {
                    continue;
                };
                let per_seq = (ctx + (a.steps + 3) * (k + 1) + 4).div_ceil(page);
                if b * per_seq > plan.num_kv_pages {
                    continue;
                }
                tracing::info!("bench: speculative steps (K = {k}) batch {b} at context {}", fmt_count(ctx as u64));
                let (draft_ms, verify_ms, commit_ms) = speculative(cb, b, k, ctx, per_seq, a.steps, vocab)?;
                report.speculative.push(SpecRow {
                    k,
                    batch: b,
                    context: ctx,
                    draft_ms,
                    verify_ms,
                    commit_ms,
                    decode_ms: one,
                });
            }
        }
    }
    if d.num_deltanet_layers > 0 {
        tracing::info!("bench: DeltaNet state snapshots ({} per sequence)", fmt_bytes(plan.state_bytes_per_seq));
        let ops: [(&'static str, CacheOp); 4] = [
            ("save to device", CacheOp::SaveState { slot: 0, to: SnapshotLoc::Device(0) }),
            (
                "restore from device",
                CacheOp::RestoreState { from: SnapshotLoc::Device(0), slot: 1.min(plan.max_seqs as u32 - 1) },
            ),
            ("save to host", CacheOp::SaveState { slot: 0, to: SnapshotLoc::Host(0) }),
            (
                "restore from host",
                CacheOp::RestoreState { from: SnapshotLoc::Host(0), slot: 1.min(plan.max_seqs as u32 - 1) },
            ),
        ];
        for (what, op) in ops {
            report.snapshots.push((what, time_cache_op(be.get(), op)?));
        }
    }
    report.arena_allocations_moved = be.get().arena_stats().allocations != stats.allocations;
    drop(be);

    emit("bench", &report, a.json, a.svg.as_deref())
}

/// The backend under test: one GPU or a tensor-parallel group.
enum Under {
    One(Box<CudaBackend>),
    Tp(TpBackend),
}

impl Under {
    fn get(&mut self) -> &mut dyn Backend {
        match self {
            Under::One(b) => b.as_mut(),
            Under::Tp(b) => b,
        }
    }

    /// Seconds per all-reduce of `[tokens, hidden]` over the group (None on one GPU).
    fn all_reduce_s(&mut self, tokens: usize) -> Result<Option<f64>> {
        match self {
            Under::One(_) => Ok(None),
            Under::Tp(b) => Ok(Some(b.time_all_reduce(tokens, 20)?)),
        }
    }
}

fn model_name(m: &ModelArgs, cfg: &ModelConfig) -> String {
    let shape = format!("{} layers, hidden {}", cfg.layer_types.len(), cfg.hidden_size);
    match (&m.model, &m.preset) {
        (Some(dir), _) => format!("{} ({shape})", dir.display()),
        (None, Some(p)) => format!("preset {p}, random weights ({shape})"),
        _ => shape,
    }
}

/// The chunked DeltaNet prefill kernels alone (prep + walk, one layer) at the model's per-card shape:
/// one prompt of 4K, 16K and 64K tokens and four of 1K, as far as the free memory allows (each case
/// allocates its own buffers, freed before the backend starts).
fn measure_deltanet(
    rt: &Runtime,
    k: &Kernels,
    card: &ModelConfig,
    skipped: &mut Vec<String>,
) -> Result<Vec<deltaserve_cuda::gdn_bench::GdnTiming>> {
    use deltaserve_cuda::gdn_bench::{gdn_bench_bytes, time_gdn_prefill};
    let d = card.dims();
    if d.num_deltanet_layers == 0 {
        return Ok(Vec::new());
    }
    let mut out = Vec::new();
    for (t, seqs) in [(4096usize, 1usize), (16384, 1), (65536, 1), (4096, 4)] {
        let need = gdn_bench_bytes(k, t, seqs, d.gdn_k_heads, d.gdn_v_heads) as u64;
        let free = rt.free_memory()?;
        if need > free - free / 10 {
            skipped.push(format!("DeltaNet kernels at {t} tokens: need {}, {} free", fmt_bytes(need), fmt_bytes(free)));
            continue;
        }
        tracing::info!("bench: DeltaNet prefill kernels, {seqs} × {} tokens", fmt_count((t / seqs) as u64));
        let prec = deltaserve_cuda::ops::gdn_chunk::Precision::Split;
        out.push(time_gdn_prefill(rt, k, d.gdn_k_heads, d.gdn_v_heads, t, seqs, prec, 10)?);
    }
    Ok(out)
}

/// bf16 GEMM rate (8192³, median of 10) and device copy rate (1 GiB, read + write bytes per second).
fn measure_ceilings(rt: &Runtime, k: &Kernels) -> Result<Ceilings> {
    let n = 8192usize;
    let mut arena = Arena::new(rt.context().clone());
    let r = arena.add_region("bench ceilings", 3 * n * n * 2 + (32 << 20))?;
    let (x, w, y) = (arena.alloc(r, n * n * 2)?, arena.alloc(r, n * n * 2)?, arena.alloc(r, n * n * 2)?);
    let ws = arena.alloc(r, 32 << 20)?;
    init_random(k, rt.stream(), x.ptr, n * n, 1, Init::Normal(1.0), false)?;
    init_random(k, rt.stream(), w.ptr, n * n, 2, Init::Normal(1.0), false)?;
    let g = deltaserve_cuda::gemm::Gemm::new(rt, ws)?;
    let gemm_s = time_median(rt, 12, || g.linear(rt.stream(), x.ptr, w.ptr, y.ptr, n, n, n))?;
    // The copy reuses the GEMM buffers: 2 × 128 MiB, several copies per timing.
    let bytes = n * n * 2;
    let copy_s = time_median(rt, 12, || {
        for _ in 0..8 {
            rt.copy_device(y.ptr, x.ptr, bytes)?;
        }
        Ok(())
    })? / 8.0;
    drop(g);
    drop(arena);
    Ok(Ceilings { gemm_tflops: 2.0 * (n as f64).powi(3) / gemm_s / 1e12, copy_gbs: 2.0 * bytes as f64 / copy_s / 1e9 })
}

/// Median wall time of `f` (synchronised), after 2 warm-up runs.
fn time_median(
    rt: &Runtime,
    runs: usize,
    mut f: impl FnMut() -> Result<(), deltaserve_cuda::CudaError>,
) -> Result<f64> {
    let mut times = Vec::new();
    for i in 0..runs + 2 {
        rt.synchronize()?;
        let t0 = Instant::now();
        f()?;
        rt.synchronize()?;
        if i >= 2 {
            times.push(t0.elapsed().as_secs_f64());
        }
    }
    Ok(median(times))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// One prompt through the backend in chunks of `chunk` tokens (slot 0, state from zero); seconds.
fn prefill(be: &mut dyn Backend, pages: &[u32], tokens: &[u32], chunk: usize) -> Result<f64> {
    let mut out = StepOut::default();
    let t0 = Instant::now();
    for (i, c) in tokens.chunks(chunk).enumerate() {
        let start = i * chunk;
        let last = start + c.len() == tokens.len();
        let batch = StepBatch {
            seqs: vec![SeqChunk {
                seq_id: 0,
                slot: 0,
                pages: pages.to_vec(),
                start,
                tokens: c.to_vec(),
                want_logits: last,
                ..Default::default()
            }],
            ..Default::default()
        };
        out.clear();
        be.step(&batch, Want::Logits, &mut out)?;
    }
    let s = t0.elapsed().as_secs_f64();
    if !out.logits.iter().all(|x| x.is_finite()) {
        bail!("prefill of {} tokens produced non-finite logits", tokens.len());
    }
    Ok(s)
}

/// What a timed decode step hands back.
#[derive(Clone, Copy, Debug)]
enum Pick<'a> {
    /// Every row's logits.
    Logits,
    /// Every row's argmax, picked on the device ([`Want::Tokens`], greedy decoding).
    Argmax,
    /// Every row's token sampled by this rule on the device ([`Want::Tokens`]).
    Sample(&'a RowSampling),
    /// The logits, then the host's pick by this rule (the engine's path without device sampling).
    HostSample(&'a RowSampling),
}

/// `--sample temperature,top_k,top_p,min_p`.
fn parse_sampling(s: &str) -> Result<RowSampling, String> {
    let v: Vec<&str> = s.split(',').map(str::trim).collect();
    let bad = || format!("`{s}`: expected temperature,top_k,top_p,min_p (e.g. 0.6,20,0.95,0)");
    let [t, k, p, m] = v[..] else { return Err(bad()) };
    let f = |x: &str| x.parse::<f32>().map_err(|_| bad());
    let row = RowSampling {
        temperature: f(t)?,
        top_k: k.parse().map_err(|_| bad())?,
        top_p: f(p)?,
        min_p: f(m)?,
        ..RowSampling::greedy()
    };
    let ok = row.temperature > 0.0 && row.temperature.is_finite() && row.top_p > 0.0 && row.top_p <= 1.0;
    if !ok || !(0.0..=1.0).contains(&row.min_p) {
        return Err(format!("`{s}`: temperature > 0, top_p in (0, 1], min_p in [0, 1]"));
    }
    Ok(row)
}

/// `--sample`'s rule in words.
fn sampling_label(r: &RowSampling) -> String {
    format!("temperature {}, top-k {}, top-p {}, min-p {}", r.temperature, r.top_k, r.top_p, r.min_p)
}

/// `b` sequences of `n` tokens each per step at positions `ctx..` (n = 1: decode): median ms per step over
/// `steps` steps, each handing back what `pick` says.
#[allow(clippy::too_many_arguments)]
fn decode(
    be: &mut dyn Backend,
    b: usize,
    n: usize,
    ctx: usize,
    per_seq: usize,
    steps: usize,
    vocab: usize,
    pick: Pick<'_>,
) -> Result<f64> {
    let mut out = StepOut::default();
    let mut times = Vec::new();
    for step in 0..steps + 3 {
        let batch = StepBatch { seqs: step_seqs(b, n, ctx + step * n, per_seq, step, vocab), ..Default::default() };
        let rows: Vec<RowSampling> = match pick {
            Pick::Sample(r) | Pick::HostSample(r) => step_rows(r, b, step),
            _ => Vec::new(),
        };
        out.clear();
        let t0 = Instant::now();
        let tokens = |pick| Want::Tokens { valid: vocab, pick };
        match pick {
            Pick::Logits => be.step(&batch, Want::Logits, &mut out)?,
            Pick::Argmax => be.step(&batch, tokens(deltaserve_backend::Pick::Argmax), &mut out)?,
            Pick::Sample(_) => be.step(&batch, tokens(deltaserve_backend::Pick::Sample(&rows)), &mut out)?,
            Pick::HostSample(_) => {
                be.step(&batch, Want::Logits, &mut out)?;
                out.tokens.extend(out.logits.chunks_exact_mut(vocab).zip(&rows).map(|(l, r)| r.pick(l)));
            }
        }
        if step >= 3 {
            times.push(t0.elapsed().as_secs_f64() * 1e3);
        }
    }
    Ok(median(times))
}

/// Step `step`'s sampling rows of `b` sequences: `rule` with a fixed spread of draws.
fn step_rows(rule: &RowSampling, b: usize, step: usize) -> Vec<RowSampling> {
    (0..b)
        .map(|i| RowSampling { uniform: ((i * 7919 + step * 104_729) % 1000) as f32 / 1000.0, ..rule.clone() })
        .collect()
}

/// [`decode`]'s greedy (`rule` None) or sampled steps launched ahead: each step is launched, fed the
/// previous one's picks on the device, before the previous one is collected. Median ms between
/// consecutive collections (the time per token the engine's look-ahead gives).
fn decode_ahead(
    be: &mut dyn Backend,
    b: usize,
    ctx: usize,
    per_seq: usize,
    steps: usize,
    vocab: usize,
    rule: Option<&RowSampling>,
) -> Result<f64> {
    let feed = Feed { from: (0..b).collect(), stops: vec![Vec::new(); b] };
    let mut picked = Picked::default();
    let mut times = Vec::new();
    let mut last: Option<Instant> = None;
    for step in 0..steps + 4 {
        let batch = StepBatch { seqs: step_seqs(b, 1, ctx + step, per_seq, step, vocab), ..Default::default() };
        let rows: Vec<RowSampling> = rule.map_or_else(Vec::new, |r| step_rows(r, b, step));
        let pick =
            if rule.is_some() { deltaserve_backend::Pick::Sample(&rows) } else { deltaserve_backend::Pick::Argmax };
        be.launch(&batch, vocab, pick, (step > 0).then_some(&feed))?;
        if step > 0 {
            picked.tokens.clear();
            picked.on_device.clear();
            be.collect(&mut picked)?;
            let now = Instant::now();
            if let Some(t) = last
                && step > 3
            {
                times.push((now - t).as_secs_f64() * 1e3);
            }
            last = Some(now);
        }
    }
    be.collect(&mut picked)?;
    Ok(median(times))
}

/// Step `step`'s chunks of `b` sequences (slot i, pages `i·per_seq..`), `n` tokens each from position
/// `start`, each wanting its logits.
fn step_seqs(b: usize, n: usize, start: usize, per_seq: usize, step: usize, vocab: usize) -> Vec<SeqChunk> {
    (0..b)
        .map(|i| SeqChunk {
            seq_id: i as u64,
            slot: i as u32,
            pages: ((i * per_seq) as u32..((i + 1) * per_seq) as u32).collect(),
            start,
            tokens: (0..n).map(|j| ((i * 131 + step * 17 + j * 7) % vocab) as u32).collect(),
            want_logits: true,
            ..Default::default()
        })
        .collect()
}

/// Speculative steps of `b` sequences drafting `k` tokens from context `ctx`, committing all `k + 1`
/// positions: median ms of (draft, verify, commit).
fn speculative(
    be: &mut CudaBackend,
    b: usize,
    k: usize,
    ctx: usize,
    per_seq: usize,
    steps: usize,
    vocab: usize,
) -> Result<(f64, f64, f64)> {
    let (mut draft, mut verify, mut commit) = (Vec::new(), Vec::new(), Vec::new());
    let mut pick = |_: u64, _: usize, row: &[f32]| deltaserve_backend::argmax(row);
    let mut out = StepOut::default();
    for step in 0..steps + 3 {
        let mut seqs = step_seqs(b, 1, ctx + step * (k + 1), per_seq, step, vocab);
        for c in &mut seqs {
            (c.draft, c.greedy_draft_vocab) = (k, vocab);
        }
        let commits: Vec<deltaserve_backend::SpecCommit> = seqs
            .iter()
            .map(|c| deltaserve_backend::SpecCommit {
                seq_id: c.seq_id,
                slot: c.slot,
                pages: c.pages.clone(),
                start: c.start,
                accepted: k + 1,
            })
            .collect();
        let batch = StepBatch { seqs, ..Default::default() };
        out.clear();
        let t0 = Instant::now();
        be.step(&batch, Want::Drafts(&mut pick), &mut out)?;
        let t1 = Instant::now();
        be.commit_speculative(&commits)?;
        if step >= 3 {
            let d = be.last_draft_s() * 1e3;
            draft.push(d);
            verify.push((t1 - t0).as_secs_f64() * 1e3 - d);
            commit.push(t1.elapsed().as_secs_f64() * 1e3);
        }
    }
    Ok((median(draft), median(verify), median(commit)))
}

/// Median ms of a step that only runs `op` (10 runs after 2 warm-ups), synchronised.
fn time_cache_op(be: &mut dyn Backend, op: CacheOp) -> Result<f64> {
    let batch = StepBatch { pre: vec![op], ..Default::default() };
    let mut out = StepOut::default();
    let mut times = Vec::new();
    for i in 0..12 {
        let t0 = Instant::now();
        be.step(&batch, Want::Logits, &mut out)?;
        if i >= 2 {
            times.push(t0.elapsed().as_secs_f64() * 1e3);
        }
    }
    Ok(median(times))
}

/// (total FLOPs, attention FLOPs) of a `t`-token prompt from position 0 (`docs/architecture.md` §6). A
/// mixture of experts' token runs its `top_k` routed experts, not all of them.
fn prefill_flops(cfg: &ModelConfig, linear_params: u64, t: usize) -> (f64, f64) {
    let d = cfg.dims();
    let t = t as f64;
    let unrouted = cfg.moe.as_ref().map_or(0.0, |m| {
        let per_expert = 3.0 * (m.expert_intermediate * d.hidden) as f64;
        (m.num_sparse_layers() * m.num_experts.saturating_sub(m.top_k)) as f64 * per_expert
    });
    let linears = 2.0 * (linear_params as f64 - unrouted) * t;
    let gdn = 180e3 * (d.gdn_k_dim * d.gdn_v_dim) as f64 / 16384.0 * (d.gdn_v_heads * d.num_deltanet_layers) as f64 * t;
    let attn = 4.0 * (d.head_dim * d.q_heads * d.num_attention_layers) as f64 * t * (t + 1.0) / 2.0;
    let lm_head = 2.0 * (d.vocab * d.hidden) as f64;
    (linears + gdn + attn + lm_head, attn)
}

impl Report {
    fn peak_driver_bytes(&self) -> Option<u64> {
        let p = self.prefill.iter().filter_map(|r| r.driver_peak_bytes);
        p.chain(self.decode.iter().filter_map(|r| r.driver_peak_bytes)).chain(self.idle_driver_bytes).max()
    }
}

impl Report {
    /// Grouped bars: each decode row's ms per step with the logits, the greedy token, the token sampled on
    /// the device and sampled on the host.
    fn svg_picks(&self, s: &mut String, x0: f64, y0: f64, pw: f64, ph: f64) {
        const SERIES: [(&str, &str); 6] = [
            ("logits", "#999999"),
            ("greedy", "#4a7bd0"),
            ("sampled (GPU)", "#2a9d5b"),
            ("sampled (host)", "#d0704a"),
            ("greedy, ahead", "#1f3f8a"),
            ("sampled, ahead", "#145a34"),
        ];
        let _ = writeln!(
            s,
            "<text x=\"{x0}\" y=\"{}\">decode ms per step by what the step hands back (sampled: {})</text>",
            y0 - 8.0,
            xml(&self.sampling)
        );
        let _ =
            writeln!(s, "<rect x=\"{x0}\" y=\"{y0}\" width=\"{pw}\" height=\"{ph}\" fill=\"none\" stroke=\"#999\"/>");
        let groups: Vec<(String, [f64; 6])> = self
            .decode
            .iter()
            .map(|r| {
                let ahead = |x: Option<f64>| x.unwrap_or(0.0);
                let ms = [
                    r.ms_per_step,
                    r.ms_per_step_argmax,
                    r.ms_per_step_sampled,
                    r.ms_per_step_host_sampled,
                    ahead(r.ms_per_step_argmax_ahead),
                    ahead(r.ms_per_step_sampled_ahead),
                ];
                (format!("b{}@{}", r.batch, short(r.context)), ms)
            })
            .collect();
        let max = groups.iter().flat_map(|g| g.1).fold(1e-9, f64::max);
        let gw = pw / groups.len() as f64;
        let bw = gw * 0.8 / SERIES.len() as f64;
        for (j, (label, ms)) in groups.iter().enumerate() {
            for (k, (&v, (name, color))) in ms.iter().zip(SERIES).enumerate().filter(|(_, (v, _))| **v > 0.0) {
                let bh = ph * v / max;
                let x = x0 + j as f64 * gw + gw * 0.1 + k as f64 * bw;
                let _ = writeln!(
                    s,
                    "<rect x=\"{x:.1}\" y=\"{:.1}\" width=\"{:.1}\" height=\"{bh:.1}\" fill=\"{color}\"><title>{label} {name}: \
                     {v:.2} ms</title></rect>",
                    y0 + ph - bh,
                    bw * 0.9
                );
                let _ = writeln!(
                    s,
                    "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\" font-size=\"9\">{v:.2}</text>",
                    x + bw * 0.45,
                    y0 + ph - bh - 3.0
                );
            }
            let _ = writeln!(
                s,
                "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{}</text>",
                x0 + (j as f64 + 0.5) * gw,
                y0 + ph + 14.0,
                xml(label)
            );
        }
        for (k, (name, color)) in SERIES.iter().enumerate() {
            let x = x0 + k as f64 * 120.0;
            let y = y0 + ph + 32.0;
            let _ = writeln!(s, "<rect x=\"{x}\" y=\"{}\" width=\"10\" height=\"10\" fill=\"{color}\"/>", y - 9.0);
            let _ = writeln!(s, "<text x=\"{}\" y=\"{y}\">{name}</text>", x + 14.0);
        }
    }
}

impl ToolReport for Report {
    fn to_json(&self) -> Value {
        json!({
            "gpu": self.gpu,
            "tensor_parallel": self.tensor_parallel,
            "model": self.model,
            "ceilings": {"gemm_bf16_tflops": r1(self.ceilings.gemm_tflops), "copy_gb_s": r1(self.ceilings.copy_gbs)},
            "plan_bytes": self.plan_bytes,
            "arena_bytes": self.arena_bytes,
            "startup_s": r1(self.startup_s),
            "driver_idle_bytes": self.idle_driver_bytes,
            "driver_peak_bytes": self.peak_driver_bytes(),
            "arena_allocated_after_start": self.arena_allocations_moved,
            "prefill": self.prefill.iter().map(|r| json!({
                "tokens": r.tokens, "seconds": r3(r.seconds), "ttft_ms": r1(r.seconds * 1e3),
                "tokens_per_s": r1(r.tokens as f64 / r.seconds), "tflops": r1(r.tflop / r.seconds),
                "roofline_ratio": r3(r.ratio), "attention_flop_share": r3(r.attention_share),
                "allreduce_share": r.allreduce_share.map(r3), "driver_peak_bytes": r.driver_peak_bytes,
            })).collect::<Vec<_>>(),
            "sampling": self.sampling,
            "decode": self.decode.iter().map(|r| json!({
                "batch": r.batch, "context": r.context, "ms_per_step": r3(r.ms_per_step),
                "ms_per_step_argmax": r3(r.ms_per_step_argmax),
                "ms_per_step_sampled": r3(r.ms_per_step_sampled),
                "ms_per_step_host_sampled": r3(r.ms_per_step_host_sampled),
                "roofline_ratio_sampled": r3(r.ratio_sampled),
                "ms_per_step_argmax_ahead": r.ms_per_step_argmax_ahead.map(r3),
                "ms_per_step_sampled_ahead": r.ms_per_step_sampled_ahead.map(r3),
                "roofline_ratio_argmax_ahead": r.ms_per_step_argmax_ahead.map(|ms| r3(r.ratio * r.ms_per_step / ms)),
                "roofline_ratio_sampled_ahead": r.ms_per_step_sampled_ahead.map(|ms| r3(r.ratio * r.ms_per_step / ms)),
                "tokens_per_s": r1(r.batch as f64 * 1e3 / r.ms_per_step), "bytes_per_step": r.bytes,
                "roofline_ratio": r3(r.ratio), "roofline_ratio_argmax": r3(r.ratio_argmax),
                "allreduce_share": r.allreduce_share.map(r3), "driver_peak_bytes": r.driver_peak_bytes,
            })).collect::<Vec<_>>(),
            "verify": self.verify.iter().map(|&(n, ctx, ms, one)| json!({
                "tokens_per_step": n, "context": ctx, "ms_per_step": r3(ms), "decode_ms_per_step": r3(one),
                "ratio_to_decode": r3(ms / one),
            })).collect::<Vec<_>>(),
            "speculative": self.speculative.iter().map(|r| json!({
                "draft_tokens": r.k, "batch": r.batch, "context": r.context, "draft_ms": r3(r.draft_ms),
                "verify_ms": r3(r.verify_ms), "commit_ms": r3(r.commit_ms), "step_ms": r3(r.total_ms()),
                "decode_ms_per_step": r3(r.decode_ms), "verify_ratio_to_decode": r3(r.verify_ms / r.decode_ms),
                "step_ratio_to_decode": r3(r.total_ms() / r.decode_ms),
                "speedup_at_2_5_tokens": r3(r.speedup(2.5)), "speedup_at_3_tokens": r3(r.speedup(3.0)),
            })).collect::<Vec<_>>(),
            "deltanet_prefill": self.deltanet.iter().map(|r| {
                let (fla_t, fla) = deltaserve_cuda::gdn_bench::fla_h200_nearest(r.tokens / r.seqs);
                json!({
                    "tokens": r.tokens, "sequences": r.seqs, "ms": r3(r.ms), "prep_ms": r3(r.prep_ms),
                    "walk_ms": r3(r.state_ms), "mtok_per_s_per_layer": r3(r.mtok_per_s()),
                    "fla_h200_mtok_per_s": fla, "fla_h200_tokens": fla_t, "ratio_to_fla_h200": r3(r.mtok_per_s() / fla),
                    "workspace_bytes": r.workspace_bytes, "nonfinite_outputs": r.nonfinite,
                })
            }).collect::<Vec<_>>(),
            "profile": self.profiles.iter().map(|p| json!({
                "batch": 1, "context": p.context, "eager_ms_per_step": r3(p.eager_ms),
                "gpu_ms_per_step": r3(p.groups.iter().map(|g| g.1).sum::<f64>()),
                "groups_ms": p.groups.iter().map(|(g, ms)| json!([g, r3(*ms)])).collect::<Vec<_>>(),
            })).collect::<Vec<_>>(),
            "phases": self.phases.iter().map(|(b, ctx, out, p)| json!({
                "batch": b, "context": ctx, "output": out, "steps": p.steps, "wall_ms": r3(p.wall_ms),
                "host_prep_ms": r3(p.host_prep_ms), "host_upload_ms": r3(p.host_upload_ms),
                "host_launch_ms": r3(p.host_launch_ms), "gpu_inputs_ms": r3(p.gpu_inputs_ms),
                "gpu_forward_ms": r3(p.gpu_forward_ms), "output_ms": r3(p.output_ms),
            })).collect::<Vec<_>>(),
            "snapshots_ms": self.snapshots.iter().map(|(w, ms)| (w.replace(' ', "_"), json!(r3(*ms)))).collect::<serde_json::Map<_, _>>(),
            "skipped": self.skipped,
        })
    }

    fn table(&self) -> String {
        let mut s = String::new();
        let c = &self.ceilings;
        let _ = writeln!(s, "deltaserve bench on {}: {}", self.gpu, self.model);
        let _ = writeln!(
            s,
            "ceilings: bf16 GEMM {:.0} TFLOP/s · device copy {:.0} GB/s (read + write) · backend up in {:.1} s",
            c.gemm_tflops, c.copy_gbs, self.startup_s
        );
        let _ = writeln!(s, "\nprefill (one prompt, chunked)    roofline = FLOPs / GEMM rate");
        let _ = writeln!(
            s,
            "{:>9} {:>10} {:>10} {:>9} {:>9} {:>8} {:>11} {:>11}",
            "tokens", "TTFT ms", "tok/s", "TFLOP/s", "roofline", "attn %", "driver", "all-reduce"
        );
        for r in &self.prefill {
            let _ = writeln!(
                s,
                "{:>9} {:>10.0} {:>10.0} {:>9.0} {:>8.1}% {:>7.0}% {:>11} {:>11}",
                r.tokens,
                r.seconds * 1e3,
                r.tokens as f64 / r.seconds,
                r.tflop / r.seconds,
                100.0 * r.ratio,
                100.0 * r.attention_share,
                r.driver_peak_bytes.map_or("n/a".into(), fmt_bytes),
                pct(r.allreduce_share)
            );
        }
        let _ = writeln!(
            s,
            "\ndecode (one token per sequence)    roofline = bytes / copy rate (the step with the logits returned; \
             argmax: with the greedy token picked on the device; sampled: {} on the device; host-sampled: the \
             logits step, then the host's pick)",
            self.sampling
        );
        let _ = writeln!(
            s,
            "{:>6} {:>8} {:>10} {:>12} {:>12} {:>15} {:>10} {:>10} {:>9} {:>9} {:>9} {:>11} {:>11}",
            "batch",
            "context",
            "ms/step",
            "argmax ms",
            "sampled ms",
            "host-sampled ms",
            "tok/s",
            "GB/step",
            "roofline",
            "argmax",
            "sampled",
            "driver",
            "all-reduce"
        );
        for r in &self.decode {
            let _ = writeln!(
                s,
                "{:>6} {:>8} {:>10.2} {:>12.2} {:>12.2} {:>15.2} {:>10.1} {:>10.2} {:>8.1}% {:>8.1}% {:>8.1}% {:>11} {:>11}",
                r.batch,
                r.context,
                r.ms_per_step,
                r.ms_per_step_argmax,
                r.ms_per_step_sampled,
                r.ms_per_step_host_sampled,
                r.batch as f64 * 1e3 / r.ms_per_step,
                r.bytes / 1e9,
                100.0 * r.ratio,
                100.0 * r.ratio_argmax,
                100.0 * r.ratio_sampled,
                r.driver_peak_bytes.map_or("n/a".into(), fmt_bytes),
                pct(r.allreduce_share)
            );
        }
        if self.decode.iter().any(|r| r.ms_per_step_argmax_ahead.is_some()) {
            let _ = writeln!(
                s,
                "\ndecode launched ahead (each step launched before the previous one's tokens are read; ms between tokens)"
            );
            let _ = writeln!(
                s,
                "{:>6} {:>8} {:>10} {:>9} {:>11} {:>9}",
                "batch", "context", "greedy ms", "roofline", "sampled ms", "roofline"
            );
            for r in &self.decode {
                let (Some(g), Some(x)) = (r.ms_per_step_argmax_ahead, r.ms_per_step_sampled_ahead) else { continue };
                let ratio = |ms: f64| 100.0 * r.ratio * r.ms_per_step / ms;
                let _ = writeln!(
                    s,
                    "{:>6} {:>8} {:>10.3} {:>8.1}% {:>11.3} {:>8.1}%",
                    r.batch,
                    r.context,
                    g,
                    ratio(g),
                    x,
                    ratio(x)
                );
            }
        }
        let _ = writeln!(
            s,
            "\nmemory: plan {} (arena {}); driver idle {}, peak {} ({}); arena allocations after start: {}",
            fmt_bytes(self.plan_bytes),
            fmt_bytes(self.arena_bytes),
            self.idle_driver_bytes.map_or("n/a".into(), fmt_bytes),
            self.peak_driver_bytes().map_or("n/a".into(), fmt_bytes),
            self.peak_driver_bytes()
                .map_or("-".into(), |p| format!("{:.3} of the plan", p as f64 / self.plan_bytes as f64)),
            if self.arena_allocations_moved { "YES" } else { "none" }
        );
        if !self.deltanet.is_empty() {
            let _ = writeln!(
                s,
                "\nDeltaNet chunked prefill kernels alone (one layer, the model's shape; FLA = flash-linear-attention on an H200)"
            );
            let _ = writeln!(
                s,
                "{:>14} {:>9} {:>9} {:>9} {:>12} {:>8} {:>12}",
                "tokens", "ms", "prep ms", "walk ms", "M tok/s", "vs FLA", "workspace"
            );
            for r in &self.deltanet {
                let (_, fla) = deltaserve_cuda::gdn_bench::fla_h200_nearest(r.tokens / r.seqs);
                let _ = writeln!(
                    s,
                    "{:>14} {:>9.3} {:>9.3} {:>9.3} {:>12.2} {:>7.2}× {:>12}",
                    if r.seqs == 1 { format!("{}", r.tokens) } else { format!("{} × {}", r.seqs, r.tokens / r.seqs) },
                    r.ms,
                    r.prep_ms,
                    r.state_ms,
                    r.mtok_per_s(),
                    r.mtok_per_s() / fla,
                    fmt_bytes(r.workspace_bytes as u64)
                );
            }
        }
        for p in &self.profiles {
            let gpu: f64 = p.groups.iter().map(|g| g.1).sum();
            let _ = writeln!(
                s,
                "\ndecode step at batch 1, context {}, op group by op group (eager: {:.2} ms/step, GPU {gpu:.2} ms)",
                p.context, p.eager_ms
            );
            for (g, ms) in &p.groups {
                let _ = writeln!(s, "{g:>32} {ms:>8.3} ms {:>5.1}%", 100.0 * ms / gpu);
            }
        }
        if !self.phases.is_empty() {
            let _ = writeln!(
                s,
                "\ndecode step phases (medians, ms): host before the forward, GPU inputs and forward, outputs"
            );
            let _ = writeln!(
                s,
                "{:>6} {:>8} {:>7} {:>7} {:>7} {:>7} {:>7} {:>8} {:>7} {:>7}",
                "batch", "context", "output", "wall", "prep", "upload", "launch", "forward", "inputs", "return"
            );
            for (b, ctx, out, p) in &self.phases {
                let _ = writeln!(
                    s,
                    "{b:>6} {ctx:>8} {out:>7} {:>7.3} {:>7.3} {:>7.3} {:>7.3} {:>8.3} {:>7.3} {:>7.3}",
                    p.wall_ms,
                    p.host_prep_ms,
                    p.host_upload_ms,
                    p.host_launch_ms,
                    p.gpu_forward_ms,
                    p.gpu_inputs_ms,
                    p.output_ms
                );
            }
        }
        if !self.snapshots.is_empty() {
            let parts: Vec<String> = self.snapshots.iter().map(|(w, ms)| format!("{w} {ms:.2} ms")).collect();
            let _ = writeln!(s, "DeltaNet state snapshot: {}", parts.join(" · "));
        }
        for &(n, ctx, ms, one) in &self.verify {
            let _ = writeln!(
                s,
                "verify-shaped step ({n} tokens, batch 1) at {ctx}: {ms:.2} ms = {:.2}× the one-token step ({one:.2} ms)",
                ms / one
            );
        }
        if !self.speculative.is_empty() {
            let _ = writeln!(s, "\nspeculative steps (MTP head drafts K, verify K + 1, commit K + 1)");
            let _ = writeln!(
                s,
                "{:>3} {:>6} {:>8} {:>9} {:>10} {:>10} {:>9} {:>10} {:>9} {:>11}",
                "K",
                "batch",
                "context",
                "draft ms",
                "verify ms",
                "commit ms",
                "step ms",
                "decode ms",
                "verify ×",
                "×@2.5 / ×@3"
            );
            for r in &self.speculative {
                let _ = writeln!(
                    s,
                    "{:>3} {:>6} {:>8} {:>9.2} {:>10.2} {:>10.2} {:>9.2} {:>10.2} {:>9.2} {:>5.2} / {:.2}",
                    r.k,
                    r.batch,
                    r.context,
                    r.draft_ms,
                    r.verify_ms,
                    r.commit_ms,
                    r.total_ms(),
                    r.decode_ms,
                    r.verify_ms / r.decode_ms,
                    r.speedup(2.5),
                    r.speedup(3.0)
                );
            }
        }
        for k in &self.skipped {
            let _ = writeln!(s, "skipped: {k}");
        }
        s
    }

    /// Prefill tokens/s by prompt length and decode tokens/s by batch (one series per context); below,
    /// each decode row's step time by what the step hands back.
    fn svg(&self) -> String {
        let (w, h, pad) = (820.0, 360.0, 56.0);
        let pw = (w - 3.0 * pad) / 2.0;
        let ph = h - 2.0 * pad;
        let h = h + if self.decode.is_empty() { 0.0 } else { 300.0 };
        let mut s = format!(
            "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"11\">\n\
             <text x=\"{pad}\" y=\"22\" font-size=\"14\">deltaserve bench — {}</text>\n",
            xml(&self.gpu)
        );
        let panels: [(&str, Vec<Bar>); 2] = [
            (
                "prefill tok/s by prompt (label: % of roofline)",
                self.prefill.iter().map(|r| (short(r.tokens), r.tokens as f64 / r.seconds, r.ratio)).collect(),
            ),
            (
                "decode tok/s by batch @ context (label: % of roofline)",
                self.decode
                    .iter()
                    .map(|r| {
                        (format!("b{}@{}", r.batch, short(r.context)), r.batch as f64 * 1e3 / r.ms_per_step, r.ratio)
                    })
                    .collect(),
            ),
        ];
        for (i, (title, bars)) in panels.iter().enumerate() {
            let x0 = pad + i as f64 * (pw + pad);
            let y0 = pad;
            let _ = writeln!(s, "<text x=\"{x0}\" y=\"{}\">{title}</text>", y0 - 8.0);
            let _ = writeln!(
                s,
                "<rect x=\"{x0}\" y=\"{y0}\" width=\"{pw}\" height=\"{ph}\" fill=\"none\" stroke=\"#999\"/>"
            );
            let max = bars.iter().map(|b| b.1).fold(1.0, f64::max);
            let bw = pw / bars.len().max(1) as f64;
            for (j, (label, v, ratio)) in bars.iter().enumerate() {
                let bh = ph * v / max;
                let x = x0 + j as f64 * bw + bw * 0.15;
                let _ = writeln!(
                    s,
                    "<rect x=\"{x:.1}\" y=\"{:.1}\" width=\"{:.1}\" height=\"{bh:.1}\" fill=\"#4a7bd0\"><title>{label}: {v:.0}</title></rect>",
                    y0 + ph - bh,
                    bw * 0.7
                );
                let cx = x + bw * 0.35;
                let _ = writeln!(
                    s,
                    "<text x=\"{cx:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{:.0} ({:.0}%)</text>",
                    y0 + ph - bh - 4.0,
                    v,
                    100.0 * ratio
                );
                let _ = writeln!(
                    s,
                    "<text x=\"{cx:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{}</text>",
                    y0 + ph + 14.0,
                    xml(label)
                );
            }
        }
        if !self.decode.is_empty() {
            self.svg_picks(&mut s, pad, 360.0 + 10.0, w - 2.0 * pad, 200.0);
        }
        s.push_str("</svg>\n");
        s
    }

    fn failures(&self) -> Vec<String> {
        let mut f = Vec::new();
        for r in self.deltanet.iter().filter(|r| r.nonfinite > 0) {
            f.push(format!("the DeltaNet kernels gave {} non-finite outputs at {} tokens", r.nonfinite, r.tokens));
        }
        if self.arena_allocations_moved {
            f.push("the arena allocated after start".to_string());
        }
        if let Some(p) = self.peak_driver_bytes()
            && p > self.plan_bytes
        {
            f.push(format!(
                "driver-reported memory {} is above the plan's {}",
                fmt_bytes(p),
                fmt_bytes(self.plan_bytes)
            ));
        }
        f
    }
}

/// (label, value, roofline ratio) of one bar.
type Bar = (String, f64, f64);

fn short(n: usize) -> String {
    if n >= 1024 && n.is_multiple_of(1024) { format!("{}K", n / 1024) } else { n.to_string() }
}

fn pct(v: Option<f64>) -> String {
    v.map_or("-".into(), |v| format!("{:.1}%", 100.0 * v))
}

fn r1(v: f64) -> f64 {
    round_to(v, 1)
}

fn r3(v: f64) -> f64 {
    round_to(v, 3)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefill_flops_match_the_architecture_doc() {
        // §6: a T-token prompt of the 27B costs about T·49.1e9 + 196,608·T² + 2.5e9 FLOPs.
        let json = deltaserve_model::synth::Preset::Qwen36_27b.config_json(None);
        let cfg = ModelConfig::from_json_str(&json.to_string()).unwrap();
        for t in [4096usize, 32768, 131072] {
            let (total, attn) = prefill_flops(&cfg, 24_350_556_160, t);
            let doc = t as f64 * 49.1e9 + 196_608.0 * (t as f64).powi(2) + 2.5e9;
            assert!((total / doc - 1.0).abs() < 0.01, "{t}: {total:e} vs {doc:e}");
            assert!(attn < total);
        }
        let (total, attn) = prefill_flops(&cfg, 24_350_556_160, 131072);
        assert!((attn / total - 0.34).abs() < 0.01, "§6: attention is 34% at 128K");
    }

    #[test]
    fn sampling_flag_parses_and_checks() {
        let r = parse_sampling("0.7, 0, 0.9, 0.05").unwrap();
        assert_eq!((r.temperature, r.top_k, r.top_p, r.min_p), (0.7, 0, 0.9, 0.05));
        assert_eq!(sampling_label(&r), "temperature 0.7, top-k 0, top-p 0.9, min-p 0.05");
        for bad in ["0.7,20,0.9", "0,20,0.9,0", "0.7,20,1.5,0", "0.7,x,0.9,0", "0.7,20,0.9,2"] {
            assert!(parse_sampling(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn labels() {
        assert_eq!(short(32768), "32K");
        assert_eq!(short(1000), "1000");
    }
}
