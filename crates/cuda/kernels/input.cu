// The input op: a u8 [N, H, W, C] batch → (x / 255 − mean[c]) / std[c] as T, logically
// [N, C, H, W] (written in the output's layout, channels-last by default). Computed in f64 with
// the reference's formula, then rounded once: bit-identical to it. Memory-bound either way.
#include "common.cuh"

/// At most this many channels (the Rust side refuses more, naming the op).
#define INPUT_MAX_CHANNELS 16

struct Normalization {
    double mean[INPUT_MAX_CHANNELS];
    double std[INPUT_MAX_CHANNELS];
};

template <class T>
__global__ void normalize_input(const u8 *__restrict__ x, Strided xs, T *__restrict__ out, Strided os, i64 n,
                                Normalization norm) {
    const i64 C = os.shape[1], H = os.shape[2], W = os.shape[3];
    for (i64 i = first_index(); i < n; i += grid_step()) {
        const i64 px = i % W, py = (i / W) % H, ch = (i / (W * H)) % C, b = i / (W * H * C);
        const i64 at = xs.offset + b * xs.stride[0] + py * xs.stride[1] + px * xs.stride[2] + ch * xs.stride[3];
        const double v = ((double)x[at] / 255.0 - norm.mean[ch]) / norm.std[ch];
        out[position(os, i)] = From<T>::f(v);
    }
}
