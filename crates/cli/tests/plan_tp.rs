//! `deltaserve plan --tensor-parallel N`: the plan is per card (no GPU needed).

mod common;

use std::process::Command;

use common::{plan, plan_json};

#[test]
fn tensor_parallel_plans_one_card() {
    let base = ["--preset", "qwen3.6-27b", "--memory", "24GiB", "--weights-dtype", "int4", "--json"];
    let one = plan_json(&base);
    let two = plan_json(&[&base[..], &["--tensor-parallel", "2"]].concat());
    assert_eq!(two["tensor_parallel"], 2);
    assert_eq!(two["scope"], "per card, TP=2");
    let half = |k: &str| (one[k].as_u64().unwrap(), two[k].as_u64().unwrap());
    let (kv1, kv2) = half("kv_bytes_per_token");
    assert_eq!(kv1, 2 * kv2);
    let (s1, s2) = half("state_bytes_per_seq");
    assert_eq!(s1, 2 * s2);
    assert_eq!(two["max_context"], 262_144);
    // The weights of the same settings (the fit trades differently on one card and on two; the GPU
    // vision tower runs on one card only).
    let untraded = |tp: &str| plan_json(&[&base[..], &["--tensor-parallel", tp, "--no-fit", "--no-vision"]].concat());
    let (w1, w2) = (untraded("1")["weights_bytes"].as_u64().unwrap(), untraded("2")["weights_bytes"].as_u64().unwrap());
    assert!(w2 < w1 / 2 + (64 << 20), "{w2} vs {w1}");

    let out =
        plan(&["--preset", "qwen3.6-27b", "--memory", "24GiB", "--weights-dtype", "int4", "--tensor-parallel", "2"]);
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && table.contains("per card, TP=2"), "{table}");
}

#[test]
fn tensor_parallel_that_splits_a_head_group_is_an_error() {
    let out = plan(&["--preset", "qwen3.6-27b", "--tensor-parallel", "8"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--tensor-parallel 8") && err.contains("4 attention kv heads"), "{err}");
}

#[test]
fn serve_tensor_parallel_is_cuda_only_and_checks_the_gpus() {
    // cpu: the built-in demo model; cuda: the tiny preset with weights drawn on the GPU.
    let cpu: &[&str] = &["--device", "cpu"];
    let cuda: &[&str] = &["--device", "cuda", "--preset", "tiny", "--random-weights"];
    for (device, args) in [("cpu", cpu), ("cuda", cuda)] {
        let out = Command::new(env!("CARGO_BIN_EXE_deltaserve"))
            .arg("serve")
            .args(args)
            // More GPUs than any test machine has: refused before anything is loaded.
            .args(["--tensor-parallel", "64", "--port", "0"])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{device}: {err}");
        if device == "cpu" {
            assert!(err.contains("--tensor-parallel 64") && err.contains("--device cuda"), "{device}: {err}");
        } else if err.contains("--tensor-parallel") {
            // With a GPU: the size is checked (64 is not 1, 2, 4 or 8). Without one, device selection
            // or the GPU's memory query fails first, also an error.
            assert!(err.contains("must be 1, 2, 4 or 8"), "{device}: {err}");
        }
    }
}
