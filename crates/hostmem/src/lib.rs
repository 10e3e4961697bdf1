//! Host memory for data that is on its way to a device.
//!
//! Two pieces, both deliberately small:
//!
//! * [`HostAllocator`] — where host buffers come from. The default, [`PageAligned`], hands out
//!   zeroed, page-aligned memory from the global allocator. A GPU backend supplies its own
//!   (the CUDA backend: page-locked memory from `cuMemHostAlloc`, so copies run as DMA without a
//!   staging copy); nothing else in redline needs to know which one is in use.
//! * [`BufferPool`] — a fixed set of equally sized buffers allocated once and recycled. A buffer
//!   leaves the pool as a [`PooledBuffer`] and comes back only when its last user says it is done
//!   (by dropping it or calling [`PooledBuffer::release`]). The loader fills a buffer, hands it to
//!   the consumer, the consumer hands it to an upload, and the upload drops it only after the
//!   device copy has completed — so no one can overwrite bytes that are still in flight
//!   (DESIGN.md, contract 7).
//!
//! The crate has no redline dependency: the loader and the tensor core both build on it.

mod alloc;
mod pool;

pub use alloc::{HostAllocator, HostBuffer, PageAligned, PAGE_SIZE};
pub use pool::{BufferPool, PoolStats, PooledBuffer};

/// What can go wrong when asking for host memory.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum HostMemError {
    /// The allocator could not provide `bytes` bytes.
    #[error("host allocator '{allocator}' could not allocate {bytes} bytes: {reason}")]
    OutOfMemory {
        allocator: String,
        bytes: usize,
        reason: String,
    },
    /// A buffer pool needs at least one buffer.
    #[error("a buffer pool needs at least one buffer (asked for 0)")]
    EmptyPool,
    /// The pool was closed; waiting for a buffer would never end.
    #[error("the buffer pool was closed")]
    Closed,
}

/// The README's example, compiled and run as a doctest.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
