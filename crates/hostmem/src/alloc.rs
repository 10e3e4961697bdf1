//! The allocator trait and the page-aligned default.

use std::alloc::Layout;
use std::fmt;
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;
use std::sync::Arc;

use crate::HostMemError;

/// Alignment of [`PageAligned`] buffers. 4 KiB is the page size on every platform we target, and
/// it is also what O_DIRECT reads and DMA engines want.
pub const PAGE_SIZE: usize = 4096;

/// A source of host memory.
///
/// # Safety
/// `allocate(len)` must return memory valid for reads and writes of `len` bytes, zero-initialised,
/// aligned to at least 64 bytes, and exclusively owned by the caller until it is handed back to
/// `deallocate` with the same `len`. It must be safe to use and free from any thread.
pub unsafe trait HostAllocator: Send + Sync + fmt::Debug {
    /// A short name for messages ("page-aligned", "cuda-pinned").
    fn name(&self) -> &str;
    /// Whether the memory is page-locked, so devices can copy from it asynchronously.
    fn is_pinned(&self) -> bool;
    /// Allocates `len > 0` zeroed bytes.
    fn allocate(&self, len: usize) -> Result<NonNull<u8>, HostMemError>;
    /// Frees memory from [`allocate`](Self::allocate).
    ///
    /// # Safety
    /// `ptr` came from `self.allocate(len)` and is not used afterwards.
    unsafe fn deallocate(&self, ptr: NonNull<u8>, len: usize);
}

/// The default allocator: zeroed, page-aligned memory from the global allocator (not pinned).
#[derive(Debug, Default, Clone, Copy)]
pub struct PageAligned;

impl PageAligned {
    fn layout(len: usize) -> Result<Layout, HostMemError> {
        Layout::from_size_align(len, PAGE_SIZE).map_err(|e| HostMemError::OutOfMemory {
            allocator: "page-aligned".into(),
            bytes: len,
            reason: e.to_string(),
        })
    }
}

// SAFETY: `alloc_zeroed` with a page-aligned layout satisfies the contract; `deallocate`
// rebuilds the same layout.
unsafe impl HostAllocator for PageAligned {
    fn name(&self) -> &str {
        "page-aligned"
    }

    fn is_pinned(&self) -> bool {
        false
    }

    fn allocate(&self, len: usize) -> Result<NonNull<u8>, HostMemError> {
        let layout = Self::layout(len.max(1))?;
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        NonNull::new(ptr).ok_or_else(|| HostMemError::OutOfMemory {
            allocator: self.name().into(),
            bytes: len,
            reason: "the global allocator returned null".into(),
        })
    }

    unsafe fn deallocate(&self, ptr: NonNull<u8>, len: usize) {
        if let Ok(layout) = Self::layout(len.max(1)) {
            // SAFETY: the caller passes a pointer from `allocate(len)`, which used this layout.
            unsafe { std::alloc::dealloc(ptr.as_ptr(), layout) }
        }
    }
}

/// An owned, fixed-size block of host memory from some [`HostAllocator`]. Dereferences to bytes.
pub struct HostBuffer {
    ptr: NonNull<u8>,
    len: usize,
    allocator: Arc<dyn HostAllocator>,
}

// SAFETY: the buffer exclusively owns its memory (allocator contract), like a `Box<[u8]>`.
unsafe impl Send for HostBuffer {}
// SAFETY: shared access only hands out `&[u8]`.
unsafe impl Sync for HostBuffer {}

impl HostBuffer {
    /// Allocates `len` zeroed bytes from `allocator`.
    pub fn new(len: usize, allocator: Arc<dyn HostAllocator>) -> Result<Self, HostMemError> {
        let ptr = allocator.allocate(len)?;
        Ok(Self {
            ptr,
            len,
            allocator,
        })
    }

    /// Allocates `len` zeroed bytes from the default [`PageAligned`] allocator.
    pub fn page_aligned(len: usize) -> Result<Self, HostMemError> {
        Self::new(len, Arc::new(PageAligned))
    }

    /// Whether a device can copy from this buffer asynchronously (page-locked memory).
    pub fn is_pinned(&self) -> bool {
        self.allocator.is_pinned()
    }

    /// The allocator the buffer came from.
    pub fn allocator(&self) -> &Arc<dyn HostAllocator> {
        &self.allocator
    }
}

impl Deref for HostBuffer {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `ptr` is valid for `len` initialised bytes for the buffer's lifetime.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl DerefMut for HostBuffer {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, and `&mut self` makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from this allocator with this length and is never used again.
        unsafe { self.allocator.deallocate(self.ptr, self.len) }
    }
}

impl fmt::Debug for HostBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostBuffer")
            .field("len", &self.len)
            .field("allocator", &self.allocator.name())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn page_aligned_buffers_are_zeroed_aligned_and_writable() {
        let mut buf = HostBuffer::page_aligned(10_000).unwrap();
        assert_eq!(buf.len(), 10_000);
        assert_eq!(buf.as_ptr() as usize % PAGE_SIZE, 0);
        assert!(buf.iter().all(|&b| b == 0));
        buf[9_999] = 7;
        assert_eq!(buf[9_999], 7);
        assert!(!buf.is_pinned());
    }

    #[test]
    fn zero_length_buffers_are_fine() {
        let buf = HostBuffer::page_aligned(0).unwrap();
        assert!(buf.is_empty());
    }

    #[test]
    fn impossible_sizes_are_an_error_not_a_panic() {
        let err = HostBuffer::page_aligned(usize::MAX - 10).unwrap_err();
        assert!(err.to_string().contains("page-aligned"), "{err}");
    }
}
