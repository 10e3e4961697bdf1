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

/// Channels of a statistics block of the channels-last pass (batch_norm_stats_rows): a warp
/// reads this many adjacent channels of one row.
#define ROWS_LANES 32
/// Rows a statistics block of the channels-last pass reads at once (LANES × ROWS = 256 threads).
#define ROWS_AT_ONCE 8

/// batch_norm_stats for a dense channels-last x (and y, in the same layout): x is a [rows, C]
/// matrix in memory, so a warp reads ROWS_LANES adjacent channels of a row — coalesced, where
/// a block per channel would read one element per 128-byte line. Block (x, y) sums channels
/// [32·x, 32·x + 32) over rows [y·rows_per_block, …) into partials[y] ([2, C] each);
/// batch_norm_stats_combine adds the blocks' partials in order: the same bits every run.
template <class T, bool HAS_Y, bool GATE>
__global__ void __launch_bounds__(ROWS_LANES *ROWS_AT_ONCE)
    batch_norm_stats_rows(const T *__restrict__ x, const T *__restrict__ y,
                          const typename Stat<T>::type *__restrict__ gate,
                          typename Stat<T>::type *__restrict__ partials, i64 rows, i64 C,
                          i64 rows_per_block) {
    typedef typename Stat<T>::type S;
    __shared__ S part[2][ROWS_AT_ONCE][ROWS_LANES];
    const i64 c = (i64)blockIdx.x * ROWS_LANES + threadIdx.x;
    const i64 start = (i64)blockIdx.y * rows_per_block;
    const i64 end = start + rows_per_block < rows ? start + rows_per_block : rows;
    S sum = 0, dot = 0;
    if (c < C) {
        const S a = GATE ? gate[c] : (S)0, b = GATE ? gate[C + c] : (S)0;
        for (i64 r = start + threadIdx.y; r < end; r += ROWS_AT_ONCE) {
            const S xv = Num<T>::load(x[r * C + c]);
            S other = xv;
            if constexpr (HAS_Y) {
                other = Num<T>::load(y[r * C + c]);
                if constexpr (GATE) {
                    if (!gate_open<T>(a, xv, b)) other = 0;
                }
            }
            sum += other;
            dot += xv * other;
        }
    }
    part[0][threadIdx.y][threadIdx.x] = sum;
    part[1][threadIdx.y][threadIdx.x] = dot;
    __syncthreads();
    if (threadIdx.y == 0 && c < C) {
        S s = 0, d = 0;
        for (int k = 0; k < ROWS_AT_ONCE; k++) {
            s += part[0][k][threadIdx.x];
            d += part[1][k][threadIdx.x];
        }
        partials[(i64)blockIdx.y * 2 * C + c] = s;
        partials[(i64)blockIdx.y * 2 * C + C + c] = d;
    }
}

/// out[i] = Σ_k partials[k][i] over the `chunks` [2, C] partials: a block per i, its threads'
/// shares combined by block_all (an order fixed by the block size).
template <class S>
__global__ void __launch_bounds__(NORM_THREADS)
    batch_norm_stats_combine(const S *__restrict__ partials, i64 chunks, S *__restrict__ out, i64 C) {
    for (i64 i = blockIdx.x; i < 2 * C; i += gridDim.x) {
        S total = 0;
        for (i64 k = threadIdx.x; k < chunks; k += blockDim.x) total += partials[k * 2 * C + i];
        total = block_all(total, SumOp());
        if (threadIdx.x == 0) out[i] = total;
    }
}

/// batch_norm_apply over operands that share one dense layout, in memory order, a 16-byte pack
/// per step: element m of every operand is the same logical element, of channel
/// (m / cstride) % C (cstride: the channel axis's stride; 1 channels-last). `packs` packs, every
/// pointer 16-byte aligned (the launcher checks). The arithmetic is batch_norm_apply's: the
/// same bits.
template <class T, bool HAS_Y, bool RELU, bool GATE>
__global__ void batch_norm_apply_packed(const Pack16<T> *__restrict__ x, const Pack16<T> *__restrict__ y,
                                        const typename Stat<T>::type *__restrict__ coef,
                                        const typename Stat<T>::type *__restrict__ gate,
                                        Pack16<T> *__restrict__ out, i64 packs, i64 C, i64 cstride) {
    typedef typename Stat<T>::type S;
    const int K = 16 / sizeof(T);
    for (i64 p = first_index(); p < packs; p += grid_step()) {
        const i64 m = p * K;
        // The channel of the pack's first element, then stepped: one division per pack.
        i64 c = (m / cstride) % C, r = m % cstride;
        const Pack16<T> xp = x[p];
        Pack16<T> yp = xp;
        if constexpr (HAS_Y) yp = y[p];
        Pack16<T> o;
#pragma unroll
        for (int k = 0; k < K; k++) {
            const S xv = Num<T>::load(xp.v[k]);
            S v = affine(coef[c], xv, coef[C + c]);
            if constexpr (HAS_Y) {
                S yv = Num<T>::load(yp.v[k]);
                if constexpr (GATE) {
                    if (!gate_open<T>(gate[c], xv, gate[C + c])) yv = 0;
                }
                v += coef[2 * C + c] * yv;
            }
            if constexpr (RELU) v = v > (S)0 ? v : (S)0;  // NaN → 0, as the reference
            o.v[k] = Num<T>::store(v);
            if (++r == cstride) {
                r = 0;
                if (++c == C) c = 0;
            }
        }
        out[p] = o;
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
