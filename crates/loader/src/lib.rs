//! The prefetch loader: decode and augment on every core into pooled host buffers. It depends on
//! `redline-shard` and `redline-hostmem` only, so it serves any tensor library.
//!
//! * [`order`] — the sample order as a pure function of (seed, epoch, rank, world), with
//!   DistributedSampler-style padding or dropping and a checkpointable resume position;
//! * [`decode`] — libjpeg-turbo (feature `turbojpeg`: cropped, DCT-scaled decodes) or zune-jpeg
//!   (pure Rust), with the `image` crate as fallback;
//! * [`resize`] — PIL's antialiased bilinear crop-and-resize (bit-exact against PIL fixtures);
//! * [`augment`] — torchvision's RandomResizedCrop / flip / eval-crop geometry keyed per sample;
//! * [`pipeline`] — persistent workers building whole batches, prefetched and in order.

pub mod augment;
pub mod decode;
pub mod order;
pub mod pipeline;
pub mod resident;
pub mod resize;

pub use augment::{eval_geometry, train_params, EvalGeometry, TrainParams};
pub use decode::{scale_denominator, Codec, DecodeError, Decoded, Decoder, Image, Region};
pub use order::{Mode, Order, OrderError, Position, Uneven};
pub use pipeline::{Batch, BatchStats, Config, Loader, LoaderError, OnBadSample, Skipped};
pub use resident::Resident;
pub use resize::{flip_horizontal, Crop, Resizer};

/// The README's example, compiled and run as a doctest.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
