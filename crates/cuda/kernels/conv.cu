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
//   tokens per block, the window sliding in registers; conv_prefill8, below, where rows allow 16-byte
//   vectors); conv_state_update / conv_decode grid (ceil(C/128), B),
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

// conv_prefill8: conv_prefill with 8 channels a thread (16-byte loads and stores; the 8 channels' taps are
// 8*KW consecutive values, KW 16-byte loads) over CONV_TT8 tokens, the same sums in the same order (bitwise
// conv_prefill's). A block whose tokens and windows lie inside one sequence (every tile of a long prompt but
// its first) loads the x rows of CONV_SUB tokens' windows before their arithmetic and runs unrolled; a tile
// that meets a sequence start looks up each token's sequence and takes the window rows before it from the
// state, a token at a time. (conv_prefill is issue-bound: a token's sequence lookup and its window's checks
// for every element; 40% of the copy rate at 4,096 tokens.)
// Launch: grid (ceil(C / 1024), ceil(T / CONV_TT8)), block 128; C % 8 == 0, x_stride % 8 == 0, x, w, y, state
// 16-byte aligned.
#define CONV_TT8 8
#ifndef CONV_SUB
#define CONV_SUB 4  // tokens a pass of the unrolled path loads rows for (a divisor of CONV_TT8; 4: 75 us a call
                    // at 4,096 tokens against 83 for 8, H100)
#endif
// One tap j of 8 channels: acc[e] += w[c + e, j] * x[e] for the row's 16-byte vector xv (conv_prefill's
// sum order, tap after tap).
__device__ __forceinline__ void conv8_tap(float (&acc)[8], const float (&wj)[8], uint4 xv) {
    float fv[8];
    bf16x8_f32(xv, fv);
#pragma unroll
    for (int e = 0; e < 8; e++) acc[e] += wj[e] * fv[e];
}
// y's 8 channels at p from their sums: bf16(silu(acc)).
__device__ __forceinline__ void conv8_store(bf16_t* p, const float (&acc)[8]) {
    u32 o[4];
#pragma unroll
    for (int e = 0; e < 4; e++) o[e] = pack_f2bf(siluf_(acc[2 * e]), siluf_(acc[2 * e + 1]));
    *(uint4*)p = make_uint4(o[0], o[1], o[2], o[3]);
}
extern "C" __global__ void __launch_bounds__(128)
conv_prefill8(const bf16_t* __restrict__ x, long long x_stride, const bf16_t* __restrict__ w, bf16_t* __restrict__ y,
              const bf16_t* __restrict__ state, const int* __restrict__ cu_seqlens, const int* __restrict__ slots,
              int B, int C, int T) {
    const int c = (blockIdx.x * blockDim.x + threadIdx.x) * 8;
    const int t0 = blockIdx.y * CONV_TT8;
    if (c >= C) return;
    const int n = min(CONV_TT8, T - t0);
    // wv[j][e] = w[c + e, j]: the 8 * CONV_K values from w + c * CONV_K, CONV_K 16-byte words.
    float wv[CONV_K][8];
#pragma unroll
    for (int q = 0; q < CONV_K; q++) {
        const uint4 v = *(const uint4*)(w + (long long)c * CONV_K + 8 * q);
        const u32 ww[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int h = 0; h < 8; h++) {
            const int idx = 8 * q + h;  // = e * CONV_K + j
            wv[idx % CONV_K][idx / CONV_K] = h & 1 ? hi_f(ww[h >> 1]) : lo_f(ww[h >> 1]);
        }
    }
    const int s0 = seq_of_token(cu_seqlens, B, t0);
    int start = cu_seqlens[s0], next = cu_seqlens[s0 + 1];
    if (t0 - (CONV_K - 1) >= start && t0 + n <= next) {
        // CONV_SUB tokens at a time: rows ts - (CONV_K - 1) .. ts + CONV_SUB - 1 (clamped into the step: rows
        // past T are never used).
        constexpr int R = CONV_SUB + CONV_K - 1;
#pragma unroll 1
        for (int ts = t0; ts < t0 + n; ts += CONV_SUB) {
            uint4 xr[R];
#pragma unroll
            for (int i = 0; i < R; i++)
                xr[i] = *(const uint4*)(x + (long long)min(ts - (CONV_K - 1) + i, T - 1) * x_stride + c);
#pragma unroll
            for (int i = 0; i < CONV_SUB; i++) {
                if (ts + i < t0 + n) {
                    float acc[8] = {};
#pragma unroll
                    for (int j = 0; j < CONV_K; j++) conv8_tap(acc, wv[j], xr[i + j]);
                    conv8_store(y + (long long)(ts + i) * C + c, acc);
                }
            }
        }
        return;
    }
    int s = s0;
#pragma unroll 1
    for (int i = 0; i < n; i++) {
        const int t = t0 + i;
        while (t >= next) {
            s++;
            start = next;
            next = cu_seqlens[s + 1];
        }
        float acc[8] = {};
#pragma unroll
        for (int j = 0; j < CONV_K; j++) {
            const int rel = t - start - (CONV_K - 1) + j;  // the window row's place in its sequence
            conv8_tap(acc, wv[j],
                      rel >= 0 ? *(const uint4*)(x + (long long)(start + rel) * x_stride + c)
                               : *(const uint4*)(state + ((long long)slots[s] * (CONV_K - 1) + CONV_K - 1 + rel) * C + c));
        }
        conv8_store(y + (long long)t * C + c, acc);
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
