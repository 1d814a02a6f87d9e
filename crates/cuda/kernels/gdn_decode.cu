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
//   gdn_decode_gated (decode rows + the gated RMSNorm): grid (B, Hv), block 4 * DV.
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

// Runs rows t0 .. t0 + n - 1 of one (sequence, value head) through the recurrence for value column c
// of this thread: warp w holds state rows [(w & 3) * RW, +RW) of column c in registers; the blocks of
// gdn_decode / gdn_recurrent have 4 warps (one 32-column group), gdn_decode_gated's 4 * DV / 32 warps
// (column group w >> 2). The column sums reduce over the 4 row groups in shared memory. Returns the
// last row's output (bf16-rounded) in the warps of row group 0, which also store o unless o is null.
// wait: a programmatically launched kernel (sm_90) whose state no earlier kernel of the step writes:
// the state loads are issued first, then it waits for the previous kernel (q, k, v, g, beta).
__device__ __forceinline__ float gdn_tokens(const bf16_t* q, const bf16_t* k, const bf16_t* v, long long v_stride,
                                            const float* g, const float* beta,
                                            float* __restrict__ st, bf16_t* __restrict__ o, int Hk,
                                            int Hv, int hv, int c, long long t0, int n, bool write_state,
                                            bool wait = false) {
    __shared__ float qs[DK], ks[DK], red[4][DV];
    const int w = (threadIdx.x >> 5) & 3;
    const int hk = hv / (Hv / Hk);
    float S[RW];
    float out = 0.0f;
#pragma unroll
    for (int r = 0; r < RW; r++) S[r] = st[(long long)(w * RW + r) * DV + c];
    if (wait) pdl_wait();
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
        red[w][c] = kv;
        __syncthreads();
        kv = red[0][c] + red[1][c] + red[2][c] + red[3][c];
        const float delta = bt * (bf2f(v[t * v_stride + (long long)hv * DV + c]) - kv);
        float ov = 0.0f;
#pragma unroll
        for (int r = 0; r < RW; r++) {
            S[r] += ks[w * RW + r] * delta;
            ov += S[r] * qs[w * RW + r];
        }
        __syncthreads();
        red[w][c] = ov;
        __syncthreads();
        if (w == 0) {
            const bf16_t ob = f2bf(red[0][c] + red[1][c] + red[2][c] + red[3][c]);
            out = bf2f(ob);
            if (o) o[(t * Hv + hv) * DV + c] = ob;
        }
    }
    if (write_state) {
#pragma unroll
        for (int r = 0; r < RW; r++) st[(long long)(w * RW + r) * DV + c] = S[r];
    }
    return out;
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

// gdn_decode_gated: gdn_decode followed by norm.cu's gated_rms_norm of the row's head, in one launch
// and bitwise the same: out[b, hv, :] = bf16(w * (o * rsqrt(mean(o^2) + eps)) * silu(z[b, hv, :]))
// with o the bf16 recurrence output (not stored). z row b head hv at z + b*z_tok_stride + hv*DV;
// w [DV] f32; out [B, Hv, DV] bf16. Launch: grid (B, Hv), block 4 * DV (DV / 32 column groups of 4
// warps). Padding rows (slot < 0) normalise o = 0, as the two kernels did.
extern "C" __global__ void __launch_bounds__(4 * DV)
gdn_decode_gated(const bf16_t* q, const bf16_t* k, const bf16_t* v, long long v_stride, const float* g,
                 const float* beta, float* __restrict__ state, const int* __restrict__ slots, const bf16_t* z,
                 long long z_tok_stride, const float* __restrict__ nw,
                 bf16_t* __restrict__ out, int Hk, int Hv, float eps) {
    // Launched programmatically on sm_90: the GEMV that follows may start streaming its weights, and
    // this kernel loads its state (no kernel before it in the step writes it; slots is a step input)
    // before it waits for the previous kernel's q, k, v, g, beta.
    pdl_trigger();
    __shared__ float gred[DV / 32];
    const int b = blockIdx.x, hv = blockIdx.y;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int c = (warp >> 2) * 32 + lane;
    float o = 0.0f;
    const int slot = slots[b];
    if (slot >= 0) {  // uniform over the block
        float* st = state + ((long long)slot * Hv + hv) * DK * DV;
        o = gdn_tokens(q, k, v, v_stride, g, beta, st, nullptr, Hk, Hv, hv, c, b, 1, true, true);
    } else {
        pdl_wait();
    }
    // gated_rms_norm's block sum over the DV values (its block of DV threads: warp = column group).
    if ((warp & 3) == 0) {
        const float ws = warp_sum(o * o);
        if (lane == 0) gred[warp >> 2] = ws;
    }
    __syncthreads();
    if ((warp & 3) == 0) {
        const float tsum = warp_sum(lane < DV / 32 ? gred[lane] : 0.0f);
        const float inv = rsqrtf(tsum / (float)DV + eps);
        const bf16_t* zrow = z + (long long)b * z_tok_stride + (long long)hv * DV;
        out[((long long)b * Hv + hv) * DV + c] = f2bf(nw[c] * (o * inv) * siluf_(bf2f(zrow[c])));
    }
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
