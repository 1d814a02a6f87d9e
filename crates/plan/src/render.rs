//! How a [`Plan`] is shown: [`Plan::to_json`], [`Plan::table`], [`Plan::workspace_table`] and [`Plan::svg`].

use std::fmt::Write as _;

use serde_json::{Value, json};

use crate::plan::Plan;
use crate::size::{fmt_bytes, fmt_count};

impl Plan {
    fn free_bytes(&self) -> u64 {
        self.budget_bytes - self.total_bytes
    }

    fn pct(&self, b: u64) -> f64 {
        if self.budget_bytes == 0 { 0.0 } else { 100.0 * b as f64 / self.budget_bytes as f64 }
    }

    fn context_line(&self) -> String {
        let why = if self.options.max_context.is_some() {
            "as requested by --max-context".to_string()
        } else if self.max_context == self.max_position_embeddings {
            format!("capped by the model's max_position_embeddings {}", fmt_count(self.max_position_embeddings as u64))
        } else {
            format!("{} KV pages × {} tokens", fmt_count(self.num_kv_pages as u64), self.page_size)
        };
        format!(
            "context: one sequence can fill {} tokens (100%, {why}); {} sequence(s) at that length at once, {} per step",
            fmt_count(self.max_context as u64),
            self.max_full_context_seqs,
            self.max_seqs
        )
    }

    /// `""` at TP=1, else ` (per card, TP=N)`.
    fn per_card(&self) -> String {
        let tp = self.options.tensor_parallel;
        if tp > 1 { format!(" (per card, TP={tp})") } else { String::new() }
    }

    /// One JSON object with every number of the plan (one card's under tensor parallelism).
    pub fn to_json(&self) -> Value {
        let o = &self.options;
        let w = &self.weight_parts;
        let d = &self.dims;
        json!({
            "tensor_parallel": o.tensor_parallel,
            "scope": if o.tensor_parallel > 1 { format!("per card, TP={}", o.tensor_parallel) } else { "one card".to_string() },
            "weights_bytes": self.weights_bytes,
            "host_weights_bytes": self.host_weights_bytes,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "state_bytes_per_seq": self.state_bytes_per_seq,
            "activation_bytes": self.activation_bytes,
            "snapshot_bytes": self.snapshot_bytes,
            "logits_bytes": self.logits_bytes,
            "block_table_bytes": self.block_table_bytes,
            "gemm_workspace_bytes": o.gemm_workspace_bytes,
            "backend_scratch_bytes": self.backend_scratch_bytes,
            "vision_workspace_bytes": self.vision_workspace_bytes,
            "runtime_reserve_bytes": o.runtime_reserve_bytes,
            "graph_reserve_bytes": o.graph_reserve_bytes,
            "kv_pages_bytes": self.num_kv_pages as u64 * self.kv_page_bytes(),
            "arena_bytes": self.arena_bytes(),
            "total_bytes": self.total_bytes,
            "budget_bytes": self.budget_bytes,
            "free_bytes": self.free_bytes(),
            "max_context": self.max_context,
            "max_full_context_seqs": self.max_full_context_seqs,
            "max_position_embeddings": self.max_position_embeddings,
            "page_size": self.page_size,
            "kv_page_bytes": self.kv_page_bytes(),
            "num_kv_pages": self.num_kv_pages,
            "num_state_slots": self.num_state_slots,
            "snapshot_slots": o.snapshot_slots,
            "max_batch_tokens": self.max_batch_tokens,
            "max_seqs": self.max_seqs,
            "options": {
                "weights_dtype": o.weights_dtype.name(),
                "int4_asym": o.int4_asym,
                "lm_head_int4": o.lm_head_int4,
                "embed_on_host": o.embed_on_host,
                "experts_on_host": o.experts_on_host,
                "k_dtype": o.k_dtype.name(),
                "v_dtype": o.v_dtype.name(),
                "state_dtype": o.state_dtype.name(),
                "activation_bytes_per_elem": o.activation_bytes_per_elem,
                "decode_partitions": o.decode_partitions,
                "max_context": o.max_context,
                "tensor_parallel": o.tensor_parallel,
                "max_image_tokens_per_step": o.max_image_tokens_per_step,
            },
            "model": {
                "layers": d.num_layers,
                "deltanet_layers": d.num_deltanet_layers,
                "attention_layers": d.num_attention_layers,
                "hidden": d.hidden,
                "vocab": self.model_vocab,
                "card_vocab": d.vocab,
                "card_q_heads": d.q_heads,
                "card_kv_heads": d.kv_heads,
                "card_deltanet_v_heads": d.gdn_v_heads,
                "card_intermediate": d.intermediate,
                "vision_tower": self.model_has_vision,
            },
            "weights": {
                "linears_bytes": w.linears,
                "linear_params": w.linear_params,
                "dense_bytes": w.dense,
                "embed_bytes": w.embed,
                "lm_head_bytes": w.lm_head,
                "embed_on_host": w.embed_on_host,
                "experts_bytes": w.experts,
                "experts_active_bytes_per_token": w.experts_active,
                "mtp_experts_bytes": w.mtp_experts,
                "experts_on_host": w.experts_on_host,
                "host_experts_bytes": w.host_experts(),
                "vision_bytes": w.vision,
                "vision_params": w.vision_params,
            },
            "regions": self.regions.iter().map(|r| json!({
                "name": r.name, "bytes": r.bytes, "offset": r.offset, "note": r.note,
            })).collect::<Vec<_>>(),
            "workspace": {
                "bytes": self.workspace.bytes,
                "peak_live_bytes": self.workspace.peak_live_bytes(),
                "ops": self.workspace.ops,
                "buffers": self.workspace.buffers.iter().map(|b| json!({
                    "name": b.name, "bytes": b.bytes, "offset": b.offset,
                    "first_op": b.first_op, "last_op": b.last_op, "shape": b.shape,
                })).collect::<Vec<_>>(),
            },
        })
    }

    /// The human table: every region with size, % of budget and offset, then the fillable context.
    pub fn table(&self) -> String {
        let o = &self.options;
        let d = &self.dims;
        let mut s = String::new();
        let kv =
            if o.k_dtype == o.v_dtype { o.k_dtype.to_string() } else { format!("K {} / V {}", o.k_dtype, o.v_dtype) };
        let _ = writeln!(
            s,
            "memory plan{}: {} layers ({} DeltaNet + {} attention), hidden {}, vocab {}",
            self.per_card(),
            d.num_layers,
            d.num_deltanet_layers,
            d.num_attention_layers,
            d.hidden,
            fmt_count(self.model_vocab as u64)
        );
        if o.tensor_parallel > 1 {
            let _ = writeln!(
                s,
                "each of {} cards holds {} q / {} kv attention heads, {} DeltaNet value heads, intermediate {}, \
                 vocabulary {}; budget, sizes and context below are one card's",
                o.tensor_parallel,
                d.q_heads,
                d.kv_heads,
                d.gdn_v_heads,
                fmt_count(d.intermediate as u64),
                fmt_count(d.vocab as u64)
            );
        }
        let _ = writeln!(
            s,
            "budget {}{} · weights {}{}{}{} · KV {kv} · activations {} · {} tokens / {} seqs per step",
            fmt_bytes(self.budget_bytes),
            if o.tensor_parallel > 1 { " per card" } else { "" },
            o.weights_dtype,
            if o.lm_head_int4 { " + int4 lm_head" } else { "" },
            if o.embed_on_host { " + host embedding" } else { "" },
            if self.weight_parts.experts_on_host { " + host experts" } else { "" },
            if o.activation_bytes_per_elem == 4 { "f32" } else { "bf16" },
            fmt_count(self.max_batch_tokens as u64),
            self.max_seqs
        );
        if self.weight_parts.experts > 0 {
            let w = &self.weight_parts;
            let _ = if w.experts_on_host {
                writeln!(
                    s,
                    "mixture of experts: routed experts {} in pinned host memory (--experts-on-host, outside the \
                     budget); one token reads {} of them across the bus (PCIe)",
                    fmt_bytes(w.host_experts()),
                    fmt_bytes(w.experts_active)
                )
            } else {
                writeln!(
                    s,
                    "mixture of experts: routed experts {} of the weights; one token reads {} of them",
                    fmt_bytes(w.experts),
                    fmt_bytes(w.experts_active)
                )
            };
        }
        if let Some(line) = self.vision_line() {
            let _ = writeln!(s, "{line}");
        }
        let _ = writeln!(s);
        let _ = writeln!(s, "{:<16} {:>11} {:>7} {:>11}  note", "region", "size", "budget", "offset");
        for r in &self.regions {
            let _ = writeln!(
                s,
                "{:<16} {:>11} {:>6.1}% {:>11}  {}",
                r.name,
                fmt_bytes(r.bytes),
                self.pct(r.bytes),
                fmt_bytes(r.offset),
                r.note
            );
        }
        // What the budget counts beside the arena.
        for (name, bytes, note) in [
            ("runtime_reserve", o.runtime_reserve_bytes, reserve_note(o)),
            ("cuda_graphs", o.graph_reserve_bytes, GRAPHS_NOTE.to_string()),
        ] {
            if bytes > 0 {
                let (size, pct) = (fmt_bytes(bytes), self.pct(bytes));
                let _ =
                    writeln!(s, "{name:<16} {size:>11} {pct:>6.1}% {:>11}  {note} (counted, not in the arena)", "-");
            }
        }
        let pad = self.arena_bytes() - self.regions.iter().map(|r| r.bytes).sum::<u64>();
        let _ = writeln!(
            s,
            "{:<16} {:>11} {:>6.1}% {:>11}  unused: less than one KV page ({}){}",
            "free",
            fmt_bytes(self.free_bytes()),
            self.pct(self.free_bytes()),
            "-",
            fmt_bytes(self.kv_page_bytes()),
            if pad > 0 { format!("; {pad} B of alignment padding is counted in total") } else { String::new() }
        );
        let _ = writeln!(s, "{:<16} {:>11} {:>6.1}%", "total", fmt_bytes(self.total_bytes), self.pct(self.total_bytes));
        if self.host_weights_bytes > 0 {
            let _ = writeln!(
                s,
                "{:<16} {:>11} {:>7} {:>11}  {} in pinned host memory (outside the budget)",
                "host",
                fmt_bytes(self.host_weights_bytes),
                "",
                "",
                self.host_parts()
            );
        }
        let _ = writeln!(s);
        let _ = writeln!(
            s,
            "per token: {} of KV ({} B); per sequence: {} of DeltaNet state{}",
            fmt_bytes(self.kv_bytes_per_token),
            fmt_count(self.kv_bytes_per_token),
            fmt_bytes(self.state_bytes_per_seq),
            self.per_card()
        );
        let _ = writeln!(s, "{}", self.context_line());
        s
    }

    /// What the pinned host memory holds: `embedding 2.37 GiB`, `routed experts 37.12 GiB`, or both.
    fn host_parts(&self) -> String {
        let w = &self.weight_parts;
        let mut parts = Vec::new();
        if w.embed_on_host {
            parts.push(format!("embedding {}", fmt_bytes(w.embed)));
        }
        if w.experts_on_host {
            parts.push(format!("routed experts {}", fmt_bytes(w.host_experts())));
        }
        parts.join(" + ")
    }

    /// What the plan holds of the model's vision tower (None: the model has none).
    fn vision_line(&self) -> Option<String> {
        if !self.model_has_vision {
            return None;
        }
        let o = &self.options;
        let w = &self.weight_parts;
        Some(match o.max_image_tokens_per_step {
            Some(n) => format!(
                "vision tower: weights {} ({} params, {}) · workspace {} for {} patches a step \
                 (--max-image-tokens-per-step; an image of more patches is refused)",
                fmt_bytes(w.vision),
                fmt_count(w.vision_params),
                if o.weights_dtype.dense_elem_bytes() == 4 { "f32" } else { "bf16" },
                fmt_bytes(self.vision_workspace_bytes),
                fmt_count(n as u64)
            ),
            None => "vision tower: not loaded, nothing priced (--no-vision, traded for the full context: \
                     --max-image-tokens-per-step keeps it, or --tensor-parallel above 1); images are refused"
                .to_string(),
        })
    }

    /// The activation workspace: every buffer with its offset, size, lifetime and shape.
    pub fn workspace_table(&self) -> String {
        let ws = &self.workspace;
        let mut s = String::new();
        let _ = writeln!(
            s,
            "activation workspace: {} ({} buffers, {} ops; peak live {})",
            fmt_bytes(ws.bytes),
            ws.buffers.len(),
            ws.ops.len(),
            fmt_bytes(ws.peak_live_bytes())
        );
        let _ = writeln!(s, "{:<22} {:>11} {:>11}  {:<38} shape", "buffer", "offset", "size", "live (ops)");
        let mut bufs: Vec<_> = ws.buffers.iter().collect();
        bufs.sort_by_key(|b| (b.first_op, b.offset));
        for b in bufs {
            let live = format!("{}..{} {}→{}", b.first_op, b.last_op, ws.ops[b.first_op], ws.ops[b.last_op]);
            let _ = writeln!(
                s,
                "{:<22} {:>11} {:>11}  {:<38} {}",
                b.name,
                fmt_bytes(b.offset),
                fmt_bytes(b.bytes),
                live,
                b.shape
            );
        }
        s
    }

    /// A self-contained SVG: one bar of the budget split into regions (each its own colour), the host
    /// weights (embedding, routed experts) under it when the plan keeps them in host memory, a legend, and the activation workspace
    /// drawn by liveness (ops across, offset down).
    pub fn svg(&self) -> String {
        let o = &self.options;
        let mut segs: Vec<(String, u64, &str, String)> = self
            .regions
            .iter()
            .enumerate()
            .map(|(i, r)| (r.name.to_string(), r.bytes, REGION_COLORS[i % REGION_COLORS.len()], r.note.clone()))
            .collect();
        segs.push(("runtime_reserve".into(), o.runtime_reserve_bytes, RESERVE_COLOR, reserve_note(o)));
        if o.graph_reserve_bytes > 0 {
            segs.push(("cuda_graphs".into(), o.graph_reserve_bytes, GRAPHS_COLOR, GRAPHS_NOTE.into()));
        }
        segs.push(("free".into(), self.free_bytes(), FREE_COLOR, "less than one KV page".into()));
        let subtitle = wrap(&self.context_line(), SUBTITLE_CHARS);
        let bar_y = 40.0 + 18.0 * subtitle.len() as f64;
        let host_y = bar_y + BAR_H + 12.0;
        let host = self.host_weights_bytes > 0;
        let legend_y = if host { host_y + HOST_H + 28.0 } else { bar_y + BAR_H + 24.0 };
        let legend_rows = (segs.len() + usize::from(host)).div_ceil(2);
        let ws_top = legend_y + 22.0 * legend_rows as f64 + 12.0;
        // The op names under the workspace run down at 40°: room for the longest (8 px text, ~4.8 px a character).
        let longest = self.workspace.ops.iter().map(|op| op.len()).max().unwrap_or(0) as f64;
        let h = ws_top + WS_H + 16.0 + longest * 4.8 * 0.65;
        let w = X0 + BAR_W + longest * 4.8 * 0.77 + 8.0;

        let mut s = String::new();
        let _ = writeln!(
            s,
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w:.0}" height="{h:.0}" viewBox="0 0 {w:.0} {h:.0}" font-family="sans-serif" font-size="12">"#
        );
        let _ = writeln!(s, r#"<rect width="100%" height="100%" fill="white"/>"#);
        let _ = writeln!(
            s,
            r#"<text x="{X0}" y="24" font-size="16" font-weight="bold">deltaserve memory plan{}: {} of {} ({:.1}%)</text>"#,
            esc(&self.per_card()),
            fmt_bytes(self.total_bytes),
            fmt_bytes(self.budget_bytes),
            self.pct(self.total_bytes)
        );
        for (i, line) in subtitle.iter().enumerate() {
            let _ = writeln!(s, r#"<text x="{X0}" y="{}">{}</text>"#, 44.0 + 18.0 * i as f64, esc(line));
        }
        let scale = BAR_W / self.budget_bytes.max(1) as f64;
        self.svg_budget_bar(&mut s, &segs, bar_y, scale);
        if host {
            // At the budget's scale, cut at the bar's width (routed experts can outweigh the budget).
            let hw = (self.host_weights_bytes as f64 * scale).clamp(2.0, BAR_W);
            let _ = writeln!(
                s,
                r##"<rect x="{X0}" y="{host_y}" width="{hw:.2}" height="{HOST_H}" fill="{HOST_COLOR}" stroke="#555" stroke-dasharray="4 2"><title>pinned host memory: {}</title></rect>"##,
                esc(&self.host_parts())
            );
            // A wide host bar takes its label inside.
            let tx = if hw + 300.0 > BAR_W { X0 + 6.0 } else { X0 + hw + 6.0 };
            let _ = writeln!(
                s,
                r#"<text x="{tx:.2}" y="{:.1}">host memory, outside the budget: {}</text>"#,
                host_y + HOST_H - 5.0,
                esc(&self.host_parts())
            );
        }
        let mut legend: Vec<(String, &str)> =
            segs.iter().map(|(n, b, c, _)| (format!("{n}: {} ({:.1}%)", fmt_bytes(*b), self.pct(*b)), *c)).collect();
        if host {
            legend.push((format!("host: {} (pinned host memory)", self.host_parts()), HOST_COLOR));
        }
        for (i, (text, color)) in legend.iter().enumerate() {
            let lx = X0 + (i % 2) as f64 * (BAR_W / 2.0);
            let ly = legend_y + 22.0 * (i / 2) as f64;
            let _ = writeln!(
                s,
                r##"<rect x="{lx}" y="{}" width="14" height="14" fill="{color}" stroke="#888"/>"##,
                ly - 11.0
            );
            let _ = writeln!(s, r#"<text x="{}" y="{ly}">{}</text>"#, lx + 20.0, esc(text));
        }
        self.svg_workspace(&mut s, ws_top);
        s.push_str("</svg>\n");
        s
    }

    /// The budget bar: one segment per region, labelled where the label fits.
    fn svg_budget_bar(&self, s: &mut String, segs: &[(String, u64, &str, String)], y: f64, scale: f64) {
        let mut x = X0;
        for (name, bytes, color, note) in segs {
            let w = *bytes as f64 * scale;
            if w <= 0.0 {
                continue;
            }
            let _ = writeln!(
                s,
                r#"<rect x="{x:.2}" y="{y}" width="{w:.2}" height="{BAR_H}" fill="{color}" stroke="white" stroke-width="0.5"><title>{}: {} ({:.1}%) {}</title></rect>"#,
                name,
                fmt_bytes(*bytes),
                self.pct(*bytes),
                esc(note)
            );
            // Label what fits (about 6.5 px per character at 12 px).
            let full = format!("{name} {}", fmt_bytes(*bytes));
            let label = [full.as_str(), name.as_str()].into_iter().find(|l| w > l.len() as f64 * 6.5 + 6.0);
            if let Some(label) = label {
                let _ = writeln!(
                    s,
                    r#"<text x="{:.2}" y="{:.1}" text-anchor="middle" fill="black">{label}</text>"#,
                    x + w / 2.0,
                    y + BAR_H / 2.0 + 4.0
                );
            }
            x += w;
        }
        let _ = writeln!(s, r#"<rect x="{X0}" y="{y}" width="{BAR_W}" height="{BAR_H}" fill="none" stroke="black"/>"#);
    }

    /// The activation workspace by liveness, its op names underneath.
    fn svg_workspace(&self, s: &mut String, ws_top: f64) {
        let ws = &self.workspace;
        let _ = writeln!(
            s,
            r#"<text x="{X0}" y="{}" font-weight="bold">activation workspace {} at {} tokens / {} seqs per step, by liveness (ops →, offset ↓)</text>"#,
            ws_top - 6.0,
            fmt_bytes(ws.bytes),
            fmt_count(self.max_batch_tokens as u64),
            self.max_seqs
        );
        let n_ops = ws.ops.len().max(1) as f64;
        let ox = BAR_W / n_ops;
        let oy = WS_H / ws.bytes.max(1) as f64;
        let _ = writeln!(
            s,
            r##"<rect x="{X0}" y="{ws_top}" width="{BAR_W}" height="{WS_H}" fill="#fafafa" stroke="black"/>"##
        );
        for (i, b) in ws.buffers.iter().enumerate() {
            let bx = X0 + b.first_op as f64 * ox;
            let bw = (b.last_op - b.first_op + 1) as f64 * ox;
            let by = ws_top + b.offset as f64 * oy;
            let bh = (b.bytes as f64 * oy).max(0.5);
            let _ = writeln!(
                s,
                r#"<rect x="{bx:.2}" y="{by:.2}" width="{bw:.2}" height="{bh:.2}" fill="{}" fill-opacity="0.8" stroke="white" stroke-width="0.5"><title>{}: {} at +{} ops {}..{} ({}→{}) {}</title></rect>"#,
                REGION_COLORS[i % REGION_COLORS.len()],
                b.name,
                fmt_bytes(b.bytes),
                fmt_bytes(b.offset),
                b.first_op,
                b.last_op,
                ws.ops[b.first_op],
                ws.ops[b.last_op],
                esc(&b.shape)
            );
            if bh >= 11.0 && bw >= 60.0 {
                let _ = writeln!(
                    s,
                    r#"<text x="{:.2}" y="{:.2}" font-size="10">{}</text>"#,
                    bx + 3.0,
                    by + bh.min(20.0) / 2.0 + 4.0,
                    b.name
                );
            }
        }
        for (i, op) in ws.ops.iter().enumerate() {
            let tx = X0 + (i as f64 + 0.5) * ox;
            let ty = ws_top + WS_H + 8.0;
            let _ = writeln!(
                s,
                r##"<text x="{tx:.2}" y="{ty:.2}" font-size="8" fill="#555" transform="rotate(40 {tx:.2} {ty:.2})">{op}</text>"##
            );
        }
    }
}

/// The plan chart's geometry: left margin, bar width and height, host bar height, workspace height.
const X0: f64 = 20.0;
const BAR_W: f64 = 960.0;
const BAR_H: f64 = 44.0;
const HOST_H: f64 = 22.0;
const WS_H: f64 = 260.0;
/// Characters of subtitle per line (12 px text across the bar).
const SUBTITLE_CHARS: usize = 140;
/// One colour per region (more than the plan has), none of them the reserve's, the graphs', the free space's or the
/// host embedding's.
const REGION_COLORS: [&str; 12] = [
    "#4e79a7", "#f28e2b", "#59a14f", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#e15759", "#17becf",
    "#8cd17d", "#d37295",
];
const RESERVE_COLOR: &str = "#bab0ac";
const FREE_COLOR: &str = "#eeeeee";
const GRAPHS_COLOR: &str = "#d4a6c8";
const HOST_COLOR: &str = "#a0cbe8";

/// `text` split at spaces into lines of at most `width` characters (a longer word keeps its own line).
fn wrap(text: &str, width: usize) -> Vec<String> {
    let mut lines: Vec<String> = Vec::new();
    for word in text.split(' ') {
        match lines.last_mut() {
            Some(line) if line.len() + 1 + word.len() <= width => {
                line.push(' ');
                line.push_str(word);
            }
            _ => lines.push(word.to_string()),
        }
    }
    lines
}

fn esc(t: &str) -> String {
    t.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

/// What the runtime reserve holds.
/// What the `cuda_graphs` line holds.
const GRAPHS_NOTE: &str = "CUDA graphs of the step shapes (captured as they occur, up to this much)";

fn reserve_note(o: &crate::PlanOptions) -> String {
    if o.tensor_parallel > 1 {
        format!(
            "CUDA context, modules, cuBLAS handles + {} of NCCL buffers",
            fmt_bytes(crate::COLLECTIVE_RESERVE_BYTES)
        )
    } else {
        "CUDA context, modules, cuBLAS handles".into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wrapping() {
        assert_eq!(wrap("aa bb cc", 5), ["aa bb", "cc"]);
        assert_eq!(wrap("averylongword b", 4), ["averylongword", "b"]);
        assert_eq!(wrap("one", 80), ["one"]);
    }
}
