//! A test case: an op, a dtype, host-side inputs (shape, values, view) — buildable on any device
//! so the backend under test and the reference see identical inputs.

use redline_tensor::{
    optim, AdamWParams, BatchNormCoefParams, BinaryOp, Conv2dParams, DType, Device, NnOp, Op,
    OptimOp, OtherOp, Pool2dParams, ReduceOp, Result, ScalerParams, SgdParams, Tensor, TensorError,
    UnaryOp,
};

/// How an input tensor is laid out in memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ViewKind {
    /// Row-major.
    Plain,
    /// The transpose of a row-major tensor with the last two axes swapped (rank ≥ 2).
    Transposed,
    /// A narrow view: rows 1.. of a base with two more rows on axis 0 (rank ≥ 1).
    Narrowed,
    /// NCHW stored NHWC (rank 4).
    ChannelsLast,
}

/// One input: its logical shape, the base tensor's values (row-major), dtype and view.
#[derive(Debug, Clone, PartialEq)]
pub struct Input {
    pub shape: Vec<usize>,
    pub values: Vec<f64>,
    pub dtype: DType,
    pub view: ViewKind,
}

impl Input {
    /// The shape of the stored base tensor the view is taken from.
    pub fn base_shape(shape: &[usize], view: ViewKind) -> Vec<usize> {
        let mut base = shape.to_vec();
        match view {
            ViewKind::Transposed => base.swap(shape.len() - 2, shape.len() - 1),
            ViewKind::Narrowed => base[0] += 2,
            ViewKind::Plain | ViewKind::ChannelsLast => {}
        }
        base
    }

    /// Builds the input on `dev` (values rounded to the dtype on the host, so every device
    /// receives the same bits).
    pub fn build(&self, dev: &Device) -> Result<Tensor> {
        Ok(self.build_leaf(dev, false)?.1)
    }

    /// Builds the stored base tensor (a leaf, requiring grad if asked) and the view of it the op
    /// sees; gradients reach the leaf through the view.
    pub fn build_leaf(&self, dev: &Device, requires_grad: bool) -> Result<(Tensor, Tensor)> {
        let base_shape = Self::base_shape(&self.shape, self.view);
        let mut bytes = vec![0u8; self.values.len() * self.dtype.size()];
        for (i, &v) in self.values.iter().enumerate() {
            self.dtype.write(&mut bytes, i, v);
        }
        let base = Tensor::from_bytes(bytes, self.dtype, &base_shape, dev)?
            .with_requires_grad(requires_grad);
        let view = match self.view {
            ViewKind::Plain => base.clone(),
            ViewKind::Transposed => base.transpose(self.shape.len() - 2, self.shape.len() - 1)?,
            ViewKind::Narrowed => base.narrow(0, 1, self.shape[0])?,
            ViewKind::ChannelsLast => base.to_channels_last()?,
        };
        Ok((base, view))
    }
}

/// An op applied to inputs.
#[derive(Debug, Clone, PartialEq)]
pub struct Case {
    pub op: Op,
    pub dtype: DType,
    pub inputs: Vec<Input>,
    /// Reduction axes (one for argmax), or the concat, softmax or gather axis.
    pub axes: Vec<usize>,
    /// Convolution geometry (conv cases).
    pub conv: Option<Conv2dParams>,
    /// Pooling geometry (pool cases).
    pub pool: Option<Pool2dParams>,
    /// Batch-norm apply with its fused ReLU.
    pub relu: bool,
    /// A batch-norm stats, apply or gradient-statistics case with a `[2, C]` gate on the
    /// second operand: its last input (for the sums, the third, a centre may follow).
    pub gate: bool,
    /// The batch-norm coefficient ops' optional operands (with or without the statistics):
    /// bit 0 weight, 1 bias, 2 running statistics, 3 a residual, 4 the sums' centre
    /// (forward); bit 0 weight (backward). The inputs are always all there; the op is given those the bits name.
    /// For the batch-norm sums, bit 0: the last input is a `[C]` centre.
    pub operands: u8,
}

/// Elements per channel the batch-norm coefficient cases assume.
const COEF_COUNT: f64 = 6.0;

/// Elements per channel of `x` `[N, C, ..]`.
fn per_channel(x: &Tensor) -> f64 {
    (x.numel() / x.shape()[1].max(1)) as f64
}

/// Several outputs as one flat tensor, for one comparison.
fn flat_concat(parts: &[Tensor]) -> Result<Tensor> {
    let flat = parts
        .iter()
        .map(Tensor::flatten)
        .collect::<Result<Vec<_>>>()?;
    Tensor::concat(&flat.iter().collect::<Vec<_>>(), 0)
}

impl Case {
    /// A case without convolution or pooling geometry.
    pub fn new(op: Op, dtype: DType, inputs: Vec<Input>, axes: Vec<usize>) -> Self {
        Self {
            op,
            dtype,
            inputs,
            axes,
            conv: None,
            pool: None,
            relu: false,
            gate: false,
            operands: 0,
        }
    }

    /// Whether the op has a gradient for this dtype.
    pub fn differentiable(&self) -> bool {
        self.dtype.is_float()
            && match self.op {
                Op::Unary(u) => u != UnaryOp::GeluGrad,
                Op::Binary(b) => !b.is_comparison() && b != BinaryOp::ReluGrad,
                Op::Reduce(r) => r != ReduceOp::ArgMax,
                Op::Other(o) => o != OtherOp::Fill,
                // The gradient ops are checked as values (they are gradients already).
                Op::Nn(n) => matches!(
                    n,
                    NnOp::Softmax
                        | NnOp::LogSoftmax
                        | NnOp::CrossEntropy
                        | NnOp::Gather
                        | NnOp::ScatterAdd
                        | NnOp::Conv2d
                        | NnOp::MaxPool2d
                        | NnOp::AvgPool2d
                ),
                Op::Optim(_) => false,
            }
    }

    /// Which inputs receive gradients (not conditions or indices).
    pub fn grad_inputs(&self) -> Vec<usize> {
        match self.op {
            Op::Other(OtherOp::Select) => vec![1, 2],
            Op::Nn(NnOp::Gather | NnOp::CrossEntropy) => vec![0],
            Op::Nn(NnOp::ScatterAdd) => vec![0, 2],
            _ => (0..self.inputs.len()).collect(),
        }
    }

    /// Runs the op on already built inputs.
    pub fn apply(&self, x: &[Tensor]) -> Result<Tensor> {
        match self.op {
            Op::Unary(u) => x[0].unary(u),
            Op::Binary(b) => x[0].binary(b, &x[1]),
            Op::Reduce(ReduceOp::Sum) => x[0].sum(&self.axes, false),
            Op::Reduce(ReduceOp::Max) => x[0].max(&self.axes, false),
            Op::Reduce(ReduceOp::ArgMax) => x[0].argmax(self.axes[0], false),
            Op::Other(OtherOp::Matmul) => x[0].matmul(&x[1]),
            Op::Other(OtherOp::Select) => Tensor::where_(&x[0], &x[1], &x[2]),
            // A real relayout (channels-last for rank 4, else a transposed copy), then for the
            // half types an exact round trip through f32 (both cast directions).
            Op::Other(OtherOp::Convert) => {
                let r = x[0].rank();
                let y = if r == 4 {
                    x[0].to_channels_last()?
                } else {
                    x[0].transpose(0, r - 1)?.contiguous()?
                };
                if matches!(self.dtype, DType::F16 | DType::BF16) {
                    y.cast(DType::F32)?.cast(self.dtype)
                } else {
                    Ok(y)
                }
            }
            Op::Other(OtherOp::CopyInto) => Tensor::concat(&[&x[0], &x[1]], self.axes[0]),
            Op::Other(OtherOp::Fill) => Tensor::full(
                x[0].numel() as f64 * 0.5,
                x[0].shape(),
                self.dtype,
                x[0].device(),
            ),
            Op::Nn(n) => self.apply_nn(n, x),
            Op::Optim(o) => self.apply_optim(o, x),
        }
    }

    fn conv_params(&self) -> Conv2dParams {
        self.conv.unwrap_or_default()
    }

    fn pool_params(&self) -> Pool2dParams {
        self.pool.unwrap_or(Pool2dParams {
            kernel: [2, 2],
            stride: [2, 2],
            padding: [0, 0],
        })
    }

    /// The gradient reaching `x[which]` from `sum(f(x) * weights)`, computed on fresh leaves.
    fn grad_of(
        &self,
        x: &[Tensor],
        which: usize,
        f: impl Fn(&[Tensor]) -> Result<Tensor>,
    ) -> Result<Tensor> {
        let leaves: Vec<Tensor> = x
            .iter()
            .map(|t| t.detach().with_requires_grad(true))
            .collect();
        let y = f(&leaves)?;
        let w = crate::gradcheck::loss_weights(&y)?;
        y.mul(&w)?.sum(&[], false)?.backward()?;
        leaves[which]
            .grad()
            .ok_or_else(|| TensorError::Autograd(format!("input {which} got no gradient")))
    }

    fn apply_nn(&self, op: NnOp, x: &[Tensor]) -> Result<Tensor> {
        let conv = |x: &[Tensor]| x[0].conv2d(&x[1], None, self.conv_params());
        let avg = |x: &[Tensor]| x[0].avg_pool2d(self.pool_params());
        let max = |x: &[Tensor]| x[0].max_pool2d(self.pool_params());
        match op {
            NnOp::Softmax => x[0].softmax(self.axes[0]),
            NnOp::LogSoftmax => x[0].log_softmax(self.axes[0]),
            NnOp::Gather => x[0].gather(self.axes[0], &x[1]),
            NnOp::CrossEntropy => x[0].cross_entropy(&x[1], 0.1, Some(-1)),
            NnOp::ScatterAdd => x[0].scatter_add(self.axes[0], &x[1], &x[2]),
            NnOp::Conv2d => conv(x),
            NnOp::Conv2dInputGrad => self.grad_of(x, 0, conv),
            NnOp::Conv2dWeightGrad => self.grad_of(x, 1, conv),
            NnOp::MaxPool2d => max(x),
            NnOp::MaxPool2dGrad => self.grad_of(x, 0, max),
            NnOp::AvgPool2d => avg(x),
            NnOp::AvgPool2dGrad => self.grad_of(x, 0, avg),
            NnOp::RandomUniform => {
                let seed = self.inputs[0].values.len() as u64 * 7919;
                Tensor::random_uniform(x[0].shape(), self.dtype, seed, 13, x[0].device())
            }
            NnOp::BatchNormStats => {
                let gate = self.gate.then(|| &x[2]);
                let centre = (self.operands & 1 != 0).then(|| x.last()).flatten();
                let y = x[1..].first().filter(|y| y.shape() == x[0].shape());
                x[0].batch_norm_stats(y, gate, centre)
            }
            NnOp::BatchNormApply => {
                let (y, coef, gate) = match x {
                    [_, coef] => (None, coef, None),
                    [_, y, coef] => (Some(y), coef, None),
                    [_, y, coef, gate] if self.gate => (Some(y), coef, Some(gate)),
                    _ => return Err(TensorError::Shape("batch_norm_apply case".into())),
                };
                x[0].batch_norm_apply(y, coef, self.relu, gate)
            }
            NnOp::BatchNormCoef | NnOp::BatchNormStatsCoef => {
                // x: sums (or the activations themselves), weight, bias, running mean, running
                // variance (updated: copies), and with the sums the centre they were taken about.
                let has = |bit: u8| self.operands & (1 << bit) != 0;
                let (mean, var) = (x[3].contiguous_copy()?, x[4].contiguous_copy()?);
                let with_sums = op == NnOp::BatchNormCoef;
                let p = BatchNormCoefParams {
                    count: if with_sums {
                        COEF_COUNT
                    } else {
                        per_channel(&x[0])
                    },
                    eps: 1e-5,
                    momentum: 0.1,
                    residual: has(3),
                };
                let (weight, bias) = (has(0).then_some(&x[1]), has(1).then_some(&x[2]));
                let running = has(2).then_some((&mean, &var));
                let (coef, saved) = if with_sums {
                    let centre = has(4).then_some(&x[5]);
                    Tensor::batch_norm_coef(&x[0], centre, self.dtype, weight, bias, running, &p)?
                } else {
                    x[0].batch_norm_stats_coef(weight, bias, running, &p)?
                };
                flat_concat(&[coef, saved, mean, var])
            }
            NnOp::BatchNormGradCoef => {
                // x: sums, saved [mean; rstd], weight.
                let weight = (self.operands & 1 != 0).then_some(&x[2]);
                let (coef, dw, db) =
                    Tensor::batch_norm_grad_coef(&x[0], self.dtype, &x[1], weight, COEF_COUNT)?;
                flat_concat(&[coef, dw, db])
            }
            NnOp::BatchNormGradStatsCoef => {
                // x: the activations, their gradient, saved [mean; rstd], weight (, gate).
                let weight = (self.operands & 1 != 0).then_some(&x[3]);
                let gate = self.gate.then(|| &x[4]);
                let (coef, dw, db) = x[0].batch_norm_grad_stats_coef(
                    &x[1],
                    gate,
                    &x[2],
                    weight,
                    per_channel(&x[0]),
                )?;
                flat_concat(&[coef, dw, db])
            }
            NnOp::NormalizeInput => Tensor::normalize_input(
                &x[0],
                &[0.485, 0.456, 0.406],
                &[0.229, 0.224, 0.225],
                self.dtype,
            ),
        }
    }

    /// Runs the in-place op on fresh copies of the inputs and returns everything it updated,
    /// flattened and joined.
    fn apply_optim(&self, op: OptimOp, x: &[Tensor]) -> Result<Tensor> {
        let fresh: Vec<Tensor> = x
            .iter()
            .map(|t| t.contiguous_copy())
            .collect::<Result<_>>()?;
        let dev = x[0].device();
        let scalar = |v: f64| Tensor::full(v, &[1], self.dtype, dev);
        let found_inf = scalar(0.0)?;
        let updated: Vec<Tensor> = match op {
            OptimOp::Sgd => {
                let p = SgdParams {
                    lr_scale: 0.5,
                    momentum: 0.9,
                    dampening: 0.25,
                    weight_decay: 0.01,
                    nesterov: true,
                };
                // Two updates from step 0: the first fills the buffer with the gradient, the
                // second blends; the learning rate (a device scalar) changes between them.
                let (step, lr) = (scalar(0.0)?, scalar(0.2)?);
                let (params, grads, bufs) = ([&fresh[0]], [&fresh[1]], [&fresh[2]]);
                optim::sgd(&params, &grads, &bufs, &step, &lr, &p, Some(&found_inf))?;
                lr.copy_from_f64s(&[0.1])?;
                optim::sgd(&params, &grads, &bufs, &step, &lr, &p, Some(&found_inf))?;
                vec![fresh[0].clone(), fresh[2].clone(), step]
            }
            OptimOp::AdamW => {
                let p = AdamWParams {
                    lr_scale: 0.5,
                    beta1: 0.9,
                    beta2: 0.999,
                    eps: 1e-8,
                    weight_decay: 0.01,
                };
                let (step, lr) = (scalar(3.0)?, scalar(0.02)?);
                let (params, grads) = ([&fresh[0]], [&fresh[1]]);
                let (m, v) = ([&fresh[2]], [&fresh[3]]);
                optim::adamw(&params, &grads, &m, &v, &step, &lr, &p, Some(&found_inf))?;
                vec![fresh[0].clone(), fresh[2].clone(), fresh[3].clone(), step]
            }
            OptimOp::UnscaleCheck => {
                optim::unscale_check(&[&fresh[0]], &scalar(0.5)?, &found_inf)?;
                vec![fresh[0].clone(), found_inf]
            }
            OptimOp::SumSquares => {
                let all: Vec<&Tensor> = fresh.iter().collect();
                vec![optim::sum_squares(&all)?]
            }
            OptimOp::ScalerUpdate => {
                let (scale, tracker) = (scalar(65536.0)?, scalar(1.0)?);
                let p = ScalerParams {
                    growth_interval: 2,
                    ..ScalerParams::default()
                };
                optim::scaler_update(&scale, &tracker, &found_inf, &p)?;
                vec![scale, tracker, found_inf]
            }
        };
        let flat: Vec<Tensor> = updated.iter().map(|t| t.flatten()).collect::<Result<_>>()?;
        Tensor::concat(&flat.iter().collect::<Vec<_>>(), 0)
    }
}
