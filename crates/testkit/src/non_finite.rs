//! NaN and ±inf through every op whose handling of them the reference defines: the values the
//! conformance suite's drawn cases never hold, and what mixed precision's overflow detection
//! and the optimizers' skip rely on.

use redline_tensor::{
    BinaryOp, Conv2dParams, DType, Device, Op, Pool2dParams, Tensor, TensorError,
};

use crate::conformance::close;

/// Non-finite values, overflow and subnormals through every op mixed precision leans on,
/// against the reference in every float dtype the device declares (ARCHITECTURE.md lists
/// them): ReLU sends NaN and -inf to 0; maximum, minimum, max, argmax and max pooling take NaN
/// over any number (the first NaN, for argmax and pooling's positions) and -inf as a value
/// (PyTorch's); comparisons, sums and softmax are IEEE's; casts into integers are Rust's `as`;
/// convolutions may spread a non-finite value but never lose one; subnormals are kept, unless
/// the backend declares it may flush them ([`redline_tensor::Backend::may_flush_subnormals`]).
/// The random cases never draw these values, and a shading language need not keep them:
/// WGSL's `max(x, 0)` may return either operand for a NaN.
pub fn non_finite_values_as_the_reference(device: &Device) -> Result<(), String> {
    use redline_tensor::{
        AdamWParams, NnOp, OptimOp, OtherOp, ReduceOp, Result, SgdParams, UnaryOp,
    };
    const A: [f64; 10] = [
        f64::NAN,
        f64::INFINITY,
        f64::NEG_INFINITY,
        0.0,
        -0.0,
        1.5,
        -2.0,
        f64::NAN,
        f64::INFINITY,
        3.0,
    ];
    const B: [f64; 10] = [
        1.0,
        f64::INFINITY,
        f64::INFINITY,
        f64::NAN,
        f64::NEG_INFINITY,
        f64::NAN,
        -2.0,
        f64::NAN,
        f64::NEG_INFINITY,
        0.0,
    ];
    // Rows for reductions and pooling: infinite sums, inf - inf, NaN among numbers (twice),
    // all -inf (ties), signed zeros.
    #[rustfmt::skip]
    const R: [f64; 25] = [
        1.0, f64::INFINITY, -2.0, 3.0, 0.0,
        f64::INFINITY, f64::NEG_INFINITY, 1.0, 2.0, 3.0,
        -1.0, f64::NAN, 5.0, f64::NAN, 2.0,
        f64::NEG_INFINITY, f64::NEG_INFINITY, f64::NEG_INFINITY, f64::NEG_INFINITY, f64::NEG_INFINITY,
        -3.0, -1.0, -2.0, -0.0, -5.0,
    ];
    let tensor = |d: &Device, dtype: DType, values: &[f64], shape: &[usize]| {
        let mut bytes = vec![0u8; values.len() * dtype.size()];
        for (i, &v) in values.iter().enumerate() {
            dtype.write(&mut bytes, i, v);
        }
        Tensor::from_bytes(bytes, dtype, shape, d)
    };
    let supports = |op: Op, dtype: DType| device.backend().supports(op, dtype);
    let reference = Device::reference();
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        let compared = |compare: Compare, op: &str, run: &dyn Fn(&Device) -> Result<Tensor>| {
            let what = format!("{}: {dtype} {op}", device.name());
            against_reference(device, &reference, dtype, compare, &what, run)
        };
        let both = |op: &str, run: &dyn Fn(&Device) -> Result<Tensor>| compared(close, op, run);
        if supports(Op::Other(OtherOp::Convert), dtype) {
            // Into dtype from f32 past its range (to ±inf, as IEEE's round to nearest: f16's
            // largest is 65504, and 65520 rounds up to inf), and back out of it.
            #[rustfmt::skip]
            const WIDE: [f64; 10] = [
                1e5, -1e5, 65504.0, 65519.0, 65520.0, 3.4e38, f64::INFINITY, f64::NAN,
                f64::NEG_INFINITY, 1e-8,
            ];
            both(&format!("cast of f32 {WIDE:?}"), &|d| {
                tensor(d, DType::F32, &WIDE, &[10])?.cast(dtype)
            })?;
            both(&format!("cast to f32 of {A:?}"), &|d| {
                tensor(d, dtype, &A, &[10])?.cast(DType::F32)
            })?;
            // Sums past the range overflow to inf in dtype, not to its largest finite value.
            both("60000 + 60000 and 3e38 + 3e38", &|d| {
                let big = tensor(d, dtype, &[6e4, -6e4, 3e38, -3e38], &[4])?;
                big.add(&big)
            })?;
        }
        if supports(Op::Other(OtherOp::Convert), dtype)
            && supports(Op::Binary(BinaryOp::Mul), dtype)
        {
            // Subnormals are kept, not flushed to zero: f16's start below 6.1e-5 and f32's
            // (and bf16's) below 1.2e-38, and keeping small gradients representable is what
            // loss scaling is for. Each result is rounded once: compared exactly — or, on a
            // backend that declares it may flush them (WGSL allows it), exactly or zero where
            // the reference is subnormal.
            // (The inputs are f32's: a flush of either dtype may show.)
            let may_flush = |d: DType| device.backend().may_flush_subnormals(d);
            let kept: Compare = match may_flush(dtype) || may_flush(DType::F32) {
                true => exactly_or_flushed,
                false => exactly,
            };
            const TINY: [f64; 6] = [1e-5, 1e-7, -3e-6, 6e-8, 1e-40, -1e-42];
            compared(kept, &format!("cast of f32 {TINY:?}"), &|d| {
                tensor(d, DType::F32, &TINY, &[6])?.cast(dtype)
            })?;
            compared(kept, &format!("product of {TINY:?} and 0.5"), &|d| {
                let x = tensor(d, DType::F32, &TINY, &[6])?.cast(dtype)?;
                x.mul(&tensor(d, dtype, &[0.5; 6], &[6])?)
            })?;
        }
        for &op in UnaryOp::ALL {
            if supports(Op::Unary(op), dtype) {
                both(&format!("{op:?} of {A:?}"), &|d| {
                    tensor(d, dtype, &A, &[10])?.unary(op)
                })?;
            }
        }
        for &op in BinaryOp::ALL {
            // pow's non-finite cases are libm's, not a semantics the suite defines.
            if op == BinaryOp::Pow || !supports(Op::Binary(op), dtype) {
                continue;
            }
            both(&format!("{op:?} of {A:?} and {B:?}"), &|d| {
                tensor(d, dtype, &A, &[10])?.binary(op, &tensor(d, dtype, &B, &[10])?)
            })?;
        }
        // Along either axis of R.
        type AlongAxis = fn(&Tensor, usize) -> Result<Tensor>;
        let along: [(Op, AlongAxis); 5] = [
            (Op::Reduce(ReduceOp::Sum), |x, a| x.sum(&[a], false)),
            (Op::Reduce(ReduceOp::Max), |x, a| x.max(&[a], false)),
            (Op::Reduce(ReduceOp::ArgMax), |x, a| x.argmax(a, false)),
            (Op::Nn(NnOp::Softmax), |x, a| x.softmax(a)),
            (Op::Nn(NnOp::LogSoftmax), |x, a| x.log_softmax(a)),
        ];
        for (op, run) in along.into_iter().filter(|&(op, _)| supports(op, dtype)) {
            for axis in [0, 1] {
                both(&format!("{op:?} over axis {axis} of {R:?}"), &|d| {
                    run(&tensor(d, dtype, &R, &[5, 5])?, axis)
                })?;
            }
        }
        if dtype == DType::F32 {
            // A row whose values all lie below -3.4e38 (f32's range ends at -3.4028e38): its
            // maximum is one of them, not a stand-in for -inf.
            const LOW: [f64; 3] = [-3.4028e38, -3.401e38, -3.4015e38];
            for (op, run) in [
                (
                    NnOp::Softmax,
                    (|x, _| x.softmax(1)) as fn(&Tensor, &Tensor) -> Result<Tensor>,
                ),
                (NnOp::LogSoftmax, |x, _| x.log_softmax(1)),
                (NnOp::CrossEntropy, |x, t| x.cross_entropy(t, 0.1, None)),
            ] {
                if supports(Op::Nn(op), dtype) {
                    both(&format!("{op:?} of {LOW:?}"), &|d| {
                        let targets = Tensor::from_slice(&[1i64], &[1], d)?;
                        run(&tensor(d, dtype, &LOW, &[1, 3])?, &targets)
                    })?;
                }
            }
        }
        if [NnOp::BatchNormStats, NnOp::BatchNormApply]
            .iter()
            .all(|&op| supports(Op::Nn(op), dtype))
        {
            // Training batch norm over channels holding a NaN, an inf and numbers, plain and
            // with a residual and ReLU: outputs, running statistics (a NaN variance clamps to
            // 0, as the reference) and the gradients of x, the weight, the bias and the
            // residual.
            for fused in [false, true] {
                let label = match fused {
                    false => "training batch_norm",
                    true => "training relu(batch_norm + residual)",
                };
                both(
                    &format!("{label} of channels with NaN, inf and numbers"),
                    &|d| {
                        #[rustfmt::skip]
                    let values = [
                        1.0, f64::NAN, 2.0, 3.0, f64::INFINITY, 1.0,
                        4.0, -1.0, 0.5, 2.0, 2.0, 3.0,
                    ];
                        let x = tensor(d, dtype, &values, &[2, 3, 1, 2])?.with_requires_grad(true);
                        let residual =
                            tensor(d, dtype, &[0.5, -1.0, 2.0].repeat(4), &[2, 3, 1, 2])?
                                .with_requires_grad(true);
                        let stats = redline_tensor::stats_dtype(dtype);
                        let per_channel = |v: f64| tensor(d, stats, &[v; 3], &[3]);
                        let (mean, var) = (per_channel(0.0)?, per_channel(1.0)?);
                        let running = redline_tensor::RunningStats {
                            mean: &mean,
                            var: &var,
                            momentum: 0.1,
                        };
                        let w = per_channel(1.5)?.with_requires_grad(true);
                        let b = per_channel(-0.5)?.with_requires_grad(true);
                        let (w_, b_, r) = (Some(&w), Some(&b), Some(running));
                        let y = match fused {
                            false => x.batch_norm(w_, b_, r, true, 1e-5)?,
                            true => x.batch_norm_relu(w_, b_, r, true, 1e-5, Some(&residual))?,
                        };
                        let ramp: Vec<f64> = (1..=12).map(f64::from).collect();
                        let weights = tensor(d, dtype, &ramp, &[2, 3, 1, 2])?;
                        y.mul(&weights)?.sum(&[], false)?.backward()?;
                        let grad = |t: &Tensor| {
                            t.grad()
                                .ok_or_else(|| TensorError::Autograd("no gradient".into()))
                        };
                        let mut outputs =
                            vec![y.detach(), mean, var, grad(&x)?, grad(&w)?, grad(&b)?];
                        if fused {
                            outputs.push(grad(&residual)?);
                        }
                        let flat: Vec<Tensor> = (outputs.iter())
                            .map(|t| t.cast(DType::F32)?.flatten())
                            .collect::<Result<_>>()?;
                        Tensor::concat(&flat.iter().collect::<Vec<_>>(), 0)
                    },
                )?;
            }
        }
        // Products through matmul and convolution, and their gradients: inf · 0 is NaN, an inf
        // or NaN reaches every sum it enters (no kernel may skip a zero operand or pad with
        // values that meet an inf). X as [3, 6]: an inf in row 0, a NaN in row 2.
        #[rustfmt::skip]
        const X: [f64; 18] = [
            1.0, f64::INFINITY, 0.0, 2.0, -1.0, 0.5, 0.0, 1.0, 3.0,
            0.5, 1.0, -2.0, 0.0, f64::NAN, 1.0, 2.0, 0.0, -1.0,
        ];
        if supports(Op::Other(OtherOp::Matmul), dtype) {
            both(&format!("matmul of [3, 6] {X:?} by its transpose"), &|d| {
                let a = tensor(d, dtype, &X, &[3, 6])?;
                a.matmul(&a.transpose(0, 1)?)
            })?;
        }
        let conv_ops = [NnOp::Conv2d, NnOp::Conv2dInputGrad, NnOp::Conv2dWeightGrad];
        if conv_ops.iter().all(|&op| supports(Op::Nn(op), dtype)) {
            // x [1, 2, 6, 6]: an inf in channel 0's first corner, a NaN in channel 1's last;
            // outputs and input gradients away from them are finite, and compared. The
            // weights [2, 2, 3, 3] hold zeros. Σ y² is the loss, so the output's gradient (2y)
            // carries the inf and NaN too.
            let mut xs: Vec<f64> = (0..72).map(|i| ((i * 7) % 11) as f64 / 4.0 - 1.0).collect();
            (xs[0], xs[71]) = (f64::INFINITY, f64::NAN);
            let ws = [0.0, 1.0, -1.0, 0.5].repeat(9);
            let p = Conv2dParams {
                padding: [1, 1],
                ..Conv2dParams::default()
            };
            for last in [false, true] {
                let run = |d: &Device, which: usize| -> Result<Tensor> {
                    let mut x = tensor(d, dtype, &xs, &[1, 2, 6, 6])?;
                    let mut w = tensor(d, dtype, &ws, &[2, 2, 3, 3])?;
                    if last {
                        (x, w) = (x.to_channels_last()?, w.to_channels_last()?);
                    }
                    let (x, w) = (x.with_requires_grad(true), w.with_requires_grad(true));
                    let y = x.conv2d(&w, None, p)?;
                    if which == 0 {
                        return Ok(y.detach());
                    }
                    y.mul(&y)?.sum(&[], false)?.backward()?;
                    let grad = if which == 1 { x.grad() } else { w.grad() };
                    grad.ok_or_else(|| TensorError::Autograd("no gradient".into()))
                };
                let order = if last { "channels-last" } else { "NCHW" };
                let outputs = [
                    "conv2d",
                    "conv2d's input gradient",
                    "conv2d's weight gradient",
                ];
                for (which, what) in outputs.iter().enumerate() {
                    // cuDNN's transform algorithms (FFT, Winograd) may turn an inf into NaN or
                    // spread it: what training relies on is that none disappears.
                    let label = format!("{order} {what} over an inf and a NaN");
                    compared(non_finite_kept, &label, &|d| run(d, which))?;
                }
            }
        }
        if supports(Op::Nn(NnOp::CrossEntropy), dtype) {
            // The fused loss and its logits' gradient, row by row (one NaN row would make a
            // batch's mean NaN whatever the others gave): a NaN or inf logit must reach both
            // (GradScaler skips the step on the gradient), with and without smoothing. A -inf
            // logit that is not the target is a masked class: without smoothing the loss stays
            // finite (PyTorch's), with it the loss is inf.
            #[rustfmt::skip]
            const MASKED: [f64; 5] = [1.0, f64::NEG_INFINITY, 2.0, 0.5, f64::NEG_INFINITY];
            let rows = R.chunks(5).chain([&MASKED[..]]);
            for (row, values) in rows.enumerate() {
                for smoothing in [0.0, 0.1] {
                    for what in ["loss", "gradient"] {
                        let label =
                            format!("cross-entropy {what} of {values:?} (smoothing {smoothing})");
                        both(&label, &|d| {
                            let x = tensor(d, dtype, values, &[1, 5])?.with_requires_grad(true);
                            let target = [1i64, 0, 2, 4, 3, 2][row];
                            let targets = Tensor::from_slice(&[target], &[1], d)?;
                            let loss = x.cross_entropy(&targets, smoothing, None)?;
                            if what == "loss" {
                                return Ok(loss);
                            }
                            loss.backward()?;
                            x.grad()
                                .ok_or_else(|| TensorError::Autograd("no logits' gradient".into()))
                        })?;
                    }
                }
            }
        }
        if supports(Op::Nn(NnOp::MaxPool2d), dtype) && supports(Op::Nn(NnOp::MaxPool2dGrad), dtype)
        {
            // Overlapping 2×2 windows, and 1×2 ones (four all -inf): the first NaN wins a
            // window, else the first maximum; the gradient goes where the value came from.
            // NCHW with one channel, and channels-last with 8 (R rotated by 3k in channel k:
            // whole 16-byte packs of every dtype).
            let planes: Vec<f64> = (0..8)
                .flat_map(|k| (0..25).map(move |i| R[(i + 3 * k) % 25]))
                .collect();
            let inputs = [(&planes[..25], 1, false), (&planes[..], 8, true)];
            for (kernel, (values, c, last)) in [[2, 2], [1, 2]]
                .into_iter()
                .flat_map(|k| inputs.map(|i| (k, i)))
            {
                let p = Pool2dParams {
                    kernel,
                    stride: [1, 1],
                    padding: [0, 0],
                };
                let input = |d: &Device| -> Result<Tensor> {
                    let x = tensor(d, dtype, values, &[1, c, 5, 5])?;
                    if last {
                        x.to_channels_last()
                    } else {
                        Ok(x)
                    }
                };
                let label = format!(
                    "{kernel:?} max_pool2d over {c} channel(s) of {R:?}{}",
                    if last { ", channels-last" } else { "" }
                );
                both(&label, &|d| input(d)?.max_pool2d(p))?;
                both(&format!("{label}: gradient"), &|d| {
                    let x = input(d)?.with_requires_grad(true);
                    let y = x.max_pool2d(p)?;
                    let n = y.shape().iter().product::<usize>();
                    let ramp: Vec<f64> = (1..=n).map(|i| (i % 64) as f64).collect();
                    y.mul(&tensor(d, dtype, &ramp, y.shape())?)?
                        .sum(&[], false)?
                        .backward()?;
                    x.grad()
                        .ok_or_else(|| TensorError::Autograd("no input gradient".into()))
                })?;
            }
        }
        if supports(Op::Optim(OptimOp::UnscaleCheck), dtype) {
            // GradScaler's check over three gradients, one holding `bad`, into an f32 flag that
            // starts at `raised`: the flag goes up on NaN, inf or -inf in any of them, and stays
            // up once up; the gradients are unscaled either way.
            for (bad, raised) in [
                (f64::NAN, 0.0),
                (f64::INFINITY, 0.0),
                (f64::NEG_INFINITY, 0.0),
                (2.0, 0.0),
                (2.0, 1.0),
            ] {
                both(
                    &format!("unscale_check with {bad} among the gradients, flag at {raised}"),
                    &|d| {
                        let grads = [
                            tensor(d, dtype, &[1.0, -2.0, 3.0], &[3])?,
                            tensor(d, dtype, &[4.0, bad, 5.0], &[3])?,
                            tensor(d, dtype, &[6.0, 8.0], &[2])?,
                        ];
                        let found = tensor(d, DType::F32, &[raised], &[1])?;
                        let inv_scale = tensor(d, DType::F32, &[0.5], &[1])?;
                        redline_tensor::optim::unscale_check(
                            &grads.each_ref(),
                            &inv_scale,
                            &found,
                        )?;
                        let flat: Vec<Tensor> = grads
                            .iter()
                            .chain([&found.cast(dtype)?])
                            .map(|t| t.flatten())
                            .collect::<Result<_>>()?;
                        Tensor::concat(&flat.iter().collect::<Vec<_>>(), 0)
                    },
                )?;
            }
        }
        // The optimizers read GradScaler's f32 flag, step and learning rate beside parameters
        // of any dtype: a raised flag leaves everything, the step included, as it was.
        for raised in [0.0, 1.0] {
            let scalars = |d: &Device| -> Result<[Tensor; 3]> {
                let f32s = |v: f64| tensor(d, DType::F32, &[v], &[1]);
                Ok([f32s(1.0)?, f32s(0.1)?, f32s(raised)?])
            };
            let joined = |ts: &[&Tensor]| -> Result<Tensor> {
                let flat: Vec<Tensor> = (ts.iter())
                    .map(|t| t.cast(dtype)?.flatten())
                    .collect::<Result<_>>()?;
                Tensor::concat(&flat.iter().collect::<Vec<_>>(), 0)
            };
            let state = |d: &Device, values: &[f64]| tensor(d, dtype, values, &[3]);
            if supports(Op::Optim(OptimOp::Sgd), dtype) {
                both(&format!("sgd with an f32 flag at {raised}"), &|d| {
                    let [step, lr, found] = scalars(d)?;
                    let (p, g) = (state(d, &[1.0, -2.0, 3.0])?, state(d, &[0.5, 0.5, -1.0])?);
                    let m = state(d, &[0.25, 0.0, -0.5])?;
                    let hp = SgdParams {
                        lr_scale: 1.0,
                        momentum: 0.5,
                        dampening: 0.0,
                        weight_decay: 0.0,
                        nesterov: false,
                    };
                    redline_tensor::optim::sgd(&[&p], &[&g], &[&m], &step, &lr, &hp, Some(&found))?;
                    joined(&[&p, &m, &step])
                })?;
            }
            if supports(Op::Optim(OptimOp::AdamW), dtype) {
                both(&format!("adamw with an f32 flag at {raised}"), &|d| {
                    let [step, lr, found] = scalars(d)?;
                    let (p, g) = (state(d, &[1.0, -2.0, 3.0])?, state(d, &[0.5, 0.5, -1.0])?);
                    let (m, v) = (state(d, &[0.25, 0.0, -0.5])?, state(d, &[0.5, 0.25, 1.0])?);
                    let hp = AdamWParams {
                        lr_scale: 1.0,
                        beta1: 0.5,
                        beta2: 0.75,
                        eps: 1e-3,
                        weight_decay: 0.0,
                    };
                    let (ps, gs, ms, vs) = ([&p], [&g], [&m], [&v]);
                    redline_tensor::optim::adamw(
                        &ps,
                        &gs,
                        &ms,
                        &vs,
                        &step,
                        &lr,
                        &hp,
                        Some(&found),
                    )?;
                    joined(&[&p, &m, &v, &step])
                })?;
            }
        }
        if supports(Op::Optim(OptimOp::SumSquares), dtype) {
            // Gradient clipping's norm: inf from an inf, NaN from a NaN, in any of the tensors.
            for bad in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
                both(
                    &format!("sum_squares with {bad} in the second of three"),
                    &|d| {
                        let ts = [
                            tensor(d, dtype, &[1.0, -2.0], &[2])?,
                            tensor(d, dtype, &[3.0, bad], &[2])?,
                            tensor(d, dtype, &[4.0], &[1])?,
                        ];
                        redline_tensor::optim::sum_squares(&ts.each_ref())
                    },
                )?;
            }
        }
        if supports(Op::Nn(NnOp::BatchNormApply), dtype) {
            // coef rows [a; b; d] = 1, 0, 1: relu(x) and relu(x + y), fused.
            let coef = |d: &Device| {
                let stats = redline_tensor::stats_dtype(dtype);
                tensor(d, stats, &[1.0, 1.0, 0.0, 0.0, 1.0, 1.0], &[3, 2])
            };
            both(&format!("batch_norm_apply relu of {A:?}"), &|d| {
                let x = tensor(d, dtype, &A, &[1, 2, 1, 5])?;
                x.batch_norm_apply(None, &coef(d)?, true, None)
            })?;
            both(
                &format!("batch_norm_apply relu(x + y) of {A:?} and {B:?}"),
                &|d| {
                    let x = tensor(d, dtype, &A, &[1, 2, 1, 5])?;
                    let y = tensor(d, dtype, &B, &[1, 2, 1, 5])?;
                    x.batch_norm_apply(Some(&y), &coef(d)?, true, None)
                },
            )?;
        }
    }
    // Into integers: toward zero, saturating, NaN to 0 (Rust's `as`, which the reference
    // uses; C's and WGSL's conversions leave these undefined or indeterminate).
    #[rustfmt::skip]
    const TO_INT: [f64; 10] = [
        f64::NAN, f64::INFINITY, f64::NEG_INFINITY, 3e9, -3e9, 1e20, 300.0, 255.7, -1.5, 2.5,
    ];
    for int in [DType::U8, DType::I32, DType::I64] {
        if !supports(Op::Other(OtherOp::Convert), int) {
            continue;
        }
        // The integers, and read back into f32 (both words of an i64).
        let what = format!("{}: cast of f32 {TO_INT:?} to {int}", device.name());
        let ints = |d: &Device| tensor(d, DType::F32, &TO_INT, &[10])?.cast(int);
        against_reference(device, &reference, int, exactly, &what, &ints)?;
        let back = |d: &Device| ints(d)?.cast(DType::F32);
        let what = format!("{what} and back");
        against_reference(device, &reference, int, exactly, &what, &back)?;
    }
    // i64s that need both words and more than an f32's 24 bits, read into f32 with one
    // rounding (2^32 + 2^31 + 767 rounds down; two roundings would take it up).
    const WIDE_I64: [i64; 8] = [
        6_442_451_711,
        -6_442_451_711,
        i64::MAX,
        i64::MIN,
        -1,
        -4_294_967_296,
        9_007_199_254_740_993,
        -10_000_000_000,
    ];
    if supports(Op::Other(OtherOp::Convert), DType::I64) {
        let what = format!("{}: cast of i64 {WIDE_I64:?} to f32", device.name());
        let run = |d: &Device| Tensor::from_slice(&WIDE_I64, &[8], d)?.cast(DType::F32);
        against_reference(device, &reference, DType::F32, exactly, &what, &run)?;
    }
    Ok(())
}

/// How a device's values are held against the reference's.
type Compare = fn(&[f64], &[f64], DType, &str) -> Result<(), String>;

/// `run` on `device` and on `reference`, the values compared by `compare` (`dtype` sets its
/// tolerance); errors name `what`.
fn against_reference(
    device: &Device,
    reference: &Device,
    dtype: DType,
    compare: Compare,
    what: &str,
    run: &dyn Fn(&Device) -> redline_tensor::Result<Tensor>,
) -> Result<(), String> {
    let got = run(device).and_then(|t| t.to_f64_vec());
    let want = run(reference).and_then(|t| t.to_f64_vec());
    match (got, want) {
        (Ok(got), Ok(want)) => compare(&got, &want, dtype, what),
        (Err(e), _) => Err(format!("{what}: {e}")),
        (_, Err(e)) => Err(format!("{what} on the reference: {e}")),
    }
}

/// `got` keeps every non-finite value of `want` non-finite (of any kind), and matches its
/// finite values where it is finite itself: a transform convolution may spread a NaN or turn
/// an inf into one, but must not hide either.
fn non_finite_kept(got: &[f64], want: &[f64], dtype: DType, what: &str) -> Result<(), String> {
    if got.len() != want.len() {
        return close(got, want, dtype, what);
    }
    if let Some(i) = (0..got.len()).find(|&i| !want[i].is_finite() && got[i].is_finite()) {
        let (g, w) = (got[i], want[i]);
        return Err(format!(
            "{what}[{i}] = {g}, reference {w}: a non-finite value lost"
        ));
    }
    let (g, w): (Vec<f64>, Vec<f64>) = (got.iter().zip(want))
        .filter(|(g, _)| g.is_finite())
        .map(|(&g, &w)| (g, w))
        .unzip();
    close(&g, &w, dtype, &format!("{what} (where finite)"))
}

/// Bit for bit (as f64 values): for results every backend rounds once, where a tolerance
/// would hide a flushed subnormal.
fn exactly(got: &[f64], want: &[f64], _dtype: DType, what: &str) -> Result<(), String> {
    match got == want {
        true => Ok(()),
        false => Err(format!("{what}: {got:?}, reference {want:?}")),
    }
}

/// [`exactly`], except that a zero stands for a reference value that is subnormal in `dtype`:
/// for a backend that may flush subnormals. Any other difference fails, a lost normal value
/// included.
fn exactly_or_flushed(got: &[f64], want: &[f64], dtype: DType, what: &str) -> Result<(), String> {
    let flushed = |g: f64, w: f64| g == 0.0 && dtype.is_subnormal(w);
    let same =
        got.len() == want.len() && got.iter().zip(want).all(|(&g, &w)| g == w || flushed(g, w));
    match same {
        true => Ok(()),
        false => Err(format!(
            "{what}: {got:?}, reference {want:?} (a zero may stand only for a subnormal)"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_zero_stands_only_for_a_subnormal_of_the_dtype() {
        let ok = |got: &[f64], want: &[f64], dtype| exactly_or_flushed(got, want, dtype, "x");
        assert!(ok(&[0.0, -0.0, 1.5], &[1e-40, -1e-42, 1.5], DType::F32).is_ok());
        assert!(ok(&[0.0, 1e-40], &[1e-6, 1e-40], DType::F16).is_ok());
        // A normal value of the dtype zeroed, a subnormal changed, a length changed.
        let err = ok(&[0.0], &[1e-30], DType::F32).unwrap_err();
        assert!(
            err.contains("a zero may stand only for a subnormal"),
            "{err}"
        );
        assert!(ok(&[0.0], &[1e-4], DType::F16).is_err());
        assert!(ok(&[2e-40], &[1e-40], DType::F32).is_err());
        assert!(ok(&[0.0], &[0.0, 0.0], DType::F32).is_err());
    }
}
