//! The autocast policy and GradScaler on the CPU backend, with raw tensors (the layers that
//! consult the policy are tested in redline-nn).

use redline_amp::{
    autocast, autocast_dtype, for_compute, for_compute_channels_last, for_f32, GradScaler,
};
use redline_cpu::CpuBackend;
use redline_tensor::{Conv2dParams, DType, Device, ScalerParams, Tensor};

fn weight(device: &Device) -> Tensor {
    Tensor::from_slice(&[0.5f32, -1.0, 2.0, 0.25], &[2, 2], device)
        .unwrap()
        .with_requires_grad(true)
}

#[test]
fn scopes_cast_compute_operands_and_nest() {
    let device = CpuBackend::device();
    let x = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0], &[2, 2], &device).unwrap();
    assert_eq!(autocast_dtype(), None);
    assert_eq!(
        for_compute(&x).unwrap().dtype(),
        DType::F32,
        "no scope: unchanged"
    );
    {
        let _outer = autocast(DType::F16).unwrap();
        assert_eq!(for_compute(&x).unwrap().dtype(), DType::F16);
        {
            let _inner = autocast(DType::BF16).unwrap();
            assert_eq!(
                autocast_dtype(),
                Some(DType::BF16),
                "the innermost scope wins"
            );
            assert_eq!(for_compute(&x).unwrap().dtype(), DType::BF16);
        }
        assert_eq!(autocast_dtype(), Some(DType::F16));
        // Integer tensors (targets, indices) are never cast.
        let labels = Tensor::from_slice(&[1i64, 0], &[2], &device).unwrap();
        assert_eq!(for_compute(&labels).unwrap().dtype(), DType::I64);
        // Ops the policy keeps in f32 get their low-precision inputs cast up.
        let low = for_compute(&x).unwrap();
        assert_eq!(for_f32(&low).unwrap().dtype(), DType::F32);
    }
    assert_eq!(
        autocast_dtype(),
        None,
        "dropping the guards closes the scopes"
    );
    let low = x.cast(DType::F16).unwrap();
    assert_eq!(
        for_f32(&low).unwrap().dtype(),
        DType::F16,
        "no scope: unchanged"
    );
}

#[test]
fn autocast_refuses_a_dtype_that_is_not_half_precision() {
    for dtype in [DType::F32, DType::F64, DType::I64, DType::U8] {
        let err = autocast(dtype).err().expect("only f16/bf16 scopes");
        assert!(err.to_string().contains("f16 or bf16"), "{err}");
    }
    assert_eq!(autocast_dtype(), None, "a refused scope is not opened");
}

#[test]
fn parameters_are_cast_once_per_scope_and_grads_reach_the_f32_master() {
    let device = CpuBackend::device();
    let w = weight(&device);
    {
        let _scope = autocast(DType::F16).unwrap();
        let a = for_compute(&w).unwrap();
        let b = for_compute(&w).unwrap();
        assert_eq!(a.key(), b.key(), "one cached copy within a scope");
        assert_eq!(a.dtype(), DType::F16);
        // The copy used twice: the f32 master gets both contributions, in f32.
        let loss = a.add(&b).unwrap().sum(&[], false).unwrap();
        loss.backward().unwrap();
    }
    let grad = w.grad().expect("the master weight has a gradient");
    assert_eq!(grad.dtype(), DType::F32);
    assert_eq!(grad.to_f64_vec().unwrap(), vec![2.0; 4]);
    // The next scope (the next step) casts the updated master afresh.
    w.assign(&w.mul_scalar(2.0).unwrap().detach()).unwrap();
    let _step = autocast(DType::F16).unwrap();
    let fresh = for_compute(&w).unwrap().to_f64_vec().unwrap();
    assert_eq!(fresh, vec![1.0, -2.0, 4.0, 0.5]);
}

#[test]
fn a_conv_weight_beside_channels_last_activations_is_cast_channels_last_in_one_copy() {
    // bf16 conv of a channels-last input with the weight's copy in either layout: the same
    // output bits, and the f32 master's gradient laid out as the master (OIHW), the same bits.
    let device = CpuBackend::device();
    let values = |n: usize, k: usize| -> Vec<f32> {
        (0..n).map(|i| ((i * k) % 23) as f32 / 8.0 - 1.5).collect()
    };
    let master = || {
        Tensor::from_slice(&values(8 * 4 * 9, 7), &[8, 4, 3, 3], &device)
            .unwrap()
            .with_requires_grad(true)
    };
    let x = Tensor::from_slice(&values(2 * 4 * 6 * 6, 5), &[2, 4, 6, 6], &device)
        .and_then(|t| t.to_channels_last())
        .unwrap();
    let p = Conv2dParams {
        padding: [1, 1],
        ..Conv2dParams::default()
    };
    let run = |channels_last: bool| {
        let w = master();
        let _scope = autocast(DType::BF16).unwrap();
        let low = match channels_last {
            true => for_compute_channels_last(&w).unwrap(),
            false => for_compute(&w).unwrap(),
        };
        assert_eq!(low.dtype(), DType::BF16);
        assert_eq!(low.is_channels_last(), channels_last);
        assert_eq!(low.layout().is_contiguous(), !channels_last);
        if channels_last {
            // Cached per scope and layout: the same copy again, the OIHW one apart.
            assert_eq!(for_compute_channels_last(&w).unwrap().key(), low.key());
            assert_ne!(for_compute(&w).unwrap().key(), low.key());
        }
        let y = for_compute(&x).unwrap().conv2d(&low, None, p).unwrap();
        let out = y.cast(DType::F32).unwrap().to_vec::<f32>().unwrap();
        y.mul(&y)
            .unwrap()
            .sum(&[], false)
            .unwrap()
            .backward()
            .unwrap();
        let grad = w.grad().expect("the master weight has a gradient");
        assert!(grad.layout().is_contiguous(), "{:?}", grad.layout());
        (out, grad.to_vec::<f32>().unwrap())
    };
    assert_eq!(run(true), run(false));
    // Outside a scope, nothing changes; a tensor that is not 4-d is cast as for_compute does.
    let w = master();
    assert_eq!(for_compute_channels_last(&w).unwrap().key(), w.key());
    let _scope = autocast(DType::F16).unwrap();
    let v = weight(&device);
    assert!(for_compute_channels_last(&v)
        .unwrap()
        .layout()
        .is_contiguous());
}

fn scaler(device: &Device, init: f64, growth_interval: u64) -> GradScaler {
    let params = ScalerParams {
        growth_interval,
        ..ScalerParams::default()
    };
    GradScaler::with(device, DType::F32, init, params).unwrap()
}

fn scale_of(s: &GradScaler) -> (f64, f64) {
    let [(_, scale), (_, tracker)] = s.state();
    (scale.item().unwrap(), tracker.item().unwrap())
}

#[test]
fn grad_scaler_unscales_to_the_true_gradients_and_grows_after_clean_steps() {
    let device = CpuBackend::device();
    let w = weight(&device);
    let mut s = scaler(&device, 1024.0, 2);
    for step in 0..4 {
        w.zero_grad();
        let loss = w.mul(&w).unwrap().sum(&[], false).unwrap();
        s.scale(&loss).unwrap().backward().unwrap();
        let scaled = w.grad().unwrap().to_f64_vec().unwrap();
        let (scale, _) = scale_of(&s);
        assert_eq!(
            scaled,
            vec![1.0 * scale, -2.0 * scale, 4.0 * scale, 0.5 * scale]
        );
        let flag = s
            .step_flag(std::slice::from_ref(&w))
            .unwrap()
            .item()
            .unwrap();
        assert_eq!(flag, 0.0, "step {step}: finite gradients");
        assert_eq!(
            w.grad().unwrap().to_f64_vec().unwrap(),
            vec![1.0, -2.0, 4.0, 0.5]
        );
        // A second unscale in the same step is a no-op, as in PyTorch.
        s.unscale(std::slice::from_ref(&w)).unwrap();
        assert_eq!(
            w.grad().unwrap().to_f64_vec().unwrap(),
            vec![1.0, -2.0, 4.0, 0.5]
        );
        s.update().unwrap();
    }
    // growth_interval 2: ×2 after steps 2 and 4.
    assert_eq!(scale_of(&s), (4096.0, 0.0));
}

#[test]
fn grad_scaler_flags_inf_and_nan_and_backs_off() {
    let device = CpuBackend::device();
    for bad in [f32::INFINITY, f32::NAN] {
        let w = weight(&device);
        let other = Tensor::from_slice(&[1.0f32, 1.0], &[2], &device)
            .unwrap()
            .with_requires_grad(true);
        let mut s = scaler(&device, 65536.0, 2);
        // One clean step first so the growth tracker is non-zero and must be reset.
        let loss = w.sum(&[], false).unwrap();
        s.scale(&loss).unwrap().backward().unwrap();
        s.step_flag(&[w.clone(), other.clone()]).unwrap();
        s.update().unwrap();
        assert_eq!(scale_of(&s), (65536.0, 1.0));

        w.zero_grad();
        let poison = Tensor::from_slice(&[1.0f32, bad, 1.0, 1.0], &[2, 2], &device).unwrap();
        let loss = w
            .mul(&poison)
            .unwrap()
            .sum(&[], false)
            .unwrap()
            .add(&other.sum(&[], false).unwrap())
            .unwrap();
        s.scale(&loss).unwrap().backward().unwrap();
        let flag = s
            .step_flag(&[w.clone(), other.clone()])
            .unwrap()
            .item()
            .unwrap();
        assert_eq!(flag, 1.0, "{bad} in one gradient sets the flag");
        s.update().unwrap();
        assert_eq!(scale_of(&s), (32768.0, 0.0), "halved, tracker reset");
        // The flag is cleared for the next step.
        w.zero_grad();
        other.zero_grad();
        let loss = w.sum(&[], false).unwrap();
        s.scale(&loss).unwrap().backward().unwrap();
        assert_eq!(
            s.step_flag(std::slice::from_ref(&w))
                .unwrap()
                .item()
                .unwrap(),
            0.0
        );
    }
}

#[test]
fn grad_scaler_unscales_half_precision_gradients_into_the_one_flag() {
    let device = CpuBackend::device();
    let w32 = weight(&device);
    let w16 = Tensor::from_slice(&[1.0f32, 2.0], &[2], &device)
        .unwrap()
        .cast(DType::F16)
        .unwrap()
        .with_requires_grad(true);
    let mut s = scaler(&device, 8.0, 2000);
    let poison = Tensor::from_slice(&[f32::INFINITY, 1.0], &[2], &device)
        .unwrap()
        .cast(DType::F16)
        .unwrap();
    let loss = w32
        .sum(&[], false)
        .unwrap()
        .add(
            &w16.mul(&poison)
                .unwrap()
                .sum(&[], false)
                .unwrap()
                .cast(DType::F32)
                .unwrap(),
        )
        .unwrap();
    s.scale(&loss).unwrap().backward().unwrap();
    let flag = s
        .step_flag(&[w32.clone(), w16.clone()])
        .unwrap()
        .item()
        .unwrap();
    assert_eq!(flag, 1.0, "an inf in the f16 group reaches the f32 flag");
    assert_eq!(w32.grad().unwrap().to_f64_vec().unwrap(), vec![1.0; 4]);
}
