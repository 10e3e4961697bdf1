//! `Device`: a cheap, clonable handle to a backend (DESIGN.md, contract 3).

use std::fmt;
use std::sync::Arc;

use crate::backend::{Backend, Event, Graph, Op, Timestamp};
use crate::dtype::DType;
use crate::error::{Result, TensorError};

/// A handle to a backend. Two handles are the same device when they share the backend instance.
#[derive(Clone)]
pub struct Device(Arc<dyn Backend>);

impl Device {
    pub fn new(backend: Arc<dyn Backend>) -> Self {
        Self(backend)
    }

    /// The f64 reference implementation (plain loops; the yardstick for every backend).
    pub fn reference() -> Self {
        Self(Arc::new(crate::reference::Reference::new()))
    }

    pub fn backend(&self) -> &dyn Backend {
        &*self.0
    }

    pub fn name(&self) -> String {
        self.0.name()
    }

    /// Errors with [`TensorError::Unsupported`] unless the backend declares `(op, dtype)`.
    pub fn check(&self, op: Op, dtype: DType) -> Result<()> {
        if self.0.supports(op, dtype) {
            Ok(())
        } else {
            Err(TensorError::Unsupported {
                op,
                dtype,
                device: self.name(),
            })
        }
    }

    /// Waits for all enqueued work.
    pub fn synchronize(&self) -> Result<()> {
        self.0.synchronize()
    }

    /// The point after every op enqueued so far ([`Backend::record_event`]); no waiting.
    pub fn record_event(&self) -> Result<Event> {
        self.0.record_event()
    }

    /// Ops enqueued from now on wait on the device for `event` ([`Backend::wait_event`]).
    pub fn wait_event(&self, event: &Event) -> Result<()> {
        self.0.wait_event(event)
    }

    /// Runs `f` once with the device capturing instead of running ([`Backend::begin_capture`])
    /// and returns the graph with `f`'s result; replaying the graph does what `f` enqueued,
    /// again, with the same addresses and values. Capture ends however `f` ends; an error of
    /// `f` (a refused download, say) discards it. Tensors `f` returns live in the graph's
    /// memory: each replay rewrites them.
    pub fn capture<T>(&self, f: impl FnOnce() -> Result<T>) -> Result<(Graph, T)> {
        self.0.begin_capture()?;
        let result = f();
        let graph = self.0.end_capture();
        let value = result?;
        Ok((graph?, value))
    }

    /// Enqueues a reading of the device clock after the work enqueued so far
    /// ([`Backend::timestamp`]); `None` where host timers are exact (synchronous backends).
    pub fn timestamp(&self) -> Result<Option<Timestamp>> {
        self.0.timestamp()
    }

    /// The nanosecond readings of `stamps`, once the device has taken them.
    pub fn read_timestamps(&self, stamps: &[Timestamp]) -> Result<Vec<u64>> {
        self.0.read_timestamps(stamps)
    }

    /// A profiler range named `name` until the guard drops ([`Backend::annotate`]).
    pub fn annotate(&self, name: &str) -> crate::backend::Annotation {
        self.0.annotate(name)
    }

    /// The host allocator for loader pools feeding this device ([`Backend::host_allocator`]).
    pub fn host_allocator(&self) -> Option<std::sync::Arc<dyn redline_hostmem::HostAllocator>> {
        self.0.host_allocator()
    }

    /// What the device's caching allocator holds ([`Backend::memory_stats`]).
    pub fn memory_stats(&self) -> Option<crate::MemoryStats> {
        self.0.memory_stats()
    }
}

impl PartialEq for Device {
    fn eq(&self, other: &Self) -> bool {
        self.0.id() == other.0.id()
    }
}

impl Eq for Device {}

impl fmt::Debug for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Device({})", self.name())
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name())
    }
}
