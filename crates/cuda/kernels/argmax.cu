// argmax.cu — greedy token selection on the device: the argmax of each logits row.
//
// Computes: ids[r] = the first i < valid (lowest index on ties) with x[r, i] == max_{j < valid} x[r, j],
//           with the host's sequential rule (`best = 0; for i: if x[i] > x[best] best = i`): NaNs are
//           never a maximum, and a NaN at index 0 keeps index 0 (nothing compares greater than it).
//  argmax_rows:  one block per row.
//  argmax_part + argmax_merge: a row split into P parts of `chunk` ids (a multiple of 4), one block each;
//                each part's best (value, index) into pv / pi [R, P], then one warp per row takes the best
//                of its P (candidates are ordered by value, then index: the same ids as argmax_rows).
// Shapes/dtypes: x [R, ld] f32 (logits rows, ld >= valid); ids [R] i32; pv [R, P] f32, pi [R, P] i32.
// Launch: argmax_rows grid (R), block 1024; argmax_part grid (P, R), block 256; argmax_merge grid (R),
//   block 32 (blocks: any multiple of 32 up to 1024). Arch: plain loads, warp shuffles, sm_80+.
// Measured in the 27B decode step (H200, bench/results/session24-h200-2026-12-01.md): with one 4-byte
// load per thread per iteration the block took ~96 us for a 248,320-token row; with 16-byte loads, four in
// flight a thread, ~47 us (one SM's share of the bandwidth); split over 61 blocks, 28 us (session 27). With
// steps launched ahead the GPU's time is the step's, so the split version is the one the backend runs.
// Tested by: tests/ops.rs cases "argmax" (both paths); tests/backend.rs `argmax_step_picks_the_logits_argmax`.

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

// Folds ids [b, e) of `row` into the thread's best candidate (blocks of any size): 16-byte loads, four in
// flight per thread, where row + b is 16-byte aligned; then the rest one by one. (am_better orders
// candidates by value, then index: the visiting order does not change the result.) Plain loads: an earlier
// kernel of the step wrote the logits (prelude.cuh, pdl_wait).
__device__ __forceinline__ void am_scan(const float* row, int b, int e, float& bv, int& bi) {
    int done = b;
    if ((reinterpret_cast<unsigned long long>(row + b) & 15ull) == 0) {
        const float4* r4 = reinterpret_cast<const float4*>(row + b);
        const int n4 = (e - b) >> 2, bd = blockDim.x;
        int j = threadIdx.x;
        for (; j + 3 * bd < n4; j += 4 * bd) {
            const float4 p = r4[j], q = r4[j + bd], u = r4[j + 2 * bd], w = r4[j + 3 * bd];
            am_take4(p, b + 4 * j, bv, bi);
            am_take4(q, b + 4 * (j + bd), bv, bi);
            am_take4(u, b + 4 * (j + 2 * bd), bv, bi);
            am_take4(w, b + 4 * (j + 3 * bd), bv, bi);
        }
        for (; j < n4; j += bd) am_take4(r4[j], b + 4 * j, bv, bi);
        done = b + 4 * n4;
    }
    for (int i = done + threadIdx.x; i < e; i += blockDim.x) am_take(row[i], i, bv, bi);
}

// The block's best candidate, in warp 0's lanes (every thread calls it: a barrier).
__device__ __forceinline__ void am_block_best(float& bv, int& bi) {
    am_warp_best(bv, bi);
    __shared__ float sv[32];
    __shared__ int si[32];
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

// The row's id from its best candidate: a NaN at index 0 wins the sequential rule (nothing is greater than
// it); all-NaN rows too.
__device__ __forceinline__ int am_id(const float* row, float bv, int bi) {
    const float x0 = row[0];
    return (x0 != x0 || bv != bv) ? 0 : bi;
}

extern "C" __global__ void argmax_rows(const float* x, long long ld, int valid, int* __restrict__ ids) {
    pdl_enter();  // launched programmatically on sm_90
    const float* row = x + (long long)blockIdx.x * ld;
    float bv = __int_as_float(0x7fc00000);  // NaN: "nothing yet"
    int bi = 0x7fffffff;
    am_scan(row, 0, valid, bv, bi);
    am_block_best(bv, bi);
    if (threadIdx.x == 0) ids[blockIdx.x] = am_id(row, bv, bi);
}

extern "C" __global__ void argmax_part(const float* x, long long ld, int valid, int chunk, float* __restrict__ pv,
                                       int* __restrict__ pi) {
    pdl_enter();  // launched programmatically on sm_90
    const int p = blockIdx.x, r = blockIdx.y;
    const float* row = x + (long long)r * ld;
    const int b = min(p * chunk, valid), e = min(b + chunk, valid);
    float bv = __int_as_float(0x7fc00000);
    int bi = 0x7fffffff;
    am_scan(row, b, e, bv, bi);
    am_block_best(bv, bi);
    if (threadIdx.x == 0) {
        pv[(long long)r * gridDim.x + p] = bv;
        pi[(long long)r * gridDim.x + p] = bi;
    }
}

extern "C" __global__ void argmax_merge(const float* x, long long ld, const float* pv, const int* pi, int parts,
                                        int* __restrict__ ids) {
    pdl_enter();  // launched programmatically on sm_90
    const int r = blockIdx.x;
    float bv = __int_as_float(0x7fc00000);
    int bi = 0x7fffffff;
    for (int i = threadIdx.x; i < parts; i += blockDim.x) am_take(pv[(long long)r * parts + i], pi[(long long)r * parts + i], bv, bi);
    am_block_best(bv, bi);
    if (threadIdx.x == 0) ids[r] = am_id(x + (long long)r * ld, bv, bi);
}
