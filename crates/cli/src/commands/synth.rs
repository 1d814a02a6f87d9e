//! `deltaserve synth`: a complete random-weight model directory (config, bf16 safetensors, tokenizer, template).

use std::path::PathBuf;

use anyhow::Result;
use deltaserve_model::synth::{MtpVariant, Preset};
use indicatif::{ProgressBar, ProgressStyle};

#[derive(clap::Args)]
pub struct Args {
    /// Shape preset: tiny, tiny-moe, qwen3.6-27b, qwen3.6-35b-a3b or qwen3-next-80b-a3b.
    #[arg(long)]
    preset: String,
    /// Output directory.
    #[arg(long)]
    out: PathBuf,
    /// Number of decoder layers (default: the preset's).
    #[arg(long)]
    layers: Option<usize>,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Write an MTP head built to agree with the model (speculative decoding accepts its drafts), with
    /// the main layers' residual contributions scaled by this factor (0: every draft accepted; larger:
    /// fewer). Changes the main model too. Default: a random head (drafts rejected).
    #[arg(long)]
    mtp_agreeing: Option<f32>,
    /// Then rewrite the decoder linears as a 4-bit GPTQ checkpoint (round-to-nearest codes in the
    /// real GPTQ layout, group 128): `sym` (v1, as AutoGPTQ exports) or `asym-act-order` (zero points
    /// and a permuted column order). For testing GPTQ loading without a real export.
    #[arg(long, value_parser = ["sym", "asym-act-order"])]
    gptq: Option<String>,
    /// Then rewrite the decoder linears (the MTP layer's included, every expert's too) as block-FP8 in
    /// the layout of the official Qwen `-FP8` checkpoints: F8_E4M3 `weight` codes and F32
    /// `weight_scale_inv` per 128×128 block, with their `quantization_config`. What those keep in
    /// bf16 stays bf16: embeddings, lm_head, norms, conv, DeltaNet's in_proj_a/b, MoE routers and
    /// shared-expert gates, the MTP head's fc, the vision tower. (Qwen3-Next's packed in_proj_qkvz is
    /// quantised as in its official release, which deltaserve does not load yet.)
    #[arg(long, conflicts_with = "gptq")]
    fp8: bool,
    /// Write no weights: config.json, generation_config.json and the tokenizer files only, for
    /// `--model DIR --random-weights` (the preset's shapes, no weight files).
    #[arg(long, conflicts_with_all = ["mtp_agreeing", "gptq", "fp8"])]
    no_weights: bool,
}

pub fn run(a: Args) -> Result<()> {
    let preset = Preset::parse(&a.preset)?;
    if a.layers == Some(0) {
        anyhow::bail!("--layers must be at least 1");
    }
    if a.no_weights {
        deltaserve_text::synth_model::write_synthetic_config(&a.out, preset, a.layers)?;
        eprintln!("wrote the config and tokenizer of a {} model (no weights) to {}", a.preset, a.out.display());
        return Ok(());
    }
    let bar = ProgressBar::new(0).with_message("writing weights");
    bar.set_style(
        ProgressStyle::with_template("{msg} [{bar:40}] {bytes}/{total_bytes} ({eta})")?.progress_chars("=> "),
    );
    let mtp = match a.mtp_agreeing {
        Some(residual_scale) if residual_scale.is_finite() && residual_scale >= 0.0 => {
            MtpVariant::Agreeing { residual_scale }
        }
        Some(x) => anyhow::bail!("--mtp-agreeing {x}: a residual scale ≥ 0"),
        None => MtpVariant::Random,
    };
    deltaserve_text::synth_model::write_synthetic_model_with(&a.out, preset, a.layers, a.seed, mtp, |done, total| {
        bar.set_length(total);
        bar.set_position(done);
    })?;
    bar.finish_and_clear();
    if let Some(kind) = &a.gptq {
        use deltaserve_model::synth::gptq::{self, GptqVariant};
        let v = if kind == "sym" { GptqVariant::SYM } else { GptqVariant::ASYM_ACT_ORDER };
        let done = gptq::convert(&a.out, v, &[], a.seed, |_| {})?;
        eprintln!("packed {} decoder linears as GPTQ int4 ({kind}, group 128)", done.quantized.len());
    }
    if a.fp8 {
        let bar = ProgressBar::new(0).with_message("writing FP8 weights");
        bar.set_style(
            ProgressStyle::with_template("{msg} [{bar:40}] {bytes}/{total_bytes} ({eta})")?.progress_chars("=> "),
        );
        let done = deltaserve_model::synth::fp8::convert(&a.out, |done, total| {
            bar.set_length(total);
            bar.set_position(done);
        })?;
        bar.finish_and_clear();
        eprintln!(
            "quantised {} linears to block FP8 e4m3 (128x128 scale blocks; {} modules listed as not converted)",
            done.quantized.len(),
            done.modules_to_not_convert.len()
        );
    }
    eprintln!("wrote a {} model with RANDOM weights to {}", a.preset, a.out.display());
    Ok(())
}
