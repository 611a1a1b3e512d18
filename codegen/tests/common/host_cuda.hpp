// CUDA's thread model on a CPU, for the generated CUDA C itself
// (codegen/tests/host_cuda.rs): a block's threads are OS threads released
// together; `__syncthreads` is a barrier over them; a warp shuffle is an
// exchange through the warp's slots between two barriers over its 32
// threads; `__shared__` memory (dynamic too) is a static of the kernel, which the blocks,
// run one after another, share in turn; atomics are `std::atomic_ref`.
// Enough for the elementwise, row and scan kernels (no tensor cores, no
// inline PTX: the storage conversions below replace the generated ones).
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

struct dplc_dim3 {
    unsigned x, y, z;
};
struct uint4 {
    unsigned x, y, z, w;
};
struct uint2 {
    unsigned x, y;
};
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }

inline thread_local dplc_dim3 threadIdx, blockIdx, blockDim, gridDim;

struct dplc_warp_state {
    explicit dplc_warp_state(std::ptrdiff_t n) : bar(n) {}
    std::barrier<> bar;
    float slot[32];
    // A tensor-core step's operand fragments, by lane.
    unsigned a[32][4];
    unsigned b[32][2];
    // An `ldmatrix`'s row addresses, by lane.
    const unsigned short* rows[32];
};
inline thread_local std::barrier<>* dplc_block_bar;
inline thread_local dplc_warp_state* dplc_warp;

#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#define __shared__ static
// A block's dynamic shared memory: a static of the kernel too, of the bytes
// the launch would give.
#define DPLC_DYNAMIC_SHARED(name, bytes) static __attribute__((aligned(16))) unsigned char name[bytes]

inline void __syncthreads() { dplc_block_bar->arrive_and_wait(); }

inline float dplc_exchange(float v, int from) {
    const int lane = threadIdx.x & 31;
    dplc_warp->slot[lane] = v;
    dplc_warp->bar.arrive_and_wait();
    const float r = dplc_warp->slot[from];
    dplc_warp->bar.arrive_and_wait();
    return r;
}
inline float __shfl_xor_sync(unsigned, float v, int mask) {
    return dplc_exchange(v, (threadIdx.x & 31) ^ mask);
}
inline float __shfl_up_sync(unsigned, float v, int delta) {
    const int lane = threadIdx.x & 31;
    const float r = dplc_exchange(v, lane >= delta ? lane - delta : lane);
    return lane >= delta ? r : v;
}
inline float __shfl_down_sync(unsigned, float v, int delta) {
    const int lane = threadIdx.x & 31;
    const float r = dplc_exchange(v, lane + delta < 32 ? lane + delta : lane);
    return lane + delta < 32 ? r : v;
}

inline float __uint_as_float(unsigned u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
inline float __int_as_float(int i) {
    float f;
    std::memcpy(&f, &i, 4);
    return f;
}
inline unsigned __float_as_uint(float f) {
    unsigned u;
    std::memcpy(&u, &f, 4);
    return u;
}
inline int __float_as_int(float f) {
    int i;
    std::memcpy(&i, &f, 4);
    return i;
}
// `ex2.approx`: the host's exp2 (the GPU's is within 2 ulp of it).
#define DPLC_EXP2
inline float dplc_exp2(float x) { return exp2f(x); }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline float atomicAdd(float* p, float v) { return std::atomic_ref<float>(*p).fetch_add(v); }
inline int atomicAdd(int* p, int v) { return std::atomic_ref<int>(*p).fetch_add(v); }

// The storage types, as the GPU's conversions round (to nearest even).
#define DPLC_STORAGE
#if DPLC_DTYPE == 0
typedef float dplc_t;
inline float dplc_ld(float x) { return x; }
inline float dplc_st(float x) { return x; }
#elif DPLC_DTYPE == 1
typedef unsigned short dplc_t;
inline float dplc_ld(unsigned short h) { return __uint_as_float(((unsigned)h) << 16); }
inline unsigned short dplc_st(float f) {
    unsigned u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40);  // NaN stays NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}
#else
typedef unsigned short dplc_t;
inline float dplc_ld(unsigned short h) {
    _Float16 x;
    std::memcpy(&x, &h, 2);
    return (float)x;
}
inline unsigned short dplc_st(float f) {
    _Float16 x = (_Float16)f;
    unsigned short h;
    std::memcpy(&h, &x, 2);
    return h;
}
#endif

// The tensor-core step `mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}`
// as the PTX ISA lays out its fragments: lane = 4 g + t holds A's rows g and
// g + 8 at columns 2t, 2t + 1 (registers 0, 1) and 2t + 8, 2t + 9 (2, 3), B's
// column g at rows 2t, 2t + 1 (b0) and 2t + 8, 2t + 9 (b1), and C's rows g
// (c0, c1) and g + 8 (c2, c3) at columns 2t, 2t + 1; the lower-indexed
// element of a pair in the register's low half. Every lane of the warp
// takes part, as in `mma.sync`. Products summed in f32.
#if DPLC_DTYPE != 0
#define DPLC_MMA
inline float dplc_half(unsigned v, int high) { return dplc_ld((unsigned short)(high ? v >> 16 : v & 0xffffu)); }
inline void dplc_mma(float* c, const unsigned* a, unsigned b0, unsigned b1) {
    const int lane = threadIdx.x & 31;
    dplc_warp_state* w = dplc_warp;
    for (int i = 0; i < 4; ++i) w->a[lane][i] = a[i];
    w->b[lane][0] = b0;
    w->b[lane][1] = b1;
    w->bar.arrive_and_wait();
    const int g = lane >> 2, t = lane & 3;
    for (int i = 0; i < 4; ++i) {
        const int r = g + (i >= 2 ? 8 : 0), n = 2 * t + (i & 1);
        float sum = 0.0f;
        for (int k = 0; k < 16; ++k) {
            const unsigned av = w->a[(r & 7) * 4 + ((k & 7) >> 1)][(r >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0)];
            const unsigned bv = w->b[n * 4 + ((k & 7) >> 1)][k >= 8 ? 1 : 0];
            sum += dplc_half(av, k & 1) * dplc_half(bv, k & 1);
        }
        c[i] += sum;
    }
    w->bar.arrive_and_wait();
}
// `ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16`: lane l gives row l % 8
// of tile l / 8; register i of lane 4g + t takes tile i's row g at columns
// 2t and 2t + 1, or transposed its rows 2t and 2t + 1 at column g — the
// lower in the low half.
inline void dplc_ldsm_x4_any(unsigned* r, const void* row, bool trans) {
    const int lane = threadIdx.x & 31;
    dplc_warp_state* w = dplc_warp;
    w->rows[lane] = static_cast<const unsigned short*>(row);
    w->bar.arrive_and_wait();
    const int g = lane >> 2, t = lane & 3;
    for (int i = 0; i < 4; ++i) {
        const unsigned lo = trans ? w->rows[8 * i + 2 * t][g] : w->rows[8 * i + g][2 * t];
        const unsigned hi = trans ? w->rows[8 * i + 2 * t + 1][g] : w->rows[8 * i + g][2 * t + 1];
        r[i] = lo | (hi << 16);
    }
    w->bar.arrive_and_wait();
}
inline void dplc_ldsm_x4(unsigned* r, const void* row) { dplc_ldsm_x4_any(r, row, false); }
inline void dplc_ldsm_x4_t(unsigned* r, const void* row) { dplc_ldsm_x4_any(r, row, true); }
inline unsigned dplc_pack(float lo, float hi) {
    return (unsigned)dplc_st(lo) | ((unsigned)dplc_st(hi) << 16);
}
// `cp.async`: a thread's copies land when it waits for them, not before, so
// a tile read before its wait (or before the barrier after every thread's
// wait) reads what the buffer held.
struct dplc_pending_copy { void* dst; const void* src; };
inline thread_local std::vector<dplc_pending_copy> dplc_pending;
inline void dplc_cp_async16(void* smem, const void* gmem) { dplc_pending.push_back({smem, gmem}); }
inline void dplc_cp_async_commit() {}
inline void dplc_cp_async_wait() {
    for (const auto& c : dplc_pending) std::memcpy(c.dst, c.src, 16);
    dplc_pending.clear();
}
#endif

// Run `body` as a grid of `grid` blocks of `block` threads, one block after
// another. A thread that has finished leaves the barriers, as an exited
// GPU thread no longer holds its block's or its warp's back.
template <class F>
void dplc_run(unsigned grid, unsigned block, F body) {
    for (unsigned b = 0; b < grid; ++b) {
        std::barrier<> bar(block);
        std::vector<std::unique_ptr<dplc_warp_state>> warps;
        for (unsigned w = 0; w * 32 < block; ++w) {
            const unsigned n = block - w * 32 < 32 ? block - w * 32 : 32;
            warps.push_back(std::make_unique<dplc_warp_state>(n));
        }
        std::vector<std::thread> threads;
        threads.reserve(block);
        for (unsigned t = 0; t < block; ++t) {
            threads.emplace_back([&, t] {
                threadIdx = {t, 0, 0};
                blockIdx = {b, 0, 0};
                blockDim = {block, 1, 1};
                gridDim = {grid, 1, 1};
                dplc_block_bar = &bar;
                dplc_warp = warps[t / 32].get();
                body();
                bar.arrive_and_drop();
                dplc_warp->bar.arrive_and_drop();
            });
        }
        for (auto& t : threads) t.join();
    }
}
