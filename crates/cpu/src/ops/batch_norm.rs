//! Batch norm's two fused passes: per-channel sums, and the per-channel affine map.
//!
//! Both walk the data in its memory order with a third "operand" that maps every element to its
//! channel (strides 0 except 1 on axis 1): on channels-last data a run is C consecutive
//! channels, so the sums accumulate into a contiguous `[2, C]` and the map is vectorised.

use redline_tensor::{batch_norm_shift, stats_dtype, Layout};

use crate::buffer::{as_compute, from_compute, overwritten, with_compute, Data, Elem, Real};
use crate::parallel::{self, Disjoint};
use crate::strided::Plan;

/// Channels-last f32 pixels summed in f32 before their sums join the f64 ones (a bound on the
/// f32 rounding: eight terms).
const PIXELS_PER_FLUSH: usize = 8;
/// Elements of the walk per chunk (fixed: the sums' bits never depend on the thread count).
const CHUNK: usize = 1 << 15;

/// A layout of `shape` whose position is the channel (axis 1), plus `offset`.
fn channel_of(shape: &[usize], offset: usize) -> Layout {
    let mut strides = vec![0; shape.len()];
    strides[1] = 1;
    Layout::new(shape.to_vec(), strides, offset)
}

/// The gate `[a; b]` (rows of C from an offset) as two channel slices of the compute type.
fn gate_rows<C: Real>(gate: &[C], c: usize) -> (&[C], &[C]) {
    (&gate[..c], &gate[c..2 * c])
}

/// `o` where the gate is open at this element (`a·v + b > 0`, computed as [`apply`] computes
/// its value, so exactly where a ReLU after it passed), else 0 (NaN closes it).
#[inline(always)]
fn gated<C: Real>(a: C, b: C, v: C, o: C) -> C {
    if a * v + b > C::ZERO {
        o
    } else {
        C::ZERO
    }
}

/// An element's two summands' factors in f64: `x − k` and y (or `x − k` again without y).
#[inline(always)]
fn centred<C: Real>(v: C, o: C, k: C, has_y: bool) -> (f64, f64) {
    let v = v.to_f64() - k.to_f64();
    (v, if has_y { o.to_f64() } else { v })
}

/// `[Σx, Σx²]` or `[Σy, Σx·y]` per channel, in f64, as the stats dtype; with `gate` (its data
/// and offset: `[a; b]`) y counts only where `a·x + b > 0`; with `centre` (its data and offset:
/// `[k]`) the sums read `x − k[c]` where they read x (the gate still reads x).
pub(crate) fn stats(
    x: &Data,
    xl: &Layout,
    y: Option<(&Data, &Layout)>,
    gate: Option<(&Data, usize)>,
    centre: Option<(&Data, usize)>,
) -> Data {
    let shape = xl.shape();
    let c = shape[1];
    let chan = channel_of(shape, 0);
    let yl = y.map_or(xl, |(_, l)| l);
    let sums = with_compute!(x.dtype(), C => {
        let xs = as_compute::<C>(x);
        let ys = y.map(|(d, _)| as_compute::<C>(d));
        let other: &[C] = ys.as_deref().unwrap_or(&xs);
        let gate_data = gate.map(|(d, offset)| (as_compute::<C>(d), offset));
        let gate = gate_data.as_ref().map(|(d, offset)| gate_rows(&d[*offset..], c));
        // Zero without a centre: one subtraction an element instead of a second set of loops.
        let centre: Vec<C> = match centre {
            Some((d, offset)) => as_compute::<C>(d)[offset..offset + c]
                .iter()
                .map(|&k| C::c(batch_norm_shift(k.to_f64())))
                .collect(),
            None => vec![C::ZERO; c],
        };
        let has_y = ys.is_some();
        let plan = Plan::new([xl, yl, &chan]);
        let n = plan.numel();
        let inner = plan.inner();
        let chunks = n.div_ceil(CHUNK).max(1);
        let mut partials = vec![0.0f64; chunks * 2 * c];
        let slots = Disjoint::new(&mut partials);
        parallel::for_parts(chunks, parallel::parts_for(chunks, 1), |_, range| {
            for chunk in range {
                // SAFETY: each chunk owns its partial sums.
                let acc = unsafe { slots.slice(chunk * 2 * c..(chunk + 1) * 2 * c) };
                let (first, second) = acc.split_at_mut(c);
                // f32 data, channels-last: up to PIXELS_PER_FLUSH pixels summed in f32 (8 lanes
                // a vector, no conversions), then added to the f64 sums.
                let (mut f32_first, mut f32_second) = (vec![0.0f32; c], vec![0.0f32; c]);
                let mut pending = 0;
                let flush = |first: &mut [f64], second: &mut [f64], f: &mut [f32], s: &mut [f32]| {
                    for (acc, v) in first.iter_mut().zip(f.iter_mut()) {
                        *acc += f64::from(std::mem::take(v));
                    }
                    for (acc, v) in second.iter_mut().zip(s.iter_mut()) {
                        *acc += f64::from(std::mem::take(v));
                    }
                };
                plan.runs(parallel::part_range(n, chunks, chunk), |pos, len| {
                    let xr = &xs[pos[0]..];
                    let or = &other[pos[1]..];
                    match inner {
                        // Channels-last: a run is consecutive channels (vectorised).
                        [1, 1, 1] => {
                            let k = pos[2]..pos[2] + len;
                            let f32s = (C::as_f32(&xr[..len]), C::as_f32(&or[..len]), C::as_f32(&centre[k.clone()]));
                            if let (Some(xv), Some(ov), Some(kv)) = f32s {
                                let sums = f32_first[k.clone()].iter_mut().zip(&mut f32_second[k.clone()]);
                                let gate_f32 = gate.map(|(a, b)| (C::as_f32(&a[k.clone()]), C::as_f32(&b[k.clone()])));
                                if let Some((Some(ga), Some(gb))) = gate_f32 {
                                    let gates = ga.iter().zip(gb);
                                    for (((f, s), ((&v, &o), &m)), (&a, &b)) in sums.zip(xv.iter().zip(ov).zip(kv)).zip(gates) {
                                        let o = gated(a, b, v, o);
                                        *f += o;
                                        *s += (v - m) * o;
                                    }
                                } else {
                                    for ((f, s), ((&v, &o), &m)) in sums.zip(xv.iter().zip(ov).zip(kv)) {
                                        let v = v - m;
                                        let o = if has_y { o } else { v };
                                        *f += o;
                                        *s += v * o;
                                    }
                                }
                                pending += 1;
                                if pending == PIXELS_PER_FLUSH {
                                    flush(first, second, &mut f32_first, &mut f32_second);
                                    pending = 0;
                                }
                                return;
                            }
                            let sums = first[k.clone()].iter_mut().zip(&mut second[k.clone()]);
                            for (j, ((f, s), (&v, &o))) in sums.zip(xr.iter().zip(or).take(len)).enumerate() {
                                let o = gate.map_or(o, |(a, b)| gated(a[k.start + j], b[k.start + j], v, o));
                                let (v, o) = centred(v, o, centre[k.start + j], has_y);
                                *f += o;
                                *s += v * o;
                            }
                        }
                        // NCHW: a run is one channel's pixels; eight lanes of partial sums.
                        [1, 1, 0] => {
                            let (mut f, mut s) = ([0.0f64; 8], [0.0f64; 8]);
                            let (xc, oc) = (xr[..len].chunks_exact(8), or[..len].chunks_exact(8));
                            let (xt, ot) = (xc.remainder(), oc.remainder());
                            let ch = pos[2];
                            let gate_at = |v: C, o: C| gate.map_or(o, |(a, b)| gated(a[ch], b[ch], v, o));
                            for (xv, ov) in xc.zip(oc) {
                                for l in 0..8 {
                                    let o = gate_at(xv[l], ov[l]);
                                    let (v, o) = centred(xv[l], o, centre[ch], has_y);
                                    f[l] += o;
                                    s[l] += v * o;
                                }
                            }
                            for (&v, &o) in xt.iter().zip(ot) {
                                let o = gate_at(v, o);
                                let (v, o) = centred(v, o, centre[ch], has_y);
                                f[0] += o;
                                s[0] += v * o;
                            }
                            first[pos[2]] += f.iter().sum::<f64>();
                            second[pos[2]] += s.iter().sum::<f64>();
                        }
                        _ => {
                            for j in 0..len {
                                let k = pos[2] + j * inner[2];
                                let v = xs[pos[0] + j * inner[0]];
                                let o = other[pos[1] + j * inner[1]];
                                let o = gate.map_or(o, |(a, b)| gated(a[k], b[k], v, o));
                                let (v, o) = centred(v, o, centre[k], has_y);
                                first[k] += o;
                                second[k] += v * o;
                            }
                        }
                    }
                });
                flush(first, second, &mut f32_first, &mut f32_second);
            }
        });
        // Chunks combined in order.
        let mut sums = vec![0.0f64; 2 * c];
        for part in partials.chunks(2 * c) {
            for (s, &p) in sums.iter_mut().zip(part) {
                *s += p;
            }
        }
        sums
    });
    from_compute(stats_dtype(x.dtype()), sums)
}

/// `a[c]·x + b[c] (+ d[c]·y)` in the dense layout `out`, with `coef = [a; b; d]` (rows of C
/// from `coef_offset`); with `gate` (its data and offset) y counts only where the gate's
/// `a·x + b > 0`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn apply(
    x: &Data,
    xl: &Layout,
    y: Option<(&Data, &Layout)>,
    coef: &Data,
    coef_offset: usize,
    relu: bool,
    gate: Option<(&Data, usize)>,
    out: &Layout,
) -> Data {
    let shape = xl.shape();
    let c = shape[1];
    let chan = channel_of(shape, 0);
    let yl = y.map_or(xl, |(_, l)| l);
    with_compute!(x.dtype(), C => {
        let (xs, k) = (as_compute::<C>(x), as_compute::<C>(coef));
        let ys = y.map(|(d, _)| as_compute::<C>(d));
        let (a, b) = (&k[coef_offset..coef_offset + c], &k[coef_offset + c..coef_offset + 2 * c]);
        let gate_data = gate.map(|(d, offset)| (as_compute::<C>(d), offset));
        let gate = gate_data.as_ref().map(|(d, offset)| gate_rows(&d[*offset..], c));
        let d = &k[coef_offset + 2 * c..coef_offset + 3 * c];
        // Without y, d·y is skipped (x stands in as a harmless second operand).
        let (other, dd): (&[C], &[C]) = match &ys {
            Some(v) => (v, d),
            None => (&xs, &[]),
        };
        let plan = Plan::new([out, xl, yl, &chan]);
        let mut values = overwritten::<C>(out.storage_extent().max(plan.numel()));
        let inner = plan.inner();
        parallel::chunks_mut(&mut values, CHUNK, |start, dst| {
            let mut at = 0;
            plan.runs(start..start + dst.len(), |pos, len| {
                let run = &mut dst[at..at + len];
                at += len;
                let (xr, or) = (&xs[pos[1]..], &other[pos[2]..]);
                match inner {
                    // Channels-last: consecutive channels, coefficient slices (vectorised).
                    [_, 1, 1, 1] => {
                        let ch = pos[3]..pos[3] + len;
                        let ab = a[ch.clone()].iter().zip(&b[ch.clone()]);
                        for ((o, &v), (&ka, &kb)) in run.iter_mut().zip(xr).zip(ab) {
                            *o = ka * v + kb;
                        }
                        if let (false, Some((ga, gb))) = (dd.is_empty(), gate) {
                            let gates = ga[ch.clone()].iter().zip(&gb[ch.clone()]);
                            let terms = or.iter().zip(xr).zip(&dd[ch]);
                            for ((o, ((&w, &v), &kd)), (&ga, &gb)) in run.iter_mut().zip(terms).zip(gates) {
                                *o += kd * gated(ga, gb, v, w);
                            }
                        } else if !dd.is_empty() {
                            for ((o, &w), &kd) in run.iter_mut().zip(or).zip(&dd[ch]) {
                                *o += kd * w;
                            }
                        }
                    }
                    // NCHW: one channel's pixels, scalar coefficients.
                    [_, 1, 1, 0] => {
                        let (ka, kb) = (a[pos[3]], b[pos[3]]);
                        for (o, &v) in run.iter_mut().zip(xr) {
                            *o = ka * v + kb;
                        }
                        if let Some(&kd) = dd.get(pos[3]) {
                            let gate_at = |v: C, w: C| gate.map_or(w, |(a, b)| gated(a[pos[3]], b[pos[3]], v, w));
                            for ((o, &w), &v) in run.iter_mut().zip(or).zip(xr) {
                                *o += kd * gate_at(v, w);
                            }
                        }
                    }
                    _ => {
                        for (j, o) in run.iter_mut().enumerate() {
                            let ch = pos[3] + j * inner[3];
                            let v = xr[j * inner[1]];
                            *o = a[ch] * v + b[ch];
                            if let Some(&kd) = dd.get(ch) {
                                let w = or[j * inner[2]];
                                *o += kd * gate.map_or(w, |(a, b)| gated(a[ch], b[ch], v, w));
                            }
                        }
                    }
                }
                if relu {
                    // In the same pass, while the run is in L1; as the ReLU op (NaN → 0).
                    for o in run.iter_mut() {
                        *o = if *o > C::ZERO { *o } else { C::ZERO };
                    }
                }
            });
        });
        from_compute(x.dtype(), values)
    })
}
