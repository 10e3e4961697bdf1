//! The conformance suite: one call runs every op of a backend against the reference.

use std::fmt::Write as _;

use proptest::strategy::{Strategy, ValueTree};
use proptest::test_runner::{Config, RngAlgorithm, TestCaseError, TestError, TestRng, TestRunner};
use redline_tensor::{
    BinaryOp, Conv2dParams, DType, Device, Op, Pool2dParams, Tensor, TensorError,
};

use crate::case::{Case, ViewKind};
use crate::gradcheck::loss_weights;
use crate::strategies;

/// How hard to test.
#[derive(Debug, Clone)]
pub struct SuiteConfig {
    /// Proptest cases per declared (op, dtype) pair.
    pub cases: u32,
    /// How long a failure may shrink, in milliseconds.
    pub max_shrink_ms: u32,
}

impl Default for SuiteConfig {
    fn default() -> Self {
        Self {
            cases: 24,
            max_shrink_ms: 10_000,
        }
    }
}

/// What happened to one (op, dtype) pair.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Cell {
    /// Declared, and every case matched the reference.
    Passed,
    /// Declared, and a case did not match (see the report's failures).
    Failed,
    /// Not declared, and the device refused it with the clear error.
    Refused,
    /// The reference has no such pair either.
    NotApplicable,
}

/// The suite's result: the matrix it ran and every failure, shrunk to a readable case.
#[derive(Debug, Clone)]
pub struct Report {
    pub device: String,
    pub cells: Vec<(Op, DType, Cell)>,
    pub failures: Vec<String>,
}

impl Report {
    pub fn passed(&self) -> bool {
        self.failures.is_empty()
    }

    /// The (op, dtype) matrix: ✓ passed, ✗ failed, · refused (undeclared), blank n/a.
    pub fn matrix(&self) -> String {
        // The op column as wide as the longest name, and two spaces.
        let width = self.cells.iter().map(|(op, ..)| op.name().len()).max();
        let width = width.unwrap_or(0).max(2) + 2;
        let mut out = format!(
            "conformance of {} against the reference\n{:<width$}",
            self.device, "op"
        );
        for d in DType::ALL {
            let _ = write!(out, "{:>6}", d.to_string());
        }
        let mut current = None;
        for (op, _, cell) in &self.cells {
            if current != Some(*op) {
                current = Some(*op);
                let _ = write!(out, "\n{:<width$}", op.name());
            }
            let mark = match cell {
                Cell::Passed => "✓",
                Cell::Failed => "✗",
                Cell::Refused => "·",
                Cell::NotApplicable => " ",
            };
            let _ = write!(out, "{mark:>6}");
        }
        let left_out: Vec<String> = self
            .cells
            .iter()
            .filter(|(_, d, c)| *c == Cell::Refused && matches!(d, DType::F32 | DType::F16))
            .map(|(o, d, _)| format!("{o}/{d}"))
            .collect();
        let _ = write!(
            out,
            "\n✓ passed  ✗ failed  · undeclared (refused with the clear error)\nundeclared f32/f16 pairs: {}\n",
            if left_out.is_empty() { "none".to_string() } else { left_out.join(", ") }
        );
        out
    }

    /// Panics with the matrix and every failure unless the suite passed.
    pub fn assert_passed(&self) {
        assert!(
            self.passed(),
            "{}\n{} failure(s):\n{}",
            self.matrix(),
            self.failures.len(),
            self.failures.join("\n\n")
        );
    }
}

/// Relative and absolute tolerance for comparing `dtype` results with the reference.
pub fn tolerance(dtype: DType) -> (f64, f64) {
    match dtype {
        DType::F64 => (1e-9, 1e-9),
        DType::F32 => (1e-4, 1e-5),
        DType::F16 => (1e-2, 1e-2),
        DType::BF16 => (4e-2, 4e-2),
        DType::U8 | DType::I32 | DType::I64 => (0.0, 0.0),
    }
}

pub(crate) fn close(got: &[f64], want: &[f64], dtype: DType, what: &str) -> Result<(), String> {
    close_at(got, want, dtype, what, None)
}

/// [`close`], each element relative to the larger of its reference value and its `scales`
/// entry (the 2-norm of the terms a sum cancelled: [`crate::cancellation`]).
pub(crate) fn close_at(
    got: &[f64],
    want: &[f64],
    dtype: DType,
    what: &str,
    scales: Option<&[f64]>,
) -> Result<(), String> {
    if got.len() != want.len() {
        return Err(format!(
            "{what}: {} elements, the reference has {}",
            got.len(),
            want.len()
        ));
    }
    let (rtol, atol) = tolerance(dtype);
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let scale = scales
            .and_then(|s| s.get(i))
            .map_or(w.abs(), |&s| s.max(w.abs()));
        // An infinite reference matches only itself: |g - inf| <= rtol * inf holds for any g.
        let near = w.is_finite() && (g - w).abs() <= atol + rtol * scale;
        let ok = (g.is_nan() && w.is_nan()) || g == w || near;
        if !ok {
            let at = match scale > w.abs() {
                true => format!(" of its terms' 2-norm {scale}"),
                false => String::new(),
            };
            return Err(format!(
                "{what}[{i}] = {g}, reference {w} (tolerance {rtol} rel{at}, {atol} abs)"
            ));
        }
    }
    Ok(())
}

/// A case's output values, input gradients and output shape on one device.
type Outcome = (Vec<f64>, Vec<Vec<f64>>, Vec<usize>);

/// Runs `case` on both devices and compares outputs and (when differentiable) input gradients.
pub fn compare(device: &Device, reference: &Device, case: &Case) -> Result<(), String> {
    let err = |dev: &Device, e: TensorError| format!("on {dev}: {e}");
    let grads = case.differentiable();
    let grad_inputs = case.grad_inputs();
    let run = |dev: &Device| -> Result<Outcome, String> {
        let built: Vec<(Tensor, Tensor)> = case
            .inputs
            .iter()
            .enumerate()
            .map(|(i, x)| x.build_leaf(dev, grads && grad_inputs.contains(&i)))
            .collect::<Result<_, _>>()
            .map_err(|e| err(dev, e))?;
        let views: Vec<Tensor> = built.iter().map(|(_, v)| v.clone()).collect();
        let y = case.apply(&views).map_err(|e| err(dev, e))?;
        let out = y.to_f64_vec().map_err(|e| err(dev, e))?;
        let mut input_grads = Vec::new();
        if grads {
            let w = loss_weights(&y).map_err(|e| err(dev, e))?;
            let loss = y
                .mul(&w)
                .and_then(|l| l.sum(&[], false))
                .map_err(|e| err(dev, e))?;
            loss.backward().map_err(|e| err(dev, e))?;
            for &i in &grad_inputs {
                let g = built[i]
                    .0
                    .grad()
                    .ok_or_else(|| format!("on {dev}: input {i} got no gradient"))?;
                input_grads.push(g.to_f64_vec().map_err(|e| err(dev, e))?);
            }
        }
        Ok((out, input_grads, y.shape().to_vec()))
    };
    let (got, got_grads, got_shape) = run(device)?;
    let (want, want_grads, want_shape) = run(reference)?;
    if got_shape != want_shape {
        return Err(format!(
            "output shape {got_shape:?}, reference {want_shape:?}"
        ));
    }
    let scales = crate::cancellation::term_scales(case, reference)?;
    close_at(&got, &want, case.dtype, "output", scales.as_deref())?;
    for ((g, w), i) in got_grads.iter().zip(&want_grads).zip(&grad_inputs) {
        close(g, w, case.dtype, &format!("grad of input {i}"))?;
    }
    Ok(())
}

/// Runs the whole suite on `device`: every op × dtype, against a fresh reference device, or
/// for a soak only the ops named in `REDLINE_CONFORMANCE_OPS` (comma-separated, as the report
/// names them). Never panics on a mismatch; see [`Report::assert_passed`].
pub fn run_conformance(device: &Device, config: &SuiteConfig) -> Report {
    let ops = soak_ops(std::env::var("REDLINE_CONFORMANCE_OPS").ok());
    run_conformance_on(device, config, &ops)
}

/// [`run_conformance`] over `ops` only (e.g. the ops a second code path of a backend serves).
pub fn run_conformance_on(device: &Device, config: &SuiteConfig, ops: &[Op]) -> Report {
    let reference = Device::reference();
    let mut report = Report {
        device: device.name(),
        cells: Vec::new(),
        failures: Vec::new(),
    };
    for &op in ops {
        for dtype in DType::ALL {
            let declared = device.backend().supports(op, dtype);
            let checkable = reference.backend().supports(op, dtype);
            let cell = match (declared, checkable) {
                (false, false) => Cell::NotApplicable,
                (true, false) => {
                    report.failures.push(format!(
                        "{op}/{dtype}: declared by {} but the reference cannot check it",
                        device.name()
                    ));
                    Cell::Failed
                }
                (false, true) => match check_refused(device, op, dtype) {
                    Ok(()) => Cell::Refused,
                    Err(e) => {
                        report.failures.push(format!("{op}/{dtype}: {e}"));
                        Cell::Failed
                    }
                },
                (true, true) => match check_declared(device, &reference, op, dtype, config) {
                    Ok(()) => Cell::Passed,
                    Err(e) => {
                        report.failures.push(format!("{op}/{dtype}: {e}"));
                        Cell::Failed
                    }
                },
            };
            let failed = cell == Cell::Failed;
            report.cells.push((op, dtype, cell));
            if failed {
                // Said as it happens: a run ended from outside (a timeout) keeps the first.
                eprintln!("conformance on {}: {op}/{dtype} FAILED", device.name());
                // A device left in error (CUDA's sticky errors: an illegal address) fails every
                // later pair, each shrinking first: stop at the one that broke it.
                if let Err(e) = device.synchronize() {
                    report.failures.push(format!(
                        "{} is in error after {op}/{dtype} ({e}): the pairs after it were not run",
                        device.name()
                    ));
                    return report;
                }
            }
        }
    }
    if let Err(e) = check_invalid_inputs(device) {
        report.failures.push(format!("invalid inputs: {e}"));
    }
    report
}

/// A deterministic runner: the same cases on every run and every machine, unless a soak asks
/// for more (`REDLINE_CONFORMANCE_CASES=N` per declared pair) or for others
/// (`REDLINE_CONFORMANCE_SEED=S`, itself deterministic).
fn runner(config: &SuiteConfig) -> TestRunner {
    let cases = soak("REDLINE_CONFORMANCE_CASES").map_or(config.cases, soak_cases);
    let rng = match soak("REDLINE_CONFORMANCE_SEED") {
        None => TestRng::deterministic_rng(RngAlgorithm::ChaCha),
        Some(seed) => {
            let mut bytes = [0u8; 32];
            bytes[..8].copy_from_slice(&seed.to_le_bytes());
            TestRng::from_seed(RngAlgorithm::ChaCha, &bytes)
        }
    };
    let config = Config {
        cases,
        max_shrink_time: config.max_shrink_ms,
        failure_persistence: None,
        ..Config::default()
    };
    TestRunner::new_with_rng(config, rng)
}

/// A soak setting from the environment: unset is None, anything but a whole number panics
/// naming it (a typo must not run the usual cases as if it were a soak).
fn soak(name: &str) -> Option<u64> {
    soak_value(name, std::env::var(name).ok())
}

fn soak_value(name: &str, value: Option<String>) -> Option<u64> {
    let value = value?;
    match value.trim().parse() {
        Ok(n) => Some(n),
        Err(_) => panic!("{name} must be a whole number, got {value:?}"),
    }
}

/// The ops a soak runs: every op when unset; otherwise each comma-separated name must be an
/// op's, or it panics naming it (a typo must not pass as a soak of nothing).
fn soak_ops(value: Option<String>) -> Vec<Op> {
    let Some(value) = value else { return Op::all() };
    let names: Vec<&str> = value
        .split(',')
        .map(str::trim)
        .filter(|n| !n.is_empty())
        .collect();
    if names.is_empty() {
        panic!("REDLINE_CONFORMANCE_OPS names no op: {value:?}");
    }
    let all = Op::all();
    names
        .iter()
        .map(|name| match all.iter().find(|op| op.to_string() == *name) {
            Some(&op) => op,
            None => panic!("REDLINE_CONFORMANCE_OPS: no op is named {name:?}"),
        })
        .collect()
}

/// Cases per pair for a soak: at least one (0 would pass every pair untested), at most
/// `u32::MAX`.
fn soak_cases(value: u64) -> u32 {
    match u32::try_from(value) {
        Ok(n) if n > 0 => n,
        _ => panic!(
            "REDLINE_CONFORMANCE_CASES must be 1 to {}, got {value}",
            u32::MAX
        ),
    }
}

fn check_declared(
    device: &Device,
    reference: &Device,
    op: Op,
    dtype: DType,
    config: &SuiteConfig,
) -> Result<(), String> {
    let mut runner = runner(config);
    let result = runner.run(&strategies::case(op, dtype), |case| {
        compare(device, reference, &case).map_err(TestCaseError::fail)
    });
    match result {
        Ok(()) => Ok(()),
        Err(TestError::Fail(why, case)) => Err(format!("{why}\n  minimal failing case: {case:?}")),
        Err(TestError::Abort(why)) => Err(format!("aborted: {why}")),
    }
}

/// An undeclared pair must fail with `TensorError::Unsupported`, not run or fail otherwise.
fn check_refused(device: &Device, op: Op, dtype: DType) -> Result<(), String> {
    let mut runner = TestRunner::deterministic();
    let tree = strategies::case(op, dtype)
        .new_tree(&mut runner)
        .map_err(|e| format!("no case generated: {e}"))?;
    let mut case = tree.current();
    for input in &mut case.inputs {
        input.view = ViewKind::Plain;
        let n: usize = input.shape.iter().product();
        input.values.truncate(n);
    }
    // A device that cannot even hold the dtype refuses at upload: that is the clear error too.
    let inputs: Vec<Tensor> = match case.inputs.iter().map(|x| x.build(device)).collect() {
        Ok(inputs) => inputs,
        Err(TensorError::Unsupported { .. }) => return Ok(()),
        Err(e) => return Err(format!("could not even upload the inputs: {e}")),
    };
    match case.apply(&inputs) {
        Err(TensorError::Unsupported { .. }) => Ok(()),
        Err(other) => Err(format!(
            "undeclared, but failed with another error: {other}"
        )),
        Ok(_) => Err(format!("undeclared by {}, yet it ran", device.name())),
    }
}

/// Invalid shapes and dtypes are errors on the device, as on the reference (or, for an op the
/// device does not declare, the refusal of the undeclared pair).
fn check_invalid_inputs(device: &Device) -> Result<(), String> {
    let Some(dtype) = [DType::F32, DType::F64, DType::F16]
        .into_iter()
        .find(|&d| device.backend().supports(Op::Binary(BinaryOp::Add), d))
    else {
        return Ok(());
    };
    let make = |shape: &[usize], dtype: DType| -> Result<Tensor, String> {
        let n: usize = shape.iter().product();
        Tensor::from_bytes(vec![0u8; n * dtype.size()], dtype, shape, device)
            .map_err(|e| e.to_string())
    };
    let (a, b) = (make(&[2, 3], dtype)?, make(&[4], dtype)?);
    let expectations: Vec<(&str, Result<Tensor, TensorError>)> = vec![
        ("add of [2, 3] and [4]", a.add(&b)),
        ("matmul of [2, 3] and [4]", a.matmul(&make(&[4, 2], dtype)?)),
        ("sum over axis 5 of [2, 3]", a.sum(&[5], false)),
        (
            "concat of [2, 3] and [4] on axis 0",
            Tensor::concat(&[&a, &b], 0),
        ),
        (
            "where with an f-typed condition",
            Tensor::where_(&a, &a, &a),
        ),
        ("reshape [2, 3] to [4]", a.reshape(&[4])),
        ("narrow 2..4 of an axis of 3", a.narrow(1, 2, 2)),
        ("channels-last of a 2-d tensor", a.to_channels_last()),
        ("conv2d with mismatched channels", {
            let x = make(&[1, 2, 4, 4], dtype)?;
            x.conv2d(&make(&[3, 3, 1, 1], dtype)?, None, Conv2dParams::default())
        }),
        ("conv2d whose kernel does not fit", {
            let x = make(&[1, 2, 2, 2], dtype)?;
            x.conv2d(&make(&[3, 2, 3, 3], dtype)?, None, Conv2dParams::default())
        }),
        ("max_pool2d with padding over half the kernel", {
            let p = Pool2dParams {
                kernel: [2, 2],
                stride: [1, 1],
                padding: [2, 2],
            };
            make(&[1, 1, 4, 4], dtype)?.max_pool2d(p)
        }),
        ("softmax over a missing axis", a.softmax(2)),
        ("gather with a float index", a.gather(0, &a)),
    ];
    for (what, result) in expectations {
        match result {
            Err(TensorError::Shape(_)) | Err(TensorError::DType(_)) => {}
            // An op the device does not declare is refused before its shapes are looked at.
            Err(TensorError::Unsupported { op, dtype, .. })
                if !device.backend().supports(op, dtype) => {}
            Err(other) => return Err(format!("{what}: expected a shape/dtype error, got {other}")),
            Ok(t) => return Err(format!("{what}: accepted, giving shape {:?}", t.shape())),
        }
    }
    Ok(())
}

/// For host backends, which can check cheaply: `max_pool2d_grad` refuses a position outside its
/// plane with an error that says so (a GPU backend drops such a gradient instead of syncing).
pub fn refuses_out_of_plane_positions(device: &Device) {
    use redline_tensor::{Layout, Pool2dParams, Tensor};
    let p = Pool2dParams {
        kernel: [2, 2],
        stride: [2, 2],
        padding: [0, 0],
    };
    let g = Tensor::ones(&[1, 1, 2, 2], DType::F32, device).expect("a gradient");
    let positions =
        Tensor::from_slice(&[0i64, 3, 16, 5], &[1, 1, 2, 2], device).expect("positions");
    let out = Layout::contiguous(&[1, 1, 4, 4]);
    let err = device
        .backend()
        .max_pool2d_grad(g.view(), positions.view(), &p, &out)
        .expect_err("position 16 lies outside a 4x4 plane");
    assert!(err.to_string().contains("out"), "{err}");
}

/// A [`RandomStream`](redline_tensor::RandomStream) draws what `random_uniform` draws at host
/// offsets 0, 7 and 7 + 12 (odd lengths, so draws start mid-block of four), bit for bit, and
/// its device offset ends at 7 + 12 + 5; assigning an offset back resumes it there; dropout
/// from the stream drops what dropout at the same host offset drops.
pub fn random_stream_follows_its_device_offset(device: &Device) {
    use redline_tensor::{NnOp, Op, RandomStream, Tensor};
    let stream = RandomStream::new(42, device).expect("a stream");
    let mut at = 0u64;
    // f64 where the device draws it (not wgpu).
    let wide = match device
        .backend()
        .supports(Op::Nn(NnOp::RandomUniform), DType::F64)
    {
        true => DType::F64,
        false => DType::F32,
    };
    for (shape, dtype) in [
        (vec![7], DType::F32),
        (vec![3, 4], DType::F32),
        (vec![5], wide),
    ] {
        let drawn = stream.uniform(&shape, dtype).expect("a draw");
        let want = Tensor::random_uniform(&shape, dtype, 42, at, device).expect("host offset");
        let bits = |t: &Tensor| t.to_f64_vec().expect("values");
        assert_eq!(bits(&drawn), bits(&want), "draw of {shape:?} at {at}");
        at += shape.iter().product::<usize>() as u64;
    }
    let offset = stream.offset().to_vec::<i64>().expect("the offset");
    assert_eq!(offset, [at as i64], "the device offset after three draws");
    // Resume at 100: the next draw is the host stream's at 100.
    let resumed = Tensor::from_slice(&[100i64], &[1], device).expect("an offset");
    stream.offset().assign(&resumed).expect("assign");
    let x = Tensor::from_slice(&[1.0f32; 16], &[16], device).expect("x");
    let dropped = x.dropout_with(0.5, &stream, true).expect("dropout");
    let want = x.dropout(0.5, 42, 100, true).expect("dropout at 100");
    assert_eq!(
        dropped.to_vec::<f32>().expect("values"),
        want.to_vec::<f32>().expect("values")
    );
    assert!(
        x.dropout_with(1.5, &stream, true).is_err(),
        "p outside [0, 1)"
    );
    // Not training: the input, and the stream does not move.
    assert_eq!(stream.offset().to_vec::<i64>().expect("offset"), [116]);
    x.dropout_with(0.5, &stream, false).expect("identity");
    assert_eq!(stream.offset().to_vec::<i64>().expect("offset"), [116]);
}

/// The fused cross-entropy without an `ignore_index` counts every sample — target 0 and the
/// largest class included — and matches the reference's loss and logits' gradient (the
/// suite's cases always pass `Some(-1)`; "none" reaches a backend as a target no sample holds).
pub fn cross_entropy_without_ignore_index_keeps_every_sample(device: &Device) {
    use redline_tensor::Tensor;
    let values: Vec<f32> = (0..12).map(|i| ((i * 5) % 7) as f32 / 3.0 - 1.0).collect();
    let run = |d: &Device| {
        let x = Tensor::from_slice(&values, &[3, 4], d)
            .expect("logits")
            .with_requires_grad(true);
        let y = Tensor::from_slice(&[0i64, 3, 0], &[3], d).expect("targets");
        let loss = x.cross_entropy(&y, 0.1, None).expect("loss");
        loss.backward().expect("backward");
        let grad = x.grad().expect("a gradient").to_f64_vec().expect("grad");
        (loss.item().expect("loss value"), grad)
    };
    let (loss, grad) = run(device);
    let (want_loss, want_grad) = run(&Device::reference());
    assert!(
        (loss - want_loss).abs() <= 1e-5 * want_loss.abs(),
        "{}: loss {loss}, reference {want_loss}",
        device.name()
    );
    for (g, w) in grad.iter().zip(&want_grad) {
        assert!(
            (g - w).abs() <= 1e-5,
            "{}: gradient {grad:?}, reference {want_grad:?}",
            device.name()
        );
    }
}

/// A convolution's weight gradient comes back in the weight's own order: a channels-last
/// weight's gradient is channels-last (what cuDNN's NHWC kernels write natively), an OIHW
/// weight's is OIHW, and both match the reference — a backend that wrote OIHW into the
/// channels-last storage would scramble it. Grouped, strided, padded, over channels-last and
/// NCHW inputs, in every float dtype the device declares (cuDNN's KRSC filter gradient on a
/// GPU, where `gpu-check` runs it).
pub fn conv_weight_grad_in_the_weights_order(device: &Device) -> Result<(), String> {
    use redline_tensor::{NnOp, Result};
    let p = Conv2dParams {
        stride: [2, 1],
        padding: [1, 1],
        groups: 2,
        ..Conv2dParams::default()
    };
    let make = ramp;
    let run = |d: &Device, dtype: DType, x_last: bool, w_last: bool| -> Result<(Vec<f64>, bool)> {
        let mut x = make(d, dtype, &[2, 4, 7, 6], 5)?;
        let mut w = make(d, dtype, &[6, 2, 3, 3], 7)?;
        if x_last {
            x = x.to_channels_last()?;
        }
        if w_last {
            w = w.to_channels_last()?;
        }
        let w = w.with_requires_grad(true);
        let y = x.conv2d(&w, None, p)?;
        y.mul(&loss_weights(&y)?)?.sum(&[], false)?.backward()?;
        let grad = w
            .grad()
            .ok_or_else(|| TensorError::Autograd("no weight gradient".into()))?;
        Ok((grad.to_f64_vec()?, grad.is_channels_last()))
    };
    let reference = Device::reference();
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        if !device
            .backend()
            .supports(Op::Nn(NnOp::Conv2dWeightGrad), dtype)
        {
            continue;
        }
        for (x_last, w_last) in [(true, true), (true, false), (false, true), (false, false)] {
            let what = format!(
                "{}: {dtype} conv, input {}, weight {}: weight gradient",
                device.name(),
                if x_last { "channels-last" } else { "NCHW" },
                if w_last { "channels-last" } else { "OIHW" },
            );
            let (got, got_last) =
                run(device, dtype, x_last, w_last).map_err(|e| format!("{what}: {e}"))?;
            let (want, _) = run(&reference, dtype, x_last, w_last)
                .map_err(|e| format!("{what} on the reference: {e}"))?;
            if got_last != w_last {
                return Err(format!("{what}: the gradient's layout is not the weight's"));
            }
            close(&got, &want, dtype, &what)?;
        }
    }
    Ok(())
}

/// `shape` of `dtype` on `d`, filled with a ramp of 13 values in [-0.75, 0.75] (stride `k`).
fn ramp(d: &Device, dtype: DType, shape: &[usize], k: usize) -> redline_tensor::Result<Tensor> {
    let n: usize = shape.iter().product();
    let mut bytes = vec![0u8; n * dtype.size()];
    for i in 0..n {
        dtype.write(&mut bytes, i, ((i * k) % 13) as f64 / 8.0 - 0.75);
    }
    Tensor::from_bytes(bytes, dtype, shape, d)
}

/// A convolution's input gradient added into the gradient already waiting for its input (a
/// residual block's: `conv(x) + relu(x)`, the convolution first) matches the reference's, as
/// does the weight's: 3×3 and 1×1 (a bottleneck's first), channels-last and NCHW, in every
/// half and single dtype the device declares. On a GPU cuDNN adds it in place (β = 1), which
/// nothing else there checks.
pub fn conv_input_grad_into_a_waiting_gradient(device: &Device) -> Result<(), String> {
    use redline_tensor::{NnOp, Result};
    let run = |d: &Device, dtype: DType, k: usize, last: bool| -> Result<Vec<f64>> {
        let p = Conv2dParams {
            padding: [k / 2, k / 2],
            ..Conv2dParams::default()
        };
        let mut x = ramp(d, dtype, &[2, 8, 7, 6], 5)?;
        if last {
            x = x.to_channels_last()?;
        }
        let x = x.with_requires_grad(true);
        let w = ramp(d, dtype, &[8, 8, k, k], 7)?.with_requires_grad(true);
        let c = x.conv2d(&w, None, p)?;
        let y = c.add(&x.relu()?)?;
        y.mul(&loss_weights(&y)?)?.sum(&[], false)?.backward()?;
        let mut out = Vec::new();
        for t in [&x, &w] {
            let g = t
                .grad()
                .ok_or_else(|| TensorError::Autograd("no gradient".into()))?;
            out.extend(g.to_f64_vec()?);
        }
        Ok(out)
    };
    let reference = Device::reference();
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        let ops = [NnOp::Conv2dInputGrad, NnOp::Conv2dWeightGrad];
        if !ops
            .iter()
            .all(|&op| device.backend().supports(Op::Nn(op), dtype))
        {
            continue;
        }
        for (k, last) in [(3, true), (1, true), (3, false), (1, false)] {
            let order = if last { "channels-last" } else { "NCHW" };
            let what = format!(
                "{}: {dtype} {k}×{k} conv, {order}, its input gradient added to a waiting one",
                device.name()
            );
            let got = run(device, dtype, k, last).map_err(|e| format!("{what}: {e}"))?;
            let want = run(&reference, dtype, k, last)
                .map_err(|e| format!("{what} on the reference: {e}"))?;
            close(&got, &want, dtype, &what)?;
        }
    }
    Ok(())
}

pub use crate::non_finite::non_finite_values_as_the_reference;

#[cfg(test)]
mod tests {
    use super::{soak_cases, soak_ops, soak_value};
    use redline_tensor::{NnOp, Op};

    #[test]
    fn soak_settings_are_whole_numbers_or_unset() {
        assert_eq!(soak_value("N", None), None);
        assert_eq!(soak_value("N", Some(" 300 ".into())), Some(300));
        let typo = std::panic::catch_unwind(|| {
            soak_value("REDLINE_CONFORMANCE_CASES", Some("3OO".into()))
        });
        let message = typo.expect_err("a typo must not pass as a soak");
        let message = message
            .downcast_ref::<String>()
            .cloned()
            .unwrap_or_default();
        assert!(
            message.contains("REDLINE_CONFORMANCE_CASES must be a whole number, got \"3OO\""),
            "{message}"
        );
    }

    #[test]
    fn a_soak_runs_the_ops_it_names_or_refuses_the_names() {
        assert_eq!(soak_ops(None), Op::all());
        assert_eq!(
            soak_ops(Some(
                " batch_norm_stats, batch_norm_grad_stats_coef ".into()
            )),
            [
                Op::Nn(NnOp::BatchNormStats),
                Op::Nn(NnOp::BatchNormGradStatsCoef)
            ]
        );
        for (bad, says) in [
            ("batch_norm_stat", "no op is named \"batch_norm_stat\""),
            (" , ", "names no op"),
        ] {
            let message = std::panic::catch_unwind(|| soak_ops(Some(bad.into())))
                .expect_err("refused")
                .downcast_ref::<String>()
                .cloned()
                .unwrap_or_default();
            assert!(message.contains(says), "{bad:?}: {message}");
        }
    }

    #[test]
    fn a_soak_runs_at_least_one_case_per_pair() {
        assert_eq!(soak_cases(300), 300);
        for refused in [0, 1 << 32] {
            let message = std::panic::catch_unwind(|| soak_cases(refused))
                .expect_err("refused")
                .downcast_ref::<String>()
                .cloned()
                .unwrap_or_default();
            assert!(message.contains("must be 1 to 4294967295"), "{message}");
        }
    }
}
