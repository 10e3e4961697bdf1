//! A convolution as cuDNN's descriptors: the plan `cudnn.rs` runs.
//!
//! cuDNN's classic API names three tensors whatever the direction: `x` (the input), `w` (the
//! filter) and `y` (the output); the forward pass writes `y`, the data gradient writes `x` from
//! `y`'s gradient, the filter gradient writes `w`. Tensors are described by their logical NCHW
//! dims and element strides, so NCHW, NHWC and any other non-overlapping order pass as they are;
//! a filter must be packed NCHW (KCRS) or NHWC (KRSC), cuDNN's two filter formats. Anything cuDNN
//! cannot describe (broadcast strides, a filter in another order, dims past `i32`) has no plan
//! and runs on our own kernels.
//!
//! Pure data, so the mapping is tested on the host: `tests` below computes each direction from
//! a plan the way cuDNN reads memory and compares it with a direct convolution.

use redline_tensor::{Conv2dParams, DType, Layout};

/// Which of cuDNN's three calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Direction {
    /// `y = conv(x, w)`.
    Forward,
    /// `dx` from `dy` and `w` (cudnnConvolutionBackwardData).
    InputGrad,
    /// `dw` from `x` and `dy` (cudnnConvolutionBackwardFilter).
    WeightGrad,
}

/// A tensor descriptor: logical NCHW dims and element strides.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TensorDesc {
    pub dims: [i32; 4],
    pub strides: [i32; 4],
}

/// cuDNN's filter formats: how a packed `[K, C, R, S]` filter sits in memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FilterFormat {
    /// K, C, R, S (row-major OIHW: contiguous weights).
    Nchw,
    /// K, R, S, C (channels-last weights).
    Nhwc,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FilterDesc {
    pub dims: [i32; 4],
    pub format: FilterFormat,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ConvPlan {
    pub dtype: DType,
    pub direction: Direction,
    pub x: TensorDesc,
    pub w: FilterDesc,
    pub y: TensorDesc,
    pub padding: [i32; 2],
    pub stride: [i32; 2],
    pub dilation: [i32; 2],
    pub groups: i32,
    /// Every operand starts on a 16-byte boundary (whole allocations do; a view may not). A
    /// plan of its own either way: cuDNN may reject an algorithm for an unaligned operand, and
    /// that must not refuse the plan for aligned ones (its Find measures on aligned buffers).
    pub aligned: bool,
}

fn int(v: usize) -> Option<i32> {
    i32::try_from(v).ok()
}

/// `layout` (4-d) as a tensor descriptor: strides of size-1 axes are free, so they get the
/// value a packed tensor in the same order would have; overlapping layouts have none.
fn tensor(layout: &Layout) -> Option<TensorDesc> {
    let (shape, strides) = (layout.shape(), layout.strides());
    if shape.len() != 4 || layout.numel() == 0 {
        return None;
    }
    // Axes from the fastest-moving; size-1 axes last, where they change nothing.
    let mut order: Vec<usize> = (0..4).collect();
    order.sort_by_key(|&d| (shape[d] == 1, strides[d], std::cmp::Reverse(d)));
    let mut fixed = [0usize; 4];
    let mut span = 1usize;
    for &d in &order {
        let stride = if shape[d] == 1 { span } else { strides[d] };
        // Non-overlapping: each axis steps over everything the faster ones cover.
        if stride < span {
            return None;
        }
        fixed[d] = stride;
        span = stride * shape[d];
    }
    let mut desc = TensorDesc {
        dims: [0; 4],
        strides: [0; 4],
    };
    for d in 0..4 {
        desc.dims[d] = int(shape[d])?;
        desc.strides[d] = int(fixed[d])?;
    }
    int(span)?;
    Some(desc)
}

/// A `[K, C, R, S]` weight layout as a filter, if it is packed in one of cuDNN's formats.
fn filter(layout: &Layout) -> Option<FilterDesc> {
    let (shape, strides) = (layout.shape(), layout.strides());
    if shape.len() != 4 {
        return None;
    }
    let [k, c, r, s] = [shape[0], shape[1], shape[2], shape[3]];
    let matches = |want: [usize; 4]| (0..4).all(|d| shape[d] == 1 || strides[d] == want[d]);
    let format = if matches([c * r * s, r * s, s, 1]) {
        FilterFormat::Nchw
    } else if matches([r * s * c, 1, s * c, c]) {
        FilterFormat::Nhwc
    } else {
        return None;
    };
    int(k * c * r * s)?;
    Some(FilterDesc {
        dims: [int(k)?, int(c)?, int(r)?, int(s)?],
        format,
    })
}

impl ConvPlan {
    /// The plan for `direction` with cuDNN's `x` (input or its gradient), `w` (weight or its
    /// gradient) and `y` (output or its gradient) layouts, or `None` where cuDNN cannot take them.
    pub fn new(
        dtype: DType,
        direction: Direction,
        x: &Layout,
        w: &Layout,
        y: &Layout,
        p: &Conv2dParams,
    ) -> Option<ConvPlan> {
        if !matches!(dtype, DType::F32 | DType::F16 | DType::BF16) {
            return None;
        }
        let pair = |v: [usize; 2]| Some([int(v[0])?, int(v[1])?]);
        Some(ConvPlan {
            dtype,
            direction,
            x: tensor(x)?,
            w: filter(w)?,
            y: tensor(y)?,
            padding: pair(p.padding)?,
            stride: pair(p.stride)?,
            dilation: pair(p.dilation)?,
            groups: int(p.groups)?,
            aligned: true,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(t: &TensorDesc, [n, c, h, w]: [i32; 4]) -> usize {
        let s = t.strides;
        (n * s[0] + c * s[1] + h * s[2] + w * s[3]) as usize
    }

    fn filter_at(f: &FilterDesc, [k, c, r, s]: [i32; 4]) -> usize {
        let [_, cc, rr, ss] = f.dims;
        (match f.format {
            FilterFormat::Nchw => ((k * cc + c) * rr + r) * ss + s,
            FilterFormat::Nhwc => ((k * rr + r) * ss + s) * cc + c,
        }) as usize
    }

    /// Every (output position, filter tap, input position) the cross-correlation pairs, as
    /// cuDNN's descriptors define it: `f(y index, w index, x index)`.
    fn each_tap(p: &ConvPlan, mut f: impl FnMut(usize, usize, usize)) {
        let [n, _, h, w] = p.x.dims;
        let [k, cg, r, s] = p.w.dims;
        let [_, _, ho, wo] = p.y.dims;
        let kg = k / p.groups;
        for b in 0..n {
            for o in 0..k {
                let g = o / kg;
                for oy in 0..ho {
                    for ox in 0..wo {
                        for ci in 0..cg {
                            for ky in 0..r {
                                for kx in 0..s {
                                    let iy = oy * p.stride[0] - p.padding[0] + ky * p.dilation[0];
                                    let ix = ox * p.stride[1] - p.padding[1] + kx * p.dilation[1];
                                    if iy < 0 || iy >= h || ix < 0 || ix >= w {
                                        continue;
                                    }
                                    f(
                                        at(&p.y, [b, o, oy, ox]),
                                        filter_at(&p.w, [o, ci, ky, kx]),
                                        at(&p.x, [b, g * cg + ci, iy, ix]),
                                    );
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    /// The same sums through the logical layouts alone (no plan): `(y, dx, dw)` row-major.
    fn reference(
        x: (&Layout, &[f64]),
        w: (&Layout, &[f64]),
        y: (&Layout, &[f64]),
        p: &Conv2dParams,
    ) -> [Vec<f64>; 3] {
        let read = |l: &Layout, i: [usize; 4]| -> usize {
            l.offset() + i.iter().zip(l.strides()).map(|(a, b)| a * b).sum::<usize>()
        };
        let flat = |shape: &[usize], i: [usize; 4]| {
            ((i[0] * shape[1] + i[1]) * shape[2] + i[2]) * shape[3] + i[3]
        };
        let (xs, ws, ys) = (x.0.shape(), w.0.shape(), y.0.shape());
        let mut out = [
            vec![0.0; y.0.numel()],
            vec![0.0; x.0.numel()],
            vec![0.0; w.0.numel()],
        ];
        let kg = ws[0] / p.groups;
        for b in 0..xs[0] {
            for o in 0..ws[0] {
                for oy in 0..ys[2] {
                    for ox in 0..ys[3] {
                        for ci in 0..ws[1] {
                            for ky in 0..ws[2] {
                                for kx in 0..ws[3] {
                                    let iy = (oy * p.stride[0] + ky * p.dilation[0]) as isize
                                        - p.padding[0] as isize;
                                    let ix = (ox * p.stride[1] + kx * p.dilation[1]) as isize
                                        - p.padding[1] as isize;
                                    if iy < 0
                                        || ix < 0
                                        || iy as usize >= xs[2]
                                        || ix as usize >= xs[3]
                                    {
                                        continue;
                                    }
                                    let xi = [b, o / kg * ws[1] + ci, iy as usize, ix as usize];
                                    let (yi, wi) = ([b, o, oy, ox], [o, ci, ky, kx]);
                                    let (xv, wv, yv) = (
                                        x.1[read(x.0, xi)],
                                        w.1[read(w.0, wi)],
                                        y.1[read(y.0, yi)],
                                    );
                                    out[0][flat(ys, yi)] += xv * wv;
                                    out[1][flat(xs, xi)] += yv * wv;
                                    out[2][flat(ws, wi)] += xv * yv;
                                }
                            }
                        }
                    }
                }
            }
        }
        out
    }

    fn values(l: &Layout, salt: f64) -> Vec<f64> {
        (0..l.storage_extent().max(1))
            .map(|i| (i as f64 * 0.61 + salt).cos())
            .collect()
    }

    /// Runs each direction from its plan, reading and writing memory as cuDNN would, and
    /// compares the written elements (read back through the written tensor's layout).
    fn check(x: Layout, w: Layout, y: Layout, p: Conv2dParams) {
        let (xd, wd, yd) = (values(&x, 0.3), values(&w, 1.1), values(&y, 2.0));
        let want = reference((&x, &xd), (&w, &wd), (&y, &yd), &p);
        let logical =
            |l: &Layout, mem: &[f64]| -> Vec<f64> { l.indices().map(|i| mem[i]).collect() };
        for (slot, direction) in [
            Direction::Forward,
            Direction::InputGrad,
            Direction::WeightGrad,
        ]
        .into_iter()
        .enumerate()
        {
            let plan = ConvPlan::new(DType::F32, direction, &x, &w, &y, &p)
                .unwrap_or_else(|| panic!("no plan for {x:?} {w:?} {y:?}"));
            let (xo, wo, yo) = (x.offset(), w.offset(), y.offset());
            let mut written = vec![0.0; [&y, &x, &w][slot].storage_extent().max(1)];
            each_tap(&plan, |yi, wi, xi| match direction {
                Direction::Forward => written[yo + yi] += xd[xo + xi] * wd[wo + wi],
                Direction::InputGrad => written[xo + xi] += yd[yo + yi] * wd[wo + wi],
                Direction::WeightGrad => written[wo + wi] += xd[xo + xi] * yd[yo + yi],
            });
            let got = logical([&y, &x, &w][slot], &written);
            for (g, e) in got.iter().zip(&want[slot]) {
                assert!(
                    (g - e).abs() < 1e-9,
                    "{direction:?}: {got:?} vs {:?}",
                    want[slot]
                );
            }
        }
    }

    fn params(stride: usize, padding: usize, dilation: usize, groups: usize) -> Conv2dParams {
        Conv2dParams {
            stride: [stride, stride + 1],
            padding: [padding, padding],
            dilation: [dilation, 1],
            groups,
        }
    }

    fn out_hw(h: usize, k: usize, p: &Conv2dParams, axis: usize) -> usize {
        (h + 2 * p.padding[axis] - p.dilation[axis] * (k - 1) - 1) / p.stride[axis] + 1
    }

    #[test]
    fn nchw_and_nhwc_tensors_with_both_filter_formats_map_to_cudnn() {
        let (n, c, h, w, k, r) = (2, 4, 5, 6, 6, 3);
        for (p, groups) in [(params(1, 1, 1, 1), 1), (params(2, 0, 2, 2), 2)] {
            let p = Conv2dParams { groups, ..p };
            let (ho, wo) = (out_hw(h, r, &p, 0), out_hw(w, r, &p, 1));
            let cg = c / groups;
            let nchw = |s: &[usize]| Layout::contiguous(s);
            let nhwc = |s: &[usize]| Layout::channels_last(s).unwrap();
            for (x, wt, y) in [
                (
                    nchw(&[n, c, h, w]),
                    nchw(&[k, cg, r, r]),
                    nchw(&[n, k, ho, wo]),
                ),
                (
                    nhwc(&[n, c, h, w]),
                    nhwc(&[k, cg, r, r]),
                    nhwc(&[n, k, ho, wo]),
                ),
                (
                    nhwc(&[n, c, h, w]),
                    nchw(&[k, cg, r, r]),
                    nchw(&[n, k, ho, wo]),
                ),
            ] {
                check(x, wt, y, p);
            }
        }
    }

    #[test]
    fn views_with_offsets_and_size_one_axes_keep_their_strides() {
        // x: a channel slice of a wider NCHW tensor (offset, padded channel stride); N = 1 with
        // a stray batch stride; a 1×1 filter.
        let x = Layout::new(vec![1, 3, 4, 5], vec![999, 20, 5, 1], 20);
        let w = Layout::new(vec![2, 3, 1, 1], vec![3, 1, 7, 7], 0);
        let y = Layout::contiguous(&[1, 2, 4, 5]);
        check(x, w, y, params(1, 0, 1, 1));
    }

    #[test]
    fn layouts_cudnn_cannot_describe_have_no_plan() {
        let p = params(1, 0, 1, 1);
        let x = Layout::contiguous(&[1, 2, 3, 3]);
        let w = Layout::contiguous(&[2, 2, 1, 1]);
        let y = Layout::contiguous(&[1, 2, 3, 3]);
        let plan =
            |x: &Layout, w: &Layout| ConvPlan::new(DType::F32, Direction::Forward, x, w, &y, &p);
        assert!(plan(&x, &w).is_some());
        // A broadcast input (stride 0), a filter transposed to IOHW, an integer dtype.
        let broadcast = Layout::new(vec![1, 2, 3, 3], vec![0, 0, 3, 1], 0);
        assert!(plan(&broadcast, &w).is_none());
        let iohw = Layout::new(vec![2, 2, 1, 1], vec![1, 2, 1, 1], 0);
        assert!(plan(&x, &iohw).is_none());
        assert!(ConvPlan::new(DType::I64, Direction::Forward, &x, &w, &y, &p).is_none());
    }
}
