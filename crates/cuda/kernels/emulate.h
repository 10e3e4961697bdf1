// The CUDA kernel language on the host: the one file that knows the kernels are not on a GPU.
//
// The kernels in this folder are compiled twice from the same text: by NVRTC for the GPU, and by
// g++ with this header forced in front (`-include emulate.h`) for the host emulator that CI runs.
// Each CUDA thread of a block becomes a fiber with its own stack and its own
// threadIdx; a block's fibers run cooperatively on one OS thread, switching only at barriers,
// and blocks run one after another. So:
// - `__shared__` is a function-local thread_local static: one copy per block in flight (a
//   block's fibers share their OS thread; launches on other threads, from other emulator
//   instances in the same process, get their own). Before each block that runs as fibers, all
//   of it is poisoned (every byte 0xFF: NaN in every float type, -1 in the integers), as a GPU
//   gives a block whatever its SM held last: a kernel that reads shared memory its block did
//   not write sees NaN, not zeros or the previous block's values (which, computed by the same
//   code, would often have passed).
// - `__syncthreads()` is a real barrier: a fiber waits until every thread of its block arrives.
//   A thread that exits while others wait, or waits while others exited, is an error (CUDA's
//   "barrier in divergent code"), not a silent pass.
// - Warp shuffles, votes and `__syncwarp` exchange through a per-warp buffer between two warp
//   barriers; every lane named in the mask must take part, and a shuffle that reads a lane
//   outside the mask is an error.
// - Fibers only switch at barriers, so a missing `__syncthreads()` means one thread runs ahead
//   and reads shared memory the others have not written. Launches alternate the order in which
//   a block's threads start (forward, then backward), so a race hidden by one order shows in
//   the other.
// - A kernel whose launch finished without any barrier or warp operation runs later launches
//   with its threads as plain calls (no fibers): elementwise work at function-call speed.
// - `__half` and `__nv_bfloat16` are 16-bit host types with correctly rounded conversions.
// - `REDLINE_HOST_EMULATOR` is defined, for the one place a kernel must know: a parameter too
//   large to copy for every thread (optim.cu's tensor lists) is declared a const reference
//   here, bound to the launch's bytes (`sizeof` of a reference is its type's, so the launch's
//   parameter sizes still match).
// Slow (a context switch per thread per barrier), but exact about indexing, tails and
// synchronisation. On x86-64 a switch saves only the registers a function call must preserve
// (see `switch_to`); glibc's swapcontext, used elsewhere, also makes a system call per switch.
// The host shims `host/cuda_fp16.h` and `host/cuda_bf16.h` stand in for NVIDIA's headers.
#pragma once

#define REDLINE_HOST_EMULATOR 1

// The hand-written switch on x86-64; ucontext elsewhere, or where REDLINE_EMU_UCONTEXT is
// defined (how the emulator's self-test checks that path too).
#if defined(__x86_64__) && !defined(REDLINE_EMU_UCONTEXT)
#define REDLINE_EMU_FAST_SWITCH 1
#else
#include <ucontext.h>
#endif

#include <cmath>
#include <cstdint>
#if defined(__linux__)
#include <link.h>
#endif
#include <cstdio>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__
#define __launch_bounds__(...)
#define __restrict__ __restrict
#define __shared__ static thread_local

struct uint3 {
    unsigned x, y, z;
};

struct dim3 {
    unsigned x, y, z;
    constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

namespace redline_emu {

constexpr unsigned kWarp = 32;
constexpr size_t kStackBytes = 128 * 1024;

// A fiber's saved execution state: where to resume it.
#if REDLINE_EMU_FAST_SWITCH
// glibc's swapcontext saves and restores the signal mask with a system call on every switch:
// nine tenths of the emulated suite's time went there. A switch here is a call that pushes the
// registers the System V ABI makes callee-saved, stores the stack pointer, loads the other
// fiber's and pops its registers; the `ret` resumes that fiber where it called the switch. The
// kernels never change the floating-point environment, so MXCSR and the x87 control word need
// no saving. Hidden: each emulator library has its own.
struct Context {
    void *sp = nullptr;
};

extern "C" __attribute__((visibility("hidden"))) void redline_emu_switch(void **save, void *load);
asm(R"(
    .pushsection .text
    .globl redline_emu_switch
    .hidden redline_emu_switch
    .type redline_emu_switch, @function
    .p2align 4
redline_emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size redline_emu_switch, .-redline_emu_switch
    .popsection
)");

/// Saves the running fiber's state in `from` and resumes `to`.
inline void switch_to(Context &from, Context &to) { redline_emu_switch(&from.sp, to.sp); }

/// Prepares `c` to start `entry` on `stack`: a frame as `redline_emu_switch` leaves one, whose
/// six registers are zero and whose return address is `entry`, above which a null return
/// address ends backtraces. `entry` then starts with the stack pointer 8 bytes past a 16-byte
/// boundary, as after a call.
inline void start_context(Context &c, std::vector<char> &stack, void (*entry)()) {
    auto top = reinterpret_cast<uintptr_t>(stack.data() + stack.size()) & ~uintptr_t(15);
    void **frame = reinterpret_cast<void **>(top) - 8;
    for (int i = 0; i < 6; i++) frame[i] = nullptr;
    frame[6] = reinterpret_cast<void *>(entry);
    frame[7] = nullptr;
    c.sp = frame;
}
#else
struct Context {
    ucontext_t uc;
};

inline void switch_to(Context &from, Context &to) { swapcontext(&from.uc, &to.uc); }

inline void start_context(Context &c, std::vector<char> &stack, void (*entry)()) {
    getcontext(&c.uc);
    c.uc.uc_stack.ss_sp = stack.data();
    c.uc.uc_stack.ss_size = stack.size();
    c.uc.uc_link = nullptr;
    makecontext(&c.uc, entry, 0);
}
#endif

struct Fiber {
    Context context;
    std::vector<char> stack;
    uint3 thread_idx;
    unsigned linear = 0;
    bool done = false;
};

/// The block being run: its fibers, its barrier and its warps' exchange buffers.
struct Block {
    dim3 grid, block;
    uint3 block_idx;
    std::vector<Fiber> fibers;
    Context scheduler;
    Fiber *current = nullptr;
    unsigned exited = 0;
    // The block barrier: arrivals in the current generation.
    unsigned barrier_arrived = 0;
    uint64_t barrier_generation = 0;
    // One barrier and one exchange buffer per warp.
    std::vector<unsigned> warp_arrived;
    std::vector<uint64_t> warp_generation;
    std::vector<unsigned> warp_mask;
    std::vector<uint64_t> warp_values;  // kWarp slots per warp, raw bits
    std::string error;
    void (*entry)(void **) = nullptr;
    void **args = nullptr;
    // Direct mode: threads run as plain calls, one after another (see `launch`).
    bool direct = false;
    // Whether any thread of this launch used a barrier or a warp operation.
    bool synced = false;
};

/// Thrown by a barrier met in direct mode, caught by `launch`.
struct BarrierInDirectMode {};

inline thread_local Block *g_block = nullptr;

inline Block &block() { return *g_block; }
inline Fiber &fiber() { return *g_block->current; }

/// Records the first error and parks the fiber for good: the launch fails with the message.
[[noreturn]] inline void fail(const std::string &what) {
    Block &b = block();
    if (b.error.empty()) {
        Fiber &f = fiber();
        b.error = what + " (thread (" + std::to_string(f.thread_idx.x) + "," +
                  std::to_string(f.thread_idx.y) + "," + std::to_string(f.thread_idx.z) +
                  ") of block (" + std::to_string(b.block_idx.x) + "," +
                  std::to_string(b.block_idx.y) + "," + std::to_string(b.block_idx.z) + "))";
    }
    for (;;) switch_to(fiber().context, b.scheduler);
}

/// Hands control back to the scheduler until it resumes this fiber.
inline void yield() {
    Block &b = block();
    switch_to(b.current->context, b.scheduler);
}

inline unsigned threads_in_block() { return block().block.x * block().block.y * block().block.z; }

/// Lanes that exist in warp `w` (a block's last warp may be partial).
inline unsigned existing_lanes(unsigned w) {
    unsigned n = threads_in_block() - w * kWarp;
    return n >= kWarp ? 0xffffffffu : ((1u << n) - 1u);
}

inline void syncthreads() {
    Block &b = block();
    if (b.direct) throw BarrierInDirectMode{};
    b.synced = true;
    if (b.exited > 0) fail("__syncthreads() after another thread of the block exited");
    uint64_t generation = b.barrier_generation;
    if (++b.barrier_arrived == threads_in_block()) {
        b.barrier_arrived = 0;
        b.barrier_generation++;
        return;
    }
    while (b.barrier_generation == generation) yield();
}

/// Waits until every lane of `mask` in this fiber's warp arrives with the same mask.
inline void warp_barrier(unsigned mask, const char *what) {
    Block &b = block();
    if (b.direct) throw BarrierInDirectMode{};
    b.synced = true;
    Fiber &f = fiber();
    unsigned w = f.linear / kWarp, lane = f.linear % kWarp;
    if (!(mask & (1u << lane))) fail(std::string(what) + ": the calling lane is not in its mask");
    if (mask & ~existing_lanes(w)) fail(std::string(what) + ": the mask names lanes past the block's last thread");
    if (b.warp_arrived[w] == 0) {
        b.warp_mask[w] = mask;
    } else if (b.warp_mask[w] != mask) {
        fail(std::string(what) + ": lanes of one warp passed different masks");
    }
    uint64_t generation = b.warp_generation[w];
    if (++b.warp_arrived[w] == (unsigned)__builtin_popcount(mask)) {
        b.warp_arrived[w] = 0;
        b.warp_generation[w]++;
        return;
    }
    while (b.warp_generation[w] == generation) yield();
}

inline unsigned lane_id() { return fiber().linear % kWarp; }

/// Publishes `bits` for this lane, waits for the warp, reads lane `src`, waits again (so no lane
/// overwrites its slot before every lane has read).
inline uint64_t exchange(unsigned mask, uint64_t bits, unsigned src, const char *what) {
    Block &b = block();
    // In direct mode the exchange buffers are sized for the last fiber launch: refuse before
    // writing (warp_barrier would, one line too late).
    if (b.direct) throw BarrierInDirectMode{};
    unsigned w = fiber().linear / kWarp;
    uint64_t *slots = &b.warp_values[w * kWarp];
    slots[lane_id()] = bits;
    warp_barrier(mask, what);
    if (!(mask & (1u << src))) fail(std::string(what) + ": reads lane " + std::to_string(src) + ", which is not in the mask");
    uint64_t got = slots[src];
    warp_barrier(mask, what);
    return got;
}

template <class T>
T shuffle(unsigned mask, T value, unsigned src, const char *what) {
    static_assert(sizeof(T) <= 8, "shuffles move at most 8 bytes");
    uint64_t bits = 0;
    std::memcpy(&bits, &value, sizeof(T));
    bits = exchange(mask, bits, src, what);
    T out;
    std::memcpy(&out, &bits, sizeof(T));
    return out;
}

/// A fiber's first and only frame: runs the kernel for its thread, then parks for good.
[[noreturn]] inline void fiber_main() noexcept {
    Block &b = block();
    b.entry(b.args);
    b.current->done = true;
    b.exited++;
    if (b.barrier_arrived > 0) fail("a thread exited while others wait at __syncthreads()");
    for (;;) switch_to(b.current->context, b.scheduler);
}

/// Runs one block with each thread a plain call, in order: for kernels without barriers, where
/// fibers would only add a context switch per thread. Returns "" or the error.
inline std::string run_direct(Block &b, unsigned n, dim3 blk, bool reverse) {
    for (unsigned k = 0; k < n; k++) {
        unsigned t = reverse ? n - 1 - k : k;
        Fiber &f = b.fibers[t];
        f.linear = t;
        f.thread_idx = {t % blk.x, (t / blk.x) % blk.y, t / (blk.x * blk.y)};
        b.current = &f;
        try {
            b.entry(b.args);
        } catch (const BarrierInDirectMode &) {
            return "the kernel reached a barrier on a launch after launches that reached none "
                   "(a barrier under a data-dependent condition)";
        }
    }
    return "";
}

/// Runs one block with its threads as fibers; returns "" or the error.
inline std::string run_fibers(Block &b, unsigned n, dim3 blk, bool reverse) {
    unsigned warps = (n + kWarp - 1) / kWarp;
    b.exited = 0;
    b.barrier_arrived = 0;
    b.warp_arrived.assign(warps, 0);
    b.warp_generation.assign(warps, 0);
    b.warp_mask.assign(warps, 0);
    b.warp_values.assign(warps * kWarp, 0);
    for (unsigned t = 0; t < n; t++) {
        Fiber &f = b.fibers[t];
        f.stack.resize(kStackBytes);
        f.linear = t;
        f.thread_idx = {t % blk.x, (t / blk.x) % blk.y, t / (blk.x * blk.y)};
        f.done = false;
        start_context(f.context, f.stack, fiber_main);
    }
    // Round-robin until every thread is done; a round in which nothing moves is a deadlock (a
    // barrier some threads never reach).
    for (;;) {
        bool all_done = true;
        uint64_t before = b.barrier_generation;
        uint64_t warp_before = 0;
        for (uint64_t g : b.warp_generation) warp_before += g;
        unsigned exited_before = b.exited;
        for (unsigned k = 0; k < n; k++) {
            Fiber &f = b.fibers[reverse ? n - 1 - k : k];
            if (f.done) continue;
            b.current = &f;
            switch_to(b.scheduler, f.context);
            if (!b.error.empty()) return b.error;
            if (!f.done) all_done = false;
        }
        if (all_done) return "";
        uint64_t warp_after = 0;
        for (uint64_t g : b.warp_generation) warp_after += g;
        if (b.barrier_generation == before && warp_after == warp_before && b.exited == exited_before)
            return "deadlock: threads wait at a barrier that others never reach";
    }
}

#if defined(__linux__)
/// This library's thread-local storage on the calling thread: the module whose loaded code
/// holds this function (every emulator library has its own, hidden), its TLS segment's size
/// and this thread's copy of it (allocated: the caller has used `g_block`).
struct TlsBlock {
    char *data = nullptr;
    size_t size = 0;
};

inline int find_tls(dl_phdr_info *info, size_t, void *out) {
    const auto self = reinterpret_cast<uintptr_t>(&find_tls);
    bool ours = false;
    size_t size = 0;
    for (int i = 0; i < info->dlpi_phnum; i++) {
        const ElfW(Phdr) &ph = info->dlpi_phdr[i];
        const uintptr_t start = info->dlpi_addr + ph.p_vaddr;
        ours |= ph.p_type == PT_LOAD && self >= start && self < start + ph.p_memsz;
        if (ph.p_type == PT_TLS) size = ph.p_memsz;
    }
    if (!ours) return 0;
    auto *found = static_cast<TlsBlock *>(out);
    found->data = static_cast<char *>(info->dlpi_tls_data);
    found->size = size;
    return 1;
}

/// Poisons every `__shared__` array (the library's whole thread-local storage: 0xFF bytes),
/// keeping the emulator's own thread-locals (`g_block`, launch's block and barrier-free list,
/// passed as `keep`) as they were. Their initialisation guards, also thread-local, read
/// 0xFF as "initialised", which they are. Returns "" or why it could not.
template <class... Keep>
std::string poison_shared(Keep &...keep) {
    TlsBlock tls;
    dl_iterate_phdr(find_tls, &tls);
    if (tls.data == nullptr) return "the emulator found no thread-local storage of its own to poison";
    char saved[(sizeof(Keep) + ... + 0)];
    char *at = saved;
    ((std::memcpy(at, static_cast<void *>(&keep), sizeof(Keep)), at += sizeof(Keep)), ...);
    std::memset(tls.data, 0xFF, tls.size);
    at = saved;
    ((std::memcpy(static_cast<void *>(&keep), at, sizeof(Keep)), at += sizeof(Keep)), ...);
    return "";
}
#else
template <class... Keep>
std::string poison_shared(Keep &...) {
    return "";
}
#endif

/// Runs `entry(args)` as a grid of blocks; returns "" or the first error. A kernel's first
/// launch runs its threads as fibers; once a launch has finished without any thread reaching a
/// barrier or a warp operation, the kernel's later launches run threads as plain calls (direct
/// mode), thousands of times faster — and a barrier met there anyway is an error, not a
/// silent race.
inline std::string launch(void (*entry)(void **), dim3 grid, dim3 blk, void **args, bool reverse) {
    unsigned n = blk.x * blk.y * blk.z;
    if (n == 0 || n > 1024) return "block of " + std::to_string(n) + " threads (CUDA allows 1..1024)";
    if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.y > 65535 || grid.z > 65535)
        return "grid (" + std::to_string(grid.x) + "," + std::to_string(grid.y) + "," +
               std::to_string(grid.z) + ") out of CUDA's limits";
    static thread_local Block b;
    static thread_local std::vector<void (*)(void **)> barrier_free;
    b.grid = grid;
    b.block = blk;
    b.entry = entry;
    b.args = args;
    b.error.clear();
    b.fibers.resize(n);
    b.synced = false;
    b.direct = false;
    for (auto known : barrier_free) b.direct |= known == entry;
    Block *saved = g_block;
    g_block = &b;
    std::string error;
    for (unsigned bz = 0; bz < grid.z && error.empty(); bz++)
        for (unsigned by = 0; by < grid.y && error.empty(); by++)
            for (unsigned bx = 0; bx < grid.x && error.empty(); bx++) {
                b.block_idx = {bx, by, bz};
                if (!b.direct) error = poison_shared(g_block, b, barrier_free);
                if (!error.empty()) break;
                error = b.direct ? run_direct(b, n, blk, reverse) : run_fibers(b, n, blk, reverse);
            }
    g_block = saved;
    if (error.empty() && !b.direct && !b.synced) barrier_free.push_back(entry);
    return error;
}

/// Calls kernel `f` with its parameters read from `args` (cuLaunchKernel's convention: one
/// pointer per parameter, to a value of the parameter's type).
template <class... P, size_t... I>
void call_with(void (*f)(P...), void **args, std::index_sequence<I...>) {
    f(*static_cast<std::remove_cv_t<std::remove_reference_t<P>> *>(args[I])...);
}

template <class... P>
void invoke(void (*f)(P...), void **args) {
    call_with(f, args, std::index_sequence_for<P...>{});
}

/// A kernel's parameter sizes, so a launch whose packed parameters do not match is refused with a
/// message instead of reading garbage (which a GPU would do silently).
struct Signature {
    unsigned count;
    unsigned sizes[32];
};

template <class... P>
Signature signature_of(void (*)(P...)) {
    static_assert(sizeof...(P) <= 32, "at most 32 kernel parameters");
    return Signature{sizeof...(P), {(unsigned)sizeof(P)...}};
}

template <auto F>
Signature signature() {
    return signature_of(F);
}

/// "" when `sizes` (from the launcher) match the kernel's parameters, else what differs.
inline std::string check_signature(const Signature &s, const unsigned long *sizes, unsigned count) {
    bool same = count == s.count;
    for (unsigned i = 0; same && i < count; i++) same = sizes[i] == s.sizes[i];
    if (same) return "";
    std::string msg = "the kernel takes " + std::to_string(s.count) + " parameters (";
    for (unsigned i = 0; i < s.count; i++) msg += (i ? ", " : "") + std::to_string(s.sizes[i]);
    msg += " bytes) but the launch packed " + std::to_string(count) + " (";
    for (unsigned i = 0; i < count; i++) msg += (i ? ", " : "") + std::to_string(sizes[i]);
    return msg + " bytes)";
}

/// The launchable form of kernel `F`: what the registry maps its name expression to.
template <auto F>
void trampoline(void **args) {
    invoke(F, args);
}

}  // namespace redline_emu

// --- the kernel language --------------------------------------------------------------------

#define threadIdx (::redline_emu::fiber().thread_idx)
#define blockIdx (::redline_emu::block().block_idx)
#define blockDim (::redline_emu::block().block)
#define gridDim (::redline_emu::block().grid)
#define warpSize 32

inline void __syncthreads() { redline_emu::syncthreads(); }
inline void __syncwarp(unsigned mask = 0xffffffffu) { redline_emu::warp_barrier(mask, "__syncwarp"); }

template <class T>
T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
    unsigned lane = redline_emu::lane_id();
    unsigned base = lane - lane % (unsigned)width;
    return redline_emu::shuffle(mask, v, base + ((unsigned)src % (unsigned)width), "__shfl_sync");
}
template <class T>
T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
    unsigned lane = redline_emu::lane_id();
    unsigned base = lane - lane % (unsigned)width;
    unsigned src = lane + delta < base + (unsigned)width ? lane + delta : lane;
    return redline_emu::shuffle(mask, v, src, "__shfl_down_sync");
}
template <class T>
T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32) {
    unsigned lane = redline_emu::lane_id();
    unsigned base = lane - lane % (unsigned)width;
    unsigned src = lane >= base + delta ? lane - delta : lane;
    return redline_emu::shuffle(mask, v, src, "__shfl_up_sync");
}
template <class T>
T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
    unsigned lane = redline_emu::lane_id();
    unsigned base = lane - lane % (unsigned)width;
    unsigned src = lane ^ (unsigned)lane_mask;
    if (src < base || src >= base + (unsigned)width) src = lane;
    return redline_emu::shuffle(mask, v, src, "__shfl_xor_sync");
}

/// Every lane's predicate as a bit mask (one exchange per lane: slow, exact).
inline unsigned __ballot_sync(unsigned mask, int predicate) {
    unsigned bits = 0;
    for (unsigned l = 0; l < redline_emu::kWarp; l++) {
        if (!(mask & (1u << l))) continue;
        int p = redline_emu::shuffle(mask, predicate, l, "__ballot_sync");
        if (p) bits |= 1u << l;
    }
    return bits;
}
inline int __any_sync(unsigned mask, int predicate) { return __ballot_sync(mask, predicate) != 0; }
inline int __all_sync(unsigned mask, int predicate) { return __ballot_sync(mask, predicate) == mask; }

// Atomics: a block's threads run one at a time on one OS thread, and blocks one after another,
// so a plain read-modify-write is atomic here.
template <class T>
T atomicAdd(T *address, T value) {
    T old = *address;
    *address = old + value;
    return old;
}
template <class T>
T atomicMax(T *address, T value) {
    T old = *address;
    *address = old > value ? old : value;
    return old;
}
template <class T>
T atomicMin(T *address, T value) {
    T old = *address;
    *address = old < value ? old : value;
    return old;
}
template <class T>
T atomicExch(T *address, T value) {
    T old = *address;
    *address = value;
    return old;
}
template <class T>
T atomicOr(T *address, T value) {
    T old = *address;
    *address = old | value;
    return old;
}
template <class T>
T atomicCAS(T *address, T compare, T value) {
    T old = *address;
    if (old == compare) *address = value;
    return old;
}
inline void __threadfence() {}
inline void __threadfence_block() {}

template <class T>
T __ldg(const T *p) { return *p; }

/// CUDA's 16-byte vector type, for 128-bit loads (`load_pack`).
struct alignas(16) uint4 {
    unsigned int x, y, z, w;
};

// Intrinsics and math that CUDA has and the C++ library does not (or names differently).
inline float __expf(float x) { return std::exp(x); }
inline float __logf(float x) { return std::log(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline double rsqrt(double x) { return 1.0 / std::sqrt(x); }
inline float __saturatef(float x) { return x < 0.0f ? 0.0f : (x > 1.0f ? 1.0f : x); }
inline float __int_as_float(int x) { float f; std::memcpy(&f, &x, 4); return f; }
inline int __float_as_int(float x) { int i; std::memcpy(&i, &x, 4); return i; }
inline double __longlong_as_double(long long x) { double d; std::memcpy(&d, &x, 8); return d; }
inline long long __double_as_longlong(double x) { long long i; std::memcpy(&i, &x, 8); return i; }
inline float __uint_as_float(unsigned x) { float f; std::memcpy(&f, &x, 4); return f; }
inline unsigned __float_as_uint(float x) { unsigned u; std::memcpy(&u, &x, 4); return u; }
inline unsigned __umulhi(unsigned a, unsigned b) { return (unsigned)(((unsigned long long)a * b) >> 32); }
inline unsigned long long __umul64hi(unsigned long long a, unsigned long long b) {
    return (unsigned long long)(((unsigned __int128)a * b) >> 64);
}
// The float and double overloads the kernels call generically (CUDA has both).
using std::erf;
using std::exp;
using std::fabs;
using std::fma;
using std::fmax;
using std::fmin;
using std::isfinite;
using std::isinf;
using std::isnan;
using std::log;
using std::pow;
using std::sqrt;
using std::tanh;

// --- 16-bit floats: storage types with CUDA's conversion functions, nothing more, so a kernel
// that computes in half precision without converting fails here as it would read on a GPU. ----

struct __half {
    _Float16 value;
};
struct __nv_bfloat16 {
    unsigned short bits;
};

inline float __half2float(__half h) { return (float)h.value; }
inline __half __float2half(float f) { return __half{(_Float16)f}; }
inline __half __float2half_rn(float f) { return __half{(_Float16)f}; }
inline __half __double2half(double d) { return __half{(_Float16)d}; }

inline float __bfloat162float(__nv_bfloat16 b) { return __uint_as_float((unsigned)b.bits << 16); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
    unsigned u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return __nv_bfloat16{(unsigned short)((u >> 16) | 0x40u)};
    u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest, ties to even
    return __nv_bfloat16{(unsigned short)(u >> 16)};
}
inline __nv_bfloat16 __float2bfloat16(float f) { return __float2bfloat16_rn(f); }
inline __nv_bfloat16 __double2bfloat16(double d) {
    // Round once, from double: through float would round twice.
    double a = d < 0 ? -d : d;
    if (d != d) return __nv_bfloat16{0x7fc0};
    float f = (float)d;
    unsigned u = __float_as_uint(f);
    if ((double)(f < 0 ? -f : f) == a || std::isinf(f)) return __float2bfloat16_rn(f);
    // float rounding may have created a tie: nudge toward d before rounding to bf16.
    if ((u & 0xffffu) == 0x8000u) u += ((double)(f < 0 ? -f : f) < a) ? 1 : -1;
    return __float2bfloat16_rn(__uint_as_float(u));
}
