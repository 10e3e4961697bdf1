//! Launchers of `kernels/pool.cu`: max and average pooling and their gradients.

use redline_tensor::{DType, Layout, Pool2dParams, Result};

use crate::gpu::{DevicePtr, Gpu, KernelArgs, Strided};
use crate::kernels;
use crate::ops::elementwise::Operand;
use crate::ops::linear_shape;

/// The kernels' `PoolGeometry`: kernel, stride and padding as six i64.
fn geometry(args: KernelArgs, p: &Pool2dParams) -> KernelArgs {
    let [kh, kw] = p.kernel;
    let [sh, sw] = p.stride;
    let [ph, pw] = p.padding;
    let words: Vec<u8> = [kh, kw, sh, sw, ph, pw]
        .iter()
        .flat_map(|&v| (v as i64).to_ne_bytes())
        .collect();
    args.bytes(&words)
}

/// The kernels' `channels_inner`: whether the tensor a pooling kernel writes has its channels
/// fastest in memory (channels-last), so its threads walk it that way.
fn channels_inner(written: &Layout) -> i32 {
    (written.shape()[1] > 1 && written.strides()[1] == 1) as i32
}

/// The dense channels-last layout of `l`'s shape (every pooling operand is 4-d).
fn channels_last(l: &Layout) -> Layout {
    Layout::channels_last(l.shape()).unwrap_or_else(|_| Layout::contiguous(l.shape()))
}

/// Where the packed max-pool kernels may run: every operand (one float dtype) dense
/// channels-last at any offset, its channels a whole number of 16-byte packs, and each first
/// element 16-byte aligned. Their first elements' addresses and the packs a pixel has.
fn channels_last_packs(operands: &[&Operand; 2]) -> Option<([DevicePtr; 2], usize)> {
    let size = operands[0].dtype.size();
    let channels = operands[0].layout.shape()[1];
    let start = |o: &Operand| o.ptr.offset(o.layout.offset() * size);
    let fits = operands.iter().all(|o| {
        o.dtype == operands[0].dtype
            && o.layout.shape()[1] == channels
            && o.layout.strides_match(&channels_last(o.layout))
            && start(o).0.is_multiple_of(16)
    });
    let whole = size < 16 && channels > 0 && (channels * size).is_multiple_of(16);
    (fits && whole).then(|| (operands.map(start), channels * size / 16))
}

/// The packed kernels' sizes: packs, packs a pixel, the input's plane and the output's.
fn planes(
    args: KernelArgs,
    packs: usize,
    cols: usize,
    input: &Operand,
    output: &Operand,
) -> KernelArgs {
    let (i, o) = (input.layout.shape(), output.layout.shape());
    [packs, cols, i[2], i[3], o[2], o[3]]
        .iter()
        .fold(args, |args, &v| args.i64(v as i64))
}

fn strided(gpu: &dyn Gpu, o: &Operand, what: &str) -> Result<Strided> {
    Strided::new(o.layout, &gpu.name(), what)
}

/// Max pooling of `x` into `out`, the first maximum's flat in-plane position into `positions`
/// (i64, laid out as `out`).
pub fn max_pool2d(
    gpu: &dyn Gpu,
    x: &Operand,
    p: &Pool2dParams,
    out: &Operand,
    positions: DevicePtr,
) -> Result<()> {
    let n = out.layout.numel();
    if n == 0 {
        return Ok(());
    }
    if let Some(([from, to], cols)) = channels_last_packs(&[x, out]) {
        let at = positions.offset(out.layout.offset() * 8);
        let args = KernelArgs::new().ptr(from).ptr(to).ptr(at);
        let packs = n / (16 / x.dtype.size());
        let args = planes(args, packs, cols, x, out);
        let kernel = kernels::pool("max_pool2d_packed", x.dtype);
        return gpu.launch(&kernel, linear_shape(packs), &geometry(args, p));
    }
    let args = KernelArgs::new()
        .ptr(x.ptr)
        .strided(&strided(gpu, x, "max_pool2d")?)
        .ptr(out.ptr)
        .strided(&strided(gpu, out, "max_pool2d")?)
        .ptr(positions)
        .i64(n as i64)
        .i32(channels_inner(out.layout));
    let kernel = kernels::pool("max_pool2d", x.dtype);
    gpu.launch(&kernel, linear_shape(n), &geometry(args, p))
}

/// Average pooling of `x` into `out`.
pub fn avg_pool2d(gpu: &dyn Gpu, x: &Operand, p: &Pool2dParams, out: &Operand) -> Result<()> {
    let n = out.layout.numel();
    if n == 0 {
        return Ok(());
    }
    let args = KernelArgs::new()
        .ptr(x.ptr)
        .strided(&strided(gpu, x, "avg_pool2d")?)
        .ptr(out.ptr)
        .strided(&strided(gpu, out, "avg_pool2d")?)
        .i64(n as i64)
        .i32(channels_inner(out.layout));
    let kernel = kernels::pool("avg_pool2d", x.dtype);
    gpu.launch(&kernel, linear_shape(n), &geometry(args, p))
}

/// The input gradient of a pooling (`positions` for max pooling), written into `out`.
pub fn pool_grad(
    gpu: &dyn Gpu,
    dtype: DType,
    g: &Operand,
    positions: Option<&Operand>,
    p: &Pool2dParams,
    out: &Operand,
) -> Result<()> {
    let n = out.layout.numel();
    if n == 0 {
        return Ok(());
    }
    if let (Some(at), Some(([from, to], cols))) = (positions, channels_last_packs(&[g, out])) {
        if at.layout.strides_match(&channels_last(at.layout)) {
            let start = at.ptr.offset(at.layout.offset() * 8);
            let args = KernelArgs::new().ptr(from).ptr(start).ptr(to);
            let packs = n / (16 / dtype.size());
            let args = planes(args, packs, cols, out, g);
            let kernel = kernels::pool("max_pool2d_grad_packed", dtype);
            return gpu.launch(&kernel, linear_shape(packs), &geometry(args, p));
        }
    }
    let what = if positions.is_some() {
        "max_pool2d_grad"
    } else {
        "avg_pool2d_grad"
    };
    let mut args = KernelArgs::new()
        .ptr(g.ptr)
        .strided(&strided(gpu, g, what)?);
    if let Some(at) = positions {
        args = args.ptr(at.ptr).strided(&strided(gpu, at, what)?);
    }
    let args = args
        .ptr(out.ptr)
        .strided(&strided(gpu, out, what)?)
        .i64(n as i64)
        .i32(channels_inner(out.layout));
    gpu.launch(
        &kernels::pool(what, dtype),
        linear_shape(n),
        &geometry(args, p),
    )
}
