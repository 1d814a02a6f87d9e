//! `deltaserve plan` as issue #6 runs it (no GPU needed).

use std::process::Command;

fn plan_json(args: &[&str]) -> serde_json::Value {
    let out = Command::new(env!("CARGO_BIN_EXE_deltaserve")).arg("plan").args(args).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn qwen36_27b_in_24gib_with_int4_and_fp8_fills_262144() {
    let j = plan_json(&[
        "--preset",
        "qwen3.6-27b",
        "--memory",
        "24GiB",
        "--weights-dtype",
        "int4",
        "--kv-cache-dtype",
        "fp8",
        "--json",
    ]);
    assert!(j["max_context"].as_u64().unwrap() >= 262_144, "{j}");
    assert!(j["total_bytes"].as_u64().unwrap() <= 24 << 30, "{j}");
    assert_eq!(j["fit"]["reached"], true);
    assert_eq!(j["fit"]["target_context"], 262_144);
}

#[test]
fn no_fit_plans_the_settings_as_given() {
    let j = plan_json(&[
        "--preset",
        "qwen3.6-27b",
        "--memory",
        "24GiB",
        "--weights-dtype",
        "int4",
        "--kv-cache-dtype",
        "fp8",
        "--no-fit",
        "--json",
    ]);
    let mc = j["max_context"].as_u64().unwrap();
    assert!(mc < 262_144 && mc > 60_000, "{j}");
    assert_eq!(j["fit"]["reached"], false);
    assert_eq!(j["fit"]["adjustments"].as_array().unwrap().len(), 0);
}
