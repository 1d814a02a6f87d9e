//! `y[n, m] = x[n, k] · W[m, k]ᵀ` (PyTorch Linear, row-major, no bias) through cuBLASLt:
//! bf16 in, f32 accumulate, bf16 out. Descriptors and the algorithm are created once per exact
//! shape (m = out features, n = tokens, k = in features) and cached; [`Gemm::prepare`] does it at
//! warm-up so a step only calls `cublasLtMatmul`. [`Gemm::heuristic_calls`] lets callers assert
//! that no heuristic ran on the hot path.
//!
//! Layout: cuBLASLt is column-major, so we compute yᵀ[m, n] = W · xᵀ with A = W viewed as a
//! col-major [k, m] matrix, transposed (op T), and B = x viewed as col-major [k, n] (op N).

use std::cell::{Cell, RefCell};
use std::collections::{HashMap, HashSet};
use std::ffi::c_void;

use cudarc::cublaslt::result;
use cudarc::cublaslt::sys;
use cudarc::driver::CudaStream;

use crate::arena::DevSpan;
use crate::error::CudaError;
use crate::runtime::{LibStatus, Runtime};

struct Plan {
    desc: sys::cublasLtMatmulDesc_t,
    a: sys::cublasLtMatrixLayout_t,
    b: sys::cublasLtMatrixLayout_t,
    c: sys::cublasLtMatrixLayout_t,
    algo: sys::cublasLtMatmulAlgo_t,
    /// What the heuristic offered, best first (one unless more were asked for; `algo` is one of them).
    offered: Vec<sys::cublasLtMatmulAlgo_t>,
}

/// (m, n, k, f32 y, y's leading dimension, y's alignment in bytes, FP8 with block scales).
type PlanKey = (usize, usize, usize, bool, usize, u32, bool);

/// The largest power of two (at most 256) dividing a device address: what cuBLASLt may assume of it.
fn alignment(ptr: u64) -> u32 {
    if ptr == 0 { 256 } else { (1u64 << ptr.trailing_zeros().min(8)) as u32 }
}

/// A cuBLASLt handle, its workspace (an arena span) and the per-shape plans.
/// Not `Sync`: the thread that owns the GPU owns this.
pub struct Gemm {
    handle: sys::cublasLtHandle_t,
    workspace: DevSpan,
    plans: RefCell<HashMap<PlanKey, Plan>>,
    /// FP8 shapes cuBLASLt refused (asked once each).
    refused: RefCell<HashSet<PlanKey>>,
    heuristic_calls: Cell<usize>,
}

/// cuBLAS's recommended workspace: 32 MiB on Hopper, 4 MiB before.
pub fn recommended_workspace_bytes(rt: &Runtime) -> usize {
    if rt.cc.0 >= 9 { 32 << 20 } else { 4 << 20 }
}

impl Gemm {
    /// Creates the handle; `workspace` is device memory reserved for cuBLASLt.
    pub fn new(rt: &Runtime, workspace: DevSpan) -> Result<Gemm, CudaError> {
        LibStatus::probe().require_all()?;
        rt.context().bind_to_thread().map_err(CudaError::driver("cuCtxSetCurrent"))?;
        let handle = result::create_handle().map_err(|source| CudaError::Blas {
            call: "cublasLtCreate",
            m: 0,
            n: 0,
            k: 0,
            cause: source,
        })?;
        Ok(Gemm {
            handle,
            workspace,
            plans: RefCell::new(HashMap::new()),
            refused: RefCell::new(HashSet::new()),
            heuristic_calls: Cell::new(0),
        })
    }

    /// Number of algorithm heuristics run so far (one per distinct shape).
    pub fn heuristic_calls(&self) -> usize {
        self.heuristic_calls.get()
    }

    /// Builds and caches the plan for y[n, m] = x[n, k] · W[m, k]ᵀ (bf16 y).
    pub fn prepare(&self, m: usize, n: usize, k: usize) -> Result<(), CudaError> {
        self.prepare_out(m, n, k, false)
    }

    /// [`Gemm::prepare`] with y in f32 (`f32_out`) or bf16.
    pub fn prepare_out(&self, m: usize, n: usize, k: usize, f32_out: bool) -> Result<(), CudaError> {
        self.prepare_key((m, n, k, f32_out, m, 256, false))
    }

    fn prepare_key(&self, key: PlanKey) -> Result<(), CudaError> {
        if self.plans.borrow().contains_key(&key) {
            return Ok(());
        }
        let plan = self.make_plan(key)?;
        self.plans.borrow_mut().insert(key, plan);
        Ok(())
    }

    fn make_plan(&self, key: PlanKey) -> Result<Plan, CudaError> {
        self.make_plan_offering(key, 1)
    }

    /// A plan for `key` with up to `count` of the heuristic's algorithms (at least one, or an error).
    fn make_plan_offering(&self, key: PlanKey, count: usize) -> Result<Plan, CudaError> {
        let (m, n, k, f32_out, ldc, align_c, fp8) = key;
        let err = |call| move |source| CudaError::Blas { call, m, n, k, cause: source };
        if m == 0 || n == 0 || k == 0 || ldc < m {
            return Err(CudaError::InvalidArgs {
                kernel: "gemm",
                msg: format!("empty GEMM or ldc < m: m={m} n={n} k={k} ldc={ldc}"),
            });
        }
        let bf16 = sys::cudaDataType::CUDA_R_16BF;
        let desc =
            result::create_matmul_desc(sys::cublasComputeType_t::CUBLAS_COMPUTE_32F, sys::cudaDataType::CUDA_R_32F)
                .map_err(err("cublasLtMatmulDescCreate"))?;
        let trans_t: i32 = 1;
        // SAFETY: desc is live; the attribute is a 4-byte cublasOperation_t.
        unsafe {
            result::set_matmul_desc_attribute(
                desc,
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
                &trans_t as *const i32 as *const c_void,
                4,
            )
        }
        .map_err(err("cublasLtMatmulDescSetAttribute(TRANSA)"))?;
        if fp8 {
            // A = the weights in 128×128 blocks, B = the activations in 1×128 blocks (f32 scales each).
            for (attr, mode) in [
                (sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_A_SCALE_MODE, SCALE_BLK128X128_32F),
                (sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_B_SCALE_MODE, SCALE_VEC128_32F),
            ] {
                // SAFETY: desc is live; the attribute is a 4-byte cublasLtMatmulMatrixScale_t.
                unsafe { result::set_matmul_desc_attribute(desc, attr, &mode as *const i32 as *const c_void, 4) }
                    .map_err(err("cublasLtMatmulDescSetAttribute(scale mode)"))?;
            }
            // The heuristic wants scale pointers set: any non-null address (each call sets the real ones).
            set_scale_pointers(desc, 256, 256).map_err(err("cublasLtMatmulDescSetAttribute(scale pointer)"))?;
        }
        let (m64, n64, k64) = (m as u64, n as u64, k as u64);
        let ab = if fp8 { sys::cudaDataType::CUDA_R_8F_E4M3 } else { bf16 };
        let a = result::create_matrix_layout(ab, k64, m64, k as i64).map_err(err("cublasLtMatrixLayoutCreate(A)"))?;
        let b = result::create_matrix_layout(ab, k64, n64, k as i64).map_err(err("cublasLtMatrixLayoutCreate(B)"))?;
        let c_type = if f32_out { sys::cudaDataType::CUDA_R_32F } else { bf16 };
        let c =
            result::create_matrix_layout(c_type, m64, n64, ldc as i64).map_err(err("cublasLtMatrixLayoutCreate(C)"))?;
        let pref = result::create_matmul_pref().map_err(err("cublasLtMatmulPreferenceCreate"))?;
        let ws = self.workspace.bytes as u64;
        // SAFETY: pref is live; the attribute is a u64.
        let heur = unsafe {
            result::set_matmul_pref_attribute(
                pref,
                sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                &ws as *const u64 as *const c_void,
                8,
            )
            .map_err(err("cublasLtMatmulPreferenceSetAttribute"))
            .and_then(|_| {
                // y may start inside a wider row (a column slice of the output): say how aligned.
                for attr in [
                    sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                    sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
                ] {
                    result::set_matmul_pref_attribute(pref, attr, &align_c as *const u32 as *const c_void, 4)
                        .map_err(err("cublasLtMatmulPreferenceSetAttribute(alignment)"))?;
                }
                // Split-K partial sums reduced in f32 only: summed in place or in the output type, deep
                // GEMMs of few rows (the MLP down projection at 64 tokens: 17,408 inputs) lose bf16 bits
                // of partial sums much larger than the result.
                let mask = sys::cublasLtReductionScheme_t::CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE as u32;
                result::set_matmul_pref_attribute(
                    pref,
                    sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
                    &mask as *const u32 as *const c_void,
                    4,
                )
                .map_err(err("cublasLtMatmulPreferenceSetAttribute(reduction scheme)"))?;
                Ok(())
            })
            .and_then(|_| {
                heuristic(self.handle, desc, a, b, c, pref, count).map_err(err("cublasLtMatmulAlgoGetHeuristic"))
            })
        };
        // SAFETY: destroyed once.
        let _ = unsafe { result::destroy_matmul_pref(pref) };
        self.heuristic_calls.set(self.heuristic_calls.get() + 1);
        let offered = heur?;
        Ok(Plan { desc, a, b, c, algo: offered[0], offered })
    }

    /// How many algorithms cuBLASLt's heuristic offers for y[n, m] = x[n, k] · W[m, k]ᵀ (`f32_out`:
    /// y in f32), up to `most`, best first; the plan keeps its choice ([`Gemm::use_algorithm`]).
    pub fn algorithms(&self, m: usize, n: usize, k: usize, f32_out: bool, most: usize) -> Result<usize, CudaError> {
        let key = (m, n, k, f32_out, m, 256, false);
        let current = self.plans.borrow().get(&key).map(|p| p.algo);
        let mut plan = self.make_plan_offering(key, most.max(1))?;
        if let Some(a) = current {
            plan.algo = a;
        }
        let count = plan.offered.len();
        if let Some(old) = self.plans.borrow_mut().insert(key, plan) {
            destroy_plan(&old);
        }
        Ok(count)
    }

    /// Makes the `i`-th algorithm [`Gemm::algorithms`] offered for this shape the one its GEMMs run.
    pub fn use_algorithm(&self, m: usize, n: usize, k: usize, f32_out: bool, i: usize) -> Result<(), CudaError> {
        let key = (m, n, k, f32_out, m, 256, false);
        let mut plans = self.plans.borrow_mut();
        let p = plans.get_mut(&key).filter(|p| i < p.offered.len()).ok_or_else(|| CudaError::InvalidArgs {
            kernel: "gemm",
            msg: format!("no algorithm {i} offered for m={m} n={n} k={k} (call algorithms first)"),
        })?;
        p.algo = p.offered[i];
        Ok(())
    }

    /// y [n, m] bf16 = x [n, k] bf16 · w [m, k] bf16ᵀ on `stream`. Uses the cached plan; a shape
    /// never prepared is planned now (one heuristic call, counted).
    #[allow(clippy::too_many_arguments)]
    pub fn linear(
        &self,
        stream: &CudaStream,
        x: u64,
        w: u64,
        y: u64,
        n: usize,
        m: usize,
        k: usize,
    ) -> Result<(), CudaError> {
        self.linear_out(stream, x, w, y, n, m, k, false)
    }

    /// [`Gemm::linear`] with y [n, m] in f32 (`f32_out`, e.g. logits) or bf16.
    #[allow(clippy::too_many_arguments)]
    pub fn linear_out(
        &self,
        stream: &CudaStream,
        x: u64,
        w: u64,
        y: u64,
        n: usize,
        m: usize,
        k: usize,
        f32_out: bool,
    ) -> Result<(), CudaError> {
        self.linear_ld(stream, x, w, y, n, m, k, m, f32_out)
    }

    /// [`Gemm::linear_out`] writing row `i` of y at `y + i·ldc` elements (`ldc ≥ m`): y may be a
    /// column slice of a wider output (the int4 prefill path writes each dequantised row slice's
    /// product straight into its columns). Plans are cached per (shape, ldc, y's alignment).
    #[allow(clippy::too_many_arguments)]
    pub fn linear_ld(
        &self,
        stream: &CudaStream,
        x: u64,
        w: u64,
        y: u64,
        n: usize,
        m: usize,
        k: usize,
        ldc: usize,
        f32_out: bool,
    ) -> Result<(), CudaError> {
        if n == 0 {
            return Ok(());
        }
        self.matmul(stream, (m, n, k, f32_out, ldc, alignment(y), false), w, x, y, None)
    }

    /// `cublasLtMatmul` of the plan for `key` (planned now if it never was) on `stream`: y = x · wᵀ, with
    /// the FP8 plan's scale pointers (weights', activations') set to `scales` first.
    fn matmul(
        &self,
        stream: &CudaStream,
        key: PlanKey,
        w: u64,
        x: u64,
        y: u64,
        scales: Option<(u64, u64)>,
    ) -> Result<(), CudaError> {
        let (m, n, k, ..) = key;
        self.prepare_key(key)?;
        let plans = self.plans.borrow();
        let p = plans
            .get(&key)
            .ok_or(CudaError::InvalidArgs { kernel: "gemm", msg: format!("no plan for m={m} n={n} k={k}") })?;
        if let Some((ws, xs)) = scales {
            set_scale_pointers(p.desc, ws, xs).map_err(|source| CudaError::Blas {
                call: "cublasLtMatmulDescSetAttribute",
                m,
                n,
                k,
                cause: source,
            })?;
        }
        let (alpha, beta) = (1.0f32, 0.0f32);
        // SAFETY: descriptors are live and describe the row-major buffers the caller passes (an FP8 plan's
        // scale pointers were just set to this call's); the workspace span belongs to this Gemm.
        unsafe {
            result::matmul(
                self.handle,
                p.desc,
                &alpha as *const f32 as *const c_void,
                &beta as *const f32 as *const c_void,
                w as *const c_void,
                p.a,
                x as *const c_void,
                p.b,
                y as *const c_void,
                p.c,
                y as *mut c_void,
                p.c,
                &p.algo,
                self.workspace.ptr as *mut c_void,
                self.workspace.bytes,
                stream.cu_stream() as sys::cudaStream_t,
            )
        }
        .map_err(|source| CudaError::Blas { call: "cublasLtMatmul", m, n, k, cause: source })
    }
}

/// `cublasLtMatmulMatrixScale_t`: one f32 scale per 128 consecutive k of a row or column.
const SCALE_VEC128_32F: i32 = 4;
/// `cublasLtMatmulMatrixScale_t`: one f32 scale per 128×128 block.
const SCALE_BLK128X128_32F: i32 = 5;

/// Sets the A and B scale pointers of an FP8 plan's descriptor.
fn set_scale_pointers(
    desc: sys::cublasLtMatmulDesc_t,
    a: u64,
    b: u64,
) -> Result<(), cudarc::cublaslt::result::CublasError> {
    for (attr, p) in [
        (sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, a),
        (sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, b),
    ] {
        // SAFETY: desc is live; the attribute is a device pointer (8 bytes).
        unsafe { result::set_matmul_desc_attribute(desc, attr, &p as *const u64 as *const c_void, 8) }?;
    }
    Ok(())
}

impl Gemm {
    /// Whether cuBLASLt runs the block-scaled FP8 GEMM of [`Gemm::linear_fp8`] for this shape (Hopper:
    /// `sm_90`; plans it now, once per shape). False where it refuses: the caller dequantises instead.
    pub fn fp8_supported(&self, m: usize, n: usize, k: usize, ldc: usize, y: u64) -> bool {
        let key = (m, n, k, false, ldc, alignment(y), true);
        if m == 0 || n == 0 || !k.is_multiple_of(128) || self.refused.borrow().contains(&key) {
            return false;
        }
        match self.prepare_key(key) {
            Ok(()) => true,
            Err(e) => {
                tracing::debug!("cuBLASLt has no block-scaled FP8 GEMM for m={m} n={n} k={k}: {e}");
                self.refused.borrow_mut().insert(key);
                false
            }
        }
    }

    /// y [n, m] bf16 (row `i` at `y + i·ldc` elements) = x · Wᵀ with FP8 tensor cores: `xq` the
    /// activations' e4m3 codes `[n, k]` and `xs` their scales `[k/128, n]` (token-major;
    /// [`crate::ops::fp8::act_quant`]), `w` the weights' codes `[m, k]` and `ws` their scales
    /// `[ceil(m/128), k/128]`. The shape must pass [`Gemm::fp8_supported`].
    #[allow(clippy::too_many_arguments)]
    pub fn linear_fp8(
        &self,
        stream: &CudaStream,
        xq: u64,
        xs: u64,
        w: u64,
        ws: u64,
        y: u64,
        n: usize,
        m: usize,
        k: usize,
        ldc: usize,
    ) -> Result<(), CudaError> {
        if n == 0 {
            return Ok(());
        }
        self.matmul(stream, (m, n, k, false, ldc, alignment(y), true), w, xq, y, Some((ws, xs)))
    }
}

/// Up to `count` algorithms of cuBLASLt's heuristic for a described GEMM, best first (at least one).
fn heuristic(
    handle: sys::cublasLtHandle_t,
    desc: sys::cublasLtMatmulDesc_t,
    a: sys::cublasLtMatrixLayout_t,
    b: sys::cublasLtMatrixLayout_t,
    c: sys::cublasLtMatrixLayout_t,
    pref: sys::cublasLtMatmulPreference_t,
    count: usize,
) -> Result<Vec<sys::cublasLtMatmulAlgo_t>, cudarc::cublaslt::result::CublasError> {
    let mut found = vec![std::mem::MaybeUninit::<sys::cublasLtMatmulHeuristicResult_t>::zeroed(); count];
    let mut returned = 0i32;
    // SAFETY: the descriptors are live; `found` has room for `count` results, `returned` says how many
    // cuBLASLt wrote.
    unsafe {
        sys::cublasLtMatmulAlgoGetHeuristic(
            handle,
            desc,
            a,
            b,
            c,
            c,
            pref,
            count as i32,
            found.as_mut_ptr().cast(),
            &mut returned,
        )
        .result()?;
    }
    let mut algos = Vec::new();
    for r in found.iter().take(returned.max(0) as usize) {
        // SAFETY: the first `returned` entries were written by cuBLASLt.
        let r = unsafe { r.assume_init_ref() };
        if r.state == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
            algos.push(r.algo);
        }
    }
    if algos.is_empty() {
        return Err(cudarc::cublaslt::result::CublasError(sys::cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED));
    }
    Ok(algos)
}

/// Destroys a plan's descriptors (once; errors ignored).
fn destroy_plan(p: &Plan) {
    // SAFETY: the plan's descriptors are live and destroyed exactly once.
    unsafe {
        let _ = result::destroy_matrix_layout(p.a);
        let _ = result::destroy_matrix_layout(p.b);
        let _ = result::destroy_matrix_layout(p.c);
        let _ = result::destroy_matmul_desc(p.desc);
    }
}

impl Drop for Gemm {
    fn drop(&mut self) {
        for p in self.plans.borrow().values() {
            destroy_plan(p);
        }
        // SAFETY: the handle is destroyed exactly once; errors at teardown are ignored.
        let _ = unsafe { result::destroy_handle(self.handle) };
    }
}
