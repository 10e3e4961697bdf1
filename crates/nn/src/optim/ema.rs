//! An exponential moving average of a model's weights (timm's `ModelEmaV3`): after each step,
//! `ema ← d·ema + (1−d)·w` for every floating-point parameter and buffer; other buffers (the
//! batch counters) are copied. Evaluate with [`Ema::swap`] or copy the averages out.

use redline_tensor::{no_grad, Result, Tensor};

use crate::module::{state_dict, Module};

pub struct Ema {
    pub decay: f64,
    /// (name, live tensor, average), in state-dict order.
    entries: Vec<(String, Tensor, Tensor)>,
}

impl Ema {
    /// Starts the averages at the model's current state.
    pub fn new(model: &dyn Module, decay: f64) -> Result<Self> {
        let entries = state_dict(model)
            .into_iter()
            .map(|(name, t, _)| {
                let avg = t.detach().contiguous_copy()?;
                Ok((name, t, avg))
            })
            .collect::<Result<_>>()?;
        Ok(Self { decay, entries })
    }

    /// Folds the model's current state into the averages (on the device, no synchronisation).
    pub fn update(&self) -> Result<()> {
        no_grad(|| {
            for (_, live, avg) in &self.entries {
                if live.dtype().is_float() {
                    let mixed = avg
                        .mul_scalar(self.decay)?
                        .add(&live.mul_scalar(1.0 - self.decay)?)?;
                    avg.assign(&mixed)?;
                } else {
                    avg.assign(live)?;
                }
            }
            Ok(())
        })
    }

    /// Exchanges the model's values with the averages (call twice to restore): evaluate the
    /// averaged weights without a second model.
    pub fn swap(&self) -> Result<()> {
        no_grad(|| {
            for (_, live, avg) in &self.entries {
                let kept = live.contiguous_copy()?;
                live.assign(avg)?;
                avg.assign(&kept)?;
            }
            Ok(())
        })
    }

    /// The averages by state-dict name.
    pub fn averages(&self) -> impl Iterator<Item = (&str, &Tensor)> {
        self.entries.iter().map(|(n, _, a)| (n.as_str(), a))
    }
}
