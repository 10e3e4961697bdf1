//! The reference passes its own suite and gradcheck; broken backends fail the suite.

use std::sync::Arc;

use proptest::test_runner::{Config, TestCaseError, TestRunner};
use redline_tensor::{DType, Device, Op};
use redline_testkit::broken::{Broken, Fault};
use redline_testkit::conformance::Cell;
use redline_testkit::{gradcheck, run_conformance, strategies, SuiteConfig};

#[test]
fn the_reference_backward_matches_finite_differences_for_every_op() {
    let mut checked = 0;
    for op in Op::all() {
        let probe = redline_testkit::Case::new(op, DType::F64, vec![], vec![]);
        if !probe.differentiable() {
            continue;
        }
        let mut runner = TestRunner::new(Config {
            cases: 12,
            failure_persistence: None,
            ..Config::default()
        });
        runner
            .run(&strategies::case(op, DType::F64), |case| {
                gradcheck(&case).map_err(TestCaseError::fail)
            })
            .unwrap_or_else(|e| panic!("gradcheck {op}: {e}"));
        checked += 1;
    }
    assert!(checked >= 20, "only {checked} ops were gradchecked");
}

#[test]
fn the_reference_passes_the_conformance_suite() {
    let report = run_conformance(
        &Device::reference(),
        &SuiteConfig {
            cases: 12,
            max_shrink_ms: 5_000,
        },
    );
    println!("{}", report.matrix());
    report.assert_passed();
}

#[test]
fn undeclared_dtypes_are_checked_refused_and_listed() {
    let device = Device::new(Arc::new(Broken::new(Fault::None).without(DType::F16)));
    let report = run_conformance(
        &device,
        &SuiteConfig {
            cases: 4,
            max_shrink_ms: 1_000,
        },
    );
    report.assert_passed();
    let refused = report.cells.iter().filter(|c| c.2 == Cell::Refused).count();
    assert_eq!(
        refused,
        report.cells.iter().filter(|c| c.1 == DType::F16).count()
    );
    assert!(
        report
            .matrix()
            .contains("undeclared f32/f16 pairs: neg/f16"),
        "{}",
        report.matrix()
    );
}

fn broken_report(fault: Fault) -> redline_testkit::Report {
    let device = Device::new(Arc::new(Broken::new(fault)));
    run_conformance(
        &device,
        &SuiteConfig {
            cases: 8,
            max_shrink_ms: 2_000,
        },
    )
}

#[test]
fn a_wrong_forward_fails_the_suite_with_a_shrunk_case() {
    let report = broken_report(Fault::ExpOffByATenthPercent);
    assert!(!report.passed());
    let failure = report
        .failures
        .iter()
        .find(|f| f.starts_with("exp/f64"))
        .expect("exp/f64 fails");
    assert!(failure.contains("minimal failing case"), "{failure}");
    // f16's tolerance is wider than the 0.1% error: only the precise dtypes catch it.
    assert!(report.failures.iter().any(|f| f.starts_with("exp/f32")));
}

#[test]
fn a_wrong_reduction_fails_forward_and_the_gradients_built_on_it() {
    let report = broken_report(Fault::SumDropsLastElement);
    assert!(
        report.failures.iter().any(|f| f.starts_with("sum/f32")),
        "{:?}",
        report.failures
    );
    assert!(
        report
            .failures
            .iter()
            .any(|f| f.starts_with("add/f32") && f.contains("grad")),
        "{:?}",
        report.failures
    );
}

#[test]
fn a_declared_op_that_errors_fails_the_suite() {
    let report = broken_report(Fault::RefusesDeclaredOp);
    let failure = report
        .failures
        .iter()
        .find(|f| f.starts_with("neg/f16"))
        .expect("neg/f16 fails");
    assert!(failure.contains("f16 neg kernel missing"), "{failure}");
}

#[test]
fn an_allocator_that_never_caches_fails_the_steady_state_check() {
    let leaky = Device::new(Arc::new(Broken::new(Fault::AllocatesEveryOp)));
    let err = redline_testkit::training::check_steady_state_memory(&leaky).unwrap_err();
    assert!(err.contains("allocated from the device"), "{err}");
}

#[test]
fn the_reference_refuses_max_pool_positions_outside_their_plane() {
    redline_testkit::conformance::refuses_out_of_plane_positions(
        &redline_tensor::Device::reference(),
    );
}

#[test]
fn batch_norm_through_the_coefficient_ops_equals_its_composition() {
    use redline_tensor::{NnOp, RunningStats, Tensor};
    let fused = Device::reference();
    let composed = Device::new(Arc::new(
        Broken::new(Fault::None)
            .hiding(Op::Nn(NnOp::BatchNormCoef))
            .hiding(Op::Nn(NnOp::BatchNormGradCoef)),
    ));
    // The values, running statistics and gradients of relu(bn(x) (+ r)) on a device.
    let run = |device: &Device, residual: bool| -> Vec<Vec<f64>> {
        let ramp = |n: usize, k: usize| -> Vec<f64> {
            (0..n).map(|i| ((i * k) % 17) as f64 / 8.0 - 1.0).collect()
        };
        let leaf = |v: Vec<f64>, shape: &[usize]| {
            Tensor::from_slice(&v, shape, device)
                .unwrap()
                .with_requires_grad(true)
        };
        let x = leaf(ramp(2 * 3 * 4 * 4, 7), &[2, 3, 4, 4]);
        let r = leaf(ramp(2 * 3 * 4 * 4, 5), &[2, 3, 4, 4]);
        let (w, b) = (
            leaf(vec![0.5, 1.5, -1.0], &[3]),
            leaf(vec![0.1, -0.2, 0.3], &[3]),
        );
        let mean = Tensor::from_slice(&[0.1, 0.2, 0.3], &[3], device).unwrap();
        let var = Tensor::from_slice(&[1.0, 2.0, 0.5], &[3], device).unwrap();
        let stats = RunningStats {
            mean: &mean,
            var: &var,
            momentum: 0.1,
        };
        let y = x
            .batch_norm_relu(
                Some(&w),
                Some(&b),
                Some(stats),
                true,
                1e-5,
                residual.then_some(&r),
            )
            .unwrap();
        let weights = Tensor::from_slice(&ramp(y.numel(), 3), y.shape(), device).unwrap();
        y.mul(&weights)
            .unwrap()
            .sum(&[], false)
            .unwrap()
            .backward()
            .unwrap();
        let mut out = vec![y.to_f64_vec().unwrap(), mean.to_f64_vec().unwrap()];
        out.push(var.to_f64_vec().unwrap());
        for t in [&x, &w, &b] {
            out.push(t.grad().unwrap().to_f64_vec().unwrap());
        }
        if residual {
            out.push(r.grad().unwrap().to_f64_vec().unwrap());
        }
        out
    };
    for residual in [false, true] {
        let (a, b) = (run(&fused, residual), run(&composed, residual));
        assert_eq!(a.len(), b.len());
        for (i, (a, b)) in a.iter().zip(&b).enumerate() {
            for (x, y) in a.iter().zip(b) {
                assert!(
                    (x - y).abs() <= 1e-12 * (1.0 + y.abs()),
                    "output {i}: {x} vs {y}"
                );
            }
        }
    }
}

#[test]
fn clipping_through_the_multi_tensor_ops_equals_its_composition() {
    use redline_tensor::{OptimOp, Tensor};
    let composed = Device::new(Arc::new(
        Broken::new(Fault::None).hiding(Op::Optim(OptimOp::SumSquares)),
    ));
    let run = |device: &Device| -> Vec<Vec<f64>> {
        let params: Vec<Tensor> = [(vec![3.0, -4.0, 1.0], 7), (vec![2.0, 0.5], 3)]
            .into_iter()
            .map(|(v, k)| {
                let n = v.len();
                let p = Tensor::from_slice(&v, &[n], device)
                    .unwrap()
                    .with_requires_grad(true);
                let w: Vec<f64> = (0..n).map(|i| (i * k) as f64 - 2.0).collect();
                let w = Tensor::from_slice(&w, &[n], device).unwrap();
                p.mul(&w)
                    .unwrap()
                    .sum(&[], false)
                    .unwrap()
                    .backward()
                    .unwrap();
                p
            })
            .collect();
        let norm = redline_nn::clip_grad_norm(&params, 1.5).unwrap().unwrap();
        let mut out = vec![norm.to_f64_vec().unwrap()];
        out.extend(
            params
                .iter()
                .map(|p| p.grad().unwrap().to_f64_vec().unwrap()),
        );
        out
    };
    let (a, b) = (run(&Device::reference()), run(&composed));
    for (x, y) in a.iter().flatten().zip(b.iter().flatten()) {
        assert!((x - y).abs() <= 1e-12 * (1.0 + y.abs()), "{a:?} vs {b:?}");
    }
    assert!(a[0][0] > 1.5, "the gradients were clipped: {a:?}");
}

#[test]
fn cross_entropy_in_one_op_equals_its_composition_and_refuses_a_bad_target() {
    use redline_tensor::{NnOp, Tensor};
    let fused = Device::reference();
    let composed = Device::new(Arc::new(
        Broken::new(Fault::None).hiding(Op::Nn(NnOp::CrossEntropy)),
    ));
    // Loss and logits' gradient, label-smoothed, with and without a skipped sample (-1), on
    // logits stored transposed (any layout is taken).
    let run = |device: &Device, targets: &[i64], ignore: Option<i64>| -> Vec<Vec<f64>> {
        let values: Vec<f64> = (0..15).map(|i| ((i * 7) % 11) as f64 / 3.0 - 1.5).collect();
        let x = Tensor::from_slice(&values, &[5, 3], device)
            .unwrap()
            .with_requires_grad(true);
        let logits = x.transpose(0, 1).unwrap();
        let t = Tensor::from_slice(targets, &[3], device).unwrap();
        let loss = logits.cross_entropy(&t, 0.1, ignore).unwrap();
        loss.mul_scalar(2.5).unwrap().backward().unwrap();
        vec![
            loss.to_f64_vec().unwrap(),
            x.grad().unwrap().to_f64_vec().unwrap(),
        ]
    };
    let cases: [(&[i64], Option<i64>); 4] = [
        (&[4, 0, 2], None),
        (&[4, -1, 2], Some(-1)),
        (&[-1, -1, -1], Some(-1)),
        (&[1, 3, 0], Some(-1)),
    ];
    for (targets, ignore) in cases {
        let (a, b) = (
            run(&fused, targets, ignore),
            run(&composed, targets, ignore),
        );
        for (i, (a, b)) in a.iter().zip(&b).enumerate() {
            assert_eq!(a.len(), b.len());
            for (x, y) in a.iter().zip(b) {
                assert!(
                    (x - y).abs() <= 1e-12 * (1.0 + y.abs()),
                    "{targets:?}: output {i}: {x} vs {y}"
                );
            }
        }
    }
    let logits = Tensor::from_slice(&[0.0, 1.0, 2.0, 3.0], &[2, 2], &fused).unwrap();
    let bad = Tensor::from_slice(&[0i64, 2], &[2], &fused).unwrap();
    let err = logits
        .cross_entropy(&bad, 0.0, None)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("target 2 of sample 1") && err.contains("2 classes"),
        "{err}"
    );
}

#[test]
fn downloads_ordered_after_an_event_see_the_work_before_it() {
    redline_testkit::events::check_events(&Device::reference()).unwrap();
}

/// A convolution whose input already has a gradient waiting (a skip connection's) adds its
/// own into it in place where the backend can, with the bits of the engine's separate add —
/// and never into a gradient something else holds (an add's backward gives both its inputs
/// the one tensor, which is also the convolution's own output gradient).
#[test]
fn a_convolution_adds_its_input_gradient_into_a_waiting_one_only_when_it_is_alone() {
    use redline_tensor::{Conv2dParams, Tensor};
    let p = Conv2dParams {
        padding: [1, 1],
        ..Conv2dParams::default()
    };
    // The gradients of x and w through y = conv(x, w) + skip(x), and how many input gradients
    // the device added in place.
    let run = |backend: Broken, relu_skip: bool, channels_last: bool| {
        let backend = Arc::new(backend);
        let device = Device::new(backend.clone());
        let ramp = |n: usize, k: usize| -> Vec<f64> {
            (0..n).map(|i| ((i * k) % 23) as f64 / 7.0 - 1.3).collect()
        };
        let mut x = Tensor::from_slice(&ramp(2 * 3 * 5 * 5, 7), &[2, 3, 5, 5], &device)
            .unwrap()
            .cast(DType::F32)
            .unwrap();
        if channels_last {
            x = x.to_channels_last().unwrap();
        }
        let x = x.with_requires_grad(true);
        let w = Tensor::from_slice(&ramp(3 * 3 * 3 * 3, 5), &[3, 3, 3, 3], &device)
            .unwrap()
            .cast(DType::F32)
            .unwrap()
            .with_requires_grad(true);
        // The convolution first: backward reaches it after the skip has left x its gradient.
        let c = x.conv2d(&w, None, p).unwrap();
        let skip = if relu_skip {
            x.relu().unwrap()
        } else {
            x.clone()
        };
        let y = c.add(&skip).unwrap();
        let weights = Tensor::from_slice(&ramp(y.numel(), 3), y.shape(), &device)
            .unwrap()
            .cast(DType::F32)
            .unwrap();
        let loss = y.mul(&weights).unwrap().sum(&[], false).unwrap();
        loss.backward().unwrap();
        let grads = [&x, &w].map(|t| t.grad().unwrap().to_f64_vec().unwrap());
        (grads, backend.accumulated())
    };
    for channels_last in [false, true] {
        // A ReLU's backward leaves x a gradient of its own: the convolution adds into it.
        let (added, n) = run(Broken::new(Fault::None), true, channels_last);
        let (separate, none) = run(
            Broken::new(Fault::None).without_accumulation(),
            true,
            channels_last,
        );
        assert_eq!((n, none), (1, 0), "channels-last {channels_last}");
        assert_eq!(added, separate, "channels-last {channels_last}");
        // The identity's gradient is the add's, shared with the convolution's: left alone.
        let (shared, n) = run(Broken::new(Fault::None), false, channels_last);
        let (separate, _) = run(
            Broken::new(Fault::None).without_accumulation(),
            false,
            channels_last,
        );
        assert_eq!(n, 0, "channels-last {channels_last}");
        assert_eq!(shared, separate, "channels-last {channels_last}");
    }
}

/// The reference itself in f32 (sums in f64, stored as f32) keeps batch norm's digits far from
/// zero: its sums are centred (forward: on each channel's first element; backward: the mean).
#[test]
fn the_reference_in_f32_keeps_batch_norms_digits_far_from_zero() {
    redline_testkit::precision::batch_norm_far_from_zero(&Device::reference()).unwrap();
}

/// The non-finite check's subnormal cases: a backend that flushes subnormals to zero fails
/// it unless it declares that it may (as wgpu does: WGSL allows it), and declaring it while
/// keeping them passes too.
#[test]
fn flushed_subnormals_fail_the_non_finite_check_unless_the_backend_declares_it() {
    use redline_testkit::conformance::non_finite_values_as_the_reference as check;
    let device = |b: Broken| Device::new(Arc::new(b));
    let err = check(&device(Broken::new(Fault::FlushesSubnormals))).unwrap_err();
    // f32's subnormals: (a cast into f32 is no call) the product by 0.5.
    assert!(err.contains("f32 product of [1e-5"), "{err}");
    assert!(err.contains("0.0], reference ["), "{err}");
    check(&device(
        Broken::new(Fault::FlushesSubnormals).declaring_subnormal_flush(),
    ))
    .unwrap();
    check(&device(
        Broken::new(Fault::None).declaring_subnormal_flush(),
    ))
    .unwrap();
}
