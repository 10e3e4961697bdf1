//! Batch norm's two fused passes: per-channel sums, and the per-channel affine map.
//!
//! Both walk the data in its memory order with a third "operand" that maps every element to its
//! channel (strides 0 except 1 on axis 1): on channels-last data a run is C consecutive
//! channels, so the sums accumulate into a contiguous `[2, C]` and the map is vectorised.

use redline_tensor::{stats_dtype, Layout};

use crate::buffer::{as_compute, from_compute, with_compute, Data, Elem};
use crate::ops::elementwise::map;
use crate::parallel::{self, Disjoint};
use crate::strided::Plan;

/// Elements of the walk per chunk (fixed: the sums' bits never depend on the thread count).
const CHUNK: usize = 1 << 15;

/// A layout of `shape` whose position is the channel (axis 1), plus `offset`.
fn channel_of(shape: &[usize], offset: usize) -> Layout {
    let mut strides = vec![0; shape.len()];
    strides[1] = 1;
    Layout::new(shape.to_vec(), strides, offset)
}

/// `[Σx, Σx²]` or `[Σy, Σx·y]` per channel, in f64, as the stats dtype.
pub(crate) fn stats(x: &Data, xl: &Layout, y: Option<(&Data, &Layout)>) -> Data {
    let shape = xl.shape();
    let c = shape[1];
    let chan = channel_of(shape, 0);
    let yl = y.map_or(xl, |(_, l)| l);
    let sums = with_compute!(x.dtype(), C => {
        let xs = as_compute::<C>(x);
        let ys = y.map(|(d, _)| as_compute::<C>(d));
        let other: &[C] = ys.as_deref().unwrap_or(&xs);
        let plan = Plan::new([xl, yl, &chan]);
        let n = plan.numel();
        let inner = plan.inner();
        let chunks = n.div_ceil(CHUNK).max(1);
        let mut partials = vec![0.0f64; chunks * 2 * c];
        let slots = Disjoint::new(&mut partials);
        parallel::for_parts(chunks, parallel::parts_for(chunks, 1), |_, range| {
            for chunk in range {
                // SAFETY: each chunk owns its partial sums.
                let acc = unsafe { slots.slice(chunk * 2 * c..(chunk + 1) * 2 * c) };
                let (first, second) = acc.split_at_mut(c);
                plan.runs(parallel::part_range(n, chunks, chunk), |pos, len| {
                    for j in 0..len {
                        let v = xs[pos[0] + j * inner[0]].to_f64();
                        let o = other[pos[1] + j * inner[1]].to_f64();
                        let k = pos[2] + j * inner[2];
                        first[k] += o;
                        second[k] += v * o;
                    }
                });
            }
        });
        // Chunks combined in order.
        let mut sums = vec![0.0f64; 2 * c];
        for part in partials.chunks(2 * c) {
            for (s, &p) in sums.iter_mut().zip(part) {
                *s += p;
            }
        }
        sums
    });
    from_compute(stats_dtype(x.dtype()), sums)
}

/// `a[c]·x + b[c] (+ d[c]·y)` in the dense layout `out`, with `coef = [a; b; d]`.
pub(crate) fn apply(
    x: &Data,
    xl: &Layout,
    y: Option<(&Data, &Layout)>,
    coef: &Data,
    coef_offset: usize,
    out: &Layout,
) -> Data {
    let shape = xl.shape();
    let c = shape[1];
    let rows: Vec<Layout> = (0..3)
        .map(|r| channel_of(shape, coef_offset + r * c))
        .collect();
    with_compute!(x.dtype(), C => {
        let (xs, k) = (as_compute::<C>(x), as_compute::<C>(coef));
        let values = match y {
            None => map([out, xl, &rows[0], &rows[1]], [&[], &xs, &k, &k], |v| v[1] * v[2] + v[3]),
            Some((yd, yl)) => {
                let ys = as_compute::<C>(yd);
                map(
                    [out, xl, &rows[0], &rows[1], yl, &rows[2]],
                    [&[], &xs, &k, &k, &ys, &k],
                    |v| v[1] * v[2] + v[3] + v[4] * v[5],
                )
            }
        };
        from_compute(x.dtype(), values)
    })
}
