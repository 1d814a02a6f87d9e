// init.cu — deterministic random weights generated on the GPU (benchmarks at real shapes without
// a checkpoint): each element is a pure function of (seed, index), so any layout is reproducible.
//
// Computes, for i < n, with r = splitmix64(seed ^ splitmix64(first + i)), u1 in (0, 1], u2 in [0, 1)
// (`first`: where a slice of a tensor made in pieces starts, 0 for a whole tensor):
//   z = sqrt(-2 ln u1) cos(2 pi u2)                       (Box–Muller standard normal)
//   mode 0: std * z      mode 1: 1 + std * z      mode 2: ln(1 + 15 u2)   (A_log = ln U(1, 16))
//   mode 3: raw 32-bit words (random int4 codes; out is u32 [n])   mode 4: std * (1 + 0.1 z) (int4 scales)
//   mode 5: e4m3 codes of std * z (random fp8 weights; out is u8 [n])
// the distributions of crates/model/src/synth.rs (not its exact bytes: that uses a CPU RNG).
// Shapes/dtypes: out [n] bf16 (is_f32 == 0) or f32. Launch: any grid (grid-stride), block 256.
// Arch: plain, sm_80+. Tested by: tests/backend.rs (random-weight backend runs finite logits).
//
// init_smem: each block stores the 32-bit `pattern` over its `words` words of dynamic shared memory and
// exits. Tests launch it (a few blocks per SM, the whole shared memory each) before a kernel that must
// not read shared memory it did not write: that kernel's blocks then find the pattern (0xffffffff: bf16
// and f32 NaN) where they find anything at all (shared memory is not cleared between kernels).
// Launch: grid any, block any, dynamic smem 4 * words B (ops/init.rs fill_smem). Tested by: tests/ops/
// vision cases (NaN left in shared memory before the attention).

__device__ __forceinline__ unsigned long long splitmix64(unsigned long long x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

extern "C" __global__ void init_random(void* out, long long n, long long first, unsigned long long seed,
                                       float std_, int mode, int is_f32) {
    long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        unsigned long long r = splitmix64(seed ^ splitmix64((unsigned long long)(first + i)));
        float u1 = (float)((r >> 40) + 1ull) * (1.0f / 16777216.0f);
        float u2 = (float)((r >> 16) & 0xffffffull) * (1.0f / 16777216.0f);
        float z = sqrtf(-2.0f * logf(u1)) * cosf(6.28318530718f * u2);
        if (mode == 3) {  // raw random 32-bit words (packed int4 codes); n counts words
            ((unsigned int*)out)[i] = (unsigned int)(r ^ (r >> 32));
            continue;
        }
        if (mode == 5) {  // e4m3 codes of std * z (fp8 weights; n counts bytes)
            ((unsigned char*)out)[i] = (unsigned char)kq_e4m3(std_ * z);
            continue;
        }
        float v = mode == 0 ? std_ * z
                            : (mode == 1 ? 1.0f + std_ * z
                                         : (mode == 2 ? logf(1.0f + 15.0f * u2) : std_ * (1.0f + 0.1f * z)));
        if (is_f32) ((float*)out)[i] = v;
        else ((bf16_t*)out)[i] = f2bf(v);
    }
}

extern "C" __global__ void init_smem(unsigned int pattern, int words) {
    extern __shared__ __align__(16) unsigned int init_smem_words[];
    const u32 base = smem_addr(init_smem_words);
    // Volatile stores: nothing in this kernel reads them.
    for (int i = threadIdx.x; i < words; i += blockDim.x)
        asm volatile("st.shared.u32 [%0], %1;" ::"r"(base + 4u * (u32)i), "r"(pattern) : "memory");
}
