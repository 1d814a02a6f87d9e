//! Running the `deltaserve` binary in the CLI's tests: the command, its JSON reports, its clean errors
//! and scratch directories.
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::{Command, Output};

use serde_json::Value;

/// The `deltaserve` binary, logging warnings only.
pub fn deltaserve() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_deltaserve"));
    c.env("RUST_LOG", "warn");
    c
}

/// Runs `deltaserve ARGS` (logging warnings only).
pub fn run(args: &[&str]) -> Output {
    deltaserve().args(args).output().expect("run deltaserve")
}

/// Runs `deltaserve SUBCOMMAND ARGS` (logging warnings only).
pub fn subcommand(name: &str, args: &[&str]) -> Output {
    deltaserve().arg(name).args(args).output().unwrap_or_else(|e| panic!("run deltaserve {name}: {e}"))
}

/// Runs `deltaserve SUBCOMMAND ARGS` (which ask for `--json`) and returns its JSON report, after
/// checking that it succeeded without a panic.
pub fn report_json(name: &str, args: &[&str]) -> Value {
    let out = subcommand(name, args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
    let v: Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("stdout is not one JSON object ({e}): {}", String::from_utf8_lossy(&out.stdout)));
    assert!(out.status.success(), "{name} failed: {stderr}\n{v:#}");
    v
}

/// Runs `deltaserve plan ARGS`.
pub fn plan(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_deltaserve")).arg("plan").args(args).output().unwrap()
}

/// The JSON of `deltaserve plan ARGS` (which ask for `--json`), after checking that it succeeded.
pub fn plan_json(args: &[&str]) -> Value {
    let out = plan(args);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

/// Asserts a clean failure: non-zero exit, every needle in stderr, no panic.
pub fn assert_clean_error(out: &Output, needles: &[&str]) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "expected failure, got success; stderr: {stderr}");
    assert!(!stderr.contains("panicked"), "panicked: {stderr}");
    for n in needles {
        assert!(stderr.contains(n), "stderr should mention `{n}`: {stderr}");
    }
}

/// A fresh, empty directory `ds-{kind}-{pid}-{tag}` in the system's temporary directory.
pub fn tempdir(kind: &str, tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("ds-{kind}-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}
