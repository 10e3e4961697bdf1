//! Tensors, dtypes, devices, the Backend trait, autograd and the f64 reference implementation.
//!
//! * [`Tensor`] — a strided view of an opaque device [`Storage`] on a [`Device`]; views
//!   (reshape, permute, transpose, narrow, broadcast, channels-last) share storage.
//! * [`Backend`] — the one small, object-safe trait every device implements, grouped by op family
//!   ([`UnaryOp`], [`BinaryOp`], [`ReduceOp`], [`OtherOp`]); each backend declares its
//!   (op, dtype) matrix and the front end refuses undeclared pairs with a clear error.
//! * Autograd — reverse mode on a tape recorded as ops run: `backward()`, accumulating `.grad()`,
//!   [`no_grad`], `detach`, `with_requires_grad`; the tape is freed as backward consumes it.
//! * [`reference::Reference`] — every op as plain f64 loops: the yardstick for every backend.
//!
//! ```
//! use redline_tensor::{Device, Tensor};
//! # fn main() -> redline_tensor::Result<()> {
//! let dev = Device::reference();
//! let x = Tensor::from_slice(&[1.0f32, 2.0, 3.0], &[3], &dev)?.with_requires_grad(true);
//! let y = x.mul(&x)?.sum(&[], false)?; // sum of squares
//! y.backward()?;
//! assert_eq!(x.grad().unwrap().to_vec::<f32>()?, [2.0, 4.0, 6.0]);
//! # Ok(()) }
//! ```

mod autograd;
pub mod backend;
mod device;
pub mod dtype;
mod error;
pub mod layout;
mod ops;
pub mod reference;
mod tensor;

pub use autograd::{is_grad_enabled, no_grad, NoGradGuard};
pub use backend::{
    batch_norm_shift, batch_norm_stats_coef_composed, first_of_each_channel, saved_mean,
    stats_dtype, with_batch_norm_sums, AdamWParams, Annotation, Backend, BatchNormCoefParams,
    BinaryOp, Conv2dParams, Download, DownloadOf, Event, Graph, HostBytes, MemoryStats, NnOp, Op,
    OptimOp, OtherOp, Pool2dParams, ReduceOp, Replay, ScalerParams, SgdParams, Storage, Timestamp,
    UnaryOp, View, TIMESTAMP_SLOTS,
};
pub use device::Device;
pub use dtype::{DType, Element};
pub use error::{Result, TensorError};
pub use layout::Layout;
pub use ops::norm::RunningStats;
pub use ops::optim;
pub use ops::random::RandomStream;
pub use tensor::{GradHook, PendingVec, Tensor};

/// The reference kernels' scalar formulas, shared with host backends that apply them per element
/// (one definition of GELU, Philox, cross-entropy, SGD and AdamW, not one per backend).
pub mod scalar {
    pub use crate::ops::elementwise::reference::{binary, erf, unary};
    pub use crate::ops::nn::reference::cross_entropy;
    pub use crate::ops::optim::reference::{adamw, sgd};
    pub use crate::ops::random::reference::{philox, uniform};
}

/// The README's example, compiled and run as a doctest.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
