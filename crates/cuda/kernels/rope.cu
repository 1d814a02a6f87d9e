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
// one launch (was rms_norm_1p on q and on k, then rope_partial on each). Per (token t, head h): h < nq
// is q head h at q + t*q_tok + h*q_head (norm weight wq), else k head h - nq at k + t*k_tok +
// (h - nq)*k_head (weight wk); D = head_dim <= QKNR_MAX_D, R = rotary_dim. Bitwise equal to the four
// separate kernels: the same block sum over 256 threads (rms_norm_1p's launch), the normalised
// value rounded to bf16 before the rotation, the same rotation arithmetic.
// Launch: grid (T, nq + nk), block 256. Tested by: tests/ops.rs case "qk_norm_rope".
#define QKNR_MAX_D 512
extern "C" __global__ void __launch_bounds__(256)
qk_norm_rope(bf16_t* q, long long q_tok, long long q_head, const bf16_t* __restrict__ wq, int nq, bf16_t* k,
             long long k_tok, long long k_head, const bf16_t* __restrict__ wk, const int* __restrict__ pos, int D,
             int R, float theta_base, float eps) {
    __shared__ float ys[QKNR_MAX_D];
    __shared__ float red[32];
    const int t = blockIdx.x, h = blockIdx.y;
    const bool isq = h < nq;
    bf16_t* row = isq ? q + (long long)t * q_tok + (long long)h * q_head
                      : k + (long long)t * k_tok + (long long)(h - nq) * k_head;
    const bf16_t* w = isq ? wq : wk;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < D; i += blockDim.x) {
        const float v = bf2f(row[i]);
        ss += v * v;
    }
    const float inv = rsqrtf(block_sum(ss, red) / (float)D + eps);
    for (int i = threadIdx.x; i < D; i += blockDim.x) ys[i] = round_bf(bf2f(row[i]) * inv * (1.0f + bf2f(w[i])));
    __syncthreads();
    const int half = R / 2;
    const float p = (float)pos[t];
    for (int i = threadIdx.x; i < D; i += blockDim.x) {
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
