//! Every CUDA op against the f32 CPU reference (deltaserve-cpu), in ONE table of cases.
//!
//! Each case draws fresh random inputs (the seed is printed), rounds them to bf16 (what the GPU
//! reads), runs the CPU reference in f32 on those rounded values, poisons the GPU outputs with
//! NaN (0xFF bytes) before the launch, and checks every element: |ref − x| ≤ atol + rtol·|ref|.
//! The worst element and its share of the tolerance are printed for every case.
//!
//! Tolerances (bf16 I/O, f32 math): a bf16 output is the f32 result rounded once, a relative
//! error ≤ 2⁻⁹ ≈ 2e-3, so rtol = 8e-3 leaves 4× headroom for f32 reordering and libm differences
//! (expf, sinf). atol covers cancellation near zero and is tied to the output scale (rms of ref):
//! 2e-3·rms for single-rounding ops. The DeltaNet chunk kernel and attention accumulate over
//! many tokens in a different order than the CPU, and GEMM sums 5120 products; they get
//! rtol 1.6e-2 and atol 4e-3·rms. The residual stream (bf16(x + res)) must match bit for bit.
//!
//! With no CUDA driver the test prints SKIP and passes. To add an op: add an `Op` variant, rows in
//! `cases()` (cases.rs), its arm in `run_case` and its case function in its family's module.

mod attention;
mod bench_gdn;
mod cases;
mod deltanet;
mod elementwise;
mod fp8;
mod gdn_rows;
mod harness;
mod kv_quant;
mod moe;
mod sampling;
mod vision;
mod w4;

use std::time::{SystemTime, UNIX_EPOCH};

use cudarc::driver::CudaStream;
use deltaserve_cuda::ops::gdn_chunk;
use deltaserve_cuda::{AttnTiling, KernelDims, Kernels, LibStatus, Runtime};
use deltaserve_plan::KvDtype;
use rand::SeedableRng;
use rand::rngs::StdRng;

pub(crate) use cases::{ACCUM, EXACT, FOLD_X, Tol};
use cases::{Case, cases};
use harness::{Dev, Outcome, R};

#[derive(Clone, Debug)]
enum Op {
    Embed {
        t: usize,
        d: usize,
        vocab: usize,
    },
    /// Rows of `vocab` f32 logits, the argmax over the first `valid`; `special`: ties, NaNs, infinities.
    Argmax {
        rows: usize,
        vocab: usize,
        valid: usize,
        special: bool,
    },
    /// Rows of `vocab` logits (peaked like a language model's, flat, on a coarse grid with ties), each
    /// picked `rounds` times under a cycle of sampling parameters (greedy and penalised, plain draws,
    /// top-k / top-p / min-p cuts) with fresh uniforms: the device's tokens against the host rule.
    Sample {
        rows: usize,
        vocab: usize,
        valid: usize,
        rounds: usize,
    },
    AddRmsNorm {
        rows: usize,
        d: usize,
        residual: bool,
    },
    /// `add_rms_norm_1p_parts`: x the bf16 rounding of `splits` f32 partial-sum arrays added in order.
    AddRmsNormParts {
        rows: usize,
        d: usize,
        splits: usize,
    },
    RmsNormStrided {
        t: usize,
        heads: usize,
        hd: usize,
        stride: usize,
    },
    GatedRmsNorm {
        t: usize,
        hv: usize,
        dv: usize,
    },
    SigmoidGate {
        t: usize,
        heads: usize,
        hd: usize,
    },
    Swiglu {
        t: usize,
        i: usize,
    },
    Rope {
        t: usize,
        heads: usize,
        hd: usize,
        rot: usize,
        pos0: usize,
    },
    /// q|gate and k heads: the fused RMSNorm + RoPE kernel, bitwise vs rms_norm_1p + rope_partial.
    QkNormRope {
        t: usize,
        nq: usize,
        nkv: usize,
        hd: usize,
        rot: usize,
        pos0: usize,
    },
    /// qk_norm_rope_kv (q|gate, k heads normalised and rotated; K and V rows into a paged cache of
    /// formats `fk` / `fv`), bitwise vs qk_norm_rope + kv_write_q. `seqs`: (cached, new) tokens per
    /// sequence (the new tokens at positions cached, cached + 1, ...); `pad` adds a decode-graph
    /// padding row (position -1).
    QkNormRopeKv {
        fk: KvDtype,
        fv: KvDtype,
        seqs: Vec<(usize, usize)>,
        nq: usize,
        nkv: usize,
        hd: usize,
        page: usize,
        pad: bool,
    },
    /// qk_norm_rope at (t, h, w) M-RoPE positions (`rope_pos`) against rms_norm_1p + apply_mrope, and at
    /// equal streams bitwise the launch rotating at the KV positions.
    QkNormRopeMrope {
        t: usize,
        nq: usize,
        nkv: usize,
        hd: usize,
        rot: usize,
        section: [usize; 3],
    },
    /// The vision tower's LayerNorm: f32 rows in, bf16 out; with `residual`, the residual add (x += y +
    /// bias, stored) in the same kernel before it.
    VisionLayerNorm {
        rows: usize,
        d: usize,
        residual: bool,
    },
    /// The tower's position embeddings: an image of `grid` (t, h, w) patches, the `side²` table.
    VisionEmbedPos {
        grid: [usize; 3],
        d: usize,
        side: usize,
    },
    /// The qkv bias and the 2-D axial rotary of q and k.
    VisionQkvRope {
        grid: [usize; 3],
        heads: usize,
        hd: usize,
    },
    /// Non-causal attention within each frame of each image (one launch per image).
    VisionAttention {
        grids: Vec<[usize; 3]>,
        heads: usize,
        hd: usize,
    },
    /// The same over packed frames of any lengths `lens` in one launch (frame offsets on the device);
    /// `nan_smem`: every SM's shared memory filled with NaN just before the launch.
    VisionAttentionFrames {
        lens: Vec<usize>,
        heads: usize,
        hd: usize,
        nan_smem: bool,
    },
    /// The biased activation of the tower's GEMM outputs.
    VisionBiasAct {
        rows: usize,
        d: usize,
        act: vision::VisionAct,
    },
    /// With `saves` (sequence, rows): snapshots inside the sequences (conv_state_save).
    ConvPrefill {
        lens: Vec<usize>,
        c: usize,
        saves: Vec<(usize, usize)>,
    },
    ConvDecode {
        b: usize,
        c: usize,
    },
    /// Decode rows: gdn_conv_gate_decode bitwise vs conv_decode + gdn_gate (slots < 0: padding).
    GdnConvGateDecode {
        slots: Vec<i32>,
        hk: usize,
        hv: usize,
    },
    /// Verify chunks of `lens` rows: gdn_conv_gate_rows bitwise vs conv_prefill + gdn_gate.
    GdnConvGateRows {
        lens: Vec<usize>,
        slots: Vec<i32>,
        hk: usize,
        hv: usize,
    },
    GdnGate {
        t: usize,
        hk: usize,
        hv: usize,
    },
    /// With `cuts`: each sequence cut at those rows (snapshots inside a chunk: the segments walked
    /// round by round, the states at the cuts read between rounds).
    GdnChunk {
        lens: Vec<usize>,
        hk: usize,
        hv: usize,
        prec: gdn_chunk::Precision,
        cuts: Vec<Vec<usize>>,
    },
    GdnDecode {
        b: usize,
        hk: usize,
        hv: usize,
    },
    /// Decode rows: gdn_decode_gated bitwise vs gdn_decode + gated_rms_norm (slots < 0: padding).
    GdnDecodeGated {
        slots: Vec<i32>,
        hk: usize,
        hv: usize,
    },
    /// gdn_recurrent over `lens` rows per sequence: verify (`accept` None: outputs of every row, the
    /// state bit-untouched) or commit of the first `accept[b]` rows (the state against the oracle, and
    /// bit-equal to gdn_decode run token by token over those rows).
    /// Verify chunks of `lens` rows: gdn_recurrent_gated bitwise vs gdn_recurrent + gated_rms_norm.
    GdnRecurrentGated {
        lens: Vec<usize>,
        slots: Vec<i32>,
        hk: usize,
        hv: usize,
    },
    /// A speculative step's rows, `lens` per sequence: gdn_rows bitwise vs the kernels it replaces —
    /// the verify (`accept` None) or the commit of the first `accept[b]` rows.
    GdnRows {
        lens: Vec<usize>,
        slots: Vec<i32>,
        accept: Option<Vec<usize>>,
        hk: usize,
        hv: usize,
    },
    /// The commit of `layers` DeltaNet layers in one launch per table of layers (gdn_commit_layers)
    /// bitwise vs each layer's own gdn_rows commit (`accept[b]` of `lens[b]` rows).
    GdnCommitLayers {
        lens: Vec<usize>,
        slots: Vec<i32>,
        accept: Vec<usize>,
        hk: usize,
        hv: usize,
        layers: usize,
    },
    GdnRecurrent {
        lens: Vec<usize>,
        accept: Option<Vec<usize>>,
        hk: usize,
        hv: usize,
    },
    /// conv_state_update over the first `accept[b]` of `lens[b]` rows (speculative commit): bit-exact
    /// against the oracle's window shift.
    ConvAccept {
        lens: Vec<usize>,
        accept: Vec<usize>,
        c: usize,
    },
    /// shift_rows (each row's previous row, or its slot's pending row) and scatter_rows: bit-exact.
    MtpRows {
        lens: Vec<usize>,
        d: usize,
    },
    /// (past, new) per sequence: kv_write of all positions, then prefill attention of the new.
    AttnPrefill {
        seqs: Vec<(usize, usize)>,
        hq: usize,
        hkv: usize,
        page: usize,
    },
    /// [`Op::AttnPrefill`] with kernels compiled for another prefill tiling.
    AttnPrefillTiled {
        seqs: Vec<(usize, usize)>,
        hq: usize,
        hkv: usize,
        page: usize,
        tiling: AttnTiling,
    },
    AttnDecode {
        lens: Vec<usize>,
        hq: usize,
        hkv: usize,
        page: usize,
        n_split: usize,
    },
    Gemm {
        m: usize,
        n: usize,
        k: usize,
    },
    /// Decode GEMV: n tokens, up to 3 weight matrices [m, k] sharing x; f32 or bf16 out.
    Gemv {
        n: usize,
        ms: Vec<usize>,
        k: usize,
        f32_out: bool,
    },
    /// Block-FP8 GEMV: n tokens (1..=16), up to three linears [out, k] sharing x.
    Fp8Gemv {
        n: usize,
        outs: Vec<usize>,
        k: usize,
        f32_out: bool,
    },
    /// Block-FP8 prefill: the activations' quantisation, cuBLASLt's block-scaled FP8 GEMM (Hopper) and
    /// the dequantised-rows route, n tokens, W [out, k].
    Fp8Gemm {
        n: usize,
        out: usize,
        k: usize,
    },
    /// The SwiGLU of [t, i] rows quantised for the FP8 GEMM in one pass (its first tq rows; the rest bf16)
    /// against the SwiGLU and the activations' quantisation.
    Fp8SwigluQuant {
        t: usize,
        i: usize,
        tq: usize,
    },
    /// The DeltaNet output norm (heads of 128) of t tokens quantised for the FP8 GEMM (its first tq tokens;
    /// the rest bf16) against the norm and the activations' quantisation.
    Fp8GatedNormQuant {
        t: usize,
        hv: usize,
        tq: usize,
    },
    /// The residual add + RMSNorm of t rows of d (the many-rows kernel) quantised for the FP8 GEMM (its first
    /// tq rows; the rest bf16) against the norm and the activations' quantisation.
    Fp8NormQuant {
        t: usize,
        d: usize,
        tq: usize,
    },
    /// bf16 weights [out, k] quantised to block FP8 on the GPU.
    Fp8Quantize {
        out: usize,
        k: usize,
    },
    /// 4-bit GEMV (every warps-per-tile choice): m tokens, W [out, inp]; asym = zero points,
    /// perm = act-order permutation, bf16 = bf16 scales.
    W4Gemv {
        m: usize,
        out: usize,
        inp: usize,
        asym: bool,
        perm: bool,
        bf16: bool,
    },
    /// Up to three 4-bit linears sharing x in one launch (w4_gemv_multi): each output vs the CPU
    /// and bitwise vs its own launch with the same configuration.
    W4GemvMulti {
        m: usize,
        outs: Vec<usize>,
        inp: usize,
        asym: bool,
        bf16: bool,
    },
    /// The residual add + RMSNorm folded into the 4-bit projections around it (w4_gemv_fold): a
    /// producer [hidden, pin] whose output joins the residual stream, then the consumers `outs` x
    /// [hidden], against the same GEMVs with add_rms_norm_1p between them. `thin`: the producer's
    /// thin last wave runs as a second segment (its rows from an offset).
    W4Fold {
        m: usize,
        hidden: usize,
        pin: usize,
        outs: Vec<usize>,
        asym: bool,
        bf16: bool,
        thin: bool,
    },
    /// Rows r0..r1 of a 4-bit W [out, inp] to bf16, bit-exact vs W4Linear::dequantize_bf16.
    W4Dequant {
        out: usize,
        inp: usize,
        r0: usize,
        r1: usize,
        asym: bool,
        perm: bool,
    },
    /// bf16 W [out, inp] -> int4 in two row slices, bit-exact vs W4Linear::quantize.
    W4Quantize {
        out: usize,
        inp: usize,
        asym: bool,
    },
    /// Quantised KV cache (K and V formats): kv_write_q of all positions (codes and f16 scales
    /// bit-equal to deltaserve_cpu::kvquant), then (unless `special`) prefill attention of the new
    /// tokens, or decode with `n_split`, against the CPU attention over the CPU-dequantised cache.
    /// `special` adds all-zero, tiny, huge (saturating) and ±inf rows and checks the write only.
    KvQ {
        fk: KvDtype,
        fv: KvDtype,
        seqs: Vec<(usize, usize)>,
        hq: usize,
        hkv: usize,
        page: usize,
        n_split: Option<usize>,
        special: bool,
    },
    /// A sparse layer's routed experts: `t` tokens of width `h`, top `top_k` of `experts` experts of
    /// width `i` (see tests/ops/moe.rs).
    Moe {
        t: usize,
        experts: usize,
        top_k: usize,
        h: usize,
        i: usize,
        norm: bool,
        routing: moe::Routing,
    },
}

#[test]
fn ops_match_cpu_reference() {
    if !LibStatus::probe().driver {
        eprintln!("SKIP ops: no CUDA driver (libcuda) on this machine");
        return;
    }
    let rt = Runtime::open(0).expect("CUDA driver present but the device could not be opened");
    // DS_OPS_SEED=<u64>: a printed seed again (a failing run's inputs reproduced); else from the clock.
    let seed = std::env::var("DS_OPS_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(1));
    println!("device {} ({}), seed {seed}", rt.name, rt.arch());
    let mut kernels: Vec<(KernelDims, Kernels)> = Vec::new();
    let mut failures = Vec::new();
    // DS_OPS_FILTER=<substring>[,<substring>…]: only the cases whose name contains one of them (quick device runs).
    let filter = std::env::var("DS_OPS_FILTER").unwrap_or_default();
    for (i, case) in cases().into_iter().enumerate() {
        if !filter.split(',').any(|f| case.name.contains(f)) {
            continue;
        }
        if !kernels.iter().any(|(d, _)| *d == case.dims) {
            let k = Kernels::load(&rt, case.dims).expect("kernel load");
            println!("loaded kernels for {:?} in {:.0} ms", case.dims, k.load_ms);
            kernels.push((case.dims, k));
        }
        let k = &kernels.iter().find(|(d, _)| *d == case.dims).expect("loaded").1;
        let mut rng = StdRng::seed_from_u64(seed.wrapping_add(i as u64));
        let outcomes = match run_case(&rt, k, &case, &mut rng) {
            Ok(o) => o,
            Err(e) => vec![Outcome::error(format!("{e}"))],
        };
        for o in outcomes {
            println!(
                "{:<4} {:<22} {:<58} {}",
                if o.ok { "ok" } else { "FAIL" },
                case.name,
                format!("{:?}", case.op).chars().take(58).collect::<String>(),
                o.detail
            );
            if !o.ok {
                failures.push(format!("{} {:?}: {}", case.name, case.op, o.detail));
            }
        }
    }
    assert!(failures.is_empty(), "{} failing checks:\n{}", failures.len(), failures.join("\n"));
}

/// The host codec the GPU checks rely on: encode then decode gives deltaserve_cpu::kvquant's values.
#[test]
fn kvq_host_codec_matches_kvquant() {
    kv_quant::host_codec_matches_kvquant();
}

/// Timing (run explicitly: cargo test --release -p deltaserve-cuda --test ops -- --ignored).
#[test]
#[ignore = "benchmark; needs a GPU"]
fn bench_gdn_prefill_27b() {
    bench_gdn::prefill_27b();
}

/// What a case runs on: the device, the kernels loaded for its dims, the device's stream and the
/// case's tolerance.
#[derive(Clone, Copy)]
struct Env<'a> {
    rt: &'a Runtime,
    k: &'a Kernels,
    s: &'a CudaStream,
    tol: Tol,
}

/// The function that runs one kind of case (called with its `Op` variant only).
type CaseFn = fn(Env, &mut Dev, &mut StdRng, &Op) -> R<Vec<Outcome>>;

/// One case on a fresh arena region: the op's function in its family's module.
fn run_case(rt: &Runtime, k: &Kernels, case: &Case, rng: &mut StdRng) -> R<Vec<Outcome>> {
    let run: CaseFn = match case.op {
        Op::Embed { .. } => elementwise::embed,
        Op::Argmax { .. } => sampling::argmax,
        Op::Sample { .. } => sampling::sample,
        Op::AddRmsNorm { .. } => elementwise::add_rms_norm,
        Op::AddRmsNormParts { .. } => elementwise::add_rms_norm_parts,
        Op::RmsNormStrided { .. } => elementwise::rms_norm_strided,
        Op::GatedRmsNorm { .. } => elementwise::gated_rms_norm,
        Op::SigmoidGate { .. } => elementwise::sigmoid_gate,
        Op::Swiglu { .. } => elementwise::swiglu,
        Op::Rope { .. } => elementwise::rope,
        Op::QkNormRope { .. } => elementwise::qk_norm_rope,
        Op::QkNormRopeKv { .. } => elementwise::qk_norm_rope_kv,
        Op::QkNormRopeMrope { .. } => vision::qk_norm_rope_mrope,
        Op::VisionLayerNorm { .. } => vision::layer_norm,
        Op::VisionEmbedPos { .. } => vision::embed_pos,
        Op::VisionQkvRope { .. } => vision::qkv_rope,
        Op::VisionAttention { .. } => vision::attention,
        Op::VisionAttentionFrames { .. } => vision::attention_frames,
        Op::VisionBiasAct { .. } => vision::bias_act,
        Op::ConvPrefill { .. } => elementwise::conv_prefill,
        Op::ConvDecode { .. } => elementwise::conv_decode,
        Op::GdnConvGateDecode { .. } | Op::GdnConvGateRows { .. } => deltanet::conv_gate_decode,
        Op::GdnGate { .. } => deltanet::gate,
        Op::GdnChunk { .. } => deltanet::chunk,
        Op::GdnDecode { .. } => deltanet::decode,
        Op::GdnDecodeGated { .. } | Op::GdnRecurrentGated { .. } => deltanet::decode_gated,
        Op::GdnRows { .. } => gdn_rows::rows,
        Op::GdnCommitLayers { .. } => gdn_rows::commit_layers,
        Op::GdnRecurrent { .. } => deltanet::recurrent,
        Op::ConvAccept { .. } => elementwise::conv_accept,
        Op::MtpRows { .. } => elementwise::mtp_rows,
        Op::AttnPrefill { .. } => attention::prefill,
        Op::AttnPrefillTiled { .. } => attention::prefill_tiled,
        Op::AttnDecode { .. } => attention::decode,
        Op::Gemm { .. } => elementwise::gemm,
        Op::Gemv { .. } => elementwise::gemv,
        Op::Fp8Gemv { .. } => fp8::gemv,
        Op::Fp8Gemm { .. } => fp8::gemm,
        Op::Fp8SwigluQuant { .. } => fp8::swiglu_quant,
        Op::Fp8GatedNormQuant { .. } => fp8::gated_norm_quant,
        Op::Fp8NormQuant { .. } => fp8::norm_quant,
        Op::Fp8Quantize { .. } => fp8::quantize,
        Op::W4Gemv { .. } => w4::gemv,
        Op::W4GemvMulti { .. } => w4::gemv_multi,
        Op::W4Fold { .. } => w4::fold,
        Op::W4Dequant { .. } => w4::dequant,
        Op::W4Quantize { .. } => w4::quantize,
        Op::KvQ { .. } => kv_quant::kvq_case,
        Op::Moe { .. } => moe::moe_case,
    };
    let e = Env { rt, k, s: rt.stream(), tol: case.tol };
    let mut dev = Dev::new(rt, 1 << 30)?;
    let out = run(e, &mut dev, rng, &case.op)?;
    rt.synchronize()?;
    Ok(out)
}
