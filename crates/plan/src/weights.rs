//! Bytes of the text-model weights in a given storage format, split between the device arena and pinned host
//! memory (the embedding with `embed_on_host`, the routed experts with `experts_on_host`). Shapes are the canonical (unpacked) `[out, in]` ones of `docs/architecture.md` §5.1; the vision
//! tower is counted where the backend loads it ([`crate::vision`]); the MTP head (§5.2) is counted only with
//! speculative decoding on (a mixture-of-experts model's head with all its experts). A sparse layer's routed experts and shared expert are decoder linears in
//! `weights_dtype` (every expert priced, whether or not a token routes to it); its router and shared-expert
//! gate stay 16-bit. Every tensor (a quantised linear's data,
//! scales and zero points are separate tensors) starts 256-byte aligned, and its padding is counted, so a
//! bump allocator that places the tensors one after another fits exactly.

use deltaserve_model::{LayerKind, ModelConfig};

use crate::dtype::{QUANT_GROUP, WeightsDtype};
use crate::options::PlanOptions;
use crate::plan::ALIGN;
use crate::vision::{tower_params, tower_weight_bytes};

fn al(x: u128) -> u128 {
    x.next_multiple_of(ALIGN as u128)
}

/// Bytes of one `[out, in]` linear as separately aligned tensors (data, scales, zero points).
fn linear_aligned(wd: WeightsDtype, out: usize, inp: usize, asym: bool) -> u128 {
    let (o, i, g) = (out as u128, inp as u128, QUANT_GROUP as u128);
    match wd {
        WeightsDtype::Int4 => {
            let groups = i.div_ceil(g);
            al(o * i.div_ceil(2)) + al(o * groups * 2) + if asym { al(groups * o.div_ceil(2)) } else { 0 }
        }
        WeightsDtype::Fp8Block => al(o * i) + al(o.div_ceil(g) * crate::dtype::fp8_scale_cols(inp) as u128 * 4),
        _ => al(wd.linear_bytes(out, inp, asym)),
    }
}

/// Every decoder linear's `[out, in]`, layer by layer (the MTP head's not included): the mixer's
/// projections (DeltaNet: in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, out_proj; attention:
/// q_proj with its gate, k_proj, v_proj, o_proj), then the MLP's gate, up, down (a sparse layer: the shared
/// expert's, then every routed expert's; its router and shared-expert gate are not counted here).
pub fn decoder_linear_shapes(cfg: &ModelConfig) -> Vec<(usize, usize)> {
    let d = cfg.dims();
    let h = d.hidden;
    let mut v = Vec::new();
    for (layer, kind) in cfg.layer_types.iter().enumerate() {
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
        match cfg.moe.as_ref().filter(|m| m.is_sparse(layer)) {
            Some(m) => {
                let (s, e) = (m.shared_expert_intermediate, m.expert_intermediate);
                v.extend([(s, h), (s, h), (h, s)]);
                for _ in 0..m.num_experts {
                    v.extend([(e, h), (e, h), (h, e)]);
                }
            }
            None => v.extend([(d.intermediate, h), (d.intermediate, h), (h, d.intermediate)]),
        }
    }
    v
}

/// Weight bytes by part.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WeightBytes {
    /// Decoder linears (every `[out, in]` projection of every layer), in `weights_dtype`, scales included.
    pub linears: u64,
    /// Norm weights, conv taps, `A_log`, `dt_bias` (16-bit; 32-bit for fp32 weights), each tensor padded to 256 B.
    pub dense: u64,
    /// Embedding table (16-bit; 32-bit for fp32 weights). On the host when `embed_on_host`.
    pub embed: u64,
    /// lm_head (16-bit, or int4 with `lm_head_int4`); 0 when tied to a device-resident embedding.
    pub lm_head: u64,
    /// Parameters of the decoder linears (for the table).
    pub linear_params: u64,
    pub embed_on_host: bool,
    /// The MTP head (its linears in `weights_dtype`, its norms dense; a mixture-of-experts model's head with
    /// every routed expert, its router and shared-expert gate) with speculative decoding on; else 0.
    pub mtp: u64,
    /// The routed experts of every sparse layer (part of `linears`); 0 for a dense model.
    pub experts: u64,
    /// The routed experts one token reads (`top_k` per sparse layer; part of `experts`).
    pub experts_active: u64,
    /// The MTP head's routed experts (part of `mtp`; 0 without speculative decoding or a sparse head).
    pub mtp_experts: u64,
    /// The routed experts (`experts` and `mtp_experts`) are in pinned host memory, not on the device.
    pub experts_on_host: bool,
    /// The vision tower (every `model.visual.*` tensor, in the dense format: f32 for f32 weights, else
    /// 16-bit) where the backend loads it ([`PlanOptions::max_image_tokens_per_step`]); else 0.
    pub vision: u64,
    /// Parameters of the vision tower (0 when not counted).
    pub vision_params: u64,
}

impl WeightBytes {
    /// Routed-expert bytes a step of `tokens` tokens reads: per sparse layer the distinct experts its
    /// tokens pick, `E·(1 − (1 − k/E)^tokens)` of its `E` under uniform routing (what random weights
    /// give; a trained router's skew reads fewer). One token: [`WeightBytes::experts_active`].
    pub fn experts_read(&self, num_experts: usize, top_k: usize, tokens: usize) -> f64 {
        if self.experts == 0 || num_experts == 0 {
            return 0.0;
        }
        let picked = (top_k as f64 / num_experts as f64).min(1.0);
        self.experts as f64 * (1.0 - (1.0 - picked).powi(tokens.min(i32::MAX as usize) as i32))
    }

    pub fn new(cfg: &ModelConfig, opts: &PlanOptions) -> Option<Self> {
        let d = cfg.dims();
        let h = d.hidden;
        let wd = opts.weights_dtype;
        let asym = opts.int4_asym;
        let shapes = decoder_linear_shapes(cfg);
        let elem = wd.dense_elem_bytes() as u128;
        let t = |n: usize| al(n as u128 * elem); // one small tensor of n elements
        let mut dense: u128 = t(h); // final norm
        for kind in &cfg.layer_types {
            dense += 2 * t(h); // input + post-attention layernorm
            dense += match kind {
                // conv taps, A_log, dt_bias, gated-norm weight
                LayerKind::DeltaNet => t(d.conv_channels * d.conv_kernel) + 2 * t(d.gdn_v_heads) + t(d.gdn_v_dim),
                LayerKind::Attention => 2 * t(d.head_dim), // q_norm, k_norm
            };
        }
        // Sparse layers: the router and the shared expert's gate (16-bit); the routed experts.
        let (mut experts, mut experts_active): (u128, u128) = (0, 0);
        if let Some(m) = &cfg.moe {
            let sparse = m.num_sparse_layers() as u128;
            let (e, ew) = (m.num_experts as u128, m.expert_intermediate);
            dense += sparse * (t(m.num_experts * h) + t(h));
            let one = 2 * linear_aligned(wd, ew, h, asym) + linear_aligned(wd, h, ew, asym);
            experts = sparse * e * one;
            experts_active = sparse * m.top_k as u128 * one;
        }
        let (mtp, mtp_experts) = if opts.speculative_tokens > 0 && cfg.mtp_num_hidden_layers > 0 {
            // fc, q/k/v/o, then the MLP's gate/up/down (a mixture-of-experts head: its shared expert's, then
            // every routed expert's); norms: 2 pre-fc, final, input, post-attention, q_norm, k_norm.
            let sparse = cfg.moe.as_ref().filter(|m| m.mtp_is_sparse());
            let width = sparse.map_or(d.intermediate, |m| m.shared_expert_intermediate);
            let mut mtp_shapes = vec![(h, 2 * h), (2 * d.attn_dim, h), (d.kv_dim, h), (d.kv_dim, h), (h, d.attn_dim)];
            mtp_shapes.extend([(width, h), (width, h), (h, width)]);
            // A sparse head's router and shared-expert gate stay 16-bit, as a main layer's.
            let mut small = 5 * t(h) + 2 * t(d.head_dim);
            let mut routed = 0;
            if let Some(m) = sparse {
                let e = m.expert_intermediate;
                routed = m.num_experts as u128 * (2 * linear_aligned(wd, e, h, asym) + linear_aligned(wd, h, e, asym));
                small += t(m.num_experts * h) + t(h);
            }
            (mtp_shapes.iter().map(|&(o, i)| linear_aligned(wd, o, i, asym)).sum::<u128>() + routed + small, routed)
        } else {
            (0, 0)
        };
        let (vision, vision_params) = match (&cfg.vision, opts.max_image_tokens_per_step) {
            (Some(v), Some(_)) => (tower_weight_bytes(v, elem as usize), tower_params(v)),
            _ => (0, 0),
        };
        let linears: u128 = shapes.iter().map(|&(o, i)| linear_aligned(wd, o, i, asym)).sum();
        let linear_params: u128 = shapes.iter().map(|&(o, i)| o as u128 * i as u128).sum();
        let table = al(d.vocab as u128 * h as u128 * elem);
        let lm_head = if opts.lm_head_int4 {
            linear_aligned(WeightsDtype::Int4, d.vocab, h, asym)
        } else if cfg.tie_word_embeddings && !opts.embed_on_host {
            0 // shares the device-resident embedding
        } else {
            table
        };
        Some(Self {
            linears: u64::try_from(linears).ok()?,
            dense: u64::try_from(dense).ok()?,
            embed: u64::try_from(table).ok()?,
            lm_head: u64::try_from(lm_head).ok()?,
            linear_params: u64::try_from(linear_params).ok()?,
            embed_on_host: opts.embed_on_host,
            mtp: u64::try_from(mtp).ok()?,
            experts: u64::try_from(experts).ok()?,
            experts_active: u64::try_from(experts_active).ok()?,
            mtp_experts: u64::try_from(mtp_experts).ok()?,
            experts_on_host: opts.experts_on_host && cfg.moe.is_some(),
            vision: u64::try_from(vision).ok()?,
            vision_params: u64::try_from(vision_params).ok()?,
        })
    }

    /// Bytes in the device arena.
    pub fn device(&self) -> u64 {
        self.linears
            + self.dense
            + self.lm_head
            + self.mtp
            + self.vision
            + if self.embed_on_host { 0 } else { self.embed }
            - self.host_experts()
    }

    /// Routed-expert bytes in pinned host memory (the main layers' and the MTP head's; 0 unless
    /// `experts_on_host`).
    pub fn host_experts(&self) -> u64 {
        if self.experts_on_host { self.experts + self.mtp_experts } else { 0 }
    }

    /// Bytes in pinned host memory: the embedding table with `embed_on_host`, the routed experts with
    /// `experts_on_host`.
    pub fn host(&self) -> u64 {
        self.host_experts() + if self.embed_on_host { self.embed } else { 0 }
    }
}
