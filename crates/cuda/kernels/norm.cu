// Batch norm as two kernels the front end composes (forward, backward, with the ReLU gate):
// per-channel sums in one pass (a block per channel), and the per-channel affine a·x + b
// (+ d·y), optionally through a ReLU, in one elementwise pass. Statistics accumulate in f32
// (f64 for f64 inputs). `affine` is the one expression both kernels use for a·x + b, so the
// gate's mask in the backward is the forward's ReLU mask by construction.
#include "block.cuh"

#define NORM_THREADS 256

/// The dtype of statistics and coefficients: f64 for f64, f32 for the rest.
template <class T>
struct Stat {
    typedef float type;
};
template <>
struct Stat<double> {
    typedef double type;
};

template <class S>
__device__ __forceinline__ S affine(S a, S x, S b) {
    return fma(a, x, b);
}

/// Whether a·x + b, stored as T the way batch_norm_apply stores it, is above 0 (NaN is not).
template <class T, class S>
__device__ __forceinline__ bool gate_open(S a, S x, S b) {
    return (S)Num<T>::load(Num<T>::store(affine(a, x, b))) > (S)0;
}

/// Logical element (b, c, s) of an [N, C, inner...] tensor.
__device__ __forceinline__ i64 channel_element(i64 b, i64 c, i64 s, i64 C, i64 inner) {
    return (b * C + c) * inner + s;
}

/// out[c] = Σ other, out[C + c] = Σ x·other over every (b, s) of channel c, where other is x,
/// or y (HAS_Y), masked by the gate [a; b] (GATE).
template <class T, bool HAS_Y, bool GATE>
__global__ void __launch_bounds__(NORM_THREADS)
    batch_norm_stats(const T *__restrict__ x, Strided xs, const T *__restrict__ y, Strided ys,
                     const typename Stat<T>::type *__restrict__ gate, typename Stat<T>::type *__restrict__ out, i64 N,
                     i64 C, i64 inner) {
    typedef typename Stat<T>::type S;
    const i64 count = N * inner;
    for (i64 c = blockIdx.x; c < C; c += gridDim.x) {
        S sum = 0, dot = 0;
        for (i64 j = threadIdx.x; j < count; j += blockDim.x) {
            const i64 l = channel_element(j / inner, c, j % inner, C, inner);
            const S xv = Num<T>::load(x[position(xs, l)]);
            S other = xv;
            if constexpr (HAS_Y) {
                other = Num<T>::load(y[position(ys, l)]);
                if constexpr (GATE) {
                    if (!gate_open<T>(gate[c], xv, gate[C + c])) other = 0;
                }
            }
            sum += other;
            dot += xv * other;
        }
        sum = block_all(sum, SumOp());
        dot = block_all(dot, SumOp());
        if (threadIdx.x == 0) {
            out[c] = sum;
            out[C + c] = dot;
        }
    }
}

/// out = coef[0,c]·x + coef[1,c] (+ coef[2,c]·y, y masked by the gate), then max(·, 0) (RELU).
template <class T, bool HAS_Y, bool RELU, bool GATE>
__global__ void batch_norm_apply(const T *__restrict__ x, Strided xs, const T *__restrict__ y, Strided ys,
                                 const typename Stat<T>::type *__restrict__ coef,
                                 const typename Stat<T>::type *__restrict__ gate, T *__restrict__ out, Strided os,
                                 i64 n, i64 C, i64 inner) {
    typedef typename Stat<T>::type S;
    for (i64 i = first_index(); i < n; i += grid_step()) {
        const i64 c = (i / inner) % C;
        const S xv = Num<T>::load(x[position(xs, i)]);
        S v = affine(coef[c], xv, coef[C + c]);
        if constexpr (HAS_Y) {
            S yv = Num<T>::load(y[position(ys, i)]);
            if constexpr (GATE) {
                if (!gate_open<T>(gate[c], xv, gate[C + c])) yv = 0;
            }
            v += coef[2 * C + c] * yv;
        }
        if constexpr (RELU) v = v > (S)0 ? v : (S)0;  // NaN → 0, as the reference
        out[position(os, i)] = Num<T>::store(v);
    }
}

/// Batch norm's forward coefficients, a thread per channel (C is at most a few thousand): from
/// the sums [Σx; Σx²], coef = [rstd·w; b − mean·rstd·w; residual] and saved = [mean; rstd],
/// and the running statistics updated in place (unbiased variance) — one launch for what the
/// composition takes ~30. S: the statistics dtype. weight, bias and the running statistics may
/// be null.
template <class S>
__global__ void batch_norm_coef(const S *__restrict__ sums, const S *__restrict__ weight,
                                const S *__restrict__ bias, S *__restrict__ running_mean,
                                S *__restrict__ running_var, S *__restrict__ coef, S *__restrict__ saved,
                                double count, double eps, double momentum, i64 residual, i64 C) {
    const S n = (S)count, m = (S)momentum;
    for (i64 c = first_index(); c < C; c += grid_step()) {
        const S mean = sums[c] / n;
        S var = sums[C + c] / n - mean * mean;
        var = var > (S)0 ? var : (S)0;
        if (running_mean != nullptr) {
            const S unbiased = n / ((n > (S)2 ? n : (S)2) - (S)1);
            running_mean[c] = ((S)1 - m) * running_mean[c] + m * mean;
            running_var[c] = ((S)1 - m) * running_var[c] + m * unbiased * var;
        }
        const S rstd = (S)1 / sqrt(var + (S)eps);
        const S scale = weight != nullptr ? rstd * weight[c] : rstd;
        coef[c] = scale;
        coef[C + c] = (bias != nullptr ? bias[c] : (S)0) - mean * scale;
        coef[2 * C + c] = residual ? (S)1 : (S)0;
        saved[c] = mean;
        saved[C + c] = rstd;
    }
}

/// Batch norm's backward coefficients, a thread per channel: from the sums [Σg; Σx·g] and the
/// forward's [mean; rstd], coef = [k0; k1; rw] for dx = rw·g + k0·x + k1, dw and db.
template <class S>
__global__ void batch_norm_grad_coef(const S *__restrict__ sums, const S *__restrict__ saved,
                                     const S *__restrict__ weight, S *__restrict__ coef,
                                     S *__restrict__ dw, S *__restrict__ db, double count, i64 C) {
    const S n = (S)count;
    for (i64 c = first_index(); c < C; c += grid_step()) {
        const S mean = saved[c], rstd = saved[C + c];
        const S sum_g = sums[c], sum_xg = sums[C + c];
        const S centred = sum_xg - mean * sum_g;
        const S rw = weight != nullptr ? rstd * weight[c] : rstd;
        const S k0 = -(rw * rstd * rstd * centred) / n;
        coef[c] = k0;
        coef[C + c] = -(rw * sum_g) / n - mean * k0;
        coef[2 * C + c] = rw;
        dw[c] = rstd * centred;
        db[c] = sum_g;
    }
}
