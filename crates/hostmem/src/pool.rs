//! A fixed pool of reusable host buffers.

use std::fmt;
use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::{HostAllocator, HostBuffer, HostMemError, PageAligned};

/// A fixed set of equally sized host buffers, allocated once and recycled.
///
/// Cloning the pool is cheap and shares it (workers each hold a clone). Buffers are handed out as
/// [`PooledBuffer`]s and return when dropped, from whatever thread drops them. When every buffer
/// is out, [`acquire`](Self::acquire) waits — that wait is the back-pressure that bounds a
/// prefetching pipeline's memory.
#[derive(Clone)]
pub struct BufferPool {
    shared: Arc<Shared>,
}

struct Shared {
    state: Mutex<State>,
    returned: Condvar,
    buffer_len: usize,
    capacity: usize,
    allocator: Arc<dyn HostAllocator>,
}

struct State {
    free: Vec<HostBuffer>,
    closed: bool,
}

/// A snapshot of a pool's occupancy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolStats {
    /// Buffers the pool owns in all.
    pub capacity: usize,
    /// Buffers waiting in the pool right now.
    pub available: usize,
    /// Size of each buffer in bytes.
    pub buffer_len: usize,
}

impl BufferPool {
    /// Allocates `count` buffers of `buffer_len` bytes each from `allocator`, up front.
    pub fn new(
        count: usize,
        buffer_len: usize,
        allocator: Arc<dyn HostAllocator>,
    ) -> Result<Self, HostMemError> {
        if count == 0 {
            return Err(HostMemError::EmptyPool);
        }
        let free = (0..count)
            .map(|_| HostBuffer::new(buffer_len, allocator.clone()))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self {
            shared: Arc::new(Shared {
                state: Mutex::new(State {
                    free,
                    closed: false,
                }),
                returned: Condvar::new(),
                buffer_len,
                capacity: count,
                allocator,
            }),
        })
    }

    /// A pool of page-aligned buffers from the default allocator.
    pub fn page_aligned(count: usize, buffer_len: usize) -> Result<Self, HostMemError> {
        Self::new(count, buffer_len, Arc::new(PageAligned))
    }

    /// Takes a buffer, waiting for one to come back if all are out. Fails only once the pool is
    /// [closed](Self::close).
    pub fn acquire(&self) -> Result<PooledBuffer, HostMemError> {
        let mut state = self.shared.lock();
        loop {
            if let Some(buffer) = self.take(&mut state)? {
                return Ok(buffer);
            }
            state = self
                .shared
                .returned
                .wait(state)
                .unwrap_or_else(|poison| poison.into_inner());
        }
    }

    /// Like [`acquire`](Self::acquire) but gives up after `timeout`, returning `Ok(None)`.
    pub fn acquire_timeout(&self, timeout: Duration) -> Result<Option<PooledBuffer>, HostMemError> {
        let deadline = Instant::now() + timeout;
        let mut state = self.shared.lock();
        loop {
            if let Some(buffer) = self.take(&mut state)? {
                return Ok(Some(buffer));
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(None);
            }
            state = self
                .shared
                .returned
                .wait_timeout(state, left)
                .unwrap_or_else(|poison| poison.into_inner())
                .0;
        }
    }

    /// Takes a buffer if one is free right now.
    pub fn try_acquire(&self) -> Result<Option<PooledBuffer>, HostMemError> {
        let mut state = self.shared.lock();
        self.take(&mut state)
    }

    /// Closes the pool: every waiting and future `acquire` fails with [`HostMemError::Closed`].
    /// Buffers already out stay valid and are freed when the last of them and the pool are gone.
    /// A pipeline calls this on shutdown so no producer waits forever for a buffer.
    pub fn close(&self) {
        self.shared.lock().closed = true;
        self.shared.returned.notify_all();
    }

    /// Occupancy right now.
    pub fn stats(&self) -> PoolStats {
        PoolStats {
            capacity: self.shared.capacity,
            available: self.shared.lock().free.len(),
            buffer_len: self.shared.buffer_len,
        }
    }

    /// Size of each buffer in bytes.
    pub fn buffer_len(&self) -> usize {
        self.shared.buffer_len
    }

    /// Whether the buffers are page-locked (device copies can be asynchronous).
    pub fn is_pinned(&self) -> bool {
        self.shared.allocator.is_pinned()
    }

    fn take(&self, state: &mut State) -> Result<Option<PooledBuffer>, HostMemError> {
        if state.closed {
            return Err(HostMemError::Closed);
        }
        Ok(state.free.pop().map(|buffer| PooledBuffer {
            buffer: Some(buffer),
            home: self.shared.clone(),
        }))
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // The state is a plain free list; a panic elsewhere cannot leave it half-updated.
        self.state
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
    }
}

impl fmt::Debug for BufferPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BufferPool")
            .field("stats", &self.stats())
            .field("allocator", &self.shared.allocator.name())
            .finish()
    }
}

/// A buffer on loan from a [`BufferPool`]. Dereferences to its bytes; goes back to the pool when
/// dropped or [released](Self::release), from any thread.
pub struct PooledBuffer {
    buffer: Option<HostBuffer>,
    home: Arc<Shared>,
}

impl PooledBuffer {
    /// Says the user is done: the buffer goes back to its pool. Same as dropping it, but explicit
    /// at the place where a consumer or a completed device copy lets go.
    pub fn release(self) {
        drop(self)
    }

    /// Whether a device can copy from this buffer asynchronously (page-locked memory).
    pub fn is_pinned(&self) -> bool {
        self.home.allocator.is_pinned()
    }
}

impl Deref for PooledBuffer {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.buffer.as_deref().unwrap_or(&[])
    }
}

impl DerefMut for PooledBuffer {
    fn deref_mut(&mut self) -> &mut [u8] {
        self.buffer.as_deref_mut().unwrap_or(&mut [])
    }
}

impl Drop for PooledBuffer {
    fn drop(&mut self) {
        if let Some(buffer) = self.buffer.take() {
            self.home.lock().free.push(buffer);
            self.home.returned.notify_one();
        }
    }
}

impl fmt::Debug for PooledBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PooledBuffer")
            .field("len", &self.len())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ptr::NonNull;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::mpsc;
    use std::thread;

    /// Counts allocations so a test can prove buffers are recycled, not reallocated.
    #[derive(Debug, Default)]
    struct Counting {
        allocs: AtomicUsize,
        frees: AtomicUsize,
    }

    // SAFETY: forwards to `PageAligned`.
    unsafe impl HostAllocator for Counting {
        fn name(&self) -> &str {
            "counting"
        }
        fn is_pinned(&self) -> bool {
            true
        }
        fn allocate(&self, len: usize) -> Result<NonNull<u8>, HostMemError> {
            self.allocs.fetch_add(1, Ordering::SeqCst);
            PageAligned.allocate(len)
        }
        unsafe fn deallocate(&self, ptr: NonNull<u8>, len: usize) {
            self.frees.fetch_add(1, Ordering::SeqCst);
            unsafe { PageAligned.deallocate(ptr, len) }
        }
    }

    #[test]
    fn buffers_are_recycled_not_reallocated() {
        let alloc = Arc::new(Counting::default());
        let pool = BufferPool::new(2, 4096, alloc.clone()).unwrap();
        assert!(pool.is_pinned());
        for round in 0..100u8 {
            let mut a = pool.acquire().unwrap();
            let b = pool.acquire().unwrap();
            assert!(a.is_pinned());
            a[0] = round;
            assert_eq!(pool.stats().available, 0);
            drop(a);
            b.release();
        }
        assert_eq!(alloc.allocs.load(Ordering::SeqCst), 2);
        assert_eq!(alloc.frees.load(Ordering::SeqCst), 0);
        drop(pool);
        assert_eq!(alloc.frees.load(Ordering::SeqCst), 2);
    }

    #[test]
    fn an_empty_pool_is_refused() {
        assert_eq!(
            BufferPool::page_aligned(0, 16).unwrap_err(),
            HostMemError::EmptyPool
        );
    }

    #[test]
    fn try_acquire_and_timeout_do_not_wait_forever() {
        let pool = BufferPool::page_aligned(1, 64).unwrap();
        let held = pool.try_acquire().unwrap().expect("one free buffer");
        assert!(pool.try_acquire().unwrap().is_none());
        assert!(pool
            .acquire_timeout(Duration::from_millis(20))
            .unwrap()
            .is_none());
        drop(held);
        assert!(pool.try_acquire().unwrap().is_some());
    }

    #[test]
    fn a_buffer_released_on_another_thread_wakes_a_waiting_acquirer() {
        let pool = BufferPool::page_aligned(1, 1 << 16).unwrap();
        let mut buffer = pool.acquire().unwrap();
        buffer[123] = 42;
        let (sent, received) = mpsc::channel();
        // The "device copy" thread owns the buffer and releases it when its work is done.
        let copier = thread::spawn(move || {
            let buffer: PooledBuffer = received.recv().unwrap();
            assert_eq!(buffer[123], 42);
            buffer.release();
        });
        let waiter = {
            let pool = pool.clone();
            thread::spawn(move || pool.acquire().map(|b| b[123]))
        };
        sent.send(buffer).unwrap();
        copier.join().unwrap();
        // The waiter gets the very buffer back, bytes intact (recycled, not re-zeroed).
        assert_eq!(waiter.join().unwrap(), Ok(42));
        assert_eq!(pool.stats().available, 1);
    }

    #[test]
    fn closing_wakes_waiters_with_an_error() {
        let pool = BufferPool::page_aligned(1, 64).unwrap();
        let held = pool.acquire().unwrap();
        let waiter = {
            let pool = pool.clone();
            thread::spawn(move || pool.acquire().map(|_| ()))
        };
        thread::sleep(Duration::from_millis(20));
        pool.close();
        assert_eq!(waiter.join().unwrap(), Err(HostMemError::Closed));
        assert_eq!(held.len(), 64, "a buffer already out stays usable");
        drop(held);
        assert_eq!(pool.try_acquire().unwrap_err(), HostMemError::Closed);
    }

    #[test]
    fn buffers_outlive_the_pool_handle() {
        let pool = BufferPool::page_aligned(1, 64).unwrap();
        let buffer = pool.acquire().unwrap();
        drop(pool);
        assert_eq!(buffer.len(), 64);
        drop(buffer); // returns to the (now unreachable) free list, then everything is freed
    }
}
