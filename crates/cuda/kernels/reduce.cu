// Reductions over any set of axes, two ways. `reduce`: one block per output element, its threads
// striding over the reduced elements, then a warp-shuffle tree and one exchange through shared
// memory. `reduce_columns`: one thread per output element walking its few reduced elements in
// order — for when the kept axes are innermost in memory (a channels-last tensor's mean over its
// plane), where a block per output would read one element per 32-byte sector with most of its
// threads idle. The order of additions depends only on the kernel and the block size, so every
// run gives the same bits.
#include "block.cuh"

/// Mirrors redline_tensor::ReduceOp.
enum class ReduceOp { Sum, Max, ArgMax };

/// Threads per reduction block (a multiple of the warp; the launcher uses exactly this).
#define REDUCE_THREADS 256

/// What sums accumulate in: f32 for f32 and the half types, f64 for f64, i64 for integers.
template <class T>
struct SumAcc {
    typedef i64 type;
};
template <>
struct SumAcc<float> {
    typedef float type;
};
template <>
struct SumAcc<__half> {
    typedef float type;
};
template <>
struct SumAcc<__nv_bfloat16> {
    typedef float type;
};
template <>
struct SumAcc<double> {
    typedef double type;
};

/// A running maximum and where it was: NaN beats everything, ties go to the lower position.
template <class A>
struct Best {
    A value;
    i64 at;
};

template <class A>
__device__ __forceinline__ Best<A> better(Best<A> x, Best<A> y) {
    if (y.at < 0) return x;
    if (x.at < 0) return y;
    bool xn = x.value != x.value, yn = y.value != y.value;
    if (xn != yn) return xn ? x : y;
    if (!xn && x.value != y.value) return x.value > y.value ? x : y;
    return x.at <= y.at ? x : y;
}

/// The block's best (value, position); thread 0 gets it.
template <class A>
__device__ __forceinline__ Best<A> block_best(Best<A> v) {
    __shared__ A values[REDUCE_THREADS / 32];
    __shared__ i64 ats[REDUCE_THREADS / 32];
    const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    for (int offset = 16; offset > 0; offset /= 2) {
        Best<A> other = {__shfl_down_sync(FULL_MASK, v.value, offset), __shfl_down_sync(FULL_MASK, v.at, offset)};
        v = better(v, other);
    }
    if (lane == 0) {
        values[warp] = v.value;
        ats[warp] = v.at;
    }
    __syncthreads();
    if (warp == 0) {
        Best<A> none = {v.value, -1};
        v = lane < REDUCE_THREADS / 32 ? Best<A>{values[lane], ats[lane]} : none;
        for (int offset = 16; offset > 0; offset /= 2) {
            Best<A> other = {__shfl_down_sync(FULL_MASK, v.value, offset), __shfl_down_sync(FULL_MASK, v.at, offset)};
            v = better(v, other);
        }
    }
    return v;
}

/// Output `o`'s value: a sum stored as T (integers saturating from i64), or the best's value
/// (Max) or position (ArgMax).
template <class T, ReduceOp OP, class A>
__device__ __forceinline__ void write_sum(typename Pick<OP == ReduceOp::ArgMax, i64, T>::type *out, i64 o, A acc) {
    if constexpr (IsFloat<T>::value) {
        out[o] = Num<T>::store(acc);
    } else {
        out[o] = From<T>::i(acc);  // integers sum in i64, stored saturating
    }
}

template <class T, ReduceOp OP, class A>
__device__ __forceinline__ void write_best(typename Pick<OP == ReduceOp::ArgMax, i64, T>::type *out, i64 o, Best<A> best) {
    if constexpr (OP == ReduceOp::ArgMax) {
        out[o] = best.at;
    } else {
        out[o] = Num<T>::store(best.value);
    }
}

/// Block b reduces output element b: the input's kept axes (`kept`, row-major over the output)
/// place its first element, the reduced axes (`reduced`, row-major, `r` elements) walk from it.
/// Sum and Max write T; ArgMax writes the position along its one reduced axis as i64.
template <class T, ReduceOp OP>
__global__ void __launch_bounds__(REDUCE_THREADS)
    reduce(const T *__restrict__ x, Strided kept, Strided reduced, i64 r,
           typename Pick<OP == ReduceOp::ArgMax, i64, T>::type *__restrict__ out, i64 outputs) {
    for (i64 o = blockIdx.x; o < outputs; o += gridDim.x) {
        const i64 base = position(kept, o);
        if constexpr (OP == ReduceOp::Sum) {
            typedef typename SumAcc<T>::type A;
            A acc = (A)0;
            for (i64 j = threadIdx.x; j < r; j += blockDim.x) acc += (A)Num<T>::load(x[base + position(reduced, j)]);
            acc = block_all(acc, SumOp());
            if (threadIdx.x == 0) write_sum<T, OP>(out, o, acc);
        } else {
            typedef typename Num<T>::acc A;
            Best<A> best = {(A)0, -1};
            for (i64 j = threadIdx.x; j < r; j += blockDim.x) {
                Best<A> here = {Num<T>::load(x[base + position(reduced, j)]), j};
                best = better(best, here);
            }
            best = block_best(best);
            if (threadIdx.x == 0) write_best<T, OP>(out, o, best);
        }
        // The next output reuses the shared partials: everyone must be done reading them.
        __syncthreads();
    }
}

/// Thread o reduces output element o over its `r` reduced elements, in order (same arguments as
/// `reduce`). Neighbouring threads take neighbouring outputs, so where the kept axes are innermost
/// in memory a warp's loads are one run of adjacent elements.
template <class T, ReduceOp OP>
__global__ void reduce_columns(const T *__restrict__ x, Strided kept, Strided reduced, i64 r,
                               typename Pick<OP == ReduceOp::ArgMax, i64, T>::type *__restrict__ out, i64 outputs) {
    for (i64 o = first_index(); o < outputs; o += grid_step()) {
        const T *column = x + position(kept, o);
        if constexpr (OP == ReduceOp::Sum) {
            typedef typename SumAcc<T>::type A;
            A acc = (A)0;
            for (i64 j = 0; j < r; j++) acc += (A)Num<T>::load(column[position(reduced, j)]);
            write_sum<T, OP>(out, o, acc);
        } else {
            typedef typename Num<T>::acc A;
            Best<A> best = {(A)0, -1};
            for (i64 j = 0; j < r; j++) {
                Best<A> here = {Num<T>::load(column[position(reduced, j)]), j};
                best = better(best, here);
            }
            write_best<T, OP>(out, o, best);
        }
    }
}
