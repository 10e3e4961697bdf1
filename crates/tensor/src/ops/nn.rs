//! Softmax, log-softmax, gather/scatter-add, embedding and cross-entropy.

use crate::backend::{NnOp, Op};
use crate::dtype::DType;
use crate::error::{Result, TensorError};
use crate::layout::Layout;
use crate::tensor::Tensor;

impl Tensor {
    fn check_axis(&self, axis: usize, op: &str) -> Result<()> {
        if axis >= self.rank() {
            return Err(TensorError::shape(format!(
                "{op}: axis {axis} of shape {:?}",
                self.shape()
            )));
        }
        Ok(())
    }

    /// Errors unless `index` is an i64 tensor on this device, of this rank, no larger than this
    /// tensor off `axis` (gather's and scatter-add's contract).
    fn check_index(&self, axis: usize, index: &Tensor, op: &str) -> Result<()> {
        self.check_axis(axis, op)?;
        self.same_device(index, op)?;
        let fits = index.rank() == self.rank()
            && (0..self.rank()).all(|d| d == axis || index.shape()[d] <= self.shape()[d]);
        if index.dtype() != DType::I64 || !fits {
            return Err(TensorError::shape(format!(
                "{op} along {axis}: index {} {:?} for {:?} (need i64 of the same rank, no larger off the axis)",
                index.dtype(),
                index.shape(),
                self.shape()
            )));
        }
        Ok(())
    }

    fn softmax_impl(&self, axis: usize, log: bool) -> Result<Tensor> {
        let op = if log { NnOp::LogSoftmax } else { NnOp::Softmax };
        self.check_axis(axis, op.name())?;
        self.device().check(Op::Nn(op), self.dtype())?;
        let out = self.layout().output_like();
        let storage = self.backend().softmax(self.view(), axis, log, &out)?;
        let y = Tensor::from_storage(storage, out, self.device().clone());
        let yd = y.detach();
        Ok(y.record(op.name(), &[self], move |g| {
            let gx = if log {
                // d log_softmax: g - softmax · Σ g
                g.sub(&yd.exp()?.mul(&g.sum(&[axis], true)?)?)?
            } else {
                // d softmax: y · (g - Σ g·y)
                yd.mul(&g.sub(&g.mul(&yd)?.sum(&[axis], true)?)?)?
            };
            Ok(vec![Some(gx)])
        }))
    }

    /// Softmax along `axis`.
    pub fn softmax(&self, axis: usize) -> Result<Tensor> {
        self.softmax_impl(axis, false)
    }

    /// Log-softmax along `axis` (computed stably, not as log(softmax)).
    pub fn log_softmax(&self, axis: usize) -> Result<Tensor> {
        self.softmax_impl(axis, true)
    }

    /// Picks elements along `axis` by an i64 `index` of the same rank (`torch.gather`).
    pub fn gather(&self, axis: usize, index: &Tensor) -> Result<Tensor> {
        self.check_index(axis, index, "gather")?;
        self.device().check(Op::Nn(NnOp::Gather), self.dtype())?;
        let storage = self.backend().gather(self.view(), axis, index.view())?;
        let y = Tensor::from_storage(
            storage,
            Layout::contiguous(index.shape()),
            self.device().clone(),
        );
        let (shape, idx) = (self.shape().to_vec(), index.detach());
        Ok(y.record("gather", &[self], move |g| {
            let gx = Tensor::zeros(&shape, g.dtype(), g.device())?;
            gx.scatter_add_in_place(axis, &idx, g)?;
            Ok(vec![Some(gx)])
        }))
    }

    /// `torch.scatter_add`: a copy of `self` with `src[p]` added at `index[p]` along `axis`
    /// (i64 `index` of `src`'s shape). Differentiable in `self` and `src`.
    pub fn scatter_add(&self, axis: usize, index: &Tensor, src: &Tensor) -> Result<Tensor> {
        self.check_index(axis, index, "scatter_add")?;
        self.same_device(src, "scatter_add")?;
        self.same_dtype(src, "scatter_add")?;
        let out = self
            .detach()
            .convert_to(self.dtype(), Layout::contiguous(self.shape()))?;
        out.scatter_add_in_place(axis, index, src)?;
        let idx = index.detach();
        Ok(out.record("scatter_add", &[self, src], move |g| {
            Ok(vec![Some(g.clone()), Some(g.gather(axis, &idx)?)])
        }))
    }

    /// `self[.., index[p], ..] += src[p]` along `axis`, in place (no autograd). `self` must be a
    /// freshly made contiguous tensor.
    pub(crate) fn scatter_add_in_place(
        &self,
        axis: usize,
        index: &Tensor,
        src: &Tensor,
    ) -> Result<()> {
        if !self.layout().is_contiguous() || index.shape() != src.shape() {
            return Err(TensorError::shape(format!(
                "scatter_add: destination {:?} (contiguous: {}), index {:?}, source {:?}",
                self.shape(),
                self.layout().is_contiguous(),
                index.shape(),
                src.shape()
            )));
        }
        self.device()
            .check(Op::Nn(NnOp::ScatterAdd), self.dtype())?;
        let src = src.cast(self.dtype())?;
        self.backend()
            .scatter_add(self.storage(), self.shape(), axis, index.view(), src.view())
    }

    /// Rows of `self` (a `[V, D]` table) picked by i64 `ids` of any shape: `[.., D]`.
    pub fn embedding(&self, ids: &Tensor) -> Result<Tensor> {
        if self.rank() != 2 {
            return Err(TensorError::shape(format!(
                "embedding: the table must be [V, D], got {:?}",
                self.shape()
            )));
        }
        let d = self.shape()[1];
        let n = ids.numel();
        let index = ids.reshape(&[n, 1])?.broadcast_to(&[n, d])?;
        let mut shape = ids.shape().to_vec();
        shape.push(d);
        self.gather(0, &index)?.reshape(&shape)
    }

    /// Mean cross-entropy of `[N, C]` logits against i64 class `targets` `[N]`, with label
    /// smoothing `smoothing` (PyTorch's: the target distribution is `(1-ε)·onehot + ε/C`) and
    /// samples whose target is `ignore_index` left out of the loss and of the mean.
    pub fn cross_entropy(
        &self,
        targets: &Tensor,
        smoothing: f64,
        ignore_index: Option<i64>,
    ) -> Result<Tensor> {
        if self.rank() != 2 || targets.shape() != [self.shape()[0]] || targets.dtype() != DType::I64
        {
            return Err(TensorError::shape(format!(
                "cross_entropy: logits {:?} and targets {} {:?} (need [N, C] and i64 [N])",
                self.shape(),
                targets.dtype(),
                targets.shape()
            )));
        }
        let n = self.shape()[0];
        if self
            .backend()
            .supports(Op::Nn(NnOp::CrossEntropy), self.dtype())
        {
            // No ignore_index: a target no sample can hold.
            return self.cross_entropy_fused(targets, smoothing, ignore_index.unwrap_or(i64::MIN));
        }
        let logp = self.log_softmax(1)?;
        let keep = match ignore_index {
            Some(ignored) => targets.ne(&Tensor::full(
                ignored as f64,
                &[],
                DType::I64,
                self.device(),
            )?)?,
            None => Tensor::ones(&[n], DType::U8, self.device())?,
        };
        // Ignored targets may be out of range (-100): gather at 0 instead, then mask.
        let zero = Tensor::zeros(&[], DType::I64, self.device())?;
        let safe = Tensor::where_(&keep, targets, &zero)?;
        let picked = logp.gather(1, &safe.reshape(&[n, 1])?)?.reshape(&[n])?;
        let mut per_sample = picked.neg()?;
        if smoothing > 0.0 {
            let uniform = logp.mean(&[1], false)?.neg()?;
            per_sample = per_sample
                .mul_scalar(1.0 - smoothing)?
                .add(&uniform.mul_scalar(smoothing)?)?;
        }
        let weight = keep.cast(self.dtype())?;
        let total = per_sample.mul(&weight)?.sum(&[], false)?;
        // Mean over kept samples; the count is clamped to 1 so an all-ignored batch gives 0.
        let count = weight.sum(&[], false)?.maximum(&total.scalar_like(1.0)?)?;
        total.div(&count)
    }
}

impl Tensor {
    /// [`Tensor::cross_entropy`] in one backend call ([`crate::Backend::cross_entropy`]): the
    /// gradient is computed with the loss (when the tape records) and its backward is one
    /// multiply by the loss's gradient.
    fn cross_entropy_fused(&self, targets: &Tensor, smoothing: f64, ignore: i64) -> Result<Tensor> {
        self.same_device(targets, "cross_entropy")?;
        let targets = targets.contiguous()?;
        let want_grad = crate::autograd::is_grad_enabled() && self.requires_grad();
        let (loss, grad) = self.backend().cross_entropy(
            self.view(),
            targets.view(),
            smoothing,
            ignore,
            want_grad,
        )?;
        let device = self.device().clone();
        let grad =
            grad.map(|g| Tensor::from_storage(g, Layout::contiguous(self.shape()), device.clone()));
        let loss = Tensor::from_storage(loss, Layout::contiguous(&[]), device);
        Ok(loss.record("cross_entropy", &[self], move |g| {
            let grad = grad.ok_or_else(|| {
                TensorError::Autograd("cross_entropy ran without its gradient".into())
            })?;
            Ok(vec![Some(grad.mul(g)?)])
        }))
    }
}

/// The reference kernels.
pub(crate) mod reference {
    use crate::error::{Result, TensorError};

    /// Fused cross-entropy ([`crate::Backend::cross_entropy`]) of row-major logits `x` `[n, c]`
    /// in f64: the loss and ∂loss/∂x. Shared by the host backends.
    pub fn cross_entropy(
        x: &[f64],
        targets: &[i64],
        c: usize,
        smoothing: f64,
        ignore: i64,
    ) -> Result<(f64, Vec<f64>)> {
        let kept = targets.iter().filter(|&&t| t != ignore).count();
        let scale = 1.0 / kept.max(1) as f64;
        let (mut total, mut grad) = (0.0, vec![0.0; x.len()]);
        for (r, (&t, row)) in targets.iter().zip(x.chunks(c)).enumerate() {
            if t == ignore {
                continue;
            }
            if t < 0 || t as usize >= c {
                return Err(TensorError::shape(format!(
                    "cross_entropy: target {t} of sample {r} is out of range for {c} classes"
                )));
            }
            let max = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let log_sum = row.iter().map(|v| (v - max).exp()).sum::<f64>().ln();
            let lse = max + log_sum;
            total += (1.0 - smoothing) * (lse - row[t as usize]);
            // The smoothing term lse − mean(v) as log Σ e^(v − max) − mean(v − max): no
            // cancellation of large logits against lse. None without smoothing: a masked
            // (-inf) logit would make it 0 · inf = NaN.
            if smoothing != 0.0 {
                let mean_shifted = row.iter().map(|v| v - max).sum::<f64>() / c as f64;
                total += smoothing * (log_sum - mean_shifted);
            }
            for (k, (g, &v)) in grad[r * c..(r + 1) * c].iter_mut().zip(row).enumerate() {
                let hot = if k == t as usize {
                    1.0 - smoothing
                } else {
                    0.0
                };
                *g = scale * ((v - lse).exp() - hot - smoothing / c as f64);
            }
        }
        Ok((total * scale, grad))
    }

    /// (Log-)softmax of row-major `x` of `shape` along `axis`.
    pub fn softmax(x: &[f64], shape: &[usize], axis: usize, log: bool) -> Vec<f64> {
        let n = shape[axis];
        let inner: usize = shape[axis + 1..].iter().product();
        let outer: usize = shape[..axis].iter().product();
        let mut y = vec![0.0; x.len()];
        for o in 0..outer {
            for i in 0..inner {
                let at = |k: usize| (o * n + k) * inner + i;
                let max = (0..n).map(|k| x[at(k)]).fold(f64::NEG_INFINITY, f64::max);
                let sum: f64 = (0..n).map(|k| (x[at(k)] - max).exp()).sum();
                for k in 0..n {
                    y[at(k)] = if log {
                        x[at(k)] - max - sum.ln()
                    } else {
                        (x[at(k)] - max).exp() / sum
                    };
                }
            }
        }
        y
    }

    /// For each element of `index` (row-major, `index_shape`), the row-major position in a
    /// tensor of `shape` it addresses along `axis`.
    pub fn positions(
        shape: &[usize],
        index_shape: &[usize],
        axis: usize,
        index: &[f64],
    ) -> Result<Vec<usize>> {
        let strides = crate::layout::contiguous_strides(shape);
        let mut out = Vec::with_capacity(index.len());
        for (i, &k) in index.iter().enumerate() {
            if k < 0.0 || k as usize >= shape[axis] {
                return Err(TensorError::shape(format!(
                    "index {k} is out of range for axis {axis} of length {}",
                    shape[axis]
                )));
            }
            let (mut rest, mut at) = (i, 0);
            for d in (0..index_shape.len()).rev() {
                let coord = rest % index_shape[d];
                rest /= index_shape[d];
                at += if d == axis { k as usize } else { coord } * strides[d];
            }
            out.push(at);
        }
        Ok(out)
    }
}
