//! The weights as the forward reads them: device addresses of every layer's linears (bf16 or int4 parts),
//! norms and small tensors, and the host embedding table.

use crate::ops::fp8::Fp8Weights;
use crate::ops::w4a16::W4Weights;
use crate::runtime::PinnedHost;

use super::moe::MoeLayer;
use super::spec::MtpHead;

/// One stored linear (or a fused pair of bf16 linears): `rows` output rows.
#[derive(Clone, Copy, Debug)]
pub(super) enum Part {
    /// bf16 `[rows, in]` (dense tensors: rows 0).
    Bf16 {
        w: u64,
        rows: usize,
    },
    W4(W4Weights),
    Fp8(Fp8Weights),
}

impl Part {
    pub(super) fn rows(&self) -> usize {
        match self {
            Part::Bf16 { rows, .. } => *rows,
            Part::W4(w) => w.out,
            Part::Fp8(w) => w.out,
        }
    }
    pub(super) fn ptr(&self) -> u64 {
        match self {
            Part::Bf16 { w, .. } => *w,
            Part::W4(w) => w.qweight,
            Part::Fp8(w) => w.codes,
        }
    }
}

/// A projection: its parts write consecutive column ranges of one output (bf16 pairs are one
/// fused part; int4 pairs two).
pub(super) type Proj = Vec<Part>;

pub(super) struct GdnLayer {
    pub(super) qkv: Proj,
    pub(super) z: Proj,
    /// [2·Hv, hidden]: in_proj_b rows then in_proj_a rows.
    pub(super) ba: Proj,
    pub(super) conv: u64,
    pub(super) dt_bias: u64,
    pub(super) a_log: u64,
    pub(super) norm: u64,
    pub(super) out: Proj,
}

pub(super) struct AttnLayer {
    pub(super) q: Proj,
    pub(super) k: Proj,
    pub(super) v: Proj,
    pub(super) o: Proj,
    pub(super) q_norm: u64,
    pub(super) k_norm: u64,
}

pub(super) enum Mixer {
    Gdn(GdnLayer),
    Attn(AttnLayer),
}

pub(super) struct Layer {
    pub(super) input_norm: u64,
    pub(super) post_norm: u64,
    pub(super) mixer: Mixer,
    /// [2·I, hidden]: gate rows then up rows (a sparse layer's shared expert).
    pub(super) gate_up: Proj,
    pub(super) down: Proj,
    /// A sparse layer's router and routed experts.
    pub(super) moe: Option<MoeLayer>,
}

pub(super) struct Weights {
    /// Device embedding table (0 when it is on the host).
    pub(super) embed: u64,
    pub(super) lm_head: Proj,
    pub(super) final_norm: u64,
    pub(super) layers: Vec<Layer>,
    /// The MTP head, loaded when the plan has speculative decoding on.
    pub(super) mtp: Option<MtpHead>,
}

/// The embedding table in pinned host memory (`embed_on_host`) and the pinned `[t_max, hidden]`
/// bf16 buffer a step's rows are gathered into before one upload.
pub(super) struct HostEmbed {
    pub(super) table: PinnedHost,
    pub(super) staging: PinnedHost,
}
