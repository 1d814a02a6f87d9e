//! Compiles every kernel for sm_80/86/89/90 with NVRTC (no GPU needed). Skips with a note when
//! libnvrtc is not found (see scripts/ci_nvrtc.sh for the pinned wheel).

use deltaserve_cuda::nvrtc::{CHECK_ARCHS, KernelDims, kernels_check, nvrtc_present};

#[test]
fn every_kernel_compiles_for_every_arch() {
    if !nvrtc_present() {
        eprintln!("SKIP kernels_check: libnvrtc not found (run scripts/ci_nvrtc.sh for LD_LIBRARY_PATH)");
        return;
    }
    for dims in
        [KernelDims::QWEN35_27B, KernelDims { gdn_bv: 16, gqa_group: 4, attn_head_dim: 128, ..KernelDims::QWEN35_27B }]
    {
        let report = kernels_check(CHECK_ARCHS, &dims).expect("NVRTC present but unusable");
        println!("{dims:?}\n{report}");
        assert!(report.all_ok(), "{report}");
    }
}
