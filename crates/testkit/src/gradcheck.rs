//! Gradcheck: the reference's backward against central finite differences, in f64.

use redline_tensor::{no_grad, DType, Device, Result, Tensor};

use crate::case::Case;

/// Fixed weights for the scalar loss `sum(y * w)`, so every output element matters differently.
pub fn loss_weights(y: &Tensor) -> Result<Tensor> {
    let w: Vec<f64> = (0..y.numel())
        .map(|i| 0.5 + 0.125 * (i % 7) as f64)
        .collect();
    Tensor::from_slice(&w, y.shape(), y.device())?.cast(y.dtype())
}

/// `sum(op(inputs) * w)` as a tensor.
pub fn loss(case: &Case, inputs: &[Tensor]) -> Result<Tensor> {
    let y = case.apply(inputs)?;
    let w = loss_weights(&y)?;
    y.mul(&w)?.sum(&[], false)
}

/// Checks the case's analytic gradients on the reference device (f64) against central
/// differences. Returns a description of the first mismatch.
pub fn gradcheck(case: &Case) -> std::result::Result<(), String> {
    let fail = |e: redline_tensor::TensorError| format!("{e}");
    if case.dtype != DType::F64 || !case.differentiable() {
        return Err(format!(
            "gradcheck needs a differentiable f64 case, got {case:?}"
        ));
    }
    let dev = Device::reference();
    let grad_inputs = case.grad_inputs();
    let built: Vec<(Tensor, Tensor)> = case
        .inputs
        .iter()
        .enumerate()
        .map(|(i, input)| input.build_leaf(&dev, grad_inputs.contains(&i)))
        .collect::<Result<_>>()
        .map_err(fail)?;
    let views: Vec<Tensor> = built.iter().map(|(_, v)| v.clone()).collect();
    loss(case, &views).map_err(fail)?.backward().map_err(fail)?;

    let h = 1e-6;
    for &i in &grad_inputs {
        let analytic = built[i]
            .0
            .grad()
            .ok_or_else(|| format!("input {i} got no gradient"))?
            .to_f64_vec()
            .map_err(fail)?;
        for (e, &a) in analytic.iter().enumerate() {
            let at = |delta: f64| -> std::result::Result<f64, String> {
                let mut perturbed = case.clone();
                perturbed.inputs[i].values[e] += delta;
                let inputs: Vec<Tensor> = perturbed
                    .inputs
                    .iter()
                    .map(|input| input.build(&dev))
                    .collect::<Result<_>>()
                    .map_err(fail)?;
                no_grad(|| loss(&perturbed, &inputs)?.item()).map_err(fail)
            };
            let numeric = (at(h)? - at(-h)?) / (2.0 * h);
            if (a - numeric).abs() > 1e-5 * (1.0 + numeric.abs()) {
                return Err(format!(
                    "{}: d loss / d input{i}[{e}] is {a} by backward but {numeric} by finite differences",
                    case.op
                ));
            }
        }
    }
    Ok(())
}
