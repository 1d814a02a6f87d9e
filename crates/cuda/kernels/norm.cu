// norm.cu — RMS normalisations.
//
// Computes (f32 math, bf16 in/out):
//  add_rms_norm_1p:  h = bf16(x + res) (res optional: null -> h = x); res_out = h;
//                    out = bf16(h * rsqrt(mean(h^2) + eps) * (1 + w))        (Qwen3_5RMSNorm)
//  add_rms_norm_1p_parts: the same with x = bf16(sum over s < splits, in order, of parts[s]) (the
//                    f32 partial sums of an int4 GEMM split over K: w4g_reduce's bf16 output, bit for
//                    bit, never stored); res required
//  rms_norm_1p:      out[r] = bf16(x[r] * rsqrt(mean(x[r]^2) + eps) * (1 + w)) over rows with
//                    independent strides (used for q_norm/k_norm on the per-head q|gate layout)
//  gated_rms_norm:   out[r] = bf16(w * (o[r] * rsqrt(mean(o[r]^2) + eps)) * silu(z[r]))  (plain w);
//                    gated_rms_norm128 the same bits for D = 128, 16-byte loads, and optionally quantised for
//                    the FP8 GEMM (below)
// Shapes/dtypes:
//  add_rms_norm_1p: x, res, res_out, out [rows, D] bf16 (res_out may alias res); w [D] bf16.
//  add_rms_norm_1p_parts: parts [splits][rows][D] f32 (16-byte aligned), splits >= 1 (the launcher takes
//                   the int4 GEMM's, 1..16); the vector path's limits below (the launcher checks them).
//  rms_norm_1p:     x row r at x + r*x_stride, out row r at out + r*out_stride (elements); w [D] bf16.
//  gated_rms_norm:  o [rows, D] bf16 (rows = T*Hv, D = Dv); z row r at z + (r/H)*z_tok_stride +
//                   (r%H)*D; w [D] f32 (Qwen3.5 stores it f32; Qwen3.6 bf16 upcasts exactly).
// Launch: grid (rows), block 256 (any multiple of 32 <= 1024; add_rms_norm_1p(_parts): up to 640, its launcher
// takes a thread per 16-byte vector of the row); gated_rms_norm grid (ceil(rows/8)), block 256 (a
// warp per row). Arch: shuffles only, sm_80+.
// add_rms_norm_1p keeps a row in registers (16-byte loads, all issued before the sum) when D % 8 == 0,
// D <= 8192 at 256 threads and the rows are 16-byte aligned; else a scalar loop.
// Tested by: tests/ops/ cases "add_rms_norm_1p", "rms_norm_1p_strided", "gated_rms_norm".

// add_rms_norm_1p, vectorised: a thread's up to NORM_MAXV 16-byte vectors of x, res and w are all
// loaded before any arithmetic and h stays in registers (the scalar loop waited a full memory latency
// per element pair and re-read res_out: ~18 us for one 5120-wide row). The weights (no kernel writes
// them) load before the wait for the previous kernel (pdl_wait), x and res after it. Needs D % 8 == 0,
// D <= 8 * NORM_MAXV * blockDim.x and 16-byte aligned rows (checked by the kernel below).
#define NORM_MAXV 4
// add_rms_norm_1p_parts: 16-byte vectors a thread holds (rows of up to 8 * 2 * 640), and the splits whose
// partial sums it loads at once (per vector two float4 a split; 82 registers on sm_90, no spills).
#define NORM_PARTS_MAXV 2
#define NORM_PART_BATCH 4

// x[8v .. 8v + 7] of the row at `base` as w4g_reduce writes it: the splits' f32 partial sums added in
// split order (NORM_PART_BATCH splits' loads in flight at once), rounded to bf16 pairs.
__device__ __forceinline__ uint4 sum_parts8(const float* parts, long long pstride, int splits, long long at) {
    float4 a = make_float4(0.f, 0.f, 0.f, 0.f), b = a;
    for (int s0 = 0; s0 < splits; s0 += NORM_PART_BATCH) {
        float4 pa[NORM_PART_BATCH], pb[NORM_PART_BATCH];
#pragma unroll
        for (int i = 0; i < NORM_PART_BATCH; i++) {
            if (s0 + i < splits) {
                const float4* p = (const float4*)(parts + (long long)(s0 + i) * pstride + at);
                pa[i] = p[0];
                pb[i] = p[1];
            }
        }
#pragma unroll
        for (int i = 0; i < NORM_PART_BATCH; i++) {
            if (s0 + i == 0) {
                a = pa[0];
                b = pb[0];
            } else if (s0 + i < splits) {
                a.x += pa[i].x;
                a.y += pa[i].y;
                a.z += pa[i].z;
                a.w += pa[i].w;
                b.x += pb[i].x;
                b.y += pb[i].y;
                b.z += pb[i].z;
                b.w += pb[i].w;
            }
        }
    }
    return make_uint4(pack_bf16(a.x, a.y), pack_bf16(a.z, a.w), pack_bf16(b.x, b.y), pack_bf16(b.z, b.w));
}

// One 16-byte vector of a row: h = bf16(x + res) in place (with res), its squares added to ss in element
// order (add_rms_norm_1p's vector paths).
__device__ __forceinline__ void norm_add8(uint4& hv, const uint4& rv, bool has_res, float& ss) {
    u32* hw = (u32*)&hv;
    const u32* rw = (const u32*)&rv;
#pragma unroll
    for (int e = 0; e < 4; e++) {
        float a = lo_f(hw[e]), b = hi_f(hw[e]);
        if (has_res) {
            a = round_bf(a + lo_f(rw[e]));
            b = round_bf(b + hi_f(rw[e]));
            hw[e] = (__float_as_uint(a) >> 16) | (__float_as_uint(b) & 0xffff0000u);
        }
        ss += a * a;
        ss += b * b;
    }
}
// One 16-byte vector of the output: bf16(h * inv * (1 + w)).
__device__ __forceinline__ uint4 norm_out8(const uint4& hv, const uint4& wv, float inv) {
    const u32* hw = (const u32*)&hv;
    const u32* ww = (const u32*)&wv;
    uint4 o;
    u32* ow = (u32*)&o;
#pragma unroll
    for (int e = 0; e < 4; e++) {
        const float wa = 1.0f + lo_f(ww[e]), wb = 1.0f + hi_f(ww[e]);
        ow[e] = pack_f2bf(lo_f(hw[e]) * inv * wa, hi_f(hw[e]) * inv * wb);
    }
    return o;
}

// PARTS: x is the sum of `splits` f32 partial-sum arrays `parts` (pstride floats apart) instead. MAXV:
// 16-byte vectors a thread holds (D <= 8 * MAXV * blockDim.x).
template <bool PARTS, int MAXV>
__device__ __forceinline__ void add_rms_norm_1p_vec(const bf16_t* x, const float* parts, long long pstride,
                                                    int splits, const bf16_t* res, const bf16_t* __restrict__ w,
                                                    bf16_t* res_out, bf16_t* __restrict__ out, int D, float eps,
                                                    float* red) {
    const long long base = (long long)blockIdx.x * D;
    const int nv = D >> 3;
    uint4 hv[MAXV], wv[MAXV], rv[MAXV];
#pragma unroll
    for (int j = 0; j < MAXV; j++) {
        const int v = threadIdx.x + j * blockDim.x;
        if (v < nv) wv[j] = *(const uint4*)(w + 8 * v);
    }
    pdl_wait();
#pragma unroll
    for (int j = 0; j < MAXV; j++) {
        const int v = threadIdx.x + j * blockDim.x;
        if (v < nv) {
            rv[j] = res ? *(const uint4*)(res + base + 8 * v) : make_uint4(0u, 0u, 0u, 0u);
            hv[j] = PARTS ? sum_parts8(parts, pstride, splits, base + 8 * v) : *(const uint4*)(x + base + 8 * v);
        }
    }
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < MAXV; j++) {
        const int v = threadIdx.x + j * blockDim.x;
        if (v < nv) {
            norm_add8(hv[j], rv[j], res != nullptr, ss);
            if (res_out) *(uint4*)(res_out + base + 8 * v) = hv[j];
        }
    }
    const float inv = rsqrtf(block_sum(ss, red) / (float)D + eps);
#pragma unroll
    for (int j = 0; j < MAXV; j++) {
        const int v = threadIdx.x + j * blockDim.x;
        if (v < nv) *(uint4*)(out + base + 8 * v) = norm_out8(hv[j], wv[j], inv);
    }
}

extern "C" __global__ void add_rms_norm_1p(const bf16_t* x, const bf16_t* res,
                                           const bf16_t* __restrict__ w, bf16_t* res_out,
                                           bf16_t* __restrict__ out, int D, float eps) {
    // Launched programmatically on sm_90: the GEMV that follows may start streaming its weights; each
    // path waits for the previous kernel before it reads x or res (pdl_wait).
    pdl_trigger();
    __shared__ float red[32];
    const unsigned long long al = (unsigned long long)x | (unsigned long long)res | (unsigned long long)w |
                                  (unsigned long long)res_out | (unsigned long long)out;
    if ((D & 7) == 0 && (al & 15) == 0 && D <= 8 * NORM_MAXV * (int)blockDim.x) {  // uniform
        add_rms_norm_1p_vec<false, NORM_MAXV>(x, nullptr, 0, 0, res, w, res_out, out, D, eps, red);
        return;
    }
    pdl_wait();
    long long base = (long long)blockIdx.x * D;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < D; i += blockDim.x) {
        float h = bf2f(x[base + i]);
        if (res) h = round_bf(h + bf2f(res[base + i]));
        if (res_out) res_out[base + i] = f2bf(h);
        ss += h * h;
    }
    float inv = rsqrtf(block_sum(ss, red) / (float)D + eps);
    for (int i = threadIdx.x; i < D; i += blockDim.x) {
        // Re-derive h exactly as above (same thread, same element): no race with res_out aliasing
        // res because each element is read and written by one thread only.
        float h = res_out ? bf2f(res_out[base + i]) : bf2f(x[base + i]);
        out[base + i] = f2bf(h * inv * (1.0f + bf2f(w[i])));
    }
}

// add_rms_norm_1p for steps of many rows: the vector path's row (D <= 8 * V, one vector a thread) with V /
// NORM_VT threads, thread r playing threads r + (V / NORM_VT) i (i < NORM_VT) of add_rms_norm_1p's V-thread
// block: the same sums in the same order (each played thread's warp sum into its warp's place, then block_sum's
// sum of the V / 32 warp sums), so the same bits, with NORM_VT times the rows an SM holds at once (a V-thread
// block a row held three: 66% of the copy rate at 4,096 rows of 5,120). Launch: grid (rows), block V / NORM_VT
// (a multiple of 32); the vector path's alignment.
// With q (D % 128 == 0), the rows of tokens t < Tq are quantised for the FP8 GEMM instead of stored (codes
// q[t * D ..], scales xs[(k / 128) * Tq + t]; fp8.cu's fp8_act_quant of the stored row, the same bits: a
// half-warp holds a 128-feature block, since R is a multiple of 32) and the rows from Tq stored to out.
#define NORM_VT 4
extern "C" __global__ void add_rms_norm_1p_rows(const bf16_t* x, const bf16_t* res, const bf16_t* __restrict__ w,
                                                bf16_t* res_out, bf16_t* __restrict__ out, int D, float eps, int V,
                                                int Tq, unsigned char* __restrict__ q, float* __restrict__ xs) {
    pdl_trigger();
    __shared__ float red[32];
    const int R = blockDim.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const long long base = (long long)blockIdx.x * D;
    const int nv = D >> 3;
    uint4 hv[NORM_VT], wv[NORM_VT], rv[NORM_VT];
#pragma unroll
    for (int i = 0; i < NORM_VT; i++) {
        const int v = threadIdx.x + i * R;
        if (v < nv) wv[i] = *(const uint4*)(w + 8 * v);
    }
    pdl_wait();
#pragma unroll
    for (int i = 0; i < NORM_VT; i++) {
        const int v = threadIdx.x + i * R;
        if (v < nv) {
            rv[i] = res ? *(const uint4*)(res + base + 8 * v) : make_uint4(0u, 0u, 0u, 0u);
            hv[i] = *(const uint4*)(x + base + 8 * v);
        }
    }
#pragma unroll
    for (int i = 0; i < NORM_VT; i++) {
        const int v = threadIdx.x + i * R;
        float ss = 0.0f;
        if (v < nv) {
            norm_add8(hv[i], rv[i], res != nullptr, ss);
            if (res_out) *(uint4*)(res_out + base + 8 * v) = hv[i];
        }
        ss = warp_sum(ss);
        if (lane == 0) red[warp + (R >> 5) * i] = ss;
    }
    __syncthreads();
    const float inv = rsqrtf(warp_sum(lane < (V >> 5) ? red[lane] : 0.0f) / (float)D + eps);
    const bool quant = q != nullptr && (int)blockIdx.x < Tq;  // block-uniform
#pragma unroll
    for (int i = 0; i < NORM_VT; i++) {
        const int v = threadIdx.x + i * R;
        const uint4 y = v < nv ? norm_out8(hv[i], wv[i], inv) : make_uint4(0u, 0u, 0u, 0u);
        if (quant) {  // every lane: the shuffles need them all (a half-warp is all inside the row or all past it)
            float f[8], sc;
            bf16x8_f32(y, f);
            const uint2 codes = f8_quant8(f, sc);
            if (v < nv) {
                *(uint2*)(q + base + 8 * v) = codes;
                if ((v & 15) == 0) xs[(long long)(v >> 4) * Tq + blockIdx.x] = sc;
            }
        } else if (v < nv) {
            *(uint4*)(out + base + 8 * v) = y;
        }
    }
}

// The residual add + RMSNorm after an int4 GEMM split over K, in place of its w4g_reduce: one block a
// row, the vector path of add_rms_norm_1p (the launcher checks its limits: NORM_PARTS_MAXV vectors a
// thread) with x summed from the partials. Equal to w4g_reduce then add_rms_norm_1p bit for bit, one launch and one bf16 [rows, D]
// round trip fewer.
extern "C" __global__ void __launch_bounds__(640) add_rms_norm_1p_parts(const float* parts, int splits, const bf16_t* res,
                                                 const bf16_t* __restrict__ w, bf16_t* res_out,
                                                 bf16_t* __restrict__ out, int D, float eps) {
    pdl_trigger();
    __shared__ float red[32];
    add_rms_norm_1p_vec<true, NORM_PARTS_MAXV>(nullptr, parts, (long long)gridDim.x * D, splits, res, w, res_out, out, D, eps, red);
}

extern "C" __global__ void rms_norm_1p(const bf16_t* __restrict__ x, long long x_stride,
                                       const bf16_t* __restrict__ w, bf16_t* __restrict__ out,
                                       long long out_stride, int D, float eps) {
    pdl_trigger();  // the GEMV that follows may start streaming its weights (sm_90)
    __shared__ float red[32];
    const bf16_t* xr = x + (long long)blockIdx.x * x_stride;
    bf16_t* orow = out + (long long)blockIdx.x * out_stride;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < D; i += blockDim.x) {
        float v = bf2f(xr[i]);
        ss += v * v;
    }
    float inv = rsqrtf(block_sum(ss, red) / (float)D + eps);
    for (int i = threadIdx.x; i < D; i += blockDim.x)
        orow[i] = f2bf(bf2f(xr[i]) * inv * (1.0f + bf2f(w[i])));
}

// One warp per row, 8 rows per 256-thread block (a 128-thread block per 128-wide row spent most of its
// time being scheduled: 196K blocks for a 4096-token step). Bitwise what that block computed: lane l
// plays its threads l + 32j (j < 4), each summing o^2 over elements l + 32j + 128k in k order, and the
// four warp sums are combined as block_sum combined them (gdn_decode_gated matches this too).
extern "C" __global__ void gated_rms_norm(const bf16_t* __restrict__ o, const bf16_t* __restrict__ z,
                                          long long z_tok_stride, int H, const float* __restrict__ w,
                                          bf16_t* __restrict__ out, int rows, int D, float eps) {
    const int lane = threadIdx.x & 31;
    const int r = blockIdx.x * 8 + (threadIdx.x >> 5);
    if (r >= rows) return;
    const bf16_t* orow = o + (long long)r * D;
    const bf16_t* zrow = z + (long long)(r / H) * z_tok_stride + (long long)(r % H) * D;
    const float inv = rsqrtf(warp_as_block_sumsq<4>(orow, D, lane) / (float)D + eps);
    for (int i = lane; i < D; i += 32)
        out[(long long)r * D + i] = f2bf(w[i] * (bf2f(orow[i]) * inv) * siluf_(bf2f(zrow[i])));
}

// gated_rms_norm for D = 128 (the value heads of every Qwen3.5 / 3.6 / Next model), a half-warp per row with 8
// features a lane in 16-byte loads and stores; the same bits as gated_rms_norm: the sum of squares is added in
// warp_as_block_sumsq<4>'s order (element e is its lane e % 32 of pass e / 32; the butterflies over lanes xor 16
// and 8 are this lane's xor 2 and 1, those over xor 4, 2, 1 its own registers i ^ 4, ^ 2, ^ 1; the passes
// combined as (0 + 2) + (1 + 3)). With q, the rows of tokens t < Tq are quantised for the FP8 GEMM instead of
// stored (a row is one 128-feature block: codes q[r * 128 ..], the scale at xs[(r % H) * Tq + t]; fp8.cu's
// fp8_act_quant of the stored row, the same bits) and the rows from Tq stored to out.
// Launch: grid (ceil(rows / 16)), block 256; o, z, out 16-byte aligned, z_tok_stride % 8 == 0, w 16-byte aligned.
extern "C" __global__ void gated_rms_norm128(const bf16_t* o, const bf16_t* z, long long z_tok_stride, int H,
                                             const float* __restrict__ w, bf16_t* __restrict__ out, int rows,
                                             float eps, int Tq, unsigned char* __restrict__ q,
                                             float* __restrict__ xs) {
    const int sub = threadIdx.x & 15;
    const int r = blockIdx.x * 16 + (threadIdx.x >> 4);
    const bool ok = r < rows;  // every lane goes on: the shuffles need them all
    const int t = ok ? r / H : 0, h = ok ? r - t * H : 0;
    uint4 ov = make_uint4(0u, 0u, 0u, 0u), zv = ov;
    if (ok) {
        ov = ld_act((const uint4*)(o + (long long)r * 128) + sub);
        zv = ld_act((const uint4*)(z + (long long)t * z_tok_stride + (long long)h * 128) + sub);
    }
    const float4 w0 = ((const float4*)w)[2 * sub], w1 = ((const float4*)w)[2 * sub + 1];
    const float wv[8] = {w0.x, w0.y, w0.z, w0.w, w1.x, w1.y, w1.z, w1.w};
    float x[8], zf[8], a[8];
    bf16x8_f32(ov, x);
    bf16x8_f32(zv, zf);
#pragma unroll
    for (int i = 0; i < 8; i++) a[i] = x[i] * x[i];
#pragma unroll
    for (int i = 0; i < 8; i++) a[i] += __shfl_xor_sync(0xffffffffu, a[i], 2);
#pragma unroll
    for (int i = 0; i < 8; i++) a[i] += __shfl_xor_sync(0xffffffffu, a[i], 1);
    const float b0 = a[0] + a[4], b1 = a[1] + a[5], b2 = a[2] + a[6], b3 = a[3] + a[7];
    float ss = (b0 + b2) + (b1 + b3);  // this pass's sum (pass sub / 4)
    ss += __shfl_xor_sync(0xffffffffu, ss, 8);
    ss += __shfl_xor_sync(0xffffffffu, ss, 4);
    const float inv = rsqrtf(ss / 128.0f + eps);
    u32 yw[4];
#pragma unroll
    for (int i = 0; i < 4; i++)
        yw[i] = pack_f2bf(wv[2 * i] * (x[2 * i] * inv) * siluf_(zf[2 * i]),
                          wv[2 * i + 1] * (x[2 * i + 1] * inv) * siluf_(zf[2 * i + 1]));
    const uint4 y = make_uint4(yw[0], yw[1], yw[2], yw[3]);
    if (q) {
        float f[8], sc;
        bf16x8_f32(y, f);
        const uint2 codes = f8_quant8(f, sc);
        if (ok && t < Tq) {
            ((uint2*)(q + (long long)r * 128))[sub] = codes;
            if (sub == 0) xs[(long long)h * Tq + t] = sc;
            return;
        }
    }
    if (ok) ((uint4*)(out + (long long)r * 128))[sub] = y;
}
