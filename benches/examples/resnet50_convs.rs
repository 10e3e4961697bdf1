//! Every distinct convolution of ResNet-50 at 224², batch 8, channels-last, on the CPU backend:
//! forward and backward (input + weight gradients) times, weighted by how often the network
//! uses each, so the slow shapes stand out. `cargo run --release -p redline-benches --example
//! resnet50_convs`; `benches/pytorch/resnet50_convs.py` prints PyTorch's same table.

use std::time::Instant;

use redline_cpu::CpuBackend;
use redline_tensor::{Conv2dParams, DType, Tensor};

/// (in, out, kernel, stride, input side, uses in the network).
pub const SHAPES: [(usize, usize, usize, usize, usize, usize); 20] = [
    (3, 64, 7, 2, 224, 1),
    (64, 64, 1, 1, 56, 1),
    (256, 64, 1, 1, 56, 2),
    (64, 64, 3, 1, 56, 3),
    (64, 256, 1, 1, 56, 4),
    (256, 128, 1, 1, 56, 1),
    (128, 128, 3, 2, 56, 1),
    (256, 512, 1, 2, 56, 1),
    (128, 512, 1, 1, 28, 4),
    (512, 128, 1, 1, 28, 3),
    (128, 128, 3, 1, 28, 3),
    (512, 256, 1, 1, 28, 1),
    (256, 256, 3, 2, 28, 1),
    (512, 1024, 1, 2, 28, 1),
    (256, 1024, 1, 1, 14, 6),
    (1024, 256, 1, 1, 14, 5),
    (256, 256, 3, 1, 14, 5),
    (1024, 512, 1, 1, 14, 1),
    (512, 512, 3, 2, 14, 1),
    (1024, 2048, 1, 2, 14, 1),
];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let device = CpuBackend::device();
    let n = 8;
    let (mut total_fwd, mut total_bwd) = (0.0, 0.0);
    println!(
        "{:<28} {:>9} {:>9} {:>8} {:>8} {:>8} {:>8}",
        "conv", "fwd ms", "bwd ms", "dx ms", "dw ms", "fwd GF/s", "bwd GF/s"
    );
    let mut rows: Vec<_> = SHAPES.to_vec();
    // The 512→2048 1×1 at 7² and the 512 3×3 at 7² (layer 4's other blocks).
    rows.push((512, 2048, 1, 1, 7, 3));
    rows.push((2048, 512, 1, 1, 7, 2));
    rows.push((512, 512, 3, 1, 7, 2));
    // `--only "256->64 k1"`: just the rows whose label contains it (for profiling one shape).
    let only = std::env::args().skip_while(|a| a != "--only").nth(1);
    for (c, o, k, s, h, uses) in rows {
        let label = format!("{c}->{o} k{k} s{s} {h}² ×{uses}");
        if only
            .as_ref()
            .is_some_and(|only| !label.contains(only.as_str()))
        {
            continue;
        }
        let x0 = Tensor::full(0.5, &[n, c, h, h], DType::F32, &device)?.to_channels_last()?;
        let w0 = Tensor::full(0.01, &[o, c, k, k], DType::F32, &device)?;
        let p = Conv2dParams {
            stride: [s, s],
            padding: [k / 2, k / 2],
            ..Conv2dParams::default()
        };
        // Backward with both gradients, then with only the input's, then only the weight's.
        let rounds = if only.is_some() { 60 } else { 12 };
        let (mut fwd, mut bwd, mut dx, mut dw) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for round in 0..rounds {
            let (gx, gw) = [(true, true), (true, false), (false, true)][round % 3];
            let x = x0.detach().with_requires_grad(gx);
            let w = w0.detach().with_requires_grad(gw);
            let t0 = Instant::now();
            let y = x.conv2d(&w, None, p)?;
            device.synchronize()?;
            let t1 = Instant::now();
            let g = Tensor::full(1.0, y.shape(), DType::F32, &device)?.to_channels_last()?;
            let t2 = Instant::now();
            y.backward_with(&g)?;
            device.synchronize()?;
            let b = t2.elapsed().as_secs_f64();
            [&mut bwd, &mut dx, &mut dw][round % 3].push(b);
            fwd.push((t1 - t0).as_secs_f64());
        }
        let best = |v: &[f64]| v[1..].iter().cloned().fold(f64::INFINITY, f64::min);
        let (f, b) = (best(&fwd), best(&bwd));
        let (bx, bw) = (best(&dx), best(&dw));
        let ho = (h + 2 * (k / 2) - k) / s + 1;
        let flops = 2.0 * (n * ho * ho * o * c * k * k) as f64;
        total_fwd += f * uses as f64;
        total_bwd += b * uses as f64;
        println!(
            "{:<28} {:>9.2} {:>9.2} {:>8.2} {:>8.2} {:>8.0} {:>8.0}",
            label,
            f * 1e3,
            b * 1e3,
            bx * 1e3,
            bw * 1e3,
            flops / f / 1e9,
            2.0 * flops / b / 1e9
        );
    }
    println!(
        "weighted total: forward {:.0} ms, backward {:.0} ms",
        total_fwd * 1e3,
        total_bwd * 1e3
    );
    Ok(())
}
