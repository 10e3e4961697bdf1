// Softmax and log-softmax along one axis: a block per row (the elements along the axis), a
// block-wide max, a block-wide sum of exp(x - max), then one pass writing the row. Computes in
// f32 for f32 and the half types, f64 for f64.
#include "block.cuh"

#define SOFTMAX_THREADS 256

/// Row r of `rows` (= outer × inner) holds logical elements (o·n + k)·inner + i for k < n,
/// with o = r / inner and i = r % inner, of x (layout `xs`) and of out (layout `os`).
template <class T, bool LOG>
__global__ void __launch_bounds__(SOFTMAX_THREADS)
    softmax(const T *__restrict__ x, Strided xs, T *__restrict__ out, Strided os, i64 rows, i64 n, i64 inner) {
    typedef typename Num<T>::acc A;
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const i64 base = (r / inner) * n * inner + r % inner;
        A m = -infinity<A>();
        for (i64 k = threadIdx.x; k < n; k += blockDim.x) m = MaxOp()(m, Num<T>::load(x[position(xs, base + k * inner)]));
        m = block_all(m, MaxOp());
        A s = (A)0;
        for (i64 k = threadIdx.x; k < n; k += blockDim.x) s += exp(Num<T>::load(x[position(xs, base + k * inner)]) - m);
        s = block_all(s, SumOp());
        const A log_s = log(s);
        for (i64 k = threadIdx.x; k < n; k += blockDim.x) {
            const A v = Num<T>::load(x[position(xs, base + k * inner)]) - m;
            out[position(os, base + k * inner)] = Num<T>::store(LOG ? v - log_s : exp(v) / s);
        }
    }
}
