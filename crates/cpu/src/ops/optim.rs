//! The multi-tensor optimizer and mixed-precision ops, in place. Each element applies the
//! reference's own scalar formula (`redline_tensor::scalar`), so the CPU follows PyTorch exactly
//! as the reference does; the work is memory-bound, split in fixed chunks across threads.

use std::sync::atomic::{AtomicBool, Ordering};

use redline_tensor::backend::{AdamWParams, ScalerParams, SgdParams};
use redline_tensor::scalar;

use crate::buffer::{as_compute, from_compute, with_compute, with_data, Data, Elem, Real};
use crate::parallel::{self, Disjoint};

const MIN_PER_PART: usize = 1 << 15;

/// Element 0 of a storage (a scalar: scale, step, found-inf flag).
pub(crate) fn scalar_of(data: &Data) -> f64 {
    with_data!(data, v => v.first().map_or(0.0, |x| x.to_f64()))
}

pub(crate) fn set_scalar(data: &mut Data, value: f64) {
    with_data!(data, v => {
        if let Some(x) = v.first_mut() {
            *x = Elem::from_f64(value);
        }
    })
}

/// Runs `f` on a storage's values as compute type `C`: in place when it holds `C`, else on a
/// converted copy that is written back (rounded to the storage's type).
pub(crate) fn with_values<C: Real, R>(data: &mut Data, f: impl FnOnce(&mut [C]) -> R) -> R {
    if let Some(v) = C::borrow_mut(data) {
        return f(v);
    }
    let mut v: Vec<C> = as_compute::<C>(data).into_owned();
    let r = f(&mut v);
    *data = from_compute(data.dtype(), v);
    r
}

/// Calls `f(i)` for every element index of `len`, split into parts across threads.
fn each(len: usize, f: impl Fn(std::ops::Range<usize>) + Sync) {
    parallel::for_parts(len, parallel::parts_for(len, MIN_PER_PART), |_, r| f(r));
}

/// What an optimizer step reads from its device scalars: the learning rate (times the group's
/// scale) and the applied-step count after this step.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Rate {
    pub lr: f64,
    pub step: f64,
}

/// One SGD step of one parameter (see `Backend::sgd`); `momentum` is None without momentum.
pub(crate) fn sgd(
    param: &mut Data,
    grad: &Data,
    momentum: Option<&mut Data>,
    at: Rate,
    p: &SgdParams,
) {
    let (lr, first) = (at.lr, at.step == 1.0);
    with_compute!(param.dtype(), C => {
        let g = as_compute::<C>(grad);
        with_values::<C, _>(param, |w| {
            let ws = Disjoint::new(w);
            match momentum {
                Some(buf) => with_values::<C, _>(buf, |m| {
                    let ms = Disjoint::new(m);
                    each(ws.len(), |r| {
                        // SAFETY: parts own disjoint ranges.
                        let (w, m) = unsafe { (ws.slice(r.clone()), ms.slice(r.clone())) };
                        for ((w, m), &g) in w.iter_mut().zip(m).zip(&g[r]) {
                            let (nw, nm) = scalar::sgd(w.to_f64(), g.to_f64(), m.to_f64(), lr, first, p);
                            (*w, *m) = (C::c(nw), C::c(nm));
                        }
                    });
                }),
                None => each(ws.len(), |r| {
                    // SAFETY: parts own disjoint ranges.
                    let w = unsafe { ws.slice(r.clone()) };
                    for (w, &g) in w.iter_mut().zip(&g[r]) {
                        *w = C::c(scalar::sgd(w.to_f64(), g.to_f64(), 0.0, lr, first, p).0);
                    }
                }),
            }
        })
    })
}

/// One AdamW step of one parameter at the (already incremented) step count of `at`.
pub(crate) fn adamw(
    param: &mut Data,
    grad: &Data,
    exp_avg: &mut Data,
    exp_avg_sq: &mut Data,
    at: Rate,
    p: &AdamWParams,
) {
    with_compute!(param.dtype(), C => {
        let g = as_compute::<C>(grad);
        with_values::<C, _>(param, |w| {
            with_values::<C, _>(exp_avg, |m| {
                with_values::<C, _>(exp_avg_sq, |v| {
                    let (ws, ms, vs) = (Disjoint::new(w), Disjoint::new(m), Disjoint::new(v));
                    each(ws.len(), |r| {
                        // SAFETY: parts own disjoint ranges.
                        let (w, m, v) = unsafe {
                            (ws.slice(r.clone()), ms.slice(r.clone()), vs.slice(r.clone()))
                        };
                        for (((w, m), v), &g) in w.iter_mut().zip(m).zip(v).zip(&g[r]) {
                            let (nw, nm, nv) = scalar::adamw(
                                w.to_f64(),
                                g.to_f64(),
                                m.to_f64(),
                                v.to_f64(),
                                at.step,
                                at.lr,
                                p,
                            );
                            (*w, *m, *v) = (C::c(nw), C::c(nm), C::c(nv));
                        }
                    });
                })
            })
        })
    })
}

/// `g *= inv_scale`; true when any result is inf or NaN.
pub(crate) fn unscale(grad: &mut Data, inv_scale: f64) -> bool {
    let bad = AtomicBool::new(false);
    with_compute!(grad.dtype(), C => {
        with_values::<C, _>(grad, |g| {
            let inv = C::c(inv_scale);
            let gs = Disjoint::new(g);
            each(gs.len(), |r| {
                // SAFETY: parts own disjoint ranges.
                let g = unsafe { gs.slice(r) };
                let mut finite = true;
                for x in g.iter_mut() {
                    *x *= inv;
                    finite &= x.is_finite();
                }
                if !finite {
                    bad.store(true, Ordering::Relaxed);
                }
            });
        })
    });
    bad.into_inner()
}

/// GradScaler's update (see `Backend::scaler_update`): returns (scale factor, new tracker).
pub(crate) fn scaler_step(found_inf: bool, tracker: f64, p: &ScalerParams) -> (f64, f64) {
    if found_inf {
        (p.backoff_factor, 0.0)
    } else if tracker + 1.0 >= p.growth_interval as f64 {
        (p.growth_factor, 0.0)
    } else {
        (1.0, tracker + 1.0)
    }
}
