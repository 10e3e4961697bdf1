//! `nn.Conv2d` (weights OIHW, optional bias).

use redline_amp::{for_compute, for_compute_channels_last};
use redline_tensor::{Conv2dParams, Result, Tensor, TensorError};

use crate::init::Init;
use crate::module::{join, Kind, Module};

pub struct Conv2d {
    pub weight: Tensor,
    pub bias: Option<Tensor>,
    pub params: Conv2dParams,
}

impl Conv2d {
    /// A `k × k` convolution from `inputs` to `outputs` channels, without bias, initialised as
    /// torchvision's ResNets are (He normal, fan-out).
    pub fn resnet(
        init: &mut Init,
        inputs: usize,
        outputs: usize,
        k: usize,
        stride: usize,
        padding: usize,
    ) -> Result<Self> {
        Ok(Self {
            weight: init.kaiming_normal_fan_out(&[outputs, inputs, k, k])?,
            bias: None,
            params: Conv2dParams {
                stride: [stride; 2],
                padding: [padding; 2],
                ..Conv2dParams::default()
            },
        })
    }

    /// PyTorch's default `nn.Conv2d` (bias and weights U(±1/√fan_in)).
    pub fn new(
        init: &mut Init,
        inputs: usize,
        outputs: usize,
        k: usize,
        params: Conv2dParams,
    ) -> Result<Self> {
        let shape = [outputs, inputs / params.groups.max(1), k, k];
        let fan_in = (shape[1] * k * k) as f64;
        Ok(Self {
            weight: init.pytorch_default(&shape)?,
            bias: Some(init.uniform(&[outputs], 1.0 / fan_in.sqrt())?),
            params,
        })
    }
}

impl Module for Conv2d {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        // Under autocast, input and weight (cached per scope) run in f16/bf16; beside a
        // channels-last input the weight's copy is channels-last too (one layout for cuDNN).
        let bias = self.bias.as_ref().map(for_compute).transpose()?;
        let weight = match x.is_channels_last() {
            true => for_compute_channels_last(&self.weight)?,
            false => for_compute(&self.weight)?,
        };
        for_compute(x)?.conv2d(&weight, bias.as_ref(), self.params)
    }

    fn visit(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor, Kind)) {
        f(&join(prefix, "weight"), &self.weight, Kind::Parameter);
        if let Some(b) = &self.bias {
            f(&join(prefix, "bias"), b, Kind::Parameter);
        }
    }

    fn shape_and_macs(&self, shape: &[usize]) -> Result<(Vec<usize>, u64)> {
        let w = self.weight.shape();
        let p = &self.params;
        if shape.len() != 4 || shape[1] != w[1] * p.groups.max(1) {
            return Err(TensorError::Shape(format!(
                "conv2d: input {shape:?} does not fit weight {w:?} ({} groups)",
                p.groups
            )));
        }
        let side = |i: usize, k: usize| {
            (shape[2 + i] + 2 * p.padding[i]).saturating_sub(p.dilation[i] * (k - 1) + 1)
                / p.stride[i]
                + 1
        };
        let out = vec![shape[0], w[0], side(0, w[2]), side(1, w[3])];
        let macs = out.iter().product::<usize>() * w[1] * w[2] * w[3];
        Ok((out, macs as u64))
    }
}
