// gdn_chunk.cu — chunked (WY / UT-transform) Gated DeltaNet prefill, chunk C = 64 (docs/architecture.md §3.1),
// on tensor cores (mma.sync m16n8k16 bf16 -> f32, ldmatrix, cp.async: sm_80/86/89/90, no wgmma).
//
// Computes, per sequence and value head (state h = S in [DK, DV], f32), chunk by chunk, with
// G = chunk-local cumsum of g, all exponents <= 0:
//   A_ij  = beta_i (k_i . k_j) exp(G_i - G_j)  (i > j)       P_ij = (q_i . k_j) exp(G_i - G_j)  (i >= j)
//   T     = (I + A)^-1                                      (unit lower triangular)
//   w     = T diag(beta exp(G)) K                           u    = T diag(beta) V
//   v_new = u - w h
//   o_i   = exp(G_i) q_i h + sum_{j<=i} P_ij v_new_j
//   h'    = exp(G_last) h + sum_j k_j^T (exp(G_last - G_j) v_new_j)
// Two kernels, several sequences per launch (varlen: cu_seqlens + state slots):
//  gdn_chunk_prep   grid (n_chunks, Hv), 128 threads (4 warps x 16 chunk rows), smem ~52 KB.
//      Everything that depends only on the chunk: K K^T and Q K^T on tensor cores (exact bf16
//      inputs, f32 accumulate), T in f32 by 16 x 16 blocks (forward substitution on the diagonal blocks,
//      then the block rows below as small products), then w and u as tensor-core products of T (times
//      the per-column scale) with K / V.
//      Writes the workspace, head-major (so that a chunk's rows of one head are contiguous and the
//      walk's tile copies are constant offsets from one base), per value head and flattened token t:
//        w_hi, w_lo [Hv, T, DK] bf16   u [Hv, T, DV] f32   P_hi, P_lo [Hv, T, 64] bf16
//        E [Hv, T, 2] f32 = (exp(G_i), exp(G_last - G_i)) (the walk's decays, computed once here)
//      (= 4*(DK+DV+66) B per token and head: the workspace stays bounded by the step's tokens).
//  gdn_chunk_state  grid (B, Hv, DV / (16*SNW)), SNW*32 threads, smem ~96 KB (fits sm_86's 99 KB).
//      The sequential walk. Everything is computed transposed so the recurrent state never leaves
//      registers: warp w owns 16 value columns and holds h^T (16 x DK, f32) as mma accumulator tiles,
//      which are also (register-only, no shuffle) the A operand of the next products:
//        vn^T = u^T - h^T w^T     (A = h^T, B = w rows)            64 chunk rows
//        o^T  = exp(G) * h^T q^T + vn^T P^T   (B = q rows, P rows; P lower triangular: half the tiles)
//        h^T  = exp(G_last) h^T + (Dl * vn)^T K   (B = K via ldmatrix.trans)
//      The chunk's w/q/P/K/decay tiles stream in with cp.async in three groups, each issued one chunk
//      ahead as soon as its buffer is free; each thread's copy addresses are a per-chunk base plus
//      constant offsets (unpredicated but for a sequence's last chunk); B fragments come in by
//      ldmatrix (one instruction per two n-tiles). The walk is bound by its own instruction stream (one block per
//      (sequence, head, 64 columns), one warp per scheduler), so every instruction per chunk counts:
//      an L2 prefetch of the next chunks cost more than it saved (bench/results/deltanet-prefill-kernels-h200-2026-11-30.md).
//      The state is read once and written once per (sequence, head) per launch.
// Precision (gdn_chunk_state, and prep's precise != 0, the default): every operand that is not exactly bf16 (h, T*scale, w, P,
//   v_new) is split into hi + lo bf16 and the products hi*hi + lo*hi + hi*lo are summed in f32
//   (~16 mantissa bits); q, k, v are exact bf16 inputs. precise == 0 drops the lo terms (FLA-like,
//   plain bf16 operands; about 2.4x fewer mma in the walk: gdn_chunk_state_bf16).
// Shapes/dtypes: q, k [T, Hk, DK] bf16 (L2-normalised, q pre-scaled: gdn_gate.cu), 16-byte aligned rows;
//   v [T, *] bf16 (head v at column v*DV, token stride v_stride (multiple of 8): the conv output);
//   g, beta [T, Hv] f32; state [slots, Hv, DK, DV] state_t (prelude.cuh); o [T, Hv, DV] bf16;
//   cu_seqlens [B+1] i32; slots [B] i32; chunk_table [n_chunks, 2] i32 = (seq, chunk index in seq),
//   built on the host (ops::gdn_chunk::chunk_table). Value head v reads key head v / (Hv / Hk).
//   gdn_chunk_state skips sequences of slot < 0: a sequence cut into segments (a snapshot inside a
//   step's chunk) has each segment as its own varlen entry, walked by one launch a segment in order,
//   the other entries of that launch at slot -1 (ops::gdn_chunk::Segments).
// -D DK, DV: multiples of 32, DK <= 128 (h^T lives in DK/2 registers per thread). GDN_BV is ignored.
// Tested by: tests/ops/ case "gdn_chunk" (1 token, 63/64/65/127/129, ragged batches, Hv/Hk=3,
//   carried state, 1000 tokens) against deltaserve_cpu::gdn::gdn_recurrent, both precision modes.

#ifndef DK
#define DK 128
#endif
#ifndef DV
#define DV 128
#endif
#define CH 64
#define KPB (DK + 8)   // bf16 row pitch of K / Q / w tiles (272 B for DK=128: conflict-free fragments)
#define VPB (DV + 8)   // bf16 row pitch of V tiles
#define PPB (CH + 8)   // bf16 row pitch of P tiles
#define AP (CH + 4)    // f32 row pitch of A and T
// gdn_chunk_prep's three regions (ops::gdn_chunk::prep_smem_bytes): K, then the staging of w and u (UB value
// columns a pass); Q, then T; A, then V.
#define PREP_UB (DV < 64 ? DV : 64)
#define PREP_MAX(a, b) ((a) > (b) ? (a) : (b))
#define PREP_KS_BYTES PREP_MAX(CH * KPB * 2, CH * (PREP_UB + 4) * 4)
#define PREP_QT_BYTES PREP_MAX(CH * KPB * 2, CH * AP * 4)
#define PREP_AV_BYTES PREP_MAX(CH * AP * 4, CH * VPB * 2)
#define SNW ((DV / 16) % 4 == 0 ? 4 : 2)  // warps per gdn_chunk_state block
#define SBV (16 * SNW)                    // value columns per gdn_chunk_state block
#define OPB (SBV + 8)                     // bf16 row pitch of the o tile

// ---------------------------------------------------------------------------------------------
// Tensor-core helpers (mma_bf16, smem_addr, cp.async: prelude.cuh, with the fragment layouts).

// x0, x1 -> hi = bf16(x), lo = bf16(x - hi), both packed.
__device__ __forceinline__ void split2(float x0, float x1, u32& hi, u32& lo) {
    hi = pack_bf16(x0, x1);
    lo = pack_bf16(x0 - __uint_as_float(hi << 16), x1 - __uint_as_float(hi & 0xffff0000u));
}


// Two B fragments (n-tiles n0 and n0+8, k-tile k0) of a row-major [k][n] bf16 tile; `row0` points at
// element (k0, n0). r0,r1 = b0,b1 of n-tile n0; r2,r3 = b0,b1 of n-tile n0+8.
__device__ __forceinline__ void ldsm_b2_trans(u32 (&r)[4], const bf16_t* row0, int pitch, int lane) {
    ldsm_x4_t(smem_addr(row0 + (lane & 15) * pitch + (lane >> 4) * 8), r[0], r[1], r[2], r[3]);
}
// cp.async of 16 (or 4) bytes; zero-fills the destination when !valid (src is then not read).
__device__ __forceinline__ void cp16(void* dst, const void* src, bool valid) {
    cp_async16(smem_addr(dst), src, valid ? 16 : 0);
}
__device__ __forceinline__ void cp8(void* dst, const void* src, bool valid) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(valid ? 8 : 0)
                 : "memory");
}

// ---------------------------------------------------------------------------------------------
// Prep: per (chunk, value head).

// acc[N/8] (rows r0..r0+15 of T diag(scale) X, X = Xs [CH][PITCH] bf16 row-major), T lower triangular.
template <int N, int PITCH>
__device__ __forceinline__ void t_times(float (&acc)[N / 8][4], const float* Ts, const float* scale,
                                        const bf16_t* Xs, int r0, int kt_max, int lane, bool precise) {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int n = 0; n < N / 8; n++) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
#pragma unroll
    for (int kt = 0; kt < CH / 16; kt++) {
        if (kt > kt_max) break;  // T[i][j] = 0 for j > i
        const int j0 = 16 * kt + 2 * t;
        const float s0 = scale[j0], s1 = scale[j0 + 1], s8 = scale[j0 + 8], s9 = scale[j0 + 9];
        const float* ta = Ts + (r0 + g) * AP + j0;
        const float* tb = ta + 8 * AP;
        u32 ah[4], al[4];
        split2(ta[0] * s0, ta[1] * s1, ah[0], al[0]);
        split2(tb[0] * s0, tb[1] * s1, ah[1], al[1]);
        split2(ta[8] * s8, ta[9] * s9, ah[2], al[2]);
        split2(tb[8] * s8, tb[9] * s9, ah[3], al[3]);
#pragma unroll
        for (int np = 0; np < N / 16; np++) {
            u32 b[4];
            ldsm_b2_trans(b, Xs + 16 * kt * PITCH + 16 * np, PITCH, lane);
            mma_bf16(acc[2 * np], ah, b[0], b[1]);
            mma_bf16(acc[2 * np + 1], ah, b[2], b[3]);
            if (precise) {
                mma_bf16(acc[2 * np], al, b[0], b[1]);
                mma_bf16(acc[2 * np + 1], al, b[2], b[3]);
            }
        }
    }
}

// Prep's output staging (compile-time fragment indices, so acc stays in registers): rows r0..r0+15
// of w's hi or lo bf16 into Sw [CH][KPB]; columns P*UB .. P*UB + UB - 1 of u into Su [CH][UB + 4]
// f32, then out(P) stores them; passes P .. NP - 1.
template <bool LO>
__device__ __forceinline__ void stage_w(const float (&acc)[DK / 8][4], bf16_t* Sw, int r0, int gq, int t4) {
#pragma unroll
    for (int n = 0; n < DK / 8; n++) {
#pragma unroll
        for (int hh = 0; hh < 2; hh++) {
            u32 hi, lo;
            split2(acc[n][2 * hh], acc[n][2 * hh + 1], hi, lo);
            *(u32*)(Sw + (r0 + gq + 8 * hh) * KPB + 8 * n + 2 * t4) = LO ? lo : hi;
        }
    }
}
template <int P, int NP, int UB, typename Out>
__device__ __forceinline__ void u_passes(const float (&acc)[DV / 8][4], float* Su, int r0, int gq, int t4, Out out) {
#pragma unroll
    for (int n = P * UB / 8; n < (P + 1) * UB / 8; n++) {
#pragma unroll
        for (int hh = 0; hh < 2; hh++)
            *(float2*)(Su + (r0 + gq + 8 * hh) * (UB + 4) + 8 * n - P * UB + 2 * t4) =
                make_float2(acc[n][2 * hh], acc[n][2 * hh + 1]);
    }
    out(P);
    if constexpr (P + 1 < NP) u_passes<P + 1, NP, UB>(acc, Su, r0, gq, t4, out);
}

extern "C" __global__ void __launch_bounds__(128)
gdn_chunk_prep(const bf16_t* __restrict__ q, const bf16_t* __restrict__ k,
               const bf16_t* __restrict__ v, long long v_stride,
               const float* __restrict__ g, const float* __restrict__ beta,
               const int* __restrict__ cu_seqlens, const int* __restrict__ chunk_table,
               bf16_t* __restrict__ ws_wh, bf16_t* __restrict__ ws_wl, float* __restrict__ ws_u,
               bf16_t* __restrict__ ws_ph, bf16_t* __restrict__ ws_pl, float* __restrict__ ws_g,
               int T, int Hk, int Hv, int precise) {
    extern __shared__ uint4 smem_u4[];
    // Three regions, each holding two things in turn (52 KB at DK = DV = 128: 4 blocks per SM, not 3): Q is
    // dead once Q K^T is out, so T takes its place; A is dead once T is out, so V lands there (its copy starts
    // then and runs under w's product); K is dead once w's product is out, so w and u are staged there.
    unsigned char* base = (unsigned char*)smem_u4;
    bf16_t* Ks = (bf16_t*)base;                                   // [CH][KPB]
    bf16_t* Qs = (bf16_t*)(base + PREP_KS_BYTES);                 // [CH][KPB]
    float* Ts = (float*)Qs;                                       // [CH][AP]  T = (I + A)^-1, after Q's last read
    float* As = (float*)(base + PREP_KS_BYTES + PREP_QT_BYTES);   // [CH][AP]  A (strictly lower)
    bf16_t* Vs = (bf16_t*)As;                                     // [CH][VPB] V, after A's last read
    float* Gs = (float*)(base + PREP_KS_BYTES + PREP_QT_BYTES + PREP_AV_BYTES);  // [CH] cumsum of g (0 past the end)
    float* Bs = Gs + CH;                 // [CH] beta (0 past the chunk end)
    float* Ew = Bs + CH;                 // [CH] beta * exp(G)

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int gq = lane >> 2, t4 = lane & 3;
    const int hv = blockIdx.y, hk = hv / (Hv / Hk);
    const int s = chunk_table[2 * blockIdx.x], ci = chunk_table[2 * blockIdx.x + 1];
    const int t0 = cu_seqlens[s] + ci * CH;
    const int L = min(CH, cu_seqlens[s + 1] - t0);
    const long long wrow = (long long)hv * T + t0;  // this chunk's first row in the head-major workspace

    // K and Q in flight at once (cp.async, zero-filled past the chunk end); V once A is out of the way.
    for (int e = tid; e < CH * (DK / 8); e += blockDim.x) {
        const int i = e / (DK / 8), p = e % (DK / 8);
        const bool ok = i < L;
        const long long off = ((long long)(ok ? t0 + i : t0) * Hk + hk) * DK + 8 * p;
        cp16(Ks + i * KPB + 8 * p, k + off, ok);
        cp16(Qs + i * KPB + 8 * p, q + off, ok);
    }
    cp_async_commit();
    if (tid < CH) {
        Gs[tid] = tid < L ? g[(long long)(t0 + tid) * Hv + hv] : 0.0f;
        Bs[tid] = tid < L ? beta[(long long)(t0 + tid) * Hv + hv] : 0.0f;
    }
    cp_async_wait<0>();
    __syncthreads();
    if (warp == 0) {  // G = inclusive cumsum of g: two rows a lane, then a scan over the lanes
        const float a = Gs[2 * lane], b = Gs[2 * lane + 1];
        float x = a + b;
#pragma unroll
        for (int d = 1; d < 32; d *= 2) {
            const float y = __shfl_up_sync(0xffffffffu, x, d);
            if (lane >= d) x += y;
        }
        float before = __shfl_up_sync(0xffffffffu, x, 1);
        if (lane == 0) before = 0.0f;
        Gs[2 * lane] = before + a;
        Gs[2 * lane + 1] = x;
    }
    __syncthreads();
    if (tid < CH) {
        const float eg = expf(Gs[tid]);
        Ew[tid] = Bs[tid] * eg;
        if (tid < L)
            *(float2*)(ws_g + 2 * (wrow + tid)) = make_float2(eg, expf(Gs[L - 1] - Gs[tid]));
    }

    const int r0 = 16 * warp;  // this warp's chunk rows
    {
        // S = K K^T and QK = Q K^T for rows r0..r0+15, all 64 columns.
        float sa[CH / 8][4], sp[CH / 8][4];
#pragma unroll
        for (int n = 0; n < CH / 8; n++)
#pragma unroll
            for (int c = 0; c < 4; c++) sa[n][c] = sp[n][c] = 0.0f;
        // ldmatrix lane offsets: A fragments (rows r0.., r0+8.. x columns 16kt.., 16kt+8..) and B
        // fragments of two n-tiles (K rows 8n.., 8n+8.. x columns 16kt.., 16kt+8..).
        const int a_off = (r0 + (lane & 7) + ((lane >> 3) & 1) * 8) * KPB + (lane >> 4) * 8;
        const int b_off = ((lane >> 4) * 8 + (lane & 7)) * KPB + ((lane >> 3) & 1) * 8;
        const u32 ka = smem_addr(Ks + a_off), qa = smem_addr(Qs + a_off), kbl = smem_addr(Ks + b_off);
#pragma unroll
        for (int kt = 0; kt < DK / 16; kt++) {
            u32 ak[4], aq[4];
            ldsm_x4(ka + 32 * kt, ak[0], ak[1], ak[2], ak[3]);
            ldsm_x4(qa + 32 * kt, aq[0], aq[1], aq[2], aq[3]);
#pragma unroll
            for (int np = 0; np < CH / 16; np++) {
                u32 b[4];
                ldsm_x4(kbl + 2 * (16 * np * KPB + 16 * kt), b[0], b[1], b[2], b[3]);
                mma_bf16(sa[2 * np], ak, b[0], b[1]);
                mma_bf16(sp[2 * np], aq, b[0], b[1]);
                mma_bf16(sa[2 * np + 1], ak, b[2], b[3]);
                mma_bf16(sp[2 * np + 1], aq, b[2], b[3]);
            }
        }
        // Epilogue: A into shared memory, P (hi/lo bf16) into the workspace. Where this warp's own Q rows
        // (read by no other warp, dead now) hold its 16 rows of P hi and lo ([16][64] bf16 each, at DK >= 120),
        // P leaves through them, each row's 16-byte pieces swizzled by the row (conflict-free fragment
        // stores), then as whole rows; else straight from the fragments.
        constexpr bool stage_p = KPB >= 2 * CH;
        __syncwarp();
        char* stage = (char*)(Qs + r0 * KPB);
#pragma unroll
        for (int n = 0; n < CH / 8; n++) {
#pragma unroll
            for (int hh = 0; hh < 2; hh++) {
                const int i = r0 + gq + 8 * hh;
                float pv[2];
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    const int j = 8 * n + 2 * t4 + e;
                    const float dec = j <= i ? expf(Gs[i] - Gs[j]) : 0.0f;
                    As[i * AP + j] = j < i ? Bs[i] * dec * sa[n][2 * hh + e] : 0.0f;
                    pv[e] = dec * sp[n][2 * hh + e];
                }
                u32 hi, lo;
                split2(pv[0], pv[1], hi, lo);
                if (stage_p) {
                    const int at = (gq + 8 * hh) * (2 * CH) + ((n ^ gq) << 4) + 4 * t4;
                    *(u32*)(stage + at) = hi;
                    *(u32*)(stage + 32 * CH + at) = lo;
                } else if (i < L) {
                    const long long off = (wrow + i) * CH + 8 * n + 2 * t4;
                    *(u32*)(ws_ph + off) = hi;
                    *(u32*)(ws_pl + off) = lo;
                }
            }
        }
        if (stage_p) {
            __syncwarp();
#pragma unroll
            for (int e = lane; e < 16 * (CH / 8); e += 32) {
                const int row = e / (CH / 8), p = e % (CH / 8);
                if (r0 + row < L) {
                    const int at = row * (2 * CH) + ((p ^ (row & 7)) << 4);
                    const long long off = (wrow + r0 + row) * CH + 8 * p;
                    *(uint4*)(ws_ph + off) = *(const uint4*)(stage + at);
                    *(uint4*)(ws_pl + off) = *(const uint4*)(stage + 32 * CH + at);
                }
            }
        }
    }
    __syncthreads();

    // T = (I + A)^-1 in 16 x 16 blocks (A strictly lower triangular, so T is unit lower triangular).
    // Diagonal blocks by forward substitution, one (block, column) per thread: T_bb[i][c] = [i == c] -
    // sum_{j<i} A_bb[i][j] T_bb[j][c]. Then block rows b = 1..3 in turn, all their blocks at once:
    // M_j = sum_{k=j}^{b-1} A_bk T_kj, T_bj = -T_bb M_j, with M_j in the upper block (0, j + 1) of Ts
    // (never read by the products below, which take only T's lower blocks).
    if (tid < CH) {
        const int b0 = 16 * (tid >> 4), c = tid & 15;
        float hist[16];
#pragma unroll
        for (int i = 0; i < 16; i++) {
            const float* ar = As + (b0 + i) * AP + b0;
            float x = i == c ? 1.0f : 0.0f;
#pragma unroll
            for (int jj = 0; jj < i; jj++) x -= ar[jj] * hist[jj];
            hist[i] = x;
            Ts[(b0 + i) * AP + b0 + c] = x;
        }
    }
    __syncthreads();
    for (int b = 1; b < CH / 16; b++) {
        for (int e = tid; e < b * 256; e += blockDim.x) {
            const int jb = e >> 8, r = (e >> 4) & 15, cc = e & 15;
            float m = 0.0f;
            for (int kb = jb; kb < b; kb++) {
                const float* ar = As + (16 * b + r) * AP + 16 * kb;
                const float* tc = Ts + (16 * kb) * AP + 16 * jb + cc;
#pragma unroll
                for (int q = 0; q < 16; q++) m += ar[q] * tc[q * AP];
            }
            Ts[r * AP + 16 * (jb + 1) + cc] = m;
        }
        __syncthreads();
        for (int e = tid; e < b * 256; e += blockDim.x) {
            const int jb = e >> 8, r = (e >> 4) & 15, cc = e & 15;
            const float* tr = Ts + (16 * b + r) * AP + 16 * b;
            const float* mc = Ts + 16 * (jb + 1) + cc;
            float x = 0.0f;
#pragma unroll
            for (int q = 0; q < 16; q++) x -= (q <= r ? tr[q] : 0.0f) * mc[q * AP];
            Ts[(16 * b + r) * AP + 16 * jb + cc] = x;
        }
        __syncthreads();
    }

    // V into A's place, under w's product.
    for (int e = tid; e < CH * (DV / 8); e += blockDim.x) {
        const int i = e / (DV / 8), p = e % (DV / 8);
        const bool ok = i < L;
        cp16(Vs + i * VPB + 8 * p, v + (long long)(ok ? t0 + i : t0) * v_stride + (long long)hv * DV + 8 * p, ok);
    }
    cp_async_commit();

    // w = T diag(beta exp(G)) K -> hi/lo bf16;  u = T diag(beta) V -> f32. Rows r0..r0+15.
    // The results leave through K's shared memory (dead once w's product is out) as 16-byte row stores,
    // 16 KB per pass: written straight from the mma fragments, every store instruction filled half
    // sectors of 8 rows and the stores took ~45% of the kernel.
    bf16_t* Sw = Ks;           // [CH][KPB] bf16
    float* Su = (float*)Ks;    // [CH][UB + 4] f32, UB value columns per pass
    constexpr int UB = PREP_UB;
    auto rows_out = [&](const uint4* src, int pitch_u4, void* dst, int row_stride_bytes, int pieces) {
        __syncthreads();  // the staged tile is complete
        for (int e = tid; e < CH * pieces; e += blockDim.x) {
            const int i = e / pieces, p = e % pieces;
            if (i < L) *(uint4*)((char*)dst + i * row_stride_bytes + 16 * p) = src[i * pitch_u4 + p];
        }
        __syncthreads();  // the staging buffer is free again
    };
    {
        float acc[DK / 8][4];
        t_times<DK, KPB>(acc, Ts, Ew, Ks, r0, warp, lane, precise != 0);
        __syncthreads();  // every warp's last read of K
        stage_w<false>(acc, Sw, r0, gq, t4);
        rows_out((const uint4*)Sw, KPB / 8, ws_wh + wrow * DK, 2 * DK, DK / 8);
        stage_w<true>(acc, Sw, r0, gq, t4);
        rows_out((const uint4*)Sw, KPB / 8, ws_wl + wrow * DK, 2 * DK, DK / 8);
    }
    cp_async_wait<0>();
    __syncthreads();  // V is in
    {
        float acc[DV / 8][4];
        t_times<DV, VPB>(acc, Ts, Bs, Vs, r0, warp, lane, precise != 0);
        u_passes<0, DV / UB, UB>(acc, Su, r0, gq, t4, [&](int part) {
            rows_out((const uint4*)Su, (UB + 4) / 4, ws_u + wrow * DV + part * UB, 4 * DV, UB / 4);
        });
    }
}

// ---------------------------------------------------------------------------------------------
// Walk pieces shared by gdn_chunk_state (below) and gdn_chunk_state_ws (gdn_chunk_ws.cu). Accumulator
// tiles [n][4] hold (row g(+8), columns 8n + 2t (+1)) of a 16-row product.

// The P hi and lo tiles [CH][PPB] of a chunk of L rows (cp.async): this thread's 16-byte piece of rows pi,
// pi + RPP, ... from phb / plb (that piece of row pi; rows CH apart), rows at or past L zero-filled (from row 0:
// a valid address, not read).
template <int RPP>
__device__ __forceinline__ void cp_p_tiles(u32 ph_d, u32 pl_d, const bf16_t* phb, const bf16_t* plb, int L, int pi) {
    const bf16_t *ph_z = phb - pi * CH, *pl_z = plb - pi * CH;
#pragma unroll
    for (int m = 0; m < CH / RPP; m++) {
        const bool ok = L == CH || pi + m * RPP < L;
        cp_async16(ph_d + 2 * m * RPP * PPB, ok ? phb + m * RPP * CH : ph_z, ok ? 16 : 0);
        cp_async16(pl_d + 2 * m * RPP * PPB, ok ? plb + m * RPP * CH : pl_z, ok ? 16 : 0);
    }
}
// a *= -(E[column].x), or .y with Y.
template <bool Y>
__device__ __forceinline__ void scale_cols_neg(float (&a)[CH / 8][4], const float2* E, int t4) {
#pragma unroll
    for (int n = 0; n < CH / 8; n++) {
        const int j = 8 * n + 2 * t4;
        const float d0 = -(Y ? E[j].y : E[j].x), d1 = -(Y ? E[j + 1].y : E[j + 1].x);
        a[n][0] *= d0;
        a[n][1] *= d1;
        a[n][2] *= d0;
        a[n][3] *= d1;
    }
}
// The CH columns of `a` as A fragments (k = column), split into hi and lo bf16.
__device__ __forceinline__ void split_frags(const float (&a)[CH / 8][4], u32 (&hi)[CH / 16][4], u32 (&lo)[CH / 16][4]) {
#pragma unroll
    for (int kt = 0; kt < CH / 16; kt++) {
        split2(a[2 * kt][0], a[2 * kt][1], hi[kt][0], lo[kt][0]);
        split2(a[2 * kt][2], a[2 * kt][3], hi[kt][1], lo[kt][1]);
        split2(a[2 * kt + 1][0], a[2 * kt + 1][1], hi[kt][2], lo[kt][2]);
        split2(a[2 * kt + 1][2], a[2 * kt + 1][3], hi[kt][3], lo[kt][3]);
    }
}
// -h^T's k-tile kt (d = 16kt..16kt+15) as A fragments, hi and lo.
__device__ __forceinline__ void split_h(const float (&h)[DK / 8][4], int kt, u32 (&hi)[4], u32 (&lo)[4]) {
    split2(h[2 * kt][0], h[2 * kt][1], hi[0], lo[0]);
    split2(h[2 * kt][2], h[2 * kt][3], hi[1], lo[1]);
    split2(h[2 * kt + 1][0], h[2 * kt + 1][1], hi[2], lo[2]);
    split2(h[2 * kt + 1][2], h[2 * kt + 1][3], hi[3], lo[3]);
}
// -h^T tiles of value columns vw.. from a state slot: h[n] covers (v = vw+g(+8), d = 8n+2t(+1)); element
// (v, d) = -state[d][v]. store_neg_h writes them back.
__device__ __forceinline__ void load_neg_h(float (&h)[DK / 8][4], const state_t* st, int vw, int gq, int t4) {
#pragma unroll
    for (int n = 0; n < DK / 8; n++) {
        const state_t* sp = st + (long long)(8 * n + 2 * t4) * DV + vw + gq;
        h[n][0] = -state_ld(sp);
        h[n][1] = -state_ld(sp + DV);
        h[n][2] = -state_ld(sp + 8);
        h[n][3] = -state_ld(sp + DV + 8);
    }
}
__device__ __forceinline__ void store_neg_h(const float (&h)[DK / 8][4], state_t* st, int vw, int gq, int t4) {
#pragma unroll
    for (int n = 0; n < DK / 8; n++) {
        state_t* sp = st + (long long)(8 * n + 2 * t4) * DV + vw + gq;
        state_st(sp, -h[n][0]);
        state_st(sp + DV, -h[n][1]);
        state_st(sp + 8, -h[n][2]);
        state_st(sp + DV + 8, -h[n][3]);
    }
}
// u^T tile of a chunk of L rows in accumulator layout (row v = vw+g(+8), column i = 8n+2t(+1)), 0 past L;
// `ub` points at (row 2t, column vw + g): rows 8n + 2t + e sit at constant offsets from it.
__device__ __forceinline__ void load_u_tile(float (&un)[CH / 8][4], const float* ub, int L, int t4) {
    if (L == CH) {
#pragma unroll
        for (int n = 0; n < CH / 8; n++) {
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const float* up = ub + (8 * n + e) * DV;
                un[n][e] = up[0];
                un[n][2 + e] = up[8];
            }
        }
    } else {
#pragma unroll
        for (int n = 0; n < CH / 8; n++) {
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const int i = 8 * n + 2 * t4 + e;
                const float* up = ub + (8 * n + e) * DV;
                un[n][e] = i < L ? up[0] : 0.0f;
                un[n][2 + e] = i < L ? up[8] : 0.0f;
            }
        }
    }
}
// o^T += vn^T P^T, vn^T as A fragments (hi, lo); P lower triangular, rows 8n.. and 8n+8.. (n even) sharing
// their nonzero k-tiles kt <= n / 2; ph_l / pl_l: the ldmatrix lane addresses of P's hi / lo tiles.
template <bool PRECISE>
__device__ __forceinline__ void add_vn_p(float (&oq)[CH / 8][4], const u32 (&vh)[CH / 16][4],
                                         const u32 (&vl)[CH / 16][4], u32 ph_l, u32 pl_l) {
#pragma unroll
    for (int np = 0; np < CH / 16; np++) {
#pragma unroll
        for (int kt = 0; kt <= np; kt++) {
            const u32 off = 2 * (16 * np * PPB + 16 * kt);
            u32 b[4];
            ldsm_x4(ph_l + off, b[0], b[1], b[2], b[3]);
            mma_bf16(oq[2 * np], vh[kt], b[0], b[1]);
            mma_bf16(oq[2 * np + 1], vh[kt], b[2], b[3]);
            if (PRECISE) {
                u32 cl[4];
                ldsm_x4(pl_l + off, cl[0], cl[1], cl[2], cl[3]);
                mma_bf16(oq[2 * np], vl[kt], b[0], b[1]);
                mma_bf16(oq[2 * np + 1], vl[kt], b[2], b[3]);
                mma_bf16(oq[2 * np], vh[kt], cl[0], cl[1]);
                mma_bf16(oq[2 * np + 1], vh[kt], cl[2], cl[3]);
            }
        }
    }
}
// The o^T tile into Os [CH][OPB] at column `col` (this warp's 16), as bf16.
__device__ __forceinline__ void stage_o(const float (&oq)[CH / 8][4], bf16_t* Os, int col, int gq, int t4) {
#pragma unroll
    for (int n = 0; n < CH / 8; n++) {
#pragma unroll
        for (int e = 0; e < 2; e++) {
            bf16_t* os = Os + (8 * n + 2 * t4 + e) * OPB + col + gq;
            os[0] = f2bf(oq[n][e]);
            os[8] = f2bf(oq[n][2 + e]);
        }
    }
}
// h^T = eg h^T + (Dl * vn)^T K on -h^T with -(Dl * vn)^T as A fragments (hi, lo); k_t: K's ldmatrix.trans
// lane address.
template <bool PRECISE>
__device__ __forceinline__ void update_h(float (&h)[DK / 8][4], const u32 (&vh)[CH / 16][4],
                                         const u32 (&vl)[CH / 16][4], u32 k_t, float eg) {
#pragma unroll
    for (int n = 0; n < DK / 8; n++)
#pragma unroll
        for (int e = 0; e < 4; e++) h[n][e] *= eg;
#pragma unroll
    for (int kt = 0; kt < CH / 16; kt++) {
#pragma unroll
        for (int np = 0; np < DK / 16; np++) {
            u32 b[4];
            ldsm_x4_t(k_t + 2 * (16 * kt * KPB + 16 * np), b[0], b[1], b[2], b[3]);
            mma_bf16(h[2 * np], vh[kt], b[0], b[1]);
            mma_bf16(h[2 * np + 1], vh[kt], b[2], b[3]);
            if (PRECISE) {
                mma_bf16(h[2 * np], vl[kt], b[0], b[1]);
                mma_bf16(h[2 * np + 1], vl[kt], b[2], b[3]);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// State walk: per (sequence, value head, SBV value columns); warp w owns columns vw..vw+15.
// PRECISE: the hi/lo operands (gdn_chunk_state); else plain bf16 (gdn_chunk_state_bf16, tests and
// benches only). A template, not a runtime flag, so that each kernel's loop has only its own code.

template <bool PRECISE>
__device__ __forceinline__ void state_walk(const bf16_t* __restrict__ q, const bf16_t* __restrict__ k,
                                           const bf16_t* __restrict__ ws_wh, const bf16_t* __restrict__ ws_wl,
                                           const float* __restrict__ ws_u, const bf16_t* __restrict__ ws_ph,
                                           const bf16_t* __restrict__ ws_pl, const float* __restrict__ ws_g,
                                           state_t* __restrict__ state, bf16_t* __restrict__ o,
                                           const int* __restrict__ cu_seqlens, const int* __restrict__ slots,
                                           int T, int Hk, int Hv) {
    extern __shared__ uint4 smem_u4[];
    bf16_t* Wh = (bf16_t*)smem_u4;  // [CH][KPB] w hi     (group A)
    bf16_t* Wl = Wh + CH * KPB;     // [CH][KPB] w lo     (group A)
    bf16_t* Qs = Wl + CH * KPB;     // [CH][KPB] q        (group A)
    bf16_t* Ks = Qs + CH * KPB;     // [CH][KPB] k        (group C)
    bf16_t* Ph = Ks + CH * KPB;     // [CH][PPB] P hi     (group B)
    bf16_t* Pl = Ph + CH * PPB;     // [CH][PPB] P lo     (group B)
    float2* Es = (float2*)(Pl + CH * PPB);  // [2][CH] (exp(G_i), exp(G_last - G_i)), double-buffered (group A)
    bf16_t* Os = (bf16_t*)(Es + 2 * CH);    // [CH][OPB] the chunk's o, this block's SBV columns

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int gq = lane >> 2, t4 = lane & 3;
    const int s = blockIdx.x, hv = blockIdx.y, hk = hv / (Hv / Hk);
    const int vw = blockIdx.z * SBV + warp * 16;
    const int start = cu_seqlens[s], len = cu_seqlens[s + 1] - start;
    if (len <= 0 || slots[s] < 0) return;  // uniform over the block (slot < 0: a segment another launch walks)
    const int nch = (len + CH - 1) / CH;
    state_t* st = state + ((long long)slots[s] * Hv + hv) * DK * DV;
    // Row of (this head, the sequence's first token) in the head-major workspace parts: a chunk's
    // w, P, u, decay rows are contiguous there, so every offset inside a tile is a constant.
    const long long wrow = (long long)hv * T + start;

    // Loaders (every thread commits one group per call, empty past the last chunk). A thread copies
    // the same 16-byte piece of rows li, li + RP, ... of every tile: from one per-chunk base, at
    // compile-time offsets (workspace tiles) or multiples of the q/k row step. Full chunks copy
    // unconditionally; only a sequence's last, partial chunk zero-fills the rows past its end.
    auto chunk_len = [&](int c) { return min(CH, len - c * CH); };
    constexpr int KP = DK / 8, RP = SNW * 32 / KP;      // K/Q/w tiles: pieces per row, rows per pass
    constexpr int PP = CH / 8, RPP = SNW * 32 / PP;     // P tiles
    static_assert(SNW * 32 % KP == 0 && SNW * 32 % PP == 0, "a thread keeps one piece column");
    const int li = tid / KP, lp = tid % KP, pi = tid / PP, pp = tid % PP;
    const int qstep = RP * Hk * DK;  // q/k elements between a thread's rows
    const bf16_t* wh0 = ws_wh + wrow * DK + li * DK + 8 * lp;
    const bf16_t* wl0 = ws_wl + wrow * DK + li * DK + 8 * lp;
    const long long qrow0 = ((long long)start * Hk + hk) * DK + (long long)li * Hk * DK + 8 * lp;
    const bf16_t* q0 = q + qrow0;
    const bf16_t* k0 = k + qrow0;
    const bf16_t* ph0 = ws_ph + wrow * CH + pi * CH + 8 * pp;
    const bf16_t* pl0 = ws_pl + wrow * CH + pi * CH + 8 * pp;
    const u32 wh_d = smem_addr(Wh + li * KPB + 8 * lp), wl_d = smem_addr(Wl + li * KPB + 8 * lp);
    const u32 q_d = smem_addr(Qs + li * KPB + 8 * lp), k_d = smem_addr(Ks + li * KPB + 8 * lp);
    const u32 ph_d = smem_addr(Ph + pi * PPB + 8 * pp), pl_d = smem_addr(Pl + pi * PPB + 8 * pp);
    auto load_a = [&](int c) {
        if (c < nch) {
            const int L = chunk_len(c);
            const bf16_t *whb = wh0 + (long long)c * CH * DK, *wlb = wl0 + (long long)c * CH * DK;
            const bf16_t* qb = q0 + (long long)c * CH * Hk * DK;
            if (L == CH) {
#pragma unroll
                for (int m = 0; m < CH / RP; m++) {
                    cp_async16(wh_d + 2 * m * RP * KPB, whb + m * RP * DK);
                    cp_async16(wl_d + 2 * m * RP * KPB, wlb + m * RP * DK);
                    cp_async16(q_d + 2 * m * RP * KPB, qb + m * qstep);
                }
            } else {
                // Rows past the end are zero-filled from the chunk's row 0 (a valid address, not read).
                const bf16_t *wh_z = whb - li * DK, *wl_z = wlb - li * DK, *q_z = qb - li * Hk * DK;
#pragma unroll
                for (int m = 0; m < CH / RP; m++) {
                    const bool ok = li + m * RP < L;
                    cp_async16(wh_d + 2 * m * RP * KPB, ok ? whb + m * RP * DK : wh_z, ok ? 16 : 0);
                    cp_async16(wl_d + 2 * m * RP * KPB, ok ? wlb + m * RP * DK : wl_z, ok ? 16 : 0);
                    cp_async16(q_d + 2 * m * RP * KPB, ok ? qb + m * qstep : q_z, ok ? 16 : 0);
                }
            }
            if (tid < CH) {  // zero past the chunk end: exp(G_last - G_j) = 0 there
                const bool ok = tid < L;
                cp8(Es + (c & 1) * CH + tid, ws_g + 2 * (wrow + c * CH + (ok ? tid : 0)), ok);
            }
        }
        cp_async_commit();
    };
    auto load_b = [&](int c) {
        if (c < nch) cp_p_tiles<RPP>(ph_d, pl_d, ph0 + (long long)c * CH * CH, pl0 + (long long)c * CH * CH, chunk_len(c), pi);
        cp_async_commit();
    };
    auto load_c = [&](int c) {
        if (c < nch) {
            const int L = chunk_len(c);
            const bf16_t* kb = k0 + (long long)c * CH * Hk * DK;
            if (L == CH) {
#pragma unroll
                for (int m = 0; m < CH / RP; m++) cp_async16(k_d + 2 * m * RP * KPB, kb + m * qstep);
            } else {
                const bf16_t* k_z = kb - li * Hk * DK;  // row 0 (zero-fill source)
#pragma unroll
                for (int m = 0; m < CH / RP; m++) {
                    const bool ok = li + m * RP < L;
                    cp_async16(k_d + 2 * m * RP * KPB, ok ? kb + m * qstep : k_z, ok ? 16 : 0);
                }
            }
        }
        cp_async_commit();
    };
    // u^T tile of chunk c in accumulator layout: (row v = vw+g(+8), col i = 8n+2t(+1)); 0 past L.
    // Rows 8n + 2t + e of the chunk sit at constant offsets from one per-chunk pointer.
    float un[CH / 8][4];
    const float* u0 = ws_u + (wrow + 2 * t4) * DV + vw + gq;
    auto load_u = [&](int c) { load_u_tile(un, u0 + (long long)c * CH * DV, c < nch ? chunk_len(c) : 0, t4); };

    // ldmatrix lane addresses (bytes): B fragments of two n-tiles (rows 8n.., 8n+8..) x one k-tile
    // (columns 16kt.., 16kt+8..) of a row-major [n][k] tile; + constant tile offsets below.
    const int b_row = (lane >> 4) * 8 + (lane & 7), b_col = ((lane >> 3) & 1) * 8;
    const u32 wh_l = smem_addr(Wh) + 2 * (b_row * KPB + b_col), wl_l = smem_addr(Wl) + 2 * (b_row * KPB + b_col);
    const u32 q_l = smem_addr(Qs) + 2 * (b_row * KPB + b_col);
    const u32 ph_l = smem_addr(Ph) + 2 * (b_row * PPB + b_col), pl_l = smem_addr(Pl) + 2 * (b_row * PPB + b_col);
    const u32 k_t = smem_addr(Ks + (lane & 15) * KPB + (lane >> 4) * 8);  // ldmatrix.trans rows

    // -h^T tiles (negated: the products below need -h, and negating the decays instead is free).
    float h[DK / 8][4];
    load_neg_h(h, st, vw, gq, t4);
    load_a(0);
    load_b(0);
    load_c(0);
    load_u(0);

    for (int c = 0; c < nch; c++) {
        const int t0 = start + c * CH, L = chunk_len(c);
        cp_async_wait<2>();
        __syncthreads();  // group A(c): w, q, G

        // Phase 1: acc = u^T - h^T w^T (= vn^T), oq = -h^T q^T.
        float acc[CH / 8][4], oq[CH / 8][4];
#pragma unroll
        for (int n = 0; n < CH / 8; n++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                acc[n][e] = un[n][e];
                oq[n][e] = 0.0f;
            }
#pragma unroll
        for (int kt = 0; kt < DK / 16; kt++) {
            u32 ah[4], al[4];  // -h^T, k-tile kt (d = 16kt..16kt+15)
            split_h(h, kt, ah, al);
#pragma unroll
            for (int np = 0; np < CH / 16; np++) {
                const u32 off = 2 * (16 * np * KPB + 16 * kt);
                u32 b[4], qb[4];
                ldsm_x4(wh_l + off, b[0], b[1], b[2], b[3]);
                ldsm_x4(q_l + off, qb[0], qb[1], qb[2], qb[3]);
                mma_bf16(acc[2 * np], ah, b[0], b[1]);
                mma_bf16(acc[2 * np + 1], ah, b[2], b[3]);
                mma_bf16(oq[2 * np], ah, qb[0], qb[1]);
                mma_bf16(oq[2 * np + 1], ah, qb[2], qb[3]);
                if (PRECISE) {
                    u32 cl[4];
                    ldsm_x4(wl_l + off, cl[0], cl[1], cl[2], cl[3]);
                    mma_bf16(acc[2 * np], al, b[0], b[1]);
                    mma_bf16(acc[2 * np + 1], al, b[2], b[3]);
                    mma_bf16(acc[2 * np], ah, cl[0], cl[1]);
                    mma_bf16(acc[2 * np + 1], ah, cl[2], cl[3]);
                    mma_bf16(oq[2 * np], al, qb[0], qb[1]);
                    mma_bf16(oq[2 * np + 1], al, qb[2], qb[3]);
                }
            }
        }
        __syncthreads();  // w, q buffers free
        load_a(c + 1);
        cp_async_wait<2>();
        __syncthreads();  // group B(c): P

        // Phase 2: o^T = exp(G_i) h^T q^T + vn^T P^T  (oq holds -h^T q^T).
        const float2* E = Es + (c & 1) * CH;
        scale_cols_neg<false>(oq, E, t4);
        u32 vh[CH / 16][4], vl[CH / 16][4];  // vn^T as A fragments (k = chunk row j)
        split_frags(acc, vh, vl);
        add_vn_p<PRECISE>(oq, vh, vl, ph_l, pl_l);
        stage_o(oq, Os, warp * 16, gq, t4);  // o through shared memory (stored below with 16-byte writes)
        // -(Dl * vn)^T with Dl_j = exp(G_last - G_j), 0 past the chunk end.
        scale_cols_neg<true>(acc, E, t4);
        split_frags(acc, vh, vl);
        __syncthreads();  // P buffers free, o tile complete
        load_b(c + 1);
        for (int e = tid; e < CH * (SBV / 8); e += SNW * 32) {
            const int i = e / (SBV / 8), p = e % (SBV / 8);
            if (i < L)
                *(uint4*)(o + ((long long)(t0 + i) * Hv + hv) * DV + blockIdx.z * SBV + 8 * p) =
                    *(const uint4*)(Os + i * OPB + 8 * p);
        }
        cp_async_wait<2>();
        __syncthreads();  // group C(c): K
        load_u(c + 1);    // next chunk's u, in flight during the state update

        // Phase 3: h^T = exp(G_last) h^T + (Dl * vn)^T K  (on -h^T, with -(Dl * vn)^T).
        update_h<PRECISE>(h, vh, vl, k_t, E[L - 1].x);
        __syncthreads();  // K buffer free
        load_c(c + 1);
    }
    store_neg_h(h, st, vw, gq, t4);
}

#define GDN_STATE_ARGS                                                                                          \
    const bf16_t *__restrict__ q, const bf16_t *__restrict__ k, const bf16_t *__restrict__ ws_wh,             \
        const bf16_t *__restrict__ ws_wl, const float *__restrict__ ws_u, const bf16_t *__restrict__ ws_ph,  \
        const bf16_t *__restrict__ ws_pl, const float *__restrict__ ws_g, state_t *__restrict__ state,       \
        bf16_t *__restrict__ o, const int *__restrict__ cu_seqlens, const int *__restrict__ slots, int T, int Hk, \
        int Hv
extern "C" __global__ void __launch_bounds__(SNW * 32) gdn_chunk_state(GDN_STATE_ARGS) {
    state_walk<true>(q, k, ws_wh, ws_wl, ws_u, ws_ph, ws_pl, ws_g, state, o, cu_seqlens, slots, T, Hk, Hv);
}
extern "C" __global__ void __launch_bounds__(SNW * 32) gdn_chunk_state_bf16(GDN_STATE_ARGS) {
    state_walk<false>(q, k, ws_wh, ws_wl, ws_u, ws_ph, ws_pl, ws_g, state, o, cu_seqlens, slots, T, Hk, Hv);
}
