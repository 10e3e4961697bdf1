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

/// How many of `targets[0..n)` are not `ignore` (every thread of the block gets the count).
__device__ __forceinline__ i64 kept_count(const i64 *__restrict__ targets, i64 n, i64 ignore) {
    i64 kept = 0;
    for (i64 i = threadIdx.x; i < n; i += blockDim.x) kept += targets[i] != ignore;
    return block_all(kept, SumOp());
}

/// Fused label-smoothed cross-entropy, a block per sample row r of logits x [n, c]: the row's
/// log-sum-exp, its loss term into `rows[r]` (0 when ignored, NaN for a kept target outside
/// [0, c)), and, when `grad` is not null, ∂loss/∂x for the row (contiguous) scaled by
/// 1/kept — each block counts the kept targets itself (n is a batch: cheap), so one launch
/// does it all. `cross_entropy_total` then sums the rows.
template <class T>
__global__ void __launch_bounds__(SOFTMAX_THREADS)
    cross_entropy_rows(const T *__restrict__ x, Strided xs, const i64 *__restrict__ targets, i64 n, i64 c,
                       double smoothing, i64 ignore, typename Num<T>::acc *__restrict__ rows, T *__restrict__ grad) {
    typedef typename Num<T>::acc A;
    const i64 kept_all = kept_count(targets, n, ignore);
    const A scale = (A)1 / (A)(kept_all > 1 ? kept_all : 1);
    const A eps = (A)smoothing;
    for (i64 r = blockIdx.x; r < n; r += gridDim.x) {
        const i64 t = targets[r];
        const bool kept = t != ignore;
        A m = -infinity<A>();
        for (i64 k = threadIdx.x; k < c; k += blockDim.x) m = MaxOp()(m, Num<T>::load(x[position(xs, r * c + k)]));
        m = block_all(m, MaxOp());
        // Σ (v − m), not Σ v: the smoothing term is then log s − mean(v − m), with no
        // cancellation of large logits against lse and no overflow of Σ v (whose inf times a
        // smoothing of 0 would be NaN).
        A s = (A)0, total = (A)0;
        for (i64 k = threadIdx.x; k < c; k += blockDim.x) {
            const A v = Num<T>::load(x[position(xs, r * c + k)]);
            s += exp(v - m);
            total += v - m;
        }
        s = block_all(s, SumOp());
        total = block_all(total, SumOp());
        const A lse = m + log(s);
        if (threadIdx.x == 0) {
            A loss = (A)0;
            if (kept && (t < 0 || t >= c)) loss = infinity<A>() - infinity<A>();  // NaN
            else if (kept) {
                loss = ((A)1 - eps) * (lse - Num<T>::load(x[position(xs, r * c + t)]));
                // None without smoothing: a masked (-inf) logit would make it 0 · inf = NaN.
                if (eps != (A)0) loss += eps * (log(s) - total / (A)c);
            }
            rows[r] = loss;
        }
        if (grad == nullptr) continue;
        for (i64 k = threadIdx.x; k < c; k += blockDim.x) {
            const A v = Num<T>::load(x[position(xs, r * c + k)]);
            const A hot = k == t ? (A)1 - eps : (A)0;
            grad[r * c + k] = Num<T>::store(kept ? scale * (exp(v - lse) - hot - eps / (A)c) : (A)0);
        }
    }
}

/// out[0] = Σ rows[0..n) / max(kept, 1), in a fixed order (one block): the mean loss.
template <class T>
__global__ void __launch_bounds__(SOFTMAX_THREADS)
    cross_entropy_total(const typename Num<T>::acc *__restrict__ rows, const i64 *__restrict__ targets, i64 n, i64 ignore,
                        T *__restrict__ out) {
    typedef typename Num<T>::acc A;
    const i64 kept = kept_count(targets, n, ignore);
    A sum = (A)0;
    for (i64 i = threadIdx.x; i < n; i += blockDim.x) sum += rows[i];
    sum = block_all(sum, SumOp());
    if (threadIdx.x == 0) out[0] = Num<T>::store(sum / (A)(kept > 1 ? kept : 1));
}
