//! 2-d convolution and its input and weight gradients: cuDNN through [`Gpu::conv`] where the
//! GPU has it and it takes the layouts, else the direct kernels of `kernels/conv.cu`.

use redline_tensor::{Conv2dParams, DType, Layout, Result, TensorError};

use crate::convolution::{ConvPlan, Direction};
use crate::gpu::{DevicePtr, Gpu, KernelArgs, Strided};
use crate::kernels;
use crate::ops::elementwise::Operand;
use crate::ops::linear_shape;

/// Input channels a padded stem has: 4 × 2 bytes, the alignment cuDNN's tensor-core kernels
/// want of a half-precision NHWC channel run.
const PADDED_CHANNELS: usize = 4;

/// A half-precision channels-last convolution over 3 input channels (a network's stem), run as
/// one over 4 with a zero channel added to its input and weight: the same sums (the extra
/// products are zeros), where cuDNN would otherwise fall back from its tensor-core kernels.
/// The padded copies are scratch of the one op; parameters, checkpoints and the model keep 3
/// channels.
pub struct ChannelPad {
    /// The padded input: channels-last `[N, 4, H, W]`.
    pub input: Layout,
    /// The padded weight `[O, 4, KH, KW]`, in the weight's own order (OIHW or OHWI).
    pub weight: Layout,
}

impl ChannelPad {
    /// The padding for input `x` and a weight laid out as `w` (the weight's layout; for the
    /// weight gradient, the gradient's), if this convolution takes one.
    pub fn new(
        gpu: &dyn Gpu,
        dtype: DType,
        x: &Layout,
        w: &Layout,
        p: &Conv2dParams,
    ) -> Option<Self> {
        let half = matches!(dtype, DType::F16 | DType::BF16);
        let stem = x.shape().len() == 4 && x.shape()[1] == 3 && w.shape()[1] == 3 && p.groups == 1;
        if !(half && stem && in_order(x, true) && gpu.pads_stem_channels()) {
            return None;
        }
        let wider = |shape: &[usize]| {
            let mut shape = shape.to_vec();
            shape[1] = PADDED_CHANNELS;
            shape
        };
        let weight = match (in_order(w, false), in_order(w, true)) {
            (true, _) => Layout::contiguous(&wider(w.shape())),
            (_, true) => Layout::channels_last(&wider(w.shape())).ok()?,
            _ => return None,
        };
        let input = Layout::channels_last(&wider(x.shape())).ok()?;
        Some(Self { input, weight })
    }
}

/// Whether `l` is dense in NCHW order (`channels_last` false) or channels-last order, at any
/// offset (size-1 axes' strides are free).
fn in_order(l: &Layout, channels_last: bool) -> bool {
    let dense = match channels_last {
        true => Layout::channels_last(l.shape()),
        false => Ok(Layout::contiguous(l.shape())),
    };
    dense.is_ok_and(|d| l.strides_match(&d))
}

/// `from`'s channels copied into `to`, of `from`'s shape but another channel count and dense
/// in the same order (NCHW or channels-last, as a [`ChannelPad`]'s are): zeros in the channels
/// past `from`'s, `from`'s past `to`'s dropped. One launch that writes each element once — the
/// padded input and weight, and the padded weight's gradient cut back to the weight's channels.
pub fn copy_channels(gpu: &dyn Gpu, from: &Operand, to: &Operand) -> Result<()> {
    let (fs, ts) = (from.layout.shape(), to.layout.shape());
    let same_else = fs.len() == 4 && ts.len() == 4 && [0, 2, 3].iter().all(|&d| fs[d] == ts[d]);
    let order = [true, false]
        .into_iter()
        .find(|&last| in_order(from.layout, last) && in_order(to.layout, last));
    let (Some(channels_last), true, true) = (order, same_else, from.dtype == to.dtype) else {
        return Err(TensorError::Device(format!(
            "{}: copy_channels takes two dense 4-d tensors of one dtype in one order that differ \
             only in channels, not {:?} {from_layout:?} and {:?} {to_layout:?}",
            gpu.name(),
            from.dtype,
            to.dtype,
            from_layout = from.layout,
            to_layout = to.layout,
        )));
    };
    let [n, _, h, w] = [ts[0], ts[1], ts[2], ts[3]];
    let (outer, inner) = match channels_last {
        true => (n * h * w, 1),
        false => (n, h * w),
    };
    if outer * inner == 0 {
        return Ok(());
    }
    let size = from.dtype.size();
    let args = KernelArgs::new()
        .ptr(from.ptr.offset(from.layout.offset() * size))
        .ptr(to.ptr.offset(to.layout.offset() * size))
        .i64(outer as i64)
        .i64(fs[1] as i64)
        .i64(ts[1] as i64)
        .i64(inner as i64);
    let name = kernels::conv("copy_channels", from.dtype);
    gpu.launch(&name, linear_shape(outer * inner), &args)
}

/// The kernels' `ConvGeometry`: stride, padding, dilation and groups as seven i64.
fn geometry(args: KernelArgs, p: &Conv2dParams) -> KernelArgs {
    let words = [
        p.stride[0],
        p.stride[1],
        p.padding[0],
        p.padding[1],
        p.dilation[0],
        p.dilation[1],
        p.groups,
    ];
    let bytes: Vec<u8> = words
        .iter()
        .flat_map(|&v| (v as i64).to_ne_bytes())
        .collect();
    args.bytes(&bytes)
}

fn strided(gpu: &dyn Gpu, layout: &Layout, what: &str) -> Result<Strided> {
    Strided::new(layout, &gpu.name(), what)
}

/// `kernel(first, second, out, n, geometry)` over the `n` elements of `out_layout`.
fn launch(
    gpu: &dyn Gpu,
    kernel: &str,
    first: &Operand,
    second: &Operand,
    out: DevicePtr,
    out_layout: &Layout,
    p: &Conv2dParams,
) -> Result<()> {
    let n = out_layout.numel();
    if n == 0 {
        return Ok(());
    }
    let args = KernelArgs::new()
        .ptr(first.ptr)
        .strided(&strided(gpu, first.layout, kernel)?)
        .ptr(second.ptr)
        .strided(&strided(gpu, second.layout, kernel)?)
        .ptr(out)
        .strided(&strided(gpu, out_layout, kernel)?)
        .i64(n as i64);
    let name = kernels::conv(kernel, first.dtype);
    gpu.launch(&name, linear_shape(n), &geometry(args, p))
}

/// Through cuDNN when the GPU has it and it takes the plan: `[x, w, y]` in cuDNN's roles.
fn library(
    gpu: &dyn Gpu,
    direction: Direction,
    [x, w, y]: [(&Layout, DevicePtr); 3],
    dtype: DType,
    p: &Conv2dParams,
    accumulate: bool,
) -> Result<bool> {
    let Some(mut plan) = ConvPlan::new(dtype, direction, x.0, w.0, y.0, p) else {
        return Ok(false);
    };
    let first = |(l, ptr): (&Layout, DevicePtr)| ptr.offset(l.offset() * dtype.size());
    let operands = [first(x), first(w), first(y)];
    plan.aligned = operands.iter().all(|at| at.0 % 16 == 0);
    gpu.conv(&plan, operands, accumulate)
}

pub fn conv2d(
    gpu: &dyn Gpu,
    x: &Operand,
    w: &Operand,
    p: &Conv2dParams,
    out: &Operand,
) -> Result<()> {
    let roles = [(x.layout, x.ptr), (w.layout, w.ptr), (out.layout, out.ptr)];
    if library(gpu, Direction::Forward, roles, x.dtype, p, false)? {
        return Ok(());
    }
    launch(gpu, "conv2d", x, w, out.ptr, out.layout, p)
}

pub fn input_grad(
    gpu: &dyn Gpu,
    g: &Operand,
    w: &Operand,
    p: &Conv2dParams,
    out: &Operand,
) -> Result<()> {
    let roles = [(out.layout, out.ptr), (w.layout, w.ptr), (g.layout, g.ptr)];
    if library(gpu, Direction::InputGrad, roles, g.dtype, p, false)? {
        return Ok(());
    }
    launch(gpu, "conv2d_input_grad", g, w, out.ptr, out.layout, p)
}

/// [`input_grad`] added into what `out` holds, where cuDNN does it in the same call (β = 1);
/// `Ok(false)` (no cuDNN, or it will not for this plan): `out` is untouched, the caller adds.
pub fn input_grad_accumulate(
    gpu: &dyn Gpu,
    g: &Operand,
    w: &Operand,
    p: &Conv2dParams,
    out: &Operand,
) -> Result<bool> {
    let roles = [(out.layout, out.ptr), (w.layout, w.ptr), (g.layout, g.ptr)];
    library(gpu, Direction::InputGrad, roles, g.dtype, p, true)
}

/// Into `out`, the weight's shape in OIHW or channels-last (KRSC) order: cuDNN's two filter
/// formats.
pub fn weight_grad(
    gpu: &dyn Gpu,
    x: &Operand,
    g: &Operand,
    p: &Conv2dParams,
    out: &Operand,
) -> Result<()> {
    let roles = [(x.layout, x.ptr), (out.layout, out.ptr), (g.layout, g.ptr)];
    if library(gpu, Direction::WeightGrad, roles, x.dtype, p, false)? {
        return Ok(());
    }
    launch(gpu, "conv2d_weight_grad", x, g, out.ptr, out.layout, p)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::emulator::Emulator;

    /// Only half-precision channels-last stems of one group, on a GPU that pads, with a dense
    /// weight in either order; the padded weight keeps the weight's order.
    #[test]
    fn only_half_precision_channels_last_stems_are_padded() {
        let pads = Emulator::new().unwrap().pad_stem_channels(true);
        let plain = Emulator::new().unwrap();
        let x = Layout::channels_last(&[2, 3, 16, 16]).unwrap();
        let (w, w_last) = (
            Layout::contiguous(&[8, 3, 7, 7]),
            Layout::channels_last(&[8, 3, 7, 7]).unwrap(),
        );
        let p = Conv2dParams::default();
        let pad = ChannelPad::new(&pads, DType::BF16, &x, &w, &p).expect("a bf16 stem");
        assert_eq!(pad.input, Layout::channels_last(&[2, 4, 16, 16]).unwrap());
        assert_eq!(pad.weight, Layout::contiguous(&[8, 4, 7, 7]));
        let pad = ChannelPad::new(&pads, DType::F16, &x, &w_last, &p).expect("an f16 stem");
        assert_eq!(pad.weight, Layout::channels_last(&[8, 4, 7, 7]).unwrap());
        let none = |gpu: &dyn Gpu, dtype, x: &Layout, w: &Layout, p: &Conv2dParams| {
            ChannelPad::new(gpu, dtype, x, w, p).is_none()
        };
        assert!(
            none(&plain, DType::BF16, &x, &w, &p),
            "a GPU that does not pad"
        );
        assert!(none(&pads, DType::F32, &x, &w, &p), "f32");
        let nchw = Layout::contiguous(&[2, 3, 16, 16]);
        assert!(none(&pads, DType::BF16, &nchw, &w, &p), "an NCHW input");
        let four = Layout::channels_last(&[2, 4, 16, 16]).unwrap();
        let w4 = Layout::contiguous(&[8, 4, 7, 7]);
        assert!(
            none(&pads, DType::BF16, &four, &w4, &p),
            "4 channels already"
        );
        let grouped = Conv2dParams { groups: 3, ..p };
        let w1 = Layout::contiguous(&[6, 1, 7, 7]);
        assert!(none(&pads, DType::BF16, &x, &w1, &grouped), "grouped");
        // [8, 3, 7, 7] with the input channel outermost: neither OIHW nor OHWI.
        let odd_w = Layout::contiguous(&[3, 8, 7, 7])
            .permute(&[1, 0, 2, 3])
            .unwrap();
        assert_eq!(odd_w.shape(), [8, 3, 7, 7]);
        assert!(
            none(&pads, DType::BF16, &x, &odd_w, &p),
            "a weight in neither order"
        );
    }

    /// Padding and cutting back channels in both orders writes every element of `to` — the
    /// emulator's fresh memory is NaN — with `from`'s value or zero, both read and written at a
    /// view's offset, for inputs, 1×1 weights and a batch of one (size-1 axes' free strides).
    #[test]
    fn channels_are_copied_padded_with_zeros_or_cut_in_either_order() {
        let gpu = Emulator::new().unwrap();
        let f32s = |v: &[f32]| v.iter().flat_map(|x| x.to_ne_bytes()).collect::<Vec<u8>>();
        let at = |l: &Layout, i: &[usize]| {
            l.offset() + i.iter().zip(l.strides()).map(|(a, s)| a * s).sum::<usize>()
        };
        let shapes: [fn(usize) -> [usize; 4]; 3] =
            [|c| [2, c, 3, 5], |c| [6, c, 1, 1], |c| [1, c, 4, 2]];
        for shape in shapes {
            for channels_last in [true, false] {
                let dense = |c: usize, offset: usize| {
                    let l = match channels_last {
                        true => Layout::channels_last(&shape(c)).unwrap(),
                        false => Layout::contiguous(&shape(c)),
                    };
                    Layout::new(l.shape().to_vec(), l.strides().to_vec(), offset)
                };
                for (from_c, to_c) in [(3, 4), (4, 3), (3, 8), (3, 3)] {
                    let (from, to) = (dense(from_c, 7), dense(to_c, 5));
                    let values: Vec<f32> = (0..7 + from.numel()).map(|i| i as f32 + 0.5).collect();
                    let src = gpu.alloc(values.len() * 4).unwrap();
                    gpu.upload(src, &f32s(&values)).unwrap();
                    let dst = gpu.alloc((5 + to.numel()) * 4).unwrap();
                    let operand = |ptr, layout| Operand {
                        ptr,
                        dtype: DType::F32,
                        layout,
                    };
                    copy_channels(&gpu, &operand(src, &from), &operand(dst, &to)).unwrap();
                    let mut bytes = vec![0u8; (5 + to.numel()) * 4];
                    gpu.download(dst, &mut bytes).unwrap();
                    let got: Vec<f32> = bytes
                        .chunks(4)
                        .map(|b| f32::from_ne_bytes([b[0], b[1], b[2], b[3]]))
                        .collect();
                    assert!(got[..5].iter().all(|v| v.is_nan()), "before the view");
                    for k in 0..to.numel() {
                        let [_, c, h, w] = shape(to_c);
                        let i = [k / (c * h * w), k / (h * w) % c, k / w % h, k % w];
                        let want = match i[1] < from_c {
                            true => values[at(&from, &i)],
                            false => 0.0,
                        };
                        assert_eq!(
                            got[at(&to, &i)],
                            want,
                            "{:?}: {from_c} → {to_c} channels, channels-last {channels_last}, at {i:?}",
                            shape(1)
                        );
                    }
                }
            }
        }
        // Shapes that differ past the channels, layouts in two orders, two dtypes or another
        // rank are refused by name.
        let ptr = gpu.alloc(4096).unwrap();
        let nchw = Layout::contiguous(&[2, 3, 4, 4]);
        let refused = [
            (Layout::contiguous(&[2, 4, 4, 5]), DType::F32),
            (Layout::channels_last(&[2, 4, 4, 4]).unwrap(), DType::F32),
            (Layout::contiguous(&[2, 4, 4, 4]), DType::F16),
            (Layout::contiguous(&[2, 4, 16]), DType::F32),
        ];
        for (to, dtype) in &refused {
            let (a, b) = (
                Operand {
                    ptr,
                    dtype: DType::F32,
                    layout: &nchw,
                },
                Operand {
                    ptr,
                    dtype: *dtype,
                    layout: to,
                },
            );
            let err = copy_channels(&gpu, &a, &b).unwrap_err().to_string();
            assert!(err.contains("copy_channels takes"), "{err}");
        }
    }
}
