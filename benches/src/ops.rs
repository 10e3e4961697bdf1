//! The op benchmark: GEMM, convolution and batch norm through the tensor API, timed to
//! completion (`synchronize`), reported as GFLOP/s of counted FLOPs over the median time.
//!
//! Row names are shared with `benches/pytorch/ops.py`, which runs the same rows in PyTorch.
//! Layout copies are part of what is timed: an `_nchw` row hands NCHW tensors in and gets NCHW
//! out, whatever the backend does inside.

use std::time::{Duration, Instant};

use redline_tensor::{Conv2dParams, Device, Result, Tensor};

/// One benchmark row.
#[derive(Debug, Clone)]
pub struct Row {
    pub name: String,
    /// FLOPs one iteration counts.
    pub flops: f64,
    kind: Kind,
}

#[derive(Debug, Clone, Copy)]
enum Kind {
    Gemm(usize),
    Conv {
        n: usize,
        c: usize,
        hw: usize,
        backward: bool,
        channels_last: bool,
    },
    BatchNorm {
        n: usize,
        c: usize,
        hw: usize,
    },
}

/// Forward FLOPs of batch norm per element, counted the same way on both sides: mean (1),
/// variance (3), normalise (2), affine (2). A forward+backward row counts 3× forward, as conv.
pub const BN_FLOPS_PER_ELEMENT: f64 = 8.0;

impl Row {
    fn gemm(n: usize) -> Row {
        Row {
            name: format!("gemm_{n}"),
            flops: 2.0 * (n as f64).powi(3),
            kind: Kind::Gemm(n),
        }
    }

    fn conv(n: usize, c: usize, hw: usize, backward: bool, channels_last: bool) -> Row {
        let forward = 2.0 * (n * c * hw * hw * c * 9) as f64;
        Row {
            name: format!(
                "conv3x3_{c}_{hw}_b{n}_{}_{}",
                if backward { "fwdbwd" } else { "fwd" },
                if channels_last { "nhwc" } else { "nchw" }
            ),
            flops: if backward { 3.0 * forward } else { forward },
            kind: Kind::Conv {
                n,
                c,
                hw,
                backward,
                channels_last,
            },
        }
    }

    fn batch_norm(n: usize, c: usize, hw: usize) -> Row {
        Row {
            name: format!("bn_{c}_{hw}_b{n}_fwdbwd"),
            flops: 3.0 * BN_FLOPS_PER_ELEMENT * (n * c * hw * hw) as f64,
            kind: Kind::BatchNorm { n, c, hw },
        }
    }
}

/// The rows for a CPU (the shapes) or for a (software) GPU adapter (small shapes).
pub fn rows(small: bool) -> Vec<Row> {
    if small {
        return vec![
            Row::gemm(256),
            Row::gemm(512),
            Row::conv(2, 16, 28, false, false),
            Row::conv(2, 16, 28, true, true),
        ];
    }
    let mut rows = vec![Row::gemm(512), Row::gemm(1024), Row::gemm(2048)];
    for backward in [false, true] {
        for channels_last in [false, true] {
            rows.push(Row::conv(8, 64, 56, backward, channels_last));
        }
    }
    rows.push(Row::batch_norm(8, 64, 56));
    rows
}

/// Deterministic inputs in [-1, 1).
fn input(shape: &[usize], seed: u32, dev: &Device) -> Result<Tensor> {
    let n: usize = shape.iter().product();
    let values: Vec<f32> = (0..n as u32)
        .map(|i| {
            let h = (i ^ seed)
                .wrapping_mul(0x9E37_79B1)
                .rotate_left(13)
                .wrapping_mul(0x85EB_CA77);
            (h >> 8) as f32 / (1u32 << 23) as f32 - 1.0
        })
        .collect();
    Tensor::from_slice(&values, shape, dev)
}

/// A prepared row: `step` runs one iteration to completion.
type Step = Box<dyn FnMut() -> Result<()>>;

fn prepare(row: &Row, dev: &Device) -> Result<Step> {
    let sync = |dev: &Device| dev.backend().synchronize();
    Ok(match row.kind {
        Kind::Gemm(n) => {
            let (a, b) = (input(&[n, n], 1, dev)?, input(&[n, n], 2, dev)?);
            let dev = dev.clone();
            Box::new(move || {
                let c = a.matmul(&b)?;
                sync(&dev)?;
                drop(c);
                Ok(())
            })
        }
        Kind::Conv {
            n,
            c,
            hw,
            backward,
            channels_last,
        } => {
            let mut x = input(&[n, c, hw, hw], 3, dev)?;
            let mut g = input(&[n, c, hw, hw], 5, dev)?;
            if channels_last {
                x = x.to_channels_last()?;
                g = g.to_channels_last()?;
            }
            let w = input(&[c, c, 3, 3], 4, dev)?;
            let p = Conv2dParams {
                padding: [1, 1],
                ..Default::default()
            };
            let dev = dev.clone();
            Box::new(move || {
                // Fresh leaves each time (sharing storage): gradients are set, not accumulated.
                let xi = x.detach().with_requires_grad(backward);
                let wi = w.detach().with_requires_grad(backward);
                let y = xi.conv2d(&wi, None, p)?;
                if backward {
                    y.backward_with(&g)?;
                }
                sync(&dev)?;
                Ok(())
            })
        }
        Kind::BatchNorm { n, c, hw } => {
            let x = input(&[n, c, hw, hw], 6, dev)?.to_channels_last()?;
            let g = input(&[n, c, hw, hw], 7, dev)?.to_channels_last()?;
            let (weight, bias) = (input(&[c], 8, dev)?, input(&[c], 9, dev)?);
            let dev = dev.clone();
            Box::new(move || {
                let xi = x.detach().with_requires_grad(true);
                let wi = weight.detach().with_requires_grad(true);
                let bi = bias.detach().with_requires_grad(true);
                let y = xi.batch_norm(Some(&wi), Some(&bi), None, true, 1e-5)?;
                y.backward_with(&g)?;
                sync(&dev)?;
                Ok(())
            })
        }
    })
}

/// A row's result.
#[derive(Debug, Clone)]
pub struct Measured {
    pub name: String,
    pub gflops: f64,
    pub median_ms: f64,
    pub iterations: usize,
}

/// How long to measure: `iterations` exactly, or until `budget` has passed (at least 5).
#[derive(Debug, Clone, Copy)]
pub enum Budget {
    Iterations(usize),
    Time(Duration),
}

/// Runs `row` on `dev`: two warm-up iterations, then the budget; GFLOP/s over the median.
pub fn measure(row: &Row, dev: &Device, budget: Budget) -> Result<Measured> {
    let mut step = prepare(row, dev)?;
    for _ in 0..2 {
        step()?;
    }
    let mut times = Vec::new();
    let start = Instant::now();
    loop {
        let t = Instant::now();
        step()?;
        times.push(t.elapsed().as_secs_f64());
        let done = match budget {
            Budget::Iterations(n) => times.len() >= n,
            Budget::Time(d) => times.len() >= 5 && (start.elapsed() >= d || times.len() >= 50),
        };
        if done {
            break;
        }
    }
    times.sort_by(f64::total_cmp);
    // The lower median, as Python's statistics.median_low in benches/pytorch/ops.py.
    let median = times[(times.len() - 1) / 2];
    Ok(Measured {
        name: row.name.clone(),
        gflops: row.flops / median / 1e9,
        median_ms: median * 1e3,
        iterations: times.len(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_row_runs_and_counts_flops() {
        // The real rows are too large for a test: run tiny versions of each kind once.
        let dev = redline_cpu::CpuBackend::device();
        let tiny = [
            Row::gemm(16),
            Row::conv(1, 4, 6, true, false),
            Row::conv(1, 4, 6, false, true),
            Row::batch_norm(2, 3, 4),
        ];
        for row in &tiny {
            let m = measure(row, &dev, Budget::Iterations(1)).unwrap();
            assert!(m.gflops.is_finite() && m.gflops > 0.0, "{m:?}");
        }
        assert_eq!(tiny[1].name, "conv3x3_4_6_b1_fwdbwd_nchw");
        assert_eq!(tiny[1].flops, 3.0 * 2.0 * (4 * 6 * 6 * 4 * 9) as f64);
        let names: Vec<String> = rows(false).into_iter().map(|r| r.name).collect();
        for want in [
            "gemm_1024",
            "conv3x3_64_56_b8_fwdbwd_nhwc",
            "conv3x3_64_56_b8_fwd_nchw",
            "bn_64_56_b8_fwdbwd",
        ] {
            assert!(
                names.iter().any(|n| n == want),
                "{want} missing from {names:?}"
            );
        }
    }
}
