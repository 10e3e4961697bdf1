//! The CUDA backend: redline's ops as CUDA kernels (`kernels/*.cu`, one templated source per op
//! family), launched through the [`Gpu`] trait.
//!
//! Built to be checked in layers, because the machines that build it mostly have no GPU:
//! - it compiles everywhere (no CUDA toolkit at build time);
//! - every kernel runs on the host emulator ([`Emulator`]): the same `.cu` text compiled by the
//!   host C++ compiler with `kernels/emulate.h`, each CUDA thread a fiber with real barriers and
//!   warp exchanges, tested against the f64 reference (`tests/emulated.rs`);
//! - NVRTC compiles every kernel for every target architecture to CUBIN and reports registers,
//!   shared memory and spills ([`nvrtc`], `tests/nvrtc_compile.rs`).
//!
//! Every op of the declared matrix ([`matrix`]) runs on our kernels; on a GPU, matmul goes
//! through cuBLASLt ([`gemm`] plans it, [`cublaslt`] runs it) and the convolutions through cuDNN
//! ([`convolution`], [`cudnn`]) wherever the library loads and takes the layouts, with our
//! kernels as the fallback. The CUDA driver behind [`Gpu`] ([`driver::CudaDriver`]) is compiled
//! and its logic tested where it can be without a GPU; it has not yet run on one (the GPU check,
//! `redline-gpu-check`, is the proof still to be run).

pub mod algorithms;
pub mod compile;
pub mod convolution;
pub mod cublaslt;
pub mod cudnn;
pub mod driver;
pub mod emulator;
pub mod gemm;
pub mod gpu;
pub mod kernels;
pub mod libs;
pub mod matrix;
pub mod memory;
pub mod nccl;
pub mod nvrtc;
pub mod nvtx;
mod ops;
pub mod plans;
pub mod stream;

use std::fmt;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use redline_tensor::{
    batch_norm_stats_coef_composed, saved_mean, stats_dtype, with_batch_norm_sums, AdamWParams,
    Annotation, Backend, BinaryOp, Conv2dParams, DType, Download, DownloadOf, Event, Graph,
    HostBytes, Layout, Op, Pool2dParams, ReduceOp, Replay, Result, ScalerParams, SgdParams,
    Storage, TensorError, Timestamp, UnaryOp, View, TIMESTAMP_SLOTS,
};

pub use emulator::Emulator;
pub use gpu::{DevicePtr, Gpu, GpuEvent, KernelArgs, LaunchShape, Library, Strided};
pub use memory::{Buffer, MemoryPool};
pub use redline_tensor::MemoryStats;

use ops::elementwise::{self, Operand};

static NEXT_ID: AtomicUsize = AtomicUsize::new(1);

/// A captured graph on a [`Gpu`], keeping the memory its ops use from the cache while it lives.
struct CudaReplay {
    gpu: Arc<dyn Gpu>,
    captured: gpu::Captured,
    _memory: Option<memory::GraphMemory>,
}

impl Replay for CudaReplay {
    fn replay(&self) -> Result<()> {
        let _range = nvtx::range("graph replay");
        self.gpu.replay(&self.captured)
    }

    fn nodes(&self) -> usize {
        self.captured.nodes()
    }
}

/// The device memory behind `t` when a CUDA backend holds it (what a collective reads and
/// writes in place, and the way to its [`Gpu`]); `None` on other devices. The [`Backend`]
/// trait has no downcast: a storage knows its pool, and the pool its GPU.
pub fn cuda_buffer(t: &redline_tensor::Tensor) -> Option<&Buffer> {
    t.storage().downcast::<Buffer>(t.device().backend().id())
}

/// The CUDA backend over one [`Gpu`].
pub struct CudaBackend {
    gpu: Arc<dyn Gpu>,
    memory: Arc<MemoryPool>,
    transfers: Counters,
    /// The next timestamp slot (modulo TIMESTAMP_SLOTS).
    next_timestamp: std::sync::atomic::AtomicU32,
    id: usize,
}

/// Host↔device traffic so far: a steady-state training step should show one upload (the
/// batch), one download (the loss) and no synchronisation — anything more is a silent host
/// round trip.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TransferStats {
    pub uploads: u64,
    /// Uploads from a host-memory pool's buffer (pinned where the GPU supplies the pool: an
    /// asynchronous copy), rather than from a vector the copy must stage first.
    pub pooled_uploads: u64,
    pub downloads: u64,
    pub synchronizations: u64,
}

#[derive(Debug, Default)]
struct Counters {
    uploads: AtomicU64,
    pooled_uploads: AtomicU64,
    downloads: AtomicU64,
    synchronizations: AtomicU64,
}

impl Counters {
    fn upload(&self, bytes: &HostBytes) {
        self.uploads.fetch_add(1, Ordering::Relaxed);
        if let HostBytes::Pooled(..) = bytes {
            self.pooled_uploads.fetch_add(1, Ordering::Relaxed);
        }
    }
}

impl fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CudaBackend({})", self.gpu.name())
    }
}

impl CudaBackend {
    /// The backend on `gpu`.
    pub fn new(gpu: Arc<dyn Gpu>) -> Self {
        Self::with_memory_cap(gpu, None)
    }

    /// The backend on `gpu` with at most `cap` bytes reserved by its caching allocator (an
    /// allocation past it is an out-of-memory error that prints the allocator's statistics).
    pub fn with_memory_cap(gpu: Arc<dyn Gpu>, cap: Option<usize>) -> Self {
        Self {
            memory: Arc::new(MemoryPool::new(gpu.clone(), cap)),
            transfers: Counters::default(),
            next_timestamp: Default::default(),
            gpu,
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed) | (3 << 48),
        }
    }

    /// The caching allocator's statistics.
    pub fn memory_stats(&self) -> MemoryStats {
        self.memory.stats()
    }

    /// Uploads, downloads and synchronisations so far.
    pub fn transfer_stats(&self) -> TransferStats {
        let t = &self.transfers;
        TransferStats {
            uploads: t.uploads.load(Ordering::Relaxed),
            pooled_uploads: t.pooled_uploads.load(Ordering::Relaxed),
            downloads: t.downloads.load(Ordering::Relaxed),
            synchronizations: t.synchronizations.load(Ordering::Relaxed),
        }
    }

    /// Returns every cached block to the device (memory in use stays).
    pub fn empty_cache(&self) {
        self.memory.empty_cache()
    }

    /// The backend on CUDA device `ordinal`, or why there is none (never a panic). The
    /// caching allocator's cap comes from `REDLINE_CUDA_MEMORY_CAP` (bytes, or with a KiB, MiB
    /// or GiB suffix) when set; a value that is not a size is an error naming it.
    pub fn device(ordinal: usize) -> Result<Self, driver::Unavailable> {
        let cap = match std::env::var("REDLINE_CUDA_MEMORY_CAP") {
            Ok(text) => Some(parse_size(&text).ok_or_else(|| {
                driver::Unavailable::Failed(format!(
                    "REDLINE_CUDA_MEMORY_CAP={text:?} is not a size (e.g. 8GiB, 512MiB, 1000000)"
                ))
            })?),
            Err(_) => None,
        };
        let gpu = Arc::new(driver::CudaDriver::new(ordinal)?);
        Ok(Self::with_memory_cap(gpu, cap))
    }

    /// The backend on the host emulator (builds the kernels for the host on first use).
    pub fn emulated() -> Result<Self> {
        Ok(Self::new(Arc::new(Emulator::new()?)))
    }

    pub fn gpu(&self) -> &Arc<dyn Gpu> {
        &self.gpu
    }

    /// The caching allocator (statistics, graph-owned memory).
    pub fn memory(&self) -> &Arc<MemoryPool> {
        &self.memory
    }

    fn buffer<'a>(&self, s: &'a Storage) -> Result<&'a Buffer> {
        s.downcast::<Buffer>(self.id).ok_or_else(|| {
            TensorError::Device(format!(
                "a storage from another device was given to {}",
                self.name()
            ))
        })
    }

    /// A new storage of `len` elements of `dtype` (contents undefined until written).
    fn alloc(&self, dtype: DType, len: usize) -> Result<Storage> {
        let buffer = Buffer::new(&self.memory, len * dtype.size())?;
        Ok(Storage::new(dtype, len, self.id, buffer))
    }

    /// `x` copied into a fresh storage laid out as `wider` (more channels), zeros beyond its own.
    fn padded(&self, x: &ops::elementwise::Operand<'_>, wider: &Layout) -> Result<Storage> {
        let storage = self.alloc_for(x.dtype, wider)?;
        ops::conv::copy_channels(&*self.gpu, x, &self.output(&storage, wider)?)?;
        Ok(storage)
    }

    /// Batch norm's forward coefficients and saved statistics (of stats dtype `sd`, `c`
    /// channels) from `sums`.
    #[allow(clippy::too_many_arguments)]
    fn coef_from(
        &self,
        sd: DType,
        c: usize,
        sums: ops::norm::Sums,
        centre: Option<DevicePtr>,
        weight: Option<View<'_>>,
        bias: Option<View<'_>>,
        running: Option<(&Storage, &Storage)>,
        p: &redline_tensor::BatchNormCoefParams,
    ) -> Result<(Storage, Storage)> {
        let (coef, saved) = (self.alloc(sd, 3 * c)?, self.alloc(sd, 2 * c)?);
        let start = |v: Option<View<'_>>| v.map(|v| self.start(v)).transpose();
        let running = running
            .map(|(m, v)| Ok::<_, TensorError>((self.buffer(m)?.ptr, self.buffer(v)?.ptr)))
            .transpose()?;
        let out = (self.buffer(&coef)?.ptr, self.buffer(&saved)?.ptr);
        let (w, b) = (start(weight)?, start(bias)?);
        ops::norm::coef(&*self.gpu, sd, c, sums, centre, w, b, running, out, p)?;
        Ok((coef, saved))
    }

    /// Batch norm's backward coefficients, `dw` and `db` (of stats dtype `sd`, `c` channels)
    /// from `sums` and the forward's `saved`.
    fn grad_coef_from(
        &self,
        sd: DType,
        c: usize,
        sums: ops::norm::Sums,
        saved: View<'_>,
        weight: Option<View<'_>>,
        count: f64,
    ) -> Result<(Storage, Storage, Storage)> {
        let coef = self.alloc(sd, 3 * c)?;
        let (dw, db) = (self.alloc(sd, c)?, self.alloc(sd, c)?);
        let w = weight.map(|w| self.start(w)).transpose()?;
        let ptr = |s: &Storage| self.buffer(s).map(|b| b.ptr);
        let out = (ptr(&coef)?, ptr(&dw)?, ptr(&db)?);
        let kept = self.start(saved)?;
        ops::norm::grad_coef(&*self.gpu, sd, c, sums, kept, w, out, count)?;
        Ok((coef, dw, db))
    }

    /// A storage for an op's output written in layout `out`.
    fn alloc_for(&self, dtype: DType, out: &Layout) -> Result<Storage> {
        self.alloc(dtype, out.storage_extent().max(out.numel()))
    }

    fn operand<'a>(&self, v: View<'a>) -> Result<Operand<'a>> {
        Ok(Operand {
            ptr: self.buffer(v.storage)?.ptr,
            dtype: v.dtype(),
            layout: v.layout,
        })
    }

    /// Where a contiguous view's first element is (coefficients, gates: small dense operands).
    fn start(&self, v: View<'_>) -> Result<DevicePtr> {
        let buffer = self.buffer(v.storage)?;
        Ok(buffer.ptr.offset(v.layout.offset() * v.dtype().size()))
    }

    fn output<'a>(&self, s: &Storage, layout: &'a Layout) -> Result<Operand<'a>> {
        Ok(Operand {
            ptr: self.buffer(s)?.ptr,
            dtype: s.dtype(),
            layout,
        })
    }

    /// Where a view's elements can be copied back from in row-major order: its own storage when
    /// it is contiguous, else a temporary it is gathered into on the device (one copy back, not
    /// one per run). The temporary is returned to keep it alive until the copy is enqueued; it
    /// is then freed in stream order, after the copy.
    fn row_major(&self, x: View<'_>) -> Result<(DevicePtr, Option<Storage>)> {
        if x.layout.is_contiguous() {
            let buffer = self.buffer(x.storage)?;
            return Ok((
                buffer.ptr.offset(x.layout.offset() * x.dtype().size()),
                None,
            ));
        }
        let dense = Layout::contiguous(x.layout.shape());
        let gathered = self.convert(x, x.dtype(), &dense)?;
        Ok((self.buffer(&gathered)?.ptr, Some(gathered)))
    }

    /// This device's event behind `event`; `None` for one already reached. An event of another
    /// device is refused by name.
    fn event<'e>(&self, event: &'e Event) -> Result<Option<&'e GpuEvent>> {
        if event.is_reached() {
            return Ok(None);
        }
        event
            .downcast::<GpuEvent>(self.id)
            .map(Some)
            .ok_or_else(|| TensorError::Backend {
                device: self.name(),
                what: "an event recorded on another device".into(),
            })
    }

    /// The multi-tensor ops' slots: tensor i's storages from each list (param, grad, states).
    fn slots(&self, lists: &[&[&Storage]]) -> Result<Vec<ops::optim::Slot>> {
        let count = lists.first().map_or(0, |l| l.len());
        (0..count)
            .map(|i| {
                let mut ptrs = [DevicePtr(0); 4];
                for (k, list) in lists.iter().enumerate() {
                    let storage = list.get(i).ok_or_else(|| {
                        TensorError::Shape(format!(
                            "an optimizer op got {count} parameters but {} of a state",
                            list.len()
                        ))
                    })?;
                    ptrs[k] = self.buffer(storage)?.ptr;
                }
                Ok(ops::optim::Slot {
                    ptrs,
                    len: lists[0][i].len(),
                })
            })
            .collect()
    }

    /// A one-element storage for the optimizer kernels.
    fn scalar(&self, s: &Storage) -> Result<ops::optim::Scalar> {
        Ok(ops::optim::Scalar {
            ptr: self.buffer(s)?.ptr,
            dtype: s.dtype(),
        })
    }

    fn step_scalars(&self, step: &Storage, lr: &Storage) -> Result<ops::optim::StepScalars> {
        Ok(ops::optim::StepScalars {
            step: self.scalar(step)?,
            lr: self.scalar(lr)?,
        })
    }
}

/// "8GiB", "512 MiB", "64KiB" or plain bytes.
fn parse_size(text: &str) -> Option<usize> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let scale: usize = match unit.trim() {
        "" | "B" => 1,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        _ => return None,
    };
    number.parse::<usize>().ok()?.checked_mul(scale)
}

impl Backend for CudaBackend {
    fn name(&self) -> String {
        self.gpu.name()
    }

    fn id(&self) -> usize {
        self.id
    }

    fn supports(&self, op: Op, dtype: DType) -> bool {
        matrix::supports(op, dtype)
    }

    fn fill(&self, dtype: DType, len: usize, value: f64) -> Result<Storage> {
        let _range = nvtx::range("fill");
        let out = self.alloc(dtype, len)?;
        elementwise::fill(&*self.gpu, dtype, self.buffer(&out)?.ptr, len, value)?;
        Ok(out)
    }

    fn upload(&self, dtype: DType, bytes: HostBytes) -> Result<Storage> {
        let _range = nvtx::range("upload");
        let len = bytes.len() / dtype.size();
        if bytes.len() != len * dtype.size() {
            return Err(TensorError::Shape(format!(
                "an upload of {} bytes is not a whole number of {dtype} elements",
                bytes.len()
            )));
        }
        let out = self.alloc(dtype, len)?;
        self.transfers.upload(&bytes);
        self.gpu.upload_owned(self.buffer(&out)?.ptr, bytes)?;
        Ok(out)
    }

    fn upload_into(&self, dst: &Storage, bytes: HostBytes) -> Result<()> {
        let _range = nvtx::range("upload_into");
        redline_tensor::backend::check_upload_into(self.name(), dst, &bytes)?;
        if bytes.is_empty() {
            return Ok(());
        }
        self.transfers.upload(&bytes);
        // Into the same allocation, on the stream: ordered after the ops that read the old
        // values, and `bytes` is kept until the copy is done (as `upload`).
        self.gpu.upload_owned(self.buffer(dst)?.ptr, bytes)
    }

    fn download(&self, x: View<'_>) -> Result<Vec<u8>> {
        let _range = nvtx::range("download");
        let mut bytes = vec![0u8; x.layout.numel() * x.dtype().size()];
        if bytes.is_empty() {
            return Ok(bytes);
        }
        self.transfers.downloads.fetch_add(1, Ordering::Relaxed);
        let (at, _gathered) = self.row_major(x)?;
        self.gpu.download(at, &mut bytes)?;
        Ok(bytes)
    }

    fn download_async(&self, x: View<'_>) -> Result<Download> {
        let _range = nvtx::range("download_async");
        let len = x.layout.numel() * x.dtype().size();
        if len == 0 {
            return Ok(Download::ready(Vec::new()));
        }
        self.transfers.downloads.fetch_add(1, Ordering::Relaxed);
        let (at, _gathered) = self.row_major(x)?;
        self.gpu.download_async(at, len)
    }

    fn begin_capture(&self) -> Result<()> {
        self.memory.begin_capture()?;
        self.gpu.begin_capture().inspect_err(|_| {
            self.memory.end_capture();
        })
    }

    fn end_capture(&self) -> Result<Graph> {
        let captured = self.gpu.end_capture();
        let memory = self.memory.end_capture();
        Ok(Graph::new(CudaReplay {
            gpu: self.gpu.clone(),
            captured: captured?,
            _memory: memory,
        }))
    }

    fn record_event(&self) -> Result<Event> {
        Ok(match self.gpu.record_event()? {
            Some(event) => Event::new(self.id, event),
            None => Event::reached(),
        })
    }

    fn wait_event(&self, event: &Event) -> Result<()> {
        match self.event(event)? {
            Some(e) => self.gpu.wait_event(e),
            None => Ok(()),
        }
    }

    fn upload_into_after(&self, dst: &Storage, bytes: HostBytes, after: &Event) -> Result<Event> {
        let _range = nvtx::range("upload_into_after");
        let Some(after) = self.event(after)? else {
            self.upload_into(dst, bytes)?;
            return self.record_event();
        };
        redline_tensor::backend::check_upload_into(self.name(), dst, &bytes)?;
        if bytes.is_empty() {
            return Ok(Event::reached());
        }
        self.transfers.upload(&bytes);
        let done = self
            .gpu
            .upload_owned_after(self.buffer(dst)?.ptr, bytes, after)?;
        Ok(match done {
            Some(event) => Event::new(self.id, event),
            None => Event::reached(),
        })
    }

    fn download_after<'a>(&self, x: View<'a>, after: &Event) -> Result<DownloadOf<'a>> {
        let _range = nvtx::range("download_after");
        let (Some(event), true) = (self.event(after)?, x.layout.is_contiguous()) else {
            // A gather runs on the compute stream anyway: download behind it.
            return Ok(DownloadOf::new(x, self.download_async(x)?));
        };
        let len = x.layout.numel() * x.dtype().size();
        if len == 0 {
            return Ok(DownloadOf::new(x, Download::ready(Vec::new())));
        }
        self.transfers.downloads.fetch_add(1, Ordering::Relaxed);
        let (at, _) = self.row_major(x)?;
        Ok(DownloadOf::new(x, self.gpu.download_after(at, len, event)?))
    }

    fn timestamp(&self) -> Result<Option<Timestamp>> {
        let slot = self.next_timestamp.fetch_add(1, Ordering::Relaxed) % TIMESTAMP_SLOTS;
        Ok(self
            .gpu
            .record_clock(slot as usize)?
            .then_some(Timestamp(slot)))
    }

    fn read_timestamps(&self, stamps: &[Timestamp]) -> Result<Vec<u64>> {
        let slots: Vec<usize> = stamps.iter().map(|s| s.0 as usize).collect();
        self.gpu.read_clock(&slots)
    }

    fn annotate(&self, name: &str) -> Annotation {
        nvtx::range(name)
    }

    fn host_allocator(&self) -> Option<Arc<dyn redline_hostmem::HostAllocator>> {
        self.gpu.host_allocator()
    }

    fn memory_stats(&self) -> Option<MemoryStats> {
        Some(self.memory.stats())
    }

    fn synchronize(&self) -> Result<()> {
        let _range = nvtx::range("synchronize");
        self.transfers
            .synchronizations
            .fetch_add(1, Ordering::Relaxed);
        self.gpu.synchronize()
    }

    fn unary(&self, op: UnaryOp, x: View<'_>, out: &Layout) -> Result<Storage> {
        let _range = nvtx::range(op.name());
        let y = self.alloc_for(x.dtype(), out)?;
        elementwise::unary(&*self.gpu, op, &self.operand(x)?, &self.output(&y, out)?)?;
        Ok(y)
    }

    fn binary(&self, op: BinaryOp, a: View<'_>, b: View<'_>, out: &Layout) -> Result<Storage> {
        let _range = nvtx::range(op.name());
        let dtype = if op.is_comparison() {
            DType::U8
        } else {
            a.dtype()
        };
        let y = self.alloc_for(dtype, out)?;
        let (a, b) = (self.operand(a)?, self.operand(b)?);
        elementwise::binary(&*self.gpu, op, &a, &b, &self.output(&y, out)?)?;
        Ok(y)
    }

    fn reduce(&self, op: ReduceOp, x: View<'_>, axes: &[usize]) -> Result<Storage> {
        let _range = nvtx::range(op.name());
        let mut shape = x.layout.shape().to_vec();
        for &a in axes {
            shape[a] = 1;
        }
        let dtype = if op == ReduceOp::ArgMax {
            DType::I64
        } else {
            x.dtype()
        };
        let y = self.alloc(dtype, shape.iter().product())?;
        let (xp, yp) = (self.buffer(x.storage)?.ptr, self.buffer(&y)?.ptr);
        ops::reduce::reduce(&*self.gpu, op, xp, x.dtype(), x.layout, axes, yp)?;
        Ok(y)
    }

    fn matmul(&self, a: View<'_>, b: View<'_>) -> Result<Storage> {
        let _range = nvtx::range("matmul");
        let (sa, sb) = (a.layout.shape(), b.layout.shape());
        let mut shape = sa.to_vec();
        if let Some(last) = shape.last_mut() {
            *last = sb[sb.len() - 1];
        }
        let y = self.alloc(a.dtype(), shape.iter().product())?;
        let (ao, bo) = (self.operand(a)?, self.operand(b)?);
        ops::matmul::matmul(&*self.gpu, &ao, &bo, self.buffer(&y)?.ptr)?;
        Ok(y)
    }

    fn select(&self, cond: View<'_>, a: View<'_>, b: View<'_>, out: &Layout) -> Result<Storage> {
        let _range = nvtx::range("select");
        let y = self.alloc_for(a.dtype(), out)?;
        let (c, a, b) = (self.operand(cond)?, self.operand(a)?, self.operand(b)?);
        elementwise::select(&*self.gpu, &c, &a, &b, &self.output(&y, out)?)?;
        Ok(y)
    }

    fn convert(&self, x: View<'_>, dtype: DType, out: &Layout) -> Result<Storage> {
        let _range = nvtx::range("convert");
        let y = self.alloc_for(dtype, out)?;
        elementwise::convert(&*self.gpu, &self.operand(x)?, &self.output(&y, out)?)?;
        Ok(y)
    }

    fn copy_into(&self, dst: &Storage, at: &Layout, src: View<'_>) -> Result<()> {
        let _range = nvtx::range("copy_into");
        elementwise::convert(&*self.gpu, &self.operand(src)?, &self.output(dst, at)?)
    }

    fn softmax(&self, x: View<'_>, axis: usize, log: bool, out: &Layout) -> Result<Storage> {
        let _range = nvtx::range("softmax");
        let y = self.alloc_for(x.dtype(), out)?;
        ops::nn::softmax(
            &*self.gpu,
            &self.operand(x)?,
            axis,
            log,
            &self.output(&y, out)?,
        )?;
        Ok(y)
    }

    fn cross_entropy(
        &self,
        logits: View<'_>,
        targets: View<'_>,
        smoothing: f64,
        ignore_index: i64,
        grad: bool,
    ) -> Result<(Storage, Option<Storage>)> {
        let _range = nvtx::range("cross_entropy");
        let (dtype, n) = (logits.dtype(), logits.layout.shape()[0]);
        let rows = self.alloc(stats_dtype(dtype), n.max(1))?;
        let grad = grad
            .then(|| self.alloc(dtype, logits.layout.numel()))
            .transpose()?;
        let loss = self.alloc(dtype, 1)?;
        let grad_ptr = grad
            .as_ref()
            .map(|g| self.buffer(g).map(|b| b.ptr))
            .transpose()?;
        ops::nn::cross_entropy(
            &*self.gpu,
            &self.operand(logits)?,
            self.start(targets)?,
            smoothing,
            ignore_index,
            self.buffer(&rows)?.ptr,
            grad_ptr,
            self.buffer(&loss)?.ptr,
        )?;
        Ok((loss, grad))
    }

    fn gather(&self, x: View<'_>, axis: usize, index: View<'_>) -> Result<Storage> {
        let _range = nvtx::range("gather");
        let y = self.alloc(x.dtype(), index.layout.numel())?;
        let (xo, io) = (self.operand(x)?, self.operand(index)?);
        ops::nn::gather(&*self.gpu, &xo, axis, &io, self.buffer(&y)?.ptr)?;
        Ok(y)
    }

    fn scatter_add(
        &self,
        dst: &Storage,
        dst_shape: &[usize],
        axis: usize,
        index: View<'_>,
        src: View<'_>,
    ) -> Result<()> {
        let _range = nvtx::range("scatter_add");
        let (io, so) = (self.operand(index)?, self.operand(src)?);
        let ptr = self.buffer(dst)?.ptr;
        ops::nn::scatter_add(&*self.gpu, ptr, dst.dtype(), dst_shape, axis, &io, &so)
    }

    fn conv2d(&self, x: View<'_>, w: View<'_>, p: &Conv2dParams, out: &Layout) -> Result<Storage> {
        let _range = nvtx::range("conv2d");
        let y = self.alloc_for(x.dtype(), out)?;
        let (xo, wo, yo) = (self.operand(x)?, self.operand(w)?, self.output(&y, out)?);
        let gpu = &*self.gpu;
        match ops::conv::ChannelPad::new(gpu, x.dtype(), x.layout, w.layout, p) {
            Some(pad) => {
                let (xp, wp) = (
                    self.padded(&xo, &pad.input)?,
                    self.padded(&wo, &pad.weight)?,
                );
                let (xpo, wpo) = (
                    self.output(&xp, &pad.input)?,
                    self.output(&wp, &pad.weight)?,
                );
                ops::conv::conv2d(gpu, &xpo, &wpo, p, &yo)?;
            }
            None => ops::conv::conv2d(gpu, &xo, &wo, p, &yo)?,
        }
        Ok(y)
    }

    fn conv2d_input_grad(
        &self,
        g: View<'_>,
        w: View<'_>,
        p: &Conv2dParams,
        out: &Layout,
    ) -> Result<Storage> {
        let _range = nvtx::range("conv2d_input_grad");
        let y = self.alloc_for(g.dtype(), out)?;
        let (go, wo, yo) = (self.operand(g)?, self.operand(w)?, self.output(&y, out)?);
        ops::conv::input_grad(&*self.gpu, &go, &wo, p, &yo)?;
        Ok(y)
    }

    /// Through cuDNN with β = 1 where it serves the plan; else declined (the caller adds).
    fn conv2d_input_grad_accumulate(
        &self,
        g: View<'_>,
        w: View<'_>,
        p: &Conv2dParams,
        into: &Storage,
        out: &Layout,
    ) -> Result<bool> {
        let _range = nvtx::range("conv2d_input_grad_accumulate");
        redline_tensor::backend::check_accumulate_into(self.name(), into, g.dtype(), out)?;
        let (go, wo, yo) = (self.operand(g)?, self.operand(w)?, self.output(into, out)?);
        ops::conv::input_grad_accumulate(&*self.gpu, &go, &wo, p, &yo)
    }

    fn conv2d_weight_grad(
        &self,
        x: View<'_>,
        g: View<'_>,
        p: &Conv2dParams,
        out: &Layout,
    ) -> Result<Storage> {
        let _range = nvtx::range("conv2d_weight_grad");
        let y = self.alloc_for(x.dtype(), out)?;
        let (xo, go, yo) = (self.operand(x)?, self.operand(g)?, self.output(&y, out)?);
        let gpu = &*self.gpu;
        let Some(pad) = ops::conv::ChannelPad::new(gpu, x.dtype(), x.layout, out, p) else {
            ops::conv::weight_grad(gpu, &xo, &go, p, &yo)?;
            return Ok(y);
        };
        // The gradient of the padded weight (in the weight's order), then its first 3 channels.
        let xp = self.padded(&xo, &pad.input)?;
        let wide = self.alloc_for(x.dtype(), &pad.weight)?;
        let (xpo, wide_out) = (
            self.output(&xp, &pad.input)?,
            self.output(&wide, &pad.weight)?,
        );
        ops::conv::weight_grad(gpu, &xpo, &go, p, &wide_out)?;
        ops::conv::copy_channels(gpu, &wide_out, &yo)?;
        Ok(y)
    }

    fn max_pool2d(
        &self,
        x: View<'_>,
        p: &Pool2dParams,
        out: &Layout,
    ) -> Result<(Storage, Storage)> {
        let _range = nvtx::range("max_pool2d");
        let y = self.alloc_for(x.dtype(), out)?;
        let positions = self.alloc_for(DType::I64, out)?;
        let (xo, yo) = (self.operand(x)?, self.output(&y, out)?);
        ops::pool::max_pool2d(&*self.gpu, &xo, p, &yo, self.buffer(&positions)?.ptr)?;
        Ok((y, positions))
    }

    fn max_pool2d_grad(
        &self,
        g: View<'_>,
        positions: View<'_>,
        p: &Pool2dParams,
        out: &Layout,
    ) -> Result<Storage> {
        let _range = nvtx::range("max_pool2d_grad");
        let y = self.alloc_for(g.dtype(), out)?;
        let (go, po, yo) = (
            self.operand(g)?,
            self.operand(positions)?,
            self.output(&y, out)?,
        );
        ops::pool::pool_grad(&*self.gpu, g.dtype(), &go, Some(&po), p, &yo)?;
        Ok(y)
    }

    fn avg_pool2d(&self, x: View<'_>, p: &Pool2dParams, out: &Layout) -> Result<Storage> {
        let _range = nvtx::range("avg_pool2d");
        let y = self.alloc_for(x.dtype(), out)?;
        ops::pool::avg_pool2d(&*self.gpu, &self.operand(x)?, p, &self.output(&y, out)?)?;
        Ok(y)
    }

    fn avg_pool2d_grad(&self, g: View<'_>, p: &Pool2dParams, out: &Layout) -> Result<Storage> {
        let _range = nvtx::range("avg_pool2d_grad");
        let y = self.alloc_for(g.dtype(), out)?;
        let (go, yo) = (self.operand(g)?, self.output(&y, out)?);
        ops::pool::pool_grad(&*self.gpu, g.dtype(), &go, None, p, &yo)?;
        Ok(y)
    }

    fn random_uniform(&self, dtype: DType, len: usize, seed: u64, offset: u64) -> Result<Storage> {
        let _range = nvtx::range("random_uniform");
        let y = self.alloc(dtype, len)?;
        let out = self.buffer(&y)?.ptr;
        ops::nn::random_uniform(&*self.gpu, dtype, out, len, seed, offset, None)?;
        Ok(y)
    }

    fn random_uniform_at(
        &self,
        dtype: DType,
        len: usize,
        seed: u64,
        offset: View<'_>,
    ) -> Result<Storage> {
        let _range = nvtx::range("random_uniform");
        if offset.dtype() != DType::I64 || offset.layout.numel() != 1 {
            return Err(TensorError::Shape(format!(
                "random_uniform_at: the offset must be one i64, got {} {:?}",
                offset.dtype(),
                offset.layout.shape()
            )));
        }
        let y = self.alloc(dtype, len)?;
        let (out, at) = (self.buffer(&y)?.ptr, self.start(offset)?);
        ops::nn::random_uniform(&*self.gpu, dtype, out, len, seed, 0, Some(at))?;
        ops::nn::advance(&*self.gpu, at, len)?;
        Ok(y)
    }

    fn normalize_input(
        &self,
        x: View<'_>,
        mean: &[f64],
        std: &[f64],
        dtype: DType,
        out: &Layout,
    ) -> Result<Storage> {
        let _range = nvtx::range("normalize_input");
        let y = self.alloc_for(dtype, out)?;
        let (xo, yo) = (self.operand(x)?, self.output(&y, out)?);
        ops::nn::normalize_input(&*self.gpu, &xo, mean, std, &yo)?;
        Ok(y)
    }

    fn batch_norm_stats(
        &self,
        x: View<'_>,
        y: Option<View<'_>>,
        gate: Option<View<'_>>,
        centre: Option<View<'_>>,
    ) -> Result<Storage> {
        let _range = nvtx::range("batch_norm_stats");
        let c = x.layout.shape()[1];
        let out = self.alloc(stats_dtype(x.dtype()), 2 * c)?;
        let yo = y.map(|v| self.operand(v)).transpose()?;
        let gate = gate.map(|g| self.start(g)).transpose()?;
        let centre = centre.map(|k| self.start(k)).transpose()?;
        let ptr = self.buffer(&out)?.ptr;
        let xo = self.operand(x)?;
        // A channels-last x's plan and scratch for its partial sums (freed in stream order).
        let plan = match &yo {
            Some(y) => ops::norm::RowsPlan::new(&xo, &[y]),
            None => ops::norm::RowsPlan::new(&xo, &[]),
        };
        let partials = plan
            .map(|p| self.alloc(stats_dtype(x.dtype()), p.partials()))
            .transpose()?;
        let rows = match (plan, &partials) {
            (Some(plan), Some(scratch)) => Some((plan, self.buffer(scratch)?.ptr)),
            _ => None,
        };
        ops::norm::stats(&*self.gpu, &xo, yo.as_ref(), gate, centre, ptr, rows)?;
        Ok(out)
    }

    fn batch_norm_coef(
        &self,
        sums: View<'_>,
        centre: Option<View<'_>>,
        weight: Option<View<'_>>,
        bias: Option<View<'_>>,
        running: Option<(&Storage, &Storage)>,
        p: &redline_tensor::BatchNormCoefParams,
    ) -> Result<(Storage, Storage)> {
        let _range = nvtx::range("batch_norm_coef");
        let (sd, c) = (sums.dtype(), sums.layout.shape()[1]);
        let sums = ops::norm::Sums::Whole(self.start(sums)?);
        let centre = centre.map(|k| self.start(k)).transpose()?;
        self.coef_from(sd, c, sums, centre, weight, bias, running, p)
    }

    fn batch_norm_stats_coef(
        &self,
        x: View<'_>,
        weight: Option<View<'_>>,
        bias: Option<View<'_>>,
        running: Option<(&Storage, &Storage)>,
        p: &redline_tensor::BatchNormCoefParams,
    ) -> Result<(Storage, Storage)> {
        let _range = nvtx::range("batch_norm_stats_coef");
        let (sd, c) = (stats_dtype(x.dtype()), x.layout.shape()[1]);
        let xo = self.operand(x)?;
        let plan = ops::norm::RowsPlan::new(&xo, &[]).filter(|_| x.layout.numel() > 0);
        let Some(plan) = plan else {
            // Summed a block per channel straight into [2, C]: nothing to fuse.
            return batch_norm_stats_coef_composed(self, x, weight, bias, running, p);
        };
        // The channels-last partials, added up by the coefficients' launch: no sums written.
        // The rows kernel centres them on x's first row and writes those C centres after the
        // partials, for the coefficients.
        let partials = self.alloc(sd, plan.partials() + c)?;
        let at = self.buffer(&partials)?.ptr;
        let first = at.offset(plan.partials() * sd.size());
        let centre = ops::norm::Centre::FirstRow(first);
        ops::norm::partial_stats(&*self.gpu, &plan, &xo, None, None, centre, at)?;
        let sums = ops::norm::Sums::Partials(at, plan.chunks);
        self.coef_from(sd, c, sums, Some(first), weight, bias, running, p)
    }

    fn batch_norm_grad_coef(
        &self,
        sums: View<'_>,
        saved: View<'_>,
        weight: Option<View<'_>>,
        count: f64,
    ) -> Result<(Storage, Storage, Storage)> {
        let _range = nvtx::range("batch_norm_grad_coef");
        let (sd, c) = (sums.dtype(), sums.layout.shape()[1]);
        let sums = ops::norm::Sums::Whole(self.start(sums)?);
        self.grad_coef_from(sd, c, sums, saved, weight, count)
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
        let _range = nvtx::range("batch_norm_grad_stats_coef");
        let (sd, c) = (stats_dtype(x.dtype()), x.layout.shape()[1]);
        let (xo, go) = (self.operand(x)?, self.operand(g)?);
        // The sums are centred on the forward's mean: saved's first row.
        let mean_layout = saved_mean(saved.layout);
        let mean = View {
            storage: saved.storage,
            layout: &mean_layout,
        };
        let Some(plan) = ops::norm::RowsPlan::new(&xo, &[&go]) else {
            // Summed a block per channel straight into [2, C]: nothing to fuse.
            return with_batch_norm_sums(self, x, Some(g), gate, Some(mean), |sums| {
                self.batch_norm_grad_coef(sums, saved, weight, count)
            });
        };
        let gate = gate.map(|g| self.start(g)).transpose()?;
        let centre = ops::norm::Centre::Given(self.start(mean)?);
        let partials = self.alloc(sd, plan.partials())?;
        let at = self.buffer(&partials)?.ptr;
        ops::norm::partial_stats(&*self.gpu, &plan, &xo, Some(&go), gate, centre, at)?;
        let sums = ops::norm::Sums::Partials(at, plan.chunks);
        self.grad_coef_from(sd, c, sums, saved, weight, count)
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
        let _range = nvtx::range("batch_norm_apply");
        let z = self.alloc_for(x.dtype(), out)?;
        let yo = y.map(|v| self.operand(v)).transpose()?;
        let gate = gate.map(|g| self.start(g)).transpose()?;
        let coef = self.start(coef)?;
        let (xo, zo) = (self.operand(x)?, self.output(&z, out)?);
        ops::norm::apply(&*self.gpu, &xo, yo.as_ref(), coef, relu, gate, &zo)?;
        Ok(z)
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
        let _range = nvtx::range("sgd");
        let states: &[&[&Storage]] = if p.momentum != 0.0 {
            &[params, grads, momentum]
        } else {
            &[params, grads]
        };
        let slots = self.slots(states)?;
        let found = found_inf.map(|f| self.scalar(f)).transpose()?;
        let at = self.step_scalars(step, lr)?;
        ops::optim::sgd(&*self.gpu, first_dtype(params), &slots, at, p, found)
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
        let _range = nvtx::range("adamw");
        let slots = self.slots(&[params, grads, exp_avg, exp_avg_sq])?;
        let found = found_inf.map(|f| self.scalar(f)).transpose()?;
        let at = self.step_scalars(step, lr)?;
        ops::optim::adamw(&*self.gpu, first_dtype(params), &slots, at, p, found)
    }

    fn sum_squares(&self, tensors: &[&Storage]) -> Result<Storage> {
        let _range = nvtx::range("sum_squares");
        let dtype = first_dtype(tensors);
        let slots = self.slots(&[tensors])?;
        let acc = stats_dtype(dtype);
        let partials = self.alloc(acc, ops::optim::sum_squares_partials(&slots).max(1))?;
        let out = self.alloc(acc, 1)?;
        let (p, o) = (self.buffer(&partials)?.ptr, self.buffer(&out)?.ptr);
        ops::optim::sum_squares(&*self.gpu, dtype, &slots, p, o)?;
        Ok(out)
    }

    fn unscale_check(
        &self,
        grads: &[&Storage],
        inv_scale: &Storage,
        found_inf: &Storage,
    ) -> Result<()> {
        let _range = nvtx::range("unscale_check");
        let slots = self.slots(&[grads])?;
        let (inv, found) = (self.scalar(inv_scale)?, self.scalar(found_inf)?);
        ops::optim::unscale_check(&*self.gpu, first_dtype(grads), &slots, inv, found)
    }

    fn scaler_update(
        &self,
        scale: &Storage,
        growth_tracker: &Storage,
        found_inf: &Storage,
        p: &ScalerParams,
    ) -> Result<()> {
        let _range = nvtx::range("scaler_update");
        let (s, t, f) = (
            self.scalar(scale)?,
            self.scalar(growth_tracker)?,
            self.scalar(found_inf)?,
        );
        ops::optim::scaler_update(&*self.gpu, s, t, f, p)
    }
}

fn first_dtype(storages: &[&Storage]) -> DType {
    storages.first().map_or(DType::F32, |s| s.dtype())
}

#[cfg(test)]
mod tests {
    #[test]
    fn memory_caps_parse_with_binary_units_and_refuse_anything_else() {
        use super::parse_size;
        assert_eq!(parse_size("8GiB"), Some(8 << 30));
        assert_eq!(parse_size("512 MiB"), Some(512 << 20));
        assert_eq!(parse_size("4096"), Some(4096));
        for bad in [
            "",
            "8GB",
            "eight",
            "-1",
            "1.5GiB",
            "99999999999999999999GiB",
        ] {
            assert_eq!(parse_size(bad), None, "{bad}");
        }
    }
}

/// The README's example, compiled and run as a doctest.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
