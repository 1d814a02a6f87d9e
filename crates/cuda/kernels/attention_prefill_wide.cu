// attention_prefill_wide.cu — the wide causal GQA prefill kernels (attention_tile.cuh has the computation,
// shapes and KV formats; attention_prefill.cu the warp-pair kernel whose tiling macros (PF_*) and helpers
// these reuse; the two files are one NVRTC module, concatenated in that order).
// attn_prefill_wide / attn_prefill_wide64 (BK = 32 / 64 keys per KV tile): the same attention with
// 128 (query, head) rows per block — packed GQA rows (row r of a sequence is query r / GQA_GROUP,
// head r % GQA_GROUP of the kv head), so a block fills its rows whatever the group size — in 4 warp
// pairs of 32 rows (two m16 tiles). Per KV tile each warp of a pair computes S for its own m16 tile
// over all head dims (even and odd k steps in two accumulator sets at BK 32: shorter HMMA chains)
// and runs the online softmax of its 16 rows; the pair swaps P (bf16 A fragments) and the rows'
// rescale factors through shared memory (named barrier 1 + pair), and each warp multiplies both
// tiles' P by its half of V (O for 32 rows x HD/2 dims: 128 registers at HD 256). Against
// attn_prefill (16 queries x 6 heads, a warp pair per m16 tile exchanging partial S in f32 and both
// running the same softmax): each V fragment feeds two m16 tiles, each K/V tile serves 128 rows
// instead of 96, the softmax is not duplicated and the exchange is 4x smaller. Q cannot live in
// registers, so it sits in shared memory, XOR-swizzled (row r's 16-byte chunk c at c ^ (r & 7): the
// 8 rows of an ldmatrix hit distinct banks without padding) and is re-read per KV tile. 8 warps of up
// to 255 registers per SM; plain bf16 P only (the hi/lo split: attn_prefill). Quantised K / V as in
// attn_prefill: the codes land in the stage, all threads widen them into a bf16 tile after the wait,
// K scales multiply S per key column (with the softmax scale), V scales fold into P before its bf16
// rounding (the row sums use P unscaled).
// Smem (HD 256, bf16 K/V): Q 64 KB + 2 stages x (K + V) x BK keys (66 / 132 KB) + the exchange 10 /
// 18 KB = 140 KB at BK 32 (sm_80, sm_90; not sm_86/89's 99 KB: they use attn_prefill), 214 KB at BK
// 64 (sm_90); fp8 K/V at BK 64: 212.5 KB.
// Measured (H200, 27B shape, 4096 causal queries, bench/results/attention-prefill-wide-h200-2026-11-30.md): 274
// TFLOP/s at 128K keys at BK 64, 245 at BK 32 (attn_prefill: 205; a first wide version that split S by
// head dims as attn_prefill does: 226).
// Split over the keys (part_o not null; short chunks over a long context, where the tiles alone are a
// handful of blocks each streaming the whole context): grid.z = n_split, block z takes the z-th of
// n_split equal runs of its tile's KV tiles and writes its rows' unnormalised O and (max in the log2
// domain, sum) in f32 at partial (query - row0, head, z) — attn_decode_combine's layout, which it then
// merges (no seq_lens: n_split partials a row; a split past a tile's last KV tile marks its rows empty).
// Launch: grid (n_tiles, Hkv, n_split), block PW_NT, dynamic smem ops/attention_tiling.rs wide_smem_bytes;
// tile_table [n_tiles, 2] = (seq, 128-row tile) over the packed rows (q_len * GQA_GROUP per sequence).
// q 16-byte aligned with q_tok, q_head multiples of 8.
#define PW_ROWS 128                        // packed (query, head) rows per block
#define PW_NW 8                            // warps per block: 4 pairs x 32 rows
#define PW_NT (32 * PW_NW)
#define PW_KV0 (PW_ROWS * HD * 2)          // the K/V stages follow the Q tile
#define PW_SWZ (PF_CH >= 8 ? 7 : PF_CH - 1)
// Smem layout for BK keys per tile (its total = ops/attention_tiling.rs wide_smem_bytes): Q, 2 stages of K + V (a
// bf16 matrix as a padded tile, a quantised one as its codes), for each quantised matrix its
// converted bf16 tile and then its f32 tile scales, the P exchange (BK / 16 uint4 per lane and warp),
// the factor exchange (a float2 per lane and warp).
__host__ __device__ constexpr int pw_mat(int bk) { return bk * PF_STR * 2; }
__host__ __device__ constexpr int pw_kpart(int bk) { return KQ_K ? bk * K_ROWB : pw_mat(bk); }
__host__ __device__ constexpr int pw_stage(int bk) { return pw_kpart(bk) + (KQ_V ? bk * V_ROWB : pw_mat(bk)); }
__host__ __device__ constexpr int pw_cvk(int bk) { return PW_KV0 + 2 * pw_stage(bk); }
__host__ __device__ constexpr int pw_cvv(int bk) { return pw_cvk(bk) + (KQ_K ? pw_mat(bk) : 0); }
__host__ __device__ constexpr int pw_sck(int bk) { return pw_cvv(bk) + (KQ_V ? pw_mat(bk) : 0); }
__host__ __device__ constexpr int pw_scv(int bk) { return pw_sck(bk) + (KQ_K ? bk * 4 : 0); }
__host__ __device__ constexpr int pw_xch(int bk) { return pw_scv(bk) + (KQ_V ? bk * 4 : 0); }
__host__ __device__ constexpr int pw_xa(int bk) { return pw_xch(bk) + PW_NW * 32 * bk; }
// The block's dynamic shared memory ends after the factor exchange: pw_xa(bk) + PW_NW * 32 * 8 bytes.

// A block's tile of PW_ROWS packed rows of one sequence for kv head blockIdx.y (the wide kernels and
// attn_prefill_wg; HEADS_X: the tile from blockIdx.y and the kv head blockIdx.x, so blocks launch every
// head's tile before the next tile's, the heaviest tiles of all heads first), and its share of the tile's
// KV tiles of BK keys: jb .. je of them, all without a split; with one (`split`: part_o given) the
// blockIdx.z-th of n_split equal runs.
struct WideTile {
    int s, hkv, qstart, past, r0, nrows, first_q, kend, jb, je;
};

template <int BK, bool HEADS_X = false>
__device__ __forceinline__ WideTile wide_tile(const int* __restrict__ tile_table, const int* __restrict__ cu_seqlens,
                                              const int* __restrict__ seq_lens, int n_split, bool split) {
    WideTile t;
    const int tile = HEADS_X ? gridDim.y - 1 - blockIdx.y : gridDim.x - 1 - blockIdx.x;
    t.s = tile_table[2 * tile];
    const int rt = tile_table[2 * tile + 1];
    t.hkv = HEADS_X ? blockIdx.x : blockIdx.y;
    t.qstart = cu_seqlens[t.s];
    const int qlen = cu_seqlens[t.s + 1] - t.qstart;
    t.past = seq_lens[t.s] - qlen;
    t.r0 = rt * PW_ROWS;
    t.nrows = min(PW_ROWS, qlen * GQA_GROUP - t.r0);
    t.first_q = t.past + t.r0 / GQA_GROUP;
    t.kend = t.past + (t.r0 + t.nrows - 1) / GQA_GROUP + 1;
    const int n_kt = (t.kend + BK - 1) / BK;
    const int per = (n_kt + n_split - 1) / n_split;
    t.jb = split ? blockIdx.z * per : 0;
    t.je = split ? min(n_kt, t.jb + per) : n_kt;
    return t;
}

// Copies the tile's packed Q rows (row r: query r / GQA_GROUP, head r % GQA_GROUP of its kv head) into
// shared memory with cp.async, row r's 16-byte chunk ch to dst(r, ch), rows past the tile zero-filled:
// threads t = 0 .. NT - 1 of the block; the caller commits.
template <int NT, typename Dst>
__device__ __forceinline__ void wide_load_q(const bf16_t* __restrict__ q, const WideTile& wt, long long q_tok,
                                            long long q_head, int t, Dst dst) {
    for (int c = t; c < PW_ROWS * (HD / 8); c += NT) {
        const int r = c / (HD / 8), ch = c % (HD / 8);
        const bool ok = r < wt.nrows;
        const int pr = wt.r0 + r, i = pr / GQA_GROUP, hh = pr - i * GQA_GROUP;
        const bf16_t* src =
            ok ? q + (long long)(wt.qstart + i) * q_tok + (long long)(wt.hkv * GQA_GROUP + hh) * q_head + ch * 8 : q;
        cp_async16(dst(r, ch), src, ok ? 16 : 0);
    }
}

// The partial (attn_decode_combine's layout: query - row0, head, split) of the tile's row r.
__device__ __forceinline__ long long wide_prow(const WideTile& t, int r, int Hq, int n_split, int row0) {
    const int pr = t.r0 + r, i = pr / GQA_GROUP, hh = pr - i * GQA_GROUP;
    return ((long long)(t.qstart + i - row0) * Hq + t.hkv * GQA_GROUP + hh) * n_split + blockIdx.z;
}

// A split past its tile's last KV tile: marks the rows' partials empty (NT threads).
template <int NT>
__device__ __forceinline__ void wide_mark_empty(const WideTile& t, float* __restrict__ part_ml, int Hq, int n_split,
                                                int row0, int tid) {
    for (int r = tid; r < t.nrows; r += NT) {
        const long long prow = wide_prow(t, r, Hq, n_split, row0);
        part_ml[2 * prow] = NEG_INF;
        part_ml[2 * prow + 1] = 0.0f;
    }
}

template <int BK>
__device__ __forceinline__ void wide_body(const bf16_t* __restrict__ q, const void* __restrict__ k_cache,
                                          const void* __restrict__ v_cache,
                                          const unsigned short* __restrict__ k_scales,
                                          const unsigned short* __restrict__ v_scales, const int* __restrict__ block_tables,
                                          int max_blocks, const int* __restrict__ cu_seqlens,
                                          const int* __restrict__ seq_lens, const int* __restrict__ tile_table,
                                          bf16_t* __restrict__ o, int Hq, int Hkv, int page, float scale,
                                          long long q_tok, long long q_head, int n_split, int row0,
                                          float* __restrict__ part_o, float* __restrict__ part_ml) {
    constexpr int MAT = pw_mat(BK), STAGE = pw_stage(BK);
    constexpr bool SPLIT_S = BK == 32;  // two accumulator sets for S (registers allow it at 32 keys)
    extern __shared__ __align__(16) unsigned char pw_smem[];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, tg = lane & 3;
    const int pair = warp >> 1, half = warp & 1;
    const int d0 = half * PF_HALF;
    // Split over the keys (part_o given): this block's KV tiles jb .. je, its unnormalised partials to
    // part_o / part_ml. A split past the block's last tile only marks its rows empty.
    const WideTile wt = wide_tile<BK>(tile_table, cu_seqlens, seq_lens, n_split, part_o != nullptr);
    const int s = wt.s, hkv = wt.hkv, qstart = wt.qstart, past = wt.past, r0 = wt.r0, nrows = wt.nrows;
    const int first_q = wt.first_q, kend = wt.kend, jb = wt.jb, je = wt.je;
    if (jb >= je) {
        wide_mark_empty<PW_NT>(wt, part_ml, Hq, n_split, row0, tid);
        return;
    }
    const long long width = (long long)Hkv * HD;
    const int* bt = block_tables + (long long)s * max_blocks;
#if !KQ_ANY
    const bf16_t* kbase = (const bf16_t*)k_cache + (long long)hkv * HD;
    const bf16_t* vbase = (const bf16_t*)v_cache + (long long)hkv * HD;
#else
    u32 pend_k = 0, pend_v = 0;  // f16 scale bits of key (tile + tid), tid < BK, for the next tile
#endif
    const u32 sbase = smem_addr(pw_smem);
    const u32 kv0 = sbase + PW_KV0;
    const bool page_tiles = (page % BK) == 0;
    const int pshift = (page & (page - 1)) == 0 ? __ffs(page) - 1 : -1;

    wide_load_q<PW_NT>(q, wt, q_tok, q_head, tid,
                       [&](int r, int ch) { return sbase + (u32)(r * HD * 2 + (ch ^ (r & PW_SWZ)) * 16); });
#if !KQ_ANY
    const KvLane kvl = kv_lane(tid, width);
    // 64-key tiles over 32-key pages: two one-page halves (no per-row block-table lookups).
    const bool halves = BK == 64 && !page_tiles && page % 32 == 0;
#else
    (void)width;
#endif
    auto load_tile = [&](int kb, u32 dst) {
#if KQ_ANY
        kv_tile_q<PW_NT, BK, pw_kpart(BK)>(dst, (const unsigned char*)k_cache, (const unsigned char*)v_cache,
                                           k_scales, v_scales, bt, page, pshift, page_tiles, Hkv, hkv, kb, kend,
                                           tid, pend_k, pend_v);
#else
        if (halves) {
            kv_tile_bf16<PW_NT, 32, MAT>(dst, kbase, vbase, bt, page, pshift, true, width, kb, kend, tid, kvl);
            kv_tile_bf16<PW_NT, 32, MAT>(dst + 32 * PF_STR * 2, kbase, vbase, bt, page, pshift, true, width, kb + 32,
                                         kend, tid, kvl);
        } else {
            kv_tile_bf16<PW_NT, BK>(dst, kbase, vbase, bt, page, pshift, page_tiles, width, kb, kend, tid, kvl);
        }
#endif
        cp_async_commit();
    };
    load_tile(jb * BK, kv0 + (jb & 1) * STAGE);

    // Own rows: m tile `half` of the pair, rows g and g + 8.
    int qpos[2];
#pragma unroll
    for (int hf = 0; hf < 2; hf++) {
        const int r = 32 * pair + 16 * half + 8 * hf + g;
        qpos[hf] = r < nrows ? past + (r0 + r) / GQA_GROUP : -1;
    }
    // Q lane addresses of the own tile over all dims: chunk 2 ks + (lane >> 4), ks = 4u + v.
    u32 qa[4];
#pragma unroll
    for (int v = 0; v < 4; v++)
        qa[v] = sbase + (u32)((32 * pair + 16 * half + (lane & 15)) * HD * 2 + (((lane >> 4) + 2 * v) ^ (lane & PW_SWZ)) * 16);
    const u32 k_lane = (u32)(((lane & 7) + ((lane >> 4) << 3)) * PF_STR + ((lane >> 3) & 1) * 8) * 2;  // all dims
    const u32 v_lane = (u32)(((lane & 7) + (((lane >> 3) & 1) << 3)) * PF_STR + (lane >> 4) * 8 + d0) * 2;

    float oacc[2][PF_HALF / 8][4];
#pragma unroll
    for (int mt = 0; mt < 2; mt++)
#pragma unroll
        for (int n = 0; n < PF_HALF / 8; n++) oacc[mt][n][0] = oacc[mt][n][1] = oacc[mt][n][2] = oacc[mt][n][3] = 0.0f;
    float mrow[2] = {NEG_INF, NEG_INF}, lrow[2] = {0.0f, 0.0f};
    const float sl2 = scale * 1.4426950408889634f;  // log2 domain
    // bf16 K: the scale rides on the exp's FFMA; quantised K: S is scaled per key column below.
    const float fs = KQ_K ? 1.0f : sl2;
    // Exchange per warp: P of its tile (BK / 16 x 4 u32 per lane) and its rows' factors (float2).
    uint4* xp_me = (uint4*)(pw_smem + pw_xch(BK)) + warp * (BK / 16) * 32 + lane;
    const uint4* xp_pa = (const uint4*)(pw_smem + pw_xch(BK)) + (warp ^ 1) * (BK / 16) * 32 + lane;
    float2* xa_me = (float2*)(pw_smem + pw_xa(BK)) + warp * 32 + lane;
    const float2* xa_pa = (const float2*)(pw_smem + pw_xa(BK)) + (warp ^ 1) * 32 + lane;

    for (int j = jb; j < je; j++) {
#if KQ_ANY
        // Tile j's scales (loaded with its codes) to smem before load_tile(j + 1) reuses the
        // registers; the previous iteration's last barrier freed the buffers.
        if (tid < BK) {
            if (KQ_K) ((float*)(pw_smem + pw_sck(BK)))[tid] = f16_to_f32((unsigned short)pend_k);
            if (KQ_V) ((float*)(pw_smem + pw_scv(BK)))[tid] = f16_to_f32((unsigned short)pend_v);
        }
#endif
        if (j + 1 < je) {
            load_tile((j + 1) * BK, kv0 + ((j + 1) & 1) * STAGE);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const u32 st_base = kv0 + (j & 1) * STAGE;
#if KQ_ANY
        // Quantised matrices: widen the codes into bf16 tiles (exact), read like bf16 ones below.
#if KQ_K
        pf_convert_tile<KV_K_FMT, PW_NT, BK>(pw_smem + PW_KV0 + (j & 1) * STAGE, pw_smem + pw_cvk(BK), tid);
#endif
#if KQ_V
        pf_convert_tile<KV_V_FMT, PW_NT, BK>(pw_smem + PW_KV0 + (j & 1) * STAGE + pw_kpart(BK), pw_smem + pw_cvv(BK),
                                             tid);
#endif
        __syncthreads();
#endif
        const u32 ks_base = KQ_K ? sbase + pw_cvk(BK) : st_base;
        const u32 vs_base = KQ_V ? sbase + pw_cvv(BK) : st_base + pw_kpart(BK);

        // S of the own 16 rows over all dims; even / odd k steps in two accumulator sets (shorter chains).
        float sx[BK / 8][4], sy[BK / 8][4];
#pragma unroll
        for (int n = 0; n < BK / 8; n++)
            sx[n][0] = sx[n][1] = sx[n][2] = sx[n][3] = sy[n][0] = sy[n][1] = sy[n][2] = sy[n][3] = 0.0f;
#pragma unroll
        for (int ks = 0; ks < HD / 16; ks++) {
            u32 a[4];
            ldsm_x4(qa[ks & 3] + (u32)((ks >> 2) * 128), a[0], a[1], a[2], a[3]);
#pragma unroll
            for (int np = 0; np < BK / 16; np++) {
                u32 b0, b1, b2, b3;
                ldsm_x4(ks_base + k_lane + (u32)(np * 16 * PF_STR + ks * 16) * 2, b0, b1, b2, b3);
                if (SPLIT_S && (ks & 1)) {
                    mma_bf16(sy[2 * np], a, b0, b1);
                    mma_bf16(sy[2 * np + 1], a, b2, b3);
                } else {
                    mma_bf16(sx[2 * np], a, b0, b1);
                    mma_bf16(sx[2 * np + 1], a, b2, b3);
                }
            }
        }
#pragma unroll
        for (int n = 0; n < (SPLIT_S ? BK / 8 : 0); n++) {
            sx[n][0] += sy[n][0];
            sx[n][1] += sy[n][1];
            sx[n][2] += sy[n][2];
            sx[n][3] += sy[n][3];
        }
#if KQ_K
        {
            const float* sks = (const float*)(pw_smem + pw_sck(BK));
#pragma unroll
            for (int n = 0; n < BK / 8; n++) {
                const float f0 = sks[n * 8 + 2 * tg] * sl2, f1 = sks[n * 8 + 2 * tg + 1] * sl2;
                sx[n][0] *= f0;
                sx[n][1] *= f1;
                sx[n][2] *= f0;
                sx[n][3] *= f1;
            }
        }
#endif
        const int kb = j * BK;
        if (kb + BK - 1 > first_q) {
#pragma unroll
            for (int n = 0; n < BK / 8; n++) {
                const int key = kb + n * 8 + 2 * tg;
                if (key > qpos[0]) sx[n][0] = NEG_INF;
                if (key + 1 > qpos[0]) sx[n][1] = NEG_INF;
                if (key > qpos[1]) sx[n][2] = NEG_INF;
                if (key + 1 > qpos[1]) sx[n][3] = NEG_INF;
            }
        }
        float al[2];
#pragma unroll
        for (int hf = 0; hf < 2; hf++) {
            float mx = NEG_INF;
#pragma unroll
            for (int n = 0; n < BK / 8; n++) mx = fmaxf(mx, fmaxf(sx[n][2 * hf], sx[n][2 * hf + 1]));
            mx = fmaxf(mrow[hf], quad_max(mx) * fs);
            const float base = mx == NEG_INF ? 0.0f : mx;
            al[hf] = pf_exp2(mrow[hf] - base);
            mrow[hf] = mx;
            float rs = 0.0f;
#pragma unroll
            for (int n = 0; n < BK / 8; n++) {
                sx[n][2 * hf] = pf_exp2(fmaf(sx[n][2 * hf], fs, -base));
                sx[n][2 * hf + 1] = pf_exp2(fmaf(sx[n][2 * hf + 1], fs, -base));
                rs += sx[n][2 * hf] + sx[n][2 * hf + 1];
            }
            lrow[hf] = lrow[hf] * al[hf] + rs;
        }
        // Own P as bf16 A fragments (16 keys per step), to the partner with the rescale factors.
        u32 po[BK / 16][4];
#pragma unroll
        for (int kk = 0; kk < BK / 16; kk++) {
#if KQ_V
            // P * vscale of the key (the V codes are unscaled; the row sums above use P unscaled).
            const float* svs = (const float*)(pw_smem + pw_scv(BK));
            const float va = svs[kk * 16 + 2 * tg], vb = svs[kk * 16 + 2 * tg + 1];
            const float vc = svs[kk * 16 + 8 + 2 * tg], vd = svs[kk * 16 + 8 + 2 * tg + 1];
#else
            const float va = 1.0f, vb = 1.0f, vc = 1.0f, vd = 1.0f;
#endif
            po[kk][0] = pack_bf16(sx[2 * kk][0] * va, sx[2 * kk][1] * vb);
            po[kk][1] = pack_bf16(sx[2 * kk][2] * va, sx[2 * kk][3] * vb);
            po[kk][2] = pack_bf16(sx[2 * kk + 1][0] * vc, sx[2 * kk + 1][1] * vd);
            po[kk][3] = pack_bf16(sx[2 * kk + 1][2] * vc, sx[2 * kk + 1][3] * vd);
            xp_me[kk * 32] = make_uint4(po[kk][0], po[kk][1], po[kk][2], po[kk][3]);
        }
        *xa_me = make_float2(al[0], al[1]);
        pair_sync<PW_NW / 2>(pair);
        u32 pq[BK / 16][4];
#pragma unroll
        for (int kk = 0; kk < BK / 16; kk++) {
            const uint4 t = xp_pa[kk * 32];
            pq[kk][0] = t.x;
            pq[kk][1] = t.y;
            pq[kk][2] = t.z;
            pq[kk][3] = t.w;
        }
        const float2 ap = *xa_pa;
        // Factors of m tile 0 / 1 (own tile = half).
        const float a00 = half ? ap.x : al[0], a01 = half ? ap.y : al[1];
        const float a10 = half ? al[0] : ap.x, a11 = half ? al[1] : ap.y;
        if (__any_sync(0xffffffffu, a00 != 1.0f || a01 != 1.0f || a10 != 1.0f || a11 != 1.0f)) {
#pragma unroll
            for (int n = 0; n < PF_HALF / 8; n++) {
                oacc[0][n][0] *= a00;
                oacc[0][n][1] *= a00;
                oacc[0][n][2] *= a01;
                oacc[0][n][3] *= a01;
                oacc[1][n][0] *= a10;
                oacc[1][n][1] *= a10;
                oacc[1][n][2] *= a11;
                oacc[1][n][3] *= a11;
            }
        }
#pragma unroll
        for (int kk = 0; kk < BK / 16; kk++) {
            u32 p0[4], p1[4];
#pragma unroll
            for (int i = 0; i < 4; i++) {
                p0[i] = half ? pq[kk][i] : po[kk][i];
                p1[i] = half ? po[kk][i] : pq[kk][i];
            }
#pragma unroll
            for (int np = 0; np < PF_HALF / 16; np++) {
                u32 b0, b1, b2, b3;
                ldsm_x4_t(vs_base + v_lane + (u32)(kk * 16 * PF_STR + np * 16) * 2, b0, b1, b2, b3);
                mma_bf16(oacc[0][2 * np], p0, b0, b1);
                mma_bf16(oacc[0][2 * np + 1], p0, b2, b3);
                mma_bf16(oacc[1][2 * np], p1, b0, b1);
                mma_bf16(oacc[1][2 * np + 1], p1, b2, b3);
            }
        }
        __syncthreads();
    }

    // Row sums: own tile's from this warp, the other tile's from the partner.
    const float l0 = quad_sum(lrow[0]), l1 = quad_sum(lrow[1]);
    *xa_me = make_float2(l0, l1);
    pair_sync<PW_NW / 2>(pair);
    const float2 lp = *xa_pa;
    if (part_o) {
        // Split: the rows' unnormalised O (this warp's half of the dims, both m tiles) and, for the
        // own m tile, the row max (log2 domain, as attn_decode_combine reads it) and sum.
#pragma unroll
        for (int mt = 0; mt < 2; mt++)
#pragma unroll
            for (int hf = 0; hf < 2; hf++) {
                const int r = 32 * pair + 16 * mt + 8 * hf + g;
                if (r >= nrows) continue;
                const long long prow = wide_prow(wt, r, Hq, n_split, row0);
                float* po = part_o + prow * HD + d0 + 2 * tg;
#pragma unroll
                for (int n = 0; n < PF_HALF / 8; n++)
                    *(float2*)(po + n * 8) = make_float2(oacc[mt][n][2 * hf], oacc[mt][n][2 * hf + 1]);
                if (mt == half && tg == 0) {
                    part_ml[2 * prow] = mrow[hf];
                    part_ml[2 * prow + 1] = hf ? l1 : l0;
                }
            }
        return;
    }
#pragma unroll
    for (int mt = 0; mt < 2; mt++)
#pragma unroll
        for (int hf = 0; hf < 2; hf++) {
            const float l = (mt == half) ? (hf ? l1 : l0) : (hf ? lp.y : lp.x);
            const float inv = l > 0.0f ? 1.0f / l : 0.0f;
            const int r = 32 * pair + 16 * mt + 8 * hf + g;
            if (r < nrows) {
                const int pr = r0 + r, i = pr / GQA_GROUP, hh = pr - i * GQA_GROUP;
                bf16_t* orow = o + ((long long)(qstart + i) * Hq + hkv * GQA_GROUP + hh) * HD + d0 + 2 * tg;
#pragma unroll
                for (int n = 0; n < PF_HALF / 8; n++)
                    *(u32*)(orow + n * 8) = pack_bf16(oacc[mt][n][2 * hf] * inv, oacc[mt][n][2 * hf + 1] * inv);
            }
        }
}

extern "C" __global__ void __launch_bounds__(PW_NT, 1)
attn_prefill_wide(const bf16_t* __restrict__ q, const void* __restrict__ k_cache,
                  const void* __restrict__ v_cache, const unsigned short* __restrict__ k_scales,
                  const unsigned short* __restrict__ v_scales, const int* __restrict__ block_tables, int max_blocks,
                  const int* __restrict__ cu_seqlens, const int* __restrict__ seq_lens,
                  const int* __restrict__ tile_table, bf16_t* __restrict__ o, int Hq, int Hkv, int page,
                  float scale, long long q_tok, long long q_head, int n_split, int row0,
                  float* __restrict__ part_o, float* __restrict__ part_ml) {
    wide_body<32>(q, k_cache, v_cache, k_scales, v_scales, block_tables, max_blocks, cu_seqlens, seq_lens, tile_table, o, Hq, Hkv, page,
                  scale, q_tok, q_head, n_split, row0, part_o, part_ml);
}

extern "C" __global__ void __launch_bounds__(PW_NT, 1)
attn_prefill_wide64(const bf16_t* __restrict__ q, const void* __restrict__ k_cache,
                    const void* __restrict__ v_cache, const unsigned short* __restrict__ k_scales,
                    const unsigned short* __restrict__ v_scales, const int* __restrict__ block_tables, int max_blocks,
                    const int* __restrict__ cu_seqlens, const int* __restrict__ seq_lens,
                    const int* __restrict__ tile_table, bf16_t* __restrict__ o, int Hq, int Hkv, int page,
                    float scale, long long q_tok, long long q_head, int n_split, int row0,
                    float* __restrict__ part_o, float* __restrict__ part_ml) {
    wide_body<64>(q, k_cache, v_cache, k_scales, v_scales, block_tables, max_blocks, cu_seqlens, seq_lens, tile_table, o, Hq, Hkv,
                  page, scale, q_tok, q_head, n_split, row0, part_o, part_ml);
}
