// CUDA's thread model on a CPU, for the generated CUDA C itself
// (codegen/tests/host_cuda.rs): a block's threads are released together;
// `__syncthreads` is a barrier over them; a warp shuffle is an exchange
// through the warp's slots between two barriers over its 32 threads;
// `__shared__` memory (dynamic too) is a static of the kernel, which the
// blocks, run one after another, share in turn; atomics are
// `std::atomic_ref`. Enough for the elementwise, row and scan kernels and
// the tensor-core passes (their `mma`, `ldmatrix` and `cp.async` below).
//
// On x86-64 a block's threads are fibers on the calling thread, switched
// at their barriers: a warp-wide step (a shuffle, an `mma`) costs a few
// user-space switches, where OS threads on a two-core machine paid a futex
// storm for each, which made the emulated tensor cores the test suite's
// slowest part. Elsewhere they are OS threads.
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#if defined(__x86_64__) && !defined(DPLC_HOST_THREADS)
#define DPLC_FIBERS 1
#else
#define DPLC_FIBERS 0
#endif

#if DPLC_FIBERS
#include <sys/mman.h>
// A barrier among fibers: the last to arrive releases the others (a new
// generation) and goes on; the others yield until their generation has
// passed. Declared here, defined with the scheduler below.
struct dplc_barrier {
    explicit dplc_barrier(std::ptrdiff_t n) : expected(n) {}
    std::ptrdiff_t expected, arrived = 0;
    unsigned long generation = 0;
    inline void arrive_and_wait();
    inline void arrive_and_drop();
};
#else
typedef std::barrier<> dplc_barrier;
#endif

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
    dplc_barrier bar;
    float slot[32];
    // A tensor-core step's operand fragments, by lane.
    unsigned a[32][4];
    unsigned b[32][2];
    // An `ldmatrix`'s row addresses, by lane.
    const unsigned short* rows[32];
};
inline thread_local dplc_barrier* dplc_block_bar;
inline thread_local dplc_warp_state* dplc_warp;
// A thread's `cp.async` copies not yet landed.
struct dplc_pending_copy { void* dst; const void* src; };
inline thread_local std::vector<dplc_pending_copy>* dplc_pending;

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
inline void dplc_cp_async16(void* smem, const void* gmem) { dplc_pending->push_back({smem, gmem}); }
inline void dplc_cp_async_commit() {}
inline void dplc_cp_async_wait() {
    for (const auto& c : *dplc_pending) std::memcpy(c.dst, c.src, 16);
    dplc_pending->clear();
}
#endif

// A block's warps: 32 threads each, the last the block's remainder.
inline std::vector<std::unique_ptr<dplc_warp_state>> dplc_block_warps(unsigned block) {
    std::vector<std::unique_ptr<dplc_warp_state>> warps;
    for (unsigned w = 0; w * 32 < block; ++w) {
        const unsigned n = block - w * 32 < 32 ? block - w * 32 : 32;
        warps.push_back(std::make_unique<dplc_warp_state>(n));
    }
    return warps;
}

// Run `body` as a grid of `grid` blocks of `block` threads, one block after
// another. A thread that has finished leaves the barriers, as an exited
// GPU thread no longer holds its block's or its warp's back.
#if DPLC_FIBERS
// The switch saves the callee-saved registers and the floating-point
// control words on the stack it leaves and restores them from the one it
// enters (the System V ABI's: everything else the caller has saved).
extern "C" __attribute__((visibility("hidden"))) void dplc_fiber_switch(void** from, void* to);
extern "C" __attribute__((visibility("hidden"))) void dplc_fiber_main(void* fiber);
asm(R"(
    .text
    .globl dplc_fiber_switch
    .hidden dplc_fiber_switch
    .type dplc_fiber_switch, @function
dplc_fiber_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $16, %rsp
    stmxcsr 8(%rsp)
    fnstcw 12(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr 8(%rsp)
    fldcw 12(%rsp)
    addq $16, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size dplc_fiber_switch, .-dplc_fiber_switch

    .globl dplc_fiber_entry
    .hidden dplc_fiber_entry
    .type dplc_fiber_entry, @function
dplc_fiber_entry:
    movq %r12, %rdi
    andq $-16, %rsp
    call dplc_fiber_main
    ud2
    .size dplc_fiber_entry, .-dplc_fiber_entry
)");
extern "C" __attribute__((visibility("hidden"))) void dplc_fiber_entry();

// A fiber's stack, its lowest page unmapped: a kernel whose locals outgrow
// it faults there instead of writing over another fiber's stack.
constexpr std::size_t dplc_stack_bytes = 256 * 1024, dplc_guard_bytes = 4096;
struct dplc_unmap {
    void operator()(unsigned char* p) const { munmap(p, dplc_stack_bytes); }
};
inline std::unique_ptr<unsigned char, dplc_unmap> dplc_new_stack() {
    void* p = mmap(nullptr, dplc_stack_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED || mprotect(p, dplc_guard_bytes, PROT_NONE) != 0) {
        std::fputs("dplc_run: cannot map a fiber's stack\n", stderr);
        std::abort();
    }
    return std::unique_ptr<unsigned char, dplc_unmap>(static_cast<unsigned char*>(p));
}

struct dplc_fiber {
    unsigned tid = 0;
    void* sp = nullptr;
    std::unique_ptr<unsigned char, dplc_unmap> stack;
    // The barrier and generation it waits for (none: runnable).
    const dplc_barrier* waits = nullptr;
    unsigned long generation = 0;
    bool done = false;
    dplc_warp_state* warp = nullptr;
    std::vector<dplc_pending_copy> pending;
};
// The scheduler of the calling thread: the fiber running, where to return.
struct dplc_scheduler {
    dplc_fiber* current = nullptr;
    void* sp = nullptr;
    void (*run)(void*) = nullptr;
    void* body = nullptr;
};
inline thread_local dplc_scheduler dplc_sched;

// Back to the scheduler; returns when the scheduler resumes this fiber.
inline void dplc_yield() {
    dplc_fiber_switch(&dplc_sched.current->sp, dplc_sched.sp);
}
inline void dplc_barrier::arrive_and_wait() {
    const unsigned long g = generation;
    if (++arrived == expected) {
        arrived = 0;
        ++generation;
        return;
    }
    dplc_sched.current->waits = this;
    dplc_sched.current->generation = g;
    dplc_yield();
}
inline void dplc_barrier::arrive_and_drop() {
    --expected;
    if (expected > 0 && arrived == expected) {
        arrived = 0;
        ++generation;
    }
}
extern "C" void dplc_fiber_main(void* p) {
    dplc_fiber* f = static_cast<dplc_fiber*>(p);
    dplc_sched.run(dplc_sched.body);
    dplc_block_bar->arrive_and_drop();
    dplc_warp->bar.arrive_and_drop();
    f->done = true;
    dplc_yield();
    __builtin_trap();  // a finished fiber is never resumed
}

template <class F>
void dplc_run(unsigned grid, unsigned block, F body) {
    std::vector<dplc_fiber> fibers(block);
    for (auto& f : fibers) f.stack = dplc_new_stack();
    dplc_sched.run = [](void* b) { (*static_cast<F*>(b))(); };
    dplc_sched.body = &body;
    blockDim = {block, 1, 1};
    gridDim = {grid, 1, 1};
    for (unsigned b = 0; b < grid; ++b) {
        blockIdx = {b, 0, 0};
        dplc_barrier bar(block);
        dplc_block_bar = &bar;  // the block's fibers share the calling thread's
        const auto warps = dplc_block_warps(block);
        for (unsigned t = 0; t < block; ++t) {
            dplc_fiber& f = fibers[t];
            f.tid = t;
            f.waits = nullptr;
            f.done = false;
            f.warp = warps[t / 32].get();
            f.pending.clear();
            // The frame a first switch into the fiber pops: the control
            // words (mxcsr at byte 8, the x87 word at 12: their defaults),
            // r15, r14, r13, r12 (the fiber, for its entry), rbx, rbp, and
            // the entry as the return address.
            void** sp = reinterpret_cast<void**>(f.stack.get() + dplc_stack_bytes) - 10;
            for (int i = 0; i < 10; ++i) sp[i] = nullptr;
            const unsigned control[4] = {0, 0, 0x1f80u, 0x037fu};
            std::memcpy(sp, control, sizeof control);
            sp[5] = &f;
            sp[8] = reinterpret_cast<void*>(&dplc_fiber_entry);
            f.sp = sp;
        }
        // Round robin: resume each fiber whose barrier has released it,
        // until all are done; a pass that resumes none is a deadlock (a
        // barrier some thread never reaches), which a GPU would hang on.
        // Each pass runs the threads up or down, by a hash of the pass, so
        // that between two barriers the high threads run before the low
        // ones about as often as after (a strict alternation would line up
        // with kernels that pass an even number of barriers a loop): a read
        // of another thread's write with no barrier between sees the stale
        // value in one order or the other, where a fixed order could hide it.
        for (std::size_t left = block, pass = 0; left > 0; ++pass) {
            bool ran = false;
            const bool down = (pass * 0x9e3779b97f4a7c15ull) >> 63;
            for (unsigned i = 0; i < block; ++i) {
                dplc_fiber& f = fibers[down ? block - 1 - i : i];
                if (f.done || (f.waits && f.waits->generation == f.generation)) continue;
                f.waits = nullptr;
                threadIdx = {f.tid, 0, 0};
                dplc_warp = f.warp;
                dplc_pending = &f.pending;
                dplc_sched.current = &f;
                dplc_fiber_switch(&dplc_sched.sp, f.sp);
                ran = true;
                if (f.done) --left;
            }
            if (!ran) {
                std::fputs("dplc_run: every thread waits at a barrier no other thread reaches\n", stderr);
                std::abort();
            }
        }
    }
}
#else
template <class F>
void dplc_run(unsigned grid, unsigned block, F body) {
    for (unsigned b = 0; b < grid; ++b) {
        std::barrier<> bar(block);
        const auto warps = dplc_block_warps(block);
        std::vector<std::thread> threads;
        threads.reserve(block);
        for (unsigned t = 0; t < block; ++t) {
            threads.emplace_back([&, t] {
                std::vector<dplc_pending_copy> pending;
                threadIdx = {t, 0, 0};
                blockIdx = {b, 0, 0};
                blockDim = {block, 1, 1};
                gridDim = {grid, 1, 1};
                dplc_block_bar = &bar;
                dplc_warp = warps[t / 32].get();
                dplc_pending = &pending;
                body();
                bar.arrive_and_drop();
                dplc_warp->bar.arrive_and_drop();
            });
        }
        for (auto& t : threads) t.join();
    }
}
#endif
