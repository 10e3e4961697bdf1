//! The scale a per-channel sum is compared at when its terms cancel.
//!
//! A backend accumulates batch norm's sums in f32 (the contract's "at least f32"), in an order
//! of its own. Summing n terms of either sign moves the result by some ulps of the terms'
//! partial sums — about u·√n·‖t‖₂ for random signs (u = 2⁻²⁴), whatever the result — so a
//! sum whose terms cancel to a thousandth of their 2-norm has no 1e-4 of its own value to
//! give: a soak of the CPU backend (seed 44, 2,000 cases) found dw = rstd·Σ(x − mean)·g at
//! −0.013284 against the f64 −0.013270, its terms' magnitudes summing to 3,252. Such an output
//! is compared at the 2-norm of its terms instead of its value when that is larger: for a
//! sum without cancellation, |Σt| ≥ ‖t‖₂ and nothing changes; a dropped or doubled term
//! still moves it by far more.

use redline_tensor::{Device, NnOp, Op};

use crate::case::Case;

/// Per output element of `case`, the 2-norm of the terms it sums, carried through the
/// per-channel math after the sums — for the ops whose outputs are channel sums
/// (`batch_norm_stats`, `batch_norm_grad_stats_coef`); None for every other op.
pub(crate) fn term_scales(case: &Case, reference: &Device) -> Result<Option<Vec<f64>>, String> {
    let op = match case.op {
        Op::Nn(op @ (NnOp::BatchNormStats | NnOp::BatchNormGradStatsCoef)) => op,
        _ => return Ok(None),
    };
    let values = |i: usize| -> Result<Vec<f64>, String> {
        let (_, view) = case.inputs[i]
            .build_leaf(reference, false)
            .map_err(|e| e.to_string())?;
        view.to_f64_vec().map_err(|e| e.to_string())
    };
    let shape = &case.inputs[0].shape;
    let c = shape[1];
    let inner: usize = shape[2..].iter().product::<usize>().max(1);
    let x = values(0)?;
    let channel = |i: usize| (i / inner) % c;
    // ‖other‖₂ and ‖(x − k)·other‖₂ per channel (a gate ignored: it only drops terms).
    let norms = |other: &[f64], k: &[f64]| -> (Vec<f64>, Vec<f64>) {
        let (mut first, mut second) = (vec![0.0; c], vec![0.0; c]);
        for (i, (&xv, &o)) in x.iter().zip(other).enumerate() {
            let ch = channel(i);
            first[ch] += o * o;
            second[ch] += ((xv - k[ch]) * o).powi(2);
        }
        let root = |v: Vec<f64>| v.into_iter().map(f64::sqrt).collect();
        (root(first), root(second))
    };
    let scales = match op {
        NnOp::BatchNormStats => {
            let has_y = case.inputs.get(1).is_some_and(|y| &y.shape == shape);
            let k = match case.operands & 1 != 0 {
                true => values(case.inputs.len() - 1)?,
                false => vec![0.0; c],
            };
            let other = match has_y {
                true => values(1)?,
                false => x
                    .iter()
                    .enumerate()
                    .map(|(i, v)| v - k[channel(i)])
                    .collect(),
            };
            let (first, second) = norms(&other, &k);
            [first, second].concat()
        }
        _ => {
            // x, g, saved [mean; rstd], weight (used with operands bit 0), the gate.
            let (g, saved) = (values(1)?, values(2)?);
            let weight = match case.operands & 1 != 0 {
                true => values(3)?,
                false => vec![1.0; c],
            };
            let (mean, rstd) = saved.split_at(c);
            let (norm_g, norm_centred) = norms(&g, mean);
            let n = (x.len() / c.max(1)) as f64;
            let mut out = vec![0.0; 5 * c];
            for ch in 0..c {
                let rw = (rstd[ch] * weight[ch]).abs();
                let k0 = rw * rstd[ch] * rstd[ch] * norm_centred[ch] / n;
                out[ch] = k0;
                out[c + ch] = rw * norm_g[ch] / n + mean[ch].abs() * k0;
                out[3 * c + ch] = rstd[ch].abs() * norm_centred[ch];
                out[4 * c + ch] = norm_g[ch];
            }
            out
        }
    };
    Ok(Some(scales))
}

#[cfg(test)]
mod tests {
    use redline_tensor::{DType, Device, NnOp, Op};

    use super::term_scales;
    use crate::case::{Case, Input, ViewKind};
    use crate::conformance::close_at;

    fn sums_case(values: Vec<f64>) -> Case {
        let x = Input {
            shape: vec![1, 1, 1, values.len()],
            values,
            dtype: DType::F32,
            view: ViewKind::Plain,
        };
        Case::new(Op::Nn(NnOp::BatchNormStats), DType::F32, vec![x], vec![])
    }

    #[test]
    fn a_sums_scale_is_its_terms_two_norm() {
        let case = sums_case(vec![3.0, -3.0, 4.0, -4.0]);
        let scales = term_scales(&case, &Device::reference()).unwrap().unwrap();
        // Σx's terms are x, Σx²'s are x².
        assert_eq!(scales, [50f64.sqrt(), 674f64.sqrt()]);
        let other = Case::new(Op::Nn(NnOp::Softmax), DType::F32, case.inputs, vec![3]);
        assert_eq!(term_scales(&other, &Device::reference()).unwrap(), None);
    }

    #[test]
    fn a_cancelled_sum_is_compared_at_its_terms_scale_and_a_dropped_term_still_fails() {
        // Terms of 2-norm 5 that cancel to 0.001: an error of 2e-4 is 20% of the value but
        // 4e-5 of the terms.
        let (want, scale) = (0.001, [5.0]);
        let got = want + 2e-4;
        assert!(close_at(&[got], &[want], DType::F32, "sum", None).is_err());
        close_at(&[got], &[want], DType::F32, "sum", Some(&scale)).unwrap();
        // A term of 3 left out is not rounding.
        let err = close_at(&[want - 3.0], &[want], DType::F32, "sum", Some(&scale)).unwrap_err();
        assert!(err.contains("of its terms' 2-norm 5"), "{err}");
    }
}
