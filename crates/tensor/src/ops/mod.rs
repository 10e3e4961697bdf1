//! The op set, one family per file: the tensor-level API (checks, broadcasting, output layout),
//! its backward, and the reference kernel beside it.

pub(crate) mod conv;
pub(crate) mod convert;
pub(crate) mod elementwise;
pub(crate) mod input;
pub(crate) mod matmul;
pub(crate) mod nn;
pub(crate) mod norm;
pub mod optim;
pub(crate) mod random;
pub(crate) mod reduce;
pub(crate) mod shape;
