// Batch norm as two passes the front end composes (forward, backward, with the ReLU gate):
// per-channel sums, and the per-channel affine a·x + b (+ d·y), optionally through a ReLU, in
// one elementwise pass. Each pass has a general kernel (any layout, logical order) and kernels
// for the dense layouts a training step makes, walked in memory order: a dense channels-last
// tensor as rows of channels (the rows kernels), any one dense layout in 16-byte packs.
// Statistics accumulate in f32 (f64 for f64 inputs). `affine` is the one expression every
// kernel uses for a·x + b, so the gate's mask in the backward is the forward's ReLU mask by
// construction.
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

/// The value a channel's sums are taken about for a centre k: k, or 0 where k is not finite (the
/// raw sums, whose non-finite results are PyTorch's).
template <class S>
__device__ __forceinline__ S finite_or_zero(S k) {
    return isfinite(k) ? k : (S)0;
}

/// Whether a·x + b, stored as T the way batch_norm_apply stores it, is above 0 (NaN is not).
template <class T, class S>
__device__ __forceinline__ bool gate_open(S a, S x, S b) {
    return (S)Num<T>::load(Num<T>::store(affine(a, x, b))) > (S)0;
}

/// One output of the affine: a·x + b (+ d·y, y zeroed where the gate [ga; gb] is shut), then
/// the ReLU (RELU). Every apply kernel computes through this, so their bits agree.
template <class T, bool HAS_Y, bool RELU, bool GATE, class S>
__device__ __forceinline__ T affine_out(S a, S b, S d, S ga, S gb, T x, T y) {
    const S xv = Num<T>::load(x);
    S v = affine(a, xv, b);
    if constexpr (HAS_Y) {
        S yv = Num<T>::load(y);
        if constexpr (GATE) {
            if (!gate_open<T>(ga, xv, gb)) yv = 0;
        }
        v += d * yv;
    }
    if constexpr (RELU) v = v > (S)0 ? v : (S)0;  // NaN → 0, as the reference
    return Num<T>::store(v);
}

/// Logical element (b, c, s) of an [N, C, inner...] tensor.
__device__ __forceinline__ i64 channel_element(i64 b, i64 c, i64 s, i64 C, i64 inner) {
    return (b * C + c) * inner + s;
}

/// out[c] = Σ other, out[C + c] = Σ (x − k)·other over every (b, s) of channel c, where
/// other is x − k, or y (HAS_Y), masked by the gate [a; b] (GATE, on x itself); k is
/// centre[c] (finite_or_zero), or 0 when centre is null — the backward passes the forward's
/// mean, so the sums hold Σ(x − mean)·g without the cancellation of Σx·g − mean·Σg.
template <class T, bool HAS_Y, bool GATE>
__global__ void __launch_bounds__(NORM_THREADS)
    batch_norm_stats(const T *__restrict__ x, Strided xs, const T *__restrict__ y, Strided ys,
                     const typename Stat<T>::type *__restrict__ gate,
                     const typename Stat<T>::type *__restrict__ centre, typename Stat<T>::type *__restrict__ out,
                     i64 N, i64 C, i64 inner) {
    typedef typename Stat<T>::type S;
    const i64 count = N * inner;
    for (i64 c = blockIdx.x; c < C; c += gridDim.x) {
        const S k = centre != nullptr ? finite_or_zero(centre[c]) : (S)0;
        S sum = 0, dot = 0;
        for (i64 j = threadIdx.x; j < count; j += blockDim.x) {
            const i64 l = channel_element(j / inner, c, j % inner, C, inner);
            const S xv = Num<T>::load(x[position(xs, l)]);
            S other = xv - k;
            if constexpr (HAS_Y) {
                other = Num<T>::load(y[position(ys, l)]);
                if constexpr (GATE) {
                    if (!gate_open<T>(gate[c], xv, gate[C + c])) other = 0;
                }
            }
            sum += other;
            dot += (xv - k) * other;
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
        const T xv = x[position(xs, i)];
        const T yv = HAS_Y ? y[position(ys, i)] : xv;
        const S d = HAS_Y ? coef[2 * C + c] : (S)0;
        const S ga = GATE ? gate[c] : (S)0, gb = GATE ? gate[C + c] : (S)0;
        out[position(os, i)] = affine_out<T, HAS_Y, RELU, GATE>(coef[c], coef[C + c], d, ga, gb, xv, yv);
    }
}

/// V adjacent channels of one row, moved at once: a T (V = 1) or a 16-byte pack.
template <class T, int V>
struct alignas(sizeof(T) * V) Channels {
    T v[V];
};

// The rows kernels take a dense channels-last tensor as a [rows, C] matrix in memory and give
// each thread V adjacent channels — column q of the C / V columns — for every row it visits,
// so its per-channel values (gate, coefficients) are read once into registers. A block is
// 256 threads: blockDim.x lanes across the columns (a power of two, at most a warp) times
// blockDim.y rows at once, so a warp reads one run of memory (32 columns of a row, or whole
// adjacent rows when a row has fewer columns). Block (x, y) covers columns [x·lanes, …) and
// rows y·blockDim.y + ty, stepping by gridDim.y·blockDim.y. The launcher (ops/norm.rs
// RowsPlan) picks V = 16 bytes only when C is a whole number of packs and every pointer is
// 16-byte aligned.

/// batch_norm_stats over the rows (HAS_Y, GATE, centre as there): block (x, y) writes the sums
/// of its columns over its rows into partials[y] ([2, C] each), after halving its rows in
/// shared memory in a fixed order; batch_norm_stats_combine adds the partials in order. The
/// same bits every run. With first_out (only without y, and rows > 0), the sums are centred
/// on x's first row — each channel's first element, a few σ from its mean whatever that is —
/// instead, and blocks y = 0 write those centres there (finite_or_zero) for the coefficients'
/// launch.
template <class T, int V, bool HAS_Y, bool GATE>
__device__ __forceinline__ void stats_rows(const T *__restrict__ x, const T *__restrict__ y,
                                           const typename Stat<T>::type *__restrict__ gate,
                                           const typename Stat<T>::type *__restrict__ centre,
                                           typename Stat<T>::type *__restrict__ first_out,
                                           typename Stat<T>::type *__restrict__ partials, i64 rows, i64 C) {
    typedef typename Stat<T>::type S;
    typedef Channels<T, V> Run;
    __shared__ S part[2][V][NORM_THREADS];
    const i64 columns = C / V, q = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    const unsigned t = threadIdx.y * blockDim.x + threadIdx.x;
    S sum[V], dot[V], ga[V], gb[V], mid[V];
#pragma unroll
    for (int k = 0; k < V; k++) sum[k] = dot[k] = ga[k] = gb[k] = mid[k] = 0;
    if (q < columns) {
        if constexpr (GATE) {
#pragma unroll
            for (int k = 0; k < V; k++) {
                ga[k] = gate[q * V + k];
                gb[k] = gate[C + q * V + k];
            }
        }
        const Run *xr = reinterpret_cast<const Run *>(x);
        // The first row only without y (the forward): the backward's instantiations never
        // read it, which keeps their registers under the 64 the packed kernel has.
        bool from_first_row = false;
        if constexpr (!HAS_Y) from_first_row = first_out != nullptr && rows > 0;
        if (from_first_row) {
            const Run first = xr[q];
#pragma unroll
            for (int k = 0; k < V; k++) mid[k] = finite_or_zero(Num<T>::load(first.v[k]));
            if (blockIdx.y == 0 && threadIdx.y == 0) {
#pragma unroll
                for (int k = 0; k < V; k++) first_out[q * V + k] = mid[k];
            }
        } else if (centre != nullptr) {
#pragma unroll
            for (int k = 0; k < V; k++) mid[k] = finite_or_zero(centre[q * V + k]);
        }
        const Run *yr = reinterpret_cast<const Run *>(y);
        // Two rows' loads in flight a thread, not more: registers hold V sums and V dots.
#pragma unroll 2
        for (i64 r = (i64)blockIdx.y * blockDim.y + threadIdx.y; r < rows; r += (i64)gridDim.y * blockDim.y) {
            const Run xv = xr[r * columns + q];
            Run yv = xv;
            if constexpr (HAS_Y) yv = yr[r * columns + q];
#pragma unroll
            for (int k = 0; k < V; k++) {
                const S xk = Num<T>::load(xv.v[k]);
                S other = xk - mid[k];
                if constexpr (HAS_Y) {
                    other = Num<T>::load(yv.v[k]);
                    if constexpr (GATE) {
                        if (!gate_open<T>(ga[k], xk, gb[k])) other = 0;
                    }
                }
                sum[k] += other;
                dot[k] += (xk - mid[k]) * other;
            }
        }
    }
#pragma unroll
    for (int k = 0; k < V; k++) {
        part[0][k][t] = sum[k];
        part[1][k][t] = dot[k];
    }
    // Halve the block's rows until one is left (blockDim.y is a power of two).
    for (unsigned half = blockDim.y / 2; half > 0; half /= 2) {
        __syncthreads();
        if (threadIdx.y < half) {
            const unsigned u = t + half * blockDim.x;
#pragma unroll
            for (int k = 0; k < V; k++) {
                part[0][k][t] += part[0][k][u];
                part[1][k][t] += part[1][k][u];
            }
        }
    }
    // Row 0 reads the slots it wrote itself last.
    if (threadIdx.y == 0 && q < columns) {
        S *out = partials + (i64)blockIdx.y * 2 * C + q * V;
#pragma unroll
        for (int k = 0; k < V; k++) {
            out[k] = part[0][k][t];
            out[C + k] = part[1][k][t];
        }
    }
}

/// The rows sums a channel at a time (C not a whole number of packs, or a pointer unaligned).
template <class T, bool HAS_Y, bool GATE>
__global__ void __launch_bounds__(NORM_THREADS)
    batch_norm_stats_rows(const T *__restrict__ x, const T *__restrict__ y,
                          const typename Stat<T>::type *__restrict__ gate,
                          const typename Stat<T>::type *__restrict__ centre,
                          typename Stat<T>::type *__restrict__ first_out,
                          typename Stat<T>::type *__restrict__ partials, i64 rows, i64 C) {
    stats_rows<T, 1, HAS_Y, GATE>(x, y, gate, centre, first_out, partials, rows, C);
}

/// The rows sums a 16-byte pack of channels at a time (128-bit loads). Four blocks a
/// multiprocessor (at most 64 registers): left to itself, ptxas gives the half types 32 on
/// sm_90 and spills the sixteen sums.
template <class T, bool HAS_Y, bool GATE>
__global__ void __launch_bounds__(NORM_THREADS, 4)
    batch_norm_stats_rows_packed(const T *__restrict__ x, const T *__restrict__ y,
                                 const typename Stat<T>::type *__restrict__ gate,
                                 const typename Stat<T>::type *__restrict__ centre,
                                 typename Stat<T>::type *__restrict__ first_out,
                                 typename Stat<T>::type *__restrict__ partials, i64 rows, i64 C) {
    stats_rows<T, 16 / sizeof(T), HAS_Y, GATE>(x, y, gate, centre, first_out, partials, rows, C);
}

/// batch_norm_apply over the rows, a 16-byte pack of channels at a time: each thread reads its
/// channels' coefficients (and gate) once, then streams its rows with 128-bit loads and
/// stores — where batch_norm_apply_packed, walking memory in one line, reads them per element
/// and a warp's lanes hit 32 different channels' coefficients.
template <class T, bool HAS_Y, bool RELU, bool GATE>
__global__ void __launch_bounds__(NORM_THREADS)
    batch_norm_apply_rows_packed(const Pack16<T> *__restrict__ x, const Pack16<T> *__restrict__ y,
                                 const typename Stat<T>::type *__restrict__ coef,
                                 const typename Stat<T>::type *__restrict__ gate, Pack16<T> *__restrict__ out,
                                 i64 rows, i64 C) {
    typedef typename Stat<T>::type S;
    const int K = 16 / sizeof(T);
    const i64 columns = C / K, q = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (q >= columns) return;
    S a[K], b[K], d[K], ga[K], gb[K];
#pragma unroll
    for (int k = 0; k < K; k++) {
        const i64 c = q * K + k;
        a[k] = coef[c];
        b[k] = coef[C + c];
        d[k] = HAS_Y ? coef[2 * C + c] : (S)0;
        ga[k] = GATE ? gate[c] : (S)0;
        gb[k] = GATE ? gate[C + c] : (S)0;
    }
    for (i64 r = (i64)blockIdx.y * blockDim.y + threadIdx.y; r < rows; r += (i64)gridDim.y * blockDim.y) {
        const i64 p = r * columns + q;
        const Pack16<T> xp = x[p];
        Pack16<T> yp = xp;
        if constexpr (HAS_Y) yp = y[p];
        Pack16<T> o;
#pragma unroll
        for (int k = 0; k < K; k++)
            o.v[k] = affine_out<T, HAS_Y, RELU, GATE>(a[k], b[k], d[k], ga[k], gb[k], xp.v[k], yp.v[k]);
        out[p] = o;
    }
}

/// Σ_k partials[k][i] over the `chunks` [2, C] partials, by the whole block: its threads'
/// shares combined by block_all (an order fixed by the block size), so every kernel that
/// combines partials gets the same bits.
template <class S>
__device__ __forceinline__ S combined(const S *__restrict__ partials, i64 chunks, i64 C, i64 i) {
    S total = 0;
    for (i64 k = threadIdx.x; k < chunks; k += blockDim.x) total += partials[k * 2 * C + i];
    return block_all(total, SumOp());
}

/// out[i] = Σ_k partials[k][i]: a block per i.
template <class S>
__global__ void __launch_bounds__(NORM_THREADS)
    batch_norm_stats_combine(const S *__restrict__ partials, i64 chunks, S *__restrict__ out, i64 C) {
    for (i64 i = blockIdx.x; i < 2 * C; i += gridDim.x) {
        const S total = combined(partials, chunks, C, i);
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
            const S d = HAS_Y ? coef[2 * C + c] : (S)0;
            const S ga = GATE ? gate[c] : (S)0, gb = GATE ? gate[C + c] : (S)0;
            o.v[k] = affine_out<T, HAS_Y, RELU, GATE>(coef[c], coef[C + c], d, ga, gb, xp.v[k], yp.v[k]);
            if (++r == cstride) {
                r = 0;
                if (++c == C) c = 0;
            }
        }
        out[p] = o;
    }
}

/// Channel c's forward coefficients from its sums Σx and Σx² over n elements, taken about k
/// (centre[c] through finite_or_zero; 0 when centre is null): coef = [rstd·w; b − mean·rstd·w;
/// residual] and saved = [mean; rstd], and the running statistics updated in place (unbiased
/// variance). centre, weight, bias and the running statistics may be null. Raw moments
/// (k = 0) lose (mean/σ)² ulps of the variance; the training forward centres on each
/// channel's first element.
template <class S>
__device__ __forceinline__ void forward_coef(i64 c, i64 C, S sum_x, S sum_xx, const S *__restrict__ centre,
                                             const S *__restrict__ weight, const S *__restrict__ bias,
                                             S *__restrict__ running_mean, S *__restrict__ running_var,
                                             S *__restrict__ coef, S *__restrict__ saved, S n, S m, double eps,
                                             i64 residual) {
    const S k = centre != nullptr ? finite_or_zero(centre[c]) : (S)0;
    const S offset = sum_x / n, mean = k + offset;
    S var = sum_xx / n - offset * offset;
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

/// Channel c's backward coefficients from its sums Σg and Σ(x − mean)·g over n elements and
/// the forward's [mean; rstd]: coef = [k0; k1; rw] for dx = rw·g + k0·x + k1, dw and db.
template <class S>
__device__ __forceinline__ void backward_coef(i64 c, i64 C, S sum_g, S centred, const S *__restrict__ saved,
                                              const S *__restrict__ weight, S *__restrict__ coef,
                                              S *__restrict__ dw, S *__restrict__ db, S n) {
    const S mean = saved[c], rstd = saved[C + c];
    const S rw = weight != nullptr ? rstd * weight[c] : rstd;
    const S k0 = -(rw * rstd * rstd * centred) / n;
    coef[c] = k0;
    coef[C + c] = -(rw * sum_g) / n - mean * k0;
    coef[2 * C + c] = rw;
    dw[c] = rstd * centred;
    db[c] = sum_g;
}

/// Batch norm's forward coefficients, a thread per channel (C is at most a few thousand), from
/// the sums [Σx; Σx²] — one launch for what the composition takes ~30. S: the statistics dtype.
template <class S>
__global__ void batch_norm_coef(const S *__restrict__ sums, const S *__restrict__ centre,
                                const S *__restrict__ weight, const S *__restrict__ bias,
                                S *__restrict__ running_mean, S *__restrict__ running_var, S *__restrict__ coef,
                                S *__restrict__ saved, double count, double eps, double momentum, i64 residual,
                                i64 C) {
    for (i64 c = first_index(); c < C; c += grid_step()) {
        forward_coef(c, C, sums[c], sums[C + c], centre, weight, bias, running_mean, running_var, coef, saved,
                     (S)count, (S)momentum, eps, residual);
    }
}

/// batch_norm_stats_combine and batch_norm_coef in one launch, for channels-last sums left as
/// partials: a block per channel adds its two rows (as the combine does: the same bits), then
/// its first thread computes the channel's coefficients — one launch a pass fewer.
template <class S>
__global__ void batch_norm_combine_coef(const S *__restrict__ partials, i64 chunks, const S *__restrict__ centre,
                            const S *__restrict__ weight, const S *__restrict__ bias, S *__restrict__ running_mean,
                            S *__restrict__ running_var, S *__restrict__ coef, S *__restrict__ saved, double count,
                            double eps, double momentum, i64 residual, i64 C) {
    for (i64 c = blockIdx.x; c < C; c += gridDim.x) {
        const S sum_x = combined(partials, chunks, C, c), sum_xx = combined(partials, chunks, C, C + c);
        if (threadIdx.x == 0) {
            forward_coef(c, C, sum_x, sum_xx, centre, weight, bias, running_mean, running_var, coef, saved,
                         (S)count, (S)momentum, eps, residual);
        }
    }
}

/// Batch norm's backward coefficients, a thread per channel, from the sums [Σg; Σ(x − mean)·g].
template <class S>
__global__ void batch_norm_grad_coef(const S *__restrict__ sums, const S *__restrict__ saved,
                                     const S *__restrict__ weight, S *__restrict__ coef,
                                     S *__restrict__ dw, S *__restrict__ db, double count, i64 C) {
    for (i64 c = first_index(); c < C; c += grid_step()) {
        backward_coef(c, C, sums[c], sums[C + c], saved, weight, coef, dw, db, (S)count);
    }
}

/// batch_norm_stats_combine and batch_norm_grad_coef in one launch (as batch_norm_combine_coef).
template <class S>
__global__ void batch_norm_combine_grad_coef(const S *__restrict__ partials, i64 chunks, const S *__restrict__ saved,
                                 const S *__restrict__ weight, S *__restrict__ coef, S *__restrict__ dw,
                                 S *__restrict__ db, double count, i64 C) {
    for (i64 c = blockIdx.x; c < C; c += gridDim.x) {
        const S sum_g = combined(partials, chunks, C, c), centred = combined(partials, chunks, C, C + c);
        if (threadIdx.x == 0) backward_coef(c, C, sum_g, centred, saved, weight, coef, dw, db, (S)count);
    }
}
