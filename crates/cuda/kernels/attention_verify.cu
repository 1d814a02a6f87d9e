// attention_verify.cu — causal GQA attention of groups of consecutive rows of one sequence (the rows of
// a speculative verify chunk: the last accepted token and its drafts) over the paged KV cache, each
// K/V tile read and widened once for every row of the group. attn_decode_mma's design (attention_decode.cu;
// the dm_* pieces both use are attention_mma.cuh's) with the group's query columns — row r, head h of the
// GQA group: column r * GQA_GROUP + h — as VQ_NT n-tiles of S^T = K Q^T and of O^T = V^T P^T, each column
// masked at its row's own causal length.
//  attn_verify_mma: grid (group, kv head, partition), block 128 (two blocks an SM). Group c is rows groups[c] ..
//    groups[c + 1] of the launch (at most VQ_COLS / GQA_GROUP), their lengths seq_lens[row] (the last
//    the longest), block-table row table_rows[first row]. Its keys (the last row's length L) are split
//    into one partition per VQ_PART_KEYS keys, at most n_split, each a multiple of 16 keys (the launcher
//    picks n_split for whole waves of blocks). A partition past those, or a column whose keys all lie
//    past its row's length, writes max = -inf: attn_decode_combine, run without lengths (every row
//    n_split partials), skips it.
//  - 4 warps in 2 pairs: the pair of tile column c takes the 16-key tiles c, c + 2, ...; both of its
//    warps compute S and the softmax of every column (bitwise the same), each accumulates half of
//    O^T's m-tiles for every column (8 x VQ_NT x 4 accumulators a lane at head dim 256; 208 registers
//    at VQ_NT = 3, no spills). The next tile's lines are prefetched into L2 while this one is computed
//    (no registers held).
//  - K and V of codes (fp8, int8; int4 at head dims % 64 == 0): a bf16 cache runs attn_decode_mma
//    row by row (its K rows would not fit a lane's registers here).
//  - Q's fragments (f16, a power-of-two scale per n-tile) live in shared memory that the pairs'
//    partial O then reuse: pair 0 stores, pair 1 adds (a fixed order: deterministic run to run).
// Arch: mma.sync, movmatrix: sm_80+. Tested by: tests/ops/ cases "kv_q+attn_verify" against the CPU
// attention over the dequantised cache (and attn_decode_mma row by row).
#ifndef VQ_NT
#define VQ_NT 3  // n-tiles of 8 columns (KernelDims::verify_ntiles: 4 verify rows, e.g. 3 at the 27B's 6 heads)
#endif
#define VQ_COLS (8 * VQ_NT)
#ifndef VQ_PART_KEYS
#define VQ_PART_KEYS 32  // keys per partition, at least (one tile per pair); an NVRTC define for experiments
#endif
#define VQ_MTH (DM_MT / 2)                                   // O^T m-tiles of a warp
#define VQ_VWH (DM_VW / 2)                                   // V words per lane per key of a warp
#define VQ_VC (DM_VU < 4 * VQ_VWH ? DM_VU : 4 * VQ_VWH)      // V load chunk (bytes) of a warp
#define VQ_OK (KV_K_FMT != KVF_BF16 && KV_V_FMT != KVF_BF16 && DM_OK(KV_K_FMT) && DM_OK(KV_V_FMT) && DM_VW % 2 == 0)

#define VQ_PAIRS 2
static_assert(VQ_NT <= 2 * VQ_PAIRS, "a warp loads each n-tile's Q");
extern "C" __global__ void __launch_bounds__(64 * VQ_PAIRS, 2)
attn_verify_mma(const bf16_t* q, const void* k_cache, const void* v_cache, const unsigned short* k_scales,
                const unsigned short* v_scales, const int* __restrict__ block_tables,
                const int* __restrict__ table_rows, int max_blocks, const int* __restrict__ seq_lens,
                const int* __restrict__ groups, float* __restrict__ part_o, float* __restrict__ part_ml, int Hq,
                int Hkv, int page, float scale, int n_split, long long q_tok, long long q_head) {
#if VQ_OK
    // Q's fragments ([VQ_NT][DM_MT][32] uint2), later the merged O (dm_ridx rows of VQ_COLS columns).
    constexpr int RED = VQ_COLS * DM_RS, QSM = VQ_NT * DM_MT * 32 * 2;
    __shared__ __align__(16) float sm[RED > QSM ? RED : QSM];
    __shared__ float ms[VQ_PAIRS][VQ_COLS], ls[VQ_PAIRS][VQ_COLS];
    __shared__ float kf_sm[VQ_NT];
    uint2* qsm = reinterpret_cast<uint2*>(sm);
    const int c = blockIdx.x, hkv = blockIdx.y, sp = blockIdx.z;
    const int w = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int col = w >> 1, hh = w & 1;
    // Step inputs (no kernel of the step writes them): read before the wait.
    const int row0 = groups[c];
    const int nrows = min(groups[c + 1] - row0, VQ_COLS / GQA_GROUP);
    const int ncols = nrows * GQA_GROUP;
    const int len = seq_lens[row0 + nrows - 1];
    const int parts = max(1, min(n_split, (len + VQ_PART_KEYS - 1) / VQ_PART_KEYS));
    const int per = (((len + parts - 1) / parts) + 15) & ~15;
    const int k0 = min(len, sp * per), k1 = min(len, k0 + per);
    const int* bt = block_tables + (long long)table_rows[row0] * max_blocks;
    const unsigned char* kc = (const unsigned char*)k_cache;
    const unsigned char* vc = (const unsigned char*)v_cache;
    // This lane's columns (n-tile nt, 2t + j): their keys end at min(row length, k1); 0 past the group.
    int kb[VQ_NT][2];
#pragma unroll
    for (int nt = 0; nt < VQ_NT; nt++) {
#pragma unroll
        for (int j = 0; j < 2; j++) {
            const int cc = nt * 8 + 2 * t + j;
            kb[nt][j] = cc < ncols ? min(k1, seq_lens[row0 + cc / GQA_GROUP]) : 0;
        }
    }
    if (sp < parts) dm_prefetch_keys(kc, vc, k_scales, v_scales, bt, page, Hkv, hkv, k0, k1);
    pdl_wait();
    auto ml_at = [&](int cc) -> long long {
        return (((long long)(row0 + cc / GQA_GROUP) * Hq + hkv * GQA_GROUP + cc % GQA_GROUP) * n_split + sp) * 2;
    };
    if (sp >= parts) {  // no keys: the combine skips this partition
        if (threadIdx.x < ncols) {
            part_ml[ml_at(threadIdx.x)] = NEG_INF;
            part_ml[ml_at(threadIdx.x) + 1] = 0.0f;
        }
        return;
    }
    // Q: warp nt loads n-tile nt (lane (g, t): column nt * 8 + g), its fragments and factor.
    if (w < VQ_NT) {
        const int cc = w * 8 + g;
        const bool ok = cc < ncols;
        const int r = ok ? cc / GQA_GROUP : 0, h = ok ? cc % GQA_GROUP : 0;
        const bf16_t* qh = q + (long long)(row0 + r) * q_tok + (long long)(hkv * GQA_GROUP + h) * q_head;
        uint2 f[DM_MT];
        const float qs = dm_q_frags(qh, ok, t, f);
#pragma unroll
        for (int st = 0; st < DM_MT; st++) qsm[(w * DM_MT + st) * 32 + lane] = f[st];
        if (lane == 0) kf_sm[w] = scale * 1.4426950408889634f / qs;
    }
    __syncthreads();
    float kf[VQ_NT];
#pragma unroll
    for (int nt = 0; nt < VQ_NT; nt++) kf[nt] = kf_sm[nt];

    // A tile's raw values (DmKPart, DmVPart: this warp's V words hh * VQ_VWH ...).
    const DmPages pg{kc, vc, k_scales, v_scales, bt, page, Hkv, hkv, k1, page % 16 == 0};
    // The L2 lines of tile p0's K (warp hh = 0) or V (hh = 1) rows: lane i takes key i / 2, every
    // other line.
    auto prefetch_tile = [&](int p0) {
        const int p = p0 + (lane >> 1);
        if (p < k1) {
            const long long th = ((long long)bt[p / page] * page + p % page) * Hkv + hkv;
            const unsigned char* base = hh ? vc + th * DM_VB : kc + th * DM_KB;
            for (int off = (lane & 1) * 128; off < (hh ? DM_VB : DM_KB); off += 256) l2_prefetch(base + off);
        }
    };

    float acc[VQ_MTH][VQ_NT][4];
#pragma unroll
    for (int i = 0; i < VQ_MTH; i++) {
#pragma unroll
        for (int nt = 0; nt < VQ_NT; nt++) acc[i][nt][0] = acc[i][nt][1] = acc[i][nt][2] = acc[i][nt][3] = 0.0f;
    }
    float m[VQ_NT][2], l[VQ_NT][2], unit = 1.0f;
#pragma unroll
    for (int nt = 0; nt < VQ_NT; nt++) m[nt][0] = m[nt][1] = NEG_INF, l[nt][0] = l[nt][1] = 0.0f;
    const int ntiles = (k1 - k0 + 15) >> 4;
    pdl_trigger();
    for (int j = col; j < ntiles; j += VQ_PAIRS) {
        const int p0 = k0 + 16 * j;
        const long long rb = pg.tile_base(p0);
        DmKPart kt;
        pg.load_k(p0, rb, g, t, kt);
        DmVPart<VQ_VWH> vt_;
        pg.load_v<VQ_VWH, VQ_VC>(p0, rb, g, t, hh, vt_);
        if (j + VQ_PAIRS < ntiles) prefetch_tile(p0 + 16 * VQ_PAIRS);
        // S^T of every n-tile: c0 (key g, column 2t), c1 (key g, 2t + 1), c2 (key g + 8, 2t), c3.
        float s[VQ_NT][4];
#pragma unroll
        for (int nt = 0; nt < VQ_NT; nt++) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#pragma unroll
        for (int st = 0; st < DM_MT; st++) {
            u32 a[4];
            dm_k_frag(kt.k, st, a);
#pragma unroll
            for (int nt = 0; nt < VQ_NT; nt++) {
                const uint2 qb = qsm[(nt * DM_MT + st) * 32 + lane];
                dm_mma<KV_K_FMT>(s[nt], a[0], a[1], a[2], a[3], qb.x, qb.y);
            }
        }
        // The tile's largest V scale (codes: P' = p * vscale / vt <= 1, O kept in units of the last vt).
        float vt = fmaxf(kt.vs[0], kt.vs[1]);
#pragma unroll
        for (int off = 4; off < 32; off <<= 1) vt = fmaxf(vt, __shfl_xor_sync(0xffffffffu, vt, off));
        vt = vt > 0.0f ? vt : 1.0f;
        const float rv = 1.0f / vt, r0 = kt.vs[0] * rv, r8 = kt.vs[1] * rv;
        const int pg = p0 + g, p8 = p0 + g + 8;
        u32 bh[VQ_NT][2], bl[VQ_NT][2];
#pragma unroll
        for (int nt = 0; nt < VQ_NT; nt++) {
            const float f0k = kt.ks[0] * kf[nt], f8k = kt.ks[1] * kf[nt];
            const float x00 = pg < kb[nt][0] ? s[nt][0] * f0k : NEG_INF;
            const float x01 = pg < kb[nt][1] ? s[nt][1] * f0k : NEG_INF;
            const float x80 = p8 < kb[nt][0] ? s[nt][2] * f8k : NEG_INF;
            const float x81 = p8 < kb[nt][1] ? s[nt][3] * f8k : NEG_INF;
            float t0 = fmaxf(x00, x80), t1 = fmaxf(x01, x81);
#pragma unroll
            for (int off = 4; off < 32; off <<= 1) {
                t0 = fmaxf(t0, __shfl_xor_sync(0xffffffffu, t0, off));
                t1 = fmaxf(t1, __shfl_xor_sync(0xffffffffu, t1, off));
            }
            // A column may have no key in this tile yet (-inf max): its factors stay finite (0 base).
            const float mn0 = fmaxf(m[nt][0], t0), mn1 = fmaxf(m[nt][1], t1);
            const float b0 = mn0 == NEG_INF ? 0.0f : mn0, b1 = mn1 == NEG_INF ? 0.0f : mn1;
            const float a0 = pf_exp2(m[nt][0] - b0), a1 = pf_exp2(m[nt][1] - b1);
            const float p00 = pf_exp2(x00 - b0), p01 = pf_exp2(x01 - b1);
            const float p80 = pf_exp2(x80 - b0), p81 = pf_exp2(x81 - b1);
            l[nt][0] = l[nt][0] * a0 + (p00 + p80);
            l[nt][1] = l[nt][1] * a1 + (p01 + p81);
            m[nt][0] = mn0;
            m[nt][1] = mn1;
            const float f0 = a0 * unit * rv, f1 = a1 * unit * rv;
#pragma unroll
            for (int i = 0; i < VQ_MTH; i++) {
                acc[i][nt][0] *= f0;
                acc[i][nt][1] *= f1;
                acc[i][nt][2] *= f0;
                acc[i][nt][3] *= f1;
            }
            const float q00 = p00 * r0, q01 = p01 * r0, q80 = p80 * r8, q81 = p81 * r8;
            const u32 h0 = dm_pack<KV_V_FMT>(q00, q01), h8 = dm_pack<KV_V_FMT>(q80, q81);
            const u32 e0 = dm_pack<KV_V_FMT>(q00 - dm_lo<KV_V_FMT>(h0), q01 - dm_hi<KV_V_FMT>(h0));
            const u32 e8 = dm_pack<KV_V_FMT>(q80 - dm_lo<KV_V_FMT>(h8), q81 - dm_hi<KV_V_FMT>(h8));
            bh[nt][0] = dm_movt(h0);
            bh[nt][1] = dm_movt(h8);
            bl[nt][0] = dm_movt(e0);
            bl[nt][1] = dm_movt(e8);
        }
        unit = vt;
#pragma unroll
        for (int i = 0; i < VQ_MTH; i++) {
            u32 va[4];
            dm_v_frag(vt_.v, i, va);
#pragma unroll
            for (int nt = 0; nt < VQ_NT; nt++) {
                dm_mma<KV_V_FMT>(acc[i][nt], va[0], va[1], va[2], va[3], bh[nt][0], bh[nt][1]);
                dm_mma<KV_V_FMT>(acc[i][nt], va[0], va[1], va[2], va[3], bl[nt][0], bl[nt][1]);
            }
        }
    }
    // Row sums over the 8 lanes of a column pair; lanes g == 0 hold columns 2t, 2t + 1.
#pragma unroll
    for (int nt = 0; nt < VQ_NT; nt++) {
#pragma unroll
        for (int off = 4; off < 32; off <<= 1) {
            l[nt][0] += __shfl_xor_sync(0xffffffffu, l[nt][0], off);
            l[nt][1] += __shfl_xor_sync(0xffffffffu, l[nt][1], off);
        }
        if (g == 0 && hh == 0) {  // (a pair's two warps hold the same max and sums)
            ms[col][nt * 8 + 2 * t] = m[nt][0];
            ls[col][nt * 8 + 2 * t] = l[nt][0];
            ms[col][nt * 8 + 2 * t + 1] = m[nt][1];
            ls[col][nt * 8 + 2 * t + 1] = l[nt][1];
        }
    }
    __syncthreads();  // (also: every warp is past its last read of Q's fragments)
    // Factor of this warp's O per column (0 for a pair without keys there), times its unit.
    float fw[VQ_NT][2];
#pragma unroll
    for (int nt = 0; nt < VQ_NT; nt++) {
#pragma unroll
        for (int j = 0; j < 2; j++) {
            const int cc = nt * 8 + 2 * t + j;
            float M = NEG_INF;
            for (int ww = 0; ww < VQ_PAIRS; ww++) M = fmaxf(M, ms[ww][cc]);
            fw[nt][j] = m[nt][j] != NEG_INF ? pf_exp2(m[nt][j] - M) * unit : 0.0f;
        }
    }
    if (threadIdx.x < ncols) {
        const int cc = threadIdx.x;
        float M = NEG_INF, Lsum = 0.0f;
        for (int ww = 0; ww < VQ_PAIRS; ww++) M = fmaxf(M, ms[ww][cc]);
        for (int ww = 0; ww < VQ_PAIRS; ww++) Lsum += ms[ww][cc] == NEG_INF ? 0.0f : ls[ww][cc] * pf_exp2(ms[ww][cc] - M);
        part_ml[ml_at(cc)] = M;
        part_ml[ml_at(cc) + 1] = Lsum;
    }
    // The pairs' O into sm one after another: acc[i][nt][e] is dim dm_vel(g, hh * VQ_MTH + i, e >> 1) of
    // column nt * 8 + 2t + (e & 1), at sm[dm_ridx(column, dim)], which splits into a lane part (t, g, hh)
    // and a compile-time part (i, nt, e): dm_vel is a lane offset plus dims below it that never carry
    // into bit 5 (as attn_decode_mma's merge; the ops cases check every format).
    float* lr = sm + dm_ridx(2 * t, dm_vel(g, hh * VQ_MTH, 0)) - dm_ridx(0, dm_vel(0, 0, 0));
#pragma unroll
    for (int pc = 0; pc < VQ_PAIRS; pc++) {
        if (col == pc) {
#pragma unroll
            for (int i = 0; i < VQ_MTH; i++) {
#pragma unroll
                for (int nt = 0; nt < VQ_NT; nt++) {
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        float* r = lr + dm_ridx(nt * 8 + (e & 1), dm_vel(0, i, e >> 1));
                        const float v = acc[i][nt][e] * fw[nt][e & 1];
                        *r = pc ? *r + v : v;
                    }
                }
            }
        }
        __syncthreads();
    }
    for (int e = threadIdx.x; e < ncols * HD; e += blockDim.x) {
        const int cc = e / HD, d = e % HD;
        part_o[(ml_at(cc) >> 1) * HD + d] = sm[dm_ridx(cc, d)];
    }
#endif
}
