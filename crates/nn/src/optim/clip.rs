//! `torch.nn.utils.clip_grad_norm_` (L2), entirely on the device: no host synchronisation.

use redline_tensor::{no_grad, Result, Tensor};

/// Scales every gradient of `params` in place by `min(1, max_norm / (‖g‖₂ + 1e-6))`, ‖g‖₂ the
/// norm of all of them together, and returns that norm as a 0-d device tensor. Parameters
/// without a gradient are skipped; with none at all the norm is `None`.
pub fn clip_grad_norm(params: &[Tensor], max_norm: f64) -> Result<Option<Tensor>> {
    let grads: Vec<Tensor> = params.iter().filter_map(Tensor::grad).collect();
    let Some(first) = grads.first() else {
        return Ok(None);
    };
    no_grad(|| {
        let mut squares = first.mul(first)?.sum(&[], false)?;
        for g in &grads[1..] {
            squares = squares.add(&g.mul(g)?.sum(&[], false)?)?;
        }
        let norm = squares.sqrt()?;
        let coef = norm
            .add_scalar(1e-6)?
            .pow_scalar(-1.0)?
            .mul_scalar(max_norm)?;
        let coef = coef.minimum(&coef.scalar_like(1.0)?)?;
        for g in &grads {
            g.assign(&g.mul(&coef)?)?;
        }
        Ok(Some(norm))
    })
}
