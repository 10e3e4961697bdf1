// 2-d max and average pooling and their gradients. The gradients pull: each input element sums
// the outputs whose windows cover it, in output order — no atomics, the reference's order of
// additions, the same bits every run. Padding counts in the average's divisor (PyTorch's
// default). Max pooling records the flat in-plane position (h·W + w) of the first maximum, laid
// out as its output; NaN counts as the maximum.
//
// Each thread takes one element of what it writes, in that tensor's memory order
// (`channels_inner`: channels-last): neighbouring threads then read and write neighbouring
// channels, where a walk in NCHW order would touch one element per 128-byte line of a
// channels-last tensor. The order only decides which thread computes what, never a value.
#include "common.cuh"

struct PoolGeometry {
    i64 kh, kw, sh, sw, ph, pw;
};

/// The coordinates of the `i`-th element in memory order of a dense [N, C, H, W] tensor:
/// channels fastest (`channels_inner`), else width.
__device__ __forceinline__ void coords4(i64 i, bool channels_inner, i64 C, i64 H, i64 W, i64 &b, i64 &c, i64 &y,
                                        i64 &x) {
    if (channels_inner) {
        c = i % C;
        x = (i / C) % W;
        y = (i / (C * W)) % H;
        b = i / (C * W * H);
    } else {
        x = i % W;
        y = (i / W) % H;
        c = (i / (W * H)) % C;
        b = i / (W * H * C);
    }
}

__device__ __forceinline__ i64 offset4(const Strided &s, i64 i0, i64 i1, i64 i2, i64 i3) {
    return s.offset + i0 * s.stride[0] + i1 * s.stride[1] + i2 * s.stride[2] + i3 * s.stride[3];
}

/// Calls `f(iy, ix)` for each input position of output (oy, ox)'s window inside the H × W
/// plane, row by row: the one window order every forward kernel visits, so the general and the
/// packed max pool keep the same first maximum.
template <class F>
__device__ __forceinline__ void each_in_window(i64 oy, i64 ox, const PoolGeometry &g, i64 H, i64 W, F f) {
    for (i64 ky = 0; ky < g.kh; ky++) {
        const i64 iy = oy * g.sh + ky - g.ph;
        if (iy < 0 || iy >= H) continue;
        for (i64 kx = 0; kx < g.kw; kx++) {
            const i64 ix = ox * g.sw + kx - g.pw;
            if (ix >= 0 && ix < W) f(iy, ix);
        }
    }
}

/// Whether `v` takes over from `best` as the window's maximum: greater, or the first NaN.
template <class A>
__device__ __forceinline__ bool beats(A v, A best) {
    return v > best || (v != v && best == best);
}

/// The outputs along one axis whose windows cover input coordinate `i`: [lo, hi].
__device__ __forceinline__ void covering(i64 i, i64 k, i64 s, i64 p, i64 outputs, i64 &lo, i64 &hi) {
    const i64 first = i + p - k + 1;  // the lowest o with o·s − p + k − 1 ≥ i, before rounding
    lo = first <= 0 ? 0 : (first + s - 1) / s;
    hi = (i + p) / s;
    if (hi > outputs - 1) hi = outputs - 1;
}

template <class T>
__global__ void max_pool2d(const T *__restrict__ x, Strided xs, T *__restrict__ out, Strided os,
                           i64 *__restrict__ positions, i64 n, i32 channels_inner, PoolGeometry g) {
    typedef typename Num<T>::acc A;
    const i64 C = xs.shape[1], H = xs.shape[2], W = xs.shape[3], HO = os.shape[2], WO = os.shape[3];
    for (i64 o = first_index(); o < n; o += grid_step()) {
        i64 b, c, oy, ox;
        coords4(o, channels_inner, C, HO, WO, b, c, oy, ox);
        A best = -infinity<A>();
        i64 where = -1;  // until the window's first element: an all -inf window points there
        each_in_window(oy, ox, g, H, W, [&](i64 iy, i64 ix) {
            const A v = Num<T>::load(at4(x, xs, b, c, iy, ix));
            if (beats(v, best) || where < 0) {
                best = v;
                where = iy * W + ix;
            }
        });
        const i64 at = offset4(os, b, c, oy, ox);
        out[at] = Num<T>::store(best);
        positions[at] = where;
    }
}

/// gx[b, c, iy, ix] = Σ g[b, c, oy, ox] over the covering outputs whose recorded maximum is
/// (iy, ix). `gs` and `ps` have the output's shape; `os` the input's.
template <class T>
__global__ void max_pool2d_grad(const T *__restrict__ g, Strided gs, const i64 *__restrict__ positions, Strided ps,
                                T *__restrict__ out, Strided os, i64 n, i32 channels_inner, PoolGeometry geo) {
    typedef typename Num<T>::acc A;
    const i64 C = os.shape[1], H = os.shape[2], W = os.shape[3], HO = gs.shape[2], WO = gs.shape[3];
    for (i64 i = first_index(); i < n; i += grid_step()) {
        i64 b, c, iy, ix;
        coords4(i, channels_inner, C, H, W, b, c, iy, ix);
        i64 y0, y1, x0, x1;
        covering(iy, geo.kh, geo.sh, geo.ph, HO, y0, y1);
        covering(ix, geo.kw, geo.sw, geo.pw, WO, x0, x1);
        A acc = 0;
        for (i64 oy = y0; oy <= y1; oy++)
            for (i64 ox = x0; ox <= x1; ox++)
                if (at4(positions, ps, b, c, oy, ox) == iy * W + ix) acc += Num<T>::load(at4(g, gs, b, c, oy, ox));
        out[offset4(os, b, c, iy, ix)] = Num<T>::store(acc);
    }
}

template <class T>
__global__ void avg_pool2d(const T *__restrict__ x, Strided xs, T *__restrict__ out, Strided os, i64 n,
                           i32 channels_inner, PoolGeometry g) {
    typedef typename Num<T>::acc A;
    const i64 C = xs.shape[1], H = xs.shape[2], W = xs.shape[3], HO = os.shape[2], WO = os.shape[3];
    const A area = (A)(g.kh * g.kw);
    for (i64 o = first_index(); o < n; o += grid_step()) {
        i64 b, c, oy, ox;
        coords4(o, channels_inner, C, HO, WO, b, c, oy, ox);
        A sum = 0;
        each_in_window(oy, ox, g, H, W, [&](i64 iy, i64 ix) { sum += Num<T>::load(at4(x, xs, b, c, iy, ix)); });
        out[offset4(os, b, c, oy, ox)] = Num<T>::store(sum / area);
    }
}

template <class T>
__global__ void avg_pool2d_grad(const T *__restrict__ g, Strided gs, T *__restrict__ out, Strided os, i64 n,
                                i32 channels_inner, PoolGeometry geo) {
    typedef typename Num<T>::acc A;
    const i64 C = os.shape[1], H = os.shape[2], W = os.shape[3], HO = gs.shape[2], WO = gs.shape[3];
    const A area = (A)(geo.kh * geo.kw);
    for (i64 i = first_index(); i < n; i += grid_step()) {
        i64 b, c, iy, ix;
        coords4(i, channels_inner, C, H, W, b, c, iy, ix);
        i64 y0, y1, x0, x1;
        covering(iy, geo.kh, geo.sh, geo.ph, HO, y0, y1);
        covering(ix, geo.kw, geo.sw, geo.pw, WO, x0, x1);
        A acc = 0;
        for (i64 oy = y0; oy <= y1; oy++)
            for (i64 ox = x0; ox <= x1; ox++) acc += Num<T>::load(at4(g, gs, b, c, oy, ox)) / area;
        out[offset4(os, b, c, iy, ix)] = Num<T>::store(acc);
    }
}

// Max pooling over dense channels-last tensors, a thread per (pixel, 16-byte pack of channels):
// the pixel's coordinates are worked out once per pack, not per element, and every read and
// write of values is one 128-bit access. `cols` = C / K packs a pixel; x (and the gradient's
// output) are [N, H, W, C] in memory, out, positions and g [N, HO, WO, C]. Windows are visited
// in the general kernels' order with their comparison and sums, so the bits and positions are
// theirs. The launcher checks the layouts, C a whole number of packs and 16-byte alignment.

template <class T>
__global__ void max_pool2d_packed(const Pack16<T> *__restrict__ x, Pack16<T> *__restrict__ out,
                                  i64 *__restrict__ positions, i64 packs, i64 cols, i64 H, i64 W, i64 HO, i64 WO,
                                  PoolGeometry g) {
    typedef typename Num<T>::acc A;
    const int K = 16 / sizeof(T);
    for (i64 p = first_index(); p < packs; p += grid_step()) {
        const i64 j = p % cols, pixel = p / cols;
        const i64 ox = pixel % WO, oy = (pixel / WO) % HO, b = pixel / (WO * HO);
        A best[K];
        i64 where[K];
#pragma unroll
        for (int k = 0; k < K; k++) {
            best[k] = -infinity<A>();
            where[k] = -1;  // as in max_pool2d
        }
        each_in_window(oy, ox, g, H, W, [&](i64 iy, i64 ix) {
            const Pack16<T> v = x[((b * H + iy) * W + ix) * cols + j];
#pragma unroll
            for (int k = 0; k < K; k++) {
                const A e = Num<T>::load(v.v[k]);
                if (beats(e, best[k]) || where[k] < 0) {
                    best[k] = e;
                    where[k] = iy * W + ix;
                }
            }
        });
        Pack16<T> o;
#pragma unroll
        for (int k = 0; k < K; k++) {
            o.v[k] = Num<T>::store(best[k]);
            positions[p * K + k] = where[k];
        }
        out[p] = o;
    }
}

template <class T>
__global__ void max_pool2d_grad_packed(const Pack16<T> *__restrict__ g, const i64 *__restrict__ positions,
                                       Pack16<T> *__restrict__ out, i64 packs, i64 cols, i64 H, i64 W, i64 HO,
                                       i64 WO, PoolGeometry geo) {
    typedef typename Num<T>::acc A;
    const int K = 16 / sizeof(T);
    for (i64 p = first_index(); p < packs; p += grid_step()) {
        const i64 j = p % cols, pixel = p / cols;
        const i64 ix = pixel % W, iy = (pixel / W) % H, b = pixel / (W * H);
        i64 y0, y1, x0, x1;
        covering(iy, geo.kh, geo.sh, geo.ph, HO, y0, y1);
        covering(ix, geo.kw, geo.sw, geo.pw, WO, x0, x1);
        const i64 here = iy * W + ix;
        A acc[K];
#pragma unroll
        for (int k = 0; k < K; k++) acc[k] = 0;
        for (i64 oy = y0; oy <= y1; oy++)
            for (i64 ox = x0; ox <= x1; ox++) {
                const i64 q = ((b * HO + oy) * WO + ox) * cols + j;
                const Pack16<T> v = load_pack(g + q);
                // Adding 0 where the maximum was elsewhere keeps the bits (acc, a sum from +0,
                // is never −0).
#pragma unroll
                for (int k = 0; k < K; k++)
                    acc[k] += positions[q * K + k] == here ? Num<T>::load(v.v[k]) : (A)0;
            }
        Pack16<T> o;
#pragma unroll
        for (int k = 0; k < K; k++) o.v[k] = Num<T>::store(acc[k]);
        out[p] = o;
    }
}
