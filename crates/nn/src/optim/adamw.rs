//! `torch.optim.AdamW`: decoupled weight decay, bias-corrected moments, a device-side step count
//! that only applied steps advance.

use redline_tensor::optim::adamw;
use redline_tensor::{AdamWParams, Result, Tensor};

use super::{named_steps, step_counts, with_grads, zeros_like, DeviceLr, ParamGroup};

pub struct AdamW {
    pub groups: Vec<ParamGroup>,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    exp_avg: Vec<Vec<Tensor>>,
    exp_avg_sq: Vec<Vec<Tensor>>,
    /// One-element step counts, one per group (none for an empty group), on the device.
    steps: Vec<Option<Tensor>>,
    pub(super) lr: DeviceLr,
}

impl AdamW {
    pub fn new(groups: Vec<ParamGroup>, beta1: f64, beta2: f64, eps: f64) -> Result<Self> {
        Ok(Self {
            steps: step_counts(&groups)?,
            lr: DeviceLr::new(&groups)?,
            exp_avg: zeros_like(&groups)?,
            exp_avg_sq: zeros_like(&groups)?,
            groups,
            beta1,
            beta2,
            eps,
        })
    }

    /// One update at the device learning rate (times each group's `lr_scale`), skipped on the
    /// device when `found_inf` is set (moments and step counts unchanged).
    pub fn update(&mut self, found_inf: Option<&Tensor>) -> Result<()> {
        let Some(lr) = self.lr.read()? else {
            return Ok(());
        };
        for (((group, m), v), step) in self
            .groups
            .iter()
            .zip(&self.exp_avg)
            .zip(&self.exp_avg_sq)
            .zip(&self.steps)
        {
            let Some(step) = step else { continue };
            let (indices, grads) = with_grads(group)?;
            let p = AdamWParams {
                lr_scale: group.lr_scale,
                beta1: self.beta1,
                beta2: self.beta2,
                eps: self.eps,
                weight_decay: group.weight_decay,
            };
            adamw(
                &pick(&group.params, &indices),
                &grads.iter().collect::<Vec<_>>(),
                &pick(m, &indices),
                &pick(v, &indices),
                step,
                lr,
                &p,
                found_inf,
            )?;
        }
        Ok(())
    }

    /// Nothing to restore: the step counts are device state, in `state()`.
    pub fn state_loaded(&mut self, _steps_taken: u64) {}

    /// Moments and step counts, named by group and index (for checkpoints).
    pub fn state(&self) -> Vec<(String, Tensor)> {
        let mut out = Vec::new();
        for (g, (m, v)) in self.exp_avg.iter().zip(&self.exp_avg_sq).enumerate() {
            for (i, (m, v)) in m.iter().zip(v).enumerate() {
                out.push((format!("exp_avg.{g}.{i}"), m.clone()));
                out.push((format!("exp_avg_sq.{g}.{i}"), v.clone()));
            }
        }
        out.extend(named_steps(&self.steps));
        out
    }
}

/// The tensors of `ts` at `indices` (the parameters that have a gradient).
fn pick<'a>(ts: &'a [Tensor], indices: &[usize]) -> Vec<&'a Tensor> {
    indices.iter().map(|&i| &ts[i]).collect()
}
