//! Errors: readable messages with the shapes, dtypes and devices involved. Never a panic.

use crate::backend::Op;
use crate::dtype::DType;

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum TensorError {
    /// Shapes that do not fit the op.
    #[error("shape error: {0}")]
    Shape(String),
    /// Dtypes that do not fit the op (mixing without a cast, an integer where a float is needed).
    #[error("dtype error: {0}")]
    DType(String),
    /// Tensors on different devices, or a storage that belongs to another backend.
    #[error("device error: {0}")]
    Device(String),
    /// The device does not declare this (op, dtype) pair.
    #[error("{device} does not support {op} on {dtype} (see its declared op/dtype matrix)")]
    Unsupported {
        op: Op,
        dtype: DType,
        device: String,
    },
    /// Autograd misuse (backward twice, a non-scalar root without a gradient).
    #[error("autograd: {0}")]
    Autograd(String),
    /// An API used out of order (an optimizer update before any learning rate was set).
    #[error("usage error: {0}")]
    Usage(String),
    /// The backend failed (out of memory, a driver error).
    #[error("backend {device}: {what}")]
    Backend { device: String, what: String },
}

impl TensorError {
    pub(crate) fn shape(what: impl Into<String>) -> Self {
        Self::Shape(what.into())
    }

    pub(crate) fn dtype(what: impl Into<String>) -> Self {
        Self::DType(what.into())
    }
}

pub type Result<T, E = TensorError> = std::result::Result<T, E>;
