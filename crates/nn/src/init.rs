//! Deterministic initialisation. Every tensor draws from the Philox generator keyed by the
//! model's seed, at counters that follow from the order tensors are made in, so a model is a
//! pure function of its seed, on every backend and whatever the thread count (DESIGN contract
//! 9). Values are made on the host once (initialisation is not a hot path) and uploaded.

use redline_tensor::scalar::philox;
use redline_tensor::{DType, Device, Result, Tensor};

/// A seeded source of initial weights for one model.
#[derive(Debug)]
pub struct Init {
    seed: u64,
    /// The next unused Philox counter.
    next: u64,
    device: Device,
    dtype: DType,
}

impl Init {
    pub fn new(seed: u64, device: &Device, dtype: DType) -> Self {
        Self {
            seed,
            next: 0,
            device: device.clone(),
            dtype,
        }
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// `n` uniform numbers in [0, 1), each from its own counter: the same values as the
    /// backends' `random_uniform` (element `i` is word `i % 4` of Philox block `i / 4`), one
    /// Philox evaluation per four numbers.
    fn uniforms(&mut self, n: usize) -> Vec<f64> {
        let (start, key) = (self.next, [self.seed as u32, (self.seed >> 32) as u32]);
        self.next += n as u64;
        let mut block = (u64::MAX, [0u32; 4]);
        (start..start + n as u64)
            .map(|i| {
                if block.0 != i / 4 {
                    let b = i / 4;
                    block = (b, philox([b as u32, (b >> 32) as u32, 0, 0], key));
                }
                (block.1[(i % 4) as usize] >> 8) as f64 / (1u32 << 24) as f64
            })
            .collect()
    }

    /// Rounded to the dtype on the host, so devices without f64 (most GPUs) get their own
    /// dtype's bytes — and every device the same values.
    fn parameter(&self, values: &[f64], shape: &[usize]) -> Result<Tensor> {
        let mut bytes = vec![0u8; values.len() * self.dtype.size()];
        for (i, &v) in values.iter().enumerate() {
            self.dtype.write(&mut bytes, i, v);
        }
        Ok(Tensor::from_bytes(bytes, self.dtype, shape, &self.device)?.with_requires_grad(true))
    }

    /// Normal(0, std²) by Box–Muller on pairs of uniforms (`1 - u` keeps the log finite).
    pub fn normal(&mut self, shape: &[usize], std: f64) -> Result<Tensor> {
        let n: usize = shape.iter().product();
        let u = self.uniforms(2 * n);
        let values: Vec<f64> = u
            .chunks_exact(2)
            .map(|p| {
                let r = (-2.0 * (1.0 - p[0]).ln()).sqrt();
                std * r * (std::f64::consts::TAU * p[1]).cos()
            })
            .collect();
        self.parameter(&values, shape)
    }

    /// Uniform(-bound, bound).
    pub fn uniform(&mut self, shape: &[usize], bound: f64) -> Result<Tensor> {
        let n: usize = shape.iter().product();
        let values: Vec<f64> = self
            .uniforms(n)
            .into_iter()
            .map(|u| (2.0 * u - 1.0) * bound)
            .collect();
        self.parameter(&values, shape)
    }

    /// A trainable tensor filled with `value` (batch norm's weight and bias).
    pub fn constant(&self, shape: &[usize], value: f64) -> Result<Tensor> {
        Ok(Tensor::full(value, shape, self.dtype, &self.device)?.with_requires_grad(true))
    }

    /// A buffer (not trained) filled with `value`, of `dtype`.
    pub fn buffer(&self, shape: &[usize], value: f64, dtype: DType) -> Result<Tensor> {
        Tensor::full(value, shape, dtype, &self.device)
    }

    /// He initialisation for a layer followed by ReLU, torchvision's ResNet choice
    /// (`kaiming_normal_(mode="fan_out", nonlinearity="relu")`): std = √(2 / fan_out).
    pub fn kaiming_normal_fan_out(&mut self, shape: &[usize]) -> Result<Tensor> {
        let fan_out = shape[0] * shape[2..].iter().product::<usize>();
        self.normal(shape, (2.0 / fan_out as f64).sqrt())
    }

    /// PyTorch's default for `nn.Linear` and `nn.Conv2d` (`kaiming_uniform_(a=√5)`):
    /// U(±1/√fan_in) for the weight, and the same bound for the bias.
    pub fn pytorch_default(&mut self, shape: &[usize]) -> Result<Tensor> {
        let fan_in: usize = shape[1..].iter().product();
        self.uniform(shape, 1.0 / (fan_in as f64).sqrt())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draws_are_a_function_of_the_seed_and_have_the_asked_spread() {
        let dev = Device::reference();
        let a = Init::new(7, &dev, DType::F32)
            .normal(&[4000], 0.5)
            .unwrap()
            .to_f64_vec()
            .unwrap();
        let b = Init::new(7, &dev, DType::F32)
            .normal(&[4000], 0.5)
            .unwrap()
            .to_f64_vec()
            .unwrap();
        assert_eq!(a, b);
        let mean = a.iter().sum::<f64>() / a.len() as f64;
        let std = (a.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / a.len() as f64).sqrt();
        assert!(
            mean.abs() < 0.03 && (std - 0.5).abs() < 0.03,
            "{mean} {std}"
        );
        let mut init = Init::new(7, &dev, DType::F32);
        let first = init.uniform(&[100], 1.0).unwrap().to_f64_vec().unwrap();
        let second = init.uniform(&[100], 1.0).unwrap().to_f64_vec().unwrap();
        assert_ne!(first, second, "consecutive tensors use fresh counters");
        assert!(first.iter().all(|v| v.abs() < 1.0));
        // The same numbers the backends draw: the first 200 counters of seed 7.
        let device_draws = Tensor::random_uniform(&[200], DType::F64, 7, 0, &dev)
            .unwrap()
            .to_f64_vec()
            .unwrap();
        let mut init = Init::new(7, &dev, DType::F64);
        assert_eq!(init.uniforms(200), device_draws);
    }
}
