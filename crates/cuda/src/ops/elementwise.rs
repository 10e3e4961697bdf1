//! Launchers of `kernels/elementwise.cu`: unary, binary, select, convert (and copy_into), fill.

use redline_tensor::{BinaryOp, DType, Layout, Result, UnaryOp};

use crate::gpu::{DevicePtr, Gpu, KernelArgs, Strided};
use crate::kernels;
use crate::ops::{in_output_order, linear_shape, share_one_dense_order};

/// An operand: its base pointer and its layout (offsets in elements).
pub struct Operand<'a> {
    pub ptr: DevicePtr,
    pub dtype: DType,
    pub layout: &'a Layout,
}

/// Launches `kernel(op0, strided0, op1, strided1, …, n)` over `out`'s elements, the output
/// last — the parameter order every strided elementwise kernel declares. The kernel walks the
/// operands in the output's memory order with their runs merged ([`in_output_order`]): flat
/// runs for operands that share one dense order (a channels-last activation and its gradient,
/// say). Where those also make whole aligned 16-byte packs, `packed`
/// (`kernel_packed(op0, op1, …, packs)`) runs instead, if given.
fn launch(
    gpu: &dyn Gpu,
    kernel: &str,
    packed: Option<String>,
    what: &str,
    operands: &[&Operand],
) -> Result<()> {
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
    if let (true, Some(packed), Some(packs)) = (flat, packed, packs(operands)) {
        let args = operands.iter().fold(KernelArgs::new(), |args, o| {
            args.ptr(o.ptr.offset(o.layout.offset() * o.dtype.size()))
        });
        return gpu.launch(&packed, linear_shape(packs), &args.i64(packs as i64));
    }
    let mut args = KernelArgs::new();
    for (operand, (shape, strides, offset)) in operands.iter().zip(in_output_order(&layouts)) {
        let strided = Strided::from_parts(&shape, &strides, offset, &device, what)?;
        args = args.ptr(operand.ptr).strided(&strided);
    }
    gpu.launch(kernel, linear_shape(n), &args.i64(n as i64))
}

/// How many 16-byte packs flat operands make, when they are one dtype, a whole number of packs
/// long and each starts 16-byte aligned (the `_packed` kernels' precondition).
pub(crate) fn packs(operands: &[&Operand]) -> Option<usize> {
    let first = operands.first()?;
    let size = first.dtype.size();
    let n = first.layout.numel();
    let aligned = operands.iter().all(|o| {
        let start = o.ptr.offset(o.layout.offset() * size);
        o.dtype == first.dtype && o.layout.numel() == n && start.0.is_multiple_of(16)
    });
    (aligned && (n * size).is_multiple_of(16)).then_some(n * size / 16)
}

pub fn unary(gpu: &dyn Gpu, op: UnaryOp, x: &Operand, out: &Operand) -> Result<()> {
    let packed = kernels::unary_packed(x.dtype, op);
    launch(
        gpu,
        &kernels::unary(x.dtype, op),
        packed,
        op.name(),
        &[x, out],
    )
}

pub fn binary(gpu: &dyn Gpu, op: BinaryOp, a: &Operand, b: &Operand, out: &Operand) -> Result<()> {
    let packed = kernels::binary_packed(a.dtype, op);
    launch(
        gpu,
        &kernels::binary(a.dtype, op),
        packed,
        op.name(),
        &[a, b, out],
    )
}

pub fn select(
    gpu: &dyn Gpu,
    cond: &Operand,
    a: &Operand,
    b: &Operand,
    out: &Operand,
) -> Result<()> {
    launch(
        gpu,
        &kernels::select(a.dtype),
        None,
        "where",
        &[cond, a, b, out],
    )
}

/// `out = x` converted to `out.dtype`, element by element in `out`'s memory order: a cast, a
/// relayout into a dense layout, or a copy into part of an existing storage.
pub fn convert(gpu: &dyn Gpu, x: &Operand, out: &Operand) -> Result<()> {
    launch(
        gpu,
        &kernels::convert(x.dtype, out.dtype),
        None,
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

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// An operand at device address `ptr` (the launchers' tests look at pointers, never memory).
    pub(crate) fn operand(layout: &Layout, dtype: DType, ptr: u64) -> Operand<'_> {
        Operand {
            ptr: DevicePtr(ptr),
            dtype,
            layout,
        }
    }

    #[test]
    fn packs_need_one_dtype_whole_packs_and_every_operand_aligned_where_it_starts() {
        let dense = Layout::contiguous(&[4, 6]);
        let at = |layout, ptr| operand(layout, DType::BF16, ptr);
        // 24 bf16 = 3 packs of 8; 24 f32 = 6 packs of 4.
        assert_eq!(packs(&[&at(&dense, 0), &at(&dense, 256)]), Some(3));
        let f32s = [0, 96, 4096].map(|p| operand(&dense, DType::F32, p));
        assert_eq!(packs(&f32s.each_ref()), Some(6));
        // A pointer off 16 bytes, or a view starting off 16 bytes, or starting back on them.
        assert_eq!(packs(&[&at(&dense, 0), &at(&dense, 8)]), None);
        let shifted = Layout::new(vec![4, 6], vec![6, 1], 3);
        assert_eq!(packs(&[&at(&dense, 0), &at(&shifted, 0)]), None);
        assert_eq!(packs(&[&at(&dense, 0), &at(&shifted, 10)]), Some(3));
        // A partial last pack, or operands of two dtypes.
        let ragged = Layout::contiguous(&[3, 5]);
        assert_eq!(packs(&[&at(&ragged, 0), &at(&ragged, 256)]), None);
        let f16 = operand(&dense, DType::F16, 256);
        assert_eq!(packs(&[&at(&dense, 0), &f16]), None);
    }
}
