// mtp.cu — row moves of the MTP head (speculative decoding, docs/architecture.md §2.5).
//
// The head's cache entry p combines the main model's post-norm hidden of position p - 1 with token p.
//  shift_rows:   y[r] = pending[slots[s]] when r is the first row of its sequence s (the hidden of the
//                position before the chunk, kept per state slot), else x[r - 1]; zeros when slots[s] < 0
//                (decode-graph padding).
//  scatter_rows: dst[dst_rows[i]] = src[rows[i]] (the slots' new pending hidden rows); rows with a
//                negative index on either side are skipped.
// Shapes/dtypes: x, y [T, D] bf16; pending, dst [slots, D] bf16; cu_seqlens [B+1], slots [B],
//   rows / dst_rows [N] i32. Bit-exact copies.
// Launch: grid (T) or (N), block 256; 16-byte copies when D % 8 == 0, else 2-byte copies.
// Arch: plain loads/stores, sm_80+.
// Tested by: tests/ops/ case "mtp_rows".

__device__ __forceinline__ void copy_row(bf16_t* __restrict__ dst, const bf16_t* __restrict__ src, int D) {
    if ((D & 7) == 0) {
        for (int i = threadIdx.x; i < D / 8; i += blockDim.x) {
            ((uint4*)dst)[i] = src ? ((const uint4*)src)[i] : make_uint4(0, 0, 0, 0);
        }
    } else {
        for (int i = threadIdx.x; i < D; i += blockDim.x) dst[i] = src ? src[i] : bf16_t();
    }
}

extern "C" __global__ void shift_rows(const bf16_t* __restrict__ x, const bf16_t* __restrict__ pending,
                                      const int* __restrict__ cu_seqlens, const int* __restrict__ slots,
                                      int B, bf16_t* __restrict__ y, int D) {
    const int r = blockIdx.x;
    const int s = seq_of_token(cu_seqlens, B, r);
    const int slot = slots[s];
    const bf16_t* src = slot < 0             ? nullptr
                        : r == cu_seqlens[s] ? pending + (long long)slot * D
                                             : x + (long long)(r - 1) * D;
    copy_row(y + (long long)r * D, src, D);
}

extern "C" __global__ void scatter_rows(const bf16_t* __restrict__ src, const int* __restrict__ rows,
                                        bf16_t* __restrict__ dst, const int* __restrict__ dst_rows, int D) {
    const int i = blockIdx.x;
    if (rows[i] < 0 || dst_rows[i] < 0) return;
    copy_row(dst + (long long)dst_rows[i] * D, src + (long long)rows[i] * D, D);
}
