// gdn_chunk.cu — chunked (WY / UT-transform) Gated DeltaNet prefill, chunk C = 64 (arch doc §3.1).
//
// Computes, per sequence and value head (state h = S in [DK, DV], f32), chunk by chunk, with
// G = chunk-local cumsum of g, all exponents <= 0:
//   A_ij  = beta_i (k_i . k_j) exp(G_i - G_j)  (i > j)       P_ij = (q_i . k_j) exp(G_i - G_j)  (i >= j)
//   w     = (I + A)^-1 (beta * exp(G) * K)                   u    = (I + A)^-1 (beta * V)
//   v_new = u - w h
//   o_i   = exp(G_i) q_i h + sum_{j<=i} P_ij v_new_j
//   h'    = exp(G_last) h + sum_j k_j^T (exp(G_last - G_j) v_new_j)
// Two kernels, several sequences per launch (varlen: cu_seqlens + state slots):
//  gdn_chunk_prep   grid (n_chunks, Hv), block 256, dynamic smem ~83 KB (DK = DV = 128).
//      Everything that depends only on the chunk's q/k/v/g/beta: G, A, P, and w/u by forward
//      substitution (one column per thread, its history in registers: fully unrolled 64x64).
//      Writes the workspace (f32, per flattened token t and value head):
//        ws_w [T, Hv, DK], ws_u [T, Hv, DV], ws_p [T, Hv, 64], ws_g [T, Hv]   (= 4*(DK+DV+65) B)
//  gdn_chunk_state  grid (B, Hv, DV / GDN_BV), block 256, dynamic smem ~75 KB (BV = 32).
//      The sequential part: walks the chunks of one sequence, holding the state slice
//      h[:, vslice] (DK x BV f32) in shared memory; reads state[slot] once, writes it once.
//      v columns are independent in the recurrence, so slices need no communication.
//      Register tiles (RV chunk rows or RH state rows x 1 value column per thread) with
//      float4 shared-memory reads of the row operand.
// Shapes/dtypes: q, k [T, Hk, DK] bf16 (L2-normalised, q pre-scaled: gdn_gate.cu);
//   v [T, *] bf16 (head v at column v*DV, token stride v_stride: the conv output);
//   g, beta [T, Hv] f32; state [slots, Hv, DK, DV] f32; o [T, Hv, DV] bf16;
//   cu_seqlens [B+1] i32; slots [B] i32; chunk_table [n_chunks, 2] i32 = (seq, chunk index in seq),
//   built on the host (ops::gdn_chunk::chunk_table). Value head v reads key head v / (Hv / Hk).
// Arch: f32 FFMA + shared memory only (no tensor cores yet); runs on sm_80/86/89/90 (smem fits
//   the 99 KB sm_86/89 limit). -D DK, DV (multiples of 32, DK+DV <= 512), GDN_BV (16 or 32).
// Tested by: tests/ops.rs case "gdn_chunk" (1 token, 63/64/65/127/129, ragged batches, Hv/Hk=3,
//   carried state) against deltaserve_cpu::gdn::gdn_recurrent.

#ifndef DK
#define DK 128
#endif
#ifndef DV
#define DV 128
#endif
#ifndef GDN_BV
#define GDN_BV 32
#endif
#define CH 64
#define KP (DK + 1)

extern "C" __global__ void __launch_bounds__(256)
gdn_chunk_prep(const bf16_t* __restrict__ q, const bf16_t* __restrict__ k,
               const bf16_t* __restrict__ v, long long v_stride,
               const float* __restrict__ g, const float* __restrict__ beta,
               const int* __restrict__ cu_seqlens, const int* __restrict__ chunk_table,
               float* __restrict__ ws_w, float* __restrict__ ws_u, float* __restrict__ ws_p,
               float* __restrict__ ws_g, int Hk, int Hv) {
    extern __shared__ float smem[];
    float* Ks = smem;                 // [CH][KP]
    float* Qs = Ks + CH * KP;         // [CH][KP]
    float* As = Qs + CH * KP;         // [CH][CH]
    float* Gs = As + CH * CH;         // [CH] cumsum of g
    float* Bs = Gs + CH;              // [CH] beta (0 past the chunk end)
    float* Xs = Bs + CH;              // [CH] beta * exp(G)

    const int tid = threadIdx.x;
    const int hv = blockIdx.y, hk = hv / (Hv / Hk);
    const int s = chunk_table[2 * blockIdx.x], ci = chunk_table[2 * blockIdx.x + 1];
    const int t0 = cu_seqlens[s] + ci * CH;
    const int L = min(CH, cu_seqlens[s + 1] - t0);

    for (int e = tid; e < CH * DK; e += blockDim.x) {
        int i = e / DK, d = e % DK;
        float kv = 0.0f, qv = 0.0f;
        if (i < L) {
            long long off = ((long long)(t0 + i) * Hk + hk) * DK + d;
            kv = bf2f(k[off]);
            qv = bf2f(q[off]);
        }
        Ks[i * KP + d] = kv;
        Qs[i * KP + d] = qv;
    }
    if (tid < CH) {
        Gs[tid] = tid < L ? g[(long long)(t0 + tid) * Hv + hv] : 0.0f;
        Bs[tid] = tid < L ? beta[(long long)(t0 + tid) * Hv + hv] : 0.0f;
    }
    __syncthreads();
    if (tid == 0) {
        float acc = 0.0f;
        for (int i = 0; i < CH; i++) {
            acc += Gs[i];
            Gs[i] = acc;
        }
    }
    __syncthreads();
    if (tid < CH) {
        Xs[tid] = Bs[tid] * expf(Gs[tid]);
        if (tid < L) ws_g[(long long)(t0 + tid) * Hv + hv] = Gs[tid];
    }

    // A (strictly lower) and P (lower incl. diagonal). A warp shares i; lanes run over j.
    for (int e = tid; e < CH * CH; e += blockDim.x) {
        int i = e / CH, j = e % CH;
        float a = 0.0f, p = 0.0f;
        if (j <= i && i < L) {
            float kk = 0.0f, qk = 0.0f;
#pragma unroll 8
            for (int d = 0; d < DK; d++) {
                float kj = Ks[j * KP + d];
                kk += Ks[i * KP + d] * kj;
                qk += Qs[i * KP + d] * kj;
            }
            float decay = expf(Gs[i] - Gs[j]);
            p = qk * decay;
            if (j < i) a = Bs[i] * decay * kk;
        }
        As[i * CH + j] = a;
        if (i < L) ws_p[((long long)(t0 + i) * Hv + hv) * CH + j] = p;
    }
    __syncthreads();

    // Forward substitution: row_i = X_i - sum_{j<i} A_ij row_j, for the DK columns of w
    // (X = beta exp(G) k) and the DV columns of u (X = beta v). Each thread owns one column and
    // keeps its 64 earlier rows in registers (indices are compile-time after unrolling).
    for (int col = tid; col < DK + DV; col += blockDim.x) {
        const bool is_w = col < DK;
        const int cc = is_w ? col : col - DK;
        const bf16_t* vcol = v + (long long)hv * DV + cc;
        float* dst = is_w ? ws_w + (long long)hv * DK + cc : ws_u + (long long)hv * DV + cc;
        const long long dst_stride = (long long)Hv * (is_w ? DK : DV);
        float hist[CH];
#pragma unroll
        for (int i = 0; i < CH; i++) {
            float x;
            if (is_w) x = Ks[i * KP + cc] * Xs[i];
            else x = i < L ? bf2f(vcol[(long long)(t0 + i) * v_stride]) * Bs[i] : 0.0f;
#pragma unroll
            for (int j = 0; j < i; j++) x -= As[i * CH + j] * hist[j];
            hist[i] = x;
            if (i < L) dst[(long long)(t0 + i) * dst_stride] = x;
        }
    }
}

#define NRG (256 / GDN_BV)       // row groups (threads per value column)
#define RV (CH / NRG)            // chunk rows per thread: rows rg*RV .. rg*RV+RV
#define RH (DK / NRG)            // state rows per thread: rows rg*RH .. rg*RH+RH
#define VNP (GDN_BV + 1)
#define KP4 (DK + 4)             // Buf row pitch: 16-byte aligned rows for float4 reads

// Loads rows [0, CH) of a [*, DK] bf16 matrix (row i at src + i*row_stride) into Buf as f32,
// zero past L. 4 elements (8 bytes) per access.
__device__ __forceinline__ void load_bf16_rows(float* Buf, const bf16_t* src, long long row_stride, int L) {
    for (int e = threadIdx.x; e < CH * DK / 4; e += blockDim.x) {
        int i = e / (DK / 4), d4 = e % (DK / 4);
        float4 f = make_float4(0.f, 0.f, 0.f, 0.f);
        if (i < L) {
            uint2 raw = *(const uint2*)(src + i * row_stride + 4 * d4);
            f = make_float4(__uint_as_float(raw.x << 16), __uint_as_float(raw.x & 0xffff0000u),
                            __uint_as_float(raw.y << 16), __uint_as_float(raw.y & 0xffff0000u));
        }
        *(float4*)&Buf[i * KP4 + 4 * d4] = f;
    }
}

// acc[r] = sum_d Buf[rg*RV + r][d] * Hs[d][c]   (register tile: RV rows x 1 column)
__device__ __forceinline__ void rows_times_state(float (&acc)[RV], const float* Buf, const float* Hs, int rg, int c) {
#pragma unroll
    for (int r = 0; r < RV; r++) acc[r] = 0.0f;
#pragma unroll 4
    for (int d = 0; d < DK; d += 4) {
        float h0 = Hs[(d + 0) * GDN_BV + c], h1 = Hs[(d + 1) * GDN_BV + c];
        float h2 = Hs[(d + 2) * GDN_BV + c], h3 = Hs[(d + 3) * GDN_BV + c];
#pragma unroll
        for (int r = 0; r < RV; r++) {
            float4 b = *(const float4*)&Buf[(rg * RV + r) * KP4 + d];
            acc[r] += b.x * h0 + b.y * h1 + b.z * h2 + b.w * h3;
        }
    }
}

extern "C" __global__ void __launch_bounds__(256)
gdn_chunk_state(const bf16_t* __restrict__ q, const bf16_t* __restrict__ k,
                const float* __restrict__ ws_w, const float* __restrict__ ws_u,
                const float* __restrict__ ws_p, const float* __restrict__ ws_g,
                float* __restrict__ state, bf16_t* __restrict__ o,
                const int* __restrict__ cu_seqlens, const int* __restrict__ slots, int Hk, int Hv) {
    extern __shared__ float4 smem4[];
    float* smem = (float*)smem4;
    float* Hs = smem;                 // [DK][GDN_BV] state slice
    float* Buf = Hs + DK * GDN_BV;    // [CH][KP4]: w, then q, then k of the chunk
    float* Ps = Buf + CH * KP4;       // [CH][CH] (zero above the diagonal and past L)
    float* Vn = Ps + CH * CH;         // [CH][VNP] v_new slice
    float* Gs = Vn + CH * VNP;        // [CH]
    float* Dl = Gs + CH;              // [CH] exp(G_last - G_j), 0 past the chunk end

    const int tid = threadIdx.x;
    const int s = blockIdx.x, hv = blockIdx.y, v0 = blockIdx.z * GDN_BV;
    const int hk = hv / (Hv / Hk);
    const int c = tid % GDN_BV, rg = tid / GDN_BV;
    const int start = cu_seqlens[s], len = cu_seqlens[s + 1] - start;
    float* st = state + ((long long)slots[s] * Hv + hv) * DK * DV;

    for (int e = tid; e < DK * GDN_BV; e += blockDim.x) {
        int r = e / GDN_BV, cc = e % GDN_BV;
        Hs[e] = st[(long long)r * DV + v0 + cc];
    }

    for (int t0 = start; t0 < start + len; t0 += CH) {
        const int L = min(CH, start + len - t0);
        __syncthreads();  // previous chunk done with Buf/Ps/Vn/Gs/Hs
        for (int e = tid; e < CH * DK / 4; e += blockDim.x) {
            int i = e / (DK / 4), d4 = e % (DK / 4);
            float4 f = make_float4(0.f, 0.f, 0.f, 0.f);
            if (i < L) f = ((const float4*)(ws_w + ((long long)(t0 + i) * Hv + hv) * DK))[d4];
            *(float4*)&Buf[i * KP4 + 4 * d4] = f;
        }
        for (int e = tid; e < CH * CH / 4; e += blockDim.x) {
            int i = e / (CH / 4), j4 = e % (CH / 4);
            float4 f = make_float4(0.f, 0.f, 0.f, 0.f);
            if (i < L) f = ((const float4*)(ws_p + ((long long)(t0 + i) * Hv + hv) * CH))[j4];
            *(float4*)&Ps[i * CH + 4 * j4] = f;
        }
        if (tid < CH) Gs[tid] = tid < L ? ws_g[(long long)(t0 + tid) * Hv + hv] : 0.0f;
        __syncthreads();
        if (tid < CH) Dl[tid] = tid < L ? expf(Gs[L - 1] - Gs[tid]) : 0.0f;

        float acc[RV];
        // v_new = u - w h
        rows_times_state(acc, Buf, Hs, rg, c);
#pragma unroll
        for (int r = 0; r < RV; r++) {
            int i = rg * RV + r;
            float u = i < L ? ws_u[((long long)(t0 + i) * Hv + hv) * DV + v0 + c] : 0.0f;
            Vn[i * VNP + c] = u - acc[r];
        }
        __syncthreads();
        load_bf16_rows(Buf, q + ((long long)t0 * Hk + hk) * DK, (long long)Hk * DK, L);
        __syncthreads();
        // o = exp(G) q h + P v_new
        rows_times_state(acc, Buf, Hs, rg, c);
#pragma unroll
        for (int r = 0; r < RV; r++) acc[r] *= expf(Gs[rg * RV + r]);
#pragma unroll 4
        for (int j = 0; j < CH; j += 4) {
            float n0 = Vn[(j + 0) * VNP + c], n1 = Vn[(j + 1) * VNP + c];
            float n2 = Vn[(j + 2) * VNP + c], n3 = Vn[(j + 3) * VNP + c];
#pragma unroll
            for (int r = 0; r < RV; r++) {
                float4 p = *(const float4*)&Ps[(rg * RV + r) * CH + j];
                acc[r] += p.x * n0 + p.y * n1 + p.z * n2 + p.w * n3;
            }
        }
#pragma unroll
        for (int r = 0; r < RV; r++) {
            int i = rg * RV + r;
            if (i < L) o[((long long)(t0 + i) * Hv + hv) * DV + v0 + c] = f2bf(acc[r]);
        }
        __syncthreads();
        load_bf16_rows(Buf, k + ((long long)t0 * Hk + hk) * DK, (long long)Hk * DK, L);
        __syncthreads();
        // h' = exp(G_last) h + K^T (Dl * v_new), rows rg*RH .. +RH
        float hacc[RH];
#pragma unroll
        for (int r = 0; r < RH; r++) hacc[r] = 0.0f;
#pragma unroll 2
        for (int j = 0; j < CH; j++) {
            float vn = Dl[j] * Vn[j * VNP + c];
#pragma unroll
            for (int r4 = 0; r4 < RH / 4; r4++) {
                float4 b = *(const float4*)&Buf[j * KP4 + rg * RH + 4 * r4];
                hacc[4 * r4 + 0] += b.x * vn;
                hacc[4 * r4 + 1] += b.y * vn;
                hacc[4 * r4 + 2] += b.z * vn;
                hacc[4 * r4 + 3] += b.w * vn;
            }
        }
        const float eg = expf(Gs[L - 1]);
#pragma unroll
        for (int r = 0; r < RH; r++) {
            int d = rg * RH + r;
            Hs[d * GDN_BV + c] = eg * Hs[d * GDN_BV + c] + hacc[r];
        }
    }
    __syncthreads();
    for (int e = tid; e < DK * GDN_BV; e += blockDim.x) {
        int r = e / GDN_BV, cc = e % GDN_BV;
        st[(long long)r * DV + v0 + cc] = Hs[e];
    }
}
