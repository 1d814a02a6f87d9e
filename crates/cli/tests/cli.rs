//! The `deltaserve` binary end to end: synth → generate/logits, the logits contract against an HF
//! `save_pretrained` directory, and bad inputs (clear error, non-zero exit, never a panic).

mod common;

use std::path::{Path, PathBuf};
use std::process::Output;

use common::{assert_clean_error, deltaserve, run, tempdir};

fn synth_tiny(tag: &str) -> PathBuf {
    let dir = tempdir("cli", tag);
    let out = run(&["synth", "--preset", "tiny", "--out", dir.to_str().unwrap(), "--seed", "5"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    dir
}

#[test]
fn synth_then_generate_json_is_deterministic() {
    let dir = synth_tiny("gen");
    let args = [
        "generate",
        "--model",
        dir.to_str().unwrap(),
        "--prompt",
        "Hello, world",
        "--chat",
        "--max-tokens",
        "12",
        "--temperature",
        "0",
        "--json",
        "--ignore-eos",
    ];
    let a = run(&args);
    assert!(a.status.success(), "{}", String::from_utf8_lossy(&a.stderr));
    let v: serde_json::Value = serde_json::from_slice(&a.stdout).unwrap();
    assert_eq!(v["token_ids"].as_array().unwrap().len(), 12);
    assert!(v["text"].is_string());
    let again: serde_json::Value = serde_json::from_slice(&run(&args).stdout).unwrap();
    assert_eq!(
        (&again["token_ids"], &again["text"]),
        (&v["token_ids"], &v["text"]),
        "greedy generation must be deterministic"
    );
    // seeded sampling reproduces with the same seed
    let seeded = |seed: &str| {
        let out = run(&[
            "generate",
            "--model",
            dir.to_str().unwrap(),
            "--tokens",
            "1,2,3",
            "--max-tokens",
            "16",
            "--temperature",
            "1",
            "--seed",
            seed,
            "--json",
            "--ignore-eos",
        ]);
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()["token_ids"].clone()
    };
    assert_eq!(seeded("9"), seeded("9"));
    assert_ne!(seeded("9"), seeded("10"));
}

#[test]
fn logits_of_an_hf_saved_model_match_hf() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/hf/qwen35_gva3");
    let reference: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(root.join("reference.json")).unwrap()).unwrap();
    let prompt = reference["prompts"].as_array().unwrap().iter().find(|p| p["len"] == 37).unwrap();
    let dir = tempdir("cli", "logits");
    let ids_path = dir.join("ids.json");
    std::fs::write(&ids_path, prompt["ids"].to_string()).unwrap();
    let out_path = dir.join("out.safetensors");
    let out = run(&[
        "logits",
        "--model",
        root.to_str().unwrap(),
        "--tokens",
        &format!("@{}", ids_path.display()),
        "--output",
        out_path.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let read = |file: &Path, name: &str| -> Vec<f32> {
        let ck = deltaserve_model::Checkpoint::open_file(file).unwrap();
        ck.get(name).unwrap().to_f32().unwrap()
    };
    let ours = read(&out_path, "logits");
    let theirs = read(&root.join("reference.safetensors"), "logits_37");
    assert_eq!(ours.len(), 37 * 512);
    let scale = theirs.iter().fold(0f32, |m, v| m.max(v.abs()));
    let worst = ours.iter().zip(&theirs).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(worst / scale < 1e-3, "max rel err {}", worst / scale);
}

/// `synth --fp8` writes a block-FP8 checkpoint that the CPU backend runs: its logits are the bf16
/// model's up to the e4m3 rounding of the weights (about 2.6 % of each linear, about 11 % of these
/// random-weight logits; far from the whole scale a wrong dequantisation gives). It cannot be combined
/// with `--gptq`.
#[test]
fn synth_fp8_runs_on_the_cpu_close_to_bf16() {
    let bf16 = synth_tiny("fp8-base");
    let dir = tempdir("cli", "fp8");
    let out = run(&["synth", "--preset", "tiny", "--out", dir.to_str().unwrap(), "--seed", "5", "--fp8"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["quantization_config"]["quant_method"], "fp8");
    assert_eq!(config["quantization_config"]["weight_block_size"], serde_json::json!([128, 128]));
    let logits = |model: &Path| {
        let path = model.join("logits.safetensors");
        let out = run(&[
            "logits",
            "--model",
            model.to_str().unwrap(),
            "--tokens",
            "1,2,3,4,5,6,7,8",
            "--output",
            path.to_str().unwrap(),
        ]);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        deltaserve_model::Checkpoint::open_file(&path).unwrap().get("logits").unwrap().to_f32().unwrap()
    };
    let (want, got) = (logits(&bf16), logits(&dir));
    let num: f32 = want.iter().zip(&got).map(|(a, b)| (a - b) * (a - b)).sum();
    let den: f32 = want.iter().map(|a| a * a).sum();
    let rel = (num / den).sqrt();
    assert!(rel > 1e-3 && rel < 0.3, "relative RMS difference of the logits: {rel}");
    let out = run(&["synth", "--preset", "tiny", "--out", dir.to_str().unwrap(), "--fp8", "--gptq", "sym"]);
    assert_clean_error(&out, &["--fp8", "--gptq"]);
}

#[test]
fn truncated_safetensors_is_a_clean_error() {
    let dir = synth_tiny("trunc");
    let f = std::fs::OpenOptions::new().write(true).open(dir.join("model.safetensors")).unwrap();
    f.set_len(f.metadata().unwrap().len() / 2).unwrap();
    let out = run(&["logits", "--model", dir.to_str().unwrap(), "--tokens", "1,2", "--output", "/dev/null"]);
    assert_clean_error(&out, &["error:", "model.safetensors"]);
}

#[test]
fn wrong_shaped_tensor_is_a_clean_error() {
    let dir = synth_tiny("shape");
    // Shrink the model's hidden size in config.json: every tensor now has the wrong shape.
    let path = dir.join("config.json");
    let mut cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    cfg["text_config"]["intermediate_size"] = serde_json::json!(200);
    std::fs::write(&path, cfg.to_string()).unwrap();
    let out = run(&["generate", "--model", dir.to_str().unwrap(), "--tokens", "1", "--max-tokens", "1"]);
    assert_clean_error(&out, &["mlp.gate_proj.weight", "[256, 128]", "[200, 128]"]);
}

#[test]
fn config_missing_a_field_is_a_clean_error() {
    let dir = synth_tiny("field");
    let path = dir.join("config.json");
    let mut cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    cfg["text_config"].as_object_mut().unwrap().remove("linear_key_head_dim");
    std::fs::write(&path, cfg.to_string()).unwrap();
    let out = run(&["generate", "--model", dir.to_str().unwrap(), "--tokens", "1"]);
    assert_clean_error(&out, &["text_config.linear_key_head_dim", "config.json"]);
}

#[test]
fn token_outside_the_vocabulary_is_a_clean_error() {
    let dir = synth_tiny("vocab");
    let out = run(&["logits", "--model", dir.to_str().unwrap(), "--tokens", "1,5000", "--output", "/dev/null"]);
    assert_clean_error(&out, &["5000", "outside the vocabulary"]);
    let out = run(&["generate", "--model", dir.to_str().unwrap(), "--tokens", "1,x"]);
    assert_clean_error(&out, &["`x`"]);
    let out = run(&["generate", "--model", "/nonexistent/model", "--tokens", "1"]);
    assert_clean_error(&out, &["does not exist"]);
}

/// The one `error:` line of a failed run: non-zero exit, no panic, the error the last line of stderr.
fn error_line(out: &Output) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && out.status.code() == Some(1), "want exit code 1: {:?}\n{stderr}", out.status);
    assert!(!stderr.contains("panicked"), "panicked: {stderr}");
    let last = stderr.lines().last().unwrap_or_default();
    assert!(last.starts_with("error: "), "the error is not the last line: {stderr}");
    assert_eq!(stderr.matches("error: ").count(), 1, "{stderr}");
    last.to_string()
}

/// A model directory whose weights cannot be read (garbage safetensors): an error that names anything
/// but the weights proves it was found before a weight was read.
fn unreadable_weights(tag: &str) -> PathBuf {
    let dir = synth_tiny(tag);
    std::fs::write(dir.join("model.safetensors"), b"not a safetensors file").unwrap();
    dir
}

#[test]
fn serve_checks_everything_before_reading_weights() {
    let dir = unreadable_weights("precheck");
    let model = dir.to_str().unwrap();
    let serve = |port: &str, extra: &[&str]| {
        let mut args = vec!["serve", model, "--port", port];
        args.extend_from_slice(extra);
        error_line(&run(&args))
    };
    // The port in use.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port().to_string();
    let e = serve(&port, &[]);
    assert!(e.contains(&format!("port {port} is in use")), "{e}");
    // A host that is not this machine's.
    let e = serve("0", &["--host", "192.0.2.1"]);
    assert!(e.contains("192.0.2.1") && e.contains("not an address of this machine"), "{e}");
    // More memory than the host has (the CPU backend's plan).
    let e = serve("0", &["--memory", "100000GiB"]);
    assert!(e.contains("host memory") && e.contains("available") && e.contains("lower --memory"), "{e}");
    // Everything checked passes: only now are the weights read.
    let e = serve("0", &[]);
    assert!(e.contains("model.safetensors"), "{e}");
    // No tokenizer.
    std::fs::remove_file(dir.join("tokenizer.json")).unwrap();
    let e = serve("0", &[]);
    assert!(e.contains("tokenizer.json") && !e.contains("safetensors"), "{e}");
}

#[test]
fn os_errors_are_printed_once_and_logs_are_plain_text() {
    let dir = tempdir("cli", "noconfig");
    let out = deltaserve()
        .env("RUST_LOG", "info")
        .args(["generate", "--model", dir.to_str().unwrap(), "--tokens", "1"])
        .output();
    let out = out.unwrap();
    let e = error_line(&out);
    assert!(e.contains("config.json") && e.matches("os error 2").count() == 1, "{e}");
    // stderr is not a terminal here: no colour codes in the log lines.
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains(" INFO ") && !stderr.contains('\u{1b}'), "{stderr}");
}
