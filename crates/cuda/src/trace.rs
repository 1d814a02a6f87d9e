//! An opt-in timeline of every kernel block, for finding where a decode step's time goes when the
//! kernels overlap (programmatic launches) and no system profiler is at hand.
//!
//! `DELTASERVE_TRACE=<file.csv>` at start: [`defines`] allocates a device ring of
//! `DELTASERVE_TRACE_CAP` records (default [`DEFAULT_CAP`], 48 bytes each; outside the memory plan:
//! a diagnostic run, the driver's numbers then include it), every kernel is compiled with
//! `DS_TRACE_SCOPE();` first in its body ([`instrument`]; `kernels/prelude.cuh` says what it
//! records), and when the backend drops, [`dump`] writes the ring's records, oldest first, as CSV:
//! `kernel,block,sm,start_ns,wait_ns,end_ns,wait_clk,end_clk` (times relative to the oldest record's
//! start; wait 0: the block has no `pdl_wait()`). `scripts/charts.py timeline` cuts the records into
//! launches and steps and draws one step. Without the variable nothing changes: no ring, no scope.
//! One ring per process, on the first GPU that asks (tensor-parallel ranks past the first are not
//! traced).

use std::collections::HashMap;
use std::fmt::Write as _;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{CudaContext, result};

use crate::error::CudaError;
use crate::runtime::Runtime;
use crate::switches::Switches;

/// Records the ring holds unless `DELTASERVE_TRACE_CAP` says otherwise (~4 decode steps of the 27B).
pub const DEFAULT_CAP: usize = 1 << 18;
/// u64 words of one record (kernels/prelude.cuh's DsTraceScope).
const RECORD_WORDS: usize = 6;

struct Ring {
    ctx: Arc<CudaContext>,
    ptr: u64,
    cap: usize,
    path: PathBuf,
}

fn ring() -> &'static Mutex<Option<Ring>> {
    static RING: OnceLock<Mutex<Option<Ring>>> = OnceLock::new();
    RING.get_or_init(|| Mutex::new(None))
}

/// The compile-time defines that turn tracing on for kernels compiled on `rt`'s GPU (empty without
/// `DELTASERVE_TRACE`). Allocates and zeroes the ring on the first call.
pub fn defines(rt: &Runtime) -> Result<Vec<(&'static str, String)>, CudaError> {
    let switches = Switches::get();
    let Some(path) = switches.trace.clone() else {
        return Ok(Vec::new());
    };
    let cap = match &switches.trace_cap {
        Some(v) => v.parse::<usize>().ok().filter(|&c| c > 0).ok_or_else(|| CudaError::InvalidArgs {
            kernel: "trace",
            msg: format!("DELTASERVE_TRACE_CAP must be a positive number of records, not {v:?}"),
        })?,
        None => DEFAULT_CAP,
    };
    let mut guard = ring().lock().map_err(|_| poisoned())?;
    if let Some(r) = guard.as_ref() {
        if !same_gpu(&r.ctx, rt) {
            tracing::warn!("kernel trace: only the first GPU is traced");
            return Ok(Vec::new());
        }
    } else {
        rt.context().bind_to_thread().map_err(CudaError::driver("cuCtxSetCurrent"))?;
        let bytes = 8 * (1 + RECORD_WORDS * cap);
        // SAFETY: a plain allocation, freed never (the process ends after the dump).
        let ptr = unsafe { result::malloc_sync(bytes) }.map_err(CudaError::driver("cuMemAlloc(trace ring)"))?;
        // SAFETY: `ptr` holds `bytes` bytes.
        unsafe { result::memset_d8_sync(ptr, 0, bytes) }.map_err(CudaError::driver("cuMemsetD8(trace ring)"))?;
        tracing::warn!(
            "kernel trace on: {cap} block records ({:.1} MiB outside the memory plan) to {}",
            bytes as f64 / (1u64 << 20) as f64,
            path.display()
        );
        *guard = Some(Ring { ctx: rt.context().clone(), ptr, cap, path });
    }
    let r = guard.as_ref().expect("set above");
    Ok(ring_defines(r.ptr, r.cap))
}

/// The defines that compile the trace scope for a ring at device address `ptr` of `cap` records.
pub fn ring_defines(ptr: u64, cap: usize) -> Vec<(&'static str, String)> {
    vec![(BUF_DEFINE, format!("{ptr:#x}ull")), ("DS_TRACE_CAP", cap.to_string())]
}

/// The define whose presence makes a build traced (kernels/prelude.cuh).
const BUF_DEFINE: &str = "DS_TRACE_BUF";

/// Whether a module compiled with `defines` is a traced build ([`instrument`] its source).
pub fn is_traced(defines: &[(&str, String)]) -> bool {
    defines.iter().any(|(k, _)| *k == BUF_DEFINE)
}

/// Whether `rt` runs on the ring's GPU (each Runtime holds its own handle on the device's primary
/// context: the bench's ceilings, then the backend's; the ring's handle keeps that context alive).
fn same_gpu(ctx: &Arc<CudaContext>, rt: &Runtime) -> bool {
    ctx.ordinal() == rt.context().ordinal()
}

fn poisoned() -> CudaError {
    CudaError::InvalidArgs { kernel: "trace", msg: "the trace ring's lock is poisoned".into() }
}

/// `src` with `DS_TRACE_SCOPE();` as the first statement of every `extern "C" __global__` function
/// (also inside a macro that defines kernels: the text goes right after the body's `{`).
pub fn instrument(src: &str) -> String {
    const KEY: &str = "extern \"C\" __global__";
    let mut out = String::with_capacity(src.len() + 1024);
    let mut rest = src;
    while let Some(i) = rest.find(KEY) {
        let (head, tail) = rest.split_at(i + KEY.len());
        out.push_str(head);
        // The body's `{`: the first one outside parentheses (launch bounds, parameters).
        let mut depth = 0i32;
        let mut body = None;
        for (j, c) in tail.char_indices() {
            match c {
                '(' => depth += 1,
                ')' => depth -= 1,
                '{' if depth == 0 => {
                    body = Some(j);
                    break;
                }
                ';' if depth == 0 => break, // a declaration, not a definition
                _ => {}
            }
        }
        match body {
            Some(j) => {
                out.push_str(&tail[..=j]);
                out.push_str(" DS_TRACE_SCOPE();");
                rest = &tail[j + 1..];
            }
            None => rest = tail,
        }
    }
    out.push_str(rest);
    out
}

/// Writes the ring's records to the trace file (no-op without a ring, or for another GPU's
/// backend). Waits for the GPU. Returns the file and the number of records written.
pub fn dump(rt: &Runtime) -> Result<Option<(PathBuf, usize)>, CudaError> {
    let guard = ring().lock().map_err(|_| poisoned())?;
    let Some(r) = guard.as_ref().filter(|r| same_gpu(&r.ctx, rt)) else {
        return Ok(None);
    };
    rt.synchronize()?;
    let mut count = [0u64];
    rt.download(&mut count, r.ptr)?;
    let mut words = vec![0u64; RECORD_WORDS * r.cap];
    rt.download(&mut words, r.ptr + 8)?;
    let n = (count[0] as usize).min(r.cap);
    // Oldest first: the ring wrapped at count % cap once count > cap.
    let first = if count[0] as usize > r.cap { count[0] as usize % r.cap } else { 0 };
    let recs: Vec<&[u64]> =
        (0..n).map(|k| (first + k) % r.cap).map(|i| &words[RECORD_WORDS * i..][..RECORD_WORDS]).collect();
    let t_base = recs.iter().map(|w| w[2]).min().unwrap_or(0);
    let mut names: HashMap<u64, String> = HashMap::new();
    let mut csv = String::from("kernel,block,sm,start_ns,wait_ns,end_ns,wait_clk,end_clk\n");
    for w in &recs {
        let name = names.entry(w[0]).or_insert_with(|| device_cstr(rt, w[0]));
        let rel = |t: u64| if t == 0 { 0 } else { t.saturating_sub(t_base) };
        let _ = writeln!(
            csv,
            "{name},{},{},{},{},{},{},{}",
            w[1] & 0xffff_ffff,
            w[1] >> 32,
            rel(w[2]),
            rel(w[3]),
            rel(w[4]),
            w[5] & 0xffff_ffff,
            w[5] >> 32
        );
    }
    std::fs::write(&r.path, csv)
        .map_err(|e| CudaError::InvalidArgs { kernel: "trace", msg: format!("{}: {e}", r.path.display()) })?;
    Ok(Some((r.path.clone(), n)))
}

/// The NUL-terminated string at device address `p` (a kernel's `__func__`), or its address in hex.
fn device_cstr(rt: &Runtime, p: u64) -> String {
    let mut bytes = Vec::new();
    for k in 0..128u64 {
        let mut b = [0u8];
        if p == 0 || rt.download(&mut b, p + k).is_err() {
            return format!("{p:#x}");
        }
        if b[0] == 0 {
            break;
        }
        bytes.push(b[0]);
    }
    String::from_utf8(bytes).unwrap_or_else(|_| format!("{p:#x}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn instrument_puts_a_scope_first_in_every_kernel_body() {
        let src = "__device__ int f(int x) { return x; }\n\
                   extern \"C\" __global__ void __launch_bounds__(256, (2 > 1) ? 2 : 1)\n\
                   k1(const int* a, int n) {\n  int x = 0;\n}\n\
                   #define K(NAME) \\\n    extern \"C\" __global__ void NAME(int* y) { \\\n        y[0] = 1; \\\n    }\n\
                   K(k2)\n";
        let out = instrument(src);
        assert_eq!(out.matches("DS_TRACE_SCOPE();").count(), 2);
        assert!(out.contains("k1(const int* a, int n) { DS_TRACE_SCOPE();\n  int x = 0;"));
        assert!(out.contains("NAME(int* y) { DS_TRACE_SCOPE(); \\\n        y[0] = 1;"));
        assert!(out.starts_with("__device__ int f(int x) { return x; }"), "device functions are left alone");
        assert_eq!(out.replace(" DS_TRACE_SCOPE();", ""), src);
    }

    #[test]
    fn instrument_reaches_every_kernel_of_the_crate() {
        for s in crate::nvrtc::SOURCES {
            let out = instrument(s.src);
            let kernels = s.src.matches("extern \"C\" __global__").count();
            assert_eq!(out.matches("DS_TRACE_SCOPE();").count(), kernels, "{}", s.module);
            assert!(kernels >= s.functions.len().min(1), "{}", s.module);
        }
    }
}
