// gdn_decode.cu — Gated DeltaNet recurrence for one token per sequence (decode), batched over slots.
//
// Computes, per sequence b and value head v (S = state[slots[b], v] in [DK, DV], f32):
//   S = exp(g) S;  kv = S^T k;  delta = beta (v - kv);  S += k (x) delta;  o = S^T q
// (arch doc §2.2 step 8 with T = 1). The state is read once and written once.
// Sequences whose slot is < 0 (decode-graph padding) touch no state and output 0.
// Shapes/dtypes: q, k [B, Hk, DK] bf16 (normalised, q pre-scaled: gdn_gate.cu);
//   v [B, *] bf16 (head v at column v*DV, token stride v_stride); g, beta [B, Hv] f32;
//   state [slots, Hv, DK, DV] f32; slots [B] i32; o [B, Hv, DV] bf16.
// Launch: grid (B, Hv, DV / 32), block 128: lane = value column, warp w owns state rows
//   [w*DK/4, (w+1)*DK/4) in registers; the two column sums reduce across the 4 warps in smem.
//   Each warp reads 128 contiguous bytes per state row. -D DK, DV (multiples of 32).
// Arch: plain f32, sm_80+.
// Tested by: tests/ops.rs case "gdn_decode" against deltaserve_cpu::gdn::gdn_recurrent.

#ifndef DK
#define DK 128
#endif
#ifndef DV
#define DV 128
#endif
#define RW (DK / 4)

extern "C" __global__ void __launch_bounds__(128)
gdn_decode(const bf16_t* __restrict__ q, const bf16_t* __restrict__ k,
           const bf16_t* __restrict__ v, long long v_stride,
           const float* __restrict__ g, const float* __restrict__ beta,
           float* __restrict__ state, const int* __restrict__ slots,
           bf16_t* __restrict__ o, int Hk, int Hv) {
    __shared__ float qs[DK], ks[DK], red[4][32];
    const int b = blockIdx.x, hv = blockIdx.y, c = blockIdx.z * 32 + (threadIdx.x & 31);
    const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (slots[b] < 0) {  // padding row of a decode graph (whole block): no state, zero output
        if (w == 0) o[((long long)b * Hv + hv) * DV + c] = 0;
        return;
    }
    const int hk = hv / (Hv / Hk);
    for (int d = threadIdx.x; d < DK; d += blockDim.x) {
        qs[d] = bf2f(q[((long long)b * Hk + hk) * DK + d]);
        ks[d] = bf2f(k[((long long)b * Hk + hk) * DK + d]);
    }
    __syncthreads();
    float* st = state + ((long long)slots[b] * Hv + hv) * DK * DV;
    const float decay = expf(g[(long long)b * Hv + hv]);
    const float bt = beta[(long long)b * Hv + hv];
    float S[RW];
    float kv = 0.0f;
#pragma unroll
    for (int r = 0; r < RW; r++) {
        int d = w * RW + r;
        S[r] = st[(long long)d * DV + c] * decay;
        kv += S[r] * ks[d];
    }
    red[w][lane] = kv;
    __syncthreads();
    kv = red[0][lane] + red[1][lane] + red[2][lane] + red[3][lane];
    const float delta = bt * (bf2f(v[(long long)b * v_stride + (long long)hv * DV + c]) - kv);
    float ov = 0.0f;
#pragma unroll
    for (int r = 0; r < RW; r++) {
        int d = w * RW + r;
        S[r] += ks[d] * delta;
        ov += S[r] * qs[d];
        st[(long long)d * DV + c] = S[r];
    }
    __syncthreads();
    red[w][lane] = ov;
    __syncthreads();
    if (w == 0)
        o[((long long)b * Hv + hv) * DV + c] = f2bf(red[0][lane] + red[1][lane] + red[2][lane] + red[3][lane]);
}
