//! The f32 reference forward pass of the Qwen3.5/3.6 text model, one sequence at a time, written
//! to be read next to `docs/architecture.md` (§2). [`CpuModel::forward`] runs any number of new tokens
//! of one sequence against its [`SequenceState`] (DeltaNet conv + recurrent state, attention KV),
//! so a prompt can be fed in pieces of any size and then decoded token by token.
//!
//! Speculative decoding pieces: [`CpuModel::forward_hidden`] returns the post-final-norm hidden rows
//! (the MTP head's input), [`CpuModel::mtp_forward`] runs the MTP head (docs/architecture.md §2.5), and a cache
//! that asks for it ([`SeqCache::wants_gdn_trace`]) receives each DeltaNet layer's recurrence inputs
//! ([`GdnTrace`]), which [`CpuModel::replay_gdn`] applies to a committed state for an accepted prefix.
//!
//! Attention rotates q and k by each token's [`Positions`]: text tokens at `first + i`, a prompt with
//! images at its (t, h, w) M-RoPE positions (see [`crate::multimodal`]); a sequence that has seen images
//! keeps its rope delta ([`SequenceState::rope_delta`]) so that later tokens continue from them.

use std::path::Path;

use deltaserve_model::weights::{
    AttentionWeights, DeltaNetWeights, HostTensor, LayerWeights, MixerWeights, MlpWeights,
};
use deltaserve_model::{Checkpoint, Dims, LayerKind, ModelConfig, ModelError, ModelWeights, VisionWeights};

use crate::activation::{sigmoid, silu, softplus};
use crate::attention::causal_gqa_attention;
use crate::conv::causal_conv1d_silu;
use crate::gdn::{GdnDims, GdnInputs, gdn_chunked, gdn_recurrent, gdn_recurrent_bf16_state};
use crate::kvquant::round_bf16_slice;
use crate::linear::linear;
use crate::norm::{gated_rms_norm, l2_norm, rms_norm_1p};
use crate::rope::{apply_mrope, apply_partial_rope};

/// Chunk length of the WY-form DeltaNet prefill.
pub use deltaserve_plan::workspace::GDN_CHUNK;

/// How the DeltaNet core runs over a call's tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GdnMode {
    /// Chunked WY form for calls of more than one token, recurrence for one token (as HF does).
    Auto,
    /// Token-by-token recurrence for every call.
    Recurrent,
}

/// Which positions' logits a forward call returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    /// [t, vocab] for every new token.
    All,
    /// [1, vocab] for the last new token only.
    Last,
}

/// The rotary positions of a forward call's tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Positions<'a> {
    /// Token i at `first + i` in every stream (text).
    Sequential(usize),
    /// Token i at the (t, h, w) position `[i]` (M-RoPE: a prompt with images).
    Mrope(&'a [[usize; 3]]),
}

/// Per-layer carried state of one sequence.
#[derive(Clone, Debug)]
pub enum LayerState {
    DeltaNet {
        /// [kernel − 1, conv_channels]: the last inputs of the short convolution.
        conv: Vec<f32>,
        /// [Hv, dk, dv] f32 recurrent state.
        recurrent: Vec<f32>,
    },
    Attention {
        /// [len, kv_heads, head_dim] after RoPE and k_norm.
        k: Vec<f32>,
        /// [len, kv_heads, head_dim]
        v: Vec<f32>,
    },
}

/// Everything a sequence carries between forward calls.
#[derive(Clone, Debug)]
pub struct SequenceState {
    /// Tokens processed so far (the index of the next token).
    pub len: usize,
    /// Rotary position of token index `i` minus `i` once images have been seen (HF's rope delta, ≤ 0);
    /// 0 for text.
    pub rope_delta: i64,
    pub layers: Vec<LayerState>,
}

impl SequenceState {
    /// The rotary position of the next token.
    pub fn next_position(&self) -> usize {
        (self.len as i64 + self.rope_delta).max(0) as usize
    }
}

/// Where one sequence's carried state lives: a [`SequenceState`] of its own, or pages and a slot of
/// the paged backend's arena. Layer indices are absolute decoder-layer indices.
pub trait SeqCache {
    /// DeltaNet layer `layer`: (conv state [kernel − 1, conv_channels], recurrent state [Hv, dk, dv]).
    fn deltanet_state(&mut self, layer: usize) -> (&mut [f32], &mut [f32]);
    /// Stores K and V rows ([t, kv_heads·head_dim] each) of attention layer `layer` at positions `start..start + t`.
    fn write_kv(&mut self, layer: usize, start: usize, k: &[f32], v: &[f32]);
    /// K and V rows of positions `0..len` of attention layer `layer`, contiguous.
    fn read_kv(&self, layer: usize, len: usize) -> (Vec<f32>, Vec<f32>);
    /// Whether the DeltaNet recurrent state is stored bf16: a layer's state is rounded to bf16 after each
    /// update (what a bf16 state slot holds; the recurrence itself runs in f32).
    fn state_bf16(&self) -> bool {
        false
    }
    /// Whether DeltaNet layers should hand their recurrence inputs to [`SeqCache::record_gdn_trace`].
    fn wants_gdn_trace(&self) -> bool {
        false
    }
    /// Receives DeltaNet layer `layer`'s recurrence inputs of this call (when [`SeqCache::wants_gdn_trace`]).
    fn record_gdn_trace(&mut self, layer: usize, trace: GdnTrace) {
        let _ = (layer, trace);
    }
}

/// The inputs of one DeltaNet layer's state update for the `t` tokens of a call: enough to advance a
/// state by any prefix of them with exactly the arithmetic of the call ([`CpuModel::replay_gdn`]).
#[derive(Clone, Debug, Default)]
pub struct GdnTrace {
    /// [t, conv_channels]: the short convolution's inputs (its state is the last kernel − 1 of them).
    pub mixed: Vec<f32>,
    /// [t, Hk, dk] (normalised, q scaled), [t, Hk, dk], [t, Hv, dv], [t, Hv], [t, Hv].
    pub q: Vec<f32>,
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    pub g: Vec<f32>,
    pub beta: Vec<f32>,
}

impl SeqCache for SequenceState {
    fn deltanet_state(&mut self, layer: usize) -> (&mut [f32], &mut [f32]) {
        match &mut self.layers[layer] {
            LayerState::DeltaNet { conv, recurrent } => (conv, recurrent),
            LayerState::Attention { .. } => unreachable!("layer {layer} is an attention layer"),
        }
    }
    fn write_kv(&mut self, layer: usize, start: usize, k: &[f32], v: &[f32]) {
        match &mut self.layers[layer] {
            LayerState::Attention { k: kc, v: vc } => {
                // Rows are appended in position order, so `start` rows are already stored.
                let _ = start;
                kc.extend_from_slice(k);
                vc.extend_from_slice(v);
            }
            LayerState::DeltaNet { .. } => unreachable!("layer {layer} is a DeltaNet layer"),
        }
    }
    fn read_kv(&self, layer: usize, len: usize) -> (Vec<f32>, Vec<f32>) {
        match &self.layers[layer] {
            LayerState::Attention { k, v } => {
                let width = k.len() / len.max(1);
                (k[..len * width].to_vec(), v[..len * width].to_vec())
            }
            LayerState::DeltaNet { .. } => unreachable!("layer {layer} is a DeltaNet layer"),
        }
    }
}

/// The reference model: config, derived dims and f32 weights (the vision tower's when loaded).
pub struct CpuModel {
    pub config: ModelConfig,
    pub dims: Dims,
    pub weights: ModelWeights<HostTensor>,
    /// The vision tower; `None` for a text-only model or when it was not loaded.
    pub vision: Option<VisionWeights<HostTensor>>,
}

/// Errors of a forward call (bad input, never a panic).
#[derive(Debug, thiserror::Error)]
pub enum ForwardError {
    #[error("token id {id} at position {index} is outside the vocabulary (size {vocab})")]
    TokenOutOfRange { id: u32, index: usize, vocab: usize },
    #[error("the sequence state does not belong to this model")]
    StateMismatch,
    #[error(transparent)]
    Gdn(#[from] crate::gdn::GdnError),
    #[error("this model has no MTP head (no `mtp.*` tensors, or `mtp_num_hidden_layers` is 0)")]
    NoMtpHead,
    #[error("speculative decoding: {0}")]
    Speculation(String),
    #[error("MTP input mismatch: {tokens} tokens but {rows} hidden rows")]
    MtpInput { tokens: usize, rows: usize },
    #[error("this model has no vision tower loaded: images are not accepted")]
    NoVisionTower,
    #[error(transparent)]
    Image(#[from] crate::vision::ImageError),
    #[error("images: {0}")]
    Multimodal(String),
}

impl CpuModel {
    pub fn new(config: ModelConfig, weights: ModelWeights<HostTensor>) -> Self {
        Self { dims: config.dims(), config, weights, vision: None }
    }

    /// The model in checkpoint directory `dir`: its config and f32 weights, without a vision tower.
    pub fn load(dir: &Path) -> Result<Self, ModelError> {
        let config = ModelConfig::from_dir(dir)?;
        let weights = ModelWeights::load_f32(&Checkpoint::open(dir)?, &config)?;
        Ok(Self::new(config, weights))
    }

    /// The model with its vision tower (`None`: images are refused).
    pub fn with_vision(mut self, vision: Option<VisionWeights<HostTensor>>) -> Self {
        self.vision = vision;
        self
    }

    /// A fresh (empty) sequence.
    pub fn new_sequence(&self) -> SequenceState {
        let d = &self.dims;
        let layers = self
            .config
            .layer_types
            .iter()
            .map(|k| match k {
                LayerKind::DeltaNet => LayerState::DeltaNet {
                    conv: vec![0.0; (d.conv_kernel - 1) * d.conv_channels],
                    recurrent: vec![0.0; d.gdn_v_heads * d.gdn_k_dim * d.gdn_v_dim],
                },
                LayerKind::Attention => LayerState::Attention { k: Vec::new(), v: Vec::new() },
            })
            .collect();
        SequenceState { len: 0, rope_delta: 0, layers }
    }

    /// Runs `tokens` (the next tokens of the sequence) and returns logits, row-major.
    pub fn forward(
        &self,
        state: &mut SequenceState,
        tokens: &[u32],
        mode: GdnMode,
        want: Logits,
    ) -> Result<Vec<f32>, ForwardError> {
        if state.layers.len() != self.dims.num_layers {
            return Err(ForwardError::StateMismatch);
        }
        let (start, first) = (state.len, state.next_position());
        let rows = self.run_layers(state, start, self.embed_checked(tokens)?, Positions::Sequential(first), mode)?;
        state.len += tokens.len();
        Ok(self.logits_of(&rows, want))
    }

    /// Runs `tokens` at positions `start..` of a sequence whose state lives in `cache`.
    pub fn forward_cached(
        &self,
        cache: &mut dyn SeqCache,
        start: usize,
        tokens: &[u32],
        mode: GdnMode,
        want: Logits,
    ) -> Result<Vec<f32>, ForwardError> {
        let rows = self.forward_hidden(cache, start, tokens, mode)?;
        Ok(self.logits_of(&rows, want))
    }

    /// The logits `want` asks for of hidden rows `[t, hidden]`.
    pub(crate) fn logits_of(&self, rows: &[f32], want: Logits) -> Vec<f32> {
        let h = self.dims.hidden;
        match want {
            Logits::All => self.logits(rows),
            Logits::Last if rows.is_empty() => Vec::new(),
            Logits::Last => self.logits(&rows[rows.len() - h..]),
        }
    }

    /// Runs `tokens` at positions `start..` and returns the post-final-norm hidden rows `[t, hidden]`
    /// (what the lm_head and the MTP head read).
    pub fn forward_hidden(
        &self,
        cache: &mut dyn SeqCache,
        start: usize,
        tokens: &[u32],
        mode: GdnMode,
    ) -> Result<Vec<f32>, ForwardError> {
        self.run_layers(cache, start, self.embed_checked(tokens)?, Positions::Sequential(start), mode)
    }

    /// The decoder over input rows `x` `[t, hidden]` (token embeddings, image rows in place of image
    /// tokens) at KV indices `start..` and rotary positions `pos`; returns the post-final-norm rows.
    pub(crate) fn run_layers(
        &self,
        cache: &mut dyn SeqCache,
        start: usize,
        mut x: Vec<f32>,
        pos: Positions<'_>,
        mode: GdnMode,
    ) -> Result<Vec<f32>, ForwardError> {
        let d = &self.dims;
        let t = x.len() / d.hidden;
        if t == 0 {
            return Ok(Vec::new());
        }
        let eps = self.config.rms_norm_eps;
        for (i, lw) in self.weights.layers.iter().enumerate() {
            let mut hn = x.clone();
            rms_norm_1p(&mut hn, &lw.input_norm.data, eps);
            let mixed = match &lw.mixer {
                MixerWeights::DeltaNet(w) => {
                    let (trace, bf16_state) = (cache.wants_gdn_trace(), cache.state_bf16());
                    let (conv, recurrent) = cache.deltanet_state(i);
                    let (out, tr) = self.deltanet(w, &hn, t, (conv, recurrent, bf16_state), mode, trace)?;
                    if let Some(tr) = tr {
                        cache.record_gdn_trace(i, tr);
                    }
                    out
                }
                MixerWeights::Attention(w) => self.attention(w, &hn, t, start, pos, i, cache),
            };
            add_in_place(&mut x, &mixed);
            let mut hn = x.clone();
            rms_norm_1p(&mut hn, &lw.post_norm.data, eps);
            add_in_place(&mut x, &self.ffn(&lw.mlp, lw.moe.as_ref(), &hn, t));
        }
        rms_norm_1p(&mut x, &self.weights.final_norm.data, eps);
        debug_assert_eq!(x.len(), t * d.hidden);
        Ok(x)
    }

    /// Logits `[n, vocab]` of hidden rows `[n, hidden]` (the shared lm_head).
    pub fn logits(&self, rows: &[f32]) -> Vec<f32> {
        let (h, v) = (self.dims.hidden, self.dims.vocab);
        linear(rows, rows.len() / h, &self.weights.lm_head().data, v, h)
    }

    /// True when the weights include an MTP head.
    pub fn has_mtp(&self) -> bool {
        self.weights.mtp.is_some()
    }

    /// The MTP head over `t` positions `start..start + t` of its own cache (attention layer index
    /// `kv_layer` of `cache`): row i combines `hidden` row i (the main model's post-norm hidden of the
    /// previous position, or the head's own output when drafting) with the embedding of `tokens[i]`.
    /// Returns the post-`mtp.norm` rows `[t, hidden]`; their logits predict the token after `tokens[i]`.
    pub fn mtp_forward(
        &self,
        cache: &mut dyn SeqCache,
        kv_layer: usize,
        start: usize,
        hidden: &[f32],
        tokens: &[u32],
    ) -> Result<Vec<f32>, ForwardError> {
        self.mtp_forward_at(cache, kv_layer, start, Positions::Sequential(start), hidden, tokens)
    }

    /// [`CpuModel::mtp_forward`] with q and k rotated at `pos` (a sequence with images: its M-RoPE
    /// positions, or its text positions offset by the rope delta).
    pub fn mtp_forward_at(
        &self,
        cache: &mut dyn SeqCache,
        kv_layer: usize,
        start: usize,
        pos: Positions<'_>,
        hidden: &[f32],
        tokens: &[u32],
    ) -> Result<Vec<f32>, ForwardError> {
        let mtp = self.weights.mtp.as_ref().ok_or(ForwardError::NoMtpHead)?;
        self.check_tokens(tokens)?;
        let (h, t) = (self.dims.hidden, tokens.len());
        if hidden.len() != t * h {
            return Err(ForwardError::MtpInput { tokens: t, rows: hidden.len() / h.max(1) });
        }
        if t == 0 {
            return Ok(Vec::new());
        }
        let eps = self.config.rms_norm_eps;
        let mut e = self.embed(tokens);
        rms_norm_1p(&mut e, &mtp.pre_fc_norm_embedding.data, eps);
        let mut hn = hidden.to_vec();
        rms_norm_1p(&mut hn, &mtp.pre_fc_norm_hidden.data, eps);
        // fc input rows: [normed embedding | normed hidden].
        let mut cat = Vec::with_capacity(t * 2 * h);
        for (er, hr) in e.chunks_exact(h).zip(hn.chunks_exact(h)) {
            cat.extend_from_slice(er);
            cat.extend_from_slice(hr);
        }
        let mut x = linear(&cat, t, &mtp.fc.data, h, 2 * h);
        let LayerWeights { input_norm, post_norm, mixer, mlp, moe } = &mtp.layer;
        let MixerWeights::Attention(aw) = mixer else { unreachable!("the MTP layer is an attention layer") };
        let mut a = x.clone();
        rms_norm_1p(&mut a, &input_norm.data, eps);
        add_in_place(&mut x, &self.attention(aw, &a, t, start, pos, kv_layer, cache));
        let mut a = x.clone();
        rms_norm_1p(&mut a, &post_norm.data, eps);
        add_in_place(&mut x, &self.ffn(mlp, moe.as_ref(), &a, t));
        rms_norm_1p(&mut x, &mtp.norm.data, eps);
        Ok(x)
    }

    /// Advances a DeltaNet layer's committed state (`conv`, `recurrent`; `bf16_state`: stored bf16) by the
    /// first `n` tokens of `trace`, with the recurrence (the arithmetic of token-by-token decode).
    pub fn replay_gdn(
        &self,
        trace: &GdnTrace,
        n: usize,
        (conv, recurrent, bf16_state): (&mut [f32], &mut [f32], bool),
    ) -> Result<(), ForwardError> {
        let d = &self.dims;
        let layer_w = self.weights.layers.iter().find_map(|l| match &l.mixer {
            MixerWeights::DeltaNet(w) => Some(w),
            MixerWeights::Attention(_) => None,
        });
        let Some(w) = layer_w else { return Ok(()) };
        // Conv taps do not change the state update (it keeps the last inputs), any layer's will do.
        let _ = causal_conv1d_silu(
            &trace.mixed[..n * d.conv_channels],
            d.conv_channels,
            &w.conv1d.data,
            d.conv_kernel,
            conv,
        );
        let (hk, hv, dk, dv) = (d.gdn_k_heads, d.gdn_v_heads, d.gdn_k_dim, d.gdn_v_dim);
        let dims = GdnDims { num_k_heads: hk, num_v_heads: hv, head_k_dim: dk, head_v_dim: dv };
        let inputs = GdnInputs {
            q: &trace.q[..n * hk * dk],
            k: &trace.k[..n * hk * dk],
            v: &trace.v[..n * hv * dv],
            g: &trace.g[..n * hv],
            beta: &trace.beta[..n * hv],
        };
        let mut o = vec![0.0f32; n * d.gdn_value_width];
        recurrence(dims, &inputs, recurrent, &mut o, bf16_state)?;
        Ok(())
    }

    fn check_tokens(&self, tokens: &[u32]) -> Result<(), ForwardError> {
        let vocab = self.dims.vocab;
        match tokens.iter().enumerate().find(|(_, id)| **id as usize >= vocab) {
            Some((index, &id)) => Err(ForwardError::TokenOutOfRange { id, index, vocab }),
            None => Ok(()),
        }
    }

    /// Embedding rows `[t, hidden]` of checked token ids.
    pub(crate) fn embed_checked(&self, tokens: &[u32]) -> Result<Vec<f32>, ForwardError> {
        self.check_tokens(tokens)?;
        Ok(self.embed(tokens))
    }

    /// Embedding rows `[t, hidden]`.
    fn embed(&self, tokens: &[u32]) -> Vec<f32> {
        let h = self.dims.hidden;
        let mut x = Vec::with_capacity(tokens.len() * h);
        for &id in tokens {
            x.extend_from_slice(&self.weights.embed.data[id as usize * h..][..h]);
        }
        x
    }

    /// Gated DeltaNet mixer (docs/architecture.md §2.2). hn: [t, hidden] → [t, hidden]; with `trace`, also the
    /// recurrence inputs.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn deltanet(
        &self,
        w: &DeltaNetWeights<HostTensor>,
        hn: &[f32],
        t: usize,
        (conv_state, recurrent, bf16_state): (&mut [f32], &mut [f32], bool),
        mode: GdnMode,
        trace: bool,
    ) -> Result<(Vec<f32>, Option<GdnTrace>), ForwardError> {
        let d = &self.dims;
        let (hk, hv, dk, dv) = (d.gdn_k_heads, d.gdn_v_heads, d.gdn_k_dim, d.gdn_v_dim);
        let mixed = linear(hn, t, &w.in_proj_qkv.data, d.conv_channels, d.hidden);
        let z = linear(hn, t, &w.in_proj_z.data, d.gdn_value_width, d.hidden);
        let b = linear(hn, t, &w.in_proj_b.data, hv, d.hidden);
        let a = linear(hn, t, &w.in_proj_a.data, hv, d.hidden);
        let c = causal_conv1d_silu(&mixed, d.conv_channels, &w.conv1d.data, d.conv_kernel, conv_state);

        // Split each token's conv output into q [Hk·dk] | k [Hk·dk] | v [Hv·dv].
        let kw = d.gdn_key_width;
        let mut q = Vec::with_capacity(t * kw);
        let mut k = Vec::with_capacity(t * kw);
        let mut v = Vec::with_capacity(t * d.gdn_value_width);
        for row in c.chunks_exact(d.conv_channels) {
            q.extend_from_slice(&row[..kw]);
            k.extend_from_slice(&row[kw..2 * kw]);
            v.extend_from_slice(&row[2 * kw..]);
        }
        l2_norm(&mut q, dk, 1e-6);
        l2_norm(&mut k, dk, 1e-6);
        let q_scale = 1.0 / (dk as f32).sqrt();
        q.iter_mut().for_each(|x| *x *= q_scale);
        let beta: Vec<f32> = b.iter().map(|&x| sigmoid(x)).collect();
        let g: Vec<f32> = a
            .iter()
            .enumerate()
            .map(|(i, &x)| {
                let head = i % hv;
                -w.a_log.data[head].exp() * softplus(x + w.dt_bias.data[head])
            })
            .collect();

        let dims = GdnDims { num_k_heads: hk, num_v_heads: hv, head_k_dim: dk, head_v_dim: dv };
        let inputs = GdnInputs { q: &q, k: &k, v: &v, g: &g, beta: &beta };
        let mut o = vec![0.0f32; t * d.gdn_value_width];
        // A bf16 state slot: rounded after every token of the recurrence, at the end of a chunked prefill.
        if mode == GdnMode::Recurrent || t == 1 {
            recurrence(dims, &inputs, recurrent, &mut o, bf16_state)?;
        } else {
            gdn_chunked(dims, GDN_CHUNK, &inputs, recurrent, &mut o)?;
            if bf16_state {
                round_bf16_slice(recurrent);
            }
        }
        gated_rms_norm(&mut o, &z, &w.norm.data, self.config.rms_norm_eps);
        let out = linear(&o, t, &w.out_proj.data, d.hidden, d.gdn_value_width);
        let trace = trace.then_some(GdnTrace { mixed, q, k, v, g, beta });
        Ok((out, trace))
    }

    /// Gated softmax attention (docs/architecture.md §2.3). hn: [t, hidden] → [t, hidden]; appends to the KV
    /// cache at rows `past..`, q and k rotated by `pos`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn attention(
        &self,
        w: &AttentionWeights<HostTensor>,
        hn: &[f32],
        t: usize,
        past: usize,
        pos: Positions<'_>,
        layer: usize,
        cache: &mut dyn SeqCache,
    ) -> Vec<f32> {
        let d = &self.dims;
        let (nh, nkv, hd) = (d.q_heads, d.kv_heads, d.head_dim);
        let eps = self.config.rms_norm_eps;
        // q_proj rows are per head [q (hd) | gate (hd)].
        let qg = linear(hn, t, &w.q_proj.data, 2 * d.attn_dim, d.hidden);
        let mut q = Vec::with_capacity(t * d.attn_dim);
        let mut gate = Vec::with_capacity(t * d.attn_dim);
        for head in qg.chunks_exact(2 * hd) {
            q.extend_from_slice(&head[..hd]);
            gate.extend_from_slice(&head[hd..]);
        }
        let mut k = linear(hn, t, &w.k_proj.data, d.kv_dim, d.hidden);
        let v = linear(hn, t, &w.v_proj.data, d.kv_dim, d.hidden);
        rms_norm_1p(&mut q, &w.q_norm.data, eps);
        rms_norm_1p(&mut k, &w.k_norm.data, eps);
        let (theta, rot) = (self.config.rope_theta, d.rotary_dim);
        match pos {
            Positions::Sequential(first) => {
                apply_partial_rope(&mut q, nh, hd, rot, theta, first);
                apply_partial_rope(&mut k, nkv, hd, rot, theta, first);
            }
            Positions::Mrope(p) => {
                let section = self.config.mrope_section;
                apply_mrope(&mut q, nh, hd, rot, theta, section, p);
                apply_mrope(&mut k, nkv, hd, rot, theta, section, p);
            }
        }
        cache.write_kv(layer, past, &k, &v);
        let (k_all, v_all) = cache.read_kv(layer, past + t);
        let mut attn = causal_gqa_attention(&q, &k_all, &v_all, nh, nkv, hd);
        for (o, g) in attn.iter_mut().zip(&gate) {
            *o *= sigmoid(*g);
        }
        linear(&attn, t, &w.o_proj.data, d.hidden, d.attn_dim)
    }

    /// SwiGLU MLP: down(silu(gate·x) ⊙ up·x), at the width of its weights (a dense MLP, an expert).
    pub(crate) fn mlp(&self, w: &MlpWeights<HostTensor>, hn: &[f32], t: usize) -> Vec<f32> {
        let h = self.dims.hidden;
        let width = w.gate_proj.shape[0];
        let mut gate = linear(hn, t, &w.gate_proj.data, width, h);
        let up = linear(hn, t, &w.up_proj.data, width, h);
        for (g, u) in gate.iter_mut().zip(&up) {
            *g = silu(*g) * u;
        }
        linear(&gate, t, &w.down_proj.data, h, width)
    }
}

fn add_in_place(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

/// The token-by-token recurrence (the arithmetic of decode); `bf16_state`: the state rounded to bf16
/// after every token, as a bf16 state slot keeps it.
fn recurrence(
    dims: GdnDims,
    inputs: &GdnInputs,
    state: &mut [f32],
    out: &mut [f32],
    bf16_state: bool,
) -> Result<(), crate::gdn::GdnError> {
    match bf16_state {
        true => gdn_recurrent_bf16_state(dims, inputs, state, out),
        false => gdn_recurrent(dims, inputs, state, out),
    }
}
