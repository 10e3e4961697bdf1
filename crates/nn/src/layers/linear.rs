//! `nn.Linear`: `y = x · Wᵀ + b`, weights `[out, in]` as PyTorch stores them.

use redline_amp::for_compute;
use redline_tensor::{Result, Tensor, TensorError};

use crate::init::Init;
use crate::module::{join, Kind, Module};

pub struct Linear {
    pub weight: Tensor,
    pub bias: Tensor,
}

impl Linear {
    /// PyTorch's default initialisation: U(±1/√inputs) for weight and bias.
    pub fn new(init: &mut Init, inputs: usize, outputs: usize) -> Result<Self> {
        Ok(Self {
            weight: init.pytorch_default(&[outputs, inputs])?,
            bias: init.uniform(&[outputs], 1.0 / (inputs as f64).sqrt())?,
        })
    }
}

impl Module for Linear {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let weight = for_compute(&self.weight)?;
        for_compute(x)?
            .matmul(&weight.transpose(0, 1)?)?
            .add(&for_compute(&self.bias)?)
    }

    fn visit(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor, Kind)) {
        f(&join(prefix, "weight"), &self.weight, Kind::Parameter);
        f(&join(prefix, "bias"), &self.bias, Kind::Parameter);
    }

    fn shape_and_macs(&self, shape: &[usize]) -> Result<(Vec<usize>, u64)> {
        let w = self.weight.shape();
        match shape {
            [n, k] if *k == w[1] => Ok((vec![*n, w[0]], (n * w[0] * w[1]) as u64)),
            _ => Err(TensorError::Shape(format!(
                "linear: input {shape:?} does not fit weight {w:?}"
            ))),
        }
    }
}
