//! Proptest strategies: op cases with awkward shapes and layouts, values kept where the op and
//! its gradient are smooth.

use proptest::prelude::*;
use redline_tensor::{
    stats_dtype, BinaryOp, Conv2dParams, DType, NnOp, Op, OptimOp, OtherOp, Pool2dParams, ReduceOp,
    UnaryOp,
};

use crate::case::{Case, Input, ViewKind};

/// Shapes of rank `ranks`, axes 1..=5 with extra weight on 1 (broadcasting, degenerate axes) and
/// odd sizes.
pub fn shape(ranks: std::ops::RangeInclusive<usize>) -> impl Strategy<Value = Vec<usize>> {
    let axis = prop_oneof![2 => Just(1usize), 3 => 2usize..=3, 2 => 4usize..=5];
    prop::collection::vec(axis, ranks)
}

/// A view that fits `shape`.
pub fn view_for(shape: &[usize]) -> BoxedStrategy<ViewKind> {
    let mut kinds = vec![ViewKind::Plain];
    if !shape.is_empty() {
        kinds.push(ViewKind::Narrowed);
    }
    if shape.len() >= 2 {
        kinds.push(ViewKind::Transposed);
    }
    if shape.len() == 4 {
        kinds.push(ViewKind::ChannelsLast);
    }
    prop::sample::select(kinds).boxed()
}

/// Where an op's inputs should live so that the op and its gradient are well-conditioned.
#[derive(Debug, Clone, Copy)]
enum Domain {
    /// [-2, 2].
    Any,
    /// [0.25, 3]: log, sqrt, rsqrt, pow's base.
    Positive,
    /// |x| in [0.5, 2]: divisors.
    AwayFromZero,
    /// Distinct values ≥ 0.2 apart (max, argmax, maximum/minimum, relu at 0): no ties, no kinks.
    Distinct,
    /// 0 or 1: conditions.
    Mask,
    /// [-1.5, 1.5]: exponents.
    Exponent,
    /// 0..=255: image bytes.
    Byte,
}

fn values(n: usize, domain: Domain, dtype: DType, salt: u32) -> BoxedStrategy<Vec<f64>> {
    if !dtype.is_float() && !matches!(domain, Domain::Mask | Domain::Byte) {
        // Small integers that neither overflow u8 nor underflow it in a subtraction
        // (the left operand of an integer op gets 10..20, the right 0..9).
        let range = if salt == 0 { 10i64..=20 } else { 0i64..=9 };
        return prop::collection::vec(range.prop_map(|v| v as f64), n).boxed();
    }
    match domain {
        Domain::Any => prop::collection::vec(-2.0..2.0f64, n).boxed(),
        Domain::Positive => prop::collection::vec(0.25..3.0f64, n).boxed(),
        Domain::Exponent => prop::collection::vec(-1.5..1.5f64, n).boxed(),
        Domain::AwayFromZero => prop::collection::vec((0.5..2.0f64, any::<bool>()), n)
            .prop_map(|v| {
                v.into_iter()
                    .map(|(m, neg)| if neg { -m } else { m })
                    .collect()
            })
            .boxed(),
        Domain::Byte => prop::collection::vec((0u16..=255).prop_map(f64::from), n).boxed(),
        Domain::Mask => prop::collection::vec(0u8..=1, n)
            .prop_map(|v| v.into_iter().map(f64::from).collect())
            .boxed(),
        Domain::Distinct => Just((0..n).collect::<Vec<usize>>())
            .prop_shuffle()
            .prop_map(move |order| {
                // Magnitudes 0.1 + 0.11·m with m even for the first operand (salt 0) and odd for
                // the second: no ties within or across inputs, nothing within 0.1 of zero.
                order
                    .into_iter()
                    .map(|k| {
                        let magnitude = 0.1 + 0.11 * (2 * k + salt as usize) as f64;
                        if k % 2 == 0 {
                            magnitude
                        } else {
                            -magnitude
                        }
                    })
                    .collect()
            })
            .boxed(),
    }
}

fn input(shape: Vec<usize>, dtype: DType, domain: Domain, salt: u32) -> BoxedStrategy<Input> {
    view_for(&shape)
        .prop_flat_map(move |view| viewed(shape.clone(), view, dtype, domain, salt))
        .boxed()
}

/// An input of `shape` seen through `view`.
fn viewed(
    shape: Vec<usize>,
    view: ViewKind,
    dtype: DType,
    domain: Domain,
    salt: u32,
) -> BoxedStrategy<Input> {
    let n: usize = Input::base_shape(&shape, view).iter().product();
    values(n, domain, dtype, salt)
        .prop_map(move |values| Input {
            shape: shape.clone(),
            values,
            dtype,
            view,
        })
        .boxed()
}

/// Batch-norm activations: any small shape and view, or channels-last (what a training step
/// makes, and what CUDA's rows kernels take) — small, or with 8–32 channels (16-byte packs of
/// every dtype) and up to 2,048 rows (partial sums from several chunks).
fn norm_activation() -> BoxedStrategy<(Vec<usize>, ViewKind)> {
    let channels_last = |s: Vec<usize>| (s, ViewKind::ChannelsLast);
    prop_oneof![
        2 => shape(2..=4).prop_flat_map(|s| (Just(s.clone()), view_for(&s))),
        1 => shape(4..=4).prop_map(channels_last),
        1 => (2usize..=8, prop::sample::select(vec![8usize, 16, 32]), 8usize..=16, 8usize..=16)
            .prop_map(move |(n, c, h, w)| channels_last(vec![n, c, h, w])),
    ]
    .boxed()
}

/// Batch norm's x and a second operand of its shape (y, or the gradient): independent views
/// of a small shape (the general kernels), or one view from [`norm_activation`] (a network's).
fn norm_operands(dtype: DType) -> BoxedStrategy<(Input, Input)> {
    let any = move |s: Vec<usize>, salt| input(s, dtype, Domain::Any, salt);
    let viewed_any = move |s: Vec<usize>, view, salt| viewed(s, view, dtype, Domain::Any, salt);
    prop_oneof![
        1 => shape(2..=4).prop_flat_map(move |s| (any(s.clone(), 0), any(s, 1))),
        3 => norm_activation()
            .prop_flat_map(move |(s, view)| (viewed_any(s.clone(), view, 0), viewed_any(s, view, 1))),
    ]
    .boxed()
}

/// Two shapes that broadcast: the second drops leading axes and/or sets some axes to 1.
fn broadcast_pair() -> impl Strategy<Value = (Vec<usize>, Vec<usize>)> {
    shape(0..=4).prop_flat_map(|a| {
        let rank = a.len();
        (
            Just(a),
            0..=rank,
            prop::collection::vec(any::<bool>(), rank),
        )
            .prop_map(|(a, drop, ones)| {
                let b: Vec<usize> = a
                    .iter()
                    .zip(&ones)
                    .skip(drop)
                    .map(|(&n, &one)| if one { 1 } else { n })
                    .collect();
                // Either side may be the one that broadcasts.
                if ones.first().copied().unwrap_or(false) {
                    (b, a)
                } else {
                    (a, b)
                }
            })
    })
}

fn unary_domain(op: UnaryOp) -> Domain {
    match op {
        UnaryOp::Log | UnaryOp::Sqrt | UnaryOp::Rsqrt => Domain::Positive,
        UnaryOp::Relu => Domain::Distinct,
        _ => Domain::Any,
    }
}

fn binary_domains(op: BinaryOp) -> (Domain, Domain) {
    match op {
        BinaryOp::Div => (Domain::Any, Domain::AwayFromZero),
        BinaryOp::Pow => (Domain::Positive, Domain::Exponent),
        BinaryOp::Maximum | BinaryOp::Minimum => (Domain::Distinct, Domain::Distinct),
        // Nothing at the kink, where rounding could move a across 0.
        BinaryOp::ReluGrad => (Domain::Distinct, Domain::Any),
        _ => (Domain::Any, Domain::Any),
    }
}

/// Cases for `op` on `dtype`.
pub fn case(op: Op, dtype: DType) -> BoxedStrategy<Case> {
    let make = move |inputs: Vec<Input>, axes: Vec<usize>| Case::new(op, dtype, inputs, axes);
    match op {
        Op::Unary(u) => shape(0..=4)
            .prop_flat_map(move |s| input(s, dtype, unary_domain(u), 0))
            .prop_map(move |x| make(vec![x], vec![]))
            .boxed(),
        Op::Binary(b) => {
            let (da, db) = binary_domains(b);
            broadcast_pair()
                .prop_flat_map(move |(sa, sb)| (input(sa, dtype, da, 0), input(sb, dtype, db, 1)))
                .prop_map(move |(a, b)| make(vec![a, b], vec![]))
                .boxed()
        }
        Op::Reduce(r) => shape(1..=4)
            .prop_flat_map(move |s| {
                let rank = s.len();
                let domain = if r == ReduceOp::Sum {
                    Domain::Any
                } else {
                    Domain::Distinct
                };
                let axes = if r == ReduceOp::ArgMax {
                    (0..rank).prop_map(|a| vec![a]).boxed()
                } else {
                    prop::sample::subsequence((0..rank).collect::<Vec<_>>(), 1..=rank).boxed()
                };
                (input(s, dtype, domain, 0), axes)
            })
            .prop_map(move |(x, axes)| make(vec![x], axes))
            .boxed(),
        Op::Other(OtherOp::Matmul) => (
            1usize..=5,
            1usize..=5,
            1usize..=5,
            0usize..=2,
            any::<bool>(),
        )
            .prop_flat_map(move |(m, k, n, batch, broadcast)| {
                let lead: Vec<usize> = (0..batch).map(|i| 2 + i).collect();
                let mut sa = lead.clone();
                sa.extend([m, k]);
                // The right operand may drop its batch axes (broadcast over the left's).
                let mut sb = if broadcast { vec![] } else { lead };
                sb.extend([k, n]);
                (
                    input(sa, dtype, Domain::Any, 0),
                    input(sb, dtype, Domain::Any, 1),
                )
            })
            .prop_map(move |(a, b)| make(vec![a, b], vec![]))
            .boxed(),
        Op::Other(OtherOp::Select) => broadcast_pair()
            .prop_flat_map(move |(sa, sb)| {
                (
                    input(sa.clone(), DType::U8, Domain::Mask, 0),
                    input(sa, dtype, Domain::Any, 0),
                    input(sb, dtype, Domain::Any, 1),
                )
            })
            .prop_map(move |(c, a, b)| make(vec![c, a, b], vec![]))
            .boxed(),
        Op::Other(OtherOp::CopyInto) => (shape(1..=3), 1usize..=3)
            .prop_flat_map(move |(s, extra)| {
                let mut other = s.clone();
                other[0] = extra;
                (
                    input(s, dtype, Domain::Any, 0),
                    input(other, dtype, Domain::Any, 1),
                )
            })
            .prop_map(move |(a, b)| make(vec![a, b], vec![0]))
            .boxed(),
        // Every axis ≥ 2, so transposes and channels-last are real relayouts.
        Op::Other(OtherOp::Convert) => prop::collection::vec(2usize..=4, 2..=4)
            .prop_flat_map(move |s| input(s, dtype, Domain::Any, 0))
            .prop_map(move |x| make(vec![x], vec![]))
            .boxed(),
        Op::Nn(n) => nn_case(n, dtype),
        Op::Optim(o) => optim_case(o, dtype),
        Op::Other(OtherOp::Fill) => shape(1..=4)
            .prop_flat_map(move |s| input(s, dtype, Domain::Any, 0))
            .prop_map(move |x| make(vec![x], vec![]))
            .boxed(),
    }
}

/// An i64 index input of `shape` whose values address `0..limit`.
fn index(shape: Vec<usize>, limit: usize) -> BoxedStrategy<Input> {
    let n: usize = shape.iter().product();
    prop::collection::vec(0..limit, n)
        .prop_map(move |v| Input {
            shape: shape.clone(),
            values: v.into_iter().map(|k| k as f64).collect(),
            dtype: DType::I64,
            view: ViewKind::Plain,
        })
        .boxed()
}

/// `n` class labels below `c`, or -1: a sample the loss leaves out.
fn targets(n: usize, c: usize) -> BoxedStrategy<Input> {
    prop::collection::vec(-1..c as i64, n)
        .prop_map(move |v| Input {
            shape: vec![n],
            values: v.into_iter().map(|k| k as f64).collect(),
            dtype: DType::I64,
            view: ViewKind::Plain,
        })
        .boxed()
}

/// A shape no larger than `s` off `axis` (and 1..=4 along it).
fn index_shape(s: &[usize], axis: usize) -> BoxedStrategy<Vec<usize>> {
    s.iter()
        .enumerate()
        .map(|(d, &n)| {
            if d == axis {
                (1..=4usize).boxed()
            } else {
                (1..=n).boxed()
            }
        })
        .collect::<Vec<_>>()
        .boxed()
}

fn conv_params() -> impl Strategy<Value = (Conv2dParams, [usize; 6])> {
    // (groups, in per group, out per group, batch, kernel, size)
    (
        1usize..=2,
        1usize..=2,
        1usize..=2,
        1usize..=2,
        1usize..=3,
        3usize..=6,
        1usize..=2,
        0usize..=1,
        1usize..=2,
    )
        .prop_filter_map(
            "the kernel must fit",
            |(g, ci, co, n, k, size, stride, pad, dil)| {
                let p = Conv2dParams {
                    stride: [stride, 1 + (stride % 2)],
                    padding: [pad, 1 - pad],
                    dilation: [dil, 1],
                    groups: g,
                };
                let fits = size + 2 * pad > dil * (k - 1) && size + 2 * (1 - pad) > k - 1;
                fits.then_some((p, [g, ci, co, n, k, size]))
            },
        )
}

fn pool_params() -> impl Strategy<Value = (Pool2dParams, Vec<usize>)> {
    (
        1usize..=2,
        1usize..=3,
        2usize..=6,
        2usize..=6,
        1usize..=3,
        1usize..=2,
        0usize..=1,
    )
        .prop_filter_map("the window must fit", |(n, c, h, w, k, stride, pad)| {
            let pad = if 2 * pad > k { 0 } else { pad };
            let p = Pool2dParams {
                kernel: [k, k.max(2) - 1],
                stride: [stride, 1],
                padding: [pad, 0],
            };
            let fits = h + 2 * pad >= k && w >= p.kernel[1];
            fits.then_some((p, vec![n, c, h, w]))
        })
}

fn nn_case(op: NnOp, dtype: DType) -> BoxedStrategy<Case> {
    let make =
        move |inputs: Vec<Input>, axes: Vec<usize>| Case::new(Op::Nn(op), dtype, inputs, axes);
    match op {
        NnOp::Softmax | NnOp::LogSoftmax => shape(1..=4)
            .prop_flat_map(move |s| {
                let rank = s.len();
                (input(s, dtype, Domain::Any, 0), 0..rank)
            })
            .prop_map(move |(x, axis)| make(vec![x], vec![axis]))
            .boxed(),
        NnOp::Gather => shape(1..=3)
            .prop_flat_map(move |s| (Just(s.clone()), 0..s.len()))
            .prop_flat_map(move |(s, axis)| {
                let limit = s[axis];
                (
                    input(s.clone(), dtype, Domain::Any, 0),
                    index_shape(&s, axis).prop_flat_map(move |t| index(t, limit)),
                    Just(axis),
                )
            })
            .prop_map(move |(x, idx, axis)| make(vec![x, idx], vec![axis]))
            .boxed(),
        NnOp::ScatterAdd => shape(1..=3)
            .prop_flat_map(move |s| (Just(s.clone()), 0..s.len()))
            .prop_flat_map(move |(s, axis)| {
                let limit = s[axis];
                let rest = index_shape(&s, axis).prop_flat_map(move |t| {
                    (index(t.clone(), limit), input(t, dtype, Domain::Any, 1))
                });
                (input(s, dtype, Domain::Any, 0), rest, Just(axis))
            })
            .prop_map(move |(x, (idx, src), axis)| make(vec![x, idx, src], vec![axis]))
            .boxed(),
        NnOp::Conv2d | NnOp::Conv2dInputGrad | NnOp::Conv2dWeightGrad => conv_params()
            .prop_flat_map(move |(p, [g, ci, co, n, k, size])| {
                let x = input(vec![n, g * ci, size, size + 1], dtype, Domain::Any, 0);
                let w = input(vec![g * co, ci, k, k], dtype, Domain::Any, 1);
                (x, w, Just(p))
            })
            .prop_map(move |(x, w, p)| Case {
                conv: Some(p),
                ..make(vec![x, w], vec![])
            })
            .boxed(),
        NnOp::MaxPool2d | NnOp::MaxPool2dGrad | NnOp::AvgPool2d | NnOp::AvgPool2dGrad => {
            let domain = if matches!(op, NnOp::MaxPool2d | NnOp::MaxPool2dGrad) {
                Domain::Distinct
            } else {
                Domain::Any
            };
            pool_params()
                .prop_flat_map(move |(p, s)| (input(s, dtype, domain, 0), Just(p)))
                .prop_map(move |(x, p)| Case {
                    pool: Some(p),
                    ..make(vec![x], vec![])
                })
                .boxed()
        }
        NnOp::RandomUniform => shape(1..=3)
            .prop_flat_map(move |s| input(s, dtype, Domain::Any, 0))
            .prop_map(move |x| make(vec![x], vec![]))
            .boxed(),
        // x [N, C, ..], optionally a second operand of x's shape, for apply the [3, C]
        // coefficients (f32, or f64 for f64) and whether its ReLU is fused, with the second
        // operand optionally a [2, C] gate on it (the backward of a ReLU after batch norm), and
        // for the sums optionally a [C] centre (the backward's mean).
        NnOp::BatchNormStats | NnOp::BatchNormApply => (
            norm_operands(dtype),
            proptest::bool::ANY,
            proptest::bool::ANY,
            proptest::bool::ANY,
        )
            .prop_flat_map(move |((x, y), with_y, relu, gated)| {
                let c = x.shape[1];
                let coef = input(vec![3, c], stats_dtype(dtype), Domain::Any, 2);
                let gate = input(vec![2, c], stats_dtype(dtype), Domain::Any, 3);
                let centre = input(vec![c], stats_dtype(dtype), Domain::Any, 4);
                (
                    (Just(x), Just(y)),
                    (coef, gate, centre),
                    Just((with_y, relu, gated && with_y)),
                )
            })
            .prop_map(
                move |((x, y), (coef, gate, centre), (with_y, relu, gated))| {
                    let mut inputs = vec![x];
                    if with_y {
                        inputs.push(y);
                    }
                    if op == NnOp::BatchNormApply {
                        inputs.push(coef);
                    }
                    if gated {
                        inputs.push(gate);
                    }
                    // The sums are centred in half the cases (the ReLU bit decides: apply's own).
                    let centred = relu && op == NnOp::BatchNormStats;
                    if centred {
                        inputs.push(centre);
                    }
                    Case {
                        relu: relu && op == NnOp::BatchNormApply,
                        gate: gated,
                        operands: u8::from(centred),
                        ..make(inputs, vec![])
                    }
                },
            )
            .boxed(),
        // Sums [2, C] (any sign: a negative variance is clamped to 0), then [C] weight, bias,
        // running mean and (positive) running variance, and the centre the sums were taken
        // about, each used or not.
        NnOp::BatchNormCoef => (1usize..=5, 0u8..32)
            .prop_flat_map(move |(c, operands)| {
                let sd = stats_dtype(dtype);
                let channel = move |domain, salt| input(vec![c], sd, domain, salt);
                (
                    input(vec![2, c], sd, Domain::Any, 0),
                    (channel(Domain::Any, 1), channel(Domain::Any, 2)),
                    (channel(Domain::Any, 3), channel(Domain::Positive, 4)),
                    (channel(Domain::Any, 5), Just(operands)),
                )
            })
            .prop_map(move |(sums, (w, b), (m, v), (k, operands))| Case {
                operands,
                ..make(vec![sums, w, b, m, v, k], vec![])
            })
            .boxed(),
        // Sums [2, C] [Σg; Σ(x − mean)·g], the forward's [mean; rstd] (rstd > 0), a weight or
        // not.
        NnOp::BatchNormGradCoef => (1usize..=5, 0u8..2)
            .prop_flat_map(move |(c, operands)| {
                let sd = stats_dtype(dtype);
                (
                    input(vec![2, c], sd, Domain::Any, 0),
                    input(vec![2, c], sd, Domain::Positive, 1),
                    input(vec![c], sd, Domain::Any, 2),
                    Just(operands),
                )
            })
            .prop_map(move |(sums, saved, w, operands)| Case {
                operands,
                ..make(vec![sums, saved, w], vec![])
            })
            .boxed(),
        // x [N ≥ 2, C, ..] (≥ 2 elements a channel; the variance stays well conditioned in
        // f32 whatever the summation order or FMA contraction: distinct values where a channel
        // has few, where two could otherwise nearly tie, and values in [-2, 2] where it has 8
        // or more, whose mean a distinct ramp of thousands would swamp), then [C] weight, bias,
        // running mean and (positive) running variance, each used or not.
        NnOp::BatchNormStatsCoef => (norm_activation(), 0u8..16)
            .prop_flat_map(move |((mut s, view), operands)| {
                s[0] = s[0].max(2);
                let per_channel = s.iter().product::<usize>() / s[1];
                let domain = match per_channel < 8 {
                    true => Domain::Distinct,
                    false => Domain::Any,
                };
                let channel = |domain, salt| input(vec![s[1]], stats_dtype(dtype), domain, salt);
                (
                    viewed(s.clone(), view, dtype, domain, 0),
                    (channel(Domain::Any, 1), channel(Domain::Any, 2)),
                    (channel(Domain::Any, 3), channel(Domain::Positive, 4)),
                    Just(operands),
                )
            })
            .prop_map(move |(x, (w, b), (m, v), operands)| Case {
                operands,
                ..make(vec![x, w, b, m, v], vec![])
            })
            .boxed(),
        // x [N, C, ..] and its gradient (mostly in one view, as in a network), the forward's
        // [mean; rstd] (rstd > 0), a [C] weight used or not, and optionally a [2, C] gate on
        // the gradient.
        NnOp::BatchNormGradStatsCoef => (norm_operands(dtype), 0u8..2, proptest::bool::ANY)
            .prop_flat_map(move |((x, g), operands, gated)| {
                let (sd, c) = (stats_dtype(dtype), x.shape[1]);
                (
                    (Just(x), Just(g)),
                    (
                        input(vec![2, c], sd, Domain::Positive, 2),
                        input(vec![c], sd, Domain::Any, 3),
                        input(vec![2, c], sd, Domain::Any, 4),
                    ),
                    Just((operands, gated)),
                )
            })
            .prop_map(move |((x, g), (saved, w, gate), (operands, gated))| {
                let mut inputs = vec![x, g, saved, w];
                if gated {
                    inputs.push(gate);
                }
                Case {
                    operands,
                    gate: gated,
                    ..make(inputs, vec![])
                }
            })
            .boxed(),
        NnOp::CrossEntropy => (1usize..=4, 1usize..=6)
            .prop_flat_map(move |(n, c)| (input(vec![n, c], dtype, Domain::Any, 0), targets(n, c)))
            .prop_map(move |(x, t)| make(vec![x, t], vec![]))
            .boxed(),
        NnOp::NormalizeInput => (1usize..=2, 1usize..=4, 1usize..=4)
            .prop_flat_map(move |(n, h, w)| input(vec![n, h, w, 3], DType::U8, Domain::Byte, 0))
            .prop_map(move |x| make(vec![x], vec![]))
            .boxed(),
    }
}

fn optim_case(op: OptimOp, dtype: DType) -> BoxedStrategy<Case> {
    let make = move |inputs: Vec<Input>| Case::new(Op::Optim(op), dtype, inputs, vec![]);
    let domains: &[Domain] = match op {
        OptimOp::Sgd => &[Domain::Any, Domain::Any, Domain::Any],
        OptimOp::AdamW => &[Domain::Any, Domain::Any, Domain::Any, Domain::Positive],
        OptimOp::UnscaleCheck => &[Domain::Any],
        OptimOp::ScalerUpdate => &[Domain::Any],
        OptimOp::SumSquares => &[Domain::Any, Domain::Any, Domain::Any],
    };
    let domains = domains.to_vec();
    shape(1..=2)
        .prop_flat_map(move |s| {
            domains
                .iter()
                .enumerate()
                .map(|(i, &d)| input(s.clone(), dtype, d, i as u32 % 2))
                .collect::<Vec<_>>()
        })
        .prop_map(make)
        .boxed()
}
