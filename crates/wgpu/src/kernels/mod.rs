//! The kernels, one family per file, each a WGSL template and the Rust that launches it.

pub(crate) mod elementwise;
pub(crate) mod matmul;
pub(crate) mod reduce;
