// The emulator's own machinery, driven directly (`emulator_machinery.rs` compiles this file
// with `emulate.h` forced in front, as the kernels are, runs it and checks what it prints):
// fibers that keep their registers, stacks and alignment across barriers, and each
// synchronisation error a GPU would hang on or hide. One line per case: `name<TAB>` then "ok",
// the launch's error, or what went wrong.

#include <cstdint>
#include <cstdio>
#include <string>

using redline_emu::launch;
using redline_emu::trampoline;

// How far this function's frame is from a 16-byte boundary: 0 when its caller's stack was
// aligned as the ABI requires, which a fiber's first frame must be too (SSE spills and
// `alignas` locals rely on it).
__attribute__((noinline)) static unsigned frame_misalignment() {
    return (unsigned)((uintptr_t)__builtin_frame_address(0) % 16);
}

// A tree sum through shared memory: nine barriers, each thread's partial sum, its index and a
// pointer held in registers across every one of them, and a kilobyte of stack per thread that
// must still hold what the thread wrote when it resumes. `check` gets, per thread, anything
// that changed plus its frame's misalignment: all zero when the fibers are sound.
__global__ void tree_sum(const int *in, int *out, long long *check) {
    __shared__ int partial[256];
    unsigned t = threadIdx.x;
    volatile int scratch[256];
    for (int i = 0; i < 256; i++) scratch[i] = (int)t * 7 + i;
    int mine = in[blockIdx.x * 256 + t];
    partial[t] = mine;
    __syncthreads();
    for (unsigned half = 128; half > 0; half /= 2) {
        if (t < half) partial[t] += partial[t + half];
        __syncthreads();
    }
    long long changed = 0;
    for (int i = 0; i < 256; i++) changed += scratch[i] - (int)t * 7 - i;
    changed += mine - in[blockIdx.x * 256 + t];
    check[blockIdx.x * 256 + t] = changed + frame_misalignment();
    if (t == 0) out[blockIdx.x] = partial[0];
}

// Lanes pass values round the warp with shuffles; every lane must end with the warp's sum.
__global__ void warp_sum(int *out) {
    int v = (int)threadIdx.x + 1;
    for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
    out[threadIdx.x] = v;
}

// Thread 0 leaves before the barrier the others wait at.
__global__ void early_exit() {
    if (threadIdx.x == 0) return;
    __syncthreads();
}

// Thread 0 waits for lane 1 at a warp barrier, lane 1 for thread 0 at the block's.
__global__ void crossed_barriers() {
    if (threadIdx.x == 0) __syncwarp(0x3u);
    else __syncthreads();
}

__global__ void lane_outside_its_mask() { __syncwarp(0x2u); }

__global__ void mask_past_the_block() { __syncwarp(0xffffffffu); }

__global__ void lanes_with_different_masks() { __syncwarp(threadIdx.x == 0 ? 0x3u : 0x7u); }

__global__ void shuffle_from_outside_the_mask(int *out) {
    out[threadIdx.x] = __shfl_sync(0x3u, (int)threadIdx.x, 5);
}

// A barrier only when the data says so: legal on a GPU when uniform, but the emulator runs a
// kernel whose launch met no barrier without fibers from then on, so it must refuse this.
__global__ void barrier_when(int flag) {
    if (flag) __syncthreads();
}

// Each thread writes its slot and reads its mirror's with no barrier between: whichever order
// the block's threads start in, some read a slot not yet written (`base` differs per launch, so
// what an earlier launch left there is stale too). Two instantiations, so each is a kernel's
// first launch, which runs as fibers.
template <int Instance>
__global__ void missing_barrier(int base, int *out) {
    __shared__ int slots[64];
    slots[threadIdx.x] = base + (int)threadIdx.x;
    out[threadIdx.x] = slots[63 - threadIdx.x];
}

// Block `writer` (none when out of the grid) writes a shared cell; every block then reads it.
// A block that did not write must read the poison (NaN), not zero or another block's value.
__global__ void reads_shared_it_did_not_write(unsigned writer, float *out) {
    __shared__ float cell[1];
    if (blockIdx.x == writer && threadIdx.x == 0) cell[0] = 1.5f;
    __syncthreads();
    if (threadIdx.x == 0) out[blockIdx.x] = cell[0];
}

static void report(const char *name, const std::string &what) {
    std::printf("%s\t%s\n", name, what.empty() ? "ok" : what.c_str());
    std::fflush(stdout);  // a crash later must not lose the lines before it
}

#define LAUNCH(kernel, grid, block, reverse, ...)                                    \
    [&] {                                                                            \
        void *args_[] = {__VA_ARGS__};                                               \
        return launch(trampoline<&kernel>, dim3(grid), dim3(block), args_, reverse); \
    }()

// Runs `tree_sum` over `blocks` blocks; "" or what went wrong.
static std::string tree_sum_case(int blocks, bool reverse) {
    int in[512], out[2] = {0, 0}, expected[2] = {0, 0};
    long long check[512];
    for (int i = 0; i < 512; i++) in[i] = i * 3 - 100;
    for (int i = 0; i < blocks * 256; i++) expected[i / 256] += in[i];
    const int *in_p = in;
    int *out_p = out;
    long long *check_p = check;
    std::string error = LAUNCH(tree_sum, blocks, 256, reverse, &in_p, &out_p, &check_p);
    if (!error.empty()) return error;
    for (int b = 0; b < blocks; b++)
        if (out[b] != expected[b])
            return "block " + std::to_string(b) + " summed " + std::to_string(out[b]) +
                   " (expected " + std::to_string(expected[b]) + ")";
    for (int i = 0; i < blocks * 256; i++)
        if (check[i] != 0)
            return "thread " + std::to_string(i) + "'s stack, registers or alignment changed (" +
                   std::to_string(check[i]) + ")";
    return "";
}

int main() {
    report("tree sum, forward", tree_sum_case(2, false));
    report("tree sum, backward", tree_sum_case(2, true));
    {
        int out[32] = {};
        int *out_p = out;
        std::string error = LAUNCH(warp_sum, 1, 32, false, &out_p);
        for (int v : out)
            if (error.empty() && v != 32 * 33 / 2) error = "a lane ended with " + std::to_string(v);
        report("warp sum", error);
    }
    report("early exit, forward", LAUNCH(early_exit, 1, 64, false, nullptr));
    report("early exit, backward", LAUNCH(early_exit, 1, 64, true, nullptr));
    // 63 fibers were left parked at that barrier: the next launch must start afresh.
    report("tree sum after a failed launch", tree_sum_case(1, false));
    report("crossed barriers", LAUNCH(crossed_barriers, 1, 2, false, nullptr));
    report("lane outside its mask", LAUNCH(lane_outside_its_mask, 1, 32, false, nullptr));
    report("mask past the block", LAUNCH(mask_past_the_block, 1, 20, false, nullptr));
    report("different masks", LAUNCH(lanes_with_different_masks, 1, 3, false, nullptr));
    {
        int out[32] = {};
        int *out_p = out;
        report("shuffle from outside the mask",
               LAUNCH(shuffle_from_outside_the_mask, 1, 2, false, &out_p));
    }
    {
        int off = 0, on = 1;
        std::string first = LAUNCH(barrier_when, 1, 32, false, &off);
        std::string second = LAUNCH(barrier_when, 1, 32, false, &on);
        report("barrier under a data-dependent condition",
               first.empty() ? second : "the first launch failed: " + first);
    }
    for (bool reverse : {false, true}) {
        int out[64] = {};
        int *out_p = out;
        int base = reverse ? 2000 : 1000;
        std::string error = reverse ? LAUNCH(missing_barrier<1>, 1, 64, true, &base, &out_p)
                                    : LAUNCH(missing_barrier<0>, 1, 64, false, &base, &out_p);
        int stale = 0;
        for (int t = 0; t < 64; t++) stale += out[t] != base + 63 - t;
        if (error.empty()) error = std::to_string(stale) + " of 64 threads read a stale slot";
        report(reverse ? "missing barrier, backward" : "missing barrier, forward", error);
    }
    {
        // Block 0 writes, block 1 does not; then a launch in which no block writes.
        float out[2] = {0, 0};
        float *out_p = out;
        unsigned first = 0, none = 2;
        std::string error = LAUNCH(reads_shared_it_did_not_write, 2, 32, false, &first, &out_p);
        if (error.empty() && (out[0] != 1.5f || out[1] == out[1]))
            error = "with block 0 writing, blocks read " + std::to_string(out[0]) + " and " +
                    std::to_string(out[1]);
        if (error.empty()) error = LAUNCH(reads_shared_it_did_not_write, 2, 32, false, &none, &out_p);
        if (error.empty() && (out[0] == out[0] || out[1] == out[1]))
            error = "with no block writing, blocks read " + std::to_string(out[0]) + " and " +
                    std::to_string(out[1]);
        report("shared memory a block did not write reads as NaN", error);
    }
    return 0;
}
