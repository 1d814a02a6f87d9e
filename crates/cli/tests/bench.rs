//! `deltaserve bench --device cpu --constrained` on the built-in demo model: the engine runs replies
//! under a JSON schema and unconstrained ones at each batch and context, and the report carries both
//! step times, their ratio and the grammar check (no timing is asserted).

mod common;

use common::{report_json, subcommand};

#[test]
fn constrained_decode_runs_on_the_cpu_and_reports_both_steps() {
    let v = report_json(
        "bench",
        &["--device", "cpu", "--constrained", "--batches", "1,2", "--contexts", "40", "--steps", "4", "--json"],
    );
    assert!(v["ceilings"].is_null(), "no GPU ceilings on the CPU: {v:#}");
    assert_eq!(v["constrained_schema"]["type"], "object");
    let rows = v["constrained"].as_array().expect("a `constrained` array");
    assert_eq!(rows.len(), 2, "{v:#}");
    for (r, batch) in rows.iter().zip([1, 2]) {
        assert_eq!(r["batch"], batch, "{r}");
        assert_eq!(r["context"], 40, "{r}");
        let f = |k: &str| r[k].as_f64().unwrap_or_else(|| panic!("{k} is not a number: {r}"));
        for k in ["ms_per_step_constrained", "ms_per_step_unconstrained", "ratio_to_unconstrained"] {
            assert!(f(k) > 0.0, "{k}: {r}");
        }
        assert!(f("host_mask_ms_per_row") > 0.0, "the masks were computed and timed: {r}");
        for k in ["steps_ahead_share_constrained", "steps_ahead_share_unconstrained"] {
            assert!((0.0..=1.0).contains(&f(k)), "{k}: {r}");
        }
        assert_eq!(r["tokens_outside_schema"], 0, "{r}");
        assert!(r["json_objects"].as_u64().is_some(), "{r}");
    }

    // The CPU's only measurement is asked for by name.
    let out = subcommand("bench", &["--device", "cpu", "--batches", "1"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains("--constrained") && !stderr.contains("panicked"), "{stderr}");
}
