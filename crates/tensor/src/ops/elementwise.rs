//! Elementwise ops: unary, binary with broadcasting, comparisons, `where`.

use crate::backend::{BinaryOp, Op, OtherOp, UnaryOp, View};
use crate::dtype::DType;
use crate::error::{Result, TensorError};
use crate::layout::{broadcast_shapes, Layout};
use crate::tensor::Tensor;

impl Tensor {
    /// `op(self)` elementwise.
    pub fn unary(&self, op: UnaryOp) -> Result<Tensor> {
        self.device().check(Op::Unary(op), self.dtype())?;
        let out = self.layout().output_like();
        let storage = self.backend().unary(op, self.view(), &out)?;
        let y = Tensor::from_storage(storage, out, self.device().clone());
        let (x, yd) = (self.detach(), y.detach());
        Ok(y.record(op.name(), &[self], move |g| {
            Ok(vec![Some(unary_grad(op, &x, &yd, g)?)])
        }))
    }

    pub fn neg(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Neg)
    }
    pub fn exp(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Exp)
    }
    pub fn log(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Log)
    }
    pub fn sqrt(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Sqrt)
    }
    pub fn rsqrt(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Rsqrt)
    }
    pub fn relu(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Relu)
    }
    pub fn gelu(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Gelu)
    }
    pub fn sigmoid(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Sigmoid)
    }
    pub fn tanh(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Tanh)
    }

    /// `op(self, other)` elementwise with NumPy broadcasting. Both operands must share dtype and
    /// device; comparisons return u8 (0/1) and carry no gradient.
    pub fn binary(&self, op: BinaryOp, other: &Tensor) -> Result<Tensor> {
        self.same_device(other, op.name())?;
        self.same_dtype(other, op.name())?;
        self.device().check(Op::Binary(op), self.dtype())?;
        let shape = broadcast_shapes(self.shape(), other.shape())?;
        let (la, lb) = (
            self.layout().broadcast_to(&shape)?,
            other.layout().broadcast_to(&shape)?,
        );
        let out = output_layout(&shape, &[self, other]);
        let a = View {
            storage: self.storage(),
            layout: &la,
        };
        let b = View {
            storage: other.storage(),
            layout: &lb,
        };
        let storage = self.backend().binary(op, a, b, &out)?;
        let y = Tensor::from_storage(storage, out, self.device().clone());
        if op.is_comparison() {
            return Ok(y);
        }
        let (a, b, yd) = (self.detach(), other.detach(), y.detach());
        Ok(y.record(op.name(), &[self, other], move |g| {
            let (ga, gb) = binary_grad(op, &a, &b, &yd, g)?;
            Ok(vec![
                Some(ga.sum_to(a.shape())?),
                Some(gb.sum_to(b.shape())?),
            ])
        }))
    }

    pub fn add(&self, other: &Tensor) -> Result<Tensor> {
        self.binary(BinaryOp::Add, other)
    }
    pub fn sub(&self, other: &Tensor) -> Result<Tensor> {
        self.binary(BinaryOp::Sub, other)
    }
    pub fn mul(&self, other: &Tensor) -> Result<Tensor> {
        self.binary(BinaryOp::Mul, other)
    }
    pub fn div(&self, other: &Tensor) -> Result<Tensor> {
        self.binary(BinaryOp::Div, other)
    }
    pub fn pow(&self, other: &Tensor) -> Result<Tensor> {
        self.binary(BinaryOp::Pow, other)
    }
    pub fn maximum(&self, other: &Tensor) -> Result<Tensor> {
        self.binary(BinaryOp::Maximum, other)
    }
    pub fn minimum(&self, other: &Tensor) -> Result<Tensor> {
        self.binary(BinaryOp::Minimum, other)
    }
    pub fn eq(&self, other: &Tensor) -> Result<Tensor> {
        self.binary(BinaryOp::Eq, other)
    }
    pub fn ne(&self, other: &Tensor) -> Result<Tensor> {
        self.binary(BinaryOp::Ne, other)
    }
    pub fn lt(&self, other: &Tensor) -> Result<Tensor> {
        self.binary(BinaryOp::Lt, other)
    }
    pub fn le(&self, other: &Tensor) -> Result<Tensor> {
        self.binary(BinaryOp::Le, other)
    }
    pub fn gt(&self, other: &Tensor) -> Result<Tensor> {
        self.binary(BinaryOp::Gt, other)
    }
    pub fn ge(&self, other: &Tensor) -> Result<Tensor> {
        self.binary(BinaryOp::Ge, other)
    }

    /// `self + v` with `v` a scalar of this tensor's dtype.
    pub fn add_scalar(&self, v: f64) -> Result<Tensor> {
        self.add(&self.scalar_like(v)?)
    }
    /// `self * v` with `v` a scalar of this tensor's dtype.
    pub fn mul_scalar(&self, v: f64) -> Result<Tensor> {
        self.mul(&self.scalar_like(v)?)
    }
    /// `self ^ v` with `v` a scalar.
    pub fn pow_scalar(&self, v: f64) -> Result<Tensor> {
        self.pow(&self.scalar_like(v)?)
    }
    /// `self > v` as u8.
    pub fn gt_scalar(&self, v: f64) -> Result<Tensor> {
        self.gt(&self.scalar_like(v)?)
    }

    /// `cond ? a : b` elementwise with broadcasting; `cond` is u8 (as comparisons return).
    pub fn where_(cond: &Tensor, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        a.same_device(b, "where")?;
        a.same_device(cond, "where")?;
        a.same_dtype(b, "where")?;
        if cond.dtype() != DType::U8 {
            return Err(TensorError::dtype(format!(
                "where: the condition must be u8 (as comparisons return), got {}",
                cond.dtype()
            )));
        }
        a.device().check(Op::Other(OtherOp::Select), a.dtype())?;
        let shape = broadcast_shapes(&broadcast_shapes(cond.shape(), a.shape())?, b.shape())?;
        let layouts = [cond, a, b].map(|t| t.layout().broadcast_to(&shape));
        let [lc, la, lb] = layouts;
        let (lc, la, lb) = (lc?, la?, lb?);
        let out = output_layout(&shape, &[a, b]);
        let storage = a.backend().select(
            View {
                storage: cond.storage(),
                layout: &lc,
            },
            View {
                storage: a.storage(),
                layout: &la,
            },
            View {
                storage: b.storage(),
                layout: &lb,
            },
            &out,
        )?;
        let y = Tensor::from_storage(storage, out, a.device().clone());
        let (c, ad, bd) = (cond.detach(), a.detach(), b.detach());
        Ok(y.record("where", &[a, b], move |g| {
            let zero = g.scalar_like(0.0)?;
            Ok(vec![
                Some(Tensor::where_(&c, g, &zero)?.sum_to(ad.shape())?),
                Some(Tensor::where_(&c, &zero, g)?.sum_to(bd.shape())?),
            ])
        }))
    }
}

/// The dense output layout of an elementwise op: the memory order of the first operand that
/// already has the full shape and is dense (channels-last in, channels-last out), else row-major.
fn output_layout(shape: &[usize], operands: &[&Tensor]) -> Layout {
    operands
        .iter()
        .find(|t| t.shape() == shape && t.layout().is_dense())
        .map_or_else(|| Layout::contiguous(shape), |t| t.layout().output_like())
}

fn unary_grad(op: UnaryOp, x: &Tensor, y: &Tensor, g: &Tensor) -> Result<Tensor> {
    match op {
        UnaryOp::Neg => g.neg(),
        UnaryOp::Exp => g.mul(y),
        UnaryOp::Log => g.div(x),
        UnaryOp::Sqrt => g.div(&y.mul_scalar(2.0)?),
        UnaryOp::Rsqrt => g.mul(&y.mul(y)?.mul(y)?.mul_scalar(-0.5)?),
        // One pass (mask, cast and select would be three, and a mask buffer).
        UnaryOp::Relu => x.binary(BinaryOp::ReluGrad, g),
        UnaryOp::Gelu => g.mul(&x.unary(UnaryOp::GeluGrad)?),
        UnaryOp::GeluGrad => Err(TensorError::Autograd(
            "gelu_grad has no backward (second derivatives of GELU are not supported)".into(),
        )),
        UnaryOp::Sigmoid => g.mul(&y.mul(&y.neg()?.add_scalar(1.0)?)?),
        UnaryOp::Tanh => g.mul(&y.mul(y)?.neg()?.add_scalar(1.0)?),
    }
}

fn binary_grad(
    op: BinaryOp,
    a: &Tensor,
    b: &Tensor,
    y: &Tensor,
    g: &Tensor,
) -> Result<(Tensor, Tensor)> {
    let mask = |m: Tensor| m.cast(g.dtype());
    Ok(match op {
        BinaryOp::Add => (g.clone(), g.clone()),
        BinaryOp::Sub => (g.clone(), g.neg()?),
        BinaryOp::Mul => (g.mul(b)?, g.mul(a)?),
        BinaryOp::Div => (g.div(b)?, g.mul(a)?.div(&b.mul(b)?)?.neg()?),
        BinaryOp::Pow => (
            g.mul(b)?.mul(&a.pow(&b.add_scalar(-1.0)?)?)?,
            g.mul(y)?.mul(&a.log()?)?,
        ),
        BinaryOp::Maximum => (g.mul(&mask(a.ge(b)?)?)?, g.mul(&mask(a.lt(b)?)?)?),
        BinaryOp::Minimum => (g.mul(&mask(a.le(b)?)?)?, g.mul(&mask(a.gt(b)?)?)?),
        BinaryOp::ReluGrad => {
            return Err(TensorError::Autograd(
                "relu_grad has no backward (second derivatives of ReLU are not supported)".into(),
            ))
        }
        _ => unreachable!("comparisons are not recorded"),
    })
}

/// The reference kernels: f64 math, then rounding to the output dtype by the caller.
pub(crate) mod reference {
    use crate::backend::{BinaryOp, UnaryOp};

    pub fn unary(op: UnaryOp, x: f64) -> f64 {
        match op {
            UnaryOp::Neg => -x,
            UnaryOp::Exp => x.exp(),
            UnaryOp::Log => x.ln(),
            UnaryOp::Sqrt => x.sqrt(),
            UnaryOp::Rsqrt => 1.0 / x.sqrt(),
            UnaryOp::Relu => x.max(0.0),
            UnaryOp::Gelu => 0.5 * x * (1.0 + erf(x / std::f64::consts::SQRT_2)),
            UnaryOp::GeluGrad => {
                let cdf = 0.5 * (1.0 + erf(x / std::f64::consts::SQRT_2));
                let pdf = (-0.5 * x * x).exp() / (2.0 * std::f64::consts::PI).sqrt();
                cdf + x * pdf
            }
            UnaryOp::Sigmoid => 1.0 / (1.0 + (-x).exp()),
            UnaryOp::Tanh => x.tanh(),
        }
    }

    pub fn binary(op: BinaryOp, a: f64, b: f64) -> f64 {
        let truth = |c: bool| c as u8 as f64;
        match op {
            BinaryOp::ReluGrad => {
                if a > 0.0 {
                    b
                } else {
                    0.0
                }
            }
            BinaryOp::Add => a + b,
            BinaryOp::Sub => a - b,
            BinaryOp::Mul => a * b,
            BinaryOp::Div => a / b,
            BinaryOp::Pow => a.powf(b),
            BinaryOp::Maximum => {
                if a.is_nan() || b.is_nan() {
                    f64::NAN
                } else {
                    a.max(b)
                }
            }
            BinaryOp::Minimum => {
                if a.is_nan() || b.is_nan() {
                    f64::NAN
                } else {
                    a.min(b)
                }
            }
            BinaryOp::Eq => truth(a == b),
            BinaryOp::Ne => truth(a != b),
            BinaryOp::Lt => truth(a < b),
            BinaryOp::Le => truth(a <= b),
            BinaryOp::Gt => truth(a > b),
            BinaryOp::Ge => truth(a >= b),
        }
    }

    /// erf to f64 precision: `2/√π · e^{-x²} · Σ 2ⁿ x^{2n+1} / (2n+1)!!`, a series of positive
    /// terms (no cancellation); erf(±6) is ±1 in f64.
    pub fn erf(x: f64) -> f64 {
        if x.is_nan() {
            return f64::NAN;
        }
        let ax = x.abs();
        if ax >= 6.0 {
            return x.signum();
        }
        let (mut term, mut sum, mut n) = (ax, ax, 0.0);
        while term > sum * 1e-17 {
            n += 1.0;
            term *= 2.0 * ax * ax / (2.0 * n + 1.0);
            sum += term;
        }
        let value = 2.0 / std::f64::consts::PI.sqrt() * (-ax * ax).exp() * sum;
        value.min(1.0).copysign(x)
    }

    #[cfg(test)]
    mod tests {
        #[test]
        fn erf_matches_known_values() {
            for (x, want) in [
                (0.0, 0.0),
                (0.5, 0.520_499_877_813_046_5),
                (1.0, 0.842_700_792_949_714_9),
                (2.0, 0.995_322_265_018_952_7),
                (-3.0, -0.999_977_909_503_001_4),
            ] {
                assert!((super::erf(x) - want).abs() < 1e-15, "erf({x})");
            }
        }
    }
}
