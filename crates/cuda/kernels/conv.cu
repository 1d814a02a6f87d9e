// conv.cu — causal depthwise conv1d over time + SiLU, with a carried state per sequence slot.
//
// Computes (f32 math, bf16 in/out), KW = CONV_K taps (-D CONV_K, 4 for Qwen3.5):
//   y[t, c] = silu( sum_{j<KW} w[c, j] * xpad[p - (KW-1) + j, c] )
// where p is t's position inside its sequence and xpad rows < 0 come from the sequence's state
//   state[slot, KW-1 + row, c]  (the previous call's last KW-1 inputs; zero it at sequence start).
//  conv_prefill:       varlen batch (cu_seqlens, slots); does NOT touch the state.
//  conv_state_update:  after conv_prefill, state[slot] = last KW-1 rows of (state ++ x_seq), where
//                      x_seq is the sequence's rows, or only its first lens[s] rows when lens is given
//                      (the accepted tokens of a speculative verify).
//  conv_state_save:    before conv_state_update, the state of snapshots taken inside sequences: save i
//                      (saves[3i .. 3i+2] = (s, r, d)) writes dst[d] = last KW-1 rows of (state[slots[s]]
//                      ++ the first r rows of sequence s); dst [snapshots, KW-1, C] like state.
//  conv_decode:        one token per sequence: reads the state, writes y, shifts the state.
// Decode rows whose slot is < 0 (decode-graph padding) touch no state and output 0.
// Shapes/dtypes: x [T, C] bf16 (token stride x_stride elements: the in_proj output may be wider);
//   w [C, KW] bf16; y [T, C] bf16 contiguous; state [slots, KW-1, C] bf16 (pre-activation inputs);
//   cu_seqlens [B+1] i32 (flattened token offsets); slots [B] i32.
// Launch: conv_prefill grid (ceil(C/128), ceil(T/16)), block 128 (one channel per thread, 16
//   tokens per block, the window sliding in registers); conv_state_update / conv_decode grid (ceil(C/128), B),
//   conv_state_save grid (ceil(C/128), saves), block 128.
// Arch: plain loads, sm_80+.
// Tested by: tests/ops/ cases "conv_prefill" (ragged batches, with carried state, snapshots inside) and
//   "conv_decode".

#ifndef CONV_K
#define CONV_K 4
#endif
#define CONV_TT 16

extern "C" __global__ void conv_prefill(const bf16_t* __restrict__ x, long long x_stride,
                                        const bf16_t* __restrict__ w, bf16_t* __restrict__ y,
                                        const bf16_t* __restrict__ state,
                                        const int* __restrict__ cu_seqlens,
                                        const int* __restrict__ slots, int B, int C, int T) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    float wk[CONV_K];
#pragma unroll
    for (int j = 0; j < CONV_K; j++) wk[j] = bf2f(w[(long long)c * CONV_K + j]);
    int t0 = blockIdx.y * CONV_TT;
    int t1 = min(t0 + CONV_TT, T);
    if (t0 >= t1) return;
    int s = seq_of_token(cu_seqlens, B, t0);
    // The window of token t (its sequence's inputs p - CONV_K + 1 .. p, the carried state before the
    // sequence's first input) slides along in registers: one new load per token; refilled at the
    // block's first token and at each sequence start.
    float win[CONV_K];
    int win_seq = -1;
    for (int t = t0; t < t1; t++) {
        while (t >= cu_seqlens[s + 1]) s++;
        const int start = cu_seqlens[s];
        const int p = t - start;
        if (s != win_seq) {
            const bf16_t* st = state + (long long)slots[s] * (CONV_K - 1) * C;
#pragma unroll
            for (int j = 0; j < CONV_K - 1; j++) {
                const int r = p - (CONV_K - 1) + j;
                win[j] = r >= 0 ? bf2f(x[(long long)(start + r) * x_stride + c])
                                : bf2f(st[(long long)(CONV_K - 1 + r) * C + c]);
            }
            win_seq = s;
        } else {
#pragma unroll
            for (int j = 0; j < CONV_K - 1; j++) win[j] = win[j + 1];
        }
        win[CONV_K - 1] = bf2f(x[(long long)t * x_stride + c]);
        float acc = 0.0f;
#pragma unroll
        for (int j = 0; j < CONV_K; j++) acc += wk[j] * win[j];
        y[(long long)t * C + c] = f2bf(siluf_(acc));
    }
}

// Channel c of the last KW-1 rows of (st ++ the `len` rows of x from row `start`) into nv: row r is row
// len + r of that concatenation.
__device__ __forceinline__ void conv_state_after(const bf16_t* x, long long x_stride, const bf16_t* st, int start,
                                                 int len, int c, int C, bf16_t (&nv)[CONV_K - 1]) {
#pragma unroll
    for (int r = 0; r < CONV_K - 1; r++) {
        int i = len + r;
        nv[r] = i < CONV_K - 1 ? st[(long long)i * C + c]
                               : x[(long long)(start + i - (CONV_K - 1)) * x_stride + c];
    }
}

extern "C" __global__ void conv_state_update(const bf16_t* __restrict__ x, long long x_stride,
                                             bf16_t* state, const int* __restrict__ cu_seqlens,
                                             const int* __restrict__ slots,
                                             const int* __restrict__ lens, int C) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    int s = blockIdx.y;
    if (c >= C || slots[s] < 0) return;
    int start = cu_seqlens[s], len = lens ? lens[s] : cu_seqlens[s + 1] - start;
    bf16_t* st = state + (long long)slots[s] * (CONV_K - 1) * C;
    bf16_t nv[CONV_K - 1];
    conv_state_after(x, x_stride, st, start, len, c, C, nv);
#pragma unroll
    for (int r = 0; r < CONV_K - 1; r++) st[(long long)r * C + c] = nv[r];
}

extern "C" __global__ void conv_state_save(const bf16_t* __restrict__ x, long long x_stride,
                                           const bf16_t* __restrict__ state, const int* __restrict__ cu_seqlens,
                                           const int* __restrict__ slots, const int* __restrict__ saves,
                                           bf16_t* __restrict__ dst, int C) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    const int* sv = saves + 3 * blockIdx.y;
    const int s = sv[0];
    if (c >= C || slots[s] < 0) return;
    bf16_t nv[CONV_K - 1];
    conv_state_after(x, x_stride, state + (long long)slots[s] * (CONV_K - 1) * C, cu_seqlens[s], sv[1], c, C, nv);
    bf16_t* out = dst + (long long)sv[2] * (CONV_K - 1) * C;
#pragma unroll
    for (int r = 0; r < CONV_K - 1; r++) out[(long long)r * C + c] = nv[r];
}

extern "C" __global__ void conv_decode(const bf16_t* __restrict__ x, long long x_stride,
                                       const bf16_t* __restrict__ w, bf16_t* __restrict__ y,
                                       bf16_t* state, const int* __restrict__ slots, int C) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    int b = blockIdx.y;
    if (c >= C) return;
    if (slots[b] < 0) {  // padding row of a decode graph: no state, zero output
        y[(long long)b * C + c] = 0;
        return;
    }
    bf16_t* st = state + (long long)slots[b] * (CONV_K - 1) * C;
    y[(long long)b * C + c] = conv_decode_step<CONV_K>(x[(long long)b * x_stride + c], w, st, c, C);
}
