//! Compiles every kernel for sm_80/86/89/90 with NVRTC (no GPU needed). Skips with a note when
//! libnvrtc is not found (see scripts/ci_nvrtc.sh for the pinned wheel).

use deltaserve_cuda::nvrtc::{
    CHECK_ARCHS, KernelDims, KernelsReport, SOURCES, WGMMA_SERIALISED, check_defines, kernels_check_where,
    nvrtc_present,
};

/// The small kernels a decode step launches once per layer (besides the int4 GEMVs, whose code is
/// mostly their main loop): their code is fetched cold at every launch, so it must stay small. An
/// unrolled `qk_norm_rope` of 9,104 instructions ran 2.7x slower than the 3,208-instruction one and
/// made the 27B step slower (bench/results/decode-small-kernels-h200-2026-12-01.md).
const PER_LAYER_DECODE_KERNELS: &[&str] =
    &["qk_norm_rope", "attn_decode_mma", "attn_decode_combine", "gdn_conv_gate_decode", "gdn_decode_gated", "swiglu8"];
/// Their budget: 64 KB of code.
const MAX_INSTRUCTIONS: usize = 4096;

fn oversized(report: &KernelsReport) -> Vec<String> {
    let mut bad = Vec::new();
    for l in &report.lines {
        for (k, n) in &l.code {
            if PER_LAYER_DECODE_KERNELS.contains(&k.as_str()) && *n > MAX_INSTRUCTIONS {
                bad.push(format!("{} {} {k}: {n} instructions", l.module, l.arch));
            }
        }
    }
    bad
}

#[test]
fn every_kernel_compiles_for_every_arch() {
    if !nvrtc_present() {
        eprintln!("SKIP kernels_check: libnvrtc not found (run scripts/ci_nvrtc.sh for LD_LIBRARY_PATH)");
        return;
    }
    let base = KernelDims::QWEN35_27B;
    // Every module at the 27B's dims; at the smaller head shapes only the modules whose defines change
    // (the others would build the same code again).
    let small = KernelDims { gdn_bv: 16, gqa_group: 4, attn_head_dim: 128, ..base };
    for (dims, all) in [(base, true), (small, false)] {
        let differs = |m: &str| all || check_defines(&dims, m) != check_defines(&base, m);
        let report = kernels_check_where(CHECK_ARCHS, &dims, differs).expect("NVRTC present but unusable");
        println!("{dims:?}\n{report}");
        assert!(report.all_ok(), "{report}");
        assert!(!report.lines.is_empty(), "no module builds at {dims:?}");
        // Every per-layer kernel built was measured (the size reading works), and none is over budget.
        for k in PER_LAYER_DECODE_KERNELS {
            let built = all || SOURCES.iter().any(|s| differs(s.module) && s.functions.contains(k));
            assert!(!built || report.lines.iter().any(|l| l.code.iter().any(|(n, _)| n == k)), "no code size for {k}");
        }
        let bad = oversized(&report);
        assert!(bad.is_empty(), "per-layer decode kernels over {MAX_INSTRUCTIONS} instructions:\n{}", bad.join("\n"));
        // The Hopper kernels' warpgroup products stay asynchronous (ptxas serialises them when registers an
        // issued product reads are written before its wait).
        let serialised: Vec<_> = report.lines.iter().filter(|l| l.detail.contains(WGMMA_SERIALISED)).collect();
        assert!(serialised.is_empty(), "wgmma serialised by ptxas: {serialised:#?}");
    }
}

/// The traced build (`DELTASERVE_TRACE`, src/trace.rs) compiles too: every kernel with its trace scope,
/// for the oldest and the newest arch. Its kernels carry the scope's record code (the sm_80 cubin differs
/// from the plain one).
#[test]
fn every_kernel_compiles_traced() {
    use deltaserve_cuda::nvrtc::compile;
    if !nvrtc_present() {
        eprintln!("SKIP kernels_check: libnvrtc not found (run scripts/ci_nvrtc.sh for LD_LIBRARY_PATH)");
        return;
    }
    let dims = KernelDims::QWEN35_27B;
    for arch in ["sm_80", "sm_90"] {
        for src in SOURCES {
            let mut defines = dims.defines(src.module);
            defines.extend(deltaserve_cuda::trace::ring_defines(0x7f00_0000_0000, 4096));
            let traced = compile(src, arch, &defines, false).unwrap_or_else(|e| panic!("{} {arch}: {e}", src.module));
            if arch == "sm_80" {
                let plain = compile(src, arch, &dims.defines(src.module), false).expect("plain build");
                // (Not always larger: the vision module's traced sm_80 cubin is smaller than its plain one.)
                assert!(traced.image != plain.image, "{} {arch}: the traced cubin is the plain one", src.module);
            }
        }
    }
}
