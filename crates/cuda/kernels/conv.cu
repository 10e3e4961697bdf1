// 2-d convolution and its two gradients as direct kernels, one thread per element written:
// correct for every stride, padding, dilation and group count, and what the host emulator
// checks; cuDNN takes the GPU's hot path (issue: the CUDA backend). Accumulates in f32 for
// f32 and the half types, f64 for f64.
#include "common.cuh"

struct ConvGeometry {
    i64 sh, sw, ph, pw, dh, dw, groups;
};

/// y[b, o, oy, ox] = Σ over the group's input channels and the taps of x · w.
template <class T>
__global__ void conv2d(const T *__restrict__ x, Strided xs, const T *__restrict__ w, Strided ws, T *__restrict__ out,
                       Strided os, i64 n, ConvGeometry g) {
    typedef typename Num<T>::acc A;
    const i64 H = xs.shape[2], W = xs.shape[3];
    const i64 O = ws.shape[0], CG = ws.shape[1], KH = ws.shape[2], KW = ws.shape[3];
    const i64 HO = os.shape[2], WO = os.shape[3], OG = O / g.groups;
    for (i64 i = first_index(); i < n; i += grid_step()) {
        const i64 ox = i % WO, oy = (i / WO) % HO, o = (i / (WO * HO)) % O, b = i / (WO * HO * O);
        const i64 c0 = (o / OG) * CG;
        A acc = 0;
        for (i64 ic = 0; ic < CG; ic++)
            for (i64 ky = 0; ky < KH; ky++) {
                const i64 iy = oy * g.sh + ky * g.dh - g.ph;
                if (iy < 0 || iy >= H) continue;
                for (i64 kx = 0; kx < KW; kx++) {
                    const i64 ix = ox * g.sw + kx * g.dw - g.pw;
                    if (ix < 0 || ix >= W) continue;
                    acc += (A)Num<T>::load(at4(x, xs, b, c0 + ic, iy, ix)) * (A)Num<T>::load(at4(w, ws, o, ic, ky, kx));
                }
            }
        out[position(os, i)] = Num<T>::store(acc);
    }
}

/// gx[b, c, iy, ix] = Σ over the group's output channels and the taps that read (iy, ix) of g · w.
template <class T>
__global__ void conv2d_input_grad(const T *__restrict__ gy, Strided gs, const T *__restrict__ w, Strided ws,
                                  T *__restrict__ out, Strided os, i64 n, ConvGeometry g) {
    typedef typename Num<T>::acc A;
    const i64 C = os.shape[1], H = os.shape[2], W = os.shape[3];
    const i64 O = ws.shape[0], CG = ws.shape[1], KH = ws.shape[2], KW = ws.shape[3];
    const i64 HO = gs.shape[2], WO = gs.shape[3], OG = O / g.groups;
    for (i64 i = first_index(); i < n; i += grid_step()) {
        const i64 ix = i % W, iy = (i / W) % H, c = (i / (W * H)) % C, b = i / (W * H * C);
        const i64 group = c / CG, ic = c % CG;
        A acc = 0;
        for (i64 o = group * OG; o < (group + 1) * OG; o++)
            for (i64 ky = 0; ky < KH; ky++) {
                const i64 ty = iy + g.ph - ky * g.dh;  // = oy · sh for the output that reads iy
                if (ty < 0 || ty % g.sh != 0 || ty / g.sh >= HO) continue;
                for (i64 kx = 0; kx < KW; kx++) {
                    const i64 tx = ix + g.pw - kx * g.dw;
                    if (tx < 0 || tx % g.sw != 0 || tx / g.sw >= WO) continue;
                    acc += (A)Num<T>::load(at4(gy, gs, b, o, ty / g.sh, tx / g.sw)) *
                           (A)Num<T>::load(at4(w, ws, o, ic, ky, kx));
                }
            }
        out[position(os, i)] = Num<T>::store(acc);
    }
}

/// gw[o, ic, ky, kx] = Σ over the batch and the output positions of g · x, written in the
/// layout `ws` (OIHW or channels-last, the weight's own order).
template <class T>
__global__ void conv2d_weight_grad(const T *__restrict__ x, Strided xs, const T *__restrict__ gy, Strided gs,
                                   T *__restrict__ out, Strided ws, i64 n, ConvGeometry g) {
    typedef typename Num<T>::acc A;
    const i64 N = xs.shape[0], H = xs.shape[2], W = xs.shape[3];
    const i64 O = ws.shape[0], CG = ws.shape[1], KH = ws.shape[2], KW = ws.shape[3];
    const i64 HO = gs.shape[2], WO = gs.shape[3], OG = O / g.groups;
    for (i64 i = first_index(); i < n; i += grid_step()) {
        const i64 kx = i % KW, ky = (i / KW) % KH, ic = (i / (KW * KH)) % CG, o = i / (KW * KH * CG);
        const i64 c = (o / OG) * CG + ic;
        A acc = 0;
        for (i64 b = 0; b < N; b++)
            for (i64 oy = 0; oy < HO; oy++) {
                const i64 iy = oy * g.sh + ky * g.dh - g.ph;
                if (iy < 0 || iy >= H) continue;
                for (i64 ox = 0; ox < WO; ox++) {
                    const i64 ix = ox * g.sw + kx * g.dw - g.pw;
                    if (ix < 0 || ix >= W) continue;
                    acc += (A)Num<T>::load(at4(gy, gs, b, o, oy, ox)) * (A)Num<T>::load(at4(x, xs, b, c, iy, ix));
                }
            }
        out[position(ws, i)] = Num<T>::store(acc);
    }
}

/// A stem's channel padding in one pass: `x`, dense `[outer, from_c, inner]`, into `out`, dense
/// `[outer, to_c, inner]` (NCHW: outer = N, inner = H·W; channels-last: outer = N·H·W, inner
/// = 1), zeros in the channels past `from_c` and x's channels past `to_c` dropped — the padded
/// input and weight, and the weight gradient cut back. One thread per (outer, inner) position
/// writes its `to_c` channels, so every element is written once and a channels-last thread
/// reads and writes one pixel's run.
template <class T>
__global__ void copy_channels(const T *__restrict__ x, T *__restrict__ out, i64 outer, i64 from_c, i64 to_c,
                              i64 inner) {
    const i64 n = outer * inner;
    const T zero = From<T>::f(0.0);
    for (i64 t = first_index(); t < n; t += grid_step()) {
        const i64 o = inner == 1 ? t : t / inner, j = inner == 1 ? 0 : t % inner;
        const T *from = x + o * from_c * inner + j;
        T *to = out + o * to_c * inner + j;
        for (i64 c = 0; c < to_c; c++) to[c * inner] = c < from_c ? from[c * inner] : zero;
    }
}
