// w4_pair.cuh — the int4 pair GEMV's device code (w4p_body and what it uses), shared by the
// w4a16 module (the decode GEMV kernels, w4a16.cu) and the moe_w4 module (the routed experts' GEMV,
// moe_w4.cu). The int4 device format and the pair kernel are described in w4a16.cu.

#define W4_WARPS 8

__device__ __forceinline__ float w4_scale(unsigned short s, int scale_bf16) {
    return scale_bf16 ? bf2f(s) : f16_to_f32(s);
}

__device__ __forceinline__ u32 w4_zero(const unsigned char* zeros, int zstride, int g, int o) {
    return zeros ? ((u32)(zeros[(long long)g * zstride + (o >> 1)] >> ((o & 1) * 4)) & 15u) : 8u;
}

// w4_sum_parts, then stores the outputs of NT 16-row tiles: fragment value c (0..3) of tile i is output
// row rows[2i + (c >> 1)] (rows[] per lane; < 0: not stored), token 2t + (c & 1).
__device__ __forceinline__ void w4_put(bf16_t* p, float v) { *p = f2bf(v); }
__device__ __forceinline__ void w4_put(float* p, float v) { *p = v; }
template <int NT, typename OutT>
__device__ __forceinline__ void w4_gemv_store(float* acc, float* red, int red_stride, int wpt, int warp, int lane,
                                              int part, const int* rows, int M, OutT* __restrict__ y,
                                              long long ldy) {
    if (!w4_sum_parts<NT>(acc, red, red_stride, wpt, warp, lane, part)) return;
    const int t = lane & 3;
#pragma unroll
    for (int c = 0; c < 4 * NT; ++c) {
        const int row = rows[c >> 1], m = 2 * t + (c & 1);
        if (row >= 0 && m < M) w4_put(y + (long long)m * ldy + row, acc[c]);
    }
}

// The pair kernel's stages (described above its code): W4P_S units of the format in registers per lane.
// Its shared memory: W4P_WARP_U4 uint4 (1 KB) per warp, where the parts of a pair add their sums
// (w4_sum_parts) and the fold's epilogue takes them, then the fold's staging (W4Fold).
#define W4P_S 2
#define W4P_WARP_U4 64

// The residual add + RMSNorm between two decode projections, folded into them (a "fold", the w4pf_*
// kernels; steps of at most 8 tokens, tensor parallelism off, rows of at most W4_FOLD_MAX_D with
// D % 128 == 0).
//  mode 1, the projection whose output joins the residual stream (a mixer's out / o projection, down;
//      one linear): y is the residual stream [M, out] (read and written), and for each output
//        h = bf16(y + bf16(acc))                  (add_rms_norm_1p's residual, bit for bit)
//        y = h,   fx[m, r] = bf16(h * (1 + nw[r]))  (the next norm's input before its 1/rms; row stride ldy)
//      and ss[8 * pair + m] = the sum of h^2 over the pair's 32 rows (its lanes in row order, then a
//      butterfly over the 8 row groups), for every pair of the linear. A segment's rows start at
//      y - y0 (y0: the launch's first segment, row 0).
//  mode 2, the projection after that norm (in-projections, gate/up): x is mode 1's fx, and the outputs
//      are scaled by inv_m = rsqrt(S_m / in + eps), S_m the sum of ss[8p + m] over p < np (np =
//      ceil(in / 32); the lanes (g, t) add p = g, g + 8, ... in order, then a butterfly over g).
// Against add_rms_norm_1p + a plain GEMV this rounds x differently (bf16(h(1 + w)), then the sum times
// inv, instead of bf16(h · inv · (1 + w))) and sums the squares in another order: as accurate (tests).
// What it saves: the norm kernel between the two projections (one launch and its memory round trips
// on the critical path of every decode step, 126 per step at the 27B's 64 layers). What it adds stays
// off the tail: the epilogue's inputs (mode 1: the lane's residual values and norm weights; mode 2: the
// sums) are copied into W4_FOLD_SMEM bytes of shared memory after the sums' slots, by cp.async issued with
// the first weights, so the epilogue reads shared memory only.
// W4Fold holds the kernel's parameters as they are; offsets are derived where they are used.
struct W4Fold {
    bf16_t* fx;
    const bf16_t* nw;
    float* ss;
    const void* y0;
    int mode, np;
    float eps;
};
#define W4_FOLD_SMEM 8192
#define W4_FOLD_MAX_D 8192
// Mode 1's staging: the residual [8 tokens][256 rows of the block] bf16, then the norm weights [256].
#define W4_FOLD_ROWS 256

__device__ __forceinline__ void cp_async8(u32 dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(dst), "l"(src) : "memory");
}
// Commits what is pending and waits for every cp.async of the thread (the fold's staging copies).
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

// The fold's epilogue, once per kernel (not in each w4p_body instantiation), after w4p_body left each
// pair's summed acc in its part-0 warp's slot (acc[c] at red[c * 32 + lane]: row r0 + c / 2,
// token 2t + c % 2) and the staging is filled (W4Fold). Lane (g, t) of a part-0 warp: rows r0 .. r0 + 3
// (r0 = 32 * pair + 4g), tokens 2t, 2t + 1. wpt is a power of two. Mode 1 stores 4 rows of a token as
// one 8-byte vector (the launcher keeps y, fx 8-byte aligned and ldy % 4 == 0).
#define W4P_RED_STRIDE (W4P_WARP_U4 * 4)
__device__ __forceinline__ void w4p_fold_epilogue(const W4Fold& f, int block, int wpt, bf16_t* y, long long ldy,
                                                  int out, int M, int in, const uint4* smem) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, lw = __ffs(wpt) - 1;
    if (warp & (wpt - 1)) return;
    const int g = lane >> 2, t = lane & 3, pw = warp >> lw;  // pw: the warp's pair in the block
    const int pair = (block << (3 - lw)) + pw, r0 = 32 * pair + 4 * g;
    const float* red = (const float*)smem + warp * W4P_RED_STRIDE + lane;
    const bf16_t* stage = (const bf16_t*)(smem + W4_WARPS * W4P_WARP_U4);
    const bool live = r0 < out;  // whole pairs: out % 32 == 0
    float v[2] = {0.f, 0.f};     // mode 1: sums of h^2; mode 2: of the producer's sums (tokens 2t, 2t + 1)
    if (f.mode == 1) {
        const long long seg = y - (const bf16_t*)f.y0;  // the segment's first row in the linear
        const int prow = 32 * pw + 4 * g;
        const uint2 wv = *(const uint2*)(stage + 8 * W4_FOLD_ROWS + prow);
#pragma unroll
        for (int k = 0; k < 2; ++k) {
            const int m = 2 * t + k;
            if (!live || m >= M) continue;
            const uint2 rv = *(const uint2*)(stage + m * W4_FOLD_ROWS + prow);
            const u32 rw[2] = {rv.x, rv.y}, ww[2] = {wv.x, wv.y};
            u32 hw[2], xw[2];
#pragma unroll
            for (int i = 0; i < 2; ++i) {  // rows 2i, 2i + 1 of the four
                const float h0 = round_bf(round_bf(red[(4 * i + k) * 32]) + __uint_as_float(rw[i] << 16));
                const float h1 =
                    round_bf(round_bf(red[(4 * i + 2 + k) * 32]) + __uint_as_float(rw[i] & 0xffff0000u));
                v[k] += h0 * h0;
                v[k] += h1 * h1;
                hw[i] = pack_bf16(h0, h1);
                xw[i] = pack_bf16(h0 * (1.0f + __uint_as_float(ww[i] << 16)),
                                  h1 * (1.0f + __uint_as_float(ww[i] & 0xffff0000u)));
            }
            *(uint2*)(y + (long long)m * ldy + r0) = make_uint2(hw[0], hw[1]);
            *(uint2*)(f.fx + seg + (long long)m * ldy + r0) = make_uint2(xw[0], xw[1]);
        }
    } else {
        const float* sss = (const float*)stage + 2 * t;  // [np][8]: lane (g, t) adds pairs g, g + 8, ...
#pragma unroll 4
        for (int p = g; p < f.np; p += 8) {
            const float2 s2 = *(const float2*)(sss + 8 * p);
            v[0] += s2.x;
            v[1] += s2.y;
        }
    }
#pragma unroll
    for (int o = 4; o < 32; o <<= 1) {  // over the 8 row groups / pair residues g
        v[0] += __shfl_xor_sync(0xffffffffu, v[0], o);
        v[1] += __shfl_xor_sync(0xffffffffu, v[1], o);
    }
    if (f.mode == 1) {
        float* ss = f.ss + 8 * ((int)((y - (const bf16_t*)f.y0) >> 5) + pair);
        if (lane < 4 && 2 * t < M) ss[2 * t] = v[0];
        if (lane < 4 && 2 * t + 1 < M) ss[2 * t + 1] = v[1];
        return;
    }
    const float inv[2] = {rsqrtf(v[0] / (float)in + f.eps), rsqrtf(v[1] / (float)in + f.eps)};
    float acc[8];
    int rows[4];
#pragma unroll
    for (int c = 0; c < 8; ++c) acc[c] = red[c * 32] * inv[c & 1];
#pragma unroll
    for (int j = 0; j < 4; ++j) rows[j] = r0 + j < out ? r0 + j : -1;
    w4_gemv_store<2>(acc, nullptr, 0, 1, warp, lane, 0, rows, M, y, ldy);  // (1 warp per pair: no reduction)
}

// The "pair" GEMV (w4p_*): a warp streams two 16-row tiles (32 output rows, one pair of the format)
// into registers and spends ~90 instructions per KB of weights:
//  - per group the warp loads its pair's unit: lane (g, t) takes chunk t of rows 4g + j, j = 0..3,
//    which in the tile-major format are four contiguous 512-byte runs (a 2 KB unit), with
//    non-allocating 16-byte loads (the lane's registers are its MMA operands);
//  - lane (g, t) owns the 4 consecutive rows rb + j (rb = 32*pair + 4g, j = 0..3) as MMA rows g
//    (j = 0), g + 8 (j = 1) of tile 0 and g, g + 8 of tile 1 (j = 2, 3); their 4 scales are one 8-byte
//    load, their zeros one 2-byte load (out % 4 == 0, VEC; otherwise one load per row);
//  - unpacking is one LOP3 per column pair, ((w >> 4p) & 0x000f000f) | 0x43004300 = bf16 (128 + q0,
//    128 + q1), straight into the MMA (no zero subtraction per weight);
//  - a third MMA with A = ones gives each token's sum of x over the group, X, and the group adds
//    s * (T - (128 + z) * X) per row and token (T: the MMA of 128 + q; exact integers times bf16 x).
// The weights, scales and zeros of the next group are loaded while this one's MMAs run (S = 2 register
// stages; x one group ahead too). The group loop is unrolled by S, so stages are compile-time. A 4-stage
// cp.async ring through shared memory instead measured 1.02-1.05x the decode step's time
// (bench/results/int4-gemv-register-stages-h100-2026-12-06.md).
template <bool SBF>
__device__ __forceinline__ float w4p_scale(u32 bits) {
    return SBF ? __uint_as_float(bits << 16) : f16_to_f32((unsigned short)bits);
}


// FOLD (the w4pf_* kernels): the fold's staging and, instead of storing, acc left for w4p_fold_epilogue.
template <typename OutT, bool ASYM, bool SBF, bool VEC, bool FOLD>
__device__ __forceinline__ void w4p_body(const u32* __restrict__ qw, const unsigned short* __restrict__ scales,
                                         const unsigned char* __restrict__ zeros, const bf16_t* x,
                                         long long ldx, OutT* __restrict__ y, long long ldy, int M, int out, int os,
                                         int in, int wpt, int block, uint4* smem, const W4Fold& f) {
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
    // The lane's 4 rows (clamped to out - 1: always inside one pair) and their uint4 at group gb;
    // the next group's are gstep uint4 further (the pair's rows x 4).
    const int gstep = 4 * min(32, out - ((min(r0, out - 1) >> 5) << 5));
    // (32-bit uint4 offsets: the launcher keeps out * in / 32 below 2^31; fewer registers than pointers.)
    const uint4* qw4 = (const uint4*)qw;
    u32 pw[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) pw[j] = (u32)w4_u4(min(r0 + j, out - 1), 4 * gb + t, out, ng);
    const int zstride = (os + 1) >> 1;
    // Scales / zeros of the next group to issue (advanced by one group per issue; os: their row stride).
    const unsigned short* ps = scales + (long long)gb * os;
    const unsigned char* pz = ASYM ? zeros + (long long)gb * zstride : nullptr;
    const bool has_x = g < M;
    // x of word i of the lane's chunk t of a group: uint4 4i + t of the group's 16.
    const uint4* px = (const uint4*)(x + (long long)(has_x ? g : 0) * ldx) + t + 16 * gb;
    uint4 wr[S][4];  // the stages: the lane's four uint4 of a unit

    uint2 sv[S];  // scale bits: x = rows 0 | 1 << 16, y = rows 2 | 3 << 16
    u32 zv[S];    // zeros: nibble j = row j
    // Issues group rel (relative to the group that pw/px point at) into stage st; scales / zeros
    // from ps / pz, which then advance.
    auto issue = [&](int st, int rel, uint2& s_out, u32& z_out) {
#pragma unroll
        for (int j = 0; j < 4; ++j) wr[st][j] = ld_nc_stream(qw4 + (pw[j] + gstep * rel));
        if (VEC) {
            s_out = __ldg((const uint2*)(ps + rv));
        } else {
            const u32 a = __ldg(ps + min(r0, out - 1)), b = __ldg(ps + min(r0 + 1, out - 1));
            const u32 c = __ldg(ps + min(r0 + 2, out - 1)), d = __ldg(ps + min(r0 + 3, out - 1));
            s_out = make_uint2(a | (b << 16), c | (d << 16));
        }
        ps += os;
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
#pragma unroll
    for (int st = 0; st < S - 1; ++st)
        if (st < n) issue(st, st, sv[st], zv[st]);
    // The fold's staging (W4Fold), after the sums' slots: a mode-1 lane's norm weights (a weight: before
    // the wait) and residual values at its rows from prow in the block (the launcher keeps out % 32 == 0);
    // mode 2's sums, copied by every thread of the block.
    const u32 fold_s = smem_addr(smem + W4_WARPS * W4P_WARP_U4);
    const int prow = (warp / wpt) * 32 + 4 * g;
    if constexpr (FOLD) {
        if (f.mode == 1 && part == 0)
            cp_async8(fold_s + 2 * (8 * W4_FOLD_ROWS + prow), f.nw + ((const bf16_t*)y - (const bf16_t*)f.y0) + r0);
    }
    // Launched to overlap the previous kernel (sm_90): the weights are in flight; x and y are that
    // kernel's.
    pdl_wait();
    if constexpr (FOLD) {
        if (f.mode == 1 && part == 0) {
#pragma unroll
            for (int k = 0; k < 2; ++k)
                if (2 * t + k < M)
                    cp_async8(fold_s + 2 * ((2 * t + k) * W4_FOLD_ROWS + prow), y + (long long)(2 * t + k) * ldy + r0);
        }
        if (f.mode == 2)
            for (int i = threadIdx.x; i < 2 * f.np; i += W4_WARPS * 32)
                cp_async16(fold_s + 16 * i, (const uint4*)f.ss + i);
    }
    uint4 xb[2][4];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        xb[0][q] = (has_x && n > 0) ? ld_act(px + 4 * q) : make_uint4(0u, 0u, 0u, 0u);
        xb[1][q] = make_uint4(0u, 0u, 0u, 0u);
    }
    const u32 ones = 0x3f803f80u;
    for (int k0 = 0; k0 < n; k0 += S) {
#pragma unroll
        for (int u = 0; u < S; ++u) {
            const int k = k0 + u;
            if (k < n) {
                const int sn = (u + S - 1) % S;
                if (k + S - 1 < n) issue(sn, u + S - 1, sv[sn], zv[sn]);
                if (has_x && k + 1 < n) {
#pragma unroll
                    for (int q = 0; q < 4; ++q) xb[(u + 1) & 1][q] = ld_act(px + 16 * (u + 1) + 4 * q);
                }
                const uint4 w0 = wr[u][0], w1 = wr[u][1], w2 = wr[u][2], w3 = wr[u][3];
                const uint4* xv = xb[u & 1];
                float t0[4] = {0.f, 0.f, 0.f, 0.f}, t1[4] = {0.f, 0.f, 0.f, 0.f}, xs[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
                for (int i = 0; i < 4; ++i) {  // word i of each row: the group's columns 32i + 8t .. + 7
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
        for (int j = 0; j < 4; ++j) pw[j] += gstep * S;
        px += 16 * S;
    }
    if constexpr (FOLD) {
        cp_async_wait_all();
        if (f.mode == 2) __syncthreads();  // the sums were staged by every thread of the block
        if (!w4_sum_parts<2>(acc, (float*)smem, W4P_RED_STRIDE, wpt, warp, lane, part)) return;
        // w4p_fold_epilogue takes the sums from the warp's slot.
#pragma unroll
        for (int c = 0; c < 8; ++c) ((float*)smem)[warp * W4P_RED_STRIDE + c * 32 + lane] = acc[c];
        return;
    }
    // Rows of the fragment values: tile 0 rows g, g + 8 = r0, r0 + 1; tile 1: r0 + 2, r0 + 3.
    int rows[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) rows[j] = r0 + j < out ? r0 + j : -1;
    w4_gemv_store<2>(acc, (float*)smem, W4P_RED_STRIDE, wpt, warp, lane, part, rows, M, y, ldy);
}
