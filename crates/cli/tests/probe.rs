//! `deltaserve probe` end to end on the in-process demo model: every rung fills exactly its share of the
//! advertised context, the conversation reaches 100% through the prefix cache, and bad input is a clean error.

mod common;

use serde_json::Value;

use common::{report_json, subcommand};
#[test]
fn fills_the_demo_context_in_one_prompt_and_over_turns() {
    let svg = std::env::temp_dir().join(format!("ds-probe-{}.svg", std::process::id()));
    let v = report_json(
        "probe",
        &[
            "--max-context",
            "2048",
            "--rungs",
            "25,92,100",
            "--turns",
            "4",
            "--max-tokens",
            "4",
            "--json",
            "--svg",
            svg.to_str().unwrap(),
        ],
    );
    assert_eq!(v["passed"], true, "{v:#}");
    assert_eq!(v["max_context"], 2048);
    // The demo model has random weights: no needle check unless asked.
    assert_eq!(v["needle_checked"], false);

    let u = |t: &Value, k: &str| t[k].as_u64().unwrap_or_else(|| panic!("{k} is not a count: {t}"));
    let rungs = v["rungs"].as_array().unwrap();
    assert_eq!(rungs.len(), 3);
    for (r, pct) in rungs.iter().zip([25.0, 92.0, 100.0]) {
        let want = (2048.0 * pct / 100.0) as u64 - 4;
        let prompt = u(r, "prompt_tokens");
        // Fitted to within the probe's slack below the target, never above it.
        assert!(prompt <= want && prompt + 16 >= want, "rung {pct}: {prompt} tokens for {want}: {r}");
        assert_eq!(u(r, "cached_tokens"), 0, "each rung is a fresh prefill: {r}");
        assert_eq!(u(r, "completion_tokens"), 4, "ignore_eos: {r}");
    }
    let turns = v["turns"].as_array().unwrap();
    assert_eq!(turns.len(), 4);
    let last = turns.last().unwrap();
    assert!(u(last, "prompt_tokens") + 4 + 16 >= 2048 && u(last, "prompt_tokens") + 4 <= 2048, "{last}");
    for w in turns.windows(2) {
        assert!(u(&w[1], "cached_tokens") as f64 >= 0.95 * u(&w[0], "prompt_tokens") as f64, "{w:?}");
    }
    let svg = std::fs::read_to_string(&svg).unwrap();
    assert!(svg.starts_with("<svg") && svg.contains("turn 4"), "{svg}");
}

#[test]
fn bad_rungs_are_a_clean_error() {
    let out = subcommand("probe", &["--rungs", "0,50"]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("--rungs") && !stderr.contains("panicked"), "{stderr}");
}

#[test]
fn nothing_listening_is_a_clean_error() {
    let out = subcommand("probe", &["--url", "http://127.0.0.1:9", "--rungs", "50", "--turns", "0"]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("cannot connect") && !stderr.contains("panicked"), "{stderr}");
}

#[test]
fn on_the_cpu_the_default_ladder_is_capped() {
    let out = subcommand("probe", &["--device", "cpu", "--rungs", "5", "--turns", "0", "--max-tokens", "1", "--json"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["max_context"], 8192, "{v:#}");
    assert!(v["advertised_context"].as_u64().unwrap() > 8192, "{v:#}");
    let prompt = v["rungs"][0]["prompt_tokens"].as_u64().unwrap();
    assert!(prompt <= 409 && prompt + 16 >= 409, "5% of 8192: {prompt}");
}

#[test]
fn prompts_with_images_still_fill_their_rungs_and_turns() {
    let svg = std::env::temp_dir().join(format!("ds-probe-images-{}.svg", std::process::id()));
    let v = report_json(
        "probe",
        &[
            "--max-context",
            "2048",
            "--rungs",
            "50,100",
            "--turns",
            "3",
            "--max-tokens",
            "4",
            "--images",
            "2",
            "--image-size",
            "320x200",
            "--json",
            "--svg",
            svg.to_str().unwrap(),
        ],
    );
    assert_eq!(v["passed"], true, "{v:#}");
    // 320x200 resizes to 352x224 (multiples of 32, at least 65,536 pixels): 22 × 14 patches, 77 tokens.
    assert_eq!((v["images_per_prompt"].as_u64(), v["image_size"].as_str()), (Some(2), Some("320x200")), "{v:#}");
    assert_eq!(v["tokens_per_image"], 77, "{v:#}");

    let u = |t: &Value, k: &str| t[k].as_u64().unwrap_or_else(|| panic!("{k} is not a count: {t}"));
    for (r, pct) in v["rungs"].as_array().unwrap().iter().zip([50.0, 100.0]) {
        let want = (2048.0 * pct / 100.0) as u64 - 4;
        let prompt = u(r, "prompt_tokens");
        // Text + image tokens fitted to the rung's target as text alone is.
        assert!(prompt <= want && prompt + 16 >= want, "rung {pct}: {prompt} tokens for {want}: {r}");
        assert_eq!((u(r, "images"), u(r, "image_tokens")), (2, 154), "{r}");
        assert_eq!(u(r, "cached_tokens"), 0, "each rung's images are its own: {r}");
    }
    let turns = v["turns"].as_array().unwrap();
    assert_eq!(turns.len(), 3);
    for (t, turn) in turns.iter().enumerate() {
        let n = 2 * (t as u64 + 1);
        assert_eq!((u(turn, "images"), u(turn, "image_tokens")), (n, 77 * n), "earlier turns' images stay: {turn}");
    }
    let last = turns.last().unwrap();
    assert!(u(last, "prompt_tokens") + 4 + 16 >= 2048 && u(last, "prompt_tokens") + 4 <= 2048, "{last}");
    for w in turns.windows(2) {
        assert!(u(&w[1], "cached_tokens") as f64 >= 0.95 * u(&w[0], "prompt_tokens") as f64, "{w:?}");
    }
    let chart = std::fs::read_to_string(&svg).unwrap();
    let _ = std::fs::remove_file(&svg);
    assert!(chart.contains("2 images of 320x200") && chart.contains(">462 img<"), "{chart}");
}

#[test]
fn images_the_server_cannot_take_are_a_clean_error() {
    for (args, needle) in [
        (&["--no-vision"][..], "loads no vision tower"),
        (&["--max-image-tokens-per-step", "256"][..], "308 patches"),
        (&["--turns", "17"][..], "34 images"),
    ] {
        let mut all = vec!["--max-context", "2048", "--rungs", "50", "--images", "2", "--image-size", "320x200"];
        all.extend(args);
        let out = subcommand("probe", &all);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && !stderr.contains("panicked"), "{args:?}: {stderr}");
        assert!(stderr.contains("--images: ") && stderr.contains(needle), "{args:?}: {stderr}");
    }
}
