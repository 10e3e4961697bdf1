// The emulator's own machinery, driven directly (`emulator_machinery.rs` compiles this file
// with `emulate.h` forced in front, as the kernels are, runs it and checks what it prints):
// fibers that keep their registers and stacks across barriers, and each synchronisation error a
// GPU would hang on or hide. One line per case: `name<TAB>` then "ok", the launch's error, or
// what went wrong.

#include <cstdio>
#include <string>

using redline_emu::launch;
using redline_emu::trampoline;

// A tree sum through shared memory: eight barriers, each thread's partial sum, its index and a
// pointer held in registers across every one of them, and a kilobyte of stack per thread that
// must still hold what the thread wrote when it resumes.
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
    long long stack_sum = 0;
    for (int i = 0; i < 256; i++) stack_sum += scratch[i] - (int)t * 7 - i;
    check[blockIdx.x * 256 + t] = stack_sum + (mine - in[blockIdx.x * 256 + t]);
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
// what an earlier launch left there is stale too).
__global__ void missing_barrier(int base, int *out) {
    __shared__ int slots[64];
    slots[threadIdx.x] = base + (int)threadIdx.x;
    out[threadIdx.x] = slots[63 - threadIdx.x];
}

static void report(const char *name, const std::string &what) {
    std::printf("%s\t%s\n", name, what.empty() ? "ok" : what.c_str());
}

#define LAUNCH(kernel, grid, block, reverse, ...)                                    \
    [&] {                                                                            \
        void *args_[] = {__VA_ARGS__};                                               \
        return launch(trampoline<&kernel>, dim3(grid), dim3(block), args_, reverse); \
    }()

int main() {
    // Registers and stacks across barriers, in both thread orders, over two blocks.
    for (bool reverse : {false, true}) {
        int in[512];
        for (int i = 0; i < 512; i++) in[i] = i * 3 - 100;
        int out[2] = {0, 0};
        long long check[512];
        const int *in_p = in;
        int *out_p = out;
        long long *check_p = check;
        std::string error = LAUNCH(tree_sum, 2, 256, reverse, &in_p, &out_p, &check_p);
        int expected[2] = {0, 0};
        for (int i = 0; i < 512; i++) expected[i / 256] += in[i];
        bool stacks = true;
        for (long long c : check) stacks &= c == 0;
        if (error.empty() && (out[0] != expected[0] || out[1] != expected[1]))
            error = "sums " + std::to_string(out[0]) + ", " + std::to_string(out[1]) +
                    " (expected " + std::to_string(expected[0]) + ", " +
                    std::to_string(expected[1]) + ")";
        if (error.empty() && !stacks) error = "a thread's stack changed across a barrier";
        report(reverse ? "tree sum, backward" : "tree sum, forward", error);
    }
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
        std::string error = LAUNCH(missing_barrier, 1, 64, reverse, &base, &out_p);
        int stale = 0;
        for (int t = 0; t < 64; t++) stale += out[t] != base + 63 - t;
        if (error.empty()) error = std::to_string(stale) + " of 64 threads read a stale slot";
        report(reverse ? "missing barrier, backward" : "missing barrier, forward", error);
    }
    // After all those failed launches, whose fibers were left parked mid-kernel, a good one
    // still runs.
    {
        int in[256], out[1] = {0};
        long long check[256];
        int sum = 0;
        for (int i = 0; i < 256; i++) sum += in[i] = i;
        const int *in_p = in;
        int *out_p = out;
        long long *check_p = check;
        std::string error = LAUNCH(tree_sum, 1, 256, true, &in_p, &out_p, &check_p);
        if (error.empty() && out[0] != sum) error = "sum " + std::to_string(out[0]);
        report("tree sum after failed launches", error);
    }
    return 0;
}
