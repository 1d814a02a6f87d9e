//! The routed experts of a sparse layer on the GPU: their weights (bf16: every expert of a layer in one
//! block, so a kernel finds expert e's rows at `base + e·stride`; int4: per expert its gate and up rows
//! as one linear, then down, every expert laid out alike at one stride), their workspace buffers, and
//! the forward that runs after the shared expert has written `mlp_out`: router logits, top-k, the
//! experts' SwiGLU MLPs (per-pair GEMVs for decode-sized steps, grouped GEMMs otherwise) and the
//! weighted un-permute onto the shared expert's gated output. With `moe_shared_pairs` a decode step's
//! shared expert runs instead as one more pair per token of those GEMVs ([`SharedExpert`]).

use deltaserve_model::MoeConfig;
use deltaserve_model::weights::MoeWeights;

use crate::error::CudaError;
use crate::ops::moe::{self, ExpertWeights, SharedPairs};
use crate::ops::moe_w4::{self, W4Experts, W4Shared};
use crate::ops::w4a16::W4Weights;
use crate::ops::{elementwise, gemv};
use crate::w4::{ScaleDtype, W4Bytes};

use super::CudaBackend;
use super::forward::b2;
use super::layout::{Workspace, Ws};
use super::linear::po;
use super::weights::Part;

/// A sparse layer's routed experts: each expert's gate and up rows (`[2·I, hidden]`, gate first) and
/// its down projection (`[hidden, I]`).
#[derive(Clone, Copy, Debug)]
pub(super) enum Experts {
    Bf16 { gate_up: ExpertWeights, down: ExpertWeights },
    Int4 { gate_up: W4Experts, down: W4Experts },
}

/// A sparse layer's router, experts and shared-expert gate (bf16), with the routing it follows.
#[derive(Clone, Copy, Debug)]
pub(super) struct MoeLayer {
    /// `[E, hidden]`.
    pub(super) router: u64,
    /// `[hidden]`: the shared expert's gate.
    pub(super) shared_gate: u64,
    pub(super) experts: Experts,
    pub(super) num_experts: usize,
    pub(super) top_k: usize,
    pub(super) norm_topk_prob: bool,
    /// A routed expert's width `I`.
    pub(super) expert_width: usize,
    /// The shared expert's width (the layer's dense MLP).
    pub(super) shared_width: usize,
}

impl MoeLayer {
    fn with(m: &MoeConfig, router: u64, shared_gate: u64, experts: Experts) -> Self {
        MoeLayer {
            router,
            shared_gate,
            experts,
            num_experts: m.num_experts,
            top_k: m.top_k,
            norm_topk_prob: m.norm_topk_prob,
            expert_width: m.expert_intermediate,
            shared_width: m.shared_expert_intermediate,
        }
    }

    /// The layer's bf16 experts from the block at `base` ([`ExpertBlock`]'s layout).
    pub(super) fn new(m: &MoeConfig, hidden: usize, router: u64, shared_gate: u64, base: u64) -> Self {
        let (i, stride) = (m.expert_intermediate, 3 * m.expert_intermediate * hidden);
        let experts = Experts::Bf16 {
            gate_up: ExpertWeights { base, stride, n: 2 * i, kdim: hidden },
            down: ExpertWeights { base: base + b2(2 * i * hidden), stride, n: hidden, kdim: i },
        };
        Self::with(m, router, shared_gate, experts)
    }

    /// The layer's int4 experts: expert e's `[2·I, hidden]` gate/up and `[hidden, I]` down linears,
    /// `parts[2e]` and `parts[2e + 1]`, each checked to sit where [`W4ExpertLayout`] puts it from
    /// expert 0's.
    pub(super) fn new_w4(
        m: &MoeConfig,
        hidden: usize,
        router: u64,
        shared_gate: u64,
        parts: &[Part],
    ) -> Result<Self, CudaError> {
        let (e, i) = (m.num_experts, m.expert_intermediate);
        let w4 = |p: &Part| match p {
            Part::W4(w) => Some(*w),
            Part::Bf16 { .. } | Part::Fp8(_) => None,
        };
        let (Some(gu), Some(_)) = (parts.first().and_then(w4), parts.get(1).and_then(w4)) else {
            return Err(CudaError::Weights("the int4 experts' first linears are missing or not int4".into()));
        };
        let lay = W4ExpertLayout::new(i, hidden, gu.zeros.is_some(), gu.scale_dtype);
        if parts.len() != 2 * e {
            return Err(CudaError::Weights(format!("{} int4 expert linears, expected {}", parts.len(), 2 * e)));
        }
        for (x, pair) in parts.chunks(2).enumerate() {
            let want = lay.expert(gu.qweight, x);
            let got = (pair[0].ptr(), pair[1].ptr(), pair.iter().filter_map(w4).count());
            if got != (want.0.qweight, want.1.qweight, 2) {
                return Err(CudaError::Weights(format!("expert {x} is not in its layer's int4 expert block")));
            }
        }
        let (g, d) = lay.expert(gu.qweight, 0);
        let experts = Experts::Int4 {
            gate_up: W4Experts { first: g, stride: lay.stride as u64, count: e },
            down: W4Experts { first: d, stride: lay.stride as u64, count: e },
        };
        Ok(Self::with(m, router, shared_gate, experts))
    }
}

/// Where the int4 experts of a layer sit: expert e's gate/up `[2·I, hidden]` linear at `base + e·stride`
/// and its down `[hidden, I]` right after it, each placed as the arena places one int4 linear (what the
/// plan's `weight_tensors` lists for them).
#[derive(Clone, Copy, Debug)]
pub(super) struct W4ExpertLayout {
    width: usize,
    hidden: usize,
    asym: bool,
    scale_dtype: ScaleDtype,
    gate_up_bytes: usize,
    /// Bytes from one expert to the next.
    pub(super) stride: usize,
}

impl W4ExpertLayout {
    pub(super) fn new(width: usize, hidden: usize, asym: bool, scale_dtype: ScaleDtype) -> Self {
        let gate_up_bytes = W4Bytes::new(2 * width, hidden, asym, false).aligned();
        let stride = gate_up_bytes + W4Bytes::new(hidden, width, asym, false).aligned();
        W4ExpertLayout { width, hidden, asym, scale_dtype, gate_up_bytes, stride }
    }

    /// Expert `e`'s (gate/up, down) linears in the block at `base`.
    pub(super) fn expert(&self, base: u64, e: usize) -> (W4Weights, W4Weights) {
        let at = base + (e * self.stride) as u64;
        let (h, i, a, sd) = (self.hidden, self.width, self.asym, self.scale_dtype);
        (W4Weights::at(at, 2 * i, h, a, false, sd), W4Weights::at(at + self.gate_up_bytes as u64, h, i, a, false, sd))
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

/// A layer's loaded experts `w` as the forward reads them: int4 ones (gate and up one linear) checked
/// by [`MoeLayer::new_w4`], bf16 ones checked to sit where the layer reads them (expert e at
/// `base + e·stride`).
pub(super) fn loaded_experts(w: &MoeWeights<Part>, m: &MoeConfig, hidden: usize) -> Result<MoeLayer, CudaError> {
    let (router, gate) = (w.router.ptr(), w.shared_expert_gate.ptr());
    if matches!(w.experts.first().map(|x| x.gate_proj), Some(Part::W4(_))) {
        let parts: Vec<Part> = w.experts.iter().flat_map(|x| [x.gate_proj, x.down_proj]).collect();
        if w.experts.iter().any(|x| x.up_proj.ptr() != x.gate_proj.ptr()) {
            return Err(CudaError::Weights("an int4 expert's up rows are not in its gate/up linear".into()));
        }
        return MoeLayer::new_w4(m, hidden, router, gate, &parts);
    }
    let base = w.experts.first().map_or(0, |x| x.gate_proj.ptr());
    let ml = MoeLayer::new(m, hidden, router, gate, base);
    let Experts::Bf16 { gate_up, down } = ml.experts else { unreachable!("MoeLayer::new gives bf16 experts") };
    let half = b2(gate_up.n / 2 * gate_up.kdim);
    for (e, x) in w.experts.iter().enumerate() {
        let at = b2(e * gate_up.stride);
        let want = [gate_up.base + at, gate_up.base + at + half, down.base + at];
        let got = [x.gate_proj.ptr(), x.up_proj.ptr(), x.down_proj.ptr()];
        if want != got || !matches!(x.gate_proj, Part::Bf16 { .. }) {
            return Err(CudaError::Weights(format!("expert {e} is not in its layer's bf16 expert block")));
        }
    }
    Ok(ml)
}

fn shared_mismatch() -> CudaError {
    CudaError::Plan("the shared expert's storage is not the routed experts'".into())
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
    /// Rows the per-pair buffers (`moe_gate_up`, `moe_act`, `moe_rows_out`) hold: the plan's tokens × top-k.
    pair_rows: usize,
}

/// A sparse layer's shared expert as it runs with the routed experts' decode GEMVs, one more pair per
/// token ([`crate::CudaOptions::moe_shared_pairs`]): its gate/up and down projections.
/// (A value on the stack for one layer's forward: the int4 variant's size is no cost.)
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Copy, Debug)]
pub(super) enum SharedExpert {
    /// `[2·I, hidden]` and `[hidden, I]` bf16.
    Bf16 {
        gate_up: u64,
        down: u64,
    },
    Int4 {
        gate_up: W4Shared,
        down: W4Shared,
    },
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
        pair_rows: t * k,
    })
}

/// The shared expert of sparse layer `m` (`gate_up`, `down`: the layer's dense MLP parts) where it can run
/// as one more pair of the routed experts' GEMVs: the experts' width and storage — bf16 `[2·I, hidden]`
/// and `[hidden, I]`, or int4 linears of the experts' format whose gate and up halves are whole GEMV
/// blocks ([`W4Shared::fits`]).
pub(super) fn shared_expert(m: &MoeLayer, gate_up: &[Part], down: &[Part], hidden: usize) -> Option<SharedExpert> {
    let i = m.expert_width;
    if m.shared_width != i {
        return None;
    }
    match (&m.experts, gate_up, down) {
        (Experts::Bf16 { .. }, [Part::Bf16 { w: gu, rows: r }], [Part::Bf16 { w: dn, rows: hr }])
            if *r == 2 * i && *hr == hidden =>
        {
            Some(SharedExpert::Bf16 { gate_up: *gu, down: *dn })
        }
        (Experts::Int4 { gate_up: eg, down: ed }, gu, [Part::W4(dn)]) => {
            let gate_up = match gu {
                [Part::W4(a)] => W4Shared { top: *a, bottom: None },
                [Part::W4(a), Part::W4(b)] => W4Shared { top: *a, bottom: Some(*b) },
                _ => return None,
            };
            let down = W4Shared { top: *dn, bottom: None };
            (gate_up.fits(&eg.first) && down.fits(&ed.first)).then_some(SharedExpert::Int4 { gate_up, down })
        }
        _ => None,
    }
}

impl CudaBackend {
    /// The routed experts of layer `m` over the `t` rows of `mlp_in`, added to `mlp_out` as
    /// `mlp_out = Σ_k w_k · expert_k + sigmoid(gate) · S`: S the shared expert's output, which `mlp_out`
    /// holds, or (`shared`: [`Self::shared_pairs`]) computed here with the routed experts' GEMVs.
    pub(super) fn moe(&self, ws: &Ws, m: &MoeLayer, t: usize, shared: Option<SharedExpert>) -> Result<(), CudaError> {
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
        let i = m.expert_width;
        // The shared expert's pairs follow the routed ones: its gate/up reads the tokens' rows, its down
        // the SwiGLU rows after the routed pairs'.
        let rows = pairs + if shared.is_some() { t } else { 0 };
        let swiglu = || elementwise::swiglu(k, s, mw.gate_up, 2 * i, mw.gate_up + b2(i), 2 * i, mw.act, rows, i);
        let gemv = self.moe_gemv(t);
        match (&m.experts, shared) {
            // Decode: each (token, k) pair reads its expert's rows only; the rows stay in pair order.
            (Experts::Bf16 { gate_up, down }, sh_w) if gemv => {
                let (sg, sd) = match sh_w {
                    Some(SharedExpert::Bf16 { gate_up, down }) => (
                        Some(SharedPairs { w: gate_up, tokens: t, x_row: 0 }),
                        Some(SharedPairs { w: down, tokens: t, x_row: pairs }),
                    ),
                    Some(SharedExpert::Int4 { .. }) => return Err(shared_mismatch()),
                    None => (None, None),
                };
                moe::gemv(k, s, ws.mlp_in, top_k, mw.topk, pairs, sg, gate_up, mw.gate_up)?;
                swiglu()?;
                moe::gemv(k, s, mw.act, 1, mw.topk, pairs, sd, down, mw.rows_out)?;
            }
            (Experts::Int4 { gate_up, down }, sh_w) if gemv => {
                let (sg, sd) = match sh_w {
                    Some(SharedExpert::Int4 { gate_up, down }) => (
                        Some(SharedPairs { w: gate_up, tokens: t, x_row: 0 }),
                        Some(SharedPairs { w: down, tokens: t, x_row: pairs }),
                    ),
                    Some(SharedExpert::Bf16 { .. }) => return Err(shared_mismatch()),
                    None => (None, None),
                };
                moe_w4::gemv(k, s, ws.mlp_in, h, top_k, mw.topk, pairs, sg, gate_up, mw.gate_up)?;
                swiglu()?;
                moe_w4::gemv(k, s, mw.act, i, 1, mw.topk, pairs, sd, down, mw.rows_out)?;
            }
            (_, Some(_)) => return Err(CudaError::Plan("the shared expert runs with per-pair GEMVs only".into())),
            (Experts::Bf16 { gate_up, down }, None) => {
                moe::offsets(k, s, mw.topk, pairs, e, moe::TILE_ROWS, mw.offsets, mw.rows)?;
                moe::permute(k, s, ws.mlp_in, mw.rows, t, top_k, h, mw.rows_in)?;
                moe::gemm(k, s, mw.rows_in, mw.offsets, e, pairs, gate_up, mw.gate_up)?;
                swiglu()?;
                moe::gemm(k, s, mw.act, mw.offsets, e, pairs, down, mw.rows_out)?;
            }
            (Experts::Int4 { gate_up, down }, None) => {
                moe::offsets(k, s, mw.topk, pairs, e, moe_w4::TILE_ROWS, mw.offsets, mw.rows)?;
                moe::permute(k, s, ws.mlp_in, mw.rows, t, top_k, h, mw.rows_in)?;
                moe_w4::gemm(k, s, mw.rows_in, mw.offsets, pairs, gate_up, mw.gate_up)?;
                swiglu()?;
                moe_w4::gemm(k, s, mw.act, mw.offsets, pairs, down, mw.rows_out)?;
            }
        }
        let rows_in_order = (!gemv).then_some(mw.rows);
        let shared_out = shared.map(|_| mw.rows_out + b2(pairs * h));
        moe::unpermute(k, s, mw.rows_out, rows_in_order, mw.topk, t, top_k, mw.shared_gate, shared_out, h, ws.mlp_out)?;
        self.tick("MoE experts")
    }

    /// The shared expert of a sparse layer (`gate_up`, `down`: the layer's dense MLP) as one more pair per
    /// token of the routed experts' GEMVs in a step of `t` tokens, where that runs: the option on, a
    /// decode-sized step, one GPU, room for the extra rows in the per-pair buffers, and a shared expert
    /// stored as the experts are ([`shared_expert`]). None: the dense MLP computes it.
    pub(super) fn shared_pairs(
        &self,
        ws: &Ws,
        m: &MoeLayer,
        gate_up: &[Part],
        down: &[Part],
        t: usize,
    ) -> Option<SharedExpert> {
        let mw = ws.moe.as_ref()?;
        let usable =
            self.opts.moe_shared_pairs && self.moe_gemv(t) && t * (m.top_k + 1) <= mw.pair_rows && self.tp.is_none();
        if !usable {
            return None;
        }
        shared_expert(m, gate_up, down, self.d.hidden)
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
    fn the_shared_expert_joins_the_experts_pairs_when_stored_as_they_are() {
        let m = |width: usize, shared: usize| MoeConfig {
            num_experts: 8,
            top_k: 2,
            expert_intermediate: width,
            shared_expert_intermediate: shared,
            norm_topk_prob: true,
            sparse_layers: vec![true],
        };
        let h = 256;
        let bf = |w: u64, rows: usize| Part::Bf16 { w, rows };
        // bf16: the experts' width, gate and up fused.
        let layer = MoeLayer::new(&m(256, 256), h, 1, 2, 4096);
        assert!(matches!(
            shared_expert(&layer, &[bf(1 << 20, 512)], &[bf(2 << 20, h)], h),
            Some(SharedExpert::Bf16 { gate_up: 0x10_0000, down: 0x20_0000 })
        ));
        assert!(shared_expert(&MoeLayer::new(&m(256, 512), h, 1, 2, 4096), &[bf(1, 1024)], &[bf(2, h)], h).is_none());
        // int4: the experts' format; gate and up as two linears need halves of whole blocks (256 rows).
        let w4 =
            |at: u64, out: usize, inp: usize, asym: bool| W4Weights::at(at, out, inp, asym, false, ScaleDtype::F16);
        let experts = |width: usize, asym: bool| {
            let lay = W4ExpertLayout::new(width, h, asym, ScaleDtype::F16);
            let (g, d) = lay.expert(1 << 30, 0);
            let experts = Experts::Int4 {
                gate_up: W4Experts { first: g, stride: lay.stride as u64, count: 8 },
                down: W4Experts { first: d, stride: lay.stride as u64, count: 8 },
            };
            MoeLayer::with(&m(width, width), 1, 2, experts)
        };
        let (gate, up, down) = (
            Part::W4(w4(1 << 20, 256, h, false)),
            Part::W4(w4(2 << 20, 256, h, false)),
            Part::W4(w4(3 << 20, h, 256, false)),
        );
        assert!(matches!(
            shared_expert(&experts(256, false), &[gate, up], &[down], h),
            Some(SharedExpert::Int4 { .. })
        ));
        assert!(shared_expert(&experts(256, true), &[gate, up], &[down], h).is_none(), "zero points differ");
        let stacked = Part::W4(w4(1 << 20, 512, h, false));
        assert!(shared_expert(&experts(256, false), &[stacked], &[down], h).is_some());
        let (g128, u128_, d128) = (
            Part::W4(w4(1 << 20, 128, h, false)),
            Part::W4(w4(2 << 20, 128, h, false)),
            Part::W4(w4(3 << 20, h, 128, false)),
        );
        assert!(shared_expert(&experts(128, false), &[g128, u128_], &[d128], h).is_none(), "halves of 128 rows");
        assert!(shared_expert(&experts(256, false), &[bf(1, 512)], &[down], h).is_none(), "bf16 beside int4 experts");
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
        let Experts::Bf16 { gate_up, down } = MoeLayer::new(&m, 32, 1, 2, 4096).experts else { panic!("bf16") };
        assert_eq!((gate_up.base, gate_up.stride, gate_up.n, gate_up.kdim), (4096, 768, 16, 32));
        assert_eq!((down.base, down.stride, down.n, down.kdim), (4096 + 2 * 16 * 32, 768, 32, 8));
    }
}
