//! How many device calls a ResNet-50 training step issues (counted by the op profile on the
//! CPU backend; the same front end issues the same calls on every device that declares the
//! same ops). A count, not a time: launches are what a host-bound GPU step pays for.

use std::sync::Arc;

use redline_nn::{named_parameters, Module, ResNet, ResNetConfig};
use redline_tensor::{Device, Tensor};
use redline_train::profile::{OpKind, OpProfile};

#[test]
fn a_resnet50_step_issues_four_calls_per_batch_norm_and_under_five_hundred_in_all() {
    let cpu = Device::new(Arc::new(redline_cpu::CpuBackend::new()));
    let (device, profile) = OpProfile::wrap(cpu, true);
    let model = ResNet::new(
        ResNetConfig {
            num_classes: 10,
            ..ResNetConfig::new(50)
        },
        &device,
    )
    .unwrap();
    let x = Tensor::from_slice(&vec![0.5f32; 2 * 3 * 32 * 32], &[2, 3, 32, 32], &device).unwrap();
    let y = Tensor::from_slice(&[1i64, 7], &[2], &device).unwrap();
    profile.reset();
    let loss = model
        .forward(&x)
        .unwrap()
        .cross_entropy(&y, 0.1, None)
        .unwrap();
    loss.backward().unwrap();
    let rows = profile.rows();
    let calls = |f: &dyn Fn(&str) -> bool| -> u64 {
        rows.iter().filter(|r| f(&r.label)).map(|r| r.calls).sum()
    };
    let launches = rows
        .iter()
        .filter(|r| r.kind != OpKind::Blocking && r.kind != OpKind::Transfer)
        .map(|r| r.calls)
        .sum::<u64>();
    let norms = 53;
    // Forward: statistics with coefficients, apply; backward: the same (one call for the
    // statistics and coefficients, so CUDA adds its channels-last partial sums in the
    // coefficients' launch).
    assert_eq!(
        calls(&|l| l.starts_with("batch_norm")),
        4 * norms,
        "{rows:#?}"
    );
    assert_eq!(calls(&|l| l == "batch_norm_stats_coef"), norms);
    // The loss: softmax, smoothing, mask and gradient in one call (was ~12 forward, ~10 back).
    assert_eq!(calls(&|l| l.starts_with("cross_entropy")), 1, "{rows:#?}");
    let grad = |l: &str| l.starts_with("batch_norm_grad_stats_coef");
    assert_eq!(calls(&grad), norms);
    // The counter every norm carries costs nothing in the step (written when read): the few
    // fills left are the loss's constants and the backward's seed.
    assert!(calls(&|l| l == "fill") < 12, "{rows:#?}");
    // 3,310 before the coefficient ops (issue 18), 525 with them and the fused cross-entropy,
    // 419 with the statistics and coefficients in one call.
    assert!(launches < 500, "{launches} launches: {rows:#?}");
    eprintln!("forward + backward: {launches} launches");
    // Clipping the 161 gradients to a global norm: a handful of launches, not a few per
    // gradient.
    let params: Vec<Tensor> = named_parameters(&model)
        .into_iter()
        .map(|(_, p)| p)
        .collect();
    assert_eq!(params.len(), 161);
    profile.reset();
    redline_nn::clip_grad_norm(&params, 1.0).unwrap().unwrap();
    let clip: u64 = profile
        .rows()
        .iter()
        .filter(|r| r.kind != OpKind::Blocking)
        .map(|r| r.calls)
        .sum();
    assert!(
        clip <= 12,
        "clipping took {clip} launches: {:#?}",
        profile.rows()
    );
    eprintln!("clipping: {clip} launches");
}

/// Under autocast, batch norm runs on its low-precision input (its statistics and coefficients
/// in f32 inside the fused kernels, as PyTorch's CUDA autocast runs it in the input's dtype):
/// a bf16 ResNet-50 step casts its parameters (down for the forward, their gradients back up)
/// and its input, and no activation or activation gradient — where casting each norm's input
/// up to f32 cost two casts forward and two backward per norm, f32 passes over both, and an
/// f32 copy of every normalised activation kept for backward.
#[test]
fn an_amp_resnet50_step_casts_parameters_and_its_input_but_no_activation() {
    use redline_tensor::DType;
    let cpu = Device::new(Arc::new(redline_cpu::CpuBackend::new()));
    let (device, profile) = OpProfile::wrap(cpu, true);
    let config = ResNetConfig {
        num_classes: 10,
        ..ResNetConfig::new(50)
    };
    let model = ResNet::new(config, &device).unwrap();
    let batch = 2;
    let x = Tensor::from_slice(
        &vec![0.5f32; batch * 3 * 32 * 32],
        &[batch, 3, 32, 32],
        &device,
    )
    .and_then(|x| x.to_channels_last())
    .unwrap();
    let y = Tensor::from_slice(&[1i64, 7], &[batch], &device).unwrap();
    profile.reset();
    let loss = {
        let _scope = redline_amp::autocast(DType::BF16).unwrap();
        let logits = model.forward(&x).unwrap();
        assert_eq!(logits.dtype(), DType::BF16);
        redline_amp::for_f32(&logits)
            .and_then(|l| l.cross_entropy(&y, 0.1, None))
            .unwrap()
    };
    loss.backward().unwrap();
    // A convert's label: "convert F32->BF16 [2, 256, 8, 8]"; batch-led 4-d shapes are
    // activations (no parameter of this model has 2 output channels).
    let activation = format!("[{batch}, ");
    let converts: Vec<(String, u64)> = profile
        .rows()
        .into_iter()
        .filter(|r| r.label.starts_with("convert") && r.label.contains(&activation))
        .map(|r| (r.label, r.calls))
        .collect();
    // The input, cast down for the stem; the logits, up for the loss and back in backward.
    let want = [
        ("convert F32->BF16 [2, 3, 32, 32]", 1),
        ("convert BF16->F32 [2, 10]", 1),
        ("convert F32->BF16 [2, 10]", 1),
    ];
    let mut got: Vec<(&str, u64)> = converts.iter().map(|(l, n)| (l.as_str(), *n)).collect();
    got.sort();
    let mut want = want.to_vec();
    want.sort();
    assert_eq!(got, want, "activations cast: {converts:#?}");
    // Every parameter (161) gets one cast down and its gradient one cast back up.
    let parameter_casts: u64 = profile
        .rows()
        .iter()
        .filter(|r| r.label.starts_with("convert") && !r.label.contains(&activation))
        .map(|r| r.calls)
        .sum();
    assert!(parameter_casts <= 2 * 161, "{parameter_casts}");
}

/// A convolution's weight gradient comes back in the weight's own order, so neither a
/// channels-last weight nor autocast's channels-last copy of an OIHW master pays an extra
/// transposing copy: none for the first, and for the second only the cast back to f32 the
/// master needs anyway (which writes it OIHW). The values match the OIHW weight's.
#[test]
fn a_channels_last_conv_weight_gets_its_gradient_in_its_own_order_with_no_extra_copy() {
    use redline_tensor::{Conv2dParams, DType};
    let cpu = Device::new(Arc::new(redline_cpu::CpuBackend::new()));
    let (device, profile) = OpProfile::wrap(cpu, true);
    let values = |n: usize, k: usize| -> Vec<f32> {
        (0..n).map(|i| ((i * k) % 19) as f32 / 8.0 - 1.0).collect()
    };
    let bf16_last = |v: Vec<f32>, shape: &[usize]| {
        Tensor::from_slice(&v, shape, &device)
            .and_then(|t| t.cast(DType::BF16))
            .and_then(|t| t.to_channels_last())
            .unwrap()
    };
    let x = bf16_last(values(2 * 4 * 6 * 6, 5), &[2, 4, 6, 6]);
    let r = bf16_last(values(2 * 8 * 6 * 6, 3), &[2, 8, 6, 6]);
    let master = Tensor::from_slice(&values(8 * 4 * 3 * 3, 7), &[8, 4, 3, 3], &device).unwrap();
    let p = Conv2dParams {
        padding: [1, 1],
        ..Conv2dParams::default()
    };
    // The backward's converts and the leaf's gradient.
    let backward = |leaf: &Tensor, w: &Tensor| {
        let loss = x.conv2d(w, None, p).unwrap().mul(&r).unwrap();
        let loss = loss.sum(&[], false).unwrap();
        profile.reset();
        loss.backward().unwrap();
        let converts: Vec<String> = profile
            .rows()
            .into_iter()
            .filter(|row| row.label.starts_with("convert"))
            .flat_map(|row| std::iter::repeat_n(row.label, row.calls as usize))
            .collect();
        let grad = leaf.grad().expect("the leaf has a gradient");
        (converts, grad)
    };
    let leaf = |t: Tensor| t.detach().with_requires_grad(true);
    let oihw = leaf(master.cast(DType::BF16).unwrap());
    let (converts, want) = backward(&oihw, &oihw);
    assert!(converts.is_empty(), "{converts:?}");
    assert!(want.layout().is_contiguous());
    let want = want.cast(DType::F32).unwrap().to_vec::<f32>().unwrap();

    let last = leaf(master.cast_channels_last(DType::BF16).unwrap());
    let (converts, grad) = backward(&last, &last);
    assert!(converts.is_empty(), "a transposing copy: {converts:?}");
    assert!(grad.is_channels_last(), "{:?}", grad.layout());
    assert_eq!(
        grad.cast(DType::F32).unwrap().to_vec::<f32>().unwrap(),
        want
    );

    // Autocast's case: the f32 OIHW master, its bf16 channels-last copy in the convolution.
    let master = leaf(master);
    let low = master.cast_channels_last(DType::BF16).unwrap();
    let (converts, grad) = backward(&master, &low);
    assert_eq!(converts, ["convert BF16->F32 [8, 4, 3, 3]"]);
    assert!(grad.layout().is_contiguous(), "{:?}", grad.layout());
    assert_eq!(grad.to_vec::<f32>().unwrap(), want);
}

/// Each residual block's input gradient is its skip connection's plus its first convolution's:
/// on a device that adds the convolution's in place (cuDNN's β = 1; the reference does too),
/// the engine's 16 activation-sized adds of a ResNet-50 backward are gone — in f32 and under
/// bf16 autocast, channels-last (the benchmark's step). Counted on the reference against the
/// CPU backend, which adds separately.
#[test]
fn a_resnet50_backward_adds_every_blocks_input_gradient_in_place_where_the_device_can() {
    use redline_tensor::DType;
    // Calls labelled `conv dx+=…` and binary adds in one forward + backward on `device`.
    let count = |device: Device, amp: bool| -> (u64, u64) {
        let (device, profile) = OpProfile::wrap(device, true);
        let model = ResNet::new(
            ResNetConfig {
                num_classes: 10,
                ..ResNetConfig::new(50)
            },
            &device,
        )
        .unwrap();
        let mut x = Tensor::from_slice(&vec![0.5f32; 3 * 16 * 16], &[1, 3, 16, 16], &device);
        if amp {
            x = x.and_then(|x| x.to_channels_last());
        }
        let (x, y) = (
            x.unwrap(),
            Tensor::from_slice(&[3i64], &[1], &device).unwrap(),
        );
        profile.reset();
        let loss = {
            let _scope = amp.then(|| redline_amp::autocast(DType::BF16).unwrap());
            let logits = model.forward(&x).unwrap();
            redline_amp::for_f32(&logits)
                .and_then(|l| l.cross_entropy(&y, 0.0, None))
                .unwrap()
        };
        loss.backward().unwrap();
        let rows = profile.rows();
        let calls = |f: &dyn Fn(&str) -> bool| -> u64 {
            rows.iter().filter(|r| f(&r.label)).map(|r| r.calls).sum()
        };
        (
            calls(&|l| l.starts_with("conv dx+=")),
            calls(&|l| l.starts_with("add")),
        )
    };
    for amp in [false, true] {
        let (in_place, adds) = count(Device::reference(), amp);
        let cpu = Device::new(Arc::new(redline_cpu::CpuBackend::new()));
        let (none, separate_adds) = count(cpu, amp);
        assert_eq!((in_place, none), (16, 0), "amp {amp}");
        assert_eq!(
            separate_adds - adds,
            16,
            "amp {amp}: {separate_adds} adds, then {adds}"
        );
    }
}
