//! Launcher of `kernels/reduce.cu`: sum, max and argmax over any axes, one block per output.

use redline_tensor::{DType, Layout, ReduceOp, Result};

use crate::gpu::{DevicePtr, Gpu, KernelArgs, LaunchShape, Strided};
use crate::kernels;

/// Threads per block: `REDUCE_THREADS` in `kernels/reduce.cu` (its shared partials are sized
/// for exactly this many).
pub const THREADS: u32 = 256;

/// Reduces `x` (`dtype`, seen through `layout`) over `axes` into the contiguous `out`, whose
/// shape is x's with `axes` set to 1.
pub fn reduce(
    gpu: &dyn Gpu,
    op: ReduceOp,
    x: DevicePtr,
    dtype: DType,
    layout: &Layout,
    axes: &[usize],
    out: DevicePtr,
) -> Result<()> {
    let (shape, strides) = (layout.shape(), layout.strides());
    let split = |keep: bool| -> (Vec<usize>, Vec<usize>) {
        (0..shape.len())
            .filter(|d| axes.contains(d) != keep)
            .map(|d| (shape[d], strides[d]))
            .unzip()
    };
    let (kept_shape, kept_strides) = split(true);
    let (reduced_shape, reduced_strides) = split(false);
    let outputs: usize = kept_shape.iter().product();
    let r: usize = reduced_shape.iter().product();
    if outputs == 0 {
        return Ok(());
    }
    let name = gpu.name();
    let kept = Strided::from_parts(
        &kept_shape,
        &kept_strides,
        layout.offset(),
        &name,
        op.name(),
    )?;
    let reduced = Strided::from_parts(&reduced_shape, &reduced_strides, 0, &name, op.name())?;
    let args = KernelArgs::new()
        .ptr(x)
        .strided(&kept)
        .strided(&reduced)
        .i64(r as i64)
        .ptr(out)
        .i64(outputs as i64);
    let blocks = outputs.clamp(1, 1 << 16) as u32;
    gpu.launch(
        &kernels::reduce(dtype, op),
        LaunchShape::linear(blocks, THREADS),
        &args,
    )
}
