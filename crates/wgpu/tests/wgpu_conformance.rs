//! The wgpu hardware suite: the conformance suite on the first wgpu adapter (software Vulkan in
//! CI). Ignored in a plain `cargo test`; `cargo xtask test` runs it with `--ignored`. Without an
//! adapter it prints the skip marker xtask reports as "skipped" — or fails when
//! `REDLINE_HARDWARE_REQUIRED=1` (CI, `--require wgpu`).

use std::sync::{Arc, OnceLock};

use redline_tensor::{Device, Pool2dParams, Tensor};
use redline_testkit::{run_conformance, SuiteConfig};
use redline_wgpu::WgpuBackend;

/// One device for the whole test binary (creating a Vulkan device is slow on lavapipe).
fn device() -> Option<(Device, redline_wgpu::AdapterSummary)> {
    static SHARED: OnceLock<Result<(Device, redline_wgpu::AdapterSummary), String>> =
        OnceLock::new();
    let shared = SHARED.get_or_init(|| {
        WgpuBackend::new(|_| true)
            .map(|backend| {
                let adapter = backend.adapter();
                (Device::new(Arc::new(backend)), adapter)
            })
            .map_err(|e| e.to_string())
    });
    let required = std::env::var("REDLINE_HARDWARE_REQUIRED").is_ok_and(|v| v == "1");
    match shared {
        Ok(found) => Some(found.clone()),
        Err(e) if required => panic!("the wgpu suite is required but: {e}"),
        Err(e) => {
            println!("redline-hardware-skip: {e}");
            None
        }
    }
}

#[test]
#[ignore = "hardware suite: cargo xtask test runs it"]
fn wgpu_passes_the_conformance_suite() {
    let Some((device, adapter)) = device() else {
        return;
    };
    println!("adapter: {adapter:?}");
    // Software Vulkan runs at ~0.3 GFLOP/s: few, small cases.
    let report = run_conformance(
        &device,
        &SuiteConfig {
            cases: 6,
            max_shrink_ms: 5_000,
        },
    );
    println!("{}", report.matrix());
    report.assert_passed();
    assert!(
        report.matrix().contains("undeclared f32/f16 pairs: none"),
        "every op must be declared for f32 and f16"
    );
}

#[test]
#[ignore = "hardware suite: cargo xtask test runs it"]
fn many_ops_per_submit_and_buffers_are_recycled() {
    let Some((device, _)) = device() else { return };
    let x = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0], &[2, 2], &device).unwrap();
    let mut y = x.clone();
    // 300 ops: several batched submits, each intermediate dropped back into the pool.
    for _ in 0..100 {
        y = y.mul_scalar(1.0).unwrap().add(&x).unwrap().sub(&x).unwrap();
    }
    assert_eq!(y.to_vec::<f32>().unwrap(), [1.0, 2.0, 3.0, 4.0]);
    let t = x.transpose(0, 1).unwrap().matmul(&x).unwrap();
    assert_eq!(t.to_vec::<f32>().unwrap(), [10.0, 14.0, 14.0, 20.0]);
    let err = Tensor::from_slice(&[1.0f64], &[1], &device).unwrap_err();
    assert!(err.to_string().contains("f64"), "{err}");
}

#[test]
#[ignore = "hardware suite: cargo xtask test runs it"]
fn downloads_run_asynchronously_and_see_exactly_the_ops_before_them() {
    let Some((device, _)) = device() else { return };
    let x = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0], &[2, 2], &device).unwrap();
    let doubled = x.mul_scalar(2.0).unwrap();
    let pending = doubled.to_vec_async::<f32>().unwrap();
    // A strided view goes through a dense copy first.
    let transposed = x.transpose(0, 1).unwrap().to_vec_async::<f32>().unwrap();
    // Later work, some of it in `doubled`'s recycled buffer, runs while the copy is in flight.
    drop(doubled);
    let mut y = x.clone();
    for _ in 0..50 {
        y = y.add(&x).unwrap();
    }
    let later = y.to_vec_async::<f32>().unwrap();
    assert_eq!(pending.wait().unwrap(), [2.0, 4.0, 6.0, 8.0]);
    assert_eq!(transposed.wait().unwrap(), [1.0, 3.0, 2.0, 4.0]);
    assert_eq!(later.wait().unwrap(), [51.0, 102.0, 153.0, 204.0]);
    // A download dropped unread is harmless.
    drop(x.to_vec_async::<f32>().unwrap());
    assert_eq!(x.to_vec::<f32>().unwrap(), [1.0, 2.0, 3.0, 4.0]);
}

#[test]
#[ignore = "hardware suite: cargo xtask test runs it"]
fn pooling_gradients_are_pulled_deterministically() {
    let Some((device, _)) = device() else { return };
    // Overlapping 3x3 windows at stride 2 (ResNet's stem pool): inputs covered by up to four
    // windows, ties broken by the first maximum.
    let values: Vec<f32> = (0..2 * 3 * 13 * 13)
        .map(|i| ((i * 37) % 11) as f32)
        .collect();
    let p = Pool2dParams {
        kernel: [3, 3],
        stride: [2, 2],
        padding: [1, 1],
    };
    let grads = || {
        let x = Tensor::from_slice(&values, &[2, 3, 13, 13], &device)
            .unwrap()
            .with_requires_grad(true);
        let y = x
            .max_pool2d(p)
            .unwrap()
            .add(&x.avg_pool2d(p).unwrap())
            .unwrap();
        let w = Tensor::from_slice(
            &(0..y.numel())
                .map(|i| 1.0 + i as f32 / 7.0)
                .collect::<Vec<_>>(),
            y.shape(),
            &device,
        )
        .unwrap();
        y.mul(&w)
            .unwrap()
            .sum(&[], false)
            .unwrap()
            .backward()
            .unwrap();
        x.grad().unwrap().to_vec::<f32>().unwrap()
    };
    let (first, second) = (grads(), grads());
    assert_eq!(
        first.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        second.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
    );
}
