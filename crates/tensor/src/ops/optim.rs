//! Multi-tensor optimizer and mixed-precision updates. They mutate storages in place and take the
//! found-inf flag as a device tensor, so a training step needs no host synchronisation
//! (DESIGN contract 8) and can be captured in a CUDA graph.

use crate::backend::{AdamWParams, Op, OptimOp, ScalerParams, SgdParams, Storage};
use crate::error::{Result, TensorError};
use crate::layout::Layout;
use crate::tensor::Tensor;

/// Every tensor must be a whole dense row-major storage on the first one's device and dtype,
/// with the shape of its partner in `like`.
fn whole<'a>(
    op: OptimOp,
    what: &str,
    tensors: &'a [&Tensor],
    like: &[&Tensor],
) -> Result<Vec<&'a Storage>> {
    let first = like.first().copied();
    tensors
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let partner = like.get(i).copied().or(first);
            let ok = t.layout().is_contiguous()
                && t.storage().len() == t.numel()
                && partner.is_none_or(|p| p.shape() == t.shape() && p.dtype() == t.dtype() && p.device() == t.device());
            if ok {
                Ok(&**t.storage())
            } else {
                Err(TensorError::shape(format!(
                    "{}: {what}[{i}] {:?} {} is not a whole contiguous tensor matching its parameter",
                    op.name(),
                    t.shape(),
                    t.dtype()
                )))
            }
        })
        .collect()
}

fn check_counts(op: OptimOp, counts: &[usize]) -> Result<()> {
    if counts.windows(2).any(|w| w[0] != w[1]) {
        return Err(TensorError::shape(format!(
            "{}: lists of different lengths {counts:?}",
            op.name()
        )));
    }
    Ok(())
}

fn flag<'a>(op: OptimOp, name: &str, t: &'a Tensor) -> Result<&'a Storage> {
    if t.numel() != 1 || !t.layout().is_contiguous() {
        return Err(TensorError::shape(format!(
            "{}: {name} must be a one-element tensor, got {:?}",
            op.name(),
            t.shape()
        )));
    }
    // Any float dtype, whatever the tensors' (each backend reads a scalar in its own); an
    // integer step or flag would be read as a float by some.
    if !t.dtype().is_float() {
        return Err(TensorError::shape(format!(
            "{}: {name} must be a float tensor, got {}",
            op.name(),
            t.dtype()
        )));
    }
    Ok(t.storage())
}

/// PyTorch's SGD step on every parameter at learning rate `lr[0] · p.lr_scale`, skipped
/// entirely when `found_inf` is non-zero. `step` counts the applied steps (the momentum
/// buffers are filled with the gradient on the first); `step` and `lr` are one-element device
/// tensors, so nothing that changes between steps is baked into the launch.
#[allow(clippy::too_many_arguments)]
pub fn sgd(
    params: &[&Tensor],
    grads: &[&Tensor],
    momentum: &[&Tensor],
    step: &Tensor,
    lr: &Tensor,
    p: &SgdParams,
    found_inf: Option<&Tensor>,
) -> Result<()> {
    let op = OptimOp::Sgd;
    let Some(first) = params.first() else {
        return Ok(());
    };
    let needs_buffers = p.momentum != 0.0;
    check_counts(
        op,
        &[
            params.len(),
            grads.len(),
            if needs_buffers {
                momentum.len()
            } else {
                params.len()
            },
        ],
    )?;
    first.device().check(Op::Optim(op), first.dtype())?;
    let ps = whole(op, "params", params, params)?;
    let gs = whole(op, "grads", grads, params)?;
    let bs = whole(op, "momentum", momentum, params)?;
    let (step, lr) = (flag(op, "step", step)?, flag(op, "lr", lr)?);
    let flag = found_inf.map(|f| flag(op, "found_inf", f)).transpose()?;
    first.backend().sgd(&ps, &gs, &bs, step, lr, p, flag)
}

/// PyTorch's AdamW step at learning rate `lr[0] · p.lr_scale` (the device-side `step` counts
/// only applied steps).
#[allow(clippy::too_many_arguments)]
pub fn adamw(
    params: &[&Tensor],
    grads: &[&Tensor],
    exp_avg: &[&Tensor],
    exp_avg_sq: &[&Tensor],
    step: &Tensor,
    lr: &Tensor,
    p: &AdamWParams,
    found_inf: Option<&Tensor>,
) -> Result<()> {
    let op = OptimOp::AdamW;
    let Some(first) = params.first() else {
        return Ok(());
    };
    check_counts(
        op,
        &[params.len(), grads.len(), exp_avg.len(), exp_avg_sq.len()],
    )?;
    first.device().check(Op::Optim(op), first.dtype())?;
    let ps = whole(op, "params", params, params)?;
    let gs = whole(op, "grads", grads, params)?;
    let ms = whole(op, "exp_avg", exp_avg, params)?;
    let vs = whole(op, "exp_avg_sq", exp_avg_sq, params)?;
    let (step, lr) = (flag(op, "step", step)?, flag(op, "lr", lr)?);
    let found = found_inf.map(|f| flag(op, "found_inf", f)).transpose()?;
    first
        .backend()
        .adamw(&ps, &gs, &ms, &vs, step, lr, p, found)
}

/// Multiplies every gradient by `inv_scale` in place and sets `found_inf` to 1 if any value is
/// inf or NaN (it is never cleared here, so several calls accumulate).
pub fn unscale_check(grads: &[&Tensor], inv_scale: &Tensor, found_inf: &Tensor) -> Result<()> {
    let op = OptimOp::UnscaleCheck;
    let Some(first) = grads.first() else {
        return Ok(());
    };
    first.device().check(Op::Optim(op), first.dtype())?;
    let gs = whole(op, "grads", grads, &[])?;
    first.backend().unscale_check(
        &gs,
        flag(op, "inv_scale", inv_scale)?,
        flag(op, "found_inf", found_inf)?,
    )
}

/// Σ x² over every element of `tensors` (whole contiguous tensors of one dtype, on one
/// device) as a `[1]` tensor of the stats dtype (f32; f64 for f64), in one multi-tensor pass:
/// the squared global norm of gradient clipping.
pub fn sum_squares(tensors: &[&Tensor]) -> Result<Tensor> {
    let op = OptimOp::SumSquares;
    let Some(first) = tensors.first() else {
        return Err(TensorError::shape("sum_squares of no tensors"));
    };
    first.device().check(Op::Optim(op), first.dtype())?;
    if let Some(other) =
        (tensors.iter()).find(|t| t.dtype() != first.dtype() || t.device() != first.device())
    {
        return Err(TensorError::shape(format!(
            "sum_squares: {} on {} beside {} on {}",
            other.dtype(),
            other.device().name(),
            first.dtype(),
            first.device().name()
        )));
    }
    let storages = whole(op, "tensors", tensors, &[])?;
    let out = first.backend().sum_squares(&storages)?;
    Ok(Tensor::from_storage(
        out,
        Layout::contiguous(&[1]),
        first.device().clone(),
    ))
}

/// GradScaler's scale update on the device; clears `found_inf` for the next step.
pub fn scaler_update(
    scale: &Tensor,
    growth_tracker: &Tensor,
    found_inf: &Tensor,
    p: &ScalerParams,
) -> Result<()> {
    let op = OptimOp::ScalerUpdate;
    scale.device().check(Op::Optim(op), scale.dtype())?;
    scale.backend().scaler_update(
        flag(op, "scale", scale)?,
        flag(op, "growth_tracker", growth_tracker)?,
        flag(op, "found_inf", found_inf)?,
        p,
    )
}

/// The reference updates, one element at a time in f64.
pub(crate) mod reference {
    use crate::backend::{AdamWParams, SgdParams};

    /// One SGD step of one element at learning rate `lr` (the device scalar times the group's
    /// scale), `first` on the first applied step: returns (param, momentum buffer).
    pub fn sgd(param: f64, grad: f64, buf: f64, lr: f64, first: bool, p: &SgdParams) -> (f64, f64) {
        let mut d = grad + p.weight_decay * param;
        let mut buf = buf;
        if p.momentum != 0.0 {
            buf = if first {
                d
            } else {
                p.momentum * buf + (1.0 - p.dampening) * d
            };
            d = if p.nesterov {
                d + p.momentum * buf
            } else {
                buf
            };
        }
        (param - lr * d, buf)
    }

    /// One AdamW step of one element at (already incremented) `step` and learning rate `lr`:
    /// (param, m, v).
    pub fn adamw(
        param: f64,
        grad: f64,
        m: f64,
        v: f64,
        step: f64,
        lr: f64,
        p: &AdamWParams,
    ) -> (f64, f64, f64) {
        let param = param * (1.0 - lr * p.weight_decay);
        let m = p.beta1 * m + (1.0 - p.beta1) * grad;
        let v = p.beta2 * v + (1.0 - p.beta2) * grad * grad;
        let bc1 = 1.0 - p.beta1.powf(step);
        let bc2 = 1.0 - p.beta2.powf(step);
        let denom = v.sqrt() / bc2.sqrt() + p.eps;
        (param - lr / bc1 * m / denom, m, v)
    }
}
