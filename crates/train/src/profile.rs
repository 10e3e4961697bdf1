//! Where a step's device work goes: a [`Backend`] that forwards every call to another and
//! accounts for it, by kind of op (and, in detail, by op and shape) — calls, the host's time in
//! the call, the bytes a memory-bound op moves and, where the device has a clock, the device's
//! time running it. `bench-imagenet` always counts (a few atomic-free adds per op, no strings);
//! `--profile-ops` asks for the detail: a row per op and shape, each op bracketed by two device
//! timestamps (CUDA events, Vulkan timestamp queries) read back every [`SETTLE_OPS`] ops. A
//! profiled step takes thousands of timestamps (ResNet-50 issues ~3,300 ops a step), more than
//! the device's ring of [`TIMESTAMP_SLOTS`] holds between a phase clock's first and last
//! reading — so in detail the profile also takes the phase clock's timestamps for it, reads
//! them with its own and keeps the readings until asked: nothing is overwritten. Each reading
//! waits for the device, so a profiled step runs a little slower than an unprofiled one; the
//! device time of each op is exact.
//!
//! What the host time means depends on the device: where ops finish before they return (the
//! CPU backend) it is the op's time, exactly; on an asynchronous device it is the time spent
//! issuing it — the launch overhead a CUDA graph removes. Calls that block the host until the
//! device catches up (`synchronize`, `download`, `read_timestamps`) are kept apart as
//! [`OpKind::Blocking`]: the synchronisations `cargo xtask doctor` looks for, each under its
//! own name even without the detail.

use std::borrow::Cow;
use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use redline_tensor::backend::*;
use redline_tensor::{BatchNormCoefParams, DType, Device, Layout, Result};
use serde_json::{json, Value};

/// Ops between two readings of the profile's device timestamps: two stamps an op, well inside
/// the device's ring of [`TIMESTAMP_SLOTS`].
pub const SETTLE_OPS: usize = 1024;

/// What an op spends its time on, for the doctor's diagnosis.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OpKind {
    /// Convolutions and matrix products: arithmetic-bound.
    Compute,
    /// One pass over memory, element by element: unary, binary, select, convert, fill, copy,
    /// the input op, batch-norm's apply.
    Elementwise,
    /// Memory-bound passes that combine elements: reductions, softmax, gather/scatter, pooling,
    /// batch-norm's statistics.
    Reduction,
    /// The multi-tensor updates: optimizer steps, unscale-and-check, the scaler's update.
    Optimizer,
    /// Host→device copies and asynchronous downloads (enqueued, not waited for).
    Transfer,
    /// Calls that wait for the device: synchronize, download, read_timestamps.
    Blocking,
}

impl OpKind {
    pub const ALL: [OpKind; 6] = [
        OpKind::Compute,
        OpKind::Elementwise,
        OpKind::Reduction,
        OpKind::Optimizer,
        OpKind::Transfer,
        OpKind::Blocking,
    ];

    pub fn name(self) -> &'static str {
        match self {
            OpKind::Compute => "compute",
            OpKind::Elementwise => "elementwise",
            OpKind::Reduction => "reduction",
            OpKind::Optimizer => "optimizer",
            OpKind::Transfer => "transfer",
            OpKind::Blocking => "blocking",
        }
    }

    /// Kinds whose speed is set by memory bandwidth (their bytes are counted).
    pub fn memory_bound(self) -> bool {
        matches!(self, OpKind::Elementwise | OpKind::Reduction)
    }
}

/// One row of [`OpProfile::rows`]: an op and shape (or, without detail, a kind of op) and
/// everything it cost.
#[derive(Debug, Clone)]
pub struct OpRow {
    pub label: String,
    pub kind: OpKind,
    pub calls: u64,
    /// The host's time inside the calls.
    pub host: Duration,
    /// The device's time running them (from its timestamps; zero where it takes none).
    pub device: Duration,
    /// Bytes read and written (memory-bound kinds only).
    pub bytes: u64,
}

#[derive(Debug, Default, Clone, Copy)]
struct Cost {
    calls: u64,
    host: Duration,
    device: Duration,
    bytes: u64,
}

#[derive(Default)]
struct Table {
    rows: HashMap<Cow<'static, str>, (OpKind, Cost)>,
    /// Ops bracketed by device timestamps and not read yet: (label, before, after).
    pending: Vec<(Cow<'static, str>, Timestamp, Timestamp)>,
    /// Timestamps taken for the caller (a phase clock), by the number handed out for each:
    /// the device's timestamp until read, then its reading.
    taken: HashMap<u32, Taken>,
    next_taken: u32,
}

#[derive(Clone, Copy)]
enum Taken {
    Pending(Timestamp),
    Read(u64),
}

/// The wrapped backend and its table.
pub struct OpProfile {
    inner: Device,
    /// A row per op and shape, and device timing (else a row per kind, host time only).
    detail: bool,
    table: Mutex<Table>,
}

impl fmt::Debug for OpProfile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "OpProfile({})", self.inner.name())
    }
}

fn conv_label(pass: &str, x: &[usize], w: &[usize], p: &Conv2dParams) -> String {
    format!(
        "conv {pass} {}->{} k{} s{} {}²",
        x[1], w[0], w[2], p.stride[0], x[2]
    )
}

/// Bytes a view's elements take.
fn size(x: &View<'_>) -> u64 {
    (x.layout.numel() * x.dtype().size()) as u64
}

/// Bytes an output of `out`'s shape in `dtype` takes.
fn out_size(out: &Layout, dtype: DType) -> u64 {
    (out.numel() * dtype.size()) as u64
}

impl OpProfile {
    /// A device whose every op is counted into the returned profile; `detail` adds a row per
    /// op and shape and the device's time per op where it has a clock.
    pub fn wrap(inner: Device, detail: bool) -> (Device, Arc<OpProfile>) {
        let profile = Arc::new(OpProfile {
            inner,
            detail,
            table: Mutex::default(),
        });
        (Device::new(profile.clone()), profile)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs `f` on the wrapped backend and charges it to `label` (built only in detail: a
    /// profile that only counts formats no strings) of kind `kind`.
    fn timed<R>(
        &self,
        kind: OpKind,
        label: impl FnOnce() -> String,
        bytes: u64,
        f: impl FnOnce(&dyn Backend) -> R,
    ) -> R {
        self.timed_when(kind, |_| label(), bytes, f, |_| true)
    }

    /// [`timed`](Self::timed) under `label(done)`, where `done` says whether the call did the
    /// work: one that declined (leaving it to the next call) is no call of its own, and only its
    /// host time is charged (to the row `label(false)` names: the next call's).
    fn timed_when<R>(
        &self,
        kind: OpKind,
        label: impl FnOnce(bool) -> String,
        bytes: u64,
        f: impl FnOnce(&dyn Backend) -> R,
        done: impl FnOnce(&R) -> bool,
    ) -> R {
        let backend = self.inner.backend();
        // Blocking calls are host waits by definition; bracketing them would time nothing.
        let stamps = self.detail && kind != OpKind::Blocking;
        let before = if stamps { self.stamp() } else { None };
        let start = Instant::now();
        let out = f(backend);
        let spent = start.elapsed();
        let after = before.and_then(|_| self.stamp());
        let done = done(&out);
        // Blocking calls keep their names always: they are few, and the doctor names the
        // wait it finds.
        let label: Cow<'static, str> = if self.detail || kind == OpKind::Blocking {
            label(done).into()
        } else {
            kind.name().into()
        };
        let mut table = self.lock();
        if let (Some(b), Some(a)) = (before, after) {
            table.pending.push((label.clone(), b, a));
        }
        // Without detail the label borrows the kind's name: no allocation per op.
        let (_, cost) = table.rows.entry(label).or_insert((kind, Cost::default()));
        cost.calls += u64::from(done);
        cost.host += spent;
        cost.bytes += if kind.memory_bound() && done {
            bytes
        } else {
            0
        };
        let full = table.pending.len() >= SETTLE_OPS;
        drop(table);
        if full {
            self.settle();
        }
        out
    }

    /// A device timestamp, or None where the device takes none (or taking one failed: the op
    /// is then timed on the host only, which the report says).
    fn stamp(&self) -> Option<Timestamp> {
        self.inner.backend().timestamp().ok().flatten()
    }

    /// Reads the pending device timestamps: charges each op its device time and keeps the
    /// readings of the caller's timestamps. Waits for the device to reach the last of them.
    pub fn settle(&self) {
        let (pending, callers): (Vec<_>, Vec<(u32, Timestamp)>) = {
            let mut table = self.lock();
            let callers = (table.taken.iter())
                .filter_map(|(&id, t)| match t {
                    Taken::Pending(stamp) => Some((id, *stamp)),
                    Taken::Read(_) => None,
                })
                .collect();
            (std::mem::take(&mut table.pending), callers)
        };
        if pending.is_empty() && callers.is_empty() {
            return;
        }
        let mut stamps: Vec<Timestamp> = pending.iter().flat_map(|(_, b, a)| [*b, *a]).collect();
        stamps.extend(callers.iter().map(|c| c.1));
        let Ok(ns) = self.inner.backend().read_timestamps(&stamps) else {
            return;
        };
        let mut table = self.lock();
        for ((label, _, _), pair) in pending.iter().zip(ns.chunks_exact(2)) {
            if let Some((_, cost)) = table.rows.get_mut(label.as_ref()) {
                cost.device += Duration::from_nanos(pair[1].saturating_sub(pair[0]));
            }
        }
        for ((id, _), &reading) in callers.iter().zip(&ns[2 * pending.len()..]) {
            table.taken.insert(*id, Taken::Read(reading));
        }
    }

    /// The readings of timestamps this profile took for the caller (detail only), each
    /// forgotten once read.
    fn read_taken(&self, stamps: &[Timestamp]) -> Result<Vec<u64>> {
        // A step's phase clock is read a few steps late, when the profile's own reads (every
        // SETTLE_OPS ops) have usually taken its stamps already: then nothing waits.
        let pending = {
            let table = self.lock();
            (stamps.iter()).any(|s| matches!(table.taken.get(&s.0), Some(Taken::Pending(_))))
        };
        if pending {
            self.settle();
        }
        let mut table = self.lock();
        (stamps.iter())
            .map(|s| match table.taken.remove(&s.0) {
                Some(Taken::Read(ns)) => Ok(ns),
                _ => Err(redline_tensor::TensorError::Backend {
                    device: self.inner.name(),
                    what: format!("timestamp {} was not taken, or was read already", s.0),
                }),
            })
            .collect()
    }

    /// Forgets what was counted so far (after warm-up steps).
    pub fn reset(&self) {
        self.settle();
        self.lock().rows.clear();
    }

    /// Every row, the most time first (device time where there is one, else host time).
    pub fn rows(&self) -> Vec<OpRow> {
        self.settle();
        let table = self.lock();
        let mut rows: Vec<OpRow> = (table.rows.iter())
            .map(|(label, &(kind, c))| OpRow {
                label: label.to_string(),
                kind,
                calls: c.calls,
                host: c.host,
                device: c.device,
                bytes: c.bytes,
            })
            .collect();
        let time = |r: &OpRow| r.device.max(r.host);
        rows.sort_by(|a, b| time(b).cmp(&time(a)).then(a.label.cmp(&b.label)));
        rows
    }

    /// Whether the ops were timed on the device's clock (detail on a device that has one).
    pub fn device_timed(&self) -> bool {
        self.detail
            && self
                .rows()
                .iter()
                .any(|r| r.kind != OpKind::Blocking && r.device > Duration::ZERO)
    }
}

/// What a profile adds up to per step, for the bench's JSON (its `ops` section) and the
/// doctor. Milliseconds are per step.
#[derive(Debug, Clone, PartialEq)]
pub struct StepProfile {
    /// How the per-kind times were measured: "device timestamps", "host timer (ops run
    /// synchronously)" or "host timer (enqueue only)".
    pub clock: &'static str,
    /// Device calls per step (blocking ones excluded): kernels, library calls and copies.
    pub launches: f64,
    /// Host time inside non-blocking calls: issuing work (or, synchronously, doing it).
    pub host_issue_ms: f64,
    /// Host time waiting for the device, and which calls (label, calls and ms per step).
    pub blocked_ms: f64,
    pub blocking: Vec<(String, f64, f64)>,
    /// Device time running ops (device clock only; synchronously, the host time).
    pub device_ms: Option<f64>,
    /// Per kind: calls, ms (device time where measured, else host) and bytes, per step.
    pub kinds: Vec<(OpKind, f64, f64, f64)>,
    /// In detail, the [`TOP_ROWS`] costliest ops and shapes: label, kind, calls, ms, bytes.
    pub rows: Vec<(String, OpKind, f64, f64, f64)>,
}

/// How many op rows a detailed profile keeps in its JSON.
pub const TOP_ROWS: usize = 40;

impl StepProfile {
    /// The profile of `rows` over `steps` steps; `synchronous`: the device finishes each op
    /// before returning (so host times are op times).
    /// `detail`: the rows are per op and shape (else per kind).
    pub fn new(
        rows: &[OpRow],
        steps: usize,
        synchronous: bool,
        device_timed: bool,
        detail: bool,
    ) -> Self {
        let per = |x: f64| x / steps.max(1) as f64;
        let ms = |d: Duration| per(d.as_secs_f64() * 1e3);
        let issued = || rows.iter().filter(|r| r.kind != OpKind::Blocking);
        let blocking: Vec<(String, f64, f64)> = (rows.iter())
            .filter(|r| r.kind == OpKind::Blocking && r.calls > 0)
            .map(|r| (r.label.clone(), per(r.calls as f64), ms(r.host)))
            .collect();
        let time = |r: &OpRow| if device_timed { r.device } else { r.host };
        let kinds = (OpKind::ALL.iter())
            .map(|&k| {
                let of = || rows.iter().filter(move |r| r.kind == k);
                let t = if k == OpKind::Blocking {
                    of().map(|r| r.host).sum()
                } else {
                    of().map(time).sum::<Duration>()
                };
                let calls = of().map(|r| r.calls).sum::<u64>() as f64;
                let bytes = of().map(|r| r.bytes).sum::<u64>() as f64;
                (k, per(calls), ms(t), per(bytes))
            })
            .collect();
        Self {
            clock: match (device_timed, synchronous) {
                (true, _) => "device timestamps",
                (false, true) => "host timer (ops run synchronously)",
                (false, false) => "host timer (enqueue only)",
            },
            launches: per(issued().map(|r| r.calls).sum::<u64>() as f64),
            host_issue_ms: ms(issued().map(|r| r.host).sum()),
            blocked_ms: blocking.iter().map(|b| b.2).sum(),
            blocking,
            device_ms: match (device_timed, synchronous) {
                (true, _) => Some(ms(issued().map(|r| r.device).sum())),
                (false, true) => Some(ms(issued().map(|r| r.host).sum())),
                (false, false) => None,
            },
            kinds,
            rows: (rows.iter())
                .filter(|r| detail && r.kind != OpKind::Blocking)
                .take(TOP_ROWS)
                .map(|r| {
                    let calls = per(r.calls as f64);
                    (
                        r.label.clone(),
                        r.kind,
                        calls,
                        ms(time(r)),
                        per(r.bytes as f64),
                    )
                })
                .collect(),
        }
    }

    /// The bench JSON's `ops` section.
    pub fn to_json(&self) -> Value {
        let kinds: serde_json::Map<String, Value> = (self.kinds.iter())
            .map(|&(k, calls, ms, bytes)| {
                let v =
                    json!({ "calls_per_step": calls, "ms_per_step": ms, "bytes_per_step": bytes });
                (k.name().to_string(), v)
            })
            .collect();
        let blocking: Vec<Value> = (self.blocking.iter())
            .map(|(call, n, ms)| json!({ "call": call, "calls_per_step": n, "ms_per_step": ms }))
            .collect();
        let rows: Vec<Value> = (self.rows.iter())
            .map(|(op, kind, calls, ms, bytes)| {
                json!({ "op": op, "kind": kind.name(), "calls_per_step": calls,
                        "ms_per_step": ms, "bytes_per_step": bytes })
            })
            .collect();
        json!({
            "clock": self.clock,
            "rows": rows,
            "launches_per_step": self.launches,
            "host_issue_ms_per_step": self.host_issue_ms,
            "blocked_ms_per_step": self.blocked_ms,
            "blocking_calls": blocking,
            "device_ms_per_step": self.device_ms,
            "by_kind": kinds,
        })
    }
}

/// The device's memory bandwidth as its simplest ops reach it, in GB/s (bytes read plus bytes
/// written, per second): the best of a few rounds of a copy and of a negation of `bytes` bytes,
/// timed on the device's clock where it has one, else on the host around a synchronisation.
/// Two ops, because either may be the slower path on some backend (the CPU backend's copy
/// converts through a scratch buffer). What a well-written memory-bound kernel can reach on
/// this device: the doctor's yardstick for the elementwise and reduction ops.
pub fn stream_bandwidth(device: &Device, bytes: usize) -> Result<f64> {
    let backend = device.backend();
    let len = (bytes / 4).max(1);
    let layout = Layout::contiguous(&[len]);
    let src = backend.fill(DType::F32, len, 1.0)?;
    let dst = backend.fill(DType::F32, len, 0.0)?;
    let view = View {
        storage: &src,
        layout: &layout,
    };
    let mut best = f64::INFINITY;
    for round in 0..6 {
        backend.synchronize()?;
        let start = Instant::now();
        let before = backend.timestamp()?;
        let negated = if round % 2 == 0 {
            backend.copy_into(&dst, &layout, view)?;
            None
        } else {
            Some(backend.unary(UnaryOp::Neg, view, &layout)?)
        };
        let after = backend.timestamp()?;
        backend.synchronize()?;
        let host = start.elapsed().as_secs_f64();
        drop(negated);
        let seconds = match (before, after) {
            (Some(b), Some(a)) => {
                let ns = backend.read_timestamps(&[b, a])?;
                ns[1].saturating_sub(ns[0]) as f64 / 1e9
            }
            _ => host,
        };
        // The first round of each op pays for first touches and lazy set-up.
        if round >= 2 && seconds > 0.0 {
            best = best.min(seconds);
        }
    }
    Ok(2.0 * (len * 4) as f64 / best / 1e9)
}

/// A report's `device_memory` section: what the device's caching allocator holds `after`
/// `steps` steps, and what it took from the device and served from its cache since `before`
/// (null where the device keeps no statistics).
pub fn memory_json(
    before: Option<redline_tensor::MemoryStats>,
    after: Option<redline_tensor::MemoryStats>,
    steps: usize,
) -> Value {
    let (Some(before), Some(after)) = (before, after) else {
        return Value::Null;
    };
    json!({
        "in_use_bytes": after.in_use,
        "reserved_bytes": after.reserved,
        "peak_in_use_bytes": after.peak_in_use,
        "device_allocations_measured": after.device_allocations - before.device_allocations,
        "reuses_measured": after.reuses - before.reuses,
        "steps": steps,
    })
}

/// Batch-norm ops' label suffix: two operands, and gated.
fn operands(y: bool, gate: bool) -> &'static str {
    match (y, gate) {
        (false, _) => "",
        (true, false) => " (2)",
        (true, true) => " (2, gated)",
    }
}

fn dense(l: &Layout) -> &'static str {
    if l.is_contiguous() {
        ""
    } else {
        " strided"
    }
}

use OpKind::*;

impl Backend for OpProfile {
    fn name(&self) -> String {
        self.inner.name()
    }
    fn id(&self) -> usize {
        self.inner.backend().id()
    }
    fn supports(&self, op: Op, dtype: DType) -> bool {
        self.inner.backend().supports(op, dtype)
    }
    fn may_flush_subnormals(&self, dtype: DType) -> bool {
        self.inner.backend().may_flush_subnormals(dtype)
    }
    fn annotate(&self, name: &str) -> Annotation {
        self.inner.backend().annotate(name)
    }
    fn host_allocator(&self) -> Option<Arc<dyn redline_hostmem::HostAllocator>> {
        self.inner.backend().host_allocator()
    }
    fn memory_stats(&self) -> Option<redline_tensor::MemoryStats> {
        self.inner.backend().memory_stats()
    }
    fn fill(&self, dtype: DType, len: usize, value: f64) -> Result<Storage> {
        let bytes = (len * dtype.size()) as u64;
        self.timed(
            Elementwise,
            || "fill".into(),
            bytes,
            |b| b.fill(dtype, len, value),
        )
    }
    fn upload(&self, dtype: DType, bytes: HostBytes) -> Result<Storage> {
        self.timed(Transfer, || "upload".into(), 0, |b| b.upload(dtype, bytes))
    }
    fn upload_into(&self, dst: &Storage, bytes: HostBytes) -> Result<()> {
        let f = |b: &dyn Backend| b.upload_into(dst, bytes);
        self.timed(Transfer, || "upload_into".into(), 0, f)
    }
    fn download(&self, x: View<'_>) -> Result<Vec<u8>> {
        self.timed(Blocking, || "download".into(), 0, |b| b.download(x))
    }
    fn download_async(&self, x: View<'_>) -> Result<Download> {
        let f = |b: &dyn Backend| b.download_async(x);
        self.timed(Transfer, || "download_async".into(), 0, f)
    }
    fn synchronize(&self) -> Result<()> {
        self.timed(Blocking, || "synchronize".into(), 0, |b| b.synchronize())
    }
    fn record_event(&self) -> Result<redline_tensor::Event> {
        self.inner.backend().record_event()
    }
    fn wait_event(&self, event: &redline_tensor::Event) -> Result<()> {
        self.inner.backend().wait_event(event)
    }
    fn upload_into_after(
        &self,
        dst: &Storage,
        bytes: HostBytes,
        after: &redline_tensor::Event,
    ) -> Result<redline_tensor::Event> {
        let f = |b: &dyn Backend| b.upload_into_after(dst, bytes, after);
        self.timed(Transfer, || "upload_into_after".into(), 0, f)
    }
    fn download_after<'a>(
        &self,
        x: View<'a>,
        after: &redline_tensor::Event,
    ) -> Result<redline_tensor::DownloadOf<'a>> {
        let f = |b: &dyn Backend| b.download_after(x, after);
        self.timed(Transfer, || "download_after".into(), 0, f)
    }
    fn begin_capture(&self) -> Result<()> {
        if self.detail {
            // Each op is bracketed by timestamps, which a graph cannot hold.
            return Err(redline_tensor::TensorError::Backend {
                device: self.name(),
                what: "a per-op profile times every op apart; a captured graph runs them as one"
                    .into(),
            });
        }
        self.inner.backend().begin_capture()
    }
    fn end_capture(&self) -> Result<redline_tensor::Graph> {
        self.inner.backend().end_capture()
    }
    fn timestamp(&self) -> Result<Option<Timestamp>> {
        let Some(stamp) = self.inner.backend().timestamp()? else {
            return Ok(None);
        };
        if !self.detail {
            return Ok(Some(stamp));
        }
        // Taken for the caller and read with the profile's own, before the ring wraps.
        let mut table = self.lock();
        let id = table.next_taken;
        table.next_taken = id.wrapping_add(1);
        table.taken.insert(id, Taken::Pending(stamp));
        Ok(Some(Timestamp(id)))
    }
    fn read_timestamps(&self, stamps: &[Timestamp]) -> Result<Vec<u64>> {
        let label = || "read_timestamps".into();
        if self.detail {
            return self.timed(Blocking, label, 0, |_| self.read_taken(stamps));
        }
        self.timed(Blocking, label, 0, |b| b.read_timestamps(stamps))
    }
    fn unary(&self, op: UnaryOp, x: View<'_>, out: &Layout) -> Result<Storage> {
        let label = || format!("{}{}", op.name(), dense(x.layout));
        let bytes = size(&x) + out_size(out, x.dtype());
        self.timed(Elementwise, label, bytes, |b| b.unary(op, x, out))
    }
    fn binary(&self, op: BinaryOp, a: View<'_>, b: View<'_>, out: &Layout) -> Result<Storage> {
        let label = || format!("{}{}{}", op.name(), dense(a.layout), dense(b.layout));
        let dtype = if op.is_comparison() {
            DType::U8
        } else {
            a.dtype()
        };
        let bytes = size(&a) + size(&b) + out_size(out, dtype);
        self.timed(Elementwise, label, bytes, |be| be.binary(op, a, b, out))
    }
    fn reduce(&self, op: ReduceOp, x: View<'_>, axes: &[usize]) -> Result<Storage> {
        let label = || format!("reduce {op:?}");
        self.timed(Reduction, label, size(&x), |b| b.reduce(op, x, axes))
    }
    fn matmul(&self, a: View<'_>, b: View<'_>) -> Result<Storage> {
        let label = || format!("matmul {:?}x{:?}", a.layout.shape(), b.layout.shape());
        self.timed(Compute, label, 0, |be| be.matmul(a, b))
    }
    fn select(&self, cond: View<'_>, a: View<'_>, b: View<'_>, out: &Layout) -> Result<Storage> {
        let bytes = size(&cond) + size(&a) + size(&b) + out_size(out, a.dtype());
        self.timed(
            Elementwise,
            || "select".into(),
            bytes,
            |be| be.select(cond, a, b, out),
        )
    }
    fn convert(&self, x: View<'_>, dtype: DType, out: &Layout) -> Result<Storage> {
        let label = || format!("convert {:?}->{dtype:?} {:?}", x.dtype(), x.layout.shape());
        let bytes = size(&x) + out_size(out, dtype);
        self.timed(Elementwise, label, bytes, |b| b.convert(x, dtype, out))
    }
    fn copy_into(&self, dst: &Storage, at: &Layout, src: View<'_>) -> Result<()> {
        let bytes = 2 * size(&src);
        self.timed(
            Elementwise,
            || "copy_into".into(),
            bytes,
            |b| b.copy_into(dst, at, src),
        )
    }
    fn softmax(&self, x: View<'_>, axis: usize, log: bool, out: &Layout) -> Result<Storage> {
        let bytes = size(&x) + out_size(out, x.dtype());
        self.timed(
            Reduction,
            || "softmax".into(),
            bytes,
            |b| b.softmax(x, axis, log, out),
        )
    }
    fn gather(&self, x: View<'_>, axis: usize, index: View<'_>) -> Result<Storage> {
        let bytes = size(&x) + size(&index);
        self.timed(
            Reduction,
            || "gather".into(),
            bytes,
            |b| b.gather(x, axis, index),
        )
    }
    fn scatter_add(
        &self,
        dst: &Storage,
        dst_shape: &[usize],
        axis: usize,
        index: View<'_>,
        src: View<'_>,
    ) -> Result<()> {
        let bytes = size(&index) + 2 * size(&src);
        let f = |b: &dyn Backend| b.scatter_add(dst, dst_shape, axis, index, src);
        self.timed(Reduction, || "scatter_add".into(), bytes, f)
    }
    fn conv2d(&self, x: View<'_>, w: View<'_>, p: &Conv2dParams, out: &Layout) -> Result<Storage> {
        let label = || conv_label("fwd", x.layout.shape(), w.layout.shape(), p);
        self.timed(Compute, label, 0, |b| b.conv2d(x, w, p, out))
    }
    fn conv2d_input_grad(
        &self,
        g: View<'_>,
        w: View<'_>,
        p: &Conv2dParams,
        out: &Layout,
    ) -> Result<Storage> {
        let label = || conv_label("dx", out.shape(), w.layout.shape(), p);
        self.timed(Compute, label, 0, |b| b.conv2d_input_grad(g, w, p, out))
    }
    fn conv2d_input_grad_accumulate(
        &self,
        g: View<'_>,
        w: View<'_>,
        p: &Conv2dParams,
        into: &Storage,
        out: &Layout,
    ) -> Result<bool> {
        // Declined: its time goes to the `dx` call that follows.
        let label = |added| {
            let pass = if added { "dx+=" } else { "dx" };
            conv_label(pass, out.shape(), w.layout.shape(), p)
        };
        let f = |b: &dyn Backend| b.conv2d_input_grad_accumulate(g, w, p, into, out);
        self.timed_when(Compute, label, 0, f, |added| matches!(added, Ok(true)))
    }
    fn conv2d_weight_grad(
        &self,
        x: View<'_>,
        g: View<'_>,
        p: &Conv2dParams,
        out: &Layout,
    ) -> Result<Storage> {
        let label = || conv_label("dw", x.layout.shape(), out.shape(), p);
        let f = |b: &dyn Backend| b.conv2d_weight_grad(x, g, p, out);
        self.timed(Compute, label, 0, f)
    }
    fn max_pool2d(
        &self,
        x: View<'_>,
        p: &Pool2dParams,
        out: &Layout,
    ) -> Result<(Storage, Storage)> {
        let bytes = size(&x) + 2 * out_size(out, x.dtype());
        self.timed(
            Reduction,
            || "max_pool2d".into(),
            bytes,
            |b| b.max_pool2d(x, p, out),
        )
    }
    fn max_pool2d_grad(
        &self,
        g: View<'_>,
        positions: View<'_>,
        p: &Pool2dParams,
        out: &Layout,
    ) -> Result<Storage> {
        let bytes = size(&g) + size(&positions) + out_size(out, g.dtype());
        let f = |b: &dyn Backend| b.max_pool2d_grad(g, positions, p, out);
        self.timed(Reduction, || "max_pool2d_grad".into(), bytes, f)
    }
    fn avg_pool2d(&self, x: View<'_>, p: &Pool2dParams, out: &Layout) -> Result<Storage> {
        let bytes = size(&x) + out_size(out, x.dtype());
        self.timed(
            Reduction,
            || "avg_pool2d".into(),
            bytes,
            |b| b.avg_pool2d(x, p, out),
        )
    }
    fn avg_pool2d_grad(&self, g: View<'_>, p: &Pool2dParams, out: &Layout) -> Result<Storage> {
        let bytes = size(&g) + out_size(out, g.dtype());
        self.timed(
            Reduction,
            || "avg_pool2d_grad".into(),
            bytes,
            |b| b.avg_pool2d_grad(g, p, out),
        )
    }
    fn random_uniform(&self, dtype: DType, len: usize, seed: u64, offset: u64) -> Result<Storage> {
        let bytes = (len * dtype.size()) as u64;
        let f = |b: &dyn Backend| b.random_uniform(dtype, len, seed, offset);
        self.timed(Elementwise, || "random_uniform".into(), bytes, f)
    }
    fn random_uniform_at(
        &self,
        dtype: DType,
        len: usize,
        seed: u64,
        offset: View<'_>,
    ) -> Result<Storage> {
        let bytes = (len * dtype.size()) as u64;
        let f = |b: &dyn Backend| b.random_uniform_at(dtype, len, seed, offset);
        self.timed(Elementwise, || "random_uniform".into(), bytes, f)
    }
    fn normalize_input(
        &self,
        x: View<'_>,
        mean: &[f64],
        std: &[f64],
        dtype: DType,
        out: &Layout,
    ) -> Result<Storage> {
        let bytes = size(&x) + out_size(out, dtype);
        let f = |b: &dyn Backend| b.normalize_input(x, mean, std, dtype, out);
        self.timed(Elementwise, || "normalize_input".into(), bytes, f)
    }
    fn batch_norm_stats(
        &self,
        x: View<'_>,
        y: Option<View<'_>>,
        gate: Option<View<'_>>,
        centre: Option<View<'_>>,
    ) -> Result<Storage> {
        let label = || format!("batch_norm_stats{}", operands(y.is_some(), gate.is_some()));
        let bytes = size(&x) + y.as_ref().map_or(0, size) + gate.as_ref().map_or(0, size);
        let bytes = bytes + centre.as_ref().map_or(0, size);
        self.timed(Reduction, label, bytes, |b| {
            b.batch_norm_stats(x, y, gate, centre)
        })
    }
    fn batch_norm_apply(
        &self,
        x: View<'_>,
        y: Option<View<'_>>,
        coef: View<'_>,
        relu: bool,
        gate: Option<View<'_>>,
        out: &Layout,
    ) -> Result<Storage> {
        let label = || {
            format!(
                "batch_norm_apply{}{}",
                operands(y.is_some(), gate.is_some()),
                if relu { " relu" } else { "" }
            )
        };
        let bytes = size(&x)
            + y.as_ref().map_or(0, size)
            + gate.as_ref().map_or(0, size)
            + out_size(out, x.dtype());
        let f = |b: &dyn Backend| b.batch_norm_apply(x, y, coef, relu, gate, out);
        self.timed(Elementwise, label, bytes, f)
    }
    fn batch_norm_coef(
        &self,
        sums: View<'_>,
        centre: Option<View<'_>>,
        weight: Option<View<'_>>,
        bias: Option<View<'_>>,
        running: Option<(&Storage, &Storage)>,
        p: &BatchNormCoefParams,
    ) -> Result<(Storage, Storage)> {
        let f = |b: &dyn Backend| b.batch_norm_coef(sums, centre, weight, bias, running, p);
        self.timed(Reduction, || "batch_norm_coef".into(), 0, f)
    }
    fn batch_norm_grad_coef(
        &self,
        sums: View<'_>,
        saved: View<'_>,
        weight: Option<View<'_>>,
        count: f64,
    ) -> Result<(Storage, Storage, Storage)> {
        let f = |b: &dyn Backend| b.batch_norm_grad_coef(sums, saved, weight, count);
        self.timed(Reduction, || "batch_norm_grad_coef".into(), 0, f)
    }
    fn batch_norm_stats_coef(
        &self,
        x: View<'_>,
        weight: Option<View<'_>>,
        bias: Option<View<'_>>,
        running: Option<(&Storage, &Storage)>,
        p: &BatchNormCoefParams,
    ) -> Result<(Storage, Storage)> {
        let f = |b: &dyn Backend| b.batch_norm_stats_coef(x, weight, bias, running, p);
        self.timed(Reduction, || "batch_norm_stats_coef".into(), size(&x), f)
    }
    fn batch_norm_grad_stats_coef(
        &self,
        x: View<'_>,
        g: View<'_>,
        gate: Option<View<'_>>,
        saved: View<'_>,
        weight: Option<View<'_>>,
        count: f64,
    ) -> Result<(Storage, Storage, Storage)> {
        let label = || {
            format!(
                "batch_norm_grad_stats_coef{}",
                operands(true, gate.is_some())
            )
        };
        let bytes = size(&x) + size(&g) + gate.as_ref().map_or(0, size);
        let f = |b: &dyn Backend| b.batch_norm_grad_stats_coef(x, g, gate, saved, weight, count);
        self.timed(Reduction, label, bytes, f)
    }
    fn cross_entropy(
        &self,
        logits: View<'_>,
        targets: View<'_>,
        smoothing: f64,
        ignore_index: i64,
        grad: bool,
    ) -> Result<(Storage, Option<Storage>)> {
        let f = |b: &dyn Backend| b.cross_entropy(logits, targets, smoothing, ignore_index, grad);
        let label = || format!("cross_entropy {:?}", logits.layout.shape());
        self.timed(Reduction, label, 0, f)
    }
    fn sgd(
        &self,
        params: &[&Storage],
        grads: &[&Storage],
        momentum: &[&Storage],
        step: &Storage,
        lr: &Storage,
        p: &SgdParams,
        found_inf: Option<&Storage>,
    ) -> Result<()> {
        let f = |b: &dyn Backend| b.sgd(params, grads, momentum, step, lr, p, found_inf);
        self.timed(Optimizer, || format!("sgd {p:?}"), 0, f)
    }
    fn adamw(
        &self,
        params: &[&Storage],
        grads: &[&Storage],
        exp_avg: &[&Storage],
        exp_avg_sq: &[&Storage],
        step: &Storage,
        lr: &Storage,
        p: &AdamWParams,
        found_inf: Option<&Storage>,
    ) -> Result<()> {
        let f =
            |b: &dyn Backend| b.adamw(params, grads, exp_avg, exp_avg_sq, step, lr, p, found_inf);
        self.timed(Optimizer, || format!("adamw {p:?}"), 0, f)
    }
    fn sum_squares(&self, tensors: &[&Storage]) -> Result<Storage> {
        self.timed(
            Optimizer,
            || "sum_squares".into(),
            0,
            |b| b.sum_squares(tensors),
        )
    }
    fn unscale_check(
        &self,
        grads: &[&Storage],
        inv_scale: &Storage,
        found_inf: &Storage,
    ) -> Result<()> {
        let f = |b: &dyn Backend| b.unscale_check(grads, inv_scale, found_inf);
        self.timed(Optimizer, || "unscale_check".into(), 0, f)
    }
    fn scaler_update(
        &self,
        scale: &Storage,
        growth_tracker: &Storage,
        found_inf: &Storage,
        p: &ScalerParams,
    ) -> Result<()> {
        let f = |b: &dyn Backend| b.scaler_update(scale, growth_tracker, found_inf, p);
        self.timed(Optimizer, || "scaler_update".into(), 0, f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use redline_tensor::Tensor;

    fn cpu() -> Device {
        Device::new(Arc::new(redline_cpu::CpuBackend::new()))
    }

    /// A few ops of known sizes on `device`, profiled: upload, add, relu, sum, then a blocking
    /// read of the sum.
    fn some_ops(device: &Device) -> f64 {
        let values: Vec<f32> = (0..1000).map(|i| i as f32 - 500.0).collect();
        let x = Tensor::from_slice(&values, &[10, 100], device).unwrap();
        let y = x.add(&x).unwrap().relu().unwrap();
        let _ = x.matmul(&x.transpose(0, 1).unwrap()).unwrap();
        y.sum(&[0, 1], false).unwrap().item().unwrap()
    }

    #[test]
    fn ops_are_counted_by_kind_with_the_bytes_they_move() {
        let (device, profile) = OpProfile::wrap(cpu(), false);
        assert_eq!(some_ops(&device), 2.0 * (1..500).sum::<i32>() as f64);
        let rows = profile.rows();
        // Without detail there is a row per kind, named after it — but a blocking call keeps
        // its name, which the doctor reports.
        let labels: Vec<&str> = rows.iter().map(|r| r.label.as_str()).collect();
        for row in &rows {
            let named = match row.kind {
                OpKind::Blocking => row.label == "download",
                kind => row.label == kind.name(),
            };
            assert!(named, "{labels:?}");
        }
        let p = StepProfile::new(&rows, 2, true, false, false);
        let kind = |k: OpKind| *p.kinds.iter().find(|r| r.0 == k).unwrap();
        // add (2 reads + a write) and relu (a read and a write) of 1000 f32; the sum reads once.
        assert_eq!(
            kind(OpKind::Elementwise).1,
            1.0,
            "two elementwise calls over two steps"
        );
        assert_eq!(kind(OpKind::Elementwise).3, (12_000.0 + 8_000.0) / 2.0);
        assert_eq!(kind(OpKind::Reduction).3, 4_000.0 / 2.0);
        assert_eq!(kind(OpKind::Compute).1, 0.5);
        assert_eq!(
            kind(OpKind::Compute).3,
            0.0,
            "compute moves no counted bytes"
        );
        assert_eq!(kind(OpKind::Transfer).1, 0.5, "one upload");
        // upload, add, relu, matmul, sum: 5 launches; the read is a blocking call.
        assert_eq!(p.launches, 2.5);
        assert_eq!(p.blocking.len(), 1);
        assert_eq!(
            (p.blocking[0].0.as_str(), p.blocking[0].1),
            ("download", 0.5)
        );
        assert_eq!(p.clock, "host timer (ops run synchronously)");
        assert_eq!(p.device_ms, Some(p.host_issue_ms));
        assert!(p.rows.is_empty(), "rows only in detail");
        let j = p.to_json();
        assert_eq!(j["by_kind"]["elementwise"]["bytes_per_step"], 10_000.0);
        assert_eq!(j["launches_per_step"], 2.5);
        // Reset forgets everything.
        profile.reset();
        assert!(profile.rows().is_empty());
    }

    #[test]
    fn detail_names_each_op_and_shape() {
        let (device, profile) = OpProfile::wrap(cpu(), true);
        some_ops(&device);
        let rows = profile.rows();
        let find = |l: &str| rows.iter().find(|r| r.label == l).unwrap();
        assert_eq!(find("matmul [10, 100]x[100, 10]").kind, OpKind::Compute);
        assert_eq!(find("add").bytes, 12_000);
        assert_eq!(find("download").kind, OpKind::Blocking);
        assert!(
            !profile.device_timed(),
            "the CPU backend has no device clock"
        );
        let p = StepProfile::new(&rows, 1, true, false, true);
        assert_eq!(
            p.rows.len(),
            5,
            "every op but the blocking read: {:?}",
            p.rows
        );
        assert_eq!(p.blocking[0].0, "download");
        assert_eq!(p.to_json()["rows"][0]["kind"], p.rows[0].1.name());
    }

    #[test]
    fn ops_on_a_device_with_a_clock_are_timed_on_it() {
        // The CUDA backend on its host emulator: its ops are CUDA kernels run by the emulator,
        // its timestamps events recorded behind them.
        let cuda = Device::new(Arc::new(redline_cuda::CudaBackend::emulated().unwrap()));
        let (device, profile) = OpProfile::wrap(cuda.clone(), true);
        some_ops(&device);
        assert!(profile.device_timed());
        let rows = profile.rows();
        let add = rows.iter().find(|r| r.label == "add").unwrap();
        assert!(add.device > Duration::ZERO, "{add:?}");
        let p = StepProfile::new(&rows, 1, false, true, true);
        assert_eq!(p.clock, "device timestamps");
        let device_ms = p.device_ms.unwrap();
        assert!(device_ms > 0.0);
        // Blocking calls get no device time: they are host waits.
        assert!(rows
            .iter()
            .filter(|r| r.kind == OpKind::Blocking)
            .all(|r| r.device.is_zero()));
        // More ops than one settle holds: every one still gets its device time.
        let x = Tensor::from_slice(&[1.0f32; 64], &[64], &device).unwrap();
        profile.reset();
        let mut y = x.clone();
        for _ in 0..SETTLE_OPS + 10 {
            y = y.add(&x).unwrap();
        }
        assert_eq!(y.to_vec::<f32>().unwrap()[0], (SETTLE_OPS + 11) as f32);
        let add = profile
            .rows()
            .into_iter()
            .find(|r| r.label == "add")
            .unwrap();
        assert_eq!(add.calls, (SETTLE_OPS + 10) as u64);
        assert!(add.device > Duration::ZERO);
        // A phase clock around more ops than the device's timestamp ring holds: the profile
        // takes and reads its timestamps with its own, so none is overwritten.
        profile.reset();
        let mut clock = crate::PhaseClock::start(&device).unwrap();
        let ops = TIMESTAMP_SLOTS as usize / 2 + 100;
        let mut y = x.clone();
        for _ in 0..ops {
            y = y.add(&x).unwrap();
        }
        clock.lap(crate::Phase::Forward).unwrap();
        let times = clock.finish().unwrap();
        assert!(times.device_clock);
        let add = profile
            .rows()
            .into_iter()
            .find(|r| r.label == "add")
            .unwrap();
        assert_eq!(add.calls, ops as u64);
        // The phase spans every add: at least their device time.
        assert!(
            times.get(crate::Phase::Forward) >= add.device,
            "{times:?} vs {add:?}"
        );
        // The stream bandwidth is measured on the device's clock too.
        assert!(stream_bandwidth(&cuda, 1 << 20).unwrap() > 0.0);
    }
}
