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
//! This first step covers the elementwise, reduction, GEMM, select and data-movement families;
//! the nn and optimizer families are not declared yet, so the front end refuses them with the
//! clear error and the conformance summary lists them.

mod context;
mod kernels;
mod shader;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use redline_tensor::backend::{
    AdamWParams, Backend, BinaryOp, Conv2dParams, HostBytes, Op, OtherOp, Pool2dParams, ReduceOp,
    ScalerParams, SgdParams, Storage, UnaryOp, View,
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
}

fn instance() -> wgpu::Instance {
    wgpu::Instance::new(wgpu::InstanceDescriptor::new_without_display_handle())
}

fn summary(adapter: &wgpu::Adapter) -> AdapterSummary {
    let info = adapter.get_info();
    AdapterSummary {
        software: info.device_type == wgpu::DeviceType::Cpu,
        name: info.name,
        backend: format!("{:?}", info.backend),
        f16: adapter.features().contains(wgpu::Features::SHADER_F16),
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
}

impl Backend for WgpuBackend {
    fn name(&self) -> String {
        self.ctx.name()
    }

    fn id(&self) -> usize {
        self.id
    }

    fn supports(&self, op: Op, dtype: DType) -> bool {
        if self.float(dtype) {
            return matches!(
                op,
                Op::Unary(_) | Op::Binary(_) | Op::Reduce(_) | Op::Other(_)
            );
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

    fn download(&self, x: View<'_>) -> Result<Vec<u8>> {
        let bytes = x.layout.numel() * x.dtype().size();
        if x.layout.is_contiguous() {
            return self.ctx.read(self.buffer(x.storage)?, bytes as u64);
        }
        let dense = Layout::contiguous(x.layout.shape());
        let copy = self.convert(x, x.dtype(), &dense)?;
        self.ctx.read(self.buffer(&copy)?, bytes as u64)
    }

    fn synchronize(&self) -> Result<()> {
        self.ctx.wait()
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

    // The nn and optimizer families are not implemented on wgpu yet; `supports` does not
    // declare them, so the front end never calls these.

    fn softmax(&self, x: View<'_>, _: usize, _: bool, _: &Layout) -> Result<Storage> {
        self.unsupported(Op::Nn(redline_tensor::NnOp::Softmax), x.dtype())
    }
    fn gather(&self, x: View<'_>, _: usize, _: View<'_>) -> Result<Storage> {
        self.unsupported(Op::Nn(redline_tensor::NnOp::Gather), x.dtype())
    }
    fn scatter_add(
        &self,
        dst: &Storage,
        _: &[usize],
        _: usize,
        _: View<'_>,
        _: View<'_>,
    ) -> Result<()> {
        self.unsupported(Op::Nn(redline_tensor::NnOp::ScatterAdd), dst.dtype())
    }
    fn conv2d(&self, x: View<'_>, _: View<'_>, _: &Conv2dParams, _: &Layout) -> Result<Storage> {
        self.unsupported(Op::Nn(redline_tensor::NnOp::Conv2d), x.dtype())
    }
    fn conv2d_input_grad(
        &self,
        g: View<'_>,
        _: View<'_>,
        _: &Conv2dParams,
        _: &Layout,
    ) -> Result<Storage> {
        self.unsupported(Op::Nn(redline_tensor::NnOp::Conv2dInputGrad), g.dtype())
    }
    fn conv2d_weight_grad(
        &self,
        x: View<'_>,
        _: View<'_>,
        _: &Conv2dParams,
        _: &[usize],
    ) -> Result<Storage> {
        self.unsupported(Op::Nn(redline_tensor::NnOp::Conv2dWeightGrad), x.dtype())
    }
    fn max_pool2d(&self, x: View<'_>, _: &Pool2dParams, _: &Layout) -> Result<(Storage, Storage)> {
        self.unsupported(Op::Nn(redline_tensor::NnOp::MaxPool2d), x.dtype())
    }
    fn avg_pool2d(&self, x: View<'_>, _: &Pool2dParams, _: &Layout) -> Result<Storage> {
        self.unsupported(Op::Nn(redline_tensor::NnOp::AvgPool2d), x.dtype())
    }
    fn avg_pool2d_grad(&self, g: View<'_>, _: &Pool2dParams, _: &Layout) -> Result<Storage> {
        self.unsupported(Op::Nn(redline_tensor::NnOp::AvgPool2dGrad), g.dtype())
    }
    fn random_uniform(&self, dtype: DType, _: usize, _: u64, _: u64) -> Result<Storage> {
        self.unsupported(Op::Nn(redline_tensor::NnOp::RandomUniform), dtype)
    }
    fn normalize_input(
        &self,
        _: View<'_>,
        _: &[f64],
        _: &[f64],
        dtype: DType,
        _: &Layout,
    ) -> Result<Storage> {
        self.unsupported(Op::Nn(redline_tensor::NnOp::NormalizeInput), dtype)
    }
    fn sgd(
        &self,
        params: &[&Storage],
        _: &[&Storage],
        _: &[&Storage],
        _: &SgdParams,
        _: Option<&Storage>,
    ) -> Result<()> {
        self.unsupported(
            Op::Optim(redline_tensor::OptimOp::Sgd),
            params.first().map_or(DType::F32, |p| p.dtype()),
        )
    }
    fn adamw(
        &self,
        params: &[&Storage],
        _: &[&Storage],
        _: &[&Storage],
        _: &[&Storage],
        _: &Storage,
        _: &AdamWParams,
        _: Option<&Storage>,
    ) -> Result<()> {
        self.unsupported(
            Op::Optim(redline_tensor::OptimOp::AdamW),
            params.first().map_or(DType::F32, |p| p.dtype()),
        )
    }
    fn unscale_check(&self, grads: &[&Storage], _: &Storage, _: &Storage) -> Result<()> {
        self.unsupported(
            Op::Optim(redline_tensor::OptimOp::UnscaleCheck),
            grads.first().map_or(DType::F32, |p| p.dtype()),
        )
    }
    fn scaler_update(
        &self,
        scale: &Storage,
        _: &Storage,
        _: &Storage,
        _: &ScalerParams,
    ) -> Result<()> {
        self.unsupported(
            Op::Optim(redline_tensor::OptimOp::ScalerUpdate),
            scale.dtype(),
        )
    }
}
