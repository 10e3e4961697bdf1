//! `torch.amp.GradScaler` on the device: scale, growth tracker and found-inf flag are
//! one-element device tensors, unscaling checks for inf/NaN in the same pass, the optimizer
//! ops read the flag and skip the step, and the scale update is a device op. Nothing here
//! waits for the device.

use redline_tensor::optim::{scaler_update, unscale_check};
use redline_tensor::{no_grad, DType, Device, Result, ScalerParams, Tensor};

pub struct GradScaler {
    pub params: ScalerParams,
    scale: Tensor,
    growth_tracker: Tensor,
    found_inf: Tensor,
    /// Whether this step's gradients were already unscaled (PyTorch's per-optimizer state;
    /// one optimizer per scaler here).
    unscaled: bool,
}

impl GradScaler {
    /// PyTorch's defaults: scale 65536, ×2 after 2000 clean steps, ×0.5 on overflow. The state
    /// has the dtype of the master gradients it will unscale (f32 for AMP's f32 masters).
    pub fn new(device: &Device, dtype: DType) -> Result<Self> {
        Self::with(device, dtype, 65536.0, ScalerParams::default())
    }

    pub fn with(
        device: &Device,
        dtype: DType,
        init_scale: f64,
        params: ScalerParams,
    ) -> Result<Self> {
        Ok(Self {
            params,
            scale: Tensor::full(init_scale, &[1], dtype, device)?,
            growth_tracker: Tensor::zeros(&[1], dtype, device)?,
            found_inf: Tensor::zeros(&[1], dtype, device)?,
            unscaled: false,
        })
    }

    /// `loss × scale` (what to call `backward` on).
    pub fn scale(&self, loss: &Tensor) -> Result<Tensor> {
        loss.mul(&self.scale.cast(loss.dtype())?)
    }

    /// Divides the gradients of `params` by the scale in place and records inf/NaN in the
    /// device flag. Call before clipping; [`GradScaler::step_flag`] does it if not yet done.
    pub fn unscale(&mut self, params: &[Tensor]) -> Result<()> {
        if self.unscaled {
            return Ok(());
        }
        let grads: Vec<Tensor> = params.iter().filter_map(Tensor::grad).collect();
        let inv = no_grad(|| self.scale.pow_scalar(-1.0))?;
        let refs: Vec<&Tensor> = grads.iter().collect();
        for (dtype, group) in by_dtype(&refs) {
            let (inv, flag) = if dtype == self.found_inf.dtype() {
                (inv.clone(), self.found_inf.clone())
            } else {
                (inv.cast(dtype)?, Tensor::zeros(&[1], dtype, inv.device())?)
            };
            unscale_check(&group, &inv, &flag)?;
            if dtype != self.found_inf.dtype() {
                let merged = self
                    .found_inf
                    .maximum(&flag.cast(self.found_inf.dtype())?)?;
                self.found_inf.assign(&merged)?;
            }
        }
        self.unscaled = true;
        Ok(())
    }

    /// Unscales (if not done yet) and returns the device flag to hand to the optimizer's
    /// `step`, which skips the update when it is set.
    pub fn step_flag(&mut self, params: &[Tensor]) -> Result<&Tensor> {
        self.unscale(params)?;
        Ok(&self.found_inf)
    }

    /// Grows or backs off the scale and clears the flag for the next step.
    pub fn update(&mut self) -> Result<()> {
        scaler_update(
            &self.scale,
            &self.growth_tracker,
            &self.found_inf,
            &self.params,
        )?;
        self.unscaled = false;
        Ok(())
    }

    /// Forgets a step that will not run (its graph capture failed, so nothing it recorded
    /// ran): the next step unscales its own gradients again.
    pub fn discard_step(&mut self) {
        self.unscaled = false;
    }

    /// (scale, growth tracker) as device tensors, for checkpoints and reports.
    pub fn state(&self) -> [(&'static str, &Tensor); 2] {
        [
            ("scale", &self.scale),
            ("growth_tracker", &self.growth_tracker),
        ]
    }
}

/// The gradients grouped by dtype (the multi-tensor op takes one dtype per call).
fn by_dtype<'a>(grads: &[&'a Tensor]) -> Vec<(DType, Vec<&'a Tensor>)> {
    let mut groups: Vec<(DType, Vec<&Tensor>)> = Vec::new();
    for g in grads {
        match groups.iter_mut().find(|(d, _)| *d == g.dtype()) {
            Some((_, list)) => list.push(g),
            None => groups.push((g.dtype(), vec![g])),
        }
    }
    groups
}
