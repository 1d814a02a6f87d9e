//! [`CudaBackend`]: the engine's [`Backend`] on one GPU, over the memory of the static plan.
//!
//! Memory: one `cuMemAlloc` per plan region (weights, kv_pages, state_slots, snapshots,
//! activations, logits, block_tables, gemm_workspace) plus one `scratch` region for what the plan
//! does not list (the chunked-DeltaNet f32 workspace, the varlen tile/chunk tables), and pinned host
//! allocations (the host snapshot pool, the embedding table with `embed_on_host`, the step inputs' image,
//! uploaded in one copy a step). The arena is sealed when [`CudaBackend::new`] returns: a step
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
//! recurrent state `[slots, Hv, Dk, Dv]` f32 then the conv state `[slots, K-1, conv_channels]`
//! bf16. Activations are bf16 with f32 math inside kernels; logits f32.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaGraph, CudaStream, result};
use deltaserve_backend::sampling::pick_rows;
use deltaserve_backend::{
    ArenaStats, Backend, BackendError, CacheOp, DraftPicker, Feed, Pick, Picked, RowSampling, SnapshotLoc, SpecCommit,
    StepBatch,
};
use deltaserve_model::shard::{ShardSpec, Split};
use deltaserve_model::weights::TensorSource;
use deltaserve_model::{Checkpoint, DType, Dims, LayerKind, ModelConfig, ModelError, ModelWeights};
use deltaserve_plan::workspace::{STEP_INPUTS, WorkspaceBuffer, WorkspaceLayout};
use deltaserve_plan::{Plan, PlanOptions, SamplingScratch, WeightsDtype};

use crate::arena::{Arena, DevSpan};
use crate::collective::{CollDtype, Communicators};
use crate::error::CudaError;
use crate::gemm::Gemm;
use crate::nvrtc::{KernelDims, KvFormats};
use crate::ops::gemv::{self, GemvOut};
use crate::ops::init::{Init, init_random};
use crate::ops::kv_quant::LayerKv;
use crate::ops::w4a16::{self, Fold, W4Weights};
use crate::ops::{
    self, Kernels, attention, conv, elementwise, embed, gdn_chunk, gdn_decode, gdn_gate, kv_cache, mtp, norm,
};
use crate::runtime::{PinnedHost, Runtime};

mod ahead;
mod phases;
mod spec;
use crate::w4::{ScaleDtype, W4Bytes, W4Linear};
use ahead::{LaunchOut, Launches};
pub use phases::StepPhases;
use phases::{Mark, PhaseTimer};
use spec::{MtpHead, Spec, Verified};

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
    /// per bucket). Bitwise equal to eager launches on the H200 (tests/backend.rs
    /// `decode_graphs_match_eager`) since the workspace plan follows the backend's op order — before,
    /// aliased buffers gave O(1) differences on some rows. Off by default (not yet measured for speed):
    /// one graph per exact batch size.
    pub graph_pad: bool,
    /// Speculative verify chunks whose context reaches this many tokens attend as decode queries
    /// (split-K over the keys), shorter ones with the prefill kernel. Measured on the H200 at the 27B
    /// shapes: at 1K context the prefill kernel is as fast at batch 1 and faster at batch 8; at 32K it
    /// is 2.4× slower at batch 1 (it has no split over the keys).
    pub verify_decode_attention_from: usize,
    /// Decode steps of at most 8 tokens fold each residual add + RMSNorm between two int4 projections
    /// into them ([`w4a16::Fold`]: the norm kernel's launch and round trips leave the critical path),
    /// when every layer's projections are int4 GEMVs and tensor parallelism is off. Off: the separate
    /// `add_rms_norm_1p` kernel (bitwise the reference's order of operations).
    pub fold_norms: bool,
}

impl Default for CudaOptions {
    fn default() -> Self {
        CudaOptions {
            cuda_graphs: true,
            gemv_max_tokens: gemv::MAX_TOKENS,
            graph_pad: false,
            verify_decode_attention_from: 4096,
            fold_norms: true,
        }
    }
}

/// Counters of the decode-graph path.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GraphStats {
    /// Graphs captured (one per bucket used so far).
    pub captures: usize,
    /// Steps replayed from a captured graph.
    pub replays: usize,
    /// Decode steps run eagerly (graphs off, profiling on, or a bucket's first step).
    pub eager_decode_steps: usize,
}

const ALIGN: usize = crate::arena::ALIGN;

fn al(x: usize) -> usize {
    x.div_ceil(ALIGN) * ALIGN
}

/// Bound of the bf16 slice an int4 linear is dequantised into for a prefill GEMM (the int4
/// prefill path: `w4_dequant` of a row slice, then cuBLASLt on it, writing the slice's columns).
pub const W4_SLICE_BYTES: usize = 64 << 20;

/// The parts of the backend's scratch region, in order.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ScratchParts {
    /// Chunked DeltaNet f32 workspace.
    pub gdn: usize,
    /// Varlen chunk and tile tables.
    pub chunk_table: usize,
    pub tile_table: usize,
    /// bf16 `[8, max in]`: x gathered in device-column order for act-order int4 weights.
    pub w4_x: usize,
    /// bf16 slice of dequantised int4 weight rows (prefill GEMMs); 0 without int4 decoder linears.
    pub w4_slice: usize,
}

impl ScratchParts {
    /// For steps of `t_max` tokens and `s_max` sequences; `int4_linears` / `lm_head_int4` as the
    /// plan's options say.
    pub fn new(cfg: &ModelConfig, t_max: usize, s_max: usize, int4_linears: bool, lm_head_int4: bool) -> Self {
        let d = cfg.dims();
        let dims = kernel_dims(cfg);
        let gdn = if d.num_deltanet_layers > 0 { gdn_chunk::workspace_bytes(t_max, d.gdn_v_heads, &dims) } else { 0 };
        let lin = decoder_linear_shapes(cfg);
        let max_in = lin.iter().map(|&(_, i)| i).max().unwrap_or(0).max(d.hidden);
        let (w4_x, w4_slice) = if int4_linears {
            let biggest = lin.iter().map(|&(o, i)| 2 * o * i).max().unwrap_or(0);
            (2 * 8 * max_in, biggest.min(W4_SLICE_BYTES))
        } else if lm_head_int4 {
            (2 * 8 * d.hidden, 0)
        } else {
            (0, 0)
        };
        ScratchParts {
            gdn,
            chunk_table: 8 * (t_max / gdn_chunk::CHUNK + s_max + 1),
            tile_table: 8 * (t_max / attention::Q_TILE + s_max + 1),
            w4_x,
            w4_slice,
        }
    }

    /// Bytes of the region (each part 256-byte aligned).
    pub fn total(&self) -> usize {
        al(self.gdn) + al(self.chunk_table) + al(self.tile_table) + al(self.w4_x) + al(self.w4_slice)
    }
}

/// Every decoder linear's `[out, in]` (the shapes the plan prices).
fn decoder_linear_shapes(cfg: &ModelConfig) -> Vec<(usize, usize)> {
    let d = cfg.dims();
    let h = d.hidden;
    let mut v = Vec::new();
    for kind in &cfg.layer_types {
        match kind {
            LayerKind::DeltaNet => v.extend([
                (d.conv_channels, h),
                (d.gdn_value_width, h),
                (d.gdn_v_heads, h),
                (d.gdn_v_heads, h),
                (h, d.gdn_value_width),
            ]),
            LayerKind::Attention => v.extend([(2 * d.attn_dim, h), (d.kv_dim, h), (d.kv_dim, h), (h, d.attn_dim)]),
        }
        v.extend([(d.intermediate, h), (d.intermediate, h), (h, d.intermediate)]);
    }
    v
}

/// Rows per dequantised slice of an `[out, in]` int4 linear in a slice buffer of `slice_bytes`:
/// all rows when they fit, else a multiple of 128 (at least 16 rows, or an error at the caller).
pub fn w4_slice_rows(out: usize, inp: usize, slice_bytes: usize) -> usize {
    let fit = slice_bytes / (2 * inp.max(1));
    if fit >= out {
        out
    } else if fit >= 128 {
        fit / 128 * 128
    } else {
        fit / 16 * 16
    }
}

/// The backend scratch the plan must reserve (`PlanOptions::backend_scratch_bytes`) for bf16
/// weights: bounded by the step's tokens and sequences, never by prompt length.
pub fn scratch_bytes(cfg: &ModelConfig, t_max: usize, s_max: usize) -> usize {
    ScratchParts::new(cfg, t_max, s_max, false, false).total()
}

/// [`scratch_bytes`] for the plan's options: int4 decoder linears add the bf16 slice the prefill
/// GEMMs dequantise into ([`W4_SLICE_BYTES`] at most) and the act-order x scratch; an int4 lm_head
/// the x scratch. Under tensor parallelism: one card's (its shard of the heads), as the plan.
pub fn scratch_bytes_for(cfg: &ModelConfig, opts: &PlanOptions) -> usize {
    let int4 = opts.weights_dtype == WeightsDtype::Int4;
    let card = deltaserve_plan::card_config(cfg, opts.tensor_parallel).unwrap_or_else(|_| cfg.clone());
    ScratchParts::new(&card, opts.max_batch_tokens, opts.max_seqs, int4, opts.lm_head_int4).total()
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
    }
}

/// One stored linear (or a fused pair of bf16 linears): `rows` output rows.
#[derive(Clone, Copy, Debug)]
enum Part {
    /// bf16 `[rows, in]` (dense tensors: rows 0).
    Bf16 {
        w: u64,
        rows: usize,
    },
    W4(W4Weights),
}

impl Part {
    fn rows(&self) -> usize {
        match self {
            Part::Bf16 { rows, .. } => *rows,
            Part::W4(w) => w.out,
        }
    }
    fn ptr(&self) -> u64 {
        match self {
            Part::Bf16 { w, .. } => *w,
            Part::W4(w) => w.qweight,
        }
    }
}

/// A projection: its parts write consecutive column ranges of one output (bf16 pairs are one
/// fused part; int4 pairs two).
type Proj = Vec<Part>;

struct GdnLayer {
    qkv: Proj,
    z: Proj,
    /// [2·Hv, hidden]: in_proj_b rows then in_proj_a rows.
    ba: Proj,
    conv: u64,
    dt_bias: u64,
    a_log: u64,
    norm: u64,
    out: Proj,
}

struct AttnLayer {
    q: Proj,
    k: Proj,
    v: Proj,
    o: Proj,
    q_norm: u64,
    k_norm: u64,
}

enum Mixer {
    Gdn(GdnLayer),
    Attn(AttnLayer),
}

struct Layer {
    input_norm: u64,
    post_norm: u64,
    mixer: Mixer,
    /// [2·I, hidden]: gate rows then up rows.
    gate_up: Proj,
    down: Proj,
}

struct Weights {
    /// Device embedding table (0 when it is on the host).
    embed: u64,
    lm_head: Proj,
    final_norm: u64,
    layers: Vec<Layer>,
    /// The MTP head, loaded when the plan has speculative decoding on.
    mtp: Option<MtpHead>,
}

/// The embedding table in pinned host memory (`embed_on_host`) and the pinned `[t_max, hidden]`
/// bf16 buffer a step's rows are gathered into before one upload.
struct HostEmbed {
    table: PinnedHost,
    staging: PinnedHost,
}

/// The step inputs' block of the workspace (the plan puts them back to back) and its pinned image: a step
/// writes its inputs into the image and uploads them in one copy.
struct StepInputs {
    image: PinnedHost,
    /// Each input's byte offset in the block and its capacity (`STEP_INPUTS` order).
    at: [(usize, usize); 6],
    /// Recorded after each upload: the image is rewritten only once the last copy out of it is done.
    done: cudarc::driver::CudaEvent,
}

/// Device addresses of the activation buffers (plan workspace offsets) and scratch.
#[derive(Clone, Copy)]
struct Ws {
    token_ids: u64,
    positions: u64,
    cu_seqlens: u64,
    seq_lens: u64,
    slots: u64,
    last_idx: u64,
    residual: u64,
    x_norm: u64,
    mixer_out: u64,
    gdn_qkv: u64,
    gdn_z: u64,
    gdn_ba: u64,
    gdn_g: u64,
    gdn_beta: u64,
    gdn_conv_out: u64,
    gdn_qk: u64,
    gdn_core_out: u64,
    gdn_normed: u64,
    attn_qg: u64,
    attn_k: u64,
    attn_v: u64,
    attn_partials: DevSpan,
    attn_out: u64,
    mlp_in: u64,
    mlp_gate_up: u64,
    mlp_act: u64,
    mlp_out: u64,
    /// Every row after the final norm.
    final_normed: u64,
    final_hidden: u64,
    /// scratch region: chunked DeltaNet workspace, chunk table, tile table.
    gdn_ws: DevSpan,
    chunk_table: DevSpan,
    tile_table: DevSpan,
    /// int4: act-order x scratch and the dequantised slice (0 bytes when unused).
    w4_x: DevSpan,
    w4_slice: DevSpan,
    /// The folded norms' input `[min(t, 8), hidden]` and sums of squares ([`w4a16::Fold`]).
    fold_x: u64,
    fold_sums: u64,
    /// Device sampling's scratch ([`ops::sample`]) and its layout.
    sampling: u64,
    sampling_layout: SamplingScratch,
}

/// Where layer `i`'s cache lives.
#[derive(Clone, Copy, Debug)]
enum LayerCache {
    /// K and V data (and scales of a quantised format) in kv_pages.
    Attn(LayerKv),
    /// Byte offsets of the recurrent and conv tensors inside state_slots / snapshots.
    Gdn { rec: usize, conv: usize, snap_rec: usize, snap_conv: usize },
}

/// What a captured CUDA graph replays: a decode step of a batch-size bucket, a step of speculative
/// verify chunks (and decode rows) of one shape, or a commit of one shape.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum GraphKey {
    Decode(usize),
    /// (decode rows, verify rows attending as decode queries, each verify chunk's rows in order).
    Verify(usize, usize, Vec<usize>),
    /// (commits, verify rows, verify chunks) of the last step.
    Commit(usize, usize, usize),
    /// A draft step of the MTP head: (rows, first draft).
    Draft(usize, bool),
}

/// The most CUDA graphs a backend keeps (decode buckets, verify, commit and draft shapes).
const MAX_GRAPHS: usize = 48;

/// Per-op-group GPU time while profiling ([`CudaBackend::set_profiling`]): a timing event is recorded
/// at the start of a step and after each group (no synchronisation in between), read back once at the
/// end of the step and summed by group.
struct Profile {
    events: Vec<cudarc::driver::CudaEvent>,
    /// Whether `events[0]` marks the start of the current step (then `names.len() + 1` events are
    /// recorded).
    open: bool,
    /// `names[i]`: the group that ended at `events[i + 1]`.
    names: Vec<&'static str>,
    totals: Vec<(&'static str, f64)>,
}

/// Timing events per profiled step (a step records one per op group: ~6 per layer); more flush early.
const PROFILE_EVENTS: usize = 1024;

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
    /// One per-sequence state size: recurrent f32 and conv bf16 bytes (one DeltaNet layer).
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
    host_embed: Option<HostEmbed>,
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
    /// Every layer's norms can fold into its projections ([`layers_fold`]; tensor parallelism off).
    fold: bool,
}

/// One tensor-parallel rank: its shard of the model and the communicators of its group (attached
/// once every rank is built).
struct RankComm {
    spec: ShardSpec,
    /// The whole model's vocabulary (token ids are checked against it).
    full_vocab: usize,
    comms: Option<Arc<Communicators>>,
}

// SAFETY: the backend is driven by one thread at a time (the engine's step loop); every entry
// point binds the CUDA context to the calling thread first. The raw pointers (cuBLASLt handle,
// pinned host allocations) are owned by this value and never shared.
unsafe impl Send for CudaBackend {}

fn is_f32_tensor(name: &str) -> bool {
    name.ends_with("A_log") || name.ends_with("dt_bias") || name.ends_with("linear_attn.norm.weight")
}

/// The first of a pair stored as one [2·rows, cols] tensor (the second follows it).
fn pair_first(name: &str) -> bool {
    name.contains("in_proj_b.weight") || name.contains("mlp.gate_proj.weight")
}
fn pair_second(name: &str) -> bool {
    name.contains("in_proj_a.weight") || name.contains("mlp.up_proj.weight")
}

/// How the backend stores the weights (from the plan's options).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WeightFormat {
    /// Decoder linears in int4 (one part per linear) instead of bf16 (pairs fused).
    pub int4: bool,
    /// The MTP head too (speculative decoding on, and the model declares one).
    pub mtp: bool,
    /// int4 with zero points.
    pub asym: bool,
    pub lm_head_int4: bool,
    pub embed_on_host: bool,
}

impl WeightFormat {
    pub fn of(opts: &PlanOptions) -> Self {
        WeightFormat {
            int4: opts.weights_dtype == WeightsDtype::Int4,
            mtp: opts.speculative_tokens > 0,
            asym: opts.int4_asym,
            lm_head_int4: opts.lm_head_int4,
            embed_on_host: opts.embed_on_host,
        }
    }
    /// A device lm_head of its own (not the device embedding).
    fn own_lm_head(&self, cfg: &ModelConfig) -> bool {
        !cfg.tie_word_embeddings || self.embed_on_host || self.lm_head_int4
    }
}

/// One tensor of the backend's weight layout.
#[derive(Clone, Copy, Debug)]
enum WSpec {
    /// `n` elements, bf16 or f32, with the random init.
    Dense { n: usize, f32: bool, init: Init },
    /// An int4 `[out, in]` linear (random init: weights of std `1/sqrt(in)`).
    W4 { out: usize, inp: usize, asym: bool },
    /// The embedding table in pinned host memory.
    Host { n: usize },
}

impl StepInputs {
    fn new(rt: &Runtime, plan: &Plan) -> Result<StepInputs, CudaError> {
        let (at, bytes) = Self::block(&plan.workspace)?;
        let image = PinnedHost::new(rt, bytes)?;
        let done = rt.context().new_event(None).map_err(CudaError::driver("cuEventCreate"))?;
        Ok(StepInputs { image, at, done })
    }

    /// The block of the plan's step inputs: each input's offset from token_ids (the first) and capacity,
    /// and the block's bytes. No other buffer live while they are may lie inside it (one copy writes it all).
    fn block(ws: &WorkspaceLayout) -> Result<([(usize, usize); 6], usize), CudaError> {
        let bufs = STEP_INPUTS.map(|name| ws.get(name));
        let Some(bufs) = bufs.into_iter().collect::<Option<Vec<_>>>() else {
            return Err(CudaError::Plan("the workspace lacks a step input".into()));
        };
        let lo = bufs[0].offset;
        if bufs.iter().any(|b| b.offset < lo) {
            return Err(CudaError::Plan("the step inputs' block does not start with token_ids".into()));
        }
        let hi = bufs.iter().map(|b| b.offset + b.bytes).max().unwrap_or(lo);
        let inside = |b: &&WorkspaceBuffer| {
            !STEP_INPUTS.contains(&b.name)
                && b.offset < hi
                && lo < b.offset + b.bytes
                && bufs.iter().any(|i| i.lifetime_overlaps(b))
        };
        if let Some(o) = ws.buffers.iter().find(inside) {
            return Err(CudaError::Plan(format!("workspace buffer `{}` lies inside the step inputs' block", o.name)));
        }
        let mut at = [(0, 0); 6];
        for (a, b) in at.iter_mut().zip(&bufs) {
            *a = ((b.offset - lo) as usize, b.bytes as usize);
        }
        Ok((at, (hi - lo) as usize))
    }
}

impl WSpec {
    fn device_bytes(&self) -> usize {
        match *self {
            WSpec::Dense { n, f32, .. } => al(n * if f32 { 4 } else { 2 }),
            WSpec::W4 { out, inp, asym } => W4Bytes::new(out, inp, asym, false).layout(ALIGN).1,
            WSpec::Host { .. } => 0,
        }
    }
}

/// Every tensor in load order: embedding, own lm_head, final norm, then per layer the norms and
/// the mixer's and MLP's tensors, then the MTP head's (fc, its three norms, its layer). bf16 pairs
/// (in_proj_b + in_proj_a, gate + up) are one entry of both halves; int4 pairs two entries.
fn weight_specs(cfg: &ModelConfig, f: WeightFormat) -> Vec<WSpec> {
    let d = cfg.dims();
    let h = d.hidden;
    let dense = |n: usize, init: Init| WSpec::Dense { n, f32: false, init };
    let lin = |o: usize, i: usize| -> Vec<WSpec> {
        if f.int4 {
            vec![WSpec::W4 { out: o, inp: i, asym: f.asym }]
        } else {
            vec![dense(o * i, Init::Normal(1.0 / (i as f32).sqrt()))]
        }
    };
    let pair = |o: usize, i: usize| -> Vec<WSpec> {
        if f.int4 {
            vec![WSpec::W4 { out: o, inp: i, asym: f.asym }, WSpec::W4 { out: o, inp: i, asym: f.asym }]
        } else {
            vec![dense(2 * o * i, Init::Normal(1.0 / (i as f32).sqrt()))]
        }
    };
    let normw = |n: usize| dense(n, Init::Normal(0.1));
    let mut v =
        vec![if f.embed_on_host { WSpec::Host { n: d.vocab * h } } else { dense(d.vocab * h, Init::Normal(1.0)) }];
    if f.own_lm_head(cfg) {
        if f.lm_head_int4 {
            v.push(WSpec::W4 { out: d.vocab, inp: h, asym: f.asym });
        } else {
            v.push(dense(d.vocab * h, Init::Normal(1.0 / (h as f32).sqrt())));
        }
    }
    v.push(normw(h));
    let mtp = f.mtp && cfg.mtp_num_hidden_layers > 0;
    let kinds = cfg.layer_types.iter().map(|k| (false, *k));
    for (is_mtp, kind) in kinds.chain(mtp.then_some((true, LayerKind::Attention))) {
        if is_mtp {
            v.extend(lin(h, 2 * h));
            v.extend([normw(h), normw(h), normw(h)]);
        }
        v.push(normw(h));
        v.push(normw(h));
        match kind {
            LayerKind::DeltaNet => {
                v.extend(lin(d.conv_channels, h));
                v.extend(lin(d.gdn_value_width, h));
                v.extend(pair(d.gdn_v_heads, h));
                v.push(dense(d.conv_channels * d.conv_kernel, Init::Normal(0.5)));
                v.push(WSpec::Dense { n: d.gdn_v_heads, f32: true, init: Init::Normal(0.5) });
                v.push(WSpec::Dense { n: d.gdn_v_heads, f32: true, init: Init::LogUniform1To16 });
                v.push(WSpec::Dense { n: d.gdn_v_dim, f32: true, init: Init::OnePlusNormal(0.1) });
                v.extend(lin(h, d.gdn_value_width));
            }
            LayerKind::Attention => {
                v.extend(lin(2 * d.attn_dim, h));
                v.extend(lin(d.kv_dim, h));
                v.extend(lin(d.kv_dim, h));
                v.extend(lin(h, d.attn_dim));
                v.push(normw(d.head_dim));
                v.push(normw(d.head_dim));
            }
        }
        v.extend(pair(d.intermediate, h));
        v.extend(lin(h, d.intermediate));
    }
    v
}

/// Device bytes of the weights as the backend places them for random weights and for a bf16
/// checkpoint (quantised at load when `f.int4`): what it compares with the plan's `weights`
/// region. It differs from the plan only by the three small DeltaNet tensors the backend keeps in
/// f32 (`A_log`, `dt_bias`, the gated-norm weight; the plan prices them 16-bit) and, for bf16,
/// by the alignment padding the fused pairs save.
pub fn weights_device_bytes(cfg: &ModelConfig, f: WeightFormat) -> usize {
    weight_specs(cfg, f).iter().map(WSpec::device_bytes).sum()
}

/// A decoder linear (stored `[out, in]` projection) by its tensor name.
fn is_linear(name: &str) -> bool {
    if name == "mtp.fc.weight" {
        return true;
    }
    const LIN: [&str; 12] = [
        "in_proj_qkv.weight",
        "in_proj_z.weight",
        "in_proj_b.weight",
        "in_proj_a.weight",
        "out_proj.weight",
        "q_proj.weight",
        "k_proj.weight",
        "v_proj.weight",
        "o_proj.weight",
        "gate_proj.weight",
        "up_proj.weight",
        "down_proj.weight",
    ];
    LIN.iter().any(|l| name.ends_with(&format!(".{l}")) || name == *l)
}

/// True when a GPTQ `g_idx` is not `i / group` (act-order): the conversion may need a permutation.
fn act_order(g: &deltaserve_model::quant::GptqSource<'_>) -> bool {
    let gs = g.params.group_size.unwrap_or(g.in_features).max(1);
    g.g_idx.is_some_and(|b| {
        b.chunks_exact(4).enumerate().any(|(i, w)| u32::from_le_bytes([w[0], w[1], w[2], w[3]]) as usize != i / gs)
    })
}

/// Device bytes the backend places for the weights of checkpoint `dir` in format `f` (an upper
/// bound: act-order GPTQ linears are counted with their permutation). For a GPTQ checkpoint under
/// an int4 plan this differs from the plan's `weights` region by the linears the checkpoint leaves
/// unquantised (kept bf16) and the act-order permutations; callers reserve the difference as
/// backend scratch (the backend takes it from there). Under tensor parallelism, `shard`'s share (the
/// tensors cut as the rank loads them; `cfg` is the whole model).
pub fn checkpoint_weights_bytes(
    cfg: &ModelConfig,
    dir: &std::path::Path,
    f: WeightFormat,
    shard: Option<&ShardSpec>,
) -> Result<usize, CudaError> {
    let ckpt = Checkpoint::open(dir).map_err(|e| CudaError::Weights(e.to_string()))?;
    let keep_dense = matches!(cfg.quantization, Some(deltaserve_model::quant::Quantization::Gptq(_)));
    let w4 = |o: usize, i: usize, asym: bool, perm: bool| W4Bytes::new(o, i, asym, perm).layout(ALIGN).1;
    let mut total = 0usize;
    let _: ModelWeights<()> = ModelWeights::load(&ckpt, cfg, |src| {
        let name = &src.name;
        let shape = match shard {
            Some(s) => s.split_stored(name)?.shard_shape(&src.shape),
            None => src.shape.clone(),
        };
        let numel: usize = shape.iter().product();
        let dense2 = al(2 * numel);
        let lin = |int4: bool, keep: bool| match &src.quantized {
            Some(deltaserve_model::QuantizedSource::Gptq(g)) if int4 => {
                w4(shape[0], shape[1], !g.params.sym, act_order(g))
            }
            _ if int4 && !keep => w4(shape[0], shape[1], f.asym, false),
            _ => dense2,
        };
        total += if name.ends_with("embed_tokens.weight") {
            let head = if cfg.tie_word_embeddings && f.own_lm_head(cfg) {
                if f.lm_head_int4 { w4(shape[0], shape[1], f.asym, false) } else { dense2 }
            } else {
                0
            };
            head + if f.embed_on_host { 0 } else { dense2 }
        } else if name.ends_with("lm_head.weight") {
            lin(f.lm_head_int4, false)
        } else if f.int4 && is_linear(name) {
            lin(true, keep_dense)
        } else if is_f32_tensor(name) {
            al(4 * numel)
        } else {
            dense2
        };
        Ok(())
    })
    .map_err(|e| CudaError::Weights(e.to_string()))?;
    Ok(total)
}

/// Places weights in the weights region while a checkpoint loads.
struct Loader<'a> {
    rt: &'a Runtime,
    k: &'a Kernels,
    arena: &'a mut Arena,
    wreg: crate::arena::RegionId,
    /// Device staging for quantisation at load (the empty KV pages region).
    staging: DevSpan,
    quantized: usize,
    converted: usize,
    total_w4: usize,
    /// Tensor parallelism: the rank's shard, cut from every tensor as it loads.
    shard: Option<&'a ShardSpec>,
}

impl Loader<'_> {
    /// The source tensor as little-endian bf16 (or f32) bytes, cut to the rank's shard under tensor
    /// parallelism, with its (shard's) shape.
    fn bytes(&self, src: &TensorSource<'_>, f32_out: bool) -> Result<(Vec<u8>, Vec<usize>), ModelError> {
        let bytes = convert(src, f32_out)?;
        match self.shard {
            None => Ok((bytes, src.shape.clone())),
            Some(spec) => {
                let split = spec.split_stored(&src.name)?;
                let shape = split.shard_shape(&src.shape);
                let out = if f32_out {
                    shard_bytes::<4>(&split, &src.name, &src.shape, &bytes)?
                } else {
                    shard_bytes::<2>(&split, &src.name, &src.shape, &bytes)?
                };
                Ok((out, shape))
            }
        }
    }

    fn dense(&mut self, bytes: &[u8]) -> Result<u64, CudaError> {
        let ptr = self.arena.alloc(self.wreg, bytes.len())?.ptr;
        self.rt.upload(ptr, bytes)?;
        Ok(ptr)
    }

    /// `[out, in]` bf16 bytes quantised on the GPU (rows staged through `staging`).
    fn quantize(
        &mut self,
        bf16: &[u8],
        out: usize,
        inp: usize,
        asym: bool,
        name: &str,
    ) -> Result<W4Weights, CudaError> {
        W4Linear::check_shape(name, out, inp)?;
        if bf16.len() != 2 * out * inp {
            return Err(CudaError::Weights(format!("`{name}`: {} B, expected [{out}, {inp}] bf16", bf16.len())));
        }
        let rows = (self.staging.bytes / (2 * inp)).min(out.next_multiple_of(2)) & !1;
        if rows < 2 {
            return Err(CudaError::Plan(format!(
                "--quantize int4 stages each linear's rows in the KV pages region: {} B cannot hold 2 rows of \
                 `{name}` [{out}, {inp}] ({} B); plan for more context (or a larger --memory)",
                self.staging.bytes,
                4 * inp
            )));
        }
        let (_, bytes) = W4Bytes::new(out, inp, asym, false).layout(ALIGN);
        let base = self.arena.alloc(self.wreg, bytes)?.ptr;
        let w = W4Weights::at(base, out, inp, asym, false, ScaleDtype::F16);
        let s = self.rt.stream().clone();
        for r0 in (0..out).step_by(rows) {
            let r1 = (r0 + rows).min(out);
            // upload() waits for the stream, so the previous chunk's quantisation has read the staging.
            self.rt.upload(self.staging.ptr, &bf16[2 * r0 * inp..2 * r1 * inp])?;
            w4a16::w4_quantize(self.k, &s, self.staging.ptr, inp, r0, r1, &w)?;
        }
        self.rt.synchronize()?;
        self.quantized += 1;
        let n = self.quantized + self.converted;
        if n.is_multiple_of(32) || n == self.total_w4 {
            tracing::info!("int4 weights: {n}/{} linears", self.total_w4);
        }
        Ok(w)
    }

    fn gptq(&mut self, g: &deltaserve_model::quant::GptqSource<'_>, name: &str) -> Result<W4Weights, CudaError> {
        let c = W4Linear::from_gptq(g, name)?;
        if c.zero16_clamped > 0 || c.scales_rounded > 0 {
            tracing::warn!(
                "`{name}`: {} zero points of 16 clamped to 15, {} f32 scales rounded to fp16",
                c.zero16_clamped,
                c.scales_rounded
            );
        }
        let l = c.linear;
        let (asym, perm) = (l.zeros.is_some(), l.perm.is_some());
        let (_, bytes) = l.bytes().layout(ALIGN);
        let base = self.arena.alloc(self.wreg, bytes)?.ptr;
        let w = W4Weights::at(base, l.out_features, l.in_features, asym, perm, l.scale_dtype);
        self.rt.upload(w.qweight, &l.qweight)?;
        self.rt.upload(w.scales, &l.scales)?;
        if let (Some(p), Some(z)) = (w.zeros, &l.zeros) {
            self.rt.upload(p, z)?;
        }
        if let (Some(p), Some(v)) = (w.perm, &l.perm) {
            self.rt.upload(p, v)?;
        }
        self.converted += 1;
        Ok(w)
    }

    /// One linear: int4 (converted from GPTQ, or quantised unless `keep_dense`) or bf16.
    fn linear(&mut self, src: &TensorSource<'_>, int4: bool, asym: bool, keep_dense: bool) -> Result<Part, CudaError> {
        if int4 && let Some(deltaserve_model::QuantizedSource::Gptq(g)) = &src.quantized {
            if let Some(spec) = self.shard {
                // The rank's shard of the packed tensors, converted like a whole linear.
                let werr = |e: ModelError| CudaError::Weights(e.to_string());
                let split = spec.split_stored(&src.name).map_err(werr)?;
                let cut = deltaserve_model::shard::shard_gptq(&split, g, &src.name).map_err(werr)?;
                return Ok(Part::W4(self.gptq(&cut.source(), &src.name)?));
            }
            return Ok(Part::W4(self.gptq(g, &src.name)?));
        }
        let (bytes, shape) = self.bytes(src, false).map_err(|e| CudaError::Weights(e.to_string()))?;
        let (out, inp) = match shape.as_slice() {
            [o, i] => (*o, *i),
            s => return Err(CudaError::Weights(format!("`{}`: shape {s:?} is not a linear", src.name))),
        };
        if int4 && !keep_dense {
            return Ok(Part::W4(self.quantize(&bytes, out, inp, asym, &src.name)?));
        }
        Ok(Part::Bf16 { w: self.dense(&bytes)?, rows: out })
    }
}

/// A tensor's shard from its full little-endian bytes, `N` bytes per element (one copy: the shard).
fn shard_bytes<const N: usize>(
    split: &Split,
    name: &str,
    shape: &[usize],
    bytes: &[u8],
) -> Result<Vec<u8>, ModelError> {
    let (elems, rest) = bytes.as_chunks::<N>();
    if !rest.is_empty() {
        return Err(ModelError::weights(format!("`{name}`: {} bytes are not whole {N}-byte elements", bytes.len())));
    }
    Ok(split.extract(name, shape, elems)?.into_flattened())
}

/// The source tensor as little-endian bf16 or f32 bytes.
fn convert(src: &TensorSource<'_>, f32_out: bool) -> Result<Vec<u8>, ModelError> {
    if !f32_out && src.dtype == DType::BF16 {
        let mut out = Vec::with_capacity(src.byte_len());
        for p in &src.parts {
            out.extend_from_slice(p);
        }
        return Ok(out);
    }
    let x = src.to_f32()?;
    let mut out = Vec::with_capacity(x.len() * if f32_out { 4 } else { 2 });
    for v in x {
        if f32_out {
            out.extend_from_slice(&v.to_le_bytes());
        } else {
            out.extend_from_slice(&half::bf16::from_f32(v).to_bits().to_le_bytes());
        }
    }
    Ok(out)
}

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

    /// Gives a rank its group's communicators (rank r's stream must be this backend's stream).
    pub fn attach(&mut self, comms: Arc<Communicators>) -> Result<(), CudaError> {
        let Some(tp) = &mut self.tp else {
            return Err(CudaError::Plan(
                "communicators attached to a backend that is not a tensor-parallel rank".into(),
            ));
        };
        if comms.world() != tp.spec.world || !Arc::ptr_eq(comms.stream(tp.spec.rank), self.rt.stream()) {
            return Err(CudaError::Plan(format!(
                "rank {}: the communicators' world or stream is not this rank's",
                tp.spec.rank
            )));
        }
        self.graphs.clear();
        tp.comms = Some(comms);
        Ok(())
    }

    fn build(
        full_cfg: &ModelConfig,
        weights: WeightSource,
        plan: &Plan,
        host_snapshot_slots: usize,
        opts: CudaOptions,
        shard: Option<ShardSpec>,
    ) -> Result<Self, CudaError> {
        let rank_cfg = shard.as_ref().map(|s| s.rank_config(full_cfg));
        let cfg = rank_cfg.as_ref().unwrap_or(full_cfg);
        let rt = Runtime::open(shard.as_ref().map_or(0, |s| s.rank))?;
        let d = cfg.dims();
        // Under tensor parallelism the plan is rank 0's (the largest shard); a last rank's vocabulary
        // shard may be shorter.
        let same_shape = match &shard {
            None => plan.dims == d,
            Some(_) => Dims { vocab: plan.dims.vocab, ..d } == plan.dims && d.vocab <= plan.dims.vocab,
        };
        if !same_shape {
            return Err(CudaError::Plan("the plan was made for another model shape".into()));
        }
        if plan.options.activation_bytes_per_elem != 2 {
            return Err(CudaError::Plan("the CUDA backend supports bf16 activations only (gpu_defaults)".into()));
        }
        // K/V stored as bf16, fp8, int8 or int4 (load_kv refuses fp16 / fp32).
        let kvf = KvFormats { k: plan.options.k_dtype, v: plan.options.v_dtype };
        kvf.validate().map_err(|e| CudaError::Plan(format!("{e}")))?;
        if !matches!(plan.options.weights_dtype, WeightsDtype::Bf16 | WeightsDtype::Int4) {
            return Err(CudaError::Plan(format!(
                "the CUDA backend stores weights in bf16 or int4, not {}",
                plan.options.weights_dtype.name()
            )));
        }
        let fmt = WeightFormat::of(&plan.options);
        let max_draft = plan.options.speculative_tokens;
        if max_draft > 0 {
            let refuse =
                |what: &str| Err(CudaError::Plan(format!("speculative decoding on CUDA does not support {what} yet")));
            if shard.is_some() {
                return refuse("tensor parallelism");
            }
            if fmt.embed_on_host {
                return refuse("the embedding table in host memory (--embed-on-host)");
            }
            if cfg.mtp_num_hidden_layers == 0 {
                return Err(CudaError::Plan("speculative decoding: the model has no MTP head".into()));
            }
        }
        let k = Kernels::load_kv(&rt, kernel_dims(cfg), kvf)?;
        tracing::info!(
            "kernels for {} compiled and loaded in {:.0} ms; attention prefill: {}",
            k.arch,
            k.load_ms,
            k.attn_prefill_kernel()
        );
        let mut arena = Arena::new(rt.context().clone());
        let region = |name: &str| -> Result<usize, CudaError> {
            plan.region(name)
                .map(|r| r.bytes as usize)
                .ok_or_else(|| CudaError::Plan(format!("the plan has no `{name}` region")))
        };

        // Weights: the backend's own layout (bf16 pairs fused, three small tensors in f32), at least
        // the plan's region. What a GPTQ checkpoint needs beyond the plan (linears it leaves bf16,
        // act-order permutations) comes out of spare backend scratch the caller reserved for it.
        let weights_bytes = match &weights {
            WeightSource::Checkpoint(dir) if fmt.int4 && cfg.quantization.is_some() => {
                checkpoint_weights_bytes(full_cfg, dir, fmt, shard.as_ref())?
            }
            _ => weights_device_bytes(cfg, fmt),
        };
        let plan_weights = region("weights")?;
        let wreg = arena.add_region("weights", weights_bytes.max(plan_weights))?;

        // Fixed plan regions, each one allocation, each carved whole.
        let whole = |arena: &mut Arena, name: &str, bytes: usize| -> Result<DevSpan, CudaError> {
            let id = arena.add_region(name, bytes)?;
            arena.alloc(id, bytes)
        };
        let kv = whole(&mut arena, "kv_pages", region("kv_pages")?)?;
        let states = whole(&mut arena, "state_slots", region("state_slots")?)?;
        let snapshots = whole(&mut arena, "snapshots", region("snapshots")?)?;
        let acts = whole(&mut arena, "activations", region("activations")?)?;
        let logits = whole(&mut arena, "logits", region("logits")?)?;
        let block_tables = whole(&mut arena, "block_tables", region("block_tables")?)?;
        // Zeroed once (the host mirror starts so); steps upload only the entries that change.
        rt.memset(block_tables.ptr, 0, block_tables.bytes)?;
        let gemm_ws = whole(&mut arena, "gemm_workspace", region("gemm_workspace")?)?;

        // The plan's backend scratch: chunked DeltaNet f32 workspace and the varlen tables.
        let (t_max, s_max) = (plan.max_batch_tokens, plan.max_seqs);
        let parts = ScratchParts::new(cfg, t_max, s_max, fmt.int4, fmt.lm_head_int4);
        let scratch_bytes = parts.total();
        let planned = plan.region("backend_scratch").map_or(0, |r| r.bytes as usize);
        if planned < scratch_bytes {
            return Err(CudaError::Plan(format!(
                "the plan reserves {planned} B of backend scratch, the CUDA backend needs {scratch_bytes} B \
                 (set PlanOptions::backend_scratch_bytes from deltaserve_cuda::backend::scratch_bytes_for)"
            )));
        }
        let over = weights_bytes.saturating_sub(plan_weights).min(planned - scratch_bytes);
        let scratch = whole(&mut arena, "backend_scratch", planned - over)?;
        let mut at = scratch.ptr;
        let mut carve = |bytes: usize| {
            let span = DevSpan { ptr: at, bytes };
            at += al(bytes) as u64;
            span
        };
        let gdn_ws = carve(parts.gdn);
        let chunk_table = carve(parts.chunk_table);
        let tile_table = carve(parts.tile_table);
        let w4_x = carve(parts.w4_x);
        let w4_slice = carve(parts.w4_slice);

        // Activation buffers from the plan's workspace, each checked against what we put there.
        let (t, s) = (t_max, s_max);
        let h = d.hidden;
        let get = |name: &str, need: usize| -> Result<u64, CudaError> {
            let b = plan
                .workspace
                .get(name)
                .ok_or_else(|| CudaError::Plan(format!("the workspace has no buffer `{name}`")))?;
            if (b.bytes as usize) < need || b.offset as usize + b.bytes as usize > acts.bytes {
                return Err(CudaError::Plan(format!(
                    "workspace buffer `{name}` holds {} B at offset {}; the backend needs {need} B",
                    b.bytes, b.offset
                )));
            }
            Ok(acts.ptr + b.offset)
        };
        let has_gdn = d.num_deltanet_layers > 0;
        let has_attn = d.num_attention_layers > 0;
        let opt = |present: bool, name: &str, need: usize| if present { get(name, need) } else { Ok(0) };
        let p = plan.options.decode_partitions;
        let partial_bytes = attention::decode_scratch_bytes(s, d.q_heads, p, d.head_dim);
        let sampling_layout = SamplingScratch::new(s, d.vocab);
        let mut ws = Ws {
            token_ids: get("token_ids", 4 * t)?,
            positions: get("positions", 4 * t)?,
            cu_seqlens: get("cu_seqlens", 4 * (s + 1))?,
            seq_lens: get("seq_lens", 4 * s)?,
            slots: get("state_slot_ids", 4 * s)?,
            last_idx: get("last_token_idx", 4 * s)?,
            residual: get("residual", 2 * t * h)?,
            x_norm: get("x_norm", 2 * t * h)?,
            mixer_out: get("mixer_out", 2 * t * h)?,
            gdn_qkv: opt(has_gdn, "gdn_qkv", 2 * t * d.conv_channels)?,
            gdn_z: opt(has_gdn, "gdn_z", 2 * t * d.gdn_value_width)?,
            gdn_ba: opt(has_gdn, "gdn_b", 2 * t * 2 * d.gdn_v_heads)?,
            gdn_g: opt(has_gdn, "gdn_g", 4 * t * d.gdn_v_heads)?,
            gdn_beta: opt(has_gdn, "gdn_beta", 4 * t * d.gdn_v_heads)?,
            gdn_conv_out: opt(has_gdn, "gdn_conv_out", 2 * t * d.conv_channels)?,
            gdn_qk: opt(has_gdn, "gdn_qk", 2 * t * 2 * d.gdn_key_width)?,
            gdn_core_out: opt(has_gdn, "gdn_core_out", 2 * t * d.gdn_value_width)?,
            gdn_normed: opt(has_gdn, "gdn_normed", 2 * t * d.gdn_value_width)?,
            attn_qg: opt(has_attn, "attn_qg", 2 * t * 2 * d.attn_dim)?,
            attn_k: opt(has_attn, "attn_k", 2 * t * d.kv_dim)?,
            attn_v: opt(has_attn, "attn_v", 2 * t * d.kv_dim)?,
            attn_partials: DevSpan {
                ptr: opt(has_attn, "attn_decode_partials", partial_bytes)?,
                bytes: if has_attn { partial_bytes } else { 0 },
            },
            attn_out: opt(has_attn, "attn_out", 2 * t * d.attn_dim)?,
            mlp_in: get("mlp_in", 2 * t * h)?,
            mlp_gate_up: get("mlp_gate_up", 2 * t * 2 * d.intermediate)?,
            mlp_act: get("mlp_act", 2 * t * d.intermediate)?,
            mlp_out: get("mlp_out", 2 * t * h)?,
            fold_x: get("fold_x", 2 * t.min(w4a16::GEMV_MAX_M) * h)?,
            fold_sums: get("fold_sums", w4a16::fold_sums_bytes(h))?,
            final_normed: get("final_normed", 2 * t * h)?,
            final_hidden: get("final_hidden", 2 * s * h)?,
            sampling: get("sampling", sampling_layout.bytes as usize)?,
            sampling_layout,
            gdn_ws,
            chunk_table,
            tile_table,
            w4_x,
            w4_slice,
        };
        if logits.bytes < 4 * s * d.vocab {
            return Err(CudaError::Plan(format!("logits region {} B < [{s}, {}] f32", logits.bytes, d.vocab)));
        }
        let table_width = plan.block_table_bytes as usize / (4 * s);

        // Cache layouts (Plan::kv_tensor_bytes / state_tensor_bytes).
        let [kb, ks, vb, vs] = plan.kv_tensor_bytes().map(|x| x as usize);
        let [rb, cb] = plan.state_tensor_bytes(plan.num_state_slots).map(|x| x as usize);
        let [srb, scb] = plan.state_tensor_bytes(plan.options.snapshot_slots).map(|x| x as usize);
        let rec_bytes = d.gdn_v_heads * d.gdn_k_dim * d.gdn_v_dim * 4;
        let conv_bytes = d.conv_kernel.saturating_sub(1) * d.conv_channels * 2;
        let (mut kv_at, mut st_at, mut sn_at) = (0usize, 0usize, 0usize);
        let mut caches = Vec::with_capacity(d.num_layers);
        for kind in &cfg.layer_types {
            match kind {
                LayerKind::Attention => {
                    let (l, n) = LayerKv::carve(kv.ptr + kv_at as u64, [kb, ks, vb, vs], kvf);
                    kv_at += n;
                    caches.push(LayerCache::Attn(l));
                }
                LayerKind::DeltaNet => {
                    caches.push(LayerCache::Gdn {
                        rec: st_at,
                        conv: st_at + al(rb),
                        snap_rec: sn_at,
                        snap_conv: sn_at + al(srb),
                    });
                    st_at += al(rb) + al(cb);
                    sn_at += al(srb) + al(scb);
                }
            }
        }
        // Speculative decoding: the MTP head's KV layer after the model's, and the pending hidden rows
        // after the DeltaNet tensors of the slots and of the snapshots.
        let spec_kv = (max_draft > 0).then(|| {
            let (l, n) = LayerKv::carve(kv.ptr + kv_at as u64, [kb, ks, vb, vs], kvf);
            kv_at += n;
            l
        });
        let (pending, snap_pending) = (st_at, sn_at);
        if max_draft > 0 {
            st_at += al(plan.num_state_slots * h * 2);
            sn_at += al(plan.options.snapshot_slots * h * 2);
        }
        if kv_at > kv.bytes || st_at > states.bytes || sn_at > snapshots.bytes {
            return Err(CudaError::Plan(format!(
                "cache layouts exceed their regions: kv {kv_at}/{}, states {st_at}/{}, snapshots {sn_at}/{}",
                kv.bytes, states.bytes, snapshots.bytes
            )));
        }

        let spec = match spec_kv {
            Some(kv) => {
                let region = whole(&mut arena, "speculation", region("speculation")?)?;
                let rows = s * (1 + max_draft);
                let n_gdn = d.num_deltanet_layers;
                let sizes = [
                    rows * h * 2,
                    s * h * 2,
                    n_gdn * rows * d.conv_channels * 2,
                    n_gdn * rows * 2 * d.gdn_v_heads * 2,
                    Spec::idx_bytes(rows),
                    rows * 4,
                    rows * h * 2,
                    attention::decode_scratch_bytes(rows, d.q_heads, plan.options.verify_partitions(), d.head_dim),
                ];
                let mut at = region.ptr;
                let spans = sizes.map(|b| {
                    let p = at;
                    at += al(b) as u64;
                    DevSpan { ptr: p, bytes: b }
                });
                if at - region.ptr > region.bytes as u64 {
                    return Err(CudaError::Plan(format!(
                        "the speculation region holds {} B, the CUDA backend needs {} B",
                        region.bytes,
                        at - region.ptr
                    )));
                }
                // Every verified row may want logits: the gather indices and rows of the lm_head.
                ws.last_idx = spans[5].ptr;
                ws.final_hidden = spans[6].ptr;
                let mws = Ws {
                    residual: get("mtp_residual", 2 * t * h)?,
                    x_norm: get("mtp_norm", 2 * t * h)?,
                    mixer_out: get("mtp_mixer_out", 2 * t * h)?,
                    attn_qg: get("mtp_qg", 2 * t * 2 * d.attn_dim)?,
                    attn_k: get("mtp_k", 2 * t * d.kv_dim)?,
                    attn_v: get("mtp_v", 2 * t * d.kv_dim)?,
                    attn_partials: DevSpan { ptr: get("mtp_partials", partial_bytes)?, bytes: partial_bytes },
                    attn_out: get("mtp_attn_out", 2 * t * d.attn_dim)?,
                    mlp_in: get("mtp_mlp_in", 2 * t * h)?,
                    mlp_gate_up: get("mtp_gate_up", 2 * t * 2 * d.intermediate)?,
                    mlp_act: get("mtp_act", 2 * t * d.intermediate)?,
                    mlp_out: get("mtp_mlp_out", 2 * t * h)?,
                    last_idx: spans[5].ptr,
                    final_hidden: spans[6].ptr,
                    ..ws
                };
                Some(Spec {
                    max_draft,
                    kv,
                    ws: mws,
                    rows_in: get("mtp_rows", 2 * t * h)?,
                    cat: get("mtp_cat", 2 * t * 2 * h)?,
                    pending,
                    snap_pending,
                    rows,
                    verify_hidden: spans[0].ptr,
                    draft_hidden: spans[1].ptr,
                    trace_x: spans[2].ptr,
                    trace_ba: spans[3].ptr,
                    idx: spans[4],
                    partials: spans[7],
                    partitions: plan.options.verify_partitions(),
                    verified: Vec::new(),
                    verify_cu: Vec::new(),
                    verify_slots: Vec::new(),
                    draft_s: 0.0,
                })
            }
            None => None,
        };
        if logits.bytes < 4 * s * (1 + max_draft) * d.vocab {
            return Err(CudaError::Plan(format!(
                "logits region {} B < [{}, {}] f32",
                logits.bytes,
                s * (1 + max_draft),
                d.vocab
            )));
        }

        let gemm = Gemm::new(&rt, gemm_ws)?;
        let snapshot_len = d.num_deltanet_layers * (rec_bytes + conv_bytes) + if spec.is_some() { h * 2 } else { 0 };
        let host_pool_bytes = host_snapshot_slots * snapshot_len;
        let host_pool = (host_pool_bytes > 0).then(|| PinnedHost::new(&rt, host_pool_bytes)).transpose()?;
        let host_embed = if fmt.embed_on_host {
            let table = PinnedHost::new(&rt, d.vocab * h * 2)?;
            Some(HostEmbed { table, staging: PinnedHost::new(&rt, t_max * h * 2)? })
        } else {
            None
        };
        let inputs = StepInputs::new(&rt, plan)?;
        let launches = Launches::new(&rt, s_max, d.vocab)?;

        let mut be = CudaBackend {
            rt,
            k,
            gemm,
            arena,
            d,
            eps: cfg.rms_norm_eps,
            rope_theta: cfg.rope_theta as f32,
            w: Weights { embed: 0, lm_head: Vec::new(), final_norm: 0, layers: Vec::new(), mtp: None },
            ws,
            caches,
            states,
            snapshots,
            logits,
            block_tables,
            table_width,
            table_mirror: std::cell::RefCell::new(vec![0; block_tables.bytes / 4]),
            page_size: plan.page_size,
            num_pages: plan.num_kv_pages,
            num_slots: plan.num_state_slots,
            snapshot_slots: plan.options.snapshot_slots,
            max_tokens: t_max,
            max_seqs: s_max,
            decode_partitions: p,
            rec_bytes,
            conv_bytes,
            host_pool,
            host_snapshot_slots,
            snapshot_len,
            weights_bytes,
            scratch_bytes,
            prof: std::cell::RefCell::new(None),
            phases: std::cell::RefCell::new(None),
            opts,
            graphs: HashMap::new(),
            graph_stats: GraphStats::default(),
            host_embed,
            inputs,
            launches,
            w4_quantized: 0,
            w4_converted: 0,
            tp: shard.map(|spec| RankComm { spec, full_vocab: full_cfg.vocab_size, comms: None }),
            spec,
            fold: false,
        };
        // The KV pages region is empty until the first step: staging for quantisation at load and
        // for the host embedding's random init.
        be.w = match weights {
            WeightSource::Checkpoint(dir) => be.load_checkpoint(full_cfg, cfg, &dir, wreg, fmt, kv)?,
            WeightSource::RandomWeights { seed } => {
                // Each rank draws its own shard's values.
                let seed = seed ^ be.tp.as_ref().map_or(0, |t| (t.spec.rank as u64) << 32);
                be.random_weights(cfg, wreg, seed, fmt, kv)?
            }
        };
        // Zero every cache region once (never read before written, but deterministic).
        for span in [kv, be.states, be.snapshots] {
            be.rt.memset(span.ptr, 0, span.bytes)?;
        }
        be.rt.synchronize()?;
        be.fold = be.tp.is_none() && layers_fold(&be.w.layers, be.d.hidden);
        be.arena.seal();
        Ok(be)
    }

    /// Loads the checkpoint of the model `full` into this backend's layout for `cfg` (the rank's
    /// shape under tensor parallelism, where every tensor is cut to the rank's shard as it loads).
    fn load_checkpoint(
        &mut self,
        full: &ModelConfig,
        cfg: &ModelConfig,
        dir: &std::path::Path,
        wreg: crate::arena::RegionId,
        fmt: WeightFormat,
        staging: DevSpan,
    ) -> Result<Weights, CudaError> {
        let ckpt = Checkpoint::open(dir).map_err(|e| CudaError::Weights(e.to_string()))?;
        let d = self.d;
        let h = d.hidden;
        // A GPTQ checkpoint keeps the linears it left unquantised in bf16; a bf16 checkpoint under an
        // int4 plan is quantised at load (`--quantize int4`).
        let keep_dense = matches!(cfg.quantization, Some(deltaserve_model::quant::Quantization::Gptq(_)));
        let total_w4 = weight_specs(cfg, fmt).iter().filter(|s| matches!(s, WSpec::W4 { .. })).count();
        let mut ld = Loader {
            rt: &self.rt,
            k: &self.k,
            arena: &mut self.arena,
            wreg,
            staging,
            quantized: 0,
            converted: 0,
            total_w4,
            shard: self.tp.as_ref().map(|t| &t.spec),
        };
        let mut pending: Option<u64> = None;
        let mut tied_head: Option<Part> = None;
        let host = self.host_embed.as_ref().map(|e| (e.table.ptr(), e.table.bytes()));
        let tied = cfg.tie_word_embeddings;
        let mut convert = |src: TensorSource<'_>| -> Result<Part, ModelError> {
            let dev = |e: CudaError| ModelError::config(format!("{}: {e}", src.name));
            let name = src.name.clone();
            if name.ends_with("embed_tokens.weight") {
                let (bytes, _) = ld.bytes(&src, false)?;
                let own_head = tied && fmt.own_lm_head(cfg);
                if own_head {
                    tied_head = Some(if fmt.lm_head_int4 {
                        Part::W4(ld.quantize(&bytes, d.vocab, h, fmt.asym, &name).map_err(dev)?)
                    } else {
                        Part::Bf16 { w: ld.dense(&bytes).map_err(dev)?, rows: d.vocab }
                    });
                }
                return match host {
                    Some((table, table_bytes)) => {
                        if bytes.len() != table_bytes {
                            return Err(ModelError::config(format!(
                                "{name}: {} B, expected {table_bytes}",
                                bytes.len()
                            )));
                        }
                        // SAFETY: the pinned table holds table_bytes bytes and lives as long as the backend.
                        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), table, table_bytes) };
                        Ok(Part::Bf16 { w: 0, rows: d.vocab })
                    }
                    None => Ok(Part::Bf16 { w: ld.dense(&bytes).map_err(dev)?, rows: d.vocab }),
                };
            }
            if name.ends_with("lm_head.weight") {
                return ld.linear(&src, fmt.lm_head_int4, fmt.asym, false).map_err(dev);
            }
            if fmt.int4 && is_linear(&name) {
                return ld.linear(&src, true, fmt.asym, keep_dense).map_err(dev);
            }
            // bf16 linears (pairs fused) and the small tensors.
            let f32_out = is_f32_tensor(&name);
            let (bytes, shape) = ld.bytes(&src, f32_out)?;
            let rows = if shape.len() == 2 { shape[0] } else { 0 };
            let ptr = if pair_second(&name) {
                pending
                    .take()
                    .ok_or_else(|| ModelError::config(format!("{name}: its pair's first half was not loaded")))?
            } else if pair_first(&name) {
                let span = ld.arena.alloc(ld.wreg, 2 * bytes.len()).map_err(dev)?;
                pending = Some(span.ptr + bytes.len() as u64);
                span.ptr
            } else {
                ld.arena.alloc(ld.wreg, bytes.len()).map_err(dev)?.ptr
            };
            ld.rt.upload(ptr, &bytes).map_err(dev)?;
            Ok(Part::Bf16 { w: ptr, rows: if pair_first(&name) { 2 * rows } else { rows } })
        };
        let werr = |e: ModelError| CudaError::Weights(e.to_string());
        let mw: ModelWeights<Part> = ModelWeights::load(&ckpt, full, &mut convert).map_err(werr)?;
        let mtp_w = if fmt.mtp {
            let m = ModelWeights::<Part>::load_mtp(&ckpt, full, &mut convert).map_err(werr)?;
            Some(m.ok_or_else(|| {
                CudaError::Weights("speculative decoding needs the checkpoint's MTP head (no `mtp.*` tensors)".into())
            })?)
        } else {
            None
        };
        let (quantized, converted) = (ld.quantized, ld.converted);
        if quantized > 0 {
            tracing::info!("quantised {quantized} linears to int4 on the GPU (round to nearest, group 128)");
        }
        self.w4_quantized = quantized;
        self.w4_converted = converted;
        let one = |p: &Part| vec![*p];
        // int4: pairs are two parts; bf16: the first half is the fused pair.
        let two =
            |a: &Part, b: &Part| if matches!(a, Part::Bf16 { .. }) && !fmt.int4 { vec![*a] } else { vec![*a, *b] };
        let layer = |l: &deltaserve_model::LayerWeights<Part>| Layer {
            input_norm: l.input_norm.ptr(),
            post_norm: l.post_norm.ptr(),
            mixer: match &l.mixer {
                deltaserve_model::MixerWeights::DeltaNet(g) => Mixer::Gdn(GdnLayer {
                    qkv: one(&g.in_proj_qkv),
                    z: one(&g.in_proj_z),
                    ba: two(&g.in_proj_b, &g.in_proj_a),
                    conv: g.conv1d.ptr(),
                    dt_bias: g.dt_bias.ptr(),
                    a_log: g.a_log.ptr(),
                    norm: g.norm.ptr(),
                    out: one(&g.out_proj),
                }),
                deltaserve_model::MixerWeights::Attention(a) => Mixer::Attn(AttnLayer {
                    q: one(&a.q_proj),
                    k: one(&a.k_proj),
                    v: one(&a.v_proj),
                    o: one(&a.o_proj),
                    q_norm: a.q_norm.ptr(),
                    k_norm: a.k_norm.ptr(),
                }),
            },
            gate_up: two(&l.mlp.gate_proj, &l.mlp.up_proj),
            down: one(&l.mlp.down_proj),
        };
        let layers = mw.layers.iter().map(layer).collect();
        let mtp = mtp_w.map(|m| MtpHead {
            fc: one(&m.fc),
            pre_fc_norm_embedding: m.pre_fc_norm_embedding.ptr(),
            pre_fc_norm_hidden: m.pre_fc_norm_hidden.ptr(),
            norm: m.norm.ptr(),
            layer: layer(&m.layer),
        });
        let lm_head = match (&mw.lm_head, tied_head) {
            (Some(p), _) => *p,
            (None, Some(p)) => p,
            (None, None) => mw.embed,
        };
        Ok(Weights {
            embed: if self.host_embed.is_some() { 0 } else { mw.embed.ptr() },
            lm_head: vec![lm_head],
            final_norm: mw.final_norm.ptr(),
            layers,
            mtp,
        })
    }

    fn random_weights(
        &mut self,
        cfg: &ModelConfig,
        wreg: crate::arena::RegionId,
        seed: u64,
        fmt: WeightFormat,
        staging: DevSpan,
    ) -> Result<Weights, CudaError> {
        let specs = weight_specs(cfg, fmt);
        let mut parts = Vec::with_capacity(specs.len());
        let s = self.rt.stream().clone();
        for (i, spec) in specs.iter().enumerate() {
            let tseed = seed ^ (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
            let part = match *spec {
                WSpec::Dense { n, f32, init } => {
                    let span = self.arena.alloc(wreg, n * if f32 { 4 } else { 2 })?;
                    init_random(&self.k, &s, span.ptr, n, tseed, init, f32)?;
                    Part::Bf16 { w: span.ptr, rows: 0 }
                }
                WSpec::W4 { out, inp, asym } => {
                    let (_, bytes) = W4Bytes::new(out, inp, asym, false).layout(ALIGN);
                    let base = self.arena.alloc(wreg, bytes)?.ptr;
                    let w = W4Weights::at(base, out, inp, asym, false, ScaleDtype::Bf16);
                    let b = w.bytes();
                    init_random(&self.k, &s, w.qweight, b.qweight / 4, tseed, Init::Bits, false)?;
                    // Uniform codes with zero 8 have a std of ~4.6 steps: weights of std 1/sqrt(in).
                    let std = 1.0 / (inp as f32).sqrt() / 4.6;
                    init_random(&self.k, &s, w.scales, b.scales / 2, tseed ^ 1, Init::Scale(std), false)?;
                    if let Some(z) = w.zeros {
                        self.rt.memset(z, 0x88, b.zeros)?;
                    }
                    Part::W4(w)
                }
                WSpec::Host { n } => {
                    let Some(he) = &self.host_embed else {
                        return Err(CudaError::Plan("embed_on_host without a host table".into()));
                    };
                    // Generated on the GPU through the (still empty) KV region, copied to the pinned table.
                    let chunk = (staging.bytes / 2).min(n);
                    if chunk == 0 {
                        return Err(CudaError::Plan("no KV region to stage the host embedding".into()));
                    }
                    for (c, e0) in (0..n).step_by(chunk).enumerate() {
                        let m = chunk.min(n - e0);
                        init_random(&self.k, &s, staging.ptr, m, tseed ^ c as u64, Init::Normal(1.0), false)?;
                        // SAFETY: the table holds n bf16 elements (table_bytes = 2n); e0 + m <= n.
                        let dst = unsafe { std::slice::from_raw_parts_mut(he.table.ptr().add(2 * e0), 2 * m) };
                        self.rt.download(dst, staging.ptr)?;
                    }
                    Part::Bf16 { w: 0, rows: 0 }
                }
            };
            parts.push(part);
        }
        let mut it = parts.into_iter();
        let mut next = || it.next().ok_or_else(|| CudaError::Weights("weight spec list too short".into()));
        let proj = |next: &mut dyn FnMut() -> Result<Part, CudaError>, pair: bool| -> Result<Proj, CudaError> {
            Ok(if pair && fmt.int4 { vec![next()?, next()?] } else { vec![next()?] })
        };
        let d = self.d;
        let embed_part = next()?;
        let embed = embed_part.ptr();
        let lm_head = if fmt.own_lm_head(cfg) { next()? } else { Part::Bf16 { w: embed, rows: d.vocab } };
        let lm_head = match lm_head {
            Part::Bf16 { w, .. } => Part::Bf16 { w, rows: d.vocab },
            p => p,
        };
        let final_norm = next()?.ptr();
        let mut layers = Vec::with_capacity(cfg.layer_types.len());
        // Row counts of bf16 parts (the forward needs them only for mixed projections).
        let rows = |mut p: Proj, r: usize| -> Proj {
            if let [Part::Bf16 { rows, .. }] = p.as_mut_slice() {
                *rows = r;
            }
            p
        };
        let layer = |next: &mut dyn FnMut() -> Result<Part, CudaError>, kind: LayerKind| -> Result<Layer, CudaError> {
            let input_norm = next()?.ptr();
            let post_norm = next()?.ptr();
            let mixer = match kind {
                LayerKind::DeltaNet => Mixer::Gdn(GdnLayer {
                    qkv: rows(proj(next, false)?, d.conv_channels),
                    z: rows(proj(next, false)?, d.gdn_value_width),
                    ba: rows(proj(next, true)?, 2 * d.gdn_v_heads),
                    conv: next()?.ptr(),
                    dt_bias: next()?.ptr(),
                    a_log: next()?.ptr(),
                    norm: next()?.ptr(),
                    out: rows(proj(next, false)?, d.hidden),
                }),
                LayerKind::Attention => Mixer::Attn(AttnLayer {
                    q: rows(proj(next, false)?, 2 * d.attn_dim),
                    k: rows(proj(next, false)?, d.kv_dim),
                    v: rows(proj(next, false)?, d.kv_dim),
                    o: rows(proj(next, false)?, d.hidden),
                    q_norm: next()?.ptr(),
                    k_norm: next()?.ptr(),
                }),
            };
            let gate_up = rows(proj(next, true)?, 2 * d.intermediate);
            let down = rows(proj(next, false)?, d.hidden);
            Ok(Layer { input_norm, post_norm, mixer, gate_up, down })
        };
        for kind in &cfg.layer_types {
            layers.push(layer(&mut next, *kind)?);
        }
        let mtp = if fmt.mtp && cfg.mtp_num_hidden_layers > 0 {
            let fc = rows(proj(&mut next, false)?, d.hidden);
            let (pre_fc_norm_embedding, pre_fc_norm_hidden, norm) = (next()?.ptr(), next()?.ptr(), next()?.ptr());
            let layer = layer(&mut next, LayerKind::Attention)?;
            Some(MtpHead { fc, pre_fc_norm_embedding, pre_fc_norm_hidden, norm, layer })
        } else {
            None
        };
        self.rt.synchronize()?;
        Ok(Weights {
            embed: if fmt.embed_on_host { 0 } else { embed },
            lm_head: vec![lm_head],
            final_norm,
            layers,
            mtp,
        })
    }

    /// The runtime (device name, stream) — for benchmarks.
    pub fn runtime(&self) -> &Runtime {
        &self.rt
    }

    /// (name, size) of each arena region.
    pub fn regions(&self) -> Vec<(String, usize)> {
        self.arena.regions().into_iter().map(|(n, s, _)| (n, s)).collect()
    }

    /// Turns per-op-group timing on or off: steps then run eagerly (no CUDA graphs) with a timing
    /// event after each op group; [`CudaBackend::take_profile`] returns and clears the totals.
    pub fn set_profiling(&mut self, on: bool) -> Result<(), CudaError> {
        let prof = if on {
            let ctx = self.rt.context();
            let timing = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
            let events = (0..PROFILE_EVENTS)
                .map(|_| ctx.new_event(timing))
                .collect::<Result<Vec<_>, _>>()
                .map_err(CudaError::driver("cuEventCreate"))?;
            Some(Profile { events, open: false, names: Vec::new(), totals: Vec::new() })
        } else {
            None
        };
        *self.prof.borrow_mut() = prof;
        Ok(())
    }

    /// Times the parts of every step from now on (host work, uploads, forward, outputs), or stops.
    pub fn set_step_phases(&mut self, on: bool) -> Result<(), CudaError> {
        *self.phases.borrow_mut() = if on { Some(PhaseTimer::new(&self.rt)?) } else { None };
        Ok(())
    }

    /// The median parts of the steps timed since phases were turned on or last taken.
    pub fn take_step_phases(&self) -> Option<StepPhases> {
        self.phases.borrow_mut().as_mut().and_then(|p| p.take())
    }

    /// Step phases: the step reached `m`.
    fn phase(&self, m: Mark) -> Result<(), CudaError> {
        match self.phases.borrow_mut().as_mut() {
            Some(p) => p.mark(m, self.rt.stream()),
            None => Ok(()),
        }
    }

    /// (group, seconds of GPU time) accumulated since profiling was turned on or last taken.
    pub fn take_profile(&self) -> Vec<(&'static str, f64)> {
        self.prof.borrow_mut().as_mut().map(|p| std::mem::take(&mut p.totals)).unwrap_or_default()
    }

    /// Profiling: marks the start of a step (first adding up groups timed outside one).
    fn prof_begin(&self) -> Result<(), CudaError> {
        self.prof_end()?;
        let mut p = self.prof.borrow_mut();
        if let Some(p) = p.as_mut() {
            p.names.clear();
            p.events[0].record(self.rt.stream()).map_err(CudaError::driver("cuEventRecord"))?;
            p.open = true;
        }
        Ok(())
    }

    /// Profiling: waits for the step's events and adds the time between them to their groups.
    fn prof_end(&self) -> Result<(), CudaError> {
        let mut p = self.prof.borrow_mut();
        if let Some(p) = p.as_mut() {
            for (i, &name) in p.names.iter().enumerate() {
                let ms = p.events[i].elapsed_ms(&p.events[i + 1]).map_err(CudaError::driver("cuEventElapsedTime"))?;
                match p.totals.iter_mut().find(|(n, _)| *n == name) {
                    Some(e) => e.1 += f64::from(ms) / 1e3,
                    None => p.totals.push((name, f64::from(ms) / 1e3)),
                }
            }
            p.names.clear();
            p.open = false;
        }
        Ok(())
    }

    /// Profiling: the op group `name` ends here.
    fn tick(&self, name: &'static str) -> Result<(), CudaError> {
        let full = self.prof.borrow().as_ref().is_some_and(|p| p.names.len() + 1 == p.events.len());
        if full {
            self.prof_end()?;
            self.prof_begin()?;
        }
        let mut p = self.prof.borrow_mut();
        if let Some(p) = p.as_mut() {
            if !p.open {
                // A group outside a step (e.g. a cache op): its own start.
                p.events[0].record(self.rt.stream()).map_err(CudaError::driver("cuEventRecord"))?;
                p.open = true;
            }
            p.events[p.names.len() + 1].record(self.rt.stream()).map_err(CudaError::driver("cuEventRecord"))?;
            p.names.push(name);
        }
        Ok(())
    }

    /// The model's vocabulary (a tensor-parallel rank holds a shard of it: [`Backend::vocab_size`]).
    fn full_vocab(&self) -> usize {
        self.tp.as_ref().map_or(self.d.vocab, |t| t.full_vocab)
    }

    /// Tensor parallelism: the in-place all-reduce (sum) of the `[.., elems]` bf16 activations at
    /// `buf` over the group, on this rank's stream (so also inside a captured decode graph). A no-op
    /// on one GPU.
    fn all_reduce(&self, buf: u64, elems: usize) -> Result<(), CudaError> {
        let Some(r) = &self.tp else { return Ok(()) };
        let comms = r.comms.as_ref().ok_or_else(|| {
            CudaError::Plan(format!(
                "tensor-parallel rank {} runs a step before its communicators are attached",
                r.spec.rank
            ))
        })?;
        comms
            .all_reduce_sum_rank(r.spec.rank, DevSpan { ptr: buf, bytes: 2 * elems }, elems, CollDtype::Bf16)
            .map_err(|e| CudaError::Plan(format!("rank {}: {e}", r.spec.rank)))?;
        self.tick("all-reduce")
    }

    /// Benchmarks: seconds per all-reduce of `[tokens, hidden]` bf16 activations, the size a step
    /// of `tokens` tokens reduces after every row-parallel projection (the mean of `reps` calls on
    /// the `mixer_out` buffer, synchronised). Every rank of the group must call it at once.
    pub fn time_all_reduce(&self, tokens: usize, reps: usize) -> Result<f64, CudaError> {
        if tokens > self.max_tokens || reps == 0 {
            return Err(CudaError::Plan(format!("all-reduce timing of {tokens} tokens × {reps}")));
        }
        self.rt.context().bind_to_thread().map_err(CudaError::driver("cuCtxSetCurrent"))?;
        let elems = tokens * self.d.hidden;
        self.all_reduce(self.ws.mixer_out, elems)?;
        self.rt.synchronize()?;
        let t0 = std::time::Instant::now();
        for _ in 0..reps {
            self.all_reduce(self.ws.mixer_out, elems)?;
        }
        self.rt.synchronize()?;
        Ok(t0.elapsed().as_secs_f64() / reps as f64)
    }

    /// This rank's vocabulary range under tensor parallelism (all of it on one GPU).
    pub fn vocab_range(&self) -> std::ops::Range<usize> {
        self.tp.as_ref().map_or(0..self.d.vocab, |t| t.spec.vocab.clone())
    }

    /// cuBLASLt heuristic calls so far (one per new GEMM shape).
    pub fn gemm_heuristic_calls(&self) -> usize {
        self.gemm.heuristic_calls()
    }

    pub fn options(&self) -> CudaOptions {
        self.opts
    }

    /// Changes the options; captured graphs are dropped (they bake in the old choices).
    pub fn set_options(&mut self, opts: CudaOptions) -> Result<(), CudaError> {
        if opts != self.opts {
            self.rt.synchronize()?;
            self.graphs.clear();
            self.opts = opts;
        }
        Ok(())
    }

    /// The argmax over ids `< valid` of each of the first `rows` rows of the logits region, picked on the
    /// device into the i32 array at `ids` (4 bytes a row come back).
    fn logits_argmax(&self, rows: usize, valid: usize, ids: u64) -> Result<Vec<u32>, CudaError> {
        let v = self.d.vocab;
        ops::argmax::argmax_rows(&self.k, self.rt.stream(), self.logits.ptr, v, valid.min(v), rows, ids)?;
        let mut got = vec![0i32; rows];
        self.rt.download(&mut got, ids)?;
        Ok(got.into_iter().map(|t| t as u32).collect())
    }

    /// The token of each of the first `rows` rows of the logits region picked by its [`RowSampling`]
    /// over ids `< valid` on the device: penalties applied in place, then greedy or the draw. Rows whose
    /// sorted bin holds more ids than the scratch's candidates, and steps with more presence / frequency
    /// entries than the scratch holds, are picked on the host from their (penalised) logits.
    fn logits_sample(&self, valid: usize, rows: &[RowSampling]) -> Result<Vec<u32>, CudaError> {
        let (v, n) = (self.d.vocab, rows.len());
        let valid = valid.min(v);
        let (sc, base) = (&self.ws.sampling_layout, self.ws.sampling);
        let e = ops::sample::encode(rows, valid, sc.penalty_words);
        if !ops::sample::penalties_fit(e.pens.len(), n) {
            return self.pick_on_host(valid, rows);
        }
        let s = self.rt.stream();
        ops::sample::sample_rows(&self.k, s, sc, base, self.logits.ptr, v, valid, n, &e)?;
        let mut got = vec![[0i32; 2]; n];
        self.rt.download(&mut got, base + sc.out)?;
        let mut tokens: Vec<u32> = got.iter().map(|&[t, _]| t as u32).collect();
        // Rows the device could not cut: the host's rule over their penalised logits.
        let left: Vec<usize> =
            (0..n).filter(|&r| got[r][1] != 0 || got[r][0] < 0 || got[r][0] as usize >= valid).collect();
        if !left.is_empty() {
            let mut logits = vec![0f32; left.len() * v];
            for (row, &r) in logits.chunks_exact_mut(v).zip(&left) {
                self.rt.download(row, self.logits.ptr + (4 * r * v) as u64)?;
            }
            let picks: Vec<RowSampling> = left.iter().map(|&r| rows[r].clone()).collect();
            for (&r, t) in left.iter().zip(pick_rows(&mut logits, v, valid, &picks, true)) {
                tokens[r] = t;
            }
        }
        Ok(tokens)
    }

    /// The first `rows.len()` logits rows downloaded and picked on the host by their rules (penalties
    /// included): for steps whose penalty entries exceed the sampling scratch.
    fn pick_on_host(&self, valid: usize, rows: &[RowSampling]) -> Result<Vec<u32>, CudaError> {
        let v = self.d.vocab;
        let mut logits = vec![0f32; rows.len() * v];
        self.rt.download(&mut logits, self.logits.ptr)?;
        Ok(pick_rows(&mut logits, v, valid, rows, false))
    }

    /// Seconds the last speculative step spent drafting with the MTP head (0 without speculation).
    pub fn last_draft_s(&self) -> f64 {
        self.spec.as_ref().map_or(0.0, |sp| sp.draft_s)
    }

    pub fn graph_stats(&self) -> GraphStats {
        self.graph_stats
    }

    /// The decode graph of a step with `n` one-token sequences: `n` itself, or with
    /// [`CudaOptions::graph_pad`] the next power of two capped at the plan's `max_seqs`.
    pub fn graph_bucket(&self, n: usize) -> usize {
        if !self.opts.graph_pad {
            return n;
        }
        n.next_power_of_two().min(self.max_seqs).max(n)
    }

    /// y_s [t, m_s] = x [t, kdim] · W_sᵀ for each output: the decode GEMV (one launch for all
    /// outputs) for steps of at most `gemv_max_tokens` tokens, else one cuBLASLt GEMM each.
    /// Outputs made of int4 parts (or mixing int4 and bf16 parts) run part by part:
    /// [`CudaBackend::w4_linear`] for int4, a cuBLASLt GEMM into the part's columns for bf16.
    fn proj(
        &self,
        s: &CudaStream,
        x: u64,
        t: usize,
        kdim: usize,
        outs: &[ProjOut<'_>],
        f32_out: bool,
    ) -> Result<(), CudaError> {
        let bf16: Option<Vec<GemvOut>> = outs
            .iter()
            .map(|o| match o.parts {
                [Part::Bf16 { w, .. }] => Some(GemvOut { w: *w, y: o.y, m: o.m }),
                _ => None,
            })
            .collect();
        if let Some(outs) = bf16 {
            let aligned = x.is_multiple_of(16) && outs.iter().all(|o| o.w.is_multiple_of(16) && o.y.is_multiple_of(16));
            if t <= self.opts.gemv_max_tokens && gemv::supported(t, kdim) && aligned {
                return gemv::gemv(&self.k, s, x, t, kdim, &outs, f32_out);
            }
            for o in &outs {
                self.gemm.linear_out(s, x, o.w, o.y, t, o.m, kdim, f32_out)?;
            }
            return Ok(());
        }
        if !f32_out && t <= self.opts.gemv_max_tokens && outs.iter().map(|o| o.parts.len()).sum::<usize>() > 1 {
            // Several int4 linears sharing x (q/k/v, qkv/z/b/a, gate/up: outputs and the parts that
            // write consecutive columns of one): one launch of the int4 GEMV.
            if let Some(w4) = w4_outs(outs) {
                let cfg = w4_multi_config(&w4, kdim, self.k.w4_slots);
                return w4a16::w4_gemv_multi(&self.k, s, &w4, x, kdim, t, cfg, false);
            }
        }
        let eb = if f32_out { 4 } else { 2 };
        for o in outs {
            let mut col = 0usize;
            for p in o.parts {
                let y = o.y + (eb * col) as u64;
                match p {
                    Part::Bf16 { w, rows } => self.gemm.linear_ld(s, x, *w, y, t, *rows, kdim, o.m, f32_out)?,
                    Part::W4(w) => self.w4_linear(s, x, w, y, o.m, t, f32_out)?,
                }
                col += p.rows();
            }
            if col != o.m {
                return Err(CudaError::Plan(format!("projection parts cover {col} of {} output columns", o.m)));
            }
        }
        Ok(())
    }

    /// [`CudaBackend::proj`] (bf16 outputs) with the residual add + RMSNorm around it folded in (`fold`;
    /// [`Fold::None`]: `proj`). A folded projection is one int4 GEMV launch (`self.fold` checked that
    /// every layer's are).
    fn proj_fold(
        &self,
        s: &CudaStream,
        x: u64,
        t: usize,
        kdim: usize,
        outs: &[ProjOut<'_>],
        fold: Fold,
    ) -> Result<(), CudaError> {
        if fold == Fold::None {
            return self.proj(s, x, t, kdim, outs, false);
        }
        let w4 =
            w4_outs(outs).ok_or_else(|| CudaError::Plan("a folded projection is not one int4 GEMV launch".into()))?;
        let cfg = w4_multi_config(&w4, kdim, self.k.w4_slots);
        w4a16::w4_gemv_fold(&self.k, s, &w4, x, kdim, t, cfg, fold)
    }

    /// Whether decode steps fold their RMSNorms into the int4 projections ([`CudaOptions::fold_norms`]
    /// and every layer's projections allow it).
    pub fn norms_fold(&self) -> bool {
        self.fold && self.opts.fold_norms
    }

    /// Whether this step's norms fold into its projections ([`CudaOptions::fold_norms`]).
    fn folds(&self, t: usize) -> bool {
        self.norms_fold() && t <= w4a16::GEMV_MAX_M && t <= self.opts.gemv_max_tokens
    }

    /// `y[t, w.out]` (row stride `ldy`) = `x[t, w.inp]` · Wᵀ for an int4 linear: the int4 GEMV for
    /// steps of at most `gemv_max_tokens` tokens and for f32 outputs (lm_head logits; any `t`),
    /// else row slices dequantised to bf16 in the scratch and a cuBLASLt GEMM per slice writing
    /// its columns of `y`.
    #[allow(clippy::too_many_arguments)]
    fn w4_linear(
        &self,
        s: &CudaStream,
        x: u64,
        w: &W4Weights,
        y: u64,
        ldy: usize,
        t: usize,
        f32_out: bool,
    ) -> Result<(), CudaError> {
        let xs = (self.ws.w4_x.bytes >= 2 * 8 * w.inp).then_some(self.ws.w4_x.ptr);
        if f32_out || t <= self.opts.gemv_max_tokens {
            let cfg = w4a16::gemv_config(w.out, w.inp, self.k.w4_slots);
            return w4a16::w4_gemv_out(&self.k, s, w, x, w.inp, y, ldy, t, cfg, xs, f32_out);
        }
        let slice = self.ws.w4_slice;
        let rows = w4_slice_rows(w.out, w.inp, slice.bytes);
        if rows == 0 {
            return Err(CudaError::Plan(format!(
                "the int4 prefill slice ({} B) cannot hold 16 rows of a [{}, {}] linear",
                slice.bytes, w.out, w.inp
            )));
        }
        for r0 in (0..w.out).step_by(rows) {
            let r1 = (r0 + rows).min(w.out);
            w4a16::w4_dequant(&self.k, s, w, r0, r1, slice.ptr, w.inp)?;
            self.gemm.linear_ld(s, x, slice.ptr, y + 2 * r0 as u64, t, r1 - r0, w.inp, ldy, false)?;
        }
        Ok(())
    }

    /// Runs `work` (stream work only: its inputs are uploaded) from the graph of `key`: replays it, or
    /// runs `work` eagerly (which also warms every cuBLASLt plan) and captures it for the next time.
    /// Eagerly every time when graphs are off or profiling is on.
    fn run_graphed(&mut self, key: GraphKey, work: &dyn Fn(&Self) -> Result<(), CudaError>) -> Result<(), CudaError> {
        let graphed = self.opts.cuda_graphs && self.prof.borrow().is_none();
        if let (true, Some(g)) = (graphed, self.graphs.get(&key)) {
            g.launch().map_err(CudaError::driver("cuGraphLaunch"))?;
            self.graph_stats.replays += 1;
            return Ok(());
        }
        work(self)?;
        if matches!(key, GraphKey::Decode(_)) {
            self.graph_stats.eager_decode_steps += 1;
        }
        // Graphs live in driver memory outside the plan (the runtime reserve covers them): at most
        // MAX_GRAPHS shapes are captured, later new shapes run eagerly.
        if !graphed || self.graphs.len() >= MAX_GRAPHS {
            return Ok(());
        }
        let st = self.rt.stream().clone();
        st.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(CudaError::driver("cuStreamBeginCapture"))?;
        let recorded = work(self);
        // Always end the capture, also when recording failed, so the stream is usable again.
        let graph = st.end_capture(CUgraphInstantiate_flags(0)).map_err(CudaError::driver("cuStreamEndCapture"));
        recorded?;
        let graph = graph?.ok_or_else(|| CudaError::Plan("the graph capture recorded no work".into()))?;
        graph.upload().map_err(CudaError::driver("cuGraphUpload"))?;
        self.graphs.insert(key, graph);
        self.graph_stats.captures += 1;
        Ok(())
    }

    fn snapshot_check(&self, loc: SnapshotLoc) -> Result<(), BackendError> {
        let (i, n) = match loc {
            SnapshotLoc::Device(i) => (i, self.snapshot_slots),
            SnapshotLoc::Host(i) => (i, self.host_snapshot_slots),
        };
        if i as usize >= n {
            return Err(BackendError::InvalidStep(format!("snapshot {loc:?} out of range")));
        }
        Ok(())
    }

    /// Per DeltaNet layer: (slot address, snapshot address or host offset, bytes) of the two
    /// tensors, for state slot `slot` and snapshot `loc`; then, with speculative decoding, the slot's
    /// pending hidden row (part of its state).
    fn state_parts(&self, slot: Option<u32>, loc: SnapshotLoc) -> Vec<(u64, u64, usize)> {
        let mut parts = Vec::new();
        for c in &self.caches {
            if let LayerCache::Gdn { rec, conv, snap_rec, snap_conv } = *c {
                parts.extend([(rec, snap_rec, self.rec_bytes), (conv, snap_conv, self.conv_bytes)]);
            }
        }
        if let Some(sp) = &self.spec {
            parts.push((sp.pending, sp.snap_pending, 2 * self.d.hidden));
        }
        let mut host_at = 0usize;
        let mut out = Vec::with_capacity(parts.len());
        for (base, snap_base, len) in parts {
            let slot_addr = slot.map(|s| self.states.ptr + (base + s as usize * len) as u64).unwrap_or(0);
            let other = match loc {
                SnapshotLoc::Device(i) => self.snapshots.ptr + (snap_base + i as usize * len) as u64,
                SnapshotLoc::Host(i) => (i as usize * self.snapshot_len + host_at) as u64,
            };
            host_at += len;
            out.push((slot_addr, other, len));
        }
        out
    }

    fn copy(&self, dst: Place, src: Place, bytes: usize) -> Result<(), CudaError> {
        let s = self.rt.stream().cu_stream();
        let pool = self.host_pool.as_ref().map_or(std::ptr::null_mut(), |p| p.ptr());
        // SAFETY: every address comes from state_parts / the pinned pool bounds checked by the
        // callers (slot and snapshot indices are validated), and the pinned pool lives as long as
        // self; the step synchronises before returning.
        unsafe {
            match (dst, src) {
                (Place::Dev(d), Place::Dev(sr)) => {
                    result::memcpy_dtod_async(d, sr, bytes, s).map_err(CudaError::driver("cuMemcpyDtoDAsync"))
                }
                (Place::Host(o), Place::Dev(sr)) => {
                    let dst = std::slice::from_raw_parts_mut(pool.add(o), bytes);
                    result::memcpy_dtoh_async(dst, sr, s).map_err(CudaError::driver("cuMemcpyDtoHAsync"))
                }
                (Place::Dev(d), Place::Host(o)) => {
                    let src = std::slice::from_raw_parts(pool.add(o), bytes);
                    result::memcpy_htod_async(d, src, s).map_err(CudaError::driver("cuMemcpyHtoDAsync"))
                }
                (Place::Host(o), Place::Host(so)) => {
                    self.rt.synchronize()?;
                    std::ptr::copy(pool.add(so), pool.add(o), bytes);
                    Ok(())
                }
            }
        }
    }

    fn apply(&self, op: &CacheOp) -> Result<(), BackendError> {
        let place = |loc: SnapshotLoc, a: u64| match loc {
            SnapshotLoc::Device(_) => Place::Dev(a),
            SnapshotLoc::Host(_) => Place::Host(a as usize),
        };
        let dev = |e: CudaError| BackendError::Device(e.to_string());
        match *op {
            CacheOp::SaveState { slot, to } | CacheOp::RestoreState { from: to, slot } => {
                self.snapshot_check(to)?;
                if slot as usize >= self.num_slots {
                    return Err(BackendError::InvalidStep(format!("state slot {slot} out of range")));
                }
                let save = matches!(op, CacheOp::SaveState { .. });
                for (sa, oa, len) in self.state_parts(Some(slot), to) {
                    if save {
                        self.copy(place(to, oa), Place::Dev(sa), len).map_err(dev)?;
                    } else {
                        self.copy(Place::Dev(sa), place(to, oa), len).map_err(dev)?;
                    }
                }
            }
            CacheOp::MoveSnapshot { from, to } => {
                self.snapshot_check(from)?;
                self.snapshot_check(to)?;
                let src = self.state_parts(None, from);
                let dst = self.state_parts(None, to);
                for ((_, s, len), (_, d, _)) in src.into_iter().zip(dst) {
                    self.copy(place(to, d), place(from, s), len).map_err(dev)?;
                }
            }
            CacheOp::CopyPagePrefix { src, dst, tokens } => {
                let ps = self.page_size;
                if src as usize >= self.num_pages || dst as usize >= self.num_pages || tokens as usize > ps {
                    return Err(BackendError::InvalidStep(format!(
                        "page copy {src} → {dst} ({tokens} tokens) out of range"
                    )));
                }
                if tokens == 0 || src == dst {
                    return Ok(());
                }
                let mtp_kv = self.spec.as_ref().map(|sp| sp.kv);
                let attn = self.caches.iter().filter_map(|c| if let LayerCache::Attn(l) = *c { Some(l) } else { None });
                // The MTP head's KV is in the pages too (speculative decoding).
                for l in attn.chain(mtp_kv) {
                    // Data and (quantised formats) scales, each `bpt` bytes per token.
                    for (base, bpt) in l.token_tensors(self.d.kv_heads, self.d.head_dim) {
                        let s0 = base + (src as usize * ps * bpt) as u64;
                        let d0 = base + (dst as usize * ps * bpt) as u64;
                        self.copy(Place::Dev(d0), Place::Dev(s0), tokens as usize * bpt).map_err(dev)?;
                    }
                }
            }
        }
        Ok(())
    }

    /// Gathers the embedding rows of `ids` from the pinned host table into the pinned staging
    /// buffer and uploads them to `residual` (before the step's kernels or graph; the previous
    /// step synchronised, so the staging is free).
    fn upload_host_embedding(&self, he: &HostEmbed, ids: &[i32]) -> Result<(), CudaError> {
        let row = 2 * self.d.hidden;
        let n = ids.len() * row;
        if n > he.staging.bytes() {
            return Err(CudaError::Plan(format!("{} embedding rows exceed the host staging buffer", ids.len())));
        }
        for (r, &id) in ids.iter().enumerate() {
            // SAFETY: r < staging_bytes / row (checked above); id < vocab rows of `row` bytes in the table.
            unsafe {
                if id < 0 {
                    // Outside a tensor-parallel rank's vocabulary shard.
                    std::ptr::write_bytes(he.staging.ptr().add(r * row), 0, row);
                } else {
                    let id = (id as usize).min(self.d.vocab - 1);
                    std::ptr::copy_nonoverlapping(he.table.ptr().add(id * row), he.staging.ptr().add(r * row), row);
                }
            }
        }
        // SAFETY: residual holds [t_max, hidden] bf16 (checked at construction); the pinned staging
        // lives as long as self and is not written again before the step synchronises.
        let src = unsafe { std::slice::from_raw_parts(he.staging.ptr(), n) };
        unsafe { result::memcpy_htod_async(self.ws.residual, src, self.rt.stream().cu_stream()) }
            .map_err(CudaError::driver("cuMemcpyHtoDAsync"))
    }

    /// Makes block-table row `r` start with `pages` on the device, uploading only the span that differs from
    /// the mirror: usually nothing in a decode step, one entry when a sequence enters a new page, a prompt's
    /// pages once. Entries past `pages` keep what they held: kernels read a row's first ⌈len / page⌉
    /// entries only, and every entry ever written is a valid page id (the region starts zeroed), so a
    /// graph's padding row still reads a real page.
    fn put_table_row(&self, r: usize, pages: &[u32]) -> Result<(), CudaError> {
        let at = r * self.table_width;
        let mut mirror = self.table_mirror.borrow_mut();
        let row = &mut mirror[at..at + pages.len()];
        let differs = |(a, &b): (&i32, &u32)| *a != b as i32;
        let Some(lo) = row.iter().zip(pages).position(differs) else { return Ok(()) };
        let hi = pages.len() - row.iter().zip(pages).rev().position(differs).unwrap_or(0);
        for (a, &b) in row[lo..hi].iter_mut().zip(&pages[lo..hi]) {
            *a = b as i32;
        }
        let r = self.upload_i32(self.block_tables.ptr + 4 * (at + lo) as u64, &row[lo..hi]);
        if r.is_err() {
            // Unknown on the device now: −1 is never a page, so the next step uploads the span again.
            row[lo..hi].fill(-1);
        }
        r
    }

    /// Writes the step inputs (`STEP_INPUTS` order) into their pinned image and uploads the block up to the
    /// last value written, in one copy. An input the backend keeps elsewhere (with speculative decoding the
    /// gather indices of every verified row, in the speculation region) is uploaded on its own.
    fn upload_inputs(&self, parts: [&[i32]; 6]) -> Result<(), CudaError> {
        let (inp, ws) = (&self.inputs, &self.ws);
        let dsts = [ws.token_ids, ws.positions, ws.cu_seqlens, ws.seq_lens, ws.slots, ws.last_idx];
        let in_block = |i: usize| dsts[i] == ws.token_ids + inp.at[i].0 as u64;
        if let Some(i) = (0..6).find(|&i| in_block(i) && 4 * parts[i].len() > inp.at[i].1) {
            return Err(CudaError::Plan(format!("the step's `{}` exceeds its workspace buffer", STEP_INPUTS[i])));
        }
        inp.done.synchronize().map_err(CudaError::driver("cuEventSynchronize"))?;
        let mut end = 0;
        for (i, v) in parts.iter().enumerate() {
            if !in_block(i) {
                self.upload_i32(dsts[i], v)?;
                continue;
            }
            let off = inp.at[i].0;
            // SAFETY: off + 4·len <= off + capacity <= the image's bytes (checked above and at construction);
            // the last copy out of the image has completed (the event above).
            unsafe { std::ptr::copy_nonoverlapping(v.as_ptr() as *const u8, inp.image.ptr().add(off), 4 * v.len()) };
            end = end.max(off + 4 * v.len());
        }
        if end == 0 {
            return Ok(());
        }
        let s = self.rt.stream();
        // SAFETY: the block starts at token_ids and holds the image's bytes (construction); the image is not
        // written again before `done` fires.
        let src = unsafe { std::slice::from_raw_parts(inp.image.ptr() as *const u8, end) };
        unsafe { result::memcpy_htod_async(ws.token_ids, src, s.cu_stream()) }
            .map_err(CudaError::driver("cuMemcpyHtoDAsync"))?;
        inp.done.record(s).map_err(CudaError::driver("cuEventRecord"))
    }

    fn upload_i32(&self, dst: u64, v: &[i32]) -> Result<(), CudaError> {
        if v.is_empty() {
            return Ok(());
        }
        // SAFETY: dst is a workspace buffer checked at construction to hold the step's maximum;
        // pageable source memory is staged before the call returns.
        unsafe { result::memcpy_htod_async(dst, v, self.rt.stream().cu_stream()) }
            .map_err(CudaError::driver("cuMemcpyHtoDAsync"))
    }

    /// Runs the step's chunks (validated) and appends the wanted logits rows.
    /// A step: its `pre` ops, its chunks (their wanted rows into `out`), its `post` ops.
    fn step_to(&mut self, batch: &StepBatch, out: StepOut<'_>) -> Result<(), BackendError> {
        if batch.seqs.iter().any(|c| c.draft > 0) {
            return Err(BackendError::InvalidStep("speculative chunks need a draft picker".into()));
        }
        if self.launches.busy() {
            return Err(BackendError::InvalidStep("a launched step is not collected yet".into()));
        }
        // This step's picks (or its sampling) may overwrite the launched picks a feed would read.
        self.launches.last = None;
        let dev = |e: CudaError| BackendError::Device(e.to_string());
        self.rt.context().bind_to_thread().map_err(|e| BackendError::Device(e.to_string()))?;
        self.enqueue_step(batch, out)?;
        self.rt.synchronize().map_err(dev)
    }

    /// Enqueues a step of plain chunks: its `pre` ops, its chunks (their wanted rows into `out`), its
    /// `post` ops. Returns without waiting.
    fn enqueue_step(&mut self, batch: &StepBatch, out: StepOut<'_>) -> Result<(), BackendError> {
        for op in &batch.pre {
            self.apply(op)?;
        }
        if let Some(sp) = &mut self.spec {
            sp.verified.clear();
        }
        self.run_chunks(batch, &[], out)?;
        for op in &batch.post {
            self.apply(op)?;
        }
        Ok(())
    }

    /// `verify[i]`: chunk i is the verify pass of a speculative chunk (its token and drafts; missing
    /// entries: false). Its DeltaNet state is left as it was, every row's logits are returned, and it
    /// is recorded for [`Backend::commit_speculative`].
    fn run_chunks(&mut self, batch: &StepBatch, verify: &[bool], out: StepOut<'_>) -> Result<(), BackendError> {
        let dev = |e: CudaError| BackendError::Device(e.to_string());
        self.prof_begin().map_err(dev)?;
        let r = self.run_chunks_timed(batch, verify, out);
        let p = self.prof_end().map_err(dev);
        r.and(p)
    }

    /// [`CudaBackend::run_chunks`] between the profiler's step marks.
    fn run_chunks_timed(&mut self, batch: &StepBatch, verify: &[bool], out: StepOut<'_>) -> Result<(), BackendError> {
        let dev = |e: CudaError| BackendError::Device(e.to_string());
        self.phase(Mark::Entry).map_err(dev)?;
        let is_ver = |i: usize| verify.get(i).copied().unwrap_or(false);
        let inv = |m: String| Err(BackendError::InvalidStep(m));
        let chunks: Vec<usize> = (0..batch.seqs.len()).filter(|&i| !batch.seqs[i].tokens.is_empty()).collect();
        for c in &batch.seqs {
            if c.tokens.is_empty() && c.want_logits {
                return inv(format!("seq {}: logits wanted for an empty chunk", c.seq_id));
            }
        }
        if chunks.is_empty() {
            // A launched step of cache ops alone is collected too (no picks).
            if let StepOut::Launch(o) = out {
                self.launch_picks(0, o).map_err(dev)?;
            }
            return Ok(());
        }
        let t: usize = chunks.iter().map(|&i| batch.seqs[i].tokens.len()).sum();
        if t > self.max_tokens || chunks.len() > self.max_seqs {
            return inv(format!(
                "{t} tokens in {} chunks exceed the plan ({} tokens, {} sequences per step)",
                chunks.len(),
                self.max_tokens,
                self.max_seqs
            ));
        }
        let mut used_slots = std::collections::HashSet::new();
        for &i in &chunks {
            let c = &batch.seqs[i];
            if c.slot as usize >= self.num_slots || !used_slots.insert(c.slot) {
                return inv(format!("seq {}: slot {} out of range or used twice in the step", c.seq_id, c.slot));
            }
            let end = c.start + c.tokens.len();
            // Without attention layers pages are never read: a sequence needs none.
            let need = if self.d.num_attention_layers > 0 { end.div_ceil(self.page_size) } else { 0 };
            if c.pages.len() < need || need > self.table_width {
                return inv(format!(
                    "seq {}: {} pages do not cover {end} positions (table width {})",
                    c.seq_id,
                    c.pages.len(),
                    self.table_width
                ));
            }
            if c.pages[..need].iter().any(|&p| p as usize >= self.num_pages) {
                return inv(format!("seq {}: page id out of range ({} pages)", c.seq_id, self.num_pages));
            }
            if let Some(&id) = c.tokens.iter().find(|&&id| id as usize >= self.full_vocab()) {
                return inv(format!("seq {}: token id {id} outside the vocabulary", c.seq_id));
            }
        }
        // Prefill chunks (> 1 token) first, then verify chunks, then decode chunks, each group in batch
        // order.
        let multi = |i: &usize| batch.seqs[*i].tokens.len() > 1;
        let mut order: Vec<usize> = chunks.iter().copied().filter(|i| multi(i) && !is_ver(*i)).collect();
        let n_real = order.len();
        // Verify chunks: those over a short context attend with the prefill kernel, the others (last)
        // as decode queries, split-K over their long context.
        let from = self.opts.verify_decode_attention_from;
        let long_ctx = |i: &usize| batch.seqs[*i].start >= from;
        order.extend(chunks.iter().copied().filter(|i| is_ver(*i) && !long_ctx(i)));
        let n_ver_pf = order.len() - n_real;
        order.extend(chunks.iter().copied().filter(|i| is_ver(*i) && long_ctx(i)));
        let n_pre = order.len();
        let n_ver = n_pre - n_real;
        order.extend(chunks.iter().copied().filter(|i| !multi(i) && !is_ver(*i)));
        let n = order.len();
        // Decode steps replay the graph of their batch size. With graph_pad the
        // rows past n are padding: token 0 at position −1 (no KV write), state slot −1 (no state
        // update), one key of the page its table row starts with (put_table_row), logits computed and not returned.
        let graph = self.opts.cuda_graphs && n_pre == 0 && self.prof.borrow().is_none();
        let rows = if graph { self.graph_bucket(n) } else { n };
        let (mut ids, mut pos, mut cu, mut lens, mut slots) =
            (Vec::with_capacity(rows), Vec::with_capacity(rows), vec![0i32], Vec::new(), Vec::new());
        let mut table_rows: Vec<&[u32]> = Vec::with_capacity(n);
        let mut row_of = vec![0usize; batch.seqs.len()];
        for (r, &i) in order.iter().enumerate() {
            let c = &batch.seqs[i];
            ids.extend(c.tokens.iter().map(|&x| x as i32));
            pos.extend((c.start..c.start + c.tokens.len()).map(|p| p as i32));
            let end = c.start + c.tokens.len();
            cu.push(cu[r] + c.tokens.len() as i32);
            lens.push(end as i32);
            slots.push(c.slot as i32);
            let need = if self.d.num_attention_layers > 0 { end.div_ceil(self.page_size) } else { 0 };
            table_rows.push(&c.pages[..need]);
            row_of[i] = cu[r + 1] as usize - 1;
        }
        for _ in n..rows {
            ids.push(0);
            pos.push(-1);
            cu.push(cu[cu.len() - 1] + 1);
            lens.push(1);
            slots.push(-1);
        }
        // A tensor-parallel rank embeds the ids of its vocabulary shard (−1: a row of zeros, the
        // all-reduce after the embedding sums the ranks' rows).
        if let Some(r) = &self.tp {
            let v = &r.spec.vocab;
            for id in &mut ids {
                *id = if v.contains(&(*id as usize)) { *id - v.start as i32 } else { -1 };
            }
        }
        let tp = cu[n_pre] as usize;
        let tv = tp - cu[n_real] as usize;
        // Wanted rows in batch order: a verify chunk's every row, another chunk's last.
        let mut last: Vec<i32> = Vec::new();
        for (i, c) in batch.seqs.iter().enumerate() {
            if is_ver(i) {
                let n = c.tokens.len() as i32;
                last.extend(row_of[i] as i32 + 1 - n..=row_of[i] as i32);
            } else if c.want_logits {
                last.push(row_of[i] as i32);
            }
        }
        let n_want = last.len();
        if graph {
            last.resize(rows, 0);
        }
        // Speculative decoding: each plain chunk's last row becomes its slot's pending hidden (graph
        // padding rows: none).
        let mut pend: (Vec<i32>, Vec<i32>) = (Vec::new(), Vec::new());
        if self.spec.is_some() {
            for (r, &i) in order.iter().enumerate() {
                if !is_ver(i) {
                    pend.0.push(cu[r + 1] - 1);
                    pend.1.push(slots[r]);
                }
            }
            pend.0.resize(pend.0.len() + rows - n, -1);
            pend.1.resize(pend.1.len() + rows - n, -1);
        }
        let chunk_table = gdn_chunk::chunk_table(&cu[..=n_real]);
        // Prefill attention covers the prefill chunks and the short-context verify chunks; the other
        // verify rows run as decode queries.
        let tile_table = attention::tile_table(&self.k, &cu[..=n_real + n_ver_pf]);
        let tvd = tp - cu[n_real + n_ver_pf] as usize;
        let (mut ver_lens, mut ver_tables) = (Vec::new(), Vec::new());
        for (r, &i) in order.iter().enumerate().take(n_pre).skip(n_real + n_ver_pf) {
            let c = &batch.seqs[i];
            ver_lens.extend((1..=c.tokens.len()).map(|j| (c.start + j) as i32));
            ver_tables.extend(std::iter::repeat_n(r as i32, c.tokens.len()));
        }
        if chunk_table.len() * 4 > self.ws.chunk_table.bytes || tile_table.len() * 4 > self.ws.tile_table.bytes {
            return Err(BackendError::Device("varlen tables exceed the scratch region".into()));
        }
        self.phase(Mark::Uploads).map_err(dev)?;
        let ws = &self.ws;
        (|| -> Result<(), CudaError> {
            self.upload_inputs([&ids, &pos, &cu, &lens, &slots, &last])?;
            for (r, pages) in table_rows.iter().enumerate() {
                self.put_table_row(r, pages)?;
            }
            self.upload_i32(ws.chunk_table.ptr, &chunk_table)?;
            self.upload_i32(ws.tile_table.ptr, &tile_table)?;
            if let Some(sp) = &self.spec {
                self.upload_i32(sp.idx_at(0), &pend.0)?;
                self.upload_i32(sp.idx_at(1), &pend.1)?;
                self.upload_i32(sp.idx_at(7), &ver_lens)?;
                self.upload_i32(sp.idx_at(8), &ver_tables)?;
            }
            match (&out, &self.host_embed) {
                // A fed step's rows come from the device (feed_rows, below).
                (StepOut::Launch(LaunchOut { feed: Some(_), .. }), _) | (_, None) => {}
                (_, Some(he)) => self.upload_host_embedding(he, &ids)?,
            }
            if let StepOut::Launch(LaunchOut { feed: Some(f), valid, .. }) = &out {
                self.feed_inputs(f, *valid)?;
            }
            // A chunk starting at position 0 begins from a zeroed state.
            for &i in &order {
                let c = &batch.seqs[i];
                if c.start == 0 {
                    for (sa, _, len) in self.state_parts(Some(c.slot), SnapshotLoc::Device(0)) {
                        self.rt.memset(sa, 0, len)?;
                    }
                }
            }
            Ok(())
        })()
        .map_err(dev)?;
        let shape = StepShape {
            t: t + (rows - n),
            n: rows,
            n_pre,
            tp,
            n_ver,
            tv,
            tvd,
            n_chunks: chunk_table.len() / 2,
            n_tiles: tile_table.len() / 2,
            n_logits: last.len(),
            n_pend: pend.0.len(),
        };
        // Decode steps replay the graph of their bucket; steps of verify chunks (and decode rows) the
        // graph of their shape; steps with a prefill chunk run eagerly.
        let key = if n_pre == 0 {
            Some(GraphKey::Decode(rows))
        } else if n_real == 0 {
            let lens = order[..n_pre].iter().map(|&i| batch.seqs[i].tokens.len()).collect();
            Some(GraphKey::Verify(n - n_pre, tvd, lens))
        } else {
            None
        };
        self.phase(Mark::Forward).map_err(dev)?;
        match key {
            Some(key) => self.run_graphed(key, &|be: &Self| be.forward(&shape)).map_err(dev)?,
            None => self.forward(&shape).map_err(dev)?,
        }
        self.phase(Mark::Forwarded).map_err(dev)?;
        if let Some(sp) = &mut self.spec {
            let base = cu[n_real];
            sp.verify_cu = cu[n_real..=n_pre].iter().map(|&x| x - base).collect();
            sp.verify_slots = slots[n_real..n_pre].to_vec();
            sp.verified = order[n_real..n_pre]
                .iter()
                .enumerate()
                .map(|(j, &i)| {
                    let c = &batch.seqs[i];
                    let row0 = sp.verify_cu[j] as usize;
                    Verified { seq_id: c.seq_id, slot: c.slot, start: c.start, n: c.tokens.len(), row0 }
                })
                .collect();
        }
        if let StepOut::Launch(o) = out {
            self.launch_picks(n_want, o).map_err(dev)?;
        } else if n_want > 0 {
            let v = self.d.vocab;
            match out {
                StepOut::Logits(logits) => {
                    // Straight into the caller's (pageable) memory: the driver stages it. Through a pinned buffer
                    // and a host copy was no faster at batch 1 and up to 0.4 ms slower at batch 8 (session 26).
                    let at = logits.len();
                    logits.resize(at + n_want * v, 0.0);
                    self.rt.download(&mut logits[at..], self.logits.ptr).map_err(dev)?;
                }
                StepOut::Argmax { valid, tokens } => {
                    // The ids land in `last_idx` (the step's gather indices, read by the forward only).
                    tokens.extend(self.logits_argmax(n_want, valid, self.ws.last_idx).map_err(dev)?);
                }
                StepOut::Sample { valid, rows, tokens } => {
                    tokens.extend(self.logits_sample(valid, rows).map_err(dev)?);
                }
                StepOut::Launch(_) => {}
            }
        }
        self.phase(Mark::Outputs).map_err(dev)?;
        Ok(())
    }

    fn forward(&self, sh: &StepShape) -> Result<(), CudaError> {
        let (k, s, ws, d) = (&self.k, self.rt.stream().as_ref(), &self.ws, &self.d);
        let t = sh.t;
        let h = d.hidden;
        let eps = self.eps;
        self.tick("step inputs")?;
        if self.host_embed.is_none() {
            embed::embed_gather(k, s, self.w.embed, ws.token_ids, ws.residual, t, h)?;
        } // else: run_chunks uploaded the rows gathered on the host into `residual`.
        self.tick("embed")?;
        self.all_reduce(ws.residual, t * h)?;
        let mut gdn_index = 0;
        let fold = self.folds(t);
        for (li, layer) in self.w.layers.iter().enumerate() {
            let cache = self.caches[li];
            let gi = matches!(cache, LayerCache::Gdn { .. }).then_some(gdn_index);
            // The last layer's output stays in mlp_out: the final norm below adds it.
            let lf =
                fold.then(|| LayerFold { input: li > 0, next_norm: self.w.layers.get(li + 1).map(|l| l.input_norm) });
            self.layer(ws, layer, cache, li == 0, sh, gi, false, lf)?;
            gdn_index += usize::from(gi.is_some());
        }
        if sh.n_logits > 0 || self.spec.is_some() {
            // Last residual add + final norm over every row (cheap), then gather the wanted rows.
            norm::add_rms_norm_1p(
                k,
                s,
                ws.mlp_out,
                Some(ws.residual),
                self.w.final_norm,
                Some(ws.residual),
                ws.final_normed,
                t,
                h,
                eps,
            )?;
        }
        if sh.n_logits > 0 {
            embed::embed_gather(k, s, ws.final_normed, ws.last_idx, ws.final_hidden, sh.n_logits, h)?;
            self.proj(s, ws.final_hidden, sh.n_logits, h, &[po(&self.w.lm_head, self.logits.ptr, d.vocab)], true)?;
            self.tick("final norm + lm_head")?;
        }
        if let Some(sp) = &self.spec {
            // The MTP head's cache entries of every row (row r: the hidden of row r − 1, or the slot's
            // pending hidden for a chunk's first row), the verify rows' hidden for their commit, and
            // each plain chunk's last hidden as its slot's new pending hidden.
            let (pending, fin) = (self.states.ptr + sp.pending as u64, ws.final_normed);
            mtp::shift_rows(k, s, fin, pending, ws.cu_seqlens, ws.slots, sh.n, sp.rows_in, t, h)?;
            if sh.n_ver > 0 {
                let r0 = sh.tp - sh.tv;
                self.copy(Place::Dev(sp.verify_hidden), Place::Dev(fin + (2 * r0 * h) as u64), 2 * sh.tv * h)?;
            }
            mtp::scatter_rows(k, s, fin, sp.idx_at(0), pending, sp.idx_at(1), sh.n_pend, h)?;
            self.mtp_forward(sh, sp.rows_in, true)?;
            self.tick("MTP head cache")?;
        }
        Ok(())
    }

    /// One decoder layer over the step `sh`. Its input is `residual` (`first`), `mlp_out + residual`,
    /// or with `fold.input` the previous layer's folded norm (`fold_x`, `fold_sums`, residual updated);
    /// its output is left in `mlp_out` (residual updated), or with `fold.next_norm` folded into the next
    /// norm. `fold`: the step folds its norms into the int4 projections ([`w4a16::Fold`]).
    /// `gdn_index`: the layer's index among the DeltaNet layers (its verify trace). `kv_only`
    /// (attention layers): stop once the K/V of the step's rows are in the cache (the MTP head's cache
    /// entries).
    #[allow(clippy::too_many_arguments)]
    fn layer(
        &self,
        ws: &Ws,
        layer: &Layer,
        cache: LayerCache,
        first: bool,
        sh: &StepShape,
        gdn_index: Option<usize>,
        kv_only: bool,
        fold: Option<LayerFold>,
    ) -> Result<(), CudaError> {
        let (k, s, d) = (&self.k, self.rt.stream().as_ref(), &self.d);
        let StepShape { t, n, n_pre, tp, tv, .. } = *sh;
        let n_dec = n - n_pre;
        let n_real = n_pre - sh.n_ver;
        let h = d.hidden;
        let eps = self.eps;
        let b2 = |x: usize| (2 * x) as u64;
        // The input norm: its own kernel, or the previous layer's down projection and this layer's
        // in-projection (folded).
        let fold_in = fold.is_some_and(|f| f.input);
        let (x_in, in_fold) =
            if fold_in { (ws.fold_x, Fold::Norm { sums: ws.fold_sums, eps }) } else { (ws.x_norm, Fold::None) };
        // Folded: the projection that ends the mixer / the MLP writes the residual stream and the next
        // norm's input.
        let fold_out = |norm_w: u64| Fold::Residual { x_out: ws.fold_x, norm_w, sums: ws.fold_sums };
        if first {
            norm::add_rms_norm_1p(k, s, ws.residual, None, layer.input_norm, None, ws.x_norm, t, h, eps)?;
        } else if !fold_in {
            norm::add_rms_norm_1p(
                k,
                s,
                ws.mlp_out,
                Some(ws.residual),
                layer.input_norm,
                Some(ws.residual),
                ws.x_norm,
                t,
                h,
                eps,
            )?;
        }
        self.tick("norms")?;
        match (&layer.mixer, cache) {
            (Mixer::Gdn(gw), LayerCache::Gdn { rec, conv, .. }) => {
                let (cc, vw, kw, hv, hk, dv) =
                    (d.conv_channels, d.gdn_value_width, d.gdn_key_width, d.gdn_v_heads, d.gdn_k_heads, d.gdn_v_dim);
                let rec_state = self.states.ptr + rec as u64;
                let conv_state = self.states.ptr + conv as u64;
                let outs = [po(&gw.qkv, ws.gdn_qkv, cc), po(&gw.z, ws.gdn_z, vw), po(&gw.ba, ws.gdn_ba, 2 * hv)];
                self.proj_fold(s, x_in, t, h, &outs, in_fold)?;
                self.tick("gdn in-proj GEMMs")?;
                if n_pre > 0 {
                    // Verify rows (the last n_ver sequences of the group) read the state, never write it.
                    let cp = conv::ConvPrefill {
                        x: ws.gdn_qkv,
                        x_stride: cc,
                        w: gw.conv,
                        y: ws.gdn_conv_out,
                        state: conv_state,
                        cu_seqlens: ws.cu_seqlens,
                        slots: ws.slots,
                        n_seqs: n_pre,
                        t: tp,
                        channels: cc,
                    };
                    conv::conv_prefill_only(k, s, &cp)?;
                    conv::conv_state_update(k, s, &cp, n_real, 0)?;
                }
                // Decode rows: the conv and the gates in one launch (the gates of the other rows below).
                let fused_dec = n_dec > 0 && gdn_gate::conv_gate_decode_supported(&k.dims, cc, hk, hv);
                if fused_dec {
                    let (q0, k0) = (ws.gdn_qk, ws.gdn_qk + b2(t * kw));
                    let ba_dec = ws.gdn_ba + b2(tp * 2 * hv);
                    let f = gdn_gate::GdnConvGateDecode {
                        x: ws.gdn_qkv + b2(tp * cc),
                        x_stride: cc,
                        w: gw.conv,
                        state: conv_state,
                        slots: ws.slots + 4 * n_pre as u64,
                        gate: gdn_gate::GdnGate {
                            qk: ws.gdn_conv_out + b2(tp * cc),
                            qk_stride: cc,
                            b: ba_dec,
                            b_stride: 2 * hv,
                            a: ba_dec + b2(hv),
                            a_stride: 2 * hv,
                            a_log: gw.a_log,
                            dt_bias: gw.dt_bias,
                            q_out: q0 + b2(tp * kw),
                            k_out: k0 + b2(tp * kw),
                            g: ws.gdn_g + (4 * tp * hv) as u64,
                            beta: ws.gdn_beta + (4 * tp * hv) as u64,
                            t: n_dec,
                            hk,
                            hv,
                        },
                    };
                    gdn_gate::gdn_conv_gate_decode(k, s, &f)?;
                } else if n_dec > 0 {
                    conv::conv_decode(
                        k,
                        s,
                        ws.gdn_qkv + b2(tp * cc),
                        cc,
                        gw.conv,
                        ws.gdn_conv_out + b2(tp * cc),
                        conv_state,
                        ws.slots + 4 * n_pre as u64,
                        n_dec,
                        cc,
                    )?;
                }
                if let (true, Some(sp), Some(gi)) = (sh.n_ver > 0, &self.spec, gdn_index) {
                    // The verify trace: this layer's in-projection rows of the verify group (qkv is dead
                    // after the conv and ba after the gates: the plan lets later buffers reuse them).
                    let r0 = tp - tv;
                    let x_at = sp.trace_x + b2(gi * sp.rows * cc);
                    let ba_at = sp.trace_ba + b2(gi * sp.rows * 2 * hv);
                    self.copy(Place::Dev(x_at), Place::Dev(ws.gdn_qkv + b2(r0 * cc)), 2 * tv * cc)?;
                    self.copy(Place::Dev(ba_at), Place::Dev(ws.gdn_ba + b2(r0 * 2 * hv)), 2 * tv * 2 * hv)?;
                }
                self.tick("gdn conv")?;
                let (q, kk) = self.gdn_gates(gw, ws.gdn_ba, t, if fused_dec { tp } else { t })?;
                self.tick("gdn gates + l2norm")?;
                let v = ws.gdn_conv_out + b2(2 * kw);
                if n_real > 0 {
                    gdn_chunk::gdn_chunk(
                        k,
                        s,
                        &gdn_chunk::GdnChunk {
                            q,
                            k: kk,
                            v,
                            v_stride: cc,
                            g: ws.gdn_g,
                            beta: ws.gdn_beta,
                            state: rec_state,
                            cu_seqlens: ws.cu_seqlens,
                            slots: ws.slots,
                            chunk_table: ws.chunk_table.ptr,
                            n_chunks: sh.n_chunks,
                            o: ws.gdn_core_out,
                            workspace: ws.gdn_ws.ptr,
                            workspace_bytes: ws.gdn_ws.bytes,
                            n_seqs: n_real,
                            t: tp - tv,
                            hk,
                            hv,
                        },
                    )?;
                }
                if sh.n_ver > 0 {
                    // Verify rows: outputs from the committed state, which stays as it was.
                    let dec = gdn_decode::GdnDecode {
                        q,
                        k: kk,
                        v,
                        v_stride: cc,
                        g: ws.gdn_g,
                        beta: ws.gdn_beta,
                        state: rec_state,
                        slots: ws.slots + 4 * n_real as u64,
                        o: ws.gdn_core_out,
                        n_seqs: sh.n_ver,
                        hk,
                        hv,
                    };
                    let starts = ws.cu_seqlens + 4 * n_real as u64;
                    let r = gdn_decode::GdnRecurrent { d: dec, starts, lens: 0, write_state: false };
                    gdn_decode::gdn_recurrent(k, s, &r)?;
                }
                if n_dec > 0 {
                    let dec = gdn_decode::GdnDecode {
                        q: q + b2(tp * kw),
                        k: kk + b2(tp * kw),
                        v: v + b2(tp * cc),
                        v_stride: cc,
                        g: ws.gdn_g + (4 * tp * hv) as u64,
                        beta: ws.gdn_beta + (4 * tp * hv) as u64,
                        state: rec_state,
                        slots: ws.slots + 4 * n_pre as u64,
                        o: ws.gdn_core_out + b2(tp * vw),
                        n_seqs: n_dec,
                        hk,
                        hv,
                    };
                    // Decode rows: the recurrence and the gated norm in one launch.
                    let gated = gdn_decode::GdnDecodeGated {
                        d: dec,
                        z: ws.gdn_z + b2(tp * vw),
                        z_tok_stride: vw,
                        norm_w: gw.norm,
                        out: ws.gdn_normed + b2(tp * vw),
                        eps,
                    };
                    gdn_decode::gdn_decode_gated(k, s, &gated)?;
                }
                self.tick("gdn core (chunked / decode)")?;
                // The gated norm of the other rows (the chunked and verify rows).
                norm::gated_rms_norm(k, s, ws.gdn_core_out, ws.gdn_z, vw, hv, gw.norm, ws.gdn_normed, tp, dv, eps)?;
                self.mixer_out_proj(s, ws, ws.gdn_normed, t, vw, &gw.out, fold.map(|_| fold_out(layer.post_norm)))?;
                self.tick("gdn gated norm + out GEMM")?;
            }
            (Mixer::Attn(aw), LayerCache::Attn(l)) => {
                let (nh, nkv, hd, ad, kvd) = (d.q_heads, d.kv_heads, d.head_dim, d.attn_dim, d.kv_dim);
                let outs = [po(&aw.q, ws.attn_qg, 2 * ad), po(&aw.k, ws.attn_k, kvd), po(&aw.v, ws.attn_v, kvd)];
                self.proj_fold(s, x_in, t, h, &outs, in_fold)?;
                self.tick("attn q/k/v GEMMs")?;
                let qkr = ops::rope::QkNormRope {
                    q: ws.attn_qg,
                    q_tok: 2 * ad,
                    q_head: 2 * hd,
                    q_heads: nh,
                    q_norm: aw.q_norm,
                    k: ws.attn_k,
                    k_tok: kvd,
                    kv_heads: nkv,
                    k_norm: aw.k_norm,
                    positions: ws.positions,
                    t,
                    head_dim: hd,
                    rotary_dim: d.rotary_dim,
                    theta: self.rope_theta,
                    eps,
                };
                let w = self.table_width;
                let kvw = kv_cache::KvWrite {
                    k: ws.attn_k,
                    k_stride: kvd,
                    v: ws.attn_v,
                    v_stride: kvd,
                    k_cache: l.k.data,
                    v_cache: l.v.data,
                    block_tables: self.block_tables.ptr,
                    max_blocks: w,
                    cu_seqlens: ws.cu_seqlens,
                    positions: ws.positions,
                    n_seqs: n,
                    t,
                    page: self.page_size,
                    kv_heads: nkv,
                    head_dim: hd,
                };
                // The q/k norms, RoPE and the K/V rows into the cache, one launch.
                ops::rope::qk_norm_rope_kv(k, s, &qkr, &kvw, &l)?;
                self.tick("attn norms + rope + kv write")?;
                if kv_only {
                    return Ok(());
                }
                let sc = l.scales();
                let kv = attention::KvPages {
                    k_cache: l.k.data,
                    v_cache: l.v.data,
                    block_tables: self.block_tables.ptr,
                    max_blocks: w,
                    page: self.page_size,
                    kv_heads: nkv,
                };
                let scale = 1.0 / (hd as f32).sqrt();
                // The prefill kernel's tiles: the prefill chunks and the short-context verify chunks.
                if sh.n_tiles > 0 {
                    attention::attn_prefill_q(
                        k,
                        s,
                        &attention::AttnPrefill {
                            q: ws.attn_qg,
                            q_tok: 2 * ad,
                            q_head: 2 * hd,
                            o: ws.attn_out,
                            kv,
                            cu_seqlens: ws.cu_seqlens,
                            seq_lens: ws.seq_lens,
                            tile_table: ws.tile_table.ptr,
                            n_tiles: sh.n_tiles,
                            q_heads: nh,
                            scale,
                        },
                        &sc,
                    )?;
                }
                let dec = attention::AttnDecode {
                    q: ws.attn_qg + b2(tp * 2 * ad),
                    q_tok: 2 * ad,
                    q_head: 2 * hd,
                    o: ws.attn_out + b2(tp * ad),
                    kv: attention::KvPages { block_tables: self.block_tables.ptr + (4 * n_pre * w) as u64, ..kv },
                    seq_lens: ws.seq_lens + 4 * n_pre as u64,
                    table_rows: 0,
                    n_seqs: n_dec,
                    q_heads: nh,
                    n_split: self.decode_partitions,
                    scratch: ws.attn_partials.ptr,
                    scratch_bytes: ws.attn_partials.bytes,
                    scale,
                    // The output gate (the q|gate layout's second half) rides on the combine step.
                    gate: ws.attn_qg + b2(tp * 2 * ad) + b2(hd),
                };
                if let (true, Some(sp)) = (sh.tvd > 0, &self.spec) {
                    // Long-context verify rows as decode queries (split-K over the keys: a few queries
                    // over a long context), each with its causal length and its chunk's block-table row.
                    let r0 = tp - sh.tvd;
                    let a = attention::AttnDecode {
                        q: ws.attn_qg + b2(r0 * 2 * ad),
                        gate: ws.attn_qg + b2(r0 * 2 * ad) + b2(hd),
                        o: ws.attn_out + b2(r0 * ad),
                        kv,
                        seq_lens: sp.idx_at(7),
                        table_rows: sp.idx_at(8),
                        n_seqs: sh.tvd,
                        n_split: sp.partitions,
                        scratch: sp.partials.ptr,
                        scratch_bytes: sp.partials.bytes,
                        ..dec
                    };
                    attention::attn_decode_q(k, s, &a, &sc)?;
                }
                if n_dec > 0 {
                    attention::attn_decode_q(k, s, &dec, &sc)?;
                }
                self.tick("attn core (prefill / decode)")?;
                // The output gate of the rows the prefill kernel attended (decode-attended rows, the
                // last tvd verify rows and the decode rows, were gated in the combine step).
                let gated_rows = tp - sh.tvd;
                elementwise::sigmoid_gate_mul(
                    k,
                    s,
                    ws.attn_out,
                    ws.attn_qg + b2(hd),
                    gated_rows,
                    nh,
                    hd,
                    2 * ad,
                    2 * hd,
                )?;
                self.mixer_out_proj(s, ws, ws.attn_out, t, ad, &aw.o, fold.map(|_| fold_out(layer.post_norm)))?;
                self.tick("attn gate + o GEMM")?;
            }
            _ => return Err(CudaError::Plan("a layer's weights and cache kinds differ".into())),
        }
        let (mlp_x, mlp_fold) = if fold.is_some() {
            (ws.fold_x, Fold::Norm { sums: ws.fold_sums, eps })
        } else {
            self.all_reduce(ws.mixer_out, t * h)?;
            norm::add_rms_norm_1p(
                k,
                s,
                ws.mixer_out,
                Some(ws.residual),
                layer.post_norm,
                Some(ws.residual),
                ws.mlp_in,
                t,
                h,
                eps,
            )?;
            self.tick("norms")?;
            (ws.mlp_in, Fold::None)
        };
        let i = d.intermediate;
        self.proj_fold(s, mlp_x, t, h, &[po(&layer.gate_up, ws.mlp_gate_up, 2 * i)], mlp_fold)?;
        elementwise::swiglu(k, s, ws.mlp_gate_up, 2 * i, ws.mlp_gate_up + b2(i), 2 * i, ws.mlp_act, t, i)?;
        if let Some(next) = fold.and_then(|f| f.next_norm) {
            self.proj_fold(s, ws.mlp_act, t, i, &[po(&layer.down, ws.residual, h)], fold_out(next))?;
            self.tick("MLP (GEMMs + SwiGLU)")?;
            return Ok(());
        }
        self.proj(s, ws.mlp_act, t, i, &[po(&layer.down, ws.mlp_out, h)], false)?;
        self.tick("MLP (GEMMs + SwiGLU)")?;
        self.all_reduce(ws.mlp_out, t * h)?;
        Ok(())
    }

    /// A mixer's output projection: into `mixer_out`, or folded (`fold`) into the residual stream and
    /// the post-attention norm's input.
    #[allow(clippy::too_many_arguments)]
    fn mixer_out_proj(
        &self,
        s: &CudaStream,
        ws: &Ws,
        x: u64,
        t: usize,
        kdim: usize,
        w: &Proj,
        fold: Option<Fold>,
    ) -> Result<(), CudaError> {
        let h = self.d.hidden;
        match fold {
            Some(f) => self.proj_fold(s, x, t, kdim, &[po(w, ws.residual, h)], f),
            None => self.proj(s, x, t, kdim, &[po(w, ws.mixer_out, h)], false),
        }
    }

    /// A DeltaNet layer's gates and normalised q, k of the first `rows` of the step's `t` rows: from the
    /// conv output (`gdn_conv_out`) and the in-projection rows `ba` (`[t, 2·Hv]`: b then a); returns the
    /// (q, k) buffers (`[t, Hk, Dk]` each). g and beta land in `gdn_g` / `gdn_beta`.
    fn gdn_gates(&self, gw: &GdnLayer, ba: u64, t: usize, rows: usize) -> Result<(u64, u64), CudaError> {
        let (ws, d) = (&self.ws, &self.d);
        let (hv, kw) = (d.gdn_v_heads, d.gdn_key_width);
        let (q, kk) = (ws.gdn_qk, ws.gdn_qk + (2 * t * kw) as u64);
        let gate = gdn_gate::GdnGate {
            qk: ws.gdn_conv_out,
            qk_stride: d.conv_channels,
            b: ba,
            b_stride: 2 * hv,
            a: ba + (2 * hv) as u64,
            a_stride: 2 * hv,
            a_log: gw.a_log,
            dt_bias: gw.dt_bias,
            q_out: q,
            k_out: kk,
            g: ws.gdn_g,
            beta: ws.gdn_beta,
            t: rows,
            hk: d.gdn_k_heads,
            hv,
        };
        gdn_gate::gdn_gate(&self.k, self.rt.stream().as_ref(), &gate)?;
        Ok((q, kk))
    }
}

/// How a layer's RMSNorms fold into its int4 projections ([`CudaBackend::layer`]; the post-attention
/// norm always does when this is given).
#[derive(Clone, Copy)]
struct LayerFold {
    /// The input norm was folded into the previous layer's down projection.
    input: bool,
    /// The weight of the norm after this layer (the next layer's input norm), which the down projection
    /// folds into; None: the output goes to `mlp_out`.
    next_norm: Option<u64>,
}

/// One output of [`CudaBackend::proj`]: `y [t, m]`, its parts writing consecutive columns.
struct ProjOut<'a> {
    parts: &'a [Part],
    y: u64,
    m: usize,
}

/// The int4 GEMV outputs of `outs` when every part is int4 and one launch takes them all
/// ([`w4a16::multi_supported`]).
fn w4_outs<'a>(outs: &[ProjOut<'a>]) -> Option<Vec<w4a16::W4Out<'a>>> {
    let mut w4 = Vec::new();
    for o in outs {
        let mut col = 0usize;
        for p in o.parts {
            let Part::W4(w) = p else { return None };
            w4.push(w4a16::W4Out { w, y: o.y + (2 * col) as u64, ldy: o.m });
            col += w.out;
        }
        if col != o.m {
            return None;
        }
    }
    w4a16::multi_supported(&w4).then_some(w4)
}

/// The GEMV configuration of one launch over `w4` (their rows summed).
fn w4_multi_config(w4: &[w4a16::W4Out<'_>], kdim: usize, slots: usize) -> w4a16::GemvConfig {
    w4a16::gemv_config(w4.iter().map(|o| o.w.out).sum(), kdim, slots)
}

/// Whether every layer's residual add + RMSNorm can fold into its projections: rows of `hidden` fold
/// ([`w4a16::fold_supported`]), each projection that follows a norm is one int4 GEMV launch, and each
/// that feeds the residual stream one int4 linear.
fn layers_fold(layers: &[Layer], hidden: usize) -> bool {
    fn whole(p: &Proj) -> ProjOut<'_> {
        po(p, 0, p.iter().map(Part::rows).sum())
    }
    let launch = |ps: &[&Proj]| w4_outs(&ps.iter().map(|p| whole(p)).collect::<Vec<_>>()).is_some();
    let linear = |p: &Proj| w4_outs(&[whole(p)]).is_some_and(|w| w.len() == 1);
    w4a16::fold_supported(hidden)
        && layers.iter().all(|l| {
            let (inp, out) = match &l.mixer {
                Mixer::Gdn(g) => (launch(&[&g.qkv, &g.z, &g.ba]), &g.out),
                Mixer::Attn(a) => (launch(&[&a.q, &a.k, &a.v]), &a.o),
            };
            inp && linear(out) && launch(&[&l.gate_up]) && linear(&l.down)
        })
}

fn po(parts: &[Part], y: u64, m: usize) -> ProjOut<'_> {
    ProjOut { parts, y, m }
}

/// What a step hands back: every wanted row's logits, its argmax over ids `< valid`, or its token
/// picked by its [`RowSampling`].
enum StepOut<'a> {
    Logits(&'a mut Vec<f32>),
    /// A launched step: picked on the device, collected later.
    Launch(LaunchOut<'a>),
    Argmax {
        valid: usize,
        tokens: &'a mut Vec<u32>,
    },
    Sample {
        valid: usize,
        rows: &'a [RowSampling],
        tokens: &'a mut Vec<u32>,
    },
}

#[derive(Clone, Copy, Debug)]
struct StepShape {
    /// Rows (tokens) and sequences of the step.
    t: usize,
    n: usize,
    /// The multi-token group (first): its sequences and rows; the verify chunks of speculative
    /// decoding are its last `n_ver` sequences (`tv` rows).
    n_pre: usize,
    tp: usize,
    n_ver: usize,
    tv: usize,
    /// The last `tvd` verify rows attend as decode queries (long contexts).
    tvd: usize,
    n_chunks: usize,
    n_tiles: usize,
    n_logits: usize,
    /// Pending-hidden stores (speculative decoding): entries of the index arrays.
    n_pend: usize,
}

#[derive(Clone, Copy, Debug)]
enum Place {
    Dev(u64),
    /// Byte offset in the pinned host pool.
    Host(usize),
}

impl Backend for CudaBackend {
    /// Steps launch ahead except under tensor parallelism (rows are picked on the host) or with
    /// speculative decoding.
    fn capabilities(&self) -> deltaserve_backend::Capabilities {
        deltaserve_backend::Capabilities {
            name: format!("cuda:{}", self.rt.context().ordinal()),
            vocab_size: self.d.vocab,
            launches_ahead: self.launches_ahead(),
            max_draft_tokens: self.spec.as_ref().map_or(0, |sp| sp.max_draft),
        }
    }

    /// Logits are downloaded whole. Tokens are picked on the GPU: the argmax of each row, or its token
    /// drawn by [`ops::sample`] (rows the device cannot cut come back whole); 4 bytes a row come back
    /// instead of the row. (A tensor-parallel rank holds a vocabulary shard: its group picks on the
    /// host.) Drafts: see `step_speculative` (speculative decoding).
    fn step(
        &mut self,
        batch: &StepBatch,
        want: deltaserve_backend::Want<'_>,
        out: &mut deltaserve_backend::StepOut,
    ) -> Result<(), BackendError> {
        use deltaserve_backend::Want;
        let tokens = &mut out.tokens;
        match want {
            Want::Logits => self.step_to(batch, StepOut::Logits(&mut out.logits)),
            Want::Tokens { .. } if self.tp.is_some() => {
                Err(BackendError::Unsupported("picking tokens on one tensor-parallel rank's vocabulary shard".into()))
            }
            Want::Tokens { valid, pick: Pick::Argmax } => self.step_to(batch, StepOut::Argmax { valid, tokens }),
            Want::Tokens { valid, pick: Pick::Sample(rows) } => {
                deltaserve_backend::check_sample_rows(batch, rows)?;
                self.step_to(batch, StepOut::Sample { valid, rows, tokens })
            }
            Want::Drafts(pick) => self.step_speculative(batch, pick, &mut out.logits, &mut out.drafts),
        }
    }

    /// Uploads the step's inputs, replays its graph (fed rows first take their tokens with `feed_rows`),
    /// picks on the device and starts the copy of the picks; returns without waiting.
    fn launch(
        &mut self,
        batch: &StepBatch,
        valid: usize,
        pick: Pick<'_>,
        feed: Option<&Feed>,
    ) -> Result<(), BackendError> {
        if !self.launches_ahead() {
            return Err(BackendError::Unsupported(
                "launching steps ahead with tensor parallelism or speculation".into(),
            ));
        }
        if batch.seqs.iter().any(|c| c.draft > 0) {
            return Err(BackendError::InvalidStep("speculative chunks need a draft picker".into()));
        }
        if self.launches.queue_len() >= 2 {
            return Err(BackendError::InvalidStep("two launched steps are not collected yet".into()));
        }
        if let Pick::Sample(rows) = pick {
            deltaserve_backend::check_sample_rows(batch, rows)?;
        }
        if let Some(f) = feed {
            let prev = self
                .launches
                .last
                .map(|(_, rows)| rows)
                .ok_or_else(|| BackendError::InvalidStep("a fed step needs the step launched before it".into()))?;
            f.check(batch, prev)?;
        }
        self.rt.context().bind_to_thread().map_err(|e| BackendError::Device(e.to_string()))?;
        if feed.is_none() && self.host_embed.is_some() && self.launches.busy() {
            // The host embedding's staging buffer may still be read by a pending launch's copy.
            self.rt.synchronize().map_err(|e| BackendError::Device(e.to_string()))?;
        }
        let r = self.enqueue_step(batch, StepOut::Launch(LaunchOut { valid, pick, feed }));
        if r.is_err() {
            self.abandon_launches();
        }
        r
    }

    fn collect(&mut self, out: &mut Picked) -> Result<(), BackendError> {
        self.rt.context().bind_to_thread().map_err(|e| BackendError::Device(e.to_string()))?;
        let r = self.collect_picks(out);
        if r.is_err() {
            self.abandon_launches();
        }
        r
    }

    fn commit_speculative(&mut self, commits: &[SpecCommit]) -> Result<(), BackendError> {
        if commits.is_empty() {
            return Ok(());
        }
        self.commit(commits)
    }

    fn arena_stats(&self) -> ArenaStats {
        let capacity: usize = self.arena.regions().iter().map(|(_, s, _)| s).sum();
        let embed = self.host_embed.as_ref().map(|e| [&e.table, &e.staging]);
        let pinned: Vec<&PinnedHost> = self
            .host_pool
            .iter()
            .chain(embed.into_iter().flatten())
            .chain([&self.inputs.image])
            .chain(self.launches.pinned())
            .collect();
        let host_b: usize = pinned.iter().map(|p| p.bytes()).sum();
        ArenaStats {
            allocations: (self.arena.driver_allocs() + pinned.len()) as u64,
            high_water_bytes: (self.arena.high_water() + host_b) as u64,
            capacity_bytes: (capacity + host_b) as u64,
        }
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

#[cfg(test)]
mod tests {
    use super::*;
    use deltaserve_model::synth::Preset;
    use deltaserve_plan::WeightBytes;

    fn preset(p: Preset, layers: Option<usize>) -> ModelConfig {
        ModelConfig::from_json_str(&p.config_json(layers).to_string()).unwrap()
    }

    /// What the backend keeps in f32 beyond the plan's 16-bit pricing (A_log, dt_bias, gated norm).
    fn f32_extra(cfg: &ModelConfig) -> usize {
        let d = cfg.dims();
        d.num_deltanet_layers
            * (2 * (al(4 * d.gdn_v_heads) - al(2 * d.gdn_v_heads)) + al(4 * d.gdn_v_dim) - al(2 * d.gdn_v_dim))
    }

    #[test]
    fn int4_weights_place_exactly_what_the_plan_charges() {
        for cfg in [preset(Preset::Qwen36_27b, None), preset(Preset::Tiny, None)] {
            for asym in [false, true] {
                for (lm_head_int4, spec) in [(false, 0), (true, 0), (false, 2), (true, 3)] {
                    for embed_on_host in [false, true] {
                        let mut o = PlanOptions::gpu_defaults(24 << 30);
                        o.weights_dtype = WeightsDtype::Int4;
                        o.int4_asym = asym;
                        o.lm_head_int4 = lm_head_int4;
                        o.embed_on_host = embed_on_host;
                        // With speculative decoding the MTP head's linears are int4 too.
                        o.speculative_tokens = spec;
                        let plan = WeightBytes::new(&cfg, &o).unwrap();
                        assert_eq!(plan.mtp > 0, spec > 0 && cfg.mtp_num_hidden_layers > 0);
                        let ours = weights_device_bytes(&cfg, WeightFormat::of(&o));
                        assert_eq!(
                            ours,
                            plan.device() as usize + f32_extra(&cfg),
                            "hidden {} asym {asym} lm_head_int4 {lm_head_int4} embed_on_host {embed_on_host} \
                             spec {spec}",
                            cfg.dims().hidden
                        );
                        // The host table is the plan's host weights.
                        let host: usize = weight_specs(&cfg, WeightFormat::of(&o))
                            .iter()
                            .map(|s| if let WSpec::Host { n } = s { 2 * n } else { 0 })
                            .sum();
                        assert_eq!(host as u64, plan.host());
                    }
                }
            }
            // bf16: fused pairs only save alignment padding.
            let o = PlanOptions::gpu_defaults(24 << 30);
            let plan = WeightBytes::new(&cfg, &o).unwrap().device() as usize;
            let ours = weights_device_bytes(&cfg, WeightFormat::of(&o));
            assert!(ours <= plan + f32_extra(&cfg) && ours + 4096 * cfg.dims().num_layers >= plan);
        }
    }

    /// Every plan's step inputs form the block one upload writes: token_ids first, the others after it in
    /// order within their capacities, nothing live beside them inside it.
    #[test]
    fn step_inputs_are_one_block() {
        for (p, layers) in [(Preset::Qwen36_27b, None), (Preset::Tiny, Some(4))] {
            let cfg = preset(p, layers);
            for (spec, embed_on_host, memory) in [(0, false, 24u64 << 30), (2, true, 24 << 30), (0, true, 80 << 30)] {
                let mut o = PlanOptions::gpu_defaults(memory);
                o.weights_dtype = WeightsDtype::Int4;
                o.speculative_tokens = spec;
                o.embed_on_host = embed_on_host;
                let plan = Plan::new(&cfg, &o).unwrap();
                let (at, bytes) = StepInputs::block(&plan.workspace).unwrap();
                assert_eq!(at[0].0, 0);
                for (w, name) in at.windows(2).zip(&STEP_INPUTS[1..]) {
                    assert!(w[0].0 + w[0].1 <= w[1].0, "{name}");
                }
                assert_eq!(bytes, at[5].0 + at[5].1);
                let s = plan.max_seqs;
                assert!(at[0].1 >= 4 * plan.max_batch_tokens && at[2].1 >= 4 * (s + 1) && at[5].1 >= 4 * s);
            }
        }
        // A buffer live beside the inputs inside their block is refused.
        let plan = Plan::new(&preset(Preset::Tiny, Some(4)), &PlanOptions::gpu_defaults(1 << 30)).unwrap();
        let mut ws = plan.workspace.clone();
        let pos = ws.get("positions").unwrap().clone();
        let other = ws.buffers.iter_mut().find(|b| b.name == "residual").unwrap();
        other.offset = pos.offset;
        assert!(StepInputs::block(&ws).unwrap_err().to_string().contains("residual"));
    }

    /// The per-rank sizing of a checkpoint's weights (what a tensor-parallel rank places: every tensor
    /// cut to its shard) equals the layout of the rank's model shape, for each rank; unsharded, the
    /// whole model's.
    #[test]
    fn checkpoint_bytes_per_rank_are_the_rank_shapes() {
        let dir = std::env::temp_dir().join(format!("ds-cuda-ckpt-bytes-{}", std::process::id()));
        let cfg = deltaserve_model::synth::write_model(&dir, Preset::Tiny, Some(4), 3, |_, _| {}).unwrap();
        for int4 in [true, false] {
            let mut o = PlanOptions::gpu_defaults(1 << 30);
            if int4 {
                o.weights_dtype = WeightsDtype::Int4;
            }
            let fmt = WeightFormat::of(&o);
            if int4 {
                // int4: one entry per linear, as the checkpoint walk counts them.
                assert_eq!(checkpoint_weights_bytes(&cfg, &dir, fmt, None).unwrap(), weights_device_bytes(&cfg, fmt));
            }
            for spec in ShardSpec::all(&cfg, 2).unwrap() {
                let got = checkpoint_weights_bytes(&cfg, &dir, fmt, Some(&spec)).unwrap();
                let rank = spec.rank_config(&cfg);
                if int4 {
                    assert_eq!(got, weights_device_bytes(&rank, fmt), "rank {}", spec.rank);
                } else {
                    // bf16 pairs are fused in the layout (one alignment instead of two).
                    let layout = weights_device_bytes(&rank, fmt);
                    assert!(got >= layout && got <= layout + 2 * 256 * rank.layer_types.len(), "rank {}", spec.rank);
                }
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn shard_bytes_cut_whole_elements() {
        // A [4, 3] tensor of 2-byte elements 0..12.
        let vals: Vec<u16> = (0..12).collect();
        let bytes: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
        let back = |b: Vec<u8>| -> Vec<u16> { b.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect() };
        let rows = Split::Rows(vec![1..2, 3..4]);
        assert_eq!(back(shard_bytes::<2>(&rows, "t", &[4, 3], &bytes).unwrap()), vec![3, 4, 5, 9, 10, 11]);
        let cols = Split::Cols(std::iter::once(1..3).collect());
        assert_eq!(back(shard_bytes::<2>(&cols, "t", &[4, 3], &bytes).unwrap()), vec![1, 2, 4, 5, 7, 8, 10, 11]);
        assert!(shard_bytes::<2>(&rows, "t", &[4, 3], &bytes[..23]).is_err());
    }

    #[test]
    fn int4_scratch_adds_the_slice_and_x_scratch() {
        let cfg = preset(Preset::Qwen36_27b, None);
        let mut o = PlanOptions::gpu_defaults(24 << 30);
        let base = scratch_bytes(&cfg, o.max_batch_tokens, o.max_seqs);
        assert_eq!(scratch_bytes_for(&cfg, &o), base);
        o.weights_dtype = WeightsDtype::Int4;
        assert_eq!(scratch_bytes_for(&cfg, &o), base + al(2 * 8 * 17408) + W4_SLICE_BYTES);
        o.weights_dtype = WeightsDtype::Bf16;
        o.lm_head_int4 = true;
        assert_eq!(scratch_bytes_for(&cfg, &o), base + al(2 * 8 * 5120));
        // The tiny model's largest linear fits whole.
        let tiny = preset(Preset::Tiny, None);
        let p = ScratchParts::new(&tiny, 512, 4, true, false);
        let d = tiny.dims();
        assert_eq!(p.w4_slice, 2 * d.hidden * d.intermediate.max(d.conv_channels));
    }

    #[test]
    fn slice_rows_at_the_27b_shapes() {
        for (out, inp, rows) in [(17408, 5120, 6528), (5120, 17408, 1920), (10240, 5120, 6528), (1024, 5120, 1024)] {
            let r = w4_slice_rows(out, inp, W4_SLICE_BYTES);
            assert_eq!(r, rows, "[{out}, {inp}]");
            assert!(2 * r * inp <= W4_SLICE_BYTES);
        }
        assert_eq!(w4_slice_rows(100, 1 << 30, W4_SLICE_BYTES), 0);
        assert_eq!(w4_slice_rows(48, 128, 1 << 20), 48);
    }

    #[test]
    fn linear_names() {
        assert!(is_linear("model.language_model.layers.3.linear_attn.in_proj_qkv.weight"));
        assert!(is_linear("model.layers.0.mlp.down_proj.weight"));
        assert!(!is_linear("model.layers.0.linear_attn.conv1d.weight"));
        assert!(!is_linear("model.layers.0.self_attn.q_norm.weight"));
        assert!(!is_linear("lm_head.weight"));
    }
}
