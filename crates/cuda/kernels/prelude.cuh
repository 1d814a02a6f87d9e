// prelude.cuh — shared device helpers, prepended (as text) to every kernel source by src/nvrtc.rs.
//
// Computes: nothing by itself. Provides bf16 <-> f32 conversion on raw `unsigned short` bit
// patterns (so kernels need no toolkit header: NVRTC 13 has no built-in cuda_bf16.h), warp
// reductions, and small math helpers.
// Dtypes: bf16 is stored as `bf16_t` (= unsigned short, the upper 16 bits of an IEEE f32).
// Arch features: plain sm_80 instructions only (shuffles); runs on sm_80/86/89/90.
// Tested by: every op test in crates/cuda/tests/ops.rs (all kernels include it).

typedef unsigned short bf16_t;
typedef unsigned int u32;

// bf16 bits -> f32: the bf16 pattern is the top half of the f32 pattern.
__device__ __forceinline__ float bf2f(bf16_t x) { return __uint_as_float(((u32)x) << 16); }

// f32 -> bf16 bits, round to nearest even; NaN stays NaN (quiet).
__device__ __forceinline__ bf16_t f2bf(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16_t)(u >> 16);
}

// Round an f32 through bf16 (what storing to a bf16 tensor and reading back does).
__device__ __forceinline__ float round_bf(float f) { return bf2f(f2bf(f)); }

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

__device__ __forceinline__ float sigmoidf_(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ __forceinline__ float siluf_(float x) { return x / (1.0f + expf(-x)); }
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
