//! The wgpu hardware suite: the conformance suite on the first wgpu adapter (software Vulkan in
//! CI). Ignored in a plain `cargo test`; `cargo xtask test` runs it with `--ignored` when the
//! probe finds an adapter (and fails when one is required but missing).

use std::sync::Arc;

use redline_tensor::{Device, Tensor};
use redline_testkit::{run_conformance, SuiteConfig};
use redline_wgpu::WgpuBackend;

fn device() -> (Device, redline_wgpu::AdapterSummary) {
    let backend =
        WgpuBackend::new(|_| true).expect("a wgpu adapter (the hardware suite needs one)");
    let adapter = backend.adapter();
    (Device::new(Arc::new(backend)), adapter)
}

#[test]
#[ignore = "hardware suite: cargo xtask test runs it where an adapter exists"]
fn wgpu_passes_the_conformance_suite() {
    let (device, adapter) = device();
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
}

#[test]
#[ignore = "hardware suite: cargo xtask test runs it where an adapter exists"]
fn many_ops_per_submit_and_buffers_are_recycled() {
    let (device, _) = device();
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
