//! The fast CPU backend: redline's op set on every core of the host.
//!
//! * Storages keep their dtype (f64, f32, f16, bf16, u8, i32, i64); kernels compute in f32 for
//!   f32/f16/bf16 and in f64 for f64 and integers, rounding once on store.
//! * GEMM is our AVX-512 / AVX2 kernel or matrixmultiply's (picked by measurement: see README);
//!   convolution runs on channels-last data as implicit GEMM (row pointers into the input, no
//!   im2col), Winograd F(4×4, 3×3) for 3×3 stride-1 layers ([`ConvAlgorithm`]), or tiled
//!   im2col and GEMM, forward and both gradients; elementwise ops walk strided views in runs;
//!   reductions walk the input in memory order.
//! * Threads: work is cut into fixed contiguous parts on scoped threads (`REDLINE_CPU_THREADS`,
//!   default every core). Partitions never depend on timing, so every run gives the same bits
//!   (DESIGN contract 9); reductions and GEMMs do not even depend on the thread count.
//! * Scratch (im2col tiles, partial sums) comes from a per-device arena and is reused.
//!
//! Ops run at once on the calling thread's schedule: `synchronize` has nothing to wait for.

mod arena;
mod buffer;
mod ops;
mod parallel;
mod sgemm;
mod strided;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};

use redline_tensor::backend::{
    AdamWParams, Backend, BatchNormCoefParams, BinaryOp, Conv2dParams, HostBytes, Op, Pool2dParams,
    ReduceOp, ScalerParams, SgdParams, Storage, UnaryOp, View,
};
use redline_tensor::{DType, Device, Layout, Result, TensorError};

use arena::Arena;
use buffer::{Buffer, Data};

static NEXT_ID: AtomicUsize = AtomicUsize::new(1);

/// The CPU backend. Each instance is its own device (with its own scratch arena).
#[derive(Debug)]
pub struct CpuBackend {
    id: usize,
    arena: Arena,
    conv: ConvAlgorithm,
}

/// How the backend computes the f32 convolutions Winograd's algorithm serves (3×3, stride 1,
/// no dilation, one group, at least 16 channels in and out) — the choice cuDNN and oneDNN
/// offer as `winograd` or `direct`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ConvAlgorithm {
    /// Winograd's F(4×4, 3×3) where it applies: a quarter of the multiplications, an f32
    /// rounding error a few times a direct convolution's (about 6·10⁻⁶ of the output's RMS at
    /// worst on ResNet-50's layers, against 2·10⁻⁷). The default.
    #[default]
    Winograd,
    /// Direct convolution (implicit GEMM or im2col) everywhere.
    Direct,
}

impl ConvAlgorithm {
    /// `REDLINE_CPU_CONV=direct` or `winograd`, else the default.
    pub fn from_env() -> Self {
        match std::env::var("REDLINE_CPU_CONV").as_deref() {
            Ok("direct") => Self::Direct,
            _ => Self::default(),
        }
    }
}

impl CpuBackend {
    /// A backend with the convolution algorithm of [`ConvAlgorithm::from_env`].
    pub fn new() -> Self {
        Self::with_conv_algorithm(ConvAlgorithm::from_env())
    }

    /// A backend that computes eligible convolutions with `conv`.
    pub fn with_conv_algorithm(conv: ConvAlgorithm) -> Self {
        Self {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed) | (2 << 48),
            arena: Arena::default(),
            conv,
        }
    }

    /// A device handle on a new CPU backend.
    pub fn device() -> Device {
        Device::new(Arc::new(Self::new()))
    }

    /// A device handle on a new CPU backend that uses `conv`.
    pub fn device_with(conv: ConvAlgorithm) -> Device {
        Device::new(Arc::new(Self::with_conv_algorithm(conv)))
    }

    /// Threads the backend splits work across.
    pub fn threads() -> usize {
        parallel::threads()
    }

    fn conv_setup(&self) -> ops::conv::Setup<'_> {
        ops::conv::Setup {
            arena: &self.arena,
            algorithm: self.conv,
        }
    }

    fn buffer<'a>(&self, s: &'a Storage) -> Result<&'a Buffer> {
        s.downcast::<Buffer>(self.id).ok_or_else(|| {
            TensorError::Device(format!(
                "a storage from another device ({s:?}) was given to the cpu backend"
            ))
        })
    }

    fn store(&self, data: Data) -> Storage {
        Storage::new(data.dtype(), data.len(), self.id, Buffer(RwLock::new(data)))
    }

    /// A (small) view's elements in logical order, as f64.
    fn f64s(&self, x: View<'_>) -> Result<Vec<f64>> {
        let data = self.buffer(x.storage)?.read();
        Ok(x.layout.indices().map(|at| data.get_f64(at)).collect())
    }
}

impl Default for CpuBackend {
    fn default() -> Self {
        Self::new()
    }
}

impl Backend for CpuBackend {
    fn name(&self) -> String {
        "cpu".into()
    }

    fn id(&self) -> usize {
        self.id
    }

    /// The reference's matrix (`redline_tensor::reference::host_matrix`).
    fn supports(&self, op: Op, dtype: DType) -> bool {
        redline_tensor::reference::host_matrix(op, dtype)
    }

    fn fill(&self, dtype: DType, len: usize, value: f64) -> Result<Storage> {
        Ok(self.store(Data::filled(dtype, len, value)))
    }

    fn upload(&self, dtype: DType, bytes: HostBytes) -> Result<Storage> {
        // Copied here; `bytes` (perhaps a pooled buffer) goes back when this returns.
        Ok(self.store(Data::from_le_bytes(dtype, &bytes)))
    }

    fn upload_into(&self, dst: &Storage, bytes: HostBytes) -> Result<()> {
        redline_tensor::backend::check_upload_into(self.name(), dst, &bytes)?;
        // Copied here, as `upload`; the storage handle (what a captured step holds) is kept.
        *self.buffer(dst)?.write() = Data::from_le_bytes(dst.dtype(), &bytes);
        Ok(())
    }

    fn download(&self, x: View<'_>) -> Result<Vec<u8>> {
        let data = self.buffer(x.storage)?.read();
        Ok(ops::elementwise::download(&data, x.layout))
    }

    fn synchronize(&self) -> Result<()> {
        Ok(())
    }

    fn unary(&self, op: UnaryOp, x: View<'_>, out: &Layout) -> Result<Storage> {
        let data = self.buffer(x.storage)?.read();
        Ok(self.store(ops::elementwise::unary(op, &data, x.layout, out)))
    }

    fn binary(&self, op: BinaryOp, a: View<'_>, b: View<'_>, out: &Layout) -> Result<Storage> {
        let (da, db) = (
            self.buffer(a.storage)?.read(),
            self.buffer(b.storage)?.read(),
        );
        Ok(self.store(ops::elementwise::binary(
            op, &da, a.layout, &db, b.layout, out,
        )))
    }

    fn reduce(&self, op: ReduceOp, x: View<'_>, axes: &[usize]) -> Result<Storage> {
        let data = self.buffer(x.storage)?.read();
        Ok(self.store(ops::reduce::reduce(op, &data, x.layout, axes)))
    }

    fn matmul(&self, a: View<'_>, b: View<'_>) -> Result<Storage> {
        let (da, db) = (
            self.buffer(a.storage)?.read(),
            self.buffer(b.storage)?.read(),
        );
        Ok(self.store(ops::matmul::matmul(&da, a.layout, &db, b.layout)))
    }

    fn select(&self, cond: View<'_>, a: View<'_>, b: View<'_>, out: &Layout) -> Result<Storage> {
        let dc = self.buffer(cond.storage)?.read();
        let (da, db) = (
            self.buffer(a.storage)?.read(),
            self.buffer(b.storage)?.read(),
        );
        Ok(self.store(ops::elementwise::select(
            &dc,
            cond.layout,
            &da,
            a.layout,
            &db,
            b.layout,
            out,
        )))
    }

    fn convert(&self, x: View<'_>, dtype: DType, out: &Layout) -> Result<Storage> {
        let data = self.buffer(x.storage)?.read();
        Ok(self.store(ops::elementwise::convert(&data, x.layout, dtype, out)))
    }

    fn copy_into(&self, dst: &Storage, at: &Layout, src: View<'_>) -> Result<()> {
        // Converted first, so `src` may be part of `dst` itself.
        let values = {
            let data = self.buffer(src.storage)?.read();
            ops::elementwise::convert(
                &data,
                src.layout,
                dst.dtype(),
                &Layout::contiguous(at.shape()),
            )
        };
        let mut target = self.buffer(dst)?.write();
        ops::elementwise::copy_into(&mut target, at, &values)
    }

    fn softmax(&self, x: View<'_>, axis: usize, log: bool, out: &Layout) -> Result<Storage> {
        let data = self.buffer(x.storage)?.read();
        Ok(self.store(ops::nn::softmax(&data, x.layout, axis, log, out)))
    }

    fn cross_entropy(
        &self,
        logits: View<'_>,
        targets: View<'_>,
        smoothing: f64,
        ignore_index: i64,
        grad: bool,
    ) -> Result<(Storage, Option<Storage>)> {
        // The reference's f64 formula: the logits are [N, C] with N a batch and C the classes,
        // small beside the convolutions that produced them.
        let x = self.f64s(logits)?;
        let t: Vec<i64> = self.f64s(targets)?.iter().map(|&v| v as i64).collect();
        let c = logits.layout.shape()[1];
        let (loss, g) = redline_tensor::scalar::cross_entropy(&x, &t, c, smoothing, ignore_index)?;
        let dtype = logits.dtype();
        let grad = grad.then(|| self.store(Data::from_f64s(dtype, &g)));
        Ok((self.store(Data::from_f64s(dtype, &[loss])), grad))
    }

    fn gather(&self, x: View<'_>, axis: usize, index: View<'_>) -> Result<Storage> {
        let (dx, di) = (
            self.buffer(x.storage)?.read(),
            self.buffer(index.storage)?.read(),
        );
        Ok(self.store(ops::nn::gather(&dx, x.layout, axis, &di, index.layout)?))
    }

    fn scatter_add(
        &self,
        dst: &Storage,
        dst_shape: &[usize],
        axis: usize,
        index: View<'_>,
        src: View<'_>,
    ) -> Result<()> {
        let idx = {
            let di = self.buffer(index.storage)?.read();
            ops::nn::checked_scatter_index(&di, index.layout, axis, dst_shape)?
        };
        // Read before the destination is locked: `src` may share its storage.
        let values = {
            let ds = self.buffer(src.storage)?.read();
            ops::elementwise::convert(
                &ds,
                src.layout,
                ds.dtype(),
                &Layout::contiguous(src.layout.shape()),
            )
        };
        let mut target = self.buffer(dst)?.write();
        let row_major = Layout::contiguous(index.layout.shape());
        ops::nn::scatter_add(
            &mut target,
            dst_shape,
            axis,
            &idx,
            index.layout.shape(),
            &values,
            &row_major,
        );
        Ok(())
    }

    fn conv2d(&self, x: View<'_>, w: View<'_>, p: &Conv2dParams, out: &Layout) -> Result<Storage> {
        let (dx, dw) = (
            self.buffer(x.storage)?.read(),
            self.buffer(w.storage)?.read(),
        );
        Ok(self.store(ops::conv::conv2d(
            self.conv_setup(),
            &dx,
            x.layout,
            &dw,
            w.layout,
            p,
            out,
        )))
    }

    fn conv2d_input_grad(
        &self,
        g: View<'_>,
        w: View<'_>,
        p: &Conv2dParams,
        out: &Layout,
    ) -> Result<Storage> {
        let (dg, dw) = (
            self.buffer(g.storage)?.read(),
            self.buffer(w.storage)?.read(),
        );
        Ok(self.store(ops::conv::conv2d_input_grad(
            self.conv_setup(),
            &dg,
            g.layout,
            &dw,
            w.layout,
            p,
            out,
        )))
    }

    fn conv2d_weight_grad(
        &self,
        x: View<'_>,
        g: View<'_>,
        p: &Conv2dParams,
        out: &Layout,
    ) -> Result<Storage> {
        let (dx, dg) = (
            self.buffer(x.storage)?.read(),
            self.buffer(g.storage)?.read(),
        );
        Ok(self.store(ops::conv::conv2d_weight_grad(
            self.conv_setup(),
            &dx,
            x.layout,
            &dg,
            g.layout,
            p,
            out,
        )))
    }

    fn max_pool2d(
        &self,
        x: View<'_>,
        p: &Pool2dParams,
        out: &Layout,
    ) -> Result<(Storage, Storage)> {
        let data = self.buffer(x.storage)?.read();
        let (values, at) = ops::pool::max_pool2d(&data, x.layout, p, out);
        Ok((self.store(values), self.store(at)))
    }

    fn avg_pool2d(&self, x: View<'_>, p: &Pool2dParams, out: &Layout) -> Result<Storage> {
        let data = self.buffer(x.storage)?.read();
        Ok(self.store(ops::pool::avg_pool2d(&data, x.layout, p, out)))
    }

    fn max_pool2d_grad(
        &self,
        g: View<'_>,
        positions: View<'_>,
        p: &Pool2dParams,
        out: &Layout,
    ) -> Result<Storage> {
        let plane = out.shape()[2] * out.shape()[3];
        let index = self.buffer(positions.storage)?.read();
        let data = self.buffer(g.storage)?.read();
        // Read in place when laid out as max_pool2d writes them (channels-last or row-major);
        // any other view is checked into a row-major copy.
        let row_major = Layout::contiguous(positions.layout.shape());
        let order = match ops::pool::is_channels_last(positions.layout) {
            true => positions.layout,
            false => &row_major,
        };
        let grad = match ops::nn::dense_in_range(&index, positions.layout, order, 2, plane)? {
            Some(at) => ops::pool::max_pool2d_grad(&data, g.layout, at, order, p, out),
            None => {
                let at = ops::nn::checked_index(&index, positions.layout, 2, plane)?;
                ops::pool::max_pool2d_grad(&data, g.layout, &at, &row_major, p, out)
            }
        };
        Ok(self.store(grad))
    }

    fn avg_pool2d_grad(&self, g: View<'_>, p: &Pool2dParams, out: &Layout) -> Result<Storage> {
        let data = self.buffer(g.storage)?.read();
        Ok(self.store(ops::pool::avg_pool2d_grad(&data, g.layout, p, out)))
    }

    fn random_uniform(&self, dtype: DType, len: usize, seed: u64, offset: u64) -> Result<Storage> {
        Ok(self.store(ops::nn::random_uniform(dtype, len, seed, offset)))
    }

    fn normalize_input(
        &self,
        x: View<'_>,
        mean: &[f64],
        std: &[f64],
        dtype: DType,
        out: &Layout,
    ) -> Result<Storage> {
        let data = self.buffer(x.storage)?.read();
        Ok(self.store(ops::nn::normalize_input(
            &data, x.layout, mean, std, dtype, out,
        )?))
    }

    fn batch_norm_stats(
        &self,
        x: View<'_>,
        y: Option<View<'_>>,
        gate: Option<View<'_>>,
        centre: Option<View<'_>>,
    ) -> Result<Storage> {
        let dx = self.buffer(x.storage)?.read();
        let dy = y
            .map(|y| self.buffer(y.storage).map(|b| b.read()))
            .transpose()?;
        let dg = gate
            .map(|g| self.buffer(g.storage).map(|b| b.read()))
            .transpose()?;
        let dk = centre
            .map(|k| self.buffer(k.storage).map(|b| b.read()))
            .transpose()?;
        let second = dy.as_deref().zip(y.map(|y| y.layout));
        let gate = dg.as_deref().zip(gate.map(|g| g.layout.offset()));
        let centre = dk.as_deref().zip(centre.map(|k| k.layout.offset()));
        Ok(self.store(ops::batch_norm::stats(&dx, x.layout, second, gate, centre)))
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
        let dx = self.buffer(x.storage)?.read();
        let dy = y
            .map(|y| self.buffer(y.storage).map(|b| b.read()))
            .transpose()?;
        let dc = self.buffer(coef.storage)?.read();
        let dg = gate
            .map(|g| self.buffer(g.storage).map(|b| b.read()))
            .transpose()?;
        let second = dy.as_deref().zip(y.map(|y| y.layout));
        let gate = dg.as_deref().zip(gate.map(|g| g.layout.offset()));
        Ok(self.store(ops::batch_norm::apply(
            &dx,
            x.layout,
            second,
            &dc,
            coef.layout.offset(),
            relu,
            gate,
            out,
        )))
    }

    // Batch norm's per-channel coefficients: C values, in f64 as the reference computes
    // them (no threads or SIMD: a few thousand flops).
    fn batch_norm_coef(
        &self,
        sums: View<'_>,
        centre: Option<View<'_>>,
        weight: Option<View<'_>>,
        bias: Option<View<'_>>,
        running: Option<(&Storage, &Storage)>,
        p: &BatchNormCoefParams,
    ) -> Result<(Storage, Storage)> {
        let sd = sums.dtype();
        let s = self.f64s(sums)?;
        let k = centre.map(|k| self.f64s(k)).transpose()?;
        let w = weight.map(|w| self.f64s(w)).transpose()?;
        let b = bias.map(|b| self.f64s(b)).transpose()?;
        let all = |st: &Storage| -> Result<Vec<f64>> {
            let data = self.buffer(st)?.read();
            Ok((0..data.len()).map(|i| data.get_f64(i)).collect())
        };
        let (coef, saved) = match running {
            Some((mean, var)) => {
                let (mut rm, mut rv) = (all(mean)?, all(var)?);
                let running = Some((&mut rm[..], &mut rv[..]));
                let out = p.host(&s, k.as_deref(), w.as_deref(), b.as_deref(), running);
                *self.buffer(mean)?.write() = Data::from_f64s(mean.dtype(), &rm);
                *self.buffer(var)?.write() = Data::from_f64s(var.dtype(), &rv);
                out
            }
            None => p.host(&s, k.as_deref(), w.as_deref(), b.as_deref(), None),
        };
        Ok((
            self.store(Data::from_f64s(sd, &coef)),
            self.store(Data::from_f64s(sd, &saved)),
        ))
    }

    fn batch_norm_grad_coef(
        &self,
        sums: View<'_>,
        saved: View<'_>,
        weight: Option<View<'_>>,
        count: f64,
    ) -> Result<(Storage, Storage, Storage)> {
        let sd = sums.dtype();
        let (s, kept) = (self.f64s(sums)?, self.f64s(saved)?);
        let w = weight.map(|w| self.f64s(w)).transpose()?;
        let (coef, dwdb) = BatchNormCoefParams::host_grad(count, &s, &kept, w.as_deref());
        let (dw, db) = dwdb.split_at(s.len() / 2);
        Ok((
            self.store(Data::from_f64s(sd, &coef)),
            self.store(Data::from_f64s(sd, dw)),
            self.store(Data::from_f64s(sd, db)),
        ))
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
        if self.flag_raised(found_inf)? {
            return Ok(());
        }
        let at = ops::optim::Rate {
            lr: ops::optim::scalar_of(&self.buffer(lr)?.read()) * p.lr_scale,
            step: self.count_step(step)?,
        };
        for (i, param) in params.iter().enumerate() {
            let grad = grads.get(i).ok_or_else(|| missing("sgd", "gradient", i))?;
            let buf = momentum.get(i).filter(|_| p.momentum != 0.0);
            distinct("sgd", i, &[Some(*param), Some(*grad), buf.copied()])?;
            let g = self.buffer(grad)?.read();
            let mut w = self.buffer(param)?.write();
            match buf {
                Some(b) => {
                    let mut m = self.buffer(b)?.write();
                    ops::optim::sgd(&mut w, &g, Some(&mut m), at, p);
                }
                None => ops::optim::sgd(&mut w, &g, None, at, p),
            }
        }
        Ok(())
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
        if self.flag_raised(found_inf)? {
            return Ok(());
        }
        let at = ops::optim::Rate {
            lr: ops::optim::scalar_of(&self.buffer(lr)?.read()) * p.lr_scale,
            step: self.count_step(step)?,
        };
        for (i, param) in params.iter().enumerate() {
            let grad = grads
                .get(i)
                .ok_or_else(|| missing("adamw", "gradient", i))?;
            let m = exp_avg
                .get(i)
                .ok_or_else(|| missing("adamw", "exp_avg", i))?;
            let v = exp_avg_sq
                .get(i)
                .ok_or_else(|| missing("adamw", "exp_avg_sq", i))?;
            distinct("adamw", i, &[Some(*param), Some(*grad), Some(*m), Some(*v)])?;
            let g = self.buffer(grad)?.read();
            let mut w = self.buffer(param)?.write();
            let (mut m, mut v) = (self.buffer(m)?.write(), self.buffer(v)?.write());
            ops::optim::adamw(&mut w, &g, &mut m, &mut v, at, p);
        }
        Ok(())
    }

    fn sum_squares(&self, tensors: &[&Storage]) -> Result<Storage> {
        // f64 accumulation, tensor by tensor (gradient clipping's norm: a read of each
        // gradient, parallel over the elements of the large ones).
        let mut sum = 0.0;
        for t in tensors {
            let data = self.buffer(t)?.read();
            sum += data.sum_squares();
        }
        let dtype = tensors.first().map_or(DType::F32, |t| t.dtype());
        let sd = redline_tensor::stats_dtype(dtype);
        Ok(self.store(Data::from_f64s(sd, &[sum])))
    }

    fn unscale_check(
        &self,
        grads: &[&Storage],
        inv_scale: &Storage,
        found_inf: &Storage,
    ) -> Result<()> {
        let inv = ops::optim::scalar_of(&self.buffer(inv_scale)?.read());
        let mut bad = false;
        for g in grads {
            bad |= ops::optim::unscale(&mut self.buffer(g)?.write(), inv);
        }
        if bad {
            ops::optim::set_scalar(&mut self.buffer(found_inf)?.write(), 1.0);
        }
        Ok(())
    }

    fn scaler_update(
        &self,
        scale: &Storage,
        growth_tracker: &Storage,
        found_inf: &Storage,
        p: &ScalerParams,
    ) -> Result<()> {
        let overflow = self.flag_raised(Some(found_inf))?;
        let mut tracker = self.buffer(growth_tracker)?.write();
        let (factor, next) = ops::optim::scaler_step(overflow, ops::optim::scalar_of(&tracker), p);
        let mut s = self.buffer(scale)?.write();
        let value = ops::optim::scalar_of(&s) * factor;
        ops::optim::set_scalar(&mut s, value);
        ops::optim::set_scalar(&mut tracker, next);
        ops::optim::set_scalar(&mut self.buffer(found_inf)?.write(), 0.0);
        Ok(())
    }
}

impl CpuBackend {
    /// Whether the optional found-inf flag is set.
    /// `step += 1` (an optimizer's count of applied steps); returns the new count.
    fn count_step(&self, step: &Storage) -> Result<f64> {
        let mut s = self.buffer(step)?.write();
        let t = ops::optim::scalar_of(&s) + 1.0;
        ops::optim::set_scalar(&mut s, t);
        Ok(t)
    }

    fn flag_raised(&self, flag: Option<&Storage>) -> Result<bool> {
        match flag {
            Some(f) => Ok(ops::optim::scalar_of(&self.buffer(f)?.read()) != 0.0),
            None => Ok(false),
        }
    }
}

fn missing(op: &str, what: &str, i: usize) -> TensorError {
    TensorError::Shape(format!("{op}: parameter {i} has no {what}"))
}

/// An in-place update needs distinct storages per parameter (one would be locked twice).
fn distinct(op: &str, i: usize, storages: &[Option<&Storage>]) -> Result<()> {
    let given: Vec<&Storage> = storages.iter().flatten().copied().collect();
    for (a, x) in given.iter().enumerate() {
        if given[a + 1..].iter().any(|y| std::ptr::eq(*x, *y)) {
            return Err(TensorError::Shape(format!(
                "{op}: parameter {i} shares a storage with its own gradient or state"
            )));
        }
    }
    Ok(())
}

/// The README's example, compiled and run as a doctest.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
