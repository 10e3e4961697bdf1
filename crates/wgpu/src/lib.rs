//! The wgpu backend: redline's op set as WGSL compute kernels on Vulkan, Metal or DX12 — and on
//! software Vulkan (Mesa lavapipe), which is how CI tests it.
//!
//! * One queue per device; ops are encoded into a pending command encoder and submitted in
//!   batches (`OPS_PER_SUBMIT`), so a step is a few submits, not hundreds.
//! * Storage buffers come from a size-class pool and go back when their tensor is dropped: the
//!   steady state creates no buffers. Op parameters go into one ring per batch.
//! * Kernels are WGSL templates specialised by dtype and tile size (`shader.rs`), compiled once
//!   per variant and cached.
//! * f32 everywhere; f16 where the adapter offers `SHADER_F16`; u8 (packed), i32 and i64 (two
//!   words) for masks, indices and data movement. Every kernel computes in f32.
//!
//! f32 and f16 declare every op; the integer dtypes declare what masks, indices and data
//! movement need. Convolution runs as implicit GEMM (forward, backward-data, backward-filter) on
//! the same tiled GEMM template as matmul.

mod context;
mod kernels;
mod shader;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use redline_tensor::backend::{
    AdamWParams, Backend, BatchNormCoefParams, BinaryOp, Conv2dParams, Download, HostBytes, Op,
    OtherOp, Pool2dParams, ReduceOp, ScalerParams, SgdParams, Storage, Timestamp, UnaryOp, View,
};
use redline_tensor::{DType, Device, Layout, Result, TensorError};

use context::{Context, PooledBuffer};
use kernels::elementwise::{self, Operand, Target};

static NEXT_ID: AtomicUsize = AtomicUsize::new(1);

/// What an adapter is, for choosing one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdapterSummary {
    pub name: String,
    pub backend: String,
    /// Mesa lavapipe / llvmpipe, SwiftShader, WARP: a CPU pretending to be a GPU.
    pub software: bool,
    pub f16: bool,
    /// The PCI vendor id (0x10DE NVIDIA, 0x1002 AMD, 0x8086 Intel; 0x10005 Mesa for lavapipe).
    pub vendor: u32,
}

/// Vulkan, Metal and DX12 (`WGPU_BACKEND` may choose others; GL's compute is too thin for us).
///
/// Mesa's implicit Vulkan layer `VK_LAYER_MESA_device_select` connects to Wayland to order the
/// GPUs, which on a headless machine prints "error: XDG_RUNTIME_DIR is invalid or not set" to
/// stderr twice — an error line that is no error. We rank adapters ourselves, so the layer is
/// turned off through its own switch (`NODEVICE_SELECT=1`) unless the user set it, once, before
/// the first Vulkan instance: the loader reads it then.
fn instance() -> wgpu::Instance {
    static QUIET: std::sync::Once = std::sync::Once::new();
    QUIET.call_once(|| {
        if std::env::var_os("NODEVICE_SELECT").is_none() {
            std::env::set_var("NODEVICE_SELECT", "1");
        }
    });
    wgpu::Instance::new(
        wgpu::InstanceDescriptor {
            backends: wgpu::Backends::PRIMARY,
            ..wgpu::InstanceDescriptor::new_without_display_handle()
        }
        .with_env(),
    )
}

fn summary(adapter: &wgpu::Adapter) -> AdapterSummary {
    let info = adapter.get_info();
    AdapterSummary {
        software: info.device_type == wgpu::DeviceType::Cpu,
        name: info.name,
        backend: format!("{:?}", info.backend),
        f16: adapter.features().contains(wgpu::Features::SHADER_F16),
        vendor: info.vendor,
    }
}

/// Every adapter wgpu can see (hardware first).
pub fn adapters() -> Vec<AdapterSummary> {
    let mut all: Vec<AdapterSummary> =
        pollster::block_on(instance().enumerate_adapters(wgpu::Backends::all()))
            .iter()
            .map(summary)
            .collect();
    all.sort_by_key(|a| a.software);
    all
}

/// The wgpu backend on one adapter.
#[derive(Debug)]
pub struct WgpuBackend {
    ctx: Context,
    id: usize,
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.name())
    }
}

impl WgpuBackend {
    /// The first adapter whose summary satisfies `pick` (e.g. `|a| !a.software`).
    pub fn new(pick: impl Fn(&AdapterSummary) -> bool) -> Result<Self> {
        let adapters = pollster::block_on(instance().enumerate_adapters(wgpu::Backends::all()));
        let mut ranked: Vec<&wgpu::Adapter> =
            adapters.iter().filter(|a| pick(&summary(a))).collect();
        ranked.sort_by_key(|a| summary(a).software);
        let adapter = ranked.first().ok_or_else(|| TensorError::Device(format!(
            "no wgpu adapter matches (found: {:?}); on Linux without a GPU, `apt-get install mesa-vulkan-drivers libvulkan1` gives the software one",
            adapters.iter().map(|a| summary(a).name).collect::<Vec<_>>()
        )))?;
        Ok(Self {
            ctx: Context::new(adapter)?,
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed) | (2 << 48),
        })
    }

    /// A device on the best adapter: hardware if any, else software.
    pub fn best() -> Result<Device> {
        Ok(Device::new(Arc::new(Self::new(|_| true)?)))
    }

    /// What this backend runs on.
    pub fn adapter(&self) -> AdapterSummary {
        AdapterSummary {
            name: self.ctx.info.name.clone(),
            backend: format!("{:?}", self.ctx.info.backend),
            software: self.ctx.info.device_type == wgpu::DeviceType::Cpu,
            f16: self.ctx.f16,
            vendor: self.ctx.info.vendor,
        }
    }

    fn buffer<'a>(&self, s: &'a Storage) -> Result<&'a wgpu::Buffer> {
        s.downcast::<PooledBuffer>(self.id)
            .map(PooledBuffer::buffer)
            .ok_or_else(|| {
                TensorError::Device(format!(
                    "a storage from another device was given to {}",
                    self.ctx.name()
                ))
            })
    }

    fn operand<'a>(&self, v: View<'a>) -> Result<Operand<'a>> {
        Ok(Operand {
            buffer: self.buffer(v.storage)?,
            layout: v.layout,
            dtype: v.dtype(),
        })
    }

    fn wrap(&self, buffer: PooledBuffer, dtype: DType, len: usize) -> Storage {
        Storage::new(dtype, len, self.id, buffer)
    }

    fn elementwise(
        &self,
        expr: &str,
        inputs: &[View<'_>],
        out: &Layout,
        dtype: DType,
        scalar: f32,
    ) -> Result<Storage> {
        let operands = inputs
            .iter()
            .map(|v| self.operand(*v))
            .collect::<Result<Vec<_>>>()?;
        let buffer = elementwise::run(&self.ctx, expr, &operands, out, dtype, scalar, Target::New)?
            .ok_or_else(|| self.ctx.fail("no output buffer"))?;
        Ok(self.wrap(buffer, dtype, out.storage_extent().max(out.numel())))
    }

    /// A contiguous operand's buffer and first element (the coefficient ops' operands, the
    /// loss's targets).
    fn dense<'a>(&self, v: View<'a>) -> Result<kernels::norm::Operand<'a>> {
        if !v.layout.is_contiguous() {
            return Err(TensorError::Shape(format!(
                "{}: an operand that must be contiguous has shape {:?} and strides {:?}",
                self.name(),
                v.layout.shape(),
                v.layout.strides()
            )));
        }
        Ok((self.buffer(v.storage)?, v.layout.offset()))
    }

    /// A new contiguous storage of `len` elements of `dtype`.
    fn empty(&self, dtype: DType, len: usize) -> Storage {
        let buffer = self.ctx.alloc(shader::storage_bytes(dtype, len.max(1)));
        self.wrap(buffer, dtype, len)
    }

    fn triple<'a>(&self, v: View<'a>) -> Result<(&'a wgpu::Buffer, &'a Layout, DType)> {
        Ok((self.buffer(v.storage)?, v.layout, v.dtype()))
    }

    fn unsupported<T>(&self, op: Op, dtype: DType) -> Result<T> {
        Err(TensorError::Unsupported {
            op,
            dtype,
            device: self.name(),
        })
    }

    fn float(&self, dtype: DType) -> bool {
        dtype == DType::F32 || (dtype == DType::F16 && self.ctx.f16)
    }

    /// `k[0, c]·x + k[1, c]` per channel `c` in f32 (x widened, the coefficients as they are:
    /// a contiguous `[rows ≥ 2, C]` of the statistics dtype), stored once as `dtype` in layout
    /// `out`: batch norm's value, shared by `batch_norm_apply` and the gate of the backward ops
    /// so both compute it with the same kernel (the same bits). Rounding the coefficients to
    /// f16 first, as composing f16 ops did, moved the ReLU's threshold off the reference's and
    /// cancelled badly where a channel's mean is large against its spread.
    fn affine(&self, x: View<'_>, k: &Storage, out: &Layout, dtype: DType) -> Result<Storage> {
        let shape = x.layout.shape();
        let (a, b) = (channel_row(shape, 0), channel_row(shape, 1));
        let row = |layout| View { storage: k, layout };
        self.elementwise("a * b + c", &[x, row(&a), row(&b)], out, dtype, 0.0)
    }

    /// The batch-norm ops' second operand `y` masked by `gate` `[a; b]` (kept where
    /// `a·x + b > 0`, computed as `batch_norm_apply` computes its value — so open exactly
    /// where the forward's ReLU passed), in layout `out`. None without a gate.
    fn gated(
        &self,
        x: View<'_>,
        y: Option<View<'_>>,
        gate: Option<View<'_>>,
        out: &Layout,
    ) -> Result<Option<Storage>> {
        let (Some(y), Some(gate)) = (y, gate) else {
            return Ok(None);
        };
        let c = x.layout.shape()[1];
        let k = self.convert(gate, gate.dtype(), &Layout::contiguous(&[2, c]))?;
        let value = self.affine(x, &k, out, x.dtype())?;
        let value = View {
            storage: &value,
            layout: out,
        };
        self.binary(BinaryOp::ReluGrad, value, y, out).map(Some)
    }

    /// `s` as an optimizer kernel's scalar operand.
    fn scalar<'a>(&'a self, s: &'a Storage) -> Result<kernels::optim::Scalar<'a>> {
        Ok(kernels::optim::Scalar {
            buffer: self.buffer(s)?,
            dtype: s.dtype(),
        })
    }

    /// The step (counted here unless `found` is set), learning rate and flag of an update.
    fn step_scalars<'a>(
        &'a self,
        step: &'a Storage,
        lr: &'a Storage,
        found: &'a Storage,
    ) -> Result<kernels::optim::StepScalars<'a>> {
        let at = kernels::optim::StepScalars {
            step: self.scalar(step)?,
            lr: self.scalar(lr)?,
            found: self.scalar(found)?,
        };
        kernels::optim::count_step(&self.ctx, at.step, at.found)?;
        Ok(at)
    }
}

/// Row `r` of a contiguous `[rows, C]` coefficient tensor, broadcast over `shape` along axis 1.
fn channel_row(shape: &[usize], r: usize) -> Layout {
    let mut strides = vec![0; shape.len()];
    strides[1] = 1;
    Layout::new(shape.to_vec(), strides, r * shape[1])
}

impl Backend for WgpuBackend {
    fn name(&self) -> String {
        self.ctx.name()
    }

    fn id(&self) -> usize {
        self.id
    }

    /// WGSL lets any float result or input that is subnormal be flushed to zero. Lavapipe
    /// keeps them; NVIDIA's Vulkan driver has been seen to flush f16 ones in arithmetic
    /// (llvm/offload-test-suite#563), and naga cannot declare the float controls that ask
    /// to keep them.
    fn may_flush_subnormals(&self, dtype: DType) -> bool {
        self.float(dtype)
    }

    fn supports(&self, op: Op, dtype: DType) -> bool {
        if self.float(dtype) {
            return true;
        }
        match dtype {
            DType::U8 => {
                matches!(
                    op,
                    Op::Other(OtherOp::Convert | OtherOp::Fill | OtherOp::Select)
                ) || matches!(op, Op::Binary(b) if b.is_comparison())
            }
            DType::I32 | DType::I64 => matches!(
                op,
                Op::Other(OtherOp::Convert | OtherOp::Fill | OtherOp::Select | OtherOp::CopyInto)
            ),
            _ => false,
        }
    }

    fn fill(&self, dtype: DType, len: usize, value: f64) -> Result<Storage> {
        let out = Layout::contiguous(&[len]);
        self.elementwise("s", &[], &out, dtype, value as f32)
    }

    fn upload(&self, dtype: DType, bytes: HostBytes) -> Result<Storage> {
        if !shader::storable(dtype, self.ctx.f16) {
            return self.unsupported(Op::Other(OtherOp::Convert), dtype);
        }
        let len = bytes.len() / dtype.size();
        let buffer = self.ctx.upload(&bytes)?;
        // `write_buffer` has copied the bytes: a pooled host buffer goes back to its pool here.
        drop(bytes);
        Ok(self.wrap(buffer, dtype, len))
    }

    fn upload_into(&self, dst: &Storage, bytes: HostBytes) -> Result<()> {
        redline_tensor::backend::check_upload_into(self.name(), dst, &bytes)?;
        self.ctx.write(self.buffer(dst)?, &bytes)
    }

    fn download(&self, x: View<'_>) -> Result<Vec<u8>> {
        self.download_async(x)?.wait()
    }

    fn download_async(&self, x: View<'_>) -> Result<Download> {
        let bytes = x.layout.numel() * x.dtype().size();
        if x.layout.is_contiguous() {
            return self.ctx.read_async(self.buffer(x.storage)?, bytes as u64);
        }
        // The dense copy is enqueued first; its storage may be recycled once this returns,
        // since anything that reuses it is submitted after the read-back copy.
        let dense = Layout::contiguous(x.layout.shape());
        let copy = self.convert(x, x.dtype(), &dense)?;
        self.ctx.read_async(self.buffer(&copy)?, bytes as u64)
    }

    fn memory_stats(&self) -> Option<redline_tensor::MemoryStats> {
        Some(self.ctx.memory_stats())
    }

    fn synchronize(&self) -> Result<()> {
        self.ctx.wait()
    }

    fn timestamp(&self) -> Result<Option<Timestamp>> {
        Ok(self.ctx.timestamp().map(Timestamp))
    }

    fn read_timestamps(&self, stamps: &[Timestamp]) -> Result<Vec<u64>> {
        let slots: Vec<u32> = stamps.iter().map(|s| s.0).collect();
        self.ctx.read_timestamps(&slots)
    }

    fn unary(&self, op: UnaryOp, x: View<'_>, out: &Layout) -> Result<Storage> {
        self.elementwise(elementwise::unary_expr(op), &[x], out, x.dtype(), 0.0)
    }

    fn binary(&self, op: BinaryOp, a: View<'_>, b: View<'_>, out: &Layout) -> Result<Storage> {
        let dtype = if op.is_comparison() {
            DType::U8
        } else {
            a.dtype()
        };
        self.elementwise(elementwise::binary_expr(op), &[a, b], out, dtype, 0.0)
    }

    fn reduce(&self, op: ReduceOp, x: View<'_>, axes: &[usize]) -> Result<Storage> {
        let operand = self.operand(x)?;
        let buffer = kernels::reduce::run(&self.ctx, op, &operand, axes)?;
        let len = (0..x.layout.rank())
            .filter(|d| !axes.contains(d))
            .map(|d| x.layout.shape()[d])
            .product();
        let dtype = if op == ReduceOp::ArgMax {
            DType::I64
        } else {
            x.dtype()
        };
        Ok(self.wrap(buffer, dtype, len))
    }

    fn matmul(&self, a: View<'_>, b: View<'_>) -> Result<Storage> {
        let r = a.layout.rank();
        let batches: usize = a.layout.shape()[..r - 2].iter().product();
        if batches > 65_535 {
            return Err(TensorError::Shape(format!(
                "matmul: {batches} batches exceed one dispatch"
            )));
        }
        let (oa, ob) = (self.operand(a)?, self.operand(b)?);
        let buffer = kernels::matmul::run(&self.ctx, &oa, &ob, a.dtype())?;
        let len = batches * a.layout.shape()[r - 2] * b.layout.shape()[r - 1];
        Ok(self.wrap(buffer, a.dtype(), len))
    }

    fn select(&self, cond: View<'_>, a: View<'_>, b: View<'_>, out: &Layout) -> Result<Storage> {
        self.elementwise("select(c, b, a != 0.0)", &[cond, a, b], out, a.dtype(), 0.0)
    }

    fn convert(&self, x: View<'_>, dtype: DType, out: &Layout) -> Result<Storage> {
        self.elementwise("a", &[x], out, dtype, 0.0)
    }

    fn copy_into(&self, dst: &Storage, at: &Layout, src: View<'_>) -> Result<()> {
        if shader::atomic_output(dst.dtype()) {
            return self.unsupported(Op::Other(OtherOp::CopyInto), dst.dtype());
        }
        let operand = self.operand(src)?;
        let target = Target::Into(self.buffer(dst)?);
        elementwise::run(&self.ctx, "a", &[operand], at, dst.dtype(), 0.0, target)?;
        Ok(())
    }

    fn softmax(&self, x: View<'_>, axis: usize, log: bool, out: &Layout) -> Result<Storage> {
        let buffer = kernels::nn::softmax(&self.ctx, &self.operand(x)?, axis, log, out)?;
        Ok(self.wrap(buffer, x.dtype(), out.numel()))
    }

    fn gather(&self, x: View<'_>, axis: usize, index: View<'_>) -> Result<Storage> {
        let buffer =
            kernels::nn::gather(&self.ctx, &self.operand(x)?, axis, &self.operand(index)?)?;
        Ok(self.wrap(buffer, x.dtype(), index.layout.numel()))
    }

    fn scatter_add(
        &self,
        dst: &Storage,
        shape: &[usize],
        axis: usize,
        index: View<'_>,
        src: View<'_>,
    ) -> Result<()> {
        let target = (self.buffer(dst)?, shape, dst.dtype());
        kernels::nn::scatter_add(
            &self.ctx,
            target,
            axis,
            &self.operand(index)?,
            &self.operand(src)?,
        )
    }

    fn conv2d(&self, x: View<'_>, w: View<'_>, p: &Conv2dParams, out: &Layout) -> Result<Storage> {
        let buffer = kernels::conv::forward(&self.ctx, self.triple(x)?, self.triple(w)?, p, out)?;
        Ok(self.wrap(buffer, x.dtype(), out.numel()))
    }

    fn conv2d_input_grad(
        &self,
        g: View<'_>,
        w: View<'_>,
        p: &Conv2dParams,
        out: &Layout,
    ) -> Result<Storage> {
        let buffer =
            kernels::conv::input_grad(&self.ctx, self.triple(g)?, self.triple(w)?, p, out)?;
        Ok(self.wrap(buffer, g.dtype(), out.numel()))
    }

    fn conv2d_weight_grad(
        &self,
        x: View<'_>,
        g: View<'_>,
        p: &Conv2dParams,
        out: &Layout,
    ) -> Result<Storage> {
        let buffer =
            kernels::conv::weight_grad(&self.ctx, self.triple(x)?, self.triple(g)?, p, out)?;
        Ok(self.wrap(buffer, x.dtype(), out.numel()))
    }

    fn max_pool2d(
        &self,
        x: View<'_>,
        p: &Pool2dParams,
        out: &Layout,
    ) -> Result<(Storage, Storage)> {
        let (values, positions) = kernels::nn::pool(&self.ctx, &self.operand(x)?, p, out, true)?;
        let positions = positions.ok_or_else(|| self.ctx.fail("max pooling made no positions"))?;
        Ok((
            self.wrap(values, x.dtype(), out.numel()),
            self.wrap(positions, DType::I64, out.numel()),
        ))
    }

    fn avg_pool2d(&self, x: View<'_>, p: &Pool2dParams, out: &Layout) -> Result<Storage> {
        let (values, _) = kernels::nn::pool(&self.ctx, &self.operand(x)?, p, out, false)?;
        Ok(self.wrap(values, x.dtype(), out.numel()))
    }

    fn max_pool2d_grad(
        &self,
        g: View<'_>,
        positions: View<'_>,
        p: &Pool2dParams,
        out: &Layout,
    ) -> Result<Storage> {
        // A position outside its plane matches no input element: its gradient is dropped, as
        // nothing addresses it (the front end only passes positions its forward recorded).
        let at = self.operand(positions)?;
        let buffer = kernels::nn::pool_grad(&self.ctx, &self.operand(g)?, Some(&at), p, out)?;
        Ok(self.wrap(buffer, g.dtype(), out.numel()))
    }

    fn avg_pool2d_grad(&self, g: View<'_>, p: &Pool2dParams, out: &Layout) -> Result<Storage> {
        let buffer = kernels::nn::pool_grad(&self.ctx, &self.operand(g)?, None, p, out)?;
        Ok(self.wrap(buffer, g.dtype(), out.numel()))
    }

    fn random_uniform(&self, dtype: DType, len: usize, seed: u64, offset: u64) -> Result<Storage> {
        let buffer = kernels::nn::random_uniform(&self.ctx, dtype, len, seed, offset)?;
        Ok(self.wrap(buffer, dtype, len))
    }

    fn normalize_input(
        &self,
        x: View<'_>,
        mean: &[f64],
        std: &[f64],
        dtype: DType,
        out: &Layout,
    ) -> Result<Storage> {
        let buffer =
            kernels::nn::normalize_input(&self.ctx, &self.operand(x)?, mean, std, dtype, out)?;
        Ok(self.wrap(buffer, dtype, out.numel()))
    }

    /// Composed from this backend's own kernels, in f32: widen, multiply, reduce, pack.
    fn batch_norm_stats(
        &self,
        x: View<'_>,
        y: Option<View<'_>>,
        gate: Option<View<'_>>,
        centre: Option<View<'_>>,
    ) -> Result<Storage> {
        let shape = x.layout.shape().to_vec();
        let (c, dense) = (shape[1], Layout::contiguous(&shape));
        let gated = self.gated(x, y, gate, &dense)?;
        let y = match &gated {
            Some(storage) => Some(View {
                storage,
                layout: &dense,
            }),
            None => y,
        };
        let view = |s| View {
            storage: s,
            layout: &dense,
        };
        let xf = match centre {
            // x − k[c] in f32: the centre broadcast along every axis but the channels', 0 where
            // it is not finite (batch_norm_shift; NaN fails the comparison too).
            Some(k) => {
                let mut strides = vec![0; shape.len()];
                strides[1] = 1;
                let along = Layout::new(shape.clone(), strides, k.layout.offset());
                let k = View {
                    storage: k.storage,
                    layout: &along,
                };
                let centred = "a - select(0.0, b, abs(b) <= 3.4028235e38)";
                self.elementwise(centred, &[x, k], &dense, DType::F32, 0.0)?
            }
            None => self.convert(x, DType::F32, &dense)?,
        };
        let yf = y.map(|y| self.convert(y, DType::F32, &dense)).transpose()?;
        let other = view(yf.as_ref().unwrap_or(&xf));
        let product = self.binary(BinaryOp::Mul, view(&xf), other, &dense)?;
        let axes: Vec<usize> = (0..shape.len()).filter(|&a| a != 1).collect();
        let sums = [
            self.reduce(ReduceOp::Sum, other, &axes)?,
            self.reduce(ReduceOp::Sum, view(&product), &axes)?,
        ];
        let out = self.fill(DType::F32, 2 * c, 0.0)?;
        let row = Layout::contiguous(&[c]);
        for (r, sum) in sums.iter().enumerate() {
            let at = Layout::new(vec![c], vec![1], r * c);
            let src = View {
                storage: sum,
                layout: &row,
            };
            self.copy_into(&out, &at, src)?;
        }
        Ok(out)
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
        let dtype = sums.dtype();
        let c = sums.layout.numel() / 2;
        let (coef, saved) = (self.empty(dtype, 3 * c), self.empty(dtype, 2 * c));
        let running = match running {
            Some((m, v)) => Some((self.buffer(m)?, self.buffer(v)?, m.dtype())),
            None => None,
        };
        kernels::norm::batch_norm_coef(
            &self.ctx,
            dtype,
            c,
            self.dense(sums)?,
            centre.map(|k| self.dense(k)).transpose()?,
            weight.map(|w| self.dense(w)).transpose()?,
            bias.map(|b| self.dense(b)).transpose()?,
            running,
            self.buffer(&coef)?,
            self.buffer(&saved)?,
            p,
        )?;
        Ok((coef, saved))
    }

    fn batch_norm_grad_coef(
        &self,
        sums: View<'_>,
        saved: View<'_>,
        weight: Option<View<'_>>,
        count: f64,
    ) -> Result<(Storage, Storage, Storage)> {
        let dtype = sums.dtype();
        let c = sums.layout.numel() / 2;
        let coef = self.empty(dtype, 3 * c);
        let (dw, db) = (self.empty(dtype, c), self.empty(dtype, c));
        let outputs = [self.buffer(&coef)?, self.buffer(&dw)?, self.buffer(&db)?];
        kernels::norm::batch_norm_grad_coef(
            &self.ctx,
            dtype,
            c,
            count,
            self.dense(sums)?,
            self.dense(saved)?,
            weight.map(|w| self.dense(w)).transpose()?,
            outputs,
        )?;
        Ok((coef, dw, db))
    }

    /// Composed from this backend's elementwise kernels with per-channel broadcast views.
    fn batch_norm_apply(
        &self,
        x: View<'_>,
        y: Option<View<'_>>,
        coef: View<'_>,
        relu: bool,
        gate: Option<View<'_>>,
        out: &Layout,
    ) -> Result<Storage> {
        let gated = self.gated(x, y, gate, out)?;
        let y = match &gated {
            Some(storage) => Some(View {
                storage,
                layout: out,
            }),
            None => y,
        };
        let c = x.layout.shape()[1];
        let k = self.convert(coef, coef.dtype(), &Layout::contiguous(&[3, c]))?;
        let value = match y {
            None => self.affine(x, &k, out, x.dtype())?,
            // The residual's term added to the f32 value, then stored once.
            Some(y) => {
                let shifted = self.affine(x, &k, out, k.dtype())?;
                let shifted = View {
                    storage: &shifted,
                    layout: out,
                };
                let d = channel_row(x.layout.shape(), 2);
                let d = View {
                    storage: &k,
                    layout: &d,
                };
                self.elementwise("a + b * c", &[shifted, d, y], out, x.dtype(), 0.0)?
            }
        };
        if !relu {
            return Ok(value);
        }
        let value = View {
            storage: &value,
            layout: out,
        };
        self.unary(UnaryOp::Relu, value, out)
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
        let Some(first) = params.first() else {
            return Ok(());
        };
        let zero = self.fill(first.dtype(), 1, 0.0)?;
        let at = self.step_scalars(step, lr, found_inf.unwrap_or(&zero))?;
        for (i, param) in params.iter().enumerate() {
            let m = match momentum.get(i) {
                Some(m) if p.momentum != 0.0 => Some(self.buffer(m)?),
                _ => None,
            };
            let (pb, gb) = (self.buffer(param)?, self.buffer(grads[i])?);
            let dtype = param.dtype();
            kernels::optim::sgd(&self.ctx, dtype, pb, gb, m, &at, param.len(), p)?;
        }
        Ok(())
    }

    fn cross_entropy(
        &self,
        logits: View<'_>,
        targets: View<'_>,
        smoothing: f64,
        ignore_index: i64,
        grad: bool,
    ) -> Result<(Storage, Option<Storage>)> {
        let (dtype, numel) = (logits.dtype(), logits.layout.numel());
        let targets = self.dense(targets)?;
        let (loss, g) = kernels::loss::cross_entropy(
            &self.ctx,
            &self.operand(logits)?,
            targets,
            smoothing,
            ignore_index,
            grad,
        )?;
        Ok((
            self.wrap(loss, dtype, 1),
            g.map(|g| self.wrap(g, dtype, numel)),
        ))
    }

    fn sum_squares(&self, tensors: &[&Storage]) -> Result<Storage> {
        let dtype = tensors.first().map_or(DType::F32, |t| t.dtype());
        let sd = redline_tensor::stats_dtype(dtype);
        let buffers = (tensors.iter())
            .map(|t| Ok((self.buffer(t)?, t.len())))
            .collect::<Result<Vec<_>>>()?;
        let y = kernels::reduce::sum_squares(&self.ctx, dtype, &buffers, sd)?;
        Ok(self.wrap(y, sd, 1))
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
        let Some(first) = params.first() else {
            return Ok(());
        };
        let zero = self.fill(first.dtype(), 1, 0.0)?;
        let at = self.step_scalars(step, lr, found_inf.unwrap_or(&zero))?;
        for (i, param) in params.iter().enumerate() {
            let buffers = (
                self.buffer(param)?,
                self.buffer(grads[i])?,
                self.buffer(exp_avg[i])?,
                self.buffer(exp_avg_sq[i])?,
            );
            kernels::optim::adamw(
                &self.ctx,
                param.dtype(),
                buffers.0,
                buffers.1,
                buffers.2,
                buffers.3,
                &at,
                param.len(),
                p,
            )?;
        }
        Ok(())
    }

    fn unscale_check(
        &self,
        grads: &[&Storage],
        inv_scale: &Storage,
        found_inf: &Storage,
    ) -> Result<()> {
        let (inv, found) = (self.scalar(inv_scale)?, self.scalar(found_inf)?);
        for g in grads {
            kernels::optim::unscale_check(
                &self.ctx,
                g.dtype(),
                self.buffer(g)?,
                inv,
                found,
                g.len(),
            )?;
        }
        Ok(())
    }

    fn scaler_update(
        &self,
        scale: &Storage,
        tracker: &Storage,
        found_inf: &Storage,
        p: &ScalerParams,
    ) -> Result<()> {
        let (scale, tracker) = (self.scalar(scale)?, self.scalar(tracker)?);
        kernels::optim::scaler_update(&self.ctx, scale, tracker, self.scalar(found_inf)?, p)
    }
}

/// The README's example, compiled and run as a doctest.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
