// attention_prefill_wg.cu — the causal GQA prefill attention on Hopper's warpgroup tensor-core
// instructions (wgmma, sm_90a), beside the wide kernel (attention_prefill_wide.cu) whose work it does
// with the same launch: grid (n_tiles, Hkv, n_split) over tiles of 128 packed (query, head) rows, the
// same tile table, key split and partial layout, over a bf16 or quantised cache.
// Only the attention module built for sm_90a compiles the body (__CUDA_ARCH_FEAT_SM90_ALL); elsewhere
// the kernel traps and the launcher never picks it.
//
// attn_prefill_wg: 256 threads, two warpgroups of 64 rows each. Per KV tile of 64 keys:
//  S = Q K^T    16 wgmma m64n64k16 (k = 16 head dims each), Q and K both read from shared memory;
//  softmax      online, in the registers of S (a thread holds rows w*16+g and +8, keys 8n+2tg, +1);
//  O += P V     P converted in registers to bf16 A fragments (the accumulator layout of S is the
//               A-fragment layout), V from shared memory read N-major (transposed), O [64 x HD] in
//               f32 registers: HD / 64 blocks of 32 per thread.
// Every tile in shared memory is laid out for the 128-byte swizzle of wgmma: [HD / 64 column blocks]
// [rows][128 B], row r's 16-byte chunk c (of its block) at (c ^ (r & 7)) * 16, 1024-byte aligned atoms
// (8 rows). K is K-major for S (rows = keys, the k dimension = head dims contiguous); the same V tile
// is N-major for P V (k = keys at 128 B, n = head dims contiguous; the next 64 dims a block further:
// the leading byte offset). The loads are cp.async by all threads, double-buffered as in the wide
// kernel; each thread fences its copies into the async proxy before the barrier that publishes them.
// Quantised K / V (as in the wide kernel): a matrix's codes land in the stage, all threads widen them
// into its swizzled bf16 tile after the wait (fenced like the copies), K scales multiply S per key
// column (with the softmax scale), V scales fold into P before its bf16 rounding (the row sums use P
// unscaled).
// Smem (ops/attention_tiling.rs wg_smem_bytes): 1 KB of alignment slack, Q 128 x HD x 2, 2 stages of K + V
// (a bf16 matrix as its swizzled tile, 64 x HD x 2, a quantised one as its codes), each quantised
// matrix's bf16 tile, then its f32 tile scales: 193 KB at HD 256 with bf16 K/V, 193.5 KB with fp8.
#define WG_ROWS PW_ROWS  // the wide kernels' tiles (WideTile)
#define WG_NT 256
#define WG_BK 64
#define WG_Q_BYTES (WG_ROWS * HD * 2)
#define WG_MAT (WG_BK * HD * 2)
#define WG_KPART (KQ_K ? WG_BK * K_ROWB : WG_MAT)
#define WG_VPART (KQ_V ? WG_BK * V_ROWB : WG_MAT)
#define WG_STAGE (WG_KPART + WG_VPART)
#define WG_CVK (WG_Q_BYTES + 2 * WG_STAGE)           // K's bf16 tile (quantised K)
#define WG_CVV (WG_CVK + (KQ_K ? WG_MAT : 0))        // V's bf16 tile (quantised V)
#define WG_SCK (WG_CVV + (KQ_V ? WG_MAT : 0))        // K's f32 tile scales
#define WG_SCV (WG_SCK + (KQ_K ? WG_BK * 4 : 0))     // V's f32 tile scales

#if defined(__CUDA_ARCH_FEAT_SM90_ALL) && (HD % 64 == 0) && HD <= 256
#define WG_BODY 1
#else
#define WG_BODY 0
#endif

#if WG_BODY
// Byte offset of row r's 16-byte chunk ch (over all head dims) in a swizzled tile of `rows` rows.
__device__ __forceinline__ u32 wg_swz(int r, int ch, int rows) {
    return (u32)((ch >> 3) * rows * 128 + r * 128 + (((ch & 7) ^ (r & 7)) << 4));
}

// A shared-memory matrix descriptor with the 128-byte swizzle: start address, leading and stride
// byte offsets, each encoded >> 4.
__device__ __forceinline__ unsigned long long wg_desc(u32 addr, u32 lbo, u32 sbo) {
    return (unsigned long long)((addr & 0x3FFFF) >> 4) | ((unsigned long long)(lbo >> 4) << 16) |
           ((unsigned long long)(sbo >> 4) << 32) | (1ull << 62);
}

// Widens a tile of codes (as they landed in the stage) into its swizzled bf16 tile: 8 elements, one
// 16-byte store, a thread at a time.
template <int FMT>
__device__ __forceinline__ void wg_convert_tile(const unsigned char* raw, u32 cv, int tid) {
    for (int c = tid; c < WG_BK * (HD / 8); c += WG_NT) {
        const int r = c / (HD / 8), ch = c % (HD / 8);
        const uint4 o = kv_widen8<FMT>(raw, r, ch);
        asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(cv + wg_swz(r, ch, WG_BK)), "r"(o.x), "r"(o.y),
                     "r"(o.z), "r"(o.w)
                     : "memory");
    }
}

__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

#define WG_D32                                                                                                   \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, " \
    "%23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define WG_ACC32(d)                                                                                            \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), \
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),   \
        "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), \
        "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])

// d (64 x 64, f32) += A (64 x 16, K-major in smem) * B (16 x 64, K-major in smem); d is overwritten
// when `acc` is 0.
__device__ __forceinline__ void wg_mma_ss(float (&d)[32], unsigned long long da, unsigned long long db, int acc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " WG_D32 ", %32, %33, p, 1, 1, 0, 0;\n}\n"
                 : WG_ACC32(d)
                 : "l"(da), "l"(db), "r"(acc));
}

// d (64 x 64, f32) += A (64 x 16, bf16 fragments in registers) * B (16 x 64, N-major in smem).
__device__ __forceinline__ void wg_mma_rs_t(float (&d)[32], const u32 (&a)[4], unsigned long long db) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " WG_D32
                 ", {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
                 : WG_ACC32(d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}

// O += P V, issued (committed, not waited): P as bf16 A fragments, V the swizzled 64-key tile at vs read
// N-major, one m64n64k16 per 16 keys and 64 head dims.
__device__ __forceinline__ void wg_issue_pv(float (&oacc)[HD / 64][32], const u32 (&pa)[WG_BK / 16][4], u32 vs) {
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < WG_BK / 16; kk++)
#pragma unroll
        for (int b = 0; b < HD / 64; b++)
            wg_mma_rs_t(oacc[b], pa[kk], wg_desc(vs + (u32)(b * WG_BK * 128 + kk * 16 * 128), WG_BK * 128, 1024));
    wg_commit();
}

// The online softmax of a 64-key tile's scores S (a warpgroup's accumulator layout: a thread holds its
// warp's rows g and g + 8, keys 8n + 2tg and + 1), keys from kb, for the warpgroup kernels: quantised K
// scales the key columns by sks (times the log2-domain scale sl2; bf16 K: sl2 rides on the exp), the
// causal mask against the rows' positions qpos (from the block's first query first_q on), new maxima
// (mrow, log2 domain), row sums (lrow, of P unscaled) and P in S's registers, and the factors that
// rescale O to al. Quantised K: rq0 and rq1 scale the rows' scores too (attn_prefill_ws's e4m3 Q).
__device__ __forceinline__ void wg_softmax(float (&sacc)[32], const float* sks, int kb, int first_q, const int (&qpos)[2],
                                           int tg, float sl2, float (&mrow)[2], float (&lrow)[2], float (&al)[2],
                                           float rq0 = 1.0f, float rq1 = 1.0f) {
    if (KQ_K) {
#pragma unroll
        for (int n = 0; n < WG_BK / 8; n++) {
            const float f0 = sks[n * 8 + 2 * tg] * sl2, f1 = sks[n * 8 + 2 * tg + 1] * sl2;
            sacc[4 * n] *= f0;
            sacc[4 * n + 1] *= f1;
            sacc[4 * n + 2] *= f0;
            sacc[4 * n + 3] *= f1;
        }
    }
    if (kb + WG_BK - 1 > first_q) {
#pragma unroll
        for (int n = 0; n < WG_BK / 8; n++) {
            const int key = kb + n * 8 + 2 * tg;
            if (key > qpos[0]) sacc[4 * n] = NEG_INF;
            if (key + 1 > qpos[0]) sacc[4 * n + 1] = NEG_INF;
            if (key > qpos[1]) sacc[4 * n + 2] = NEG_INF;
            if (key + 1 > qpos[1]) sacc[4 * n + 3] = NEG_INF;
        }
    }
#pragma unroll
    for (int hf = 0; hf < 2; hf++) {
        const float fs = KQ_K ? (hf ? rq1 : rq0) : sl2;
        float mx = NEG_INF;
#pragma unroll
        for (int n = 0; n < WG_BK / 8; n++) mx = fmaxf(mx, fmaxf(sacc[4 * n + 2 * hf], sacc[4 * n + 2 * hf + 1]));
        mx = fmaxf(mrow[hf], quad_max(mx) * fs);
        const float base = mx == NEG_INF ? 0.0f : mx;
        al[hf] = pf_exp2(mrow[hf] - base);
        mrow[hf] = mx;
        float rs = 0.0f;
#pragma unroll
        for (int n = 0; n < WG_BK / 8; n++) {
            sacc[4 * n + 2 * hf] = pf_exp2(fmaf(sacc[4 * n + 2 * hf], fs, -base));
            sacc[4 * n + 2 * hf + 1] = pf_exp2(fmaf(sacc[4 * n + 2 * hf + 1], fs, -base));
            rs += sacc[4 * n + 2 * hf] + sacc[4 * n + 2 * hf + 1];
        }
        lrow[hf] = lrow[hf] * al[hf] + rs;
    }
}

// P (the probabilities wg_softmax left in S) as bf16 A fragments, 16 keys per k step: S's n8 tiles 2kk and
// 2kk + 1, times the keys' V scales svs for quantised V.
__device__ __forceinline__ void wg_pack_p(const float (&sacc)[32], const float* svs, int tg, u32 (&pa)[WG_BK / 16][4]) {
#pragma unroll
    for (int kk = 0; kk < WG_BK / 16; kk++) {
        float va = 1.0f, vb = 1.0f, vc = 1.0f, vd = 1.0f;
        if (KQ_V) {
            va = svs[kk * 16 + 2 * tg], vb = svs[kk * 16 + 2 * tg + 1];
            vc = svs[kk * 16 + 8 + 2 * tg], vd = svs[kk * 16 + 8 + 2 * tg + 1];
        }
        pa[kk][0] = pack_bf16(sacc[8 * kk] * va, sacc[8 * kk + 1] * vb);
        pa[kk][1] = pack_bf16(sacc[8 * kk + 2] * va, sacc[8 * kk + 3] * vb);
        pa[kk][2] = pack_bf16(sacc[8 * kk + 4] * vc, sacc[8 * kk + 5] * vd);
        pa[kk][3] = pack_bf16(sacc[8 * kk + 6] * vc, sacc[8 * kk + 7] * vd);
    }
}

// A thread's rows of the warpgroup kernels (rown and rown + 8 of the tile's 128 packed rows): their
// query positions (-1 past the tile's rows), O zeroed, maxima at -inf and sums at 0.
__device__ __forceinline__ void wg_rows_init(const WideTile& wt, int rown, int (&qpos)[2], float (&oacc)[HD / 64][32],
                                             float (&mrow)[2], float (&lrow)[2]) {
#pragma unroll
    for (int hf = 0; hf < 2; hf++) {
        const int r = rown + 8 * hf;
        qpos[hf] = r < wt.nrows ? wt.past + (wt.r0 + r) / GQA_GROUP : -1;
        mrow[hf] = NEG_INF;
        lrow[hf] = 0.0f;
    }
#pragma unroll
    for (int b = 0; b < HD / 64; b++)
#pragma unroll
        for (int i = 0; i < 32; i++) oacc[b][i] = 0.0f;
}

// O (a warpgroup's [64 x HD] accumulators: HD / 64 blocks of 32 a thread) rescaled by its rows' factors,
// skipped where a warp's rows all keep their maxima.
__device__ __forceinline__ void wg_rescale(float (&oacc)[HD / 64][32], const float (&al)[2]) {
    if (__any_sync(0xffffffffu, al[0] != 1.0f || al[1] != 1.0f)) {
#pragma unroll
        for (int b = 0; b < HD / 64; b++)
#pragma unroll
            for (int n = 0; n < 8; n++) {
                oacc[b][4 * n] *= al[0];
                oacc[b][4 * n + 1] *= al[0];
                oacc[b][4 * n + 2] *= al[1];
                oacc[b][4 * n + 3] *= al[1];
            }
    }
}

// A thread's two rows of the tile (rown and rown + 8 of its 128 packed rows) out: O / l in bf16, or with
// a key split (part_o) the unnormalised O and (max in the log2 domain, sum) in attn_decode_combine's
// layout; O times ounit first (attn_prefill_ws's O in units of a power of two over an fp8 V).
__device__ __forceinline__ void wg_store_rows(const float (&oacc)[HD / 64][32], const float (&mrow)[2],
                                              const float (&lrow)[2], const WideTile& wt, int rown, int tg,
                                              bf16_t* __restrict__ o, int Hq, int n_split, int row0,
                                              float* __restrict__ part_o, float* __restrict__ part_ml,
                                              float ounit = 1.0f) {
    const float l0 = quad_sum(lrow[0]), l1 = quad_sum(lrow[1]);
#pragma unroll
    for (int hf = 0; hf < 2; hf++) {
        const int r = rown + 8 * hf;
        if (r >= wt.nrows) continue;
        if (part_o) {
            const long long prow = wide_prow(wt, r, Hq, n_split, row0);
            float* po = part_o + prow * HD + 2 * tg;
#pragma unroll
            for (int b = 0; b < HD / 64; b++)
#pragma unroll
                for (int n = 0; n < 8; n++)
                    *(float2*)(po + b * 64 + n * 8) =
                        make_float2(oacc[b][4 * n + 2 * hf] * ounit, oacc[b][4 * n + 2 * hf + 1] * ounit);
            if (tg == 0) {
                part_ml[2 * prow] = mrow[hf];
                part_ml[2 * prow + 1] = hf ? l1 : l0;
            }
        } else {
            const int pr = wt.r0 + r, i = pr / GQA_GROUP, hh = pr - i * GQA_GROUP;
            const float l = hf ? l1 : l0;
            const float inv = l > 0.0f ? ounit / l : 0.0f;
            bf16_t* orow = o + ((long long)(wt.qstart + i) * Hq + wt.hkv * GQA_GROUP + hh) * HD + 2 * tg;
#pragma unroll
            for (int b = 0; b < HD / 64; b++)
#pragma unroll
                for (int n = 0; n < 8; n++)
                    *(u32*)(orow + b * 64 + n * 8) =
                        pack_bf16(oacc[b][4 * n + 2 * hf] * inv, oacc[b][4 * n + 2 * hf + 1] * inv);
        }
    }
}
#endif

extern "C" __global__ void __launch_bounds__(WG_NT, 1)
attn_prefill_wg(const bf16_t* __restrict__ q, const void* __restrict__ k_cache, const void* __restrict__ v_cache,
                const unsigned short* __restrict__ k_scales, const unsigned short* __restrict__ v_scales,
                const int* __restrict__ block_tables, int max_blocks, const int* __restrict__ cu_seqlens,
                const int* __restrict__ seq_lens, const int* __restrict__ tile_table, bf16_t* __restrict__ o, int Hq,
                int Hkv, int page, float scale, long long q_tok, long long q_head, int n_split, int row0,
                float* __restrict__ part_o, float* __restrict__ part_ml) {
#if WG_BODY
    constexpr int NB = HD / 64;  // 64-dim column blocks
    constexpr int CH = HD / 8;   // 16-byte chunks per row
    extern __shared__ __align__(16) unsigned char wg_smem[];
    const u32 sbase = (smem_addr(wg_smem) + 1023u) & ~1023u;
    unsigned char* const sptr = wg_smem + (sbase - smem_addr(wg_smem));  // the aligned base, generic
    const int tid = threadIdx.x, wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31;
    const int g = lane >> 2, tg = lane & 3;
    const WideTile wt = wide_tile<WG_BK>(tile_table, cu_seqlens, seq_lens, n_split, part_o != nullptr);
    const int s = wt.s, hkv = wt.hkv;
    const int first_q = wt.first_q, kend = wt.kend, jb = wt.jb, je = wt.je;
    if (jb >= je) {
        wide_mark_empty<WG_NT>(wt, part_ml, Hq, n_split, row0, tid);
        return;
    }
    const int* bt = block_tables + (long long)s * max_blocks;
    const u32 kv0 = sbase + WG_Q_BYTES;
    const bool page_tiles = (page % WG_BK) == 0;
    const int pshift = (page & (page - 1)) == 0 ? __ffs(page) - 1 : -1;

    wide_load_q<WG_NT>(q, wt, q_tok, q_head, tid, [&](int r, int ch) { return sbase + wg_swz(r, ch, WG_ROWS); });
    u32 pend_k = 0, pend_v = 0;  // f16 scale bits of key (tile + tid), tid < 64, for the next tile
    // Keys [kb, kb + 64) of K and V into the stage at dst (a bf16 matrix as its swizzled tile, codes
    // as 64 rows of K_ROWB / V_ROWB bytes, the scales of key kb + tid to pend_k / pend_v); keys at or
    // past kend zero-filled (P is 0 there, and 0 * a zero V stays 0).
    auto load_tile = [&](int kb, u32 dst) {
        long long trow = 0;
        if (page_tiles) {
            const int pg = pshift >= 0 ? kb >> pshift : kb / page;
            trow = (long long)bt[pg] * page + (kb - pg * page);
        }
        auto row_of = [&](int p, int r) -> long long {
            if (page_tiles) return trow + r;
            const int pg = pshift >= 0 ? p >> pshift : p / page;
            return (long long)bt[pg] * page + (p - pg * page);
        };
#if !KQ_ANY
        // bf16 K and V: one address for both copies of a (key, chunk).
        const long long width = (long long)Hkv * HD;
        const bf16_t* kbase = (const bf16_t*)k_cache + (long long)hkv * HD;
        const bf16_t* vbase = (const bf16_t*)v_cache + (long long)hkv * HD;
#pragma unroll 4
        for (int c = tid; c < WG_BK * CH; c += WG_NT) {
            const int r = c / CH, ch = c % CH;
            const int p = kb + r;
            const bool ok = p < kend;
            const long long off = (ok ? row_of(p, r) : 0) * width + ch * 8;
            const u32 d = dst + wg_swz(r, ch, WG_BK);
            cp_async16(d, kbase + off, ok ? 16 : 0);
            cp_async16(d + WG_MAT, vbase + off, ok ? 16 : 0);
        }
#else
#pragma unroll
        for (int m = 0; m < 2; m++) {
            const bool quant = m == 0 ? KQ_K : KQ_V;
            const int rowb = m == 0 ? K_ROWB : V_ROWB;  // bytes a token-head row
            const int nch = rowb / 16;
            const unsigned char* src = (const unsigned char*)(m == 0 ? k_cache : v_cache);
            const u32 dm = dst + (m == 0 ? 0 : WG_KPART);
#pragma unroll 4
            for (int c = tid; c < WG_BK * nch; c += WG_NT) {
                const int r = c / nch, ch = c % nch;
                const int p = kb + r;
                const bool ok = p < kend;
                const long long row = ok ? row_of(p, r) : 0;
                const u32 d = dm + (quant ? (u32)(r * rowb + ch * 16) : wg_swz(r, ch, WG_BK));
                cp_async16(d, src + (row * Hkv + hkv) * rowb + ch * 16, ok ? 16 : 0);
            }
        }
#endif
        if (KQ_ANY && tid < WG_BK) {
            const int p = kb + tid;
            unsigned short a = 0, b = 0;
            if (p < kend) {
                const long long row = row_of(p, tid);
                if (KQ_K) a = k_scales[row * Hkv + hkv];
                if (KQ_V) b = v_scales[row * Hkv + hkv];
            }
            pend_k = a;
            pend_v = b;
        }
        cp_async_commit();
    };
    load_tile(jb * WG_BK, kv0 + (jb & 1) * WG_STAGE);

    // Own rows (of the block's 128): wg * 64 + warp * 16 + g and + 8.
    const int rown = wg * 64 + warp * 16 + g;
    int qpos[2];
    float oacc[NB][32], mrow[2], lrow[2];
    wg_rows_init(wt, rown, qpos, oacc, mrow, lrow);
    const float sl2 = scale * 1.4426950408889634f;  // log2 domain
    const u32 q_wg = sbase + (u32)(wg * 64 * 128);   // this warpgroup's rows in each column block

    for (int j = jb; j < je; j++) {
        if (KQ_ANY && tid < WG_BK) {
            // Tile j's scales (loaded with its codes) to smem before load_tile(j + 1) reuses the
            // registers; the previous iteration's last barrier freed the buffers.
            if (KQ_K) ((float*)(sptr + WG_SCK))[tid] = f16_to_f32((unsigned short)pend_k);
            if (KQ_V) ((float*)(sptr + WG_SCV))[tid] = f16_to_f32((unsigned short)pend_v);
        }
        if (j + 1 < je) {
            load_tile((j + 1) * WG_BK, kv0 + ((j + 1) & 1) * WG_STAGE);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        fence_proxy_async();
        __syncthreads();
        const u32 st = kv0 + (j & 1) * WG_STAGE;
        if (KQ_ANY) {
            // Quantised matrices: widen the codes into swizzled bf16 tiles (exact), read like bf16 ones.
            if (KQ_K) wg_convert_tile<KV_K_FMT>(sptr + (st - sbase), sbase + WG_CVK, tid);
            if (KQ_V) wg_convert_tile<KV_V_FMT>(sptr + (st - sbase) + WG_KPART, sbase + WG_CVV, tid);
            fence_proxy_async();
            __syncthreads();
        }
        const u32 ks = KQ_K ? sbase + WG_CVK : st, vs = KQ_V ? sbase + WG_CVV : st + WG_KPART;

        float sacc[32];
#pragma unroll
        for (int i = 0; i < 32; i++) sacc[i] = 0.0f;
        wg_fence();
#pragma unroll
        for (int k = 0; k < HD / 16; k++) {
            const unsigned long long da = wg_desc(q_wg + (u32)((k >> 2) * WG_ROWS * 128 + (k & 3) * 32), 16, 1024);
            const unsigned long long db = wg_desc(ks + (u32)((k >> 2) * WG_BK * 128 + (k & 3) * 32), 16, 1024);
            wg_mma_ss(sacc, da, db, 1);
        }
        wg_commit();
        wg_wait0();
        float al[2];
        u32 pa[WG_BK / 16][4];
        wg_softmax(sacc, (const float*)(sptr + WG_SCK), j * WG_BK, first_q, qpos, tg, sl2, mrow, lrow, al);
        wg_rescale(oacc, al);
        wg_pack_p(sacc, (const float*)(sptr + WG_SCV), tg, pa);
        wg_issue_pv(oacc, pa, vs);
        wg_wait0();
        __syncthreads();
    }

    wg_store_rows(oacc, mrow, lrow, wt, rown, tg, o, Hq, n_split, row0, part_o, part_ml);
#else
    (void)q, (void)k_cache, (void)v_cache, (void)k_scales, (void)v_scales, (void)block_tables, (void)max_blocks;
    (void)cu_seqlens, (void)seq_lens, (void)tile_table, (void)o, (void)Hq, (void)Hkv, (void)page, (void)scale;
    (void)q_tok, (void)q_head, (void)n_split, (void)row0, (void)part_o, (void)part_ml;
    __trap();
#endif
}
