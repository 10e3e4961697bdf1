// Elementwise kernels: unary and binary ops over broadcast strided operands, select, convert
// (which is also copy_into: a strided destination) and fill. One template per family; dtype and
// op are template parameters, instantiated by the name expressions `ops/elementwise.rs` lists.
// Every kernel is a grid-stride loop over the output's logical elements, so any grid covers any n.
// Unary and binary ops also come `_packed`: operands the launcher found dense in one order,
// 16-byte aligned and a whole number of packs long are walked 16 bytes a thread a step (one
// 128-bit load per operand and one store), through the same element function, so both forms
// give the same bits.
#include "common.cuh"

/// Mirrors redline_tensor::UnaryOp (the Rust side names instantiations by its variants).
enum class UnaryOp { Neg, Exp, Log, Sqrt, Rsqrt, Relu, Gelu, GeluGrad, Sigmoid, Tanh };

/// Mirrors redline_tensor::BinaryOp.
enum class BinaryOp { Add, Sub, Mul, Div, Pow, Maximum, Minimum, ReluGrad, Eq, Ne, Lt, Le, Gt, Ge };

template <UnaryOp OP, class A>
__device__ __forceinline__ A unary_value(A x) {
    const A half = (A)0.5, one = (A)1;
    const A rsqrt2 = (A)0.70710678118654752440, rsqrt2pi = (A)0.39894228040143267794;
    if constexpr (OP == UnaryOp::Neg) return -x;
    if constexpr (OP == UnaryOp::Exp) return exp(x);
    if constexpr (OP == UnaryOp::Log) return log(x);
    if constexpr (OP == UnaryOp::Sqrt) return sqrt(x);
    if constexpr (OP == UnaryOp::Rsqrt) return one / sqrt(x);
    if constexpr (OP == UnaryOp::Relu) return x > (A)0 ? x : (A)0;  // NaN → 0, as the reference
    if constexpr (OP == UnaryOp::Gelu) return half * x * (one + erf(x * rsqrt2));
    if constexpr (OP == UnaryOp::GeluGrad)
        return half * (one + erf(x * rsqrt2)) + x * rsqrt2pi * exp(-half * x * x);
    if constexpr (OP == UnaryOp::Sigmoid) return one / (one + exp(-x));
    if constexpr (OP == UnaryOp::Tanh) return tanh(x);
}

/// One element of `unary`: widened to the arithmetic type, computed, rounded back once.
template <class T, UnaryOp OP>
__device__ __forceinline__ T unary_element(T x) {
    return Num<T>::store(unary_value<OP>(Num<T>::load(x)));
}

template <class T, UnaryOp OP>
__global__ void unary(const T *__restrict__ x, Strided xs, T *__restrict__ out, Strided os, i64 n) {
    for (i64 i = first_index(); i < n; i += grid_step()) {
        out[position(os, i)] = unary_element<T, OP>(x[position(xs, i)]);
    }
}

template <class T, UnaryOp OP>
__global__ void unary_packed(const Pack16<T> *__restrict__ x, Pack16<T> *__restrict__ out, i64 packs) {
    for (i64 p = first_index(); p < packs; p += grid_step()) {
        const Pack16<T> xp = x[p];
        Pack16<T> o;
#pragma unroll
        for (int k = 0; k < (int)(16 / sizeof(T)); k++) o.v[k] = unary_element<T, OP>(xp.v[k]);
        out[p] = o;
    }
}

template <BinaryOp OP>
struct IsComparison {
    static const bool value = OP == BinaryOp::Eq || OP == BinaryOp::Ne || OP == BinaryOp::Lt ||
                              OP == BinaryOp::Le || OP == BinaryOp::Gt || OP == BinaryOp::Ge;
};

/// Comparisons write u8 (0 or 1); the rest write the operands' type.
template <class T, BinaryOp OP>
struct BinaryOut {
    typedef T type;
};
#define REDLINE_COMPARISON_WRITES_U8(OP) \
    template <class T>                   \
    struct BinaryOut<T, OP> {            \
        typedef u8 type;                 \
    };
REDLINE_COMPARISON_WRITES_U8(BinaryOp::Eq)
REDLINE_COMPARISON_WRITES_U8(BinaryOp::Ne)
REDLINE_COMPARISON_WRITES_U8(BinaryOp::Lt)
REDLINE_COMPARISON_WRITES_U8(BinaryOp::Le)
REDLINE_COMPARISON_WRITES_U8(BinaryOp::Gt)
REDLINE_COMPARISON_WRITES_U8(BinaryOp::Ge)

template <BinaryOp OP, class A>
__device__ __forceinline__ A binary_value(A a, A b) {
    if constexpr (OP == BinaryOp::Add) return a + b;
    if constexpr (OP == BinaryOp::Sub) return a - b;
    if constexpr (OP == BinaryOp::Mul) return a * b;
    if constexpr (OP == BinaryOp::Div) return a / b;
    if constexpr (OP == BinaryOp::Pow) return pow(a, b);
    // NaN in either operand gives NaN (a != a only for NaN; integers never take it).
    if constexpr (OP == BinaryOp::Maximum) return a != a ? a : (b != b ? b : (a > b ? a : b));
    if constexpr (OP == BinaryOp::Minimum) return a != a ? a : (b != b ? b : (a < b ? a : b));
    if constexpr (OP == BinaryOp::ReluGrad) return a > (A)0 ? b : (A)0;
    if constexpr (OP == BinaryOp::Eq) return a == b;
    if constexpr (OP == BinaryOp::Ne) return a != b;
    if constexpr (OP == BinaryOp::Lt) return a < b;
    if constexpr (OP == BinaryOp::Le) return a <= b;
    if constexpr (OP == BinaryOp::Gt) return a > b;
    if constexpr (OP == BinaryOp::Ge) return a >= b;
}

/// One element of `binary`: comparisons give 0 or 1, the rest are rounded back to T once.
template <class T, BinaryOp OP>
__device__ __forceinline__ typename BinaryOut<T, OP>::type binary_element(T a, T b) {
    const typename Num<T>::acc v = binary_value<OP>(Num<T>::load(a), Num<T>::load(b));
    if constexpr (IsComparison<OP>::value) {
        return (u8)(v != 0);
    } else {
        return Num<T>::store(v);
    }
}

template <class T, BinaryOp OP>
__global__ void binary(const T *__restrict__ a, Strided as, const T *__restrict__ b, Strided bs,
                       typename BinaryOut<T, OP>::type *__restrict__ out, Strided os, i64 n) {
    for (i64 i = first_index(); i < n; i += grid_step()) {
        out[position(os, i)] = binary_element<T, OP>(a[position(as, i)], b[position(bs, i)]);
    }
}

/// Arithmetic only: a comparison's u8 output has other packs than its operands.
template <class T, BinaryOp OP>
__global__ void binary_packed(const Pack16<T> *__restrict__ a, const Pack16<T> *__restrict__ b,
                              Pack16<T> *__restrict__ out, i64 packs) {
    static_assert(!IsComparison<OP>::value, "comparisons are not packed");
    for (i64 p = first_index(); p < packs; p += grid_step()) {
        const Pack16<T> ap = a[p], bp = b[p];
        Pack16<T> o;
#pragma unroll
        for (int k = 0; k < (int)(16 / sizeof(T)); k++) o.v[k] = binary_element<T, OP>(ap.v[k], bp.v[k]);
        out[p] = o;
    }
}

/// `cond != 0 ? a : b`.
template <class T>
__global__ void select(const u8 *__restrict__ cond, Strided cs, const T *__restrict__ a, Strided as,
                       const T *__restrict__ b, Strided bs, T *__restrict__ out, Strided os, i64 n) {
    for (i64 i = first_index(); i < n; i += grid_step()) {
        out[position(os, i)] = cond[position(cs, i)] ? a[position(as, i)] : b[position(bs, i)];
    }
}

/// `out = (To) x`, both strided: convert, relayout and copy_into in one kernel.
template <class From, class To>
__global__ void convert(const From *__restrict__ x, Strided xs, To *__restrict__ out, Strided os, i64 n) {
    for (i64 i = first_index(); i < n; i += grid_step()) {
        out[position(os, i)] = convert_value<To>(x[position(xs, i)]);
    }
}

/// `out[0..n] = value`, rounded to T once.
template <class T>
__global__ void fill(T *__restrict__ out, i64 n, double value) {
    const T v = From<T>::f(value);
    for (i64 i = first_index(); i < n; i += grid_step()) out[i] = v;
}
