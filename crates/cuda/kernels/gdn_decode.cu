// gdn_decode.cu — Gated DeltaNet recurrence token by token, batched over sequence slots.
//
// Computes, per sequence b, value head v and token t of the sequence (S = state[slots[b], v] in
// [DK, DV], f32):
//   S = exp(g_t) S;  kv = S^T k_t;  delta = beta_t (v_t - kv);  S += k_t (x) delta;  o_t = S^T q_t
// (docs/architecture.md §2.2 step 8 with T = 1, applied per token).
//  gdn_decode:     one token per sequence (row b); the state is read once and written once.
//  gdn_recurrent:  lens[b] tokens of sequence b from row starts[b] (lens null: starts[b+1] - starts[b],
//                  starts being cu_seqlens) (speculative decoding): the verify
//                  pass runs with write_state = 0 (outputs only, the committed state is untouched), the
//                  commit with write_state = 1 over the accepted tokens. Every kernel here runs the
//                  same per-token arithmetic (gdn_token), so a commit leaves exactly the state that
//                  decoding the accepted tokens one by one leaves.
// Sequences whose slot is < 0 (decode-graph padding) touch no state and output 0.
// Shapes/dtypes: q, k [rows, Hk, DK] bf16 (normalised, q pre-scaled: gdn_gate.cu);
//   v [rows, *] bf16 (head v at column v*DV, row stride v_stride); g, beta [rows, Hv] f32;
//   state [slots, Hv, DK, DV] state_t (f32, or bf16 under -D STATE_BF16=1: prelude.cuh); slots, lens [B],
//   starts [B] (or [B+1]) i32; o [rows, Hv, DV] bf16.
// Launch: grid (B, Hv, DV / 32), block 128: lane = value column, warp w owns state rows
//   [w*DK/4, (w+1)*DK/4) in registers; the two column sums reduce across the 4 warps in smem.
//   gdn_decode_gated (decode rows + the gated RMSNorm): grid (B, Hv), block 4 * DV (a bf16 state with DV a
//   multiple of 64: block 2 * DV, two columns a lane).
//   gdn_rows (a speculative step's verify or commit rows with their conv and gates): described above it.
//   gdn_commit_layers (the commit of gdn_rows for many layers in one launch): described above it.
//   Each warp reads 128 contiguous bytes per state row. -D DK, DV (multiples of 32), CONV_K.
// Arch: plain f32, sm_80+.
// Tested by: tests/ops/ cases "gdn_decode" and "gdn_recurrent" against deltaserve_cpu::gdn::gdn_recurrent.

#ifndef DK
#define DK 128
#endif
#ifndef DV
#define DV 128
#endif
#ifndef CONV_K
#define CONV_K 4
#endif
#define RW (DK / 4)

// One token of the recurrence for value column c: warp row group w (0..3) holds state rows
// [w*RW, +RW) of the column in S; qs, ks the token's q, k (f32, shared), vv its v value of column c.
// Decays S, adds k (x) delta, and returns bf16(o[c]) in the warps of row group 0 (0 elsewhere). The
// column sums reduce over the 4 row groups in red (shared). Every thread of the block calls it
// (barriers); red must be free on entry.
__device__ __forceinline__ bf16_t gdn_token(float (&S)[RW], const float* qs, const float* ks, float decay, float bt,
                                            float vv, int w, int c, float (*red)[DV]) {
    float kv = 0.0f;
#pragma unroll
    for (int r = 0; r < RW; r++) {
        S[r] *= decay;
        kv += S[r] * ks[w * RW + r];
    }
    red[w][c] = kv;
    __syncthreads();
    kv = red[0][c] + red[1][c] + red[2][c] + red[3][c];
    const float delta = bt * (vv - kv);
    float ov = 0.0f;
#pragma unroll
    for (int r = 0; r < RW; r++) {
        S[r] += ks[w * RW + r] * delta;
        ov += S[r] * qs[w * RW + r];
        S[r] = state_kept(S[r]);  // what the slot keeps (bf16 state: rounded); o reads the f32 update
    }
    __syncthreads();
    red[w][c] = ov;
    __syncthreads();
    return w == 0 ? f2bf(red[0][c] + red[1][c] + red[2][c] + red[3][c]) : (bf16_t)0;
}

// Runs rows t0 .. t0 + n - 1 of one (sequence, value head) through the recurrence for value column c
// of this thread (gdn_decode / gdn_recurrent: blocks of 4 warps, one 32-column group): warp w holds
// state rows [w * RW, +RW) of column c in registers (gdn_token); stores o unless it is null. Rows are
// loaded GDN_ROWS at a time.
__device__ __forceinline__ void gdn_tokens(const bf16_t* __restrict__ q, const bf16_t* __restrict__ k,
                                           const bf16_t* __restrict__ v, long long v_stride,
                                           const float* __restrict__ g, const float* __restrict__ beta,
                                           state_t* __restrict__ st, bf16_t* __restrict__ o, int Hk, int Hv, int hv,
                                           int c, long long t0, int n, bool write_state) {
    __shared__ float qs[GDN_ROWS][DK], ks[GDN_ROWS][DK], red[4][DV];
    const int w = (threadIdx.x >> 5) & 3;
    const int hk = hv / (Hv / Hk);
    float S[RW];
#pragma unroll
    for (int r = 0; r < RW; r++) S[r] = state_ld(st + (long long)(w * RW + r) * DV + c);
    for (int i0 = 0; i0 < n; i0 += GDN_ROWS) {
        const int m = min(GDN_ROWS, n - i0);
        __syncthreads();  // the previous rows' reads of qs and ks are done
        for (int e = threadIdx.x; e < m * DK; e += blockDim.x) {
            const long long t = t0 + i0 + e / DK;
            const int d = e % DK;
            qs[e / DK][d] = bf2f(q[(t * Hk + hk) * DK + d]);
            ks[e / DK][d] = bf2f(k[(t * Hk + hk) * DK + d]);
        }
        float dec[GDN_ROWS], bt[GDN_ROWS], vv[GDN_ROWS];
#pragma unroll
        for (int i = 0; i < GDN_ROWS; i++) {
            const long long t = t0 + i0 + min(i, m - 1);
            dec[i] = expf(g[t * Hv + hv]);
            bt[i] = beta[t * Hv + hv];
            vv[i] = bf2f(v[t * v_stride + (long long)hv * DV + c]);
        }
        __syncthreads();
#pragma unroll
        for (int i = 0; i < GDN_ROWS; i++) {
            if (i < m) {  // uniform over the block
                if (i > 0) __syncthreads();  // the previous row's reads of red are done
                const bf16_t ob = gdn_token(S, qs[i], ks[i], dec[i], bt[i], vv[i], w, c, red);
                if (w == 0 && o) o[((t0 + i0 + i) * Hv + hv) * DV + c] = ob;
            }
        }
    }
    if (write_state) {
#pragma unroll
        for (int r = 0; r < RW; r++) state_st(st + (long long)(w * RW + r) * DV + c, S[r]);
    }
}

extern "C" __global__ void __launch_bounds__(128)
gdn_decode(const bf16_t* __restrict__ q, const bf16_t* __restrict__ k,
           const bf16_t* __restrict__ v, long long v_stride,
           const float* __restrict__ g, const float* __restrict__ beta,
           state_t* __restrict__ state, const int* __restrict__ slots,
           bf16_t* __restrict__ o, int Hk, int Hv) {
    const int b = blockIdx.x, hv = blockIdx.y, c = blockIdx.z * 32 + (threadIdx.x & 31);
    if (slots[b] < 0) {  // padding row of a decode graph (whole block): no state, zero output
        if ((threadIdx.x >> 5) == 0) o[((long long)b * Hv + hv) * DV + c] = 0;
        return;
    }
    state_t* st = state + ((long long)slots[b] * Hv + hv) * DK * DV;
    gdn_tokens(q, k, v, v_stride, g, beta, st, o, Hk, Hv, hv, c, b, 1, true);
}

// norm.cu's gated_rms_norm of one (row, head) whose recurrence output o is held one column a thread by
// the DV / 32 active warps, warp `group` holding columns 32 group .. 32 group + 31: the block sum over
// the DV values (each warp's sum, then the groups' in order), then *dst = bf16(nwc * (o * inv) *
// silu(zv)) in the active warps. Every thread calls it (one barrier); gred must be free on entry.
__device__ __forceinline__ void gdn_gated_norm(float o, float nwc, float zv, bool active, int group, int lane,
                                               float* gred, float eps, bf16_t* dst) {
    if (active) {
        const float ws = warp_sum(o * o);
        if (lane == 0) gred[group] = ws;
    }
    __syncthreads();
    if (active) {
        const float tsum = warp_sum(lane < DV / 32 ? gred[lane] : 0.0f);
        const float inv = rsqrtf(tsum / (float)DV + eps);
        *dst = f2bf(nwc * (o * inv) * siluf_(zv));
    }
}

// gdn_gated_norm over a block of 4 * DV threads whose recurrence output o (column c = this thread's) is
// in the warps of row group 0 (warp = column group * 4 + row group).
__device__ __forceinline__ void gdn_gated_out(float o, float nwc, float zv, int warp, int lane, float* gred, float eps,
                                              bf16_t* dst) {
    gdn_gated_norm(o, nwc, zv, (warp & 3) == 0, warp >> 2, lane, gred, eps, dst);
}

// The arguments of gdn_decode_gated (both forms below).
#define GDN_DECODE_GATED_ARGS                                                                                  \
    const bf16_t *q, const bf16_t *k, const bf16_t *v, long long v_stride, const float *g, const float *beta,   \
        state_t *__restrict__ state, const int *__restrict__ slots, const bf16_t *z, long long z_tok_stride,    \
        const float *__restrict__ nw, bf16_t *__restrict__ out, int Hk, int Hv, float eps
#if defined(STATE_BF16) && STATE_BF16 && DV % 64 == 0
// gdn_decode_gated over a bf16 state: a lane holds two adjacent columns c, c + 1 of its row group's RW state
// rows (a row's two values in one 4-byte load and store: 128 contiguous bytes a warp, as the f32 state's
// lanes read, instead of 64), each column's arithmetic exactly gdn_token's (the same products, sums and
// rounding, so decode, verify and commit still agree bit for bit); the gated RMSNorm then runs on threads
// 0 .. DV - 1, one column each, warp w summing columns 32w .. 32w + 31 (gdn_gated_norm, as gdn_gated_out's
// row-group-0 warps do: bitwise norm.cu's gated_rms_norm). Launch: grid (B, Hv), block 2 * DV (DV / 64
// column groups of 4 warps). Other DV (small test models): the kernel below, a column a lane.
extern "C" __global__ void __launch_bounds__(2 * DV, 2)
gdn_decode_gated(GDN_DECODE_GATED_ARGS) {
    pdl_trigger();
    __shared__ float qs[DK], ks[DK], red[4][DV], ob[DV], gred[DV / 32];
    const int b = blockIdx.x, hv = blockIdx.y, hk = hv / (Hv / Hk);
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, w = warp & 3;
    const int c = (warp >> 2) * 64 + 2 * lane;  // this lane's columns c, c + 1
    const int slot = slots[b];                  // uniform over the block
    state_t* st = state + ((long long)max(slot, 0) * Hv + hv) * DK * DV;
    float S0[RW], S1[RW];
    if (slot >= 0) {
#pragma unroll
        for (int r = 0; r < RW; r++) {
            const u32 two = *(const u32*)(st + (long long)(w * RW + r) * DV + c);
            S0[r] = __uint_as_float(two << 16);
            S1[r] = __uint_as_float(two & 0xffff0000u);
        }
    }
    const float nwc = tid < DV ? nw[tid] : 0.0f;  // the norm's column tid (a weight: no kernel writes it)
    pdl_wait();
    const float zv = tid < DV ? bf2f(z[(long long)b * z_tok_stride + (long long)hv * DV + tid]) : 0.0f;
    if (slot >= 0) {
        for (int d = tid; d < DK; d += blockDim.x) {
            qs[d] = bf2f(q[((long long)b * Hk + hk) * DK + d]);
            ks[d] = bf2f(k[((long long)b * Hk + hk) * DK + d]);
        }
        const float decay = expf(g[(long long)b * Hv + hv]), bt = beta[(long long)b * Hv + hv];
        const u32 vv2 = *(const u32*)(v + (long long)b * v_stride + (long long)hv * DV + c);
        const float vv0 = __uint_as_float(vv2 << 16), vv1 = __uint_as_float(vv2 & 0xffff0000u);
        __syncthreads();
        // gdn_token for both columns.
        float kv0 = 0.0f, kv1 = 0.0f;
#pragma unroll
        for (int r = 0; r < RW; r++) {
            S0[r] *= decay;
            kv0 += S0[r] * ks[w * RW + r];
            S1[r] *= decay;
            kv1 += S1[r] * ks[w * RW + r];
        }
        *(float2*)&red[w][c] = make_float2(kv0, kv1);
        __syncthreads();
        kv0 = red[0][c] + red[1][c] + red[2][c] + red[3][c];
        kv1 = red[0][c + 1] + red[1][c + 1] + red[2][c + 1] + red[3][c + 1];
        const float delta0 = bt * (vv0 - kv0), delta1 = bt * (vv1 - kv1);
        float ov0 = 0.0f, ov1 = 0.0f;
#pragma unroll
        for (int r = 0; r < RW; r++) {
            S0[r] += ks[w * RW + r] * delta0;
            ov0 += S0[r] * qs[w * RW + r];
            S1[r] += ks[w * RW + r] * delta1;
            ov1 += S1[r] * qs[w * RW + r];
        }
        __syncthreads();
        *(float2*)&red[w][c] = make_float2(ov0, ov1);
        __syncthreads();
        if (w == 0) {
            ob[c] = bf2f(f2bf(red[0][c] + red[1][c] + red[2][c] + red[3][c]));
            ob[c + 1] = bf2f(f2bf(red[0][c + 1] + red[1][c + 1] + red[2][c + 1] + red[3][c + 1]));
        }
        // What the slot keeps: each value rounded as state_kept rounds it.
#pragma unroll
        for (int r = 0; r < RW; r++) *(u32*)(st + (long long)(w * RW + r) * DV + c) = pack_bf16(S0[r], S1[r]);
    } else if (tid < DV) {
        ob[tid] = 0.0f;  // padding row: o = 0, normalised as the two kernels did
    }
    __syncthreads();
    const bool active = warp < DV / 32;
    gdn_gated_norm(active ? ob[tid] : 0.0f, nwc, zv, active, warp, lane, gred, eps,
                   out + ((long long)b * Hv + hv) * DV + tid);
}
#else
// gdn_decode_gated: gdn_decode followed by norm.cu's gated_rms_norm of the row's head, in one launch
// and bitwise the same: out[b, hv, :] = bf16(w * (o * rsqrt(mean(o^2) + eps)) * silu(z[b, hv, :]))
// with o the bf16 recurrence output (not stored). z row b head hv at z + b*z_tok_stride + hv*DV;
// w [DV] f32; out [B, Hv, DV] bf16. Launch: grid (B, Hv), block 4 * DV (DV / 32 column groups of 4
// warps). Padding rows (slot < 0) normalise o = 0, as the two kernels did.
extern "C" __global__ void __launch_bounds__(4 * DV, 2)
gdn_decode_gated(GDN_DECODE_GATED_ARGS) {
    // Launched programmatically on sm_90: the GEMV that follows may start streaming its weights, and
    // this kernel loads its state (no kernel before it in the step writes it; slots is a step input)
    // (and its norm weight) before it waits for the previous kernel; then every input of the row (q,
    // k, g, beta, v, z) is loaded at once, one round trip.
    pdl_trigger();
    __shared__ float qs[DK], ks[DK], red[4][DV], gred[DV / 32];
    const int b = blockIdx.x, hv = blockIdx.y, hk = hv / (Hv / Hk);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, w = warp & 3;
    const int c = (warp >> 2) * 32 + lane;
    const int slot = slots[b];  // uniform over the block
    state_t* st = state + ((long long)max(slot, 0) * Hv + hv) * DK * DV;
    float S[RW];
    if (slot >= 0) {
#pragma unroll
        for (int r = 0; r < RW; r++) S[r] = state_ld(st + (long long)(w * RW + r) * DV + c);
    }
    const float nwc = w == 0 ? nw[c] : 0.0f;  // (a weight: no kernel writes it)
    pdl_wait();
    const float zv = w == 0 ? bf2f(z[(long long)b * z_tok_stride + (long long)hv * DV + c]) : 0.0f;
    float o = 0.0f;
    if (slot >= 0) {
        for (int d = threadIdx.x; d < DK; d += blockDim.x) {
            qs[d] = bf2f(q[((long long)b * Hk + hk) * DK + d]);
            ks[d] = bf2f(k[((long long)b * Hk + hk) * DK + d]);
        }
        const float decay = expf(g[(long long)b * Hv + hv]), bt = beta[(long long)b * Hv + hv];
        const float vv = bf2f(v[(long long)b * v_stride + (long long)hv * DV + c]);
        __syncthreads();
        o = bf2f(gdn_token(S, qs, ks, decay, bt, vv, w, c, red));
#pragma unroll
        for (int r = 0; r < RW; r++) state_st(st + (long long)(w * RW + r) * DV + c, S[r]);
    }
    gdn_gated_out(o, nwc, zv, warp, lane, gred, eps, out + ((long long)b * Hv + hv) * DV + c);
}
#endif

extern "C" __global__ void __launch_bounds__(128)
gdn_recurrent(const bf16_t* __restrict__ q, const bf16_t* __restrict__ k,
              const bf16_t* __restrict__ v, long long v_stride,
              const float* __restrict__ g, const float* __restrict__ beta,
              state_t* __restrict__ state, const int* __restrict__ slots,
              const int* __restrict__ starts, const int* __restrict__ lens,
              bf16_t* __restrict__ o, int Hk, int Hv, int write_state) {
    const int b = blockIdx.x, hv = blockIdx.y, c = blockIdx.z * 32 + (threadIdx.x & 31);
    const int n = lens ? lens[b] : starts[b + 1] - starts[b];
    if (slots[b] < 0 || n <= 0) return;  // uniform over the block
    state_t* st = state + ((long long)slots[b] * Hv + hv) * DK * DV;
    gdn_tokens(q, k, v, v_stride, g, beta, st, o, Hk, Hv, hv, c, starts[b], n, write_state != 0);
}

// gdn_recurrent_gated: the verify rows of speculative decoding (gdn_recurrent with write_state = 0)
// followed by the gated RMSNorm of each row's head (norm.cu's gated_rms_norm), in one launch and
// bitwise the same; the recurrence outputs are not stored and the state is not written. Sequence b's
// rows starts[b] .. starts[b + 1] - 1 (cu_seqlens); z row t head hv at z + t*z_tok_stride + hv*DV;
// out [rows, Hv, DV] bf16. Launch: grid (B, Hv), block 4 * DV, as gdn_decode_gated. Sequences of slot
// < 0 normalise o = 0.
extern "C" __global__ void __launch_bounds__(4 * DV, 2)
gdn_recurrent_gated(const bf16_t* q, const bf16_t* k, const bf16_t* v, long long v_stride, const float* g,
                    const float* beta, const state_t* __restrict__ state, const int* __restrict__ slots,
                    const int* __restrict__ starts, const bf16_t* z, long long z_tok_stride,
                    const float* __restrict__ nw, bf16_t* __restrict__ out, int Hk, int Hv, float eps) {
    __shared__ float qs[GDN_ROWS][DK], ks[GDN_ROWS][DK], vs[GDN_ROWS][DV], zs[GDN_ROWS][DV];
    __shared__ float red[4][DV], gred[DV / 32], dec[GDN_ROWS], bt[GDN_ROWS];
    const int b = blockIdx.x, hv = blockIdx.y, hk = hv / (Hv / Hk);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, w = warp & 3;
    const int c = (warp >> 2) * 32 + lane;
    const int slot = slots[b];  // uniform over the block
    const state_t* st = state + ((long long)max(slot, 0) * Hv + hv) * DK * DV;
    float S[RW];
#pragma unroll
    for (int r = 0; r < RW; r++) S[r] = slot >= 0 ? state_ld(st + (long long)(w * RW + r) * DV + c) : 0.0f;
    const float nwc = w == 0 ? nw[c] : 0.0f;
    for (int t0 = starts[b]; t0 < starts[b + 1]; t0 += GDN_ROWS) {
        const int m = min(GDN_ROWS, starts[b + 1] - t0);
        // Every input of rows t0 .. t0 + m - 1 loaded at once into shared memory (the previous rows'
        // reads of it are done: the barrier at the end of the loop).
        for (int e = threadIdx.x; e < m * DK; e += blockDim.x) {
            const long long t = t0 + e / DK;
            const int d = e % DK;
            qs[e / DK][d] = slot >= 0 ? bf2f(q[(t * Hk + hk) * DK + d]) : 0.0f;
            ks[e / DK][d] = slot >= 0 ? bf2f(k[(t * Hk + hk) * DK + d]) : 0.0f;
        }
        for (int e = threadIdx.x; e < m * DV; e += blockDim.x) {
            const long long t = t0 + e / DV;
            const int d = e % DV;
            vs[e / DV][d] = slot >= 0 ? bf2f(v[t * v_stride + (long long)hv * DV + d]) : 0.0f;
            zs[e / DV][d] = bf2f(z[t * z_tok_stride + (long long)hv * DV + d]);
        }
        if (slot >= 0 && threadIdx.x < m) {
            dec[threadIdx.x] = expf(g[(long long)(t0 + threadIdx.x) * Hv + hv]);
            bt[threadIdx.x] = beta[(long long)(t0 + threadIdx.x) * Hv + hv];
        }
        __syncthreads();
        for (int i = 0; i < m; i++) {
            float o = 0.0f;
            if (slot >= 0) o = bf2f(gdn_token(S, qs[i], ks[i], dec[i], bt[i], vs[i][c], w, c, red));
            gdn_gated_out(o, nwc, w == 0 ? zs[i][c] : 0.0f, warp, lane, gred, eps,
                          out + ((long long)(t0 + i) * Hv + hv) * DV + c);
        }
        __syncthreads();  // the shared inputs and gred are free for the next rows
    }
}

// gdn_rows: a speculative step's DeltaNet rows of one layer in one launch, per (sequence, value head):
// gdn_gate.cu's gdn_conv_gate_rows over the head's channels (the q and k channels of its key head, its
// v channels: each block of a key head computes the same q / k), then
//   commit == 0 (the verify): gdn_recurrent_gated — the recurrence from the committed state and the
//     gated RMSNorm of each row into out; neither state is written;
//   commit != 0: gdn_recurrent with write-back, and the conv state advanced over the rows (conv.cu's
//     conv_state_update: the last CONV_K - 1 inputs; a key head's q / k channels by its first value
//     head's block); out is not written;
// bitwise the same as those kernels. Sequence b's rows: starts[b] .. starts[b] + n - 1, n = lens[b] (lens
// non-null) or starts[b + 1] - starts[b], of x [*, x_stride] (the in-projection's qkv rows: q channels
// [0, Hk DK), k [Hk DK, 2 Hk DK), v from 2 Hk DK; C = 2 Hk DK + Hv DV) and ba [*, ba_stride] (b, then a
// at column Hv); conv weights cw [C, CONV_K], conv state [slots, CONV_K - 1, C] bf16, state as
// gdn_recurrent's; z, nw, out as gdn_recurrent_gated's. A sequence of slot < 0 normalises o = 0 and
// writes no state. trace_x / trace_ba (verify, when not null): the rows of x and ba the block reads, copied
// to the same columns of row t - starts[0] (the speculative trace the commit replays; x's q / k channels by the
// key head's first value head), at x's and ba's row strides. Launch: grid (B, Hv), block 4 * DV
// (2 DK + DV <= 4 DV). -D DK, DV, CONV_K.
// Tested by: tests/ops/ case "gdn_rows" (bitwise vs the kernels it replaces).
// gdn_rows_body: the block (sequence b, value head hv) of gdn_rows, shared with gdn_commit_layers.
__device__ __forceinline__ void gdn_rows_body(const bf16_t* x, long long x_stride, const bf16_t* __restrict__ cw,
                                              bf16_t* conv_state, const bf16_t* ba, long long ba_stride,
                                              const float* __restrict__ A_log, const float* __restrict__ dt_bias,
                                              state_t* state, const int* __restrict__ slots,
                                              const int* __restrict__ starts, const int* __restrict__ lens,
                                              const bf16_t* z, long long z_tok_stride, const float* __restrict__ nw,
                                              bf16_t* __restrict__ out, bf16_t* __restrict__ trace_x,
                                              bf16_t* __restrict__ trace_ba, int Hk, int Hv, float eps, int commit,
                                              int b, int hv) {
    constexpr int NCH = 2 * DK + DV;  // the block's conv channels: q, k of its key head, then its v
    __shared__ bf16_t ys[GDN_ROWS][NCH], qn[GDN_ROWS][DK], kn[GDN_ROWS][DK];
    __shared__ float qs[GDN_ROWS][DK], ks[GDN_ROWS][DK], red[4][DV], gred[DV / 32], gv[GDN_ROWS], bv[GDN_ROWS];
    const int hk = hv / (Hv / Hk);
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, w = warp & 3;
    const int c = (warp >> 2) * 32 + lane;
    const int slot = slots[b];  // uniform over the block
    const long long C = 2LL * Hk * DK + (long long)Hv * DV;
    const int r0 = starts[b], n = lens ? lens[b] : starts[b + 1] - r0;
    const bool has_ch = tid < NCH;
    const long long ch = tid < DK ? hk * DK + tid
                         : tid < 2 * DK ? (long long)Hk * DK + hk * DK + (tid - DK)
                                        : 2LL * Hk * DK + (long long)hv * DV + (tid - 2 * DK);
    bf16_t* cst = conv_state + (long long)max(slot, 0) * (CONV_K - 1) * C;
    bf16_t win[CONV_K];
    float wv[CONV_K];
    if (slot >= 0 && has_ch) conv_window_load<CONV_K>(cst, cw, (int)ch, C, win, wv);
    state_t* st = state + ((long long)max(slot, 0) * Hv + hv) * DK * DV;
    float S[RW];
#pragma unroll
    for (int r = 0; r < RW; r++) S[r] = slot >= 0 ? state_ld(st + (long long)(w * RW + r) * DV + c) : 0.0f;
    const float nwc = !commit && w == 0 ? nw[c] : 0.0f;
    for (int i0 = 0; i0 < n; i0 += GDN_ROWS) {
        const int m = min(GDN_ROWS, n - i0);
        const long long t0 = r0 + i0;
        if (has_ch) {  // the conv of the rows, their inputs loaded ahead
            bf16_t xr[GDN_ROWS];
#pragma unroll
            for (int i = 0; i < GDN_ROWS; i++) xr[i] = slot >= 0 ? x[(t0 + min(i, m - 1)) * x_stride + ch] : (bf16_t)0;
            // The verify's trace: the rows as read (q / k channels by the key head's first value head).
            if (trace_x && slot >= 0 && (tid >= 2 * DK || hv % (Hv / Hk) == 0)) {
#pragma unroll
                for (int i = 0; i < GDN_ROWS; i++)
                    if (i < m) trace_x[(t0 + i - starts[0]) * x_stride + ch] = xr[i];
            }
#pragma unroll
            for (int i = 0; i < GDN_ROWS; i++) {
                if (i < m) {
                    bf16_t y = 0;
                    if (slot >= 0) {
                        y = conv_window_out<CONV_K>(xr[i], wv, win);
#pragma unroll
                        for (int r = 0; r < CONV_K - 1; r++) win[r] = win[r + 1];
                    }
                    ys[i][tid] = y;
                }
            }
        }
        if (tid < m) {
            const bf16_t bb = ba[(t0 + tid) * ba_stride + hv], aa = ba[(t0 + tid) * ba_stride + Hv + hv];
            if (trace_ba && slot >= 0) {
                trace_ba[(t0 + tid - starts[0]) * ba_stride + hv] = bb;
                trace_ba[(t0 + tid - starts[0]) * ba_stride + Hv + hv] = aa;
            }
            gdn_gate_values(bf2f(bb), bf2f(aa), A_log, dt_bias, hv, &bv[tid], &gv[tid]);
        }
        __syncthreads();
        for (int e = warp; e < 2 * m; e += blockDim.x / 32) {  // q (even) and k (odd) of row e / 2
            const int i = e >> 1;
            if (e & 1) {
                gdn_l2norm_row<DK>(&ys[i][DK], kn[i], 1.0f, lane);
            } else {
                gdn_l2norm_row<DK>(&ys[i][0], qn[i], rsqrtf((float)DK), lane);
            }
        }
        __syncthreads();
        for (int e = tid; e < m * DK; e += blockDim.x) {
            qs[e / DK][e % DK] = bf2f(qn[e / DK][e % DK]);
            ks[e / DK][e % DK] = bf2f(kn[e / DK][e % DK]);
        }
        __syncthreads();
        for (int i = 0; i < m; i++) {
            // A commit's rows: the previous row's reads of red are done (a verify's gated norm has a barrier).
            if (commit && i > 0) __syncthreads();
            float o = 0.0f;
            if (slot >= 0) o = bf2f(gdn_token(S, qs[i], ks[i], expf(gv[i]), bv[i], bf2f(ys[i][2 * DK + c]), w, c, red));
            if (!commit) {
                const float zv = w == 0 ? bf2f(z[(t0 + i) * z_tok_stride + (long long)hv * DV + c]) : 0.0f;
                gdn_gated_out(o, nwc, zv, warp, lane, gred, eps, out + ((t0 + i) * Hv + hv) * DV + c);
            }
        }
        __syncthreads();  // ys, qn, kn, qs, ks, gv, bv, red and gred are free for the next rows
    }
    if (commit && slot >= 0 && n > 0) {
#pragma unroll
        for (int r = 0; r < RW; r++) state_st(st + (long long)(w * RW + r) * DV + c, S[r]);
        if (has_ch && (tid >= 2 * DK || hv % (Hv / Hk) == 0)) {
#pragma unroll
            for (int r = 0; r < CONV_K - 1; r++) cst[(long long)r * C + ch] = win[r];
        }
    }
}

extern "C" __global__ void __launch_bounds__(4 * DV, 2)
gdn_rows(const bf16_t* x, long long x_stride, const bf16_t* __restrict__ cw, bf16_t* conv_state, const bf16_t* ba,
         long long ba_stride, const float* __restrict__ A_log, const float* __restrict__ dt_bias, state_t* state,
         const int* __restrict__ slots, const int* __restrict__ starts, const int* __restrict__ lens, const bf16_t* z,
         long long z_tok_stride, const float* __restrict__ nw, bf16_t* __restrict__ out, bf16_t* __restrict__ trace_x,
         bf16_t* __restrict__ trace_ba, int Hk, int Hv, float eps, int commit) {
    gdn_rows_body(x, x_stride, cw, conv_state, ba, ba_stride, A_log, dt_bias, state, slots, starts, lens, z,
                  z_tok_stride, nw, out, trace_x, trace_ba, Hk, Hv, eps, commit, blockIdx.x, blockIdx.y);
}

// The per-layer pointers of gdn_commit_layers, passed by value (GDN_LAYER_TABLE * 5 * 8 bytes of
// kernel parameters, within the 4 KB every architecture takes).
#define GDN_LAYER_TABLE 48
struct GdnLayerTable {
    const bf16_t* cw[GDN_LAYER_TABLE];
    bf16_t* conv_state[GDN_LAYER_TABLE];
    const float* a_log[GDN_LAYER_TABLE];
    const float* dt_bias[GDN_LAYER_TABLE];
    state_t* state[GDN_LAYER_TABLE];
};

// gdn_commit_layers: the commit of gdn_rows (commit != 0) for up to GDN_LAYER_TABLE DeltaNet layers in
// one launch, layer l = blockIdx.z: its rows x + l * x_layer and ba + l * ba_layer (the speculative
// trace's per-layer blocks), its weights and states from the table. Each layer's blocks compute exactly
// what its own gdn_rows commit would (bitwise). Launch: grid (B, Hv, layers), block 4 * DV.
// Tested by: tests/ops/ case "gdn_commit_layers" (bitwise vs gdn_rows per layer).
extern "C" __global__ void __launch_bounds__(4 * DV, 2)
gdn_commit_layers(const bf16_t* x, long long x_layer, long long x_stride, const bf16_t* ba, long long ba_layer,
                  long long ba_stride, GdnLayerTable lt, const int* __restrict__ slots, const int* __restrict__ starts,
                  const int* __restrict__ lens, int Hk, int Hv) {
    const int l = blockIdx.z;
    gdn_rows_body(x + l * x_layer, x_stride, lt.cw[l], lt.conv_state[l], ba + l * ba_layer, ba_stride, lt.a_log[l],
                  lt.dt_bias[l], lt.state[l], slots, starts, lens, nullptr, 0, nullptr, nullptr, nullptr, nullptr, Hk,
                  Hv, 0.0f, 1, blockIdx.x, blockIdx.y);
}
