//! `deltaserve bench`'s report: the rows each measurement gives, the table, the JSON and the SVG chart.

use super::*;

#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Ceilings {
    pub(super) gemm_tflops: f64,
    pub(super) copy_gbs: f64,
    /// Pinned host memory to the device (GB/s): what the routed experts are read at with
    /// `--experts-on-host` (measured only then).
    pub(super) host_read_gbs: Option<f64>,
}

#[derive(Debug)]
pub(super) struct PrefillRow {
    pub(super) tokens: usize,
    pub(super) seconds: f64,
    pub(super) tflop: f64,
    /// Roofline time over measured time.
    pub(super) ratio: f64,
    /// Share of the FLOPs in softmax attention.
    pub(super) attention_share: f64,
    /// Tensor parallelism: the all-reduces' share of the time.
    pub(super) allreduce_share: Option<f64>,
    pub(super) driver_peak_bytes: Option<u64>,
}

#[derive(Debug)]
pub(super) struct DecodeRow {
    pub(super) batch: usize,
    pub(super) context: usize,
    pub(super) ms_per_step: f64,
    /// The same steps with the tokens picked on the device (`Want::Tokens` with the argmax, greedy decoding).
    pub(super) ms_per_step_argmax: f64,
    /// Sampled with [`qwen_sampling`]: on the device (`Want::Tokens` with the rule), and the logits step
    /// followed by the host's pick.
    pub(super) ms_per_step_sampled: f64,
    pub(super) ms_per_step_host_sampled: f64,
    /// Greedy and sampled steps launched ahead ([`Backend::launch`]: each step launched before the
    /// previous one's tokens are read, fed its picks on the device), ms between consecutive tokens; None
    /// where the backend steps one at a time.
    pub(super) ms_per_step_argmax_ahead: Option<f64>,
    pub(super) ms_per_step_sampled_ahead: Option<f64>,
    pub(super) bytes: f64,
    /// The roofline over the step with the logits returned, over the greedy step, over the sampled one.
    pub(super) ratio: f64,
    pub(super) ratio_argmax: f64,
    pub(super) ratio_sampled: f64,
    pub(super) allreduce_share: Option<f64>,
    pub(super) driver_peak_bytes: Option<u64>,
}

#[derive(Default)]
pub(super) struct Report {
    /// The device in words (a GPU's name, or the CPU).
    pub(super) gpu: String,
    pub(super) tensor_parallel: usize,
    pub(super) model: String,
    /// The GPU's ceilings (None on the CPU).
    pub(super) ceilings: Option<Ceilings>,
    pub(super) plan_bytes: u64,
    pub(super) arena_bytes: u64,
    pub(super) idle_driver_bytes: Option<u64>,
    pub(super) startup_s: f64,
    pub(super) prefill: Vec<PrefillRow>,
    pub(super) decode: Vec<DecodeRow>,
    /// The rule of the sampled decode timings, in words.
    pub(super) sampling: String,
    pub(super) skipped: Vec<String>,
    pub(super) arena_allocations_moved: bool,
    /// (what, ms) of DeltaNet state snapshot copies: save/restore to/from the device and host tiers.
    pub(super) snapshots: Vec<(&'static str, f64)>,
    /// Verify-shaped steps: (tokens per step, context, ms per step, ms of the one-token step there).
    pub(super) verify: Vec<(usize, usize, f64, f64)>,
    pub(super) short_chunks: Vec<ShortChunkRow>,
    pub(super) speculative: Vec<SpecRow>,
    pub(super) profiles: Vec<ProfileRow>,
    /// `--phases`: (batch, context, "logits" | "greedy" | "sampled", the step's parts).
    pub(super) phases: Vec<(usize, usize, &'static str, deltaserve_cuda::StepPhases)>,
    /// The chunked DeltaNet prefill kernels alone at the model's (per-card) shape.
    pub(super) deltanet: Vec<deltaserve_cuda::gdn_bench::GdnTiming>,
    /// `--constrained`: decode steps under a JSON schema against unconstrained ones.
    pub(super) constrained: Vec<constrained::ConstrainedRow>,
}

/// One sequence prefilling `tokens` new tokens a step after `context` tokens.
#[derive(Debug)]
pub(super) struct ShortChunkRow {
    pub(super) tokens: usize,
    pub(super) context: usize,
    /// ms per step as the backend is configured; on one GPU also with the prefill kernel's query tiles,
    /// with its keys split (where the wide prefill kernels run) and with the rows as decode queries.
    pub(super) ms: f64,
    pub(super) ms_tiles: Option<f64>,
    pub(super) ms_split: Option<f64>,
    pub(super) ms_rows: Option<f64>,
    /// The step's bytes at the copy rate or its FLOPs at the GEMM rate, whichever takes longer.
    pub(super) floor_ms: f64,
}

/// `--profile`: one decode step of `batch` rows at `context`, or one prompt of `prefill` tokens,
/// op group by op group.
pub(super) struct ProfileRow {
    /// `Some(tokens)`: a whole prompt's prefill (every step of it summed); `None`: one decode step.
    pub(super) prefill: Option<usize>,
    pub(super) batch: usize,
    pub(super) context: usize,
    /// Eager (profiled) ms per step, or of the whole prompt.
    pub(super) eager_ms: f64,
    /// (op group, GPU ms per step).
    pub(super) groups: Vec<(&'static str, f64)>,
}

/// Whole speculative steps at one (batch, context): ms per step of each phase.
#[derive(Debug)]
pub(super) struct SpecRow {
    pub(super) k: usize,
    pub(super) batch: usize,
    pub(super) context: usize,
    pub(super) draft_ms: f64,
    pub(super) verify_ms: f64,
    pub(super) commit_ms: f64,
    /// The decode step with its logits returned (the bench's decode row).
    pub(super) decode_ms: f64,
    /// The greedy decode step the engine runs: the token picked on the GPU, launched ahead where the bench
    /// measured that.
    pub(super) decode_greedy_ms: f64,
}

impl SpecRow {
    pub(super) fn total_ms(&self) -> f64 {
        self.draft_ms + self.verify_ms + self.commit_ms
    }
    /// Decode speed-up at `tokens` emitted per step (accepted drafts + 1), against the decode step with
    /// its logits returned.
    pub(super) fn speedup(&self, tokens: f64) -> f64 {
        tokens * self.decode_ms / self.total_ms()
    }
    /// The same against the greedy decode step ([`SpecRow::decode_greedy_ms`]).
    pub(super) fn speedup_greedy(&self, tokens: f64) -> f64 {
        tokens * self.decode_greedy_ms / self.total_ms()
    }
}

impl Report {
    pub(super) fn peak_driver_bytes(&self) -> Option<u64> {
        let p = self.prefill.iter().filter_map(|r| r.driver_peak_bytes);
        p.chain(self.decode.iter().filter_map(|r| r.driver_peak_bytes)).chain(self.idle_driver_bytes).max()
    }
}

impl Report {
    /// Grouped bars: each decode row's ms per step with the logits, the greedy token, the token sampled on
    /// the device and sampled on the host.
    pub(super) fn svg_picks(&self, s: &mut String, x0: f64, y0: f64, pw: f64, ph: f64) {
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

impl Report {
    /// The GPU's tables: prefill, decode, memory, DeltaNet kernels, profiles, phases, snapshots,
    /// verify-shaped steps, short chunks and speculative steps.
    fn gpu_tables(&self, s: &mut String) {
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
                "\nDeltaNet chunked prefill kernels alone (one layer, the model's shape, {}; FLA = flash-linear-attention on an H200)",
                self.deltanet.first().map_or("", |r| walk_name(r.walk))
            );
            let _ = writeln!(
                s,
                "{:>14} {:>7} {:>9} {:>9} {:>9} {:>12} {:>8} {:>12}",
                "tokens", "pieces", "ms", "prep ms", "walk ms", "M tok/s", "vs FLA", "workspace"
            );
            for r in &self.deltanet {
                let (_, fla) = deltaserve_cuda::gdn_bench::fla_h200_nearest(r.tokens / r.seqs);
                let _ = writeln!(
                    s,
                    "{:>14} {:>7} {:>9.3} {:>9} {:>9} {:>12.2} {:>7.2}× {:>12}",
                    if r.seqs == 1 { format!("{}", r.tokens) } else { format!("{} × {}", r.seqs, r.tokens / r.seqs) },
                    if r.piece > 0 { r.piece.to_string() } else { "-".into() },
                    r.ms,
                    r.prep_ms.map_or("-".into(), |v| format!("{v:.3}")),
                    r.state_ms.map_or("-".into(), |v| format!("{v:.3}")),
                    r.mtok_per_s(),
                    r.mtok_per_s() / fla,
                    fmt_bytes(r.workspace_bytes as u64)
                );
            }
        }
        for p in &self.profiles {
            let gpu: f64 = p.groups.iter().map(|g| g.1).sum();
            let what = match p.prefill {
                Some(t) => format!("prefill of {t} tokens"),
                None => format!("decode step at batch {}, context {}", p.batch, p.context),
            };
            let per = if p.prefill.is_some() { "" } else { "/step" };
            let _ = writeln!(s, "\n{what}, op group by op group (eager: {:.2} ms{per}, GPU {gpu:.2} ms)", p.eager_ms);
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
        for r in &self.short_chunks {
            let ways: Vec<String> =
                [("prefill kernel", r.ms_tiles), ("keys split", r.ms_split), ("as decode queries", r.ms_rows)]
                    .into_iter()
                    .filter_map(|(w, ms)| Some(format!("{w} {:.2} ms", ms?)))
                    .collect();
            let both = if ways.is_empty() { String::new() } else { format!(" ({})", ways.join(", ")) };
            let _ = writeln!(
                s,
                "short chunk ({} tokens, batch 1) at {}: {:.2} ms, {:.2} of the roofline{both}",
                r.tokens,
                r.context,
                r.ms,
                r.floor_ms / r.ms
            );
        }
        if !self.speculative.is_empty() {
            let _ = writeln!(s, "\nspeculative steps (MTP head drafts K, verify K + 1, commit K + 1)");
            let _ = writeln!(
                s,
                "{:>3} {:>6} {:>8} {:>9} {:>10} {:>10} {:>9} {:>10} {:>9} {:>11} {:>13}",
                "K",
                "batch",
                "context",
                "draft ms",
                "verify ms",
                "commit ms",
                "step ms",
                "decode ms",
                "verify ×",
                "×@2.5 / ×@3",
                "greedy ×@3"
            );
            for r in &self.speculative {
                let _ = writeln!(
                    s,
                    "{:>3} {:>6} {:>8} {:>9.2} {:>10.2} {:>10.2} {:>9.2} {:>10.2} {:>9.2} {:>5.2} / {:.2} {:>13.2}",
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
                    r.speedup(3.0),
                    r.speedup_greedy(3.0)
                );
            }
        }
    }

    /// `--constrained`: one line per (batch, context).
    fn constrained_lines(&self, s: &mut String) {
        if self.constrained.is_empty() {
            return;
        }
        let _ = writeln!(
            s,
            "\nconstrained decode (replies under a JSON schema, {}; both run by the engine, ms between steps)",
            self.sampling
        );
        for r in &self.constrained {
            let _ = writeln!(
                s,
                "constrained decode batch {} at {}: {:.3} ms/step against {:.3} ms unconstrained = {:.3}× (host mask \
                 {:.3} ms a row; launched ahead: {:.0}% of steps, unconstrained {:.0}%; JSON objects completed: {}, \
                 tokens outside the schema: {})",
                r.batch,
                r.context,
                r.ms_constrained,
                r.ms_unconstrained,
                r.ratio(),
                r.mask_ms,
                100.0 * r.ahead_constrained,
                100.0 * r.ahead_unconstrained,
                r.objects,
                r.outside
            );
        }
    }
}

impl ToolReport for Report {
    fn to_json(&self) -> Value {
        json!({
            "gpu": self.gpu,
            "tensor_parallel": self.tensor_parallel,
            "model": self.model,
            "ceilings": self.ceilings.map(|c| json!({
                "gemm_bf16_tflops": r1(c.gemm_tflops),
                "copy_gb_s": r1(c.copy_gbs),
                "host_read_gb_s": c.host_read_gbs.map(r1),
            })),
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
            "short_chunks": self.short_chunks.iter().map(|r| json!({
                "tokens": r.tokens, "context": r.context, "ms_per_step": r3(r.ms),
                "ms_prefill_kernel": r.ms_tiles.map(r3), "ms_keys_split": r.ms_split.map(r3),
                "ms_decode_queries": r.ms_rows.map(r3),
                "floor_ms": r3(r.floor_ms), "roofline_ratio": r3(r.floor_ms / r.ms),
                "tokens_per_s": r1(r.tokens as f64 * 1e3 / r.ms),
            })).collect::<Vec<_>>(),
            "speculative": self.speculative.iter().map(|r| json!({
                "draft_tokens": r.k, "batch": r.batch, "context": r.context, "draft_ms": r3(r.draft_ms),
                "verify_ms": r3(r.verify_ms), "commit_ms": r3(r.commit_ms), "step_ms": r3(r.total_ms()),
                "decode_ms_per_step": r3(r.decode_ms), "verify_ratio_to_decode": r3(r.verify_ms / r.decode_ms),
                "step_ratio_to_decode": r3(r.total_ms() / r.decode_ms),
                "speedup_at_2_5_tokens": r3(r.speedup(2.5)), "speedup_at_3_tokens": r3(r.speedup(3.0)),
                "decode_greedy_ms_per_step": r3(r.decode_greedy_ms),
                "speedup_at_3_tokens_greedy": r3(r.speedup_greedy(3.0)),
            })).collect::<Vec<_>>(),
            "deltanet_prefill": self.deltanet.iter().map(|r| {
                let (fla_t, fla) = deltaserve_cuda::gdn_bench::fla_h200_nearest(r.tokens / r.seqs);
                json!({
                    "tokens": r.tokens, "sequences": r.seqs, "ms": r3(r.ms), "prep_ms": r.prep_ms.map(r3),
                    "walk_ms": r.state_ms.map(r3), "piece_rows": r.piece, "mtok_per_s_per_layer": r3(r.mtok_per_s()),
                    "fla_h200_mtok_per_s": fla, "fla_h200_tokens": fla_t, "ratio_to_fla_h200": r3(r.mtok_per_s() / fla),
                    "workspace_bytes": r.workspace_bytes, "nonfinite_outputs": r.nonfinite, "walk": walk_name(r.walk),
                })
            }).collect::<Vec<_>>(),
            "profile": self.profiles.iter().map(|p| json!({
                "prefill_tokens": p.prefill, "batch": p.batch, "context": p.context, "eager_ms_per_step": r3(p.eager_ms),
                "gpu_ms_per_step": r3(p.groups.iter().map(|g| g.1).sum::<f64>()),
                "groups_ms": p.groups.iter().map(|(g, ms)| json!([g, r3(*ms)])).collect::<Vec<_>>(),
            })).collect::<Vec<_>>(),
            "phases": self.phases.iter().map(|(b, ctx, out, p)| json!({
                "batch": b, "context": ctx, "output": out, "steps": p.steps, "wall_ms": r3(p.wall_ms),
                "host_prep_ms": r3(p.host_prep_ms), "host_upload_ms": r3(p.host_upload_ms),
                "host_launch_ms": r3(p.host_launch_ms), "gpu_inputs_ms": r3(p.gpu_inputs_ms),
                "gpu_forward_ms": r3(p.gpu_forward_ms), "output_ms": r3(p.output_ms),
            })).collect::<Vec<_>>(),
            "constrained": self.constrained.iter().map(|r| json!({
                "batch": r.batch, "context": r.context,
                "ms_per_step_constrained": r3(r.ms_constrained), "ms_per_step_unconstrained": r3(r.ms_unconstrained),
                "ratio_to_unconstrained": r3(r.ratio()), "host_mask_ms_per_row": round_to(r.mask_ms, 4),
                "steps_ahead_share_constrained": r3(r.ahead_constrained),
                "steps_ahead_share_unconstrained": r3(r.ahead_unconstrained),
                "json_objects": r.objects, "tokens_outside_schema": r.outside,
            })).collect::<Vec<_>>(),
            "constrained_schema": (!self.constrained.is_empty()).then(constrained::reply_schema),
            "snapshots_ms": self.snapshots.iter().map(|(w, ms)| (w.replace(' ', "_"), json!(r3(*ms)))).collect::<serde_json::Map<_, _>>(),
            "skipped": self.skipped,
        })
    }

    fn table(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "deltaserve bench on {}: {}", self.gpu, self.model);
        if let Some(c) = &self.ceilings {
            let host = c.host_read_gbs.map_or(String::new(), |r| format!(" · host to device {r:.1} GB/s"));
            let _ = writeln!(
                s,
                "ceilings: bf16 GEMM {:.0} TFLOP/s · device copy {:.0} GB/s (read + write){host} · backend up in {:.1} s",
                c.gemm_tflops, c.copy_gbs, self.startup_s
            );
            self.gpu_tables(&mut s);
        }
        self.constrained_lines(&mut s);
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
        for r in self.constrained.iter().filter(|r| r.outside > 0) {
            f.push(format!(
                "constrained decode batch {} at {}: {} tokens outside the schema",
                r.batch, r.context, r.outside
            ));
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
pub(super) type Bar = (String, f64, f64);

pub(super) fn short(n: usize) -> String {
    if n >= 1024 && n.is_multiple_of(1024) { format!("{}K", n / 1024) } else { n.to_string() }
}

pub(super) fn pct(v: Option<f64>) -> String {
    v.map_or("-".into(), |v| format!("{:.1}%", 100.0 * v))
}

pub(super) fn r1(v: f64) -> f64 {
    round_to(v, 1)
}

pub(super) fn r3(v: f64) -> f64 {
    round_to(v, 3)
}

/// How the DeltaNet walk ran, in the report's words.
fn walk_name(w: deltaserve_cuda::ops::gdn_chunk::Walk) -> &'static str {
    match w {
        deltaserve_cuda::ops::gdn_chunk::Walk::OneStream => "walk in one stream",
        deltaserve_cuda::ops::gdn_chunk::Walk::OutputWarps => "walk with output warps",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels() {
        assert_eq!(short(32768), "32K");
        assert_eq!(short(1000), "1000");
    }

    #[test]
    fn constrained_rows_print_their_line_fields_and_failures() {
        let row = |outside| constrained::ConstrainedRow {
            batch: 8,
            context: 1024,
            ms_constrained: 6.6,
            ms_unconstrained: 6.0,
            mask_ms: 0.12,
            ahead_constrained: 0.0,
            ahead_unconstrained: 0.99,
            objects: 3,
            outside,
        };
        let r = Report { sampling: "greedy".into(), constrained: vec![row(0)], ..Report::default() };
        let table = r.table();
        assert!(
            table.contains(
                "constrained decode batch 8 at 1024: 6.600 ms/step against 6.000 ms unconstrained = 1.100× (host mask \
                 0.120 ms a row; launched ahead: 0% of steps, unconstrained 99%; JSON objects completed: 3, tokens \
                 outside the schema: 0)"
            ),
            "{table}"
        );
        assert!(!table.contains("ceilings"), "no GPU tables without ceilings: {table}");
        let j = r.to_json();
        let c = &j["constrained"][0];
        assert_eq!(
            (c["ms_per_step_constrained"].as_f64(), c["ratio_to_unconstrained"].as_f64()),
            (Some(6.6), Some(1.1))
        );
        assert_eq!(j["constrained_schema"]["required"].as_array().map(Vec::len), Some(4));
        assert!(r.failures().is_empty());
        let bad = Report { constrained: vec![row(2)], ..Report::default() };
        assert_eq!(bad.failures(), ["constrained decode batch 8 at 1024: 2 tokens outside the schema"]);
    }
}
