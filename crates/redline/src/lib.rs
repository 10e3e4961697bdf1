//! redline: a training stack that keeps the GPU busy. This facade re-exports the tensor API and
//! picks devices: [`registry::best`] ranks what the machine has (DESIGN.md, contract 3).

pub mod registry;

pub use redline_tensor::*;

/// The README's example, compiled and run as a doctest.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
