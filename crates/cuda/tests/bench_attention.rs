//! Benchmark of the paged attention kernels at the Qwen3.6-27B attention shape (24 q heads, 4 kv
//! heads, head dim 256, page 32), random bf16 K/V/Q generated on the GPU, scrambled block table:
//! `cargo test -p deltaserve-cuda --release --test bench_attention -- --ignored --nocapture`.
//!
//! attn_prefill: 4096 queries (one chunked-prefill step) after 0 / 28,672 / 126,976 / 258,048 past
//! keys, causal; q in the backend's q|gate layout. Time: CUDA events around each launch, 2 warm-up
//! launches, median of the timed ones. FLOPs = 4 · head_dim · q_heads · Σ_queries visible keys.
//! Compared with the bf16 GEMM rate (766 TFLOP/s) and PyTorch SDPA's Hopper kernels at the same
//! shapes (/work/shared/anchors/rooflines-h200.json; built-in copies when the file is absent).
//!
//! attn_decode: 1 query per sequence at 32K context, batch 1 and 8, 16 / 32 / 64 partitions, each
//! on attn_decode_split and attn_decode_mma: K/V bytes read per second against the 4.26 TB/s device
//! copy rate of the same anchors file. Then over fp8 and int4 caches at 4K / 32K / 128K context.
//!
//! On Hopper the default prefill kernel is the warp-specialised one (`attn_prefill_ws`: a TMA producer
//! warpgroup); the warpgroup one (`attn_prefill_wg`, wgmma) and the wide one (mma.sync) run beside it.
//! Then both Hopper kernels over an fp8 cache (random codes, scales 1.0: timing only);
//! DS_BENCH_ATTN=prefill-fp8 runs those alone.
//!
//! DS_BENCH_ATTN=verify: speculative verify chunks of 4 rows (fp8 K/V) at 1K–128K context, 1 / 4 / 8
//! chunks, each row a decode query on attn_decode_mma (16 partitions, the backend's) against each chunk's
//! rows together on attn_verify_mma (splits for whole waves, as the backend picks them).

use std::sync::Arc;

use cudarc::driver::CudaStream;
use cudarc::driver::sys::CUevent_flags;
use deltaserve_cuda::ops::attention::{self, AttnDecode, AttnPrefill, KvPages, KvScales};
use deltaserve_cuda::ops::init::{Init, init_random};
use deltaserve_cuda::{Arena, AttnTiling, KernelDims, Kernels, KvFormats, LibStatus, Runtime};
use deltaserve_plan::KvDtype;
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

const HQ: usize = 24;
const HKV: usize = 4;
const HD: usize = 256;
const PAGE: usize = 32;
const TQ: usize = 4096;
const MAX_CTX: usize = 262_144;
const GEMM_TFLOPS: f64 = 766.0;

/// SDPA (Hopper kernels) TFLOP/s for 4096 causal queries at a total context, and the copy rate.
fn anchors() -> (Vec<(usize, f64)>, f64) {
    let path = std::env::var("DS_ROOFLINES").unwrap_or_else(|_| "/work/shared/anchors/rooflines-h200.json".into());
    let builtin = (vec![(4096, 517.2), (32768, 752.5), (131_072, 672.0)], 4.263);
    let Ok(text) = std::fs::read_to_string(&path) else {
        return builtin;
    };
    let Ok(v) = serde_json::from_str::<serde_json::Value>(&text) else {
        return builtin;
    };
    let mut sdpa = Vec::new();
    for ctx in [4096usize, 32768, 131_072, 262_144] {
        if let Some(t) = v.get(format!("sdpa_q4096_ctx{ctx}")).and_then(|e| e.get("TFLOPs")).and_then(|t| t.as_f64()) {
            sdpa.push((ctx, t));
        }
    }
    let copy = v.get("copy_TBps").and_then(|c| c.as_f64()).unwrap_or(builtin.1);
    (if sdpa.is_empty() { builtin.0 } else { sdpa }, copy)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Median milliseconds of `f` (CUDA events around each call) after 2 warm-up calls.
fn time_ms(rt: &Runtime, runs: usize, mut f: impl FnMut(&Arc<CudaStream>)) -> f64 {
    let s = rt.stream();
    let flags = Some(CUevent_flags::CU_EVENT_DEFAULT);
    let (e0, e1) = (rt.context().new_event(flags).unwrap(), rt.context().new_event(flags).unwrap());
    for _ in 0..2 {
        f(s);
    }
    rt.synchronize().unwrap();
    let mut times = Vec::new();
    for _ in 0..runs {
        e0.record(s).unwrap();
        f(s);
        e1.record(s).unwrap();
        times.push(e0.elapsed_ms(&e1).unwrap() as f64);
    }
    median(times)
}

#[test]
#[ignore]
fn bench_attn_prefill_27b() {
    if !LibStatus::probe().driver {
        eprintln!("SKIP bench_attention: no CUDA driver");
        return;
    }
    let rt = Runtime::open(0).unwrap();
    let k = Kernels::load(&rt, KernelDims::QWEN35_27B).unwrap();
    println!("device {} ({}), kernels loaded in {:.0} ms", rt.name, rt.arch(), k.load_ms);
    let (sdpa, copy_tbps) = anchors();
    let width = HKV * HD;
    let n_pages = MAX_CTX / PAGE;
    let cache_elems = MAX_CTX * width;
    let q_tok = 2 * HQ * HD; // q|gate projection rows, like the backend
    let mut arena = Arena::new(rt.context().clone());
    let scale_bytes = 2 * MAX_CTX * HKV; // one f16 scale per cache row and kv head (the fp8 decode runs)
    let reg = arena
        .add_region("bench", 2 * 2 * cache_elems + 2 * scale_bytes + 2 * TQ * q_tok + 2 * TQ * HQ * HD + (64 << 20))
        .unwrap();
    let kc = arena.alloc(reg, 2 * cache_elems).unwrap().ptr;
    let vc = arena.alloc(reg, 2 * cache_elems).unwrap().ptr;
    let ksc = arena.alloc(reg, scale_bytes).unwrap().ptr;
    let vsc = arena.alloc(reg, scale_bytes).unwrap().ptr;
    let q = arena.alloc(reg, 2 * TQ * q_tok).unwrap().ptr;
    let o = arena.alloc(reg, 2 * TQ * HQ * HD).unwrap().ptr;
    let s = rt.stream();
    init_random(&k, s, kc, cache_elems, 11, Init::Normal(1.0), false).unwrap();
    init_random(&k, s, vc, cache_elems, 12, Init::Normal(1.0), false).unwrap();
    init_random(&k, s, q, TQ * q_tok, 13, Init::Normal(1.0), false).unwrap();
    // Physical pages in a scrambled order (as a long-running server's free list hands them out).
    let mut rng = StdRng::seed_from_u64(7);
    let mut perm: Vec<i32> = (0..n_pages as i32).collect();
    for i in (1..perm.len()).rev() {
        let j = rng.random_range(0..=i);
        perm.swap(i, j);
    }
    let bt = arena.alloc(reg, 4 * n_pages).unwrap().ptr;
    rt.upload(bt, &perm).unwrap();
    let small = arena.alloc(reg, 1 << 20).unwrap().ptr;
    let (cu_p, lens_p, tiles_p) = (small, small + 4096, small + 8192);
    let kv = KvPages {
        k_cache: kc,
        v_cache: vc,
        block_tables: bt,
        max_blocks: n_pages,
        page: PAGE,
        kv_heads: HKV,
        rows: n_pages * PAGE,
    };
    let scale = 1.0 / (HD as f32).sqrt();

    // Every tiling the device's shared memory allows: the shipped default first (none with
    // DS_BENCH_ATTN=decode / verify: the decode / verify kernels only; with DS_BENCH_ATTN=prefill: the default and the
    // warp-pair kernel's default tiling, no decode).
    let mode = std::env::var("DS_BENCH_ATTN").unwrap_or_default();
    let no_bf16_prefill = mode == "decode" || mode == "verify" || mode == "prefill-fp8";
    // On Hopper the warpgroup kernel beside the default warp-specialised one (a TMA producer).
    let mut tilings = if no_bf16_prefill {
        Vec::new()
    } else {
        vec![AttnTiling { tma: false, ..AttnTiling::DEFAULT }, AttnTiling::DEFAULT]
    };
    for keys in [32, 64].into_iter().filter(|_| !no_bf16_prefill) {
        let t = AttnTiling { keys, wgmma: false, ..AttnTiling::DEFAULT };
        if !tilings.contains(&t) {
            tilings.push(t);
        }
    }
    let grid: &[(usize, usize)] = if mode == "prefill" { &[(32, 6)] } else { &[(32, 6), (32, 3), (32, 2), (64, 3)] };
    for &(keys, heads) in grid.iter().filter(|_| !no_bf16_prefill) {
        for p_split in [true, false].into_iter().filter(|&p| !(p && mode == "prefill")) {
            let t = AttnTiling { keys, p_split, heads, wide: false, wgmma: false, tma: false };
            if !tilings.contains(&t) {
                tilings.push(t);
            }
        }
    }
    // The prefill table of `kt` over the cache as it holds (codes with their scales `sc`): a row a past.
    let prefill_rows = |kt: &Kernels, sc: &KvScales| {
        println!(
            "{:>8} {:>8} {:>10} {:>9} {:>8} {:>10} {:>8}",
            "past", "keys", "ms", "TFLOP/s", "/GEMM", "SDPA", "/SDPA"
        );
        for past in [0usize, 28_672, 126_976, 258_048] {
            let cu = [0i32, TQ as i32];
            let lens = [(past + TQ) as i32];
            let tiles = attention::tile_table(kt, &cu);
            rt.upload(cu_p, &cu).unwrap();
            rt.upload(lens_p, &lens).unwrap();
            rt.upload(tiles_p, &tiles).unwrap();
            let a = AttnPrefill {
                q,
                q_tok,
                q_head: 2 * HD,
                o,
                kv,
                cu_seqlens: cu_p,
                seq_lens: lens_p,
                tile_table: tiles_p,
                n_tiles: tiles.len() / 2,
                q_heads: HQ,
                scale,
            };
            let runs = if past > 100_000 { 5 } else { 9 };
            let ms = time_ms(&rt, runs, |s| attention::attn_prefill_q(kt, s, &a, sc).unwrap());
            let visible = (TQ * past + TQ * (TQ + 1) / 2) as f64;
            let tflops = 4.0 * (HD * HQ) as f64 * visible / (ms * 1e-3) / 1e12;
            let ctx = past + TQ;
            let sd = sdpa.iter().find(|(c, _)| *c == ctx).map(|(_, t)| *t);
            println!(
                "{past:>8} {ctx:>8} {ms:>10.3} {tflops:>9.1} {:>7.0}% {:>10} {:>8}",
                100.0 * tflops / GEMM_TFLOPS,
                sd.map(|t| format!("{t:.1}")).unwrap_or_else(|| "-".into()),
                sd.map(|t| format!("{:.0}%", 100.0 * tflops / t)).unwrap_or_else(|| "-".into()),
            );
        }
    };
    for tiling in tilings {
        let kt = match Kernels::load_tiled(&rt, KernelDims::QWEN35_27B, KvFormats::BF16, tiling) {
            Ok(kt) => kt,
            Err(e) => {
                println!("attn_prefill {tiling:?}: not loaded ({e})");
                continue;
            }
        };
        let kernel = kt.attn_prefill_kernel();
        println!(
            "{kernel} {tiling:?}, 27B shape (Hq {HQ}, Hkv {HKV}, head dim {HD}, page {PAGE}), {TQ} causal queries:"
        );
        prefill_rows(&kt, &KvScales::default());
    }
    // Over an fp8 cache (the 24 GB configuration's): the warpgroup kernel (DELTASERVE_ATTN_PREFILL=wg) and
    // the warp-specialised one (the default there: K's codes as e4m3 products). Codes are random bytes and every scale 1.0
    // (timing only: some codes are NaN patterns). DS_BENCH_ATTN=prefill-fp8 runs these alone.
    if mode.is_empty() || mode == "prefill" || mode == "prefill-fp8" {
        let fp8 = KvFormats { k: KvDtype::Fp8, v: KvDtype::Fp8 };
        init_random(&k, s, kc, cache_elems / 4, 21, Init::Bits, false).unwrap();
        init_random(&k, s, vc, cache_elems / 4, 22, Init::Bits, false).unwrap();
        rt.upload(ksc, &vec![0x3c00u16; MAX_CTX * HKV]).unwrap();
        rt.upload(vsc, &vec![0x3c00u16; MAX_CTX * HKV]).unwrap();
        for tma in [false, true] {
            let tiling = AttnTiling { tma, ..AttnTiling::DEFAULT };
            let kq = match Kernels::load_tiled(&rt, KernelDims::QWEN35_27B, fp8, tiling) {
                Ok(kq) => kq,
                Err(e) => {
                    println!("attn_prefill fp8 {tiling:?}: not loaded ({e})");
                    continue;
                }
            };
            println!("{} over fp8 K/V {tiling:?}, {TQ} causal queries:", kq.attn_prefill_kernel());
            prefill_rows(&kq, &KvScales { k: ksc, v: vsc });
        }
    }
    if mode == "prefill" || mode == "prefill-fp8" {
        return;
    }
    if mode.is_empty() {
        // The fp8 runs above overwrote the bf16 cache the decode runs below read.
        init_random(&k, s, kc, cache_elems, 11, Init::Normal(1.0), false).unwrap();
        init_random(&k, s, vc, cache_elems, 12, Init::Normal(1.0), false).unwrap();
    }
    if mode == "verify" {
        bench_verify(&rt, KvPages { max_blocks: n_pages, ..kv }, (ksc, vsc), (q, o), small, &mut arena, copy_tbps);
        return;
    }
    // Decode: one query per sequence at 32K context, each sequence on its own pages.
    let ctx = 32_768usize;
    let scratch_bytes = attention::decode_scratch_bytes(8, HQ, 64, HD);
    let scratch = arena.alloc(reg, scratch_bytes).unwrap().ptr;
    // One query per row at `ctx` keys for `b` rows, each on its own pages; at most `n_split` partitions.
    let args = |ctx: usize, b: usize, n_split: usize| {
        rt.upload(lens_p, &vec![ctx as i32; b]).unwrap();
        AttnDecode {
            table_rows: 0,
            q,
            q_tok,
            q_head: 2 * HD,
            o,
            kv: KvPages { max_blocks: ctx / PAGE, ..kv },
            seq_lens: lens_p,
            n_seqs: b,
            q_heads: HQ,
            n_split,
            scratch,
            scratch_bytes,
            scale,
            gate: 0,
        }
    };
    // A row of the table: the kernel, the case (a, b), µs, and GB/s and share of the copy rate.
    let row = |mma: bool, a: usize, b: usize, ms: f64, bytes: usize| {
        let gbs = bytes as f64 / (ms * 1e-3) / 1e9;
        let name = if mma { "attn_decode_mma" } else { "attn_decode_split" };
        println!("{name:>18} {a:>8} {b:>6} {:>10.1} {gbs:>10.0} {:>7.0}%", ms * 1e3, 100.0 * gbs / (copy_tbps * 1e3));
    };
    println!("attn_decode, {ctx} context (a row uses one partition per 128 keys, up to the cap):");
    println!("{:>18} {:>8} {:>6} {:>10} {:>10} {:>8}", "kernel", "cap", "batch", "us", "GB/s", "/copy");
    let mut k = k;
    for (n_split, b, mma) in
        [16usize, 32, 64].into_iter().flat_map(|n| [(n, 1usize, false), (n, 1, true), (n, 8, false), (n, 8, true)])
    {
        let a = args(ctx, b, n_split);
        k.decode_mma = mma;
        let ms = time_ms(&rt, 21, |s| attention::attn_decode(&k, s, &a).unwrap());
        row(mma, n_split, b, ms, b * ctx * width * 2 * 2);
    }

    // Decode over quantised caches: fp8 (e4m3, the 24 GB configuration's) and int4: the split kernel
    // against the tensor-core one (attn_decode_mma), both with the backend's 32 partitions. Codes are
    // random bytes and every scale 1.0 (timing only: some fp8 codes are NaN patterns). Bytes = codes +
    // scales.
    let ones = vec![0x3c00u16; MAX_CTX * HKV];
    rt.upload(ksc, &ones).unwrap();
    rt.upload(vsc, &ones).unwrap();
    let scales = KvScales { k: ksc, v: vsc };
    for (fmt, name, row_bytes) in [(KvDtype::Fp8, "fp8", width), (KvDtype::Int4, "int4", width / 2)] {
        let mut kq = Kernels::load_kv(&rt, KernelDims::QWEN35_27B, KvFormats { k: fmt, v: fmt }).unwrap();
        init_random(&kq, s, kc, cache_elems / 4, 21, Init::Bits, false).unwrap();
        init_random(&kq, s, vc, cache_elems / 4, 22, Init::Bits, false).unwrap();
        println!("attn_decode {name} K/V, cap 32 partitions:");
        println!("{:>18} {:>8} {:>6} {:>10} {:>10} {:>8}", "kernel", "context", "batch", "us", "GB/s", "/copy");
        for ctx in [4096usize, 32_768, 131_072] {
            for b in [1usize, 8].into_iter().filter(|b| b * ctx <= MAX_CTX) {
                let a = args(ctx, b, 32);
                for mma in [false, true] {
                    kq.decode_mma = mma;
                    let ms = time_ms(&rt, 21, |s| attention::attn_decode_q(&kq, s, &a, &scales).unwrap());
                    row(mma, ctx, b, ms, b * ctx * (row_bytes + 2 * HKV) * 2);
                }
            }
        }
    }
}

/// Verify chunks of 4 rows (lengths ctx − 3 … ctx, each chunk on its own pages of `kv`'s scrambled
/// table) over an fp8 cache: row by row against grouped, µs and K/V bytes (one read of each chunk's
/// context) per second.
fn bench_verify(
    rt: &Runtime,
    kv: KvPages,
    (ksc, vsc): (u64, u64),
    (q, o): (u64, u64),
    small: u64,
    arena: &mut Arena,
    copy_tbps: f64,
) {
    const ROWS: usize = 4;
    let mut kq = Kernels::load_kv(rt, KernelDims::QWEN35_27B, KvFormats { k: KvDtype::Fp8, v: KvDtype::Fp8 }).unwrap();
    let s = rt.stream();
    let cache_elems = MAX_CTX * HKV * HD;
    init_random(&kq, s, kv.k_cache, cache_elems / 4, 21, Init::Bits, false).unwrap();
    init_random(&kq, s, kv.v_cache, cache_elems / 4, 22, Init::Bits, false).unwrap();
    rt.upload(ksc, &vec![0x3c00u16; MAX_CTX * HKV]).unwrap();
    rt.upload(vsc, &vec![0x3c00u16; MAX_CTX * HKV]).unwrap();
    let scales = KvScales { k: ksc, v: vsc };
    let scratch_bytes = attention::decode_scratch_bytes(8 * ROWS, HQ, 64, HD);
    let reg = arena.add_region("verify scratch", scratch_bytes + 256).unwrap();
    let scratch = arena.alloc(reg, scratch_bytes).unwrap().ptr;
    let (lens_p, rows_p, groups_p) = (small + 4096, small + 12288, small + 16384);
    let sms = attention::VERIFY_BLOCKS_PER_SM * rt.sm_count.max(1) as usize;
    println!("verify chunks of {ROWS} rows, fp8 K/V (bytes: each chunk's context read once):");
    println!(
        "{:>18} {:>8} {:>7} {:>7} {:>10} {:>10} {:>8}",
        "kernel", "context", "chunks", "splits", "us", "GB/s", "/copy"
    );
    for ctx in [1024usize, 4096, 32_768, 131_072] {
        for chunks in [1usize, 4, 8].into_iter().filter(|c| c * ctx <= MAX_CTX) {
            let lens: Vec<i32> = (0..chunks * ROWS).map(|r| (ctx - ROWS + 1 + r % ROWS) as i32).collect();
            let tables: Vec<i32> = (0..chunks * ROWS).map(|r| (r / ROWS) as i32).collect();
            let starts: Vec<i32> = (0..=chunks).map(|c| (c * ROWS) as i32).collect();
            rt.upload(lens_p, &lens).unwrap();
            rt.upload(rows_p, &tables).unwrap();
            rt.upload(groups_p, &starts).unwrap();
            let g = attention::RowGroups { starts: groups_p, n: chunks, max_rows: ROWS };
            let bytes = chunks * ctx * (HKV * HD + 2 * HKV) * 2;
            for grouped in [false, true] {
                kq.verify_mma = grouped;
                let n_split = if grouped { attention::wave_splits(sms, chunks * HKV, 64) } else { 16 };
                let a = AttnDecode {
                    q,
                    q_tok: 2 * HQ * HD,
                    q_head: 2 * HD,
                    o,
                    kv: KvPages { max_blocks: ctx / PAGE, ..kv },
                    seq_lens: lens_p,
                    table_rows: rows_p,
                    n_seqs: chunks * ROWS,
                    q_heads: HQ,
                    n_split,
                    scratch,
                    scratch_bytes,
                    scale: 1.0 / (HD as f32).sqrt(),
                    gate: 0,
                };
                let ms = time_ms(rt, 21, |s| attention::attn_verify_q(&kq, s, &a, &scales, &g).unwrap());
                let gbs = bytes as f64 / (ms * 1e-3) / 1e9;
                let name = if grouped { "attn_verify_mma" } else { "attn_decode_mma" };
                println!(
                    "{name:>18} {ctx:>8} {chunks:>7} {n_split:>7} {:>10.1} {gbs:>10.0} {:>7.0}%",
                    ms * 1e3,
                    100.0 * gbs / (copy_tbps * 1e3)
                );
            }
        }
    }
}
