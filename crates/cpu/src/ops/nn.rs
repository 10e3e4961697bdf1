//! Softmax, gather / scatter-add, Philox uniforms and the input op.

use redline_tensor::{scalar, DType, Layout, Result, TensorError};

use crate::buffer::{
    as_compute, from_compute, overwritten, with_compute, with_data, Data, Elem, Real,
};
use crate::ops::elementwise::{dense, map};
use crate::parallel::{self, Disjoint};

pub(crate) fn softmax(x: &Data, xl: &Layout, axis: usize, log: bool, out: &Layout) -> Data {
    let shape = xl.shape();
    let n = shape[axis];
    let inner: usize = shape[axis + 1..].iter().product();
    let outer: usize = shape[..axis].iter().product();
    let row_major = Layout::contiguous(shape);
    with_compute!(x.dtype(), C => {
        let src = as_compute::<C>(x);
        let xs = dense(&src, xl, &row_major);
        let mut y = overwritten::<C>(xs.len());
        let block = n * inner;
        let ys = Disjoint::new(&mut y);
        parallel::for_parts(outer, parallel::parts_for(outer * block, 1 << 14), |_, range| {
            for o in range {
                // SAFETY: each outer index owns its block of the output.
                let yb = unsafe { ys.slice(o * block..(o + 1) * block) };
                let xb = &xs[o * block..(o + 1) * block];
                for i in 0..inner {
                    let at = |k: usize| k * inner + i;
                    let max = (0..n)
                        .map(|k| xb[at(k)])
                        .fold(C::NEG_INFINITY, |m, v| if v > m { v } else { m });
                    let mut sum = C::ZERO;
                    for k in 0..n {
                        sum += (xb[at(k)] - max).exp();
                    }
                    for k in 0..n {
                        yb[at(k)] = if log {
                            xb[at(k)] - max - sum.ln()
                        } else {
                            (xb[at(k)] - max).exp() / sum
                        };
                    }
                }
            }
        });
        from_compute(x.dtype(), dense(&y, &row_major, out).into_owned())
    })
}

fn out_of_range(k: &dyn std::fmt::Display, axis: usize, len: usize) -> TensorError {
    TensorError::Shape(format!(
        "index {k} is out of range for axis {axis} of length {len}"
    ))
}

/// A dense i64 index storage read in place, every value checked to lie in `0..len` (one
/// read-only pass on every core: no converted copy, which for a max pool's positions — 1.6 M
/// of them at ResNet's stem — was a single-threaded pass writing 13 MB of fresh pages); None
/// for any other storage (use [`checked_index`]). The values are returned in memory order, so
/// `il` must be `order` exactly (row-major, or channels-last for a max pool's positions).
pub(crate) fn dense_in_range<'a>(
    index: &'a Data,
    il: &Layout,
    order: &Layout,
    axis: usize,
    len: usize,
) -> Result<Option<&'a [i64]>> {
    let Data::I64(v) = index else {
        return Ok(None);
    };
    if il != order {
        return Ok(None);
    }
    let v = &v[il.offset()..il.offset() + il.numel()];
    let bad = std::sync::atomic::AtomicBool::new(false);
    let valid = |&k: &i64| usize::try_from(k).is_ok_and(|k| k < len);
    parallel::for_parts(
        v.len(),
        parallel::parts_for(v.len(), 1 << 16),
        |_, range| {
            if !v[range].iter().all(valid) {
                bad.store(true, std::sync::atomic::Ordering::Relaxed);
            }
        },
    );
    if bad.into_inner() {
        let k = v.iter().find(|k| !valid(k)).copied().unwrap_or_default();
        return Err(out_of_range(&k, axis, len));
    }
    Ok(Some(v))
}

/// The index view's values as in-range positions along `axis` (row-major over its shape).
pub(crate) fn checked_index(
    index: &Data,
    il: &Layout,
    axis: usize,
    len: usize,
) -> Result<Vec<usize>> {
    let out_of_range = |k: &dyn std::fmt::Display| out_of_range(k, axis, len);
    // The usual case (positions an op just produced): dense i64, read as it is — no f64 copy.
    if let Data::I64(v) = index {
        if *il == Layout::contiguous(il.shape()) {
            return v
                .iter()
                .map(|&k| {
                    usize::try_from(k)
                        .ok()
                        .filter(|&k| k < len)
                        .ok_or_else(|| out_of_range(&k))
                })
                .collect();
        }
    }
    let values = dense(
        &as_compute::<f64>(index),
        il,
        &Layout::contiguous(il.shape()),
    )
    .into_owned();
    values
        .into_iter()
        .map(|k| {
            if k < 0.0 || k as usize >= len {
                Err(out_of_range(&k))
            } else {
                Ok(k as usize)
            }
        })
        .collect()
}

/// For row-major element `p` of `shape`, its position under `strides` with the `axis`
/// coordinate replaced by `k`.
#[inline]
fn position(p: usize, shape: &[usize], strides: &[usize], axis: usize, k: usize) -> usize {
    let (mut rest, mut at) = (p, 0);
    for d in (0..shape.len()).rev() {
        let coord = rest % shape[d];
        rest /= shape[d];
        at += if d == axis { k } else { coord } * strides[d];
    }
    at
}

pub(crate) fn gather(
    x: &Data,
    xl: &Layout,
    axis: usize,
    index: &Data,
    il: &Layout,
) -> Result<Data> {
    let idx = checked_index(index, il, axis, xl.shape()[axis])?;
    let shape = il.shape();
    fn pick<E: Elem>(
        src: &[E],
        idx: &[usize],
        shape: &[usize],
        xl: &Layout,
        axis: usize,
    ) -> Vec<E> {
        let mut out = overwritten::<E>(idx.len());
        parallel::chunks_mut(&mut out, 1 << 14, |start, chunk| {
            for (i, o) in chunk.iter_mut().enumerate() {
                let p = start + i;
                *o = src[xl.offset() + position(p, shape, xl.strides(), axis, idx[p])];
            }
        });
        out
    }
    Ok(with_data!(x, v => Elem::wrap(pick(v, &idx, shape, xl, axis))))
}

/// `dst[p with axis coordinate index[p]] += src[p]` on a contiguous `dst` of `dst_shape`.
pub(crate) fn scatter_add(
    dst: &mut Data,
    dst_shape: &[usize],
    axis: usize,
    idx: &[usize],
    index_shape: &[usize],
    src: &Data,
    sl: &Layout,
) {
    let strides = redline_tensor::layout::contiguous_strides(dst_shape);
    let outer: usize = index_shape[..axis].iter().product();
    let per_outer: usize = index_shape[axis..].iter().product();
    with_compute!(dst.dtype(), C => {
        let values = dense(&as_compute::<C>(src), sl, &Layout::contiguous(index_shape)).into_owned();
        let add = |d: &mut [C]| {
            let target = Disjoint::new(d);
            // Elements with different coordinates before `axis` never meet in dst: split there.
            parallel::for_parts(outer, parallel::parts_for(outer * per_outer, 1 << 14), |_, range| {
                for p in range.start * per_outer..range.end * per_outer {
                    let at = position(p, index_shape, &strides, axis, idx[p]);
                    assert!(at < target.len());
                    // SAFETY: in bounds (checked); parts own disjoint outer coordinates.
                    unsafe { *target.ptr().add(at) += values[p] };
                }
            });
        };
        match C::borrow_mut(dst) {
            Some(d) => add(d),
            None => {
                let mut d: Vec<C> = as_compute::<C>(dst).into_owned();
                add(&mut d);
                *dst = from_compute(dst.dtype(), d);
            }
        }
    })
}

pub(crate) fn checked_scatter_index(
    index: &Data,
    il: &Layout,
    axis: usize,
    dst_shape: &[usize],
) -> Result<Vec<usize>> {
    checked_index(index, il, axis, dst_shape[axis])
}

pub(crate) fn random_uniform(dtype: DType, len: usize, seed: u64, offset: u64) -> Data {
    let mut values = vec![0.0f64; len];
    parallel::chunks_mut(&mut values, 1 << 14, |start, chunk| {
        for (i, v) in chunk.iter_mut().enumerate() {
            *v = scalar::uniform(seed, offset + (start + i) as u64);
        }
    });
    from_compute(dtype, values)
}

/// u8 `[N, H, W, C]` → `(x / 255 - mean[c]) / std[c]`, logically `[N, C, H, W]` in `out`.
pub(crate) fn normalize_input(
    x: &Data,
    xl: &Layout,
    mean: &[f64],
    std: &[f64],
    dtype: DType,
    out: &Layout,
) -> Result<Data> {
    let nchw = xl.permute(&[0, 3, 1, 2])?;
    let s = out.shape();
    // Per-channel scale and shift, broadcast over N, H, W.
    let per_channel = Layout::new(s.to_vec(), vec![0, 1, 0, 0], 0);
    with_compute!(dtype, C => {
        let scale: Vec<C> = std.iter().map(|&d| C::c(1.0 / (255.0 * d))).collect();
        let shift: Vec<C> = mean.iter().zip(std).map(|(&m, &d)| C::c(-m / d)).collect();
        // The loader's case: a dense NHWC u8 batch into channels-last, pixel by pixel (the
        // strided walk below runs in runs of 3 channels, and widens the bytes first).
        if let (Data::U8(bytes), Ok(order)) = (x, Layout::channels_last(s)) {
            if *xl == Layout::contiguous(xl.shape()) && *out == order {
                let c = s[1];
                let src = &bytes[..xl.numel()];
                let mut values = crate::buffer::overwritten::<C>(src.len());
                crate::parallel::chunks_mut(&mut values, 1 << 15, |start, dst| {
                    let from = &src[start..start + dst.len()];
                    let mut ch = start % c;
                    for (v, &b) in dst.iter_mut().zip(from) {
                        *v = C::c(f64::from(b)) * scale[ch] + shift[ch];
                        ch = if ch + 1 == c { 0 } else { ch + 1 };
                    }
                });
                return Ok(from_compute(dtype, values));
            }
        }
        let src = as_compute::<C>(x);
        let values = map([out, &nchw, &per_channel, &per_channel], [&[], &src, &scale, &shift], |v| {
            v[1] * v[2] + v[3]
        });
        Ok(from_compute(dtype, values))
    })
}
