// w4a16.cu — 4-bit weights, bf16 activations (W4A16): decode GEMV, dequantisation, quantisation.
//
// Device format of one linear W [out, in] (in % 128 == 0; NG = in/128 groups of 128 "device
// columns"; host side and tests in src/w4.rs):
//   qweight u32 [out, in/8], row-major by output row: word j of row o holds device columns
//           8j..8j+7; column 8j+c is nibble (c & 1)*4 + (c >> 1) (nibbles hold columns
//           0,2,4,6,1,3,5,7), so (word >> 4p) & 0x000f000f = columns (2p, 2p+1) in the two halves.
//   scales  u16 [NG, out] (group-major): fp16 bits, or bf16 bits when scale_bf16 != 0.
//   zeros   u8  [NG, ceil(out/2)]: zero of (g, o) = nibble (o & 1) of byte g*ceil(out/2) + o/2;
//           NULL = symmetric, zero 8.
//   perm    i32 [in] (act-order checkpoints only): device column j holds input feature perm[j].
//   W[o, perm[j]] = (q[o, j] - zero[j/128, o]) * scale[j/128, o]   (f32)
//
// Computes:
//  w4_permute_x: xo[m, j] = x[m, perm[j]]  (the GEMV's x for act-order weights; xo row stride in)
//  w4p_*:        the same for up to four linears sharing x in one launch (the default GEMV: the
//                "pair" kernel, described above its code; bf16 or f32 y), and the older variants
//  w4_gemv_*:    y[m, o] = bf16(sum_j x[m, j] * W[o, j]), m < M <= 8, f32 accumulation
//                (w4_gemv_reg_f32: y in f32), kept as benchmark baselines.
//  w4_dequant:   dst[r - r0, perm[j]] = bf16(W[r, perm[j]]) for rows r0 <= r < r1 (prefill path:
//                an N-slice of bf16 weights for cuBLASLt).
//  w4_quantize:  rows r0..r1 of a bf16 W (staging buffer, row r at w + (r - r0)*ldw) -> the format,
//                round to nearest even, per (row, group of 128):
//                  sym:  s = fp16(min(max|w|/7, 65504)), q = clamp(rint(w/s), -8, 7) + 8
//                  asym: lo = min(min w, 0), hi = max(max w, 0), s = fp16(min((hi-lo)/15, 65504)),
//                        z = clamp(rint(-lo/s), 0, 15), q = clamp(rint(w/s) + z, 0, 15)
//                  s == 0: q = z (8 sym, 0 asym). Bit-equal to W4Linear::quantize (src/w4.rs).
//
// Method (w4_gemv_*): tensor cores with the tokens as the n = 8 columns of mma.sync m16n8k16
//   (bf16 x bf16 -> f32). A warp owns 16 output rows (a "tile") and a contiguous range of groups;
//   lane (g = lane/4, t = lane%4) takes 16 bytes (32 columns) of rows g and g+8 per group.
//   Unpacking is two integer ops per column pair: ((w >> 4p) & 0x000f000f) | 0x43004300 is the
//   bf16 pair (128 + q0, 128 + q1), and one fma.bf16x2 subtracts (128 + zero) exactly, leaving the
//   integers q - zero as the A fragment. The lane's 32 columns are the A/B fragments of 8 MMAs
//   under a fixed permutation of k (the same for A and for x, which lane (g, t) reads for token g,
//   64 bytes per group, from global/L1). Each group's 8 MMAs accumulate into a fresh f32 tile that
//   is scaled by the group's scale (integer weights times bf16 x: the products are exact in f32).
//   `wpt` warps split one tile's groups (split-K inside the block), summed in shared memory in a
//   fixed order, so a token's result does not depend on M. Variants (same results up to the f32
//   summation order of the split):
//   - w4_gemv_reg: W4_D groups of weights/scales/zeros in flight in registers (16-byte
//     non-allocating loads);
//   - w4_gemv_cp4 / w4_gemv_cp8: a per-warp ring of 4 / 8 stages in shared memory filled with
//     cp.async (weights, scale and zero words), 3 / 7 groups in flight tracked by commit groups;
//     each lane copies and reads back only its own slots (no barrier); x one group ahead in
//     registers.
//
// Launch:
//  w4_permute_x: grid (ceil(M*in/256)), block 256.
//  w4_gemv_*:    grid (ceil(ceil(out/16) / (8/wpt))), block 256 (8 warps), wpt in {1,2,4,8};
//                x 16-byte aligned with ldx % 8 == 0, scales and zeros 4-byte aligned; reg: static
//                smem 4 KB; cp4 / cp8: dynamic smem 48 / 96 KB (8 warps x stages x 1.5 KB).
//  w4p_*:        grid (sum over the linears of ceil(ceil(out/32) / (8/wpt))), block 256, dynamic smem
//                64 KB (8 warps x 4 stages x 2 KB); scales 8-byte aligned.
//  w4_dequant:   grid (ceil((r1-r0)*in/32 / 256)) (grid-stride; per word with perm), block 256; dst
//                16-byte aligned, ldd % 8 == 0 (without perm); (r1-r0)*in/8 < 2^31.
//  w4_quantize:  grid (ceil(ceil((r1-r0)/2) * NG / 8)), block 256: one warp per (row pair, group);
//                r0 even, r1 even or r1 == out.
// Arch: mma.sync bf16, fma.rn.bf16x2, cp.async, cvt f16, ld.global.nc: sm_80+ (nothing Hopper-only).
// Tested by: tests/ops.rs cases "w4_gemv", "w4_gemv_multi", "w4_dequant", "w4_quantize"; bench in
// tests/bench_w4.rs.

#define W4_WARPS 8
#define W4_D 4

__device__ __forceinline__ float w4_scale(unsigned short s, int scale_bf16) {
    return scale_bf16 ? bf2f(s) : f16_to_f32(s);
}

__device__ __forceinline__ u32 w4_zero(const unsigned char* zeros, int zstride, int g, int o) {
    return zeros ? ((u32)(zeros[(long long)g * zstride + (o >> 1)] >> ((o & 1) * 4)) & 15u) : 8u;
}

// bf16x2 of -(128 + z) in both halves (exact: 128..143 has 8 significant bits).
__device__ __forceinline__ u32 w4_negz2(u32 z) {
    u32 b = (u32)f2bf(-(128.0f + (float)z));
    return b | (b << 16);
}

// Columns (2p, 2p+1) of word w as the bf16 pair (q0 - z, q1 - z).
__device__ __forceinline__ u32 w4_pair(u32 w, int p, u32 negz2) {
    u32 v = ((w >> (4 * p)) & 0x000f000fu) | 0x43004300u;
    u32 r;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(v), "r"(0x3f803f80u), "r"(negz2));
    return r;
}

extern "C" __global__ void w4_permute_x(const bf16_t* __restrict__ x, long long ldx, const int* __restrict__ perm,
                                        bf16_t* __restrict__ xo, int M, int in) {
    long long n = (long long)M * in;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        long long m = i / in;
        int j = (int)(i - m * in);
        xo[i] = x[m * ldx + perm[j]];
    }
}

// The 8 MMAs of one group: A = rows (a, b) of the lane's 32 columns (ca, cb), B = x (xv).
__device__ __forceinline__ void w4_group_mma(float* tmp, const uint4& ca, const uint4& cb, u32 nza, u32 nzb,
                                             const uint4* xv) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const u32 aw = u4_comp(ca, j >> 1), bw = u4_comp(cb, j >> 1);
        const int p = (j & 1) * 2;
        mma_bf16(tmp, w4_pair(aw, p, nza), w4_pair(bw, p, nzb), w4_pair(aw, p + 1, nza), w4_pair(bw, p + 1, nzb),
               u4_comp(xv[j >> 1], p), u4_comp(xv[j >> 1], p + 1));
    }
}

// Sums the wpt partial results (warp w writes its NT*128 partials at red + w * red_stride, a region
// no other warp touches) and stores the outputs of NT 16-row tiles: fragment value c (0..3) of tile
// i is output row rows[2i + (c >> 1)] (rows[] per lane; < 0: not stored), token 2t + (c & 1).
// Contains __syncthreads() when wpt > 1.
__device__ __forceinline__ void w4_put(bf16_t* p, float v) { *p = f2bf(v); }
__device__ __forceinline__ void w4_put(float* p, float v) { *p = v; }
template <int NT, typename OutT>
__device__ __forceinline__ void w4_gemv_store(float* acc, float* red, int red_stride, int wpt, int warp, int lane,
                                              int part, const int* rows, int M, OutT* __restrict__ y,
                                              long long ldy) {
    if (wpt > 1) {
#pragma unroll
        for (int c = 0; c < 4 * NT; ++c) red[warp * red_stride + c * 32 + lane] = acc[c];
        __syncthreads();
        if (part != 0) return;
#pragma unroll
        for (int c = 0; c < 4 * NT; ++c) {
            float s = 0.f;
            for (int w = 0; w < wpt; ++w) s += red[(warp + w) * red_stride + c * 32 + lane];
            acc[c] = s;
        }
    }
    const int t = lane & 3;
#pragma unroll
    for (int c = 0; c < 4 * NT; ++c) {
        const int row = rows[c >> 1], m = 2 * t + (c & 1);
        if (row >= 0 && m < M) w4_put(y + (long long)m * ldy + row, acc[c]);
    }
}

// The rows of a 16-row tile's fragment values for w4_gemv_store (rows past `out`: -1).
__device__ __forceinline__ void w4_tile_rows(int* rows, int tile, int lane, int out) {
    const int ra = tile * 16 + (lane >> 2), rb = ra + 8;
    rows[0] = ra < out ? ra : -1;
    rows[1] = rb < out ? rb : -1;
}

// Variant "reg": W4_D groups of weights, scales and zeros in flight in registers.
// (OutT = float: the f32-output variant, for int4 lm_head logits.)
template <typename OutT>
__device__ __forceinline__ void w4_gemv_reg_body(const u32* __restrict__ qw, const unsigned short* __restrict__ scales,
                                                 const unsigned char* __restrict__ zeros, int scale_bf16,
                                                 const bf16_t* __restrict__ x, long long ldx, OutT* __restrict__ y,
                                                 long long ldy, int M, int out, int in, int wpt, float* red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int tile = blockIdx.x * (W4_WARPS / wpt) + warp / wpt;
    const int part = warp % wpt;
    const int ng = in >> 7;
    const int gb = (int)((long long)part * ng / wpt), ge = (int)((long long)(part + 1) * ng / wpt);
    const int ra = min(tile * 16 + g, out - 1), rb = min(tile * 16 + g + 8, out - 1);  // loads; stores check
    const long long wrow = (long long)(in >> 5);                                      // uint4 per row
    const uint4* pa = (const uint4*)qw + (long long)ra * wrow + t;                    // group i: + 4i
    const uint4* pb = (const uint4*)qw + (long long)rb * wrow + t;
    const int zstride = (out + 1) >> 1;
    const bool has_x = g < M;
    const uint4* px = (const uint4*)(x + (long long)(has_x ? g : 0) * ldx) + t * 4;  // group i: + 16i

    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    uint4 wa[W4_D], wb[W4_D];
    u32 sab[W4_D], zab[W4_D];  // scale bits (a | b << 16), zeros (a | b << 8)
#pragma unroll
    for (int d = 0; d < W4_D; ++d) {
        const int gi = gb + d;
        if (gi < ge) {
            wa[d] = ld_nc_stream(pa + 4 * gi);
            wb[d] = ld_nc_stream(pb + 4 * gi);
            sab[d] = (u32)scales[(long long)gi * out + ra] | ((u32)scales[(long long)gi * out + rb] << 16);
            zab[d] = w4_zero(zeros, zstride, gi, ra) | (w4_zero(zeros, zstride, gi, rb) << 8);
        }
    }
    for (int gs = gb; gs < ge; gs += W4_D) {
#pragma unroll
        for (int d = 0; d < W4_D; ++d) {
            const int gi = gs + d;
            if (gi < ge) {
                uint4 xv[4];
#pragma unroll
                for (int q = 0; q < 4; ++q) xv[q] = has_x ? ld_nc(px + 16 * gi + q) : make_uint4(0u, 0u, 0u, 0u);
                const uint4 ca = wa[d], cb = wb[d];
                const u32 cs = sab[d], cz = zab[d];
                const int gn = gi + W4_D;
                if (gn < ge) {
                    wa[d] = ld_nc_stream(pa + 4 * gn);
                    wb[d] = ld_nc_stream(pb + 4 * gn);
                    sab[d] = (u32)scales[(long long)gn * out + ra] | ((u32)scales[(long long)gn * out + rb] << 16);
                    zab[d] = w4_zero(zeros, zstride, gn, ra) | (w4_zero(zeros, zstride, gn, rb) << 8);
                }
                float tmp[4] = {0.f, 0.f, 0.f, 0.f};
                w4_group_mma(tmp, ca, cb, w4_negz2(cz & 0xffu), w4_negz2(cz >> 8), xv);
                const float sa = w4_scale((unsigned short)(cs & 0xffffu), scale_bf16);
                const float sb = w4_scale((unsigned short)(cs >> 16), scale_bf16);
                acc[0] += sa * tmp[0];
                acc[1] += sa * tmp[1];
                acc[2] += sb * tmp[2];
                acc[3] += sb * tmp[3];
            }
        }
    }
    int rows[2];
    w4_tile_rows(rows, tile, lane, out);
    w4_gemv_store<1>(acc, red, 128, wpt, warp, lane, part, rows, M, y, ldy);
}

extern "C" __global__ void __launch_bounds__(W4_WARPS * 32, 2)
w4_gemv_reg(const u32* __restrict__ qw, const unsigned short* __restrict__ scales,
            const unsigned char* __restrict__ zeros, int scale_bf16, const bf16_t* __restrict__ x, long long ldx,
            bf16_t* __restrict__ y, long long ldy, int M, int out, int in, int wpt) {
    __shared__ float red[W4_WARPS * 128];
    w4_gemv_reg_body<bf16_t>(qw, scales, zeros, scale_bf16, x, ldx, y, ldy, M, out, in, wpt, red);
}

// y in f32 (logits of an int4 lm_head); otherwise w4_gemv_reg.
extern "C" __global__ void __launch_bounds__(W4_WARPS * 32, 2)
w4_gemv_reg_f32(const u32* __restrict__ qw, const unsigned short* __restrict__ scales,
                const unsigned char* __restrict__ zeros, int scale_bf16, const bf16_t* __restrict__ x, long long ldx,
                float* __restrict__ y, long long ldy, int M, int out, int in, int wpt) {
    __shared__ float red[W4_WARPS * 128];
    w4_gemv_reg_body<float>(qw, scales, zeros, scale_bf16, x, ldx, y, ldy, M, out, in, wpt, red);
}


// Variant "async": the weights, scales and zeros of S groups stream through a per-warp ring in
// shared memory with cp.async (S - 1 groups in flight, tracked by commit groups); each lane copies
// and reads back only its own slots, so no barrier is needed. x (L2-resident) is loaded into
// registers one group ahead. Ring per warp and stage: 2 x 32 uint4 of weights (rows a, b), 32 uint4
// of {scale word a, scale word b, zero word a, zero word b}: 1.5 KB.
#define W4_STAGE_U4 96
template <int S>
__device__ __forceinline__ void w4_gemv_async(const u32* __restrict__ qw, const unsigned short* __restrict__ scales,
                                              const unsigned char* __restrict__ zeros, int scale_bf16,
                                              const bf16_t* __restrict__ x, long long ldx, bf16_t* __restrict__ y,
                                              long long ldy, int M, int out, int in, int wpt, uint4* smem) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int tile = blockIdx.x * (W4_WARPS / wpt) + warp / wpt;
    const int part = warp % wpt;
    const int ng = in >> 7;
    const int gb = (int)((long long)part * ng / wpt), ge = (int)((long long)(part + 1) * ng / wpt);
    const int ra = min(tile * 16 + g, out - 1), rb = min(tile * 16 + g + 8, out - 1);
    const long long wrow = (long long)(in >> 5);
    const uint4* pa = (const uint4*)qw + (long long)ra * wrow + t;
    const uint4* pb = (const uint4*)qw + (long long)rb * wrow + t;
    const int zstride = (out + 1) >> 1;
    const long long n_scales = (long long)ng * out, n_zeros = (long long)ng * zstride;
    const bool has_x = g < M;
    const uint4* px = (const uint4*)(x + (long long)(has_x ? g : 0) * ldx) + t * 4;
    uint4* ring = smem + warp * (S * W4_STAGE_U4);
    const u32 ring_s = smem_addr(ring);

    auto issue = [&](int st, int gi) {
        const u32 base = ring_s + (u32)(st * W4_STAGE_U4 * 16);
        cp_async16(base + lane * 16, pa + 4 * gi);
        cp_async16(base + (32 + lane) * 16, pb + 4 * gi);
        const u32 sz = base + (64 + lane) * 16;
        const long long ea = ((long long)gi * out + ra) & ~1LL, eb = ((long long)gi * out + rb) & ~1LL;
        cp_async4(sz, scales + ea, (int)min(4LL, 2 * (n_scales - ea)));
        cp_async4(sz + 4, scales + eb, (int)min(4LL, 2 * (n_scales - eb)));
        if (zeros) {
            const long long za = ((long long)gi * zstride + (ra >> 1)) & ~3LL;
            const long long zb = ((long long)gi * zstride + (rb >> 1)) & ~3LL;
            cp_async4(sz + 8, zeros + za, (int)min(4LL, n_zeros - za));
            cp_async4(sz + 12, zeros + zb, (int)min(4LL, n_zeros - zb));
        }
    };

    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    uint4 xc[4], xn[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        xc[q] = (has_x && gb < ge) ? ld_nc(px + 16 * gb + q) : make_uint4(0u, 0u, 0u, 0u);
        xn[q] = make_uint4(0u, 0u, 0u, 0u);
    }
#pragma unroll
    for (int s = 0; s < S - 1; ++s) {
        if (gb + s < ge) issue(s, gb + s);
        cp_async_commit();
    }
    for (int gi = gb; gi < ge; ++gi) {
        const int k = gi - gb;
        if (gi + S - 1 < ge) issue((k + S - 1) & (S - 1), gi + S - 1);
        cp_async_commit();
        if (has_x && gi + 1 < ge) {
#pragma unroll
            for (int q = 0; q < 4; ++q) xn[q] = ld_nc(px + 16 * (gi + 1) + q);
        }
        cp_async_wait<S - 1>();
        const uint4* st = ring + (k & (S - 1)) * W4_STAGE_U4;
        const uint4 ca = st[lane], cb = st[32 + lane], sz = st[64 + lane];
        const long long ea = (long long)gi * out + ra, eb = (long long)gi * out + rb;
        const unsigned short sa16 = (unsigned short)(sz.x >> ((ea & 1) * 16));
        const unsigned short sb16 = (unsigned short)(sz.y >> ((eb & 1) * 16));
        u32 za = 8u, zb = 8u;
        if (zeros) {
            const long long ya = (long long)gi * zstride + (ra >> 1), yb = (long long)gi * zstride + (rb >> 1);
            za = (sz.z >> (8 * (ya & 3) + 4 * (ra & 1))) & 15u;
            zb = (sz.w >> (8 * (yb & 3) + 4 * (rb & 1))) & 15u;
        }
        float tmp[4] = {0.f, 0.f, 0.f, 0.f};
        w4_group_mma(tmp, ca, cb, w4_negz2(za), w4_negz2(zb), xc);
        const float sa = w4_scale(sa16, scale_bf16), sb = w4_scale(sb16, scale_bf16);
        acc[0] += sa * tmp[0];
        acc[1] += sa * tmp[1];
        acc[2] += sb * tmp[2];
        acc[3] += sb * tmp[3];
#pragma unroll
        for (int q = 0; q < 4; ++q) xc[q] = xn[q];
    }
    cp_async_wait<0>();
    // Partials go into this warp's own ring (its copies are drained), summed after a barrier.
    int rows[2];
    w4_tile_rows(rows, tile, lane, out);
    w4_gemv_store<1>(acc, (float*)smem, S * W4_STAGE_U4 * 4, wpt, warp, lane, part, rows, M, y, ldy);
}

extern "C" __global__ void __launch_bounds__(W4_WARPS * 32, 3)
w4_gemv_cp4(const u32* __restrict__ qw, const unsigned short* __restrict__ scales,
            const unsigned char* __restrict__ zeros, int scale_bf16, const bf16_t* __restrict__ x, long long ldx,
            bf16_t* __restrict__ y, long long ldy, int M, int out, int in, int wpt) {
    extern __shared__ uint4 w4_dyn[];
    w4_gemv_async<4>(qw, scales, zeros, scale_bf16, x, ldx, y, ldy, M, out, in, wpt, w4_dyn);
}

extern "C" __global__ void __launch_bounds__(W4_WARPS * 32, 2)
w4_gemv_cp8(const u32* __restrict__ qw, const unsigned short* __restrict__ scales,
            const unsigned char* __restrict__ zeros, int scale_bf16, const bf16_t* __restrict__ x, long long ldx,
            bf16_t* __restrict__ y, long long ldy, int M, int out, int in, int wpt) {
    extern __shared__ uint4 w4_dyn[];
    w4_gemv_async<8>(qw, scales, zeros, scale_bf16, x, ldx, y, ldy, M, out, in, wpt, w4_dyn);
}

// Variant "pair" (w4p_*): a warp streams two 16-row tiles (32 output rows) through a cp.async ring
// and spends ~90 instructions per KB of weights (cp4: ~340):
//  - lane (g, t) owns the 4 consecutive rows rb + j (rb = 32*pair + 4g, j = 0..3) as MMA rows g
//    (j = 0), g + 8 (j = 1) of tile 0 and g, g + 8 of tile 1 (j = 2, 3); their 4 scales are one 8-byte
//    load, their zeros one 2-byte load (out % 4 == 0, VEC; otherwise one load per row);
//  - unpacking is one LOP3 per column pair, ((w >> 4p) & 0x000f000f) | 0x43004300 = bf16 (128 + q0,
//    128 + q1), straight into the MMA (no zero subtraction per weight);
//  - a third MMA with A = ones gives each token's sum of x over the group, X, and the group adds
//    s * (T - (128 + z) * X) per row and token (T: the MMA of 128 + q; exact integers times bf16 x).
// The weights of S = 4 groups (2 KB each) stream through a per-warp ring (3 in flight); scales and
// zeros ride in registers 3 groups ahead; x one group ahead. The group loop is unrolled by S, so
// stages and register slots are compile-time.
#define W4P_S 4
#define W4P_STAGE_U4 128

template <bool SBF>
__device__ __forceinline__ float w4p_scale(u32 bits) {
    return SBF ? __uint_as_float(bits << 16) : f16_to_f32((unsigned short)bits);
}

// bf16 pair (128 + q0, 128 + q1) of the column pair in nibbles (p, p + 4) of w (after w >> 4p).
__device__ __forceinline__ u32 w4p_unpack(u32 w) {
    u32 r;
    asm("lop3.b32 %0, %1, %2, %3, 0xea;" : "=r"(r) : "r"(w), "r"(0x000f000fu), "r"(0x43004300u));
    return r;
}

template <typename OutT, bool ASYM, bool SBF, bool VEC>
__device__ __forceinline__ void w4p_body(const u32* __restrict__ qw, const unsigned short* __restrict__ scales,
                                         const unsigned char* __restrict__ zeros, const bf16_t* __restrict__ x,
                                         long long ldx, OutT* __restrict__ y, long long ldy, int M, int out, int in,
                                         int wpt, int block, uint4* smem) {
    constexpr int S = W4P_S;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int pair = block * (W4_WARPS / wpt) + warp / wpt;
    const int part = warp % wpt;
    const int ng = in >> 7;
    const int gb = (int)((long long)part * ng / wpt), ge = (int)((long long)(part + 1) * ng / wpt);
    const int n = ge - gb;
    const int r0 = pair * 32 + 4 * g;  // this lane's rows r0 .. r0 + 3
    const int rv = min(r0, out - 4);  // VEC (out % 4 == 0): the 4 rows whose scales / zeros are loaded
    const long long wrow = (long long)(in >> 5);  // uint4 per row
    const uint4* pw[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) pw[j] = (const uint4*)qw + (long long)min(r0 + j, out - 1) * wrow + t + 4 * gb;
    const int zstride = (out + 1) >> 1;
    // Scales / zeros of the next group to issue (advanced by one group per issue).
    const unsigned short* ps = scales + (long long)gb * out;
    const unsigned char* pz = ASYM ? zeros + (long long)gb * zstride : nullptr;
    const bool has_x = g < M;
    const uint4* px = (const uint4*)(x + (long long)(has_x ? g : 0) * ldx) + t * 4 + 16 * gb;
    const u32 ring_s = smem_addr(smem + warp * (S * W4P_STAGE_U4));
    const uint4* ring = smem + warp * (S * W4P_STAGE_U4);

    uint2 sv[S];  // scale bits: x = rows 0 | 1 << 16, y = rows 2 | 3 << 16
    u32 zv[S];    // zeros: nibble j = row j
    // Issues group rel (relative to the group that pw/px point at) into stage st; scales / zeros
    // from ps / pz, which then advance.
    auto issue = [&](int st, int rel, uint2& s_out, u32& z_out) {
        const u32 base = ring_s + (u32)(st * W4P_STAGE_U4 * 16) + lane * 16;
#pragma unroll
        for (int j = 0; j < 4; ++j) cp_async16(base + j * 512, pw[j] + 4 * rel);
        if (VEC) {
            s_out = __ldg((const uint2*)(ps + rv));
        } else {
            const u32 a = __ldg(ps + min(r0, out - 1)), b = __ldg(ps + min(r0 + 1, out - 1));
            const u32 c = __ldg(ps + min(r0 + 2, out - 1)), d = __ldg(ps + min(r0 + 3, out - 1));
            s_out = make_uint2(a | (b << 16), c | (d << 16));
        }
        ps += out;
        if (ASYM) {
            if (VEC) {
                z_out = __ldg((const unsigned short*)(pz + (rv >> 1)));
            } else {
                u32 z = 0;
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const int r = min(r0 + j, out - 1);
                    z |= ((u32)(__ldg(pz + (r >> 1)) >> (4 * (r & 1))) & 15u) << (4 * j);
                }
                z_out = z;
            }
            pz += zstride;
        }
    };

    float acc[8];
#pragma unroll
    for (int c = 0; c < 8; ++c) acc[c] = 0.f;
    uint4 xb[2][4];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        xb[0][q] = (has_x && n > 0) ? ld_nc(px + q) : make_uint4(0u, 0u, 0u, 0u);
        xb[1][q] = make_uint4(0u, 0u, 0u, 0u);
    }
#pragma unroll
    for (int st = 0; st < S - 1; ++st) {
        if (st < n) issue(st, st, sv[st], zv[st]);
        cp_async_commit();
    }
    const u32 ones = 0x3f803f80u;
    for (int k0 = 0; k0 < n; k0 += S) {
#pragma unroll
        for (int u = 0; u < S; ++u) {
            const int k = k0 + u;
            if (k < n) {
                const int sn = (u + S - 1) % S;
                if (k + S - 1 < n) issue(sn, u + S - 1, sv[sn], zv[sn]);
                cp_async_commit();
                if (has_x && k + 1 < n) {
#pragma unroll
                    for (int q = 0; q < 4; ++q) xb[(u + 1) & 1][q] = ld_nc(px + 16 * (u + 1) + q);
                }
                cp_async_wait<S - 1>();
                const uint4* st = ring + u * W4P_STAGE_U4 + lane;
                const uint4 w0 = st[0], w1 = st[32], w2 = st[64], w3 = st[96];
                const uint4* xv = xb[u & 1];
                float t0[4] = {0.f, 0.f, 0.f, 0.f}, t1[4] = {0.f, 0.f, 0.f, 0.f}, xs[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
                for (int i = 0; i < 4; ++i) {  // word i of each row: columns 8i .. 8i + 7 of the lane's 32
                    const u32 a0 = u4_comp(w0, i), a1 = u4_comp(w1, i), a2 = u4_comp(w2, i), a3 = u4_comp(w3, i);
                    const u32 b0 = u4_comp(xv[i], 0), b1 = u4_comp(xv[i], 1), b2 = u4_comp(xv[i], 2),
                              b3 = u4_comp(xv[i], 3);
                    mma_bf16(t0, w4p_unpack(a0), w4p_unpack(a1), w4p_unpack(a0 >> 4), w4p_unpack(a1 >> 4), b0, b1);
                    mma_bf16(t1, w4p_unpack(a2), w4p_unpack(a3), w4p_unpack(a2 >> 4), w4p_unpack(a3 >> 4), b0, b1);
                    mma_bf16(xs, ones, ones, ones, ones, b0, b1);
                    mma_bf16(t0, w4p_unpack(a0 >> 8), w4p_unpack(a1 >> 8), w4p_unpack(a0 >> 12), w4p_unpack(a1 >> 12),
                             b2, b3);
                    mma_bf16(t1, w4p_unpack(a2 >> 8), w4p_unpack(a3 >> 8), w4p_unpack(a2 >> 12), w4p_unpack(a3 >> 12),
                             b2, b3);
                    mma_bf16(xs, ones, ones, ones, ones, b2, b3);
                }
                const uint2 sb = sv[u];
                float s[4] = {w4p_scale<SBF>(sb.x & 0xffffu), w4p_scale<SBF>(sb.x >> 16),
                              w4p_scale<SBF>(sb.y & 0xffffu), w4p_scale<SBF>(sb.y >> 16)};
                float c[4];
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    // -(128 + z) as f32: 128 = 0x43000000, one unit of the mantissa at bit 16.
                    const float zf = ASYM ? __uint_as_float(0x43000000u | (((zv[u] >> (4 * j)) & 15u) << 16)) : 136.f;
                    c[j] = -zf * s[j];
                }
                acc[0] = fmaf(c[0], xs[0], fmaf(s[0], t0[0], acc[0]));
                acc[1] = fmaf(c[0], xs[1], fmaf(s[0], t0[1], acc[1]));
                acc[2] = fmaf(c[1], xs[0], fmaf(s[1], t0[2], acc[2]));
                acc[3] = fmaf(c[1], xs[1], fmaf(s[1], t0[3], acc[3]));
                acc[4] = fmaf(c[2], xs[0], fmaf(s[2], t1[0], acc[4]));
                acc[5] = fmaf(c[2], xs[1], fmaf(s[2], t1[1], acc[5]));
                acc[6] = fmaf(c[3], xs[0], fmaf(s[3], t1[2], acc[6]));
                acc[7] = fmaf(c[3], xs[1], fmaf(s[3], t1[3], acc[7]));
            }
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) pw[j] += 4 * S;
        px += 16 * S;
    }
    cp_async_wait<0>();
    // Rows of the fragment values: tile 0 rows g, g + 8 = r0, r0 + 1; tile 1: r0 + 2, r0 + 3.
    int rows[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) rows[j] = r0 + j < out ? r0 + j : -1;
    w4_gemv_store<2>(acc, (float*)smem, S * W4P_STAGE_U4 * 4, wpt, warp, lane, part, rows, M, y, ldy);
}

// One launch runs up to four linears that share x and `in` (a layer's q/k/v, qkv/z/b/a or gate/up):
// segment s takes nb_s consecutive blocks (nb_s = ceil(ceil(out_s/32) / (8/wpt)); unused: nb = 0).
#define W4P_SEG_ARGS(i, OUT_T)                                                                               \
    const u32 *__restrict__ qw##i, const unsigned short *__restrict__ sc##i,                                  \
        const unsigned char *__restrict__ z##i, OUT_T *__restrict__ y##i, long long ldy##i, int out##i, int nb##i
#define W4P_KERNEL(NAME, OUT_T, ASYM, SBF)                                                                    \
    extern "C" __global__ void __launch_bounds__(W4_WARPS * 32, 2)                                              \
        NAME(const bf16_t* __restrict__ x, long long ldx, int M, int in, int wpt, W4P_SEG_ARGS(0, OUT_T),         \
             W4P_SEG_ARGS(1, OUT_T), W4P_SEG_ARGS(2, OUT_T), W4P_SEG_ARGS(3, OUT_T)) {                          \
        extern __shared__ uint4 w4_dyn[];                                                                        \
        int b = blockIdx.x;                                                                                      \
        const u32* qw = qw0;                                                                                     \
        const unsigned short* sc = sc0;                                                                          \
        const unsigned char* z = z0;                                                                             \
        OUT_T* y = y0;                                                                                           \
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
        if ((out & 3) == 0)                                                                                      \
            w4p_body<OUT_T, ASYM, SBF, true>(qw, sc, z, x, ldx, y, ldy, M, out, in, wpt, b, w4_dyn);             \
        else                                                                                                     \
            w4p_body<OUT_T, ASYM, SBF, false>(qw, sc, z, x, ldx, y, ldy, M, out, in, wpt, b, w4_dyn);            \
    }
// w4p_<y: h bf16 | f f32><s symmetric | a zero points><h f16 | b bf16 scales>
W4P_KERNEL(w4p_hsh, bf16_t, false, false)
W4P_KERNEL(w4p_hsb, bf16_t, false, true)
W4P_KERNEL(w4p_hah, bf16_t, true, false)
W4P_KERNEL(w4p_hab, bf16_t, true, true)
W4P_KERNEL(w4p_fsh, float, false, false)
W4P_KERNEL(w4p_fsb, float, false, true)
W4P_KERNEL(w4p_fah, float, true, false)
W4P_KERNEL(w4p_fab, float, true, true)

// Eight columns of word w as bf16 (q - z) * s, packed in column order (column c of the word is
// nibble (c & 1) * 4 + (c >> 1)).
__device__ __forceinline__ uint4 w4_dequant_word(u32 w, float s, int z) {
    u32 r[4];
#pragma unroll
    for (int p = 0; p < 4; ++p) {
        const int c0 = 2 * p, c1 = 2 * p + 1;
        const int q0 = (int)((w >> (4 * ((c0 & 1) * 4 + (c0 >> 1)))) & 15u);
        const int q1 = (int)((w >> (4 * ((c1 & 1) * 4 + (c1 >> 1)))) & 15u);
        r[p] = (u32)f2bf((float)(q0 - z) * s) | ((u32)f2bf((float)(q1 - z) * s) << 16);
    }
    return make_uint4(r[0], r[1], r[2], r[3]);
}

// Without perm: one thread per 4 words (32 columns of one row, one group): a 16-byte load, one scale
// and zero, four 16-byte stores; 32-bit indices (the launcher keeps rows * in / 32 below 2^31).
// With perm: one thread per word, each column scattered to its input feature.
extern "C" __global__ void __launch_bounds__(256)
w4_dequant(const u32* __restrict__ qw, const unsigned short* __restrict__ scales,
           const unsigned char* __restrict__ zeros, int scale_bf16, const int* __restrict__ perm,
           bf16_t* __restrict__ dst, long long ldd, int out, int in, int r0, int r1) {
    const int zstride = (out + 1) >> 1;
    if (!perm) {
        const int qpr = in >> 5;  // uint4 per row
        const int n = (r1 - r0) * qpr;
        for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
            const int rr = i / qpr, j4 = i - rr * qpr;
            const int o = r0 + rr, gi = j4 >> 2;
            const uint4 w = ld_nc_stream((const uint4*)qw + (long long)o * qpr + j4);
            const float s = w4_scale(scales[(long long)gi * out + o], scale_bf16);
            const int z = (int)w4_zero(zeros, zstride, gi, o);
            uint4* d = (uint4*)(dst + (long long)rr * ldd + 32 * j4);
            d[0] = w4_dequant_word(w.x, s, z);
            d[1] = w4_dequant_word(w.y, s, z);
            d[2] = w4_dequant_word(w.z, s, z);
            d[3] = w4_dequant_word(w.w, s, z);
        }
        return;
    }
    const int wpr = in >> 3;  // words per row
    const int n = (r1 - r0) * wpr;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        const int rr = i / wpr, j = i - rr * wpr;
        const int o = r0 + rr, gi = j >> 4;
        const u32 w = qw[(long long)o * wpr + j];
        const float s = w4_scale(scales[(long long)gi * out + o], scale_bf16);
        const int z = (int)w4_zero(zeros, zstride, gi, o);
        const uint4 v = w4_dequant_word(w, s, z);
        const u32 pk[4] = {v.x, v.y, v.z, v.w};
        bf16_t* drow = dst + (long long)rr * ldd;
#pragma unroll
        for (int c = 0; c < 8; ++c) drow[perm[8 * j + c]] = (bf16_t)(pk[c >> 1] >> (16 * (c & 1)));
    }
}

extern "C" __global__ void __launch_bounds__(256)
w4_quantize(const bf16_t* __restrict__ w, long long ldw, int out, int in, int r0, int r1, int asym,
            u32* __restrict__ qw, unsigned short* __restrict__ scales, unsigned char* __restrict__ zeros) {
    const int ng = in >> 7;
    const int pairs = (r1 - r0 + 1) >> 1;
    const long long wid = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    if (wid >= (long long)pairs * ng) return;  // whole warps
    const int gi = (int)(wid % ng), pi = (int)(wid / ng);
    const int zstride = (out + 1) >> 1;
    u32 zbyte = 0;
    for (int h = 0; h < 2; ++h) {
        const int o = r0 + 2 * pi + h;
        if (o >= r1) break;  // uniform over the warp
        const bf16_t* src = w + (long long)(o - r0) * ldw + gi * 128 + lane * 4;
        float v[4];
        float amax = 0.f, lo = 0.f, hi = 0.f;
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            v[c] = bf2f(src[c]);
            amax = fmaxf(amax, fabsf(v[c]));
            lo = fminf(lo, v[c]);
            hi = fmaxf(hi, v[c]);
        }
        float sf;
        u32 z;
        unsigned short s16;
        if (asym) {
#pragma unroll
            for (int off = 16; off > 0; off >>= 1) {
                lo = fminf(lo, __shfl_xor_sync(0xffffffffu, lo, off));
                hi = fmaxf(hi, __shfl_xor_sync(0xffffffffu, hi, off));
            }
            s16 = f32_to_f16_rn(fminf((hi - lo) / 15.0f, 65504.0f));
            sf = f16_to_f32(s16);
            z = sf > 0.f ? (u32)fminf(fmaxf(rintf(-lo / sf), 0.f), 15.f) : 0u;
        } else {
            amax = warp_max(amax);
            s16 = f32_to_f16_rn(fminf(amax / 7.0f, 65504.0f));
            sf = f16_to_f32(s16);
            z = 8u;
        }
        u32 part = 0;
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            u32 q;
            if (sf > 0.f) {
                const float r = rintf(v[c] / sf);
                q = asym ? (u32)fminf(fmaxf(r + (float)z, 0.f), 15.f) : (u32)((int)fminf(fmaxf(r, -8.f), 7.f) + 8);
            } else {
                q = z;
            }
            const int cw = (lane & 1) * 4 + c;  // column within the word
            part |= q << (4 * ((cw & 1) * 4 + (cw >> 1)));
        }
        const u32 other = __shfl_down_sync(0xffffffffu, part, 1);
        if ((lane & 1) == 0) qw[(long long)o * (in >> 3) + gi * 16 + (lane >> 1)] = part | other;
        if (lane == 0) scales[(long long)gi * out + o] = s16;
        zbyte |= z << (4 * h);
    }
    if (asym && lane == 0) zeros[(long long)gi * zstride + (r0 >> 1) + pi] = (unsigned char)zbyte;
}

// w4_read_probe (benchmark only, tests/bench_w4.rs): the pair kernel's weight streaming alone (its
// grid, warps per pair and 4-stage cp.async ring; no math), over an [out, in] int4 buffer read either
// as the device format (tiled == 0: a unit = 64 bytes of each of 32 rows, row stride in/2 bytes) or
// as if each (pair, group) unit were one contiguous 2 KB block (tiled != 0). Says how much of the
// GEMV's gap to the copy rate is the access pattern. sink gets one word that is never 0x9e3779b9.
extern "C" __global__ void __launch_bounds__(W4_WARPS * 32, 2)
w4_read_probe(const uint4* __restrict__ qw, int out, int in, int wpt, int tiled, unsigned* __restrict__ sink) {
    extern __shared__ uint4 w4_dyn[];
    constexpr int S = W4P_S;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int pair = blockIdx.x * (W4_WARPS / wpt) + warp / wpt;
    const int part = warp % wpt;
    const int ng = in >> 7;
    const int gb = (int)((long long)part * ng / wpt), ge = (int)((long long)(part + 1) * ng / wpt);
    const int n = ge - gb;
    const int r0 = pair * 32 + 4 * g;
    const long long wrow = (long long)(in >> 5);
    const u32 ring_s = smem_addr(w4_dyn + warp * (S * W4P_STAGE_U4));
    const uint4* ring = w4_dyn + warp * (S * W4P_STAGE_U4);
    auto src = [&](int k, int j) -> const uint4* {
        if (tiled) return qw + ((long long)pair * ng + k) * W4P_STAGE_U4 + j * 32 + lane;
        return qw + (long long)min(r0 + j, out - 1) * wrow + t + 4 * k;
    };
    auto issue = [&](int st, int k) {
        const u32 base = ring_s + (u32)(st * W4P_STAGE_U4 * 16) + lane * 16;
#pragma unroll
        for (int j = 0; j < 4; ++j) cp_async16(base + j * 512, src(k, j));
    };
    u32 acc = 0;
#pragma unroll
    for (int st = 0; st < S - 1; ++st) {
        if (st < n) issue(st, gb + st);
        cp_async_commit();
    }
    for (int k0 = 0; k0 < n; k0 += S) {
#pragma unroll
        for (int u = 0; u < S; ++u) {
            const int k = k0 + u;
            if (k < n) {
                if (k + S - 1 < n) issue((u + S - 1) % S, gb + k + S - 1);
                cp_async_commit();
                cp_async_wait<S - 1>();
                const uint4* stg = ring + u * W4P_STAGE_U4 + lane;
                acc ^= stg[0].x ^ stg[32].y ^ stg[64].z ^ stg[96].w;
            }
        }
    }
    cp_async_wait<0>();
    if (acc == 0x9e3779b9u) sink[0] = acc;
}
