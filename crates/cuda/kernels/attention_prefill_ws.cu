// attention_prefill_ws.cu — attn_prefill_wg's work (attention_prefill_wg.cu: the same launch, tile table,
// key split, partials and wgmma tiles) over a bf16 cache, with warps specialised as Hopper's attention
// kernels run them (FlashAttention-3): a producer warpgroup and two consumer warpgroups, no block-wide
// barrier inside the key loop.
//
// attn_prefill_ws: 384 threads.
//  Producer (warpgroup 0, registers lowered to 24): one thread copies each 64-key K and V tile with the
//    tensor memory accelerator (cp.async.bulk.tensor, 2-D maps of the cache [rows, kv heads x HD], a
//    box of 64 dims x min(page, 64) rows landing in the 128-byte-swizzled layout wgmma reads), into
//    two stages of K and two of V, each with a full barrier (the copy's bytes) and an empty one (the
//    consumer warps' releases). Boxes whose keys all lie past the tile's end are not copied.
//  Consumers (warpgroups 1 and 2, registers raised to 240): 64 packed rows each, as
//    attn_prefill_wg's warpgroups. Each issues S_j = Q K_j^T and O += P_{j-1} V_{j-1} together and runs the softmax of S_j
//    while P_{j-1} V_{j-1} is still on the tensor cores, then rescales O (P of consecutive tiles in two
//    register arrays, so no product's operands are overwritten early); a K stage is released once its S
//    is done, a V stage once its P V is. The two warpgroups are not ordered against each other: one's
//    softmax runs beside the other's products.
//  Build switches (-D, for measuring): WS_OVERLAP=0 runs each tile's S, softmax and P V in turn;
//    WS_PINGPONG=1 makes the warpgroups take turns issuing their products (named barriers 4 and 5);
//    WS_V8_K_LATE=0 copies an fp8 cache's next K tile with V's codes at the start of a tile (thread 0 then
//    waits there for the K stage, and the producer's barrier with it: 0.86x at 128K keys on the H100).
// Quantised K and/or V (fp8, int8, int4; mixed): thread 0 copies a tile's codes (a 2-D map of the
//    cache's bytes, box rowb x rows) into one stage of codes; the whole producer warpgroup (registers
//    still 24) widens them into the bf16 stage's swizzled tile, writes the tile's f32 scales beside
//    it and publishes the stage; the consumers scale S's key columns by the K scales and fold the V
//    scales into P before its bf16 rounding, as attn_prefill_wg does.
// fp8 K and V (head dim 256): no codes are widened; both products run on e4m3 tensor cores
//    (attention_prefill_e4m3.cuh). The K map is the cache's bytes in 128-byte swizzled boxes (128 e4m3 a
//    row, as wgmma's 8-bit operands lie), copied straight into 16 KB K stages; S = Q K^T runs against Q
//    split once into two e4m3 halves whose sum is the bf16 Q exactly (ws_split_q). V's codes land the same
//    way in two codes stages (thread 0 copies tile j + 1's while tile j's are transposed); the producer
//    warpgroup transposes each into its V stage (ws_transpose_v: ldmatrix / byte permutes / stmatrix) and
//    P V runs against P split into e4m3 halves (ws_pack_p8), so S and O are what bf16 products over the
//    widened codes give, at the same tensor-core time. (fp8 K with another V: K as here, V widened.)
// V rows past the block's last key (a partial last tile: stale rows of its last page, or boxes not
// copied) are zeroed before P V (P is 0 there; 0 * a stale NaN is not): by each consumer warpgroup for
// a bf16 V, by the widening or the transposition for codes. K rows there only reach masked scores.
// Smem (ops/attention_tiling.rs ws_smem_bytes): 1 KB of alignment slack, Q 128 x HD x 2, 2 K stages and 2 V
// stages of 64 x HD x 2 (an fp8 K's: 64 x HD; an fp8 V's: its transposed tile, 17 KB, then its 2 codes
// stages of 64 x HD), 10 barriers in 128 bytes (193.1 KB at HD 256); with codes the scales (2 stages x
// 128 f32) and the codes' stage (64 rows of each widened matrix; none for fp8 / fp8: 164.1 KB).
// Launch: grid (Hkv, n_tiles, n_split) (attn_prefill_wg's with its first two dims swapped: every kv
// head's heaviest tiles start first), block 384; kmap / vmap encoded by the launcher for this layer's
// cache, boxes of `box_rows` rows (ops/attention_tiling.rs tma_box_rows: the page where it divides 64 keys,
// from 8; 64 where 64 divides the page). Hopper's default over a bf16 and an fp8 cache (AttnTiling::tma; over
// other quantised caches ops/attention_tiling.rs producer_copies keeps attn_prefill_wg, DELTASERVE_ATTN_PREFILL=ws
// runs this one).

#ifndef WS_OVERLAP
#define WS_OVERLAP 1
#endif
#ifndef WS_PINGPONG
#define WS_PINGPONG 0
#endif
#ifndef WS_V8_K_LATE
#define WS_V8_K_LATE 1
#endif
#define WS_NT 384
// Registers a thread after the warpgroups re-divide the block's: the launch gives 168 to each of the 384
// threads (__launch_bounds__(384, 1)), and a setmaxnreg.inc waits until the block has released enough
// with setmaxnreg.dec, so the producer's and the consumers' counts together must stay within the
// launch's (an increase past it waits on registers no warp releases: the block hangs once another block
// holds the SM's remaining registers). ptxas fits the producer's widening of codes in 24 without spills;
// 32 for it with 240 for the consumers hung the 27B's fp8-KV prefill on the H200.
#define WS_LAUNCH_REGS 168
#define WS_PRODUCER_REGS 24
#define WS_CONSUMER_REGS 240
static_assert(WS_PRODUCER_REGS * 128 + WS_CONSUMER_REGS * 256 <= WS_LAUNCH_REGS * WS_NT,
              "the warpgroups' registers exceed the launch's: setmaxnreg.inc would never return");
#define WS_STR2(x) #x
#define WS_STR(x) WS_STR2(x)
#define WS_MAT (WG_BK * HD * 2)
#define WS_KMAT (WG_BK * HD * (WS_K8 ? 1 : 2))  // a K stage's bytes
#define WS_VMAT (WS_V8 ? WS_VT_BYTES : WG_BK * HD * 2)  // a V stage's bytes
#define WS_KCODES (KQ_K && !WS_K8)            // K's codes widened through the codes' stage
#define WS_VCODES (KQ_V && !WS_V8)            // V's codes widened through the codes' stage
#define WS_VT_CODES (WS_V8 ? WG_BK * HD : 0)  // an fp8 V's codes stage (two, before the barriers)
#define WS_BAR_BYTES 128  // 10 barriers, padded

// A CUtensorMap (cuda.h): 128 opaque bytes, passed by value as a __grid_constant__ parameter.
struct __align__(64) TmaMap {
    unsigned long long v[16];
};

#if WG_BODY
__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Waits until the barrier's phase of parity `parity` has completed. A wait of 2^33 SM clocks (seconds;
// a tile takes microseconds) can only be a broken pipeline: it traps, so the launch fails with an error
// instead of hanging the GPU.
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    long long t0 = 0;
    for (int n = 0;; n++) {
        u32 done;
        asm volatile(
            "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
            : "=r"(done)
            : "r"(bar), "r"(parity)
            : "memory");
        if (done) return;
        if (n == 0)
            t0 = clock64();
        else if (clock64() - t0 > (1ll << 33))
            __trap();
    }
}
// One box of the map at (x, y) (elements, rows) to dst, its bytes counted on bar.
__device__ __forceinline__ void tma_load_2d(u32 dst, const TmaMap* map, int x, int y, u32 bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(
            dst),
        "l"((unsigned long long)map), "r"(x), "r"(y), "r"(bar)
        : "memory");
}
// Pins the compiler's view of registers an asynchronous wgmma wrote (after its wait).
template <int N>
__device__ __forceinline__ void reg_fence(float (&r)[N]) {
#pragma unroll
    for (int i = 0; i < N; i++) asm volatile("" : "+f"(r[i])::"memory");
}
template <int N>
__device__ __forceinline__ void reg_fence(u32 (&r)[N]) {
#pragma unroll
    for (int i = 0; i < N; i++) asm volatile("" : "+r"(r[i])::"memory");
}
#define WS_OUT32(d)                                                                                            \
    "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3]), "=f"(d[4]), "=f"(d[5]), "=f"(d[6]), "=f"(d[7]), "=f"(d[8]), \
        "=f"(d[9]), "=f"(d[10]), "=f"(d[11]), "=f"(d[12]), "=f"(d[13]), "=f"(d[14]), "=f"(d[15]), "=f"(d[16]),   \
        "=f"(d[17]), "=f"(d[18]), "=f"(d[19]), "=f"(d[20]), "=f"(d[21]), "=f"(d[22]), "=f"(d[23]), "=f"(d[24]), \
        "=f"(d[25]), "=f"(d[26]), "=f"(d[27]), "=f"(d[28]), "=f"(d[29]), "=f"(d[30]), "=f"(d[31])
// d (64 x 64, f32) = A (64 x 16) * B (16 x 64), both K-major in smem: d's old values are not read.
__device__ __forceinline__ void wg_mma_ss_first(float (&d)[32], unsigned long long da, unsigned long long db) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " WG_D32 ", %32, %33, 0, 1, 1, 0, 0;\n"
                 : WS_OUT32(d)
                 : "l"(da), "l"(db));
}
template <int N>
__device__ __forceinline__ void wg_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
#endif

#if WG_BODY && KQ_ANY
// The producer warpgroup over a cache with quantised K and/or V (128 threads). Per tile: thread 0 copies the codes
// to widen into the codes' one stage (counted on code_full) and a bf16 matrix's tile (or an fp8 K's codes) straight
// into its stage; every thread waits for the codes and the stage's release, widens the codes into the stage's
// swizzled bf16 tile (rows past kend as zeros) and writes the tile's f32 scales; after a barrier of the warpgroup
// thread 0 publishes the stage (an arrival on both its barriers, so a consumer that waited for either sees the
// scales) and copies the next tile's codes.
__device__ __forceinline__ void ws_produce_quantised(const TmaMap& kmap, const TmaMap& vmap,
                                                     const unsigned short* __restrict__ k_scales,
                                                     const unsigned short* __restrict__ v_scales,
                                                     const int* __restrict__ bt, int page, int box_rows, int Hkv,
                                                     int hkv, int kend, int jb, int je, u32 ks0, u32 vs0, u32 bars,
                                                     u32 codes, float* sc_f, int tid, const unsigned char* codes_p) {
    constexpr int NB = HD / 64, CH = HD / 8;
    auto full = [&](int m, int st) { return bars + 16 * m + 8 * st; };
    auto empty = [&](int m, int st) { return bars + 32 + 16 * m + 8 * st; };
    // The codes' barrier (an fp8 V's: one a stage of its two).
    auto code_full = [&](int st) { return bars + 64 + (WS_V8 ? 8 * st : 0); };
    const int pshift = (page & (page - 1)) == 0 ? __ffs(page) - 1 : -1;
    const int per_tile = WG_BK / box_rows;
    auto row_of = [&](int key) {
        const int pg = pshift >= 0 ? key >> pshift : key / page;
        return bt[pg] * page + (key - pg * page);
    };
    auto nbox_of = [&](int kb) { return min(per_tile, (kend - kb + box_rows - 1) / box_rows); };
    // nbox boxes of rows from key kb, each row nb boxes of 128 bytes (per_box of the map's columns apart), into
    // the swizzled 64-row tile at dst, counted on bar.
    auto copy_tile = [&](u32 dst, const TmaMap* map, int per_box, int nb, int kb, int nbox, u32 bar) {
        for (int rb = 0; rb < nbox; rb++) {
            const int row = row_of(kb + rb * box_rows);
            for (int b = 0; b < nb; b++)
                tma_load_2d(dst + (u32)(b * WG_BK * 128 + rb * box_rows * 128), map, hkv * HD + b * per_box, row, bar);
        }
    };
    // Thread 0: tile j's copies.
    // (An fp8 V: `codes_part` its codes, `tiles_part` the K tile; otherwise both at once.)
    auto issue = [&](int j, int it, bool codes_part, bool tiles_part) {
        const int st = it & 1, use = it >> 1, kb = j * WG_BK, nbox = nbox_of(kb);
        if (WS_V8 && codes_part) {
            // An fp8 V's codes into codes stage st, in 128-byte swizzled boxes (ws_transpose_v reads them so).
            mbar_expect_tx(code_full(st), (u32)(nbox * box_rows * HD));
            copy_tile(codes + st * WS_VT_CODES, &vmap, 128, HD / 128, kb, nbox, code_full(st));
        } else if (!WS_V8) {
            mbar_expect_tx(code_full(0), (u32)(nbox * box_rows * ((WS_KCODES ? K_ROWB : 0) + (KQ_V ? V_ROWB : 0))));
        }
        if (!tiles_part) return;
#pragma unroll
        for (int m = 0; m < 2; m++) {
            const bool quant = m == 0 ? WS_KCODES : WS_VCODES;
            const TmaMap* map = m == 0 ? &kmap : &vmap;
            if (m == 1 && WS_V8) continue;
            if (quant) {
                const int rowb = m == 0 ? K_ROWB : V_ROWB;
                const u32 dst = codes + (m == 0 ? 0 : (WS_KCODES ? WG_BK * K_ROWB : 0));
                for (int rb = 0; rb < nbox; rb++)
                    tma_load_2d(dst + (u32)(rb * box_rows * rowb), map, hkv * rowb, row_of(kb + rb * box_rows),
                                code_full(0));
            } else {
                // A bf16 matrix's tile or fp8 K's codes, copied straight into its stage (128-byte boxes:
                // 64 bf16 or 128 e4m3 a row).
                const bool k8 = m == 0 && WS_K8;
                const int nb = k8 ? HD / 128 : NB, per_box = k8 ? 128 : 64;
                if (use > 0) mbar_wait(empty(m, st), (use - 1) & 1);
                mbar_expect_tx(full(m, st), (u32)(nbox * box_rows * 128 * nb));
                copy_tile(m == 0 ? ks0 + st * WS_KMAT : vs0 + st * WS_VMAT, map, per_box, nb, kb, nbox, full(m, st));
            }
        }
    };
    if (tid == 0) issue(jb, 0, true, true);
    for (int j = jb, it = 0; j < je; j++, it++) {
        const int st = it & 1, use = it >> 1, kb = j * WG_BK;
        // An fp8 V's next codes go to the other codes stage (free: its transposition ended at the last
        // barrier) while this tile's are transposed; the next K tile (whose stage waits for the consumers'
        // S two tiles back) after this tile is published (WS_V8_K_LATE), so no producer thread waits on it here.
        if (WS_V8 && tid == 0 && j + 1 < je) issue(j + 1, it + 1, true, !WS_V8_K_LATE);
        float ksv = 0.0f, vsv = 0.0f;  // the scales of key kb + tid (tid < 64), loaded while the codes land
        if (tid < WG_BK && kb + tid < kend) {
            const long long at = (long long)row_of(kb + tid) * Hkv + hkv;
            if (KQ_K) ksv = f16_to_f32(k_scales[at]);
            if (KQ_V) vsv = f16_to_f32(v_scales[at]);
        }
        if (WS_V8)
            mbar_wait(code_full(st), use & 1);
        else
            mbar_wait(code_full(0), it & 1);
        if (use > 0) {
            // The stage's tiles and its scales (read until the consumers release V) are free.
            mbar_wait(empty(0, st), (use - 1) & 1);
            mbar_wait(empty(1, st), (use - 1) & 1);
        }
#pragma unroll
        for (int m = 0; m < 2; m++) {
            if (!(m == 0 ? WS_KCODES : WS_VCODES)) continue;
            const unsigned char* raw = codes_p + (m == 0 ? 0 : (WS_KCODES ? WG_BK * K_ROWB : 0));
            const u32 dst = m == 0 ? ks0 + st * WS_KMAT : vs0 + st * WS_VMAT;
            for (int c = tid; c < WG_BK * CH; c += 128) {
                const int r = c / CH, ch = c % CH;
                uint4 w = make_uint4(0, 0, 0, 0);
                if (kb + r < kend) w = m == 0 ? kv_widen8<KV_K_FMT>(raw, r, ch) : kv_widen8<KV_V_FMT>(raw, r, ch);
                asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(dst + wg_swz(r, ch, WG_BK)), "r"(w.x),
                             "r"(w.y), "r"(w.z), "r"(w.w)
                             : "memory");
            }
        }
#if WS_V8
        ws_transpose_v(codes + st * WS_VT_CODES, vs0 + st * WS_VMAT, kend - kb, tid);
#endif
        if (tid < WG_BK) {
            sc_f[st * 2 * WG_BK + tid] = ksv;
            sc_f[st * 2 * WG_BK + WG_BK + tid] = vsv;
        }
        fence_proxy_async();
        named_sync(6, 128);
        if (tid == 0) {
            mbar_arrive(full(0, st));
            mbar_arrive(full(1, st));
            if ((!WS_V8 || WS_V8_K_LATE) && j + 1 < je) issue(j + 1, it + 1, !WS_V8, true);
        }
    }
}
#endif

extern "C" __global__ void __launch_bounds__(WS_NT, 1)
attn_prefill_ws(const __grid_constant__ TmaMap kmap, const __grid_constant__ TmaMap vmap, const bf16_t* __restrict__ q,
                const unsigned short* __restrict__ k_scales, const unsigned short* __restrict__ v_scales,
                const int* __restrict__ block_tables, int max_blocks, const int* __restrict__ cu_seqlens,
                const int* __restrict__ seq_lens, const int* __restrict__ tile_table, bf16_t* __restrict__ o, int Hq,
                int Hkv, int page, int box_rows, float scale, long long q_tok, long long q_head, int n_split, int row0,
                float* __restrict__ part_o, float* __restrict__ part_ml) {
#if WG_BODY
    constexpr int NB = HD / 64;  // 64-dim column blocks
    constexpr int CH = HD / 8;   // 16-byte chunks per row
    extern __shared__ __align__(16) unsigned char ws_smem[];
    const u32 sbase = (smem_addr(ws_smem) + 1023u) & ~1023u;
    const int tid = threadIdx.x;
    const WideTile wt = wide_tile<WG_BK, true>(tile_table, cu_seqlens, seq_lens, n_split, part_o != nullptr);
    const int hkv = wt.hkv;
    const int first_q = wt.first_q, kend = wt.kend, jb = wt.jb, je = wt.je;
    if (jb >= je) {
        wide_mark_empty<WS_NT>(wt, part_ml, Hq, n_split, row0, tid);
        return;
    }
    const u32 ks0 = sbase + WG_Q_BYTES, vs0 = ks0 + 2 * WS_KMAT;
    // (An fp8 V: its two codes stages after the V stages.) Barriers: full K [2], full V [2], empty K [2],
    // empty V [2], the codes' stage (an fp8 V's two).
    const u32 bars = vs0 + 2 * WS_VMAT + 2 * WS_VT_CODES;
    auto full_k = [&](int st) { return bars + 8 * st; };
    auto full_v = [&](int st) { return bars + 16 + 8 * st; };
    auto empty_k = [&](int st) { return bars + 32 + 8 * st; };
    auto empty_v = [&](int st) { return bars + 48 + 8 * st; };
    const u32 code_full = bars + 64;
    if (tid == 0) {
        for (int st = 0; st < 2; st++) {
            // With codes, every stage is also published after its tile's widening and scales (a second
            // arrival on a bf16 matrix's barrier, beside its copy's), whichever barrier a consumer waits on.
            mbar_init(full_k(st), KQ_ANY && !WS_KCODES ? 2 : 1);
            mbar_init(full_v(st), KQ_ANY && !KQ_V ? 2 : 1);
            mbar_init(empty_k(st), 8);  // one release a consumer warp
            mbar_init(empty_v(st), 8);
        }
        mbar_init(code_full, 1);
        if (WS_V8) mbar_init(code_full + 8, 1);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

#if KQ_ANY
    // Quantised K and/or V: f32 tile scales [2 stages][K 64, V 64], then the codes' one stage (K codes,
    // V codes, 64 rows each as they lie in the cache; an fp8 V's two stages lie before the barriers).
    const u32 scs = bars + WS_BAR_BYTES;
    float* const sc_f = (float*)(ws_smem + (scs - smem_addr(ws_smem)));
    const u32 codes = WS_V8 ? vs0 + 2 * WS_VMAT : scs + 2 * 2 * WG_BK * 4;
    if (tid < 128) {
        // Producer warpgroup: thread 0 copies each tile's codes (and a bf16 matrix's tile) with the TMA;
        // all 128 threads widen the codes into the bf16 stage and write the tile's scales.
        asm volatile("setmaxnreg.dec.sync.aligned.u32 " WS_STR(WS_PRODUCER_REGS) ";\n" ::: "memory");
        ws_produce_quantised(kmap, vmap, k_scales, v_scales, block_tables + (long long)wt.s * max_blocks, page,
                             box_rows, Hkv, hkv, kend, jb, je, ks0, vs0, bars, codes, sc_f, tid,
                             ws_smem + (codes - smem_addr(ws_smem)));
        return;
    }
#else
    (void)code_full;
    if (tid < 128) {
        // Producer warpgroup: one thread issues every copy; the rest leave.
        asm volatile("setmaxnreg.dec.sync.aligned.u32 " WS_STR(WS_PRODUCER_REGS) ";\n" ::: "memory");
        if (tid != 0) return;
        const int* bt = block_tables + (long long)wt.s * max_blocks;
        const int pshift = (page & (page - 1)) == 0 ? __ffs(page) - 1 : -1;
        const int per_tile = WG_BK / box_rows;
        const u32 box_bytes = (u32)box_rows * 128;
        for (int j = jb, it = 0; j < je; j++, it++) {
            const int st = it & 1, use = it >> 1;
            const int kb = j * WG_BK;
            const int nbox = min(per_tile, (kend - kb + box_rows - 1) / box_rows);  // boxes with a key before kend
            // The boxes' cache rows (block-table reads) before the wait for the stage, not after it.
            int rows[WG_BK / 8];
#pragma unroll
            for (int rb = 0; rb < WG_BK / 8; rb++) {
                if (rb < nbox) {
                    const int key = kb + rb * box_rows;
                    const int pg = pshift >= 0 ? key >> pshift : key / page;
                    rows[rb] = bt[pg] * page + (key - pg * page);
                }
            }
            for (int m = 0; m < 2; m++) {
                const u32 full = m == 0 ? full_k(st) : full_v(st);
                if (use > 0) mbar_wait(m == 0 ? empty_k(st) : empty_v(st), (use - 1) & 1);
                mbar_expect_tx(full, (u32)nbox * box_bytes * NB);
                const u32 dst = (m == 0 ? ks0 : vs0) + st * WS_MAT;  // (bf16 K and V: WS_KMAT = WS_VMAT = WS_MAT)
                const TmaMap* map = m == 0 ? &kmap : &vmap;
#pragma unroll
                for (int rb = 0; rb < WG_BK / 8; rb++) {
                    if (rb >= nbox) break;
#pragma unroll
                    for (int b = 0; b < NB; b++)
                        tma_load_2d(dst + (u32)(b * WG_BK * 128 + rb * box_rows * 128), map, hkv * HD + b * 64, rows[rb],
                                    full);
                }
            }
        }
        return;
    }
#endif

    // Consumers.
    asm volatile("setmaxnreg.inc.sync.aligned.u32 " WS_STR(WS_CONSUMER_REGS) ";\n" ::: "memory");
    const int ct = tid - 128, cw = ct >> 7, warp = (ct >> 5) & 3, lane = ct & 31;
    const int g = lane >> 2, tg = lane & 3;
    wide_load_q<256>(q, wt, q_tok, q_head, ct, [&](int r, int ch) { return sbase + wg_swz(r, ch, WG_ROWS); });
    cp_async_commit();
    cp_async_wait<0>();
    fence_proxy_async();
    named_sync(1, 256);
#if WS_K8
    // Q as e4m3 halves for the fp8 products; this thread's rows' factors 2^-e (from the lanes that split
    // them: rows rown and rown + 8 are lanes 2g and 2g + 16's).
    const float rq_own = ws_split_q(sbase, ct);
    fence_proxy_async();
    named_sync(1, 256);
    const float rq0 = __shfl_sync(0xffffffffu, rq_own, 2 * g), rq1 = __shfl_sync(0xffffffffu, rq_own, 2 * g + 16);
#else
    const float rq0 = 1.0f, rq1 = 1.0f;
#endif

    const int rown = cw * 64 + warp * 16 + g;  // own rows of the block's 128: rown and rown + 8
    int qpos[2];
    float oacc[NB][32], mrow[2], lrow[2];
    wg_rows_init(wt, rown, qpos, oacc, mrow, lrow);
    const float sl2 = scale * 1.4426950408889634f;  // log2 domain
    int sb_run = 253;  // an fp8 V: O's unit c = 2^(sb_run - 127) (ws_pack_p8), none set yet
    (void)sb_run;
    const u32 q_wg = sbase + (u32)(cw * 64 * 128);  // this warpgroup's rows in each column block

    // S = Q K^T of stage st's K (issued, not waited).
    auto issue_s = [&](float (&sacc)[32], int st) {
        const u32 ks = ks0 + st * WS_KMAT;
        wg_fence();
#if WS_K8
        // Q_hi K^T + Q_lo K^T: 32 dims a k step, both halves into one accumulator.
#pragma unroll
        for (int k = 0; k < 2 * (HD / 32); k++) {
            const int kd = k % (HD / 32);
            const u32 qa = q_wg + (k >= HD / 32 ? (u32)(WG_ROWS * HD) : 0u);
            const unsigned long long da = wg_desc(qa + (u32)((kd >> 2) * WG_ROWS * 128 + (kd & 3) * 32), 16, 1024);
            const unsigned long long db = wg_desc(ks + (u32)((kd >> 2) * WG_BK * 128 + (kd & 3) * 32), 16, 1024);
            wg_mma_e4m3(sacc, da, db, k > 0);
        }
#else
#pragma unroll
        for (int k = 0; k < HD / 16; k++) {
            const unsigned long long da = wg_desc(q_wg + (u32)((k >> 2) * WG_ROWS * 128 + (k & 3) * 32), 16, 1024);
            const unsigned long long db = wg_desc(ks + (u32)((k >> 2) * WG_BK * 128 + (k & 3) * 32), 16, 1024);
            if (k == 0)
                wg_mma_ss_first(sacc, da, db);
            else
                wg_mma_ss(sacc, da, db, 1);
        }
#endif
        wg_commit();
        reg_fence(sacc);
    };
    // O += P V of stage st's V (issued, not waited); a partial last tile's V rows past kend zeroed first.
    auto issue_pv = [&](const u32 (&pa)[WG_BK / 16][4], int st, int kb, bool last) {
        const u32 vs = vs0 + st * WS_VMAT;
        // (Quantised V: the producer wrote those rows as zeros.)
        if (!KQ_V && last && kend - kb < WG_BK) {
            const int v0 = kend - kb;
            for (int c = ct & 127; c < (WG_BK - v0) * CH; c += 128) {
                const int r = v0 + c / CH, ch = c % CH;
                asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(vs + wg_swz(r, ch, WG_BK)), "r"(0)
                             : "memory");
            }
            fence_proxy_async();
            named_sync(2 + cw, 128);
        }
#pragma unroll
        for (int b = 0; b < NB; b++) reg_fence(oacc[b]);
#if WS_V8
        ws_issue_pv8(oacc, pa, vs);
#else
        wg_issue_pv(oacc, pa, vs);
#endif
#pragma unroll
        for (int b = 0; b < NB; b++) reg_fence(oacc[b]);
    };
    // The online softmax of tile kb in stage st (its scales, with codes): P to pa, O's factors to al.
    auto softmax = [&](float (&sacc)[32], int kb, int st, u32 (&pa)[WG_BK / 16][4], float (&al)[2]) {
#if KQ_ANY
        const float *sks = sc_f + st * 2 * WG_BK, *svs = sks + WG_BK;
#else
        const float *sks = nullptr, *svs = nullptr;
        (void)st;
#endif
        wg_softmax(sacc, sks, kb, first_q, qpos, tg, sl2, mrow, lrow, al, rq0, rq1);
#if WS_V8
        ws_pack_p8(sacc, svs, tg, sb_run, al, pa);
#else
        wg_pack_p(sacc, svs, tg, pa);
#endif
    };
    auto rescale = [&](const float (&al)[2]) { wg_rescale(oacc, al); };
    auto release = [&](u32 bar) {
        // Lane 0 of each warp, predicated (no branch inside a warpgroup's open products).
        asm volatile("{\n.reg .pred p;\nsetp.eq.u32 p, %1, 0;\n@p mbarrier.arrive.shared::cta.b64 _, [%0];\n}\n" ::"r"(bar),
                     "r"(lane)
                     : "memory");
    };

    float sacc[32];
    u32 pa[WG_BK / 16][4];
    float al[2];
#if WS_OVERLAP
    // Tile jb: S, softmax (O is still 0).
    mbar_wait(full_k(0), 0);
    issue_s(sacc, 0);
    wg_wait<0>();
    reg_fence(sacc);
    release(empty_k(0));
    softmax(sacc, jb * WG_BK, 0, pa, al);
#pragma unroll
    for (int kk = 0; kk < WG_BK / 16; kk++) reg_fence(pa[kk]);
#if WS_PINGPONG
    // The warpgroups take turns on the tensor cores: one issues its S and P V while the other runs
    // its softmax (barrier 4 + w: warpgroup w's turn). Warpgroup 0 goes first.
    if (cw == 1) named_arrive(4, 256);
#endif
    // Tile j (after the first): S_j and P_{j-1} V_{j-1} issued together, the softmax of S_j while the
    // product runs. P_{j-1} (pin) and P_j (pout) live in two arrays the loop alternates, so P_j is never
    // written to registers an issued product still reads (NVRTC 13.0's ptxas serialises the products
    // when a copy between them lets that happen).
    auto step = [&](int j, int it, const u32 (&pin)[WG_BK / 16][4], u32 (&pout)[WG_BK / 16][4]) {
        const int st = it & 1, pst = st ^ 1;
        mbar_wait(full_k(st), (it >> 1) & 1);
        mbar_wait(full_v(pst), ((it - 1) >> 1) & 1);
#if WS_PINGPONG
        named_sync(4 + cw, 256);
#endif
        issue_s(sacc, st);
        issue_pv(pin, pst, (j - 1) * WG_BK, false);
#if WS_PINGPONG
        named_arrive(4 + (cw ^ 1), 256);
#endif
        wg_wait<1>();  // S_j done; P_{j-1} V_{j-1} may still run
        release(empty_k(st));
        softmax(sacc, j * WG_BK, st, pout, al);
        wg_wait<0>();
        release(empty_v(pst));
        rescale(al);
    };
    u32 pb[WG_BK / 16][4];
    bool last_in_pb = false;
    for (int j = jb + 1, it = 1; j < je; j += 2, it += 2) {
        step(j, it, pa, pb);
        if (j + 1 < je)
            step(j + 1, it + 1, pb, pa);
        else
            last_in_pb = true;
    }
    if (last_in_pb) {
#pragma unroll
        for (int kk = 0; kk < WG_BK / 16; kk++)
#pragma unroll
            for (int i = 0; i < 4; i++) pa[kk][i] = pb[kk][i];
    }
#if WS_PINGPONG
    if (cw == 0) named_sync(4, 256);  // warpgroup 1's last turn handed back: every arrival met
#endif
    {
        const int it = je - 1 - jb, st = it & 1;
        mbar_wait(full_v(st), (it >> 1) & 1);
        issue_pv(pa, st, (je - 1) * WG_BK, true);
        wg_wait<0>();
#pragma unroll
        for (int b = 0; b < NB; b++) reg_fence(oacc[b]);
        release(empty_v(st));
    }
#else
    for (int j = jb, it = 0; j < je; j++, it++) {
        const int st = it & 1, par = (it >> 1) & 1;
        mbar_wait(full_k(st), par);
        issue_s(sacc, st);
        wg_wait<0>();
        reg_fence(sacc);
        release(empty_k(st));
        softmax(sacc, j * WG_BK, st, pa, al);
        rescale(al);
        mbar_wait(full_v(st), par);
        issue_pv(pa, st, j * WG_BK, true);
        wg_wait<0>();
#pragma unroll
        for (int b = 0; b < NB; b++) reg_fence(oacc[b]);
        release(empty_v(st));
    }
#endif

    // (An fp8 V: O in units of c = 2^(sb_run - 127).)
    wg_store_rows(oacc, mrow, lrow, wt, rown, tg, o, Hq, n_split, row0, part_o, part_ml,
                  WS_V8 ? __uint_as_float((u32)(254 - sb_run) << 23) : 1.0f);
#else
    (void)kmap, (void)vmap, (void)q, (void)k_scales, (void)v_scales, (void)block_tables, (void)max_blocks;
    (void)cu_seqlens, (void)seq_lens, (void)tile_table, (void)o, (void)Hq, (void)Hkv, (void)page, (void)box_rows;
    (void)scale, (void)q_tok, (void)q_head;
    (void)n_split, (void)row0, (void)part_o, (void)part_ml;
    __trap();
#endif
}
