//! Copies with conversion: dtype casts, contiguous, channels-last.

use crate::backend::{Op, OtherOp};
use crate::dtype::DType;
use crate::error::{Result, TensorError};
use crate::layout::Layout;
use crate::tensor::Tensor;

impl Tensor {
    /// The same values in `dtype` (rounded; float → integer truncates toward zero). Gradients
    /// flow back through casts between float dtypes.
    pub fn cast(&self, dtype: DType) -> Result<Tensor> {
        if dtype == self.dtype() {
            return Ok(self.clone());
        }
        self.convert(dtype, self.layout().output_like())
    }

    /// A row-major copy (or this tensor, when it already is row-major).
    pub fn contiguous(&self) -> Result<Tensor> {
        if self.layout().is_contiguous() {
            return Ok(self.clone());
        }
        self.convert(self.dtype(), Layout::contiguous(self.shape()))
    }

    /// The same NCHW tensor stored channels-last (NHWC in memory), as PyTorch's
    /// `memory_format=torch.channels_last`.
    pub fn to_channels_last(&self) -> Result<Tensor> {
        let layout = Layout::channels_last(self.shape())?;
        if self.layout() == &layout {
            return Ok(self.clone());
        }
        self.convert(self.dtype(), layout)
    }

    /// The values in `dtype`, stored channels-last, in one copy (autocast's low-precision conv
    /// weight beside channels-last activations: cuDNN's NHWC kernels take KRSC filters, and
    /// PyTorch's channels-last models carry their weights so).
    pub fn cast_channels_last(&self, dtype: DType) -> Result<Tensor> {
        let layout = Layout::channels_last(self.shape())?;
        if self.dtype() == dtype && self.layout() == &layout {
            return Ok(self.clone());
        }
        self.convert(dtype, layout)
    }

    /// Whether the tensor is stored channels-last.
    pub fn is_channels_last(&self) -> bool {
        Layout::channels_last(self.shape()).is_ok_and(|l| self.layout().strides() == l.strides())
    }

    /// A fresh row-major copy with its own storage (for in-place updates), off the tape.
    pub fn contiguous_copy(&self) -> Result<Tensor> {
        Ok(self
            .convert(self.dtype(), Layout::contiguous(self.shape()))?
            .detach())
    }

    /// A fresh copy in `dtype` and layout `out` (always a new storage).
    pub(crate) fn convert_to(&self, dtype: DType, out: Layout) -> Result<Tensor> {
        self.convert(dtype, out)
    }

    fn convert(&self, dtype: DType, out: Layout) -> Result<Tensor> {
        self.device()
            .check(Op::Other(OtherOp::Convert), self.dtype())?;
        self.device().check(Op::Other(OtherOp::Convert), dtype)?;
        let storage = self.backend().convert(self.view(), dtype, &out)?;
        let y = Tensor::from_storage(storage, out, self.device().clone());
        if !(dtype.is_float() && self.dtype().is_float()) {
            return Ok(y);
        }
        // A cast's gradient is cast back in the same one copy into the source's own order: an
        // OIHW master weight gets the gradient of its channels-last low-precision copy as OIHW
        // (the layout its optimizer state has) with no second, transposing copy. A relayout in
        // one dtype hands the gradient on as it is (the leaf's accumulation orders it if needed).
        let (from, back) = (self.dtype(), self.layout().output_like());
        Ok(y.record("convert", &[self], move |g| {
            let gx = match g.dtype() == from {
                true => g.clone(),
                false => g.convert(from, back.clone())?,
            };
            Ok(vec![Some(gx)])
        }))
    }

    /// Overwrites this tensor's elements with `src`'s (same shape and dtype), in place and off
    /// the tape: for state that is updated between steps (batch norm's counters, optimizer
    /// state, checkpoint loading).
    pub fn assign(&self, src: &Tensor) -> Result<()> {
        self.same_dtype(src, "assign")?;
        self.same_device(src, "assign")?;
        self.write_region(self.layout(), src)
    }

    /// Writes `src` into the region `at` of this tensor's storage, in place (no autograd: use it
    /// to build fresh tensors, or under `no_grad` for updates).
    pub(crate) fn write_region(&self, at: &Layout, src: &Tensor) -> Result<()> {
        if at.shape() != src.shape() {
            return Err(TensorError::shape(format!(
                "copy_into: region {:?} and source {:?}",
                at.shape(),
                src.shape()
            )));
        }
        self.device()
            .check(Op::Other(OtherOp::CopyInto), self.dtype())?;
        self.backend().copy_into(self.storage(), at, src.view())
    }
}
