//! Launchers of `kernels/optim.cu`: multi-tensor SGD and AdamW, unscale-and-check, and the
//! GradScaler update. Tensors go to the kernels in lists of up to [`LIST_MAX`] by value, one
//! launch per list; scalars (found-inf, step, scale, growth tracker) stay on the device.

use redline_tensor::{AdamWParams, DType, Result, ScalerParams, SgdParams};

use crate::gpu::{DevicePtr, Gpu, KernelArgs, LaunchShape};
use crate::kernels;
use crate::ops::THREADS;

/// Tensors per launch (`LIST_MAX` in `kernels/optim.cu`).
pub const LIST_MAX: usize = 32;

/// One tensor of an update: up to four storages of `len` elements (param, grad, states).
#[derive(Debug, Clone, Copy)]
pub struct Slot {
    pub ptrs: [DevicePtr; 4],
    pub len: usize,
}

/// A one-element device scalar (or none): the kernels' `Flag`.
#[derive(Debug, Clone, Copy)]
pub struct Scalar {
    pub ptr: DevicePtr,
    pub dtype: DType,
}

fn flag(args: KernelArgs, s: Option<Scalar>) -> KernelArgs {
    let (ptr, code) = s.map_or((0, 0), |s| (s.ptr.0, kernels::dtype_code(s.dtype)));
    let mut bytes = ptr.to_ne_bytes().to_vec();
    bytes.extend(code.to_ne_bytes());
    bytes.extend(0i32.to_ne_bytes());
    args.bytes(&bytes)
}

fn doubles(args: KernelArgs, values: &[f64]) -> KernelArgs {
    args.f64s(values)
}

/// The kernels' `TensorList` for up to LIST_MAX slots.
fn list(slots: &[Slot]) -> Vec<u8> {
    let mut ptrs = [[0u64; LIST_MAX]; 4];
    let mut lens = [0i64; LIST_MAX];
    for (t, slot) in slots.iter().enumerate() {
        for (k, p) in slot.ptrs.iter().enumerate() {
            ptrs[k][t] = p.0;
        }
        lens[t] = slot.len as i64;
    }
    let mut bytes: Vec<u8> = ptrs
        .iter()
        .flatten()
        .flat_map(|p| p.to_ne_bytes())
        .collect();
    bytes.extend(lens.iter().flat_map(|n| n.to_ne_bytes()));
    bytes
}

/// Launches `kernel` once per list of up to LIST_MAX slots: block row y walks slot y.
fn per_list(
    gpu: &dyn Gpu,
    kernel: &str,
    slots: &[Slot],
    tail: impl Fn(KernelArgs) -> KernelArgs,
) -> Result<()> {
    for chunk in slots.chunks(LIST_MAX) {
        let longest = chunk.iter().map(|s| s.len).max().unwrap_or(0);
        if longest == 0 {
            continue;
        }
        let blocks = longest.div_ceil(THREADS as usize).clamp(1, 1024) as u32;
        let shape = LaunchShape {
            grid: [blocks, chunk.len() as u32, 1],
            block: [THREADS, 1, 1],
        };
        let args = tail(KernelArgs::new().bytes(&list(chunk)));
        gpu.launch(kernel, shape, &args)?;
    }
    Ok(())
}

/// The step count first, in its own launch: every block of the update then reads the new value.
fn count_step(gpu: &dyn Gpu, step: Scalar, found_inf: Option<Scalar>) -> Result<()> {
    let args = flag(flag(KernelArgs::new(), Some(step)), found_inf);
    gpu.launch("count_step", LaunchShape::linear(1, 32), &args)
}

/// What an update reads on the device: its step count and learning rate.
#[derive(Debug, Clone, Copy)]
pub struct StepScalars {
    pub step: Scalar,
    pub lr: Scalar,
}

pub fn sgd(
    gpu: &dyn Gpu,
    dtype: DType,
    slots: &[Slot],
    at: StepScalars,
    p: &SgdParams,
    found_inf: Option<Scalar>,
) -> Result<()> {
    count_step(gpu, at.step, found_inf)?;
    let kernel = kernels::optim("sgd", dtype);
    // SgdArgs: four doubles, then four i32 (nesterov, three unused), one parameter.
    let mut sgd_args: Vec<u8> = [p.lr_scale, p.momentum, p.dampening, p.weight_decay]
        .iter()
        .flat_map(|v| v.to_ne_bytes())
        .collect();
    for v in [p.nesterov as i32, 0, 0, 0] {
        sgd_args.extend(v.to_ne_bytes());
    }
    per_list(gpu, &kernel, slots, |args| {
        let args = flag(flag(args.bytes(&sgd_args), Some(at.step)), Some(at.lr));
        flag(args, found_inf)
    })
}

pub fn adamw(
    gpu: &dyn Gpu,
    dtype: DType,
    slots: &[Slot],
    at: StepScalars,
    p: &AdamWParams,
    found_inf: Option<Scalar>,
) -> Result<()> {
    count_step(gpu, at.step, found_inf)?;
    let kernel = kernels::optim("adamw", dtype);
    per_list(gpu, &kernel, slots, |args| {
        let args = doubles(args, &[p.lr_scale, p.beta1, p.beta2, p.eps, p.weight_decay]);
        flag(flag(flag(args, Some(at.step)), Some(at.lr)), found_inf)
    })
}

pub fn unscale_check(
    gpu: &dyn Gpu,
    dtype: DType,
    slots: &[Slot],
    inv_scale: Scalar,
    found_inf: Scalar,
) -> Result<()> {
    let kernel = kernels::optim("unscale_check", dtype);
    per_list(gpu, &kernel, slots, |args| {
        flag(flag(args, Some(inv_scale)), Some(found_inf))
    })
}

/// The most blocks per tensor in the first pass of [`sum_squares`].
pub const SQUARES_BLOCKS: usize = 32;

/// Blocks per tensor in the first pass of [`sum_squares`] over `slots`: enough for the longest.
fn squares_blocks(slots: &[Slot]) -> usize {
    let longest = slots.iter().map(|s| s.len).max().unwrap_or(0);
    longest.div_ceil(THREADS as usize).clamp(1, SQUARES_BLOCKS)
}

/// How many partial sums [`sum_squares`] writes for `slots` (its scratch buffer's length).
pub fn sum_squares_partials(slots: &[Slot]) -> usize {
    slots.len().max(1) * squares_blocks(slots)
}

/// Σ x² over every slot's first storage into the one-element `out` (of `dtype`'s accumulation
/// type): per list, a block per (tensor, share) writes a partial into `partials`
/// ([`sum_squares_partials`] long, tensor after tensor: every entry written); one block then
/// sums them all.
pub fn sum_squares(
    gpu: &dyn Gpu,
    dtype: DType,
    slots: &[Slot],
    partials: DevicePtr,
    out: DevicePtr,
) -> Result<()> {
    let kernel = kernels::optim("sum_squares_partial", dtype);
    let acc = redline_tensor::stats_dtype(dtype);
    let blocks = squares_blocks(slots);
    for (i, chunk) in slots.chunks(LIST_MAX).enumerate() {
        let shape = LaunchShape {
            grid: [blocks as u32, chunk.len() as u32, 1],
            block: [THREADS, 1, 1],
        };
        let at = partials.offset(i * LIST_MAX * blocks * acc.size());
        let args = KernelArgs::new().bytes(&list(chunk)).ptr(at);
        gpu.launch(&kernel, shape, &args)?;
    }
    let args = KernelArgs::new()
        .ptr(partials)
        .i64(sum_squares_partials(slots) as i64)
        .ptr(out);
    let sum = format!("sum_partials<{}>", kernels::ctype(acc));
    gpu.launch(&sum, LaunchShape::linear(1, THREADS), &args)
}

pub fn scaler_update(
    gpu: &dyn Gpu,
    scale: Scalar,
    tracker: Scalar,
    found_inf: Scalar,
    p: &ScalerParams,
) -> Result<()> {
    let args = flag(
        flag(flag(KernelArgs::new(), Some(scale)), Some(tracker)),
        Some(found_inf),
    );
    let args = doubles(
        args,
        &[p.growth_factor, p.backoff_factor, p.growth_interval as f64],
    );
    gpu.launch("scaler_update", LaunchShape::linear(1, 32), &args)
}
