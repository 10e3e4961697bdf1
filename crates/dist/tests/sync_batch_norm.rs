//! Synchronised batch norm in one process (a world of one): its composed forward and backward
//! equal the fused batch norm's — outputs, every gradient and the running statistics — with
//! and without the fused ReLU and residual. The multi-process equality is in `multiprocess.rs`.

use std::sync::Arc;

use redline_dist::{Collective, SingleProcess, SyncBatchStats};
use redline_nn::layers::BatchNormReLU;
use redline_nn::{BatchNorm2d, Init, Module};
use redline_tensor::{DType, Tensor};

/// Within 2e-5 of each other, relative to the magnitude past 1: the two paths compose other
/// ops (a division by the summed count against the fused kernels' reciprocal), a rounding or
/// two apart — two ulps of the weight gradient's sums of ~240 are 3e-5.
fn close(a: &Tensor, b: &Tensor, what: &str) {
    let (a, b) = (a.to_vec::<f32>().unwrap(), b.to_vec::<f32>().unwrap());
    assert_eq!(a.len(), b.len(), "{what}");
    let worst = a
        .iter()
        .zip(&b)
        .fold(0f32, |m, (x, y)| m.max((x - y).abs() / y.abs().max(1.0)));
    assert!(
        worst <= 2e-5,
        "{what}: differs by {worst} (relative past 1)"
    );
}

#[test]
fn a_world_of_one_gives_what_the_fused_batch_norm_gives() {
    let device = redline_cpu::CpuBackend::device();
    for fused_relu in [false, true] {
        let make = || {
            let init = Init::new(3, &device, DType::F32);
            let bn = BatchNorm2d::new(&init, 4, 1.0).unwrap();
            // Non-trivial affine parameters.
            bn.weight.copy_from_f64s(&[0.5, 1.5, -1.0, 2.0]).unwrap();
            bn.bias.copy_from_f64s(&[0.1, -0.2, 0.3, 0.0]).unwrap();
            bn
        };
        let (plain, synced) = (make(), make());
        SyncBatchStats::install(&synced, &(Arc::new(SingleProcess) as Arc<dyn Collective>))
            .unwrap();
        let values: Vec<f32> = (0..3 * 4 * 5 * 5)
            .map(|i| ((i * 37 % 101) as f32 / 25.0 - 2.0) * (1.0 + (i % 4) as f32))
            .collect();
        let residual = Tensor::from_slice(&values[..], &[3, 4, 5, 5], &device)
            .unwrap()
            .mul_scalar(0.3)
            .unwrap();
        let run = |bn: &BatchNorm2d| {
            let x = Tensor::from_slice(&values, &[3, 4, 5, 5], &device)
                .unwrap()
                .with_requires_grad(true);
            let y = match fused_relu {
                true => bn.forward_relu(&x, Some(&residual)).unwrap(),
                false => bn.forward(&x).unwrap(),
            };
            // A loss that weights every output differently.
            let w = Tensor::from_slice(&values, &[3, 4, 5, 5], &device).unwrap();
            y.mul(&w)
                .unwrap()
                .sum(&[], false)
                .unwrap()
                .backward()
                .unwrap();
            (y, x.grad().unwrap())
        };
        let (y0, dx0) = run(&plain);
        let (y1, dx1) = run(&synced);
        let case = if fused_relu {
            "with ReLU and residual"
        } else {
            "plain"
        };
        close(&y0, &y1, &format!("{case}: output"));
        close(&dx0, &dx1, &format!("{case}: input gradient"));
        close(
            &plain.weight.grad().unwrap(),
            &synced.weight.grad().unwrap(),
            case,
        );
        close(
            &plain.bias.grad().unwrap(),
            &synced.bias.grad().unwrap(),
            case,
        );
        close(
            &plain.running_mean,
            &synced.running_mean,
            &format!("{case}: running mean"),
        );
        close(
            &plain.running_var,
            &synced.running_var,
            &format!("{case}: running variance"),
        );
        // Evaluation mode ignores the sync: running statistics, as before.
        synced.set_training(false);
        let x = Tensor::from_slice(&values, &[3, 4, 5, 5], &device).unwrap();
        plain.set_training(false);
        close(
            &plain.forward(&x).unwrap(),
            &synced.forward(&x).unwrap(),
            "evaluation",
        );
    }
    // The fused module forwards the sync to its norm.
    let init = Init::new(3, &device, DType::F32);
    let fused = BatchNormReLU(BatchNorm2d::new(&init, 2, 1.0).unwrap());
    let sync: Arc<dyn redline_nn::BatchStatsSync> =
        Arc::new(SyncBatchStats::new(Arc::new(SingleProcess)));
    fused.sync_batch_norm(Some(&sync));
    let x = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 5.0], &[2, 2, 1, 1], &device).unwrap();
    let y = fused.forward(&x).unwrap().to_vec::<f32>().unwrap();
    // Channel 0 holds 1 and 3, channel 1 holds 2 and 5: each normalised to ∓1 (eps aside), ReLU'd.
    assert!(
        y[0] == 0.0 && (y[2] - 1.0).abs() < 1e-4 && y[1] == 0.0 && (y[3] - 1.0).abs() < 1e-4,
        "{y:?}"
    );
}

#[test]
fn an_empty_batch_on_every_process_leaves_the_running_statistics_as_they_were() {
    // No process holds a sample: the summed count is 0. The statistics are 0 over 1, not
    // NaN, and the running statistics keep their values (no count is read on the host to
    // refuse the batch: that was a device round trip every step).
    let device = redline_cpu::CpuBackend::device();
    let init = Init::new(3, &device, DType::F32);
    let bn = BatchNorm2d::new(&init, 4, 0.1).unwrap();
    bn.running_mean
        .copy_from_f64s(&[0.5, -1.0, 2.0, 0.0])
        .unwrap();
    bn.running_var
        .copy_from_f64s(&[1.0, 2.0, 3.0, 4.0])
        .unwrap();
    SyncBatchStats::install(&bn, &(Arc::new(SingleProcess) as Arc<dyn Collective>)).unwrap();
    let x = Tensor::from_slice(&[] as &[f32], &[0, 4, 5, 5], &device).unwrap();
    let y = bn.forward(&x).unwrap();
    assert_eq!(y.shape(), &[0, 4, 5, 5]);
    assert_eq!(
        bn.running_mean.to_vec::<f32>().unwrap(),
        [0.5, -1.0, 2.0, 0.0]
    );
    assert_eq!(
        bn.running_var.to_vec::<f32>().unwrap(),
        [1.0, 2.0, 3.0, 4.0]
    );
}
