//! `deltaserve soak --sessions N` / `--metrics-url`: each session's summary (turns, cached fraction of
//! the previous prompt, TTFT) and the replicas' counters read from their own `/metrics` before and
//! after the run (a gateway in front of them does not proxy `/metrics`).

use std::fmt::Write as _;

use anyhow::Result;
use serde_json::{Value, json};

use super::soak::Session;
use crate::http::{Client, MetricsSample, Target};
use crate::report::round_to;

impl Session {
    /// Turns from 2 on: cached tokens over the previous turn's prompt, summed.
    fn cached_fraction(&self) -> Option<f64> {
        let (cached, prev): (u64, u64) = self
            .turns
            .windows(2)
            .map(|w| (w[1].cached_tokens, w[0].prompt_tokens))
            .fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1));
        (prev > 0).then(|| cached as f64 / prev as f64)
    }

    /// Mean and largest TTFT (ms) of the turns from 2 on (turn 1 prefills the whole first prompt).
    fn follow_up_ttft_ms(&self) -> Option<(f64, f64)> {
        let later = self.turns.get(1..).filter(|t| !t.is_empty())?;
        let mean = later.iter().map(|t| t.ttft_ms).sum::<f64>() / later.len() as f64;
        Some((mean, later.iter().map(|t| t.ttft_ms).fold(0.0, f64::max)))
    }

    pub(super) fn summary(&self) -> Value {
        let ttft = self.follow_up_ttft_ms();
        json!({
            "session": self.key,
            "turns": self.turns.len(),
            "final_context": self.turns.last().map(|t| t.prompt_tokens),
            "cached_fraction_of_previous_context": self.cached_fraction().map(|v| round_to(v, 4)),
            "min_cached_fraction_of_previous_context": self.min_cached_fraction().map(|v| round_to(v, 4)),
            "first_turn_ttft_ms": self.turns.first().map(|t| round_to(t.ttft_ms, 3)),
            "follow_up_ttft_ms_mean": ttft.map(|t| round_to(t.0, 3)),
            "follow_up_ttft_ms_max": ttft.map(|t| round_to(t.1, 3)),
            "ok": self.failures.is_empty(),
        })
    }
}

/// One replica's counters over the run.
pub(super) struct Replica {
    url: String,
    before: MetricsSample,
    after: MetricsSample,
}

impl Replica {
    /// Pairs the samples; an arena that allocated or grew during the run is a failure.
    pub(super) fn compare(
        targets: &[Target],
        before: Vec<MetricsSample>,
        after: Vec<MetricsSample>,
        failures: &mut Vec<String>,
    ) -> Vec<Replica> {
        let replicas: Vec<Replica> = targets
            .iter()
            .zip(before.into_iter().zip(after))
            .map(|(t, (before, after))| Replica { url: t.origin(), before, after })
            .collect();
        for r in &replicas {
            let (b, a) = (&r.before, &r.after);
            if (b.allocations, b.high_water) != (a.allocations, a.high_water) {
                failures.push(format!(
                    "{}: the arena changed during the run (allocations {} → {}, high water {} → {} bytes)",
                    r.url, b.allocations, a.allocations, b.high_water, a.high_water
                ));
            }
        }
        replicas
    }

    fn delta(&self, f: impl Fn(&MetricsSample) -> Option<u64>) -> Option<u64> {
        Some(f(&self.after)?.saturating_sub(f(&self.before)?))
    }

    pub(super) fn to_json(&self) -> Value {
        json!({
            "url": self.url,
            "prompt_tokens": self.delta(|m| m.prompt_tokens),
            "cached_tokens": self.delta(|m| m.cached_tokens),
            "arena_allocations": self.after.allocations,
            "arena_high_water_bytes": self.after.high_water,
        })
    }
}

/// Every replica's /metrics, in order.
pub(super) async fn read_replicas(clients: &[Client]) -> Result<Vec<MetricsSample>> {
    let mut out = Vec::with_capacity(clients.len());
    for c in clients {
        out.push(c.metrics().await?);
    }
    Ok(out)
}

/// One row per session, then one per replica.
pub(super) fn sessions_table(
    s: &mut String,
    server: &str,
    target_context: usize,
    sessions: &[Session],
    replicas: &[Replica],
) {
    let _ = writeln!(s, "soak: {} sessions against {server} (target context {target_context})", sessions.len());
    let _ = writeln!(
        s,
        "{:>10} {:>5} {:>8} {:>8} {:>8} {:>12} {:>12} {:>12}  status",
        "session", "turns", "context", "cached", "min", "turn-1 ttft", "ttft mean", "ttft max"
    );
    let pct = |v: Option<f64>| v.map_or("-".into(), |v| format!("{:.1}%", 100.0 * v));
    let ms = |v: Option<f64>| v.map_or("-".into(), |v| format!("{v:.1} ms"));
    for x in sessions {
        let ttft = x.follow_up_ttft_ms();
        let _ = writeln!(
            s,
            "{:>10} {:>5} {:>8} {:>8} {:>8} {:>12} {:>12} {:>12}  {}",
            x.key,
            x.turns.len(),
            x.turns.last().map_or(0, |t| t.prompt_tokens),
            pct(x.cached_fraction()),
            pct(x.min_cached_fraction()),
            ms(x.turns.first().map(|t| t.ttft_ms)),
            ms(ttft.map(|t| t.0)),
            ms(ttft.map(|t| t.1)),
            if x.failures.is_empty() { "ok" } else { "FAILED" }
        );
    }
    let _ =
        writeln!(s, "(cached: cached tokens of turns 2.. over the previous turn's prompt; ttft mean/max: turns 2..)");
    for r in replicas {
        let _ = writeln!(
            s,
            "replica {}: {} prompt tokens, {} of them cached; arena {} allocations, {} bytes high water",
            r.url,
            r.delta(|m| m.prompt_tokens).map_or("-".into(), |v| v.to_string()),
            r.delta(|m| m.cached_tokens).map_or("-".into(), |v| v.to_string()),
            r.after.allocations,
            r.after.high_water
        );
    }
}

#[cfg(test)]
mod tests {
    use super::super::soak::Turn;
    use super::*;

    #[test]
    fn session_figures_count_turns_from_the_second() {
        let t = |turn, prompt, cached, ttft_ms| Turn {
            turn,
            prompt_tokens: prompt,
            cached_tokens: cached,
            ttft_ms,
            ..Default::default()
        };
        let s = Session {
            key: "soak-3".into(),
            turns: vec![t(1, 100, 0, 50.0), t(2, 200, 99, 10.0), t(3, 300, 150, 30.0)],
            ..Default::default()
        };
        // (99 + 150) / (100 + 200); the smallest is 150 / 200.
        assert!((s.cached_fraction().unwrap() - 0.83).abs() < 1e-9);
        assert_eq!(s.min_cached_fraction(), Some(0.75));
        assert_eq!(s.follow_up_ttft_ms(), Some((20.0, 30.0)));
        let v = s.summary();
        assert_eq!(
            (v["session"].as_str(), v["turns"].as_u64(), v["final_context"].as_u64()),
            (Some("soak-3"), Some(3), Some(300))
        );
        assert_eq!(v["first_turn_ttft_ms"], 50.0);
        let one = Session { turns: vec![t(1, 100, 0, 5.0)], ..Default::default() };
        assert_eq!((one.cached_fraction(), one.follow_up_ttft_ms()), (None, None));
    }

    #[test]
    fn a_replica_whose_arena_grew_fails_the_run() {
        let m = |allocations, prompt| MetricsSample {
            allocations,
            high_water: 10,
            kv_pages_used: None,
            steps: None,
            step_seconds: None,
            prompt_tokens: Some(prompt),
            cached_tokens: Some(prompt / 2),
        };
        let targets =
            [Target::parse("http://127.0.0.1:8101").unwrap(), Target::parse("http://127.0.0.1:8102").unwrap()];
        let mut failures = Vec::new();
        let r = Replica::compare(&targets, vec![m(3, 100), m(3, 0)], vec![m(3, 500), m(4, 40)], &mut failures);
        assert_eq!(failures.len(), 1, "{failures:?}");
        assert!(failures[0].contains("127.0.0.1:8102") && failures[0].contains("allocations 3 → 4"), "{failures:?}");
        assert_eq!(r[0].to_json()["prompt_tokens"], 400);
        assert_eq!(r[0].to_json()["cached_tokens"], 200);
    }
}
