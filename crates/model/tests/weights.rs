//! Checkpoint loading: synthetic directories load; truncated files, wrong shapes and missing tensors
//! give errors that name the tensor and both shapes; sharded and text-only layouts; Qwen3-Next packing.

use std::path::Path;

use deltaserve_model::checkpoint::{TensorHeader, write_f32_safetensors, write_safetensors};
use deltaserve_model::synth::{MtpVariant, Preset, write_model, write_model_json};
use deltaserve_model::{Checkpoint, DType, ModelConfig, ModelWeights};

fn tiny(dir: &Path) -> ModelConfig {
    write_model(dir, Preset::Tiny, None, 3, |_, _| {}).unwrap()
}

fn load(dir: &Path) -> Result<ModelWeights<deltaserve_model::weights::HostTensor>, String> {
    let cfg = ModelConfig::from_dir(dir).map_err(|e| e.to_string())?;
    let ckpt = Checkpoint::open(dir).map_err(|e| e.to_string())?;
    ModelWeights::load_f32(&ckpt, &cfg).map_err(|e| e.to_string())
}

/// Which tensors go into a shard.
type KeepFn<'a> = &'a dyn Fn(&str) -> bool;

/// Rewrites model.safetensors through `edit(name, shape) -> Option<(new_name, new_shape)>` (None drops it).
fn rewrite(dir: &Path, files: &[(&str, KeepFn)], edit: impl Fn(&str, &[usize]) -> Option<(String, Vec<usize>)>) {
    let ckpt = Checkpoint::open(dir).unwrap();
    let names: Vec<String> = ckpt.names().iter().map(|s| s.to_string()).collect();
    for (file, keep) in files {
        let mut headers = Vec::new();
        let mut sources = Vec::new();
        for n in names.iter().filter(|n| keep(n)) {
            let t = ckpt.get(n).unwrap();
            if let Some((name, shape)) = edit(n, t.shape) {
                sources.push((t.bytes.to_vec(), t.shape.iter().product::<usize>(), shape.iter().product::<usize>()));
                headers.push(TensorHeader { name, dtype: DType::BF16, shape });
            }
        }
        let tmp = dir.join(format!("{file}.tmp"));
        write_safetensors(&tmp, &headers, |i, buf| {
            let (bytes, _, want) = &sources[i];
            buf.extend(bytes.iter().cycle().take(want * 2));
            Ok(())
        })
        .unwrap();
        std::fs::rename(&tmp, dir.join(file)).unwrap();
    }
}

#[test]
fn synthetic_model_loads_with_expected_shapes() {
    let dir = tempdir("load");
    let cfg = tiny(&dir);
    let w = load(&dir).expect("loads");
    let d = cfg.dims();
    assert_eq!(w.embed.shape, vec![d.vocab, d.hidden]);
    assert_eq!(w.layers.len(), 4);
    assert!(w.lm_head.is_some());
    assert!(w.embed.data.iter().all(|v| v.is_finite()));
}

/// A Qwen3-Next layout (packed in-projections) at a small shape: every DeltaNet tensor is written, so the
/// checkpoint loads (the packed layout once lacked the conv, gates, norm and out projection).
#[test]
fn synthetic_qwen3_next_layout_loads() {
    let dir = tempdir("next");
    let c = Preset::small_qwen3_next_moe();
    write_model_json(&dir, Preset::Qwen3Next80bA3b, c, 5, MtpVariant::None, |_, _| {}).unwrap();
    let w = load(&dir).expect("loads");
    assert_eq!(w.layers.len(), 4);
}

#[test]
fn truncated_file_is_a_clear_error() {
    let dir = tempdir("trunc");
    tiny(&dir);
    let path = dir.join("model.safetensors");
    let len = std::fs::metadata(&path).unwrap().len();
    let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    f.set_len(len - 100).unwrap();
    let e = load(&dir).err().expect("load should fail");
    assert!(e.contains("model.safetensors") && e.contains("not a valid safetensors"), "{e}");
}

#[test]
fn wrong_shape_names_tensor_and_both_shapes() {
    let dir = tempdir("shape");
    tiny(&dir);
    let target = "model.language_model.layers.1.linear_attn.in_proj_z.weight";
    rewrite(&dir, &[("model.safetensors", &|_| true)], |n, s| {
        Some((n.to_string(), if n == target { vec![s[0] - 1, s[1]] } else { s.to_vec() }))
    });
    let e = load(&dir).err().expect("load should fail");
    assert!(e.contains(target) && e.contains("[191, 128]") && e.contains("[192, 128]"), "{e}");
}

#[test]
fn missing_tensor_is_named() {
    let dir = tempdir("missing");
    tiny(&dir);
    let target = "model.language_model.layers.3.self_attn.k_norm.weight";
    rewrite(&dir, &[("model.safetensors", &|_| true)], |n, s| (n != target).then(|| (n.to_string(), s.to_vec())));
    let e = load(&dir).err().expect("load should fail");
    assert!(e.contains(target) && e.contains("missing"), "{e}");
}

#[test]
fn sharded_text_only_layout_with_tied_embeddings_loads_identically() {
    let a = tempdir("shard-a");
    tiny(&a);
    let reference = load(&a).expect("loads");
    // Text-only names (`model.*`), two shards with an index, tied lm_head dropped.
    let b = tempdir("shard-b");
    std::fs::copy(a.join("model.safetensors"), b.join("model.safetensors")).unwrap();
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(a.join("config.json")).unwrap()).unwrap();
    let mut text = cfg["text_config"].take();
    text["tie_word_embeddings"] = serde_json::json!(true);
    std::fs::write(b.join("config.json"), text.to_string()).unwrap();
    let first = |n: &str| n.contains("layers.0.") || n.contains("embed");
    rewrite(
        &b,
        &[("model-00001-of-00002.safetensors", &first), ("model-00002-of-00002.safetensors", &|n: &str| !first(n))],
        |n, s| (n != "lm_head.weight").then(|| (n.replace("model.language_model.", "model."), s.to_vec())),
    );
    std::fs::remove_file(b.join("model.safetensors")).unwrap();
    let ckpt_names: Vec<String> = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
        .iter()
        .flat_map(|f| {
            let c = Checkpoint::open(&{
                let d = tempdir(&format!("one-{f}"));
                std::fs::copy(b.join(f), d.join("model.safetensors")).unwrap();
                d
            })
            .unwrap();
            c.names().iter().map(|n| format!("\"{n}\": \"{f}\"")).collect::<Vec<_>>()
        })
        .collect();
    std::fs::write(
        b.join("model.safetensors.index.json"),
        format!("{{\"metadata\": {{}}, \"weight_map\": {{{}}}}}", ckpt_names.join(",")),
    )
    .unwrap();
    let w = load(&b).expect("loads");
    assert!(w.lm_head.is_none());
    assert_eq!(w.embed, reference.embed);
    assert_eq!(w.lm_head(), &reference.embed);
    assert_eq!(w.final_norm, reference.final_norm);
}

#[test]
fn unsupported_dtype_and_garbage_files_are_errors() {
    let dir = tempdir("garbage");
    std::fs::write(dir.join("model.safetensors"), b"definitely not safetensors").unwrap();
    assert!(Checkpoint::open(&dir).is_err());
    let empty = tempdir("empty");
    assert!(Checkpoint::open(&empty).unwrap_err().to_string().contains("no *.safetensors"));
}

/// Rewriting a safetensors file never disturbs a reader that has the old one open (the new file is
/// written beside it and renamed over it: no truncation under a mapping), a failed write leaves the
/// old file and no partial one, and `open_file` reads a file of any name.
#[test]
fn rewriting_a_mapped_file_keeps_the_old_bytes_for_its_reader() {
    let dir = tempdir("rewrite");
    let path = dir.join("reference.safetensors");
    write_f32_safetensors(&path, &[("t", vec![4], &[1.0, 2.0, 3.0, 4.0])]).unwrap();
    let old = Checkpoint::open_file(&path).unwrap();
    write_f32_safetensors(&path, &[("t", vec![2], &[9.0, 8.0])]).unwrap();
    assert_eq!(old.get("t").unwrap().to_f32().unwrap(), vec![1.0, 2.0, 3.0, 4.0]);
    assert_eq!(Checkpoint::open_file(&path).unwrap().get("t").unwrap().to_f32().unwrap(), vec![9.0, 8.0]);

    let headers = [TensorHeader { name: "t".into(), dtype: DType::F32, shape: vec![3] }];
    let short = write_safetensors(&path, &headers, |_, buf| {
        buf.extend_from_slice(&[0u8; 4]);
        Ok(())
    });
    assert!(short.unwrap_err().to_string().contains("produced 4 bytes, expected 12"));
    assert_eq!(Checkpoint::open_file(&path).unwrap().get("t").unwrap().to_f32().unwrap(), vec![9.0, 8.0]);
    let names: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(names, vec![std::ffi::OsString::from("reference.safetensors")]);
}

fn tempdir(tag: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("ds-model-test-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}
