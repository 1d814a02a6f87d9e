// prelude.cuh — shared device helpers, prepended (as text) to every kernel source by src/nvrtc.rs.
//
// Computes: nothing by itself. Provides bf16 <-> f32 conversion on raw `unsigned short` bit
// patterns (so kernels need no toolkit header: NVRTC 13 has no built-in cuda_bf16.h), warp
// reductions, small math helpers, f16 conversions, and the sm_80 tensor-core / cp.async helpers.
// Dtypes: bf16 is stored as `bf16_t` (= unsigned short, the upper 16 bits of an IEEE f32).
// Arch features: plain sm_80 instructions only (shuffles); runs on sm_80/86/89/90.
// Tested by: every op test in crates/cuda/tests/ops/ (all kernels include it).

typedef unsigned short bf16_t;
typedef unsigned int u32;

// Kernel timeline (opt-in: src/trace.rs, DELTASERVE_TRACE). Without DS_TRACE_BUF nothing here is
// compiled. With it, src/trace.rs puts DS_TRACE_SCOPE(); first in every kernel body: thread 0 notes
// the block's start (%globaltimer, %clock64), pdl_wait() notes when the block's wait returned, and
// the block's last thread to exit appends one 48-byte record to the ring at DS_TRACE_BUF (a u64
// counter, then DS_TRACE_CAP records): the kernel's __func__ address (its name in device memory), the
// block (linear index), the SM, the start, wait and end times (ns), and the wait and end offsets in SM
// clocks. One barrier at the start and one shared atomic per thread at the end: a diagnostic build.
#ifdef DS_TRACE_BUF
struct DsTraceSh {
    unsigned long long t0, tw, c0, cw;
    const char* func;
    unsigned int left;
};
__device__ __forceinline__ DsTraceSh* ds_trace_sh() {
    __shared__ DsTraceSh s;
    return &s;
}
__device__ __forceinline__ unsigned long long ds_gtime() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
__device__ __forceinline__ unsigned int ds_tid() {
    return threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
}
__device__ __forceinline__ void ds_trace_wait_done() {
    DsTraceSh* s = ds_trace_sh();
    if (ds_tid() == 0 && s->tw == 0) {
        s->cw = clock64();
        s->tw = ds_gtime();
    }
}
struct DsTraceScope {
    __device__ explicit DsTraceScope(const char* func) {
        DsTraceSh* s = ds_trace_sh();
        if (ds_tid() == 0) {
            s->c0 = clock64();
            s->t0 = ds_gtime();
            s->tw = 0;
            s->cw = 0;
            s->func = func;
            s->left = blockDim.x * blockDim.y * blockDim.z;
        }
        __syncthreads();
    }
    __device__ ~DsTraceScope() {
        DsTraceSh* s = ds_trace_sh();
        if (atomicSub(&s->left, 1u) != 1u) return;
        const unsigned long long c1 = clock64(), t1 = ds_gtime();
        unsigned int sm;
        asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
        unsigned long long* ring = (unsigned long long*)(DS_TRACE_BUF);
        const unsigned long long i = atomicAdd(ring, 1ull) % (unsigned long long)(DS_TRACE_CAP);
        unsigned long long* r = ring + 1 + 6 * i;
        r[0] = (unsigned long long)s->func;
        r[1] = (unsigned long long)(blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z)) |
               ((unsigned long long)sm << 32);
        r[2] = s->t0;
        r[3] = s->tw;
        r[4] = t1;
        r[5] = (s->cw ? (s->cw - s->c0) : 0ull) | ((c1 - s->c0) << 32);
    }
};
#define DS_TRACE_SCOPE() DsTraceScope ds_trace_scope_(__func__)
#else
#define DS_TRACE_SCOPE()
__device__ __forceinline__ void ds_trace_wait_done() {}
#endif

// bf16 bits -> f32: the bf16 pattern is the top half of the f32 pattern.
__device__ __forceinline__ float bf2f(bf16_t x) { return __uint_as_float(((u32)x) << 16); }

// f32 -> bf16 bits, round to nearest even; NaN stays NaN (quiet).
__device__ __forceinline__ bf16_t f2bf(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16_t)(u >> 16);
}

// Two f32 -> f16x2 (lo in bits 0..15), round to nearest even (one instruction).
__device__ __forceinline__ u32 pack_f16(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
// Two f32 -> packed bf16x2, round to nearest even (one instruction; NaN -> the canonical NaN): lo in
// bits 0..15 (the lower column / address).
__device__ __forceinline__ u32 pack_bf16(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// Round an f32 through bf16 (what storing to a bf16 tensor and reading back does).
__device__ __forceinline__ float round_bf(float f) { return bf2f(f2bf(f)); }

// The DeltaNet recurrent state's storage in its slots (gdn_decode.cu, gdn_chunk.cu): -D STATE_BF16=1
// stores bf16 (round to nearest even at every store; the recurrence computes in f32), else f32.
// The recurrent kernels (decode, verify, commit) keep what a slot would after every token
// (state_kept), so a commit of n tokens leaves the state n decode steps leave; the chunked walk rounds
// where it stores.
#if defined(STATE_BF16) && STATE_BF16
typedef bf16_t state_t;
__device__ __forceinline__ bf16_t state_bits(float x) {  // f2bf's rounding, one instruction
    unsigned short r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(x));
    return (bf16_t)r;
}
__device__ __forceinline__ float state_ld(const state_t* p) { return bf2f(*p); }
__device__ __forceinline__ void state_st(state_t* p, float x) { *p = state_bits(x); }
__device__ __forceinline__ float state_kept(float x) { return bf2f(state_bits(x)); }
#else
typedef float state_t;
__device__ __forceinline__ float state_ld(const state_t* p) { return *p; }
__device__ __forceinline__ void state_st(state_t* p, float x) { *p = x; }
__device__ __forceinline__ float state_kept(float x) { return x; }
#endif

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over the whole block (blockDim.x a multiple of 32, at most 1024). `red` is >= 32 floats of
// shared memory. Every thread gets the result. Contains __syncthreads().
__device__ __forceinline__ float block_sum(float v, float* red) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    float t = lane < nw ? red[lane] : 0.0f;
    return warp_sum(t);
}

// Inclusive scan of one value per thread over the block (≤ 1024 threads); `sh` holds 32 values of
// shared memory. Contains __syncthreads() (also at the end: `sh` may be reused right after).
template <typename T>
__device__ __forceinline__ T block_inclusive_scan(T v, T* sh) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const T t = __shfl_up_sync(0xffffffffu, v, o);
        if (lane >= o) v += t;
    }
    if (lane == 31) sh[warp] = v;
    __syncthreads();
    if (warp == 0) {
        T w = lane < nw ? sh[lane] : T(0);
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const T t = __shfl_up_sync(0xffffffffu, w, o);
            if (lane >= o) w += t;
        }
        if (lane < nw) sh[lane] = w;
    }
    __syncthreads();
    const T before = warp > 0 ? sh[warp - 1] : T(0);
    __syncthreads();
    return v + before;
}

// mean-square building block: the sum of row[i]^2 over i < D exactly as a block of NW warps computes it
// with block_sum (thread v sums elements v, v + 32*NW, ... in order; the NW warp sums combined by one
// warp_sum) — computed by one warp, lane l playing threads l + 32j. Every lane gets the sum.
template <int NW>
__device__ __forceinline__ float warp_as_block_sumsq(const bf16_t* row, int D, int lane) {
    float tot = 0.0f;
#pragma unroll
    for (int j = 0; j < NW; j++) {
        float ss = 0.0f;
        for (int i = lane + 32 * j; i < D; i += 32 * NW) {
            const float v = bf2f(row[i]);
            ss += v * v;
        }
        ss = warp_sum(ss);
        if (lane == j) tot = ss;
    }
    return warp_sum(tot);
}
// The same sum from the row's values in registers: x[m] = element lane + 32m (M * 32 >= D; entries at
// or past D unused), so that every load of the row can be in flight at once.
template <int NW, int M>
__device__ __forceinline__ float warp_as_block_sumsq(const float (&x)[M], int D, int lane) {
    float tot = 0.0f;
#pragma unroll
    for (int j = 0; j < NW; j++) {
        float ss = 0.0f;
#pragma unroll
        for (int m = j; m < M; m += NW)
            if (lane + 32 * m < D) ss += x[m] * x[m];
        ss = warp_sum(ss);
        if (lane == j) tot = ss;
    }
    return warp_sum(tot);
}

// Greedy order of (value, index) candidates (argmax.cu, sample.cu): the host's sequential argmax rule.
__device__ __forceinline__ bool am_better(float v, int i, float bv, int bi) {
    // v beats (bv, bi): larger value, or equal value at a lower index; NaN never beats, anything
    // non-NaN beats a NaN best (a NaN best only survives at index 0, handled by the caller).
    if (v != v) return false;
    if (bv != bv) return true;
    return v > bv || (v == bv && i < bi);
}

// The best of the warp's 32 candidates, in every lane.
__device__ __forceinline__ void am_warp_best(float& bv, int& bi) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, bv, off);
        const int oi = __shfl_xor_sync(0xffffffffu, bi, off);
        if (am_better(ov, oi, bv, bi)) {
            bv = ov;
            bi = oi;
        }
    }
}

// A grouped expert GEMM's tile j (moe.cu's moe_offsets: offs[0..E] row prefix sums, then offs[E+1..2E+1]
// tile prefix sums, tiles of bm rows): its expert e and first grouped row; false past the step's last tile
// (block-uniform: the block exits). The expert is the last one whose first tile is <= j.
__device__ __forceinline__ bool moe_tile(const int* offs, int E, int j, int bm, int& e, int& row0) {
    const int* toff = offs + E + 1;
    if (j >= toff[E]) return false;
    int lo = 0, hi = E - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (toff[mid] <= j) lo = mid;
        else hi = mid - 1;
    }
    e = lo;
    row0 = offs[e] + (j - toff[e]) * bm;
    return true;
}

// The x row of pair p of a per-pair GEMV launch over P routed pairs (p < P: row p / x_div) and, past
// them, one shared-expert pair per token (moe_gemv, moe_w4p_*): pair P + t reads row sx + t (sx = 0:
// the gate/up projection over the layer's tokens; sx = P: the down projection over the pairs' SwiGLU
// rows, the shared pairs' after the routed).
__device__ __forceinline__ int moe_x_row(int p, int P, int x_div, int sx) {
    return p < P ? p / x_div : sx + (p - P);
}

__device__ __forceinline__ float sigmoidf_(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ __forceinline__ float siluf_(float x) { return x / (1.0f + expf(-x)); }
// (g0, g1) of a packed bf16 pair as f32, and two f32 rounded to a packed bf16 pair.
__device__ __forceinline__ float lo_f(u32 w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float hi_f(u32 w) { return __uint_as_float(w & 0xffff0000u); }
__device__ __forceinline__ u32 pack_f2bf(float lo, float hi) { return (u32)f2bf(lo) | ((u32)f2bf(hi) << 16); }
// SwiGLU of 8 features: bf16(silu(g) * u) of the packed bf16 vectors g and u (swiglu8, fp8_swiglu_quant).
__device__ __forceinline__ uint4 swiglu_vec8(uint4 gv, uint4 uv) {
    const u32 gw[4] = {gv.x, gv.y, gv.z, gv.w}, uw[4] = {uv.x, uv.y, uv.z, uv.w};
    u32 o[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) o[k] = pack_f2bf(siluf_(lo_f(gw[k])) * lo_f(uw[k]), siluf_(hi_f(gw[k])) * hi_f(uw[k]));
    return make_uint4(o[0], o[1], o[2], o[3]);
}
// The 8 bf16 features of a 16-byte vector as f32 (f[2i] the low half of word i).
__device__ __forceinline__ void bf16x8_f32(uint4 v, float (&f)[8]) {
    const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        f[2 * i] = lo_f(w[i]);
        f[2 * i + 1] = hi_f(w[i]);
    }
}
// PyTorch F.softplus (beta 1, threshold 20).
__device__ __forceinline__ float softplusf_(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

// Index of the sequence holding flattened token `t`: largest s with cu[s] <= t (cu has n+1 entries).
__device__ __forceinline__ int seq_of_token(const int* cu, int n, int t) {
    int lo = 0, hi = n - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) >> 1;
        if (cu[mid] <= t) lo = mid; else hi = mid - 1;
    }
    return lo;
}

// ---------------------------------------------------------------------------------------------
// f16 bits <-> f32 (KV-cache and int4-weight scales).

__device__ __forceinline__ float f16_to_f32(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// f32 -> f16 bits, round to nearest even (overflow gives inf, as IEEE conversion does).
__device__ __forceinline__ unsigned short f32_to_f16_rn(float f) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// ---------------------------------------------------------------------------------------------
// sm_80 tensor-core and asynchronous-copy helpers (mma.sync, ldmatrix, cp.async, non-coherent loads,
// the online softmax's pieces), shared by the attention, vision-attention, DeltaNet-chunk, GEMV and
// int4 kernels. Nothing Hopper-only.

// Component i (0..3, unrolled to a constant) of a uint4: x, y, z, w.
__device__ __forceinline__ u32 u4_comp(const uint4& v, int i) {
    return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// Shared-memory address of a generic pointer into shared memory (for ldmatrix / cp.async).
__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 r;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }\n" : "=r"(r) : "l"(p));
    return r;
}

// c += A (16x16 bf16, row) * B (16x8 bf16, col), f32 accumulate (mma.sync m16n8k16). Fragments
// (g = lane/4, t = lane%4): a0 (g, 2t..2t+1) a1 (g+8, 2t..) a2 (g, 2t+8..) a3 (g+8, 2t+8..);
// b0 (k 2t..2t+1, n g) b1 (k 2t+8.., n g); c0,c1 (g, 2t..) c2,c3 (g+8, 2t..); lower index in the low
// 16 bits.
__device__ __forceinline__ void mma_bf16(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// The same with A as four registers and C at `c` (4 floats).
__device__ __forceinline__ void mma_bf16(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    const u32 a[4] = {a0, a1, a2, a3};
    mma_bf16(*reinterpret_cast<float(*)[4]>(c), a, b0, b1);
}
// mma_bf16's fragments with f16 A and B (mma.sync m16n8k16 .f16, f32 accumulate).
__device__ __forceinline__ void mma_f16(float (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
// c = A * B (mma_bf16 on a zero accumulator, no zeroing of c first).
__device__ __forceinline__ void mma_bf16_0(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%10,%10,%10,%10};\n"
        : "=f"(c[0]), "=f"(c[1]), "=f"(c[2]), "=f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(0.0f));
}
// c += A (16x8 bf16, row) * B (8x8 bf16, col) (mma.sync m16n8k8): a0, a1 and b0 of the k16 layout
// above (its first 8 columns of A / rows of B), C the same.
__device__ __forceinline__ void mma_bf16_k8(float (&c)[4], u32 a0, u32 a1, u32 b0) {
    asm("mma.sync.aligned.m16n8k8.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(b0));
}

// Four 8x8 b16 matrices from shared memory (ldmatrix .x4): lanes 8m..8m+7 give the row addresses of
// matrix m, which lands in r_m as (row lane/4, columns 2(lane%4), +1); _t transposes each matrix.
__device__ __forceinline__ void ldsm_x4(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}
// Two matrices (.x2): lanes 0..15 give the row addresses (the other lanes' are ignored).
__device__ __forceinline__ void ldsm_x2(u32 addr, u32& r0, u32& r1) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];" : "=r"(r0), "=r"(r1) : "r"(addr));
}
__device__ __forceinline__ void ldsm_x2_t(u32 addr, u32& r0, u32& r1) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];" : "=r"(r0), "=r"(r1) : "r"(addr));
}

// Online softmax on mma C fragments (the attention kernels, the vision tower's attention).
// 2^x in one MUFU op (inputs <= 0 here; results below 2^-126 flush to 0, -inf gives 0).
__device__ __forceinline__ float pf_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// The max / sum of x over the 4 lanes that hold one row of an mma C fragment (lanes 4g .. 4g + 3).
__device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
    return x;
}
__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    x += __shfl_xor_sync(0xffffffffu, x, 2);
    return x;
}

// The int4 kernels' unpacking (w4a16.cu's GEMV, w4_gemm.cu's pair kernel): the bf16 pair (128 + q0,
// 128 + q1) of the column pair in nibbles (p, p + 4) of w (after w >> 4p).
__device__ __forceinline__ u32 w4p_unpack(u32 w) {
    u32 r;
    asm("lop3.b32 %0, %1, %2, %3, 0xea;" : "=r"(r) : "r"(w), "r"(0x000f000fu), "r"(0x43004300u));
    return r;
}

// The int4 kernels' in-block split over K (w4a16.cu, w4_gemm.cu). Sums the wpt partial results (warp w writes its NT*128 partials at red + w * red_stride, a region
// no other warp touches) into the part-0 warps' acc; false in the other warps. Contains
// __syncthreads() when wpt > 1.
template <int NT>
__device__ __forceinline__ bool w4_sum_parts(float* acc, float* red, int red_stride, int wpt, int warp, int lane,
                                             int part) {
    if (wpt > 1) {
#pragma unroll
        for (int c = 0; c < 4 * NT; ++c) red[warp * red_stride + c * 32 + lane] = acc[c];
        __syncthreads();
        if (part != 0) return false;
#pragma unroll
        for (int c = 0; c < 4 * NT; ++c) {
            float s = 0.f;
            for (int w = 0; w < wpt; ++w) s += red[(warp + w) * red_stride + c * 32 + lane];
            acc[c] = s;
        }
    }
    return true;
}

// cp.async of 16 (cache-global) or 4 (cache-all) bytes to shared address `dst`; only `src_bytes` are
// read, the rest of the destination is zero-filled (0: nothing is read).
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
// The whole 16 bytes (no zero-fill operand).
__device__ __forceinline__ void cp_async16(u32 dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
}
// Fetches the 128-byte line holding p into L2 (a hint; coherent, like any L2 access).
__device__ __forceinline__ void l2_prefetch(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }
__device__ __forceinline__ void cp_async4(u32 dst, const void* src, int src_bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Named barriers of n threads (whole warps): bar.sync waits for n arrivals, bar.arrive counts one
// and goes on; both order the shared-memory accesses before them for the threads that wait.
__device__ __forceinline__ void named_sync(int id, int n) { asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(n) : "memory"); }
__device__ __forceinline__ void named_arrive(int id, int n) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}
// Waits until at most N commit groups are pending.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// 16-byte read-only (non-coherent) global loads, for data no kernel writes while this one runs
// (weights, step inputs uploaded before the step); the _stream one does not allocate in L1. Not for
// what an earlier kernel of the step wrote: see pdl_wait below, and ld_act.
__device__ __forceinline__ uint4 ld_nc(const uint4* p) {
    uint4 r;
    asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}
// A 16-byte (coherent) global load of an activation, i.e. data an earlier kernel of the step wrote.
__device__ __forceinline__ uint4 ld_act(const uint4* p) {
    uint4 r;
    asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}
__device__ __forceinline__ uint4 ld_nc_stream(const uint4* p) {
    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
        : "l"(p));
    return r;
}

// ---------------------------------------------------------------------------------------------
// The int4 weight format (w4a16.cu's header, src/w4.rs): the uint4 c of row o of an [out, 128 * ng]
// linear in the tile-major order: chunk c & 3 of group c >> 2, whose word i holds the group's columns
// 32i + 8(c & 3) .. + 7 (w4a16.cu and w4_gemm.cu read it).
__device__ __forceinline__ long long w4_u4(int o, int c, int out, int ng) {
    const int p = o >> 5, rr = o & 31, R = min(32, out - (p << 5));
    int before = 0;
    for (int jj = 0; jj < (rr & 3); ++jj) before += (R + 3 - jj) >> 2;
    return (long long)p * ng * 128 + (long long)(c >> 2) * R * 4 + (before + (rr >> 2)) * 4 + (c & 3);
}

// The word holding 8-column piece j (device columns 8j .. 8j + 7) of row o: piece q = j & 15 of group
// j >> 4 is word q >> 2 of chunk q & 3.
__device__ __forceinline__ long long w4_word(int o, int j, int out, int ng) {
    return w4_u4(o, (j & ~15) >> 2 | (j & 3), out, ng) * 4 + ((j >> 2) & 3);
}

// ---------------------------------------------------------------------------------------------
// DeltaNet gates (gdn_gate.cu, gdn_decode.cu's gdn_rows). One q or k row of D values at src:
// dst = bf16(v / sqrt(sum v^2 + 1e-6) * scale); one warp.
template <int D>
__device__ __forceinline__ void gdn_l2norm_row(const bf16_t* src, bf16_t* __restrict__ dst, float scale, int lane) {
    float v[D / 32];
    float ss = 0.0f;
#pragma unroll
    for (int i = 0; i < D / 32; i++) {
        v[i] = bf2f(src[lane + 32 * i]);
        ss += v[i] * v[i];
    }
    const float inv = 1.0f / sqrtf(warp_sum(ss) + 1e-6f) * scale;
#pragma unroll
    for (int i = 0; i < D / 32; i++) dst[lane + 32 * i] = f2bf(v[i] * inv);
}

// beta and g of value head h from its b and a (f32).
__device__ __forceinline__ void gdn_gate_values(float bv, float av, const float* __restrict__ A_log,
                                                const float* __restrict__ dt_bias, int h, float* beta, float* g) {
    *beta = sigmoidf_(bv);
    *g = -expf(A_log[h]) * softplusf_(av + dt_bias[h]);
}

// ---------------------------------------------------------------------------------------------
// Rows the DeltaNet kernels of several rows per sequence (gdn_decode.cu's gdn_tokens and
// gdn_recurrent_gated, gdn_gate.cu's gdn_conv_gate_rows) load ahead at a time, so that only their own
// barriers, not a global load per row, stand between one row and the next (a speculative step's verify
// and commit rows: K + 1 = 4 per sequence at K = 3).
#define GDN_ROWS 4

// ---------------------------------------------------------------------------------------------
// One causal depthwise conv1d decode step of channel c (KW taps; conv.cu's conv_decode and
// gdn_gate.cu's fused decode kernel), in parts: conv_window_load reads the state's KW - 1 rows (row r
// at st + r*C) into win and the channel's taps into wv; conv_window_out puts x last in the window and
// returns bf16(silu(sum_j w[c, j] * win[j])); conv_state_shift writes the state one row on (win[1..]).
// conv_decode_step: all three.
template <int KW>
__device__ __forceinline__ void conv_window_load(const bf16_t* st, const bf16_t* __restrict__ w, int c, long long C,
                                                 bf16_t (&win)[KW], float (&wv)[KW]) {
#pragma unroll
    for (int r = 0; r < KW - 1; r++) win[r] = st[(long long)r * C + c];
#pragma unroll
    for (int j = 0; j < KW; j++) wv[j] = bf2f(w[(long long)c * KW + j]);
}
template <int KW>
__device__ __forceinline__ bf16_t conv_window_out(bf16_t x, const float (&wv)[KW], bf16_t (&win)[KW]) {
    win[KW - 1] = x;
    float acc = 0.0f;
#pragma unroll
    for (int j = 0; j < KW; j++) acc += wv[j] * bf2f(win[j]);
    return f2bf(siluf_(acc));
}
template <int KW>
__device__ __forceinline__ void conv_state_shift(bf16_t* st, int c, long long C, const bf16_t (&win)[KW]) {
#pragma unroll
    for (int r = 0; r < KW - 1; r++) st[(long long)r * C + c] = win[r + 1];
}
template <int KW>
__device__ __forceinline__ bf16_t conv_decode_step(bf16_t x, const bf16_t* __restrict__ w, bf16_t* st, int c,
                                                   long long C) {
    bf16_t win[KW];
    float wv[KW];
    conv_window_load<KW>(st, w, c, C, win, wv);
    const bf16_t y = conv_window_out<KW>(x, wv, win);
    conv_state_shift<KW>(st, c, C, win);
    return y;
}

// Programmatic dependent launch (sm_90 and later; no-ops on Ampere/Ada, where every launch waits for
// the previous kernel as usual). pdl_trigger(): this kernel lets the next one in the stream launch
// now (that one still waits for this one's completion before reading its outputs). pdl_wait(): in a
// kernel launched to overlap its predecessor, waits until the predecessor has completed and its
// memory is visible; nothing the predecessor writes may be read (or overwritten) before it.
// A programmatically launched kernel is running while its predecessors write its inputs, so those
// inputs (anything an earlier kernel of the step wrote, not only the predecessor's outputs) must not
// be read through the non-coherent read-only path: no ld_nc / __ldg, and no `const T* __restrict__`
// parameters for them, of the kernel or of a helper it calls (from which the compiler may emit
// ld.global.nc). Measured on the H200
// (bench/results/pdl-coherent-loads-h200-2026-11-30.md): a `const __restrict__` load of z (written by the
// in-projection two kernels back) right after pdl_wait() read the previous layer's values; the same
// load through L2, or placed later, read the right ones. tests/pdl_reads.rs checks the sources.
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
    ds_trace_wait_done();
}
// pdl_enter(): the first statement of a kernel that its launcher may launch programmatically
// (launch_pdl!) and that reads nothing before its predecessor is done: lets the next kernel launch,
// then waits for the predecessor. Every block of such a kernel passes here before touching memory or
// returning, so its completion implies its predecessors' (the chain stays ordered).
__device__ __forceinline__ void pdl_enter() {
    pdl_trigger();
    pdl_wait();
}

// ---------------------------------------------------------------------------------------------
// KV-cache codes (kv_quant.cu's kv_write_q, rope.cu's qk_norm_rope; attention_*.cu read the formats): the
// formats (nvrtc::KvFormats::code) and one token-head row's encoding, as deltaserve_cpu::kvquant rounds it
// (kv_quant.cu's header has the rules).
#define KVF_BF16 0
#define KVF_FP8 1
#define KVF_INT8 2
#define KVF_INT4 3

// f16 bits of the stored scale for a wanted scale s = amax / qmax > 0 (kvquant::f16_scale).
__device__ __forceinline__ unsigned short kq_scale_bits(float s) {
    if (!(s <= 65504.0f)) return 0x7bffu;  // NaN or above the largest finite f16
    unsigned short h = f32_to_f16_rn(s);
    if (f16_to_f32(h) < s) h += 1;  // round up (from 0 this gives 2^-24, the clamp's floor)
    return h;
}

// The e4m3 (OCP FN) code nearest to y, ties to even, saturating at +-448, NaN -> 0 (kvquant::f32_to_e4m3).
__device__ __forceinline__ unsigned int kq_e4m3(float y) {
    if (y != y) return 0u;
    const unsigned int sign = (__float_as_uint(y) >> 24) & 0x80u;
    const float a = fminf(fabsf(y), 448.0f);
    if (a < 0.015625f) return sign | (unsigned int)rintf(a * 512.0f);  // subnormal: multiple of 2^-9
    int e = (int)(__float_as_uint(a) >> 23) - 127;                      // in [-6, 8]
    float r = rintf(a * __uint_as_float((unsigned int)(127 + 3 - e) << 23));  // a / 2^(e-3), exact
    if (r >= 16.0f) {
        e += 1;
        r = 8.0f;
    }
    return sign | ((unsigned int)(e + 7) << 3) | ((unsigned int)r - 8u);
}

// Two f32 -> e4m3 codes (lo in bits 0..7), round to nearest even, saturating at +-448: the hardware
// conversion on sm_89 and later, kq_e4m3 (the same rounding) before.
__device__ __forceinline__ u32 f8_pack2(float lo, float hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    unsigned short r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    return (u32)r;
#else
    return kq_e4m3(lo) | (kq_e4m3(hi) << 8);
#endif
}

// The FP8 GEMM's activation quantisation (fp8.cu's fp8_act_quant, and the producers that quantise their
// output for it): a lane's 8 features f of a 128-feature block that its half-warp holds (lanes 16h ..
// 16h + 15 in feature order; every lane of the warp calls, the shuffles need them all) -> their 8 e4m3
// codes of f * (1 / s), s = amax / 448 over the block (1 for an all-zero block), returned in `s`.
__device__ __forceinline__ uint2 f8_quant8(const float (&f)[8], float& s) {
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; i++) amax = fmaxf(amax, fabsf(f[i]));
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    s = amax > 0.0f ? __fdiv_rn(amax, 448.0f) : 1.0f;
    const float inv = __frcp_rn(s);
    uint2 out;
    out.x = f8_pack2(f[0] * inv, f[1] * inv) | (f8_pack2(f[2] * inv, f[3] * inv) << 16);
    out.y = f8_pack2(f[4] * inv, f[5] * inv) | (f8_pack2(f[6] * inv, f[7] * inv) << 16);
    return out;
}

// One code of a scaled format for y = x / scale (the low 8 bits; int4 uses the low 4).
__device__ __forceinline__ unsigned int kq_code(int fmt, float y) {
    if (fmt == KVF_FP8) return kq_e4m3(y);
    const float qmax = fmt == KVF_INT8 ? 127.0f : 7.0f;
    const int q = (int)fminf(fmaxf(rintf(y), -qmax), qmax);
    return (unsigned int)q & 0xffu;
}

// Stores one token-head row `x` (hd bf16) into `dst` (the row's bytes) and its scale.
__device__ __forceinline__ void kq_row(const bf16_t* x, unsigned char* dst, unsigned short* scale,
                                       int hd, int fmt, int lane) {
    const int pairs = hd >> 1;
    if (fmt == KVF_BF16) {
        for (int i = lane; i < pairs; i += 32) ((u32*)dst)[i] = ((const u32*)x)[i];
        return;
    }
    float amax = 0.0f;
    for (int i = lane; i < pairs; i += 32) {
        const u32 w = ((const u32*)x)[i];
        amax = fmaxf(amax, fmaxf(fabsf(__uint_as_float(w << 16)), fabsf(__uint_as_float(w & 0xffff0000u))));
    }
    amax = warp_max(amax);
    const float qmax = fmt == KVF_FP8 ? 448.0f : (fmt == KVF_INT8 ? 127.0f : 7.0f);
    const unsigned short sb = amax > 0.0f ? kq_scale_bits(__fdiv_rn(amax, qmax)) : (unsigned short)0;
    const float sc = f16_to_f32(sb);
    if (lane == 0) *scale = sb;
    for (int i = lane; i < pairs; i += 32) {
        const u32 w = ((const u32*)x)[i];
        unsigned int c0 = 0, c1 = 0;
        if (sb != 0) {
            c0 = kq_code(fmt, __fdiv_rn(__uint_as_float(w << 16), sc));
            c1 = kq_code(fmt, __fdiv_rn(__uint_as_float(w & 0xffff0000u), sc));
        }
        if (fmt == KVF_INT4) {
            dst[i] = (unsigned char)((c0 & 0xfu) | ((c1 & 0xfu) << 4));
        } else {
            ((unsigned short*)dst)[i] = (unsigned short)(c0 | (c1 << 8));
        }
    }
}

// Bytes of one token-head row of hd elements in format fmt.
__device__ __forceinline__ long long kq_row_bytes(int fmt, int hd) {
    return fmt == KVF_BF16 ? 2LL * hd : (fmt == KVF_INT4 ? hd / 2 : hd);
}
