//! Layers under autocast (f16 and bf16 compute, f32 statistics and masters) and a full AMP
//! training step on the CPU backend, including one whose gradients overflow.

use redline_amp::{autocast, for_f32, GradScaler};
use redline_cpu::CpuBackend;
use redline_nn::layers::GlobalAvgPool;
use redline_nn::{
    decay_groups, named_parameters, AdamW, BatchNorm2d, Conv2d, Init, Linear, Module, ReLU,
    Sequential,
};
use redline_tensor::{Conv2dParams, DType, Device, Tensor};

fn small_cnn(device: &Device) -> Sequential {
    let mut init = Init::new(7, device, DType::F32);
    let pad = Conv2dParams {
        padding: [1, 1],
        ..Conv2dParams::default()
    };
    Sequential::new()
        .push(Conv2d::new(&mut init, 3, 8, 3, pad).unwrap())
        .push(BatchNorm2d::new(&init, 8, 1.0).unwrap())
        .push(ReLU)
        .push(GlobalAvgPool)
        .push(Linear::new(&mut init, 8, 4).unwrap())
}

fn batch(device: &Device) -> (Tensor, Tensor) {
    let values: Vec<f32> = (0..2 * 3 * 6 * 6)
        .map(|i| ((i * 37 % 23) as f32 - 11.0) / 7.0)
        .collect();
    let x = Tensor::from_slice(&values, &[2, 3, 6, 6], device).unwrap();
    let y = Tensor::from_slice(&[1i64, 3], &[2], device).unwrap();
    (x, y)
}

/// Loss and the gradient of every parameter, with `precision` None for f32.
fn loss_and_grads(model: &Sequential, precision: Option<DType>) -> (Tensor, Vec<(String, Tensor)>) {
    let device = named_parameters(model)[0].1.device().clone();
    let (x, y) = batch(&device);
    for (_, p) in named_parameters(model) {
        p.zero_grad();
    }
    let scope = precision.map(|d| autocast(d).unwrap());
    let logits = model.forward(&x).unwrap();
    let loss = for_f32(&logits)
        .unwrap()
        .cross_entropy(&y, 0.0, None)
        .unwrap();
    drop(scope);
    loss.backward().unwrap();
    let grads = named_parameters(model)
        .into_iter()
        .map(|(name, p)| (name, p.grad().expect("every parameter has a gradient")))
        .collect();
    (logits, grads)
}

fn close(a: &[f64], b: &[f64], tol: f64, what: &str) {
    let scale = b.iter().fold(0.0f64, |m, v| m.max(v.abs())).max(1e-3);
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!(
            (x - y).abs() <= tol * scale,
            "{what}[{i}]: {x} vs {y} (scale {scale})"
        );
    }
}

#[test]
fn autocast_runs_layers_in_half_precision_with_f32_statistics_and_master_gradients() {
    let device = CpuBackend::device();
    let model = small_cnn(&device);
    let (reference, want) = loss_and_grads(&model, None);
    assert_eq!(reference.dtype(), DType::F32);
    for (dtype, tol) in [(DType::F16, 1e-2), (DType::BF16, 5e-2)] {
        let (logits, got) = loss_and_grads(&model, Some(dtype));
        assert_eq!(
            logits.dtype(),
            dtype,
            "the classifier's matmul ran in {dtype}"
        );
        close(
            &logits.to_f64_vec().unwrap(),
            &reference.to_f64_vec().unwrap(),
            tol,
            "logits",
        );
        for ((name, g), (_, w)) in got.iter().zip(&want) {
            assert_eq!(g.dtype(), DType::F32, "{name}: master gradients stay f32");
            close(
                &g.to_f64_vec().unwrap(),
                &w.to_f64_vec().unwrap(),
                tol * 4.0,
                name,
            );
        }
    }
    // The parameters themselves never left f32.
    for (name, p) in named_parameters(&model) {
        assert_eq!(p.dtype(), DType::F32, "{name}");
    }
}

/// Every value's bits (f32 → f64 is exact, so equal bits here are equal bits on the device).
fn snapshot(tensors: &[(String, Tensor)]) -> Vec<(String, Vec<u64>)> {
    tensors
        .iter()
        .map(|(n, t)| {
            let bits = t
                .to_f64_vec()
                .unwrap()
                .iter()
                .map(|v| v.to_bits())
                .collect();
            (n.clone(), bits)
        })
        .collect()
}

#[test]
fn an_overflowing_amp_step_changes_nothing_but_the_scale() {
    let device = CpuBackend::device();
    let model = small_cnn(&device);
    let mut opt = AdamW::new(decay_groups(&model, 0.05), 0.9, 0.999, 1e-8).unwrap();
    let mut scaler = GradScaler::new(&device, DType::F32).unwrap();
    let params: Vec<Tensor> = named_parameters(&model)
        .into_iter()
        .map(|(_, p)| p)
        .collect();
    let (x, y) = batch(&device);
    let step = |opt: &mut AdamW, scaler: &mut GradScaler, poison: bool| {
        for p in &params {
            p.zero_grad();
        }
        let scope = autocast(DType::F16).unwrap();
        let logits = model.forward(&x).unwrap();
        let loss = for_f32(&logits)
            .unwrap()
            .cross_entropy(&y, 0.1, None)
            .unwrap();
        drop(scope);
        scaler.scale(&loss).unwrap().backward().unwrap();
        if poison {
            // An overflow in one gradient, as an f16 activation overflow would leave.
            let g = params[0].grad().unwrap();
            let mut v = g.to_vec::<f32>().unwrap();
            v[3] = f32::INFINITY;
            g.assign(&Tensor::from_slice(&v, g.shape(), &device).unwrap())
                .unwrap();
        }
        let flag = scaler.step_flag(&params).unwrap().clone();
        opt.step(1e-3, Some(&flag)).unwrap();
        scaler.update().unwrap();
    };
    step(&mut opt, &mut scaler, false);
    let weights = snapshot(&named_parameters(&model));
    let state = snapshot(&opt.state());
    let scale = scaler.state()[0].1.item().unwrap();

    step(&mut opt, &mut scaler, true);
    assert_eq!(
        snapshot(&named_parameters(&model)),
        weights,
        "weights bitwise unchanged"
    );
    assert_eq!(
        snapshot(&opt.state()),
        state,
        "moments and step counts bitwise unchanged"
    );
    assert_eq!(
        scaler.state()[0].1.item().unwrap(),
        scale / 2.0,
        "scale halved"
    );

    // The next clean step applies, as AdamW's second step (the count was not advanced).
    step(&mut opt, &mut scaler, false);
    assert_ne!(snapshot(&named_parameters(&model)), weights);
    let counts: Vec<f64> = opt
        .state()
        .iter()
        .filter(|(n, _)| n.starts_with("step"))
        .map(|(_, t)| t.item().unwrap())
        .collect();
    assert!(
        !counts.is_empty() && counts.iter().all(|&c| c == 2.0),
        "step counts {counts:?}"
    );
}
