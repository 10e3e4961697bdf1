//! Batch norm and layer norm, composed from the primitive ops (so every backend gets
//! them, forward and backward, from its primitives; fused kernels can replace them later).

use crate::autograd::no_grad;
use crate::backend::{stats_dtype, BatchNormCoefParams, BinaryOp, NnOp, Op};
use crate::dtype::DType;
use crate::error::{Result, TensorError};
use crate::layout::Layout;
use crate::tensor::Tensor;

/// Batch norm's running statistics, updated in place in training mode.
pub struct RunningStats<'a> {
    pub mean: &'a Tensor,
    pub var: &'a Tensor,
    /// PyTorch's `momentum` (default 0.1): `running = (1 - m) · running + m · batch`.
    pub momentum: f64,
}

impl Tensor {
    /// Batch norm over `[N, C, ..]` with per-channel `weight` and `bias` (`[C]`). Training
    /// normalises by the batch statistics and updates `running` (PyTorch's unbiased running
    /// variance); evaluation normalises by `running`.
    pub fn batch_norm(
        &self,
        weight: Option<&Tensor>,
        bias: Option<&Tensor>,
        running: Option<RunningStats<'_>>,
        training: bool,
        eps: f64,
    ) -> Result<Tensor> {
        if self.rank() < 2 {
            return Err(TensorError::shape(format!(
                "batch_norm needs [N, C, ..], got {:?}",
                self.shape()
            )));
        }
        let c = self.shape()[1];
        if training && self.fused_batch_norm() {
            return self.batch_norm_fused(weight, bias, running, eps, None, false);
        }
        let mut stat_shape = vec![1; self.rank()];
        stat_shape[1] = c;
        let axes: Vec<usize> = (0..self.rank()).filter(|&a| a != 1).collect();
        let (mean, var) = if training {
            let mean = self.mean(&axes, true)?;
            let var = self.var(&axes, 0, true)?;
            if let Some(r) = &running {
                let n: usize = axes.iter().map(|&a| self.shape()[a]).product();
                let unbiased = n as f64 / (n.max(2) - 1) as f64;
                no_grad(|| -> Result<()> {
                    let update = |stat: &Tensor, batch: &Tensor, scale: f64| -> Result<()> {
                        let batch = batch.reshape(&[c])?.mul_scalar(scale * r.momentum)?;
                        let new = stat.mul_scalar(1.0 - r.momentum)?.add(&batch)?;
                        stat.write_region(&Layout::contiguous(stat.shape()), &new)
                    };
                    update(r.mean, &mean, 1.0)?;
                    update(r.var, &var, unbiased)
                })?;
            }
            (mean, var)
        } else {
            let r = running.ok_or_else(|| {
                TensorError::shape("batch_norm in eval mode needs running statistics")
            })?;
            (r.mean.reshape(&stat_shape)?, r.var.reshape(&stat_shape)?)
        };
        let mut y = self.sub(&mean)?.mul(&var.add_scalar(eps)?.rsqrt()?)?;
        if let Some(w) = weight {
            y = y.mul(&w.reshape(&stat_shape)?)?;
        }
        if let Some(b) = bias {
            y = y.add(&b.reshape(&stat_shape)?)?;
        }
        Ok(y)
    }

    /// Per-channel sums over every axis but 1: `[2, C]` holding `[Σx, Σx²]`, or with `y`
    /// `[Σy, Σx·y]`, as f32 (f64 for f64). One pass; no gradient. Batch norm's building block.
    /// With `gate` (`[2, C]` `[a; b]`, only with `y`), y counts only where `a·x + b > 0`; with
    /// `centre` (`[C]` of the same dtype as the sums), the sums are of `x − centre[c]`: the
    /// backward's Σ(x − mean)·g ([`crate::Backend::batch_norm_stats`]).
    pub fn batch_norm_stats(
        &self,
        y: Option<&Tensor>,
        gate: Option<&Tensor>,
        centre: Option<&Tensor>,
    ) -> Result<Tensor> {
        const OP: &str = "batch_norm_stats";
        self.check_channels(OP, y)?;
        let gate = self.check_gate(OP, y, gate)?;
        let c = self.shape()[1];
        Self::check_per_channel(OP, self, self.dtype(), c, &[centre])?;
        self.device()
            .check(Op::Nn(NnOp::BatchNormStats), self.dtype())?;
        let centre = centre.map(Tensor::contiguous).transpose()?;
        let storage = self.backend().batch_norm_stats(
            self.view(),
            y.map(|y| y.view()),
            gate.as_ref().map(|g| g.view()),
            centre.as_ref().map(Tensor::view),
        )?;
        Ok(Tensor::from_storage(
            storage,
            Layout::contiguous(&[2, c]),
            self.device().clone(),
        ))
    }

    /// `relu(bn(x) + residual)` — batch norm as [`Tensor::batch_norm`], plus an optional
    /// residual of x's shape, then ReLU: ResNet's `bn → relu` and `bn → add → relu` — in one
    /// pass over the data in training mode on backends with the fused batch-norm ops (one
    /// output written instead of three), composed otherwise. The gradient is the composition's.
    #[allow(clippy::too_many_arguments)]
    pub fn batch_norm_relu(
        &self,
        weight: Option<&Tensor>,
        bias: Option<&Tensor>,
        running: Option<RunningStats<'_>>,
        training: bool,
        eps: f64,
        residual: Option<&Tensor>,
    ) -> Result<Tensor> {
        if let Some(r) = residual {
            if r.shape() != self.shape() {
                return Err(TensorError::shape(format!(
                    "batch_norm_relu: residual {:?} for input {:?}",
                    r.shape(),
                    self.shape()
                )));
            }
        }
        if training && self.fused_batch_norm() && residual.is_none_or(|r| r.dtype() == self.dtype())
        {
            return self.batch_norm_fused(weight, bias, running, eps, residual, true);
        }
        let y = self.batch_norm(weight, bias, running, training, eps)?;
        match residual {
            Some(r) => y.add(r)?.relu(),
            None => y.relu(),
        }
    }

    /// Whether this backend computes batch norm's per-channel coefficients in one launch each
    /// way for this dtype, with the statistics in the same call (the last two are by default
    /// `batch_norm_stats` then one of the first two).
    fn coef_ops(&self) -> bool {
        [
            NnOp::BatchNormCoef,
            NnOp::BatchNormGradCoef,
            NnOp::BatchNormStatsCoef,
            NnOp::BatchNormGradStatsCoef,
        ]
        .iter()
        .all(|&op| self.device().backend().supports(Op::Nn(op), self.dtype()))
    }

    /// Whether training batch norm runs fused on this tensor: its backend has the two fused
    /// batch-norm ops for its dtype (statistics and coefficients in f32 for half types, the
    /// output in its dtype).
    pub fn fused_batch_norm(&self) -> bool {
        [NnOp::BatchNormStats, NnOp::BatchNormApply]
            .iter()
            .all(|&op| self.device().backend().supports(Op::Nn(op), self.dtype()))
    }

    /// `coef[0, c]·x + coef[1, c] (+ coef[2, c]·y)` per channel, then `max(·, 0)` where `relu`,
    /// in x's dtype and memory order; `coef` is `[3, C]` of f32 (f64 for f64). One pass; no
    /// gradient. With `gate` (`[2, C]` `[a; b]`, only with `y`), y counts only where
    /// `a·x + b > 0` ([`crate::Backend::batch_norm_apply`]).
    pub fn batch_norm_apply(
        &self,
        y: Option<&Tensor>,
        coef: &Tensor,
        relu: bool,
        gate: Option<&Tensor>,
    ) -> Result<Tensor> {
        self.check_channels("batch_norm_apply", y)?;
        let gate = self.check_gate("batch_norm_apply", y, gate)?;
        let c = self.shape()[1];
        let want = stats_dtype(self.dtype());
        if coef.shape() != [3, c] || coef.dtype() != want {
            return Err(TensorError::shape(format!(
                "batch_norm_apply: coefficients {} {:?} for {:?} (need {want} [3, {c}])",
                coef.dtype(),
                coef.shape(),
                self.shape()
            )));
        }
        self.same_device(coef, "batch_norm_apply")?;
        self.device()
            .check(Op::Nn(NnOp::BatchNormApply), self.dtype())?;
        let coef = coef.contiguous()?;
        let out = self.layout().output_like();
        let storage = self.backend().batch_norm_apply(
            self.view(),
            y.map(|y| y.view()),
            coef.view(),
            relu,
            gate.as_ref().map(|g| g.view()),
            &out,
        )?;
        Ok(Tensor::from_storage(storage, out, self.device().clone()))
    }

    /// Batch norm's forward coefficients for activations of `dtype`
    /// ([`crate::Backend::batch_norm_coef`]): `(coef [3, C], saved [2, C] = [mean; rstd])` from
    /// `sums` ([`Tensor::batch_norm_stats`]) and the `centre` they were taken about, updating
    /// `running` (`(mean, var)`) in place. Every operand is `[C]` (`sums` `[2, C]`) of
    /// [`stats_dtype`]`(dtype)`. No gradient.
    pub fn batch_norm_coef(
        sums: &Tensor,
        centre: Option<&Tensor>,
        dtype: DType,
        weight: Option<&Tensor>,
        bias: Option<&Tensor>,
        running: Option<(&Tensor, &Tensor)>,
        p: &BatchNormCoefParams,
    ) -> Result<(Tensor, Tensor)> {
        let per_channel = [centre, weight, bias];
        let c = Self::check_coef_operands("batch_norm_coef", sums, dtype, &per_channel)?;
        Self::check_running("batch_norm_coef", sums, dtype, c, running)?;
        sums.device().check(Op::Nn(NnOp::BatchNormCoef), dtype)?;
        let dense = |t: Option<&Tensor>| t.map(Tensor::contiguous).transpose();
        let (sums, centre) = (sums.contiguous()?, dense(centre)?);
        let (weight, bias) = (dense(weight)?, dense(bias)?);
        let (coef, saved) = sums.backend().batch_norm_coef(
            sums.view(),
            centre.as_ref().map(Tensor::view),
            weight.as_ref().map(Tensor::view),
            bias.as_ref().map(Tensor::view),
            running.map(|(m, v)| (&**m.storage(), &**v.storage())),
            p,
        )?;
        let device = sums.device().clone();
        Ok((
            Tensor::from_storage(coef, Layout::contiguous(&[3, c]), device.clone()),
            Tensor::from_storage(saved, Layout::contiguous(&[2, c]), device),
        ))
    }

    /// [`Tensor::batch_norm_stats`] of this tensor alone, then [`Tensor::batch_norm_coef`] of
    /// its sums, both about each channel's first element, in one backend call
    /// ([`crate::Backend::batch_norm_stats_coef`]: on CUDA the sums are never written). The
    /// same checks, and the bits of the two calls given those first elements (as the stats
    /// dtype) for their centre.
    pub fn batch_norm_stats_coef(
        &self,
        weight: Option<&Tensor>,
        bias: Option<&Tensor>,
        running: Option<(&Tensor, &Tensor)>,
        p: &BatchNormCoefParams,
    ) -> Result<(Tensor, Tensor)> {
        const OP: &str = "batch_norm_stats_coef";
        self.check_channels(OP, None)?;
        let (dtype, c) = (self.dtype(), self.shape()[1]);
        Self::check_per_channel(OP, self, dtype, c, &[weight, bias])?;
        Self::check_running(OP, self, dtype, c, running)?;
        self.device()
            .check(Op::Nn(NnOp::BatchNormStatsCoef), dtype)?;
        let dense = |t: Option<&Tensor>| t.map(Tensor::contiguous).transpose();
        let (weight, bias) = (dense(weight)?, dense(bias)?);
        let (coef, saved) = self.backend().batch_norm_stats_coef(
            self.view(),
            weight.as_ref().map(Tensor::view),
            bias.as_ref().map(Tensor::view),
            running.map(|(m, v)| (&**m.storage(), &**v.storage())),
            p,
        )?;
        let device = self.device().clone();
        Ok((
            Tensor::from_storage(coef, Layout::contiguous(&[3, c]), device.clone()),
            Tensor::from_storage(saved, Layout::contiguous(&[2, c]), device),
        ))
    }

    /// [`Tensor::batch_norm_stats`] of this tensor with the gradient `g` (and `gate`), then
    /// [`Tensor::batch_norm_grad_coef`] of those sums, in one backend call
    /// ([`crate::Backend::batch_norm_grad_stats_coef`]).
    pub fn batch_norm_grad_stats_coef(
        &self,
        g: &Tensor,
        gate: Option<&Tensor>,
        saved: &Tensor,
        weight: Option<&Tensor>,
        count: f64,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        const OP: &str = "batch_norm_grad_stats_coef";
        self.check_channels(OP, Some(g))?;
        let gate = self.check_gate(OP, Some(g), gate)?;
        let (dtype, c) = (self.dtype(), self.shape()[1]);
        Self::check_per_channel(OP, self, dtype, c, &[weight])?;
        let sd = stats_dtype(dtype);
        if saved.shape() != [2, c] || saved.dtype() != sd {
            return Err(TensorError::shape(format!(
                "{OP}: saved statistics {} {:?} for {c} channels (need {sd} [2, {c}])",
                saved.dtype(),
                saved.shape()
            )));
        }
        self.same_device(saved, OP)?;
        self.device()
            .check(Op::Nn(NnOp::BatchNormGradStatsCoef), dtype)?;
        let (saved, weight) = (
            saved.contiguous()?,
            weight.map(Tensor::contiguous).transpose()?,
        );
        let (coef, dw, db) = self.backend().batch_norm_grad_stats_coef(
            self.view(),
            g.view(),
            gate.as_ref().map(Tensor::view),
            saved.view(),
            weight.as_ref().map(Tensor::view),
            count,
        )?;
        let device = self.device().clone();
        let channel = |s| Tensor::from_storage(s, Layout::contiguous(&[c]), device.clone());
        Ok((
            Tensor::from_storage(coef, Layout::contiguous(&[3, c]), device.clone()),
            channel(dw),
            channel(db),
        ))
    }

    /// Batch norm's backward coefficients for activations of `dtype`
    /// ([`crate::Backend::batch_norm_grad_coef`]): `(coef [3, C], dw [C], db [C])` from `sums`
    /// `[Σg; Σ(x−mean)·g]` ([`Tensor::batch_norm_stats`] centred on `saved`'s mean), the
    /// forward's `saved` and the optional `weight`, over `count` elements a channel. No
    /// gradient.
    pub fn batch_norm_grad_coef(
        sums: &Tensor,
        dtype: DType,
        saved: &Tensor,
        weight: Option<&Tensor>,
        count: f64,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let c = Self::check_coef_operands("batch_norm_grad_coef", sums, dtype, &[weight])?;
        if saved.shape() != [2, c] || saved.dtype() != sums.dtype() {
            return Err(TensorError::shape(format!(
                "batch_norm_grad_coef: saved statistics {} {:?} for sums {} [2, {c}]",
                saved.dtype(),
                saved.shape(),
                sums.dtype()
            )));
        }
        sums.same_device(saved, "batch_norm_grad_coef")?;
        sums.device()
            .check(Op::Nn(NnOp::BatchNormGradCoef), dtype)?;
        let (sums, saved) = (sums.contiguous()?, saved.contiguous()?);
        let weight = weight.map(Tensor::contiguous).transpose()?;
        let (coef, dw, db) = sums.backend().batch_norm_grad_coef(
            sums.view(),
            saved.view(),
            weight.as_ref().map(Tensor::view),
            count,
        )?;
        let device = sums.device().clone();
        let channel = |s| Tensor::from_storage(s, Layout::contiguous(&[c]), device.clone());
        Ok((
            Tensor::from_storage(coef, Layout::contiguous(&[3, c]), device.clone()),
            channel(dw),
            channel(db),
        ))
    }

    /// Checks a coefficient op's `sums` (`[2, C]` of the stats dtype of `dtype`) and its
    /// per-channel operands (`[C]` of that dtype, on its device); returns C.
    fn check_coef_operands(
        op: &str,
        sums: &Tensor,
        dtype: DType,
        per_channel: &[Option<&Tensor>],
    ) -> Result<usize> {
        let sd = stats_dtype(dtype);
        let c = sums.shape().get(1).copied().unwrap_or(0);
        if sums.shape() != [2, c] || sums.dtype() != sd || !dtype.is_float() {
            return Err(TensorError::shape(format!(
                "{op}: sums {} {:?} for {dtype} activations (need {sd} [2, C])",
                sums.dtype(),
                sums.shape()
            )));
        }
        Self::check_per_channel(op, sums, dtype, c, per_channel)?;
        Ok(c)
    }

    /// Checks per-channel operands of a coefficient op for `c` channels of `dtype` activations:
    /// `[C]` of its stats dtype, on `like`'s device.
    fn check_per_channel(
        op: &str,
        like: &Tensor,
        dtype: DType,
        c: usize,
        per_channel: &[Option<&Tensor>],
    ) -> Result<()> {
        let sd = stats_dtype(dtype);
        for t in per_channel.iter().flatten() {
            like.same_device(t, op)?;
            if t.shape() != [c] || t.dtype() != sd {
                return Err(TensorError::shape(format!(
                    "{op}: a per-channel operand {} {:?} (need {sd} [{c}])",
                    t.dtype(),
                    t.shape()
                )));
            }
        }
        Ok(())
    }

    /// Checks the running statistics a coefficient op updates in place: per-channel operands
    /// ([`Tensor::check_per_channel`]), each a whole contiguous tensor of its own.
    fn check_running(
        op: &str,
        like: &Tensor,
        dtype: DType,
        c: usize,
        running: Option<(&Tensor, &Tensor)>,
    ) -> Result<()> {
        let Some((m, v)) = running else {
            return Ok(());
        };
        Self::check_per_channel(op, like, dtype, c, &[Some(m), Some(v)])?;
        let whole = |t: &Tensor| {
            t.layout().is_contiguous() && t.layout().offset() == 0 && t.storage().len() == c
        };
        if !whole(m) || !whole(v) {
            return Err(TensorError::shape(format!(
                "{op}: running statistics are updated in place: each must be a whole \
                 contiguous tensor of its own"
            )));
        }
        Ok(())
    }

    /// A gate for `op`: only beside `y`, `[2, C]` of the stats dtype on x's device; made
    /// contiguous.
    fn check_gate(
        &self,
        op: &str,
        y: Option<&Tensor>,
        gate: Option<&Tensor>,
    ) -> Result<Option<Tensor>> {
        let Some(gate) = gate else { return Ok(None) };
        let (c, want) = (self.shape()[1], stats_dtype(self.dtype()));
        if y.is_none() {
            return Err(TensorError::shape(format!(
                "{op}: a gate masks the second operand, and there is none"
            )));
        }
        if gate.shape() != [2, c] || gate.dtype() != want {
            return Err(TensorError::shape(format!(
                "{op}: gate {} {:?} for {:?} (need {want} [2, {c}])",
                gate.dtype(),
                gate.shape(),
                self.shape()
            )));
        }
        self.same_device(gate, op)?;
        gate.contiguous().map(Some)
    }

    fn check_channels(&self, op: &str, y: Option<&Tensor>) -> Result<()> {
        if self.rank() < 2 || !self.dtype().is_float() {
            return Err(TensorError::shape(format!(
                "{op} needs a float [N, C, ..], got {} {:?}",
                self.dtype(),
                self.shape()
            )));
        }
        if let Some(y) = y {
            self.same_device(y, op)?;
            self.same_dtype(y, op)?;
            if y.shape() != self.shape() {
                return Err(TensorError::shape(format!(
                    "{op}: second operand {:?} for {:?}",
                    y.shape(),
                    self.shape()
                )));
            }
        }
        Ok(())
    }

    /// Training-mode batch norm in four passes over the data (statistics, normalisation; in
    /// backward, the two reductions and the input gradient), instead of the ~30 of the
    /// composition: the fused path for backends that declare the two batch-norm ops. With
    /// `relu`, `relu(bn(x) + residual)` in the same normalisation pass; its backward masks
    /// the gradient by the output (`> 0` exactly where the ReLU's input was) first.
    fn batch_norm_fused(
        &self,
        weight: Option<&Tensor>,
        bias: Option<&Tensor>,
        running: Option<RunningStats<'_>>,
        eps: f64,
        residual: Option<&Tensor>,
        relu: bool,
    ) -> Result<Tensor> {
        let c = self.shape()[1];
        let n = (self.numel() / c.max(1)) as f64;
        let sd = stats_dtype(self.dtype());
        let x = self.detach();
        let row = move |t: &Tensor, i: usize| t.narrow(0, i, 1)?.reshape(&[c]);
        let w = weight.map(|w| w.detach().cast(sd)).transpose()?;
        let b = bias.map(|b| b.detach().cast(sd)).transpose()?;
        // One launch for the per-channel math where the backend has it (and the running
        // statistics are of the stats dtype, as they are in a network): ~30 otherwise.
        let coef_op = self.coef_ops()
            && running
                .as_ref()
                .is_none_or(|r| r.mean.dtype() == sd && r.var.dtype() == sd);
        let (coef, saved) = no_grad(|| -> Result<_> {
            if coef_op {
                let p = BatchNormCoefParams {
                    count: n,
                    eps,
                    momentum: running.as_ref().map_or(0.0, |r| r.momentum),
                    residual: residual.is_some(),
                };
                let stats = running.as_ref().map(|r| (r.mean, r.var));
                return x.batch_norm_stats_coef(w.as_ref(), b.as_ref(), stats, &p);
            }
            // The sums about each channel's first element (0 where it is not finite), as the
            // one-launch path takes them (`BatchNormCoefParams::host`): mean = k + d,
            // var = Σ(x−k)²/n − d².
            let shift = match x.numel() {
                0 => None,
                _ => {
                    let mut first = x.clone();
                    for axis in (0..x.rank()).filter(|&a| a != 1) {
                        first = first.narrow(axis, 0, 1)?;
                    }
                    let k = first.reshape(&[c])?.cast(sd)?;
                    let zero = k.scalar_like(0.0)?;
                    let finite = k.sub(&k)?.eq(&zero)?;
                    Some(Tensor::where_(&finite, &k, &zero)?)
                }
            };
            let sums = x.batch_norm_stats(None, None, shift.as_ref())?;
            let offset = row(&sums, 0)?.mul_scalar(1.0 / n)?;
            let var = row(&sums, 1)?
                .mul_scalar(1.0 / n)?
                .sub(&offset.mul(&offset)?)?
                .maximum(&offset.scalar_like(0.0)?)?;
            let mean = match &shift {
                Some(k) => k.add(&offset)?,
                None => offset,
            };
            if let Some(r) = &running {
                let unbiased = n / (n.max(2.0) - 1.0);
                let update = |stat: &Tensor, batch: &Tensor, scale: f64| -> Result<()> {
                    let batch = batch.cast(stat.dtype())?.mul_scalar(scale * r.momentum)?;
                    let new = stat
                        .mul_scalar(1.0 - r.momentum)?
                        .add(&batch.reshape(stat.shape())?)?;
                    stat.write_region(&Layout::contiguous(stat.shape()), &new)
                };
                update(r.mean, &mean, 1.0)?;
                update(r.var, &var, unbiased)?;
            }
            let rstd = var.add_scalar(eps)?.rsqrt()?;
            let scale = match &w {
                Some(w) => rstd.mul(&w.reshape(&[c])?)?,
                None => rstd.clone(),
            };
            let mut shift = mean.mul(&scale)?.neg()?;
            if let Some(b) = &b {
                shift = shift.add(&b.reshape(&[c])?)?;
            }
            let residual_scale = scale.scalar_like(if residual.is_some() { 1.0 } else { 0.0 })?;
            let coef = Tensor::stack(&[&scale, &shift, &residual_scale.broadcast_to(&[c])?], 0)?;
            Ok((coef, Tensor::stack(&[&mean, &rstd], 0)?))
        })?;
        let r = residual.map(Tensor::detach);
        let y = x.batch_norm_apply(r.as_ref(), &coef, relu, None)?;
        let mut inputs = vec![self];
        inputs.extend(weight);
        inputs.extend(bias);
        inputs.extend(residual);
        let (has_w, has_b, has_r) = (weight.is_some(), bias.is_some(), residual.is_some());
        let (w_dtype, b_dtype) = (weight.map(|t| t.dtype()), bias.map(|t| t.dtype()));
        // The ReLU's mask in backward. Without a residual, `scale·x + shift > 0` recomputed
        // from x inside the two backward passes (the gate: no read of the output, no masked
        // gradient written — a pass fewer); with one, the residual's gradient is the masked
        // gradient itself, so it is written, from the output (without its graph).
        let gate = (relu && !has_r).then(|| coef.narrow(0, 0, 2)).transpose()?;
        let out = (relu && has_r).then(|| y.detach());
        Ok(y.record("batch_norm", &inputs, move |g| {
            let masked = out
                .as_ref()
                .map(|z| z.binary(BinaryOp::ReluGrad, g))
                .transpose()?;
            // A gated g is read where the masked copy would have been written: in x's memory
            // order, so the sums run in the composition's order (the same bits). A network's
            // gradient already is; a copy only otherwise.
            let relaid = match gate.is_some().then(|| x.layout().output_like()) {
                Some(like_x) if g.layout() != &like_x => Some(g.convert_to(g.dtype(), like_x)?),
                _ => None,
            };
            let g = masked.as_ref().or(relaid.as_ref()).unwrap_or(g);
            let gate = gate.as_ref();
            let (coef, dw, db) = if coef_op {
                x.batch_norm_grad_stats_coef(g, gate, &saved, w.as_ref(), n)?
            } else {
                let (mean, rstd) = (row(&saved, 0)?, row(&saved, 1)?);
                let sums = x.batch_norm_stats(Some(g), gate, Some(&mean))?;
                let (sum_g, centred) = (row(&sums, 0)?, row(&sums, 1)?);
                // The input gradient's per-channel coefficients from Σg and Σ(x - mean)·g:
                // dx = rstd·w·g + k0·x + k1 with k0 = -rstd³·w·Σ(x-mean)g / n,
                // k1 = -rstd·w·Σg / n - mean·k0.
                let rw = match &w {
                    Some(w) => rstd.mul(&w.reshape(&[c])?)?,
                    None => rstd.clone(),
                };
                let k0 = rw
                    .mul(&rstd)?
                    .mul(&rstd)?
                    .mul(&centred)?
                    .mul_scalar(-1.0 / n)?;
                let k1 = rw.mul(&sum_g)?.mul_scalar(-1.0 / n)?.sub(&mean.mul(&k0)?)?;
                let coef = Tensor::stack(&[&k0, &k1, &rw], 0)?;
                (coef, rstd.mul(&centred)?, sum_g)
            };
            let dx = x.batch_norm_apply(Some(g), &coef, false, gate)?;
            let mut grads = vec![Some(dx)];
            if has_w {
                grads.push(Some(dw.cast(w_dtype.unwrap_or(sd))?));
            }
            if has_b {
                grads.push(Some(db.cast(b_dtype.unwrap_or(sd))?));
            }
            if has_r {
                // (With a residual there is no gate: g is already masked.)
                grads.push(Some(g.clone()));
            }
            Ok(grads)
        }))
    }

    /// Layer norm over the trailing `normalized` axes, with optional elementwise affine.
    pub fn layer_norm(
        &self,
        normalized: usize,
        weight: Option<&Tensor>,
        bias: Option<&Tensor>,
        eps: f64,
    ) -> Result<Tensor> {
        if normalized == 0 || normalized > self.rank() {
            return Err(TensorError::shape(format!(
                "layer_norm over the last {normalized} axes of {:?}",
                self.shape()
            )));
        }
        let axes: Vec<usize> = (self.rank() - normalized..self.rank()).collect();
        let mean = self.mean(&axes, true)?;
        let var = self.var(&axes, 0, true)?;
        let mut y = self.sub(&mean)?.mul(&var.add_scalar(eps)?.rsqrt()?)?;
        if let Some(w) = weight {
            y = y.mul(w)?;
        }
        if let Some(b) = bias {
            y = y.add(b)?;
        }
        Ok(y)
    }
}

/// The reference batch-norm kernels.
pub(crate) mod batch_norm_reference {
    /// `[Σx, Σx²]` (or `[Σy, Σx·y]`) per channel of row-major `x` of `shape` (`[N, C, ..]`),
    /// of `x − centre[c]` in place of x when given.
    pub fn stats(
        x: &[f64],
        y: Option<&[f64]>,
        centre: Option<&[f64]>,
        shape: &[usize],
    ) -> Vec<f64> {
        let c = shape[1];
        let inner: usize = shape[2..].iter().product();
        let mut out = vec![0.0; 2 * c];
        for (i, &v) in x.iter().enumerate() {
            let k = (i / inner.max(1)) % c.max(1);
            let v = v - centre.map_or(0.0, |m| m[k]);
            let other = y.map_or(v, |y| y[i]);
            out[k] += other;
            out[c + k] += v * other;
        }
        out
    }
}
