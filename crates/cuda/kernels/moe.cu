// moe.cu — the routed experts of a mixture-of-experts layer: routing, grouping rows by expert, the
// experts' GEMMs (grouped for prefill, per selected expert for decode) and the weighted un-permute.
//
// Computes, for T tokens x [T, H] (bf16), router logits [T, E] (f32, a GEMM before these kernels),
// top K of E experts, expert e's weights at W + e·wstride (bf16 row-major [N, Kd]):
//   moe_route:      softmax of each row's logits (f32), the K largest (equal: the lower expert first),
//                   renormalised to sum 1 when `norm`; topk[t, j] = (expert i32, weight f32); and the
//                   shared expert's gate sigmoid(x[t]·wg) (f32).
//   moe_offsets:    rows per expert as prefix sums offs[0..E] (offs[E] = T·K) and tiles of bm rows
//                   per expert as prefix sums offs[E+1..2E+1]; rows[p] = the row of pair p = t·K + j in
//                   the grouped order (within an expert the order is arbitrary: rows are independent).
//   moe_permute:    grouped[rows[p]] = x[p / K].
//   moe_gemm:       Y[r, :N] = X[r, :Kd] · W_eᵀ for every grouped row r of expert e.
//   moe_gemv:       Y[p, :N] = X[p / x_div, :Kd] · W_eᵀ, e = topk[p]'s expert, for the P routed pairs
//                   (decode: reads only the selected experts' weights; no grouping); the launch's pairs
//                   past P (one per token, when the shared expert runs with them) use the shared expert's
//                   projection Ws (same shape) over moe_x_row's row.
//   moe_unpermute:  out[t] = bf16(Σ_j w_j · Y[row(t, j)] + gate[t] · S[t]), S the shared expert's output:
//                   `shared` [T, H] when given (the shared pairs' rows of Y), else out itself.
// Launch shapes depend only on T, K, E and the dims, never on the routing (CUDA graphs replay them):
//   moe_route grid T block 256; moe_offsets grid 1 block 1024 smem 8·E; moe_permute grid T·K block 128;
//   moe_gemm grid (ceil(N/64), ceil(T·K/64) + min(E, T·K)) block 128 (blocks past the last tile exit);
//   moe_gemv grid (ceil(N/16), T·K, or T·K + T with the shared expert) block 128; moe_unpermute grid T
//   block 256.
// Dtypes: bf16 activations and weights, f32 accumulate. Kd % 8 == 0, H % 8 == 0, 16-byte aligned
//   rows (the launchers check).
// Arch: mma.sync m16n8k16 bf16 (sm_80+), nothing Hopper-only. moe_route, moe_gemv and moe_unpermute (a
// decode step's chain) may be launched programmatically (sm_90): they wait for their predecessor first
// (pdl_enter) and read the step's data through coherent loads; the grouping and grouped GEMMs are not.
// Tested by: tests/ops/ cases "moe_*" against deltaserve_cpu::moe.

#define MOE_BM 64
#define MOE_BN 64
#define MOE_BK 32
#define MOE_PAD 8
#define MOE_MAX_K 32
#define MOE_NEG_INF __int_as_float(0xff800000u)

extern "C" __global__ void __launch_bounds__(256)
moe_route(const float* logits, int E, int K, int norm, const bf16_t* x, const bf16_t* __restrict__ wg, int H,
          int* topk, float* shared_gate) {
    __shared__ float red[32];
    __shared__ float wv[32];
    __shared__ int wi[32];
    __shared__ int chosen[MOE_MAX_K];
    __shared__ float chosen_v[MOE_MAX_K];
    pdl_enter();
    const int t = blockIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const float* l = logits + (long long)t * E;
    float g = 0.0f;
    for (int c = threadIdx.x; c < H; c += blockDim.x) g += bf2f(x[(long long)t * H + c]) * bf2f(wg[c]);
    g = block_sum(g, red);
    for (int j = 0; j < K; j++) {
        float bv = MOE_NEG_INF;
        int bi = E;
        for (int e = threadIdx.x; e < E; e += blockDim.x) {
            bool taken = false;
            for (int q = 0; q < j; q++) taken |= chosen[q] == e;
            if (!taken && am_better(l[e], e, bv, bi)) {
                bv = l[e];
                bi = e;
            }
        }
        am_warp_best(bv, bi);
        if (lane == 0) {
            wv[warp] = bv;
            wi[warp] = bi;
        }
        __syncthreads();
        if (warp == 0) {
            bv = lane < nw ? wv[lane] : MOE_NEG_INF;
            bi = lane < nw ? wi[lane] : E;
            am_warp_best(bv, bi);
            if (lane == 0) {
                chosen[j] = bi;
                chosen_v[j] = bv;
            }
        }
        __syncthreads();
    }
    const float mx = chosen_v[0];  // the largest logit
    float s = 0.0f;
    for (int e = threadIdx.x; e < E; e += blockDim.x) s += expf(l[e] - mx);
    s = block_sum(s, red);
    if (threadIdx.x == 0) {
        shared_gate[t] = sigmoidf_(g);
        float total = 0.0f;
        for (int j = 0; j < K; j++) total += expf(chosen_v[j] - mx) / s;
        for (int j = 0; j < K; j++) {
            float p = expf(chosen_v[j] - mx) / s;
            if (norm) p /= total;
            topk[2 * ((long long)t * K + j)] = chosen[j];
            topk[2 * ((long long)t * K + j) + 1] = __float_as_int(p);
        }
    }
}

extern "C" __global__ void __launch_bounds__(1024)
moe_offsets(const int* __restrict__ topk, int P, int E, int bm, int* __restrict__ offs, int* __restrict__ rows) {
    extern __shared__ int moe_sm[];
    __shared__ int red[32];
    int* cnt = moe_sm;
    int* cur = moe_sm + E;
    for (int e = threadIdx.x; e < E; e += blockDim.x) cnt[e] = 0;
    __syncthreads();
    for (int p = threadIdx.x; p < P; p += blockDim.x) atomicAdd(&cnt[topk[2 * p]], 1);
    __syncthreads();
    const int chunk = (E + blockDim.x - 1) / blockDim.x;
    const int e0 = min(E, (int)threadIdx.x * chunk), e1 = min(E, e0 + chunk);
    int rs = 0, ts = 0;
    for (int e = e0; e < e1; e++) {
        rs += cnt[e];
        ts += (cnt[e] + bm - 1) / bm;
    }
    int rp = block_inclusive_scan(rs, red) - rs;  // exclusive: the experts before this thread's
    int tp = block_inclusive_scan(ts, red) - ts;
    for (int e = e0; e < e1; e++) {
        offs[e] = rp;
        offs[E + 1 + e] = tp;
        cur[e] = rp;
        rp += cnt[e];
        tp += (cnt[e] + bm - 1) / bm;
    }
    if (threadIdx.x == blockDim.x - 1) {  // its prefix now covers every expert
        offs[E] = rp;
        offs[2 * E + 1] = tp;
    }
    __syncthreads();
    for (int p = threadIdx.x; p < P; p += blockDim.x) rows[p] = atomicAdd(&cur[topk[2 * p]], 1);
}

extern "C" __global__ void __launch_bounds__(128)
moe_permute(const bf16_t* __restrict__ x, const int* __restrict__ rows, int K, int H, bf16_t* __restrict__ out) {
    const int p = blockIdx.x, H8 = H >> 3;
    const uint4* src = (const uint4*)(x + (long long)(p / K) * H);
    uint4* dst = (uint4*)(out + (long long)rows[p] * H);
    for (int c = threadIdx.x; c < H8; c += blockDim.x) dst[c] = src[c];
}

extern "C" __global__ void __launch_bounds__(128)
moe_gemm(const bf16_t* __restrict__ X, const int* __restrict__ offs, int E, const bf16_t* __restrict__ W,
         long long wstride, int N, int Kd, bf16_t* __restrict__ Y) {
    __shared__ __align__(16) bf16_t As[MOE_BM][MOE_BK + MOE_PAD];
    __shared__ __align__(16) bf16_t Bs[MOE_BN][MOE_BK + MOE_PAD];
    int e, row0;
    if (!moe_tile(offs, E, blockIdx.y, MOE_BM, e, row0)) return;
    const int row_end = offs[e + 1];
    const bf16_t* We = W + (long long)e * wstride;
    const int n0 = blockIdx.x * MOE_BN;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp >> 1, wn = warp & 1, g = lane >> 2, tq = lane & 3;
    float acc[2][4][4];
#pragma unroll
    for (int mi = 0; mi < 2; mi++)
#pragma unroll
        for (int ni = 0; ni < 4; ni++)
#pragma unroll
            for (int q = 0; q < 4; q++) acc[mi][ni][q] = 0.0f;
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
    for (int k0 = 0; k0 < Kd; k0 += MOE_BK) {
#pragma unroll
        for (int q = 0; q < 2; q++) {
            const int idx = tid + q * 128, r = idx >> 2, c = (idx & 3) * 8, kk = k0 + c;
            const int row = row0 + r, n = n0 + r;
            uint4 a = zero, b = zero;
            if (row < row_end && kk < Kd) a = *(const uint4*)(X + (long long)row * Kd + kk);
            if (n < N && kk < Kd) b = ld_nc((const uint4*)(We + (long long)n * Kd + kk));
            *(uint4*)&As[r][c] = a;
            *(uint4*)&Bs[r][c] = b;
        }
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < MOE_BK; kk += 16) {
            u32 a[2][4];
#pragma unroll
            for (int mi = 0; mi < 2; mi++) {
                const int r = wm * 32 + mi * 16 + g;
                a[mi][0] = *(const u32*)&As[r][kk + 2 * tq];
                a[mi][1] = *(const u32*)&As[r + 8][kk + 2 * tq];
                a[mi][2] = *(const u32*)&As[r][kk + 2 * tq + 8];
                a[mi][3] = *(const u32*)&As[r + 8][kk + 2 * tq + 8];
            }
#pragma unroll
            for (int ni = 0; ni < 4; ni++) {
                const int n = wn * 32 + ni * 8 + g;
                const u32 b0 = *(const u32*)&Bs[n][kk + 2 * tq];
                const u32 b1 = *(const u32*)&Bs[n][kk + 2 * tq + 8];
#pragma unroll
                for (int mi = 0; mi < 2; mi++) mma_bf16(acc[mi][ni], a[mi], b0, b1);
            }
        }
        __syncthreads();
    }
#pragma unroll
    for (int mi = 0; mi < 2; mi++)
#pragma unroll
        for (int ni = 0; ni < 4; ni++) {
            const int c = n0 + wn * 32 + ni * 8 + 2 * tq;
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int r = row0 + wm * 32 + mi * 16 + g + 8 * h;
                if (r >= row_end) continue;
                bf16_t* y = Y + (long long)r * N;
                if (c < N) y[c] = f2bf(acc[mi][ni][2 * h]);
                if (c + 1 < N) y[c + 1] = f2bf(acc[mi][ni][2 * h + 1]);
            }
        }
}

#define MOE_GEMV_ROWS 4  // output rows per warp (4 warps: 16 per block)

extern "C" __global__ void __launch_bounds__(128)
moe_gemv(const bf16_t* X, int x_div, const int* topk, int P, int sx, const bf16_t* __restrict__ W,
         long long wstride, const bf16_t* __restrict__ Ws, int N, int Kd, bf16_t* Y) {
    pdl_enter();
    const int p = blockIdx.y, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const bool sh = p >= P;  // a shared-expert pair (moe_x_row)
    const uint4* xr = (const uint4*)(X + (long long)moe_x_row(p, P, x_div, sx) * Kd);
    const bf16_t* We = sh ? Ws : W + (long long)topk[2 * p] * wstride;
    const int nb = blockIdx.x * (4 * MOE_GEMV_ROWS) + warp * MOE_GEMV_ROWS;
    const int K8 = Kd >> 3;
    float acc[MOE_GEMV_ROWS];
#pragma unroll
    for (int r = 0; r < MOE_GEMV_ROWS; r++) acc[r] = 0.0f;
    for (int v = lane; v < K8; v += 32) {
        const uint4 xv = xr[v];
#pragma unroll
        for (int r = 0; r < MOE_GEMV_ROWS; r++) {
            const int n = nb + r < N ? nb + r : N - 1;
            const uint4 wv = ld_nc((const uint4*)(We + (long long)n * Kd) + v);
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const u32 xw = u4_comp(xv, i), ww = u4_comp(wv, i);
                acc[r] += bf2f((bf16_t)(xw & 0xffffu)) * bf2f((bf16_t)(ww & 0xffffu));
                acc[r] += bf2f((bf16_t)(xw >> 16)) * bf2f((bf16_t)(ww >> 16));
            }
        }
    }
#pragma unroll
    for (int r = 0; r < MOE_GEMV_ROWS; r++) {
        const float s = warp_sum(acc[r]);
        if (lane == 0 && nb + r < N) Y[(long long)p * N + nb + r] = f2bf(s);
    }
}

extern "C" __global__ void __launch_bounds__(256)
moe_unpermute(const bf16_t* ys, const int* rows, const int* topk, int K, const float* shared_gate,
              const bf16_t* shared, int H, bf16_t* out) {
    pdl_enter();
    const int t = blockIdx.x;
    const float g = shared_gate[t];
    const bf16_t* so = shared ? shared + (long long)t * H : out + (long long)t * H;  // the shared expert's row
    for (int c = threadIdx.x; c < H; c += blockDim.x) {
        float acc = 0.0f;
        for (int j = 0; j < K; j++) {
            const long long p = (long long)t * K + j;
            const int r = rows ? rows[p] : (int)p;
            acc += __int_as_float(topk[2 * p + 1]) * bf2f(ys[(long long)r * H + c]);
        }
        out[(long long)t * H + c] = f2bf(acc + g * bf2f(so[c]));
    }
}
