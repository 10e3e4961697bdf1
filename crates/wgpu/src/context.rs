//! The device context: one queue, a pending command encoder that batches many ops per submit, a
//! ring of op parameters, and pools of storage and read-back buffers.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use std::sync::atomic::{AtomicU32, Ordering};

use redline_tensor::{Download, MemoryStats, Result, TensorError, TIMESTAMP_SLOTS};

/// Ops encoded before a submit is forced (downloads and uploads also flush).
const OPS_PER_SUBMIT: usize = 64;
/// Every op's parameters start on this boundary of the ring (storage-buffer offset alignment).
const PARAM_ALIGN: usize = 256;

/// A buffer on loan from a [`BufferPool`]; it goes back when dropped. Reuse is safe because all
/// work runs on one queue in order: a later op that writes a recycled buffer is submitted after
/// every earlier op that read it.
pub(crate) struct PooledBuffer {
    buffer: Option<wgpu::Buffer>,
    class: u64,
    pool: Arc<BufferPool>,
}

impl PooledBuffer {
    pub(crate) fn buffer(&self) -> &wgpu::Buffer {
        self.buffer.as_ref().expect("present until dropped")
    }
}

impl Drop for PooledBuffer {
    fn drop(&mut self) {
        if let Some(buffer) = self.buffer.take() {
            let mut pool = self.pool.lock();
            pool.stats.in_use -= self.class as usize;
            pool.free.entry(self.class).or_default().push(buffer);
        }
    }
}

/// Free buffers by size class (powers of two), so the steady state creates no buffers; and
/// what the pool holds.
#[derive(Default)]
pub(crate) struct BufferPool {
    state: Mutex<PoolState>,
}

#[derive(Default)]
struct PoolState {
    free: HashMap<u64, Vec<wgpu::Buffer>>,
    stats: MemoryStats,
}

impl BufferPool {
    fn lock(&self) -> MutexGuard<'_, PoolState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn stats(&self) -> MemoryStats {
        self.lock().stats
    }

    fn take(
        self: &Arc<Self>,
        device: &wgpu::Device,
        bytes: u64,
        usage: wgpu::BufferUsages,
    ) -> PooledBuffer {
        let class = bytes.max(256).next_power_of_two();
        let mut pool = self.lock();
        let reused = pool.free.get_mut(&class).and_then(Vec::pop);
        let stats = &mut pool.stats;
        stats.in_use += class as usize;
        stats.peak_in_use = stats.peak_in_use.max(stats.in_use);
        let buffer = match reused {
            Some(buffer) => {
                stats.reuses += 1;
                buffer
            }
            None => {
                stats.device_allocations += 1;
                stats.reserved += class as usize;
                drop(pool);
                device.create_buffer(&wgpu::BufferDescriptor {
                    label: Some("redline pooled buffer"),
                    size: class,
                    usage,
                    mapped_at_creation: false,
                })
            }
        };
        PooledBuffer {
            buffer: Some(buffer),
            class,
            pool: self.clone(),
        }
    }
}

/// The device's clock: timestamp queries written between commands (where the adapter offers
/// them inside encoders), a ring of `TIMESTAMP_SLOTS` slots.
struct Clock {
    queries: wgpu::QuerySet,
    /// Where readings are resolved to, one per `QUERY_RESOLVE_BUFFER_ALIGNMENT` bytes.
    resolved: wgpu::Buffer,
    next: AtomicU32,
    /// Nanoseconds per tick.
    period: f64,
    /// Held through a read: two reads at once would resolve into the same buffer.
    reading: Mutex<()>,
}

const RESOLVE_STRIDE: u64 = wgpu::QUERY_RESOLVE_BUFFER_ALIGNMENT;

/// Work encoded but not yet submitted, and the op parameters it refers to.
struct Pending {
    encoder: Option<wgpu::CommandEncoder>,
    ops: usize,
    params: Vec<u8>,
}

pub(crate) struct Context {
    pub(crate) device: wgpu::Device,
    pub(crate) queue: wgpu::Queue,
    pub(crate) info: wgpu::AdapterInfo,
    pub(crate) f16: bool,
    storage: Arc<BufferPool>,
    readback: Arc<BufferPool>,
    pending: Mutex<Pending>,
    /// The parameter ring of the batch being encoded (grown when a batch needs more).
    ring: Mutex<wgpu::Buffer>,
    pipelines: Mutex<HashMap<String, Arc<wgpu::ComputePipeline>>>,
    clock: Option<Clock>,
    error: Arc<Mutex<Option<String>>>,
}

impl Context {
    pub(crate) fn new(adapter: &wgpu::Adapter) -> Result<Self> {
        let info = adapter.get_info();
        let f16 = adapter.features().contains(wgpu::Features::SHADER_F16);
        let timestamps =
            wgpu::Features::TIMESTAMP_QUERY | wgpu::Features::TIMESTAMP_QUERY_INSIDE_ENCODERS;
        let mut required_features = wgpu::Features::empty();
        if f16 {
            required_features |= wgpu::Features::SHADER_F16;
        }
        if adapter.features().contains(timestamps) {
            required_features |= timestamps;
        }
        let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
            label: Some("redline"),
            required_features,
            required_limits: adapter.limits(),
            ..Default::default()
        }))
        .map_err(|e| TensorError::Backend {
            device: format!("wgpu:{}", info.name),
            what: format!("no device: {e}"),
        })?;
        // Validation errors become `TensorError::Backend` at the next flush instead of a panic.
        let error = Arc::new(Mutex::new(None));
        let slot = error.clone();
        device.on_uncaptured_error(Arc::new(move |e: wgpu::Error| {
            let mut slot = slot.lock().unwrap_or_else(|p| p.into_inner());
            slot.get_or_insert_with(|| e.to_string());
        }));
        let ring = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("redline params"),
            size: 1 << 16,
            usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let clock = required_features.contains(timestamps).then(|| Clock {
            queries: device.create_query_set(&wgpu::QuerySetDescriptor {
                label: Some("redline timestamps"),
                ty: wgpu::QueryType::Timestamp,
                count: TIMESTAMP_SLOTS,
            }),
            resolved: device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("redline timestamps resolved"),
                size: u64::from(TIMESTAMP_SLOTS) * RESOLVE_STRIDE,
                usage: wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
                mapped_at_creation: false,
            }),
            next: AtomicU32::new(0),
            period: f64::from(queue.get_timestamp_period()),
            reading: Mutex::new(()),
        });
        let clock = clock.filter(|c| c.period > 0.0);
        Ok(Self {
            clock,
            device,
            queue,
            info,
            f16,
            storage: Arc::default(),
            readback: Arc::default(),
            pending: Mutex::new(Pending {
                encoder: None,
                ops: 0,
                params: Vec::new(),
            }),
            ring: Mutex::new(ring),
            pipelines: Mutex::default(),
            error,
        })
    }

    pub(crate) fn name(&self) -> String {
        format!("wgpu:{}", self.info.name)
    }

    pub(crate) fn fail(&self, what: impl Into<String>) -> TensorError {
        TensorError::Backend {
            device: self.name(),
            what: what.into(),
        }
    }

    /// What the storage-buffer pool holds (read-back staging buffers are not counted).
    pub(crate) fn memory_stats(&self) -> MemoryStats {
        self.storage.stats()
    }

    /// A storage buffer of at least `bytes` (rounded up to 4), from the pool.
    pub(crate) fn alloc(&self, bytes: u64) -> PooledBuffer {
        let usage = wgpu::BufferUsages::STORAGE
            | wgpu::BufferUsages::COPY_SRC
            | wgpu::BufferUsages::COPY_DST;
        self.storage
            .take(&self.device, bytes.div_ceil(4) * 4, usage)
    }

    /// The compute pipeline for WGSL `source`, compiled once per distinct source.
    pub(crate) fn pipeline(
        &self,
        key: &str,
        source: impl FnOnce() -> String,
    ) -> Arc<wgpu::ComputePipeline> {
        let mut cache = self.pipelines.lock().unwrap_or_else(|p| p.into_inner());
        cache
            .entry(key.to_string())
            .or_insert_with(|| {
                let module = self
                    .device
                    .create_shader_module(wgpu::ShaderModuleDescriptor {
                        label: Some(key),
                        source: wgpu::ShaderSource::Wgsl(source().into()),
                    });
                Arc::new(
                    self.device
                        .create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                            label: Some(key),
                            layout: None,
                            module: &module,
                            entry_point: Some("main"),
                            compilation_options: Default::default(),
                            cache: None,
                        }),
                )
            })
            .clone()
    }

    /// Encodes one dispatch of `pipeline` with `params` (binding 0) and `buffers` (bindings 1..),
    /// clearing `clear` first (outputs written with atomics start from zero).
    pub(crate) fn dispatch(
        &self,
        pipeline: &wgpu::ComputePipeline,
        params: &[u32],
        buffers: &[&wgpu::Buffer],
        clear: Option<&wgpu::Buffer>,
        groups: [u32; 3],
    ) -> Result<()> {
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        let size = (params.len().max(1) * 4) as u64;
        let mut offset = pending.params.len().div_ceil(PARAM_ALIGN) * PARAM_ALIGN;
        if !self.ring_holds(offset as u64 + size) {
            // The ops encoded so far are bound to the current ring, and their parameters are
            // written into it only at submit: submit them before the ring is replaced.
            self.submit(&mut pending)?;
            offset = 0;
            self.grow_ring(size);
        }
        pending.params.resize(offset, 0);
        pending
            .params
            .extend(params.iter().flat_map(|p| p.to_le_bytes()));
        let ring = self.ring.lock().unwrap_or_else(|p| p.into_inner());
        let mut entries = vec![wgpu::BindGroupEntry {
            binding: 0,
            resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                buffer: &ring,
                offset: offset as u64,
                size: wgpu::BufferSize::new(size),
            }),
        }];
        for (i, b) in buffers.iter().enumerate() {
            entries.push(wgpu::BindGroupEntry {
                binding: i as u32 + 1,
                resource: b.as_entire_binding(),
            });
        }
        let bind_group = self.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: None,
            layout: &pipeline.get_bind_group_layout(0),
            entries: &entries,
        });
        let device = &self.device;
        let encoder = pending
            .encoder
            .get_or_insert_with(|| device.create_command_encoder(&Default::default()));
        if let Some(buffer) = clear {
            encoder.clear_buffer(buffer, 0, None);
        }
        {
            let mut pass = encoder.begin_compute_pass(&Default::default());
            pass.set_pipeline(pipeline);
            pass.set_bind_group(0, &bind_group, &[]);
            pass.dispatch_workgroups(groups[0], groups[1], groups[2]);
        }
        pending.ops += 1;
        let full = pending.ops >= OPS_PER_SUBMIT;
        drop(ring);
        if full {
            self.submit(&mut pending)?;
        }
        Ok(())
    }

    fn ring_holds(&self, bytes: u64) -> bool {
        self.ring.lock().unwrap_or_else(|p| p.into_inner()).size() >= bytes
    }

    /// Replaces the parameter ring with one of at least `bytes`. Only with nothing encoded: the
    /// old ring stays alive as long as submitted work references it.
    fn grow_ring(&self, bytes: u64) {
        let mut ring = self.ring.lock().unwrap_or_else(|p| p.into_inner());
        if ring.size() < bytes {
            *ring = self.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("redline params"),
                size: bytes.next_power_of_two(),
                usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            });
        }
    }

    fn submit(&self, pending: &mut Pending) -> Result<Option<wgpu::SubmissionIndex>> {
        let mut index = None;
        if let Some(encoder) = pending.encoder.take() {
            // The parameters land before this submit's commands run (queue order).
            let ring = self.ring.lock().unwrap_or_else(|p| p.into_inner());
            self.queue.write_buffer(&ring, 0, &pending.params);
            drop(ring);
            index = Some(self.queue.submit([encoder.finish()]));
        }
        pending.ops = 0;
        pending.params.clear();
        self.check_error()?;
        Ok(index)
    }

    /// Encodes a timestamp after everything encoded so far and returns its slot; `None` when
    /// the adapter has no timestamp queries inside encoders.
    pub(crate) fn timestamp(&self) -> Option<u32> {
        let clock = self.clock.as_ref()?;
        let slot = clock.next.fetch_add(1, Ordering::Relaxed) % TIMESTAMP_SLOTS;
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        let device = &self.device;
        pending
            .encoder
            .get_or_insert_with(|| device.create_command_encoder(&Default::default()))
            .write_timestamp(&clock.queries, slot);
        Some(slot)
    }

    /// The readings in `slots`, in nanoseconds; waits for the device to take them.
    pub(crate) fn read_timestamps(&self, slots: &[u32]) -> Result<Vec<u64>> {
        let clock = (self.clock.as_ref())
            .ok_or_else(|| self.fail("this adapter offers no timestamp queries"))?;
        if slots.is_empty() {
            return Ok(Vec::new());
        }
        if slots.len() > TIMESTAMP_SLOTS as usize {
            return Err(self.fail(format!(
                "{} timestamps read at once; at most {TIMESTAMP_SLOTS}",
                slots.len()
            )));
        }
        if let Some(bad) = slots.iter().find(|&&s| s >= TIMESTAMP_SLOTS) {
            return Err(self.fail(format!(
                "timestamp slot {bad} (there are {TIMESTAMP_SLOTS})"
            )));
        }
        let _reading = clock.reading.lock().unwrap_or_else(|p| p.into_inner());
        {
            let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
            let device = &self.device;
            let encoder = pending
                .encoder
                .get_or_insert_with(|| device.create_command_encoder(&Default::default()));
            for (i, &slot) in slots.iter().enumerate() {
                let at = i as u64 * RESOLVE_STRIDE;
                encoder.resolve_query_set(&clock.queries, slot..slot + 1, &clock.resolved, at);
            }
        }
        // The copy is queued after the resolves; a later read resolves into the same buffer
        // only after this copy has run (one queue, in order).
        let bytes = self
            .read_async(&clock.resolved, slots.len() as u64 * RESOLVE_STRIDE)?
            .wait()?;
        Ok(bytes
            .chunks(RESOLVE_STRIDE as usize)
            .map(|tick| {
                let ticks = u64::from_le_bytes(tick[..8].try_into().expect("8 bytes"));
                (ticks as f64 * clock.period).round() as u64
            })
            .collect())
    }

    /// Submits everything encoded so far.
    pub(crate) fn flush(&self) -> Result<()> {
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        self.submit(&mut pending).map(drop)
    }

    fn check_error(&self) -> Result<()> {
        match self.error.lock().unwrap_or_else(|p| p.into_inner()).take() {
            Some(e) => Err(self.fail(e)),
            None => Ok(()),
        }
    }

    /// Waits for all submitted work.
    pub(crate) fn wait(&self) -> Result<()> {
        self.flush()?;
        self.device
            .poll(wgpu::PollType::wait_indefinitely())
            .map_err(|e| self.fail(format!("poll: {e}")))?;
        self.check_error()
    }

    /// Copies `bytes` into a new storage buffer. Pending work is submitted first, because
    /// `write_buffer` lands before the next submit's commands: a recycled buffer must not be
    /// overwritten under ops that still read it. `write_buffer` copies the host bytes at once, so
    /// the caller's (pooled) host buffer is free when this returns.
    ///
    /// The encoder lock is held from that submit until the bytes are queued: otherwise another
    /// thread could encode an op on a buffer, drop it into the pool, and have this upload take
    /// it and overwrite it before that op runs (seen as wrong values in concurrent tests).
    pub(crate) fn upload(&self, bytes: &[u8]) -> Result<PooledBuffer> {
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        self.submit(&mut pending)?;
        let buffer = self.alloc(bytes.len() as u64);
        self.write_padded(buffer.buffer(), bytes);
        Ok(buffer)
    }

    /// Overwrites the start of `buffer` with `bytes`, after everything encoded so far (which is
    /// submitted first, for the reason `upload` gives): ops encoded before read the old values,
    /// ops encoded after the new ones. The host bytes are copied before this returns.
    pub(crate) fn write(&self, buffer: &wgpu::Buffer, bytes: &[u8]) -> Result<()> {
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        self.submit(&mut pending)?;
        self.write_padded(buffer, bytes);
        Ok(())
    }

    /// `write_buffer` in whole 4-byte words (its rule); buffers are allocated in whole words,
    /// so a padded tail stays inside the buffer.
    fn write_padded(&self, buffer: &wgpu::Buffer, bytes: &[u8]) {
        let padded = bytes.len().div_ceil(4) * 4;
        if padded == bytes.len() {
            self.queue.write_buffer(buffer, 0, bytes);
        } else {
            let mut copy = bytes.to_vec();
            copy.resize(padded, 0);
            self.queue.write_buffer(buffer, 0, &copy);
        }
    }

    /// Starts reading `bytes` bytes from the start of `buffer`: the copy into a read-back buffer
    /// is submitted with everything encoded before it (so it sees every earlier op) and the call
    /// returns; the [`Download`] waits for that submission alone, maps and copies out, while
    /// work submitted later keeps running. A recycled source buffer is safe: anything that
    /// overwrites it is submitted after the copy, on the same queue.
    pub(crate) fn read_async(&self, buffer: &wgpu::Buffer, bytes: u64) -> Result<Download> {
        let size = bytes.div_ceil(4).max(1) * 4;
        let staging = self.readback.take(
            &self.device,
            size,
            wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
        );
        let submission = {
            let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
            let device = &self.device;
            let encoder = pending
                .encoder
                .get_or_insert_with(|| device.create_command_encoder(&Default::default()));
            encoder.copy_buffer_to_buffer(buffer, 0, staging.buffer(), 0, size);
            self.submit(&mut pending)?
        };
        let (device, error, name) = (self.device.clone(), self.error.clone(), self.name());
        Ok(Download::pending(move || {
            let fail = |what: String| TensorError::Backend {
                device: name.clone(),
                what,
            };
            let slice = staging.buffer().slice(..size);
            let (tx, rx) = std::sync::mpsc::channel();
            slice.map_async(wgpu::MapMode::Read, move |r| {
                let _ = tx.send(r);
            });
            device
                .poll(wgpu::PollType::Wait {
                    submission_index: submission,
                    timeout: None,
                })
                .map_err(|e| fail(format!("poll: {e}")))?;
            rx.recv()
                .map_err(|_| fail("the read-back never completed".into()))?
                .map_err(|e| fail(format!("map: {e}")))?;
            let data = slice
                .get_mapped_range()
                .map_err(|e| fail(format!("map: {e}")))?[..bytes as usize]
                .to_vec();
            staging.buffer().unmap();
            if let Some(e) = error.lock().unwrap_or_else(|p| p.into_inner()).take() {
                return Err(fail(e));
            }
            Ok(data)
        }))
    }
}
