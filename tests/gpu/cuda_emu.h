// A CPU emulation of the CUDA execution model, enough to run llamapy's kernels_cuda/ sources
// unchanged on a machine without a GPU (tests/gpu/cuda_emu.py compiles them with g++ -include
// this header). Every thread of a block is a fiber (ucontext) on one OS thread; the blocks of a
// grid run one after another. __syncthreads and the warp shuffles are barriers at which a fiber
// yields; a fiber that returns leaves every barrier it belongs to (CUDA's exited threads). A
// barrier no fiber can pass (a __syncthreads in divergent code, a shuffle with a lane missing)
// stops the launch with an error instead of hanging. Shared memory is one buffer per block.
// Float operations are IEEE single/double on SSE2 with -ffp-contract=off: __fmul_rn and friends
// round as on the device; expf, tanhf, cos, sin are glibc's (the device's differ by an ulp or
// two, which the tests' tolerances allow for).
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <ucontext.h>
#include <utility>
#include <vector>

struct lp_dim3 {
    unsigned int x, y, z;
};
struct float4 {
    float x, y, z, w;
};
struct uint4 {
    unsigned int x, y, z, w;
};
struct float2 {
    float x, y;
};
#define LP_EMU 1
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }
inline uint4 make_uint4(unsigned int x, unsigned int y, unsigned int z, unsigned int w) { return uint4{x, y, z, w}; }

extern lp_dim3 threadIdx, blockIdx, blockDim, gridDim;
extern unsigned char* lp_dyn_smem;

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)

inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fsqrt_rn(float a) { return std::sqrt(a); }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
// __dp4a(a, b, c): c plus the four products of a's and b's bytes as signed 8-bit integers (the
// int overload), wrapping in 32 bits as the device's IDP4A does
inline int __dp4a(int a, int b, int c) {
    uint32_t s = (uint32_t)c;
    for (int i = 0; i < 4; ++i) s += (uint32_t)((int)(int8_t)(a >> (8 * i)) * (int)(int8_t)(b >> (8 * i)));
    return (int)s;
}
// __byte_perm(x, y, s): byte i of the result is byte (s >> 4i) & 7 of the 8 bytes y:x (x the low
// four); with bit 3 of that selector nibble set, the selected byte's sign bit replicated
inline unsigned int __byte_perm(unsigned int x, unsigned int y, unsigned int s) {
    const uint64_t v = ((uint64_t)y << 32) | x;
    unsigned int r = 0;
    for (int i = 0; i < 4; ++i) {
        const unsigned int n = (s >> (4 * i)) & 15u;
        unsigned int b = (unsigned int)(v >> (8 * (n & 7))) & 0xffu;
        if (n & 8) b = (b & 0x80u) ? 0xffu : 0u;
        r |= b << (8 * i);
    }
    return r;
}
inline double __dadd_rn(double a, double b) { return a + b; }
inline float __int_as_float(int i) {
    float f;
    std::memcpy(&f, &i, 4);
    return f;
}
inline float __int_as_float(unsigned int i) { return __int_as_float((int)i); }
inline float __uint_as_float(unsigned int i) { return __int_as_float((int)i); }
inline unsigned int __float_as_uint(float f) {
    unsigned int u;
    std::memcpy(&u, &f, 4);
    return u;
}
// __ldg as the device's: a load of sizeof(T) bytes, which must be aligned to them there (the
// emulator records a misaligned one: the launch then fails, naming the kernel)
extern int lp_misaligned;
template <typename T>
inline T __ldg(const T* p) {
    if (reinterpret_cast<uintptr_t>(p) % sizeof(T)) lp_misaligned = 1;
    T v;
    std::memcpy(&v, p, sizeof(T));
    return v;
}
using std::cos;
using std::sin;

struct lp_barrier_t {
    int count, expected;
    unsigned int gen;
};
void lp_wait(lp_barrier_t* b);
extern lp_barrier_t lp_block_barrier;
extern lp_barrier_t lp_warp_barriers[32];
extern unsigned char lp_warp_slots[32][32][8];

inline void __syncthreads() { lp_wait(&lp_block_barrier); }

extern int lp_block_or;
// 1 when any thread of the block passes a nonzero p; three barriers so that the flag is reset
// (by thread 0) before any thread can reach the next call's write
inline int __syncthreads_or(int p) {
    lp_wait(&lp_block_barrier);
    if (p) lp_block_or = 1;
    lp_wait(&lp_block_barrier);
    const int r = lp_block_or;
    lp_wait(&lp_block_barrier);
    if (threadIdx.x == 0) lp_block_or = 0;
    return r;
}

template <typename T>
inline T __shfl_xor_sync(unsigned int, T v, int off) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    std::memcpy(lp_warp_slots[w][lane], &v, sizeof(T));
    lp_wait(&lp_warp_barriers[w]);
    T r;
    std::memcpy(&r, lp_warp_slots[w][lane ^ off], sizeof(T));
    lp_wait(&lp_warp_barriers[w]);
    return r;
}

// kernel arguments as 8-byte slots, cast to the kernel's own parameter types
template <typename T>
inline T lp_arg(uint64_t v) {
    if constexpr (std::is_pointer_v<T>) {
        return reinterpret_cast<T>(static_cast<uintptr_t>(v));
    } else if constexpr (std::is_same_v<T, float>) {
        float f;
        uint32_t u = (uint32_t)v;
        std::memcpy(&f, &u, 4);
        return f;
    } else {
        return static_cast<T>(v);
    }
}
// a parameter's kind as CuPy packs an argument: 'p' pointer, 'f' float, 'd' double, else an
// integer of 1/2/4/8 bytes ('b', 'h', 'i', 'q'); lp_kinds: a kernel's signature, one letter each
template <typename T>
constexpr char lp_kind() {
    if constexpr (std::is_pointer_v<T>) return 'p';
    else if constexpr (std::is_same_v<T, float>) return 'f';
    else if constexpr (std::is_same_v<T, double>) return 'd';
    else if constexpr (sizeof(T) == 8) return 'q';
    else if constexpr (sizeof(T) == 4) return 'i';
    else if constexpr (sizeof(T) == 2) return 'h';
    else return 'b';
}
template <typename... A>
inline const char* lp_kinds(void (*)(A...)) {
    static const char s[] = {lp_kind<std::decay_t<A>>()..., 0};
    return s;
}
template <typename... A, std::size_t... I>
inline void lp_invoke_i(void (*f)(A...), const uint64_t* a, std::index_sequence<I...>) {
    f(lp_arg<A>(a[I])...);
}
template <typename... A>
inline void lp_invoke(void (*f)(A...), const uint64_t* a) {
    lp_invoke_i(f, a, std::index_sequence_for<A...>{});
}

#ifdef LP_EMU_IMPL
lp_dim3 threadIdx, blockIdx, blockDim, gridDim;
unsigned char* lp_dyn_smem;
lp_barrier_t lp_block_barrier;
lp_barrier_t lp_warp_barriers[32];
unsigned char lp_warp_slots[32][32][8];
int lp_block_or;
int lp_misaligned;

namespace {
enum { RUN, WAIT, DONE };
struct Fiber {
    ucontext_t ctx;
    int state;
    lp_barrier_t* bar;
    unsigned int gen;
};
ucontext_t sched_ctx;
std::vector<Fiber> fibers;
std::vector<char> stacks;
int cur;
void (*call)(const uint64_t*);
const uint64_t* call_args;
const size_t STACK = 256 << 10;

void release_if_full(lp_barrier_t* b) {
    if (b->expected > 0 && b->count >= b->expected) {
        b->count = 0;
        b->gen++;
    }
}

void fiber_main() {
    call(call_args);
    fibers[cur].state = DONE;
    // an exited thread no longer holds back the barriers it belongs to
    lp_block_barrier.expected--;
    release_if_full(&lp_block_barrier);
    lp_barrier_t* w = &lp_warp_barriers[cur >> 5];
    w->expected--;
    release_if_full(w);
}
}  // namespace

void lp_wait(lp_barrier_t* b) {
    const unsigned int g = b->gen;
    if (++b->count >= b->expected) {
        b->count = 0;
        b->gen++;
        return;
    }
    fibers[cur].state = WAIT;
    fibers[cur].bar = b;
    fibers[cur].gen = g;
    swapcontext(&fibers[cur].ctx, &sched_ctx);
}

// Runs fn over the grid; returns 0, -1 when a barrier can never be passed (the block index is
// then in *bad_block), -2 when a load was misaligned for its width.
extern "C" int lp_emu_launch(void (*fn)(const uint64_t*), const uint64_t* args, unsigned int gx, unsigned int gy,
                             unsigned int gz, unsigned int bx, unsigned long long shared, int* bad_block) {
    call = fn;
    call_args = args;
    lp_misaligned = 0;
    gridDim = {gx, gy, gz};
    blockDim = {bx, 1, 1};
    std::vector<unsigned char> smem(shared + 16);
    lp_dyn_smem = smem.data();
    if (stacks.size() < bx * STACK) stacks.resize(bx * STACK);
    fibers.assign(bx, Fiber{});
    for (unsigned int z = 0; z < gz; ++z)
        for (unsigned int y = 0; y < gy; ++y)
            for (unsigned int x = 0; x < gx; ++x) {
                blockIdx = {x, y, z};
                std::memset(smem.data(), 0xcd, smem.size());  // not zero: reads before writes show
                lp_block_barrier = {0, (int)bx, 0};
                for (unsigned int w = 0; w < (bx + 31) / 32; ++w)
                    lp_warp_barriers[w] = {0, (int)((bx - 32 * w) < 32 ? bx - 32 * w : 32), 0};
                for (unsigned int t = 0; t < bx; ++t) {
                    Fiber& f = fibers[t];
                    getcontext(&f.ctx);
                    f.ctx.uc_stack.ss_sp = stacks.data() + t * STACK;
                    f.ctx.uc_stack.ss_size = STACK;
                    f.ctx.uc_link = &sched_ctx;
                    makecontext(&f.ctx, fiber_main, 0);
                    f.state = RUN;
                }
                for (;;) {
                    bool progress = false, all_done = true;
                    for (unsigned int t = 0; t < bx; ++t) {
                        Fiber& f = fibers[t];
                        if (f.state == DONE) continue;
                        all_done = false;
                        if (f.state == WAIT && f.bar->gen == f.gen) continue;
                        f.state = RUN;
                        cur = (int)t;
                        threadIdx = {t, 0, 0};
                        swapcontext(&sched_ctx, &f.ctx);
                        progress = true;
                    }
                    if (all_done) break;
                    if (!progress) {
                        *bad_block = (int)(x + gx * (y + gy * z));
                        return -1;
                    }
                }
            }
    return lp_misaligned ? -2 : 0;
}
#endif
