//! The soak's output: JSON, the table (one row per turn, or one per session) and the SVG chart.

use std::fmt::Write as _;

use serde_json::{Value, json};

use super::{Report, Session, Turn};
use crate::commands::soak_sessions::{Replica, sessions_table};
use crate::report::{ToolReport, round_to, xml};

/// Cached tokens of each turn over the previous turn's prompt (None for the first).
fn cached_fractions(turns: &[Turn]) -> impl Iterator<Item = Option<f64>> + '_ {
    turns.iter().enumerate().map(|(i, t)| {
        let prev = i.checked_sub(1).map(|j| &turns[j])?;
        Some(t.cached_tokens as f64 / prev.prompt_tokens.max(1) as f64)
    })
}

impl Report {
    /// Turns from 2 on whose prompt ran in one engine step, and how many turns from 2 on reported their
    /// steps (None when the server sent no `timings`).
    fn follow_ups_in_one_step(&self) -> Option<[usize; 2]> {
        let later = self.sessions.iter().flat_map(|s| s.turns.iter().skip(1));
        let steps: Vec<u64> = later.filter_map(|t| t.prefill_steps).collect();
        (!steps.is_empty()).then(|| [steps.iter().filter(|&&n| n == 1).count(), steps.len()])
    }

    /// The largest TTFT of a turn from 2 on over the compute of the steps that ran its prompt: what the
    /// cache and the serving path add to a turn's first token (1.0: nothing).
    fn max_ttft_over_compute(&self) -> Option<f64> {
        let later = self.sessions.iter().flat_map(|s| s.turns.iter().skip(1));
        later.filter_map(|t| t.prefill_ms.filter(|&c| c > 0.0).map(|c| t.ttft_ms / c)).max_by(f64::total_cmp)
    }

    /// Every session's short follow-ups (--follow-ups).
    fn short_turns(&self) -> impl Iterator<Item = &Turn> {
        self.sessions.iter().flat_map(|s| s.short_turns())
    }

    /// Accepted over drafted tokens of every turn (None without speculative decoding).
    fn acceptance(&self) -> Option<f64> {
        let turns = self.sessions.iter().flat_map(|s| &s.turns);
        let (d, a) = turns.filter_map(|t| t.drafted.zip(t.accepted)).fold((0, 0), |s, (d, a)| (s.0 + d, s.1 + a));
        (d > 0).then(|| a as f64 / d as f64)
    }

    /// Completion tokens of every session's turns.
    fn generated_tokens(&self) -> u64 {
        self.sessions.iter().flat_map(|s| &s.turns).map(|t| t.completion_tokens).sum()
    }

    /// The first session's turns (the only session's, without --sessions).
    fn turns(&self) -> &[Turn] {
        self.sessions.first().map_or(&[], |s| &s.turns)
    }
}

impl ToolReport for Report {
    fn to_json(&self) -> Value {
        let turns: Vec<Value> = self
            .sessions
            .iter()
            .flat_map(|s| s.turns.iter().zip(cached_fractions(&s.turns)).map(move |(t, f)| (s, t, f)))
            .map(|(session, t, cached_fraction)| {
                json!({
                    "session": session.key,
                    "turn": t.turn,
                    "kind": t.kind,
                    "prompt_tokens": t.prompt_tokens,
                    "cached_tokens": t.cached_tokens,
                    "new_tokens": t.new_tokens(),
                    "cached_fraction_of_previous_context": cached_fraction.map(|v| round_to(v, 4)),
                    "images": t.images,
                    "image_tokens": t.image_tokens,
                    "completion_tokens": t.completion_tokens,
                    "ttft_ms": round3(t.ttft_ms),
                    "ttft_per_new_token_ms": round3(t.ttft_per_new_token_ms()),
                    "total_ms": round3(t.total_ms),
                    "arena_high_water_bytes": t.arena_high_water_bytes,
                    "arena_allocations": t.arena_allocations,
                    "kv_pages_used": t.kv_pages_used,
                    "host_rss_bytes": t.host_rss_bytes,
                    "steps": t.steps,
                    "step_ms": t.step_ms.map(round3),
                    "prefill_steps": t.prefill_steps,
                    "prefill_compute_ms": t.prefill_ms.map(round3),
                    "ttft_outside_compute_fraction": t.outside_compute().map(|v| round_to(v, 4)),
                    "draft_tokens": t.drafted,
                    "accepted_draft_tokens": t.accepted,
                })
            })
            .collect();
        let n_turns = turns.len();
        let generated = self.generated_tokens();
        let first = self.sessions.first();
        let baseline = first.and_then(|s| s.baseline);
        let min_cached = self.sessions.iter().filter_map(Session::min_cached_fraction).min_by(f64::total_cmp);
        json!({
            "turns": turns,
            "sessions": self.sessions.iter().map(Session::summary).collect::<Vec<_>>(),
            "replicas": self.replicas.iter().map(Replica::to_json).collect::<Vec<_>>(),
            "summary": {
                "server": self.server,
                "sessions": self.sessions.len(),
                "turns": n_turns,
                "target_context": self.target_context,
                "screenshot": self.screenshot.map(|(size, _)| size.to_string()),
                "tokens_per_screenshot": self.screenshot.map(|(_, tokens)| tokens),
                "final_context": self.sessions.iter().filter_map(|s| s.turns.last()).map(|t| t.prompt_tokens).max(),
                "ttft_ratio_last_vs_turn2_per_new_token": first.and_then(Session::ttft_ratio).map(round3),
                "min_cached_fraction_of_previous_context": min_cached.map(round3),
                "follow_up_turns_in_one_prefill_step": self.follow_ups_in_one_step(),
                "max_follow_up_ttft_over_prefill_compute": self.max_ttft_over_compute().map(round3),
                "short_follow_ups": self.short_turns().count(),
                "short_follow_up_max_new_tokens": self.short_turns().map(Turn::new_tokens).max(),
                "short_follow_up_max_ttft_ms": self.short_turns().map(|t| t.ttft_ms).max_by(f64::total_cmp).map(round3),
                "short_follow_up_max_prefill_steps": self.short_turns().filter_map(|t| t.prefill_steps).max(),
                "draft_acceptance_rate": self.acceptance().map(|v| round_to(v, 4)),
                "wall_s": round3(self.wall_s),
                "generated_tokens": generated,
                "generated_tokens_per_s": round3(generated as f64 / self.wall_s.max(1e-9)),
                "baseline_arena_allocations": baseline.map(|b| b.0),
                "baseline_arena_high_water_bytes": baseline.map(|b| b.1),
                "ok": self.failures.is_empty(),
                "failures": self.failures,
            }
        })
    }

    fn table(&self) -> String {
        let mut s = String::new();
        if self.sessions.len() > 1 || !self.replicas.is_empty() {
            sessions_table(&mut s, &self.server, self.target_context, &self.sessions, &self.replicas);
            let _ = writeln!(
                s,
                "{} tokens generated in {:.1} s: {:.1} tokens/s over all sessions",
                self.generated_tokens(),
                self.wall_s,
                self.generated_tokens() as f64 / self.wall_s.max(1e-9)
            );
        } else {
            self.turns_table(&mut s);
        }
        if self.failures.is_empty() {
            let _ = writeln!(s, "ok");
        } else {
            let _ = writeln!(s, "FAILED:");
            for f in &self.failures {
                let _ = writeln!(s, "  - {f}");
            }
        }
        s
    }

    /// Two panels: TTFT per turn (bars, ms) and prompt tokens per turn split into cached and new (the
    /// first session's).
    fn svg(&self) -> String {
        self.turns_svg()
    }

    fn failures(&self) -> Vec<String> {
        self.failures.clone()
    }
}

impl Report {
    /// One row per turn of the only session.
    fn turns_table(&self, s: &mut String) {
        let _ = writeln!(
            s,
            "soak: {} turns against {} (target context {})",
            self.turns().len(),
            self.server,
            self.target_context
        );
        if let Some((size, tokens)) = self.screenshot {
            let _ = writeln!(s, "every turn adds a {size} screenshot ({tokens} prompt tokens each)");
        }
        let rss = if self.in_process { "  host RSS" } else { "" };
        let img = if self.screenshot.is_some() { format!(" {:>8}", "img tok") } else { String::new() };
        let _ = writeln!(
            s,
            "{:>4} {:>4} {:>8} {:>8} {:>7} {:>7}{img} {:>9} {:>12} {:>9} {:>9} {:>9} {:>6} {:>9} {:>14} {:>7}{rss}",
            "turn",
            "msg",
            "prompt",
            "cached",
            "of prev",
            "new",
            "ttft ms",
            "ttft/new ms",
            "pf steps",
            "pf ms",
            "total ms",
            "steps",
            "step ms",
            "arena hw",
            "allocs"
        );
        for (t, cached) in self.turns().iter().zip(cached_fractions(self.turns())) {
            let img = if self.screenshot.is_some() { format!(" {:>8}", t.image_tokens) } else { String::new() };
            let _ = write!(
                s,
                "{:>4} {:>4} {:>8} {:>8} {:>7} {:>7}{img} {:>9.1} {:>12.4} {:>9} {:>9} {:>9.1} {:>6} {:>9} {:>14} {:>7}",
                t.turn,
                t.kind,
                t.prompt_tokens,
                t.cached_tokens,
                cached.map_or("-".into(), |f| format!("{:.1}%", 100.0 * f)),
                t.new_tokens(),
                t.ttft_ms,
                t.ttft_per_new_token_ms(),
                t.prefill_steps.map_or("-".into(), |v| v.to_string()),
                t.prefill_ms.map_or("-".into(), |v| format!("{v:.1}")),
                t.total_ms,
                t.steps.map_or("-".into(), |v| v.to_string()),
                t.step_ms.map_or("-".into(), |v| format!("{v:.1}")),
                t.arena_high_water_bytes.map_or("-".into(), |v| v.to_string()),
                t.arena_allocations.map_or("-".into(), |v| v.to_string()),
            );
            if self.in_process {
                let _ = write!(
                    s,
                    "  {}",
                    t.host_rss_bytes.map_or("-".into(), |v| format!("{:.1} MiB", v as f64 / 1048576.0))
                );
            }
            s.push('\n');
        }
        let fmt = |v: Option<f64>| v.map_or("-".into(), |v| format!("{v:.3}"));
        let first = self.sessions.first();
        let _ = writeln!(
            s,
            "final context {} tokens; min cached fraction of the previous context {}; TTFT per new token, last vs turn 2: {}",
            self.turns().last().map_or(0, |t| t.prompt_tokens),
            fmt(first.and_then(Session::min_cached_fraction)),
            fmt(first.and_then(Session::ttft_ratio))
        );
        if let Some(rate) = self.acceptance() {
            let _ = writeln!(s, "speculative decoding: {:.1}% of the drafted tokens accepted", 100.0 * rate);
        }
        if let Some([one, of]) = self.follow_ups_in_one_step() {
            let _ = writeln!(
                s,
                "pf steps / pf ms: the engine steps that ran each prompt and their compute (the server's timings); \
                 {one} of {of} follow-up turns in one step; the largest follow-up TTFT over its prefill compute {}",
                fmt(self.max_ttft_over_compute())
            );
        }
    }

    fn turns_svg(&self) -> String {
        let (w, h, left, right, top, panel, gap) = (760.0, 580.0, 70.0, 20.0, 40.0, 200.0, 70.0);
        let plot_w = w - left - right;
        let n = self.turns().len().max(1) as f64;
        let slot = plot_w / n;
        let bar = (slot * 0.7).max(1.0);
        let mut s = String::new();
        let _ = writeln!(
            s,
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" font-family="sans-serif" font-size="11">"#
        );
        let _ = writeln!(s, r#"<rect width="{w}" height="{h}" fill="white"/>"#);
        let _ = writeln!(
            s,
            r#"<text x="{left}" y="20" font-size="14">deltaserve soak: {} turns, {} ({})</text>"#,
            self.turns().len(),
            xml(&self.server),
            if self.failures.is_empty() { "ok" } else { "FAILED" }
        );
        // Panel 1: TTFT.
        let max_ttft = self.turns().iter().map(|t| t.ttft_ms).fold(0.0, f64::max).max(1e-3);
        let y0 = top + 20.0;
        let max_ttft = crate::report::panel(&mut s, left, y0, plot_w, panel, max_ttft, "time to first token (ms)", "");
        for (i, t) in self.turns().iter().enumerate() {
            let x = left + slot * i as f64 + (slot - bar) / 2.0;
            let bh = panel * t.ttft_ms / max_ttft;
            let _ = writeln!(
                s,
                r##"<rect x="{x:.1}" y="{:.1}" width="{bar:.1}" height="{bh:.1}" fill="#4878cf"><title>turn {}: {:.1} ms ({:.4} ms per new token)</title></rect>"##,
                y0 + panel - bh,
                t.turn,
                t.ttft_ms,
                t.ttft_per_new_token_ms()
            );
        }
        // Panel 2: cached vs new prompt tokens.
        let max_tok = self.turns().iter().map(|t| t.prompt_tokens).max().unwrap_or(1).max(1) as f64;
        let y1 = y0 + panel + gap;
        let title = match self.screenshot {
            Some((size, tokens)) => {
                format!("prompt tokens per turn: cached / new (a {size} screenshot a turn, {tokens} tokens each)")
            }
            None => "prompt tokens per turn: cached / new".into(),
        };
        let max_tok = crate::report::panel(&mut s, left, y1, plot_w, panel, max_tok, &title, "");
        for (i, t) in self.turns().iter().enumerate() {
            let x = left + slot * i as f64 + (slot - bar) / 2.0;
            let ch = panel * t.cached_tokens as f64 / max_tok;
            let nh = panel * t.new_tokens() as f64 / max_tok;
            let _ = writeln!(
                s,
                r##"<rect x="{x:.1}" y="{:.1}" width="{bar:.1}" height="{ch:.1}" fill="#6acc65"><title>turn {}: {} cached</title></rect>"##,
                y1 + panel - ch,
                t.turn,
                t.cached_tokens
            );
            let _ = writeln!(
                s,
                r##"<rect x="{x:.1}" y="{:.1}" width="{bar:.1}" height="{nh:.1}" fill="#d65f5f"><title>turn {}: {} new</title></rect>"##,
                y1 + panel - ch - nh,
                t.turn,
                t.new_tokens()
            );
            if self.turns().len() <= 40 || i % (self.turns().len() / 20).max(1) == 0 {
                let _ = writeln!(
                    s,
                    r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
                    x + bar / 2.0,
                    y1 + panel + 14.0,
                    t.turn
                );
            }
        }
        let ly = y1 + panel + 34.0;
        let _ = writeln!(
            s,
            r##"<rect x="{left}" y="{:.1}" width="10" height="10" fill="#6acc65"/><text x="{:.1}" y="{:.1}">cached</text><rect x="{:.1}" y="{:.1}" width="10" height="10" fill="#d65f5f"/><text x="{:.1}" y="{:.1}">new</text><text x="{:.1}" y="{:.1}" text-anchor="end">turn</text>"##,
            ly - 9.0,
            left + 14.0,
            ly,
            left + 70.0,
            ly - 9.0,
            left + 84.0,
            ly,
            w - right,
            ly
        );
        s.push_str("</svg>\n");
        s
    }
}

fn round3(v: f64) -> f64 {
    round_to(v, 3)
}
