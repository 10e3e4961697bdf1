//! Launchers of the neural-network families without a library behind them: `softmax.cu`,
//! `index.cu` (gather, scatter-add), `random.cu` and `input.cu`.

use redline_tensor::{DType, Layout, Result, TensorError};

use crate::gpu::{DevicePtr, Gpu, KernelArgs, LaunchShape, Strided};
use crate::kernels;
use crate::ops::elementwise::Operand;
use crate::ops::linear_shape;

/// Threads per softmax block (`SOFTMAX_THREADS` in `kernels/softmax.cu`).
const SOFTMAX_THREADS: u32 = 256;

/// Channels the input op takes (`INPUT_MAX_CHANNELS` in `kernels/input.cu`).
const INPUT_MAX_CHANNELS: usize = 16;

fn strided(gpu: &dyn Gpu, layout: &Layout, what: &str) -> Result<Strided> {
    Strided::new(layout, &gpu.name(), what)
}

/// (Log-)softmax of `x` along `axis` into `out` (x's shape): a block per row.
pub fn softmax(gpu: &dyn Gpu, x: &Operand, axis: usize, log: bool, out: &Operand) -> Result<()> {
    let shape = x.layout.shape();
    let n = shape[axis];
    let inner: usize = shape[axis + 1..].iter().product();
    let rows = shape[..axis].iter().product::<usize>() * inner;
    if rows == 0 || n == 0 {
        return Ok(());
    }
    let what = if log { "log_softmax" } else { "softmax" };
    let args = KernelArgs::new()
        .ptr(x.ptr)
        .strided(&strided(gpu, x.layout, what)?)
        .ptr(out.ptr)
        .strided(&strided(gpu, out.layout, what)?)
        .i64(rows as i64)
        .i64(n as i64)
        .i64(inner as i64);
    let blocks = rows.min(1 << 16) as u32;
    let shape = LaunchShape::linear(blocks, SOFTMAX_THREADS);
    gpu.launch(&kernels::softmax(x.dtype, log), shape, &args)
}

/// Fused cross-entropy of logits `x` `[n, c]` against contiguous i64 `targets`: a block per
/// row writes its loss term into `rows` (n of the accumulation type) and, where `grad` is
/// given, its gradient; one block then writes the mean into `out` (one element of x's dtype).
#[allow(clippy::too_many_arguments)]
pub fn cross_entropy(
    gpu: &dyn Gpu,
    x: &Operand,
    targets: DevicePtr,
    smoothing: f64,
    ignore: i64,
    rows: DevicePtr,
    grad: Option<DevicePtr>,
    out: DevicePtr,
) -> Result<()> {
    let (n, c) = (x.layout.shape()[0], x.layout.shape()[1]);
    let args = KernelArgs::new()
        .ptr(x.ptr)
        .strided(&strided(gpu, x.layout, "cross_entropy")?)
        .ptr(targets)
        .i64(n as i64)
        .i64(c as i64)
        .f64(smoothing)
        .i64(ignore)
        .ptr(rows)
        .ptr(grad.unwrap_or(DevicePtr(0)));
    if n > 0 && c > 0 {
        let shape = LaunchShape::linear(n.min(1 << 16) as u32, SOFTMAX_THREADS);
        gpu.launch(
            &kernels::cross_entropy("cross_entropy_rows", x.dtype),
            shape,
            &args,
        )?;
    }
    let args = KernelArgs::new()
        .ptr(rows)
        .ptr(targets)
        .i64(n as i64)
        .i64(ignore)
        .ptr(out);
    let shape = LaunchShape::linear(1, SOFTMAX_THREADS);
    gpu.launch(
        &kernels::cross_entropy("cross_entropy_total", x.dtype),
        shape,
        &args,
    )
}

/// `out` (contiguous, index's shape) = x gathered along `axis` by `index` (i64).
pub fn gather(
    gpu: &dyn Gpu,
    x: &Operand,
    axis: usize,
    index: &Operand,
    out: DevicePtr,
) -> Result<()> {
    let n = index.layout.numel();
    if n == 0 {
        return Ok(());
    }
    let args = KernelArgs::new()
        .ptr(x.ptr)
        .strided(&strided(gpu, x.layout, "gather")?)
        .ptr(index.ptr)
        .strided(&strided(gpu, index.layout, "gather")?)
        .ptr(out)
        .i64(n as i64)
        .i32(axis as i32)
        .i64(x.layout.shape()[axis] as i64);
    gpu.launch(&kernels::gather(x.dtype), linear_shape(n), &args)
}

/// `dst[.., index[p], ..] += src[p]` along `axis`; dst is a whole contiguous `dst_shape`.
pub fn scatter_add(
    gpu: &dyn Gpu,
    dst: DevicePtr,
    dtype: DType,
    dst_shape: &[usize],
    axis: usize,
    index: &Operand,
    src: &Operand,
) -> Result<()> {
    let n: usize = dst_shape.iter().product();
    if n == 0 || index.layout.numel() == 0 {
        return Ok(());
    }
    let dst_layout = Layout::contiguous(dst_shape);
    let args = KernelArgs::new()
        .ptr(dst)
        .strided(&strided(gpu, &dst_layout, "scatter_add")?)
        .ptr(index.ptr)
        .strided(&strided(gpu, index.layout, "scatter_add")?)
        .ptr(src.ptr)
        .strided(&strided(gpu, src.layout, "scatter_add")?)
        .i64(n as i64)
        .i32(axis as i32);
    gpu.launch(&kernels::scatter_add(dtype), linear_shape(n), &args)
}

/// `len` uniform numbers of the Philox stream of `seed` from element `offset`.
/// `len` uniform numbers at `out` from the stream at `offset`, plus the device i64 at `at` when
/// given (a position advanced on the device: read by the kernel, so a captured graph follows it).
pub fn random_uniform(
    gpu: &dyn Gpu,
    dtype: DType,
    out: DevicePtr,
    len: usize,
    seed: u64,
    offset: u64,
    at: Option<DevicePtr>,
) -> Result<()> {
    if len == 0 {
        return Ok(());
    }
    let args = KernelArgs::new()
        .ptr(out)
        .i64(len as i64)
        .u64(seed)
        .u64(offset)
        .ptr(at.unwrap_or(DevicePtr(0)));
    gpu.launch(&kernels::random_uniform(dtype), linear_shape(len), &args)
}

/// Moves the device i64 at `at` on by `len` (a stream's position past a draw), in order after
/// the draw.
pub fn advance(gpu: &dyn Gpu, at: DevicePtr, len: usize) -> Result<()> {
    let args = KernelArgs::new().ptr(at).i64(len as i64);
    gpu.launch("advance", LaunchShape::linear(1, 32), &args)
}

/// u8 NHWC `x` → `(x / 255 − mean) / std` in `out` (logically NCHW, out's dtype and layout).
pub fn normalize_input(
    gpu: &dyn Gpu,
    x: &Operand,
    mean: &[f64],
    std: &[f64],
    out: &Operand,
) -> Result<()> {
    let channels = mean.len();
    let (x_channels, out_channels) = (x.layout.shape()[3], out.layout.shape()[1]);
    if channels > INPUT_MAX_CHANNELS
        || std.len() != channels
        || x_channels != channels
        || out_channels != channels
    {
        return Err(TensorError::Backend {
            device: gpu.name(),
            what: format!(
                "normalize_input: {channels} channels (mean), {} (std), {x_channels} (batch) and {out_channels} (output); the CUDA input op takes equal counts up to {INPUT_MAX_CHANNELS}",
                std.len()
            ),
        });
    }
    let n = out.layout.numel();
    if n == 0 {
        return Ok(());
    }
    let mut norm = [1.0f64; 2 * INPUT_MAX_CHANNELS];
    norm[..channels].copy_from_slice(mean);
    norm[INPUT_MAX_CHANNELS..INPUT_MAX_CHANNELS + channels].copy_from_slice(std);
    if let Some((from, to)) = input_in_one_order(x, out) {
        let args = KernelArgs::new()
            .ptr(from)
            .ptr(to)
            .i64(n as i64)
            .i64(channels as i64)
            .f64s(&norm);
        let kernel = kernels::normalize_input_packed(out.dtype);
        return gpu.launch(&kernel, linear_shape(n / 16), &args);
    }
    let args = KernelArgs::new()
        .ptr(x.ptr)
        .strided(&strided(gpu, x.layout, "normalize_input")?)
        .ptr(out.ptr)
        .strided(&strided(gpu, out.layout, "normalize_input")?)
        .i64(n as i64)
        .f64s(&norm);
    // Each block tabulates 256 values a channel: let a thread take about 16 elements, so the
    // table is not most of the work.
    let blocks = linear_shape(n.div_ceil(16));
    gpu.launch(&kernels::normalize_input(out.dtype), blocks, &args)
}

/// Where the input op's packed kernel may run — the loader's batch, a dense `[N, H, W, C]`
/// (any offset), into a dense channels-last output: then both lay out (n, y, x, c) alike and
/// are walked as flat arrays. Returns their first elements' addresses when both are 16-byte
/// aligned; else `None`, and the general kernel runs.
fn input_in_one_order(x: &Operand, out: &Operand) -> Option<(DevicePtr, DevicePtr)> {
    let channels_last = Layout::channels_last(out.layout.shape()).ok()?;
    let dense = x
        .layout
        .strides_match(&Layout::contiguous(x.layout.shape()))
        && out.layout.strides_match(&channels_last);
    let start = |o: &Operand| o.ptr.offset(o.layout.offset() * o.dtype.size());
    let (from, to) = (start(x), start(out));
    (dense && from.0.is_multiple_of(16) && to.0.is_multiple_of(16)).then_some((from, to))
}
