//! Precision a backend's kernels must keep where the conformance suite's random cases (values
//! of either sign, means near 0) never look: statistics that cancel.

use redline_tensor::{stats_dtype, DType, Device, RunningStats, Tensor};

/// Channel means far from 0 beside a spread of σ ≈ 0.115: 170 to 260 σ, where raw moments
/// (E[x²] − mean²) in f32 keep no digit of the variance.
const MEANS: [f64; 4] = [20.0, -15.0, 30.0, 0.5];
const SPREAD: f64 = 0.2;
const SHAPE: [usize; 4] = [8, 4, 6, 6];

/// Training batch norm on f32 activations whose channel means sit 170 to 260 σ from 0, with a
/// running mean that has found them (0.03 off: a warmed-up or fine-tuned network), NCHW and
/// channels-last: the output, the gradients of x, weight and bias and the updated running
/// statistics must match the reference computing in f64 on the same values, within 1e-4 of
/// each result's largest magnitude. The sums are taken about the running mean
/// (`BatchNormCoefParams::host`), so this holds where raw moments are off by 0.1–1%. Then a
/// non-finite running mean (NaN, ±inf) must not poison the batch's statistics: the output
/// stays finite and the reference's.
pub fn batch_norm_far_from_zero(device: &Device) -> Result<(), String> {
    let warm: Vec<f64> = MEANS.iter().map(|m| m + 0.03).collect();
    for channels_last in [false, true] {
        let what = format!("far from zero, channels-last {channels_last}");
        compare(device, &MEANS, &warm, channels_last, &what)?;
    }
    let near = [0.5, -0.25, 0.0, 1.0];
    let poisoned = [f64::NAN, f64::INFINITY, f64::NEG_INFINITY, 0.9];
    compare(device, &near, &poisoned, true, "a non-finite running mean")
}

/// One training step of batch norm on `device` (f32) and on the reference (f64), compared.
fn compare(
    device: &Device,
    means: &[f64; 4],
    running_mean: &[f64],
    channels_last: bool,
    what: &str,
) -> Result<(), String> {
    let got = step(device, DType::F32, means, running_mean, channels_last)
        .map_err(|e| format!("{what} on {device}: {e}"))?;
    let want = step(&Device::reference(), DType::F64, means, running_mean, false)
        .map_err(|e| format!("{what} on the reference: {e}"))?;
    let names = ["output", "dx", "dw", "db", "running mean", "running var"];
    for ((name, g), w) in names.iter().zip(&got).zip(&want) {
        let scale = w
            .iter()
            .filter(|v| v.is_finite())
            .fold(0.0f64, |m, v| m.max(v.abs()));
        for (i, (&g, &w)) in g.iter().zip(w).enumerate() {
            let same = (g.is_nan() && w.is_nan()) || g == w;
            let near = w.is_finite() && (g - w).abs() <= 1e-4 * scale;
            if !(same || near) {
                return Err(format!(
                    "{what} on {device}: {name}[{i}] = {g}, reference {w} (allowed 1e-4 of \
                     the largest, {scale})"
                ));
            }
        }
    }
    if got[0].iter().any(|v| !v.is_finite()) {
        return Err(format!("{what} on {device}: a non-finite output"));
    }
    Ok(())
}

/// `[y, dx, dw, db, running mean, running var]` of one training batch norm over x (`dtype`;
/// every value made as f32 first, so both sides see the same numbers) against a fixed loss
/// weighting.
fn step(
    dev: &Device,
    dtype: DType,
    means: &[f64; 4],
    running_mean: &[f64],
    channels_last: bool,
) -> redline_tensor::Result<Vec<Vec<f64>>> {
    let n: usize = SHAPE.iter().product();
    let inner = SHAPE[2] * SHAPE[3];
    // A deterministic spread in [-1, 1): 7919 is prime beside 1000.
    let x: Vec<f64> = (0..n)
        .map(|i| {
            let u = (i * 7919 % 1000) as f64 / 500.0 - 1.0;
            means[(i / inner) % SHAPE[1]] + SPREAD * u
        })
        .collect();
    let loss_weights: Vec<f64> = (0..n).map(|i| ((i * 31 % 17) as f64 - 8.0) / 8.0).collect();
    // Made from f32 (not every device has f64), then cast: the same values either side.
    let tensor = |v: &[f64], shape: &[usize], d: DType| {
        let v: Vec<f32> = v.iter().map(|&v| v as f32).collect();
        Tensor::from_slice(&v, shape, dev).and_then(|t| t.cast(d))
    };
    let mut x = tensor(&x, &SHAPE, dtype)?;
    if channels_last {
        x = x.to_channels_last()?;
    }
    let x = x.with_requires_grad(true);
    let sd = stats_dtype(dtype);
    let weight = tensor(&[1.5, 0.5, 1.0, 2.0], &[4], sd)?.with_requires_grad(true);
    let bias = tensor(&[0.1, -0.2, 0.3, 0.0], &[4], sd)?.with_requires_grad(true);
    let (mean, var) = (
        tensor(running_mean, &[4], sd)?,
        tensor(&[1.0; 4], &[4], sd)?,
    );
    let running = RunningStats {
        mean: &mean,
        var: &var,
        momentum: 0.1,
    };
    let y = x.batch_norm(Some(&weight), Some(&bias), Some(running), true, 1e-5)?;
    let lw = tensor(&loss_weights, &SHAPE, dtype)?;
    y.mul(&lw)?.sum(&[], false)?.backward()?;
    let grad = |t: &Tensor| -> redline_tensor::Result<Vec<f64>> {
        t.grad()
            .ok_or_else(|| redline_tensor::TensorError::Shape("no gradient".into()))?
            .to_f64_vec()
    };
    Ok(vec![
        y.to_f64_vec()?,
        grad(&x)?,
        grad(&weight)?,
        grad(&bias)?,
        mean.to_f64_vec()?,
        var.to_f64_vec()?,
    ])
}
