// w4_tile.cuh — the int4 tile GEMM's device code (w4g_body and its helpers), shared by the w4_gemm
// module (w4_gemm.cu, which describes it) and the moe_w4 module (the routed experts' grouped GEMM,
// moe_w4.cu).

#define W4G_WARPS 4
#define W4G_S 4
// Bytes of a stage's weights (4 warps x one 2 KB unit).
#define W4G_WBYTES (W4G_WARPS * 2048)
// A build switch for the tile kernel's measured stalls (bench/results/norm-in-reduce-h200-2026-12-05.md §3):
// W4G_SMEM_SCALES (on by default): a group's scales ride the cp.async ring (W4G_SBYTES a stage: 4 warps x 8 row
// quads x 8 bytes, after the weights and the x tile; the launcher's shared memory always has room) instead of
// registers loaded S - 1 groups ahead; 0 restores the registers. The kernels alone 4-12% faster at 24-64 rows,
// int4 decode at batch 24-64 4-7% (bench/results/fp8-gemv-and-w4g-scales-h100-2026-12-06.md §2).
#define W4G_SBYTES (W4G_WARPS * 64)
#ifndef W4G_SMEM_SCALES
#define W4G_SMEM_SCALES 1
#endif
// Each group's exact products (q - z) * x run on the tensor cores into per-group partial sums, to which
// the group adds scale * sum in f32 (no rounding of the weights; the group's last MMAs drain into those
// FMAs: norm-in-reduce-h200-2026-12-05.md §3). Scaling the unpacked weights before the MMA instead (each
// weight rounded to bf16 once, accumulation across groups, half the accumulator registers) measured
// slower at every tile size on the H100 (bench/results/int4-48-token-exact-tile-h100-2026-12-06.md).

// The column pair in nibbles (p, p + 4) of w (after w >> 4p) as bf16 (q0 - z, q1 - z), exact: the LOP3
// gives bf16 (128 + q0, 128 + q1), and a bf16x2 FMA (sm_80) adds nz = -(128 + z) in both halves.
__device__ __forceinline__ u32 w4g_dq(u32 w, u32 nz) {
    u32 r;
    asm("{\n .reg .b32 q;\n lop3.b32 q, %1, %2, %3, 0xea;\n fma.rn.bf16x2 %0, q, %4, %5;\n}"
        : "=r"(r)
        : "r"(w), "r"(0x000f000fu), "r"(0x43004300u), "r"(0x3f803f80u), "r"(nz));
    return r;
}

// Zeroes a warp tile's accumulators (2 row tiles x NT n-tiles x 4).
template <int NT>
__device__ __forceinline__ void w4g_zero(float (&v)[2][NT][4]) {
#pragma unroll
    for (int a = 0; a < 2; ++a)
#pragma unroll
        for (int b = 0; b < NT; ++b)
#pragma unroll
            for (int c = 0; c < 4; ++c) v[a][b][c] = 0.f;
}

// Physical 16-byte chunk of chunk c (0..15) of x-tile row r: conflict-free 16-byte loads for the
// lanes (g, t) of a quarter warp (rows 2q, 2q + 1; chunks 4i + t: one row's in one half of the 128
// bytes, the other row's in the other half).
__device__ __forceinline__ int w4g_swz(int r, int c) { return c ^ ((r & 1) << 2); }

// Stores the fragments of a lane's 4 rows r0 .. r0 + 3 (all in: out % 4 == 0) for NT n-tiles of 8
// tokens from m0: fragment c of tile a, n-tile b is row r0 + 2a + (c >> 1), token m0 + 8b + 2t + (c & 1).
// mode 0: bf16 y, 1: f32 y, 2: f32 partials ws[split][M][ldp] (y = ws); vec: 4 rows per store.
template <int NT>
__device__ __forceinline__ void w4g_store(const float (&acc)[2][NT][4], int r0, int m0, int t, void* y, long long ldy,
                                          int M, long long ldp, int mode, int vec, int split) {
#pragma unroll
    for (int b = 0; b < NT; ++b) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int m = m0 + 8 * b + 2 * t + e;
            if (m >= M) continue;
            const float v0 = acc[0][b][e], v1 = acc[0][b][2 + e], v2 = acc[1][b][e], v3 = acc[1][b][2 + e];
            if (mode == 2) {
                float* ws = (float*)y + ((long long)split * M + m) * ldp + r0;
                *(float4*)ws = make_float4(v0, v1, v2, v3);
            } else if (mode == 1) {
                float* p = (float*)y + m * ldy + r0;
                if (vec) {
                    *(float4*)p = make_float4(v0, v1, v2, v3);
                } else {
                    p[0] = v0;
                    p[1] = v1;
                    p[2] = v2;
                    p[3] = v3;
                }
            } else {
                bf16_t* p = (bf16_t*)y + m * ldy + r0;
                if (vec) {
                    *(uint2*)p = make_uint2(pack_bf16(v0, v1), pack_bf16(v2, v3));
                } else {
                    const u32 lo = pack_bf16(v0, v1), hi = pack_bf16(v2, v3);
                    p[0] = (bf16_t)lo;
                    p[1] = (bf16_t)(lo >> 16);
                    p[2] = (bf16_t)hi;
                    p[3] = (bf16_t)(hi >> 16);
                }
            }
        }
    }
}

// One block's tile: tokens m0 .. m0 + 8*NT of x (rows past M zero-filled, not stored), output rows
// 128*rb .. + 127, the groups of K split `split` of `splits` (w4g_*: blockIdx.x * 8*NT, blockIdx.y,
// blockIdx.z of gridDim.z; moe_w4g: one expert's tile).
template <int NT>
__device__ __forceinline__ void w4g_body(const u32* __restrict__ qw, const unsigned short* __restrict__ scales,
                                         const unsigned char* __restrict__ zeros, int scale_bf16, const bf16_t* x,
                                         long long ldx, void* y, long long ldy, int M, int out, int in, int mode,
                                         int vec, int m0, int rb, int split, int splits) {
    constexpr int S = W4G_S, BM = 8 * NT, WB = W4G_WBYTES;
    constexpr int XBYTES = BM * 256, STAGE = WB + XBYTES + (W4G_SMEM_SCALES ? W4G_SBYTES : 0);
    extern __shared__ uint4 w4g_smem[];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int ng = in >> 7;
    const int gb = (int)((long long)split * ng / splits), ge = (int)((long long)(split + 1) * ng / splits);
    const int n = ge - gb;
    const int r0 = rb * 128 + warp * 32 + 4 * g;  // the lane's rows r0 .. r0 + 3
    const int rc = min(r0, out - 4);              // rows whose scales / zeros are loaded
    // The lane's 4 rows (clamped to out - 1: inside one pair) at group gb; gstep uint4 per group.
    const int gstep = 4 * min(32, out - ((min(r0, out - 1) >> 5) << 5));
    const uint4* qw4 = (const uint4*)qw;
    u32 pw[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) pw[j] = (u32)w4_u4(min(r0 + j, out - 1), 4 * gb + t, out, ng);
    const int zstride = out >> 1;
    const u32 smem_s = smem_addr(w4g_smem);

    uint2 sv[S];  // scale bits: x = rows 0 | 1 << 16, y = rows 2 | 3 << 16
    u32 zv[S];    // zeros: nibble j = row j
    // The next group's sources, one group on after each issue (the groups are issued in order).
    const uint4* wsrc[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) wsrc[j] = qw4 + pw[j];
    const unsigned short* ssrc = scales + (long long)gb * out + rc;
    const unsigned char* zsrc = zeros ? zeros + (long long)gb * zstride + (rc >> 1) : nullptr;
    auto issue_w = [&](int st, uint2& s_out, u32& z_out) {
        const u32 base = smem_s + st * STAGE + warp * 2048 + lane * 16;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            cp_async16(base + j * 512, wsrc[j]);
            wsrc[j] += gstep;
        }
        if (W4G_SMEM_SCALES) {
            if (t == 0)
                asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(smem_s + st * STAGE + WB + XBYTES +
                                                                                 warp * 64 + g * 8),
                             "l"(ssrc)
                             : "memory");
        } else {
            s_out = __ldg((const uint2*)ssrc);
        }
        ssrc += out;
        z_out = zsrc ? (u32)__ldg((const unsigned short*)zsrc) : 0x8888u;
        if (zsrc) zsrc += zstride;
    };
    // The thread's 16-byte pieces of each stage's x tile: piece c is chunk ch of token row r (clamped to
    // M - 1 and zero-filled past M), at the next group in xp[c] (+ 128 columns after each issue).
    constexpr int XC = BM * 16 / (W4G_WARPS * 32);
    const bf16_t* xp[XC];
    u32 xd[XC];
    int xn[XC];
#pragma unroll
    for (int c = 0; c < XC; ++c) {
        const int id = tid + c * W4G_WARPS * 32, r = id >> 4, ch = id & 15;
        xp[c] = x + (long long)min(m0 + r, M - 1) * ldx + (long long)gb * 128 + ch * 8;
        xd[c] = WB + r * 256 + w4g_swz(r, ch) * 16;
        xn[c] = m0 + r < M ? 16 : 0;
    }
    auto issue_x = [&](int st) {
#pragma unroll
        for (int c = 0; c < XC; ++c) {
            cp_async16(smem_s + st * STAGE + xd[c], xp[c], xn[c]);
            xp[c] += 128;
        }
    };

    float acc[2][NT][4];
    w4g_zero<NT>(acc);
    // The first S - 1 stages: weights before the wait (a programmatic launch overlaps the previous
    // kernel), x after it; commit group st holds stage st's x (and, in group 0, every early weight).
#pragma unroll
    for (int st = 0; st < S - 1; ++st)
        if (st < n) issue_w(st, sv[st], zv[st]);
    pdl_wait();
#pragma unroll
    for (int st = 0; st < S - 1; ++st) {
        if (st < n) issue_x(st);
        cp_async_commit();
    }
    // The lane's x-fragment offsets in shared memory: token row r = 8b + g (r & 1 = g & 1), chunk 4i + t of the
    // stage's x tile: byte g * 256 + w4g_swz(g, 4i + t) * 16 (+ b * 2048 + the stage's offset, constants
    // once the loops are unrolled). Every n-tile is computed (tokens at or past M are zero-filled and not
    // stored): no branch between the fragment loads and the MMAs. Chunk 4i + t sits at 64 * (i ^ (g & 1)) +
    // 16t, so words 2h and 2h + 1 are at xa and xa ^ 64, + 128h (two registers; bit 7 of both clear).
    const u32 xa = WB + g * 256 + w4g_swz(g, t) * 16, xo = xa ^ 64u;
    for (int k0 = 0; k0 < n; k0 += S) {
#pragma unroll
        for (int u = 0; u < S; ++u) {
            const int k = k0 + u;
            if (k < n) {
                cp_async_wait<S - 2>();
                __syncthreads();  // stage u is complete for every thread; stage u - 1 is free
                const int sn = (u + S - 1) % S;
                if (k + S - 1 < n) {
                    issue_w(sn, sv[sn], zv[sn]);
                    issue_x(sn);
                }
                cp_async_commit();
                const uint4* wst = w4g_smem + (u * STAGE + warp * 2048) / 16 + lane;
                const uint4 q0 = wst[0], q1 = wst[32], q2 = wst[64], q3 = wst[96];
                // -(128 + z) as bf16 in both halves: the zero points spread to both halves once, a LOP3 a row.
                const u32 zz = zv[u] * 0x10001u;
                u32 nz[4];
#pragma unroll
                for (int j = 0; j < 4; ++j) nz[j] = ((zz >> (4 * j)) & 0x000f000fu) | 0xc300c300u;
                float own[2][NT][4];
                w4g_zero<NT>(own);
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    uint4 xv[NT];
#pragma unroll
                    for (int b = 0; b < NT; ++b)
                        xv[b] = *(const uint4*)((const char*)w4g_smem + ((i & 1) ? xo : xa) + (i >> 1) * 128 +
                                                u * STAGE + b * 2048);
                    const u32 w0 = u4_comp(q0, i), w1 = u4_comp(q1, i), w2 = u4_comp(q2, i), w3 = u4_comp(q3, i);
                    u32 a[2][2][4];  // [tile][half][fragment register]
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        a[0][h][0] = w4g_dq(w0 >> (8 * h), nz[0]);
                        a[0][h][1] = w4g_dq(w1 >> (8 * h), nz[1]);
                        a[0][h][2] = w4g_dq(w0 >> (8 * h + 4), nz[0]);
                        a[0][h][3] = w4g_dq(w1 >> (8 * h + 4), nz[1]);
                        a[1][h][0] = w4g_dq(w2 >> (8 * h), nz[2]);
                        a[1][h][1] = w4g_dq(w3 >> (8 * h), nz[3]);
                        a[1][h][2] = w4g_dq(w2 >> (8 * h + 4), nz[2]);
                        a[1][h][3] = w4g_dq(w3 >> (8 * h + 4), nz[3]);
                    }
#pragma unroll
                    for (int b = 0; b < NT; ++b) {
                        mma_bf16(own[0][b], a[0][0], xv[b].x, xv[b].y);
                        mma_bf16(own[1][b], a[1][0], xv[b].x, xv[b].y);
                        mma_bf16(own[0][b], a[0][1], xv[b].z, xv[b].w);
                        mma_bf16(own[1][b], a[1][1], xv[b].z, xv[b].w);
                    }
                }
                // The group's 4 row scales (f32), from the ring or the registers loaded S - 1 groups ahead.
                const uint2 sb = W4G_SMEM_SCALES ? *(const uint2*)((const char*)w4g_smem + u * STAGE + WB + XBYTES +
                                                                   warp * 64 + g * 8)
                                                 : sv[u];
                const u32 bits[4] = {sb.x & 0xffffu, sb.x >> 16, sb.y & 0xffffu, sb.y >> 16};
                float s[4];
#pragma unroll
                for (int j = 0; j < 4; ++j)
                    s[j] = scale_bf16 ? __uint_as_float(bits[j] << 16) : f16_to_f32((unsigned short)bits[j]);
#pragma unroll
                for (int a = 0; a < 2; ++a)
#pragma unroll
                    for (int b = 0; b < NT; ++b)
#pragma unroll
                        for (int c = 0; c < 4; ++c) acc[a][b][c] = fmaf(s[2 * a + (c >> 1)], own[a][b][c], acc[a][b][c]);
            }
        }
    }
    cp_async_wait<0>();
    if (r0 >= out) return;  // out % 4 == 0: the lane's 4 rows are all in or all out
    w4g_store<NT>(acc, r0, m0, t, y, ldy, M, ldy, mode, vec, split);
}
