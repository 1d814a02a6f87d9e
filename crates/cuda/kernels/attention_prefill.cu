// attention_prefill.cu — causal GQA attention prefill over the paged KV cache (attention_tile.cuh
// has the computation, shapes and KV formats): varlen queries (cu_seqlens), FlashAttention-2 style on
// tensor cores (mma.sync m16n8k16 bf16 -> f32, ldmatrix, cp.async); no scratch.
//  attn_prefill:        one block = 16 queries x PF_HPB query heads of one kv head, a warp pair per
//                       head (design below).
//  attn_prefill_wide / attn_prefill_wide64: the same with 128 packed (query, head) rows per block
//                       (the default where its 140 / 214 KB of shared memory fit: sm_80 / sm_90;
//                       attention_prefill_wide.cu, which follows this file in the module).
// Launch: attn_prefill grid (n_tiles, Hkv * GQA_GROUP / PF_HPB), block 64*PF_HPB, dynamic smem
//   2 stages * (K + V) * PF_BK keys * (HD+8) * 2 B + the pairs' exchange 2*PF_HPB*PF_BK*64 B
//   (91,136 B at HD 256, 32 keys, 6 heads).
//   -D PF_BK, PF_PSPLIT, PF_HPB: attn_prefill's tiling (ops::attention tiling: nvrtc::AttnTiling).
//
// Quantised KV: the codes of a KV tile are copied (cp.async, double-buffered as for bf16) into a raw
// stage; after the wait all threads widen them to bf16 codes in a single converted tile with the
// bf16 layout (padded rows), which the unchanged ldmatrix/mma path reads. Tile scales travel
// through registers of threads 0..31 (loaded when the tile is issued, stored to smem one
// iteration later) into f32 smem. Smem (HD 256): fp8/int8 66.3 KB, int4 50.3 KB, mixed <= 66.8 KB.
//
// attn_prefill design (one block = 16 queries x PF_HPB query heads of one kv head):
//  - Warps 2p and 2p+1 (a pair) own query head p of the block for the block's 16 queries (one m16
//    row tile) and split its head dims: each holds Q (mma A fragments) and the f32 O accumulator
//    for HD/2 dims only (32 + 64 registers at HD 256), so 12 warps of 168 registers fit an SM. Per
//    KV tile each warp computes S over its half of the dims, the pair adds the two halves through
//    shared memory (named barrier 1 + p; a + b == b + a, so both hold bitwise the same S), and both
//    run the same online softmax; each then multiplies P by its half of V. The K/V tile is loaded
//    once per block and read by all PF_HPB heads (GQA sharing).
//  - KV tile = PF_BK keys (32: one page at page 32), double-buffered with cp.async (16-byte chunks;
//    keys past the visible end are zero-filled, so poisoned / unmapped cache rows are never read).
//    Smem rows are padded to HD+8 bf16 (16 B) so ldmatrix row addresses hit distinct banks. When the
//    page size is a multiple of PF_BK a tile lies inside one page: one block-table lookup, and each
//    thread copies a fixed column of every PF_RSTEP-th row (a pointer bump per copy).
//  - S = Q K^T (ldmatrix non-trans of K rows = mma "col" B), in the log2 domain (scale * log2 e
//    applied in the exp's FFMA), ex2.approx; causal mask only on tiles that reach past the tile's
//    first query position; tiles past the last query are never visited.
//  - Online softmax per row (rows g and g+8 of the m16 tile per thread, 4 threads per row; row sums
//    stay per-thread partial until the end); O is rescaled only when some row max moved (warp vote).
//  - O += P V with V via ldmatrix.trans, f32 accumulation; P as plain bf16 (PF_PSPLIT 0, the
//    default, like FlashAttention) or as hi = bf16(p) plus lo = bf16(p - hi) (PF_PSPLIT 1: ~2^-17
//    relative error instead of 2^-9, 1.5x the mma).
//  - Blocks run in reverse tile-table order so the longest (causal) tiles start first, and grid.x
//    = tiles, grid.y = kv heads x head groups so co-resident blocks stream the same K/V (L2 reuse).
// Measured (H200, bench/results/attention-pairs-h200-2026-11-29.md): 27B shape, 4096 causal
//   queries, 32K-262K keys: 193 TFLOP/s with plain P, 165 with the split (one warp per head, the
//   previous design: 154 split, 181-195 plain). ncu: ~9 instructions per mma, stalls mostly on fixed-
//   latency dependencies ("wait"), 12 warps per SM changed little against 6. Without the per-tile
//   page division (power-of-two pages): 205 TFLOP/s at 128K-262K keys; a third KV stage (one barrier
//   per tile instead of two) changed nothing (bench/results/int4-tile-major-and-prefill-kernels-h200-2026-11-29.md).

// attn_prefill's tiling and shared-memory layout.
#define PF_BQ 16                       // queries per block (Q_TILE in ops/attention.rs)
#ifndef PF_BK
#define PF_BK 32                       // keys per KV tile (ops::attention::AttnTiling::keys)
#endif
#ifndef PF_PSPLIT
#define PF_PSPLIT 1                    // P as bf16 hi + lo (1) or plain bf16 (0)
#endif
#ifndef PF_HPB
#define PF_HPB GQA_GROUP               // query heads per block (a divisor of GQA_GROUP)
#endif
#define PF_HALF (HD / 2)               // head dims per warp: a warp pair shares one query head
#define PF_NW (2 * PF_HPB)             // warps per block
#define PF_NT (32 * PF_NW)             // threads per block
#define PF_RSTEP (PF_NT / PF_CH)       // tile rows one pass of the block's threads copies
#define PF_MAT_BYTES (PF_BK * PF_STR * 2)   // one K or V tile
// One cp.async stage: K then V, each a bf16 tile (padded rows) or, for a quantised format, the raw
// codes (PF_BK rows of K_ROWB / V_ROWB bytes). With bf16 K and V: 2 * PF_MAT_BYTES as always.
#define PF_K_PART (KQ_K ? PF_BK * K_ROWB : PF_MAT_BYTES)
#define PF_V_PART (KQ_V ? PF_BK * V_ROWB : PF_MAT_BYTES)
#define PF_STAGE_BYTES (PF_K_PART + PF_V_PART)
// After the 2 stages: converted bf16 code tiles (quantised formats only), f32 tile scales, then the
// warp pairs' partial-S exchange (PF_NW warps x PF_BK x 16 f32).
#define PF_CV_K (2 * PF_STAGE_BYTES)
#define PF_CV_V (PF_CV_K + (KQ_K ? PF_MAT_BYTES : 0))
#define PF_SC_K (PF_CV_V + (KQ_V ? PF_MAT_BYTES : 0))
#define PF_SC_V (PF_SC_K + (KQ_K ? PF_BK * 4 : 0))
#define PF_XCH (PF_SC_V + (KQ_V ? PF_BK * 4 : 0))
#define PF_SMEM_BYTES (PF_XCH + PF_NW * PF_BK * 64)  // = ops/attention_tiling.rs prefill_smem_bytes

// (x0, x1) -> hi = bf16x2(x0, x1) and lo = bf16x2(x0 - hi0, x1 - hi1).
__device__ __forceinline__ void split_bf16(float x0, float x1, u32& hi, u32& lo) {
    hi = pack_bf16(x0, x1);
    lo = pack_bf16(x0 - __uint_as_float(hi << 16), x1 - __uint_as_float(hi & 0xffff0000u));
}

// Barrier 1 + pair with immediate ids, so ptxas reserves NP + 1 barriers, not all 16 (which would
// cap the blocks per SM). NP: pairs per block (<= 8).
template <int NP>
__device__ __forceinline__ void pair_sync(int pair) {
#define PF_BAR(p) \
    case p: \
        if (NP > p) asm volatile("bar.sync " #p " + 1, 64;" ::: "memory"); \
        break;
    switch (pair) {
        PF_BAR(0)
        PF_BAR(1)
        PF_BAR(2)
        PF_BAR(3)
        PF_BAR(4)
        PF_BAR(5)
        PF_BAR(6)
        PF_BAR(7)
    }
#undef PF_BAR
}

// One block = 16 queries x PF_HPB query heads of one kv head; warps 2h and 2h+1 (a pair) own query
// head h of the block and split its head dims: each holds Q and the f32 O accumulator for its
// PF_HALF dims only (half the registers of one warp per head, so twice the warps fit on an SM).
// Per KV tile each warp computes S over its half of the dims, the pair swaps the partial S through
// shared memory (named barrier 1 + h, 64 threads) and both add them (a + b == b + a: the two warps
// hold bitwise the same S, max, P and row sums), then each multiplies P by its half of V.
__device__ __forceinline__ void prefill_body(const bf16_t* __restrict__ q, const void* __restrict__ k_cache,
                                             const void* __restrict__ v_cache,
                                             const unsigned short* __restrict__ k_scales,
                                             const unsigned short* __restrict__ v_scales,
                                             const int* __restrict__ block_tables, int max_blocks,
                                             const int* __restrict__ cu_seqlens, const int* __restrict__ seq_lens,
                                             const int* __restrict__ tile_table, bf16_t* __restrict__ o, int Hq,
                                             int Hkv, int page, float scale, long long q_tok, long long q_head) {
    extern __shared__ __align__(16) unsigned char pf_smem[];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, tg = lane & 3;  // mma fragment row group / thread in group
    const int pair = warp >> 1, half = warp & 1;
    const int d0 = half * PF_HALF;  // this warp's first head dim
    const int tile = gridDim.x - 1 - blockIdx.x;  // longest tiles first
    const int s = tile_table[2 * tile], qt = tile_table[2 * tile + 1];
    const int groups = GQA_GROUP / PF_HPB;  // blocks per kv head
    const int hkv = blockIdx.y / groups;
    const int h = hkv * GQA_GROUP + (blockIdx.y % groups) * PF_HPB + pair;
    const int qstart = cu_seqlens[s], qlen = cu_seqlens[s + 1] - qstart;
    const int past = seq_lens[s] - qlen;
    const int i0 = qt * PF_BQ;
    const int nq = min(PF_BQ, qlen - i0);
    const int kend = past + i0 + nq;  // keys [0, kend) are visible to some query of the tile
    const int n_kt = (kend + PF_BK - 1) / PF_BK;
    const long long width = (long long)Hkv * HD;
    const int* bt = block_tables + (long long)s * max_blocks;
#if !KQ_ANY
    const bf16_t* kbase = (const bf16_t*)k_cache + (long long)hkv * HD;
    const bf16_t* vbase = (const bf16_t*)v_cache + (long long)hkv * HD;
#else
    // Byte addressing: token-head row (row * Hkv + hkv) of K_ROWB / V_ROWB bytes.
    const unsigned char* kbytes = (const unsigned char*)k_cache;
    const unsigned char* vbytes = (const unsigned char*)v_cache;
    u32 pend_k = 0, pend_v = 0;  // f16 scale bits of key (tile + tid), tid < PF_BK, for the next tile
#endif
    const u32 sbase = smem_addr(pf_smem);
    const bool page_tiles = (page % PF_BK) == 0;  // every KV tile lies inside one page
    const int pshift = (page & (page - 1)) == 0 ? __ffs(page) - 1 : -1;
#if !KQ_ANY
    const KvLane kvl = kv_lane(tid, width);
#endif
    // Issue the cp.async copies of KV tile j into stage st (one commit group per tile).
    auto load_tile = [&](int j, int st) {
        const int kb = j * PF_BK;
        const u32 dst = sbase + st * PF_STAGE_BYTES;
#if !KQ_ANY
        kv_tile_bf16<PF_NT, PF_BK>(dst, kbase, vbase, bt, page, pshift, page_tiles, width, kb, kend, tid, kvl);
#else
        (void)width;
        kv_tile_q<PF_NT, PF_BK, PF_K_PART>(dst, kbytes, vbytes, k_scales, v_scales, bt, page, pshift, page_tiles, Hkv,
                                           hkv, kb, kend, tid, pend_k, pend_v);
#endif
        cp_async_commit();
    };

    load_tile(0, 0);

    // Q of this warp's head and half as mma A fragments (rows g, g+8; 16 dims per k step), raw bf16.
    u32 qf[PF_HALF / 16][4];
    {
        const bool v0 = g < nq, v1 = g + 8 < nq;
        const bf16_t* q0 = q + (long long)(qstart + i0 + g) * q_tok + (long long)h * q_head + d0 + 2 * tg;
        const bf16_t* q1 = q0 + 8 * q_tok;
#pragma unroll
        for (int ks = 0; ks < PF_HALF / 16; ks++) {
            qf[ks][0] = v0 ? *(const u32*)(q0 + ks * 16) : 0u;
            qf[ks][1] = v1 ? *(const u32*)(q1 + ks * 16) : 0u;
            qf[ks][2] = v0 ? *(const u32*)(q0 + ks * 16 + 8) : 0u;
            qf[ks][3] = v1 ? *(const u32*)(q1 + ks * 16 + 8) : 0u;
        }
    }

    float oacc[PF_HALF / 8][4];
#pragma unroll
    for (int n = 0; n < PF_HALF / 8; n++) oacc[n][0] = oacc[n][1] = oacc[n][2] = oacc[n][3] = 0.0f;
    float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.0f, l1 = 0.0f;  // rows g, g+8 (l: this thread's columns)
    const float sl2 = scale * 1.4426950408889634f;
    const int first_q = past + i0;
    const int qpos0 = first_q + g, qpos1 = qpos0 + 8;
    // This warp's and its partner's partial S, fragment order: [n][lane] float4.
    float4* xme = (float4*)(pf_smem + PF_XCH) + warp * (PF_BK / 8) * 32 + lane;
    const float4* xpa = (const float4*)(pf_smem + PF_XCH) + (warp ^ 1) * (PF_BK / 8) * 32 + lane;

    // ldmatrix lane offsets (bytes) inside a tile, at this warp's first dim.
    // K (non-trans, B of S = Q K^T): matrices (keys 0-7, d 0-7), (keys 0-7, d 8-15), (keys 8-15, d 0-7), (8-15, 8-15).
    const u32 k_lane = (u32)(((lane & 7) + ((lane >> 4) << 3)) * PF_STR + ((lane >> 3) & 1) * 8 + d0) * 2;
    // V (trans, B of O = P V): matrices (keys 0-7, d 0-7), (keys 8-15, d 0-7), (keys 0-7, d 8-15), (8-15, 8-15).
    const u32 v_lane = (u32)(((lane & 7) + (((lane >> 3) & 1) << 3)) * PF_STR + (lane >> 4) * 8 + d0) * 2;

    for (int j = 0; j < n_kt; j++) {
#if KQ_ANY
        // Tile j's scales (loaded by load_tile(j)) to smem before load_tile(j + 1) reuses the
        // registers; the previous iteration's last barrier freed the buffers.
        if (tid < PF_BK) {
            // Only the quantised matrices have a scale row in smem (PF_SMEM_BYTES reserves nothing
            // for a bf16 one: writing it anyway ran past the allocation for quantised K + bf16 V).
#if KQ_K
            ((float*)(pf_smem + PF_SC_K))[tid] = f16_to_f32((unsigned short)pend_k);
#endif
#if KQ_V
            ((float*)(pf_smem + PF_SC_V))[tid] = f16_to_f32((unsigned short)pend_v);
#endif
        }
#endif
        if (j + 1 < n_kt) {
            load_tile(j + 1, (j + 1) & 1);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
#if !KQ_ANY
        const u32 ks_base = sbase + (j & 1) * PF_STAGE_BYTES;
        const u32 vs_base = ks_base + PF_MAT_BYTES;
#else
        const u32 st_base = sbase + (j & 1) * PF_STAGE_BYTES;
#if KQ_K
        pf_convert_tile<KV_K_FMT, PF_NT, PF_BK>(pf_smem + (j & 1) * PF_STAGE_BYTES, pf_smem + PF_CV_K, tid);
        const u32 ks_base = sbase + PF_CV_K;
        const float* sks = (const float*)(pf_smem + PF_SC_K);
#else
        const u32 ks_base = st_base;
#endif
#if KQ_V
        pf_convert_tile<KV_V_FMT, PF_NT, PF_BK>(pf_smem + (j & 1) * PF_STAGE_BYTES + PF_K_PART, pf_smem + PF_CV_V, tid);
        const u32 vs_base = sbase + PF_CV_V;
        const float* svs = (const float*)(pf_smem + PF_SC_V);
#else
        const u32 vs_base = st_base + PF_K_PART;
#endif
        __syncthreads();
#endif

        // This warp's half of S = Q K^T, then the pair's sum.
        float sx[PF_BK / 8][4];
#pragma unroll
        for (int n = 0; n < PF_BK / 8; n++) sx[n][0] = sx[n][1] = sx[n][2] = sx[n][3] = 0.0f;
#pragma unroll
        for (int ks = 0; ks < PF_HALF / 16; ks++) {
#pragma unroll
            for (int np = 0; np < PF_BK / 16; np++) {
                u32 b0, b1, b2, b3;
                ldsm_x4(ks_base + k_lane + (u32)(np * 16 * PF_STR + ks * 16) * 2, b0, b1, b2, b3);
                mma_bf16(sx[2 * np], qf[ks], b0, b1);
                mma_bf16(sx[2 * np + 1], qf[ks], b2, b3);
            }
        }
#pragma unroll
        for (int n = 0; n < PF_BK / 8; n++) xme[n * 32] = make_float4(sx[n][0], sx[n][1], sx[n][2], sx[n][3]);
        pair_sync<PF_HPB>(pair);
#pragma unroll
        for (int n = 0; n < PF_BK / 8; n++) {
            const float4 p = xpa[n * 32];
            sx[n][0] += p.x;
            sx[n][1] += p.y;
            sx[n][2] += p.z;
            sx[n][3] += p.w;
        }

        // Into the log2 domain, scaled by fs at the exponent (bf16 K: the softmax scale rides on the
        // exp's FFMA; quantised K: each key's scale differs, so S is scaled here and fs = 1); causal
        // mask where the tile reaches past the first query.
        const int kb = j * PF_BK;
#if KQ_K
        // K scales of this thread's key columns, folded into the log2-domain factor.
        float f0[PF_BK / 8], f1[PF_BK / 8];
#pragma unroll
        for (int n = 0; n < PF_BK / 8; n++) {
            f0[n] = sks[n * 8 + 2 * tg] * sl2;
            f1[n] = sks[n * 8 + 2 * tg + 1] * sl2;
        }
#define PF_F0(x, n) (x) * f0[n]
#define PF_F1(x, n) (x) * f1[n]
        const float fs = 1.0f;
#else
#define PF_F0(x, n) (x)
#define PF_F1(x, n) (x)
        const float fs = sl2;
#endif
        if (kb + PF_BK - 1 > first_q) {
#pragma unroll
            for (int n = 0; n < PF_BK / 8; n++) {
                const int key = kb + n * 8 + 2 * tg;
                sx[n][0] = key <= qpos0 ? PF_F0(sx[n][0], n) : NEG_INF;
                sx[n][1] = key + 1 <= qpos0 ? PF_F1(sx[n][1], n) : NEG_INF;
                sx[n][2] = key <= qpos1 ? PF_F0(sx[n][2], n) : NEG_INF;
                sx[n][3] = key + 1 <= qpos1 ? PF_F1(sx[n][3], n) : NEG_INF;
            }
        } else {
#pragma unroll
            for (int n = 0; n < PF_BK / 8; n++) {
                sx[n][0] = PF_F0(sx[n][0], n);
                sx[n][1] = PF_F1(sx[n][1], n);
                sx[n][2] = PF_F0(sx[n][2], n);
                sx[n][3] = PF_F1(sx[n][3], n);
            }
        }
#undef PF_F0
#undef PF_F1

        float mx0 = NEG_INF, mx1 = NEG_INF;
#pragma unroll
        for (int n = 0; n < PF_BK / 8; n++) {
            mx0 = fmaxf(mx0, fmaxf(sx[n][0], sx[n][1]));
            mx1 = fmaxf(mx1, fmaxf(sx[n][2], sx[n][3]));
        }
        mx0 = quad_max(mx0);
        mx1 = quad_max(mx1);
        mx0 = fmaxf(m0, mx0 * fs);  // fs > 0: -inf stays -inf
        mx1 = fmaxf(m1, mx1 * fs);
        // A row with no visible key yet keeps max -inf: subtract 0 instead (all its p are 0).
        const float base0 = mx0 == NEG_INF ? 0.0f : mx0, base1 = mx1 == NEG_INF ? 0.0f : mx1;
        const float a0 = pf_exp2(m0 - base0), a1 = pf_exp2(m1 - base1);
        m0 = mx0;
        m1 = mx1;
        float rs0 = 0.0f, rs1 = 0.0f;
#pragma unroll
        for (int n = 0; n < PF_BK / 8; n++) {
            sx[n][0] = pf_exp2(fmaf(sx[n][0], fs, -base0));
            sx[n][1] = pf_exp2(fmaf(sx[n][1], fs, -base0));
            sx[n][2] = pf_exp2(fmaf(sx[n][2], fs, -base1));
            sx[n][3] = pf_exp2(fmaf(sx[n][3], fs, -base1));
            rs0 += sx[n][0] + sx[n][1];
            rs1 += sx[n][2] + sx[n][3];
        }
        l0 = l0 * a0 + rs0;
        l1 = l1 * a1 + rs1;
        if (__any_sync(0xffffffffu, a0 != 1.0f || a1 != 1.0f)) {
#pragma unroll
            for (int n = 0; n < PF_HALF / 8; n++) {
                oacc[n][0] *= a0;
                oacc[n][1] *= a0;
                oacc[n][2] *= a1;
                oacc[n][3] *= a1;
            }
        }

        // O += P V over this warp's half of the dims, 16 keys per k step.
#pragma unroll
        for (int kk = 0; kk < PF_BK / 16; kk++) {
            u32 ph[4];
#if PF_PSPLIT
            // P = hi + lo, both bf16 (hi = bf16(p), lo = bf16(p - hi)): P enters with ~2^-17
            // relative error instead of bf16's 2^-9.
            u32 pl[4];
#define PF_PACK(i, x, y) split_bf16(x, y, ph[i], pl[i])
#else
#define PF_PACK(i, x, y) ph[i] = pack_bf16(x, y)
#endif
#if KQ_V
            // P * vscale of the key (the V codes are unscaled).
            const float va = svs[kk * 16 + 2 * tg], vb = svs[kk * 16 + 2 * tg + 1];
            const float vc = svs[kk * 16 + 8 + 2 * tg], vd = svs[kk * 16 + 8 + 2 * tg + 1];
            PF_PACK(0, sx[2 * kk][0] * va, sx[2 * kk][1] * vb);
            PF_PACK(1, sx[2 * kk][2] * va, sx[2 * kk][3] * vb);
            PF_PACK(2, sx[2 * kk + 1][0] * vc, sx[2 * kk + 1][1] * vd);
            PF_PACK(3, sx[2 * kk + 1][2] * vc, sx[2 * kk + 1][3] * vd);
#else
            PF_PACK(0, sx[2 * kk][0], sx[2 * kk][1]);
            PF_PACK(1, sx[2 * kk][2], sx[2 * kk][3]);
            PF_PACK(2, sx[2 * kk + 1][0], sx[2 * kk + 1][1]);
            PF_PACK(3, sx[2 * kk + 1][2], sx[2 * kk + 1][3]);
#endif
#undef PF_PACK
#pragma unroll
            for (int np = 0; np < PF_HALF / 16; np++) {
                u32 b0, b1, b2, b3;
                ldsm_x4_t(vs_base + v_lane + (u32)(kk * 16 * PF_STR + np * 16) * 2, b0, b1, b2, b3);
                mma_bf16(oacc[2 * np], ph, b0, b1);
                mma_bf16(oacc[2 * np + 1], ph, b2, b3);
#if PF_PSPLIT
                mma_bf16(oacc[2 * np], pl, b0, b1);
                mma_bf16(oacc[2 * np + 1], pl, b2, b3);
#endif
            }
        }
        __syncthreads();  // stage j & 1 and the exchange are rewritten in iteration j + 1
    }

    l0 = quad_sum(l0);
    l1 = quad_sum(l1);
    const float inv0 = l0 > 0.0f ? 1.0f / l0 : 0.0f, inv1 = l1 > 0.0f ? 1.0f / l1 : 0.0f;
    bf16_t* o0 = o + ((long long)(qstart + i0 + g) * Hq + h) * HD + d0 + 2 * tg;
    bf16_t* o1 = o0 + 8LL * Hq * HD;
#pragma unroll
    for (int n = 0; n < PF_HALF / 8; n++) {
        if (g < nq) *(u32*)(o0 + n * 8) = pack_bf16(oacc[n][0] * inv0, oacc[n][1] * inv0);
        if (g + 8 < nq) *(u32*)(o1 + n * 8) = pack_bf16(oacc[n][2] * inv1, oacc[n][3] * inv1);
    }
}

// Registers for 12 resident warps per SM whatever the block size (168 per thread).
extern "C" __global__ void __launch_bounds__(PF_NT, (12 / PF_NW) > 0 ? (12 / PF_NW) : 1)
attn_prefill(const bf16_t* __restrict__ q, const void* __restrict__ k_cache,
             const void* __restrict__ v_cache, const unsigned short* __restrict__ k_scales,
             const unsigned short* __restrict__ v_scales, const int* __restrict__ block_tables, int max_blocks,
             const int* __restrict__ cu_seqlens, const int* __restrict__ seq_lens,
             const int* __restrict__ tile_table, bf16_t* __restrict__ o, int Hq, int Hkv, int page,
             float scale, long long q_tok, long long q_head) {
    prefill_body(q, k_cache, v_cache, k_scales, v_scales, block_tables, max_blocks, cu_seqlens, seq_lens,
                 tile_table, o, Hq, Hkv, page, scale, q_tok, q_head);
}
