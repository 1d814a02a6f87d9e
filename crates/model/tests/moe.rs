//! Mixture-of-experts checkpoints (the `qwen35_moe` / `qwen3next_moe` HF fixtures): experts load one tensor
//! per expert or fused, and a checkpoint that disagrees with its config (a missing expert, a router of
//! the wrong shape, more experts than `num_experts`) is an error naming the tensor and the field. GPTQ
//! experts load like any GPTQ linear (dequantised for the CPU backend). The MTP head of a mixture-of-experts
//! model has a sparse MLP under the real names (`mtp.layers.0.mlp.gate.weight`, `mlp.experts.*`,
//! `mlp.shared_expert.*`, `mlp.shared_expert_gate.weight`), loaded per expert or fused like a main layer's.

use std::path::{Path, PathBuf};

use deltaserve_model::checkpoint::write_f32_safetensors;
use deltaserve_model::weights::{HostTensor, MlpWeights};
use deltaserve_model::{Checkpoint, ModelConfig, ModelWeights};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/hf").join(name)
}

fn load(dir: &Path) -> Result<ModelWeights<HostTensor>, String> {
    let cfg = ModelConfig::from_dir(dir).map_err(|e| e.to_string())?;
    let ckpt = Checkpoint::open(dir).map_err(|e| e.to_string())?;
    ModelWeights::load_f32(&ckpt, &cfg).map_err(|e| e.to_string())
}

/// The load error of `dir`, which is then removed.
fn load_err(dir: PathBuf) -> String {
    let e = load(&dir).err().expect("expected an error");
    let _ = std::fs::remove_dir_all(dir);
    e
}

type Tensors = Vec<(String, Vec<usize>, Vec<f32>)>;

/// A copy of fixture `name` in a fresh directory, its tensors (as f32) passed through `edit` and its
/// text config through `edit_cfg`.
fn edited(
    name: &str,
    tag: &str,
    edit: impl FnOnce(&mut Tensors),
    edit_cfg: impl FnOnce(&mut serde_json::Value),
) -> PathBuf {
    edited_dir(&fixture(name), tag, edit, edit_cfg)
}

/// [`edited`] of the model in `src`.
fn edited_dir(
    src: &Path,
    tag: &str,
    edit: impl FnOnce(&mut Tensors),
    edit_cfg: impl FnOnce(&mut serde_json::Value),
) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ds-moe-test-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let ckpt = Checkpoint::open(src).unwrap();
    let mut tensors: Tensors = ckpt
        .names()
        .into_iter()
        .map(|n| {
            let t = ckpt.get(n).unwrap();
            (n.to_string(), t.shape.to_vec(), t.to_f32().unwrap())
        })
        .collect();
    edit(&mut tensors);
    let refs: Vec<(&str, Vec<usize>, &[f32])> =
        tensors.iter().map(|(n, s, d)| (n.as_str(), s.clone(), d.as_slice())).collect();
    write_f32_safetensors(&dir.join("model.safetensors"), &refs).unwrap();
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    let text = if cfg.get("text_config").is_some() { &mut cfg["text_config"] } else { &mut cfg };
    edit_cfg(text);
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
    dir
}

#[test]
fn fixtures_load_their_experts_shared_expert_and_dense_layers() {
    let w = load(&fixture("qwen35_moe")).unwrap();
    for l in &w.layers {
        let moe = l.moe.as_ref().unwrap();
        assert_eq!((moe.router.shape.as_slice(), moe.experts.len()), (&[8, 64][..], 8));
        assert_eq!(moe.experts[7].down_proj.shape, [64, 32]);
        assert_eq!(moe.shared_expert_gate.shape, [1, 64]);
        assert_eq!(l.mlp.gate_proj.shape, [48, 64], "the shared expert");
    }
    let w = load(&fixture("qwen3next_moe")).unwrap();
    let sparse: Vec<bool> = w.layers.iter().map(|l| l.moe.is_some()).collect();
    assert_eq!(sparse, [true, true, false, true]);
    assert_eq!(w.layers[2].mlp.gate_proj.shape, [128, 64], "layer 2 is dense");
}

#[test]
fn fused_experts_load_as_the_per_expert_tensors() {
    let per_expert = load(&fixture("qwen3next_moe")).unwrap();
    // Fuse every sparse layer's experts as transformers holds them: gate_up [E, 2I, D], down [E, D, I].
    let dir = edited(
        "qwen3next_moe",
        "fused",
        |t| {
            for layer in [0, 1, 3] {
                fuse(t, &format!("model.layers.{layer}.mlp.experts."), [6, 32, 64]);
            }
        },
        |_| {},
    );
    let fused = load(&dir).unwrap();
    for (a, b) in per_expert.layers.iter().zip(&fused.layers) {
        let (Some(a), Some(b)) = (&a.moe, &b.moe) else { continue };
        assert_same_experts(&a.experts, &b.experts);
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// Replaces the per-expert tensors under `p` (`….mlp.experts.`) of `[experts, width, hidden]` by the fused
/// pair as transformers holds them: gate_up `[E, 2I, D]`, down `[E, D, I]`.
fn fuse(t: &mut Tensors, p: &str, [experts, width, hidden]: [usize; 3]) {
    let take = |t: &mut Tensors, e: usize, proj: &str| {
        let i = t.iter().position(|x| x.0 == format!("{p}{e}.{proj}.weight")).unwrap();
        t.remove(i).2
    };
    let (mut gu, mut down) = (Vec::new(), Vec::new());
    for e in 0..experts {
        gu.extend(take(t, e, "gate_proj"));
        gu.extend(take(t, e, "up_proj"));
        down.extend(take(t, e, "down_proj"));
    }
    t.push((format!("{p}gate_up_proj"), vec![experts, 2 * width, hidden], gu));
    t.push((format!("{p}down_proj"), vec![experts, hidden, width], down));
}

fn assert_same_experts(a: &[MlpWeights<HostTensor>], b: &[MlpWeights<HostTensor>]) {
    assert_eq!(a.len(), b.len());
    for (x, y) in a.iter().zip(b) {
        assert_eq!(x.gate_proj, y.gate_proj);
        assert_eq!(x.up_proj, y.up_proj);
        assert_eq!(x.down_proj, y.down_proj);
    }
}

/// A synthetic model in a fresh directory: `tiny-moe` (`qwen3_5_moe`), or with `next_dense` the small
/// Qwen3-Next mixture of experts whose dense layers are `next_dense`.
fn synthetic(tag: &str, next_dense: Option<&[u64]>) -> PathBuf {
    use deltaserve_model::synth::{MtpVariant, Preset, write_model, write_model_json};
    let dir = std::env::temp_dir().join(format!("ds-moe-test-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    match next_dense {
        None => write_model(&dir, Preset::TinyMoe, None, 3, |_, _| {}).map(|_| ()),
        Some(dense) => {
            let mut c = Preset::small_qwen3_next_moe();
            c["mlp_only_layers"] = dense.to_vec().into();
            write_model_json(&dir, Preset::Qwen3Next80bA3b, c, 3, MtpVariant::Random, |_, _| {}).map(|_| ())
        }
    }
    .unwrap();
    dir
}

#[test]
fn the_mtp_head_of_a_moe_model_has_its_experts_per_expert_or_fused() {
    let src = synthetic("mtp", None);
    let w = load(&src).unwrap();
    let mtp = w.mtp.as_ref().expect("the MTP head is loaded");
    let moe = mtp.layer.moe.as_ref().expect("its MLP is a mixture of experts");
    assert_eq!((moe.router.shape.as_slice(), moe.experts.len()), (&[8, 128][..], 8));
    assert_eq!(moe.experts[7].down_proj.shape, [128, 64]);
    assert_eq!(moe.shared_expert_gate.shape, [1, 128]);
    assert_eq!(mtp.layer.mlp.gate_proj.shape, [128, 128], "the shared expert");
    // The real Qwen3.5/3.6-35B-A3B checkpoints store the head's experts fused.
    let dir = edited_dir(&src, "mtp-fused", |t| fuse(t, "mtp.layers.0.mlp.experts.", [8, 64, 128]), |_| {});
    let fused = load(&dir).unwrap();
    let fused_moe = fused.mtp.as_ref().unwrap().layer.moe.as_ref().unwrap();
    assert_same_experts(&moe.experts, &fused_moe.experts);
    assert_eq!(moe.router, fused_moe.router);
    let _ = std::fs::remove_dir_all(dir);
    // A partial head is an error naming the missing tensor.
    for missing in [
        "mtp.layers.0.mlp.experts.5.up_proj.weight",
        "mtp.layers.0.mlp.gate.weight",
        "mtp.layers.0.mlp.shared_expert.down_proj.weight",
        "mtp.layers.0.mlp.shared_expert_gate.weight",
    ] {
        let e = load_err(edited_dir(&src, "mtp-missing", |t| t.retain(|x| x.0 != missing), |_| {}));
        assert!(e.contains(missing) && e.contains("missing"), "{e}");
    }
    let _ = std::fs::remove_dir_all(src);
}

#[test]
fn a_qwen3_next_mtp_head_is_sparse_as_decoder_layer_0_is() {
    for (dense, sparse) in [(&[2u64][..], true), (&[0u64][..], false)] {
        let dir = synthetic(&format!("next-mtp-{}", dense[0]), Some(dense));
        let w = load(&dir).unwrap();
        let _ = std::fs::remove_dir_all(dir);
        let layer = &w.mtp.as_ref().expect("the MTP head is loaded").layer;
        assert_eq!(layer.moe.is_some(), sparse, "mlp_only_layers {dense:?}");
        let width = if sparse { 96 } else { 256 }; // the shared expert's, or the dense MLP's
        assert_eq!(layer.mlp.gate_proj.shape, [width, 128], "mlp_only_layers {dense:?}");
        if let Some(moe) = &layer.moe {
            assert_eq!(moe.experts.len(), 6);
        }
    }
}

#[test]
fn checkpoints_that_disagree_with_the_config_name_the_tensor() {
    let missing = "model.language_model.layers.1.mlp.experts.3.up_proj.weight";
    let dir = edited("qwen35_moe", "missing", |t| t.retain(|x| x.0 != missing), |_| {});
    let e = load_err(dir);
    assert!(e.contains(missing) && e.contains("missing"), "{e}");

    // The config says 7 experts, the router has 8 rows.
    let dir = edited("qwen35_moe", "router", |_| {}, |c| c["num_experts"] = 7.into());
    let e = load_err(dir);
    assert!(e.contains("layers.0.mlp.gate.weight") && e.contains("`num_experts` is 7"), "{e}");

    // Router cut to 7 rows too: the checkpoint still holds an eighth expert.
    let dir = edited(
        "qwen35_moe",
        "count",
        |t| {
            for x in t.iter_mut().filter(|x| x.0.ends_with("mlp.gate.weight")) {
                x.1[0] = 7;
                x.2.truncate(7 * 64);
            }
        },
        |c| c["num_experts"] = 7.into(),
    );
    let e = load_err(dir);
    assert!(e.contains("experts.7.gate_proj.weight") && e.contains("`num_experts` is 7"), "{e}");

    // An expert of the wrong width.
    let dir = edited("qwen3next_moe", "width", |_| {}, |c| c["moe_intermediate_size"] = 16.into());
    let e = load_err(dir);
    assert!(e.contains("experts.0.gate_proj.weight") && e.contains("[16, 64]"), "{e}");
}

#[test]
fn gptq_experts_load_dequantised() {
    use deltaserve_model::synth::{Preset, gptq, write_model};
    let dir = std::env::temp_dir().join(format!("ds-moe-test-{}-gptq", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    write_model(&dir, Preset::TinyMoe, None, 3, |_, _| {}).unwrap();
    let done = gptq::convert(&dir, gptq::GptqVariant::ASYM_ACT_ORDER, &[], 7, |_| {}).unwrap();
    let w = load(&dir).unwrap();
    let name = "model.language_model.layers.2.mlp.experts.5.down_proj.weight";
    let close =
        |got: &[f32], want: &[f32]| got.len() == want.len() && got.iter().zip(want).all(|(a, b)| (a - b).abs() <= 1e-6);
    assert!(close(&w.layers[2].moe.as_ref().unwrap().experts[5].down_proj.data, &done.quantized[name].0), "{name}");
    let router = "model.language_model.layers.1.mlp.gate.weight";
    assert!(close(&w.layers[1].moe.as_ref().unwrap().router.data, &done.quantized[router].0), "{router}");
    let _ = std::fs::remove_dir_all(dir);
}
