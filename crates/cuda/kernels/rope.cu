// rope.cu — partial rotary position embedding, NeoX rotate-half layout.
//
// Computes, in place, for every token t, head h and i < R/2 (R = rotary_dim):
//   theta_i = pos[t] * (1 / theta_base^(2i/R))          (f32, like HF's inv_freq)
//   x'_i     = x_i cos - x_{i+R/2} sin ;  x'_{i+R/2} = x_{i+R/2} cos + x_i sin
// dims [R, head_dim) pass through. f32 math, accurate sinf/cosf (positions up to 1e6 rad).
// Shapes/dtypes: x [T, H, head_dim] bf16 (row stride `tok_stride`, head stride `head_stride`
//   elements: head_dim when contiguous, 2*head_dim on the q|gate layout); pos [T] i32.
// Launch: grid (T), block 128; threads loop over H * R/2 pairs. Arch: sm_80+.
// Tested by: tests/ops.rs case "rope".

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
        hx[i] = f2bf(a * c - b * s);
        hx[i + half] = f2bf(b * c + a * s);
    }
}
