//! `deltaserve plan` as a user with a 24 GB card runs it (no GPU needed).

mod common;

use std::process::Command;

use common::{plan, plan_json};

/// Qwen3.6-27B on a 24 GiB card with int4 weights and an fp8 KV cache.
const QWEN36_24GIB: [&str; 8] =
    ["--preset", "qwen3.6-27b", "--memory", "24GiB", "--weights-dtype", "int4", "--kv-cache-dtype", "fp8"];

#[test]
fn qwen36_27b_in_24gib_with_int4_and_fp8_fills_262144() {
    let j = plan_json(&[&QWEN36_24GIB[..], &["--json"]].concat());
    assert!(j["max_context"].as_u64().unwrap() >= 262_144, "{j}");
    assert!(j["total_bytes"].as_u64().unwrap() <= 24 << 30, "{j}");
    assert_eq!(j["fit"]["reached"], true);
    assert_eq!(j["fit"]["target_context"], 262_144);
}

/// The default configuration with MTP speculation (3 draft tokens) still fills the full context in 24 GiB:
/// the head's weights, KV, verify workspace and draft logits are priced and traded like the rest.
#[test]
fn qwen36_27b_in_24gib_with_mtp_fills_262144() {
    let plain = plan_json(&[&QWEN36_24GIB[..], &["--json"]].concat());
    let j = plan_json(&[&QWEN36_24GIB[..], &["--speculative-tokens", "3", "--json"]].concat());
    assert_eq!(j["fit"]["reached"], true, "{j}");
    assert!(j["max_context"].as_u64().unwrap() >= 262_144, "{j}");
    assert!(j["total_bytes"].as_u64().unwrap() <= 24 << 30, "{j}");
    let region = |j: &serde_json::Value, name: &str| {
        j["regions"].as_array().unwrap().iter().find(|r| r["name"] == name).map_or(0, |r| r["bytes"].as_u64().unwrap())
    };
    // The head's weights and the wider logits rows are in the plan.
    assert!(region(&j, "weights") > region(&plain, "weights"), "{j}");
    assert!(region(&j, "logits") > region(&plain, "logits"), "{j}");
}

/// `--state-dtype bf16` halves the DeltaNet recurrent state: with MTP on a 24 GiB card the full context
/// then takes twice the sequences per step (the fit trades fewer of them away); a format it does not
/// store is a clear error.
#[test]
fn bf16_state_in_24gib_with_mtp_serves_more_sequences() {
    let mtp = [&QWEN36_24GIB[..], &["--speculative-tokens", "3", "--json"]].concat();
    let f32s = plan_json(&mtp);
    let bf16s = plan_json(&[&mtp[..], &["--state-dtype", "bf16"]].concat());
    assert_eq!(bf16s["options"]["state_dtype"], "bf16");
    // The f32 plan, which traded sequences for the context, says what the bf16 state would keep.
    let note = f32s["fit"]["note"].as_str().unwrap_or_default();
    assert!(note.contains("--state-dtype bf16"), "{f32s}");
    assert!(bf16s["max_context"].as_u64().unwrap() >= 262_144, "{bf16s}");
    assert!(bf16s["total_bytes"].as_u64().unwrap() <= 24 << 30, "{bf16s}");
    let n = |j: &serde_json::Value, k: &str| j[k].as_u64().unwrap();
    // 48 layers × 48 value heads × 128 × 128 recurrent elements, 2 bytes fewer each.
    assert_eq!(n(&f32s, "state_bytes_per_seq") - n(&bf16s, "state_bytes_per_seq"), 48 * 48 * 128 * 128 * 2);
    assert!(n(&bf16s, "max_seqs") >= 2 * n(&f32s, "max_seqs"), "{} vs {}", n(&bf16s, "max_seqs"), n(&f32s, "max_seqs"));
    let out = plan(&["--preset", "tiny", "--state-dtype", "fp8"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("fp32, bf16"), "{err}");
}

#[test]
fn no_fit_plans_the_settings_as_given() {
    let j = plan_json(
        &[
            &QWEN36_24GIB[..],
            // (the vision tower alone would not leave room for a context: --no-fit does not trade it either)
            &["--no-fit", "--no-vision", "--json"],
        ]
        .concat(),
    );
    let mc = j["max_context"].as_u64().unwrap();
    assert!(mc < 262_144 && mc > 60_000, "{j}");
    assert_eq!(j["fit"]["reached"], false);
    assert_eq!(j["fit"]["adjustments"].as_array().unwrap().len(), 0);
}

/// `synth --no-weights` writes a preset's config, generation config and tokenizer files and no weights: a
/// directory that `plan --model` plans as the preset itself.
#[test]
fn synth_no_weights_plans_as_the_preset() {
    let dir = std::env::temp_dir().join(format!("ds-plan-no-weights-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let out = Command::new(env!("CARGO_BIN_EXE_deltaserve"))
        .args(["synth", "--preset", "qwen3.6-27b", "--no-weights", "--out"])
        .arg(&dir)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    for f in ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"] {
        assert!(dir.join(f).is_file(), "{f} missing");
    }
    let files: Vec<_> = std::fs::read_dir(&dir).unwrap().flatten().map(|e| e.file_name()).collect();
    assert_eq!(files.len(), 4, "{files:?}");
    let opts = ["--memory", "24GiB", "--weights-dtype", "int4", "--kv-cache-dtype", "fp8", "--json"];
    let from_dir = plan_json(&[&["--model", dir.to_str().unwrap()][..], &opts].concat());
    assert_eq!(from_dir, plan_json(&[&["--preset", "qwen3.6-27b"][..], &opts].concat()));
    let _ = std::fs::remove_dir_all(&dir);
}

/// A GPTQ checkpoint is planned as `serve --device cuda` loads it: int4 (asymmetric when the checkpoint
/// has zero points), with the linears it keeps bf16 priced in the backend scratch; asking for bf16
/// weights is a clear error.
#[test]
fn gptq_checkpoint_plans_int4_like_serve() {
    let dir = std::env::temp_dir().join(format!("ds-plan-gptq-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let out = Command::new(env!("CARGO_BIN_EXE_deltaserve"))
        .args(["synth", "--preset", "tiny", "--out"])
        .arg(&dir)
        .args(["--gptq", "asym-act-order"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let d = dir.to_str().unwrap();
    // (without the vision tower, whose own scratch needs would hide the difference checked below)
    let j = plan_json(&["--model", d, "--no-vision", "--json"]);
    assert_eq!(j["options"]["weights_dtype"], "int4", "{}", j["options"]);
    assert_eq!(j["options"]["int4_asym"], true);
    // A bf16 checkpoint of the same shape, planned int4, has no linears kept bf16: the GPTQ one's scratch is
    // larger by what it keeps dense (the tiny model's in_proj_a/b have 6 rows: left bf16, as real exports do).
    let plain = plan_json(&["--preset", "tiny", "--weights-dtype", "int4", "--int4-asym", "--no-vision", "--json"]);
    assert!(
        j["backend_scratch_bytes"].as_u64().unwrap() > plain["backend_scratch_bytes"].as_u64().unwrap(),
        "{} vs {}",
        j["backend_scratch_bytes"],
        plain["backend_scratch_bytes"]
    );
    let out = plan(&["--model", d, "--weights-dtype", "bf16"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("GPTQ-quantised"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The vision tower where the backend runs it (`--device cpu`): its weights and its workspace for
/// `--max-image-tokens-per-step` patches (default: one image at the preprocessor's pixel budget, 65,536
/// patches for Qwen3.5's), both shown; `--no-vision` prices none, and the table says so.
#[test]
fn cpu_plan_prices_the_vision_tower() {
    let base = ["--preset", "tiny", "--device", "cpu", "--memory", "2GiB"];
    let j = plan_json(&[&base[..], &["--json"]].concat());
    let vision = j["weights"]["vision_bytes"].as_u64().unwrap();
    let workspace = j["vision_workspace_bytes"].as_u64().unwrap();
    assert!(vision > 0 && workspace > 0, "{j}");
    assert_eq!(j["options"]["max_image_tokens_per_step"], 65_536);
    let small = plan_json(&[&base[..], &["--max-image-tokens-per-step", "1024", "--json"]].concat());
    // Linear in the patches: 1,024 take a 64th of 65,536's.
    assert_eq!(small["vision_workspace_bytes"].as_u64().unwrap() * 64, workspace);
    let none = plan_json(&[&base[..], &["--no-vision", "--json"]].concat());
    assert_eq!((none["weights"]["vision_bytes"].as_u64(), none["vision_workspace_bytes"].as_u64()), (Some(0), Some(0)));
    assert_eq!(j["weights_bytes"].as_u64().unwrap() - none["weights_bytes"].as_u64().unwrap(), vision);
    assert!(none["regions"].as_array().unwrap().iter().all(|r| r["name"] != "vision"));

    let table = |args: &[&str]| {
        let out = plan(args);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap()
    };
    let t = table(&base);
    assert!(t.contains("vision tower: weights") && t.contains("65,536 patches"), "{t}");
    assert!(t.lines().any(|l| l.starts_with("vision ")), "{t}");
    let t = table(&[&base[..], &["--no-vision"]].concat());
    assert!(t.contains("vision tower: not loaded"), "{t}");
}

/// On CUDA (one card) the GPU vision tower is priced where it fits beside the full context: its bf16
/// weights (Qwen3.6's 460,730,096 parameters, each tensor 256-byte aligned) and its `vision` region for the
/// patches of one image. `--no-vision` prices none; a budget whose full context needs the tower's memory
/// trades it (`--no-vision` among the fit's changes) unless `--max-image-tokens-per-step` asks for images.
#[test]
fn cuda_plan_prices_the_gpu_tower_where_it_fits() {
    let run = |extra: &[&str]| plan_json(&[&["--preset", "qwen3.6-27b", "--json"][..], extra].concat());
    let priced = |j: &serde_json::Value| {
        (j["weights"]["vision_bytes"].as_u64().unwrap(), j["vision_workspace_bytes"].as_u64().unwrap())
    };
    let on = run(&["--memory", "80GiB"]);
    assert_eq!(on["weights"]["vision_bytes"], 2 * 460_730_096 + 27 * 96, "{on}");
    assert!(on["vision_workspace_bytes"].as_u64().unwrap() > 0, "{on}");
    assert!(on["regions"].as_array().unwrap().iter().any(|r| r["name"] == "vision"), "{on}");
    assert_eq!(priced(&run(&["--memory", "80GiB", "--no-vision"])), (0, 0));
    assert_eq!(priced(&run(&["--memory", "80GiB", "--tensor-parallel", "2"])), (0, 0));
    // 24 GiB, int4 + fp8 KV: the full context takes the tower's memory...
    let small = ["--memory", "24GiB", "--weights-dtype", "int4", "--kv-cache-dtype", "fp8"];
    let traded = run(&small);
    assert_eq!(priced(&traded), (0, 0), "{traded}");
    assert!(traded["fit"].to_string().contains("--no-vision"), "{}", traded["fit"]);
    assert_eq!(traded["max_context"], 262_144, "{}", traded["fit"]);
    // ...unless the user asks for images: the tower stays, the context is what fits beside it.
    let kept = run(&[&small[..], &["--max-image-tokens-per-step", "4096"]].concat());
    assert!(priced(&kept).0 > 0 && priced(&kept).1 > 0, "{kept}");
    assert!(!kept["fit"].to_string().contains("--no-vision"), "{}", kept["fit"]);
}

/// `deltaserve plan --preset qwen3-next-80b-a3b --memory 24GiB --weights-dtype int4 --kv-cache-dtype fp8`:
/// its 37 GiB of int4 experts do not fit the card, so the fit keeps them in pinned host memory and serves
/// the full context; `--experts-on-host` plans that as given, `--no-fit` without it is the weights error
/// that names it, and the CPU backend and dense models refuse it.
#[test]
fn qwen3_next_80b_in_24gib_keeps_its_experts_on_the_host() {
    let base =
        ["--preset", "qwen3-next-80b-a3b", "--memory", "24GiB", "--weights-dtype", "int4", "--kv-cache-dtype", "fp8"];
    let j = plan_json(&[&base[..], &["--json"]].concat());
    assert_eq!(j["fit"]["reached"], true, "{j}");
    assert_eq!(j["fit"]["adjustments"], serde_json::json!(["--experts-on-host"]), "{j}");
    assert_eq!(j["max_context"], 262_144, "{j}");
    assert!(j["total_bytes"].as_u64().unwrap() <= 24 << 30, "{j}");
    assert_eq!(j["options"]["experts_on_host"], true);
    let experts = j["weights"]["experts_bytes"].as_u64().unwrap();
    assert_eq!(experts, 48 * 512 * 1_622_016);
    assert_eq!(j["host_weights_bytes"].as_u64().unwrap(), experts);
    assert!(j["weights_bytes"].as_u64().unwrap() < 3 << 30, "{j}");
    // Asked for: the same plan, nothing traded.
    let asked = plan_json(&[&base[..], &["--experts-on-host", "--json"]].concat());
    assert_eq!(asked["fit"]["adjustments"].as_array().unwrap().len(), 0);
    assert_eq!(
        (asked["max_context"].clone(), asked["weights_bytes"].clone()),
        (j["max_context"].clone(), j["weights_bytes"].clone())
    );
    // The table says where the experts are.
    let out = plan(&base);
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && table.contains("host experts") && table.contains("routed experts"), "{table}");
    assert!(table.contains("the planner set --experts-on-host"), "{table}");
    // Without the fit the weights do not fit, and the error says what would.
    let out = plan(&[&base[..], &["--no-fit"]].concat());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("--experts-on-host"), "{err}");
    // Refused where it cannot work: the CPU backend, a dense model.
    for args in [
        &["--preset", "qwen3-next-80b-a3b", "--device", "cpu", "--experts-on-host"][..],
        &["--preset", "qwen3.6-27b", "--experts-on-host"][..],
    ] {
        let out = plan(args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains("--experts-on-host"), "{args:?}: {err}");
    }
}
