// kv_quant.cu — write new K/V rows into the paged KV cache, quantised to the cache formats.
//
// Computes: for each flattened token t of sequence s (cu_seqlens), with absolute position
//   p = pos[t] (p < 0: decode-graph padding, writes nothing):
//   row = block_tables[s * max_blocks + p / page] * page + p % page
//   and for each kv head h, the token-head row x = k[t, h, :] (then v[t, h, :]) is stored with its
//   format (k_fmt / v_fmt, codes KVF_* below), exactly as deltaserve_cpu::kvquant rounds it:
//   - KVF_BF16: copied (the input is bf16).
//   - scaled formats, qmax = 448 (fp8 e4m3 FN) / 127 (int8) / 7 (int4):
//       amax = max |x| (NaN ignored); scale = the smallest f16 >= amax / qmax, clamped to
//       [2^-24, 65504]; code = round_half_even(x / scale) clamped to +-qmax (ints), or the nearest
//       e4m3 to x / scale (ties to even, saturating at +-448, NaN -> 0); all-zero rows store
//       scale 0 and codes 0. The f16 scale bits go to scales[row, h].
// Storage: cache [num_blocks * page, Hkv, hd] at the format's bits (bf16 2 B, fp8 / int8 1 B,
//   int4 2 per byte: element 2i in the low nibble, 2i+1 in the high nibble, two's complement,
//   codes -7..7); scales [num_blocks * page, Hkv] f16 bits (unused for bf16, may be 0).
// Shapes/dtypes: k, v [T, Hkv*hd] bf16 with token strides (elements, even); hd even; pointers of
//   k/v 4-byte aligned; block_tables [B, max_blocks] i32; cu_seqlens [B+1] i32; pos [T] i32.
// Launch: grid (T), block 128 (4 warps; warp w handles rows w, w+4, .. of the 2*Hkv K and V rows:
//   pass 1 the row's amax (warp max), pass 2 the codes, each lane a pair of elements at a time).
// Formats are run-time arguments (uniform branches): the kernel is memory-bound and one cubin
//   then serves every (K, V) pair, so kernels_check covers all of them at once.
// Arch: sm_80+ (plain loads/stores, shuffles; cvt.rn.f16.f32 for the scale).
// Tested by: tests/ops.rs cases "kv_write_q" (codes and scales bit-equal to the CPU).

#define KVF_BF16 0
#define KVF_FP8 1
#define KVF_INT8 2
#define KVF_INT4 3


// f16 bits of the stored scale for a wanted scale s = amax / qmax > 0 (kvquant::f16_scale).
__device__ __forceinline__ unsigned short kq_scale_bits(float s) {
    if (!(s <= 65504.0f)) return 0x7bffu;  // NaN or above the largest finite f16
    unsigned short h = f32_to_f16_rn(s);
    if (f16_to_f32(h) < s) h += 1;  // round up (from 0 this gives 2^-24, the clamp's floor)
    return h;
}

// The e4m3 (OCP FN) code nearest to y, ties to even, saturating at +-448, NaN -> 0 (kvquant::f32_to_e4m3).
__device__ __forceinline__ unsigned int kq_e4m3(float y) {
    if (y != y) return 0u;
    const unsigned int sign = (__float_as_uint(y) >> 24) & 0x80u;
    const float a = fminf(fabsf(y), 448.0f);
    if (a < 0.015625f) return sign | (unsigned int)rintf(a * 512.0f);  // subnormal: multiple of 2^-9
    int e = (int)(__float_as_uint(a) >> 23) - 127;                      // in [-6, 8]
    float r = rintf(a * __uint_as_float((unsigned int)(127 + 3 - e) << 23));  // a / 2^(e-3), exact
    if (r >= 16.0f) {
        e += 1;
        r = 8.0f;
    }
    return sign | ((unsigned int)(e + 7) << 3) | ((unsigned int)r - 8u);
}

// One code of a scaled format for y = x / scale (the low 8 bits; int4 uses the low 4).
__device__ __forceinline__ unsigned int kq_code(int fmt, float y) {
    if (fmt == KVF_FP8) return kq_e4m3(y);
    const float qmax = fmt == KVF_INT8 ? 127.0f : 7.0f;
    const int q = (int)fminf(fmaxf(rintf(y), -qmax), qmax);
    return (unsigned int)q & 0xffu;
}

// Stores one token-head row `x` (hd bf16) into `dst` (the row's bytes) and its scale.
__device__ __forceinline__ void kq_row(const bf16_t* x, unsigned char* dst, unsigned short* scale,
                                       int hd, int fmt, int lane) {
    const int pairs = hd >> 1;
    if (fmt == KVF_BF16) {
        for (int i = lane; i < pairs; i += 32) ((u32*)dst)[i] = ((const u32*)x)[i];
        return;
    }
    float amax = 0.0f;
    for (int i = lane; i < pairs; i += 32) {
        const u32 w = ((const u32*)x)[i];
        amax = fmaxf(amax, fmaxf(fabsf(__uint_as_float(w << 16)), fabsf(__uint_as_float(w & 0xffff0000u))));
    }
    amax = warp_max(amax);
    const float qmax = fmt == KVF_FP8 ? 448.0f : (fmt == KVF_INT8 ? 127.0f : 7.0f);
    const unsigned short sb = amax > 0.0f ? kq_scale_bits(__fdiv_rn(amax, qmax)) : (unsigned short)0;
    const float sc = f16_to_f32(sb);
    if (lane == 0) *scale = sb;
    for (int i = lane; i < pairs; i += 32) {
        const u32 w = ((const u32*)x)[i];
        unsigned int c0 = 0, c1 = 0;
        if (sb != 0) {
            c0 = kq_code(fmt, __fdiv_rn(__uint_as_float(w << 16), sc));
            c1 = kq_code(fmt, __fdiv_rn(__uint_as_float(w & 0xffff0000u), sc));
        }
        if (fmt == KVF_INT4) {
            dst[i] = (unsigned char)((c0 & 0xfu) | ((c1 & 0xfu) << 4));
        } else {
            ((unsigned short*)dst)[i] = (unsigned short)(c0 | (c1 << 8));
        }
    }
}

// Bytes of one token-head row of hd elements in format fmt.
__device__ __forceinline__ long long kq_row_bytes(int fmt, int hd) {
    return fmt == KVF_BF16 ? 2LL * hd : (fmt == KVF_INT4 ? hd / 2 : hd);
}

extern "C" __global__ void __launch_bounds__(128)
kv_write_q(const bf16_t* k, long long k_stride, const bf16_t* v, long long v_stride,
           unsigned char* k_cache, unsigned short* k_scales, unsigned char* v_cache, unsigned short* v_scales,
           const int* __restrict__ block_tables, int max_blocks, const int* __restrict__ cu_seqlens, int B,
           const int* __restrict__ pos, int page, int Hkv, int hd, int k_fmt, int v_fmt) {
    pdl_enter();  // launched programmatically on sm_90
    const int t = blockIdx.x;
    const int s = seq_of_token(cu_seqlens, B, t);
    const int p = pos[t];
    if (p < 0) return;  // padding row of a decode graph
    const long long row = (long long)block_tables[(long long)s * max_blocks + p / page] * page + p % page;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (int r = warp; r < 2 * Hkv; r += 4) {
        const bool is_k = r < Hkv;
        const int h = is_k ? r : r - Hkv;
        const int fmt = is_k ? k_fmt : v_fmt;
        const bf16_t* x = is_k ? k + (long long)t * k_stride + (long long)h * hd
                               : v + (long long)t * v_stride + (long long)h * hd;
        unsigned char* cache = is_k ? k_cache : v_cache;
        unsigned short* scales = is_k ? k_scales : v_scales;
        const long long idx = row * Hkv + h;  // token-head row index
        kq_row(x, cache + idx * kq_row_bytes(fmt, hd), scales + idx, hd, fmt, lane);
    }
}
