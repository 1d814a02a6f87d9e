//! Image preprocessing against Hugging Face's Qwen2-VL image processor (`fixtures/hf/image_preprocess`):
//! grids exact, pixels bit-close where no resize happens and within one 8-bit step otherwise (JPEG: see below).

use std::path::PathBuf;

use deltaserve_media::{ImageProcessorConfig, decode, preprocess};
use safetensors::SafeTensors;
use serde_json::Value;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/hf/image_preprocess")
}

fn f32s(st: &SafeTensors, name: &str) -> Vec<f32> {
    let t = st.tensor(name).unwrap();
    t.data().chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect()
}

fn i64s(st: &SafeTensors, name: &str) -> Vec<i64> {
    let t = st.tensor(name).unwrap();
    t.data().chunks_exact(8).map(|b| i64::from_le_bytes(b.try_into().unwrap())).collect()
}

#[test]
fn matches_hugging_face_image_processor() {
    let dir = fixtures();
    let cases: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("cases.json")).unwrap()).unwrap();
    let bytes = std::fs::read(dir.join("preprocess.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let cases_list = cases["cases"].as_array().unwrap();
    assert_eq!(cases_list.len(), 5);
    for case in cases_list {
        let name = case["name"].as_str().unwrap();
        let cfg = ImageProcessorConfig::from_json(
            &serde_json::json!({
                "patch_size": cases["patch_size"], "temporal_patch_size": cases["temporal_patch_size"],
                "merge_size": cases["merge_size"], "image_mean": cases["image_mean"], "image_std": cases["image_std"],
                "resample": 3, "rescale_factor": 1.0 / 255.0,
                "size": {"shortest_edge": case["min_pixels"], "longest_edge": case["max_pixels"]},
            })
            .to_string(),
        )
        .unwrap();
        let img = decode(&std::fs::read(dir.join(case["file"].as_str().unwrap())).unwrap()).unwrap();
        assert_eq!(
            (img.height as u64, img.width as u64),
            (case["height"].as_u64().unwrap(), case["width"].as_u64().unwrap())
        );
        let out = preprocess(&cfg, &img).unwrap();
        let grid: Vec<i64> = out.grid_thw.iter().map(|&v| v as i64).collect();
        assert_eq!(grid, i64s(&st, &format!("{name}.image_grid_thw")), "{name}: grid");
        let want = f32s(&st, &format!("{name}.pixel_values"));
        assert_eq!(out.pixels.len(), want.len(), "{name}: pixel count");
        let max_diff = out.pixels.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        let resized = out.grid_thw[1] * cfg.patch_size != img.height as usize
            || out.grid_thw[2] * cfg.patch_size != img.width as usize;
        // One 8-bit step is 1/255 before normalising, 2/255 after normalising with std 0.5.
        let step = 2.0 / 255.0;
        if name == "jpeg" {
            // Pillow's libjpeg-turbo and our decoder round the IDCT and colour conversion differently: a few
            // pixels differ by up to 3 steps, on average far less than one.
            let mean = out.pixels.iter().zip(&want).map(|(a, b)| (a - b).abs()).sum::<f32>() / want.len() as f32;
            assert!(max_diff <= 3.0 * step + 1e-6, "{name}: max |diff| {max_diff}");
            assert!(mean <= 0.25 * step, "{name}: mean |diff| {mean}");
        } else {
            let tolerance = if resized { step + 1e-6 } else { 1e-6 };
            assert!(max_diff <= tolerance, "{name}: max |diff| {max_diff} > {tolerance}");
        }
    }
}
