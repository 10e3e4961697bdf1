//! Modules with named parameters and buffers, deterministic initialisation, and the ResNet
//! family with torchvision's names and shapes (so checkpoints map one to one).
//!
//! Built so far: the [`Module`] trait and its state dict, [`Init`] (counter-based, so a model's
//! weights are a pure function of its seed on every backend), the layers a ResNet needs
//! ([`layers`]) and [`resnet`]. Optimizers and LR schedules come next (issue 7).

pub mod init;
pub mod layers;
pub mod module;
pub mod resnet;

pub use init::Init;
pub use layers::{BatchNorm2d, Conv2d, Linear, MaxPool2d, ReLU, Sequential};
pub use module::{named_parameters, num_parameters, state_dict, Kind, Module};
pub use resnet::{ResNet, ResNetConfig};
