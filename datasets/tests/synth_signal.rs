//! The synthetic set's class signal: a small CNN learns it; a linear model on the mean colour
//! does not. Both models are trained here on decoded JPEGs read back from real shards.
//!
//! The "small CNN" is two convolution layers (16 5×5 then 32 3×3 filters, ReLU, 2×2 pooling,
//! global average pooling) with fixed random weights, and a softmax classifier trained on its
//! features — enough to show the signal is spatial texture that convolutions pick up, without
//! needing the tensor library this workspace has not built yet.

use redline_datasets::generate::{synth_shards, SynthOptions};
use redline_shard::ShardSet;

const RES: usize = 64;
const CLASSES: u32 = 10;

struct Sample {
    /// Planar RGB, RES×RES, values 0..1.
    pixels: Vec<f32>,
    label: usize,
}

fn load(set: &ShardSet) -> Vec<Sample> {
    set.records()
        .map(|r| {
            let r = r.unwrap();
            let img = image::load_from_memory(r.bytes).unwrap().to_rgb8();
            let small = image::imageops::resize(
                &img,
                RES as u32,
                RES as u32,
                image::imageops::FilterType::Triangle,
            );
            let mut pixels = vec![0.0; 3 * RES * RES];
            for (i, p) in small.pixels().enumerate() {
                for c in 0..3 {
                    pixels[c * RES * RES + i] = p.0[c] as f32 / 255.0;
                }
            }
            Sample {
                pixels,
                label: r.label as usize,
            }
        })
        .collect()
}

fn mean_colour(s: &Sample) -> Vec<f32> {
    (0..3)
        .map(|c| {
            s.pixels[c * RES * RES..(c + 1) * RES * RES]
                .iter()
                .sum::<f32>()
                / (RES * RES) as f32
        })
        .collect()
}

/// Deterministic pseudo-random weights in [-1, 1).
fn weights(n: usize, seed: u64) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

/// A valid convolution + ReLU over `[cin, size, size]`; returns `[cout, size-k+1, size-k+1]`.
fn conv_relu(input: &[f32], cin: usize, size: usize, w: &[f32], cout: usize, k: usize) -> Vec<f32> {
    let out = size - k + 1;
    let mut y = vec![0.0; cout * out * out];
    for o in 0..cout {
        let w = &w[o * cin * k * k..(o + 1) * cin * k * k];
        // Zero-mean filters respond to texture, not to brightness.
        let bias = -w.iter().sum::<f32>() / w.len() as f32;
        for r in 0..out {
            for c in 0..out {
                let mut acc = 0.0;
                for i in 0..cin {
                    for dr in 0..k {
                        let row = &input[(i * size + r + dr) * size + c..][..k];
                        let wr = &w[(i * k + dr) * k..][..k];
                        acc += row.iter().zip(wr).map(|(a, b)| a * (b + bias)).sum::<f32>();
                    }
                }
                y[(o * out + r) * out + c] = acc.max(0.0);
            }
        }
    }
    y
}

fn avg_pool2(x: &[f32], ch: usize, size: usize) -> Vec<f32> {
    let h = size / 2;
    let mut y = vec![0.0; ch * h * h];
    for c in 0..ch {
        for r in 0..h {
            for q in 0..h {
                let at = |dr: usize, dq: usize| x[(c * size + 2 * r + dr) * size + 2 * q + dq];
                y[(c * h + r) * h + q] = (at(0, 0) + at(0, 1) + at(1, 0) + at(1, 1)) / 4.0;
            }
        }
    }
    y
}

fn cnn_features(s: &Sample, w1: &[f32], w2: &[f32]) -> Vec<f32> {
    // Per-image normalisation removes colour and contrast: only structure is left.
    let mut x = s.pixels.clone();
    for c in 0..3 {
        let plane = &mut x[c * RES * RES..(c + 1) * RES * RES];
        let mean = plane.iter().sum::<f32>() / plane.len() as f32;
        let var = plane.iter().map(|v| (v - mean).powi(2)).sum::<f32>() / plane.len() as f32;
        plane
            .iter_mut()
            .for_each(|v| *v = (*v - mean) / (var.sqrt() + 1e-3));
    }
    let a = conv_relu(&x, 3, RES, w1, 16, 5); // 16 × 60 × 60
    let a = avg_pool2(&a, 16, RES - 4); // 16 × 30 × 30
    let b = conv_relu(&a, 16, 30, w2, 32, 3); // 32 × 28 × 28
    let gap = |t: &[f32], ch: usize| -> Vec<f32> {
        let n = t.len() / ch;
        (0..ch)
            .map(|c| t[c * n..(c + 1) * n].iter().sum::<f32>() / n as f32)
            .collect()
    };
    [gap(&a, 16), gap(&b, 32)].concat()
}

/// Softmax regression by full-batch gradient descent on standardised features; returns the
/// accuracy on `test`.
fn softmax_accuracy(train: &[(Vec<f32>, usize)], test: &[(Vec<f32>, usize)]) -> f64 {
    let d = train[0].0.len();
    let k = CLASSES as usize;
    let mean: Vec<f32> = (0..d)
        .map(|j| train.iter().map(|s| s.0[j]).sum::<f32>() / train.len() as f32)
        .collect();
    let std: Vec<f32> = (0..d)
        .map(|j| {
            (train
                .iter()
                .map(|s| (s.0[j] - mean[j]).powi(2))
                .sum::<f32>()
                / train.len() as f32)
                .sqrt()
                + 1e-6
        })
        .collect();
    let norm = |x: &[f32]| -> Vec<f32> {
        x.iter()
            .enumerate()
            .map(|(j, v)| (v - mean[j]) / std[j])
            .chain([1.0])
            .collect()
    };
    let train: Vec<(Vec<f32>, usize)> = train.iter().map(|(x, y)| (norm(x), *y)).collect();
    let mut w = vec![0.0f32; k * (d + 1)];
    let logits = |w: &[f32], x: &[f32]| -> Vec<f32> {
        (0..k)
            .map(|c| {
                w[c * (d + 1)..(c + 1) * (d + 1)]
                    .iter()
                    .zip(x)
                    .map(|(a, b)| a * b)
                    .sum()
            })
            .collect()
    };
    for _ in 0..400 {
        let mut grad = vec![0.0f32; w.len()];
        for (x, y) in &train {
            let z = logits(&w, x);
            let max = z.iter().cloned().fold(f32::MIN, f32::max);
            let e: Vec<f32> = z.iter().map(|v| (v - max).exp()).collect();
            let sum: f32 = e.iter().sum();
            for c in 0..k {
                let g = e[c] / sum - (c == *y) as i32 as f32;
                for (j, xj) in x.iter().enumerate() {
                    grad[c * (d + 1) + j] += g * xj;
                }
            }
        }
        for (wi, gi) in w.iter_mut().zip(&grad) {
            *wi -= 0.5 * (gi / train.len() as f32 + 1e-3 * *wi);
        }
    }
    let correct = test
        .iter()
        .filter(|(x, y)| {
            let z = logits(&w, &norm(x));
            let best = (0..k).max_by(|&a, &b| z[a].total_cmp(&z[b])).unwrap();
            best == *y
        })
        .count();
    correct as f64 / test.len() as f64
}

#[test]
fn a_small_cnn_learns_the_classes_and_mean_colour_does_not() {
    let dir = tempfile::tempdir().unwrap();
    let options = SynthOptions {
        classes: CLASSES,
        images: 500,
        seed: 11,
        ..SynthOptions::default()
    };
    synth_shards(dir.path(), &options).unwrap();
    let train = load(&ShardSet::open(dir.path().join("train")).unwrap());
    let val = load(&ShardSet::open(dir.path().join("val")).unwrap());
    assert_eq!((train.len(), val.len()), (500, 100));

    let colour = |set: &[Sample]| -> Vec<(Vec<f32>, usize)> {
        set.iter().map(|s| (mean_colour(s), s.label)).collect()
    };
    let colour_acc = softmax_accuracy(&colour(&train), &colour(&val));

    let (w1, w2) = (weights(16 * 3 * 25, 1), weights(32 * 16 * 9, 2));
    let cnn = |set: &[Sample]| -> Vec<(Vec<f32>, usize)> {
        set.iter()
            .map(|s| (cnn_features(s, &w1, &w2), s.label))
            .collect()
    };
    let cnn_acc = softmax_accuracy(&cnn(&train), &cnn(&val));

    eprintln!("val accuracy: mean colour {colour_acc:.3}, small CNN {cnn_acc:.3} (chance 0.100)");
    assert!(
        colour_acc < 0.25,
        "mean colour predicts the class: {colour_acc}"
    );
    assert!(
        cnn_acc > 0.5,
        "the small CNN does not learn the classes: {cnn_acc}"
    );
}
