// attention.cu — causal GQA softmax attention over the paged KV cache (online softmax).
//
// Computes, per sequence s, query token i (absolute position past_s + i, past_s = seq_lens[s] -
// q_len_s) and query head h (kv head h / GQA_GROUP):
//   o[i, h] = sum_{p <= past_s + i} softmax_p(scale * q[i,h] . K[p]) V[p]
// where key p lives at cache row block_tables[s, p / page] * page + p % page.
//  attn_prefill:        varlen queries (cu_seqlens); FlashAttention-2 style on tensor cores
//                       (mma.sync m16n8k16 bf16 -> f32, ldmatrix, cp.async); no scratch.
//  attn_prefill_wide / attn_prefill_wide64: the same with 128 packed (query, head) rows per block
//                       (the default where its 140 / 214 KB of shared memory fit: sm_80 / sm_90;
//                       design below attn_prefill's).
//  attn_decode_split:   one query per row b (a decode sequence, or one row of a speculative verify:
//                       its block-table row is table_rows[b] when table_rows is not null, else b);
//                       keys split into dec_parts(len) <= n_split equal ranges (one per 128
//                       keys), each block
//                       handles all GQA_GROUP query heads of one kv head (K/V read once), writes
//                       unnormalised partials (o, max in the log2 domain, sum) in f32. Each warp
//                       walks chunks of DEC_KC consecutive keys (every 8th chunk) with the next
//                       chunk's loads in flight; a chunk's DEC_KC x GQA_GROUP dot products are
//                       reduced across the warp together and the online softmax rescales once per
//                       chunk; the 8 warps' partials are summed in shared memory in a fixed order
//                       (no atomics: deterministic run to run).
//  attn_decode_mma:     attn_decode_split's work on tensor cores (same grid, arguments and partials;
//                       K and V of bf16 / fp8 / int8, int4 at head dims % 64 == 0; the default
//                       where the formats allow, design
//                       above its code at the end of this file).
//  attn_decode_combine: merges the n_split partials (log-sum-exp) into bf16 o; with a gate pointer
//                       also applies the attention output gate, o *= sigmoid(gate) (as
//                       elementwise.cu's sigmoid_gate_mul after it would).
// Shapes/dtypes: q [T, Hq, HD] bf16 (head h of token t at q + t*q_tok + h*q_head: contiguous is
//   q_tok = Hq*HD, q_head = HD; the attention q|gate projection output is q_tok = 2*Hq*HD,
//   q_head = 2*HD; q 4-byte aligned, strides even); k_cache, v_cache [num_blocks * page, Hkv * HD]
//   bf16 (16-byte aligned); block_tables [B, max_blocks] i32; seq_lens [B] i32 (kv length
//   including the new tokens); cu_seqlens [B+1] i32; tile_table [n_tiles, 2] i32 = (seq, 16-query
//   tile index) from the host; o [T, Hq, HD] bf16; part_o [B, Hq, n_split, HD] f32;
//   part_ml [B, Hq, n_split, 2] f32.
// Launch: attn_prefill grid (n_tiles, Hkv * GQA_GROUP / PF_HPB), block 64*PF_HPB, dynamic smem
//   2 stages * (K + V) * PF_BK keys * (HD+8) * 2 B + the pairs' exchange 2*PF_HPB*PF_BK*64 B
//   (91,136 B at HD 256, 32 keys, 6 heads); attn_decode_split grid
//   (B, Hkv, n_split), block 256 (8 warps, 2*DEC_KC keys per warp in flight, 16-byte loads at
//   HD 256 bf16), static smem 4*GQA_GROUP*HD*4 B + 0.5 KB;
//   attn_decode_combine grid (B, Hq), block HD.
//   -D HD (head dim, multiple of 32, <= 256), GQA_GROUP (Hq / Hkv, 1..8); PF_BK, PF_PSPLIT, PF_HPB
//   (ops::attention tiling: nvrtc::AttnTiling).
// Arch: sm_80+ (mma.sync, ldmatrix, cp.async; no Hopper-only instructions).
// Tested by: tests/ops.rs cases "kv_write+attn_prefill" and "attn_decode" against
//   deltaserve_cpu::attention::causal_gqa_attention; timed by tests/bench_attention.rs.
//
// Quantised KV (-D KV_K_FMT / KV_V_FMT = KVF_FP8 1, KVF_INT8 2, KVF_INT4 3; absent = bf16, which
// compiles exactly the bf16 code): the cache of that matrix holds codes [rows, Hkv, HD] (fp8 e4m3 /
// int8 1 B, int4 two per byte, low nibble first; written by kv_quant.cu) and k_scales / v_scales
// [rows, Hkv] f16, value = code * scale (deltaserve_cpu::kvquant). Every code is exact in bf16 and
// f32, so the kernels never round a dequantised value: the scale of key p is applied in f32 outside
// the dot products, S[i,p] = kscale[p] * (q_i . kcode_p) and O[i] = sum_p (P[i,p] * vscale[p]) vcode_p
// (the V scale folds into P before its hi/lo bf16 split; the softmax sums use P unscaled). Tested by
// tests/ops.rs cases "kv_q+attn_prefill" / "kv_q+attn_decode" against the CPU attention over the
// CPU-dequantised cache (same tolerance as bf16).
//  - prefill: the codes of a KV tile are copied (cp.async, double-buffered as for bf16) into a raw
//    stage; after the wait all threads widen them to bf16 codes in a single converted tile with the
//    bf16 layout (padded rows), which the unchanged ldmatrix/mma path reads. Tile scales travel
//    through registers of threads 0..31 (loaded when the tile is issued, stored to smem one
//    iteration later) into f32 smem. Smem (HD 256): fp8/int8 66.3 KB, int4 50.3 KB, mixed <= 66.8 KB.
//  - decode: each lane loads its HD/32 codes (32-bit words when they are whole) and widens them.
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

#ifndef HD
#define HD 256
#endif
#ifndef GQA_GROUP
#define GQA_GROUP 6
#endif
#define NEG_INF (-__int_as_float(0x7f800000))

// KV-cache formats: KVF_* (prelude.cuh).
#ifndef KV_K_FMT
#define KV_K_FMT KVF_BF16
#endif
#ifndef KV_V_FMT
#define KV_V_FMT KVF_BF16
#endif
#define KQ_K (KV_K_FMT != KVF_BF16)
#define KQ_V (KV_V_FMT != KVF_BF16)
#define KQ_ANY (KQ_K || KQ_V)
// Bytes of one token-head row in the cache.
#define KV_ROWB(f) ((f) == KVF_BF16 ? 2 * HD : ((f) == KVF_INT4 ? HD / 2 : HD))
#define K_ROWB KV_ROWB(KV_K_FMT)
#define V_ROWB KV_ROWB(KV_V_FMT)

// Code (low 8 bits; int4: low 4) -> its exact value as f32.
template <int FMT>
__device__ __forceinline__ float kv_code_f32(u32 c) {
    if (FMT == KVF_FP8) {
        // e4m3 bits as an f32 with the exponent field at bit 23 (subnormal when e = 0), times
        // 2^120 (= 2^(127-7)): exact for normal and subnormal codes (no flush to zero).
        const float a = __uint_as_float((c & 0x7fu) << 20) * __uint_as_float(247u << 23);
        return __uint_as_float(__float_as_uint(a) | ((c & 0x80u) << 24));
    } else if (FMT == KVF_INT8) {
        return (float)(int)(signed char)(c & 0xffu);
    } else {
        return (float)(((int)(c << 28)) >> 28);
    }
}

// Two codes -> packed bf16x2 (exact: every code has <= 4 significant bits, int8 <= 8 bits).
template <int FMT>
__device__ __forceinline__ u32 kv_codes_bf16x2(u32 c0, u32 c1) {
    return (__float_as_uint(kv_code_f32<FMT>(c0)) >> 16) | (__float_as_uint(kv_code_f32<FMT>(c1)) & 0xffff0000u);
}


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
#define PF_STR (HD + 8)                // smem row stride in bf16 (16-byte pad)
#define PF_CH (HD / 8)                 // 16-byte chunks per K/V row
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
#define PF_SMEM_BYTES (PF_XCH + PF_NW * PF_BK * 64)  // = ops/attention.rs prefill_smem_bytes

// Widens the raw codes of one tile (BK rows) into bf16 codes with the padded tile layout (NT threads).
template <int FMT, int NT, int BK>
__device__ __forceinline__ void pf_convert_tile(const unsigned char* raw, unsigned char* cv, int tid) {
    for (int c = tid; c < BK * (HD / 8); c += NT) {
        const int r = c / (HD / 8), ch = c % (HD / 8);  // 8 elements: one 16-byte bf16 store
        uint4 o;
        if (FMT == KVF_INT4) {
            const u32 w = *(const u32*)(raw + r * (HD / 2) + ch * 4);
            o.x = kv_codes_bf16x2<FMT>(w, w >> 4);
            o.y = kv_codes_bf16x2<FMT>(w >> 8, w >> 12);
            o.z = kv_codes_bf16x2<FMT>(w >> 16, w >> 20);
            o.w = kv_codes_bf16x2<FMT>(w >> 24, w >> 28);
        } else {
            const uint2 w = *(const uint2*)(raw + r * HD + ch * 8);
            o.x = kv_codes_bf16x2<FMT>(w.x, w.x >> 8);
            o.y = kv_codes_bf16x2<FMT>(w.x >> 16, w.x >> 24);
            o.z = kv_codes_bf16x2<FMT>(w.y, w.y >> 8);
            o.w = kv_codes_bf16x2<FMT>(w.y >> 16, w.y >> 24);
        }
        *(uint4*)(cv + (r * PF_STR + ch * 8) * 2) = o;
    }
}

// Issues the cp.async copies of keys [kb, kb + BK) of a cache with quantised K and/or V (a bf16
// matrix lands as a padded bf16 tile, codes packed as BK rows of K_ROWB / V_ROWB bytes) into a stage
// at `dst` (K part, then the V part KPART bytes later; token-head row (row * Hkv + hkv)); threads
// tid < BK return the f16 scale bits of key kb + tid in sk / sv (0 past kend or for a bf16 matrix).
// Keys at or past kend are zero-filled. NT threads; the caller commits.
template <int NT, int BK, int KPART>
__device__ __forceinline__ void kv_tile_q(u32 dst, const unsigned char* kbytes, const unsigned char* vbytes,
                                          const unsigned short* k_scales, const unsigned short* v_scales,
                                          const int* bt, int page, int pshift, bool page_tiles, int Hkv, int hkv,
                                          int kb, int kend, int tid, u32& sk, u32& sv) {
    long long row0 = 0;
    if (page_tiles) {
        const int pg = pshift >= 0 ? kb >> pshift : kb / page;  // no division for power-of-two pages
        row0 = (long long)bt[pg] * page + (kb - pg * page);
    }
    auto row_of = [&](int p, int r) -> long long {
        if (page_tiles) return row0 + r;
        if (pshift >= 0) return (long long)bt[p >> pshift] * page + (p & (page - 1));
        return (long long)bt[p / page] * page + p % page;
    };
#pragma unroll
    for (int m = 0; m < 2; m++) {
        const bool quant = m == 0 ? KQ_K : KQ_V;
        const int rowb = m == 0 ? K_ROWB : V_ROWB;
        const int nch = rowb / 16;
        const unsigned char* src = m == 0 ? kbytes : vbytes;
        const u32 dm = dst + (m == 0 ? 0 : KPART);
        for (int c = tid; c < BK * nch; c += NT) {
            const int r = c / nch, ch = c % nch;
            const int p = kb + r;
            const bool ok = p < kend;
            const long long row = ok ? row_of(p, r) : 0;
            const u32 d = dm + (quant ? (u32)(r * rowb + ch * 16) : (u32)(r * PF_STR + ch * 8) * 2);
            cp_async16(d, src + (row * Hkv + hkv) * rowb + ch * 16, ok ? 16 : 0);
        }
    }
    if (tid < BK) {
        const int p = kb + tid;
        unsigned short a = 0, b = 0;
        if (p < kend) {
            const long long row = row_of(p, tid);
            if (KQ_K) a = k_scales[row * Hkv + hkv];
            if (KQ_V) b = v_scales[row * Hkv + hkv];
        }
        sk = a;
        sv = b;
    }
}

// (x0, x1) -> hi = bf16x2(x0, x1) and lo = bf16x2(x0 - hi0, x1 - hi1).
__device__ __forceinline__ void split_bf16(float x0, float x1, u32& hi, u32& lo) {
    hi = pack_bf16(x0, x1);
    lo = pack_bf16(x0 - __uint_as_float(hi << 16), x1 - __uint_as_float(hi & 0xffff0000u));
}

// One block = 16 queries x PF_HPB query heads of one kv head; warps 2h and 2h+1 (a pair) own query
// head h of the block and split its head dims: each holds Q and the f32 O accumulator for its
// PF_HALF dims only (half the registers of one warp per head, so twice the warps fit on an SM).
// Per KV tile each warp computes S over its half of the dims, the pair swaps the partial S through
// shared memory (named barrier 1 + h, 64 threads) and both add them (a + b == b + a: the two warps
// hold bitwise the same S, max, P and row sums), then each multiplies P by its half of V.
// 2^x in one MUFU op (inputs <= 0 here; results below 2^-126 flush to 0, -inf gives 0).
__device__ __forceinline__ float pf_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
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

// Issues the cp.async copies of keys [kb, kb + BK) of one kv head's bf16 K and V (kbase / vbase:
// the head's first element in cache row 0, rows `width` elements apart) into a stage at `dst`: the
// K tile, then the V tile MAT bytes later (default BK * PF_STR * 2), rows padded to PF_STR. Keys at or past kend
// are zero-filled (their cache rows are never read). page_tiles: every BK-key tile lies inside one
// page (one block-table lookup; each thread copies a fixed 16-byte column of every (NT / PF_CH)-th
// row, so only a pointer advances per copy); pshift: log2(page) for power-of-two pages, else -1.
// NT threads call it; the caller commits the group.
// This thread's fixed 16-byte column of the one-page copy: first row, source offset and smem
// offset (computed once per block, outside the KV loop).
struct KvLane {
    int row;
    long long off;
    u32 dst;
};
__device__ __forceinline__ KvLane kv_lane(int tid, long long width) {
    const int row = tid / PF_CH;
    return KvLane{row, (long long)row * width + (tid % PF_CH) * 8, (u32)(row * PF_STR + (tid % PF_CH) * 8) * 2};
}
template <int NT, int BK, int MAT = BK * PF_STR * 2>
__device__ __forceinline__ void kv_tile_bf16(u32 dst, const bf16_t* kbase, const bf16_t* vbase, const int* bt,
                                             int page, int pshift, bool page_tiles, long long width, int kb,
                                             int kend, int tid, const KvLane& ln) {
    long long row0 = 0;
    if (page_tiles) {
        // A 32-bit division per tile was ~30 of the ~365 instructions a warp issued per tile.
        const int pg = pshift >= 0 ? kb >> pshift : kb / page;
        row0 = (long long)bt[pg] * page + (kb - pg * page);
    }
    if (NT % PF_CH == 0 && page_tiles) {
        constexpr int RSTEP = NT % PF_CH == 0 ? NT / PF_CH : 1;  // tile rows one pass copies
        const int lane_row = ln.row;
        const long long lane_off = ln.off;
        const u32 lane_dst = ln.dst;
        const bf16_t* kp = kbase + (row0 * width + lane_off);
        const bf16_t* vp = vbase + (row0 * width + lane_off);
        const long long step = RSTEP * width;
        const int left = kend - kb - lane_row;  // rows lane_row + i * RSTEP are visible while i * RSTEP < left
#pragma unroll
        for (int i = 0; i < (BK + RSTEP - 1) / RSTEP; i++) {
            if (BK % RSTEP == 0 || lane_row + i * RSTEP < BK) {
                const u32 d = dst + lane_dst + (u32)(i * RSTEP * PF_STR * 2);
                const int n = i * RSTEP < left ? 16 : 0;
                cp_async16(d, kp, n);
                cp_async16(d + MAT, vp, n);
            }
            kp += step;
            vp += step;
        }
        return;
    }
    for (int c = tid; c < BK * PF_CH; c += NT) {
        const int r = c / PF_CH, ch = c % PF_CH;
        const int p = kb + r;
        const bool ok = p < kend;
        long long row = 0;
        if (ok) row = page_tiles ? row0 + r : (long long)bt[p / page] * page + p % page;
        const long long off = row * width + ch * 8;
        const u32 d = dst + (u32)(r * PF_STR + ch * 8) * 2;
        cp_async16(d, kbase + off, ok ? 16 : 0);
        cp_async16(d + MAT, vbase + off, ok ? 16 : 0);
    }
}

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
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
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

    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
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

// ---------------------------------------------------------------------------------------------
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
// Launch: grid (n_tiles, Hkv), block PW_NT, dynamic smem ops/attention.rs wide_smem_bytes;
// tile_table [n_tiles, 2] = (seq, 128-row tile) over the packed rows (q_len * GQA_GROUP per sequence).
// q 16-byte aligned with q_tok, q_head multiples of 8.
#define PW_ROWS 128                        // packed (query, head) rows per block
#define PW_NW 8                            // warps per block: 4 pairs x 32 rows
#define PW_NT (32 * PW_NW)
#define PW_KV0 (PW_ROWS * HD * 2)          // the K/V stages follow the Q tile
#define PW_SWZ (PF_CH >= 8 ? 7 : PF_CH - 1)
// Smem layout for BK keys per tile (its total = ops/attention.rs wide_smem_bytes): Q, 2 stages of K + V (a
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

template <int BK>
__device__ __forceinline__ void wide_body(const bf16_t* __restrict__ q, const void* __restrict__ k_cache,
                                          const void* __restrict__ v_cache,
                                          const unsigned short* __restrict__ k_scales,
                                          const unsigned short* __restrict__ v_scales, const int* __restrict__ block_tables,
                                          int max_blocks, const int* __restrict__ cu_seqlens,
                                          const int* __restrict__ seq_lens, const int* __restrict__ tile_table,
                                          bf16_t* __restrict__ o, int Hq, int Hkv, int page, float scale,
                                          long long q_tok, long long q_head) {
    constexpr int MAT = pw_mat(BK), STAGE = pw_stage(BK);
    constexpr bool SPLIT_S = BK == 32;  // two accumulator sets for S (registers allow it at 32 keys)
    extern __shared__ __align__(16) unsigned char pw_smem[];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, tg = lane & 3;
    const int pair = warp >> 1, half = warp & 1;
    const int d0 = half * PF_HALF;
    const int tile = gridDim.x - 1 - blockIdx.x;
    const int s = tile_table[2 * tile], rt = tile_table[2 * tile + 1];
    const int hkv = blockIdx.y;
    const int qstart = cu_seqlens[s], qlen = cu_seqlens[s + 1] - qstart;
    const int past = seq_lens[s] - qlen;
    const int r0 = rt * PW_ROWS;
    const int nrows = min(PW_ROWS, qlen * GQA_GROUP - r0);
    const int first_q = past + r0 / GQA_GROUP;
    const int kend = past + (r0 + nrows - 1) / GQA_GROUP + 1;
    const int n_kt = (kend + BK - 1) / BK;
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

    for (int c = tid; c < PW_ROWS * PF_CH; c += PW_NT) {
        const int r = c / PF_CH, ch = c % PF_CH;
        const bool ok = r < nrows;
        const int pr = r0 + r, i = pr / GQA_GROUP, hh = pr - i * GQA_GROUP;
        const bf16_t* src = ok ? q + (long long)(qstart + i) * q_tok + (long long)(hkv * GQA_GROUP + hh) * q_head + ch * 8 : q;
        cp_async16(sbase + (u32)(r * HD * 2 + (ch ^ (r & PW_SWZ)) * 16), src, ok ? 16 : 0);
    }
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
    load_tile(0, kv0);

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

    for (int j = 0; j < n_kt; j++) {
#if KQ_ANY
        // Tile j's scales (loaded with its codes) to smem before load_tile(j + 1) reuses the
        // registers; the previous iteration's last barrier freed the buffers.
        if (tid < BK) {
            if (KQ_K) ((float*)(pw_smem + pw_sck(BK)))[tid] = f16_to_f32((unsigned short)pend_k);
            if (KQ_V) ((float*)(pw_smem + pw_scv(BK)))[tid] = f16_to_f32((unsigned short)pend_v);
        }
#endif
        if (j + 1 < n_kt) {
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
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            mx = fmaxf(mrow[hf], mx * fs);
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
    float l0 = lrow[0], l1 = lrow[1];
    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    *xa_me = make_float2(l0, l1);
    pair_sync<PW_NW / 2>(pair);
    const float2 lp = *xa_pa;
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
                  float scale, long long q_tok, long long q_head) {
    wide_body<32>(q, k_cache, v_cache, k_scales, v_scales, block_tables, max_blocks, cu_seqlens, seq_lens, tile_table, o, Hq, Hkv, page,
                  scale, q_tok, q_head);
}

extern "C" __global__ void __launch_bounds__(PW_NT, 1)
attn_prefill_wide64(const bf16_t* __restrict__ q, const void* __restrict__ k_cache,
                    const void* __restrict__ v_cache, const unsigned short* __restrict__ k_scales,
                    const unsigned short* __restrict__ v_scales, const int* __restrict__ block_tables, int max_blocks,
                    const int* __restrict__ cu_seqlens, const int* __restrict__ seq_lens,
                    const int* __restrict__ tile_table, bf16_t* __restrict__ o, int Hq, int Hkv, int page,
                    float scale, long long q_tok, long long q_head) {
    wide_body<64>(q, k_cache, v_cache, k_scales, v_scales, block_tables, max_blocks, cu_seqlens, seq_lens, tile_table, o, Hq, Hkv,
                  page, scale, q_tok, q_head);
}

#define DPL (HD / 32)  // dims per lane in decode
#define DEC_KC 4       // keys per chunk of a decode warp

// Decode: a lane's DPL elements of one token-head row, as raw bits (bf16 pairs or codes) in a uint4
// (DEC_LB(fmt) bytes from DEC_OFF(fmt, lane): 2*DPL for bf16, DPL for fp8 / int8, DPL/2 for int4 — at
// head dim 32 an int4 lane reads the byte that holds its one nibble, number DEC_NIB0(lane)), widened
// at use.
#define DEC_LB(f) ((f) == KVF_BF16 ? 2 * DPL : ((f) == KVF_INT4 ? (DPL + 1) / 2 : DPL))
#define DEC_OFF(f, lane) ((f) == KVF_INT4 ? ((lane) * DPL) >> 1 : (lane) * DEC_LB(f))
#define DEC_NIB0(lane) (((lane) * DPL) & 1)
template <int BYTES>
__device__ __forceinline__ uint4 dec_load_raw(const unsigned char* p) {
    uint4 r = make_uint4(0u, 0u, 0u, 0u);
    if (BYTES == 16) {
        r = *(const uint4*)p;
    } else if (BYTES == 8) {
        const uint2 v = *(const uint2*)p;
        r.x = v.x;
        r.y = v.y;
    } else if (BYTES == 4) {
        r.x = *(const u32*)p;
    } else if (BYTES == 2) {
        r.x = *(const unsigned short*)p;
    } else {
        r.x = *p;
    }
    return r;
}
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

extern "C" __global__ void attn_decode_combine(const float* part_o, const float* part_ml,
                                               const int* __restrict__ seq_lens,
                                               bf16_t* __restrict__ o, int Hq, int n_split,
                                               const bf16_t* gate, long long g_tok,
                                               long long g_head) {
    pdl_trigger();  // launched programmatically on sm_90: the GEMV that follows may start streaming its weights
    const int b = blockIdx.x, h = blockIdx.y, d = threadIdx.x;
    const long long base = ((long long)b * Hq + h) * n_split;
    const int parts = dec_parts(seq_lens[b], n_split);  // (a step input: before the wait)
    pdl_wait();
    float M = NEG_INF;
    for (int sp = 0; sp < parts; sp++) M = fmaxf(M, part_ml[(base + sp) * 2]);
    float num = 0.0f, den = 0.0f;
    for (int sp = 0; sp < parts; sp++) {
        float ms = part_ml[(base + sp) * 2];
        if (ms == NEG_INF) continue;
        float f = pf_exp2(ms - M);  // partial maxima are in the log2 domain
        num += f * part_o[(base + sp) * HD + d];
        den += f * part_ml[(base + sp) * 2 + 1];
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
// Arch: mma.sync, movmatrix (sm_75+), cvt e4m3x2 only under __CUDA_ARCH__ >= 890: sm_80+.
// Tested by: tests/ops.rs cases "attn_decode" (bf16) and "kv_q+attn_decode" (K/V pairs of bf16 /
// fp8 / int8 / int4), each also run on attn_decode_split, against the CPU attention over the
// dequantised cache; timed by tests/bench_attention.rs (decode: bf16, fp8, int4).
#define DM_OK(f) ((f) != KVF_INT4 || HD % 64 == 0)  // int4: a lane's V piece is >= 4 bytes
#define DM_BITS(f) ((f) == KVF_BF16 ? 16 : ((f) == KVF_INT4 ? 4 : 8))
#define DM_KB (HD * DM_BITS(KV_K_FMT) / 8)  // bytes of a K / V token-head row
#define DM_VB (HD * DM_BITS(KV_V_FMT) / 8)
#define DM_MT (HD / 16)                         // K steps of S^T = m-tiles of O^T
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
#define DM_KW (DM_KB / 16)                      // K words per lane per key
#define DM_KU ((DM_KB / 4) % 16 == 0 ? 16 : 8)  // K load unit (bytes) of a lane
#define DM_VW (DM_VB / 32)                      // V words per lane per key
#define DM_VU ((DM_VB / 8) % 16 == 0 ? 16 : ((DM_VB / 8) % 8 == 0 ? 8 : 4))  // V load unit
#define DM_VWH (DM_VW / (1 + DM_PAIR))          // V words per lane per key of a warp (its half of the dims)
#define DM_VC (DM_VU < 4 * DM_VWH ? DM_VU : 4 * DM_VWH)  // V load chunk (bytes) of a warp

// Byte of word w of lane t's K piece of a key row: load unit j = w / (KU/4) at KU * (4j + t).
__device__ __forceinline__ int dm_kbyte(int t, int w) {
    return DM_KU * (4 * (w / (DM_KU / 4)) + t) + 4 * (w % (DM_KU / 4));
}
// Byte of word w of lane g's V piece of a key row: load unit j at VU * (8j + g).
__device__ __forceinline__ int dm_vbyte(int g, int w) {
    return DM_VU * (8 * (w / (DM_VU / 4)) + g) + 4 * (w % (DM_VU / 4));
}
// Dim of value r (0..3) of K step st for lane t: r = 0, 1 are a0's (and Q's b0) pair, r = 2, 3 a2's (b1).
// 1-byte codes: bytes r of word st; int4 (two dims a byte, low nibble first): of word st / 2, the low
// (r = 0, 1) or high (r = 2, 3) nibbles of bytes s = st & 1 (r = 0, 2) and s + 2 (r = 1, 3), so that
// a fragment register is one mask of the word shifted (dm_i4); bf16: the halves of words 2 st, 2 st + 1.
__device__ __forceinline__ int dm_kel(int t, int st, int r) {
    if (KV_K_FMT == KVF_INT4) return 2 * (dm_kbyte(t, st >> 1) + (st & 1) + 2 * (r & 1)) + (r >> 1);
    return DM_KB == HD ? dm_kbyte(t, st) + r : dm_kbyte(t, 2 * st + (r >> 1)) / 2 + (r & 1);
}
// Dim of row g (hi = 0) or g + 8 (hi = 1) of O^T's m-tile i for lane g: 1-byte codes, bytes 2 (i & 1)
// + hi of word i / 2; int4, the nibbles of byte i & 3 of word i / 4; bf16, the halves of word i.
__device__ __forceinline__ int dm_vel(int g, int i, int hi) {
    if (KV_V_FMT == KVF_INT4) return 2 * (dm_vbyte(g, i >> 2) + (i & 3)) + hi;
    return DM_VB == HD ? dm_vbyte(g, i >> 1) + 2 * (i & 1) + hi : dm_vbyte(g, i) / 2 + hi;
}

// The merge's shared rows (attn_decode_mma's red[slot]): dim d of head h at h * DM_RS + d + d / 32. A warp's
// lanes (g, t) store dims 16 g + const of heads 2t (+ 1) (dm_vel, 1-byte codes); in plain [h][HD] rows
// those fall in 2 of the 32 banks (16-way conflicts, ~6 us of a 1K-context decode block). With one word
// after every 32 dims and rows DM_RS = 2 (mod 32) words apart, lane (g, t) lands in bank 4t + g / 2 +
// 16 (g % 2) + const: all different. The final pass reads 32 consecutive dims: conflict-free.
#define DM_RS (((HD + HD / 32 - 2 + 31) / 32) * 32 + 2)
__device__ __forceinline__ int dm_ridx(int h, int d) { return h * DM_RS + d + (d >> 5); }

// U bytes (16, 8 or 4) at p into the words w[0 .. U/4) (dec_load_raw's vector load).
template <int U>
__device__ __forceinline__ void dm_load(const unsigned char* p, u32* w) {
    const uint4 v = dec_load_raw<U>(p);
#pragma unroll
    for (int i = 0; i < U / 4; i++) w[i] = u4_comp(v, i);
}

__device__ __forceinline__ u32 dm_prmt(u32 a, u32 b, u32 sel) {
    u32 r;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
    return r;
}

// Two f32 -> f16x2 (lo in bits 0..15), round to nearest even.
__device__ __forceinline__ u32 dm_pack_h2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
__device__ __forceinline__ float dm_h_lo(u32 h) { return f16_to_f32((unsigned short)(h & 0xffffu)); }
__device__ __forceinline__ float dm_h_hi(u32 h) { return f16_to_f32((unsigned short)(h >> 16)); }

// Two f32 -> the 16-bit pair of the mma type that V's format uses (bf16: bf16, codes: f16).
template <int FMT>
__device__ __forceinline__ u32 dm_pack(float lo, float hi) {
    return FMT == KVF_BF16 ? pack_bf16(lo, hi) : dm_pack_h2(lo, hi);
}
template <int FMT>
__device__ __forceinline__ float dm_lo(u32 h) {
    return FMT == KVF_BF16 ? __uint_as_float(h << 16) : dm_h_lo(h);
}
template <int FMT>
__device__ __forceinline__ float dm_hi(u32 h) {
    return FMT == KVF_BF16 ? __uint_as_float(h & 0xffff0000u) : dm_h_hi(h);
}

// The codes in bytes 2h and 2h + 1 of w -> f16x2 of their exact values (byte 2h in the low half).
template <int FMT>
__device__ __forceinline__ u32 dm_h2(u32 w, int h) {
    u32 r;
    if (FMT == KVF_FP8) {
#if __CUDA_ARCH__ >= 890 && !defined(DM_NO_CVT_E4M3)  // (-DDM_NO_CVT_E4M3: tests the sm_80 path on sm_89+)
        const unsigned short s = (unsigned short)(w >> (16 * h));
        asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(r) : "h"(s));
#else
        // [0, b0, 0, b1]: sign to bit 15, the 7 exponent/mantissa bits to bits 13..7 = the f16 of
        // code * 2^-8 (subnormal codes included), then * 256 (exact).
        const u32 v = dm_prmt(w, 0u, h ? 0x3424u : 0x1404u);
        const u32 f = (v & 0x80008000u) | ((v >> 1) & 0x3f803f80u);
        asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(f), "r"(0x5c005c00u));
#endif
    } else {
        // f16 (1024 + (c + 128)) - 1152 = c, exact.
        const u32 v = dm_prmt(w ^ 0x80808080u, 0x64646464u, h ? 0x5342u : 0x5140u);
        asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(v), "r"(0x64806480u));
    }
    return r;
}

// The two int4 codes (two's complement, -8..7) at bits 0..3 and 16..19 of x -> f16x2 of their exact
// values: flipping a code's top bit gives c + 8, and f16 (1024 + (c + 8)) - 1032 = c; the mask, the
// flip and the f16 exponent bits are one LOP3, ((x & 0x000f000f) ^ 0x64086408), then one HSUB2.
__device__ __forceinline__ u32 dm_i4(u32 x) {
    u32 r;
    asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"((x & 0x000f000fu) ^ 0x64086408u), "r"(0x64086408u));
    return r;
}

__device__ __forceinline__ void mma_f16(float (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
// The mma of a matrix's format: bf16 for a bf16 cache, f16 for codes.
template <int FMT>
__device__ __forceinline__ void dm_mma(float (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    if (FMT == KVF_BF16) {
        mma_bf16(c, a0, a1, a2, a3, b0, b1);
    } else {
        mma_f16(c, a0, a1, a2, a3, b0, b1);
    }
}

// Transpose of an 8x8 16-bit matrix in the mma fragment layout (lane (g, t): row g, cols 2t, 2t+1).
__device__ __forceinline__ u32 dm_movt(u32 x) {
    u32 r;
    asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(r) : "r"(x));
    return r;
}

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
    // While the previous kernel runs: the K and V rows (and scales) of the partition's first 8 tiles
    // into L2 (prefetch.global.L2: coherent, so this step's rows, which the previous kernel writes, are
    // safe to prefetch too). Thread i takes key k0 + i / 2, every other 128-byte line of its rows.
    if (sp < parts) {
        const int p = k0 + (threadIdx.x >> 1);
        if (p < k1) {
            const long long th = ((long long)bt[p / page] * page + p % page) * Hkv + hkv;
            for (int off = (threadIdx.x & 1) * 128; off < DM_KB; off += 256) l2_prefetch(kc + th * DM_KB + off);
            for (int off = (threadIdx.x & 1) * 128; off < DM_VB; off += 256) l2_prefetch(vc + th * DM_VB + off);
            if (((p - k0) & 15) == 0 && (threadIdx.x & 1) == 0) {
                if (KQ_K) l2_prefetch(k_scales + th);
                if (KQ_V) l2_prefetch(v_scales + th);
            }
        }
    }
    pdl_wait();
    if (sp >= parts) return;

    // Q: head g of the group (zeros past it), lane t's dims of each K step (bf16 K: as stored; codes:
    // times qs, in f16). Warp 0 loads it, stores the fragments and the factor; the others wait.
    if (w == 0) {
        const bf16_t* qh = q + (long long)b * q_tok + (long long)(hkv * GQA_GROUP + g) * q_head;
        u32 qw[DM_MT][2];
        float qmax = 0.0f;
#pragma unroll
        for (int st = 0; st < DM_MT; st++) {
#pragma unroll
            for (int r = 0; r < 2; r++) {
                if (KV_K_FMT == KVF_INT4) {  // (dm_kel's pairs are not adjacent dims)
                    const u32 lo = g < GQA_GROUP ? qh[dm_kel(t, st, 2 * r)] : 0u;
                    const u32 hi = g < GQA_GROUP ? qh[dm_kel(t, st, 2 * r + 1)] : 0u;
                    qw[st][r] = lo | (hi << 16);
                } else {
                    qw[st][r] = g < GQA_GROUP ? *(const u32*)(qh + dm_kel(t, st, 2 * r)) : 0u;
                }
                qmax = fmaxf(qmax, fmaxf(fabsf(__uint_as_float(qw[st][r] << 16)),
                                         fabsf(__uint_as_float(qw[st][r] & 0xffff0000u))));
            }
        }
        float qs = 1.0f;
        if (KV_K_FMT != KVF_BF16) {
            qmax = warp_max(qmax);  // the warp's lanes hold all of the group's Q
            const int ex = qmax > 0.0f ? max((int)((__float_as_uint(qmax) >> 23) & 0xffu) - 127, -100) : 0;
            qs = __uint_as_float((u32)(127 + 14 - ex) << 23);
        }
#pragma unroll
        for (int st = 0; st < DM_MT; st++) {
            u32 f[2];
#pragma unroll
            for (int r = 0; r < 2; r++) {
                f[r] = KV_K_FMT == KVF_BF16 ? qw[st][r]
                                            : dm_pack_h2(__uint_as_float(qw[st][r] << 16) * qs,
                                                         __uint_as_float(qw[st][r] & 0xffff0000u) * qs);
            }
            qsm[st][lane] = make_uint2(f[0], f[1]);
        }
        if (lane == 0) kf_sm = scale * 1.4426950408889634f / qs;
    }
    __syncthreads();
    const float kf = kf_sm;  // S^T's factor besides the key's scale: scale * log2(e) (/ qs)

    // A tile's raw values: K of keys g, g + 8 (lane t's piece), V of keys 2t, 2t+1, 2t+8, 2t+9 (lane
    // g's piece), the scales of keys g, g + 8 (1 for bf16). Keys at or past k1: zeros (their rows
    // are never read).
    struct KPart {
        u32 k[2][DM_KW];
        float ks[2], vs[2];
    };
    struct VPart {
        u32 v[4][DM_VWH];  // this warp's words hh * DM_VWH ...
    };
    const bool one_page = page % 16 == 0;  // a 16-key tile (16-aligned) lies inside one page
    auto row_of = [&](int p0, long long rb, int p) -> long long {
        return one_page ? rb + (p - p0) : (long long)bt[p / page] * page + p % page;
    };
    auto tile_base = [&](int p0) -> long long { return one_page ? (long long)bt[p0 / page] * page + p0 % page : 0; };
    auto load_k = [&](int p0, long long rb, KPart& r) {
#pragma unroll
        for (int kk = 0; kk < 2; kk++) {
            const int p = p0 + g + 8 * kk;
            if (p < k1) {
                const long long th = row_of(p0, rb, p) * Hkv + hkv;
                const unsigned char* src = kc + th * DM_KB;
#pragma unroll
                for (int j = 0; j < DM_KW / (DM_KU / 4); j++)
                    dm_load<DM_KU>(src + DM_KU * (4 * j + t), &r.k[kk][j * (DM_KU / 4)]);
                r.ks[kk] = KQ_K ? f16_to_f32(k_scales[th]) : 1.0f;
                r.vs[kk] = KQ_V ? f16_to_f32(v_scales[th]) : 1.0f;
            } else {
#pragma unroll
                for (int i = 0; i < DM_KW; i++) r.k[kk][i] = 0u;
                r.ks[kk] = 0.0f;
                r.vs[kk] = 0.0f;
            }
        }
    };
    auto load_v = [&](int p0, long long rb, VPart& r) {
#pragma unroll
        for (int vv = 0; vv < 4; vv++) {
            const int p = p0 + 2 * t + (vv & 1) + 8 * (vv >> 1);
            if (p < k1) {
                const unsigned char* src = vc + (row_of(p0, rb, p) * Hkv + hkv) * DM_VB;
#pragma unroll
                for (int j = 0; j < DM_VWH / (DM_VC / 4); j++)
                    dm_load<DM_VC>(src + dm_vbyte(g, hh * DM_VWH + j * (DM_VC / 4)), &r.v[vv][j * (DM_VC / 4)]);
            } else {
#pragma unroll
                for (int i = 0; i < DM_VWH; i++) r.v[vv][i] = 0u;
            }
        }
    };

    float acc[DM_MTH][4];  // m-tiles hh * DM_MTH ...
#pragma unroll
    for (int i = 0; i < DM_MTH; i++) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
    float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.0f, l1 = 0.0f, unit = 1.0f;
    const int ntiles = (k1 - k0 + 15) >> 4;
    KPart kcur;
    VPart vcur;
#if DM_PF
    KPart knxt;
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
#pragma unroll
            for (int kk = 0; kk < 2; kk++) {
                if (KV_K_FMT == KVF_INT4) {  // (dm_kel's nibbles: low, then high, of bytes st & 1 and + 2)
                    const u32 x = kcur.k[kk][st >> 1] >> (8 * (st & 1));
                    a[kk] = dm_i4(x);
                    a[2 + kk] = dm_i4(x >> 4);
                } else if (DM_KB == HD) {
                    a[kk] = dm_h2<KV_K_FMT>(kcur.k[kk][st], 0);
                    a[2 + kk] = dm_h2<KV_K_FMT>(kcur.k[kk][st], 1);
                } else {
                    a[kk] = kcur.k[kk][2 * st];
                    a[2 + kk] = kcur.k[kk][2 * st + 1];
                }
            }
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
#pragma unroll
            for (int kp = 0; kp < 2; kp++) {
                if (KV_V_FMT == KVF_INT4) {
                    // Byte i & 3 of word i / 4 of keys 2t (+8), 2t + 1 (+9) into bytes 0, 2: the low
                    // nibbles are row g's dim, the high ones row g + 8's.
                    const int j = i & 3;
                    const u32 y = dm_prmt(vcur.v[2 * kp][i >> 2], vcur.v[2 * kp + 1][i >> 2], (u32)(j | (4 + j) << 8));
                    va[2 * kp] = dm_i4(y);
                    va[2 * kp + 1] = dm_i4(y >> 4);
                } else if (DM_VB == HD) {
                    const u32 y = dm_prmt(vcur.v[2 * kp][i >> 1], vcur.v[2 * kp + 1][i >> 1], (i & 1) ? 0x7362u : 0x5140u);
                    va[2 * kp] = dm_h2<KV_V_FMT>(y, 0);
                    va[2 * kp + 1] = dm_h2<KV_V_FMT>(y, 1);
                } else {
                    va[2 * kp] = dm_prmt(vcur.v[2 * kp][i], vcur.v[2 * kp + 1][i], 0x5410u);
                    va[2 * kp + 1] = dm_prmt(vcur.v[2 * kp][i], vcur.v[2 * kp + 1][i], 0x7632u);
                }
            }
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
