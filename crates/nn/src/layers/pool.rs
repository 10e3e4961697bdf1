//! `nn.MaxPool2d` and the global average pool + flatten that ends a ResNet
//! (`AdaptiveAvgPool2d(1)` followed by `torch.flatten(x, 1)`).

use redline_tensor::{Pool2dParams, Result, Tensor, TensorError};

use crate::module::{Kind, Module};

pub struct MaxPool2d(pub Pool2dParams);

impl Module for MaxPool2d {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.max_pool2d(self.0)
    }

    fn visit(&self, _prefix: &str, _f: &mut dyn FnMut(&str, &Tensor, Kind)) {}

    fn shape_and_macs(&self, shape: &[usize]) -> Result<(Vec<usize>, u64)> {
        let p = &self.0;
        if shape.len() != 4 {
            return Err(TensorError::Shape(format!(
                "max_pool2d needs [N, C, H, W], got {shape:?}"
            )));
        }
        let side = |i: usize| (shape[2 + i] + 2 * p.padding[i] - p.kernel[i]) / p.stride[i] + 1;
        Ok((vec![shape[0], shape[1], side(0), side(1)], 0))
    }
}

/// `[N, C, H, W]` → `[N, C]`: the mean of each plane.
pub struct GlobalAvgPool;

impl Module for GlobalAvgPool {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (n, c) = (x.shape()[0], x.shape()[1]);
        x.global_avg_pool()?.reshape(&[n, c])
    }

    fn visit(&self, _prefix: &str, _f: &mut dyn FnMut(&str, &Tensor, Kind)) {}

    fn shape_and_macs(&self, shape: &[usize]) -> Result<(Vec<usize>, u64)> {
        match shape {
            [n, c, _, _] => Ok((vec![*n, *c], 0)),
            _ => Err(TensorError::Shape(format!(
                "global average pooling needs [N, C, H, W], got {shape:?}"
            ))),
        }
    }
}
