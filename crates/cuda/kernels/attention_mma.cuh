// attention_mma.cuh — the tensor-core decode pieces that attn_decode_mma (attention_decode.cu) and
// attn_verify_mma (attention_verify.cu) share: the lane layout of a K / V row's codes in mma fragments
// (dm_kel, dm_vel: the design above attn_decode_mma), the shared-memory rows of the partial-O merge
// (dm_ridx), the f16 / bf16 packing and mma helpers, the L2 prefetch of a partition's first keys, the
// paged tile loaders (DmPages) and the fragments of Q, K and V. The module puts this file after attention_tile.cuh (dec_load_raw, dm_h2,
// dm_i4) and before the decode kernels.

#define DM_OK(f) ((f) != KVF_INT4 || HD % 64 == 0)  // int4: a lane's V piece is >= 4 bytes
#define DM_BITS(f) ((f) == KVF_BF16 ? 16 : ((f) == KVF_INT4 ? 4 : 8))
#define DM_KB (HD * DM_BITS(KV_K_FMT) / 8)  // bytes of a K / V token-head row
#define DM_VB (HD * DM_BITS(KV_V_FMT) / 8)
#define DM_MT (HD / 16)                         // K steps of S^T = m-tiles of O^T
#define DM_KW (DM_KB / 16)                      // K words per lane per key
#define DM_KU ((DM_KB / 4) % 16 == 0 ? 16 : 8)  // K load unit (bytes) of a lane
#define DM_VW (DM_VB / 32)                      // V words per lane per key
#define DM_VU ((DM_VB / 8) % 16 == 0 ? 16 : ((DM_VB / 8) % 8 == 0 ? 8 : 4))  // V load unit

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
__device__ __forceinline__ float dm_h_lo(u32 h) { return f16_to_f32((unsigned short)(h & 0xffffu)); }
__device__ __forceinline__ float dm_h_hi(u32 h) { return f16_to_f32((unsigned short)(h >> 16)); }

// Two f32 -> the 16-bit pair of the mma type that V's format uses (bf16: bf16, codes: f16).
template <int FMT>
__device__ __forceinline__ u32 dm_pack(float lo, float hi) {
    return FMT == KVF_BF16 ? pack_bf16(lo, hi) : pack_f16(lo, hi);
}
template <int FMT>
__device__ __forceinline__ float dm_lo(u32 h) {
    return FMT == KVF_BF16 ? __uint_as_float(h << 16) : dm_h_lo(h);
}
template <int FMT>
__device__ __forceinline__ float dm_hi(u32 h) {
    return FMT == KVF_BF16 ? __uint_as_float(h & 0xffff0000u) : dm_h_hi(h);
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

// While the previous kernel runs (before pdl_wait): the K and V rows (and scales) of keys k0 ..
// min(k1, k0 + blockDim.x / 2) of kv head hkv into L2 (prefetch.global.L2: coherent, so this step's rows, which
// the previous kernel writes, are safe to prefetch too). Thread i takes key k0 + i / 2, every other
// 128-byte line of its rows (blockDim.x / 2 keys).
__device__ __forceinline__ void dm_prefetch_keys(const unsigned char* kc, const unsigned char* vc,
                                                 const unsigned short* k_scales, const unsigned short* v_scales,
                                                 const int* bt, int page, int Hkv, int hkv, int k0, int k1) {
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

// One query column's B fragments of S^T (every lane of the warp calls it; lane (g, t) holds column
// g, whose head row is qh, zeros where !ok): f[st] the pair of K step st in dm_kel's dim order; bf16 K:
// as stored, codes: times a power of two qs that puts the warp's largest |q| in [2^14, 2^15) (bf16
// values are exact in f16 there). Returns qs (1 for bf16 K).
__device__ __forceinline__ float dm_q_frags(const bf16_t* qh, bool ok, int t, uint2 (&f)[DM_MT]) {
    u32 qw[DM_MT][2];
    float qmax = 0.0f;
#pragma unroll
    for (int st = 0; st < DM_MT; st++) {
#pragma unroll
        for (int r = 0; r < 2; r++) {
            if (KV_K_FMT == KVF_INT4) {  // (dm_kel's pairs are not adjacent dims)
                const u32 lo = ok ? qh[dm_kel(t, st, 2 * r)] : 0u;
                const u32 hi = ok ? qh[dm_kel(t, st, 2 * r + 1)] : 0u;
                qw[st][r] = lo | (hi << 16);
            } else {
                qw[st][r] = ok ? *(const u32*)(qh + dm_kel(t, st, 2 * r)) : 0u;
            }
            qmax = fmaxf(qmax, fmaxf(fabsf(__uint_as_float(qw[st][r] << 16)),
                                     fabsf(__uint_as_float(qw[st][r] & 0xffff0000u))));
        }
    }
    float qs = 1.0f;
    if (KV_K_FMT != KVF_BF16) {
        qmax = warp_max(qmax);  // the warp's lanes hold all of its columns
        const int ex = qmax > 0.0f ? max((int)((__float_as_uint(qmax) >> 23) & 0xffu) - 127, -100) : 0;
        qs = __uint_as_float((u32)(127 + 14 - ex) << 23);
    }
#pragma unroll
    for (int st = 0; st < DM_MT; st++) {
        u32 h[2];
#pragma unroll
        for (int r = 0; r < 2; r++) {
            h[r] = KV_K_FMT == KVF_BF16 ? qw[st][r]
                                        : pack_f16(__uint_as_float(qw[st][r] << 16) * qs,
                                                     __uint_as_float(qw[st][r] & 0xffff0000u) * qs);
        }
        f[st] = make_uint2(h[0], h[1]);
    }
    return qs;
}

// The A fragment of S^T's K step st (keys g, g + 8 x the step's dims, dm_kel) from a lane's raw K
// words k[key][word] (keys g, g + 8).
__device__ __forceinline__ void dm_k_frag(const u32 (&k)[2][DM_KW], int st, u32 (&a)[4]) {
#pragma unroll
    for (int kk = 0; kk < 2; kk++) {
        if (KV_K_FMT == KVF_INT4) {  // (dm_kel's nibbles: low, then high, of bytes st & 1 and + 2)
            const u32 x = k[kk][st >> 1] >> (8 * (st & 1));
            a[kk] = dm_i4(x);
            a[2 + kk] = dm_i4(x >> 4);
        } else if (DM_KB == HD) {
            a[kk] = dm_h2<KV_K_FMT>(k[kk][st], 0);
            a[2 + kk] = dm_h2<KV_K_FMT>(k[kk][st], 1);
        } else {
            a[kk] = k[kk][2 * st];
            a[2 + kk] = k[kk][2 * st + 1];
        }
    }
}

// The A fragment of O^T's m-tile i of a lane's V words v[key][word] (keys 2t, 2t + 1, 2t + 8, 2t + 9;
// VW words a key, from the lane's first m-tile on): rows g, g + 8 x keys (2t, 2t + 1), then (2t + 8,
// 2t + 9).
template <int VW>
__device__ __forceinline__ void dm_v_frag(const u32 (&v)[4][VW], int i, u32 (&va)[4]) {
#pragma unroll
    for (int kp = 0; kp < 2; kp++) {
        if (KV_V_FMT == KVF_INT4) {
            // Byte i & 3 of word i / 4 of keys 2t (+8), 2t + 1 (+9) into bytes 0, 2: the low
            // nibbles are row g's dim, the high ones row g + 8's.
            const int j = i & 3;
            const u32 y = dm_prmt(v[2 * kp][i >> 2], v[2 * kp + 1][i >> 2], (u32)(j | (4 + j) << 8));
            va[2 * kp] = dm_i4(y);
            va[2 * kp + 1] = dm_i4(y >> 4);
        } else if (DM_VB == HD) {
            const u32 y = dm_prmt(v[2 * kp][i >> 1], v[2 * kp + 1][i >> 1], (i & 1) ? 0x7362u : 0x5140u);
            va[2 * kp] = dm_h2<KV_V_FMT>(y, 0);
            va[2 * kp + 1] = dm_h2<KV_V_FMT>(y, 1);
        } else {
            va[2 * kp] = dm_prmt(v[2 * kp][i], v[2 * kp + 1][i], 0x5410u);
            va[2 * kp + 1] = dm_prmt(v[2 * kp][i], v[2 * kp + 1][i], 0x7632u);
        }
    }
}

// A 16-key tile's raw values for lane (g, t): K of keys g, g + 8 (lane t's piece, DM_KW words each), the
// scales of keys g, g + 8 (1 for bf16), and V of keys 2t, 2t + 1, 2t + 8, 2t + 9 (lane g's piece, VW words
// each from word hh * VW: a warp of a pair takes half of the dims). Keys at or past k1: zeros (their rows
// are never read).
struct DmKPart {
    u32 k[2][DM_KW];
    float ks[2], vs[2];
};
template <int VW>
struct DmVPart {
    u32 v[4][VW];
};

// The paged K/V rows of kv head hkv whose keys end at k1, as the tile loaders see them.
struct DmPages {
    const unsigned char* kc;
    const unsigned char* vc;
    const unsigned short* k_scales;
    const unsigned short* v_scales;
    const int* bt;  // the sequence's block-table row
    int page, Hkv, hkv, k1;
    bool one_page;  // page % 16 == 0: a 16-key tile (16-aligned) lies inside one page

    // The cache row of tile p0's first key (one_page; else 0), and of its key p.
    __device__ __forceinline__ long long tile_base(int p0) const {
        return one_page ? (long long)bt[p0 / page] * page + p0 % page : 0;
    }
    __device__ __forceinline__ long long row_of(int p0, long long rb, int p) const {
        return one_page ? rb + (p - p0) : (long long)bt[p / page] * page + p % page;
    }
    __device__ __forceinline__ void load_k(int p0, long long rb, int g, int t, DmKPart& r) const {
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
    }
    // VC: the load chunk (bytes) of a lane's VW words.
    template <int VW, int VC>
    __device__ __forceinline__ void load_v(int p0, long long rb, int g, int t, int hh, DmVPart<VW>& r) const {
#pragma unroll
        for (int vv = 0; vv < 4; vv++) {
            const int p = p0 + 2 * t + (vv & 1) + 8 * (vv >> 1);
            if (p < k1) {
                const unsigned char* src = vc + (row_of(p0, rb, p) * Hkv + hkv) * DM_VB;
#pragma unroll
                for (int j = 0; j < VW / (VC / 4); j++)
                    dm_load<VC>(src + dm_vbyte(g, hh * VW + j * (VC / 4)), &r.v[vv][j * (VC / 4)]);
            } else {
#pragma unroll
                for (int i = 0; i < VW; i++) r.v[vv][i] = 0u;
            }
        }
    }
};
