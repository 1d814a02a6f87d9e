// gdn_chunk_ws.cu — gdn_chunk_state with the output on warps of its own (gdn_chunk_state_ws), where a block
// may have its shared memory (ops::gdn_chunk::ws_smem_bytes: 226 KB at DK = DV = 128, sm_90's 227).
// Follows gdn_chunk.cu in one module (its helpers, tile pitches, SNW / SBV and GDN_STATE_ARGS).
//
// The one-stream walk (state_walk) spends 188 of its 508 tensor-core instructions a chunk on the output
// o^T = exp(G) h^T q^T + vn^T P^T, which no later chunk reads, in the same instruction stream as the
// recurrence, one warp per scheduler. Here a block has SNW state warps and SNW output warps:
//   state warp w:  vn^T = u^T - h^T w^T, then h^T = exp(G_last) h^T + (Dl * vn)^T K (320 mma a chunk); it
//                  hands its -h^T A fragments (hi and lo: built for its own product anyway) and vn^T's
//                  (hi, lo) to output warp w through shared memory and goes on with the next chunk;
//   output warp w: o^T = exp(G) h^T q^T + vn^T P^T for the same 16 columns, staged and stored as before.
// Two warps per scheduler; the exchange buffer is double-buffered, so the output of chunk c runs beside the
// state update of chunk c and the next chunk's vn. The products, operands and summation order are the
// one-stream walk's (split hi/lo operands), so o and the state are bit for bit the same (the ops table
// checks it).
// Shared memory: X [2][SNW][(DK/16 + CH/16) * 2][32] uint4 (per buffer, warp, k-tile and hi/lo: one lane's
// 4 fragment registers; 16-byte stores and loads of consecutive lanes), then the state warps' w hi, lo tiles
// twice (chunk c + 2's copy starts once chunk c's product has read its buffer: a whole chunk ahead, which made
// the walk 11% faster than one buffer), K tile and decays [CH] (group C: read after v_new, free at the chunk's
// end), the output warps' q, P hi, lo tiles, o tile and decays [CH]. u comes in registers a chunk ahead.
// Named barriers (the block never uses barrier 0): 1 the state warps, 2 the output warps, 3 + b "buffer b
// written" (state warps arrive, output warps wait), 5 + b "buffer b read" (output warps arrive, state
// warps wait before they write it again). Each side copies its own tiles with cp.async (its own groups).

#define WS_XU4 ((DK / 16 + CH / 16) * 2 * 32)  // uint4 of one warp's exchange buffer
#define WS_WBUF (2 * CH * KPB * 2)             // bytes of one w buffer (hi and lo tiles)
#define WS_NT (SNW * 32)                      // threads of one side
#define WS_BAR_STATE 1
#define WS_BAR_OUT 2
#define WS_BAR_FULL 3
#define WS_BAR_EMPTY 5

__device__ __forceinline__ uint4 u4_of(const u32 (&r)[4]) { return make_uint4(r[0], r[1], r[2], r[3]); }
__device__ __forceinline__ void u4_to(u32 (&r)[4], const uint4& v) {
    r[0] = v.x;
    r[1] = v.y;
    r[2] = v.z;
    r[3] = v.w;
}

extern "C" __global__ void __launch_bounds__(2 * SNW * 32) gdn_chunk_state_ws(GDN_STATE_ARGS) {
    extern __shared__ uint4 smem_u4[];
    uint4* X = smem_u4;                              // [2][SNW][WS_XU4]
    bf16_t* Wh = (bf16_t*)(X + 2 * SNW * WS_XU4);    // [2][w hi, w lo][CH][KPB] (state, double-buffered)
    bf16_t* Wl = Wh + CH * KPB;
    bf16_t* Ks = Wh + 4 * CH * KPB;                  // [CH][KPB] k      (state)
    bf16_t* Qs = Ks + CH * KPB;                      // [CH][KPB] q      (output)
    bf16_t* Ph = Qs + CH * KPB;                      // [CH][PPB] P hi   (output)
    bf16_t* Pl = Ph + CH * PPB;                      // [CH][PPB] P lo   (output)
    bf16_t* Os = Pl + CH * PPB;                      // [CH][OPB] o      (output)
    float2* Es = (float2*)(Os + CH * OPB);           // [CH] (exp(G_i), exp(G_last - G_i)) (state)
    float2* Eo = Es + CH;                            // [CH] the same pairs, the output warps' copy

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const bool out_side = warp >= SNW;
    const int rt = tid % WS_NT, sw = warp % SNW;  // thread and warp index within its side
    const int gq = lane >> 2, t4 = lane & 3;
    const int s = blockIdx.x, hv = blockIdx.y, hk = hv / (Hv / Hk);
    const int vw = blockIdx.z * SBV + sw * 16;
    const int start = cu_seqlens[s], len = cu_seqlens[s + 1] - start;
    if (len <= 0 || slots[s] < 0) return;  // uniform over the block
    const int nch = (len + CH - 1) / CH;
    const long long wrow = (long long)hv * T + start;
    auto chunk_len = [&](int c) { return min(CH, len - c * CH); };
    constexpr int KP = DK / 8, RP = WS_NT / KP;  // K/Q/w tiles: pieces per row, rows per pass
    constexpr int PP = CH / 8, RPP = WS_NT / PP;  // P tiles
    static_assert(WS_NT % KP == 0 && WS_NT % PP == 0, "a thread keeps one piece column");
    const int li = rt / KP, lp = rt % KP, pi = rt / PP, pp = rt % PP;
    const int qstep = RP * Hk * DK;
    const long long qrow0 = ((long long)start * Hk + hk) * DK + (long long)li * Hk * DK + 8 * lp;
    // A bf16 [CH][KPB] tile of chunk c from rows `base` (+ c's offset) `step` elements apart; zero rows
    // past the chunk end (copied from row 0, a valid address, not read).
    auto load_rows = [&](u32 dst, const bf16_t* base, int step, int L) {
        if (L == CH) {
#pragma unroll
            for (int m = 0; m < CH / RP; m++) cp_async16(dst + 2 * m * RP * KPB, base + m * step);
        } else {
            const bf16_t* z = base - li * (step / RP);
#pragma unroll
            for (int m = 0; m < CH / RP; m++) {
                const bool ok = li + m * RP < L;
                cp_async16(dst + 2 * m * RP * KPB, ok ? base + m * step : z, ok ? 16 : 0);
            }
        }
    };
    // The decay pairs of chunk c into E[CH] (zero past the chunk end: exp(G_last - G_j) = 0 there).
    auto load_decays = [&](float2* E, int c, int L) {
        if (rt < CH) {
            const bool ok = rt < L;
            cp8(E + rt, ws_g + 2 * (wrow + c * CH + (ok ? rt : 0)), ok);
        }
    };
    // Chunk c's k or q tile (`base`: this thread's first row of the tensor) and its decays into E, one group.
    auto load_rows_decays = [&](u32 dst, const bf16_t* base, float2* E, int c) {
        if (c < nch) {
            const int L = chunk_len(c);
            load_rows(dst, base + (long long)c * CH * Hk * DK, qstep, L);
            load_decays(E, c, L);
        }
        cp_async_commit();
    };
    // ldmatrix lane addresses (bytes) of B fragments (see state_walk).
    const int b_row = (lane >> 4) * 8 + (lane & 7), b_col = ((lane >> 3) & 1) * 8;
    uint4* Xw = X + sw * WS_XU4 + lane;  // this warp pair's exchange slots, + buffer * SNW * WS_XU4 + 32 * slot
    constexpr int XV = 2 * (DK / 16);    // first vn^T slot

    if (!out_side) {
        // ---------------------------------------------------------------- the recurrence
        state_t* st = state + ((long long)slots[s] * Hv + hv) * DK * DV;
        const bf16_t* wh0 = ws_wh + wrow * DK + li * DK + 8 * lp;
        const bf16_t* wl0 = ws_wl + wrow * DK + li * DK + 8 * lp;
        const bf16_t* k0 = k + qrow0;
        const u32 wh_d = smem_addr(Wh + li * KPB + 8 * lp), wl_d = smem_addr(Wl + li * KPB + 8 * lp);
        const u32 k_d = smem_addr(Ks + li * KPB + 8 * lp);
        auto load_a = [&](int c) {  // group A: w hi, lo (buffer c & 1)
            if (c < nch) {
                const int L = chunk_len(c);
                const u32 wb = (c & 1) * WS_WBUF;
                load_rows(wh_d + wb, wh0 + (long long)c * CH * DK, RP * DK, L);
                load_rows(wl_d + wb, wl0 + (long long)c * CH * DK, RP * DK, L);
            }
            cp_async_commit();
        };
        auto load_c = [&](int c) { load_rows_decays(k_d, k0, Es, c); };  // group C: k and the decays
        float un[CH / 8][4];
        const float* u0 = ws_u + (wrow + 2 * t4) * DV + vw + gq;
        auto load_u = [&](int c) { load_u_tile(un, u0 + (long long)c * CH * DV, c < nch ? chunk_len(c) : 0, t4); };
        const u32 wh_l = smem_addr(Wh) + 2 * (b_row * KPB + b_col), wl_l = smem_addr(Wl) + 2 * (b_row * KPB + b_col);
        const u32 k_t = smem_addr(Ks + (lane & 15) * KPB + (lane >> 4) * 8);

        float h[DK / 8][4];  // -h^T (see state_walk)
        load_neg_h(h, st, vw, gq, t4);
        load_a(0);
        load_c(0);
        load_a(1);
        load_u(0);

        for (int c = 0; c < nch; c++) {
            const int L = chunk_len(c), b = c & 1;
            uint4* xb = Xw + b * SNW * WS_XU4;
            const u32 wb = b * WS_WBUF;
            cp_async_wait<2>();
            named_sync(WS_BAR_STATE, WS_NT);  // group A(c): w
            if (c >= 2) named_sync(WS_BAR_EMPTY + b, 2 * WS_NT);  // the output of chunk c - 2 read buffer b

            // vn^T = u^T - h^T w^T; -h^T's fragments to the output warp.
            float acc[CH / 8][4];
#pragma unroll
            for (int n = 0; n < CH / 8; n++)
#pragma unroll
                for (int e = 0; e < 4; e++) acc[n][e] = un[n][e];
            load_u(c + 1);
#pragma unroll
            for (int kt = 0; kt < DK / 16; kt++) {
                u32 ah[4], al[4];
                split_h(h, kt, ah, al);
                xb[32 * (2 * kt)] = u4_of(ah);
                xb[32 * (2 * kt + 1)] = u4_of(al);
#pragma unroll
                for (int np = 0; np < CH / 16; np++) {
                    const u32 off = 2 * (16 * np * KPB + 16 * kt);
                    u32 bh[4], bl[4];
                    ldsm_x4(wh_l + wb + off, bh[0], bh[1], bh[2], bh[3]);
                    ldsm_x4(wl_l + wb + off, bl[0], bl[1], bl[2], bl[3]);
                    mma_bf16(acc[2 * np], ah, bh[0], bh[1]);
                    mma_bf16(acc[2 * np + 1], ah, bh[2], bh[3]);
                    mma_bf16(acc[2 * np], al, bh[0], bh[1]);
                    mma_bf16(acc[2 * np + 1], al, bh[2], bh[3]);
                    mma_bf16(acc[2 * np], ah, bl[0], bl[1]);
                    mma_bf16(acc[2 * np + 1], ah, bl[2], bl[3]);
                }
            }
            named_sync(WS_BAR_STATE, WS_NT);  // w buffer b free
            load_a(c + 2);
            u32 vh[CH / 16][4], vl[CH / 16][4];  // vn^T as A fragments (k = chunk row j)
            split_frags(acc, vh, vl);
#pragma unroll
            for (int kt = 0; kt < CH / 16; kt++) {
                xb[32 * (XV + 2 * kt)] = u4_of(vh[kt]);
                xb[32 * (XV + 2 * kt + 1)] = u4_of(vl[kt]);
            }
            named_arrive(WS_BAR_FULL + b, 2 * WS_NT);  // buffer b holds chunk c's -h^T and vn^T

            // -(Dl * vn)^T with Dl_j = exp(G_last - G_j), 0 past the chunk end.
            cp_async_wait<1>();
            named_sync(WS_BAR_STATE, WS_NT);  // group C(c): K, decays
            const float2* E = Es;
            scale_cols_neg<true>(acc, E, t4);
            split_frags(acc, vh, vl);

            // h^T = exp(G_last) h^T + (Dl * vn)^T K  (on -h^T, with -(Dl * vn)^T).
            update_h<true>(h, vh, vl, k_t, E[L - 1].x);
            named_sync(WS_BAR_STATE, WS_NT);  // K buffer free
            load_c(c + 1);
        }
        store_neg_h(h, st, vw, gq, t4);
        return;
    }

    // -------------------------------------------------------------------- the output
    const bf16_t* q0 = q + qrow0;
    const bf16_t* ph0 = ws_ph + wrow * CH + pi * CH + 8 * pp;
    const bf16_t* pl0 = ws_pl + wrow * CH + pi * CH + 8 * pp;
    const u32 q_d = smem_addr(Qs + li * KPB + 8 * lp);
    const u32 ph_d = smem_addr(Ph + pi * PPB + 8 * pp), pl_d = smem_addr(Pl + pi * PPB + 8 * pp);
    auto load_q = [&](int c) { load_rows_decays(q_d, q0, Eo, c); };  // group Q: q and the decays
    auto load_p = [&](int c) {  // group P: P hi, lo
        if (c < nch) cp_p_tiles<RPP>(ph_d, pl_d, ph0 + (long long)c * CH * CH, pl0 + (long long)c * CH * CH, chunk_len(c), pi);
        cp_async_commit();
    };
    const u32 q_l = smem_addr(Qs) + 2 * (b_row * KPB + b_col);
    const u32 ph_l = smem_addr(Ph) + 2 * (b_row * PPB + b_col), pl_l = smem_addr(Pl) + 2 * (b_row * PPB + b_col);
    load_q(0);
    load_p(0);

    for (int c = 0; c < nch; c++) {
        const int t0 = start + c * CH, L = chunk_len(c), b = c & 1;
        const uint4* xb = Xw + b * SNW * WS_XU4;
        cp_async_wait<1>();
        named_sync(WS_BAR_OUT, WS_NT);           // group Q(c): q, decays
        named_sync(WS_BAR_FULL + b, 2 * WS_NT);  // buffer b holds chunk c's -h^T and vn^T

        // oq = -h^T q^T, then o^T = exp(G_i) h^T q^T (the one-stream walk's order of products).
        float oq[CH / 8][4];
#pragma unroll
        for (int n = 0; n < CH / 8; n++)
#pragma unroll
            for (int e = 0; e < 4; e++) oq[n][e] = 0.0f;
#pragma unroll
        for (int kt = 0; kt < DK / 16; kt++) {
            u32 ah[4], al[4];
            u4_to(ah, xb[32 * (2 * kt)]);
            u4_to(al, xb[32 * (2 * kt + 1)]);
#pragma unroll
            for (int np = 0; np < CH / 16; np++) {
                u32 qb[4];
                ldsm_x4(q_l + 2 * (16 * np * KPB + 16 * kt), qb[0], qb[1], qb[2], qb[3]);
                mma_bf16(oq[2 * np], ah, qb[0], qb[1]);
                mma_bf16(oq[2 * np + 1], ah, qb[2], qb[3]);
                mma_bf16(oq[2 * np], al, qb[0], qb[1]);
                mma_bf16(oq[2 * np + 1], al, qb[2], qb[3]);
            }
        }
        scale_cols_neg<false>(oq, Eo, t4);
        u32 vh[CH / 16][4], vl[CH / 16][4];
#pragma unroll
        for (int kt = 0; kt < CH / 16; kt++) {
            u4_to(vh[kt], xb[32 * (XV + 2 * kt)]);
            u4_to(vl[kt], xb[32 * (XV + 2 * kt + 1)]);
        }
        if (c + 2 < nch) named_arrive(WS_BAR_EMPTY + b, 2 * WS_NT);  // buffer b read (the state warps wait at c + 2)
        named_sync(WS_BAR_OUT, WS_NT);  // q, decays free
        load_q(c + 1);
        cp_async_wait<1>();
        named_sync(WS_BAR_OUT, WS_NT);  // group P(c)

        add_vn_p<true>(oq, vh, vl, ph_l, pl_l);
        stage_o(oq, Os, sw * 16, gq, t4);
        named_sync(WS_BAR_OUT, WS_NT);  // P buffers free, o tile complete
        load_p(c + 1);
        for (int e = rt; e < CH * (SBV / 8); e += WS_NT) {
            const int i = e / (SBV / 8), p = e % (SBV / 8);
            if (i < L)
                *(uint4*)(o + ((long long)(t0 + i) * Hv + hv) * DV + blockIdx.z * SBV + 8 * p) =
                    *(const uint4*)(Os + i * OPB + 8 * p);
        }
    }
}
