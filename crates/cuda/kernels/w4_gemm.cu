// w4_gemm.cu — the int4-weight GEMM for steps of more rows than the decode GEMV takes (W4A16: 4-bit
// weights in the device format of w4a16.cu / src/w4.rs, bf16 activations), reading that format directly.
//
// Computes y[m, o] = sum_j x[m, j] * W[o, j] for m < M, o < out, f32 accumulation:
//   W[o, j] = (q[o, j] - zero[j/128, o]) * scale[j/128, o]   (j: device column; act-order weights take
//   x already gathered in device-column order, w4a16.cu's w4_permute_x)
// and writes y as bf16 or f32 (row stride ldy), or, split over K, f32 partial sums that w4g_reduce adds
// in split order (deterministic).
//
// Tiling: a block of W4G_WARPS = 4 warps owns 128 output rows (4 "pairs" of the format, one per warp)
// x 8*NT tokens (NT = 2, 3, 4, 6, 8: 16, 24, 32, 48, 64), and the groups gb .. ge of its K split. Per group of 128
// columns a stage of the cp.async ring (W4G_S stages) holds each warp's 2 KB weight unit (the lane
// (g, t) copies, and alone reads back, chunk t of rows 4g + j, j = 0..3, as the decode GEMV does) and
// the x tile [8*NT tokens][128 columns] bf16 shared by the warps (16-byte chunks swizzled so that the
// fragment loads below are conflict-free; tokens at or past M are zero-filled). Scales and zeros ride
// in registers W4G_S - 1 groups ahead (the group loop is unrolled by W4G_S).
// Per group and 16-column step a lane unpacks its 4 rows' words with one LOP3 per column pair
// (((w >> 4p) & 0x000f000f) | 0x43004300 = bf16 (128 + q0, 128 + q1)) and one bf16x2 FMA that
// subtracts 128 + zero exactly, giving A fragments of the integers q - z (rows 4g, 4g + 1 in tile 0,
// 4g + 2, 4g + 3 in tile 1; the K order inside a group is the format's, matched by the x fragment:
// lane (g, t) reads x[token g][32i + 8t .. 32i + 8t + 7] for word i as one 16-byte load). mma.sync
// m16n8k16 (bf16, f32 accumulation) sums the exact products per group into its own accumulators, and the
// group adds scale * sum to acc in f32 (the GEMV's accuracy: no rounding of the weights).
//
// Launch: grid (ceil(M / (8*NT)), the segments' ceil(out_i / 128) together, splits), block 128, dynamic
// smem W4G_S * (8 KB + 8*NT * 256 B); out % 4 == 0, in % 128 == 0, splits <= in / 128; x 16-byte aligned
// rows (ldx % 8 == 0); scales 8-byte aligned, zeros 2-byte aligned; qweight 16-byte aligned, out * in / 32 < 2^31.
// mode 0: bf16 y, mode 1: f32 y (vec != 0: y's rows 8-byte (bf16) / 16-byte (f32) aligned and ldy % 4
// == 0, 4 rows per store); mode 2: f32 partials ws[split][M][ldp] (16-byte aligned), segment i's at column
// col_i. w4g_reduce: grid (ceil(M * ldp / 4 / 256)), block 256.
// PDL: the first stages' weights, scales and zeros are issued before pdl_wait(); x after it (x is
// read through cp.async, L2-coherent). Arch: mma.sync bf16, cp.async, fma.rn.bf16x2: sm_80+.
// Tested by tests/w4_gemm.rs (host oracle src/w4.rs); bench in tests/bench_w4.rs (bench_w4_rows).

// The tile GEMM's device code (w4g_body) is w4_tile.cuh, which the module puts before this file.

// The "pair" GEMM (w4t_*): the decode GEMV's pair structure (w4a16.cu, w4p_body) for NT n-tiles of 8
// tokens. No block barrier in the main loop: every warp streams its own pair's 2 KB units (lane (g, t):
// chunk t of rows 4g + j, j = 0..3) into W4T_S register stages with non-allocating loads, the next
// group's while this one's MMAs run (as w4p_body does); x comes from global memory (L1 / L2: every
// warp of the SM reads the same columns) into registers one group ahead, each register reloaded right
// after its last use. Unpacking is one LOP3 per column pair into bf16 (128 + q0, 128 + q1), straight
// into the MMA; a third MMA with A = ones gives each token's sum X of x over the group, and the group
// adds s * (T - (128 + z) * X) per row and token (T: the MMA of 128 + q, exact integers times bf16 x,
// f32 accumulation).
// Blocks of W4T_WARPS warps: W4T_WARPS / wpt pairs, each over the groups of the block's K split
// (blockIdx.z of gridDim.z) in wpt parts (the warps' partial sums are added in part order in shared
// memory, w4_sum_parts); blockIdx.x: pairs, blockIdx.y: tiles of 8 * NT tokens. Warps of pairs past
// out (the last block) run on clamped rows and store nothing.
// Launch: grid (ceil(pairs / (W4T_WARPS / wpt)), ceil(M / (8 * NT)), splits), block W4T_WARPS * 32,
// dynamic smem W4T_WARPS * 2 KB (the parts' sums), at most 168 registers (3 blocks an SM); the limits
// of w4g_* (out % 4 == 0, in % 128 == 0, x rows 16-byte aligned); ASYM: zeros given (else symmetric,
// zero 8).
#define W4T_WARPS 4
#define W4T_S 2
#define W4T_SLOT_U4 128  // a warp's shared memory: its 2 KB of partial sums (w4_sum_parts)

template <int NT, bool ASYM>
__device__ __forceinline__ void w4t_body(const u32* __restrict__ qw, const unsigned short* __restrict__ scales,
                                         const unsigned char* __restrict__ zeros, int scale_bf16, const bf16_t* x,
                                         long long ldx, void* y, long long ldy, int M, int out, int in, int mode,
                                         int vec, int wpt, int block) {
    constexpr int S = W4T_S;
    extern __shared__ uint4 w4t_smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int pair = block * (W4T_WARPS / wpt) + warp / wpt, part = warp % wpt;
    const int m0 = blockIdx.y * 8 * NT;
    const int ng = in >> 7, splits = gridDim.z, split = blockIdx.z;
    const int sb = (int)((long long)split * ng / splits), se = (int)((long long)(split + 1) * ng / splits);
    const int gb = sb + part * (se - sb) / wpt, n = sb + (part + 1) * (se - sb) / wpt - gb;
    const int r0 = pair * 32 + 4 * g;        // the lane's rows r0 .. r0 + 3
    const int rc = max(0, min(r0, out - 4));  // rows whose scales / zeros are loaded
    const int gstep = 4 * min(32, out - ((min(r0, out - 1) >> 5) << 5));
    const uint4* qw4 = (const uint4*)qw;
    u32 pw[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) pw[j] = (u32)w4_u4(min(r0 + j, out - 1), 4 * gb + t, out, ng);
    const unsigned short* ps = scales + (long long)gb * out + rc;
    const unsigned char* pz = ASYM ? zeros + (long long)gb * (out >> 1) + (rc >> 1) : nullptr;
    uint4 wr[S][4];  // the stages: the lane's four uint4 of a unit
    uint2 sv[S];     // scale bits: x = rows 0 | 1 << 16, y = rows 2 | 3 << 16
    u32 zv[S];       // zeros: nibble j = row j
    auto issue = [&](int st, int rel) {
#pragma unroll
        for (int j = 0; j < 4; ++j) wr[st][j] = ld_nc_stream(qw4 + (pw[j] + (u32)(gstep * rel)));
        sv[st] = __ldg((const uint2*)(ps + (long long)rel * out));
        if (ASYM) zv[st] = __ldg((const unsigned short*)(pz + (long long)rel * (out >> 1)));
    };
#pragma unroll
    for (int st = 0; st < S - 1; ++st)
        if (st < n) issue(st, st);
    pdl_wait();  // x is the previous kernel's
    // x of token m0 + 8b + g (clamped to M - 1: tokens past M are computed, not stored), columns
    // 32i + 8t .. + 7 of each group for word i: uint4 4i from px[b] + 16 * group.
    const uint4* px[NT];
    uint4 xb[NT][4];
#pragma unroll
    for (int b = 0; b < NT; ++b) {
        px[b] = (const uint4*)(x + (long long)min(m0 + 8 * b + g, M - 1) * ldx) + t + 16 * gb;
#pragma unroll
        for (int i = 0; i < 4; ++i) xb[b][i] = n > 0 ? px[b][4 * i] : make_uint4(0u, 0u, 0u, 0u);
    }
    const u32 ones = 0x3f803f80u;
    float acc[2][NT][4];
    w4g_zero<NT>(acc);
    for (int k0 = 0; k0 < n; k0 += S) {
#pragma unroll
        for (int u = 0; u < S; ++u) {
            const int k = k0 + u;
            if (k < n) {
                const int sn = (u + S - 1) % S;
                if (k + S - 1 < n) issue(sn, u + S - 1);
                const uint4 w0 = wr[u][0], w1 = wr[u][1], w2 = wr[u][2], w3 = wr[u][3];
                const bool more = k + 1 < n;
                float tm[2][NT][4], xs[NT][4];
                w4g_zero<NT>(tm);
#pragma unroll
                for (int b = 0; b < NT; ++b)
#pragma unroll
                    for (int c = 0; c < 4; ++c) xs[b][c] = 0.f;
#pragma unroll
                for (int i = 0; i < 4; ++i) {  // word i of each row: columns 8i .. 8i + 7 of the lane's 32
                    const u32 a0 = u4_comp(w0, i), a1 = u4_comp(w1, i), a2 = u4_comp(w2, i), a3 = u4_comp(w3, i);
                    const u32 lo0[4] = {w4p_unpack(a0), w4p_unpack(a1), w4p_unpack(a0 >> 4), w4p_unpack(a1 >> 4)};
                    const u32 lo1[4] = {w4p_unpack(a2), w4p_unpack(a3), w4p_unpack(a2 >> 4), w4p_unpack(a3 >> 4)};
                    const u32 hi0[4] = {w4p_unpack(a0 >> 8), w4p_unpack(a1 >> 8), w4p_unpack(a0 >> 12),
                                        w4p_unpack(a1 >> 12)};
                    const u32 hi1[4] = {w4p_unpack(a2 >> 8), w4p_unpack(a3 >> 8), w4p_unpack(a2 >> 12),
                                        w4p_unpack(a3 >> 12)};
                    const u32 one4[4] = {ones, ones, ones, ones};
#pragma unroll
                    for (int b = 0; b < NT; ++b) {
                        const uint4 xv = xb[b][i];
                        mma_bf16(tm[0][b], lo0, xv.x, xv.y);
                        mma_bf16(tm[1][b], lo1, xv.x, xv.y);
                        mma_bf16(xs[b], one4, xv.x, xv.y);
                        mma_bf16(tm[0][b], hi0, xv.z, xv.w);
                        mma_bf16(tm[1][b], hi1, xv.z, xv.w);
                        mma_bf16(xs[b], one4, xv.z, xv.w);
                        if (more) xb[b][i] = px[b][16 * (u + 1) + 4 * i];
                    }
                }
                const uint2 sbits = sv[u];
                const u32 bits[4] = {sbits.x & 0xffffu, sbits.x >> 16, sbits.y & 0xffffu, sbits.y >> 16};
                float s[4], c[4];
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    s[j] = scale_bf16 ? __uint_as_float(bits[j] << 16) : f16_to_f32((unsigned short)bits[j]);
                    // -(128 + z) as f32: 128 = 0x43000000, one unit of the mantissa at bit 16.
                    const float zf = ASYM ? __uint_as_float(0x43000000u | (((zv[u] >> (4 * j)) & 15u) << 16)) : 136.f;
                    c[j] = -zf * s[j];
                }
#pragma unroll
                for (int a = 0; a < 2; ++a)
#pragma unroll
                    for (int b = 0; b < NT; ++b)
#pragma unroll
                        for (int e = 0; e < 4; ++e) {
                            const int j = 2 * a + (e >> 1);
                            acc[a][b][e] = fmaf(c[j], xs[b][e & 1], fmaf(s[j], tm[a][b][e], acc[a][b][e]));
                        }
            }
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) pw[j] += gstep * S;
        ps += (long long)S * out;
        if (ASYM) pz += (long long)S * (out >> 1);
#pragma unroll
        for (int b = 0; b < NT; ++b) px[b] += 16 * S;
    }
    if (!w4_sum_parts<2 * NT>(&acc[0][0][0], (float*)w4t_smem, W4T_SLOT_U4 * 4, wpt, warp, lane, part)) return;
    if (r0 >= out) return;  // out % 4 == 0: the lane's 4 rows are all in or all out
    w4g_store<NT>(acc, r0, m0, t, y, ldy, M, out, mode, vec, split);
}


// The tile and pair kernels take up to four linears sharing x (a layer's q/k/v, qkv/z/b/a, gate/up) as
// segments: segment i's blocks follow segment i - 1's (nb_i blocks; unused: 0); its qweight, scales, zeros, y,
// ldy and out. Split over K, the tile kernels write segment i's partial sums at column col_i (the outs before
// it) of ws[split][M][ldp] (ldp: every segment's outs together), which w4g_reduce adds into each y; a pair
// kernel split over K runs one segment.
#define W4T_SEG_ARGS(i)                                                                                        \
    const u32 *__restrict__ qw##i, const unsigned short *__restrict__ sc##i, const unsigned char *__restrict__ z##i, \
        void *y##i, long long ldy##i, int out##i, int nb##i
#define W4T_SEGS W4T_SEG_ARGS(0), W4T_SEG_ARGS(1), W4T_SEG_ARGS(2), W4T_SEG_ARGS(3)
#define W4T_SEG_VALS                                                                                       \
    qw0, sc0, z0, y0, ldy0, out0, nb0, qw1, sc1, z1, y1, ldy1, out1, nb1, qw2, sc2, z2, y2, ldy2, out2, nb2, qw3, sc3, \
        z3, y3, ldy3, out3, nb3
struct W4Seg {
    const u32* qw;
    const unsigned short* sc;
    const unsigned char* z;
    void* y;
    long long ldy;
    int out, b, col;  // the block's index inside its segment, the segment's first column
};
// The segment of block b (of the segments' blocks in order).
__device__ __forceinline__ W4Seg w4_seg(int b, W4T_SEGS) {
    W4Seg g = {qw0, sc0, z0, y0, ldy0, out0, b, 0};
    if (b >= nb0) {
        b -= nb0;
        if (b < nb1) {
            g = {qw1, sc1, z1, y1, ldy1, out1, b, out0};
        } else if (b < nb1 + nb2) {
            g = {qw2, sc2, z2, y2, ldy2, out2, b - nb1, out0 + out1};
        } else {
            g = {qw3, sc3, z3, y3, ldy3, out3, b - nb1 - nb2, out0 + out1 + out2};
        }
    }
    return g;
}

// w4g_<tokens per block>. Registers capped for the blocks a multiprocessor's shared memory holds at W4G_S
// = 4: 3 of 32 tokens or fewer (168), 2 of 48 or 64 (217 / 255 registers). On the H100 the 48-token tile
// is 0.85-0.99x the time of two 24-token tiles at 40-48 rows, and the 48- and 64-token tiles with exact
// per-group sums 0.90-0.96x those that round the weights to bf16 before the MMA (scaled fragments,
// accumulation across groups: which is what made them 1.04-2.1x faster than dequantised slices +
// cuBLASLt at 96-256 rows, bench/results/int4-64-token-tile-h100-2026-12-06.md):
// bench/results/int4-48-token-exact-tile-h100-2026-12-06.md. Blocks: blockIdx.y over the segments' row
// tiles of 128.
#define W4G_KERNEL(NAME, NT, BLOCKS)                                                                         \
    extern "C" __global__ void __launch_bounds__(W4G_WARPS * 32, BLOCKS)                                         \
        NAME(const bf16_t* x, long long ldx, int M, int in, int scale_bf16, int mode, int vec, float* ws,         \
             long long ldp, W4T_SEGS) {                                                                            \
        pdl_trigger();                                                                                           \
        const W4Seg g = w4_seg(blockIdx.y, W4T_SEG_VALS);                                                        \
        void* dst = mode == 2 ? (void*)(ws + g.col) : g.y;                                                       \
        w4g_body<NT>(g.qw, g.sc, g.z, scale_bf16, x, ldx, dst, mode == 2 ? ldp : g.ldy, M, g.out, in, mode, vec,  \
                     blockIdx.x * 8 * NT, g.b, blockIdx.z, gridDim.z);                                           \
    }
W4G_KERNEL(w4g_16, 2, 3)
W4G_KERNEL(w4g_24, 3, 3)
W4G_KERNEL(w4g_32, 4, 3)
W4G_KERNEL(w4g_48, 6, 2)
W4G_KERNEL(w4g_64, 8, 2)

// w4t_16<s symmetric | a zero points>. The segment picked inline (w4_seg here changes ptxas's schedule of the
// pair loop).
#define W4T_KERNEL(NAME, NT, ASYM)                                                                             \
    extern "C" __global__ void __launch_bounds__(W4T_WARPS * 32, 3)                                              \
        NAME(const bf16_t* x, long long ldx, int M, int in, int scale_bf16, int mode, int vec, int wpt,           \
             W4T_SEGS) {                                                                                         \
        pdl_trigger();                                                                                           \
        int b = blockIdx.x;                                                                                      \
        const u32* qw = qw0;                                                                                     \
        const unsigned short* sc = sc0;                                                                          \
        const unsigned char* z = z0;                                                                             \
        void* y = y0;                                                                                            \
        long long ldy = ldy0;                                                                                    \
        int out = out0;                                                                                          \
        if (b >= nb0) {                                                                                          \
            b -= nb0;                                                                                            \
            if (b < nb1) {                                                                                       \
                qw = qw1; sc = sc1; z = z1; y = y1; ldy = ldy1; out = out1;                                      \
            } else if (b < nb1 + nb2) {                                                                          \
                b -= nb1;                                                                                        \
                qw = qw2; sc = sc2; z = z2; y = y2; ldy = ldy2; out = out2;                                      \
            } else {                                                                                             \
                b -= nb1 + nb2;                                                                                  \
                qw = qw3; sc = sc3; z = z3; y = y3; ldy = ldy3; out = out3;                                      \
            }                                                                                                    \
        }                                                                                                        \
        w4t_body<NT, ASYM>(qw, sc, z, scale_bf16, x, ldx, y, ldy, M, out, in, mode, vec, wpt, b);                 \
    }
W4T_KERNEL(w4t_16s, 2, false)
W4T_KERNEL(w4t_16a, 2, true)

// y_i[m, o] (bf16, or f32 when f32_out) = sum over s < splits, in order, of ws[s][m][col_i + o] for the
// segments (the tile kernels' y_i, ldy_i, out_i; nb_i unused) of ldp columns together; 4 outputs per thread
// (out_i % 4 == 0; vec as for w4g_*).
extern "C" __global__ void __launch_bounds__(256)
w4g_reduce(const float* ws, int splits, int M, long long ldp, int f32_out, int vec, W4T_SEGS) {
    pdl_enter();
    const long long n4 = (long long)M * ldp / 4;
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n4) return;
    const long long e = 4 * i, m = e / ldp;
    int o = (int)(e - m * ldp);
    void* y = y0;
    long long ldy = ldy0;
    if (o >= out0) {
        o -= out0;
        if (o < out1) {
            y = y1; ldy = ldy1;
        } else if (o < out1 + out2) {
            o -= out1; y = y2; ldy = ldy2;
        } else {
            o -= out1 + out2; y = y3; ldy = ldy3;
        }
    }
    float4 v = *(const float4*)(ws + e);
    for (int s = 1; s < splits; ++s) {
        const float4 p = *(const float4*)(ws + (long long)s * M * ldp + e);
        v.x += p.x;
        v.y += p.y;
        v.z += p.z;
        v.w += p.w;
    }
    if (f32_out) {
        float* q = (float*)y + m * ldy + o;
        if (vec) {
            *(float4*)q = v;
        } else {
            q[0] = v.x;
            q[1] = v.y;
            q[2] = v.z;
            q[3] = v.w;
        }
    } else {
        bf16_t* q = (bf16_t*)y + m * ldy + o;
        const u32 lo = pack_bf16(v.x, v.y), hi = pack_bf16(v.z, v.w);
        if (vec) {
            *(uint2*)q = make_uint2(lo, hi);
        } else {
            q[0] = (bf16_t)lo;
            q[1] = (bf16_t)(lo >> 16);
            q[2] = (bf16_t)hi;
            q[3] = (bf16_t)(hi >> 16);
        }
    }
}
