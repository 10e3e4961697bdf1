//! The Backend contract (DESIGN.md, contract 2): one small, object-safe trait, grouped by op family.
//!
//! A backend owns device memory behind opaque [`Storage`] handles and runs ops on it. Ops
//! *enqueue* work and return a new storage; only [`Backend::download`] and
//! [`Backend::synchronize`] wait. The tensor front end (shapes, broadcasting, autograd, dtype
//! checks) is shared, so a backend implements kernels and nothing else, and every op's backward is
//! expressed through these same forward ops.
//!
//! # Mapping onto CUDA (cudarc 0.19)
//! Each CUDA device holds one `CudaStream` on which every method is stream-ordered:
//! - `alloc_zeroed`/`fill` → `stream.alloc_zeros` / a fill kernel (stream-ordered
//!   `cuMemAllocAsync`, so allocation is legal inside graph capture).
//! - `upload` → `stream.memcpy_htod` from the [`HostBytes`] (pinned when the CUDA allocator of
//!   `redline-hostmem` made it), then an event; the `HostBytes` is dropped — returning a pooled
//!   buffer to its pool — only when that event has completed (DESIGN contract 7).
//! - op methods → kernel launches (`stream.launch_builder`), cuBLASLt GEMMs, cuDNN calls on the
//!   stream; nothing blocks the host.
//! - `download` → `stream.memcpy_dtoh` into host memory + `stream.synchronize()`.
//! - `download_async` → `stream.memcpy_dtoh` into pinned host memory + an event recorded after
//!   it; [`Download::wait`] synchronises on that event only (later work keeps running).
//! - `synchronize` → `stream.synchronize()`.
//! - Graph capture: a training step whose shapes are static is bracketed by
//!   `cuStreamBeginCapture`/`cuStreamEndCapture` and replayed with `cuGraphLaunch`; it works
//!   because ops never wait on the host and scalars stay on the device (`fill`, device flags).

use std::any::Any;
use std::fmt;
use std::marker::PhantomData;
use std::ops::{Deref, Range};
use std::sync::Arc;

use redline_hostmem::{HostAllocator, PooledBuffer};

use crate::dtype::DType;
use crate::error::{Result, TensorError};
use crate::layout::Layout;

/// Device memory: an opaque handle. Only the backend that made it can look inside.
pub struct Storage {
    dtype: DType,
    len: usize,
    owner: usize,
    inner: Box<dyn Any + Send + Sync>,
}

impl Storage {
    /// Wraps a backend's own storage type. `owner` identifies the backend instance
    /// (see [`Backend::id`]) so a storage handed to the wrong one is refused.
    pub fn new<T: Any + Send + Sync>(dtype: DType, len: usize, owner: usize, inner: T) -> Self {
        Self {
            dtype,
            len,
            owner,
            inner: Box::new(inner),
        }
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Elements.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The backend's view of its storage, if `owner` made it.
    pub fn downcast<T: Any>(&self, owner: usize) -> Option<&T> {
        (self.owner == owner)
            .then(|| self.inner.downcast_ref::<T>())
            .flatten()
    }
}

impl fmt::Debug for Storage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Storage({} x {})", self.len, self.dtype)
    }
}

/// A storage seen through a layout: an op's operand.
#[derive(Debug, Clone, Copy)]
pub struct View<'a> {
    pub storage: &'a Storage,
    pub layout: &'a Layout,
}

impl View<'_> {
    pub fn dtype(&self) -> DType {
        self.storage.dtype()
    }
}

/// [`Backend::batch_norm_stats`] of `x` (with `y`, `gate` and `centre`) on `backend`, handed
/// to `then` as the contiguous `[2, C]` view it is: the first half of the
/// statistics-with-coefficients calls' composition.
pub fn with_batch_norm_sums<B: Backend + ?Sized, R>(
    backend: &B,
    x: View<'_>,
    y: Option<View<'_>>,
    gate: Option<View<'_>>,
    centre: Option<View<'_>>,
    then: impl FnOnce(View<'_>) -> Result<R>,
) -> Result<R> {
    let sums = backend.batch_norm_stats(x, y, gate, centre)?;
    let layout = Layout::contiguous(&[2, x.layout.shape()[1]]);
    then(View {
        storage: &sums,
        layout: &layout,
    })
}

/// [`Backend::batch_norm_stats_coef`] as its three calls on `backend`: each channel's first
/// element converted to the stats dtype (none for an empty batch, whose sums are raw and 0),
/// the sums about it, the coefficients. The default, and a fused backend's fallback.
pub fn batch_norm_stats_coef_composed<B: Backend + ?Sized>(
    backend: &B,
    x: View<'_>,
    weight: Option<View<'_>>,
    bias: Option<View<'_>>,
    running: Option<(&Storage, &Storage)>,
    p: &BatchNormCoefParams,
) -> Result<(Storage, Storage)> {
    let channel = Layout::contiguous(&[x.layout.shape()[1]]);
    let centre = match x.layout.numel() {
        0 => None,
        _ => {
            let first = first_of_each_channel(x.layout);
            let first = View {
                storage: x.storage,
                layout: &first,
            };
            Some(backend.convert(first, stats_dtype(x.dtype()), &channel)?)
        }
    };
    let centre = centre.as_ref().map(|storage| View {
        storage,
        layout: &channel,
    });
    with_batch_norm_sums(backend, x, None, None, centre, |sums| {
        backend.batch_norm_coef(sums, centre, weight, bias, running, p)
    })
}

/// Host bytes handed to [`Backend::upload`], owned by the backend until the copy has completed.
#[derive(Debug)]
pub enum HostBytes {
    /// A range of a buffer from a `redline-hostmem` pool (pinned on CUDA), which several copies
    /// may share (a batch's pixels and its labels); it returns to its pool when the last
    /// backend holding it drops it after its copy.
    Pooled(Arc<PooledBuffer>, Range<usize>),
    Owned(Vec<u8>),
}

impl Deref for HostBytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            HostBytes::Pooled(buffer, range) => {
                let end = range.end.min(buffer.len());
                &buffer[range.start.min(end)..end]
            }
            HostBytes::Owned(bytes) => bytes,
        }
    }
}

/// A profiler range (an NVTX range on CUDA, seen in Nsight Systems) that ends when dropped.
/// Ranges nest; drop them on the thread that opened them, innermost first.
#[must_use = "the range ends when this is dropped"]
pub struct Annotation(Option<Box<dyn FnOnce()>>);

impl Annotation {
    /// No range: for backends without a profiler interface.
    pub fn none() -> Self {
        Self(None)
    }

    /// A range that `end` closes.
    pub fn new(end: impl FnOnce() + 'static) -> Self {
        Self(Some(Box::new(end)))
    }
}

impl Drop for Annotation {
    fn drop(&mut self) {
        if let Some(end) = self.0.take() {
            end();
        }
    }
}

impl fmt::Debug for Annotation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.0.is_some() {
            "Annotation(open)"
        } else {
            "Annotation(none)"
        })
    }
}

/// A point in a device's work order ([`Backend::record_event`]): reached once every op enqueued
/// before it has finished. Transfers and collectives on a device's other streams order themselves
/// after one instead of after everything (CUDA: an event on the compute stream). A backend whose
/// ops have finished when they return hands out events that are already reached.
#[derive(Clone)]
pub struct Event {
    owner: usize,
    inner: Option<Arc<dyn Any + Send + Sync>>,
}

impl Event {
    /// An event already reached: the answer of a backend whose ops run as they are enqueued.
    pub fn reached() -> Self {
        Self {
            owner: usize::MAX,
            inner: None,
        }
    }

    /// Wraps a backend's own event; `owner` is [`Backend::id`].
    pub fn new<T: Any + Send + Sync>(owner: usize, inner: T) -> Self {
        Self {
            owner,
            inner: Some(Arc::new(inner)),
        }
    }

    /// Whether this event was reached when it was made (no backend event behind it).
    pub fn is_reached(&self) -> bool {
        self.inner.is_none()
    }

    /// The backend's event, if backend `owner` made it.
    pub fn downcast<T: Any>(&self, owner: usize) -> Option<&T> {
        (self.owner == owner)
            .then(|| self.inner.as_deref().and_then(|e| e.downcast_ref::<T>()))
            .flatten()
    }
}

impl fmt::Debug for Event {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.is_reached() {
            "Event(reached)"
        } else {
            "Event(device)"
        })
    }
}

/// Recorded device work replayed as a whole (a CUDA graph): one launch from the host instead of
/// one per op, with every op's arguments — addresses and values — as they were at capture.
pub trait Replay: Send + Sync {
    /// Enqueues the recorded work again, ordered like an op.
    fn replay(&self) -> Result<()>;
    /// How many operations (kernels, library calls, copies) one replay runs.
    fn nodes(&self) -> usize;
}

/// A captured graph ([`Backend::end_capture`]): replay it as often as wanted. It keeps the
/// device memory its ops used for as long as it lives.
pub struct Graph(Box<dyn Replay>);

impl Graph {
    pub fn new(replay: impl Replay + 'static) -> Self {
        Self(Box::new(replay))
    }

    /// Enqueues the captured work again (no host work per op).
    pub fn replay(&self) -> Result<()> {
        self.0.replay()
    }

    /// Operations per replay.
    pub fn nodes(&self) -> usize {
        self.0.nodes()
    }
}

impl fmt::Debug for Graph {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Graph({} nodes)", self.nodes())
    }
}

/// One reading of a device's clock ([`Backend::timestamp`]): the slot the device writes it to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timestamp(pub u32);

/// How many timestamps a device keeps before reusing a slot: a few hundred steps' phases, or
/// one profiled step's (an op profile brackets every op with two; Vulkan allows at most 4096
/// queries in a set).
pub const TIMESTAMP_SLOTS: u32 = 4096;

/// What a device's allocator holds ([`Backend::memory_stats`]): bytes in use by storages, bytes
/// taken from the device (in use plus cached for reuse), the peak in use, and how many requests
/// went to the device and how many the cache served. A training step's steady state makes no
/// device allocations.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemoryStats {
    /// Bytes in blocks that storages hold now (by size class).
    pub in_use: usize,
    /// Bytes taken from the device: in use plus cached.
    pub reserved: usize,
    /// The most `in_use` has been.
    pub peak_in_use: usize,
    /// Allocations from the device (a cudaMalloc-class call, a new wgpu buffer).
    pub device_allocations: u64,
    /// Requests served from the cache.
    pub reuses: u64,
}

impl std::fmt::Display for MemoryStats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mib = |b: usize| b as f64 / (1024.0 * 1024.0);
        write!(
            f,
            "{:.1} MiB in use, {:.1} MiB reserved, peak {:.1} MiB in use, {} device allocations, {} reuses",
            mib(self.in_use),
            mib(self.reserved),
            mib(self.peak_in_use),
            self.device_allocations,
            self.reuses
        )
    }
}

/// A device-to-host copy in flight, from [`Backend::download_async`]: [`wait`](Self::wait)
/// blocks until the bytes are on the host. Dropping it without waiting is allowed (a backend
/// whose buffers the copy still uses waits for it then).
pub struct Download(Box<dyn FnOnce() -> Result<Vec<u8>> + Send>);

impl Download {
    /// A copy that has already completed.
    pub fn ready(bytes: Vec<u8>) -> Self {
        Self(Box::new(move || Ok(bytes)))
    }

    /// A copy that `finish` completes (waiting for the device as needed). Dropped unwaited,
    /// `finish` is dropped uncalled: what it holds cleans up after itself.
    pub fn pending(finish: impl FnOnce() -> Result<Vec<u8>> + Send + 'static) -> Self {
        Self(Box::new(finish))
    }

    /// The bytes (little-endian elements, row-major), once the copy has completed.
    pub fn wait(self) -> Result<Vec<u8>> {
        (self.0)()
    }
}

impl fmt::Debug for Download {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Download { .. }")
    }
}

/// A [`Download`] from [`Backend::download_after`], which borrows the storage it reads until
/// it is waited for or dropped (a backend whose copy may still be reading then waits for it
/// as the download drops): the copy may run on a stream of its own, after the compute stream
/// has gone on, and a storage freed meanwhile would go back to a caching allocator that hands
/// it to the compute stream's next op while the copy still reads it.
///
/// The compiler holds the storage: a tensor outlives its downloads
///
/// ```
/// use redline_tensor::{DType, Device, Event, Tensor};
/// let device = Device::reference();
/// let t = Tensor::ones(&[4], DType::F32, &device)?;
/// let download = device.backend().download_after(t.view(), &Event::reached())?;
/// assert_eq!(download.wait()?.len(), 16);
/// drop(t);
/// # Ok::<(), redline_tensor::TensorError>(())
/// ```
///
/// and cannot go first:
///
/// ```compile_fail
/// use redline_tensor::{DType, Device, Event, Tensor};
/// let device = Device::reference();
/// let t = Tensor::ones(&[4], DType::F32, &device)?;
/// let download = device.backend().download_after(t.view(), &Event::reached())?;
/// drop(t);
/// assert_eq!(download.wait()?.len(), 16);
/// # Ok::<(), redline_tensor::TensorError>(())
/// ```
#[derive(Debug)]
pub struct DownloadOf<'a> {
    download: Download,
    _storage: PhantomData<&'a Storage>,
}

impl<'a> DownloadOf<'a> {
    /// `download`, reading `view`'s storage.
    pub fn new(view: View<'a>, download: Download) -> Self {
        let _ = view;
        Self {
            download,
            _storage: PhantomData,
        }
    }

    /// The bytes, once the copy has completed (then the storage is free to go).
    pub fn wait(self) -> Result<Vec<u8>> {
        self.download.wait()
    }
}

macro_rules! op_enum {
    ($(#[$m:meta])* $name:ident { $($(#[$vm:meta])* $variant:ident => $text:literal),* $(,)? }) => {
        $(#[$m])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub enum $name { $($(#[$vm])* $variant),* }

        impl $name {
            pub const ALL: &'static [$name] = &[$($name::$variant),*];
            pub fn name(self) -> &'static str {
                match self { $($name::$variant => $text),* }
            }
        }
    };
}

op_enum!(
    /// Elementwise ops of one operand; the output has the input's dtype.
    UnaryOp {
        Neg => "neg",
        Exp => "exp",
        Log => "log",
        Sqrt => "sqrt",
        Rsqrt => "rsqrt",
        Relu => "relu",
        /// Exact (erf) GELU, PyTorch's default.
        Gelu => "gelu",
        /// d gelu(x) / dx, for GELU's backward.
        GeluGrad => "gelu_grad",
        Sigmoid => "sigmoid",
        Tanh => "tanh",
    }
);

op_enum!(
    /// Elementwise ops of two operands of one dtype, already broadcast to one shape.
    /// Comparisons return u8 (0 or 1).
    BinaryOp {
        Add => "add",
        Sub => "sub",
        Mul => "mul",
        Div => "div",
        Pow => "pow",
        Maximum => "maximum",
        Minimum => "minimum",
        /// ReLU's backward: `b` where `a > 0`, else 0 (`a` the ReLU's input, `b` the incoming
        /// gradient; NaN in `a` gives 0, as PyTorch's `threshold_backward`). Not differentiable.
        ReluGrad => "relu_grad",
        Eq => "eq",
        Ne => "ne",
        Lt => "lt",
        Le => "le",
        Gt => "gt",
        Ge => "ge",
    }
);

impl BinaryOp {
    pub fn is_comparison(self) -> bool {
        matches!(
            self,
            BinaryOp::Eq | BinaryOp::Ne | BinaryOp::Lt | BinaryOp::Le | BinaryOp::Gt | BinaryOp::Ge
        )
    }
}

op_enum!(
    /// Reductions over axes (kept as size 1). `ArgMax` reduces one axis and returns i64.
    ReduceOp {
        Sum => "sum",
        Max => "max",
        ArgMax => "argmax",
    }
);

op_enum!(
    /// Ops that are not elementwise or reductions.
    OtherOp {
        /// Batched matrix product.
        Matmul => "matmul",
        /// `cond ? a : b`, elementwise.
        Select => "where",
        /// Strided copy with dtype conversion (contiguous, channels-last, cast).
        Convert => "convert",
        /// Strided copy into part of an existing storage (concat, padding, in-place updates).
        CopyInto => "copy_into",
        /// A storage filled with one value.
        Fill => "fill",
    }
);

op_enum!(
    /// Neural-network ops: softmax, indexing, convolution, pooling, randomness, input.
    NnOp {
        /// Softmax along one axis.
        Softmax => "softmax",
        /// Log-softmax along one axis.
        LogSoftmax => "log_softmax",
        /// `out[.., i, ..] = x[.., index[.., i, ..], ..]` along one axis (i64 index).
        Gather => "gather",
        /// The transpose of gather: `dst[.., index[i], ..] += src[.., i, ..]`, in place.
        ScatterAdd => "scatter_add",
        /// 2-d convolution (stride, padding, dilation, groups), NCHW logical, OIHW weights.
        Conv2d => "conv2d",
        /// Gradient of conv2d with respect to its input.
        Conv2dInputGrad => "conv2d_input_grad",
        /// Gradient of conv2d with respect to its weight.
        Conv2dWeightGrad => "conv2d_weight_grad",
        /// Max pooling; also returns each output's flat input position (i64).
        MaxPool2d => "max_pool2d",
        MaxPool2dGrad => "max_pool2d_grad",
        /// Average pooling (padding counted, as PyTorch's default).
        AvgPool2d => "avg_pool2d",
        /// Gradient of average pooling.
        AvgPool2dGrad => "avg_pool2d_grad",
        /// Uniform [0, 1) numbers from Philox-4x32-10 keyed by (seed, position).
        RandomUniform => "random_uniform",
        /// u8 NHWC batch → normalised float NCHW stored channels-last (the input op).
        NormalizeInput => "normalize_input",
        /// Per-channel sums `[Σx, Σx²]` (or `[Σy, Σx·y]`): batch norm's statistics and the
        /// reductions of its backward, in one pass.
        BatchNormStats => "batch_norm_stats",
        /// Per-channel `a·x + b (+ d·y)`: batch norm's normalisation and its input gradient, in
        /// one pass.
        BatchNormApply => "batch_norm_apply",
        /// Batch norm's per-channel forward coefficients from its statistics, and the running
        /// statistics' update, in one launch.
        BatchNormCoef => "batch_norm_coef",
        /// Batch norm's per-channel input-gradient coefficients and its weight and bias
        /// gradients from the backward's sums, in one launch.
        BatchNormGradCoef => "batch_norm_grad_coef",
        /// `batch_norm_stats` then `batch_norm_coef` in one call: a training norm's forward
        /// statistics and coefficients (CUDA never writes the sums of a channels-last input).
        BatchNormStatsCoef => "batch_norm_stats_coef",
        /// `batch_norm_stats` of the gradient then `batch_norm_grad_coef`, in one call.
        BatchNormGradStatsCoef => "batch_norm_grad_stats_coef",
        /// Label-smoothed cross-entropy with its softmax, and the logits' gradient, in one
        /// pass over the logits.
        CrossEntropy => "cross_entropy",
    }
);

op_enum!(
    /// Multi-tensor optimizer and mixed-precision ops; they update storages in place and read the
    /// device-side found-inf flag, so a training step needs no host synchronisation.
    OptimOp {
        /// SGD with momentum, nesterov and weight decay (PyTorch's formulas).
        Sgd => "sgd",
        /// AdamW (decoupled weight decay) with a device-side step count.
        AdamW => "adamw",
        /// Multiplies gradients by 1/scale and raises found-inf on any inf/NaN.
        UnscaleCheck => "unscale_check",
        /// GradScaler's scale update (growth after clean intervals, backoff on overflow).
        ScalerUpdate => "scaler_update",
        /// Σ x² over a list of tensors: the squared global norm of gradient clipping.
        SumSquares => "sum_squares",
    }
);

/// Every op a backend can declare, for the (op, dtype) matrix.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Op {
    Unary(UnaryOp),
    Binary(BinaryOp),
    Reduce(ReduceOp),
    Other(OtherOp),
    Nn(NnOp),
    Optim(OptimOp),
}

impl Op {
    /// Every op, grouped by family.
    pub fn all() -> Vec<Op> {
        let unary = UnaryOp::ALL.iter().map(|&o| Op::Unary(o));
        let binary = BinaryOp::ALL.iter().map(|&o| Op::Binary(o));
        let reduce = ReduceOp::ALL.iter().map(|&o| Op::Reduce(o));
        let other = OtherOp::ALL.iter().map(|&o| Op::Other(o));
        let nn = NnOp::ALL.iter().map(|&o| Op::Nn(o));
        let optim = OptimOp::ALL.iter().map(|&o| Op::Optim(o));
        unary
            .chain(binary)
            .chain(reduce)
            .chain(other)
            .chain(nn)
            .chain(optim)
            .collect()
    }

    pub fn name(self) -> &'static str {
        match self {
            Op::Unary(o) => o.name(),
            Op::Binary(o) => o.name(),
            Op::Reduce(o) => o.name(),
            Op::Other(o) => o.name(),
            Op::Nn(o) => o.name(),
            Op::Optim(o) => o.name(),
        }
    }
}

/// The dtype of batch-norm statistics and coefficients for inputs of `dtype`: f64 for f64,
/// f32 for the rest (half-precision sums would lose the statistics).
pub fn stats_dtype(dtype: DType) -> DType {
    if dtype == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

/// Geometry of a 2-d convolution.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Conv2dParams {
    pub stride: [usize; 2],
    pub padding: [usize; 2],
    pub dilation: [usize; 2],
    pub groups: usize,
}

impl Default for Conv2dParams {
    fn default() -> Self {
        Self {
            stride: [1, 1],
            padding: [0, 0],
            dilation: [1, 1],
            groups: 1,
        }
    }
}

/// Geometry of 2-d pooling.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Pool2dParams {
    pub kernel: [usize; 2],
    pub stride: [usize; 2],
    pub padding: [usize; 2],
}

/// SGD hyper-parameters (PyTorch's `torch.optim.SGD`) that stay the same from step to step:
/// what changes (the learning rate, whether the momentum buffers hold a value yet) lives in
/// device scalars the kernels read, so a captured step replays with the new values.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SgdParams {
    /// The parameter group's multiplier of the device learning rate (1 for most groups).
    pub lr_scale: f64,
    pub momentum: f64,
    pub dampening: f64,
    pub weight_decay: f64,
    pub nesterov: bool,
}

/// AdamW hyper-parameters (PyTorch's `torch.optim.AdamW`) that stay the same from step to step
/// (the learning rate and the step count are device scalars).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWParams {
    /// The parameter group's multiplier of the device learning rate.
    pub lr_scale: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
}

/// GradScaler's update rule (PyTorch's `torch.amp.GradScaler`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ScalerParams {
    pub growth_factor: f64,
    pub backoff_factor: f64,
    pub growth_interval: u64,
}

impl Default for ScalerParams {
    fn default() -> Self {
        Self {
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
        }
    }
}

/// Refuses an [`Backend::upload_into`] whose bytes are not exactly `dst`'s elements.
pub fn check_upload_into(device: String, dst: &Storage, bytes: &[u8]) -> Result<()> {
    let want = dst.len() * dst.dtype().size();
    if bytes.len() != want {
        return Err(TensorError::shape(format!(
            "upload_into on {device}: {} bytes for a storage of {} {} elements ({want} bytes)",
            bytes.len(),
            dst.len(),
            dst.dtype()
        )));
    }
    Ok(())
}

/// Refuses a [`Backend::conv2d_input_grad_accumulate`] whose `into` is not of `dtype` or does
/// not hold every element `out` addresses.
pub fn check_accumulate_into(
    device: String,
    into: &Storage,
    dtype: DType,
    out: &Layout,
) -> Result<()> {
    if into.dtype() != dtype || into.len() < out.storage_extent() {
        return Err(TensorError::shape(format!(
            "conv2d_input_grad_accumulate on {device}: a {} storage of {} elements to add {dtype} \
             {:?} into (needs {})",
            into.dtype(),
            into.len(),
            out.shape(),
            out.storage_extent()
        )));
    }
    Ok(())
}

/// The value batch norm's sums are taken about for a centre value `k`: `k` itself, or 0 where it
/// is not finite — so a non-finite first element (or mean) leaves the raw sums, whose
/// non-finite results are the ones PyTorch gives.
pub fn batch_norm_shift(k: f64) -> f64 {
    if k.is_finite() {
        k
    } else {
        0.0
    }
}

/// The layout of `x`'s first element of every channel (index 0 on every axis but 1): the
/// forward's centre ([`Backend::batch_norm_stats_coef`]).
pub fn first_of_each_channel(x: &Layout) -> Layout {
    let c = x.shape()[1];
    Layout::new(vec![c], vec![x.strides()[1]], x.offset())
}

/// The layout of the mean row of batch norm's `saved` `[mean; rstd]` (`[2, C]`): the
/// backward's centre ([`Backend::batch_norm_grad_stats_coef`]).
pub fn saved_mean(saved: &Layout) -> Layout {
    Layout::new(
        vec![saved.shape()[1]],
        vec![saved.strides()[1]],
        saved.offset(),
    )
}

/// Batch norm's training-mode constants for [`Backend::batch_norm_coef`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BatchNormCoefParams {
    /// Elements per channel (N·H·W).
    pub count: f64,
    pub eps: f64,
    /// The running statistics' update weight (PyTorch's `momentum`).
    pub momentum: f64,
    /// Whether a residual is added: the third coefficient row is 1 (else 0).
    pub residual: bool,
}

impl BatchNormCoefParams {
    /// The forward coefficients on the host, in f64 (the reference kernel, shared by the host
    /// backends): from `sums` `[Σx; Σx²]` (`2·C`) taken about `centre` (`C`, each value through
    /// [`batch_norm_shift`]; 0 when None), the optional weight and bias (`C`) and the running
    /// mean and variance (updated in place), returns `coef` `[scale; shift; r]` and `saved`
    /// `[mean; rstd]`. The composition in `Tensor::batch_norm` computes the same: with
    /// d = Σ(x−k)/n, mean = k + d, var = max(Σ(x−k)²/n − d², 0), rstd = 1/√(var + eps),
    /// scale = rstd·w, shift = b − mean·scale; the running variance is updated with the
    /// unbiased variance.
    ///
    /// Raw moments (k = 0) lose (mean/σ)² ulps of the variance to cancellation — every digit
    /// in f32 once the mean is a few thousand σ from 0; the training forward takes its sums
    /// about each channel's first element ([`Backend::batch_norm_stats_coef`]), a few σ from
    /// the batch's mean whatever it is, as PyTorch's Welford sums keep them.
    pub fn host(
        &self,
        sums: &[f64],
        centre: Option<&[f64]>,
        weight: Option<&[f64]>,
        bias: Option<&[f64]>,
        running: Option<(&mut [f64], &mut [f64])>,
    ) -> (Vec<f64>, Vec<f64>) {
        let c = sums.len() / 2;
        let n = self.count;
        let k = |ch: usize| centre.map_or(0.0, |k| batch_norm_shift(k[ch]));
        let offset: Vec<f64> = sums[..c].iter().map(|s| s / n).collect();
        let mean: Vec<f64> = (0..c).map(|ch| k(ch) + offset[ch]).collect();
        let var: Vec<f64> = (0..c)
            .map(|ch| (sums[c + ch] / n - offset[ch] * offset[ch]).max(0.0))
            .collect();
        if let Some((rm, rv)) = running {
            let unbiased = n / (n.max(2.0) - 1.0);
            let m = self.momentum;
            for k in 0..c {
                rm[k] = (1.0 - m) * rm[k] + m * mean[k];
                rv[k] = (1.0 - m) * rv[k] + m * unbiased * var[k];
            }
        }
        let rstd: Vec<f64> = var.iter().map(|v| 1.0 / (v + self.eps).sqrt()).collect();
        let mut coef = vec![0.0; 3 * c];
        for k in 0..c {
            let scale = rstd[k] * weight.map_or(1.0, |w| w[k]);
            coef[k] = scale;
            coef[c + k] = bias.map_or(0.0, |b| b[k]) - mean[k] * scale;
            coef[2 * c + k] = if self.residual { 1.0 } else { 0.0 };
        }
        (coef, [mean, rstd].concat())
    }

    /// The backward coefficients on the host, in f64: from `sums` `[Σg; Σ(x−mean)·g]` (`2·C`,
    /// the centred sums of [`Backend::batch_norm_stats`] with the forward's mean as its
    /// `centre`), the forward's `saved` `[mean; rstd]` and the optional weight, returns `coef`
    /// `[k0; k1; rw]` (dx = rw·g + k0·x + k1) and `[dw; db]` (`2·C`): rw = rstd·w,
    /// k0 = −rw·rstd²·Σ(x−mean)g/n, k1 = −rw·Σg/n − mean·k0, dw = rstd·Σ(x−mean)g, db = Σg.
    pub fn host_grad(
        count: f64,
        sums: &[f64],
        saved: &[f64],
        weight: Option<&[f64]>,
    ) -> (Vec<f64>, Vec<f64>) {
        let c = sums.len() / 2;
        let mut coef = vec![0.0; 3 * c];
        let mut dwdb = vec![0.0; 2 * c];
        for k in 0..c {
            let (mean, rstd) = (saved[k], saved[c + k]);
            let (sum_g, centred) = (sums[k], sums[c + k]);
            let rw = rstd * weight.map_or(1.0, |w| w[k]);
            let k0 = -(rw * rstd * rstd * centred) / count;
            coef[k] = k0;
            coef[c + k] = -(rw * sum_g) / count - mean * k0;
            coef[2 * c + k] = rw;
            dwdb[k] = rstd * centred;
            dwdb[c + k] = sum_g;
        }
        (coef, dwdb)
    }
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A compute device's kernels and memory. Object-safe; shared as `Arc<dyn Backend>` by
/// [`Device`](crate::Device).
///
/// Every op writes a **new** storage, except where its doc says it updates one in place
/// (`copy_into`, `scatter_add`, the `upload_into` calls, the optimizer family, the running
/// statistics of the batch-norm coefficient calls, the random stream's offset and
/// `conv2d_input_grad_accumulate`). Output layouts passed in as `out` are
/// dense (every element once, any axis order — row-major or channels-last). The front end has
/// already checked shapes, dtypes and [`supports`](Self::supports); a backend may still return
/// errors (out of memory, a foreign storage).
pub trait Backend: Send + Sync + fmt::Debug {
    /// A name for messages and registries: "reference", "cpu", "wgpu:llvmpipe", "cuda:0".
    fn name(&self) -> String;

    /// A number unique to this backend instance; stamped on every storage it makes.
    fn id(&self) -> usize;

    /// Whether the backend implements `op` for `dtype` (its declared matrix). The front end
    /// refuses undeclared pairs with [`TensorError::Unsupported`](crate::TensorError).
    fn supports(&self, op: Op, dtype: DType) -> bool;

    /// Whether this backend may flush subnormal values of `dtype` to zero, as results or as
    /// inputs. WGSL lets an implementation do so, and NVIDIA's Vulkan driver does where a
    /// shader does not ask to keep them (naga has no way to ask); the conformance suite then
    /// accepts a zero where the reference is subnormal, and nothing else. The CPU and CUDA
    /// (NVRTC without `-ftz`) keep them, as loss scaling needs of small gradients: false by
    /// default.
    fn may_flush_subnormals(&self, dtype: DType) -> bool {
        let _ = dtype;
        false
    }

    // --- memory -------------------------------------------------------------------------

    /// `len` elements of `dtype`, all `value` (rounded to the dtype).
    fn fill(&self, dtype: DType, len: usize, value: f64) -> Result<Storage>;

    /// A storage holding `bytes` (little-endian elements of `dtype`). The backend owns `bytes`
    /// until the copy has completed, then drops it (returning a pooled buffer to its pool).
    fn upload(&self, dtype: DType, bytes: HostBytes) -> Result<Storage>;

    /// Overwrites all of `dst` with `bytes` (exactly `dst.len()` little-endian elements of its
    /// dtype), ordered like an op: after every op enqueued before it, before every op enqueued
    /// after it. The storage keeps its address, which is what a captured graph needs of its
    /// inputs and step scalars (CUDA: an async copy on the stream into the same allocation).
    /// `bytes` is owned until the copy has completed. The default uploads a fresh storage and
    /// copies it over with [`copy_into`](Self::copy_into); backends write directly.
    fn upload_into(&self, dst: &Storage, bytes: HostBytes) -> Result<()> {
        check_upload_into(self.name(), dst, &bytes)?;
        let src = self.upload(dst.dtype(), bytes)?;
        let layout = Layout::contiguous(&[dst.len()]);
        let view = View {
            storage: &src,
            layout: &layout,
        };
        self.copy_into(dst, &layout, view)
    }

    /// [`upload_into`](Self::upload_into) ordered after `after` only (the caller's word that
    /// no op enqueued since touches `dst`), returning the event the copy is complete at, for
    /// [`wait_event`](Self::wait_event) before `dst` is used again: the next batch's copy can
    /// run while this step computes (CUDA: on the copy stream). The default copies in order
    /// and returns the point after it.
    fn upload_into_after(&self, dst: &Storage, bytes: HostBytes, after: &Event) -> Result<Event> {
        let _ = after;
        self.upload_into(dst, bytes)?;
        self.record_event()
    }

    /// The view's elements in row-major order as little-endian bytes. Waits for pending work.
    fn download(&self, x: View<'_>) -> Result<Vec<u8>>;

    /// Starts copying the view's elements (row-major, little-endian) to the host and returns
    /// without waiting: the copy sees every op enqueued before it, ops enqueued after it run
    /// while it is in flight, and [`Download::wait`] blocks only until it has arrived (a trainer
    /// reads last step's loss this way while the device runs this step). The default copies at
    /// once, which is right for a backend whose ops run synchronously.
    fn download_async(&self, x: View<'_>) -> Result<Download> {
        self.download(x).map(Download::ready)
    }

    /// Waits until every enqueued op has finished.
    fn synchronize(&self) -> Result<()>;

    /// Marks the point after every op enqueued so far and returns without waiting (CUDA: an
    /// event recorded on the compute stream). The default, [`Event::reached`], is right for a
    /// backend with one queue whose work is already ordered, or whose ops finish as they return.
    fn record_event(&self) -> Result<Event> {
        Ok(Event::reached())
    }

    /// Makes every op enqueued after this call wait, on the device, for `event` — which may
    /// mark work of another stream (a collective's): the host does not wait. Storages that
    /// work touches must stay alive until this call. The default does nothing, which is right
    /// where all work runs in one queue.
    fn wait_event(&self, event: &Event) -> Result<()> {
        let _ = event;
        Ok(())
    }

    /// Starts recording instead of running: every op enqueued until
    /// [`end_capture`](Self::end_capture) is captured into a graph (its outputs' memory comes
    /// from, and stays with, the graph). What a capture cannot hold is refused while it runs —
    /// a download, a synchronize, a copy from pageable host memory — so a step that would read
    /// the device, or decide on the host, fails here instead of replaying wrong. The default:
    /// this device cannot capture.
    fn begin_capture(&self) -> Result<()> {
        Err(TensorError::Backend {
            device: self.name(),
            what: "this device cannot capture graphs".into(),
        })
    }

    /// Ends the capture [`begin_capture`](Self::begin_capture) started and returns the graph
    /// (which has not run yet).
    fn end_capture(&self) -> Result<Graph> {
        Err(TensorError::Backend {
            device: self.name(),
            what: "no capture to end: this device cannot capture graphs".into(),
        })
    }

    /// Like [`download_async`](Self::download_async), but ordered after `after` only, not after
    /// every op enqueued so far (CUDA: on a copy stream that waits for the event), so a
    /// gradient can travel to the host while the rest of the backward pass runs. The caller
    /// guarantees no op after `after` writes the view before the download is waited for; the
    /// returned download borrows the view's storage until then (the caching allocator reuses
    /// memory in the compute stream's order and knows nothing of a copy stream still reading
    /// it). The default downloads after everything, which is correct, only later.
    fn download_after<'a>(&self, x: View<'a>, after: &Event) -> Result<DownloadOf<'a>> {
        let _ = after;
        Ok(DownloadOf::new(x, self.download_async(x)?))
    }

    /// Enqueues a reading of the device's clock, taken when every op enqueued before it has
    /// finished (a CUDA event, a Vulkan timestamp query), and returns without waiting. `None`
    /// where the device has no such clock — or needs none: a backend whose ops run
    /// synchronously is timed exactly by the host's clock, which is the default.
    fn timestamp(&self) -> Result<Option<Timestamp>> {
        Ok(None)
    }

    /// The readings of `stamps` in nanoseconds on the device's clock (only differences mean
    /// anything), waiting until the device has taken them. A reading can be read until
    /// [`TIMESTAMP_SLOTS`] later ones have been taken.
    fn read_timestamps(&self, stamps: &[Timestamp]) -> Result<Vec<u64>> {
        if stamps.is_empty() {
            return Ok(Vec::new());
        }
        Err(TensorError::Backend {
            device: self.name(),
            what: "this device takes no timestamps".into(),
        })
    }

    /// Opens a profiler range named `name` (an op, a training phase) until the guard drops;
    /// backends without a profiler interface return [`Annotation::none`].
    fn annotate(&self, name: &str) -> Annotation {
        let _ = name;
        Annotation::none()
    }

    /// The host allocator loader pools should use so batches upload without a staging copy
    /// (page-locked memory on CUDA, DESIGN contract 7); `None`: the default page-aligned one.
    fn host_allocator(&self) -> Option<Arc<dyn HostAllocator>> {
        None
    }

    /// What the device's caching allocator holds; `None` where storages are plain host
    /// allocations (the CPU backends: the process's resident memory tells their story).
    fn memory_stats(&self) -> Option<MemoryStats> {
        None
    }

    // --- op families --------------------------------------------------------------------

    /// `op(x)` elementwise, written in layout `out`.
    fn unary(&self, op: UnaryOp, x: View<'_>, out: &Layout) -> Result<Storage>;

    /// `op(a, b)` elementwise over views already broadcast to `out`'s shape.
    fn binary(&self, op: BinaryOp, a: View<'_>, b: View<'_>, out: &Layout) -> Result<Storage>;

    /// Reduces `axes` (sorted, unique; kept with size 1) into a contiguous output. `ArgMax`
    /// gets exactly one axis and writes i64.
    fn reduce(&self, op: ReduceOp, x: View<'_>, axes: &[usize]) -> Result<Storage>;

    /// `[.., M, K] @ [.., K, N]` with equal batch shapes (broadcast batches have stride 0;
    /// transposed operands arrive as strides) into a contiguous `[.., M, N]`.
    fn matmul(&self, a: View<'_>, b: View<'_>) -> Result<Storage>;

    /// `cond != 0 ? a : b` over views broadcast to `out`'s shape; `cond` is u8.
    fn select(&self, cond: View<'_>, a: View<'_>, b: View<'_>, out: &Layout) -> Result<Storage>;

    /// `x` converted to `dtype` and written in layout `out` (copy, relayout, cast).
    fn convert(&self, x: View<'_>, dtype: DType, out: &Layout) -> Result<Storage>;

    /// Writes `src` (converted to the destination's dtype) into the part of `dst` that `at`
    /// describes. Stream-ordered like the other ops.
    fn copy_into(&self, dst: &Storage, at: &Layout, src: View<'_>) -> Result<()>;

    // --- neural-network ops -------------------------------------------------------------

    /// (Log-)softmax of `x` along `axis`, written in layout `out`.
    fn softmax(&self, x: View<'_>, axis: usize, log: bool, out: &Layout) -> Result<Storage>;

    /// `out[p] = x[p with axis coordinate replaced by index[p]]`; `index` (i64) has x's rank and
    /// is no larger on any other axis; the output is contiguous of index's shape.
    fn gather(&self, x: View<'_>, axis: usize, index: View<'_>) -> Result<Storage>;

    /// `dst[p with axis coordinate index[p]] += src[p]`, in place; `dst` is a whole contiguous
    /// storage of shape `dst_shape`.
    fn scatter_add(
        &self,
        dst: &Storage,
        dst_shape: &[usize],
        axis: usize,
        index: View<'_>,
        src: View<'_>,
    ) -> Result<()>;

    /// `x [N, C, H, W] ⋆ w [O, C/groups, KH, KW]` → `[N, O, HO, WO]` written in layout `out`.
    fn conv2d(&self, x: View<'_>, w: View<'_>, p: &Conv2dParams, out: &Layout) -> Result<Storage>;

    /// The gradient of conv2d's input (shape `out.shape()`) from the output gradient `g`.
    fn conv2d_input_grad(
        &self,
        g: View<'_>,
        w: View<'_>,
        p: &Conv2dParams,
        out: &Layout,
    ) -> Result<Storage>;

    /// [`conv2d_input_grad`](Self::conv2d_input_grad) added in place into `into` (laid out as
    /// `out`, g's dtype), where the backend fuses the addition (cuDNN's β = 1): a residual
    /// block's input gradient without a separate add. `Ok(true)` when it did; `Ok(false)`, the
    /// default, leaves `into` as it was and the caller adds.
    fn conv2d_input_grad_accumulate(
        &self,
        g: View<'_>,
        w: View<'_>,
        p: &Conv2dParams,
        into: &Storage,
        out: &Layout,
    ) -> Result<bool> {
        let _ = (g, w, p, into, out);
        Ok(false)
    }

    /// The gradient of conv2d's weight from `x` and `g`, written in layout `out` (the weight's
    /// shape; dense, OIHW or channels-last OHWI — the weight's own order, so that cuDNN's NHWC
    /// kernels write their native KRSC filter gradient beside a channels-last weight).
    fn conv2d_weight_grad(
        &self,
        x: View<'_>,
        g: View<'_>,
        p: &Conv2dParams,
        out: &Layout,
    ) -> Result<Storage>;

    /// Max pooling into layout `out`, plus (i64, also in layout `out`) the flat `h * W + w`
    /// position of each output's maximum in its input plane (first maximum on ties). The
    /// positions share the values' layout so a device writes both in one memory-order walk
    /// (channels-last under AMP), as PyTorch lays out its indices.
    fn max_pool2d(&self, x: View<'_>, p: &Pool2dParams, out: &Layout)
        -> Result<(Storage, Storage)>;

    /// The input gradient of max pooling, written in layout `out` (the input's shape): each
    /// output gradient of `g` `[N, C, HO, WO]` is added at its maximum's flat position in its
    /// plane (`positions`, i64, as [`max_pool2d`](Self::max_pool2d) returns them), summed in
    /// output order so every run gives the same bits. A position outside its plane is an error
    /// on host backends; a device backend drops its gradient (checking would cost a host sync).
    fn max_pool2d_grad(
        &self,
        g: View<'_>,
        positions: View<'_>,
        p: &Pool2dParams,
        out: &Layout,
    ) -> Result<Storage>;

    /// Average pooling (padding counted in the divisor) into layout `out`.
    fn avg_pool2d(&self, x: View<'_>, p: &Pool2dParams, out: &Layout) -> Result<Storage>;

    /// The input gradient of average pooling, written in layout `out` (the input's shape).
    fn avg_pool2d_grad(&self, g: View<'_>, p: &Pool2dParams, out: &Layout) -> Result<Storage>;

    /// `len` uniform numbers in [0, 1): element `i` is Philox-4x32-10 with key `seed` and counter
    /// `(offset + i) / 4`, word `(offset + i) % 4`, as `(word >> 8) * 2^-24`. Identical on every
    /// backend, whatever the launch geometry (DESIGN contract 9).
    fn random_uniform(&self, dtype: DType, len: usize, seed: u64, offset: u64) -> Result<Storage>;

    /// [`random_uniform`](Self::random_uniform) from the offset this device holds in `offset`
    /// (a whole one-element i64 storage, non-negative), which then advances by `len` in place:
    /// what a step captured as a graph draws with, so that each replay reads and moves the
    /// offset on the device instead of repeating one baked in at capture. The default reads
    /// the offset back to the host and writes the next one (a synchronisation, right for host
    /// backends); a backend that captures graphs does both in its kernels.
    fn random_uniform_at(
        &self,
        dtype: DType,
        len: usize,
        seed: u64,
        offset: View<'_>,
    ) -> Result<Storage> {
        let bytes = self.download(offset)?;
        let at = bytes
            .get(..8)
            .and_then(|b| <[u8; 8]>::try_from(b).ok())
            .map(i64::from_le_bytes)
            .ok_or_else(|| TensorError::shape("random_uniform_at: the offset is not one i64"))?;
        let next = u64::try_from(at)
            .ok()
            .and_then(|at| Some((at, i64::try_from(at.checked_add(len as u64)?).ok()?)));
        let Some((at, next)) = next else {
            return Err(TensorError::shape(format!(
                "random_uniform_at: offset {at} (+ {len}) is outside 0..2^63"
            )));
        };
        let drawn = self.random_uniform(dtype, len, seed, at)?;
        let next = HostBytes::Owned(next.to_le_bytes().to_vec());
        self.upload_into(offset.storage, next)?;
        Ok(drawn)
    }

    /// `x` u8 `[N, H, W, C]` → `(x / 255 - mean[c]) / std[c]` as `dtype`, logically `[N, C, H, W]`
    /// in layout `out` (channels-last: the same memory order as the input).
    fn normalize_input(
        &self,
        x: View<'_>,
        mean: &[f64],
        std: &[f64],
        dtype: DType,
        out: &Layout,
    ) -> Result<Storage>;

    /// Per-channel sums over every axis but 1 of `x` (`[N, C, ..]`, any layout): a contiguous
    /// `[2, C]` of [`stats_dtype`]`(x)` holding `[Σx, Σx²]`, or with `y` (x's shape and dtype)
    /// `[Σy, Σx·y]`. Accumulated in at least f32 (f64 on host backends).
    ///
    /// `gate` (only with `y`; a contiguous `[2, C]` `[a; b]` of [`stats_dtype`]`(x)`): `y`
    /// counts only where `a[c]·x + b[c] > 0`, computed exactly as [`Backend::batch_norm_apply`]
    /// computes its value from x — the mask of the ReLU after a batch norm, for its backward,
    /// without reading the forward's output or writing a masked gradient (NaN masks to 0, as
    /// [`BinaryOp::ReluGrad`]).
    ///
    /// `centre` (a contiguous `[C]` `k` of [`stats_dtype`]`(x)`): every sum reads `x − k[c]`
    /// where it reads x (the gate still reads x itself) — `[Σy, Σ(x−k)·y]` with `y` — a
    /// non-finite `k[c]` taken as 0 ([`batch_norm_shift`]). The backward passes the forward's
    /// mean, so the sums hold Σ(x − mean)·g itself: subtracting mean·Σg from a raw Σx·g
    /// afterwards cancels digits the stats dtype no longer has (a conformance soak found f32
    /// `dw` 1e-4 relative off that way, where PyTorch's kernels also centre first). The
    /// training forward passes each channel's first element
    /// ([`batch_norm_stats_coef`](Self::batch_norm_stats_coef)).
    fn batch_norm_stats(
        &self,
        x: View<'_>,
        y: Option<View<'_>>,
        gate: Option<View<'_>>,
        centre: Option<View<'_>>,
    ) -> Result<Storage>;

    /// `coef[0, c]·x + coef[1, c] (+ coef[2, c]·y)` per channel `c` (axis 1), then
    /// `max(·, 0)` where `relu` (batch norm, its residual add and the ReLU after them in one
    /// pass), written in layout `out` as x's dtype; `coef` is a contiguous `[3, C]` of
    /// [`stats_dtype`]`(x)`. `gate` (only with `y`) masks `y` as in
    /// [`Backend::batch_norm_stats`].
    fn batch_norm_apply(
        &self,
        x: View<'_>,
        y: Option<View<'_>>,
        coef: View<'_>,
        relu: bool,
        gate: Option<View<'_>>,
        out: &Layout,
    ) -> Result<Storage>;

    /// Batch norm's forward coefficients (training): from `sums` (`[2, C]` of
    /// [`batch_norm_stats`](Self::batch_norm_stats)) and the `centre` they were taken about,
    /// the optional weight and bias (`[C]`) and running mean and variance (`[C]`, updated in
    /// place), a `[3, C]` `coef` for [`batch_norm_apply`](Self::batch_norm_apply) and a
    /// `[2, C]` `[mean; rstd]` for the backward — every operand contiguous and of the sums'
    /// dtype; the math is [`BatchNormCoefParams::host`]. One launch where the composition
    /// takes ~30. Declared for the activations' dtype; the default refuses.
    fn batch_norm_coef(
        &self,
        sums: View<'_>,
        centre: Option<View<'_>>,
        weight: Option<View<'_>>,
        bias: Option<View<'_>>,
        running: Option<(&Storage, &Storage)>,
        p: &BatchNormCoefParams,
    ) -> Result<(Storage, Storage)> {
        let _ = (sums, centre, weight, bias, running, p);
        Err(TensorError::Backend {
            device: self.name(),
            what: "batch_norm_coef is not implemented".into(),
        })
    }

    /// Batch norm's backward coefficients: from `sums` (`[2, C]` `[Σg; Σ(x−mean)·g]`: the
    /// sums of [`batch_norm_stats`](Self::batch_norm_stats) centred on the mean), the forward's
    /// `saved` `[mean; rstd]` and the optional weight, a `[3, C]` `coef` for the input
    /// gradient's [`batch_norm_apply`](Self::batch_norm_apply), `dw` and `db` (`[C]` each,
    /// apart: they are gradients of their own) — contiguous, of the sums' dtype; the math is
    /// [`BatchNormCoefParams::host_grad`].
    fn batch_norm_grad_coef(
        &self,
        sums: View<'_>,
        saved: View<'_>,
        weight: Option<View<'_>>,
        count: f64,
    ) -> Result<(Storage, Storage, Storage)> {
        let _ = (sums, saved, weight, count);
        Err(TensorError::Backend {
            device: self.name(),
            what: "batch_norm_grad_coef is not implemented".into(),
        })
    }

    /// [`batch_norm_stats`](Self::batch_norm_stats) of `x` alone, then
    /// [`batch_norm_coef`](Self::batch_norm_coef) of its sums, both centred on each channel's
    /// first element ([`first_of_each_channel`], as [`stats_dtype`]`(x)`): the fused training
    /// forward's statistics and coefficients in one call, so a backend may never write the
    /// sums — CUDA turns its channels-last partial sums into coefficients in one launch and
    /// reads the first elements there. The same bits as the three calls (the first elements
    /// converted, the sums, the coefficients); they are the default.
    fn batch_norm_stats_coef(
        &self,
        x: View<'_>,
        weight: Option<View<'_>>,
        bias: Option<View<'_>>,
        running: Option<(&Storage, &Storage)>,
        p: &BatchNormCoefParams,
    ) -> Result<(Storage, Storage)> {
        batch_norm_stats_coef_composed(self, x, weight, bias, running, p)
    }

    /// The backward's counterpart of [`batch_norm_stats_coef`](Self::batch_norm_stats_coef):
    /// [`batch_norm_stats`](Self::batch_norm_stats) of `x` with the gradient `g` (and `gate`),
    /// centred on `saved`'s mean, then [`batch_norm_grad_coef`](Self::batch_norm_grad_coef) of
    /// those sums.
    fn batch_norm_grad_stats_coef(
        &self,
        x: View<'_>,
        g: View<'_>,
        gate: Option<View<'_>>,
        saved: View<'_>,
        weight: Option<View<'_>>,
        count: f64,
    ) -> Result<(Storage, Storage, Storage)> {
        let mean = saved_mean(saved.layout);
        let centre = View {
            storage: saved.storage,
            layout: &mean,
        };
        with_batch_norm_sums(self, x, Some(g), gate, Some(centre), |sums| {
            self.batch_norm_grad_coef(sums, saved, weight, count)
        })
    }

    /// Label-smoothed cross-entropy of `logits` `[N, C]` (a float dtype, any layout) against
    /// i64 `targets` `[N]` (contiguous): per sample `(1 − ε)·(lse − x[t]) + ε·(lse − mean x)`
    /// with `lse` the row's log-sum-exp and ε = `smoothing`, averaged over the samples whose
    /// target is not `ignore_index` (0 when none is left). Returns the loss (one element of
    /// the logits' dtype, accumulated in [`stats_dtype`]) and, when `grad`, ∂loss/∂logits
    /// (`[N, C]` contiguous, logits' dtype): `keep/count · (softmax − (1 − ε)·onehot(t) − ε/C)`.
    /// Softmax, loss and gradient in one pass where the composition takes ~12 ops forward and
    /// ~10 backward. A kept target outside `[0, C)` is an error where the backend sees it (host
    /// backends) and a NaN loss on a device. The default refuses.
    fn cross_entropy(
        &self,
        logits: View<'_>,
        targets: View<'_>,
        smoothing: f64,
        ignore_index: i64,
        grad: bool,
    ) -> Result<(Storage, Option<Storage>)> {
        let _ = (logits, targets, smoothing, ignore_index, grad);
        Err(TensorError::Backend {
            device: self.name(),
            what: "cross_entropy is not implemented".into(),
        })
    }

    // --- optimizer and mixed-precision ops (in place) ------------------------------------

    /// Unless `found_inf` (one element) is non-zero: `step += 1`, then for every i PyTorch's
    /// SGD step on `params[i]` with `grads[i]` and momentum buffer `momentum[i]` (ignored
    /// without momentum) at learning rate `lr[0] · p.lr_scale`. The buffer is set to the
    /// gradient, undampened, when the new `step` is 1 (the first applied step, as PyTorch fills
    /// a buffer that does not exist yet). `step` and `lr` are one-element device scalars.
    #[allow(clippy::too_many_arguments)]
    fn sgd(
        &self,
        params: &[&Storage],
        grads: &[&Storage],
        momentum: &[&Storage],
        step: &Storage,
        lr: &Storage,
        p: &SgdParams,
        found_inf: Option<&Storage>,
    ) -> Result<()>;

    /// Unless `found_inf` is non-zero: `step += 1`, then PyTorch's AdamW update of every
    /// parameter with its gradient and moment buffers at learning rate `lr[0] · p.lr_scale`,
    /// bias-corrected with the new `step`.
    #[allow(clippy::too_many_arguments)]
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
    ) -> Result<()>;

    /// Σ x² over every element of every storage in `tensors` (one dtype, at least one), as a
    /// one-element storage of [`stats_dtype`]: the squared global norm gradient clipping needs,
    /// in one multi-tensor pass instead of a few ops per tensor. The default refuses.
    fn sum_squares(&self, tensors: &[&Storage]) -> Result<Storage> {
        let _ = tensors;
        Err(TensorError::Backend {
            device: self.name(),
            what: "sum_squares is not implemented".into(),
        })
    }

    /// `g *= inv_scale` for every gradient, and `found_inf = 1` when any result is inf or NaN.
    fn unscale_check(
        &self,
        grads: &[&Storage],
        inv_scale: &Storage,
        found_inf: &Storage,
    ) -> Result<()>;

    /// GradScaler's update: on `found_inf`, `scale *= backoff` and `growth_tracker = 0`; else
    /// `growth_tracker += 1`, and when it reaches `growth_interval`, `scale *= growth` and it
    /// resets to 0. Then `found_inf` is cleared for the next step.
    fn scaler_update(
        &self,
        scale: &Storage,
        growth_tracker: &Storage,
        found_inf: &Storage,
        p: &ScalerParams,
    ) -> Result<()>;
}
