//! The CPU backend against the reference: the whole conformance suite (every declared
//! (op, dtype) pair on small random cases), then the sizes and layouts those small cases do not
//! reach — several threads, several im2col tiles, the 1×1 fast path, big reductions.

use redline_cpu::{ConvAlgorithm, CpuBackend};
use redline_tensor::{Conv2dParams, DType, Device, Result, Tensor};
use redline_testkit::conformance::tolerance;
use redline_testkit::{run_conformance, SuiteConfig};

#[test]
fn cpu_passes_the_conformance_suite() {
    let device = CpuBackend::device();
    let report = run_conformance(&device, &SuiteConfig::default());
    println!("{}", report.matrix());
    report.assert_passed();
    assert!(report.matrix().contains("undeclared f32/f16 pairs: none"));
}

/// Deterministic values in [-1, 1).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

fn tensor(shape: &[usize], seed: u64, dev: &Device) -> Tensor {
    let n = shape.iter().product();
    Tensor::from_slice(&values(n, seed), shape, dev).expect("upload")
}

/// Runs `f` on the CPU backend and on the reference and compares every output (f32 tolerance).
fn agree(what: &str, f: impl Fn(&Device) -> Result<Vec<Tensor>>) {
    agree_on(CpuBackend::device(), what, f)
}

/// [`agree`] on the CPU device `cpu`.
fn agree_on(cpu: Device, what: &str, f: impl Fn(&Device) -> Result<Vec<Tensor>>) {
    let reference = Device::reference();
    let got = f(&cpu).unwrap_or_else(|e| panic!("{what} on cpu: {e}"));
    let want = f(&reference).unwrap_or_else(|e| panic!("{what} on the reference: {e}"));
    let (rtol, atol) = tolerance(DType::F32);
    for (k, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g.shape(), w.shape(), "{what}: output {k} shape");
        let (g, w) = (g.to_f64_vec().unwrap(), w.to_f64_vec().unwrap());
        // Sums of hundreds of products: scale the tolerance by the output's magnitude.
        let scale = w.iter().fold(1.0f64, |m, v| m.max(v.abs()));
        for (i, (a, b)) in g.iter().zip(&w).enumerate() {
            assert!(
                (a - b).abs() <= atol * scale + rtol * b.abs().max(scale * 1e-2),
                "{what}: output {k}[{i}] = {a}, reference {b}"
            );
        }
    }
}

/// Convolution forward and both gradients through autograd, on either layout, with each of
/// the backend's algorithms (Winograd where it applies, and direct).
fn conv_case(shape: [usize; 4], w: [usize; 4], p: Conv2dParams, channels_last: bool) {
    for algo in [ConvAlgorithm::Winograd, ConvAlgorithm::Direct] {
        conv_case_with(algo, shape, w, p, channels_last);
    }
}

fn conv_case_with(
    algo: ConvAlgorithm,
    shape: [usize; 4],
    w: [usize; 4],
    p: Conv2dParams,
    channels_last: bool,
) {
    agree_on(
        CpuBackend::device_with(algo),
        &format!("conv {shape:?} * {w:?} {p:?} cl={channels_last} {algo:?}"),
        |dev| {
            let mut x = tensor(&shape, 1, dev);
            if channels_last {
                x = x.to_channels_last()?;
            }
            let x = x.with_requires_grad(true);
            let wt = tensor(&w, 2, dev).with_requires_grad(true);
            let y = x.conv2d(&wt, None, p)?;
            let weights = tensor(y.shape(), 3, dev);
            y.mul(&weights)?.sum(&[], false)?.backward()?;
            Ok(vec![y, x.grad().unwrap(), wt.grad().unwrap()])
        },
    );
}

#[test]
fn max_pool_gradients_refuse_positions_outside_their_plane() {
    redline_testkit::conformance::refuses_out_of_plane_positions(&CpuBackend::device());
}

#[test]
fn downloads_ordered_after_an_event_see_the_work_before_it() {
    redline_testkit::events::check_events(&CpuBackend::device()).unwrap();
}

#[test]
fn random_stream_follows_its_device_offset() {
    redline_testkit::conformance::random_stream_follows_its_device_offset(
        &redline_cpu::CpuBackend::device(),
    );
    redline_testkit::conformance::random_stream_follows_its_device_offset(&Device::reference());
}

#[test]
fn cross_entropy_without_ignore_index_keeps_every_sample() {
    redline_testkit::conformance::cross_entropy_without_ignore_index_keeps_every_sample(
        &CpuBackend::device(),
    );
}

#[test]
fn batch_norm_far_from_zero_keeps_its_digits() {
    redline_testkit::precision::batch_norm_far_from_zero(&CpuBackend::device()).unwrap();
}

#[test]
fn non_finite_values_as_the_reference() {
    redline_testkit::conformance::non_finite_values_as_the_reference(&CpuBackend::device())
        .unwrap();
}

#[test]
fn conv_weight_grad_in_the_weights_order() {
    use redline_testkit::conformance::conv_weight_grad_in_the_weights_order as check;
    check(&CpuBackend::device()).unwrap();
    check(&Device::reference()).unwrap();
}

/// The CPU backend declines to add in place (the engine adds); the reference adds in place.
#[test]
fn conv_input_grad_into_a_waiting_gradient() {
    use redline_testkit::conformance::conv_input_grad_into_a_waiting_gradient as check;
    check(&CpuBackend::device()).unwrap();
    check(&Device::reference()).unwrap();
}

#[test]
fn convolutions_over_several_tiles_and_threads() {
    let p3 = Conv2dParams {
        padding: [1, 1],
        ..Default::default()
    };
    for cl in [false, true] {
        // 3×3 pad 1: several im2col tiles, several images per thread.
        conv_case([4, 16, 24, 24], [16, 16, 3, 3], p3, cl);
        // 1×1 stride 1: the no-im2col path; with more outputs than inputs its weight gradient
        // splits the pixels across threads.
        conv_case([2, 32, 20, 20], [24, 32, 1, 1], Conv2dParams::default(), cl);
        conv_case([2, 16, 20, 20], [48, 16, 1, 1], Conv2dParams::default(), cl);
    }
    // Deep 1×1 layers (more channels than pixels: one GEMM over all pixels for the weight
    // gradient), grouped too.
    conv_case([2, 64, 3, 3], [48, 64, 1, 1], Conv2dParams::default(), true);
    let two_groups = Conv2dParams {
        groups: 2,
        ..Default::default()
    };
    conv_case([2, 32, 4, 4], [24, 16, 1, 1], two_groups, false);
    // ResNet's downsampling 1×1 stride 2, a strided 7×7 stem, groups with dilation.
    conv_case(
        [2, 16, 17, 17],
        [32, 16, 1, 1],
        Conv2dParams {
            stride: [2, 2],
            ..Default::default()
        },
        true,
    );
    conv_case(
        [2, 3, 30, 30],
        [8, 3, 7, 7],
        Conv2dParams {
            stride: [2, 2],
            padding: [3, 3],
            ..Default::default()
        },
        false,
    );
    // The stem at batch 4, 64 px: its weight gradient's pixels split across threads (4,096
    // pixels: several parts, their partial gradients summed).
    conv_case(
        [4, 3, 64, 64],
        [8, 3, 7, 7],
        Conv2dParams {
            stride: [2, 2],
            padding: [3, 3],
            ..Default::default()
        },
        true,
    );
    // Strided 3×3 layers with padding (implicit GEMM with a row pointer per output pixel),
    // odd sizes, an uneven stride with dilation.
    for cl in [false, true] {
        let s2 = Conv2dParams {
            stride: [2, 2],
            padding: [1, 1],
            ..Default::default()
        };
        conv_case([3, 16, 15, 13], [24, 16, 3, 3], s2, cl);
    }
    // The input gradient by stride phases: a 5×5 kernel at strides 3 and 2, padding 2 and 1,
    // odd sizes (taps reading before and after the output gradient: both margins padded).
    let phases = Conv2dParams {
        stride: [3, 2],
        padding: [2, 1],
        ..Default::default()
    };
    conv_case([2, 20, 17, 16], [24, 20, 5, 5], phases, true);
    // A 3×1 kernel at stride 2: the odd columns are a phase no tap reaches (zeros).
    let narrow = Conv2dParams {
        stride: [2, 2],
        padding: [1, 0],
        ..Default::default()
    };
    conv_case([2, 16, 9, 10], [24, 16, 3, 1], narrow, true);
    let uneven = Conv2dParams {
        stride: [2, 3],
        padding: [2, 1],
        dilation: [2, 1],
        ..Default::default()
    };
    conv_case([2, 32, 17, 19], [20, 32, 3, 3], uneven, true);
    // Stride 1 with dilation, a non-square kernel and uneven padding (the implicit-GEMM path).
    let dilated = Conv2dParams {
        padding: [2, 1],
        dilation: [2, 1],
        ..Default::default()
    };
    conv_case([2, 8, 19, 23], [16, 8, 3, 5], dilated, true);
    conv_case([2, 8, 19, 23], [16, 8, 3, 5], dilated, false);
    // Horizontal dilation: a kernel row's taps are not adjacent pixels (one tap per (ky, kx)
    // on the row-pointer path, not one per kernel row).
    let wide = Conv2dParams {
        padding: [1, 2],
        dilation: [1, 2],
        ..Default::default()
    };
    conv_case([2, 16, 11, 13], [8, 16, 3, 3], wide, true);
    let grouped = Conv2dParams {
        padding: [2, 2],
        dilation: [2, 2],
        groups: 4,
        ..Default::default()
    };
    conv_case([3, 16, 15, 13], [8, 4, 3, 3], grouped, true);
}

#[test]
fn three_by_three_stride_one_convolutions_by_winograd() {
    // At least 64 tiles of 4×4 outputs (Winograd's threshold): ragged edges (tiles past the
    // output), channels that are not a multiple of 16, padding 0, 1 and 2.
    let pad = |p: usize| Conv2dParams {
        padding: [p, p],
        ..Default::default()
    };
    for cl in [false, true] {
        conv_case([4, 32, 16, 16], [32, 32, 3, 3], pad(1), cl);
        conv_case([2, 48, 30, 26], [40, 48, 3, 3], pad(1), cl);
    }
    conv_case([4, 32, 18, 18], [16, 32, 3, 3], pad(0), true);
    conv_case([3, 24, 21, 21], [40, 24, 3, 3], pad(2), true);
    // ResNet-50's first-stage 3×3 at a quarter of its size.
    conv_case([2, 64, 28, 28], [64, 64, 3, 3], pad(1), true);
}

#[test]
fn deep_layers_with_fewer_pixels_than_weight_gradient_rows() {
    // ResNet's last stages in miniature: fewer output pixels than rows of the weight gradient
    // (on AVX2, at stride 1, its rows are split across threads, every pixel read through a row
    // pointer), and few rows for the forward (its columns split across threads too).
    let pad = |s: usize| Conv2dParams {
        stride: [s, s],
        padding: [1, 1],
        ..Default::default()
    };
    for cl in [false, true] {
        // 50 pixels, 576 rows, 40 outputs (a ragged last panel): the gradient gathered
        // straight into OIHW.
        conv_case([2, 64, 5, 5], [40, 64, 3, 3], pad(1), cl);
        // Two blocks of 256 pixels (338) against 1,152 rows: over a quarter of the rows, so
        // the rows are split across threads instead.
        conv_case([2, 128, 13, 13], [24, 128, 3, 3], pad(1), cl);
        // Strided (the forward's row pointers), and 20 channels: 12-row panels that straddle
        // taps.
        conv_case([2, 48, 7, 7], [36, 48, 3, 3], pad(2), cl);
        conv_case([2, 20, 4, 4], [24, 20, 3, 3], pad(1), cl);
    }
    // An empty batch.
    conv_case([0, 16, 6, 6], [8, 16, 3, 3], pad(1), true);
    // The downsampling 1×1 stride 2 of the last stage: 18 pixels, 64 rows.
    let s2 = Conv2dParams {
        stride: [2, 2],
        ..Default::default()
    };
    conv_case([2, 64, 6, 6], [80, 64, 1, 1], s2, true);
}

#[test]
fn weight_gradients_gathered_straight_into_oihw() {
    // Layers with at least four times as many gradient rows or outputs as pixels.
    let p = |s: usize, pad: usize, d: usize| Conv2dParams {
        stride: [s, s],
        padding: [pad, pad],
        dilation: [d, d],
        ..Default::default()
    };
    // 529 pixels in two blocks against 2,160 rows.
    conv_case([1, 240, 23, 23], [16, 240, 3, 3], p(1, 1, 1), true);
    // 1×1 stride 2 with many outputs (blocks of rows as well as of columns): 32 pixels.
    conv_case([2, 32, 8, 8], [160, 32, 1, 1], p(2, 0, 1), true);
    // Dilated (a tap per kernel position) with 20 channels: ragged, scattered panels.
    conv_case([1, 20, 5, 5], [112, 20, 3, 3], p(1, 2, 2), false);
}

#[test]
fn max_pooling_on_channels_last_inputs() {
    // The stem's pool (3×3, stride 2, padding 1) on a channels-last input: the per-pixel path.
    agree(
        "max pool 3x3/2 pad 1, channels-last, and its gradient",
        |dev| {
            let x = tensor(&[2, 5, 9, 9], 8, dev)
                .to_channels_last()?
                .with_requires_grad(true);
            let p = redline_tensor::Pool2dParams {
                kernel: [3, 3],
                stride: [2, 2],
                padding: [1, 1],
            };
            let y = x.max_pool2d(p)?;
            assert!(
                y.layout().is_dense() && !y.layout().is_contiguous(),
                "channels-last out"
            );
            y.mul(&tensor(y.shape(), 9, dev))?
                .sum(&[], false)?
                .backward()?;
            Ok(vec![y, x.grad().expect("the input's gradient")])
        },
    );
}

#[test]
fn stride_one_convolutions_with_few_channels() {
    // The implicit-GEMM weight gradient packs 12 (tap, channel) rows a panel: with fewer than
    // 6 channels a panel spans three taps or more (this was wrong for 1, 2, 3 and 5).
    let p = Conv2dParams {
        padding: [1, 1],
        ..Default::default()
    };
    for c in [1, 2, 3, 5, 6, 7] {
        conv_case([2, c, 8, 8], [5, c, 3, 3], p, c % 2 == 0);
    }
}

#[test]
fn a_convolution_computes_only_the_gradients_that_are_needed() {
    // The stem: its input (the data) needs no gradient; the weight's must still be right.
    agree("stem weight gradient without an input gradient", |dev| {
        let x = tensor(&[2, 3, 12, 12], 1, dev);
        let w = tensor(&[8, 3, 7, 7], 2, dev).with_requires_grad(true);
        let p = Conv2dParams {
            stride: [2, 2],
            padding: [3, 3],
            ..Default::default()
        };
        let y = x.conv2d(&w, None, p)?;
        y.mul(&tensor(y.shape(), 3, dev))?
            .sum(&[], false)?
            .backward()?;
        assert!(
            x.grad().is_none(),
            "no gradient for an input that does not require one"
        );
        Ok(vec![w.grad().expect("the weight's gradient")])
    });
}

#[test]
fn large_matmuls_split_rows_across_threads() {
    agree("matmul 300x200 @ (150x200)^T and batched", |dev| {
        let a = tensor(&[300, 200], 4, dev);
        let b = tensor(&[150, 200], 5, dev);
        let batched = tensor(&[3, 40, 50], 6, dev).matmul(&tensor(&[3, 50, 20], 7, dev))?;
        Ok(vec![a.matmul(&b.transpose(0, 1)?)?, batched])
    });
    // A classifier's few rows (one pass over B, columns split across threads): by a
    // transposed weight (dot products along its rows), by a plain one, and by a strided one.
    agree(
        "matmul 8x300 @ (700x300)^T, @ 300x700, @ a strided 300x350",
        |dev| {
            let a = tensor(&[8, 300], 10, dev);
            let w = tensor(&[700, 300], 11, dev);
            let b = tensor(&[300, 700], 12, dev);
            let strided = b.narrow(1, 0, 350)?;
            Ok(vec![
                a.matmul(&w.transpose(0, 1)?)?,
                a.matmul(&b)?,
                a.matmul(&strided)?,
            ])
        },
    );
}

/// `relu(bn(x) + r)` on channels-last data, fused or as the three ops, with the gradients of
/// x, the affine parameters and r; the incoming gradient channels-last (as a network's) or not.
fn bn_relu(
    dev: &Device,
    residual: bool,
    fused: bool,
    grad_channels_last: bool,
) -> Result<Vec<Tensor>> {
    let x = tensor(&[6, 24, 17, 19], 17, dev)
        .to_channels_last()?
        .with_requires_grad(true);
    let w = tensor(&[24], 18, dev).with_requires_grad(true);
    let b = tensor(&[24], 19, dev).with_requires_grad(true);
    let r = tensor(&[6, 24, 17, 19], 20, dev)
        .to_channels_last()?
        .with_requires_grad(true);
    let r = residual.then_some(&r);
    let y = if fused {
        x.batch_norm_relu(Some(&w), Some(&b), None, true, 1e-5, r)?
    } else {
        let y = x.batch_norm(Some(&w), Some(&b), None, true, 1e-5)?;
        r.map_or(Ok(y.clone()), |r| y.add(r))?.relu()?
    };
    let mut weights = tensor(y.shape(), 21, dev);
    if grad_channels_last {
        weights = weights.to_channels_last()?;
    }
    y.mul(&weights)?.sum(&[], false)?.backward()?;
    let mut out = vec![y, x.grad().unwrap(), w.grad().unwrap(), b.grad().unwrap()];
    out.extend(r.map(|r| r.grad().unwrap()));
    Ok(out)
}

#[test]
fn a_dense_byte_batch_is_normalised_pixel_by_pixel() {
    // The loader's u8 NHWC batch (the CPU's pixel-by-pixel path) and a strided view of one
    // (the general walk), each against the reference.
    let bytes: Vec<u8> = (0..2 * 5 * 7 * 3).map(|i| (i * 37 % 256) as u8).collect();
    for narrowed in [false, true] {
        agree("normalize_input of a u8 NHWC batch", |dev| {
            let mut x = Tensor::from_slice(&bytes, &[2, 5, 7, 3], dev)?;
            if narrowed {
                x = x.narrow(1, 1, 3)?;
            }
            let (mean, std) = ([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]);
            Ok(vec![Tensor::normalize_input(&x, &mean, &std, DType::F32)?])
        });
    }
}

#[test]
fn fused_batch_norm_relu_is_the_three_ops_bit_for_bit() {
    let dev = CpuBackend::device();
    // Without a residual the fused backward masks by recomputing the ReLU's input from x (the
    // gate); with one, by the output. Either way the composition's bits.
    for (residual, cl) in [(false, false), (false, true), (true, false), (true, true)] {
        let (fused, composed) = (
            bn_relu(&dev, residual, true, cl),
            bn_relu(&dev, residual, false, cl),
        );
        let bits = |t: &[Tensor]| -> Vec<Vec<u64>> {
            t.iter()
                .map(|t| {
                    t.to_f64_vec()
                        .unwrap()
                        .iter()
                        .map(|v| v.to_bits())
                        .collect()
                })
                .collect()
        };
        assert_eq!(
            bits(&fused.unwrap()),
            bits(&composed.unwrap()),
            "residual {residual}, channels-last gradient {cl}"
        );
    }
}

#[test]
fn large_reductions_and_elementwise_ops() {
    agree("per-channel statistics of a channels-last batch", |dev| {
        // 7 × 24 × 29 × 31 elements: an odd number of fixed chunks, 24 outputs each.
        let x = tensor(&[7, 24, 29, 31], 8, dev).to_channels_last()?;
        let bias = tensor(&[1, 24, 1, 1], 9, dev);
        let y = x.add(&bias)?.relu()?;
        Ok(vec![
            y.sum(&[0, 2, 3], true)?,
            y.max(&[0, 2, 3], true)?,
            x.sum(&[0], false)?,
            x.sum(&[], false)?,
            y,
        ])
    });
    for channels_last in [true, false] {
        agree("batch norm (the fused ops) forward and backward", |dev| {
            let mut x = tensor(&[6, 24, 17, 19], 13, dev);
            if channels_last {
                x = x.to_channels_last()?;
            }
            let x = x.with_requires_grad(true);
            let w = tensor(&[24], 14, dev).with_requires_grad(true);
            let b = tensor(&[24], 15, dev).with_requires_grad(true);
            let y = x.batch_norm(Some(&w), Some(&b), None, true, 1e-5)?;
            y.mul(&tensor(y.shape(), 16, dev))?
                .sum(&[], false)?
                .backward()?;
            Ok(vec![
                y,
                x.grad().unwrap(),
                w.grad().unwrap(),
                b.grad().unwrap(),
            ])
        });
    }
    for residual in [false, true] {
        agree(
            "batch norm + residual + ReLU (one fused pass) forward and backward",
            |dev| bn_relu(dev, residual, true, true),
        );
    }
    agree("softmax and argmax of wide rows", |dev| {
        let x = tensor(&[64, 1000], 10, dev);
        Ok(vec![
            x.log_softmax(1)?,
            x.softmax(0)?,
            x.argmax(1, false)?.cast(DType::F32)?,
        ])
    });
}

#[test]
fn results_are_bitwise_reproducible() {
    let dev = CpuBackend::device();
    let run = || -> Vec<f32> {
        let x = tensor(&[4, 16, 24, 24], 11, &dev)
            .to_channels_last()
            .unwrap()
            .with_requires_grad(true);
        let w = tensor(&[16, 16, 3, 3], 12, &dev).with_requires_grad(true);
        let p = Conv2dParams {
            padding: [1, 1],
            ..Default::default()
        };
        let y = x.conv2d(&w, None, p).unwrap();
        y.sum(&[0, 2, 3], false)
            .unwrap()
            .sum(&[], false)
            .unwrap()
            .backward()
            .unwrap();
        let mut all = w.grad().unwrap().to_vec::<f32>().unwrap();
        all.extend(x.grad().unwrap().to_vec::<f32>().unwrap());
        all.extend(y.sum(&[0, 2, 3], false).unwrap().to_vec::<f32>().unwrap());
        all
    };
    let first = run();
    for _ in 0..3 {
        assert!(run()
            .iter()
            .zip(&first)
            .all(|(a, b)| a.to_bits() == b.to_bits()));
    }
}

/// The CPU runs ops as they come: there is nothing to capture, and asking says so.
#[test]
fn a_capture_is_refused_by_name_and_the_device_goes_on() {
    let device = CpuBackend::device();
    let x = redline_tensor::Tensor::from_slice(&[1.0f32, 2.0], &[2], &device).unwrap();
    let error = device
        .capture(|| x.mul_scalar(2.0))
        .unwrap_err()
        .to_string();
    assert!(error.contains("cannot capture graphs"), "{error}");
    assert_eq!(
        x.mul_scalar(2.0).unwrap().to_vec::<f32>().unwrap(),
        [2.0, 4.0]
    );
}
