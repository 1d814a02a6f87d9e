//! The vision tower and prompts with images against HF transformers 5.17 (fp32) on the
//! `fixtures/hf/qwen35_vision` model (made by `scripts/hf_vision_fixtures.py`): two images of different
//! grids in one prompt. The M-RoPE positions are exact; the tower's patch embedding, first block and
//! merger output, the full prompt's logits and 8 cached greedy decode steps after it are within 1e-3 of
//! HF relative to the largest magnitude, with the same greedy ids.

#[path = "hf_vision_fixture/mod.rs"]
mod hf_vision_fixture;

use deltaserve_cpu::{CpuModel, GdnMode, Logits, VisionTower};
use deltaserve_model::mrope::rope_index;

use hf_vision_fixture::{Reference, fixture, load};

const TOL: f32 = 1e-3;

/// max |ours − ref| / max |ref|.
fn rel_err(ours: &[f32], reference: &[f32]) -> f32 {
    assert_eq!(ours.len(), reference.len());
    let scale = reference.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let worst = ours.iter().zip(reference).fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
    worst / scale
}

fn close(what: &str, ours: &[f32], reference: &[f32]) {
    let e = rel_err(ours, reference);
    println!("{what}: max rel err {e:.2e}");
    assert!(e < TOL, "{what} differs from HF by {e:.3e} (relative to the largest magnitude)");
}

#[test]
fn positions_equal_hf_get_rope_index() {
    let (model, r) = (load(&fixture()), Reference::open());
    let ids = r.ids("input_ids");
    let vc = model.config.vision.as_ref().unwrap();
    let grids: Vec<[usize; 3]> = r.images().iter().map(|i| i.grid_thw).collect();
    let m = rope_index(&ids, vc.image_token_id, &grids, vc.spatial_merge_size).unwrap();
    let want = r.i64("position_ids"); // [3, T]
    let t = ids.len();
    for (i, p) in m.positions.iter().enumerate() {
        let hf = [want[i], want[t + i], want[2 * t + i]];
        assert_eq!(p.map(|v| v as i64), hf, "token {i}");
    }
    assert_eq!(m.delta, -20, "reference.json's rope delta");
}

#[test]
fn tower_intermediates_match_hf() {
    let (model, r) = (load(&fixture()), Reference::open());
    let tower: VisionTower = model.vision_tower().unwrap();
    let images = r.images();
    let (mut patch, mut block0, mut merged) = (Vec::new(), Vec::new(), Vec::new());
    for img in &images {
        tower.check(0, img).unwrap();
        let mut x = tower.patch_embed(img);
        patch.extend_from_slice(&x);
        tower.add_position_embeddings(&mut x, img.grid_thw);
        tower.block(0, &mut x, img.grid_thw);
        block0.extend_from_slice(&x);
        for i in 1..model.vision.as_ref().unwrap().blocks.len() {
            tower.block(i, &mut x, img.grid_thw);
        }
        merged.extend(tower.merge(&x));
    }
    close("patch_embeds", &patch, &r.f32("patch_embeds"));
    close("block0", &block0, &r.f32("block0"));
    close("image_embeds", &merged, &r.f32("image_embeds"));
    close("encode_images", &model.encode_images(&images).unwrap(), &r.f32("image_embeds"));
}

#[test]
fn prompt_with_images_and_cached_decode_match_hf() {
    let (model, r) = (load(&fixture()), Reference::open());
    let ids = r.ids("input_ids");
    let images = r.images();
    let mut st = model.new_sequence();
    let logits = model.forward_with_images(&mut st, &ids, &images, GdnMode::Auto, Logits::All).unwrap();
    close("prompt logits", &logits, &r.f32("logits"));
    assert_eq!(st.rope_delta, -20);

    let vocab = model.dims.vocab;
    let decode_ids = r.ids("decode_ids");
    let want = r.f32("decode_logits");
    let mut last = logits[logits.len() - vocab..].to_vec();
    for (step, expected) in want.chunks_exact(vocab).enumerate() {
        close(&format!("decode step {step}"), &last, expected);
        let next = argmax(&last);
        assert_eq!(next, decode_ids[ids.len() + step], "greedy id at decode step {step}");
        last = model.forward(&mut st, &[next], GdnMode::Auto, Logits::Last).unwrap();
    }
}

#[test]
fn images_are_refused_without_a_tower_and_when_they_do_not_fit() {
    let r = Reference::open();
    let (ids, images) = (r.ids("input_ids"), r.images());
    let text_only = CpuModel::load(&fixture()).unwrap();
    let mut st = text_only.new_sequence();
    let e = text_only.forward_with_images(&mut st, &ids, &images, GdnMode::Auto, Logits::Last).unwrap_err();
    assert!(e.to_string().contains("no vision tower"), "{e}");

    let model = load(&fixture());
    let mut st = model.new_sequence();
    let e = model.forward_with_images(&mut st, &ids, &images[..1], GdnMode::Auto, Logits::Last).unwrap_err();
    assert!(e.to_string().contains("has no image"), "{e}");
    let mut bad = images.clone();
    bad[1].pixels.pop();
    let e = model.forward_with_images(&mut st, &ids, &bad, GdnMode::Auto, Logits::Last).unwrap_err();
    assert!(e.to_string().contains("image 1"), "{e}");
    assert_eq!(st.len, 0, "a refused call leaves the sequence as it was");
}

fn argmax(v: &[f32]) -> u32 {
    v.iter().enumerate().fold((0, f32::NEG_INFINITY), |(bi, bv), (i, &x)| if x > bv { (i, x) } else { (bi, bv) }).0
        as u32
}
