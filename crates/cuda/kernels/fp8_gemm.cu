// fp8_gemm.cu — the block-FP8 GEMM of prefill chunks on Ada's FP8 tensor cores with mma.sync (sm_89, where
// cuBLASLt has no block-scaled FP8 GEMM), in the fp8 module after fp8.cu (its format and fp8_act_quant).
// Hopper runs the same instruction emulated (its codes converted to fp16 for the fp16 tensor cores; the
// FP8 rate is wgmma's): there it checks this kernel, and cuBLASLt's block-scaled GEMM stays the fast path.
//
// gemm_fp8: y [T, M] bf16 (row stride ldy) = x · Wᵀ with, per 128-k block kb,
//   y[t, m] = sum_kb (sum_{k in kb} e4m3(q[t, k]) · e4m3(W[m, k])) · xs[kb, t] · S[m / 128, kb]
//   q [T, K] e4m3 codes and xs [K/128, T] f32 (fp8_act_quant's output), W [M, K] e4m3 codes and S
//   [ceil(M/128), KBP] f32 (the format of fp8.cu). The products of codes are exact in the MMA's f32
//   accumulation; each 128-k block's sums are scaled in f32 and added (the checkpoints' scheme, as
//   cuBLASLt's VEC128_32F x BLK128x128_32F scaling computes it).
// Tiling: a block of 8 warps computes 128 tokens (blockIdx.x: consecutive blocks share the weights' tile
//   row, so a wave reads each weight once) x 128 output rows (blockIdx.y: one scale block of W). Warp
//   (wm, wn) = (warp / 4, warp % 4) owns tokens 64 wm .. + 63 and rows 32 wn .. + 31: 4 x 4 tiles of
//   mma.sync m16n8k32 e4m3 (A = tokens x k, B = rows x k). Per 128-k block a stage of the cp.async ring
//   (F8G_S stages) holds the x tile [128 tokens][128 B], the W tile [128 rows][128 B] (16-byte chunk c of
//   row r at chunk c ^ (r & 7): the ldmatrix reads below are conflict-free) and the 128 tokens' scales;
//   tokens past T and rows past M are zero-filled. ldmatrix (b16, 8 rows x 16 B) gives lane (g, t) the
//   bytes 4t .. 4t + 3 of row g: the 8-bit MMA fragments (a0 / a1: rows g / g + 8, k 4t..; a2 / a3: k
//   16 + 4t..; b0 / b1: row g, k 4t.. / 16 + 4t..).
// Launch: grid (ceil(T / 128), ceil(M / 128)), block 256, dynamic smem F8G_S * F8G_STAGE (97.5 KB);
//   K % 128 == 0, M % 8 == 0, ldy even, y 4-byte aligned, q and W 16-byte aligned rows (K % 16 == 0).
//   Launched plainly (not programmatically).
// Arch: mma.sync m16n8k32 e4m3 (sm_89+); built for sm_80/86 as a trap (never launched there).
// Tested by: tests/ops/ case "fp8_gemm" against the CPU linear on the dequantised activations and weights.

#define F8G_BM 128
#define F8G_BN 128
#define F8G_S 3
#define F8G_TILE (F8G_BM * 128)                // bytes of one operand tile: 128 rows of 128 codes
#define F8G_STAGE (2 * F8G_TILE + 4 * F8G_BM)  // the x tile, the W tile, the tokens' scales

__device__ __forceinline__ void mma_e4m3(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
#if __CUDA_ARCH__ >= 890
    asm("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

// The shared-memory offset of 16-byte chunk c of row r of a stage's tile.
__device__ __forceinline__ u32 f8g_swz(int r, int c) { return (u32)(r * 128 + ((c ^ (r & 7)) << 4)); }

extern "C" __global__ void __launch_bounds__(256, 1)
gemm_fp8(const unsigned char* q, const float* xs, int T, int K, const unsigned char* __restrict__ W,
         const float* __restrict__ S, int M, bf16_t* y, int ldy) {
#if __CUDA_ARCH__ < 890
    __trap();
#else
    extern __shared__ uint4 f8g_smem[];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3, wm = warp >> 2, wn = warp & 3;
    const int m0 = blockIdx.x * F8G_BM, n0 = blockIdx.y * F8G_BN;
    const int nk = K >> 7, KBP = (nk + 3) & ~3;
    const u32 sbase = smem_addr(f8g_smem);

    // The thread's copies of a stage: chunks id = tid + 256 i (row id / 8, chunk id % 8) of each tile,
    // clamped rows zero-filled; token tid's scale (tid < 128).
    const unsigned char* xsrc[4];
    const unsigned char* wsrc[4];
    u32 dst[4];
    int xbytes[4], wbytes[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int id = tid + 256 * i, r = id >> 3, c = id & 7;
        const bool xok = m0 + r < T, wok = n0 + r < M;
        xsrc[i] = q + (long long)(xok ? m0 + r : 0) * K + c * 16;
        wsrc[i] = W + (long long)(wok ? n0 + r : 0) * K + c * 16;
        xbytes[i] = xok ? 16 : 0;
        wbytes[i] = wok ? 16 : 0;
        dst[i] = f8g_swz(r, c);
    }
    const bool sok = tid < F8G_BM && m0 + tid < T;
    const float* ssrc = xs + (sok ? m0 + tid : 0);
    auto load = [&](int st, int kb) {
        const u32 base = sbase + st * F8G_STAGE;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            cp_async16(base + dst[i], xsrc[i] + kb * 128, xbytes[i]);
            cp_async16(base + F8G_TILE + dst[i], wsrc[i] + kb * 128, wbytes[i]);
        }
        if (tid < F8G_BM) cp_async4(base + 2 * F8G_TILE + 4 * tid, ssrc + (long long)kb * T, sok ? 4 : 0);
    };

    float acc[4][4][4];
#pragma unroll
    for (int a = 0; a < 4; ++a)
#pragma unroll
        for (int b = 0; b < 4; ++b)
#pragma unroll
            for (int c = 0; c < 4; ++c) acc[a][b][c] = 0.f;

#pragma unroll
    for (int st = 0; st < F8G_S - 1; ++st) {
        if (st < nk) load(st, st);
        cp_async_commit();
    }
    // ldmatrix row addresses: lane (quarter qd = lane / 8, row r8 = lane % 8).
    const int qd = lane >> 3, r8 = lane & 7;
    for (int kb = 0; kb < nk; ++kb) {
        cp_async_wait<F8G_S - 2>();
        __syncthreads();  // stage kb is complete for every thread; stage kb - 1 is free
        if (kb + F8G_S - 1 < nk) load((kb + F8G_S - 1) % F8G_S, kb + F8G_S - 1);
        cp_async_commit();
        const int st = kb % F8G_S;
        const u32 sx = sbase + st * F8G_STAGE, sw = sx + F8G_TILE;
        float tmp[4][4][4];
#pragma unroll
        for (int a = 0; a < 4; ++a)
#pragma unroll
            for (int b = 0; b < 4; ++b)
#pragma unroll
                for (int c = 0; c < 4; ++c) tmp[a][b][c] = 0.f;
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {  // 32 k of the block: chunks 2kk, 2kk + 1
            u32 af[4][4], bf[4][2];
#pragma unroll
            for (int mt = 0; mt < 4; ++mt) {
                const int r = wm * 64 + mt * 16 + r8 + (qd & 1) * 8;
                ldsm_x4(sx + f8g_swz(r, 2 * kk + (qd >> 1)), af[mt][0], af[mt][1], af[mt][2], af[mt][3]);
            }
#pragma unroll
            for (int np = 0; np < 2; ++np) {
                const int r = wn * 32 + np * 16 + (qd >> 1) * 8 + r8;
                ldsm_x4(sw + f8g_swz(r, 2 * kk + (qd & 1)), bf[2 * np][0], bf[2 * np][1], bf[2 * np + 1][0],
                        bf[2 * np + 1][1]);
            }
#pragma unroll
            for (int mt = 0; mt < 4; ++mt)
#pragma unroll
                for (int nt = 0; nt < 4; ++nt) mma_e4m3(tmp[mt][nt], af[mt], bf[nt][0], bf[nt][1]);
        }
        // The block's sums times the tokens' scales and the weights' block scale.
        const float wsc = __ldg(S + (long long)blockIdx.y * KBP + kb);
        const float* tsc = (const float*)((const char*)f8g_smem + st * F8G_STAGE + 2 * F8G_TILE);
#pragma unroll
        for (int mt = 0; mt < 4; ++mt) {
            const int r = wm * 64 + mt * 16 + g;
            const float s0 = tsc[r] * wsc, s1 = tsc[r + 8] * wsc;
#pragma unroll
            for (int nt = 0; nt < 4; ++nt) {
                acc[mt][nt][0] = fmaf(tmp[mt][nt][0], s0, acc[mt][nt][0]);
                acc[mt][nt][1] = fmaf(tmp[mt][nt][1], s0, acc[mt][nt][1]);
                acc[mt][nt][2] = fmaf(tmp[mt][nt][2], s1, acc[mt][nt][2]);
                acc[mt][nt][3] = fmaf(tmp[mt][nt][3], s1, acc[mt][nt][3]);
            }
        }
    }
    cp_async_wait<0>();
#pragma unroll
    for (int mt = 0; mt < 4; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int tok = m0 + wm * 64 + mt * 16 + g + 8 * h;
            if (tok >= T) continue;
#pragma unroll
            for (int nt = 0; nt < 4; ++nt) {
                const int o = n0 + wn * 32 + nt * 8 + 2 * t;
                if (o < M) *(u32*)(y + (long long)tok * ldy + o) = pack_bf16(acc[mt][nt][2 * h], acc[mt][nt][2 * h + 1]);
            }
        }
#endif
}
