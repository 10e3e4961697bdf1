//! Gradcheck of the ops the front end composes from primitives: cross-entropy (label smoothing,
//! ignore-index), batch norm in training, layer norm, embedding, dropout, mean/var, pooling.

use redline_tensor::{DType, Device, Result, RunningStats, Tensor};
use redline_testkit::{gradcheck_fn, Input, ViewKind};

/// Deterministic values in [-2, 2).
fn values(n: usize, seed: u64) -> Vec<f64> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 11) as f64 / (1u64 << 53) as f64 * 4.0 - 2.0
        })
        .collect()
}

fn f64_input(shape: &[usize], seed: u64, view: ViewKind) -> Input {
    let base = Input::base_shape(shape, view);
    Input {
        shape: shape.to_vec(),
        values: values(base.iter().product(), seed),
        dtype: DType::F64,
        view,
    }
}

fn i64_input(values: &[i64]) -> Input {
    Input {
        shape: vec![values.len()],
        values: values.iter().map(|&v| v as f64).collect(),
        dtype: DType::I64,
        view: ViewKind::Plain,
    }
}

#[test]
fn cross_entropy_with_smoothing_and_ignore_index() {
    let cases = [
        (0.0, None, [0, 3, 2, 2, 1]),
        (0.1, None, [0, 3, 2, 2, 1]),
        (0.1, Some(-100), [0, 3, -100, 2, 1]),
        (0.0, Some(2), [0, 3, 2, 2, 1]),
    ];
    for (smoothing, ignore, targets) in cases {
        let inputs = [f64_input(&[5, 4], 1, ViewKind::Plain), i64_input(&targets)];
        gradcheck_fn("cross_entropy", &inputs, &[0], |x| {
            x[0].cross_entropy(&x[1], smoothing, ignore)
        })
        .unwrap();
    }
}

/// (name, inputs, inputs that get gradients, the function).
type Check = (
    &'static str,
    Vec<Input>,
    Vec<usize>,
    Box<dyn Fn(&[Tensor]) -> Result<Tensor>>,
);

#[test]
fn norms_embedding_dropout_and_pooling() {
    let x4 = f64_input(&[3, 2, 3, 2], 2, ViewKind::ChannelsLast);
    let w = f64_input(&[2], 3, ViewKind::Plain);
    let b = f64_input(&[2], 4, ViewKind::Plain);
    let checks: Vec<Check> = vec![
        (
            "batch_norm (training)",
            vec![x4.clone(), w.clone(), b.clone()],
            vec![0, 1, 2],
            Box::new(|x| x[0].batch_norm(Some(&x[1]), Some(&x[2]), None, true, 1e-5)),
        ),
        (
            "batch_norm_relu (training, a residual added before the ReLU)",
            vec![
                x4.clone(),
                w.clone(),
                b.clone(),
                f64_input(&[3, 2, 3, 2], 10, ViewKind::Plain),
            ],
            vec![0, 1, 2, 3],
            Box::new(|x| {
                x[0].batch_norm_relu(Some(&x[1]), Some(&x[2]), None, true, 1e-5, Some(&x[3]))
            }),
        ),
        (
            "batch_norm (training, no affine, NCHW)",
            vec![f64_input(&[2, 3, 2, 3], 9, ViewKind::Plain)],
            vec![0],
            Box::new(|x| x[0].batch_norm(None, None, None, true, 1e-5)),
        ),
        (
            "layer_norm",
            vec![
                f64_input(&[3, 4], 5, ViewKind::Transposed),
                f64_input(&[4], 6, ViewKind::Plain),
            ],
            vec![0, 1],
            Box::new(|x| x[0].layer_norm(1, Some(&x[1]), None, 1e-5)),
        ),
        (
            "embedding",
            vec![
                f64_input(&[5, 3], 7, ViewKind::Plain),
                i64_input(&[4, 0, 4, 2]),
            ],
            vec![0],
            Box::new(|x| x[0].embedding(&x[1])),
        ),
        (
            "dropout",
            vec![f64_input(&[4, 5], 8, ViewKind::Narrowed)],
            vec![0],
            Box::new(|x| x[0].dropout(0.3, 42, 7, true)),
        ),
        (
            "var (unbiased) and mean",
            vec![f64_input(&[3, 4], 9, ViewKind::Plain)],
            vec![0],
            Box::new(|x| {
                x[0].var(&[1], 1, false)?
                    .add(&x[0].mean(&[0], false)?.sum(&[], true)?)
            }),
        ),
        (
            "global_avg_pool",
            vec![x4.clone()],
            vec![0],
            Box::new(|x| x[0].global_avg_pool()),
        ),
        (
            "conv2d with bias",
            vec![
                x4,
                f64_input(&[3, 2, 2, 2], 10, ViewKind::Plain),
                f64_input(&[3], 11, ViewKind::Plain),
            ],
            vec![0, 1, 2],
            Box::new(|x| {
                let p = redline_tensor::Conv2dParams {
                    padding: [1, 0],
                    ..Default::default()
                };
                x[0].conv2d(&x[1], Some(&x[2]), p)
            }),
        ),
    ];
    for (name, inputs, grads, f) in checks {
        gradcheck_fn(name, &inputs, &grads, f).unwrap_or_else(|e| panic!("{e}"));
    }
}

#[test]
fn batch_norm_updates_running_statistics_like_pytorch() {
    let dev = Device::reference();
    // Two channels, four values each: channel 0 = 1, 2, 3, 4; channel 1 = 0, 0, 0, 8.
    let x = Tensor::from_slice(
        &[1.0, 2.0, 0.0, 0.0, 3.0, 4.0, 0.0, 8.0],
        &[2, 2, 2, 1],
        &dev,
    )
    .unwrap();
    let mean = Tensor::zeros(&[2], DType::F64, &dev).unwrap();
    let var = Tensor::ones(&[2], DType::F64, &dev).unwrap();
    let running = RunningStats {
        mean: &mean,
        var: &var,
        momentum: 0.1,
    };
    let y = x.batch_norm(None, None, Some(running), true, 0.0).unwrap();
    // running_mean = 0.9 * 0 + 0.1 * batch mean; running_var uses the unbiased variance.
    let m = mean.to_f64_vec().unwrap();
    assert!(
        (m[0] - 0.25).abs() < 1e-12 && (m[1] - 0.2).abs() < 1e-12,
        "{m:?}"
    );
    let v = var.to_f64_vec().unwrap();
    let (unbiased0, unbiased1) = (5.0 / 3.0, 48.0 / 3.0);
    assert!((v[0] - (0.9 + 0.1 * unbiased0)).abs() < 1e-12, "{v:?}");
    assert!((v[1] - (0.9 + 0.1 * unbiased1)).abs() < 1e-12, "{v:?}");
    // Training output is normalised by the biased batch variance: zero mean, unit variance.
    let out = y.to_f64_vec().unwrap();
    let channel0 = [out[0], out[1], out[4], out[5]];
    assert!(channel0.iter().sum::<f64>().abs() < 1e-12);
    assert!((channel0.iter().map(|v| v * v).sum::<f64>() / 4.0 - 1.0).abs() < 1e-9);
    // Eval mode uses the running statistics.
    let eval = x
        .batch_norm(
            None,
            None,
            Some(RunningStats {
                mean: &mean,
                var: &var,
                momentum: 0.1,
            }),
            false,
            0.0,
        )
        .unwrap()
        .to_f64_vec()
        .unwrap();
    assert!((eval[0] - (1.0 - 0.25) / v[0].sqrt()).abs() < 1e-12);
}
