//! Launchers of `kernels/norm.cu`: batch norm's per-channel sums and per-channel affine.

use redline_tensor::Result;

use crate::gpu::{DevicePtr, Gpu, KernelArgs, LaunchShape, Strided};
use crate::kernels;
use crate::ops::elementwise::Operand;
use crate::ops::linear_shape;

/// Threads per statistics block (`NORM_THREADS` in `kernels/norm.cu`).
const THREADS: u32 = 256;

/// (N, C, inner): batch, channels and elements per channel per sample of an [N, C, ..] shape.
fn split(shape: &[usize]) -> (usize, usize, usize) {
    let inner = shape[2..].iter().product::<usize>().max(1);
    (shape[0], shape[1], inner)
}

/// Packs an optional operand: its pointer and layout, or a null pointer and x's layout.
fn optional(
    args: KernelArgs,
    operand: Option<&Operand>,
    x: &Strided,
    device: &str,
) -> Result<KernelArgs> {
    Ok(match operand {
        Some(o) => args
            .ptr(o.ptr)
            .strided(&Strided::new(o.layout, device, "batch norm")?),
        None => args.ptr(DevicePtr(0)).strided(x),
    })
}

/// `[Σ other, Σ x·other]` per channel into the contiguous `[2, C]` at `out`.
pub fn stats(
    gpu: &dyn Gpu,
    x: &Operand,
    y: Option<&Operand>,
    gate: Option<DevicePtr>,
    out: DevicePtr,
) -> Result<()> {
    let (n, c, inner) = split(x.layout.shape());
    if c == 0 {
        return Ok(());
    }
    let device = gpu.name();
    let xs = Strided::new(x.layout, &device, "batch_norm_stats")?;
    let args = KernelArgs::new().ptr(x.ptr).strided(&xs);
    let args = optional(args, y, &xs, &device)?
        .ptr(gate.unwrap_or(DevicePtr(0)))
        .ptr(out)
        .i64(n as i64)
        .i64(c as i64)
        .i64(inner as i64);
    let kernel = kernels::batch_norm_stats(x.dtype, y.is_some(), gate.is_some());
    let blocks = c.min(1 << 16) as u32;
    gpu.launch(&kernel, LaunchShape::linear(blocks, THREADS), &args)
}

/// `coef[0]·x + coef[1] (+ coef[2]·y)`, then the ReLU where asked, into `out`.
pub fn apply(
    gpu: &dyn Gpu,
    x: &Operand,
    y: Option<&Operand>,
    coef: DevicePtr,
    relu: bool,
    gate: Option<DevicePtr>,
    out: &Operand,
) -> Result<()> {
    let total = x.layout.numel();
    if total == 0 {
        return Ok(());
    }
    let (_, c, inner) = split(x.layout.shape());
    let device = gpu.name();
    let xs = Strided::new(x.layout, &device, "batch_norm_apply")?;
    let args = KernelArgs::new().ptr(x.ptr).strided(&xs);
    let args = optional(args, y, &xs, &device)?
        .ptr(coef)
        .ptr(gate.unwrap_or(DevicePtr(0)))
        .ptr(out.ptr)
        .strided(&Strided::new(out.layout, &device, "batch_norm_apply")?)
        .i64(total as i64)
        .i64(c as i64)
        .i64(inner as i64);
    let kernel = kernels::batch_norm_apply(x.dtype, y.is_some(), relu, gate.is_some());
    gpu.launch(&kernel, linear_shape(total), &args)
}

/// Batch norm's forward coefficients (a thread per channel): `coef` `[3, C]` and `saved`
/// `[2, C]` from `sums`, the running statistics updated in place; absent operands are null.
#[allow(clippy::too_many_arguments)]
pub fn coef(
    gpu: &dyn Gpu,
    stats: redline_tensor::DType,
    c: usize,
    sums: DevicePtr,
    weight: Option<DevicePtr>,
    bias: Option<DevicePtr>,
    running: Option<(DevicePtr, DevicePtr)>,
    out: (DevicePtr, DevicePtr),
    p: &redline_tensor::BatchNormCoefParams,
) -> Result<()> {
    if c == 0 {
        return Ok(());
    }
    let null = DevicePtr(0);
    let (mean, var) = running.unwrap_or((null, null));
    let args = KernelArgs::new()
        .ptr(sums)
        .ptr(weight.unwrap_or(null))
        .ptr(bias.unwrap_or(null))
        .ptr(mean)
        .ptr(var)
        .ptr(out.0)
        .ptr(out.1)
        .f64(p.count)
        .f64(p.eps)
        .f64(p.momentum)
        .i64(i64::from(p.residual))
        .i64(c as i64);
    let kernel = kernels::batch_norm_coef(stats, false);
    gpu.launch(&kernel, linear_shape(c), &args)
}

/// Batch norm's backward coefficients (a thread per channel): `coef` `[3, C]`, `dw`, `db`.
#[allow(clippy::too_many_arguments)]
pub fn grad_coef(
    gpu: &dyn Gpu,
    stats: redline_tensor::DType,
    c: usize,
    sums: DevicePtr,
    saved: DevicePtr,
    weight: Option<DevicePtr>,
    out: (DevicePtr, DevicePtr, DevicePtr),
    count: f64,
) -> Result<()> {
    if c == 0 {
        return Ok(());
    }
    let args = KernelArgs::new()
        .ptr(sums)
        .ptr(saved)
        .ptr(weight.unwrap_or(DevicePtr(0)))
        .ptr(out.0)
        .ptr(out.1)
        .ptr(out.2)
        .f64(count)
        .i64(c as i64);
    let kernel = kernels::batch_norm_coef(stats, true);
    gpu.launch(&kernel, linear_shape(c), &args)
}
