//! `deltaserve soak` end to end: a short session against the in-process demo server (JSON shape,
//! prefix-cache accounting, no arena growth), and a clean failure when nothing listens at --url.

mod common;

use serde_json::Value;

use common::{report_json, subcommand};
#[test]
fn in_process_demo_session_restores_the_context_and_does_not_allocate() {
    let svg = std::env::temp_dir().join(format!("ds-soak-{}.svg", std::process::id()));
    let svg_arg = svg.to_str().unwrap();
    let args = ["--turns", "6", "--target-context", "1500", "--follow-ups", "2", "--follow-up-tokens", "20"];
    let v = report_json("soak", &[&args[..], &["--json", "--svg", svg_arg]].concat());

    let s = &v["summary"];
    assert_eq!(s["ok"], true, "{v:#}");
    assert_eq!(s["failures"].as_array().map(Vec::len), Some(0), "{v:#}");
    assert_eq!(s["turns"], 8, "6 turns and 2 short follow-ups");
    let turns = v["turns"].as_array().expect("turns is a list");
    assert_eq!(turns.len(), 8);
    // The short follow-ups: a few new tokens each (the message, the reply before it, the template's
    // wrapping), in one prefill step on the whole conversation.
    assert_eq!(s["short_follow_ups"], 2, "{s:#}");
    assert!(s["short_follow_up_max_new_tokens"].as_u64().unwrap() <= 64, "{s:#}");
    assert_eq!(s["short_follow_up_max_prefill_steps"], 1, "{s:#}");
    assert!(s["short_follow_up_max_ttft_ms"].as_f64().unwrap() > 0.0, "{s:#}");
    assert!(turns[..6].iter().all(|t| t["kind"] != "short") && turns[6..].iter().all(|t| t["kind"] == "short"));
    let final_context = s["final_context"].as_u64().unwrap();
    assert!((1000..=2000).contains(&final_context), "the context should grow to about 1500: {final_context}");
    assert!(s["min_cached_fraction_of_previous_context"].as_f64().unwrap() >= 0.95, "{s:#}");
    assert!(s["ttft_ratio_last_vs_turn2_per_new_token"].as_f64().unwrap() > 0.0, "{s:#}");
    let one_step = s["follow_up_turns_in_one_prefill_step"].as_array().expect("the server sends timings");
    assert_eq!(one_step[1], 7, "{s:#}");
    assert!(s["max_follow_up_ttft_over_prefill_compute"].as_f64().unwrap() >= 1.0, "{s:#}");

    let u = |t: &Value, k: &str| t[k].as_u64().unwrap_or_else(|| panic!("turn field {k} is not a count: {t}"));
    let f = |t: &Value, k: &str| t[k].as_f64().unwrap_or_else(|| panic!("turn field {k} is not a number: {t}"));
    for (i, t) in turns.iter().enumerate() {
        assert_eq!(u(t, "turn"), i as u64 + 1);
        let (prompt, cached, new) = (u(t, "prompt_tokens"), u(t, "cached_tokens"), u(t, "new_tokens"));
        assert_eq!(new, prompt - cached, "{t}");
        assert!(cached < prompt, "at most prompt_tokens - 1 can be cached: {t}");
        let (ttft, per_new, total) = (f(t, "ttft_ms"), f(t, "ttft_per_new_token_ms"), f(t, "total_ms"));
        assert!(ttft > 0.0 && ttft <= total + 1e-6, "{t}");
        assert!((per_new - ttft / new as f64).abs() < 1e-2, "{t}");
        // No arena growth: every turn reports what turn 1 reported.
        assert_eq!(t["arena_allocations"], turns[0]["arena_allocations"], "{t}");
        assert_eq!(t["arena_high_water_bytes"], turns[0]["arena_high_water_bytes"], "{t}");
        assert!(u(t, "arena_allocations") > 0 && u(t, "arena_high_water_bytes") > 0, "{t}");
        assert!(u(t, "host_rss_bytes") > 0, "in-process: the host RSS is reported: {t}");
        // The engine's steps during the turn: at least one to prefill and one per further token (the
        // soak reads /metrics between turns, nothing else runs). Their time is not compared with the
        // turn's: the last step finishes its bookkeeping after the client has read the final token.
        let (steps, step_ms) = (u(t, "steps"), f(t, "step_ms"));
        assert!(steps >= u(t, "completion_tokens").max(1), "{t}");
        assert!(step_ms > 0.0, "{t}");
        // The server's timings: the steps that ran the prompt are among the turn's, within its TTFT.
        let (prefill_steps, prefill_ms) = (u(t, "prefill_steps"), f(t, "prefill_compute_ms"));
        assert!(prefill_steps >= 1 && prefill_steps <= steps, "{t}");
        assert!(prefill_ms > 0.0 && prefill_ms <= ttft + 1e-6, "{t}");
        assert!((0.0..1.0).contains(&f(t, "ttft_outside_compute_fraction")), "{t}");
        if i > 0 {
            let prev = u(&turns[i - 1], "prompt_tokens");
            assert!(prompt > prev, "the context grows every turn: {t}");
            assert!(cached as f64 >= 0.95 * prev as f64, "turn {} restored {cached} of {prev}: {t}", i + 1);
        } else {
            assert_eq!(cached, 0, "nothing is cached before the first turn: {t}");
        }
    }
    let chart = std::fs::read_to_string(&svg).expect("the SVG was written");
    let _ = std::fs::remove_file(&svg);
    assert!(chart.starts_with("<svg") && chart.trim_end().ends_with("</svg>"));
    assert_eq!(chart.matches("<title>turn ").count(), 8 * 3, "one TTFT bar and a cached + a new bar per turn");
}

#[test]
fn nothing_listening_is_a_clean_error() {
    let out = subcommand("soak", &["--url", "http://127.0.0.1:1", "--turns", "2", "--target-context", "500"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "expected failure; stderr: {stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(stderr.contains("error: soak failed"), "{stderr}");
    assert!(stderr.contains("cannot connect to 127.0.0.1:1"), "{stderr}");

    // With --json the report is still one JSON object, with the reason.
    let out = subcommand("soak", &["--url", "http://127.0.0.1:1", "--turns", "2", "--target-context", "500", "--json"]);
    assert!(!out.status.success());
    let v: Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    assert_eq!(v["summary"]["ok"], false);
    assert_eq!(v["turns"].as_array().map(Vec::len), Some(0));
    let failures = v["summary"]["failures"].as_array().unwrap();
    assert!(failures.iter().any(|f| f.as_str().unwrap().contains("cannot connect")), "{v:#}");
}

#[test]
fn bad_arguments_are_clean_errors() {
    for (args, needle) in [
        (&["--url", "https://127.0.0.1:1", "--turns", "2", "--target-context", "500"][..], "https is not supported"),
        (&["--url", "http://127.0.0.1:1", "--turns", "0", "--target-context", "500"][..], "--turns must be at least 1"),
    ] {
        let out = subcommand("soak", args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && !stderr.contains("panicked"), "{args:?}: {stderr}");
        assert!(stderr.contains(needle), "{args:?}: {stderr}");
    }
}

#[test]
fn screenshots_in_the_history_are_restored_from_the_prefix_cache() {
    let v = report_json("soak", &["--turns", "6", "--target-context", "2000", "--screenshot", "256x256", "--json"]);
    let s = &v["summary"];
    assert_eq!(s["ok"], true, "{v:#}");
    // 256x256 is the smallest image the processor takes as it is: 16 × 16 patches, 64 tokens.
    assert_eq!((s["screenshot"].as_str(), s["tokens_per_screenshot"].as_u64()), (Some("256x256"), Some(64)), "{s:#}");
    let turns = v["turns"].as_array().unwrap();
    assert_eq!(turns.len(), 6);
    let u = |t: &Value, k: &str| t[k].as_u64().unwrap_or_else(|| panic!("turn field {k} is not a count: {t}"));
    for (i, t) in turns.iter().enumerate() {
        let n = i as u64 + 1;
        assert_eq!((u(t, "images"), u(t, "image_tokens")), (n, 64 * n), "one screenshot more every turn: {t}");
        if i == 0 {
            assert!(t["cached_fraction_of_previous_context"].is_null(), "{t}");
            continue;
        }
        let prev = u(&turns[i - 1], "prompt_tokens");
        let fraction = t["cached_fraction_of_previous_context"].as_f64().unwrap();
        assert!(u(t, "prompt_tokens") > prev + 64, "the context grows by the screenshot and more: {t}");
        assert!(fraction >= 0.95, "turn {n} restored {} of {prev}: {t}", u(t, "cached_tokens"));
        assert!((fraction - u(t, "cached_tokens") as f64 / prev as f64).abs() < 1e-3, "{t}");
    }
}

#[test]
fn screenshots_the_server_cannot_take_are_a_clean_error() {
    for (args, needle) in
        [(&["--turns", "2", "--no-vision"][..], "loads no vision tower"), (&["--turns", "33"][..], "33 images")]
    {
        let mut all = vec!["--target-context", "1500", "--screenshot", "256x256"];
        all.extend(args);
        let out = subcommand("soak", &all);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && !stderr.contains("panicked"), "{args:?}: {stderr}");
        assert!(stderr.contains("--screenshot: ") && stderr.contains(needle), "{args:?}: {stderr}");
    }
}

#[test]
fn speculative_decoding_reports_each_turns_drafts() {
    let v = report_json(
        "soak",
        &["--turns", "2", "--target-context", "600", "--max-tokens", "12", "--speculative-tokens", "2", "--json"],
    );
    assert_eq!(v["summary"]["ok"], true, "{v:#}");
    let rate = v["summary"]["draft_acceptance_rate"].as_f64().expect("an acceptance rate");
    assert!((0.0..=1.0).contains(&rate), "{rate}");
    for t in v["turns"].as_array().unwrap() {
        let (drafted, accepted) = (t["draft_tokens"].as_u64().unwrap(), t["accepted_draft_tokens"].as_u64().unwrap());
        assert!(drafted > 0 && accepted <= drafted, "{t}");
    }
}
