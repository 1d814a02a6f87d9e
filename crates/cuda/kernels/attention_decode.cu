// attention_decode.cu — causal GQA attention decode over the paged KV cache (attention_tile.cuh has
// the computation, shapes and KV formats): one query per row, its keys split into partitions whose
// unnormalised partials a second kernel merges.
//  attn_decode_split:   one query per row b (a decode sequence, or one row of a speculative verify:
//                       its block-table row is table_rows[b] when table_rows is not null, else b);
//                       keys split into dec_parts(len) <= n_split equal ranges (one per 128 keys),
//                       each block handles all GQA_GROUP query heads of one kv head (K/V read once),
//                       writes unnormalised partials (o, max in the log2 domain, sum) in f32. Each
//                       warp walks chunks of DEC_KC consecutive keys (every 8th chunk) with the next
//                       chunk's loads in flight; a chunk's DEC_KC x GQA_GROUP dot products are
//                       reduced across the warp together and the online softmax rescales once per
//                       chunk; the 8 warps' partials are summed in shared memory in a fixed order
//                       (no atomics: deterministic run to run). Quantised K / V: each lane loads its
//                       HD/32 codes (32-bit words when they are whole) and widens them.
//  attn_decode_mma:     attn_decode_split's work on tensor cores (same grid, arguments and partials;
//                       K and V of bf16 / fp8 / int8, int4 at head dims % 64 == 0; the default where
//                       the formats allow; design above its code at the end of this file).
//  attn_decode_combine: merges the n_split partials (log-sum-exp) into bf16 o (also those of a split
//                       prefill launch, attention_prefill.cu's wide kernels: no seq_lens); with a gate pointer
//                       also applies the attention output gate, o *= sigmoid(gate) (as
//                       elementwise.cu's sigmoid_gate_mul after it would).
// Launch: attn_decode_split grid (B, Hkv, n_split), block 256 (8 warps, 2*DEC_KC keys per warp in
//   flight, 16-byte loads at HD 256 bf16), static smem 4*GQA_GROUP*HD*4 B + 0.5 KB; attn_decode_mma
//   the same grid and block; attn_decode_combine grid (B, Hq), block HD.

#define DPL (HD / 32)  // dims per lane in decode
#define DEC_KC 4       // keys per chunk of a decode warp

// Decode: a lane's DPL elements of one token-head row, as raw bits (bf16 pairs or codes) in a uint4
// (DEC_LB(fmt) bytes from DEC_OFF(fmt, lane): 2*DPL for bf16, DPL for fp8 / int8, DPL/2 for int4 — at
// head dim 32 an int4 lane reads the byte that holds its one nibble, number DEC_NIB0(lane)), widened
// at use.
#define DEC_LB(f) ((f) == KVF_BF16 ? 2 * DPL : ((f) == KVF_INT4 ? (DPL + 1) / 2 : DPL))
#define DEC_OFF(f, lane) ((f) == KVF_INT4 ? ((lane) * DPL) >> 1 : (lane) * DEC_LB(f))
#define DEC_NIB0(lane) (((lane) * DPL) & 1)
// Element d (< DPL) of a raw row piece of format FMT, as f32 (codes: unscaled); nib0: DEC_NIB0.
template <int FMT>
__device__ __forceinline__ float dec_elem(const uint4& r, int d, int nib0) {
    if (FMT == KVF_BF16) {
        const u32 w = u4_comp(r, d >> 1);
        return __uint_as_float((d & 1) ? (w & 0xffff0000u) : (w << 16));
    } else if (FMT == KVF_INT4) {
        const int n = d + nib0;
        return kv_code_f32<FMT>(u4_comp(r, n >> 3) >> (4 * (n & 7)));
    } else {
        return kv_code_f32<FMT>(u4_comp(r, d >> 2) >> (8 * (d & 3)));
    }
}

// Partitions of a row with `len` keys: one per DEC_PART_KEYS keys, at most n_split. A row's split
// depends on its own length only, so its result does not depend on the batch it decodes in.
#ifndef DEC_PART_KEYS
#define DEC_PART_KEYS 128  // an NVRTC define for experiments (a shorter range: more, shorter blocks)
#endif
__device__ __forceinline__ int dec_parts(int len, int n_split) {
    return max(1, min(n_split, (len + DEC_PART_KEYS - 1) / DEC_PART_KEYS));
}

extern "C" __global__ void __launch_bounds__(256)
attn_decode_split(const bf16_t* q, const void* k_cache, const void* v_cache, const unsigned short* k_scales,
                  const unsigned short* v_scales, const int* __restrict__ block_tables,
                  const int* __restrict__ table_rows, int max_blocks, const int* __restrict__ seq_lens,
                  float* __restrict__ part_o,
                  float* __restrict__ part_ml, int Hq, int Hkv, int page, float scale, int n_split,
                  long long q_tok, long long q_head) {
    // The 8 warps' partial outputs, summed without atomics in a fixed order: warps 4..7 store theirs,
    // warps 0..3 add their own, then every thread sums the 4 slots (deterministic run to run).
    __shared__ float red[4][GQA_GROUP][HD];
    __shared__ float ms[8][GQA_GROUP], ls[8][GQA_GROUP];
    pdl_enter();  // launched programmatically on sm_90
    const int b = blockIdx.x, hkv = blockIdx.y, sp = blockIdx.z;
    const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int len = seq_lens[b];
    const int parts = dec_parts(len, n_split);
    if (sp >= parts) return;  // this row's context needs fewer partitions (the combine reads `parts`)
    const int per = (len + parts - 1) / parts;
    const int k0 = sp * per, k1 = min(len, k0 + per);
    const long long width = (long long)Hkv * HD;
    const int* bt = block_tables + (long long)(table_rows ? table_rows[b] : b) * max_blocks;

    const float sl2 = scale * 1.4426950408889634f;
    float qv[GQA_GROUP][DPL], acc[GQA_GROUP][DPL], m[GQA_GROUP], l[GQA_GROUP];
#pragma unroll
    for (int g = 0; g < GQA_GROUP; g++) {
        const bf16_t* qh = q + (long long)b * q_tok + (long long)(hkv * GQA_GROUP + g) * q_head + lane * DPL;
#pragma unroll
        for (int d = 0; d < DPL; d++) {
            qv[g][d] = bf2f(qh[d]) * sl2;  // log2 domain: softmax by exp2
            acc[g][d] = 0.0f;
        }
        m[g] = NEG_INF;
        l[g] = 0.0f;
    }
    // Key p's K and V: this lane's raw bits and, for quantised formats, the row's scales.
    struct DecKey {
        uint4 k, v;
        float ks, vs;
    };
    auto load_key = [&](int p, DecKey& r) {
        const long long row = (long long)bt[p / page] * page + p % page;
        const long long th = row * Hkv + hkv;  // token-head row
        r.k = dec_load_raw<DEC_LB(KV_K_FMT)>((const unsigned char*)k_cache + th * K_ROWB + DEC_OFF(KV_K_FMT, lane));
        r.v = dec_load_raw<DEC_LB(KV_V_FMT)>((const unsigned char*)v_cache + th * V_ROWB + DEC_OFF(KV_V_FMT, lane));
        r.ks = KQ_K ? f16_to_f32(k_scales[th]) : 1.0f;
        r.vs = KQ_V ? f16_to_f32(v_scales[th]) : 1.0f;
    };
    // Warp w walks chunks of DEC_KC consecutive keys (k0 + (8c + w) * DEC_KC ...); the next chunk's
    // loads are in flight while this one is computed, so up to 2 * DEC_KC keys per warp are in
    // flight (one key at a time left every key waiting a full memory latency).
    DecKey cur[DEC_KC], nxt[DEC_KC];
    const int stride = 8 * DEC_KC;
    const int c0 = k0 + w * DEC_KC;
#pragma unroll
    for (int i = 0; i < DEC_KC; i++)
        if (c0 + i < k1) load_key(c0 + i, cur[i]);
    for (int p0 = c0; p0 < k1; p0 += stride) {
#pragma unroll
        for (int i = 0; i < DEC_KC; i++)
            if (p0 + stride + i < k1) load_key(p0 + stride + i, nxt[i]);
        // The chunk's DEC_KC x GQA_GROUP dot products first, reduced across the warp together (their
        // shuffles overlap), then one online-softmax rescale per chunk: a key-by-key update put a
        // warp reduction and a rescale on one dependency chain per key and head.
        const int nk = min(DEC_KC, k1 - p0);  // >= 1, uniform over the warp
        float dot[DEC_KC][GQA_GROUP];
#pragma unroll
        for (int i = 0; i < DEC_KC; i++) {
            float kf[DPL];
#pragma unroll
            for (int d = 0; d < DPL; d++) kf[d] = dec_elem<KV_K_FMT>(cur[i].k, d, DEC_NIB0(lane));
#pragma unroll
            for (int g = 0; g < GQA_GROUP; g++) {
                float t = 0.0f;
#pragma unroll
                for (int d = 0; d < DPL; d++) t += qv[g][d] * kf[d];
                dot[i][g] = t;
            }
        }
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) {
#pragma unroll
            for (int i = 0; i < DEC_KC; i++) {
#pragma unroll
                for (int g = 0; g < GQA_GROUP; g++) dot[i][g] += __shfl_xor_sync(0xffffffffu, dot[i][g], off);
            }
        }
        float pk[DEC_KC][GQA_GROUP];
#pragma unroll
        for (int g = 0; g < GQA_GROUP; g++) {
            float mnew = m[g];
#pragma unroll
            for (int i = 0; i < DEC_KC; i++) {
                // codes: the key's scale multiplies the dot product; keys past the range weigh 0
                dot[i][g] = i < nk ? dot[i][g] * cur[i].ks : NEG_INF;
                mnew = fmaxf(mnew, dot[i][g]);
            }
            const float alpha = pf_exp2(m[g] - mnew);  // m = -inf -> 0, and acc/l are 0 then
            float lsum = l[g] * alpha;
#pragma unroll
            for (int i = 0; i < DEC_KC; i++) {
                const float pr = pf_exp2(dot[i][g] - mnew);
                lsum += pr;
                pk[i][g] = i < nk ? pr * cur[i].vs : 0.0f;  // codes: the key's scale multiplies its probability
            }
            l[g] = lsum;
            m[g] = mnew;
#pragma unroll
            for (int d = 0; d < DPL; d++) acc[g][d] *= alpha;
        }
#pragma unroll
        for (int i = 0; i < DEC_KC; i++) {
            if (i >= nk) break;  // uniform over the warp
            float vf[DPL];
#pragma unroll
            for (int d = 0; d < DPL; d++) vf[d] = dec_elem<KV_V_FMT>(cur[i].v, d, DEC_NIB0(lane));
#pragma unroll
            for (int g = 0; g < GQA_GROUP; g++) {
#pragma unroll
                for (int d = 0; d < DPL; d++) acc[g][d] = fmaf(pk[i][g], vf[d], acc[g][d]);
            }
        }
#pragma unroll
        for (int i = 0; i < DEC_KC; i++) cur[i] = nxt[i];
    }
    if (lane == 0) {
#pragma unroll
        for (int g = 0; g < GQA_GROUP; g++) {
            ms[w][g] = m[g];
            ls[w][g] = l[g];
        }
    }
    __syncthreads();
    float f[GQA_GROUP];
#pragma unroll
    for (int g = 0; g < GQA_GROUP; g++) {
        float M = NEG_INF;
        for (int ww = 0; ww < 8; ww++) M = fmaxf(M, ms[ww][g]);
        f[g] = m[g] == NEG_INF ? 0.0f : pf_exp2(m[g] - M);
        if (threadIdx.x == 0) {
            float Lsum = 0.0f;
            for (int ww = 0; ww < 8; ww++)
                Lsum += ms[ww][g] == NEG_INF ? 0.0f : ls[ww][g] * pf_exp2(ms[ww][g] - M);
            long long pi = (((long long)b * Hq + hkv * GQA_GROUP + g) * n_split + sp) * 2;
            part_ml[pi] = M;
            part_ml[pi + 1] = Lsum;
        }
    }
    if (w >= 4) {
#pragma unroll
        for (int g = 0; g < GQA_GROUP; g++) {
#pragma unroll
            for (int d = 0; d < DPL; d++) red[w - 4][g][lane * DPL + d] = acc[g][d] * f[g];
        }
    }
    __syncthreads();
    if (w < 4) {
#pragma unroll
        for (int g = 0; g < GQA_GROUP; g++) {
#pragma unroll
            for (int d = 0; d < DPL; d++) red[w][g][lane * DPL + d] += acc[g][d] * f[g];
        }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < GQA_GROUP * HD; e += blockDim.x) {
        const int g = e / HD, d = e % HD;
        part_o[(((long long)b * Hq + hkv * GQA_GROUP + g) * n_split + sp) * HD + d] =
            (red[0][g][d] + red[1][g][d]) + (red[2][g][d] + red[3][g][d]);
    }
}

#define COMB_MAX 128  // partials of a row, at most (the launcher checks)
extern "C" __global__ void attn_decode_combine(const float* part_o, const float* part_ml,
                                               const int* __restrict__ seq_lens,
                                               bf16_t* __restrict__ o, int Hq, int n_split,
                                               const bf16_t* gate, long long g_tok,
                                               long long g_head) {
    // The partials' (max, sum) pairs, loaded in parallel: the sums over them below then wait for one
    // load of o per partial with a key, those loads independent (predicated, no branch).
    __shared__ float pm[COMB_MAX], pl[COMB_MAX];
    pdl_trigger();  // launched programmatically on sm_90: the GEMV that follows may start streaming its weights
    const int b = blockIdx.x, h = blockIdx.y, d = threadIdx.x;
    const long long base = ((long long)b * Hq + h) * n_split;
    // (a step input: before the wait; no lengths: every row has n_split partials, as a split prefill
    // launch or a grouped verify launch writes them, those without keys max = -inf)
    const int parts = seq_lens ? dec_parts(seq_lens[b], n_split) : n_split;
    pdl_wait();
    for (int sp = threadIdx.x; sp < parts; sp += blockDim.x) {
        pm[sp] = part_ml[(base + sp) * 2];
        pl[sp] = part_ml[(base + sp) * 2 + 1];
    }
    __syncthreads();
    float M = NEG_INF;  // (each warp reduces all of them: no second barrier)
    for (int sp = threadIdx.x & 31; sp < parts; sp += 32) M = fmaxf(M, pm[sp]);
    M = warp_max(M);
    float num = 0.0f, den = 0.0f;
#pragma unroll 8
    for (int sp = 0; sp < parts; sp++) {
        const float ms = pm[sp];
        const bool has = ms != NEG_INF;
        const float po = has ? part_o[(base + sp) * HD + d] : 0.0f;
        const float f = has ? pf_exp2(ms - M) : 0.0f;  // partial maxima are in the log2 domain
        num += f * po;
        den += f * pl[sp];
    }
    float v = num / den;
    if (gate) v = round_bf(v) * sigmoidf_(bf2f(gate[(long long)b * g_tok + (long long)h * g_head + d]));
    o[((long long)b * Hq + h) * HD + d] = f2bf(v);
}

// ---------------------------------------------------------------------------------------------
// attn_decode_mma: attn_decode_split on tensor cores, for K and V caches each of bf16 or of codes
// (fp8 e4m3, int8, int4; int4 only at head dims that are multiples of 64, else attn_decode_split
// takes the pair). Same grid, block, arguments and
// partials (part_o / part_ml, read by attn_decode_combine); the keys of a partition start at a
// multiple of 16 (a row's split still depends on its length only; a partition past the row's end
// writes max = -inf, which the combine skips).
//
// Design (one block = one (row, kv head, partition); warp w takes the 16-key tiles w, w + 8, ...):
//  - S^T = K Q^T on mma.sync m16n8k16 (-> f32): the tile's 16 keys are the M rows, the GQA group's
//    heads the N columns (<= 8; padding heads are zeros), the head dims the K steps. The dims of a
//    K step are permuted (the same permutation for Q and K, so the dot products are unchanged) such
//    that lane (g, t) needs 4 contiguous dims per step of keys g and g + 8, and its pieces come from
//    16-byte loads of which the 4 lanes t of a key cover 64 contiguous bytes (dm_kel).
//  - bf16 K: the mma is bf16 with Q as stored. Codes: f16, the codes widened exactly (fp8:
//    cvt.rn.f16x2.e4m3x2 on sm_89+, a bit move + one multiply by 256 below; int8 and int4: the
//    1024 + x magic, dm_i4; an int4 lane piece holds twice the dims of a 1-byte one), Q times a
//    power of two qs that puts the group's largest |q| in [2^14, 2^15) (bf16
//    values are exact in f16 there). S is the f32-accumulated dot product of the exact values;
//    scale * log2(e) * kscale / qs is applied in f32.
//  - Online softmax in the log2 domain on the C fragment (keys g, g + 8 x heads 2t, 2t + 1: the
//    tile max per head over 8 lanes by 3 shuffles; row sums stay per lane until the end).
//  - O^T += V^T P'^T: the head dims are the M rows (16 per m-tile; lane g reads 32 contiguous bytes
//    per key at 1 byte per dim, dm_vel), the keys the K step, the heads the N columns. Codes:
//    P' = p * vscale / vt (vt: the tile's largest V scale, so P' <= 1; O is kept in units of the
//    last vt, rescaled with the softmax factor); bf16 V: P' = p. P' is split into hi + lo of the
//    mma's type (two mma: ~2^-16 relative for bf16, ~2^-22 for f16) and transposed from the C
//    layout into the B fragment by movmatrix. Two keys' values of one dim are paired by one prmt.
//  - Codes in K and V (1-byte or int4): the next tile's K (and scales) loads are issued before this
//    tile's S, its V loads after S (~8 KB per warp in flight at HD 256, fp8). With a bf16 matrix a
//    tile takes up to 128 registers per lane: each tile is loaded where it is used (16 KB per warp in
//    flight). (Two 1-byte tiles loaded at once instead of the double buffer measured ~4% slower, three
//    spilled.) The loaded words are not touched until their tile is used (an int4 variant that
//    flipped the codes' sign bits at load time stalled on the loads: b8 @ 32K +19% end to end).
//  - The 8 warps' (max, sum, O) merge in shared memory in a fixed order, as attn_decode_split's, in rows
//    laid out by dm_ridx (no bank conflicts).
//  - Launched programmatically (sm_90): the row's length, partition and block-table row (step inputs) are
//    read and the partition's first 128 keys' K/V lines prefetched into L2 before pdl_wait; the next
//    kernel may launch once the first tile's loads are issued.
// The layout, packing and fragment helpers (dm_*) are attention_mma.cuh's.
// Arch: mma.sync, movmatrix (sm_75+), cvt e4m3x2 only under __CUDA_ARCH__ >= 890: sm_80+.
// Tested by: tests/ops/ cases "attn_decode" (bf16) and "kv_q+attn_decode" (K/V pairs of bf16 /
// fp8 / int8 / int4), each also run on attn_decode_split, against the CPU attention over the
// dequantised cache; timed by tests/bench_attention.rs (decode: bf16, fp8, int4).
// Warp pairs (-DDM_PAIR=1, an experiment switch; 1-byte K and V, HD % 64 == 0): the two warps of a
// pair take the same tiles, both compute S and the softmax (bitwise the same), and each accumulates
// half of O's head dims from half of V, without the double buffer; at 124 registers two blocks fit an
// SM. Measured on the H200 (fp8, 32 partitions; bench/results/decode-attention-tensor-cores-h200-2026-11-30.md): faster
// where the grid has many blocks (b8 @ 4K 103 -> 68 us, b8 @ 32K 259 -> 231 us), slower at batch 1
// (b1 @ 32K 44 -> 58 us, b1 @ 128K 107 -> 178 us: 128 blocks, one per SM, now 4 tile columns). Chosen
// per launch it would make a row's bits depend on its batch, hence off.
#ifndef DM_PAIR
#define DM_PAIR 0
#endif
#if DM_PAIR && !(DM_BITS(KV_K_FMT) == 8 && DM_BITS(KV_V_FMT) == 8 && HD % 64 == 0)
#undef DM_PAIR
#define DM_PAIR 0
#endif
#define DM_PF (DM_KB <= HD && DM_VB <= HD && !DM_PAIR)  // register double buffer (codes, no pairs)
#define DM_NP (DM_PAIR ? 4 : 8)                 // tile columns of a block (warp pairs or warps)
#define DM_MTH (DM_MT / (1 + DM_PAIR))          // O^T m-tiles of a warp
#define DM_VWH (DM_VW / (1 + DM_PAIR))          // V words per lane per key of a warp (its half of the dims)
#define DM_VC (DM_VU < 4 * DM_VWH ? DM_VU : 4 * DM_VWH)  // V load chunk (bytes) of a warp
extern "C" __global__ void __launch_bounds__(256, DM_PAIR ? 2 : 1)
attn_decode_mma(const bf16_t* q, const void* k_cache, const void* v_cache, const unsigned short* k_scales,
                const unsigned short* v_scales, const int* __restrict__ block_tables,
                const int* __restrict__ table_rows, int max_blocks, const int* __restrict__ seq_lens,
                float* __restrict__ part_o, float* __restrict__ part_ml, int Hq, int Hkv, int page, float scale,
                int n_split, long long q_tok, long long q_head) {
#if DM_OK(KV_K_FMT) && DM_OK(KV_V_FMT)
    __shared__ float red[4][GQA_GROUP * DM_RS];
    __shared__ float ms[8][GQA_GROUP], ls[8][GQA_GROUP];
    // Q fragments (B of S^T, the same for every warp: lane l's pair at qsm[st][l]).
    __shared__ uint2 qsm[DM_MT][32];
    __shared__ float kf_sm;
    // Launched programmatically on sm_90. It lets the next kernel (the combine, then the GEMV after it)
    // launch only once its first K/V loads are issued (pdl_trigger below; a block without keys triggers
    // by exiting): triggered at the start, the GEMV's first weights queued ahead of those loads
    // (bench/results/decode-attention-layer-kernels-h200-2026-12-01.md).
    const int b = blockIdx.x, hkv = blockIdx.y, sp = blockIdx.z;
    const int w = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int col = DM_PAIR ? w >> 1 : w;  // tile column (tiles col, col + DM_NP, ...)
    const int hh = DM_PAIR ? w & 1 : 0;     // half of the head dims (pairs)
    // Step inputs (no kernel of the step writes them): read before the wait.
    const int len = seq_lens[b];
    const int parts = dec_parts(len, n_split);
    const int per = (((len + parts - 1) / parts) + 15) & ~15;
    const int k0 = min(len, sp * per), k1 = min(len, k0 + per);
    const int* bt = block_tables + (long long)(table_rows ? table_rows[b] : b) * max_blocks;
    const unsigned char* kc = (const unsigned char*)k_cache;
    const unsigned char* vc = (const unsigned char*)v_cache;
    // While the previous kernel runs: the partition's first 8 tiles into L2.
    if (sp < parts) dm_prefetch_keys(kc, vc, k_scales, v_scales, bt, page, Hkv, hkv, k0, k1);
    pdl_wait();
    if (sp >= parts) return;

    // Q: head g of the group (zeros past it), lane t's dims of each K step (bf16 K: as stored; codes:
    // times qs, in f16). Warp 0 loads it, stores the fragments and the factor; the others wait.
    if (w == 0) {
        const bf16_t* qh = q + (long long)b * q_tok + (long long)(hkv * GQA_GROUP + g) * q_head;
        uint2 f[DM_MT];
        const float qs = dm_q_frags(qh, g < GQA_GROUP, t, f);
#pragma unroll
        for (int st = 0; st < DM_MT; st++) qsm[st][lane] = f[st];
        if (lane == 0) kf_sm = scale * 1.4426950408889634f / qs;
    }
    __syncthreads();
    const float kf = kf_sm;  // S^T's factor besides the key's scale: scale * log2(e) (/ qs)

    // A tile's raw values (DmKPart, DmVPart: this warp's words hh * DM_VWH ...).
    using VPart = DmVPart<DM_VWH>;
    const DmPages pg{kc, vc, k_scales, v_scales, bt, page, Hkv, hkv, k1, page % 16 == 0};
    auto load_k = [&](int p0, long long rb, DmKPart& r) { pg.load_k(p0, rb, g, t, r); };
    auto load_v = [&](int p0, long long rb, VPart& r) { pg.load_v<DM_VWH, DM_VC>(p0, rb, g, t, hh, r); };
    auto tile_base = [&](int p0) -> long long { return pg.tile_base(p0); };

    float acc[DM_MTH][4];  // m-tiles hh * DM_MTH ...
#pragma unroll
    for (int i = 0; i < DM_MTH; i++) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
    float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.0f, l1 = 0.0f, unit = 1.0f;
    const int ntiles = (k1 - k0 + 15) >> 4;
    DmKPart kcur;
    VPart vcur;
#if DM_PF
    DmKPart knxt;
    VPart vnxt;
    long long rb_nxt = 0;
    if (col < ntiles) {
        const long long rb = tile_base(k0 + 16 * col);
        load_k(k0 + 16 * col, rb, kcur);
        load_v(k0 + 16 * col, rb, vcur);
    }
#endif
    pdl_trigger();
    for (int j = col; j < ntiles; j += DM_NP) {
        const int p0 = k0 + 16 * j;
#if DM_PF
        const bool more = j + 8 < ntiles;
        if (more) {
            rb_nxt = tile_base(p0 + 128);
            load_k(p0 + 128, rb_nxt, knxt);
        }
#else
        const long long rb = tile_base(p0);
        load_k(p0, rb, kcur);
        load_v(p0, rb, vcur);
#endif
        // S^T: c0 (key g, head 2t), c1 (key g, head 2t+1), c2 (key g+8, head 2t), c3 (key g+8, head
        // 2t+1); two accumulators (even and odd K steps): two dependency chains of mma instead of one.
        float s[4] = {0.0f, 0.0f, 0.0f, 0.0f}, s2[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int st = 0; st < DM_MT; st++) {
            const uint2 qb = qsm[st][lane];
            u32 a[4];  // keys g, g + 8 x dims (r = 0, 1), then (r = 2, 3)
            dm_k_frag(kcur.k, st, a);
            dm_mma<KV_K_FMT>((st & 1) ? s2 : s, a[0], a[1], a[2], a[3], qb.x, qb.y);
        }
#pragma unroll
        for (int c = 0; c < 4; c++) s[c] += s2[c];
#if DM_PF
        if (more) load_v(p0 + 128, rb_nxt, vnxt);
#endif
        const bool ok0 = p0 + g < k1, ok8 = p0 + g + 8 < k1;
        const float f0k = kcur.ks[0] * kf, f8k = kcur.ks[1] * kf;
        const float x00 = ok0 ? s[0] * f0k : NEG_INF, x01 = ok0 ? s[1] * f0k : NEG_INF;
        const float x80 = ok8 ? s[2] * f8k : NEG_INF, x81 = ok8 ? s[3] * f8k : NEG_INF;
        float t0 = fmaxf(x00, x80), t1 = fmaxf(x01, x81);
        float vt = fmaxf(kcur.vs[0], kcur.vs[1]);
#pragma unroll
        for (int off = 4; off < 32; off <<= 1) {
            t0 = fmaxf(t0, __shfl_xor_sync(0xffffffffu, t0, off));
            t1 = fmaxf(t1, __shfl_xor_sync(0xffffffffu, t1, off));
            if (KQ_V) vt = fmaxf(vt, __shfl_xor_sync(0xffffffffu, vt, off));
        }
        // The tile's first key is valid: the new maxima are finite; m = -inf gives alpha = 0.
        const float mn0 = fmaxf(m0, t0), mn1 = fmaxf(m1, t1);
        const float a0 = pf_exp2(m0 - mn0), a1 = pf_exp2(m1 - mn1);
        const float p00 = pf_exp2(x00 - mn0), p01 = pf_exp2(x01 - mn1);
        const float p80 = pf_exp2(x80 - mn0), p81 = pf_exp2(x81 - mn1);
        l0 = l0 * a0 + (p00 + p80);
        l1 = l1 * a1 + (p01 + p81);
        m0 = mn0;
        m1 = mn1;
        float f0 = a0, f1 = a1, r0 = 1.0f, r8 = 1.0f;
        if (KQ_V) {
            vt = vt > 0.0f ? vt : 1.0f;
            const float rv = 1.0f / vt;
            f0 *= unit * rv;
            f1 *= unit * rv;
            unit = vt;
            r0 = kcur.vs[0] * rv;
            r8 = kcur.vs[1] * rv;
        }
#pragma unroll
        for (int i = 0; i < DM_MTH; i++) {
            acc[i][0] *= f0;
            acc[i][1] *= f1;
            acc[i][2] *= f0;
            acc[i][3] *= f1;
        }
        const float q00 = p00 * r0, q01 = p01 * r0, q80 = p80 * r8, q81 = p81 * r8;
        const u32 h0 = dm_pack<KV_V_FMT>(q00, q01), h8 = dm_pack<KV_V_FMT>(q80, q81);
        const u32 e0 = dm_pack<KV_V_FMT>(q00 - dm_lo<KV_V_FMT>(h0), q01 - dm_hi<KV_V_FMT>(h0));
        const u32 e8 = dm_pack<KV_V_FMT>(q80 - dm_lo<KV_V_FMT>(h8), q81 - dm_hi<KV_V_FMT>(h8));
        const u32 bh0 = dm_movt(h0), bh1 = dm_movt(h8), bl0 = dm_movt(e0), bl1 = dm_movt(e8);
#pragma unroll
        for (int i = 0; i < DM_MTH; i++) {  // (independent across m-tiles: the scheduler interleaves them)
            u32 va[4];  // rows g, g + 8 x keys (2t, 2t + 1), then keys (2t + 8, 2t + 9)
            dm_v_frag(vcur.v, i, va);
            dm_mma<KV_V_FMT>(acc[i], va[0], va[1], va[2], va[3], bh0, bh1);
            dm_mma<KV_V_FMT>(acc[i], va[0], va[1], va[2], va[3], bl0, bl1);
        }
#if DM_PF
        if (more) {
            kcur = knxt;
            vcur = vnxt;
        }
#endif
    }
    // Row sums over the 8 lanes of a head pair; lanes g == 0 hold heads 2t, 2t + 1.
#pragma unroll
    for (int off = 4; off < 32; off <<= 1) {
        l0 += __shfl_xor_sync(0xffffffffu, l0, off);
        l1 += __shfl_xor_sync(0xffffffffu, l1, off);
    }
    if (g == 0 && hh == 0) {  // (a pair's two warps hold the same max and sums)
        if (2 * t < GQA_GROUP) {
            ms[col][2 * t] = m0;
            ls[col][2 * t] = l0;
        }
        if (2 * t + 1 < GQA_GROUP) {
            ms[col][2 * t + 1] = m1;
            ls[col][2 * t + 1] = l1;
        }
    }
    __syncthreads();
    // Factor of this warp's O per head (0 for a warp without keys), times its unit.
    float fw[2];
#pragma unroll
    for (int c = 0; c < 2; c++) {
        const int h = 2 * t + c;
        const float mh = c ? m1 : m0;
        float M = NEG_INF;
        if (h < GQA_GROUP) {
            for (int ww = 0; ww < DM_NP; ww++) M = fmaxf(M, ms[ww][h]);
        }
        fw[c] = (h < GQA_GROUP && mh != NEG_INF) ? pf_exp2(mh - M) * unit : 0.0f;
    }
    if (threadIdx.x < GQA_GROUP) {
        const int h = threadIdx.x;
        float M = NEG_INF;
        for (int ww = 0; ww < DM_NP; ww++) M = fmaxf(M, ms[ww][h]);
        float Lsum = 0.0f;
        for (int ww = 0; ww < DM_NP; ww++) Lsum += ms[ww][h] == NEG_INF ? 0.0f : ls[ww][h] * pf_exp2(ms[ww][h] - M);
        const long long pi = (((long long)b * Hq + hkv * GQA_GROUP + h) * n_split + sp) * 2;
        part_ml[pi] = M;
        part_ml[pi + 1] = Lsum;
    }
    // acc[i][c]: dim d = dm_vel(g, hh * DM_MTH + i, c >> 1), head h = 2t + (c & 1), at red[slot][dm_ridx(h, d)].
    // dm_ridx(h, dm_vel(g, i, hi)) splits into a lane part (t, g) and a compile-time part (i, c): dm_vel is
    // a lane offset plus dims below it that never carry into bit 5 (every format's layout; ops tests).
    const int i0 = hh * DM_MTH;
    const int rlane = dm_ridx(2 * t, dm_vel(g, i0, 0)) - dm_ridx(0, dm_vel(0, i0, 0));
    auto put = [&](int slot, bool add) {
        float* lr = red[slot] + rlane;
#pragma unroll
        for (int i = 0; i < DM_MTH; i++) {
#pragma unroll
            for (int c = 0; c < 4; c++) {
                if (2 * t + (c & 1) < GQA_GROUP) {
                    float* r = lr + dm_ridx(c & 1, dm_vel(0, i0 + i, c >> 1));
                    const float v = acc[i][c] * fw[c & 1];
                    *r = add ? *r + v : v;
                }
            }
        }
    };
    if (DM_PAIR) {
        put(col, false);  // the 4 pairs' slots; a pair's warps write disjoint dims
    } else {
        if (w >= 4) put(w - 4, false);
        __syncthreads();
        if (w < 4) put(w, true);
    }
    __syncthreads();
    for (int e = threadIdx.x; e < GQA_GROUP * HD; e += blockDim.x) {
        const int h = e / HD, d = e % HD;
        const int r = dm_ridx(h, d);
        part_o[(((long long)b * Hq + hkv * GQA_GROUP + h) * n_split + sp) * HD + d] =
            (red[0][r] + red[1][r]) + (red[2][r] + red[3][r]);
    }
#endif
}
