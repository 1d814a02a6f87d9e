//! Output of the measuring tools (`soak`, `probe`, `bench`): one JSON object (`--json`) or a table on
//! stdout, an optional SVG chart, and the failures that make the command exit non-zero — the same way for
//! every tool.

use std::path::Path;

use anyhow::{Context, Result, bail};
use serde_json::Value;

/// A tool's report.
pub(crate) trait ToolReport {
    fn to_json(&self) -> Value;
    fn table(&self) -> String;
    fn svg(&self) -> String;
    /// Why the run failed (empty: it passed).
    fn failures(&self) -> Vec<String>;
}

/// Prints `report` (JSON or table), writes its SVG to `svg`, and fails naming every failure.
pub(crate) fn emit(tool: &str, report: &impl ToolReport, json: bool, svg: Option<&Path>) -> Result<()> {
    if json {
        println!("{}", serde_json::to_string_pretty(&report.to_json())?);
    } else {
        print!("{}", report.table());
    }
    if let Some(path) = svg {
        std::fs::write(path, report.svg()).with_context(|| format!("writing {}", path.display()))?;
    }
    let failures = report.failures();
    if !failures.is_empty() {
        bail!("{tool} failed:\n  - {}", failures.join("\n  - "));
    }
    Ok(())
}

/// Text escaped for SVG/XML content and attribute values.
pub(crate) fn xml(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

/// A chart axis for values up to `max`: a round top at or above it and the ticks 0, step, … top (a step of
/// 1, 2 or 5 × 10^k, 3 to 6 ticks).
pub(crate) fn ticks(max: f64) -> (f64, Vec<f64>) {
    let max = if max.is_finite() && max > 0.0 { max } else { 1.0 };
    let raw = max / 4.0;
    let mag = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0].into_iter().map(|m| m * mag).find(|s| *s >= raw).unwrap_or(10.0 * mag);
    let n = (max / step - 1e-9).ceil().max(1.0) as usize;
    (step * n as f64, (0..=n).map(|i| step * i as f64).collect())
}

/// A tick value without trailing noise: `1500`, `2.5`, `0.25`.
pub(crate) fn tick_label(v: f64) -> String {
    let s = format!("{v:.3}");
    let s = s.trim_end_matches('0').trim_end_matches('.');
    if s == "-0" { "0".into() } else { s.to_string() }
}

/// A chart panel at (`x`, `y`) of `w` × `h`: its title, frame and a y axis whose ticks carry their values
/// (`unit` after each, e.g. ` GiB`). Returns the axis top, the value a full-height bar stands for.
#[allow(clippy::too_many_arguments)]
pub(crate) fn panel(s: &mut String, x: f64, y: f64, w: f64, h: f64, max: f64, title: &str, unit: &str) -> f64 {
    use std::fmt::Write as _;
    let (top, values) = ticks(max);
    let _ = writeln!(s, r#"<text x="{x}" y="{:.1}" font-size="12">{}</text>"#, y - 8.0, xml(title));
    for v in values {
        let ty = y + h - h * v / top;
        let _ = writeln!(
            s,
            r##"<line x1="{:.1}" y1="{ty:.1}" x2="{:.1}" y2="{ty:.1}" stroke="#e4e4e4"/><line x1="{:.1}" y1="{ty:.1}" x2="{x}" y2="{ty:.1}" stroke="#999"/><text x="{:.1}" y="{:.1}" text-anchor="end">{}{unit}</text>"##,
            x,
            x + w,
            x - 4.0,
            x - 6.0,
            ty + 4.0,
            tick_label(v)
        );
    }
    let _ = writeln!(s, r##"<rect x="{x}" y="{y}" width="{w}" height="{h}" fill="none" stroke="#999"/>"##);
    top
}

/// `v` rounded to `digits` decimals (for JSON that people read).
pub(crate) fn round_to(v: f64, digits: i32) -> f64 {
    let f = 10f64.powi(digits);
    (v * f).round() / f
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn helpers() {
        assert_eq!(xml("a<b & \"c\">"), "a&lt;b &amp; &quot;c&quot;&gt;");
        assert_eq!(round_to(1.23456, 3), 1.235);
        assert_eq!(round_to(1.25, 1), 1.3);
    }

    #[test]
    fn axis_ticks_are_round() {
        let (top, t) = ticks(9.0);
        assert_eq!((top, t), (10.0, vec![0.0, 5.0, 10.0]));
        let (top, t) = ticks(2989.0);
        assert_eq!((top, t.len()), (3000.0, 4));
        let (top, t) = ticks(0.37);
        assert_eq!((top, t), (0.4, vec![0.0, 0.1, 0.2, 0.30000000000000004, 0.4]));
        assert_eq!(ticks(0.0).0, 1.0);
        assert_eq!(ticks(f64::NAN).0, 1.0);
        assert_eq!([tick_label(1500.0), tick_label(2.5), tick_label(0.30000000000000004)], ["1500", "2.5", "0.3"]);
    }
}
