//! The input op (DESIGN contract 6): a u8 NHWC batch from the loader becomes a normalised float
//! NCHW tensor stored channels-last, on the device — host-to-device traffic stays 1 byte a value.

use crate::backend::{NnOp, Op};
use crate::dtype::DType;
use crate::error::{Result, TensorError};
use crate::layout::Layout;
use crate::tensor::Tensor;

impl Tensor {
    /// `batch` (u8 `[N, H, W, C]`) → `(batch / 255 - mean[c]) / std[c]` as `dtype`, logically
    /// `[N, C, H, W]`, stored channels-last.
    pub fn normalize_input(
        batch: &Tensor,
        mean: &[f64],
        std: &[f64],
        dtype: DType,
    ) -> Result<Tensor> {
        let s = batch.shape();
        if batch.dtype() != DType::U8 || s.len() != 4 || mean.len() != s[3] || std.len() != s[3] {
            return Err(TensorError::shape(format!(
                "normalize_input: batch {} {s:?} with {} means and {} stds (need u8 [N, H, W, C] and C of each)",
                batch.dtype(),
                mean.len(),
                std.len()
            )));
        }
        if std.iter().any(|&v| v == 0.0 || !v.is_finite()) {
            return Err(TensorError::shape(format!(
                "normalize_input: std {std:?} has a zero or non-finite value"
            )));
        }
        batch.device().check(Op::Nn(NnOp::NormalizeInput), dtype)?;
        let out = Layout::channels_last(&[s[0], s[3], s[1], s[2]])?;
        let storage = batch
            .backend()
            .normalize_input(batch.view(), mean, std, dtype, &out)?;
        Ok(Tensor::from_storage(storage, out, batch.device().clone()))
    }
}
