//! The probe's checks (driver-reported memory against the plan and across rungs, needles) and its
//! output: JSON, the table and the SVG chart.

use std::fmt::Write as _;

use deltaserve_plan::{fmt_bytes, fmt_count};
use serde_json::{Value, json};

use super::{Report, Row};
use crate::report::{ToolReport, round_to, xml};

/// Allowed spread of the driver-reported peak across rungs, as a fraction of the plan (or of the first peak).
const MAX_GROWTH: f64 = 0.01;

impl Report {
    fn rows(&self) -> impl Iterator<Item = &Row> {
        self.rungs.iter().chain(&self.turns)
    }

    pub(super) fn check(&mut self) {
        let mut f = Vec::new();
        for r in self.rows() {
            if let (Some(peak), Some(plan)) = (r.driver_peak_bytes, self.plan_bytes)
                && peak > plan
            {
                f.push(format!(
                    "{}: driver-reported {} is above the plan's {}",
                    r.label,
                    fmt_bytes(peak),
                    fmt_bytes(plan)
                ));
            }
            if r.needle == Some(false) {
                f.push(format!("{}: the reply does not repeat the needle", r.label));
            }
        }
        let peaks: Vec<u64> = self.rows().filter_map(|r| r.driver_peak_bytes).collect();
        if let (Some(lo), Some(hi)) = (peaks.iter().min(), peaks.iter().max()) {
            let allowed = (self.plan_bytes.unwrap_or(*lo) as f64 * MAX_GROWTH) as u64;
            if hi - lo > allowed {
                f.push(format!(
                    "driver-reported memory grew with the prompt: {} to {} (allowed spread {})",
                    fmt_bytes(*lo),
                    fmt_bytes(*hi),
                    fmt_bytes(allowed)
                ));
            }
        }
        self.failures.extend(f);
    }
}

impl ToolReport for Report {
    fn to_json(&self) -> Value {
        let row = |r: &Row| {
            json!({
                "label": r.label, "percent": round1(r.percent), "prompt_tokens": r.prompt_tokens,
                "cached_tokens": r.cached_tokens, "new_tokens": r.new_tokens(),
                "completion_tokens": r.completion_tokens, "ttft_ms": round1(r.ttft_ms), "total_ms": round1(r.total_ms),
                "prefill_tok_s": round1(r.prefill_tok_s()), "driver_peak_bytes": r.driver_peak_bytes, "needle": r.needle,
                "images": r.images, "image_tokens": r.image_tokens,
            })
        };
        json!({
            "server": self.server, "model": self.model, "max_context": self.max_context,
            "advertised_context": self.advertised_context,
            "plan_bytes": self.plan_bytes, "idle_driver_bytes": self.idle_driver_bytes,
            "arena_capacity_bytes": self.arena_capacity_bytes, "needle_checked": self.needle,
            "images_per_prompt": self.images_per_prompt,
            "image_size": (self.images_per_prompt > 0).then(|| self.image_size.to_string()),
            "tokens_per_image": self.tokens_per_image,
            "rungs": self.rungs.iter().map(row).collect::<Vec<_>>(),
            "turns": self.turns.iter().map(row).collect::<Vec<_>>(),
            "passed": self.failures.is_empty(), "failures": self.failures,
        })
    }

    fn table(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "probe of {} ({}), filling {} tokens of the advertised context {}",
            self.server,
            self.model,
            fmt_count(self.max_context),
            fmt_count(self.advertised_context)
        );
        let _ = writeln!(
            s,
            "plan {} · driver idle {} · arena {}",
            self.plan_bytes.map_or("n/a".into(), fmt_bytes),
            self.idle_driver_bytes.map_or("n/a".into(), fmt_bytes),
            self.arena_capacity_bytes.map_or("n/a".into(), fmt_bytes)
        );
        let images = self.images_per_prompt > 0;
        if images {
            let _ = writeln!(
                s,
                "images: {} of {} in each rung's prompt and each turn's new message, {} prompt tokens each",
                self.images_per_prompt, self.image_size, self.tokens_per_image
            );
        }
        let _ = write!(
            s,
            "\n{:<9} {:>6} {:>9} {:>9} {:>9} {:>10} {:>11} {:>11} {:>7} {:>6}",
            "rung", "fill", "prompt", "cached", "new", "TTFT ms", "prefill/s", "driver", "/plan", "needle"
        );
        let _ = writeln!(s, "{}", if images { format!(" {:>6} {:>8}", "images", "img tok") } else { String::new() });
        for r in self.rows() {
            let ratio = match (r.driver_peak_bytes, self.plan_bytes) {
                (Some(p), Some(plan)) => format!("{:.3}", p as f64 / plan as f64),
                _ => "-".into(),
            };
            let _ = write!(
                s,
                "{:<9} {:>5.1}% {:>9} {:>9} {:>9} {:>10.0} {:>11.0} {:>11} {:>7} {:>6}",
                r.label,
                r.percent,
                r.prompt_tokens,
                r.cached_tokens,
                r.new_tokens(),
                r.ttft_ms,
                r.prefill_tok_s(),
                r.driver_peak_bytes.map_or("n/a".into(), fmt_bytes),
                ratio,
                r.needle.map_or("-", |ok| if ok { "ok" } else { "MISS" })
            );
            let _ = writeln!(
                s,
                "{}",
                if images { format!(" {:>6} {:>8}", r.images, r.image_tokens) } else { String::new() }
            );
        }
        let _ = writeln!(
            s,
            "\n{}",
            if self.failures.is_empty() { "PASS".to_string() } else { format!("FAIL ({})", self.failures.len()) }
        );
        s
    }

    /// Two panels: prefill tokens/s per rung and turn; driver-reported memory against the plan. Each y
    /// axis carries its values.
    fn svg(&self) -> String {
        let rows: Vec<&Row> = self.rows().collect();
        let (w, h, left, right, top, gap) = (760.0, 540.0, 80.0, 20.0, 56.0, 70.0);
        let (pw, ph) = (w - left - right, (h - top - gap - 40.0) / 2.0);
        let bw = pw / rows.len().max(1) as f64;
        let mut s = format!(
            "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" viewBox=\"0 0 {w} {h}\" font-family=\"sans-serif\" font-size=\"11\">\n\
             <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
             <text x=\"{left}\" y=\"20\" font-size=\"14\">deltaserve probe: {} — {} of {} tokens{}</text>\n",
            xml(&self.model),
            fmt_count(self.max_context),
            fmt_count(self.advertised_context),
            if self.images_per_prompt > 0 {
                format!(
                    " · {} images of {} a prompt (under each bar: its image tokens)",
                    self.images_per_prompt, self.image_size
                )
            } else {
                String::new()
            }
        );
        let max_rate = rows.iter().map(|r| r.prefill_tok_s()).fold(0.0, f64::max);
        let plan = self.plan_bytes.unwrap_or(0) as f64;
        let max_mem = rows.iter().filter_map(|r| r.driver_peak_bytes).map(|b| b as f64).fold(plan, f64::max);
        // Memory in the largest binary unit it reaches.
        let (unit, unit_name) = [(1u64 << 30, " GiB"), (1 << 20, " MiB"), (1, " B")]
            .into_iter()
            .find(|(u, _)| max_mem >= *u as f64)
            .unwrap_or((1, " B"));
        let unit = unit as f64;
        for panel in 0..2 {
            let y0 = top + panel as f64 * (ph + gap);
            let axis_top = match panel {
                0 => crate::report::panel(
                    &mut s,
                    left,
                    y0,
                    pw,
                    ph,
                    max_rate,
                    "prefill tokens/s (new prompt tokens / TTFT)",
                    "",
                ),
                _ => {
                    let title = "driver-reported device memory (line: plan)";
                    crate::report::panel(&mut s, left, y0, pw, ph, max_mem / unit, title, unit_name)
                }
            };
            for (i, r) in rows.iter().enumerate() {
                let x = left + i as f64 * bw + bw * 0.15;
                let (v, color) = match panel {
                    0 => (r.prefill_tok_s(), "#4a7bd0"),
                    _ => (r.driver_peak_bytes.unwrap_or(0) as f64 / unit, "#d07b4a"),
                };
                let bh = ph * v / axis_top;
                let _ = writeln!(
                    s,
                    "<rect x=\"{x:.1}\" y=\"{:.1}\" width=\"{:.1}\" height=\"{bh:.1}\" fill=\"{color}\"><title>{}: {}</title></rect>",
                    y0 + ph - bh,
                    bw * 0.7,
                    xml(&r.label),
                    crate::report::tick_label(v)
                );
                let _ = writeln!(
                    s,
                    "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{}</text>",
                    x + bw * 0.35,
                    y0 + ph + 14.0,
                    xml(&r.label)
                );
                if r.images > 0 {
                    let _ = writeln!(
                        s,
                        "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\" fill=\"#666\"><title>{} images, {} of the prompt's tokens</title>{} img</text>",
                        x + bw * 0.35,
                        y0 + ph + 27.0,
                        r.images,
                        r.image_tokens,
                        fmt_count(r.image_tokens)
                    );
                }
            }
            if panel == 1 && plan > 0.0 {
                let y = y0 + ph - ph * (plan / unit) / axis_top;
                let _ = writeln!(
                    s,
                    "<line x1=\"{left}\" x2=\"{}\" y1=\"{y:.1}\" y2=\"{y:.1}\" stroke=\"#c00\" stroke-dasharray=\"4 3\"/>",
                    left + pw
                );
                let _ = writeln!(
                    s,
                    "<text x=\"{}\" y=\"{:.1}\" text-anchor=\"end\" fill=\"#c00\">plan {}</text>",
                    left + pw - 4.0,
                    y - 4.0,
                    fmt_bytes(plan as u64)
                );
            }
        }
        s.push_str("</svg>\n");
        s
    }

    fn failures(&self) -> Vec<String> {
        self.failures.clone()
    }
}

fn round1(v: f64) -> f64 {
    round_to(v, 1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synthetic_images::ImageSize;

    /// A report of `rungs` under a plan of `plan_bytes`, without a context, images or turns.
    fn report(plan_bytes: u64, rungs: Vec<Row>) -> Report {
        Report {
            server: String::new(),
            model: String::new(),
            max_context: 0,
            advertised_context: 0,
            plan_bytes: Some(plan_bytes),
            idle_driver_bytes: None,
            arena_capacity_bytes: None,
            needle: false,
            images_per_prompt: 0,
            image_size: ImageSize { width: 64, height: 64 },
            tokens_per_image: 0,
            rungs,
            turns: vec![],
            failures: vec![],
        }
    }

    #[test]
    fn the_chart_has_axis_values() {
        let row = |label: &str, peak| Row {
            label: label.into(),
            prompt_tokens: 3000,
            ttft_ms: 1000.0,
            driver_peak_bytes: Some(peak),
            ..Default::default()
        };
        let r = Report {
            model: "m".into(),
            max_context: 4096,
            advertised_context: 4096,
            ..report(2 << 30, vec![row("25%", 3 << 29)])
        };
        let svg = r.svg();
        for tick in [">0<", ">1000<", ">3000<", ">0 GiB<", ">0.5 GiB<", ">2 GiB<"] {
            assert!(svg.contains(tick), "no tick {tick}: {svg}");
        }
    }

    #[test]
    fn growth_and_plan_checks() {
        let row = |label: &str, peak| Row { label: label.into(), driver_peak_bytes: Some(peak), ..Default::default() };
        let mut r = report(1000, vec![row("25%", 900), row("50%", 905)]);
        r.check();
        assert!(r.failures.is_empty(), "{:?}", r.failures);
        r.rungs.push(row("100%", 1001));
        r.check();
        assert_eq!(r.failures.len(), 2, "{:?}", r.failures); // above the plan, and grew by > 1%
    }
}
