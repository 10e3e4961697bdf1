//! Reductions: sum and max over any axes, argmax along one.
//!
//! The input is walked in its memory order (sequential reads, whatever the axes: a per-channel
//! sum over channels-last reads every byte once) and each element is added into its output slot.
//! Parallel work is split into fixed chunks of the walk, each with its own partial outputs,
//! combined in chunk order — so the bits never depend on timing or on the thread count.

use redline_tensor::backend::ReduceOp;
use redline_tensor::Layout;

use crate::buffer::{as_compute, from_compute, with_compute, Data, Elem, Real};
use crate::parallel::{self, Disjoint};
use crate::strided::Plan;

/// Elements of the walk per chunk (a fixed constant: chunking never depends on the machine).
const CHUNK: usize = 1 << 15;
/// Partial outputs (chunks × outputs) above this make the walk run as one chunk.
const MAX_PARTIALS: usize = 1 << 22;

pub(crate) fn reduce(op: ReduceOp, x: &Data, xl: &Layout, axes: &[usize]) -> Data {
    let mut out_shape = xl.shape().to_vec();
    for &a in axes {
        out_shape[a] = 1;
    }
    if op == ReduceOp::ArgMax {
        return Data::I64(argmax(x, xl, axes[0]));
    }
    // The output's strides seen from the input's shape: 0 along reduced axes.
    let mut out_strides = redline_tensor::layout::contiguous_strides(&out_shape);
    for &a in axes {
        out_strides[a] = 0;
    }
    let to_out = Layout::new(xl.shape().to_vec(), out_strides, 0);
    let out_len: usize = out_shape.iter().product();
    with_compute!(x.dtype(), C => {
        let src = as_compute::<C>(x);
        let values: Vec<C> = match op {
            // Sums accumulate in f64 whatever the storage type.
            ReduceOp::Sum => {
                let add = |acc: &mut f64, v: f64| *acc += v;
                walk(&src, xl, &to_out, out_len, 0.0f64, |acc, v: C| add(acc, v.to_f64()), add)
                    .into_iter()
                    .map(C::c)
                    .collect()
            }
            _ => walk(&src, xl, &to_out, out_len, C::NEG_INFINITY, max_into, max_into),
        };
        from_compute(x.dtype(), values)
    })
}

/// Folds every element of `src` (through `xl`) into `out[slot]` (slot through `to_out`).
fn walk<C: Real, A: Copy + Send + Sync>(
    src: &[C],
    xl: &Layout,
    to_out: &Layout,
    out_len: usize,
    init: A,
    fold: impl Fn(&mut A, C) + Sync,
    combine: impl Fn(&mut A, A),
) -> Vec<A> {
    let plan = Plan::new([xl, to_out]);
    let n = plan.numel();
    let inner = plan.inner();
    let chunks = if n.div_ceil(CHUNK) * out_len > MAX_PARTIALS {
        1
    } else {
        n.div_ceil(CHUNK).max(1)
    };
    let run_chunk = |c: usize, acc: &mut [A]| {
        let range = parallel::part_range(n, chunks, c);
        plan.runs(range, |pos, len| {
            for j in 0..len {
                fold(&mut acc[pos[1] + j * inner[1]], src[pos[0] + j * inner[0]]);
            }
        });
    };
    if chunks == 1 {
        let mut acc = vec![init; out_len];
        run_chunk(0, &mut acc);
        return acc;
    }
    let mut partials = vec![init; chunks * out_len];
    let slots = Disjoint::new(&mut partials);
    parallel::for_parts(chunks, parallel::parts_for(chunks, 1), |_, range| {
        for c in range {
            // SAFETY: chunk c owns partials[c * out_len..(c + 1) * out_len].
            run_chunk(c, unsafe { slots.slice(c * out_len..(c + 1) * out_len) });
        }
    });
    let mut acc = vec![init; out_len];
    for part in partials.chunks(out_len) {
        for (a, &p) in acc.iter_mut().zip(part) {
            combine(a, p);
        }
    }
    acc
}

/// `acc = max(acc, v)`, NaN winning (the reference's rule).
fn max_into<C: Real>(acc: &mut C, v: C) {
    if !acc.is_nan() && (v.is_nan() || v > *acc) {
        *acc = v;
    }
}

/// Position of the first maximum (NaN counts as the maximum) along `axis`.
fn argmax(x: &Data, xl: &Layout, axis: usize) -> Vec<i64> {
    let (shape, strides) = (xl.shape(), xl.strides());
    let len = shape[axis];
    let step = strides[axis];
    let rest_shape: Vec<usize> = (0..shape.len())
        .filter(|&d| d != axis)
        .map(|d| shape[d])
        .collect();
    let rest_strides: Vec<usize> = (0..shape.len())
        .filter(|&d| d != axis)
        .map(|d| strides[d])
        .collect();
    let rest = Layout::new(rest_shape, rest_strides, xl.offset());
    let src = as_compute::<f64>(x);
    let mut out = vec![0i64; rest.numel()];
    parallel::chunks_mut(&mut out, 1 << 12, |start, chunk| {
        for (i, o) in chunk.iter_mut().enumerate() {
            let base = rest.index_of(start + i);
            let (mut best, mut at) = (f64::NEG_INFINITY, 0);
            for k in 0..len {
                let v = src[base + k * step];
                if v > best || (v.is_nan() && !best.is_nan()) {
                    (best, at) = (v, k);
                }
            }
            *o = at as i64;
        }
    });
    out
}
