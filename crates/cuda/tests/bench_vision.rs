//! Benchmark of the GPU vision tower at the Qwen3.6-27B tower's shapes (27 blocks of width 1152, 16 heads
//! of 72, MLP 4304, merger to 5120) with random weights generated on the GPU
//! (`cargo test -p deltaserve-cuda --release --test bench_vision -- --ignored --nocapture`).
//!
//! Encodes one 1024×1024 image (64×64 patches of 16 px: 4,096 patches, 1,024 prompt tokens) in a prefill
//! step of a 4-layer text model and times the step against the same step with text tokens in place of the
//! image: the difference is the tower. Reported against the bf16 dense roofline of the H200 (989 TFLOP/s):
//! the tower's GEMM FLOPs plus its attention's (scores and values, every patch over its image). Then the
//! tower's attention alone (`ops::vision::attention` at the image's shape on random q, k, v; CUDA events
//! around each launch, median), its share of the tower and its rate.

use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::sys::CUevent_flags;
use deltaserve_backend::{Backend, ChunkImage, ImagePatches, SeqChunk, StepBatch, step_logits};
use deltaserve_cuda::ops::init::{Init, init_random};
use deltaserve_cuda::ops::vision::{self as vk, Grid};
use deltaserve_cuda::{Arena, CudaBackend, KernelDims, Kernels, Runtime, WeightSource};
use deltaserve_model::ModelConfig;
use deltaserve_model::mrope::place_images;
use deltaserve_model::synth::Preset;
use deltaserve_plan::{Plan, PlanOptions};

/// bf16 dense tensor-core peak of the H200 (FLOP/s).
const H200_BF16: f64 = 989e12;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

/// Median milliseconds of one attention launch of the tower at an image of `side`² patches (`heads` of
/// `hd`, one frame) on random q, k, v: CUDA events around each of 20 launches after 2 warm-up ones.
fn attention_ms(side: usize, heads: usize, hd: usize) -> f64 {
    let rt = Runtime::open(0).unwrap();
    let k = Kernels::load(&rt, KernelDims::QWEN35_27B).unwrap();
    let n = side * side;
    let (qkv_elems, o_elems) = (3 * n * heads * hd, n * heads * hd);
    let mut arena = Arena::new(rt.context().clone());
    let reg = arena.add_region("bench", 2 * (qkv_elems + o_elems) + (1 << 20)).unwrap();
    let qkv = arena.alloc(reg, 2 * qkv_elems).unwrap().ptr;
    let o = arena.alloc(reg, 2 * o_elems).unwrap().ptr;
    let s = rt.stream();
    init_random(&k, s, qkv, qkv_elems, 5, Init::Normal(1.0), false).unwrap();
    let grid = Grid { t: 1, h: side, w: side, merge: 2 };
    let flags = Some(CUevent_flags::CU_EVENT_DEFAULT);
    let (e0, e1) = (rt.context().new_event(flags).unwrap(), rt.context().new_event(flags).unwrap());
    for _ in 0..2 {
        vk::attention(&k, s, qkv, o, heads, hd, grid).unwrap();
    }
    rt.synchronize().unwrap();
    let times = (0..20)
        .map(|_| {
            e0.record(s).unwrap();
            vk::attention(&k, s, qkv, o, heads, hd, grid).unwrap();
            e1.record(s).unwrap();
            e0.elapsed_ms(&e1).unwrap() as f64
        })
        .collect();
    median(times)
}

#[test]
#[ignore]
fn bench_vision_tower_27b() {
    if let Err(e) = Runtime::open(0) {
        println!("SKIP: {e}");
        return;
    }
    let cfg = ModelConfig::from_json_str(&Preset::Qwen36_27b.config_json(Some(4)).to_string()).unwrap();
    let v = cfg.vision.clone().unwrap();
    let side = 1024 / v.patch_size;
    let patches = side * side;
    let mut o = PlanOptions::gpu_defaults(40 << 30);
    o.max_context = Some(8192);
    o.max_seqs = 2;
    o.snapshot_slots = 1;
    o.max_image_tokens_per_step = Some(patches);
    let plan = Plan::new(&cfg, &o).unwrap();
    let mut be = CudaBackend::new(&cfg, WeightSource::RandomWeights { seed: 3 }, &plan, 1).unwrap();
    let it = be.image_tokens().expect("the plan prices the tower");
    let pixels = (0..patches * it.patch_len).map(|i| ((i * 31) % 97) as f32 / 48.5 - 1.0).collect();
    let img = Arc::new(ImagePatches { grid_thw: [1, side, side], pixels, hash: [1; 32] });
    let tokens = img.tokens(it.merge);
    let mut ids: Vec<u32> = vec![11, 12];
    ids.extend(std::iter::repeat_n(it.image_token_id, tokens));
    ids.extend([13, 14]);
    let placed = place_images(&ids, it.image_token_id, &[img.grid_thw], it.merge).unwrap();
    let pages: Vec<u32> = (0..(8192 / plan.page_size) as u32).collect();
    let step = |with_image: bool| {
        let images = if with_image { vec![ChunkImage { image: img.clone(), placed: placed[0] }] } else { Vec::new() };
        let tokens = if with_image { ids.clone() } else { ids.iter().map(|&t| t % 1000).collect() };
        StepBatch {
            pre: vec![],
            seqs: vec![SeqChunk {
                seq_id: 0,
                slot: 0,
                pages: pages.clone(),
                start: 0,
                tokens,
                want_logits: true,
                all_logits: false,
                draft: 0,
                greedy_draft_vocab: 0,
                rope_delta: 0,
                images,
                save_within: Vec::new(),
            }],
            post: vec![],
        }
    };
    let mut time = |with_image: bool| {
        let mut t = Vec::new();
        let mut logits = Vec::new();
        for i in 0..6 {
            logits.clear();
            let t0 = Instant::now();
            step_logits(&mut be, &step(with_image), &mut logits).unwrap();
            if i > 0 {
                t.push(t0.elapsed().as_secs_f64());
            }
        }
        assert!(logits.iter().all(|x| x.is_finite()));
        median(t)
    };
    let (with, without) = (time(true), time(false));
    let tower_s = (with - without).max(1e-9);
    let (n, h, i, m) = (patches as f64, v.hidden_size as f64, v.intermediate_size as f64, v.merge_unit() as f64);
    let blocks = v.depth as f64 * n * (2.0 * (4.0 * h * h + 2.0 * h * i) + 4.0 * n * h);
    let merger = 2.0 * (n / m) * (m * h * m * h + m * h * v.out_hidden_size as f64);
    let flops = 2.0 * n * h * v.patch_dim() as f64 + blocks + merger;
    println!(
        "BENCH vision tower, 1024x1024 image ({patches} patches, {tokens} tokens): {:.2} ms (step {:.2} ms with the \
         image, {:.2} ms with text); {:.1} TFLOP ({:.0} TFLOP/s) = {:.1}% of the bf16 roofline ({:.2} ms at 989 TFLOP/s)",
        tower_s * 1e3,
        with * 1e3,
        without * 1e3,
        flops / 1e12,
        flops / tower_s / 1e12,
        100.0 * flops / tower_s / H200_BF16,
        flops / H200_BF16 * 1e3
    );
    let (heads, hd) = (v.num_heads, v.head_dim());
    let attn_ms = attention_ms(side, heads, hd);
    let layers_ms = attn_ms * v.depth as f64;
    let attn_flops = 4.0 * n * n * (heads * hd) as f64;
    println!(
        "BENCH vision attention, {patches} patches x {heads} heads of {hd} (one frame): {attn_ms:.3} ms per block, \
         {layers_ms:.2} ms for the {} blocks = {:.0}% of the tower ({:.0} TFLOP/s); the tower without it: {:.2} ms",
        v.depth,
        100.0 * layers_ms / (tower_s * 1e3),
        attn_flops / (attn_ms * 1e-3) / 1e12,
        tower_s * 1e3 - layers_ms
    );
}

/// Where the tower's time goes: one pass of its 27 blocks at a 1024×1024 image's 4,096 patches, on random
/// activations and one block's random weights (every block reads the same ones), each op timed with CUDA
/// events and summed by kind (the first LayerNorm, each GEMM, the q/k rotary, attention, the residual adds
/// with the LayerNorms after them, bias + activation), with each GEMM's rate. Their sum against the tower's time in a step (above) is the host's
/// share (pixels, the step's other work).
#[test]
#[ignore]
fn bench_vision_tower_ops_27b() {
    let Ok(rt) = Runtime::open(0) else {
        println!("SKIP: no GPU");
        return;
    };
    let cfg = ModelConfig::from_json_str(&Preset::Qwen36_27b.config_json(Some(4)).to_string()).unwrap();
    let v = cfg.vision.clone().unwrap();
    let side = 1024 / v.patch_size;
    let n = side * side;
    let (h, heads, hd, inter) = (v.hidden_size, v.num_heads, v.head_dim(), v.intermediate_size);
    let wide_cols = (3 * h).max(inter);
    let k = Kernels::load(&rt, KernelDims::QWEN35_27B).unwrap();
    let ws_bytes = deltaserve_cuda::gemm::recommended_workspace_bytes(&rt);
    let weights = 2 * (3 * h * h + h * h + 2 * h * inter) + 2 * (3 * h + 2 * h + inter + 4 * h);
    let acts = 4 * n * h + 2 * n * h + 4 * n * wide_cols + 2 * n * wide_cols;
    let mut arena = Arena::new(rt.context().clone());
    let reg = arena.add_region("bench", weights + acts + ws_bytes + (16 << 20)).unwrap();
    let s = rt.stream();
    let mut buf = |len: usize, bytes_per: usize, fill: Option<(u64, Init)>| {
        let p = arena.alloc(reg, bytes_per * len).unwrap().ptr;
        if let Some((seed, init)) = fill {
            init_random(&k, s, p, len, seed, init, bytes_per == 4).unwrap();
        }
        p
    };
    let lin = |fan_in: usize, seed| Some((seed, Init::Normal(1.0 / (fan_in as f32).sqrt())));
    let qkv_w = buf(3 * h * h, 2, lin(h, 1));
    let proj_w = buf(h * h, 2, lin(h, 2));
    let fc1_w = buf(inter * h, 2, lin(h, 3));
    let fc2_w = buf(h * inter, 2, lin(inter, 4));
    let small = |seed| Some((seed, Init::Normal(0.02)));
    let (qkv_b, proj_b, fc1_b, fc2_b) =
        (buf(3 * h, 2, small(5)), buf(h, 2, small(6)), buf(inter, 2, small(7)), buf(h, 2, small(8)));
    let (ln_w, ln_b) = (buf(h, 2, Some((9, Init::OnePlusNormal(0.1)))), buf(h, 2, small(10)));
    let x = buf(n * h, 4, Some((11, Init::Normal(1.0))));
    let xn = buf(n * h, 2, Some((12, Init::Normal(1.0))));
    let (wide, narrow) = (buf(n * wide_cols, 4, None), buf(n * wide_cols, 2, None));
    let ws = buf(ws_bytes, 1, None);
    let gemm = deltaserve_cuda::gemm::Gemm::new(&rt, deltaserve_cuda::DevSpan { ptr: ws, bytes: ws_bytes }).unwrap();
    let grid = Grid { t: 1, h: side, w: side, merge: v.spatial_merge_size };
    let act = vk::Act::GeluTanh;
    let flags = Some(CUevent_flags::CU_EVENT_DEFAULT);
    let ev = || rt.context().new_event(flags).unwrap();
    let kinds = [
        "first layer norm",
        "qkv GEMM",
        "q/k rotary",
        "attention",
        "proj GEMM",
        "residual + norm",
        "fc1 GEMM",
        "bias + activation",
        "fc2 GEMM",
    ];
    let mut ms = vec![0.0f64; kinds.len()];
    let pass = |timed: bool, ms: &mut Vec<f64>| {
        for block in 0..v.depth {
            let mut op = |kind: usize, f: &mut dyn FnMut()| {
                let (e0, e1) = (ev(), ev());
                e0.record(s).unwrap();
                f();
                e1.record(s).unwrap();
                if timed {
                    ms[kind] += e0.elapsed_ms(&e1).unwrap() as f64;
                }
            };
            if block == 0 {
                op(0, &mut || vk::layer_norm(&k, s, x, None, ln_w, ln_b, xn, n, h, 1e-6).unwrap());
            }
            op(1, &mut || gemm.linear_out(s, xn, qkv_w, wide, n, 3 * h, h, true).unwrap());
            op(2, &mut || vk::qkv_rope(&k, s, wide, qkv_b, narrow, heads, hd, grid, v.rope_theta as f32).unwrap());
            op(3, &mut || vk::attention(&k, s, narrow, xn, heads, hd, grid).unwrap());
            op(4, &mut || gemm.linear_out(s, xn, proj_w, wide, n, h, h, true).unwrap());
            op(5, &mut || vk::layer_norm(&k, s, x, Some((wide, proj_b)), ln_w, ln_b, xn, n, h, 1e-6).unwrap());
            op(6, &mut || gemm.linear_out(s, xn, fc1_w, wide, n, inter, h, true).unwrap());
            op(7, &mut || vk::bias_act(&k, s, wide, fc1_b, narrow, n, inter, act).unwrap());
            op(8, &mut || gemm.linear_out(s, narrow, fc2_w, wide, n, h, inter, true).unwrap());
            op(5, &mut || vk::layer_norm(&k, s, x, Some((wide, fc2_b)), ln_w, ln_b, xn, n, h, 1e-6).unwrap());
        }
    };
    pass(false, &mut ms);
    rt.synchronize().unwrap();
    pass(true, &mut ms);
    let flops = |m: usize, kk: usize| 2.0 * (n * m * kk) as f64 * v.depth as f64;
    let gemm_flops = [(1, flops(3 * h, h)), (4, flops(h, h)), (6, flops(inter, h)), (8, flops(h, inter))];
    let total: f64 = ms.iter().sum();
    for (i, kind) in kinds.iter().enumerate() {
        let rate = gemm_flops.iter().find(|g| g.0 == i).map_or(String::new(), |g| {
            format!(
                " ({:.0} TFLOP/s, {:.0}% of 989)",
                g.1 / (ms[i] * 1e-3) / 1e12,
                100.0 * g.1 / (ms[i] * 1e-3) / H200_BF16
            )
        });
        println!("BENCH vision tower op, {} blocks at {n} patches: {kind:<18} {:7.2} ms{rate}", v.depth, ms[i]);
    }
    println!(
        "BENCH vision tower ops: {total:.2} ms for the {} blocks (the merger and patch embedding not included)",
        v.depth
    );
}
