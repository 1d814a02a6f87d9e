//! `GET /v1/loads`: the load report a gateway polls for its load-aware routing, in the shape SGLang
//! serves and the Shepherd Model Gateway (`smg`) reads: one data-parallel rank with its running and
//! waiting requests, the tokens still to prefill for the waiting ones, and the KV-cache usage.

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use deltaserve_engine::EngineStats;
use serde_json::{Value, json};

use crate::state::AppState;

/// The report for `stats`, read now.
pub fn load_report(stats: &EngineStats) -> Value {
    let s = &stats.sched;
    let ratio = |used: usize, total: usize| if total == 0 { 0.0 } else { used as f64 / total as f64 };
    // KV pages in use, those the prefix cache keeps for later turns included (it gives them back
    // on demand).
    let token_usage = ratio(s.pages_in_use, s.pages_total);
    let cache_hit_rate =
        if stats.prompt_tokens == 0 { 0.0 } else { s.prefix.hit_tokens as f64 / stats.prompt_tokens as f64 };
    let timestamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| format!("{:.3}", d.as_secs_f64()))
        .unwrap_or_default();
    json!({
        "timestamp": timestamp,
        "dp_rank_count": 1,
        "loads": [{
            "dp_rank": 0,
            "num_running_reqs": s.running,
            "num_waiting_reqs": s.waiting,
            "num_waiting_uncached_tokens": s.waiting_tokens,
            "num_total_reqs": s.running + s.waiting,
            "num_used_tokens": s.pages_in_use * s.page_size,
            "max_total_num_tokens": s.pages_total * s.page_size,
            "token_usage": token_usage,
            "utilization": token_usage,
            "cache_hit_rate": cache_hit_rate,
            "max_running_requests": s.slots_total,
        }],
    })
}

pub async fn loads(State(st): State<AppState>) -> Response {
    axum::Json(load_report(&st.engine.stats())).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_report_reads_the_scheduler() {
        let mut stats = EngineStats { prompt_tokens: 400, ..Default::default() };
        let s = &mut stats.sched;
        (s.running, s.waiting, s.waiting_tokens) = (3, 2, 900);
        (s.pages_in_use, s.pages_total, s.page_size, s.slots_total) = (25, 100, 16, 8);
        s.prefix.hit_tokens = 100;
        let r = load_report(&stats);
        assert_eq!(r["dp_rank_count"], 1);
        let l = &r["loads"][0];
        assert_eq!(l["num_running_reqs"], 3);
        assert_eq!(l["num_waiting_reqs"], 2);
        assert_eq!(l["num_total_reqs"], 5);
        assert_eq!(l["num_waiting_uncached_tokens"], 900);
        assert_eq!(l["num_used_tokens"], 400);
        assert_eq!(l["max_total_num_tokens"], 1600);
        assert_eq!(l["token_usage"], 0.25);
        assert_eq!(l["cache_hit_rate"], 0.25);
        assert_eq!(l["max_running_requests"], 8);
        // An idle engine with nothing planned reports zeros, not NaN.
        let idle = load_report(&EngineStats::default());
        assert_eq!(idle["loads"][0]["token_usage"], 0.0);
        assert_eq!(idle["loads"][0]["cache_hit_rate"], 0.0);
    }
}
