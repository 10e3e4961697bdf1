//! Gradcheck: the reference's backward against central finite differences, in f64.

use redline_tensor::{no_grad, DType, Device, Result, Tensor};

use crate::case::{Case, Input};

/// Fixed weights for the scalar loss `sum(y * w)`, so every output element matters differently.
pub fn loss_weights(y: &Tensor) -> Result<Tensor> {
    // Encoded on the host in y's dtype: the device may not hold f64 at all.
    let dtype = y.dtype();
    let mut bytes = vec![0u8; y.numel() * dtype.size()];
    for i in 0..y.numel() {
        dtype.write(&mut bytes, i, 0.5 + 0.125 * (i % 7) as f64);
    }
    Tensor::from_bytes(bytes, dtype, y.shape(), y.device())
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
    if case.dtype != DType::F64 || !case.differentiable() {
        return Err(format!(
            "gradcheck needs a differentiable f64 case, got {case:?}"
        ));
    }
    gradcheck_fn(case.op.name(), &case.inputs, &case.grad_inputs(), |x| {
        case.apply(x)
    })
}

/// Gradcheck of any function of tensors (composite ops: cross-entropy, norms, embedding):
/// the gradients of `sum(f(inputs) * w)` with respect to `grad_inputs` by backward, against
/// central differences, on the reference device in f64.
pub fn gradcheck_fn(
    name: &str,
    inputs: &[Input],
    grad_inputs: &[usize],
    f: impl Fn(&[Tensor]) -> Result<Tensor>,
) -> std::result::Result<(), String> {
    let fail = |e: redline_tensor::TensorError| format!("{name}: {e}");
    let dev = Device::reference();
    let loss_of = |x: &[Tensor]| -> Result<Tensor> {
        let y = f(x)?;
        let w = loss_weights(&y)?;
        y.mul(&w)?.sum(&[], false)
    };
    let built: Vec<(Tensor, Tensor)> = inputs
        .iter()
        .enumerate()
        .map(|(i, input)| input.build_leaf(&dev, grad_inputs.contains(&i)))
        .collect::<Result<_>>()
        .map_err(fail)?;
    let views: Vec<Tensor> = built.iter().map(|(_, v)| v.clone()).collect();
    loss_of(&views).map_err(fail)?.backward().map_err(fail)?;

    let h = 1e-6;
    for &i in grad_inputs {
        let analytic = built[i]
            .0
            .grad()
            .ok_or_else(|| format!("{name}: input {i} got no gradient"))?
            .to_f64_vec()
            .map_err(fail)?;
        for (e, &a) in analytic.iter().enumerate() {
            let at = |delta: f64| -> std::result::Result<f64, String> {
                let mut perturbed = inputs.to_vec();
                perturbed[i].values[e] += delta;
                let x: Vec<Tensor> = perturbed
                    .iter()
                    .map(|input| input.build(&dev))
                    .collect::<Result<_>>()
                    .map_err(fail)?;
                no_grad(|| loss_of(&x)?.item()).map_err(fail)
            };
            let numeric = (at(h)? - at(-h)?) / (2.0 * h);
            if (a - numeric).abs() > 1e-5 * (1.0 + numeric.abs()) {
                return Err(format!(
                    "{name}: d loss / d input{i}[{e}] is {a} by backward but {numeric} by finite differences"
                ));
            }
        }
    }
    Ok(())
}
