//! Run-time compilation of the embedded CUDA C kernels with NVRTC, to a cubin for one exact
//! `sm_XY`, with `-D` specialisations (head dims, conv width, GQA group). Results are cached per
//! process (key: module, arch, options). [`kernels_check`] compiles every module for every
//! supported arch without a GPU (NVRTC alone, e.g. from the `nvidia-cuda-nvrtc` wheel).
//!
//! Kernels include no toolkit header: `kernels/prelude.cuh` (bf16 on raw bit patterns, warp
//! reductions) is prepended to each source as text. A module of several files is their text
//! concatenated, its shared header first (attention: `attention_tile.cuh`, the prefill kernels,
//! `attention_mma.cuh`, then the decode and the verify kernels). The attention module alone is also
//! built for sm_90a (`HOPPER_ARCH`) where its warpgroup prefill kernel runs.

use std::collections::HashMap;
use std::ffi::{CStr, CString, c_char};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use cudarc::nvrtc::{result, sys};

use crate::error::CudaError;

mod check;
mod defines;
mod sources;

pub use check::{
    CHECK_ARCHS, CHECK_KV, CheckLine, HOPPER_ARCH, KernelsReport, WGMMA_SERIALISED, check_defines, kernel_instructions,
    kernels_check, kernels_check_where,
};
pub use defines::{AttnTiling, KernelDims, KvFormats};
pub use sources::{KernelSource, SOURCES};

const PRELUDE: &str = include_str!("../kernels/prelude.cuh");

/// Whether libnvrtc can be dlopened.
pub fn nvrtc_present() -> bool {
    // SAFETY: only tries dlopen on candidate names.
    unsafe { sys::is_culib_present() }
}

/// NVRTC's (major, minor) version.
pub fn nvrtc_version() -> Result<(i32, i32), CudaError> {
    require_nvrtc("version")?;
    let (mut major, mut minor) = (0, 0);
    // SAFETY: writes two ints.
    unsafe { sys::nvrtcVersion(&mut major, &mut minor) }.result().map_err(|source| CudaError::Nvrtc {
        call: "nvrtcVersion",
        module: String::new(),
        cause: source,
    })?;
    Ok((major, minor))
}

fn require_nvrtc(_what: &str) -> Result<(), CudaError> {
    if nvrtc_present() {
        Ok(())
    } else {
        Err(CudaError::LibraryMissing {
            lib: "libnvrtc.so.13",
            hint: "install the CUDA 13 toolkit or the nvidia-cuda-nvrtc==13.0.* wheel and add its lib dir to LD_LIBRARY_PATH",
        })
    }
}

/// A compiled module.
#[derive(Clone)]
pub struct Cubin {
    pub module: &'static str,
    pub arch: String,
    pub image: Arc<Vec<u8>>,
    /// NVRTC's log (with `verbose`: ptxas register / spill lines).
    pub log: String,
    pub compile_ms: f64,
}

type CacheKey = (&'static str, String, Vec<String>);

fn cache() -> &'static Mutex<HashMap<CacheKey, Cubin>> {
    static CACHE: OnceLock<Mutex<HashMap<CacheKey, Cubin>>> = OnceLock::new();
    CACHE.get_or_init(|| Mutex::new(HashMap::new()))
}

/// Compiles `source` for `arch` (e.g. "sm_90") with `-D` defines; cached per process.
/// `verbose` adds ptxas's resource report to the log (and bypasses nothing: it is part of the key).
pub fn compile(
    source: &KernelSource,
    arch: &str,
    defines: &[(&str, String)],
    verbose: bool,
) -> Result<Cubin, CudaError> {
    require_nvrtc(source.module)?;
    let mut options = vec![
        format!("--gpu-architecture={arch}"),
        "-std=c++17".to_string(),
        "--device-as-default-execution-space".to_string(),
    ];
    if verbose {
        options.push("--ptxas-options=-v".to_string());
    }
    options.extend(defines.iter().map(|(k, v)| format!("-D{k}={v}")));
    // Experiments: extra options for every module (`-DNAME=VALUE` for a switch a kernel file reads
    // under #ifndef, to sweep it without rebuilding).
    options.extend(crate::switches::Switches::get().nvrtc_options.iter().cloned());
    let key = (source.module, arch.to_string(), options.clone());
    if let Ok(c) = cache().lock()
        && let Some(hit) = c.get(&key)
    {
        return Ok(hit.clone());
    }
    let t0 = Instant::now();
    // A traced build (crate::trace): every kernel body starts with the trace scope.
    let body = if crate::trace::is_traced(defines) {
        std::borrow::Cow::Owned(crate::trace::instrument(source.src))
    } else {
        source.src.into()
    };
    let (image, log) = compile_uncached(source.module, &format!("{PRELUDE}\n{body}"), arch, &options)?;
    let cubin = Cubin {
        module: source.module,
        arch: arch.to_string(),
        image: Arc::new(image),
        log,
        compile_ms: t0.elapsed().as_secs_f64() * 1e3,
    };
    if let Ok(mut c) = cache().lock() {
        c.insert(key, cubin.clone());
    }
    Ok(cubin)
}

fn compile_uncached(
    module: &'static str,
    src: &str,
    arch: &str,
    options: &[String],
) -> Result<(Vec<u8>, String), CudaError> {
    let nv = |call: &'static str| move |source| CudaError::Nvrtc { call, module: module.to_string(), cause: source };
    let c_src = CString::new(src).map_err(|_| CudaError::Compile {
        module: module.into(),
        arch: arch.into(),
        options: options.join(" "),
        log: "source contains a NUL byte".into(),
    })?;
    let name = CString::new(format!("{module}.cu")).unwrap_or_default();
    let prog = result::create_program(&c_src, Some(&name)).map_err(nv("nvrtcCreateProgram"))?;
    // SAFETY: `prog` is a live program until destroy_program below; options contain no NUL.
    let compiled = unsafe { result::compile_program(prog, options) };
    let log = unsafe { result::get_program_log(prog) }.map(|l| c_chars_to_string(&l)).unwrap_or_default();
    let out = match compiled {
        Err(_) => Err(CudaError::Compile {
            module: module.into(),
            arch: arch.into(),
            options: options.join(" "),
            log: log.clone(),
        }),
        Ok(()) => get_cubin(prog).map_err(nv("nvrtcGetCUBIN")),
    };
    // SAFETY: destroyed once.
    let _ = unsafe { result::destroy_program(prog) };
    out.map(|image| (image, log))
}

fn get_cubin(prog: sys::nvrtcProgram) -> Result<Vec<u8>, result::NvrtcError> {
    let mut size = 0usize;
    // SAFETY: `prog` compiled successfully; the buffer has the size NVRTC reports.
    unsafe {
        sys::nvrtcGetCUBINSize(prog, &mut size).result()?;
        let mut buf = vec![0u8; size];
        sys::nvrtcGetCUBIN(prog, buf.as_mut_ptr() as *mut c_char).result()?;
        Ok(buf)
    }
}

fn c_chars_to_string(v: &[c_char]) -> String {
    if v.is_empty() {
        return String::new();
    }
    // SAFETY: NVRTC logs are NUL-terminated; fall back to lossy bytes otherwise.
    match CStr::from_bytes_until_nul(unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, v.len()) }) {
        Ok(s) => s.to_string_lossy().into_owned(),
        Err(_) => String::new(),
    }
}
