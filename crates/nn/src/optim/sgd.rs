//! `torch.optim.SGD`: momentum, dampening, Nesterov, per-group weight decay.

use redline_tensor::optim::sgd;
use redline_tensor::{Result, SgdParams, Tensor};

use super::{named_steps, step_counts, with_grads, zeros_like, DeviceLr, ParamGroup};

pub struct Sgd {
    pub groups: Vec<ParamGroup>,
    pub momentum: f64,
    pub dampening: f64,
    pub nesterov: bool,
    /// Momentum buffers, per group and parameter (empty without momentum).
    buffers: Vec<Vec<Tensor>>,
    /// Applied steps per group, on the device. PyTorch fills a buffer with its first gradient,
    /// undampened; counting on the device makes that the first *applied* step, so a first step
    /// skipped by `found_inf` changes nothing, as in PyTorch.
    steps: Vec<Option<Tensor>>,
    pub(super) lr: DeviceLr,
}

impl Sgd {
    pub fn new(
        groups: Vec<ParamGroup>,
        momentum: f64,
        dampening: f64,
        nesterov: bool,
    ) -> Result<Self> {
        let buffers = if momentum != 0.0 {
            zeros_like(&groups)?
        } else {
            groups.iter().map(|_| Vec::new()).collect()
        };
        Ok(Self {
            steps: step_counts(&groups)?,
            lr: DeviceLr::new(&groups)?,
            groups,
            momentum,
            dampening,
            nesterov,
            buffers,
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
            let params: Vec<&Tensor> = indices.iter().map(|&i| &group.params[i]).collect();
            let momentum: Vec<&Tensor> = if buffers.is_empty() {
                Vec::new()
            } else {
                indices.iter().map(|&i| &buffers[i]).collect()
            };
            let p = SgdParams {
                lr_scale: group.lr_scale,
                momentum: self.momentum,
                dampening: self.dampening,
                weight_decay: group.weight_decay,
                nesterov: self.nesterov,
            };
            let grads: Vec<&Tensor> = grads.iter().collect();
            sgd(&params, &grads, &momentum, step, lr, &p, found_inf)?;
        }
        Ok(())
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
