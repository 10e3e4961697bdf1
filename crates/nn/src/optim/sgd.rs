//! `torch.optim.SGD`: momentum, dampening, Nesterov, per-group weight decay.

use redline_tensor::optim::sgd;
use redline_tensor::{Result, SgdParams, Tensor};

use super::{with_grads, zeros_like, ParamGroup};

pub struct Sgd {
    pub groups: Vec<ParamGroup>,
    pub momentum: f64,
    pub dampening: f64,
    pub nesterov: bool,
    /// Momentum buffers, per group and parameter (empty without momentum).
    buffers: Vec<Vec<Tensor>>,
    /// Whether a step has been issued. PyTorch fills a buffer with its first gradient,
    /// undampened; a first step skipped by `found_inf` leaves zero buffers, which the next
    /// step treats as filled — the same values unless `dampening` is non-zero.
    started: bool,
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
            groups,
            momentum,
            dampening,
            nesterov,
            buffers,
            started: false,
        })
    }

    /// One step at learning rate `lr` (times each group's `lr_scale`), skipped on the device
    /// when `found_inf` is set.
    pub fn step(&mut self, lr: f64, found_inf: Option<&Tensor>) -> Result<()> {
        for (group, buffers) in self.groups.iter().zip(&self.buffers) {
            let (indices, grads) = with_grads(group)?;
            let params: Vec<&Tensor> = indices.iter().map(|&i| &group.params[i]).collect();
            let momentum: Vec<&Tensor> = if buffers.is_empty() {
                Vec::new()
            } else {
                indices.iter().map(|&i| &buffers[i]).collect()
            };
            let p = SgdParams {
                lr: lr * group.lr_scale,
                momentum: self.momentum,
                dampening: self.dampening,
                weight_decay: group.weight_decay,
                nesterov: self.nesterov,
                first_step: !self.started,
            };
            sgd(
                &params,
                &grads.iter().collect::<Vec<_>>(),
                &momentum,
                &p,
                found_inf,
            )?;
        }
        self.started = true;
        Ok(())
    }

    /// Whether the momentum buffers are filled is host state: restored from the step count.
    pub fn state_loaded(&mut self, steps_taken: u64) {
        self.started = steps_taken > 0;
    }

    /// The momentum buffers, named `group.index` (for checkpoints).
    pub fn state(&self) -> Vec<(String, Tensor)> {
        super::named_buffers("momentum_buffer", &self.buffers)
    }
}
