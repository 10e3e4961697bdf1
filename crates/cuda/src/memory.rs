//! The caching allocator: device memory is taken from the [`Gpu`] once and reused, so a
//! training step's steady state allocates nothing from the device (no cudaMalloc, no
//! cuMemAllocAsync). Blocks are kept in size classes and reused in stream order: the backend has
//! one stream, and a storage is dropped only after every op that uses it was enqueued, so a
//! later op that gets its block runs after them.
//!
//! Size classes: multiples of 512 bytes up to 1 MiB; above, eight classes per power of two (at
//! most 12.5% rounding). On the emulator every size is its own class, so its guard bytes sit
//! right after each storage. Statistics (in use, reserved, peak, device allocations, reuses) are
//! kept, an optional cap bounds what is reserved, and running out of memory — the cap or the
//! device — first returns every cached block to the device and retries, then fails with an error
//! that prints the statistics.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use redline_tensor::{MemoryStats, Result, TensorError};

use crate::gpu::{DevicePtr, Gpu};

/// The size class of a request: what is really allocated for it.
pub fn size_class(bytes: usize) -> usize {
    const SMALL: usize = 512;
    const LARGE: usize = 1 << 20;
    let bytes = bytes.max(1);
    if bytes <= LARGE {
        return bytes.div_ceil(SMALL) * SMALL;
    }
    // Eight steps between consecutive powers of two.
    let power = usize::BITS - 1 - (bytes - 1).leading_zeros();
    let step = (1usize << power) / 8;
    bytes.div_ceil(step) * step
}

#[derive(Debug, Default)]
struct State {
    free: BTreeMap<usize, Vec<DevicePtr>>,
    stats: MemoryStats,
    /// The graph being captured: the number of its memory, and the blocks it has been given
    /// back, free for its later ops (reuse within a capture follows its stream order).
    capture: Option<(u64, BTreeMap<usize, Vec<DevicePtr>>)>,
    /// Blocks a graph's ops use: never in the general cache while that graph lives (a replay
    /// writes them), whether or not a storage still holds them.
    owned: HashMap<u64, Owned>,
    next_graph: u64,
}

#[derive(Debug, Clone, Copy)]
struct Owned {
    class: usize,
    /// The graph, or `None` once it is gone (the block then waits for its storage only).
    graph: Option<u64>,
    /// Whether a storage holds the block.
    held: bool,
}

/// The allocator of one device.
#[derive(Debug)]
pub struct MemoryPool {
    gpu: Arc<dyn Gpu>,
    cap: Option<usize>,
    state: Mutex<State>,
}

impl MemoryPool {
    /// A pool over `gpu`; `cap` bounds the bytes reserved (None: the device's memory).
    pub fn new(gpu: Arc<dyn Gpu>, cap: Option<usize>) -> Self {
        Self {
            gpu,
            cap,
            state: Mutex::new(State::default()),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The GPU this pool allocates from.
    pub fn gpu(&self) -> &Arc<dyn Gpu> {
        &self.gpu
    }

    pub fn stats(&self) -> MemoryStats {
        self.state().stats
    }

    /// A block of at least `bytes`, and its class (pass it back to [`release`](Self::release)).
    /// During a capture the block belongs to the graph from then on.
    pub fn allocate(&self, bytes: usize) -> Result<(DevicePtr, usize)> {
        let class = if self.gpu.exact_sizes() {
            bytes.max(1)
        } else {
            size_class(bytes)
        };
        let mut state = self.state();
        let (ptr, class) = self.take(&mut state, bytes, class)?;
        if let Some((graph, _)) = state.capture {
            let owned = Owned {
                class,
                graph: Some(graph),
                held: true,
            };
            state.owned.insert(ptr.0, owned);
        }
        Ok((ptr, class))
    }

    fn take(&self, state: &mut State, bytes: usize, class: usize) -> Result<(DevicePtr, usize)> {
        let captured = state
            .capture
            .as_mut()
            .and_then(|(_, free)| free.get_mut(&class));
        if let Some(ptr) = captured.and_then(Vec::pop) {
            state.stats.reuses += 1;
            Self::count_in(&mut state.stats, class);
            return Ok((ptr, class));
        }
        if let Some(ptr) = state.free.get_mut(&class).and_then(Vec::pop) {
            state.stats.reuses += 1;
            Self::count_in(&mut state.stats, class);
            return Ok((ptr, class));
        }
        let over_cap = |s: &State| self.cap.is_some_and(|cap| s.stats.reserved + class > cap);
        if over_cap(state) {
            self.empty_cache_locked(state);
        }
        if over_cap(state) {
            return Err(self.out_of_memory(state, bytes, "the memory cap"));
        }
        let ptr = match self.gpu.alloc(class) {
            Ok(ptr) => ptr,
            Err(first) => {
                // The device is full: give back what is cached and try once more.
                self.empty_cache_locked(state);
                self.gpu
                    .alloc(class)
                    .map_err(|_| self.out_of_memory(state, bytes, &first.to_string()))?
            }
        };
        state.stats.device_allocations += 1;
        state.stats.reserved += class;
        Self::count_in(&mut state.stats, class);
        Ok((ptr, class))
    }

    fn count_in(stats: &mut MemoryStats, class: usize) {
        stats.in_use += class;
        stats.peak_in_use = stats.peak_in_use.max(stats.in_use);
    }

    /// Takes a block back into the cache (stream-ordered reuse: see the module docs). A block a
    /// graph uses stays with it; one given back during a capture joins the graph being
    /// captured (its earlier ops may use it, and every replay will).
    pub fn release(&self, ptr: DevicePtr, class: usize) {
        let mut state = self.state();
        state.stats.in_use -= class;
        let capturing = state.capture.as_ref().map(|(graph, _)| *graph);
        let owned = state.owned.get(&ptr.0).copied();
        match (owned, capturing) {
            (Some(o), Some(g)) if o.graph == Some(g) => self.to_capture(&mut state, ptr, class),
            (Some(Owned { graph: Some(_), .. }), _) => {
                if let Some(o) = state.owned.get_mut(&ptr.0) {
                    o.held = false;
                }
            }
            (Some(Owned { graph: None, .. }), capturing) => {
                state.owned.remove(&ptr.0);
                match capturing {
                    // The capture's ops may have used it: it joins that graph.
                    Some(_) => self.to_capture(&mut state, ptr, class),
                    None => state.free.entry(class).or_default().push(ptr),
                }
            }
            (None, Some(_)) => self.to_capture(&mut state, ptr, class),
            (None, None) => state.free.entry(class).or_default().push(ptr),
        }
    }

    fn to_capture(&self, state: &mut State, ptr: DevicePtr, class: usize) {
        let Some((graph, free)) = state.capture.as_mut() else {
            return;
        };
        free.entry(class).or_default().push(ptr);
        let owned = Owned {
            class,
            graph: Some(*graph),
            held: false,
        };
        state.owned.insert(ptr.0, owned);
    }

    /// Starts giving blocks to a graph being captured (one capture at a time).
    pub fn begin_capture(&self) -> Result<()> {
        let mut state = self.state();
        if state.capture.is_some() {
            return Err(TensorError::Backend {
                device: self.gpu.name(),
                what: "a capture is already running".into(),
            });
        }
        state.next_graph += 1;
        state.capture = Some((state.next_graph, BTreeMap::new()));
        Ok(())
    }

    /// Ends the capture: its blocks stay the graph's until the returned [`GraphMemory`] drops.
    pub fn end_capture(self: &Arc<Self>) -> Option<GraphMemory> {
        let (graph, _) = self.state().capture.take()?;
        Some(GraphMemory {
            graph,
            pool: self.clone(),
        })
    }

    /// Bytes in blocks that live graphs keep (held by a storage or not).
    pub fn graph_bytes(&self) -> usize {
        let state = self.state();
        (state.owned.values())
            .filter(|o| o.graph.is_some())
            .map(|o| o.class)
            .sum()
    }

    /// A graph is gone: its blocks no storage holds go back to the cache, the others when
    /// their storages drop.
    fn graph_dropped(&self, graph: u64) {
        let mut state = self.state();
        let mine: Vec<(u64, Owned)> = (state.owned.iter())
            .filter(|(_, o)| o.graph == Some(graph))
            .map(|(p, o)| (*p, *o))
            .collect();
        for (ptr, owned) in mine {
            if owned.held {
                if let Some(o) = state.owned.get_mut(&ptr) {
                    o.graph = None;
                }
            } else {
                state.owned.remove(&ptr);
                state
                    .free
                    .entry(owned.class)
                    .or_default()
                    .push(DevicePtr(ptr));
            }
        }
    }

    /// Returns every cached block to the device.
    pub fn empty_cache(&self) {
        let mut state = self.state();
        self.empty_cache_locked(&mut state);
    }

    /// Not while a capture runs: the driver takes no free of ordinary memory then (it would be
    /// a graph free node), and the cache must survive the capture's out-of-memory error.
    fn empty_cache_locked(&self, state: &mut State) {
        if state.capture.is_some() {
            return;
        }
        for (class, ptrs) in std::mem::take(&mut state.free) {
            for ptr in ptrs {
                self.gpu.free(ptr);
                state.stats.reserved -= class;
            }
        }
    }

    fn out_of_memory(&self, state: &State, bytes: usize, why: &str) -> TensorError {
        let cap = self.cap.map_or(String::new(), |c| {
            format!(", cap {:.1} MiB", c as f64 / 1048576.0)
        });
        TensorError::Backend {
            device: self.gpu.name(),
            what: format!(
                "out of memory allocating {bytes} bytes ({why}); allocator: {}{cap}",
                state.stats
            ),
        }
    }
}

/// The memory a captured graph's ops use, kept from the general cache while this lives.
#[derive(Debug)]
pub struct GraphMemory {
    graph: u64,
    pool: Arc<MemoryPool>,
}

impl Drop for GraphMemory {
    fn drop(&mut self) {
        self.pool.graph_dropped(self.graph);
    }
}

impl Drop for MemoryPool {
    fn drop(&mut self) {
        self.empty_cache();
    }
}

/// Device memory owned by a storage: back to its pool's cache when the storage goes.
#[derive(Debug)]
pub struct Buffer {
    pub ptr: DevicePtr,
    class: usize,
    pool: Arc<MemoryPool>,
}

impl Buffer {
    pub fn new(pool: &Arc<MemoryPool>, bytes: usize) -> Result<Self> {
        let (ptr, class) = pool.allocate(bytes)?;
        Ok(Self {
            ptr,
            class,
            pool: pool.clone(),
        })
    }
}

impl Buffer {
    /// The GPU that holds this memory.
    pub fn gpu(&self) -> &Arc<dyn Gpu> {
        self.pool.gpu()
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        self.pool.release(self.ptr, self.class);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn size_classes_round_up_by_at_most_an_eighth_above_a_mebibyte() {
        assert_eq!(size_class(0), 512);
        assert_eq!(size_class(1), 512);
        assert_eq!(size_class(513), 1024);
        assert_eq!(size_class(1 << 20), 1 << 20);
        assert_eq!(size_class((1 << 20) + 1), (1 << 20) + (1 << 17));
        for bytes in [3_000_000usize, 25_000_000, 1 << 30] {
            let c = size_class(bytes);
            assert!(c >= bytes && (c - bytes) * 8 <= bytes, "{bytes} → {c}");
        }
    }
}
