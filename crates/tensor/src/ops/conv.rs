//! 2-d convolution and pooling (NCHW logical; channels-last inputs give channels-last outputs).

use crate::backend::{Conv2dParams, NnOp, Op, Pool2dParams};
use crate::error::{Result, TensorError};
use crate::layout::Layout;
use crate::tensor::Tensor;

/// Output size of a sliding window: `(n + 2p - d(k-1) - 1) / s + 1`, or None when it does not fit.
pub(crate) fn out_size(n: usize, k: usize, s: usize, p: usize, d: usize) -> Option<usize> {
    let span = d.checked_mul(k.checked_sub(1)?)?.checked_add(1)?;
    let padded = n.checked_add(2 * p)?;
    (s > 0 && padded >= span).then(|| (padded - span) / s + 1)
}

/// The layout of an NCHW output: channels-last when the input is.
fn nchw_out(x: &Tensor, shape: &[usize]) -> Result<Layout> {
    if x.is_channels_last() {
        Layout::channels_last(shape)
    } else {
        Ok(Layout::contiguous(shape))
    }
}

impl Tensor {
    /// 2-d convolution of `[N, C, H, W]` by `[O, C/groups, KH, KW]`, plus an optional `[O]` bias.
    pub fn conv2d(
        &self,
        weight: &Tensor,
        bias: Option<&Tensor>,
        p: Conv2dParams,
    ) -> Result<Tensor> {
        self.same_device(weight, "conv2d")?;
        self.same_dtype(weight, "conv2d")?;
        let (xs, ws) = (self.shape(), weight.shape());
        let bad = |why: &str| {
            TensorError::shape(format!("conv2d: input {xs:?}, weight {ws:?}, {p:?}: {why}"))
        };
        if xs.len() != 4 || ws.len() != 4 {
            return Err(bad("need 4-d input and weight"));
        }
        if p.groups == 0 || xs[1] != ws[1] * p.groups || ws[0] % p.groups != 0 {
            return Err(bad("channels do not match the groups"));
        }
        let ho = out_size(xs[2], ws[2], p.stride[0], p.padding[0], p.dilation[0]);
        let wo = out_size(xs[3], ws[3], p.stride[1], p.padding[1], p.dilation[1]);
        let (Some(ho), Some(wo)) = (ho, wo) else {
            return Err(bad(
                "the kernel does not fit the padded input (or a stride is 0)",
            ));
        };
        if ho == 0 || wo == 0 || p.dilation.contains(&0) {
            return Err(bad("empty output"));
        }
        self.device().check(Op::Nn(NnOp::Conv2d), self.dtype())?;
        let out = nchw_out(self, &[xs[0], ws[0], ho, wo])?;
        let storage = self
            .backend()
            .conv2d(self.view(), weight.view(), &p, &out)?;
        let y = Tensor::from_storage(storage, out, self.device().clone());
        let (x, w) = (self.detach(), weight.detach());
        // Only the gradients someone needs: the first layer's input (the data) needs none, and
        // its input gradient would be the costliest of the network's (3 channels, full size).
        let (need_x, need_w) = (self.requires_grad(), weight.requires_grad());
        let y = y.record_with_pending("conv2d", &[self, weight], move |g, pending| {
            let gx = if need_x {
                x.device().check(Op::Nn(NnOp::Conv2dInputGrad), x.dtype())?;
                let gx_layout = x.layout().output_like();
                // Added into the gradient already waiting for x (a residual block's skip
                // connection) where the backend can: the engine's add is saved.
                // (Of g's dtype: what the backend writes.)
                let waiting = pending.exclusive(0, &gx_layout, g.dtype());
                let added = match waiting {
                    Some(into) => x.backend().conv2d_input_grad_accumulate(
                        g.view(),
                        w.view(),
                        &p,
                        into.storage(),
                        &gx_layout,
                    )?,
                    None => false,
                };
                if added {
                    pending.take(0)
                } else {
                    let gx = x
                        .backend()
                        .conv2d_input_grad(g.view(), w.view(), &p, &gx_layout)?;
                    Some(Tensor::from_storage(gx, gx_layout, x.device().clone()))
                }
            } else {
                None
            };
            let gw = if need_w {
                x.device()
                    .check(Op::Nn(NnOp::Conv2dWeightGrad), x.dtype())?;
                // In the weight's own order (PyTorch's rule): beside channels-last activations
                // autocast's weight copy is channels-last, and cuDNN's NHWC kernels write a
                // KRSC filter gradient natively; the cast back to the OIHW master reorders it
                // in the copy it makes anyway.
                let layout = match w.is_channels_last() {
                    true => Layout::channels_last(w.shape())?,
                    false => Layout::contiguous(w.shape()),
                };
                let gw = x
                    .backend()
                    .conv2d_weight_grad(x.view(), g.view(), &p, &layout)?;
                Some(Tensor::from_storage(gw, layout, x.device().clone()))
            } else {
                None
            };
            Ok(vec![gx, gw])
        });
        match bias {
            None => Ok(y),
            Some(b) if b.shape() == [ws[0]] => y.add(&b.reshape(&[1, ws[0], 1, 1])?),
            Some(b) => Err(bad(&format!("bias {:?} is not [{}]", b.shape(), ws[0]))),
        }
    }

    fn pool_geometry(&self, p: &Pool2dParams, op: &str) -> Result<Vec<usize>> {
        let s = self.shape();
        let bad = |why: &str| TensorError::shape(format!("{op}: input {s:?}, {p:?}: {why}"));
        if s.len() != 4 {
            return Err(bad("need a 4-d input"));
        }
        if p.padding[0] * 2 > p.kernel[0] || p.padding[1] * 2 > p.kernel[1] {
            return Err(bad(
                "padding must be at most half the kernel (as in PyTorch)",
            ));
        }
        let ho = out_size(s[2], p.kernel[0], p.stride[0], p.padding[0], 1);
        let wo = out_size(s[3], p.kernel[1], p.stride[1], p.padding[1], 1);
        match (ho, wo) {
            (Some(ho), Some(wo)) if ho > 0 && wo > 0 && !p.kernel.contains(&0) => {
                Ok(vec![s[0], s[1], ho, wo])
            }
            _ => Err(bad("the window does not fit (or a kernel or stride is 0)")),
        }
    }

    /// Max pooling over `[N, C, H, W]`.
    pub fn max_pool2d(&self, p: Pool2dParams) -> Result<Tensor> {
        let shape = self.pool_geometry(&p, "max_pool2d")?;
        self.device().check(Op::Nn(NnOp::MaxPool2d), self.dtype())?;
        let out = nchw_out(self, &shape)?;
        let (values, positions) = self.backend().max_pool2d(self.view(), &p, &out)?;
        // Positions are laid out as the values (channels-last with them), so a device walks both
        // in memory order.
        let positions = Tensor::from_storage(positions, out.clone(), self.device().clone());
        let y = Tensor::from_storage(values, out, self.device().clone());
        let x = self.detach();
        Ok(y.record("max_pool2d", &[self], move |g| {
            // Each output gradient goes to its maximum (a pull per input element on devices).
            x.device().check(Op::Nn(NnOp::MaxPool2dGrad), g.dtype())?;
            let layout = x.layout().output_like();
            let gx = x
                .backend()
                .max_pool2d_grad(g.view(), positions.view(), &p, &layout)?;
            Ok(vec![Some(Tensor::from_storage(
                gx,
                layout,
                x.device().clone(),
            ))])
        }))
    }

    /// Average pooling over `[N, C, H, W]` (padding counted in the divisor, PyTorch's default).
    pub fn avg_pool2d(&self, p: Pool2dParams) -> Result<Tensor> {
        let shape = self.pool_geometry(&p, "avg_pool2d")?;
        self.device().check(Op::Nn(NnOp::AvgPool2d), self.dtype())?;
        let out = nchw_out(self, &shape)?;
        let storage = self.backend().avg_pool2d(self.view(), &p, &out)?;
        let y = Tensor::from_storage(storage, out, self.device().clone());
        let x = self.detach();
        Ok(y.record("avg_pool2d", &[self], move |g| {
            x.device().check(Op::Nn(NnOp::AvgPool2dGrad), g.dtype())?;
            let layout = x.layout().output_like();
            let gx = x.backend().avg_pool2d_grad(g.view(), &p, &layout)?;
            Ok(vec![Some(Tensor::from_storage(
                gx,
                layout,
                x.device().clone(),
            ))])
        }))
    }

    /// Mean over H and W: `[N, C, H, W]` → `[N, C]`.
    pub fn global_avg_pool(&self) -> Result<Tensor> {
        if self.rank() != 4 {
            return Err(TensorError::shape(format!(
                "global_avg_pool needs [N, C, H, W], got {:?}",
                self.shape()
            )));
        }
        self.mean(&[2, 3], false)
    }
}

/// The reference kernels: direct loops over logical NCHW, f64 accumulation.
pub(crate) mod reference {
    use super::out_size;
    use crate::backend::{Conv2dParams, Pool2dParams};

    /// Calls `f(x_index, w_index, y_index)` for every multiply-add of the convolution.
    fn conv_taps(
        xs: &[usize],
        ws: &[usize],
        p: &Conv2dParams,
        mut f: impl FnMut(usize, usize, usize),
    ) {
        let (n, c, h, w) = (xs[0], xs[1], xs[2], xs[3]);
        let (o, cg, kh, kw) = (ws[0], ws[1], ws[2], ws[3]);
        let og = o / p.groups;
        let ho = out_size(h, kh, p.stride[0], p.padding[0], p.dilation[0]).unwrap_or(0);
        let wo = out_size(w, kw, p.stride[1], p.padding[1], p.dilation[1]).unwrap_or(0);
        for b in 0..n {
            for oc in 0..o {
                let group = oc / og;
                for y in 0..ho {
                    for x in 0..wo {
                        let yi = ((b * o + oc) * ho + y) * wo + x;
                        for ic in 0..cg {
                            let ch = group * cg + ic;
                            for ky in 0..kh {
                                let iy = (y * p.stride[0] + ky * p.dilation[0]) as isize
                                    - p.padding[0] as isize;
                                if iy < 0 || iy >= h as isize {
                                    continue;
                                }
                                for kx in 0..kw {
                                    let ix = (x * p.stride[1] + kx * p.dilation[1]) as isize
                                        - p.padding[1] as isize;
                                    if ix < 0 || ix >= w as isize {
                                        continue;
                                    }
                                    let xi = ((b * c + ch) * h + iy as usize) * w + ix as usize;
                                    let wi = ((oc * cg + ic) * kh + ky) * kw + kx;
                                    f(xi, wi, yi);
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    pub fn conv2d(
        x: &[f64],
        xs: &[usize],
        w: &[f64],
        ws: &[usize],
        p: &Conv2dParams,
        y_len: usize,
    ) -> Vec<f64> {
        let mut y = vec![0.0; y_len];
        conv_taps(xs, ws, p, |xi, wi, yi| y[yi] += x[xi] * w[wi]);
        y
    }

    pub fn conv2d_input_grad(
        g: &[f64],
        w: &[f64],
        ws: &[usize],
        xs: &[usize],
        p: &Conv2dParams,
    ) -> Vec<f64> {
        let mut gx = vec![0.0; xs.iter().product()];
        conv_taps(xs, ws, p, |xi, wi, yi| gx[xi] += g[yi] * w[wi]);
        gx
    }

    pub fn conv2d_weight_grad(
        x: &[f64],
        xs: &[usize],
        g: &[f64],
        ws: &[usize],
        p: &Conv2dParams,
    ) -> Vec<f64> {
        let mut gw = vec![0.0; ws.iter().product()];
        conv_taps(xs, ws, p, |xi, wi, yi| gw[wi] += g[yi] * x[xi]);
        gw
    }

    /// Calls `f(output index, window positions inside the input plane (flat h*W+w), plane offset)`.
    fn windows(xs: &[usize], p: &Pool2dParams, mut f: impl FnMut(usize, &[usize], usize)) {
        let (n, c, h, w) = (xs[0], xs[1], xs[2], xs[3]);
        let ho = out_size(h, p.kernel[0], p.stride[0], p.padding[0], 1).unwrap_or(0);
        let wo = out_size(w, p.kernel[1], p.stride[1], p.padding[1], 1).unwrap_or(0);
        let mut inside = Vec::with_capacity(p.kernel[0] * p.kernel[1]);
        for plane in 0..n * c {
            for y in 0..ho {
                for x in 0..wo {
                    inside.clear();
                    for ky in 0..p.kernel[0] {
                        for kx in 0..p.kernel[1] {
                            let iy = (y * p.stride[0] + ky) as isize - p.padding[0] as isize;
                            let ix = (x * p.stride[1] + kx) as isize - p.padding[1] as isize;
                            if (0..h as isize).contains(&iy) && (0..w as isize).contains(&ix) {
                                inside.push(iy as usize * w + ix as usize);
                            }
                        }
                    }
                    f((plane * ho + y) * wo + x, &inside, plane * h * w);
                }
            }
        }
    }

    /// (max values, flat in-plane positions of the first maximum: the first NaN, or the
    /// window's first element where all are -inf, as PyTorch's).
    pub fn max_pool2d(
        x: &[f64],
        xs: &[usize],
        p: &Pool2dParams,
        len: usize,
    ) -> (Vec<f64>, Vec<f64>) {
        let (mut y, mut at) = (vec![f64::NEG_INFINITY; len], vec![0.0; len]);
        windows(xs, p, |o, inside, base| {
            at[o] = inside.first().map_or(0.0, |&pos| pos as f64);
            for &pos in inside {
                let v = x[base + pos];
                if v > y[o] || (v.is_nan() && !y[o].is_nan()) {
                    y[o] = v;
                    at[o] = pos as f64;
                }
            }
        });
        (y, at)
    }

    pub fn avg_pool2d(x: &[f64], xs: &[usize], p: &Pool2dParams, len: usize) -> Vec<f64> {
        let area = (p.kernel[0] * p.kernel[1]) as f64;
        let mut y = vec![0.0; len];
        windows(xs, p, |o, inside, base| {
            y[o] = inside.iter().map(|&pos| x[base + pos]).sum::<f64>() / area;
        });
        y
    }

    /// `g[o]` added at its plane's flat position `at[o]`, in output order; `None` if a position
    /// lies outside its plane.
    pub fn max_pool2d_grad(g: &[f64], at: &[f64], xs: &[usize], os: &[usize]) -> Option<Vec<f64>> {
        let (plane, outputs) = (xs[2] * xs[3], os[2] * os[3]);
        let mut gx = vec![0.0; xs.iter().product()];
        for (o, (&g, &at)) in g.iter().zip(at).enumerate() {
            if !(0.0..plane as f64).contains(&at) {
                return None;
            }
            gx[(o / outputs) * plane + at as usize] += g;
        }
        Some(gx)
    }

    pub fn avg_pool2d_grad(g: &[f64], xs: &[usize], p: &Pool2dParams) -> Vec<f64> {
        let area = (p.kernel[0] * p.kernel[1]) as f64;
        let mut gx = vec![0.0; xs.iter().product()];
        windows(xs, p, |o, inside, base| {
            for &pos in inside {
                gx[base + pos] += g[o] / area;
            }
        });
        gx
    }
}
