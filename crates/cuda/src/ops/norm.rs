//! Launchers of `kernels/norm.cu`: batch norm's per-channel sums and per-channel affine.
//!
//! Each has a general kernel (any layouts, walked in logical order) and one for the layouts a
//! training step actually makes, walked in memory order: the sums of a dense channels-last
//! tensor as a rows × channels matrix (a warp reads adjacent channels), the affine over
//! operands sharing one dense layout in 16-byte packs. The general kernels read channels-last
//! tensors one element per 128-byte line.

use redline_tensor::{Layout, Result};

use crate::gpu::{DevicePtr, Gpu, KernelArgs, LaunchShape, Strided};
use crate::kernels;
use crate::ops::elementwise::Operand;
use crate::ops::{linear_shape, share_one_dense_order};

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

/// Channels a block of `batch_norm_stats_rows` covers (`ROWS_LANES`).
const ROWS_LANES: usize = 32;
/// Rows its threads read at once (`ROWS_AT_ONCE`).
const ROWS_AT_ONCE: usize = 8;
/// Blocks the channels-last sums aim for: enough to fill a large GPU several times over.
const ROWS_TARGET_BLOCKS: usize = 1024;

/// Operands the memory-order kernels take: one dense order ([`share_one_dense_order`]) from
/// the start of each storage (their pointers are the storages').
fn share_one_dense_layout(layouts: &[&Layout]) -> bool {
    share_one_dense_order(layouts) && layouts.iter().all(|l| l.offset() == 0)
}

/// How `batch_norm_stats_rows` splits a channels-last x: `chunks` row ranges of
/// `rows_per_chunk` rows, a grid of `[⌈C / 32⌉, chunks]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowsPlan {
    pub rows: usize,
    pub channels: usize,
    pub rows_per_chunk: usize,
    pub chunks: usize,
}

impl RowsPlan {
    /// The plan when x (and y) are dense channels-last (channels innermost in memory, more
    /// than one), else `None`: the block-per-channel kernel runs.
    pub fn new(x: &Operand, y: Option<&Operand>) -> Option<Self> {
        let shape = x.layout.shape();
        let mut layouts = vec![x.layout];
        layouts.extend(y.map(|y| y.layout));
        if shape.len() < 2 || shape[1] < 2 || x.layout.strides()[1] != 1 {
            return None;
        }
        if !share_one_dense_layout(&layouts) || y.is_some_and(|y| y.dtype != x.dtype) {
            return None;
        }
        let (channels, rows) = (shape[1], x.layout.numel() / shape[1]);
        if rows == 0 {
            // Nothing to read: the general kernel writes the zero sums.
            return None;
        }
        let across = channels.div_ceil(ROWS_LANES);
        let chunks = ROWS_TARGET_BLOCKS
            .div_ceil(across)
            .clamp(1, rows.div_ceil(ROWS_AT_ONCE));
        let rows_per_chunk = rows.div_ceil(chunks);
        Some(Self {
            rows,
            channels,
            rows_per_chunk,
            chunks: rows.div_ceil(rows_per_chunk),
        })
    }

    /// Statistics-dtype elements of scratch its partial sums take.
    pub fn partials(&self) -> usize {
        self.chunks * 2 * self.channels
    }
}

/// `[Σ other, Σ x·other]` per channel into the contiguous `[2, C]` at `out`. With `rows` (a
/// channels-last x's [`RowsPlan`] and scratch of [`RowsPlan::partials`] elements) the
/// rows × channels kernels run, else the block-per-channel one.
pub fn stats(
    gpu: &dyn Gpu,
    x: &Operand,
    y: Option<&Operand>,
    gate: Option<DevicePtr>,
    out: DevicePtr,
    rows: Option<(RowsPlan, DevicePtr)>,
) -> Result<()> {
    let (n, c, inner) = split(x.layout.shape());
    if c == 0 {
        return Ok(());
    }
    if let Some((plan, partials)) = rows {
        return stats_rows(gpu, &plan, x, y, gate, out, partials);
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
    let kernel =
        kernels::batch_norm_stats("batch_norm_stats", x.dtype, y.is_some(), gate.is_some());
    let blocks = c.min(1 << 16) as u32;
    gpu.launch(&kernel, LaunchShape::linear(blocks, THREADS), &args)
}

/// The channels-last sums: partial sums per (channel block, row chunk), then combined in order.
fn stats_rows(
    gpu: &dyn Gpu,
    plan: &RowsPlan,
    x: &Operand,
    y: Option<&Operand>,
    gate: Option<DevicePtr>,
    out: DevicePtr,
    partials: DevicePtr,
) -> Result<()> {
    let null = DevicePtr(0);
    let args = KernelArgs::new()
        .ptr(x.ptr)
        .ptr(y.map_or(null, |y| y.ptr))
        .ptr(gate.unwrap_or(null))
        .ptr(partials)
        .i64(plan.rows as i64)
        .i64(plan.channels as i64)
        .i64(plan.rows_per_chunk as i64);
    let kernel = kernels::batch_norm_stats(
        "batch_norm_stats_rows",
        x.dtype,
        y.is_some(),
        gate.is_some(),
    );
    let shape = LaunchShape {
        grid: [
            plan.channels.div_ceil(ROWS_LANES) as u32,
            plan.chunks as u32,
            1,
        ],
        block: [ROWS_LANES as u32, ROWS_AT_ONCE as u32, 1],
    };
    gpu.launch(&kernel, shape, &args)?;
    let stats = redline_tensor::stats_dtype(x.dtype);
    let args = KernelArgs::new()
        .ptr(partials)
        .i64(plan.chunks as i64)
        .ptr(out)
        .i64(plan.channels as i64);
    let blocks = (2 * plan.channels).min(1 << 16) as u32;
    let combine = kernels::batch_norm_stats_combine(stats);
    gpu.launch(&combine, LaunchShape::linear(blocks, THREADS), &args)
}

/// The affine's packed form, when x, y and out share one dense layout, fill whole 16-byte
/// packs and start 16-byte aligned: `(packs, channel stride)`.
fn packed(x: &Operand, y: Option<&Operand>, out: &Operand) -> Option<(usize, usize)> {
    let size = x.dtype.size();
    let per_pack = 16 / size;
    let mut operands = vec![x, out];
    operands.extend(y);
    let layouts: Vec<&Layout> = operands.iter().map(|o| o.layout).collect();
    let n = x.layout.numel();
    let aligned = operands
        .iter()
        .all(|o| o.dtype == x.dtype && o.ptr.0 % 16 == 0);
    if !aligned || per_pack == 0 || !n.is_multiple_of(per_pack) || !share_one_dense_layout(&layouts)
    {
        return None;
    }
    let channel_stride = x.layout.strides().get(1).copied().unwrap_or(1).max(1);
    Some((n / per_pack, channel_stride))
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
    let kernel = |name| kernels::batch_norm_apply(name, x.dtype, y.is_some(), relu, gate.is_some());
    if let Some((packs, channel_stride)) = packed(x, y, out) {
        let args = KernelArgs::new()
            .ptr(x.ptr)
            .ptr(y.map_or(DevicePtr(0), |y| y.ptr))
            .ptr(coef)
            .ptr(gate.unwrap_or(DevicePtr(0)))
            .ptr(out.ptr)
            .i64(packs as i64)
            .i64(c as i64)
            .i64(channel_stride as i64);
        let packed_kernel = kernel("batch_norm_apply_packed");
        return gpu.launch(&packed_kernel, linear_shape(packs), &args);
    }
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
    gpu.launch(&kernel("batch_norm_apply"), linear_shape(total), &args)
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

#[cfg(test)]
mod tests {
    use super::*;
    use redline_tensor::DType;

    fn operand(layout: &Layout, dtype: DType, ptr: u64) -> Operand<'_> {
        Operand {
            ptr: DevicePtr(ptr),
            dtype,
            layout,
        }
    }

    /// `shape` row-major and channels-last.
    fn both_layouts(shape: &[usize]) -> (Layout, Layout) {
        (
            Layout::contiguous(shape),
            Layout::channels_last(shape).unwrap(),
        )
    }

    #[test]
    fn channels_last_sums_take_the_rows_kernel_with_enough_blocks() {
        let shape = [256, 64, 56, 56];
        let cl = Layout::channels_last(&shape).unwrap();
        let x = operand(&cl, DType::BF16, 0);
        let plan = RowsPlan::new(&x, Some(&x)).expect("dense channels-last");
        assert_eq!((plan.rows, plan.channels), (256 * 56 * 56, 64));
        // Two channel blocks, so 512 row chunks: 1,024 blocks, every row covered once.
        assert_eq!(plan.chunks, 512);
        assert!(plan.chunks * plan.rows_per_chunk >= plan.rows);
        assert!((plan.chunks - 1) * plan.rows_per_chunk < plan.rows);
        assert_eq!(plan.partials(), 512 * 2 * 64);
        // Few rows: a chunk per 8 rows at most.
        let small = Layout::channels_last(&[1, 40, 3, 5]).unwrap();
        let plan = RowsPlan::new(&operand(&small, DType::F32, 0), None).unwrap();
        assert_eq!((plan.rows, plan.chunks, plan.rows_per_chunk), (15, 2, 8));
        // An empty batch has no rows to split.
        let empty = Layout::channels_last(&[0, 40, 3, 5]).unwrap();
        assert_eq!(RowsPlan::new(&operand(&empty, DType::F32, 0), None), None);
    }

    #[test]
    fn other_layouts_keep_the_block_per_channel_sums() {
        let shape = [8, 16, 4, 4];
        let (nchw, cl) = both_layouts(&shape);
        let narrowed = cl.narrow(0, 1, 4).unwrap();
        let one_channel = Layout::channels_last(&[8, 1, 4, 4]).unwrap();
        let refused = [
            (operand(&nchw, DType::F32, 0), None),
            (operand(&narrowed, DType::F32, 0), None),
            (operand(&one_channel, DType::F32, 0), None),
            // y in another layout, or another dtype.
            (
                operand(&cl, DType::F32, 0),
                Some(operand(&nchw, DType::F32, 0)),
            ),
            (
                operand(&cl, DType::F32, 0),
                Some(operand(&cl, DType::F16, 0)),
            ),
        ];
        for (x, y) in &refused {
            assert_eq!(RowsPlan::new(x, y.as_ref()), None, "{:?}", x.layout);
        }
    }

    #[test]
    fn the_packed_affine_needs_one_dense_layout_whole_packs_and_aligned_pointers() {
        let shape = [2, 16, 3, 8];
        let (nchw, cl) = both_layouts(&shape);
        let at = |l, ptr| operand(l, DType::BF16, ptr);
        // Channels-last: the channel stride is 1; NCHW: a plane.
        assert_eq!(packed(&at(&cl, 0), None, &at(&cl, 256)), Some((96, 1)));
        assert_eq!(
            packed(&at(&nchw, 0), Some(&at(&nchw, 512)), &at(&nchw, 256)),
            Some((96, 24))
        );
        // Mixed layouts, a misaligned pointer, a partial last pack, another dtype: general.
        assert_eq!(packed(&at(&cl, 0), None, &at(&nchw, 256)), None);
        assert_eq!(packed(&at(&cl, 0), None, &at(&cl, 8)), None);
        let ragged = Layout::contiguous(&[1, 3, 5, 5]);
        assert_eq!(packed(&at(&ragged, 0), None, &at(&ragged, 256)), None);
        let f32_out = operand(&cl, DType::F32, 256);
        assert_eq!(packed(&at(&cl, 0), None, &f32_out), None);
        // f32 packs hold 4, f64 packs 2.
        let f64_x = operand(&ragged, DType::F64, 0);
        let f64_out = operand(&ragged, DType::F64, 1024);
        assert_eq!(packed(&f64_x, None, &f64_out), None, "75 is odd");
        let even = Layout::contiguous(&[2, 3, 5, 5]);
        let (a, b) = (
            operand(&even, DType::F64, 0),
            operand(&even, DType::F64, 2048),
        );
        assert_eq!(packed(&a, None, &b), Some((75, 25)));
    }
}
