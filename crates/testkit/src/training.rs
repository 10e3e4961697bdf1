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

/// The tiny CNN with its optimizer, GradScaler and a fixed batch: AMP steps of it, one after
/// another, as a training loop runs them.
pub struct AmpLoop {
    model: redline_nn::Sequential,
    opt: Box<dyn redline_nn::Optimizer>,
    scaler: redline_amp::GradScaler,
    params: Vec<Tensor>,
    x: Tensor,
    y: Tensor,
}

impl AmpLoop {
    /// The loop on `device`, with AdamW (else SGD with Nesterov momentum).
    pub fn new(device: &Device, adamw: bool) -> Self {
        use redline_nn::{decay_groups, named_parameters, AdamW, Optimizer, Sgd};
        let model = tiny_cnn(device);
        let groups = decay_groups(&model, 0.01);
        let opt: Box<dyn Optimizer> = if adamw {
            Box::new(AdamW::new(groups, 0.9, 0.999, 1e-8).expect("adamw"))
        } else {
            Box::new(Sgd::new(groups, 0.9, 0.0, true).expect("sgd"))
        };
        let scaler =
            redline_amp::GradScaler::new(device, redline_tensor::DType::F32).expect("scaler");
        let params = named_parameters(&model)
            .into_iter()
            .map(|(_, p)| p)
            .collect();
        let pixels: Vec<f32> = (0..2 * 3 * 8 * 8)
            .map(|i| ((i * 7 % 13) as f32 - 6.0) / 6.0)
            .collect();
        let x = Tensor::from_slice(&pixels, &[2, 3, 8, 8], device).expect("x");
        let y = Tensor::from_slice(&[2i64, 0], &[2], device).expect("y");
        Self {
            model,
            opt,
            scaler,
            params,
            x,
            y,
        }
    }

    /// One step (f16 autocast, scaled backward, unscale and check, update, scale update);
    /// `poison` puts an inf in the first gradient. Returns the logits' dtype and the found-inf
    /// flag as the update saw it (read before the scale update).
    pub fn step(&mut self, poison: bool) -> (redline_tensor::DType, f64) {
        use redline_amp::{autocast, for_f32};
        use redline_nn::Module;
        let scope = autocast(redline_tensor::DType::F16).expect("autocast");
        let logits = self.model.forward(&self.x).expect("forward");
        let loss = for_f32(&logits)
            .and_then(|l| l.cross_entropy(&self.y, 0.1, None))
            .expect("loss");
        drop(scope);
        (self.scaler.scale(&loss))
            .and_then(|l| l.backward())
            .expect("backward");
        if poison {
            let g = self.params[0].grad().expect("a gradient");
            let mut v = g.to_vec::<f32>().expect("download");
            v[0] = f32::INFINITY;
            g.assign(&Tensor::from_slice(&v, g.shape(), g.device()).expect("upload"))
                .expect("assign");
        }
        let flag = self
            .scaler
            .step_flag(&self.params)
            .expect("unscale")
            .clone();
        self.opt.step(0.1, Some(&flag)).expect("step");
        let found = flag.item().unwrap_or(f64::NAN);
        self.scaler.update().expect("update");
        for p in &self.params {
            p.zero_grad();
        }
        (logits.dtype(), found)
    }
}

/// One AMP step (f16 autocast, GradScaler, then AdamW or SGD) of the tiny CNN on `device`;
/// `poison` puts an inf in the first gradient. Returns the parameters after it, the logits'
/// dtype, the found-inf flag and the scale after the update.
pub fn amp_step(
    device: &Device,
    poison: bool,
    adamw: bool,
) -> (Vec<Vec<f64>>, redline_tensor::DType, f64, f64) {
    let mut run = AmpLoop::new(device, adamw);
    let (dtype, found) = run.step(poison);
    let after = (run.params.iter())
        .map(|p| p.to_f64_vec().expect("download"))
        .collect();
    let scale = run.scaler.state()[0].1.item().expect("scale");
    (after, dtype, found, scale)
}

/// A training loop's steady state on `device` takes nothing new from the device: after two
/// warm-up AMP steps, three more make no device allocation, reserve no more memory and leave
/// as much in use as before (the caching allocator's contract, DESIGN's "no cudaMalloc in the
/// steady state"). A device without allocator statistics (the CPU backends) passes trivially —
/// its storages are host allocations.
pub fn check_steady_state_memory(device: &Device) -> Result<(), String> {
    let mut run = AmpLoop::new(device, true);
    for _ in 0..2 {
        run.step(false);
    }
    device.synchronize().map_err(|e| e.to_string())?;
    let Some(warm) = device.memory_stats() else {
        return Ok(());
    };
    for _ in 0..3 {
        run.step(false);
    }
    device.synchronize().map_err(|e| e.to_string())?;
    let after = device.memory_stats().ok_or("memory statistics went away")?;
    if after.device_allocations != warm.device_allocations || after.reserved != warm.reserved {
        return Err(format!(
            "steps after the warm-up allocated from the device: {warm} → {after}"
        ));
    }
    if after.in_use != warm.in_use {
        return Err(format!(
            "memory in use changed from one step to the next: {warm} → {after}"
        ));
    }
    if after.reuses <= warm.reuses {
        return Err(format!("no request was served from the cache: {after}"));
    }
    Ok(())
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
