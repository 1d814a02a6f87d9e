//! [`CudaBackend`]: the engine's [`Backend`] on one GPU, over the memory of the static plan.
//!
//! Memory: one `cuMemAlloc` per plan region (weights, kv_pages, state_slots, snapshots,
//! activations, logits, block_tables, gemm_workspace, and backend_scratch: the chunked-DeltaNet f32
//! workspace, the varlen tile/chunk tables and the int4 scratch, as `deltaserve_plan::cuda` sizes
//! them), and pinned host allocations (the host snapshot pool, the embedding table with
//! `embed_on_host`, the routed experts with `experts_on_host` (mapped for the expert kernels, which
//! read the experts a step picks across the bus), the step inputs' image, uploaded in one copy a step). The arena is sealed when [`CudaBackend::new`] returns: a step
//! allocates nothing (any allocation after the seal is an error), so [`Backend::arena_stats`]
//! never moves while serving.
//!
//! A step mirrors `deltaserve_cpu::paged` (the reference of this contract) and `model.rs`'s
//! forward order, but runs all chunks of the step together as one varlen batch: the chunks are
//! reordered so multi-token chunks (prefill: conv prefill, chunked DeltaNet, paged prefill
//! attention) come first and 1-token chunks (decode: conv/DeltaNet recurrence, split-K decode
//! attention) last; logits rows come back in the batch's order.
//!
//! Layouts (as `deltaserve_plan::Plan` documents them): per attention layer K then V
//! `[pages, page_size, kv_heads, head_dim]` bf16, each 256-byte aligned; per DeltaNet layer the
//! recurrent state `[slots, Hv, Dk, Dv]` f32 (bf16 under `--state-dtype bf16`) then the conv state
//! `[slots, K-1, conv_channels]` bf16. Activations are bf16 with f32 math inside kernels; logits f32.

use std::collections::HashMap;
use std::path::PathBuf;

use cudarc::driver::CudaGraph;
use deltaserve_model::shard::ShardSpec;
use deltaserve_model::{Dims, ModelConfig};
use deltaserve_plan::Plan;

use crate::arena::{Arena, DevSpan};
use crate::error::CudaError;
use crate::gemm::Gemm;
use crate::nvrtc::KernelDims;
use crate::ops::{Kernels, gemv};
use crate::runtime::{PinnedHost, Runtime};

mod ahead;
mod attention;
mod cache_ops;
mod contract;
mod deltanet;
mod expert_load;
mod forward;
mod fp8_load;
mod graphs;
mod host_experts;
mod images;
mod inputs;
mod layout;
mod linear;
mod loader;
mod moe;
mod phases;
mod profile;
mod rank;
mod saves;
mod spec;
mod step;
#[cfg(test)]
mod tests;
mod vision;
mod weights;

pub use graphs::GraphStats;
pub use phases::StepPhases;

/// The most tokens of a prefill chunk whose rows attend as decode queries
/// ([`CudaOptions::short_chunk_decode_attention_from`] without the keys split).
pub const SHORT_CHUNK_TOKENS: usize = 64;

/// The default [`CudaOptions::short_chunk_split_max_tokens`].
pub const SHORT_CHUNK_SPLIT_TOKENS: usize = 1024;

use ahead::Launches;
use graphs::GraphKey;
use inputs::StepInputs;
use layout::{LayerCache, Ws};
use phases::PhaseTimer;
use profile::Profile;
use rank::RankComm;
use spec::Spec;
use weights::{HostEmbed, Weights};

// What `ahead` and `spec` take from here (`use super::*`).
use cache_ops::Place;
use cudarc::driver::result;
use deltaserve_backend::sampling::pick_rows;
use deltaserve_backend::{Backend, BackendError, DraftPicker, Feed, Pick, Picked, RowSampling, SpecCommit, StepBatch};
use linear::po;
use step::StepShape;
use weights::{Layer, Mixer, Proj};

use crate::ops::kv_quant::LayerKv;
use crate::ops::{self, conv, embed, gdn_decode, mtp, norm};

/// A CUDA error as the backend contract's device error.
fn device_error(e: CudaError) -> BackendError {
    BackendError::Device(e.to_string())
}

/// Where the weights come from.
#[derive(Clone, Debug)]
pub enum WeightSource {
    /// An HF checkpoint directory (safetensors, bf16/f16/f32; converted to bf16, `A_log`,
    /// `dt_bias` and the gated-norm weight to f32).
    Checkpoint(PathBuf),
    /// Random weights at the real shapes, generated on the GPU (benchmarks): the distributions of
    /// `deltaserve_model::synth`.
    RandomWeights { seed: u64 },
}

/// Kernel specialisation for a model.
pub fn kernel_dims(cfg: &ModelConfig) -> KernelDims {
    let d = cfg.dims();
    KernelDims {
        gdn_k_dim: d.gdn_k_dim,
        gdn_v_dim: d.gdn_v_dim,
        conv_kernel: d.conv_kernel,
        attn_head_dim: d.head_dim,
        gqa_group: d.q_per_kv.max(1),
        gdn_bv: if d.gdn_v_dim.is_multiple_of(32) { 32 } else { 16 },
        state_bf16: false,
    }
}

/// Run-time choices of the backend (not part of the memory plan).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CudaOptions {
    /// Replay decode steps (every sequence of the step has one token) from CUDA graphs, one per
    /// batch size, captured lazily on that size's first step (which runs eagerly). Off: every
    /// step launches its kernels eagerly.
    pub cuda_graphs: bool,
    /// Steps of at most this many tokens run their projections through the decode GEMV
    /// (`kernels/gemv.cu`, at most [`gemv::MAX_TOKENS`]) instead of cuBLASLt; 0 turns it off.
    pub gemv_max_tokens: usize,
    /// Pads decode batches to power-of-two buckets (token 0, position −1, slot −1 rows; one graph
    /// per bucket). Bitwise equal to eager launches on the H200 (tests/backend/graphs.rs
    /// `decode_graphs_match_eager`) since the workspace plan follows the backend's op order — before,
    /// aliased buffers gave O(1) differences on some rows. Off by default (not yet measured for speed):
    /// one graph per exact batch size.
    pub graph_pad: bool,
    /// Speculative verify chunks whose context reaches this many tokens attend as decode queries
    /// (split-K over the keys), shorter ones with the prefill kernel. Default 0: every verify chunk as
    /// decode queries. Measured on the H200 at the 27B shapes, int4 + fp8 KV, K = 3: at 1K context the
    /// verify step takes 7.21 ms against 8.78 with the prefill kernel at batch 1, 13.20 against 14.54
    /// at batch 4, the same at batch 8 (bench/results/int4-pair-gemm-h200-2026-12-02.md); at 32K the
    /// prefill kernel (no split over the keys) was 2.4× slower at batch 1.
    pub verify_decode_attention_from: usize,
    /// Prefill chunks of at most [`CudaOptions::short_chunk_split_max_tokens`] tokens (split over the
    /// keys; [`SHORT_CHUNK_TOKENS`] as decode queries, at most the plan's `SHORT_CHUNK_DECODE_ROWS`
    /// rows a step) whose context reaches this many tokens do not attend with the prefill kernel's
    /// tiles alone: a chunk of a few tokens over a long context is one tile per kv head
    /// there, a handful of blocks each streaming the whole context (an agent's tool result after a
    /// long conversation). They run the prefill kernel with each tile's keys split over more blocks
    /// ([`CudaOptions::short_chunk_split_keys`]), or their rows as decode queries, split-K over their
    /// causal keys as long-context verify rows are. Default 2,048; `usize::MAX`: off. Measured on the
    /// H200 at the 27B shapes, int4 + fp8 KV at 24 GiB (bench/results/short-chunks-h200-2026-12-03.md):
    /// 16 new tokens after 131,072 take 17.6 ms split (29.0 as decode queries) against 217 ms; after
    /// 2,048, 11.3 against 14.2; 256 after 131,072 130.5 against 261.1
    /// (bench/results/short-chunks-to-1024-h200-2026-12-03.md).
    pub short_chunk_decode_attention_from: usize,
    /// Those short chunks run the prefill kernel with each tile's keys split over more blocks (merged
    /// as decode partials are) where the wide prefill kernels run (sm_80, sm_90), instead of their rows
    /// as decode queries (each row reading the whole context). Default on; the rows path everywhere
    /// else.
    pub short_chunk_split_keys: bool,
    /// The most tokens of a short chunk that runs the prefill kernel split over the keys (the rows path
    /// takes at most [`SHORT_CHUNK_TOKENS`]). Default [`SHORT_CHUNK_SPLIT_TOKENS`]: on the H200 the split
    /// is faster at every length measured up to 1,024 (4–20% at 1,024 tokens).
    pub short_chunk_split_max_tokens: usize,
    /// Decode steps of at most 8 tokens fold each residual add + RMSNorm between two int4 projections
    /// into them ([`crate::ops::w4a16::Fold`]: the norm kernel's launch and round trips leave the critical path),
    /// when every layer's projections are int4 GEMVs and tensor parallelism is off. Off: the separate
    /// `add_rms_norm_1p` kernel (bitwise the reference's order of operations).
    pub fold_norms: bool,
    /// Steps the int4 GEMM takes (more tokens than the decode GEMV, at most `w4_gemm_max_rows`) run each
    /// residual add + RMSNorm in the split-K reduce of the int4 projection before it
    /// ([`crate::ops::w4_gemm::w4_gemm_norm`]: one launch a norm fewer, bitwise the separate kernels'
    /// result) when tensor parallelism is off. Off: the reduce, then `add_rms_norm_1p`.
    pub norms_in_reduce: bool,
    /// Steps of more tokens than the decode GEMV takes and at most this many run their int4
    /// projections (and an int4 lm_head) through the int4 tensor-core GEMM (`kernels/w4_gemm.cu`,
    /// reading the int4 weights in place); longer steps dequantise row slices for cuBLASLt. At most
    /// the plan's `W4_GEMM_MAX_ROWS` (its scratch is sized for that, and the GEMM is the faster path
    /// up to there at every 27B shape on the H200); 0 turns it off.
    pub w4_gemm_max_rows: usize,
    /// Block-FP8 projections of steps of more than 16 tokens run on the FP8 tensor cores (cuBLASLt's
    /// block-scaled GEMM, Hopper; the activations quantised to e4m3 per token and 128 features, as the
    /// checkpoints' `activation_scheme: dynamic` says). Off (and where cuBLASLt has no such GEMM): row
    /// slices dequantised to bf16 and a bf16 GEMM, activations unquantised.
    pub fp8_tensor_cores: bool,
    /// Snapshots at points inside a step's chunks (`Capabilities::snapshots_within_chunks`): a prompt's
    /// chunk runs past its message starts, its sequence cut there inside the chunked DeltaNet walk, so
    /// a turn's new tokens run in the fewest steps the token budget allows (on by default; bitwise the
    /// state and logits of the same pieces run as steps of their own, bench/results/attention-prefill-
    /// wgmma-h200-2026-12-05.md §4). Off: chunks end at snapshot points; `DELTASERVE_SNAPSHOTS_IN_STEP=0`
    /// turns it off for the server and the benchmarks.
    pub snapshots_in_step: bool,
    /// A sparse layer's shared expert runs in decode steps as one more pair per token of the routed
    /// experts' GEMV launches (its gate/up, the SwiGLU and its down join theirs: three launches fewer a
    /// layer), where it has the experts' width and format: 35B-A3B decode 3.4–3.7% faster at batch 1, 1.3%
    /// at 8, the same at 32 (H100, bench/results/moe-shared-pairs-h100-2026-12-05.md). Off: the shared
    /// expert runs as the layer's dense MLP first; `DELTASERVE_MOE_SHARED_PAIRS=0` turns it off for the
    /// server and the benchmarks.
    pub moe_shared_pairs: bool,
    /// Block-FP8 projections of prefill steps (with [`CudaOptions::fp8_tensor_cores`]) run our FP8 GEMM on
    /// mma.sync (`kernels/fp8_gemm.cu`, sm_89 and later) instead of dequantised row slices (Ada, where
    /// cuBLASLt has no block-scaled FP8 GEMM) or cuBLASLt's (Hopper, where mma.sync e4m3 is emulated: only
    /// a check there). Off (the default until it is checked on a GPU and measured on an Ada card).
    /// `DELTASERVE_FP8_MMA=1` turns it on for the server and the benchmarks.
    pub fp8_mma_gemm: bool,
    /// The SwiGLU before a block-FP8 down projection on the tensor cores writes the FP8 GEMM's activation
    /// codes and scales itself (`fp8_swiglu_quant`: the same codes, one pass over the rows instead of the
    /// SwiGLU and the activations' quantisation). Off: the SwiGLU, then the quantisation;
    /// `DELTASERVE_FP8_FUSED_QUANT=0` turns it off for the server and the benchmarks.
    pub fp8_fused_quant: bool,
    /// Long prefill steps cut the chunked DeltaNet into pieces, each piece's walk on a stream of its own beside
    /// the next piece's prep, where the kernels allow it ([`crate::Kernels::gdn_overlap`]; the same results bit
    /// for bit). Off: one prep, then one walk.
    pub deltanet_overlap: bool,
}

impl Default for CudaOptions {
    fn default() -> Self {
        CudaOptions {
            cuda_graphs: true,
            gemv_max_tokens: gemv::MAX_TOKENS,
            graph_pad: false,
            verify_decode_attention_from: 0,
            short_chunk_decode_attention_from: 2048,
            short_chunk_split_keys: true,
            short_chunk_split_max_tokens: SHORT_CHUNK_SPLIT_TOKENS,
            fold_norms: true,
            norms_in_reduce: true,
            w4_gemm_max_rows: deltaserve_plan::cuda::W4_GEMM_MAX_ROWS,
            fp8_tensor_cores: true,
            snapshots_in_step: true,
            moe_shared_pairs: true,
            fp8_mma_gemm: false,
            fp8_fused_quant: true,
            deltanet_overlap: true,
        }
    }
}

/// The engine backend on one CUDA GPU.
pub struct CudaBackend {
    rt: Runtime,
    k: Kernels,
    gemm: Gemm,
    arena: Arena,
    d: Dims,
    eps: f32,
    rope_theta: f32,
    w: Weights,
    ws: Ws,
    caches: Vec<LayerCache>,
    states: DevSpan,
    snapshots: DevSpan,
    logits: DevSpan,
    block_tables: DevSpan,
    table_width: usize,
    /// What the device's block tables hold, row by row (the region starts zeroed): a step uploads only the
    /// entries that change.
    table_mirror: std::cell::RefCell<Vec<i32>>,
    page_size: usize,
    num_pages: usize,
    num_slots: usize,
    snapshot_slots: usize,
    max_tokens: usize,
    max_seqs: usize,
    decode_partitions: usize,
    /// One per-sequence state size: recurrent (f32 or bf16: `--state-dtype`) and conv bf16 bytes (one DeltaNet layer).
    rec_bytes: usize,
    conv_bytes: usize,
    /// Pinned host snapshot pool: [host_snapshot_slots, state bytes of every DeltaNet layer].
    host_pool: Option<PinnedHost>,
    host_snapshot_slots: usize,
    snapshot_len: usize,
    /// Bytes of weights the backend laid out (vs the plan's `weights` region).
    pub weights_bytes: usize,
    /// Size of the `scratch` region (not in the plan).
    pub scratch_bytes: usize,
    /// Per-op-group timing (synchronising after each group) when enabled: (group, seconds).
    prof: std::cell::RefCell<Option<Profile>>,
    /// Where each step's wall time goes, when enabled ([`CudaBackend::set_step_phases`]).
    phases: std::cell::RefCell<Option<PhaseTimer>>,
    opts: CudaOptions,
    /// Decode graphs by bucket size (captured lazily).
    graphs: HashMap<GraphKey, CudaGraph>,
    graph_stats: GraphStats,
    /// The plan's `graph_reserve_bytes`: the device memory the captured graphs may take.
    graph_budget: u64,
    host_embed: Option<HostEmbed>,
    /// The routed experts in pinned, device-mapped host memory (the plan's `experts_on_host`).
    host_experts: Option<host_experts::HostExperts>,
    /// The step inputs' pinned image (one upload a step).
    inputs: StepInputs,
    /// Launched steps ([`Backend::launch`]) and their pinned slots.
    launches: Launches,
    /// Linears quantised at load (`--quantize int4`) and converted from GPTQ.
    pub w4_quantized: usize,
    pub w4_converted: usize,
    /// Tensor parallelism: this backend is one rank of a [`crate::tp::TpBackend`].
    tp: Option<RankComm>,
    /// Speculative decoding (the plan's `speculative_tokens` > 0).
    spec: Option<Spec>,
    /// Every layer's norms can fold into its projections ([`linear::layers_fold`]; tensor parallelism off).
    fold: bool,
    /// The vision tower, when the plan prices it (images accepted).
    vision: Option<vision::Vision>,
    /// The (t, h, w) frequency split of M-RoPE (rows rotate at (t, h, w) positions with the tower).
    mrope_section: [usize; 3],
    /// The running step's snapshots inside its chunks.
    saves: std::cell::RefCell<saves::StepSaves>,
    /// The stream and events of the chunked DeltaNet's overlapped pieces (where the kernels allow them), and
    /// the running step's rounds of pieces (none: one prep, one walk).
    overlap: Option<crate::ops::gdn_overlap::Overlap>,
    rounds: std::cell::RefCell<Vec<crate::ops::gdn_overlap::RoundOnDevice>>,
    /// What the FP8 activation scratch (`fp8_x`) holds when a kernel that wrote an activation quantised
    /// it for the projection that reads it next ([`linear::Fp8XTag`]); taken by that projection.
    fp8_x_holds: std::cell::Cell<Option<linear::Fp8XTag>>,
}

// SAFETY: the backend is driven by one thread at a time (the engine's step loop); every entry
// point binds the CUDA context to the calling thread first. The raw pointers (cuBLASLt handle,
// pinned host allocations) are owned by this value and never shared.
unsafe impl Send for CudaBackend {}

impl CudaBackend {
    /// Opens GPU 0, compiles the kernels for the model, allocates the plan's regions (one
    /// `cuMemAlloc` each), loads or generates the weights, and seals the arena. Default
    /// [`CudaOptions`] (decode graphs and the decode GEMV on).
    pub fn new(
        cfg: &ModelConfig,
        weights: WeightSource,
        plan: &Plan,
        host_snapshot_slots: usize,
    ) -> Result<Self, CudaError> {
        Self::with_options(cfg, weights, plan, host_snapshot_slots, CudaOptions::default())
    }

    /// Whether this backend's kernels take `cfg`'s shapes (head dims, GQA group, conv width); an error
    /// naming the shape and the CPU backend, before anything touches the GPU. Every checkpoint format of
    /// a model it takes runs: block-FP8 mixture-of-experts checkpoints with their experts dequantised to
    /// bf16 at load, or quantised to int4 (`--quantize int4`).
    pub fn check_model(cfg: &ModelConfig) -> Result<(), CudaError> {
        kernel_dims(cfg).validate().map_err(|e| {
            let why = match e {
                CudaError::InvalidArgs { msg, .. } => msg,
                other => other.to_string(),
            };
            CudaError::UnsupportedModel(format!(
                "this model's shapes are not ones the CUDA kernels take ({why}): use --device cpu"
            ))
        })
    }

    /// [`CudaBackend::new`] with explicit [`CudaOptions`].
    pub fn with_options(
        cfg: &ModelConfig,
        weights: WeightSource,
        plan: &Plan,
        host_snapshot_slots: usize,
        opts: CudaOptions,
    ) -> Result<Self, CudaError> {
        Self::build(cfg, weights, plan, host_snapshot_slots, opts, None)
    }

    /// Rank `spec.rank` of a tensor-parallel group, on GPU `spec.rank`: the rank's shard of the model
    /// `cfg` (its heads, DeltaNet heads, intermediate and vocabulary ranges; a checkpoint's tensors
    /// are cut as they load) under the per-card `plan` (`tensor_parallel` = `spec.world`). Steps need
    /// the group's communicators ([`CudaBackend::attach`]); [`crate::tp::TpBackend`] drives the ranks.
    pub fn rank(
        cfg: &ModelConfig,
        weights: WeightSource,
        plan: &Plan,
        host_snapshot_slots: usize,
        opts: CudaOptions,
        spec: ShardSpec,
    ) -> Result<Self, CudaError> {
        if plan.options.tensor_parallel != spec.world {
            return Err(CudaError::Plan(format!(
                "rank {} of {}: the plan is for tensor parallel size {}",
                spec.rank, spec.world, plan.options.tensor_parallel
            )));
        }
        Self::build(cfg, weights, plan, host_snapshot_slots, opts, Some(spec))
    }

    /// The runtime (device name, stream) — for benchmarks.
    pub fn runtime(&self) -> &Runtime {
        &self.rt
    }

    /// (name, size) of each arena region.
    pub fn regions(&self) -> Vec<(String, usize)> {
        self.arena.regions().into_iter().map(|(n, s, _)| (n, s)).collect()
    }

    /// cuBLASLt heuristic calls so far (one per new GEMM shape).
    pub fn gemm_heuristic_calls(&self) -> usize {
        self.gemm.heuristic_calls()
    }

    /// Whether short chunks over a long context may run the prefill kernel split over the keys here
    /// (the wide prefill kernels: [`CudaOptions::short_chunk_split_keys`]).
    pub fn short_chunks_split_keys(&self) -> bool {
        crate::ops::attention::prefill_split_supported(&self.k)
    }

    pub fn options(&self) -> CudaOptions {
        self.opts
    }

    /// Changes the options; captured graphs are dropped (they bake in the old choices).
    pub fn set_options(&mut self, opts: CudaOptions) -> Result<(), CudaError> {
        let most = deltaserve_plan::cuda::W4_GEMM_MAX_ROWS;
        if opts.w4_gemm_max_rows > most {
            return Err(CudaError::Plan(format!(
                "w4_gemm_max_rows {}: the plan's int4 GEMM scratch holds {most} rows",
                opts.w4_gemm_max_rows
            )));
        }
        if opts != self.opts {
            self.rt.synchronize()?;
            self.graphs.clear();
            self.opts = opts;
        }
        Ok(())
    }

    /// Rounds of pieces the last step's chunked DeltaNet ran in (each round's walk beside the next round's
    /// prep; 0: one prep and one walk).
    pub fn last_deltanet_rounds(&self) -> usize {
        self.rounds.borrow().len()
    }

    /// Seconds the last speculative step spent drafting with the MTP head (0 without speculation).
    pub fn last_draft_s(&self) -> f64 {
        self.spec.as_ref().map_or(0.0, |sp| sp.draft_s)
    }
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        self.graphs.clear();
        if self.rt.context().bind_to_thread().is_ok() {
            let _ = self.rt.synchronize();
            match crate::trace::dump(&self.rt) {
                Ok(Some((path, n))) => tracing::warn!("kernel trace: {n} block records written to {}", path.display()),
                Ok(None) => {}
                Err(e) => tracing::warn!("kernel trace: not written: {e}"),
            }
            // The pinned buffers free themselves (PinnedHost) once the stream is idle.
        }
    }
}
