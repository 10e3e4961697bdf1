//! Launcher of `kernels/reduce.cu`: sum, max and argmax over any axes, one block per output, or
//! one thread per output where the kept axes are innermost in memory.

use redline_tensor::{DType, Layout, ReduceOp, Result};

use crate::gpu::{DevicePtr, Gpu, KernelArgs, LaunchShape, Strided};
use crate::kernels;
use crate::ops::linear_shape;

/// Threads per block: `REDUCE_THREADS` in `kernels/reduce.cu` (its shared partials are sized
/// for exactly this many).
pub const THREADS: u32 = 256;

/// At most this many reduced elements per output for a thread per output: one thread's
/// sequential walk must stay short next to a block's strided one.
const COLUMN_MAX_ELEMENTS: usize = 256;

/// At least this many outputs for a thread per output: enough warps to fill the device.
const COLUMN_MIN_OUTPUTS: usize = 2048;

/// Whether a thread per output reads memory in order: many outputs over few elements each, and
/// the last kept axis (the one neighbouring threads step along) closer in memory than any
/// reduced axis — a channels-last tensor's mean over its plane (ResNet's global average pool)
/// is the case that matters. A block per output would read one element per 32-byte sector there
/// with most of its threads idle. Size-1 axes are ignored.
fn by_columns(
    kept: &[(usize, usize)],
    reduced: &[(usize, usize)],
    outputs: usize,
    r: usize,
) -> bool {
    let inner_kept = kept.iter().rev().find(|&&(size, _)| size > 1);
    let nearest_reduced = reduced
        .iter()
        .filter(|&&(size, _)| size > 1)
        .map(|&(_, s)| s)
        .min();
    let kept_inner = match (inner_kept, nearest_reduced) {
        (Some(&(_, kept)), Some(reduced)) => kept < reduced,
        _ => false,
    };
    kept_inner && r <= COLUMN_MAX_ELEMENTS && outputs >= COLUMN_MIN_OUTPUTS
}

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
    let split = |keep: bool| -> Vec<(usize, usize)> {
        (0..shape.len())
            .filter(|d| axes.contains(d) != keep)
            .map(|d| (shape[d], strides[d]))
            .collect()
    };
    let (kept_axes, reduced_axes) = (split(true), split(false));
    let (kept_shape, kept_strides): (Vec<usize>, Vec<usize>) = kept_axes.iter().copied().unzip();
    let (reduced_shape, reduced_strides): (Vec<usize>, Vec<usize>) =
        reduced_axes.iter().copied().unzip();
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
    if by_columns(&kept_axes, &reduced_axes, outputs, r) {
        let kernel = kernels::reduce("reduce_columns", dtype, op);
        return gpu.launch(&kernel, linear_shape(outputs), &args);
    }
    let blocks = outputs.clamp(1, 1 << 16) as u32;
    gpu.launch(
        &kernels::reduce("reduce", dtype, op),
        LaunchShape::linear(blocks, THREADS),
        &args,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_thread_per_output_only_where_the_kept_axes_are_innermost() {
        // Channels-last [256, 2048, 7, 7], mean over the plane: kept (N, C), C innermost.
        let (n, c, hw) = (256, 2048, 7);
        let kept = [(n, hw * hw * c), (c, 1)];
        let plane = [(hw, hw * c), (hw, c)];
        assert!(by_columns(&kept, &plane, n * c, hw * hw));
        // NCHW: the plane is innermost, a block per output reads it in order.
        let kept = [(n, c * hw * hw), (c, hw * hw)];
        let plane = [(hw, hw), (hw, 1)];
        assert!(!by_columns(&kept, &plane, n * c, hw * hw));
        // Too few outputs, or too many elements each.
        assert!(!by_columns(&[(1000, 1)], &[(16, 1000)], 1000, 16));
        assert!(!by_columns(&[(c, 1)], &[(1000, c)], c, 1000));
        // Size-1 axes do not count: a kept [N, 1] still steps along N.
        assert!(by_columns(&[(4096, 1), (1, 1)], &[(16, 4096)], 4096, 16));
        // Nothing reduced (r = 1 over size-1 axes) or nothing kept: the block kernel.
        assert!(!by_columns(&[(4096, 1)], &[(1, 1)], 4096, 1));
        assert!(!by_columns(&[], &[(64, 1)], 1, 64));
    }
}
