//! Launchers of `kernels/elementwise.cu`: unary, binary, select, convert (and copy_into), fill.

use redline_tensor::{BinaryOp, DType, Layout, Result, UnaryOp};

use crate::gpu::{DevicePtr, Gpu, KernelArgs, Strided};
use crate::kernels;
use crate::ops::{linear_shape, share_one_dense_order};

/// An operand: its base pointer and its layout (offsets in elements).
pub struct Operand<'a> {
    pub ptr: DevicePtr,
    pub dtype: DType,
    pub layout: &'a Layout,
}

/// Launches `kernel(op0, strided0, op1, strided1, …, n)` over `out`'s elements, the output
/// last — the parameter order every strided elementwise kernel declares. Operands that share
/// one dense order (a channels-last activation and its gradient, say) go as flat runs, so the
/// kernel walks memory in order instead of striding through it in logical order.
fn launch(gpu: &dyn Gpu, kernel: &str, what: &str, operands: &[&Operand]) -> Result<()> {
    let Some(out) = operands.last() else {
        return Ok(());
    };
    let n = out.layout.numel();
    if n == 0 {
        return Ok(());
    }
    let device = gpu.name();
    let layouts: Vec<&Layout> = operands.iter().map(|o| o.layout).collect();
    let flat = share_one_dense_order(&layouts);
    let mut args = KernelArgs::new();
    for operand in operands {
        let strided = match flat {
            true => Strided::contiguous(n, operand.layout.offset()),
            false => Strided::new(operand.layout, &device, what)?,
        };
        args = args.ptr(operand.ptr).strided(&strided);
    }
    gpu.launch(kernel, linear_shape(n), &args.i64(n as i64))
}

pub fn unary(gpu: &dyn Gpu, op: UnaryOp, x: &Operand, out: &Operand) -> Result<()> {
    launch(gpu, &kernels::unary(x.dtype, op), op.name(), &[x, out])
}

pub fn binary(gpu: &dyn Gpu, op: BinaryOp, a: &Operand, b: &Operand, out: &Operand) -> Result<()> {
    launch(gpu, &kernels::binary(a.dtype, op), op.name(), &[a, b, out])
}

pub fn select(
    gpu: &dyn Gpu,
    cond: &Operand,
    a: &Operand,
    b: &Operand,
    out: &Operand,
) -> Result<()> {
    launch(gpu, &kernels::select(a.dtype), "where", &[cond, a, b, out])
}

/// `out = x` converted to `out.dtype`, element by element in logical order: a cast, a relayout
/// into a dense layout, or a copy into part of an existing storage.
pub fn convert(gpu: &dyn Gpu, x: &Operand, out: &Operand) -> Result<()> {
    launch(
        gpu,
        &kernels::convert(x.dtype, out.dtype),
        "convert",
        &[x, out],
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
