// gdn_gate.cu — DeltaNet gates fused with the q/k L2 normalisation (docs/architecture.md §2.2 steps 5–7).
//
// Computes, per token t (f32 math):
//   q_out[t, h, :] = bf16( q[t,h,:] / sqrt(sum q^2 + 1e-6) * DK^-0.5 )     h < Hk
//   k_out[t, h, :] = bf16( k[t,h,:] / sqrt(sum k^2 + 1e-6) )
//   beta[t, v]     = sigmoid(b[t, v])                                       v < Hv  (f32)
//   g[t, v]        = -exp(A_log[v]) * softplus(a[t, v] + dt_bias[v])        (f32, <= 0)
// Shapes/dtypes: qk: the conv output [T, conv_dim] bf16 with q at column 0 and k at column
//   Hk*DK (token stride qk_stride); b, a [T, Hv] bf16 with token strides b_stride/a_stride;
//   A_log, dt_bias [Hv] f32; q_out, k_out [T, Hk, DK] bf16; g, beta [T, Hv] f32.
// Launch: grid (T), block 256 (8 warps; warp w normalises rows w, w+8, ... of the 2*Hk q/k rows;
//   lanes own DK/32 elements each). -D DK (head_k_dim; multiple of 32, <= 256).
// Arch: shuffles only, sm_80+.
// Tested by: tests/ops/ case "gdn_gate".

#ifndef DK
#define DK 128
#endif

#ifndef CONV_K
#define CONV_K 4
#endif

extern "C" __global__ void gdn_gate(const bf16_t* __restrict__ qk, long long qk_stride,
                                    const bf16_t* __restrict__ b, long long b_stride,
                                    const bf16_t* __restrict__ a, long long a_stride,
                                    const float* __restrict__ A_log, const float* __restrict__ dt_bias,
                                    bf16_t* __restrict__ q_out, bf16_t* __restrict__ k_out,
                                    float* __restrict__ g, float* __restrict__ beta, int Hk, int Hv) {
    int t = blockIdx.x;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const bf16_t* row = qk + (long long)t * qk_stride;
    const float qscale = rsqrtf((float)DK);
    for (int r = warp; r < 2 * Hk; r += nw) {
        // rows 0..Hk are q heads, Hk..2Hk are k heads; in the conv output they are contiguous.
        const bool is_q = r < Hk;
        bf16_t* dst = (is_q ? q_out + ((long long)t * Hk + r) * DK
                            : k_out + ((long long)t * Hk + (r - Hk)) * DK);
        gdn_l2norm_row<DK>(row + (long long)r * DK, dst, is_q ? qscale : 1.0f, lane);
    }
    for (int h = threadIdx.x; h < Hv; h += blockDim.x)
        gdn_gate_values(bf2f(b[(long long)t * b_stride + h]), bf2f(a[(long long)t * a_stride + h]), A_log, dt_bias, h,
                        &beta[(long long)t * Hv + h], &g[(long long)t * Hv + h]);
}

// gdn_conv_gate_decode: decode rows (one token per sequence b): conv_decode (conv.cu) and gdn_gate in
// one launch, bitwise the same. Block (b, j < C/DK) convolves channels j*DK .. j*DK + DK - 1 (one q, k
// or v head: the conv channels are q | k | v heads of DK = DV columns), writes y and shifts its state
// rows; a q or k block then normalises its head from the bf16 outputs (warp 0, as gdn_gate); block
// (b, C/DK) writes row b's beta and g. Padding rows (slot < 0): y = 0, no state, q/k from zeros.
// x [B, *] bf16 (token stride x_stride), w [C, CONV_K], y [B, C], state [slots, CONV_K-1, C] bf16;
// q_out, k_out [B, Hk, DK]; b, a [B, Hv] (strides b_stride, a_stride); g, beta [B, Hv] f32.
// Launch: grid (B, C/DK + 1), block DK (C % DK == 0, DV == DK). Tested by: tests/ops/ case
// "gdn_conv_gate_decode" (bitwise vs conv_decode + gdn_gate).
extern "C" __global__ void gdn_conv_gate_decode(const bf16_t* x, long long x_stride, const bf16_t* __restrict__ w,
                                                bf16_t* __restrict__ y, bf16_t* state, const int* __restrict__ slots,
                                                int C, const bf16_t* b, long long b_stride, const bf16_t* a,
                                                long long a_stride,
                                                const float* __restrict__ A_log, const float* __restrict__ dt_bias,
                                                bf16_t* __restrict__ q_out, bf16_t* __restrict__ k_out,
                                                float* __restrict__ g, float* __restrict__ beta, int Hk, int Hv) {
    __shared__ bf16_t ys[DK];
    // Launched programmatically on sm_90: the conv state rows and taps load before the wait for the
    // in-projection (no earlier kernel of the step writes them; the slot ids are a step input).
    pdl_trigger();
    const int row = blockIdx.x, j = blockIdx.y, tid = threadIdx.x;
    const int c = j * DK + tid;
    const int slot = slots[row];
    bf16_t* st = state + (long long)max(slot, 0) * (CONV_K - 1) * C;
    bf16_t win[CONV_K];
    float wv[CONV_K];
    if (j < C / DK && slot >= 0) conv_window_load<CONV_K>(st, w, c, C, win, wv);
    pdl_wait();
    if (j == C / DK) {
        for (int h = tid; h < Hv; h += blockDim.x)
            gdn_gate_values(bf2f(b[(long long)row * b_stride + h]), bf2f(a[(long long)row * a_stride + h]), A_log,
                            dt_bias, h, &beta[(long long)row * Hv + h], &g[(long long)row * Hv + h]);
        return;
    }
    bf16_t out = 0;
    if (slot >= 0) {
        out = conv_window_out<CONV_K>(x[(long long)row * x_stride + c], wv, win);
        conv_state_shift<CONV_K>(st, c, C, win);
    }
    y[(long long)row * C + c] = out;
    if (j >= 2 * Hk) return;  // a v head: nothing to normalise (uniform over the block)
    ys[tid] = out;
    __syncthreads();
    if (tid < 32) {
        const bool is_q = j < Hk;
        bf16_t* dst = is_q ? q_out + ((long long)row * Hk + j) * DK : k_out + ((long long)row * Hk + (j - Hk)) * DK;
        gdn_l2norm_row<DK>(ys, dst, is_q ? rsqrtf((float)DK) : 1.0f, tid);
    }
}

// gdn_conv_gate_rows: the rows of speculative verify chunks (and of their commit): conv_prefill (conv.cu)
// and gdn_gate in one launch, bitwise the same; the conv state is read, never written. Block
// (s, j < C/DK) convolves channels j*DK .. j*DK + DK - 1 of sequence s's rows cu_seqlens[s] ..
// cu_seqlens[s + 1] - 1 in order, its window sliding in registers from the state of slots[s]; a q or k
// block normalises its head's row after each row (warp 0, as gdn_gate); block (s, C/DK) writes the
// rows' beta and g. A sequence of slot < 0: y = 0, q/k from zeros.
// x [T, *] bf16 (token stride x_stride), w [C, CONV_K], y [T, C], state [slots, CONV_K-1, C] bf16;
// q_out, k_out [T, Hk, DK]; b, a [T, Hv] (strides b_stride, a_stride); g, beta [T, Hv] f32.
// Launch: grid (n_seqs, C/DK + 1), block DK (C % DK == 0, DV == DK). Tested by: tests/ops/ case
// "gdn_conv_gate_rows" (bitwise vs conv_prefill + gdn_gate).
extern "C" __global__ void gdn_conv_gate_rows(const bf16_t* x, long long x_stride, const bf16_t* __restrict__ w,
                                              bf16_t* __restrict__ y, const bf16_t* state,
                                              const int* __restrict__ cu_seqlens, const int* __restrict__ slots,
                                              int C, const bf16_t* b, long long b_stride, const bf16_t* a,
                                              long long a_stride, const float* __restrict__ A_log,
                                              const float* __restrict__ dt_bias, bf16_t* __restrict__ q_out,
                                              bf16_t* __restrict__ k_out, float* __restrict__ g,
                                              float* __restrict__ beta, int Hk, int Hv) {
    __shared__ bf16_t ys[GDN_ROWS][DK];
    const int seq = blockIdx.x, j = blockIdx.y, tid = threadIdx.x;
    const int r0 = cu_seqlens[seq], r1 = cu_seqlens[seq + 1];
    if (j == C / DK) {
        for (int row = r0; row < r1; ++row)
            for (int h = tid; h < Hv; h += blockDim.x)
                gdn_gate_values(bf2f(b[(long long)row * b_stride + h]), bf2f(a[(long long)row * a_stride + h]), A_log,
                                dt_bias, h, &beta[(long long)row * Hv + h], &g[(long long)row * Hv + h]);
        return;
    }
    const int c = j * DK + tid;
    const int slot = slots[seq];
    bf16_t win[CONV_K];
    float wv[CONV_K];
    if (slot >= 0) conv_window_load<CONV_K>(state + (long long)slot * (CONV_K - 1) * C, w, c, C, win, wv);
    const bool is_q = j < Hk;
    // GDN_ROWS rows at a time: their x loaded ahead, convolved in order, then each q / k row normalised
    // by its own warp.
    for (int t0 = r0; t0 < r1; t0 += GDN_ROWS) {
        const int m = min(GDN_ROWS, r1 - t0);
        bf16_t xr[GDN_ROWS];
#pragma unroll
        for (int i = 0; i < GDN_ROWS; i++) xr[i] = slot >= 0 ? x[(long long)(t0 + min(i, m - 1)) * x_stride + c] : (bf16_t)0;
#pragma unroll
        for (int i = 0; i < GDN_ROWS; i++) {
            if (i < m) {
                bf16_t out = 0;
                if (slot >= 0) {
                    out = conv_window_out<CONV_K>(xr[i], wv, win);
#pragma unroll
                    for (int r = 0; r < CONV_K - 1; r++) win[r] = win[r + 1];
                }
                y[(long long)(t0 + i) * C + c] = out;
                ys[i][tid] = out;
            }
        }
        if (j >= 2 * Hk) continue;  // a v head: nothing to normalise (uniform over the block)
        __syncthreads();
        for (int i = tid >> 5; i < m; i += DK / 32) {
            const long long row = t0 + i;
            bf16_t* dst = is_q ? q_out + (row * Hk + j) * DK : k_out + (row * Hk + (j - Hk)) * DK;
            gdn_l2norm_row<DK>(ys[i], dst, is_q ? rsqrtf((float)DK) : 1.0f, tid & 31);
        }
        __syncthreads();  // ys is free for the next rows
    }
}
