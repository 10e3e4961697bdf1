//! Launchers of `kernels/elementwise.cu`: unary, binary, select, convert (and copy_into), fill.

use redline_tensor::{BinaryOp, DType, Layout, Result, UnaryOp};

use crate::gpu::{DevicePtr, Gpu, KernelArgs, Strided};
use crate::kernels;
use crate::ops::linear_shape;

/// An operand: its base pointer and its layout (offsets in elements).
pub struct Operand<'a> {
    pub ptr: DevicePtr,
    pub dtype: DType,
    pub layout: &'a Layout,
}

impl Operand<'_> {
    fn strided(&self, gpu: &dyn Gpu, what: &str) -> Result<Strided> {
        Strided::new(self.layout, &gpu.name(), what)
    }
}

pub fn unary(gpu: &dyn Gpu, op: UnaryOp, x: &Operand, out: &Operand) -> Result<()> {
    let n = out.layout.numel();
    if n == 0 {
        return Ok(());
    }
    let args = KernelArgs::new()
        .ptr(x.ptr)
        .strided(&x.strided(gpu, op.name())?)
        .ptr(out.ptr)
        .strided(&out.strided(gpu, op.name())?)
        .i64(n as i64);
    gpu.launch(&kernels::unary(x.dtype, op), linear_shape(n), &args)
}

pub fn binary(gpu: &dyn Gpu, op: BinaryOp, a: &Operand, b: &Operand, out: &Operand) -> Result<()> {
    let n = out.layout.numel();
    if n == 0 {
        return Ok(());
    }
    let args = KernelArgs::new()
        .ptr(a.ptr)
        .strided(&a.strided(gpu, op.name())?)
        .ptr(b.ptr)
        .strided(&b.strided(gpu, op.name())?)
        .ptr(out.ptr)
        .strided(&out.strided(gpu, op.name())?)
        .i64(n as i64);
    gpu.launch(&kernels::binary(a.dtype, op), linear_shape(n), &args)
}

pub fn select(
    gpu: &dyn Gpu,
    cond: &Operand,
    a: &Operand,
    b: &Operand,
    out: &Operand,
) -> Result<()> {
    let n = out.layout.numel();
    if n == 0 {
        return Ok(());
    }
    let args = KernelArgs::new()
        .ptr(cond.ptr)
        .strided(&cond.strided(gpu, "where")?)
        .ptr(a.ptr)
        .strided(&a.strided(gpu, "where")?)
        .ptr(b.ptr)
        .strided(&b.strided(gpu, "where")?)
        .ptr(out.ptr)
        .strided(&out.strided(gpu, "where")?)
        .i64(n as i64);
    gpu.launch(&kernels::select(a.dtype), linear_shape(n), &args)
}

/// `out = x` converted to `out.dtype`, element by element in logical order: a cast, a relayout
/// into a dense layout, or a copy into part of an existing storage.
pub fn convert(gpu: &dyn Gpu, x: &Operand, out: &Operand) -> Result<()> {
    let n = out.layout.numel();
    if n == 0 {
        return Ok(());
    }
    let args = KernelArgs::new()
        .ptr(x.ptr)
        .strided(&x.strided(gpu, "convert")?)
        .ptr(out.ptr)
        .strided(&out.strided(gpu, "convert")?)
        .i64(n as i64);
    gpu.launch(
        &kernels::convert(x.dtype, out.dtype),
        linear_shape(n),
        &args,
    )
}

/// `len` elements at `out`, all `value` rounded to `dtype`.
pub fn fill(gpu: &dyn Gpu, dtype: DType, out: DevicePtr, len: usize, value: f64) -> Result<()> {
    if len == 0 {
        return Ok(());
    }
    let args = KernelArgs::new().ptr(out).i64(len as i64).f64(value);
    gpu.launch(&kernels::fill(dtype), linear_shape(len), &args)
}
