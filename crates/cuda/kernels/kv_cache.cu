// kv_cache.cu — write new K/V rows into the paged KV cache.
//
// Computes: for each flattened token t of sequence s (cu_seqlens), with absolute position
//   p = pos[t]:  row = block_tables[s * max_blocks + p / page] * page + p % page
//   k_cache[row, :, :] = k[t, :, :];  v_cache[row, :, :] = v[t, :, :]   (bf16 copies)
// Tokens at a position < 0 (decode-graph padding) write nothing.
// Shapes/dtypes: k, v [T, Hkv*hd] bf16 with token strides k_stride/v_stride (elements);
//   k_cache, v_cache [num_blocks * page, Hkv*hd] bf16 (= [num_blocks, page, Hkv, hd]);
//   block_tables [B, max_blocks] i32; cu_seqlens [B+1] i32; pos [T] i32.
// Launch: grid (T), block 128. Arch: sm_80+.
// Tested by: tests/ops/ cases "kv_write+attn_prefill", "attn_decode".

extern "C" __global__ void kv_write(const bf16_t* k, long long k_stride, const bf16_t* v, long long v_stride,
                                    bf16_t* k_cache, bf16_t* v_cache,
                                    const int* __restrict__ block_tables, int max_blocks,
                                    const int* __restrict__ cu_seqlens, int B,
                                    const int* __restrict__ pos, int page, int width) {
    pdl_enter();  // launched programmatically on sm_90
    int t = blockIdx.x;
    int s = seq_of_token(cu_seqlens, B, t);
    int p = pos[t];
    if (p < 0) return;  // padding row of a decode graph
    long long row = (long long)block_tables[s * max_blocks + p / page] * page + p % page;
    const bf16_t* ks = k + (long long)t * k_stride;
    const bf16_t* vs = v + (long long)t * v_stride;
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
        k_cache[row * width + i] = ks[i];
        v_cache[row * width + i] = vs[i];
    }
}
