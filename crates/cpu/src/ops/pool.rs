//! Max and average pooling, and average pooling's gradient: one plane (image, channel) per task,
//! read through the input's strides (NCHW or channels-last alike).

use redline_tensor::backend::Pool2dParams;
use redline_tensor::Layout;

use crate::buffer::{as_compute, from_compute, overwritten, with_compute, zeros, Data, Real};
use crate::ops::elementwise::{dense, relayout};
use crate::parallel::{self, Disjoint};

/// One plane's geometry: input `h × w` at `strides` (row, column), output `ho × wo`.
struct Plane {
    h: usize,
    w: usize,
    ho: usize,
    wo: usize,
    p: Pool2dParams,
}

impl Plane {
    /// The planes of an `[N, C, H, W]` input pooled to `[N, C, HO, WO]`.
    fn new(input: &[usize], output: &[usize], p: &Pool2dParams) -> Self {
        Self {
            h: input[2],
            w: input[3],
            ho: output[2],
            wo: output[3],
            p: *p,
        }
    }

    /// Calls `f(output index, iy, ix)` for every window position inside the input.
    #[inline]
    fn window(&self, oy: usize, ox: usize, mut f: impl FnMut(usize, usize)) {
        for ky in 0..self.p.kernel[0] {
            let Some(iy) = (oy * self.p.stride[0] + ky).checked_sub(self.p.padding[0]) else {
                continue;
            };
            if iy >= self.h {
                continue;
            }
            for kx in 0..self.p.kernel[1] {
                let Some(ix) = (ox * self.p.stride[1] + kx).checked_sub(self.p.padding[1]) else {
                    continue;
                };
                if ix < self.w {
                    f(iy, ix);
                }
            }
        }
    }

    fn area<C: Real>(&self) -> C {
        C::c((self.p.kernel[0] * self.p.kernel[1]) as f64)
    }
}

/// Runs `f(plane index, input plane offset)` for every (image, channel) plane, in parallel.
fn planes(xl: &Layout, f: impl Fn(usize, usize) + Sync) {
    let (n, c) = (xl.shape()[0], xl.shape()[1]);
    let (sn, sc) = (xl.strides()[0], xl.strides()[1]);
    let count = n * c;
    let per_plane = xl.shape()[2] * xl.shape()[3];
    parallel::for_parts(
        count,
        parallel::parts_for(count * per_plane, 1 << 14),
        |_, range| {
            for plane in range {
                f(plane, xl.offset() + (plane / c) * sn + (plane % c) * sc);
            }
        },
    );
}

/// Whether `l` is the dense channels-last layout of its shape.
pub(crate) fn is_channels_last(l: &Layout) -> bool {
    Layout::channels_last(l.shape()).is_ok_and(|cl| cl.strides() == l.strides() && l.offset() == 0)
}

/// Max pooling into layout `out`, with each output's first-maximum position (flat in its input
/// plane) laid out as `out` too.
pub(crate) fn max_pool2d(x: &Data, xl: &Layout, p: &Pool2dParams, out: &Layout) -> (Data, Data) {
    let small_planes = xl.shape()[2].saturating_mul(xl.shape()[3]) <= u32::MAX as usize;
    if is_channels_last(xl) && is_channels_last(out) && small_planes {
        return max_pool2d_channels_last(x, xl, p, out);
    }
    let s = xl.shape();
    let plane = Plane::new(s, out.shape(), p);
    let (sy, sx) = (xl.strides()[2], xl.strides()[3]);
    let per_out = plane.ho * plane.wo;
    with_compute!(x.dtype(), C => {
        let src = as_compute::<C>(x);
        let mut values = overwritten::<C>(s[0] * s[1] * per_out);
        let mut at = vec![0i64; values.len()];
        let (vo, ao) = (Disjoint::new(&mut values), Disjoint::new(&mut at));
        planes(xl, |i, base| {
            // SAFETY: each plane writes its own output plane.
            let (vs, ats) = unsafe { (vo.slice(i * per_out..(i + 1) * per_out), ao.slice(i * per_out..(i + 1) * per_out)) };
            for oy in 0..plane.ho {
                for ox in 0..plane.wo {
                    // (No position until the window's first element: an all -inf window
                    // points there, as PyTorch's.)
                    let (mut best, mut pos) = (C::NEG_INFINITY, usize::MAX);
                    plane.window(oy, ox, |iy, ix| {
                        let v = src[base + iy * sy + ix * sx];
                        if v > best || (v.is_nan() && !best.is_nan()) || pos == usize::MAX {
                            (best, pos) = (v, iy * plane.w + ix);
                        }
                    });
                    vs[oy * plane.wo + ox] = best;
                    ats[oy * plane.wo + ox] = pos as i64;
                }
            }
        });
        let values = dense(&values, &Layout::contiguous(out.shape()), out).into_owned();
        let at = relayout(&at, &Layout::contiguous(out.shape()), out);
        (from_compute(x.dtype(), values), Data::I64(at))
    })
}

/// Max pooling of a channels-last input into a channels-last output: per output pixel, every
/// window position is one contiguous run of C channels (a plane-by-plane walk would read each
/// cache line once per channel). Same values, same positions (and NaN rule) as the plane walk;
/// positions channels-last as the values.
fn max_pool2d_channels_last(x: &Data, xl: &Layout, p: &Pool2dParams, out: &Layout) -> (Data, Data) {
    let s = xl.shape();
    let (n, c) = (s[0], s[1]);
    let plane = Plane::new(s, out.shape(), p);
    let (ho, wo) = (plane.ho, plane.wo);
    with_compute!(x.dtype(), C => {
        let src = as_compute::<C>(x);
        let mut values = overwritten::<C>(n * ho * wo * c);
        if values.is_empty() {
            return (from_compute(x.dtype(), values), Data::I64(Vec::new()));
        }
        let mut at = overwritten::<i64>(n * c * ho * wo);
        let (vo, ao) = (Disjoint::new(&mut values), Disjoint::new(&mut at));
        let rows = n * ho;
        parallel::for_parts(rows, parallel::parts_for(rows * wo * c, 1 << 14), |_, range| {
            let mut best = vec![C::NEG_INFINITY; c];
            // u32 while searching (the vectorised select), i64 when stored.
            let mut pos = vec![0u32; c];
            for row in range {
                let (b, oy) = (row / ho, row % ho);
                // SAFETY: each output row (image b, row oy) is written by one part.
                let (vs, ats) = unsafe {
                    let run = row * wo * c..(row + 1) * wo * c;
                    (vo.slice(run.clone()), ao.slice(run))
                };
                for ox in 0..wo {
                    best.fill(C::NEG_INFINITY);
                    let mut first = true;
                    plane.window(oy, ox, |iy, ix| {
                        let px = &src[((b * plane.h + iy) * plane.w + ix) * c..][..c];
                        // (< 2³² per plane: checked by the caller.)
                        let here = (iy * plane.w + ix) as u32;
                        // An all -inf window points at its first element.
                        if first {
                            pos.fill(here);
                            first = false;
                        }
                        // Branch-free (vectorised): the first maximum, NaN beating numbers.
                        for ((v, bst), p) in px.iter().zip(best.iter_mut()).zip(pos.iter_mut()) {
                            // (`|`, `&`: no short circuit, so the loop stays branch-free.)
                            let take = (*v > *bst) | (v.is_nan() & !bst.is_nan());
                            *bst = if take { *v } else { *bst };
                            *p = if take { here } else { *p };
                        }
                    });
                    vs[ox * c..(ox + 1) * c].copy_from_slice(&best);
                    for (d, p) in ats[ox * c..(ox + 1) * c].iter_mut().zip(&pos) {
                        *d = i64::from(*p);
                    }
                }
            }
        });
        (from_compute(x.dtype(), values), Data::I64(at))
    })
}

pub(crate) fn avg_pool2d(x: &Data, xl: &Layout, p: &Pool2dParams, out: &Layout) -> Data {
    let s = xl.shape();
    let plane = Plane::new(s, out.shape(), p);
    let (sy, sx) = (xl.strides()[2], xl.strides()[3]);
    let per_out = plane.ho * plane.wo;
    with_compute!(x.dtype(), C => {
        let src = as_compute::<C>(x);
        let mut values = overwritten::<C>(s[0] * s[1] * per_out);
        let vo = Disjoint::new(&mut values);
        let area: C = plane.area();
        planes(xl, |i, base| {
            // SAFETY: each plane writes its own output plane.
            let vs = unsafe { vo.slice(i * per_out..(i + 1) * per_out) };
            for oy in 0..plane.ho {
                for ox in 0..plane.wo {
                    let mut sum = C::ZERO;
                    plane.window(oy, ox, |iy, ix| sum += src[base + iy * sy + ix * sx]);
                    vs[oy * plane.wo + ox] = sum / area;
                }
            }
        });
        let values = dense(&values, &Layout::contiguous(out.shape()), out).into_owned();
        from_compute(x.dtype(), values)
    })
}

/// The gradient of average pooling: each output's gradient spread evenly over its window.
pub(crate) fn avg_pool2d_grad(g: &Data, gl: &Layout, p: &Pool2dParams, out: &Layout) -> Data {
    let plane = Plane::new(out.shape(), gl.shape(), p);
    with_compute!(g.dtype(), C => {
        let area: C = plane.area();
        let values = route(&as_compute::<C>(g), gl, &plane, |gx, _, oy, ox, v| {
            let share = v / area;
            plane.window(oy, ox, |iy, ix| gx[iy * plane.w + ix] += share);
        });
        let values = dense(&values, &Layout::contiguous(out.shape()), out).into_owned();
        from_compute(g.dtype(), values)
    })
}

/// The gradient of max pooling: each output's gradient added at its maximum, `at` (flat
/// in-plane positions, checked by the caller, laid out densely as `at_layout`: the gradient's
/// order as [`max_pool2d`] wrote them, or row-major), in output order.
pub(crate) fn max_pool2d_grad<P: Position>(
    g: &Data,
    gl: &Layout,
    at: &[P],
    at_layout: &Layout,
    p: &Pool2dParams,
    out: &Layout,
) -> Data {
    if is_channels_last(gl) && is_channels_last(out) && is_channels_last(at_layout) {
        return max_pool2d_grad_channels_last(g, gl, at, p, out);
    }
    let plane = Plane::new(out.shape(), gl.shape(), p);
    let c = gl.shape()[1];
    let s = at_layout.strides();
    with_compute!(g.dtype(), C => {
        let values = route(&as_compute::<C>(g), gl, &plane, |gx, i, oy, ox, v| {
            let o = (i / c) * s[0] + (i % c) * s[1] + oy * s[2] + ox * s[3];
            gx[at[o].index()] += v;
        });
        let values = dense(&values, &Layout::contiguous(out.shape()), out).into_owned();
        from_compute(g.dtype(), values)
    })
}

/// [`max_pool2d_grad`] from a channels-last gradient and positions into a channels-last input
/// gradient, without the plane walk's strided reads and the relayout after it. One task per image (windows
/// overlap across output rows); within it each channel's gradients are added in the plane walk's
/// order (output rows, then columns), so the sums are bit for bit the same.
fn max_pool2d_grad_channels_last<P: Position>(
    g: &Data,
    gl: &Layout,
    at: &[P],
    p: &Pool2dParams,
    out: &Layout,
) -> Data {
    let plane = Plane::new(out.shape(), gl.shape(), p);
    let (n, c) = (out.shape()[0], out.shape()[1]);
    let (ho, wo, per_in) = (plane.ho, plane.wo, plane.h * plane.w);
    with_compute!(g.dtype(), C => {
        let src = as_compute::<C>(g);
        let mut values = zeros::<C>(n * per_in * c);
        let vo = Disjoint::new(&mut values);
        parallel::for_parts(n, parallel::parts_for(n * per_in * c, 1 << 14), |_, images| {
            for b in images {
                // SAFETY: each image's input gradient is written by one part.
                let gx = unsafe { vo.slice(b * per_in * c..(b + 1) * per_in * c) };
                for oy in 0..ho {
                    let row = (b * ho + oy) * wo * c..(b * ho + oy + 1) * wo * c;
                    let (g_row, at_row) = (&src[row.clone()], &at[row]);
                    // Each channel still takes its adds in (row, column) order.
                    for ox in 0..wo {
                        let (gs, ats) = (&g_row[ox * c..][..c], &at_row[ox * c..][..c]);
                        for (ch, (&v, &at)) in gs.iter().zip(ats).enumerate() {
                            gx[at.index() * c + ch] += v;
                        }
                    }
                }
            }
        });
        from_compute(g.dtype(), values)
    })
}

/// Both gradients' shared loop: one task per plane, each output gradient `v` (read through
/// `gl`'s strides) handed to `add(plane's input gradient, plane index, oy, ox, v)`.
fn route<C: Real>(
    src: &[C],
    gl: &Layout,
    plane: &Plane,
    add: impl Fn(&mut [C], usize, usize, usize, C) + Sync,
) -> Vec<C> {
    let (sy, sx) = (gl.strides()[2], gl.strides()[3]);
    let per_in = plane.h * plane.w;
    let mut values = zeros::<C>(gl.shape()[0] * gl.shape()[1] * per_in);
    let vo = Disjoint::new(&mut values);
    planes(gl, |i, base| {
        // SAFETY: each plane writes its own input-gradient plane.
        let gx = unsafe { vo.slice(i * per_in..(i + 1) * per_in) };
        for oy in 0..plane.ho {
            for ox in 0..plane.wo {
                add(gx, i, oy, ox, src[base + oy * sy + ox * sx]);
            }
        }
    });
    values
}

/// A max pool's recorded position, as its storage holds it (i64, checked to be in range) or
/// converted.
pub(crate) trait Position: Copy + Send + Sync {
    fn index(self) -> usize;
}

impl Position for usize {
    #[inline(always)]
    fn index(self) -> usize {
        self
    }
}

impl Position for i64 {
    /// Only for positions checked to lie in `0..len` ([`super::nn::dense_in_range`]).
    #[inline(always)]
    fn index(self) -> usize {
        self as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::elementwise::relayout;

    /// The channels-last forward equals the plane walk: values bit for bit and positions
    /// (both laid out as the output), with ties (first maximum wins) and NaNs (a NaN beats any
    /// number).
    #[test]
    fn channels_last_max_pool_matches_the_plane_walk() {
        let (n, c, h, w) = (2, 11, 9, 7);
        let p = Pool2dParams {
            kernel: [3, 3],
            stride: [2, 2],
            padding: [1, 1],
        };
        let (xs, ys) = ([n, c, h, w], [n, c, 5, 4]);
        let mut x: Vec<f32> = (0..n * c * h * w).map(|i| ((i * 37) % 5) as f32).collect();
        x[17] = f32::NAN;
        x[300] = f32::NAN;
        let nchw = |s: &[usize]| Layout::contiguous(s);
        let cl = |s: &[usize]| Layout::channels_last(s).expect("rank 4");
        let (plain, plain_at) = max_pool2d(&Data::F32(x.clone()), &nchw(&xs), &p, &nchw(&ys));
        let x_cl = relayout(&x, &nchw(&xs), &cl(&xs));
        let (fast, fast_at) = max_pool2d(&Data::F32(x_cl), &cl(&xs), &p, &cl(&ys));
        let (Data::F32(plain), Data::F32(fast)) = (plain, fast) else {
            panic!("f32 out")
        };
        let fast = relayout(&fast, &cl(&ys), &nchw(&ys));
        let bits = |v: &[f32]| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&plain), bits(&fast));
        assert!(plain.iter().any(|v| v.is_nan()), "a NaN wins its windows");
        let (Data::I64(plain_at), Data::I64(fast_at)) = (plain_at, fast_at) else {
            panic!("i64 positions")
        };
        assert_eq!(plain_at, relayout(&fast_at, &cl(&ys), &nchw(&ys)));
        // The plane walk into a channels-last output lays its positions out channels-last too.
        let (_, mixed_at) = max_pool2d(&Data::F32(x.clone()), &nchw(&xs), &p, &cl(&ys));
        let Data::I64(mixed_at) = mixed_at else {
            panic!("i64 positions")
        };
        assert_eq!(mixed_at, fast_at);
        // No channels: an empty result, not a panic.
        let (xs, ys) = ([2, 0, 9, 7], [2, 0, 5, 4]);
        let (v, at) = max_pool2d(&Data::F32(Vec::new()), &cl(&xs), &p, &cl(&ys));
        assert!(matches!((v, at), (Data::F32(v), Data::I64(at)) if v.is_empty() && at.is_empty()));
    }

    /// The channels-last max-pool gradient equals the plane walk's bit for bit, with
    /// overlapping windows (3×3, stride 2, padding 1) so that positions collect several adds;
    /// positions in either order are read through their layout on the plane walk.
    #[test]
    fn channels_last_max_pool_grad_matches_the_plane_walk() {
        let (n, c, h, w) = (3, 5, 9, 7);
        let p = Pool2dParams {
            kernel: [3, 3],
            stride: [2, 2],
            padding: [1, 1],
        };
        let (ho, wo) = (5, 4);
        let x: Vec<f32> = (0..n * c * h * w).map(|i| ((i * 37) % 11) as f32).collect();
        let gv: Vec<f32> = (0..n * c * ho * wo)
            .map(|i| ((i * 13) % 7) as f32 * 0.1 + 0.01)
            .collect();
        let (xs, gs) = ([n, c, h, w], [n, c, ho, wo]);
        let nchw = |s: &[usize]| Layout::contiguous(s);
        let cl = |s: &[usize]| Layout::channels_last(s).expect("rank 4");
        // Positions from the NCHW forward (row-major, as its output), and channels-last.
        let (_, at) = max_pool2d(&Data::F32(x.clone()), &nchw(&xs), &p, &nchw(&gs));
        let Data::I64(at) = at else {
            panic!("positions are i64")
        };
        let at_cl = relayout(&at, &nchw(&gs), &cl(&gs));
        let g_cl = relayout(&gv, &nchw(&gs), &cl(&gs));
        let bits = |d: Data, l: &Layout| {
            let Data::F32(v) = d else { panic!("f32 out") };
            let v = relayout(&v, l, &nchw(&xs));
            v.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        };
        let plain = max_pool2d_grad(
            &Data::F32(gv.clone()),
            &nchw(&gs),
            &at,
            &nchw(&gs),
            &p,
            &nchw(&xs),
        );
        let Data::F32(plain) = plain else {
            panic!("f32 out")
        };
        let want = bits(Data::F32(plain.clone()), &nchw(&xs));
        assert!(
            plain.iter().any(|&v| v > 0.2),
            "some positions collect several adds"
        );
        let fast = max_pool2d_grad(
            &Data::F32(g_cl.clone()),
            &cl(&gs),
            &at_cl,
            &cl(&gs),
            &p,
            &cl(&xs),
        );
        assert_eq!(bits(fast, &cl(&xs)), want, "channels-last throughout");
        let mixed = max_pool2d_grad(&Data::F32(g_cl), &cl(&gs), &at, &nchw(&gs), &p, &cl(&xs));
        assert_eq!(
            bits(mixed, &cl(&xs)),
            want,
            "row-major positions, channels-last gradient"
        );
        let mixed = max_pool2d_grad(&Data::F32(gv), &nchw(&gs), &at_cl, &cl(&gs), &p, &nchw(&xs));
        assert_eq!(
            bits(mixed, &nchw(&xs)),
            want,
            "channels-last positions, NCHW gradient"
        );
    }
}
