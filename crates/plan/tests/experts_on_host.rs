//! `--experts-on-host`: a mixture-of-experts model's routed experts in pinned host memory. The device
//! weights lose exactly the experts' bytes, which the host gains; the fit moves them only when the ladder
//! alone stays short of the full context (the Qwen3-Next-80B-A3B on a 24 GiB card), never for a dense
//! model; the table, JSON and SVG show them.

use deltaserve_model::ModelConfig;
use deltaserve_model::synth::Preset;
use deltaserve_plan::cuda::{WeightFormat, host_experts_bytes, weights_device_bytes};
use deltaserve_plan::{Free, KvDtype, Plan, PlanError, PlanOptions, WeightBytes, WeightsDtype, fit_context};

const GIB: u64 = 1 << 30;

fn cfg(preset: &str) -> ModelConfig {
    Preset::parse(preset).unwrap().config(None)
}

/// The CUDA backend's defaults at `budget`, int4 weights, fp8 KV.
fn int4_fp8(budget: u64) -> PlanOptions {
    PlanOptions {
        weights_dtype: WeightsDtype::Int4,
        k_dtype: KvDtype::Fp8,
        v_dtype: KvDtype::Fp8,
        ..PlanOptions::gpu_defaults(budget)
    }
}

fn hosted(o: &PlanOptions) -> PlanOptions {
    PlanOptions { experts_on_host: true, ..o.clone() }
}

#[test]
fn the_experts_move_from_the_device_to_the_host_byte_for_byte() {
    for preset in ["qwen3-next-80b-a3b", "qwen3.6-35b-a3b"] {
        let c = cfg(preset);
        for int4 in [true, false] {
            for (spec, embed_on_host) in [(0, false), (2, false), (0, true), (3, true)] {
                let mut o = PlanOptions { speculative_tokens: spec, embed_on_host, ..int4_fp8(400 * GIB) };
                if !int4 {
                    o.weights_dtype = WeightsDtype::Bf16;
                }
                let what = format!("{preset} int4 {int4} spec {spec} embed_on_host {embed_on_host}");
                let (dev, host) = (Plan::new(&c, &o).unwrap(), Plan::new(&c, &hosted(&o)).unwrap());
                let w = &host.weight_parts;
                assert!(w.experts > 0 && (w.mtp_experts > 0) == (spec > 0), "{what}");
                let moved = w.experts + w.mtp_experts;
                assert_eq!(dev.weights_bytes - host.weights_bytes, moved, "{what}");
                assert_eq!(host.host_weights_bytes - dev.host_weights_bytes, moved, "{what}");
                assert_eq!(host.host_weights_bytes, moved + if embed_on_host { w.embed } else { 0 }, "{what}");
                assert_eq!(host.region("weights").unwrap().bytes, host.weights_bytes);
                // The rest of the plan is the same plan, its KV given what the experts left.
                assert_eq!(dev.workspace, host.workspace, "{what}");
                assert!(host.num_kv_pages > dev.num_kv_pages, "{what}");
                // The backend's layout: the experts' tensors leave the device region for the host block,
                // which holds what the plan prices (at these shapes no tensor pads).
                let (fd, fh) = (WeightFormat::of(&o), WeightFormat::of(&hosted(&o)));
                assert_eq!(host_experts_bytes(&c, fd), 0);
                assert_eq!(host_experts_bytes(&c, fh) as u64, moved, "{what}");
                assert_eq!(weights_device_bytes(&c, fh) + host_experts_bytes(&c, fh), weights_device_bytes(&c, fd));
            }
        }
    }
}

/// `deltaserve plan --preset qwen3-next-80b-a3b --memory 24GiB --weights-dtype int4 --kv-cache-dtype fp8`:
/// 37 GiB of int4 experts do not fit the card; the fit moves them to the host and serves the full
/// context at the defaults, trading nothing else.
#[test]
fn the_fit_serves_the_80b_full_context_at_24gib_with_its_experts_on_the_host() {
    let c = cfg("qwen3-next-80b-a3b");
    let base = int4_fp8(24 * GIB);
    let e = Plan::new(&c, &base).unwrap_err();
    assert!(matches!(e, PlanError::WeightsDoNotFit { .. }), "{e}");
    assert!(e.to_string().contains("use --experts-on-host (frees"), "{e}");

    let f = fit_context(&c, &base, Free::all()).unwrap();
    let p = &f.plan;
    println!("{}", p.table());
    assert_eq!(f.adjustments, ["--experts-on-host"]);
    assert!(f.shortfall.is_none());
    assert_eq!((p.max_context, f.target_context), (262_144, 262_144));
    assert!(p.options.experts_on_host && !p.options.embed_on_host && !p.options.lm_head_int4);
    assert_eq!((p.max_seqs, p.options.snapshot_slots), (16, 8));
    assert!(p.total_bytes <= 24 * GIB);
    let w = &p.weight_parts;
    assert_eq!(w.experts, 48 * 512 * 1_622_016);
    assert_eq!(p.host_weights_bytes, w.experts);
    assert_eq!(p.weights_bytes, WeightBytes::new(&c, &base).unwrap().device() - w.experts);
    assert!(p.weights_bytes < 4 * GIB, "{}", p.weights_bytes);
    println!(
        "80B at 24 GiB: context {}, {} KV pages, device weights {} B, host experts {} B, total {} B of {} B",
        p.max_context, p.num_kv_pages, p.weights_bytes, p.host_weights_bytes, p.total_bytes, p.budget_bytes
    );
    // The plan is the plain plan of the options it reports.
    assert_eq!(Plan::new(&c, &p.options).unwrap(), *p);

    // Where the backend cannot (the option closed, or set): the settings' own error, or their plan.
    let closed = fit_context(&c, &base, Free { experts_on_host: false, ..Free::all() }).unwrap_err();
    assert!(closed.to_string().contains("--experts-on-host"), "{closed}");
    let set = fit_context(&c, &hosted(&base), Free::default()).unwrap();
    assert!(set.adjustments.is_empty() && set.plan == *p);
    // The MTP head's experts go with the model's.
    let spec = fit_context(&c, &PlanOptions { speculative_tokens: 2, ..base.clone() }, Free::all()).unwrap();
    assert_eq!(spec.plan.max_context, 262_144);
    let w = &spec.plan.weight_parts;
    assert!(w.mtp_experts > 0 && spec.plan.host_weights_bytes == w.experts + w.mtp_experts);
}

/// A model whose experts fit keeps them on the device; so does one the ladder brings near the full
/// context (reading experts across the bus costs more than the last tenth of the context); a budget the
/// ladder leaves far short moves them.
#[test]
fn the_experts_move_only_when_the_ladder_stays_far_short() {
    let c = cfg("qwen3.6-35b-a3b");
    let f = fit_context(&c, &int4_fp8(24 * GIB), Free::all()).unwrap();
    assert!(!f.plan.options.experts_on_host && f.adjustments.is_empty());
    for gib in [19, 20, 21, 22, 23] {
        let f = fit_context(&c, &int4_fp8(gib * GIB), Free::all()).unwrap();
        // The most the ladder gives: every rung traded.
        let all = PlanOptions {
            max_seqs: 1,
            snapshot_slots: 1,
            embed_on_host: true,
            lm_head_int4: true,
            ..int4_fp8(gib * GIB)
        };
        let ladder = Plan::new(&c, &all).map_or(0, |p| p.max_context);
        println!(
            "35B at {gib} GiB: the ladder at most {ladder}; the fit {:?} -> {}",
            f.adjustments, f.plan.max_context
        );
        if ladder as f64 >= deltaserve_plan::NEAR_BEST * 262_144.0 {
            assert!(!f.plan.options.experts_on_host, "{gib} GiB");
        } else {
            assert!(f.plan.options.experts_on_host && f.adjustments[0] == "--experts-on-host", "{gib} GiB");
            assert_eq!(f.plan.max_context, 262_144);
        }
    }
    // An explicit context the ladder reaches keeps them on the device.
    let o = PlanOptions { max_context: Some(32_768), ..int4_fp8(19 * GIB) };
    let f = fit_context(&c, &o, Free::all()).unwrap();
    assert!(!f.plan.options.experts_on_host && f.plan.max_context == 32_768);
}

/// Where the fit moves bf16 experts to the host and int4 weights would keep them on the GPU at the full
/// context (the 35B-A3B at 24 GiB), it says so; not where int4 experts would still go to the host (the
/// 80B-A3B), nor for int4 weights, nor when the experts stay on the GPU.
#[test]
fn the_fit_points_to_int4_where_that_keeps_the_experts_on_the_gpu() {
    let bf16 = |gib: u64| PlanOptions { weights_dtype: WeightsDtype::Bf16, ..int4_fp8(gib * GIB) };
    let f = fit_context(&cfg("qwen3.6-35b-a3b"), &bf16(24), Free::all()).unwrap();
    assert!(f.plan.options.experts_on_host);
    let hint = f.hint.expect("a hint for int4");
    assert!(
        hint.contains("--weights-dtype int4") && hint.contains("--quantize int4") && hint.contains("262,144"),
        "{hint}"
    );
    let f = fit_context(&cfg("qwen3-next-80b-a3b"), &bf16(24), Free::all()).unwrap();
    assert!(f.plan.options.experts_on_host && f.hint.is_none(), "{:?}", f.hint);
    let f = fit_context(&cfg("qwen3.6-35b-a3b"), &int4_fp8(24 * GIB), Free::all()).unwrap();
    assert!(!f.plan.options.experts_on_host && f.hint.is_none());
    let f = fit_context(&cfg("qwen3.6-35b-a3b"), &bf16(140), Free::all()).unwrap();
    assert!(!f.plan.options.experts_on_host && f.hint.is_none());
}

/// fp8 weights are the dense models' on one card: a mixture of experts' plan refuses them with what to use
/// instead, and so does one under tensor parallelism.
#[test]
fn fp8_weights_are_refused_where_the_backend_does_not_keep_them() {
    let fp8 = PlanOptions { weights_dtype: WeightsDtype::Fp8Block, ..int4_fp8(24 * GIB) };
    let e = Plan::new(&cfg("qwen3.6-35b-a3b"), &fp8).unwrap_err().to_string();
    assert!(e.contains("--weights-dtype") && e.contains("--quantize int4"), "{e}");
    let mut tp = fp8.clone();
    tp.set_tensor_parallel(2);
    let e = Plan::new(&cfg("qwen3.6-27b"), &tp).unwrap_err().to_string();
    assert!(e.contains("--tensor-parallel 2"), "{e}");
    let dense = PlanOptions { weights_dtype: WeightsDtype::Fp8Block, ..int4_fp8(40 * GIB) };
    assert!(Plan::new(&cfg("qwen3.6-27b"), &dense).is_ok());
}

#[test]
fn dense_models_never_move_experts() {
    let c = cfg("qwen3.6-27b");
    // 22 GiB: short of the full context with every rung (the fit's own test); still no experts to move.
    for gib in [22, 24] {
        let f = fit_context(&c, &int4_fp8(gib * GIB), Free::all()).unwrap();
        assert!(!f.plan.options.experts_on_host && f.adjustments.iter().all(|a| !a.contains("experts")));
        assert_eq!(f.plan.host_weights_bytes, if f.plan.options.embed_on_host { f.plan.weight_parts.embed } else { 0 });
    }
    let e = Plan::new(&c, &hosted(&int4_fp8(24 * GIB))).unwrap_err().to_string();
    assert!(e.contains("--experts-on-host") && e.contains("no routed experts"), "{e}");
    // Nor under tensor parallelism (mixture-of-experts models run on one card).
    let n = cfg("qwen3-next-80b-a3b");
    let mut o = hosted(&int4_fp8(24 * GIB));
    o.set_tensor_parallel(2);
    let e = Plan::new(&n, &o).unwrap_err().to_string();
    assert!(e.contains("--experts-on-host") && e.contains("--tensor-parallel 2"), "{e}");
}

#[test]
fn the_plan_shows_the_host_experts() {
    let c = cfg("qwen3-next-80b-a3b");
    let p = Plan::new(&c, &hosted(&PlanOptions { embed_on_host: true, ..int4_fp8(24 * GIB) })).unwrap();
    let t = p.table();
    assert!(t.contains("weights int4 + host embedding + host experts"), "{t}");
    assert!(t.contains("in pinned host memory (--experts-on-host, outside the budget)"), "{t}");
    let host_line = t.lines().find(|l| l.starts_with("host ")).unwrap();
    assert!(host_line.contains("embedding ") && host_line.contains("routed experts"), "{host_line}");
    assert!(p.region("weights").unwrap().note.contains("routed experts"), "{t}");
    let j = p.to_json();
    assert_eq!(j["options"]["experts_on_host"], true);
    assert_eq!(j["weights"]["host_experts_bytes"], p.weight_parts.experts);
    assert_eq!(j["host_weights_bytes"], p.weight_parts.experts + p.weight_parts.embed);
    let svg = p.svg();
    assert!(svg.contains("routed experts") && svg.contains("host memory, outside the budget"));
    // The host bar is drawn at the budget's scale, cut at the bar's width (the experts outweigh it).
    assert!(svg.contains(r#"width="960.00" height="22""#), "{svg}");
}
