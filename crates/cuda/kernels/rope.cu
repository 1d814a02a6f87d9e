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
// Tested by: tests/ops.rs case "rope".

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

// qk_norm_rope: an attention layer's per-head q and k RMSNorm(1 + w) then partial RoPE, in place, in
// one launch (was rms_norm_1p on q and on k, then rope_partial on each). Row r = t*(nq + nk) + h: h < nq
// is q head h at q + t*q_tok + h*q_head (norm weight wq), else k head h - nq at k + t*k_tok +
// (h - nq)*k_head (weight wk); D = head_dim <= QKNR_MAX_D, R = rotary_dim. Bitwise equal to the four
// separate kernels: the same sum as rms_norm_1p's 256-thread block (lane l plays its threads l + 32j,
// j < 8, each summing elements l + 32j + 256k in k order; the 8 warp sums combined as block_sum does),
// the normalised value rounded to bf16 before the rotation, the same rotation arithmetic. One warp per
// row, 8 rows per block (a 256-thread block per row spent most of a prefill step being scheduled:
// 115K blocks for 4,096 tokens).
// Launch: grid (ceil(T*(nq + nk)/8)), block 256. Tested by: tests/ops.rs case "qk_norm_rope".
#define QKNR_MAX_D 512
extern "C" __global__ void __launch_bounds__(256)
qk_norm_rope(bf16_t* q, long long q_tok, long long q_head, const bf16_t* __restrict__ wq, int nq, bf16_t* k,
             long long k_tok, long long k_head, const bf16_t* __restrict__ wk, const int nk,
             const int* __restrict__ pos, int T, int D, int R, float theta_base, float eps) {
    __shared__ float ys_all[8][QKNR_MAX_D];
    pdl_enter();  // launched programmatically on sm_90
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const long long r = (long long)blockIdx.x * 8 + warp;
    if (r >= (long long)T * (nq + nk)) return;
    const int t = (int)(r / (nq + nk)), h = (int)(r % (nq + nk));
    const bool isq = h < nq;
    bf16_t* row = isq ? q + (long long)t * q_tok + (long long)h * q_head
                      : k + (long long)t * k_tok + (long long)(h - nq) * k_head;
    const bf16_t* w = isq ? wq : wk;
    const float inv = rsqrtf(warp_as_block_sumsq<8>(row, D, lane) / (float)D + eps);
    float* ys = ys_all[warp];
    for (int i = lane; i < D; i += 32) ys[i] = round_bf(bf2f(row[i]) * inv * (1.0f + bf2f(w[i])));
    __syncwarp();
    const int half = R / 2;
    const float p = (float)pos[t];
    for (int i = lane; i < D; i += 32) {
        float v = ys[i];
        if (i < R) {
            const int j = i < half ? i : i - half;
            const float inv_freq = 1.0f / powf(theta_base, (float)(2 * j) / (float)R);
            const float ang = p * inv_freq;
            const float c = cosf(ang), s = sinf(ang);
            v = i < half ? rope_rot(ys[i], ys[i + half], c, -s) : rope_rot(ys[i], ys[i - half], c, s);
        }
        row[i] = f2bf(v);
    }
}
