//! Optimizers on the multi-tensor device ops (one launch per group, not one per parameter),
//! with PyTorch's semantics and its parameter groups; gradient clipping; LR schedules live in
//! [`crate::schedule`].
//!
//! Every step takes an optional device `found_inf` flag (GradScaler's): when it is set the
//! whole update is skipped on the device, moments and step counts included, so a training step
//! needs no host synchronisation (DESIGN contract 8).
//!
//! What changes from step to step lives on the device at a fixed address: the learning rate
//! ([`Optimizer::set_lr`] writes it, outside the step) and each group's count of applied steps
//! (the update increments it). [`Optimizer::update`] therefore issues the same launches with
//! the same arguments every step, which is what replaying a captured CUDA graph needs (as
//! PyTorch's `capturable` optimizers keep `lr` and `step` in device tensors).

mod adamw;
mod clip;
mod ema;
mod lars;
mod sgd;

pub use adamw::AdamW;
pub use clip::clip_grad_norm;
pub use ema::Ema;
pub use lars::Lars;
pub use sgd::Sgd;

use redline_tensor::{stats_dtype, Result, Tensor, TensorError};

use crate::module::{named_parameters, Module};

/// What a trainer needs of any optimizer here.
pub trait Optimizer: Send {
    /// Sets the learning rate the next updates read (each group's `lr_scale` applies on top):
    /// a copy into the device scalar, only when the value changed. Outside a captured step.
    fn set_lr(&mut self, lr: f64) -> Result<()>;
    /// One update at the device learning rate, skipped on the device when `found_inf` is set:
    /// the same launches with the same arguments every step.
    fn update(&mut self, found_inf: Option<&Tensor>) -> Result<()>;
    /// [`set_lr`](Self::set_lr) then [`update`](Self::update).
    fn step(&mut self, lr: f64, found_inf: Option<&Tensor>) -> Result<()> {
        self.set_lr(lr)?;
        self.update(found_inf)
    }
    fn groups(&self) -> &[ParamGroup];
    /// Named state tensors (moments, step counts), for checkpoints and tests.
    fn state(&self) -> Vec<(String, Tensor)>;
    /// After `state()`'s tensors were loaded from a checkpoint taken after `steps_taken`
    /// issued steps: restores what the optimizer keeps on the host.
    fn state_loaded(&mut self, steps_taken: u64);
}

macro_rules! optimizer {
    ($($t:ty),*) => {$(
        impl $t {
            /// [`Optimizer::step`], callable without the trait in scope.
            pub fn step(&mut self, lr: f64, found_inf: Option<&Tensor>) -> Result<()> {
                Optimizer::step(self, lr, found_inf)
            }
        }
        impl Optimizer for $t {
            fn set_lr(&mut self, lr: f64) -> Result<()> {
                self.lr.set(lr)
            }
            fn update(&mut self, found_inf: Option<&Tensor>) -> Result<()> {
                <$t>::update(self, found_inf)
            }
            fn groups(&self) -> &[ParamGroup] {
                &self.groups
            }
            fn state(&self) -> Vec<(String, Tensor)> {
                <$t>::state(self)
            }
            fn state_loaded(&mut self, steps_taken: u64) {
                <$t>::state_loaded(self, steps_taken)
            }
        }
    )*};
}
optimizer!(Sgd, AdamW, Lars);

/// Parameters that share hyper-parameters (PyTorch's `param_groups` entry).
#[derive(Debug, Clone)]
pub struct ParamGroup {
    pub params: Vec<Tensor>,
    pub weight_decay: f64,
    /// This group's learning rate relative to the scheduled one (1 by default).
    pub lr_scale: f64,
}

impl ParamGroup {
    pub fn new(params: Vec<Tensor>, weight_decay: f64) -> Self {
        Self {
            params,
            weight_decay,
            lr_scale: 1.0,
        }
    }
}

/// The usual two groups for a convolutional network: weights (rank ≥ 2) decay, while biases
/// and normalisation weights (rank 1) do not.
pub fn decay_groups(m: &dyn Module, weight_decay: f64) -> Vec<ParamGroup> {
    let (decay, plain): (Vec<_>, Vec<_>) = named_parameters(m)
        .into_iter()
        .map(|(_, t)| t)
        .partition(|t| t.rank() >= 2);
    vec![
        ParamGroup::new(decay, weight_decay),
        ParamGroup::new(plain, 0.0),
    ]
}

/// The parameters of `group` that have a gradient, with their gradients as whole contiguous
/// tensors (what the multi-tensor ops take) and their indices in the group. Parameters without
/// a gradient are skipped, as PyTorch does.
fn with_grads(group: &ParamGroup) -> Result<(Vec<usize>, Vec<Tensor>)> {
    let mut indices = Vec::new();
    let mut grads = Vec::new();
    for (i, p) in group.params.iter().enumerate() {
        let Some(g) = p.grad() else { continue };
        let whole = g.layout().is_contiguous() && g.storage().len() == g.numel();
        grads.push(if whole { g } else { g.contiguous_copy()? });
        indices.push(i);
    }
    Ok((indices, grads))
}

/// The learning rate the update kernels read: a one-element device tensor of the parameters'
/// statistics dtype (f32 for f32 and half parameters), written from the host when it changes.
struct DeviceLr {
    /// None when no group has a parameter (nothing to update, no device to hold it).
    value: Option<Tensor>,
    written: Option<f64>,
}

impl DeviceLr {
    fn new(groups: &[ParamGroup]) -> Result<Self> {
        let first = groups.iter().find_map(|g| g.params.first());
        let value = first
            .map(|p| Tensor::zeros(&[1], stats_dtype(p.dtype()), p.device()))
            .transpose()?;
        Ok(Self {
            value,
            written: None,
        })
    }

    fn set(&mut self, lr: f64) -> Result<()> {
        let Some(t) = &self.value else {
            return Ok(());
        };
        if self.written != Some(lr) {
            t.copy_from_f64s(&[lr])?;
            self.written = Some(lr);
        }
        Ok(())
    }

    /// The tensor to hand the update op, or an error before the first [`DeviceLr::set`]: an
    /// update at a learning rate of 0 would silently do nothing.
    fn read(&self) -> Result<Option<&Tensor>> {
        match (&self.value, self.written) {
            (Some(_), None) => Err(TensorError::Usage(
                "optimizer update before any learning rate was set (call set_lr or step)".into(),
            )),
            (value, _) => Ok(value.as_ref()),
        }
    }
}

/// One-element step counts, one per group (none for an empty group), on the device: the
/// update ops count only applied steps. In f32 for half-precision parameters, as the learning
/// rate: bf16 counts exactly only to 256 and f16 to 2,048, where `+ 1` stops moving the count
/// and AdamW's bias correction would freeze.
fn step_counts(groups: &[ParamGroup]) -> Result<Vec<Option<Tensor>>> {
    groups
        .iter()
        .map(|g| {
            g.params
                .first()
                .map(|p| Tensor::zeros(&[1], stats_dtype(p.dtype()), p.device()))
                .transpose()
        })
        .collect()
}

/// The step counts of [`step_counts`], named `step.group` (for checkpoints).
fn named_steps(steps: &[Option<Tensor>]) -> Vec<(String, Tensor)> {
    (steps.iter().enumerate())
        .filter_map(|(g, s)| s.as_ref().map(|s| (format!("step.{g}"), s.clone())))
        .collect()
}

/// Zeros shaped like every parameter of every group (moment buffers).
fn zeros_like(groups: &[ParamGroup]) -> Result<Vec<Vec<Tensor>>> {
    groups
        .iter()
        .map(|g| {
            g.params
                .iter()
                .map(|p| Tensor::zeros(p.shape(), p.dtype(), p.device()))
                .collect()
        })
        .collect()
}

/// Clears every parameter's gradient.
pub fn zero_grad(groups: &[ParamGroup]) {
    for p in groups.iter().flat_map(|g| &g.params) {
        p.zero_grad();
    }
}

/// Per-group, per-parameter state tensors named `prefix.group.index` (for checkpoints).
fn named_buffers(prefix: &str, buffers: &[Vec<Tensor>]) -> Vec<(String, Tensor)> {
    buffers
        .iter()
        .enumerate()
        .flat_map(|(g, bufs)| {
            bufs.iter()
                .enumerate()
                .map(move |(i, t)| (format!("{prefix}.{g}.{i}"), t.clone()))
        })
        .collect()
}
