// gemv.cu — skinny GEMM for decode steps: y[n, m] = x[n, k] · W[m, k]ᵀ for n = 1..8 tokens.
//
// Computes (bf16 in, f32 accumulate, bf16 or f32 out), for up to three (W, y, M) segments that
// share x and K in one launch (e.g. a layer's q/k/v or qkv/z/ba projections):
//   y_s[t, r] = sum_k x[t, k] * W_s[r, k]      t < N, r < M_s
// Shapes/dtypes: x [N, K] bf16 (row stride K); W_s [M_s, K] bf16 row-major (PyTorch Linear);
//   y_s [N, M_s] bf16 (f32_out = 0) or f32 (f32_out = 1). K % 8 == 0, all pointers 16-byte
//   aligned (the launcher checks).
// Method: tensor cores with the tokens as the MMA's n = 8 columns (mma.sync m16n8k16, bf16 ->
//   f32; unused token columns are zero). The weights are streamed once with 16-byte
//   non-allocating loads: lane (r = lane/4, c = lane%4) loads 8 consecutive k of rows r and r+8 of
//   the block's 16 rows and the same 8 k of token r's x; those 8 k feed two MMAs, so a lane's
//   registers ARE its A/B fragments under a fixed permutation of k (the dot product does not
//   care about the order of k, and A and B use the same permutation). Each warp of the block takes
//   its own 256-byte k-slices of the 16 rows (split-K inside the block; GEMV_U slices in flight
//   per lane, register double-buffered); the 4 partial tiles are summed in shared memory in a
//   fixed order, so the result does not depend on N (a token's output is bitwise the same at
//   every N).
// Launch: grid (sum_s ceil(M_s / 16)), block 128 (4 warps; <= 128 registers so 4 blocks fit an SM:
//   the 320 blocks of an M = 5120 projection run in one wave on 132 SMs), static smem 2 KB.
// Arch: mma.sync bf16 + ld.global.nc, sm_80+ (no Hopper-only instructions; on sm_90 the launcher
//   may launch it programmatically: the first weights load before pdl_wait()).
// Tested by: tests/ops/ case "gemv" against deltaserve_cpu::linear::linear.

#define GEMV_WARPS 4
#define GEMV_U 4
#define GEMV_ROWS 16

extern "C" __global__ void __launch_bounds__(128, 4)
gemv_bf16(const bf16_t* x, int N, int K,
          const bf16_t* __restrict__ w0, void* __restrict__ y0, int m0, int nb0,
          const bf16_t* __restrict__ w1, void* __restrict__ y1, int m1, int nb1,
          const bf16_t* __restrict__ w2, void* __restrict__ y2, int m2, int f32_out) {
    __shared__ float red[GEMV_WARPS][GEMV_ROWS][8];
    int b = blockIdx.x;
    const bf16_t* W;
    void* Y;
    int M;
    if (b < nb0) {
        W = w0; Y = y0; M = m0;
    } else if (b < nb0 + nb1) {
        b -= nb0; W = w1; Y = y1; M = m1;
    } else {
        b -= nb0 + nb1; W = w2; Y = y2; M = m2;
    }
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int r = lane >> 2, c = lane & 3;
    const int row0 = b * GEMV_ROWS + r, row1 = row0 + 8;
    const bool ok0 = row0 < M, ok1 = row1 < M, okx = r < N;
    const uint4* wp0 = (const uint4*)(W + (long long)(ok0 ? row0 : 0) * K);
    const uint4* wp1 = (const uint4*)(W + (long long)(ok1 ? row1 : 0) * K);
    const uint4* xp = (const uint4*)(x + (long long)(okx ? r : 0) * K);
    const int K8 = K >> 3;  // 16-byte vectors per row
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
    const int step = GEMV_WARPS * GEMV_U * 4;
    // Register double buffer: the loads of the next slice are issued before the MMAs of this one
    // (ptxas cannot sink them past the loop's back edge, so GEMV_U x 3 loads stay in flight).
    // Loads are unconditional at clamped addresses (zeroed afterwards where out of range); the
    // loop is warp-uniform (mma.sync needs the whole warp).
    uint4 a[GEMV_U], a8[GEMV_U], xv[GEMV_U];
    int vb = warp * GEMV_U * 4;
    if (vb < K8) {
#pragma unroll
        for (int u = 0; u < GEMV_U; u++) {
            const int v = vb + u * 4 + c, vc = v < K8 ? v : 0;
            a[u] = ld_nc_stream(wp0 + vc);
            a8[u] = ld_nc_stream(wp1 + vc);
        }
    }
    // Launched to overlap the previous kernel (sm_90): the first weights are in flight; x and y
    // are that kernel's.
    pdl_wait();
    if (vb < K8) {
#pragma unroll
        for (int u = 0; u < GEMV_U; u++) {
            const int v = vb + u * 4 + c, vc = v < K8 ? v : 0;
            xv[u] = ld_act(xp + vc);
        }
    }
    for (; vb < K8; vb += step) {
        uint4 na[GEMV_U], na8[GEMV_U], nxv[GEMV_U];
        const int nb = vb + step;
        if (nb < K8) {
#pragma unroll
            for (int u = 0; u < GEMV_U; u++) {
                const int v = nb + u * 4 + c, vc = v < K8 ? v : 0;
                na[u] = ld_nc_stream(wp0 + vc);
                na8[u] = ld_nc_stream(wp1 + vc);
                nxv[u] = ld_act(xp + vc);
            }
        }
#pragma unroll
        for (int u = 0; u < GEMV_U; u++) {
            const bool in = vb + u * 4 + c < K8;
            if (!(ok0 && in)) a[u] = zero;
            if (!(ok1 && in)) a8[u] = zero;
            if (!(okx && in)) xv[u] = zero;
            mma_bf16(acc, a[u].x, a8[u].x, a[u].y, a8[u].y, xv[u].x, xv[u].y);
            mma_bf16(acc, a[u].z, a8[u].z, a[u].w, a8[u].w, xv[u].z, xv[u].w);
        }
#pragma unroll
        for (int u = 0; u < GEMV_U; u++) {
            a[u] = na[u];
            a8[u] = na8[u];
            xv[u] = nxv[u];
        }
    }
    // Accumulators: (row r, token 2c), (row r, token 2c+1), (row r+8, token 2c), (row r+8, token 2c+1).
    red[warp][r][2 * c] = acc[0];
    red[warp][r][2 * c + 1] = acc[1];
    red[warp][r + 8][2 * c] = acc[2];
    red[warp][r + 8][2 * c + 1] = acc[3];
    __syncthreads();
    {  // 128 threads = 16 rows x 8 tokens
        const int row = threadIdx.x >> 3, t = threadIdx.x & 7;
        const int gr = b * GEMV_ROWS + row;
        if (t < N && gr < M) {
            float s = 0.0f;
#pragma unroll
            for (int w = 0; w < GEMV_WARPS; w++) s += red[w][row][t];
            const long long at = (long long)t * M + gr;
            if (f32_out) ((float*)Y)[at] = s;
            else ((bf16_t*)Y)[at] = f2bf(s);
        }
    }
}
