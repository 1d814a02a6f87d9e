// feed.cu — look-ahead decode: a launched step's input tokens are the picks of the step launched just
// before it, read where they are (on the device) instead of through the host.
//
// Computes, per row r of the step (every row one token):
//   f = from[r]; t = picks[f·stride] (stride 2: (token, flag) pairs, flag ≠ 0 = picked on the host);
//   the row runs when flag == 0, 0 ≤ t < valid and t is none of its stop ids (stops[r, ..]; −1 pads):
//     token_ids[r] = t;
//   else it is a padding row (token 0 at position −1: no KV write; slot −1: no state update; length 1).
//   With a host table (the embedding kept in pinned host memory), also residual[r, :] = table[t, :] (a
//   row of token 0 when the row does not run), read over the bus.
// Shapes/dtypes: picks [F·stride] i32; feed [R] i32 `from`, then [R, W] i32 stop ids; token_ids,
// positions, slots, seq_lens [R] i32; table [vocab, D] bf16 (host, device-mapped), residual [R, D] bf16.
// Launch: grid (R), block 256. Arch: plain loads/stores (host memory through unified addressing), sm_80+.
// Tested by: tests/backend.rs `launched_steps_feed_their_picks`.

extern "C" __global__ void feed_rows(const int* __restrict__ picks, int stride, const int* __restrict__ feed, int rows,
                                     int stops_w, int valid, int* __restrict__ token_ids, int* __restrict__ positions,
                                     int* __restrict__ slots, int* __restrict__ seq_lens, const bf16_t* table,
                                     bf16_t* __restrict__ residual, int D) {
    int r = blockIdx.x;
    int f = feed[r];
    int t = picks[(long long)f * stride];
    bool run = (stride < 2 || picks[(long long)f * stride + 1] == 0) && t >= 0 && t < valid;
    const int* stops = feed + rows + (long long)r * stops_w;
    for (int i = 0; i < stops_w; ++i) run = run && stops[i] != t;
    if (threadIdx.x == 0) {
        if (run) {
            token_ids[r] = t;
        } else {
            token_ids[r] = 0;
            positions[r] = -1;
            slots[r] = -1;
            seq_lens[r] = 1;
        }
    }
    if (table == nullptr) return;
    const bf16_t* src = table + (long long)(run ? t : 0) * D;
    bf16_t* dst = residual + (long long)r * D;
    if ((D & 7) == 0) {
        const uint4* s4 = (const uint4*)src;
        uint4* d4 = (uint4*)dst;
        for (int i = threadIdx.x; i < D / 8; i += blockDim.x) d4[i] = s4[i];
    } else {
        for (int i = threadIdx.x; i < D; i += blockDim.x) dst[i] = src[i];
    }
}
