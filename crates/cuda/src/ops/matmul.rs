//! Matmul: cuBLASLt through [`Gpu::gemm`] where the GPU has it, else `kernels/matmul.cu`
//! (batched, strided operands, a contiguous product).

use redline_tensor::Result;

use crate::gemm::GemmPlan;
use crate::gpu::{DevicePtr, Gpu, KernelArgs, LaunchShape, Strided};
use crate::kernels;
use crate::ops::elementwise::Operand;

/// Tile edge (`MATMUL_TILE` in `kernels/matmul.cu`): blocks are TILE × TILE threads.
const TILE: u32 = 16;

/// `[.., M, K] @ [.., K, N]` (equal batch shapes; a broadcast batch has stride 0) into the
/// contiguous `[.., M, N]` at `out`.
pub fn matmul(gpu: &dyn Gpu, a: &Operand, b: &Operand, out: DevicePtr) -> Result<()> {
    let (sa, sb) = (a.layout.shape(), b.layout.shape());
    let r = sa.len();
    let (m, k, n) = (sa[r - 2], sa[r - 1], sb[r - 1]);
    let batch: usize = sa[..r - 2].iter().product();
    if batch == 0 || m == 0 || n == 0 {
        return Ok(());
    }
    // cuBLASLt where the GPU has it and can read the operands; our tiled kernel otherwise.
    if k > 0 {
        if let Some(plan) = GemmPlan::new(a.dtype, a.layout, b.layout) {
            let size = a.dtype.size();
            let first = |o: &Operand| o.ptr.offset(o.layout.offset() * size);
            // BLAS's first operand is our b (the product is computed transposed).
            if gpu.gemm(&plan, [first(b), first(a), out])? {
                return Ok(());
            }
        }
    }
    let device = gpu.name();
    let batch_of = |o: &Operand| {
        let l = o.layout;
        Strided::from_parts(
            &l.shape()[..r - 2],
            &l.strides()[..r - 2],
            l.offset(),
            &device,
            "matmul",
        )
    };
    let (ta, tb) = (a.layout.strides(), b.layout.strides());
    let args = KernelArgs::new()
        .ptr(a.ptr)
        .strided(&batch_of(a)?)
        .i64(ta[r - 2] as i64)
        .i64(ta[r - 1] as i64)
        .ptr(b.ptr)
        .strided(&batch_of(b)?)
        .i64(tb[r - 2] as i64)
        .i64(tb[r - 1] as i64)
        .ptr(out)
        .i64(batch as i64)
        .i64(m as i64)
        .i64(n as i64)
        .i64(k as i64);
    let shape = LaunchShape {
        grid: [
            n.div_ceil(TILE as usize) as u32,
            m.div_ceil(TILE as usize).min(65535) as u32,
            batch.min(65535) as u32,
        ],
        block: [TILE, TILE, 1],
    };
    if m.div_ceil(TILE as usize) > 65535 {
        return Err(redline_tensor::TensorError::Backend {
            device,
            what: format!("matmul: {m} rows is more than this kernel's grid covers"),
        });
    }
    gpu.launch(&kernels::matmul(a.dtype), shape, &args)
}
