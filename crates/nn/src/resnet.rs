//! ResNet-18/34/50 as torchvision builds them (v1.5: a bottleneck's stride is on its 3×3 conv),
//! with the same parameter names, shapes, order and initialisation (He normal, fan-out, for
//! convolutions; batch norm 1 and 0; PyTorch's default for the classifier), and optionally
//! the last batch norm of every residual branch zero-initialised (`zero_init_residual`).

use std::sync::Arc;

use redline_tensor::{DType, Device, Pool2dParams, Result, Tensor, TensorError};

use crate::init::Init;
use crate::layers::{
    BatchNorm2d, BatchNormReLU, BatchStatsSync, Conv2d, GlobalAvgPool, Linear, MaxPool2d,
    Sequential,
};
use crate::module::{chain, join, Kind, Module};

/// Which ResNet, and how to initialise it.
#[derive(Debug, Clone, PartialEq)]
pub struct ResNetConfig {
    /// 18, 34 or 50.
    pub depth: usize,
    pub num_classes: usize,
    pub zero_init_residual: bool,
    pub seed: u64,
    pub dtype: DType,
}

impl ResNetConfig {
    /// "resnet18", "resnet34" or "resnet50" (torchvision's names), with [`ResNetConfig::new`]'s
    /// defaults; an error naming the choices otherwise.
    pub fn named(name: &str) -> Result<Self> {
        name.strip_prefix("resnet")
            .and_then(|d| d.parse().ok())
            .filter(|d| [18, 34, 50].contains(d))
            .map(Self::new)
            .ok_or_else(|| {
                TensorError::Shape(format!(
                    "model {name:?}: use resnet18, resnet34 or resnet50"
                ))
            })
    }

    pub fn new(depth: usize) -> Self {
        Self {
            depth,
            num_classes: 1000,
            zero_init_residual: false,
            seed: 0,
            dtype: DType::F32,
        }
    }
}

/// A residual block: torchvision's `BasicBlock` (two 3×3) or `Bottleneck` (1×1, 3×3, 1×1 with
/// 4× expansion), plus the projection shortcut where the shape changes.
struct Block {
    /// conv1, bn1, conv2, bn2[, conv3, bn3], in order.
    convs: Vec<(Conv2d, BatchNorm2d)>,
    downsample: Option<Sequential>,
}

impl Block {
    fn new(
        init: &mut Init,
        bottleneck: bool,
        inputs: usize,
        width: usize,
        stride: usize,
        zero_last: bool,
    ) -> Result<(Self, usize)> {
        let outputs = if bottleneck { width * 4 } else { width };
        // (in, out, kernel, stride, padding) per conv.
        let plan = if bottleneck {
            vec![
                (inputs, width, 1, 1, 0),
                (width, width, 3, stride, 1),
                (width, outputs, 1, 1, 0),
            ]
        } else {
            vec![(inputs, width, 3, stride, 1), (width, width, 3, 1, 1)]
        };
        let last = plan.len() - 1;
        let mut convs = Vec::new();
        for (i, (cin, cout, k, s, p)) in plan.into_iter().enumerate() {
            let conv = Conv2d::resnet(init, cin, cout, k, s, p)?;
            let gamma = if zero_last && i == last { 0.0 } else { 1.0 };
            convs.push((conv, BatchNorm2d::new(init, cout, gamma)?));
        }
        let downsample = if stride != 1 || inputs != outputs {
            Some(
                Sequential::new()
                    .push(Conv2d::resnet(init, inputs, outputs, 1, stride, 0)?)
                    .push(BatchNorm2d::new(init, outputs, 1.0)?),
            )
        } else {
            None
        };
        Ok((Self { convs, downsample }, outputs))
    }
}

impl Module for Block {
    /// Each norm with the ReLU after it (and the last with the residual add before it) in one
    /// fused pass (`BatchNorm2d::forward_relu`): the same values as torchvision's separate
    /// `bn`, `relu` and `+`.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let last = self.convs.len() - 1;
        let shortcut = match &self.downsample {
            Some(d) => d.forward(x)?,
            None => x.clone(),
        };
        let mut y = x.clone();
        for (i, (conv, bn)) in self.convs.iter().enumerate() {
            let residual = (i == last).then_some(&shortcut);
            y = bn.forward_relu(&conv.forward(&y)?, residual)?;
        }
        Ok(y)
    }

    fn visit(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor, Kind)) {
        for (i, (conv, bn)) in self.convs.iter().enumerate() {
            conv.visit(&join(prefix, &format!("conv{}", i + 1)), f);
            bn.visit(&join(prefix, &format!("bn{}", i + 1)), f);
        }
        if let Some(d) = &self.downsample {
            d.visit(&join(prefix, "downsample"), f);
        }
    }

    fn set_training(&self, training: bool) {
        for (_, bn) in &self.convs {
            bn.set_training(training);
        }
        if let Some(d) = &self.downsample {
            d.set_training(training);
        }
    }

    fn sync_batch_norm(&self, sync: Option<&Arc<dyn BatchStatsSync>>) {
        for (_, bn) in &self.convs {
            bn.sync_batch_norm(sync);
        }
        if let Some(d) = &self.downsample {
            d.sync_batch_norm(sync);
        }
    }

    fn batch_replayed(&self) {
        for (_, bn) in &self.convs {
            bn.batch_replayed();
        }
        if let Some(d) = &self.downsample {
            d.batch_replayed();
        }
    }

    fn state_loaded(&self) -> Result<()> {
        for (_, bn) in &self.convs {
            bn.state_loaded()?;
        }
        self.downsample
            .as_ref()
            .map_or(Ok(()), |d| d.state_loaded())
    }

    fn shape_and_macs(&self, shape: &[usize]) -> Result<(Vec<usize>, u64)> {
        let (y, mut macs) = chain(shape, self.convs.iter().map(|(c, _)| c as &dyn Module))?;
        if let Some(d) = &self.downsample {
            macs += d.shape_and_macs(shape)?.1;
        }
        Ok((y, macs))
    }
}

/// A ResNet: stem (7×7/2 conv, norm, ReLU, 3×3/2 max pool), four stages of blocks, global
/// average pool, classifier.
pub struct ResNet {
    stem: Sequential,
    stages: Vec<Sequential>,
    head: Sequential,
    config: ResNetConfig,
}

impl ResNet {
    pub fn new(config: ResNetConfig, device: &Device) -> Result<Self> {
        let (bottleneck, blocks) = match config.depth {
            18 => (false, [2, 2, 2, 2]),
            34 => (false, [3, 4, 6, 3]),
            50 => (true, [3, 4, 6, 3]),
            d => {
                return Err(TensorError::Shape(format!(
                    "ResNet-{d}: this build has ResNet-18, -34 and -50"
                )))
            }
        };
        let mut init = Init::new(config.seed, device, config.dtype);
        let stem = Sequential::new()
            .named("conv1", Conv2d::resnet(&mut init, 3, 64, 7, 2, 3)?)
            // bn1 and its ReLU in one pass (torchvision's `bn1`, `relu`).
            .named("bn1", BatchNormReLU(BatchNorm2d::new(&init, 64, 1.0)?))
            .named(
                "maxpool",
                MaxPool2d(Pool2dParams {
                    kernel: [3, 3],
                    stride: [2, 2],
                    padding: [1, 1],
                }),
            );
        let mut inputs = 64;
        let mut stages = Vec::new();
        for (stage, &count) in blocks.iter().enumerate() {
            let width = 64 << stage;
            let mut seq = Sequential::new();
            for b in 0..count {
                let stride = if stage > 0 && b == 0 { 2 } else { 1 };
                let (block, outputs) = Block::new(
                    &mut init,
                    bottleneck,
                    inputs,
                    width,
                    stride,
                    config.zero_init_residual,
                )?;
                seq = seq.push(block);
                inputs = outputs;
            }
            stages.push(seq);
        }
        let head = Sequential::new()
            .named("avgpool", GlobalAvgPool)
            .named("fc", Linear::new(&mut init, inputs, config.num_classes)?);
        Ok(Self {
            stem,
            stages,
            head,
            config,
        })
    }

    pub fn config(&self) -> &ResNetConfig {
        &self.config
    }

    /// Multiply-accumulates of one forward pass on one `res × res` RGB image.
    pub fn macs_per_image(&self, res: usize) -> Result<u64> {
        Ok(self.shape_and_macs(&[1, 3, res, res])?.1)
    }
}

impl Module for ResNet {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut y = self.stem.forward(x)?;
        for stage in &self.stages {
            y = stage.forward(&y)?;
        }
        self.head.forward(&y)
    }

    fn visit(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor, Kind)) {
        self.stem.visit(prefix, f);
        for (i, stage) in self.stages.iter().enumerate() {
            stage.visit(&join(prefix, &format!("layer{}", i + 1)), f);
        }
        self.head.visit(prefix, f);
    }

    fn set_training(&self, training: bool) {
        self.stem.set_training(training);
        for stage in &self.stages {
            stage.set_training(training);
        }
    }

    fn sync_batch_norm(&self, sync: Option<&Arc<dyn BatchStatsSync>>) {
        self.stem.sync_batch_norm(sync);
        for stage in &self.stages {
            stage.sync_batch_norm(sync);
        }
    }

    fn batch_replayed(&self) {
        self.stem.batch_replayed();
        for stage in &self.stages {
            stage.batch_replayed();
        }
    }

    fn state_loaded(&self) -> Result<()> {
        self.stem.state_loaded()?;
        self.stages.iter().try_for_each(|s| s.state_loaded())?;
        self.head.state_loaded()
    }

    fn shape_and_macs(&self, shape: &[usize]) -> Result<(Vec<usize>, u64)> {
        let parts = std::iter::once(&self.stem)
            .chain(&self.stages)
            .chain(std::iter::once(&self.head));
        chain(shape, parts.map(|m| m as &dyn Module))
    }
}
