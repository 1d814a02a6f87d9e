// vision.cu — the vision tower of Qwen3.5/3.6 on one image (crates/cpu/src/vision.rs is the reference):
// the residual stream is f32, GEMM inputs bf16, GEMM outputs f32 (cuBLASLt, no bias: the bias is added
// here, before anything else touches the value, as the reference's linear_bias does).
//
// A patch row r of an image of grid (t, gh, gw) sits in frame r / (gh*gw); inside a frame the patches come
// window by window (merge x merge windows in raster order, raster order inside a window), so row i of a
// frame is at (row, col) = (br*merge + ir, bc*merge + ic) with window w = i / merge², br = w / (gw/merge),
// bc = w % (gw/merge), ir = (i % merge²) / merge, ic = i % merge (patch_positions).
//
//  vision_embed_pos:  x[r] += bias + Σ taps table[k] * weight   (align-corners bilinear resampling of the
//                     side x side table to gh x gw; HF's f32 arithmetic, taps in the reference's order)
//  vision_layer_norm: out[r] = bf16((x[r] - mean) * rsqrt(var + eps) * w + b)     (x f32, two passes)
//  vision_qkv_rope:   qkv[r] = bf16(y[r] + bias); q and k heads rotated by the 2-D axial rotary: pair j of
//                     hd/2 pairs (dims j, j + hd/2) at angle row * inv[j] for j < hd/4, col * inv[j - hd/4]
//                     after, inv[i] = 1 / theta^(2i / (hd/2))
//  vision_attention:  o = softmax(q kᵀ / sqrt(hd)) v per head, each query over the keys of its frame
//                     (non-causal), flash style: 64-key tiles in shared memory, online f32 softmax
//  vision_residual:   x += y + bias                                    (x, y f32 [n, D])
//  vision_bias_act:   out = bf16(act(y + bias))   act: 0 gelu tanh, 1 gelu (erf), 2 silu, 3 none
// Shapes/dtypes: x, y f32 [n, D]; qkv bf16 [n, 3D] (q | k | v, head h at h*hd); o bf16 [n, D]; weights,
// biases, the table bf16. hd ≤ VIS_MAX_HD and even (the tower's is 72, a multiple of 4 by its config).
// Launch: embed_pos, layer_norm, qkv_rope: grid (n), block 256; attention: grid (frames * ceil(L / 32),
// heads), block 128; residual, bias_act: grid (ceil(n*D / 256)), block 256. Arch: plain f32 math, sm_80+.
// Tested by: tests/ops/ cases "vision_*" (against the CPU reference's functions).

#define VIS_MAX_HD 128
#define VIS_QT 32   // queries per attention block (4 threads each)
#define VIS_KT 64   // keys per shared-memory tile
#define VIS_NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ void vis_patch_pos(int r, int gh, int gw, int merge, int& row, int& col) {
    const int frame = gh * gw;
    const int i = r % frame;
    const int mm = merge * merge;
    const int w = i / mm, in = i % mm;
    const int wpr = gw / merge;
    row = (w / wpr) * merge + in / merge;
    col = (w % wpr) * merge + in % merge;
}

// The two table rows and weights resampling index i of an axis of `size` onto `side` (interpolation_taps).
__device__ __forceinline__ void vis_taps(int i, int size, int side, int (&idx)[2], float (&wt)[2]) {
    const float src = (float)i * (float)(side - 1) / (float)(max(size, 2) - 1);
    const float fl = floorf(src);
    for (int o = 0; o < 2; o++) {
        idx[o] = min((int)fl + o, side - 1);
        wt[o] = fmaxf(1.0f - fabsf(src - fl - (float)o), 0.0f);
    }
}

extern "C" __global__ void vision_embed_pos(float* x, const bf16_t* __restrict__ bias, const bf16_t* __restrict__ table,
                                            int D, int gh, int gw, int merge, int side) {
    const int r = blockIdx.x;
    int row, col;
    vis_patch_pos(r, gh, gw, merge, row, col);
    int ri[2], ci[2];
    float rw[2], cw[2];
    vis_taps(row, gh, side, ri, rw);
    vis_taps(col, gw, side, ci, cw);
    float* xr = x + (long long)r * D;
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float pos = 0.0f;
        for (int a = 0; a < 2; a++)
            for (int b = 0; b < 2; b++) {
                const long long k = (long long)ri[a] * side + ci[b];
                pos += bf2f(table[k * D + d]) * (rw[a] * cw[b]);
            }
        const float v = xr[d] + (bias ? bf2f(bias[d]) : 0.0f);
        xr[d] = v + pos;
    }
}

extern "C" __global__ void vision_layer_norm(const float* __restrict__ x, const bf16_t* __restrict__ w,
                                             const bf16_t* __restrict__ b, bf16_t* __restrict__ out, int D,
                                             float eps) {
    __shared__ float red[32];
    const float* xr = x + (long long)blockIdx.x * D;
    float s = 0.0f;
    for (int d = threadIdx.x; d < D; d += blockDim.x) s += xr[d];
    const float mean = block_sum(s, red) / (float)D;
    float v = 0.0f;
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        const float c = xr[d] - mean;
        v += c * c;
    }
    const float var = block_sum(v, red) / (float)D;
    const float inv = 1.0f / sqrtf(var + eps);
    bf16_t* o = out + (long long)blockIdx.x * D;
    for (int d = threadIdx.x; d < D; d += blockDim.x) o[d] = f2bf((xr[d] - mean) * inv * bf2f(w[d]) + bf2f(b[d]));
}

// a*c - b*s and b*c + a*s with the products rounded before the sum (the reference's order, no FMA).
__device__ __forceinline__ float vis_rot(float x, float y, float c, float s) {
    return __fadd_rn(__fmul_rn(x, c), __fmul_rn(y, s));
}

extern "C" __global__ void vision_qkv_rope(const float* __restrict__ y, const bf16_t* __restrict__ bias,
                                           bf16_t* __restrict__ qkv, int heads, int hd, int gh, int gw, int merge,
                                           float theta) {
    const int r = blockIdx.x;
    const int D = heads * hd, half = hd / 2, quarter = hd / 4;
    int row, col;
    vis_patch_pos(r, gh, gw, merge, row, col);
    const float* yr = y + (long long)r * 3 * D;
    bf16_t* out = qkv + (long long)r * 3 * D;
    // q and k: one thread per rotated pair (2 * heads * half of them).
    for (int k = threadIdx.x; k < 2 * heads * half; k += blockDim.x) {
        const int hh = k / half, j = k % half;  // hh < heads: q head, else k head hh - heads
        const int base = hh * hd;               // q | k are contiguous: k head h at D + h*hd
        const int fi = j < quarter ? j : j - quarter;
        const float inv_freq = 1.0f / powf(theta, (float)(2 * fi) / (float)half);
        const float ang = (float)(j < quarter ? row : col) * inv_freq;
        const float c = cosf(ang), s = sinf(ang);
        const float a = yr[base + j] + (bias ? bf2f(bias[base + j]) : 0.0f);
        const float b = yr[base + j + half] + (bias ? bf2f(bias[base + j + half]) : 0.0f);
        out[base + j] = f2bf(vis_rot(a, b, c, -s));
        out[base + j + half] = f2bf(vis_rot(b, a, c, s));
    }
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        const int i = 2 * D + d;
        out[i] = f2bf(yr[i] + (bias ? bf2f(bias[i]) : 0.0f));
    }
}

// Non-causal attention within frames of L patches. Block (frame tile, head): VIS_QT queries, 4 threads
// each (thread s of a query holds dims s, s + 4, ...), over 64-key tiles of the frame in shared memory.
extern "C" __global__ void __launch_bounds__(128)
vision_attention(const bf16_t* __restrict__ qkv, bf16_t* __restrict__ o, int n, int heads, int hd, int L,
                 float scale) {
    __shared__ __align__(16) bf16_t ks[VIS_KT][VIS_MAX_HD];
    __shared__ __align__(16) bf16_t vs[VIS_KT][VIS_MAX_HD];
    const int D = heads * hd;
    const long long stride = 3LL * D;
    const int tiles = (L + VIS_QT - 1) / VIS_QT;
    const int frame = blockIdx.x / tiles, tile = blockIdx.x % tiles;
    const int h = blockIdx.y;
    const int k0 = frame * L, k1 = min(k0 + L, n);
    const int qi = tile * VIS_QT + threadIdx.x / 4, sub = threadIdx.x & 3;
    const int qr = k0 + qi;
    const bool live = qi < L && qr < n;
    constexpr int M = VIS_MAX_HD / 4;
    float q[M], acc[M];
#pragma unroll
    for (int m = 0; m < M; m++) {
        const int d = sub + 4 * m;
        q[m] = live && d < hd ? bf2f(qkv[qr * stride + h * hd + d]) * scale : 0.0f;
        acc[m] = 0.0f;
    }
    float mx = VIS_NEG_INF, l = 0.0f;
    const int words = hd / 2;  // u32 pairs of a head row
    for (int kb = k0; kb < k1; kb += VIS_KT) {
        const int nk = min(VIS_KT, k1 - kb);
        __syncthreads();
        for (int e = threadIdx.x; e < nk * words; e += blockDim.x) {
            const int j = e / words, wd = e % words;
            const long long at = (long long)(kb + j) * stride + h * hd + 2 * wd;
            ((u32*)ks[j])[wd] = *(const u32*)(qkv + at + D);
            ((u32*)vs[j])[wd] = *(const u32*)(qkv + at + 2 * D);
        }
        __syncthreads();
        for (int j0 = 0; j0 < nk; j0 += 16) {
            float sc[16];
            float cmax = VIS_NEG_INF;
#pragma unroll
            for (int jj = 0; jj < 16; jj++) {
                float dot = 0.0f;
                if (j0 + jj < nk) {
#pragma unroll
                    for (int m = 0; m < M; m++) {
                        const int d = sub + 4 * m;
                        if (d < hd) dot += q[m] * bf2f(ks[j0 + jj][d]);
                    }
                }
                dot += __shfl_xor_sync(0xffffffffu, dot, 1);
                dot += __shfl_xor_sync(0xffffffffu, dot, 2);
                sc[jj] = j0 + jj < nk ? dot : VIS_NEG_INF;
                cmax = fmaxf(cmax, sc[jj]);
            }
            const float nmx = fmaxf(mx, cmax);
            const float corr = mx == VIS_NEG_INF ? 0.0f : expf(mx - nmx);
            l *= corr;
#pragma unroll
            for (int m = 0; m < M; m++) acc[m] *= corr;
            // Only the tile's nk keys: the rows of vs past them hold whatever an earlier kernel left in
            // shared memory (a NaN there would survive a zero weight).
#pragma unroll
            for (int jj = 0; jj < 16; jj++) {
                if (j0 + jj >= nk) break;
                const float p = expf(sc[jj] - nmx);
                l += p;
#pragma unroll
                for (int m = 0; m < M; m++) {
                    const int d = sub + 4 * m;
                    if (d < hd) acc[m] += p * bf2f(vs[j0 + jj][d]);
                }
            }
            mx = nmx;
        }
    }
    if (!live) return;
    const float inv = 1.0f / l;
#pragma unroll
    for (int m = 0; m < M; m++) {
        const int d = sub + 4 * m;
        if (d < hd) o[(long long)qr * D + h * hd + d] = f2bf(acc[m] * inv);
    }
}

extern "C" __global__ void vision_residual(float* __restrict__ x, const float* __restrict__ y,
                                           const bf16_t* __restrict__ bias, long long total, int D) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= total) return;
    x[i] += y[i] + (bias ? bf2f(bias[i % D]) : 0.0f);
}

extern "C" __global__ void vision_bias_act(const float* __restrict__ y, const bf16_t* __restrict__ bias,
                                           bf16_t* __restrict__ out, long long total, int D, int act) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= total) return;
    const float v = y[i] + (bias ? bf2f(bias[i % D]) : 0.0f);
    float a;
    if (act == 0) {
        const float k = 0.7978846f;  // sqrt(2 / pi), the reference's f32 constant
        a = 0.5f * v * (1.0f + tanhf(k * (v + 0.044715f * v * v * v)));
    } else if (act == 1) {
        a = 0.5f * v * (1.0f + erff(v * 0.70710678118654752f));
    } else if (act == 2) {
        a = v * (1.0f / (1.0f + expf(-v)));
    } else {
        a = v;
    }
    out[i] = f2bf(a);
}
