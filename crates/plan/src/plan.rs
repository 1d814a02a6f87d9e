//! [`Plan::new`]: sizes and places every region of the device arena; KV pages get everything left.

use deltaserve_model::{Dims, ModelConfig, ModelError, ShardSpec};

use crate::cuda::backend_scratch_bytes;
use crate::dtype::{KvDtype, WeightsDtype};
use crate::error::PlanError;
use crate::options::{MAX_DECODE_PARTITIONS, PlanBackend, PlanOptions};
use crate::size::fmt_bytes;
use crate::vision::{CudaTowerLayout, tower_workspace_bytes};
use crate::weights::WeightBytes;
use crate::workspace::{StepShape, WorkspaceLayout, plan_workspace};

/// Alignment of every region offset and every workspace buffer offset.
pub const ALIGN: u64 = 256;

/// One region of the arena.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Region {
    pub name: &'static str,
    pub bytes: u64,
    /// Offset in the arena (multiple of [`ALIGN`]).
    pub offset: u64,
    pub note: String,
}

/// The static memory plan.
#[derive(Clone, Debug, PartialEq)]
pub struct Plan {
    /// In arena order: weights, kv_pages, state_slots, snapshots, activations, logits, block_tables,
    /// gemm_workspace, backend_scratch, then (when priced) speculation and vision. Offsets are 256-byte aligned; each region starts where the previous one ends, rounded up.
    pub regions: Vec<Region>,
    /// Weights in the device arena.
    pub weights_bytes: u64,
    /// Weights in pinned host memory (the embedding with `embed_on_host`, the routed experts with
    /// `experts_on_host`), outside the budget.
    pub host_weights_bytes: u64,
    /// All attention layers, K + V, scales included.
    pub kv_bytes_per_token: u64,
    /// Recurrent state `[Hv, Dk, Dv]` (the stored state dtype) + conv state `[K-1, conv_channels]` (activation
    /// dtype), every DeltaNet layer.
    pub state_bytes_per_seq: u64,
    pub activation_bytes: u64,
    pub snapshot_bytes: u64,
    /// `[max_seqs, vocab]` f32.
    pub logits_bytes: u64,
    /// `[max_seqs, ceil(context cap / page_size)]` i32 page ids.
    pub block_table_bytes: u64,
    /// What the backend carves beside the generic regions ([`crate::cuda::backend_scratch_bytes`]; 0 on
    /// the CPU backend).
    pub backend_scratch_bytes: u64,
    /// The vision tower's activation workspace ([`crate::vision::tower_workspace_bytes`] for
    /// `max_image_tokens_per_step` patches); 0 when no tower is priced.
    pub vision_workspace_bytes: u64,
    /// The model has a vision tower (priced or not: see [`PlanOptions::max_image_tokens_per_step`]).
    pub model_has_vision: bool,
    /// Everything counted against the budget: the arena (alignment included) + the runtime reserve.
    pub total_bytes: u64,
    pub budget_bytes: u64,
    pub page_size: usize,
    /// Whole pages; KV gets ALL memory left after the fixed regions.
    pub num_kv_pages: usize,
    pub num_state_slots: usize,
    /// The largest context one sequence can fill to 100%.
    pub max_context: usize,
    /// Sequences that can be at `max_context` at once (at most `max_seqs`).
    pub max_full_context_seqs: usize,
    pub max_batch_tokens: usize,
    pub max_seqs: usize,
    /// Named activation buffers with offsets inside the `activations` region, planned by liveness.
    pub workspace: WorkspaceLayout,
    /// The weight bytes by part.
    pub weight_parts: WeightBytes,
    /// The derived sizes of what one card holds (the whole model at `tensor_parallel` 1; under TP
    /// the card's shard: heads, kv heads, DeltaNet heads, intermediate and vocabulary divided).
    pub dims: Dims,
    /// The whole model's vocabulary (the gathered logits' width).
    pub model_vocab: usize,
    /// The model's position limit (caps `max_context`).
    pub max_position_embeddings: usize,
    /// The options the plan was made for.
    pub options: PlanOptions,
}

impl Plan {
    /// Sizes and places every region for `cfg` under `opts`. Pure: allocates nothing.
    pub fn new(cfg: &ModelConfig, opts: &PlanOptions) -> Result<Plan, PlanError> {
        validate(cfg, opts)?;
        // With tensor parallelism everything below is one card's: the card's shard of the model is a
        // model of its own shape (heads, kv heads, DeltaNet heads, intermediate, vocabulary divided).
        // Logits are gathered over the full vocabulary; sampling reads them.
        let full_vocab = cfg.vocab_size;
        let card = card_config(cfg, opts.tensor_parallel)?;
        let cfg = &card;
        let d = cfg.dims();
        let overflow = |what| PlanError::Overflow { what };
        let to64 = |x: u128, what| u64::try_from(x).map_err(|_| overflow(what));
        let wb = WeightBytes::new(cfg, opts).ok_or(overflow("weight bytes"))?;
        let weights = wb.device();
        let scratch_bytes = backend_scratch_bytes(cfg, opts, weights);
        // Counted against the budget beside the arena: the runtime's own memory and the CUDA graphs.
        let reserve = opts.runtime_reserve_bytes + opts.graph_reserve_bytes;
        let budget = opts.budget_bytes;
        let hints = Hints { cfg, opts, wb: &wb };

        // Per-token and per-sequence costs.
        let kv = KvShape::new(&d, opts);
        let kv_bytes_per_token = to64(kv.bytes_per_token(), "KV bytes per token")?;
        let page_bytes = to64(kv.bytes_per_token() * opts.page_size as u128, "KV page")?;
        let st = StateShape::new(&d, opts);
        let state_bytes_per_seq = to64(st.bytes_per_seq(), "state bytes per sequence")?;

        // Fixed regions.
        let state_bytes = to64(st.region(opts.max_seqs), "state slots")?;
        let snapshot_bytes = to64(st.region(opts.snapshot_slots), "snapshots")?;
        // Speculative decoding verifies 1 + K positions per sequence: that many logit rows each.
        let spec = opts.speculative_tokens;
        // Under TP a card also holds its own vocabulary shard of the rows before the all-gather.
        let logit_cols = full_vocab as u128 + if opts.tensor_parallel > 1 { d.vocab as u128 } else { 0 };
        let logits_bytes = to64(opts.max_seqs as u128 * (1 + spec) as u128 * logit_cols * 4, "logits")?;
        // Verify workspace (its positions count against max_batch_tokens, so the activation workspace
        // covers the forward): per sequence and verified position the main model's hidden row and each
        // DeltaNet layer's recurrence inputs (conv input, q, k, v, g, beta; f32), replayed at the commit,
        // and the split-K partials of its attention as a decode query; plus the K draft logit rows per
        // sequence.
        let spec_bytes = if spec > 0 {
            let per_pos = d.hidden as u128
                + d.num_deltanet_layers as u128
                    * (d.conv_channels + 2 * d.gdn_key_width + d.gdn_value_width + 2 * d.gdn_v_heads) as u128
                + (opts.verify_partitions() * d.q_heads * (d.head_dim + 2)) as u128;
            let b = opts.max_seqs as u128 * ((1 + spec) as u128 * per_pos + spec as u128 * full_vocab as u128) * 4;
            to64(b, "speculation workspace")?
        } else {
            0
        };
        let context_cap = opts.max_context.unwrap_or(cfg.max_position_embeddings);
        let table_width = context_cap.div_ceil(opts.page_size);
        let table_bytes = to64(opts.max_seqs as u128 * table_width as u128 * 4, "block tables")?;
        let shape = StepShape {
            tokens: opts.max_batch_tokens,
            seqs: opts.max_seqs,
            act_bytes: opts.activation_bytes_per_elem,
            host_embed_elem: opts.embed_on_host.then_some(opts.weights_dtype.dense_elem_bytes() as usize),
            decode_partitions: opts.decode_partitions,
            speculative: spec > 0,
        };
        let vision_bytes = match (&cfg.vision, opts.max_image_tokens_per_step, &opts.backend) {
            (Some(v), Some(n), PlanBackend::Cuda { .. }) => {
                to64(CudaTowerLayout::new(v, n, opts.max_batch_tokens).bytes as u128, "vision workspace")?
            }
            (Some(v), Some(n), PlanBackend::Generic) => {
                to64(tower_workspace_bytes(v, n, opts.activation_bytes_per_elem), "vision workspace")?
            }
            _ => 0,
        };
        let ws_cfg = ModelConfig { vocab_size: full_vocab, ..cfg.clone() };
        let workspace = plan_workspace(&ws_cfg, &shape).ok_or(overflow("activation workspace"))?;
        let activation_bytes = workspace.bytes;
        let fixed_parts: [(&str, u64); 9] = [
            ("speculation", spec_bytes),
            ("vision workspace", vision_bytes),
            ("state slots", state_bytes),
            ("snapshots", snapshot_bytes),
            ("activations", activation_bytes),
            ("logits", logits_bytes),
            ("block tables", table_bytes),
            ("GEMM workspace", opts.gemm_workspace_bytes),
            ("backend scratch", scratch_bytes),
        ];
        let fixed = fixed_parts.iter().map(|(_, x)| x.next_multiple_of(ALIGN) as u128).sum::<u128>()
            + weights.next_multiple_of(ALIGN) as u128
            + reserve as u128;
        let fixed = to64(fixed, "fixed regions")?;
        let one_page = to64(kv.region(1), "KV page")?;
        let minimum = fixed.saturating_add(one_page);

        if weights.saturating_add(reserve) > budget {
            let mut h = Vec::new();
            if opts.weights_dtype != WeightsDtype::Int4 && hints.weight_flags_apply() {
                let int4 = PlanOptions { weights_dtype: WeightsDtype::Int4, ..opts.clone() };
                if let Some(w) = WeightBytes::new(cfg, &int4) {
                    h.push(format!("use --weights-dtype int4 ({} of weights)", fmt_bytes(w.device())));
                }
            }
            h.extend(hints.weight_savings());
            h.extend(hints.vision_savings(vision_bytes));
            h.push(format!("raise --memory to at least {} (the whole plan at these settings)", fmt_bytes(minimum)));
            return Err(PlanError::WeightsDoNotFit {
                weights,
                dtype: weights_desc(opts),
                runtime_reserve: reserve,
                budget,
                hint: join_or(h),
            });
        }
        if fixed > budget {
            let mut breakdown: Vec<String> =
                fixed_parts.iter().filter(|(_, x)| *x > 0).map(|(n, x)| format!("{n} {}", fmt_bytes(*x))).collect();
            if reserve > 0 {
                breakdown.push(format!("runtime and graph reserve {}", fmt_bytes(reserve)));
            }
            let mut h = hints.fixed_savings(state_bytes_per_seq, activation_bytes);
            h.extend(hints.vision_savings(vision_bytes));
            h.extend(hints.weight_savings());
            h.push(format!("raise --memory to at least {}", fmt_bytes(minimum)));
            return Err(PlanError::FixedRegionsDoNotFit {
                weights,
                fixed,
                budget,
                breakdown: breakdown.join(", "),
                hint: join_or(h),
            });
        }

        // KV pages: everything left, in whole pages.
        let left = budget - fixed;
        let max_pos = cfg.max_position_embeddings;
        let (num_kv_pages, max_context, max_full_context_seqs) = if let Some(pages) = left.checked_div(page_bytes) {
            // Per-tensor alignment may cost a few hundred bytes: step back until the region fits.
            let mut pages = usize::try_from(pages).unwrap_or(usize::MAX);
            while pages > 0 && kv.region(pages) > left as u128 {
                pages -= 1;
            }
            let kv_name = kv_desc(opts);
            let fits = pages.saturating_mul(opts.page_size).min(max_pos);
            if pages == 0 {
                let mut h = hints.fixed_savings(state_bytes_per_seq, activation_bytes);
                h.extend(hints.vision_savings(vision_bytes));
                h.extend(hints.weight_savings());
                h.push(format!("raise --memory to at least {}", fmt_bytes(minimum)));
                return Err(PlanError::NoKvPage {
                    weights,
                    left,
                    budget,
                    page_bytes,
                    page_size: opts.page_size,
                    kv: kv_name,
                    hint: join_or(h),
                });
            }
            let max_context = match opts.max_context {
                Some(mc) => {
                    let need_pages = mc.div_ceil(opts.page_size);
                    if need_pages > pages {
                        let needed = to64(kv.region(need_pages), "KV for --max-context")?;
                        let mut h = vec!["lower --max-context".to_string()];
                        h.extend(hints.kv_smaller());
                        h.extend(hints.weight_savings());
                        h.extend(hints.fixed_savings(state_bytes_per_seq, activation_bytes));
                        h.extend(hints.vision_savings(vision_bytes));
                        h.push(format!("raise --memory to at least {}", fmt_bytes(fixed.saturating_add(needed))));
                        return Err(PlanError::ContextDoesNotFit {
                            requested: mc,
                            needed,
                            left,
                            weights,
                            fits,
                            kv: kv_name,
                            hint: join_or(h),
                        });
                    }
                    mc
                }
                None => fits,
            };
            let per_seq_pages = max_context.div_ceil(opts.page_size).max(1);
            (pages, max_context, (pages / per_seq_pages).min(opts.max_seqs))
        } else {
            // No attention layer (page_bytes == 0): nothing grows with context.
            (0, context_cap.min(max_pos), opts.max_seqs)
        };
        let kv_bytes = to64(kv.region(num_kv_pages), "KV pages")?;

        let w = &wb;
        let dense_note = if opts.weights_dtype == WeightsDtype::F32 { "f32" } else { "bf16" };
        let lm_note = if opts.lm_head_int4 {
            "int4"
        } else if w.lm_head == 0 {
            "tied to embed"
        } else {
            dense_note
        };
        let small = if cfg.moe.is_some() { "norms/conv/A_log/dt_bias/routers" } else { "norms/conv/A_log/dt_bias" };
        let device_linears = w.linears - if w.experts_on_host { w.experts } else { 0 };
        let mut weights_note = format!(
            "decoder linears {} {}, lm_head {} {lm_note}, {small} {} {dense_note}",
            fmt_bytes(device_linears),
            weights_desc(opts),
            fmt_bytes(w.lm_head),
            fmt_bytes(w.dense),
        );
        if opts.embed_on_host {
            weights_note += &format!("; embed {} in pinned host memory", fmt_bytes(w.embed));
        } else {
            weights_note += &format!(", embed {} {dense_note}", fmt_bytes(w.embed));
        }
        if w.vision > 0 {
            weights_note += &format!("; vision tower {} {dense_note}", fmt_bytes(w.vision));
        }
        if w.experts_on_host {
            weights_note += &format!(
                "; routed experts {} {} in pinned host memory, read across the bus",
                fmt_bytes(w.host_experts()),
                weights_desc(opts)
            );
        }
        let specs: Vec<(&'static str, u64, String)> = vec![
            ("weights", weights, weights_note),
            (
                "kv_pages",
                kv_bytes,
                format!(
                    "{num_kv_pages} pages × {} tokens × {} B/token ({} layers × K,V × {} kv heads × {}; K {} V {})",
                    opts.page_size,
                    kv_bytes_per_token,
                    d.num_attention_layers,
                    d.kv_heads,
                    d.head_dim,
                    opts.k_dtype,
                    opts.v_dtype
                ),
            ),
            (
                "state_slots",
                state_bytes,
                format!(
                    "{} slots × {} (DeltaNet recurrent {} + conv, {} layers)",
                    opts.max_seqs,
                    fmt_bytes(state_bytes_per_seq),
                    opts.stored_state_dtype().name(),
                    d.num_deltanet_layers
                ),
            ),
            (
                "snapshots",
                snapshot_bytes,
                format!("{} slots × {}", opts.snapshot_slots, fmt_bytes(state_bytes_per_seq)),
            ),
            (
                "activations",
                activation_bytes,
                format!(
                    "{} buffers by liveness at {} tokens / {} seqs per step (peak live {})",
                    workspace.buffers.len(),
                    opts.max_batch_tokens,
                    opts.max_seqs,
                    fmt_bytes(workspace.peak_live_bytes())
                ),
            ),
            (
                "logits",
                logits_bytes,
                if opts.tensor_parallel > 1 {
                    format!(
                        "[{rows}, {full_vocab}] f32 gathered + this card's [{rows}, {}] vocabulary shard",
                        d.vocab,
                        rows = opts.max_seqs * (1 + spec)
                    )
                } else {
                    format!("[{}, {}] f32", opts.max_seqs * (1 + spec), d.vocab)
                },
            ),
            ("block_tables", table_bytes, format!("[{}, {table_width}] i32 page ids", opts.max_seqs)),
            ("gemm_workspace", opts.gemm_workspace_bytes, "cuBLASLt workspace".to_string()),
            (
                "backend_scratch",
                scratch_bytes,
                "backend scratch (chunked DeltaNet workspace, varlen tables)".to_string(),
            ),
        ];
        let mut specs = specs;
        if spec > 0 {
            specs.push((
                "speculation",
                spec_bytes,
                format!(
                    "{} seqs × {} verified positions (hidden + DeltaNet recurrence inputs) + {spec} draft logit rows; \
                     MTP head {} in weights, its KV in every page, a pending hidden per state slot",
                    opts.max_seqs,
                    1 + spec,
                    fmt_bytes(wb.mtp - if wb.experts_on_host { wb.mtp_experts } else { 0 })
                ),
            ));
        }
        if let (Some(v), Some(n)) = (&cfg.vision, opts.max_image_tokens_per_step) {
            specs.push((
                "vision",
                vision_bytes,
                format!(
                    "vision tower activations for {n} patches (--max-image-tokens-per-step; {} blocks of width {}, \
                     MLP {}), one image at a time",
                    v.depth, v.hidden_size, v.intermediate_size
                ),
            ));
        }
        let mut regions = Vec::with_capacity(specs.len());
        let mut offset = 0u64;
        for (name, bytes, note) in specs {
            regions.push(Region { name, bytes, offset, note });
            offset += bytes.next_multiple_of(ALIGN);
        }
        let total_bytes = offset + reserve;
        debug_assert!(total_bytes <= budget);

        Ok(Plan {
            regions,
            weights_bytes: weights,
            host_weights_bytes: wb.host(),
            kv_bytes_per_token,
            state_bytes_per_seq,
            activation_bytes,
            snapshot_bytes,
            logits_bytes,
            block_table_bytes: table_bytes,
            backend_scratch_bytes: scratch_bytes,
            vision_workspace_bytes: vision_bytes,
            model_has_vision: cfg.vision.is_some(),
            total_bytes,
            budget_bytes: budget,
            page_size: opts.page_size,
            num_kv_pages,
            num_state_slots: opts.max_seqs,
            max_context,
            max_full_context_seqs,
            max_batch_tokens: opts.max_batch_tokens,
            max_seqs: opts.max_seqs,
            workspace,
            weight_parts: wb,
            dims: d,
            model_vocab: full_vocab,
            max_position_embeddings: max_pos,
            options: opts.clone(),
        })
    }

    /// The region called `name`.
    pub fn region(&self, name: &str) -> Option<&Region> {
        self.regions.iter().find(|r| r.name == name)
    }

    /// Size of the arena (what the backend allocates once): every region, alignment included.
    pub fn arena_bytes(&self) -> u64 {
        self.total_bytes - self.options.runtime_reserve_bytes - self.options.graph_reserve_bytes
    }

    /// Bytes of one KV page (all attention layers, K + V, scales), without alignment padding.
    pub fn kv_page_bytes(&self) -> u64 {
        self.kv_bytes_per_token * self.page_size as u64
    }

    /// Layout of the `kv_pages` region: for each attention layer in order, four tensors each starting 256-byte
    /// aligned — K `[pages, page_size, kv_heads, head_dim]`, K scales `[pages, page_size, kv_heads]` f16,
    /// V, V scales (scales are 0 bytes for float formats). Returns their unpadded sizes.
    pub fn kv_tensor_bytes(&self) -> [u64; 4] {
        let kv = KvShape::new(&self.dims, &self.options);
        kv.tensors(self.num_kv_pages).map(|x| x as u64)
    }

    /// Layout of the `state_slots` (and `snapshots`) region: for each DeltaNet layer in order, the recurrent state
    /// `[slots, Hv, Dk, Dv]` ([`PlanOptions::stored_state_dtype`]) then the conv state `[slots, K-1, conv_channels]`
    /// (activation dtype), each starting 256-byte aligned. Returns their unpadded sizes for `slots`.
    pub fn state_tensor_bytes(&self, slots: usize) -> [u64; 2] {
        let st = StateShape::new(&self.dims, &self.options);
        st.tensors(slots).map(|x| x as u64)
    }
}

fn al(x: u128) -> u128 {
    x.next_multiple_of(ALIGN as u128)
}

/// Byte sizes of the paged KV cache.
struct KvShape {
    layers: u128,
    /// Per token of one layer: K data, K scales, V data, V scales.
    per_token: [u128; 4],
    page_size: u128,
}

impl KvShape {
    fn new(d: &Dims, o: &PlanOptions) -> Self {
        let (kvh, hd) = (d.kv_heads as u128, d.head_dim as u128);
        let data = |x: KvDtype| kvh * (hd * x.bits() as u128).div_ceil(8);
        let scale = |x: KvDtype| kvh * x.scale_bytes() as u128;
        Self {
            // With speculative decoding the MTP head's attention layer keeps its KV in the same pages.
            layers: d.num_attention_layers as u128 + u128::from(o.speculative_tokens > 0),
            per_token: [data(o.k_dtype), scale(o.k_dtype), data(o.v_dtype), scale(o.v_dtype)],
            page_size: o.page_size as u128,
        }
    }
    fn bytes_per_token(&self) -> u128 {
        self.layers * self.per_token.iter().sum::<u128>()
    }
    /// One layer's four tensors for `pages` pages of `page_size` tokens (unpadded).
    fn tensors(&self, pages: usize) -> [u128; 4] {
        self.per_token.map(|x| x * self.page_size * pages as u128)
    }
    fn region(&self, pages: usize) -> u128 {
        self.layers * self.tensors(pages).iter().map(|&x| al(x)).sum::<u128>()
    }
}

/// Byte sizes of the DeltaNet state (slots and snapshots).
struct StateShape {
    layers: u128,
    /// Per sequence of one layer: recurrent (the stored state dtype), conv (activation dtype).
    per_seq: [u128; 2],
    /// Per sequence, beyond the layers: the pending hidden row of speculative decoding (else 0).
    extra: u128,
}

impl StateShape {
    fn new(d: &Dims, o: &PlanOptions) -> Self {
        let elem = o.stored_state_dtype().bytes() as u128;
        let recurrent = d.gdn_v_heads as u128 * d.gdn_k_dim as u128 * d.gdn_v_dim as u128 * elem;
        let conv =
            (d.conv_kernel as u128).saturating_sub(1) * d.conv_channels as u128 * o.activation_bytes_per_elem as u128;
        let extra = if o.speculative_tokens > 0 { d.hidden as u128 * o.activation_bytes_per_elem as u128 } else { 0 };
        Self { layers: d.num_deltanet_layers as u128, per_seq: [recurrent, conv], extra }
    }
    fn bytes_per_seq(&self) -> u128 {
        self.layers * self.per_seq.iter().sum::<u128>() + self.extra
    }
    fn tensors(&self, slots: usize) -> [u128; 2] {
        self.per_seq.map(|x| x * slots as u128)
    }
    fn region(&self, slots: usize) -> u128 {
        self.layers * self.tensors(slots).iter().map(|&x| al(x)).sum::<u128>() + al(self.extra * slots as u128)
    }
}

fn validate(cfg: &ModelConfig, o: &PlanOptions) -> Result<(), PlanError> {
    let bad = |option, value: String, reason: &str| {
        Err(PlanError::InvalidOption { option, value, reason: reason.to_string() })
    };
    if o.max_batch_tokens == 0 {
        return bad("--max-batch-tokens", "0".into(), "a step needs at least one token");
    }
    if o.max_seqs == 0 {
        return bad("--max-seqs", "0".into(), "at least one sequence (DeltaNet state slot) is needed");
    }
    if o.max_seqs > o.max_batch_tokens {
        return bad(
            "--max-seqs",
            o.max_seqs.to_string(),
            &format!("more sequences per step than tokens per step (--max-batch-tokens {})", o.max_batch_tokens),
        );
    }
    if o.page_size == 0 {
        return bad("--page-size", "0".into(), "a KV page holds at least one token");
    }
    if o.speculative_tokens > 4 {
        return bad("--speculative-tokens", o.speculative_tokens.to_string(), "must be 1..=4 (0: off)");
    }
    if o.speculative_tokens > 0 && cfg.mtp_num_hidden_layers == 0 {
        return bad(
            "--speculative-tokens",
            o.speculative_tokens.to_string(),
            "the model has no MTP head (mtp_num_hidden_layers is 0)",
        );
    }
    if !matches!(o.activation_bytes_per_elem, 2 | 4) {
        return bad(
            "activation_bytes_per_elem",
            o.activation_bytes_per_elem.to_string(),
            "must be 2 (bf16, GPU) or 4 (f32, CPU)",
        );
    }
    if o.max_image_tokens_per_step == Some(0) {
        return bad(
            "--max-image-tokens-per-step",
            "0".into(),
            "an image has at least one patch (--no-vision: no tower)",
        );
    }
    if !(1..=MAX_DECODE_PARTITIONS).contains(&o.decode_partitions) {
        return bad(
            "--decode-partitions",
            o.decode_partitions.to_string(),
            &format!("decode attention uses 1 to {MAX_DECODE_PARTITIONS} partitions"),
        );
    }
    if o.weights_dtype == WeightsDtype::Fp8Block && cfg.moe.is_some() {
        return bad(
            "--weights-dtype",
            "fp8".into(),
            "mixture-of-experts models take bf16 or int4 weights (a block-FP8 checkpoint's experts are dequantised \
             to bf16 at load, or quantised with --quantize int4)",
        );
    }
    if o.weights_dtype == WeightsDtype::Fp8Block && o.tensor_parallel > 1 {
        return bad(
            "--weights-dtype",
            "fp8".into(),
            &format!("not with --tensor-parallel {} yet (bf16 or int4 weights)", o.tensor_parallel),
        );
    }
    if o.experts_on_host && cfg.moe.is_none() {
        return bad("--experts-on-host", "on".into(), "the model has no routed experts (its MLPs are dense)");
    }
    if o.experts_on_host && o.tensor_parallel > 1 {
        return bad(
            "--experts-on-host",
            "on".into(),
            &format!("not with --tensor-parallel {} (mixture-of-experts models run on one card)", o.tensor_parallel),
        );
    }
    match o.max_context {
        Some(0) => bad("--max-context", "0".into(), "a context holds at least one token"),
        Some(mc) if mc > cfg.max_position_embeddings => {
            Err(PlanError::ContextExceedsModel { requested: mc, model_max: cfg.max_position_embeddings })
        }
        _ => Ok(()),
    }
}

/// The model shape one card holds at tensor parallelism `tp` (rank 0's shard, the largest; the
/// config itself at `tp` = 1). An error names the head counts `tp` does not divide.
pub fn card_config(cfg: &ModelConfig, tp: usize) -> Result<ModelConfig, PlanError> {
    if tp == 1 {
        return Ok(cfg.clone());
    }
    let spec = ShardSpec::new(cfg, 0, tp).map_err(|e| PlanError::InvalidOption {
        option: "--tensor-parallel",
        value: tp.to_string(),
        reason: match e {
            ModelError::Unsupported(m) => m,
            other => other.to_string(),
        },
    })?;
    Ok(spec.rank_config(cfg))
}

/// `int4 (g128, fp16 scales)`, `bf16`, …
fn weights_desc(o: &PlanOptions) -> String {
    match o.weights_dtype {
        WeightsDtype::Int4 if o.int4_asym => "int4 (g128, fp16 scales + int4 zeros)".into(),
        WeightsDtype::Int4 => "int4 (g128, fp16 scales)".into(),
        WeightsDtype::Fp8Block => "fp8 (128×128 blocks, f32 scales)".into(),
        other => other.name().into(),
    }
}

/// `fp8` or `K fp8 / V int4`.
fn kv_desc(o: &PlanOptions) -> String {
    if o.k_dtype == o.v_dtype { o.k_dtype.name().into() } else { format!("K {} / V {}", o.k_dtype, o.v_dtype) }
}

/// Suggestions for error messages, each with what it frees.
struct Hints<'a> {
    cfg: &'a ModelConfig,
    opts: &'a PlanOptions,
    wb: &'a WeightBytes,
}

impl Hints<'_> {
    /// Whether the weight-storage flags (--weights-dtype, --embed-on-host, --experts-on-host, --lm-head-int4) apply: not to
    /// f32 weights, the CPU reference backend's (it keeps every weight in f32 and takes none of them).
    fn weight_flags_apply(&self) -> bool {
        self.opts.weights_dtype != WeightsDtype::F32
    }

    fn weight_savings(&self) -> Vec<String> {
        let mut h = Vec::new();
        if !self.weight_flags_apply() {
            return h;
        }
        if !self.opts.embed_on_host && self.wb.embed > 0 {
            let on_host = PlanOptions { embed_on_host: true, ..self.opts.clone() };
            if let Some(w) = WeightBytes::new(self.cfg, &on_host)
                && w.device() < self.wb.device()
            {
                h.push(format!("use --embed-on-host (frees {})", fmt_bytes(self.wb.device() - w.device())));
            }
        }
        if !self.opts.experts_on_host && self.wb.experts > 0 && self.opts.tensor_parallel == 1 {
            let on_host = PlanOptions { experts_on_host: true, ..self.opts.clone() };
            if let Some(w) = WeightBytes::new(self.cfg, &on_host)
                && w.device() < self.wb.device()
            {
                h.push(format!(
                    "use --experts-on-host (frees {}: the routed experts in pinned host memory, each token reading \
                     its experts across the bus)",
                    fmt_bytes(self.wb.device() - w.device())
                ));
            }
        }
        if !self.opts.lm_head_int4 {
            let int4 = PlanOptions { lm_head_int4: true, ..self.opts.clone() };
            if let Some(w) = WeightBytes::new(self.cfg, &int4)
                && w.device() < self.wb.device()
            {
                h.push(format!("use --lm-head-int4 (frees {})", fmt_bytes(self.wb.device() - w.device())));
            }
        }
        h
    }

    /// Lowering the vision tower's bound, or loading no tower, when its workspace is priced.
    fn vision_savings(&self, workspace: u64) -> Vec<String> {
        match self.opts.max_image_tokens_per_step {
            Some(n) if workspace > 0 => vec![
                format!("lower --max-image-tokens-per-step {n} (vision workspace {})", fmt_bytes(workspace)),
                format!("use --no-vision (frees {} of tower weights and the workspace)", fmt_bytes(self.wb.vision)),
            ],
            _ => Vec::new(),
        }
    }

    fn kv_smaller(&self) -> Vec<String> {
        let (k, v) = (self.opts.k_dtype, self.opts.v_dtype);
        let smaller = |x: KvDtype| x.smaller().unwrap_or(x);
        if k == v {
            k.smaller().map(|s| format!("use --kv-cache-dtype {s}")).into_iter().collect()
        } else if smaller(k) != k || smaller(v) != v {
            vec![format!("use --k-cache-dtype {} --v-cache-dtype {}", smaller(k), smaller(v))]
        } else {
            Vec::new()
        }
    }

    fn fixed_savings(&self, state_per_seq: u64, activations: u64) -> Vec<String> {
        let o = self.opts;
        let mut h = Vec::new();
        if o.max_seqs > 1 {
            h.push(format!("lower --max-seqs {} ({} of DeltaNet state each)", o.max_seqs, fmt_bytes(state_per_seq)));
        }
        if o.snapshot_slots > 0 {
            h.push(format!("lower --snapshot-slots {} ({} each)", o.snapshot_slots, fmt_bytes(state_per_seq)));
        }
        if o.max_batch_tokens > 256 {
            h.push(format!("lower --max-batch-tokens {} (activations {})", o.max_batch_tokens, fmt_bytes(activations)));
        }
        h
    }
}

/// `a, b, or c`.
fn join_or(mut items: Vec<String>) -> String {
    match items.len() {
        0 => String::new(),
        1 => items.remove(0),
        _ => {
            let last = items.pop().unwrap_or_default();
            format!("{}, or {last}", items.join(", "))
        }
    }
}
