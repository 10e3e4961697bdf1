//! The CPU backend's two algorithms for 3×3 stride-1 f32 convolutions, side by side in one
//! process: Winograd F(4×4, 3×3) and the direct (implicit GEMM) convolution, on ResNet-50's
//! four 3×3 stride-1 shapes at batch 8, channels-last — forward, input gradient and weight
//! gradient, the two devices interleaved round by round so the machine's drift lands on both.
//! `cargo run --release -p redline-benches --example conv_algorithms [-- --rounds N]`.

use std::time::Instant;

use redline_cpu::{ConvAlgorithm, CpuBackend};
use redline_tensor::{Conv2dParams, DType, Device, Tensor};

/// (channels, side, uses in ResNet-50).
const SHAPES: [(usize, usize, usize); 4] = [(64, 56, 3), (128, 28, 3), (256, 14, 5), (512, 7, 2)];

/// Best seconds of forward, input gradient, weight gradient over `rounds` (after a warm-up).
fn time(device: &Device, c: usize, side: usize) -> Result<[f64; 3], Box<dyn std::error::Error>> {
    let n = 8;
    let x0 = Tensor::full(0.5, &[n, c, side, side], DType::F32, device)?.to_channels_last()?;
    let w0 = Tensor::full(0.01, &[c, c, 3, 3], DType::F32, device)?;
    let p = Conv2dParams {
        padding: [1, 1],
        ..Conv2dParams::default()
    };
    let mut best = [f64::INFINITY; 3];
    for round in 0..3 {
        // Round 0 warms up; then the input gradient alone, then the weight gradient alone.
        let (gx, gw) = [(true, true), (true, false), (false, true)][round];
        let x = x0.detach().with_requires_grad(gx);
        let w = w0.detach().with_requires_grad(gw);
        let t0 = Instant::now();
        let y = x.conv2d(&w, None, p)?;
        device.synchronize()?;
        let forward = t0.elapsed().as_secs_f64();
        let g = Tensor::full(1.0, y.shape(), DType::F32, device)?.to_channels_last()?;
        let t1 = Instant::now();
        y.backward_with(&g)?;
        device.synchronize()?;
        let backward = t1.elapsed().as_secs_f64();
        if round > 0 {
            best[0] = best[0].min(forward);
            best[round] = best[round].min(backward);
        }
    }
    Ok(best)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let rounds = std::env::args()
        .skip_while(|a| a != "--rounds")
        .nth(1)
        .and_then(|r| r.parse().ok())
        .unwrap_or(8usize);
    let winograd = CpuBackend::device_with(ConvAlgorithm::Winograd);
    let direct = CpuBackend::device_with(ConvAlgorithm::Direct);
    println!(
        "{:<22} {:>24} {:>24} {:>24}",
        "3×3 s1, batch 8", "forward ms (wino/direct)", "input grad ms", "weight grad ms"
    );
    let (mut total_w, mut total_d) = (0.0, 0.0);
    for (c, side, uses) in SHAPES {
        let (mut w, mut d) = ([f64::INFINITY; 3], [f64::INFINITY; 3]);
        for _ in 0..rounds {
            for (best, device) in [(&mut w, &winograd), (&mut d, &direct)] {
                for (b, t) in best.iter_mut().zip(time(device, c, side)?) {
                    *b = b.min(t);
                }
            }
        }
        total_w += w.iter().sum::<f64>() * uses as f64;
        total_d += d.iter().sum::<f64>() * uses as f64;
        let cell = |i: usize| {
            format!(
                "{:.2} / {:.2} ({:.2}×)",
                w[i] * 1e3,
                d[i] * 1e3,
                d[i] / w[i]
            )
        };
        println!(
            "{:<22} {:>24} {:>24} {:>24}",
            format!("{c}->{c} at {side}² ×{uses}"),
            cell(0),
            cell(1),
            cell(2)
        );
    }
    println!(
        "weighted by uses, all three passes: winograd {:.0} ms, direct {:.0} ms ({:.2}×)",
        total_w * 1e3,
        total_d * 1e3,
        total_d / total_w
    );
    Ok(())
}
