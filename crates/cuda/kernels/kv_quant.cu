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
// Tested by: tests/ops/ cases "kv_write_q" (codes and scales bit-equal to the CPU).

// The KV codes (KVF_*, kq_row and its helpers) are prelude.cuh's (rope.cu's qk_norm_rope writes the cache too).

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
