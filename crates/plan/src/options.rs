//! [`PlanOptions`]: the limits a plan is computed for.

use std::sync::Arc;

use crate::checkpoint::CheckpointTensors;
use crate::dtype::{KvDtype, StateDtype, WeightsDtype};
use crate::size::MIB;
use crate::vision::MIN_DEFAULT_IMAGE_TOKENS;

/// Split-K partitions of the decode attention of speculative verify rows, at most (the speculation
/// region holds their partials for every verified position): [`PlanOptions::verify_partitions`].
pub const VERIFY_PARTITIONS: usize = 16;

/// Split-K partitions of a decode row's attention, at most ([`PlanOptions::decode_partitions`]).
pub const MAX_DECODE_PARTITIONS: usize = 128;

/// The backend a plan is for.
#[derive(Clone, Debug, PartialEq)]
pub enum PlanBackend {
    /// The generic regions only: the f32 reference (CPU) backend carves nothing else.
    Generic,
    /// The CUDA backend: its scratch (chunked DeltaNet workspace, varlen tables, int4 slice and x
    /// scratch, bounded by the tokens and sequences per step) and, loading a quantised checkpoint
    /// under int4 weights, what the checkpoint's tensors need beyond the `weights` region.
    Cuda {
        /// The quantised checkpoint the weights come from, walked once (`None`: random weights, a
        /// bf16 checkpoint, or weights not stored int4).
        checkpoint: Option<Arc<CheckpointTensors>>,
    },
}

/// Everything besides the model shape that decides the plan.
#[derive(Clone, Debug, PartialEq)]
pub struct PlanOptions {
    /// The arena cap (`--memory`), runtime reserve included.
    pub budget_bytes: u64,
    /// Storage of the decoder linears (norms, conv, `A_log`, `dt_bias` stay 16-bit, or 32-bit for `F32`;
    /// embedding + lm_head 16-bit unless `lm_head_int4`).
    pub weights_dtype: WeightsDtype,
    /// int4 weights carry packed int4 zero points (asymmetric quantisation); ignored for other formats.
    pub int4_asym: bool,
    /// Store lm_head as int4 (group 128, fp16 scales) whatever `weights_dtype` is.
    pub lm_head_int4: bool,
    /// Keep the embedding table in pinned host memory (outside the device budget); a step gathers its rows on
    /// the host and copies `[T, D]` to the device.
    pub embed_on_host: bool,
    /// Keep the routed experts of every sparse layer (and of the MTP head) in pinned host memory, outside
    /// the device budget, mapped into the device's address space: the expert kernels read the experts a
    /// step picks across the bus (PCIe). Only for a mixture-of-experts model on the CUDA backend, one card.
    pub experts_on_host: bool,
    pub k_dtype: KvDtype,
    pub v_dtype: KvDtype,
    /// Storage of the DeltaNet recurrent state in its slots and snapshots (`--state-dtype`). The generic
    /// (CPU) backend keeps f32 whatever this says: it stores the values the format holds.
    pub state_dtype: StateDtype,
    /// 2 on GPU (bf16), 4 on the CPU reference backend.
    pub activation_bytes_per_elem: usize,
    /// Tokens per engine step (chunked prefill + decodes).
    pub max_batch_tokens: usize,
    /// Sequences per step = DeltaNet state slots.
    pub max_seqs: usize,
    /// None: as large as fits (capped by `max_position_embeddings`).
    pub max_context: Option<usize>,
    /// Tokens per KV page.
    pub page_size: usize,
    /// Device pool of DeltaNet state snapshots (recurrent + conv state of every DeltaNet layer).
    pub snapshot_slots: usize,
    /// CUDA context, modules, cuBLAS handles: counted against the budget, not allocated by the arena.
    pub runtime_reserve_bytes: u64,
    /// CUDA graphs of the step shapes (decode batches, speculative verify, commit and draft steps),
    /// captured as they first occur: counted against the budget, not allocated by the arena; the
    /// backend captures no graph that would take its graphs past this (later shapes run eagerly).
    pub graph_reserve_bytes: u64,
    /// cuBLASLt workspace.
    pub gemm_workspace_bytes: u64,
    /// The backend the plan is for: what it carves beside the generic regions (its `backend_scratch`).
    pub backend: PlanBackend,
    /// Split-K partitions of decode attention: the most a sequence uses (the CUDA kernel gives each
    /// row one partition per 128 keys of its context, up to this).
    pub decode_partitions: usize,
    /// Speculative decoding (`--speculative-tokens`, 0 = off): drafts per decode step. When on, the plan
    /// also holds the MTP head's weights, its KV (one more attention layer in every page), a pending
    /// hidden row per state slot (and snapshot), K + 1 logit rows per sequence and the verify workspace.
    pub speculative_tokens: usize,
    /// Tensor parallelism (`--tensor-parallel`, 1 = off): the model is split over this many cards
    /// (Megatron style, [`deltaserve_model::shard`]) and the plan is **per card**: the card's weight
    /// shards, its KV heads' pages (kv heads / N), its DeltaNet value heads' state (value heads / N),
    /// activations at the card's shapes, the gathered logits. `budget_bytes` is then one card's budget
    /// (the smallest card's, with mixed cards: it decides the context every card can hold).
    pub tensor_parallel: usize,
    /// The vision tower, where the backend loads the model's: the most patches it runs at once
    /// (`--max-image-tokens-per-step`; an image of more patches is refused), which bounds its activation
    /// workspace (the `vision` region); its weights are in the `weights` region, at the dense format
    /// (f32 for f32 weights, else 16-bit). `None`: no tower loaded (`--no-vision`, or a backend that runs
    /// none), nothing priced. A text-only model prices nothing either way.
    pub max_image_tokens_per_step: Option<usize>,
}

/// Device memory NCCL takes per card beyond the CUDA runtime (communicator buffers for every channel
/// and protocol, its kernels, proxy state), counted against a card's budget under tensor parallelism.
/// Measured on 2× H200 over NVLink with NCCL 2.28.3 (bench/results/tp-2x-h200-2026-11-29.md): the
/// driver reported 0.79 GiB per card above a plan without it; PCIe cards set up fewer channels.
pub const COLLECTIVE_RESERVE_BYTES: u64 = 1 << 30;

impl PlanOptions {
    /// How the state slots hold the DeltaNet state: `state_dtype` on CUDA, f32 on the generic backend
    /// (which stores the values of `state_dtype` in f32).
    pub fn stored_state_dtype(&self) -> StateDtype {
        match self.backend {
            PlanBackend::Generic => StateDtype::F32,
            PlanBackend::Cuda { .. } => self.state_dtype,
        }
    }

    /// Split-K partitions of a speculative verify row's decode attention.
    pub fn verify_partitions(&self) -> usize {
        self.decode_partitions.min(VERIFY_PARTITIONS)
    }

    /// Sets tensor parallelism to `n` cards: the plan becomes per card, and on the GPU (a nonzero
    /// runtime reserve) each card also reserves [`COLLECTIVE_RESERVE_BYTES`] for NCCL.
    pub fn set_tensor_parallel(&mut self, n: usize) {
        let had = if self.tensor_parallel > 1 { COLLECTIVE_RESERVE_BYTES } else { 0 };
        let reserve = self.runtime_reserve_bytes.saturating_sub(had);
        self.tensor_parallel = n;
        self.runtime_reserve_bytes = if n > 1 && reserve > 0 { reserve + COLLECTIVE_RESERVE_BYTES } else { reserve };
    }

    /// The CUDA backend: bf16 weights and KV, bf16 activations, 4096 tokens and 16 sequences per step,
    /// 32-token pages, 8 snapshots, 600 MiB runtime reserve, 64 MiB of CUDA graphs, 32 MiB GEMM workspace,
    /// 32 decode partitions; no vision tower (the CLI sets `max_image_tokens_per_step` for a model that has one).
    pub fn gpu_defaults(budget: u64) -> Self {
        Self {
            budget_bytes: budget,
            weights_dtype: WeightsDtype::Bf16,
            int4_asym: false,
            lm_head_int4: false,
            embed_on_host: false,
            experts_on_host: false,
            k_dtype: KvDtype::Bf16,
            v_dtype: KvDtype::Bf16,
            state_dtype: StateDtype::F32,
            activation_bytes_per_elem: 2,
            max_batch_tokens: 4096,
            max_seqs: 16,
            max_context: None,
            page_size: 32,
            snapshot_slots: 8,
            runtime_reserve_bytes: 600 * MIB,
            graph_reserve_bytes: 64 * MIB,
            gemm_workspace_bytes: 32 * MIB,
            backend: PlanBackend::Cuda { checkpoint: None },
            decode_partitions: 32,
            speculative_tokens: 0,
            tensor_parallel: 1,
            max_image_tokens_per_step: None,
        }
    }

    /// The f32 reference backend (no backend scratch): f32 weights, KV and activations, 512 tokens and 4 sequences per step,
    /// 32-token pages, 2 snapshots, no runtime or graph reserve or GEMM workspace, 1 decode partition; the
    /// model's vision tower (f32) with [`MIN_DEFAULT_IMAGE_TOKENS`] patches per step.
    pub fn cpu_defaults(budget: u64) -> Self {
        Self {
            budget_bytes: budget,
            weights_dtype: WeightsDtype::F32,
            k_dtype: KvDtype::F32,
            v_dtype: KvDtype::F32,
            state_dtype: StateDtype::F32,
            activation_bytes_per_elem: 4,
            max_batch_tokens: 512,
            max_seqs: 4,
            snapshot_slots: 2,
            runtime_reserve_bytes: 0,
            graph_reserve_bytes: 0,
            gemm_workspace_bytes: 0,
            decode_partitions: 1,
            backend: PlanBackend::Generic,
            max_image_tokens_per_step: Some(MIN_DEFAULT_IMAGE_TOKENS),
            ..Self::gpu_defaults(budget)
        }
    }
}
