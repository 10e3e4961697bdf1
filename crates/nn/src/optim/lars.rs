//! LARS (You et al. 2017, as timm's `Lars` implements it): SGD with momentum whose update for
//! each parameter is scaled by a layer-wise trust ratio
//! `η·‖w‖ / (‖g + λw‖ + λ‖w‖ + ε)` (1 where either norm is zero).
//!
//! The trust ratios are computed on the device (a few reductions per parameter) and applied to
//! the decayed gradient; the momentum update is then the multi-tensor SGD op with no further
//! decay, so a skipped step (`found_inf`) leaves parameters and buffers untouched as SGD does.
//! Groups with `weight_decay == 0` (biases, normalisation weights) get plain SGD, the usual
//! LARS exclusion.

use redline_tensor::optim::sgd;
use redline_tensor::{no_grad, Result, SgdParams, Tensor};

use super::{named_steps, step_counts, with_grads, zeros_like, DeviceLr, ParamGroup};

pub struct Lars {
    pub groups: Vec<ParamGroup>,
    pub momentum: f64,
    pub nesterov: bool,
    /// η, the trust coefficient (timm's default 0.001).
    pub trust_coefficient: f64,
    pub eps: f64,
    buffers: Vec<Vec<Tensor>>,
    /// Applied steps per group, on the device (see `Sgd`).
    steps: Vec<Option<Tensor>>,
    pub(super) lr: DeviceLr,
}

impl Lars {
    pub fn new(groups: Vec<ParamGroup>, momentum: f64, nesterov: bool) -> Result<Self> {
        Ok(Self {
            buffers: zeros_like(&groups)?,
            steps: step_counts(&groups)?,
            lr: DeviceLr::new(&groups)?,
            groups,
            momentum,
            nesterov,
            trust_coefficient: 0.001,
            eps: 1e-8,
        })
    }

    /// One update at the device learning rate (times each group's `lr_scale`), skipped on the
    /// device when `found_inf` is set.
    pub fn update(&mut self, found_inf: Option<&Tensor>) -> Result<()> {
        let Some(lr) = self.lr.read()? else {
            return Ok(());
        };
        for ((group, buffers), step) in self.groups.iter().zip(&self.buffers).zip(&self.steps) {
            let Some(step) = step else { continue };
            let (indices, grads) = with_grads(group)?;
            let wd = group.weight_decay;
            let scaled: Vec<Tensor> = if wd == 0.0 {
                grads
            } else {
                no_grad(|| {
                    indices
                        .iter()
                        .zip(&grads)
                        .map(|(&i, g)| self.adapted(&group.params[i], g, wd))
                        .collect::<Result<_>>()
                })?
            };
            let p = SgdParams {
                lr_scale: group.lr_scale,
                momentum: self.momentum,
                dampening: 0.0,
                weight_decay: 0.0,
                nesterov: self.nesterov,
            };
            sgd(
                &indices
                    .iter()
                    .map(|&i| &group.params[i])
                    .collect::<Vec<_>>(),
                &scaled.iter().collect::<Vec<_>>(),
                &indices.iter().map(|&i| &buffers[i]).collect::<Vec<_>>(),
                step,
                lr,
                &p,
                found_inf,
            )?;
        }
        Ok(())
    }

    /// `(g + λw) · trust_ratio`, as a new whole tensor.
    fn adapted(&self, w: &Tensor, g: &Tensor, wd: f64) -> Result<Tensor> {
        let d = g.add(&w.mul_scalar(wd)?)?;
        let norm = |t: &Tensor| t.mul(t)?.sum(&[], false)?.sqrt();
        let (w_norm, d_norm) = (norm(w)?, norm(&d)?);
        let ratio = w_norm
            .mul_scalar(self.trust_coefficient)?
            .div(&d_norm.add(&w_norm.mul_scalar(wd)?)?.add_scalar(self.eps)?)?;
        let one = ratio.scalar_like(1.0)?;
        let both = w_norm.gt_scalar(0.0)?.mul(&d_norm.gt_scalar(0.0)?)?;
        let ratio = Tensor::where_(&both, &ratio, &one)?;
        d.mul(&ratio)?.contiguous_copy()
    }

    /// Nothing to restore: the step counts are device state, in `state()`.
    pub fn state_loaded(&mut self, _steps_taken: u64) {}

    /// The momentum buffers, named `group.index`, and the step counts (for checkpoints).
    pub fn state(&self) -> Vec<(String, Tensor)> {
        let mut out = super::named_buffers("momentum_buffer", &self.buffers);
        out.extend(named_steps(&self.steps));
        out
    }
}
