//! The activation workspace of one engine step, planned by liveness once, at plan time.
//!
//! The step is written as an op list: upload the step inputs, embed, ONE layer section, then final norm,
//! lm_head and sampling. The layer section holds the ops of a DeltaNet mixer, then those of an attention mixer
//! (a layer runs one of the two), then the MLP. Each buffer lives from the first op that touches it to the last;
//! a buffer that is live when the layer section starts (the residual stream, the step inputs) stays live to its
//! end, because the section repeats for every layer. The step inputs go first, back to back from offset 0 (one
//! upload fills them all). The other buffers are then placed first-fit by lifetime (largest first, at the lowest
//! 256-byte aligned offset that overlaps no placed buffer whose lifetime overlaps), as `ggml-alloc` does at run
//! time, but once.
//!
//! Sizes depend on tokens per step `T` and sequences per step `S` only — never on prompt length or context.
//! Chunked DeltaNet prefill is bounded by `T` too: a step holds at most `⌊(T + 63·min(S,T)) / 64⌋` chunks of
//! 64 tokens (every sequence may end in a partial chunk). Prefill attention keeps its online softmax in
//! registers / shared memory (no scratch); decode attention uses split-K partials `[S, P, H, hd + 2]` f32.

use deltaserve_model::ModelConfig;

use crate::plan::ALIGN;

/// Chunk length of the chunked (WY) DeltaNet prefill.
pub const GDN_CHUNK: usize = 64;

/// Tokens of the decode steps whose RMSNorms fold into the int4 projections (one GEMV launch).
pub const FOLD_TOKENS: usize = 8;

/// The step inputs, in their order at the start of the workspace (each 256-byte aligned).
pub const STEP_INPUTS: [&str; 6] =
    ["token_ids", "positions", "cu_seqlens", "seq_lens", "state_slot_ids", "last_token_idx"];

/// Bins of device sampling's histogram of each row (by distance from the row's maximum logit).
pub const SAMPLE_BINS: usize = 2048;
/// Candidates device sampling sorts per row (rows whose cut needs more are picked on the host).
pub const SAMPLE_CANDIDATES: usize = 4096;
/// Presence / frequency penalty entries (generated ids) per sequence of a step; steps with more are
/// sampled on the host. The repetition penalty's ids travel as a bitmap (any context length).
pub const SAMPLE_PENALTIES_PER_SEQ: usize = 8192;

/// Device sampling's scratch for `seqs` rows of `vocab` logits: byte offsets of its parts inside the
/// `sampling` workspace buffer (each 256-byte aligned). One layout for the plan and the backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SamplingScratch {
    /// Blocks per row of the row-wide sampling kernels (about 4K ids each, at most 64).
    pub blocks: usize,
    /// Candidates per row: [`SAMPLE_CANDIDATES`], or the vocabulary when it is smaller.
    pub candidates: usize,
    /// `[S]` × 32 B parameters.
    pub params: u64,
    /// `[S, blocks]` × 16 B partial maxima and sums.
    pub partials: u64,
    /// `[S, bins]` u32 counts, then `[S, bins]` u64 masses, `[S]` u32 candidate counts and `[S]` × 32 B
    /// row states: one zeroing covers them (`zeroed_bytes`).
    pub hist_count: u64,
    pub hist_mass: u64,
    pub cand_count: u64,
    pub state: u64,
    pub zeroed_bytes: u64,
    /// `[S, candidates]` u64 keys.
    pub cand: u64,
    /// `[S]` × 8 B (token, flag).
    pub out: u64,
    /// `[S · SAMPLE_PENALTIES_PER_SEQ]` × 16 B penalty entries (presence / frequency subtrahends).
    pub penalties: u64,
    /// `[S, ⌈vocab / 32⌉]` u32: the ids the repetition penalty applies to, a bit each.
    pub penalty_bits: u64,
    /// Words of one row's bitmap.
    pub penalty_words: usize,
    pub bytes: u64,
}

impl SamplingScratch {
    pub fn new(seqs: usize, vocab: usize) -> Self {
        let blocks = vocab.div_ceil(4096).clamp(1, 64);
        let candidates = SAMPLE_CANDIDATES.min(vocab.max(1)).next_power_of_two().min(SAMPLE_CANDIDATES);
        let (s, bins) = (seqs as u64, SAMPLE_BINS as u64);
        let mut at = 0u64;
        let mut take = |bytes: u64| {
            let o = at;
            at += bytes.next_multiple_of(ALIGN);
            o
        };
        let params = take(s * 32);
        let partials = take(s * blocks as u64 * 16);
        let hist_count = take(s * bins * 4);
        let hist_mass = take(s * bins * 8);
        let cand_count = take(s * 4);
        let state = take(s * 32);
        let zeroed_bytes = state + (s * 32).next_multiple_of(ALIGN) - hist_count;
        let cand = take(s * candidates as u64 * 8);
        let out = take(s * 8);
        let penalties = take(s * SAMPLE_PENALTIES_PER_SEQ as u64 * 16);
        let penalty_words = vocab.div_ceil(32).max(1);
        let penalty_bits = take(s * penalty_words as u64 * 4);
        Self {
            blocks,
            candidates,
            params,
            partials,
            hist_count,
            hist_mass,
            cand_count,
            state,
            zeroed_bytes,
            cand,
            out,
            penalties,
            penalty_bits,
            penalty_words,
            bytes: at,
        }
    }
}

/// One named buffer of the workspace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkspaceBuffer {
    pub name: &'static str,
    pub bytes: u64,
    /// Offset inside the `activations` region (256-byte aligned).
    pub offset: u64,
    /// First and last op (index into [`WorkspaceLayout::ops`]) during which the buffer is live, inclusive.
    pub first_op: usize,
    pub last_op: usize,
    /// Shape and dtype, e.g. `[T=4096, 10240] act`.
    pub shape: String,
}

impl WorkspaceBuffer {
    /// Whether the two lifetimes share an op.
    pub fn lifetime_overlaps(&self, o: &Self) -> bool {
        self.first_op <= o.last_op && o.first_op <= self.last_op
    }
    /// Whether the two address ranges share a byte.
    pub fn address_overlaps(&self, o: &Self) -> bool {
        self.offset < o.offset + o.bytes && o.offset < self.offset + self.bytes
    }
}

/// The planned workspace: named buffers with offsets and the region size.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkspaceLayout {
    pub buffers: Vec<WorkspaceBuffer>,
    /// Size of the `activations` region (256-byte aligned).
    pub bytes: u64,
    /// Op names in step order; `first_op`/`last_op` index this list.
    pub ops: Vec<&'static str>,
}

impl WorkspaceLayout {
    /// The buffer called `name`.
    pub fn get(&self, name: &str) -> Option<&WorkspaceBuffer> {
        self.buffers.iter().find(|b| b.name == name)
    }

    /// The most bytes live at any one op (a lower bound for [`WorkspaceLayout::bytes`]).
    pub fn peak_live_bytes(&self) -> u64 {
        (0..self.ops.len())
            .map(|op| {
                self.buffers
                    .iter()
                    .filter(|b| b.first_op <= op && op <= b.last_op)
                    .map(|b| b.bytes.next_multiple_of(ALIGN))
                    .sum::<u64>()
            })
            .max()
            .unwrap_or(0)
    }
}

/// What one step looks like.
#[derive(Clone, Copy, Debug)]
pub struct StepShape {
    /// `T`: tokens per step.
    pub tokens: usize,
    /// `S`: sequences per step.
    pub seqs: usize,
    /// Bytes per activation element (2 bf16, 4 f32).
    pub act_bytes: usize,
    /// Bytes per element of the embedding table (host staging rows), when it lives on the host.
    pub host_embed_elem: Option<usize>,
    /// Split-K partitions of decode attention.
    pub decode_partitions: usize,
    /// Speculative decoding: after the logits every step runs the MTP head over its rows (it needs the
    /// step's inputs and the final-normed rows after the last layer).
    pub speculative: bool,
}

struct Builder {
    bufs: Vec<(&'static str, u128, String)>,
    ops: Vec<(&'static str, Vec<&'static str>, Vec<&'static str>)>,
}

impl Builder {
    fn buf(&mut self, name: &'static str, bytes: u128, shape: String) {
        if bytes > 0 {
            self.bufs.push((name, bytes, shape));
        }
    }
    fn op(&mut self, name: &'static str, reads: &[&'static str], writes: &[&'static str]) {
        self.ops.push((name, reads.to_vec(), writes.to_vec()));
    }
}

/// Rows of one tile of the CUDA backend's grouped expert GEMM (its per-expert tile counts are planned).
pub const MOE_TILE_ROWS: usize = 64;

/// The routed experts' buffers of a sparse layer: bounded by the step's tokens × `top_k` (the rows the
/// experts compute, however unevenly the tokens route) and the expert count, never by the prompt.
fn moe_buffers(b: &mut Builder, m: &deltaserve_model::MoeConfig, s: &StepShape, hd: u128, a: u128, act: &str) {
    let (t, k, e, w) = (s.tokens as u128, m.top_k as u128, m.num_experts as u128, m.expert_intermediate as u128);
    let (tt, rows) = (format!("T={}", s.tokens), format!("T·k={}", s.tokens * m.top_k));
    b.buf("moe_router_logits", t * e * 4, format!("[{tt}, {}] f32", m.num_experts));
    b.buf("moe_topk", t * k * 8, format!("[{tt}, {}] (i32 expert, f32 weight)", m.top_k));
    b.buf(
        "moe_expert_offsets",
        2 * (e + 1) * 4,
        format!("2·[{}+1] i32 (prefix sums of rows, then of {MOE_TILE_ROWS}-row tiles, per expert)", m.num_experts),
    );
    b.buf("moe_rows", t * k * 4, format!("[{rows}] i32 (each (token, k)'s row in the grouped order)"));
    b.buf("moe_rows_in", t * k * hd * a, format!("[{rows}, {hd}] {act} (tokens grouped by expert)"));
    b.buf("moe_gate_up", t * k * 2 * w * a, format!("[{rows}, 2·{w}] {act}"));
    b.buf("moe_act", t * k * w * a, format!("[{rows}, {w}] {act}"));
    b.buf("moe_rows_out", t * k * hd * a, format!("[{rows}, {hd}] {act}"));
    b.buf("moe_shared_gate", t * 4, format!("[{tt}] f32 (sigmoid gate of the shared expert)"));
}

/// The routed experts' ops, after the shared expert (which the dense MLP ops compute into `mlp_out`).
/// The routed experts of a sparse layer over the rows of `mlp_in`, added to `mlp_out` (the main layers'
/// buffers, or the MTP head's when its layer is sparse: the `moe_*` buffers then live through the head too).
fn moe_ops(b: &mut Builder, mlp_in: &'static str, mlp_out: &'static str) {
    b.op("moe_router", &[mlp_in], &["moe_router_logits", "moe_shared_gate"]);
    b.op("moe_topk", &["moe_router_logits"], &["moe_topk", "moe_expert_offsets", "moe_rows"]);
    b.op("moe_permute", &[mlp_in, "moe_topk", "moe_rows"], &["moe_rows_in"]);
    // Grouped GEMMs read the grouped rows; decode's per-pair GEMVs read each token's row of `mlp_in`.
    b.op("moe_gate_up", &["moe_rows_in", "moe_expert_offsets", "moe_topk", mlp_in], &["moe_gate_up"]);
    b.op("moe_act", &["moe_gate_up"], &["moe_act"]);
    b.op("moe_down", &["moe_act", "moe_expert_offsets", "moe_topk"], &["moe_rows_out"]);
    b.op("moe_unpermute", &["moe_rows_out", "moe_topk", "moe_rows", "moe_shared_gate", mlp_out], &[mlp_out]);
}

/// Plans the workspace of one step. None if a size overflows u64.
pub fn plan_workspace(cfg: &ModelConfig, s: &StepShape) -> Option<WorkspaceLayout> {
    let d = cfg.dims();
    let (t, n) = (s.tokens as u128, s.seqs as u128);
    let a = s.act_bytes as u128;
    let act = if s.act_bytes == 4 { "f32" } else { "act" };
    let chunks = (t + (GDN_CHUNK as u128 - 1) * n.min(t)) / GDN_CHUNK as u128;
    let c = GDN_CHUNK as u128;
    let (hd, hv) = (d.hidden as u128, d.gdn_v_heads as u128);
    let tt = format!("T={}", s.tokens);
    let ss = format!("S={}", s.seqs);
    let mut b = Builder { bufs: Vec::new(), ops: Vec::new() };

    // Step inputs (one upload per step): STEP_INPUTS.
    b.buf("token_ids", t * 4, format!("[{tt}] i32"));
    b.buf("positions", t * 4, format!("[{tt}] i32"));
    b.buf("cu_seqlens", (n + 1) * 4, format!("[{ss}+1] i32"));
    b.buf("seq_lens", n * 4, format!("[{ss}] i32 (context length after this step)"));
    b.buf("state_slot_ids", n * 4, format!("[{ss}] i32"));
    b.buf("last_token_idx", n * 4, format!("[{ss}] i32"));
    if let Some(e) = s.host_embed_elem {
        b.buf("embed_rows", t * hd * e as u128, format!("[{tt}, {}] embedding dtype (gathered on the host)", d.hidden));
    }
    // The residual stream in the activation dtype (the CUDA backend adds in bf16, as the reference does).
    b.buf("residual", t * hd * a, format!("[{tt}, {}] {act}", d.hidden));
    b.buf("x_norm", t * hd * a, format!("[{tt}, {}] {act}", d.hidden));
    b.buf("mixer_out", t * hd * a, format!("[{tt}, {}] {act}", d.hidden));
    // Decode steps of at most 8 tokens fold the residual add + RMSNorm into the int4 projections around it
    // (the CUDA backend's `w4a16::Fold`): the norm's input before its 1/rms, and per-32-row sums of squares.
    let ft = t.min(FOLD_TOKENS as u128);
    b.buf("fold_x", ft * hd * a, format!("[min({tt}, {FOLD_TOKENS}), {}] {act}", d.hidden));
    b.buf(
        "fold_sums",
        hd.div_ceil(32) * FOLD_TOKENS as u128 * 4,
        format!("[{}/32, {FOLD_TOKENS}] f32 (sums of squares)", d.hidden),
    );
    // DeltaNet mixer.
    let (conv, vw, kw) = (d.conv_channels as u128, d.gdn_value_width as u128, d.gdn_key_width as u128);
    b.buf("gdn_qkv", t * conv * a, format!("[{tt}, {}] {act}", d.conv_channels));
    b.buf("gdn_z", t * vw * a, format!("[{tt}, {}] {act}", d.gdn_value_width));
    b.buf("gdn_a", t * hv * 4, format!("[{tt}, {}] f32", d.gdn_v_heads));
    b.buf("gdn_b", t * hv * 4, format!("[{tt}, {}] f32", d.gdn_v_heads));
    b.buf("gdn_g", t * hv * 4, format!("[{tt}, {}] f32 (log decay)", d.gdn_v_heads));
    b.buf("gdn_beta", t * hv * 4, format!("[{tt}, {}] f32", d.gdn_v_heads));
    b.buf("gdn_conv_out", t * conv * a, format!("[{tt}, {}] {act} (q | k | v after conv + silu)", d.conv_channels));
    b.buf("gdn_qk", t * 2 * kw * a, format!("[{tt}, 2·{}] {act} (l2-normalised q, k)", d.gdn_key_width));
    let nc = format!("chunks={chunks}");
    b.buf("gdn_chunk_a", chunks * hv * c * c * 4, format!("[{nc}, {}, 64, 64] f32", d.gdn_v_heads));
    b.buf(
        "gdn_chunk_w",
        chunks * hv * c * d.gdn_k_dim as u128 * a,
        format!("[{nc}, {}, 64, {}] {act}", d.gdn_v_heads, d.gdn_k_dim),
    );
    b.buf(
        "gdn_chunk_u",
        chunks * hv * c * d.gdn_v_dim as u128 * a,
        format!("[{nc}, {}, 64, {}] {act}", d.gdn_v_heads, d.gdn_v_dim),
    );
    b.buf("gdn_core_out", t * vw * a, format!("[{tt}, {}] {act}", d.gdn_value_width));
    b.buf("gdn_normed", t * vw * a, format!("[{tt}, {}] {act} (gated rmsnorm)", d.gdn_value_width));
    // Attention mixer.
    let (ad, kvd) = (d.attn_dim as u128, d.kv_dim as u128);
    b.buf("attn_qg", t * 2 * ad * a, format!("[{tt}, {}, 2·{}] {act} (q | gate per head)", d.q_heads, d.head_dim));
    b.buf("attn_k", t * kvd * a, format!("[{tt}, {}] {act}", d.kv_dim));
    b.buf("attn_v", t * kvd * a, format!("[{tt}, {}] {act}", d.kv_dim));
    let pr = crate::cuda::decode_partial_rows(s.seqs) as u128;
    b.buf(
        "attn_decode_partials",
        pr * s.decode_partitions as u128 * d.q_heads as u128 * (d.head_dim as u128 + 2) * 4,
        format!("[{pr} rows, P={}, {}, {}+2] f32 (split-K out, max, sum)", s.decode_partitions, d.q_heads, d.head_dim),
    );
    b.buf("attn_out", t * ad * a, format!("[{tt}, {}] {act}", d.attn_dim));
    // MLP (a sparse layer's shared expert runs here too: the widest of the two).
    let widest = cfg.moe.as_ref().map_or(d.intermediate, |m| m.shared_expert_intermediate.max(d.intermediate));
    let i = widest as u128;
    b.buf("mlp_in", t * hd * a, format!("[{tt}, {}] {act}", d.hidden));
    b.buf("mlp_gate_up", t * 2 * i * a, format!("[{tt}, 2·{widest}] {act}"));
    b.buf("mlp_act", t * i * a, format!("[{tt}, {widest}] {act}"));
    b.buf("mlp_out", t * hd * a, format!("[{tt}, {}] {act}", d.hidden));
    if let Some(m) = &cfg.moe {
        moe_buffers(&mut b, m, s, hd, a, act);
    }
    // Final.
    b.buf("final_normed", t * hd * a, format!("[{tt}, {}] {act} (every row, final-normed)", d.hidden));
    b.buf("final_hidden", n * hd * a, format!("[{ss}, {}] {act} (last token, final-normed)", d.hidden));
    let sampling = SamplingScratch::new(s.seqs, d.vocab);
    b.buf(
        "sampling",
        sampling.bytes as u128,
        format!(
            "[{ss}] × (params, {} block partials, {SAMPLE_BINS}-bin histogram, {} candidates, {} penalties) (device sampling)",
            sampling.blocks,
            sampling.candidates,
            SAMPLE_PENALTIES_PER_SEQ
        ),
    );
    if s.speculative {
        // The MTP head's own buffers: it runs after the layers, over the step's rows.
        let m = |x: usize| format!("[{tt}, {x}] {act}");
        b.buf("mtp_rows", t * hd * a, format!("{} (each row's previous final-normed row)", m(d.hidden)));
        b.buf("mtp_cat", t * 2 * hd * a, format!("{} (normed embedding | normed hidden)", m(2 * d.hidden)));
        b.buf("mtp_residual", t * hd * a, format!("[{tt}, {}] {act}", d.hidden));
        b.buf("mtp_norm", t * hd * a, m(d.hidden));
        b.buf("mtp_qg", t * 2 * ad * a, m(2 * d.attn_dim));
        b.buf("mtp_k", t * kvd * a, m(d.kv_dim));
        b.buf("mtp_v", t * kvd * a, m(d.kv_dim));
        b.buf(
            "mtp_partials",
            n * s.decode_partitions as u128 * d.q_heads as u128 * (d.head_dim as u128 + 2) * 4,
            format!("[{ss}, P={}, {}, {}+2] f32", s.decode_partitions, d.q_heads, d.head_dim),
        );
        b.buf("mtp_attn_out", t * ad * a, m(d.attn_dim));
        b.buf("mtp_mixer_out", t * hd * a, m(d.hidden));
        b.buf("mtp_mlp_in", t * hd * a, m(d.hidden));
        b.buf("mtp_gate_up", t * 2 * i * a, m(2 * d.intermediate));
        b.buf("mtp_act", t * i * a, m(d.intermediate));
        b.buf("mtp_mlp_out", t * hd * a, m(d.hidden));
    }

    b.op("upload_inputs", &[], &STEP_INPUTS);
    if s.host_embed_elem.is_some() {
        b.op("embed_upload", &["token_ids"], &["embed_rows"]);
        b.op("embed", &["embed_rows"], &["residual"]);
    } else {
        b.op("embed", &["token_ids"], &["residual"]);
    }
    let section_start = b.ops.len();
    // A folded input norm is the in-projection's epilogue: the fold buffers stay live around the section.
    b.op("input_norm", &["residual", "fold_x", "fold_sums"], &["x_norm"]);
    // The DeltaNet ops in the backend's order: conv first, then the gates fused with the q/k L2 norm (it
    // reads the conv output and the b/a rows); decode's recurrence reads v (conv output) while writing
    // its output, so the conv output stays live through the core. Decode and verify rows run the conv and
    // the gates in one launch, which writes the gates' outputs while it reads the in-projection rows: the
    // conv op writes them too, so they never share bytes with gdn_qkv.
    b.op("gdn_in_proj", &["x_norm", "fold_x", "fold_sums"], &["gdn_qkv", "gdn_z", "gdn_b", "gdn_a"]);
    b.op(
        "gdn_conv",
        &["gdn_qkv", "gdn_a", "gdn_b", "cu_seqlens", "state_slot_ids"],
        &["gdn_conv_out", "gdn_g", "gdn_beta", "gdn_qk"],
    );
    b.op("gdn_gate_qk_l2norm", &["gdn_a", "gdn_b", "gdn_conv_out"], &["gdn_g", "gdn_beta", "gdn_qk"]);
    b.op(
        "gdn_chunk_wy",
        &["gdn_qk", "gdn_conv_out", "gdn_g", "gdn_beta", "cu_seqlens"],
        &["gdn_chunk_a", "gdn_chunk_w", "gdn_chunk_u"],
    );
    b.op(
        "gdn_core",
        &[
            "gdn_qk",
            "gdn_conv_out",
            "gdn_g",
            "gdn_beta",
            "gdn_chunk_a",
            "gdn_chunk_w",
            "gdn_chunk_u",
            "cu_seqlens",
            "state_slot_ids",
        ],
        &["gdn_core_out"],
    );
    b.op("gdn_gated_norm", &["gdn_core_out", "gdn_z"], &["gdn_normed"]);
    b.op("gdn_out_proj", &["gdn_normed", "residual"], &["mixer_out", "residual", "fold_x", "fold_sums"]);
    b.op("attn_in_proj", &["x_norm", "fold_x", "fold_sums"], &["attn_qg", "attn_k", "attn_v"]);
    b.op(
        "attn_qk_norm_rope_kv_append",
        &["attn_qg", "attn_k", "attn_v", "positions", "cu_seqlens"],
        &["attn_qg", "attn_k"],
    );
    b.op("attn_prefill", &["attn_qg", "cu_seqlens", "seq_lens"], &["attn_out"]);
    b.op("attn_decode", &["attn_qg", "seq_lens"], &["attn_decode_partials"]);
    b.op("attn_decode_reduce", &["attn_decode_partials"], &["attn_out"]);
    b.op("attn_gate", &["attn_out", "attn_qg"], &["attn_out"]);
    b.op("attn_o_proj", &["attn_out", "residual"], &["mixer_out", "residual", "fold_x", "fold_sums"]);
    b.op("post_norm", &["mixer_out", "residual"], &["residual", "mlp_in"]);
    b.op("mlp_gate_up", &["mlp_in", "fold_x", "fold_sums"], &["mlp_gate_up"]);
    b.op("mlp_act", &["mlp_gate_up"], &["mlp_act"]);
    b.op("mlp_down", &["mlp_act", "residual"], &["mlp_out", "residual", "fold_x", "fold_sums"]);
    if cfg.moe.is_some() {
        moe_ops(&mut b, "mlp_in", "mlp_out");
    }
    b.op("mlp_residual", &["mlp_out", "residual"], &["residual"]);
    let section_end = b.ops.len() - 1;
    b.op("final_norm_gather", &["residual", "mlp_out", "last_token_idx"], &["final_normed", "final_hidden"]);
    b.op("lm_head", &["final_hidden"], &[]);
    if s.speculative {
        // The MTP head over the step's rows (its cache entries; its logits when drafting): row r from the
        // final-normed row r − 1 (or the slot's pending hidden) and token r, through fc and its layer.
        b.op("mtp_shift", &["final_normed", "cu_seqlens", "state_slot_ids"], &["mtp_rows"]);
        b.op("mtp_embed", &["token_ids"], &["mtp_residual"]);
        b.op("mtp_pre_fc_norms", &["mtp_residual", "mtp_rows"], &["mtp_cat"]);
        b.op("mtp_fc", &["mtp_cat"], &["mtp_residual"]);
        b.op("mtp_input_norm", &["mtp_residual"], &["mtp_norm"]);
        b.op("mtp_qkv", &["mtp_norm"], &["mtp_qg", "mtp_k", "mtp_v"]);
        b.op("mtp_rope_kv_append", &["mtp_qg", "mtp_k", "mtp_v", "positions", "cu_seqlens"], &["mtp_qg", "mtp_k"]);
        b.op("mtp_attention", &["mtp_qg", "cu_seqlens", "seq_lens"], &["mtp_partials", "mtp_attn_out"]);
        b.op("mtp_o_proj", &["mtp_attn_out", "mtp_qg"], &["mtp_mixer_out"]);
        b.op("mtp_post_norm", &["mtp_mixer_out", "mtp_residual"], &["mtp_residual", "mtp_mlp_in"]);
        b.op("mtp_gate_up", &["mtp_mlp_in"], &["mtp_gate_up"]);
        b.op("mtp_act", &["mtp_gate_up"], &["mtp_act"]);
        b.op("mtp_down", &["mtp_act"], &["mtp_mlp_out"]);
        if cfg.moe.as_ref().is_some_and(|m| m.mtp_is_sparse()) {
            moe_ops(&mut b, "mtp_mlp_in", "mtp_mlp_out");
        }
        b.op("mtp_norm_logits", &["mtp_mlp_out", "mtp_residual", "last_token_idx"], &["mtp_norm", "final_hidden"]);
    }
    b.op("sample", &[], &["sampling"]);

    let mut buffers = Vec::with_capacity(b.bufs.len());
    for (name, bytes, shape) in b.bufs {
        let touches: Vec<usize> = b
            .ops
            .iter()
            .enumerate()
            .filter(|(_, (_, r, w))| r.contains(&name) || w.contains(&name))
            .map(|(i, _)| i)
            .collect();
        let (first, mut last) = match (touches.first(), touches.last()) {
            (Some(&f), Some(&l)) => (f, l),
            _ => continue, // declared but unused: nothing to place
        };
        if first < section_start && last >= section_start {
            last = last.max(section_end); // live into the repeating layer section: live through all of it
        }
        buffers.push(WorkspaceBuffer {
            name,
            bytes: u64::try_from(bytes).ok()?,
            offset: 0,
            first_op: first,
            last_op: last,
            shape,
        });
    }
    // The inputs are declared first and all written by the first op; as one block they live as long as the
    // longest-lived of them.
    let k = STEP_INPUTS.len();
    debug_assert!(buffers.iter().take(k).map(|b| b.name).eq(STEP_INPUTS));
    let last = buffers[..k].iter().map(|b| b.last_op).max()?;
    for b in &mut buffers[..k] {
        b.last_op = last;
    }
    let bytes = place_packed_then_first_fit(&mut buffers, k);
    Some(WorkspaceLayout { buffers, bytes, ops: b.ops.into_iter().map(|(n, _, _)| n).collect() })
}

/// Places buffers first-fit by lifetime: largest first (ties: earlier first op, then name), each at the lowest
/// `ALIGN`-aligned offset where it overlaps no already placed buffer with an overlapping lifetime. Sets every
/// `offset` and returns the aligned end of the highest buffer.
pub fn place_first_fit(buffers: &mut [WorkspaceBuffer]) -> u64 {
    place_packed_then_first_fit(buffers, 0)
}

/// Places the first `packed` buffers back to back from offset 0, in their order, then the others as
/// [`place_first_fit`] does around them. Returns the aligned end of the highest buffer.
pub fn place_packed_then_first_fit(buffers: &mut [WorkspaceBuffer], packed: usize) -> u64 {
    let mut end = 0u64;
    for b in &mut buffers[..packed] {
        b.offset = end;
        end += b.bytes.next_multiple_of(ALIGN);
    }
    let mut order: Vec<usize> = (packed..buffers.len()).collect();
    order.sort_by(|&x, &y| {
        let (a, b) = (&buffers[x], &buffers[y]);
        b.bytes.cmp(&a.bytes).then(a.first_op.cmp(&b.first_op)).then(a.name.cmp(b.name))
    });
    let mut placed: Vec<usize> = (0..packed).collect();
    for &i in &order {
        let size = buffers[i].bytes.next_multiple_of(ALIGN);
        let mut conflicts: Vec<(u64, u64)> = placed
            .iter()
            .filter(|&&j| buffers[j].lifetime_overlaps(&buffers[i]))
            .map(|&j| (buffers[j].offset, buffers[j].offset + buffers[j].bytes.next_multiple_of(ALIGN)))
            .collect();
        conflicts.sort_unstable();
        let mut offset = 0u64;
        for (lo, hi) in conflicts {
            if offset + size <= lo {
                break;
            }
            offset = offset.max(hi);
        }
        buffers[i].offset = offset;
        end = end.max(offset + size);
        placed.push(i);
    }
    end
}
