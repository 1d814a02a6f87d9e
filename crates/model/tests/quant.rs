//! Quantised checkpoints: a GPTQ packer and an FP8 e4m3 block quantiser written here from the
//! formats' definitions produce real-layout checkpoints from the tiny synthetic model; every
//! dequantised weight must equal the packer's own dequantisation exactly and stay within the
//! format's error of the original, and unquantised tensors must load unchanged.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};

use deltaserve_model::quant::{ModuleQuant, Quantization, ZeroFormat, fp8_block_quantize};
use deltaserve_model::synth::fp8;
use deltaserve_model::synth::gptq::{self, GptqVariant, OutTensor};
use deltaserve_model::synth::{Preset, write_model};
use deltaserve_model::weights::HostTensor;
use deltaserve_model::{Checkpoint, DType, LayerWeights, MixerWeights, ModelConfig, ModelWeights, TensorRef};
use serde_json::{Value, json};

const P: &str = "model.language_model.";

fn tempdir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("ds-quant-test-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn load(dir: &Path) -> Result<ModelWeights<HostTensor>, String> {
    let cfg = ModelConfig::from_dir(dir).map_err(|e| e.to_string())?;
    let ckpt = Checkpoint::open(dir).map_err(|e| e.to_string())?;
    ModelWeights::load_f32(&ckpt, &cfg).map_err(|e| e.to_string())
}

/// Every loaded tensor under its stored checkpoint name (the MTP head's too, when loaded).
fn flatten(w: &ModelWeights<HostTensor>) -> HashMap<String, &HostTensor> {
    let mut m = HashMap::new();
    m.insert(format!("{P}embed_tokens.weight"), &w.embed);
    m.insert(format!("{P}norm.weight"), &w.final_norm);
    if let Some(l) = &w.lm_head {
        m.insert("lm_head.weight".into(), l);
    }
    for (i, l) in w.layers.iter().enumerate() {
        flatten_layer(&format!("{P}layers.{i}."), l, &mut m);
    }
    if let Some(mtp) = &w.mtp {
        m.insert("mtp.fc.weight".into(), &mtp.fc);
        m.insert("mtp.pre_fc_norm_embedding.weight".into(), &mtp.pre_fc_norm_embedding);
        m.insert("mtp.pre_fc_norm_hidden.weight".into(), &mtp.pre_fc_norm_hidden);
        m.insert("mtp.norm.weight".into(), &mtp.norm);
        flatten_layer("mtp.layers.0.", &mtp.layer, &mut m);
    }
    m
}

/// One decoder layer's tensors under `prefix` (`….layers.{i}.`), its experts' included.
fn flatten_layer<'a>(prefix: &str, l: &'a LayerWeights<HostTensor>, m: &mut HashMap<String, &'a HostTensor>) {
    let n = |s: &str| format!("{prefix}{s}");
    m.insert(n("input_layernorm.weight"), &l.input_norm);
    m.insert(n("post_attention_layernorm.weight"), &l.post_norm);
    let mlp = if l.moe.is_some() { "mlp.shared_expert." } else { "mlp." };
    m.insert(n(&format!("{mlp}gate_proj.weight")), &l.mlp.gate_proj);
    m.insert(n(&format!("{mlp}up_proj.weight")), &l.mlp.up_proj);
    m.insert(n(&format!("{mlp}down_proj.weight")), &l.mlp.down_proj);
    if let Some(moe) = &l.moe {
        m.insert(n("mlp.gate.weight"), &moe.router);
        m.insert(n("mlp.shared_expert_gate.weight"), &moe.shared_expert_gate);
        for (e, x) in moe.experts.iter().enumerate() {
            m.insert(n(&format!("mlp.experts.{e}.gate_proj.weight")), &x.gate_proj);
            m.insert(n(&format!("mlp.experts.{e}.up_proj.weight")), &x.up_proj);
            m.insert(n(&format!("mlp.experts.{e}.down_proj.weight")), &x.down_proj);
        }
    }
    match &l.mixer {
        MixerWeights::DeltaNet(d) => {
            let n = |s: &str| format!("{prefix}linear_attn.{s}");
            m.insert(n("in_proj_qkv.weight"), &d.in_proj_qkv);
            m.insert(n("in_proj_z.weight"), &d.in_proj_z);
            m.insert(n("in_proj_b.weight"), &d.in_proj_b);
            m.insert(n("in_proj_a.weight"), &d.in_proj_a);
            m.insert(n("conv1d.weight"), &d.conv1d);
            m.insert(n("dt_bias"), &d.dt_bias);
            m.insert(n("A_log"), &d.a_log);
            m.insert(n("norm.weight"), &d.norm);
            m.insert(n("out_proj.weight"), &d.out_proj);
        }
        MixerWeights::Attention(a) => {
            let n = |s: &str| format!("{prefix}self_attn.{s}");
            m.insert(n("q_proj.weight"), &a.q_proj);
            m.insert(n("k_proj.weight"), &a.k_proj);
            m.insert(n("v_proj.weight"), &a.v_proj);
            m.insert(n("o_proj.weight"), &a.o_proj);
            m.insert(n("q_norm.weight"), &a.q_norm);
            m.insert(n("k_norm.weight"), &a.k_norm);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// GPTQ checkpoints: deltaserve_model::synth::gptq packs them from the format's definition
// ---------------------------------------------------------------------------------------------

/// What the test expects of each stored linear.
struct Expect {
    /// Original (bf16 → f32) weights, by stored name.
    original: HashMap<String, Vec<f32>>,
    /// The quantiser's own dequantisation and per-element error bound, by stored name.
    quantized: HashMap<String, (Vec<f32>, Vec<f32>)>,
}

/// Builds a GPTQ checkpoint from the tiny model in `dir` (rewriting model.safetensors and config.json).
/// `not_converted`: modules (without `.weight`) left in bf16. `edit` may change one tensor's shape.
fn make_gptq(dir: &Path, v: GptqVariant, not_converted: &[&str], edit: Option<(&str, Vec<usize>)>) -> Expect {
    write_model(dir, Preset::Tiny, None, 11, |_, _| {}).unwrap();
    let done = gptq::convert(dir, v, not_converted, 5, |tensors| {
        if let Some((target, shape)) = edit {
            let t = tensors.iter_mut().find(|t| t.0 == target).expect("edited tensor exists");
            let n: usize = shape.iter().product::<usize>() * 4;
            t.3.resize(n, 0);
            t.2 = shape;
        }
    })
    .unwrap();
    // Half a step, plus the f16 rounding of the scale (≤ 2^-11 relative) over the 15-step range for
    // values clamped at the grid's ends.
    let quantized = done
        .quantized
        .into_iter()
        .map(|(name, (deq, scale))| (name, (deq, scale.iter().map(|s| s * 0.51).collect())))
        .collect();
    Expect { original: done.original, quantized }
}

/// Loads `dir` and checks every tensor against `exp`; returns (quantised count, max error / bound).
fn check_loaded(dir: &Path, exp: &Expect) -> (usize, f32) {
    let w = load(dir).expect("quantised checkpoint loads");
    let flat = flatten(&w);
    let mut worst = 0f32;
    let mut nq = 0;
    for (name, orig) in &exp.original {
        if name.starts_with("mtp.") || name.starts_with("model.visual.") {
            continue; // loaded by their own loaders
        }
        let got = flat.get(name).unwrap_or_else(|| panic!("{name} not loaded"));
        match exp.quantized.get(name) {
            Some((deq, bound)) => {
                nq += 1;
                assert_eq!(got.data.len(), deq.len(), "{name}");
                for (k, (&g, &d)) in got.data.iter().zip(deq).enumerate() {
                    assert!(g.to_bits() == d.to_bits(), "{name}[{k}]: loaded {g}, packer dequantised {d}");
                    let err = (g - orig[k]).abs();
                    assert!(err <= bound[k] * 1.0001 + 1e-7, "{name}[{k}]: error {err} > bound {}", bound[k]);
                    if bound[k] > 0.0 {
                        worst = worst.max(err / bound[k]);
                    }
                }
                // And the quantisation is not trivially lossless or broken: relative RMS error of int4 / fp8.
                let num: f32 = got.data.iter().zip(orig).map(|(a, b)| (a - b) * (a - b)).sum();
                let den: f32 = orig.iter().map(|b| b * b).sum();
                assert!((num / den).sqrt() < 0.2, "{name}: relative RMS error {}", (num / den).sqrt());
            }
            None => assert_eq!(&got.data, orig, "{name} (unquantised) must load unchanged"),
        }
    }
    (nq, worst)
}

fn run_gptq(tag: &str, v: GptqVariant) {
    let dir = tempdir(tag);
    let not_converted =
        ["model.language_model.layers.0.mlp.down_proj", "model.language_model.layers.3.self_attn.o_proj"];
    let exp = make_gptq(&dir, v, &not_converted, None);
    let cfg = ModelConfig::from_dir(&dir).unwrap();
    let Some(Quantization::Gptq(g)) = &cfg.quantization else { panic!("{:?}", cfg.quantization) };
    assert_eq!(g.params.sym, v.sym);
    assert_eq!(g.desc_act, v.act_order);
    assert_eq!(g.zero_format, if v.v2 { ZeroFormat::V2Exact } else { ZeroFormat::V1MinusOne });
    let q = cfg.quantization.as_ref().unwrap();
    assert_eq!(q.module(not_converted[0]), ModuleQuant::Excluded);
    assert!(matches!(q.module("model.language_model.layers.1.mlp.up_proj"), ModuleQuant::Gptq(_)));
    let (nq, worst) = check_loaded(&dir, &exp);
    // 3 DeltaNet layers × (qkv, z, out) + 1 attention layer × 4 + 4 × 3 MLP, minus the 2 left in bf16.
    assert_eq!(nq, 3 * 3 + 4 + 4 * 3 - 2, "{tag}");
    assert!(worst > 0.3, "{tag}: the error bound is never approached ({worst}); is anything quantised?");
}

#[test]
fn gptq_symmetric_v1_loads_exactly() {
    run_gptq(
        "gptq-sym",
        GptqVariant { method: "gptq", sym: true, act_order: false, v2: false, group: 128, write_trivial_g_idx: true },
    );
}

#[test]
fn gptq_asymmetric_act_order_v1_loads_exactly() {
    run_gptq(
        "gptq-asym-act",
        GptqVariant { method: "gptq", sym: false, act_order: true, v2: false, group: 128, write_trivial_g_idx: false },
    );
}

#[test]
fn gptq_v2_asymmetric_zeros_load_exactly() {
    run_gptq(
        "gptq-v2",
        GptqVariant { method: "gptq", sym: false, act_order: false, v2: true, group: 128, write_trivial_g_idx: false },
    );
}

#[test]
fn gptq_symmetric_act_order_loads_exactly() {
    run_gptq(
        "gptq-sym-act",
        GptqVariant { method: "gptq", sym: true, act_order: true, v2: false, group: 128, write_trivial_g_idx: false },
    );
}

#[test]
fn autoround_gptq_export_loads_exactly() {
    run_gptq(
        "autoround-asym",
        GptqVariant {
            method: "auto-round",
            sym: false,
            act_order: false,
            v2: false,
            group: 128,
            write_trivial_g_idx: false,
        },
    );
    run_gptq(
        "autoround-sym-perchannel",
        GptqVariant {
            method: "auto-round",
            sym: true,
            act_order: false,
            v2: false,
            group: -1,
            write_trivial_g_idx: false,
        },
    );
}

#[test]
fn gptq_wrong_qweight_shape_names_tensor_and_both_shapes() {
    let dir = tempdir("gptq-shape");
    let v =
        GptqVariant { method: "gptq", sym: true, act_order: false, v2: false, group: 128, write_trivial_g_idx: false };
    let target = "model.language_model.layers.1.linear_attn.in_proj_z.qweight";
    // in_proj_z is [192, 128]: qweight [16, 192].
    make_gptq(&dir, v, &[], Some((target, vec![15, 192])));
    let e = load(&dir).err().expect("load should fail");
    assert!(e.contains(target) && e.contains("[15, 192]") && e.contains("[16, 192]"), "{e}");
}

#[test]
fn gptq_missing_g_idx_with_desc_act_and_excluded_but_packed_are_errors() {
    let dir = tempdir("gptq-gidx");
    let v =
        GptqVariant { method: "gptq", sym: false, act_order: true, v2: false, group: 128, write_trivial_g_idx: false };
    make_gptq(&dir, v, &[], None);
    // Drop one g_idx.
    let target = "model.language_model.layers.2.mlp.up_proj.g_idx";
    let ckpt = Checkpoint::open(&dir).unwrap();
    let tensors: Vec<OutTensor> = ckpt
        .names()
        .into_iter()
        .filter(|n| *n != target)
        .map(|n| {
            let t = ckpt.get(n).unwrap();
            (n.to_string(), t.dtype, t.shape.to_vec(), t.bytes.to_vec())
        })
        .collect();
    drop(ckpt);
    gptq::write_tensors(&dir.join("model.safetensors"), &tensors).unwrap();
    let e = load(&dir).err().expect("load should fail");
    assert!(e.contains(target) && e.contains("desc_act"), "{e}");

    // A module the config excludes but the checkpoint stores packed.
    let dir = tempdir("gptq-excluded");
    let v =
        GptqVariant { method: "gptq", sym: true, act_order: false, v2: false, group: 128, write_trivial_g_idx: false };
    make_gptq(&dir, v, &[], None);
    gptq::set_quant_config(&dir, gptq::config(v, &["model.language_model.layers.1.mlp"])).unwrap();
    let e = load(&dir).err().expect("load should fail");
    assert!(e.contains("layers.1.mlp.") && e.contains("unquantised"), "{e}");

    // A GPTQ-packed checkpoint without quantization_config.
    let path = dir.join("config.json");
    let mut c: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    c.as_object_mut().unwrap().remove("quantization_config");
    std::fs::write(&path, c.to_string()).unwrap();
    let e = load(&dir).err().expect("load should fail");
    assert!(e.contains(".qweight") && e.contains("no quantization_config"), "{e}");
}

// ---------------------------------------------------------------------------------------------
// Block FP8, with an e4m3 encoder from the format's definition
// ---------------------------------------------------------------------------------------------

/// e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; subnormals at exponent 0; max 448; no inf.
fn e4m3_decode(b: u8) -> f32 {
    let s = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let e = ((b >> 3) & 0xf) as i32;
    let m = (b & 7) as f32;
    if e == 0 { s * m * 2f32.powi(-9) } else { s * (1.0 + m / 8.0) * 2f32.powi(e - 7) }
}

/// Round-to-nearest-even e4m3fn encoding, saturating at ±448. Non-negative codes are monotonic and
/// contiguous (a mantissa carry moves to the next binade), which keeps this short.
fn e4m3_encode(x: f32) -> u8 {
    let sign = if x.is_sign_negative() { 0x80 } else { 0 };
    let a = x.abs();
    if a >= 448.0 {
        return sign | 0x7e;
    }
    let rne = |v: f32| {
        let f = v.floor();
        let r = v - f;
        if r > 0.5 || (r == 0.5 && f as i32 % 2 == 1) { f as i32 + 1 } else { f as i32 }
    };
    let code = if a < 2f32.powi(-6) {
        rne(a / 2f32.powi(-9))
    } else {
        let e = a.log2().floor() as i32;
        let e = if 2f32.powi(e) > a { e - 1 } else { e }; // guard log2 rounding
        ((e + 7) << 3) + rne((a / 2f32.powi(e) - 1.0) * 8.0)
    };
    sign | code.min(0x7e) as u8
}

#[test]
fn e4m3_encoder_round_trips_every_code() {
    for b in 0..=255u8 {
        if b & 0x7f == 0x7f {
            assert!(deltaserve_model::quant::fp8_e4m3_to_f32(b).is_nan());
            continue;
        }
        let x = e4m3_decode(b);
        assert_eq!(deltaserve_model::quant::fp8_e4m3_to_f32(b).to_bits(), x.to_bits(), "code {b:#04x}");
        if x != 0.0 {
            assert_eq!(e4m3_encode(x), b, "{x}");
            assert_eq!(deltaserve_model::quant::fp8_e4m3_from_f32(x), b, "{x}");
        }
    }
    assert_eq!(e4m3_decode(0x7e), 448.0);
    // The library encoder against this one between the codes: exact midpoints (ties to even), just
    // either side of them, and beyond the largest finite code (saturating).
    let enc = deltaserve_model::quant::fp8_e4m3_from_f32;
    for b in 0..0x7eu8 {
        let (lo, hi) = (e4m3_decode(b), e4m3_decode(b + 1));
        let mid = (lo + hi) / 2.0;
        for x in [mid, f32::from_bits(mid.to_bits() - 1), f32::from_bits(mid.to_bits() + 1)] {
            assert_eq!(enc(x), e4m3_encode(x), "{x}");
            assert_eq!(enc(-x), e4m3_encode(-x), "{}", -x);
        }
    }
    assert_eq!(enc(1e9), 0x7e);
    assert_eq!(enc(-500.0), 0xfe);
    assert_eq!(enc(f32::NAN) & 0x7f, 0x7f);
}

fn make_fp8(dir: &Path, block: [usize; 2], not_converted: &[&str], scale_rows_cut: Option<&str>) -> Expect {
    write_model(dir, Preset::Tiny, None, 17, |_, _| {}).unwrap();
    let ckpt = Checkpoint::open(dir).unwrap();
    let mut tensors: Vec<OutTensor> = Vec::new();
    let mut exp = Expect { original: HashMap::new(), quantized: HashMap::new() };
    for name in ckpt.names() {
        let t = ckpt.get(name).unwrap();
        let module = name.trim_end_matches(".weight");
        exp.original.insert(name.to_string(), t.to_f32().unwrap());
        // in_proj_b (6 rows) is quantised here too: a single partial scale block.
        let quantize = gptq::is_decoder_linear(name, t.shape) && !not_converted.contains(&module);
        if !quantize {
            tensors.push((name.to_string(), t.dtype, t.shape.to_vec(), t.bytes.to_vec()));
            continue;
        }
        let (out, inp) = (t.shape[0], t.shape[1]);
        let w = t.to_f32().unwrap();
        let (br, bc) = (out.div_ceil(block[0]), inp.div_ceil(block[1]));
        let mut scale_inv = vec![0f32; br * bc];
        for (k, s) in scale_inv.iter_mut().enumerate() {
            let (r, c) = (k / bc, k % bc);
            let mut amax = 0f32;
            for o in r * block[0]..((r + 1) * block[0]).min(out) {
                for i in c * block[1]..((c + 1) * block[1]).min(inp) {
                    amax = amax.max(w[o * inp + i].abs());
                }
            }
            *s = if amax > 0.0 { amax / 448.0 } else { 1.0 };
        }
        let mut codes = vec![0u8; out * inp];
        let mut deq = vec![0f32; out * inp];
        let mut bound = vec![0f32; out * inp];
        for o in 0..out {
            for i in 0..inp {
                let s = scale_inv[(o / block[0]) * bc + i / block[1]];
                let c = e4m3_encode(w[o * inp + i] / s);
                codes[o * inp + i] = c;
                deq[o * inp + i] = e4m3_decode(c) * s;
                // Half an ulp: 2^-4 relative for normals, 2^-10 · s for subnormals.
                bound[o * inp + i] = w[o * inp + i].abs() / 16.0 + s * 2f32.powi(-10);
            }
        }
        exp.quantized.insert(name.to_string(), (deq, bound));
        tensors.push((name.to_string(), DType::F8E4M3, vec![out, inp], codes));
        let rows = if scale_rows_cut == Some(name) { br - 1 } else { br };
        tensors.push((
            format!("{module}.weight_scale_inv"),
            DType::F32,
            vec![rows, bc],
            scale_inv[..rows * bc].iter().flat_map(|s| s.to_le_bytes()).collect(),
        ));
    }
    drop(ckpt);
    gptq::write_tensors(&dir.join("model.safetensors"), &tensors).unwrap();
    gptq::set_quant_config(
        dir,
        json!({
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": block,
            "modules_to_not_convert": not_converted,
        }),
    )
    .unwrap();
    exp
}

#[test]
fn block_fp8_loads_exactly() {
    for (tag, block) in [("fp8-128", [128, 128]), ("fp8-32x64", [32, 64])] {
        let dir = tempdir(tag);
        let not_converted = ["model.language_model.layers.0.linear_attn.in_proj_a", "lm_head"];
        let exp = make_fp8(&dir, block, &not_converted, None);
        let cfg = ModelConfig::from_dir(&dir).unwrap();
        assert!(matches!(&cfg.quantization, Some(Quantization::Fp8Block(c)) if c.block == block));
        let (nq, worst) = check_loaded(&dir, &exp);
        // 3 DeltaNet layers × (qkv, z, b, a, out) − layer 0's in_proj_a, + 4 attention + 12 MLP.
        assert_eq!(nq, 3 * 5 - 1 + 4 + 12, "{tag}");
        assert!(worst > 0.3, "{tag}: {worst}");
    }
}

#[test]
fn block_fp8_wrong_scale_shape_is_named() {
    let dir = tempdir("fp8-scale");
    let target = "model.language_model.layers.3.self_attn.q_proj.weight";
    make_fp8(&dir, [128, 128], &[], Some(target));
    let e = load(&dir).err().expect("load should fail");
    // q_proj is [256, 128] → scales [2, 1]; the file holds [1, 1].
    assert!(
        e.contains("layers.3.self_attn.q_proj.weight_scale_inv") && e.contains("[1, 1]") && e.contains("[2, 1]"),
        "{e}"
    );
}

// ---------------------------------------------------------------------------------------------
// Block FP8 as `deltaserve synth --fp8` writes it (deltaserve_model::synth::fp8)
// ---------------------------------------------------------------------------------------------

/// A stored tensor: dtype, shape, bytes.
type Stored = (DType, Vec<usize>, Vec<u8>);

fn stored_tensors(dir: &Path) -> HashMap<String, Stored> {
    let ckpt = Checkpoint::open(dir).unwrap();
    ckpt.names()
        .into_iter()
        .map(|n| {
            let t = ckpt.get(n).unwrap();
            (n.to_string(), (t.dtype, t.shape.to_vec(), t.bytes.to_vec()))
        })
        .collect()
}

/// Writes `preset`, converts it with the FP8 rewrite and checks the result against the bf16 original:
/// the config, which linears are quantised, the stored codes and scales, the loaded (dequantised)
/// weights, and every other tensor byte for byte. Returns the number of quantised linears.
fn check_synth_fp8(tag: &str, preset: Preset) -> usize {
    let dir = tempdir(tag);
    write_model(&dir, preset, None, 29, |_, _| {}).unwrap();
    let before = stored_tensors(&dir);
    let mut last = (0, 0);
    let done = fp8::convert(&dir, |d, t| last = (d, t)).unwrap();
    assert!(last.0 == last.1 && last.1 > 0, "{tag}: progress ends at the total ({last:?})");

    // config.json: the official quantization_config, parsed as block FP8 with 128 × 128 blocks.
    let json: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let q = &json["quantization_config"];
    assert_eq!(q["quant_method"], "fp8");
    assert_eq!(q["fmt"], "e4m3");
    assert_eq!(q["activation_scheme"], "dynamic");
    assert_eq!(q["weight_block_size"], json!([128, 128]));
    assert_eq!(q["modules_to_not_convert"], json!(done.modules_to_not_convert));
    let cfg = ModelConfig::from_dir(&dir).unwrap();
    let Some(Quantization::Fp8Block(c)) = &cfg.quantization else { panic!("{tag}: {:?}", cfg.quantization) };
    assert_eq!(c.block, [128, 128]);
    assert_eq!(c.modules_to_not_convert, done.modules_to_not_convert);
    let quant = cfg.quantization.as_ref().unwrap();
    for m in &done.modules_to_not_convert {
        assert_eq!(quant.module(m), ModuleQuant::Excluded, "{m}");
    }
    // (the MoE list names the embedding `model.embed_tokens`, as its release does: the same module)
    for m in ["lm_head", "model.language_model.embed_tokens", "mtp.fc"] {
        assert_eq!(quant.module(m), ModuleQuant::Excluded, "{tag}: {m} not listed");
    }

    // Which linears are quantised: the decoder's and the MTP layer's, never the small DeltaNet
    // projections, routers, shared-expert gates, mtp.fc, lm_head, embeddings or the vision tower.
    let quantized: HashSet<&str> = done.quantized.iter().map(String::as_str).collect();
    for (name, (_, shape, _)) in &before {
        let linear = shape.len() == 2 && name.ends_with(".weight");
        let decoder = name.starts_with("model.language_model.layers.") || name.starts_with("mtp.layers.");
        let kept = ["in_proj_a.weight", "in_proj_b.weight", "mlp.gate.weight", "shared_expert_gate.weight"]
            .iter()
            .any(|s| name.ends_with(s));
        assert_eq!(quantized.contains(name.as_str()), linear && decoder && !kept, "{tag}: {name}");
    }

    let after = stored_tensors(&dir);
    let w = load(&dir).expect("the FP8 checkpoint loads");
    let flat = flatten(&w);
    let mut n_loaded = 0;
    for (name, (dtype, shape, bytes)) in &before {
        if !quantized.contains(name.as_str()) {
            assert_eq!(after.get(name), Some(&(*dtype, shape.clone(), bytes.clone())), "{tag}: {name} unchanged");
            continue;
        }
        let module = name.trim_end_matches(".weight");
        assert_eq!(quant.module(module), ModuleQuant::Fp8([128, 128]), "{module}");
        let (out, inp) = (shape[0], shape[1]);
        let (cd, cs, codes) = &after[name];
        assert_eq!((*cd, cs.clone()), (DType::F8E4M3, vec![out, inp]), "{name}");
        let (sd, ss, scale_bytes) = &after[&format!("{module}.weight_scale_inv")];
        let (br, bc) = (out.div_ceil(128), inp.div_ceil(128));
        assert_eq!((*sd, ss.clone()), (DType::F32, vec![br, bc]), "{name}");
        let scales: Vec<f32> =
            scale_bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
        let orig = TensorRef { name, dtype: *dtype, shape, bytes }.to_f32().unwrap();
        // The library quantiser's codes and scales, as written.
        let (want_codes, want_scales) = fp8_block_quantize(&orig, out, inp, [128, 128]);
        assert!(codes == &want_codes && scales == want_scales, "{name}: not the library quantiser's output");
        // Loaded: exactly code · scale (decoded here), within half an e4m3 step of the original.
        let got = &flat.get(name).unwrap_or_else(|| panic!("{name} not loaded")).data;
        assert_eq!(got.len(), out * inp);
        for (k, (&g, &x)) in got.iter().zip(&orig).enumerate() {
            let s = scales[(k / inp / 128) * bc + (k % inp) / 128];
            let deq = e4m3_decode(codes[k]) * s;
            assert!(g.to_bits() == deq.to_bits(), "{name}[{k}]: loaded {g}, code · scale = {deq}");
            let bound = x.abs() / 16.0 + s * 2f32.powi(-10);
            assert!((g - x).abs() <= bound * 1.0001, "{name}[{k}]: {g} vs {x} (bound {bound})");
        }
        let zero = orig.iter().all(|&x| x == 0.0);
        let num: f64 = got.iter().zip(&orig).map(|(a, b)| f64::from(a - b).powi(2)).sum();
        let den: f64 = orig.iter().map(|b| f64::from(*b).powi(2)).sum();
        let rel = if zero { 0.0 } else { (num / den).sqrt() };
        // e4m3 keeps 3 mantissa bits: about 2.5 % relative RMS error on these weights, never 0.
        assert!(zero || (0.005..0.04).contains(&rel), "{name}: relative RMS error {rel}");
        n_loaded += 1;
    }
    assert_eq!(n_loaded, done.quantized.len());
    done.quantized.len()
}

#[test]
fn synth_fp8_is_the_official_layout_and_loads_exactly() {
    // Tiny: 3 DeltaNet layers × (qkv, z, out) + 1 attention layer × 4 + 4 MLPs × 3, and the MTP
    // layer's q, k, v, o and MLP.
    assert_eq!(check_synth_fp8("synth-fp8-tiny", Preset::Tiny), 3 * 3 + 4 + 4 * 3 + 4 + 3);
    // Tiny MoE: every layer and the MTP layer with 8 experts and a shared expert, all quantised.
    assert_eq!(check_synth_fp8("synth-fp8-tiny-moe", Preset::TinyMoe), 3 * 3 + 4 + 4 * (8 + 1) * 3 + 4 + (8 + 1) * 3);
}

/// The lists of not-converted modules have the official releases' shapes: the dense one names only
/// the linears, conv and embedding kept (sorted), the MoE one every module that is not quantised;
/// Qwen3-Next's keeps its packed `in_proj_ba` and leaves the embedding out.
#[test]
fn fp8_modules_to_not_convert_follow_the_official_lists() {
    let cfg = |v: Value| ModelConfig::from_json_str(&v.to_string()).unwrap();
    let dense = fp8::modules_to_not_convert(&cfg(Preset::Qwen36_27b.config_json(None)));
    // lm_head, the embedding, 48 DeltaNet layers × 3, 27 vision blocks × 4 + 4, mtp.fc.
    assert_eq!(dense.len(), 259);
    let mut sorted = dense.clone();
    sorted.sort();
    assert_eq!(dense, sorted);
    assert_eq!(dense[..2], ["lm_head", "model.language_model.embed_tokens"]);
    assert_eq!(dense.last().map(String::as_str), Some("mtp.fc"));
    for m in ["model.language_model.layers.62.linear_attn.in_proj_b", "model.visual.blocks.26.mlp.linear_fc2"] {
        assert!(dense.iter().any(|x| x == m), "{m}");
    }

    let moe = fp8::modules_to_not_convert(&cfg(Preset::Qwen36_35bA3b.config_json(None)));
    let l0 = "model.language_model.layers.0.";
    for m in [
        "lm_head".to_string(),
        "model.embed_tokens".into(),
        format!("{l0}linear_attn.in_proj_ba"),
        format!("{l0}linear_attn.A_log"),
        format!("{l0}mlp.gate"),
        format!("{l0}mlp.shared_expert_gate"),
        "model.language_model.layers.3.self_attn.q_norm".into(),
        "mtp.layers.0.mlp.shared_expert_gate".into(),
        "mtp.pre_fc_norm_hidden".into(),
    ] {
        assert!(moe.contains(&m), "{m}");
    }
    // 40 layers: 30 DeltaNet (2 norms + 2 gates + 7) and 10 attention (2 norms + 2 gates + 2); 27 × 4 + 4
    // vision; 4 + 6 MTP; lm_head and the embedding.
    assert_eq!(moe.len(), 30 * 11 + 10 * 6 + 112 + 10 + 2);

    let next = fp8::modules_to_not_convert(&cfg(Preset::Qwen3Next80bA3b.config_json(None)));
    assert_eq!(next[..2], ["lm_head", "model.layers.0.input_layernorm"]);
    assert!(next.iter().all(|m| !m.contains("embed_tokens") && !m.contains("in_proj_a") && !m.contains("visual")));
    assert_eq!(next.len(), 36 * 9 + 12 * 6 + 10 + 1);
    assert!(fp8::is_quantized_linear(
        "model.layers.0.linear_attn.in_proj_qkvz.weight",
        &[12288, 2048],
        &next.iter().map(String::as_str).collect()
    ));
}

// ---------------------------------------------------------------------------------------------
// Config parsing
// ---------------------------------------------------------------------------------------------

fn config_with(q: Value) -> Result<ModelConfig, String> {
    let mut c = Preset::Tiny.config_json(None);
    c["quantization_config"] = q;
    ModelConfig::from_json_str(&c.to_string()).map_err(|e| e.to_string())
}

#[test]
fn unsupported_quantization_configs_are_named() {
    let e = config_with(json!({ "quant_method": "gptq", "bits": 8, "group_size": 128, "sym": true })).unwrap_err();
    assert!(e.contains("quantization_config.bits") && e.contains("8") && e.contains("not supported"), "{e}");
    let e = config_with(json!({ "quant_method": "awq", "bits": 4, "group_size": 128 })).unwrap_err();
    assert!(e.contains("quantization_config.quant_method") && e.contains("awq"), "{e}");
    let e = config_with(json!({ "quant_method": "auto-round", "bits": 4, "group_size": 128, "sym": true,
        "packing_format": "auto_round:auto_awq" }))
    .unwrap_err();
    assert!(e.contains("packing_format") && e.contains("auto_awq"), "{e}");
    let e = config_with(json!({ "quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin" }))
        .unwrap_err();
    assert!(e.contains("checkpoint_format") && e.contains("marlin"), "{e}");
    let e = config_with(json!({ "quant_method": "auto-round", "bits": 4, "group_size": 128, "sym": true,
        "extra_config": { "model.language_model.layers.0.mlp.down_proj": { "bits": 8 } } }))
    .unwrap_err();
    assert!(e.contains("extra_config.model.language_model.layers.0.mlp.down_proj.bits") && e.contains("8"), "{e}");
    let e = config_with(json!({ "quant_method": "fp8", "activation_scheme": "dynamic" })).unwrap_err();
    assert!(e.contains("weight_block_size"), "{e}");
    let e =
        config_with(json!({ "quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128] }))
            .unwrap_err();
    assert!(e.contains("activation_scheme") && e.contains("static"), "{e}");
    let e = config_with(json!({ "quant_method": "gptq", "bits": 4, "group_size": 0 })).unwrap_err();
    assert!(e.contains("group_size") && e.contains("0"), "{e}");

    // Under text_config (text-only layout) too.
    let mut t = Preset::Tiny.text_config(None);
    t["quantization_config"] = json!({ "quant_method": "bitsandbytes" });
    let e = ModelConfig::from_json_str(&t.to_string()).unwrap_err().to_string();
    assert!(e.contains("quant_method") && e.contains("bitsandbytes"), "{e}");
    t["quantization_config"] =
        json!({ "quant_method": "fp8", "weight_block_size": [128, 128], "ignored_layers": ["lm_head"] });
    let cfg = ModelConfig::from_json_str(&t.to_string()).unwrap();
    assert_eq!(cfg.quantization.as_ref().unwrap().module("lm_head"), ModuleQuant::Excluded);
}

#[test]
fn module_rules_follow_the_config() {
    let cfg = config_with(json!({
        "quant_method": "auto-round", "bits": 4, "group_size": 128, "sym": false,
        "block_name_to_quantize": "model.language_model.layers",
        "extra_config": {
            "model.language_model.layers.0.linear_attn.in_proj_a": { "bits": 16 },
            "model.language_model.layers.1.mlp.down_proj": { "group_size": -1, "sym": true },
        },
    }))
    .unwrap();
    let q = cfg.quantization.unwrap();
    assert_eq!(q.module("model.language_model.layers.0.linear_attn.in_proj_a"), ModuleQuant::Excluded);
    assert_eq!(q.module("lm_head"), ModuleQuant::Excluded, "outside block_name_to_quantize");
    let ModuleQuant::Gptq(p) = q.module("model.language_model.layers.1.mlp.down_proj") else { panic!() };
    assert!(p.sym && p.group_size.is_none() && p.bits == 4);
    let ModuleQuant::Gptq(p) = q.module("model.language_model.layers.1.mlp.up_proj") else { panic!() };
    assert!(!p.sym && p.group_size == Some(128));
    // Names with the text-only prefix match the same entries.
    assert_eq!(q.module("model.layers.0.linear_attn.in_proj_a"), ModuleQuant::Excluded);

    let none = Preset::Tiny.config(None);
    assert!(none.quantization.is_none());
}

#[test]
fn quantised_qwen3_next_packed_projection_is_refused_by_name() {
    let dir = tempdir("next-fp8");
    write_model(&dir, Preset::Tiny, None, 23, |_, _| {}).unwrap();
    let cfg = ModelConfig::from_dir(&dir).unwrap();
    let d = cfg.dims();
    let ckpt = Checkpoint::open(&dir).unwrap();
    let mut tensors: Vec<OutTensor> = Vec::new();
    for name in ckpt.names() {
        let t = ckpt.get(name).unwrap();
        let n = name.replace(P, "model.");
        if n.contains("in_proj_z") || n.contains("in_proj_a") {
            continue; // folded into the packed tensors below
        }
        if let Some(base) = n.strip_suffix("in_proj_qkv.weight") {
            let rows = 2 * d.gdn_key_width + 2 * d.gdn_value_width;
            tensors.push((
                format!("{base}in_proj_qkvz.weight"),
                DType::F8E4M3,
                vec![rows, d.hidden],
                vec![0x38; rows * d.hidden],
            ));
            let scale = 1f32.to_le_bytes().repeat(rows.div_ceil(128));
            tensors.push((
                format!("{base}in_proj_qkvz.weight_scale_inv"),
                DType::F32,
                vec![rows.div_ceil(128), 1],
                scale,
            ));
        } else if let Some(base) = n.strip_suffix("in_proj_b.weight") {
            tensors.push((
                format!("{base}in_proj_ba.weight"),
                t.dtype,
                vec![2 * d.gdn_v_heads, d.hidden],
                t.bytes.repeat(2),
            ));
        } else {
            tensors.push((n, t.dtype, t.shape.to_vec(), t.bytes.to_vec()));
        }
    }
    drop(ckpt);
    gptq::write_tensors(&dir.join("model.safetensors"), &tensors).unwrap();
    let mut c = Preset::Tiny.text_config(None);
    c["model_type"] = json!("qwen3_next");
    c["quantization_config"] = json!({ "quant_method": "fp8", "weight_block_size": [128, 128] });
    std::fs::write(dir.join("config.json"), c.to_string()).unwrap();
    let e = load(&dir).err().expect("load should fail");
    assert!(e.contains("layers.0.linear_attn.in_proj_qkvz.weight") && e.contains("Qwen3-Next"), "{e}");
}
