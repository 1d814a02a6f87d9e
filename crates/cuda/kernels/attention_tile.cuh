// attention_tile.cuh — device code shared by the attention kernels: causal GQA softmax attention
// over the paged KV cache (online softmax). src/nvrtc.rs prepends it (as text, after prelude.cuh) to
// attention_prefill.cu and attention_decode.cu, which compile together as the module "attention".
//
// Every attention kernel computes, per sequence s, query token i (absolute position past_s + i,
// past_s = seq_lens[s] - q_len_s) and query head h (kv head h / GQA_GROUP):
//   o[i, h] = sum_{p <= past_s + i} softmax_p(scale * q[i,h] . K[p]) V[p]
// where key p lives at cache row block_tables[s, p / page] * page + p % page.
// Shapes/dtypes: q [T, Hq, HD] bf16 (head h of token t at q + t*q_tok + h*q_head: contiguous is
//   q_tok = Hq*HD, q_head = HD; the attention q|gate projection output is q_tok = 2*Hq*HD,
//   q_head = 2*HD; q 4-byte aligned, strides even); k_cache, v_cache [num_blocks * page, Hkv * HD]
//   bf16 (16-byte aligned); block_tables [B, max_blocks] i32; seq_lens [B] i32 (kv length
//   including the new tokens); cu_seqlens [B+1] i32; tile_table [n_tiles, 2] i32 = (seq, 16-query
//   tile index) from the host; o [T, Hq, HD] bf16; part_o [B, Hq, n_split, HD] f32;
//   part_ml [B, Hq, n_split, 2] f32.
//   -D HD (head dim, multiple of 32, <= 256), GQA_GROUP (Hq / Hkv, 1..8).
// Arch: sm_80+ (mma.sync, ldmatrix, cp.async; no Hopper-only instructions).
// Tested by: tests/ops/ cases "kv_write+attn_prefill" and "attn_decode" against
//   deltaserve_cpu::attention::causal_gqa_attention; timed by tests/bench_attention.rs.
//
// Quantised KV (-D KV_K_FMT / KV_V_FMT = KVF_FP8 1, KVF_INT8 2, KVF_INT4 3; absent = bf16, which
// compiles exactly the bf16 code): the cache of that matrix holds codes [rows, Hkv, HD] (fp8 e4m3 /
// int8 1 B, int4 two per byte, low nibble first; written by kv_quant.cu) and k_scales / v_scales
// [rows, Hkv] f16, value = code * scale (deltaserve_cpu::kvquant). Every code is exact in bf16 and
// f32, so the kernels never round a dequantised value: the scale of key p is applied in f32 outside
// the dot products, S[i,p] = kscale[p] * (q_i . kcode_p) and O[i] = sum_p (P[i,p] * vscale[p]) vcode_p
// (the V scale folds into P before its hi/lo bf16 split; the softmax sums use P unscaled). Tested by
// tests/ops/ cases "kv_q+attn_prefill" / "kv_q+attn_decode" against the CPU attention over the
// CPU-dequantised cache (same tolerance as bf16).
//
// Provides: the specialisation defines and the KV formats; the exact widening of codes (to f32, to
// bf16 pairs, to f16 pairs for the tensor cores); the prefill kernels' K/V
// tiles (cp.async copies into padded bf16 rows, the widening of a tile of codes); the decode
// kernels' vector read of a lane's piece of a row. (The online softmax's 2^x and row max / sum,
// pf_exp2 / quad_max / quad_sum, are prelude.cuh's: the vision tower's attention shares them.)

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

// e4m3 codes widen to bf16 pairs with integer moves and one bf16x2 multiply (fp8x2_bf16x2): about 3.5
// instructions a value against about 8 for two f32 conversions (27B int4 + fp8 KV prefill at 128K on the
// H200: 1.07x with attn_prefill_wg, 1.13x with attn_prefill_ws). Build switch (-D, for measuring):
// KV_WIDEN_BF16X2=0 keeps the f32 conversions.
#ifndef KV_WIDEN_BF16X2
#define KV_WIDEN_BF16X2 1
#endif

// Two e4m3 codes in bytes 0 and 2 of v (bytes 1 and 3 zero) -> the bf16x2 of their exact values (byte 0 in
// the low half): the sign to bit 15 and the 7 exponent/mantissa bits to bits 10..4 make the bf16 of
// value * 2^-120 (a bf16 subnormal for a subnormal code, exact), then one multiply by 2^120 (bf16 0x7b80;
// the fma adds -0, which keeps every product, -0 included).
__device__ __forceinline__ u32 fp8x2_bf16x2(u32 v) {
    const u32 b = ((v & 0x00800080u) << 8) | ((v & 0x007f007fu) << 4);
    u32 r;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(b), "r"(0x7b807b80u), "r"(0x80008000u));
    return r;
}

// Two codes -> packed bf16x2 (exact: every code has <= 4 significant bits, int8 <= 8 bits).
template <int FMT>
__device__ __forceinline__ u32 kv_codes_bf16x2(u32 c0, u32 c1) {
    return (__float_as_uint(kv_code_f32<FMT>(c0)) >> 16) | (__float_as_uint(kv_code_f32<FMT>(c1)) & 0xffff0000u);
}

// ---------------------------------------------------------------------------------------------
// Codes as f16 pairs for the tensor cores (attn_decode_mma).
// The bytes of (a, b) that sel's nibbles pick (prmt.b32).
__device__ __forceinline__ u32 dm_prmt(u32 a, u32 b, u32 sel) {
    u32 r;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
    return r;
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

// ---------------------------------------------------------------------------------------------
// Prefill K/V tiles (attn_prefill, attn_prefill_wide*): bf16 rows padded to PF_STR, so the rows of
// an ldmatrix hit distinct banks; a quantised matrix's codes are copied raw, then widened.
#define PF_STR (HD + 8)                // smem row stride in bf16 (16-byte pad)
#define PF_CH (HD / 8)                 // 16-byte chunks per K/V row

// The 8 codes of row r's 16-byte bf16 chunk ch in a tile of raw codes (rows packed as they landed:
// HD / 2 bytes for int4, HD for the 8-bit formats), widened to bf16 (exact).
template <int FMT>
__device__ __forceinline__ uint4 kv_widen8(const unsigned char* raw, int r, int ch) {
    uint4 o;
    if (FMT == KVF_INT4) {
        const u32 w = *(const u32*)(raw + r * (HD / 2) + ch * 4);
        o.x = kv_codes_bf16x2<FMT>(w, w >> 4);
        o.y = kv_codes_bf16x2<FMT>(w >> 8, w >> 12);
        o.z = kv_codes_bf16x2<FMT>(w >> 16, w >> 20);
        o.w = kv_codes_bf16x2<FMT>(w >> 24, w >> 28);
    } else if (FMT == KVF_FP8 && KV_WIDEN_BF16X2) {
        const uint2 w = *(const uint2*)(raw + r * HD + ch * 8);
        o.x = fp8x2_bf16x2(dm_prmt(w.x, 0u, 0x4140u));
        o.y = fp8x2_bf16x2(dm_prmt(w.x, 0u, 0x4342u));
        o.z = fp8x2_bf16x2(dm_prmt(w.y, 0u, 0x4140u));
        o.w = fp8x2_bf16x2(dm_prmt(w.y, 0u, 0x4342u));
    } else {
        const uint2 w = *(const uint2*)(raw + r * HD + ch * 8);
        o.x = kv_codes_bf16x2<FMT>(w.x, w.x >> 8);
        o.y = kv_codes_bf16x2<FMT>(w.x >> 16, w.x >> 24);
        o.z = kv_codes_bf16x2<FMT>(w.y, w.y >> 8);
        o.w = kv_codes_bf16x2<FMT>(w.y >> 16, w.y >> 24);
    }
    return o;
}

// Widens the raw codes of one tile (BK rows) into bf16 codes with the padded tile layout (NT threads).
template <int FMT, int NT, int BK>
__device__ __forceinline__ void pf_convert_tile(const unsigned char* raw, unsigned char* cv, int tid) {
    for (int c = tid; c < BK * (HD / 8); c += NT) {
        const int r = c / (HD / 8), ch = c % (HD / 8);  // 8 elements: one 16-byte bf16 store
        *(uint4*)(cv + (r * PF_STR + ch * 8) * 2) = kv_widen8<FMT>(raw, r, ch);
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

// Issues the cp.async copies of keys [kb, kb + BK) of one kv head's bf16 K and V (kbase / vbase:
// the head's first element in cache row 0, rows `width` elements apart) into a stage at `dst`: the
// K tile, then the V tile MAT bytes later (default BK * PF_STR * 2), rows padded to PF_STR. Keys at or past kend
// are zero-filled (their cache rows are never read). page_tiles: every BK-key tile lies inside one
// page (one block-table lookup; each thread copies a fixed 16-byte column of every (NT / PF_CH)-th
// row, so only a pointer advances per copy); pshift: log2(page) for power-of-two pages, else -1.
// NT threads call it; the caller commits the group.
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

// ---------------------------------------------------------------------------------------------
// Decode reads (attn_decode_split, attn_decode_mma): BYTES (16, 8, 4, 2 or 1) at p into the low
// words of a uint4, in one load.
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
