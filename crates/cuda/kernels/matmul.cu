// Batched matrix product through shared-memory tiles: the reference GEMM that runs everywhere
// (the host emulator included) and the fallback where cuBLASLt is not at hand. Operands arrive
// strided (transposes and broadcast batches are strides); products accumulate in f32 for f32
// and the half types, f64 for f64.
#include "common.cuh"

#define MATMUL_TILE 16

/// c[z, m, n] = Σ_k a[z, m, k] · b[z, k, n]; `ab`/`bb` place batch z (row-major over the batch
/// axes) in a and b; (am, ak) and (bk, bn) are the matrix strides; c is contiguous.
template <class T>
__global__ void __launch_bounds__(MATMUL_TILE *MATMUL_TILE)
    matmul(const T *__restrict__ a, Strided ab, i64 am, i64 ak, const T *__restrict__ b, Strided bb, i64 bk, i64 bn,
           T *__restrict__ c, i64 batch, i64 M, i64 N, i64 K) {
    typedef typename Num<T>::acc A;
    __shared__ A ta[MATMUL_TILE][MATMUL_TILE];
    __shared__ A tb[MATMUL_TILE][MATMUL_TILE];
    const int tx = threadIdx.x, ty = threadIdx.y;
    const i64 row = (i64)blockIdx.y * MATMUL_TILE + ty, col = (i64)blockIdx.x * MATMUL_TILE + tx;
    for (i64 z = blockIdx.z; z < batch; z += gridDim.z) {
        const i64 a0 = position(ab, z), b0 = position(bb, z);
        A acc = 0;
        for (i64 k0 = 0; k0 < K; k0 += MATMUL_TILE) {
            ta[ty][tx] = row < M && k0 + tx < K ? (A)Num<T>::load(a[a0 + row * am + (k0 + tx) * ak]) : (A)0;
            tb[ty][tx] = k0 + ty < K && col < N ? (A)Num<T>::load(b[b0 + (k0 + ty) * bk + col * bn]) : (A)0;
            __syncthreads();
            for (int k = 0; k < MATMUL_TILE; k++) acc += ta[ty][k] * tb[k][tx];
            __syncthreads();
        }
        if (row < M && col < N) c[(z * M + row) * N + col] = Num<T>::store(acc);
    }
}
