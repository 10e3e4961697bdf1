//! The autocast scope: a thread-local policy, as `torch.autocast` is thread-local.

use std::cell::RefCell;
use std::collections::HashMap;

use redline_tensor::{DType, Result, Tensor, TensorError};

struct Scope {
    dtype: DType,
    /// Low-precision copies of parameters (leaves that require grad), keyed by identity and
    /// whether the copy is channels-last; kept for the scope's life, as PyTorch's autocast
    /// weight cache is.
    weights: HashMap<(usize, bool), Tensor>,
}

thread_local! {
    static SCOPES: RefCell<Vec<Scope>> = const { RefCell::new(Vec::new()) };
}

/// While alive, [`for_compute`] casts to its dtype on this thread. Dropping it ends the scope
/// and frees its weight cache (so a new step casts the updated weights again).
pub struct Autocast {
    _not_send: std::marker::PhantomData<*const ()>,
}

/// Opens an autocast scope running conv and matmul in `dtype` (f16 or bf16). Scopes nest; the
/// innermost wins.
pub fn autocast(dtype: DType) -> Result<Autocast> {
    if !matches!(dtype, DType::F16 | DType::BF16) {
        return Err(TensorError::DType(format!(
            "autocast runs in f16 or bf16, not {dtype}"
        )));
    }
    SCOPES.with(|s| {
        s.borrow_mut().push(Scope {
            dtype,
            weights: HashMap::new(),
        })
    });
    Ok(Autocast {
        _not_send: std::marker::PhantomData,
    })
}

impl Drop for Autocast {
    fn drop(&mut self) {
        SCOPES.with(|s| s.borrow_mut().pop());
    }
}

/// The compute dtype of the innermost open scope, if any.
pub fn autocast_dtype() -> Option<DType> {
    SCOPES.with(|s| s.borrow().last().map(|scope| scope.dtype))
}

/// An operand of a conv or matmul, in the scope's low precision (f32/f64 inputs only; others
/// pass through). Parameters are cast once per scope and reused.
pub fn for_compute(t: &Tensor) -> Result<Tensor> {
    low_precision(t, false)
}

/// [`for_compute`] for a conv weight beside a channels-last input: the low-precision copy is
/// stored channels-last (KRSC, what cuDNN's NHWC kernels take, as PyTorch's channels-last
/// models keep their weights), made in the same one copy as the cast. The parameter and its
/// gradient keep their own layout. Outside a scope, unchanged.
pub fn for_compute_channels_last(t: &Tensor) -> Result<Tensor> {
    low_precision(t, t.shape().len() == 4)
}

fn low_precision(t: &Tensor, channels_last: bool) -> Result<Tensor> {
    let Some(dtype) = autocast_dtype() else {
        return Ok(t.clone());
    };
    if !matches!(t.dtype(), DType::F32 | DType::F64) {
        return Ok(t.clone());
    }
    let cast = |t: &Tensor| match channels_last {
        true => t.cast_channels_last(dtype),
        false => t.cast(dtype),
    };
    if !(t.is_leaf() && t.requires_grad()) {
        return cast(t);
    }
    let key = (t.key(), channels_last);
    if let Some(hit) = SCOPES.with(|s| {
        s.borrow()
            .last()
            .and_then(|scope| scope.weights.get(&key).cloned())
    }) {
        return Ok(hit);
    }
    let low = cast(t)?;
    SCOPES.with(|s| {
        if let Some(scope) = s.borrow_mut().last_mut() {
            scope.weights.insert(key, low.clone());
        }
    });
    Ok(low)
}

/// The input of an op the policy keeps in f32 (normalisation, softmax, losses): low-precision
/// floats are cast up inside a scope; outside one, or for other dtypes, it is unchanged.
pub fn for_f32(t: &Tensor) -> Result<Tensor> {
    match (autocast_dtype(), t.dtype()) {
        (Some(_), DType::F16 | DType::BF16) => t.cast(DType::F32),
        _ => Ok(t.clone()),
    }
}
