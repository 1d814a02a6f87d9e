// elementwise.cu — gating activations.
//
// Computes (f32 math, bf16 in/out):
//  sigmoid_gate_mul: x[t, h*hd + d] = bf16(x[t, h*hd + d] * sigmoid(gate[t*g_tok + h*g_head + d]))
//                    (attention output gate; gate lives inside the q_proj output [T, H, 2*hd] at
//                    offset hd, so g_tok = 2*H*hd, g_head = 2*hd)
//  swiglu:           out[t, i] = bf16(silu(gate[t*g_stride + i]) * up[t*u_stride + i])
// Shapes/dtypes: x [T, H*hd] bf16 in place; out [T, I] bf16; strides in elements.
// Launch: grid (ceil(n/256)) over n = T*H*hd or T*I, block 256. Arch: sm_80+.
// Tested by: tests/ops.rs cases "sigmoid_gate_mul", "swiglu".

extern "C" __global__ void sigmoid_gate_mul(bf16_t* x, const bf16_t* __restrict__ gate, int T, int H,
                                            int hd, long long g_tok, long long g_head) {
    long long n = (long long)T * H * hd;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        long long t = i / ((long long)H * hd);
        int rem = (int)(i - t * H * hd);
        int h = rem / hd, d = rem % hd;
        float g = bf2f(gate[t * g_tok + (long long)h * g_head + d]);
        x[i] = f2bf(bf2f(x[i]) * sigmoidf_(g));
    }
}

extern "C" __global__ void swiglu(const bf16_t* __restrict__ gate, long long g_stride,
                                  const bf16_t* __restrict__ up, long long u_stride,
                                  bf16_t* __restrict__ out, int T, int I) {
    long long n = (long long)T * I;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        long long t = i / I;
        int c = (int)(i - t * I);
        float g = bf2f(gate[t * g_stride + c]);
        out[i] = f2bf(siluf_(g) * bf2f(up[t * u_stride + c]));
    }
}
