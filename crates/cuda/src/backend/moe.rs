//! The routed experts of a sparse layer on the GPU: their weights (every expert of a layer in one
//! block, so a kernel finds expert e's rows at `base + e·stride`), their workspace buffers, and the
//! forward that runs after the shared expert has written `mlp_out`: router logits, top-k, the
//! experts' SwiGLU MLPs (per-pair GEMVs for decode-sized steps, grouped GEMMs otherwise) and the
//! weighted un-permute onto the shared expert's gated output.

use deltaserve_model::MoeConfig;
use deltaserve_model::weights::MoeWeights;

use crate::error::CudaError;
use crate::ops::moe::{self, ExpertWeights};
use crate::ops::{elementwise, gemv};

use super::CudaBackend;
use super::forward::b2;
use super::layout::{Workspace, Ws};
use super::linear::po;
use super::weights::Part;

/// A sparse layer's router, experts and shared-expert gate (bf16), with the routing it follows.
#[derive(Clone, Copy, Debug)]
pub(super) struct MoeLayer {
    /// `[E, hidden]`.
    pub(super) router: u64,
    /// `[hidden]`: the shared expert's gate.
    pub(super) shared_gate: u64,
    /// Expert e's `[2·I, hidden]` gate rows then up rows.
    pub(super) gate_up: ExpertWeights,
    /// Expert e's `[hidden, I]`.
    pub(super) down: ExpertWeights,
    pub(super) num_experts: usize,
    pub(super) top_k: usize,
    pub(super) norm_topk_prob: bool,
    /// The shared expert's width (the layer's dense MLP).
    pub(super) shared_width: usize,
}

impl MoeLayer {
    /// The layer's experts from the block at `base` ([`ExpertBlock`]'s layout).
    pub(super) fn new(m: &MoeConfig, hidden: usize, router: u64, shared_gate: u64, base: u64) -> Self {
        let (i, stride) = (m.expert_intermediate, 3 * m.expert_intermediate * hidden);
        MoeLayer {
            router,
            shared_gate,
            gate_up: ExpertWeights { base, stride, n: 2 * i, kdim: hidden },
            down: ExpertWeights { base: base + b2(2 * i * hidden), stride, n: hidden, kdim: i },
            num_experts: m.num_experts,
            top_k: m.top_k,
            norm_topk_prob: m.norm_topk_prob,
            shared_width: m.shared_expert_intermediate,
        }
    }
}

/// `(expert, projection)` of an expert tensor's name (`….mlp.experts.{e}.{gate,up,down}_proj.weight`,
/// also as cut from fused experts): projection 0 gate, 1 up, 2 down.
pub(super) fn expert_proj(name: &str) -> Option<(usize, usize)> {
    const AT: &str = "mlp.experts.";
    let rest = &name[name.find(AT)? + AT.len()..];
    let (e, rest) = rest.split_once('.')?;
    let proj = ["gate_proj.", "up_proj.", "down_proj."].iter().position(|p| rest.starts_with(p))?;
    Some((e.parse().ok()?, proj))
}

/// Where a layer's expert tensors go as a checkpoint loads: one block of `E · 3` matrices of `I·hidden`
/// bf16, expert e's gate, up and down at matrix `3e`, `3e + 1`, `3e + 2`. The block is allocated when
/// expert 0's gate arrives (experts load in order, gate / up / down).
#[derive(Default)]
pub(super) struct ExpertBlock {
    base: u64,
    matrix_bytes: usize,
}

impl ExpertBlock {
    /// The address of expert tensor `(e, proj)` of `bytes` bytes; `alloc(n)` allocates the block.
    pub(super) fn place(
        &mut self,
        name: &str,
        (e, proj): (usize, usize),
        bytes: usize,
        num_experts: usize,
        alloc: &mut dyn FnMut(usize) -> Result<u64, CudaError>,
    ) -> Result<u64, CudaError> {
        if (e, proj) == (0, 0) {
            self.base = alloc(3 * num_experts * bytes)?;
            self.matrix_bytes = bytes;
        }
        if self.base == 0 || bytes != self.matrix_bytes || e >= num_experts {
            return Err(CudaError::Weights(format!(
                "`{name}`: {bytes} B, expected expert {e} < {num_experts} of {} B after expert 0's gate",
                self.matrix_bytes
            )));
        }
        Ok(self.base + ((3 * e + proj) * bytes) as u64)
    }
}

/// Checks that a layer's loaded experts `w` sit where `ml` reads them (expert e at `base + e·stride`).
pub(super) fn check_expert_block(w: &MoeWeights<Part>, ml: &MoeLayer) -> Result<(), CudaError> {
    let half = b2(ml.gate_up.n / 2 * ml.gate_up.kdim);
    for (e, x) in w.experts.iter().enumerate() {
        let at = b2(e * ml.gate_up.stride);
        let want = [ml.gate_up.base + at, ml.gate_up.base + at + half, ml.down.base + at];
        let got = [x.gate_proj.ptr(), x.up_proj.ptr(), x.down_proj.ptr()];
        if want != got || !matches!(x.gate_proj, Part::Bf16 { .. }) {
            return Err(CudaError::Weights(format!("expert {e} is not in its layer's bf16 expert block")));
        }
    }
    Ok(())
}

/// The routed experts' workspace buffers (the plan's `moe_*`).
#[derive(Clone, Copy)]
pub(super) struct MoeWs {
    router_logits: u64,
    topk: u64,
    offsets: u64,
    rows: u64,
    rows_in: u64,
    gate_up: u64,
    act: u64,
    rows_out: u64,
    shared_gate: u64,
}

/// The `moe_*` buffers for steps of `t` tokens, each checked against what the kernels put there.
pub(super) fn moe_views(wsb: &Workspace<'_>, m: &MoeConfig, t: usize, hidden: usize) -> Result<MoeWs, CudaError> {
    let (e, k, i) = (m.num_experts, m.top_k, m.expert_intermediate);
    let get = |name: &str, need: usize| wsb.get(name, need);
    Ok(MoeWs {
        router_logits: get("moe_router_logits", 4 * t * e)?,
        topk: get("moe_topk", moe::topk_bytes(t, k))?,
        offsets: get("moe_expert_offsets", moe::offsets_bytes(e))?,
        rows: get("moe_rows", 4 * t * k)?,
        rows_in: get("moe_rows_in", 2 * t * k * hidden)?,
        gate_up: get("moe_gate_up", 2 * t * k * 2 * i)?,
        act: get("moe_act", 2 * t * k * i)?,
        rows_out: get("moe_rows_out", 2 * t * k * hidden)?,
        shared_gate: get("moe_shared_gate", 4 * t)?,
    })
}

impl CudaBackend {
    /// The routed experts of layer `m` over the `t` rows of `mlp_in`, added to `mlp_out` (which holds
    /// the shared expert's output) as `mlp_out = Σ_k w_k · expert_k + sigmoid(gate) · mlp_out`.
    pub(super) fn moe(&self, ws: &Ws, m: &MoeLayer, t: usize) -> Result<(), CudaError> {
        let (k, s, h) = (&self.k, self.rt.stream().as_ref(), self.d.hidden);
        let mw = ws.moe.as_ref().ok_or_else(|| CudaError::Plan("the workspace has no `moe_*` buffers".into()))?;
        let (e, top_k) = (m.num_experts, m.top_k);
        let pairs = t * top_k;
        let router = [Part::Bf16 { w: m.router, rows: e }];
        self.proj(s, ws.mlp_in, t, h, &[po(&router, mw.router_logits, e)], true)?;
        moe::route(
            k,
            s,
            mw.router_logits,
            t,
            e,
            top_k,
            m.norm_topk_prob,
            ws.mlp_in,
            m.shared_gate,
            h,
            mw.topk,
            mw.shared_gate,
        )?;
        let i = m.gate_up.n / 2;
        let swiglu = || elementwise::swiglu(k, s, mw.gate_up, 2 * i, mw.gate_up + b2(i), 2 * i, mw.act, pairs, i);
        if self.moe_gemv(t) {
            // Decode: each (token, k) pair reads its expert's rows only; the rows stay in pair order.
            moe::gemv(k, s, ws.mlp_in, top_k, mw.topk, pairs, &m.gate_up, mw.gate_up)?;
            swiglu()?;
            moe::gemv(k, s, mw.act, 1, mw.topk, pairs, &m.down, mw.rows_out)?;
            moe::unpermute(k, s, mw.rows_out, None, mw.topk, t, top_k, mw.shared_gate, h, ws.mlp_out)?;
        } else {
            moe::offsets(k, s, mw.topk, pairs, e, mw.offsets, mw.rows)?;
            moe::permute(k, s, ws.mlp_in, mw.rows, t, top_k, h, mw.rows_in)?;
            moe::gemm(k, s, mw.rows_in, mw.offsets, e, pairs, &m.gate_up, mw.gate_up)?;
            swiglu()?;
            moe::gemm(k, s, mw.act, mw.offsets, e, pairs, &m.down, mw.rows_out)?;
            moe::unpermute(k, s, mw.rows_out, Some(mw.rows), mw.topk, t, top_k, mw.shared_gate, h, ws.mlp_out)?;
        }
        self.tick("MoE experts")
    }

    /// Whether a step of `t` tokens runs the experts as per-pair GEMVs (the decode GEMV's token range,
    /// [`crate::CudaOptions::gemv_max_tokens`]) rather than grouped GEMMs.
    fn moe_gemv(&self, t: usize) -> bool {
        t <= self.opts.gemv_max_tokens.min(gemv::MAX_TOKENS)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expert_names_give_expert_and_projection() {
        assert_eq!(expert_proj("model.layers.3.mlp.experts.17.down_proj.weight"), Some((17, 2)));
        assert_eq!(
            expert_proj("model.language_model.layers.0.mlp.experts.0.gate_proj.weight (from fused `x`)"),
            Some((0, 0))
        );
        assert_eq!(expert_proj("model.layers.0.mlp.experts.2.up_proj.weight"), Some((2, 1)));
        assert_eq!(expert_proj("model.layers.0.mlp.shared_expert.gate_proj.weight"), None);
        assert_eq!(expert_proj("model.layers.0.mlp.gate.weight"), None);
        assert_eq!(expert_proj("model.layers.0.mlp.experts.gate_up_proj"), None);
    }

    #[test]
    fn experts_fill_one_block_in_order() {
        let mut allocs = Vec::new();
        let mut alloc = |n: usize| {
            allocs.push(n);
            Ok(4096u64)
        };
        let mut b = ExpertBlock::default();
        assert!(b.place("x", (1, 0), 64, 4, &mut alloc).is_err(), "expert 1 before expert 0's gate");
        assert_eq!(b.place("g0", (0, 0), 64, 4, &mut alloc).unwrap(), 4096);
        assert_eq!(b.place("d0", (0, 2), 64, 4, &mut alloc).unwrap(), 4096 + 128);
        assert_eq!(b.place("u3", (3, 1), 64, 4, &mut alloc).unwrap(), 4096 + 10 * 64);
        assert!(b.place("x", (4, 0), 64, 4, &mut alloc).is_err(), "beyond the config's experts");
        assert!(b.place("x", (2, 0), 32, 4, &mut alloc).is_err(), "another size");
        assert_eq!(allocs, vec![3 * 4 * 64]);
        let m = MoeConfig {
            num_experts: 4,
            top_k: 2,
            expert_intermediate: 8,
            shared_expert_intermediate: 16,
            norm_topk_prob: true,
            sparse_layers: vec![true],
        };
        let l = MoeLayer::new(&m, 32, 1, 2, 4096);
        assert_eq!((l.gate_up.base, l.gate_up.stride, l.gate_up.n, l.gate_up.kdim), (4096, 768, 16, 32));
        assert_eq!((l.down.base, l.down.stride, l.down.n, l.down.kdim), (4096 + 2 * 16 * 32, 768, 32, 8));
    }
}
