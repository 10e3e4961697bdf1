//! The reference backend: every op as plain loops over f64, obviously correct and slow.
//!
//! Storage holds one f64 per element, always rounded to the storage's dtype, so a reference f16
//! tensor holds exactly the values an f16 can. Kernels compute in f64 and round once on store.
//! Every backend is compared against this one; gradcheck runs on it alone.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::RwLock;

use crate::backend::{
    AdamWParams, Backend, BatchNormCoefParams, BinaryOp, Conv2dParams, HostBytes, NnOp, Op,
    OtherOp, Pool2dParams, ReduceOp, ScalerParams, SgdParams, Storage, UnaryOp, View,
};
use crate::dtype::DType;
use crate::error::{Result, TensorError};
use crate::layout::Layout;
use crate::ops;

static NEXT_ID: AtomicUsize = AtomicUsize::new(1);

/// The reference backend. Each instance is its own device.
#[derive(Debug)]
pub struct Reference {
    id: usize,
}

impl Reference {
    pub fn new() -> Self {
        Self {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed) | (1 << 48),
        }
    }
}

impl Default for Reference {
    fn default() -> Self {
        Self::new()
    }
}

/// A reference storage: the elements as f64 (already rounded to the dtype).
struct Values(RwLock<Vec<f64>>);

impl Reference {
    fn values<'a>(&self, s: &'a Storage) -> Result<std::sync::RwLockReadGuard<'a, Vec<f64>>> {
        let values = s.downcast::<Values>(self.id).ok_or_else(|| {
            TensorError::Device(
                "a storage from another device was given to the reference backend".into(),
            )
        })?;
        Ok(values.0.read().unwrap_or_else(|p| p.into_inner()))
    }

    fn store(&self, dtype: DType, values: Vec<f64>) -> Storage {
        let values: Vec<f64> = values.into_iter().map(|v| dtype.round(v)).collect();
        Storage::new(dtype, values.len(), self.id, Values(RwLock::new(values)))
    }

    /// Writes `f(i)` for every logical index `i` of `out` at its storage position.
    fn produce(&self, dtype: DType, out: &Layout, f: impl Fn(usize) -> f64) -> Storage {
        let mut values = vec![0.0; out.storage_extent().max(out.numel())];
        for (i, at) in out.indices().enumerate() {
            values[at] = f(i);
        }
        self.store(dtype, values)
    }

    /// Runs `f` on a storage's values, mutably (the in-place ops).
    fn update<R>(&self, s: &Storage, f: impl FnOnce(&mut Vec<f64>) -> R) -> Result<R> {
        let values = s.downcast::<Values>(self.id).ok_or_else(|| {
            TensorError::Device(
                "a storage from another device was given to the reference backend".into(),
            )
        })?;
        let mut values = values.0.write().unwrap_or_else(|p| p.into_inner());
        let result = f(&mut values);
        let dtype = s.dtype();
        values.iter_mut().for_each(|v| *v = dtype.round(*v));
        Ok(result)
    }

    /// Element 0 of a one-element storage.
    fn scalar(&self, s: &Storage) -> Result<f64> {
        Ok(self.values(s)?.first().copied().unwrap_or(0.0))
    }

    /// `step += 1` (an optimizer's count of applied steps); returns the new count.
    fn count_step(&self, step: &Storage) -> Result<f64> {
        self.update(step, |s| {
            s[0] += 1.0;
            s[0]
        })
    }

    /// The view's elements in logical row-major order.
    fn gather(&self, x: View<'_>) -> Result<Vec<f64>> {
        let values = self.values(x.storage)?;
        Ok(x.layout.indices().map(|at| values[at]).collect())
    }

    /// The batch-norm ops' second operand, masked by `gate` `[a; b]` where given: kept where
    /// `a·x + b`, as `batch_norm_apply` would store it in x's dtype, is above 0.
    fn gated(
        &self,
        xs: &[f64],
        x: View<'_>,
        y: Option<View<'_>>,
        gate: Option<View<'_>>,
    ) -> Result<Option<Vec<f64>>> {
        let Some(y) = y else { return Ok(None) };
        let mut ys = self.gather(y)?;
        if let Some(gate) = gate {
            let k = self.gather(gate)?;
            let shape = x.layout.shape();
            let (c, inner) = (shape[1], shape[2..].iter().product::<usize>().max(1));
            for (i, (v, &xv)) in ys.iter_mut().zip(xs).enumerate() {
                let ch = (i / inner) % c;
                // NaN is not above 0: masked, as ReLU's gradient does.
                let open = x.dtype().round(k[ch] * xv + k[c + ch]) > 0.0;
                if !open {
                    *v = 0.0;
                }
            }
        }
        Ok(Some(ys))
    }
}

/// The (op, dtype) matrix of the host backends (the reference and `redline-cpu`): every op on the
/// float types; on integers, exact arithmetic, comparisons, selection, reductions, copies and
/// indexing. A u8 sum would overflow (PyTorch promotes it to i64): cast first.
pub fn host_matrix(op: Op, dtype: DType) -> bool {
    if dtype.is_float() {
        return true;
    }
    match op {
        Op::Unary(_) | Op::Optim(_) => false,
        // Indexing works on any dtype; the rest of the nn family needs floats.
        Op::Nn(n) => matches!(n, NnOp::Gather) || (n == NnOp::ScatterAdd && dtype != DType::U8),
        Op::Binary(b) => !matches!(b, BinaryOp::Div | BinaryOp::Pow),
        Op::Reduce(r) => !(r == ReduceOp::Sum && dtype == DType::U8),
        Op::Other(o) => o != OtherOp::Matmul,
    }
}

impl Backend for Reference {
    fn name(&self) -> String {
        "reference".into()
    }

    fn id(&self) -> usize {
        self.id
    }

    fn supports(&self, op: Op, dtype: DType) -> bool {
        host_matrix(op, dtype)
    }

    fn fill(&self, dtype: DType, len: usize, value: f64) -> Result<Storage> {
        Ok(self.store(dtype, vec![value; len]))
    }

    fn upload(&self, dtype: DType, bytes: HostBytes) -> Result<Storage> {
        let values = (0..bytes.len() / dtype.size())
            .map(|i| dtype.read(&bytes, i))
            .collect();
        // The copy is complete here: `bytes` (maybe a pooled buffer) is dropped on return.
        Ok(self.store(dtype, values))
    }

    fn upload_into(&self, dst: &Storage, bytes: HostBytes) -> Result<()> {
        crate::backend::check_upload_into(self.name(), dst, &bytes)?;
        let dtype = dst.dtype();
        self.update(dst, |values| {
            for (i, v) in values.iter_mut().enumerate() {
                *v = dtype.read(&bytes, i);
            }
        })
    }

    fn download(&self, x: View<'_>) -> Result<Vec<u8>> {
        let values = self.gather(x)?;
        let dtype = x.dtype();
        let mut bytes = vec![0u8; values.len() * dtype.size()];
        for (i, v) in values.into_iter().enumerate() {
            dtype.write(&mut bytes, i, v);
        }
        Ok(bytes)
    }

    fn synchronize(&self) -> Result<()> {
        Ok(())
    }

    fn unary(&self, op: UnaryOp, x: View<'_>, out: &Layout) -> Result<Storage> {
        let xs = self.gather(x)?;
        Ok(self.produce(x.dtype(), out, |i| {
            ops::elementwise::reference::unary(op, xs[i])
        }))
    }

    fn binary(&self, op: BinaryOp, a: View<'_>, b: View<'_>, out: &Layout) -> Result<Storage> {
        let (xs, ys) = (self.gather(a)?, self.gather(b)?);
        let dtype = if op.is_comparison() {
            DType::U8
        } else {
            a.dtype()
        };
        Ok(self.produce(dtype, out, |i| {
            ops::elementwise::reference::binary(op, xs[i], ys[i])
        }))
    }

    fn reduce(&self, op: ReduceOp, x: View<'_>, axes: &[usize]) -> Result<Storage> {
        let values = self.values(x.storage)?;
        let out = ops::reduce::reference::reduce(op, &values, x.layout, axes);
        let dtype = if op == ReduceOp::ArgMax {
            DType::I64
        } else {
            x.dtype()
        };
        Ok(self.store(dtype, out))
    }

    fn matmul(&self, a: View<'_>, b: View<'_>) -> Result<Storage> {
        let (va, vb) = (self.values(a.storage)?, self.values(b.storage)?);
        let out = ops::matmul::reference::matmul(&va, a.layout, &vb, b.layout);
        Ok(self.store(a.dtype(), out))
    }

    fn select(&self, cond: View<'_>, a: View<'_>, b: View<'_>, out: &Layout) -> Result<Storage> {
        let (c, xs, ys) = (self.gather(cond)?, self.gather(a)?, self.gather(b)?);
        Ok(self.produce(a.dtype(), out, |i| if c[i] != 0.0 { xs[i] } else { ys[i] }))
    }

    fn convert(&self, x: View<'_>, dtype: DType, out: &Layout) -> Result<Storage> {
        let xs = self.gather(x)?;
        Ok(self.produce(dtype, out, |i| xs[i]))
    }

    fn copy_into(&self, dst: &Storage, at: &Layout, src: View<'_>) -> Result<()> {
        let values = self.gather(src)?;
        let target = dst.downcast::<Values>(self.id).ok_or_else(|| {
            TensorError::Device("copy_into: the destination belongs to another device".into())
        })?;
        let mut target = target.0.write().unwrap_or_else(|p| p.into_inner());
        if at.storage_extent() > target.len() {
            return Err(TensorError::shape(format!(
                "copy_into: region reaches element {} of a storage of {}",
                at.storage_extent(),
                target.len()
            )));
        }
        for (v, i) in values.into_iter().zip(at.indices()) {
            target[i] = dst.dtype().round(v);
        }
        Ok(())
    }

    fn softmax(&self, x: View<'_>, axis: usize, log: bool, out: &Layout) -> Result<Storage> {
        let xs = self.gather(x)?;
        let y = ops::nn::reference::softmax(&xs, x.layout.shape(), axis, log);
        Ok(self.produce(x.dtype(), out, |i| y[i]))
    }

    fn cross_entropy(
        &self,
        logits: View<'_>,
        targets: View<'_>,
        smoothing: f64,
        ignore_index: i64,
        grad: bool,
    ) -> Result<(Storage, Option<Storage>)> {
        let x = self.gather(logits)?;
        let t: Vec<i64> = self.gather(targets)?.iter().map(|&v| v as i64).collect();
        let c = logits.layout.shape()[1];
        let (loss, g) = ops::nn::reference::cross_entropy(&x, &t, c, smoothing, ignore_index)?;
        let dtype = logits.dtype();
        Ok((
            self.store(dtype, vec![loss]),
            grad.then(|| self.store(dtype, g)),
        ))
    }

    fn gather(&self, x: View<'_>, axis: usize, index: View<'_>) -> Result<Storage> {
        let (xs, idx) = (self.gather(x)?, self.gather(index)?);
        let at = ops::nn::reference::positions(x.layout.shape(), index.layout.shape(), axis, &idx)?;
        Ok(self.store(x.dtype(), at.into_iter().map(|p| xs[p]).collect()))
    }

    fn scatter_add(
        &self,
        dst: &Storage,
        dst_shape: &[usize],
        axis: usize,
        index: View<'_>,
        src: View<'_>,
    ) -> Result<()> {
        let (idx, vs) = (self.gather(index)?, self.gather(src)?);
        let at = ops::nn::reference::positions(dst_shape, index.layout.shape(), axis, &idx)?;
        self.update(dst, |d| {
            for (p, v) in at.into_iter().zip(vs) {
                d[p] += v;
            }
        })
    }

    fn conv2d(&self, x: View<'_>, w: View<'_>, p: &Conv2dParams, out: &Layout) -> Result<Storage> {
        let (xs, ws) = (self.gather(x)?, self.gather(w)?);
        let y = ops::conv::reference::conv2d(
            &xs,
            x.layout.shape(),
            &ws,
            w.layout.shape(),
            p,
            out.numel(),
        );
        Ok(self.produce(x.dtype(), out, |i| y[i]))
    }

    fn conv2d_input_grad(
        &self,
        g: View<'_>,
        w: View<'_>,
        p: &Conv2dParams,
        out: &Layout,
    ) -> Result<Storage> {
        let (gs, ws) = (self.gather(g)?, self.gather(w)?);
        let gx =
            ops::conv::reference::conv2d_input_grad(&gs, &ws, w.layout.shape(), out.shape(), p);
        Ok(self.produce(g.dtype(), out, |i| gx[i]))
    }

    /// Added in place (rounded as the separate add would round), so every reference test of a
    /// network with skip connections runs the engine's path that hands a waiting gradient to
    /// the convolution.
    fn conv2d_input_grad_accumulate(
        &self,
        g: View<'_>,
        w: View<'_>,
        p: &Conv2dParams,
        into: &Storage,
        out: &Layout,
    ) -> Result<bool> {
        let dtype = g.dtype();
        crate::backend::check_accumulate_into(self.name(), into, dtype, out)?;
        let (gs, ws) = (self.gather(g)?, self.gather(w)?);
        let gx =
            ops::conv::reference::conv2d_input_grad(&gs, &ws, w.layout.shape(), out.shape(), p);
        self.update(into, |values| {
            for (i, at) in out.indices().enumerate() {
                values[at] += dtype.round(gx[i]);
            }
        })?;
        Ok(true)
    }

    fn conv2d_weight_grad(
        &self,
        x: View<'_>,
        g: View<'_>,
        p: &Conv2dParams,
        out: &Layout,
    ) -> Result<Storage> {
        let (xs, gs) = (self.gather(x)?, self.gather(g)?);
        let gw =
            ops::conv::reference::conv2d_weight_grad(&xs, x.layout.shape(), &gs, out.shape(), p);
        Ok(self.produce(x.dtype(), out, |i| gw[i]))
    }

    fn max_pool2d(
        &self,
        x: View<'_>,
        p: &Pool2dParams,
        out: &Layout,
    ) -> Result<(Storage, Storage)> {
        let xs = self.gather(x)?;
        let (y, at) = ops::conv::reference::max_pool2d(&xs, x.layout.shape(), p, out.numel());
        Ok((
            self.produce(x.dtype(), out, |i| y[i]),
            self.produce(DType::I64, out, |i| at[i]),
        ))
    }

    fn avg_pool2d(&self, x: View<'_>, p: &Pool2dParams, out: &Layout) -> Result<Storage> {
        let xs = self.gather(x)?;
        let y = ops::conv::reference::avg_pool2d(&xs, x.layout.shape(), p, out.numel());
        Ok(self.produce(x.dtype(), out, |i| y[i]))
    }

    fn max_pool2d_grad(
        &self,
        g: View<'_>,
        positions: View<'_>,
        _p: &Pool2dParams,
        out: &Layout,
    ) -> Result<Storage> {
        let (gs, at) = (self.gather(g)?, self.gather(positions)?);
        let gx = ops::conv::reference::max_pool2d_grad(&gs, &at, out.shape(), g.layout.shape())
            .ok_or_else(|| {
                TensorError::Shape(format!(
                    "max_pool2d_grad: a position lies outside its {:?} plane",
                    &out.shape()[2..]
                ))
            })?;
        Ok(self.produce(g.dtype(), out, |i| gx[i]))
    }

    fn avg_pool2d_grad(&self, g: View<'_>, p: &Pool2dParams, out: &Layout) -> Result<Storage> {
        let gs = self.gather(g)?;
        let gx = ops::conv::reference::avg_pool2d_grad(&gs, out.shape(), p);
        Ok(self.produce(g.dtype(), out, |i| gx[i]))
    }

    fn random_uniform(&self, dtype: DType, len: usize, seed: u64, offset: u64) -> Result<Storage> {
        let values = (0..len as u64)
            .map(|i| ops::random::reference::uniform(seed, offset + i))
            .collect();
        Ok(self.store(dtype, values))
    }

    fn normalize_input(
        &self,
        x: View<'_>,
        mean: &[f64],
        std: &[f64],
        dtype: DType,
        out: &Layout,
    ) -> Result<Storage> {
        let xs = self.gather(x)?;
        let (h, w, c) = (
            x.layout.shape()[1],
            x.layout.shape()[2],
            x.layout.shape()[3],
        );
        // Output logical index i is (n, ch, y, x) of [N, C, H, W]; the input is [N, H, W, C].
        Ok(self.produce(dtype, out, |i| {
            let (px, rest) = (i % w, i / w);
            let (py, rest) = (rest % h, rest / h);
            let (ch, n) = (rest % c, rest / c);
            (xs[((n * h + py) * w + px) * c + ch] / 255.0 - mean[ch]) / std[ch]
        }))
    }

    fn batch_norm_stats(
        &self,
        x: View<'_>,
        y: Option<View<'_>>,
        gate: Option<View<'_>>,
        centre: Option<View<'_>>,
    ) -> Result<Storage> {
        let xs = self.gather(x)?;
        let ys = self.gated(&xs, x, y, gate)?;
        let k = centre.map(|k| self.gather(k)).transpose()?.map(|k| {
            k.into_iter()
                .map(crate::backend::batch_norm_shift)
                .collect::<Vec<_>>()
        });
        let sums = ops::norm::batch_norm_reference::stats(
            &xs,
            ys.as_deref(),
            k.as_deref(),
            x.layout.shape(),
        );
        Ok(self.store(crate::backend::stats_dtype(x.dtype()), sums))
    }

    fn batch_norm_apply(
        &self,
        x: View<'_>,
        y: Option<View<'_>>,
        coef: View<'_>,
        relu: bool,
        gate: Option<View<'_>>,
        out: &Layout,
    ) -> Result<Storage> {
        let (xs, k) = (self.gather(x)?, self.gather(coef)?);
        let ys = self.gated(&xs, x, y, gate)?;
        let shape = x.layout.shape();
        let (c, inner) = (shape[1], shape[2..].iter().product::<usize>().max(1));
        Ok(self.produce(x.dtype(), out, |i| {
            let ch = (i / inner) % c;
            let extra = ys.as_ref().map_or(0.0, |y| k[2 * c + ch] * y[i]);
            let v = k[ch] * xs[i] + k[c + ch] + extra;
            if relu {
                v.max(0.0)
            } else {
                v
            }
        }))
    }

    fn batch_norm_coef(
        &self,
        sums: View<'_>,
        centre: Option<View<'_>>,
        weight: Option<View<'_>>,
        bias: Option<View<'_>>,
        running: Option<(&Storage, &Storage)>,
        p: &BatchNormCoefParams,
    ) -> Result<(Storage, Storage)> {
        let sd = sums.dtype();
        let s = self.gather(sums)?;
        let k = centre.map(|k| self.gather(k)).transpose()?;
        let w = weight.map(|w| self.gather(w)).transpose()?;
        let b = bias.map(|b| self.gather(b)).transpose()?;
        let (coef, saved) = match running {
            Some((mean, var)) => {
                let (mut rm, mut rv) = (self.values(mean)?.clone(), self.values(var)?.clone());
                let running = Some((&mut rm[..], &mut rv[..]));
                let out = p.host(&s, k.as_deref(), w.as_deref(), b.as_deref(), running);
                self.update(mean, |v| v.copy_from_slice(&rm))?;
                self.update(var, |v| v.copy_from_slice(&rv))?;
                out
            }
            None => p.host(&s, k.as_deref(), w.as_deref(), b.as_deref(), None),
        };
        Ok((self.store(sd, coef), self.store(sd, saved)))
    }

    fn batch_norm_grad_coef(
        &self,
        sums: View<'_>,
        saved: View<'_>,
        weight: Option<View<'_>>,
        count: f64,
    ) -> Result<(Storage, Storage, Storage)> {
        let sd = sums.dtype();
        let (s, kept) = (self.gather(sums)?, self.gather(saved)?);
        let w = weight.map(|w| self.gather(w)).transpose()?;
        let (coef, mut dw) = BatchNormCoefParams::host_grad(count, &s, &kept, w.as_deref());
        let db = dw.split_off(s.len() / 2);
        Ok((self.store(sd, coef), self.store(sd, dw), self.store(sd, db)))
    }

    fn sgd(
        &self,
        params: &[&Storage],
        grads: &[&Storage],
        momentum: &[&Storage],
        step: &Storage,
        lr: &Storage,
        p: &SgdParams,
        found_inf: Option<&Storage>,
    ) -> Result<()> {
        if let Some(flag) = found_inf {
            if self.scalar(flag)? != 0.0 {
                return Ok(());
            }
        }
        let first = self.count_step(step)? == 1.0;
        let lr = self.scalar(lr)? * p.lr_scale;
        for (i, param) in params.iter().enumerate() {
            let g = self.values(grads[i])?.clone();
            let mut bufs = match momentum.get(i) {
                Some(b) if p.momentum != 0.0 => self.values(b)?.clone(),
                _ => vec![0.0; g.len()],
            };
            self.update(param, |w| {
                for (k, w) in w.iter_mut().enumerate() {
                    (*w, bufs[k]) = ops::optim::reference::sgd(*w, g[k], bufs[k], lr, first, p);
                }
            })?;
            if let Some(b) = momentum.get(i).filter(|_| p.momentum != 0.0) {
                self.update(b, |v| v.copy_from_slice(&bufs))?;
            }
        }
        Ok(())
    }

    fn adamw(
        &self,
        params: &[&Storage],
        grads: &[&Storage],
        exp_avg: &[&Storage],
        exp_avg_sq: &[&Storage],
        step: &Storage,
        lr: &Storage,
        p: &AdamWParams,
        found_inf: Option<&Storage>,
    ) -> Result<()> {
        if let Some(flag) = found_inf {
            if self.scalar(flag)? != 0.0 {
                return Ok(());
            }
        }
        let t = self.count_step(step)?;
        let lr = self.scalar(lr)? * p.lr_scale;
        for (i, param) in params.iter().enumerate() {
            let g = self.values(grads[i])?.clone();
            let mut m = self.values(exp_avg[i])?.clone();
            let mut v = self.values(exp_avg_sq[i])?.clone();
            self.update(param, |w| {
                for (k, w) in w.iter_mut().enumerate() {
                    (*w, m[k], v[k]) = ops::optim::reference::adamw(*w, g[k], m[k], v[k], t, lr, p);
                }
            })?;
            self.update(exp_avg[i], |d| d.copy_from_slice(&m))?;
            self.update(exp_avg_sq[i], |d| d.copy_from_slice(&v))?;
        }
        Ok(())
    }

    fn sum_squares(&self, tensors: &[&Storage]) -> Result<Storage> {
        let mut sum = 0.0;
        for t in tensors {
            sum += self.values(t)?.iter().map(|v| v * v).sum::<f64>();
        }
        let dtype = tensors.first().map_or(DType::F32, |t| t.dtype());
        Ok(self.store(crate::backend::stats_dtype(dtype), vec![sum]))
    }

    fn unscale_check(
        &self,
        grads: &[&Storage],
        inv_scale: &Storage,
        found_inf: &Storage,
    ) -> Result<()> {
        let inv = self.scalar(inv_scale)?;
        let mut bad = false;
        for g in grads {
            bad |= self.update(g, |values| {
                values.iter_mut().fold(false, |bad, v| {
                    *v *= inv;
                    bad || !v.is_finite()
                })
            })?;
        }
        if bad {
            self.update(found_inf, |f| f[0] = 1.0)?;
        }
        Ok(())
    }

    fn scaler_update(
        &self,
        scale: &Storage,
        growth_tracker: &Storage,
        found_inf: &Storage,
        p: &ScalerParams,
    ) -> Result<()> {
        let overflow = self.scalar(found_inf)? != 0.0;
        let tracker = self.scalar(growth_tracker)?;
        let (factor, tracker) = if overflow {
            (p.backoff_factor, 0.0)
        } else if tracker + 1.0 >= p.growth_interval as f64 {
            (p.growth_factor, 0.0)
        } else {
            (1.0, tracker + 1.0)
        };
        self.update(scale, |s| s[0] *= factor)?;
        self.update(growth_tracker, |t| t[0] = tracker)?;
        self.update(found_inf, |f| f[0] = 0.0)
    }
}
