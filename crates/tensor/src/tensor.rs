//! `Tensor`: a shared storage seen through a layout, on a device, maybe on the autograd tape.

use std::fmt;
use std::marker::PhantomData;
use std::sync::{Arc, Mutex};

use crate::autograd::{self, BackwardFn, Node, Pending};
use crate::backend::{Backend, Download, Event, HostBytes, Op, OtherOp, Storage, View};
use crate::device::Device;
use crate::dtype::{self, DType, Element};
use crate::error::{Result, TensorError};
use crate::layout::Layout;

/// An n-dimensional array on a device. Cloning is cheap (it shares everything); views share the
/// storage with a new layout.
#[derive(Clone)]
pub struct Tensor(Arc<Inner>);

struct Inner {
    storage: Arc<Storage>,
    layout: Layout,
    device: Device,
    requires_grad: bool,
    node: Option<Arc<Node>>,
    grad: Mutex<Option<Tensor>>,
    /// Called when backward has finished accumulating this leaf's gradient.
    grad_hook: Mutex<Option<GradHook>>,
}

/// A leaf's gradient-ready hook (PyTorch's `register_post_accumulate_grad_hook`): called with
/// the leaf once a backward pass has accumulated its gradient — the moment data parallelism can
/// start reducing it while backward goes on with the rest of the graph.
pub type GradHook = Arc<dyn Fn(&Tensor) + Send + Sync>;

impl Tensor {
    /// A tensor over `storage` that is not on the tape.
    pub fn from_storage(storage: Storage, layout: Layout, device: Device) -> Self {
        Self::plain(Arc::new(storage), layout, device)
    }

    fn plain(storage: Arc<Storage>, layout: Layout, device: Device) -> Self {
        Self(Arc::new(Inner {
            storage,
            layout,
            device,
            requires_grad: false,
            node: None,
            grad: Mutex::new(None),
            grad_hook: Mutex::new(None),
        }))
    }

    /// Uploads `values` as a tensor of `shape` (dtype from `T`).
    pub fn from_slice<T: Element>(values: &[T], shape: &[usize], device: &Device) -> Result<Self> {
        Self::from_bytes(dtype::to_bytes(values), T::DTYPE, shape, device)
    }

    /// Uploads little-endian bytes of `dtype` as a tensor of `shape`.
    pub fn from_bytes(
        bytes: Vec<u8>,
        dtype: DType,
        shape: &[usize],
        device: &Device,
    ) -> Result<Self> {
        Self::upload(HostBytes::Owned(bytes), dtype, shape, device)
    }

    /// Uploads host bytes (e.g. a pooled, pinned loader batch) as a tensor of `shape`; the device
    /// keeps the buffer until the copy completes, then returns it to its pool.
    pub fn upload(
        bytes: HostBytes,
        dtype: DType,
        shape: &[usize],
        device: &Device,
    ) -> Result<Self> {
        let numel: usize = shape.iter().product();
        if bytes.len() != numel * dtype.size() {
            return Err(TensorError::shape(format!(
                "{} bytes do not hold a {dtype} tensor of shape {shape:?} ({} bytes)",
                bytes.len(),
                numel * dtype.size()
            )));
        }
        let storage = device.backend().upload(dtype, bytes)?;
        Ok(Self::from_storage(
            storage,
            Layout::contiguous(shape),
            device.clone(),
        ))
    }

    /// Overwrites this tensor's elements with host bytes, in place: the storage keeps its
    /// device address, so a captured step that reads it (an input batch, a learning rate) sees
    /// the new values on replay. The tensor must own its whole storage densely (a tensor made by
    /// an upload, `full` or an op, not a view into another); `bytes` must hold exactly its
    /// elements. Ordered like an op; the device owns `bytes` until the copy has completed.
    pub fn copy_from_host(&self, bytes: HostBytes) -> Result<()> {
        self.check_whole("copy_from_host")?;
        self.backend().upload_into(self.storage(), bytes)
    }

    /// [`copy_from_host`](Self::copy_from_host) ordered after `after` only — the point after
    /// the last op that reads or writes this tensor — instead of after every op so far (CUDA:
    /// on the copy stream, overlapping the compute queued since). Returns the event the copy
    /// is complete at: make the device wait for it ([`Device::wait_event`](crate::Device))
    /// before the next op that uses the tensor, and enqueue none in between.
    pub fn copy_from_host_after(&self, bytes: HostBytes, after: &Event) -> Result<Event> {
        self.check_whole("copy_from_host_after")?;
        self.backend()
            .upload_into_after(self.storage(), bytes, after)
    }

    fn check_whole(&self, what: &str) -> Result<()> {
        let dense = self.layout().is_contiguous() && self.storage().len() == self.numel();
        if !dense {
            return Err(TensorError::shape(format!(
                "{what} into a view ({:?} of a {}-element storage): only a whole dense tensor \
                 can be overwritten from the host",
                self.shape(),
                self.storage().len()
            )));
        }
        Ok(())
    }

    /// [`copy_from_host`](Self::copy_from_host) from values rounded to this tensor's dtype.
    pub fn copy_from_f64s(&self, values: &[f64]) -> Result<()> {
        let dtype = self.dtype();
        let mut bytes = vec![0u8; values.len() * dtype.size()];
        for (i, &v) in values.iter().enumerate() {
            dtype.write(&mut bytes, i, v);
        }
        self.copy_from_host(HostBytes::Owned(bytes))
    }

    /// A tensor of `shape` filled with `value`.
    pub fn full(value: f64, shape: &[usize], dtype: DType, device: &Device) -> Result<Self> {
        device.check(Op::Other(OtherOp::Fill), dtype)?;
        let numel = shape.iter().product();
        let storage = device.backend().fill(dtype, numel, value)?;
        Ok(Self::from_storage(
            storage,
            Layout::contiguous(shape),
            device.clone(),
        ))
    }

    pub fn zeros(shape: &[usize], dtype: DType, device: &Device) -> Result<Self> {
        Self::full(0.0, shape, dtype, device)
    }

    pub fn ones(shape: &[usize], dtype: DType, device: &Device) -> Result<Self> {
        Self::full(1.0, shape, dtype, device)
    }

    /// A 0-d tensor holding `value`, on this tensor's device and of its dtype.
    pub fn scalar_like(&self, value: f64) -> Result<Self> {
        Self::full(value, &[], self.dtype(), self.device())
    }

    /// Downloads the elements in row-major order, converted to `T`.
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>> {
        let bytes = self.device().backend().download(self.view())?;
        Ok(dtype::from_bytes(&bytes, self.dtype()))
    }

    /// Starts downloading the elements (row-major) without waiting for the device; the
    /// [`PendingVec`] waits when read. Ops issued afterwards do not change what it reads.
    pub fn to_vec_async<T: Element>(&self) -> Result<PendingVec<T>> {
        Ok(PendingVec {
            download: self.device().backend().download_async(self.view())?,
            dtype: self.dtype(),
            element: PhantomData,
        })
    }

    /// Downloads the elements as f64 (exact for every dtype but i64 beyond 2^53).
    pub fn to_f64_vec(&self) -> Result<Vec<f64>> {
        self.to_vec::<f64>()
    }

    /// The single element of a one-element tensor.
    pub fn item(&self) -> Result<f64> {
        match self.to_f64_vec()?.as_slice() {
            [v] => Ok(*v),
            values => Err(TensorError::shape(format!(
                "item() needs one element, the tensor has shape {:?} ({} elements)",
                self.shape(),
                values.len()
            ))),
        }
    }

    pub fn shape(&self) -> &[usize] {
        self.0.layout.shape()
    }

    pub fn rank(&self) -> usize {
        self.0.layout.rank()
    }

    pub fn numel(&self) -> usize {
        self.0.layout.numel()
    }

    pub fn dtype(&self) -> DType {
        self.0.storage.dtype()
    }

    pub fn device(&self) -> &Device {
        &self.0.device
    }

    pub fn layout(&self) -> &Layout {
        &self.0.layout
    }

    pub fn storage(&self) -> &Arc<Storage> {
        &self.0.storage
    }

    /// The operand view backends take.
    pub fn view(&self) -> View<'_> {
        View {
            storage: &self.0.storage,
            layout: &self.0.layout,
        }
    }

    pub(crate) fn backend(&self) -> &dyn Backend {
        self.0.device.backend()
    }

    // --- autograd -----------------------------------------------------------------------

    /// Whether gradients flow to (or through) this tensor.
    pub fn requires_grad(&self) -> bool {
        self.0.requires_grad
    }

    /// A leaf sharing this tensor's data that does (or does not) require gradients.
    pub fn with_requires_grad(self, requires_grad: bool) -> Self {
        Self(Arc::new(Inner {
            storage: self.0.storage.clone(),
            layout: self.0.layout.clone(),
            device: self.0.device.clone(),
            requires_grad,
            node: None,
            grad: Mutex::new(None),
            grad_hook: Mutex::new(None),
        }))
    }

    /// The same data, off the tape.
    pub fn detach(&self) -> Self {
        Self::plain(
            self.0.storage.clone(),
            self.0.layout.clone(),
            self.0.device.clone(),
        )
    }

    /// Whether this tensor was made by the user rather than recorded by an op.
    pub fn is_leaf(&self) -> bool {
        self.0.node.is_none()
    }

    /// The accumulated gradient of a leaf, after `backward()`.
    pub fn grad(&self) -> Option<Tensor> {
        self.0
            .grad
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Sets (or with `None` removes) the hook a backward pass calls once it has accumulated
    /// this leaf's gradient: after every tensor that depends on the leaf has passed its
    /// gradient back, so `grad()` holds the pass's total. Shared by the leaf's clones (a
    /// module's parameter and the optimizer's handle are one tensor); a new leaf made by
    /// `with_requires_grad` or `detach` starts without one. Only a leaf that requires
    /// gradients can have one.
    pub fn set_grad_hook(&self, hook: Option<GradHook>) -> Result<()> {
        if !self.is_leaf() || !self.requires_grad() {
            return Err(TensorError::Autograd(format!(
                "a gradient hook on a {:?} tensor that is not a leaf requiring gradients",
                self.shape()
            )));
        }
        *self.0.grad_hook.lock().unwrap_or_else(|p| p.into_inner()) = hook;
        Ok(())
    }

    /// Runs the gradient-ready hook, if any (autograd, after accumulating).
    pub(crate) fn gradient_ready(&self) {
        let hook = self
            .0
            .grad_hook
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        if let Some(hook) = hook {
            hook(self);
        }
    }

    /// Clears the accumulated gradient.
    pub fn zero_grad(&self) {
        *self.0.grad.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }

    /// Backpropagates from this one-element tensor (gradient 1).
    pub fn backward(&self) -> Result<()> {
        if self.numel() != 1 {
            return Err(TensorError::Autograd(format!(
                "backward() without a gradient needs a one-element tensor, not shape {:?}",
                self.shape()
            )));
        }
        let one = Self::full(1.0, self.shape(), self.dtype(), self.device())?;
        autograd::backward(self, one)
    }

    /// Backpropagates `grad`, the gradient of this tensor (same shape).
    pub fn backward_with(&self, grad: &Tensor) -> Result<()> {
        if grad.shape() != self.shape() {
            return Err(TensorError::shape(format!(
                "backward_with: gradient of shape {:?} for a tensor of shape {:?}",
                grad.shape(),
                self.shape()
            )));
        }
        autograd::backward(self, grad.detach())
    }

    /// This tensor's identity: equal for clones of one handle, distinct for live tensors
    /// (used to key caches such as autocast's low-precision weight copies).
    pub fn key(&self) -> usize {
        Arc::as_ptr(&self.0) as usize
    }

    pub(crate) fn node(&self) -> Option<&Arc<Node>> {
        self.0.node.as_ref()
    }

    pub(crate) fn accumulate_grad(&self, grad: Tensor) -> Result<()> {
        let fresh = if grad.shape() == self.shape() && grad.dtype() == self.dtype() {
            grad.detach()
        } else {
            grad.sum_to(self.shape())?.cast(self.dtype())?.detach()
        };
        // The handle passed in shares the storage with `fresh`: let it go, so that a gradient
        // nothing else holds is kept as it is instead of copied (every parameter, every step).
        drop(grad);
        let grad = fresh;
        // A leaf's gradient is updated in place (unscaling, clipping, the optimizer ops read
        // it whole, element for element with the leaf): make sure it is a whole dense storage
        // in the leaf's own memory order (row-major for a leaf that is not dense) that nothing
        // else shares — the backward of `a + b` hands one tensor to both inputs.
        let (gl, want) = (grad.layout(), self.layout().output_like());
        let same_order =
            gl.strides() == want.strides() || (gl.is_contiguous() && want.is_contiguous());
        let owned = same_order
            && grad.storage().len() == grad.numel()
            && Arc::strong_count(grad.storage()) == 1;
        // The copy keeps the leaf's memory order (PyTorch's layout contract for a leaf's
        // gradient): a channels-last input's gradient stays channels-last — a straight copy,
        // not a transposing one.
        let grad = if owned {
            grad
        } else {
            grad.convert_to(grad.dtype(), want)?.detach()
        };
        let mut slot = self.0.grad.lock().unwrap_or_else(|p| p.into_inner());
        let total = match slot.take() {
            Some(previous) => previous.add(&grad)?.detach(),
            None => grad,
        };
        *slot = Some(total);
        Ok(())
    }

    /// This freshly computed tensor as the output of a differentiable function of `inputs`
    /// defined outside this crate (PyTorch's `autograd.Function`): when recording is on and an
    /// input requires gradients, backward calls `backward` with this output's gradient and
    /// takes one gradient per input (`None` where there is none). For operations the op set
    /// does not have — a sum over processes whose gradient is again a sum over processes
    /// (synchronised batch norm). The closure runs once, under `no_grad`.
    pub fn with_backward(
        self,
        name: &'static str,
        inputs: &[&Tensor],
        backward: impl FnOnce(&Tensor) -> Result<Vec<Option<Tensor>>> + Send + 'static,
    ) -> Self {
        self.detach().record(name, inputs, backward)
    }

    /// Records this freshly computed tensor on the tape as the output of `name` applied to
    /// `inputs`, when any of them requires grad and recording is on. `backward` is called with
    /// the output's gradient and returns one gradient per input.
    pub(crate) fn record(
        self,
        name: &'static str,
        inputs: &[&Tensor],
        backward: impl FnOnce(&Tensor) -> Result<Vec<Option<Tensor>>> + Send + 'static,
    ) -> Self {
        self.record_with_pending(name, inputs, move |g, _| backward(g))
    }

    /// [`record`](Self::record) for a backward that may add into gradients already waiting
    /// for its inputs ([`Pending`]).
    pub(crate) fn record_with_pending(
        self,
        name: &'static str,
        inputs: &[&Tensor],
        backward: impl FnOnce(&Tensor, &mut Pending<'_>) -> Result<Vec<Option<Tensor>>> + Send + 'static,
    ) -> Self {
        let needed = autograd::is_grad_enabled() && inputs.iter().any(|t| t.requires_grad());
        if !needed {
            return self;
        }
        let backward: BackwardFn = Box::new(backward);
        let node = Node::new(name, inputs.iter().map(|&t| t.clone()).collect(), backward);
        Self(Arc::new(Inner {
            storage: self.0.storage.clone(),
            layout: self.0.layout.clone(),
            device: self.0.device.clone(),
            requires_grad: true,
            node: Some(node),
            grad: Mutex::new(None),
            grad_hook: Mutex::new(None),
        }))
    }

    /// Whether this handle is the only one to this tensor and to its memory (no clone, view or
    /// detached copy shares it): what may be written in place unseen.
    pub(crate) fn is_sole_owner(&self) -> bool {
        Arc::strong_count(&self.0) == 1 && Arc::strong_count(&self.0.storage) == 1
    }

    /// A new tensor sharing this storage through `layout` (views).
    pub(crate) fn with_layout(&self, layout: Layout) -> Self {
        Self::plain(self.0.storage.clone(), layout, self.0.device.clone())
    }

    /// Errors unless `other` lives on the same device.
    pub(crate) fn same_device(&self, other: &Tensor, op: &str) -> Result<()> {
        if self.device() != other.device() {
            return Err(TensorError::Device(format!(
                "{op}: tensors on {} and {} (move one with to_device first)",
                self.device(),
                other.device()
            )));
        }
        Ok(())
    }

    /// Errors unless `other` has the same dtype.
    pub(crate) fn same_dtype(&self, other: &Tensor, op: &str) -> Result<()> {
        if self.dtype() != other.dtype() {
            return Err(TensorError::dtype(format!(
                "{op}: {} {:?} and {} {:?} (cast one first)",
                self.dtype(),
                self.shape(),
                other.dtype(),
                other.shape()
            )));
        }
        Ok(())
    }
}

impl fmt::Debug for Tensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Tensor({:?}, {}, {}{})",
            self.shape(),
            self.dtype(),
            self.device(),
            if self.requires_grad() {
                ", requires_grad"
            } else {
                ""
            }
        )
    }
}

/// A download in flight, from [`Tensor::to_vec_async`].
#[derive(Debug)]
pub struct PendingVec<T> {
    download: Download,
    dtype: DType,
    element: PhantomData<T>,
}

impl<T: Element> PendingVec<T> {
    /// The elements, once the copy has arrived (blocks until then).
    pub fn wait(self) -> Result<Vec<T>> {
        let bytes = self.download.wait()?;
        Ok(dtype::from_bytes(&bytes, self.dtype))
    }
}
