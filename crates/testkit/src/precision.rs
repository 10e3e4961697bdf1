//! Precision a backend's kernels must keep where the conformance suite's random cases (values
//! of either sign, means near 0) never look: statistics that cancel.

use redline_tensor::{stats_dtype, DType, Device, Tensor};

/// Channel means far from 0 beside a spread of σ ≈ 0.115 (5,000 to 17,000 σ), where raw
/// products x·g keep none of the digits of Σ(x − mean)·g.
const MEANS: [f64; 4] = [1000.0, -600.0, 2000.0, 0.5];
const SPREAD: f64 = 0.2;
const SHAPE: [usize; 4] = [8, 4, 6, 6];

/// Batch norm's backward statistics and coefficients (`batch_norm_grad_stats_coef`) on f32
/// activations whose channel means sit thousands of σ from 0, NCHW and channels-last, with
/// the saved `[mean; rstd]` a forward would have kept: the input gradient's coefficients, dw
/// and db must match the reference computing in f64 on the same values, within 1e-4 of each
/// result's largest magnitude. The sums are centred on the saved mean
/// ([`redline_tensor::Backend::batch_norm_stats`]'s `centre`); with raw Σx·g, rounding it to
/// the f32 it is kept in alone is 5e-4 of the centred sum here.
pub fn batch_norm_backward_far_from_zero(device: &Device) -> Result<(), String> {
    for channels_last in [false, true] {
        let what = format!("batch norm's backward far from zero, channels-last {channels_last}");
        let got = backward(device, DType::F32, channels_last)
            .map_err(|e| format!("{what} on {device}: {e}"))?;
        let want = backward(&Device::reference(), DType::F64, false)
            .map_err(|e| format!("{what} on the reference: {e}"))?;
        for ((name, g), w) in ["coefficients", "dw", "db"].iter().zip(&got).zip(&want) {
            let scale = w.iter().fold(0.0f64, |m, v| m.max(v.abs()));
            for (i, (&g, &w)) in g.iter().zip(w).enumerate() {
                let near = (g - w).abs() <= 1e-4 * scale;
                if !near {
                    return Err(format!(
                        "{what} on {device}: {name}[{i}] = {g}, reference {w} (allowed 1e-4 \
                         of the largest, {scale})"
                    ));
                }
            }
        }
    }
    Ok(())
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
    let count = n / c;
    let inner = SHAPE[2] * SHAPE[3];
    let f32_of = |v: f64| f64::from(v as f32);
    // A deterministic spread in [-1, 1): 7919 and 31 are prime beside 1000 and 17.
    let x: Vec<f64> = (0..n)
        .map(|i| {
            let u = (i * 7919 % 1000) as f64 / 500.0 - 1.0;
            f32_of(MEANS[(i / inner) % c] + SPREAD * u)
        })
        .collect();
    // A gradient with a mean of its own (0.25), as a channel's usually has.
    let g: Vec<f64> = (0..n).map(|i| ((i * 31 % 17) as f64 - 6.0) / 8.0).collect();
    let mut saved = vec![0.0; 2 * c];
    for ch in 0..c {
        let values = x.iter().enumerate().filter(|(i, _)| (i / inner) % c == ch);
        let values: Vec<f64> = values.map(|(_, &v)| v).collect();
        let mean = values.iter().sum::<f64>() / count as f64;
        let var = values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / count as f64;
        saved[ch] = f32_of(mean);
        saved[c + ch] = f32_of(1.0 / (var + 1e-5).sqrt());
    }
    // Made from f32 (not every device has f64), then cast: the same values either side.
    let tensor = |v: &[f64], shape: &[usize], d: DType| {
        let v: Vec<f32> = v.iter().map(|&v| v as f32).collect();
        Tensor::from_slice(&v, shape, dev).and_then(|t| t.cast(d))
    };
    let (mut x, mut g) = (tensor(&x, &SHAPE, dtype)?, tensor(&g, &SHAPE, dtype)?);
    if channels_last {
        (x, g) = (x.to_channels_last()?, g.to_channels_last()?);
    }
    let sd = stats_dtype(dtype);
    let saved = tensor(&saved, &[2, c], sd)?;
    let weight = tensor(&[1.5, 0.5, 1.0, 2.0], &[c], sd)?;
    let (coef, dw, db) =
        x.batch_norm_grad_stats_coef(&g, None, &saved, Some(&weight), count as f64)?;
    Ok(vec![coef.to_f64_vec()?, dw.to_f64_vec()?, db.to_f64_vec()?])
}
