//! Batch norm, layer norm and dropout, composed from the primitive ops (so every backend gets
//! them, forward and backward, from its primitives; fused kernels can replace them later).

use crate::autograd::no_grad;
use crate::backend::{NnOp, Op};
use crate::dtype::DType;
use crate::error::{Result, TensorError};
use crate::layout::Layout;
use crate::tensor::Tensor;

/// Batch norm's running statistics, updated in place in training mode.
pub struct RunningStats<'a> {
    pub mean: &'a Tensor,
    pub var: &'a Tensor,
    /// PyTorch's `momentum` (default 0.1): `running = (1 - m) · running + m · batch`.
    pub momentum: f64,
}

impl Tensor {
    /// Batch norm over `[N, C, ..]` with per-channel `weight` and `bias` (`[C]`). Training
    /// normalises by the batch statistics and updates `running` (PyTorch's unbiased running
    /// variance); evaluation normalises by `running`.
    pub fn batch_norm(
        &self,
        weight: Option<&Tensor>,
        bias: Option<&Tensor>,
        running: Option<RunningStats<'_>>,
        training: bool,
        eps: f64,
    ) -> Result<Tensor> {
        if self.rank() < 2 {
            return Err(TensorError::shape(format!(
                "batch_norm needs [N, C, ..], got {:?}",
                self.shape()
            )));
        }
        let c = self.shape()[1];
        let mut stat_shape = vec![1; self.rank()];
        stat_shape[1] = c;
        let axes: Vec<usize> = (0..self.rank()).filter(|&a| a != 1).collect();
        let (mean, var) = if training {
            let mean = self.mean(&axes, true)?;
            let var = self.var(&axes, 0, true)?;
            if let Some(r) = &running {
                let n: usize = axes.iter().map(|&a| self.shape()[a]).product();
                let unbiased = n as f64 / (n.max(2) - 1) as f64;
                no_grad(|| -> Result<()> {
                    let update = |stat: &Tensor, batch: &Tensor, scale: f64| -> Result<()> {
                        let batch = batch.reshape(&[c])?.mul_scalar(scale * r.momentum)?;
                        let new = stat.mul_scalar(1.0 - r.momentum)?.add(&batch)?;
                        stat.write_region(&Layout::contiguous(stat.shape()), &new)
                    };
                    update(r.mean, &mean, 1.0)?;
                    update(r.var, &var, unbiased)
                })?;
            }
            (mean, var)
        } else {
            let r = running.ok_or_else(|| {
                TensorError::shape("batch_norm in eval mode needs running statistics")
            })?;
            (r.mean.reshape(&stat_shape)?, r.var.reshape(&stat_shape)?)
        };
        let mut y = self.sub(&mean)?.mul(&var.add_scalar(eps)?.rsqrt()?)?;
        if let Some(w) = weight {
            y = y.mul(&w.reshape(&stat_shape)?)?;
        }
        if let Some(b) = bias {
            y = y.add(&b.reshape(&stat_shape)?)?;
        }
        Ok(y)
    }

    /// Layer norm over the trailing `normalized` axes, with optional elementwise affine.
    pub fn layer_norm(
        &self,
        normalized: usize,
        weight: Option<&Tensor>,
        bias: Option<&Tensor>,
        eps: f64,
    ) -> Result<Tensor> {
        if normalized == 0 || normalized > self.rank() {
            return Err(TensorError::shape(format!(
                "layer_norm over the last {normalized} axes of {:?}",
                self.shape()
            )));
        }
        let axes: Vec<usize> = (self.rank() - normalized..self.rank()).collect();
        let mean = self.mean(&axes, true)?;
        let var = self.var(&axes, 0, true)?;
        let mut y = self.sub(&mean)?.mul(&var.add_scalar(eps)?.rsqrt()?)?;
        if let Some(w) = weight {
            y = y.mul(w)?;
        }
        if let Some(b) = bias {
            y = y.add(b)?;
        }
        Ok(y)
    }

    /// Uniform [0, 1) numbers of `shape` from the counter-based generator: element `i`
    /// (row-major) is a pure function of (`seed`, `offset + i`), the same on every backend.
    pub fn random_uniform(
        shape: &[usize],
        dtype: DType,
        seed: u64,
        offset: u64,
        device: &crate::Device,
    ) -> Result<Tensor> {
        device.check(Op::Nn(NnOp::RandomUniform), dtype)?;
        let numel = shape.iter().product();
        let storage = device
            .backend()
            .random_uniform(dtype, numel, seed, offset)?;
        Ok(Tensor::from_storage(
            storage,
            Layout::contiguous(shape),
            device.clone(),
        ))
    }

    /// Inverted dropout: zeroes each element with probability `p` and scales the rest by
    /// `1 / (1 - p)`. The mask is keyed by (`seed`, `offset` + position), so replays and every
    /// backend drop the same elements. Identity when not training.
    pub fn dropout(&self, p: f64, seed: u64, offset: u64, training: bool) -> Result<Tensor> {
        if !(0.0..1.0).contains(&p) {
            return Err(TensorError::shape(format!(
                "dropout probability {p} is not in [0, 1)"
            )));
        }
        if !training || p == 0.0 {
            return Ok(self.clone());
        }
        let u = Tensor::random_uniform(self.shape(), self.dtype(), seed, offset, self.device())?;
        let keep = u.ge(&u.scalar_like(p)?)?;
        let zero = self.scalar_like(0.0)?;
        Tensor::where_(&keep, &self.mul_scalar(1.0 / (1.0 - p))?, &zero)
    }
}

/// The reference generator: Philox-4x32-10.
pub(crate) mod reference {
    const M0: u32 = 0xD251_1F53;
    const M1: u32 = 0xCD9E_8D57;
    const W0: u32 = 0x9E37_79B9;
    const W1: u32 = 0xBB67_AE85;

    /// Philox-4x32 with 10 rounds on a 128-bit counter and 64-bit key.
    pub fn philox(counter: [u32; 4], key: [u32; 2]) -> [u32; 4] {
        let (mut c, mut k) = (counter, key);
        for round in 0..10 {
            if round > 0 {
                k = [k[0].wrapping_add(W0), k[1].wrapping_add(W1)];
            }
            let p0 = M0 as u64 * c[0] as u64;
            let p1 = M1 as u64 * c[2] as u64;
            c = [
                (p1 >> 32) as u32 ^ c[1] ^ k[0],
                p1 as u32,
                (p0 >> 32) as u32 ^ c[3] ^ k[1],
                p0 as u32,
            ];
        }
        c
    }

    /// Element `n` of the uniform stream of `seed`.
    pub fn uniform(seed: u64, n: u64) -> f64 {
        let block = n / 4;
        let words = philox(
            [block as u32, (block >> 32) as u32, 0, 0],
            [seed as u32, (seed >> 32) as u32],
        );
        (words[(n % 4) as usize] >> 8) as f64 / (1u32 << 24) as f64
    }

    #[cfg(test)]
    mod tests {
        #[test]
        fn philox_matches_the_random123_known_answer() {
            // Random123's kat_vectors: philox4x32_10, counter and key all zero.
            assert_eq!(
                super::philox([0; 4], [0; 2]),
                [0x6627_e8d5, 0xe169_c58d, 0xbc57_ac4c, 0x9b00_dbd8]
            );
            // ... and all ones.
            assert_eq!(
                super::philox([u32::MAX; 4], [u32::MAX; 2]),
                [0x408f_276d, 0x41c8_3b0e, 0xa20b_c7c6, 0x6d54_51fd]
            );
        }
    }
}
