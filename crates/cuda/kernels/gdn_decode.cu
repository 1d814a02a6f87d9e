// gdn_decode.cu — Gated DeltaNet recurrence token by token, batched over sequence slots.
//
// Computes, per sequence b, value head v and token t of the sequence (S = state[slots[b], v] in
// [DK, DV], f32):
//   S = exp(g_t) S;  kv = S^T k_t;  delta = beta_t (v_t - kv);  S += k_t (x) delta;  o_t = S^T q_t
// (arch doc §2.2 step 8 with T = 1, applied per token).
//  gdn_decode:     one token per sequence (row b); the state is read once and written once.
//  gdn_recurrent:  lens[b] tokens of sequence b from row starts[b] (lens null: starts[b+1] - starts[b],
//                  starts being cu_seqlens) (speculative decoding): the verify
//                  pass runs with write_state = 0 (outputs only, the committed state is untouched), the
//                  commit with write_state = 1 over the accepted tokens. Both kernels run the same
//                  per-token arithmetic (gdn_tokens), so a commit leaves exactly the state that
//                  decoding the accepted tokens one by one leaves.
// Sequences whose slot is < 0 (decode-graph padding) touch no state and output 0.
// Shapes/dtypes: q, k [rows, Hk, DK] bf16 (normalised, q pre-scaled: gdn_gate.cu);
//   v [rows, *] bf16 (head v at column v*DV, row stride v_stride); g, beta [rows, Hv] f32;
//   state [slots, Hv, DK, DV] f32; slots, lens [B], starts [B] (or [B+1]) i32; o [rows, Hv, DV] bf16.
// Launch: grid (B, Hv, DV / 32), block 128: lane = value column, warp w owns state rows
//   [w*DK/4, (w+1)*DK/4) in registers; the two column sums reduce across the 4 warps in smem.
//   Each warp reads 128 contiguous bytes per state row. -D DK, DV (multiples of 32).
// Arch: plain f32, sm_80+.
// Tested by: tests/ops.rs cases "gdn_decode" and "gdn_recurrent" against deltaserve_cpu::gdn::gdn_recurrent.

#ifndef DK
#define DK 128
#endif
#ifndef DV
#define DV 128
#endif
#define RW (DK / 4)

// Runs rows t0 .. t0 + n - 1 of one (sequence, value head, 32 columns) block through the recurrence.
__device__ __forceinline__ void gdn_tokens(const bf16_t* __restrict__ q, const bf16_t* __restrict__ k,
                                           const bf16_t* __restrict__ v, long long v_stride,
                                           const float* __restrict__ g, const float* __restrict__ beta,
                                           float* __restrict__ st, bf16_t* __restrict__ o, int Hk,
                                           int Hv, int hv, int c, long long t0, int n, bool write_state) {
    __shared__ float qs[DK], ks[DK], red[4][32];
    const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int hk = hv / (Hv / Hk);
    float S[RW];
#pragma unroll
    for (int r = 0; r < RW; r++) S[r] = st[(long long)(w * RW + r) * DV + c];
    for (int i = 0; i < n; i++) {
        const long long t = t0 + i;
        __syncthreads();  // the previous token's reads of qs, ks and red are done
        for (int d = threadIdx.x; d < DK; d += blockDim.x) {
            qs[d] = bf2f(q[(t * Hk + hk) * DK + d]);
            ks[d] = bf2f(k[(t * Hk + hk) * DK + d]);
        }
        __syncthreads();
        const float decay = expf(g[t * Hv + hv]);
        const float bt = beta[t * Hv + hv];
        float kv = 0.0f;
#pragma unroll
        for (int r = 0; r < RW; r++) {
            S[r] *= decay;
            kv += S[r] * ks[w * RW + r];
        }
        red[w][lane] = kv;
        __syncthreads();
        kv = red[0][lane] + red[1][lane] + red[2][lane] + red[3][lane];
        const float delta = bt * (bf2f(v[t * v_stride + (long long)hv * DV + c]) - kv);
        float ov = 0.0f;
#pragma unroll
        for (int r = 0; r < RW; r++) {
            S[r] += ks[w * RW + r] * delta;
            ov += S[r] * qs[w * RW + r];
        }
        __syncthreads();
        red[w][lane] = ov;
        __syncthreads();
        if (w == 0) o[(t * Hv + hv) * DV + c] = f2bf(red[0][lane] + red[1][lane] + red[2][lane] + red[3][lane]);
    }
    if (write_state) {
#pragma unroll
        for (int r = 0; r < RW; r++) st[(long long)(w * RW + r) * DV + c] = S[r];
    }
}

extern "C" __global__ void __launch_bounds__(128)
gdn_decode(const bf16_t* __restrict__ q, const bf16_t* __restrict__ k,
           const bf16_t* __restrict__ v, long long v_stride,
           const float* __restrict__ g, const float* __restrict__ beta,
           float* __restrict__ state, const int* __restrict__ slots,
           bf16_t* __restrict__ o, int Hk, int Hv) {
    const int b = blockIdx.x, hv = blockIdx.y, c = blockIdx.z * 32 + (threadIdx.x & 31);
    if (slots[b] < 0) {  // padding row of a decode graph (whole block): no state, zero output
        if ((threadIdx.x >> 5) == 0) o[((long long)b * Hv + hv) * DV + c] = 0;
        return;
    }
    float* st = state + ((long long)slots[b] * Hv + hv) * DK * DV;
    gdn_tokens(q, k, v, v_stride, g, beta, st, o, Hk, Hv, hv, c, b, 1, true);
}

extern "C" __global__ void __launch_bounds__(128)
gdn_recurrent(const bf16_t* __restrict__ q, const bf16_t* __restrict__ k,
              const bf16_t* __restrict__ v, long long v_stride,
              const float* __restrict__ g, const float* __restrict__ beta,
              float* __restrict__ state, const int* __restrict__ slots,
              const int* __restrict__ starts, const int* __restrict__ lens,
              bf16_t* __restrict__ o, int Hk, int Hv, int write_state) {
    const int b = blockIdx.x, hv = blockIdx.y, c = blockIdx.z * 32 + (threadIdx.x & 31);
    const int n = lens ? lens[b] : starts[b + 1] - starts[b];
    if (slots[b] < 0 || n <= 0) return;  // uniform over the block
    float* st = state + ((long long)slots[b] * Hv + hv) * DK * DV;
    gdn_tokens(q, k, v, v_stride, g, beta, st, o, Hk, Hv, hv, c, starts[b], n, write_state != 0);
}
