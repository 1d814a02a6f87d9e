// sample.cu — token selection on the device for sampling rows: the penalties, then the greedy pick or a
// draw with temperature, top-k, top-p and min-p, from one uniform number per row drawn by the engine.
// The rule is the host reference's (crates/backend/src/sampling.rs, `RowSampling::pick`); the sums here
// run in another (fixed) order, so a draw within rounding of a boundary may pick the neighbour.
//
// Computes, per row r (logits x[r, ..valid], f32, row stride ld; s = x / temperature):
//   mode 0 (greedy): the argmax of x (lowest index on ties; the host's NaN rule);
//   mode 1 (plain draw, no cut): the first id, in id order, where the running sum of exp(s − max)
//          exceeds u·Σ exp(s − max);
//   mode 2 (cut): the candidates — ordered by s descending, ties by lower id — cut to the top-k, the
//          top-p prefix (of the top-k mass) and the min-p floor; the draw walks them in that order.
// How (mode 2): sample_stats takes per-block maxima and sums; sample_hist bins every id by its distance
// from the row's maximum (1/64 of a unit of s per bin, the last bin holds the rest) with counts and
// fixed-point masses (integer atomics: deterministic); sample_gather finds the last bin the kept set
// can reach and copies the ids of the bins up to it as sortable 64-bit keys; sample_pick sorts them
// (bitonic, shared memory) and cuts and draws exactly. A row whose candidates would exceed the buffer
// gets token −1 and flag 1: the host picks it from the (penalised) logits.
// Shapes/dtypes: params [R] SampleParams; partials [R, B] float4 (max, sum, argmax id, −); hist_count
// [R, bins] u32 and hist_mass [R, bins] u64 (zeroed before sample_hist); cand [R, cap] u64; cand_count [R]
// u32 (zeroed); out [R] int2 (token, flag). Penalties: int4 (row, id, bits of the repetition factor, bits
// of the subtrahend).
// Launch: sample_penalize grid (⌈n/256⌉), block 256; stats / hist / gather grid (B, R), block 256
// (hist: dynamic shared memory bins·12 B); pick grid (R), block 1024, dynamic shared memory cap·8 B.
// Arch: plain loads, shuffles, shared and global 32/64-bit integer atomics: sm_80+.
// Tested by: tests/ops.rs case "sample"; tests/backend.rs `sample_step_matches_the_host_rule`.

struct SampleParams {
    float inv_t;
    int top_k;  // 0: no top-k cut
    float top_p;
    float min_p;
    float uniform;
    int mode;
    int pad0, pad1;
};

#define SAMPLE_BIN_SCALE 64.0f  // bins per unit of s
#define SAMPLE_FIXED 4294967296.0f  // fixed-point scale of a bin's mass (exp(s − max) ≤ 1)

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

// The block's range of ids of block b of B over `valid` ids.
__device__ __forceinline__ void sample_range(int b, int B, int valid, int& lo, int& hi) {
    const int chunk = (valid + B - 1) / B;
    lo = min(b * chunk, valid);
    hi = min(lo + chunk, valid);
}

// The row's maximum of s and Σ exp(s − max), reduced over the B blocks' partials in block order.
__device__ __forceinline__ void sample_row_max_sum(const float4* part, int B, float& smax, float& z) {
    smax = -__int_as_float(0x7f800000);
    for (int b = 0; b < B; ++b) smax = fmaxf(smax, part[b].x);
    z = 0.0f;
    for (int b = 0; b < B; ++b)
        if (part[b].y > 0.0f) z += part[b].y * expf(part[b].x - smax);
}

// The row's maximum of s (from the partials), in every thread of the block.
__device__ __forceinline__ float sample_block_row_max(const float4* part, int B) {
    __shared__ float s_max;
    if (threadIdx.x == 0) {
        float z;
        sample_row_max_sum(part, B, s_max, z);
    }
    __syncthreads();
    return s_max;
}

__device__ __forceinline__ int sample_bin(float s, float smax, int bins) {
    const float d = (smax - s) * SAMPLE_BIN_SCALE;
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

// partials[r, b] = (max of s, Σ exp(s − that max), the greedy best id of the block, 0).
extern "C" __global__ void sample_stats(const float* x, long long ld, int valid, const SampleParams* params,
                                        float4* partials) {
    const int r = blockIdx.y, B = gridDim.x;
    const SampleParams p = params[r];
    const float* row = x + (long long)r * ld;
    int lo, hi;
    sample_range(blockIdx.x, B, valid, lo, hi);
    float m = -__int_as_float(0x7f800000), bv = __int_as_float(0x7fc00000);
    int bi = 0x7fffffff;
    for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        const float s = sample_s(row[i], p);
        if (s == s) m = fmaxf(m, s);
        if (am_better(s, i, bv, bi)) {
            bv = s;
            bi = i;
        }
    }
    __shared__ float sm[32], sv[32];
    __shared__ int si[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    m = warp_max(m);
    am_warp_best(bv, bi);
    if (lane == 0) {
        sm[warp] = m;
        sv[warp] = bv;
        si[warp] = bi;
    }
    __syncthreads();
    if (warp == 0) {
        m = lane < nw ? sm[lane] : -__int_as_float(0x7f800000);
        bv = lane < nw ? sv[lane] : __int_as_float(0x7fc00000);
        bi = lane < nw ? si[lane] : 0x7fffffff;
        m = warp_max(m);
        am_warp_best(bv, bi);
        if (lane == 0) sm[0] = m;
    }
    __syncthreads();
    m = sm[0];
    float z = 0.0f;
    if (p.mode != 0 && m > -__int_as_float(0x7f800000))
        for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) {
            const float s = sample_s(row[i], p);
            if (s == s) z += expf(s - m);
        }
    __shared__ float red[32];
    z = block_sum(z, red);
    if (threadIdx.x == 0) partials[(long long)r * B + blockIdx.x] = make_float4(m, z, __int_as_float(bi), 0.0f);
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
    const float smax = sample_block_row_max(partials + (long long)r * B, B);
    const float* row = x + (long long)r * ld;
    int lo, hi;
    sample_range(blockIdx.x, B, valid, lo, hi);
    for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        const float s = sample_s(row[i], p);
        if (s != s) continue;
        const int b = sample_bin(s, smax, bins);
        atomicAdd(&sh_count[b], 1u);
        const unsigned long long mass = __float2ull_rz(expf(s - smax) * SAMPLE_FIXED);
        if (mass) atomicAdd(&sh_mass[b], mass);
    }
    __syncthreads();
    for (int i = threadIdx.x; i < bins; i += blockDim.x) {
        if (sh_count[i]) atomicAdd(&hist_count[(long long)r * bins + i], sh_count[i]);
        if (sh_mass[i]) atomicAdd(&hist_mass[(long long)r * bins + i], sh_mass[i]);
    }
}

// The last bin the kept set of a mode-2 row can reach, and the ids up to it (inclusive). Every block
// of the row finds the same bin (integer sums in a fixed order).
__device__ int sample_cut_bin(const SampleParams& p, const unsigned* cnt, const unsigned long long* mass, int bins,
                              unsigned& count_upto) {
    // Each thread scans a contiguous run of bins; runs are combined in thread order.
    __shared__ unsigned long long run_mass[256];
    __shared__ unsigned run_count[256];
    __shared__ int s_cut;
    __shared__ unsigned s_count;
    const int per = (bins + blockDim.x - 1) / blockDim.x;
    const int b0 = min((int)threadIdx.x * per, bins), b1 = min(b0 + per, bins);
    unsigned c = 0;
    unsigned long long m = 0;
    for (int b = b0; b < b1; ++b) {
        c += cnt[b];
        m += mass[b];
    }
    run_count[threadIdx.x] = c;
    run_mass[threadIdx.x] = m;
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned long long total = 0;
        for (int t = 0; t < (int)blockDim.x; ++t) total += run_mass[t];
        // Targets: the top-k count; the top-p mass of every id (without top-k); the min-p bin.
        const bool has_k = p.top_k > 0, has_p = p.top_p < 1.0f;
        const unsigned long long p_target = (unsigned long long)((double)p.top_p * (double)total);
        int last = bins - 1;
        if (p.min_p > 0.0f) last = min(last, (int)(-logf(p.min_p) * SAMPLE_BIN_SCALE));
        // With top-k and top-p, the top-p mass is of the top-k set: keep all of it (the pick cuts).
        const bool use_p = has_p && !has_k;
        unsigned cc = 0;
        unsigned long long cm = 0;
        int cut = last;
        for (int t = 0; t < (int)blockDim.x && cut == last; ++t) {
            const int tb0 = min(t * per, bins), tb1 = min(tb0 + per, bins);
            if (tb0 > last) break;
            if ((!has_k || cc + run_count[t] < (unsigned)p.top_k) && (!use_p || cm + run_mass[t] < p_target) &&
                tb1 - 1 <= last) {
                cc += run_count[t];
                cm += run_mass[t];
                continue;
            }
            for (int b = tb0; b < tb1; ++b) {
                cc += cnt[b];
                cm += mass[b];
                if (b == last || (has_k && cc >= (unsigned)p.top_k) || (use_p && cm >= p_target)) {
                    cut = b;
                    break;
                }
            }
            break;
        }
        // cc counts the ids up to the cut bin when the loop stopped inside a run; else up to `last`.
        s_cut = cut;
        s_count = cc;
    }
    __syncthreads();
    count_upto = s_count;
    return s_cut;
}

extern "C" __global__ void sample_gather(const float* x, long long ld, int valid, const SampleParams* params,
                                         const float4* partials, int bins, const unsigned* hist_count,
                                         const unsigned long long* hist_mass, int cap, unsigned long long* cand,
                                         unsigned* cand_count) {
    const int r = blockIdx.y, B = gridDim.x;
    const SampleParams p = params[r];
    if (p.mode != 2) return;
    unsigned upto;
    const int cut = sample_cut_bin(p, hist_count + (long long)r * bins, hist_mass + (long long)r * bins, bins, upto);
    if (upto > (unsigned)cap) return;  // too many candidates: the host picks this row
    const float smax = sample_block_row_max(partials + (long long)r * B, B);
    const float* row = x + (long long)r * ld;
    int lo, hi;
    sample_range(blockIdx.x, B, valid, lo, hi);
    for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        const float s = sample_s(row[i], p);
        if (s != s || sample_bin(s, smax, bins) > cut) continue;
        const unsigned at = atomicAdd(&cand_count[r], 1u);
        if (at < (unsigned)cap) cand[(long long)r * cap + at] = sample_key(s, i);
    }
}

// The first i < n whose inclusive prefix sum of w[i·stride] reaches the target (> target when `strict`,
// else >=), or −1; `total` gets the sum of all n. Warp-wide (every lane gets the same answer).
__device__ int sample_first_reaching(const float* w, int stride, int n, float target, bool strict, float& total) {
    const int lane = threadIdx.x & 31;
    float carry = 0.0f;
    int found = -1;
    for (int base = 0; base < n; base += 32) {
        const int i = base + lane;
        float incl = i < n ? w[(long long)i * stride] : 0.0f;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const float t = __shfl_up_sync(0xffffffffu, incl, o);
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

// Inclusive scan of one float per thread over the block (≤ 1024 threads); `sh` holds 33 floats.
__device__ float sample_block_scan(float v, float* sh) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const float t = __shfl_up_sync(0xffffffffu, v, o);
        if (lane >= o) v += t;
    }
    if (lane == 31) sh[warp] = v;
    __syncthreads();
    if (warp == 0) {
        float w = lane < nw ? sh[lane] : 0.0f;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const float t = __shfl_up_sync(0xffffffffu, w, o);
            if (lane >= o) w += t;
        }
        if (lane < nw) sh[lane] = w;
    }
    __syncthreads();
    const float before = warp > 0 ? sh[warp - 1] : 0.0f;
    __syncthreads();
    return v + before;
}

extern "C" __global__ void sample_pick(const float* x, long long ld, int valid, const SampleParams* params,
                                       const float4* partials, int B, int cap, unsigned long long* cand,
                                       const unsigned* cand_count, int2* out) {
    const int r = blockIdx.x;
    const SampleParams p = params[r];
    const float4* part = partials + (long long)r * B;
    const float* row = x + (long long)r * ld;
    __shared__ float s_max, s_z;
    __shared__ int s_tok, s_last;
    __shared__ float sh[33];
    if (threadIdx.x == 0) {
        sample_row_max_sum(part, B, s_max, s_z);
        s_tok = 0x7fffffff;
        s_last = -1;
    }
    __syncthreads();
    const float smax = s_max, z = s_z;
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
            const float s = row[i] * p.inv_t;
            if (s == s) mine += expf(s - smax);
        }
        const float incl = sample_block_scan(mine, sh);
        // Each thread walks its run from its exclusive prefix; the first crossing wins.
        float acc = incl - mine;
        const float rest = s_rest;
        for (int i = i0; i < i1; ++i) {
            const float s = row[i] * p.inv_t;
            const float w = (s == s) ? expf(s - smax) : 0.0f;
            if (w <= 0.0f) continue;
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
    // Mode 2: sort the candidates, cut, draw.
    const unsigned n_raw = cand_count[r];
    if (n_raw == 0 || n_raw > (unsigned)cap) {
        if (threadIdx.x == 0) out[r] = make_int2(-1, 1);
        return;
    }
    const int n = (int)n_raw;
    extern __shared__ unsigned long long keys[];
    int n2 = 1;
    while (n2 < n) n2 <<= 1;
    for (int i = threadIdx.x; i < n2; i += blockDim.x) keys[i] = i < n ? cand[(long long)r * cap + i] : ~0ull;
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
    // Probabilities in candidate order, written over the keys' high words (ids stay in the low words):
    // softmax over the top-k (its own sum), or over every id (z) without top-k.
    const int kk = p.top_k > 0 ? min(p.top_k, n) : n;
    const float s0 = sample_key_s(keys[0]);
    float* w = reinterpret_cast<float*>(keys) + 1;  // the high word of entry i is w[2i]
    __syncthreads();
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const float s = sample_key_s(keys[i]);
        const float e = i < kk ? expf(s - (p.top_k > 0 ? s0 : smax)) : 0.0f;
        w[2 * i] = e;
    }
    __syncthreads();
    if (threadIdx.x < 32) {
        float sum_k = z;
        if (p.top_k > 0) sample_first_reaching(w, 2, kk, __int_as_float(0x7f800000), false, sum_k);
        for (int i = threadIdx.x; i < kk; i += 32) w[2 * i] /= sum_k;
        __syncwarp();
        int keep = kk;
        float t;
        if (p.top_p < 1.0f) {
            const int at = sample_first_reaching(w, 2, kk, p.top_p, false, t);
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
        sample_first_reaching(w, 2, keep, __int_as_float(0x7f800000), false, total);
        int at = sample_first_reaching(w, 2, keep, p.uniform * total, true, t);
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
}
