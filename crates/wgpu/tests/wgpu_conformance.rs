//! The wgpu hardware suite: the conformance suite on the first wgpu adapter (software Vulkan in
//! CI). Ignored in a plain `cargo test`; `cargo xtask test` runs it with `--ignored`. Without an
//! adapter it prints the skip marker xtask reports as "skipped" — or fails when
//! `REDLINE_HARDWARE_REQUIRED=1` (CI, `--require wgpu`).

use std::sync::{Arc, OnceLock};

use redline_tensor::{Device, Pool2dParams, Tensor};
use redline_testkit::training::check_amp_step;
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
    // Every op is declared for f32 and f16.
    assert!(
        report.matrix().contains("undeclared f32/f16 pairs: none\n"),
        "every other op must be declared for f32 and f16:\n{}",
        report.matrix()
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
fn timestamps_are_taken_in_queue_order_and_bracket_the_work_between_them() {
    let Some((device, adapter)) = device() else {
        return;
    };
    // Allowed by the trait, but lavapipe and every Vulkan GPU offer them: say so loudly.
    if let Err(e) = redline_testkit::timing::check_timestamps(&device) {
        panic!("{adapter:?}: {e}");
    }
}

#[test]
#[ignore = "hardware suite: cargo xtask test runs it"]
fn downloads_ordered_after_an_event_see_the_work_before_it() {
    let Some((device, adapter)) = device() else {
        return;
    };
    if let Err(e) = redline_testkit::events::check_events(&device) {
        panic!("{adapter:?}: {e}");
    }
}

#[test]
#[ignore = "hardware suite: cargo xtask test runs it"]
fn the_phase_clock_times_device_phases_from_timestamps() {
    use redline_train::{Phase, PhaseClock};
    let Some((device, _)) = device() else { return };
    let values: Vec<f32> = (0..96 * 96).map(|i| (i % 5) as f32).collect();
    let x = Tensor::from_slice(&values, &[96, 96], &device).unwrap();
    device.synchronize().unwrap();
    let mut clock = PhaseClock::start(&device).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(20));
    clock.lap_host(Phase::DataWait).unwrap();
    let y = x.matmul(&x).unwrap();
    clock.lap(Phase::Forward).unwrap();
    let z = y.matmul(&x).unwrap().matmul(&x).unwrap();
    clock.lap(Phase::Backward).unwrap();
    let times = clock.finish().unwrap();
    assert!(
        times.device_clock,
        "wgpu phases are read from device timestamps"
    );
    assert!(times.get(Phase::DataWait) >= std::time::Duration::from_millis(20));
    // The device spent time on each phase's work; phases with no work (host-to-device,
    // optimizer) got none.
    assert!(!times.get(Phase::Forward).is_zero(), "{times:?}");
    assert!(!times.get(Phase::Backward).is_zero(), "{times:?}");
    assert!(times.get(Phase::HostToDevice).is_zero() && times.get(Phase::Optimizer).is_zero());
    drop(z);
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

#[test]
#[ignore = "hardware suite: cargo xtask test runs it"]
fn an_amp_training_step_matches_the_cpu_backend_and_skips_on_overflow() {
    let Some((device, _)) = device() else {
        return;
    };
    let cpu = redline_cpu::CpuBackend::device();
    check_amp_step(&device, &cpu).unwrap_or_else(|e| panic!("{e}"));
}

#[test]
#[ignore = "hardware suite: cargo xtask test runs it"]
fn uploads_on_other_threads_never_overwrite_buffers_still_in_use() {
    let Some((device, _)) = device() else { return };
    // Each thread uploads its own constant, reads it in an op, drops it at once (its buffer goes
    // back to the shared pool while the op may not have run) and checks the result. An upload
    // that took that buffer and wrote it ahead of the op would change another thread's numbers.
    let threads: Vec<_> = (0..4)
        .map(|t| {
            let device = device.clone();
            std::thread::spawn(move || {
                for round in 0..200 {
                    let value = (t * 1000 + round) as f32;
                    let x = Tensor::from_slice(&[value; 64], &[64], &device).expect("upload");
                    let y = x.add_scalar(0.5).expect("op");
                    drop(x);
                    let got = y.to_vec::<f32>().expect("download");
                    assert!(
                        got.iter().all(|&v| v == value + 0.5),
                        "thread {t} round {round}: {:?} instead of {}",
                        &got[..4],
                        value + 0.5
                    );
                }
            })
        })
        .collect();
    for t in threads {
        t.join().expect("a thread saw another thread's upload");
    }
}

#[test]
#[ignore = "hardware suite: cargo xtask test runs it"]
fn a_training_loop_steady_state_creates_no_buffers() {
    if device().is_none() {
        return;
    }
    // A device of its own: the shared one's pool also serves the tests running beside this.
    let device = Device::new(Arc::new(WgpuBackend::new(|_| true).unwrap()));
    redline_testkit::training::check_steady_state_memory(&device).unwrap();
    let stats = device.memory_stats().expect("the buffer pool's statistics");
    assert!(stats.reserved >= stats.in_use && stats.peak_in_use >= stats.in_use);
}

#[test]
#[ignore = "hardware suite: cargo xtask test runs it"]
fn the_sum_of_squares_covers_many_workgroups_of_many_tensors() {
    let Some((device, _)) = device() else { return };
    // Tensors from one element to past 256 workgroups' worth, in f32.
    let lens = [1usize, 63, 1000, 70_001, 300_000];
    let values: Vec<Vec<f32>> = (lens.iter().enumerate())
        .map(|(k, &n)| {
            (0..n)
                .map(|i| ((i * 7 + k) % 23) as f32 / 11.0 - 1.0)
                .collect()
        })
        .collect();
    let tensors: Vec<Tensor> = (values.iter())
        .map(|v| Tensor::from_slice(v, &[v.len()], &device).unwrap())
        .collect();
    let storages: Vec<&redline_tensor::Storage> = tensors.iter().map(|t| &**t.storage()).collect();
    let sum = device.backend().sum_squares(&storages).unwrap();
    let got = Tensor::from_storage(sum, redline_tensor::Layout::contiguous(&[]), device.clone())
        .item()
        .unwrap();
    let want: f64 = values
        .iter()
        .flatten()
        .map(|&v| f64::from(v) * f64::from(v))
        .sum();
    assert!((got - want).abs() <= 1e-5 * want, "{got} vs {want}");
}

#[test]
#[ignore = "hardware suite: cargo xtask test runs it"]
fn random_stream_follows_its_device_offset() {
    let Some((device, _)) = device() else { return };
    redline_testkit::conformance::random_stream_follows_its_device_offset(&device);
}

#[test]
#[ignore = "hardware suite: cargo xtask test runs it"]
fn conv_weight_grad_in_the_weights_order() {
    let Some((device, _)) = device() else { return };
    redline_testkit::conformance::conv_weight_grad_in_the_weights_order(&device).unwrap();
}

#[test]
#[ignore = "hardware suite: cargo xtask test runs it"]
fn conv_input_grad_into_a_waiting_gradient() {
    let Some((device, _)) = device() else { return };
    redline_testkit::conformance::conv_input_grad_into_a_waiting_gradient(&device).unwrap();
}

#[test]
#[ignore = "hardware suite: cargo xtask test runs it"]
fn cross_entropy_without_ignore_index_keeps_every_sample() {
    let Some((device, _)) = device() else { return };
    redline_testkit::conformance::cross_entropy_without_ignore_index_keeps_every_sample(&device);
}

#[test]
#[ignore = "hardware suite: cargo xtask test runs it"]
fn batch_norm_far_from_zero_keeps_its_digits() {
    let Some((device, _)) = device() else { return };
    redline_testkit::precision::batch_norm_far_from_zero(&device).unwrap();
}

#[test]
#[ignore = "hardware suite: cargo xtask test runs it"]
fn non_finite_values_as_the_reference() {
    let Some((device, _)) = device() else { return };
    redline_testkit::conformance::non_finite_values_as_the_reference(&device).unwrap();
}
