//! Launchers of `kernels/optim.cu`: multi-tensor SGD and AdamW, unscale-and-check, and the
//! GradScaler update. Tensors go to the kernels in lists of up to [`LIST_MAX`] by value, one
//! launch per list over a flat grid (each tensor gets the blocks its length needs); scalars
//! (found-inf, step, scale, growth tracker) stay on the device.

use redline_tensor::{AdamWParams, DType, Result, ScalerParams, SgdParams};

use crate::gpu::{DevicePtr, Gpu, KernelArgs, LaunchShape};
use crate::kernels;
use crate::ops::THREADS;

/// Tensors per launch (`LIST_MAX` in `kernels/optim.cu`): a list of 512 is 22,536 bytes of
/// kernel parameters, within the 32,764 CUDA 12.1 allows, so ResNet-50's 161 parameters are
/// one launch per op.
pub const LIST_MAX: usize = 512;

/// The most blocks an update gives one tensor; longer tensors are walked grid-stride.
const UPDATE_BLOCKS: usize = 1024;

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

/// The blocks a tensor of `len` elements gets: one per THREADS elements, at most `most`.
fn blocks_for(len: usize, most: usize) -> usize {
    len.div_ceil(THREADS as usize).min(most)
}

/// The kernels' `TensorList` for up to LIST_MAX slots, each given [`blocks_for`] its length
/// (at most `most`) in a flat grid; returns its bytes and the grid's blocks.
fn list(slots: &[Slot], most: usize) -> (Vec<u8>, usize) {
    debug_assert!(slots.len() <= LIST_MAX);
    let mut ptrs = vec![[0u64; LIST_MAX]; 4];
    let mut lens = [0i64; LIST_MAX];
    let mut first_block = [0i32; LIST_MAX];
    let mut blocks = 0;
    for (t, slot) in slots.iter().enumerate() {
        for (k, p) in slot.ptrs.iter().enumerate() {
            ptrs[k][t] = p.0;
        }
        lens[t] = slot.len as i64;
        first_block[t] = blocks as i32;
        blocks += blocks_for(slot.len, most);
    }
    let mut bytes: Vec<u8> = ptrs
        .iter()
        .flatten()
        .flat_map(|p| p.to_ne_bytes())
        .collect();
    bytes.extend(lens.iter().flat_map(|n| n.to_ne_bytes()));
    bytes.extend(first_block.iter().flat_map(|b| b.to_ne_bytes()));
    bytes.extend((slots.len() as i32).to_ne_bytes());
    bytes.extend(0i32.to_ne_bytes());
    (bytes, blocks)
}

/// Launches `kernel` once per list of up to LIST_MAX slots, over the list's flat grid.
fn per_list(
    gpu: &dyn Gpu,
    kernel: &str,
    slots: &[Slot],
    tail: impl Fn(KernelArgs) -> KernelArgs,
) -> Result<()> {
    for chunk in slots.chunks(LIST_MAX) {
        let (bytes, blocks) = list(chunk, UPDATE_BLOCKS);
        if blocks == 0 {
            continue;
        }
        let shape = LaunchShape::linear(blocks as u32, THREADS);
        gpu.launch(kernel, shape, &tail(KernelArgs::new().bytes(&bytes)))?;
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

/// How many partial sums [`sum_squares`] writes for `slots`: one per block of its first pass.
pub fn sum_squares_partials(slots: &[Slot]) -> usize {
    slots
        .iter()
        .map(|s| blocks_for(s.len, SQUARES_BLOCKS))
        .sum()
}

/// Σ x² over every slot's first storage into the one-element `out` (of `dtype`'s accumulation
/// type): per list, each block of the flat grid writes its partial into `partials`
/// ([`sum_squares_partials`] long, list after list: every entry written); one block then sums
/// them all, in a fixed order.
pub fn sum_squares(
    gpu: &dyn Gpu,
    dtype: DType,
    slots: &[Slot],
    partials: DevicePtr,
    out: DevicePtr,
) -> Result<()> {
    let kernel = kernels::optim("sum_squares_partial", dtype);
    let acc = redline_tensor::stats_dtype(dtype);
    let mut written = 0;
    for chunk in slots.chunks(LIST_MAX) {
        let (bytes, blocks) = list(chunk, SQUARES_BLOCKS);
        if blocks == 0 {
            continue;
        }
        let at = partials.offset(written * acc.size());
        let args = KernelArgs::new().bytes(&bytes).ptr(at);
        gpu.launch(&kernel, LaunchShape::linear(blocks as u32, THREADS), &args)?;
        written += blocks;
    }
    let args = KernelArgs::new().ptr(partials).i64(written as i64).ptr(out);
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
