// embed.cu — embedding gather.
//
// Computes: out[t, :] = table[ids[t], :]   (bf16 copy, bit exact); a row of zeros for ids[t] < 0
//           (tensor parallelism: a token outside this rank's vocabulary shard).
// Shapes/dtypes: table [vocab, D] bf16; ids [T] i32 (caller validates ids < vocab);
//                out [T, D] bf16.
// Launch: grid (T), block 256; 16-byte copies when D % 8 == 0, else 2-byte copies.
// Arch: plain loads/stores, sm_80+.
// Tested by: tests/ops/ case "embed".

extern "C" __global__ void embed_gather(const bf16_t* table, const int* __restrict__ ids,
                                        bf16_t* __restrict__ out, int D) {
    pdl_enter();  // launched programmatically on sm_90
    int t = blockIdx.x;
    long long row = (long long)ids[t];
    const bf16_t* src = table + row * D;
    bf16_t* dst = out + (long long)t * D;
    if (row < 0) {
        if ((D & 7) == 0) {
            for (int i = threadIdx.x; i < D / 8; i += blockDim.x) ((uint4*)dst)[i] = make_uint4(0, 0, 0, 0);
        } else {
            for (int i = threadIdx.x; i < D; i += blockDim.x) dst[i] = bf16_t();
        }
        return;
    }
    if ((D & 7) == 0) {
        const uint4* s4 = (const uint4*)src;
        uint4* d4 = (uint4*)dst;
        for (int i = threadIdx.x; i < D / 8; i += blockDim.x) d4[i] = s4[i];
    } else {
        for (int i = threadIdx.x; i < D; i += blockDim.x) dst[i] = src[i];
    }
}
