// Block-wide reductions shared by the families that reduce rows or channels (reduce, softmax,
// norm): a warp-shuffle tree, one exchange through shared memory, every thread gets the result.
// Blocks are a multiple of 32 threads (at most 1024). The order of combination depends only on
// the block size, so every run gives the same bits.
#pragma once
#include "common.cuh"

#define FULL_MASK 0xffffffffu

struct SumOp {
    template <class A>
    __device__ __forceinline__ A operator()(A a, A b) const { return a + b; }
};

/// NaN wins; otherwise the larger.
struct MaxOp {
    template <class A>
    __device__ __forceinline__ A operator()(A a, A b) const { return a != a ? a : (b != b ? b : (a > b ? a : b)); }
};

/// `op` over every thread's `v`, returned to every thread. Safe to call again at once: it
/// ends with a barrier, so the next call's writes cannot overtake this call's reads.
template <class A, class Op>
__device__ __forceinline__ A block_all(A v, Op op) {
    __shared__ A partial[32];
    const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
    for (int offset = 16; offset > 0; offset /= 2) v = op(v, __shfl_xor_sync(FULL_MASK, v, offset));
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    A total = partial[0];
    for (unsigned w = 1; w < warps; w++) total = op(total, partial[w]);
    __syncthreads();
    return total;
}
