// What every kernel family shares: integer names, the strided operand, and conversions between
// storage types whose rules are spelled out (so the GPU and the host emulator agree bit for bit).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

typedef unsigned char u8;
typedef int i32;
typedef long long i64;
typedef unsigned int u32;
typedef unsigned long long u64;

/// The most axes an operand may have (the Rust side refuses more, naming the op).
#define MAX_RANK 8

/// How `position` walks an operand: contiguous (offset + i), by 32-bit coordinates (every
/// index below 2^31, divided by multiply-high: a few instructions an axis), or by 64-bit
/// division (a long software sequence an axis; only for operands of 2^31 elements or more).
#define WALK_INDEX64 0
#define WALK_CONTIGUOUS 1
#define WALK_INDEX32 2

/// An operand seen through a layout: logical element `i` (row-major over `shape`) lives at
/// `offset + Σ coord[d] · stride[d]`. Broadcast axes have stride 0. Mirrors `gpu::Strided`,
/// which also computes the divisors: i / shape[d] = (umulhi(i, magic[d]) + i) >> shift[d] for
/// every i < 2^31 (Granlund and Montgomery's division by invariant integers).
struct Strided {
    i64 offset;
    i32 rank;
    i32 walk;  // WALK_*
    i64 shape[MAX_RANK];
    i64 stride[MAX_RANK];
    u32 magic[MAX_RANK];
    u32 shift[MAX_RANK];
};

/// i / shape[d] for i < 2^31 (the sum cannot overflow 32 bits).
__device__ __forceinline__ u32 divide(const Strided &s, int d, u32 i) {
    return (__umulhi(i, s.magic[d]) + i) >> s.shift[d];
}

/// Where logical element `i` (below the operand's element count) lives. The outermost
/// coordinate is what remains after the inner axes are divided out: no division for it.
__device__ __forceinline__ i64 position(const Strided &s, i64 i) {
    if (s.walk == WALK_CONTIGUOUS) return s.offset + i;
    i64 at = s.offset;
    if (s.walk == WALK_INDEX32) {
        u32 j = (u32)i;
        for (int d = s.rank - 1; d > 0; d--) {
            const u32 q = divide(s, d, j);
            at += (i64)(j - q * (u32)s.shape[d]) * s.stride[d];
            j = q;
        }
        return at + (i64)j * s.stride[0];
    }
    for (int d = s.rank - 1; d > 0; d--) {
        const i64 n = s.shape[d];
        at += (i % n) * s.stride[d];
        i /= n;
    }
    return at + i * s.stride[0];
}

/// `Pick<c, A, B>::type` is A when c holds, else B (std::conditional without the standard library,
/// which NVRTC does not ship).
template <bool C, class A, class B>
struct Pick {
    typedef A type;
};
template <class A, class B>
struct Pick<false, A, B> {
    typedef B type;
};

/// 16 bytes of T, aligned: a copy is one 128-bit load or store (ld.global.v4). Kernels that
/// take packs are only launched on 16-byte-aligned pointers (the launcher checks).
template <class T>
struct alignas(16) Pack16 {
    T v[16 / sizeof(T)];
};

/// A pack read as one 128-bit load through the read-only cache, which the compiler cannot
/// split into element loads (NVRTC did for sm_120 where a kernel used only some elements).
template <class T>
__device__ __forceinline__ Pack16<T> load_pack(const Pack16<T> *p) {
    const uint4 raw = __ldg(reinterpret_cast<const uint4 *>(p));
    Pack16<T> v;
    memcpy(&v, &raw, 16);
    return v;
}

/// t[i0, i1, i2, i3] of a 4-d operand, through its strides (convolutions, pooling).
template <class T>
__device__ __forceinline__ T at4(const T *t, const Strided &s, i64 i0, i64 i1, i64 i2, i64 i3) {
    return t[s.offset + i0 * s.stride[0] + i1 * s.stride[1] + i2 * s.stride[2] + i3 * s.stride[3]];
}

/// Per storage type: the type arithmetic happens in, and the load/store between them.
/// Half types compute in f32; everything else in itself.
template <class T>
struct Num {
    typedef T acc;
    static __device__ __forceinline__ T load(T v) { return v; }
    static __device__ __forceinline__ T store(T v) { return v; }
};
template <>
struct Num<__half> {
    typedef float acc;
    static __device__ __forceinline__ float load(__half v) { return __half2float(v); }
    static __device__ __forceinline__ __half store(float v) { return __float2half_rn(v); }
};
template <>
struct Num<__nv_bfloat16> {
    typedef float acc;
    static __device__ __forceinline__ float load(__nv_bfloat16 v) { return __bfloat162float(v); }
    static __device__ __forceinline__ __nv_bfloat16 store(float v) { return __float2bfloat16_rn(v); }
};
template <>
struct Num<u8> {
    typedef i32 acc;  // u8 arithmetic in int, stored back modulo 256 (as PyTorch)
    static __device__ __forceinline__ i32 load(u8 v) { return v; }
    static __device__ __forceinline__ u8 store(i32 v) { return (u8)v; }
};

template <class T>
struct IsFloat {
    static const bool value = false;
};
template <>
struct IsFloat<float> {
    static const bool value = true;
};
template <>
struct IsFloat<double> {
    static const bool value = true;
};
template <>
struct IsFloat<__half> {
    static const bool value = true;
};
template <>
struct IsFloat<__nv_bfloat16> {
    static const bool value = true;
};

/// A value widened without loss for conversion: floats to double, integers to i64.
template <class T>
__device__ __forceinline__ double widen_float(T v) {
    return (double)Num<T>::load(v);
}

/// `v` (a double) as integer type `I`: toward zero, saturating, NaN to 0 (Rust's `as`, which
/// the reference uses, and the GPU's cvt.rzi.sat).
template <class I>
__device__ __forceinline__ I saturate(double v, double lo, double hi, I min, I max) {
    if (v != v) return (I)0;
    if (v <= lo) return min;
    if (v >= hi) return max;
    return (I)v;
}

template <class To>
struct From;
template <>
struct From<double> {
    static __device__ __forceinline__ double f(double v) { return v; }
    static __device__ __forceinline__ double i(i64 v) { return (double)v; }
};
template <>
struct From<float> {
    static __device__ __forceinline__ float f(double v) { return (float)v; }
    static __device__ __forceinline__ float i(i64 v) { return (float)v; }
};
template <>
struct From<__half> {
    static __device__ __forceinline__ __half f(double v) { return __double2half(v); }
    static __device__ __forceinline__ __half i(i64 v) { return __double2half((double)v); }
};
template <>
struct From<__nv_bfloat16> {
    static __device__ __forceinline__ __nv_bfloat16 f(double v) { return __double2bfloat16(v); }
    static __device__ __forceinline__ __nv_bfloat16 i(i64 v) { return __double2bfloat16((double)v); }
};
template <>
struct From<u8> {
    static __device__ __forceinline__ u8 f(double v) { return saturate<u8>(v, 0.0, 255.0, 0, 255); }
    static __device__ __forceinline__ u8 i(i64 v) { return v < 0 ? (u8)0 : (v > 255 ? (u8)255 : (u8)v); }
};
template <>
struct From<i32> {
    static __device__ __forceinline__ i32 f(double v) { return saturate<i32>(v, -2147483648.0, 2147483647.0, -2147483647 - 1, 2147483647); }
    static __device__ __forceinline__ i32 i(i64 v) {
        return v < -2147483648LL ? (i32)(-2147483647 - 1) : (v > 2147483647LL ? 2147483647 : (i32)v);
    }
};
template <>
struct From<i64> {
    static __device__ __forceinline__ i64 f(double v) {
        return saturate<i64>(v, -9223372036854775808.0, 9223372036854775808.0, -9223372036854775807LL - 1,
                             9223372036854775807LL);
    }
    static __device__ __forceinline__ i64 i(i64 v) { return v; }
};

/// `v` converted to `To`: floats round to nearest even, integers saturate (see `saturate`).
template <class To, class T>
__device__ __forceinline__ To convert_value(T v) {
    if constexpr (IsFloat<T>::value && sizeof(T) <= 4 && IsFloat<To>::value) {
        // Exact in float and rounded once to `To`: the value the route through double gives
        // (a NaN stays a NaN, its payload as the conversion keeps it), without double
        // arithmetic (1/64 of the float rate on consumer GPUs).
        return Num<To>::store(Num<T>::load(v));
    } else if constexpr (IsFloat<T>::value) {
        return From<To>::f(widen_float(v));
    } else {
        return From<To>::i((i64)Num<T>::load(v));
    }
}

/// +∞ of a float type (NVRTC has no <cmath> constants).
template <class A>
__device__ __forceinline__ A infinity();
template <>
__device__ __forceinline__ float infinity<float>() {
    return __int_as_float(0x7f800000);
}
template <>
__device__ __forceinline__ double infinity<double>() {
    return __longlong_as_double(0x7ff0000000000000LL);
}

/// 1-d grid-stride loop bounds: every thread handles i = first, first + step, … below n.
__device__ __forceinline__ i64 first_index() { return (i64)blockIdx.x * blockDim.x + threadIdx.x; }
__device__ __forceinline__ i64 grid_step() { return (i64)gridDim.x * blockDim.x; }
