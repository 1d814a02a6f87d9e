// argmax.cu — greedy token selection on the device: the argmax of each logits row.
//
// Computes: ids[r] = the first i < valid (lowest index on ties) with x[r, i] == max_{j < valid} x[r, j],
//           with the host's sequential rule (`best = 0; for i: if x[i] > x[best] best = i`): NaNs are
//           never a maximum, and a NaN at index 0 keeps index 0 (nothing compares greater than it).
// Shapes/dtypes: x [R, ld] f32 (logits rows, ld >= valid); ids [R] i32.
// Launch: grid (R), block 1024 (any multiple of 32 up to 1024). Arch: plain loads, warp shuffles, sm_80+.
// Measured in the 27B decode step (H200, bench/results/decode-timeline-and-argmax-h200-2026-12-01.md): with one 4-byte
// load per thread per iteration the block took ~96 us for a 248,320-token row.
// Tested by: tests/ops/ case "argmax"; tests/backend.rs `argmax_step_picks_the_logits_argmax`.

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

extern "C" __global__ void argmax_rows(const float* x, long long ld, int valid, int* __restrict__ ids) {
    pdl_enter();  // launched programmatically on sm_90
    const float* row = x + (long long)blockIdx.x * ld;
    float bv = __int_as_float(0x7fc00000);  // NaN: "nothing yet"
    int bi = 0x7fffffff;
    // One block reads the whole row (the 27B's 993 KB): 16-byte loads, four in flight per thread, where
    // the row is 16-byte aligned; then the rest one by one. (am_better orders candidates by value,
    // then index: the visiting order does not change the result.) Plain loads: an earlier kernel of
    // the step wrote the logits (prelude.cuh, pdl_wait).
    int done = 0;
    if ((reinterpret_cast<unsigned long long>(row) & 15ull) == 0) {
        const float4* r4 = reinterpret_cast<const float4*>(row);
        const int n4 = valid >> 2, bd = blockDim.x;
        int j = threadIdx.x;
        for (; j + 3 * bd < n4; j += 4 * bd) {
            const float4 a = r4[j], b = r4[j + bd], c = r4[j + 2 * bd], d = r4[j + 3 * bd];
            am_take4(a, 4 * j, bv, bi);
            am_take4(b, 4 * (j + bd), bv, bi);
            am_take4(c, 4 * (j + 2 * bd), bv, bi);
            am_take4(d, 4 * (j + 3 * bd), bv, bi);
        }
        for (; j < n4; j += bd) am_take4(r4[j], 4 * j, bv, bi);
        done = 4 * n4;
    }
    for (int i = done + threadIdx.x; i < valid; i += blockDim.x) am_take(row[i], i, bv, bi);
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
        if (lane == 0) {
            // A NaN at index 0 wins the sequential rule (nothing is greater than it); all-NaN rows too.
            const float x0 = row[0];
            ids[blockIdx.x] = (x0 != x0 || bv != bv) ? 0 : bi;
        }
    }
}
