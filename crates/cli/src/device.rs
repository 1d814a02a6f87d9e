//! Which backend `--device auto` picks, and why: CUDA when the driver, NVRTC, cuBLAS and a GPU are
//! all there, else the CPU with a log line naming what was missing.

use deltaserve_cuda::LibStatus;

use crate::model_source::Device;

/// The backend `--device auto` runs on; says why when it is the CPU.
pub fn auto() -> Device {
    let libs = LibStatus::probe();
    // Counting devices initialises the driver: only once every library is there.
    let gpus = libs.require_all().is_ok().then(|| deltaserve_cuda::device_count().map_err(|e| e.to_string()));
    match cpu_reason(libs, gpus) {
        None => Device::Cuda,
        Some(why) => {
            tracing::info!("--device auto: running on the CPU reference backend (slow): {why}");
            Device::Cpu
        }
    }
}

/// Why `auto` falls back to the CPU (None: CUDA). `gpus`: the driver's device count, when every library
/// was found.
fn cpu_reason(libs: LibStatus, gpus: Option<Result<usize, String>>) -> Option<String> {
    if let Err(e) = libs.require_all() {
        return Some(e.to_string());
    }
    match gpus {
        Some(Ok(0)) => Some("the NVIDIA driver reports no GPU (CUDA_VISIBLE_DEVICES?)".into()),
        Some(Err(e)) => Some(format!("the NVIDIA driver does not start: {e}")),
        Some(Ok(_)) | None => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_reason_names_what_is_missing() {
        let all = LibStatus { driver: true, nvrtc: true, cublas: true, cublaslt: true };
        assert_eq!(cpu_reason(all, Some(Ok(1))), None);
        let why = cpu_reason(LibStatus { driver: false, ..all }, None).unwrap();
        assert!(why.contains("libcuda.so.1") && why.contains("driver"), "{why}");
        let why = cpu_reason(LibStatus { nvrtc: false, ..all }, None).unwrap();
        assert!(why.contains("libnvrtc"), "{why}");
        let why = cpu_reason(LibStatus { cublas: false, ..all }, None).unwrap();
        assert!(why.contains("libcublas"), "{why}");
        assert!(cpu_reason(all, Some(Ok(0))).unwrap().contains("no GPU"));
        let why = cpu_reason(all, Some(Err("cuInit failed".into()))).unwrap();
        assert!(why.contains("cuInit failed"), "{why}");
    }
}
