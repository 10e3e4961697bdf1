//! The prefetch loader: sample order, then (coming) decode and augment on every core into pooled
//! host buffers. It depends on `redline-shard` and `redline-hostmem` only, so it serves any
//! tensor library.
//!
//! Built so far: [`order`] — the sample order as a pure function of (seed, epoch, rank, world),
//! with DistributedSampler-style padding or dropping and a checkpointable resume position.

pub mod order;

pub use order::{Mode, Order, OrderError, Position, Uneven};
