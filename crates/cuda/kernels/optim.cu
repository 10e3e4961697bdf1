// Multi-tensor optimizer and mixed-precision ops. A launch takes up to LIST_MAX tensors'
// pointers by value (PyTorch's multi_tensor_apply approach: no pointer table to upload, so a
// captured graph replays them as they are). CUDA 12.1 raised the kernel parameter limit from
// 4 KiB to 32,764 bytes on Volta and later (this build needs a 12.8 driver), so a list holds
// 512 tensors — ResNet-50's 161 parameters (ResNet-152's 467) are one launch per op, where
// 4 KiB held about 36. The grid is flat: tensor t owns blocks [first_block[t], first_block[t+1]),
// as many as its length needs up to a cap, so no block is launched only to find its tensor
// shorter than the longest. They read the device-side found-inf flag and skip the step on
// overflow: a training step never waits for the host. One-element scalars (found-inf, step,
// scale, growth tracker) may be of any dtype: read and written through `load_scalar` /
// `store_scalar` by the dtype's code.
#include "block.cuh"

#define LIST_MAX 512

/// Up to four lists of tensors (param, grad, and two states), `count` of them, `n[i]` elements,
/// and the flat grid's block map. Mirrored by `list` in `src/ops/optim.rs`.
struct TensorList {
    u64 ptr[4][LIST_MAX];
    i64 n[LIST_MAX];
    i32 first_block[LIST_MAX];
    i32 count;
    i32 unused;
};

// A list is read where the launch left it: on a GPU from the parameter bank; on the host
// emulator through a reference to the launch's bytes, since a by-value parameter is copied
// for every thread (22 KiB each).
#ifdef REDLINE_HOST_EMULATOR
typedef const TensorList &Tensors;
#else
typedef const TensorList Tensors;
#endif

/// This block's share of the flat grid: its tensor, and the element walk over that tensor's
/// blocks — from `begin`, every `step`.
struct Share {
    int t;
    i64 begin, step;
};

__device__ __forceinline__ Share share_of(Tensors list) {
    // The last tensor whose first block is at or before this one: a tensor of no blocks
    // shares its first block with the next, which wins.
    const i32 b = (i32)blockIdx.x;
    int lo = 0, hi = list.count - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (list.first_block[mid] <= b) lo = mid;
        else hi = mid - 1;
    }
    const i32 end = lo + 1 < list.count ? list.first_block[lo + 1] : (i32)gridDim.x;
    const i64 blocks = end - list.first_block[lo];
    return Share{lo, (i64)(b - list.first_block[lo]) * blockDim.x + threadIdx.x, blocks * blockDim.x};
}

/// redline_tensor::DType in declaration order.
enum DTypeCode { CODE_F64, CODE_F32, CODE_F16, CODE_BF16, CODE_U8, CODE_I32, CODE_I64 };

__device__ __forceinline__ double load_scalar(const void *p, i32 code) {
    switch (code) {
    case CODE_F64: return *(const double *)p;
    case CODE_F32: return (double)*(const float *)p;
    case CODE_F16: return (double)__half2float(*(const __half *)p);
    case CODE_BF16: return (double)__bfloat162float(*(const __nv_bfloat16 *)p);
    case CODE_U8: return (double)*(const u8 *)p;
    case CODE_I32: return (double)*(const i32 *)p;
    default: return (double)*(const i64 *)p;
    }
}

__device__ __forceinline__ void store_scalar(void *p, i32 code, double v) {
    switch (code) {
    case CODE_F64: *(double *)p = v; break;
    case CODE_F32: *(float *)p = From<float>::f(v); break;
    case CODE_F16: *(__half *)p = From<__half>::f(v); break;
    case CODE_BF16: *(__nv_bfloat16 *)p = From<__nv_bfloat16>::f(v); break;
    case CODE_U8: *(u8 *)p = From<u8>::f(v); break;
    case CODE_I32: *(i32 *)p = From<i32>::f(v); break;
    default: *(i64 *)p = From<i64>::f(v); break;
    }
}

/// A flag pointer (null: no flag) and its dtype code.
struct Flag {
    u64 ptr;
    i32 code;
    i32 unused;
};

__device__ __forceinline__ bool raised(Flag f) { return f.ptr != 0 && load_scalar((const void *)f.ptr, f.code) != 0.0; }

struct SgdArgs {
    double lr_scale, momentum, dampening, weight_decay;
    i32 nesterov, unused0, unused1, unused2;
};

/// An optimizer's count of applied steps: += 1 unless found-inf (one thread, in its own launch
/// before the update, so every block of the update reads the new value).
__global__ void count_step(Flag step, Flag found_inf) {
    if (threadIdx.x != 0 || blockIdx.x != 0 || raised(found_inf)) return;
    store_scalar((void *)step.ptr, step.code, load_scalar((const void *)step.ptr, step.code) + 1.0);
}

/// PyTorch's SGD at (already counted) `step` and learning rate `lr · lr_scale`, both read from
/// the device (a replayed graph sees this step's values): list 0 params, 1 grads, 2 momentum
/// buffers (when momentum ≠ 0), filled with the gradient on the first applied step.
template <class T>
__global__ void sgd(Tensors list, SgdArgs a, Flag step, Flag lr, Flag found_inf) {
    typedef typename Num<T>::acc A;
    if (raised(found_inf)) return;
    const bool first = load_scalar((const void *)step.ptr, step.code) == 1.0;
    const A rate = (A)(load_scalar((const void *)lr.ptr, lr.code) * a.lr_scale);
    const Share s = share_of(list);
    T *param = (T *)list.ptr[0][s.t];
    const T *grad = (const T *)list.ptr[1][s.t];
    T *buf = (T *)list.ptr[2][s.t];
    for (i64 i = s.begin; i < list.n[s.t]; i += s.step) {
        const A w = Num<T>::load(param[i]);
        A d = Num<T>::load(grad[i]) + (A)a.weight_decay * w;
        if (a.momentum != 0.0) {
            const A b = first ? d : (A)a.momentum * Num<T>::load(buf[i]) + (A)(1.0 - a.dampening) * d;
            buf[i] = Num<T>::store(b);
            d = a.nesterov ? d + (A)a.momentum * b : b;
        }
        param[i] = Num<T>::store(w - rate * d);
    }
}

struct AdamArgs {
    double lr_scale, beta1, beta2, eps, weight_decay;
};

/// PyTorch's AdamW at the (already counted) step and learning rate `lr · lr_scale`, both read
/// from the device: list 0 params, 1 grads, 2 exp_avg, 3 exp_avg_sq.
///
/// The bias corrections take two f64 `pow`s: one thread of each block computes them and shares
/// them, since every thread doing so cost a GeForce card (f64 at 1/64 rate) milliseconds a
/// step. A skipped step leaves after the barrier, so every block reaches it whatever the data
/// (the host emulator runs a kernel whose launch met no barrier without fibers from then on,
/// and a skipped first step would have hidden it).
template <class T>
__global__ void adamw(Tensors list, AdamArgs a, Flag step, Flag lr, Flag found_inf) {
    typedef typename Num<T>::acc A;
    const Share s = share_of(list);
    __shared__ A corrections[2];
    if (threadIdx.x == 0) {
        const double steps = load_scalar((const void *)step.ptr, step.code);
        corrections[0] = (A)(1.0 - pow(a.beta1, steps));
        corrections[1] = (A)sqrt(1.0 - pow(a.beta2, steps));
    }
    __syncthreads();
    if (raised(found_inf)) return;
    const A bc1 = corrections[0], bc2_sqrt = corrections[1];
    const double rate = load_scalar((const void *)lr.ptr, lr.code) * a.lr_scale;
    T *param = (T *)list.ptr[0][s.t];
    const T *grad = (const T *)list.ptr[1][s.t];
    T *m1 = (T *)list.ptr[2][s.t];
    T *m2 = (T *)list.ptr[3][s.t];
    for (i64 i = s.begin; i < list.n[s.t]; i += s.step) {
        const A g = Num<T>::load(grad[i]);
        const A w = Num<T>::load(param[i]) * (A)(1.0 - rate * a.weight_decay);
        const A m = (A)a.beta1 * Num<T>::load(m1[i]) + (A)(1.0 - a.beta1) * g;
        const A v = (A)a.beta2 * Num<T>::load(m2[i]) + (A)(1.0 - a.beta2) * g * g;
        const A denom = sqrt(v) / bc2_sqrt + (A)a.eps;
        m1[i] = Num<T>::store(m);
        m2[i] = Num<T>::store(v);
        param[i] = Num<T>::store(w - (A)rate / bc1 * m / denom);
    }
}

/// g *= inv_scale for every gradient (list 0); found-inf = 1 where a result is inf or NaN.
template <class T>
__global__ void unscale_check(Tensors list, Flag inv_scale, Flag found_inf) {
    typedef typename Num<T>::acc A;
    const A inv = (A)load_scalar((const void *)inv_scale.ptr, inv_scale.code);
    const Share s = share_of(list);
    T *grad = (T *)list.ptr[0][s.t];
    bool bad = false;
    for (i64 i = s.begin; i < list.n[s.t]; i += s.step) {
        const A v = Num<T>::load(grad[i]) * inv;
        bad |= !isfinite(v);
        grad[i] = Num<T>::store(v);
    }
    // Every writer writes the same 1: the race is benign.
    if (bad) store_scalar((void *)found_inf.ptr, found_inf.code, 1.0);
}

/// Σ g² over each tensor of list 0, a block's share into partials[blockIdx.x]: every block of
/// the launch writes its entry, so the final sum needs no clearing. The first pass of gradient
/// clipping's global norm.
template <class T>
__global__ void __launch_bounds__(256) sum_squares_partial(Tensors list, typename Num<T>::acc *partials) {
    typedef typename Num<T>::acc A;
    const Share s = share_of(list);
    const T *g = (const T *)list.ptr[0][s.t];
    A sum = 0;
    for (i64 i = s.begin; i < list.n[s.t]; i += s.step) {
        const A v = Num<T>::load(g[i]);
        sum += v * v;
    }
    sum = block_all(sum, SumOp());
    if (threadIdx.x == 0) partials[blockIdx.x] = sum;
}

/// out[0] = Σ partials[0..n) (one block, in a fixed order: the same bits every run).
template <class A>
__global__ void __launch_bounds__(256) sum_partials(const A *__restrict__ partials, i64 n, A *__restrict__ out) {
    A sum = 0;
    for (i64 i = threadIdx.x; i < n; i += blockDim.x) sum += partials[i];
    sum = block_all(sum, SumOp());
    if (threadIdx.x == 0) out[0] = sum;
}

struct ScalerArgs {
    double growth_factor, backoff_factor, growth_interval;
};

/// GradScaler's update (one thread): back off on overflow, grow after `growth_interval` clean
/// steps; then clear found-inf for the next step.
__global__ void scaler_update(Flag scale, Flag tracker, Flag found_inf, ScalerArgs a) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    const bool overflow = raised(found_inf);
    const double count = load_scalar((const void *)tracker.ptr, tracker.code);
    double factor = 1.0, next = count + 1.0;
    if (overflow) {
        factor = a.backoff_factor;
        next = 0.0;
    } else if (count + 1.0 >= a.growth_interval) {
        factor = a.growth_factor;
        next = 0.0;
    }
    store_scalar((void *)scale.ptr, scale.code, load_scalar((const void *)scale.ptr, scale.code) * factor);
    store_scalar((void *)tracker.ptr, tracker.code, next);
    store_scalar((void *)found_inf.ptr, found_inf.code, 0.0);
}
