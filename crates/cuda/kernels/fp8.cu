// fp8.cu — block-FP8 weights (the official `-FP8` checkpoints' e4m3 codes with one f32 scale per 128x128
// block) read in place: the decode GEMV, the activations' quantisation for the FP8 tensor-core GEMM,
// dequantisation to bf16 row slices, and the quantiser and random initialiser that make the format.
//
// Format (ops/fp8.rs): W [M, K] e4m3 codes row-major (the checkpoint's `weight`, bytes as stored),
//   S [ceil(M/128), KBP] f32 row-major (its `weight_scale_inv`, each row padded to KBP = ceil(K/128) rounded
//   up to a multiple of 4, the 16-byte rows cuBLASLt's block-scaled GEMM reads): w[r, k] = e4m3(W[r, k]) *
//   S[r/128, k/128]. K % 16 == 0.
//
// e4m3 -> bf16 by integer ops (f8_bf16x2_pairs): the code's sign, exponent and mantissa bits moved
//   into a bf16's places give e4m3(c) * 2^-120 exactly (normals and subnormals alike: both formats' exponent
//   fields count from the same zero); the 2^120 is folded into the block scale. NaN codes (never in a
//   checkpoint) become finite.
//
// gemv_fp8_n{8,16}: y_s[t, r] = sum_k x[t, k] * w_s[r, k] for t < N (1..8 / 9..16 tokens), up to three
//   (W, S, y, M, ldy) segments sharing x and K (q/k/v, qkv/z/b/a, gate/up). x [N, K] bf16, y [N, M_s] (row
//   stride ldy_s) bf16 or f32 (f32_out). Tensor cores (mma.sync m16n8k16 bf16 -> f32), the tokens as n (8 per tile, NT tiles).
//   Lane (r = lane/4, c = lane%4) loads 16 codes (one 16-byte vector v) of rows r and r+8 of the block's 16
//   rows and the same 16 k of its token(s)' x; those 16 k feed four MMAs under a fixed permutation of k
//   (A and B permuted alike): MMA j takes codes 4j..4j+3 of the vector as its k-slots (2c, 2c+1, 2c+8,
//   2c+9). The quad's four vectors are 64 aligned k, inside one 128-k scale block: each vector's four MMAs
//   accumulate into a zeroed tile that is added scaled (S * 2^120) to the accumulator. Each warp of the
//   block takes its own k-slices (split-K in the block, U = 2 vectors in flight per lane per row, register
//   double-buffered); the partial tiles are summed in shared memory in a fixed order (a token's output
//   does not depend on N).
//   Both (gemv_fp8_tile with one or two token tiles) run the slices wholly inside K without bounds checks and
//   convert the codes in five integer operations a word (f8_bf16x2_pairs; MMA j's k-slots then hold codes 4j,
//   4j+2 | 4j+1, 4j+3 and x alike).
// Launch: grid (sum_s ceil(M_s / 16)), block 256 (8 warps splitting K: the 320 blocks of a 5120-row
//   projection fill one wave, 3 blocks an SM for n8), static smem 4 / 8 KB (n8 / n16). Both take the same
//   k-slices in the same order (U = 2): a token's output is bitwise the same at every N.
//
// fp8_act_quant: x [T, K] bf16 -> q [T, K] e4m3 codes and scales xs [K/128, T] f32 (token-major, what
//   cuBLASLt's VEC128_32F scaling reads): per token and 128-k block, s = amax / 448 (1 for an all-zero
//   block), q = e4m3(x * (1 / s)) rounded to nearest even, saturating (f8_pack2). K % 128 == 0. Launch:
//   grid-stride, block 256 (a lane per 8 features).
// fp8_swiglu_quant: the SwiGLU of a prefill step quantised for the FP8 GEMM in one pass: h = bf16(silu(g) * u)
//   (elementwise.cu's swiglu8, the same bits) of gate / up [T, I] (row strides g_stride / u_stride elements), its
//   rows t < Tq quantised exactly as fp8_act_quant would quantise h (q [Tq, I] codes, xs [I/128, Tq]) and never
//   written as bf16; rows t >= Tq (the last tokens, which the GEMV takes) written to out [T, I] as bf16. I % 128
//   == 0. Launch: grid (ceil(I / 2048), min(T, 65535)), block 256 (8 columns a lane, 16-byte loads).
// fp8_dequant: rows [r0, r1) of W, S -> bf16 [r1 - r0, K] (row stride K), f2bf(e4m3(c) * s) (f32 math).
//   Launch: grid-stride, block 256.
// fp8_quantize: bf16 W [M, K] -> codes and S as deltaserve_model::quant::fp8_block_quantize does (s = amax /
//   448, 1 for an all-zero block; c = e4m3(w / s)). Launch: grid (ceil(K/128), ceil(M/128)), block 256.
// fp8_random: random codes of 32 * N(0, 1) (init.cu's hash, per (seed, index)) and every scale = std / 32.
//   Launch: grid-stride, block 256.
// Arch: mma.sync bf16 + integer ops, sm_80+ (the CUDA backend keeps FP8 weights on sm_89 and later).
// Tested by: tests/ops/ case "fp8" against the CPU oracle (deltaserve_cuda::fp8).

#define F8_ROWS 16
#define F8_TWO120 1.329227995784916e36f  // 2^120

// A word's codes as the pairs (bytes 0, 2) and (bytes 1, 3), values * 2^-120: five integer operations (two of them
// shifts left, which ptxas gives the multiply pipe) against eight for the pairs in byte order; the x pairs that meet
// them in the MMA are permuted alike (two byte permutes an MMA). gemv_fp8_tile's conversion.
__device__ __forceinline__ void f8_bf16x2_pairs(u32 w, u32& p02, u32& p13) {
    p02 = ((w << 4) & 0x07f007f0u) | ((w << 8) & 0x80008000u);
    p13 = ((w >> 4) & 0x07f007f0u) | (w & 0x80008000u);
}

// The value of one e4m3 code (f32, exact).
__device__ __forceinline__ float f8_value(u32 code) {
    const u32 b = ((code & 0x80u) << 24) | ((code & 0x7fu) << 20);
    return __uint_as_float(b) * F8_TWO120;
}

// The block's outputs from each warp's accumulators acc[n] (lane (r, c): rows r, r + 8 of the block, tokens
// 8n + 2c, 8n + 2c + 1 in the mma layout): through red, row `rb + row`, token t is the sum over the warps of
// their values in warp order (rows past M and tokens past N not stored).
template <int NT, int WARPS>
__device__ __forceinline__ void gemv_fp8_store(const float (&acc)[NT][4], float (*red)[F8_ROWS][8 * NT], int rb,
                                               int N, int M, int ldy, void* Y, int f32_out) {
    constexpr int ROWS = F8_ROWS, COLS = 8 * NT;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, r = lane >> 2, c = lane & 3;
#pragma unroll
    for (int n = 0; n < NT; n++) {
        red[warp][r][8 * n + 2 * c] = acc[n][0];
        red[warp][r][8 * n + 2 * c + 1] = acc[n][1];
        red[warp][r + 8][8 * n + 2 * c] = acc[n][2];
        red[warp][r + 8][8 * n + 2 * c + 1] = acc[n][3];
    }
    __syncthreads();
    for (int i = threadIdx.x; i < ROWS * COLS; i += blockDim.x) {
        const int row = i / COLS, t = i % COLS;
        const int gr = rb + row;
        if (t < N && gr < M) {
            float s = 0.0f;
#pragma unroll
            for (int w = 0; w < WARPS; w++) s += red[w][row][t];
            const long long at = (long long)t * ldy + gr;
            if (f32_out) ((float*)Y)[at] = s;
            else ((bf16_t*)Y)[at] = f2bf(s);
        }
    }
}

// One block of 16 rows, WARPS warps splitting K into slices of U vectors a lane (a warp's slices start at vector
// warp*U*4 and follow every WARPS*U*4), the same slices and order at every N. The slices wholly inside K run
// without bounds checks: a row past M reads row 0's codes and a token past N token 0's x (their outputs are never
// stored; an MMA's output rows and columns depend on their own A rows and B columns only); at most one slice a
// warp straddles K's end, and there the vectors past K count as zero. Other block shapes (two row tiles a warp, x
// and scales loaded a slice ahead, 4-warp blocks) measured 0.88-0.99x this one
// (bench/results/fp8-gemv-and-w4g-scales-h100-2026-12-06.md §1).
template <int NT, int U, int WARPS>
__device__ __forceinline__ void gemv_fp8_tile(const bf16_t* x, int N, int K, const unsigned char* __restrict__ W,
                                              const float* __restrict__ S, void* Y, int M, int ldy, int b,
                                              int f32_out, float (*red)[F8_ROWS][8 * NT]) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int r = lane >> 2, c = lane & 3;
    const int rb = b * F8_ROWS;  // the block's first row
    const uint4* wp[2];
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int row = rb + 8 * h + r;
        wp[h] = (const uint4*)(W + (long long)(row < M ? row : 0) * K) + c;
    }
    const int KV = K >> 4;  // 16-byte code vectors per row
    const int KBP = (((K + 127) >> 7) + 3) & ~3;
    const float* srow = S + (long long)(rb >> 7) * KBP;
    const uint4* xp[NT];
#pragma unroll
    for (int n = 0; n < NT; n++) xp[n] = (const uint4*)(x + (long long)(r + 8 * n < N ? r + 8 * n : 0) * K) + 2 * c;
    float acc[NT][4];
#pragma unroll
    for (int n = 0; n < NT; n++) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
    const int step = WARPS * U * 4;
    // A slice: the codes of U vectors of each of the lane's two rows.
    struct Slice {
        uint4 a[U][2];
    };
    // The loads of the slice from vector vb; `part`: vectors past K are read at vector 0 (the MMAs zero them).
    auto load = [&](Slice& sl, int vb, bool part) {
        if (!part) {  // one address a row, the vectors at constant offsets from it
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const uint4* wrow = wp[h] + vb;
#pragma unroll
                for (int u = 0; u < U; u++) sl.a[u][h] = ld_nc_stream(wrow + u * 4);
            }
            return;
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int o = vb + u * 4 + c >= KV ? -c : vb + u * 4;
#pragma unroll
            for (int h = 0; h < 2; h++) sl.a[u][h] = ld_nc_stream(wp[h] + o);
        }
    };
    // The MMAs of slice `sl` from vector vb (`part`: zero the vectors past K).
    auto compute = [&](Slice& sl, int vb, bool part) {
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int vq = vb + u * 4;  // the quad's first vector: 64 aligned k in one scale block
            const bool in = !part || vq + c < KV;
            if (!in) sl.a[u][0] = sl.a[u][1] = zero;
            float sc = __ldg(srow + ((part && vq >= KV ? 0 : vq) >> 3));
            sc = part && vq >= KV ? 0.0f : sc * F8_TWO120;
#pragma unroll
            for (int n = 0; n < NT; n++) {
                uint4 xv[2];
                const int o = in ? vq : -c;
                xv[0] = ld_act(xp[n] + 2 * o);
                xv[1] = ld_act(xp[n] + 2 * o + 1);
                if (!in) xv[0] = xv[1] = zero;
                u32 xb[4][2];  // MMA j's B registers: x permuted as f8_bf16x2_pairs pairs the codes
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    const uint4& xx = xv[j >> 1];
                    const u32 lo = (j & 1) ? xx.z : xx.x, hi = (j & 1) ? xx.w : xx.y;
                    xb[j][0] = __byte_perm(lo, hi, 0x5410);
                    xb[j][1] = __byte_perm(lo, hi, 0x7632);
                }
                float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    const u32 w0 = u4_comp(sl.a[u][0], j), w1 = u4_comp(sl.a[u][1], j);
                    u32 a0, a1, a2, a3;
                    f8_bf16x2_pairs(w0, a0, a2);
                    f8_bf16x2_pairs(w1, a1, a3);
                    mma_bf16(d, a0, a1, a2, a3, xb[j][0], xb[j][1]);
                }
#pragma unroll
                for (int i = 0; i < 4; i++) acc[n][i] = fmaf(sc, d[i], acc[n][i]);
            }
        }
    };
    // Whether the slice from vector v lies wholly inside K.
    auto whole = [&](int v) { return v + U * 4 <= KV; };
    // One whole slice's MMAs (in `now`) with the next slice's loads (into `next`) in flight; false when the next
    // slice is not whole (then `next` holds it if it starts inside K).
    int vb = warp * U * 4;
    auto advance = [&](Slice& now, Slice& next) {
        const int nb = vb + step;
        if (whole(nb) || nb < KV) load(next, nb, !whole(nb));
        compute(now, vb, false);
        vb = nb;
        return whole(vb);
    };
    // Two slices in turn (no copies between them).
    Slice s0, s1;
    if (vb < KV) load(s0, vb, !whole(vb));
    // Launched to overlap the previous kernel (sm_90): the first codes are in flight; x and y are its.
    pdl_wait();
    bool last_in_s0 = true;
    if (whole(vb)) {
        for (;;) {
            if (!advance(s0, s1)) {
                last_in_s0 = false;
                break;
            }
            if (!advance(s1, s0)) break;
        }
    }
    if (vb < KV) {
        if (last_in_s0) compute(s0, vb, true);
        else compute(s1, vb, true);
    }
    gemv_fp8_store<NT, WARPS>(acc, red, rb, N, M, ldy, Y, f32_out);
}

// A GEMV kernel: the body (gemv_fp8_tile, instantiated) over the launch's three segments, WARPS
// warps a block, a shared-memory reduction of [WARPS][ROWS][COLS].
#define GEMV_FP8(NAME, WARPS, BLOCKS, ROWS, COLS, ...)                                                         \
    extern "C" __global__ void __launch_bounds__(32 * WARPS, BLOCKS)                                           \
    NAME(const bf16_t* x, int N, int K, const unsigned char* __restrict__ w0, const float* __restrict__ s0,     \
         void* __restrict__ y0, int m0, int ld0, int nb0, const unsigned char* __restrict__ w1,                \
         const float* __restrict__ s1, void* __restrict__ y1, int m1, int ld1, int nb1,                         \
         const unsigned char* __restrict__ w2, const float* __restrict__ s2, void* __restrict__ y2, int m2,    \
         int ld2, int f32_out) {                                                                                \
        __shared__ float red[WARPS][ROWS][COLS];                                                               \
        int b = blockIdx.x;                                                                                     \
        if (b < nb0) {                                                                                          \
            __VA_ARGS__(x, N, K, w0, s0, y0, m0, ld0, b, f32_out, red);                                         \
        } else if (b < nb0 + nb1) {                                                                             \
            __VA_ARGS__(x, N, K, w1, s1, y1, m1, ld1, b - nb0, f32_out, red);                                   \
        } else {                                                                                                \
            __VA_ARGS__(x, N, K, w2, s2, y2, m2, ld2, b - nb0 - nb1, f32_out, red);                             \
        }                                                                                                       \
    }

GEMV_FP8(gemv_fp8_n8, 8, 3, F8_ROWS, 8, gemv_fp8_tile<1, 2, 8>)
GEMV_FP8(gemv_fp8_n16, 8, 2, F8_ROWS, 16, gemv_fp8_tile<2, 2, 8>)

extern "C" __global__ void fp8_act_quant(const bf16_t* x, int T, int K, unsigned char* __restrict__ q,
                                         float* __restrict__ xs) {
    pdl_enter();
    // A lane per 8 features, a half-warp per 128-feature block (K % 128 == 0: blocks never straddle
    // half-warps or rows); the loop is warp-uniform (the shuffles need every lane).
    const int lane = threadIdx.x & 31;
    const long long groups = (long long)T * (K >> 3);
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long base = (long long)blockIdx.x * blockDim.x + (threadIdx.x & ~31); base < groups; base += stride) {
        const long long g = base + lane;
        const bool ok = g < groups;
        const uint4 v = ok ? ld_act((const uint4*)x + g) : make_uint4(0u, 0u, 0u, 0u);
        float f[8], sc;
        bf16x8_f32(v, f);
        const uint2 out = f8_quant8(f, sc);
        if (ok) {
            *(uint2*)(q + 8 * g) = out;
            if ((lane & 15) == 0) {
                const long long row = g / (K >> 3);
                const int kb = (int)((g - row * (K >> 3)) >> 4);
                xs[(long long)kb * T + row] = sc;
            }
        }
    }
}

extern "C" __global__ void fp8_swiglu_quant(const bf16_t* gate, long long g_stride, const bf16_t* up,
                                            long long u_stride, int T, int I, int Tq, unsigned char* __restrict__ q,
                                            float* __restrict__ xs, bf16_t* __restrict__ out) {
    pdl_enter();
    // A lane per 8 columns, a half-warp per 128-column block (I % 128 == 0 and 2048 columns a block: a
    // half-warp's lanes are all inside I or all past it); every lane runs the quantisation (its shuffles).
    const int c = (blockIdx.x * blockDim.x + threadIdx.x) * 8;
    const bool in = c < I;
    for (long long t = blockIdx.y; t < T; t += gridDim.y) {
        uint4 h = make_uint4(0u, 0u, 0u, 0u);
        if (in) h = swiglu_vec8(ld_act((const uint4*)(gate + t * g_stride + c)), ld_act((const uint4*)(up + t * u_stride + c)));
        float f[8], sc;
        bf16x8_f32(h, f);
        const uint2 codes = f8_quant8(f, sc);
        if (!in) continue;
        if (t < Tq) {
            *(uint2*)(q + t * I + c) = codes;
            if ((threadIdx.x & 15) == 0) xs[(long long)(c >> 7) * Tq + t] = sc;
        } else {
            *(uint4*)(out + t * I + c) = h;
        }
    }
}

extern "C" __global__ void fp8_dequant(const unsigned char* __restrict__ W, const float* __restrict__ S, int K,
                                       int r0, int r1, bf16_t* __restrict__ out) {
    const int KBP = (((K + 127) >> 7) + 3) & ~3;
    const long long n = (long long)(r1 - r0) * K;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const int row = r0 + (int)(i / K), k = (int)(i % K);
        const float s = S[(long long)(row >> 7) * KBP + (k >> 7)];
        out[i] = f2bf(f8_value(W[(long long)row * K + k]) * s);
    }
}

extern "C" __global__ void __launch_bounds__(256) fp8_quantize(const bf16_t* __restrict__ w, int M, int K,
                                                               unsigned char* __restrict__ W,
                                                               float* __restrict__ S) {
    __shared__ float red[8];
    const int kb = blockIdx.x, rb = blockIdx.y;
    const int KBP = (gridDim.x + 3) & ~3;
    // Thread i: row rb*128 + i/2, columns kb*128 + (i%2)*64 .. + 63.
    const int row = rb * 128 + (threadIdx.x >> 1), k0 = kb * 128 + (threadIdx.x & 1) * 64;
    float amax = 0.0f;
    if (row < M)
        for (int k = k0; k < min(k0 + 64, K); k++) amax = fmaxf(amax, fabsf(bf2f(w[(long long)row * K + k])));
    amax = warp_max(amax);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = amax;
    __syncthreads();
    amax = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; i++) amax = fmaxf(amax, red[i]);
    const float s = amax > 0.0f ? __fdiv_rn(amax, 448.0f) : 1.0f;
    if (threadIdx.x == 0) S[(long long)rb * KBP + kb] = s;
    if (row < M)
        for (int k = k0; k < min(k0 + 64, K); k++)
            W[(long long)row * K + k] = (unsigned char)kq_e4m3(__fdiv_rn(bf2f(w[(long long)row * K + k]), s));
}
