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
        i64 where = 0;
        for (i64 ky = 0; ky < g.kh; ky++) {
            const i64 iy = oy * g.sh + ky - g.ph;
            if (iy < 0 || iy >= H) continue;
            for (i64 kx = 0; kx < g.kw; kx++) {
                const i64 ix = ox * g.sw + kx - g.pw;
                if (ix < 0 || ix >= W) continue;
                const A v = Num<T>::load(at4(x, xs, b, c, iy, ix));
                if (v > best || (v != v && best == best)) {
                    best = v;
                    where = iy * W + ix;
                }
            }
        }
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
        for (i64 ky = 0; ky < g.kh; ky++) {
            const i64 iy = oy * g.sh + ky - g.ph;
            if (iy < 0 || iy >= H) continue;
            for (i64 kx = 0; kx < g.kw; kx++) {
                const i64 ix = ox * g.sw + kx - g.pw;
                if (ix >= 0 && ix < W) sum += Num<T>::load(at4(x, xs, b, c, iy, ix));
            }
        }
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
