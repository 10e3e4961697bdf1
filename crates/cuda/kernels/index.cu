// Indexing along one axis with an i64 index: gather, and its transpose scatter-add. Scatter-add
// pulls: each destination element sums the sources that name it, in index order, so there are
// no float atomics and every run gives the same bits. An index outside the axis cannot be
// reported without a host synchronisation: gather writes 0 for it and scatter-add skips it.
#include "common.cuh"

/// out[p] = x[p with its `axis` coordinate replaced by index[p]], p row-major over index's shape
/// (`is.shape`); out is contiguous. Only x's strides and offset are read from `xs`.
template <class T>
__global__ void gather(const T *__restrict__ x, Strided xs, const i64 *__restrict__ index, Strided is,
                       T *__restrict__ out, i64 n, i32 axis, i64 axis_len) {
    for (i64 p = first_index(); p < n; p += grid_step()) {
        const i64 k = index[position(is, p)];
        if (k < 0 || k >= axis_len) {
            out[p] = From<T>::f(0.0);
            continue;
        }
        i64 rest = p, at = xs.offset;
        for (int d = is.rank - 1; d >= 0; d--) {
            const i64 c = rest % is.shape[d];
            rest /= is.shape[d];
            at += (d == axis ? k : c) * xs.stride[d];
        }
        out[p] = x[at];
    }
}

/// dst[q] += Σ src[p] over the p (index's shape) with index[p] = q's `axis` coordinate and p's
/// other coordinates equal to q's; dst is a whole contiguous storage of shape `ds.shape`.
template <class T>
__global__ void scatter_add(T *__restrict__ dst, Strided ds, const i64 *__restrict__ index, Strided is,
                            const T *__restrict__ src, Strided ss, i64 n, i32 axis) {
    for (i64 q = first_index(); q < n; q += grid_step()) {
        // q's coordinates; the index position of its row along `axis` (coordinate 0 there).
        i64 rest = q, target = 0, row = 0, row_src = 0;
        bool inside = true;
        for (int d = ds.rank - 1; d >= 0; d--) {
            const i64 c = rest % ds.shape[d];
            rest /= ds.shape[d];
            if (d == axis) {
                target = c;
                continue;
            }
            if (c >= is.shape[d]) inside = false;
            row += c * is.stride[d];
            row_src += c * ss.stride[d];
        }
        if (!inside) continue;
        typename Num<T>::acc acc = 0;
        bool any = false;
        for (i64 j = 0; j < is.shape[axis]; j++) {
            if (index[is.offset + row + j * is.stride[axis]] != target) continue;
            acc += Num<T>::load(src[ss.offset + row_src + j * ss.stride[axis]]);
            any = true;
        }
        if (any) dst[q] = Num<T>::store(Num<T>::load(dst[q]) + acc);
    }
}
