//! Mixed precision with PyTorch's semantics (DESIGN contract 8).
//!
//! - [`autocast`]: a scope in which convolutions and matrix products run in f16 or bf16 while
//!   normalisation statistics, softmax, losses and reductions stay in f32. Parameters stay f32
//!   (the master weights); their low-precision copies are cast once per scope and cached, and
//!   gradients flow back through the cast into the f32 masters.
//! - [`GradScaler`]: loss scaling with a device-side scale, growth tracker and found-inf flag,
//!   so a training step needs no host synchronisation.
//!
//! Layers consult the policy through [`for_compute`] (conv, matmul) and [`for_f32`]
//! (losses; batch norm where it is not fused — fused, it keeps its statistics in f32 inside
//! and its activations in their half dtype); outside a scope both return their input
//! unchanged.

mod autocast;
mod scaler;

pub use autocast::{
    autocast, autocast_dtype, for_compute, for_compute_channels_last, for_f32, Autocast,
};
pub use scaler::GradScaler;

/// The README's example, compiled and run as a doctest.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
