//! `deltaserve plan`: the static memory plan (what fits in a memory budget), from a model's
//! `config.json` (a directory, or a Hugging Face id: only that file is downloaded) or a built-in preset
//! shape. Touches no device; reads no weights (of a quantised checkpoint planned int4 it walks the tensor
//! headers and act-order indices, as `serve` does, where the weights are on disk).

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use deltaserve_model::ModelConfig;
use deltaserve_model::synth::Preset;
use deltaserve_plan::{
    Fitted, Free, KvDtype, PlanOptions, StateDtype, WeightsDtype, card_config, fit_context, parse_size,
};

#[derive(clap::Args)]
pub struct Args {
    /// A Hugging Face model id (owner/name[@revision]: only its config.json is downloaded) or a model
    /// directory (config.json; a quantised checkpoint's tensor headers).
    #[arg(long, conflicts_with = "preset")]
    model: Option<PathBuf>,
    /// Shape preset instead of a model directory: tiny, tiny-moe, qwen3.6-27b, qwen3.6-35b-a3b or
    /// qwen3-next-80b-a3b.
    #[arg(long)]
    preset: Option<String>,
    /// Number of decoder layers of the preset (default: the preset's).
    #[arg(long, requires = "preset")]
    layers: Option<usize>,
    /// Memory budget (the arena cap, runtime reserve included): 24GiB, 24G, 512MiB, 1.5GiB or bytes. With
    /// --tensor-parallel: one card's budget (with cards of different sizes, the smallest card's).
    #[arg(long, default_value = "24GiB", value_parser = parse_size)]
    memory: u64,
    /// Split the model over N cards (1, 2, 4 or 8; it must divide the attention kv heads and the DeltaNet
    /// key heads). The plan is then per card: the card's weight shards, KV of its kv heads, state of its
    /// DeltaNet value heads.
    #[arg(long, visible_alias = "tensor-parallel-size", default_value_t = 1)]
    tensor_parallel: usize,
    /// Storage of the decoder linears: bf16, fp16, fp32, int4, fp8 (default: bf16 on cuda, fp32 on cpu).
    #[arg(long)]
    weights_dtype: Option<WeightsDtype>,
    /// int4 weights carry packed int4 zero points (asymmetric).
    #[arg(long)]
    int4_asym: bool,
    /// Store lm_head as int4 (group 128, fp16 scales).
    #[arg(long)]
    lm_head_int4: bool,
    /// Keep the embedding table in pinned host memory, outside --memory.
    #[arg(long)]
    embed_on_host: bool,
    /// A mixture-of-experts model: keep its routed experts in pinned host memory, outside --memory (the
    /// GPU reads the experts each token picks across PCIe). Default: the fit chooses it on CUDA when nothing
    /// else comes near the full context.
    #[arg(long)]
    experts_on_host: bool,
    /// KV cache dtype for K and V: bf16, fp16, fp32, fp8, int8, int4 (default: bf16 on cuda, fp32 on cpu).
    #[arg(long)]
    kv_cache_dtype: Option<KvDtype>,
    /// K cache dtype (overrides --kv-cache-dtype for K).
    #[arg(long)]
    k_cache_dtype: Option<KvDtype>,
    /// V cache dtype (overrides --kv-cache-dtype for V).
    #[arg(long)]
    v_cache_dtype: Option<KvDtype>,
    /// DeltaNet recurrent state storage: fp32 (default) or bf16 (half the state's bytes), as `serve
    /// --state-dtype` (the CPU backend keeps f32).
    #[arg(long)]
    state_dtype: Option<StateDtype>,
    /// MTP speculation with K draft tokens a step (1..=4; 0: off), as `serve --speculative-tokens`:
    /// prices the MTP head's weights and KV, the verify workspace and the draft logits.
    #[arg(long, default_value_t = 0)]
    speculative_tokens: usize,
    /// The most patches of one image the vision tower runs (as `serve`): prices the tower's activation
    /// workspace for this many. Default: the larger of 4096 and one image at the pixel budget of the
    /// model's preprocessor_config.json (65,536 for Qwen3.5/3.6). The tower (weights and workspace) is
    /// priced where the backend runs it: --device cpu, or CUDA on one card. Given, it also keeps the GPU
    /// tower in a plan that the full context would otherwise trade it for.
    #[arg(long, value_name = "N")]
    max_image_tokens_per_step: Option<usize>,
    /// Price no vision tower (as `serve --no-vision`, which loads none).
    #[arg(long)]
    no_vision: bool,
    /// Tokens per engine step (chunked prefill + decodes). Default: 4096 on cuda, 512 on cpu.
    #[arg(long)]
    max_batch_tokens: Option<usize>,
    /// Sequences per step (DeltaNet state slots). Default: 16 on cuda, 4 on cpu.
    #[arg(long)]
    max_seqs: Option<usize>,
    /// Context every sequence must be able to fill; error if it does not fit. Default: as large as fits.
    #[arg(long, short = 'c', visible_aliases = ["max-model-len", "ctx-size"])]
    max_context: Option<usize>,
    /// Tokens per KV page.
    #[arg(long)]
    page_size: Option<usize>,
    /// DeltaNet state snapshots kept on the device. Default: 8 on cuda, 2 on cpu.
    #[arg(long)]
    snapshot_slots: Option<usize>,
    /// Memory counted against --memory for the CUDA context, modules and handles. Default: 600MiB on cuda, 0 on cpu.
    #[arg(long, value_parser = parse_size)]
    runtime_reserve: Option<u64>,
    /// Plan exactly the settings given (the largest context that fits them) instead of aiming at the model's
    /// full context by trading the options left unset (snapshot slots, sequences per step, embedding on
    /// the host, int4 lm_head with int4 weights, a mixture of experts' routed experts on the host).
    #[arg(long)]
    no_fit: bool,
    /// Device the plan is for: cuda or cpu.
    #[arg(long, default_value = "cuda")]
    device: String,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
    /// Also print the activation workspace buffer by buffer.
    #[arg(long)]
    workspace: bool,
    /// Write an SVG chart of the plan to FILE.
    #[arg(long, value_name = "FILE")]
    svg: Option<PathBuf>,
}

pub fn run(a: Args) -> Result<()> {
    let dir = a.model.as_deref().map(|m| crate::hub::resolve(m, crate::hub::Need::Config)).transpose()?;
    let cfg = match (&dir, &a.preset) {
        (Some(dir), _) => ModelConfig::from_dir(dir).with_context(|| format!("reading {}", dir.display()))?,
        (None, Some(name)) => {
            if a.layers == Some(0) {
                bail!("--layers must be at least 1");
            }
            let json = Preset::parse(name)?.config_json(a.layers);
            ModelConfig::from_json_str(&json.to_string())?
        }
        (None, None) => bail!(
            "pass --model ID|DIR (a Hugging Face id or a directory with config.json) or --preset NAME (tiny, tiny-moe, qwen3.6-27b, qwen3.6-35b-a3b, qwen3-next-80b-a3b)"
        ),
    };
    let mut o = match a.device.as_str() {
        "cuda" | "gpu" => PlanOptions::gpu_defaults(a.memory),
        "cpu" => PlanOptions::cpu_defaults(a.memory),
        other => bail!("unknown --device `{other}` (expected cuda or cpu)"),
    };
    if let Some(w) = a.weights_dtype {
        o.weights_dtype = w;
    }
    o.int4_asym = a.int4_asym;
    let gpu = a.device != "cpu";
    // A GPTQ checkpoint is int4 by itself on CUDA (as `serve` loads it).
    if gpu
        && a.model.is_some()
        && let Some(asym) = crate::model_source::gptq_int4(&cfg, a.weights_dtype, false)?
    {
        o.weights_dtype = WeightsDtype::Int4;
        o.int4_asym = asym || a.int4_asym;
    }
    o.lm_head_int4 = a.lm_head_int4;
    o.embed_on_host = a.embed_on_host;
    if a.experts_on_host && !gpu {
        bail!("--experts-on-host: a CUDA backend option (the CPU reference keeps every weight in host memory)");
    }
    o.experts_on_host = a.experts_on_host;
    if let Some(kv) = a.kv_cache_dtype {
        (o.k_dtype, o.v_dtype) = (kv, kv);
    }
    o.k_dtype = a.k_cache_dtype.unwrap_or(o.k_dtype);
    o.v_dtype = a.v_cache_dtype.unwrap_or(o.v_dtype);
    o.state_dtype = a.state_dtype.unwrap_or_default();
    o.max_batch_tokens = a.max_batch_tokens.unwrap_or(o.max_batch_tokens);
    o.max_seqs = a.max_seqs.unwrap_or(o.max_seqs);
    o.max_context = a.max_context;
    o.speculative_tokens = a.speculative_tokens;
    o.page_size = a.page_size.unwrap_or(o.page_size);
    o.snapshot_slots = a.snapshot_slots.unwrap_or(o.snapshot_slots);
    o.runtime_reserve_bytes = a.runtime_reserve.unwrap_or(o.runtime_reserve_bytes);
    // The model's vision tower (unless --no-vision): the CPU backend's, or the CUDA backend's on one card.
    let tower_here = !gpu || a.tensor_parallel <= 1;
    o.max_image_tokens_per_step = (tower_here && !a.no_vision && cfg.vision.is_some())
        .then(|| crate::model_source::max_image_tokens_per_step(a.max_image_tokens_per_step, dir.as_deref()));
    o.set_tensor_parallel(a.tensor_parallel);
    // A size that splits a head group is refused here, naming the heads.
    card_config(&cfg, a.tensor_parallel)?;
    // What the CUDA backend carves beside the activation workspace (as `serve --device cuda` plans it,
    // one card's under tensor parallelism).
    if gpu {
        // A Hub model whose weights are not downloaded is planned from its config alone.
        let checkpoint = dir.as_deref().filter(|d| a.model.as_deref() == Some(*d) || crate::hub::has_weights(d));
        if dir.is_some() && checkpoint.is_none() && cfg.quantization.is_some() && o.weights_dtype == WeightsDtype::Int4
        {
            tracing::warn!(
                "planned from config.json alone: the backend scratch this quantised checkpoint's tensors need beyond \
                 the weights is counted once its weights are downloaded (`serve` counts it)"
            );
        }
        o.backend = crate::model_source::cuda_plan_backend(&cfg, checkpoint, &o)?;
    }
    let free = if a.no_fit {
        Free::default()
    } else {
        Free {
            max_seqs: a.max_seqs.is_none(),
            snapshot_slots: a.snapshot_slots.is_none(),
            embed_on_host: gpu,
            lm_head_int4: gpu,
            // As `serve` plans: the GPU tower may be left out unless the user asked for images.
            vision: gpu && a.max_image_tokens_per_step.is_none(),
            // A mixture of experts' routed experts may go to the host (one card).
            experts_on_host: gpu && a.tensor_parallel <= 1,
        }
    };
    let fitted = fit_context(&cfg, &o, free)?;
    let plan = &fitted.plan;
    if let Some(path) = &a.svg {
        std::fs::write(path, plan.svg()).with_context(|| format!("writing {}", path.display()))?;
    }
    if a.json {
        let mut j = plan.to_json();
        j["fit"] = fit_json(&fitted);
        println!("{}", serde_json::to_string_pretty(&j)?);
    } else {
        print!("{}", plan.table());
        print!("{}", fit_text(&fitted));
        if a.workspace {
            println!();
            print!("{}", plan.workspace_table());
        }
        if let Some(path) = &a.svg {
            println!("wrote {}", path.display());
        }
    }
    Ok(())
}

/// The `fit` object of `plan --json`: what was aimed at and what the planner changed to get there.
fn fit_json(f: &Fitted) -> serde_json::Value {
    serde_json::json!({
        "target_context": f.target_context,
        "reached": f.shortfall.is_none(),
        "adjustments": f.adjustments,
        "shortfall": f.shortfall,
        "hint": f.hint,
        "note": f.note,
    })
}

/// The lines under the plan table saying what the planner changed (nothing when it changed nothing).
fn fit_text(f: &Fitted) -> String {
    let mut s = String::new();
    const OVERRIDE: &str = "set these options to override; --no-fit plans the settings as given";
    match &f.shortfall {
        None if !f.adjustments.is_empty() => {
            s += &format!(
                "fit: to fill the full context ({} tokens) the planner set {} ({OVERRIDE})\n",
                deltaserve_plan::fmt_count(f.target_context as u64),
                f.adjustments.join(", ")
            );
        }
        None => {}
        Some(why) if !f.adjustments.is_empty() => s += &format!("fit: {why} ({OVERRIDE})\n"),
        Some(why) => s += &format!("fit: {why}\n"),
    }
    if let Some(hint) = &f.hint {
        s += &format!("hint: {hint}\n");
    }
    if let Some(note) = &f.note {
        s += &format!("note: {note}\n");
    }
    s
}
