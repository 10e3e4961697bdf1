//! A deliberately broken backend: the reference with one op's results nudged. The conformance
//! suite must catch it — proof that the suite can fail.

use redline_tensor::backend::{
    AdamWParams, Backend, BatchNormCoefParams, BinaryOp, Conv2dParams, HostBytes, Op, Pool2dParams,
    ReduceOp, ScalerParams, SgdParams, Storage, UnaryOp, View,
};
use redline_tensor::reference::Reference;
use redline_tensor::{DType, Layout, Result};

/// Which op to break.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Nothing broken (combine with [`Broken::without`] to test refusals).
    None,
    /// `exp` returns `exp(x) * (1 + 1e-3)`: a forward error.
    ExpOffByATenthPercent,
    /// `sum` skips the last element of the first reduced axis: wrong forward, and wrong
    /// gradients wherever a backward sums (broadcast operands, matmul batches).
    SumDropsLastElement,
    /// Declares f16 `neg` but fails when asked to run it.
    RefusesDeclaredOp,
    /// Reports allocator statistics in which every binary op takes a new block from the
    /// device: a caching allocator that never caches.
    AllocatesEveryOp,
    /// Binary ops and casts write zero where their float result is subnormal, as a shader
    /// compiled to flush them does (declared with [`Broken::declaring_subnormal_flush`] or not).
    FlushesSubnormals,
}

/// The reference backend with `fault` injected.
#[derive(Debug)]
pub struct Broken {
    inner: Reference,
    fault: Fault,
    undeclared: Vec<DType>,
    /// Ops not declared for any dtype.
    hidden: Vec<Op>,
    /// Binary ops run (the allocations [`Fault::AllocatesEveryOp`] reports).
    binaries: std::sync::atomic::AtomicU64,
    /// Whether convolutions' input gradients are added in place, as the reference adds them.
    accumulates: bool,
    /// Input gradients added in place so far.
    accumulated: std::sync::atomic::AtomicU64,
    /// Whether it declares that it may flush subnormals.
    declares_flush: bool,
}

impl Broken {
    pub fn new(fault: Fault) -> Self {
        Self {
            inner: Reference::new(),
            fault,
            undeclared: Vec::new(),
            hidden: Vec::new(),
            binaries: Default::default(),
            accumulates: true,
            accumulated: Default::default(),
            declares_flush: false,
        }
    }

    /// Declares that it may flush subnormals of every dtype to zero, as a WGSL backend does.
    pub fn declaring_subnormal_flush(mut self) -> Self {
        self.declares_flush = true;
        self
    }

    /// `y` (of `out`'s layout) with its subnormal elements zeroed under
    /// [`Fault::FlushesSubnormals`].
    fn flushed(&self, y: Storage, out: &Layout) -> Result<Storage> {
        let dtype = y.dtype();
        if self.fault != Fault::FlushesSubnormals || !dtype.is_float() {
            return Ok(y);
        }
        let view = View {
            storage: &y,
            layout: out,
        };
        let mut bytes = self.inner.download(view)?;
        for i in 0..out.numel() {
            if dtype.is_subnormal(dtype.read(&bytes, i)) {
                dtype.write(&mut bytes, i, 0.0);
            }
        }
        // Back in `out`'s layout: the bytes are in row-major order.
        let flat = self.inner.upload(dtype, HostBytes::Owned(bytes))?;
        let row_major = Layout::contiguous(out.shape());
        let view = View {
            storage: &flat,
            layout: &row_major,
        };
        self.inner.convert(view, dtype, out)
    }

    /// Declines to add convolutions' input gradients in place (as a backend without cuDNN):
    /// the engine adds them.
    pub fn without_accumulation(mut self) -> Self {
        self.accumulates = false;
        self
    }

    /// How many convolution input gradients were added in place.
    pub fn accumulated(&self) -> u64 {
        self.accumulated.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Stops declaring `op` (as a backend without that kernel would: the front end composes
    /// it from other ops where it can).
    pub fn hiding(mut self, op: Op) -> Self {
        self.hidden.push(op);
        self
    }

    /// Stops declaring every op for `dtype` (as a backend without, say, f64 would).
    pub fn without(mut self, dtype: DType) -> Self {
        self.undeclared.push(dtype);
        self
    }
}

impl Backend for Broken {
    fn name(&self) -> String {
        format!("broken({:?})", self.fault)
    }
    fn id(&self) -> usize {
        self.inner.id()
    }
    fn supports(&self, op: Op, dtype: DType) -> bool {
        !self.undeclared.contains(&dtype)
            && !self.hidden.contains(&op)
            && self.inner.supports(op, dtype)
    }
    fn may_flush_subnormals(&self, dtype: DType) -> bool {
        self.declares_flush && dtype.is_float()
    }
    fn fill(&self, dtype: DType, len: usize, value: f64) -> Result<Storage> {
        self.inner.fill(dtype, len, value)
    }
    fn upload(&self, dtype: DType, bytes: HostBytes) -> Result<Storage> {
        self.inner.upload(dtype, bytes)
    }
    fn upload_into(&self, dst: &Storage, bytes: HostBytes) -> Result<()> {
        self.inner.upload_into(dst, bytes)
    }
    fn download(&self, x: View<'_>) -> Result<Vec<u8>> {
        self.inner.download(x)
    }
    fn synchronize(&self) -> Result<()> {
        self.inner.synchronize()
    }
    fn unary(&self, op: UnaryOp, x: View<'_>, out: &Layout) -> Result<Storage> {
        let y = self.inner.unary(op, x, out)?;
        match (self.fault, op) {
            (Fault::ExpOffByATenthPercent, UnaryOp::Exp) => {
                let factor = self.inner.fill(x.dtype(), 1, 1.001)?;
                let scalar = Layout::contiguous(&[]).broadcast_to(out.shape())?;
                let view = View {
                    storage: &y,
                    layout: out,
                };
                self.inner.binary(
                    BinaryOp::Mul,
                    view,
                    View {
                        storage: &factor,
                        layout: &scalar,
                    },
                    out,
                )
            }
            (Fault::RefusesDeclaredOp, UnaryOp::Neg) if x.dtype() == DType::F16 => {
                Err(redline_tensor::TensorError::Backend {
                    device: self.name(),
                    what: "f16 neg kernel missing".into(),
                })
            }
            _ => Ok(y),
        }
    }
    fn binary(&self, op: BinaryOp, a: View<'_>, b: View<'_>, out: &Layout) -> Result<Storage> {
        (self.binaries).fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let y = self.inner.binary(op, a, b, out)?;
        self.flushed(y, out)
    }
    fn memory_stats(&self) -> Option<redline_tensor::MemoryStats> {
        let n = self.binaries.load(std::sync::atomic::Ordering::Relaxed);
        (self.fault == Fault::AllocatesEveryOp).then_some(redline_tensor::MemoryStats {
            in_use: 0,
            reserved: n as usize * 512,
            peak_in_use: 512,
            device_allocations: n,
            reuses: 0,
        })
    }
    fn reduce(&self, op: ReduceOp, x: View<'_>, axes: &[usize]) -> Result<Storage> {
        if self.fault == Fault::SumDropsLastElement && op == ReduceOp::Sum && x.layout.numel() > 1 {
            // Sum over all but the last element of the first reduced axis.
            let axis = axes[0];
            let n = x.layout.shape()[axis];
            if n > 1 {
                let shorter = x.layout.narrow(axis, 0, n - 1)?;
                return self.inner.reduce(
                    op,
                    View {
                        storage: x.storage,
                        layout: &shorter,
                    },
                    axes,
                );
            }
        }
        self.inner.reduce(op, x, axes)
    }
    fn matmul(&self, a: View<'_>, b: View<'_>) -> Result<Storage> {
        self.inner.matmul(a, b)
    }
    fn select(&self, cond: View<'_>, a: View<'_>, b: View<'_>, out: &Layout) -> Result<Storage> {
        self.inner.select(cond, a, b, out)
    }
    fn convert(&self, x: View<'_>, dtype: DType, out: &Layout) -> Result<Storage> {
        let y = self.inner.convert(x, dtype, out)?;
        self.flushed(y, out)
    }
    fn copy_into(&self, dst: &Storage, at: &Layout, src: View<'_>) -> Result<()> {
        self.inner.copy_into(dst, at, src)
    }
    fn softmax(&self, x: View<'_>, axis: usize, log: bool, out: &Layout) -> Result<Storage> {
        self.inner.softmax(x, axis, log, out)
    }
    fn gather(&self, x: View<'_>, axis: usize, index: View<'_>) -> Result<Storage> {
        self.inner.gather(x, axis, index)
    }
    fn scatter_add(
        &self,
        dst: &Storage,
        shape: &[usize],
        axis: usize,
        index: View<'_>,
        src: View<'_>,
    ) -> Result<()> {
        self.inner.scatter_add(dst, shape, axis, index, src)
    }
    fn conv2d(&self, x: View<'_>, w: View<'_>, p: &Conv2dParams, out: &Layout) -> Result<Storage> {
        self.inner.conv2d(x, w, p, out)
    }
    fn conv2d_input_grad(
        &self,
        g: View<'_>,
        w: View<'_>,
        p: &Conv2dParams,
        out: &Layout,
    ) -> Result<Storage> {
        self.inner.conv2d_input_grad(g, w, p, out)
    }
    fn conv2d_input_grad_accumulate(
        &self,
        g: View<'_>,
        w: View<'_>,
        p: &Conv2dParams,
        into: &Storage,
        out: &Layout,
    ) -> Result<bool> {
        if !self.accumulates {
            return Ok(false);
        }
        let added = self
            .inner
            .conv2d_input_grad_accumulate(g, w, p, into, out)?;
        if added {
            self.accumulated
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        Ok(added)
    }
    fn conv2d_weight_grad(
        &self,
        x: View<'_>,
        g: View<'_>,
        p: &Conv2dParams,
        out: &Layout,
    ) -> Result<Storage> {
        self.inner.conv2d_weight_grad(x, g, p, out)
    }
    fn max_pool2d(
        &self,
        x: View<'_>,
        p: &Pool2dParams,
        out: &Layout,
    ) -> Result<(Storage, Storage)> {
        self.inner.max_pool2d(x, p, out)
    }
    fn avg_pool2d(&self, x: View<'_>, p: &Pool2dParams, out: &Layout) -> Result<Storage> {
        self.inner.avg_pool2d(x, p, out)
    }
    fn max_pool2d_grad(
        &self,
        g: View<'_>,
        positions: View<'_>,
        p: &Pool2dParams,
        out: &Layout,
    ) -> Result<Storage> {
        self.inner.max_pool2d_grad(g, positions, p, out)
    }

    fn avg_pool2d_grad(&self, g: View<'_>, p: &Pool2dParams, out: &Layout) -> Result<Storage> {
        self.inner.avg_pool2d_grad(g, p, out)
    }
    fn random_uniform(&self, dtype: DType, len: usize, seed: u64, offset: u64) -> Result<Storage> {
        self.inner.random_uniform(dtype, len, seed, offset)
    }
    fn random_uniform_at(
        &self,
        dtype: DType,
        len: usize,
        seed: u64,
        offset: View<'_>,
    ) -> Result<Storage> {
        self.inner.random_uniform_at(dtype, len, seed, offset)
    }
    fn normalize_input(
        &self,
        x: View<'_>,
        mean: &[f64],
        std: &[f64],
        dtype: DType,
        out: &Layout,
    ) -> Result<Storage> {
        self.inner.normalize_input(x, mean, std, dtype, out)
    }
    fn batch_norm_stats(
        &self,
        x: View<'_>,
        y: Option<View<'_>>,
        gate: Option<View<'_>>,
        centre: Option<View<'_>>,
    ) -> Result<Storage> {
        self.inner.batch_norm_stats(x, y, gate, centre)
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
        self.inner.batch_norm_apply(x, y, coef, relu, gate, out)
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
        self.inner
            .batch_norm_coef(sums, centre, weight, bias, running, p)
    }
    fn batch_norm_grad_coef(
        &self,
        sums: View<'_>,
        saved: View<'_>,
        weight: Option<View<'_>>,
        count: f64,
    ) -> Result<(Storage, Storage, Storage)> {
        self.inner.batch_norm_grad_coef(sums, saved, weight, count)
    }
    fn batch_norm_stats_coef(
        &self,
        x: View<'_>,
        weight: Option<View<'_>>,
        bias: Option<View<'_>>,
        running: Option<(&Storage, &Storage)>,
        p: &BatchNormCoefParams,
    ) -> Result<(Storage, Storage)> {
        self.inner
            .batch_norm_stats_coef(x, weight, bias, running, p)
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
        self.inner
            .batch_norm_grad_stats_coef(x, g, gate, saved, weight, count)
    }
    fn cross_entropy(
        &self,
        logits: View<'_>,
        targets: View<'_>,
        smoothing: f64,
        ignore_index: i64,
        grad: bool,
    ) -> Result<(Storage, Option<Storage>)> {
        (self.inner).cross_entropy(logits, targets, smoothing, ignore_index, grad)
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
        self.inner
            .sgd(params, grads, momentum, step, lr, p, found_inf)
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
        self.inner
            .adamw(params, grads, exp_avg, exp_avg_sq, step, lr, p, found_inf)
    }
    fn sum_squares(&self, tensors: &[&Storage]) -> Result<Storage> {
        self.inner.sum_squares(tensors)
    }
    fn unscale_check(
        &self,
        grads: &[&Storage],
        inv_scale: &Storage,
        found_inf: &Storage,
    ) -> Result<()> {
        self.inner.unscale_check(grads, inv_scale, found_inf)
    }
    fn scaler_update(
        &self,
        scale: &Storage,
        tracker: &Storage,
        found_inf: &Storage,
        p: &ScalerParams,
    ) -> Result<()> {
        self.inner.scaler_update(scale, tracker, found_inf, p)
    }
}
