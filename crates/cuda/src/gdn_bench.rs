//! Timing of the chunked DeltaNet prefill kernels ([`crate::ops::gdn_chunk`]) at one model's shape,
//! on random inputs made on the device: `deltaserve bench` and tests/ops/ report it in M tokens per
//! second per layer (the target: ≥ 8 M at the 27B shape; flash-linear-attention's rate on an
//! H200 in [`FLA_H200_MTOK`]).

use crate::ops::gdn_chunk::{self, GdnChunk, Precision, Walk};
use crate::ops::gdn_overlap::{self, Overlap, Rounds};
use crate::ops::init::{Init, init_random};
use crate::{Arena, CudaError, Kernels, Runtime};

/// Flash-linear-attention's `chunk_gated_delta_rule` on one H200 at the 27B DeltaNet shape, one
/// sequence of T tokens: (T, M tokens/s per layer) (`../shared/anchors/fla-chunk-gated-delta-rule-h200.json`).
pub const FLA_H200_MTOK: [(usize, f64); 6] =
    [(4128, 6.589), (8192, 9.401), (16384, 10.797), (32768, 10.974), (65536, 11.111), (131072, 11.425)];

/// FLA's rate at the measured sequence length nearest `tokens`: (that length, M tokens/s per layer).
pub fn fla_h200_nearest(tokens: usize) -> (usize, f64) {
    FLA_H200_MTOK.iter().copied().min_by_key(|&(t, _)| t.abs_diff(tokens)).unwrap_or((0, 0.0))
}

/// What [`time_gdn_prefill`] times: `seqs` sequences of `tokens / seqs` tokens (zero initial state) through
/// the kernels of one layer of `hk` key and `hv` value heads, `runs` times.
#[derive(Clone, Copy, Debug)]
pub struct GdnCase {
    pub hk: usize,
    pub hv: usize,
    pub tokens: usize,
    pub seqs: usize,
    pub prec: Precision,
    pub walk: Walk,
    /// Rows a piece of each sequence has when each piece's walk runs beside the next one's prep
    /// ([`gdn_overlap`]); 0: one prep, then one walk.
    pub piece: usize,
    pub runs: usize,
}

/// One shape's timing.
#[derive(Clone, Copy, Debug)]
pub struct GdnTiming {
    pub tokens: usize,
    pub seqs: usize,
    /// Medians over the runs (by the total): prep + walk, and each part (not timed apart when the pieces
    /// overlap); the fastest and slowest total.
    pub ms: f64,
    pub prep_ms: Option<f64>,
    pub state_ms: Option<f64>,
    pub min_ms: f64,
    pub max_ms: f64,
    pub runs: usize,
    /// The kernels' transient workspace for this step.
    pub workspace_bytes: usize,
    /// Non-finite values in the output (0 expected).
    pub nonfinite: usize,
    /// The walk that ran, and the rows of its pieces (0: one walk).
    pub walk: Walk,
    pub piece: usize,
}

impl GdnTiming {
    /// Millions of tokens per second through one layer.
    pub fn mtok_per_s(&self) -> f64 {
        self.tokens as f64 / (self.ms * 1e-3) / 1e6
    }
}

/// Device bytes [`time_gdn_prefill`] allocates for `t` tokens in `n_seqs` sequences.
pub fn gdn_bench_bytes(k: &Kernels, t: usize, n_seqs: usize, hk: usize, hv: usize) -> usize {
    let (dk, dv) = (k.dims.gdn_k_dim, k.dims.gdn_v_dim);
    let pad = |b: usize| b.div_ceil(256) * 256;
    gdn_chunk::workspace_bytes(t, hv, &k.dims)
        + 2 * pad(2 * t * hk * dk)            // q, k bf16
        + 2 * pad(2 * t * hv * dv)            // v, o bf16
        + 2 * pad(4 * t * hv)                 // g, beta f32
        + pad(4 * n_seqs * hv * dk * dv)      // state f32
        + 3 * pad(4 * (2 * n_seqs + 2 * (t / gdn_chunk::CHUNK + n_seqs) + 1)) // cu_seqlens, slots, chunk table
        // the rounds of pieces: chunk tables, and each round's boundaries and slots (at most 4 i32 a sequence)
        + pad(4 * (2 * t / gdn_chunk::CHUNK + 6 * t / gdn_overlap::MIN_PIECE + 6 * n_seqs + 8))
        + (1 << 20)
}

/// Times [`gdn_chunk::gdn_chunk_prep_with`] + [`gdn_chunk::gdn_chunk_state_walk`] with CUDA events:
/// `runs` timed launches after a warm-up (≥ 2 runs and ≥ 100 ms). Inputs: q and k with entries
/// N(0, 1/dk) (about unit norm, as after the L2 norm), v N(0, 1), g in [-0.5, 0], beta in
/// [0.05, 0.95]; the output and the workspace start poisoned (NaN). Allocates [`gdn_bench_bytes`] in
/// its own arena, freed on return.
pub fn time_gdn_prefill(rt: &Runtime, k: &Kernels, c: GdnCase) -> Result<GdnTiming, CudaError> {
    let GdnCase { hk, hv, tokens: t, seqs: n_seqs, prec, walk, piece, runs } = c;
    let bad = |msg: String| Err(CudaError::InvalidArgs { kernel: "time_gdn_prefill", msg });
    if t == 0 || n_seqs == 0 || !t.is_multiple_of(n_seqs) || runs == 0 {
        return bad(format!("{t} tokens in {n_seqs} equal sequences, {runs} runs"));
    }
    if piece > 0 && (piece < gdn_overlap::MIN_PIECE || !piece.is_multiple_of(gdn_chunk::CHUNK)) {
        return bad(format!(
            "pieces of {piece} rows: a multiple of {} from {}",
            gdn_chunk::CHUNK,
            gdn_overlap::MIN_PIECE
        ));
    }
    if piece > 0 && walk != k.gdn_walk {
        return bad(format!("pieces walk as the kernels do ({:?}), not {walk:?}", k.gdn_walk));
    }
    let (dk, dv) = (k.dims.gdn_k_dim, k.dims.gdn_v_dim);
    let s = rt.stream().clone();
    let mut arena = Arena::new(rt.context().clone());
    let r = arena.add_region("gdn bench", gdn_bench_bytes(k, t, n_seqs, hk, hv))?;
    let mut buf = |bytes: usize| arena.alloc(r, bytes).map(|span| span.ptr);
    let (q, kp, v, o) = (buf(2 * t * hk * dk)?, buf(2 * t * hk * dk)?, buf(2 * t * hv * dv)?, buf(2 * t * hv * dv)?);
    let (g, beta, state) = (buf(4 * t * hv)?, buf(4 * t * hv)?, buf(4 * n_seqs * hv * dk * dv)?);
    let cu: Vec<i32> = (0..=n_seqs).map(|i| (i * (t / n_seqs)) as i32).collect();
    let slots: Vec<i32> = (0..n_seqs as i32).collect();
    let table = gdn_chunk::chunk_table(&cu);
    let (cup, slp, tp) = (buf(4 * cu.len())?, buf(4 * slots.len())?, buf(4 * table.len())?);
    let ws_bytes = gdn_chunk::workspace_bytes(t, hv, &k.dims);
    let ws = buf(ws_bytes)?;
    let rounds = (piece > 0).then(|| Rounds::new(&cu, &slots, piece));
    let image = rounds.as_ref().map(Rounds::image).unwrap_or_default();
    let imp = buf(4 * image.len().max(1))?;

    let std_qk = 1.0 / (dk as f32).sqrt();
    init_random(k, &s, q, t * hk * dk, 11, Init::Normal(std_qk), false)?;
    init_random(k, &s, kp, t * hk * dk, 12, Init::Normal(std_qk), false)?;
    init_random(k, &s, v, t * hv * dv, 13, Init::Normal(1.0), false)?;
    // g and beta from a small LCG on the host (uniform in their ranges).
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    let mut uniform = move || {
        x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
        (x >> 40) as f32 / (1u64 << 24) as f32
    };
    let gv: Vec<f32> = (0..t * hv).map(|_| -0.5 * uniform()).collect();
    let bv: Vec<f32> = (0..t * hv).map(|_| 0.05 + 0.9 * uniform()).collect();
    rt.upload(g, &gv)?;
    rt.upload(beta, &bv)?;
    rt.upload(cup, &cu)?;
    rt.upload(slp, &slots)?;
    rt.upload(tp, &table)?;
    if !image.is_empty() {
        rt.upload(imp, &image)?;
    }
    let on_device = rounds.as_ref().map(|r| r.on_device(imp)).unwrap_or_default();
    let overlap = if piece > 0 { Some(Overlap::new(rt.context())?) } else { None };
    rt.memset(state, 0, 4 * n_seqs * hv * dk * dv)?;
    rt.memset(o, 0xff, 2 * t * hv * dv)?;
    rt.memset(ws, 0xff, ws_bytes)?;
    let a = GdnChunk {
        q,
        k: kp,
        v,
        v_stride: hv * dv,
        g,
        beta,
        state,
        cu_seqlens: cup,
        slots: slp,
        chunk_table: tp,
        n_chunks: table.len() / 2,
        o,
        workspace: ws,
        workspace_bytes: ws_bytes,
        n_seqs,
        t,
        hk,
        hv,
    };

    let timing = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
    let ev = || rt.context().new_event(timing).map_err(CudaError::driver("cuEventCreate"));
    let (e0, e1, e2) = (ev()?, ev()?, ev()?);
    let rec = |e: &cudarc::driver::CudaEvent| e.record(&s).map_err(CudaError::driver("cuEventRecord"));
    let elapsed = |a: &cudarc::driver::CudaEvent, b: &cudarc::driver::CudaEvent| {
        a.elapsed_ms(b).map(f64::from).map_err(CudaError::driver("cuEventElapsedTime"))
    };
    // One run; `timed`: the events recorded before it, between its prep and walk (one walk only) and after it.
    let run = |timed: Option<[&cudarc::driver::CudaEvent; 3]>| -> Result<(), CudaError> {
        let mark = |i: usize| timed.map_or(Ok(()), |e| rec(e[i]));
        mark(0)?;
        if let Some(ov) = &overlap {
            gdn_overlap::gdn_chunk_overlapped(k, &s, ov, &a, &on_device, prec)?;
        } else {
            gdn_chunk::gdn_chunk_prep_with(k, &s, &a, prec)?;
            mark(1)?;
            gdn_chunk::gdn_chunk_state_walk(k, &s, &a, prec, walk)?;
        }
        mark(2)
    };
    // Warm-up: at least two runs and 100 ms of them, so that the clocks have left an idle state (a
    // single warm-up run measured the first small case ~8% slow right after kernel compilation).
    let warm = std::time::Instant::now();
    let mut warm_runs = 0;
    while warm_runs < 2 || (warm.elapsed().as_secs_f64() < 0.1 && warm_runs < 1000) {
        run(None)?;
        rt.synchronize()?;
        warm_runs += 1;
    }
    // [total, prep, walk] per timed run.
    let mut times: Vec<[f64; 3]> = Vec::with_capacity(runs);
    for _ in 0..runs {
        run(Some([&e0, &e1, &e2]))?;
        let total = elapsed(&e0, &e2)?;
        let parts = if overlap.is_some() { [f64::NAN; 2] } else { [elapsed(&e0, &e1)?, elapsed(&e1, &e2)?] };
        times.push([total, parts[0], parts[1]]);
    }
    times.sort_by(|x, y| x[0].total_cmp(&y[0]));
    let [ms, prep_ms, state_ms] = times[times.len() / 2];
    let mut out = vec![0u16; t * hv * dv];
    rt.download(&mut out, o)?;
    // bf16 NaN or infinity: all exponent bits set.
    let nonfinite = out.iter().filter(|&&b| b & 0x7f80 == 0x7f80).count();
    Ok(GdnTiming {
        tokens: t,
        seqs: n_seqs,
        ms,
        prep_ms: (!prep_ms.is_nan()).then_some(prep_ms),
        state_ms: (!state_ms.is_nan()).then_some(state_ms),
        min_ms: times[0][0],
        max_ms: times[times.len() - 1][0],
        runs,
        workspace_bytes: ws_bytes,
        nonfinite,
        walk,
        piece,
    })
}
