//! Tensor parallelism simulated on the CPU: the model split into `world` rank models, each holding
//! only its shards ([`deltaserve_model::shard`]) in f32, run in lock step with explicit in-memory
//! collectives where a multi-GPU run has NCCL calls:
//!
//! - embedding: each rank embeds the ids in its vocabulary range (zero rows otherwise), then
//!   **all-reduce** (sum);
//! - per layer: the replicated residual stream is normed on every rank; the mixer (attention heads /
//!   DeltaNet key-head groups of the rank) gives a partial `o_proj` / `out_proj` output, **all-reduce**;
//!   the MLP (the rank's intermediate range) gives a partial `down_proj` output, **all-reduce**;
//! - lm_head: each rank's vocabulary range of the logits, **all-gather** along the vocabulary.
//!
//! A rank model is a [`CpuModel`] of the rank's shape ([`ShardSpec::rank_config`]), so the mixer and
//! MLP arithmetic is the reference model's own; only the sums of the row-parallel projections are
//! split (rank partials added in rank order), so TP=1 is bit-identical to [`CpuModel::forward`] and
//! TP>1 differs by f32 rounding of those sums.

use deltaserve_model::shard::ShardSpec;
use deltaserve_model::weights::{HostTensor, MixerWeights};
use deltaserve_model::{ModelConfig, ModelError, ModelWeights};

use crate::linear::linear;
use crate::model::{CpuModel, ForwardError, GdnMode, LayerState, Logits, Positions, SequenceState};
use crate::norm::rms_norm_1p;

/// One rank: its shard ranges and its model (the rank's shape, the rank's weights).
pub struct TpRank {
    pub spec: ShardSpec,
    pub model: CpuModel,
}

/// The model split over `world` simulated ranks.
pub struct TpModel {
    /// The full model's config.
    pub config: ModelConfig,
    pub world: usize,
    pub ranks: Vec<TpRank>,
}

/// One sequence's carried state on every rank (each rank holds its heads' KV and DeltaNet state).
#[derive(Clone, Debug)]
pub struct TpSequence {
    pub len: usize,
    pub ranks: Vec<SequenceState>,
}

/// Sums the per-rank buffers element-wise (in rank order) and leaves the sum in every one of them,
/// as an in-place NCCL all-reduce (sum) does.
pub fn all_reduce_sum(bufs: &mut [Vec<f32>]) {
    let Some((first, rest)) = bufs.split_first_mut() else { return };
    for b in rest.iter() {
        for (a, x) in first.iter_mut().zip(b) {
            *a += x;
        }
    }
    for b in rest.iter_mut() {
        b.copy_from_slice(first);
    }
}

/// All-gather along the last dim: rank `r` holds `[rows, n_r]`; the result is `[rows, Σ n_r]` with
/// rank 0's columns first.
pub fn all_gather_cols(parts: &[Vec<f32>], rows: usize) -> Vec<f32> {
    let widths: Vec<usize> = parts.iter().map(|p| p.len().checked_div(rows).unwrap_or(0)).collect();
    let mut out = Vec::with_capacity(parts.iter().map(Vec::len).sum());
    for row in 0..rows {
        for (p, &w) in parts.iter().zip(&widths) {
            out.extend_from_slice(&p[row * w..(row + 1) * w]);
        }
    }
    out
}

impl TpModel {
    /// Splits full f32 weights over `world` ranks (1, 2, 4 or 8; it must divide the attention kv heads
    /// and the DeltaNet key heads).
    pub fn new(config: &ModelConfig, weights: &ModelWeights<HostTensor>, world: usize) -> Result<Self, ModelError> {
        let ranks = ShardSpec::all(config, world)?
            .into_iter()
            .map(|spec| {
                let w = spec.shard_weights(weights)?;
                let model = CpuModel::new(spec.rank_config(config), w);
                Ok(TpRank { spec, model })
            })
            .collect::<Result<Vec<_>, ModelError>>()?;
        Ok(Self { config: config.clone(), world, ranks })
    }

    /// [`Self::new`] from a loaded reference model.
    pub fn from_model(m: &CpuModel, world: usize) -> Result<Self, ModelError> {
        Self::new(&m.config, &m.weights, world)
    }

    /// A fresh sequence on every rank.
    pub fn new_sequence(&self) -> TpSequence {
        TpSequence { len: 0, ranks: self.ranks.iter().map(|r| r.model.new_sequence()).collect() }
    }

    /// Runs `tokens` (the next tokens of the sequence) on all ranks and returns the gathered logits,
    /// row-major over the full vocabulary (as [`CpuModel::forward`]).
    pub fn forward(
        &self,
        seq: &mut TpSequence,
        tokens: &[u32],
        mode: GdnMode,
        want: Logits,
    ) -> Result<Vec<f32>, ForwardError> {
        let vocab = self.config.vocab_size;
        if let Some((index, &id)) = tokens.iter().enumerate().find(|(_, id)| **id as usize >= vocab) {
            return Err(ForwardError::TokenOutOfRange { id, index, vocab });
        }
        let n_layers = self.config.layer_types.len();
        if seq.ranks.len() != self.world || seq.ranks.iter().any(|s| s.layers.len() != n_layers) {
            return Err(ForwardError::StateMismatch);
        }
        let t = tokens.len();
        if t == 0 {
            return Ok(Vec::new());
        }
        let h = self.config.hidden_size;
        let eps = self.config.rms_norm_eps;
        let start = seq.len;

        // Vocabulary-sharded embedding, then all-reduce.
        let mut xs: Vec<Vec<f32>> = self
            .ranks
            .iter()
            .map(|r| {
                let mut x = vec![0.0f32; t * h];
                for (row, &id) in x.chunks_exact_mut(h).zip(tokens) {
                    let id = id as usize;
                    if r.spec.vocab.contains(&id) {
                        let local = id - r.spec.vocab.start;
                        row.copy_from_slice(&r.model.weights.embed.data[local * h..(local + 1) * h]);
                    }
                }
                x
            })
            .collect();
        all_reduce_sum(&mut xs);

        for i in 0..n_layers {
            // Mixer: partial o_proj / out_proj outputs, all-reduce, residual add.
            let mut parts = Vec::with_capacity(self.world);
            for ((r, x), st) in self.ranks.iter().zip(&xs).zip(seq.ranks.iter_mut()) {
                let lw = &r.model.weights.layers[i];
                let mut hn = x.clone();
                rms_norm_1p(&mut hn, &lw.input_norm.data, eps);
                let part = match (&lw.mixer, &mut st.layers[i]) {
                    (MixerWeights::DeltaNet(w), LayerState::DeltaNet { conv, recurrent }) => {
                        r.model.deltanet(w, &hn, t, (conv, recurrent, false), mode, false)?.0
                    }
                    (MixerWeights::Attention(w), LayerState::Attention { .. }) => {
                        r.model.attention(w, &hn, t, start, Positions::Sequential(start), i, st)
                    }
                    _ => return Err(ForwardError::StateMismatch),
                };
                parts.push(part);
            }
            all_reduce_sum(&mut parts);
            for (x, p) in xs.iter_mut().zip(&parts) {
                add_in_place(x, p);
            }
            // MLP: partial down_proj outputs, all-reduce, residual add.
            let mut parts = Vec::with_capacity(self.world);
            for (r, x) in self.ranks.iter().zip(&xs) {
                let lw = &r.model.weights.layers[i];
                let mut hn = x.clone();
                rms_norm_1p(&mut hn, &lw.post_norm.data, eps);
                parts.push(r.model.mlp(&lw.mlp, &hn, t));
            }
            all_reduce_sum(&mut parts);
            for (x, p) in xs.iter_mut().zip(&parts) {
                add_in_place(x, p);
            }
        }

        // Final norm (replicated), vocabulary-sharded lm_head, all-gather of the logits.
        let rows = match want {
            Logits::All => t,
            Logits::Last => 1,
        };
        let parts: Vec<Vec<f32>> = self
            .ranks
            .iter()
            .zip(&mut xs)
            .map(|(r, x)| {
                rms_norm_1p(x, &r.model.weights.final_norm.data, eps);
                let x = &x[(t - rows) * h..];
                linear(x, rows, &r.model.weights.lm_head().data, r.spec.vocab.len(), h)
            })
            .collect();
        seq.len += t;
        for st in &mut seq.ranks {
            st.len += t;
        }
        Ok(all_gather_cols(&parts, rows))
    }
}

fn add_in_place(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}
