//! A test case: an op, a dtype, host-side inputs (shape, values, view) — buildable on any device
//! so the backend under test and the reference see identical inputs.

use redline_tensor::{DType, Device, Op, OtherOp, ReduceOp, Result, Tensor, UnaryOp};

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
    /// Reduction axes (one for argmax), or the concat axis.
    pub axes: Vec<usize>,
}

impl Case {
    /// Whether the op has a gradient for this dtype.
    pub fn differentiable(&self) -> bool {
        self.dtype.is_float()
            && match self.op {
                Op::Unary(u) => u != UnaryOp::GeluGrad,
                Op::Binary(b) => !b.is_comparison(),
                Op::Reduce(r) => r != ReduceOp::ArgMax,
                Op::Other(o) => o != OtherOp::Fill,
            }
    }

    /// Which inputs receive gradients (not `where`'s condition).
    pub fn grad_inputs(&self) -> Vec<usize> {
        match self.op {
            Op::Other(OtherOp::Select) => vec![1, 2],
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
        }
    }
}

/// Whether a binary op is a comparison (u8 output).
pub fn is_comparison(op: Op) -> bool {
    matches!(op, Op::Binary(b) if b.is_comparison())
}
