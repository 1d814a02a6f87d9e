// w4_tile_wg.cuh — the int4 tile GEMM on Hopper's warpgroup tensor-core instructions (wgmma, sm_90a):
// w4w_body, the device code of the w4_gemm module's w4w_* kernels (w4_gemm.cu), an additional path beside
// w4g_body (w4_tile.cuh, mma.sync: Ampere, Ada, and Hopper where this one is off). Only the module built
// for sm_90a compiles the body (__CUDA_ARCH_FEAT_SM90_ALL); elsewhere the kernels trap and the launcher
// never picks them.
//
// The same tile, ring and arithmetic as w4g_body: a block of 4 warps (one warpgroup) owns 128 output rows
// x 8*NT tokens and the groups of its K split; each warp's 2 KB weight unit of a group and the group's
// scales ride the cp.async ring (W4G_S stages), zeros ride in registers; a lane unpacks its 4 rows'
// words into the same A fragments (q - z exact, and with RW scaled as w4g_body's RW rounds them). What
// changes is the product: per 16 columns and row tile, one wgmma m64n(8*NT)k16 for the warpgroup
// (A = the fragments in registers: warp w's rows are the warpgroup's rows 16w .. 16w + 15, in the
// order of w4g_body's tiles; B = the stage's x tile in shared memory), issued asynchronously while the
// next words unpack, instead of 2*NT mma.sync a warp and their x-fragment loads.
// The x tile is laid out for wgmma's 128-byte swizzle ([2 column blocks of 64][8*NT tokens][128 B], 16-byte
// chunk c of row r at (c ^ (r & 7)) * 16, 1024-byte aligned stages), in the K order the fragments have: a
// lane holds columns 8t .. 8t + 7 of each 32, so step h (of two) of word i holds the column pairs
// 32i + 8t + 4h + {0,1} at logical k 2t and 32i + 8t + 4h + {2,3} at 2t + 8; the tile copies x in 4-byte
// pairs to those places (pair 4t + 2h + a of the 32 columns to logical pair 8h + 4a + t).
// RW = 0: each group's exact products go to per-group sums (the first step of a group overwrites them),
// drained as scale * sum into the accumulators after the group's products complete; RW = 1: the fragments
// are scaled before the product, which accumulates across groups.
// Stage (1024-byte aligned): the x tile (8*NT * 256 B), the 4 weight units (8 KB), the scales (256 B),
// rounded up to 1 KB; the launcher adds 1 KB of alignment slack (ops/w4_gemm.rs smem_bytes_wg).
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define W4W_BODY 1
#else
#define W4W_BODY 0
#endif

#if W4W_BODY
// d (64 x 8*NT f32, a warpgroup's accumulator layout: n8 block j of the warp's rows g, g + 8 at d[4j ..
// 4j + 3], as mma.sync's c fragments) += A (64 x 16, bf16 fragments in registers) * B (16 x 8*NT, K-major in
// shared memory); d is overwritten when `acc` is 0.
__device__ __forceinline__ void w4w_mma24(float* d, const u32 (&a)[4], unsigned long long db, int acc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %17, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n24k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11}, {%12, %13, %14, %15}, %16, p, 1, 1, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(acc));
}
__device__ __forceinline__ void w4w_mma32(float* d, const u32 (&a)[4], unsigned long long db, int acc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, {%16, %17, %18, %19}, %20, p, 1, 1, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(acc));
}
__device__ __forceinline__ void w4w_mma48(float* d, const u32 (&a)[4], unsigned long long db, int acc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %29, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n48k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23}, {%24, %25, %26, %27}, %28, p, 1, 1, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(acc));
}
__device__ __forceinline__ void w4w_mma64(float* d, const u32 (&a)[4], unsigned long long db, int acc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(acc));
}
template <int NT>
__device__ __forceinline__ void w4w_mma(float* d, const u32 (&a)[4], unsigned long long db, int acc) {
    if constexpr (NT == 3) w4w_mma24(d, a, db, acc);
    else if constexpr (NT == 4) w4w_mma32(d, a, db, acc);
    else if constexpr (NT == 6) w4w_mma48(d, a, db, acc);
    else w4w_mma64(d, a, db, acc);
}

// Keeps the compiler from moving reads of a warpgroup product's accumulators above the wait for it.
template <int NT>
__device__ __forceinline__ void w4w_fence_acc(float (&v)[2][NT][4]) {
#pragma unroll
    for (int a = 0; a < 2; ++a)
#pragma unroll
        for (int b = 0; b < NT; ++b)
#pragma unroll
            for (int c = 0; c < 4; ++c) asm volatile("" : "+f"(v[a][b][c])::"memory");
}

// Stages of w4w_body's ring: 6 for tiles of up to 32 tokens, 5 for 48, 4 for 64 (2 blocks an SM on sm_90:
// ops/w4_gemm.rs smem_bytes_wg).
template <int NT>
__host__ __device__ constexpr int w4w_stages() {
    return NT == 8 ? 4 : NT == 6 ? 5 : 6;
}

// Bytes of a stage of w4w_body's ring (1024-byte aligned).
template <int NT>
__host__ __device__ constexpr int w4w_stage_bytes() {
    return (NT * 8 * 256 + W4G_WBYTES + W4G_SBYTES + 1023) / 1024 * 1024;
}
#endif

// One block's tile (the arguments of w4g_body).
template <int NT, int RW>
__device__ __forceinline__ void w4w_body(const u32* __restrict__ qw, const unsigned short* __restrict__ scales,
                                         const unsigned char* __restrict__ zeros, int scale_bf16, const bf16_t* x,
                                         long long ldx, void* y, long long ldy, int M, int out, int in, int mode,
                                         int vec, int m0, int rb, int split, int splits) {
#if W4W_BODY
    // Ring stages (w4w_stages), refilled AHEAD groups ahead: RW = 0 waits for a group's products at its end
    // (its sums are drained there), so the previous group's stage is free at the next group (S - 1 ahead);
    // RW = 1 lets a group's last products run into the next group, whose refill then takes the stage of
    // two groups before (S - 2 ahead), except the 64-token tile (4 stages), which waits instead.
    constexpr int S = w4w_stages<NT>(), BM = 8 * NT;
    constexpr int AHEAD = (RW && S >= 5) ? S - 2 : S - 1;
    constexpr int XBYTES = BM * 256, STAGE = w4w_stage_bytes<NT>();
    extern __shared__ uint4 w4g_smem[];
    const u32 raw_s = smem_addr(w4g_smem);
    const u32 smem_s = (raw_s + 1023u) & ~1023u;
    const char* smem_c = (const char*)w4g_smem + (smem_s - raw_s);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int ng = in >> 7;
    const int gb = (int)((long long)split * ng / splits), ge = (int)((long long)(split + 1) * ng / splits);
    const int n = ge - gb;
    const int r0 = rb * 128 + warp * 32 + 4 * g;  // the lane's rows r0 .. r0 + 3
    const int rc = min(r0, out - 4);              // rows whose scales / zeros are loaded
    const int gstep = 4 * min(32, out - ((min(r0, out - 1) >> 5) << 5));
    const uint4* qw4 = (const uint4*)qw;
    u32 pw[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) pw[j] = (u32)w4_u4(min(r0 + j, out - 1), 4 * gb + t, out, ng);
    const int zstride = out >> 1;
    u32 zv[S];  // zeros: nibble j = row j
    auto issue_w = [&](int st, int rel, u32& z_out) {
        const u32 base = smem_s + st * STAGE + XBYTES + warp * 2048 + lane * 16;
#pragma unroll
        for (int j = 0; j < 4; ++j) cp_async16(base + j * 512, qw4 + (pw[j] + (u32)(gstep * rel)));
        const long long grp = gb + rel;
        if (t == 0)
            asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(smem_s + st * STAGE + XBYTES + W4G_WBYTES +
                                                                             warp * 64 + g * 8),
                         "l"(scales + grp * out + rc)
                         : "memory");
        z_out = zeros ? (u32)__ldg((const unsigned short*)(zeros + grp * zstride + (rc >> 1))) : 0x8888u;
    };
    // x: the thread copies column pair D (4 bytes) of token rows rt + 2c, c < BM / 2, to its logical pair
    // Lp of the tile (the header's K order); row r's swizzle depends on r & 7 = 2 (c & 3) + rt.
    const int D = tid & 63, rt = tid >> 6;
    const int Lp = 16 * (D >> 4) + 8 * ((D >> 1) & 1) + 4 * (D & 1) + ((D >> 2) & 3);
    // Row rt + 2c's swizzle: chunk ((Lp >> 2) & 7) ^ rt ^ 2 (c & 3), i.e. bits 5-6 of the offset XOR (c & 3) << 5.
    const u32 xsw = (u32)((Lp >> 5) * BM * 128 + rt * 128 + ((((Lp >> 2) & 7) ^ rt) << 4) + 4 * (Lp & 3));
    const bf16_t* xr = x + (long long)min(m0 + rt, M - 1) * ldx + (long long)gb * 128 + 2 * D;
    const long long xstep = 2 * ldx;
    const int nval = M - m0 - rt;  // rows rt + 2c of the tile are x's for 2c < nval
    const bool full = m0 + BM <= M;
    auto issue_x = [&](int st, int rel) {
        const bf16_t* p = xr + rel * 128;
        const u32 dst = smem_s + st * STAGE;
        if (full) {
#pragma unroll
            for (int c = 0; c < BM / 2; ++c) cp_async4(dst + (xsw ^ ((c & 3) << 5)) + 256 * c, p + c * xstep, 4);
        } else {
#pragma unroll
            for (int c = 0; c < BM / 2; ++c) {
                const bool ok = 2 * c < nval;
                cp_async4(dst + (xsw ^ ((c & 3) << 5)) + 256 * c, ok ? p + c * xstep : p, ok ? 4 : 0);
            }
        }
    };

    float acc[2][NT][4];
    w4g_zero<NT>(acc);
    float own[2][NT][4];  // RW = 0: a group's sums (its first product overwrites them)
    if constexpr (!RW) w4g_zero<NT>(own);
#pragma unroll
    for (int st = 0; st < AHEAD; ++st)
        if (st < n) issue_w(st, st, zv[st]);
    pdl_wait();
#pragma unroll
    for (int st = 0; st < AHEAD; ++st) {
        if (st < n) issue_x(st, st);
        cp_async_commit();
    }
    // The group's row scales (f32) from stage st.
    auto row_scales = [&](int st, float (&sc)[4]) {
        const uint2 sb = *(const uint2*)(smem_c + st * STAGE + XBYTES + W4G_WBYTES + warp * 64 + g * 8);
        const u32 bits[4] = {sb.x & 0xffffu, sb.x >> 16, sb.y & 0xffffu, sb.y >> 16};
#pragma unroll
        for (int j = 0; j < 4; ++j)
            sc[j] = scale_bf16 ? __uint_as_float(bits[j] << 16) : f16_to_f32((unsigned short)bits[j]);
    };
    // RW = 0: acc += scale * the sums of the group in stage st (its products complete).
    auto drain = [&](int st, float (&v)[2][NT][4]) {
        w4w_fence_acc<NT>(v);
        float sc[4];
        row_scales(st, sc);
#pragma unroll
        for (int a = 0; a < 2; ++a)
#pragma unroll
            for (int b = 0; b < NT; ++b)
#pragma unroll
                for (int c = 0; c < 4; ++c) acc[a][b][c] = fmaf(sc[2 * a + (c >> 1)], v[a][b][c], acc[a][b][c]);
    };
    for (int k0 = 0; k0 < n; k0 += S) {
#pragma unroll
        for (int u = 0; u < S; ++u) {
            const int k = k0 + u;
            if (k < n) {
                cp_async_wait<AHEAD - 1>();
                fence_proxy_async();  // this thread's copies of stage u, visible to the products' reads
                // With AHEAD = S - 1 the stage refilled below is the previous group's: its products first
                // (RW = 0 waited for them at the group's end).
                if constexpr (RW && AHEAD == S - 1) wg_wait0();
                __syncthreads();  // stage u complete for every thread; the stage refilled below is free
                const int sn = (u + AHEAD) % S;
                if (k + AHEAD < n) {
                    issue_w(sn, k + AHEAD, zv[sn]);
                    issue_x(sn, k + AHEAD);
                }
                cp_async_commit();
                const char* stc = smem_c + u * STAGE;
                const uint4* wst = (const uint4*)(stc + XBYTES + warp * 2048) + lane;
                const uint4 q0 = wst[0], q1 = wst[32], q2 = wst[64], q3 = wst[96];
                u32 nz[4];
#pragma unroll
                for (int j = 0; j < 4; ++j) nz[j] = 0x80008000u | ((0x4300u | ((zv[u] >> (4 * j)) & 15u)) * 0x10001u);
                u32 sh[4], sl[4];
                if constexpr (RW) {
                    float sc[4];
                    row_scales(u, sc);
#pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        sh[j] = pack_bf16(sc[j], sc[j]);
                        const float lo = sc[j] - __uint_as_float(sh[j] << 16);
                        sl[j] = pack_bf16(lo, lo);
                    }
                }
                float(&tmp)[2][NT][4] = *(RW ? &acc : &own);
                const u32 xs = smem_s + u * STAGE;
#pragma unroll
                for (int i = 0; i < 4; ++i) {
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
                        if constexpr (RW) {
#pragma unroll
                            for (int r = 0; r < 4; ++r)
#pragma unroll
                                for (int tl = 0; tl < 2; ++tl) {
                                    const int j = 2 * tl + (r & 1);
                                    a[tl][h][r] = w4g_scale(a[tl][h][r], sh[j], sl[j]);
                                }
                        }
                    }
                    wg_fence();
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        // k16 step 2i + h: column block i >> 1, 32 bytes a step inside its 128-byte rows.
                        const unsigned long long db = wg_desc(xs + (u32)((i >> 1) * BM * 128 + ((2 * i + h) & 3) * 32), 16, 1024);
#pragma unroll
                        for (int tl = 0; tl < 2; ++tl) w4w_mma<NT>(&tmp[tl][0][0], a[tl][h], db, RW || i > 0 || h > 0);
                    }
                    wg_commit();
                    // At most one word's products in flight: the fragments of the word before are free.
                    wg_wait1();
                }
                if constexpr (!RW) {
                    wg_wait0();
                    drain(u, own);
                }
            }
        }
    }
    wg_wait0();
    w4w_fence_acc<NT>(acc);
    cp_async_wait<0>();
    if (r0 >= out) return;  // out % 4 == 0: the lane's 4 rows are all in or all out
    w4g_store<NT>(acc, r0, m0, t, y, ldy, M, out, mode, vec, split);
#else
    __trap();
#endif
}
