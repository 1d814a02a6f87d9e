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
}
