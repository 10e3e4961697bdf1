// The input op: a u8 [N, H, W, C] batch → (x / 255 − mean[c]) / std[c] as T, logically
// [N, C, H, W] (written in the output's layout, channels-last by default). A byte takes 256
// values, so each block first tabulates what every (channel, byte) becomes — the reference's
// formula in f64, rounded once: bit-identical to it — and an element is then one shared-memory
// read, with no double arithmetic per element (GeForce cards run it at 1/64 of float rate).
#include "common.cuh"

/// At most this many channels (the Rust side refuses more, naming the op).
#define INPUT_MAX_CHANNELS 16

struct Normalization {
    double mean[INPUT_MAX_CHANNELS];
    double std[INPUT_MAX_CHANNELS];
};

/// The block's table: entry c · 256 + b is byte b of channel c normalised, as T. Every thread
/// of the block must call it; it ends with a barrier, so each may read any entry after.
template <class T>
__device__ __forceinline__ const T *input_table(const Normalization &norm, i64 C) {
    __shared__ Pack16<u8> space[INPUT_MAX_CHANNELS * 256 * sizeof(T) / 16];
    T *table = reinterpret_cast<T *>(space);
    for (i64 k = threadIdx.x; k < C * 256; k += blockDim.x) {
        const i64 c = k / 256;
        table[k] = From<T>::f(((double)(k % 256) / 255.0 - norm.mean[c]) / norm.std[c]);
    }
    __syncthreads();
    return table;
}

/// Any layouts: a thread per output element in logical order.
template <class T>
__global__ void normalize_input(const u8 *__restrict__ x, Strided xs, T *__restrict__ out, Strided os, i64 n,
                                Normalization norm) {
    const i64 C = os.shape[1], H = os.shape[2], W = os.shape[3];
    const T *table = input_table<T>(norm, C);
    for (i64 i = first_index(); i < n; i += grid_step()) {
        const i64 px = i % W, py = (i / W) % H, ch = (i / (W * H)) % C, b = i / (W * H * C);
        const i64 at = xs.offset + b * xs.stride[0] + py * xs.stride[1] + px * xs.stride[2] + ch * xs.stride[3];
        out[position(os, i)] = table[ch * 256 + x[at]];
    }
}

/// The loader's case: x a dense [N, H, W, C] batch and out dense channels-last, which lay out
/// (n, y, x, c) alike, so element m of each is the same one, of channel m % C. A step reads 16
/// bytes (one 128-bit load) and writes sizeof(T) 128-bit stores; the last n % 16 elements go
/// one a thread. Both pointers 16-byte aligned (the launcher checks).
template <class T>
__global__ void normalize_input_packed(const Pack16<u8> *__restrict__ x, Pack16<T> *__restrict__ out, i64 n,
                                       i64 C, Normalization norm) {
    const T *table = input_table<T>(norm, C);
    const int K = 16 / sizeof(T);
    const i64 packs = n / 16;
    for (i64 p = first_index(); p < packs; p += grid_step()) {
        const Pack16<u8> bytes = x[p];
        i64 c = (p * 16) % C;
#pragma unroll
        for (int j = 0; j < (int)sizeof(T); j++) {
            Pack16<T> o;
#pragma unroll
            for (int k = 0; k < K; k++) {
                o.v[k] = table[c * 256 + bytes.v[j * K + k]];
                if (++c == C) c = 0;
            }
            out[p * (i64)sizeof(T) + j] = o;
        }
    }
    const u8 *xe = reinterpret_cast<const u8 *>(x);
    T *oe = reinterpret_cast<T *>(out);
    for (i64 m = packs * 16 + first_index(); m < n; m += grid_step()) oe[m] = table[(m % C) * 256 + xe[m]];
}
