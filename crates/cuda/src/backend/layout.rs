//! The arena carve at construction: the plan's regions, the scratch parts, the activation buffers of the
//! workspace, the cache layouts and the speculation region; then the weights, and the seal.

use std::collections::HashMap;

use deltaserve_model::shard::ShardSpec;
use deltaserve_model::{Checkpoint, Dims, LayerKind, ModelConfig, MoeConfig, VisionConfig};
use deltaserve_plan::cuda::{ScratchParts, WeightFormat, host_experts_bytes, weights_device_bytes};
use deltaserve_plan::{CheckpointTensors, CudaTowerLayout, Plan, PlanBackend, SamplingScratch, WeightsDtype};

use crate::arena::{Arena, DevSpan, RegionId, aligned as al};
use crate::error::CudaError;
use crate::gemm::Gemm;
use crate::nvrtc::KvFormats;
use crate::ops::kv_quant::LayerKv;
use crate::ops::{Kernels, attention, w4a16};
use crate::runtime::{PinnedHost, Runtime};

use super::ahead::Launches;
use super::graphs::GraphStats;
use super::host_experts::HostExperts;
use super::inputs::StepInputs;
use super::linear::layers_fold;
use super::moe::{MoeWs, moe_views};
use super::rank::RankComm;
use super::spec::Spec;
use super::vision;
use super::weights::{HostEmbed, Weights};
use super::{CudaBackend, CudaOptions, WeightSource, kernel_dims};

/// Device addresses of the activation buffers (plan workspace offsets) and scratch.
#[derive(Clone, Copy)]
pub(super) struct Ws {
    pub(super) token_ids: u64,
    pub(super) positions: u64,
    /// `[t, 3]` i32 M-RoPE positions (the vision region's; 0 without the tower: rows rotate at `positions`).
    pub(super) rope_pos: u64,
    pub(super) cu_seqlens: u64,
    pub(super) seq_lens: u64,
    pub(super) slots: u64,
    pub(super) last_idx: u64,
    pub(super) residual: u64,
    pub(super) x_norm: u64,
    pub(super) mixer_out: u64,
    pub(super) gdn_qkv: u64,
    pub(super) gdn_z: u64,
    pub(super) gdn_ba: u64,
    pub(super) gdn_g: u64,
    pub(super) gdn_beta: u64,
    pub(super) gdn_conv_out: u64,
    pub(super) gdn_qk: u64,
    pub(super) gdn_core_out: u64,
    pub(super) gdn_normed: u64,
    pub(super) attn_qg: u64,
    pub(super) attn_k: u64,
    pub(super) attn_v: u64,
    pub(super) attn_partials: DevSpan,
    pub(super) attn_out: u64,
    pub(super) mlp_in: u64,
    pub(super) mlp_gate_up: u64,
    pub(super) mlp_act: u64,
    pub(super) mlp_out: u64,
    /// Every row after the final norm.
    pub(super) final_normed: u64,
    pub(super) final_hidden: u64,
    /// scratch region: chunked DeltaNet workspace, chunk table, tile table.
    pub(super) gdn_ws: DevSpan,
    pub(super) chunk_table: DevSpan,
    pub(super) tile_table: DevSpan,
    /// A step with snapshots inside its chunks: its segments' boundaries, their walk rounds' slots,
    /// and the conv state's saves (i32; `plan::cuda::segment_table_bytes`).
    pub(super) segments: DevSpan,
    /// Short prefill chunks attending as decode queries: their rows' attention lengths, then their
    /// block-table rows (i32).
    pub(super) decode_rows: DevSpan,
    /// int4: act-order x scratch; int4 or fp8: the dequantised slice (0 bytes when unused).
    pub(super) w4_x: DevSpan,
    pub(super) w4_slice: DevSpan,
    pub(super) w4_gemm: DevSpan,
    /// fp8: the step's activations as e4m3 codes and their scales (0 bytes when unused).
    pub(super) fp8_x: DevSpan,
    /// The folded norms' input `[min(t, 8), hidden]` and sums of squares ([`w4a16::Fold`]).
    pub(super) fold_x: u64,
    pub(super) fold_sums: u64,
    /// Device sampling's scratch ([`ops::sample`]) and its layout.
    pub(super) sampling: u64,
    pub(super) sampling_layout: SamplingScratch,
    /// The routed experts' buffers (a mixture-of-experts model).
    pub(super) moe: Option<MoeWs>,
}

/// Where layer `i`'s cache lives.
#[derive(Clone, Copy, Debug)]
pub(super) enum LayerCache {
    /// K and V data (and scales of a quantised format) in kv_pages.
    Attn(LayerKv),
    /// Byte offsets of the recurrent and conv tensors inside state_slots / snapshots.
    Gdn { rec: usize, conv: usize, snap_rec: usize, snap_conv: usize },
}

/// The plan's regions as the backend allocates them (one allocation each) and the parts of its scratch.
struct Regions {
    wreg: RegionId,
    weights_bytes: usize,
    kv: DevSpan,
    states: DevSpan,
    snapshots: DevSpan,
    acts: DevSpan,
    logits: DevSpan,
    block_tables: DevSpan,
    gemm_ws: DevSpan,
    scratch_bytes: usize,
    gdn_ws: DevSpan,
    chunk_table: DevSpan,
    tile_table: DevSpan,
    segments: DevSpan,
    decode_rows: DevSpan,
    w4_x: DevSpan,
    w4_slice: DevSpan,
    w4_gemm: DevSpan,
    fp8_x: DevSpan,
}

/// Where the layers' caches and the pending hidden rows lie in the cache regions.
struct CacheLayout {
    caches: Vec<LayerCache>,
    /// The MTP head's KV layer (speculative decoding).
    spec_kv: Option<LayerKv>,
    pending: usize,
    snap_pending: usize,
    rec_bytes: usize,
    conv_bytes: usize,
}

/// The plan's workspace buffers in the activations region, each checked against what the backend puts
/// there.
pub(super) struct Workspace<'a> {
    plan: &'a Plan,
    acts: DevSpan,
}

impl Workspace<'_> {
    pub(super) fn get(&self, name: &str, need: usize) -> Result<u64, CudaError> {
        let b = self
            .plan
            .workspace
            .get(name)
            .ok_or_else(|| CudaError::Plan(format!("the workspace has no buffer `{name}`")))?;
        if (b.bytes as usize) < need || b.offset as usize + b.bytes as usize > self.acts.bytes {
            return Err(CudaError::Plan(format!(
                "workspace buffer `{name}` holds {} B at offset {}; the backend needs {need} B",
                b.bytes, b.offset
            )));
        }
        Ok(self.acts.ptr + b.offset)
    }

    /// The buffer `name` when the model has what uses it (`present`), else 0.
    fn opt(&self, present: bool, name: &str, need: usize) -> Result<u64, CudaError> {
        if present { self.get(name, need) } else { Ok(0) }
    }
}

/// The bytes of the plan's region `name`.
fn plan_region(plan: &Plan, name: &str) -> Result<usize, CudaError> {
    plan.region(name)
        .map(|r| r.bytes as usize)
        .ok_or_else(|| CudaError::Plan(format!("the plan has no `{name}` region")))
}

/// A fixed plan region: one allocation, carved whole.
fn whole_region(arena: &mut Arena, name: &str, bytes: usize) -> Result<DevSpan, CudaError> {
    let id = arena.add_region(name, bytes)?;
    arena.alloc(id, bytes)
}

/// Checks that the CUDA backend can serve `plan` for the model `cfg` (the rank's shape under tensor
/// parallelism): the weight format and K/V formats it stores, and the draft tokens per step.
pub(super) fn check_plan(
    cfg: &ModelConfig,
    d: Dims,
    plan: &Plan,
    shard: Option<&ShardSpec>,
) -> Result<(KvFormats, WeightFormat, usize), CudaError> {
    // Under tensor parallelism the plan is rank 0's (the largest shard); a last rank's vocabulary
    // shard may be shorter.
    let same_shape = match &shard {
        None => plan.dims == d,
        Some(_) => Dims { vocab: plan.dims.vocab, ..d } == plan.dims && d.vocab <= plan.dims.vocab,
    };
    if !same_shape {
        return Err(CudaError::Plan("the plan was made for another model shape".into()));
    }
    if !matches!(plan.options.backend, PlanBackend::Cuda { .. }) {
        return Err(CudaError::Plan(
            "the plan was made without the CUDA backend's scratch (PlanBackend::Generic); plan with \
             PlanOptions::gpu_defaults (PlanBackend::Cuda)"
                .into(),
        ));
    }
    if plan.options.activation_bytes_per_elem != 2 {
        return Err(CudaError::Plan("the CUDA backend supports bf16 activations only (gpu_defaults)".into()));
    }
    // K/V stored as bf16, fp8, int8 or int4 (load_kv refuses fp16 / fp32).
    let kvf = KvFormats { k: plan.options.k_dtype, v: plan.options.v_dtype };
    kvf.validate().map_err(|e| CudaError::Plan(format!("{e}")))?;
    if !matches!(plan.options.weights_dtype, WeightsDtype::Bf16 | WeightsDtype::Int4 | WeightsDtype::Fp8Block) {
        return Err(CudaError::Plan(format!(
            "the CUDA backend stores weights in bf16, int4 or fp8, not {}",
            plan.options.weights_dtype.name()
        )));
    }
    let fmt = WeightFormat::of(&plan.options);
    if fmt.fp8 && (cfg.moe.is_some() || shard.is_some()) {
        return Err(CudaError::UnsupportedModel(
            "fp8 weights on CUDA: dense models on one GPU only for now (mixture-of-experts models and tensor \
             parallelism take bf16 or int4)"
                .into(),
        ));
    }
    if fmt.experts_on_host && (cfg.moe.is_none() || shard.is_some()) {
        return Err(CudaError::Plan("routed experts on the host need a mixture-of-experts model on one GPU".into()));
    }
    if cfg.moe.is_some() && shard.is_some() {
        return Err(CudaError::UnsupportedModel(
            "mixture-of-experts models on CUDA do not support tensor parallelism yet".into(),
        ));
    }
    let max_draft = plan.options.speculative_tokens;
    if max_draft > 0 {
        let refuse =
            |what: &str| Err(CudaError::Plan(format!("speculative decoding on CUDA does not support {what} yet")));
        if shard.is_some() {
            return refuse("tensor parallelism");
        }
        if cfg.mtp_num_hidden_layers == 0 {
            return Err(CudaError::Plan("speculative decoding: the model has no MTP head".into()));
        }
    }
    Ok((kvf, fmt, max_draft))
}

/// How the backend splits the plan's `weights` and `backend_scratch` regions for a rank of model shape
/// `cfg` whose weights take `weights_bytes` in format `fmt`: the weights region at least the plan's,
/// what the weights need beyond it taken from the scratch's spare, the scratch's parts at its start.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Carve {
    pub(super) weights: usize,
    pub(super) scratch: usize,
    pub(super) parts: ScratchParts,
}

impl Carve {
    pub(super) fn new(
        plan: &Plan,
        cfg: &ModelConfig,
        weights_bytes: usize,
        fmt: WeightFormat,
    ) -> Result<Self, CudaError> {
        let plan_weights = plan_region(plan, "weights")?;
        let parts = ScratchParts::new(cfg, plan.max_batch_tokens, plan.max_seqs, fmt.linears(), fmt.lm_head_int4);
        let planned = plan.region("backend_scratch").map_or(0, |r| r.bytes as usize);
        let spare = planned.checked_sub(parts.total()).ok_or_else(|| {
            CudaError::Plan(format!(
                "the plan reserves {planned} B of backend scratch, the CUDA backend needs {} B",
                parts.total()
            ))
        })?;
        let over = weights_bytes.saturating_sub(plan_weights).min(spare);
        Ok(Carve { weights: weights_bytes.max(plan_weights), scratch: planned - over, parts })
    }
}

/// Device bytes of the weights as the backend places them: a quantised checkpoint's under int4 weights
/// as the plan walked it (walked here when the plan did not), else the layout of the rank's shape.
pub(super) fn weights_bytes(
    plan: &Plan,
    (full_cfg, cfg): (&ModelConfig, &ModelConfig),
    weights: &WeightSource,
    fmt: WeightFormat,
    shard: Option<&ShardSpec>,
) -> Result<usize, CudaError> {
    Ok(match weights {
        WeightSource::Checkpoint(dir) if (fmt.int4 || fmt.fp8) && cfg.quantization.is_some() => {
            match &plan.options.backend {
                PlanBackend::Cuda { checkpoint: Some(c) } => c.device_bytes(fmt),
                _ => CheckpointTensors::walk(full_cfg, dir, shard)
                    .map_err(|e| CudaError::Weights(e.to_string()))?
                    .device_bytes(fmt),
            }
        }
        _ => weights_device_bytes(cfg, fmt),
    })
}

/// Allocates the plan's regions (the weights region at least the plan's, for the backend's own layout)
/// and carves the backend scratch into its parts.
fn carve_regions(
    arena: &mut Arena,
    rt: &Runtime,
    plan: &Plan,
    cfgs: (&ModelConfig, &ModelConfig),
    weights: &WeightSource,
    fmt: WeightFormat,
    shard: Option<&ShardSpec>,
) -> Result<Regions, CudaError> {
    let region = |name: &str| plan_region(plan, name);

    // Weights: the backend's own layout (bf16 pairs fused, three small tensors in f32), at least
    // the plan's region. What a GPTQ checkpoint needs beyond the plan (linears it leaves bf16,
    // act-order permutations) comes out of spare backend scratch the plan reserved for it.
    // The vision tower's bf16 weights follow the model's (when the plan prices the tower).
    let tower = super::vision::tower_of(cfgs.0, plan, shard.is_some())?;
    let weights_bytes =
        weights_bytes(plan, cfgs, weights, fmt, shard)? + tower.map_or(0, |(v, _)| super::vision::weight_bytes(v));
    let carve_at = Carve::new(plan, cfgs.1, weights_bytes, fmt)?;
    let wreg = arena.add_region("weights", carve_at.weights)?;

    // Fixed plan regions, each one allocation, each carved whole.
    let whole = whole_region;
    let kv = whole(arena, "kv_pages", region("kv_pages")?)?;
    let states = whole(arena, "state_slots", region("state_slots")?)?;
    let snapshots = whole(arena, "snapshots", region("snapshots")?)?;
    let acts = whole(arena, "activations", region("activations")?)?;
    let logits = whole(arena, "logits", region("logits")?)?;
    let block_tables = whole(arena, "block_tables", region("block_tables")?)?;
    // Zeroed once (the host mirror starts so); steps upload only the entries that change.
    rt.memset(block_tables.ptr, 0, block_tables.bytes)?;
    let gemm_ws = whole(arena, "gemm_workspace", region("gemm_workspace")?)?;

    // The plan's backend scratch: chunked DeltaNet f32 workspace, the varlen tables, the int4 scratch.
    let parts = carve_at.parts;
    let scratch = whole(arena, "backend_scratch", carve_at.scratch)?;
    let mut at = scratch.ptr;
    let mut carve = |bytes: usize| {
        let span = DevSpan { ptr: at, bytes };
        at += al(bytes) as u64;
        span
    };
    let gdn_ws = carve(parts.gdn);
    let chunk_table = carve(parts.chunk_table);
    let tile_table = carve(parts.tile_table);
    let segments = carve(parts.segments);
    let decode_rows = carve(parts.decode_rows);
    let w4_x = carve(parts.w4_x);
    let w4_slice = carve(parts.w4_slice);
    let w4_gemm = carve(parts.w4_gemm);
    let fp8_x = carve(parts.fp8_x);
    Ok(Regions {
        wreg,
        weights_bytes,
        kv,
        states,
        snapshots,
        acts,
        logits,
        block_tables,
        gemm_ws,
        scratch_bytes: parts.total(),
        gdn_ws,
        chunk_table,
        tile_table,
        segments,
        decode_rows,
        w4_x,
        w4_slice,
        w4_gemm,
        fp8_x,
    })
}

/// The activation buffers from the plan's workspace (steps of `t` tokens and `s` sequences), each
/// checked against what the backend puts there, and the scratch parts.
fn workspace_views(
    wsb: &Workspace<'_>,
    d: &Dims,
    moe: Option<&MoeConfig>,
    r: &Regions,
    partial_bytes: usize,
) -> Result<Ws, CudaError> {
    let (t, s) = (wsb.plan.max_batch_tokens, wsb.plan.max_seqs);
    let h = d.hidden;
    let get = |name: &str, need: usize| wsb.get(name, need);
    let has_gdn = d.num_deltanet_layers > 0;
    let has_attn = d.num_attention_layers > 0;
    let opt = |present: bool, name: &str, need: usize| wsb.opt(present, name, need);
    let sampling_layout = SamplingScratch::new(s, d.vocab);
    Ok(Ws {
        token_ids: get("token_ids", 4 * t)?,
        positions: get("positions", 4 * t)?,
        rope_pos: 0,
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
        gdn_ws: r.gdn_ws,
        chunk_table: r.chunk_table,
        tile_table: r.tile_table,
        segments: r.segments,
        decode_rows: r.decode_rows,
        w4_x: r.w4_x,
        w4_slice: r.w4_slice,
        w4_gemm: r.w4_gemm,
        fp8_x: r.fp8_x,
        moe: moe.map(|m| moe_views(wsb, m, t, h)).transpose()?,
    })
}

/// Cache layouts (Plan::kv_tensor_bytes / state_tensor_bytes): per attention layer its K/V in the KV
/// pages, per DeltaNet layer its tensors in the state slots and the snapshots; with speculative
/// decoding the MTP head's KV layer after the model's, and the pending hidden rows after the DeltaNet
/// tensors of the slots and of the snapshots.
fn cache_layouts(
    plan: &Plan,
    cfg: &ModelConfig,
    d: &Dims,
    r: &Regions,
    kvf: KvFormats,
    max_draft: usize,
) -> Result<CacheLayout, CudaError> {
    let (kv, states, snapshots) = (r.kv, r.states, r.snapshots);
    let h = d.hidden;
    let [kb, ks, vb, vs] = plan.kv_tensor_bytes().map(|x| x as usize);
    let [rb, cb] = plan.state_tensor_bytes(plan.num_state_slots).map(|x| x as usize);
    let [srb, scb] = plan.state_tensor_bytes(plan.options.snapshot_slots).map(|x| x as usize);
    let [rec_bytes, conv_bytes] = plan.state_tensor_bytes(1).map(|x| x as usize);
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
    Ok(CacheLayout { caches, spec_kv, pending, snap_pending, rec_bytes, conv_bytes })
}

/// Speculative decoding's buffers: the speculation region carved (verify and draft hidden rows, the
/// verify trace, the index arrays, the gather rows of the lm_head, the verify rows' split-K partials),
/// the MTP head's workspace views; every verified row may want logits, so `ws` gathers them there.
fn speculation(
    arena: &mut Arena,
    wsb: &Workspace<'_>,
    d: &Dims,
    ws: &mut Ws,
    kv: LayerKv,
    (max_draft, pending, snap_pending): (usize, usize, usize),
    partial_bytes: usize,
) -> Result<Spec, CudaError> {
    let plan = wsb.plan;
    let (t, s) = (plan.max_batch_tokens, plan.max_seqs);
    let h = d.hidden;
    let get = |name: &str, need: usize| wsb.get(name, need);
    let region = whole_region(arena, "speculation", plan_region(plan, "speculation")?)?;
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
        ..*ws
    };
    Ok(Spec {
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

impl CudaBackend {
    pub(super) fn build(
        full_cfg: &ModelConfig,
        weights: WeightSource,
        plan: &Plan,
        host_snapshot_slots: usize,
        opts: CudaOptions,
        shard: Option<ShardSpec>,
    ) -> Result<Self, CudaError> {
        Self::check_model(full_cfg)?;
        let rank_cfg = shard.as_ref().map(|s| s.rank_config(full_cfg));
        let cfg = rank_cfg.as_ref().unwrap_or(full_cfg);
        let rt = Runtime::open(shard.as_ref().map_or(0, |s| s.rank))?;
        let d = cfg.dims();
        let (kvf, fmt, max_draft) = check_plan(cfg, d, plan, shard.as_ref())?;
        let k = Kernels::load_kv(&rt, kernel_dims(cfg).with_state_dtype(plan.options.stored_state_dtype()), kvf)?;
        tracing::info!(
            "kernels for {} compiled and loaded in {:.0} ms; attention prefill: {}",
            k.arch,
            k.load_ms,
            k.attn_prefill_kernel()
        );
        let mut arena = Arena::new(rt.context().clone());
        let r = carve_regions(&mut arena, &rt, plan, (full_cfg, cfg), &weights, fmt, shard.as_ref())?;
        let (kv, logits, block_tables) = (r.kv, r.logits, r.block_tables);

        // Activation buffers from the plan's workspace, each checked against what we put there.
        let (t_max, s_max) = (plan.max_batch_tokens, plan.max_seqs);
        let s = s_max;
        let h = d.hidden;
        let wsb = Workspace { plan, acts: r.acts };
        let p = plan.options.decode_partitions;
        // (at least SHORT_CHUNK_PARTIAL_ROWS rows: short prefill chunks split their keys into them)
        let partial_rows = deltaserve_plan::cuda::decode_partial_rows(s);
        let partial_bytes = attention::decode_scratch_bytes(partial_rows, d.q_heads, p, d.head_dim);
        let mut ws = workspace_views(&wsb, &d, cfg.moe.as_ref(), &r, partial_bytes)?;
        if logits.bytes < 4 * s * d.vocab {
            return Err(CudaError::Plan(format!("logits region {} B < [{s}, {}] f32", logits.bytes, d.vocab)));
        }
        let table_width = plan.block_table_bytes as usize / (4 * s);

        let cl = cache_layouts(plan, cfg, &d, &r, kvf, max_draft)?;
        let (rec_bytes, conv_bytes) = (cl.rec_bytes, cl.conv_bytes);
        // The vision region (the tower's buffers and every step's M-RoPE positions), before the MTP head's
        // views copy `ws`.
        let tower = match vision::tower_of(full_cfg, plan, shard.is_some())? {
            Some((v, n)) => {
                let (region, layout) = vision::carve_region(&mut arena, plan, v, n)?;
                ws.rope_pos = region.ptr + layout.rope_pos as u64;
                Some((v.clone(), n, region, layout))
            }
            None => None,
        };
        let spec = cl
            .spec_kv
            .map(|kv| {
                let at = (max_draft, cl.pending, cl.snap_pending);
                // The draft head's attention: decode rows of the step's sequences only.
                let mtp_partial_bytes = attention::decode_scratch_bytes(s, d.q_heads, p, d.head_dim);
                speculation(&mut arena, &wsb, &d, &mut ws, kv, at, mtp_partial_bytes)
            })
            .transpose()?;
        if logits.bytes < 4 * s * (1 + max_draft) * d.vocab {
            return Err(CudaError::Plan(format!(
                "logits region {} B < [{}, {}] f32",
                logits.bytes,
                s * (1 + max_draft),
                d.vocab
            )));
        }

        let gemm = Gemm::new(&rt, r.gemm_ws)?;
        let snapshot_len = d.num_deltanet_layers * (rec_bytes + conv_bytes) + if spec.is_some() { h * 2 } else { 0 };
        let host_pool_bytes = host_snapshot_slots * snapshot_len;
        let host_pool = (host_pool_bytes > 0).then(|| PinnedHost::new(&rt, host_pool_bytes)).transpose()?;
        let host_embed = if fmt.embed_on_host {
            let table = PinnedHost::new(&rt, d.vocab * h * 2)?;
            Some(HostEmbed { table, staging: PinnedHost::new(&rt, t_max * h * 2)? })
        } else {
            None
        };
        // The routed experts' pinned block (every sparse layer's and the MTP head's), outside the arena.
        let host_experts =
            fmt.experts_on_host.then(|| HostExperts::new(&rt, host_experts_bytes(cfg, fmt))).transpose()?;
        let inputs = StepInputs::new(&rt, plan)?;
        let launches = Launches::new(&rt, s_max, d.vocab)?;
        let overlap = (k.gdn_overlap && d.num_deltanet_layers > 0)
            .then(|| crate::ops::gdn_overlap::Overlap::new(rt.context()))
            .transpose()?;

        let be = CudaBackend {
            rt,
            k,
            gemm,
            arena,
            d,
            eps: cfg.rms_norm_eps,
            rope_theta: cfg.rope_theta as f32,
            w: Weights { embed: 0, lm_head: Vec::new(), final_norm: 0, layers: Vec::new(), mtp: None },
            ws,
            caches: cl.caches,
            states: r.states,
            snapshots: r.snapshots,
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
            weights_bytes: r.weights_bytes,
            scratch_bytes: r.scratch_bytes,
            prof: std::cell::RefCell::new(None),
            phases: std::cell::RefCell::new(None),
            opts,
            graphs: HashMap::new(),
            graph_stats: GraphStats::default(),
            graph_budget: plan.options.graph_reserve_bytes,
            host_embed,
            host_experts,
            inputs,
            launches,
            w4_quantized: 0,
            w4_converted: 0,
            tp: shard.map(|spec| RankComm { spec, full_vocab: full_cfg.vocab_size, comms: None }),
            spec,
            fold: false,
            vision: None,
            mrope_section: cfg.mrope_section,
            saves: Default::default(),
            overlap,
            rounds: Default::default(),
            fp8_x_holds: Default::default(),
        };
        be.place_weights(weights, (full_cfg, cfg), r.wreg, fmt, kv, tower)
    }

    /// Loads or generates the weights into the weights region (the KV pages region `kv`, empty until the
    /// first step, stages them), zeroes the cache regions and seals the arena.
    fn place_weights(
        mut self,
        weights: WeightSource,
        (full_cfg, cfg): (&ModelConfig, &ModelConfig),
        wreg: RegionId,
        fmt: WeightFormat,
        kv: DevSpan,
        tower: Option<(VisionConfig, usize, DevSpan, CudaTowerLayout)>,
    ) -> Result<Self, CudaError> {
        let be = &mut self;
        // The KV pages region is empty until the first step: staging for quantisation at load and
        // for the host embedding's random init.
        be.w = match &weights {
            WeightSource::Checkpoint(dir) => be.load_checkpoint(full_cfg, cfg, dir, wreg, fmt, kv)?,
            WeightSource::RandomWeights { seed } => {
                // Each rank draws its own shard's values.
                let seed = seed ^ be.tp.as_ref().map_or(0, |t| (t.spec.rank as u64) << 32);
                be.random_weights(cfg, wreg, seed, fmt, kv)?
            }
        };
        if let Some((v, max_patches, region, layout)) = tower {
            let w = match &weights {
                WeightSource::Checkpoint(dir) => {
                    let ckpt = Checkpoint::open(dir).map_err(|e| CudaError::Weights(e.to_string()))?;
                    vision::load_checkpoint(&be.rt, &mut be.arena, wreg, &ckpt, full_cfg)?
                }
                WeightSource::RandomWeights { seed } => {
                    vision::random_weights(&be.k, &be.rt, &mut be.arena, wreg, &v, *seed)?
                }
            };
            let (kept, fills) = Default::default();
            let pixels = vision::PixelStaging::new(&be.rt)?;
            be.vision = Some(vision::Vision { cfg: v, w, max_patches, region, layout, kept, fills, pixels });
        }
        // Zero every cache region once (never read before written, but deterministic).
        for span in [kv, be.states, be.snapshots] {
            be.rt.memset(span.ptr, 0, span.bytes)?;
        }
        be.rt.synchronize()?;
        be.fold = be.tp.is_none() && layers_fold(&be.w.layers, be.d.hidden);
        if let Some(he) = &be.host_experts {
            let (used, bytes) = he.usage();
            tracing::info!("routed experts: {used} B of the {bytes} B host block placed");
        }
        be.arena.seal();
        Ok(self)
    }
}
