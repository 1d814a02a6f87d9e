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

// qk_norm_rope: an attention layer's per-head q and k RMSNorm(1 + w) then partial RoPE, in place, and
// (nv = nk) the step's K rows as it leaves them and its V rows into the paged KV cache, in one launch.
// Row r = t*(nq + nk + nv) + h, one warp each: h < nq is q head h at q + t*q_tok + h*q_head (norm weight
// wq), h < nq + nk k head h - nq at k + t*k_tok + (h - nq)*k_head (weight wk), else v head h - nq - nk at
// v + t*v_tok + (h - nq - nk)*D. D = head_dim <= QKNR_MAX_D, R = rotary_dim.
//  - The norm and RoPE are bitwise rms_norm_1p's and rope_partial's: the same sum as rms_norm_1p's
//    256-thread block (lane l plays its threads l + 32j, j < 8, each summing elements l + 32j + 256k in
//    k order; the 8 warp sums combined as block_sum does), the normalised value rounded to bf16 before
//    the rotation, the same rotation arithmetic.
//  - Rotary positions: pos[t] (the row's KV index), or with rope_pos ([T, 3] i32 (t, h, w), a model that
//    runs images) Qwen3.5's interleaved M-RoPE: frequency j at stream h when j % 3 == 1 and j < 3*sec_h,
//    w when j % 3 == 2 and j < 3*sec_w, else t (crates/cpu/src/rope.rs apply_mrope); equal streams give
//    pos-based RoPE's values exactly.
//  - The KV write (nv > 0) is kv_quant.cu's kv_write_q, bit for bit (formats k_fmt / v_fmt: KVF_*;
//    its addressing; tokens with pos < 0, decode-graph padding, store nothing).
// What does not depend on the previous kernel is done before pdl_wait: the row's cache address (step
// inputs), its rotation's cos / sin and its norm weights; after it, the row's values load all at once.
// One warp per row, 8 rows per block (a 256-thread block per row spent most of a prefill step being
// scheduled: 115K blocks for 4,096 tokens). The rotation's loops stay rolled:
// unrolled, sinf / cosf's rarely taken large-argument paths made the kernel ~9K instructions and, with
// its code fetched once per layer, 2.7x slower (bench/results/decode-small-kernels-h200-2026-12-01.md).
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
    if (live && nv > 0 && h >= nq && p >= 0) {
        const int s = seq_of_token(cu_seqlens, B, t);
        const long long row = (long long)block_tables[(long long)s * max_blocks + p / page] * page + p % page;
        idx = row * nk + (h < nq + nk ? h - nq : h - nq - nk);
    }
    // The rotation of frequency j < R/2 (dims j and j + R/2) of a q or k head (a rolled loop: see above).
    const int half = R / 2;
    float* rc = rot_all[warp][0];
    float* rs = rot_all[warp][1];
    if (live && h < nq + nk) {
        for (int j = lane; j < half; j += 32) {
            // M-RoPE (rope_pos given): frequency j takes its position from the t, h or w stream.
            const int st = !rope_pos ? -1 : (j % 3 == 1 && j < 3 * sec_h) ? 1 : (j % 3 == 2 && j < 3 * sec_w) ? 2 : 0;
            const float pf = st < 0 ? (float)p : (float)rope_pos[3LL * t + st];
            const float inv_freq = 1.0f / powf(theta_base, (float)(2 * j) / (float)R);
            const float ang = pf * inv_freq;
            rc[j] = cosf(ang);
            rs[j] = sinf(ang);
        }
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
