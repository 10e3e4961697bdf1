//! `nn.BatchNorm2d`: affine, running statistics (momentum 0.1, unbiased variance) and the
//! `num_batches_tracked` counter torchvision's state dicts carry.

use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, Mutex};

use redline_amp::for_f32;
use redline_tensor::{no_grad, DType, Result, RunningStats, Tensor, TensorError};

use crate::init::Init;
use crate::module::{join, Kind, Module};

/// How synchronised batch norm combines one process's statistics with the others' (PyTorch's
/// `SyncBatchNorm` over a process group; `redline-dist` implements it over a collective).
pub trait BatchStatsSync: Send + Sync {
    /// `t` summed over every process, as a differentiable op: the gradient of the result is
    /// summed over every process too.
    fn sum(&self, t: &Tensor) -> Result<Tensor>;
}

pub struct BatchNorm2d {
    pub weight: Tensor,
    pub bias: Tensor,
    pub running_mean: Tensor,
    pub running_var: Tensor,
    /// i64, 0-d: training batches seen. Counted on the host (`batches`) and written only when
    /// the state is read (a state dict, a checkpoint): the step itself launches nothing for it
    /// — it was a fill and a copy per norm per step, 106 of a ResNet-50 step's launches.
    pub num_batches_tracked: Tensor,
    batches: AtomicI64,
    /// The count `num_batches_tracked` holds (-1: unknown).
    written: AtomicI64,
    pub momentum: f64,
    pub eps: f64,
    training: AtomicBool,
    /// Set: training statistics over every process's batch (synchronised batch norm).
    sync: Mutex<Option<Arc<dyn BatchStatsSync>>>,
}

impl BatchNorm2d {
    /// `channels` features, weight `gamma` (1 by default; 0 for a zero-initialised residual
    /// branch's last norm), bias 0, running mean 0 and variance 1.
    pub fn new(init: &Init, channels: usize, gamma: f64) -> Result<Self> {
        Ok(Self {
            weight: init.constant(&[channels], gamma)?,
            bias: init.constant(&[channels], 0.0)?,
            running_mean: init.buffer(&[channels], 0.0, DType::F32)?,
            running_var: init.buffer(&[channels], 1.0, DType::F32)?,
            num_batches_tracked: init.buffer(&[], 0.0, DType::I64)?,
            batches: AtomicI64::new(0),
            written: AtomicI64::new(0),
            momentum: 0.1,
            eps: 1e-5,
            training: AtomicBool::new(true),
            sync: Mutex::new(None),
        })
    }
}

impl BatchNorm2d {
    /// `relu(self(x) + residual)`: ResNet's `bn → relu` and `bn → add → relu` as one fused
    /// pass in training (`Tensor::batch_norm_relu`); the same values as the three modules.
    pub fn forward_relu(&self, x: &Tensor, residual: Option<&Tensor>) -> Result<Tensor> {
        let training = self.count_batch()?;
        if let Some(sync) = self.synchronised(training) {
            let residual = residual.map(for_f32).transpose()?;
            return self.forward_synchronised(x, sync.as_ref(), residual.as_ref(), true);
        }
        let x = norm_input(x, training)?;
        let residual = residual.map(|r| r.cast(x.dtype())).transpose()?;
        x.batch_norm_relu(
            Some(&self.weight),
            Some(&self.bias),
            Some(self.running()),
            training,
            self.eps,
            residual.as_ref(),
        )
    }

    /// The statistics' sync, when set and training.
    fn synchronised(&self, training: bool) -> Option<Arc<dyn BatchStatsSync>> {
        match training {
            true => self.sync.lock().unwrap_or_else(|p| p.into_inner()).clone(),
            false => None,
        }
    }

    /// Training batch norm (then `+ residual`, then ReLU if asked) with mean and variance over
    /// every process's batch, as PyTorch's `SyncBatchNorm`: two rounds — the mean, then the
    /// variance around it (a two-pass variance, without `E[x²] − E[x]²`'s cancellation) — each a
    /// differentiable sum over processes, so backward sums the statistics' gradients over the
    /// processes too. The running statistics take the unbiased variance over the whole batch.
    /// Composed from ops (no fused kernel): it is for several processes, where the sums' round
    /// trips dominate anyway.
    fn forward_synchronised(
        &self,
        x: &Tensor,
        sync: &dyn BatchStatsSync,
        residual: Option<&Tensor>,
        relu: bool,
    ) -> Result<Tensor> {
        let x = for_f32(x)?;
        let [_, c, _, _] = *x.shape() else {
            return Err(TensorError::Shape(format!(
                "synchronised batch norm needs [N, C, H, W], got {:?}",
                x.shape()
            )));
        };
        let axes = [0, 2, 3];
        // This process's count rides with its sums in one all-reduce on the device, so no
        // step waits for a count on the host (one round trip per norm per step, and a value a
        // captured graph would have baked in).
        let per_channel = [1, c, 1, 1];
        let device = x.device();
        let count = Tensor::full((x.numel() / c.max(1)) as f64, &[1], DType::F32, device)?;
        let local = Tensor::concat(&[&x.sum(&axes, false)?, &count], 0)?;
        let summed = sync.sum(&local)?;
        // A constant: no gradient flows back into the count.
        let total = summed.narrow(0, c, 1)?.detach();
        // An empty batch on every process: sums and count 0, the statistics 0 over 1 (not
        // NaN), and the running statistics left as they are (their momentum times 0).
        let one = Tensor::full(1.0, &[1], DType::F32, device)?;
        let divisor = total.maximum(&one)?;
        let mean = summed
            .narrow(0, 0, c)?
            .div(&divisor)?
            .reshape(&per_channel)?;
        let centred = x.sub(&mean)?;
        let squares = centred.mul(&centred)?.sum(&axes, true)?;
        let var = sync.sum(&squares)?.div(&divisor)?;
        let scale = var
            .add_scalar(self.eps)?
            .rsqrt()?
            .mul(&self.weight.reshape(&per_channel)?)?;
        let mut y = centred
            .mul(&scale)?
            .add(&self.bias.reshape(&per_channel)?)?;
        if let Some(r) = residual {
            y = y.add(r)?;
        }
        if relu {
            y = y.relu()?;
        }
        no_grad(|| -> Result<()> {
            let momentum = total.minimum(&one)?.mul_scalar(self.momentum)?;
            let update = |stat: &Tensor, batch: &Tensor| -> Result<()> {
                let step = batch.reshape(&[c])?.sub(stat)?.mul(&momentum)?;
                stat.assign(&stat.add(&step)?)
            };
            update(&self.running_mean, &mean)?;
            // The unbiased variance: total / (total − 1), over the whole batch.
            let unbiased = total.div(&total.add_scalar(-1.0)?.maximum(&one)?)?;
            update(&self.running_var, &var.reshape(&[c])?.mul(&unbiased)?)
        })?;
        Ok(y)
    }

    /// Whether in training mode, counting the batch there.
    fn count_batch(&self) -> Result<bool> {
        let training = self.training.load(Ordering::Relaxed);
        if training {
            self.batches.fetch_add(1, Ordering::Relaxed);
        }
        Ok(training)
    }

    /// Writes the host's count into `num_batches_tracked` if it holds another (a fill: not
    /// every device does integer arithmetic). A failed write leaves it marked stale; the
    /// device error resurfaces at the read that follows.
    fn write_count(&self) {
        let count = self.batches.load(Ordering::Relaxed);
        if self.written.swap(count, Ordering::Relaxed) == count {
            return;
        }
        let t = &self.num_batches_tracked;
        let wrote = no_grad(|| t.assign(&Tensor::full(count as f64, &[], DType::I64, t.device())?));
        if wrote.is_err() {
            self.written.store(-1, Ordering::Relaxed);
        }
    }

    fn running(&self) -> RunningStats<'_> {
        RunningStats {
            mean: &self.running_mean,
            var: &self.running_var,
            momentum: self.momentum,
        }
    }
}

/// Batch norm's input under autocast. Where training batch norm runs fused on x's dtype, x as
/// it is: the kernels keep the statistics and coefficients in f32 (the parameters and running
/// statistics are f32) and write the output in x's dtype — PyTorch's CUDA autocast, whose
/// batch norm runs in its input's dtype. Casting up instead cost a ResNet-50 AMP step an f32
/// copy of every normalised activation and its gradient, the casts back, and f32 passes over
/// both: about 40 bytes of traffic an element, some 100 GB a step at batch 256. Elsewhere
/// (evaluation, backends that compose batch norm) x is cast up to f32, as every op the policy
/// keeps in f32.
fn norm_input(x: &Tensor, training: bool) -> Result<Tensor> {
    match training && x.fused_batch_norm() {
        true => Ok(x.clone()),
        false => for_f32(x),
    }
}

impl Module for BatchNorm2d {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let training = self.count_batch()?;
        if let Some(sync) = self.synchronised(training) {
            return self.forward_synchronised(x, sync.as_ref(), None, false);
        }
        norm_input(x, training)?.batch_norm(
            Some(&self.weight),
            Some(&self.bias),
            Some(self.running()),
            training,
            self.eps,
        )
    }

    fn visit(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor, Kind)) {
        // Whoever visits reads (or loads) the state: the counter must be current.
        self.write_count();
        f(&join(prefix, "weight"), &self.weight, Kind::Parameter);
        f(&join(prefix, "bias"), &self.bias, Kind::Parameter);
        f(
            &join(prefix, "running_mean"),
            &self.running_mean,
            Kind::Buffer,
        );
        f(
            &join(prefix, "running_var"),
            &self.running_var,
            Kind::Buffer,
        );
        f(
            &join(prefix, "num_batches_tracked"),
            &self.num_batches_tracked,
            Kind::Buffer,
        );
    }

    fn set_training(&self, training: bool) {
        self.training.store(training, Ordering::Relaxed);
    }

    fn sync_batch_norm(&self, sync: Option<&Arc<dyn BatchStatsSync>>) {
        *self.sync.lock().unwrap_or_else(|p| p.into_inner()) = sync.cloned();
    }

    fn batch_replayed(&self) {
        let _ = self.count_batch();
    }

    fn state_loaded(&self) -> Result<()> {
        let count = self.num_batches_tracked.item()? as i64;
        self.batches.store(count, Ordering::Relaxed);
        self.written.store(count, Ordering::Relaxed);
        Ok(())
    }

    fn shape_and_macs(&self, shape: &[usize]) -> Result<(Vec<usize>, u64)> {
        Ok((shape.to_vec(), 0))
    }
}

/// `BatchNorm2d` followed by `ReLU`, as one module computed in one fused pass
/// ([`BatchNorm2d::forward_relu`]); its state is the norm's, under the norm's own names.
pub struct BatchNormReLU(pub BatchNorm2d);

impl Module for BatchNormReLU {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.0.forward_relu(x, None)
    }

    fn visit(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor, Kind)) {
        self.0.visit(prefix, f)
    }

    fn set_training(&self, training: bool) {
        self.0.set_training(training)
    }

    fn sync_batch_norm(&self, sync: Option<&Arc<dyn BatchStatsSync>>) {
        self.0.sync_batch_norm(sync)
    }

    fn batch_replayed(&self) {
        self.0.batch_replayed()
    }

    fn state_loaded(&self) -> Result<()> {
        self.0.state_loaded()
    }

    fn shape_and_macs(&self, shape: &[usize]) -> Result<(Vec<usize>, u64)> {
        self.0.shape_and_macs(shape)
    }
}
