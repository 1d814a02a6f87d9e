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
//!   roofline time is bytes / the measured copy rate (read + write bytes per second); with
//!   `--experts-on-host` the experts' bytes count at the host-to-device copy rate measured then.
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
//! `--constrained` times decode steps of replies under a JSON schema (structured outputs) against
//! unconstrained replies at each batch and context, both driven by the engine over this backend (its
//! host masks, look-ahead and masked device picks: `constrained.rs`); with `--device cpu` it is the
//! only measurement, on the CPU reference backend (by default the built-in demo model).
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
use deltaserve_cuda::backend::{CudaOptions, SHORT_CHUNK_TOKENS};
use deltaserve_cuda::ops::init::{Init, init_random};
use deltaserve_cuda::{Arena, CudaBackend, Kernels, Runtime, TpBackend, WeightSource};
use deltaserve_model::ModelConfig;
use deltaserve_plan::{
    KvDtype, Plan, PlanOptions, StateDtype, WeightsDtype, card_config, fmt_bytes, fmt_count, parse_size,
};
use serde_json::{Value, json};

use crate::gpu_memory::GpuSampler;
use crate::model_source::ModelArgs;
use crate::report::{ToolReport, emit, round_to, xml};

mod constrained;
mod measure;
mod report;

use measure::*;
use report::*;

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
    /// A mixture-of-experts model: keep the routed experts in pinned host memory (read across PCIe; the
    /// decode rooflines count them at the host-to-device rate measured in the same run).
    #[arg(long)]
    experts_on_host: bool,
    /// KV cache dtype for K and V: bf16, fp8, int8, int4.
    #[arg(long, default_value = "bf16")]
    kv_cache_dtype: KvDtype,
    /// DeltaNet recurrent state storage: fp32 or bf16 (half the state's bytes a decode step reads and writes).
    #[arg(long, default_value = "fp32")]
    state_dtype: StateDtype,
    /// Tokens per engine step (prefill chunk).
    #[arg(long, default_value_t = 4096)]
    max_batch_tokens: usize,
    /// Tokens per step of the verify-shaped runs (K + 1 of speculative decoding; 0 or 1: none).
    #[arg(long, default_value_t = 3)]
    verify_tokens: usize,
    /// New tokens of the short-chunk runs: one sequence prefilling this many tokens a step after each
    /// decode context (a tool result after a long conversation), on one GPU with the prefill kernel's
    /// query tiles, with its keys split and with the rows as decode queries (0: none).
    #[arg(long, value_delimiter = ',', default_value = "16,64,256")]
    short_chunks: Vec<usize>,
    /// Tensor parallelism over GPUs 0..N (--memory is per card).
    #[arg(long, default_value_t = 1)]
    tensor_parallel: usize,
    /// Also time speculative steps drafting this many tokens with the MTP head (1..=4; 0: none).
    #[arg(long, default_value_t = 0)]
    speculative_tokens: usize,
    /// The most split-K partitions a decode row's attention uses (as `serve --decode-partitions`).
    #[arg(long, default_value_t = PlanOptions::gpu_defaults(0).decode_partitions)]
    decode_partitions: usize,
    /// Also time one decode step of each batch per context, and each prompt's prefill, op group by op
    /// group (eagerly, a timing event after each group: where a step's GPU time goes; one GPU, not
    /// under --tensor-parallel).
    #[arg(long)]
    profile: bool,
    /// Also split each decode point's steps (logits to the host, and greedy) into host work, uploads,
    /// the forward on the GPU and the outputs' return (timing events at four marks of a step; one GPU).
    #[arg(long)]
    phases: bool,
    /// The sampling of the sampled decode timings: `temperature,top_k,top_p,min_p` (top_k 0: none).
    #[arg(long, default_value = "0.6,20,0.95,0", value_parser = parse_sampling)]
    sample: RowSampling,
    /// Also time decode steps of replies under a JSON schema (structured outputs) against unconstrained
    /// replies at each batch and context, both run by the engine (its host masks, look-ahead and
    /// device picks; sampled by --sample). The only measurement with --device cpu.
    #[arg(long)]
    constrained: bool,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
    /// Also write an SVG chart (prefill tok/s by prompt length, decode tok/s by batch) to this file.
    #[arg(long)]
    svg: Option<PathBuf>,
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
    if a.model.device == "cpu" {
        return constrained::run_cpu(&a);
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
    let kernels = Kernels::load(&rt, deltaserve_cuda::backend::kernel_dims(&card).with_state_dtype(a.state_dtype))?;
    let ceilings = measure_ceilings(&rt, &kernels, a.experts_on_host)?;
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
    // Decode runs step from each context: `steps + 3` steps of one token, of `verify_tokens` tokens, of
    // `speculative_tokens + 1` and of each short chunk's tokens.
    let widest = a.short_chunks.iter().copied().filter(|&n| n <= a.max_batch_tokens).max().unwrap_or(1);
    let span = (a.steps + 3) * a.verify_tokens.max(widest).max(a.speculative_tokens + 1).max(1) + 8;
    // `--constrained`: each reply's tokens.
    let span = if a.constrained { span.max(constrained::reply_tokens(a.steps) + 8) } else { span };
    o.max_context = Some(max_prompt.max(a.contexts.iter().copied().max().unwrap_or(0) + span));
    o.weights_dtype = a.weights_dtype;
    o.int4_asym = a.int4_asym;
    o.lm_head_int4 = a.lm_head_int4;
    o.embed_on_host = a.embed_on_host;
    o.experts_on_host = a.experts_on_host;
    (o.k_dtype, o.v_dtype) = (a.kv_cache_dtype, a.kv_cache_dtype);
    o.state_dtype = a.state_dtype;
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
            "{}{} · weights {}{}{}{} · KV {}{}",
            model_name(&model, &cfg),
            if tp > 1 { format!(" · tensor parallel {tp} (per card below)") } else { String::new() },
            plan.options.weights_dtype.name(),
            if plan.options.lm_head_int4 { " + int4 lm_head" } else { "" },
            if plan.options.embed_on_host { " + host embedding" } else { "" },
            if plan.options.experts_on_host { " + host experts" } else { "" },
            plan.options.k_dtype.name(),
            if plan.options.state_dtype == StateDtype::Bf16 { " · DeltaNet state bf16" } else { "" }
        ),
        ceilings: Some(ceilings),
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
        short_chunks: Vec::new(),
        speculative: Vec::new(),
        profiles: Vec::new(),
        phases: Vec::new(),
        deltanet,
        constrained: Vec::new(),
    };

    let d = cfg.dims();
    let vocab = d.vocab;
    let page = plan.page_size;
    // All-reduces per step: after the embedding and after each layer's mixer and MLP.
    let reduces = (2 * d.num_layers + 1) as f64;
    let mut warmed = std::collections::HashSet::new();
    for &t in &a.prompts {
        if t > plan.max_context {
            report.skipped.push(format!("prefill {t}: beyond the plan's context {}", plan.max_context));
            continue;
        }
        tracing::info!("bench: prefill {} tokens", fmt_count(t as u64));
        let pages: Vec<u32> = (0..t.div_ceil(page) as u32).collect();
        let tokens: Vec<u32> = (0..t).map(|i| ((i * 7919 + 13) % vocab) as u32).collect();
        // Warm-up: one step of each chunk size this prompt runs that no earlier prompt ran (a step's
        // kernels and GEMM algorithms differ by its rows: the int4 linears take the int4 GEMM up to 256
        // rows and dequantised slices above, cuBLASLt picks an algorithm per shape).
        for size in [t.min(a.max_batch_tokens), if t > a.max_batch_tokens { t % a.max_batch_tokens } else { 0 }] {
            if size > 0 && warmed.insert(size) {
                prefill(be.get(), &pages, &tokens[..size], a.max_batch_tokens)?;
            }
        }
        peak(&sampler);
        let s = prefill(be.get(), &pages, &tokens, a.max_batch_tokens)?;
        let driver_peak_bytes = peak(&sampler);
        // One card's FLOPs (its shard) against one card's GEMM rate; `flop` counts every card's.
        let (flop, attn) = prefill_flops(&card, plan.weight_parts.linear_params, t);
        let roofline = flop / (ceilings.gemm_tflops * 1e12);
        let (flop, attn) = (flop * tp as f64, attn * tp as f64);
        let (full, rest) = (t / a.max_batch_tokens, t % a.max_batch_tokens);
        let allreduce_share = match be.all_reduce_s(a.max_batch_tokens)? {
            Some(per) => {
                let last = if rest > 0 { be.all_reduce_s(rest)?.unwrap_or(0.0) } else { 0.0 };
                Some(reduces * (full as f64 * per + last) / s)
            }
            None => None,
        };
        if let (true, Under::One(cb)) = (a.profile, &mut be) {
            tracing::info!("bench: prefill of {} tokens op group by op group", fmt_count(t as u64));
            cb.set_profiling(true)?;
            let eager_ms = 1e3 * prefill(cb.as_mut(), &pages, &tokens, a.max_batch_tokens)?;
            let groups = cb.take_profile().into_iter().map(|(g, s)| (g, s * 1e3)).collect();
            cb.set_profiling(false)?;
            report.profiles.push(ProfileRow { prefill: Some(t), batch: 1, context: 0, eager_ms, groups });
        }
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
            if let (true, Under::One(cb)) = (a.profile, &mut be) {
                tracing::info!("bench: decode step op groups, batch {b} at context {}", fmt_count(ctx as u64));
                cb.set_profiling(true)?;
                let eager_ms = decode(cb.as_mut(), b, 1, ctx, per_seq, a.steps, vocab, Pick::Logits)?;
                let steps = (a.steps + 3) as f64; // decode() runs 3 warm-up steps
                let groups = cb.take_profile().into_iter().map(|(g, s)| (g, s * 1e3 / steps)).collect();
                cb.set_profiling(false)?;
                report.profiles.push(ProfileRow { prefill: None, batch: b, context: ctx, eager_ms, groups });
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
            let split = step_bytes(&plan, &cfg, b, ctx);
            let (bytes, floor_ms) = (split.0 + split.1, bytes_floor_s(split, &ceilings) * 1e3);
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
        for &n in a.short_chunks.iter().filter(|&&n| n > 1) {
            let end = ctx + (a.steps + 3) * n + 4;
            if n > a.max_batch_tokens || end.div_ceil(page) > plan.num_kv_pages || end > plan.max_context {
                report.skipped.push(format!("short chunk of {n} tokens at {ctx}: beyond the plan's step or context"));
                continue;
            }
            tracing::info!("bench: short chunks of {n} tokens at context {}", fmt_count(ctx as u64));
            let per_seq = end.div_ceil(page);
            let mut row = ShortChunkRow {
                tokens: n,
                context: ctx,
                ms: 0.0,
                ms_tiles: None,
                ms_split: None,
                ms_rows: None,
                floor_ms: 0.0,
            };
            match &mut be {
                Under::One(cb) => {
                    // Each attention of the chunk's rows (the keys split where the wide kernels run,
                    // at any length; the rows as decode queries up to SHORT_CHUNK_TOKENS), then the
                    // configured one back.
                    let opts = cb.options();
                    let mut ways: Vec<(usize, bool)> = vec![(usize::MAX, true)];
                    if cb.short_chunks_split_keys() {
                        ways.push((0, true));
                    }
                    if n <= SHORT_CHUNK_TOKENS {
                        ways.push((0, false));
                    }
                    for (from, split) in ways {
                        let o = CudaOptions {
                            short_chunk_decode_attention_from: from,
                            short_chunk_split_keys: split,
                            short_chunk_split_max_tokens: opts.short_chunk_split_max_tokens.max(n),
                            ..opts
                        };
                        cb.set_options(o)?;
                        let ms = decode(cb.as_mut(), 1, n, ctx, per_seq, a.steps, vocab, Pick::Logits)?;
                        *(match (from, split) {
                            (usize::MAX, _) => &mut row.ms_tiles,
                            (_, true) => &mut row.ms_split,
                            _ => &mut row.ms_rows,
                        }) = Some(ms);
                    }
                    cb.set_options(opts)?;
                    let split = cb.short_chunks_split();
                    let on = ctx >= opts.short_chunk_decode_attention_from && n <= cb.short_chunk_max_tokens();
                    row.ms = match (on, split) {
                        (false, _) => row.ms_tiles,
                        (true, true) => row.ms_split,
                        (true, false) => row.ms_rows,
                    }
                    .unwrap_or_default();
                }
                Under::Tp(b) => row.ms = decode(b, 1, n, ctx, per_seq, a.steps, vocab, Pick::Logits)?,
            }
            // The floor: the step's bytes at the copy rate or its FLOPs at the GEMM rate (one card's).
            let (flop, _) = chunk_flops(&card, plan.weight_parts.linear_params, n, ctx);
            let bytes = step_bytes(&plan, &cfg, 1, ctx);
            row.floor_ms = bytes_floor_s(bytes, &ceilings).max(flop / (ceilings.gemm_tflops * 1e12)) * 1e3;
            report.short_chunks.push(row);
        }
        let k = a.speculative_tokens;
        if let (true, Under::One(cb)) = (k > 0, &mut be) {
            for &b in &a.batches {
                let Some((one, greedy)) = report
                    .decode
                    .iter()
                    .find(|r| r.batch == b && r.context == ctx)
                    .map(|r| (r.ms_per_step, r.ms_per_step_argmax_ahead.unwrap_or(r.ms_per_step_argmax)))
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
                    decode_greedy_ms: greedy,
                });
            }
        }
    }
    if a.constrained {
        let tokenizer = text.tokenizer.context("--constrained needs the model's tokenizer.json")?;
        let setup = constrained::Setup {
            tokenizer: std::sync::Arc::new(tokenizer),
            eos: cfg.eos_token_ids.clone(),
            sample: a.sample.clone(),
            steps: a.steps,
            page_size: page,
            num_pages: plan.num_kv_pages,
            max_context: plan.max_context,
            max_seqs: plan.max_seqs,
        };
        let points = constrained::fitting_points(&a, &plan, &mut report.skipped);
        let (back, rows) = constrained::measure(be, &setup, &points)?;
        be = back;
        report.constrained = rows;
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
