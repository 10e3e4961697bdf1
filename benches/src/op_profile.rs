//! Time per op on a synchronous backend: a [`Backend`] that forwards every call to another and
//! adds the call's wall time to a table keyed by op and shape (`bench-imagenet --profile-ops`).
//! Host timers are exact only where ops finish before they return (the CPU backend); on an
//! asynchronous device they time the enqueue.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use redline_tensor::backend::*;
use redline_tensor::{DType, Device, Layout, Result};

/// The wrapped backend and its table.
pub struct OpProfile {
    inner: Device,
    table: Mutex<HashMap<String, (u64, Duration)>>,
}

impl fmt::Debug for OpProfile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "OpProfile({})", self.inner.name())
    }
}

/// One row of [`OpProfile::rows`]: an op and shape, its calls and total time.
#[derive(Debug, Clone)]
pub struct OpRow {
    pub label: String,
    pub calls: u64,
    pub total: Duration,
}

fn conv_label(pass: &str, x: &[usize], w: &[usize], p: &Conv2dParams) -> String {
    format!(
        "conv {pass} {}->{} k{} s{} {}²",
        x[1], w[0], w[2], p.stride[0], x[2]
    )
}

impl OpProfile {
    /// A device whose every op is timed into the returned profile.
    pub fn wrap(inner: Device) -> (Device, Arc<OpProfile>) {
        let profile = Arc::new(OpProfile {
            inner,
            table: Mutex::default(),
        });
        (Device::new(profile.clone()), profile)
    }

    fn timed<R>(&self, label: impl FnOnce() -> String, f: impl FnOnce(&dyn Backend) -> R) -> R {
        let start = Instant::now();
        let out = f(self.inner.backend());
        let spent = start.elapsed();
        let mut table = self.table.lock().unwrap_or_else(|p| p.into_inner());
        let entry = table.entry(label()).or_default();
        entry.0 += 1;
        entry.1 += spent;
        out
    }

    /// Forgets what was timed so far (after warm-up steps).
    pub fn reset(&self) {
        self.table.lock().unwrap_or_else(|p| p.into_inner()).clear();
    }

    /// Every op and shape timed, the most time first.
    pub fn rows(&self) -> Vec<OpRow> {
        let table = self.table.lock().unwrap_or_else(|p| p.into_inner());
        let mut rows: Vec<OpRow> = table
            .iter()
            .map(|(label, &(calls, total))| OpRow {
                label: label.clone(),
                calls,
                total,
            })
            .collect();
        rows.sort_by(|a, b| b.total.cmp(&a.total).then(a.label.cmp(&b.label)));
        rows
    }
}

/// The batch-norm ops' label suffix: two operands, and gated.
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
    fn fill(&self, dtype: DType, len: usize, value: f64) -> Result<Storage> {
        self.timed(|| "fill".into(), |b| b.fill(dtype, len, value))
    }
    fn upload(&self, dtype: DType, bytes: HostBytes) -> Result<Storage> {
        self.timed(|| "upload".into(), |b| b.upload(dtype, bytes))
    }
    fn download(&self, x: View<'_>) -> Result<Vec<u8>> {
        self.timed(|| "download".into(), |b| b.download(x))
    }
    fn download_async(&self, x: View<'_>) -> Result<Download> {
        self.timed(|| "download".into(), |b| b.download_async(x))
    }
    fn synchronize(&self) -> Result<()> {
        self.inner.backend().synchronize()
    }
    fn timestamp(&self) -> Result<Option<Timestamp>> {
        self.inner.backend().timestamp()
    }
    fn read_timestamps(&self, stamps: &[Timestamp]) -> Result<Vec<u64>> {
        self.inner.backend().read_timestamps(stamps)
    }
    fn unary(&self, op: UnaryOp, x: View<'_>, out: &Layout) -> Result<Storage> {
        let label = || format!("{}{}", op.name(), dense(x.layout));
        self.timed(label, |b| b.unary(op, x, out))
    }
    fn binary(&self, op: BinaryOp, a: View<'_>, b: View<'_>, out: &Layout) -> Result<Storage> {
        let label = || format!("{}{}{}", op.name(), dense(a.layout), dense(b.layout));
        self.timed(label, |be| be.binary(op, a, b, out))
    }
    fn reduce(&self, op: ReduceOp, x: View<'_>, axes: &[usize]) -> Result<Storage> {
        self.timed(|| format!("reduce {op:?}"), |b| b.reduce(op, x, axes))
    }
    fn matmul(&self, a: View<'_>, b: View<'_>) -> Result<Storage> {
        let label = || format!("matmul {:?}x{:?}", a.layout.shape(), b.layout.shape());
        self.timed(label, |be| be.matmul(a, b))
    }
    fn select(&self, cond: View<'_>, a: View<'_>, b: View<'_>, out: &Layout) -> Result<Storage> {
        self.timed(|| "select".into(), |be| be.select(cond, a, b, out))
    }
    fn convert(&self, x: View<'_>, dtype: DType, out: &Layout) -> Result<Storage> {
        let label = || format!("convert {:?}->{dtype:?} {:?}", x.dtype(), x.layout.shape());
        self.timed(label, |b| b.convert(x, dtype, out))
    }
    fn copy_into(&self, dst: &Storage, at: &Layout, src: View<'_>) -> Result<()> {
        self.timed(|| "copy_into".into(), |b| b.copy_into(dst, at, src))
    }
    fn softmax(&self, x: View<'_>, axis: usize, log: bool, out: &Layout) -> Result<Storage> {
        self.timed(|| "softmax".into(), |b| b.softmax(x, axis, log, out))
    }
    fn gather(&self, x: View<'_>, axis: usize, index: View<'_>) -> Result<Storage> {
        self.timed(|| "gather".into(), |b| b.gather(x, axis, index))
    }
    fn scatter_add(
        &self,
        dst: &Storage,
        dst_shape: &[usize],
        axis: usize,
        index: View<'_>,
        src: View<'_>,
    ) -> Result<()> {
        let f = |b: &dyn Backend| b.scatter_add(dst, dst_shape, axis, index, src);
        self.timed(|| "scatter_add".into(), f)
    }
    fn conv2d(&self, x: View<'_>, w: View<'_>, p: &Conv2dParams, out: &Layout) -> Result<Storage> {
        let label = || conv_label("fwd", x.layout.shape(), w.layout.shape(), p);
        self.timed(label, |b| b.conv2d(x, w, p, out))
    }
    fn conv2d_input_grad(
        &self,
        g: View<'_>,
        w: View<'_>,
        p: &Conv2dParams,
        out: &Layout,
    ) -> Result<Storage> {
        let label = || conv_label("dx", out.shape(), w.layout.shape(), p);
        self.timed(label, |b| b.conv2d_input_grad(g, w, p, out))
    }
    fn conv2d_weight_grad(
        &self,
        x: View<'_>,
        g: View<'_>,
        p: &Conv2dParams,
        weight_shape: &[usize],
    ) -> Result<Storage> {
        let label = || conv_label("dw", x.layout.shape(), weight_shape, p);
        self.timed(label, |b| b.conv2d_weight_grad(x, g, p, weight_shape))
    }
    fn max_pool2d(
        &self,
        x: View<'_>,
        p: &Pool2dParams,
        out: &Layout,
    ) -> Result<(Storage, Storage)> {
        self.timed(|| "max_pool2d".into(), |b| b.max_pool2d(x, p, out))
    }
    fn max_pool2d_grad(
        &self,
        g: View<'_>,
        positions: View<'_>,
        p: &Pool2dParams,
        out: &Layout,
    ) -> Result<Storage> {
        let f = |b: &dyn Backend| b.max_pool2d_grad(g, positions, p, out);
        self.timed(|| "max_pool2d_grad".into(), f)
    }
    fn avg_pool2d(&self, x: View<'_>, p: &Pool2dParams, out: &Layout) -> Result<Storage> {
        self.timed(|| "avg_pool2d".into(), |b| b.avg_pool2d(x, p, out))
    }
    fn avg_pool2d_grad(&self, g: View<'_>, p: &Pool2dParams, out: &Layout) -> Result<Storage> {
        self.timed(
            || "avg_pool2d_grad".into(),
            |b| b.avg_pool2d_grad(g, p, out),
        )
    }
    fn random_uniform(&self, dtype: DType, len: usize, seed: u64, offset: u64) -> Result<Storage> {
        let f = |b: &dyn Backend| b.random_uniform(dtype, len, seed, offset);
        self.timed(|| "random_uniform".into(), f)
    }
    fn normalize_input(
        &self,
        x: View<'_>,
        mean: &[f64],
        std: &[f64],
        dtype: DType,
        out: &Layout,
    ) -> Result<Storage> {
        let f = |b: &dyn Backend| b.normalize_input(x, mean, std, dtype, out);
        self.timed(|| "normalize_input".into(), f)
    }
    fn batch_norm_stats(
        &self,
        x: View<'_>,
        y: Option<View<'_>>,
        gate: Option<View<'_>>,
    ) -> Result<Storage> {
        let label = || format!("batch_norm_stats{}", operands(y.is_some(), gate.is_some()));
        self.timed(label, |b| b.batch_norm_stats(x, y, gate))
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
        self.timed(label, |b| b.batch_norm_apply(x, y, coef, relu, gate, out))
    }
    fn sgd(
        &self,
        params: &[&Storage],
        grads: &[&Storage],
        momentum: &[&Storage],
        p: &SgdParams,
        found_inf: Option<&Storage>,
    ) -> Result<()> {
        let f = |b: &dyn Backend| b.sgd(params, grads, momentum, p, found_inf);
        self.timed(|| "sgd".into(), f)
    }
    fn adamw(
        &self,
        params: &[&Storage],
        grads: &[&Storage],
        exp_avg: &[&Storage],
        exp_avg_sq: &[&Storage],
        step: &Storage,
        p: &AdamWParams,
        found_inf: Option<&Storage>,
    ) -> Result<()> {
        let f = |b: &dyn Backend| b.adamw(params, grads, exp_avg, exp_avg_sq, step, p, found_inf);
        self.timed(|| "adamw".into(), f)
    }
    fn unscale_check(
        &self,
        grads: &[&Storage],
        inv_scale: &Storage,
        found_inf: &Storage,
    ) -> Result<()> {
        let f = |b: &dyn Backend| b.unscale_check(grads, inv_scale, found_inf);
        self.timed(|| "unscale_check".into(), f)
    }
    fn scaler_update(
        &self,
        scale: &Storage,
        growth_tracker: &Storage,
        found_inf: &Storage,
        p: &ScalerParams,
    ) -> Result<()> {
        let f = |b: &dyn Backend| b.scaler_update(scale, growth_tracker, found_inf, p);
        self.timed(|| "scaler_update".into(), f)
    }
}
