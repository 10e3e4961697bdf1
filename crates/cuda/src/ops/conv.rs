//! 2-d convolution and its input and weight gradients: cuDNN through [`Gpu::conv`] where the
//! GPU has it and it takes the layouts, else the direct kernels of `kernels/conv.cu`.

use redline_tensor::{Conv2dParams, DType, Layout, Result};

use crate::convolution::{ConvPlan, Direction};
use crate::gpu::{DevicePtr, Gpu, KernelArgs, Strided};
use crate::kernels;
use crate::ops::elementwise::Operand;
use crate::ops::linear_shape;

/// The kernels' `ConvGeometry`: stride, padding, dilation and groups as seven i64.
fn geometry(args: KernelArgs, p: &Conv2dParams) -> KernelArgs {
    let words = [
        p.stride[0],
        p.stride[1],
        p.padding[0],
        p.padding[1],
        p.dilation[0],
        p.dilation[1],
        p.groups,
    ];
    let bytes: Vec<u8> = words
        .iter()
        .flat_map(|&v| (v as i64).to_ne_bytes())
        .collect();
    args.bytes(&bytes)
}

fn strided(gpu: &dyn Gpu, layout: &Layout, what: &str) -> Result<Strided> {
    Strided::new(layout, &gpu.name(), what)
}

/// `kernel(first, second, out, n, geometry)` over the `n` elements of `out_layout`.
fn launch(
    gpu: &dyn Gpu,
    kernel: &str,
    first: &Operand,
    second: &Operand,
    out: DevicePtr,
    out_layout: &Layout,
    p: &Conv2dParams,
) -> Result<()> {
    let n = out_layout.numel();
    if n == 0 {
        return Ok(());
    }
    let args = KernelArgs::new()
        .ptr(first.ptr)
        .strided(&strided(gpu, first.layout, kernel)?)
        .ptr(second.ptr)
        .strided(&strided(gpu, second.layout, kernel)?)
        .ptr(out)
        .strided(&strided(gpu, out_layout, kernel)?)
        .i64(n as i64);
    let name = kernels::conv(kernel, first.dtype);
    gpu.launch(&name, linear_shape(n), &geometry(args, p))
}

/// Through cuDNN when the GPU has it and it takes the plan: `[x, w, y]` in cuDNN's roles.
fn library(
    gpu: &dyn Gpu,
    direction: Direction,
    [x, w, y]: [(&Layout, DevicePtr); 3],
    dtype: DType,
    p: &Conv2dParams,
) -> Result<bool> {
    let Some(plan) = ConvPlan::new(dtype, direction, x.0, w.0, y.0, p) else {
        return Ok(false);
    };
    let first = |(l, ptr): (&Layout, DevicePtr)| ptr.offset(l.offset() * dtype.size());
    gpu.conv(&plan, [first(x), first(w), first(y)])
}

pub fn conv2d(
    gpu: &dyn Gpu,
    x: &Operand,
    w: &Operand,
    p: &Conv2dParams,
    out: &Operand,
) -> Result<()> {
    let roles = [(x.layout, x.ptr), (w.layout, w.ptr), (out.layout, out.ptr)];
    if library(gpu, Direction::Forward, roles, x.dtype, p)? {
        return Ok(());
    }
    launch(gpu, "conv2d", x, w, out.ptr, out.layout, p)
}

pub fn input_grad(
    gpu: &dyn Gpu,
    g: &Operand,
    w: &Operand,
    p: &Conv2dParams,
    out: &Operand,
) -> Result<()> {
    let roles = [(out.layout, out.ptr), (w.layout, w.ptr), (g.layout, g.ptr)];
    if library(gpu, Direction::InputGrad, roles, g.dtype, p)? {
        return Ok(());
    }
    launch(gpu, "conv2d_input_grad", g, w, out.ptr, out.layout, p)
}

/// Into the contiguous `weight_shape` at `out`.
pub fn weight_grad(
    gpu: &dyn Gpu,
    x: &Operand,
    g: &Operand,
    p: &Conv2dParams,
    weight_shape: &[usize],
    out: DevicePtr,
) -> Result<()> {
    let layout = Layout::contiguous(weight_shape);
    let roles = [(x.layout, x.ptr), (&layout, out), (g.layout, g.ptr)];
    if library(gpu, Direction::WeightGrad, roles, x.dtype, p)? {
        return Ok(());
    }
    launch(gpu, "conv2d_weight_grad", x, g, out, &layout, p)
}
