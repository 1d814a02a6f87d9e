//! What the CUDA backend carves beside the generic regions, priced from the model shape and the
//! options alone: its scratch ([`ScratchParts`]: chunked DeltaNet workspace, varlen tables, int4
//! slice and x scratch) and the device layout of its weights ([`weight_tensors`]: bf16 pairs fused,
//! three small DeltaNet tensors in f32, int4 linears as [`W4Bytes`] places them; the routed experts in a
//! pinned host block with `experts_on_host`, laid out alike).

use deltaserve_model::{LayerKind, ModelConfig};

use crate::dtype::{QUANT_GROUP, WeightsDtype, fp8_scale_cols};
use crate::options::{PlanBackend, PlanOptions};
use crate::plan::{ALIGN, card_config};
use crate::weights::decoder_linear_shapes;
use crate::workspace::GDN_CHUNK;

/// Bound of the bf16 slice an int4 linear is dequantised into for a prefill GEMM (the int4
/// prefill path: `w4_dequant` of a row slice, then cuBLASLt on it, writing the slice's columns).
pub const W4_SLICE_BYTES: usize = 64 << 20;

/// Most rows of x an int4 projection runs through the int4 tensor-core GEMM (`w4_gemm`): steps of
/// more tokens than the decode GEMV takes and at most this many; longer steps dequantise row slices
/// for cuBLASLt. The act-order x scratch and the split-K workspace are sized for this many rows.
pub const W4_GEMM_MAX_ROWS: usize = 256;

/// Most splits over K of one int4 GEMM launch (its f32 partial sums go through the workspace).
pub const W4_GEMM_MAX_SPLITS: usize = 16;

/// Output rows of an int4 GEMM block (4 warps, one 32-row pair of the int4 format each).
pub const W4_GEMM_BLOCK_ROWS: usize = 128;

/// Fewest groups of 128 input columns per split (the tile GEMM's cp.async ring holds 3 in flight).
const W4_GEMM_MIN_GROUPS_PER_SPLIT: usize = 4;

/// The most multiprocessors [`w4_gemm_workspace_bound`] sizes for (more splits on larger GPUs; a
/// GPU with more takes the splits this workspace holds).
const W4_GEMM_PLANNED_SMS: usize = 200;

/// Tokens (rows of x) per int4 GEMM block for `m` rows: 16 up to 16 rows; 24 or 32 to 32 rows, whichever
/// pads `m` less (32 on a tie: fewer blocks); one 48-token tile at 33–48 rows (0.85–0.99× the time of
/// two 24-token tiles, 2 blocks an SM against 3); 24 or 32 again at 49–64 rows; above 64 rows 48 where
/// it takes no more tiles than 64, else 64 (faster than dequantised slices + cuBLASLt up to 256 rows on
/// an H100). Measured by `bench_w4_rows` with its sweep. Every token of a block is computed (rows past
/// `m` are zeros), so padding is work.
pub fn w4_gemm_tokens(m: usize) -> usize {
    match m {
        0..=16 => 16,
        33..=48 => 48,
        17..=64 if m.div_ceil(24) * 24 < m.div_ceil(32) * 32 => 24,
        17..=64 => 32,
        _ if m.div_ceil(48) == m.div_ceil(64) => 48,
        _ => 64,
    }
}

/// Splits over K of an int4 GEMM of `m` rows through an `[out, in]` linear on a GPU of `sms`
/// multiprocessors: the fewest powers of two that give the launch 2.4 blocks per multiprocessor (0.8
/// waves of the tiles of up to 32 tokens, 3 blocks an SM; 1.2 of the 48-token one, 2 an SM) or, for the
/// 64-token tile (2 an SM), 2.6 (1.3 waves); at most [`W4_GEMM_MAX_SPLITS`] and at least 4 groups of 128
/// columns per split. Measured at the 27B shapes (`bench_w4_rows` with its sweep): within 10% of the best
/// split of each shape at 12–48 rows on the H200 and at 128 and 256 rows on the H100 (11% for 5120 × 6144
/// at 128 rows), where a rule aiming at 2 blocks per SM and partial sums of at most a quarter of the weight
/// bytes was up to 1.7× slower (10240 × 5120 at 32 rows: 50.9 µs against 29.3). One 48-token tile (33–48 rows) first tries the most
/// splits whose blocks fit one wave of 2 an SM, taken where they fill at least 85% of it (3 or 6 splits at
/// the 27B shapes: 0.84–0.88× the power of two's time at 40–48 rows on the H100).
pub fn w4_gemm_splits(m: usize, out: usize, inp: usize, sms: usize) -> usize {
    let tokens = w4_gemm_tokens(m);
    let tiles = out.div_ceil(W4_GEMM_BLOCK_ROWS) * m.max(1).div_ceil(tokens);
    let most = (inp / QUANT_GROUP / W4_GEMM_MIN_GROUPS_PER_SPLIT).clamp(1, W4_GEMM_MAX_SPLITS);
    if tokens == 48 && m <= 48 {
        let slots = 2 * sms.max(1);
        let wave = (slots / tiles).clamp(1, most);
        if 100 * tiles * wave >= 85 * slots {
            return wave;
        }
    }
    let target = (if tokens == 64 { 26 } else { 24 } * sms.max(1)).div_ceil(10);
    let mut splits = 1;
    while tiles * splits < target && 2 * splits <= most {
        splits *= 2;
    }
    splits
}

/// Bytes of the f32 partial sums of a launch of `m` rows through `out` outputs in `splits` splits (0
/// unsplit).
pub fn w4_gemm_partial_bytes(m: usize, out: usize, splits: usize) -> usize {
    if splits > 1 { splits * m * out * 4 } else { 0 }
}

/// Bytes of the x scratch an act-order int4 linear needs for `m` rows of `in` columns: x gathered in
/// device column order, bf16 `[m, in]`.
pub fn w4_x_scratch_bytes(m: usize, inp: usize) -> usize {
    2 * m * inp
}

/// Bytes of the FP8 GEMM's activation scratch for steps of `t` tokens and linears of at most `inp`
/// inputs: the e4m3 codes `[t, inp]`, then (256-byte aligned) one f32 scale per token and 128 inputs.
pub fn fp8_x_scratch_bytes(t: usize, inp: usize) -> usize {
    al(t * inp) + 4 * t * inp.div_ceil(QUANT_GROUP)
}

/// Bytes of the int4 GEMM's split-K workspace for an `[out, in]` linear at up to `rows` rows: the
/// partial sums [`w4_gemm_splits`] asks for on GPUs of up to 200 multiprocessors. A launch takes no
/// more splits than the workspace it is given holds.
pub fn w4_gemm_workspace_bound(out: usize, inp: usize, rows: usize) -> usize {
    (1..=rows)
        .map(|m| w4_gemm_partial_bytes(m, out, w4_gemm_splits(m, out, inp, W4_GEMM_PLANNED_SMS)))
        .max()
        .unwrap_or(0)
}

/// Query rows per tile of the paged prefill attention (the varlen tile table has one entry a tile).
pub const ATTN_Q_TILE: usize = 16;

/// Most rows of a step's short prefill chunks that attend as decode queries (split-K over their long
/// context, as verify rows do) instead of the prefill kernel's query tiles; their per-row attention
/// lengths and block-table rows sit in the scratch's `decode_rows` part.
pub const SHORT_CHUNK_DECODE_ROWS: usize = 256;

/// Rows the decode attention's split-K partials hold at least (`attn_decode_partials`: the step's
/// sequences, or this many when fewer): a step's short prefill chunks split their keys into them
/// (the prefill kernel split over the keys, or the rows as decode queries), so a plan of one or two
/// sequences still splits a 16-token chunk over a long context 32 ways.
pub const SHORT_CHUNK_PARTIAL_ROWS: usize = 16;

/// Rows of `attn_decode_partials` for a plan of `max_seqs` sequences a step.
pub fn decode_partial_rows(max_seqs: usize) -> usize {
    max_seqs.max(SHORT_CHUNK_PARTIAL_ROWS)
}

/// The most snapshots one step takes inside its chunks (the CUDA backend cuts its sequences there:
/// [`ScratchParts::segments`]; fewer when the plan has fewer device snapshot slots).
pub const MAX_SNAPSHOTS_WITHIN_STEP: usize = 8;

/// Bytes of the segment tables of a step of `s_max` sequences cut at up to
/// [`MAX_SNAPSHOTS_WITHIN_STEP`] snapshots (i32 each): the segments' boundaries, each walk round's
/// slots, and the snapshots' (sequence, rows, snapshot) triples.
pub fn segment_table_bytes(s_max: usize) -> usize {
    let n = MAX_SNAPSHOTS_WITHIN_STEP;
    let segs = s_max + n;
    4 * ((segs + 1) + (n + 1) * segs + 3 * n)
}

fn al(x: usize) -> usize {
    x.next_multiple_of(ALIGN as usize)
}

/// Bytes of the chunked DeltaNet workspace for `t` tokens of `hv` value heads (key head dim `dk`,
/// value head dim `dv`): w_hi, w_lo `[hv, t, dk]` bf16, u `[hv, t, dv]` f32, P_hi, P_lo `[hv, t, 64]`
/// bf16, the decays `[hv, t, 2]` f32 = 4 (dk + dv + 66) B per token and head, each of the six parts
/// starting 256-byte aligned.
pub fn gdn_chunk_workspace_bytes(t: usize, hv: usize, dk: usize, dv: usize) -> usize {
    let per_tok_head = dk + dv + GDN_CHUNK + 2;
    4 * t * hv * per_tok_head + 6 * ALIGN as usize
}

/// The parts of the backend's scratch region, in order.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ScratchParts {
    /// Chunked DeltaNet f32 workspace.
    pub gdn: usize,
    /// Varlen chunk and tile tables (the chunk table of the step's segments).
    pub chunk_table: usize,
    pub tile_table: usize,
    /// The step's sequences cut at the snapshots inside them ([`segment_table_bytes`]).
    pub segments: usize,
    /// Short prefill chunks attending as decode queries: each row's attention length and block-table
    /// row (i32 each, [`SHORT_CHUNK_DECODE_ROWS`] rows at most).
    pub decode_rows: usize,
    /// bf16 `[rows, max in]`: x gathered in device-column order for act-order int4 weights (rows: 8
    /// for the GEMV, up to [`W4_GEMM_MAX_ROWS`] with int4 decoder linears).
    pub w4_x: usize,
    /// f32 split-K partial sums of the int4 GEMM ([`w4_gemm_workspace_bound`] of the largest int4
    /// decoder linear); 0 without int4 decoder linears.
    pub w4_gemm: usize,
    /// bf16 slice of dequantised int4 or fp8 weight rows (prefill GEMMs); 0 without quantised decoder
    /// linears.
    pub w4_slice: usize,
    /// fp8 decoder linears: the step's activations as e4m3 codes `[t_max, max in]` and their scales
    /// (f32 per token and 128 features), what the FP8 tensor-core GEMM reads; 0 without.
    pub fp8_x: usize,
}

impl ScratchParts {
    /// For steps of `t_max` tokens and `s_max` sequences; `int4_linears` / `lm_head_int4` as the
    /// plan's options say.
    pub fn new(cfg: &ModelConfig, t_max: usize, s_max: usize, linears: WeightsDtype, lm_head_int4: bool) -> Self {
        let int4_linears = linears == WeightsDtype::Int4;
        let d = cfg.dims();
        let gdn = if d.num_deltanet_layers > 0 {
            gdn_chunk_workspace_bytes(t_max, d.gdn_v_heads, d.gdn_k_dim, d.gdn_v_dim)
        } else {
            0
        };
        let lin = decoder_linear_shapes(cfg);
        let max_in = lin.iter().map(|&(_, i)| i).max().unwrap_or(0).max(d.hidden);
        let (w4_x, w4_slice, w4_gemm) = if int4_linears {
            let biggest = lin.iter().map(|&(o, i)| 2 * o * i).max().unwrap_or(0);
            let rows = t_max.clamp(8, W4_GEMM_MAX_ROWS);
            let ws = lin.iter().map(|&(o, i)| w4_gemm_workspace_bound(o, i, rows)).max().unwrap_or(0);
            (w4_x_scratch_bytes(rows, max_in), biggest.min(W4_SLICE_BYTES), ws)
        } else if linears == WeightsDtype::Fp8Block {
            let biggest = lin.iter().map(|&(o, i)| 2 * o * i).max().unwrap_or(0);
            let x = if lm_head_int4 { w4_x_scratch_bytes(8, d.hidden) } else { 0 };
            (x, biggest.min(W4_SLICE_BYTES), 0)
        } else if lm_head_int4 {
            (w4_x_scratch_bytes(8, d.hidden), 0, 0)
        } else {
            (0, 0, 0)
        };
        let fp8_x = if linears == WeightsDtype::Fp8Block { fp8_x_scratch_bytes(t_max, max_in) } else { 0 };
        ScratchParts {
            gdn,
            chunk_table: 8 * (t_max / GDN_CHUNK + s_max + MAX_SNAPSHOTS_WITHIN_STEP + 1),
            tile_table: 8 * (t_max / ATTN_Q_TILE + s_max + 1),
            segments: segment_table_bytes(s_max),
            decode_rows: 8 * t_max.min(SHORT_CHUNK_DECODE_ROWS),
            w4_x,
            w4_slice,
            w4_gemm,
            fp8_x,
        }
    }

    /// The parts for a plan's options: one card's shapes under tensor parallelism.
    pub fn of(cfg: &ModelConfig, opts: &PlanOptions) -> Self {
        let card = card_config(cfg, opts.tensor_parallel).unwrap_or_else(|_| cfg.clone());
        ScratchParts::new(&card, opts.max_batch_tokens, opts.max_seqs, opts.weights_dtype, opts.lm_head_int4)
    }

    /// Bytes of the region (each part 256-byte aligned).
    pub fn total(&self) -> usize {
        al(self.gdn)
            + al(self.chunk_table)
            + al(self.tile_table)
            + al(self.segments)
            + al(self.decode_rows)
            + al(self.w4_x)
            + al(self.w4_slice)
            + al(self.w4_gemm)
            + al(self.fp8_x)
    }
}

/// Bytes of the plan's `backend_scratch` region for `opts` on `card` (one card's model shape), whose
/// `weights` region holds `planned_weights` bytes: the CUDA backend's [`ScratchParts`], plus what a
/// quantised checkpoint's tensors need beyond the weights region under int4 weights (linears it keeps
/// bf16, act-order permutations); 0 for the generic regions alone (the CPU backend).
pub fn backend_scratch_bytes(card: &ModelConfig, opts: &PlanOptions, planned_weights: u64) -> u64 {
    let PlanBackend::Cuda { checkpoint } = &opts.backend else {
        return 0;
    };
    let int4 = opts.weights_dtype == WeightsDtype::Int4;
    let parts = ScratchParts::new(card, opts.max_batch_tokens, opts.max_seqs, opts.weights_dtype, opts.lm_head_int4);
    let beyond = checkpoint
        .as_ref()
        .filter(|_| int4 || opts.weights_dtype == WeightsDtype::Fp8Block)
        .map_or(0, |c| (c.device_bytes(WeightFormat::of(opts)) as u64).saturating_sub(planned_weights));
    parts.total() as u64 + beyond
}

/// Rows per dequantised slice of an `[out, in]` int4 linear in a slice buffer of `slice_bytes`:
/// all rows when they fit, else a multiple of 128 (at least 16 rows, or an error at the caller).
pub fn w4_slice_rows(out: usize, inp: usize, slice_bytes: usize) -> usize {
    let fit = slice_bytes / (2 * inp.max(1));
    if fit >= out {
        out
    } else if fit >= 128 {
        fit / 128 * 128
    } else {
        fit / 16 * 16
    }
}

/// Device bytes of the tensors of one int4 linear (the format of the CUDA backend's int4 weights).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct W4Bytes {
    pub qweight: usize,
    pub scales: usize,
    pub zeros: usize,
    pub perm: usize,
}

impl W4Bytes {
    /// The tensors of an `[out, in]` linear (`asym`: with zero points, `perm`: act-order).
    pub fn new(out: usize, inp: usize, asym: bool, perm: bool) -> Self {
        let groups = inp.div_ceil(QUANT_GROUP);
        W4Bytes {
            qweight: out * inp.div_ceil(8) * 4,
            scales: groups * out * 2,
            zeros: if asym { groups * out.div_ceil(2) } else { 0 },
            perm: if perm { inp * 4 } else { 0 },
        }
    }
    pub fn total(&self) -> usize {
        self.qweight + self.scales + self.zeros + self.perm
    }

    /// Byte offsets of (qweight, scales, zeros, perm) when the tensors are placed one after another,
    /// each starting `align`-byte aligned (the arena's 256), and the bytes that takes: for a linear
    /// without `perm` exactly what the plan charges (`weights`, int4).
    pub fn layout(&self, align: usize) -> ([usize; 4], usize) {
        let mut at = 0usize;
        let mut offs = [0usize; 4];
        for (o, b) in offs.iter_mut().zip([self.qweight, self.scales, self.zeros, self.perm]) {
            *o = at;
            if b > 0 {
                at += b.next_multiple_of(align.max(1));
            }
        }
        (offs, at)
    }

    /// Bytes of the tensors placed at the arena's alignment.
    pub fn aligned(&self) -> usize {
        self.layout(ALIGN as usize).1
    }
}

/// Device bytes of the tensors of one block-FP8 linear: e4m3 codes `[out, in]` and f32 scales
/// `[ceil(out/128), ceil(in/128)]` (the official `-FP8` checkpoints' `weight` and `weight_scale_inv`), each
/// row of scales padded to [`fp8_scale_cols`] (a multiple of 4).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fp8Bytes {
    pub codes: usize,
    pub scales: usize,
}

impl Fp8Bytes {
    pub fn new(out: usize, inp: usize) -> Self {
        Fp8Bytes { codes: out * inp, scales: 4 * out.div_ceil(QUANT_GROUP) * fp8_scale_cols(inp) }
    }

    /// Offset of the scales after the codes (each 256-byte aligned) and the bytes both take.
    pub fn layout(&self) -> (usize, usize) {
        (al(self.codes), al(self.codes) + al(self.scales))
    }

    /// Bytes of the tensors placed at the arena's alignment.
    pub fn aligned(&self) -> usize {
        self.layout().1
    }
}

/// How the backend stores the weights (from the plan's options).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WeightFormat {
    /// Decoder linears in int4 (one part per linear) instead of bf16 (pairs fused).
    pub int4: bool,
    /// Decoder linears in block FP8 (one part per linear).
    pub fp8: bool,
    /// The MTP head too (speculative decoding on, and the model declares one).
    pub mtp: bool,
    /// int4 with zero points.
    pub asym: bool,
    pub lm_head_int4: bool,
    pub embed_on_host: bool,
    /// The routed experts (the main layers' and the MTP head's) in pinned host memory.
    pub experts_on_host: bool,
}

impl WeightFormat {
    pub fn of(opts: &PlanOptions) -> Self {
        WeightFormat {
            int4: opts.weights_dtype == WeightsDtype::Int4,
            fp8: opts.weights_dtype == WeightsDtype::Fp8Block,
            mtp: opts.speculative_tokens > 0,
            asym: opts.int4_asym,
            lm_head_int4: opts.lm_head_int4,
            embed_on_host: opts.embed_on_host,
            experts_on_host: opts.experts_on_host,
        }
    }

    /// How the decoder linears are stored.
    pub fn linears(&self) -> WeightsDtype {
        if self.int4 {
            WeightsDtype::Int4
        } else if self.fp8 {
            WeightsDtype::Fp8Block
        } else {
            WeightsDtype::Bf16
        }
    }

    /// A device lm_head of its own (not the device embedding), for a model that ties them or not.
    pub fn own_lm_head(&self, tie_word_embeddings: bool) -> bool {
        !tie_word_embeddings || self.embed_on_host || self.lm_head_int4
    }
}

/// What a dense tensor of the layout holds (what its random initialisation follows).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DenseRole {
    /// The embedding table.
    Embed,
    /// A bf16 projection (or a fused pair of them) reading `fan_in` features; lm_head included.
    Linear { fan_in: usize },
    /// An RMSNorm weight (final, per layer, q/k, the MTP head's).
    Norm,
    /// A DeltaNet layer's conv taps.
    ConvTaps,
    /// A DeltaNet layer's `dt_bias` (f32).
    DtBias,
    /// A DeltaNet layer's `A_log` (f32).
    ALog,
    /// A DeltaNet layer's gated-norm weight (f32).
    GatedNorm,
}

/// One tensor of the backend's weight layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightTensor {
    /// `n` elements, bf16 or f32.
    Dense { n: usize, f32: bool, role: DenseRole },
    /// An int4 `[out, in]` linear.
    W4 { out: usize, inp: usize, asym: bool },
    /// A block-FP8 `[out, in]` linear.
    Fp8 { out: usize, inp: usize },
    /// The embedding table in pinned host memory.
    Host { n: usize },
    /// A layer's bf16 routed experts (one block of `n` elements) in pinned host memory.
    HostDense { n: usize, role: DenseRole },
    /// An int4 routed expert's `[out, in]` linear in pinned host memory.
    HostW4 { out: usize, inp: usize, asym: bool },
}

impl WeightTensor {
    /// Bytes in the device weights region (256-byte aligned; 0 on the host).
    pub fn device_bytes(&self) -> usize {
        match *self {
            WeightTensor::Dense { n, f32, .. } => al(n * if f32 { 4 } else { 2 }),
            WeightTensor::W4 { out, inp, asym } => W4Bytes::new(out, inp, asym, false).aligned(),
            WeightTensor::Fp8 { out, inp } => Fp8Bytes::new(out, inp).aligned(),
            WeightTensor::Host { .. } | WeightTensor::HostDense { .. } | WeightTensor::HostW4 { .. } => 0,
        }
    }

    /// Bytes of a routed-expert tensor in the pinned host block, placed as the device region places
    /// the same tensor (256-byte aligned); 0 for every other tensor.
    pub fn host_expert_bytes(&self) -> usize {
        match *self {
            WeightTensor::HostDense { n, .. } => al(2 * n),
            WeightTensor::HostW4 { out, inp, asym } => W4Bytes::new(out, inp, asym, false).aligned(),
            _ => 0,
        }
    }
}

/// Every tensor in load order: embedding, own lm_head, final norm, then per layer the norms and
/// the mixer's and MLP's tensors, then the MTP head's (fc, its three norms, its layer). bf16 pairs
/// (in_proj_b + in_proj_a, gate + up) are one entry of both halves; int4 pairs two entries.
pub fn weight_tensors(cfg: &ModelConfig, f: WeightFormat) -> Vec<WeightTensor> {
    use DenseRole::*;
    let d = cfg.dims();
    let h = d.hidden;
    let dense = |n: usize, role: DenseRole| WeightTensor::Dense { n, f32: false, role };
    let f32 = |n: usize, role: DenseRole| WeightTensor::Dense { n, f32: true, role };
    let w4 = |out: usize, inp: usize| WeightTensor::W4 { out, inp, asym: f.asym };
    // A routed expert's tensors: on the host with `experts_on_host`, laid out as on the device.
    let expert_w4 = |out: usize, inp: usize| {
        if f.experts_on_host { WeightTensor::HostW4 { out, inp, asym: f.asym } } else { w4(out, inp) }
    };
    let expert_block = |n: usize| {
        let role = Linear { fan_in: h };
        if f.experts_on_host { WeightTensor::HostDense { n, role } } else { dense(n, role) }
    };
    let lin = |o: usize, i: usize| -> Vec<WeightTensor> {
        if f.int4 {
            vec![w4(o, i)]
        } else if f.fp8 {
            vec![WeightTensor::Fp8 { out: o, inp: i }]
        } else {
            vec![dense(o * i, Linear { fan_in: i })]
        }
    };
    let pair = |o: usize, i: usize| -> Vec<WeightTensor> {
        if f.int4 || f.fp8 { [lin(o, i), lin(o, i)].concat() } else { vec![dense(2 * o * i, Linear { fan_in: i })] }
    };
    let normw = |n: usize| dense(n, Norm);
    let mut v = vec![if f.embed_on_host { WeightTensor::Host { n: d.vocab * h } } else { dense(d.vocab * h, Embed) }];
    if f.own_lm_head(cfg.tie_word_embeddings) {
        if f.lm_head_int4 {
            v.push(WeightTensor::W4 { out: d.vocab, inp: h, asym: f.asym });
        } else {
            v.push(dense(d.vocab * h, Linear { fan_in: h }));
        }
    }
    v.push(normw(h));
    let mtp = f.mtp && cfg.mtp_num_hidden_layers > 0;
    let kinds =
        cfg.layer_types.iter().enumerate().map(|(i, k)| (false, *k, cfg.moe.as_ref().filter(|m| m.is_sparse(i))));
    // The MTP head's layer is sparse as decoder layer 0 is (`MoeConfig::mtp_is_sparse`).
    let head_sparse = cfg.moe.as_ref().filter(|m| m.mtp_is_sparse());
    for (is_mtp, kind, sparse) in kinds.chain(mtp.then_some((true, LayerKind::Attention, head_sparse))) {
        if is_mtp {
            v.extend(lin(h, 2 * h));
            v.extend([normw(h), normw(h), normw(h)]);
        }
        v.push(normw(h));
        v.push(normw(h));
        match kind {
            LayerKind::DeltaNet => {
                v.extend(lin(d.conv_channels, h));
                v.extend(lin(d.gdn_value_width, h));
                v.extend(pair(d.gdn_v_heads, h));
                v.push(dense(d.conv_channels * d.conv_kernel, ConvTaps));
                v.push(f32(d.gdn_v_heads, DtBias));
                v.push(f32(d.gdn_v_heads, ALog));
                v.push(f32(d.gdn_v_dim, GatedNorm));
                v.extend(lin(h, d.gdn_value_width));
            }
            LayerKind::Attention => {
                v.extend(lin(2 * d.attn_dim, h));
                v.extend(lin(d.kv_dim, h));
                v.extend(lin(d.kv_dim, h));
                v.extend(lin(h, d.attn_dim));
                v.push(normw(d.head_dim));
                v.push(normw(d.head_dim));
            }
        }
        // A sparse layer's dense MLP is its shared expert; then the router, the experts (bf16: one block,
        // expert e's gate, up and down rows at e·3·I·hidden; int4: per expert its gate and up rows as one
        // [2·I, hidden] linear, then down, every expert laid out alike) and the shared expert's gate.
        let width = sparse.map_or(d.intermediate, |m| m.shared_expert_intermediate);
        v.extend(pair(width, h));
        v.extend(lin(h, width));
        if let Some(m) = sparse {
            let (e, i) = (m.num_experts, m.expert_intermediate);
            v.push(dense(e * h, Linear { fan_in: h }));
            if f.int4 {
                v.extend((0..e).flat_map(|_| [expert_w4(2 * i, h), expert_w4(h, i)]));
            } else {
                v.push(expert_block(e * 3 * i * h));
            }
            v.push(dense(h, Linear { fan_in: h }));
        }
    }
    v
}

/// Bytes of the pinned host block of the routed experts (`experts_on_host`: every sparse layer's and the
/// MTP head's, each tensor 256-byte aligned as in [`weight_tensors`]); 0 when they are on the device. A
/// GPTQ checkpoint's experts take at most this (the format's zero points are those of `f.asym`, or none).
pub fn host_experts_bytes(cfg: &ModelConfig, f: WeightFormat) -> usize {
    weight_tensors(cfg, f).iter().map(WeightTensor::host_expert_bytes).sum()
}

/// Device bytes of the weights as the backend places them for random weights and for a bf16
/// checkpoint (quantised at load when `f.int4`). It differs from the plan's `weights` region only by
/// the three small DeltaNet tensors the backend keeps in f32 (`A_log`, `dt_bias`, the gated-norm
/// weight; the plan prices them 16-bit) and, for bf16, by the alignment padding the fused pairs save.
pub fn weights_device_bytes(cfg: &ModelConfig, f: WeightFormat) -> usize {
    weight_tensors(cfg, f).iter().map(WeightTensor::device_bytes).sum()
}
