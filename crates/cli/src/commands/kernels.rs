//! `deltaserve kernels check`: compiles every CUDA kernel with NVRTC for sm_80, sm_86, sm_89 and
//! sm_90, specialised to a model's dims. Needs NVRTC only (no GPU): CI runs it with NVIDIA's pip wheel.

use anyhow::{Result, bail};
use deltaserve_cuda::{KernelDims, kernels_check};
use deltaserve_model::ModelConfig;
use deltaserve_model::synth::Preset;

#[derive(clap::Subcommand)]
pub enum Command {
    /// Compile every kernel for every target architecture and report registers, spills, instruction
    /// counts and errors.
    Check(CheckArgs),
}

#[derive(clap::Args)]
pub struct CheckArgs {
    /// Comma-separated targets.
    #[arg(long, default_value = "sm_80,sm_86,sm_89,sm_90")]
    arch: String,
    /// Specialise to this model's dims: a directory or a Hugging Face id (its config.json alone is
    /// downloaded). Default: the Qwen3.6-27B preset.
    #[arg(long)]
    model: Option<std::path::PathBuf>,
}

pub fn run(c: Command) -> Result<()> {
    let Command::Check(a) = c;
    let cfg = match &a.model {
        Some(dir) => ModelConfig::from_dir(&crate::hub::resolve(dir, crate::hub::Need::Config)?)?,
        None => ModelConfig::from_json_str(&Preset::Qwen36_27b.config_json(None).to_string())?,
    };
    let d = cfg.dims();
    let dims = KernelDims {
        gdn_k_dim: d.gdn_k_dim,
        gdn_v_dim: d.gdn_v_dim,
        conv_kernel: d.conv_kernel,
        attn_head_dim: d.head_dim,
        gqa_group: d.q_per_kv,
        ..KernelDims::QWEN35_27B
    };
    if !deltaserve_cuda::nvrtc::nvrtc_present() {
        bail!(
            "NVRTC (libnvrtc.so.13) was not found: install a CUDA 13 toolkit, or `pip install nvidia-cuda-nvrtc==13.0.88` \
             and put its nvidia/cu13/lib directory on LD_LIBRARY_PATH (scripts/ci_nvrtc.sh prints it)"
        );
    }
    let archs: Vec<&str> = a.arch.split(',').map(str::trim).filter(|s| !s.is_empty()).collect();
    let report = kernels_check(&archs, &dims)?;
    println!("{report}");
    if !report.all_ok() {
        bail!("some kernels failed to compile");
    }
    Ok(())
}
