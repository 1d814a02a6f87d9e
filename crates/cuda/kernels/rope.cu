// rope.cu — partial rotary position embedding, NeoX rotate-half layout.
//
// Computes, in place, for every token t, head h and i < R/2 (R = rotary_dim):
//   theta_i = pos[t] * (1 / theta_base^(2i/R))          (f32, like HF's inv_freq)
//   x'_i     = x_i cos - x_{i+R/2} sin ;  x'_{i+R/2} = x_{i+R/2} cos + x_i sin
// dims [R, head_dim) pass through. f32 math (products rounded before the sum), accurate sinf/cosf
// (positions up to 1e6 rad).
// Shapes/dtypes: x [T, H, head_dim] bf16 (row stride `tok_stride`, head stride `head_stride`
//   elements: head_dim when contiguous, 2*head_dim on the q|gate layout); pos [T] i32.
// Launch: grid (T), block 128; threads loop over H * R/2 pairs. Arch: sm_80+.
// Tested by: tests/ops/ case "rope".

// x*c + y*s with both products rounded (no FMA contraction), so that rope_partial and qk_norm_rope,
// compiled separately, round identically.
__device__ __forceinline__ float rope_rot(float x, float y, float c, float s) {
    return __fadd_rn(__fmul_rn(x, c), __fmul_rn(y, s));
}

extern "C" __global__ void rope_partial(bf16_t* x, long long tok_stride, const int* __restrict__ pos,
                                        int H, int head_dim, int R, float theta_base,
                                        long long head_stride) {
    int t = blockIdx.x;
    int half = R / 2;
    float p = (float)pos[t];
    bf16_t* row = x + (long long)t * tok_stride;
    for (int k = threadIdx.x; k < H * half; k += blockDim.x) {
        int h = k / half, i = k % half;
        float inv_freq = 1.0f / powf(theta_base, (float)(2 * i) / (float)R);
        float ang = p * inv_freq;
        float c = cosf(ang), s = sinf(ang);
        bf16_t* hx = row + (long long)h * head_stride;
        float a = bf2f(hx[i]), b = bf2f(hx[i + half]);
        hx[i] = f2bf(rope_rot(a, b, c, -s));
        hx[i + half] = f2bf(rope_rot(b, a, c, s));
    }
}

// The rotation (cos, sin) of frequency j < R/2 for token t at position p, or with rope_pos ([T, 3] i32
// (t, h, w), a model that runs images) Qwen3.5's interleaved M-RoPE: frequency j takes stream h when
// j % 3 == 1 and j < 3*sec_h, w when j % 3 == 2 and j < 3*sec_w, else t.
__device__ __forceinline__ void qknr_rotation(int j, int p, int t, const int* __restrict__ rope_pos, int R,
                                              float theta_base, int sec_h, int sec_w, float& c, float& s) {
    const int st = !rope_pos ? -1 : (j % 3 == 1 && j < 3 * sec_h) ? 1 : (j % 3 == 2 && j < 3 * sec_w) ? 2 : 0;
    const float pf = st < 0 ? (float)p : (float)rope_pos[3LL * t + st];
    const float inv_freq = 1.0f / powf(theta_base, (float)(2 * j) / (float)R);
    const float ang = pf * inv_freq;
    c = cosf(ang);
    s = sinf(ang);
}

// The paged cache's row (token slot) of token t at KV index p >= 0 (kv_write_q's addressing).
__device__ __forceinline__ long long qknr_cache_row(int t, int p, const int* __restrict__ block_tables,
                                                    int max_blocks, const int* __restrict__ cu_seqlens, int B,
                                                    int page) {
    const int s = seq_of_token(cu_seqlens, B, t);
    return (long long)block_tables[(long long)s * max_blocks + p / page] * page + p % page;
}

// qk_norm_rope: an attention layer's per-head q and k RMSNorm(1 + w) then partial RoPE, in place, and
// (nv = nk) the step's K rows as it leaves them and its V rows into the paged KV cache, in one launch.
// Row r = t*(nq + nk + nv) + h, one warp each: h < nq is q head h at q + t*q_tok + h*q_head (norm weight
// wq), h < nq + nk k head h - nq at k + t*k_tok + (h - nq)*k_head (weight wk), else v head h - nq - nk at
// v + t*v_tok + (h - nq - nk)*D. D = head_dim <= QKNR_MAX_D, R = rotary_dim.
//  - The norm and RoPE are bitwise rms_norm_1p's and rope_partial's: the same sum as rms_norm_1p's
//    256-thread block (lane l plays its threads l + 32j, j < 8, each summing elements l + 32j + 256k in
//    k order; the 8 warp sums combined as block_sum does), the normalised value rounded to bf16 before
//    the rotation, the same rotation arithmetic.
//  - Rotary positions: pos[t] (the row's KV index), or with rope_pos M-RoPE (qknr_rotation; crates/cpu/src/rope.rs
//    apply_mrope); equal streams give pos-based RoPE's values exactly.
//  - The KV write (nv > 0) is kv_quant.cu's kv_write_q, bit for bit (formats k_fmt / v_fmt: KVF_*;
//    its addressing; tokens with pos < 0, decode-graph padding, store nothing).
// What does not depend on the previous kernel is done before pdl_wait: the row's cache address (step
// inputs), its rotation's cos / sin and its norm weights; after it, the row's values load all at once.
// One warp per row, 8 rows per block (a 256-thread block per row spent most of a prefill step being
// scheduled: 115K blocks for 4,096 tokens). The rotation's loops stay rolled:
// unrolled, sinf / cosf's rarely taken large-argument paths made the kernel ~9K instructions and, with
// its code fetched once per layer, 2.7x slower (bench/results/decode-small-kernels-h200-2026-12-01.md).
// Head dims 64, 128 and 256 run qk_norm_rope_v<E> (below) where rows allow its vectors; this kernel the rest.
// Launch: grid (ceil(T*(nq + nk + nv)/8)), block 256. Tested by: tests/ops/ cases "qk_norm_rope"
// (vs rms_norm_1p + rope_partial), "qk_norm_rope_kv" (vs the same launch without KV + kv_write_q) and
// "qk_norm_rope_mrope" (M-RoPE vs rms_norm_1p + apply_mrope; equal streams bitwise the pos-based launch).
#define QKNR_MAX_D 512
extern "C" __global__ void __launch_bounds__(256)
qk_norm_rope(bf16_t* q, long long q_tok, long long q_head, const bf16_t* __restrict__ wq, int nq, bf16_t* k,
             long long k_tok, long long k_head, const bf16_t* __restrict__ wk, const int nk, const bf16_t* v,
             long long v_tok, int nv, const int* __restrict__ pos, int T, int D, int R, float theta_base, float eps,
             unsigned char* k_cache, unsigned short* k_scales, unsigned char* v_cache, unsigned short* v_scales,
             const int* __restrict__ block_tables, int max_blocks, const int* __restrict__ cu_seqlens, int B,
             int page, int k_fmt, int v_fmt, const int* __restrict__ rope_pos, int sec_h, int sec_w) {
    __shared__ float ys_all[8][QKNR_MAX_D];
    __shared__ float rot_all[8][2][QKNR_MAX_D / 2];  // cos, sin of the row's rotation frequencies
    __shared__ __align__(16) bf16_t kb_all[8][QKNR_MAX_D];  // a k row's final values (kq_row reads words)
    pdl_trigger();  // launched programmatically on sm_90: the attention kernel may launch
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const long long r = (long long)blockIdx.x * 8 + warp;
    const bool live = r < (long long)T * (nq + nk + nv);
    const int t = live ? (int)(r / (nq + nk + nv)) : 0, h = live ? (int)(r % (nq + nk + nv)) : 0;
    const int p = live ? pos[t] : -1;
    // The cache row of a k / v head (-1: none), from step inputs.
    long long idx = -1;
    if (live && nv > 0 && h >= nq && p >= 0)
        idx = qknr_cache_row(t, p, block_tables, max_blocks, cu_seqlens, B, page) * nk + (h < nq + nk ? h - nq : h - nq - nk);
    // The rotation of frequency j < R/2 (dims j and j + R/2) of a q or k head (a rolled loop: see above).
    const int half = R / 2;
    float* rc = rot_all[warp][0];
    float* rs = rot_all[warp][1];
    if (live && h < nq + nk) {
        for (int j = lane; j < half; j += 32) qknr_rotation(j, p, t, rope_pos, R, theta_base, sec_h, sec_w, rc[j], rs[j]);
    }
    // The row's norm weights at dims lane + 32m (weights: loaded before the wait).
    float wr[QKNR_MAX_D / 32];
#pragma unroll
    for (int m = 0; m < QKNR_MAX_D / 32; m++) {
        const int i = lane + 32 * m;
        wr[m] = live && h < nq + nk && i < D ? bf2f((h < nq ? wq : wk)[i]) : 0.0f;
    }
    pdl_wait();
    if (!live) return;
    const bf16_t* x = v + (long long)t * v_tok + (long long)(h - nq - nk) * D;  // a v head's row
    if (h < nq + nk) {
        const bool isq = h < nq;
        bf16_t* row = isq ? q + (long long)t * q_tok + (long long)h * q_head
                          : k + (long long)t * k_tok + (long long)(h - nq) * k_head;
        float* ys = ys_all[warp];
        bf16_t* kb = kb_all[warp];
        // The row's values at dims lane + 32m, all loads in flight at once.
        float xr[QKNR_MAX_D / 32];
#pragma unroll
        for (int m = 0; m < QKNR_MAX_D / 32; m++) {
            const int i = lane + 32 * m;
            xr[m] = i < D ? bf2f(row[i]) : 0.0f;
        }
        const float inv = rsqrtf(warp_as_block_sumsq<8>(xr, D, lane) / (float)D + eps);
#pragma unroll
        for (int m = 0; m < QKNR_MAX_D / 32; m++) {
            const int i = lane + 32 * m;
            if (i < D) ys[i] = round_bf(xr[m] * inv * (1.0f + wr[m]));
        }
        __syncwarp();
        for (int i = lane; i < D; i += 32) {
            float vv = ys[i];
            if (i < R) {
                const int j = i < half ? i : i - half;
                vv = i < half ? rope_rot(ys[i], ys[i + half], rc[j], -rs[j])
                              : rope_rot(ys[i], ys[i - half], rc[j], rs[j]);
            }
            row[i] = f2bf(vv);
            kb[i] = f2bf(vv);
        }
        if (isq) return;
        __syncwarp();  // the k row's bf16 values in kb
        x = kb;
    }
    if (idx < 0) return;
    const bool is_k = h < nq + nk;
    const int fmt = is_k ? k_fmt : v_fmt;
    kq_row(x, (is_k ? k_cache : v_cache) + idx * kq_row_bytes(fmt, D), (is_k ? k_scales : v_scales) + idx, D, fmt,
           lane);
}

// qk_norm_rope_v<E>: qk_norm_rope for head_dim D = 32 * E (E = 2, 4, 8) with R/2 a multiple of E, bitwise
// the same (same arguments). A lane holds E consecutive dims of a row (one 4-, 8- or 16-byte load):
//  - the norm's sum is warp_as_block_sumsq<8>'s: lane L holds dims E*L + r of the emulated block's warp
//    j = L / (32/E), whose butterfly offset o is a shuffle with lane L ^ (o/E) when o >= E and an add of
//    the lane's dims r and r ^ o below; the 8 warp sums' butterfly (warps >= D/32 add zeros) is offsets
//    E/2 .. 1 over j, lane L ^ (o * 32/E);
//  - RoPE's partner dims i +- R/2 are lane L +- R/(2E)'s, by one shuffle of the packed bf16 values.
// A block of 8 warps takes the rows of token blockIdx.x in gridDim.y pieces (warp w of piece y rows
// y*8 + w + 8*gridDim.y*k) and computes the token's rotation table and cache row once (before the wait:
// a step's first blocks do it while the previous kernel finishes); a long step runs one piece a token (a
// warp's rows loaded before the first is reduced), a short one a row a warp. Measured against
// qk_norm_rope (H100): 214 -> 76-83 us at 4,096 tokens, decode steps 0.6-0.7% faster
// (bench/results/prefill-conv-and-qk-norm-vectors-2026-12-07.md).
// Launch: grid (T, pieces), block 256; rows, strides and norm weights aligned to 2E bytes.
#define QKNV_ROWS 4  // a warp's rows in flight at once

template <int E>
__device__ __forceinline__ void bf16_ld(const bf16_t* p, u32 (&w)[E / 2]) {
    if constexpr (E == 8) {
        const uint4 v = *(const uint4*)p;
        w[0] = v.x, w[1] = v.y, w[2] = v.z, w[3] = v.w;
    } else if constexpr (E == 4) {
        const uint2 v = *(const uint2*)p;
        w[0] = v.x, w[1] = v.y;
    } else {
        w[0] = *(const u32*)p;
    }
}
template <int E>
__device__ __forceinline__ void bf16_st(bf16_t* p, const u32 (&w)[E / 2]) {
    if constexpr (E == 8) {
        *(uint4*)p = make_uint4(w[0], w[1], w[2], w[3]);
    } else if constexpr (E == 4) {
        *(uint2*)p = make_uint2(w[0], w[1]);
    } else {
        *(u32*)p = w[0];
    }
}

template <int E>
__device__ __forceinline__ void qknr_v(bf16_t* q, long long q_tok, long long q_head, const bf16_t* __restrict__ wq,
                                       int nq, bf16_t* k, long long k_tok, long long k_head,
                                       const bf16_t* __restrict__ wk, const int nk, const bf16_t* v, long long v_tok,
                                       int nv, const int* __restrict__ pos, int R, float theta_base, float eps,
                                       unsigned char* k_cache, unsigned short* k_scales, unsigned char* v_cache,
                                       unsigned short* v_scales, const int* __restrict__ block_tables, int max_blocks,
                                       const int* __restrict__ cu_seqlens, int B, int page, int k_fmt, int v_fmt,
                                       const int* __restrict__ rope_pos, int sec_h, int sec_w) {
    constexpr int D = 32 * E, W = E / 2;
    __shared__ float rc[D / 2], rs[D / 2];             // cos, sin of the token's rotation frequencies
    __shared__ __align__(16) bf16_t kb_all[8][D];      // a k / v row's final values (kq_row reads words)
    pdl_trigger();  // launched programmatically on sm_90: the attention kernel may launch
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int t = blockIdx.x, rows = nq + nk + nv, half = R / 2;
    const int p = pos[t];
    // Step inputs and weights before the wait: the rotation table, the cache row, the norm weights.
    for (int j = threadIdx.x; j < half; j += blockDim.x)
        qknr_rotation(j, p, t, rope_pos, R, theta_base, sec_h, sec_w, rc[j], rs[j]);
    const long long crow = nv > 0 && p >= 0 ? qknr_cache_row(t, p, block_tables, max_blocks, cu_seqlens, B, page) : -1;
    u32 wqw[W], wkw[W];
    bf16_ld<E>(wq + E * lane, wqw);
    bf16_ld<E>(wk + E * lane, wkw);
    __syncthreads();
    pdl_wait();
    const int step = 8 * gridDim.y;
    // The lane's rotation: its dims' frequencies j0 .. j0 + E - 1 and their partner lane (lanes past R keep
    // their dims).
    const int i0 = E * lane;
    const bool rot = i0 < R, lo_half = i0 < half;
    const int j0 = lo_half ? i0 : i0 - half;
    const int partner = !rot ? lane : lo_half ? lane + half / E : lane - half / E;
    bf16_t* kb = kb_all[warp];
    // Row h < nq + nk of the token: a q or k head, normalised and rotated in place.
    auto qk_row = [&](int h) { return h < nq ? q + t * q_tok + h * q_head : k + t * k_tok + (h - nq) * k_head; };
    for (int h0 = blockIdx.y * 8 + warp; h0 < rows; h0 += QKNV_ROWS * step) {
        u32 xw[QKNV_ROWS][W];
#pragma unroll
        for (int m = 0; m < QKNV_ROWS; m++) {
            const int h = h0 + m * step;
            const bf16_t* src = h < nq + nk ? qk_row(h) : v + t * v_tok + (long long)(h - nq - nk) * D;
            if (h < rows) bf16_ld<E>(src + i0, xw[m]);
        }
        // Rolled (the code stays small: a short step runs it once a layer): row m is always in xw[0], the
        // rows after it shift down a place at the end of each pass.
#pragma unroll 1
        for (int m = 0; m < QKNV_ROWS; m++) {
            const int h = h0 + m * step;
            if (h >= rows) break;
            u32 ow[W];
            if (h < nq + nk) {
                const bool isq = h < nq;
                float x[E], ss[E];
#pragma unroll
                for (int c = 0; c < W; c++) x[2 * c] = lo_f(xw[0][c]), x[2 * c + 1] = hi_f(xw[0][c]);
#pragma unroll
                for (int r = 0; r < E; r++) ss[r] = x[r] * x[r];
#pragma unroll
                for (int o = 16; o > 0; o >>= 1) {
                    if (o >= E) {
#pragma unroll
                        for (int r = 0; r < E; r++) ss[r] += __shfl_xor_sync(0xffffffffu, ss[r], o / E);
                    } else {
                        float u[E];
#pragma unroll
                        for (int r = 0; r < E; r++) u[r] = ss[r] + ss[r ^ o];
#pragma unroll
                        for (int r = 0; r < E; r++) ss[r] = u[r];
                    }
                }
                float tot = ss[0];
#pragma unroll
                for (int o = E / 2; o > 0; o >>= 1) tot += __shfl_xor_sync(0xffffffffu, tot, o * (32 / E));
                const float inv = rsqrtf(tot / (float)D + eps);
                float y[E];
                u32 yw[W], pw[W];
#pragma unroll
                for (int c = 0; c < W; c++) {
                    const u32 w = isq ? wqw[c] : wkw[c];
                    y[2 * c] = round_bf(x[2 * c] * inv * (1.0f + lo_f(w)));
                    y[2 * c + 1] = round_bf(x[2 * c + 1] * inv * (1.0f + hi_f(w)));
                    yw[c] = pack_f2bf(y[2 * c], y[2 * c + 1]);
                }
#pragma unroll
                for (int c = 0; c < W; c++) pw[c] = __shfl_sync(0xffffffffu, yw[c], partner);
                if (rot) {
                    float o2[E];
#pragma unroll
                    for (int c = 0; c < W; c++) {
                        const float p0 = lo_f(pw[c]), p1 = hi_f(pw[c]);
                        const int j = j0 + 2 * c;
                        o2[2 * c] = lo_half ? rope_rot(y[2 * c], p0, rc[j], -rs[j]) : rope_rot(y[2 * c], p0, rc[j], rs[j]);
                        o2[2 * c + 1] = lo_half ? rope_rot(y[2 * c + 1], p1, rc[j + 1], -rs[j + 1])
                                                : rope_rot(y[2 * c + 1], p1, rc[j + 1], rs[j + 1]);
                    }
#pragma unroll
                    for (int c = 0; c < W; c++) ow[c] = pack_f2bf(o2[2 * c], o2[2 * c + 1]);
                } else {
#pragma unroll
                    for (int c = 0; c < W; c++) ow[c] = yw[c];
                }
                bf16_st<E>(qk_row(h) + i0, ow);
            } else {
#pragma unroll
                for (int c = 0; c < W; c++) ow[c] = xw[0][c];
            }
            if (h >= nq && crow >= 0) {
                // The KV write: the row's final values through shared memory into kq_row.
                const bool is_k = h < nq + nk;
                const int fmt = is_k ? k_fmt : v_fmt;
                const long long idx = crow * nk + (is_k ? h - nq : h - nq - nk);
                bf16_st<E>(kb + i0, ow);
                __syncwarp();
                kq_row(kb, (is_k ? k_cache : v_cache) + idx * kq_row_bytes(fmt, D), (is_k ? k_scales : v_scales) + idx,
                       D, fmt, lane);
                __syncwarp();
            }
#pragma unroll
            for (int n = 0; n + 1 < QKNV_ROWS; n++)
#pragma unroll
                for (int c = 0; c < W; c++) xw[n][c] = xw[n + 1][c];
        }
    }
}

#define QKNR_V(E)                                                                                                   \
    extern "C" __global__ void __launch_bounds__(256) qk_norm_rope_v##E(                                            \
        bf16_t* q, long long q_tok, long long q_head, const bf16_t* __restrict__ wq, int nq, bf16_t* k,              \
        long long k_tok, long long k_head, const bf16_t* __restrict__ wk, const int nk, const bf16_t* v,             \
        long long v_tok, int nv, const int* __restrict__ pos, int T, int D, int R, float theta_base, float eps,      \
        unsigned char* k_cache, unsigned short* k_scales, unsigned char* v_cache, unsigned short* v_scales,          \
        const int* __restrict__ block_tables, int max_blocks, const int* __restrict__ cu_seqlens, int B, int page,   \
        int k_fmt, int v_fmt, const int* __restrict__ rope_pos, int sec_h, int sec_w) {                              \
        qknr_v<E>(q, q_tok, q_head, wq, nq, k, k_tok, k_head, wk, nk, v, v_tok, nv, pos, R, theta_base, eps, k_cache, \
                  k_scales, v_cache, v_scales, block_tables, max_blocks, cu_seqlens, B, page, k_fmt, v_fmt, rope_pos, \
                  sec_h, sec_w);                                                                                    \
    }
QKNR_V(2)
QKNR_V(4)
QKNR_V(8)
