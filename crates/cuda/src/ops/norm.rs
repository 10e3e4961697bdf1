//! Launchers of `kernels/norm.cu`: batch norm's per-channel sums and per-channel affine.
//!
//! Each has a general kernel (any layouts, walked in logical order) and kernels for the layouts
//! a training step actually makes, walked in memory order: a dense channels-last tensor as a
//! rows × channels matrix ([`RowsPlan`]: a thread owns a 16-byte pack of adjacent channels, so
//! their per-channel values stay in its registers while it streams its rows), and the affine
//! over operands sharing any other dense layout in 16-byte packs. The general kernels read
//! channels-last tensors one element per 128-byte line.

use redline_tensor::{Layout, Result, TensorError};

use crate::gpu::{DevicePtr, Gpu, KernelArgs, LaunchShape, Strided};
use crate::kernels;
use crate::ops::elementwise::{self, Operand};
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

/// Blocks the rows kernels aim for: enough to fill a large GPU several times over.
const ROWS_TARGET_BLOCKS: usize = 1024;
/// Rows each thread of the rows kernels reads at least, where there are enough: its per-channel
/// values (gate, coefficients) and its block's final reduction are paid once for them.
const ROWS_PER_THREAD: usize = 4;

/// Operands the memory-order kernels take: one dense order ([`share_one_dense_order`]) from
/// the start of each storage (their pointers are the storages').
fn share_one_dense_layout(layouts: &[&Layout]) -> bool {
    share_one_dense_order(layouts) && layouts.iter().all(|l| l.offset() == 0)
}

/// How the rows kernels (`kernels/norm.cu`) split a dense channels-last tensor, seen as a
/// `[rows, channels]` matrix: a thread owns `vector` adjacent channels (one, or a 16-byte
/// pack), `lanes` threads (a power of two, at most a warp) span a row's `channels / vector`
/// columns and the block's other `256 / lanes` threads take more rows at once; a grid of
/// `[⌈columns / lanes⌉, chunks]` blocks, the chunks stepping through the rows together.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowsPlan {
    pub rows: usize,
    pub channels: usize,
    pub vector: usize,
    pub lanes: usize,
    pub chunks: usize,
}

impl RowsPlan {
    /// The plan when x and the `others` (same dtype) are dense channels-last in one layout
    /// from their storages' starts, with more than one channel; else `None`, and the general
    /// kernels run. Packs of 16 bytes when the channels fill whole packs and every pointer is
    /// 16-byte aligned, else a channel a thread.
    pub fn new(x: &Operand, others: &[&Operand]) -> Option<Self> {
        let shape = x.layout.shape();
        let mut layouts = vec![x.layout];
        layouts.extend(others.iter().map(|o| o.layout));
        if shape.len() < 2 || shape[1] < 2 || x.layout.strides()[1] != 1 {
            return None;
        }
        if !share_one_dense_layout(&layouts) || others.iter().any(|o| o.dtype != x.dtype) {
            return None;
        }
        let (channels, rows) = (shape[1], x.layout.numel() / shape[1]);
        if rows == 0 {
            // Nothing to read: the general kernels write the zero sums.
            return None;
        }
        let per_pack = 16 / x.dtype.size();
        let aligned = std::iter::once(x)
            .chain(others.iter().copied())
            .all(|o| o.ptr.0 % 16 == 0);
        let vector = match per_pack > 1 && channels.is_multiple_of(per_pack) && aligned {
            true => per_pack,
            false => 1,
        };
        let columns = channels / vector;
        let lanes = columns.next_power_of_two().min(32);
        let rows_at_once = THREADS as usize / lanes;
        let chunks = ROWS_TARGET_BLOCKS
            .div_ceil(columns.div_ceil(lanes))
            .clamp(1, rows.div_ceil(rows_at_once * ROWS_PER_THREAD));
        Some(Self {
            rows,
            channels,
            vector,
            lanes,
            chunks,
        })
    }

    /// Whether a thread moves 16-byte packs (the `*_rows_packed` kernels).
    pub fn packed(&self) -> bool {
        self.vector > 1
    }

    /// Statistics-dtype elements of scratch the sums' partials take.
    pub fn partials(&self) -> usize {
        self.chunks * 2 * self.channels
    }

    fn shape(&self) -> LaunchShape {
        let columns = self.channels / self.vector;
        LaunchShape {
            grid: [columns.div_ceil(self.lanes) as u32, self.chunks as u32, 1],
            block: [self.lanes as u32, THREADS / self.lanes as u32, 1],
        }
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
    centre: Option<DevicePtr>,
    out: DevicePtr,
    rows: Option<(RowsPlan, DevicePtr)>,
) -> Result<()> {
    let (n, c, inner) = split(x.layout.shape());
    if c == 0 {
        return Ok(());
    }
    if let Some((plan, partials)) = rows {
        return stats_rows(gpu, &plan, x, y, gate, centre, out, partials);
    }
    let device = gpu.name();
    let xs = Strided::new(x.layout, &device, "batch_norm_stats")?;
    let args = KernelArgs::new().ptr(x.ptr).strided(&xs);
    let args = optional(args, y, &xs, &device)?
        .ptr(gate.unwrap_or(DevicePtr(0)))
        .ptr(centre.unwrap_or(DevicePtr(0)))
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
#[allow(clippy::too_many_arguments)]
fn stats_rows(
    gpu: &dyn Gpu,
    plan: &RowsPlan,
    x: &Operand,
    y: Option<&Operand>,
    gate: Option<DevicePtr>,
    centre: Option<DevicePtr>,
    out: DevicePtr,
    partials: DevicePtr,
) -> Result<()> {
    let centre = centre.map_or(Centre::Raw, Centre::Given);
    partial_stats(gpu, plan, x, y, gate, centre, partials)?;
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

/// A channels-last x's partial sums per (channel block, row chunk) into `partials`
/// ([`RowsPlan::partials`] elements), for the combine or a coefficient op to add up
/// ([`Sums::Partials`]).
pub fn partial_stats(
    gpu: &dyn Gpu,
    plan: &RowsPlan,
    x: &Operand,
    y: Option<&Operand>,
    gate: Option<DevicePtr>,
    centre: Centre,
    partials: DevicePtr,
) -> Result<()> {
    let null = DevicePtr(0);
    let (given, first_out) = match centre {
        Centre::Raw => (null, null),
        Centre::Given(k) => (k, null),
        // The kernels read the first row only without y; with one, the coefficients would
        // read centres nobody wrote.
        Centre::FirstRow(_) if y.is_some() => {
            return Err(TensorError::Backend {
                device: gpu.name(),
                what: "batch norm's sums centre on x's first row only without y".into(),
            })
        }
        Centre::FirstRow(out) => (null, out),
    };
    let args = KernelArgs::new()
        .ptr(x.ptr)
        .ptr(y.map_or(null, |y| y.ptr))
        .ptr(gate.unwrap_or(null))
        .ptr(given)
        .ptr(first_out)
        .ptr(partials)
        .i64(plan.rows as i64)
        .i64(plan.channels as i64);
    let name = match plan.packed() {
        true => "batch_norm_stats_rows_packed",
        false => "batch_norm_stats_rows",
    };
    let kernel = kernels::batch_norm_stats(name, x.dtype, y.is_some(), gate.is_some());
    gpu.launch(&kernel, plan.shape(), &args)
}

/// What the rows kernels' sums are taken about.
#[derive(Clone, Copy, Debug)]
pub enum Centre {
    /// Nothing: raw sums.
    Raw,
    /// A contiguous `[C]` of the stats dtype (the backward's mean).
    Given(DevicePtr),
    /// x's first row — each channel's first element, the forward's centre — which the
    /// kernel also writes to this `[C]` of the stats dtype for the coefficients' launch. Only
    /// without y (the forward).
    FirstRow(DevicePtr),
}

/// Where batch norm's per-channel math reads its sums.
#[derive(Clone, Copy, Debug)]
pub enum Sums {
    /// A contiguous `[2, C]` ([`stats`]'s output).
    Whole(DevicePtr),
    /// [`partial_stats`]' partials of that many chunks, added up in the coefficients' launch
    /// (a block a channel, in the combine's order: the same bits).
    Partials(DevicePtr, usize),
}

impl Sums {
    /// The coefficient kernel's leading arguments, its launch over `c` channels, and whether
    /// it adds partials.
    fn launch(self, c: usize) -> (KernelArgs, LaunchShape, bool) {
        match self {
            Sums::Whole(sums) => (KernelArgs::new().ptr(sums), linear_shape(c), false),
            Sums::Partials(partials, chunks) => (
                KernelArgs::new().ptr(partials).i64(chunks as i64),
                LaunchShape::linear(c.min(1 << 16) as u32, THREADS),
                true,
            ),
        }
    }
}

/// The affine's packed form, when x, y and out share one dense layout, fill whole 16-byte
/// packs and start 16-byte aligned: `(packs, channel stride)`.
fn packed(x: &Operand, y: Option<&Operand>, out: &Operand) -> Option<(usize, usize)> {
    let mut operands = vec![x, out];
    operands.extend(y);
    let layouts: Vec<&Layout> = operands.iter().map(|o| o.layout).collect();
    if !share_one_dense_layout(&layouts) {
        return None;
    }
    let packs = elementwise::packs(&operands)?;
    let channel_stride = x.layout.strides().get(1).copied().unwrap_or(1).max(1);
    Some((packs, channel_stride))
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
    // The memory-order kernels' pointers: x, y (or null), coef, gate (or null), out.
    let pointers = || {
        KernelArgs::new()
            .ptr(x.ptr)
            .ptr(y.map_or(DevicePtr(0), |y| y.ptr))
            .ptr(coef)
            .ptr(gate.unwrap_or(DevicePtr(0)))
            .ptr(out.ptr)
    };
    let rows = match y {
        Some(y) => RowsPlan::new(x, &[out, y]),
        None => RowsPlan::new(x, &[out]),
    };
    if let Some(plan) = rows.filter(RowsPlan::packed) {
        let args = pointers().i64(plan.rows as i64).i64(c as i64);
        return gpu.launch(&kernel("batch_norm_apply_rows_packed"), plan.shape(), &args);
    }
    if let Some((packs, channel_stride)) = packed(x, y, out) {
        let args = pointers()
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

/// Batch norm's forward coefficients (a thread per channel, or a block per channel adding
/// partials): `coef` `[3, C]` and `saved`
/// `[2, C]` from `sums`, the running statistics updated in place; absent operands are null.
#[allow(clippy::too_many_arguments)]
pub fn coef(
    gpu: &dyn Gpu,
    stats: redline_tensor::DType,
    c: usize,
    sums: Sums,
    centre: Option<DevicePtr>,
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
    let (args, shape, partials) = sums.launch(c);
    let args = args
        .ptr(centre.unwrap_or(null))
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
    let kernel = kernels::batch_norm_coef(stats, false, partials);
    gpu.launch(&kernel, shape, &args)
}

/// Batch norm's backward coefficients (as [`coef`]): `coef` `[3, C]`, `dw`, `db`.
#[allow(clippy::too_many_arguments)]
pub fn grad_coef(
    gpu: &dyn Gpu,
    stats: redline_tensor::DType,
    c: usize,
    sums: Sums,
    saved: DevicePtr,
    weight: Option<DevicePtr>,
    out: (DevicePtr, DevicePtr, DevicePtr),
    count: f64,
) -> Result<()> {
    if c == 0 {
        return Ok(());
    }
    let (args, shape, partials) = sums.launch(c);
    let args = args
        .ptr(saved)
        .ptr(weight.unwrap_or(DevicePtr(0)))
        .ptr(out.0)
        .ptr(out.1)
        .ptr(out.2)
        .f64(count)
        .i64(c as i64);
    let kernel = kernels::batch_norm_coef(stats, true, partials);
    gpu.launch(&kernel, shape, &args)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::elementwise::tests::operand;
    use redline_tensor::DType;

    /// `shape` row-major and channels-last.
    fn both_layouts(shape: &[usize]) -> (Layout, Layout) {
        (
            Layout::contiguous(shape),
            Layout::channels_last(shape).unwrap(),
        )
    }

    #[test]
    fn channels_last_tensors_take_the_rows_kernels_in_packs_with_enough_blocks() {
        // ResNet-50's first bottleneck at batch 256: 8 packs of 8 bf16 channels a row, so 8
        // lanes by 32 rows a block (a warp reads 4 whole adjacent rows: 512 contiguous bytes).
        let cl = Layout::channels_last(&[256, 64, 56, 56]).unwrap();
        let x = operand(&cl, DType::BF16, 0);
        let plan = RowsPlan::new(&x, &[&x]).expect("dense channels-last");
        assert_eq!((plan.rows, plan.channels), (256 * 56 * 56, 64));
        assert_eq!((plan.vector, plan.lanes, plan.chunks), (8, 8, 1024));
        let shape = plan.shape();
        assert_eq!((shape.grid, shape.block), ([1, 1024, 1], [8, 32, 1]));
        assert_eq!(plan.partials(), 1024 * 2 * 64);
        // Its last stage: 2,048 channels are 256 packs, a warp of them across 8 blocks.
        let wide = Layout::channels_last(&[256, 2048, 7, 7]).unwrap();
        let plan = RowsPlan::new(&operand(&wide, DType::BF16, 0), &[]).unwrap();
        assert_eq!((plan.vector, plan.lanes, plan.chunks), (8, 32, 128));
        assert_eq!(plan.shape().grid, [8, 128, 1]);
        // Few rows: every thread reads at least 4 of them. f32 packs hold 4 channels, so 40
        // make 10 columns, 16 lanes and 16 rows at once.
        let small = Layout::channels_last(&[1, 40, 3, 5]).unwrap();
        let plan = RowsPlan::new(&operand(&small, DType::F32, 0), &[]).unwrap();
        assert_eq!(
            (plan.rows, plan.vector, plan.lanes, plan.chunks),
            (15, 4, 16, 1)
        );
        // Channels that fill no whole packs, or a pointer off 16 bytes: a channel a thread.
        let ragged = Layout::channels_last(&[3, 36, 5, 7]).unwrap();
        let plan = RowsPlan::new(&operand(&ragged, DType::BF16, 0), &[]).unwrap();
        assert_eq!((plan.vector, plan.lanes, plan.chunks), (1, 32, 4));
        let y = operand(&cl, DType::BF16, 8);
        assert_eq!(RowsPlan::new(&x, &[&y]).unwrap().vector, 1);
        // An empty batch has no rows to split.
        let empty = Layout::channels_last(&[0, 40, 3, 5]).unwrap();
        assert_eq!(RowsPlan::new(&operand(&empty, DType::F32, 0), &[]), None);
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
            let others: Vec<&Operand> = y.iter().collect();
            assert_eq!(RowsPlan::new(x, &others), None, "{:?}", x.layout);
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
