//! One file per op family, each with its kernels.

pub(crate) mod batch_norm;
pub(crate) mod conv;
pub(crate) mod elementwise;
pub(crate) mod matmul;
pub(crate) mod nn;
pub(crate) mod optim;
pub(crate) mod pool;
pub(crate) mod reduce;
