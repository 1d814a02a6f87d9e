//! The vision tower in the plan: its weights (against the tensors `synth` writes), its workspace region
//! bounded by `max_image_tokens_per_step`, nothing for a text-only model or a tower not loaded, and the fit
//! keeping the tower.

use deltaserve_model::synth::{Preset, write_model};
use deltaserve_model::{Checkpoint, ModelConfig};
use deltaserve_plan::vision::{CudaTowerLayout, tower_params, tower_workspace_bytes};
use deltaserve_plan::{Free, KvDtype, Plan, PlanError, PlanOptions, WeightBytes, WeightsDtype, fit_context};

const GIB: u64 = 1 << 30;
const MIB: u64 = 1 << 20;

fn cfg(preset: Preset) -> ModelConfig {
    preset.config(None)
}

fn region(p: &Plan, name: &str) -> Option<u64> {
    p.region(name).map(|r| r.bytes)
}

/// The tower's weights priced by the plan are the tensors `synth` writes for the tiny preset (the demo
/// model's shape): every `model.visual.*` tensor, at f32 on the CPU (each 256-byte aligned).
#[test]
fn tiny_tower_bytes_are_the_synthesized_tensors() {
    let dir = std::env::temp_dir().join(format!("ds-plan-vision-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let cfg = write_model(&dir, Preset::Tiny, None, 0, |_, _| {}).unwrap();
    let ckpt = Checkpoint::open(&dir).unwrap();
    let visual: Vec<usize> = ckpt
        .names()
        .into_iter()
        .filter(|n| n.starts_with("model.visual."))
        .map(|n| ckpt.get(n).unwrap().shape.iter().product())
        .collect();
    assert!(visual.len() > 20, "{} tower tensors", visual.len());
    let params: usize = visual.iter().sum();
    let f32_aligned: u64 = visual.iter().map(|&n| (4 * n as u64).next_multiple_of(256)).sum();
    let _ = std::fs::remove_dir_all(&dir);

    let v = cfg.vision.as_ref().unwrap();
    assert_eq!(tower_params(v), params as u128);
    let cpu = PlanOptions::cpu_defaults(GIB);
    let wb = WeightBytes::new(&cfg, &cpu).unwrap();
    assert_eq!((wb.vision_params, wb.vision), (params as u64, f32_aligned));
    // Without the tower (--no-vision) the weights are smaller by exactly those bytes.
    let none = WeightBytes::new(&cfg, &PlanOptions { max_image_tokens_per_step: None, ..cpu }).unwrap();
    assert_eq!((none.vision, none.vision_params), (0, 0));
    assert_eq!(wb.device() - none.device(), f32_aligned);
}

#[test]
fn the_vision_region_is_bounded_by_the_patches_per_step() {
    let c = cfg(Preset::Tiny);
    let v = c.vision.as_ref().unwrap();
    let plan = |n: Option<usize>| {
        Plan::new(&c, &PlanOptions { max_image_tokens_per_step: n, ..PlanOptions::cpu_defaults(GIB) }).unwrap()
    };
    let (small, large, off) = (plan(Some(1024)), plan(Some(65_536)), plan(None));
    assert_eq!(region(&small, "vision"), Some(tower_workspace_bytes(v, 1024, 4) as u64));
    assert_eq!(large.vision_workspace_bytes, tower_workspace_bytes(v, 65_536, 4) as u64);
    assert_eq!(region(&off, "vision"), None);
    assert_eq!(off.vision_workspace_bytes, 0);
    // The workspace and the tower's weights are taken from what KV gets.
    assert!(large.num_kv_pages < small.num_kv_pages && small.num_kv_pages < off.num_kv_pages);
    assert_eq!(small.weights_bytes - off.weights_bytes, small.weight_parts.vision);
    assert!(region(&small, "weights").unwrap() > region(&off, "weights").unwrap());
    // The table shows both lines; a tower not loaded says so.
    let t = small.table();
    assert!(t.contains("vision tower: weights") && t.contains("1,024 patches"), "{t}");
    assert!(t.lines().any(|l| l.starts_with("vision ")), "{t}");
    assert!(off.table().contains("vision tower: not loaded"), "{}", off.table());
    let j = small.to_json();
    assert_eq!(j["options"]["max_image_tokens_per_step"], 1024);
    assert_eq!(j["weights"]["vision_bytes"], small.weight_parts.vision);
    assert_eq!(j["vision_workspace_bytes"], small.vision_workspace_bytes);
}

#[test]
fn a_text_only_model_prices_no_tower() {
    let c = cfg(Preset::Qwen3Next80bA3b);
    assert!(c.vision.is_none());
    let o = PlanOptions { max_image_tokens_per_step: Some(4096), ..PlanOptions::gpu_defaults(200 * GIB) };
    let p = Plan::new(&c, &o).unwrap();
    assert_eq!((p.weight_parts.vision, p.vision_workspace_bytes), (0, 0));
    assert!(p.region("vision").is_none() && !p.table().contains("vision tower"));
}

#[test]
fn zero_patches_is_refused_and_a_large_workspace_names_its_flags() {
    let c = cfg(Preset::Tiny);
    let e = Plan::new(&c, &PlanOptions { max_image_tokens_per_step: Some(0), ..PlanOptions::cpu_defaults(GIB) })
        .unwrap_err();
    assert!(matches!(e, PlanError::InvalidOption { option: "--max-image-tokens-per-step", .. }), "{e}");
    // 65,536 patches of the tiny tower take ~0.5 GiB: not in 256 MiB.
    let o = PlanOptions { max_image_tokens_per_step: Some(65_536), ..PlanOptions::cpu_defaults(256 * MIB) };
    let m = Plan::new(&c, &o).unwrap_err().to_string();
    assert!(m.contains("vision workspace") && m.contains("lower --max-image-tokens-per-step 65536"), "{m}");
    assert!(m.contains("--no-vision"), "{m}");
}

/// Qwen3.6-27B int4 weights and fp8 KV in 24 GiB, with the CUDA backend's bf16 tower: where the user asked
/// for images (the tower is not open to the fit) it prices its weights and workspace, keeps it and still
/// fills the full context; where the user did not, the fit leaves the tower out (a rung after the int4
/// lm_head) when the full context needs its memory.
#[test]
fn the_24gib_fit_keeps_the_tower_asked_for_and_trades_it_otherwise() {
    let c = cfg(Preset::Qwen36_27b);
    let text = PlanOptions {
        weights_dtype: WeightsDtype::Int4,
        k_dtype: KvDtype::Fp8,
        v_dtype: KvDtype::Fp8,
        ..PlanOptions::gpu_defaults(24 * GIB)
    };
    let asked = Free { vision: false, ..Free::all() };
    let with = PlanOptions { max_image_tokens_per_step: Some(4096), ..text.clone() };
    let (f, plain) = (fit_context(&c, &with, asked).unwrap(), fit_context(&c, &text, Free::all()).unwrap());
    assert_eq!(f.plan.options.max_image_tokens_per_step, Some(4096));
    let v = c.vision.as_ref().unwrap();
    assert_eq!(f.plan.weight_parts.vision, 2 * 460_730_096 + 27 * 96);
    // The CUDA backend's layout of the tower's buffers (and the step's M-RoPE positions).
    let layout = CudaTowerLayout::new(v, 4096, f.plan.options.max_batch_tokens);
    assert_eq!(f.plan.vision_workspace_bytes, layout.bytes as u64);
    assert!(f.plan.total_bytes <= 24 * GIB && f.plan.max_context >= 262_144, "{}", f.plan.table());
    assert!(!f.adjustments.iter().any(|a| a == "--no-vision"), "{:?}", f.adjustments);
    // The tower's bytes come out of what the plan without it leaves free or gives KV.
    let kv = |p: &Plan| p.num_kv_pages as u64 * p.kv_page_bytes();
    assert!(kv(&f.plan) < kv(&plain.plan) || f.adjustments.len() > plain.adjustments.len());

    // Not asked for, at the default bound (65,536 patches: a 2 GiB workspace): traded, after the int4 lm_head.
    let open = PlanOptions { max_image_tokens_per_step: Some(65_536), ..text.clone() };
    let t = fit_context(&c, &open, Free::all()).unwrap();
    assert_eq!(t.plan.options.max_image_tokens_per_step, None);
    assert_eq!((t.plan.weight_parts.vision, t.plan.vision_workspace_bytes), (0, 0));
    assert!(t.plan.max_context >= 262_144 && t.shortfall.is_none(), "{:?}", t.shortfall);
    let at = |name: &str| t.adjustments.iter().position(|a| a == name);
    assert!(at("--lm-head-int4") < at("--no-vision") && at("--no-vision").is_some(), "{:?}", t.adjustments);
    // Where the context fits beside it (a large budget), the tower stays.
    let big = fit_context(&c, &PlanOptions { budget_bytes: 80 * GIB, ..open }, Free::all()).unwrap();
    assert_eq!(big.plan.options.max_image_tokens_per_step, Some(65_536));
    assert!(big.adjustments.is_empty(), "{:?}", big.adjustments);
}
