//! The HF fixture `fixtures/hf/qwen35_vision` (`scripts/hf_vision_fixtures.py`) and HF's tensors of it,
//! shared by the CPU model's vision tests and the engine's image tests (`#[path]`).
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::Arc;

use deltaserve_cpu::CpuModel;
use deltaserve_model::{Checkpoint, DType, ImagePatches, ModelConfig, ModelWeights, VisionWeights};

/// The fixture's directory.
pub fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/hf/qwen35_vision")
}

/// The model in `dir` with its vision tower, in f32.
pub fn load(dir: &Path) -> CpuModel {
    let cfg = ModelConfig::from_dir(dir).unwrap();
    let ckpt = Checkpoint::open(dir).unwrap();
    let w = ModelWeights::load_f32(&ckpt, &cfg).unwrap();
    let v = VisionWeights::load_f32(&ckpt, &cfg).unwrap();
    assert!(v.is_some(), "{} has a vision tower", dir.display());
    CpuModel::new(cfg, w).with_vision(v)
}

/// HF's tensors of the fixture.
pub struct Reference(Checkpoint);

impl Reference {
    pub fn open() -> Self {
        Self(Checkpoint::open_file(&fixture().join("reference.safetensors")).unwrap())
    }
    pub fn f32(&self, name: &str) -> Vec<f32> {
        self.0.get(name).unwrap().to_f32().unwrap()
    }
    pub fn i64(&self, name: &str) -> Vec<i64> {
        let t = self.0.get(name).unwrap();
        assert_eq!(t.dtype, DType::Other("I64"), "{name}");
        t.bytes.chunks_exact(8).map(|b| i64::from_le_bytes(b.try_into().unwrap())).collect()
    }
    pub fn ids(&self, name: &str) -> Vec<u32> {
        self.i64(name).into_iter().map(|v| v as u32).collect()
    }
    /// The prompt's images (HF's pixel values split by grid), hashed 1, 2, ….
    pub fn images(&self) -> Vec<ImagePatches> {
        let grids = self.i64("image_grid_thw");
        let pixels = self.f32("pixel_values");
        let row = pixels.len() / grids.chunks(3).map(|g| g.iter().product::<i64>() as usize).sum::<usize>();
        let mut at = 0;
        grids
            .chunks(3)
            .enumerate()
            .map(|(i, g)| {
                let grid_thw = [g[0] as usize, g[1] as usize, g[2] as usize];
                let n = grid_thw.iter().product::<usize>() * row;
                at += n;
                ImagePatches { grid_thw, pixels: pixels[at - n..at].to_vec(), hash: [i as u8 + 1; 32] }
            })
            .collect()
    }
    /// [`Reference::images`] as requests carry them.
    pub fn shared_images(&self) -> Vec<Arc<ImagePatches>> {
        self.images().into_iter().map(Arc::new).collect()
    }
}
