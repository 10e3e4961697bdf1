//! The prefetch loader: sample order, then (coming) decode and augment on every core into pooled
//! host buffers. It depends on `redline-shard` and `redline-hostmem` only, so it serves any
//! tensor library.
//!
//! Built so far: [`order`] — the sample order as a pure function of (seed, epoch, rank, world),
//! with DistributedSampler-style padding or dropping and a checkpointable resume position — and
//! [`resize`], PIL's antialiased bilinear crop-and-resize (bit-exact against PIL fixtures), and
//! [`augment`], torchvision's RandomResizedCrop / flip / eval-crop geometry keyed per sample.

pub mod augment;
pub mod decode;
pub mod order;
pub mod pipeline;
pub mod resize;

pub use augment::{eval_geometry, train_params, EvalGeometry, TrainParams};
pub use decode::{DecodeError, Decoder, Image};
pub use order::{Mode, Order, OrderError, Position, Uneven};
pub use pipeline::{Batch, BatchStats, Config, Loader, LoaderError, OnBadSample, Skipped};
pub use resize::{flip_horizontal, Crop, Resizer};
