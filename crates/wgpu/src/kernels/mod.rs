//! The kernels, one family per file, each a WGSL template and the Rust that launches it.

pub(crate) mod conv;
pub(crate) mod elementwise;
pub(crate) mod gemm;
pub(crate) mod loss;
pub(crate) mod matmul;
pub(crate) mod nn;
pub(crate) mod norm;
pub(crate) mod optim;
pub(crate) mod reduce;
