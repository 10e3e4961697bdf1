//! The CUDA backend's launchers and kernels on the host emulator, against the f64 reference:
//! the conformance suite over the declared matrix, then cases aimed at what a GPU gets wrong
//! quietly — tails of odd lengths, broadcasting, strided and channels-last views, every
//! conversion, blocks of many warps. Needs only a host C++ compiler (g++).
//!
//! Mutated kernels (`REDLINE_CUDA_KERNELS`, set by `cargo xtask test`) must fail this file.

use std::sync::{Arc, OnceLock};

use redline_cuda::{CudaBackend, KernelArgs, LaunchShape, Strided};
use redline_tensor::{BinaryOp, DType, Device, Pool2dParams, Tensor, UnaryOp};
use redline_testkit::{run_conformance, SuiteConfig};

fn device() -> Device {
    static DEVICE: OnceLock<Device> = OnceLock::new();
    DEVICE
        .get_or_init(|| {
            let backend = CudaBackend::emulated().unwrap_or_else(|e| panic!("{e}"));
            Device::new(Arc::new(backend))
        })
        .clone()
}

fn close(got: &[f64], want: &[f64], tol: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let ok = (g.is_nan() && w.is_nan()) || g == w || (g - w).abs() <= tol * (1.0 + w.abs());
        assert!(ok, "{what}[{i}] = {g}, reference {w}");
    }
}

/// `f` on the emulated CUDA device and on the reference, compared.
fn same_as_reference(what: &str, tol: f64, f: impl Fn(&Device) -> Tensor) {
    let got = f(&device())
        .to_f64_vec()
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    let want = f(&Device::reference()).to_f64_vec().unwrap();
    close(&got, &want, tol, what);
}

fn ramp(n: usize, scale: f64) -> Vec<f32> {
    (0..n)
        .map(|i| ((i * 37 % 101) as f64 * scale - 1.7) as f32)
        .collect()
}

#[test]
fn the_emulated_backend_passes_the_conformance_suite_over_its_matrix() {
    let report = run_conformance(
        &device(),
        &SuiteConfig {
            cases: 8,
            max_shrink_ms: 5_000,
        },
    );
    println!("{}", report.matrix());
    report.assert_passed();
    assert!(
        report.matrix().contains("undeclared f32/f16 pairs: none"),
        "every op must be declared for f32 and f16"
    );
}

#[test]
fn tails_of_odd_lengths_around_block_and_grid_edges() {
    // 1 element, a warp ± 1, a block ± 1, several blocks and a ragged end.
    for n in [1usize, 31, 33, 255, 257, 1000, 2049] {
        same_as_reference(&format!("exp of {n}"), 1e-6, |d| {
            Tensor::from_slice(&ramp(n, 0.03), &[n], d)
                .unwrap()
                .exp()
                .unwrap()
        });
        same_as_reference(&format!("sum of {n}"), 1e-5, |d| {
            Tensor::from_slice(&ramp(n, 0.03), &[n], d)
                .unwrap()
                .sum(&[], false)
                .unwrap()
        });
    }
}

#[test]
fn broadcasting_strided_and_channels_last_operands() {
    same_as_reference("[3,1,5] + [4,1]", 1e-6, |d| {
        let a = Tensor::from_slice(&ramp(15, 0.1), &[3, 1, 5], d).unwrap();
        let b = Tensor::from_slice(&ramp(4, 0.2), &[4, 1], d).unwrap();
        a.add(&b).unwrap()
    });
    same_as_reference("transposed * narrowed", 1e-6, |d| {
        let a = Tensor::from_slice(&ramp(35, 0.1), &[5, 7], d).unwrap();
        let b = Tensor::from_slice(&ramp(49, 0.1), &[7, 7], d).unwrap();
        let at = a.transpose(0, 1).unwrap();
        let bn = b.narrow(1, 2, 5).unwrap();
        at.mul(&bn).unwrap()
    });
    same_as_reference("channels-last relu", 0.0, |d| {
        let x = Tensor::from_slice(&ramp(2 * 3 * 5 * 7, 0.05), &[2, 3, 5, 7], d).unwrap();
        x.to_channels_last().unwrap().relu().unwrap()
    });
    // Both channels-last (walked as flat runs), then one of each (walked in the output's
    // memory order, the other operand strided).
    for mixed in [false, true] {
        same_as_reference(&format!("channels-last sum, mixed {mixed}"), 1e-6, |d| {
            let x = Tensor::from_slice(&ramp(2 * 6 * 5 * 7, 0.05), &[2, 6, 5, 7], d).unwrap();
            let y = Tensor::from_slice(&ramp(2 * 6 * 5 * 7, 0.03), &[2, 6, 5, 7], d).unwrap();
            let y = if mixed {
                y
            } else {
                y.to_channels_last().unwrap()
            };
            let sum = x.to_channels_last().unwrap().add(&y).unwrap();
            let back = sum.cast(DType::F16).unwrap().cast(DType::F32).unwrap();
            Tensor::concat(&[&sum.flatten().unwrap(), &back.flatten().unwrap()], 0).unwrap()
        });
    }
}

#[test]
fn elementwise_ops_in_16_byte_packs_give_the_bits_of_the_element_kernels() {
    // Every unary and arithmetic binary op over aligned operands (the `_packed` kernels, 16
    // bytes a thread) and over the same values one element into a larger storage (off 16
    // bytes: the element-a-thread kernels), bit for bit, both next to the reference. 4,800
    // elements make several blocks of packs, the last one ragged; channels-last operands
    // take the packed kernels too.
    let d = device();
    let n = 4_800;
    // The same n values at element 0 or 1 of a storage of n + 1.
    let values = |scale: f64, dtype: DType, shifted: bool| {
        let pad = [0.0f32];
        let v = match shifted {
            true => [&pad[..], &ramp(n, scale)].concat(),
            false => [&ramp(n, scale), &pad[..]].concat(),
        };
        let t = Tensor::from_slice(&v, &[n + 1], &d)
            .unwrap()
            .cast(dtype)
            .unwrap();
        t.narrow(0, shifted as usize, n).unwrap()
    };
    let same_bits = |packed: Tensor, element: Tensor, what: &str| {
        let (p, e) = (packed.to_f64_vec().unwrap(), element.to_f64_vec().unwrap());
        if let Some(i) = (0..n).find(|&i| p[i].to_bits() != e[i].to_bits()) {
            panic!(
                "{what}: [{i}] is {} packed, {} element by element",
                p[i], e[i]
            );
        }
    };
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        let tol = if dtype == DType::F32 { 1e-5 } else { 1e-2 };
        for &op in UnaryOp::ALL {
            let what = format!("{} {dtype:?}", op.name());
            let packed = values(0.05, dtype, false).unary(op).unwrap();
            let element = values(0.05, dtype, true).unary(op).unwrap();
            same_bits(packed, element, &what);
            same_as_reference(&what, tol, |d| {
                let x = Tensor::from_slice(&ramp(n, 0.05), &[2, 8, 15, 20], d).unwrap();
                let x = x.cast(dtype).unwrap().to_channels_last().unwrap();
                x.unary(op).unwrap()
            });
        }
        for op in BinaryOp::ALL
            .iter()
            .copied()
            .filter(|op| !op.is_comparison())
        {
            let what = format!("{} {dtype:?}", op.name());
            let run = |shifted| {
                let b = values(0.03, dtype, shifted);
                values(0.05, dtype, shifted).binary(op, &b).unwrap()
            };
            same_bits(run(false), run(true), &what);
            same_as_reference(&what, tol, |d| {
                let x = Tensor::from_slice(&ramp(n, 0.05), &[n], d).unwrap();
                let y = Tensor::from_slice(&ramp(n, 0.03), &[n], d).unwrap();
                let (x, y) = (x.cast(dtype).unwrap(), y.cast(dtype).unwrap());
                x.binary(op, &y).unwrap()
            });
        }
    }
}

#[test]
fn batch_norm_walks_channels_last_and_dense_tensors_in_memory_order() {
    // (shape, channels-last). The rows kernels in packs (16 bytes of channels a thread): 40
    // channels over 105 rows (5 bf16 columns, 10 f32: lanes idle past them, rows not a multiple
    // of those a block reads at once); 64 over 256 rows (several row chunks, each thread
    // stepping through rows); 320 (40 bf16 columns: a warp-wide block and a ragged one). A
    // channel a thread where packs do not fit: 36 channels (two blocks across), 12 (f32 and f64
    // still in packs), 3, 2 (f64 in packs). NCHW planes of whole packs; 75 elements (no whole
    // number of packs: the general affine); an empty batch (sums of zero).
    let cases: [([usize; 4], bool); 10] = [
        ([3, 40, 5, 7], true),
        ([4, 64, 8, 8], true),
        ([2, 320, 3, 3], true),
        ([2, 36, 3, 3], true),
        ([2, 12, 5, 3], true),
        ([2, 16, 3, 8], false),
        ([1, 3, 5, 5], true),
        ([4, 2, 1, 1], true),
        ([0, 8, 2, 2], true),
        ([2, 64, 4, 4], true),
    ];
    for dtype in [DType::F32, DType::F16, DType::BF16, DType::F64] {
        let tol = if dtype.size() == 2 { 1e-2 } else { 1e-4 };
        for (shape, channels_last) in cases {
            let (n, c) = (shape.iter().product::<usize>(), shape[1]);
            let what = format!("{dtype} {shape:?} channels-last {channels_last}");
            let tensor = |d: &Device, values: Vec<f32>, shape: &[usize]| {
                let t = Tensor::from_slice(&values, shape, d)
                    .unwrap()
                    .cast(dtype)
                    .unwrap();
                match channels_last && shape.len() == 4 {
                    true => t.to_channels_last().unwrap(),
                    false => t,
                }
            };
            let stats = redline_tensor::stats_dtype(dtype);
            let coef = |d: &Device, rows: usize| {
                Tensor::from_slice(&ramp(rows * c, 0.02), &[rows, c], d)
                    .unwrap()
                    .cast(stats)
                    .unwrap()
            };
            let x = |d: &Device| tensor(d, ramp(n, 0.05), &shape);
            let y = |d: &Device| tensor(d, ramp(n + 3, 0.03)[3..].to_vec(), &shape);
            same_as_reference(&format!("sums {what}"), tol, |d| {
                x(d).batch_norm_stats(None, None, None).unwrap()
            });
            same_as_reference(&format!("gated sums {what}"), tol, |d| {
                let gate = coef(d, 2);
                x(d).batch_norm_stats(Some(&y(d)), Some(&gate), None)
                    .unwrap()
            });
            same_as_reference(&format!("centred sums {what}"), tol, |d| {
                let centre = coef(d, 1).reshape(&[c]).unwrap();
                let gate = coef(d, 2);
                let alone = x(d).batch_norm_stats(None, None, Some(&centre)).unwrap();
                let gated = x(d)
                    .batch_norm_stats(Some(&y(d)), Some(&gate), Some(&centre))
                    .unwrap();
                Tensor::concat(&[&alone, &gated], 0).unwrap()
            });
            same_as_reference(&format!("affine + relu {what}"), tol, |d| {
                x(d).batch_norm_apply(None, &coef(d, 3), true, None)
                    .unwrap()
            });
            same_as_reference(&format!("gated backward affine {what}"), tol, |d| {
                let gate = coef(d, 2);
                x(d).batch_norm_apply(Some(&y(d)), &coef(d, 3), false, Some(&gate))
                    .unwrap()
            });
        }
    }
    // Operands in different layouts take the general kernels.
    same_as_reference("channels-last x, NCHW y", 1e-4, |d| {
        let x = Tensor::from_slice(&ramp(2 * 8 * 4 * 4, 0.05), &[2, 8, 4, 4], d).unwrap();
        let y = Tensor::from_slice(&ramp(2 * 8 * 4 * 4, 0.07), &[2, 8, 4, 4], d).unwrap();
        let coef = Tensor::from_slice(&ramp(24, 0.02), &[3, 8], d).unwrap();
        let xl = x.to_channels_last().unwrap();
        let sums = xl.batch_norm_stats(Some(&y), None, None).unwrap();
        let out = xl.batch_norm_apply(Some(&y), &coef, true, None).unwrap();
        Tensor::concat(&[&sums.flatten().unwrap(), &out.flatten().unwrap()], 0).unwrap()
    });
}

/// Batch norm's statistics and coefficients in one call give the two calls' bits — the
/// coefficients, the saved statistics, the running statistics updated in place, and backward's
/// dw and db — with one launch fewer where x is channels-last (its partial sums are added by
/// the coefficients' launch, never written as sums), and as many where it is not.
#[test]
fn batch_norm_statistics_and_coefficients_in_one_call_take_a_launch_fewer_with_the_same_bits() {
    let emulator = Arc::new(redline_cuda::Emulator::new().unwrap_or_else(|e| panic!("{e}")));
    let d = Device::new(Arc::new(CudaBackend::new(emulator.clone())));
    let p = redline_tensor::BatchNormCoefParams {
        count: 0.0,
        eps: 1e-5,
        momentum: 0.1,
        residual: true,
    };
    let cases: [([usize; 4], bool); 4] = [
        ([4, 64, 8, 8], true),
        ([3, 40, 5, 7], true),
        ([2, 36, 3, 3], true),
        ([2, 16, 3, 8], false),
    ];
    for dtype in [DType::BF16, DType::F32, DType::F64] {
        for (shape, channels_last) in cases {
            let what = format!("{dtype} {shape:?} channels-last {channels_last}");
            let (n, c) = (shape.iter().product::<usize>(), shape[1]);
            let p = redline_tensor::BatchNormCoefParams {
                count: (n / c) as f64,
                ..p
            };
            let sd = redline_tensor::stats_dtype(dtype);
            let tensor = |values: Vec<f32>| {
                let t = Tensor::from_slice(&values, &shape, &d).unwrap().cast(dtype);
                match channels_last {
                    true => t.and_then(|t| t.to_channels_last()).unwrap(),
                    false => t.unwrap(),
                }
            };
            let per_channel = |scale| {
                Tensor::from_slice(&ramp(c, scale), &[c], &d)
                    .and_then(|t| t.cast(sd))
                    .unwrap()
            };
            let (x, g) = (
                tensor(ramp(n, 0.05)),
                tensor(ramp(n + 5, 0.03)[5..].to_vec()),
            );
            let (w, b) = (per_channel(0.02), per_channel(0.04));
            let gate = Tensor::from_slice(&ramp(2 * c, 0.01), &[2, c], &d)
                .and_then(|t| t.cast(sd))
                .unwrap();
            // Bit patterns: -0 and +0 differ.
            let bits = |t: &Tensor| -> Vec<u64> {
                t.to_f64_vec()
                    .unwrap()
                    .iter()
                    .map(|v| v.to_bits())
                    .collect()
            };
            let counted = |f: &dyn Fn() -> Vec<Vec<u64>>| {
                let before = emulator.launches();
                let out = f();
                (out, emulator.launches() - before)
            };
            // The forward's sums are taken about each channel's first element.
            let first = [0, 2, 3]
                .iter()
                .try_fold(x.clone(), |t, &axis| t.narrow(axis, 0, 1))
                .and_then(|t| t.reshape(&[c]))
                .and_then(|t| t.cast(sd))
                .and_then(|t| t.contiguous())
                .unwrap();
            let forward = |fused: bool| {
                let positive: Vec<f32> = (0..c).map(|i| 0.5 + i as f32 * 0.01).collect();
                let var = Tensor::from_slice(&positive, &[c], &d)
                    .and_then(|t| t.cast(sd))
                    .unwrap();
                let mean = per_channel(0.06);
                let running = Some((&mean, &var));
                let (coef, saved) = match fused {
                    true => x.batch_norm_stats_coef(Some(&w), Some(&b), running, &p),
                    false => {
                        let sums = x.batch_norm_stats(None, None, Some(&first)).unwrap();
                        let (k, w, b) = (Some(&first), Some(&w), Some(&b));
                        Tensor::batch_norm_coef(&sums, k, dtype, w, b, running, &p)
                    }
                }
                .unwrap_or_else(|e| panic!("{what}: {e}"));
                vec![bits(&coef), bits(&saved), bits(&mean), bits(&var)]
            };
            // The running statistics are made inside: count only the stats and coefficients.
            let (fused, fused_launches) = counted(&|| forward(true));
            let (apart, apart_launches) = counted(&|| forward(false));
            assert_eq!(fused, apart, "forward {what}");
            let saved = {
                let sums = x.batch_norm_stats(None, None, None).unwrap();
                Tensor::batch_norm_coef(&sums, None, dtype, Some(&w), Some(&b), None, &p)
                    .unwrap()
                    .1
            };
            let backward = |fused: bool| {
                let (coef, dw, db) = match fused {
                    true => {
                        x.batch_norm_grad_stats_coef(&g, Some(&gate), &saved, Some(&w), p.count)
                    }
                    false => {
                        let mean = saved.narrow(0, 0, 1).and_then(|m| m.reshape(&[c]));
                        let mean = mean.unwrap();
                        let sums = x.batch_norm_stats(Some(&g), Some(&gate), Some(&mean));
                        let sums = sums.unwrap();
                        Tensor::batch_norm_grad_coef(&sums, dtype, &saved, Some(&w), p.count)
                    }
                }
                .unwrap_or_else(|e| panic!("{what}: {e}"));
                vec![bits(&coef), bits(&dw), bits(&db)]
            };
            let (fused_grad, fused_grad_launches) = counted(&|| backward(true));
            let (apart_grad, apart_grad_launches) = counted(&|| backward(false));
            assert_eq!(fused_grad, apart_grad, "backward {what}");
            // Reading the results back launches nothing; both sides made the same tensors.
            // Channels-last, the coefficients add the rows kernel's partials (a launch fewer)
            // and the first row is read there; otherwise the fused call is the calls apart
            // and the first elements' conversion, made outside `apart` here.
            let fewer = usize::from(channels_last) as u64;
            let forward_launches = match channels_last {
                true => fused_launches + 1,
                false => fused_launches - 1,
            };
            assert_eq!(forward_launches, apart_launches, "forward {what}");
            assert_eq!(
                fused_grad_launches + fewer,
                apart_grad_launches,
                "backward {what}"
            );
        }
    }
}

#[test]
fn the_affine_kernels_give_the_same_bits_whatever_the_layout() {
    // The gated backward affine in bf16 three ways: channels-last (the rows kernel, a pack of
    // channels a thread), NCHW (packs in memory order), mixed layouts (the general kernel).
    let d = device();
    let shape = [4, 64, 8, 8];
    let n = shape.iter().product::<usize>();
    let bf16 = |values: Vec<f32>, shape: &[usize]| {
        Tensor::from_slice(&values, shape, &d)
            .unwrap()
            .cast(DType::BF16)
            .unwrap()
    };
    let (x, y) = (
        bf16(ramp(n, 0.05), &shape),
        bf16(ramp(n + 5, 0.03)[5..].to_vec(), &shape),
    );
    let coef = Tensor::from_slice(&ramp(3 * 64, 0.02), &[3, 64], &d).unwrap();
    let gate = Tensor::from_slice(&ramp(2 * 64 + 7, 0.02)[7..], &[2, 64], &d).unwrap();
    let affine = |x: &Tensor, y: &Tensor| {
        let out = x
            .batch_norm_apply(Some(y), &coef, true, Some(&gate))
            .unwrap();
        out.contiguous().unwrap().to_f64_vec().unwrap()
    };
    let (xl, yl) = (x.to_channels_last().unwrap(), y.to_channels_last().unwrap());
    let rows = affine(&xl, &yl);
    let bits = |v: &[f64]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&rows), bits(&affine(&x, &y)), "channels-last and NCHW");
    assert_eq!(
        bits(&rows),
        bits(&affine(&xl, &y)),
        "channels-last and mixed"
    );
}

#[test]
fn pooling_walks_channels_last_and_nchw_tensors_in_memory_order() {
    // (shape, kernel, stride, padding): overlapping windows with padding over 40 channels (a
    // warp and a ragged one), windows that tile the plane, one channel (walked by width).
    let cases = [
        ([2, 40, 9, 7], 3, 2, 1),
        ([3, 5, 8, 8], 2, 2, 0),
        ([2, 1, 6, 5], 3, 1, 1),
    ];
    for dtype in [DType::F32, DType::BF16] {
        let tol = if dtype == DType::BF16 { 1e-2 } else { 1e-5 };
        for (shape, k, s, pad) in cases {
            let p = Pool2dParams {
                kernel: [k, k],
                stride: [s, s],
                padding: [pad, pad],
            };
            for channels_last in [true, false] {
                let what = format!("{dtype} {shape:?} {p:?} channels-last {channels_last}");
                let layout = |t: Tensor| match channels_last {
                    true => t.to_channels_last().unwrap(),
                    false => t,
                };
                // Values with ties (the ramp repeats every 101), so the first maximum counts.
                let x = |d: &Device| {
                    let n = shape.iter().product();
                    let t = Tensor::from_slice(&ramp(n, 0.05), &shape, d).unwrap();
                    layout(t.cast(dtype).unwrap()).with_requires_grad(true)
                };
                let pooled = |d: &Device, max: bool| {
                    let x = x(d);
                    let y = match max {
                        true => x.max_pool2d(p).unwrap(),
                        false => x.avg_pool2d(p).unwrap(),
                    };
                    assert_eq!(y.is_channels_last(), channels_last, "{what}");
                    let g = Tensor::from_slice(&ramp(y.numel(), 0.03), y.shape(), d).unwrap();
                    y.backward_with(&layout(g.cast(dtype).unwrap())).unwrap();
                    (y, x.grad().expect("x's gradient"))
                };
                for max in [true, false] {
                    let kind = if max { "max" } else { "avg" };
                    same_as_reference(&format!("{kind} pool {what}"), tol, |d| pooled(d, max).0);
                    same_as_reference(&format!("{kind} pool grad {what}"), tol, |d| {
                        pooled(d, max).1
                    });
                }
            }
        }
    }
}

#[test]
fn reductions_over_several_axes_of_strided_views() {
    let make = |d: &Device| {
        Tensor::from_slice(&ramp(2 * 3 * 4 * 37, 0.07), &[2, 3, 4, 37], d)
            .unwrap()
            .to_channels_last()
            .unwrap()
    };
    same_as_reference("sum over 0 and 2", 1e-5, |d| {
        make(d).sum(&[0, 2], true).unwrap()
    });
    same_as_reference("sum over 3", 1e-5, |d| make(d).sum(&[3], true).unwrap());
    same_as_reference("max over 1 and 3", 0.0, |d| {
        make(d).max(&[1, 3], true).unwrap()
    });
    same_as_reference("argmax over 3", 0.0, |d| make(d).argmax(3, true).unwrap());
    // A thread per output (kept axes innermost, ≥ 2048 outputs of ≤ 256 elements): a
    // channels-last mean over the plane (global average pooling), a max and an argmax down the
    // rows of a row-major matrix, an integer sum; every grid-stride tail of 256-thread blocks.
    let pooled = |d: &Device| {
        Tensor::from_slice(&ramp(3 * 700 * 3 * 5, 0.03), &[3, 700, 3, 5], d)
            .unwrap()
            .to_channels_last()
            .unwrap()
    };
    same_as_reference("channels-last global average pool", 1e-5, |d| {
        pooled(d).global_avg_pool().unwrap()
    });
    same_as_reference("channels-last half sum over the plane", 1e-2, |d| {
        pooled(d)
            .cast(DType::BF16)
            .unwrap()
            .sum(&[2, 3], false)
            .unwrap()
    });
    let rows = |d: &Device| Tensor::from_slice(&ramp(9 * 2100, 0.02), &[9, 2100], d).unwrap();
    same_as_reference("max down rows", 0.0, |d| rows(d).max(&[0], false).unwrap());
    same_as_reference("argmax down rows", 0.0, |d| {
        rows(d).argmax(0, false).unwrap()
    });
    same_as_reference("integer sum down rows", 0.0, |d| {
        rows(d).cast(DType::I64).unwrap().sum(&[0], false).unwrap()
    });
    // More than one block's worth of reduced elements per output (600 > 256 threads).
    same_as_reference("sum of 2 × 600", 1e-5, |d| {
        Tensor::from_slice(&ramp(1200, 0.01), &[2, 600], d)
            .unwrap()
            .sum(&[1], true)
            .unwrap()
    });
}

#[test]
fn argmax_takes_the_first_maximum_and_nan_wins() {
    let dev = device();
    let x = Tensor::from_slice(
        &[1.0f32, 7.0, 7.0, 2.0, 3.0, f32::NAN, 9.0, f32::NAN],
        &[2, 4],
        &dev,
    )
    .unwrap();
    let arg = x.argmax(1, false).unwrap().to_vec::<i64>().unwrap();
    assert_eq!(arg, [1, 1]);
    let max = x.max(&[1], false).unwrap().to_vec::<f32>().unwrap();
    assert_eq!(max[0], 7.0);
    assert!(max[1].is_nan());
}

#[test]
fn every_conversion_between_dtypes_matches_the_reference() {
    let values = [
        0.0f64, 1.0, -1.0, 2.5, -2.5, 3.7, 100.0, 255.0, 300.0, -300.0, 65504.0,
    ];
    for from in DType::ALL {
        for to in DType::ALL {
            same_as_reference(&format!("{from} -> {to}"), 0.0, |d| {
                let bytes: Vec<u8> = {
                    let mut b = vec![0u8; values.len() * from.size()];
                    for (i, &v) in values.iter().enumerate() {
                        from.write(&mut b, i, from.round(v));
                    }
                    b
                };
                let x = Tensor::from_bytes(bytes, from, &[values.len()], d).unwrap();
                x.cast(to).unwrap()
            });
        }
    }
}

#[test]
fn half_precision_ops_round_once_like_the_reference() {
    for dtype in [DType::F16, DType::BF16] {
        same_as_reference(&format!("gelu {dtype}"), 0.0, |d| {
            Tensor::from_slice(&ramp(300, 0.05), &[300], d)
                .unwrap()
                .cast(dtype)
                .unwrap()
                .gelu()
                .unwrap()
        });
    }
}

#[test]
fn a_kernel_writing_past_its_buffer_is_caught() {
    let backend = CudaBackend::emulated().unwrap();
    let gpu = backend.gpu();
    let out = gpu.alloc(10 * 4).unwrap();
    // fill<float> told there are 11 elements in a buffer of 10.
    let args = KernelArgs::new().ptr(out).i64(11).f64(1.0);
    let err = gpu
        .launch("fill<float>", LaunchShape::linear(1, 32), &args)
        .unwrap_err();
    assert!(err.to_string().contains("wrote outside"), "{err}");
    gpu.free(out);
}

#[test]
fn launch_errors_name_the_kernel_and_the_problem() {
    let backend = CudaBackend::emulated().unwrap();
    let gpu = backend.gpu();
    let out = gpu.alloc(4).unwrap();
    let args = KernelArgs::new().ptr(out).i64(1).f64(1.0);
    let err = gpu
        .launch("fill<float>", LaunchShape::linear(1, 2048), &args)
        .unwrap_err();
    assert!(err.to_string().contains("2048 threads"), "{err}");
    let err = gpu
        .launch("fill<quad>", LaunchShape::linear(1, 32), &args)
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("no kernel instantiation named fill<quad>"),
        "{err}"
    );
    gpu.free(out);
}

#[test]
fn a_storage_of_another_device_is_refused() {
    let other = Device::new(Arc::new(CudaBackend::emulated().unwrap()));
    let a = Tensor::from_slice(&[1.0f32], &[1], &device()).unwrap();
    let b = Tensor::from_slice(&[1.0f32], &[1], &other).unwrap();
    assert!(a.add(&b).is_err());
}

#[test]
fn softmax_rows_longer_than_a_block_and_along_inner_axes() {
    for (shape, axis) in [
        (vec![3usize, 700], 1usize),
        (vec![4, 5, 6], 1),
        (vec![300, 2], 0),
    ] {
        let n: usize = shape.iter().product();
        for log in [false, true] {
            same_as_reference(
                &format!("softmax {shape:?} axis {axis} log {log}"),
                1e-5,
                |d| {
                    let x = Tensor::from_slice(&ramp(n, 0.2), &shape, d).unwrap();
                    if log {
                        x.log_softmax(axis).unwrap()
                    } else {
                        x.softmax(axis).unwrap()
                    }
                },
            );
        }
    }
}

#[test]
fn random_numbers_are_the_reference_stream_bit_for_bit() {
    let backend = CudaBackend::emulated().unwrap();
    let reference = redline_tensor::reference::Reference::new();
    use redline_tensor::Backend;
    // An offset that is not a multiple of 4 and a length that is not either.
    for (seed, offset, len) in [(0u64, 0u64, 9usize), (0x1234_5678_9abc, 7, 1031)] {
        let got = backend
            .random_uniform(DType::F32, len, seed, offset)
            .unwrap();
        let want = reference
            .random_uniform(DType::F32, len, seed, offset)
            .unwrap();
        let layout = redline_tensor::Layout::contiguous(&[len]);
        let view = |s| redline_tensor::View {
            storage: s,
            layout: &layout,
        };
        assert_eq!(
            backend.download(view(&got)).unwrap(),
            reference.download(view(&want)).unwrap(),
            "seed {seed:#x} offset {offset}"
        );
    }
}

#[test]
fn scatter_add_sums_repeated_indices_in_order() {
    same_as_reference("scatter_add with repeats", 1e-6, |d| {
        let dst = Tensor::zeros(&[3, 4], DType::F32, d).unwrap();
        let index = Tensor::from_slice(&[0i64, 2, 2, 0, 1, 1, 1, 0], &[2, 4], d).unwrap();
        let src = Tensor::from_slice(&ramp(8, 0.3), &[2, 4], d).unwrap();
        dst.scatter_add(0, &index, &src).unwrap()
    });
}

#[test]
fn the_input_op_gives_the_references_bits_from_packed_and_strided_batches() {
    // The loader's dense batch (the packed kernel: 16 bytes a step, then a tail of n % 16),
    // the same bytes one element into their storage (off 16 bytes: the general kernel), and a
    // narrowed, non-dense view (general) — each bit for bit against the reference, whose f64
    // formula the kernels tabulate per (channel, byte). Every byte value occurs.
    for channels in [1usize, 3, 4, 16] {
        let (mean, std): (Vec<f64>, Vec<f64>) = (0..channels)
            .map(|c| (0.3 + 0.05 * c as f64, 0.2 + 0.01 * c as f64))
            .unzip();
        let n = 2 * 7 * 9 * channels;
        let bytes: Vec<u8> = (0..n + 1).map(|i| (i * 37 % 256) as u8).collect();
        for dtype in [DType::F64, DType::F32, DType::F16, DType::BF16] {
            for (case, start) in [("dense", 0), ("one byte in", 1), ("narrowed", 0)] {
                let what = format!("normalize_input {dtype:?} of {channels} channels, {case}");
                same_as_reference(&what, 0.0, |d| {
                    let all = Tensor::from_slice(&bytes, &[n + 1], d).unwrap();
                    let x = all
                        .narrow(0, start, n)
                        .unwrap()
                        .reshape(&[2, 7, 9, channels]);
                    let mut x = x.unwrap();
                    if case == "narrowed" {
                        x = x.narrow(2, 2, 5).unwrap();
                    }
                    Tensor::normalize_input(&x, &mean, &std, dtype).unwrap()
                });
            }
        }
    }
}

#[test]
fn the_input_op_refuses_more_channels_than_it_takes_or_counts_that_disagree() {
    let backend = CudaBackend::emulated().unwrap();
    use redline_tensor::Backend;
    let x = backend.fill(DType::U8, 17, 0.0).unwrap();
    let layout = redline_tensor::Layout::contiguous(&[1, 1, 1, 17]);
    let view = redline_tensor::View {
        storage: &x,
        layout: &layout,
    };
    let out = redline_tensor::Layout::channels_last(&[1, 17, 1, 1]).unwrap();
    let err = backend
        .normalize_input(view, &[0.5; 17], &[0.2; 17], DType::F32, &out)
        .unwrap_err();
    assert!(err.to_string().contains("17 channels"), "{err}");
    // A batch, an output and statistics that disagree on the channels: the kernels' table
    // would be sized for one count and read for another.
    let x = backend.fill(DType::U8, 3, 0.0).unwrap();
    let layout = redline_tensor::Layout::contiguous(&[1, 1, 1, 3]);
    let view = redline_tensor::View {
        storage: &x,
        layout: &layout,
    };
    let wide = redline_tensor::Layout::channels_last(&[1, 4, 1, 1]).unwrap();
    let err = backend
        .normalize_input(view, &[0.5; 3], &[0.2; 3], DType::F32, &wide)
        .unwrap_err();
    assert!(err.to_string().contains("4 (output)"), "{err}");
}

#[test]
fn parameters_that_do_not_match_the_kernel_are_refused_before_it_runs() {
    let backend = CudaBackend::emulated().unwrap();
    let gpu = backend.gpu();
    let out = gpu.alloc(4 * 4).unwrap();
    // fill<float>(T *out, i64 n, double value): three parameters of 8 bytes; here n is 4 bytes.
    let args = KernelArgs::new().ptr(out).i32(4).f64(1.0);
    let err = gpu
        .launch("fill<float>", LaunchShape::linear(1, 32), &args)
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("takes 3 parameters (8, 8, 8 bytes) but the launch packed 3 (8, 4, 8 bytes)"),
        "{err}"
    );
    let args = KernelArgs::new().ptr(out).i64(4);
    let err = gpu
        .launch("fill<float>", LaunchShape::linear(1, 32), &args)
        .unwrap_err();
    assert!(err.to_string().contains("packed 2"), "{err}");
    gpu.free(out);
}

#[test]
fn strided_walks_by_32_and_64_bit_division_reach_the_same_elements() {
    // x[0..210] read through a permuted view with a broadcast axis and an offset, copied out
    // densely: each walk must land on the element the coordinates name. Operands under 2^31
    // elements take the 32-bit walk; the 64-bit one (for larger) is forced here.
    let backend = CudaBackend::emulated().unwrap();
    let gpu = backend.gpu();
    let (shape, strides, offset) = ([6usize, 3, 5, 7], [1usize, 0, 42, 6], 9usize);
    let n: usize = shape.iter().product();
    let x: Vec<f32> = (0..260).map(|i| i as f32).collect();
    let want: Vec<f32> = (0..n)
        .map(|i| {
            let (a, b, c, d) = (i / 105, i / 35 % 3, i / 7 % 5, i % 7);
            x[offset + a * strides[0] + b * strides[1] + c * strides[2] + d * strides[3]]
        })
        .collect();
    let xp = gpu.alloc(4 * x.len()).unwrap();
    let out = gpu.alloc(4 * n).unwrap();
    let bytes: Vec<u8> = x.iter().flat_map(|v| v.to_ne_bytes()).collect();
    gpu.upload(xp, &bytes).unwrap();
    for walk in [Strided::WALK_INDEX32, Strided::WALK_INDEX64] {
        let mut xs = Strided::from_parts(&shape, &strides, offset, "emulated", "test").unwrap();
        assert_eq!(xs.walk, Strided::WALK_INDEX32);
        xs.walk = walk;
        let args = KernelArgs::new()
            .ptr(xp)
            .strided(&xs)
            .ptr(out)
            .strided(&Strided::contiguous(n, 0))
            .i64(n as i64);
        gpu.launch("convert<float, float>", LaunchShape::linear(2, 64), &args)
            .unwrap();
        let mut got = vec![0u8; 4 * n];
        gpu.download(out, &mut got).unwrap();
        let got: Vec<f32> = got
            .chunks_exact(4)
            .map(|b| f32::from_ne_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        assert_eq!(got, want, "walk {walk}");
    }
    gpu.free(xp);
    gpu.free(out);
}

#[test]
fn matmul_tiles_with_ragged_edges_transposes_and_broadcast_batches() {
    // 17 × 19 by 19 × 33: no dimension a multiple of the 16-wide tile.
    same_as_reference("17x19 @ 19x33", 1e-5, |d| {
        let a = Tensor::from_slice(&ramp(17 * 19, 0.02), &[17, 19], d).unwrap();
        let b = Tensor::from_slice(&ramp(19 * 33, 0.03), &[19, 33], d).unwrap();
        a.matmul(&b).unwrap()
    });
    same_as_reference("batched, transposed, broadcast", 1e-5, |d| {
        let a = Tensor::from_slice(&ramp(3 * 5 * 7, 0.02), &[3, 7, 5], d).unwrap();
        let b = Tensor::from_slice(&ramp(7 * 4, 0.03), &[1, 7, 4], d).unwrap();
        let at = a.transpose(1, 2).unwrap();
        let bb = b.broadcast_to(&[3, 7, 4]).unwrap();
        at.matmul(&bb).unwrap()
    });
}

#[test]
fn convolutions_with_stride_dilation_padding_and_groups() {
    let p = redline_tensor::Conv2dParams {
        stride: [2, 1],
        padding: [1, 2],
        dilation: [1, 2],
        groups: 2,
    };
    let make = |d: &Device| {
        let x = Tensor::from_slice(&ramp(2 * 4 * 7 * 6, 0.05), &[2, 4, 7, 6], d).unwrap();
        let w = Tensor::from_slice(&ramp(6 * 2 * 3 * 2, 0.07), &[6, 2, 3, 2], d).unwrap();
        (x, w)
    };
    same_as_reference("conv2d", 1e-5, |d| {
        let (x, w) = make(d);
        x.conv2d(&w, None, p).unwrap()
    });
    for input in [true, false] {
        same_as_reference(
            &format!(
                "conv2d gradient of the {}",
                if input { "input" } else { "weight" }
            ),
            1e-4,
            |d| {
                let (x, w) = make(d);
                let (x, w) = (x.with_requires_grad(true), w.with_requires_grad(true));
                let y = x.conv2d(&w, None, p).unwrap();
                y.sum(&[], false).unwrap().backward().unwrap();
                if input {
                    x.grad().unwrap()
                } else {
                    w.grad().unwrap()
                }
            },
        );
    }
}

/// A half-precision channels-last stem (3 input channels) on a device that pads it to 4, as a
/// GPU with cuDNN does: the forward, the weight gradient (computed padded, then narrowed) and
/// the input gradient (not padded) equal the unpadded device's exactly — the extra products
/// are zeros — and the reference's to rounding; weights in either order.
#[test]
fn a_stem_padded_to_four_channels_computes_the_same_convolution() {
    let padding = {
        let emulator = redline_cuda::Emulator::new().unwrap_or_else(|e| panic!("{e}"));
        Device::new(Arc::new(CudaBackend::new(Arc::new(
            emulator.pad_stem_channels(true),
        ))))
    };
    let p = redline_tensor::Conv2dParams {
        stride: [2, 2],
        padding: [3, 3],
        ..Default::default()
    };
    for dtype in [DType::BF16, DType::F16] {
        for weight_channels_last in [false, true] {
            let what = format!("{dtype} stem, weight channels-last {weight_channels_last}");
            let run = |d: &Device| {
                let x = Tensor::from_slice(&ramp(2 * 3 * 11 * 9, 0.05), &[2, 3, 11, 9], d)
                    .and_then(|t| t.cast(dtype))
                    .and_then(|t| t.to_channels_last())
                    .unwrap()
                    .with_requires_grad(true);
                let w = Tensor::from_slice(&ramp(8 * 3 * 7 * 7, 0.01), &[8, 3, 7, 7], d)
                    .and_then(|t| t.cast(dtype))
                    .unwrap();
                let w = match weight_channels_last {
                    true => w.to_channels_last().unwrap(),
                    false => w,
                }
                .with_requires_grad(true);
                let y = x.conv2d(&w, None, p).unwrap();
                let g = Tensor::from_slice(&ramp(y.numel(), 0.02), y.shape(), d)
                    .and_then(|t| t.cast(dtype))
                    .and_then(|t| t.to_channels_last())
                    .unwrap();
                y.backward_with(&g).unwrap();
                [y, w.grad().unwrap(), x.grad().unwrap()].map(|t| t.to_f64_vec().unwrap())
            };
            let (padded, plain, want) = (run(&padding), run(&device()), run(&Device::reference()));
            for (i, part) in ["forward", "weight gradient", "input gradient"]
                .iter()
                .enumerate()
            {
                close(
                    &padded[i],
                    &plain[i],
                    0.0,
                    &format!("{what}: {part}, padded vs not"),
                );
                close(
                    &padded[i],
                    &want[i],
                    2e-2,
                    &format!("{what}: {part} vs reference"),
                );
            }
        }
    }
}

/// The AMP path end to end on the CUDA kernels: f16 autocast, GradScaler, unscale-and-check,
/// SGD (and AdamW) reading the device flag, the scale update — next to the CPU backend, then
/// with an inf planted in a gradient: the flag is raised on the device, no parameter moves and
/// the scale halves.
#[test]
fn an_amp_training_step_matches_the_cpu_backend_and_skips_on_overflow() {
    let cpu = redline_cpu::CpuBackend::device();
    redline_testkit::training::check_amp_step(&device(), &cpu).unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn a_repeated_step_reuses_cached_memory_and_allocates_nothing() {
    let backend = Arc::new(CudaBackend::emulated().unwrap());
    let device = Device::new(backend.clone());
    let step = || {
        let x = Tensor::from_slice(&ramp(2 * 3 * 8 * 8, 0.1), &[2, 3, 8, 8], &device).unwrap();
        let w = Tensor::from_slice(&ramp(4 * 3 * 3 * 3, 0.1), &[4, 3, 3, 3], &device)
            .unwrap()
            .with_requires_grad(true);
        let y = x
            .conv2d(&w, None, Default::default())
            .unwrap()
            .relu()
            .unwrap();
        y.sum(&[], false).unwrap().backward().unwrap();
        w.grad().unwrap().to_vec::<f32>().unwrap()
    };
    let first = step();
    let warm = backend.memory_stats();
    let second = step();
    let after = backend.memory_stats();
    assert_eq!(first, second);
    assert_eq!(
        after.device_allocations, warm.device_allocations,
        "the second step allocated from the device: {warm} → {after}"
    );
    assert!(after.reuses > warm.reuses);
    assert_eq!(
        after.in_use, 0,
        "every storage went back to the cache: {after}"
    );
    backend.empty_cache();
    assert_eq!(backend.memory_stats().reserved, 0);
}

#[test]
fn past_the_memory_cap_is_an_out_of_memory_error_with_the_allocator_statistics() {
    let gpu: Arc<dyn redline_cuda::Gpu> = Arc::new(redline_cuda::Emulator::new().unwrap());
    let backend = CudaBackend::with_memory_cap(gpu, Some(4096));
    let device = Device::new(Arc::new(backend));
    let small = Tensor::zeros(&[256], DType::F32, &device).unwrap(); // 1 KiB
    let err = Tensor::zeros(&[1024], DType::F32, &device).unwrap_err(); // 4 KiB more
    let text = err.to_string();
    assert!(
        text.contains("out of memory allocating 4096 bytes"),
        "{text}"
    );
    assert!(
        text.contains("the memory cap") && text.contains("reserved"),
        "{text}"
    );
    drop(small);
    // The cached 1 KiB goes back to the device to make room: now it fits.
    Tensor::zeros(&[1024], DType::F32, &device).unwrap();
}

/// One AMP training step after another on the CUDA kernels: past the first (which creates the
/// optimizer's state), each shows the batch upload and the loss read-back and no other host
/// round trip, and allocates nothing from the device.
#[test]
fn a_steady_state_training_step_copies_only_the_batch_and_the_loss() {
    use redline_amp::{autocast, for_f32, GradScaler};
    use redline_nn::{decay_groups, named_parameters, Module, Sgd};
    let backend = Arc::new(CudaBackend::emulated().unwrap());
    let device = Device::new(backend.clone());
    let model = redline_testkit::training::tiny_cnn(&device);
    let mut opt = Sgd::new(decay_groups(&model, 0.01), 0.9, 0.0, true).unwrap();
    let mut scaler = GradScaler::new(&device, DType::F32).unwrap();
    let params: Vec<Tensor> = named_parameters(&model)
        .into_iter()
        .map(|(_, p)| p)
        .collect();
    let labels = Tensor::from_slice(&[2i64, 0], &[2], &device).unwrap();
    let mut step = |seed: usize, lr: f64| -> f64 {
        let pixels: Vec<f32> = (0..2 * 3 * 8 * 8)
            .map(|i| (((i + seed) * 7 % 13) as f32 - 6.0) / 6.0)
            .collect();
        let x = Tensor::from_slice(&pixels, &[2, 3, 8, 8], &device).unwrap();
        let scope = autocast(DType::F16).unwrap();
        let logits = model.forward(&x).unwrap();
        let loss = for_f32(&logits)
            .and_then(|l| l.cross_entropy(&labels, 0.1, None))
            .unwrap();
        drop(scope);
        scaler.scale(&loss).and_then(|l| l.backward()).unwrap();
        let flag = scaler.step_flag(&params).unwrap().clone();
        opt.step(lr, Some(&flag)).unwrap();
        scaler.update().unwrap();
        for p in &params {
            p.zero_grad();
        }
        loss.item().unwrap()
    };
    step(0, 0.1);
    step(1, 0.1);
    let (before, memory) = (backend.transfer_stats(), backend.memory_stats());
    let loss = step(2, 0.1);
    let (after, memory_after) = (backend.transfer_stats(), backend.memory_stats());
    assert!(loss.is_finite());
    assert_eq!(
        (
            after.uploads - before.uploads,
            after.downloads - before.downloads,
            after.synchronizations - before.synchronizations
        ),
        (1, 1, 0),
        "a step: one upload (the batch), one download (the loss), no synchronisation"
    );
    assert_eq!(
        memory_after.device_allocations, memory.device_allocations,
        "{memory_after}"
    );
    // A new learning rate is one more 4-byte upload, into the scalar the update already reads.
    step(3, 0.05);
    let last = backend.transfer_stats();
    assert_eq!(
        (
            last.uploads - after.uploads,
            last.synchronizations - after.synchronizations
        ),
        (2, 0),
        "a step at a new learning rate: the batch and the rate, no synchronisation"
    );
    let memory_last = backend.memory_stats();
    assert_eq!(
        memory_last.device_allocations, memory.device_allocations,
        "{memory_last}"
    );
}

/// Timestamps (events on a GPU; the host clock at recording time on the emulator, whose
/// launches run when enqueued) follow the shared clock contract.
#[test]
fn timestamps_are_taken_in_queue_order_and_bracket_the_work_between_them() {
    redline_testkit::timing::check_timestamps(&device()).unwrap();
}

/// The event contract (on the emulator every event is already reached when recorded).
#[test]
fn downloads_ordered_after_an_event_see_the_work_before_it() {
    redline_testkit::events::check_events(&device()).unwrap();
}

#[test]
fn cross_entropy_without_ignore_index_keeps_every_sample() {
    redline_testkit::conformance::cross_entropy_without_ignore_index_keeps_every_sample(&device());
}

#[test]
fn batch_norm_far_from_zero_keeps_its_digits() {
    redline_testkit::precision::batch_norm_far_from_zero(&device()).unwrap();
}

#[test]
fn non_finite_values_as_the_reference() {
    redline_testkit::conformance::non_finite_values_as_the_reference(&device()).unwrap();
}

#[test]
fn random_stream_follows_its_device_offset() {
    redline_testkit::conformance::random_stream_follows_its_device_offset(&device());
}

#[test]
fn conv_weight_grad_in_the_weights_order() {
    redline_testkit::conformance::conv_weight_grad_in_the_weights_order(&device()).unwrap();
}

/// The emulator has no cuDNN: it declines to add in place, and the engine's add gives the
/// reference's gradients.
#[test]
fn conv_input_grad_into_a_waiting_gradient() {
    redline_testkit::conformance::conv_input_grad_into_a_waiting_gradient(&device()).unwrap();
}

/// An asynchronous download sees the ops enqueued before it, of strided views too.
#[test]
fn an_asynchronous_download_returns_what_a_synchronous_one_does() {
    let device = device();
    let x = Tensor::from_slice(&ramp(35, 0.5), &[5, 7], &device).unwrap();
    let y = x.exp().unwrap().transpose(0, 1).unwrap();
    let pending = device.backend().download_async(y.view()).unwrap();
    let want = y.to_vec::<f32>().unwrap();
    let got: Vec<f32> = pending
        .wait()
        .unwrap()
        .chunks(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    assert_eq!(got, want);
}

/// Emulators in one process share the kernels' library: launches on other threads must not
/// share a block's `__shared__` memory (they once did, and a reduction's partials mixed).
#[test]
fn emulators_on_several_threads_keep_their_shared_memory_apart() {
    let threads: Vec<_> = (0..4)
        .map(|t| {
            std::thread::spawn(move || {
                let device = Device::new(Arc::new(CudaBackend::emulated().unwrap()));
                let values: Vec<f32> = (0..4096).map(|i| ((i * (t + 3)) % 17) as f32).collect();
                let want: f32 = values.iter().sum();
                let x = Tensor::from_slice(&values, &[64, 64], &device).unwrap();
                for _ in 0..20 {
                    let got = x.sum(&[], false).unwrap().item().unwrap();
                    assert_eq!(got, want as f64, "thread {t}");
                }
            })
        })
        .collect();
    for t in threads {
        t.join().expect("a reduction saw another thread's partials");
    }
}

#[test]
fn a_training_loop_steady_state_allocates_nothing_from_the_device() {
    // The AMP loop of the tiny CNN through the Backend contract's statistics: the caching
    // allocator serves every step after the warm-up from its cache.
    let device = Device::new(Arc::new(CudaBackend::emulated().unwrap()));
    redline_testkit::training::check_steady_state_memory(&device).unwrap();
    let stats = device
        .memory_stats()
        .expect("the caching allocator's statistics");
    assert!(stats.device_allocations > 0 && stats.reuses > stats.device_allocations);
}

/// The multi-tensor tests' AdamW.
const ADAMW: redline_tensor::AdamWParams = redline_tensor::AdamWParams {
    lr_scale: 1.0,
    beta1: 0.9,
    beta2: 0.999,
    eps: 1e-8,
    weight_decay: 0.05,
};

/// The multi-tensor ops' tensor lengths: 600 tensors (a full list of 512 and a second list),
/// empty ones among them (no blocks: the next tensor owns their first block), and one tensor
/// `long` elements long.
fn multi_tensor_lengths(long: usize) -> Vec<usize> {
    (0..600)
        .map(|t| match t {
            7 => long,
            _ if t % 50 == 3 => 0,
            _ => 1 + t % 97 * 5,
        })
        .collect()
}

/// An emulated device and its launch counter.
fn counted_device() -> (Arc<redline_cuda::Emulator>, Device) {
    let emulator = Arc::new(redline_cuda::Emulator::new().unwrap_or_else(|e| panic!("{e}")));
    let d = Device::new(Arc::new(CudaBackend::new(emulator.clone())));
    (emulator, d)
}

#[test]
fn the_sum_of_squares_spans_several_lists_and_blocks() {
    // One tensor longer than its 32 blocks cover at once (a grid-stride walk).
    let (emulator, device) = counted_device();
    let tensors: Vec<Tensor> = multi_tensor_lengths(9000)
        .into_iter()
        .enumerate()
        .map(|(t, n)| {
            let v: Vec<f32> = (0..n)
                .map(|i| ((i * 7 + t) % 13) as f32 / 4.0 - 1.5)
                .collect();
            Tensor::from_slice(&v, &[n], &device).unwrap()
        })
        .collect();
    let want: f64 = tensors
        .iter()
        .flat_map(|t| t.to_vec::<f32>().unwrap())
        .map(|v| f64::from(v) * f64::from(v))
        .sum();
    let all: Vec<&Tensor> = tensors.iter().collect();
    let before = emulator.launches();
    let got = redline_tensor::optim::sum_squares(&all).unwrap();
    assert_eq!(
        emulator.launches() - before,
        3,
        "a launch per list, then the sum"
    );
    let got = got.item().unwrap();
    assert!((got - want).abs() <= 1e-5 * want, "{got} vs {want}");
}

#[test]
fn an_optimizer_step_over_resnet_50s_161_parameters_is_one_launch_per_op() {
    let (emulator, d) = counted_device();
    let tensors = |k: f32| -> Vec<Tensor> {
        (0..161)
            .map(|t| Tensor::full(f64::from(k), &[1 + t % 7 * 300], DType::F32, &d).unwrap())
            .collect()
    };
    let (params, grads, m1, m2) = (tensors(1.0), tensors(0.5), tensors(0.0), tensors(0.0));
    let scalar = |v: f64| Tensor::full(v, &[1], DType::F32, &d).unwrap();
    let (step, lr, found, inv) = (scalar(0.0), scalar(0.01), scalar(0.0), scalar(0.5));
    fn refs(ts: &[Tensor]) -> Vec<&Tensor> {
        ts.iter().collect()
    }
    let p = ADAMW;
    let launches = |f: &dyn Fn()| {
        let before = emulator.launches();
        f();
        emulator.launches() - before
    };
    let (pr, gr, mr, vr) = (refs(&params), refs(&grads), refs(&m1), refs(&m2));
    let unscale = || redline_tensor::optim::unscale_check(&gr, &inv, &found).unwrap();
    assert_eq!(launches(&unscale), 1, "unscale and check");
    let adamw =
        || redline_tensor::optim::adamw(&pr, &gr, &mr, &vr, &step, &lr, &p, Some(&found)).unwrap();
    assert_eq!(
        launches(&adamw),
        2,
        "AdamW: the step count, then the update"
    );
    let sgd = || {
        let q = redline_tensor::SgdParams {
            lr_scale: 1.0,
            momentum: 0.9,
            dampening: 0.0,
            weight_decay: 0.0,
            nesterov: false,
        };
        redline_tensor::optim::sgd(&pr, &gr, &mr, &step, &lr, &q, Some(&found)).unwrap()
    };
    assert_eq!(launches(&sgd), 2, "SGD: the step count, then the update");
    // And each tensor got its own update: the unscaled gradient (0.25) moved every parameter.
    for (t, w) in params.iter().enumerate() {
        let v = w.to_vec::<f32>().unwrap();
        assert!(v.iter().all(|&x| x < 1.0 && x == v[0]), "tensor {t}: {v:?}");
    }
}

#[test]
fn adamw_spans_several_lists_and_blocks_and_skips_on_overflow() {
    // 600 tensors (two lists) with empty ones among them, and one longer than its 1,024
    // blocks cover at once; four steps (the bias corrections move), the first and last with
    // found-inf raised (nothing may change; a skipped first launch once left the emulator
    // sure the kernel had no barrier). Against the reference.
    let run = |d: &Device| -> Vec<f64> {
        let lengths = multi_tensor_lengths(270_000);
        let make = |k: usize| -> Vec<Tensor> {
            lengths
                .iter()
                .enumerate()
                .map(|(t, &n)| {
                    let v: Vec<f32> = (0..n)
                        .map(|i| ((i * 7 + t * 3 + k) % 13) as f32 / 4.0 - 1.5)
                        .collect();
                    Tensor::from_slice(&v, &[n], d).unwrap()
                })
                .collect()
        };
        let (params, grads) = (make(0), make(5));
        let zeros = |t: &Tensor| Tensor::zeros(t.shape(), DType::F32, d).unwrap();
        let m1: Vec<Tensor> = params.iter().map(zeros).collect();
        let m2: Vec<Tensor> = params.iter().map(zeros).collect();
        let scalar = |v: f64| Tensor::full(v, &[1], DType::F32, d).unwrap();
        let (step, lr) = (scalar(0.0), scalar(0.01));
        let p = ADAMW;
        fn refs(ts: &[Tensor]) -> Vec<&Tensor> {
            ts.iter().collect()
        }
        for overflow in [true, false, false, true] {
            let found = scalar(if overflow { 1.0 } else { 0.0 });
            let (pr, gr, mr, vr) = (refs(&params), refs(&grads), refs(&m1), refs(&m2));
            redline_tensor::optim::adamw(&pr, &gr, &mr, &vr, &step, &lr, &p, Some(&found)).unwrap();
        }
        let mut all = step.to_f64_vec().unwrap();
        for t in params.iter().chain(&m1).chain(&m2) {
            all.extend(t.to_f64_vec().unwrap());
        }
        all
    };
    let (got, want) = (run(&device()), run(&Device::reference()));
    assert_eq!(got[0], 2.0, "two applied steps");
    close(&got, &want, 1e-5, "adamw over 600 tensors");
}

/// The fused cross-entropy cannot stop the stream on a bad label: a kept target outside the
/// classes makes the loss NaN (where the host backends refuse it), so the GradScaler's check or
/// the loss read-back shows it; an ignored one is left out.
#[test]
fn a_cross_entropy_target_out_of_range_gives_a_nan_loss() {
    let device = device();
    let logits = Tensor::from_slice(&[0.0f32, 1.0, 2.0, 3.0], &[2, 2], &device).unwrap();
    let bad = Tensor::from_slice(&[0i64, 2], &[2], &device).unwrap();
    let loss = logits.cross_entropy(&bad, 0.0, None).unwrap();
    assert!(loss.item().unwrap().is_nan());
    let skipped = Tensor::from_slice(&[0i64, -1], &[2], &device).unwrap();
    let loss = logits.cross_entropy(&skipped, 0.0, Some(-1)).unwrap();
    // Row 0 alone: log(1 + e) − 0.
    let want = (1.0f64 + 1f64.exp()).ln();
    assert!((loss.item().unwrap() - want).abs() < 1e-6);
}
