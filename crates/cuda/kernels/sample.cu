// sample.cu — token selection on the device for sampling rows: the penalties, then the greedy pick or a
// draw with temperature, top-k, top-p and min-p, from one uniform number per row drawn by the engine.
// The rule is the host reference's (crates/backend/src/sampling.rs, `RowSampling::pick`); the sums here
// run in another (fixed) order, so a draw within rounding of a boundary may pick the neighbour.
//
// Computes, per row r (logits x[r, ..valid], f32, row stride ld; s = x / temperature, w = exp(s − max)):
//   mode 0 (greedy): the argmax of x (lowest index on ties; the host's NaN rule);
//   mode 1 (plain draw, no cut): the first id, in id order, where the running sum of w exceeds u·Σ w;
//   mode 2 (cut): the candidates — ordered by s descending, ties by lower id — cut to the top-k, the
//          top-p prefix (of the top-k mass) and the min-p floor; the draw walks them in that order.
// How (mode 2): sample_stats takes per-block maxima, minima and sums; sample_hist bins every id by its
// distance from the row's maximum (2048 bins over min(max − min, 32) units of s, the last bin holds the
// rest) with counts and fixed-point masses (w·2^40, integer atomics: deterministic). With top-k,
// sample_gather copies the ids of the bins up to the k-th's as sortable 64-bit keys and sample_pick sorts
// them (bitonic, shared memory) and cuts and draws in f32 as the host does. Without top-k, only two bins
// are ever sorted: the one where the top-p prefix ends (the bins before it count whole) and the one
// where the draw lands (round 2 of gather and pick when it is another bin); min-p's floor is a
// threshold, counted while gathering. A row whose bin or candidates exceed the buffer gets token −1 and
// flag 1: the host picks it from the (penalised) logits.
// Penalties: sample_penalize_bits (the repetition penalty's ids as a bitmap), then sample_penalize (entries).
// Token masks (structured outputs): sample_mask_bits, before the penalties, sets the logits of the ids a
// masked row's bitmap does not allow (bit clear) to −inf; such ids get no mass and sort last.
// Shapes/dtypes: params [R] SampleParams; partials [R, B] float4 (max, sum, argmax id, min); hist_count
// [R, bins] u32, hist_mass [R, bins] u64, cand_count [R] u32 and state [R] SampleState (zeroed before
// sample_hist); cand [R, cap] u64; out [R] int2 (token, flag). Penalties: int4 (row, id, bits of the
// repetition factor, bits of the subtrahend).
// Launch: sample_penalize grid (⌈n/256⌉), block 256; sample_penalize_bits grid (⌈words/256⌉, R);
// sample_mask_bits grid (⌈valid/256⌉, R), block 256; stats / hist / gather grid (B, R), block 256
// (hist: dynamic shared memory bins·12 B); pick grid (R), block 1024, dynamic shared memory cap·8 B.
// Gather and pick run with round 1, then (rows without top-k) round 2.
// Arch: plain loads, shuffles, shared and global 32/64-bit integer atomics: sm_80+.
// Tested by: tests/ops/ case "sample"; tests/backend.rs `sample_step_matches_the_host_rule`.

struct SampleParams {
    float inv_t;
    int top_k;  // 0: no top-k cut
    float top_p;
    float min_p;
    float uniform;
    int mode;
    float rep;  // the repetition penalty of the ids in the row's bitmap (1: none)
    int masked;  // 1: the row's token bitmap (sample_mask_bits) says which ids it may pick
};

// Per row, zeroed each step: the min-p floor's count and mass (round 1's gather), and where round 2
// finds the draw (the bin, the mass to walk into it).
struct SampleState {
    int need;
    int bin;
    unsigned long long rest;
    unsigned cnt_m;
    unsigned pad;
    unsigned long long mass_m;
};

#define SAMPLE_RANGE 32.0f                   // units of s the bins span at most
#define SAMPLE_FIXED 1099511627776.0f        // 2^40: fixed-point scale of w ≤ 1

// x < y in the candidate order of an ascending sort: larger s first, then the lower id.
__device__ __forceinline__ unsigned long long sample_key(float s, int id) {
    unsigned u = __float_as_uint(s);
    unsigned ord = (u & 0x80000000u) ? ~u : (u | 0x80000000u);  // ascending with s
    return ((unsigned long long)(~ord) << 32) | (unsigned)id;
}
__device__ __forceinline__ float sample_key_s(unsigned long long k) {
    const unsigned ord = ~(unsigned)(k >> 32);
    return __uint_as_float((ord & 0x80000000u) ? (ord & 0x7fffffffu) : ~ord);
}

__device__ __forceinline__ float sample_s(float x, const SampleParams& p) { return p.mode == 0 ? x : x * p.inv_t; }

// w·2^40 (0 where w is not a positive number: an infinite logit makes s − max NaN).
__device__ __forceinline__ unsigned long long sample_fixed(float s, float smax) {
    const float w = expf(s - smax);
    return w > 0.0f ? __float2ull_rz(w * SAMPLE_FIXED) : 0ull;
}

// The block's range of ids of block b of B over `valid` ids.
__device__ __forceinline__ void sample_range(int b, int B, int valid, int& lo, int& hi) {
    const int chunk = (valid + B - 1) / B;
    lo = min(b * chunk, valid);
    hi = min(lo + chunk, valid);
}

// A row's statistics from its blocks' partials (reduced in block order: every kernel gets the same).
struct SampleRow {
    float smax, z, scale;  // scale: bins per unit of s
};

__device__ __forceinline__ SampleRow sample_row_of(const float4* part, int B, int bins) {
    SampleRow R;
    float smin = __int_as_float(0x7f800000);
    R.smax = -__int_as_float(0x7f800000);
    for (int b = 0; b < B; ++b) {
        R.smax = fmaxf(R.smax, part[b].x);
        smin = fminf(smin, part[b].w);
    }
    R.z = 0.0f;
    for (int b = 0; b < B; ++b)
        if (part[b].y > 0.0f) R.z += part[b].y * expf(part[b].x - R.smax);
    const float range = fminf(R.smax - smin, SAMPLE_RANGE);
    R.scale = range > 0.0f ? (float)(bins - 1) / range : 0.0f;
    return R;
}

// sample_row_of in every thread of the block.
__device__ SampleRow sample_block_row(const float4* part, int B, int bins) {
    __shared__ SampleRow s_row;
    if (threadIdx.x == 0) s_row = sample_row_of(part, B, bins);
    __syncthreads();
    const SampleRow R = s_row;
    __syncthreads();
    return R;
}

__device__ __forceinline__ int sample_bin(float s, const SampleRow& R, int bins) {
    const float d = (R.smax - s) * R.scale;
    return d < (float)(bins - 1) ? (int)d : bins - 1;
}

extern "C" __global__ void sample_penalize(float* x, long long ld, const int4* __restrict__ pen, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const int4 p = pen[i];
    float* l = x + (long long)p.x * ld + p.y;
    const float rp = __int_as_float(p.z), sub = __int_as_float(p.w);
    float v = *l;
    if (rp != 1.0f) v = v > 0.0f ? v / rp : v * rp;
    *l = v - sub;
}

// The repetition penalty of row r over the ids whose bit is set in its bitmap (bits [R, words] u32):
// a positive logit is divided by the factor, a negative one multiplied. Grid (any, R), block 256.
extern "C" __global__ void sample_penalize_bits(float* x, long long ld, int valid, const SampleParams* params,
                                                const unsigned* __restrict__ bits, int words) {
    const int r = blockIdx.y;
    const float rp = params[r].rep;
    if (rp == 1.0f) return;
    float* row = x + (long long)r * ld;
    for (int w = blockIdx.x * blockDim.x + threadIdx.x; w < words; w += gridDim.x * blockDim.x) {
        unsigned m = bits[(long long)r * words + w];
        while (m) {
            const int id = w * 32 + __ffs(m) - 1;
            m &= m - 1;
            if (id >= valid) break;
            const float v = row[id];
            row[id] = v > 0.0f ? v / rp : v * rp;
        }
    }
}

// The token mask of row r when it is masked: every id < valid whose bit is clear in the row's bitmap
// (bits [R, words] u32, bit id % 32 of word id / 32 set = allowed) gets logit −inf. One thread an id
// (coalesced writes). Grid (any, R), block 256.
extern "C" __global__ void sample_mask_bits(float* x, long long ld, int valid, const SampleParams* params,
                                            const unsigned* __restrict__ bits, int words) {
    const int r = blockIdx.y;
    if (params[r].masked == 0) return;
    float* row = x + (long long)r * ld;
    const unsigned* mask = bits + (long long)r * words;
    const int n = min(valid, words * 32);
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < valid; i += gridDim.x * blockDim.x) {
        const bool allowed = i < n && ((mask[i >> 5] >> (i & 31)) & 1u);
        if (!allowed) row[i] = -__int_as_float(0x7f800000);
    }
}

// partials[r, b] = (max of s, Σ exp(s − that max), the greedy best id of the block, min of s).
extern "C" __global__ void sample_stats(const float* x, long long ld, int valid, const SampleParams* params,
                                        float4* partials) {
    const int r = blockIdx.y, B = gridDim.x;
    const SampleParams p = params[r];
    const float* row = x + (long long)r * ld;
    int lo, hi;
    sample_range(blockIdx.x, B, valid, lo, hi);
    float m = -__int_as_float(0x7f800000), mn = __int_as_float(0x7f800000), bv = __int_as_float(0x7fc00000);
    int bi = 0x7fffffff;
    for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        const float s = sample_s(row[i], p);
        if (s == s) {
            m = fmaxf(m, s);
            mn = fminf(mn, s);
        }
        if (am_better(s, i, bv, bi)) {
            bv = s;
            bi = i;
        }
    }
    __shared__ float sm[32], smn[32], sv[32];
    __shared__ int si[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    m = warp_max(m);
    mn = -warp_max(-mn);
    am_warp_best(bv, bi);
    if (lane == 0) {
        sm[warp] = m;
        smn[warp] = mn;
        sv[warp] = bv;
        si[warp] = bi;
    }
    __syncthreads();
    if (warp == 0) {
        m = lane < nw ? sm[lane] : -__int_as_float(0x7f800000);
        mn = lane < nw ? smn[lane] : __int_as_float(0x7f800000);
        bv = lane < nw ? sv[lane] : __int_as_float(0x7fc00000);
        bi = lane < nw ? si[lane] : 0x7fffffff;
        m = warp_max(m);
        mn = -warp_max(-mn);
        am_warp_best(bv, bi);
        if (lane == 0) {
            sm[0] = m;
            smn[0] = mn;
        }
    }
    __syncthreads();
    m = sm[0];
    mn = smn[0];
    float z = 0.0f;
    if (p.mode != 0 && m > -__int_as_float(0x7f800000))
        for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) {
            const float s = sample_s(row[i], p);
            const float w = expf(s - m);
            if (w > 0.0f) z += w;  // not NaN (an infinite logit)
        }
    __shared__ float red[32];
    z = block_sum(z, red);
    if (threadIdx.x == 0) partials[(long long)r * B + blockIdx.x] = make_float4(m, z, __int_as_float(bi), mn);
}

// Mode-2 rows: counts and fixed-point masses of ids per bin of distance from the row's maximum.
extern "C" __global__ void sample_hist(const float* x, long long ld, int valid, const SampleParams* params,
                                       const float4* partials, int bins, unsigned* hist_count,
                                       unsigned long long* hist_mass) {
    const int r = blockIdx.y, B = gridDim.x;
    const SampleParams p = params[r];
    if (p.mode != 2) return;
    extern __shared__ unsigned long long sh_mass[];
    unsigned* sh_count = reinterpret_cast<unsigned*>(sh_mass + bins);
    for (int i = threadIdx.x; i < bins; i += blockDim.x) {
        sh_mass[i] = 0ull;
        sh_count[i] = 0u;
    }
    const SampleRow R = sample_block_row(partials + (long long)r * B, B, bins);
    const float* row = x + (long long)r * ld;
    int lo, hi;
    sample_range(blockIdx.x, B, valid, lo, hi);
    for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        const float s = sample_s(row[i], p);
        if (s != s) continue;
        const int b = sample_bin(s, R, bins);
        atomicAdd(&sh_count[b], 1u);
        const unsigned long long m = sample_fixed(s, R.smax);
        if (m) atomicAdd(&sh_mass[b], m);
    }
    __syncthreads();
    for (int i = threadIdx.x; i < bins; i += blockDim.x) {
        if (sh_count[i]) atomicAdd(&hist_count[(long long)r * bins + i], sh_count[i]);
        if (sh_mass[i]) atomicAdd(&hist_mass[(long long)r * bins + i], sh_mass[i]);
    }
}

// A bin found by a running count or mass, and the count and mass of the bins before it.
struct SampleBin {
    int bin;
    unsigned count_before, count_at;
    unsigned long long mass_before, mass_at;
};

// The first bin b <= last whose running count (bins 0..b) reaches kc or running mass reaches km, else
// `last`. Block-wide (every thread gets it; blockDim <= 1024, a multiple of 32): each thread sums a run of
// bins; warp 0 scans the runs 32 at a time to the run that holds the answer, then walks its bins.
__device__ SampleBin sample_find_bin(const unsigned* cnt, const unsigned long long* mass, int bins, int last,
                                     unsigned kc, unsigned long long km) {
    __shared__ unsigned run_c[1024];
    __shared__ unsigned long long run_m[1024];
    __shared__ SampleBin s_res;
    const int per = (bins + blockDim.x - 1) / blockDim.x;
    const int b0 = min((int)threadIdx.x * per, bins), b1 = min(b0 + per, bins);
    unsigned c = 0;
    unsigned long long m = 0;
    for (int b = b0; b < b1; ++b) {
        c += cnt[b];
        m += mass[b];
    }
    run_c[threadIdx.x] = c;
    run_m[threadIdx.x] = m;
    __syncthreads();
    if (threadIdx.x < 32) {
        const int lane = threadIdx.x;
        unsigned cc = 0;  // before the current chunk of 32 runs
        unsigned long long cm = 0;
        int run = -1;
        for (int base = 0; base < (int)blockDim.x && run < 0; base += 32) {
            const int t = base + lane;
            const int tb0 = min(t * per, bins), tb1 = min(tb0 + per, bins);
            unsigned ic = run_c[t];
            unsigned long long im = run_m[t];
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const unsigned xc = __shfl_up_sync(0xffffffffu, ic, o);
                const unsigned long long xm = __shfl_up_sync(0xffffffffu, im, o);
                if (lane >= o) {
                    ic += xc;
                    im += xm;
                }
            }
            const bool hit = tb1 - 1 >= last || cc + ic >= kc || cm + im >= km;
            const unsigned hits = __ballot_sync(0xffffffffu, hit);
            if (hits) {
                run = base + __ffs(hits) - 1;
                // The exclusive prefix at that run.
                const unsigned ec = __shfl_sync(0xffffffffu, ic - run_c[t], run - base);
                const unsigned long long em = __shfl_sync(0xffffffffu, im - run_m[t], run - base);
                cc += ec;
                cm += em;
            } else {
                cc += __shfl_sync(0xffffffffu, ic, 31);
                cm += __shfl_sync(0xffffffffu, im, 31);
            }
        }
        if (lane == 0) {
            int found = last;
            const int tb0 = min(run * per, bins), tb1 = min(tb0 + per, bins);
            for (int b = tb0; b < tb1; ++b) {
                if (b == last || cc + cnt[b] >= kc || cm + mass[b] >= km) {
                    found = b;
                    break;
                }
                cc += cnt[b];
                cm += mass[b];
            }
            s_res.bin = found;
            s_res.count_before = cc;
            s_res.mass_before = cm;
            s_res.count_at = cnt[found];
            s_res.mass_at = mass[found];
        }
    }
    __syncthreads();
    const SampleBin res = s_res;
    __syncthreads();
    return res;
}

// Which bins a mode-2 row gathers in round 1, from its histogram (every block computes the same).
struct SampleCut {
    bool nucleus;  // no top-k: the top-p / min-p path
    bool fits;     // the gathered ids fit the candidates
    int lo, hi;    // bins to gather (lo = -1: none)
    unsigned count_before;
    unsigned long long mass_before, target, total;
};

__device__ SampleCut sample_plan(const SampleParams& p, const SampleRow& R, const unsigned* cnt,
                                 const unsigned long long* mass, int bins, int cap) {
    SampleCut c;
    const float dm = p.min_p > 0.0f ? -logf(p.min_p) * R.scale : 0.0f;
    const int last_m = p.min_p > 0.0f ? (dm < (float)(bins - 1) ? (int)dm : bins - 1) : bins - 1;
    c.nucleus = p.top_k == 0;
    c.count_before = 0;
    c.mass_before = 0;
    c.target = 0;
    c.total = 0;
    if (!c.nucleus) {
        // The bins up to the k-th id's (with top-p, all of the top-k: its mass normalises top-p).
        const SampleBin k = sample_find_bin(cnt, mass, bins, bins - 1, (unsigned)p.top_k, ~0ull);
        const int cut = p.top_p < 1.0f ? k.bin : min(k.bin, last_m);
        const SampleBin up = sample_find_bin(cnt, mass, bins, cut, 0xffffffffu, ~0ull);
        c.lo = 0;
        c.hi = cut;
        c.fits = up.count_before + up.count_at <= (unsigned)cap;
        return c;
    }
    const SampleBin all = sample_find_bin(cnt, mass, bins, bins - 1, 0xffffffffu, ~0ull);
    c.total = all.mass_before + all.mass_at;
    c.lo = c.hi = -1;
    c.fits = true;
    if (p.top_p < 1.0f) {
        unsigned long long t = (unsigned long long)((double)p.top_p * (double)c.total);
        c.target = t > 0 ? t : 1;
        const SampleBin b = sample_find_bin(cnt, mass, bins, bins - 1, 0xffffffffu, c.target);
        c.lo = c.hi = b.bin;
        c.count_before = b.count_before;
        c.mass_before = b.mass_before;
        c.fits = b.count_at <= (unsigned)cap;
    }
    return c;
}

// Round 1: each mode-2 row's planned bins (and without top-k the min-p floor's count and mass); round 2:
// the bin where a row's draw lands.
extern "C" __global__ void sample_gather(const float* x, long long ld, int valid, const SampleParams* params,
                                         const float4* partials, int bins, const unsigned* hist_count,
                                         const unsigned long long* hist_mass, int cap, unsigned long long* cand,
                                         unsigned* cand_count, SampleState* state, int round) {
    const int r = blockIdx.y, B = gridDim.x;
    const SampleParams p = params[r];
    if (p.mode != 2) return;
    const unsigned* cnt = hist_count + (long long)r * bins;
    const unsigned long long* mass = hist_mass + (long long)r * bins;
    int lo_bin, hi_bin;
    bool floor_count = false;
    if (round == 2 && !state[r].need) return;
    const SampleRow R = sample_block_row(partials + (long long)r * B, B, bins);
    if (round == 2) {
        lo_bin = hi_bin = state[r].bin;
        if (cnt[lo_bin] > (unsigned)cap) return;  // too many: pick flags the row for the host
    } else {
        const SampleCut c = sample_plan(p, R, cnt, mass, bins, cap);
        lo_bin = c.fits ? c.lo : -1;  // too many: gather nothing, pick flags the row for the host
        hi_bin = c.fits ? c.hi : -1;
        floor_count = c.nucleus && p.min_p > 0.0f;
        if (lo_bin < 0 && !floor_count) return;
    }
    const float* row = x + (long long)r * ld;
    int lo, hi;
    sample_range(blockIdx.x, B, valid, lo, hi);
    unsigned fc = 0;
    unsigned long long fm = 0;
    for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        const float s = sample_s(row[i], p);
        if (s != s) continue;
        if (floor_count && expf(s - R.smax) >= p.min_p) {
            ++fc;
            fm += sample_fixed(s, R.smax);
        }
        const int b = sample_bin(s, R, bins);
        if (b < lo_bin || b > hi_bin) continue;
        const unsigned at = atomicAdd(&cand_count[r], 1u);
        if (at < (unsigned)cap) cand[(long long)r * cap + at] = sample_key(s, i);
    }
    if (floor_count) {
        for (int o = 16; o > 0; o >>= 1) {
            fc += __shfl_xor_sync(0xffffffffu, fc, o);
            fm += __shfl_xor_sync(0xffffffffu, fm, o);
        }
        if ((threadIdx.x & 31) == 0 && fc) {
            atomicAdd(&state[r].cnt_m, fc);
            atomicAdd(&state[r].mass_m, fm);
        }
    }
}

// The first i < n whose running sum of load(i) reaches `target` (> target when `strict`, else >=), or
// −1; `total` gets the sum of all n. Warp-wide (one warp; every lane gets the same answer). T: float
// (probabilities) or unsigned long long (fixed-point masses).
template <typename T, typename Load>
__device__ int sample_first_reaching(int n, Load load, T target, bool strict, T& total) {
    const int lane = threadIdx.x & 31;
    T carry = 0;
    int found = -1;
    for (int base = 0; base < n; base += 32) {
        const int i = base + lane;
        T incl = i < n ? load(i) : T(0);
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const T t = __shfl_up_sync(0xffffffffu, incl, o);
            if (lane >= o) incl += t;
        }
        incl += carry;
        const unsigned hit = __ballot_sync(0xffffffffu, i < n && (strict ? incl > target : incl >= target));
        if (hit && found < 0) found = base + __ffs(hit) - 1;
        carry = __shfl_sync(0xffffffffu, incl, 31);
    }
    total = carry;
    return found;
}

// Loads n candidates into shared memory and sorts them ascending (the candidate order), bitonic over the
// next power of two (padding sorts last). Block-wide.
__device__ void sample_sort(const unsigned long long* src, int n, unsigned long long* keys) {
    int n2 = 1;
    while (n2 < n) n2 <<= 1;
    for (int i = threadIdx.x; i < n2; i += blockDim.x) keys[i] = i < n ? src[i] : ~0ull;
    __syncthreads();
    for (int k = 2; k <= n2; k <<= 1) {
        for (int j = k >> 1; j > 0; j >>= 1) {
            for (int i = threadIdx.x; i < n2; i += blockDim.x) {
                const int l = i ^ j;
                if (l > i) {
                    const unsigned long long a = keys[i], b = keys[l];
                    const bool up = (i & k) == 0;
                    if ((a > b) == up) {
                        keys[i] = b;
                        keys[l] = a;
                    }
                }
            }
            __syncthreads();
        }
    }
}

// sample_first_reaching over the fixed-point masses of sorted keys.
__device__ int sample_first_fixed(const unsigned long long* keys, int n, float smax, unsigned long long target,
                                  bool strict, unsigned long long& total) {
    return sample_first_reaching<unsigned long long>(
        n, [&](int i) { return sample_fixed(sample_key_s(keys[i]), smax); }, target, strict, total);
}

// Warp 0: the sorted candidate where `rest` (fixed-point mass into these candidates) lands.
__device__ void sample_walk(const unsigned long long* keys, int n, float smax, unsigned long long rest, int r,
                            int2* out) {
    unsigned long long t;
    int at = sample_first_fixed(keys, n, smax, rest, true, t);
    if (at < 0) at = n - 1;  // rounding leftovers: the last candidate
    if (threadIdx.x == 0) out[r] = make_int2((int)(unsigned)(keys[at] & 0xffffffffull), 0);
}

// Mode 2 with top-k: the sorted candidates hold the whole top-k set; cut and draw in f32 as the host does.
__device__ void sample_pick_top_k(const SampleParams& p, unsigned long long* keys, int n, int r, int2* out) {
    // Probabilities in candidate order, written over the keys' high words (ids stay in the low words):
    // softmax over the top-k (its own sum).
    const int kk = min(p.top_k, n);
    const float s0 = sample_key_s(keys[0]);
    float* w = reinterpret_cast<float*>(keys) + 1;  // the high word of entry i is w[2i]
    __syncthreads();
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const float s = sample_key_s(keys[i]);
        w[2 * i] = i < kk ? expf(s - s0) : 0.0f;
    }
    __syncthreads();
    if (threadIdx.x >= 32) return;
    const auto prob = [&](int i) { return w[2 * i]; };
    float sum_k;
    sample_first_reaching<float>(kk, prob, __int_as_float(0x7f800000), false, sum_k);
    for (int i = threadIdx.x; i < kk; i += 32) w[2 * i] /= sum_k;
    __syncwarp();
    int keep = kk;
    float t;
    if (p.top_p < 1.0f) {
        const int at = sample_first_reaching<float>(kk, prob, p.top_p, false, t);
        if (at >= 0) keep = at + 1;
    }
    if (p.min_p > 0.0f) {
        const float floor = p.min_p * w[0];
        // The first candidate below the floor (probabilities fall along the order); at least one.
        int below = keep;
        for (int base = 0; base < keep; base += 32) {
            const int i = base + threadIdx.x;
            const unsigned m = __ballot_sync(0xffffffffu, i < keep && w[2 * i] < floor);
            if (m) {
                below = base + __ffs(m) - 1;
                break;
            }
        }
        keep = max(below, 1);
    }
    float total;
    sample_first_reaching<float>(keep, prob, __int_as_float(0x7f800000), false, total);
    int at = sample_first_reaching<float>(keep, prob, p.uniform * total, true, t);
    if (at < 0) {
        at = 0;  // rounding leftovers: the last positive candidate
        for (int i = keep - 1; i > 0; --i)
            if (w[2 * i] > 0.0f) {
                at = i;
                break;
            }
    }
    if (threadIdx.x == 0) out[r] = make_int2((int)(unsigned)(keys[at] & 0xffffffffull), 0);
}

// Round 2 of a row without top-k: sort the bin where the draw landed and walk into it.
__device__ void sample_pick_rest(const float4* part, int B, int bins, int cap, const unsigned long long* cand,
                                 const unsigned* cand_count, const SampleState* state, int2* out) {
    const int r = blockIdx.x;
    const SampleRow R = sample_block_row(part, B, bins);
    const unsigned n = cand_count[r];
    if (n == 0 || n > (unsigned)cap) {
        if (threadIdx.x == 0) out[r] = make_int2(-1, 1);
        return;
    }
    extern __shared__ unsigned long long keys[];
    sample_sort(cand + (long long)r * cap, (int)n, keys);
    if (threadIdx.x < 32) sample_walk(keys, (int)n, R.smax, state[r].rest, r, out);
}

extern "C" __global__ void sample_pick(const float* x, long long ld, int valid, const SampleParams* params,
                                       const float4* partials, int B, int bins, const unsigned* hist_count,
                                       const unsigned long long* hist_mass, int cap, unsigned long long* cand,
                                       unsigned* cand_count, SampleState* state, int round, int2* out) {
    const int r = blockIdx.x;
    const SampleParams p = params[r];
    const float4* part = partials + (long long)r * B;
    const float* row = x + (long long)r * ld;
    if (round == 2) {
        if (p.mode == 2 && state[r].need) sample_pick_rest(part, B, bins, cap, cand, cand_count, state, out);
        return;
    }
    __shared__ int s_tok, s_last;
    __shared__ float sh[33];
    if (threadIdx.x == 0) {
        s_tok = 0x7fffffff;
        s_last = -1;
    }
    const SampleRow R = sample_block_row(part, B, bins);
    const float smax = R.smax, z = R.z;
    if (p.mode == 0) {
        if (threadIdx.x == 0) {
            float bv = __int_as_float(0x7fc00000);
            int bi = 0x7fffffff;
            for (int b = 0; b < B; ++b) {
                const int i = __float_as_int(part[b].z);
                if (i < valid && am_better(row[i], i, bv, bi)) {
                    bv = row[i];
                    bi = i;
                }
            }
            const float x0 = row[0];
            out[r] = make_int2((x0 != x0 || bv != bv) ? 0 : bi, 0);
        }
        return;
    }
    if (p.mode == 1) {
        // Which block's range holds the draw (block order = id order), then where in it.
        __shared__ int s_b;
        __shared__ float s_rest;
        if (threadIdx.x == 0) {
            float rest = p.uniform * z;
            int at = -1, last = -1;
            float last_w = 0.0f;
            for (int b = 0; b < B; ++b) {
                const float w = part[b].y > 0.0f ? part[b].y * expf(part[b].x - smax) : 0.0f;
                if (w <= 0.0f) continue;
                if (rest < w) {
                    at = b;
                    break;
                }
                rest -= w;
                last = b;
                last_w = w;
            }
            if (at < 0) {
                at = last < 0 ? 0 : last;
                rest = last_w;  // rounding leftovers: the range's last positive id
            }
            s_b = at;
            s_rest = rest;
        }
        __syncthreads();
        int lo, hi;
        sample_range(s_b, B, valid, lo, hi);
        const int per = (hi - lo + blockDim.x - 1) / blockDim.x;
        const int i0 = min(lo + (int)threadIdx.x * per, hi), i1 = min(i0 + per, hi);
        float mine = 0.0f;
        for (int i = i0; i < i1; ++i) {
            const float w = expf(row[i] * p.inv_t - smax);
            if (w > 0.0f) mine += w;
        }
        const float incl = block_inclusive_scan(mine, sh);
        // Each thread walks its run from its exclusive prefix; the first crossing wins.
        float acc = incl - mine;
        const float rest = s_rest;
        for (int i = i0; i < i1; ++i) {
            const float w = expf(row[i] * p.inv_t - smax);
            if (!(w > 0.0f)) continue;  // zero or NaN
            if (rest < acc + w) {
                atomicMin(&s_tok, i);
                break;
            }
            acc += w;
            atomicMax(&s_last, i);
        }
        __syncthreads();
        if (threadIdx.x == 0) out[r] = make_int2(s_tok != 0x7fffffff ? s_tok : max(s_last, lo), 0);
        return;
    }
    // Mode 2.
    const unsigned* cnt = hist_count + (long long)r * bins;
    const unsigned long long* mass = hist_mass + (long long)r * bins;
    const SampleCut c = sample_plan(p, R, cnt, mass, bins, cap);
    extern __shared__ unsigned long long keys[];
    const int n = c.fits ? (int)min(cand_count[r], (unsigned)cap) : 0;
    if (c.lo >= 0 && n == 0) {
        if (threadIdx.x == 0) out[r] = make_int2(-1, 1);  // too many candidates: the host picks this row
        return;
    }
    if (c.lo >= 0) sample_sort(cand + (long long)r * cap, n, keys);
    if (!c.nucleus) {
        sample_pick_top_k(p, keys, n, r, out);
        return;
    }
    // Without top-k: the kept set is the top-p prefix (its end found in the sorted bin c.lo) and the
    // min-p floor (counted while gathering); the draw's place in it, in fixed-point mass.
    __shared__ unsigned long long s_keep_p, s_mass_p;
    if (threadIdx.x < 32) {
        unsigned long long keep_p = ~0ull, mass_p = c.total, t;
        if (c.lo >= 0) {
            const int j = sample_first_fixed(keys, n, smax, c.target - c.mass_before, false, t);
            keep_p = c.count_before + (unsigned long long)(j < 0 ? n - 1 : j) + 1;
            unsigned long long upto;
            sample_first_fixed(keys, j < 0 ? n : j + 1, smax, ~0ull, false, upto);
            mass_p = c.mass_before + upto;
        }
        if (threadIdx.x == 0) {
            s_keep_p = keep_p;
            s_mass_p = mass_p;
        }
    }
    __syncthreads();
    unsigned long long kept_mass = s_mass_p;
    if (p.min_p > 0.0f && (unsigned long long)state[r].cnt_m < s_keep_p) kept_mass = state[r].mass_m;
    unsigned long long at = (unsigned long long)((double)p.uniform * (double)kept_mass);
    if (at >= kept_mass) at = kept_mass - 1;
    const SampleBin d = sample_find_bin(cnt, mass, bins, bins - 1, 0xffffffffu, at + 1);
    const unsigned long long rest = at - d.mass_before;
    if (c.lo >= 0 && d.bin == c.lo) {
        if (threadIdx.x < 32) sample_walk(keys, n, smax, rest, r, out);
        return;
    }
    // The draw lands in another bin: sample_gather and sample_pick of round 2 sort that one.
    if (threadIdx.x == 0) {
        state[r].need = 1;
        state[r].bin = d.bin;
        state[r].rest = rest;
        cand_count[r] = 0;
        out[r] = make_int2(-1, 2);
    }
}

// Rows left to the host (flag ≠ 0, or a token outside [0, valid)): their (penalised) logits rows copied
// to `stash` (pinned host memory, device-mapped, [R, ld] f32), for a pick after a later step has
// overwritten the logits (look-ahead decode). Other rows copy nothing.
// Launch: grid (B, R), block 256.
extern "C" __global__ void sample_stash(const float* x, long long ld, int valid, const int2* out, float* stash) {
    int r = blockIdx.y;
    int2 o = out[r];
    if (o.y == 0 && o.x >= 0 && o.x < valid) return;
    const float* src = x + (long long)r * ld;
    float* dst = stash + (long long)r * ld;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < ld; i += (long long)gridDim.x * blockDim.x)
        dst[i] = src[i];
}
