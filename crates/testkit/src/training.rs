//! A training step every backend can run and compare: a tiny CNN (conv, batch norm, ReLU,
//! pooling, a linear layer) with the same parameters on every device, and one mixed-precision
//! step of it (f16 autocast, GradScaler, SGD or AdamW) — the AMP path end to end, including the
//! overflow skip and the scale backoff.

use redline_tensor::{Device, Tensor};

/// A tiny CNN whose parameters are the same on every device (seeded, rounded on the host).
pub fn tiny_cnn(device: &Device) -> redline_nn::Sequential {
    use redline_nn::{layers::GlobalAvgPool, BatchNorm2d, Conv2d, Init, Linear, ReLU};
    let mut init = Init::new(5, device, redline_tensor::DType::F32);
    let pad = redline_tensor::Conv2dParams {
        padding: [1, 1],
        ..Default::default()
    };
    redline_nn::Sequential::new()
        .push(Conv2d::new(&mut init, 3, 4, 3, pad).expect("conv"))
        .push(BatchNorm2d::new(&init, 4, 1.0).expect("bn"))
        .push(ReLU)
        .push(GlobalAvgPool)
        .push(Linear::new(&mut init, 4, 3).expect("linear"))
}

/// One AMP step (f16 autocast, GradScaler, then AdamW or SGD) of the tiny CNN on `device`;
/// `poison` puts an inf in the first gradient. Returns the parameters after it, the logits'
/// dtype, the found-inf flag and the scale after the update.
pub fn amp_step(
    device: &Device,
    poison: bool,
    adamw: bool,
) -> (Vec<Vec<f64>>, redline_tensor::DType, f64, f64) {
    use redline_amp::{autocast, for_f32, GradScaler};
    use redline_nn::{decay_groups, named_parameters, AdamW, Module, Optimizer, Sgd};
    use redline_tensor::DType;
    let model = tiny_cnn(device);
    let groups = decay_groups(&model, 0.01);
    let mut opt: Box<dyn Optimizer> = if adamw {
        Box::new(AdamW::new(groups, 0.9, 0.999, 1e-8).expect("adamw"))
    } else {
        Box::new(Sgd::new(groups, 0.9, 0.0, true).expect("sgd"))
    };
    let mut scaler = GradScaler::new(device, DType::F32).expect("scaler");
    let params: Vec<Tensor> = named_parameters(&model)
        .into_iter()
        .map(|(_, p)| p)
        .collect();
    let pixels: Vec<f32> = (0..2 * 3 * 8 * 8)
        .map(|i| ((i * 7 % 13) as f32 - 6.0) / 6.0)
        .collect();
    let x = Tensor::from_slice(&pixels, &[2, 3, 8, 8], device).expect("x");
    let y = Tensor::from_slice(&[2i64, 0], &[2], device).expect("y");
    let scope = autocast(DType::F16).expect("autocast");
    let logits = model.forward(&x).expect("forward");
    let loss = for_f32(&logits)
        .and_then(|l| l.cross_entropy(&y, 0.1, None))
        .expect("loss");
    drop(scope);
    scaler
        .scale(&loss)
        .and_then(|l| l.backward())
        .expect("backward");
    if poison {
        let g = params[0].grad().expect("a gradient");
        let mut v = g.to_vec::<f32>().expect("download");
        v[0] = f32::INFINITY;
        g.assign(&Tensor::from_slice(&v, g.shape(), device).expect("upload"))
            .expect("assign");
    }
    let flag = scaler.step_flag(&params).expect("unscale").clone();
    opt.step(0.1, Some(&flag)).expect("step");
    let found = flag.item().unwrap_or(f64::NAN);
    scaler.update().expect("update");
    let after = params
        .iter()
        .map(|p| p.to_f64_vec().expect("download"))
        .collect();
    let scale = scaler.state()[0].1.item().expect("scale");
    (after, logits.dtype(), found, scale)
}

/// The AMP step on `device` checked against `reference` (another backend, e.g. the CPU): the
/// classifier ran in f16, a clean step moves the parameters as the reference's did (within f16
/// noise), and a step with an inf planted in a gradient raises the device flag, moves nothing
/// and halves the scale. An error says which check failed.
pub fn check_amp_step(device: &Device, reference: &Device) -> Result<(), String> {
    // SGD for the compared step: an update proportional to the gradient (AdamW's first step is
    // ±lr whatever the gradient's size, so a tiny gradient's rounding could flip it).
    let (want, _, _, _) = amp_step(reference, false, false);
    let (got, dtype, flag, scale) = amp_step(device, false, false);
    if dtype != redline_tensor::DType::F16 {
        return Err(format!("the classifier ran in {dtype}, not f16"));
    }
    if (flag, scale) != (0.0, 65536.0) {
        return Err(format!(
            "a clean step left found-inf {flag} and scale {scale}"
        ));
    }
    for (g, w) in got.iter().zip(&want) {
        for (a, b) in g.iter().zip(w) {
            if (a - b).abs() > 2e-3 * b.abs().max(1.0) {
                return Err(format!("a parameter: {a} on {device}, {b} on {reference}"));
            }
        }
    }
    let before: Vec<Vec<f64>> = redline_nn::named_parameters(&tiny_cnn(device))
        .into_iter()
        .map(|(_, p)| p.to_f64_vec().map_err(|e| e.to_string()))
        .collect::<Result<_, _>>()?;
    let (after, _, flag, scale) = amp_step(device, true, true);
    if (flag, scale) != (1.0, 32768.0) {
        return Err(format!(
            "an overflowing step left found-inf {flag} and scale {scale}"
        ));
    }
    if after != before {
        return Err("a skipped step moved parameters".into());
    }
    Ok(())
}
