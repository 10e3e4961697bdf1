//! `nn.ReLU`.

use redline_tensor::{Result, Tensor};

use crate::module::{Kind, Module};

pub struct ReLU;

impl Module for ReLU {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.relu()
    }

    fn visit(&self, _prefix: &str, _f: &mut dyn FnMut(&str, &Tensor, Kind)) {}

    fn shape_and_macs(&self, shape: &[usize]) -> Result<(Vec<usize>, u64)> {
        Ok((shape.to_vec(), 0))
    }
}
