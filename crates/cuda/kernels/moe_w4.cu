// moe_w4.cu — the routed experts of a mixture-of-experts layer with 4-bit weights (W4A16): every
// expert's linear in the int4 device format of w4a16.cu / src/w4.rs, expert e's tensors `estride`
// bytes after expert e - 1's (qweight, scales and zeros alike: one layout per expert, so expert 0's
// pointers and the stride locate every expert). The routing, grouping and un-permute are moe.cu's.
//
// Computes, for an expert projection W_e [out, in] (in % 128 == 0, out % 4 == 0):
//   moe_w4p_*: Y[p, :out] = X[p / x_div, :in] · W_eᵀ, e = topk[p]'s expert, for the P routed pairs
//              (decode: one pair per blockIdx.y, reading only the selected experts' weights; no
//              grouping); pairs past P (one per token, when the shared expert runs with them) use the
//              shared expert's linear (MoeW4Shared: the experts' shape and format, its gate/up as two
//              linears) over the row prelude.cuh's moe_x_row gives. The pair GEMV (w4_pair.cuh's
//              w4p_body, one token): grid.x = ceil(ceil(out/32) / (8/wpt)) blocks of 8 warps, wpt warps
//              per 32 output rows (with a two-linear shared expert: 2 · shb, each half's rows whole
//              blocks).
//   moe_w4g:   Y[r, :out] = X[r, :in] · W_eᵀ for the grouped rows r of every expert e (offs from
//              moe_offsets with tiles of MOE_W4_TILE rows): the tile GEMM (w4_tile.cuh's w4g_body,
//              32 tokens) over one expert tile per blockIdx.y, 128 output rows per blockIdx.x.
// Y bf16, f32 accumulation; the weights exactly as the dense int4 kernels compute them.
// Launch: moe_w4p_*: grid (blocks, pairs), block 256, dynamic smem 8 KB (the pairs' sums); moe_w4g: grid
//   (ceil(out/128), moe.rs's gemm_tiles(pairs, E, MOE_W4_TILE)), block 128, dynamic smem
//   w4_gemm::smem_bytes(32); blocks past the last tile exit. Launch shapes depend only on the step's
//   tokens, top-k and the expert count, never on the routing (CUDA graphs replay them). An expert index
//   outside 0..E (a routing of NaN logits) reads expert E - 1 rather than past the weights.
// moe_w4p_* may be launched programmatically (sm_90): each block waits for its predecessor (pdl_enter)
// before it reads the routing, so its weights stream after the wait; moe_w4g is launched plainly.
// Arch: what w4p_body and w4g_body use (mma.sync bf16, cp.async): sm_80+.
// Tested by: tests/ops/ cases "moe_w4_*" against the host dequantisation (src/w4.rs).

#define MOE_W4_TILE 32

// Expert e's tensor from expert 0's.
template <typename T>
__device__ __forceinline__ const T* moe_w4_at(const T* p0, long long estride, int e) {
    return p0 ? (const T*)((const char*)p0 + (long long)e * estride) : nullptr;
}

// The shared expert's linear of a moe_w4p_* launch: one linear over the launch's rows (the down
// projection), or two stacked (gate/up: the gate's rows, then the up's, each `out / 2` rows), whose
// first `shb` blocks of grid.x compute the top one and the rest the bottom one (shb: 0 for one linear).
struct MoeW4Shared {
    const u32* qw[2];
    const unsigned short* sc[2];
    const unsigned char* z[2];
    int shb;
};

#define MOE_W4P_KERNEL(NAME, ASYM, SBF)                                                                        \
    extern "C" __global__ void __launch_bounds__(W4_WARPS * 32, 2)                                              \
        NAME(const bf16_t* x, long long ldx, int x_div, const int* topk, int E, int P, int sx,                  \
             const u32* __restrict__ qw0, const unsigned short* __restrict__ sc0,                               \
             const unsigned char* __restrict__ z0, long long estride, MoeW4Shared shw, bf16_t* __restrict__ y,   \
             int out, int in, int wpt) {                                                                        \
        extern __shared__ uint4 w4_dyn[];                                                                        \
        pdl_enter(); /* the expert is the routing's: its weights are read after the wait */                     \
        const int p = blockIdx.y;                                                                                \
        const bf16_t* xr = x + (long long)moe_x_row(p, P, x_div, sx) * ldx;                                      \
        /* A shared-expert pair (past P): h, the half of a two-linear gate/up this block computes. */           \
        const bool sh = p >= P;                                                                                  \
        const int h = sh && shw.shb > 0 && (int)blockIdx.x >= shw.shb;                                          \
        const int rows = sh && shw.shb > 0 ? out / 2 : out;                                                      \
        const int e = sh ? 0 : min(max(topk[2 * p], 0), E - 1);                                                  \
        const u32* qw = sh ? (h ? shw.qw[1] : shw.qw[0]) : moe_w4_at(qw0, estride, e);                           \
        const unsigned short* sc = sh ? (h ? shw.sc[1] : shw.sc[0]) : moe_w4_at(sc0, estride, e);                \
        const unsigned char* z = sh ? (h ? shw.z[1] : shw.z[0]) : moe_w4_at(z0, estride, e);                     \
        w4p_body<bf16_t, ASYM, SBF, true, false>(qw, sc, z, xr, ldx, y + (long long)p * out + h * rows, out, 1,   \
                                                 rows, rows, in, wpt, blockIdx.x - h * shw.shb, w4_dyn, {});      \
    }
// moe_w4p_<s symmetric | a zero points><h f16 | b bf16 scales>.
MOE_W4P_KERNEL(moe_w4p_sh, false, false)
MOE_W4P_KERNEL(moe_w4p_sb, false, true)
MOE_W4P_KERNEL(moe_w4p_ah, true, false)
MOE_W4P_KERNEL(moe_w4p_ab, true, true)

extern "C" __global__ void __launch_bounds__(W4G_WARPS * 32, 3)
moe_w4g(const bf16_t* x, const int* __restrict__ offs, int E, const u32* __restrict__ qw0,
        const unsigned short* __restrict__ sc0, const unsigned char* __restrict__ z0, long long estride,
        int scale_bf16, bf16_t* y, int out, int in) {
    int e, row0;
    if (!moe_tile(offs, E, blockIdx.y, MOE_W4_TILE, e, row0)) return;
    const int rows = min(MOE_W4_TILE, offs[e + 1] - row0);
    w4g_body<MOE_W4_TILE / 8>(moe_w4_at(qw0, estride, e), moe_w4_at(sc0, estride, e), moe_w4_at(z0, estride, e),
                              scale_bf16, x + (long long)row0 * in, in, y + (long long)row0 * out, out, rows, out, in,
                              0, 1, 0, blockIdx.x, 0, 1);
}
