//! What the CUDA backend carves beside the activation workspace, as `serve` and `plan` price it: the
//! backend's own scratch (chunked DeltaNet workspace, varlen tables) and, for a quantised checkpoint
//! stored int4, what its weights need beyond the plan's `weights` region (linears a GPTQ checkpoint
//! keeps bf16, act-order permutations).

use std::cell::RefCell;
use std::path::PathBuf;

use anyhow::Result;
use deltaserve_cuda::backend::{WeightFormat, checkpoint_weights_bytes, scratch_bytes_for};
use deltaserve_model::ModelConfig;
use deltaserve_model::quant::Quantization;
use deltaserve_model::shard::ShardSpec;
use deltaserve_plan::{PlanOptions, WeightBytes, WeightsDtype, card_config};

pub struct CudaScratch<'a> {
    cfg: &'a ModelConfig,
    /// One card's share of the model (the whole model without tensor parallelism).
    card: ModelConfig,
    /// The checkpoint to walk (a quantised model directory; walked when the plan stores int4).
    quantized_dir: Option<PathBuf>,
    /// Under tensor parallelism rank 0's shard (the largest), priced against one card's plan.
    rank0: Option<ShardSpec>,
    /// The fit tries several option sets; the checkpoint is walked once per weight format.
    walked: RefCell<Vec<(WeightFormat, Result<usize, String>)>>,
}

impl<'a> CudaScratch<'a> {
    /// `checkpoint`: the model directory when the weights come from it (not random weights).
    pub fn new(cfg: &'a ModelConfig, checkpoint: Option<PathBuf>, tp: usize) -> Result<Self> {
        let quantized_dir = checkpoint.filter(|_| cfg.quantization.is_some());
        let rank0 = (tp > 1).then(|| ShardSpec::new(cfg, 0, tp)).transpose()?;
        Ok(Self { cfg, card: card_config(cfg, tp)?, quantized_dir, rank0, walked: RefCell::default() })
    }

    /// Backend scratch bytes for the options `o`.
    pub fn bytes(&self, o: &PlanOptions) -> u64 {
        let mut b = scratch_bytes_for(self.cfg, o) as u64;
        let Some(dir) = self.quantized_dir.as_ref().filter(|_| o.weights_dtype == WeightsDtype::Int4) else {
            return b;
        };
        let fmt = WeightFormat::of(o);
        let known = self.walked.borrow().iter().find(|(f, _)| *f == fmt).map(|(_, r)| r.clone());
        let bytes = known.unwrap_or_else(|| {
            let r = checkpoint_weights_bytes(self.cfg, dir, fmt, self.rank0.as_ref()).map_err(|e| e.to_string());
            self.walked.borrow_mut().push((fmt, r.clone()));
            r
        });
        match bytes {
            Ok(w) => {
                let planned = WeightBytes::new(&self.card, o).map_or(0, |w| w.device());
                b += (w as u64).saturating_sub(planned);
            }
            Err(e) => tracing::warn!("sizing the checkpoint's int4 weights: {e}"),
        }
        b
    }
}

/// The int4 storage a GPTQ checkpoint implies on CUDA: `Some(asymmetric)` for a GPTQ checkpoint (an
/// error if the flags ask for other weights), `None` otherwise.
pub fn gptq_int4(cfg: &ModelConfig, weights_dtype: Option<WeightsDtype>, quantize: bool) -> Result<Option<bool>> {
    let Some(Quantization::Gptq(g)) = &cfg.quantization else {
        return Ok(None);
    };
    if weights_dtype.is_some_and(|w| w != WeightsDtype::Int4) || quantize {
        anyhow::bail!("this checkpoint is GPTQ-quantised (int4 by itself): --weights-dtype / --quantize do not apply");
    }
    Ok(Some(!g.params.sym))
}
