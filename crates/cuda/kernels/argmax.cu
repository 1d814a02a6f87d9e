// argmax.cu — greedy token selection on the device: the argmax of each logits row.
//
// Computes: ids[r] = the first i < valid (lowest index on ties) with x[r, i] == max_{j < valid} x[r, j],
//           with the host's sequential rule (`best = 0; for i: if x[i] > x[best] best = i`): NaNs are
//           never a maximum, and a NaN at index 0 keeps index 0 (nothing compares greater than it).
// In two launches: argmax_part, block (r, p) the best (value, index) of elements [p AM_CHUNK, (p + 1)
// AM_CHUNK) of row r into part[r * np + p]; argmax_final, block r the best of the row's np parts into
// ids[r]. (am_better orders candidates by value, then index: the result does not depend on which block
// or thread saw which element.)
// Shapes/dtypes: x [R, ld] f32 (logits rows, ld >= valid); part [R, np] int2 (value bits, index), np =
// ceil(valid / AM_CHUNK); ids [R] i32.
// Launch: argmax_part grid (R, np), block 256; argmax_final grid (R), block 32. Arch: plain loads, warp
// shuffles, sm_80+.
// Measured in the 27B decode step (H200): one block a row took ~96 us for a 248,320-token row with 4-byte
// loads, 28 us with 16-byte ones (bench/results/session24-h200-2026-12-01.md); spread over the row's 61
// blocks, bench/results/session25-h200-2026-12-01.md.
// Tested by: tests/ops.rs case "argmax"; tests/backend.rs `argmax_step_picks_the_logits_argmax`.

#define AM_CHUNK 4096  // elements of a row per argmax_part block (a multiple of 4 * 256)

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

// Folds x[i] (index i) into the thread's best candidate.
__device__ __forceinline__ void am_take(float v, int i, float& bv, int& bi) {
    if (am_better(v, i, bv, bi)) {
        bv = v;
        bi = i;
    }
}
__device__ __forceinline__ void am_take4(float4 v, int i, float& bv, int& bi) {
    am_take(v.x, i, bv, bi);
    am_take(v.y, i + 1, bv, bi);
    am_take(v.z, i + 2, bv, bi);
    am_take(v.w, i + 3, bv, bi);
}

// The best candidate of the block (blockDim.x a multiple of 32, at most 1024), in thread 0.
__device__ __forceinline__ void am_block_best(float& bv, int& bi) {
    __shared__ float sv[32];
    __shared__ int si[32];
    am_warp_best(bv, bi);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    if (lane == 0) {
        sv[warp] = bv;
        si[warp] = bi;
    }
    __syncthreads();
    if (warp == 0) {
        bv = lane < nw ? sv[lane] : __int_as_float(0x7fc00000);
        bi = lane < nw ? si[lane] : 0x7fffffff;
        am_warp_best(bv, bi);
    }
}

extern "C" __global__ void __launch_bounds__(256)
argmax_part(const float* x, long long ld, int valid, int np, int2* __restrict__ part) {
    pdl_enter();  // launched programmatically on sm_90
    const float* row = x + (long long)blockIdx.x * ld;
    const int c0 = blockIdx.y * AM_CHUNK, c1 = min(valid, c0 + AM_CHUNK);
    float bv = __int_as_float(0x7fc00000);  // NaN: "nothing yet"
    int bi = 0x7fffffff;
    // 16-byte loads, all of the thread's in flight at once, where the row is 16-byte aligned; then the
    // rest one by one. Plain loads: an earlier kernel of the step wrote the logits (prelude.cuh, pdl_wait).
    int done = c0;
    if ((reinterpret_cast<unsigned long long>(row) & 15ull) == 0) {
        const float4* r4 = reinterpret_cast<const float4*>(row);
        const int j0 = c0 >> 2, n4 = (c1 >> 2) - j0;
        float4 v[AM_CHUNK / 4 / 256];
#pragma unroll
        for (int u = 0; u < AM_CHUNK / 4 / 256; u++) {
            const int j = threadIdx.x + 256 * u;
            v[u] = j < n4 ? r4[j0 + j] : make_float4(0.f, 0.f, 0.f, 0.f);
        }
#pragma unroll
        for (int u = 0; u < AM_CHUNK / 4 / 256; u++) {
            const int j = threadIdx.x + 256 * u;
            if (j < n4) am_take4(v[u], 4 * (j0 + j), bv, bi);
        }
        done = 4 * (j0 + n4);
    }
    for (int i = done + threadIdx.x; i < c1; i += blockDim.x) am_take(row[i], i, bv, bi);
    am_block_best(bv, bi);
    if (threadIdx.x == 0) part[(long long)blockIdx.x * np + blockIdx.y] = make_int2(__float_as_int(bv), bi);
}

extern "C" __global__ void argmax_final(const float* x, long long ld, int np, const int2* part, int* __restrict__ ids) {
    pdl_enter();  // launched programmatically on sm_90
    float bv = __int_as_float(0x7fc00000);
    int bi = 0x7fffffff;
    for (int p = threadIdx.x; p < np; p += 32) {
        const int2 c = part[(long long)blockIdx.x * np + p];
        am_take(__int_as_float(c.x), c.y, bv, bi);
    }
    am_warp_best(bv, bi);
    if (threadIdx.x == 0) {
        // A NaN at index 0 wins the sequential rule (nothing is greater than it); all-NaN rows too.
        const float x0 = x[(long long)blockIdx.x * ld];
        ids[blockIdx.x] = (x0 != x0 || bv != bv) ? 0 : bi;
    }
}
