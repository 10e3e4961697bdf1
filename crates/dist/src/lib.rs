//! Data-parallel training for redline: one process per device, launched the way PyTorch jobs
//! are (torchrun, `srun`, a Kubernetes job, or `cargo xtask train --nproc N`).
//!
//! * [`Launch`] — where this process stands: torchrun's RANK, WORLD_SIZE, LOCAL_RANK,
//!   MASTER_ADDR and MASTER_PORT (and its agent's store, when there is one).
//! * [`StoreClient`] / [`StoreServer`] — PyTorch's TCPStore protocol: the key-value store ranks
//!   meet in. A client of torchrun's own store, or served by rank 0 without it.
//! * [`Collective`] — all-reduce, broadcast and barrier over tensors; [`TcpCollective`] is the
//!   CPU implementation (TCP, a star around rank 0, for tests and CPU training),
//!   [`NcclCollective`] the one for CUDA devices (NCCL on a stream of its own, ordered by
//!   events; the `nccl` feature, on by default).
//! * [`DataParallel`] — gradients averaged in buckets as soon as backward completes them,
//!   overlapping the rest of backward (PyTorch DDP's reducer).
//! * [`SyncBatchStats`] — synchronised batch norm: statistics over every rank's batch.
//!
//! Every wait has a timeout: a rank that never arrives, dies or stalls makes every other rank
//! fail with an error naming it, instead of hanging the job.

mod collective;
mod data_parallel;
mod env;
mod error;
#[cfg(feature = "nccl")]
mod nccl;
mod rendezvous;
mod store;
mod sync_batch_norm;
mod tcp;

pub use collective::{Collective, Reduce, SingleProcess};
pub use data_parallel::{buckets, BucketLaunch, DataParallel, DEFAULT_BUCKET_BYTES};
pub use env::Launch;
pub use error::{DistError, Result};
#[cfg(feature = "nccl")]
pub use nccl::NcclCollective;
pub use rendezvous::{connect, connect_device, timeout_from_env, DEFAULT_TIMEOUT};
pub use store::{Store, StoreClient, StoreServer};
pub use sync_batch_norm::SyncBatchStats;
pub use tcp::TcpCollective;

/// The README's example, compiled and run as a doctest.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
