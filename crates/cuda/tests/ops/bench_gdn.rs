//! The DeltaNet chunked prefill's throughput at the 27B shape, against the target and FLA's
//! measured H200 numbers (run explicitly: `cargo test --release -p deltaserve-cuda --test ops --
//! --ignored bench_gdn_prefill_27b`).

use deltaserve_cuda::gdn_bench::GdnCase;
use deltaserve_cuda::ops::gdn_chunk;
use deltaserve_cuda::ops::gdn_overlap::piece_for;
use deltaserve_cuda::{KernelDims, Kernels, LibStatus, Runtime};

use crate::harness::R;

/// Both precisions and both walks over one to eight sequences of 4K to 64K tokens.
pub fn prefill_27b() {
    if !LibStatus::probe().driver {
        eprintln!("SKIP bench: no CUDA driver");
        return;
    }
    let rt = Runtime::open(0).expect("open device");
    let k = Kernels::load(&rt, KernelDims::QWEN35_27B).expect("load");
    println!("device {} ({})", rt.name, rt.arch());
    let (split, one) = (gdn_chunk::Precision::Split, gdn_chunk::Walk::OneStream);
    // The kernels' walk, the one-stream walk where that is another, then plain bf16 operands.
    let mut kinds = vec![(split, k.gdn_walk)];
    kinds.extend((k.gdn_walk != one).then_some((split, one)));
    kinds.push((gdn_chunk::Precision::Bf16, one));
    // Pieces of these rows walked beside the next piece's prep (the kernels' walk; 0: one prep, one walk;
    // `DS_GDN_PIECES`: a comma-separated list instead).
    let pieces: Vec<usize> = std::env::var("DS_GDN_PIECES")
        .map(|v| v.split(',').filter_map(|p| p.trim().parse().ok()).collect())
        .unwrap_or_else(|_| vec![2048, 4096, 8192]);
    for (t, n_seqs) in [(4096usize, 1usize), (4096, 4), (16384, 1), (16384, 8), (65536, 1)] {
        let auto = piece_for(&k, t, n_seqs, 48);
        for piece in pieces.iter().copied().chain(Some(auto)).filter(|&p| p > 0 && p < t / n_seqs) {
            if let Err(e) = bench_gdn(&rt, &k, t, n_seqs, split, k.gdn_walk, piece) {
                panic!("bench failed: {e}");
            }
        }
    }
    for (prec, walk) in kinds {
        for (t, n_seqs) in [(4096usize, 1usize), (4096, 4), (16384, 1), (16384, 8), (65536, 1)] {
            if let Err(e) = bench_gdn(&rt, &k, t, n_seqs, prec, walk, 0) {
                panic!("bench failed: {e}");
            }
        }
    }
}

/// The prefill throughput target, M tokens/s per layer.
const GDN_TARGET_MTOK: f64 = 8.0;

fn bench_gdn(
    rt: &Runtime,
    k: &Kernels,
    t: usize,
    n_seqs: usize,
    prec: gdn_chunk::Precision,
    walk: gdn_chunk::Walk,
    piece: usize,
) -> R<()> {
    let (hk, hv) = (16usize, 48usize);
    let (dk, dv) = (k.dims.gdn_k_dim, k.dims.gdn_v_dim);
    let case = GdnCase { hk, hv, tokens: t, seqs: n_seqs, prec, walk, piece, runs: 10 };
    let r = deltaserve_cuda::gdn_bench::time_gdn_prefill(rt, k, case)?;
    let parts = match (r.prep_ms, r.state_ms) {
        (Some(p), Some(w)) => format!("prep {p:.3} + state {w:.3}"),
        _ => format!("pieces of {piece} rows, each walk beside the next prep"),
    };
    let mtok = r.mtok_per_s();
    // FLA at the nearest measured prompt length (one sequence).
    let (fla_t, fla) = deltaserve_cuda::gdn_bench::fla_h200_nearest(t / n_seqs);
    println!(
        "BENCH gdn_chunk 27B shape Hk={hk} Hv={hv} Dk={dk} Dv={dv} {prec:?} {walk:?} T={t} ({n_seqs} seqs): median {:.3} ms ({parts}) over {} runs (min {:.3}, max {:.3}) = {mtok:.2} M tokens/s per layer = {:.2}x the 8 M target, {:.2}x FLA at one {fla_t}-token sequence ({fla}); workspace {:.1} MiB ({} B/token); non-finite outputs {}",
        r.ms,
        r.runs,
        r.min_ms,
        r.max_ms,
        mtok / GDN_TARGET_MTOK,
        mtok / fla,
        r.workspace_bytes as f64 / (1 << 20) as f64,
        r.workspace_bytes / t,
        r.nonfinite,
    );
    assert_eq!(r.nonfinite, 0, "non-finite DeltaNet outputs");
    Ok(())
}
