//! The mixture-of-experts MLP of a sparse layer, in f32 and in the order transformers computes it: router
//! logits, softmax, the `top_k` most probable experts (renormalised when the config says so), each chosen
//! expert's SwiGLU MLP weighted by its probability and summed in expert order, plus the shared expert
//! times `sigmoid(x·w_gate)`.

use deltaserve_model::MoeConfig;
use deltaserve_model::weights::{HostTensor, MlpWeights, MoeWeights};

use crate::activation::sigmoid;
use crate::linear::linear;
use crate::model::CpuModel;

/// The experts one token uses, from its router logits `[num_experts]`: `(expert, weight)` for the `top_k`
/// largest softmax probabilities, most probable first (equal logits: the lower expert first). With
/// `norm_topk_prob` the weights are divided by their sum, else they are the plain probabilities.
pub fn route(logits: &[f32], top_k: usize, norm_topk_prob: bool) -> Vec<(usize, f32)> {
    let max = logits.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    let exps: Vec<f32> = logits.iter().map(|&v| (v - max).exp()).collect();
    let sum: f32 = exps.iter().sum();
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
    let mut chosen: Vec<(usize, f32)> = order.iter().take(top_k).map(|&e| (e, exps[e] / sum)).collect();
    if norm_topk_prob {
        let total: f32 = chosen.iter().map(|c| c.1).sum();
        for c in &mut chosen {
            c.1 /= total;
        }
    }
    chosen
}

impl CpuModel {
    /// The MLP of layer `lw`'s kind: the sparse mixture when the layer has experts, else the dense MLP.
    pub(crate) fn ffn(
        &self,
        mlp: &MlpWeights<HostTensor>,
        moe: Option<&MoeWeights<HostTensor>>,
        hn: &[f32],
        t: usize,
    ) -> Vec<f32> {
        match (moe, &self.config.moe) {
            (Some(w), Some(m)) => self.sparse_mlp(m, w, mlp, hn, t),
            _ => self.mlp(mlp, hn, t),
        }
    }

    /// The sparse MLP over `t` rows `hn` `[t, hidden]`; `shared` is the shared expert.
    fn sparse_mlp(
        &self,
        m: &MoeConfig,
        w: &MoeWeights<HostTensor>,
        shared: &MlpWeights<HostTensor>,
        hn: &[f32],
        t: usize,
    ) -> Vec<f32> {
        let h = self.dims.hidden;
        let e_count = m.num_experts;
        let logits = linear(hn, t, &w.router.data, e_count, h);
        // Tokens grouped by expert: (row, weight).
        let mut by_expert: Vec<Vec<(usize, f32)>> = vec![Vec::new(); e_count];
        for r in 0..t {
            for (e, p) in route(&logits[r * e_count..(r + 1) * e_count], m.top_k, m.norm_topk_prob) {
                by_expert[e].push((r, p));
            }
        }
        let mut out = vec![0.0f32; t * h];
        for (e, rows) in by_expert.iter().enumerate().filter(|(_, rows)| !rows.is_empty()) {
            let xs: Vec<f32> = rows.iter().flat_map(|&(r, _)| hn[r * h..(r + 1) * h].iter().copied()).collect();
            let ys = self.mlp(&w.experts[e], &xs, rows.len());
            for (y, &(r, p)) in ys.chunks_exact(h).zip(rows) {
                for (o, v) in out[r * h..(r + 1) * h].iter_mut().zip(y) {
                    *o += v * p;
                }
            }
        }
        let shared_out = self.mlp(shared, hn, t);
        let gate = linear(hn, t, &w.shared_expert_gate.data, 1, h);
        for ((o, s), g) in out.chunks_exact_mut(h).zip(shared_out.chunks_exact(h)).zip(&gate) {
            let g = sigmoid(*g);
            for (a, b) in o.iter_mut().zip(s) {
                *a += g * b;
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::route;

    #[test]
    fn route_picks_the_largest_and_renormalises_only_when_asked() {
        let logits = [0.0f32, 2.0, 1.0, -1.0];
        let z: f32 = logits.iter().map(|v| v.exp()).sum();
        let plain = route(&logits, 2, false);
        assert_eq!(plain.iter().map(|c| c.0).collect::<Vec<_>>(), vec![1, 2]);
        assert!((plain[0].1 - 2f32.exp() / z).abs() < 1e-6 && (plain[1].1 - 1f32.exp() / z).abs() < 1e-6);
        let norm = route(&logits, 2, true);
        let s = 2f32.exp() + 1f32.exp();
        assert!((norm[0].1 - 2f32.exp() / s).abs() < 1e-6 && (norm[1].1 - 1f32.exp() / s).abs() < 1e-6);
        assert!((norm.iter().map(|c| c.1).sum::<f32>() - 1.0).abs() < 1e-6);
    }

    #[test]
    fn route_breaks_ties_towards_the_lower_expert() {
        assert_eq!(route(&[1.0, 3.0, 3.0, 0.0], 1, true), vec![(1, 1.0)]);
        assert_eq!(route(&[5.0; 4], 4, false).iter().map(|c| c.0).collect::<Vec<_>>(), vec![0, 1, 2, 3]);
    }
}
