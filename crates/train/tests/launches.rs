//! How many device calls a ResNet-50 training step issues (counted by the op profile on the
//! CPU backend; the same front end issues the same calls on every device that declares the
//! same ops). A count, not a time: launches are what a host-bound GPU step pays for.

use std::sync::Arc;

use redline_nn::{named_parameters, Module, ResNet, ResNetConfig};
use redline_tensor::{Device, Tensor};
use redline_train::profile::{OpKind, OpProfile};

#[test]
fn a_resnet50_step_issues_six_launches_per_batch_norm_and_under_seven_hundred_in_all() {
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
    // Forward: statistics, coefficients, apply; backward: statistics, coefficients, apply.
    assert_eq!(
        calls(&|l| l.starts_with("batch_norm")),
        6 * norms,
        "{rows:#?}"
    );
    assert_eq!(calls(&|l| l == "batch_norm_coef"), norms);
    // The loss: softmax, smoothing, mask and gradient in one call (was ~12 forward, ~10 back).
    assert_eq!(calls(&|l| l.starts_with("cross_entropy")), 1, "{rows:#?}");
    assert_eq!(calls(&|l| l == "batch_norm_grad_coef"), norms);
    // The counter every norm carries costs nothing in the step (written when read): the few
    // fills left are the loss's constants and the backward's seed.
    assert!(calls(&|l| l == "fill") < 12, "{rows:#?}");
    // 3,310 before the coefficient ops (issue 18), 525 with them and the fused cross-entropy.
    assert!(launches < 700, "{launches} launches: {rows:#?}");
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
