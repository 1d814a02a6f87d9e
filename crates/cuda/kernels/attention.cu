// attention.cu — causal GQA softmax attention over the paged KV cache (online softmax).
//
// Computes, per sequence s, query token i (absolute position past_s + i, past_s = seq_lens[s] -
// q_len_s) and query head h (kv head h / GQA_GROUP):
//   o[i, h] = sum_{p <= past_s + i} softmax_p(scale * q[i,h] . K[p]) V[p]
// where key p lives at cache row block_tables[s, p / page] * page + p % page.
//  attn_prefill:        varlen queries (cu_seqlens), tiles of 16 queries x 32 keys; no scratch.
//  attn_decode_split:   one query per sequence; keys split into n_split equal ranges, each block
//                       handles all GQA_GROUP query heads of one kv head (K/V read once), writes
//                       unnormalised partials (o, max, sum) in f32.
//  attn_decode_combine: merges the n_split partials (log-sum-exp) into bf16 o.
// Shapes/dtypes: q [T, Hq, HD] bf16 (head h of token t at q + t*q_tok + h*q_head: contiguous is
//   q_tok = Hq*HD, q_head = HD; the attention q|gate projection output is q_tok = 2*Hq*HD, q_head = 2*HD); k_cache, v_cache [num_blocks * page, Hkv * HD] bf16;
//   block_tables [B, max_blocks] i32; seq_lens [B] i32 (kv length including the new tokens);
//   cu_seqlens [B+1] i32; tile_table [n_tiles, 2] i32 = (seq, 16-query tile index) from the host;
//   o [T, Hq, HD] bf16; part_o [B, Hq, n_split, HD] f32; part_ml [B, Hq, n_split, 2] f32.
// Launch: attn_prefill grid (n_tiles, Hq), block 128, dynamic smem (16+64)*(HD+1)*4 + 2 KB
//   (~82 KB at HD 256); attn_decode_split grid (B, Hkv, n_split), block 256 (8 warps, one key per
//   warp at a time, 16-byte loads); attn_decode_combine grid (B, Hq), block HD.
//   -D HD (head dim, multiple of 32, <= 256), GQA_GROUP (Hq / Hkv).
// Arch: f32 FFMA + shuffles + shared atomics only, sm_80+ (no tensor cores yet).
// Tested by: tests/ops.rs cases "kv_write+attn_prefill" and "attn_decode" against
//   deltaserve_cpu::attention::causal_gqa_attention.

#ifndef HD
#define HD 256
#endif
#ifndef GQA_GROUP
#define GQA_GROUP 6
#endif
#define BQ 16
#define BK 32
#define HP (HD + 1)
#define NEG_INF (-__int_as_float(0x7f800000))

extern "C" __global__ void __launch_bounds__(128)
attn_prefill(const bf16_t* __restrict__ q, const bf16_t* __restrict__ k_cache,
             const bf16_t* __restrict__ v_cache, const int* __restrict__ block_tables, int max_blocks,
             const int* __restrict__ cu_seqlens, const int* __restrict__ seq_lens,
             const int* __restrict__ tile_table, bf16_t* __restrict__ o, int Hq, int Hkv, int page,
             float scale, long long q_tok, long long q_head) {
    extern __shared__ float smem[];
    float* Qs = smem;              // [BQ][HP]
    float* Ks = Qs + BQ * HP;      // [BK][HP]
    float* Vs = Ks + BK * HP;      // [BK][HP]
    float* Ps = Vs + BK * HP;      // [BQ][BK]

    const int tid = threadIdx.x;
    const int s = tile_table[2 * blockIdx.x], qt = tile_table[2 * blockIdx.x + 1];
    const int h = blockIdx.y, hkv = h / GQA_GROUP;
    const int qstart = cu_seqlens[s], qlen = cu_seqlens[s + 1] - qstart;
    const int past = seq_lens[s] - qlen;
    const int i0 = qt * BQ;
    const int nq = min(BQ, qlen - i0);
    const int kend = past + i0 + nq;  // keys [0, kend) are visible to some query of the tile
    const long long width = (long long)Hkv * HD;
    const int* bt = block_tables + (long long)s * max_blocks;

    for (int e = tid; e < BQ * HD; e += blockDim.x) {
        int r = e / HD, d = e % HD;
        Qs[r * HP + d] = r < nq ? bf2f(q[(long long)(qstart + i0 + r) * q_tok + (long long)h * q_head + d]) * scale : 0.0f;
    }
    const int qi = tid >> 3, sub = tid & 7;  // score role: key sub + 8m; output role: dims sub + 8j
    const int qpos = past + i0 + qi;         // absolute position of this thread's query row
    float m = NEG_INF, l = 0.0f;
    float acc[HD / 8];
#pragma unroll
    for (int j = 0; j < HD / 8; j++) acc[j] = 0.0f;

    for (int kb = 0; kb < kend; kb += BK) {
        __syncthreads();
        for (int e = tid; e < BK * HD; e += blockDim.x) {
            int r = e / HD, d = e % HD;
            int p = kb + r;
            float kv = 0.0f, vv = 0.0f;
            if (p < kend) {
                long long row = (long long)bt[p / page] * page + p % page;
                kv = bf2f(k_cache[row * width + (long long)hkv * HD + d]);
                vv = bf2f(v_cache[row * width + (long long)hkv * HD + d]);
            }
            Ks[r * HP + d] = kv;
            Vs[r * HP + d] = vv;
        }
        __syncthreads();
        float sc[BK / 8];
        float mt = NEG_INF;
#pragma unroll
        for (int mm = 0; mm < BK / 8; mm++) {
            int key = sub + 8 * mm;
            float dot = 0.0f;
#pragma unroll 8
            for (int d = 0; d < HD; d++) dot += Qs[qi * HP + d] * Ks[key * HP + d];
            bool vis = qi < nq && kb + key <= qpos;
            sc[mm] = vis ? dot : NEG_INF;
            mt = fmaxf(mt, sc[mm]);
        }
        mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, 1));
        mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, 2));
        mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, 4));
        float mnew = fmaxf(m, mt);
        float alpha = mnew == NEG_INF ? 1.0f : expf(m - mnew);
        float ps = 0.0f;
#pragma unroll
        for (int mm = 0; mm < BK / 8; mm++) {
            float p = mnew == NEG_INF ? 0.0f : expf(sc[mm] - mnew);
            Ps[qi * BK + sub + 8 * mm] = p;
            ps += p;
        }
        ps += __shfl_xor_sync(0xffffffffu, ps, 1);
        ps += __shfl_xor_sync(0xffffffffu, ps, 2);
        ps += __shfl_xor_sync(0xffffffffu, ps, 4);
        l = l * alpha + ps;
        m = mnew;
        __syncthreads();
#pragma unroll
        for (int j = 0; j < HD / 8; j++) acc[j] *= alpha;
        for (int key = 0; key < BK; key++) {
            float p = Ps[qi * BK + key];
#pragma unroll
            for (int j = 0; j < HD / 8; j++) acc[j] += p * Vs[key * HP + sub + 8 * j];
        }
    }
    if (qi < nq) {
        float inv = 1.0f / l;
        bf16_t* dst = o + ((long long)(qstart + i0 + qi) * Hq + h) * HD;
#pragma unroll
        for (int j = 0; j < HD / 8; j++) dst[sub + 8 * j] = f2bf(acc[j] * inv);
    }
}

#define DPL (HD / 32)  // dims per lane in decode

extern "C" __global__ void __launch_bounds__(256)
attn_decode_split(const bf16_t* __restrict__ q, const bf16_t* __restrict__ k_cache,
                  const bf16_t* __restrict__ v_cache, const int* __restrict__ block_tables,
                  int max_blocks, const int* __restrict__ seq_lens, float* __restrict__ part_o,
                  float* __restrict__ part_ml, int Hq, int Hkv, int page, float scale, int n_split,
                  long long q_tok, long long q_head) {
    __shared__ float o_acc[GQA_GROUP][HD];
    __shared__ float ms[8][GQA_GROUP], ls[8][GQA_GROUP];
    const int b = blockIdx.x, hkv = blockIdx.y, sp = blockIdx.z;
    const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int len = seq_lens[b];
    const int per = (len + n_split - 1) / n_split;
    const int k0 = sp * per, k1 = min(len, k0 + per);
    const long long width = (long long)Hkv * HD;
    const int* bt = block_tables + (long long)b * max_blocks;

    for (int e = threadIdx.x; e < GQA_GROUP * HD; e += blockDim.x) o_acc[e / HD][e % HD] = 0.0f;
    float qv[GQA_GROUP][DPL], acc[GQA_GROUP][DPL], m[GQA_GROUP], l[GQA_GROUP];
#pragma unroll
    for (int g = 0; g < GQA_GROUP; g++) {
        const bf16_t* qh = q + (long long)b * q_tok + (long long)(hkv * GQA_GROUP + g) * q_head + lane * DPL;
#pragma unroll
        for (int d = 0; d < DPL; d++) {
            qv[g][d] = bf2f(qh[d]) * scale;
            acc[g][d] = 0.0f;
        }
        m[g] = NEG_INF;
        l[g] = 0.0f;
    }
    for (int p = k0 + w; p < k1; p += 8) {
        long long row = (long long)bt[p / page] * page + p % page;
        const bf16_t* kr = k_cache + row * width + (long long)hkv * HD + lane * DPL;
        const bf16_t* vr = v_cache + row * width + (long long)hkv * HD + lane * DPL;
        float kf[DPL], vf[DPL];
#pragma unroll
        for (int d = 0; d < DPL; d++) {
            kf[d] = bf2f(kr[d]);
            vf[d] = bf2f(vr[d]);
        }
#pragma unroll
        for (int g = 0; g < GQA_GROUP; g++) {
            float dot = 0.0f;
#pragma unroll
            for (int d = 0; d < DPL; d++) dot += qv[g][d] * kf[d];
            dot = warp_sum(dot);
            float mnew = fmaxf(m[g], dot);
            float alpha = expf(m[g] - mnew);  // m = -inf -> 0, and acc/l are 0 then
            float pr = expf(dot - mnew);
            l[g] = l[g] * alpha + pr;
#pragma unroll
            for (int d = 0; d < DPL; d++) acc[g][d] = acc[g][d] * alpha + pr * vf[d];
            m[g] = mnew;
        }
    }
    if (lane == 0) {
#pragma unroll
        for (int g = 0; g < GQA_GROUP; g++) {
            ms[w][g] = m[g];
            ls[w][g] = l[g];
        }
    }
    __syncthreads();
#pragma unroll
    for (int g = 0; g < GQA_GROUP; g++) {
        float M = NEG_INF;
        for (int ww = 0; ww < 8; ww++) M = fmaxf(M, ms[ww][g]);
        float f = m[g] == NEG_INF ? 0.0f : expf(m[g] - M);
#pragma unroll
        for (int d = 0; d < DPL; d++) atomicAdd(&o_acc[g][lane * DPL + d], acc[g][d] * f);
        if (threadIdx.x == 0) {
            float Lsum = 0.0f;
            for (int ww = 0; ww < 8; ww++)
                Lsum += ms[ww][g] == NEG_INF ? 0.0f : ls[ww][g] * expf(ms[ww][g] - M);
            long long pi = (((long long)b * Hq + hkv * GQA_GROUP + g) * n_split + sp) * 2;
            part_ml[pi] = M;
            part_ml[pi + 1] = Lsum;
        }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < GQA_GROUP * HD; e += blockDim.x) {
        int g = e / HD, d = e % HD;
        part_o[(((long long)b * Hq + hkv * GQA_GROUP + g) * n_split + sp) * HD + d] = o_acc[g][d];
    }
}

extern "C" __global__ void attn_decode_combine(const float* __restrict__ part_o,
                                               const float* __restrict__ part_ml,
                                               bf16_t* __restrict__ o, int Hq, int n_split) {
    const int b = blockIdx.x, h = blockIdx.y, d = threadIdx.x;
    const long long base = ((long long)b * Hq + h) * n_split;
    float M = NEG_INF;
    for (int sp = 0; sp < n_split; sp++) M = fmaxf(M, part_ml[(base + sp) * 2]);
    float num = 0.0f, den = 0.0f;
    for (int sp = 0; sp < n_split; sp++) {
        float ms = part_ml[(base + sp) * 2];
        if (ms == NEG_INF) continue;
        float f = expf(ms - M);
        num += f * part_o[(base + sp) * HD + d];
        den += f * part_ml[(base + sp) * 2 + 1];
    }
    o[((long long)b * Hq + h) * HD + d] = f2bf(num / den);
}
