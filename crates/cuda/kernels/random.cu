// Counter-based uniform numbers: element i is word (offset + i) % 4 of Philox-4x32-10 with key
// `seed` and counter (offset + i) / 4, as (word >> 8) · 2^-24 — the reference's stream, bit for
// bit, whatever the launch geometry (DESIGN contract 9). The stream's position is `offset`, plus
// the i64 at `at` when given: a device scalar, read when the kernel runs and moved on by
// `advance` after it, so a captured graph draws from wherever the stream has got to on each
// replay.
#include "common.cuh"

__device__ __forceinline__ u32 philox_word(u64 block, u64 seed, u32 word) {
    u32 c0 = (u32)block, c1 = (u32)(block >> 32), c2 = 0, c3 = 0;
    u32 k0 = (u32)seed, k1 = (u32)(seed >> 32);
    for (int round = 0; round < 10; round++) {
        if (round > 0) {
            k0 += 0x9E3779B9u;
            k1 += 0xBB67AE85u;
        }
        const u64 p0 = (u64)0xD2511F53u * c0;
        const u64 p1 = (u64)0xCD9E8D57u * c2;
        const u32 n0 = (u32)(p1 >> 32) ^ c1 ^ k0, n1 = (u32)p1;
        const u32 n2 = (u32)(p0 >> 32) ^ c3 ^ k1, n3 = (u32)p0;
        c0 = n0;
        c1 = n1;
        c2 = n2;
        c3 = n3;
    }
    return word == 0 ? c0 : word == 1 ? c1 : word == 2 ? c2 : c3;
}

template <class T>
__global__ void random_uniform(T *__restrict__ out, i64 n, u64 seed, u64 offset, const i64 *__restrict__ at) {
    const u64 start = offset + (at != nullptr ? (u64)*at : 0);
    for (i64 i = first_index(); i < n; i += grid_step()) {
        const u64 e = start + (u64)i;
        const u32 w = philox_word(e / 4, seed, (u32)(e % 4));
        out[i] = From<T>::f((double)(w >> 8) * (1.0 / 16777216.0));
    }
}

/// The stream's device position moved past a draw of `n` (one thread; launched after the draw,
/// whose threads have all read the old position by then).
__global__ void advance(i64 *at, i64 n) {
    if (first_index() == 0) *at += n;
}
