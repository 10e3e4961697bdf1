//! Elementwise ops over strided views: unary, binary, select, convert, copy_into — and the
//! `map` kernel every other op uses to read a view in the order it needs.

use redline_tensor::backend::{BinaryOp, UnaryOp};
use redline_tensor::{scalar, DType, Layout, Result, TensorError};

use crate::buffer::{
    as_compute, from_compute, overwritten, recycle, with_compute, with_data, Data, Elem, Real,
};
use crate::parallel;
use crate::strided::Plan;

/// Elements per part below which an op stays on one thread.
const MIN_PER_PART: usize = 1 << 15;

/// A dense output in `layouts[0]`'s memory order whose element is `f(inputs)`, where input `k`
/// (`k ≥ 1`) is `srcs[k]` read through `layouts[k]` (`srcs[0]` is unused).
pub(crate) fn map<C: Real, const M: usize>(
    layouts: [&Layout; M],
    srcs: [&[C]; M],
    f: impl Fn([C; M]) -> C + Sync,
) -> Vec<C> {
    let plan = Plan::new(layouts);
    let mut out = overwritten::<C>(layouts[0].storage_extent().max(plan.numel()));
    let inner = plan.inner();
    parallel::chunks_mut(&mut out, MIN_PER_PART, |start, chunk| {
        let mut at = 0;
        plan.runs(start..start + chunk.len(), |pos, len| {
            let run = &mut chunk[at..at + len];
            if (1..M).all(|k| inner[k] == 1) {
                // The common case (contiguous operands): plain slices the compiler vectorises.
                let ins: [&[C]; M] = std::array::from_fn(|k| {
                    if k == 0 {
                        &[][..]
                    } else {
                        &srcs[k][pos[k]..pos[k] + len]
                    }
                });
                for (j, o) in run.iter_mut().enumerate() {
                    *o = f(std::array::from_fn(|k| {
                        if k == 0 {
                            C::ZERO
                        } else {
                            ins[k][j]
                        }
                    }));
                }
            } else {
                for (j, o) in run.iter_mut().enumerate() {
                    *o = f(std::array::from_fn(|k| {
                        if k == 0 {
                            C::ZERO
                        } else {
                            srcs[k][pos[k] + j * inner[k]]
                        }
                    }));
                }
            }
            at += len;
        });
    });
    out
}

/// A view's elements in a wanted order: borrowed when they already were, else a copy that goes
/// back to the recycled vectors when dropped (layout conversions are transient and large).
pub(crate) enum Dense<'a, E: Elem> {
    Borrowed(&'a [E]),
    Owned(Vec<E>),
}

impl<E: Elem> std::ops::Deref for Dense<'_, E> {
    type Target = [E];
    fn deref(&self) -> &[E] {
        match self {
            Dense::Borrowed(s) => s,
            Dense::Owned(v) => v,
        }
    }
}

impl<E: Elem> Dense<'_, E> {
    pub fn into_owned(mut self) -> Vec<E> {
        match &mut self {
            Dense::Borrowed(s) => s.to_vec(),
            Dense::Owned(v) => std::mem::take(v),
        }
    }
}

impl<E: Elem> Drop for Dense<'_, E> {
    fn drop(&mut self) {
        if let Dense::Owned(v) = self {
            recycle(std::mem::take(v));
        }
    }
}

/// The elements of `src` (read through `view`) in the memory order of the dense layout `order`
/// (same shape), borrowed when they already are laid out that way.
pub(crate) fn dense<'a, C: Real>(src: &'a [C], view: &Layout, order: &Layout) -> Dense<'a, C> {
    let n = view.numel();
    let same = view
        .shape()
        .iter()
        .zip(view.strides().iter().zip(order.strides()))
        .all(|(&len, (&a, &b))| len <= 1 || a == b);
    if same && view.offset() + n <= src.len() {
        Dense::Borrowed(&src[view.offset()..view.offset() + n])
    } else {
        Dense::Owned(map([order, view], [&[], src], |v| v[1]))
    }
}

/// One monomorphised loop per op (a function pointer per element would keep the compiler from
/// vectorising ReLU, the op a CNN runs most).
fn unary_kernel<C: Real>(op: UnaryOp, x: &[C], xl: &Layout, out: &Layout) -> Vec<C> {
    let (l, s) = ([out, xl], [&[][..], x]);
    match op {
        UnaryOp::Neg => map(l, s, |v| -v[1]),
        UnaryOp::Exp => map(l, s, |v| v[1].exp()),
        UnaryOp::Log => map(l, s, |v| v[1].ln()),
        UnaryOp::Sqrt => map(l, s, |v| v[1].sqrt()),
        UnaryOp::Rsqrt => map(l, s, |v| C::ONE / v[1].sqrt()),
        UnaryOp::Relu => map(l, s, |v| if v[1] > C::ZERO { v[1] } else { C::ZERO }),
        UnaryOp::Sigmoid => map(l, s, |v| C::ONE / (C::ONE + (-v[1]).exp())),
        UnaryOp::Tanh => map(l, s, |v| v[1].tanh()),
        // erf has no std implementation: the reference's series, in f64.
        UnaryOp::Gelu | UnaryOp::GeluGrad => map(l, s, |v| C::c(scalar::unary(op, v[1].to_f64()))),
    }
}

pub(crate) fn unary(op: UnaryOp, x: &Data, xl: &Layout, out: &Layout) -> Data {
    with_compute!(x.dtype(), C => {
        let src = as_compute::<C>(x);
        from_compute(x.dtype(), unary_kernel(op, &src, xl, out))
    })
}

fn binary_kernel<C: Real>(
    op: BinaryOp,
    a: &[C],
    al: &Layout,
    b: &[C],
    bl: &Layout,
    out: &Layout,
) -> Vec<C> {
    let truth = |c: bool| if c { C::ONE } else { C::ZERO };
    let l = [out, al, bl];
    let s = [&[][..], a, b];
    // One monomorphised loop per op: the match stays outside the hot loop.
    match op {
        BinaryOp::Add => map(l, s, |v| v[1] + v[2]),
        BinaryOp::Sub => map(l, s, |v| v[1] - v[2]),
        BinaryOp::Mul => map(l, s, |v| v[1] * v[2]),
        BinaryOp::Div => map(l, s, |v| v[1] / v[2]),
        BinaryOp::Pow => map(l, s, |v| v[1].powf(v[2])),
        BinaryOp::Maximum => map(l, s, |v| {
            if v[1].is_nan() || v[2].is_nan() {
                v[1] + v[2]
            } else if v[1] >= v[2] {
                v[1]
            } else {
                v[2]
            }
        }),
        BinaryOp::Minimum => map(l, s, |v| {
            if v[1].is_nan() || v[2].is_nan() {
                v[1] + v[2]
            } else if v[1] <= v[2] {
                v[1]
            } else {
                v[2]
            }
        }),
        BinaryOp::ReluGrad => map(l, s, |v| if v[1] > C::ZERO { v[2] } else { C::ZERO }),
        BinaryOp::Eq => map(l, s, |v| truth(v[1] == v[2])),
        BinaryOp::Ne => map(l, s, |v| truth(v[1] != v[2])),
        BinaryOp::Lt => map(l, s, |v| truth(v[1] < v[2])),
        BinaryOp::Le => map(l, s, |v| truth(v[1] <= v[2])),
        BinaryOp::Gt => map(l, s, |v| truth(v[1] > v[2])),
        BinaryOp::Ge => map(l, s, |v| truth(v[1] >= v[2])),
    }
}

pub(crate) fn binary(
    op: BinaryOp,
    a: &Data,
    al: &Layout,
    b: &Data,
    bl: &Layout,
    out: &Layout,
) -> Data {
    let out_dtype = if op.is_comparison() {
        DType::U8
    } else {
        a.dtype()
    };
    with_compute!(a.dtype(), C => {
        let (x, y) = (as_compute::<C>(a), as_compute::<C>(b));
        from_compute(out_dtype, binary_kernel(op, &x, al, &y, bl, out))
    })
}

pub(crate) fn select(
    cond: &Data,
    cl: &Layout,
    a: &Data,
    al: &Layout,
    b: &Data,
    bl: &Layout,
    out: &Layout,
) -> Data {
    with_compute!(a.dtype(), C => {
        let (c, x, y) = (as_compute::<C>(cond), as_compute::<C>(a), as_compute::<C>(b));
        let values = map([out, cl, al, bl], [&[], &c, &x, &y], |v| {
            if v[1] != C::ZERO { v[2] } else { v[3] }
        });
        from_compute(a.dtype(), values)
    })
}

/// Same-type strided copy: exact for every dtype (an i64 above 2^53 stays itself).
pub(crate) fn relayout<E: Elem>(src: &[E], from: &Layout, to: &Layout) -> Vec<E> {
    let plan = Plan::new([to, from]);
    let mut out = overwritten::<E>(to.storage_extent().max(plan.numel()));
    let inner = plan.inner();
    parallel::chunks_mut(&mut out, MIN_PER_PART, |start, chunk| {
        let mut at = 0;
        plan.runs(start..start + chunk.len(), |pos, len| {
            for (j, o) in chunk[at..at + len].iter_mut().enumerate() {
                *o = src[pos[1] + j * inner[1]];
            }
            at += len;
        });
    });
    out
}

/// `x` converted to `dtype`, written in the dense layout `out`.
pub(crate) fn convert(x: &Data, xl: &Layout, dtype: DType, out: &Layout) -> Data {
    if x.dtype() == dtype {
        return with_data!(x, v => Elem::wrap(relayout(v, xl, out)));
    }
    // Through f64 whenever either side needs it (f64, integers), so nothing is rounded twice —
    // except u8 into a float type: every u8 is exact in f32 (masks, pixels: the common case).
    let float = |d: DType| matches!(d, DType::F32 | DType::F16 | DType::BF16);
    let wide = !(float(dtype) && (float(x.dtype()) || x.dtype() == DType::U8));
    if wide {
        let src = as_compute::<f64>(x);
        from_compute(dtype, map([out, xl], [&[], &src], |v| v[1]))
    } else {
        let src = as_compute::<f32>(x);
        from_compute(dtype, map([out, xl], [&[], &src], |v| v[1]))
    }
}

/// The view's elements in row-major order as little-endian bytes.
pub(crate) fn download(x: &Data, xl: &Layout) -> Vec<u8> {
    let row_major = Layout::contiguous(xl.shape());
    let size = x.dtype().size();
    with_data!(x, v => {
        // A row-major view is a plain slice: no gather (a whole gradient, a loader batch).
        let relaid;
        let values = if xl.is_contiguous() {
            &v[xl.offset()..xl.offset() + xl.numel()]
        } else {
            relaid = relayout(v, xl, &row_major);
            &relaid[..]
        };
        let mut bytes = vec![0u8; values.len() * size];
        for (out, &e) in bytes.chunks_exact_mut(size).zip(values) {
            e.write_le(out);
        }
        bytes
    })
}

/// Writes `values` (row-major over `at`'s shape, already of the destination's dtype: see
/// [`convert`]) at the positions `at` of `dst`.
pub(crate) fn copy_into(dst: &mut Data, at: &Layout, values: &Data) -> Result<()> {
    if at.storage_extent() > dst.len() {
        return Err(TensorError::Shape(format!(
            "copy_into: region reaches element {} of a storage of {}",
            at.storage_extent(),
            dst.len()
        )));
    }
    let row_major = Layout::contiguous(at.shape());
    let plan = Plan::new([at, &row_major]);
    let inner = plan.inner();
    fn scatter<E: Elem>(dst: &mut [E], src: &[E], plan: &Plan<2>, inner: [usize; 2]) {
        plan.runs(0..plan.numel(), |pos, len| {
            for j in 0..len {
                dst[pos[0] + j * inner[0]] = src[pos[1] + j * inner[1]];
            }
        });
    }
    match (dst, values) {
        (Data::F64(d), Data::F64(s)) => scatter(d, s, &plan, inner),
        (Data::F32(d), Data::F32(s)) => scatter(d, s, &plan, inner),
        (Data::F16(d), Data::F16(s)) => scatter(d, s, &plan, inner),
        (Data::BF16(d), Data::BF16(s)) => scatter(d, s, &plan, inner),
        (Data::U8(d), Data::U8(s)) => scatter(d, s, &plan, inner),
        (Data::I32(d), Data::I32(s)) => scatter(d, s, &plan, inner),
        (Data::I64(d), Data::I64(s)) => scatter(d, s, &plan, inner),
        (d, s) => {
            return Err(TensorError::DType(format!(
                "copy_into: {} values for a {} storage",
                s.dtype(),
                d.dtype()
            )))
        }
    }
    Ok(())
}
