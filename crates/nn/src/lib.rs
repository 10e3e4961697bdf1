//! Modules with named parameters and buffers, deterministic initialisation, and the ResNet
//! family with torchvision's names and shapes (so checkpoints map one to one).
//!
//! Built so far: the [`Module`] trait and its state dict, [`Init`] (counter-based, so a model's
//! weights are a pure function of its seed on every backend), the layers a ResNet needs
//! ([`layers`]), [`resnet`], SGD, AdamW and LARS with parameter groups, gradient clipping
//! and a weight EMA on the multi-tensor device ops ([`optim`]), and PyTorch's LR schedules
//! ([`schedule`]).

pub mod init;
pub mod layers;
pub mod module;
pub mod optim;
pub mod resnet;
pub mod schedule;

pub use init::Init;
pub use layers::{BatchNorm2d, BatchStatsSync, Conv2d, Linear, MaxPool2d, ReLU, Sequential};
pub use module::{named_parameters, num_parameters, state_dict, Kind, Module};
pub use optim::{
    clip_grad_norm, decay_groups, zero_grad, AdamW, Ema, Lars, Optimizer, ParamGroup, Sgd,
};
pub use resnet::{ResNet, ResNetConfig};
pub use schedule::Schedule;

/// The README's example, compiled and run as a doctest.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
