//! The layers a ResNet is made of, one per file, each a [`Module`](crate::Module).

mod activation;
mod batch_norm;
mod conv;
mod linear;
mod pool;
mod sequential;

pub use activation::ReLU;
pub use batch_norm::{BatchNorm2d, BatchNormReLU, BatchStatsSync};
pub use conv::Conv2d;
pub use linear::Linear;
pub use pool::{GlobalAvgPool, MaxPool2d};
pub use sequential::Sequential;
