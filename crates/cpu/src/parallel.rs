//! Work on every core with fixed partitions (DESIGN contract 9).
//!
//! Work is split into contiguous parts whose boundaries depend only on the work's size and the
//! thread count, never on timing: the same inputs give the same bits on every run. Parts run on
//! scoped threads (the caller runs part 0), so there is no pool to shut down and a panic in a
//! part reaches the caller. Small work stays on the calling thread.

use std::ops::Range;
use std::sync::OnceLock;

/// Threads the backend uses: `REDLINE_CPU_THREADS`, or every core.
pub(crate) fn threads() -> usize {
    static THREADS: OnceLock<usize> = OnceLock::new();
    *THREADS.get_or_init(|| {
        std::env::var("REDLINE_CPU_THREADS")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .filter(|&n| n > 0)
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
    })
}

/// How many parts `n` items make when each part should get at least `min_per_part` of them.
pub(crate) fn parts_for(n: usize, min_per_part: usize) -> usize {
    (n / min_per_part.max(1)).clamp(1, threads())
}

/// The `part`-th of `parts` contiguous ranges covering `0..n`.
pub(crate) fn part_range(n: usize, parts: usize, part: usize) -> Range<usize> {
    (n * part / parts)..(n * (part + 1) / parts)
}

/// Runs `f(part, range)` for each of `parts` contiguous ranges of `0..n`, in parallel.
pub(crate) fn for_parts(n: usize, parts: usize, f: impl Fn(usize, Range<usize>) + Sync) {
    let parts = parts.clamp(1, n.max(1));
    if parts == 1 {
        f(0, 0..n);
        return;
    }
    std::thread::scope(|scope| {
        let f = &f;
        for part in 1..parts {
            scope.spawn(move || f(part, part_range(n, parts, part)));
        }
        f(0, part_range(n, parts, 0));
    });
}

/// Runs `f(task)` for every task of `0..count`, on up to [`threads`] threads that claim tasks
/// one at a time. Only for tasks that write disjoint outputs: the results cannot depend on who
/// ran what, and a core slowed by other load simply takes fewer tasks.
pub(crate) fn for_each_task(count: usize, f: impl Fn(usize) + Sync) {
    let workers = threads().min(count);
    if workers <= 1 {
        (0..count).for_each(f);
        return;
    }
    let next = std::sync::atomic::AtomicUsize::new(0);
    let work = || loop {
        let task = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if task >= count {
            break;
        }
        f(task);
    };
    std::thread::scope(|scope| {
        for _ in 1..workers {
            scope.spawn(work);
        }
        work();
    });
}

/// Runs `f(start, chunk)` over contiguous chunks of `out` (at least `min_chunk` elements each), in
/// parallel; `start` is the chunk's first index in `out`.
pub(crate) fn chunks_mut<T: Send>(
    out: &mut [T],
    min_chunk: usize,
    f: impl Fn(usize, &mut [T]) + Sync,
) {
    let n = out.len();
    let parts = parts_for(n, min_chunk);
    if parts == 1 {
        f(0, out);
        return;
    }
    std::thread::scope(|scope| {
        let f = &f;
        let mut rest = out;
        let mut start = 0;
        for part in 0..parts {
            let len = part_range(n, parts, part).len();
            let (chunk, tail) = rest.split_at_mut(len);
            rest = tail;
            let at = start;
            start += len;
            if part + 1 == parts {
                f(at, chunk);
            } else {
                scope.spawn(move || f(at, chunk));
            }
        }
    });
}

/// A mutable slice that parts of a parallel loop write at disjoint positions they compute
/// themselves (the rows of a GEMM, the images of a convolution).
pub(crate) struct Disjoint<T> {
    ptr: *mut T,
    len: usize,
}

// SAFETY: shared only by parts that write disjoint positions (each user states why).
unsafe impl<T: Send> Send for Disjoint<T> {}
unsafe impl<T: Send> Sync for Disjoint<T> {}

impl<T> Disjoint<T> {
    pub fn new(slice: &mut [T]) -> Self {
        Self {
            ptr: slice.as_mut_ptr(),
            len: slice.len(),
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn ptr(&self) -> *mut T {
        self.ptr
    }

    /// The sub-slice `range`.
    ///
    /// # Safety
    /// No other part may access `range` while the returned slice lives.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn slice(&self, range: Range<usize>) -> &mut [T] {
        assert!(range.start <= range.end && range.end <= self.len);
        // SAFETY: in bounds (checked); exclusivity is the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(range.start), range.len()) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_cover_everything_once() {
        for n in [0usize, 1, 7, 100, 1001] {
            for parts in 1..5 {
                let total: usize = (0..parts).map(|p| part_range(n, parts, p).len()).sum();
                assert_eq!(total, n);
            }
        }
        let mut v = vec![0u32; 100_000];
        chunks_mut(&mut v, 10, |start, chunk| {
            for (i, x) in chunk.iter_mut().enumerate() {
                *x += (start + i) as u32;
            }
        });
        assert!(v.iter().enumerate().all(|(i, &x)| x == i as u32));
    }
}
