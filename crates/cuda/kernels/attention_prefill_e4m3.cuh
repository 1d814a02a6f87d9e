// attention_prefill_e4m3.cuh — attn_prefill_ws's e4m3 tensor-core products over an fp8 cache (head dim 256;
// attention_prefill_ws.cu runs them). The cache's codes go to wgmma as they lie; the bf16 operands they meet (Q
// for S = Q K^T, P for O += P V) are split into two e4m3 halves whose sum carries a bf16's 8 significant bits, so
// S and P V mean what bf16 products over the widened codes give, in the same tensor-core time (e4m3 runs at twice
// bf16's rate) and with no widening of the codes.
//  K (WS_K8): the K cache's bytes are wgmma's K-major operand as they lie (128-byte swizzled boxes of the
//    cache's rows); Q is split once per block (ws_split_q), 2^-e a row rides on the softmax's scale.
//  V (WS_V8, with WS_K8): P V's B operand must be K-major too (keys contiguous for each head dim), the cache
//    holds V dims-contiguous: the producer warpgroup transposes each tile's codes in shared memory
//    (ws_transpose_v: byte permutes, no arithmetic), the keys of each 16 in the order S's accumulators hand P
//    to the A fragments, so P needs no shuffles. The V scales fold into P with c, a power of two that keeps
//    every P * vscale * c under 256 (e4m3's largest finite is 448); O accumulates in units of c
//    (ws_pack_p8).

// The e4m3 paths, at head dim 256 (the shape checked on a GPU; K's code takes any multiple of 128, whole 128-byte
// swizzle rows; V's transposition is written for 256: 4 warps of 64 dims).
#if KQ_K && KV_K_FMT == KVF_FP8 && HD == 256
#define WS_K8 1
#else
#define WS_K8 0
#endif
#if WS_K8 && KV_V_FMT == KVF_FP8
#define WS_V8 1
#else
#define WS_V8 0
#endif
#define WS_VT_SBO 528                                           // wg_desc_vt
#define WS_VT_BYTES ((HD / 8 * WS_VT_SBO + 1023) / 1024 * 1024)  // a transposed V tile, 1 KB aligned

#if WG_BODY && WS_K8
// d (64 x 64, f32) (+)= A (64 x 32, e4m3) * B (32 x 64, e4m3), both K-major in smem (128-byte swizzle: a
// 32-element k step is 32 bytes, as a bf16 k16 step); d is overwritten when `acc` is 0.
__device__ __forceinline__ void wg_mma_e4m3(float (&d)[32], unsigned long long da, unsigned long long db, int acc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 " WG_D32 ", %32, %33, p, 1, 1;\n}\n"
                 : WG_ACC32(d)
                 : "l"(da), "l"(db), "r"(acc));
}

// Two f32 -> e4m3 codes (round to nearest; x0 in the low byte).
__device__ __forceinline__ u32 e4m3x2(float x0, float x1) {
    unsigned short r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(x1), "f"(x0));
    return r;
}
// The e4m3 codes in the low 16 bits of c -> their exact values (the low byte to x0).
__device__ __forceinline__ void e4m3x2_f32(u32 c, float& x0, float& x1) {
    u32 h;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h) : "h"((unsigned short)c));
    x0 = f16_to_f32((unsigned short)h);
    x1 = f16_to_f32((unsigned short)(h >> 16));
}

// The consumers' Q tile (bf16 rows in the swizzled layout at q) rewritten as two e4m3 tiles for the fp8
// products: hi = e4m3(x), lo = e4m3(x - hi) of x = q * 2^e, e a row's power of two that brings its largest
// |q| into [128, 256). A bf16 has 8 significant bits, an e4m3 4: x - hi is a multiple of x's last bit
// at most 8 of them, so hi + lo = x exactly where x's last bit is at least e4m3's smallest step 2^-9: |x| >=
// 2^-2, i.e. |q| >= 2^-9 of the row's largest (deltaserve_cpu::kvquant's a_bf16_is_two_e4m3_halves),
// and S = (Q_hi K^T + Q_lo K^T) 2^-e. hi (128 rows of HD bytes, swizzled as K's tiles) replaces the
// bf16 tile's first half, lo its second. Two threads a row (ct = 2 r + h: dims h HD/2 ...), so a warp
// holds exactly the 16 rows its accumulators hold; returns 2^-e of the thread's row.
__device__ __forceinline__ float ws_split_q(u32 q, int ct) {
    constexpr int CH = HD / 8, HC = CH / 2;  // bf16 chunks a row, a thread's
    const int r = ct >> 1, h = ct & 1;
    float amax = 0.0f;
    for (int i = 0; i < HC; i++) {
        uint4 w;
        asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(w.x), "=r"(w.y), "=r"(w.z), "=r"(w.w)
                     : "r"(q + wg_swz(r, h * HC + i, WG_ROWS)));
        const u32 ww[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const float lo = fabsf(__uint_as_float(ww[e] << 16)), hi = fabsf(__uint_as_float(ww[e] & 0xffff0000u));
            amax = fmaxf(amax, fmaxf(lo, hi));
        }
    }
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
    // amax in [2^(E-127), 2^(E-126)): 2^(134 - E) (biased 261 - E) brings it into [128, 256). Zero,
    // subnormal, inf or NaN rows: 1.
    const int E = (int)((__float_as_uint(amax) >> 23) & 0xffu);
    const int sb = E == 0 || E == 255 ? 127 : min(261 - E, 253);
    const float sc = __uint_as_float((u32)sb << 23);
    // A thread's codes: HD / 32 16-byte chunks of hi and of lo (16 dims each, from 2 bf16 chunks).
    constexpr int NC = HD / 32;
    u32 hi[NC][4], lo[NC][4];
#pragma unroll
    for (int c = 0; c < NC; c++) {
#pragma unroll
        for (int half = 0; half < 2; half++) {
            uint4 w;
            asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                         : "=r"(w.x), "=r"(w.y), "=r"(w.z), "=r"(w.w)
                         : "r"(q + wg_swz(r, h * HC + 2 * c + half, WG_ROWS)));
            const u32 ww[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
            for (int p = 0; p < 2; p++) {
                u32 hw = 0, lw = 0;
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    const u32 v = ww[2 * p + e];
                    const float x0 = __uint_as_float(v << 16) * sc, x1 = __uint_as_float(v & 0xffff0000u) * sc;
                    const u32 hc = e4m3x2(x0, x1);
                    float h0, h1;
                    e4m3x2_f32(hc, h0, h1);
                    hw |= hc << (16 * e);
                    lw |= e4m3x2(x0 - h0, x1 - h1) << (16 * e);
                }
                hi[c][2 * half + p] = hw;
                lo[c][2 * half + p] = lw;
            }
        }
    }
    named_sync(1, 256);  // every bf16 chunk read before any code lands over it
#pragma unroll
    for (int c = 0; c < NC; c++) {
        const u32 at = q + wg_swz(r, h * NC + c, WG_ROWS);
        asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(at), "r"(hi[c][0]), "r"(hi[c][1]),
                     "r"(hi[c][2]), "r"(hi[c][3])
                     : "memory");
        asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(at + WG_ROWS * HD), "r"(lo[c][0]),
                     "r"(lo[c][1]), "r"(lo[c][2]), "r"(lo[c][3])
                     : "memory");
    }
    return __uint_as_float((u32)(254 - sb) << 23);
}
#endif

#if WG_BODY && WS_V8
// A V tile for the P V products (ws_transpose_v): K-major without swizzle, wgmma's 8 x 16-byte core matrices (8
// head dims x 16 keys, 128 contiguous bytes); the 4 core matrices of 8 dims (keys 0-15, 16-31, ...) 128 bytes
// apart, groups of 8 dims WS_VT_SBO apart: 16 bytes past 512, so the 8 rows a stmatrix writes (dims 2 apart)
// meet 8 different banks.
__device__ __forceinline__ unsigned long long wg_desc_vt(u32 addr) {
    return (unsigned long long)((addr & 0x3FFFF) >> 4) | ((unsigned long long)(128 >> 4) << 16) |
           ((unsigned long long)(WS_VT_SBO >> 4) << 32);
}

// d (64 x 64, f32) += A (64 x 32, e4m3 fragments in registers) * B (32 x 64, e4m3, K-major in smem).
__device__ __forceinline__ void wg_mma_rs_e4m3(float (&d)[32], const u32 (&a)[4], unsigned long long db) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 " WG_D32
                 ", {%32, %33, %34, %35}, %36, 1, 1, 1;\n"
                 : WG_ACC32(d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}

// O += P V over a transposed V tile at vt (ws_transpose_v), issued (committed, not waited): per 32-key k step s
// and 64 head dims, P's hi half (pa[2s]) and lo half (pa[2s + 1]).
__device__ __forceinline__ void ws_issue_pv8(float (&oacc)[HD / 64][32], const u32 (&pa)[WG_BK / 16][4], u32 vt) {
    wg_fence();
#pragma unroll
    for (int s = 0; s < WG_BK / 32; s++)
#pragma unroll
        for (int b = 0; b < HD / 64; b++) {
            const unsigned long long db = wg_desc_vt(vt + (u32)(b * 8 * WS_VT_SBO + s * 256));
            wg_mma_rs_e4m3(oacc[b], pa[2 * s], db);
            wg_mma_rs_e4m3(oacc[b], pa[2 * s + 1], db);
        }
    wg_commit();
}

// Four values x (0 <= x < 256) as two e4m3 words, value j in byte j: hi = e4m3(xh), lo = e4m3(xh - hi) of xh,
// x in f16 (xh - hi is exact in f16: hi is xh rounded to 4 significant bits).
__device__ __forceinline__ void e4m3_split4(float x0, float x1, float x2, float x3, u32& hi, u32& lo) {
    u32 h01, h23, b01, b23;
    unsigned short c01, c23, d01, d23;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(h01) : "f"(x1), "f"(x0));
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(h23) : "f"(x3), "f"(x2));
    asm("cvt.rn.satfinite.e4m3x2.f16x2 %0, %1;" : "=h"(c01) : "r"(h01));
    asm("cvt.rn.satfinite.e4m3x2.f16x2 %0, %1;" : "=h"(c23) : "r"(h23));
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(b01) : "h"(c01));
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(b23) : "h"(c23));
    asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(b01) : "r"(h01), "r"(b01));
    asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(b23) : "r"(h23), "r"(b23));
    asm("cvt.rn.satfinite.e4m3x2.f16x2 %0, %1;" : "=h"(d01) : "r"(b01));
    asm("cvt.rn.satfinite.e4m3x2.f16x2 %0, %1;" : "=h"(d23) : "r"(b23));
    hi = (u32)c01 | ((u32)c23 << 16);
    lo = (u32)d01 | ((u32)d23 << 16);
}

// P (the probabilities wg_softmax left in S's registers) times the keys' V scales svs and c, as the e4m3 A
// fragments of the P V products: pa[2s] the hi and pa[2s + 1] the lo halves of 32-key k step s. A fragment's
// word holds a row's 4 consecutive k slots, S's accumulators a row's keys 8n + 2tg and + 1: word 0 of step s
// (row g) takes keys 2tg, 2tg + 1 of n8 tiles 4s and 4s + 1, word 2 of tiles 4s + 2 and 4s + 3, words 1 and 3
// the same keys of row g + 8; ws_transpose_v puts V's keys in the k slots in that order. c = 2^(sb - 127): the
// largest V scale seen so far (quad_max over the tile's 64) times c lies in [128, 256); sb only falls, and when
// it does al takes the factor that brings O (kept in units of c) to the new c.
__device__ __forceinline__ void ws_pack_p8(const float (&sacc)[32], const float* svs, int tg, int& sb_run,
                                           float (&al)[2], u32 (&pa)[WG_BK / 16][4]) {
    float vs[16], vmax = 0.0f;
#pragma unroll
    for (int n = 0; n < WG_BK / 8; n++) {
        vs[2 * n] = svs[8 * n + 2 * tg];
        vs[2 * n + 1] = svs[8 * n + 2 * tg + 1];
        vmax = fmaxf(vmax, fmaxf(vs[2 * n], vs[2 * n + 1]));
    }
    vmax = quad_max(vmax);
    // vmax in [2^(E-127), 2^(E-126)): 2^(134 - E) (biased 261 - E) brings it into [128, 256). Zero: 1.
    const int E = (int)((__float_as_uint(vmax) >> 23) & 0xffu);
    const int sb = E == 0 || E == 255 ? 127 : min(261 - E, 253);
    if (sb < sb_run) {
        const float f = __uint_as_float((u32)max(1, 127 + sb - sb_run) << 23);
        al[0] *= f;
        al[1] *= f;
        sb_run = sb;
    }
    const float c = __uint_as_float((u32)sb_run << 23);
#pragma unroll
    for (int i = 0; i < 16; i++) vs[i] *= c;
    auto x = [&](int n, int e, int hf) { return sacc[4 * n + 2 * hf + e] * vs[2 * n + e]; };
#pragma unroll
    for (int s = 0; s < WG_BK / 32; s++)
#pragma unroll
        for (int w = 0; w < 4; w++) {
            const int n = 4 * s + 2 * (w >> 1), hf = w & 1;  // words 0 / 2: row g, 1 / 3: row g + 8
            e4m3_split4(x(n, 0, hf), x(n, 1, hf), x(n + 1, 0, hf), x(n + 1, 1, hf), pa[2 * s][w], pa[2 * s + 1][w]);
        }
}

// The producer warpgroup (128 threads) transposes one V tile: its codes at `codes` as the TMA landed them
// (HD / 128 blocks of 64 keys x 128 bytes, 128-byte swizzle) into the P V operand at vt (wg_desc_vt's layout:
// HD rows of 64 keys), k slot 4t + j of each 16-key chunk holding key 8 (j >> 1) + 2t + (j & 1) of the chunk
// (ws_pack_p8's order); keys at or past nk as zeros (a partial last tile: P is 0 there, and 0 times a stale
// code that reads as NaN is not). Codes as b16 pairs of dims: ldmatrix.trans of 8 keys x 16 dims gives a thread
// (lane 4r + t) keys 2t and 2t + 1 of dims 2r and 2r + 1; the same of keys 8 on and two byte permutes make the 4
// keys of slots 4t .. 4t + 3 for dim 2r and for 2r + 1, which stmatrix writes as rows of the transposed tile.
// A warp's iteration: 16 keys x 32 dims (4 matrices each way). No bank conflicts: a loaded matrix's 8 keys lie
// in 8 swizzle rows, a stored one's 8 rows (dims 2 apart) in 8 banks (WS_VT_SBO).
template <bool PARTIAL>
__device__ __forceinline__ void ws_transpose_v_(u32 codes, u32 vt, int nk, int w, int l) {
    static_assert(HD == 256, "the producer's 4 warps transpose 64 dims each");
    const int m = l >> 3, i = l & 7, q = l & 3;
    // ldmatrix: lane 8m + i addresses key 16 kc + 8 (m & 1) + i of 16-dim chunk 4w + 2 (u >> 2) + (m >> 1);
    // stmatrix: dim 16 (4w + 2 (u >> 2) + (m >> 1)) + 2i + (m & 1), 16-key chunk kc (u = 4 (x - 2w) / 2 + kc).
    u32 src[2];
#pragma unroll
    for (int xh = 0; xh < 2; xh++) {
        const int ch = 4 * w + 2 * xh + (m >> 1);
        src[xh] = codes + (u32)((ch >> 3) * WG_BK * 128 + (8 * (m & 1) + i) * 128 + (((ch & 7) ^ i) << 4));
    }
    const int d0 = 16 * (4 * w + (m >> 1)) + 2 * i + (m & 1);
    const u32 dst = vt + (u32)((d0 >> 3) * WS_VT_SBO + (d0 & 7) * 16);
#pragma unroll
    for (int u = 0; u < 8; u++) {
        const int kc = u & 3, xh = u >> 2;
        u32 r0, r1, r2, r3;
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                     : "r"(src[xh] + (u32)(kc * 16 * 128)));
        // Matrices 0 / 1: keys 0-7 / 8-15 of the chunk at 16-dim chunk x, 2 / 3 the same at x + 1.
        u32 x0 = dm_prmt(r0, r1, 0x6420u), y0 = dm_prmt(r0, r1, 0x7531u);
        u32 x1 = dm_prmt(r2, r3, 0x6420u), y1 = dm_prmt(r2, r3, 0x7531u);
        if (PARTIAL) {
            const int k0 = 16 * kc + 2 * q;
            const u32 keep = (k0 < nk ? 0xffu : 0u) | (k0 + 1 < nk ? 0xff00u : 0u) | (k0 + 8 < nk ? 0xff0000u : 0u) |
                             (k0 + 9 < nk ? 0xff000000u : 0u);
            x0 &= keep, y0 &= keep, x1 &= keep, y1 &= keep;
        }
        asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(
                         dst + (u32)(xh * 4 * WS_VT_SBO + kc * 128)),
                     "r"(x0), "r"(y0), "r"(x1), "r"(y1)
                     : "memory");
    }
}
__device__ __forceinline__ void ws_transpose_v(u32 codes, u32 vt, int nk, int tid) {
    if (nk >= WG_BK)
        ws_transpose_v_<false>(codes, vt, nk, tid >> 5, tid & 31);
    else
        ws_transpose_v_<true>(codes, vt, nk, tid >> 5, tid & 31);
}
#endif
