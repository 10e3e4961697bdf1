//! `torch.nn.utils.clip_grad_norm_` (L2), entirely on the device: no host synchronisation.

use redline_tensor::{no_grad, optim, Op, OptimOp, Result, Tensor};

/// Scales every gradient of `params` in place by `min(1, max_norm / (‖g‖₂ + 1e-6))`, ‖g‖₂ the
/// norm of all of them together, and returns that norm as a 0-d device tensor. Parameters
/// without a gradient are skipped; with none at all the norm is `None`.
///
/// Where the device has the multi-tensor ops and the gradients share a dtype (as in a network)
/// it is a handful of launches whatever the parameter count: one pass for Σg² over every
/// gradient ([`optim::sum_squares`]), a few on the scalar, and one multi-tensor scale
/// ([`optim::unscale_check`], whose finiteness flag it discards). Otherwise a few ops per
/// gradient, as before.
pub fn clip_grad_norm(params: &[Tensor], max_norm: f64) -> Result<Option<Tensor>> {
    let grads: Vec<Tensor> = params.iter().filter_map(Tensor::grad).collect();
    let Some(first) = grads.first() else {
        return Ok(None);
    };
    let backend = first.device().backend();
    let multi = [OptimOp::SumSquares, OptimOp::UnscaleCheck]
        .iter()
        .all(|&op| backend.supports(Op::Optim(op), first.dtype()))
        && grads.iter().all(|g| g.dtype() == first.dtype());
    no_grad(|| {
        let squares = if multi {
            let all: Vec<&Tensor> = grads.iter().collect();
            optim::sum_squares(&all)?.reshape(&[])?
        } else {
            let mut squares = first.mul(first)?.sum(&[], false)?;
            for g in &grads[1..] {
                squares = squares.add(&g.mul(g)?.sum(&[], false)?)?;
            }
            squares
        };
        let norm = squares.sqrt()?;
        let coef = norm
            .add_scalar(1e-6)?
            .pow_scalar(-1.0)?
            .mul_scalar(max_norm)?;
        let coef = coef.minimum(&coef.scalar_like(1.0)?)?;
        if multi {
            let all: Vec<&Tensor> = grads.iter().collect();
            let unused = coef.scalar_like(0.0)?;
            optim::unscale_check(&all, &coef.reshape(&[1])?, &unused.reshape(&[1])?)?;
        } else {
            for g in &grads {
                g.assign(&g.mul(&coef)?)?;
            }
        }
        Ok(Some(norm))
    })
}
