//! Precision a backend's kernels must keep where the conformance suite's random cases (values
//! of either sign, means near 0) never look: statistics that cancel.

use redline_tensor::{stats_dtype, DType, Device, RunningStats, Tensor};

/// A spread of σ ≈ 0.115 about each channel's mean.
const SPREAD: f64 = 0.2;
const SHAPE: [usize; 4] = [8, 4, 6, 6];
/// Channel means 5,000 to 17,000 σ from 0, where raw products x·g keep none of the digits of
/// Σ(x − mean)·g.
const BACKWARD_MEANS: [f64; 4] = [1000.0, -600.0, 2000.0, 0.5];
/// Channel means 170 to 260 σ from 0, where raw moments (E[x²] − mean²) in f32 keep none of
/// the variance's digits — and not further, where the output's affine a·x + b (as PyTorch's)
/// would lose 1e-4 of its own.
const FORWARD_MEANS: [f64; 4] = [20.0, -15.0, 30.0, 0.5];

/// Training batch norm far from zero on `device` against the reference in f64: the forward
/// and its backward at 170–260 σ ([`training_far_from_zero`]), and the backward's statistics
/// alone at 5,000–17,000 σ ([`batch_norm_backward_far_from_zero`]).
pub fn batch_norm_far_from_zero(device: &Device) -> Result<(), String> {
    training_far_from_zero(device)?;
    batch_norm_backward_far_from_zero(device)
}

/// Within 1e-4 of `want`'s largest magnitude, element by element (NaN matches NaN).
fn near(device: &Device, what: &str, name: &str, got: &[f64], want: &[f64]) -> Result<(), String> {
    let scale = want.iter().fold(0.0f64, |m, v| m.max(v.abs()));
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let near = (g - w).abs() <= 1e-4 * scale || (g.is_nan() && w.is_nan());
        if !near {
            return Err(format!(
                "{what} on {device}: {name}[{i}] = {g}, reference {w} (allowed 1e-4 of the \
                 largest, {scale})"
            ));
        }
    }
    Ok(())
}

/// Training batch norm (NCHW and channels-last) on f32 activations whose channel means sit
/// 170–260 σ from 0: the output, the gradients of x, weight and bias and the updated running
/// statistics within 1e-4 of each result's largest magnitude of the reference's in f64. The
/// forward's sums are taken about each channel's first element
/// ([`redline_tensor::Backend::batch_norm_stats_coef`]); with raw moments the reference's own
/// f32 output is 1.3e-3 off here.
pub fn training_far_from_zero(device: &Device) -> Result<(), String> {
    let names = ["output", "dx", "dw", "db", "running mean", "running var"];
    against_f64(
        device,
        "training batch norm far from zero",
        &names,
        training_step,
    )
}

/// One run on a device in a dtype, channels-last or not: its results, each flattened.
type Step = fn(&Device, DType, bool) -> redline_tensor::Result<Vec<Vec<f64>>>;

/// `step` on `device` in f32 (NCHW and channels-last) against the reference in f64, each
/// result (named by `names`) within 1e-4 of its largest magnitude.
fn against_f64(device: &Device, what: &str, names: &[&str], step: Step) -> Result<(), String> {
    for channels_last in [false, true] {
        let what = format!("{what}, channels-last {channels_last}");
        let got = step(device, DType::F32, channels_last)
            .map_err(|e| format!("{what} on {device}: {e}"))?;
        let want = step(&Device::reference(), DType::F64, false)
            .map_err(|e| format!("{what} on the reference: {e}"))?;
        for ((name, g), w) in names.iter().zip(&got).zip(&want) {
            near(device, &what, name, g, w)?;
        }
    }
    Ok(())
}

/// x of `SHAPE` about `means`, its values made as f32 (so both sides see the same numbers):
/// a deterministic spread in [-1, 1) (7919 is prime beside 1000).
fn activations(means: &[f64; 4]) -> Vec<f64> {
    let inner = SHAPE[2] * SHAPE[3];
    let n: usize = SHAPE.iter().product();
    (0..n)
        .map(|i| {
            let u = (i * 7919 % 1000) as f64 / 500.0 - 1.0;
            f64::from((means[(i / inner) % SHAPE[1]] + SPREAD * u) as f32)
        })
        .collect()
}

/// A tensor of `dtype` on `dev` made from f32 values (not every device has f64), then cast.
fn tensor(
    dev: &Device,
    v: &[f64],
    shape: &[usize],
    dtype: DType,
) -> redline_tensor::Result<Tensor> {
    let v: Vec<f32> = v.iter().map(|&v| v as f32).collect();
    Tensor::from_slice(&v, shape, dev).and_then(|t| t.cast(dtype))
}

/// `[y, dx, dw, db, running mean, running var]` of one training batch norm against a fixed
/// loss weighting.
fn training_step(
    dev: &Device,
    dtype: DType,
    channels_last: bool,
) -> redline_tensor::Result<Vec<Vec<f64>>> {
    let n: usize = SHAPE.iter().product();
    let loss_weights: Vec<f64> = (0..n).map(|i| ((i * 31 % 17) as f64 - 8.0) / 8.0).collect();
    let mut x = tensor(dev, &activations(&FORWARD_MEANS), &SHAPE, dtype)?;
    if channels_last {
        x = x.to_channels_last()?;
    }
    let x = x.with_requires_grad(true);
    let sd = stats_dtype(dtype);
    let weight = tensor(dev, &[1.5, 0.5, 1.0, 2.0], &[4], sd)?.with_requires_grad(true);
    let bias = tensor(dev, &[0.1, -0.2, 0.3, 0.0], &[4], sd)?.with_requires_grad(true);
    let (mean, var) = (
        tensor(dev, &[0.0; 4], &[4], sd)?,
        tensor(dev, &[1.0; 4], &[4], sd)?,
    );
    let running = RunningStats {
        mean: &mean,
        var: &var,
        momentum: 0.1,
    };
    let y = x.batch_norm(Some(&weight), Some(&bias), Some(running), true, 1e-5)?;
    let lw = tensor(dev, &loss_weights, &SHAPE, dtype)?;
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

/// Batch norm's backward statistics and coefficients (`batch_norm_grad_stats_coef`) on f32
/// activations whose channel means sit thousands of σ from 0, NCHW and channels-last, with
/// the saved `[mean; rstd]` a forward would have kept: the input gradient's coefficients, dw
/// and db must match the reference computing in f64 on the same values, within 1e-4 of each
/// result's largest magnitude. The sums are centred on the saved mean
/// ([`redline_tensor::Backend::batch_norm_stats`]'s `centre`); with raw Σx·g, rounding it to
/// the f32 it is kept in alone is 5e-4 of the centred sum here.
pub fn batch_norm_backward_far_from_zero(device: &Device) -> Result<(), String> {
    let names = ["coefficients", "dw", "db"];
    against_f64(
        device,
        "batch norm's backward far from zero",
        &names,
        backward,
    )
}

/// `[coef, dw, db]` of the backward statistics over x and a gradient (`dtype`; every value
/// made as f32 first, so both sides see the same numbers), with the batch's own saved mean
/// and rstd (computed in f64, kept as f32).
fn backward(
    dev: &Device,
    dtype: DType,
    channels_last: bool,
) -> redline_tensor::Result<Vec<Vec<f64>>> {
    let (c, n) = (SHAPE[1], SHAPE.iter().product::<usize>());
    let (count, inner) = (n / c, SHAPE[2] * SHAPE[3]);
    let x = activations(&BACKWARD_MEANS);
    // A gradient with a mean of its own (0.25), as a channel's usually has.
    let g: Vec<f64> = (0..n).map(|i| ((i * 31 % 17) as f64 - 6.0) / 8.0).collect();
    let mut saved = vec![0.0; 2 * c];
    for ch in 0..c {
        let values = x.iter().enumerate().filter(|(i, _)| (i / inner) % c == ch);
        let values: Vec<f64> = values.map(|(_, &v)| v).collect();
        let mean = values.iter().sum::<f64>() / count as f64;
        let var = values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / count as f64;
        saved[ch] = mean;
        saved[c + ch] = 1.0 / (var + 1e-5).sqrt();
    }
    let (mut x, mut g) = (
        tensor(dev, &x, &SHAPE, dtype)?,
        tensor(dev, &g, &SHAPE, dtype)?,
    );
    if channels_last {
        (x, g) = (x.to_channels_last()?, g.to_channels_last()?);
    }
    let sd = stats_dtype(dtype);
    let saved = tensor(dev, &saved, &[2, c], sd)?;
    let weight = tensor(dev, &[1.5, 0.5, 1.0, 2.0], &[c], sd)?;
    let (coef, dw, db) =
        x.batch_norm_grad_stats_coef(&g, None, &saved, Some(&weight), count as f64)?;
    Ok(vec![coef.to_f64_vec()?, dw.to_f64_vec()?, db.to_f64_vec()?])
}
