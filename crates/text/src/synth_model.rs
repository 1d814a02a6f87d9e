//! Complete synthetic model directories (weights + config from `deltaserve-model`, tokenizer and chat
//! template from this crate), and the built-in demo model: the `tiny` preset with seed 0,
//! generated deterministically on first use. Its weights are random: it produces gibberish.

use std::path::{Path, PathBuf};

use deltaserve_model::ModelError;
use deltaserve_model::synth::{MtpVariant, Preset, write_model_with};

/// Version of the demo model's recipe; bump when the synthetic generator changes.
const DEMO_VERSION: &str = "tiny-seed0-v3";

/// Writes a full model directory for `preset`.
pub fn write_synthetic_model(
    dir: &Path,
    preset: Preset,
    layers: Option<usize>,
    seed: u64,
    progress: impl FnMut(u64, u64),
) -> Result<(), ModelError> {
    write_synthetic_model_with(dir, preset, layers, seed, MtpVariant::Random, progress)
}

/// [`write_synthetic_model`] with a chosen MTP head (an agreeing one makes speculative decoding accept).
pub fn write_synthetic_model_with(
    dir: &Path,
    preset: Preset,
    layers: Option<usize>,
    seed: u64,
    mtp: MtpVariant,
    progress: impl FnMut(u64, u64),
) -> Result<(), ModelError> {
    write_model_with(dir, preset, layers, seed, mtp, progress)?;
    let tokenizer = crate::synthetic_tokenizer_json(preset.tokenizer_mergeable())
        .map_err(|e| ModelError::config(format!("synthetic tokenizer: {e}")))?;
    let files = [
        ("tokenizer.json", tokenizer),
        ("tokenizer_config.json", crate::synthetic_tokenizer_config_json_for(preset.tokenizer_mergeable())),
    ];
    for (name, text) in files {
        let path = dir.join(name);
        std::fs::write(&path, text).map_err(|e| ModelError::io(&path, e))?;
    }
    Ok(())
}

/// A model directory with the config, tokenizer and chat template of `preset` but no weights: for
/// backends that generate random weights at the real shapes themselves (`--random-weights`).
pub fn write_synthetic_config(dir: &Path, preset: Preset, layers: Option<usize>) -> Result<(), ModelError> {
    std::fs::create_dir_all(dir).map_err(|e| ModelError::io(dir, e))?;
    let mergeable = preset.tokenizer_mergeable();
    let files = [
        ("config.json", preset.config_json(layers).to_string()),
        ("generation_config.json", serde_json::json!({ "eos_token_id": [mergeable + 2, mergeable] }).to_string()),
        (
            "tokenizer.json",
            crate::synthetic_tokenizer_json(mergeable)
                .map_err(|e| ModelError::config(format!("synthetic tokenizer: {e}")))?,
        ),
        ("tokenizer_config.json", crate::synthetic_tokenizer_config_json_for(mergeable)),
    ];
    for (name, text) in files {
        let path = dir.join(name);
        std::fs::write(&path, text).map_err(|e| ModelError::io(&path, e))?;
    }
    Ok(())
}

/// deltaserve's cache directory: `$DELTASERVE_CACHE`, else `$XDG_CACHE_HOME/deltaserve`, else
/// `~/.cache/deltaserve`, else a temporary directory.
pub fn cache_dir() -> PathBuf {
    std::env::var_os("DELTASERVE_CACHE")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("XDG_CACHE_HOME").map(|p| PathBuf::from(p).join("deltaserve")))
        .or_else(|| std::env::var_os("HOME").map(|p| PathBuf::from(p).join(".cache/deltaserve")))
        .unwrap_or_else(|| std::env::temp_dir().join("deltaserve"))
}

/// The demo model's directory, generated on first use under the cache dir
/// (`$DELTASERVE_CACHE`, else `$XDG_CACHE_HOME/deltaserve`, else `~/.cache/deltaserve`).
pub fn demo_model_dir() -> Result<PathBuf, ModelError> {
    let base = cache_dir();
    let dir = base.join(format!("demo-{DEMO_VERSION}"));
    let marker = dir.join(".complete");
    if !marker.exists() {
        // Build next to the final place, then rename, so a crash never leaves a half-written model.
        let tmp = base.join(format!("demo-{DEMO_VERSION}.tmp-{}", std::process::id()));
        write_synthetic_model(&tmp, Preset::Tiny, None, 0, |_, _| {})?;
        std::fs::write(tmp.join(".complete"), DEMO_VERSION).map_err(|e| ModelError::io(&tmp, e))?;
        if std::fs::rename(&tmp, &dir).is_err() {
            // Another process won the race; use its copy.
            let _ = std::fs::remove_dir_all(&tmp);
        }
    }
    Ok(dir)
}
