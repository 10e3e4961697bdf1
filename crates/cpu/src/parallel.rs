//! Work on every core with fixed partitions (DESIGN contract 9).
//!
//! Work is split into contiguous parts whose boundaries depend only on the work's size and the
//! thread count, never on timing: the same inputs give the same bits on every run, whoever runs
//! which part. Parts run on a pool of `threads() - 1` persistent workers and the calling thread,
//! all claiming parts from one counter: a training step runs thousands of ops, and spawning
//! threads for each cost a thread stack's map and unmap (TLB shootdowns on every core) per op.
//! The caller claims parts too, so it never waits for a worker that is busy elsewhere or asleep
//! (nested and concurrent calls cannot deadlock), and a panic in a part reaches the caller
//! after every part has finished. Small work stays on the calling thread.

use std::any::Any;
use std::collections::VecDeque;
use std::ops::Range;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};

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
    run(parts, &|part| f(part, part_range(n, parts, part)));
}

/// Runs `f(task)` for every task of `0..count`, on up to [`threads`] threads that claim tasks
/// one at a time. Only for tasks that write disjoint outputs: the results cannot depend on who
/// ran what, and a core slowed by other load simply takes fewer tasks.
pub(crate) fn for_each_task(count: usize, f: impl Fn(usize) + Sync) {
    if threads() <= 1 || count <= 1 {
        (0..count).for_each(f);
        return;
    }
    run(count, &f);
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
    let chunks = Disjoint::new(out);
    run(parts, &|part| {
        let range = part_range(n, parts, part);
        // SAFETY: the parts' ranges are disjoint.
        f(range.start, unsafe { chunks.slice(range) })
    });
}

/// One parallel call: `parts` parts claimed through `next` by the caller and the workers.
struct Job {
    /// The caller's closure with its lifetime erased: only dereferenced for a claimed part
    /// (`next` below `parts`), and the caller returns only after every part has finished.
    work: *const (dyn Fn(usize) + Sync),
    parts: usize,
    next: AtomicUsize,
    done: AtomicUsize,
    finished: (Mutex<()>, Condvar),
    panic: Mutex<Option<Box<dyn Any + Send>>>,
}

// SAFETY: `work` points at a `Sync` closure that outlives every use (see `run`).
unsafe impl Send for Job {}
unsafe impl Sync for Job {}

impl Job {
    fn exhausted(&self) -> bool {
        self.next.load(Ordering::Relaxed) >= self.parts
    }

    /// Claims and runs parts until none is left.
    fn help(&self) {
        loop {
            let part = self.next.fetch_add(1, Ordering::Relaxed);
            if part >= self.parts {
                return;
            }
            // SAFETY: a claimed part: the caller is still waiting for it (`work` is alive).
            let work = unsafe { &*self.work };
            if let Err(payload) = catch_unwind(AssertUnwindSafe(|| work(part))) {
                let mut first = self.panic.lock().unwrap_or_else(|e| e.into_inner());
                first.get_or_insert(payload);
            }
            if self.done.fetch_add(1, Ordering::AcqRel) + 1 == self.parts {
                let _guard = self.finished.0.lock().unwrap_or_else(|e| e.into_inner());
                self.finished.1.notify_all();
            }
        }
    }

    fn wait(&self) {
        // The rest is usually a worker finishing its last part: spin before sleeping (a
        // futex wake-up costs tens of microseconds, and a step waits thousands of times).
        if spin_until(|| self.done.load(Ordering::Acquire) >= self.parts) {
            return;
        }
        let mut guard = self.finished.0.lock().unwrap_or_else(|e| e.into_inner());
        while self.done.load(Ordering::Acquire) < self.parts {
            guard = self
                .finished
                .1
                .wait(guard)
                .unwrap_or_else(|e| e.into_inner());
        }
    }
}

/// How long an idle worker, or a caller waiting for its parts, spins before it sleeps: longer
/// than the gap between two ops of a training step, so workers are awake when the next op's
/// parts arrive (as OpenMP runtimes do: Intel's spins 200 ms by default).
const SPIN: std::time::Duration = std::time::Duration::from_micros(500);

/// Spins until `ready()` or [`SPIN`] has passed; whether it became ready.
fn spin_until(ready: impl Fn() -> bool) -> bool {
    let start = std::time::Instant::now();
    loop {
        for _ in 0..64 {
            if ready() {
                return true;
            }
            std::hint::spin_loop();
        }
        if start.elapsed() > SPIN {
            return ready();
        }
    }
}

/// The persistent workers and the queue of calls they help with.
struct Pool {
    queue: Mutex<VecDeque<Arc<Job>>>,
    wake: Condvar,
    /// Jobs pushed so far: spinning workers watch it instead of the locked queue.
    pushed: AtomicUsize,
    /// Workers asleep on `wake` (a caller notifies only when some are).
    sleepers: AtomicUsize,
}

fn pool() -> &'static Pool {
    static POOL: OnceLock<&'static Pool> = OnceLock::new();
    POOL.get_or_init(|| {
        let pool: &'static Pool = Box::leak(Box::new(Pool {
            queue: Mutex::new(VecDeque::new()),
            wake: Condvar::new(),
            pushed: AtomicUsize::new(0),
            sleepers: AtomicUsize::new(0),
        }));
        for i in 1..threads() {
            let spawned = std::thread::Builder::new()
                .name(format!("redline-cpu-{i}"))
                .spawn(move || pool.serve());
            // Without a worker the callers run every part themselves: slower, still correct.
            if let Err(e) = spawned {
                eprintln!("redline-cpu: could not start worker thread {i}: {e}");
            }
        }
        pool
    })
}

impl Pool {
    fn serve(&self) {
        loop {
            self.next_job().help();
        }
    }

    /// The oldest job with parts left: spins for [`SPIN`] watching for a new one, then sleeps.
    fn next_job(&self) -> Arc<Job> {
        loop {
            let seen = self.pushed.load(Ordering::Acquire);
            if let Some(job) = self.front(&mut self.queue.lock().unwrap_or_else(|e| e.into_inner()))
            {
                return job;
            }
            if spin_until(|| self.pushed.load(Ordering::Acquire) != seen) {
                continue;
            }
            let mut queue = self.queue.lock().unwrap_or_else(|e| e.into_inner());
            loop {
                if let Some(job) = self.front(&mut queue) {
                    return job;
                }
                // Counted under the lock: a caller pushes under it too, then reads the count.
                self.sleepers.fetch_add(1, Ordering::SeqCst);
                queue = self.wake.wait(queue).unwrap_or_else(|e| e.into_inner());
                self.sleepers.fetch_sub(1, Ordering::SeqCst);
            }
        }
    }

    /// The first job in `queue` with parts left (exhausted ones are dropped).
    fn front(&self, queue: &mut VecDeque<Arc<Job>>) -> Option<Arc<Job>> {
        while queue.front().is_some_and(|j| j.exhausted()) {
            queue.pop_front();
        }
        queue.front().cloned()
    }
}

/// Runs `work(part)` for every part of `0..parts` on the pool and the calling thread; returns
/// when all have finished, re-raising the first panic.
fn run(parts: usize, work: &(dyn Fn(usize) + Sync)) {
    // SAFETY: only the lifetime is erased; this function does not return (or unwind) before
    // every part has finished, and a job's `work` is never dereferenced after that.
    let work: *const (dyn Fn(usize) + Sync + 'static) = unsafe { std::mem::transmute(work) };
    let job = Arc::new(Job {
        work,
        parts,
        next: AtomicUsize::new(0),
        done: AtomicUsize::new(0),
        finished: (Mutex::new(()), Condvar::new()),
        panic: Mutex::new(None),
    });
    let pool = pool();
    pool.queue
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push_back(job.clone());
    pool.pushed.fetch_add(1, Ordering::Release);
    // A worker that counted itself asleep did so under the queue's lock, before the push
    // above: it is seen here. One that counts itself later finds the job in the queue first.
    if pool.sleepers.load(Ordering::SeqCst) > 0 {
        pool.wake.notify_all();
    }
    job.help();
    job.wait();
    let payload = job.panic.lock().unwrap_or_else(|e| e.into_inner()).take();
    if let Some(payload) = payload {
        resume_unwind(payload);
    }
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

    #[test]
    fn nested_and_concurrent_calls_finish_and_panics_reach_the_caller() {
        let total = AtomicUsize::new(0);
        std::thread::scope(|scope| {
            for _ in 0..4 {
                scope.spawn(|| {
                    for_each_task(50, |_| {
                        for_parts(1000, 4, |_, r| {
                            total.fetch_add(r.len(), Ordering::Relaxed);
                        });
                    });
                });
            }
        });
        assert_eq!(total.load(Ordering::Relaxed), 4 * 50 * 1000);
        let caught = catch_unwind(|| for_each_task(8, |t| assert!(t != 5, "task {t} failed")));
        let payload = caught.expect_err("the part's panic reaches the caller");
        let message = payload
            .downcast_ref::<String>()
            .cloned()
            .unwrap_or_default();
        assert!(message.contains("task 5 failed"), "{message}");
        // The pool still works afterwards.
        let after = AtomicUsize::new(0);
        for_each_task(8, |_| {
            after.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(after.load(Ordering::Relaxed), 8);
    }
}
