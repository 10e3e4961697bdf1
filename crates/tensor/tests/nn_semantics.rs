//! The formulas users expect, checked against hand-computed PyTorch values.

use redline_tensor::{
    optim, AdamWParams, BatchNormCoefParams, DType, Device, Pool2dParams, ScalerParams, SgdParams,
    Tensor, TensorError,
};

fn t(values: &[f64], shape: &[usize], dev: &Device) -> Tensor {
    Tensor::from_slice(values, shape, dev).unwrap()
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-9
}

fn sgd_params(dampening: f64) -> SgdParams {
    SgdParams {
        lr_scale: 0.5,
        momentum: 0.9,
        dampening,
        weight_decay: 0.01,
        nesterov: true,
    }
}

#[test]
fn sgd_follows_pytorch_nesterov_and_skips_on_found_inf() {
    let dev = Device::reference();
    let (p, g, buf) = (
        t(&[1.0], &[1], &dev),
        t(&[0.5], &[1], &dev),
        t(&[0.2], &[1], &dev),
    );
    // lr = 0.2 on the device, halved by the group's scale; step 4: buffers hold values.
    let (lr, step) = (t(&[0.2], &[1], &dev), t(&[4.0], &[1], &dev));
    let clean = t(&[0.0], &[1], &dev);
    let hp = sgd_params(0.0);
    optim::sgd(&[&p], &[&g], &[&buf], &step, &lr, &hp, Some(&clean)).unwrap();
    // d = g + wd·p = 0.51; buf = 0.9·0.2 + 0.51 = 0.69; nesterov d = 0.51 + 0.9·0.69 = 1.131.
    assert!(close(buf.item().unwrap(), 0.69));
    assert!(close(p.item().unwrap(), 1.0 - 0.1 * 1.131));
    assert_eq!(step.item().unwrap(), 5.0, "an applied step is counted");
    // An overflow step changes nothing, the count included.
    let overflow = t(&[1.0], &[1], &dev);
    optim::sgd(&[&p], &[&g], &[&buf], &step, &lr, &hp, Some(&overflow)).unwrap();
    assert!(close(buf.item().unwrap(), 0.69));
    assert_eq!(step.item().unwrap(), 5.0);
}

#[test]
fn sgd_fills_the_buffer_on_the_first_applied_step_even_after_a_skipped_one() {
    let dev = Device::reference();
    let (p, g, buf) = (
        t(&[1.0], &[1], &dev),
        t(&[0.5], &[1], &dev),
        t(&[0.0], &[1], &dev),
    );
    let (lr, step) = (t(&[0.2], &[1], &dev), t(&[0.0], &[1], &dev));
    // Dampening 0.5: a blended first step would give 0.255, PyTorch's fill gives 0.51.
    let hp = sgd_params(0.5);
    let overflow = t(&[1.0], &[1], &dev);
    optim::sgd(&[&p], &[&g], &[&buf], &step, &lr, &hp, Some(&overflow)).unwrap();
    assert_eq!((buf.item().unwrap(), step.item().unwrap()), (0.0, 0.0));
    optim::sgd(&[&p], &[&g], &[&buf], &step, &lr, &hp, None).unwrap();
    assert!(close(buf.item().unwrap(), 0.51), "{}", buf.item().unwrap());
    assert_eq!(step.item().unwrap(), 1.0);
    // The next step blends, at the learning rate now on the device (0.4 · 0.5).
    lr.copy_from_f64s(&[0.4]).unwrap();
    let before = p.item().unwrap();
    optim::sgd(&[&p], &[&g], &[&buf], &step, &lr, &hp, None).unwrap();
    let d = 0.5 + 0.01 * before;
    let b = 0.9 * 0.51 + 0.5 * d;
    assert!(close(buf.item().unwrap(), b));
    assert!(close(p.item().unwrap(), before - 0.2 * (d + 0.9 * b)));
}

#[test]
fn adamw_follows_pytorch_and_counts_only_applied_steps() {
    let dev = Device::reference();
    let (p, g) = (t(&[1.0], &[1], &dev), t(&[0.5], &[1], &dev));
    let (m, v, step) = (
        t(&[0.0], &[1], &dev),
        t(&[0.0], &[1], &dev),
        t(&[0.0], &[1], &dev),
    );
    let lr = t(&[0.02], &[1], &dev);
    let hp = AdamWParams {
        lr_scale: 0.5,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.01,
    };
    optim::adamw(&[&p], &[&g], &[&m], &[&v], &step, &lr, &hp, None).unwrap();
    // p ← p(1 - lr·wd) - lr/(1-β1) · m / (√v/√(1-β2) + eps) with lr = 0.01, m = 0.05,
    // v = 0.00025.
    let want = 0.9999 - 0.01 / 0.1 * 0.05 / ((0.00025f64).sqrt() / (0.001f64).sqrt() + 1e-8);
    assert!(close(p.item().unwrap(), want), "{}", p.item().unwrap());
    assert_eq!(step.item().unwrap(), 1.0);
    let overflow = t(&[1.0], &[1], &dev);
    optim::adamw(&[&p], &[&g], &[&m], &[&v], &step, &lr, &hp, Some(&overflow)).unwrap();
    assert_eq!(step.item().unwrap(), 1.0, "a skipped step is not counted");
}

#[test]
fn a_host_write_keeps_the_storage_and_refuses_a_wrong_length_or_a_view() {
    let dev = Device::reference();
    let x = t(&[1.0, 2.0, 3.0], &[3], &dev);
    let storage = std::sync::Arc::as_ptr(x.storage());
    x.copy_from_f64s(&[4.0, 5.0, 6.0]).unwrap();
    assert_eq!(x.to_f64_vec().unwrap(), [4.0, 5.0, 6.0]);
    assert!(std::ptr::eq(storage, std::sync::Arc::as_ptr(x.storage())));
    let err = x.copy_from_f64s(&[1.0, 2.0]).unwrap_err().to_string();
    assert!(err.contains("16 bytes") && err.contains("3 f64"), "{err}");
    let view = x.narrow(0, 1, 2).unwrap();
    let err = view.copy_from_f64s(&[1.0, 2.0]).unwrap_err().to_string();
    assert!(err.contains("view"), "{err}");
    assert_eq!(
        x.to_f64_vec().unwrap(),
        [4.0, 5.0, 6.0],
        "nothing was written"
    );
}

#[test]
fn unscale_flags_non_finite_gradients_and_the_scaler_backs_off_or_grows() {
    let dev = Device::reference();
    let grads = t(&[2.0, 4.0], &[2], &dev);
    let (inv, found) = (t(&[0.5], &[1], &dev), t(&[0.0], &[1], &dev));
    optim::unscale_check(&[&grads], &inv, &found).unwrap();
    assert_eq!(grads.to_f64_vec().unwrap(), [1.0, 2.0]);
    assert_eq!(found.item().unwrap(), 0.0);
    let bad = t(&[1.0, f64::INFINITY], &[2], &dev);
    optim::unscale_check(&[&grads, &bad], &inv, &found).unwrap();
    assert_eq!(found.item().unwrap(), 1.0);

    let (scale, tracker) = (t(&[65536.0], &[1], &dev), t(&[5.0], &[1], &dev));
    let p = ScalerParams {
        growth_interval: 3,
        ..ScalerParams::default()
    };
    optim::scaler_update(&scale, &tracker, &found, &p).unwrap();
    assert_eq!(
        (scale.item().unwrap(), tracker.item().unwrap()),
        (32768.0, 0.0)
    );
    assert_eq!(found.item().unwrap(), 0.0, "cleared for the next step");
    for _ in 0..2 {
        optim::scaler_update(&scale, &tracker, &found, &p).unwrap();
    }
    assert_eq!(
        (scale.item().unwrap(), tracker.item().unwrap()),
        (32768.0, 2.0)
    );
    optim::scaler_update(&scale, &tracker, &found, &p).unwrap();
    assert_eq!(
        (scale.item().unwrap(), tracker.item().unwrap()),
        (65536.0, 0.0)
    );
}

#[test]
fn cross_entropy_values_match_pytorch() {
    let dev = Device::reference();
    let logits = t(&[2.0, 0.0, 0.0, 0.0], &[2, 2], &dev);
    let targets = Tensor::from_slice(&[0i64, 1], &[2], &dev).unwrap();
    let plain = logits
        .cross_entropy(&targets, 0.0, None)
        .unwrap()
        .item()
        .unwrap();
    let a = (1.0 + (-2.0f64).exp()).ln();
    assert!(close(plain, (a + 2f64.ln()) / 2.0));
    let smooth = logits
        .cross_entropy(&targets, 0.1, None)
        .unwrap()
        .item()
        .unwrap();
    let a_smooth = 0.9 * a + 0.1 * (a + (a + 2.0)) / 2.0;
    assert!(close(smooth, (a_smooth + 2f64.ln()) / 2.0), "{smooth}");
    let ignored = Tensor::from_slice(&[-100i64, -100], &[2], &dev).unwrap();
    assert_eq!(
        logits
            .cross_entropy(&ignored, 0.1, Some(-100))
            .unwrap()
            .item()
            .unwrap(),
        0.0
    );
    let out_of_range = Tensor::from_slice(&[0i64, 7], &[2], &dev).unwrap();
    let err = logits.cross_entropy(&out_of_range, 0.0, None).unwrap_err();
    assert!(
        err.to_string()
            .contains("target 7 of sample 1 is out of range"),
        "{err}"
    );
}

#[test]
fn the_input_op_normalises_u8_nhwc_into_channels_last_nchw() {
    let dev = Device::reference();
    // One 1×2 image, RGB: (255, 0, 51) and (0, 255, 102).
    let batch = Tensor::from_slice(&[255u8, 0, 51, 0, 255, 102], &[1, 1, 2, 3], &dev).unwrap();
    let x =
        Tensor::normalize_input(&batch, &[0.5, 0.5, 0.0], &[0.5, 0.5, 0.2], DType::F32).unwrap();
    assert_eq!(x.shape(), [1, 3, 1, 2]);
    assert!(x.is_channels_last());
    let v = x.to_vec::<f32>().unwrap();
    assert_eq!(v, [1.0, -1.0, -1.0, 1.0, 1.0, 2.0]);
    let err = Tensor::normalize_input(&batch, &[0.5; 2], &[0.5; 2], DType::F32).unwrap_err();
    assert!(matches!(err, TensorError::Shape(_)));
}

/// A stream's device offset outside 0..2^63 (or one a draw would push past it) is refused on a
/// host backend, naming it, and the offset is left as it was.
#[test]
fn a_random_stream_refuses_an_offset_out_of_range() {
    let dev = Device::reference();
    let stream = redline_tensor::RandomStream::new(1, &dev).unwrap();
    // (2^63 − 1024: exact in the reference's f64 values; a draw of 2048 passes 2^63.)
    for (bad, n) in [(-1i64, 4), (i64::MAX - 1023, 2048)] {
        let offset = Tensor::from_slice(&[bad], &[1], &dev).unwrap();
        stream.offset().assign(&offset).unwrap();
        let err = stream.uniform(&[n], DType::F32).unwrap_err().to_string();
        assert!(err.contains(&bad.to_string()), "{err}");
        assert_eq!(stream.offset().to_vec::<i64>().unwrap(), [bad]);
    }
}

#[test]
fn dropout_is_keyed_by_seed_and_position() {
    let dev = Device::reference();
    let x = Tensor::ones(&[100, 100], DType::F32, &dev).unwrap();
    let a = x
        .dropout(0.25, 7, 0, true)
        .unwrap()
        .to_vec::<f32>()
        .unwrap();
    assert_eq!(
        a,
        x.dropout(0.25, 7, 0, true)
            .unwrap()
            .to_vec::<f32>()
            .unwrap()
    );
    assert_ne!(
        a,
        x.dropout(0.25, 7, 1, true)
            .unwrap()
            .to_vec::<f32>()
            .unwrap()
    );
    let kept = a.iter().filter(|&&v| v != 0.0).count() as f64 / a.len() as f64;
    assert!((kept - 0.75).abs() < 0.02, "kept {kept}");
    assert!(a.iter().all(|&v| v == 0.0 || (v - 1.0 / 0.75).abs() < 1e-6));
    assert_eq!(
        x.dropout(0.25, 7, 0, false)
            .unwrap()
            .to_vec::<f32>()
            .unwrap()[0],
        1.0
    );
    // Element i of a longer draw equals element i - 3 of a draw offset by 3.
    let long = Tensor::random_uniform(&[10], DType::F64, 9, 0, &dev)
        .unwrap()
        .to_f64_vec()
        .unwrap();
    let shifted = Tensor::random_uniform(&[7], DType::F64, 9, 3, &dev)
        .unwrap()
        .to_f64_vec()
        .unwrap();
    assert_eq!(&long[3..], &shifted[..]);
}

#[test]
fn pooling_and_convolution_geometry_errors_are_clear() {
    let dev = Device::reference();
    let x = Tensor::zeros(&[1, 2, 4, 4], DType::F32, &dev).unwrap();
    let w = Tensor::zeros(&[3, 3, 3, 3], DType::F32, &dev).unwrap();
    let err = x
        .conv2d(&w, None, Default::default())
        .unwrap_err()
        .to_string();
    assert!(err.contains("channels do not match"), "{err}");
    let big = Tensor::zeros(&[1, 2, 5, 5], DType::F32, &dev).unwrap();
    let err = x
        .conv2d(&big, None, Default::default())
        .unwrap_err()
        .to_string();
    assert!(err.contains("does not fit"), "{err}");
    let p = Pool2dParams {
        kernel: [2, 2],
        stride: [2, 2],
        padding: [2, 0],
    };
    assert!(x.max_pool2d(p).is_err());
    let p = Pool2dParams {
        kernel: [2, 2],
        stride: [2, 2],
        padding: [0, 0],
    };
    let y = x.max_pool2d(p).unwrap();
    assert_eq!(y.shape(), [1, 2, 2, 2]);
}

/// A masked class (a -inf logit that is not the target) leaves the unsmoothed loss finite, as
/// PyTorch's `cross_entropy`; with label smoothing it is inf (the uniform part takes log 0).
#[test]
fn cross_entropy_keeps_a_masked_logit_finite_without_smoothing() {
    let dev = Device::reference();
    let inf = f64::INFINITY;
    let x = t(&[1.0, -inf, 2.0, 0.5, -inf], &[1, 5], &dev);
    let target = Tensor::from_slice(&[2i64], &[1], &dev).unwrap();
    let lse = (1f64.exp() + 2f64.exp() + 0.5f64.exp()).ln();
    let loss = x.cross_entropy(&target, 0.0, None).unwrap().item().unwrap();
    assert!((loss - (lse - 2.0)).abs() < 1e-12, "{loss}");
    let smoothed = x.cross_entropy(&target, 0.1, None).unwrap().item().unwrap();
    assert_eq!(smoothed, inf);
}

/// PyTorch's max pooling: the first NaN in a window wins it, and a window of -inf alone keeps
/// -inf and sends its gradient to its own first element (not to the plane's first).
#[test]
fn max_pooling_takes_nan_and_points_an_all_negative_infinity_window_at_itself() {
    let dev = Device::reference();
    let (inf, nan) = (f64::INFINITY, f64::NAN);
    // 2×3 plane: (1, NaN, NaN) over (-inf, -inf, 2); 1×2 windows.
    let x = t(&[1.0, nan, nan, -inf, -inf, 2.0], &[1, 1, 2, 3], &dev).with_requires_grad(true);
    let p = Pool2dParams {
        kernel: [1, 2],
        stride: [1, 1],
        padding: [0, 0],
    };
    let y = x.max_pool2d(p).unwrap();
    let v = y.to_vec::<f64>().unwrap();
    assert!(v[0].is_nan() && v[1].is_nan());
    assert_eq!(v[2..], [-inf, 2.0]);
    let w = t(&[1.0, 10.0, 100.0, 1000.0], &[1, 1, 2, 2], &dev);
    let loss = y.mul(&w).and_then(|l| l.sum(&[], false)).unwrap();
    loss.backward().unwrap();
    // NaN's first position takes both NaN windows' (1 + 10); (-inf, -inf) points at its first.
    assert_eq!(
        x.grad().unwrap().to_vec::<f64>().unwrap(),
        [0.0, 11.0, 0.0, 100.0, 0.0, 1000.0]
    );
}

#[test]
fn a_batch_norm_gate_masks_the_gradient_where_the_relu_was_closed() {
    let dev = Device::reference();
    // x [1, 2, 1, 2]: channel 0 holds (1, -1), channel 1 (2, 3); gate a = (1, -1), b = (0, 2.5):
    // a·x + b is (1, -1) and (0.5, -0.5) — open, closed, open, closed.
    let x = t(&[1.0, -1.0, 2.0, 3.0], &[1, 2, 1, 2], &dev);
    let g = t(&[10.0, 20.0, 30.0, 40.0], &[1, 2, 1, 2], &dev);
    let gate = t(&[1.0, -1.0, 0.0, 2.5], &[2, 2], &dev);
    let sums = x.batch_norm_stats(Some(&g), Some(&gate), None).unwrap();
    // [Σg, Σx·g] over the open elements: channel 0 → (10, 10), channel 1 → (30, 60).
    assert_eq!(sums.to_vec::<f64>().unwrap(), [10.0, 30.0, 10.0, 60.0]);
    // Centred on (0.5, 2): Σ(x − k)·g over the same elements — the gate still reads x itself:
    // channel 0 → (1 − 0.5)·10, channel 1 → (2 − 2)·30.
    let centre = t(&[0.5, 2.0], &[2], &dev);
    let sums = x
        .batch_norm_stats(Some(&g), Some(&gate), Some(&centre))
        .unwrap();
    assert_eq!(sums.to_vec::<f64>().unwrap(), [10.0, 30.0, 5.0, 0.0]);
    // Without y, the sums of x − k and its squares: channel 0 (0.5, −1.5), channel 1 (0, 1).
    let sums = x.batch_norm_stats(None, None, Some(&centre)).unwrap();
    assert_eq!(sums.to_vec::<f64>().unwrap(), [-1.0, 1.0, 2.5, 1.0]);
    // dx-style apply: 0·x + 0 + 1·(gated g).
    let coef = t(&[0.0, 0.0, 0.0, 0.0, 1.0, 1.0], &[3, 2], &dev);
    let applied = x
        .batch_norm_apply(Some(&g), &coef, false, Some(&gate))
        .unwrap();
    assert_eq!(applied.to_vec::<f64>().unwrap(), [10.0, 0.0, 30.0, 0.0]);
    // A gate needs a second operand to mask, and the [2, C] shape of the stats dtype.
    let err = |r: Result<Tensor, TensorError>| r.unwrap_err().to_string();
    assert!(err(x.batch_norm_stats(None, Some(&gate), None))
        .contains("a gate masks the second operand"));
    let said = err(x.batch_norm_stats(Some(&g), None, Some(&gate)));
    assert!(
        said.contains("batch_norm_stats: a per-channel operand f64 [2, 2] (need f64 [2])"),
        "{said}"
    );
    let wrong = t(&[1.0, 0.0, 1.0], &[3, 1], &dev);
    assert!(
        err(x.batch_norm_apply(Some(&g), &coef, false, Some(&wrong))).contains("need f64 [2, 2]")
    );
}

/// Statistics with coefficients in one call (the default: the two calls) give the two calls'
/// values and refuse what either refuses, naming the combined op.
#[test]
fn batch_norm_statistics_with_coefficients_are_the_two_calls_and_check_as_they_do() {
    let dev = Device::reference();
    let x = t(&[1.0, -1.0, 2.0, 3.0, 0.5, 4.0], &[1, 2, 1, 3], &dev);
    let g = t(&[0.3, 0.2, -0.1, 0.4, 0.7, -0.6], &[1, 2, 1, 3], &dev);
    let (w, b) = (t(&[1.5, 0.5], &[2], &dev), t(&[0.1, -0.2], &[2], &dev));
    let p = BatchNormCoefParams {
        count: 3.0,
        eps: 1e-5,
        momentum: 0.1,
        residual: false,
    };
    let running = || (t(&[0.0, 0.5], &[2], &dev), t(&[1.0, 2.0], &[2], &dev));
    let values = |ts: &[&Tensor]| -> Vec<Vec<f64>> {
        ts.iter().map(|t| t.to_vec::<f64>().unwrap()).collect()
    };
    let (m1, v1) = running();
    let (coef, saved) = x
        .batch_norm_stats_coef(Some(&w), Some(&b), Some((&m1, &v1)), &p)
        .unwrap();
    let (m2, v2) = running();
    // The sums about each channel's first element: x is [1, 2, 1, 3], so x[0, c, 0, 0].
    let first = x.narrow(3, 0, 1).unwrap().reshape(&[2]).unwrap();
    let sums = x.batch_norm_stats(None, None, Some(&first)).unwrap();
    let running = Some((&m2, &v2));
    let (k, w_, b_) = (Some(&first), Some(&w), Some(&b));
    let (coef2, saved2) =
        Tensor::batch_norm_coef(&sums, k, x.dtype(), w_, b_, running, &p).unwrap();
    assert_eq!(
        values(&[&coef, &saved, &m1, &v1]),
        values(&[&coef2, &saved2, &m2, &v2])
    );
    let grad = x
        .batch_norm_grad_stats_coef(&g, None, &saved, Some(&w), 3.0)
        .unwrap();
    // The backward's sums are centred on the forward's mean.
    let mean = saved.narrow(0, 0, 1).unwrap().reshape(&[2]).unwrap();
    let sums = x.batch_norm_stats(Some(&g), None, Some(&mean)).unwrap();
    let grad2 = Tensor::batch_norm_grad_coef(&sums, x.dtype(), &saved, Some(&w), 3.0).unwrap();
    assert_eq!(
        values(&[&grad.0, &grad.1, &grad.2]),
        values(&[&grad2.0, &grad2.1, &grad2.2])
    );
    let err = |e: TensorError| e.to_string();
    let three = t(&[1.0, 2.0, 3.0], &[3], &dev);
    let said = err(x
        .batch_norm_stats_coef(Some(&three), None, None, &p)
        .unwrap_err());
    assert!(
        said.contains("batch_norm_stats_coef") && said.contains("[2]"),
        "{said}"
    );
    let view = t(&[0.0, 0.5, 9.0], &[3], &dev).narrow(0, 0, 2).unwrap();
    let said = err(x
        .batch_norm_stats_coef(None, None, Some((&view, &v1)), &p)
        .unwrap_err());
    assert!(said.contains("updated in place"), "{said}");
    let said = err(x
        .batch_norm_grad_stats_coef(&g, None, &w, None, 3.0)
        .unwrap_err());
    assert!(said.contains("saved statistics"), "{said}");
    let wrong_g = t(&[0.0; 4], &[1, 2, 1, 2], &dev);
    assert!(x
        .batch_norm_grad_stats_coef(&wrong_g, None, &saved, None, 3.0)
        .is_err());
    // The gate's own checks: [2, C] of the stats dtype.
    let wrong_gate = t(&[1.0, 0.0, 1.0], &[3, 1], &dev);
    let said = err(x
        .batch_norm_grad_stats_coef(&g, Some(&wrong_gate), &saved, None, 3.0)
        .unwrap_err());
    assert!(said.contains("need f64 [2, 2]"), "{said}");
}
