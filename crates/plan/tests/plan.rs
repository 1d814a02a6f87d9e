//! The plan against hand arithmetic from `docs/architecture.md` §4 and §6, its invariants, and its errors.

use deltaserve_model::ModelConfig;
use deltaserve_model::synth::Preset;
use deltaserve_plan::{KvDtype, Plan, PlanBackend, PlanError, PlanOptions, StateDtype, WeightsDtype};

const GIB: u64 = 1 << 30;
const MIB: u64 = 1 << 20;

fn cfg(preset: &str, layers: Option<usize>) -> ModelConfig {
    Preset::parse(preset).unwrap().config(layers)
}

/// The GPU defaults priced for the generic regions alone (no CUDA backend scratch), as the design
/// doc's arithmetic counts them.
fn generic(budget: u64) -> PlanOptions {
    PlanOptions { backend: PlanBackend::Generic, ..PlanOptions::gpu_defaults(budget) }
}

fn int4_fp8(budget: u64) -> PlanOptions {
    PlanOptions { weights_dtype: WeightsDtype::Int4, k_dtype: KvDtype::Fp8, v_dtype: KvDtype::Fp8, ..generic(budget) }
}

/// `deltaserve plan --preset qwen3.6-27b --memory 24GiB --weights-dtype int4 --kv-cache-dtype fp8`, by hand.
#[test]
fn qwen36_27b_int4_fp8_24gib_by_hand() {
    let plan = Plan::new(&cfg("qwen3.6-27b", None), &int4_fp8(24 * GIB)).unwrap();

    // Weights (§6): decoder-linear params per layer kind, [out, in] shapes of §5.1.
    let gdn_linears = 10240 * 5120 + 6144 * 5120 + 2 * 48 * 5120 + 5120 * 6144; // qkv, z, b+a, out_proj
    let attn_linears = 2 * 24 * 256 * 5120 + 2 * 4 * 256 * 5120 + 5120 * 24 * 256; // q+gate, k+v, o_proj
    let mlp_linears = 3 * 17408 * 5120;
    assert_eq!(gdn_linears, 115_834_880);
    assert_eq!(attn_linears, 104_857_600);
    assert_eq!(mlp_linears, 267_386_880);
    let linear_params: u64 = 48 * (gdn_linears + mlp_linears) + 16 * (attn_linears + mlp_linears);
    assert_eq!(linear_params, 24_350_556_160); // §6: 2 × 24,350,556,160 FLOP per token
    // int4, group 128 along `in` (every `in` here is a multiple of 128), fp16 scale: 0.5 B + 2 B / 128 = 33/64 B.
    let linears = linear_params / 2 + linear_params / 128 * 2;
    assert_eq!(linears, 12_555_755_520); // §6: 12.56 GB
    // Norms, conv taps, A_log, dt_bias, gated-norm weight, q/k norms at bf16; every tensor starts 256-aligned,
    // so A_log and dt_bias ([48] bf16 = 96 B) take 256 B each. Everything else is a multiple of 256 already.
    let dense: u64 = 48 * (10240 * 4 * 2 + 2 * 256 + 128 * 2) + 16 * (2 * 256 * 2) + (64 * 2 + 1) * 5120 * 2;
    assert_eq!(dense, 5_291_008 + 48 * 2 * (256 - 96));
    let table = 248_320 * 5120 * 2; // embed and lm_head, bf16, untied
    let weights = linears + dense + 2 * table;
    assert_eq!(weights, 17_646_655_488); // §6: 17.65 GB (16.43 GiB)
    assert_eq!(plan.weights_bytes, weights);
    assert_eq!(plan.host_weights_bytes, 0);

    // KV (§4): 16 layers × (K + V) × 4 kv heads × (256 × 1 B fp8 + 2 B f16 scale).
    let kv_per_token: u64 = 16 * 2 * 4 * (256 + 2);
    assert_eq!(kv_per_token, 33_024);
    assert_eq!(plan.kv_bytes_per_token, kv_per_token);

    // DeltaNet state (§4): 48 × (f32 [48, 128, 128] + bf16 [3, 10240]).
    let state: u64 = 48 * (48 * 128 * 128 * 4 + 3 * 10240 * 2);
    assert_eq!(state, 153_944_064); // 146.8 MiB
    assert_eq!(plan.state_bytes_per_seq, state);
    assert_eq!(plan.num_state_slots, 16);
    assert_eq!(plan.snapshot_bytes, 8 * state);

    // Activations: the peak is at the DeltaNet core — residual [T, D] (bf16), x_norm [T, D] (the attention
    // projection of the section reads it later), z [T, 6144], the conv output [T, 10240] (decode's
    // recurrence reads v from it while writing its output), q|k [T, 4096], the core output [T, 6144] (bf16),
    // g and beta [T, 48] f32, the chunk tensors of the 79 chunks a step can hold (A [48, 64, 64] f32,
    // W and U [48, 64, 128] bf16 each), plus the step inputs (one block live through the step: token_ids and
    // positions [T] i32 and four [S] i32 arrays padded to 256 B), and the folded norms' input [8, D] (bf16) and sums of squares [D/32, 8] (f32),
    // live through every layer. First-fit reaches it.
    let t: u64 = 4096;
    let chunks = 79;
    let peak = t * 5120 * 2
        + t * 5120 * 2
        + t * (6144 + 10240 + 4096 + 6144) * 2
        + 2 * t * 48 * 4
        + chunks * 48 * 64 * (64 * 4 + 2 * 128 * 2)
        + 2 * t * 4
        + (17 * 4u64).next_multiple_of(256)
        + 3 * 256
        + 8 * 5120 * 2
        + 160 * 8 * 4;
    assert_eq!(plan.workspace.peak_live_bytes(), peak);
    assert_eq!(peak, 490_067_968); // 467.4 MiB
    // First-fit by lifetime packs the buffers into 4% more than the peak.
    let act = plan.activation_bytes;
    assert_eq!(act, 511_825_920); // 488.1 MiB

    let logits = 16 * 248_320 * 4;
    assert_eq!(plan.logits_bytes, logits);
    let tables = 16 * (262_144 / 32) * 4;
    assert_eq!(plan.block_table_bytes, tables);

    // Fixed regions (each a multiple of 256 already) + runtime reserve + CUDA graphs; KV pages take the rest in
    // whole pages.
    let fixed = weights + 16 * state + 8 * state + act + logits + tables + 32 * MIB + 600 * MIB + 64 * MIB;
    let left = 24 * GIB - fixed;
    let page = 32 * kv_per_token;
    let pages = left / page;
    assert_eq!(pages, 3000);
    assert_eq!(plan.num_kv_pages as u64, pages);
    assert_eq!(plan.page_size, 32);
    assert_eq!(plan.max_context as u64, pages * 32); // 96,000 < 262,144
    assert_eq!(plan.max_context, 96_000);
    assert_eq!(plan.max_full_context_seqs, 1);
    assert_eq!(plan.total_bytes, fixed + pages * page);
    assert_eq!(plan.budget_bytes, 24 * GIB);
    assert!(plan.budget_bytes - plan.total_bytes < page);
    assert_eq!((plan.max_batch_tokens, plan.max_seqs), (4096, 16));

    // Regions: arena order, 256-aligned, back to back.
    let names: Vec<_> = plan.regions.iter().map(|r| r.name).collect();
    assert_eq!(
        names,
        [
            "weights",
            "kv_pages",
            "state_slots",
            "snapshots",
            "activations",
            "logits",
            "block_tables",
            "gemm_workspace",
            "backend_scratch"
        ]
    );
    let sizes: Vec<u64> = plan.regions.iter().map(|r| r.bytes).collect();
    assert_eq!(sizes, [weights, pages * page, 16 * state, 8 * state, act, logits, tables, 32 * MIB, 0]);
    let mut off = 0;
    for r in &plan.regions {
        assert_eq!(r.offset, off, "{}", r.name);
        assert_eq!(r.offset % 256, 0);
        off += r.bytes.next_multiple_of(256);
    }
    assert_eq!(off + 600 * MIB + 64 * MIB, plan.total_bytes);
}

/// What the 27B gets at 24 GiB with int4 weights + fp8 KV, and which switches reach the full 262,144.
#[test]
fn qwen36_27b_24gib_context_by_switches() {
    let c = cfg("qwen3.6-27b", None);
    let ctx = |f: &dyn Fn(&mut PlanOptions)| {
        let mut o = int4_fp8(24 * GIB);
        f(&mut o);
        Plan::new(&c, &o).unwrap().max_context
    };
    assert_eq!(ctx(&|_| {}), 96_000);
    assert_eq!(ctx(&|o| o.embed_on_host = true), 172_992);
    assert_eq!(ctx(&|o| o.lm_head_int4 = true), 153_120);
    assert_eq!(
        ctx(&|o| {
            o.embed_on_host = true;
            o.lm_head_int4 = true;
        }),
        230_144
    );
    assert_eq!(
        ctx(&|o| {
            o.embed_on_host = true;
            o.lm_head_int4 = true;
            o.max_seqs = 8;
        }),
        262_144
    );
}

/// `--state-dtype bf16` halves the recurrent state of every slot and snapshot on the CUDA backend (the
/// conv state stays 16-bit); the generic (CPU) backend stores f32 either way; the freed bytes go to the KV.
#[test]
fn bf16_state_halves_the_recurrent_state() {
    let c = cfg("qwen3.6-27b", None);
    let cuda = |state| PlanOptions {
        state_dtype: state,
        weights_dtype: WeightsDtype::Int4,
        ..PlanOptions::gpu_defaults(24 * GIB)
    };
    let (f32s, bf16s) =
        (Plan::new(&c, &cuda(StateDtype::F32)).unwrap(), Plan::new(&c, &cuda(StateDtype::Bf16)).unwrap());
    let (recurrent, conv) = (48 * 128 * 128, 3 * 10240 * 2);
    assert_eq!(f32s.state_bytes_per_seq, 48 * (recurrent * 4 + conv));
    assert_eq!(bf16s.state_bytes_per_seq, 48 * (recurrent * 2 + conv));
    assert_eq!(bf16s.state_tensor_bytes(1), [recurrent * 2, conv]);
    assert!(bf16s.max_context > f32s.max_context, "{} vs {}", bf16s.max_context, f32s.max_context);
    let region = |p: &Plan, name| p.region(name).unwrap().bytes;
    assert!(region(&bf16s, "snapshots") < region(&f32s, "snapshots"));
    let generic16 = Plan::new(&c, &PlanOptions { state_dtype: StateDtype::Bf16, ..int4_fp8(24 * GIB) }).unwrap();
    assert_eq!(generic16.state_bytes_per_seq, f32s.state_bytes_per_seq);
}

#[test]
fn workspace_is_bounded_and_independent_of_context() {
    let c = cfg("qwen3.6-27b", None);
    let base = Plan::new(&c, &int4_fp8(24 * GIB)).unwrap();
    assert!(base.activation_bytes <= 3 * GIB / 2, "{}", base.activation_bytes);
    for mc in [1, 4096, 50_000, 96_000] {
        let p = Plan::new(&c, &PlanOptions { max_context: Some(mc), ..int4_fp8(24 * GIB) }).unwrap();
        assert_eq!(p.workspace, base.workspace, "max_context {mc}");
        assert_eq!(p.max_context, mc);
    }
    // A bigger budget (longer context) does not change it either; more tokens per step does.
    let big = Plan::new(&c, &int4_fp8(80 * GIB)).unwrap();
    assert_eq!(big.max_context, 262_144);
    assert_eq!(big.workspace, base.workspace);
    let small = Plan::new(&c, &PlanOptions { max_batch_tokens: 1024, ..int4_fp8(24 * GIB) }).unwrap();
    assert!(small.activation_bytes < base.activation_bytes / 3);
    // bf16 everything at 80 GiB: still bounded by the step.
    let bf16 = Plan::new(&c, &PlanOptions::gpu_defaults(80 * GIB)).unwrap();
    assert!(bf16.activation_bytes <= 3 * GIB / 2);
}

#[test]
fn max_context_is_monotone_in_budget() {
    let c = cfg("qwen3.6-27b", None);
    let mut last: Option<usize> = None;
    let mut budget = 16 * GIB;
    while budget <= 48 * GIB {
        match Plan::new(&c, &int4_fp8(budget)) {
            Ok(p) => {
                assert!(p.total_bytes <= budget);
                assert!(p.max_context >= last.unwrap_or(0), "budget {budget}");
                // Fragmentation: every full-context sequence holds whole pages.
                let per_seq = p.max_context.div_ceil(p.page_size);
                assert!(p.max_full_context_seqs >= 1);
                assert!(p.max_full_context_seqs * per_seq <= p.num_kv_pages);
                last = Some(p.max_context);
            }
            Err(e) => assert!(last.is_none(), "budget {budget} failed after a smaller one fit: {e}"),
        }
        budget += 128 * MIB;
    }
    assert_eq!(last, Some(262_144));
}

#[test]
fn errors_name_sizes_and_fixes() {
    let c = cfg("qwen3.6-27b", None);
    let e = Plan::new(&c, &int4_fp8(8 * GIB)).unwrap_err();
    assert!(matches!(e, PlanError::WeightsDoNotFit { .. }), "{e}");
    let m = e.to_string();
    for needle in ["16.43 GiB", "8.00 GiB", "--embed-on-host", "--memory"] {
        assert!(m.contains(needle), "`{needle}` missing: {m}");
    }
    let e = Plan::new(&c, &PlanOptions::gpu_defaults(24 * GIB)).unwrap_err();
    assert!(e.to_string().contains("--weights-dtype int4"), "{e}");
    // The CPU reference (f32 weights) takes none of the CUDA weight flags: the hints name what it takes.
    let tiny = cfg("tiny", None);
    for budget in [MIB, 5 * MIB] {
        let m = Plan::new(&tiny, &PlanOptions::cpu_defaults(budget)).unwrap_err().to_string();
        for cuda_only in ["--weights-dtype", "--embed-on-host", "--lm-head-int4"] {
            assert!(!m.contains(cuda_only), "`{cuda_only}` recommended on the CPU: {m}");
        }
        assert!(m.contains("raise --memory"), "{m}");
    }

    // Weights fit but the state slots do not.
    let e = Plan::new(&c, &int4_fp8(18 * GIB)).unwrap_err();
    assert!(matches!(e, PlanError::FixedRegionsDoNotFit { .. }), "{e}");
    let m = e.to_string();
    for needle in ["state slots 2.29 GiB", "snapshots 1.15 GiB", "--max-seqs", "18.00 GiB"] {
        assert!(m.contains(needle), "`{needle}` missing: {m}");
    }

    // Requested context too long for the budget.
    let e = Plan::new(&c, &PlanOptions { max_context: Some(200_000), ..int4_fp8(24 * GIB) }).unwrap_err();
    assert!(matches!(e, PlanError::ContextDoesNotFit { fits: 96_000, .. }), "{e}");
    let m = e.to_string();
    for needle in
        ["--max-context 200,000", "6.15 GiB of KV at fp8", "at most 96,000 tokens fit", "int4", "raise --memory"]
    {
        assert!(m.contains(needle), "`{needle}` missing: {m}");
    }

    // Longer than the model's positions.
    let e = Plan::new(&c, &PlanOptions { max_context: Some(300_000), ..int4_fp8(80 * GIB) }).unwrap_err();
    assert!(matches!(e, PlanError::ContextExceedsModel { .. }), "{e}");
    assert!(e.to_string().contains("262,144"), "{e}");

    // Not even one page: budget = exactly the fixed regions + half a page.
    let ok = Plan::new(&c, &int4_fp8(24 * GIB)).unwrap();
    let fixed = ok.total_bytes - ok.num_kv_pages as u64 * ok.kv_page_bytes();
    let e = Plan::new(&c, &int4_fp8(fixed + ok.kv_page_bytes() / 2)).unwrap_err();
    assert!(matches!(e, PlanError::NoKvPage { .. }), "{e}");
    assert!(e.to_string().contains("one KV page"), "{e}");
    let one = Plan::new(&c, &int4_fp8(fixed + ok.kv_page_bytes())).unwrap();
    assert_eq!((one.num_kv_pages, one.max_context), (1, 32));

    // Bad options.
    for o in [
        PlanOptions { max_seqs: 0, ..int4_fp8(24 * GIB) },
        PlanOptions { max_batch_tokens: 8, max_seqs: 16, ..int4_fp8(24 * GIB) },
        PlanOptions { page_size: 0, ..int4_fp8(24 * GIB) },
        PlanOptions { max_context: Some(0), ..int4_fp8(24 * GIB) },
    ] {
        assert!(matches!(Plan::new(&c, &o), Err(PlanError::InvalidOption { .. })));
    }
}

#[test]
fn json_has_the_keys() {
    let p = Plan::new(&cfg("qwen3.6-27b", None), &int4_fp8(24 * GIB)).unwrap();
    let j = p.to_json();
    for key in [
        "weights_bytes",
        "host_weights_bytes",
        "kv_bytes_per_token",
        "state_bytes_per_seq",
        "activation_bytes",
        "snapshot_bytes",
        "logits_bytes",
        "total_bytes",
        "budget_bytes",
        "max_context",
        "max_full_context_seqs",
        "num_kv_pages",
        "page_size",
        "regions",
        "workspace",
    ] {
        assert!(j.get(key).is_some(), "missing {key}");
    }
    assert_eq!(j["max_context"], 96_000);
    assert_eq!(j["regions"].as_array().unwrap().len(), p.regions.len());
    let t = p.table();
    assert!(t.contains("96,000 tokens") && t.contains("16.43 GiB") && t.contains("%"), "{t}");
    let svg = p.svg();
    assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
    assert!(svg.contains("kv_pages") && svg.contains("mlp_gate_up"));
}

#[test]
fn host_embedding_and_int4_lm_head() {
    let c = cfg("qwen3.6-27b", None);
    let base = Plan::new(&c, &int4_fp8(24 * GIB)).unwrap();
    let host = Plan::new(&c, &PlanOptions { embed_on_host: true, ..int4_fp8(24 * GIB) }).unwrap();
    let table = 248_320 * 5120 * 2;
    assert_eq!(host.host_weights_bytes, table);
    assert_eq!(host.weights_bytes, base.weights_bytes - table);
    // The host gathers the step's rows and uploads [T, D] bf16.
    assert_eq!(host.workspace.get("embed_rows").unwrap().bytes, 4096 * 5120 * 2);
    // The chart draws the host embedding, apart from the budget; each region has its own colour.
    assert!(host.svg().contains("host memory, outside the budget: embedding 2.37 GiB"));
    assert!(!base.svg().contains("host memory"));
    let svg = host.svg();
    let fills: Vec<&str> = host
        .regions
        .iter()
        .filter(|r| r.bytes > 0)
        .map(|r| {
            let at = svg.find(&format!("<title>{}: ", r.name)).unwrap();
            let rect = &svg[svg[..at].rfind("<rect").unwrap()..at];
            rect.split("fill=\"").nth(1).unwrap().split('"').next().unwrap()
        })
        .collect();
    let mut distinct = fills.clone();
    distinct.sort();
    distinct.dedup();
    assert_eq!(distinct.len(), fills.len(), "regions share a colour: {fills:?}");
    assert!(base.workspace.get("embed_rows").is_none());
    let lm4 = Plan::new(&c, &PlanOptions { lm_head_int4: true, ..int4_fp8(24 * GIB) }).unwrap();
    assert_eq!(lm4.weights_bytes, base.weights_bytes - table + table / 4 + 248_320 * 40 * 2);
    // §6: 15.76 GB with lm_head int4.
    assert_eq!(lm4.weights_bytes / 10_000_000, 1575);
    // Asymmetric int4 adds packed zeros: §6 17.74 GB.
    let asym = Plan::new(&c, &PlanOptions { int4_asym: true, ..int4_fp8(24 * GIB) }).unwrap();
    assert_eq!((asym.weights_bytes + 5_000_000) / 10_000_000, 1774);
    // fp8 blocks: §6 29.45 GB; bf16 53.79 GB.
    let fp8 = Plan::new(&c, &PlanOptions { weights_dtype: WeightsDtype::Fp8Block, ..int4_fp8(40 * GIB) }).unwrap();
    assert_eq!((fp8.weights_bytes + 5_000_000) / 10_000_000, 2945);
    let bf16 = Plan::new(&c, &PlanOptions::gpu_defaults(80 * GIB)).unwrap();
    assert_eq!((bf16.weights_bytes + 5_000_000) / 10_000_000, 5379);
    assert_eq!(bf16.kv_bytes_per_token, 64 * 1024); // §4: 64 KiB/token at bf16
}

#[test]
fn small_and_odd_models() {
    // Tiny preset on the CPU defaults.
    let tiny = cfg("tiny", None);
    let p = Plan::new(&tiny, &PlanOptions::cpu_defaults(256 * MIB)).unwrap();
    assert_eq!(p.max_context, 262_144);
    assert!(p.total_bytes <= 256 * MIB);
    // 27B cut to 3 layers: DeltaNet only, no KV at all.
    let dn = cfg("qwen3.6-27b", Some(3));
    let p = Plan::new(&dn, &int4_fp8(24 * GIB)).unwrap();
    assert_eq!((p.kv_bytes_per_token, p.num_kv_pages, p.max_context), (0, 0, 262_144));
    assert_eq!(p.max_full_context_seqs, 16);
    // Mixed K/V dtypes.
    let c = cfg("qwen3.6-27b", None);
    let o = PlanOptions { k_dtype: KvDtype::Fp8, v_dtype: KvDtype::Int4, ..int4_fp8(24 * GIB) };
    assert_eq!(Plan::new(&c, &o).unwrap().kv_bytes_per_token, 16 * 4 * (258 + 130));
}

/// The `kv_pages` and `state_slots` regions hold their per-layer tensors, each 256-aligned, for any page size.
#[test]
fn regions_hold_their_aligned_tensors() {
    let al = |x: u64| x.next_multiple_of(256);
    for preset in ["tiny", "qwen3.6-27b"] {
        let c = cfg(preset, None);
        let d = c.dims();
        for page_size in [1, 7, 16, 32, 33] {
            for (k, v) in [(KvDtype::Bf16, KvDtype::Bf16), (KvDtype::Fp8, KvDtype::Int4), (KvDtype::F32, KvDtype::Int8)]
            {
                let budget = if preset == "tiny" { GIB } else { 40 * GIB };
                let o = PlanOptions {
                    page_size,
                    k_dtype: k,
                    v_dtype: v,
                    weights_dtype: WeightsDtype::Int4,
                    ..PlanOptions::gpu_defaults(budget)
                };
                let p = Plan::new(&c, &o).unwrap();
                let kv: u64 = p.kv_tensor_bytes().iter().map(|&x| al(x)).sum();
                assert_eq!(p.region("kv_pages").unwrap().bytes, d.num_attention_layers as u64 * kv);
                let st: u64 = p.state_tensor_bytes(p.max_seqs).iter().map(|&x| al(x)).sum();
                assert_eq!(p.region("state_slots").unwrap().bytes, d.num_deltanet_layers as u64 * st);
                assert!(p.total_bytes <= budget);
                assert!(p.budget_bytes - p.total_bytes < p.kv_page_bytes() + 4 * 256 * d.num_attention_layers as u64);
            }
        }
    }
}
