// gdn_gate.cu — DeltaNet gates fused with the q/k L2 normalisation (arch doc §2.2 steps 5–7).
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
// Tested by: tests/ops.rs case "gdn_gate".

#ifndef DK
#define DK 128
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
        const bf16_t* src = row + (long long)r * DK;
        float v[DK / 32];
        float ss = 0.0f;
#pragma unroll
        for (int i = 0; i < DK / 32; i++) {
            v[i] = bf2f(src[lane + 32 * i]);
            ss += v[i] * v[i];
        }
        float inv = 1.0f / sqrtf(warp_sum(ss) + 1e-6f);
        bool is_q = r < Hk;
        if (is_q) inv *= qscale;
        bf16_t* dst = (is_q ? q_out + ((long long)t * Hk + r) * DK
                            : k_out + ((long long)t * Hk + (r - Hk)) * DK);
#pragma unroll
        for (int i = 0; i < DK / 32; i++) dst[lane + 32 * i] = f2bf(v[i] * inv);
    }
    for (int h = threadIdx.x; h < Hv; h += blockDim.x) {
        float bv = bf2f(b[(long long)t * b_stride + h]);
        float av = bf2f(a[(long long)t * a_stride + h]);
        beta[(long long)t * Hv + h] = sigmoidf_(bv);
        g[(long long)t * Hv + h] = -expf(A_log[h]) * softplusf_(av + dt_bias[h]);
    }
}
