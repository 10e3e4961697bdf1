//! Events on the driver's stream, so the host never waits for more than it needs:
//! - [`Clock`]: the timestamp ring (a timing event per slot, read relative to one another);
//! - [`InFlight`]: uploads from pinned memory, each buffer kept until its copy's event has
//!   completed (then it returns to its pool — DESIGN contract 7: an event, not a synchronize),
//!   by a reaper thread that waits on the events;
//! - [`Staging`]: pinned buffers that asynchronous downloads land in, each back in the pool
//!   once its copy has completed — waited for, or its download dropped (which waits).

use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;

use cudarc::driver::{result, sys, CudaContext, CudaEvent, CudaStream, DriverError};
use redline_hostmem::{HostAllocator, HostMemError};
use redline_tensor::{HostBytes, TIMESTAMP_SLOTS};

fn timing_event(ctx: &Arc<CudaContext>) -> Result<CudaEvent, DriverError> {
    ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
}

/// [`TIMESTAMP_SLOTS`] timing events, recorded on the stream on request.
pub struct Clock {
    /// Recorded with the first timestamp: readings are nanoseconds since it.
    base: Option<CudaEvent>,
    slots: Vec<Option<CudaEvent>>,
}

impl Default for Clock {
    fn default() -> Self {
        Self {
            base: None,
            slots: (0..TIMESTAMP_SLOTS).map(|_| None).collect(),
        }
    }
}

impl Clock {
    /// Records slot `slot`'s event behind everything enqueued on `stream` so far.
    pub fn record(&mut self, stream: &Arc<CudaStream>, slot: usize) -> Result<(), DriverError> {
        let ctx = stream.context();
        if self.base.is_none() {
            let base = timing_event(ctx)?;
            base.record(stream)?;
            self.base = Some(base);
        }
        let event = match self.slots.get_mut(slot) {
            Some(Some(e)) => e,
            Some(empty) => empty.insert(timing_event(ctx)?),
            None => return Err(DriverError(sys::CUresult::CUDA_ERROR_INVALID_VALUE)),
        };
        event.record(stream)
    }

    /// The readings of `slots` in nanoseconds, waiting for each. The first slot is placed on
    /// the clock since the base event and the others relative to it, so differences within
    /// one call keep the events' resolution (~0.5 µs) however long the run has been.
    pub fn read(&self, slots: &[usize]) -> Result<Vec<u64>, String> {
        let event = |slot: usize| {
            self.slots
                .get(slot)
                .and_then(Option::as_ref)
                .ok_or_else(|| format!("timestamp slot {slot} was never recorded"))
        };
        let (Some(&first), Some(base)) = (slots.first(), self.base.as_ref()) else {
            return Ok(Vec::new());
        };
        let anchor = event(first)?;
        let ms = |from: &CudaEvent, to: &CudaEvent| {
            from.elapsed_ms(to)
                .map(f64::from)
                .map_err(|e| format!("reading a timestamp: {e:?}"))
        };
        let anchor_ns = ms(base, anchor)? * 1e6;
        slots
            .iter()
            .map(|&s| Ok((anchor_ns + ms(anchor, event(s)?)? * 1e6).max(0.0) as u64))
            .collect()
    }
}

/// An upload's event and the buffer it copies from.
type Upload = (CudaEvent, HostBytes);

/// Uploads whose source buffers must outlive their copies. Each buffer goes with its copy's
/// event to a reaper thread, which waits for the event (sleeping: blocking-sync events) and
/// drops the buffer, back to its pool. Not the uploading thread: one that asks a pool for
/// its next buffer before it uploads again would wait on buffers only it could return — a
/// resident batch's few, or a loader's under gradient accumulation, with the host steps ahead
/// of the device. A copy whose event reports an error is dropped too (the context is broken,
/// and the loader should meet that error, not wait for the buffer).
#[derive(Default)]
pub struct InFlight {
    reaper: Mutex<Option<(mpsc::Sender<Upload>, JoinHandle<()>)>>,
    /// Events of copies done, reused.
    spare: Arc<Mutex<Vec<CudaEvent>>>,
}

impl InFlight {
    /// Keeps `bytes` until everything enqueued on `stream` so far (its copy included) is done.
    pub fn keep(&self, stream: &Arc<CudaStream>, bytes: HostBytes) -> Result<(), DriverError> {
        let spare = self.spare.lock().unwrap_or_else(|p| p.into_inner()).pop();
        let event = match spare {
            Some(e) => e,
            // Blocking-sync: the reaper sleeps in its wait instead of spinning on a core the
            // loader decodes on (cudarc takes one flag, so timing stays on: a few bytes more).
            None => stream
                .context()
                .new_event(Some(sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC))?,
        };
        event.record(stream)?;
        let mut reaper = self.reaper.lock().unwrap_or_else(|p| p.into_inner());
        if reaper.is_none() {
            *reaper = self.spawn_reaper();
        }
        let unsent = match reaper.as_ref() {
            Some((copies, _)) => copies.send((event, bytes)).err().map(|e| e.0),
            None => Some((event, bytes)),
        };
        if let Some((event, bytes)) = unsent {
            // No reaper (it could not start): wait here instead.
            let _ = event.synchronize();
            drop(bytes);
        }
        Ok(())
    }

    fn spawn_reaper(&self) -> Option<(mpsc::Sender<Upload>, JoinHandle<()>)> {
        let (copies, done) = mpsc::channel::<Upload>();
        let spare = self.spare.clone();
        let reaper = std::thread::Builder::new()
            .name("redline-cuda-uploads".into())
            .spawn(move || {
                for (event, bytes) in done {
                    let _ = event.synchronize();
                    drop(bytes);
                    spare.lock().unwrap_or_else(|p| p.into_inner()).push(event);
                }
            })
            .ok()?;
        Some((copies, reaper))
    }
}

impl Drop for InFlight {
    /// Waits for the copies still out (their buffers outlive them).
    fn drop(&mut self) {
        let reaper = self
            .reaper
            .get_mut()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some((copies, reaper)) = reaper {
            drop(copies);
            let _ = reaper.join();
        }
    }
}

/// Page-locked host memory from the driver (`cuMemHostAlloc`, portable across contexts): the
/// `redline-hostmem` allocator a loader's pool uses on CUDA, so batches upload asynchronously.
#[derive(Debug)]
pub struct PinnedAllocator {
    ctx: Arc<CudaContext>,
}

impl PinnedAllocator {
    pub fn new(ctx: Arc<CudaContext>) -> Self {
        Self { ctx }
    }
}

// SAFETY: cuMemHostAlloc returns page-aligned memory valid for `len` bytes, zeroed below, owned
// by the caller until cuMemFreeHost; the driver's host allocations may be used from any thread.
unsafe impl HostAllocator for PinnedAllocator {
    fn name(&self) -> &str {
        "cuda-pinned"
    }

    fn is_pinned(&self) -> bool {
        true
    }

    fn allocate(&self, len: usize) -> Result<std::ptr::NonNull<u8>, HostMemError> {
        let oom = |reason: String| HostMemError::OutOfMemory {
            allocator: self.name().into(),
            bytes: len,
            reason,
        };
        self.ctx
            .bind_to_thread()
            .map_err(|e| oom(format!("binding the context: {e:?}")))?;
        // SAFETY: a host allocation of at least one byte.
        let ptr = unsafe { result::malloc_host(len.max(1), sys::CU_MEMHOSTALLOC_PORTABLE) }
            .map_err(|e| oom(format!("cuMemHostAlloc: {e:?}")))?;
        let ptr = std::ptr::NonNull::new(ptr.cast::<u8>())
            .ok_or_else(|| oom("cuMemHostAlloc returned null".into()))?;
        // SAFETY: `len` writable bytes just allocated.
        unsafe { std::ptr::write_bytes(ptr.as_ptr(), 0, len) };
        Ok(ptr)
    }

    unsafe fn deallocate(&self, ptr: std::ptr::NonNull<u8>, _len: usize) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: the caller passes memory from `allocate`, unused from now on.
            let _ = unsafe { result::free_host(ptr.as_ptr().cast()) };
        }
    }
}

/// A pinned buffer for one asynchronous download.
struct StagingBuffer {
    ptr: std::ptr::NonNull<u8>,
    len: usize,
}

// SAFETY: plain host memory, owned by one download at a time.
unsafe impl Send for StagingBuffer {}

/// Pinned buffers for asynchronous downloads, reused (a step reads back a loss of a few bytes;
/// cuMemHostAlloc per read would cost more than the copy).
pub struct Staging(Arc<StagingPool>);

/// The buffers, shared with the downloads in flight: the last of them to go frees them all.
struct StagingPool {
    allocator: PinnedAllocator,
    free: Mutex<Vec<StagingBuffer>>,
}

impl Staging {
    pub fn new(ctx: Arc<CudaContext>) -> Self {
        Self(Arc::new(StagingPool {
            allocator: PinnedAllocator::new(ctx),
            free: Mutex::new(Vec::new()),
        }))
    }

    /// Enqueues a copy of `len` bytes at `src` into a pinned buffer and returns the function
    /// that waits for it, gives the buffer back and hands the bytes over. Dropped uncalled (a
    /// [`redline_tensor::Download`] dropped unwaited), it waits for the copy all the same.
    pub fn download(
        &self,
        stream: &Arc<CudaStream>,
        src: sys::CUdeviceptr,
        len: usize,
    ) -> Result<impl FnOnce() -> Result<Vec<u8>, String> + Send + 'static, String> {
        let pool = &self.0;
        let taken = {
            let mut free = pool.free.lock().unwrap_or_else(|p| p.into_inner());
            free.iter()
                .position(|b| b.len >= len)
                .map(|i| free.swap_remove(i))
        };
        let buffer = match taken {
            Some(b) => b,
            None => {
                let len = len.max(4096);
                let ptr = pool.allocator.allocate(len).map_err(|e| e.to_string())?;
                StagingBuffer { ptr, len }
            }
        };
        // SAFETY: the buffer holds at least `len` bytes and stays untouched until the event
        // below has completed (the closure waits for it before reading).
        let copied = unsafe {
            let dst = std::slice::from_raw_parts_mut(buffer.ptr.as_ptr(), len);
            result::memcpy_dtoh_async(dst, src, stream.cu_stream())
        };
        if let Err(e) = copied {
            pool.give_back(buffer); // nothing was enqueued into it
            return Err(format!("download: {e:?}"));
        }
        let event = stream
            .context()
            .new_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))
            .and_then(|e| e.record(stream).map(|()| e));
        let event = match event {
            Ok(e) => e,
            Err(e) => {
                // The copy is enqueued with no event to wait for: wait for the whole stream
                // before the buffer can be given back.
                if stream.synchronize().is_ok() {
                    pool.give_back(buffer);
                }
                return Err(format!("download event: {e:?}"));
            }
        };
        let copy = StagedCopy {
            event,
            buffer: Some(buffer),
            len,
            pool: Arc::clone(pool),
        };
        Ok(move || copy.finish())
    }
}

/// A download's copy into a staging buffer, in flight until its event completes. Dropped
/// unfinished (its download dropped unwaited), it still waits for the copy: until then the
/// buffer cannot go back to the pool, nor may the device memory it reads be reused.
struct StagedCopy {
    event: CudaEvent,
    buffer: Option<StagingBuffer>,
    len: usize,
    pool: Arc<StagingPool>,
}

impl StagedCopy {
    /// The bytes, once the copy has completed; the buffer back in the pool.
    fn finish(mut self) -> Result<Vec<u8>, String> {
        self.event
            .synchronize()
            .map_err(|e| format!("waiting for a download: {e:?}"))?;
        let Some(buffer) = self.buffer.take() else {
            return Err("a download's buffer was given back already".into());
        };
        // SAFETY: the copy into the buffer has completed.
        let bytes = unsafe { std::slice::from_raw_parts(buffer.ptr.as_ptr(), self.len) }.to_vec();
        self.pool.give_back(buffer);
        Ok(bytes)
    }
}

impl Drop for StagedCopy {
    fn drop(&mut self) {
        // A failed wait keeps the buffer out of the pool for good: the copy may still be
        // writing it.
        if let Some(buffer) = self.buffer.take() {
            if self.event.synchronize().is_ok() {
                self.pool.give_back(buffer);
            }
        }
    }
}

impl StagingPool {
    fn give_back(&self, buffer: StagingBuffer) {
        self.free
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(buffer);
    }
}

impl Drop for StagingPool {
    fn drop(&mut self) {
        let buffers = std::mem::take(self.free.get_mut().unwrap_or_else(|p| p.into_inner()));
        for b in buffers {
            // SAFETY: allocated by this allocator; no download holds it (it is in the free
            // list, and the downloads that took buffers hold this pool).
            unsafe { self.allocator.deallocate(b.ptr, b.len) };
        }
    }
}
