// vision.cu — the vision tower of Qwen3.5/3.6 on one image (crates/cpu/src/vision.rs is the reference):
// the residual stream is f32, GEMM inputs bf16, GEMM outputs f32 (cuBLASLt, no bias: the bias is added
// here, before anything else touches the value, as the reference's linear_bias does).
//
// A patch row r of an image of grid (t, gh, gw) sits in frame r / (gh*gw); inside a frame the patches come
// window by window (merge x merge windows in raster order, raster order inside a window), so row i of a
// frame is at (row, col) = (br*merge + ir, bc*merge + ic) with window w = i / merge², br = w / (gw/merge),
// bc = w % (gw/merge), ir = (i % merge²) / merge, ic = i % merge (patch_positions).
//
//  vision_embed_pos:  x[r] += bias + Σ taps table[k] * weight   (align-corners bilinear resampling of the
//                     side x side table to gh x gw; HF's f32 arithmetic, taps in the reference's order)
//  vision_add_norm:   with y: x[r] += y[r] + bias (the residual add, stored); then out[r] = bf16((x[r] - mean)
//                     * rsqrt(var + eps) * w + b)  (x f32; without y the LayerNorm alone)
//  vision_qkv_rope:   qkv[r] = y[r] + bias: q and k heads (bf16) rotated by the 2-D axial rotary, pair j of
//                     hd/2 pairs (dims j, j + hd/2) at angle row * inv[j] for j < hd/4, col * inv[j - hd/4]
//                     after, inv[i] = 1 / theta^(2i / (hd/2)); v as the f16 codes of v * 2^-8 (VIS_V_SCALE)
//  vision_attn_d64 / _d72 / _d128: o = softmax(q kᵀ / sqrt(hd)) v per head, each query over the keys of
//                     its frame (non-causal), FlashAttention-2 style on tensor cores (design above its code)
//  vision_bias_act:   out = bf16(act(y + bias))   act: 0 gelu tanh, 1 gelu (erf), 2 silu, 3 none
// Shapes/dtypes: x, y f32 [n, D]; qkv [n, 3D] (q | k | v, head h at h*hd; q, k bf16, v f16); o bf16 [n, D]; weights,
// biases, the table bf16. hd ≤ 128 and even (the tower's is 72, a multiple of 4 by its config).
// Launch: embed_pos: grid (n), block 256; add_norm: a warp a row, 4 rows a block of 128; qkv_rope: 4 patches a
// block of 256 (their cos / sin in shared memory, once for all heads); attention: see its design; bias_act:
// grid (n, ceil(D / 1024)), block 256, four values a thread. Arch: plain f32 math, sm_80+ (the attention:
// mma.sync, ldmatrix, cp.async, sm_80+).
// Tested by: tests/ops/ cases "vision_*" (against the CPU reference's functions).

// V's scale in its f16 codes (vision_qkv_rope writes v * 2^-8 as f16, the attention multiplies O by 2^8):
// v in [2^-6, 2^24) keeps all of f16's 11 significant bits, smaller values lose bits as f16 subnormals;
// no activation of a vision tower comes near 2^24.
#define VIS_V_SCALE 0.00390625f
#define VIS_V_UNSCALE 256.0f

__device__ __forceinline__ void vis_patch_pos(int r, int gh, int gw, int merge, int& row, int& col) {
    const int frame = gh * gw;
    const int i = r % frame;
    const int mm = merge * merge;
    const int w = i / mm, in = i % mm;
    const int wpr = gw / merge;
    row = (w / wpr) * merge + in / merge;
    col = (w % wpr) * merge + in % merge;
}

// The two table rows and weights resampling index i of an axis of `size` onto `side` (interpolation_taps).
__device__ __forceinline__ void vis_taps(int i, int size, int side, int (&idx)[2], float (&wt)[2]) {
    const float src = (float)i * (float)(side - 1) / (float)(max(size, 2) - 1);
    const float fl = floorf(src);
    for (int o = 0; o < 2; o++) {
        idx[o] = min((int)fl + o, side - 1);
        wt[o] = fmaxf(1.0f - fabsf(src - fl - (float)o), 0.0f);
    }
}

extern "C" __global__ void vision_embed_pos(float* x, const bf16_t* __restrict__ bias, const bf16_t* __restrict__ table,
                                            int D, int gh, int gw, int merge, int side) {
    const int r = blockIdx.x;
    int row, col;
    vis_patch_pos(r, gh, gw, merge, row, col);
    int ri[2], ci[2];
    float rw[2], cw[2];
    vis_taps(row, gh, side, ri, rw);
    vis_taps(col, gw, side, ci, cw);
    float* xr = x + (long long)r * D;
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float pos = 0.0f;
        for (int a = 0; a < 2; a++)
            for (int b = 0; b < 2; b++) {
                const long long k = (long long)ri[a] * side + ci[b];
                pos += bf2f(table[k * D + d]) * (rw[a] * cw[b]);
            }
        const float v = xr[d] + (bias ? bf2f(bias[d]) : 0.0f);
        xr[d] = v + pos;
    }
}

// Four consecutive values of a row as f32: element 4c + i of the row for i < 4 (vec: one 16-byte load of
// f32, else element loads masked to the row's D, zeros past it). bf16 rows: one 8-byte load, or elements.
__device__ __forceinline__ float4 vis_ld4(const float* row, int c, int D, bool vec) {
    if (vec) return *reinterpret_cast<const float4*>(row + 4 * c);
    float4 v;
    v.x = 4 * c < D ? row[4 * c] : 0.0f;
    v.y = 4 * c + 1 < D ? row[4 * c + 1] : 0.0f;
    v.z = 4 * c + 2 < D ? row[4 * c + 2] : 0.0f;
    v.w = 4 * c + 3 < D ? row[4 * c + 3] : 0.0f;
    return v;
}
__device__ __forceinline__ float4 vis_ld4(const bf16_t* row, int c, int D, bool vec) {
    float4 v;
    if (vec) {
        const uint2 u = *reinterpret_cast<const uint2*>(row + 4 * c);
        v.x = __uint_as_float(u.x << 16);
        v.y = __uint_as_float(u.x & 0xffff0000u);
        v.z = __uint_as_float(u.y << 16);
        v.w = __uint_as_float(u.y & 0xffff0000u);
        return v;
    }
    v.x = 4 * c < D ? bf2f(row[4 * c]) : 0.0f;
    v.y = 4 * c + 1 < D ? bf2f(row[4 * c + 1]) : 0.0f;
    v.z = 4 * c + 2 < D ? bf2f(row[4 * c + 2]) : 0.0f;
    v.w = 4 * c + 3 < D ? bf2f(row[4 * c + 3]) : 0.0f;
    return v;
}
// Stores the four values of chunk c (vec: one 16-byte f32 store / 8-byte bf16 store, else the elements below D).
__device__ __forceinline__ void vis_st4(float* row, int c, int D, bool vec, float4 v) {
    if (vec) {
        *reinterpret_cast<float4*>(row + 4 * c) = v;
        return;
    }
    if (4 * c < D) row[4 * c] = v.x;
    if (4 * c + 1 < D) row[4 * c + 1] = v.y;
    if (4 * c + 2 < D) row[4 * c + 2] = v.z;
    if (4 * c + 3 < D) row[4 * c + 3] = v.w;
}
__device__ __forceinline__ void vis_st4(bf16_t* row, int c, int D, bool vec, float4 v) {
    if (vec) {
        uint2 u;
        u.x = (u32)f2bf(v.x) | ((u32)f2bf(v.y) << 16);
        u.y = (u32)f2bf(v.z) | ((u32)f2bf(v.w) << 16);
        *reinterpret_cast<uint2*>(row + 4 * c) = u;
        return;
    }
    if (4 * c < D) row[4 * c] = f2bf(v.x);
    if (4 * c + 1 < D) row[4 * c + 1] = f2bf(v.y);
    if (4 * c + 2 < D) row[4 * c + 2] = f2bf(v.z);
    if (4 * c + 3 < D) row[4 * c + 3] = f2bf(v.w);
}
__device__ __forceinline__ float4 vis_add4(float4 a, float4 b) {
    return make_float4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w);
}

// Chunks of 4 values a lane of vision_add_norm keeps in registers (rows of up to 32 * 4 * VIS_NORM_REGS
// values: 1,536; longer rows read the rest again from global memory, where they are cached).
#define VIS_NORM_REGS 12

// One warp a row (4 rows a block of 128 threads), the row's chunks of 4 values at lane + 32 i: with y, x[r] +=
// y[r] + bias (stored back), then out[r] = LayerNorm(x[r]) (mean, then the mean of the squared deviations).
// vec: D % 4 == 0 and every row 16-byte (f32) / 8-byte (bf16) aligned.
extern "C" __global__ void __launch_bounds__(128) vision_add_norm(float* __restrict__ x, const float* __restrict__ y,
                                                                const bf16_t* __restrict__ bias,
                                                                const bf16_t* __restrict__ w,
                                                                const bf16_t* __restrict__ b, bf16_t* __restrict__ out,
                                                                int rows, int D, float eps, int vec) {
    const int r = blockIdx.x * 4 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (r >= rows) return;
    const int nch = (D + 3) >> 2;
    float* xr = x + (long long)r * D;
    const float* yr = y ? y + (long long)r * D : nullptr;
    float4 v[VIS_NORM_REGS];
    float s = 0.0f;
    // Pass 1: the row (the residual added and stored), its sum; chunks past the registers' reach are
    // added and stored here and read again below.
    auto add = [&](int c) {
        float4 t = vis_ld4(xr, c, D, vec);
        if (yr) {
            float4 a = vis_ld4(yr, c, D, vec);
            if (bias) a = vis_add4(a, vis_ld4(bias, c, D, vec));
            t = vis_add4(t, a);
            vis_st4(xr, c, D, vec, t);
        }
        s += (t.x + t.y) + (t.z + t.w);
        return t;
    };
#pragma unroll
    for (int i = 0; i < VIS_NORM_REGS; i++) {
        const int c = lane + 32 * i;
        if (c < nch) v[i] = add(c);
    }
    for (int c = lane + 32 * VIS_NORM_REGS; c < nch; c += 32) add(c);
    const float mean = warp_sum(s) / (float)D;
    // Pass 2: the squared deviations (elements past D, zeros in the chunk, do not count).
    float q = 0.0f;
    auto dev = [&](float4 t, int c) {
        const float e[4] = {t.x - mean, t.y - mean, t.z - mean, t.w - mean};
#pragma unroll
        for (int j = 0; j < 4; j++)
            if (4 * c + j < D) q += e[j] * e[j];
    };
#pragma unroll
    for (int i = 0; i < VIS_NORM_REGS; i++) {
        const int c = lane + 32 * i;
        if (c < nch) dev(v[i], c);
    }
    for (int c = lane + 32 * VIS_NORM_REGS; c < nch; c += 32) dev(vis_ld4(xr, c, D, vec), c);
    const float inv = 1.0f / sqrtf(warp_sum(q) / (float)D + eps);
    bf16_t* o = out + (long long)r * D;
    auto norm = [&](float4 t, int c) {
        const float4 g = vis_ld4(w, c, D, vec), bb = vis_ld4(b, c, D, vec);
        vis_st4(o, c, D, vec,
                make_float4((t.x - mean) * inv * g.x + bb.x, (t.y - mean) * inv * g.y + bb.y,
                            (t.z - mean) * inv * g.z + bb.z, (t.w - mean) * inv * g.w + bb.w));
    };
#pragma unroll
    for (int i = 0; i < VIS_NORM_REGS; i++) {
        const int c = lane + 32 * i;
        if (c < nch) norm(v[i], c);
    }
    for (int c = lane + 32 * VIS_NORM_REGS; c < nch; c += 32) norm(vis_ld4(xr, c, D, vec), c);
}

// a*c - b*s and b*c + a*s with the products rounded before the sum (the reference's order, no FMA).
__device__ __forceinline__ float vis_rot(float x, float y, float c, float s) {
    return __fadd_rn(__fmul_rn(x, c), __fmul_rn(y, s));
}

// Rotated pairs of a head the rotary takes at most (head dims up to 128).
#define VIS_MAX_HALF 64
// Patches a vision_qkv_rope block rotates.
#define VIS_ROPE_ROWS 4

// VIS_ROPE_ROWS patches a block of 256 threads: the rotation of each pair j at each patch first (shared
// memory), then per patch the q and k heads two pairs a thread (pairs j, j + 1: 8-byte loads at dims j and
// j + hd / 2) and v four values a thread. Needs hd % 4 == 0, y 16-byte, bias and qkv 8-byte aligned.
extern "C" __global__ void __launch_bounds__(256) vision_qkv_rope(const float* __restrict__ y,
                                                                const bf16_t* __restrict__ bias,
                                                                bf16_t* __restrict__ qkv, int n, int heads, int hd,
                                                                int gh, int gw, int merge, float theta) {
    const int r0 = blockIdx.x * VIS_ROPE_ROWS;
    const int D = heads * hd, half = hd / 2, quarter = hd / 4;
    const int rows = min(VIS_ROPE_ROWS, n - r0);
    // The rotation of pair j at patch r0 + i (the same for every q and k head): computed once.
    __shared__ float2 rot[VIS_ROPE_ROWS][VIS_MAX_HALF];
    for (int t = threadIdx.x; t < rows * half; t += blockDim.x) {
        const int i = t / half, j = t % half;
        int row, col;
        vis_patch_pos(r0 + i, gh, gw, merge, row, col);
        const int fi = j < quarter ? j : j - quarter;
        const float inv_freq = 1.0f / powf(theta, (float)(2 * fi) / (float)half);
        const float ang = (float)(j < quarter ? row : col) * inv_freq;
        rot[i][j] = make_float2(cosf(ang), sinf(ang));
    }
    __syncthreads();
    // q and k: pairs (j, j + 1) of head hh (hh < heads: a q head, else k head hh - heads; q | k are
    // contiguous, so k head h sits at D + h * hd).
    const int hp = half / 2, qk = 2 * heads * hp;
    for (int t = threadIdx.x; t < rows * qk; t += blockDim.x) {
        const int i = t / qk, p = t % qk;
        const int hh = p / hp, j = 2 * (p % hp);
        const long long at = (long long)(r0 + i) * 3 * D + hh * hd + j;
        float2 a = *reinterpret_cast<const float2*>(y + at);
        float2 b = *reinterpret_cast<const float2*>(y + at + half);
        if (bias) {
            const u32 ba = *reinterpret_cast<const u32*>(bias + hh * hd + j);
            const u32 bb = *reinterpret_cast<const u32*>(bias + hh * hd + j + half);
            a.x += __uint_as_float(ba << 16);
            a.y += __uint_as_float(ba & 0xffff0000u);
            b.x += __uint_as_float(bb << 16);
            b.y += __uint_as_float(bb & 0xffff0000u);
        }
        const float2 r1 = rot[i][j], r2 = rot[i][j + 1];
        const u32 lo = (u32)f2bf(vis_rot(a.x, b.x, r1.x, -r1.y)) | ((u32)f2bf(vis_rot(a.y, b.y, r2.x, -r2.y)) << 16);
        const u32 hi = (u32)f2bf(vis_rot(b.x, a.x, r1.x, r1.y)) | ((u32)f2bf(vis_rot(b.y, a.y, r2.x, r2.y)) << 16);
        *reinterpret_cast<u32*>(qkv + at) = lo;
        *reinterpret_cast<u32*>(qkv + at + half) = hi;
    }
    // v: four values a thread, as the f16 codes of v * 2^-8 (the attention's P V operand).
    const int vq = D / 4;
    for (int t = threadIdx.x; t < rows * vq; t += blockDim.x) {
        const int i = t / vq, c = t % vq;
        const long long row = (long long)(r0 + i) * 3 * D + 2 * D;
        float4 v = vis_ld4(y + row, c, D, true);
        if (bias) v = vis_add4(v, vis_ld4(bias + 2 * D, c, D, true));
        const uint2 u = make_uint2(pack_f16(v.x * VIS_V_SCALE, v.y * VIS_V_SCALE),
                                   pack_f16(v.z * VIS_V_SCALE, v.w * VIS_V_SCALE));
        *reinterpret_cast<uint2*>(qkv + row + 4 * c) = u;
    }
}

// ---------------------------------------------------------------------------------------------
// Attention within frames on tensor cores: vision_attn_d64 / vision_attn_d72 / vision_attn_d128, the
// same kernel computing HDK = 64 / 72 / 128 head dims (the launcher, ops/vision.rs attention_frames,
// takes the smallest HDK >= hd; dims hd..HDK are zeros and contribute nothing).
// Computes, for each frame [fs, fe) (cu_frames null: frame z = [z L, min(z L + L, n)), an image's frames
// of L patches; else frame z = [cu_frames[z], cu_frames[z + 1])), head h and query row i of the frame:
//   o[i, h] = sum_{j in [fs, fe)} softmax_j(scale * q[i, h] . k[j, h]) v[j, h]      (non-causal, f32 softmax)
// Shapes/dtypes: qkv [n, 3 D] (q | k | v, D = heads * hd, head h at h * hd): q and k bf16, v the f16 codes
// of v * 2^-8 (VIS_V_SCALE, as vision_qkv_rope writes them); o bf16 [n, D]; hd even, <= HDK; qkv and o
// 4-byte aligned; vec = 1 where hd % 8 == 0 and qkv is 16-byte aligned (16-byte copies),
// else 0 (4-byte copies).
// Design: FlashAttention-2 on mma.sync (m16n8k16 bf16 -> f32, ldmatrix, cp.async), attn_prefill's
// (attention_prefill.cu) without paging, GQA or the causal mask:
//  - One block = QROWS queries of one (frame, head), 4 warps of MT m16 row tiles each (VaTile): 32 rows at
//    HDK <= 80, so every K / V fragment read from shared memory feeds two mma; 16 at HDK 128, where Q
//    and O of 32 rows would not fit the registers. Q stays in registers (mma A fragments) for the block.
//  - K/V tiles of BK keys, double-buffered (cp.async). Every copy writes all HDK columns of all BK
//    rows: dims past hd and keys past the frame's end are zero-filled, so the tensor cores never read a
//    byte no copy of this block wrote (whatever an earlier kernel left in shared memory, e.g. a NaN,
//    cannot reach p·v, where NaN · 0 would be NaN). Rows are an odd number of 16-byte chunks apart, so
//    the 8 rows of an ldmatrix hit distinct banks (72 dims: no padding).
//  - The head dims in k16 steps and, where HDK % 16 == 8, a k8 tail (mma m16n8k8) for S; O in HDK / 8
//    n8 tiles: 72 dims cost 72, not 80.
//  - S = Q Kᵀ in f32; keys past the frame's end (in its last tile only) masked to -inf; online softmax
//    in the log2 domain (scale · log2 e applied in the exp's FFMA, ex2.approx) against a base that
//    moves only when a row's max passes it by more than VA_SLACK (P <= 2^8: bf16 rounds it with the
//    same relative error, the f32 sums are far from overflow), so O is rescaled (when any row's base
//    moved: warp vote) on the first tiles only, in practice. P V in f16: P rounded to f16 (11
//    significant bits, P <= 2^VA_SLACK) against V's f16 codes, one MMA per fragment (V fragments by
//    ldmatrix.trans); O times 2^8 at the end. Each row's sum of P on the tensor cores: P's f16 fragments
//    against a B of ones, one mma per 16 keys and row tile, the sum in every column of its C fragment
//    (of the f16 P that multiplies V), instead of two FADDs a score and a quad sum at the end (0.97x the
//    time). Query rows past the frame's end read zeros and are not stored.
//  - One barrier per key tile (V arrives in f16: nothing to convert in shared memory; a conversion here
//    and its second barrier took 1.13x the time). Measured: bench/results/vision-attention-v-codes-h100-2026-12-07.md.
//  - Static shared memory: 2 stages of K + V tiles (36,864 B at HDK 64 and 72, 34,816 B at 128); the Q
//    tile (the bytes of one stage) lands in stage 1 before the key loop. Two blocks per SM (8 warps; up
//    to 255 registers a thread, no spills).
// Launch: grid (ceil(longest frame / QROWS), heads, frames), block VA_NT = 128, no dynamic shared
//   memory; QROWS = 128 (HDK 64, 72) or 64 (HDK 128) = ops/vision.rs ATTENTION_KERNELS.
// Arch: sm_80+ (mma.sync, ldmatrix, cp.async; nothing Hopper-only).
// Tested by: tests/ops/ cases "vision_attention" (images' frames; packed frames of 1 to 4,096 rows,
//   not multiples of the tiles, several per launch, with shared memory filled with NaN beforehand; head
//   dims 2 to 128) against deltaserve_cpu::attention::full_attention per frame; timed by
//   tests/bench_vision.rs.
#define VA_NW 4  // warps per attention block
#define VA_NT (32 * VA_NW)
#define VA_NEG_INF (-__int_as_float(0x7f800000))
#define VA_SLACK 8.0f  // log2 of the largest P: a row's softmax base lags its max by at most this

// The tiling at HDK computed head dims.
template <int HDK>
struct VaTile {
    static constexpr int MT = HDK <= 80 ? 2 : 1;  // m16 row tiles per warp
    static constexpr int QROWS = 16 * MT * VA_NW;  // queries per block
    static constexpr int BK = 32 * MT;             // keys per K/V tile
    static constexpr int CH = HDK / 8;             // 16-byte chunks of a row
    static constexpr int STR = (CH | 1) * 8;       // shared-memory row stride (bf16): odd in 16-byte chunks
    static constexpr int MAT = BK * STR * 2;       // bytes of a K or a V tile
    static constexpr int STAGE = 2 * MAT;          // K + V; = the Q tile's QROWS * STR * 2 bytes
};

// Copies R rows of one (TWO: two) matrices of a head into shared-memory rows VaTile<HDK>::STR bf16 apart
// at dst: row r from src + r * stride (its hd dims; the second matrix `second` elements further, landing
// MAT bytes further). Dims hd..HDK and rows at or past `rows` (>= 1) are zero-filled (nothing is read for
// them: their source address is src's). vec: 16-byte copies, else 4-byte ones. All VA_NT threads call
// it; the caller commits. Thread tid copies row tid / TPR, chunks tid % TPR + k TPR (TPR = VA_NT / R
// threads per row: the warp's copies of one k are whole 16 TPR-byte pieces of 32 / TPR rows), so its
// addresses step by constants (one row offset per copy call, no division).
template <int HDK, int R, bool TWO>
__device__ __forceinline__ void vat_copy(u32 dst, const bf16_t* src, long long stride, long long second, int rows,
                                         int hd, bool vec, int tid) {
    using T = VaTile<HDK>;
    constexpr int TPR = VA_NT / R;                 // threads per row (R: 32, 64 or 128)
    constexpr int CPT = (T::CH + TPR - 1) / TPR;   // chunks per thread
    static_assert(VA_NT % R == 0, "rows per copy divide the block");
    const int r = tid / TPR, part = tid % TPR;
    const bool live = r < rows;
    // 32-bit offsets: r * stride < 128 * 3 * 65,535 * 128 < 2^32 (the launcher's bounds).
    const bf16_t* row = src + (live ? (u32)r * (u32)stride : 0u);
    const u32 d = dst + (u32)(r * T::STR + part * 8) * 2;
    if (vec) {
        const int nch = live ? hd >> 3 : 0;  // chunks to read in this row
#pragma unroll
        for (int k = 0; k < CPT; k++) {
            const int ch = part + k * TPR;
            if (T::CH % TPR == 0 || ch < T::CH) {
                const bool ok = ch < nch;
                const bf16_t* p = ok ? row + ch * 8 : src;
                cp_async16(d + k * TPR * 16, p, ok ? 16 : 0);
                if (TWO) cp_async16(d + k * TPR * 16 + T::MAT, p + second, ok ? 16 : 0);
            }
        }
    } else {
        const int nw = live ? hd >> 1 : 0;  // 4-byte words to read in this row
#pragma unroll 1
        for (int k = 0; k < 4 * CPT; k++) {
            const int w = 4 * part + (k >> 2) * 4 * TPR + (k & 3);  // word k & 3 of chunk part + (k >> 2) TPR
            if (w < 4 * T::CH) {
                const bool ok = w < nw;
                const bf16_t* p = ok ? row + 2 * w : src;
                const u32 dw = dst + (u32)(r * T::STR * 2 + w * 4);
                cp_async4(dw, p, ok ? 4 : 0);
                if (TWO) cp_async4(dw + T::MAT, p + second, ok ? 4 : 0);
            }
        }
    }
}

// The key loop's three parts over NB n8 key tiles (8 NB keys; the tile's first at kt / vt in shared memory,
// key index kb in the frame), shared by both loops of vat_body. S = Q Kᵀ:
template <int HDK, int NB>
__device__ __forceinline__ void vat_scores(float (&s)[VaTile<HDK>::MT][NB][4],
                                           const u32 (&qf)[VaTile<HDK>::MT][HDK / 16][4],
                                           const u32 (&qt)[VaTile<HDK>::MT][2], u32 kt, u32 k_lane, u32 t_lane) {
    constexpr int MT = VaTile<HDK>::MT, STR = VaTile<HDK>::STR, KS = HDK / 16;
    constexpr bool TAIL = HDK % 16 != 0;
#pragma unroll
    for (int ks = 0; ks < KS; ks++)
#pragma unroll
        for (int np = 0; np < NB / 2; np++) {
            u32 b0, b1, b2, b3;
            ldsm_x4(kt + k_lane + (u32)(np * 16 * STR + ks * 16) * 2, b0, b1, b2, b3);
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                if (ks == 0) {  // the first k step starts from zero (no zeroing of S)
                    mma_bf16_0(s[mt][2 * np], qf[mt][ks], b0, b1);
                    mma_bf16_0(s[mt][2 * np + 1], qf[mt][ks], b2, b3);
                } else {
                    mma_bf16(s[mt][2 * np], qf[mt][ks], b0, b1);
                    mma_bf16(s[mt][2 * np + 1], qf[mt][ks], b2, b3);
                }
            }
        }
    if (TAIL) {
#pragma unroll
        for (int np = 0; np < NB / 2; np++) {
            u32 b0, b1;
            ldsm_x2(kt + t_lane + (u32)(np * 16 * STR) * 2, b0, b1);
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                mma_bf16_k8(s[mt][2 * np], qt[mt][0], qt[mt][1], b0);
                mma_bf16_k8(s[mt][2 * np + 1], qt[mt][0], qt[mt][1], b1);
            }
        }
    }
}

// Keys at or past fe masked (where the tile passes fe), then the online softmax of rows g and g + 8 of each
// row tile (4 lanes per row): s becomes P, O and the row sums rescaled where a row's base moved.
template <int HDK, int NB>
__device__ __forceinline__ void vat_softmax(float (&s)[VaTile<HDK>::MT][NB][4], float (&mrow)[VaTile<HDK>::MT][2],
                                            float (&oacc)[VaTile<HDK>::MT][HDK / 8][4],
                                            float (&lacc)[VaTile<HDK>::MT][4], int kb, int fe, float sl2, int tg) {
    constexpr int MT = VaTile<HDK>::MT, NO = HDK / 8;
    if (kb + 8 * NB > fe) {  // the frame's last tile: no key at or past fe
#pragma unroll
        for (int nn = 0; nn < NB; nn++) {
            const int key = kb + nn * 8 + 2 * tg;
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                if (key >= fe) s[mt][nn][0] = s[mt][nn][2] = VA_NEG_INF;
                if (key + 1 >= fe) s[mt][nn][1] = s[mt][nn][3] = VA_NEG_INF;
            }
        }
    }

    float al[MT][2];
    bool moved = false;
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int hf = 0; hf < 2; hf++) {
            float mx = VA_NEG_INF;
#pragma unroll
            for (int nn = 0; nn < NB; nn++) mx = fmaxf(mx, fmaxf(s[mt][nn][2 * hf], s[mt][nn][2 * hf + 1]));
            mx = quad_max(mx) * sl2;  // sl2 > 0: -inf stays -inf
            // The row's base moves only when the max passes it by more than VA_SLACK (the first tile
            // always): P stays below 2^VA_SLACK, and O is rarely rescaled after the first tiles.
            al[mt][hf] = 1.0f;
            if (mx > mrow[mt][hf] + VA_SLACK) {
                al[mt][hf] = pf_exp2(mrow[mt][hf] - mx);  // 0 on the first tile (-inf)
                mrow[mt][hf] = mx;
                moved = true;
            }
            const float base = mrow[mt][hf] == VA_NEG_INF ? 0.0f : mrow[mt][hf];
#pragma unroll
            for (int nn = 0; nn < NB; nn++) {
                s[mt][nn][2 * hf] = pf_exp2(fmaf(s[mt][nn][2 * hf], sl2, -base));
                s[mt][nn][2 * hf + 1] = pf_exp2(fmaf(s[mt][nn][2 * hf + 1], sl2, -base));
            }
        }
    if (__any_sync(0xffffffffu, moved)) {
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int nn = 0; nn < NO; nn++) {
                oacc[mt][nn][0] *= al[mt][0];
                oacc[mt][nn][1] *= al[mt][0];
                oacc[mt][nn][2] *= al[mt][1];
                oacc[mt][nn][3] *= al[mt][1];
            }
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
            lacc[mt][0] *= al[mt][0];
            lacc[mt][1] *= al[mt][0];
            lacc[mt][2] *= al[mt][1];
            lacc[mt][3] *= al[mt][1];
        }
    }
}

// O += P V, 16 keys per k step: P in f16 (one A fragment straight from the S accumulators) against V's f16
// codes; each row's sum of P against a B of ones.
template <int HDK, int NB>
__device__ __forceinline__ void vat_pv(const float (&s)[VaTile<HDK>::MT][NB][4],
                                       float (&oacc)[VaTile<HDK>::MT][HDK / 8][4], float (&lacc)[VaTile<HDK>::MT][4],
                                       u32 vt, u32 v_lane, u32 t_lane) {
    constexpr int MT = VaTile<HDK>::MT, STR = VaTile<HDK>::STR, KS = HDK / 16, NO = HDK / 8;
    constexpr bool TAIL = HDK % 16 != 0;
    constexpr u32 ONES = 0x3c003c00u;  // a pair of f16 1.0
#pragma unroll
    for (int kk = 0; kk < NB / 2; kk++) {
        u32 pa[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
#pragma unroll
            for (int q = 0; q < 4; q++) {
                const float* p = s[mt][2 * kk + (q >> 1)];
                pa[mt][q] = pack_f16(p[2 * (q & 1)], p[2 * (q & 1) + 1]);
            }
            mma_f16(lacc[mt], pa[mt][0], pa[mt][1], pa[mt][2], pa[mt][3], ONES, ONES);  // the rows' sums of P
        }
#pragma unroll
        for (int np = 0; np < KS; np++) {
            u32 b0, b1, b2, b3;
            ldsm_x4_t(vt + v_lane + (u32)(kk * 16 * STR + np * 16) * 2, b0, b1, b2, b3);
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                mma_f16(oacc[mt][2 * np], pa[mt][0], pa[mt][1], pa[mt][2], pa[mt][3], b0, b1);
                mma_f16(oacc[mt][2 * np + 1], pa[mt][0], pa[mt][1], pa[mt][2], pa[mt][3], b2, b3);
            }
        }
        if (TAIL) {
            u32 b0, b1;
            ldsm_x2_t(vt + t_lane + (u32)(kk * 16 * STR) * 2, b0, b1);
#pragma unroll
            for (int mt = 0; mt < MT; mt++)
                mma_f16(oacc[mt][NO - 1], pa[mt][0], pa[mt][1], pa[mt][2], pa[mt][3], b0, b1);
        }
    }
}

template <int HDK>
__device__ __forceinline__ void vat_body(const bf16_t* __restrict__ qkv, bf16_t* __restrict__ o,
                                         const int* __restrict__ cu_frames, int n, int heads, int hd, int L,
                                         float scale, int vec) {
    using T = VaTile<HDK>;
    constexpr int MT = T::MT, BK = T::BK, STR = T::STR;
    constexpr int KS = HDK / 16;          // k16 steps over the head dims
    constexpr bool TAIL = HDK % 16 != 0;  // and a k8 step (S) / the last n8 tile (O) for dims 16 KS..HDK
    constexpr int NO = HDK / 8;           // n8 tiles of O
    __shared__ __align__(16) unsigned char vat_smem[4 * T::MAT];
    const int z = blockIdx.z, h = blockIdx.y;
    int fs, fe;
    if (cu_frames) {
        fs = cu_frames[z];
        fe = cu_frames[z + 1];
    } else {
        fs = z * L;
        fe = min(fs + L, n);
    }
    const int q0 = fs + blockIdx.x * T::QROWS;
    if (q0 >= fe) return;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, tg = lane & 3;  // mma fragment row group / thread in group
    const int D = heads * hd;
    const long long stride = 3LL * D;
    const bf16_t* head = qkv + (long long)h * hd;
    const u32 st0 = smem_addr(vat_smem), st1 = st0 + T::STAGE;
    const int n_kt = (fe - fs + BK - 1) / BK;

    // The block's queries to stage 1, key tile 0 to stage 0; Q into registers, then stage 1 is free.
    vat_copy<HDK, T::QROWS, false>(st1, head + (long long)q0 * stride, stride, 0, fe - q0, hd, vec, tid);
    vat_copy<HDK, BK, true>(st0, head + (long long)fs * stride + D, stride, D, fe - fs, hd, vec, tid);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    u32 qf[MT][KS][4], qt[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
        const u32 row = st1 + (u32)(((warp * MT + mt) * 16 + (lane & 15)) * STR) * 2;
#pragma unroll
        for (int ks = 0; ks < KS; ks++)
            ldsm_x4(row + (u32)(ks * 16 + (lane >> 4) * 8) * 2, qf[mt][ks][0], qf[mt][ks][1], qf[mt][ks][2],
                    qf[mt][ks][3]);
        qt[mt][0] = qt[mt][1] = 0u;
        if (TAIL) ldsm_x2(row + (u32)(KS * 16) * 2, qt[mt][0], qt[mt][1]);
    }
    __syncthreads();

    float oacc[MT][NO][4];
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int nn = 0; nn < NO; nn++) oacc[mt][nn][0] = oacc[mt][nn][1] = oacc[mt][nn][2] = oacc[mt][nn][3] = 0.0f;
    // mrow: each row's softmax base (log2 domain); lacc: each row's sum of P, in every column of an mma C
    // fragment (P against a B of ones, below): c0 / c1 row g, c2 / c3 row g + 8.
    float mrow[MT][2], lacc[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
        mrow[mt][0] = mrow[mt][1] = VA_NEG_INF;
        lacc[mt][0] = lacc[mt][1] = lacc[mt][2] = lacc[mt][3] = 0.0f;
    }
    const float sl2 = scale * 1.4426950408889634f;  // log2 domain
    // Lane addresses in a tile: K (B of S, keys 16 np.., dims 16 ks..), V (B of P V, transposed: keys
    // 16 kk.., dims 16 np..) and the tail's (rows 0..15, dims 16 KS..: K and V alike).
    const u32 k_lane = (u32)(((lane & 7) + ((lane >> 4) << 3)) * STR + ((lane >> 3) & 1) * 8) * 2;
    const u32 v_lane = (u32)(((lane & 7) + (((lane >> 3) & 1) << 3)) * STR + (lane >> 4) * 8) * 2;
    const u32 t_lane = (u32)((lane & 15) * STR + KS * 16) * 2;

    // Per key tile j, one barrier: it makes tile j visible and frees the other stage (every warp is past
    // tile j - 1), so the copy of tile j + 1 starts there.
    for (int j = 0; j < n_kt; j++) {
        const int kb = fs + j * BK;
        cp_async_wait<0>();
        __syncthreads();
        if (j + 1 < n_kt) {
            vat_copy<HDK, BK, true>((j & 1) ? st0 : st1, head + (long long)(kb + BK) * stride + D, stride, D,
                                    fe - kb - BK, hd, vec, tid);
            cp_async_commit();
        }
        const u32 kt = (j & 1) ? st1 : st0, vt = kt + T::MAT;

        float s[MT][BK / 8][4];
        vat_scores<HDK, BK / 8>(s, qf, qt, kt, k_lane, t_lane);
        vat_softmax<HDK, BK / 8>(s, mrow, oacc, lacc, kb, fe, sl2, tg);
        vat_pv<HDK, BK / 8>(s, oacc, lacc, vt, v_lane, t_lane);
    }

#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int hf = 0; hf < 2; hf++) {
            const float l = lacc[mt][2 * hf];
            const float inv = l > 0.0f ? VIS_V_UNSCALE / l : 0.0f;
            const int row = q0 + (warp * MT + mt) * 16 + 8 * hf + g;
            if (row < fe) {
                bf16_t* orow = o + (long long)row * D + (long long)h * hd + 2 * tg;
#pragma unroll
                for (int nn = 0; nn < NO; nn++)
                    if (nn * 8 + 2 * tg < hd)
                        *(u32*)(orow + nn * 8) = pack_bf16(oacc[mt][nn][2 * hf] * inv, oacc[mt][nn][2 * hf + 1] * inv);
            }
        }
}

extern "C" __global__ void __launch_bounds__(VA_NT, 2)
vision_attn_d64(const bf16_t* __restrict__ qkv, bf16_t* __restrict__ o, const int* __restrict__ cu_frames, int n,
                int heads, int hd, int L, float scale, int vec) {
    vat_body<64>(qkv, o, cu_frames, n, heads, hd, L, scale, vec);
}

extern "C" __global__ void __launch_bounds__(VA_NT, 2)
vision_attn_d72(const bf16_t* __restrict__ qkv, bf16_t* __restrict__ o, const int* __restrict__ cu_frames, int n,
                int heads, int hd, int L, float scale, int vec) {
    vat_body<72>(qkv, o, cu_frames, n, heads, hd, L, scale, vec);
}

extern "C" __global__ void __launch_bounds__(VA_NT, 2)
vision_attn_d128(const bf16_t* __restrict__ qkv, bf16_t* __restrict__ o, const int* __restrict__ cu_frames, int n,
                 int heads, int hd, int L, float scale, int vec) {
    vat_body<128>(qkv, o, cu_frames, n, heads, hd, L, scale, vec);
}

// vision_bias_act: blockIdx.x the row, blockIdx.y * blockDim.x + threadIdx.x its chunk of four values
// (vec: D % 4 == 0 and rows 16-byte (y) / 8-byte (bias, out) aligned, else element loads and stores).
extern "C" __global__ void vision_bias_act(const float* __restrict__ y, const bf16_t* __restrict__ bias,
                                           bf16_t* __restrict__ out, int D, int act, int vec) {
    const int c = blockIdx.y * blockDim.x + threadIdx.x;
    if (4 * c >= D) return;
    const long long r = (long long)blockIdx.x * D;
    float4 v = vis_ld4(y + r, c, D, vec);
    if (bias) v = vis_add4(v, vis_ld4(bias, c, D, vec));
    float e[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const float t = e[j];
        if (act == 0) {
            const float k = 0.7978846f;  // sqrt(2 / pi), the reference's f32 constant
            e[j] = 0.5f * t * (1.0f + tanhf(k * (t + 0.044715f * t * t * t)));
        } else if (act == 1) {
            e[j] = 0.5f * t * (1.0f + erff(t * 0.70710678118654752f));
        } else if (act == 2) {
            e[j] = t * (1.0f / (1.0f + expf(-t)));
        }
    }
    vis_st4(out + r, c, D, vec, make_float4(e[0], e[1], e[2], e[3]));
}
