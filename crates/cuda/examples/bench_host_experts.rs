//! The routed experts of a decode step computed by the host CPU (`deltaserve_cuda::w4_host`), at a
//! mixture-of-experts model's shapes with int4 experts, against reading the same expert bytes across
//! the bus (`--experts-on-host` streams them to the GPU's kernels): can this machine's CPU beat its bus?
//!
//! `cargo run --release -p deltaserve-cuda --example bench_host_experts -- [PRESET] [TOKENS] [THREADS] [BUS_GBS]`
//!
//! - PRESET: `qwen3-next-80b-a3b` (default) or `qwen3.6-35b-a3b` (the shapes of `synth --preset`);
//! - TOKENS: rows of the decode step (default 1; each takes top-k experts of every sparse layer);
//! - THREADS: worker threads (default: every core);
//! - BUS_GBS: the host-read rate to compare with (default 55.1 GB/s, what the GPU kernels read pinned
//!   host memory at on an H200 machine: bench/results/fp8-weights-h200-2026-12-03.md).
//!
//! Random int4 experts (a pool of distinct experts several times the last-level cache, routed at random
//! so that no expert stays cached between layers), random x. Per sparse layer, the step's rows through
//! their top-k experts (`deltaserve_cuda::host_experts_mlp::routed_experts`: gate/up, SwiGLU, down,
//! weighted into each row's output, in row ranges over the threads). Prints the step's time, the int4
//! bytes it read and the rate, and the time those bytes take across the bus.

use std::time::Instant;

use deltaserve_cuda::host_experts_mlp::{ExpertView, Route, routed_experts};
use deltaserve_cuda::w4::{ScaleDtype, W4Linear};
use deltaserve_cuda::w4_host::W4HostView;
use deltaserve_model::ModelConfig;
use deltaserve_model::synth::Preset;
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use rayon::prelude::*;

/// Bytes of distinct experts to route over (several times any last-level cache).
const POOL_BYTES: usize = 3 << 30;

struct Expert {
    gate_up: W4Linear,
    down: W4Linear,
}

fn random_linear(out: usize, inp: usize, seed: u64) -> W4Linear {
    let mut rng = StdRng::seed_from_u64(seed);
    let ng = inp / 128;
    W4Linear {
        out_features: out,
        in_features: inp,
        qweight: (0..out * inp / 8).map(|_| rng.random::<u32>()).collect(),
        scales: (0..ng * out).map(|_| half::f16::from_f32(rng.random_range(1e-3f32..2e-2)).to_bits()).collect(),
        scale_dtype: ScaleDtype::F16,
        zeros: None,
        perm: None,
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let preset = args.first().map_or("qwen3-next-80b-a3b", String::as_str);
    let tokens: usize = args.get(1).and_then(|v| v.parse().ok()).unwrap_or(1).max(1);
    let threads: usize = args.get(2).and_then(|v| v.parse().ok()).unwrap_or(0);
    let bus_gbs: f64 = args.get(3).and_then(|v| v.parse().ok()).unwrap_or(55.1);
    let cfg = match Preset::parse(preset) {
        Ok(p) => ModelConfig::from_json_str(&p.config_json(None).to_string()),
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(2);
        }
    };
    let cfg = cfg.unwrap_or_else(|e| {
        eprintln!("{preset}: {e}");
        std::process::exit(2);
    });
    let Some(moe) = cfg.moe.clone() else {
        eprintln!("{preset} has no mixture-of-experts layers");
        std::process::exit(2);
    };
    if threads > 0 {
        rayon::ThreadPoolBuilder::new().num_threads(threads).build_global().ok();
    }
    let (h, width, top_k) = (cfg.hidden_size, moe.expert_intermediate, moe.top_k);
    let sparse = (0..cfg.layer_types.len()).filter(|&l| moe.is_sparse(l)).count();
    let expert_bytes = (2 * width * h + h * width) / 2 + 2 * (2 * width * h + h * width) / 128;
    let pool = (POOL_BYTES / expert_bytes).clamp(top_k * tokens, moe.num_experts * sparse);
    println!(
        "{preset}: {sparse} sparse layers, top-{top_k} of {} experts [{width} x {h}], {tokens} token(s), {} threads; \
         a pool of {pool} random int4 experts ({:.2} GB)",
        moe.num_experts,
        rayon::current_num_threads(),
        (pool * expert_bytes) as f64 / 1e9
    );
    let t0 = Instant::now();
    let experts: Vec<Expert> = (0..pool)
        .into_par_iter()
        .map(|e| Expert {
            gate_up: random_linear(2 * width, h, 2 * e as u64 + 11),
            down: random_linear(h, width, 2 * e as u64 + 12),
        })
        .collect();
    println!("made in {:.1} s", t0.elapsed().as_secs_f64());
    let views: Vec<ExpertView<'_>> = experts
        .iter()
        .map(|e| ExpertView {
            gate_up: W4HostView::of(&e.gate_up).expect("format"),
            down: W4HostView::of(&e.down).expect("format"),
        })
        .collect();
    let x: Vec<f32> = (0..tokens * h).map(|j| ((j * 31) % 97) as f32 / 97.0 - 0.5).collect();
    let mut out = vec![0f32; tokens * h];
    let mut rng = StdRng::seed_from_u64(0x2545_f491_4f6c_dd1d);

    let steps = 6;
    let mut best = f64::INFINITY;
    let mut sink = 0f32;
    for step in 0..steps {
        // The routing of every sparse layer: top_k distinct experts of the pool per token.
        let routes: Vec<Vec<usize>> = (0..sparse * tokens)
            .map(|_| {
                let mut r: Vec<usize> = Vec::with_capacity(top_k);
                while r.len() < top_k {
                    let e = rng.random_range(0..pool);
                    if !r.contains(&e) {
                        r.push(e);
                    }
                }
                r
            })
            .collect();
        let t0 = Instant::now();
        for layer in 0..sparse {
            let routes: Vec<Route> = (0..tokens)
                .flat_map(|t| routes[layer * tokens + t].iter().map(move |&e| Route { row: t, expert: e, weight: 0.1 }))
                .collect();
            routed_experts(&views, &x, h, &routes, &mut out).expect("routed experts");
            sink += out.iter().step_by(97).sum::<f32>();
        }
        let s = t0.elapsed().as_secs_f64();
        if step > 0 {
            best = best.min(s);
        }
    }
    let bytes = (sparse * tokens * top_k * expert_bytes) as f64;
    println!(
        "step ({tokens} token(s)): {:.2} ms for {:.1} MB of int4 experts = {:.1} GB/s on the CPU; across the bus at \
         {bus_gbs} GB/s: {:.2} ms ({:.2}x the CPU's time){}",
        best * 1e3,
        bytes / 1e6,
        bytes / best / 1e9,
        bytes / (bus_gbs * 1e9) * 1e3,
        bytes / (bus_gbs * 1e9) / best,
        if sink.is_nan() { " (NaN seen)" } else { "" }
    );
}
