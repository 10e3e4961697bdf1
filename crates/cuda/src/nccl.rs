//! NCCL: the collectives data parallelism runs on CUDA devices.
//!
//! Bound by hand from `libnccl.so.2`, found like every other library (NVIDIA's `nvidia-nccl-cu13`
//! wheel, which PyTorch pulls in, ships only that file — a name cudarc's own lookup never
//! tries). A [`Communicator`] is one rank's member of a group on one device, with a stream of
//! its own: each collective waits on the device for the event its inputs are final at, runs
//! there while the compute stream goes on, and returns the event its results are complete at.
//! The tensors of one call go in one NCCL group (one launch).
//!
//! NCCL waits forever for a peer that died mid-collective. A watchdog thread per communicator
//! looks at the oldest unfinished collective: past the group's timeout it aborts the
//! communicator (`ncclCommAbort` ends the kernels), so the job fails with a message instead of
//! hanging — PyTorch's `TORCH_NCCL_ASYNC_ERROR_HANDLING`. The abort never runs beside another
//! NCCL call on the communicator (it frees it), except one blocked past the timeout, which
//! only an abort ends. A call that fails aborts it too (NCCL's guidance: nothing can be
//! assumed of a communicator after an error), and one dropped while its collectives are still
//! unfinished after the timeout is aborted rather than destroyed (which would wait forever).
//! A call answering `ncclInProgress` (a non-blocking communicator: `NCCL_COMM_BLOCKING=0`) is
//! polled to its end within the timeout.
//!
//! Collectives may be captured into a CUDA graph (NCCL ≥ 2.9): when the event a collective
//! waits for was recorded on a capturing stream, NCCL's stream joins the capture and the calls
//! are recorded, not run. Such a collective is not watched (its event never completes: it is
//! never run as such); whoever replays the graph hands the point after each replay to
//! [`Communicator::watch`] instead, and asks [`Communicator::alive`] before replaying.
//!
//! Not yet run on a GPU: the library, its version and unique ids are tested here (they need no
//! device); communicators and collectives run in `gpu-check`'s NCCL stage.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

use cudarc::driver::{sys, CudaContext, CudaStream};
use redline_tensor::DType;

use crate::gpu::{DevicePtr, GpuEvent};
use crate::libs;

/// The file this build loads (NCCL 2's ABI, whatever CUDA version).
pub const LIBRARY: &str = "libnccl.so.2";

/// NCCL's `ncclUniqueId`: 128 opaque bytes rank 0 makes and every rank passes to its
/// communicator (sent through the job's rendezvous).
#[derive(Clone, Copy, PartialEq, Eq)]
#[repr(C)]
pub struct UniqueId(pub [u8; 128]);

impl std::fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "UniqueId({:02x?}…)", &self.0[..8])
    }
}

type Comm = *mut c_void;
type Status = c_int;

/// `ncclInProgress`: the call goes on in the background (a non-blocking communicator, which
/// `NCCL_COMM_BLOCKING=0` makes of any); `ncclCommGetAsyncError` says when it has ended.
const IN_PROGRESS: Status = 7;

/// `ncclAllReduce` and `ncclBroadcast`: (send, receive, count, type, op or root, comm, stream).
type InPlace = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    c_int,
    c_int,
    Comm,
    sys::CUstream,
) -> Status;

/// The entry points used, with NCCL 2's signatures (nccl.h).
struct Functions {
    get_version: unsafe extern "C" fn(*mut c_int) -> Status,
    get_unique_id: unsafe extern "C" fn(*mut UniqueId) -> Status,
    comm_init_rank: unsafe extern "C" fn(*mut Comm, c_int, UniqueId, c_int) -> Status,
    all_reduce: InPlace,
    broadcast: InPlace,
    group_start: unsafe extern "C" fn() -> Status,
    group_end: unsafe extern "C" fn() -> Status,
    comm_async_error: unsafe extern "C" fn(Comm, *mut Status) -> Status,
    comm_abort: unsafe extern "C" fn(Comm) -> Status,
    comm_destroy: unsafe extern "C" fn(Comm) -> Status,
    error_string: unsafe extern "C" fn(Status) -> *const c_char,
}

/// The loaded library: where from, its version, its functions.
pub struct Nccl {
    pub path: PathBuf,
    /// "2.32.6".
    pub version: String,
    f: Functions,
    _library: libloading::Library,
}

/// NCCL, or why not (looked up once per process).
pub fn library() -> Result<&'static Nccl, String> {
    static LOADED: OnceLock<Result<Nccl, String>> = OnceLock::new();
    LOADED
        .get_or_init(load)
        .as_ref()
        .map_err(|e| format!("NCCL is not available: {e}"))
}

fn load() -> Result<Nccl, String> {
    let path = libs::find(LIBRARY).map_err(|e| e.to_string())?;
    let library = libs::load_global(&path).map_err(|e| e.to_string())?;
    let missing = |name: &str, e: libloading::Error| format!("{}: {name}: {e}", path.display());
    macro_rules! symbol {
        ($name:literal) => {
            // SAFETY: the field's type is the function's signature in nccl.h (NCCL 2).
            *unsafe { library.get(concat!($name, "\0").as_bytes()) }
                .map_err(|e| missing($name, e))?
        };
    }
    let f = Functions {
        get_version: symbol!("ncclGetVersion"),
        get_unique_id: symbol!("ncclGetUniqueId"),
        comm_init_rank: symbol!("ncclCommInitRank"),
        all_reduce: symbol!("ncclAllReduce"),
        broadcast: symbol!("ncclBroadcast"),
        group_start: symbol!("ncclGroupStart"),
        group_end: symbol!("ncclGroupEnd"),
        comm_async_error: symbol!("ncclCommGetAsyncError"),
        comm_abort: symbol!("ncclCommAbort"),
        comm_destroy: symbol!("ncclCommDestroy"),
        error_string: symbol!("ncclGetErrorString"),
    };
    let mut code = 0;
    // SAFETY: an out-parameter.
    check_with(&f, "ncclGetVersion", unsafe { (f.get_version)(&mut code) })?;
    Ok(Nccl {
        path,
        version: version_text(code),
        f,
        _library: library,
    })
}

/// NCCL's version code (major·10000 + minor·100 + patch since 2.9; major·1000 + … before).
pub fn version_text(code: c_int) -> String {
    let (major, minor, patch) = match code >= 10000 {
        true => (code / 10000, code / 100 % 100, code % 100),
        false => (code / 1000, code / 100 % 10, code % 100),
    };
    format!("{major}.{minor}.{patch}")
}

fn check_with(f: &Functions, call: &str, status: Status) -> Result<(), String> {
    if status == 0 {
        return Ok(());
    }
    // SAFETY: NCCL returns a static string for any status.
    let text = unsafe { CStr::from_ptr((f.error_string)(status)) };
    Err(format!(
        "{call} failed: {} ({status})",
        text.to_string_lossy()
    ))
}

/// NCCL's element type for `dtype`.
pub fn data_type(dtype: DType) -> c_int {
    match dtype {
        DType::U8 => 1,
        DType::I32 => 2,
        DType::I64 => 4,
        DType::F16 => 6,
        DType::F32 => 7,
        DType::F64 => 8,
        DType::BF16 => 9,
    }
}

/// How an all-reduce combines (NCCL's `ncclRedOp_t`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceOp {
    Sum = 0,
    Max = 2,
    /// The sum divided by the world size, in the reduction (floating types only).
    Avg = 4,
}

impl Nccl {
    fn check(&self, call: &str, status: Status) -> Result<(), String> {
        check_with(&self.f, call, status)
    }

    /// A fresh unique id (rank 0's to make; needs no device).
    pub fn unique_id(&self) -> Result<UniqueId, String> {
        let mut id = UniqueId([0; 128]);
        // SAFETY: an out-parameter of ncclUniqueId's size and layout.
        self.check("ncclGetUniqueId", unsafe {
            (self.f.get_unique_id)(&mut id)
        })?;
        Ok(id)
    }
}

/// A buffer a collective reads and writes in place: where, how many elements, of what.
#[derive(Debug, Clone, Copy)]
pub struct Buffer {
    pub ptr: DevicePtr,
    pub len: usize,
    pub dtype: DType,
}

/// One rank's NCCL communicator on one device, with its own stream.
pub struct Communicator {
    inner: Arc<Inner>,
}

struct Inner {
    nccl: &'static Nccl,
    comm: Comm,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    rank: usize,
    world: usize,
    timeout: Duration,
    /// Collectives enqueued and not yet seen complete, oldest first (the watchdog's list).
    in_flight: Mutex<Vec<(GpuEvent, Instant, String)>>,
    /// Serialises enqueues (one NCCL call on the communicator at a time). Not `in_flight`'s
    /// lock: `ncclGroupEnd` may block on the host (connecting to a peer that died), and the
    /// watchdog must still get to abort the communicator then.
    enqueuing: Mutex<()>,
    /// The enqueue under way and since when: the watchdog times it like a collective.
    enqueue_since: Mutex<Option<(Instant, String)>>,
    /// Why the communicator was aborted; every later call fails with it.
    broken: Mutex<Option<String>>,
}

// SAFETY: an NCCL communicator may be used from any thread, one call at a time: every enqueue
// below holds `enqueuing`, and so does the watchdog's abort — except of an enqueue blocked past
// the timeout, which only an abort ends (as PyTorch's watchdog does). The watchdog's other
// call, ncclCommGetAsyncError, NCCL allows from another thread while a call runs.
unsafe impl Send for Inner {}
unsafe impl Sync for Inner {}

impl Communicator {
    /// Joins the group `id` names as `rank` of `world` on `ctx`'s device (blocks until every
    /// rank has joined — rendezvous first, so all are known to be alive), with a new stream.
    /// Collectives unfinished after `timeout` abort the communicator.
    pub fn new(
        ctx: &Arc<CudaContext>,
        id: &UniqueId,
        rank: usize,
        world: usize,
        timeout: Duration,
    ) -> Result<Self, String> {
        let nccl = library()?;
        if rank >= world {
            return Err(format!("rank {rank} in a world of {world}"));
        }
        ctx.bind_to_thread()
            .map_err(|e| format!("binding the context: {e:?}"))?;
        let stream = ctx
            .new_stream()
            .map_err(|e| format!("creating NCCL's stream: {e:?}"))?;
        let mut comm: Comm = std::ptr::null_mut();
        // SAFETY: an out-parameter; the id is passed by value as nccl.h declares.
        let status =
            unsafe { (nccl.f.comm_init_rank)(&mut comm, world as c_int, *id, rank as c_int) };
        let joined = match status {
            IN_PROGRESS => settle(nccl, comm, "ncclCommInitRank", Instant::now() + timeout),
            status => nccl.check("ncclCommInitRank", status),
        };
        if let Err(why) = joined {
            if !comm.is_null() {
                // SAFETY: a communicator that failed to join; not used again.
                unsafe { (nccl.f.comm_abort)(comm) };
            }
            return Err(why);
        }
        let inner = Arc::new(Inner {
            nccl,
            comm,
            ctx: ctx.clone(),
            stream,
            rank,
            world,
            timeout,
            in_flight: Mutex::new(Vec::new()),
            enqueuing: Mutex::new(()),
            enqueue_since: Mutex::new(None),
            broken: Mutex::new(None),
        });
        let watched = Arc::downgrade(&inner);
        std::thread::Builder::new()
            .name(format!("redline-nccl-watchdog-{rank}"))
            .spawn(move || watchdog(watched))
            .map_err(|e| format!("starting NCCL's watchdog: {e}"))?;
        Ok(Self { inner })
    }

    pub fn rank(&self) -> usize {
        self.inner.rank
    }

    pub fn world(&self) -> usize {
        self.inner.world
    }

    /// All-reduces `buffers` in place on NCCL's stream after `ready` (one NCCL group); the
    /// event marks the results.
    pub fn all_reduce(
        &self,
        buffers: &[Buffer],
        op: ReduceOp,
        ready: Option<&GpuEvent>,
    ) -> Result<GpuEvent, String> {
        let f = self.inner.nccl.f.all_reduce;
        self.in_place("ncclAllReduce", f, op as c_int, buffers, ready)
    }

    /// Copies `root`'s `buffers` to every rank in place, after `ready`.
    pub fn broadcast(
        &self,
        buffers: &[Buffer],
        root: usize,
        ready: Option<&GpuEvent>,
    ) -> Result<GpuEvent, String> {
        let f = self.inner.nccl.f.broadcast;
        self.in_place("ncclBroadcast", f, root as c_int, buffers, ready)
    }

    /// Calls `f` (with `arg`: the reduction, the root) on each buffer in place, inside one
    /// group enqueued after `ready`. The caller keeps every buffer alive until the returned
    /// event has been waited for.
    fn in_place(
        &self,
        what: &str,
        f: InPlace,
        arg: c_int,
        buffers: &[Buffer],
        ready: Option<&GpuEvent>,
    ) -> Result<GpuEvent, String> {
        self.enqueue(what, ready, |comm, stream| {
            buffers.iter().try_for_each(|b| {
                let ptr = b.ptr.0 as *mut c_void;
                let dtype = data_type(b.dtype);
                // SAFETY: `b` is a device allocation of `len` elements of its dtype, alive
                // until the event is waited for; send = receive is allowed.
                match unsafe { f(ptr, ptr, b.len, dtype, arg, comm, stream) } {
                    IN_PROGRESS => Ok(()), // settled with the group
                    status => self.inner.nccl.check(what, status),
                }
            })
        })
    }

    /// Enqueues `calls` as one NCCL group on the stream after `ready`, records and watches the
    /// event after it.
    fn enqueue(
        &self,
        what: &str,
        ready: Option<&GpuEvent>,
        calls: impl FnOnce(Comm, sys::CUstream) -> Result<(), String>,
    ) -> Result<GpuEvent, String> {
        let inner = &self.inner;
        let _one_at_a_time = inner.enqueuing.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(why) = inner
            .broken
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
        {
            return Err(why.clone());
        }
        inner
            .ctx
            .bind_to_thread()
            .map_err(|e| format!("binding the context: {e:?}"))?;
        if let Some(ready) = ready {
            inner
                .stream
                .wait(ready)
                .map_err(|e| format!("NCCL's stream waiting for its inputs: {e:?}"))?;
        }
        let f = &inner.nccl.f;
        let since = |now: Option<(Instant, String)>| {
            *inner
                .enqueue_since
                .lock()
                .unwrap_or_else(|p| p.into_inner()) = now;
        };
        let start = Instant::now();
        since(Some((start, what.to_string())));
        // SAFETY: no arguments; paired with the group end below whatever `calls` returns.
        let started = inner
            .nccl
            .check("ncclGroupStart", unsafe { (f.group_start)() });
        let enqueued = started.and_then(|()| {
            let called = calls(inner.comm, inner.stream.cu_stream());
            // SAFETY: closes the group opened above.
            let ended = match unsafe { (f.group_end)() } {
                IN_PROGRESS => {
                    // Out of NCCL's calls and timed here: the watchdog must not abort the
                    // communicator under this thread's polling.
                    since(None);
                    settle(
                        inner.nccl,
                        inner.comm,
                        "ncclGroupEnd",
                        start + inner.timeout,
                    )
                }
                status => inner.nccl.check("ncclGroupEnd", status),
            };
            called.and(ended)
        });
        since(None);
        if let Err(why) = enqueued {
            // Nothing can be assumed of a communicator a call failed on (NCCL's guidance):
            // abort it, so no later call or replay runs on it.
            let why = format!(
                "NCCL {what} on rank {} of {}: {why}; the communicator was aborted",
                inner.rank, inner.world
            );
            inner.abort(why.clone());
            return Err(why);
        }
        let event = inner
            .ctx
            .new_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))
            .and_then(|e| e.record(&inner.stream).map(|()| e))
            .map_err(|e| format!("recording NCCL's {what} event: {e:?}"))?;
        let event = Arc::new(event);
        // Captured into a graph (the stream waited for an event of a capturing stream), the
        // collective does not run now and its event can never be queried (CUDA refuses to
        // query an event recorded during capture): the replays are watched instead
        // ([`Communicator::watch`]).
        let captured = inner
            .stream
            .capture_status()
            .map_err(|e| format!("asking whether NCCL's stream is capturing: {e:?}"))?;
        if captured == sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE {
            let mut in_flight = inner.in_flight.lock().unwrap_or_else(|p| p.into_inner());
            in_flight.retain(|(e, _, _)| !e.is_complete());
            in_flight.push((event.clone(), Instant::now(), what.to_string()));
        }
        Ok(event)
    }

    /// `Err` with the reason once the communicator has been aborted (nothing may be enqueued
    /// on it then, a graph holding its collectives included).
    pub fn alive(&self) -> Result<(), String> {
        match self
            .inner
            .broken
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
        {
            Some(why) => Err(why.clone()),
            None => Ok(()),
        }
    }

    /// Watches `until` (recorded after work that runs this communicator's collectives without
    /// enqueueing them here: a replayed graph) as one of its own collectives, named `what`:
    /// unfinished after the timeout, the communicator is aborted.
    pub fn watch(&self, until: &GpuEvent, what: &str) -> Result<(), String> {
        let mut in_flight = (self.inner.in_flight.lock()).unwrap_or_else(|p| p.into_inner());
        self.alive()?;
        in_flight.retain(|(e, _, _)| !e.is_complete());
        in_flight.push((until.clone(), Instant::now(), what.to_string()));
        Ok(())
    }
}

impl Inner {
    /// Marks the communicator broken with `why` and aborts it (ending its kernels), once: a
    /// second abort would touch the freed communicator. The caller keeps other NCCL calls
    /// out (holds `enqueuing`), unless one is blocked for good.
    fn abort(&self, why: String) {
        let mut broken = self.broken.lock().unwrap_or_else(|p| p.into_inner());
        if broken.is_none() {
            *broken = Some(why);
            // SAFETY: the communicator is alive and aborted only here, once; marked broken,
            // nothing enqueues on it again.
            unsafe { (self.nccl.f.comm_abort)(self.comm) };
        }
    }
}

/// Waits for a call that returned `ncclInProgress` to end, by `deadline`: its final status.
fn settle(nccl: &Nccl, comm: Comm, call: &str, deadline: Instant) -> Result<(), String> {
    loop {
        let mut status: Status = IN_PROGRESS;
        // SAFETY: the communicator is alive; an out-parameter.
        let asked = unsafe { (nccl.f.comm_async_error)(comm, &mut status) };
        nccl.check("ncclCommGetAsyncError", asked)?;
        if status != IN_PROGRESS {
            return nccl.check(call, status);
        }
        if Instant::now() > deadline {
            return Err(format!("{call} still in progress at the timeout"));
        }
        std::thread::sleep(Duration::from_micros(200));
    }
}

/// Every 50 ms: forget finished collectives; abort the communicator when the oldest has run
/// past the timeout or NCCL reports an asynchronous error (a peer's failure).
fn watchdog(watched: Weak<Inner>) {
    const EVERY: Duration = Duration::from_millis(50);
    while let Some(inner) = watched.upgrade() {
        let mut in_flight = inner.in_flight.lock().unwrap_or_else(|p| p.into_inner());
        in_flight.retain(|(e, _, _)| !e.is_complete());
        let mut status: Status = 0;
        {
            // Asked under `broken`'s lock, which every abort holds: never of a freed one.
            let broken = inner.broken.lock().unwrap_or_else(|p| p.into_inner());
            if broken.is_some() {
                return; // aborted (by a call that failed): nothing left to watch
            }
            // SAFETY: the communicator is alive and not aborted (checked above, and no
            // abort can start while the lock is held); an out-parameter.
            let _ = unsafe { (inner.nccl.f.comm_async_error)(inner.comm, &mut status) };
        }
        // An enqueue blocked on the host counts as the oldest collective.
        let blocked = inner
            .enqueue_since
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let oldest = (blocked.iter().map(|(since, what)| (since, what)))
            .chain(in_flight.first().map(|(_, since, what)| (since, what)))
            .min_by_key(|(since, _)| **since);
        let late = oldest.filter(|(since, _)| since.elapsed() > inner.timeout);
        let why = match (status, late) {
            (0 | 7, None) => None,
            (0 | 7, Some((since, what))) => Some(format!(
                "NCCL {what} on rank {} of {} unfinished after {:.1} s (timeout {:.1} s): a \
                 rank died or stalled; the communicator was aborted",
                inner.rank,
                inner.world,
                since.elapsed().as_secs_f64(),
                inner.timeout.as_secs_f64()
            )),
            (error, _) => Some(format!(
                "NCCL reported an error on rank {} of {}: {}; the communicator was aborted",
                inner.rank,
                inner.world,
                check_with(&inner.nccl.f, "ncclCommGetAsyncError", error)
                    .err()
                    .unwrap_or_default()
            )),
        };
        if let Some(why) = why {
            // No NCCL call may run on the communicator while it is aborted (abort frees it):
            // an enqueue under way is waited for, unless it is the one blocked past the
            // timeout, which only an abort ends (as PyTorch's watchdog does).
            let enqueuing = inner.enqueuing.try_lock();
            let idle = !matches!(enqueuing, Err(std::sync::TryLockError::WouldBlock));
            // Looked at again, and held through the abort: an enqueue that returns meanwhile
            // waits here (`since(None)`) rather than starting the next call.
            let since = inner
                .enqueue_since
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            let enqueue_late = (since.as_ref()).is_some_and(|(t, _)| t.elapsed() > inner.timeout);
            if idle || enqueue_late {
                inner.abort(why);
                in_flight.clear();
                return;
            }
        }
        drop(in_flight);
        drop(inner);
        std::thread::sleep(EVERY);
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        if self
            .broken
            .get_mut()
            .unwrap_or_else(|p| p.into_inner())
            .is_some()
        {
            return; // aborted: NCCL has freed it
        }
        // Destroying waits for the communicator's collectives, forever if a peer died: give
        // the watched ones (replays included) the timeout to finish, then abort instead.
        let deadline = Instant::now() + self.timeout;
        let finished = loop {
            let in_flight = self.in_flight.get_mut().unwrap_or_else(|p| p.into_inner());
            in_flight.retain(|(e, _, _)| !e.is_complete());
            let mut status: Status = 0;
            // SAFETY: the communicator is alive; an out-parameter.
            let _ = unsafe { (self.nccl.f.comm_async_error)(self.comm, &mut status) };
            if status != 0 && status != IN_PROGRESS {
                break false;
            }
            if in_flight.is_empty() {
                break true;
            }
            if Instant::now() > deadline {
                break false;
            }
            std::thread::sleep(Duration::from_millis(1));
        };
        match finished {
            true => {
                // Collectives replayed inside a graph run on the compute stream, not this
                // one: the whole context's work must finish before the communicator goes.
                let _ = self.ctx.synchronize();
                let _ = self.stream.synchronize();
                // SAFETY: the communicator's work has finished; it is not used again.
                unsafe { (self.nccl.f.comm_destroy)(self.comm) };
            }
            // SAFETY: ends the collectives still waiting; the communicator is not used again.
            false => unsafe {
                (self.nccl.f.comm_abort)(self.comm);
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn version_codes_read_as_nccl_prints_them() {
        assert_eq!(version_text(23206), "2.32.6");
        assert_eq!(version_text(21803), "2.18.3");
        assert_eq!(version_text(2804), "2.8.4");
    }

    #[test]
    fn every_dtype_has_its_nccl_type() {
        let codes: Vec<c_int> = DType::ALL.iter().map(|&d| data_type(d)).collect();
        assert_eq!(codes, [8, 7, 6, 9, 1, 2, 4]);
    }

    /// Where the wheel is installed the library loads, says its version and makes distinct
    /// unique ids without a GPU; elsewhere the reason names the file (the `nccl` hardware suite
    /// requires the library in CI).
    #[test]
    fn the_library_loads_and_makes_unique_ids_without_a_device() {
        match library() {
            Ok(nccl) => {
                println!("NCCL {} from {}", nccl.version, nccl.path.display());
                assert!(nccl.version.starts_with("2."), "{}", nccl.version);
                let (a, b) = (nccl.unique_id().unwrap(), nccl.unique_id().unwrap());
                assert_ne!(a, b, "two unique ids are the same");
                assert!(a.0.iter().any(|&byte| byte != 0));
            }
            Err(why) => {
                println!("{why}");
                assert!(why.contains(LIBRARY), "{why}");
            }
        }
    }
}
